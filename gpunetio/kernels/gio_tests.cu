// Kernels of gpunetio's own tests and tools: the device library in every execution
// scope and sharing mode, and the ABI layout read on the GPU.
#include "gpunetio/gio_device.cuh"

using gio::u64;

__device__ __forceinline__ void record(int *status, int st) {
  if (st != GIO_OK) atomicCAS(status, GIO_OK, st);
}

template <typename T, typename F> __device__ u64 field_offset(const T &object, const F &field) {
  return (u64)((const char *)&field - (const char *)&object);
}

// sizeof/offsetof in the order of gpunetio_sys::LAYOUT (NVRTC has no constant offsetof:
// offsets are measured on objects).
extern "C" __global__ void gio_layout(u64 *out, int *count) {
  gio_ring_entry gio_ring_entry_;
  gio_ring_ctrl gio_ring_ctrl_;
  gio_ring_dev_state gio_ring_dev_state_;
  gio_dev_mr gio_dev_mr_;
  gio_dev_qp gio_dev_qp_;
#define GIO_FIELD(s, f) field_offset(s##_, s##_.f)
  const u64 v[] = {
      sizeof(gio_ring_entry), GIO_FIELD(gio_ring_entry, seq), GIO_FIELD(gio_ring_entry, opcode),
      GIO_FIELD(gio_ring_entry, flags), GIO_FIELD(gio_ring_entry, local_mr),
      GIO_FIELD(gio_ring_entry, remote_mr), GIO_FIELD(gio_ring_entry, signal_mr),
      GIO_FIELD(gio_ring_entry, local_off), GIO_FIELD(gio_ring_entry, remote_off),
      GIO_FIELD(gio_ring_entry, length), GIO_FIELD(gio_ring_entry, signal_off),
      GIO_FIELD(gio_ring_entry, signal_add), GIO_FIELD(gio_ring_entry, counter),
      sizeof(gio_ring_ctrl), GIO_FIELD(gio_ring_ctrl, consumed), GIO_FIELD(gio_ring_ctrl, completed),
      GIO_FIELD(gio_ring_ctrl, error), GIO_FIELD(gio_ring_ctrl, shutdown),
      GIO_FIELD(gio_ring_ctrl, error_ticket),
      sizeof(gio_ring_dev_state), GIO_FIELD(gio_ring_dev_state, reserved),
      GIO_FIELD(gio_ring_dev_state, cached_consumed), GIO_FIELD(gio_ring_dev_state, level),
      GIO_FIELD(gio_ring_dev_state, last_post_ns),
      sizeof(gio_dev_mr), GIO_FIELD(gio_dev_mr, addr), GIO_FIELD(gio_dev_mr, length),
      GIO_FIELD(gio_dev_mr, flags), GIO_FIELD(gio_dev_mr, index),
      sizeof(gio_dev_qp), GIO_FIELD(gio_dev_qp, abi_version), GIO_FIELD(gio_dev_qp, nic_handler),
      GIO_FIELD(gio_dev_qp, ring_size), GIO_FIELD(gio_dev_qp, num_mrs), GIO_FIELD(gio_dev_qp, ring),
      GIO_FIELD(gio_dev_qp, ctrl), GIO_FIELD(gio_dev_qp, state), GIO_FIELD(gio_dev_qp, mrs),
      GIO_FIELD(gio_dev_qp, counters), GIO_FIELD(gio_dev_qp, num_counters),
      GIO_FIELD(gio_dev_qp, timeout_ns), GIO_FIELD(gio_dev_qp, mlx5),
      GIO_FIELD(gio_dev_qp, first_poll_ns),
  };
  const int n = sizeof(v) / sizeof(v[0]);
  for (int i = 0; i < n; i++) out[i] = v[i];
  *count = n;
}

// Each thread (THREAD scope) or warp (WARP scope) puts blocks `b` of `blocks` (block
// bytes each, same offset on both sides), `signal_add` added to the peer's signal word
// after each block (0: plain put), then waits for everything to complete.
template <gio::scope Sc, gio::sharing S>
__device__ void put_blocks(gio_dev_qp *qp, uint32_t remote_mr, uint32_t local_mr, u64 block,
                           u64 blocks, uint32_t signal_mr, u64 signal_off, u64 signal_add,
                           int *status, bool single = false) {
  const u64 threads = (u64)gridDim.x * blockDim.x;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 workers = single ? 1 : Sc == gio::scope::warp ? threads / 32 : threads;
  const u64 me = single ? 0 : Sc == gio::scope::warp ? tid / 32 : tid;
  for (u64 b = me; b < blocks; b += workers) {
    int st = signal_add ? gio::put_signal<Sc, S>(qp, remote_mr, b * block, local_mr, b * block,
                                                 block, signal_mr, signal_off, signal_add)
                        : gio::put<Sc, S>(qp, remote_mr, b * block, local_mr, b * block, block);
    record(status, st);
  }
  record(status, gio::quiet(qp));
}

extern "C" __global__ void gio_put_thread(gio_dev_qp *qp, uint32_t remote_mr, uint32_t local_mr,
                                          u64 block, u64 blocks, uint32_t signal_mr,
                                          u64 signal_off, u64 signal_add, int *status) {
  put_blocks<gio::scope::thread, gio::sharing::gpu>(qp, remote_mr, local_mr, block, blocks,
                                                    signal_mr, signal_off, signal_add, status);
}

extern "C" __global__ void gio_put_warp(gio_dev_qp *qp, uint32_t remote_mr, uint32_t local_mr,
                                        u64 block, u64 blocks, uint32_t signal_mr, u64 signal_off,
                                        u64 signal_add, int *status) {
  put_blocks<gio::scope::warp, gio::sharing::gpu>(qp, remote_mr, local_mr, block, blocks,
                                                  signal_mr, signal_off, signal_add, status);
}

extern "C" __global__ void gio_put_thread_cta(gio_dev_qp *qp, uint32_t remote_mr,
                                              uint32_t local_mr, u64 block, u64 blocks,
                                              uint32_t signal_mr, u64 signal_off, u64 signal_add,
                                              int *status) {
  put_blocks<gio::scope::thread, gio::sharing::cta>(qp, remote_mr, local_mr, block, blocks,
                                                    signal_mr, signal_off, signal_add, status);
}

extern "C" __global__ void gio_put_exclusive(gio_dev_qp *qp, uint32_t remote_mr,
                                             uint32_t local_mr, u64 block, u64 blocks,
                                             uint32_t signal_mr, u64 signal_off, u64 signal_add,
                                             int *status) {
  if (blockIdx.x == 0 && threadIdx.x == 0)
    put_blocks<gio::scope::thread, gio::sharing::exclusive>(qp, remote_mr, local_mr, block,
                                                            blocks, signal_mr, signal_off,
                                                            signal_add, status, true);
}

// Gets blocks of the peer into local memory (THREAD or WARP scope), then quiet.
template <gio::scope Sc>
__device__ void get_blocks(gio_dev_qp *qp, uint32_t local_mr, uint32_t remote_mr, u64 block,
                           u64 blocks, int *status) {
  const u64 threads = (u64)gridDim.x * blockDim.x;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 workers = Sc == gio::scope::warp ? threads / 32 : threads;
  const u64 me = Sc == gio::scope::warp ? tid / 32 : tid;
  for (u64 b = me; b < blocks; b += workers)
    record(status, gio::get<Sc>(qp, local_mr, b * block, remote_mr, b * block, block));
  record(status, gio::quiet(qp));
}

extern "C" __global__ void gio_get_thread(gio_dev_qp *qp, uint32_t local_mr, uint32_t remote_mr,
                                          u64 block, u64 blocks, int *status) {
  get_blocks<gio::scope::thread>(qp, local_mr, remote_mr, block, blocks, status);
}

extern "C" __global__ void gio_get_warp(gio_dev_qp *qp, uint32_t local_mr, uint32_t remote_mr,
                                        u64 block, u64 blocks, int *status) {
  get_blocks<gio::scope::warp>(qp, local_mr, remote_mr, block, blocks, status);
}

// Thread i writes the 8-byte value base + i at remote offset 8 i; then thread 0 fences
// and signals once (ordered after the values of its own block; the test reads the values
// after the kernel).
extern "C" __global__ void gio_p_signal(gio_dev_qp *qp, uint32_t remote_mr, u64 base, u64 count,
                                        uint32_t signal_mr, u64 signal_off, int *status) {
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid < count) record(status, gio::p<u64>(qp, remote_mr, 8 * tid, base + tid));
  record(status, gio::quiet(qp));
  __syncthreads();
  if (tid == 0) {
    record(status, gio::fence(qp));
    record(status, gio::signal(qp, signal_mr, signal_off, 1));
    record(status, gio::quiet(qp));
  }
}

// Waits until the local word reaches `value`; reports how long it took.
extern "C" __global__ void gio_signal_wait(gio_dev_qp *qp, const u64 *word, u64 value,
                                           u64 *waited_ns, int *status) {
  const u64 start = gio::now_ns();
  record(status, gio::signal_wait_ge(qp, word, value));
  *waited_ns = gio::now_ns() - start;
}

// The low-level API: one thread reserves `n` slots, prepares puts of `block` bytes, marks
// them ready, submits, polls the last one.
extern "C" __global__ void gio_low_level_puts(gio_dev_qp *qp, uint32_t remote_mr,
                                              uint32_t local_mr, u64 block, uint32_t n,
                                              int *status) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const u64 first = gio::reserve_slots<gio::sharing::gpu>(qp, n);
  for (uint32_t i = 0; i < n; i++) {
    int st = GIO_OK;
    gio_ring_entry *e = gio::entry_ptr<gio::sharing::gpu>(qp, first + i, &st);
    if (!e) {
      record(status, st);
      return;
    }
    gio::prepare_put(e, remote_mr, i * block, local_mr, i * block, block);
    gio::mark_ready(e, first + i);
  }
  gio::submit(qp, first + n);
  const u64 start = gio::now_ns();
  int st;
  while ((st = gio::poll_completion(qp, first + n - 1)) == 1) {
    if (gio::timed_out(qp, start)) {
      st = GIO_ERR_TIMEOUT;
      break;
    }
  }
  record(status, st);
}

// Bandwidth: every warp of the grid puts its slice of each of `iters` messages of `size`
// bytes (WARP scope), message i at offset (i * size) % window on both sides (a window
// larger than L2 keeps the messages in memory, not in cache), then waits for completion.
extern "C" __global__ void gio_put_bw_warp(gio_dev_qp *qp, uint32_t remote_mr, uint32_t local_mr,
                                           u64 size, u64 iters, u64 window, int *status) {
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 warps = (u64)gridDim.x * blockDim.x / 32;
  const u64 w = tid / 32;
  u64 slice = (size + warps - 1) / warps;
  slice = (slice + 15) & ~(u64)15;
  const u64 off = w * slice;
  if (off >= size) return;
  const u64 len = size - off < slice ? size - off : slice;
  const u64 per_window = window / size;
  for (u64 i = 0; i < iters; i++) {
    const u64 base = (i % per_window) * size + off;
    record(status, gio::put<gio::scope::warp>(qp, remote_mr, base, local_mr, base, len));
  }
  record(status, gio::quiet(qp));
}

// Latency: thread 0 of each side. The initiator puts 8 bytes with a signal and waits for
// the answer on its own signal word; the responder waits, then answers the same way.
// `elapsed_ns` gets the initiator's time for all round trips.
extern "C" __global__ void gio_pingpong(gio_dev_qp *qp, uint32_t remote_mr, uint32_t local_mr,
                                        uint32_t remote_signal_mr, const u64 *my_signal, u64 iters,
                                        int initiator, u64 *elapsed_ns, int *status) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const u64 start = gio::now_ns();
  for (u64 i = 1; i <= iters; i++) {
    if (!initiator) record(status, gio::signal_wait_ge(qp, my_signal, i));
    record(status, gio::put_signal<gio::scope::thread, gio::sharing::exclusive>(
                       qp, remote_mr, 0, local_mr, 0, 8, remote_signal_mr, 0, 1));
    if (initiator) record(status, gio::signal_wait_ge(qp, my_signal, i));
    if (*status != GIO_OK) break;
  }
  *elapsed_ns = gio::now_ns() - start;
}
