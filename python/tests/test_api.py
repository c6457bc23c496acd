"""NIXL's Python API, tested as NIXL documents it (runs against ours and NIXL's wheel).

DRAM only (numpy buffers), with the default configuration (backend ``UCX``: ours maps
it to ``LIBFABRIC``). Two agents in one process, and an agent in another process.
"""

from __future__ import annotations

import gc
import multiprocessing as mp

import numpy as np
import pytest
from conftest import IMPL, free_port, load_api, wait_for, wait_xfer

api = load_api()
B = api.nixlBind  # the bindings module of the implementation: exception classes
SIZE = 4 << 20
CHUNK = 64 << 10


def pattern(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def make_agent(name: str, **conf) -> "api.nixl_agent":
    return api.nixl_agent(name, api.nixl_agent_config(**conf) if conf else None)


def dram(buf: np.ndarray, off: int = 0, n: int = None) -> tuple:
    n = buf.nbytes - off if n is None else n
    return (buf.ctypes.data + off, n, 0)


class Pair:
    """Initiator ``A`` and target ``B`` in this process, ``B``'s metadata loaded in ``A``."""

    def __init__(self, **conf):
        self.a = make_agent("A", **conf)
        self.b = make_agent("B", **conf)
        self.src = pattern(SIZE, 7)
        self.dst = np.zeros(SIZE, dtype=np.uint8)
        self.reg_a = self.a.register_memory([(*dram(self.src), "")], "DRAM")
        self.reg_b = self.b.register_memory(np.array([dram(self.dst)], dtype=np.uint64), "DRAM")
        assert self.a.add_remote_agent(self.b.get_agent_metadata()) == b"B"


@pytest.fixture
def pair():
    return Pair()


def chunks(buf: np.ndarray, count: int, size: int = CHUNK):
    return [dram(buf, i * size, size) for i in range(count)]


# --- configuration and backends -------------------------------------------------------


def test_config_defaults_are_nixls():
    conf = api.nixl_agent_config()
    assert conf.enable_pthread is True
    assert conf.enable_listen is False
    assert conf.port == api.DEFAULT_COMM_PORT == 8888
    assert conf.capture_telemetry is False
    assert conf.num_threads == 0
    assert conf.backends == ["UCX"]
    assert conf.sync_mode is None
    with pytest.raises(TypeError):
        api.nixl_agent_config(sync_mode="strict")


def test_default_agent_has_a_backend_for_dram():
    agent = api.nixl_agent("solo")
    assert agent.name == "solo"
    plugins = agent.get_plugin_list()
    assert plugins and all(isinstance(p, str) for p in plugins)
    assert len(agent.backends) >= 1
    for name in agent.backends:
        assert "DRAM_SEG" in agent.get_backend_mem_types(name)
        assert isinstance(agent.get_backend_params(name), dict)
        assert name in plugins
        assert "DRAM_SEG" in agent.get_plugin_mem_types(name)
        assert isinstance(agent.get_plugin_params(name), dict)
    assert agent.get_backend_mem_types("NO_SUCH_BACKEND") == []
    assert agent.get_backend_params("NO_SUCH_BACKEND") == {}
    assert agent.get_plugin_mem_types("NO_SUCH_PLUGIN") == []
    assert agent.get_plugin_params("NO_SUCH_PLUGIN") == {}


def test_unknown_backend_is_not_found():
    agent = api.nixl_agent("solo")
    with pytest.raises(B.nixlNotFoundError):
        agent.create_backend("NO_SUCH_BACKEND")


# --- registration and descriptor lists --------------------------------------------------


def test_register_deregister_tuples_and_numpy():
    agent = api.nixl_agent("reg")
    buf = np.zeros(4 * CHUNK, dtype=np.uint8)
    regs = agent.register_memory([(*d, "") for d in chunks(buf, 2)], "DRAM")
    assert regs.descCount() == 2
    more = agent.register_memory(np.array(chunks(buf[2 * CHUNK :], 2), dtype=np.uint64), "DRAM")
    assert more.descCount() == 2
    agent.deregister_memory(regs)
    agent.deregister_memory(more)
    with pytest.raises(B.nixlNotFoundError):
        agent.deregister_memory(regs)


def test_descriptor_lists():
    agent = api.nixl_agent("descs")
    xfer = agent.get_xfer_descs([(0x1000, 64, 0), (0x2000, 32, 0)], "DRAM")
    assert xfer.descCount() == 2 and not xfer.isEmpty()
    assert xfer[1] == (0x2000, 32, 0)
    assert xfer.getType() == B.DRAM_SEG
    assert agent.get_xfer_descs(np.array([[1, 2, 3], [4, 5, 6]]), "VRAM")[1] == (4, 5, 6)
    assert agent.get_xfer_descs(xfer) is xfer
    assert agent.get_xfer_descs([(0x1000, 64, 0)], "cpu").getType() == B.DRAM_SEG
    reg = agent.get_reg_descs([(0x1000, 64, 0, "meta")], "DRAM")
    assert reg[0] == (0x1000, 64, 0, b"meta")
    # Forms the API does not take give None, as NIXL.
    assert agent.get_xfer_descs([(1, 2)], "DRAM") is None
    assert agent.get_xfer_descs([(1, 2, 0)]) is None
    assert agent.get_reg_descs([(1, 2, 0)], "DRAM") is None
    assert agent.get_reg_descs(xfer) is None
    # Serialization round trip.
    back = agent.deserialize_descs(agent.get_serialized_descs(xfer))
    assert back.descCount() == 2 and back[0] == xfer[0] and back[1] == xfer[1]
    rback = agent.deserialize_descs(agent.get_serialized_descs(reg))
    assert rback[0] == (0x1000, 64, 0, b"meta")


# --- transfers in one process -------------------------------------------------------------


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_prepped_transfer_with_notification_after_data(op):
    p = Pair()
    n = 16
    if op == "READ":
        # READ pulls B's bytes into A: put the pattern on B's side.
        p.dst[:] = pattern(SIZE, 11)
        p.src[:] = 0
        expect = pattern(SIZE, 11)
    else:
        expect = p.src.copy()
    local = p.a.prep_xfer_dlist("NIXL_INIT_AGENT", chunks(p.src, n), "DRAM")
    remote = p.a.prep_xfer_dlist("B", chunks(p.dst, n), "DRAM")
    order = list(range(n))
    h = p.a.make_prepped_xfer(op, local, order, remote, np.array(order[::-1]), b"tag-1")
    assert p.a.query_xfer_backend(h) in p.a.backends
    wait_xfer(p.a, h, state=p.a.transfer(h))
    # The notification arrives at B, after the data: every chunk is in place by then.
    wait_for(lambda: p.b.check_remote_xfer_done("A", b"tag"), what="notification")
    for i in range(n):
        j = n - 1 - i
        a_chunk = p.src[i * CHUNK : (i + 1) * CHUNK]
        b_chunk = p.dst[j * CHUNK : (j + 1) * CHUNK]
        assert np.array_equal(a_chunk, b_chunk), f"chunk {i}"
        if op == "READ":
            assert np.array_equal(a_chunk, expect[j * CHUNK : (j + 1) * CHUNK])
    # Reposting the same request moves the data again and notifies again.
    wait_xfer(p.a, h, state=p.a.transfer(h, b"tag-2"))
    wait_for(lambda: p.b.check_remote_xfer_done("A", b"tag-2"), what="second notification")
    p.a.release_xfer_handle(h)
    p.a.release_dlist_handle(local)
    p.a.release_dlist_handle(remote)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_one_shot_transfer(pair, op):
    p = pair
    if op == "READ":
        p.dst[:] = pattern(SIZE, 3)
    local = p.a.get_xfer_descs([dram(p.src, 0, 4096), dram(p.src, 8192, 100)], "DRAM")
    remote = p.a.get_xfer_descs([dram(p.dst, 4096, 4096), dram(p.dst, 0, 100)], "DRAM")
    h = p.a.initialize_xfer(op, local, remote, "B", b"one-shot")
    wait_xfer(p.a, h, state=p.a.transfer(h))
    wait_for(lambda: p.b.check_remote_xfer_done("A", b"one-shot"), what="notification")
    assert np.array_equal(p.src[:4096], p.dst[4096:8192])
    assert np.array_equal(p.src[8192:8292], p.dst[:100])


def test_standalone_notification_after_plain_transfer(pair):
    p = pair
    h = p.a.initialize_xfer(
        "WRITE",
        p.a.get_xfer_descs([dram(p.src, 0, 4096)], "DRAM"),
        p.a.get_xfer_descs([dram(p.dst, 0, 4096)], "DRAM"),
        "B",
    )
    wait_xfer(p.a, h, state=p.a.transfer(h))
    p.a.send_notif("B", b"fence")
    notifs = wait_for(lambda: p.b.get_new_notifs(), what="standalone notification")
    assert notifs == {"A": [b"fence"]}


def test_write_done_means_data_is_at_target(pair):
    """Without a notification, DONE at the initiator is the only signal: NIXL's WRITE is
    delivered by then (checked 20 times: a race would show)."""
    p = pair
    local = p.a.get_xfer_descs([dram(p.src, 0, 4096)], "DRAM")
    remote = p.a.get_xfer_descs([dram(p.dst, 0, 4096)], "DRAM")
    for i in range(20):
        p.dst[:4096] = 0
        p.src[:4096] = pattern(4096, i)
        h = p.a.initialize_xfer("WRITE", local, remote, "B")
        wait_xfer(p.a, h, state=p.a.transfer(h))
        assert np.array_equal(p.src[:4096], p.dst[:4096]), f"round {i}"


def test_loopback_transfer():
    agent = make_agent("loop")
    buf = pattern(2 * CHUNK, 5)
    buf[CHUNK:] = 0
    agent.register_memory([(*dram(buf), "")], "DRAM")
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [dram(buf, 0, CHUNK)], "DRAM")
    remote = agent.prep_xfer_dlist("loop", [dram(buf, CHUNK, CHUNK)], "DRAM")
    h = agent.make_prepped_xfer("WRITE", local, [0], remote, [0], b"self")
    wait_xfer(agent, h, state=agent.transfer(h))
    wait_for(lambda: agent.check_remote_xfer_done("loop", b"self"), what="loopback notification")
    assert np.array_equal(buf[:CHUNK], buf[CHUNK:])


def test_standalone_notifications(pair):
    p = pair
    p.a.send_notif("B", b"hello")
    p.a.send_notif("B", "as-str")
    got = {}

    def both():
        for k, v in p.b.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        return len(got.get("A", [])) == 2

    wait_for(both, what="two notifications")
    assert got == {"A": [b"hello", b"as-str"]}
    # update_notifs keeps what was not consumed; check_remote_xfer_done consumes one.
    p.a.send_notif("B", b"abc-123")
    wait_for(lambda: p.b.update_notifs().get("A"), what="notification")
    assert p.b.update_notifs() == {"A": [b"abc-123"]}
    assert not p.b.check_remote_xfer_done("A", b"123")  # not a prefix
    assert p.b.check_remote_xfer_done("A", b"123", tag_is_prefix=False)
    assert p.b.update_notifs() == {"A": []}


def test_remove_and_readd_remote_agent(pair):
    p = pair
    local = p.a.get_xfer_descs([dram(p.src, 0, 4096)], "DRAM")
    remote = p.a.get_xfer_descs([dram(p.dst, 0, 4096)], "DRAM")
    old = p.a.initialize_xfer("WRITE", local, remote, "B")
    wait_xfer(p.a, old, state=p.a.transfer(old))
    assert p.a.check_remote_metadata("B")
    p.a.remove_remote_agent("B")
    assert not p.a.check_remote_metadata("B")
    with pytest.raises(B.nixlNotFoundError):
        p.a.prep_xfer_dlist("B", [dram(p.dst, 0, 4096)], "DRAM")
    with pytest.raises(B.nixlNotFoundError):
        p.a.initialize_xfer("WRITE", local, remote, "B")
    # A request made for the removed peer is not posted again.
    with pytest.raises(Exception):
        p.a.transfer(old)
    assert p.a.add_remote_agent(p.b.get_agent_metadata()) == b"B"
    p.src[:4096] = pattern(4096, 99)
    h = p.a.initialize_xfer("WRITE", local, remote, "B", b"again")
    wait_xfer(p.a, h, state=p.a.transfer(h))
    wait_for(lambda: p.b.check_remote_xfer_done("A", b"again"), what="notification")
    assert np.array_equal(p.src[:4096], p.dst[:4096])


def test_bad_descriptors_raise(pair):
    p = pair
    remote_ok = p.a.get_xfer_descs([dram(p.dst, 0, 4096)], "DRAM")
    local_ok = p.a.get_xfer_descs([dram(p.src, 0, 4096)], "DRAM")
    outside = np.zeros(4096, dtype=np.uint8)  # never registered
    # Local memory that is not registered.
    with pytest.raises(B.nixlNotFoundError):
        p.a.prep_xfer_dlist("NIXL_INIT_AGENT", [dram(outside)], "DRAM")
    with pytest.raises(B.nixlNotFoundError):
        p.a.initialize_xfer("WRITE", p.a.get_xfer_descs([dram(outside)], "DRAM"), remote_ok, "B")
    # Remote memory outside what the peer registered.
    beyond = p.a.get_xfer_descs([(p.dst.ctypes.data + SIZE, 4096, 0)], "DRAM")
    with pytest.raises(B.nixlNotFoundError):
        p.a.initialize_xfer("WRITE", local_ok, beyond, "B")
    assert not p.a.check_remote_metadata("B", beyond)
    assert p.a.check_remote_metadata("B", remote_ok)
    # An unknown peer.
    with pytest.raises(B.nixlNotFoundError):
        p.a.prep_xfer_dlist("nobody", [dram(p.dst, 0, 64)], "DRAM")
    # Lengths that do not match.
    short = p.a.get_xfer_descs([dram(p.dst, 0, 1000)], "DRAM")
    with pytest.raises(B.nixlInvalidParamError):
        p.a.initialize_xfer("WRITE", local_ok, short, "B")
    # Indices out of range, or of different counts.
    local = p.a.prep_xfer_dlist("NIXL_INIT_AGENT", [dram(p.src, 0, 64)], "DRAM")
    remote = p.a.prep_xfer_dlist("B", [dram(p.dst, 0, 64)], "DRAM")
    with pytest.raises(B.nixlInvalidParamError):
        p.a.make_prepped_xfer("WRITE", local, [1], remote, [0])
    with pytest.raises(B.nixlInvalidParamError):
        p.a.make_prepped_xfer("WRITE", local, [0], remote, [0, 0])
    # Metadata that is not metadata.
    with pytest.raises(B.nixlMismatchError):
        p.a.add_remote_agent(b"definitely not metadata")
    # Polling a request never posted.
    h = p.a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    with pytest.raises(B.nixlNotPostedError):
        p.a.check_xfer_state(h)


def test_handles_release_explicitly_and_on_collection(pair):
    p = pair
    local = p.a.prep_xfer_dlist("NIXL_INIT_AGENT", [dram(p.src, 0, 64)], "DRAM")
    remote = p.a.prep_xfer_dlist("B", [dram(p.dst, 0, 64)], "DRAM")
    h = p.a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    wait_xfer(p.a, h, state=p.a.transfer(h))
    p.a.release_xfer_handle(h)
    assert "released=True" in repr(h)
    p.a.release_xfer_handle(h)  # idempotent
    for _ in range(50):
        h = p.a.make_prepped_xfer("WRITE", local, [0], remote, [0])
        wait_xfer(p.a, h, state=p.a.transfer(h))
    del h
    gc.collect()
    p.a.release_dlist_handle(local)
    assert "released=True" in repr(local)
    del remote
    gc.collect()


def test_telemetry():
    agent = make_agent("tele", capture_telemetry=True)
    buf = np.zeros(2 * CHUNK, dtype=np.uint8)
    agent.register_memory([(*dram(buf), "")], "DRAM")
    h = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs([dram(buf, 0, CHUNK)], "DRAM"),
        agent.get_xfer_descs([dram(buf, CHUNK, CHUNK)], "DRAM"),
        "tele",
    )
    wait_xfer(agent, h, state=agent.transfer(h))
    t = agent.get_xfer_telemetry(h)
    assert t.totalBytes == CHUNK
    assert t.descCount == 1
    assert t.xferDuration >= t.postDuration >= 0
    plain = make_agent("plain")
    plain.register_memory([(*dram(buf), "")], "DRAM")
    h2 = plain.initialize_xfer(
        "WRITE",
        plain.get_xfer_descs([dram(buf, 0, 64)], "DRAM"),
        plain.get_xfer_descs([dram(buf, CHUNK, 64)], "DRAM"),
        "plain",
    )
    with pytest.raises(B.nixlNoTelemetryError):
        plain.get_xfer_telemetry(h2)


def test_partial_metadata():
    a = make_agent("A")
    b = make_agent("B")
    src = pattern(2 * CHUNK, 1)
    dst = np.zeros(2 * CHUNK, dtype=np.uint8)
    a.register_memory([(*dram(src), "")], "DRAM")
    first = b.register_memory([(*dram(dst, 0, CHUNK), "")], "DRAM")
    b.register_memory([(*dram(dst, CHUNK, CHUNK), "")], "DRAM")
    # Connection information only, then the first region only.
    conn = b.get_partial_agent_metadata(B.nixlRegDList(B.DRAM_SEG), True)
    assert a.add_remote_agent(conn) == b"B"
    assert a.add_remote_agent(b.get_partial_agent_metadata(first, False)) == b"B"
    covered = a.get_xfer_descs([dram(dst, 0, CHUNK)], "DRAM")
    not_sent = a.get_xfer_descs([dram(dst, CHUNK, CHUNK)], "DRAM")
    assert a.check_remote_metadata("B", covered)
    assert not a.check_remote_metadata("B", not_sent)
    h = a.initialize_xfer(
        "WRITE", a.get_xfer_descs([dram(src, 0, CHUNK)], "DRAM"), covered, "B", b"partial"
    )
    wait_xfer(a, h, state=a.transfer(h))
    wait_for(lambda: b.check_remote_xfer_done("A", b"partial"), what="notification")
    assert np.array_equal(src[:CHUNK], dst[:CHUNK])


def test_threads_transfer_concurrently():
    """Python threads post and poll their own requests on one agent at once (thread-safe
    sync mode asked for, as NIXL requires)."""
    import threading

    strict = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    p = Pair(sync_mode=strict)
    threads, errors = 4, []
    per = SIZE // threads

    def worker(t: int) -> None:
        try:
            local = p.a.get_xfer_descs([dram(p.src, t * per, per)], "DRAM")
            remote = p.a.get_xfer_descs([dram(p.dst, t * per, per)], "DRAM")
            h = p.a.initialize_xfer("WRITE", local, remote, "B", f"t{t}".encode())
            for _ in range(20):
                wait_xfer(p.a, h, state=p.a.transfer(h))
            p.a.release_xfer_handle(h)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert not errors, errors
    for t in range(threads):
        for _ in range(20):
            wait_for(lambda: p.b.check_remote_xfer_done("A", f"t{t}".encode()), what=f"t{t}")
    assert np.array_equal(p.src, p.dst)


# --- metadata through the listener --------------------------------------------------------


def test_metadata_by_listener_fetch_send_invalidate():
    port_a, port_b = free_port(), free_port()
    a = make_agent("A", enable_listen_thread=True, listen_port=port_a)
    b = make_agent("B", enable_listen_thread=True, listen_port=port_b)
    src = pattern(CHUNK, 2)
    dst = np.zeros(CHUNK, dtype=np.uint8)
    a.register_memory([(*dram(src), "")], "DRAM")
    b.register_memory([(*dram(dst), "")], "DRAM")
    # A fetches B's metadata from B's listener.
    a.fetch_remote_metadata("B", "127.0.0.1", port_b)
    wait_for(lambda: a.check_remote_metadata("B"), what="fetched metadata")
    # B pushes its metadata to A's listener... and A's to B the other way round.
    a.send_local_metadata("127.0.0.1", port_b)
    wait_for(lambda: b.check_remote_metadata("A"), what="sent metadata")
    h = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([dram(src)], "DRAM"),
        a.get_xfer_descs([dram(dst)], "DRAM"),
        "B",
        b"via-listener",
    )
    wait_xfer(a, h, state=a.transfer(h))
    wait_for(lambda: b.check_remote_xfer_done("A", b"via-listener"), what="notification")
    assert np.array_equal(src, dst)
    # A tells B to forget it.
    a.invalidate_local_metadata("127.0.0.1", port_b)
    wait_for(lambda: not b.check_remote_metadata("A"), what="invalidation")


# --- two processes ------------------------------------------------------------------------


@pytest.fixture
def peer_process():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port = free_port()
    import _peer

    proc = ctx.Process(target=_peer.serve, args=(IMPL, port, SIZE, child), daemon=True)
    proc.start()
    child.close()  # the child's end lives in the child: its exit closes the pipe
    assert parent.poll(60), "peer process did not start"
    hello = parent.recv()
    hello["port"] = port
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


def ask(peer, *cmd, timeout=30):
    peer["conn"].send(cmd)
    assert peer["conn"].poll(timeout), f"peer did not answer {cmd[0]}"
    return peer["conn"].recv()


# 64 KiB blocks, and one 4 MiB block (over shm ours copies it from both processes at once).
@pytest.mark.parametrize("exchange,block", [("blob", CHUNK), ("listener", CHUNK), ("blob", SIZE)])
def test_two_processes_write_then_read(peer_process, exchange, block):
    peer = peer_process
    port = free_port()
    a = make_agent("initiator", enable_listen_thread=True, listen_port=port)
    src = pattern(SIZE, 21)
    back = np.zeros(SIZE, dtype=np.uint8)
    a.register_memory([(*dram(src), ""), (*dram(back), "")], "DRAM")
    if exchange == "blob":
        assert a.add_remote_agent(peer["metadata"]) == b"target"
    else:
        a.fetch_remote_metadata("target", "127.0.0.1", peer["port"])
        wait_for(lambda: a.check_remote_metadata("target"), what="fetched metadata")
    n = SIZE // block
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", chunks(src, n, block), "DRAM")
    remote_rows = [(peer["addr"] + i * block, block, 0) for i in range(n)]
    remote = a.prep_xfer_dlist("target", remote_rows, "DRAM")
    h = a.make_prepped_xfer("WRITE", local, list(range(n)), remote, list(range(n)), b"w1")
    wait_xfer(a, h, state=a.transfer(h))
    # The peer saw the notification only once all the data was there.
    status, head, total = ask(peer, "await", b"w1")
    assert status == "ok"
    assert head == bytes(src[:64])
    assert total == int(src.sum(dtype=np.uint64))
    # Now READ a pattern the peer writes into its buffer.
    assert ask(peer, "fill", 0x5A) == ("ok",)
    into = a.prep_xfer_dlist("NIXL_INIT_AGENT", chunks(back, n, block), "DRAM")
    r = a.make_prepped_xfer("READ", into, list(range(n)), remote, list(range(n)), b"r1")
    wait_xfer(a, r, state=a.transfer(r))
    expect = np.arange(SIZE, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    assert np.array_equal(back, expect)
    status, _, _ = ask(peer, "await", b"r1")
    assert status == "ok"
    # Standalone notification across processes.
    a.send_notif("target", b"ping")

    def got_ping():
        return ask(peer, "notifs")[1].get("initiator") == [b"ping"]

    wait_for(got_ping, what="standalone notification in the peer")


def test_killed_peer_process_is_a_remote_disconnect(peer_process):
    """A peer whose process dies: the next transfer to it raises nixlRemoteDisconnectError
    (not a descriptor error, not a hang), in both implementations."""
    import os
    import signal
    import time

    peer = peer_process
    a = make_agent("initiator")
    src = pattern(CHUNK, 8)
    a.register_memory([(*dram(src), "")], "DRAM")
    a.add_remote_agent(peer["metadata"])
    local = a.get_xfer_descs([dram(src)], "DRAM")
    remote = a.get_xfer_descs([(peer["addr"], CHUNK, 0)], "DRAM")
    h = a.initialize_xfer("WRITE", local, remote, "target", b"before")
    wait_xfer(a, h, state=a.transfer(h))
    os.kill(peer["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    with pytest.raises(B.nixlRemoteDisconnectError):
        while time.monotonic() < deadline:
            h = a.initialize_xfer("WRITE", local, remote, "target", b"after")
            wait_xfer(a, h, state=a.transfer(h), timeout=30)
            time.sleep(0.01)


# --- our additions (typed errors) ---------------------------------------------------------


@pytest.mark.ours_only
def test_errors_share_a_base_and_carry_the_typed_error(pair):
    p = pair
    with pytest.raises(B.nixlError) as info:
        p.a.prep_xfer_dlist("nobody", [dram(p.dst, 0, 64)], "DRAM")
    assert isinstance(info.value, B.nixlNotFoundError)
    assert info.value.kind == "UnknownAgent"
    assert info.value.agent == "nobody"
    for cls in (B.nixlNotFoundError, B.nixlRemoteDisconnectError, B.nixlBackendError):
        assert issubclass(cls, B.nixlError) and issubclass(cls, Exception)


@pytest.mark.ours_only
def test_wait_new_notifs_sleeps_until_a_notification_or_the_timeout(pair):
    import threading
    import time

    p = pair
    start = time.monotonic()
    assert p.b.wait_new_notifs(0.3) == {}
    assert 0.3 <= time.monotonic() - start < 10
    # A notification sent from another Python thread while B waits (the GIL is released
    # meanwhile, or the sender could not run) ends the wait early.
    sender = threading.Timer(0.2, lambda: p.a.send_notif("B", b"wake"))
    sender.start()
    start = time.monotonic()
    got = p.b.wait_new_notifs(60)
    waited = time.monotonic() - start
    sender.join()
    assert got == {"A": [b"wake"]}
    assert waited < 10, waited
    assert p.b.wait_new_notifs(0.1) == {}, "taken once"
    with pytest.raises(B.nixlInvalidParamError):
        p.b.wait_new_notifs(-1)


@pytest.mark.ours_only
def test_remote_disconnect_is_its_own_error():
    """A transfer whose peer is lost raises nixlRemoteDisconnectError (the FAULT backend
    fails the first completion as a flushed one), unlike a bad descriptor."""
    a = api.nixl_agent("A", api.nixl_agent_config(backends=[]))
    a.create_backend("FAULT", {"inner": "LIBFABRIC", "disconnect_after": "1"})
    b = make_agent("B")
    src = pattern(CHUNK, 4)
    dst = np.zeros(CHUNK, dtype=np.uint8)
    a.register_memory([(*dram(src), "")], "DRAM")
    b.register_memory([(*dram(dst), "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer(
        "WRITE", a.get_xfer_descs([dram(src)], "DRAM"), a.get_xfer_descs([dram(dst)], "DRAM"), "B"
    )
    assert a.query_xfer_backend(h) == "FAULT"
    with pytest.raises(B.nixlRemoteDisconnectError) as info:
        wait_xfer(a, h, state=a.transfer(h))
    assert info.value.kind == "RemoteDisconnect"
    assert info.value.agent == "B"
    # Reconnect: the peer's metadata loaded again makes new requests work.
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([dram(src)], "DRAM"),
        a.get_xfer_descs([dram(dst)], "DRAM"),
        "B",
        b"after-reconnect",
    )
    wait_xfer(a, h, state=a.transfer(h))
    wait_for(lambda: b.check_remote_xfer_done("A", b"after-reconnect"), what="notification")
    assert np.array_equal(src, dst)


@pytest.mark.ours_only
def test_ucx_maps_to_libfabric(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="rdma_nixl")
    agent = api.nixl_agent("ucx", api.nixl_agent_config(backends=["UCX", "LIBFABRIC"]))
    # One backend, LIBFABRIC, known by the name asked for (as NIXL keys it); with a GPU,
    # CUDA_IPC beside it (what NIXL's UCX does inside for VRAM on this node).
    assert [k for k in agent.backends if k != "CUDA_IPC"] == ["UCX"]
    assert "UCX" in agent.get_plugin_list() and "LIBFABRIC" in agent.get_plugin_list()
    assert any("UCX" in r.getMessage() for r in caplog.records)
    assert agent.get_backend_mem_types("UCX") == agent.get_backend_mem_types("LIBFABRIC")
    assert agent.get_plugin_params("UCX") == agent.get_plugin_params("LIBFABRIC")
    buf = np.zeros(128, dtype=np.uint8)
    # Either name selects it.
    agent.register_memory([(*dram(buf), "")], "DRAM", backends=["LIBFABRIC"])
    h = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs([dram(buf, 0, 64)], "DRAM"),
        agent.get_xfer_descs([dram(buf, 64, 64)], "DRAM"),
        "ucx",
        backends=["UCX"],
    )
    assert agent.query_xfer_backend(h) == "UCX"


@pytest.mark.ours_only
def test_what_our_backends_lack_is_not_supported():
    agent = api.nixl_agent("noip")
    # No central metadata server: an IP is needed.
    with pytest.raises(B.nixlNotSupportedError):
        agent.send_local_metadata()
    with pytest.raises(B.nixlNotSupportedError):
        agent.fetch_remote_metadata("x")
    # No cost model. (The device API is GPUNETIO's: tests/test_device.py.)
    with pytest.raises(B.nixlNotSupportedError):
        agent.estimate_xfer_cost(None)


def test_torch_cpu_tensors_are_dram():
    """Tensors and lists of tensors as descriptors (CPU tensors: DRAM, device 0)."""
    torch = pytest.importorskip("torch")
    a = make_agent("A")
    b = make_agent("B")
    src = torch.arange(SIZE, dtype=torch.int64).remainder(253).to(torch.uint8)
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    regs = a.register_memory(src)
    assert regs.descCount() == 1 and regs.getType() == B.DRAM_SEG
    b.register_memory([dst])
    a.add_remote_agent(b.get_agent_metadata())
    n = 4
    piece = SIZE // n
    local = a.get_xfer_descs([src[i * piece : (i + 1) * piece] for i in range(n)])
    assert local.descCount() == n and local.getType() == B.DRAM_SEG
    assert local[1] == (src.data_ptr() + piece, piece, 0)
    remote = a.get_xfer_descs([dst[i * piece : (i + 1) * piece] for i in range(n)])
    h = a.initialize_xfer("WRITE", local, remote, "B", b"tensors")
    wait_xfer(a, h, state=a.transfer(h))
    wait_for(lambda: b.check_remote_xfer_done("A", b"tensors"), what="notification")
    assert torch.equal(src, dst)
    # A non-contiguous tensor is refused (None), as NIXL.
    assert a.get_xfer_descs(src.view(2, -1).t()) is None


@pytest.mark.ours_only
def test_blocking_calls_release_the_gil_and_time_out_typed():
    """A metadata fetch from a peer that accepts and never answers blocks for the
    metadata timeout with the GIL released (another Python thread keeps running), then
    raises the typed timeout."""
    import socket
    import threading
    import time

    from rdma_nixl import _core

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    agent = _core.Agent("gil", metadata_timeout_s=1.0)
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        start = time.monotonic()
        before = ticks
        with pytest.raises(B.nixlTimeoutError) as info:
            agent.fetch_remote_metadata("127.0.0.1", silent.getsockname()[1])
        blocked = time.monotonic() - start
        assert 0.9 < blocked < 10
        assert info.value.kind == "Timeout"
        assert isinstance(info.value, B.nixlBackendError)
        # The counter ran while the call blocked: the GIL was released.
        assert ticks - before > 100
    finally:
        stop.set()
        counter.join()
        silent.close()


def test_prep_xfer_dlist_takes_the_name_add_remote_agent_returned(pair):
    # vLLM's connector keeps add_remote_agent's return value (bytes in NIXL) and
    # prepares the peer's descriptor lists with it; NIXL's binding takes bytes as a str.
    name = pair.a.add_remote_agent(pair.b.get_agent_metadata())
    assert name == b"B"
    remote = pair.a.prep_xfer_dlist(name, chunks(pair.dst, 2), "DRAM")
    local = pair.a.prep_xfer_dlist("NIXL_INIT_AGENT", chunks(pair.src, 2), "DRAM")
    h = pair.a.make_prepped_xfer("WRITE", local, [0, 1], remote, [1, 0], b"by-bytes")
    wait_xfer(pair.a, h, state=pair.a.transfer(h))
    assert np.array_equal(pair.dst[:CHUNK], pair.src[CHUNK : 2 * CHUNK])
    assert np.array_equal(pair.dst[CHUNK : 2 * CHUNK], pair.src[:CHUNK])
