/*
 * The gather/scatter copy of LOCAL and CUDA_IPC (nixl/src/backends/cuda_copy.rs): one
 * launch moves a whole prepared transfer, however many descriptors it has, instead of one
 * cuMemcpyAsync per descriptor.
 *
 * Input: a device-resident table of work items (src, dst, len). The host splits
 * descriptors larger than its chunk size into several items, so one huge descriptor still
 * spreads over every SM. Each block takes items in turn (grid-stride) and copies an item
 * with all its threads: 16-byte vector loads and stores where source and destination
 * share their alignment modulo 16 (after a byte-wise head up to the destination's
 * alignment), else the widest word both share (8, 4, 2 bytes), else bytes. Each thread
 * keeps NIXL_COPY_UNROLL loads in flight before it stores, so the memory system sees
 * enough outstanding requests (HBM and NVLink both need many bytes in flight).
 *
 * Addresses are anything this GPU can dereference: its own VRAM, a peer GPU's VRAM with
 * peer access enabled (an IPC mapping included), host memory pinned and mapped
 * (cuMemHostRegister with DEVICEMAP, same address under unified addressing).
 *
 * Completion: the host records an event after the launch; the notification of a transfer
 * is sent only once that event completed, i.e. after every store of the kernel.
 */

#ifndef NIXL_COPY_UNROLL
#define NIXL_COPY_UNROLL 4
#endif

/* One work item; the layout of `CopyItem` in cuda_copy.rs (24 bytes, asserted there). */
struct nixl_copy_item {
  unsigned long long src;
  unsigned long long dst;
  unsigned long long len;
};
static_assert(sizeof(nixl_copy_item) == 24, "nixl_copy_item is CopyItem (24 bytes)");

/* Bytes [0, n) of one item, one byte per thread per step (heads, tails, odd alignment). */
__device__ __forceinline__ void copy_bytes(const unsigned char *src, unsigned char *dst,
                                           unsigned long long n) {
  for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

/* `n` words of type T, both pointers T-aligned, every thread of the block taking part. */
template <typename T>
__device__ __forceinline__ void copy_words(const T *src, T *dst, unsigned long long n) {
  const unsigned long long stride = blockDim.x;
  unsigned long long i = threadIdx.x;
  for (; i + (NIXL_COPY_UNROLL - 1) * stride < n; i += NIXL_COPY_UNROLL * stride) {
    T v[NIXL_COPY_UNROLL];
#pragma unroll
    for (int k = 0; k < NIXL_COPY_UNROLL; k++) v[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < NIXL_COPY_UNROLL; k++) dst[i + k * stride] = v[k];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

/* One item with words of type T: a byte head up to T's alignment of the destination (the
 * source then has it too: the caller checked that both share it), the words, a byte tail. */
template <typename T>
__device__ __forceinline__ void copy_aligned(unsigned long long src, unsigned long long dst,
                                             unsigned long long len) {
  const unsigned long long w = sizeof(T);
  unsigned long long head = (w - (dst & (w - 1))) & (w - 1);
  if (head > len) head = len;
  copy_bytes((const unsigned char *)src, (unsigned char *)dst, head);
  const unsigned long long words = (len - head) / w;
  copy_words<T>((const T *)(src + head), (T *)(dst + head), words);
  const unsigned long long done = head + words * w;
  copy_bytes((const unsigned char *)(src + done), (unsigned char *)(dst + done), len - done);
}

__device__ __forceinline__ void copy_item(unsigned long long src, unsigned long long dst,
                                          unsigned long long len) {
  /* The widest word whose alignment source and destination share. */
  const unsigned long long shared = (src ^ dst) & 15;
  if (shared == 0)
    copy_aligned<uint4>(src, dst, len);
  else if ((shared & 7) == 0)
    copy_aligned<unsigned long long>(src, dst, len);
  else if ((shared & 3) == 0)
    copy_aligned<unsigned int>(src, dst, len);
  else if ((shared & 1) == 0)
    copy_aligned<unsigned short>(src, dst, len);
  else
    copy_bytes((const unsigned char *)src, (unsigned char *)dst, len);
}

extern "C" __global__ void nixl_copy_batch(const nixl_copy_item *items, unsigned long long count) {
  for (unsigned long long k = blockIdx.x; k < count; k += gridDim.x) {
    const nixl_copy_item it = items[k];
    copy_item(it.src, it.dst, it.len);
  }
}

/* One copy of a request over two prepared lists: positions in the source and the
 * destination address tables (`GatherPair` in cuda_copy.rs, 8 bytes, asserted there). */
struct nixl_gather_pair {
  unsigned int src;
  unsigned int dst;
};
static_assert(sizeof(nixl_gather_pair) == 8, "nixl_gather_pair is GatherPair (8 bytes)");

/*
 * The gather/scatter copy of a request by descriptor index over lists prepared once: the
 * lists' addresses (and lengths) stay on the GPU from the first request on, and a request
 * uploads only its pairs of positions. Pair k copies lens[pair.dst or pair.src] bytes
 * from src_addrs[pair.src] to dst_addrs[pair.dst] (`lens_by_dst` says which index the
 * length table follows: it is the initiator's list). Each block takes pairs in turn,
 * copying each with all its threads, as `nixl_copy_batch` does its items.
 */
extern "C" __global__ void nixl_copy_gather(const unsigned long long *src_addrs,
                                            const unsigned long long *dst_addrs,
                                            const unsigned long long *lens, int lens_by_dst,
                                            const nixl_gather_pair *pairs,
                                            unsigned long long count) {
  for (unsigned long long k = blockIdx.x; k < count; k += gridDim.x) {
    const nixl_gather_pair p = pairs[k];
    const unsigned long long len = lens[lens_by_dst ? p.dst : p.src];
    copy_item(src_addrs[p.src], dst_addrs[p.dst], len);
  }
}
