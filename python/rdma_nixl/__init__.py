"""rdma_nixl: NIXL's Python API over a Rust transfer agent.

Code written for NIXL changes one import::

    from rdma_nixl._api import nixl_agent, nixl_agent_config   # was: from nixl._api import ...

``rdma_nixl.device`` has the GPU device API's helpers: the headers kernels include,
NVRTC options, the handles' kernel arguments, signal words.
"""

from . import device
from ._api import (
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_gpu_xfer_req_handle,
    nixl_mem_view_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from ._core import __version__

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_gpu_xfer_req_handle",
    "nixl_mem_view_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "device",
    "logging",
    "_utils",
    "__version__",
]
