#!/usr/bin/env python3
"""NIXL's own Python API (the nixl-cu13 / nixl-cu12 wheel, UCX backend) measured the way
our nixlbench measures: two processes, one request of `--batch_size` blocks (default 1;
spaced two blocks apart where the buffer has room, as nixlbench places them) repeated, warmup, then N timed iterations of post + wait; GB/s = bytes / sum of the iteration
times. It prints nixlbench's table (same columns, units and header shape) for each
(op, initiator memory, target memory) case, so that tools/peer/summarize.py lines it up
with ours, and writes the rows as CSV.

    python3 nixl_peer_bench.py --segs VRAM:VRAM,DRAM:DRAM --op_type WRITE,READ \\
        --start_block_size 4096 --max_block_size 67108864 --csv /tmp/nixl.csv

The target is a second process (multiprocessing, spawn); metadata (get_agent_metadata
/ add_remote_agent) and control messages go over a pipe. VRAM is a torch CUDA tensor,
DRAM a torch CPU tensor (a numpy array without torch). A case that needs a GPU is
skipped with its reason when none is usable, or fails with --require_gpu.

The timed loop runs in Python: each iteration pays a few microseconds of interpreter
overhead that NIXL's C++ nixlbench does not, which shows at small blocks only.
"""

import argparse
import csv
import importlib
import math
import multiprocessing as mp
import os
import sys
import time

TARGET = "nixl-peer-target"
INITIATOR = "nixl-peer-initiator"
SEG_TYPES = ("DRAM", "VRAM")


def import_nixl():
    """NIXL's package: $NIXL_MODULE if set, else nixl_cu13, nixl_cu12 or nixl (the
    first the path holds)."""
    errors = []
    names = ("nixl_cu13", "nixl_cu12", "nixl._api")
    if os.environ.get("NIXL_MODULE"):
        names = (os.environ["NIXL_MODULE"],)
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if hasattr(mod, "nixl_agent"):
            return mod, name.split(".")[0]
    sys.exit("nixl_peer_bench: no NIXL Python package importable: " + "; ".join(errors))


def nixl_version(module):
    from importlib import metadata

    for dist in (module.replace("_", "-"), "nixl"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return "?"


def torch_or_none():
    try:
        import torch

        return torch
    except ImportError:
        return None


def gpu_problem(gpu):
    """Why VRAM on GPU `gpu` cannot be used here, or None."""
    torch = torch_or_none()
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if gpu >= torch.cuda.device_count():
        return f"no GPU {gpu} (torch sees {torch.cuda.device_count()})"
    return None


class Buf:
    """One side's buffer of one memory kind."""

    def __init__(self, kind, size, gpu):
        self.kind = kind
        self.size = size
        torch = torch_or_none()
        self.torch = torch
        if kind == "VRAM":
            self.t = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{gpu}")
            self.dev = gpu
        elif torch is not None:
            self.t = torch.zeros(size, dtype=torch.uint8)
            self.dev = 0
        else:
            import numpy as np

            self.t = np.zeros(size, dtype=np.uint8)
            self.dev = 0
        self.addr = self.t.data_ptr() if hasattr(self.t, "data_ptr") else self.t.ctypes.data

    def describe(self):
        return f"VRAM (GPU {self.dev})" if self.kind == "VRAM" else self.kind

    def fill(self, n, value):
        self.t[:n] = value
        if self.kind == "VRAM":
            self.torch.cuda.synchronize(self.dev)

    def holds(self, n, value):
        """Whether the first n bytes all equal value (VRAM compared on the GPU, then
        the verdict copied back)."""
        return bool((self.t[:n] == value).all())


def sizes(start, maximum):
    out, s = [], start
    while s <= maximum:
        out.append(s)
        s *= 2
    return out


def avg_p99(samples):
    if not samples:
        return 0.0, 0.0
    s = sorted(samples)
    idx = min(max(math.ceil(len(s) * 0.99), 1), len(s)) - 1
    return sum(s) / len(s), s[idx]


def make_agent(nixl, name, opts):
    conf = nixl.nixl_agent_config(
        enable_prog_thread=not opts.no_progress_thread, backends=[opts.backend]
    )
    agent = nixl.nixl_agent(name, conf)
    if opts.backend not in agent.backends:
        raise SystemExit(f"nixl_peer_bench: backend {opts.backend} did not start")
    return agent


def register(agent, buf):
    return agent.register_memory([(buf.addr, buf.size, buf.dev, "")], buf.kind)


def target_main(conn, opts):
    """The target process: registers one buffer per kind it serves, answers fill and
    check requests on its own memory, and polls notifications (progress) meanwhile."""
    try:
        nixl, _ = import_nixl()
        agent = make_agent(nixl, TARGET, opts)
        bufs = {}
        for kind in opts.target_kinds:
            bufs[kind] = Buf(kind, opts.buffer_size, opts.target_gpu)
            register(agent, bufs[kind])
        conn.send(("ready", agent.get_agent_metadata(),
                   {k: (b.addr, b.dev, b.describe()) for k, b in bufs.items()}))
    except Exception as e:  # reported by the initiator
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        if not conn.poll(0.002):
            agent.get_new_notifs()
            continue
        msg = conn.recv()
        if msg[0] == "done":
            conn.send(("bye",))
            conn.close()
            quick_exit(0)
        if msg[0] == "fill":
            _, kind, n, value = msg
            bufs[kind].fill(n, value)
            conn.send(("filled",))
        elif msg[0] == "check":
            _, kind, n, value = msg
            conn.send(("checked", bufs[kind].holds(n, value)))


def quick_exit(status):
    """Ends the process without running library destructors: the wheel's bundled
    libnl-route crashes in its ELF destructor at exit (SIGSEGV in rtnl_tc_unregister from
    _dl_fini, seen with nixl-cu12 1.5.1 once a UCX backend was created), after all the
    work is done; that must not turn a good run into exit status 139."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def ask(conn, msg, expect, timeout=60):
    conn.send(msg)
    if not conn.poll(timeout):
        raise RuntimeError(f"the target did not answer {msg[0]} within {timeout} s")
    reply = conn.recv()
    if reply[0] != expect:
        raise RuntimeError(f"target: {reply}")
    return reply


def wait_done(agent, handle, state):
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer failed: {state}")


HEADER = ("{:<18} {:<12} {:<14} {:<16} {:<14} {:<14} {:<14} {:<14} {:<14} {:<14}".format(
    "Block Size (B)", "Batch Size", "B/W (GB/Sec)", "Avg Lat. (us)", "Avg Prep (us)",
    "P99 Prep (us)", "Avg Post (us)", "P99 Post (us)", "Avg Tx (us)", "P99 Tx (us)"))
CSV_FIELDS = ["impl", "backend", "op", "initiator_seg", "target_seg", "block_size",
              "batch_size", "gbps", "avg_lat_us", "avg_prep_us", "p99_prep_us",
              "avg_post_us", "p99_post_us", "avg_tx_us", "p99_tx_us", "consistent"]


def run_point(agent, conn, remote_name, local, remote, op, block, opts, point_no):
    """One block size: returns the row (as nixlbench computes it)."""
    iters = opts.num_iter
    if block >= 1 << 20:
        iters = max(opts.num_iter // opts.large_blk_iter_ftr, 1)
    raddr, rdev, _ = remote["where"]
    t0 = time.perf_counter_ns()
    batch = opts.batch_size
    stride = 2 * block if 2 * block * batch <= opts.buffer_size else block
    offsets = [i * stride for i in range(batch)]
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                               [(local.addr + o, block, local.dev) for o in offsets], local.kind)
    rh = agent.prep_xfer_dlist(remote_name, [(raddr + o, block, rdev) for o in offsets],
                               remote["kind"])
    handle = agent.make_prepped_xfer(op, lh, list(range(batch)), rh, list(range(batch)))
    prep = (time.perf_counter_ns() - t0) / 1e3
    value = 1 + point_no % 254
    if opts.check_consistency and batch > 1:
        raise RuntimeError("--check_consistency checks batch 1 only")
    if opts.check_consistency:
        if op == "WRITE":
            local.fill(block, value)  # the target's copy holds another point's value
        else:
            local.fill(block, 0)
            ask(conn, ("fill", remote["kind"], block, value), "filled")
    for _ in range(min(opts.warmup_iter, iters)):
        wait_done(agent, handle, agent.transfer(handle))
    post, tx = [], []
    clock = time.perf_counter_ns
    for _ in range(iters):
        start = clock()
        state = agent.transfer(handle)
        posted = clock()
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        end = clock()
        if state != "DONE":
            raise RuntimeError(f"transfer failed: {state}")
        post.append((posted - start) / 1e3)
        tx.append((end - start) / 1e3)
    consistent = ""
    if opts.check_consistency:
        if op == "WRITE":
            ok = ask(conn, ("check", remote["kind"], block, value), "checked")[1]
        else:
            ok = local.holds(block, value)
        if not ok:
            raise RuntimeError(f"consistency check failed: {op} block size {block}")
        consistent = "yes"
    agent.release_xfer_handle(handle)
    agent.release_dlist_handle(lh)
    agent.release_dlist_handle(rh)
    wall = sum(tx)
    pa, pp = avg_p99(post)
    ta, tp = avg_p99(tx)
    return {
        "block_size": block, "batch_size": batch,
        "gbps": block * batch * iters / (wall / 1e6) / 1e9,
        "avg_lat_us": wall / iters, "avg_prep_us": prep, "p99_prep_us": prep,
        "avg_post_us": pa, "p99_post_us": pp, "avg_tx_us": ta, "p99_tx_us": tp,
        "consistent": consistent,
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="UCX")
    p.add_argument("--segs", default="VRAM:VRAM,VRAM:DRAM,DRAM:VRAM,DRAM:DRAM",
                   help="INITIATOR:TARGET memory kinds, comma-separated")
    p.add_argument("--op_type", default="WRITE,READ", help="WRITE, READ or both")
    p.add_argument("--start_block_size", type=int, default=4096)
    p.add_argument("--max_block_size", type=int, default=64 << 20)
    p.add_argument("--batch_size", type=int, default=1,
                   help="blocks per request (as nixlbench's --start/max_batch_size)")
    p.add_argument("--num_iter", type=int, default=1000)
    p.add_argument("--warmup_iter", type=int, default=100)
    p.add_argument("--large_blk_iter_ftr", type=int, default=16)
    p.add_argument("--initiator_gpu", type=int, default=0)
    p.add_argument("--target_gpu", type=int, default=0)
    p.add_argument("--check_consistency", action="store_true",
                   help="fill the source with a per-point byte and verify the destination "
                        "where it lives (WRITE: in the target process)")
    p.add_argument("--no_progress_thread", action="store_true",
                   help="agents without NIXL's progress thread (the Python API's default is on)")
    p.add_argument("--require_gpu", action="store_true",
                   help="a VRAM case without a usable GPU fails instead of being skipped")
    p.add_argument("--csv", help="write every row here")
    o = p.parse_args(argv)
    if o.batch_size < 1:
        p.error("--batch_size: at least 1")
    # As nixlbench: room for the batch's blocks two apart.
    o.buffer_size = o.max_block_size * o.batch_size * 2
    o.segs = [tuple(s.strip().upper().split(":")) for s in o.segs.split(",") if s.strip()]
    for s in o.segs:
        if len(s) != 2 or any(k not in SEG_TYPES for k in s):
            p.error(f"--segs: INITIATOR:TARGET with DRAM or VRAM, not {':'.join(s)}")
    o.ops = [x.strip().upper() for x in o.op_type.split(",") if x.strip()]
    if any(x not in ("WRITE", "READ") for x in o.ops):
        p.error("--op_type: WRITE and/or READ")
    o.large_blk_iter_ftr = max(o.large_blk_iter_ftr, 1)
    if not 0 < o.start_block_size <= o.max_block_size:
        p.error("need 0 < start_block_size <= max_block_size")
    return o


def main(argv):
    opts = parse_args(argv)
    usable = []
    for ikind, tkind in opts.segs:
        why = None
        if ikind == "VRAM":
            why = gpu_problem(opts.initiator_gpu)
        if why is None and tkind == "VRAM":
            why = gpu_problem(opts.target_gpu)
        if why is not None:
            msg = f"nixl_peer_bench: {ikind} -> {tkind}: {why}"
            if opts.require_gpu:
                sys.exit(msg)
            print(msg + ": skipped", flush=True)
            continue
        usable.append((ikind, tkind))
    if not usable:
        sys.exit("nixl_peer_bench: no case to run")
    opts.target_kinds = sorted({t for _, t in usable})
    nixl, module = import_nixl()
    impl = f"NIXL {nixl_version(module)} ({module})"

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(child_conn, opts), daemon=True)
    target.start()
    rows = []
    try:
        if not conn.poll(120):
            raise RuntimeError("the target process did not start within 120 s")
        ready = conn.recv()
        if ready[0] != "ready":
            raise RuntimeError(f"target: {ready[1]}")
        _, metadata, remote_bufs = ready
        agent = make_agent(nixl, INITIATOR, opts)
        local_bufs = {k: Buf(k, opts.buffer_size, opts.initiator_gpu)
                      for k in sorted({i for i, _ in usable})}
        regs = [register(agent, b) for b in local_bufs.values()]
        remote_name = agent.add_remote_agent(metadata)
        shown = remote_name.decode() if isinstance(remote_name, bytes) else remote_name
        point_no = 0
        for ikind, tkind in usable:
            local = local_bufs[ikind]
            remote = {"kind": tkind, "where": remote_bufs[tkind]}
            for op in opts.ops:
                print(f"nixl-peer: {impl} backend {opts.backend}, {op.capitalize()}, "
                      f"{local.describe()} -> {remote_bufs[tkind][2]}, 1 thread(s), "
                      f"target `{shown}` in process {target.pid}")
                print("-" * 150)
                print(HEADER)
                print("-" * 150, flush=True)
                for block in sizes(opts.start_block_size, opts.max_block_size):
                    point_no += 1
                    r = run_point(agent, conn, remote_name, local, remote, op, block, opts,
                                  point_no)
                    print("{:<18} {:<12} {:<14.6f} {:<16.3f} {:<14.3f} {:<14.3f} {:<14.3f} "
                          "{:<14.3f} {:<14.3f} {:<14.3f}".format(
                              r["block_size"], r["batch_size"], r["gbps"], r["avg_lat_us"],
                              r["avg_prep_us"], r["p99_prep_us"], r["avg_post_us"],
                              r["p99_post_us"], r["avg_tx_us"], r["p99_tx_us"]), flush=True)
                    r.update(impl=impl, backend=opts.backend, op=op, initiator_seg=ikind,
                             target_seg=tkind)
                    rows.append(r)
                if opts.check_consistency:
                    print(f"consistency check: every block verified ({op})", flush=True)
        ask(conn, ("done",), "bye")
        for reg in regs:
            agent.deregister_memory(reg)
    finally:
        if opts.csv and rows:
            with open(opts.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
                w.writeheader()
                w.writerows(rows)
        target.join(10)
        if target.is_alive():
            target.kill()
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (print(e.code, file=sys.stderr) or 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    quick_exit(code or 0)
