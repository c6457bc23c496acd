//! The GPU device API against the raw `gpunetio` calls it sits on, in one run: put +
//! signal bandwidth per block size at THREAD and WARP level, and signal latency (a
//! ping-pong between two kernels), each through `nixlGpuPost*XferReq` and through
//! `gio::put_signal` / `gio::signal` on the same request's queue pair, alternating.
//!
//! ```text
//! cargo run --release -p rdma-rs-nixl --features gpunetio --example device_api_bench [-- --max MiB --rounds N]
//! ```

use gpunetio::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use gpunetio::{DeviceBuffer, Gpu, HostBuffer};
use nixl::device::{self, RawGpuHandle};
use nixl::{Agent, AgentConfig, Desc, DescList, MemKind, XferOp};
use std::time::Instant;

fn vram(descs: impl IntoIterator<Item = Desc>) -> DescList {
    DescList::from_descs(MemKind::Vram, descs)
}

fn desc(buf: &DeviceBuffer, off: u64, len: u64) -> Desc {
    Desc::new(buf.ptr() + off, len, buf.gpu().ordinal() as u64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Bench {
    gpu: Gpu,
    status: HostBuffer,
}

impl Bench {
    fn status(&mut self) -> i32 {
        i32::from_le_bytes(self.status.as_slice()[..4].try_into().unwrap())
    }

    /// Runs `iters` put+signal of `size` bytes; seconds.
    fn put_signal(
        &mut self,
        f: &CudaFunction,
        h: RawGpuHandle,
        size: u64,
        iters: u32,
        level: u32,
        raw: u32,
    ) -> f64 {
        self.status.as_mut_slice().fill(0);
        let stream = self.gpu.context().default_stream();
        let st = self.status.device_ptr().unwrap();
        let mut l = stream.launch_builder(f);
        l.arg(&h)
            .arg(&size)
            .arg(&iters)
            .arg(&level)
            .arg(&raw)
            .arg(&st);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let t = Instant::now();
        // SAFETY: bench_put_signal(nixlGpuXferReqH, u64, unsigned, unsigned, unsigned,
        // int*); the request's memory outlives the synchronized launch.
        unsafe { l.launch(cfg) }.unwrap();
        stream.synchronize().unwrap();
        let s = t.elapsed().as_secs_f64();
        assert_eq!(self.status(), 0, "device status");
        s
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str, d: u64| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .map(|v| v.parse().expect("a number"))
            .unwrap_or(d)
    };
    let max = arg("--max", 64) << 20;
    let rounds = arg("--rounds", 3) as usize;
    let gpu = Gpu::open(0).expect("a GPU");
    let agent = Agent::new("device-api-bench", AgentConfig::default()).unwrap();
    agent
        .create_backend("GPUNETIO", &Default::default())
        .unwrap();
    let src = DeviceBuffer::alloc(&gpu, max as usize).unwrap();
    let dst = DeviceBuffer::alloc(&gpu, max as usize).unwrap();
    let sigs = DeviceBuffer::alloc(&gpu, 4096).unwrap();
    let one = DeviceBuffer::alloc(&gpu, 4096).unwrap();
    src.fill(7).unwrap();
    sigs.fill(0).unwrap();
    // SAFETY: the buffers live until the end of main.
    let _h = unsafe {
        agent
            .register_mem(
                &vram([
                    desc(&src, 0, max),
                    desc(&dst, 0, max),
                    desc(&sigs, 0, 4096),
                    desc(&one, 0, 4096),
                ]),
                None,
            )
            .unwrap()
    };
    let me = "device-api-bench";
    let req = agent
        .create_xfer_req(
            XferOp::Write,
            &vram([desc(&src, 0, max), desc(&one, 0, 8)]),
            &vram([desc(&dst, 0, max), desc(&sigs, 0, 8)]),
            me,
            None,
        )
        .unwrap();
    let handle = req.create_gpu_xfer_req().unwrap();
    let ptx = gpunetio::device_code::compile(
        "nixl_write_signal.cu",
        device::DEVICE_SOURCES[1].1,
        &device::compile_options(&gpu).unwrap(),
    )
    .unwrap();
    let module = gpu.context().load_module(ptx).unwrap();
    let put = module.load_function("bench_put_signal").unwrap();
    let mut b = Bench {
        status: HostBuffer::alloc(&gpu, 8).unwrap(),
        gpu: gpu.clone(),
    };
    println!("put + signal, one block, device API vs raw gpunetio on the same queue pair (median of {rounds} alternating rounds): raw fused = gio::put_signal, raw pair = gio::put then gio::signal (the two operations the API issues)");
    println!(
        "{:>10} {:>7} {:>10} {:>15} {:>14} {:>12} {:>11}",
        "bytes", "level", "api GB/s", "raw fused GB/s", "raw pair GB/s", "api/fused", "api/pair"
    );
    let mut size = 4096u64;
    while size <= max {
        for (level, name) in [(0u32, "THREAD"), (1, "WARP")] {
            let budget: u64 = if level == 0 { 64 << 20 } else { 512 << 20 };
            let iters = (budget / size).clamp(8, 20_000) as u32;
            let mut gbps = [Vec::new(), Vec::new(), Vec::new()];
            for mode in 0..3u32 {
                // Warm-up of each variant.
                b.put_signal(&put, handle.raw(), size, 2, level, mode);
            }
            for _ in 0..rounds {
                for mode in 0..3u32 {
                    let secs = b.put_signal(&put, handle.raw(), size, iters, level, mode);
                    gbps[mode as usize].push(size as f64 * f64::from(iters) / secs / 1e9);
                }
            }
            let [a, f, p] = gbps.map(median);
            println!(
                "{size:>10} {name:>7} {a:>10.2} {f:>15.2} {p:>14.2} {:>12.3} {:>11.3}",
                a / f,
                a / p
            );
        }
        size *= 4;
    }

    // Signal latency: two requests, each signalling the other side's word.
    let ping_req = agent
        .create_xfer_req(
            XferOp::Write,
            &vram([desc(&one, 0, 8), desc(&one, 8, 8)]),
            &vram([desc(&dst, 0, 8), desc(&sigs, 64, 8)]),
            me,
            None,
        )
        .unwrap();
    let pong_req = agent
        .create_xfer_req(
            XferOp::Write,
            &vram([desc(&one, 0, 8), desc(&one, 8, 8)]),
            &vram([desc(&dst, 0, 8), desc(&sigs, 128, 8)]),
            me,
            None,
        )
        .unwrap();
    let (ping_h, pong_h) = (
        ping_req.create_gpu_xfer_req().unwrap(),
        pong_req.create_gpu_xfer_req().unwrap(),
    );
    let ping = module.load_function("bench_ping").unwrap();
    let pong = module.load_function("bench_pong").unwrap();
    let ns = DeviceBuffer::alloc(&gpu, 8).unwrap();
    let pong_stream = gpu.new_stream().unwrap();
    let ping_stream = gpu.new_stream().unwrap();
    let iters = 10_000u32;
    let timeout = 5_000_000_000u64;
    let one_way = |raw: u32, b: &mut Bench| -> f64 {
        sigs.fill(0).unwrap();
        b.status.as_mut_slice().fill(0);
        let st = b.status.device_ptr().unwrap();
        // ping waits on word 128 (pong signals it), pong on word 64 (ping signals it).
        let (mine_ping, mine_pong) = (sigs.ptr() + 128, sigs.ptr() + 64);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (h2, ns_ptr) = (pong_h.raw(), ns.ptr());
        let mut l = pong_stream.launch_builder(&pong);
        l.arg(&h2)
            .arg(&mine_pong)
            .arg(&iters)
            .arg(&raw)
            .arg(&timeout)
            .arg(&st);
        // SAFETY: bench_pong(nixlGpuXferReqH, const u64*, unsigned, unsigned, u64, int*).
        unsafe { l.launch(cfg) }.unwrap();
        let h1 = ping_h.raw();
        let mut l = ping_stream.launch_builder(&ping);
        l.arg(&h1)
            .arg(&mine_ping)
            .arg(&iters)
            .arg(&raw)
            .arg(&timeout)
            .arg(&ns_ptr)
            .arg(&st);
        // SAFETY: bench_ping(nixlGpuXferReqH, const u64*, unsigned, unsigned, u64, u64*, int*).
        unsafe { l.launch(cfg) }.unwrap();
        ping_stream.synchronize().unwrap();
        pong_stream.synchronize().unwrap();
        assert_eq!(b.status(), 0, "ping-pong status");
        let t = u64::from_le_bytes(ns.to_vec().unwrap()[..8].try_into().unwrap());
        t as f64 / f64::from(iters) / 2.0 / 1000.0
    };
    one_way(0, &mut b);
    one_way(1, &mut b);
    let (mut api, mut raw) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        api.push(one_way(0, &mut b));
        raw.push(one_way(1, &mut b));
    }
    let (a, r) = (median(api), median(raw));
    println!("signal one-way latency (ping-pong / 2, {iters} round trips): api {a:.3} us, raw {r:.3} us, ratio raw/api {:.3}", r / a);
}
