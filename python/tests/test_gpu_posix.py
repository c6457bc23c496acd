"""The POSIX backend with VRAM: torch CUDA tensors read from and written to files
through POSIX's pinned staging slots (READ file -> VRAM, WRITE VRAM -> file), one large
descriptor and many of odd sizes at odd offsets, with and without progress threads,
every byte checked; ``query_memory`` says the VRAM is staged; a READ past the end fails.

Skipped (with the reason printed) where torch or a CUDA device is missing; with
``NIXL_REQUIRE_GPU=1`` (the GPU machine) they FAIL instead. Ours only (NIXL's POSIX
plugin takes DRAM).
"""

from __future__ import annotations

import os

import pytest
from conftest import load_api, load_module, wait_xfer

pytestmark = pytest.mark.ours_only


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
    pytest.skip(f"POSIX VRAM tests skipped: {_why}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _gpu_is_required():
    if torch is None:
        pytest.fail(f"NIXL_REQUIRE_GPU=1 but {_why}")


api = load_api()
B = load_module("_bindings")
MIB = 1 << 20


def pattern(n: int, seed: int):
    return (torch.arange(n, dtype=torch.int64, device="cuda:0") * 2654435761 + seed).remainder(
        256
    ).to(torch.uint8)


def posix_agent(name: str, progress: bool, slot: int = MIB, slots: int = 3):
    agent = api.nixl_agent(
        name, api.nixl_agent_config(enable_prog_thread=progress, backends=[])
    )
    agent.create_backend(
        "POSIX", {"staging_slot_size": str(slot), "staging_size": str(slot * slots)}
    )
    return agent


def run(agent, op, mem, files):
    h = agent.initialize_xfer(op, mem, files, agent.name, backends=["POSIX"])
    wait_xfer(agent, h, timeout=60, state=agent.transfer(h))
    agent.release_xfer_handle(h)


def pieces():
    """(memory offset, file offset, length): odd sizes, the file in reverse order."""
    lens = [[1, 4095, 65_537, 3 * MIB // 2 + 11, 777][i % 5] for i in range(60)]
    mem, at = [], 3
    for n in lens:
        mem.append(at)
        at += n + 13
    file, at = [0] * len(lens), 0
    for i in reversed(range(len(lens))):
        file[i] = at
        at += lens[i] + 7
    return list(zip(mem, file, lens))


@pytest.mark.parametrize("progress", [True, False])
def test_file_to_vram_and_back(tmp_path, progress):
    size = 32 * MIB
    want = pattern(size, 7)
    src_path = tmp_path / "src"
    src_path.write_bytes(want.cpu().numpy().tobytes())
    src = os.open(src_path, os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        agent = posix_agent(f"gpu-posix-{int(progress)}", progress)
        buf = torch.zeros(size + MIB, dtype=torch.uint8, device="cuda:0")
        base = buf.data_ptr()
        agent.register_memory([(base, buf.numel(), 0, "")], "VRAM")
        agent.register_memory([(0, 2 * size, src, "src"), (0, 2 * size, dst, "dst")], "FILE")
        assert agent.query_memory([(base, 4096, 0, "")], "POSIX", "VRAM") == [
            {"backend": "POSIX", "mode": "staged"}
        ]
        at = 4099
        run(agent, "READ", agent.get_xfer_descs([(base + at, size, 0)], "VRAM"),
            agent.get_xfer_descs([(0, size, src)], "FILE"))
        torch.cuda.synchronize()
        assert torch.equal(buf[at:at + size], want), "file -> VRAM"

        layout = pieces()
        assert all(m + n <= size for m, _, n in layout)
        mem = agent.get_xfer_descs([(base + at + m, n, 0) for m, _, n in layout], "VRAM")
        files = agent.get_xfer_descs([(f, n, dst) for _, f, n in layout], "FILE")
        run(agent, "WRITE", mem, files)
        host = want.cpu().numpy()
        for m, f, n in layout:
            assert os.pread(dst, n, f) == host[m:m + n].tobytes(), f"VRAM -> file at {f}"

        buf.fill_(0xA5)
        torch.cuda.synchronize()
        run(agent, "READ", mem, files)
        torch.cuda.synchronize()
        expect = torch.full_like(buf, 0xA5)
        for m, _, n in layout:
            expect[at + m:at + m + n] = want[m:m + n]
        assert torch.equal(buf, expect), "file -> VRAM, many descriptors (nothing else touched)"
    finally:
        os.close(src)
        os.close(dst)


def test_read_past_the_end_into_vram_fails(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"y" * (MIB + 100))
    fd = os.open(path, os.O_RDONLY)
    try:
        agent = posix_agent("gpu-posix-eof", True, slot=64 << 10, slots=2)
        buf = torch.zeros(2 * MIB, dtype=torch.uint8, device="cuda:0")
        agent.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "VRAM")
        agent.register_memory([(0, 2 * MIB, fd, "short")], "FILE")
        h = agent.initialize_xfer(
            "READ", agent.get_xfer_descs([(buf.data_ptr(), 2 * MIB, 0)], "VRAM"),
            agent.get_xfer_descs([(0, 2 * MIB, fd)], "FILE"), agent.name, backends=["POSIX"],
        )
        with pytest.raises(B.nixlBackendError, match="past the end of the file"):
            wait_xfer(agent, h, timeout=60, state=agent.transfer(h))
        torch.cuda.synchronize()
        assert bool((buf[:MIB] == ord("y")).all()), "the pieces before the end arrived"
    finally:
        os.close(fd)
