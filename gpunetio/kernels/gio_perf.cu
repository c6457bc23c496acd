// Kernels of the gpunetio-put-bw and gpunetio-write-lat tools.
#include "gpunetio/gio_device.cuh"

using gio::u64;

__device__ __forceinline__ void record(int *status, int st) {
  if (st != GIO_OK) atomicCAS(status, GIO_OK, st);
}

// Every worker (a thread in THREAD scope, a warp in WARP scope; at most window / size of
// them) puts one message of `size` bytes per iteration; message m lands at
// (m * size) % window on both sides. After quiet, every worker adds 1 to the peer's
// signal word (the server expects `workers`). Block b posts on queue pair b % nqp (as
// ib_write_bw -q spreads its work over queue pairs); the memory table indices are the
// same in every queue pair.
template <gio::scope Sc>
__device__ void put_bw(gio_dev_qp *const *qps, uint32_t nqp, uint32_t remote_mr,
                       uint32_t local_mr, u64 size, u64 iters, u64 window, uint32_t signal_mr,
                       int *status) {
  gio_dev_qp *qp = qps[blockIdx.x % nqp];
  const u64 threads = (u64)gridDim.x * blockDim.x;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 workers = Sc == gio::scope::warp ? threads / 32 : threads;
  const u64 me = Sc == gio::scope::warp ? tid / 32 : tid;
  // Messages in flight at once must be distinct memory (else the same bytes are read and
  // written from cache by many workers): at most window / size workers put.
  const u64 per_window = window / size;
  const u64 active = workers < per_window ? workers : per_window;
  if (me < active) {
    for (u64 i = 0; i < iters; i++) {
      const u64 off = ((i * active + me) % per_window) * size;
      record(status, gio::put<Sc>(qp, remote_mr, off, local_mr, off, size));
    }
  }
  record(status, gio::quiet(qp));
  record(status, gio::signal<Sc>(qp, signal_mr, 0, 1));
  record(status, gio::quiet(qp));
}

extern "C" __global__ void gio_perf_put_bw_thread(gio_dev_qp *const *qps, uint32_t nqp,
                                                  uint32_t remote_mr, uint32_t local_mr, u64 size,
                                                  u64 iters, u64 window, uint32_t signal_mr,
                                                  int *status) {
  put_bw<gio::scope::thread>(qps, nqp, remote_mr, local_mr, size, iters, window, signal_mr,
                             status);
}

extern "C" __global__ void gio_perf_put_bw_warp(gio_dev_qp *const *qps, uint32_t nqp,
                                                uint32_t remote_mr, uint32_t local_mr, u64 size,
                                                u64 iters, u64 window, uint32_t signal_mr,
                                                int *status) {
  put_bw<gio::scope::warp>(qps, nqp, remote_mr, local_mr, size, iters, window, signal_mr, status);
}

// Ping-pong, one warp of each side (WARP scope above 512 B: the lanes copy together;
// lane 0 alone below): the initiator
// puts `size` bytes with a signal and waits for the answer on its own signal word; the
// responder waits, then answers the same way. The initiator records each round trip's
// nanoseconds in `rtt_ns[i]`.
extern "C" __global__ void gio_perf_write_lat(gio_dev_qp *qp, uint32_t remote_mr,
                                              uint32_t local_mr, uint32_t remote_signal_mr,
                                              const u64 *my_signal, u64 size, u64 iters,
                                              int initiator, u64 *rtt_ns, int *status) {
  if (blockIdx.x != 0 || threadIdx.x >= 32) return;
  if (size <= 512) {
    // Small messages: lane 0 alone in THREAD scope, no warp barrier in the loop.
    if (threadIdx.x != 0) return;
    for (u64 i = 1; i <= iters; i++) {
      const u64 start = gio::now_ns();
      if (!initiator) record(status, gio::signal_wait_ge(qp, my_signal, i));
      record(status, gio::put_signal<gio::scope::thread, gio::sharing::exclusive>(
                         qp, remote_mr, 0, local_mr, 0, size, remote_signal_mr, 0, 1));
      if (initiator) {
        record(status, gio::signal_wait_ge(qp, my_signal, i));
        rtt_ns[i - 1] = gio::now_ns() - start;
      }
      if (*(volatile int *)status != GIO_OK) break;
    }
    return;
  }
  const bool lead = threadIdx.x == 0;
  for (u64 i = 1; i <= iters; i++) {
    const u64 start = gio::now_ns();
    if (!initiator) {
      if (lead) record(status, gio::signal_wait_ge(qp, my_signal, i));
      __syncwarp();
    }
    record(status, gio::put_signal<gio::scope::warp, gio::sharing::exclusive>(
                       qp, remote_mr, 0, local_mr, 0, size, remote_signal_mr, 0, 1));
    if (initiator) {
      if (lead) {
        record(status, gio::signal_wait_ge(qp, my_signal, i));
        rtt_ns[i - 1] = gio::now_ns() - start;
      }
      __syncwarp();
    }
    if (__shfl_sync(0xffffffffu, *(volatile int *)status, 0) != GIO_OK) break;
  }
}

// CPU proxy round trip: thread 0 posts and waits (gio::wait) until the proxy reports the
// post complete, `iters` times; `rtt_ns[i]` gets each round trip, `post_ns[i]` (if not
// null) the part until the post was published. `kind`:
//   0 a NOP prepared in its ring slot and published with a release store (low level, in
//     place)
//   1 a NOP built in an image and published without a fence (low level, image)
//   2 gio::p of 8 bytes (high level: through the transport to the peer)
//   3 gio::put of 8 bytes from local region 0 to remote region `remote_mr` (high level:
//     GPU-scope fence for device memory, then through the transport)
__device__ void proxy_rtt(gio_dev_qp *qp, u64 iters, u64 *rtt_ns, u64 *post_ns, int *status,
                          unsigned kind, uint32_t remote_mr) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (u64 i = 0; i < iters; i++) {
    const u64 start = gio::now_ns();
    u64 t = 0;
    int st = GIO_OK;
    if (kind <= 1) {
      gio_ring_dev_state *const state = GIO_RO(qp->state);
      const u64 first_poll = GIO_RO(qp->first_poll_ns);
      const u64 consumed = gio::cached_consumed<gio::sharing::exclusive>(qp);
      t = gio::reserve_slots<gio::sharing::exclusive>(qp, 1);
      gio_ring_entry *e = gio::entry_slot<gio::sharing::exclusive>(qp, t, consumed, &st);
      if (!e) {
        record(status, st);
        return;
      }
      if (kind == 0) {
        gio::prepare_nop(e);
        gio::mark_ready(e, t);
        gio::submit(qp, t + 1);
      } else {
        gio::entry_image img;
        gio::prepare_nop(&img.e);
        gio::mark_ready(qp, e, img, t);
        gio::stamp_post(state, first_poll);  // submit() with the fields read up front
      }
    } else if (kind == 2) {
      st = gio::p<u64, gio::scope::thread, gio::sharing::exclusive>(qp, remote_mr, 0, i, &t);
    } else {
      st = gio::put<gio::scope::thread, gio::sharing::exclusive>(qp, remote_mr, 0, 0, 0, 8, &t);
    }
    const u64 posted = gio::now_ns();
    if (st == GIO_OK) st = gio::wait(qp, t);
    rtt_ns[i] = gio::now_ns() - start;
    if (post_ns) post_ns[i] = posted - start;
    if (st != GIO_OK) {
      record(status, st);
      return;
    }
  }
}

extern "C" __global__ void gio_perf_proxy_rtt_ext(gio_dev_qp *qp, u64 iters, u64 *rtt_ns,
                                                  u64 *post_ns, int *status, unsigned kind,
                                                  uint32_t remote_mr) {
  proxy_rtt(qp, iters, rtt_ns, post_ns, status, kind, remote_mr);
}

// proxy_rtt of an image-published NOP (kind 1).
extern "C" __global__ void gio_perf_proxy_rtt(gio_dev_qp *qp, u64 iters, u64 *rtt_ns, int *status) {
  proxy_rtt(qp, iters, rtt_ns, 0, status, 1, 0);
}
