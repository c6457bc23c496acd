"""The other process of the two-process tests (run with multiprocessing's spawn).

It is a target: it registers a buffer, offers its metadata (as a blob over the pipe and
through its listener), waits for the initiator's notification and reports what its
buffer held at that moment, then lets the initiator READ a pattern back.
"""

from __future__ import annotations

import time


def serve(impl: str, port: int, size: int, conn) -> None:
    import os

    os.environ["NIXL_PY_IMPL"] = impl
    import numpy as np

    from conftest import load_api

    api = load_api()
    agent = api.nixl_agent(
        "target",
        api.nixl_agent_config(enable_listen_thread=True, listen_port=port),
    )
    buf = np.zeros(size, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    conn.send(
        {"metadata": agent.get_agent_metadata(), "addr": int(buf.ctypes.data), "pid": os.getpid()}
    )
    while True:
        cmd = conn.recv()
        if cmd[0] == "await":
            # Wait for the notification, then report the buffer's state at that moment:
            # the notification must come after the data.
            tag = cmd[1]
            deadline = time.monotonic() + 20
            while not agent.check_remote_xfer_done("initiator", tag):
                if time.monotonic() > deadline:
                    conn.send(("timeout", None))
                    break
                time.sleep(0.0005)
            else:
                conn.send(("ok", bytes(buf[:64]), int(buf.sum(dtype=np.uint64))))
        elif cmd[0] == "fill":
            buf[:] = np.arange(size, dtype=np.uint64).astype(np.uint8) ^ cmd[1]
            conn.send(("ok",))
        elif cmd[0] == "notifs":
            conn.send(("ok", agent.get_new_notifs()))
        elif cmd[0] == "bye":
            conn.send(("ok",))
            return
