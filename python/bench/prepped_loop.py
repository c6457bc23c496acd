#!/usr/bin/env python3
"""A Python loop of prepped transfers, through rdma_nixl and through NIXL's wheel.

Two agents in one process (one host), DRAM, one prepared request of 64 x 64 KiB
WRITE, posted again as soon as it is DONE::

    while running:
        state = agent.transfer(handle)
        while state != "DONE":
            state = agent.check_xfer_state(handle)

Reported per implementation: transfers/s (and GB/s), the mean time inside one
``transfer()`` call and inside one ``check_xfer_state()`` call as Python sees them
(ours yields the CPU on a poll that finds the transfer moving, so that time is mostly
waiting), and the pure call overhead of ``check_xfer_state()`` on a request that is
already DONE. The per-call overhead summed up is ``transfer()`` + a DONE check.

On one host NIXL's UCX moves the data over shared memory, and so does our LIBFABRIC with
its default parameters (its ``shm`` rails, opened beside the network provider's for the
peers on this host); ``--param local_provider=none`` measures the network provider
(``tcp;ofi_rxm`` here) alone.

Without ``--impl`` the script runs each implementation in its own subprocess,
alternating (``--rounds`` times each), and prints the ratio ours / NIXL of the median
transfers/s. NIXL's wheel may live in another venv: ``--nixl-python PATH``.

    python bench/prepped_loop.py                    # both, alternating
    python bench/prepped_loop.py --impl ours        # one
    python bench/prepped_loop.py --nixl-python /path/to/venv/bin/python
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

BATCH = 64
BLOCK = 64 << 10


def load(impl: str):
    if impl == "ours":
        return importlib.import_module("rdma_nixl._api")
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise SystemExit("NIXL's wheel is not installed in this interpreter")


def measure(impl: str, seconds: float, params: dict, progress_thread: bool = True) -> dict:
    import logging

    import numpy as np

    logging.getLogger("nixl").setLevel(logging.WARNING)
    logging.getLogger("rdma_nixl").setLevel(logging.WARNING)
    api = load(impl)
    a = api.nixl_agent("bench-a", api.nixl_agent_config(progress_thread, backends=[]))
    b = api.nixl_agent("bench-b", api.nixl_agent_config(progress_thread, backends=[]))
    backend = "UCX" if impl == "nixl" else "LIBFABRIC"
    a.create_backend(backend, params)
    b.create_backend(backend, params)
    src = np.full(BATCH * BLOCK, 7, dtype=np.uint8)
    dst = np.zeros(BATCH * BLOCK, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    rows = [(src.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BATCH)]
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
    rrows = [(dst.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BATCH)]
    remote = a.prep_xfer_dlist("bench-b", rrows, "DRAM")
    idx = list(range(BATCH))
    h = a.make_prepped_xfer("WRITE", local, idx, remote, idx)

    transfer, check = a.transfer, a.check_xfer_state
    # Warm up (connections, page faults).
    for _ in range(50):
        s = transfer(h)
        while s != "DONE":
            s = check(h)

    # Throughput: the bare loop, no timers inside.
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        s = transfer(h)
        while s != "DONE":
            s = check(h)
        n += 1
        if n % 16 == 0 and time.perf_counter() > deadline:
            break
    elapsed = time.perf_counter() - start

    # Time inside each call, as Python sees it (timer cost subtracted).
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(1000):
        clock()
    timer_ns = (clock() - t0) / 1000
    post_ns = check_ns = 0.0
    posts = checks = 0
    end = time.perf_counter() + min(seconds, 2.0)
    while time.perf_counter() < end:
        t0 = clock()
        s = transfer(h)
        post_ns += clock() - t0 - timer_ns
        posts += 1
        while s != "DONE":
            t0 = clock()
            s = check(h)
            check_ns += clock() - t0 - timer_ns
            checks += 1

    # Pure call overhead: polling a request that is already DONE.
    reps = 200_000
    t0 = time.perf_counter()
    for _ in range(reps):
        check(h)
    done_check_us = (time.perf_counter() - t0) / reps * 1e6

    assert int(dst[0]) == 7 and int(dst[-1]) == 7
    a.release_xfer_handle(h)
    return {
        "impl": impl,
        "transfers_per_s": n / elapsed,
        "gb_per_s": n * BATCH * BLOCK / elapsed / 1e9,
        "transfer_call_us": post_ns / max(posts, 1) / 1e3,
        "check_call_us": check_ns / max(checks, 1) / 1e3,
        "checks_per_transfer": checks / max(posts, 1),
        "done_check_us": done_check_us,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["ours", "nixl"], help="run one implementation in-process")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="backend parameter for our LIBFABRIC (e.g. provider=shm)")
    ap.add_argument("--nixl-param", action="append", default=[], metavar="KEY=VALUE",
                    help="backend parameter for NIXL's UCX")
    ap.add_argument("--nixl-python", default=sys.executable, help="interpreter with NIXL's wheel")
    ap.add_argument("--ours-python", default=sys.executable, help="interpreter with rdma_nixl")
    ap.add_argument("--json", action="store_true", help="(with --impl) print one JSON line")
    args = ap.parse_args()

    if args.impl:
        params = dict(kv.split("=", 1) for kv in (args.param if args.impl == "ours" else args.nixl_param))
        r = measure(args.impl, args.seconds, params)
        print(json.dumps(r) if args.json else r, flush=True)
        return

    results = {"ours": [], "nixl": []}
    for round_no in range(args.rounds):
        for impl in ("ours", "nixl"):
            python = args.ours_python if impl == "ours" else args.nixl_python
            cmd = [python, os.path.abspath(__file__), "--impl", impl, "--json",
                   "--seconds", str(args.seconds)]
            cmd += [f"--param={p}" for p in args.param] + [f"--nixl-param={p}" for p in args.nixl_param]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if not line:
                sys.exit(f"{impl} failed:\n{out.stdout}\n{out.stderr}")
            if out.returncode != 0:
                # NIXL's wheel may crash at interpreter exit (UCX teardown), after its result.
                print(f"({impl} exited with status {out.returncode} after reporting)", flush=True)
            r = json.loads(line[-1])
            results[impl].append(r)
            print(
                f"round {round_no + 1} {impl:4}: {r['transfers_per_s']:9.0f} transfers/s "
                f"({r['gb_per_s']:6.2f} GB/s)  transfer() {r['transfer_call_us']:7.2f} us  "
                f"check_xfer_state() {r['check_call_us']:6.2f} us x {r['checks_per_transfer']:.1f}  "
                f"check on DONE {r['done_check_us']:.3f} us",
                flush=True,
            )
    med = {k: statistics.median(r["transfers_per_s"] for r in v) for k, v in results.items()}
    # Per-call overhead: one transfer() plus one check_xfer_state() that finds the request
    # DONE (a poll that finds it still moving yields the CPU to the data movers, so its
    # time in the loop is waiting, not overhead).
    call = {
        k: statistics.median(r["transfer_call_us"] + r["done_check_us"] for r in v)
        for k, v in results.items()
    }
    print(f"median transfers/s: ours {med['ours']:.0f}, NIXL {med['nixl']:.0f}, "
          f"ratio ours/NIXL {med['ours'] / med['nixl']:.2f}x")
    print(f"median per-call overhead, transfer() + check_xfer_state() on DONE: "
          f"ours {call['ours']:.2f} us, NIXL {call['nixl']:.2f} us "
          f"(NIXL's transfer() moves the data inline on one host)")


if __name__ == "__main__":
    main()
