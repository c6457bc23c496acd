#!/usr/bin/env python3
"""Where rdma_nixl's Python layers spend per request and per list, and the fast
conversions before/after, in one run.

vLLM's KV-pull shape on DRAM (two agents in one process, LIBFABRIC): ``--regions`` x
``--blocks`` descriptors per list (64 x 1,024 = 65,536) and ``--regions`` x
``--request-blocks`` ids per request (8,192). Printed, medians in microseconds:

1. per layer, one request made and released (``make_prepped_xfer`` +
   ``release_xfer_handle``) through ``_api``, through ``_agent`` (``makeXferReq`` with
   int handles) and through ``_core`` (``Agent.make_xfer_req`` on packed bytes), ids as a
   numpy int64 array and as a list; a post + poll cycle and a poll of a DONE request
   through ``_api`` and ``_core``;
2. before/after, alternating in this process: the id conversion (``_index_bytes``) and
   ``prep_xfer_dlist`` of a list of 65,536 (addr, len, dev) tuples, with the conversions
   of this tree (``_core.pack_indices`` / ``_core.pack_descs``) and with the pure-Python
   ones they replaced (kept below as ``OLD_*``), ratio before / after.

    python bench/py_layers.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from array import array
from itertools import chain


def old_index_bytes(indices) -> bytes:
    """The id conversion before this change (``_agent._index_bytes``)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(indices, np.ndarray):
        return indices.astype("<i8", copy=False).tobytes()
    packed = array("q", indices)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def old_extend_fast(self, descs) -> bool:
    """``_DList._extend_fast`` before this change: a per-element type check, then
    ``array('Q', chain.from_iterable(...))``."""
    if not isinstance(descs, (list, tuple)):
        return False
    width = self._width
    try:
        if not all(type(d) is tuple and len(d) == width for d in descs):
            return False
        words = array("Q", chain.from_iterable(d[:3] for d in descs) if width != 3
                      else chain.from_iterable(descs))
    except (TypeError, OverflowError):
        return False
    self._words.extend(words)
    self._add_meta(descs)
    self._packed = None
    return True


def median_us(fn, reps: int) -> float:
    clock = time.perf_counter
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regions", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--block-bytes", type=int, default=256)
    ap.add_argument("--request-blocks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=200, help="calls per per-request figure")
    ap.add_argument("--rounds", type=int, default=9, help="before/after alternations")
    args = ap.parse_args()

    import logging

    import numpy as np

    from rdma_nixl import _agent, _api as api, _bindings

    logging.getLogger("rdma_nixl").setLevel(logging.WARNING)
    regions, blocks, bb = args.regions, args.blocks, args.block_bytes
    a = api.nixl_agent("layers-a", api.nixl_agent_config(True, backends=[]))
    b = api.nixl_agent("layers-b", api.nixl_agent_config(True, backends=[]))
    a.create_backend("LIBFABRIC", {})
    b.create_backend("LIBFABRIC", {})
    src = [np.zeros(blocks * bb, dtype=np.uint8) for _ in range(regions)]
    dst = [np.ones(blocks * bb, dtype=np.uint8) for _ in range(regions)]
    a.register_memory([(s.ctypes.data, s.nbytes, 0, "") for s in src], "DRAM")
    b.register_memory([(d.ctypes.data, d.nbytes, 0, "") for d in dst], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    local_rows = [(s.ctypes.data + k * bb, bb, 0) for s in src for k in range(blocks)]
    remote_rows = [(d.ctypes.data + k * bb, bb, 0) for d in dst for k in range(blocks)]
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, "DRAM")
    remote = a.prep_xfer_dlist("layers-b", remote_rows, "DRAM")
    rng = np.random.default_rng(7)
    picked = rng.choice(blocks, size=args.request_blocks, replace=False)
    ids_np = (np.arange(regions, dtype=np.int64)[:, None] * blocks + picked[None, :]).ravel()
    ids_list = ids_np.tolist()
    print(f"{regions * blocks} descriptors per list, {ids_np.size} ids per request, "
          f"{bb} B blocks; medians in us", flush=True)

    low, core = a.agent, a.agent._core
    lcore, rcore = low._dlists[local._handle], low._dlists[remote._handle]
    reps = args.reps

    print("1. per layer (make + release of one request):")
    for label, ids in (("numpy", ids_np), ("list", ids_list)):
        def api_make(ids=ids):
            a.release_xfer_handle(a.make_prepped_xfer("READ", local, ids, remote, ids, b"kv"))

        def agent_make(ids=ids):
            low.releaseXferReq(low.makeXferReq(
                _bindings.NIXL_READ, local._handle, ids, remote._handle, ids, b"kv"))

        packed = _agent._index_bytes(ids)

        def core_make(packed=packed):
            core.make_xfer_req("READ", lcore, packed, rcore, packed, b"kv", None).release()

        for fn in (api_make, agent_make, core_make):
            fn()
        row = {n: median_us(f, reps) for n, f in
               (("_api", api_make), ("_agent", agent_make), ("_core", core_make))}
        print(f"   ids {label:5}: " + "  ".join(f"{k} {v:8.1f}" for k, v in row.items())
              + f"   Python above the core: {row['_api'] - row['_core']:.1f}", flush=True)

    h = a.make_prepped_xfer("READ", local, ids_np, remote, ids_np, b"kv")
    req = h._req.core

    def api_cycle():
        s = a.transfer(h)
        while s != "DONE":
            s = a.check_xfer_state(h)

    def core_cycle():
        s = req.post()
        while s != "DONE":
            s = req.status()

    api_cycle()
    cycle = {"_api": median_us(api_cycle, reps // 4), "_core": median_us(core_cycle, reps // 4)}
    done = {"_api": median_us(lambda: a.check_xfer_state(h), 20 * reps),
            "_core": median_us(req.status, 20 * reps)}
    print(f"   post + poll to DONE: _api {cycle['_api']:.1f}  _core {cycle['_core']:.1f};"
          f"  a poll of a DONE request: _api {done['_api']:.2f}  _core {done['_core']:.2f}")
    a.release_xfer_handle(h)

    print("2. before / after, alternating:")
    new_index, new_extend = _agent._index_bytes, _bindings._DList._extend_fast
    results = {k: ([], []) for k in ("ids list", "ids numpy", "prep 65,536 tuples")}
    for _ in range(args.rounds):
        for which, (index_fn, extend_fn) in enumerate(
            ((old_index_bytes, old_extend_fast), (new_index, new_extend))
        ):
            _agent._index_bytes = index_fn
            _bindings._DList._extend_fast = extend_fn
            results["ids list"][which].append(median_us(lambda: _agent._index_bytes(ids_list), 50))
            results["ids numpy"][which].append(median_us(lambda: _agent._index_bytes(ids_np), 50))

            def prep():
                a.release_dlist_handle(a.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, "DRAM"))

            results["prep 65,536 tuples"][which].append(median_us(prep, 3))
    _agent._index_bytes, _bindings._DList._extend_fast = new_index, new_extend
    for name, (before, after) in results.items():
        b_, a_ = statistics.median(before), statistics.median(after)
        print(f"   {name:19} before {b_:9.1f}  after {a_:9.1f}  ratio {b_ / a_:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
