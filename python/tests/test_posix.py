# The POSIX backend: DRAM <-> FILE through pread/pwrite within one agent, and NIXL's
# queryMem on file paths (query_memory through nixl_agent, queryMem through the
# low-level agent), as NIXL's query_mem_example.py and test_query_mem use them.

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import IMPL, load_api, load_module, wait_xfer

api = load_api()
B = load_module("_bindings")


def pattern(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def posix_agent(name: str, progress: bool = True):
    config = api.nixl_agent_config(
        enable_prog_thread=progress, enable_listen_thread=False, backends=[]
    )
    agent = api.nixl_agent(name, config)
    agent.create_backend("POSIX", agent.get_plugin_params("POSIX"))
    return agent


def test_posix_is_offered_with_its_memory_types():
    agent = api.nixl_agent("offer", api.nixl_agent_config(backends=[]))
    assert "POSIX" in agent.get_plugin_list()
    assert set(agent.get_plugin_mem_types("POSIX")) >= {"DRAM_SEG", "FILE_SEG"}


@pytest.mark.parametrize("progress", [True, False])
def test_write_then_read_dram_file_round_trip(tmp_path, progress):
    path = tmp_path / "data"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        agent = posix_agent(f"rt{int(progress)}", progress)
        size = 256 << 10
        src = pattern(2 * size, 3)
        dst = np.zeros(2 * size, dtype=np.uint8)
        agent.register_memory(
            [(src.ctypes.data, src.nbytes, 0, ""), (dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"
        )
        agent.register_memory([(0, 4 * size, fd, "data")], "FILE")
        # Two pieces, swapped between memory and file.

        def mem(buf):
            return agent.get_xfer_descs(
                [(buf.ctypes.data, size, 0), (buf.ctypes.data + size, size, 0)], "DRAM"
            )

        files = agent.get_xfer_descs([(2 * size, size, fd), (0, size, fd)], "FILE")
        name = agent.name
        w = agent.initialize_xfer("WRITE", mem(src), files, name, backends=["POSIX"])
        wait_xfer(agent, w, state=agent.transfer(w))
        assert os.pread(fd, size, 2 * size) == src[:size].tobytes()
        assert os.pread(fd, size, 0) == src[size:].tobytes()
        r = agent.initialize_xfer("READ", mem(dst), files, name, backends=["POSIX"])
        wait_xfer(agent, r, state=agent.transfer(r))
        assert np.array_equal(dst, src)
    finally:
        os.close(fd)


# Ours is stricter than NIXL's POSIX plugin here: a short read and a closed descriptor
# are typed errors, which NIXL 1.5.1 does not raise.
@pytest.mark.skipif(IMPL == "nixl", reason="ours only: NIXL 1.5.1 raises no error here")
def test_read_past_the_end_of_the_file_fails(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        agent = posix_agent("eof")
        buf = np.zeros(4096, dtype=np.uint8)
        agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        agent.register_memory([(0, 1 << 20, fd, "short")], "FILE")
        local = agent.get_xfer_descs([(buf.ctypes.data, 4096, 0)], "DRAM")
        remote = agent.get_xfer_descs([(0, 4096, fd)], "FILE")
        h = agent.initialize_xfer("READ", local, remote, agent.name, backends=["POSIX"])
        with pytest.raises(B.nixlBackendError, match="past the end of the file"):
            wait_xfer(agent, h, state=agent.transfer(h))
    finally:
        os.close(fd)


@pytest.mark.skipif(IMPL == "nixl", reason="ours only: NIXL 1.5.1 raises no error here")
def test_registering_a_closed_descriptor_is_refused(tmp_path):
    agent = posix_agent("closed")
    with pytest.raises(B.nixlInvalidParamError, match="not an open file descriptor"):
        agent.register_memory([(0, 4096, 2**31 - 1, "gone")], "FILE", backends=["POSIX"])


def test_query_memory_on_file_paths(tmp_path):
    present = tmp_path / "present.txt"
    present.write_bytes(b"Test content for file 0")
    missing = str(tmp_path / "missing.txt")
    agent = posix_agent("query", progress=False)
    resp = agent.query_memory(
        [(0, 0, 0, str(present)), (0, 0, 0, missing), (0, 0, 0, str(present))],
        "POSIX",
        mem_type="FILE",
    )
    assert len(resp) == 3
    st = os.stat(present)
    assert resp[0] == {"size": "23", "mode": str(st.st_mode), "mtime": str(int(st.st_mtime))}
    assert resp[1] is None
    assert resp[2] == resp[0]


def test_low_level_query_mem_as_nixls_test():
    config = B.nixlAgentConfig()
    config.useProgThread = False
    config.useListenThread = False
    agent = B.nixlAgent("low", config)
    params, mems = agent.getPluginParams("POSIX")
    backend = agent.createBackend("POSIX", params)
    descs = B.nixlRegDList(B.FILE_SEG)
    assert agent.queryMem(descs, backend) == []
    descs.addDesc((0, 0, 0, __file__))
    descs.addDesc((0, 0, 0, "./nixl_test_nonexistent_file_12345.txt"))
    resp = agent.queryMem(descs, backend)
    assert len(resp) == 2
    assert isinstance(resp[0], dict) and resp[0]["size"] == str(os.path.getsize(__file__))
    assert resp[1] is None


@pytest.mark.ours_only
def test_staging_parameters_are_checked():
    agent = api.nixl_agent("params", api.nixl_agent_config(backends=[]))
    params = agent.get_plugin_params("POSIX")
    assert params == {"staging_size": str(4 << 20), "staging_slot_size": str(1 << 20)}
    with pytest.raises(B.nixlInvalidParamError, match="at least one slot"):
        agent.create_backend("POSIX", {"staging_size": "1024", "staging_slot_size": "4096"})
    with pytest.raises(B.nixlInvalidParamError, match="takes no parameter `use_uring`"):
        agent.create_backend("POSIX", {"use_uring": "true"})
    agent.create_backend("POSIX", {"staging_size": "65536", "staging_slot_size": "4096"})
    assert agent.get_backend_params("POSIX")["staging_slot_size"] == "4096"
