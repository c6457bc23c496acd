"""NIXL's test helpers (``nixl._utils``): raw host buffers by address.

NIXL's own tests and examples allocate, fill and compare plain host memory through
these four functions; they are here so that code runs unchanged. They take and return
addresses as ints (what descriptors hold), and like NIXL's they trust the caller: an
address that is not a live buffer of at least ``size`` bytes is undefined behaviour.

- ``malloc_passthru(size)``: ``size`` bytes aligned to 4096 (storage I/O with
  ``O_DIRECT`` needs block alignment), uninitialised; 0 when the allocation fails.
- ``free_passthru(addr)``: frees what ``malloc_passthru`` returned.
- ``ba_buf(addr, size)``: fills ``size`` bytes with ``0xba``.
- ``verify_transfer(addr1, addr2, size)``: checks two buffers hold the same bytes.
  NIXL's is a C ``assert`` (which its release wheel compiles out, checking nothing);
  this one always checks and raises ``AssertionError`` naming the first differing
  offset.
"""

from __future__ import annotations

import ctypes
import operator

__all__ = ["malloc_passthru", "free_passthru", "ba_buf", "verify_transfer"]

# Alignment of malloc_passthru's buffers (NIXL's IO_SIZE).
IO_SIZE = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_aligned_alloc = _libc.aligned_alloc
_aligned_alloc.restype = ctypes.c_void_p
_aligned_alloc.argtypes = (ctypes.c_size_t, ctypes.c_size_t)
_free = _libc.free
_free.restype = None
_free.argtypes = (ctypes.c_void_p,)

_INT_MAX = (1 << 31) - 1


def _c_int(value, what: str) -> int:
    """NIXL's sizes are C ``int``s: an int (or an object with ``__index__``) in range,
    else ``TypeError``, as pybind11 raises."""
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None
    if not -_INT_MAX - 1 <= n <= _INT_MAX:
        raise TypeError(f"{what} {n} does not fit a C int")
    return n


def _address(value, what: str) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int address, not {type(value).__name__}") from None
    if not 0 <= n < (1 << 64):
        raise TypeError(f"{what} {n} is not an address")
    return n


def malloc_passthru(size: int) -> int:
    """``size`` bytes aligned to 4096 (uninitialised); 0 if the allocation fails (a
    negative size fails, as C's ``aligned_alloc`` of the same value)."""
    n = _c_int(size, "size")
    if n < 0:
        return 0
    return _aligned_alloc(IO_SIZE, n) or 0


def free_passthru(buf: int) -> None:
    """Frees a buffer from ``malloc_passthru`` (0 is a no-op, as ``free(NULL)``)."""
    addr = _address(buf, "buf")
    if addr:
        _free(addr)


def ba_buf(addr: int, size: int) -> None:
    """Fills ``size`` bytes at ``addr`` with ``0xba`` (nothing for ``size <= 0``)."""
    base = _address(addr, "addr")
    n = _c_int(size, "size")
    if n > 0:
        ctypes.memset(base, 0xBA, n)


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Raises ``AssertionError`` unless the ``size`` bytes at ``addr1`` and ``addr2``
    are equal."""
    a = _address(addr1, "addr1")
    b = _address(addr2, "addr2")
    n = _c_int(size, "size")
    if n <= 0:
        return
    left = ctypes.string_at(a, n)
    right = ctypes.string_at(b, n)
    if left != right:
        at = next(i for i in range(n) if left[i] != right[i])
        raise AssertionError(
            f"transfer mismatch at byte {at} of {n}: {left[at]:#04x} at {a + at:#x}, "
            f"{right[at]:#04x} at {b + at:#x}"
        )
