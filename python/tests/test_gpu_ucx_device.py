"""The device API behind NIXL's backend name ``UCX`` (what NIXL's ``test_prep_mem_view``
needs): agents made with the default configuration (``backends=["UCX"]``) get a
``GPUNETIO`` backend at their first VRAM registration, and serve ``prep_mem_view`` and
``create_gpu_xfer_req`` through it:

- ``_bindings.HAVE_UCX_GPU_DEVICE_API`` is true on a GPU machine (NVRTC loads);
- which registrations the device backend takes (VRAM of its GPU, not DRAM);
- two processes, each on its own GPU where there are two (else both on GPU 0), as
  NIXL's test runs them: memory views of local and remote lists are ints (non-zero),
  a CuPy kernel ``nixlPut``s into the peer's VRAM and ``nixlAtomicAdd``s its counter,
  the request form (a request UCX's transfer backend carries, made again on the device
  backend) writes and signals; the peer checks every byte;
- a host-posted WRITE (CUDA_IPC) and a memory view (GPUNETIO) of the same peer memory
  in one process, one after the other (both import the peer's allocation).

Skipped (with the reason printed) without CuPy or a CUDA device; with
``NIXL_REQUIRE_GPU=1`` (the GPU machine) they FAIL instead. Ours only.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from conftest import IMPL, load_api, load_module

import _device_kernels as K

pytestmark = pytest.mark.ours_only

LEN = 1 << 20
THREADS = 256


def _cupy_or_reason():
    try:
        import cupy
    except ImportError as e:
        return None, f"cupy is not installed ({e})"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None, "CuPy sees no CUDA device"
    except Exception as e:  # noqa: BLE001 - any CUDA failure means no usable GPU
        return None, f"CuPy sees no CUDA device ({e})"
    return cupy, None


cp, _why = _cupy_or_reason() if IMPL == "ours" else (None, "ours only")
if cp is None and os.environ.get("NIXL_REQUIRE_GPU") != "1":
    pytest.skip(f"UCX device-API tests skipped: {_why}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _gpu_is_required():
    if cp is None:
        pytest.fail(f"NIXL_REQUIRE_GPU=1 but {_why}")


api = load_api()
B = load_module("_bindings")
if IMPL == "ours":
    from rdma_nixl import device as D

_module = None


def kernel(name: str):
    global _module
    if _module is None:
        _module = cp.RawModule(code=K.SOURCE, options=D.nvrtc_options())
    return _module.get_function(name)


def pattern(n: int, seed: int):
    return ((cp.arange(n, dtype=cp.int64) * 2654435761 + seed) % 256).astype(cp.uint8)


def vram(arr):
    return (arr.data.ptr, arr.nbytes, arr.device.id)


def outputs(n: int):
    return cp.full(n, K.SENTINEL, dtype=cp.int64)


def ucx_agent(name: str):
    return api.nixl_agent(name, api.nixl_agent_config())  # NIXL's default: UCX


def test_the_flag_is_true_on_a_gpu_machine():
    assert B.HAVE_UCX_GPU_DEVICE_API, (
        "the device path behind UCX is missing: " + str(B._ucx_device_api_unavailable())
    )


def test_the_first_vram_registration_adds_the_device_backend():
    import numpy as np

    agent = ucx_agent("ucx-first-vram")
    host = np.zeros(4096, dtype=np.uint8)
    agent.register_memory([(host.ctypes.data, host.nbytes, 0, "")], "DRAM")
    assert "GPUNETIO" not in agent.backends, "DRAM adds no device backend"
    with cp.cuda.Device(0):
        buf = cp.zeros(LEN, dtype=cp.uint8)
    agent.register_memory([(*vram(buf), "")], "VRAM")
    assert "GPUNETIO" in agent.backends, agent._ucx_device_why
    assert agent._ucx_device_gpu == 0
    assert agent.get_backend_params("GPUNETIO")["nic_handler"] == "intra_node"
    # GPUNETIO answers for a GPU pair ("A:B", as CUDA_IPC): GPU 0 with itself.
    (info,) = agent.query_memory([(*vram(buf), "0:0")], "GPUNETIO", "VRAM")
    assert info is not None and info["path"] == "same-gpu", info
    assert info["handler"] == "intra_node", info
    with pytest.raises(B.nixlNotSupportedError):
        agent.query_memory([(host.ctypes.data, host.nbytes, 0, "")], "GPUNETIO", "DRAM")
    # A local memory view: an int, as NIXL's.
    view = agent.prep_mem_view(agent.get_xfer_descs([vram(buf)], "VRAM"))
    assert isinstance(view, int) and view != 0
    agent.release_mem_view(int(view))
    assert view.released


@pytest.fixture
def ucx_peer():
    ngpu = cp.cuda.runtime.getDeviceCount()
    gpu = 1 if ngpu >= 2 else 0
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    import _gpu_device_peer

    proc = ctx.Process(
        target=_gpu_device_peer.serve,
        args=(LEN, child, ("UCX",), gpu, "ucx-peer"),
        daemon=True,
    )
    proc.start()
    child.close()
    assert parent.poll(180), "the UCX peer process did not start"
    hello = parent.recv()
    assert "error" not in hello, hello.get("error")
    hello["conn"] = parent
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
    assert proc.exitcode == 0, f"the peer process exited with {proc.exitcode}"


def test_two_processes_through_ucx(ucx_peer):
    import numpy as np

    peer = ucx_peer
    conn = peer["conn"]
    assert "GPUNETIO" in peer["backends"], f"the peer's backends: {peer['backends']}"
    a = ucx_agent("ucx-initiator")
    with cp.cuda.Device(0):
        src = pattern(LEN, 11)
        one = cp.zeros(1, dtype=cp.uint64)
        cp.cuda.runtime.deviceSynchronize()
        a.register_memory([(*vram(src), ""), (*vram(one), "")], "VRAM")
    assert "GPUNETIO" in a.backends, a._ucx_device_why
    assert a.add_remote_agent(peer["metadata"]) == b"ucx-peer"
    g = peer["gpu"]
    data = (peer["data"], LEN, g)
    signal = (peer["words"], 8, g)
    counter = (peer["words"] + 8, 8, g)

    # Memory views, as NIXL's test_prep_mem_view makes them: ints, not 0.
    lv = a.prep_mem_view(a.get_xfer_descs([vram(src)], "VRAM"))
    rv = a.prep_mem_view(
        a.get_remote_descs([(*data, "ucx-peer"), (*counter, "ucx-peer")], "VRAM")
    )
    for v in (lv, rv):
        assert isinstance(v, int) and v != 0
    out = outputs(7)
    with cp.cuda.Device(0):
        src[:] = pattern(LEN, 31)
        cp.cuda.runtime.deviceSynchronize()
        kernel("put_then_add")(
            (1,), (32,), (lv.kernel_arg, rv.kernel_arg, cp.uint64(LEN), cp.uint64(5), out)
        )
        cp.cuda.runtime.deviceSynchronize()
    got = out.get().tolist()
    assert got[:2] == [D.NIXL_SUCCESS, D.NIXL_SUCCESS], f"nixlPut / nixlAtomicAdd: {got}"
    conn.send(("counter",))
    assert conn.poll(60), "the peer did not answer"
    status, at_peer, count = conn.recv()
    assert status == "ok" and count == 5, (status, count)
    assert (np.frombuffer(at_peer, dtype=np.uint8) == src.get()).all(), "the put's data"
    a.release_mem_view(lv)
    a.release_mem_view(int(rv))  # NIXL's callers hold ints
    assert lv.released and rv.released

    # The request form: a request of UCX's transfer backend (named, so LIBFABRIC: the
    # peer's memory is imported by GPUNETIO alone), posted by a kernel.
    xfer = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([vram(src), vram(one)], "VRAM"),
        a.get_xfer_descs([data, signal], "VRAM"),
        "ucx-peer",
        backends=["UCX"],
    )
    assert a.query_xfer_backend(xfer) == "UCX"
    req = a.create_gpu_xfer_req(xfer)
    assert isinstance(req, int) and req != 0
    with cp.cuda.Device(0):
        src[:] = pattern(LEN, 12)
        cp.cuda.runtime.deviceSynchronize()
        status_out = outputs(1 + THREADS)
        kernel("write_then_signal")((1,), (THREADS,), (req.kernel_arg, cp.uint64(LEN), status_out))
        cp.cuda.runtime.deviceSynchronize()
    statuses = status_out.get().tolist()
    assert statuses == [D.NIXL_SUCCESS] * (1 + THREADS), statuses
    conn.send(("check", 12, 1))
    assert conn.poll(60), "the peer did not answer"
    status, at_peer, seen = conn.recv()
    assert status == "ok" and seen == 1, (status, seen)
    assert (np.frombuffer(at_peer, dtype=np.uint8) == src.get()).all(), "the kernel's writes"
    a.release_gpu_xfer_req(req)
    a.release_xfer_handle(xfer)


def test_a_host_transfer_and_a_view_of_the_same_peer_memory(ucx_peer):
    # NIXL's default configuration carries VRAM to a peer on this node through CUDA_IPC
    # (host-posted) and memory views through GPUNETIO: both import the peer's
    # allocation into this process, one after the other.
    import numpy as np

    peer = ucx_peer
    conn = peer["conn"]
    a = ucx_agent("ucx-both")
    with cp.cuda.Device(0):
        src = pattern(LEN, 41)
        one = cp.ones(1, dtype=cp.uint64)
        cp.cuda.runtime.deviceSynchronize()
        a.register_memory([(*vram(src), ""), (*vram(one), "")], "VRAM")
    a.add_remote_agent(peer["metadata"])
    g = peer["gpu"]
    data = (peer["data"], LEN, g)
    signal = (peer["words"], 8, g)
    counter = (peer["words"] + 8, 8, g)
    xfer = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([vram(src), vram(one)], "VRAM"),
        a.get_xfer_descs([data, signal], "VRAM"),
        "ucx-peer",
    )
    assert a.query_xfer_backend(xfer) == "CUDA_IPC"
    state = a.transfer(xfer)
    while state != "DONE":
        state = a.check_xfer_state(xfer)
    conn.send(("check", 41, 1))
    assert conn.poll(60), "the peer did not answer"
    status, at_peer, seen = conn.recv()
    assert status == "ok" and seen == 1, (status, seen)
    assert (np.frombuffer(at_peer, dtype=np.uint8) == src.get()).all(), "the host WRITE"
    # Now a view of the same peer memory, and a kernel's put into it.
    lv = a.prep_mem_view(a.get_xfer_descs([vram(src)], "VRAM"))
    rv = a.prep_mem_view(
        a.get_remote_descs([(*data, "ucx-peer"), (*counter, "ucx-peer")], "VRAM")
    )
    out = outputs(7)
    with cp.cuda.Device(0):
        src[:] = pattern(LEN, 43)
        cp.cuda.runtime.deviceSynchronize()
        kernel("put_then_add")(
            (1,), (32,), (lv.kernel_arg, rv.kernel_arg, cp.uint64(LEN), cp.uint64(5), out)
        )
        cp.cuda.runtime.deviceSynchronize()
    got = out.get().tolist()
    assert got[:2] == [D.NIXL_SUCCESS, D.NIXL_SUCCESS], f"nixlPut / nixlAtomicAdd: {got}"
    conn.send(("counter",))
    assert conn.poll(60), "the peer did not answer"
    status, at_peer, count = conn.recv()
    assert status == "ok" and count == 5, (status, count)
    assert (np.frombuffer(at_peer, dtype=np.uint8) == src.get()).all(), "the put's data"
    # And the host path once more, after the view.
    state = a.transfer(xfer)
    while state != "DONE":
        state = a.check_xfer_state(xfer)


def test_the_callers_current_device_is_kept():
    """An engine that works on GPU 1 (``torch.cuda.set_device(1)``, CuPy's ``Device(1)``)
    creates its agent, registers and transfers: its current device stays GPU 1 (the
    agent binds other GPUs' contexts internally; the runtime's current device follows
    the current context, so later allocations would move to GPU 0)."""
    if cp.cuda.runtime.getDeviceCount() < 2:
        import os

        if os.environ.get("NIXL_REQUIRE_GPU") == "1":
            pytest.fail("NIXL_REQUIRE_GPU=1 but this test needs 2 GPUs")
        pytest.skip("needs 2 GPUs")
    with cp.cuda.Device(1):
        agent = ucx_agent("ucx-keeps-device")
        assert cp.cuda.runtime.getDevice() == 1, "creating the agent changed the device"
        buf = cp.zeros(LEN, dtype=cp.uint8)
        assert buf.device.id == 1
        agent.register_memory([(*vram(buf), "")], "VRAM")
        assert cp.cuda.runtime.getDevice() == 1, "registering VRAM changed the device"
        other = cp.zeros(16, dtype=cp.uint8)
        assert other.device.id == 1
        # And the allocation really is on GPU 1 (what the agent checks at registration).
        agent.register_memory([(*vram(other), "")], "VRAM")
        assert cp.cuda.runtime.getDevice() == 1
