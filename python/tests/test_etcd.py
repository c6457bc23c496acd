"""Metadata through etcd (``NIXL_ETCD_ENDPOINTS``): NIXL's central metadata store.

A real etcd is started on loopback for this module: the binary is ``NIXL_TEST_ETCD_BIN``
or ``etcd`` on ``PATH`` (Debian: etcd-server); without one the tests skip, saying so.
Each test uses a namespace of its own. The agents read ``NIXL_ETCD_ENDPOINTS`` /
``NIXL_ETCD_NAMESPACE`` when they are made, as NIXL's do. Fetches are polled with
``check_remote_metadata`` (NIXL's fetch is asynchronous), so the tests hold for NIXL too
except where marked ``ours_only``.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from conftest import IMPL, free_port, load_api, load_module, wait_for, wait_xfer

api = load_api()
bindings = load_module("_bindings")

SIZE = 1 << 20
_NAMESPACES = itertools.count()


@pytest.fixture(scope="module")
def etcd_endpoint():
    binary = os.environ.get("NIXL_TEST_ETCD_BIN") or shutil.which("etcd")
    if not binary:
        pytest.skip("no etcd binary (install etcd-server or set NIXL_TEST_ETCD_BIN)")
    client, peer = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    with tempfile.TemporaryDirectory(prefix="etcd-pytest-") as data:
        log = open(os.path.join(data, "etcd.log"), "wb")
        proc = subprocess.Popen(
            [
                binary,
                "--name", "nixl-pytest",
                "--data-dir", os.path.join(data, "data"),
                "--listen-client-urls", client_url,
                "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url,
                "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"nixl-pytest={peer_url}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", client), timeout=0.2).close()
                    break
                except OSError:
                    if proc.poll() is not None:
                        log.close()
                        with open(os.path.join(data, "etcd.log")) as f:
                            pytest.fail(f"etcd exited ({proc.returncode}):\n{f.read()}")
                    if time.monotonic() > deadline:
                        pytest.fail("etcd never listened")
                    time.sleep(0.05)
            yield client_url
        finally:
            proc.kill()
            proc.wait()
            log.close()


@pytest.fixture
def etcd_env(etcd_endpoint, monkeypatch):
    """``NIXL_ETCD_ENDPOINTS`` and a namespace of this test's own; returns both."""
    namespace = f"/nixl-pytest/{os.getpid()}-{next(_NAMESPACES)}"
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", etcd_endpoint)
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", namespace)
    return etcd_endpoint, namespace


def agent(name: str) -> "api.nixl_agent":
    # No listener: etcd is the only way metadata travels in these tests.
    return api.nixl_agent(name, api.nixl_agent_config(enable_listen_thread=False))


def dram(buf: np.ndarray, off: int = 0, n: int = None) -> tuple:
    n = buf.nbytes - off if n is None else n
    return (buf.ctypes.data + off, n, 0)


def reg(buf: np.ndarray) -> tuple:
    return (*dram(buf), "")


def read_into(initiator, dst: np.ndarray, remote_rows, peer: str, tag: bytes) -> None:
    local = initiator.get_xfer_descs([dram(dst)], "DRAM")
    remote = initiator.get_xfer_descs(remote_rows, "DRAM")
    h = initiator.initialize_xfer("READ", local, remote, peer, tag)
    wait_xfer(initiator, h, state=initiator.transfer(h))
    initiator.release_xfer_handle(h)


# --- two processes ------------------------------------------------------------------------


@pytest.fixture
def etcd_peer(etcd_env):
    endpoint, namespace = etcd_env
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    import _etcd_peer

    proc = ctx.Process(
        target=_etcd_peer.serve,
        args=(IMPL, endpoint, namespace, "etcd-target", SIZE, child),
        daemon=True,
    )
    proc.start()
    child.close()
    assert parent.poll(60), "peer process did not start"
    hello = parent.recv()
    hello["conn"] = parent
    hello["proc"] = proc
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


def ask(peer, *cmd, timeout=30):
    peer["conn"].send(cmd)
    assert peer["conn"].poll(timeout), f"peer did not answer {cmd[0]}"
    return peer["conn"].recv()


def test_two_processes_exchange_metadata_through_etcd(etcd_peer):
    peer = etcd_peer
    a = agent("etcd-initiator")
    dst = np.zeros(SIZE, dtype=np.uint8)
    a.register_memory([reg(dst)], "DRAM")
    expect = (np.arange(SIZE, dtype=np.uint64) * 7 + 3).astype(np.uint8)

    a.fetch_remote_metadata("etcd-target")
    wait_for(lambda: a.check_remote_metadata("etcd-target"), what="metadata from etcd")
    rows = [(peer["addr"], SIZE, 0)]
    read_into(a, dst, rows, "etcd-target", b"first")
    assert np.array_equal(dst, expect)
    assert ask(peer, "await", "etcd-initiator", b"first") == ("ok",)

    # The peer removes its keys: this agent, watching them, forgets it.
    assert ask(peer, "invalidate") == ("ok",)
    wait_for(lambda: not a.check_remote_metadata("etcd-target"), what="invalidation via etcd")

    # Republished and fetched again: transfers work again.
    assert ask(peer, "publish") == ("ok",)
    a.fetch_remote_metadata("etcd-target")
    wait_for(lambda: a.check_remote_metadata("etcd-target"), what="metadata fetched again")
    dst[:] = 0
    read_into(a, dst, rows, "etcd-target", b"second")
    assert np.array_equal(dst, expect)
    assert ask(peer, "await", "etcd-initiator", b"second") == ("ok",)


@pytest.mark.ours_only
def test_a_peer_process_that_exits_is_forgotten(etcd_peer):
    """Our keys hang on a lease the agent revokes when it goes (and that expires if its
    process dies): a peer that fetched it through etcd forgets it."""
    a = agent("etcd-watcher")
    a.fetch_remote_metadata("etcd-target")
    wait_for(lambda: a.check_remote_metadata("etcd-target"), what="metadata from etcd")
    assert ask(etcd_peer, "bye") == ("ok",)
    etcd_peer["proc"].join(20)
    wait_for(lambda: not a.check_remote_metadata("etcd-target"), what="the peer's keys gone")


# --- one process --------------------------------------------------------------------------


def test_fetch_before_publish_loads_when_published(etcd_env):
    """NIXL's fetch waits (up to ``etcdWatchTimeout``) for a key not published yet."""
    a = agent("early")
    b = agent("late")
    buf = np.zeros(4096, dtype=np.uint8)
    b.register_memory([reg(buf)], "DRAM")
    a.fetch_remote_metadata("late")
    time.sleep(0.2)
    assert not a.check_remote_metadata("late")
    b.send_local_metadata()
    wait_for(lambda: a.check_remote_metadata("late"), timeout=10, what="the late key")


def test_partial_metadata_by_label(etcd_env):
    """As NIXL's partial_md_example.py --etcd: the target publishes its registrations
    in two labelled parts; the initiator sees only what it fetched."""
    target, init = agent("part-target"), agent("part-init")
    first = np.full(SIZE, 0x11, dtype=np.uint8)
    second = np.full(SIZE, 0x22, dtype=np.uint8)
    reg1 = target.register_memory([reg(first)], "DRAM")
    reg2 = target.register_memory([reg(second)], "DRAM")
    dst = np.zeros(SIZE, dtype=np.uint8)
    init.register_memory([reg(dst)], "DRAM")
    xfer1, xfer2 = reg1.trim(), reg2.trim()

    target.send_partial_agent_metadata(reg1, True, ["UCX"], label="label_1")
    init.fetch_remote_metadata("part-target", label="label_1")
    wait_for(lambda: init.check_remote_metadata("part-target", xfer1), what="label_1")
    assert not init.check_remote_metadata("part-target", xfer2)
    read_into(init, dst, [dram(first)], "part-target", b"p1")
    assert (dst == 0x11).all()
    with pytest.raises(bindings.nixlNotFoundError):
        init.initialize_xfer(
            "READ", init.get_xfer_descs([dram(dst)], "DRAM"), xfer2, "part-target", b"p2"
        )

    target.send_partial_agent_metadata(reg2, True, ["UCX"], label="label_2")
    init.fetch_remote_metadata("part-target", label="label_2")
    wait_for(lambda: init.check_remote_metadata("part-target", xfer2), what="label_2")
    read_into(init, dst, [dram(second)], "part-target", b"p2")
    assert (dst == 0x22).all()
    wait_for(lambda: target.check_remote_xfer_done("part-init", b"p2"), what="notification")


@pytest.mark.ours_only
def test_partial_metadata_needs_a_label(etcd_env):
    a = agent("unlabelled")
    buf = np.zeros(4096, dtype=np.uint8)
    descs = a.register_memory([reg(buf)], "DRAM")
    with pytest.raises(bindings.nixlInvalidParamError):
        a.send_partial_agent_metadata(descs, True)


@pytest.mark.ours_only
def test_invalidate_removes_the_keys(etcd_env):
    """After ``invalidate_local_metadata()`` a fresh fetch finds nothing (its background
    wait times out); a second invalidation is fine, as in NIXL."""
    b = agent("going")
    b.send_local_metadata()
    b.invalidate_local_metadata()
    b.invalidate_local_metadata()
    config = bindings.nixlAgentConfig()
    config.etcdWatchTimeout = 0.5
    low = bindings.nixlAgent("looking", config)
    low.fetchRemoteMD("going")
    time.sleep(1.0)
    assert low.checkRemoteMD("going", bindings.nixlXferDList(bindings.DRAM_SEG)) != (
        bindings.NIXL_SUCCESS
    )


@pytest.mark.ours_only
def test_unreachable_etcd_is_a_bounded_backend_error(monkeypatch):
    """No etcd at the endpoint: each call raises nixlBackendError within the agent's
    ``etcdWatchTimeout`` (NIXL logs and carries on; ours tells the caller)."""
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", f"http://127.0.0.1:{free_port()}")
    config = bindings.nixlAgentConfig()
    config.etcdWatchTimeout = 1
    a = bindings.nixlAgent("stranded", config)  # making the agent does no I/O
    for call in (lambda: a.sendLocalMD(), lambda: a.fetchRemoteMD("anyone")):
        start = time.monotonic()
        with pytest.raises(bindings.nixlBackendError):
            call()
        assert time.monotonic() - start < 5, "not bounded by etcdWatchTimeout"
    # Nothing was published: nothing to remove, no I/O.
    a.invalidateLocalMD()


@pytest.mark.ours_only
def test_without_endpoints_no_address_is_invalid_param(monkeypatch):
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    a = agent("no-store")
    with pytest.raises(bindings.nixlInvalidParamError):
        a.send_local_metadata()
    with pytest.raises(bindings.nixlInvalidParamError):
        a.fetch_remote_metadata("anyone")


@pytest.mark.ours_only
def test_nixls_partial_md_example_runs_unchanged_through_etcd(etcd_env):
    """NIXL's ``examples/python/partial_md_example.py --etcd``, not a line changed,
    through the opt-in ``nixl`` name (``python/nixl-shim``). We do not ship NIXL's file:
    ``NIXL_EXAMPLES_DIR`` names a checkout's ``examples/python`` (skipped without)."""
    examples = os.environ.get("NIXL_EXAMPLES_DIR")
    script = os.path.join(examples or "", "partial_md_example.py")
    if not examples or not os.path.isfile(script):
        pytest.skip("NIXL_EXAMPLES_DIR (a NIXL checkout's examples/python) is not set")
    shim = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nixl-shim")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH", "")) if p)
    ports = ["--init-port", str(free_port()), "--target-port", str(free_port())]
    out = subprocess.run(
        [sys.executable, script, "--etcd", *ports],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Test Complete." in out.stdout + out.stderr
