// Kernels of gpu_proxy_rtt: the GPU <-> CPU floor of the CPU proxy's round trip.
#include "gpunetio/gio_device.cuh"

typedef unsigned long long u64;

// The latency of one read of host-mapped memory: `n` loads, each address depending on
// the value the previous one returned (`mask` is 0, unknown to the compiler), so they
// cannot overlap. out[0] = ns per load.
extern "C" __global__ void gio_rtt_load_latency(const u64 *word, u64 mask, unsigned n, u64 *out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  u64 v = 0;
  const u64 start = gio::now_ns();
  for (unsigned i = 0; i < n; i++) v = gio::ld_relaxed_sys(word + (v & mask));
  out[0] = (gio::now_ns() - start) / n;
  out[1] = v;
}

// Thread 0 pings a host thread through host-mapped memory, `iters` times: it stores i
// into `line` (word 0 is what the host thread watches) as `mode` says, waits `delay_ns`,
// then polls `from_host` (relaxed system-scope loads) until the host echoes i.
// `rtt_ns[i - 1]` gets each round trip, `polls[i - 1]` how many reads it took; a host
// silent for a second ends the kernel with ~0 in that slot. `mode`:
//   0 one relaxed store of i to word 0
//   1 one release store (st.release.sys) of i to word 0: the in-place ring post's
//     publication (mark_ready)
//   2 an image: the 64-byte line as four 16-byte relaxed stores (publish_image), no fence
//   3 a GPU-scope fence, then the image: a put of device memory (order_before_post)
extern "C" __global__ void gio_rtt_host_ping(u64 *line, const u64 *from_host, u64 iters,
                                             u64 delay_ns, unsigned mode, u64 *rtt_ns,
                                             u64 *polls) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (u64 i = 1; i <= iters; i++) {
    const u64 start = gio::now_ns();
    if (mode == 0) {
      asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(line), "l"(i) : "memory");
    } else if (mode == 1) {
      gio::st_release_sys(line, i);
    } else {
      if (mode == 3) asm volatile("fence.acq_rel.gpu;" ::: "memory");
#pragma unroll
      for (int k = 0; k < 8; k += 2)
        asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(line + k),
                     "l"(k == 0 ? i : i + k), "l"(i + k + 1)
                     : "memory");
    }
    const u64 due = gio::now_ns() + delay_ns;
    while ((long long)(gio::now_ns() - due) < 0) {
    }
    u64 n = 1;
    while (gio::ld_relaxed_sys(from_host) < i) {
      n++;
      if (gio::now_ns() - start > 1000000000ull) {
        rtt_ns[i - 1] = ~0ull;
        return;
      }
    }
    rtt_ns[i - 1] = gio::now_ns() - start;
    polls[i - 1] = n;
  }
}
