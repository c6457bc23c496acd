"""NIXL's low-level agent (``nixl._bindings.nixlAgent``) and its configuration
(``nixlAgentConfig``), over the Rust agent (``_core.Agent``).

These are the classes NIXL's ``nixl_agent`` is built on, with NIXL's method names,
arguments and return conventions: backends, prepared lists and transfer requests are
ints (handles), successful calls return ``nixl_status_t`` values (``NIXL_SUCCESS``,
``NIXL_IN_PROG``) and failures raise the exception class of their status
(``nixlNotFoundError`` for ``NIXL_ERR_NOT_FOUND``, ...). Code written against NIXL's
bindings (``createBackend``, ``registerMem``, ``createXferReq``, ``postXferReq``,
``getXferStatus``, ``getNotifs``, ...) runs unchanged.

Handles are never reused within a process, so a stale one names nothing: passing it
raises ``nixlInvalidParamError`` (in NIXL it is a dangling pointer).

Thread safety (``syncMode``). NIXL's agent takes no lock under
``NIXL_THREAD_SYNC_NONE`` (callers must serialise their calls), one lock for every call
under ``STRICT``, and a reader/writer lock under ``RW`` (transfers in parallel, changes
to registrations and peers exclusive). The Rust agent under this one is thread-safe by
construction whatever the level: its registrations and peers are behind reader/writer
locks, each transfer request behind its own lock, and every call that may block
releases the GIL. So every level's guarantee holds at every level, and transfers on
different requests run in parallel even under ``STRICT``. The level is kept as NIXL
keeps it (``NONE`` becomes ``STRICT`` when a listener thread runs) and readable as
``nixlAgent.syncMode``, for code that checks it.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import operator
import os
import sys
from array import array
from typing import Callable, Dict, List, Optional, Tuple

from . import _core
from . import _telemetry
from ._bindings import (
    DEFAULT_COMM_PORT,
    _BadDescriptors,
    NIXL_ERR_NOT_FOUND,
    NIXL_IN_PROG,
    NIXL_INIT_AGENT,
    NIXL_SUCCESS,
    nixl_status_t,
    nixl_thread_sync_t,
    nixl_xfer_op_t,
    nixlEmptyNameError,
    nixlError,
    nixlInvalidParamError,
    nixlNoMetadataServerError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDList,
    nixlXferDList,
    nixlXferTelemetry,
)

logger = logging.getLogger("rdma_nixl.bindings")

__all__ = ["nixlAgent", "nixlAgentConfig", "BACKEND_ALIASES", "PLUGIN_PARAMS"]

# NIXL's backends that this build provides under another name: code asking for NIXL's
# default, UCX, gets the backend we use for peers.
BACKEND_ALIASES = {"UCX": "LIBFABRIC"}

# Parameters each backend takes, with their defaults (``getPluginParams``).
PLUGIN_PARAMS: Dict[str, Dict[str, str]] = {
    "LIBFABRIC": {
        "provider": "",
        # shm rails for the peers on this host, beside the provider's ("none": only those).
        "local_provider": "shm",
        # the shm rails' count (default: as num_rails for shm, one per four cores).
        "local_rails": "",
        "node": "",
        "num_rails": "1",
        "striping_threshold": str(128 << 10),
        "busy_poll": "0",
        "vram_mode": "auto",
        "staging_chunk": str(512 << 10),
        "staging_chunks": "16",
        "stage_dram": "0",
        # shm: WRITEs from 2 MiB copied by both processes at once ("0": by the peer alone).
        "cma_write": "1",
        # shm: READs from 2 MiB copied by both processes at once, and serving peers' such
        # READs ("0": neither).
        "cma_read": "1",
        # shm: transfers up to this many bytes copied by the posting thread ("0": off).
        "cma_inline": str(1 << 20),
        # shm: threads copying a transfer of many small blocks (a KV-cache pull) within the
        # post (a quarter of the CPUs, at most 8; below 2: off).
        "cma_threads": str(min(8, (os.cpu_count() or 1) // 4)),
        # VRAM <-> a same-host peer's DRAM in one copy by the process owning the DRAM
        # ("off": the staged pipeline).
        "vram_peer_copy": "auto",
        # Notifications from endpoints that are no loaded peer: "any" delivers them under
        # the name they carry (targets that never load their initiators), "loaded" refuses.
        "notif_senders": "any",
    },
    "VERBS": {
        "device": "",
        "gid_index": "",
        "ib_port": "1",
        "num_rails": "1",
        "striping_threshold": str(128 << 10),
        "listen_addr": "",
        "topology_xml": "",
        "qp_timeout": "",
        "vram_mode": "auto",
        "staging_chunk": str(512 << 10),
        "staging_chunks": "16",
        "stage_dram": "0",
    },
    "LOCAL": {"num_streams": "4", "copy_engine": "auto"} if _core.CUDA else {},
    # NIXL's POSIX: files by pread/pwrite (its io-queue choices have no counterpart);
    # VRAM goes through pinned slots, staging_size bytes per transfer in slots of
    # staging_slot_size.
    "POSIX": {"staging_size": str(4 << 20), "staging_slot_size": str(1 << 20)},
    # peer_access=off copies every cross-GPU pair through pinned host memory.
    "CUDA_IPC": {"num_streams": "4", "copy_engine": "auto", "peer_access": "auto"},
    "GPUNETIO": {
        # Empty: the GPU of the first VRAM registered (an ordinal pins one).
        "gpu_devices": "",
        "cuda_streams": "4",
        "network_devices": "",
        "oob_interface": "",
        "nic_handler": "auto",
        "provider": "tcp;ofi_rxm",
        "copy_depth": "4",
        # Host-posted same-node copies: copy engines / batched kernel (auto) or the
        # queue-pair kernel (gio).
        "copy_engine": "auto",
        # VRAM <-> a same-host peer's DRAM in one copy by the peer ("off": the NIC path).
        "vram_peer_copy": "auto",
    },
    "FAULT": {
        "inner": "",
        "fail_completion": "",
        "fail_error": "disconnect",
        "disconnect_after": "",
        "delay_ms": "",
        "hold": "false",
        "drop_notif": "",
    },
}
_GPU_MEMS = ["DRAM_SEG", "VRAM_SEG"] if _core.CUDA else ["DRAM_SEG"]
# Memory types each backend registers (``getPluginParams``, before creating it).
PLUGIN_MEMS: Dict[str, List[str]] = {
    "LIBFABRIC": _GPU_MEMS,
    "VERBS": _GPU_MEMS,
    "LOCAL": _GPU_MEMS,
    "POSIX": _GPU_MEMS + ["FILE_SEG"],
    "CUDA_IPC": ["DRAM_SEG", "VRAM_SEG"],
    "GPUNETIO": ["DRAM_SEG", "VRAM_SEG"],
    "FAULT": _GPU_MEMS,
}

# Handle ints for backends, prepared lists, requests and memory views: one counter for
# all kinds (a handle of one kind never names another) that never repeats.
_HANDLES = itertools.count(0x1_0000)

_U16 = (1 << 16) - 1
_U64 = (1 << 64) - 1


def _is_ndarray(obj: object) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


def _msg_bytes(msg) -> bytes:
    """A message or metadata blob as bytes (NIXL's bindings take ``str`` or ``bytes``)."""
    if isinstance(msg, bytes):
        return msg
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytearray, memoryview)):
        return bytes(msg)
    raise TypeError(f"expected str or bytes, not {type(msg).__name__}")


def _index_bytes(indices) -> bytes:
    """Indices as little-endian i64 bytes (what the core takes). A list or tuple is
    converted in Rust in one pass; one it cannot take (an entry that is not an int of
    64 bits) goes the checked way below, which raises the precise error."""
    if type(indices) is list or type(indices) is tuple:
        packed = _core.pack_indices(indices)
        if packed is not None:
            return packed
    if _is_ndarray(indices):
        if indices.ndim != 1:
            raise ValueError("indices numpy array must be 1D")
        if indices.dtype.kind not in "iu":
            raise ValueError(f"indices numpy array must be of an integer type, not {indices.dtype}")
        return indices.astype("<i8", copy=False).tobytes()
    try:
        packed = array("q", indices)
    except TypeError:
        raise TypeError("indices must be a list of ints or a 1D numpy array") from None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _op_name(operation) -> str:
    """``"READ"``/``"WRITE"`` of a ``nixl_xfer_op_t`` (or its int value)."""
    try:
        return nixl_xfer_op_t(operation).name[5:]
    except ValueError:
        raise TypeError(f"operation must be a nixl_xfer_op_t, not {operation!r}") from None


def _as_bool(value, what: str) -> bool:
    if isinstance(value, bool):
        return value
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.bool_):
        return bool(value)
    try:
        return bool(operator.index(value))
    except TypeError:
        raise TypeError(f"{what} must be a bool, not {type(value).__name__}") from None


def _as_uint(value, what: str, top: int) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None
    if isinstance(value, bool) or not 0 <= n <= top:
        raise TypeError(f"{what} must be an int in 0..{top}, not {value!r}")
    return n


class nixlAgentConfig:
    """An agent's configuration (NIXL's ``nixlAgentConfig``).

    ``nixlAgentConfig()`` has NIXL's defaults (no progress thread, no listener, port
    8888, ``NIXL_THREAD_SYNC_DEFAULT``, no telemetry, ``pthrDelay`` 0 µs, ``lthrDelay``
    100000 µs, ``etcdWatchTimeout`` 5 s); NIXL's positional constructor
    ``nixlAgentConfig(use_prog_thread[, use_listen_thread[, port[, sync_mode[,
    num_workers[, pthr_delay_us[, lthr_delay_us[, capture_telemetry]]]]]]])`` is taken
    too. Fields are typed as NIXL's (``TypeError`` otherwise).

    ``useProgThread``: backends progress transfers on their own threads.
    ``useListenThread`` / ``listenPort``: the metadata listener (port 0: any free one).
    ``syncMode``: the thread-safety level (see the module's notes: ours holds every
    level's guarantee). ``captureTelemetry``: telemetry, unless ``NIXL_TELEMETRY_ENABLE``
    overrides it. ``etcdWatchTimeout`` bounds each etcd request and a fetch's wait for
    a key not published yet (``NIXL_ETCD_ENDPOINTS``). ``pthrDelay`` and ``lthrDelay``
    are kept but have no effect: our progress and listener threads wake on events rather
    than on a timer. ``num_workers`` is accepted and ignored, as by
    NIXL's constructor.
    """

    __slots__ = (
        "_use_prog_thread",
        "_use_listen_thread",
        "_listen_port",
        "_sync_mode",
        "_capture_telemetry",
        "_pthr_delay",
        "_lthr_delay",
        "_etcd_watch_timeout",
    )

    _POSITIONAL = (
        "useProgThread",
        "useListenThread",
        "listenPort",
        "syncMode",
        None,  # num_workers: in NIXL's constructor, stored nowhere
        "pthrDelay",
        "lthrDelay",
        "captureTelemetry",
    )

    def __init__(self, *args):
        if len(args) > len(self._POSITIONAL):
            raise TypeError(
                f"nixlAgentConfig() takes at most {len(self._POSITIONAL)} arguments "
                f"(use_prog_thread, use_listen_thread, port, sync_mode, num_workers, "
                f"pthr_delay_us, lthr_delay_us, capture_telemetry), got {len(args)}"
            )
        self._use_prog_thread = False
        self._use_listen_thread = False
        self._listen_port = DEFAULT_COMM_PORT
        self._sync_mode = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT
        self._capture_telemetry = False
        self._pthr_delay = 0
        self._lthr_delay = 100000
        self._etcd_watch_timeout = datetime.timedelta(seconds=5)
        for name, value in zip(self._POSITIONAL, args):
            if name is None:
                _as_uint(value, "num_workers", (1 << 32) - 1)
            else:
                setattr(self, name, value)

    @property
    def useProgThread(self) -> bool:
        return self._use_prog_thread

    @useProgThread.setter
    def useProgThread(self, value) -> None:
        self._use_prog_thread = _as_bool(value, "useProgThread")

    @property
    def useListenThread(self) -> bool:
        return self._use_listen_thread

    @useListenThread.setter
    def useListenThread(self, value) -> None:
        self._use_listen_thread = _as_bool(value, "useListenThread")

    @property
    def listenPort(self) -> int:
        return self._listen_port

    @listenPort.setter
    def listenPort(self, value) -> None:
        self._listen_port = _as_uint(value, "listenPort", _U16)

    @property
    def syncMode(self) -> nixl_thread_sync_t:
        return self._sync_mode

    @syncMode.setter
    def syncMode(self, value) -> None:
        if not isinstance(value, nixl_thread_sync_t):
            raise TypeError(f"syncMode must be a nixl_thread_sync_t, not {value!r}")
        self._sync_mode = value

    @property
    def captureTelemetry(self) -> bool:
        return self._capture_telemetry

    @captureTelemetry.setter
    def captureTelemetry(self, value) -> None:
        self._capture_telemetry = _as_bool(value, "captureTelemetry")

    @property
    def pthrDelay(self) -> int:
        return self._pthr_delay

    @pthrDelay.setter
    def pthrDelay(self, value) -> None:
        self._pthr_delay = _as_uint(value, "pthrDelay", _U64)

    @property
    def lthrDelay(self) -> int:
        return self._lthr_delay

    @lthrDelay.setter
    def lthrDelay(self, value) -> None:
        self._lthr_delay = _as_uint(value, "lthrDelay", _U64)

    @property
    def etcdWatchTimeout(self) -> datetime.timedelta:
        return self._etcd_watch_timeout

    @etcdWatchTimeout.setter
    def etcdWatchTimeout(self, value) -> None:
        if isinstance(value, datetime.timedelta):
            self._etcd_watch_timeout = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            self._etcd_watch_timeout = datetime.timedelta(seconds=value)
        else:
            raise TypeError(
                f"etcdWatchTimeout must be a datetime.timedelta or seconds, not {value!r}"
            )

    def __repr__(self) -> str:
        return (
            f"nixlAgentConfig(useProgThread={self._use_prog_thread}, "
            f"useListenThread={self._use_listen_thread}, listenPort={self._listen_port}, "
            f"syncMode={self._sync_mode}, captureTelemetry={self._capture_telemetry}, "
            f"pthrDelay={self._pthr_delay}, lthrDelay={self._lthr_delay}, "
            f"etcdWatchTimeout={self._etcd_watch_timeout})"
        )


def _count_error(ring, e: nixlError) -> None:
    """Records a failed call in an agent's telemetry ring (NIXL's ``agent_err_*``)."""
    if ring is not None:
        event = _telemetry.error_event(int(getattr(e, "status", 0)))
        if event is not None:
            ring.push(event, 1)


class _Request:
    """A transfer request behind a handle int: posts and polls the core request, and
    records its telemetry events once per completed post. (It holds the agent's ring,
    not the agent: no reference cycle keeps an agent alive after its last user.)"""

    __slots__ = ("core", "ring", "is_write", "pending")

    def __init__(self, core, ring, is_write: bool):
        self.core = core
        self.ring = ring
        self.is_write = is_write
        # A post whose completion has not been recorded in the ring yet.
        self.pending = False

    def post(self, notif: Optional[bytes] = None) -> str:
        """``"DONE"`` or ``"PROC"``."""
        try:
            state = self.core.post(notif) if notif else self.core.post()
        except nixlError as e:
            _count_error(self.ring, e)
            raise
        if self.ring is not None:
            if state == "DONE":
                self._record()
            else:
                self.pending = True
        return state

    def status(self) -> str:
        """``"DONE"`` or ``"PROC"``; a failed transfer raises."""
        try:
            state = self.core.status()
        except nixlError as e:
            _count_error(self.ring, e)
            raise
        if self.pending and state == "DONE":
            self.pending = False
            self._record()
        return state

    def _record(self) -> None:
        _start, post_us, xfer_us, total_bytes, _descs = self.core.telemetry()
        t = _telemetry
        self.ring.push_many(
            [
                (t.AGENT_XFER_POST_TIME, post_us),
                (t.AGENT_XFER_TIME, xfer_us),
                (t.AGENT_TX_BYTES if self.is_write else t.AGENT_RX_BYTES, total_bytes),
                (t.AGENT_TX_REQUESTS_NUM if self.is_write else t.AGENT_RX_REQUESTS_NUM, 1),
            ]
        )


def _status(state: str) -> nixl_status_t:
    return NIXL_SUCCESS if state == "DONE" else NIXL_IN_PROG


class nixlAgent:
    """NIXL's low-level agent: ``nixlAgent(name, config)`` with NIXL's camelCase methods.

    ``name`` must be non-empty (``ValueError``, as NIXL); ``config`` is a
    ``nixlAgentConfig``. Backends are created by name (``UCX``, NIXL's default, creates
    ``LIBFABRIC``, logged); telemetry follows ``config.captureTelemetry`` and
    ``NIXL_TELEMETRY_*`` (``rdma_nixl._telemetry``). The Rust agent is ``self._core``.
    """

    def __init__(self, name: str, config: nixlAgentConfig):
        if not isinstance(name, str):
            raise TypeError(f"nixlAgent(name, config): name must be a str, not {type(name).__name__}")
        if not isinstance(config, nixlAgentConfig):
            raise TypeError(
                f"nixlAgent(name, config): config must be a nixlAgentConfig, not "
                f"{type(config).__name__}"
            )
        if not name:
            raise nixlEmptyNameError("Agent needs a non-empty name")
        telemetry_on = _telemetry.enabled(config.captureTelemetry)
        ring = _telemetry.open_sink(name) if telemetry_on else None
        self._core = _core.Agent(
            name,
            progress_thread=config.useProgThread,
            listen_port=config.listenPort if config.useListenThread else None,
            etcd_timeout_s=config.etcdWatchTimeout.total_seconds(),
        )
        self.name = name
        sync = config.syncMode
        if config.useListenThread and sync == nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE:
            sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        #: The thread-safety level in effect (NIXL's rule: NONE with a listener is STRICT).
        self.syncMode: nixl_thread_sync_t = sync
        self._telemetry_on = telemetry_on
        self._ring = ring
        # handle -> (name the core knows the backend by, name it was created as)
        self._backends: Dict[int, Tuple[str, str]] = {}
        self._backend_mems: Dict[int, List[str]] = {}
        self._backend_options: Dict[int, Dict[str, str]] = {}
        self._dlists: Dict[int, object] = {}
        self._requests: Dict[int, _Request] = {}
        self._mem_views: Dict[int, object] = {}

    def __repr__(self) -> str:
        return f"nixlAgent({self.name!r})"

    # --- internals -------------------------------------------------------------------

    def _count_error(self, e: nixlError) -> None:
        _count_error(self._ring, e)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except nixlError as e:
            self._count_error(e)
            raise

    def _backend(self, handle) -> str:
        try:
            return self._backends[operator.index(handle)][0]
        except (KeyError, TypeError):
            raise nixlInvalidParamError(
                f"{handle!r} is not a backend handle of agent '{self.name}'"
            ) from None

    def _backend_list(self, backends) -> Optional[List[str]]:
        if not backends:
            return None
        return [self._backend(b) for b in backends]

    def _lookup(self, table: dict, handle, what: str):
        try:
            return table[operator.index(handle)]
        except (KeyError, TypeError):
            raise nixlInvalidParamError(
                f"{handle!r} is not a live {what} handle of agent '{self.name}'"
            ) from None

    def _new_request(self, core, operation: str) -> int:
        handle = next(_HANDLES)
        self._requests[handle] = _Request(core, self._ring, operation == "WRITE")
        return handle

    def _request(self, handle) -> _Request:
        return self._lookup(self._requests, handle, "transfer request")

    def _try_backends(self, build: Callable[[Optional[str]], object], backends):
        """``build(backend)`` with each backend given, in order, until one succeeds (NIXL
        picks among the backends given), or with the agent's choice when none is."""
        names = self._backend_list(backends)
        if not names:
            return self._call(build, None)
        last: Optional[nixlError] = None
        for name in names:
            try:
                return build(name)
            except nixlError as e:
                last = e
        self._count_error(last)
        raise last

    @staticmethod
    def _reg_list(descs, what: str) -> nixlRegDList:
        if not isinstance(descs, nixlRegDList):
            raise _bad_list(what, "nixlRegDList", descs)
        return descs

    @staticmethod
    def _xfer_list(descs, what: str) -> nixlXferDList:
        if not isinstance(descs, nixlXferDList):
            raise _bad_list(what, "nixlXferDList", descs)
        return descs

    # --- plugins and backends ----------------------------------------------------------

    def getAvailPlugins(self) -> List[str]:
        """Names of the backends this build can create, and NIXL's names that create
        one of them (``UCX``, which creates ``LIBFABRIC``), last."""
        have = list(_core.Agent.available_backends())
        return have + [alias for alias, name in BACKEND_ALIASES.items() if name in have]

    def getPluginParams(self, type: str) -> Tuple[Dict[str, str], List[str]]:
        """``(parameters with their defaults, memory types)`` of a backend this build
        can create; ``nixlNotFoundError`` for any other name."""
        name = BACKEND_ALIASES.get(type, type)
        if name not in _core.Agent.available_backends():
            error = nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: no backend plugin '{type}'")
            self._count_error(error)
            raise error
        return dict(PLUGIN_PARAMS.get(name, {})), list(PLUGIN_MEMS.get(name, []))

    def getBackendParams(self, backend) -> Tuple[Dict[str, str], List[str]]:
        """``(parameters it was made with, memory types it registers)`` of a backend."""
        self._backend(backend)
        handle = operator.index(backend)
        return dict(self._backend_options[handle]), list(self._backend_mems[handle])

    def createBackend(self, type: str, initParams: Dict[str, str]) -> int:
        """Creates a backend; returns its handle. ``UCX`` creates ``LIBFABRIC``."""
        return self._create_backend(type, initParams)

    def _create_backend(self, type: str, initParams: Dict[str, str], count_errors: bool = True) -> int:
        """``createBackend``; ``count_errors=False`` for a backend added on the user's
        behalf where one can be (best effort): its failure is then not counted as one of
        the agent's errors in telemetry (the user asked for nothing that failed)."""
        name = BACKEND_ALIASES.get(type, type)
        if name != type:
            logger.info("Backend %s is NIXL's; creating %s, this build's backend for peers.", type, name)
        params = {str(k): str(v) for k, v in dict(initParams).items()}
        if count_errors:
            core_name, mems = self._call(self._core.create_backend, name, params)
        else:
            core_name, mems = self._core.create_backend(name, params)
        handle = next(_HANDLES)
        self._backends[handle] = (core_name, type)
        self._backend_mems[handle] = list(mems)
        options = dict(PLUGIN_PARAMS.get(name, {}))
        options.update(params)
        self._backend_options[handle] = options
        return handle

    # --- memory ------------------------------------------------------------------------

    def registerMem(self, descs: nixlRegDList, backends=()) -> nixl_status_t:
        """Registers every descriptor with each backend that takes its memory type (or
        with those given); all or nothing."""
        descs = self._reg_list(descs, "registerMem")
        self._call(
            self._core.register, descs._core_kind(), descs._packed_bytes(), self._backend_list(backends)
        )
        if self._ring is not None:
            self._ring.push(_telemetry.AGENT_MEMORY_REGISTERED, _total_len(descs))
        return NIXL_SUCCESS

    def deregisterMem(self, descs: nixlRegDList, backends=()) -> nixl_status_t:
        """Deregisters descriptors registered before (each as it was registered)."""
        descs = self._reg_list(descs, "deregisterMem")
        self._call(
            self._core.deregister, descs._core_kind(), descs._packed_bytes(), self._backend_list(backends)
        )
        if self._ring is not None:
            self._ring.push(_telemetry.AGENT_MEMORY_DEREGISTERED, _total_len(descs))
        return NIXL_SUCCESS

    def queryMem(self, descs: nixlRegDList, backend) -> List[Optional[Dict[str, str]]]:
        """Per descriptor, as NIXL's: a backend that answers from the descriptors'
        metadata (``POSIX``: ``metaInfo`` is a file path) gives ``None`` where the file does
        not exist, else ``{"size", "mode", "mtime"}`` (decimal strings, from ``stat``).
        Other backends answer from their registrations: ``None`` where the backend has not
        registered the descriptor, else ``{"backend", "mode"}``."""
        descs = self._reg_list(descs, "queryMem")
        name = self._backend(backend)
        answers = self._call(
            self._core.query_mem_info, descs._core_kind(), list(descs._meta), name
        )
        if answers is not None:
            return answers
        return self._call(self._core.query_mem, descs._core_kind(), descs._packed_bytes(), name)

    # --- metadata ----------------------------------------------------------------------

    def getLocalMD(self) -> bytes:
        """This agent's full metadata."""
        return self._call(self._core.local_metadata)

    def getLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool = False, backends=()) -> bytes:
        """Metadata of the registrations covering ``descs`` (none for an empty list),
        with connection information if ``inc_conn_info``."""
        descs = self._reg_list(descs, "getLocalPartialMD")
        self._backend_list(backends)
        return self._call(
            self._core.partial_metadata, descs._core_kind(), descs._packed_bytes(), bool(inc_conn_info)
        )

    def loadRemoteMD(self, remote_metadata) -> bytes:
        """Loads a peer's metadata; returns its name (bytes)."""
        return self._call(self._core.load_remote_metadata, _msg_bytes(remote_metadata)).encode()

    def invalidateRemoteMD(self, remote_agent: str) -> nixl_status_t:
        """Forgets a peer (and disconnects): ``NIXL_SUCCESS``, or ``NIXL_ERR_NOT_FOUND``
        (returned, not raised, as NIXL) for one it does not know."""
        known = self._call(self._core.invalidate_remote, remote_agent)
        return NIXL_SUCCESS if known else NIXL_ERR_NOT_FOUND

    def checkRemoteMD(self, remote_agent: str, descs: nixlXferDList) -> nixl_status_t:
        """``NIXL_SUCCESS`` if the peer's metadata is loaded and covers ``descs`` (empty:
        any), else ``NIXL_ERR_NOT_FOUND`` (returned)."""
        descs = self._xfer_list(descs, "checkRemoteMD")
        found = self._core.has_remote(remote_agent, descs._core_kind(), descs._packed_bytes())
        return NIXL_SUCCESS if found else NIXL_ERR_NOT_FOUND

    def _to_store(self, ip_addr: str, what: str) -> bool:
        """Whether ``what`` goes to the central metadata store (etcd): with no
        ``ip_addr``, as NIXL. Without an address and without a store
        (``NIXL_ETCD_ENDPOINTS`` unset when the agent was made, or a build without etcd)
        it raises ``nixlNoMetadataServerError`` (a ``nixlInvalidParamError``)."""
        if ip_addr:
            return False
        if self._core.etcd_configured:
            return True
        how = (
            "set NIXL_ETCD_ENDPOINTS before creating the agent"
            if _core.ETCD
            else "this build has no etcd client"
        )
        error = nixlNoMetadataServerError(
            f"NIXL_ERR_INVALID_PARAM: {what} needs an IP address or a central metadata "
            f"store ({how})"
        )
        self._count_error(error)
        raise error

    def sendLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        """Pushes the full metadata to the listener at ``ip_addr:port``, or without an
        address publishes it in etcd (``{namespace}/{name}/metadata``). Done, or raised
        (``nixlBackendError`` when etcd does not answer within ``etcdWatchTimeout``),
        when this returns."""
        if self._to_store(ip_addr, "sendLocalMD"):
            self._call(self._core.etcd_send_local_metadata)
            return
        self._call(self._core.send_local_metadata, ip_addr, int(port))

    def sendLocalPartialMD(
        self,
        descs: nixlRegDList,
        inc_conn_info: bool = False,
        backends=(),
        ip_addr: str = "",
        port: int = 0,
        label: str = "",
    ) -> None:
        """Pushes partial metadata (``getLocalPartialMD``) to the listener at
        ``ip_addr:port``, or without an address publishes it in etcd under ``label``
        (``{namespace}/{name}/{label}``; required there: ``nixlInvalidParamError``)."""
        descs = self._reg_list(descs, "sendLocalPartialMD")
        self._backend_list(backends)
        if self._to_store(ip_addr, "sendLocalPartialMD"):
            self._call(
                self._core.etcd_send_partial_metadata,
                descs._core_kind(),
                descs._packed_bytes(),
                bool(inc_conn_info),
                str(label),
            )
            return
        self._call(
            self._core.send_partial_metadata,
            descs._core_kind(),
            descs._packed_bytes(),
            bool(inc_conn_info),
            ip_addr,
            int(port),
        )

    def fetchRemoteMD(self, remote_agent: str, ip_addr: str = "", port: int = 0, label: str = "") -> None:
        """Fetches and loads the metadata of the agent listening at ``ip_addr:port``
        (loaded, or raised, when this returns). Without an address, from etcd:
        ``remote_agent``'s ``label`` (default: its full metadata), loaded before this
        returns if published, else waited for in the background for up to
        ``etcdWatchTimeout`` (poll ``checkRemoteMD``, as with NIXL); the peer is then
        watched: its keys removed invalidate it, a republication reloads it."""
        if self._to_store(ip_addr, "fetchRemoteMD"):
            self._call(self._core.etcd_fetch_remote_metadata, remote_agent, str(label))
            return
        got = self._call(self._core.fetch_remote_metadata, ip_addr, int(port))
        if got != remote_agent:
            logger.warning(
                "fetchRemoteMD: asked for '%s' at %s:%s, the agent there is '%s'",
                remote_agent, ip_addr, port, got,
            )

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        """Tells the agent listening at ``ip_addr:port`` to forget this one, or without
        an address removes this agent's keys from etcd (peers that fetched it from there
        forget it)."""
        if self._to_store(ip_addr, "invalidateLocalMD"):
            self._call(self._core.etcd_invalidate_local_metadata)
            return
        self._call(self._core.invalidate_local_metadata, ip_addr, int(port))

    def makeConnection(self, remote_agent: str, backends=()) -> nixl_status_t:
        """Connections are made when a peer's metadata is loaded: this checks it is
        (``nixlNotFoundError`` otherwise)."""
        self._backend_list(backends)
        if not self._core.has_remote(remote_agent, 0, b""):
            error = nixlNotFoundError(
                f"NIXL_ERR_NOT_FOUND: no metadata of remote agent '{remote_agent}' is loaded"
            )
            self._count_error(error)
            raise error
        return NIXL_SUCCESS

    # --- transfers ---------------------------------------------------------------------

    def prepXferDlist(self, *args, **kwargs) -> int:
        """A list prepared once for many requests by index; returns its handle. NIXL's
        three forms: ``(agent_name, descs[, backend])`` (``NIXL_INIT_AGENT`` — ``""`` —
        for local memory, a peer's name, or this agent's own for loopback),
        ``(descs[, backend])`` (local), and ``(agent_name, mem_type, array[,
        backend])`` with an N x 5 numpy array of strided rows ``(addr, len, dev_id,
        stride, count)``."""
        agent, descs, backends = _prep_args(args, kwargs)
        self._backend_list(backends)
        local = agent in (NIXL_INIT_AGENT, "NIXL_INIT_AGENT")
        core = self._call(
            self._core.prep_xfer_dlist,
            None if local else agent,
            descs._core_kind(),
            descs._packed_bytes(),
        )
        handle = next(_HANDLES)
        self._dlists[handle] = core
        return handle

    def releasedDlistH(self, handle) -> nixl_status_t:
        """Releases a prepared list."""
        core = self._lookup(self._dlists, handle, "prepared list")
        del self._dlists[operator.index(handle)]
        core.release()
        return NIXL_SUCCESS

    def makeXferReq(
        self,
        operation,
        local_side,
        local_indices,
        remote_side,
        remote_indices,
        notif_msg="",
        backend=(),
        skip_desc_merg: bool = False,
    ) -> int:
        """A request from two prepared lists by index (``local_indices[i]`` to/from
        ``remote_indices[i]``; lists or 1-D numpy arrays); returns its handle."""
        op = _op_name(operation)
        local = self._lookup(self._dlists, local_side, "prepared list")
        remote = self._lookup(self._dlists, remote_side, "prepared list")
        lidx = _index_bytes(local_indices)
        # One conversion where both sides take the same ids (the same object).
        ridx = lidx if remote_indices is local_indices else _index_bytes(remote_indices)
        notif = _msg_bytes(notif_msg) or None
        core = self._try_backends(
            lambda b: self._core.make_xfer_req(op, local, lidx, remote, ridx, notif, b), backend
        )
        return self._new_request(core, op)

    def createXferReq(
        self,
        operation,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: str,
        notif_msg="",
        backend=(),
    ) -> int:
        """A request from two lists (descriptor i to descriptor i); returns its handle."""
        op = _op_name(operation)
        local = self._xfer_list(local_descs, "createXferReq")
        remote = self._xfer_list(remote_descs, "createXferReq")
        notif = _msg_bytes(notif_msg) or None
        core = self._try_backends(
            lambda b: self._core.create_xfer_req(
                op,
                local._core_kind(),
                local._packed_bytes(),
                remote._core_kind(),
                remote._packed_bytes(),
                remote_agent,
                notif,
                b,
            ),
            backend,
        )
        return self._new_request(core, op)

    def estimateXferCost(self, req_handle) -> Tuple[int, int, int]:
        """Not provided: none of our backends estimates (``nixlNotSupportedError``)."""
        error = nixlNotSupportedError(
            "NIXL_ERR_NOT_SUPPORTED: no backend of this agent estimates transfer costs"
        )
        self._count_error(error)
        raise error

    def postXferReq(self, reqh, notif_msg="") -> nixl_status_t:
        """Posts a request: ``NIXL_SUCCESS`` if it completed within the call, else
        ``NIXL_IN_PROG``. A non-empty ``notif_msg`` replaces its notification."""
        notif = _msg_bytes(notif_msg)
        return _status(self._request(reqh).post(notif or None))

    def getXferStatus(self, reqh) -> nixl_status_t:
        """``NIXL_SUCCESS`` or ``NIXL_IN_PROG``; a failed transfer raises."""
        return _status(self._request(reqh).status())

    def getXferTelemetry(self, reqh) -> nixlXferTelemetry:
        """Telemetry of the request's last post (``nixlNoTelemetryError`` when the
        agent's telemetry is off)."""
        request = self._request(reqh)
        if not self._telemetry_on:
            error = nixlNoTelemetryError(
                "NIXL_ERR_NO_TELEMETRY: telemetry is off (captureTelemetry, NIXL_TELEMETRY_ENABLE)"
            )
            self._count_error(error)
            raise error
        return nixlXferTelemetry(*request.core.telemetry())

    def queryXferBackend(self, reqh) -> int:
        """The handle of the backend carrying a request."""
        core_name = self._request(reqh).core.backend
        for handle, (name, _asked) in self._backends.items():
            if name == core_name:
                return handle
        raise nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: backend '{core_name}' has no handle")

    def releaseXferReq(self, reqh) -> nixl_status_t:
        """Releases a request (one in flight is canceled)."""
        request = self._request(reqh)
        del self._requests[operator.index(reqh)]
        request.core.release()
        return NIXL_SUCCESS

    # --- notifications -----------------------------------------------------------------

    def getNotifs(self, notif_map, backends=()) -> Dict[str, List[bytes]]:
        """``notif_map``'s notifications plus those received since the last call, as a
        new dict (``notif_map`` itself is not changed, as with NIXL's copy)."""
        self._backend_list(backends)
        out = {str(k): list(v) for k, v in dict(notif_map).items()}
        for sender, msgs in self._call(self._core.get_notifs).items():
            out.setdefault(sender, []).extend(msgs)
        return out

    def genNotif(self, remote_agent: str, msg, backends=()) -> nixl_status_t:
        """Sends a notification not bound to a transfer."""
        self._backend_list(backends)
        self._call(self._core.gen_notif, remote_agent, _msg_bytes(msg))
        return NIXL_SUCCESS

    # --- the GPU device API --------------------------------------------------------------

    def _mem_view_core(self, dlist, backend: Optional[str]):
        agent, kind, packed = _mem_view_target(dlist)
        return self._core.prep_mem_view(agent, kind, packed, backend)

    def prepMemView(self, dlist, backends=()) -> int:
        """A memory view for kernels of a local ``nixlXferDList`` or a
        ``nixlRemoteDList``; returns its int (``nixl.device``'s handle objects are what
        ``nixl_agent.prep_mem_view`` returns)."""
        from .device import nixl_mem_view_handle

        core = self._try_backends(lambda b: self._mem_view_core(dlist, b), backends)
        view = nixl_mem_view_handle(core)
        self._mem_views[view.handle] = view
        return view.handle

    def releaseMemView(self, mvh) -> None:
        """Releases a memory view from ``prepMemView``."""
        view = self._lookup(self._mem_views, mvh, "memory view")
        del self._mem_views[operator.index(mvh)]
        view.release()


def _total_len(descs) -> int:
    return sum(descs._words[1::3])


def _bad_list(what: str, want: str, got) -> TypeError:
    return _BadDescriptors(f"{what} takes a {want}, not {type(got).__name__}")


def _prep_args(args, kwargs):
    """(agent name, nixlXferDList, backends) of ``prepXferDlist``'s three forms."""
    backends = kwargs.pop("backend", kwargs.pop("backends", ()))
    args = list(args)
    if "agent_name" in kwargs:
        args.insert(0, kwargs.pop("agent_name"))
    if "mem_type" in kwargs:
        args.insert(1, kwargs.pop("mem_type"))
    if "descs" in kwargs:
        args.append(kwargs.pop("descs"))
    if kwargs:
        raise TypeError(f"prepXferDlist(): unexpected arguments {sorted(kwargs)}")
    if args and isinstance(args[0], nixlXferDList):
        agent, rest = NIXL_INIT_AGENT, args
    elif args and isinstance(args[0], (str, bytes)):
        # bytes as NIXL's binding takes them (pybind11's std::string): vLLM passes the
        # name add_remote_agent returned, which is bytes.
        agent = args[0].decode() if isinstance(args[0], bytes) else args[0]
        rest = args[1:]
    else:
        raise TypeError(
            "prepXferDlist takes (agent_name, nixlXferDList[, backend]), (nixlXferDList[, "
            "backend]) or (agent_name, mem_type, N x 5 numpy array[, backend])"
        )
    if rest and isinstance(rest[0], nixlXferDList):
        descs = rest[0]
        extra = rest[1:]
    elif len(rest) >= 2 and _is_ndarray(rest[1]):
        descs = _strided_list(rest[0], rest[1])
        extra = rest[2:]
    else:
        raise TypeError("prepXferDlist: expected a nixlXferDList, or a memory type and an N x 5 array")
    if len(extra) > 1:
        raise TypeError("prepXferDlist: too many arguments")
    if extra:
        backends = extra[0]
    return agent, descs, backends


def _strided_list(mem_type, arr) -> nixlXferDList:
    """Rows ``(addr, len, dev_id, stride, count)`` expanded to ``count`` descriptors
    ``(addr + k * stride, len, dev_id)`` each."""
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise ValueError("strided descriptors must be an N x 5 numpy array")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"strided descriptors must be of an integer type, not {arr.dtype}")
    rows = []
    for addr, length, dev, stride, count in arr.tolist():
        rows.extend((int(addr) + k * int(stride), int(length), int(dev)) for k in range(int(count)))
    return nixlXferDList(mem_type, rows)


def _mem_view_target(dlist) -> Tuple[Optional[str], int, bytes]:
    """(agent or None for local memory, core kind, packed descriptors) of a list given
    to ``prepMemView``."""
    if isinstance(dlist, nixlRemoteDList):
        agents = sorted(set(dlist.agents()))
        if len(agents) != 1 or not agents[0]:
            raise nixlInvalidParamError(
                "prep_mem_view: a remote list's descriptors must all name one agent "
                f"(got {agents})"
            )
        agent: Optional[str] = agents[0]
    elif isinstance(dlist, nixlXferDList):
        agent = None
    else:
        raise _BadDescriptors(
            "prep_mem_view takes a nixlXferDList (local memory) or a nixlRemoteDList "
            f"(from get_remote_descs), not {type(dlist).__name__}"
        )
    if dlist.isEmpty():
        raise nixlInvalidParamError("prep_mem_view: a memory view needs at least one descriptor")
    return agent, dlist._core_kind(), dlist._packed_bytes()
