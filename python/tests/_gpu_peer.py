"""The other process of the two-process GPU tests (multiprocessing spawn): a target
whose buffer is a torch CUDA tensor."""

from __future__ import annotations

import time


def serve(impl: str, backends: list, size: int, conn) -> None:
    import os

    os.environ["NIXL_PY_IMPL"] = impl
    import torch

    from conftest import load_api

    api = load_api()
    agent = api.nixl_agent("gpu-target", api.nixl_agent_config(backends=backends))
    buf = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    agent.register_memory(buf)
    conn.send({"metadata": agent.get_agent_metadata(), "addr": int(buf.data_ptr())})
    while True:
        cmd = conn.recv()
        if cmd[0] == "await":
            deadline = time.monotonic() + 30
            while not agent.check_remote_xfer_done("gpu-initiator", cmd[1]):
                if time.monotonic() > deadline:
                    conn.send(("timeout", None))
                    break
                time.sleep(0.0005)
            else:
                # What the tensor holds when the notification is seen.
                conn.send(("ok", buf.cpu().numpy().tobytes()))
        elif cmd[0] == "fill":
            buf.copy_(torch.arange(size, dtype=torch.int64, device="cuda:0").remainder(251).to(torch.uint8))
            torch.cuda.synchronize()
            conn.send(("ok",))
        elif cmd[0] == "bye":
            conn.send(("ok",))
            return
