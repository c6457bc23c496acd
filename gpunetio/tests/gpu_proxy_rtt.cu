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
