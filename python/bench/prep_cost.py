#!/usr/bin/env python3
"""Host cost per descriptor of vLLM's NixlConnector calls, through rdma_nixl and through
NIXL's wheel.

The shape of a KV-cache pull: ``--regions`` registrations per side (layers x K/V, 64 by
default), ``--blocks`` blocks in each (1,024), one descriptor per (region, block), so both
sides prepare a list of regions x blocks descriptors (65,536) once. A request picks
``--request-blocks`` random block ids (128) and takes them in every region: 8,192
descriptor ids, handed over as a numpy int64 array (``--ids list``: a Python list); the
lists are prepared from an N x 3 numpy array (``--rows tuples``: a list of tuples).
Blocks are small (``--block-bytes``, 256 by default) so that the data moved does not
hide the per-descriptor cost. Two agents in one process, DRAM (UCX for NIXL, LIBFABRIC
for ours: shared memory on one host).

Timed, medians over ``--reps``:

- ``prep_xfer_dlist``: one list of 65,536 descriptors (local side, then remote side);
- ``make_prepped_xfer``: 8,192 ids from the prepared lists;
- ``transfer``: the post of that request;
- ``request``: ``make_prepped_xfer`` + ``transfer`` + polling ``check_xfer_state`` until
  DONE + ``release_xfer_handle`` — one request end to end, the data verified.

Without ``--impl`` each implementation runs in its own subprocess, alternating
(``--rounds`` times each), and the ratios NIXL / ours of the medians are printed (above 1:
ours is faster). NIXL's wheel may live in another interpreter: ``--nixl-python PATH``.

    python bench/prep_cost.py --nixl-python /path/to/venv/bin/python
    python bench/prep_cost.py --impl ours
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

PHASES = ("prep_local", "prep_remote", "make", "transfer", "request")


def load(impl: str):
    if impl == "ours":
        return importlib.import_module("rdma_nixl._api")
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise SystemExit("NIXL's wheel is not installed in this interpreter")


def measure(impl: str, args) -> dict:
    import logging

    import numpy as np

    logging.getLogger("nixl").setLevel(logging.WARNING)
    logging.getLogger("rdma_nixl").setLevel(logging.WARNING)
    api = load(impl)
    a = api.nixl_agent("prep-a", api.nixl_agent_config(True, backends=[]))
    b = api.nixl_agent("prep-b", api.nixl_agent_config(True, backends=[]))
    backend = "UCX" if impl == "nixl" else "LIBFABRIC"
    a.create_backend(backend, {})
    b.create_backend(backend, {})
    regions, blocks, bb = args.regions, args.blocks, args.block_bytes
    # READ pulls the remote side (dst, a pattern per region) into the local side (src).
    src = [np.zeros(blocks * bb, dtype=np.uint8) for _ in range(regions)]
    dst = [np.full(blocks * bb, r % 251 + 1, dtype=np.uint8) for r in range(regions)]
    a.register_memory([(s.ctypes.data, s.nbytes, 0, "") for s in src], "DRAM")
    b.register_memory([(d.ctypes.data, d.nbytes, 0, "") for d in dst], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())

    def rows(bufs):
        # vLLM's layout: descriptor id = region * blocks + block.
        base = np.array([x.ctypes.data for x in bufs], dtype=np.uint64)
        addr = (base[:, None] + np.arange(blocks, dtype=np.uint64)[None, :] * np.uint64(bb)).ravel()
        out = np.empty((regions * blocks, 3), dtype=np.uint64)
        out[:, 0] = addr
        out[:, 1] = bb
        out[:, 2] = 0
        return out

    local_rows, remote_rows = rows(src), rows(dst)
    if args.rows == "tuples":
        # vLLM's form: a Python list of (addr, len, dev) tuples of ints.
        local_rows = [tuple(r) for r in local_rows.tolist()]
        remote_rows = [tuple(r) for r in remote_rows.tolist()]
    rng = np.random.default_rng(7)

    def request_ids():
        picked = rng.choice(blocks, size=args.request_blocks, replace=False)
        ids = (np.arange(regions, dtype=np.int64)[:, None] * blocks + picked[None, :]).ravel()
        return ids if args.ids == "numpy" else ids.tolist()

    clock = time.perf_counter
    times = {p: [] for p in PHASES}
    local = remote = None
    for rep in range(args.reps + 1):
        for h in (local, remote):
            if h is not None:
                a.release_dlist_handle(h)
        for x in src:
            x.fill(0)
        # Let the last request's progress threads go idle: on a small machine their
        # spinning would otherwise be measured as preparation time.
        time.sleep(0.05)
        t0 = clock()
        local = a.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, "DRAM")
        t1 = clock()
        remote = a.prep_xfer_dlist("prep-b", remote_rows, "DRAM")
        t2 = clock()
        lids = request_ids()
        rids = lids
        t3 = clock()
        h = a.make_prepped_xfer("READ", local, lids, remote, rids, b"kv")
        t4 = clock()
        s = a.transfer(h)
        t5 = clock()
        while s != "DONE":
            s = a.check_xfer_state(h)
        a.release_xfer_handle(h)
        t6 = clock()
        if rep == 0:
            continue  # warm-up: connections, page faults
        times["prep_local"].append(t1 - t0)
        times["prep_remote"].append(t2 - t1)
        times["make"].append(t4 - t3)
        times["transfer"].append(t5 - t4)
        times["request"].append(t6 - t3)
    # After the last request the picked blocks of src hold their region's pattern, the
    # others are still zero.
    ids = np.asarray(lids, dtype=np.int64)
    flat = np.concatenate(src).reshape(regions * blocks, bb)
    want = (ids // blocks % 251 + 1).astype(np.uint8)
    if not (flat[ids] == want[:, None]).all():
        raise SystemExit(f"{impl}: the READ did not land")
    untouched = np.setdiff1d(np.arange(regions * blocks), ids)
    if flat[untouched].any():
        raise SystemExit(f"{impl}: the READ wrote outside its descriptors")
    return {"impl": impl, **{p: statistics.median(v) for p, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["ours", "nixl"], help="run one implementation in-process")
    ap.add_argument("--regions", type=int, default=64, help="registrations per side (layers x K/V)")
    ap.add_argument("--blocks", type=int, default=1024, help="blocks per region")
    ap.add_argument("--block-bytes", type=int, default=256)
    ap.add_argument("--request-blocks", type=int, default=128, help="blocks per request, in every region")
    ap.add_argument("--ids", choices=["numpy", "list"], default="numpy")
    ap.add_argument("--rows", choices=["numpy", "tuples"], default="numpy",
                    help="the lists prepared: an N x 3 array or a list of tuples")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nixl-python", default=sys.executable, help="interpreter with NIXL's wheel")
    ap.add_argument("--ours-python", default=sys.executable, help="interpreter with rdma_nixl")
    ap.add_argument("--json", action="store_true", help="(with --impl) print one JSON line")
    args = ap.parse_args()
    shape = (f"--regions={args.regions}", f"--blocks={args.blocks}",
             f"--block-bytes={args.block_bytes}", f"--request-blocks={args.request_blocks}",
             f"--ids={args.ids}", f"--rows={args.rows}", f"--reps={args.reps}")

    if args.impl:
        r = measure(args.impl, args)
        print(json.dumps(r) if args.json else r, flush=True)
        return

    print(f"{args.regions * args.blocks} descriptors per list, "
          f"{args.regions * args.request_blocks} ids per request ({args.ids}), lists as {args.rows}, "
          f"{args.block_bytes} B blocks; medians in ms", flush=True)
    results = {"ours": [], "nixl": []}
    for round_no in range(args.rounds):
        for impl in ("ours", "nixl"):
            python = args.ours_python if impl == "ours" else args.nixl_python
            cmd = [python, os.path.abspath(__file__), "--impl", impl, "--json", *shape]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if not line:
                sys.exit(f"{impl} failed:\n{out.stdout}\n{out.stderr}")
            r = json.loads(line[-1])
            results[impl].append(r)
            print(f"round {round_no + 1} {impl:4}: "
                  + "  ".join(f"{p} {r[p] * 1e3:8.3f}" for p in PHASES), flush=True)
    print("median over rounds (ms) and ratio NIXL / ours (>1: ours faster):")
    for p in PHASES:
        ours = statistics.median(r[p] for r in results["ours"])
        nixl = statistics.median(r[p] for r in results["nixl"])
        print(f"  {p:12} ours {ours * 1e3:9.3f}  NIXL {nixl * 1e3:9.3f}  ratio {nixl / ours:6.2f}x")


if __name__ == "__main__":
    main()
