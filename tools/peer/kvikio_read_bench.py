#!/usr/bin/env python3
"""KvikIO's file -> GPU read bandwidth, the reference for hf3fs-gdr's daemon.

Reads FILE (whole, sequentially, in one `CuFile.pread` of `--chunk` bytes each, as
KvikIO splits it over its thread pool) into a CuPy device buffer for each thread count
given, `--rounds` times, and prints one line per (threads, round) plus the best; with
`--random4k N` also N 4 KiB reads at random aligned offsets (IOPS).

KvikIO comes from its wheels (kvikio-cu13, libkvikio-cu13, rapids-logger: fetch them
with `pip download --no-deps --python-version 3.12 --only-binary=:all:
--platform manylinux_2_28_x86_64 kvikio-cu13 libkvikio-cu13 rapids-logger`) installed
with `pip install --no-deps --target DIR` and DIR on PYTHONPATH; CuPy and the cuFile
wheel are the GPU machine's. Without GPUDirect Storage KvikIO reads through its own
bounce buffers (compat mode), which is what the comparison measures.

    python3 kvikio_read_bench.py FILE --threads 1,8,16 --rounds 3 [--random4k 20000 --depth 64]
"""

import argparse
import os
import random
import sys
import time


def set_threads(kvikio, n: int) -> None:
    """KvikIO's thread pool size, across the API's versions."""
    d = kvikio.defaults
    if hasattr(d, "set"):
        d.set("num_threads", n)
    elif hasattr(d, "num_threads_reset"):
        d.num_threads_reset(n)
    else:
        d.set_num_threads(n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--threads", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=0, help="bytes per pread (0: the whole file)")
    ap.add_argument("--random4k", type=int, default=0)
    ap.add_argument("--depth", type=int, default=64, help="random reads in flight")
    args = ap.parse_args()

    import cupy
    import kvikio
    import kvikio.defaults

    size = os.path.getsize(args.file)
    buf = cupy.empty(size, dtype=cupy.uint8)
    chunk = args.chunk or size
    compat = getattr(kvikio.defaults, "compat_mode", None) or getattr(kvikio.defaults, "is_compat_mode_preferred", None)
    try:
        mode = compat() if callable(compat) else kvikio.defaults.get("compat_mode")
    except Exception as e:  # the accessor moved between KvikIO releases
        mode = f"unknown ({e})"
    print(f"kvikio {kvikio.__version__}, compat mode {mode}, file {args.file} {size} bytes")
    best = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        set_threads(kvikio, threads)
        for r in range(args.rounds):
            t0 = time.perf_counter()
            with kvikio.CuFile(args.file, "r") as f:
                futures = [f.pread(buf[off:off + min(chunk, size - off)], min(chunk, size - off), off)
                           for off in range(0, size, chunk)]
                moved = sum(fut.get() for fut in futures)
            cupy.cuda.runtime.deviceSynchronize()
            dt = time.perf_counter() - t0
            gbps = moved / dt / 1e9
            best[threads] = max(best.get(threads, 0.0), gbps)
            print(f"kvikio threads={threads} round={r} bytes={moved} seconds={dt:.4f} GB/s={gbps:.2f}")
    for threads, gbps in best.items():
        print(f"kvikio best threads={threads} GB/s={gbps:.2f}")
    if args.random4k:
        set_threads(kvikio, max(int(t) for t in args.threads.split(",")))
        depth = args.depth
        small = cupy.empty(4096 * depth, dtype=cupy.uint8)
        blocks = size // 4096
        offs = [random.randrange(blocks) * 4096 for _ in range(args.random4k)]
        with kvikio.CuFile(args.file, "r") as f:
            t0 = time.perf_counter()
            for at in range(0, len(offs), depth):
                batch = offs[at:at + depth]
                futures = [f.pread(small[i * 4096:(i + 1) * 4096], 4096, off) for i, off in enumerate(batch)]
                for fut in futures:
                    fut.get()
            dt = time.perf_counter() - t0
        print(f"kvikio random4k reads={args.random4k} depth={depth} seconds={dt:.4f} IOPS={args.random4k / dt:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
