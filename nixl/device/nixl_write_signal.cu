/*
 * Kernels of the write-and-signal example (nixl/examples/write_signal.rs) and of the
 * device-API tests: the initiator writes round r's slice of its buffer to the target and
 * then adds 1 to the target's signal word; the target's kernel waits for the signal of
 * each round and checks that round's slice.
 *
 * Request layout: descriptor 0 is the data (rounds * slice bytes), descriptor 1 the
 * target's 8-byte signal word. Byte i of slice r is pattern(r, i, seed).
 */
#include "nixl/nixl_device.cuh"

__device__ __forceinline__ unsigned char pattern(unsigned r, unsigned long long i, unsigned seed) {
  return (unsigned char)((i * 131u + r * 7u + seed) ^ (i >> 9));
}

extern "C" __global__ void fill_pattern(unsigned char *data, unsigned long long slice,
                                        unsigned rounds, unsigned seed) {
  const unsigned long long n = slice * rounds;
  for (unsigned long long k = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; k < n;
       k += (unsigned long long)gridDim.x * blockDim.x)
    data[k] = pattern((unsigned)(k / slice), k % slice, seed);
}

__device__ __forceinline__ void fail(int *status, int st) {
  if (st != NIXL_SUCCESS) atomicCAS_system(status, NIXL_SUCCESS, st);
}

/* THREAD level: each thread writes its share of the slice (waiting for its delivery),
 * the block synchronizes, thread 0 signals. */
extern "C" __global__ void write_signal_thread(nixlGpuXferReqH req, unsigned long long slice,
                                               unsigned rounds, int *status) {
  const unsigned t = threadIdx.x, n = blockDim.x;
  const unsigned long long share = ((slice + n - 1) / n + 15) & ~15ull;
  for (unsigned r = 0; r < rounds; r++) {
    const unsigned long long begin = (unsigned long long)t * share;
    if (begin < slice) {
      const unsigned long long len = slice - begin < share ? slice - begin : share;
      const unsigned long long off = (unsigned long long)r * slice + begin;
      fail(status, nixlGpuPostSingleWriteXferReq<nixl_gpu_level_t::THREAD>(req, off, off, 0, len, 0,
                                                                            true));
    }
    __syncthreads();
    if (t == 0)
      fail(status,
           nixlGpuPostSignalXferReq<nixl_gpu_level_t::THREAD>(req, 0, 1, 1, 0, true));
    __syncthreads();
  }
}

/* WARP level: each warp writes its share with all 32 lanes, then warp 0 signals. */
extern "C" __global__ void write_signal_warp(nixlGpuXferReqH req, unsigned long long slice,
                                             unsigned rounds, int *status) {
  const unsigned warps = blockDim.x / 32, w = threadIdx.x / 32;
  const unsigned long long share = ((slice + warps - 1) / warps + 15) & ~15ull;
  for (unsigned r = 0; r < rounds; r++) {
    const unsigned long long begin = (unsigned long long)w * share;
    if (begin < slice) {
      const unsigned long long len = slice - begin < share ? slice - begin : share;
      const unsigned long long off = (unsigned long long)r * slice + begin;
      const nixl_status_t st =
          nixlGpuPostSingleWriteXferReq<nixl_gpu_level_t::WARP>(req, off, off, 0, len, 0, true);
      if (gio::lane_id() == 0) fail(status, st);
    }
    __syncthreads();
    if (w == 0) {
      const nixl_status_t st =
          nixlGpuPostSignalXferReq<nixl_gpu_level_t::WARP>(req, 0, 1, 1, 0, true);
      if (gio::lane_id() == 0) fail(status, st);
    }
    __syncthreads();
  }
}

/* BLOCK level: the whole block writes the slice and signals. */
extern "C" __global__ void write_signal_block(nixlGpuXferReqH req, unsigned long long slice,
                                              unsigned rounds, int *status) {
  for (unsigned r = 0; r < rounds; r++) {
    const unsigned long long off = (unsigned long long)r * slice;
    nixl_status_t st =
        nixlGpuPostSingleWriteXferReq<nixl_gpu_level_t::BLOCK>(req, off, off, 0, slice, 0, true);
    if (threadIdx.x == 0) fail(status, st);
    st = nixlGpuPostSignalXferReq<nixl_gpu_level_t::BLOCK>(req, 0, 1, 1, 0, true);
    if (threadIdx.x == 0) fail(status, st);
  }
}

/* Memory-view form, any transport: each warp puts its share of slice r from element 0 of
 * the local view to element 0 of the remote view, polls its status until the put
 * completed (bounded by `timeout_ns`), then thread 0 adds 1 to the remote view's element
 * 1 (the signal word). */
extern "C" __global__ void view_put_signal(nixlMemViewH local, nixlMemViewH remote,
                                           unsigned long long slice, unsigned rounds,
                                           unsigned long long timeout_ns, int *status) {
  const unsigned warps = blockDim.x / 32, w = threadIdx.x / 32;
  const unsigned long long share = ((slice + warps - 1) / warps + 15) & ~15ull;
  for (unsigned r = 0; r < rounds; r++) {
    const unsigned long long begin = (unsigned long long)w * share;
    if (begin < slice) {
      const unsigned long long len = slice - begin < share ? slice - begin : share;
      const unsigned long long off = (unsigned long long)r * slice + begin;
      nixlGpuXferStatusH xs{};
      nixl_status_t st = nixlPut<nixl_gpu_level_t::WARP>(nixlMemViewElem{local, 0, off},
                                                         nixlMemViewElem{remote, 0, off}, len, 0,
                                                         0, &xs);
      if (st == NIXL_SUCCESS && gio::lane_id() == 0) {
        const unsigned long long start = gio::now_ns();
        while ((st = nixlGpuGetXferStatus(xs)) == NIXL_IN_PROG) {
          if (gio::now_ns() - start > timeout_ns) {
            st = NIXL_ERR_BACKEND;
            break;
          }
        }
      }
      if (gio::lane_id() == 0) fail(status, st);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      nixlGpuXferStatusH xs{};
      nixl_status_t st =
          nixlAtomicAdd<nixl_gpu_level_t::THREAD>(1, nixlMemViewElem{remote, 1, 0}, 0, 0, &xs);
      const unsigned long long start = gio::now_ns();
      if (st == NIXL_SUCCESS) {
        while ((st = nixlGpuGetXferStatus(xs)) == NIXL_IN_PROG) {
          if (gio::now_ns() - start > timeout_ns) {
            st = NIXL_ERR_BACKEND;
            break;
          }
        }
      }
      fail(status, st);
    }
    __syncthreads();
  }
}

/* The target: for each round, wait (bounded by `timeout_ns`) until the signal reached
 * r + 1, then count the slice's wrong bytes into bad[0]; bad[1] gets the rounds seen. */
extern "C" __global__ void wait_and_check(const unsigned long long *signal,
                                          const unsigned char *data, unsigned long long slice,
                                          unsigned rounds, unsigned seed,
                                          unsigned long long timeout_ns,
                                          unsigned long long *bad) {
  __shared__ int timed_out;
  for (unsigned r = 0; r < rounds; r++) {
    if (threadIdx.x == 0) {
      timed_out = 0;
      const unsigned long long start = gio::now_ns();
      while (nixlGpuReadSignal<nixl_gpu_level_t::THREAD>(signal) < r + 1ull) {
        if (gio::now_ns() - start > timeout_ns) {
          timed_out = 1;
          break;
        }
      }
    }
    __syncthreads();
    if (timed_out) return;
    unsigned long long wrong = 0;
    for (unsigned long long i = threadIdx.x; i < slice; i += blockDim.x)
      wrong += data[(unsigned long long)r * slice + i] != pattern(r, i, seed);
    if (wrong) atomicAdd(&bad[0], wrong);
    __syncthreads();
    if (threadIdx.x == 0) bad[1] = r + 1;
  }
}

/* Device-API checks one thread runs on a request and a pair of views; each result goes
 * to out[k] (a nixl_status_t, or a pointer for nixlGetPtr). */
extern "C" __global__ void device_api_probe(nixlGpuXferReqH req, nixlGpuXferReqH stale,
                                            nixlMemViewH local, nixlMemViewH remote,
                                            unsigned long long desc_len, long long *out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  /* 0: a write inside descriptor 0. */
  out[0] = nixlGpuPostSingleWriteXferReq(req, 0, 0, 0, 64, 0, true);
  /* 1: an offset past the descriptor. */
  out[1] = nixlGpuPostSingleWriteXferReq(req, desc_len, 0, 0, 64, 0, true);
  /* 2: a size that runs past it. */
  out[2] = nixlGpuPostSingleWriteXferReq(req, desc_len - 8, 0, 0, 64, 0, true);
  /* 3: a descriptor index out of range. */
  out[3] = nixlGpuPostSingleWriteXferReq(req, 0, 0, 7, 64, 0, true);
  /* 4: a released request's handle. */
  out[4] = nixlGpuPostSingleWriteXferReq(stale, 0, 0, 0, 64, 0, true);
  /* 5: a signal at an unaligned offset. */
  out[5] = nixlGpuPostSignalXferReq(req, 3, 1, 1, 0, true);
  /* 6: memory-view put of 128 bytes at offset 64, local element 0 -> remote element 0,
   * with a status polled until done. */
  nixlGpuXferStatusH st{};
  out[6] = nixlPut(nixlMemViewElem{local, 0, 64}, nixlMemViewElem{remote, 0, 64}, 128, 0, 0, &st);
  if (out[6] == NIXL_SUCCESS) {
    nixl_status_t s;
    while ((s = nixlGpuGetXferStatus(st)) == NIXL_IN_PROG) {
    }
    out[7] = s;
  }
  /* 8: atomic add of 5 to remote element 1. */
  out[8] = nixlAtomicAdd(5, nixlMemViewElem{remote, 1, 0}, 0, 0, &st);
  if (out[8] == NIXL_SUCCESS) {
    nixl_status_t s;
    while ((s = nixlGpuGetXferStatus(st)) == NIXL_IN_PROG) {
    }
    out[9] = s;
  }
  /* 10, 11: direct pointers of the remote element 0 and of a bad index. */
  out[10] = (long long)nixlGetPtr(remote, 0);
  out[11] = (long long)nixlGetPtr(remote, 99);
  /* 12: a view element past its end; 13: source and destination views swapped. */
  out[12] = nixlPut(nixlMemViewElem{local, 0, desc_len}, nixlMemViewElem{remote, 0, 0}, 8);
  out[13] = nixlPut(nixlMemViewElem{remote, 0, 0}, nixlMemViewElem{local, 0, 0}, 8);
}

/* ---- benchmark kernels (nixl/examples/device_api_bench.rs) ------------------------------ */

/* The request's queue pair and descriptor `i`: what the raw gpunetio variants below post
 * on, loaded once before their loop (as a kernel written against gio alone would hold its
 * queue pair and region indices), for a side-by-side comparison with the device API. */
__device__ __forceinline__ gio_dev_qp *raw_qp(nixlGpuXferReqH req) { return req.qp; }
__device__ __forceinline__ nixl_gpu_desc raw_desc(nixlGpuXferReqH req, unsigned i) {
  return req.descs[i];
}

/* raw: 0 = the device API (a write, then a signal), 1 = gio's fused put_signal, 2 = gio's
 * put then gio's signal (the two operations the API issues). */
/* `iters` times: put `size` bytes (descriptor 0, at offset 0) at `level`, then signal
 * (descriptor 1); `raw` does the same with gio calls on the request's queue pair. One
 * block; the host times the kernel. */
extern "C" __global__ void bench_put_signal(nixlGpuXferReqH req, unsigned long long size,
                                            unsigned iters, unsigned level, unsigned raw,
                                            int *status) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  gio_dev_qp *qp = raw_qp(req);
  const nixl_gpu_desc d = raw_desc(req, 0), s = raw_desc(req, 1);
  for (unsigned i = 0; i < iters; i++) {
    int st = NIXL_SUCCESS;
    if (level == 0) {
      /* THREAD: thread 0 alone. */
      if (threadIdx.x == 0) {
        if (raw == 1) {
          st = gio::put_signal<gio::scope::thread, gio::sharing::gpu>(
              qp, d.remote_mr, 0, d.local_mr, 0, size, s.remote_mr, 0, 1);
          st = nixl_detail::from_gio(st);
        } else if (raw == 2) {
          st = gio::put<gio::scope::thread, gio::sharing::gpu>(qp, d.remote_mr, 0,
                                                               d.local_mr, 0, size, 0);
          if (st == GIO_OK)
            st = gio::signal<gio::scope::thread, gio::sharing::gpu>(qp, s.remote_mr, 0, 1);
          st = nixl_detail::from_gio(st);
        } else {
          st = nixlGpuPostSingleWriteXferReq<nixl_gpu_level_t::THREAD>(req, 0, 0, 0, size);
          if (st == NIXL_SUCCESS)
            st = nixlGpuPostSignalXferReq<nixl_gpu_level_t::THREAD>(req, 0, 1, 1);
        }
      }
    } else if (warp == 0) {
      /* WARP: warp 0's lanes together. */
      if (raw == 1) {
        st = nixl_detail::from_gio(gio::put_signal<gio::scope::warp, gio::sharing::gpu>(
            qp, d.remote_mr, 0, d.local_mr, 0, size, s.remote_mr, 0, 1));
      } else if (raw == 2) {
        st = gio::put<gio::scope::warp, gio::sharing::gpu>(qp, d.remote_mr, 0, d.local_mr,
                                                           0, size, 0);
        if (st == GIO_OK)
          st = gio::signal<gio::scope::warp, gio::sharing::gpu>(qp, s.remote_mr, 0, 1);
        st = nixl_detail::from_gio(st);
      } else {
        st = nixlGpuPostSingleWriteXferReq<nixl_gpu_level_t::WARP>(req, 0, 0, 0, size);
        if (st == NIXL_SUCCESS) st = nixlGpuPostSignalXferReq<nixl_gpu_level_t::WARP>(req, 0, 1, 1);
      }
    }
    if (st != NIXL_SUCCESS && lane == 0) atomicCAS_system(status, NIXL_SUCCESS, st);
  }
}

/* Signal ping-pong between two kernels of this process through two requests (each
 * request's descriptor 1 is the other side's signal word): `ping` signals then waits for
 * the answer, `pong` waits then answers. ping writes the total time (ns) to *ns. */
extern "C" __global__ void bench_ping(nixlGpuXferReqH req, const unsigned long long *mine,
                                      unsigned iters, unsigned raw, unsigned long long timeout_ns,
                                      unsigned long long *ns, int *status) {
  if (threadIdx.x != 0) return;
  gio_dev_qp *qp = raw_qp(req);
  const unsigned signal_mr = raw_desc(req, 1).remote_mr;
  const unsigned long long start = gio::now_ns();
  for (unsigned i = 0; i < iters; i++) {
    int st;
    if (raw)
      st = nixl_detail::from_gio(gio::signal<gio::scope::thread, gio::sharing::gpu>(
          qp, signal_mr, 0, 1));
    else
      st = nixlGpuPostSignalXferReq<nixl_gpu_level_t::THREAD>(req, 0, 1, 1);
    if (st != NIXL_SUCCESS) {
      atomicCAS_system(status, NIXL_SUCCESS, st);
      return;
    }
    const unsigned long long t0 = gio::now_ns();
    while (nixlGpuReadSignal(mine) < i + 1ull) {
      if (gio::now_ns() - t0 > timeout_ns) {
        atomicCAS_system(status, NIXL_SUCCESS, NIXL_ERR_BACKEND);
        return;
      }
    }
  }
  *ns = gio::now_ns() - start;
}

extern "C" __global__ void bench_pong(nixlGpuXferReqH req, const unsigned long long *mine,
                                      unsigned iters, unsigned raw, unsigned long long timeout_ns,
                                      int *status) {
  if (threadIdx.x != 0) return;
  gio_dev_qp *qp = raw_qp(req);
  const unsigned signal_mr = raw_desc(req, 1).remote_mr;
  for (unsigned i = 0; i < iters; i++) {
    const unsigned long long t0 = gio::now_ns();
    while (nixlGpuReadSignal(mine) < i + 1ull) {
      if (gio::now_ns() - t0 > timeout_ns) {
        atomicCAS_system(status, NIXL_SUCCESS, NIXL_ERR_BACKEND);
        return;
      }
    }
    int st;
    if (raw)
      st = nixl_detail::from_gio(gio::signal<gio::scope::thread, gio::sharing::gpu>(
          qp, signal_mr, 0, 1));
    else
      st = nixlGpuPostSignalXferReq<nixl_gpu_level_t::THREAD>(req, 0, 1, 1);
    if (st != NIXL_SUCCESS) {
      atomicCAS_system(status, NIXL_SUCCESS, st);
      return;
    }
  }
}
