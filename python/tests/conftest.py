"""Selects the implementation under test.

``NIXL_PY_IMPL=ours`` (the default) tests ``rdma_nixl._api``; ``NIXL_PY_IMPL=nixl``
tests NIXL's own wheel (``nixl._api``, or ``nixl_cu12._api`` / ``nixl_cu13._api`` where
only the CUDA-specific wheel is installed). The suite is written against NIXL's
documented Python API only, so it must pass unchanged on both; tests of our additions
are marked ``ours_only``.
"""

from __future__ import annotations

import importlib
import os
import socket
import time

import pytest

IMPL = os.environ.get("NIXL_PY_IMPL", "ours")


def load_module(name: str = "_api"):
    """The implementation's module ``name`` (``_api``, ``_bindings``, ``_utils``,
    ``logging``): ``rdma_nixl.<name>``, or NIXL's ``nixl.<name>`` (``nixl_cu12`` /
    ``nixl_cu13`` where only the CUDA-specific wheel is installed)."""
    if IMPL == "ours":
        return importlib.import_module(f"rdma_nixl.{name}")
    if IMPL == "nixl":
        for package in ("nixl", "nixl_cu12", "nixl_cu13"):
            try:
                module = importlib.import_module(f"{package}.{name}")
            except ImportError:
                continue
            if not module.__name__.startswith("rdma_nixl."):  # not our opt-in `nixl` shim
                return module
        raise RuntimeError("NIXL_PY_IMPL=nixl but no NIXL wheel is installed")
    raise RuntimeError(f"NIXL_PY_IMPL must be 'ours' or 'nixl', not {IMPL!r}")


def load_api():
    return load_module("_api")


def pytest_configure(config):
    config.addinivalue_line("markers", "ours_only: tests of rdma_nixl's additions to NIXL's API")


def pytest_collection_modifyitems(config, items):
    if IMPL == "ours":
        return
    skip = pytest.mark.skip(reason="tests rdma_nixl's additions (NIXL_PY_IMPL=nixl)")
    for item in items:
        if "ours_only" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    """Polls ``predicate`` until it returns a truthy value (returned) or fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.001)


def wait_xfer(agent, handle, timeout: float = 20.0, state: str = None) -> None:
    """Polls a posted transfer until DONE (fails the test on ERR or a timeout)."""
    deadline = time.monotonic() + timeout
    state = state or "PROC"
    while state == "PROC":
        if time.monotonic() > deadline:
            pytest.fail(f"transfer not done after {timeout} s")
        state = agent.check_xfer_state(handle)
    assert state == "DONE", state
