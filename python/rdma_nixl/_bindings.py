"""The names of NIXL's ``nixl._bindings`` module, over our Rust core.

Constants keep NIXL's values (``nixl_mem_t.FILE_SEG`` is 4 as in NIXL, whatever the
core numbers it; ``nixl_status_t`` has NIXL's status codes), the exception classes keep
NIXL's names (all subclasses of our ``nixlError``; ``status`` is the NIXL status each
stands for), and the descriptor lists ``nixlXferDList`` / ``nixlRegDList`` /
``nixlRemoteDList`` have the methods of NIXL's (``descCount``, ``getType``, ``append``,
``trim``, indexing, pickling). ``nixlAgentConfig`` and the low-level ``nixlAgent``
(NIXL's camelCase methods, int handles, status returns) are in ``_agent`` and
re-exported here.

Where NIXL raises a built-in exception for a malformed argument (``ValueError`` for a
descriptor of the wrong width or an empty agent name, ``TypeError`` for an argument of
the wrong type, ``IndexError`` for an index out of range), so does this module; where
such an error is also one of NIXL's statuses, the class raised derives from both (a
missing descriptor in ``index()`` is a ``nixlNotFoundError`` and a ``ValueError``).
"""

from __future__ import annotations

import os
import sys
from array import array
from enum import IntEnum
from typing import Iterator, Optional, Tuple, Union

from . import _core
from ._core import (  # noqa: F401  (re-exported)
    nixlBackendError,
    nixlCancelledError,
    nixlError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlStalledError,
    nixlTimeoutError,
    nixlUnknownError,
)

DEFAULT_COMM_PORT = 8888
NIXL_INIT_AGENT = ""
# Our device API is the GPUNETIO backend's (HAVE_GPU_DEVICE_API: this build has it).
# NIXL's HAVE_UCX_GPU_DEVICE_API (UCX's device API) is computed on first use, below.
HAVE_GPU_DEVICE_API = bool(_core.CUDA)

_UNSET = object()
_ucx_device_reason = _UNSET


def _ucx_device_api_unavailable() -> Optional[str]:
    """Why NIXL's device API cannot be served behind the backend name ``UCX`` in this
    process, or None where it can: this build has ``GPUNETIO``, a GPU is seen and NVRTC
    loads (an agent made with ``UCX`` then adds ``GPUNETIO`` for VRAM: see
    ``nixl_agent``), unless ``RDMA_NIXL_UCX_DEVICE_API=0`` turns that off (agents that
    never use the device API then skip the backend's cost: an IPC listener thread and a
    kernel compiled per agent). Asked once per process, when first needed: the probe initialises
    the CUDA driver, which importing the package must not do (a process that forks
    after initialising CUDA leaves its children without it)."""
    global _ucx_device_reason
    if _ucx_device_reason is _UNSET:
        setting = os.environ.get("RDMA_NIXL_UCX_DEVICE_API", "").strip().lower()
        if setting in ("0", "n", "no", "off", "false", "disable"):
            _ucx_device_reason = f"turned off by RDMA_NIXL_UCX_DEVICE_API={setting}"
        elif "GPUNETIO" not in _core.Agent.available_backends():
            _ucx_device_reason = "this build has no GPUNETIO backend"
        else:
            _ucx_device_reason = _core.device_api_unavailable()
    return _ucx_device_reason


def __getattr__(name: str):
    # NIXL's probe for UCX's GPU device API (its tests skip the device API without it):
    # true where the device path behind "UCX" exists in this build and this machine.
    if name == "HAVE_UCX_GPU_DEVICE_API":
        return _ucx_device_api_unavailable() is None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + ["HAVE_UCX_GPU_DEVICE_API"])


class _NixlEnum(IntEnum):
    """An IntEnum printed as pybind11 prints NIXL's enums (``nixl_mem_t.DRAM_SEG``)."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class nixl_mem_t(_NixlEnum):
    """Memory types, with NIXL's values."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG

# NIXL's value -> the core's memory-kind code.
_CORE_KIND = {
    nixl_mem_t.DRAM_SEG: 0,
    nixl_mem_t.VRAM_SEG: 1,
    nixl_mem_t.FILE_SEG: 2,
    nixl_mem_t.BLK_SEG: 3,
    nixl_mem_t.OBJ_SEG: 4,
}
# The core's names ("DRAM_SEG", ...) are NIXL's.


class nixl_xfer_op_t(_NixlEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


NIXL_READ = nixl_xfer_op_t.NIXL_READ
NIXL_WRITE = nixl_xfer_op_t.NIXL_WRITE


class nixl_thread_sync_t(_NixlEnum):
    """NIXL's thread-safety levels of an agent. Ours is thread-safe at every level (see
    ``nixlAgent``): the level is recorded, and ``NONE`` is upgraded to ``STRICT`` when a
    listener thread runs, as NIXL does."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0  # an alias of NONE, as in NIXL


NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT


class nixl_status_t(_NixlEnum):
    """NIXL's status codes: what the low-level ``nixlAgent`` methods return (errors are
    raised as the exception class of the status instead)."""

    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9
    NIXL_ERR_REMOTE_DISCONNECT = -10
    NIXL_ERR_CANCELED = -11
    NIXL_ERR_NO_TELEMETRY = -12


NIXL_IN_PROG = nixl_status_t.NIXL_IN_PROG
NIXL_SUCCESS = nixl_status_t.NIXL_SUCCESS
NIXL_ERR_NOT_POSTED = nixl_status_t.NIXL_ERR_NOT_POSTED
NIXL_ERR_INVALID_PARAM = nixl_status_t.NIXL_ERR_INVALID_PARAM
NIXL_ERR_BACKEND = nixl_status_t.NIXL_ERR_BACKEND
NIXL_ERR_NOT_FOUND = nixl_status_t.NIXL_ERR_NOT_FOUND
NIXL_ERR_MISMATCH = nixl_status_t.NIXL_ERR_MISMATCH
NIXL_ERR_NOT_ALLOWED = nixl_status_t.NIXL_ERR_NOT_ALLOWED
NIXL_ERR_REPOST_ACTIVE = nixl_status_t.NIXL_ERR_REPOST_ACTIVE
NIXL_ERR_UNKNOWN = nixl_status_t.NIXL_ERR_UNKNOWN
NIXL_ERR_NOT_SUPPORTED = nixl_status_t.NIXL_ERR_NOT_SUPPORTED
NIXL_ERR_REMOTE_DISCONNECT = nixl_status_t.NIXL_ERR_REMOTE_DISCONNECT
NIXL_ERR_CANCELED = nixl_status_t.NIXL_ERR_CANCELED
NIXL_ERR_NO_TELEMETRY = nixl_status_t.NIXL_ERR_NO_TELEMETRY


class nixl_cost_t(_NixlEnum):
    """How ``estimateXferCost`` estimated (none of our backends estimates)."""

    NIXL_COST_ANALYTICAL_BACKEND = 0


NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND

# The NIXL status each exception class stands for (``e.status``); our two additions
# are backend errors.
for _cls, _status in (
    (nixlNotPostedError, nixl_status_t.NIXL_ERR_NOT_POSTED),
    (nixlInvalidParamError, nixl_status_t.NIXL_ERR_INVALID_PARAM),
    (nixlBackendError, nixl_status_t.NIXL_ERR_BACKEND),
    (nixlNotFoundError, nixl_status_t.NIXL_ERR_NOT_FOUND),
    (nixlMismatchError, nixl_status_t.NIXL_ERR_MISMATCH),
    (nixlNotAllowedError, nixl_status_t.NIXL_ERR_NOT_ALLOWED),
    (nixlRepostActiveError, nixl_status_t.NIXL_ERR_REPOST_ACTIVE),
    (nixlUnknownError, nixl_status_t.NIXL_ERR_UNKNOWN),
    (nixlNotSupportedError, nixl_status_t.NIXL_ERR_NOT_SUPPORTED),
    (nixlRemoteDisconnectError, nixl_status_t.NIXL_ERR_REMOTE_DISCONNECT),
    (nixlCancelledError, nixl_status_t.NIXL_ERR_CANCELED),
    (nixlNoTelemetryError, nixl_status_t.NIXL_ERR_NO_TELEMETRY),
    (nixlError, nixl_status_t.NIXL_ERR_UNKNOWN),
):
    _cls.status = _status


class nixlEmptyNameError(nixlInvalidParamError, ValueError):
    """An agent needs a non-empty name (NIXL raises ``ValueError``)."""


class nixlDescNotFoundError(nixlNotFoundError, ValueError):
    """``index()`` of a descriptor the list lacks: NIXL's ``NIXL_ERR_NOT_FOUND``, and the
    ``ValueError`` of Python's ``list.index``."""


class _BadDescriptors(nixlInvalidParamError, TypeError):
    """Descriptors in a form a call does not take (NIXL's bindings raise TypeError)."""


class _BadArgument(nixlInvalidParamError, TypeError):
    """An argument of the wrong type (NIXL's bindings raise TypeError)."""


class nixlNoMetadataServerError(nixlNotSupportedError, nixlInvalidParamError):
    """A metadata call without an IP address and without a central metadata store
    (``NIXL_ETCD_ENDPOINTS`` unset when the agent was made, or a build without etcd):
    NIXL returns ``NIXL_ERR_INVALID_PARAM`` (``NIXL_ERR_NOT_SUPPORTED`` without etcd)."""

Desc3 = Tuple[int, int, int]
Desc4 = Tuple[int, int, int, Union[bytes, str]]


def _mem(value) -> nixl_mem_t:
    try:
        return nixl_mem_t(value)
    except ValueError:
        raise nixlInvalidParamError(f"unknown memory type {value!r}") from None


def _is_ndarray(obj) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


class _DList:
    """Descriptors of one memory type, packed as u64 triples (addr, len, dev_id)."""

    __slots__ = ("_type", "_words", "_packed")
    _width = 3

    def __init__(self, mem_type, descs=None):
        self._type = _mem(mem_type)
        self._words = array("Q")
        self._packed: Optional[bytes] = None
        if descs is None:
            return
        if isinstance(descs, int) and not isinstance(descs, bool):
            # NIXL's (type, init_size): that many descriptors, here zeroed (NIXL's are
            # uninitialised), to be filled by index.
            if descs < 0:
                raise ValueError(f"init_size must be non-negative, not {descs}")
            self._words.frombytes(bytes(24 * descs))
            self._add_meta_defaults(descs)
            return
        if _is_ndarray(descs):
            self._add_array(descs)
        elif not self._extend_fast(descs):
            for d in descs:
                self.append(d)

    # --- filling -------------------------------------------------------------------
    def _add_array(self, arr) -> None:
        np = sys.modules["numpy"]
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise ValueError("a numpy descriptor array must be N x 3 (addr, len, dev_id)")
        if arr.dtype.kind not in "iu":
            raise ValueError(
                f"a numpy descriptor array must be of an integer type (uint64 or int64), "
                f"not {arr.dtype}"
            )
        if arr.size and (arr < 0).any():
            raise ValueError("descriptor fields must be non-negative")
        self._words.frombytes(np.ascontiguousarray(arr, dtype="<u8").tobytes())
        self._add_meta_defaults(arr.shape[0])
        self._packed = None

    def _add_meta_defaults(self, n: int) -> None:
        pass

    def _extend_fast(self, descs) -> bool:
        """Bulk path for a list of well-formed tuples (thousands of descriptors cross at
        C speed); False, changing nothing, if any entry needs the checked path (which
        raises the precise error)."""
        if not isinstance(descs, (list, tuple)):
            return False
        # One pass in Rust: every entry a tuple of ``_width`` fields, the first three
        # converted to u64 (None where any is not, or does not fit).
        packed = _core.pack_descs(descs, self._width)
        if packed is None:
            return False
        was_empty = not self._words
        self._words.frombytes(packed)
        self._add_meta(descs)
        # A list built in one go hands the core these very bytes (native order is the
        # core's little-endian on such hosts): no second copy at prep time.
        self._packed = packed if was_empty and sys.byteorder == "little" else None
        return True

    def _add_meta(self, descs) -> None:
        pass

    def _check(self, d) -> Desc3:
        if not isinstance(d, (tuple, list)) or len(d) != self._width:
            raise ValueError(
                f"Each descriptor tuple must have exactly {self._width} elements"
            )
        addr, length, dev = (int(d[0]), int(d[1]), int(d[2]))
        if addr < 0 or length < 0 or dev < 0:
            raise ValueError("descriptor fields must be non-negative")
        return addr, length, dev

    def append(self, desc) -> None:
        addr, length, dev = self._check(desc)
        self._words.extend((addr, length, dev))
        self._packed = None

    addDesc = append

    # --- NIXL's list methods ---------------------------------------------------------
    def descCount(self) -> int:
        return len(self._words) // 3

    def isEmpty(self) -> bool:
        return len(self._words) == 0

    def getType(self) -> nixl_mem_t:
        return self._type

    def clear(self) -> None:
        del self._words[:]
        self._packed = None

    def remDesc(self, index: int) -> None:
        i = self._norm(index)
        del self._words[3 * i : 3 * i + 3]
        self._packed = None

    def index(self, desc) -> int:
        """The position of the first descriptor with ``desc``'s (addr, len, dev_id)
        (NIXL compares those only); ``nixlDescNotFoundError`` (a ``nixlNotFoundError``
        and a ``ValueError``) when there is none."""
        want = tuple(int(x) for x in desc[:3])
        for i in range(self.descCount()):
            if self._triple(i) == want:
                return i
        raise nixlDescNotFoundError(f"NIXL_ERR_NOT_FOUND: {desc!r} is not in the list")

    def print(self) -> None:
        print(f"DescList of mem type {int(self._type)}")
        for i in range(self.descCount()):
            print(f"  {self[i]}")

    # --- Python protocol ----------------------------------------------------------
    def _norm(self, index: int) -> int:
        n = self.descCount()
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"descriptor index {index} out of range (list has {n})")
        return i

    def _triple(self, i: int) -> Desc3:
        w = self._words
        return (w[3 * i], w[3 * i + 1], w[3 * i + 2])

    def __getitem__(self, index: int):
        return self._triple(self._norm(index))

    def __setitem__(self, index: int, desc) -> None:
        i = self._norm(index)
        self._words[3 * i : 3 * i + 3] = array("Q", self._check(desc))
        self._packed = None

    def __len__(self) -> int:
        return self.descCount()

    def __iter__(self) -> Iterator:
        for i in range(self.descCount()):
            yield self[i]

    def __eq__(self, other) -> bool:
        return (
            type(self) is type(other)
            and self._type == other._type
            and self._words == other._words
        )

    __hash__ = None  # mutable, like a list

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._type.name}, {list(self)!r})"

    def __getstate__(self):
        return (int(self._type), self._words.tobytes())

    def __setstate__(self, state) -> None:
        self._type = nixl_mem_t(state[0])
        self._words = array("Q")
        self._words.frombytes(state[1])
        self._packed = None

    # --- for the core ---------------------------------------------------------------
    def _core_kind(self) -> int:
        return _CORE_KIND[self._type]

    def _packed_bytes(self) -> bytes:
        # Cached: a list prepared once is often handed over many times.
        if self._packed is None:
            w = self._words
            if sys.byteorder != "little":
                w = array("Q", w)
                w.byteswap()
            self._packed = w.tobytes()
        return self._packed


class nixlXferDList(_DList):
    """A transfer descriptor list: (addr, len, dev_id) triples of one memory type."""

    __slots__ = ()

    def trim(self) -> "nixlXferDList":
        """A copy (``nixlRegDList.trim()``'s counterpart: code trimming either kind of
        list gets a new transfer list, the original unchanged)."""
        out = nixlXferDList(self._type)
        out._words = array("Q", self._words)
        return out


class _TaggedDList(_DList):
    """Descriptors with a fourth field per descriptor (``_tag`` converts it)."""

    __slots__ = ("_meta",)
    _width = 4

    def __init__(self, mem_type, descs=None):
        self._meta: list = []
        super().__init__(mem_type, descs)

    @staticmethod
    def _tag(value):
        raise NotImplementedError

    def _add_meta_defaults(self, n: int) -> None:
        self._meta.extend([self._tag(b"")] * n)

    def _add_meta(self, descs) -> None:
        self._meta.extend(self._tag(d[3]) for d in descs)

    def append(self, desc) -> None:
        super().append(desc)
        self._meta.append(self._tag(desc[3]))

    addDesc = append

    def clear(self) -> None:
        super().clear()
        self._meta = []

    def remDesc(self, index: int) -> None:
        i = self._norm(index)
        super().remDesc(i)
        del self._meta[i]

    def __getitem__(self, index: int):
        i = self._norm(index)
        return (*self._triple(i), self._meta[i])

    def __setitem__(self, index: int, desc) -> None:
        i = self._norm(index)
        super().__setitem__(i, desc)
        self._meta[i] = self._tag(desc[3])

    def __eq__(self, other) -> bool:
        return super().__eq__(other) and self._meta == other._meta

    __hash__ = _DList.__hash__

    def __getstate__(self):
        return (int(self._type), self._words.tobytes(), list(self._meta))

    def __setstate__(self, state) -> None:
        super().__setstate__(state[:2])
        self._meta = list(state[2])


class nixlRegDList(_TaggedDList):
    """A registration descriptor list: (addr, len, dev_id, meta) of one memory type."""

    __slots__ = ()

    @staticmethod
    def _tag(value) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def trim(self) -> nixlXferDList:
        """A new ``nixlXferDList`` of the same memory type holding the descriptors'
        ``(addr, len, dev_id)`` (their metadata dropped); this list is unchanged."""
        out = nixlXferDList(self._type)
        out._words = array("Q", self._words)
        return out


class nixlRemoteDList(_TaggedDList):
    """A remote descriptor list: (addr, len, dev_id, agent_name) of one memory type, the
    peers' memory a memory view (``prep_mem_view``) targets."""

    __slots__ = ()

    @staticmethod
    def _tag(value) -> str:
        if isinstance(value, (bytes, bytearray, memoryview)):
            value = bytes(value).decode()
        if not isinstance(value, str):
            raise ValueError(f"a remote descriptor's agent name must be a str, not {value!r}")
        return value

    def agents(self) -> list:
        """The agent name of each descriptor."""
        return list(self._meta)


class nixlXferTelemetry:
    """Telemetry of a transfer's last post; times in microseconds."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
            f"descCount={self.descCount})"
        )


# The low-level agent and its configuration (they use the names above).
from ._agent import nixlAgent, nixlAgentConfig  # noqa: E402,F401  (re-exported)
