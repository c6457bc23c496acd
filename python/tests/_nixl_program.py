"""A program written for NVIDIA's NIXL, as its users write them: it imports ``nixl``.

Run twice, a target and an initiator, in two processes:

    python _nixl_program.py --mode target --port 5555
    python _nixl_program.py --mode initiator --port 5555 [--iters 200]

The target registers blocks holding a pattern and listens for metadata; the initiator
fetches the target's metadata and sends its own over the target's listener, the
target sends its block descriptors in a notification, and the initiator READs the
blocks by descriptor ids from lists prepared once (in reverse order, so the ids
matter), checks every byte, then repeats the READ ``--iters`` times and reports READs
per second on one line as ``RESULT {json}``. Its last READ carries a notification
that tells the target to finish. Nothing here names ``rdma_nixl``: the tests run it
through the ``nixl`` name (the ``rdma-nixl-as-nixl`` package, or
``python -m rdma_nixl.as_nixl``), and ``tools/peer/nixl-python-tests.sh`` on NIXL's
wheel too.
"""

import argparse
import json
import sys
import time

import numpy as np

import nixl._bindings as nixl_bindings
from nixl._api import nixl_agent, nixl_agent_config
from nixl.logging import get_logger

logger = get_logger(__name__)

BLOCKS = 16
BLOCK = 64 << 10


def pattern() -> np.ndarray:
    return (np.arange(BLOCKS * BLOCK, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def wait(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            logger.error("timed out waiting for %s", what)
            sys.exit(3)
        time.sleep(0.0005)


def target(args) -> None:
    agent = nixl_agent("target", nixl_agent_config(True, True, args.port))
    buf = pattern()
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    blocks = agent.get_xfer_descs(
        [(buf.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)], "DRAM"
    )
    assert isinstance(blocks, nixl_bindings.nixlXferDList)
    print("READY", flush=True)
    wait(lambda: agent.check_remote_metadata("initiator"), "the initiator's metadata")
    agent.send_notif("initiator", agent.get_serialized_descs(blocks))
    wait(lambda: agent.check_remote_xfer_done("initiator", b"finished"), "the last READ")
    agent.deregister_memory(reg)
    logger.info("target done")


def initiator(args) -> None:
    agent = nixl_agent("initiator", nixl_agent_config(True, True, 0))
    agent.fetch_remote_metadata("target", args.ip, args.port)
    agent.send_local_metadata(args.ip, args.port)
    notifs = wait(lambda: agent.get_new_notifs().get("target"), "the target's descriptors")
    remote_blocks = agent.deserialize_descs(notifs[0])
    assert remote_blocks.descCount() == BLOCKS
    wait(lambda: agent.check_remote_metadata("target", remote_blocks), "the target's metadata")

    buf = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT",
        [(buf.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)],
        "DRAM",
    )
    remote = agent.prep_xfer_dlist("target", remote_blocks, "DRAM")
    ids = list(range(BLOCKS))
    reverse = ids[::-1]
    handle = agent.make_prepped_xfer("READ", local, ids, remote, reverse, b"block")

    def read_once(notif: bytes = b"") -> None:
        state = agent.transfer(handle, notif)
        while state != "DONE":
            state = agent.check_xfer_state(handle)
            if state == "ERR":
                logger.error("transfer failed")
                sys.exit(4)

    read_once()
    want = pattern().reshape(BLOCKS, BLOCK)[::-1].reshape(-1)
    if not np.array_equal(buf, want):
        logger.error("data mismatch after the READ")
        sys.exit(5)
    start = time.perf_counter()
    for _ in range(args.iters):
        read_once()
    elapsed = time.perf_counter() - start
    read_once(b"finished")
    result = {
        "reads": args.iters,
        "reads_per_s": args.iters / elapsed if elapsed > 0 else 0.0,
        "gb_per_s": args.iters * BLOCKS * BLOCK / elapsed / 1e9 if elapsed > 0 else 0.0,
        "verified": True,
    }
    print("RESULT " + json.dumps(result), flush=True)
    agent.release_xfer_handle(handle)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(remote)
    agent.deregister_memory(reg)
    agent.remove_remote_agent("target")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["target", "initiator"], required=True)
    parser.add_argument("--ip", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    target(args) if args.mode == "target" else initiator(args)
