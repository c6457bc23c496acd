// Kernels of gpu_proxy_rtt: the GPU <-> CPU floor of the CPU proxy's round trip.
#include "gpunetio/gio_device.cuh"

typedef unsigned long long u64;

// Thread 0 pings a host thread through host-mapped memory alone, `iters` times: it stores
// i into `to_host` (a relaxed system-scope store, as the proxy ring's entry stores) and
// polls `from_host` (relaxed system-scope loads, as the device library polls
// ctrl.completed) until the host echoes i. `rtt_ns[i - 1]` gets each round trip; a host
// silent for a second ends the kernel with ~0 in that slot.
extern "C" __global__ void gio_rtt_host_ping(u64 *to_host, const u64 *from_host, u64 iters,
                                             u64 *rtt_ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (u64 i = 1; i <= iters; i++) {
    const u64 start = gio::now_ns();
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(to_host), "l"(i) : "memory");
    while (gio::ld_relaxed_sys(from_host) < i) {
      if (gio::now_ns() - start > 1000000000ull) {
        rtt_ns[i - 1] = ~0ull;
        return;
      }
    }
    rtt_ns[i - 1] = gio::now_ns() - start;
  }
}

// The same ping with the stores a ring post makes, to see what each costs over PCIe:
// `line` is a 64-byte host-mapped line whose word 0 the host thread watches (as the
// proxy watches an entry's seq); `mode`:
//   0 one relaxed store of i to word 0 (the floor above)
//   1 one release store (st.release.sys) of i to word 0
//   2 the high-level post: payload as one 8-byte and three 16-byte relaxed stores
//     (store_image), then a release store of i to word 0 (mark_ready)
//   3 as 2 with a relaxed store of word 0 (no ordering: timing only)
//   4 the low-level post: prepare_nop (an entry image, four stores), then a release store
//   5 eight relaxed 8-byte stores, each carrying i (a flag per word), word 0 last
extern "C" __global__ void gio_rtt_host_ping_mode(u64 *line, const u64 *from_host, u64 iters,
                                                  u64 *rtt_ns, unsigned mode) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (u64 i = 1; i <= iters; i++) {
    const u64 start = gio::now_ns();
    if (mode == 2 || mode == 3) {
      gio::entry_image img;
      img.v[0] = make_uint4((unsigned)i, 1, 2, 3);
      img.v[1] = make_uint4((unsigned)i, 4, 5, 6);
      img.v[2] = make_uint4((unsigned)i, 7, 8, 9);
      img.v[3] = make_uint4((unsigned)i, 10, 11, 12);
      gio::store_image((gio_ring_entry *)line, img);
    } else if (mode == 4) {
      gio::prepare_nop((gio_ring_entry *)line);
    } else if (mode == 5) {
      for (int w = 7; w >= 1; w--)
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(line + w), "l"(i) : "memory");
    }
    if (mode == 1 || mode == 2 || mode == 4)
      gio::st_release_sys(line, i);
    else
      asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(line), "l"(i) : "memory");
    while (gio::ld_relaxed_sys(from_host) < i) {
      if (gio::now_ns() - start > 1000000000ull) {
        rtt_ns[i - 1] = ~0ull;
        return;
      }
    }
    rtt_ns[i - 1] = gio::now_ns() - start;
  }
}
