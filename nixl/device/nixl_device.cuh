/*
 * nixl device API: CUDA kernels write, signal and wait on transfers a host agent
 * prepared, with NIXL's names and semantics, over the gpunetio device library
 * (gpunetio/gio_device.cuh) and whichever NIC handler the backend's queue pair uses.
 *
 * Two forms, as NIXL has them:
 *
 *   request form (NIXL's device-API guide)      host: XferReq::create_gpu_xfer_req()
 *     nixlGpuPostSingleWriteXferReq<L>(req, dst_offset, src_offset, desc_idx, size,
 *                                      flags, wait_completion)
 *     nixlGpuPostSignalXferReq<L>(req, offset, value, desc_idx, flags, wait_completion)
 *     nixlGpuReadSignal<L>(ptr)
 *     nixlGpuGetXferStatus<L>(status)
 *
 *   memory-view form (current NIXL)             host: Agent::prep_mem_view()
 *     nixlPut<L>(src_elem, dst_elem, size, channel_id, flags, status*)
 *     nixlAtomicAdd<L>(value, counter_elem, channel_id, flags, status*)
 *     nixlGetPtr(mvh, index)          direct pointer where the peer is mapped, else null
 *
 * Levels (NIXL's nixl_gpu_level_t): THREAD (each calling thread posts its own operation),
 * WARP (all 32 lanes of a warp call together with the same arguments and post one),
 * BLOCK (every thread of the block calls together; the block moves the data and one
 * operation is reported). A call made at WARP or BLOCK level by only some of the threads
 * is undefined, as in NIXL.
 *
 * A handle (a kernel argument, by value) names a generation word in a table the backend
 * keeps for its whole life and a copy of the descriptors that table owns: a handle used
 * after its request or view was released sees a generation that moved on and gets
 * NIXL_ERR_INVALID_PARAM; it never touches freed memory. (Releasing a handle while a
 * kernel that uses it is still running is undefined, as in NIXL: the word is checked with
 * plain loads, which may still see it live.) On intra-node queue pairs the descriptors
 * hold both device addresses, and a call is the copy or atomic itself after one round
 * trip for the generation and the descriptor.
 * Offsets and sizes are checked against the descriptor (NIXL_ERR_INVALID_PARAM), a
 * descriptor index against the request. Nothing in here traps or hangs: waits are
 * bounded by the queue pair's timeout.
 */
#ifndef NIXL_NIXL_DEVICE_CUH
#define NIXL_NIXL_DEVICE_CUH

#include "gpunetio/gio_device.cuh"

/* NIXL's nixl_status_t values (nixl_types.h). */
typedef int nixl_status_t;
#define NIXL_IN_PROG 1
#define NIXL_SUCCESS 0
#define NIXL_ERR_NOT_POSTED -1
#define NIXL_ERR_INVALID_PARAM -2
#define NIXL_ERR_BACKEND -3
#define NIXL_ERR_NOT_FOUND -4
#define NIXL_ERR_MISMATCH -5
#define NIXL_ERR_NOT_ALLOWED -6
#define NIXL_ERR_REPOST_ACTIVE -7
#define NIXL_ERR_UNKNOWN -8
#define NIXL_ERR_NOT_SUPPORTED -9
#define NIXL_ERR_REMOTE_DISCONNECT -10
#define NIXL_ERR_CANCELED -11

enum class nixl_gpu_level_t : unsigned { THREAD = 0, WARP = 1, BLOCK = 2 };

/* One descriptor pair of a request or one element of a view: `len` bytes at `local_off`
 * of local region `local_mr` and at `remote_off` of remote region `remote_mr` of the
 * queue pair's memory table. Intra-node queue pairs have a region per descriptor
 * (offsets 0); NIC and proxy queue pairs have a region per registration. Offsets a
 * kernel passes are checked against `len` here, then against the region by gio. */
struct nixl_gpu_desc {
  unsigned long long local_addr;  /*  0 */
  unsigned long long remote_addr; /*  8: device-addressable (mapped) or 0 */
  unsigned long long len;         /* 16 */
  unsigned int local_mr;          /* 24 */
  unsigned int remote_mr;         /* 28 */
  unsigned long long local_off;   /* 32 */
  unsigned long long remote_off;  /* 40 */
};
static_assert(sizeof(nixl_gpu_desc) == 48, "nixl_gpu_desc layout");
GIO_ASSERT_OFFSET(nixl_gpu_desc, local_off, 32);
GIO_ASSERT_OFFSET(nixl_gpu_desc, remote_off, 40);

/* The kernel argument for a request (NIXL's nixlGpuXferReqH) or a view (nixlMemViewH):
 * everything a call needs is in the argument itself or one load away, so a call checks
 * the handle's generation and loads its descriptor at the same time.
 *   slot        the handle's generation word in the backend's table: odd while the
 *               request or view lives, moved on when it is released;
 *   descs       the descriptors, a copy the table owns: they stay mapped (reused by the
 *               slot's next owner, never unmapped while the backend lives), so loading
 *               one through a stale handle is harmless and the generation decides;
 *   qp          the queue pair (null for a view of local memory), read only after the
 *               generation matched: it is freed with its request;
 *   count/flags descriptor count, NIXL_GPU_SLOT_* and NIXL_GPU_DIRECT/_SAME_DEVICE. */
struct nixl_gpu_handle {
  const unsigned long long *slot; /*  0 */
  unsigned long long generation;  /*  8 */
  const nixl_gpu_desc *descs;     /* 16 */
  gio_dev_qp *qp;                 /* 24 */
  unsigned int count;             /* 32 */
  unsigned int flags;             /* 36 */
};
static_assert(sizeof(nixl_gpu_handle) == 40, "nixl_gpu_handle layout");
GIO_ASSERT_OFFSET(nixl_gpu_handle, descs, 16);
GIO_ASSERT_OFFSET(nixl_gpu_handle, qp, 24);
GIO_ASSERT_OFFSET(nixl_gpu_handle, count, 32);
GIO_ASSERT_OFFSET(nixl_gpu_handle, flags, 36);

#define NIXL_GPU_SLOT_REQUEST 1u
#define NIXL_GPU_SLOT_VIEW 2u
/* View of local memory: elements are sources, not targets. */
#define NIXL_GPU_SLOT_LOCAL 4u
/* Every descriptor holds both device addresses (an intra-node queue pair): puts are
 * copies and signals atomics on them, without looking regions up in the queue pair. */
#define NIXL_GPU_DIRECT 8u
/* Every peer buffer is on this GPU: GPU-scope ordering and atomics suffice. */
#define NIXL_GPU_SAME_DEVICE 16u

struct nixlGpuXferReqH : nixl_gpu_handle {};
struct nixlMemViewH : nixl_gpu_handle {};
static_assert(sizeof(nixlGpuXferReqH) == 40 && sizeof(nixlMemViewH) == 40, "handle layout");

struct nixlMemViewElem {
  nixlMemViewH mvh;
  size_t index;
  size_t offset;
};

/* What a non-blocking post hands back to poll (NIXL's nixlGpuXferStatusH). */
struct nixlGpuXferStatusH {
  gio_dev_qp *qp;
  unsigned long long ticket;
};

namespace nixl_gpu_flags {
/* Accepted for NIXL compatibility: posts are never held back here. */
constexpr unsigned long long defer = 1;
}  // namespace nixl_gpu_flags

namespace nixl_detail {

/* `[off, off + size)` lies inside `len` bytes. */
__device__ __forceinline__ bool inside(unsigned long long off, unsigned long long size,
                                       unsigned long long len) {
  return off <= len && size <= len - off;
}

__device__ __forceinline__ nixl_status_t from_gio(int st) {
  switch (st) {
    case GIO_OK:
      return NIXL_SUCCESS;
    case GIO_ERR_BOUNDS:
    case GIO_ERR_BAD_ENTRY:
      return NIXL_ERR_INVALID_PARAM;
    case GIO_ERR_PEER_GONE:
      return NIXL_ERR_REMOTE_DISCONNECT;
    case GIO_ERR_SHUTDOWN:
      return NIXL_ERR_CANCELED;
    default:
      return NIXL_ERR_BACKEND;
  }
}

/* Descriptor `index` of handle `h` into `*d` when `h` is live and of kind `kind`. The
 * generation word and the descriptor are loaded together (both stay mapped for the
 * table's life), then compared: one memory round trip, not a chain of them. Plain loads:
 * the host releases a slot between kernels (a launch makes its write visible). */
__device__ __forceinline__ bool load(const nixl_gpu_handle &h, unsigned int kind, size_t index,
                                     nixl_gpu_desc *d) {
  if (h.slot == nullptr || (h.flags & kind) == 0 || index >= h.count) return false;
  const unsigned long long generation = *h.slot;
  *d = h.descs[index];
  return generation == h.generation && (generation & 1) != 0;
}

__device__ __forceinline__ bool same_device(const nixl_gpu_handle &h) {
  return (h.flags & NIXL_GPU_SAME_DEVICE) != 0;
}

template <nixl_gpu_level_t L> __device__ __forceinline__ bool is_leader() {
  if (L == nixl_gpu_level_t::THREAD) return true;
  if (L == nixl_gpu_level_t::WARP) return gio::lane_id() == 0;
  return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
}

__device__ __forceinline__ unsigned block_rank() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

/* BLOCK level: every thread learns the leader's status. */
__device__ __forceinline__ nixl_status_t block_broadcast(nixl_status_t st) {
  __shared__ nixl_status_t shared_status;
  __syncthreads();
  if (block_rank() == 0) shared_status = st;
  __syncthreads();
  return shared_status;
}

/* Copies `len` bytes src -> dst (both device-addressable) with the level's threads. */
template <nixl_gpu_level_t L>
__device__ __forceinline__ void copy(char *dst, const char *src, unsigned long long len) {
  if (L == nixl_gpu_level_t::THREAD) {
    gio::copy_bytes(dst, src, len, 0, 1);
  } else if (L == nixl_gpu_level_t::WARP) {
    gio::copy_bytes(dst, src, len, gio::lane_id(), 32);
    __syncwarp();
  } else {
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    gio::copy_bytes(dst, src, len, block_rank(), n);
    __syncthreads();
  }
}

/* A put of `len` bytes from local region `lmr`+`loff` to remote region `rmr`+`roff` of
 * `qp`, with an optional signal, by the level's threads; `ticket` for a status. */
template <nixl_gpu_level_t L>
__device__ __forceinline__ nixl_status_t put(gio_dev_qp *qp, unsigned rmr, unsigned long long roff,
                                             unsigned lmr, unsigned long long loff,
                                             unsigned long long len, unsigned long long *ticket) {
  if (L == nixl_gpu_level_t::THREAD)
    return from_gio(gio::put<gio::scope::thread, gio::sharing::gpu>(qp, rmr, roff, lmr, loff, len,
                                                                    ticket));
  if (L == nixl_gpu_level_t::WARP)
    return from_gio(gio::put<gio::scope::warp, gio::sharing::gpu>(qp, rmr, roff, lmr, loff, len,
                                                                  ticket));
  /* BLOCK: one operation posted by thread 0 (intra-node handles copy directly instead). */
  int st = GIO_OK;
  if (block_rank() == 0)
    st = gio::put<gio::scope::thread, gio::sharing::gpu>(qp, rmr, roff, lmr, loff, len, ticket);
  return block_broadcast(from_gio(st));
}

template <nixl_gpu_level_t L>
__device__ __forceinline__ nixl_status_t signal(gio_dev_qp *qp, unsigned mr, unsigned long long off,
                                                unsigned long long value,
                                                unsigned long long *ticket) {
  if (L == nixl_gpu_level_t::WARP)
    return from_gio(gio::signal<gio::scope::warp, gio::sharing::gpu>(qp, mr, off, value, ticket));
  if (L == nixl_gpu_level_t::THREAD)
    return from_gio(gio::signal<gio::scope::thread, gio::sharing::gpu>(qp, mr, off, value, ticket));
  /* BLOCK: everything the block stored before comes first. */
  __syncthreads();
  int st = GIO_OK;
  if (block_rank() == 0) {
    gio::fence_for_peer(qp);
    st = gio::signal<gio::scope::thread, gio::sharing::gpu>(qp, mr, off, value, ticket);
  }
  return block_broadcast(from_gio(st));
}

/* A signal on a direct handle: an atomic add on the mapped word, ordered after every
 * store the level's threads made before. */
template <nixl_gpu_level_t L>
__device__ __forceinline__ void signal_direct(bool same_device, unsigned long long *word,
                                              unsigned long long value) {
  if (L == nixl_gpu_level_t::THREAD) {
    gio::peer_release_add(same_device, word, value);
    return;
  }
  if (L == nixl_gpu_level_t::WARP)
    __syncwarp();
  else
    __syncthreads();
  if (is_leader<L>()) {
    /* The other threads' stores reach the peer before the add: the barrier orders them
     * before the leader's fence, which is cumulative. */
    gio::fence_for_peer(same_device);
    gio::peer_release_add(same_device, word, value);
  }
}

template <nixl_gpu_level_t L>
__device__ __forceinline__ nixl_status_t complete(gio_dev_qp *qp, unsigned long long ticket) {
  int st = GIO_OK;
  if (is_leader<L>()) st = gio::wait(qp, ticket);
  if (L == nixl_gpu_level_t::WARP) return __shfl_sync(0xffffffffu, from_gio(st), 0);
  if (L == nixl_gpu_level_t::BLOCK) return block_broadcast(from_gio(st));
  return from_gio(st);
}

}  // namespace nixl_detail

/* ---- request form ----------------------------------------------------------------------- */

/* Writes `size` bytes from descriptor `desc_idx`'s local buffer at `src_offset` to its
 * remote buffer at `dst_offset`. With `wait_completion` it returns once the data was
 * delivered; else NIXL_SUCCESS means posted. */
template <nixl_gpu_level_t L = nixl_gpu_level_t::THREAD>
__device__ __forceinline__ nixl_status_t nixlGpuPostSingleWriteXferReq(
    nixlGpuXferReqH req, size_t dst_offset, size_t src_offset, unsigned desc_idx, size_t size,
    unsigned long long flags = 0, bool wait_completion = false,
    nixlGpuXferStatusH *status = nullptr) {
  (void)flags;
  nixl_gpu_desc d;
  if (!nixl_detail::load(req, NIXL_GPU_SLOT_REQUEST, desc_idx, &d) ||
      !nixl_detail::inside(dst_offset, size, d.len) || !nixl_detail::inside(src_offset, size, d.len))
    return NIXL_ERR_INVALID_PARAM;
  if (req.flags & NIXL_GPU_DIRECT) {
    nixl_detail::copy<L>((char *)(d.remote_addr + dst_offset),
                         (const char *)(d.local_addr + src_offset), size);
    if (wait_completion && nixl_detail::is_leader<L>())
      gio::fence_for_peer(nixl_detail::same_device(req));
    if (status) *status = nixlGpuXferStatusH{req.qp, 0};
    return NIXL_SUCCESS;
  }
  unsigned long long ticket = 0;
  nixl_status_t st = nixl_detail::put<L>(req.qp, d.remote_mr, d.remote_off + dst_offset,
                                         d.local_mr, d.local_off + src_offset, size, &ticket);
  if (st != NIXL_SUCCESS) return st;
  if (status) *status = nixlGpuXferStatusH{req.qp, ticket};
  return wait_completion ? nixl_detail::complete<L>(req.qp, ticket) : NIXL_SUCCESS;
}

/* Atomically adds `value` to the 64-bit signal word at `offset` of descriptor
 * `desc_idx`'s remote buffer, after every write this thread (level) posted before. */
template <nixl_gpu_level_t L = nixl_gpu_level_t::THREAD>
__device__ __forceinline__ nixl_status_t nixlGpuPostSignalXferReq(
    nixlGpuXferReqH req, size_t offset, unsigned long long value, unsigned desc_idx,
    unsigned long long flags = 0, bool wait_completion = false,
    nixlGpuXferStatusH *status = nullptr) {
  (void)flags;
  nixl_gpu_desc d;
  if (!nixl_detail::load(req, NIXL_GPU_SLOT_REQUEST, desc_idx, &d) ||
      !nixl_detail::inside(offset, 8, d.len))
    return NIXL_ERR_INVALID_PARAM;
  if (req.flags & NIXL_GPU_DIRECT) {
    const unsigned long long word = d.remote_addr + offset;
    if (word & 7) return NIXL_ERR_INVALID_PARAM;
    nixl_detail::signal_direct<L>(nixl_detail::same_device(req), (unsigned long long *)word, value);
    if (status) *status = nixlGpuXferStatusH{req.qp, 0};
    return NIXL_SUCCESS;
  }
  unsigned long long ticket = 0;
  nixl_status_t st = nixl_detail::signal<L>(req.qp, d.remote_mr, d.remote_off + offset, value,
                                            &ticket);
  if (st != NIXL_SUCCESS) return st;
  if (status) *status = nixlGpuXferStatusH{req.qp, ticket};
  return wait_completion ? nixl_detail::complete<L>(req.qp, ticket) : NIXL_SUCCESS;
}

/* Reads a local signal word (written by a peer's signal) with acquire semantics. */
template <nixl_gpu_level_t L = nixl_gpu_level_t::THREAD>
__device__ __forceinline__ unsigned long long nixlGpuReadSignal(const void *signal) {
  return gio::ld_acquire_sys((const unsigned long long *)signal);
}

/* Whether the operation behind `status` completed: NIXL_SUCCESS, NIXL_IN_PROG, or an
 * error. Never blocks. */
template <nixl_gpu_level_t L = nixl_gpu_level_t::THREAD>
__device__ __forceinline__ nixl_status_t nixlGpuGetXferStatus(nixlGpuXferStatusH &status) {
  if (status.qp == nullptr) return NIXL_ERR_INVALID_PARAM;
  const int st = gio::poll_completion(status.qp, status.ticket);
  if (st == 1) return NIXL_IN_PROG;
  return nixl_detail::from_gio(st);
}

/* ---- memory-view form ------------------------------------------------------------------ */

/* Puts `size` bytes from a local view's element to a remote view's element. Ordered
 * before a later nixlAtomicAdd of the same threads (level). */
template <nixl_gpu_level_t L = nixl_gpu_level_t::THREAD>
__device__ __forceinline__ nixl_status_t nixlPut(nixlMemViewElem src, nixlMemViewElem dst,
                                                 size_t size, unsigned channel_id = 0,
                                                 unsigned long long flags = 0,
                                                 nixlGpuXferStatusH *status = nullptr) {
  (void)channel_id;
  (void)flags;
  nixl_gpu_desc s, d;
  const bool src_ok = nixl_detail::load(src.mvh, NIXL_GPU_SLOT_VIEW, src.index, &s);
  const bool dst_ok = nixl_detail::load(dst.mvh, NIXL_GPU_SLOT_VIEW, dst.index, &d);
  if (!src_ok || !dst_ok || (src.mvh.flags & NIXL_GPU_SLOT_LOCAL) == 0 ||
      (dst.mvh.flags & NIXL_GPU_SLOT_LOCAL) != 0 || !nixl_detail::inside(src.offset, size, s.len) ||
      !nixl_detail::inside(dst.offset, size, d.len))
    return NIXL_ERR_INVALID_PARAM;
  if (dst.mvh.flags & NIXL_GPU_DIRECT) {
    /* The peer is mapped: the level's threads copy. */
    nixl_detail::copy<L>((char *)(d.remote_addr + dst.offset),
                         (const char *)(s.local_addr + src.offset), size);
    if (status) *status = nixlGpuXferStatusH{dst.mvh.qp, 0};
    return NIXL_SUCCESS;
  }
  /* A NIC or proxy queue pair: the source must be a region of the destination view's
   * queue pair (the backend adds every local region to it). */
  if (s.local_mr == 0xffffffffu) return NIXL_ERR_NOT_SUPPORTED;
  unsigned long long ticket = 0;
  nixl_status_t st = nixl_detail::put<L>(dst.mvh.qp, d.remote_mr, d.remote_off + dst.offset,
                                         s.local_mr, s.local_off + src.offset, size, &ticket);
  if (st == NIXL_SUCCESS && status) *status = nixlGpuXferStatusH{dst.mvh.qp, ticket};
  return st;
}

/* Atomically adds `value` to the 64-bit counter at a remote view's element. */
template <nixl_gpu_level_t L = nixl_gpu_level_t::THREAD>
__device__ __forceinline__ nixl_status_t nixlAtomicAdd(unsigned long long value,
                                                       nixlMemViewElem counter,
                                                       unsigned channel_id = 0,
                                                       unsigned long long flags = 0,
                                                       nixlGpuXferStatusH *status = nullptr) {
  (void)channel_id;
  (void)flags;
  nixl_gpu_desc c;
  if (!nixl_detail::load(counter.mvh, NIXL_GPU_SLOT_VIEW, counter.index, &c) ||
      (counter.mvh.flags & NIXL_GPU_SLOT_LOCAL) != 0 ||
      !nixl_detail::inside(counter.offset, 8, c.len))
    return NIXL_ERR_INVALID_PARAM;
  if (counter.mvh.flags & NIXL_GPU_DIRECT) {
    const unsigned long long word = c.remote_addr + counter.offset;
    if (word & 7) return NIXL_ERR_INVALID_PARAM;
    nixl_detail::signal_direct<L>(nixl_detail::same_device(counter.mvh),
                                  (unsigned long long *)word, value);
    if (status) *status = nixlGpuXferStatusH{counter.mvh.qp, 0};
    return NIXL_SUCCESS;
  }
  unsigned long long ticket = 0;
  nixl_status_t st = nixl_detail::signal<L>(counter.mvh.qp, c.remote_mr,
                                            c.remote_off + counter.offset, value, &ticket);
  if (st == NIXL_SUCCESS && status) *status = nixlGpuXferStatusH{counter.mvh.qp, ticket};
  return st;
}

/* A pointer this GPU can load and store to reach element `index` (the peer's memory
 * mapped here, or local memory), or null where it is reachable only through the NIC. */
__device__ __forceinline__ void *nixlGetPtr(nixlMemViewH mvh, size_t index) {
  nixl_gpu_desc d;
  if (!nixl_detail::load(mvh, NIXL_GPU_SLOT_VIEW, index, &d)) return nullptr;
  return (void *)((mvh.flags & NIXL_GPU_SLOT_LOCAL) ? d.local_addr : d.remote_addr);
}

#endif /* NIXL_NIXL_DEVICE_CUH */
