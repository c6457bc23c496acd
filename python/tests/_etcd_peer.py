"""The other process of the etcd tests (run with multiprocessing's spawn).

It is a target that exchanges metadata only through etcd: it publishes its metadata
(``send_local_metadata()`` without an address), waits for the initiator's notification,
and on command invalidates or republishes its metadata.
"""

from __future__ import annotations

import time


def serve(impl: str, endpoint: str, namespace: str, name: str, size: int, conn) -> None:
    import os

    # Read when the agent is made, as NIXL reads it.
    os.environ["NIXL_PY_IMPL"] = impl
    os.environ["NIXL_ETCD_ENDPOINTS"] = endpoint
    os.environ["NIXL_ETCD_NAMESPACE"] = namespace
    import numpy as np

    from conftest import load_api

    api = load_api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_listen_thread=False))
    buf = (np.arange(size, dtype=np.uint64) * 7 + 3).astype(np.uint8)
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    agent.send_local_metadata()
    conn.send({"addr": int(buf.ctypes.data), "pid": os.getpid()})
    while True:
        cmd = conn.recv()
        if cmd[0] == "await":
            deadline = time.monotonic() + 20
            while not agent.check_remote_xfer_done(cmd[1], cmd[2]):
                if time.monotonic() > deadline:
                    conn.send(("timeout",))
                    break
                time.sleep(0.0005)
            else:
                conn.send(("ok",))
        elif cmd[0] == "invalidate":
            agent.invalidate_local_metadata()
            conn.send(("ok",))
        elif cmd[0] == "publish":
            agent.send_local_metadata()
            conn.send(("ok",))
        elif cmd[0] == "bye":
            conn.send(("ok",))
            return
