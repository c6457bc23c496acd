//! The intra-node NIC handler of the device library, measured against the plain copy it
//! replaces:
//!
//! - `put-bw`: a kernel's warps put a message of each size into a buffer of another
//!   process mapped through CUDA IPC (`gio::put` in WARP scope, the message split across
//!   the grid's warps), next to `cuMemcpyAsync` into the same mapping, alternating;
//!   timed per message (launch, then wait: as nixlbench and `copy_bench` time) and
//!   pipelined: all messages in one kernel (as DOCA's `gpunetio_verbs_put_bw` does)
//!   against the same copies queued back to back, messages cycling through 512 MiB;
//! - `lat`: put (8 B) + signal ping-pong between two kernels on two streams of this
//!   process; half a round trip is the time from a put + signal to the peer's polling
//!   kernel seeing it.
//!
//! ```text
//! cargo run --release -p rdma-rs-gpunetio --example gio_bench -- [--sizes 1M,16M] [--iters N] [--modes put-bw,lat]
//! ```

#[path = "common/exporter.rs"]
mod exporter;
use exporter::Exporter;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::intra_node::IntraNodeQueuePair;
use gpunetio::{DeviceBuffer, Gpu, IpcMapping};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    let mut sizes: Vec<usize> = ["1M", "4M", "16M", "64M", "256M"]
        .iter()
        .map(|s| parse_size(s))
        .collect();
    let mut iters = 200usize;
    let mut modes = vec!["put-bw".to_string(), "lat".to_string()];
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
                eprintln!("unknown argument {other}; usage: gio_bench [--sizes 1M,1G] [--iters N] [--modes put-bw,lat]");
                std::process::exit(2);
            }
        }
        i += 1;
    }
    let gpu = Gpu::open(0).expect("GPU 0");
    println!(
        "# {} ({})",
        gpu.name().unwrap_or_default(),
        gpu.pci_bus_id().unwrap_or_default()
    );
    let (_, src) = gpunetio::DEVICE_SOURCES[0];
    let options = CompileOptions::for_gpu(&gpu).expect("compute capability");
    let module = gpu
        .context()
        .load_module(compile("gio_tests.cu", src, &options).expect("compile"))
        .expect("load");
    if modes.iter().any(|m| m == "put-bw") {
        put_bw(
            &gpu,
            &module.load_function("gio_put_bw_warp").expect("kernel"),
            &sizes,
            iters,
        );
    }
    if modes.iter().any(|m| m == "lat") {
        latency(
            &gpu,
            &module.load_function("gio_pingpong").expect("kernel"),
            iters.max(1000),
        );
    }
}

fn put_bw(gpu: &Gpu, kernel: &CudaFunction, sizes: &[usize], iters: usize) {
    let max = *sizes.iter().max().expect("a size");
    // Pipelined messages cycle through a window larger than L2 (50 MB on an H100), so
    // every byte comes from and goes to memory, as distinct messages would.
    let window = max.max(512 << 20);
    let peer = Exporter::start(window);
    let mapping = Arc::new(IpcMapping::open(gpu, &peer.handle).expect("IPC import"));
    let local = Arc::new(DeviceBuffer::alloc(gpu, window).expect("local"));
    let pattern: Vec<u8> = (0..max).map(|i| (i % 251) as u8).collect();
    local.copy_from_host(0, &pattern).expect("fill");
    let mut table = IntraNodeQueuePair::new(gpu, 0, Duration::from_secs(10));
    let local_mr = table.register_local(&local).expect("local");
    let remote_mr = table.add_remote(&mapping).expect("remote");
    let qp = table.export().expect("export");
    let status = DeviceBuffer::alloc(gpu, 4).expect("status");
    status.fill(0).expect("clear");
    let stream = gpu.new_stream().expect("stream");
    let sms = gpu
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .expect("SM count") as usize;
    let event = gpu.context().new_event(None).expect("event");
    let env = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (per_warp, per_sm) = (
        env("GIO_BENCH_PER_WARP", 8192),
        env("GIO_BENCH_WARPS_PER_SM", 16),
    );
    println!(
        "# warps: >= {per_warp} bytes each, <= {per_sm} per SM, {sms} SMs; window {window} bytes"
    );
    println!(
        "{:<22} {:>12} {:>10} {:>10}",
        "mode", "size", "GB/s", "put/copy"
    );
    let wait = || {
        event.record(&stream).expect("record");
        while !event.try_is_complete().expect("query") {
            std::hint::spin_loop();
        }
    };
    for &size in sizes {
        // Warps of at least `per_warp` bytes each, at most `per_sm` per SM.
        let warps = size.div_ceil(per_warp).clamp(1, sms * per_sm);
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(16) as u32, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = if size >= 64 << 20 { iters / 4 } else { iters }.max(8);
        let per_window = window / size;
        // `count` messages in one kernel (1: one launch per message).
        let put = |count: u64| {
            let (qp_ptr, st, size, window) =
                (qp.device_ptr(), status.ptr(), size as u64, window as u64);
            let mut launch = stream.launch_builder(kernel);
            launch
                .arg(&qp_ptr)
                .arg(&remote_mr)
                .arg(&local_mr)
                .arg(&size)
                .arg(&count)
                .arg(&window)
                .arg(&st);
            // SAFETY: gio_put_bw_warp(gio_dev_qp*, u32, u32, u64, u64, u64, int*); the queue
            // pair, both regions (window bytes each) and the status word outlive the wait.
            unsafe { launch.launch(cfg) }.expect("launch");
            wait();
        };
        // `count` copies queued back to back at the same offsets as the puts.
        let copy = |count: usize| {
            for i in 0..count {
                let off = ((i % per_window) * size) as u64;
                // SAFETY: both ranges lie inside live allocations of `window` bytes.
                let r = unsafe {
                    sys::cuMemcpyAsync(
                        mapping.ptr() + off,
                        local.ptr() + off,
                        size,
                        stream.cu_stream(),
                    )
                };
                r.result().expect("cuMemcpyAsync");
            }
            wait();
        };
        for _ in 0..(n / 10).max(2) {
            put(1);
            copy(1);
        }
        // One message per launch (nixlbench's and copy_bench's timing), alternating.
        let (mut t_put, mut t_copy) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..n {
            let t = Instant::now();
            put(1);
            t_put += t.elapsed();
            let t = Instant::now();
            copy(1);
            t_copy += t.elapsed();
        }
        let gbps = |t: Duration, count: usize| (size as f64 * count as f64) / t.as_secs_f64() / 1e9;
        let (put1, copy1) = (gbps(t_put, n), gbps(t_copy, n));
        println!(
            "{:<22} {size:>12} {put1:>10.2} {:>10.3}",
            "put-warp/launch",
            put1 / copy1
        );
        println!("{:<22} {size:>12} {copy1:>10.2}", "ipc-copy/launch");
        // Pipelined: n messages in one kernel against n copies queued back to back.
        let (mut t_put, mut t_copy) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..3 {
            let t = Instant::now();
            put(n as u64);
            t_put += t.elapsed();
            let t = Instant::now();
            copy(n);
            t_copy += t.elapsed();
        }
        let (putn, copyn) = (gbps(t_put, 3 * n), gbps(t_copy, 3 * n));
        println!(
            "{:<22} {size:>12} {putn:>10.2} {:>10.3}",
            "put-warp/pipelined",
            putn / copyn
        );
        println!("{:<22} {size:>12} {copyn:>10.2}", "ipc-copy/pipelined");
        // The data arrived: zero the peer's first message, put once more, read it back.
        // SAFETY: the mapping is live and holds at least `size` bytes.
        let r = unsafe { sys::cuMemsetD8_v2(mapping.ptr(), 0, size) };
        r.result().expect("memset");
        put(1);
        let mut back = vec![0u8; size];
        // SAFETY: `back` holds `size` bytes; the mapping is live.
        let r = unsafe { sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), mapping.ptr(), size) };
        r.result().expect("read back");
        assert!(
            back == pattern[..size],
            "put-warp of {size} bytes: data differs"
        );
        let mut st = [0u8; 4];
        status.copy_to_host(0, &mut st).expect("status");
        assert_eq!(i32::from_le_bytes(st), 0, "device status");
    }
}

fn latency(gpu: &Gpu, kernel: &CudaFunction, iters: usize) {
    // Side A and side B, each with a data word and a signal word the other side puts to.
    let bufs: Vec<Arc<DeviceBuffer>> = (0..4)
        .map(|_| Arc::new(DeviceBuffer::alloc(gpu, 64).expect("buffer")))
        .collect();
    for b in &bufs {
        b.fill(0).expect("clear");
    }
    let (data_a, sig_a, data_b, sig_b) = (&bufs[0], &bufs[1], &bufs[2], &bufs[3]);
    let qp_of =
        |local: &Arc<DeviceBuffer>, remote: &Arc<DeviceBuffer>, remote_sig: &Arc<DeviceBuffer>| {
            let mut t = IntraNodeQueuePair::new(gpu, 0, Duration::from_secs(10));
            t.register_local(local).expect("local");
            t.add_remote_local(remote).expect("remote");
            t.add_remote_local(remote_sig).expect("signal");
            t.export().expect("export")
        };
    let qp_a = qp_of(data_a, data_b, sig_b);
    let qp_b = qp_of(data_b, data_a, sig_a);
    let out = DeviceBuffer::alloc(gpu, 64).expect("out");
    out.fill(0).expect("clear");
    let (sa, sb) = (
        gpu.new_stream().expect("stream"),
        gpu.new_stream().expect("stream"),
    );
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (remote_mr, local_mr, sig_mr, iters_u) = (1u32, 0u32, 2u32, iters as u64);
    let launch = |stream: &Arc<cudarc::driver::CudaStream>,
                  qp: u64,
                  my_sig: u64,
                  initiator: i32,
                  elapsed: u64,
                  status: u64| {
        let mut l = stream.launch_builder(kernel);
        l.arg(&qp)
            .arg(&remote_mr)
            .arg(&local_mr)
            .arg(&sig_mr)
            .arg(&my_sig)
            .arg(&iters_u)
            .arg(&initiator)
            .arg(&elapsed)
            .arg(&status);
        // SAFETY: gio_pingpong(gio_dev_qp*, u32, u32, u32, const u64*, u64, int, u64*, int*);
        // every buffer outlives the synchronize below.
        unsafe { l.launch(one) }.expect("launch");
    };
    // The responder first (it waits), then the initiator, on two streams: they run together.
    launch(
        &sb,
        qp_b.device_ptr(),
        sig_b.ptr(),
        0,
        out.ptr() + 8,
        out.ptr() + 20,
    );
    launch(
        &sa,
        qp_a.device_ptr(),
        sig_a.ptr(),
        1,
        out.ptr(),
        out.ptr() + 16,
    );
    sa.synchronize().expect("initiator");
    sb.synchronize().expect("responder");
    let mut w = [0u8; 24];
    out.copy_to_host(0, &mut w).expect("read");
    let elapsed = u64::from_le_bytes(w[..8].try_into().expect("8"));
    let (st_a, st_b) = (
        i32::from_le_bytes(w[16..20].try_into().expect("4")),
        i32::from_le_bytes(w[20..24].try_into().expect("4")),
    );
    assert_eq!((st_a, st_b), (0, 0), "device statuses");
    println!("{:<18} {:>12} {:>10.3} us one way (put 8 B + signal seen by the peer's polling kernel; {iters} round trips)", "lat", 8, elapsed as f64 / 1e3 / (2 * iters) as f64);
}
