"""Kernels of the device-API tests, and NVRTC through ctypes (to compile them on a
machine without a GPU: the headers and options ``rdma_nixl.device`` gives must work).

Kernels:
- ``write_then_signal(req, len, out)``: the request form. Each thread writes its share
  of descriptor 0 (``nixlGpuPostSingleWriteXferReq<THREAD>``, waiting for delivery), the
  block synchronizes, thread 0 adds 1 to the signal word of descriptor 1
  (``nixlGpuPostSignalXferReq<THREAD>``). ``out[0]`` is the signal's status,
  ``out[1 + t]`` thread ``t``'s write status.
- ``put_then_add(src, dst, len, value, out)``: the memory-view form, one thread:
  ``nixlPut`` of ``len`` bytes from local element 0 to remote element 0, then
  ``nixlAtomicAdd(value)`` on remote element 1, each polled to completion; then the
  refusals (a put past the element, views swapped) and ``nixlGetPtr``.
- ``probe_stale(req, view, out)``: what a released handle gets.
"""

from __future__ import annotations

import ctypes
import glob
import os

SENTINEL = -999

SOURCE = r"""
#include "nixl/nixl_device.cuh"

extern "C" __global__ void write_then_signal(nixlGpuXferReqH req, unsigned long long len,
                                             long long *out) {
  const unsigned t = threadIdx.x, n = blockDim.x;
  const unsigned long long share = ((len + n - 1) / n + 15) & ~15ull;
  const unsigned long long begin = (unsigned long long)t * share;
  nixl_status_t st = NIXL_SUCCESS;
  if (begin < len) {
    const unsigned long long size = len - begin < share ? len - begin : share;
    st = nixlGpuPostSingleWriteXferReq<nixl_gpu_level_t::THREAD>(req, begin, begin, 0, size, 0,
                                                                 true);
  }
  out[1 + t] = st;
  __syncthreads();
  if (t == 0) out[0] = nixlGpuPostSignalXferReq<nixl_gpu_level_t::THREAD>(req, 0, 1, 1, 0, true);
}

__device__ long long wait_status(nixl_status_t posted, nixlGpuXferStatusH &xs) {
  if (posted != NIXL_SUCCESS) return posted;
  nixl_status_t s;
  while ((s = nixlGpuGetXferStatus<nixl_gpu_level_t::THREAD>(xs)) == NIXL_IN_PROG) {
  }
  return s;
}

extern "C" __global__ void put_then_add(nixlMemViewH src, nixlMemViewH dst, unsigned long long len,
                                        unsigned long long value, long long *out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  nixlGpuXferStatusH xs{};
  out[0] = wait_status(nixlPut<nixl_gpu_level_t::THREAD>(nixlMemViewElem{src, 0, 0},
                                                         nixlMemViewElem{dst, 0, 0}, len, 0, 0,
                                                         &xs),
                       xs);
  out[1] = wait_status(
      nixlAtomicAdd<nixl_gpu_level_t::THREAD>(value, nixlMemViewElem{dst, 1, 0}, 0, 0, &xs), xs);
  /* Refusals: past the element's end; source and destination swapped. */
  out[2] = nixlPut<nixl_gpu_level_t::THREAD>(nixlMemViewElem{src, 0, 8},
                                             nixlMemViewElem{dst, 0, 0}, len);
  out[3] = nixlPut<nixl_gpu_level_t::THREAD>(nixlMemViewElem{dst, 0, 0},
                                             nixlMemViewElem{src, 0, 0}, 8);
  out[4] = (long long)nixlGetPtr(src, 0);
  out[5] = (long long)nixlGetPtr(dst, 0);
  out[6] = (long long)nixlGetPtr(dst, 99);
}

extern "C" __global__ void probe_stale(nixlGpuXferReqH req, nixlMemViewH view, long long *out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  out[0] = nixlGpuPostSingleWriteXferReq<nixl_gpu_level_t::THREAD>(req, 0, 0, 0, 8, 0, true);
  out[1] = nixlAtomicAdd<nixl_gpu_level_t::THREAD>(1, nixlMemViewElem{view, 0, 0});
  out[2] = (long long)nixlGetPtr(view, 0);
}
"""

KERNELS = ("write_then_signal", "put_then_add", "probe_stale")


def _nvrtc_candidates():
    yield "libnvrtc.so.13"
    yield "libnvrtc.so.12"
    yield "libnvrtc.so"
    here = os.path.dirname(os.path.abspath(__file__))
    # `cargo xtask nvrtc` puts NVRTC under target/nvrtc of the repository.
    for root in (os.path.join(here, "..", ".."), os.path.join(here, "..")):
        yield from sorted(glob.glob(os.path.join(root, "target/nvrtc/*/nvidia/cu*/lib/libnvrtc.so.*")))


def load_nvrtc():
    """NVRTC as a ctypes library, or None."""
    for name in _nvrtc_candidates():
        try:
            if os.path.isabs(name):
                # NVRTC dlopens its builtins by soname: load them first from its folder.
                for builtins in glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so.*")):
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def nvrtc_compile(lib, source: str, name: str, options) -> str:
    """PTX of ``source``; raises RuntimeError with NVRTC's log on failure."""
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(
        ctypes.byref(prog), source.encode(), name.encode(), 0, None, None
    )
    if r != 0:
        raise RuntimeError(f"nvrtcCreateProgram: {r}")
    try:
        opts = [o.encode() for o in options]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        r = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if r != 0:
            raise RuntimeError(f"NVRTC failed ({r}) with {list(options)}:\n{log.value.decode()}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
