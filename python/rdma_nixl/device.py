"""The GPU device API from Python: kernel arguments, headers, compile options, signals.

Kernels post transfers an agent prepared themselves (NIXL's device API), with a
``GPUNETIO`` backend::

    from rdma_nixl import device

    req = agent.create_gpu_xfer_req(xfer)          # nixl_gpu_xfer_req_handle
    view = agent.prep_mem_view(remote_descs)       # nixl_mem_view_handle
    kernel = cupy.RawKernel(source, "my_kernel", options=device.nvrtc_options())
    kernel((1,), (32,), (req.kernel_arg, ...))     # the 40-byte nixlGpuXferReqH, by value

``source`` does ``#include "nixl/nixl_device.cuh"`` and calls
``nixlGpuPostSingleWriteXferReq<nixl_gpu_level_t::THREAD>(req, ...)``,
``nixlGpuPostSignalXferReq``, ``nixlPut``, ``nixlAtomicAdd``, ``nixlGetPtr`` (see the
header: ``header_path()``).

A handle releases itself when garbage collected (or by ``release()`` / the agent's
``release_gpu_xfer_req`` / ``release_mem_view``); a kernel launched with a released
handle's bytes gets ``NIXL_ERR_INVALID_PARAM`` and touches no freed memory. Release a
handle only after the kernels using it finished.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import tempfile
from typing import Dict, Iterable, List, Optional, Tuple

from . import _core
from ._bindings import nixlInvalidParamError

__all__ = [
    "GPU_SIGNAL_SIZE",
    "HANDLE_SIZE",
    "nixl_gpu_handle",
    "nixl_gpu_xfer_req_handle",
    "nixl_mem_view_handle",
    "nixlGpuHandleStruct",
    "handle_dtype",
    "headers",
    "include_dir",
    "include_dirs",
    "header_path",
    "nvrtc_options",
    "gpu_arch",
    "get_gpu_signal_size",
    "prep_gpu_signal",
]

#: Bytes of a signal word (``getGpuSignalSize``): a 64-bit counter, 8-byte aligned.
GPU_SIGNAL_SIZE: int = _core.GPU_SIGNAL_SIZE
#: Bytes of a kernel argument ``nixlGpuXferReqH`` / ``nixlMemViewH`` (passed by value).
HANDLE_SIZE: int = _core.GPU_HANDLE_SIZE

# Device status codes (nixl_status_t), as kernels get them.
NIXL_IN_PROG = 1
NIXL_SUCCESS = 0
NIXL_ERR_INVALID_PARAM = -2
NIXL_ERR_BACKEND = -3
NIXL_ERR_NOT_SUPPORTED = -9
NIXL_ERR_REMOTE_DISCONNECT = -10
NIXL_ERR_CANCELED = -11

# Handle flags (NIXL_GPU_SLOT_*, NIXL_GPU_DIRECT, NIXL_GPU_SAME_DEVICE).
SLOT_REQUEST = 1
SLOT_VIEW = 2
SLOT_LOCAL = 4
HANDLE_DIRECT = 8
HANDLE_SAME_DEVICE = 16

# The kernel argument's fields: the C struct nixl_gpu_handle (nixl/nixl_device.cuh).
_FIELDS: Tuple[Tuple[str, str, int], ...] = (
    ("slot", "<u8", 0),
    ("generation", "<u8", 8),
    ("descs", "<u8", 16),
    ("qp", "<u8", 24),
    ("count", "<u4", 32),
    ("flags", "<u4", 36),
)


class nixlGpuHandleStruct(ctypes.Structure):
    """``nixl_gpu_handle`` as a ctypes struct (40 bytes): for launchers taking ctypes
    values (``cuLaunchKernel`` through ctypes, cuda-python's argument packing)."""

    _fields_ = [
        ("slot", ctypes.c_uint64),
        ("generation", ctypes.c_uint64),
        ("descs", ctypes.c_uint64),
        ("qp", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


assert ctypes.sizeof(nixlGpuHandleStruct) == HANDLE_SIZE
assert all(getattr(nixlGpuHandleStruct, n).offset == o for n, _, o in _FIELDS)

_dtype = None
# Ints of handles: never reused, so a stale int never names a newer handle.
_IDS = itertools.count(1)


def handle_dtype():
    """The numpy structured dtype of the kernel argument (40 bytes, C layout); a scalar
    of it (``handle.kernel_arg``) is what CuPy's ``RawKernel`` passes by value."""
    global _dtype
    if _dtype is None:
        import numpy as np

        _dtype = np.dtype(
            {
                "names": [n for n, _, _ in _FIELDS],
                "formats": [f for _, f, _ in _FIELDS],
                "offsets": [o for _, _, o in _FIELDS],
                "itemsize": HANDLE_SIZE,
            },
            align=True,
        )
    return _dtype


class nixl_gpu_handle(int):
    """A device handle: the kernel argument and what keeps it valid. Released by
    ``release()`` or when garbage collected.

    It *is* an int, as NIXL's handles are (``isinstance(h, int)``, never 0): a number
    naming it, unique in the process and never reused, that the agent's release
    methods also accept as a plain int. The kernel argument is not that number (ours
    is a 40-byte struct passed by value, NIXL's a device pointer): ``raw`` is its
    bytes, ``kernel_arg`` the same as a numpy structured scalar (CuPy ``RawKernel``
    arguments), ``as_ctypes()`` a ctypes struct. ``handle`` is ``int(h)``. The bytes
    stay readable after release (a kernel given them gets ``NIXL_ERR_INVALID_PARAM``)."""

    # An int subclass cannot have slots of its own; the instance dict holds the core
    # handle and its bytes.

    def __new__(cls, core_handle):
        self = super().__new__(cls, next(_IDS))
        self._handle = core_handle
        self._raw = core_handle.raw
        return self

    @property
    def raw(self) -> bytes:
        """The kernel argument's 40 bytes (little-endian ``nixl_gpu_handle``)."""
        return self._raw

    @property
    def handle(self) -> int:
        """The int naming this handle (``int(h)``; unique in the process, never reused)."""
        return int(self)

    @property
    def core(self):
        """The extension's handle object (``rdma_nixl._core.GpuHandle``)."""
        return self._handle

    @property
    def kernel_arg(self):
        """The argument as a numpy structured scalar (``numpy.void``, 40 bytes), what
        CuPy's ``RawKernel`` passes by value for a struct parameter."""
        import numpy as np

        return np.frombuffer(self._raw, dtype=handle_dtype())[0]

    def as_ctypes(self) -> nixlGpuHandleStruct:
        """The argument as a ctypes struct."""
        return nixlGpuHandleStruct.from_buffer_copy(self._raw)

    @property
    def fields(self) -> Dict[str, int]:
        """``{slot, generation, descs, qp, count, flags}``."""
        h = self._handle
        return {
            "slot": h.slot,
            "generation": h.generation,
            "descs": h.descs,
            "qp": h.qp,
            "count": h.count,
            "flags": h.flags,
        }

    @property
    def count(self) -> int:
        """Descriptors of the request, elements of the view."""
        return self._handle.count

    @property
    def released(self) -> bool:
        return self._handle.released

    def release(self) -> None:
        """Releases the handle (idempotent). Only after kernels using it finished."""
        self._handle.release()

    def __del__(self):
        try:
            self._handle.release()
        except Exception:  # pragma: no cover - finalizers must not raise
            pass

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(handle={int(self)}, count={self.count}, "
            f"released={self.released})"
        )


class nixl_gpu_xfer_req_handle(nixl_gpu_handle):
    """``nixlGpuXferReqH``: a transfer request's descriptors for
    ``nixlGpuPostSingleWriteXferReq`` / ``nixlGpuPostSignalXferReq`` (from
    ``nixl_agent.create_gpu_xfer_req``)."""

    #: The core handle's ``kind``.
    KIND = "xfer_req"


class nixl_mem_view_handle(nixl_gpu_handle):
    """``nixlMemViewH``: a descriptor list's elements for ``nixlPut`` /
    ``nixlAtomicAdd`` / ``nixlGetPtr`` (from ``nixl_agent.prep_mem_view``)."""

    #: The core handle's ``kind``.
    KIND = "mem_view"


# --- headers and compile options ----------------------------------------------------


def headers() -> Dict[str, str]:
    """The device headers by include name (``nixl/nixl_device.cuh`` and the gpunetio
    device library it includes), as the extension was built with them."""
    return dict(_core.DEVICE_HEADERS)


_include: Optional[str] = None


def _cache_root() -> str:
    explicit = os.environ.get("RDMA_NIXL_INCLUDE_CACHE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rdma_nixl")


def include_dir() -> str:
    """A folder holding the device headers (``-I`` it and ``#include
    "nixl/nixl_device.cuh"``). Written once per header version under
    ``$RDMA_NIXL_INCLUDE_CACHE``, else ``~/.cache/rdma_nixl`` (the temporary folder where
    that is not writable)."""
    global _include
    if _include is not None and os.path.isdir(_include):
        return _include
    files = sorted(_core.DEVICE_HEADERS)
    digest = hashlib.sha256()
    for name, text in files:
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    tag = "include-" + digest.hexdigest()[:16]
    last_error: Optional[OSError] = None
    for root in (_cache_root(), os.path.join(tempfile.gettempdir(), f"rdma_nixl-{os.getuid()}")):
        final = os.path.join(root, tag)
        if all(os.path.isfile(os.path.join(final, n)) for n, _ in files):
            _include = final
            return final
        try:
            os.makedirs(root, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=".staging-", dir=root)
            for name, text in files:
                path = os.path.join(staging, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            try:
                os.rename(staging, final)
            except OSError:
                # Another process put the same headers there first.
                _remove_tree(staging)
                if not os.path.isdir(final):
                    raise
            _include = final
            return final
        except OSError as e:
            last_error = e
    raise OSError(f"cannot write the device headers anywhere: {last_error}")


def _remove_tree(path: str) -> None:
    for root, dirs, names in os.walk(path, topdown=False):
        for n in names:
            os.unlink(os.path.join(root, n))
        for d in dirs:
            os.rmdir(os.path.join(root, d))
    os.rmdir(path)


def include_dirs() -> List[str]:
    """``[include_dir()]``: the include path a kernel using the device API needs."""
    return [include_dir()]


def header_path() -> str:
    """The path of ``nixl/nixl_device.cuh`` (the device API and its documentation)."""
    return os.path.join(include_dir(), "nixl", "nixl_device.cuh")


def gpu_arch(device: int = 0) -> str:
    """GPU ``device``'s virtual architecture for NVRTC, e.g. ``"compute_90"``."""
    return _core.gpu_arch(int(device))


def nvrtc_options(
    device: Optional[int] = None,
    arch: Optional[str] = None,
    defines: Iterable[str] = (),
) -> Tuple[str, ...]:
    """NVRTC options for a kernel that includes ``nixl/nixl_device.cuh``: the include
    folder and C++17, plus ``-DNAME`` per define (e.g. ``GIO_DEBUG``). CuPy's
    ``RawKernel``/``RawModule`` pick the architecture themselves; for NVRTC called
    directly, give ``arch`` (``"compute_90"``) or ``device`` (its architecture is read).
    The device library needs sm_70 or newer."""
    opts = [f"-I{include_dir()}", "-std=c++17"]
    if arch is None and device is not None:
        arch = gpu_arch(device)
    if arch is not None:
        opts.append(f"--gpu-architecture={arch}")
    opts.extend(f"-D{d}" for d in defines)
    return tuple(opts)


# --- signals --------------------------------------------------------------------------


def get_gpu_signal_size() -> int:
    """Bytes of a signal word for ``nixlGpuPostSignalXferReq`` (NIXL's
    ``getGpuSignalSize``)."""
    return GPU_SIGNAL_SIZE


def prep_gpu_signal(ptr: int, device: int = 0) -> None:
    """Zeroes the signal word at device address ``ptr`` on GPU ``device`` (NIXL's
    ``prepGpuSignal``): it must be 8-byte aligned device memory of that GPU
    (``nixlInvalidParamError`` otherwise)."""
    ptr, device = int(ptr), int(device)
    if ptr <= 0 or device < 0:
        raise nixlInvalidParamError(f"signal word at {ptr:#x} on device {device}: not a device address")
    _core.prep_gpu_signal(ptr, device)
