# tools/peer/kvbench.py (the vLLM-shaped KV-cache benchmark over NIXL's Python API) end
# to end on DRAM, two processes, every block checked: READ and WRITE, both layouts, one
# and several requests in flight; run against whichever implementation conftest selects
# (NIXL_PY_IMPL). And the default configuration's backends without a GPU.

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import IMPL, load_api

# In the repository: tools/peer/; in the GPU bundle (python/gpu-bundle.sh): beside tests/.
SCRIPT = next(
    (p for p in (Path(__file__).resolve().parents[i] / "tools" / "peer" / "kvbench.py"
                 for i in (2, 1)) if p.exists()),
    Path(__file__).resolve().parents[2] / "tools" / "peer" / "kvbench.py",
)
SMALL = ["--layers", "2", "--blocks", "64", "--block-bytes", "4K",
         "--blocks-per-request", "8", "--requests", "12"]


def kvbench(*args, timeout=180):
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--impl", IMPL, *SMALL, *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def result_row(stdout):
    lines = stdout.splitlines()
    at = next(i for i, l in enumerate(lines) if "descs/req" in l)
    return [float(x) for x in lines[at + 1].split()]


@pytest.mark.parametrize("op,layout,ids,inflight", [
    ("READ", "block-major", "random", "1"),
    ("READ", "strided", "sequential", "4"),
    ("WRITE", "strided", "random", "4"),
])
def test_kv_transfer_is_verified(op, layout, ids, inflight):
    r = kvbench("--op", op, "--layout", layout, "--block-ids", ids, "--inflight", inflight)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "default config" in r.stdout and "data verified" in r.stdout, r.stdout
    if IMPL == "ours":
        # DRAM between processes of one host: LIBFABRIC (known as UCX), never CUDA_IPC.
        assert "chosen UCX," in r.stdout, r.stdout
    row = result_row(r.stdout)
    assert row[:4] == [32, 32 * 4096, int(inflight), 12], r.stdout
    assert row[4] > 0 and row[6] >= row[5] > 0, r.stdout


def test_impossible_plans_are_refused():
    r = kvbench("--blocks", "8", "--blocks-per-request", "4", "--inflight", "4")
    assert r.returncode == 2
    assert "raise --blocks" in r.stderr, r.stderr


def test_the_check_can_fail():
    # The runs above show the check passes on good data; here it must find bad data:
    # a cache checked against a plan never run, and one flipped bit.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import kvbench as kb
    finally:
        sys.path.pop(0)
    o = kb.parse_args(SMALL)
    cache = kb.Cache(o, "DRAM", 0, kb.TARGET_TAG)
    own = kb.expected(o, [], True)
    assert cache.check(own, kb.TARGET_TAG, kb.INITIATOR_TAG) is None
    requests = kb.plan(o)
    assert cache.check(kb.expected(o, requests, True), kb.TARGET_TAG,
                       kb.INITIATOR_TAG) is not None  # nothing was written yet
    cache.t[5, 3] ^= 1
    assert "differs from its own fill" in cache.check(own, kb.TARGET_TAG, kb.INITIATOR_TAG)


@pytest.mark.ours_only
def test_default_config_adds_cuda_ipc_only_with_a_gpu():
    api = load_api()
    agent = api.nixl_agent("defaults")
    have_gpu = False
    try:
        import torch

        have_gpu = torch.cuda.is_available()
    except ImportError:
        pass
    assert "UCX" in agent.backends
    can = have_gpu and "CUDA_IPC" in agent.get_plugin_list()  # a build with GPU support
    assert ("CUDA_IPC" in agent.backends) == can, list(agent.backends)
