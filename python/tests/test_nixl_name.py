"""The opt-in ``nixl`` name: code that imports ``nixl`` runs on rdma_nixl unchanged.

Two routes: the ``rdma-nixl-as-nixl`` package (``python/nixl-shim``, here put on
``PYTHONPATH`` as installing it would) and ``python -m rdma_nixl.as_nixl``. Each runs
``_nixl_program.py`` (a NIXL user's program: two processes, metadata over the listener,
descriptors in a notification, a prepped READ by descriptor ids, a finishing
notification) without a line of it changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = pytest.mark.ours_only

HERE = Path(__file__).resolve().parent
SHIM = HERE.parent / "nixl-shim"
PROGRAM = HERE / "_nixl_program.py"


def shim_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SHIM), env.get("PYTHONPATH", "")) if p
    )
    return env


def run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_the_shim_modules_are_rdma_nixls():
    code = (
        "import nixl, nixl._api, nixl._bindings, nixl._utils, nixl.logging\n"
        "import rdma_nixl, rdma_nixl._api, rdma_nixl._bindings, rdma_nixl._utils, rdma_nixl.logging\n"
        "assert nixl.__implementation__ == 'rdma_nixl'\n"
        "assert nixl._api is rdma_nixl._api and nixl._bindings is rdma_nixl._bindings\n"
        "assert nixl._utils is rdma_nixl._utils and nixl.logging is rdma_nixl.logging\n"
        "from nixl._api import nixl_agent\n"
        "assert nixl_agent is rdma_nixl._api.nixl_agent is nixl.nixl_agent\n"
        "import nixl._bindings as b\n"
        "assert b.nixlAgent is rdma_nixl._bindings.nixlAgent\n"
        "print(nixl.__file__)\n"
    )
    out = run_python(code, shim_env())
    assert out.returncode == 0, out.stderr
    assert str(SHIM) in out.stdout, "the shim answered `import nixl`"


def test_patching_the_shims_bindings_patches_what_its_api_uses():
    """NIXL's tests replace ``nixl._bindings.nixlAgent`` and expect ``nixl._api`` to
    call the replacement: the shim's modules are the same objects, so it does."""
    code = (
        "import nixl._bindings as bindings\n"
        "from nixl._api import nixl_agent, nixl_agent_config\n"
        "seen = []\n"
        "real = bindings.nixlAgent\n"
        "bindings.nixlAgent = lambda name, cfg: seen.append(cfg.syncMode) or real(name, cfg)\n"
        "nixl_agent('spied', nixl_agent_config(backends=[]))\n"
        "assert len(seen) == 1, seen\n"
    )
    out = run_python(code, shim_env())
    assert out.returncode == 0, out.stderr


def run_program(prefix: list, env: dict, iters: int = 50) -> dict:
    port = free_port()
    target = subprocess.Popen(
        prefix + [str(PROGRAM), "--mode", "target", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Its log lines go to stdout too (as NIXL's): read up to READY.
        seen = []
        for line in target.stdout:
            seen.append(line)
            if line.strip() == "READY":
                break
        else:
            pytest.fail("the target never got ready:\n" + "".join(seen) + target.stderr.read())
        # Keep its pipes drained while the initiator runs (a full pipe would block it).
        rest = {}
        for name, stream in (("stdout", target.stdout), ("stderr", target.stderr)):
            threading.Thread(target=lambda n=name, f=stream: rest.__setitem__(n, f.read()),
                             daemon=True).start()
        initiator = subprocess.run(
            prefix + [str(PROGRAM), "--mode", "initiator", "--port", str(port),
                      "--iters", str(iters)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert initiator.returncode == 0, initiator.stdout + initiator.stderr
        assert target.wait(timeout=60) == 0, rest
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()
    result = [l for l in initiator.stdout.splitlines() if l.startswith("RESULT ")]
    assert result, initiator.stdout
    return json.loads(result[-1][len("RESULT "):])


def test_unchanged_nixl_program_runs_through_the_shim():
    result = run_program([sys.executable], shim_env())
    assert result["verified"] and result["reads"] == 50 and result["reads_per_s"] > 0


def test_unchanged_nixl_program_runs_through_as_nixl():
    result = run_program([sys.executable, "-m", "rdma_nixl.as_nixl"], dict(os.environ))
    assert result["verified"] and result["reads_per_s"] > 0


def test_as_nixl_refuses_another_nixl(monkeypatch):
    import types

    from rdma_nixl import as_nixl

    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    with pytest.raises(RuntimeError, match="another `nixl`"):
        as_nixl.install()


@pytest.fixture
def no_nixl_module():
    """No ``nixl`` module imported before the test, and none left after it."""
    from rdma_nixl import as_nixl

    names = ["nixl"] + [f"nixl.{m}" for m in as_nixl.SUBMODULES]
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    yield
    for n in names:
        sys.modules.pop(n, None)
    sys.modules.update(saved)


def test_as_nixl_maps_the_names_in_process(no_nixl_module):
    from rdma_nixl import _bindings, as_nixl

    module = as_nixl.install()
    assert as_nixl.install() is module, "idempotent"
    import nixl._bindings

    assert nixl._bindings is _bindings
    from nixl import nixl_agent_config  # noqa: F401
