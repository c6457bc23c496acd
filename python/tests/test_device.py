"""The GPU device API's host side, on any machine (no GPU needed): remote descriptor
lists as NIXL builds them, typed refusals where no backend has a device API, bad input,
handle objects (kernel-argument bytes, release, release on garbage collection), the
device headers and NVRTC options (compiled with NVRTC where it is installed).

With a GPU, tests/test_gpu_device.py runs kernels on real handles.
"""

from __future__ import annotations

import gc
import os
import re
import struct

import pytest
from conftest import IMPL, load_api

import _device_kernels as K

api = load_api()
ours = pytest.mark.ours_only

if IMPL == "ours":
    from rdma_nixl import _core
    from rdma_nixl import device as D
    from rdma_nixl._bindings import (
        nixlError,
        nixlInvalidParamError,
        nixlNotFoundError,
        nixlNotSupportedError,
        nixlRemoteDList,
    )


def dram_agent(name: str, backends=("LOCAL",)):
    import numpy as np

    agent = api.nixl_agent(name, api.nixl_agent_config(backends=list(backends)))
    buf = np.zeros(256, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    return agent, buf


# --- remote lists (NIXL's behaviour: these also run on NIXL's wheel) ------------------


def test_get_remote_descs_builds_a_remote_list_from_4_tuples():
    agent = api.nixl_agent("remote-lists", api.nixl_agent_config(backends=[]))
    rows = [(0x1000, 64, 0, "peer"), (0x2000, 8, 1, "peer")]
    remote = agent.get_remote_descs(rows, "VRAM")
    assert remote is not None
    assert type(remote).__name__ == "nixlRemoteDList"
    assert remote.descCount() == 2
    assert remote.getType() == api.nixlBind.VRAM_SEG
    # A remote list is passed through unchanged.
    assert agent.get_remote_descs(remote) is remote


def test_get_remote_descs_refuses_other_forms_with_none():
    agent = api.nixl_agent("remote-none", api.nixl_agent_config(backends=[]))
    assert agent.get_remote_descs([(0x1000, 64, 0, "peer")]) is None  # no mem type
    assert agent.get_remote_descs([(0x1000, 64, 0)], "VRAM") is None  # no agent name
    assert agent.get_remote_descs("not a list", "VRAM") is None


@ours
def test_remote_lists_keep_agent_names_and_pickle():
    import pickle

    remote = nixlRemoteDList(api.nixlBind.VRAM_SEG, [(0x1000, 64, 0, "a"), (0x2000, 8, 0, b"b")])
    assert remote[0] == (0x1000, 64, 0, "a")
    assert remote.agents() == ["a", "b"]
    assert pickle.loads(pickle.dumps(remote)) == remote
    remote.append((0x3000, 16, 0, "c"))
    assert remote[-1] == (0x3000, 16, 0, "c")
    with pytest.raises(ValueError):
        remote.append((0x4000, 16, 0))  # no agent name
    with pytest.raises(ValueError):
        nixlRemoteDList(api.nixlBind.VRAM_SEG, [(0x1000, 64, 0, 7)])


# --- refusals where no backend has a device API ----------------------------------------


@ours
@pytest.mark.parametrize("backend", ["LOCAL", "LIBFABRIC"])
def test_backends_without_a_device_api_raise_not_supported(backend):
    agent, buf = dram_agent(f"nodev-{backend}", [backend])
    local = agent.get_xfer_descs([(buf.ctypes.data, 128, 0)], "DRAM")
    remote = agent.get_remote_descs([(buf.ctypes.data + 128, 128, 0, agent.name)], "DRAM")
    for dlist in (local, remote):
        with pytest.raises(nixlNotSupportedError) as e:
            agent.prep_mem_view(dlist)
        assert e.value.kind == "NotSupported"
        assert e.value.backend == backend
        with pytest.raises(nixlNotSupportedError):
            agent.prep_mem_view(dlist, backends=[backend])
    xfer = agent.initialize_xfer(
        "WRITE", local, agent.get_xfer_descs([(buf.ctypes.data + 128, 128, 0)], "DRAM"),
        agent.name,
    )
    with pytest.raises(nixlNotSupportedError) as e:
        agent.create_gpu_xfer_req(xfer)
    assert e.value.kind == "NotSupported"
    assert e.value.backend == backend
    assert not agent._gpu_handles, "a refused request left a handle behind"


@ours
def test_gpunetio_without_a_gpu_is_a_typed_backend_error():
    try:
        D.gpu_arch(0)
    except nixlError:
        pass
    else:
        pytest.skip("this machine has a GPU: tests/test_gpu_device.py creates GPUNETIO")
    agent = api.nixl_agent("nogpu", api.nixl_agent_config(backends=[]))
    assert "GPUNETIO" in agent.get_plugin_list()
    assert agent.get_plugin_params("GPUNETIO")["cuda_streams"] == "4"
    with pytest.raises(api.nixlBind.nixlBackendError) as e:
        agent.create_backend("GPUNETIO")
    assert e.value.kind == "Gpu"
    assert "GPUNETIO" not in agent.backends
    with pytest.raises(api.nixlBind.nixlBackendError):
        D.prep_gpu_signal(0x10000, 0)
    with pytest.raises(api.nixlBind.nixlBackendError):
        D.nvrtc_options(device=0)


# --- bad input ----------------------------------------------------------------------------


@ours
def test_prep_mem_view_bad_input_raises_typed_errors():
    agent, buf = dram_agent("badview")
    addr = buf.ctypes.data
    # Not a descriptor list: TypeError, as NIXL's bindings, and our InvalidParam.
    for bad in ([(addr, 8, 0)], "x", None, agent.get_reg_descs([(addr, 8, 0, "")], "DRAM")):
        with pytest.raises(TypeError):
            agent.prep_mem_view(bad)
        with pytest.raises(nixlInvalidParamError):
            agent.prep_mem_view(bad)
    with pytest.raises(nixlInvalidParamError, match="at least one"):
        agent.prep_mem_view(api.nixlBind.nixlXferDList(api.nixlBind.DRAM_SEG, []))
    two = agent.get_remote_descs([(addr, 8, 0, "p"), (addr + 8, 8, 0, "q")], "DRAM")
    with pytest.raises(nixlInvalidParamError, match="one agent"):
        agent.prep_mem_view(two)
    import numpy as np

    nameless = nixlRemoteDList(api.nixlBind.DRAM_SEG, np.array([[addr, 8, 0]], dtype=np.uint64))
    with pytest.raises(nixlInvalidParamError, match="one agent"):
        agent.prep_mem_view(nameless)
    unknown = agent.get_remote_descs([(addr, 8, 0, "nobody")], "DRAM")
    with pytest.raises(nixlNotFoundError) as e:
        agent.prep_mem_view(unknown)
    assert e.value.kind == "UnknownAgent"
    unregistered = agent.get_xfer_descs([(0x10, 8, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):
        agent.prep_mem_view(unregistered)
    with pytest.raises(KeyError):
        agent.prep_mem_view(agent.get_xfer_descs([(addr, 8, 0)], "DRAM"), backends=["NOPE"])


@ours
def test_create_gpu_xfer_req_bad_input_raises_typed_errors():
    agent, buf = dram_agent("badreq")
    addr = buf.ctypes.data
    with pytest.raises(TypeError):
        agent.create_gpu_xfer_req("not a request")
    with pytest.raises(nixlInvalidParamError):
        agent.create_gpu_xfer_req(None)
    xfer = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs([(addr, 8, 0)], "DRAM"),
        agent.get_xfer_descs([(addr + 8, 8, 0)], "DRAM"),
        agent.name,
    )
    agent.release_xfer_handle(xfer)
    with pytest.raises(nixlInvalidParamError, match="released"):
        agent.create_gpu_xfer_req(xfer)


@ours
def test_release_methods_refuse_what_they_do_not_hold():
    agent, _ = dram_agent("badrelease")
    with pytest.raises(nixlInvalidParamError, match="not a live"):
        agent.release_mem_view(12345)
    with pytest.raises(nixlInvalidParamError, match="not a live"):
        agent.release_gpu_xfer_req(12345)
    with pytest.raises(TypeError):
        agent.release_mem_view("12345")
    with pytest.raises(TypeError):
        agent.release_mem_view(True)
    view = agent._device_handle(D.nixl_mem_view_handle, _core._test_gpu_handle("mem_view", 64))
    # A view is not a request handle, by object or by int.
    with pytest.raises(TypeError):
        agent.release_gpu_xfer_req(view)
    with pytest.raises(nixlInvalidParamError):
        agent.release_gpu_xfer_req(view.handle)
    assert not view.released


@ours
def test_prep_gpu_signal_bad_input_raises_typed_errors():
    import numpy as np

    agent, buf = dram_agent("badsignal")
    assert agent.get_gpu_signal_size() == 8 == D.get_gpu_signal_size() == D.GPU_SIGNAL_SIZE
    with pytest.raises(nixlInvalidParamError, match="VRAM"):
        agent.prep_gpu_signal([(buf.ctypes.data, 8, 0)], "DRAM")
    with pytest.raises(nixlInvalidParamError, match="VRAM"):
        agent.prep_gpu_signal([(buf.ctypes.data, 8, 0, "")], "DRAM")
    with pytest.raises(nixlInvalidParamError, match="a signal needs 8"):
        agent.prep_gpu_signal([(0x10000, 4, 0)], "VRAM")
    with pytest.raises(nixlInvalidParamError, match="aligned"):
        agent.prep_gpu_signal([(0x10004, 8, 0)], "VRAM")
    with pytest.raises(TypeError):
        agent.prep_gpu_signal("x")
    with pytest.raises(nixlInvalidParamError):
        D.prep_gpu_signal(0)
    with pytest.raises(nixlInvalidParamError):
        D.prep_gpu_signal(0x10000, -1)
    assert np is not None


# --- handle objects -------------------------------------------------------------------


def _test_handle(kind="mem_view", slot=0xABC0):
    cls = D.nixl_mem_view_handle if kind == "mem_view" else D.nixl_gpu_xfer_req_handle
    return cls(_core._test_gpu_handle(kind, slot))


@ours
def test_a_handle_exposes_the_kernel_argument_in_every_form():
    import ctypes

    import numpy as np

    h = _test_handle(slot=0x7F00_0000_1230)
    raw = h.raw
    assert isinstance(raw, bytes) and len(raw) == D.HANDLE_SIZE == 40
    slot, gen, descs, qp, count, flags = struct.unpack("<QQQQII", raw)
    assert h.fields == {
        "slot": slot,
        "generation": gen,
        "descs": descs,
        "qp": qp,
        "count": count,
        "flags": flags,
    }
    assert (slot, gen, descs, qp, count, flags) == (0x7F00_0000_1230, 1, 0x1000, 0x2000, 3, 2)
    assert h.count == 3
    arg = h.kernel_arg
    assert isinstance(arg, np.void)
    assert arg.dtype == D.handle_dtype() and arg.dtype.itemsize == 40
    assert arg.tobytes() == raw
    assert int(arg["slot"]) == slot and int(arg["flags"]) == flags
    c = h.as_ctypes()
    assert ctypes.sizeof(c) == 40 and bytes(c) == raw and c.count == 3
    assert int(h) == h.handle and isinstance(h.handle, int)
    assert h.handle != _test_handle().handle, "handle ints are unique"
    assert "released=False" in repr(h)


@ours
def test_a_handle_is_released_once_explicitly_or_by_garbage_collection():
    before = _core._test_released()
    h = _test_handle()
    raw = h.raw
    h.release()
    assert h.released
    assert _core._test_released() == before + 1
    h.release()  # idempotent
    del h
    gc.collect()
    assert _core._test_released() == before + 1, "released twice"
    # Dropped without release: garbage collection releases it.
    h = _test_handle("xfer_req")
    assert raw  # the bytes of a released handle stay readable
    del h
    gc.collect()
    assert _core._test_released() == before + 2
    # In a reference cycle too.
    h = _test_handle()
    cycle = [h]
    cycle.append(cycle)
    del h, cycle
    gc.collect()
    assert _core._test_released() == before + 3


@ours
def test_the_agent_releases_handles_by_object_or_int_and_forgets_collected_ones():
    agent, _ = dram_agent("releaser")
    before = _core._test_released()
    view = agent._device_handle(D.nixl_mem_view_handle, _core._test_gpu_handle("mem_view", 8))
    req = agent._device_handle(
        D.nixl_gpu_xfer_req_handle, _core._test_gpu_handle("xfer_req", 16)
    )
    agent.release_mem_view(view.handle)  # NIXL's callers hold ints
    assert view.released and _core._test_released() == before + 1
    with pytest.raises(nixlInvalidParamError):
        agent.release_mem_view(view.handle)  # not twice
    agent.release_gpu_xfer_req(req)
    assert req.released and _core._test_released() == before + 2
    agent.release_mem_view(view)  # the object: idempotent
    assert _core._test_released() == before + 2
    # The agent holds its handles weakly: collection releases them.
    other = agent._device_handle(D.nixl_mem_view_handle, _core._test_gpu_handle("mem_view", 24))
    key = other.handle
    del other
    gc.collect()
    assert _core._test_released() == before + 3
    assert key not in agent._gpu_handles


# --- the device API behind NIXL's backend name UCX ---------------------------------------


@ours
def test_have_ucx_gpu_device_api_says_whether_the_device_path_exists_here():
    B = api.nixlBind
    why = B._ucx_device_api_unavailable()
    assert isinstance(B.HAVE_UCX_GPU_DEVICE_API, bool)
    assert B.HAVE_UCX_GPU_DEVICE_API is (why is None)
    assert "HAVE_UCX_GPU_DEVICE_API" in dir(B)
    if _core.gpu_count() == 0:
        assert not B.HAVE_UCX_GPU_DEVICE_API and why, "no GPU here: no device path"
    with pytest.raises(AttributeError):
        B.NO_SUCH_NAME  # noqa: B018


@ours
def test_the_device_path_behind_ucx_can_be_turned_off(monkeypatch):
    B = api.nixlBind
    monkeypatch.setattr(B, "_ucx_device_reason", B._UNSET)
    monkeypatch.setenv("RDMA_NIXL_UCX_DEVICE_API", "0")
    assert B._ucx_device_api_unavailable() == "turned off by RDMA_NIXL_UCX_DEVICE_API=0"
    assert B.HAVE_UCX_GPU_DEVICE_API is False
    agent = api.nixl_agent("ucx-off", api.nixl_agent_config())
    with pytest.raises(nixlError):
        agent.register_memory([(0x7000_0000, 4096, 0, "")], "VRAM")
    assert agent._ucx_device_key is None
    assert "RDMA_NIXL_UCX_DEVICE_API=0" in agent._ucx_device_why


@ours
def test_device_handles_are_ints_as_nixls():
    h = _test_handle()
    assert isinstance(h, int) and h != 0 and int(h) == h.handle
    assert isinstance(h, D.nixl_mem_view_handle)
    assert f"{h:#x}" == hex(h.handle)


@ours
def test_a_ucx_agent_without_vram_says_why_it_has_no_device_api():
    import numpy as np

    agent = api.nixl_agent("ucx-no-view", api.nixl_agent_config())
    buf = np.zeros(64, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    assert "GPUNETIO" not in agent.backends, "DRAM does not add the device backend"
    with pytest.raises(nixlNotSupportedError, match="device API behind UCX is a GPUNETIO"):
        agent.prep_mem_view(agent.get_xfer_descs([(buf.ctypes.data, 64, 0)], "DRAM"))


@ours
def test_a_ucx_agent_whose_device_backend_cannot_be_made_keeps_registering(monkeypatch):
    # As on a machine whose probe says yes but where GPUNETIO's creation fails: the
    # failure is kept as the reason, logged, and registrations go on without it.
    import numpy as np

    monkeypatch.setattr(api.nixlBind, "_ucx_device_api_unavailable", lambda: None)
    agent = api.nixl_agent("ucx-failed-device", api.nixl_agent_config())
    with pytest.raises(nixlError):
        agent.register_memory([(0x7000_0000, 4096, 0, "")], "VRAM")  # no GPU here
    if _core.gpu_count() == 0:
        assert agent._ucx_device_key is None
        assert "creating GPUNETIO on GPU 0 failed" in agent._ucx_device_why
        buf = np.zeros(64, dtype=np.uint8)
        agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        with pytest.raises(nixlNotSupportedError, match="creating GPUNETIO on GPU 0 failed"):
            agent.prep_mem_view(agent.get_xfer_descs([(buf.ctypes.data, 64, 0)], "DRAM"))


def _stand_in_device_backend(agent, backend="LOCAL", gpu=0):
    """Makes ``backend`` stand in for UCX's device backend (GPUNETIO, which needs a GPU),
    to check on any machine what the agent hands it."""
    agent.create_backend(backend)
    agent._ucx_device_wanted = True
    agent._ucx_device_key = backend
    agent._ucx_device_gpu = gpu
    return agent.backends[backend]


@ours
def test_ucx_device_backend_takes_vram_of_its_gpu_only():
    B = api.nixlBind
    agent = api.nixl_agent("ucx-reg-rules", api.nixl_agent_config())
    device = _stand_in_device_backend(agent, gpu=0)
    others = [h for k, h in agent.backends.items() if k != "LOCAL"]
    assert others, "UCX's own backend"

    def regs(rows, mem):
        return agent.get_reg_descs(rows, mem)

    # No backend named: all of them for VRAM of its GPU, all but it otherwise.
    assert agent._registration_handles(regs([(0x1000, 64, 0, "")], "VRAM"), []) == []
    assert sorted(agent._registration_handles(regs([(0x1000, 64, 1, "")], "VRAM"), [])) == sorted(others)
    mixed = regs([(0x1000, 64, 0, ""), (0x2000, 64, 1, "")], "VRAM")
    assert sorted(agent._registration_handles(mixed, [])) == sorted(others)
    assert sorted(agent._registration_handles(regs([(0x1000, 64, 0, "")], "DRAM"), [])) == sorted(others)
    # UCX named: UCX's backend, and the device one where it takes the memory.
    ucx = agent._handles(["UCX"])
    assert agent._registration_handles(regs([(0x1000, 64, 0, "")], "VRAM"), ["UCX"]) == ucx + [device]
    assert agent._registration_handles(regs([(0x1000, 64, 0, "")], "DRAM"), ["UCX"]) == ucx
    # Other backends named: exactly those.
    assert agent._registration_handles(regs([(0x1000, 64, 0, "")], "VRAM"), ["LOCAL"]) == [device]
    assert B.VRAM_SEG  # the list types above are NIXL's


@ours
def test_ucx_device_backend_is_left_out_of_dram_registrations():
    import numpy as np

    agent = api.nixl_agent("ucx-dram", api.nixl_agent_config())
    _stand_in_device_backend(agent)
    buf = np.zeros(4096, dtype=np.uint8)
    descs = [(buf.ctypes.data, buf.nbytes, 0, "")]
    agent.register_memory(descs, "DRAM")
    assert agent.query_memory(descs, "UCX", "DRAM") != [None]
    assert agent.query_memory(descs, "LOCAL", "DRAM") == [None]


@ours
def test_a_gpu_request_of_a_ucx_agent_is_made_on_its_device_backend():
    # create_gpu_xfer_req on a request UCX's transfer backend carries: the same request
    # is made on the device backend (here LOCAL standing in, which has no device API:
    # its refusal shows the request reached it).
    import numpy as np

    agent = api.nixl_agent("ucx-gpu-req", api.nixl_agent_config())
    _stand_in_device_backend(agent)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    rows = [(src.ctypes.data, 4096, 0, ""), (dst.ctypes.data, 4096, 0, "")]
    agent.register_memory(rows, "DRAM", backends=["UCX", "LOCAL"])
    xfer = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs([(src.ctypes.data, 4096, 0)], "DRAM"),
        agent.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "DRAM"),
        agent.name,
    )
    assert agent.query_xfer_backend(xfer) != "LOCAL"
    with pytest.raises(nixlNotSupportedError, match="LOCAL"):
        agent.create_gpu_xfer_req(xfer)
    sibling = xfer._gpu_sibling
    assert sibling is not None and sibling._req.core.backend == "LOCAL"
    # The transfer itself still runs on UCX's backend.
    state = agent.transfer(xfer)
    while state != "DONE":
        state = agent.check_xfer_state(xfer)
    assert (dst == src).all()
    agent.release_xfer_handle(xfer)
    assert sibling._released, "releasing the request releases its device twin"


# --- headers and compile options ---------------------------------------------------------


@ours
def test_the_include_dir_holds_the_headers_the_extension_was_built_with(tmp_path, monkeypatch):
    monkeypatch.setenv("RDMA_NIXL_INCLUDE_CACHE", str(tmp_path))
    monkeypatch.setattr(D, "_include", None)
    inc = D.include_dir()
    assert inc.startswith(str(tmp_path))
    assert D.include_dirs() == [inc]
    headers = D.headers()
    for name in ("nixl/nixl_device.cuh", "gpunetio/gio_device.cuh", "gpunetio/gio_abi.h"):
        with open(os.path.join(inc, name), encoding="utf-8") as f:
            assert f.read() == headers[name], name
    assert D.header_path() == os.path.join(inc, "nixl", "nixl_device.cuh")
    assert '#include "gpunetio/gio_device.cuh"' in headers["nixl/nixl_device.cuh"]
    # Written once: a second process (cache cleared) finds it.
    monkeypatch.setattr(D, "_include", None)
    assert D.include_dir() == inc
    assert [p for p in os.listdir(tmp_path) if p.startswith(".staging")] == []
    opts = D.nvrtc_options()
    assert opts == (f"-I{inc}", "-std=c++17")
    assert D.nvrtc_options(arch="compute_90", defines=["GIO_DEBUG"]) == (
        f"-I{inc}",
        "-std=c++17",
        "--gpu-architecture=compute_90",
        "-DGIO_DEBUG",
    )


@ours
def test_the_python_layout_matches_the_header():
    header = D.headers()["nixl/nixl_device.cuh"]
    assert re.search(r"static_assert\(sizeof\(nixl_gpu_handle\) == 40", header)
    offsets = dict(
        (m.group(1), int(m.group(2)))
        for m in re.finditer(r"GIO_ASSERT_OFFSET\(nixl_gpu_handle, (\w+), (\d+)\)", header)
    )
    assert offsets, "the header asserts the handle's field offsets"
    dtype = D.handle_dtype()
    for name, offset in offsets.items():
        assert dtype.fields[name][1] == offset, name
        assert getattr(D.nixlGpuHandleStruct, name).offset == offset, name
    for flag, value in (
        ("NIXL_GPU_SLOT_REQUEST", D.SLOT_REQUEST),
        ("NIXL_GPU_SLOT_VIEW", D.SLOT_VIEW),
        ("NIXL_GPU_SLOT_LOCAL", D.SLOT_LOCAL),
        ("NIXL_GPU_DIRECT", D.HANDLE_DIRECT),
        ("NIXL_GPU_SAME_DEVICE", D.HANDLE_SAME_DEVICE),
        ("NIXL_ERR_INVALID_PARAM", D.NIXL_ERR_INVALID_PARAM),
        ("NIXL_ERR_NOT_SUPPORTED", D.NIXL_ERR_NOT_SUPPORTED),
    ):
        m = re.search(rf"#define {flag} (-?\d+)u?\b", header)
        assert m and int(m.group(1)) == value, flag


@ours
def test_the_test_kernels_compile_with_nvrtc_and_the_package_options():
    """The headers and options compile real device-API kernels (NVRTC only: no GPU)."""
    lib = K.load_nvrtc()
    if lib is None:
        reason = "libnvrtc is not installed (cargo xtask nvrtc fetches it into target/nvrtc)"
        if os.environ.get("NIXL_REQUIRE_GPU") == "1" or os.environ.get(
            "GPUNETIO_REQUIRE_NVRTC"
        ) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    for arch in ("compute_80", "compute_90"):
        ptx = K.nvrtc_compile(lib, K.SOURCE, "device_test.cu", D.nvrtc_options(arch=arch))
        for kernel in K.KERNELS:
            assert f".entry {kernel}(" in ptx, kernel
    # Without the include folder the header is not found: the option matters.
    with pytest.raises(RuntimeError, match="nixl_device.cuh"):
        K.nvrtc_compile(lib, K.SOURCE, "device_test.cu", ("-std=c++17",))
