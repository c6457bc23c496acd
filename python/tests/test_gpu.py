"""torch CUDA tensors registered and moved (VRAM), on a machine with a GPU.

Skipped (with the reason printed) where torch or a CUDA device is missing; with
``NIXL_REQUIRE_GPU=1`` (the GPU machine) a missing GPU FAILS instead. The first tests use
the default configuration (NIXL's ``UCX``; ours maps it to ``LIBFABRIC``, staged VRAM)
and run against NIXL's wheel too; the per-backend ones (``LOCAL``, ``LIBFABRIC``,
``CUDA_IPC``) are ours.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from conftest import IMPL, load_api, wait_for, wait_xfer

SIZE = 8 << 20
CHUNK = 1 << 20


def _gpu_or_reason():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return torch, None


torch, _why = _gpu_or_reason()
if torch is None and os.environ.get("NIXL_REQUIRE_GPU") != "1":
    pytest.skip(f"GPU tests skipped: {_why}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _gpu_is_required():
    # NIXL_REQUIRE_GPU=1 (the GPU machine): every GPU test fails, rather than skips,
    # where torch or the GPU is missing; the DRAM tests of the other files still run.
    if torch is None:
        pytest.fail(f"NIXL_REQUIRE_GPU=1 but {_why}")

api = load_api()


def gpu_pattern(n: int, seed: int):
    return (torch.arange(n, dtype=torch.int64, device="cuda:0") * 2654435761 + seed).remainder(
        256
    ).to(torch.uint8)


def make(name: str, backends):
    return api.nixl_agent(name, api.nixl_agent_config(backends=backends))


def run_pair(backends, op: str, local_on_host: bool = False):
    """Two agents in this process: A moves CHUNK-sized pieces of tensors to/from B."""
    a = make("A", backends)
    b = make("B", backends)
    src = gpu_pattern(SIZE, 5)
    if local_on_host:
        src = src.cpu()
    dst = torch.zeros(SIZE, dtype=torch.uint8, device="cuda:0")
    if op == "READ":
        dst.copy_(gpu_pattern(SIZE, 9))
        src.zero_()
    torch.cuda.synchronize()
    a.register_memory(src)
    b.register_memory(dst)
    assert a.add_remote_agent(b.get_agent_metadata()) == b"B"
    n = SIZE // CHUNK
    local = a.get_xfer_descs([src[i * CHUNK : (i + 1) * CHUNK] for i in range(n)])
    remote = a.get_xfer_descs([dst[i * CHUNK : (i + 1) * CHUNK] for i in range(n)])
    assert local.getType() == (api.nixlBind.DRAM_SEG if local_on_host else api.nixlBind.VRAM_SEG)
    assert remote.getType() == api.nixlBind.VRAM_SEG
    h = a.initialize_xfer(op, local, remote, "B", b"gpu-done")
    wait_xfer(a, h, state=a.transfer(h), timeout=60)
    wait_for(lambda: b.check_remote_xfer_done("A", b"gpu-done"), timeout=60, what="notification")
    torch.cuda.synchronize()
    assert torch.equal(src.cuda(), dst)
    return a, h


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_cuda_tensors_default_backend(op):
    a, h = run_pair(["UCX"], op)
    if IMPL == "ours":
        # The default configuration sends VRAM to VRAM on one node through CUDA IPC
        # (created beside LIBFABRIC, preferred by the agent for that pair).
        assert a.query_xfer_backend(h) == "CUDA_IPC"


@pytest.mark.ours_only
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_cuda_tensors_libfabric(op):
    a, h = run_pair(["LIBFABRIC"], op)
    assert a.query_xfer_backend(h) == "LIBFABRIC"


@pytest.mark.ours_only
def test_host_tensor_to_cuda_tensor_libfabric():
    run_pair(["LIBFABRIC"], "WRITE", local_on_host=True)


@pytest.mark.ours_only
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_cuda_tensors_local_loopback(op):
    agent = make("self", ["LOCAL"])
    src = gpu_pattern(SIZE, 3)
    dst = torch.zeros(SIZE, dtype=torch.uint8, device="cuda:0")
    if op == "READ":
        src, dst = dst, src  # READ pulls the pattern from the "remote" (loopback) side
    torch.cuda.synchronize()
    agent.register_memory([src, dst])
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [src])
    remote = agent.prep_xfer_dlist("self", [dst])
    h = agent.make_prepped_xfer(op, local, [0], remote, [0], b"local")
    wait_xfer(agent, h, state=agent.transfer(h), timeout=60)
    assert agent.query_xfer_backend(h) == "LOCAL"
    torch.cuda.synchronize()
    assert torch.equal(src, dst)
    wait_for(lambda: agent.check_remote_xfer_done("self", b"local"), what="notification")


@pytest.fixture(params=[["UCX"], ["CUDA_IPC"]], ids=["default", "CUDA_IPC"])
def gpu_peer(request):
    backends = request.param
    if backends == ["CUDA_IPC"] and IMPL != "ours":
        pytest.skip("CUDA_IPC is our backend")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    import _gpu_peer

    proc = ctx.Process(target=_gpu_peer.serve, args=(IMPL, backends, SIZE, child), daemon=True)
    proc.start()
    child.close()  # the child's end lives in the child: its exit closes the pipe
    assert parent.poll(120), "GPU peer process did not start"
    hello = parent.recv()
    hello["conn"] = parent
    hello["backends"] = backends
    yield hello
    try:
        if proc.is_alive():
            parent.send(("bye",))
            parent.poll(10) and parent.recv()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()


def test_cuda_tensors_two_processes(gpu_peer):
    peer = gpu_peer
    conn = peer["conn"]
    a = make("gpu-initiator", peer["backends"])
    src = gpu_pattern(SIZE, 17)
    back = torch.zeros(SIZE, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    a.register_memory([src, back])
    assert a.add_remote_agent(peer["metadata"]) == b"gpu-target"
    n = SIZE // CHUNK
    rows = [(peer["addr"] + i * CHUNK, CHUNK, 0) for i in range(n)]
    remote = a.prep_xfer_dlist("gpu-target", rows, "VRAM")
    local = a.prep_xfer_dlist(
        "NIXL_INIT_AGENT", [src[i * CHUNK : (i + 1) * CHUNK] for i in range(n)]
    )
    h = a.make_prepped_xfer("WRITE", local, list(range(n)), remote, list(range(n)), b"w")
    wait_xfer(a, h, state=a.transfer(h), timeout=60)
    conn.send(("await", b"w"))
    assert conn.poll(60)
    status, data = conn.recv()
    assert status == "ok"
    assert data == src.cpu().numpy().tobytes()
    conn.send(("fill",))
    assert conn.poll(60) and conn.recv() == ("ok",)
    into = a.prep_xfer_dlist(
        "NIXL_INIT_AGENT", [back[i * CHUNK : (i + 1) * CHUNK] for i in range(n)]
    )
    r = a.make_prepped_xfer("READ", into, list(range(n)), remote, list(range(n)))
    wait_xfer(a, r, state=a.transfer(r), timeout=60)
    torch.cuda.synchronize()
    expect = torch.arange(SIZE, dtype=torch.int64, device="cuda:0").remainder(251).to(torch.uint8)
    assert torch.equal(back, expect)
    if peer["backends"] == ["CUDA_IPC"] or IMPL == "ours":
        # Named, or chosen by the default configuration for VRAM on one node.
        assert a.query_xfer_backend(r) == "CUDA_IPC"
