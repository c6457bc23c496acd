"""NIXL's Python API (``nixl._api``) over the Rust agent.

``from rdma_nixl._api import nixl_agent, nixl_agent_config`` replaces
``from nixl._api import nixl_agent, nixl_agent_config``: the classes, methods, signatures,
defaults and return values are NIXL's (``add_remote_agent`` returns the name as bytes,
``transfer`` returns ``"DONE"``/``"PROC"``, descriptor inputs are tuple lists with a memory
type, N x 3 numpy arrays, torch tensors or lists of tensors). As in NIXL, ``nixl_agent``
is built on the low-level ``_bindings.nixlAgent`` (``self.agent``), created from a
``_bindings.nixlAgentConfig``; handles hold that agent's ints.

Where this differs from NIXL:

- Backends are ours: ``LIBFABRIC``, ``VERBS``, ``LOCAL``, ``POSIX`` (files, as NIXL's),
  ``CUDA_IPC`` and ``GPUNETIO`` (GPU builds) and ``FAULT`` (failure injection for tests). ``UCX``, NIXL's default,
  creates ``LIBFABRIC`` with a logged note, so default-configured code runs; the backend
  is then known as ``UCX`` (``self.backends["UCX"]``), and ``LIBFABRIC`` names it too.
  Where a GPU is present, ``nixl_agent`` adds ``CUDA_IPC`` beside it (as NIXL's UCX
  carries CUDA IPC inside): VRAM to VRAM on this node then goes through CUDA IPC, all
  else through ``LIBFABRIC``, without naming backends.
- Metadata exchange by IP (``send_local_metadata``, ``fetch_remote_metadata``, ...) is
  synchronous: it has happened (or raised) when the call returns, so
  ``check_remote_metadata`` is true at once. Without ``ip_addr`` the calls go to etcd
  when ``NIXL_ETCD_ENDPOINTS`` was set at agent creation (NIXL's keys,
  ``NIXL_ETCD_NAMESPACE``): publishing and invalidating are synchronous too, and a
  fetch loads a published key before it returns (one not published yet is waited for
  in the background, as NIXL's fetch is); an unreachable etcd raises
  ``nixlBackendError`` within ``etcdWatchTimeout`` (5 s).
- Errors raise NIXL's exception classes (``rdma_nixl._bindings.nixlNotFoundError``, ...),
  all subclasses of ``nixlError``, with the typed Rust error as attributes (``kind``,
  ``agent``, ``backend``, ``code``); a lost peer is ``nixlRemoteDisconnectError``.
- ``sync_mode`` is recorded (``self.agent.syncMode``) but every level behaves as the
  safest: the agent is thread-safe (``rdma_nixl._agent`` explains the mapping).
- The GPU device API (``prep_mem_view``, ``create_gpu_xfer_req``) is the ``GPUNETIO``
  backend's, not UCX's; an agent made with ``UCX`` adds one at its first VRAM
  registration (intra-node, VRAM of that GPU; ``HAVE_UCX_GPU_DEVICE_API`` says whether
  this build and machine have it; see ``nixl_agent._ucx_device_backend``). Its handles
  are ints, as NIXL's (``rdma_nixl.device``), holding the 40-byte kernel argument as a
  struct (``kernel_arg``); the release methods also take the plain int. Other backends
  raise ``nixlNotSupportedError``.
"""

from __future__ import annotations

import logging
import pickle
import sys
import weakref
from enum import Enum
from typing import TYPE_CHECKING, Dict, List, Optional, Union

from . import _bindings as nixlBind
from . import _core
from . import device as _device
from ._agent import BACKEND_ALIASES
from ._bindings import (
    DEFAULT_COMM_PORT,
    _BadArgument,
    _BadDescriptors,
    nixlInvalidParamError,
    nixlRegDList,
    nixlRemoteDList,
    nixlXferDList,
    nixlXferTelemetry,
)
from .device import nixl_gpu_handle, nixl_gpu_xfer_req_handle, nixl_mem_view_handle

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

logger = logging.getLogger("rdma_nixl.api")

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
]


def _is_torch_tensor(obj: object) -> bool:
    # A tensor can exist only if torch was imported already: never import it here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_ndarray(obj: object) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


def _msg_bytes(msg: Union[bytes, str, bytearray, memoryview]) -> bytes:
    if isinstance(msg, bytes):
        return msg
    if isinstance(msg, str):
        return msg.encode()
    return bytes(msg)


# Opaque handle for backend can be just int, as it's not passed to the user (NIXL).
nixl_backend_handle = int


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (from ``prep_xfer_dlist``): the low-level agent's int
    ``_handle``. ``release()`` frees it; garbage collection does too."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent, value: int):
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self):
        if not self._released:
            self._agent.releasedDlistH(self._handle)
            self._released = True

    def __del__(self):
        if not self._released:
            try:
                self.release()
            except Exception:  # pragma: no cover - finalizers must not raise
                pass


class nixl_xfer_handle:
    """A transfer request (from ``make_prepped_xfer`` or ``initialize_xfer``): the
    low-level agent's int ``_handle``. ``release()`` frees it (canceling it if in
    flight); garbage collection does too."""

    __slots__ = ("_handle", "_agent", "_released", "_req", "_gpu_rebuild", "_gpu_sibling")

    def __init__(self, agent, value: int, gpu_rebuild=None):
        self._handle = int(value)
        self._agent = agent
        self._released = False
        # UCX's device API (nixl_agent.create_gpu_xfer_req): how to make the same
        # request on the device backend, and that request once made.
        self._gpu_rebuild = gpu_rebuild
        self._gpu_sibling: Optional["nixl_xfer_handle"] = None
        # The request behind the int: transfer() and check_xfer_state() reach it without
        # a lookup (they do what postXferReq / getXferStatus do).
        self._req = agent._request(self._handle)

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    def release(self):
        if not self._released:
            self._agent.releaseXferReq(self._handle)
            self._released = True
            self._gpu_rebuild = None
            if self._gpu_sibling is not None:
                self._gpu_sibling.release()

    def __del__(self):
        if not self._released:
            try:
                self.release()
            except Exception:  # pragma: no cover - finalizers must not raise
                pass


class nixl_thread_sync_t(Enum):
    """Thread synchronization modes (NIXL's: members whose values are the bindings'
    ``nixl_thread_sync_t``)."""

    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:
    """Configuration of an agent (NIXL's signature and defaults).

    Args:
        enable_prog_thread: backends progress transfers on their own threads.
        enable_listen_thread: start the metadata listener (peers push/fetch metadata).
        listen_port: the listener's port (0: any free port).
        capture_telemetry: keep per-transfer telemetry (``get_xfer_telemetry``);
            ``NIXL_TELEMETRY_ENABLE`` overrides it either way.
        num_threads: accepted for compatibility (our backends size their own threads).
        backends: backends to create; ``UCX`` means ``LIBFABRIC`` (and ``CUDA_IPC``
            beside it where a GPU is present).
        sync_mode: a ``nixl_thread_sync_t``; None picks NIXL's default (STRICT with a
            listener, else NONE). Recorded; the agent is thread-safe at every level.
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: List[str] = ["UCX"],  # noqa: B006 - NIXL's default, never mutated
        sync_mode: Optional[nixl_thread_sync_t] = None,
    ):
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})"
            )
        self.sync_mode = sync_mode


class nixl_agent:
    """A transfer agent: backends, registrations, metadata, transfers, notifications.

    Args:
        agent_name: the agent's name (peers address it by this name; ``ValueError`` if
            empty).
        nixl_conf: configuration; defaults to ``nixl_agent_config()``.
        instantiate_all: create every available backend (ignored when a config is given).
    """

    def __init__(
        self,
        agent_name: str,
        nixl_conf: Optional[nixl_agent_config] = None,
        instantiate_all: bool = False,
    ):
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning(
                "Ignoring instantiate_all based on the provided config in agent creation."
            )
        if not nixl_conf:
            nixl_conf = nixl_agent_config()

        default_sync_mode = (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            if nixl_conf.enable_listen
            else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        agent_config = nixlBind.nixlAgentConfig()
        agent_config.useProgThread = nixl_conf.enable_pthread
        agent_config.useListenThread = nixl_conf.enable_listen
        agent_config.listenPort = nixl_conf.port
        agent_config.syncMode = (nixl_conf.sync_mode or default_sync_mode).value
        agent_config.pthrDelay = 0
        agent_config.lthrDelay = 100000
        agent_config.captureTelemetry = nixl_conf.capture_telemetry
        # Looked up on the module at each call, as NIXL does (tests replace it).
        self.agent = nixlBind.nixlAgent(agent_name, agent_config)

        self.name = agent_name
        self.notifs: Dict[str, List[bytes]] = {}
        self.backends: Dict[str, nixl_backend_handle] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        self.plugin_list: List[str] = self.agent.getAvailPlugins()
        self.plugin_b_options: Dict[str, Dict[str, str]] = {}
        self.plugin_mem_types: Dict[str, List[str]] = {}
        # Live device handles by their int (release_mem_view / release_gpu_xfer_req
        # take the int, as NIXL's do): the extension's handle objects, held weakly (the
        # Python handles are ints, which cannot be weakly referenced).
        self._gpu_handles: "weakref.WeakValueDictionary[int, object]" = (
            weakref.WeakValueDictionary()
        )

        wanted = list(nixl_conf.backends)
        if instantiate_all:
            wanted = [p for p in self.plugin_list if p != "FAULT"]
        for bknd in wanted:
            name = BACKEND_ALIASES.get(bknd, bknd)
            if name not in self.plugin_list:
                logger.warning(
                    "Skipping backend registration %s due to the missing plugin.", bknd
                )
                continue
            if self._backend_key(bknd) is not None:
                continue  # e.g. ["UCX", "LIBFABRIC"]: one backend
            if instantiate_all:
                # Best effort, as NIXL: a backend without its hardware is skipped.
                try:
                    self.create_backend(bknd)
                except nixlBind.nixlError as e:
                    logger.info("Backend %s not instantiated: %s", name, e)
            else:
                self.create_backend(bknd)
        # UCX's device API (prep_mem_view, create_gpu_xfer_req on VRAM): a GPUNETIO
        # backend this agent adds at its first VRAM registration (_ucx_device_backend).
        self._ucx_device_wanted = False
        self._ucx_device_key: Optional[str] = None  # its key in self.backends
        self._ucx_device_gpu: Optional[int] = None  # the GPU it is bound to
        self._ucx_device_why: Optional[str] = None  # why it could not be added
        if "UCX" in wanted and not instantiate_all:
            self._add_cuda_ipc_for_ucx()
            self._ucx_device_wanted = (
                "GPUNETIO" in self.plugin_list and self._backend_key("GPUNETIO") is None
            )

        self.nixl_mems = {
            "DRAM": nixlBind.DRAM_SEG,
            "VRAM": nixlBind.VRAM_SEG,
            "FILE": nixlBind.FILE_SEG,
            "BLOCK": nixlBind.BLK_SEG,
            "OBJ": nixlBind.OBJ_SEG,
            "cpu": nixlBind.DRAM_SEG,  # deprecated alias, as in NIXL
            "cuda": nixlBind.VRAM_SEG,  # deprecated alias, as in NIXL
        }
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
        logger.info("Initialized agent: %s", agent_name)

    # --- backends ------------------------------------------------------------------

    def _add_cuda_ipc_for_ucx(self):
        """NIXL's ``UCX`` moves VRAM between processes of one node through CUDA IPC
        itself; here that path is the ``CUDA_IPC`` backend, created beside ``LIBFABRIC``
        where a GPU is present, so that an agent made with the default configuration
        moves VRAM to VRAM on this node through it (the agent prefers it for that pair;
        DRAM and other nodes stay with ``LIBFABRIC``) without naming backends. Best
        effort, as NIXL's own transports: without a GPU there is nothing to add."""
        if "CUDA_IPC" not in self.plugin_list or self._backend_key("CUDA_IPC") is not None:
            return
        # No GPU: nothing to try (a failed creation would count as an error event).
        if _core.gpu_count() == 0:
            return
        try:
            handle = self.agent._create_backend("CUDA_IPC", {}, count_errors=False)
        except nixlBind.nixlError as e:
            # The message only: a log record holding the exception would hold its
            # traceback, and through it this agent, past its last reference.
            reason = str(e)
        else:
            self._record_backend("CUDA_IPC", handle)
            return
        logger.info("UCX: no CUDA_IPC beside LIBFABRIC (%s)", reason)

    def _ucx_device_backend(self, reg_descs: nixlRegDList) -> Optional[int]:
        """The handle of the backend that serves NIXL's device API behind ``UCX`` for
        this registration, or None where it takes no part in it.

        NIXL's UCX carries the GPU device API (kernels post transfers; memory views)
        for VRAM; ours is the ``GPUNETIO`` backend's. An agent made with ``UCX`` adds one
        at its first VRAM registration, bound to that registration's GPU
        (``gpu_devices``) and limited to peers on this node (``nic_handler=intra_node``:
        CUDA IPC, as UCX's ``cuda_ipc`` lane; no proxy thread, no NIC registration).
        Created last, it is never the agent's choice for transfers the others carry.
        It registers the VRAM of its GPU only (lists all on that GPU); DRAM and other
        GPUs' VRAM are left to the other backends, so its GPU binding never refuses a
        registration. Best effort: without a GPU, NVRTC or this build's GPUNETIO
        (``_bindings.HAVE_UCX_GPU_DEVICE_API`` false) it is not added, the reason is
        logged once, and the device API raises ``nixlNotSupportedError`` saying so."""
        if not self._ucx_device_wanted or reg_descs.getType() != nixlBind.VRAM_SEG:
            return None
        gpus = set(reg_descs._words[2::3])
        if self._ucx_device_key is None:
            if self._ucx_device_why is not None or len(gpus) != 1:
                return None
            if self._backend_key("GPUNETIO") is not None:
                # The user created one since: theirs serves the device API.
                self._ucx_device_wanted = False
                return None
            gpu = next(iter(gpus))
            why = nixlBind._ucx_device_api_unavailable()
            if why is None:
                try:
                    handle = self.agent._create_backend(
                        "GPUNETIO",
                        {"gpu_devices": str(gpu), "nic_handler": "intra_node"},
                        count_errors=False,
                    )
                except nixlBind.nixlError as e:
                    # The message only (a record holding the exception would hold its
                    # traceback, and through it this agent).
                    why = f"creating GPUNETIO on GPU {gpu} failed: {e}"
                else:
                    self._record_backend("GPUNETIO", handle)
                    self._ucx_device_key = "GPUNETIO"
                    self._ucx_device_gpu = gpu
            if why is not None:
                self._ucx_device_why = why
                logger.info("UCX: no device API (GPUNETIO) beside LIBFABRIC: %s", why)
                return None
        if gpus != {self._ucx_device_gpu}:
            return None
        return self.backends[self._ucx_device_key]

    def _registration_handles(self, reg_descs: nixlRegDList, backends: List[str]) -> List[int]:
        """Backend handles ``register_memory`` passes down: those named (none: every
        backend), with UCX's device backend added where it takes the memory and
        left out where it does not (see ``_ucx_device_backend``)."""
        handles = self._handles(backends)
        if not self._ucx_device_wanted or (backends and "UCX" not in backends):
            return handles
        device = self._ucx_device_backend(reg_descs)
        if self._ucx_device_key is None:
            return handles
        if backends:
            return handles + [device] if device is not None else handles
        if device is not None:
            return handles  # every backend, the device one included
        companion = self.backends[self._ucx_device_key]
        return [h for h in self.backends.values() if h != companion]

    def _ucx_device_handles(self, backends: List[str]) -> List[int]:
        """Handles for the device API's calls: naming ``UCX`` names its device backend."""
        handles = self._handles(backends)
        if "UCX" in backends and self._ucx_device_key is not None:
            handles.append(self.backends[self._ucx_device_key])
        return handles

    def _explain_device_api(self, e: Exception) -> Exception:
        """``e`` (a ``nixlNotSupportedError`` of the device API), with why an agent made
        with ``UCX`` has no device backend, where that is the cause."""
        if not self._ucx_device_wanted or self._ucx_device_key is not None:
            return e
        why = self._ucx_device_why or (
            "it is added at the agent's first VRAM registration, and none was made yet"
        )
        return nixlBind.nixlNotSupportedError(
            f"{e} (the device API behind UCX is a GPUNETIO backend: {why})"
        )

    def _backend_key(self, name: str) -> Optional[str]:
        """The key in ``self.backends`` of a backend named by the user: its own name, or
        the other name of an aliased one (``UCX`` <-> ``LIBFABRIC``); None if absent."""
        if name in self.backends:
            return name
        target = BACKEND_ALIASES.get(name, name)
        for key in self.backends:
            if BACKEND_ALIASES.get(key, key) == target:
                return key
        return None

    def _handles(self, backends: List[str]) -> List[int]:
        """Backend handles of names (``KeyError`` for one not created, as NIXL)."""
        out = []
        for name in backends:
            key = self._backend_key(name)
            if key is None:
                raise KeyError(name)
            out.append(self.backends[key])
        return out

    def _load_plugin_params(self, plugin: str):
        if BACKEND_ALIASES.get(plugin, plugin) not in self.plugin_list:
            return
        try:
            options, mems = self.agent.getPluginParams(plugin)
        except nixlBind.nixlError:
            logger.warning("Failed to load params for plugin %s", plugin, exc_info=True)
            return
        self.plugin_b_options[plugin] = options
        self.plugin_mem_types[plugin] = mems

    def get_plugin_list(self) -> List[str]:
        """Names of the backends this build can create."""
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> List[str]:
        """Memory types a backend can register (before creating it)."""
        if backend not in self.plugin_mem_types:
            self._load_plugin_params(backend)
        if backend not in self.plugin_mem_types:
            logger.warning(
                "Plugin %s is not available to get its supported mem types.", backend
            )
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend: str) -> Dict[str, str]:
        """Parameters a backend takes, with their defaults (option name -> default)."""
        if backend not in self.plugin_b_options:
            self._load_plugin_params(backend)
        if backend not in self.plugin_b_options:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend: str) -> List[str]:
        """Memory types a created backend registers."""
        key = self._backend_key(backend)
        if key is not None:
            return self.backend_mems[key]
        logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend: str) -> Dict[str, str]:
        """Parameters a created backend was made with (defaults filled in)."""
        key = self._backend_key(backend)
        if key is not None:
            return self.backend_options[key]
        logger.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend: str, initParams: Dict[str, str] = {}):  # noqa: B006
        """Creates a backend with string parameters (see ``get_plugin_params``); it is
        known by the name given (``UCX`` creates ``LIBFABRIC``, known as ``UCX``)."""
        self._record_backend(backend, self.agent.createBackend(backend, initParams))

    def _record_backend(self, backend: str, handle: int) -> None:
        self.backends[backend] = handle
        options, mems = self.agent.getBackendParams(handle)
        self.backend_mems[backend] = mems
        self.backend_options[backend] = options
        logger.info("Backend %s was instantiated", backend)

    # --- memory --------------------------------------------------------------------

    def register_memory(
        self,
        reg_list,
        mem_type: Optional[str] = None,
        backends: List[str] = [],  # noqa: B006
    ) -> nixlRegDList:
        """Registers memory with every backend that handles its type (or those named).
        Returns the registration list, to pass to ``deregister_memory``."""
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        if reg_descs is None:
            raise _BadDescriptors("register_memory: descriptors in a form it does not take")
        self.agent.registerMem(reg_descs, self._registration_handles(reg_descs, backends))
        return reg_descs

    def deregister_memory(self, dereg_list: nixlRegDList, backends: List[str] = []):  # noqa: B006
        """Deregisters what ``register_memory`` registered (each descriptor as it was
        registered). ``backends`` must name created backends; a registration is released
        from every backend that holds it."""
        if not isinstance(dereg_list, nixlRegDList):
            raise _BadDescriptors("deregister_memory takes the list register_memory returned")
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(
        self, reg_list, backend: str, mem_type: Optional[str] = None
    ) -> List[Optional[Dict[str, str]]]:
        """Per descriptor, as NIXL's: for ``POSIX`` (descriptors' metaInfo is a file
        path) ``None`` where the file does not exist, else ``{"size", "mode", "mtime"}``;
        for other backends ``None`` if ``backend`` has not registered it, else a dict
        ``{"backend": name, "mode": how it reaches the memory ("staged"/"direct"/"")}``."""
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        if reg_descs is None:
            raise _BadDescriptors("query_memory: descriptors in a form it does not take")
        key = self._backend_key(backend)
        if key is None:
            raise ValueError(
                f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}"
            )
        return self.agent.queryMem(reg_descs, self.backends[key])

    def make_connection(self, remote_agent: str, backends: List[str] = []):  # noqa: B006
        """Connections are made when the peer's metadata is loaded: this checks it is."""
        self.agent.makeConnection(remote_agent, self._handles(backends))

    # --- transfers -----------------------------------------------------------------

    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list,
        mem_type: Optional[str] = None,
        backends: List[str] = [],  # noqa: B006
    ) -> nixl_prepped_dlist_handle:
        """Validates a descriptor list once, for many transfers by index.
        ``agent_name`` is ``"NIXL_INIT_AGENT"`` (or ``""``) for local memory, a peer's
        name for its memory, or this agent's own name for loopback. An N x 5 numpy array
        is a strided list: rows ``(addr, len, dev_id, stride, count)``, ``count`` blocks
        each (needs ``mem_type``)."""
        is_strided = _is_ndarray(xfer_list) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5
        if agent_name in ("NIXL_INIT_AGENT", ""):
            agent_name = nixlBind.NIXL_INIT_AGENT
        handles = self._handles(backends)
        if is_strided:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            handle = self.agent.prepXferDlist(
                agent_name, self.nixl_mems[mem_type], xfer_list, handles
            )
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
            if descs is None:
                raise _BadDescriptors("prep_xfer_dlist: descriptors in a form it does not take")
            handle = self.agent.prepXferDlist(agent_name, descs, handles)
        return nixl_prepped_dlist_handle(self.agent, handle)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle):
        """Not provided by our backends (``nixlNotSupportedError``)."""
        return self.agent.estimateXferCost(getattr(req_handle, "_handle", 0))

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices,
        notif_msg: bytes = b"",
        backends: List[str] = [],  # noqa: B006
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """A transfer from prepared lists by index: ``local_indices[i]`` moves to/from
        ``remote_indices[i]``. ``operation`` is ``"WRITE"`` or ``"READ"``."""
        op = self.nixl_ops[operation]
        handle = self.agent.makeXferReq(
            op,
            local_xfer_side._handle,
            local_indices,
            remote_xfer_side._handle,
            remote_indices,
            notif_msg,
            self._handles(backends),
            skip_desc_merge,
        )
        device = self._ucx_device_for_requests(backends)
        agent, lh, li, rh, ri = (
            self.agent, local_xfer_side, local_indices, remote_xfer_side, remote_indices
        )
        # The prepared lists' objects are held (not their ints): they stay alive for it.
        rebuild = (
            (lambda: agent.makeXferReq(
                op, lh._handle, li, rh._handle, ri, notif_msg, [device], skip_desc_merge
            ))
            if device is not None
            else None
        )
        return nixl_xfer_handle(self.agent, handle, rebuild)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: List[str] = [],  # noqa: B006
    ) -> nixl_xfer_handle:
        """Prepares both lists and makes a transfer (descriptor i to descriptor i)."""
        op = self.nixl_ops[operation]
        local = self.get_xfer_descs(local_descs)
        remote = self.get_xfer_descs(remote_descs)
        if local is None or remote is None:
            raise _BadDescriptors("initialize_xfer takes lists from get_xfer_descs")
        handle = self.agent.createXferReq(
            op, local, remote, remote_agent, notif_msg, self._handles(backends)
        )
        device = self._ucx_device_for_requests(backends)
        agent = self.agent
        rebuild = (
            (lambda: agent.createXferReq(op, local, remote, remote_agent, notif_msg, [device]))
            if device is not None
            else None
        )
        return nixl_xfer_handle(self.agent, handle, rebuild)

    def _ucx_device_for_requests(self, backends: List[str]) -> Optional[int]:
        """UCX's device backend, for a request made with ``backends`` (none, or ``UCX``
        among them) that ``create_gpu_xfer_req`` may be asked about; else None."""
        if self._ucx_device_key is None or (backends and "UCX" not in backends):
            return None
        return self.backends[self._ucx_device_key]

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Posts a transfer: ``"DONE"`` if it completed within the call, else ``"PROC"``.
        A non-empty ``notif_msg`` replaces the request's notification from now on."""
        return handle._req.post(_msg_bytes(notif_msg) if notif_msg else None)

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """``"DONE"`` or ``"PROC"``; a failed transfer raises (e.g.
        ``nixlRemoteDisconnectError``) and is spent."""
        return handle._req.status()

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """Telemetry of the last post (needs telemetry on: ``capture_telemetry=True`` or
        ``NIXL_TELEMETRY_ENABLE=y``)."""
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The backend chosen for a transfer (by the name it was created as)."""
        b_handle = self.agent.queryXferBackend(handle._handle)
        return next(name for name, h in self.backends.items() if h == b_handle)

    def release_xfer_handle(self, handle: nixl_xfer_handle):
        """Releases a transfer (one in flight is canceled)."""
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle):
        """Releases a prepared descriptor list."""
        handle.release()

    # --- the GPU device API ----------------------------------------------------------

    def _device_handle(self, cls, core) -> nixl_gpu_handle:
        h = cls(core)
        self._gpu_handles[int(h)] = core
        return h

    def _live_handle(self, handle, cls, what: str):
        """The extension's handle behind ``handle`` (a handle object of class ``cls``, or
        the int of a live one of this agent)."""
        if isinstance(handle, cls):
            return handle.core
        if isinstance(handle, nixl_gpu_handle):
            raise _BadArgument(f"{what} takes a {cls.__name__}, not {type(handle).__name__}")
        if isinstance(handle, int) and not isinstance(handle, bool):
            found = self._gpu_handles.get(handle)
            if found is not None and found.kind == cls.KIND:
                return found
            raise nixlInvalidParamError(
                f"{what}: {handle:#x} is not a live {cls.__name__} of this agent"
            )
        raise _BadArgument(f"{what} takes a {cls.__name__} or its int, not {type(handle).__name__}")

    def prep_mem_view(
        self,
        dlist: Union[nixlXferDList, nixlRemoteDList],
        *,
        backends: Optional[List[str]] = None,
    ) -> nixl_mem_view_handle:
        """A memory view of a list for kernels (NIXL's ``prepMemView``): a
        ``nixlXferDList`` of local memory (sources of ``nixlPut``) or a
        ``nixlRemoteDList`` from ``get_remote_descs`` (one peer's registered memory, or
        this agent's own: targets of ``nixlPut`` / ``nixlAtomicAdd``, ``nixlGetPtr``
        where mapped). Element ``i`` is descriptor ``i``. Needs a ``GPUNETIO`` backend
        (an agent made with ``UCX`` adds one at its first VRAM registration); others
        raise ``nixlNotSupportedError``. Returns an int, as NIXL's, that carries the
        kernel argument: pass ``handle.kernel_arg`` (or ``handle.raw``) to kernels; it
        is released by ``release_mem_view`` or when collected."""
        handles = self._ucx_device_handles(list(backends or []))
        try:
            core = self.agent._try_backends(
                lambda b: self.agent._mem_view_core(dlist, b), handles
            )
        except nixlBind.nixlNotSupportedError as e:
            raise self._explain_device_api(e) from None
        return self._device_handle(nixl_mem_view_handle, core)

    def release_mem_view(self, mvh: Union[nixl_mem_view_handle, int]) -> None:
        """Releases a memory view (the handle, or its int). Only after the kernels using
        it finished; kernels given it later get ``NIXL_ERR_INVALID_PARAM``."""
        core = self._live_handle(mvh, nixl_mem_view_handle, "release_mem_view")
        self._gpu_handles.pop(int(mvh), None)
        core.release()

    def create_gpu_xfer_req(self, req_hndl: nixl_xfer_handle) -> nixl_gpu_xfer_req_handle:
        """A handle for kernels to post a transfer request's descriptors themselves
        (NIXL's ``createGpuXferReq``): descriptor ``i`` of the request is ``desc_idx``
        ``i`` of ``nixlGpuPostSingleWriteXferReq`` / ``nixlGpuPostSignalXferReq``. The
        request's backend must be ``GPUNETIO`` (``nixlNotSupportedError`` otherwise); a
        request of an agent made with ``UCX`` that its other backends carry is made once
        more on its ``GPUNETIO`` backend for the handle (released with the request).
        Released by ``release_gpu_xfer_req`` or when collected; keep the request alive
        while kernels use it."""
        if not isinstance(req_hndl, nixl_xfer_handle):
            raise _BadArgument(
                f"create_gpu_xfer_req takes a nixl_xfer_handle, not {type(req_hndl).__name__}"
            )
        req = req_hndl._req.core
        if req.backend != "GPUNETIO" and req_hndl._gpu_rebuild is not None:
            # Made by UCX's other backends: the same request on its device backend.
            if req_hndl._gpu_sibling is None:
                req_hndl._gpu_sibling = nixl_xfer_handle(self.agent, req_hndl._gpu_rebuild())
            req = req_hndl._gpu_sibling._req.core
        try:
            core = req.create_gpu_xfer_req()
        except nixlBind.nixlNotSupportedError as e:
            raise self._explain_device_api(e) from None
        return self._device_handle(nixl_gpu_xfer_req_handle, core)

    def release_gpu_xfer_req(self, gpu_req_hndl: Union[nixl_gpu_xfer_req_handle, int]) -> None:
        """Releases a GPU request handle (NIXL's ``releaseGpuXferReq``), or its int."""
        core = self._live_handle(gpu_req_hndl, nixl_gpu_xfer_req_handle, "release_gpu_xfer_req")
        self._gpu_handles.pop(int(gpu_req_hndl), None)
        core.release()

    def get_gpu_signal_size(self, backends: List[str] = []) -> int:  # noqa: B006
        """Bytes of a signal word for ``nixlGpuPostSignalXferReq`` (NIXL's
        ``getGpuSignalSize``): 8."""
        self._handles(backends)
        return _device.GPU_SIGNAL_SIZE

    def prep_gpu_signal(
        self,
        signal_descs,
        mem_type: Optional[str] = None,
        backends: List[str] = [],  # noqa: B006
    ) -> None:
        """Prepares signal words (NIXL's ``prepGpuSignal``): zeroes the first
        ``get_gpu_signal_size()`` bytes of each descriptor, which must be VRAM, 8-byte
        aligned and at least that long (``nixlInvalidParamError`` otherwise). Takes
        what ``register_memory`` or ``get_xfer_descs`` take."""
        self._handles(backends)
        descs = _any_descs(self, signal_descs, mem_type)
        if descs is None:
            raise _BadDescriptors("prep_gpu_signal: descriptors in a form it does not take")
        if descs.getType() != nixlBind.VRAM_SEG:
            raise nixlInvalidParamError(
                f"prep_gpu_signal: signal words are VRAM, not {descs.getType().name}"
            )
        for i in range(descs.descCount()):
            addr, length, dev = descs._triple(i)
            if length < _device.GPU_SIGNAL_SIZE:
                raise nixlInvalidParamError(
                    f"prep_gpu_signal: descriptor {i} has {length} bytes, a signal needs "
                    f"{_device.GPU_SIGNAL_SIZE}"
                )
            _device.prep_gpu_signal(addr, dev)

    def get_remote_descs(
        self,
        descs: Union[nixlRemoteDList, list],
        mem_type: Optional[str] = None,
    ) -> Optional[nixlRemoteDList]:
        """A remote list (the peers' memory a memory view targets) from
        ``(addr, len, dev_id, agent_name)`` tuples with a memory type, or a
        ``nixlRemoteDList`` (returned as is). ``None`` (logged) for anything else, as
        NIXL."""
        if isinstance(descs, nixlRemoteDList):
            return descs
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is not None and len(descs[0]) == 4:
                return nixlRemoteDList(self.nixl_mems[mem_type], descs)
            if mem_type is None:
                logger.error("Please specify a mem type")
            else:
                logger.error(
                    "4-tuple list (addr, len, dev_id, agent_name) needed for remote descriptors"
                )
        return None

    # --- notifications -------------------------------------------------------------

    def get_new_notifs(self, backends: List[str] = []) -> Dict[str, List[bytes]]:  # noqa: B006
        """Notifications received since the last call: ``{sender: [message, ...]}``."""
        return self.agent.getNotifs({}, self._handles(backends))

    def wait_new_notifs(
        self, timeout: float, backends: List[str] = []  # noqa: B006
    ) -> Dict[str, List[bytes]]:
        """``get_new_notifs`` that blocks until at least one notification arrived or
        ``timeout`` seconds passed (then ``{}``), without using the CPU while it waits
        (ours: NIXL has no blocking wait; its users poll ``get_new_notifs``)."""
        self._handles(backends)
        return self.agent._core.wait_notifs(float(timeout))

    def update_notifs(self, backends: List[str] = []) -> Dict[str, List[bytes]]:  # noqa: B006
        """Adds new notifications to ``self.notifs`` and returns it (all not yet handled)."""
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: str,
        lookup_tag: bytes,
        backends: List[str] = [],  # noqa: B006
        tag_is_prefix=True,
    ) -> bool:
        """Whether a notification from the peer matching ``lookup_tag`` (a prefix, or a
        substring with ``tag_is_prefix=False``) arrived; removes the one found."""
        self.update_notifs(backends)
        tag = _msg_bytes(lookup_tag)
        msgs = self.notifs.get(remote_agent_name, [])
        for i, msg in enumerate(msgs):
            if (tag_is_prefix and msg.startswith(tag)) or (not tag_is_prefix and tag in msg):
                del msgs[i]
                return True
        return False

    def send_notif(
        self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None
    ):
        """Sends a notification not bound to a transfer."""
        if backend is None:
            self.agent.genNotif(remote_agent_name, notif_msg)
        else:
            self.agent.genNotif(remote_agent_name, notif_msg, self._handles([backend]))

    # --- metadata ------------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        """This agent's full metadata (connection information and registrations)."""
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(
        self,
        descs: nixlRegDList,
        inc_conn_info: bool = False,
        backends: List[str] = [],  # noqa: B006
    ) -> bytes:
        """Metadata of only the registrations covering ``descs`` (may be empty), with
        connection information if ``inc_conn_info``."""
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads a peer's metadata; returns its name (as bytes, as NIXL does)."""
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: str):
        """Forgets a peer and disconnects from it (a no-op for an unknown one, as NIXL)."""
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        """Pushes the full metadata to the peer listening at ``ip_addr:port``, or
        without an IP publishes it in etcd (``NIXL_ETCD_ENDPOINTS``;
        ``nixlNoMetadataServerError`` without one)."""
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(
        self,
        descs: nixlRegDList,
        inc_conn_info: bool = False,
        backends: List[str] = [],  # noqa: B006
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ):
        """Pushes partial metadata (see ``get_partial_agent_metadata``) to a peer, or
        without an IP publishes it in etcd under ``label`` (required there)."""
        self.agent.sendLocalPartialMD(
            descs, inc_conn_info, self._handles(backends), ip_addr, port, label
        )

    def fetch_remote_metadata(
        self,
        remote_agent: str,
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ):
        """Fetches and loads the metadata of the peer listening at ``ip_addr:port``, or
        without an IP ``remote_agent``'s (``label``'s, if given) from etcd; poll
        ``check_remote_metadata`` for a peer that has not published yet."""
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        """Tells the peer listening at ``ip_addr:port`` to forget this agent, or without
        an IP removes its keys from etcd (peers that fetched it from there forget it)."""
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs: nixlXferDList = None) -> bool:
        """Whether the peer's metadata is loaded (covering ``descs`` if given)."""
        if descs is None:
            descs = nixlXferDList(nixlBind.DRAM_SEG)
        elif isinstance(descs, nixlRegDList):
            descs = descs.trim()
        return self.agent.checkRemoteMD(agent, descs) == nixlBind.NIXL_SUCCESS

    # --- descriptor lists ----------------------------------------------------------

    @staticmethod
    def _tensor_mem_type(tensor: "torch.Tensor") -> str:
        return "DRAM" if tensor.get_device() == -1 else "VRAM"

    def _tensor_rows(self, descs):
        """(mem_type, [(addr, len, dev)]) of a tensor or a list of tensors on one device,
        or None (logged) for non-contiguous tensors or mixed devices."""
        tensors = [descs] if _is_torch_tensor(descs) else list(descs)
        device = tensors[0].device
        rows = []
        for t in tensors:
            if t.device != device:
                logger.error("All tensors of a list must be on one device")
                return None
            if not t.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            gpu = t.get_device()
            rows.append((t.data_ptr(), t.numel() * t.element_size(), 0 if gpu == -1 else gpu))
        return self._tensor_mem_type(tensors[0]), rows

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None) -> Optional[nixlXferDList]:
        """A transfer list from: (addr, len, dev) tuples with a memory type; an N x 3
        numpy array with a memory type; a tensor; a list of tensors; or a nixlXferDList
        (returned as is). ``None`` (logged) for anything else, as NIXL."""
        if isinstance(descs, nixlXferDList):
            return descs
        if isinstance(descs, nixlRegDList):
            logger.error("RegList type detected for transfer, please use XferList")
            return None
        if _is_ndarray(descs):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for transfer descriptor list from numpy array")
                return None
            return nixlXferDList(self.nixl_mems[mem_type], descs)
        if _is_torch_tensor(descs) or (
            isinstance(descs, (list, tuple)) and descs and _is_torch_tensor(descs[0])
        ):
            got = self._tensor_rows(descs)
            if got is None:
                return None
            return nixlXferDList(self.nixl_mems[got[0]], got[1])
        if isinstance(descs, (list, tuple)):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if descs and not (isinstance(descs[0], tuple) and len(descs[0]) == 3):
                logger.error("3-tuple list needed for transfer")
                return None
            return nixlXferDList(self.nixl_mems[mem_type], descs)
        return None

    def get_reg_descs(self, descs, mem_type: Optional[str] = None) -> Optional[nixlRegDList]:
        """A registration list from: (addr, len, dev, meta) tuples with a memory type;
        an N x 3 numpy array with a memory type; a tensor; a list of tensors; or a
        nixlRegDList (returned as is). ``None`` (logged) for anything else, as NIXL."""
        if isinstance(descs, nixlRegDList):
            return descs
        if isinstance(descs, nixlXferDList):
            logger.error("XferList type detected for registration, please use RegList")
            return None
        if _is_ndarray(descs):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for transfer descriptor list from numpy array")
                return None
            return nixlRegDList(self.nixl_mems[mem_type], descs)
        if _is_torch_tensor(descs) or (
            isinstance(descs, (list, tuple)) and descs and _is_torch_tensor(descs[0])
        ):
            got = self._tensor_rows(descs)
            if got is None:
                return None
            return nixlRegDList(self.nixl_mems[got[0]], [(*r, b"") for r in got[1]])
        if isinstance(descs, (list, tuple)):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if descs and not (isinstance(descs[0], tuple) and len(descs[0]) == 4):
                logger.error("4-tuple list needed for registration")
                return None
            return nixlRegDList(self.nixl_mems[mem_type], descs)
        return None

    def get_serialized_descs(self, descs) -> bytes:
        """Serializes a descriptor list (pickle, as NIXL)."""
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes):
        """Inverse of ``get_serialized_descs``."""
        return pickle.loads(serialized_descs)


def _any_descs(agent: "nixl_agent", descs, mem_type: Optional[str]):
    """A registration or transfer list from what either of their builders takes."""
    if isinstance(descs, (nixlRegDList, nixlXferDList)):
        return descs
    if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
        if len(descs[0]) == 3:
            return agent.get_xfer_descs(descs, mem_type)
    return agent.get_reg_descs(descs, mem_type)

