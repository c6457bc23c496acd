//! The reference copies VRAM transfers are measured against, timed the way `nixlbench`
//! times a transfer (post, then poll until complete; bandwidth = bytes / sum of times):
//!
//! - `ipc-write` / `ipc-read`: a plain cross-process copy through a CUDA-IPC mapping
//!   (this process re-executes itself as the exporter);
//! - `d2d`: device to device in one process;
//! - `h2d` / `d2h`: pinned host memory to and from the GPU; `h2d-pageable`: from
//!   ordinary host memory.
//!
//! ```text
//! cargo run --release -p rdma-rs-gpunetio --example copy_bench -- [--sizes 1M,16M,64M,1G] [--iters N] [--modes ipc-write,h2d]
//! ```
//! Prints `mode size GB/s` rows (GB = 10^9 bytes).

#[path = "common/exporter.rs"]
mod exporter;
use exporter::Exporter;

use gpunetio::cudarc::driver::sys;
use gpunetio::{DeviceBuffer, Gpu, HostBuffer, IpcMapping};
use std::time::{Duration, Instant};

const ALL_MODES: &[&str] = &["ipc-write", "ipc-read", "d2d", "h2d", "d2h", "h2d-pageable"];

fn parse_size(s: &str) -> usize {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().expect("size") * mult
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if exporter::run_if_exporter(&args, parse_size) {
        return;
    }
    let mut sizes: Vec<usize> = ["1M", "4M", "16M", "64M", "256M", "1G"]
        .iter()
        .map(|s| parse_size(s))
        .collect();
    let mut iters = 0usize;
    let mut modes: Vec<String> = ALL_MODES.iter().map(|s| s.to_string()).collect();
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--sizes" => {
                i += 1;
                sizes = args[i].split(',').map(parse_size).collect();
            }
            "--iters" => {
                i += 1;
                iters = args[i].parse().expect("--iters N");
            }
            "--modes" => {
                i += 1;
                modes = args[i].split(',').map(str::to_string).collect();
            }
            other => {
                eprintln!("unknown argument {other}; usage: copy_bench [--sizes 1M,1G] [--iters N] [--modes {}]", ALL_MODES.join(","));
                std::process::exit(2);
            }
        }
        i += 1;
    }
    let gpu = Gpu::open(0).expect("GPU 0");
    let max = *sizes.iter().max().expect("a size");
    println!(
        "# {} ({})",
        gpu.name().unwrap_or_default(),
        gpu.pci_bus_id().unwrap_or_default()
    );
    println!("{:<14} {:>12} {:>10}", "mode", "size", "GB/s");
    let local = DeviceBuffer::alloc(&gpu, max).expect("device buffer");
    let needs_ipc = modes.iter().any(|m| m.starts_with("ipc"));
    let peer = needs_ipc.then(|| Exporter::start(max));
    let mapping = peer
        .as_ref()
        .map(|p| IpcMapping::open(&gpu, &p.handle).expect("IPC import"));
    let other = modes
        .iter()
        .any(|m| m == "d2d")
        .then(|| DeviceBuffer::alloc(&gpu, max).expect("device buffer"));
    let mut pinned = modes
        .iter()
        .any(|m| m == "h2d" || m == "d2h")
        .then(|| HostBuffer::alloc(&gpu, max).expect("pinned buffer"));
    let pageable = modes
        .iter()
        .any(|m| m == "h2d-pageable")
        .then(|| vec![1u8; max]);
    let stream = gpu.new_stream().expect("stream");
    let event = gpu.context().new_event(None).expect("event");
    for mode in &modes {
        for &size in &sizes {
            let (dst, src) = match mode.as_str() {
                "ipc-write" => (mapping.as_ref().expect("ipc").ptr(), local.ptr()),
                "ipc-read" => (local.ptr(), mapping.as_ref().expect("ipc").ptr()),
                "d2d" => (other.as_ref().expect("d2d").ptr(), local.ptr()),
                "h2d" => (
                    local.ptr(),
                    pinned.as_mut().expect("pinned").as_mut_ptr() as u64,
                ),
                "d2h" => (
                    pinned.as_mut().expect("pinned").as_mut_ptr() as u64,
                    local.ptr(),
                ),
                "h2d-pageable" => (
                    local.ptr(),
                    pageable.as_ref().expect("pageable").as_ptr() as u64,
                ),
                other => panic!("unknown mode {other}"),
            };
            // nixlbench's default: 1000 iterations, 16x fewer from 1 MiB up.
            let n = if iters > 0 {
                iters
            } else if size >= 1 << 20 {
                1000 / 16
            } else {
                1000
            };
            let copy = || {
                // SAFETY: both ranges are live allocations of at least `max` bytes.
                let r = unsafe { sys::cuMemcpyAsync(dst, src, size, stream.cu_stream()) };
                r.result().expect("cuMemcpyAsync");
                event.record(&stream).expect("event record");
                while !event.try_is_complete().expect("event query") {
                    std::hint::spin_loop();
                }
            };
            for _ in 0..(n / 10).max(2) {
                copy();
            }
            let mut total = Duration::ZERO;
            for _ in 0..n {
                let start = Instant::now();
                copy();
                total += start.elapsed();
            }
            let gbps = (size as f64 * n as f64) / total.as_secs_f64() / 1e9;
            println!("{mode:<14} {size:>12} {gbps:>10.2}");
        }
    }
    drop(mapping);
}
