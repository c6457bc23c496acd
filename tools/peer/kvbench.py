#!/usr/bin/env python3
"""A vLLM-shaped paged KV-cache pull through NIXL's Python API (``nixl._api``): ours
(``rdma_nixl``) or NIXL's own wheel, the same shape and flags as the Rust ``kvbench``.

    python3 kvbench.py --impl ours --layers 32 --blocks 1024 --block-bytes 32768 \\
        --blocks-per-request 128 --op READ --initiator-mem DRAM --target-mem DRAM

Two processes (multiprocessing, spawn): the target holds a KV cache (``--layers`` x K/V x
``--blocks`` blocks of ``--block-bytes``, ``block-major`` or ``strided``) as one torch
tensor on cuda:N (VRAM) or a numpy array (DRAM), registered whole; the initiator holds
its own. Agents are created as NIXL's users create them: ``nixl_agent(name)`` with the
default configuration (NIXL's default backend), or ``--backends A,B`` named. The
initiator prepares one descriptor list per side with one descriptor per layer x K/V x
block (``prep_xfer_dlist``, timed), then runs requests of ``--blocks-per-request`` block
ids each, ``--inflight`` at a time: ``make_prepped_xfer`` with descriptor indices ->
``transfer`` -> ``check_xfer_state`` until DONE, a notification behind the data (vLLM's
NIXL connector does exactly this). Block ids are seeded random or sequential, and
requests in flight together never share a block, so the final contents are known: every
block is checked afterwards (``--no-verify`` skips it) -- READ on the initiator, WRITE in
the target.

Prints one header line and a table row (descs/req, bytes/req, inflight, requests, GB/s,
p50/p99 per-request latency, prep_xfer_dlist times); ``--csv FILE`` appends the row.
The timed loop runs in Python, as vLLM's does.

``--impl ours`` imports ``rdma_nixl._api``; ``--impl nixl`` imports NIXL's wheel
(``nixl_cu12``/``nixl_cu13``/``nixl``, or ``$NIXL_MODULE``); ``--impl auto`` whatever
``nixl._api`` is (our opt-in shim or NIXL's package).
"""

from __future__ import annotations

import argparse
import csv
import importlib
import math
import multiprocessing as mp
import os
import sys
import time

TARGET = "kvbench-target"
INITIATOR = "kvbench-initiator"
# Tags of the two caches' fill patterns (what a unit holds before any request).
INITIATOR_TAG = 0x1A
TARGET_TAG = 0x7E
CSV_FIELDS = ["impl", "backends", "chosen", "op", "initiator_mem", "target_mem", "layers", "blocks",
              "block_bytes", "layout", "block_ids", "descs_per_req", "bytes_per_req",
              "inflight", "requests", "gbps", "p50_us", "p99_us", "prep_local_ms",
              "prep_remote_ms", "verified"]


def import_api(impl):
    """The ``_api`` module of the implementation asked for, and its label."""
    if impl == "ours":
        names = ["rdma_nixl._api"]
    elif impl == "nixl":
        names = ([os.environ["NIXL_MODULE"] + "._api"] if os.environ.get("NIXL_MODULE")
                 else ["nixl_cu13._api", "nixl_cu12._api", "nixl._api"])
    else:
        names = ["nixl._api"]
    errors = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if impl == "nixl" and mod.__name__.startswith("rdma_nixl."):
            errors.append(f"{name} is rdma_nixl (the opt-in shim), not NIXL's wheel")
            continue
        package = mod.__name__.split(".")[0]
        return mod, f"{package} {version_of(package)}"
    sys.exit("kvbench.py: no such NIXL Python API here: " + "; ".join(errors))


def version_of(package):
    from importlib import metadata

    for dist in (package.replace("_", "-"), package, "nixl"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return "?"


# --- the cache ------------------------------------------------------------------------

def unit_grid(np, o):
    """Descriptor index of every unit, shaped as the cache lies in memory (the last axis,
    the block's 8-byte words, left out): unit = (layer * 2 + kv) * blocks + block."""
    layer = np.arange(o.layers).reshape(-1, 1, 1)
    kv = np.arange(2).reshape(1, -1, 1)
    block = np.arange(o.blocks).reshape(1, 1, -1)
    units = (layer * 2 + kv) * o.blocks + block  # (layers, 2, blocks)
    if o.layout == "strided":
        units = units.transpose(2, 0, 1)  # (blocks, layers, 2): a block's units together
    return np.ascontiguousarray(units).reshape(-1)


def pattern_words(xp, tags, units, words):
    """The 8-byte words of units ``units`` (1-D) with fill tags ``tags`` (same shape):
    each word = tag << 56 | unit << 24 | word index -- a block at the wrong place, of the
    wrong side or cut short differs. ``xp`` is numpy or torch."""
    if xp.__name__ == "torch":
        w = xp.arange(words, dtype=xp.int64, device=units.device)
    else:
        w = xp.arange(words, dtype=xp.int64)
    return (tags.reshape(-1, 1) << 56) | (units.reshape(-1, 1) << 24) | w.reshape(1, -1)


class Cache:
    """One side's KV cache: a torch tensor on cuda:gpu (VRAM) or a numpy array (DRAM) of
    int64 words, in address order (``unit_grid`` says which unit each block row is)."""

    def __init__(self, o, kind, gpu, tag):
        import numpy as np

        self.np = np
        self.kind = kind
        self.gpu = gpu
        self.words = o.block_bytes // 8
        self.order = unit_grid(np, o)  # row -> unit
        rows = len(self.order)
        if kind == "VRAM":
            import torch

            self.torch = torch
            dev = f"cuda:{gpu}"
            self.t = torch.empty((rows, self.words), dtype=torch.int64, device=dev)
            self.addr = self.t.data_ptr()
            self.dev = gpu
        else:
            self.t = np.empty((rows, self.words), dtype=np.int64)
            self.addr = self.t.ctypes.data
            self.dev = 0
        self.nbytes = rows * o.block_bytes
        self.block_bytes = o.block_bytes
        # row of each unit (the inverse of order)
        self.row_of = np.empty_like(self.order)
        self.row_of[self.order] = np.arange(rows)
        self.fill(tag)

    def _chunks(self):
        step = max(1, (64 << 20) // self.block_bytes)
        for first in range(0, len(self.order), step):
            yield first, min(first + step, len(self.order))

    def fill(self, tag):
        np = self.np
        for a, b in self._chunks():
            units = self.order[a:b].astype(np.int64)
            if self.kind == "VRAM":
                torch = self.torch
                u = torch.from_numpy(units).to(self.t.device)
                self.t[a:b] = pattern_words(torch, torch.full_like(u, tag), u, self.words)
            else:
                self.t[a:b] = pattern_words(np, np.full_like(units, tag), units, self.words)
        if self.kind == "VRAM":
            self.torch.cuda.synchronize(self.gpu)

    def check(self, expected, own_tag, source_tag):
        """Every unit against ``expected`` (per unit: -1 kept its own fill, else the
        source side's unit written here); None, or what differs first."""
        np = self.np
        for a, b in self._chunks():
            units = self.order[a:b].astype(np.int64)
            src = expected[units]
            written = src >= 0
            tags = np.where(written, source_tag, own_tag).astype(np.int64)
            want_units = np.where(written, src, units).astype(np.int64)
            if self.kind == "VRAM":
                torch = self.torch
                dev = self.t.device
                want = pattern_words(torch, torch.from_numpy(tags).to(dev),
                                     torch.from_numpy(want_units).to(dev), self.words)
                bad = (self.t[a:b] != want).any(dim=1).nonzero()
                if len(bad):
                    row = a + int(bad[0])
                    return self._describe(row, units[row - a], src[row - a])
            else:
                want = pattern_words(np, tags, want_units, self.words)
                bad = np.nonzero((self.t[a:b] != want).any(axis=1))[0]
                if len(bad):
                    row = a + int(bad[0])
                    return self._describe(row, units[row - a], src[row - a])
        return None

    def _describe(self, row, unit, src):
        what = "its own fill" if src < 0 else f"the source's unit {src}"
        return f"unit {unit} (row {row}) differs from {what}"

    def descs(self, o):
        """One (addr, len, dev) per unit, in descriptor-index order."""
        return [(self.addr + int(self.row_of[u]) * o.block_bytes, o.block_bytes, self.dev)
                for u in range(len(self.order))]


# --- the plan ---------------------------------------------------------------------------

def plan(o):
    """Every request's (local block ids, remote block ids), warm-up first: on each side
    a request's blocks are distinct and none is a block of the inflight - 1 requests
    before it (so requests in flight together never share a block)."""
    import numpy as np

    count = o.warmup + o.requests
    per, n, window = o.blocks_per_request, o.blocks, o.inflight
    out = []
    if o.block_ids == "sequential":
        for i in range(count):
            ids = (np.arange(per) + i * per) % n
            out.append((ids, ids))
        return out
    rng = np.random.default_rng(o.seed)
    last = [np.full(n, -(1 << 40)), np.full(n, -(1 << 40))]
    for i in range(count):
        pair = []
        for side in (0, 1):
            free = np.nonzero(i - last[side] >= window)[0]
            ids = rng.choice(free, per, replace=False)
            last[side][ids] = i
            pair.append(ids)
        out.append(tuple(pair))
    return out


def indices(o, blocks):
    """Descriptor indices of ``blocks`` across every layer and both halves."""
    import numpy as np

    lk = np.arange(o.layers * 2).reshape(-1, 1)
    return (lk * o.blocks + np.asarray(blocks).reshape(1, -1)).reshape(-1)


def expected(o, requests, destination_is_local):
    import numpy as np

    out = np.full(o.layers * 2 * o.blocks, -1, dtype=np.int64)
    for local, remote in requests:
        dst, src = (local, remote) if destination_is_local else (remote, local)
        out[indices(o, dst)] = indices(o, src)
    return out


# --- the two sides ----------------------------------------------------------------------

def make_agent(api, name, o):
    if o.backends:
        return api.nixl_agent(name, api.nixl_agent_config(backends=o.backends))
    return api.nixl_agent(name)  # NIXL's default configuration


def target_main(conn, o):
    try:
        api, _ = import_api(o.impl)
        cache = Cache(o, o.target_mem, o.target_gpu, TARGET_TAG)
        agent = make_agent(api, TARGET, o)
        agent.register_memory([(cache.addr, cache.nbytes, cache.dev, "")], o.target_mem)
        conn.send(("ready", agent.get_agent_metadata(), cache.addr, cache.dev))
        peer_md = conn.recv()
        agent.add_remote_agent(peer_md)
    except Exception as e:  # reported by the initiator
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    notifs = 0
    while True:
        if not conn.poll(0.002):
            notifs += sum(len(v) for v in agent.get_new_notifs().values())
            continue
        msg = conn.recv()
        if msg[0] == "done":
            verdict = "skipped"
            if o.op == "WRITE" and not o.no_verify:
                verdict = cache.check(expected(o, plan(o), False), TARGET_TAG,
                                      INITIATOR_TAG) or "ok"
            conn.send(("verdict", verdict, notifs))
            conn.close()
            quick_exit(0)


def quick_exit(status):
    """Ends without library destructors (NIXL's wheel's bundled libnl crashes in one at
    exit after a UCX backend was created; see nixl_peer_bench.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def recv(conn, timeout=600):
    if not conn.poll(timeout):
        raise RuntimeError(f"the target did not answer within {timeout} s")
    return conn.recv()


def percentile(sorted_values, p):
    if not sorted_values:
        return 0.0
    rank = math.ceil(p / 100 * len(sorted_values))
    return sorted_values[min(max(rank, 1), len(sorted_values)) - 1]


def run(o):
    api, impl = import_api(o.impl)
    requests = plan(o)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(child_conn, o), daemon=True)
    target.start()
    try:
        ready = recv(conn, 300)
        if ready[0] != "ready":
            raise RuntimeError(f"target: {ready[1]}")
        _, target_md, remote_addr, remote_dev = ready
        cache = Cache(o, o.initiator_mem, o.initiator_gpu, INITIATOR_TAG)
        agent = make_agent(api, INITIATOR, o)
        agent.register_memory([(cache.addr, cache.nbytes, cache.dev, "")], o.initiator_mem)
        remote_name = agent.add_remote_agent(target_md)
        conn.send(agent.get_agent_metadata())

        units = o.layers * 2 * o.blocks
        local_descs = cache.descs(o)
        remote_descs = [(remote_addr + (d[0] - cache.addr), o.block_bytes, remote_dev)
                        for d in local_descs]  # both caches have the same layout
        t0 = time.perf_counter()
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, o.initiator_mem)
        prep_local = time.perf_counter() - t0
        # The target's metadata may take a moment to be usable (NIXL loads it lazily).
        t0 = time.perf_counter()
        remote_h = agent.prep_xfer_dlist(remote_name, remote_descs, o.target_mem)
        prep_remote = time.perf_counter() - t0
        assert len(local_descs) == units

        idx = [(indices(o, loc), indices(o, rem)) for loc, rem in requests]
        lat = []
        active = []  # (handle, request number, start)
        nxt = 0
        timed_start = None
        chosen = None  # the backend of the first request, as the agent picked it
        clock = time.perf_counter
        spent = [0.0, 0.0]  # timed requests: make_prepped_xfer, transfer
        while nxt < len(requests) or active:
            window = 1 if nxt < o.warmup else o.inflight
            warm_done = nxt >= o.warmup and all(n >= o.warmup for _, n, _ in active)
            while nxt < len(requests) and len(active) < window and (nxt < o.warmup or warm_done):
                start = clock()
                if nxt == o.warmup:
                    timed_start = start
                li, ri = idx[nxt]
                h = agent.make_prepped_xfer(o.op, local_h, li, remote_h, ri, f"KV {nxt}".encode())
                made = clock()
                if chosen is None:
                    try:
                        chosen = agent.query_xfer_backend(h)
                    except Exception as e:  # an implementation without the query
                        chosen = f"? ({type(e).__name__})"
                posted = clock()
                state = agent.transfer(h)
                if nxt >= o.warmup:
                    spent[0] += made - start
                    spent[1] += clock() - posted
                if state == "ERR":
                    raise RuntimeError(f"request {nxt}: transfer failed to post")
                active.append((h, nxt, start))
                nxt += 1
            still = []
            for h, n, start in active:
                state = agent.check_xfer_state(h)
                if state == "DONE":
                    if n >= o.warmup:
                        lat.append(clock() - start)
                    agent.release_xfer_handle(h)
                elif state == "ERR":
                    raise RuntimeError(f"request {n} failed")
                else:
                    still.append((h, n, start))
            active = still
        elapsed = clock() - timed_start
        verified = "not checked"
        if not o.no_verify and o.op == "READ":
            bad = cache.check(expected(o, requests, True), INITIATOR_TAG, TARGET_TAG)
            if bad:
                raise RuntimeError(f"READ data check failed: {bad}")
            verified = "verified"
        conn.send(("done",))
        reply = recv(conn)
        if reply[1] not in ("ok", "skipped"):
            raise RuntimeError(f"WRITE data check failed in the target: {reply[1]}")
        if reply[1] == "ok":
            verified = "verified"
        agent.release_dlist_handle(local_h)
        agent.release_dlist_handle(remote_h)
    finally:
        target.join(10)
        if target.is_alive():
            target.kill()

    descs = o.layers * 2 * o.blocks_per_request
    per_req = descs * o.block_bytes
    lat.sort()
    row = {
        "impl": impl, "backends": ",".join(agent.backends.keys()), "chosen": chosen,
        "op": o.op,
        "initiator_mem": o.initiator_mem, "target_mem": o.target_mem, "layers": o.layers,
        "blocks": o.blocks, "block_bytes": o.block_bytes, "layout": o.layout,
        "block_ids": o.block_ids, "descs_per_req": descs, "bytes_per_req": per_req,
        "inflight": o.inflight, "requests": len(lat),
        "gbps": per_req * len(lat) / elapsed / 1e9,
        "p50_us": percentile(lat, 50) * 1e6, "p99_us": percentile(lat, 99) * 1e6,
        "prep_local_ms": prep_local * 1e3, "prep_remote_ms": prep_remote * 1e3,
        "verified": verified,
    }
    mem = lambda kind, gpu: f"VRAM (GPU {gpu})" if kind == "VRAM" else kind  # noqa: E731
    print(f"kvbench.py: {impl}, backends {row['backends']} "
          f"({'named' if o.backends else 'default config'}), chosen {chosen}, {o.op} "
          f"{mem(o.initiator_mem, o.initiator_gpu)} -> {mem(o.target_mem, o.target_gpu)}, "
          f"{o.layers} layers x K/V x {o.blocks} blocks x {o.block_bytes} B ({o.layout}), "
          f"{o.block_ids} block ids, data {verified}")
    print("{:>10} {:>12} {:>8} {:>9} {:>10} {:>10} {:>10} {:>13} {:>14}".format(
        "descs/req", "bytes/req", "inflight", "requests", "GB/s", "p50 us", "p99 us",
        "prep local ms", "prep remote ms"))
    print("{:>10} {:>12} {:>8} {:>9} {:>10.3f} {:>10.1f} {:>10.1f} {:>13.3f} {:>14.3f}".format(
        descs, per_req, o.inflight, len(lat), row["gbps"], row["p50_us"], row["p99_us"],
        row["prep_local_ms"], row["prep_remote_ms"]), flush=True)
    if o.breakdown and lat:
        print("per request (mean us): make_prepped_xfer {:.1f}, transfer {:.1f}, "
              "posted to done {:.1f}".format(
                  spent[0] / len(lat) * 1e6, spent[1] / len(lat) * 1e6,
                  (sum(lat) - spent[0] - spent[1]) / len(lat) * 1e6), flush=True)
    if o.csv:
        new = not os.path.exists(o.csv) or os.path.getsize(o.csv) == 0
        with open(o.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)
    return 0


def size(text):
    units = {"": 1, "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MI": 1 << 20,
             "MIB": 1 << 20}
    t = text.strip().upper()
    num = t.rstrip("KMIB")
    if not num.isdigit() or t[len(num):] not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (32768, 32K, 32KiB)")
    return int(num) * units[t[len(num):]]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=["ours", "nixl", "auto"], default="ours")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--block-bytes", type=size, default=32 << 10)
    p.add_argument("--layout", choices=["block-major", "strided"], default="block-major")
    p.add_argument("--block-ids", choices=["random", "sequential"], default="random")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--op", type=str.upper, choices=["READ", "WRITE"], default="READ")
    p.add_argument("--blocks-per-request", type=int, default=128)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--inflight", type=int, default=1)
    p.add_argument("--initiator-mem", type=str.upper, choices=["DRAM", "VRAM"], default="DRAM")
    p.add_argument("--target-mem", type=str.upper, choices=["DRAM", "VRAM"], default="DRAM")
    p.add_argument("--initiator-gpu", type=int, default=0)
    p.add_argument("--target-gpu", type=int, default=0)
    p.add_argument("--backends", default="",
                   help="comma-separated backend names (default: NIXL's default config)")
    p.add_argument("--no-verify", action="store_true", help="skip the data check")
    p.add_argument("--csv", help="append the result row here")
    p.add_argument("--breakdown", action="store_true",
                   help="also print where a timed request's time went on average")
    o = p.parse_args(argv)
    o.backends = [b.strip() for b in o.backends.split(",") if b.strip()]
    for name in ("layers", "blocks", "blocks_per_request", "requests", "inflight"):
        if getattr(o, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if o.warmup < 0:
        p.error("--warmup must be at least 0")
    if o.block_bytes < 8 or o.block_bytes % 8:
        p.error("--block-bytes: a positive multiple of 8 bytes")
    if o.blocks_per_request * o.inflight > o.blocks:
        p.error(f"{o.inflight} request(s) in flight of {o.blocks_per_request} blocks need "
                f"{o.blocks_per_request * o.inflight} distinct blocks, and the cache has "
                f"{o.blocks}: raise --blocks or lower --blocks-per-request or --inflight")
    if o.layers * 2 * o.blocks >= 1 << 32 or o.block_bytes // 8 >= 1 << 24:
        p.error("too many units or too large blocks for the data pattern")
    for side in ("initiator", "target"):
        if getattr(o, f"{side}_mem") == "VRAM":
            why = gpu_problem(getattr(o, f"{side}_gpu"))
            if why:
                p.error(f"--{side}-mem VRAM: {why}")
    return o


def gpu_problem(gpu):
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if gpu >= torch.cuda.device_count():
        return f"no GPU {gpu} (torch sees {torch.cuda.device_count()})"
    return None


if __name__ == "__main__":
    try:
        code = run(parse_args(sys.argv[1:]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (print(e.code, file=sys.stderr) or 1)
    except BaseException as e:  # one line, as the Rust kvbench
        print(f"kvbench.py: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    quick_exit(code or 0)
