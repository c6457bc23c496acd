//! `gpunetio-write-lat`: latency of GPU-initiated put + signal, as DOCA's
//! `gpunetio_verbs_write_lat` (an `ib_write_lat`-like ping-pong) measures it: the
//! initiator's kernel puts `size` bytes with a signal into the responder's memory and
//! polls its own signal word for the answer; the responder's kernel polls, then answers
//! the same way. Half of each round trip is reported, as perftest does.
//!
//! ```text
//! gpunetio-write-lat [-a | -s BYTES] [-n ITERS] [-p intra_node] [-d GPU]
//! ```
//! Each side is one warp (WARP scope above 512 B: its lanes copy the message together;
//! lane 0 alone in THREAD scope below, which is quicker than the warp's barrier). Messages
//! over 64 KiB get proportionally fewer round trips (at least 100). NIC handler
//! `intra_node` with both sides on one GPU: the two kernels run in this
//! process on two streams (kernels of two processes time-slice one GPU unless MPS runs,
//! which would measure the scheduler, not the put).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::intra_node::IntraNodeQueuePair;
use gpunetio::{cudarc, DeviceBuffer, Gpu};
use std::sync::Arc;
use std::time::Duration;

fn usage() -> ! {
    eprintln!("usage: gpunetio-write-lat [-a | -s BYTES] [-n ITERS] [-p intra_node] [-d GPU]");
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut sizes, mut iters, mut gpu_id) = (vec![8usize], 1000u64, 0usize);
    let mut i = 0;
    while i < args.len() {
        let value = |i: usize| args.get(i + 1).cloned().unwrap_or_else(|| usage());
        match args[i].as_str() {
            "-a" | "--all" => sizes = (1..=23).map(|p| 1usize << p).collect(),
            "-s" | "--size" => sizes = vec![value(i).parse().unwrap_or_else(|_| usage())],
            "-n" | "--iters" => iters = value(i).parse().unwrap_or_else(|_| usage()),
            "-d" | "--gpu" => gpu_id = value(i).parse().unwrap_or_else(|_| usage()),
            "-p" | "--nic-handler" => {
                if value(i) != "intra_node" {
                    eprintln!("gpunetio-write-lat: only the intra_node NIC handler is available in this build");
                    std::process::exit(2);
                }
            }
            _ => usage(),
        }
        i += if matches!(args[i].as_str(), "-a" | "--all") {
            1
        } else {
            2
        };
    }
    if let Err(e) = run(&sizes, iters.max(1), gpu_id) {
        eprintln!("gpunetio-write-lat: {e}");
        std::process::exit(1);
    }
}

fn run(sizes: &[usize], iters: u64, gpu_id: usize) -> Result<(), String> {
    let gpu = Gpu::open(gpu_id).map_err(|e| e.to_string())?;
    let max = *sizes.iter().max().ok_or("no size")?;
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
    let (_, source) = gpunetio::DEVICE_SOURCES
        .iter()
        .find(|(n, _)| *n == "gio_perf.cu")
        .ok_or("gio_perf.cu is not shipped")?;
    let options = CompileOptions::for_gpu(&gpu).map_err(|e| e.to_string())?;
    let ptx = compile("gio_perf.cu", source, &options).map_err(|e| e.to_string())?;
    let module = gpu
        .context()
        .load_module(ptx)
        .map_err(|e| format!("{e:?}"))?;
    let kernel = module
        .load_function("gio_perf_write_lat")
        .map_err(|e| format!("{e:?}"))?;
    let rtt = DeviceBuffer::alloc(&gpu, 8 * iters as usize).map_err(|e| e.to_string())?;
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
        "# gpunetio-write-lat: {} ({}), NIC handler intra_node, both kernels on this GPU",
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
        for b in [&sig_a, &sig_b, &status] {
            b.fill(0).map_err(|e| e.to_string())?;
        }
        let (remote_mr, local_mr, signal_mr, size_u) = (1u32, 0u32, 2u32, size as u64);
        let launch = |stream: &Arc<cudarc::driver::CudaStream>,
                      qp: u64,
                      my_sig: u64,
                      initiator: i32,
                      st: u64| {
            let rtt_ptr = rtt.ptr();
            let mut l = stream.launch_builder(&kernel);
            l.arg(&qp)
                .arg(&remote_mr)
                .arg(&local_mr)
                .arg(&signal_mr)
                .arg(&my_sig)
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
        launch(&sb, qp_b.device_ptr(), sig_b.ptr(), 0, status.ptr() + 4)?;
        launch(&sa, qp_a.device_ptr(), sig_a.ptr(), 1, status.ptr())?;
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
