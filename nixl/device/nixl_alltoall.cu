/*
 * The device-API all-to-all of the multi-GPU tests (nixl/tests/gpu_multi_alltoall.rs):
 * each rank's kernel puts a slice of its send buffer into every other rank's receive
 * buffer through GPUNETIO memory views (nixlPut at BLOCK level) and signals each peer
 * (nixlAtomicAdd on the peer's counter word for this rank); a second kernel waits until
 * every peer's counter here has reached the round's value.
 *
 * Views: `local` has one element per destination rank j (slice j of the send buffer);
 * `remotes[p]` (a device array, one view per peer, peer p being rank `peers[p]`) has
 * element 0 = that peer's receive slot for this rank, element 1 = that peer's counter
 * word for this rank. `blocks_per_peer` blocks serve each peer, each moving its share of
 * the slice and then adding 1 to the peer's counter (ordered after the block's stores),
 * so a receiver's counter for a sender reaches blocks_per_peer * round once that round's
 * whole slice has landed.
 *
 * Failures go to `*status` (first one wins): a device-API status, or NIXL_A2A_TIMED_OUT
 * when a peer's counter did not reach its value within `timeout_ns`.
 */
#include "nixl/nixl_device.cuh"

#define NIXL_A2A_TIMED_OUT 1000

__device__ __forceinline__ void a2a_fail(int *status, int st) {
  if (st != NIXL_SUCCESS) atomicCAS_system(status, NIXL_SUCCESS, st);
}

extern "C" __global__ void nixl_alltoall_put(nixlMemViewH local, const nixlMemViewH *remotes,
                                             const unsigned *peers, unsigned npeers,
                                             unsigned blocks_per_peer, unsigned long long slice,
                                             int *status) {
  const unsigned p = blockIdx.x / blocks_per_peer, b = blockIdx.x % blocks_per_peer;
  if (p >= npeers) return; /* uniform over the block */
  /* Shares of whole 16-byte words, so every block's copy stays vectorized. */
  const unsigned long long share = ((slice + blocks_per_peer - 1) / blocks_per_peer + 15) & ~15ull;
  const unsigned long long begin = (unsigned long long)b * share;
  nixl_status_t st = NIXL_SUCCESS;
  if (begin < slice) { /* uniform over the block: every thread calls at BLOCK level */
    const unsigned long long len = slice - begin < share ? slice - begin : share;
    nixlMemViewElem src;
    src.mvh = local;
    src.index = (size_t)peers[p];
    src.offset = (size_t)begin;
    nixlMemViewElem dst;
    dst.mvh = remotes[p];
    dst.index = 0;
    dst.offset = (size_t)begin;
    st = nixlPut<nixl_gpu_level_t::BLOCK>(src, dst, (size_t)len);
  }
  /* Every block signals, an empty share too: the count stays blocks_per_peer a round. */
  nixlMemViewElem counter;
  counter.mvh = remotes[p];
  counter.index = 1;
  counter.offset = 0;
  const nixl_status_t sig = nixlAtomicAdd<nixl_gpu_level_t::BLOCK>(1ull, counter);
  if (threadIdx.x == 0) {
    a2a_fail(status, st);
    a2a_fail(status, sig);
  }
}

/* One thread per peer: waits until this rank's counter for rank peers[i] (written by
 * that rank's nixlAtomicAdd) is at least `expected`. */
extern "C" __global__ void nixl_alltoall_wait(const unsigned long long *counters,
                                              const unsigned *peers, unsigned npeers,
                                              unsigned long long expected,
                                              unsigned long long timeout_ns, int *status) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= npeers) return;
  const unsigned long long *word = counters + peers[i];
  const unsigned long long start = gio::now_ns();
  while (nixlGpuReadSignal(word) < expected) {
    if (gio::now_ns() - start > timeout_ns) {
      a2a_fail(status, NIXL_A2A_TIMED_OUT);
      return;
    }
    __nanosleep(256);
  }
}
