"""The GPU device API for real: CuPy kernels compiled with ``rdma_nixl.device``'s headers
and options post transfers through handles of the ``GPUNETIO`` backend.

- request form: ``create_xfer_req`` (``initialize_xfer``) + ``create_gpu_xfer_req``; a
  kernel writes with ``nixlGpuPostSingleWriteXferReq<THREAD>`` and signals with
  ``nixlGpuPostSignalXferReq``; Python checks the target's data and signal word;
- memory-view form: ``prep_mem_view`` of a local list and of a remote list
  (``get_remote_descs``); a kernel does ``nixlPut`` then ``nixlAtomicAdd``;
- released and garbage-collected handles: kernels given their bytes get
  ``NIXL_ERR_INVALID_PARAM``;
- one agent (loopback), two agents of one process, and two processes.

Skipped (with the reason printed) without CuPy or a CUDA device; with
``NIXL_REQUIRE_GPU=1`` (the GPU machine) they FAIL instead. Ours only: NIXL's wheel has
no GPUNETIO backend (its device API needs UCX's, on ConnectX).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time

import pytest
from conftest import IMPL, load_api

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
    pytest.skip(f"GPU device-API tests skipped: {_why}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _gpu_is_required():
    if cp is None:
        pytest.fail(f"NIXL_REQUIRE_GPU=1 but {_why}")


api = load_api()
if IMPL == "ours":
    from rdma_nixl import device as D


def gpunetio_agent(name: str):
    return api.nixl_agent(name, api.nixl_agent_config(backends=["GPUNETIO"]))


def pattern(n: int, seed: int):
    return ((cp.arange(n, dtype=cp.int64) * 2654435761 + seed) % 256).astype(cp.uint8)


_module = None


def kernel(name: str):
    global _module
    if _module is None:
        _module = cp.RawModule(code=K.SOURCE, options=D.nvrtc_options())
    return _module.get_function(name)


def vram(arr):
    return (arr.data.ptr, arr.nbytes, arr.device.id)


def outputs(n: int):
    return cp.full(n, K.SENTINEL, dtype=cp.int64)


def write_then_signal(req, length: int):
    out = outputs(1 + THREADS)
    kernel("write_then_signal")((1,), (THREADS,), (req.kernel_arg, cp.uint64(length), out))
    cp.cuda.runtime.deviceSynchronize()
    statuses = out.get().tolist()
    assert statuses == [D.NIXL_SUCCESS] * (1 + THREADS), (
        f"device-API statuses (signal, then each thread's write): {statuses}"
    )


def put_then_add(src_view, dst_view, length: int, value: int):
    out = outputs(7)
    kernel("put_then_add")(
        (1,), (32,), (src_view.kernel_arg, dst_view.kernel_arg, cp.uint64(length),
                      cp.uint64(value), out)
    )
    cp.cuda.runtime.deviceSynchronize()
    return out.get().tolist()


class Target:
    """A target's buffers: data, a signal word and a counter, in VRAM (CuPy) or DRAM
    (numpy)."""

    def __init__(self, mem: str = "VRAM"):
        self.mem = mem
        if mem == "VRAM":
            self.data = cp.zeros(LEN, dtype=cp.uint8)
            self.words = cp.zeros(4, dtype=cp.uint64)  # [signal, counter, spare, spare]
        else:
            import numpy as np

            self.data = np.zeros(LEN, dtype=np.uint8)
            self.words = np.zeros(4, dtype=np.uint64)

    def desc(self, arr, offset=0, length=None):
        if self.mem == "VRAM":
            return (arr.data.ptr + offset, length or arr.nbytes, arr.device.id)
        return (arr.ctypes.data + offset, length or arr.nbytes, 0)

    def register(self, agent):
        agent.register_memory(
            [(*self.desc(self.data), ""), (*self.desc(self.words), "")], self.mem
        )

    @property
    def whole(self):
        return self.desc(self.data)

    @property
    def signal(self):
        return self.desc(self.words, 0, 8)

    @property
    def counter(self):
        return self.desc(self.words, 8, 8)

    def read(self):
        """(data as numpy, words as a list)."""
        if self.mem == "VRAM":
            cp.cuda.runtime.deviceSynchronize()
            return self.data.get(), [int(w) for w in self.words.get()]
        return self.data.copy(), [int(w) for w in self.words]

    def wait(self, index: int, value: int, timeout: float = 10.0):
        """read() once word ``index`` reached ``value`` (or the timeout passed: the
        caller's assertions then fail with what is there)."""
        deadline = time.monotonic() + timeout
        while True:
            data, words = self.read()
            if words[index] >= value or time.monotonic() > deadline:
                return data, words
            time.sleep(0.001)

    def zero_counter(self):
        self.words[1] = 0
        if self.mem == "VRAM":
            cp.cuda.runtime.deviceSynchronize()


def check_request_form(initiator, target_name: str, target: Target, check=None):
    """create_gpu_xfer_req over [data, signal]; two kernel runs; then the handle's release
    on garbage collection, seen by a kernel."""
    src = pattern(LEN, 11)
    one = cp.zeros(1, dtype=cp.uint64)
    initiator.register_memory([(*vram(src), ""), (*vram(one), "")], "VRAM")
    local = initiator.get_xfer_descs([vram(src), vram(one)], "VRAM")
    remote = initiator.get_xfer_descs([target.whole, target.signal], target.mem)
    xfer = initiator.initialize_xfer("WRITE", local, remote, target_name)
    assert initiator.query_xfer_backend(xfer) == "GPUNETIO"
    req = initiator.create_gpu_xfer_req(xfer)
    assert isinstance(req, D.nixl_gpu_xfer_req_handle)
    assert req.count == 2 and req.fields["flags"] & D.SLOT_REQUEST
    assert len(req.raw) == 40 and req.kernel_arg.tobytes() == req.raw
    write_then_signal(req, LEN)
    check = check or (lambda seed, signal: (lambda d, w: (d, w[0]))(*target.wait(0, signal)))
    data, signal = check(11, 1)
    assert signal == 1, "the signal word after one kernel"
    assert (data == src.get()).all(), "the target's data after the kernel's writes"
    src[:] = pattern(LEN, 12)
    cp.cuda.runtime.deviceSynchronize()
    write_then_signal(req, LEN)
    data, signal = check(12, 2)
    assert signal == 2, "the signal word after two kernels"
    assert (data == src.get()).all(), "the target's data after the second kernel"
    # Garbage collection releases the handle: a kernel holding its bytes is refused.
    stale = req.kernel_arg
    key = req.handle
    del req
    gc.collect()
    assert key not in initiator._gpu_handles
    out = outputs(1 + THREADS)
    kernel("write_then_signal")((1,), (THREADS,), (stale, cp.uint64(LEN), out))
    cp.cuda.runtime.deviceSynchronize()
    got = out.get().tolist()
    assert got[0] == D.NIXL_ERR_INVALID_PARAM, f"a collected request's signal: {got[0]}"
    assert set(got[1:]) == {D.NIXL_ERR_INVALID_PARAM}, "a collected request's writes"
    _, signal = check(12, 2)
    assert signal == 2, "a collected request signalled"
    # The request lives on: a new handle works.
    again = initiator.create_gpu_xfer_req(xfer)
    write_then_signal(again, LEN)
    _, signal = check(12, 3)
    assert signal == 3
    initiator.release_gpu_xfer_req(again.handle)
    assert again.released


def check_view_form(initiator, target_name: str, target: Target, mapped_here: bool):
    """prep_mem_view of a local list and of a remote one; put then atomic add; release."""
    src = pattern(LEN, 21)
    initiator.register_memory([(*vram(src), "")], "VRAM")
    local = initiator.prep_mem_view(initiator.get_xfer_descs([vram(src)], "VRAM"))
    remote_list = initiator.get_remote_descs(
        [(*target.whole, target_name), (*target.counter, target_name)], target.mem
    )
    remote = initiator.prep_mem_view(remote_list, backends=["GPUNETIO"])
    assert isinstance(local, D.nixl_mem_view_handle)
    assert local.fields["flags"] & D.SLOT_VIEW and local.fields["flags"] & D.SLOT_LOCAL
    assert remote.fields["flags"] & D.SLOT_VIEW and not remote.fields["flags"] & D.SLOT_LOCAL
    assert (local.count, remote.count) == (1, 2)
    target.zero_counter()
    got = put_then_add(local, remote, LEN, 5)
    assert got[0] == D.NIXL_SUCCESS, f"nixlPut: {got}"
    assert got[1] == D.NIXL_SUCCESS, f"nixlAtomicAdd: {got}"
    assert got[2] == D.NIXL_ERR_INVALID_PARAM, f"a put past the element: {got}"
    assert got[3] == D.NIXL_ERR_INVALID_PARAM, f"views swapped: {got}"
    assert got[4] == src.data.ptr, f"nixlGetPtr of the local element: {got}"
    if mapped_here:
        assert got[5] != 0, f"nixlGetPtr of a mapped remote element: {got}"
    assert got[6] == 0, f"nixlGetPtr of a bad index: {got}"
    return {"local": local, "remote": remote}, src


def check_stale_views(initiator, views: dict):
    """Releases the remote view by its int and lets the local one be collected (``views``
    holds the only references); kernels given their bytes are refused."""
    stale_local, stale_remote = views["local"].kernel_arg, views["remote"].kernel_arg
    remote = views.pop("remote")
    initiator.release_mem_view(remote.handle)  # NIXL's callers hold ints
    assert remote.released
    key = views["local"].handle
    del views["local"]
    gc.collect()
    assert key not in initiator._gpu_handles, "the local view was not collected"
    got = put_then_add_stale(stale_local, stale_remote)
    assert got[0] == D.NIXL_ERR_INVALID_PARAM and got[1] == D.NIXL_ERR_INVALID_PARAM, got
    assert got[4] == 0 and got[5] == 0, f"nixlGetPtr of released views: {got}"


def put_then_add_stale(src_arg, dst_arg):
    out = outputs(7)
    kernel("put_then_add")((1,), (32,), (src_arg, dst_arg, cp.uint64(8), cp.uint64(1), out))
    cp.cuda.runtime.deviceSynchronize()
    return out.get().tolist()


# --- one agent (loopback) ----------------------------------------------------------------


def test_headers_compile_with_cupy_and_a_signal_is_prepared():
    agent = gpunetio_agent("gn-signal")
    assert agent.get_backend_mem_types("GPUNETIO") == ["DRAM_SEG", "VRAM_SEG"]
    kernel("write_then_signal")  # compiles the test kernels with the package's options
    arch = D.gpu_arch(0)
    cc = cp.cuda.Device(0).compute_capability
    assert arch == f"compute_{cc}"
    words = cp.full(4, 77, dtype=cp.uint64)
    cp.cuda.runtime.deviceSynchronize()
    agent.prep_gpu_signal([(words.data.ptr + 8, 16, 0)], "VRAM")
    assert words.get().tolist() == [77, 0, 77, 77], "prep_gpu_signal zeroes 8 bytes"
    D.prep_gpu_signal(words.data.ptr, 0)
    assert words.get().tolist() == [0, 0, 77, 77]
    host = cp.cuda.alloc_pinned_memory(64)
    with pytest.raises(api.nixlBind.nixlInvalidParamError):
        D.prep_gpu_signal(host.ptr, 0)  # not device memory


def test_request_form_loopback():
    agent = gpunetio_agent("gn-self")
    target = Target()
    target.register(agent)
    check_request_form(agent, "gn-self", target)


def test_request_form_with_torch_tensors():
    """Descriptors from torch CUDA tensors (as vLLM's connectors pass them), kernels from
    CuPy: both on the device's primary context."""
    try:
        import torch
    except ImportError as e:
        if os.environ.get("NIXL_REQUIRE_GPU") == "1":
            pytest.fail(f"NIXL_REQUIRE_GPU=1 but torch is missing: {e}")
        pytest.skip(f"torch is not installed ({e})")
    agent = gpunetio_agent("gn-torch")
    src = torch.arange(LEN, dtype=torch.int64, device="cuda:0").remainder(253).to(torch.uint8)
    dst = torch.zeros(LEN, dtype=torch.uint8, device="cuda:0")
    words = torch.zeros(2, dtype=torch.int64, device="cuda:0")
    one = torch.zeros(1, dtype=torch.int64, device="cuda:0")
    torch.cuda.synchronize()
    agent.register_memory([src, dst, words, one])
    local = agent.get_xfer_descs([src, one])
    remote = agent.get_xfer_descs([dst, words[:1]])
    assert remote.getType() == api.nixlBind.VRAM_SEG
    xfer = agent.initialize_xfer("WRITE", local, remote, "gn-torch")
    req = agent.create_gpu_xfer_req(xfer)
    write_then_signal(req, LEN)
    torch.cuda.synchronize()
    assert torch.equal(dst, src), "the tensor written by the kernel"
    assert words.tolist() == [1, 0], "the signal word (and nothing past it)"
    agent.prep_gpu_signal(words[:1])
    assert words.tolist() == [0, 0], "prep_gpu_signal on a tensor"


def test_memory_views_loopback():
    agent = gpunetio_agent("gn-views")
    target = Target()
    target.register(agent)
    views, src = check_view_form(agent, "gn-views", target, mapped_here=True)
    data, words = target.wait(1, 5)
    assert (data == src.get()).all(), "the put's data"
    assert words[1] == 5, "the atomic add"
    check_stale_views(agent, views)
    assert target.read()[1][1] == 5, "a released view added"


def test_a_non_device_backend_next_to_gpunetio_is_refused_by_name():
    agent = api.nixl_agent("gn-mixed", api.nixl_agent_config(backends=["GPUNETIO", "LOCAL"]))
    buf = cp.zeros(64, dtype=cp.uint8)
    agent.register_memory([(*vram(buf), "")], "VRAM")
    dlist = agent.get_xfer_descs([vram(buf)], "VRAM")
    with pytest.raises(api.nixlBind.nixlNotSupportedError) as e:
        agent.prep_mem_view(dlist, backends=["LOCAL"])
    assert e.value.backend == "LOCAL"
    view = agent.prep_mem_view(dlist, backends=["LOCAL", "GPUNETIO"])  # tried in order
    assert view.count == 1
    xfer = agent.initialize_xfer("WRITE", dlist, dlist, "gn-mixed", backends=["LOCAL"])
    with pytest.raises(api.nixlBind.nixlNotSupportedError):
        agent.create_gpu_xfer_req(xfer)


# --- two agents of one process -------------------------------------------------------------


# A peer's VRAM is reached by the intra-node path (another agent of this process: its
# addresses as they are, since CUDA refuses to open an IPC handle in the exporting
# process); a peer's DRAM through the NIC path (the CPU proxy over libfabric).


@pytest.mark.parametrize("target_mem", ["VRAM", "DRAM"])
def test_two_agents_in_one_process(target_mem):
    a = gpunetio_agent(f"gn-a-{target_mem}")
    b = gpunetio_agent(f"gn-b-{target_mem}")
    target = Target(target_mem)
    target.register(b)
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    check_request_form(a, b.name, target)
    views, src = check_view_form(a, b.name, target, mapped_here=target_mem == "VRAM")
    data, words = target.wait(1, 5)
    assert (data == src.get()).all(), "the put's data at b"
    assert words[1] == 5, "the atomic add at b"
    check_stale_views(a, views)


# --- two processes -------------------------------------------------------------------------


@pytest.fixture
def gpunetio_peer():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    import _gpu_device_peer

    proc = ctx.Process(target=_gpu_device_peer.serve, args=(LEN, child), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(180), "the GPUNETIO peer process did not start"
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


def test_two_processes(gpunetio_peer):
    peer = gpunetio_peer
    conn = peer["conn"]
    a = gpunetio_agent("gn-initiator")
    assert a.add_remote_agent(peer["metadata"]) == b"gn-peer"
    class Remote:  # the peer's buffers, by address
        data = (peer["data"], LEN, 0)
        signal = (peer["words"], 8, 0)
        counter = (peer["words"] + 8, 8, 0)

    def at_peer(seed, signal):
        conn.send(("check", seed, signal))
        assert conn.poll(60), "the peer did not answer"
        status, data, seen = conn.recv()
        assert status == "ok", status
        import numpy as np

        return np.frombuffer(data, dtype=np.uint8), seen

    src = pattern(LEN, 11)
    one = cp.zeros(1, dtype=cp.uint64)
    a.register_memory([(*vram(src), ""), (*vram(one), "")], "VRAM")
    remote = a.get_xfer_descs([Remote.data, Remote.signal], "VRAM")
    xfer = a.initialize_xfer("WRITE", a.get_xfer_descs([vram(src), vram(one)], "VRAM"), remote,
                             "gn-peer")
    req = a.create_gpu_xfer_req(xfer)
    for seed, expect in ((11, 1), (12, 2)):
        src[:] = pattern(LEN, seed)
        cp.cuda.runtime.deviceSynchronize()
        write_then_signal(req, LEN)
        data, signal = at_peer(seed, expect)
        assert signal == expect, f"the peer's signal word: {signal}"
        assert (data == src.get()).all(), f"the peer's data (seed {seed})"
    a.release_gpu_xfer_req(req)
    # The memory-view form against the peer.
    lv = a.prep_mem_view(a.get_xfer_descs([vram(src)], "VRAM"))
    rv = a.prep_mem_view(
        a.get_remote_descs([(*Remote.data, "gn-peer"), (*Remote.counter, "gn-peer")], "VRAM")
    )
    src[:] = pattern(LEN, 31)
    cp.cuda.runtime.deviceSynchronize()
    got = put_then_add(lv, rv, LEN, 5)
    assert got[:4] == [0, 0, D.NIXL_ERR_INVALID_PARAM, D.NIXL_ERR_INVALID_PARAM], got
    conn.send(("counter",))
    assert conn.poll(60)
    status, data, counter = conn.recv()
    assert status == "ok" and counter == 5, (status, counter)
    import numpy as np

    assert (np.frombuffer(data, dtype=np.uint8) == src.get()).all(), "the put's data at the peer"
