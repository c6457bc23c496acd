//! The CPU-proxy NIC handler driven by real kernels: the ring lives in mapped pinned
//! memory, a kernel posts puts (THREAD and WARP scope) with signals, gets, inline puts
//! and fences; the proxy posts them over libfabric (`tcp;ofi_rxm`, `shm`) to a target
//! proxy in this process whose memory is pinned host memory; data and signals verified.
//! Also measures the GPU post -> proxy -> GPU round trip (printed, not asserted).
//! Skips with a printed reason without a GPU; fails with NIXL_REQUIRE_GPU=1.

use cudarc::driver::{CudaModule, LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::proxy::{CpuProxy, CpuProxyBuilder, FabricTransport, RingMemory};
use gpunetio::{gpu_for_test, DeviceBuffer, Gpu, HostBuffer};
use std::sync::Arc;
use std::time::Duration;

const BLOCK: u64 = 16 << 10;
const BLOCKS: u64 = 64;
const LEN: usize = (BLOCK * BLOCKS) as usize;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

fn module(gpu: &Gpu, name: &str) -> Arc<CudaModule> {
    let (_, src) = gpunetio::DEVICE_SOURCES
        .iter()
        .find(|(n, _)| *n == name)
        .expect("shipped device source");
    let options = CompileOptions::for_gpu(gpu).expect("compute capability");
    let ptx = compile(name, src, &options).expect("compiles");
    gpu.context().load_module(ptx).expect("module loads")
}

fn cfg(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn read_i32(buf: &DeviceBuffer) -> i32 {
    let mut b = [0u8; 4];
    buf.copy_to_host(0, &mut b).expect("status");
    i32::from_le_bytes(b)
}

fn host_word(buf: &HostBuffer, i: usize) -> u64 {
    // SAFETY: inside the buffer; volatile, as the transport writes it.
    unsafe { std::ptr::read_volatile(buf.as_ptr().cast::<u64>().add(i)) }
}

fn host_bytes(buf: &HostBuffer, len: usize) -> Vec<u8> {
    // SAFETY: inside the buffer; volatile reads of memory the transport writes.
    (0..len)
        .map(|i| unsafe { std::ptr::read_volatile(buf.as_ptr().add(i)) })
        .collect()
}

/// Initiator `a` (CUDA ring, proxy thread) and target `b`, over `provider`; `a`'s table:
/// 0 local source (pinned, mapped), 1 local device buffer (get destination), 2 `b`'s
/// destination, 3 `b`'s signal words.
struct Pair {
    a: CpuProxy<FabricTransport>,
    _b: CpuProxy<FabricTransport>,
    src: Arc<HostBuffer>,
    got: Arc<DeviceBuffer>,
    dst: Arc<HostBuffer>,
    sig: Arc<HostBuffer>,
    qp: gpunetio::proxy::ExportedProxyQueuePair,
    got_staged: bool,
}

fn pair(gpu: &Gpu, provider: &str) -> Pair {
    let ring = RingMemory::cuda(gpu, 256, 4).expect("CUDA ring");
    let a = CpuProxyBuilder::new()
        .gpu(gpu)
        .timeout(Duration::from_secs(20))
        .build(FabricTransport::new(provider).expect("transport"), &ring)
        .expect("proxy a");
    let b = CpuProxy::new(
        FabricTransport::new(provider).expect("transport"),
        &RingMemory::host(8, 0).expect("ring b"),
    )
    .expect("proxy b");
    a.connect(&b.local_info().expect("info"))
        .expect("connect a");
    b.connect(&a.local_info().expect("info"))
        .expect("connect b");
    let mut src = HostBuffer::alloc(gpu, LEN).expect("src");
    src.as_mut_slice().copy_from_slice(&pattern(3, LEN));
    let src = Arc::new(src);
    let got = Arc::new(DeviceBuffer::alloc(gpu, LEN).expect("got"));
    got.fill(0).expect("clear");
    let mut dst = HostBuffer::alloc(gpu, LEN).expect("dst");
    dst.as_mut_slice().fill(0);
    let dst = Arc::new(dst);
    let mut sig = HostBuffer::alloc(gpu, 4096).expect("sig");
    sig.as_mut_slice().fill(0);
    let sig = Arc::new(sig);
    assert_eq!(a.register_host_buffer(&src).expect("src"), 0);
    let (g, got_staged) = a.register_device(&got).expect("device buffer");
    assert_eq!(g, 1);
    let bd = b.register_host_buffer(&dst).expect("dst");
    let bs = b.register_host_buffer(&sig).expect("sig");
    assert_eq!(
        a.add_remote(&b.descriptor(bd).expect("desc"))
            .expect("remote"),
        2
    );
    assert_eq!(
        a.add_remote(&b.descriptor(bs).expect("desc"))
            .expect("remote"),
        3
    );
    a.start().expect("proxy thread");
    let qp = a.export().expect("export");
    Pair {
        a,
        _b: b,
        src,
        got,
        dst,
        sig,
        qp,
        got_staged,
    }
}

#[test]
fn gpu_kernels_put_get_signal_through_the_cpu_proxy() {
    let Some(gpu) = gpu_for_test("gpu_kernels_put_get_signal_through_the_cpu_proxy") else {
        return;
    };
    let tests = module(&gpu, "gio_tests.cu");
    let perf = module(&gpu, "gio_perf.cu");
    let stream = gpu.new_stream().expect("stream");
    let status = DeviceBuffer::alloc(&gpu, 4).expect("status");
    for provider in ["tcp;ofi_rxm", "shm"] {
        for (kernel, grid, add) in [
            ("gio_put_thread", cfg(2, 32), 1u64),
            ("gio_put_warp", cfg(2, 64), 2),
        ] {
            let p = pair(&gpu, provider);
            status.fill(0).expect("clear");
            let f = tests.load_function(kernel).expect("kernel");
            let (qp, st, remote_mr, local_mr, signal_mr, signal_off) =
                (p.qp.device_ptr(), status.ptr(), 2u32, 0u32, 3u32, 0u64);
            let mut launch = stream.launch_builder(&f);
            launch
                .arg(&qp)
                .arg(&remote_mr)
                .arg(&local_mr)
                .arg(&BLOCK)
                .arg(&BLOCKS)
                .arg(&signal_mr)
                .arg(&signal_off)
                .arg(&add)
                .arg(&st);
            // SAFETY: (gio_dev_qp*, u32, u32, u64, u64, u32, u64, u64, int*); the queue
            // pair and regions outlive the synchronize.
            unsafe { launch.launch(grid) }.expect("launch");
            stream.synchronize().expect("kernel");
            assert_eq!(read_i32(&status), 0, "{provider} {kernel}: device status");
            assert!(
                p.a.take_error().is_none(),
                "{provider} {kernel}: proxy error"
            );
            assert!(
                host_bytes(&p.dst, LEN) == host_bytes(&p.src, LEN),
                "{provider} {kernel}: data"
            );
            assert_eq!(
                host_word(&p.sig, 0),
                add * BLOCKS,
                "{provider} {kernel}: signals"
            );

            // Get it back into device memory (staged through bounce buffers where the
            // transport cannot register VRAM).
            status.fill(0).expect("clear");
            let g = tests.load_function("gio_get_warp").expect("kernel");
            let (local_mr, remote_mr) = (1u32, 2u32);
            let mut launch = stream.launch_builder(&g);
            launch
                .arg(&qp)
                .arg(&local_mr)
                .arg(&remote_mr)
                .arg(&BLOCK)
                .arg(&BLOCKS)
                .arg(&st);
            // SAFETY: (gio_dev_qp*, u32, u32, u64, u64, int*); as above.
            unsafe { launch.launch(cfg(1, 64)) }.expect("launch");
            stream.synchronize().expect("kernel");
            assert_eq!(read_i32(&status), 0, "{provider} get: device status");
            assert!(
                p.got.to_vec().expect("read") == pattern(3, LEN),
                "{provider} get (staged {})",
                p.got_staged
            );

            // Inline values, a fence, one signal.
            status.fill(0).expect("clear");
            let ps = tests.load_function("gio_p_signal").expect("kernel");
            let (base, count, signal_off) = (500u64, 64u64, 8u64);
            let mut launch = stream.launch_builder(&ps);
            launch
                .arg(&qp)
                .arg(&remote_mr)
                .arg(&base)
                .arg(&count)
                .arg(&signal_mr)
                .arg(&signal_off)
                .arg(&st);
            // SAFETY: (gio_dev_qp*, u32, u64, u64, u32, u64, int*); as above.
            unsafe { launch.launch(cfg(1, 64)) }.expect("launch");
            stream.synchronize().expect("kernel");
            assert_eq!(read_i32(&status), 0, "{provider} p: device status");
            for i in 0..count as usize {
                assert_eq!(
                    host_word(&p.dst, i),
                    base + i as u64,
                    "{provider} value {i}"
                );
            }
            assert_eq!(host_word(&p.sig, 1), 1, "{provider} p: signal");

            // GPU post -> proxy -> GPU round trip (measurement, printed).
            status.fill(0).expect("clear");
            let iters = 2000u64;
            let rtt = DeviceBuffer::alloc(&gpu, 8 * iters as usize).expect("rtt");
            let r = perf.load_function("gio_perf_proxy_rtt").expect("kernel");
            let rtt_ptr = rtt.ptr();
            let mut launch = stream.launch_builder(&r);
            launch.arg(&qp).arg(&iters).arg(&rtt_ptr).arg(&st);
            // SAFETY: (gio_dev_qp*, u64, u64*, int*); as above.
            unsafe { launch.launch(cfg(1, 32)) }.expect("launch");
            stream.synchronize().expect("kernel");
            assert_eq!(read_i32(&status), 0, "{provider} rtt: device status");
            let mut raw = vec![0u8; 8 * iters as usize];
            rtt.copy_to_host(0, &mut raw).expect("read");
            let mut ns: Vec<u64> = raw
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            ns.sort_unstable();
            eprintln!(
                "{provider} {kernel}: GPU post -> proxy -> GPU NOP round trip: median {:.2} us, p99 {:.2} us, min {:.2} us (one way ~ half)",
                ns[ns.len() / 2] as f64 / 1e3,
                ns[ns.len() * 99 / 100] as f64 / 1e3,
                ns[0] as f64 / 1e3
            );
        }
    }
}
