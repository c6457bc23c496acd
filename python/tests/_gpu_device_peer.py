"""The other process of the device API's two-process tests (multiprocessing spawn): a
target whose data buffer and signal/counter words are CuPy arrays on GPU ``gpu``, in an
agent made with ``backends`` (test_gpu_device.py: GPUNETIO; test_gpu_ucx_device.py:
NIXL's default, UCX)."""

from __future__ import annotations

import time


def serve(size: int, conn, backends=("GPUNETIO",), gpu: int = 0, name: str = "gn-peer") -> None:
    import os

    os.environ["NIXL_PY_IMPL"] = "ours"
    try:
        import cupy as cp

        from conftest import load_api

        cp.cuda.Device(gpu).use()
        api = load_api()
        agent = api.nixl_agent(name, api.nixl_agent_config(backends=list(backends)))
        data = cp.zeros(size, dtype=cp.uint8)
        words = cp.zeros(4, dtype=cp.uint64)  # [signal, counter, spare, spare]
        cp.cuda.runtime.deviceSynchronize()
        agent.register_memory(
            [(data.data.ptr, data.nbytes, gpu, ""), (words.data.ptr, words.nbytes, gpu, "")],
            "VRAM",
        )
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    conn.send(
        {
            "metadata": agent.get_agent_metadata(),
            "data": int(data.data.ptr),
            "words": int(words.data.ptr),
            "gpu": gpu,
            "backends": sorted(agent.backends),
        }
    )
    while True:
        cmd = conn.recv()
        if cmd[0] == "check":
            # Wait for the signal the initiator's kernel adds after its writes, then
            # report the data as it is at that moment.
            want = cmd[2]
            deadline = time.monotonic() + 30
            while int(words[0].get()) < want and time.monotonic() < deadline:
                time.sleep(0.0005)
            seen = int(words[0].get())
            conn.send(("ok" if seen >= want else "timeout", data.get().tobytes(), seen))
        elif cmd[0] == "counter":
            deadline = time.monotonic() + 30
            while int(words[1].get()) == 0 and time.monotonic() < deadline:
                time.sleep(0.0005)
            conn.send(("ok", data.get().tobytes(), int(words[1].get())))
        elif cmd[0] == "bye":
            conn.send(("ok",))
            return
