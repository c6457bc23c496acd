/*
 * The GPUNETIO backend's transfer kernel: what `post` launches on a CUDA stream (the
 * caller's, "stream attached", or one of the backend's, "stream pool").
 *
 * Intra-node queue pairs (the peer's memory mapped here): the descriptors are cut in
 * `chunk`-byte pieces spread over every warp of the grid, each copied by the warp's lanes
 * (gio's vectorized copy) between the descriptor's addresses. NIC and proxy queue pairs:
 * the threads of block 0 post one operation per descriptor (as NIXL's GPUNetIO plugin
 * prepares one WQE per thread), then thread 0 waits for them all (gio::quiet).
 *
 * The first failure is written to `*status` (host-mapped); the stream's event after the
 * kernel tells the host it finished.
 */
#include "nixl/nixl_device.cuh"

__device__ __forceinline__ void record_failure(int *status, int st) {
  if (st != GIO_OK) atomicCAS_system(status, GIO_OK, st);
}

extern "C" __global__ void nixl_gpunetio_xfer(gio_dev_qp *qp, const nixl_gpu_desc *descs,
                                              unsigned n, unsigned is_read,
                                              unsigned long long chunk, int *status) {
  if (qp->nic_handler == GIO_NIC_HANDLER_INTRA_NODE) {
    const unsigned long long warps = ((unsigned long long)gridDim.x * blockDim.x) / 32;
    const unsigned long long warp = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    unsigned long long first = 0; /* global index of the descriptor's first chunk */
    for (unsigned i = 0; i < n; i++) {
      const nixl_gpu_desc d = descs[i];
      const unsigned long long chunks = (d.len + chunk - 1) / chunk;
      /* This warp's first chunk of the descriptor, then every `warps`-th. */
      for (unsigned long long j = (warp + warps - first % warps) % warps; j < chunks; j += warps) {
        const unsigned long long off = j * chunk;
        const unsigned long long len = d.len - off < chunk ? d.len - off : chunk;
        /* The host built this request's queue pair from these very descriptors (both
         * ranges checked against their registrations and mappings at prep), so the copy
         * goes straight to the addresses: no per-piece table lookups before the first
         * load. Visibility to the host and the peer comes with the kernel's end (the event
         * the notification waits for). */
        char *local = (char *)(d.local_addr + off), *remote = (char *)(d.remote_addr + off);
        if (is_read)
          gio::copy_bytes(local, remote, len, gio::lane_id(), 32);
        else
          gio::copy_bytes(remote, local, len, gio::lane_id(), 32);
      }
      first += chunks;
    }
    return;
  }
  if (blockIdx.x != 0) return;
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
    const nixl_gpu_desc d = descs[i];
    const int st = is_read ? gio::get<gio::scope::thread, gio::sharing::gpu>(
                                 qp, d.local_mr, d.local_off, d.remote_mr, d.remote_off, d.len)
                           : gio::put<gio::scope::thread, gio::sharing::gpu>(
                                 qp, d.remote_mr, d.remote_off, d.local_mr, d.local_off, d.len);
    record_failure(status, st);
  }
  __syncthreads();
  if (threadIdx.x == 0) record_failure(status, gio::quiet(qp));
}
