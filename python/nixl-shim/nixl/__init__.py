"""``nixl``, answered by ``rdma_nixl`` (the opt-in ``rdma-nixl-as-nixl`` package).

Code written for NVIDIA's NIXL (``from nixl._api import nixl_agent``, ``import
nixl._bindings``, ``import nixl._utils``, ``from nixl.logging import get_logger``) runs
on ``rdma_nixl`` unchanged: each ``nixl.<module>`` *is* ``rdma_nixl.<module>`` (the
same module object, so patching ``nixl._bindings.nixlAgent`` patches what
``nixl._api`` uses, as with NIXL).

This package shadows NVIDIA's ``nixl``: both install a top-level ``nixl`` package, so
with both installed whichever was installed last wins file by file, and uninstalling
one breaks the other. Install it only where NVIDIA's is not (``pip uninstall nixl
nixl-cu12 nixl-cu13`` first), and check with ``python -c "import nixl;
print(nixl.__implementation__)"`` (``rdma_nixl`` here; NVIDIA's has no such attribute).
Without installing anything, ``python -m rdma_nixl.as_nixl program.py`` runs one program
with the same mapping.
"""

from rdma_nixl import __version__
from rdma_nixl._api import (
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

#: Which implementation answers ``import nixl``.
__implementation__ = "rdma_nixl"

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "__version__",
]
