"""Type stubs of the Rust extension ``rdma_nixl._core``.

Descriptor lists cross as ``(mem_type, packed)``: ``mem_type`` is the core's kind code
(DRAM 0, VRAM 1, FILE 2, BLK 3, OBJ 4; ``_bindings`` maps NIXL's values to it) and
``packed`` little-endian u64 triples ``(addr, len, dev_id)``. Index lists cross as
little-endian i64. Use ``rdma_nixl._api`` rather than this module directly.
"""

from typing import Dict, List, Optional, Tuple

__version__: str
CUDA: bool
ETCD: bool
"""Whether this build has the etcd client (metadata calls without an address)."""
GPU_SIGNAL_SIZE: int
"""Bytes of a signal word (8)."""
GPU_HANDLE_SIZE: int
"""Bytes of a device handle's kernel argument (40)."""
DEVICE_HEADERS: List[Tuple[str, str]]
"""The device headers by include name: ``nixl/nixl_device.cuh`` and gpunetio's."""

def pack_descs(descs: object, width: int) -> Optional[bytes]:
    """The first three fields of each tuple of a list or tuple of ``width``-tuples of
    ints in ``0..2**64``, as native-endian u64 triples; ``None`` for anything else
    (the caller's checked path then converts or raises)."""
def pack_indices(indices: object) -> Optional[bytes]:
    """A list or tuple of ints that fit an i64, as little-endian i64; ``None`` for
    anything else."""
def prep_gpu_signal(ptr: int, dev: int) -> None:
    """Zeroes the 8-byte signal word at device address ``ptr`` of GPU ``dev``."""
def gpu_count() -> int:
    """GPUs this process sees (0 without a CUDA driver or the ``cuda`` feature)."""
def gpu_arch(dev: int) -> str:
    """``"compute_XY"`` of GPU ``dev``."""
def _test_gpu_handle(kind: str, slot: int) -> GpuHandle:
    """A handle whose release only counts (tests without a GPU)."""
def _test_released() -> int: ...

class nixlError(Exception):
    kind: str
    agent: Optional[str]
    backend: Optional[str]
    code: Optional[int]

class nixlInvalidParamError(nixlError): ...
class nixlNotFoundError(nixlError): ...
class nixlMismatchError(nixlError): ...
class nixlBackendError(nixlError): ...
class nixlRemoteDisconnectError(nixlError): ...
class nixlCancelledError(nixlError): ...
class nixlNotPostedError(nixlError): ...
class nixlRepostActiveError(nixlError): ...
class nixlNotSupportedError(nixlError): ...
class nixlNotAllowedError(nixlError): ...
class nixlNoTelemetryError(nixlError): ...
class nixlUnknownError(nixlError): ...
class nixlStalledError(nixlBackendError): ...
class nixlTimeoutError(nixlBackendError): ...

class Dlist:
    """A prepared descriptor list; released explicitly or when collected."""

    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...
    def __len__(self) -> int: ...

class Xfer:
    """A transfer request; released explicitly or when collected (canceling it)."""

    @property
    def backend(self) -> str: ...
    @property
    def released(self) -> bool: ...
    def post(self, notif: Optional[bytes] = None) -> str:
        """``"DONE"`` or ``"PROC"``; raises on failure."""
    def status(self) -> str:
        """``"DONE"`` or ``"PROC"``; raises on failure (terminal)."""
    def telemetry(self) -> Tuple[int, int, int, int, int]:
        """(start_us, post_duration_us, xfer_duration_us, total_bytes, desc_count)."""
    def create_gpu_xfer_req(self) -> GpuHandle:
        """``nixlGpuXferReqH`` of this request (GPUNETIO; else nixlNotSupportedError)."""
    def release(self) -> None: ...

class GpuHandle:
    """A device handle (``nixlGpuXferReqH`` / ``nixlMemViewH``); released explicitly or
    when collected."""

    @property
    def raw(self) -> bytes:
        """The 40-byte kernel argument (little-endian ``nixl_gpu_handle``)."""
    @property
    def kind(self) -> str:
        """``"xfer_req"`` or ``"mem_view"``."""
    @property
    def slot(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def descs(self) -> int: ...
    @property
    def qp(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def flags(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...

class Agent:
    def __init__(
        self,
        name: str,
        progress_thread: bool = True,
        listen_port: Optional[int] = None,
        stall_timeout_s: float = 30.0,
        metadata_timeout_s: float = 10.0,
        etcd_timeout_s: float = 5.0,
    ) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def etcd_configured(self) -> bool:
        """``NIXL_ETCD_ENDPOINTS`` was set when the agent was made (and etcd is built)."""
    @property
    def listen_port(self) -> Optional[int]: ...
    @staticmethod
    def available_backends() -> List[str]: ...
    def create_backend(self, name: str, params: Dict[str, str]) -> Tuple[str, List[str]]: ...
    def backends(self) -> List[Tuple[str, List[str]]]: ...
    def register(
        self, mem_type: int, packed: bytes, backends: Optional[List[str]] = None
    ) -> None: ...
    def deregister(
        self, mem_type: int, packed: bytes, backends: Optional[List[str]] = None
    ) -> None: ...
    def query_mem(
        self, mem_type: int, packed: bytes, backend: str
    ) -> List[Optional[Dict[str, str]]]: ...
    def query_mem_info(
        self, mem_type: int, metas: List[bytes], backend: str
    ) -> Optional[List[Optional[Dict[str, str]]]]: ...
    def local_metadata(self) -> bytes: ...
    def partial_metadata(self, mem_type: int, packed: bytes, inc_conn_info: bool) -> bytes: ...
    def load_remote_metadata(self, blob: bytes) -> str: ...
    def invalidate_remote(self, name: str) -> bool: ...
    def has_remote(self, name: str, mem_type: int, packed: bytes) -> bool: ...
    def send_local_metadata(self, ip: str, port: int) -> None: ...
    def send_partial_metadata(
        self, mem_type: int, packed: bytes, inc_conn_info: bool, ip: str, port: int
    ) -> None: ...
    def fetch_remote_metadata(self, ip: str, port: int) -> str: ...
    def invalidate_local_metadata(self, ip: str, port: int) -> None: ...
    def etcd_send_local_metadata(self) -> None: ...
    def etcd_send_partial_metadata(
        self, mem_type: int, packed: bytes, inc_conn_info: bool, label: str
    ) -> None: ...
    def etcd_fetch_remote_metadata(self, remote: str, label: str) -> bool:
        """True: loaded; False: not published yet, waited for in the background."""
    def etcd_invalidate_local_metadata(self) -> None: ...
    def prep_xfer_dlist(self, agent: Optional[str], mem_type: int, packed: bytes) -> Dlist: ...
    def make_xfer_req(
        self,
        operation: str,
        local: Dlist,
        local_idx: bytes,
        remote: Dlist,
        remote_idx: bytes,
        notif: Optional[bytes] = None,
        backend: Optional[str] = None,
    ) -> Xfer: ...
    def create_xfer_req(
        self,
        operation: str,
        local_type: int,
        local: bytes,
        remote_type: int,
        remote: bytes,
        agent: str,
        notif: Optional[bytes] = None,
        backend: Optional[str] = None,
    ) -> Xfer: ...
    def prep_mem_view(
        self,
        agent: Optional[str],
        mem_type: int,
        packed: bytes,
        backend: Optional[str] = None,
    ) -> GpuHandle:
        """``nixlMemViewH`` of a list: local (``agent`` None) or a peer's memory."""
    def gen_notif(self, agent: str, msg: bytes) -> None: ...
    def get_notifs(self) -> Dict[str, List[bytes]]: ...
    def wait_notifs(self, timeout_s: float) -> Dict[str, List[bytes]]:
        """``get_notifs`` that blocks (GIL released) until a notification or the timeout."""
    def shutdown(self) -> None: ...

class TelemetryRing:
    """NIXL's telemetry ring file (``sharedRingBuffer<nixlTelemetryEvent>``): a 40-byte
    header, then ``capacity`` 16-byte events; one producer, readers advance ``read_pos``."""

    def __init__(self, path: str, capacity: int, version: int) -> None:
        """Creates (or recreates, emptied) the file; ``capacity`` a power of two."""
    def push(self, event_type: int, value: int) -> bool:
        """Appends an event; False when the ring is full or closed (dropped)."""
    def push_many(self, events: List[Tuple[int, int]]) -> int:
        """Appends events in order; returns how many fit."""
    def __len__(self) -> int: ...
    def close(self) -> None:
        """Unmaps the file; later pushes drop their events."""
    @property
    def path(self) -> str: ...
    @property
    def capacity(self) -> int: ...
