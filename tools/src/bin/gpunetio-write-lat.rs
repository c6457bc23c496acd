//! `gpunetio-write-lat`: latency of GPU-initiated put + signal, as DOCA's
//! `gpunetio_verbs_write_lat` (an `ib_write_lat`-like ping-pong) measures it: the
//! initiator's kernel puts `size` bytes with a signal into the responder's memory and
//! polls its own signal word for the answer; the responder's kernel polls, then answers
//! the same way. Half of each round trip is reported, as perftest does.
//!
//! ```text
//! gpunetio-write-lat [-a | -s BYTES] [-n ITERS] [-p intra_node|cpu_proxy] [-d GPU]
//!                    [--provider PROV] [--mem auto|vram|dram]
//! ```
//! Each side is one warp (WARP scope above 512 B: its lanes copy the message together;
//! lane 0 alone in THREAD scope below, which is quicker than the warp's barrier). Messages
//! over 64 KiB get proportionally fewer round trips (at least 100). NIC handler
//! `intra_node` with both sides on one GPU: the two kernels run in this
//! process on two streams (kernels of two processes time-slice one GPU unless MPS runs,
//! which would measure the scheduler, not the put). NIC handler `cpu_proxy`: the same two
//! kernels, each side with its own CUDA ring, CPU proxy thread and libfabric endpoint
//! of `--provider` (default `shm`), connected to each other; data and signal words in
//! VRAM where the provider registers it directly, else pinned host memory the kernels
//! poll over PCIe (`--mem` forces one).

#[path = "../gio_cpu_proxy.rs"]
mod gio_cpu_proxy;

use clap::Parser;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::intra_node::IntraNodeQueuePair;
use gpunetio::{cudarc, DeviceBuffer, Gpu};
use std::sync::Arc;
use std::time::Duration;

/// Latency of GPU-initiated put + signal, as DOCA's gpunetio_verbs_write_lat measures it
#[derive(Parser, Debug)]
#[command(
    name = "gpunetio-write-lat",
    version,
    max_term_width = 100,
    after_help = "RUST_LOG sets the libraries' log (default: warnings)."
)]
struct Cli {
    /// Every size from 2 B to 8 MiB
    #[arg(short = 'a', long = "all", conflicts_with = "size")]
    all: bool,
    /// Message size in bytes
    #[arg(short = 's', long = "size", value_name = "BYTES", default_value_t = 8,
          value_parser = positive)]
    size: usize,
    /// Round trips (fewer for messages over 64 KiB, at least 100)
    #[arg(short = 'n', long = "iters", value_name = "ITERS", default_value_t = 1000,
          value_parser = positive)]
    iters: usize,
    /// NIC handler
    #[arg(short = 'p', long = "nic-handler", value_name = "HANDLER", default_value = "intra_node",
          value_parser = ["intra_node", "cpu_proxy"])]
    handler: String,
    /// CUDA device
    #[arg(short = 'd', long = "gpu", value_name = "GPU", default_value_t = 0)]
    gpu: usize,
    /// cpu_proxy: libfabric provider
    #[arg(long = "provider", value_name = "PROV", default_value = "shm")]
    provider: String,
    /// cpu_proxy: where each side's memory lives
    #[arg(long = "mem", value_enum, default_value_t = gio_cpu_proxy::MemChoice::Auto)]
    mem: gio_cpu_proxy::MemChoice,
}

fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{text}` is not a whole number")),
    }
}

fn main() {
    tools::cli::init_tracing();
    let cli: Cli = tools::cli::parse_or_exit("gpunetio-write-lat");
    let sizes: Vec<usize> = if cli.all {
        (1..=23).map(|p| 1usize << p).collect()
    } else {
        vec![cli.size]
    };
    if let Err(e) = gio_cpu_proxy::check_gpu(cli.gpu) {
        tools::cli::fail("gpunetio-write-lat", e);
    }
    let proxy = (cli.handler == "cpu_proxy").then_some((cli.provider.as_str(), cli.mem));
    if let Err(e) = run(&sizes, cli.iters as u64, cli.gpu, proxy) {
        tools::cli::fail("gpunetio-write-lat", e);
    }
}

/// One side's kernel arguments: queue pair, its signal word (device address), and the
/// regions (remote data, local data, remote signal).
struct SideArgs {
    qp: u64,
    my_sig: u64,
    remote_mr: u32,
    local_mr: u32,
    signal_mr: u32,
}

fn run(
    sizes: &[usize],
    iters: u64,
    gpu_id: usize,
    proxy: Option<(&str, gio_cpu_proxy::MemChoice)>,
) -> Result<(), String> {
    let gpu = Gpu::open(gpu_id).map_err(|e| e.to_string())?;
    let max = *sizes.iter().max().ok_or("no size")?;
    if let Some((provider, mem)) = proxy {
        let mut a = gio_cpu_proxy::side(&gpu, provider, mem, &[max, 64], 256)?;
        let mut b = gio_cpu_proxy::side(&gpu, provider, mem, &[max, 64], 256)?;
        let (ai, bi) = (a.info_words()?, b.info_words()?);
        let ra = a.connect(&bi.split_whitespace().collect::<Vec<_>>())?;
        let rb = b.connect(&ai.split_whitespace().collect::<Vec<_>>())?;
        a.start()?;
        b.start()?;
        let args = |s: &gio_cpu_proxy::Side, remote: &[u32]| -> Result<SideArgs, String> {
            Ok(SideArgs {
                qp: s.qp.as_ref().ok_or("no exported queue pair")?.device_ptr(),
                my_sig: s.mems[1].device_ptr()?,
                remote_mr: remote[0],
                local_mr: s.mrs[0],
                signal_mr: remote[1],
            })
        };
        let (sa, sb) = (args(&a, &ra)?, args(&b, &rb)?);
        let label = format!(
            "cpu_proxy over {provider}, memory {}, a proxy thread per side",
            a.placement()
        );
        let reset = || -> Result<(), String> {
            a.check()?;
            b.check()?;
            a.mems[1].zero()?;
            b.mems[1].zero()
        };
        return ping_pong(&gpu, sizes, iters, &label, [sa, sb], &reset);
    }
    let alloc = |len: usize| -> Result<Arc<DeviceBuffer>, String> {
        let b = DeviceBuffer::alloc(&gpu, len).map_err(|e| e.to_string())?;
        b.fill(0).map_err(|e| e.to_string())?;
        Ok(Arc::new(b))
    };
    let (data_a, sig_a, data_b, sig_b) = (alloc(max)?, alloc(64)?, alloc(max)?, alloc(64)?);
    let qp_of =
        |local: &Arc<DeviceBuffer>, remote: &Arc<DeviceBuffer>, signal: &Arc<DeviceBuffer>| {
            let mut t = IntraNodeQueuePair::new(&gpu, 0, Duration::from_secs(30));
            t.register_local(local)?;
            t.add_remote_local(remote)?;
            t.add_remote_local(signal)?;
            t.export()
        };
    let qp_a = qp_of(&data_a, &data_b, &sig_b).map_err(|e| e.to_string())?;
    let qp_b = qp_of(&data_b, &data_a, &sig_a).map_err(|e| e.to_string())?;
    let side = |qp: u64, sig: &Arc<DeviceBuffer>| SideArgs {
        qp,
        my_sig: sig.ptr(),
        remote_mr: 1,
        local_mr: 0,
        signal_mr: 2,
    };
    let sides = [
        side(qp_a.device_ptr(), &sig_a),
        side(qp_b.device_ptr(), &sig_b),
    ];
    let reset = || -> Result<(), String> {
        sig_a.fill(0).map_err(|e| e.to_string())?;
        sig_b.fill(0).map_err(|e| e.to_string())
    };
    ping_pong(
        &gpu,
        sizes,
        iters,
        "intra_node, both kernels on this GPU",
        sides,
        &reset,
    )
}

/// Runs the two kernels per size and prints the columns.
fn ping_pong(
    gpu: &Gpu,
    sizes: &[usize],
    iters: u64,
    label: &str,
    [a, b]: [SideArgs; 2],
    reset: &dyn Fn() -> Result<(), String>,
) -> Result<(), String> {
    let alloc = |len: usize| -> Result<Arc<DeviceBuffer>, String> {
        let b = DeviceBuffer::alloc(gpu, len).map_err(|e| e.to_string())?;
        b.fill(0).map_err(|e| e.to_string())?;
        Ok(Arc::new(b))
    };
    let (_, source) = gpunetio::DEVICE_SOURCES
        .iter()
        .find(|(n, _)| *n == "gio_perf.cu")
        .ok_or("gio_perf.cu is not shipped")?;
    let options = CompileOptions::for_gpu(gpu).map_err(|e| e.to_string())?;
    let ptx = compile("gio_perf.cu", source, &options).map_err(|e| e.to_string())?;
    let module = gpu
        .context()
        .load_module(ptx)
        .map_err(|e| format!("{e:?}"))?;
    let kernel = module
        .load_function("gio_perf_write_lat")
        .map_err(|e| format!("{e:?}"))?;
    let rtt = DeviceBuffer::alloc(gpu, 8 * iters as usize).map_err(|e| e.to_string())?;
    let status = alloc(8)?;
    let (sa, sb) = (
        gpu.new_stream().map_err(|e| e.to_string())?,
        gpu.new_stream().map_err(|e| e.to_string())?,
    );
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    println!(
        "# gpunetio-write-lat: {} ({}), NIC handler {label}",
        gpu.name().unwrap_or_default(),
        gpu.pci_bus_id().unwrap_or_default()
    );
    println!(
        "{:>10} {:>12} {:>12} {:>12} {:>16} {:>12} {:>14} {:>22} {:>24}",
        "#bytes",
        "#iterations",
        "t_min[usec]",
        "t_max[usec]",
        "t_typical[usec]",
        "t_avg[usec]",
        "t_stdev[usec]",
        "99% percentile[usec]",
        "99.9% percentile[usec]"
    );
    for &size in sizes {
        // Large messages: fewer round trips (at least 100), as the time per size is bounded.
        let iters = if size > 64 << 10 {
            (iters * (64 << 10) / size as u64).max(100).min(iters)
        } else {
            iters
        };
        reset()?;
        status.fill(0).map_err(|e| e.to_string())?;
        let size_u = size as u64;
        let launch =
            |stream: &Arc<cudarc::driver::CudaStream>, side: &SideArgs, initiator: i32, st: u64| {
                let rtt_ptr = rtt.ptr();
                let mut l = stream.launch_builder(&kernel);
                l.arg(&side.qp)
                    .arg(&side.remote_mr)
                    .arg(&side.local_mr)
                    .arg(&side.signal_mr)
                    .arg(&side.my_sig)
                    .arg(&size_u)
                    .arg(&iters)
                    .arg(&initiator)
                    .arg(&rtt_ptr)
                    .arg(&st);
                // SAFETY: gio_perf_write_lat(gio_dev_qp*, u32, u32, u32, const u64*, u64, u64,
                // int, u64*, int*); every buffer outlives the synchronizes below.
                unsafe { l.launch(one) }.map_err(|e| format!("launch: {e:?}"))
            };
        // The responder first (it waits), then the initiator; both run at once.
        launch(&sb, &b, 0, status.ptr() + 4)?;
        launch(&sa, &a, 1, status.ptr())?;
        sa.synchronize().map_err(|e| format!("initiator: {e:?}"))?;
        sb.synchronize().map_err(|e| format!("responder: {e:?}"))?;
        let mut st = [0u8; 8];
        status.copy_to_host(0, &mut st).map_err(|e| e.to_string())?;
        if st != [0; 8] {
            return Err(format!(
                "device statuses {:?} (gpunetio_sys::GIO_ERR_*)",
                st
            ));
        }
        let mut raw = vec![0u8; 8 * iters as usize];
        rtt.copy_to_host(0, &mut raw).map_err(|e| e.to_string())?;
        // One-way latency: half of each round trip, in microseconds.
        let mut lat: Vec<f64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as f64 / 2e3)
            .collect();
        lat.sort_by(f64::total_cmp);
        let n = lat.len();
        let avg = lat.iter().sum::<f64>() / n as f64;
        let stdev = (lat.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / n as f64).sqrt();
        let pct = |p: f64| lat[((n as f64 * p).ceil() as usize).clamp(1, n) - 1];
        println!(
            "{size:>10} {iters:>12} {:>12.2} {:>12.2} {:>16.2} {avg:>12.2} {stdev:>14.2} {:>22.2} {:>24.2}",
            lat[0],
            lat[n - 1],
            lat[n / 2],
            pct(0.99),
            pct(0.999)
        );
    }
    Ok(())
}
