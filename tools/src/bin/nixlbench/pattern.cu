// nixlbench's data pattern written by the GPU (the host's definition is `write_pattern`
// in mem.rs): word i of a buffer, the 8 bytes at byte offset 8 * i, is
// splitmix64(seed ^ i * 0xD6E8FEB86659FD93) in little-endian order. Filling tens of GiB
// of VRAM this way runs at the GPU's memory bandwidth, where host-generated pieces
// copied over PCIe take seconds per GiB.

typedef unsigned long long u64;

__device__ __forceinline__ u64 nixlbench_splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Writes words [first_word, first_word + words) of the pattern `seed` to `dst` (which
// holds word first_word at its start, 8-byte aligned); a grid-stride loop, so any grid
// covers any length.
extern "C" __global__ void nixlbench_pattern(u64 *dst, u64 first_word, u64 words, u64 seed) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) {
        dst[i] = nixlbench_splitmix64(seed ^ ((first_word + i) * 0xD6E8FEB86659FD93ull));
    }
}
