"""NIXL's modules besides ``_api``, as NIXL's own tests and examples use them.

``_utils`` (raw host buffers), ``logging`` (``get_logger``), the constants, exceptions
and descriptor-list methods of ``_bindings``, its low-level ``nixlAgentConfig`` and
``nixlAgent`` (camelCase methods, int handles, status returns), ``sync_mode`` as
``nixl_agent`` passes it down, and telemetry (``NIXL_TELEMETRY_ENABLE``,
``NIXL_TELEMETRY_DIR`` and the ring file NIXL's readers read). Like ``test_api.py`` the
suite runs against NIXL's wheel too (``NIXL_PY_IMPL=nixl``); ``ours_only`` marks what
NIXL does differently or not at all.
"""

from __future__ import annotations

import ctypes
import datetime
import mmap
import os
import struct
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
from conftest import IMPL, load_module, wait_for, wait_xfer

api = load_module("_api")
B = load_module("_bindings")
U = load_module("_utils")
L = load_module("logging")
PACKAGE = B.__name__.rsplit(".", 1)[0]  # rdma_nixl, nixl, nixl_cu12 ...


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def no_telemetry_env(monkeypatch):
    for name in ("NIXL_TELEMETRY_ENABLE", "NIXL_TELEMETRY_DIR", "NIXL_TELEMETRY_EXPORTER",
                 "NIXL_TELEMETRY_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)


# --- _utils -------------------------------------------------------------------------------


def test_utils_allocate_fill_compare_free():
    a = U.malloc_passthru(1000)
    b = U.malloc_passthru(1000)
    try:
        assert a and b and a != b
        assert a % 4096 == 0 and b % 4096 == 0, "aligned for O_DIRECT"
        U.ba_buf(a, 1000)
        assert ctypes.string_at(a, 1000) == b"\xba" * 1000
        ctypes.memmove(b, a, 1000)
        U.verify_transfer(a, b, 1000)
    finally:
        U.free_passthru(a)
        U.free_passthru(b)
    # A size C's aligned_alloc cannot serve is a failed allocation: 0.
    assert U.malloc_passthru(-1) == 0
    with pytest.raises(TypeError):
        U.malloc_passthru("10")
    with pytest.raises(TypeError):
        U.malloc_passthru(1 << 40)  # NIXL's size is a C int


@pytest.mark.ours_only
def test_verify_transfer_checks_every_byte():
    """NIXL's verify_transfer is an assert its release wheel compiles out; ours checks."""
    a = U.malloc_passthru(64)
    b = U.malloc_passthru(64)
    try:
        U.ba_buf(a, 64)
        U.ba_buf(b, 64)
        U.verify_transfer(a, b, 64)
        ctypes.memset(b + 37, 0, 1)
        with pytest.raises(AssertionError, match="byte 37 of 64"):
            U.verify_transfer(a, b, 64)
        U.verify_transfer(a, b, 37)  # the bytes before it still match
    finally:
        U.free_passthru(a)
        U.free_passthru(b)


# --- logging ------------------------------------------------------------------------------


def test_get_logger_names_loggers_under_the_package():
    logger = L.get_logger("_test_module")
    assert logger.name.endswith(".test_module")
    assert logger.name.split(".")[0] in (PACKAGE, "nixl")
    assert L.get_logger("_test_module") is logger


def _log_lines(env: dict) -> str:
    code = (
        f"from {L.__name__} import get_logger\n"
        "log = get_logger('probe')\n"
        "log.info('info-line')\n"
        "log.error('error-line')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_get_logger_prints_to_stdout_with_nixls_format_and_level():
    plain = _log_lines({"NIXL_LOG_LEVEL": "INFO"})
    assert "NIXL INFO" in plain and "info-line" in plain and "error-line" in plain
    quiet = _log_lines({"NIXL_LOG_LEVEL": "ERROR"})
    assert "info-line" not in quiet and "error-line" in quiet
    bad = _log_lines({"NIXL_LOG_LEVEL": "LOUD"})
    assert "Invalid NIXL_LOG_LEVEL" in bad and "info-line" in bad


# --- constants, exceptions, descriptor lists ------------------------------------------------


def test_status_and_cost_constants_are_nixls():
    expected = {
        "NIXL_IN_PROG": 1,
        "NIXL_SUCCESS": 0,
        "NIXL_ERR_NOT_POSTED": -1,
        "NIXL_ERR_INVALID_PARAM": -2,
        "NIXL_ERR_BACKEND": -3,
        "NIXL_ERR_NOT_FOUND": -4,
        "NIXL_ERR_MISMATCH": -5,
        "NIXL_ERR_NOT_ALLOWED": -6,
        "NIXL_ERR_REPOST_ACTIVE": -7,
        "NIXL_ERR_UNKNOWN": -8,
        "NIXL_ERR_NOT_SUPPORTED": -9,
    }
    for name, value in expected.items():
        status = getattr(B, name)
        assert int(status) == value and status == value, name
        assert isinstance(status, B.nixl_status_t)
        assert status.name == name and str(status) == f"nixl_status_t.{name}"
        assert B.nixl_status_t.__members__[name] is status
    assert int(B.NIXL_COST_ANALYTICAL_BACKEND) == 0
    assert isinstance(B.NIXL_COST_ANALYTICAL_BACKEND, B.nixl_cost_t)
    assert str(B.DRAM_SEG) == "nixl_mem_t.DRAM_SEG"
    assert B.NIXL_THREAD_SYNC_DEFAULT == B.NIXL_THREAD_SYNC_NONE
    assert "NIXL_THREAD_SYNC_DEFAULT" in B.nixl_thread_sync_t.__members__
    assert B.NIXL_INIT_AGENT == ""


NIXL_EXCEPTIONS = [
    "nixlNotPostedError",
    "nixlInvalidParamError",
    "nixlBackendError",
    "nixlNotFoundError",
    "nixlMismatchError",
    "nixlNotAllowedError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlNotSupportedError",
    "nixlRemoteDisconnectError",
    "nixlCancelledError",
    "nixlNoTelemetryError",
]


def test_exception_classes_are_nixls():
    for name in NIXL_EXCEPTIONS:
        cls = getattr(B, name)
        assert issubclass(cls, Exception) and cls.__name__ == name


@pytest.mark.ours_only
def test_exceptions_carry_their_status():
    for name in NIXL_EXCEPTIONS:
        cls = getattr(B, name)
        assert issubclass(cls, B.nixlError)
        assert isinstance(cls.status, B.nixl_status_t)
    assert B.nixlNotFoundError.status == B.NIXL_ERR_NOT_FOUND
    assert int(B.nixlNoTelemetryError.status) == -12


def test_empty_agent_name_is_a_value_error():
    with pytest.raises(ValueError):
        api.nixl_agent("")
    with pytest.raises(ValueError):
        B.nixlAgent("", B.nixlAgentConfig())
    with pytest.raises(TypeError):
        B.nixlAgent("no-config")


@pytest.mark.ours_only
def test_empty_agent_name_is_also_invalid_param():
    with pytest.raises(B.nixlInvalidParamError):
        api.nixl_agent("")


def test_trim_returns_a_new_xfer_list_and_keeps_the_registration_list():
    reg = B.nixlRegDList(B.VRAM_SEG, [(0x1000, 64, 1, "meta"), (0x2000, 32, 1, b"")])
    trimmed = reg.trim()
    assert isinstance(trimmed, B.nixlXferDList)
    assert trimmed.getType() == B.VRAM_SEG
    assert trimmed.descCount() == 2
    assert trimmed[0] == (0x1000, 64, 1) and trimmed[1] == (0x2000, 32, 1)
    assert reg.descCount() == 2 and reg[0] == (0x1000, 64, 1, b"meta")
    trimmed.clear()
    assert reg.descCount() == 2, "the trimmed list is a copy"
    assert B.nixlRegDList(B.DRAM_SEG).trim().isEmpty()


@pytest.mark.ours_only
def test_trim_of_a_transfer_list_is_a_copy():
    xfer = B.nixlXferDList(B.DRAM_SEG, [(0x1000, 64, 0)])
    copy = xfer.trim()
    assert copy == xfer and copy is not xfer
    copy.append((0x2000, 8, 0))
    assert xfer.descCount() == 1


def test_index_of_a_missing_descriptor_is_not_found():
    lst = B.nixlXferDList(B.DRAM_SEG, [(1, 2, 0), (3, 4, 0)])
    assert lst.index((3, 4, 0)) == 1
    with pytest.raises(B.nixlNotFoundError):
        lst.index((5, 6, 0))
    reg = B.nixlRegDList(B.DRAM_SEG, [(1, 2, 0, "a")])
    assert reg.index((1, 2, 0, "another tag")) == 0, "the tag is not compared"


@pytest.mark.ours_only
def test_index_of_a_missing_descriptor_is_also_a_value_error():
    with pytest.raises(ValueError):
        B.nixlXferDList(B.DRAM_SEG, [(1, 2, 0)]).index((5, 6, 0))


def test_list_of_init_size_is_filled_by_index():
    lst = B.nixlXferDList(B.DRAM_SEG, 3)
    assert lst.descCount() == 3
    lst[2] = (0x3000, 8, 0)
    assert lst[2] == (0x3000, 8, 0)
    reg = B.nixlRegDList(B.DRAM_SEG, 2)
    assert reg.descCount() == 2


def test_malformed_descriptors_raise_nixls_builtin_errors():
    with pytest.raises(ValueError):
        B.nixlXferDList(B.DRAM_SEG, [(1, 2, 3, 4)])
    with pytest.raises(ValueError):
        B.nixlRegDList(B.DRAM_SEG, [(1, 2, 3)])
    with pytest.raises(ValueError):
        B.nixlRemoteDList(B.DRAM_SEG, [(1, 2, 3)])
    with pytest.raises(ValueError):
        B.nixlXferDList(B.DRAM_SEG, np.zeros((2, 2), dtype=np.uint64))
    with pytest.raises(ValueError):
        B.nixlXferDList(B.DRAM_SEG, np.zeros((2, 3), dtype=np.float64))
    with pytest.raises(IndexError):
        B.nixlXferDList(B.DRAM_SEG, [(1, 2, 3)]).remDesc(5)


# --- nixlAgentConfig ------------------------------------------------------------------------


def test_agent_config_defaults_and_positional_constructor():
    c = B.nixlAgentConfig()
    assert c.useProgThread is False and c.useListenThread is False
    assert c.listenPort == 8888
    assert c.syncMode == B.NIXL_THREAD_SYNC_DEFAULT
    assert c.captureTelemetry is False
    assert (c.pthrDelay, c.lthrDelay) == (0, 100000)
    assert c.etcdWatchTimeout == datetime.timedelta(seconds=5)
    c = B.nixlAgentConfig(True, True, 1234, B.NIXL_THREAD_SYNC_RW, 2, 5, 6, True)
    assert (c.useProgThread, c.useListenThread, c.listenPort) == (True, True, 1234)
    assert c.syncMode == B.NIXL_THREAD_SYNC_RW
    assert (c.pthrDelay, c.lthrDelay, c.captureTelemetry) == (5, 6, True)
    assert B.nixlAgentConfig(True).useProgThread is True
    with pytest.raises(TypeError):
        B.nixlAgentConfig(True, True, 1234, B.NIXL_THREAD_SYNC_RW, 2, 5, 6, True, 9)
    with pytest.raises(TypeError):
        B.nixlAgentConfig(True, True, "8888")


def test_agent_config_fields_are_typed():
    c = B.nixlAgentConfig()
    c.syncMode = B.NIXL_THREAD_SYNC_STRICT
    assert c.syncMode == B.NIXL_THREAD_SYNC_STRICT
    for field, bad in (("syncMode", 1), ("listenPort", 70000), ("listenPort", -1),
                       ("pthrDelay", -1), ("useProgThread", "yes")):
        with pytest.raises(TypeError):
            setattr(c, field, bad)
    c.etcdWatchTimeout = 1.5
    assert c.etcdWatchTimeout == datetime.timedelta(seconds=1.5)
    with pytest.raises(AttributeError):
        c.noSuchField = 1


# --- the low-level nixlAgent ------------------------------------------------------------------


def low_level_agent(name: str, **fields):
    config = B.nixlAgentConfig()
    for field, value in fields.items():
        setattr(config, field, value)
    agent = B.nixlAgent(name, config)
    return agent, agent.createBackend("UCX", {})


def test_low_level_agents_transfer_with_nixls_return_conventions(no_telemetry_env):
    n1, n2 = unique("ll1"), unique("ll2")
    a1, ucx1 = low_level_agent(n1, captureTelemetry=True)
    a2, ucx2 = low_level_agent(n2)
    assert isinstance(ucx1, int) and ucx1 != 0
    options, mems = a1.getBackendParams(ucx1)
    assert isinstance(options, dict) and "DRAM_SEG" in mems
    size = 4096
    src = (np.arange(size) % 251).astype(np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    reg1 = B.nixlRegDList(B.DRAM_SEG)
    reg1.addDesc((src.ctypes.data, size, 0, "src"))
    reg2 = B.nixlRegDList(B.DRAM_SEG)
    reg2.addDesc((dst.ctypes.data, size, 0, "dst"))
    assert a1.registerMem(reg1, [ucx1]) == B.NIXL_SUCCESS
    assert a2.registerMem(reg2) == B.NIXL_SUCCESS
    assert a1.loadRemoteMD(a2.getLocalMD()) == n2.encode()
    assert a2.loadRemoteMD(a1.getLocalMD()).decode() == n1
    assert a1.checkRemoteMD(n2, B.nixlXferDList(B.DRAM_SEG)) == B.NIXL_SUCCESS
    assert a1.checkRemoteMD("nobody", B.nixlXferDList(B.DRAM_SEG)) == B.NIXL_ERR_NOT_FOUND

    local = B.nixlXferDList(B.DRAM_SEG, [(src.ctypes.data + 8, 1000, 0)])
    remote = B.nixlXferDList(B.DRAM_SEG, [(dst.ctypes.data + 8, 1000, 0)])
    handle = a1.createXferReq(B.NIXL_WRITE, local, remote, n2, "n\0tification")
    assert isinstance(handle, int) and handle != 0
    status = a1.postXferReq(handle)
    assert status in (B.NIXL_SUCCESS, B.NIXL_IN_PROG)
    notifs = {}
    deadline = time.monotonic() + 20
    while status != B.NIXL_SUCCESS or not notifs:
        assert time.monotonic() < deadline, "transfer or notification timed out"
        if status != B.NIXL_SUCCESS:
            status = a1.getXferStatus(handle)
            assert status in (B.NIXL_SUCCESS, B.NIXL_IN_PROG)
        if not notifs:
            notifs = a2.getNotifs(notifs)
    assert notifs == {n1: [b"n\0tification"]}
    assert np.array_equal(src[8:1008], dst[8:1008]) and not dst[:8].any()
    seen = {"earlier": [b"x"]}
    a1.genNotif(n2, b"second")
    after = wait_for(lambda: _notifs_with(a2, seen, n1), what="notification")
    assert after["earlier"] == [b"x"] and after[n1] == [b"second"]
    assert seen == {"earlier": [b"x"]}, "getNotifs returns a new dict"

    telemetry = a1.getXferTelemetry(handle)
    assert (telemetry.descCount, telemetry.totalBytes) == (1, 1000)
    assert telemetry.startTime > 0 and telemetry.postDuration > 0
    assert telemetry.xferDuration >= telemetry.postDuration
    assert a1.queryXferBackend(handle) == ucx1
    assert a1.releaseXferReq(handle) == B.NIXL_SUCCESS
    assert a1.deregisterMem(reg1, [ucx1]) == B.NIXL_SUCCESS
    assert a2.deregisterMem(reg2, [ucx2]) == B.NIXL_SUCCESS
    assert a1.invalidateRemoteMD(n2) == B.NIXL_SUCCESS
    assert a1.invalidateRemoteMD(n2) == B.NIXL_ERR_NOT_FOUND, "returned, not raised"


def _notifs_with(agent, base, sender):
    """``agent.getNotifs(base)`` once it holds a message from ``sender`` (else None)."""
    got = agent.getNotifs(base)
    return got if got.get(sender) else None


def test_low_level_prepped_read_by_index():
    name = unique("llp")
    agent, ucx = low_level_agent(name)
    size = 8 * 1024
    buf = np.zeros(2 * size, dtype=np.uint8)
    buf[size:] = (np.arange(size) % 253).astype(np.uint8)
    reg = B.nixlRegDList(B.DRAM_SEG, [(buf.ctypes.data, buf.nbytes, 0, "")])
    agent.registerMem(reg)  # loopback: the agent's own name, no metadata to load
    blocks = [(buf.ctypes.data + i * 1024, 1024, 0) for i in range(8)]
    there = [(buf.ctypes.data + size + i * 1024, 1024, 0) for i in range(8)]
    local = agent.prepXferDlist(B.NIXL_INIT_AGENT, B.nixlXferDList(B.DRAM_SEG, blocks))
    remote = agent.prepXferDlist(name, B.nixlXferDList(B.DRAM_SEG, there), [ucx])
    other_local = agent.prepXferDlist(B.nixlXferDList(B.DRAM_SEG, blocks))  # NIXL's 2nd form
    handle = agent.makeXferReq(
        B.NIXL_READ, local, np.arange(8, dtype=np.int32), remote, list(range(7, -1, -1)), "", [ucx]
    )
    status = agent.postXferReq(handle, "read-done")
    while status != B.NIXL_SUCCESS:
        status = agent.getXferStatus(handle)
    for i in range(8):  # block i came from remote block 7 - i
        assert np.array_equal(buf[i * 1024 : (i + 1) * 1024],
                              buf[size + (7 - i) * 1024 : size + (8 - i) * 1024])
    assert agent.releaseXferReq(handle) == B.NIXL_SUCCESS
    for dlist in (local, remote, other_local):
        assert agent.releasedDlistH(dlist) == B.NIXL_SUCCESS


def test_low_level_errors_raise_the_class_of_their_status():
    agent = B.nixlAgent(unique("lle"), B.nixlAgentConfig())
    with pytest.raises(B.nixlNotFoundError):
        agent.getPluginParams("UVX")
    with pytest.raises(B.nixlNotFoundError):
        agent.createBackend("UVX", {})
    options, mems = agent.getPluginParams("UCX")
    assert isinstance(options, dict) and "DRAM_SEG" in mems
    assert agent.getAvailPlugins()
    with pytest.raises(B.nixlMismatchError):
        agent.loadRemoteMD(b"not metadata")
    with pytest.raises(B.nixlNotFoundError):
        agent.prepXferDlist("nobody", B.nixlXferDList(B.DRAM_SEG, [(1, 2, 0)]))
    with pytest.raises(B.nixlNotFoundError):
        agent.createXferReq(
            B.NIXL_WRITE,
            B.nixlXferDList(B.DRAM_SEG, [(1, 2, 0)]),
            B.nixlXferDList(B.DRAM_SEG, [(1, 2, 0)]),
            "nobody",
        )
    with pytest.raises(B.nixlInvalidParamError):
        agent.sendLocalMD()  # no IP and no central metadata server
    with pytest.raises(B.nixlNotFoundError):
        agent.makeConnection("nobody", [])


@pytest.mark.ours_only
def test_low_level_stale_handles_name_nothing():
    agent, ucx = low_level_agent(unique("stale"))
    buf = np.zeros(64, dtype=np.uint8)
    agent.registerMem(B.nixlRegDList(B.DRAM_SEG, [(buf.ctypes.data, 64, 0, "")]))
    dlist = agent.prepXferDlist(B.nixlXferDList(B.DRAM_SEG, [(buf.ctypes.data, 32, 0)]))
    agent.releasedDlistH(dlist)
    for call in (lambda: agent.releasedDlistH(dlist), lambda: agent.getXferStatus(dlist),
                 lambda: agent.getBackendParams(dlist), lambda: agent.releaseXferReq(12345)):
        with pytest.raises(B.nixlInvalidParamError):
            call()
    with pytest.raises(B.nixlNotSupportedError):
        agent.estimateXferCost(0)


@pytest.mark.ours_only
def test_an_agent_goes_with_its_last_reference():
    """No reference cycle holds an agent (its listener port, its connections) after the
    last handle and the agent itself are dropped: reference counting frees it."""
    import gc
    import weakref

    gc.disable()
    try:
        name = unique("gone")
        agent = api.nixl_agent(name, api.nixl_agent_config(capture_telemetry=True))
        buf = np.zeros(256, dtype=np.uint8)
        agent.register_memory([(buf.ctypes.data, 256, 0, "")], "DRAM")
        local = agent.prep_xfer_dlist("", [(buf.ctypes.data, 128, 0)], "DRAM")
        remote = agent.prep_xfer_dlist(name, [(buf.ctypes.data + 128, 128, 0)], "DRAM")
        h = agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
        wait_xfer(agent, h, state=agent.transfer(h))
        low = weakref.ref(agent.agent)  # the only holder of the Rust agent
        del agent, local, remote, h
        assert low() is None
    finally:
        gc.enable()


# --- sync_mode --------------------------------------------------------------------------------


@pytest.mark.parametrize("sync_mode", [None] + list(api.nixl_thread_sync_t))
@pytest.mark.parametrize("enable_listen", [True, False])
def test_sync_mode_reaches_the_agent_config(monkeypatch, sync_mode, enable_listen):
    seen = {}
    real = B.nixlAgent

    def spy(agent_name, agent_config):
        seen["config"] = agent_config
        return real(agent_name, agent_config)

    monkeypatch.setattr(B, "nixlAgent", spy)
    conf = api.nixl_agent_config(
        sync_mode=sync_mode, enable_listen_thread=enable_listen, listen_port=0, backends=[]
    )
    agent = api.nixl_agent(unique("sync"), conf)
    config = seen["config"]
    assert isinstance(config, B.nixlAgentConfig)
    if sync_mode is not None:
        want = sync_mode.value
    elif enable_listen:
        want = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value
    else:
        want = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
    assert config.syncMode == want
    assert config.useListenThread is enable_listen and config.listenPort == 0
    assert (config.pthrDelay, config.lthrDelay) == (0, 100000)
    if IMPL == "ours":
        # NIXL's rule: a listener thread makes NONE STRICT.
        effective = agent.agent.syncMode
        if enable_listen and want == B.NIXL_THREAD_SYNC_NONE:
            assert effective == B.NIXL_THREAD_SYNC_STRICT
        else:
            assert effective == want


def test_sync_mode_must_be_the_enum():
    with pytest.raises(TypeError, match="sync_mode must be a nixl_thread_sync_t"):
        api.nixl_agent_config(sync_mode=1)


@pytest.mark.ours_only
def test_every_sync_mode_is_thread_safe():
    """Under NIXL_THREAD_SYNC_NONE (NIXL: no locking, callers serialise) our agent still
    takes calls from several threads at once: each thread registers its own buffer,
    prepares, transfers and deregisters, all on one agent, concurrently."""
    conf = api.nixl_agent_config(sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
    name = unique("threads")
    agent = api.nixl_agent(name, conf)
    assert agent.agent.syncMode == B.NIXL_THREAD_SYNC_NONE
    errors = []

    def worker(seed: int):
        try:
            for _ in range(5):
                buf = np.zeros(2 * 65536, dtype=np.uint8)
                buf[:65536] = (np.arange(65536) * seed % 255).astype(np.uint8)
                reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
                local = agent.prep_xfer_dlist("", [(buf.ctypes.data, 65536, 0)], "DRAM")
                remote = agent.prep_xfer_dlist(name, [(buf.ctypes.data + 65536, 65536, 0)], "DRAM")
                h = agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
                wait_xfer(agent, h, state=agent.transfer(h))
                assert np.array_equal(buf[:65536], buf[65536:])
                agent.release_xfer_handle(h)
                agent.deregister_memory(reg)
        except BaseException as e:  # reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (3, 5, 7, 11)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


# --- telemetry --------------------------------------------------------------------------------

# The ring file's layout (NIXL's sharedRingBuffer<nixlTelemetryEvent>, version 4).
HEADER = struct.Struct("=QQiiQQ")  # write_pos, read_pos, version, expected, capacity, mask
EVENT = struct.Struct("=I4xQ")  # event_type, value
MEMORY_REGISTERED, MEMORY_DEREGISTERED = 4, 5
XFER_TIME, XFER_POST_TIME = 6, 7
TX_BYTES, RX_BYTES, TX_REQUESTS, RX_REQUESTS = 0, 1, 2, 3
ERR_NOT_FOUND = 11


def read_ring(path: str):
    """(version, capacity, events) of a telemetry ring file, consuming its events as
    NIXL's readers do (advancing read_pos)."""
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        try:
            write, read, version, _expected, capacity, mask = HEADER.unpack_from(m, 0)
            events = []
            while read != write:
                events.append(EVENT.unpack_from(m, HEADER.size + read * EVENT.size))
                read = (read + 1) & mask
            struct.pack_into("=Q", m, 8, read)
            return version, capacity, events
        finally:
            m.close()


def telemetry_pair(tmp_path, monkeypatch, capture=False, enable=None):
    if enable is not None:
        monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", enable)
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    a = api.nixl_agent(unique("telA"), api.nixl_agent_config(capture_telemetry=capture))
    b = api.nixl_agent(unique("telB"))
    return a, b


def run_transfer(a, b, op="WRITE", size=4096):
    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    reg = a.register_memory([(src.ctypes.data, size, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer(
        op,
        a.get_xfer_descs([(src.ctypes.data, size // 2, 0), (src.ctypes.data + size // 2, size // 2, 0)], "DRAM"),
        a.get_xfer_descs([(dst.ctypes.data, size // 2, 0), (dst.ctypes.data + size // 2, size // 2, 0)], "DRAM"),
        b.name,
        b"telemetry",
    )
    wait_xfer(a, h, state=a.transfer(h))
    wait_for(lambda: b.check_remote_xfer_done(a.name, b"telemetry"), what="notification")
    return h, reg, (src, dst)


@pytest.mark.parametrize(
    "enable,capture,on",
    [(None, False, False), (None, True, True), ("y", False, True), ("YES", False, True),
     ("n", True, False), ("off", True, False), ("1", False, True)],
)
def test_telemetry_enable_overrides_capture_telemetry(no_telemetry_env, monkeypatch, enable, capture, on):
    if enable is not None:
        monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", enable)
    a = api.nixl_agent(unique("tel"), api.nixl_agent_config(capture_telemetry=capture))
    b = api.nixl_agent(unique("peer"))
    h, _, _ = run_transfer(a, b)
    if on:
        t = a.get_xfer_telemetry(h)
        assert (t.descCount, t.totalBytes) == (2, 4096)
        assert t.startTime > 0 and t.postDuration > 0 and t.xferDuration >= t.postDuration
    else:
        with pytest.raises(B.nixlNoTelemetryError):
            a.get_xfer_telemetry(h)


def test_telemetry_enable_of_an_unknown_value_is_an_error(no_telemetry_env, monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "maybe")
    with pytest.raises(RuntimeError):
        api.nixl_agent(unique("tel"))


def test_telemetry_ring_file_holds_nixls_events(no_telemetry_env, monkeypatch, tmp_path):
    a, b = telemetry_pair(tmp_path, monkeypatch, enable="y")
    path = tmp_path / a.name
    assert path.exists() and (tmp_path / b.name).exists(), "one file per agent"
    version, capacity, _ = read_ring(str(path))
    assert (version, capacity) == (4, 4096)
    assert path.stat().st_size == HEADER.size + capacity * EVENT.size
    run_transfer(a, b, "WRITE")
    # NIXL flushes every 100 ms; ours writes at once.
    events = wait_for(lambda: read_ring(str(path))[2] or None, what="events")
    deadline = time.monotonic() + 2
    while len(events) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
        events += read_ring(str(path))[2]
    kinds = [k for k, _ in events]
    assert kinds[:5] == [MEMORY_REGISTERED, XFER_POST_TIME, XFER_TIME, TX_BYTES, TX_REQUESTS]
    values = dict(events)
    assert values[MEMORY_REGISTERED] == 4096 and values[TX_BYTES] == 4096
    assert values[TX_REQUESTS] == 1
    assert values[XFER_TIME] >= values[XFER_POST_TIME] > 0


@pytest.mark.ours_only
def test_telemetry_ring_file_counts_reads_deregistrations_and_errors(no_telemetry_env, monkeypatch, tmp_path):
    a, b = telemetry_pair(tmp_path, monkeypatch, capture=True)
    path = str(tmp_path / a.name)
    _, reg, _ = run_transfer(a, b, "READ", size=2048)
    a.deregister_memory(reg)
    with pytest.raises(B.nixlNotFoundError):
        a.prep_xfer_dlist("nobody", [(1, 2, 0)], "DRAM")
    kinds = [k for k, _ in read_ring(path)[2]]
    assert kinds == [MEMORY_REGISTERED, XFER_POST_TIME, XFER_TIME, RX_BYTES, RX_REQUESTS,
                     MEMORY_DEREGISTERED, ERR_NOT_FOUND]
    # Events consumed by a reader are not read again; new ones are.
    assert read_ring(path)[2] == []
    more = np.zeros(64, dtype=np.uint8)
    a.register_memory([(more.ctypes.data, 64, 0, "")], "DRAM")
    assert read_ring(path)[2] == [(MEMORY_REGISTERED, 64)]


@pytest.mark.ours_only
def test_telemetry_ring_drops_events_when_full(no_telemetry_env, monkeypatch, tmp_path):
    monkeypatch.setenv("NIXL_TELEMETRY_BUFFER_SIZE", "4")
    a, _ = telemetry_pair(tmp_path, monkeypatch, enable="on")
    buf = np.zeros(64, dtype=np.uint8)
    for i in range(6):
        reg = a.register_memory([(buf.ctypes.data + i, 8, 0, "")], "DRAM")
    del reg
    version, capacity, events = read_ring(str(tmp_path / a.name))
    assert capacity == 4
    assert events == [(MEMORY_REGISTERED, 8)] * 3, "one slot stays free; the rest is dropped"


def test_telemetry_buffer_size_must_be_a_power_of_two(no_telemetry_env, monkeypatch, tmp_path):
    monkeypatch.setenv("NIXL_TELEMETRY_BUFFER_SIZE", "100")
    with pytest.raises(RuntimeError):
        telemetry_pair(tmp_path, monkeypatch, enable="y")


def test_no_telemetry_file_when_telemetry_is_off(no_telemetry_env, monkeypatch, tmp_path):
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "n")
    agent = api.nixl_agent(unique("off"), api.nixl_agent_config(capture_telemetry=True))
    assert not (tmp_path / agent.name).exists()


@pytest.mark.ours_only
def test_telemetry_ring_directly(tmp_path):
    from rdma_nixl import _core

    path = str(tmp_path / "ring")
    with pytest.raises(ValueError, match="power of 2"):
        _core.TelemetryRing(path, 6, 4)
    ring = _core.TelemetryRing(path, 8, 4)
    assert (ring.path, ring.capacity, len(ring)) == (path, 8, 0)
    assert ring.push(XFER_TIME, 17)
    assert ring.push_many([(TX_BYTES, 1 << 40), (TX_REQUESTS, 1)] * 4) == 6, "7 of 8 slots"
    assert len(ring) == 7 and not ring.push(RX_BYTES, 1)
    version, capacity, events = read_ring(path)
    assert (version, capacity) == (4, 8)
    assert events[:3] == [(XFER_TIME, 17), (TX_BYTES, 1 << 40), (TX_REQUESTS, 1)]
    assert len(ring) == 0, "the reader consumed them"
    assert ring.push(RX_BYTES, 2) and read_ring(path)[2] == [(RX_BYTES, 2)]
    ring.close()
    ring.close()
    assert not ring.push(RX_BYTES, 3) and len(ring) == 0
    assert os.path.getsize(path) == HEADER.size + 8 * EVENT.size
