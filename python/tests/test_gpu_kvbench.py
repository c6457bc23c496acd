# tools/peer/kvbench.py on GPUs: a vLLM-shaped KV pull of random blocks (4,096
# descriptors per request) between two processes through the default configuration,
# every block checked -- on one GPU, and from GPU 0 to GPU 1 (``_2gpu``). With ours the
# agent must pick CUDA_IPC (VRAM to VRAM on one node) without being told.
#
# Skipped (with the reason) where torch or the GPUs are missing; with NIXL_REQUIRE_GPU=1
# (the GPU machine) a missing GPU FAILS instead (the ``_2gpu`` test needs two).

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import IMPL

# In the repository: tools/peer/; in the GPU bundle (python/gpu-bundle.sh): beside tests/.
SCRIPT = next(
    (p for p in (Path(__file__).resolve().parents[i] / "tools" / "peer" / "kvbench.py"
                 for i in (2, 1)) if p.exists()),
    Path(__file__).resolve().parents[2] / "tools" / "peer" / "kvbench.py",
)
SHAPE = ["--layers", "16", "--blocks", "512", "--block-bytes", "32K",
         "--blocks-per-request", "128", "--requests", "8"]


def gpus_or_skip(need: int) -> None:
    try:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        why = f"needs {need} GPU(s), torch sees {have}"
    except ImportError:
        have, why = 0, "torch is not installed"
    if have >= need:
        return
    if os.environ.get("NIXL_REQUIRE_GPU") == "1":
        pytest.fail(f"NIXL_REQUIRE_GPU=1 but {why}")
    pytest.skip(why)


def pull(initiator_gpu: int, target_gpu: int, *extra: str):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--impl", IMPL, *SHAPE, "--initiator-mem", "VRAM",
         "--target-mem", "VRAM", "--initiator-gpu", str(initiator_gpu), "--target-gpu",
         str(target_gpu), *extra],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "data verified" in r.stdout, r.stdout
    if IMPL == "ours":
        assert "chosen CUDA_IPC" in r.stdout, r.stdout
    print(r.stdout)


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_kv_pull_one_gpu(op):
    gpus_or_skip(1)
    pull(0, 0, "--op", op)


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_kv_pull_gpu0_to_gpu1_2gpu(op):
    gpus_or_skip(2)
    pull(1, 0, "--op", op, "--layout", "strided", "--inflight", "2")
