//! How long a GPU post takes to reach the CPU proxy, measured as the issue asks: the
//! round trip GPU writes a ring entry -> the proxy sees it and writes a host-mapped word
//! (`ctrl.completed`) -> the GPU sees that (`gio_perf_proxy_rtt`, a NOP through the
//! low-level API), next to the floor of that path, a kernel pinging a host thread through
//! host-mapped memory alone (`gio_rtt_host_ping`), alternating in one run. One way
//! (GPU post -> proxy sees it) is bounded by the proxy round trip minus half the
//! host-mapped one (the completion's way back). Proxy configurations: the default
//! (adaptive idling, transport polled every 16 idle rounds), busy polling on a pinned
//! core, and that with the transport polled every 1024 idle rounds.
//! Prints the numbers; asserts the runs complete. Skips with a printed reason without a
//! GPU; fails with NIXL_REQUIRE_GPU=1.

use cudarc::driver::{CudaModule, LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::proxy::{CpuProxyBuilder, FabricTransport, RingMemory};
use gpunetio::{gpu_for_test, DeviceBuffer, Gpu, HostBuffer};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ITERS: u64 = 5000;
const WARMUP: usize = 500;

fn module(gpu: &Gpu, name: &str, src: &str) -> Arc<CudaModule> {
    let options = CompileOptions::for_gpu(gpu).expect("compute capability");
    let ptx = compile(name, src, &options).expect("compiles");
    gpu.context().load_module(ptx).expect("module loads")
}

fn one_thread() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Median, p99 and minimum in microseconds, after the warm-up.
fn stats(raw: &DeviceBuffer) -> (f64, f64, f64) {
    let mut b = vec![0u8; raw.len()];
    raw.copy_to_host(0, &mut b).expect("read");
    let mut ns: Vec<u64> = b
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
        .skip(WARMUP)
        .collect();
    assert!(
        ns.iter().all(|&x| x != 0 && x != u64::MAX),
        "a round trip did not complete"
    );
    ns.sort_unstable();
    let us = |x: u64| x as f64 / 1e3;
    (us(ns[ns.len() / 2]), us(ns[ns.len() * 99 / 100]), us(ns[0]))
}

/// Pins the calling thread to `cpu` (best effort: the numbers are printed either way).
fn pin(cpu: usize) {
    // SAFETY: an all-zero cpu_set_t is the empty set; cpu < CPU_SETSIZE (checked).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < 8 * std::mem::size_of::<libc::cpu_set_t>() {
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set);
        }
    }
}

/// The kernel pings a host thread (pinned to `cpu`) through two host-mapped words.
fn host_ping(gpu: &Gpu, m: &Arc<CudaModule>, cpu: usize) -> (f64, f64, f64) {
    host_ping_mode(gpu, m, cpu, None)
}

/// As [`host_ping`], the GPU side storing as `gio_rtt_host_ping_mode`'s `mode` says.
fn host_ping_mode(
    gpu: &Gpu,
    m: &Arc<CudaModule>,
    cpu: usize,
    mode: Option<u32>,
) -> (f64, f64, f64) {
    let mut words = HostBuffer::alloc(gpu, 128).expect("pinned");
    words.as_mut_slice().fill(0);
    let base = words.device_ptr().expect("mapped");
    let host = words.as_mut_ptr() as usize;
    let raw = DeviceBuffer::alloc(gpu, 8 * ITERS as usize).expect("rtt");
    raw.fill(0).expect("clear");
    let stop = AtomicU64::new(0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            pin(cpu);
            // SAFETY: two 8-byte aligned words of the pinned buffer, which outlives this
            // scope; the GPU writes the first and reads the second, only atomically.
            let (from_gpu, to_gpu) = unsafe {
                (
                    AtomicU64::from_ptr(host as *mut u64),
                    AtomicU64::from_ptr((host + 64) as *mut u64),
                )
            };
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut seen = 0;
            while seen < ITERS && stop.load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
                let v = from_gpu.load(Ordering::Acquire);
                if v > seen {
                    seen = v;
                    to_gpu.store(v, Ordering::Release);
                }
                std::hint::spin_loop();
            }
        });
        let name = if mode.is_some() {
            "gio_rtt_host_ping_mode"
        } else {
            "gio_rtt_host_ping"
        };
        let f = m.load_function(name).expect("kernel");
        let stream = gpu.new_stream().expect("stream");
        let (to_host, from_host, iters, rtt) = (base, base + 64, ITERS, raw.ptr());
        let mode = mode.unwrap_or(0);
        let mut l = stream.launch_builder(&f);
        l.arg(&to_host).arg(&from_host).arg(&iters).arg(&rtt);
        if name == "gio_rtt_host_ping_mode" {
            l.arg(&mode);
        }
        // SAFETY: gio_rtt_host_ping(u64*, const u64*, u64, u64*) or
        // gio_rtt_host_ping_mode(.., unsigned); the buffers outlive the synchronize; the
        // kernel gives up after a silent second.
        unsafe { l.launch(one_thread()) }.expect("launch");
        stream.synchronize().expect("kernel");
        stop.store(1, Ordering::Relaxed);
    });
    drop(words);
    stats(&raw)
}

/// NOP round trips through a proxy built from `options` (a CUDA ring, shm transport).
fn proxy_rtt(gpu: &Gpu, perf: &Arc<CudaModule>, options: CpuProxyBuilder) -> (f64, f64, f64) {
    let ring = RingMemory::cuda(gpu, 256, 0).expect("ring");
    let proxy = options
        .gpu(gpu)
        .timeout(Duration::from_secs(20))
        .build(FabricTransport::new("shm").expect("shm"), &ring)
        .expect("proxy");
    proxy.start().expect("proxy thread");
    let qp = proxy.export().expect("export");
    let raw = DeviceBuffer::alloc(gpu, 8 * ITERS as usize).expect("rtt");
    raw.fill(0).expect("clear");
    let status = DeviceBuffer::alloc(gpu, 4).expect("status");
    status.fill(0).expect("clear");
    let f = perf.load_function("gio_perf_proxy_rtt").expect("kernel");
    let stream = gpu.new_stream().expect("stream");
    let (qp_ptr, iters, rtt, st) = (qp.device_ptr(), ITERS, raw.ptr(), status.ptr());
    let mut l = stream.launch_builder(&f);
    l.arg(&qp_ptr).arg(&iters).arg(&rtt).arg(&st);
    // SAFETY: gio_perf_proxy_rtt(gio_dev_qp*, u64, u64*, int*); the queue pair and buffers
    // outlive the synchronize; waits are bounded by the queue pair's timeout.
    unsafe { l.launch(one_thread()) }.expect("launch");
    stream.synchronize().expect("kernel");
    let mut b = [0u8; 4];
    status.copy_to_host(0, &mut b).expect("status");
    assert_eq!(i32::from_le_bytes(b), 0, "device status");
    assert!(proxy.take_error().is_none(), "proxy error");
    stats(&raw)
}

#[test]
fn gpu_proxy_post_to_proxy_latency() {
    let Some(gpu) = gpu_for_test("gpu_proxy_post_to_proxy_latency") else {
        return;
    };
    let ping = module(&gpu, "gpu_proxy_rtt.cu", include_str!("gpu_proxy_rtt.cu"));
    let (_, perf_src) = gpunetio::DEVICE_SOURCES
        .iter()
        .find(|(n, _)| *n == "gio_perf.cu")
        .expect("gio_perf.cu is shipped");
    let perf = module(&gpu, "gio_perf.cu", perf_src);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The proxy and the host pinger on the last cores, away from this thread.
    let (proxy_cpu, ping_cpu) = (cpus.saturating_sub(1), cpus.saturating_sub(2));
    let configs: [(&str, CpuProxyBuilder); 3] = [
        ("default", CpuProxyBuilder::new()),
        (
            "busy poll, pinned",
            CpuProxyBuilder::new().busy_poll(true).pin_to_cpu(proxy_cpu),
        ),
        (
            "busy poll, pinned, transport every 1024 idle rounds",
            CpuProxyBuilder::new()
                .busy_poll(true)
                .pin_to_cpu(proxy_cpu)
                .idle_poll_rounds(1024),
        ),
    ];
    let mut lines = Vec::new();
    // What each store pattern of a ring post costs on the way to the host thread.
    for round in 0..2 {
        for (mode, what) in [
            (0, "one relaxed store"),
            (1, "one release store"),
            (2, "high-level post: 4 payload stores + release store"),
            (3, "4 payload stores + relaxed store (unordered)"),
            (4, "low-level post: prepare_nop + release store"),
            (5, "8 relaxed flagged words"),
        ] {
            let (m, p, min) = host_ping_mode(&gpu, &ping, ping_cpu, Some(mode));
            lines.push(format!(
                "round {round}: host ping [{what}]: median {m:.2} us, p99 {p:.2} us, min {min:.2} us"
            ));
        }
    }
    for round in 0..2 {
        let (hm, hp, hmin) = host_ping(&gpu, &ping, ping_cpu);
        lines.push(format!(
            "round {round}: host-mapped round trip (GPU store -> CPU thread -> GPU load): median {hm:.2} us, p99 {hp:.2} us, min {hmin:.2} us; half {:.2} us",
            hm / 2.0
        ));
        for (name, options) in &configs {
            let (m, p, min) = proxy_rtt(&gpu, &perf, options.clone());
            lines.push(format!(
                "round {round}: proxy NOP round trip [{name}]: median {m:.2} us, p99 {p:.2} us, min {min:.2} us; GPU post -> proxy sees it <= {:.2} us (median - host-mapped half)",
                m - hm / 2.0
            ));
        }
    }
    for l in lines {
        eprintln!("{l}");
    }
}

/// The test's own kernel compiles with NVRTC (no GPU needed), so CI catches a broken
/// kernel before the GPU run: skips without libnvrtc unless `GPUNETIO_REQUIRE_NVRTC=1`
/// or `NIXL_REQUIRE_GPU=1`.
#[test]
fn ping_kernel_compiles_with_nvrtc() {
    if !gpunetio::device_code::nvrtc_available() {
        let required = std::env::var("GPUNETIO_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
            || gpunetio::gpu_required();
        assert!(
            !required,
            "NVRTC is required here but libnvrtc does not load"
        );
        eprintln!("skipped ping_kernel_compiles_with_nvrtc: libnvrtc is not installed");
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        let options = CompileOptions {
            arch: arch.into(),
            ..CompileOptions::default()
        };
        if let Err(e) = compile(
            "gpu_proxy_rtt.cu",
            include_str!("gpu_proxy_rtt.cu"),
            &options,
        ) {
            panic!("gpu_proxy_rtt.cu for {arch}: {e}");
        }
    }
}
