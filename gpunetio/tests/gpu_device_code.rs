//! The device library on a real GPU: the ABI layout as kernels see it, and every
//! high-level call of the intra-node handler (puts, gets, inline puts, signals, fences,
//! bounds errors) in THREAD and WARP scope and the sharing modes, data verified.
//! Skips with a printed reason without a GPU; fails with NIXL_REQUIRE_GPU=1.

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::ffi;
use gpunetio::intra_node::{ExportedQueuePair, IntraNodeQueuePair};
use gpunetio::{gpu_for_test, DeviceBuffer, Gpu};
use std::sync::Arc;
use std::time::Duration;

fn module(gpu: &Gpu, debug: bool) -> Arc<CudaModule> {
    let (name, src) = gpunetio::DEVICE_SOURCES
        .iter()
        .find(|(n, _)| *n == "gio_tests.cu")
        .expect("gio_tests.cu is shipped");
    let mut options = CompileOptions::for_gpu(gpu).expect("compute capability");
    if debug {
        options = options.define("GIO_DEBUG");
    }
    let ptx = compile(name, src, &options).expect("gio_tests.cu compiles");
    gpu.context().load_module(ptx).expect("module loads")
}

fn function(m: &Arc<CudaModule>, name: &str) -> CudaFunction {
    m.load_function(name)
        .unwrap_or_else(|e| panic!("{name}: {e:?}"))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

fn read_i32(buf: &DeviceBuffer) -> i32 {
    let mut b = [0u8; 4];
    buf.copy_to_host(0, &mut b).expect("read status");
    i32::from_le_bytes(b)
}

fn read_u64(buf: &DeviceBuffer, offset: usize) -> u64 {
    let mut b = [0u8; 8];
    buf.copy_to_host(offset, &mut b).expect("read word");
    u64::from_le_bytes(b)
}

/// Two buffers of `len` bytes (source filled with a pattern, destination zeroed), a
/// signal word, and an exported queue pair naming them: (qp, local, remote, signal)
/// with indices local 0, remote 1, signal 2.
struct Setup {
    qp: ExportedQueuePair,
    local: Arc<DeviceBuffer>,
    remote: Arc<DeviceBuffer>,
    signal: Arc<DeviceBuffer>,
    status: DeviceBuffer,
    stream: Arc<CudaStream>,
}

fn setup(gpu: &Gpu, len: usize, seed: u8) -> Setup {
    let local = Arc::new(DeviceBuffer::alloc(gpu, len).expect("local"));
    local
        .copy_from_host(0, &pattern(seed, len))
        .expect("fill local");
    let remote = Arc::new(DeviceBuffer::alloc(gpu, len).expect("remote"));
    remote.fill(0).expect("clear remote");
    let signal = Arc::new(DeviceBuffer::alloc(gpu, 64).expect("signal"));
    signal.fill(0).expect("clear signal");
    let mut table = IntraNodeQueuePair::new(gpu, 2, Duration::from_secs(10));
    assert_eq!(table.register_local(&local).expect("local"), 0);
    assert_eq!(table.add_remote_local(&remote).expect("remote"), 1);
    assert_eq!(table.add_remote_local(&signal).expect("signal"), 2);
    let qp = table.export().expect("export");
    let status = DeviceBuffer::alloc(gpu, 4).expect("status");
    status.fill(0).expect("clear status");
    Setup {
        qp,
        local,
        remote,
        signal,
        status,
        stream: gpu.new_stream().expect("stream"),
    }
}

fn cfg(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[test]
fn gpu_layout_matches_the_rust_mirror() {
    let Some(gpu) = gpu_for_test("gpu_layout_matches_the_rust_mirror") else {
        return;
    };
    let m = module(&gpu, false);
    let f = function(&m, "gio_layout");
    let out = DeviceBuffer::alloc(&gpu, 8 * 128).expect("out");
    let count = DeviceBuffer::alloc(&gpu, 4).expect("count");
    let stream = gpu.new_stream().expect("stream");
    let (out_ptr, count_ptr) = (out.ptr(), count.ptr());
    let mut launch = stream.launch_builder(&f);
    launch.arg(&out_ptr).arg(&count_ptr);
    // SAFETY: gio_layout(u64 *out, int *count) writes at most 128 words and one int,
    // both buffers are large enough and outlive the synchronize below.
    unsafe { launch.launch(cfg(1, 1)) }.expect("launch");
    stream.synchronize().expect("sync");
    let n = read_i32(&count) as usize;
    assert_eq!(n, ffi::LAYOUT.len(), "fields measured on the GPU");
    for (i, (s, field, value)) in ffi::LAYOUT.iter().enumerate() {
        assert_eq!(
            read_u64(&out, 8 * i) as usize,
            *value,
            "{s}.{field} on the GPU"
        );
    }
}

/// Launches a put_blocks kernel: (qp, remote_mr, local_mr, block, blocks, signal_mr,
/// signal_off, signal_add, status).
fn launch_put(s: &Setup, f: &CudaFunction, grid: LaunchConfig, block: u64, blocks: u64, add: u64) {
    let (qp, status) = (s.qp.device_ptr(), s.status.ptr());
    let (remote_mr, local_mr, signal_mr, signal_off) = (1u32, 0u32, 2u32, 0u64);
    let mut launch = s.stream.launch_builder(f);
    launch
        .arg(&qp)
        .arg(&remote_mr)
        .arg(&local_mr)
        .arg(&block)
        .arg(&blocks)
        .arg(&signal_mr)
        .arg(&signal_off)
        .arg(&add)
        .arg(&status);
    // SAFETY: the kernel's parameters match (gio_dev_qp*, u32, u32, u64, u64, u32, u64,
    // u64, int*); the queue pair and every region it names outlive the synchronize.
    unsafe { launch.launch(grid) }.expect("launch");
    s.stream.synchronize().expect("kernel completes");
}

#[test]
fn gpu_intra_node_put_signal_in_every_scope_and_sharing_mode() {
    let Some(gpu) = gpu_for_test("gpu_intra_node_put_signal_in_every_scope_and_sharing_mode")
    else {
        return;
    };
    for debug in [false, true] {
        let m = module(&gpu, debug);
        for (kernel, grid, block, blocks) in [
            ("gio_put_thread", cfg(4, 128), 4096u64, 1000u64),
            ("gio_put_warp", cfg(8, 128), 256 << 10, 37),
            ("gio_put_thread_cta", cfg(1, 256), 1000, 999),
            ("gio_put_exclusive", cfg(1, 32), 65536, 17),
        ] {
            let len = (block * blocks) as usize;
            let s = setup(&gpu, len, blocks as u8);
            launch_put(&s, &function(&m, kernel), grid, block, blocks, 3);
            assert_eq!(read_i32(&s.status), ffi::GIO_OK, "{kernel} status");
            assert!(
                s.remote.to_vec().expect("read") == s.local.to_vec().expect("read"),
                "{kernel} (debug {debug}): data differs"
            );
            assert_eq!(
                read_u64(&s.signal, 0),
                3 * blocks,
                "{kernel}: every signal added once"
            );
        }
    }
}

#[test]
fn gpu_intra_node_get_p_fence_signal_and_bounds() {
    let Some(gpu) = gpu_for_test("gpu_intra_node_get_p_fence_signal_and_bounds") else {
        return;
    };
    let m = module(&gpu, false);
    // get: remote -> local, thread and warp scope.
    for (kernel, grid) in [("gio_get_thread", cfg(2, 64)), ("gio_get_warp", cfg(4, 64))] {
        let s = setup(&gpu, 64 * 8192, 9);
        s.remote
            .copy_from_host(0, &pattern(77, 64 * 8192))
            .expect("fill remote");
        s.local.fill(0).expect("clear local");
        let f = function(&m, kernel);
        let (qp, status) = (s.qp.device_ptr(), s.status.ptr());
        let (local_mr, remote_mr, block, blocks) = (0u32, 1u32, 8192u64, 64u64);
        let mut launch = s.stream.launch_builder(&f);
        launch
            .arg(&qp)
            .arg(&local_mr)
            .arg(&remote_mr)
            .arg(&block)
            .arg(&blocks)
            .arg(&status);
        // SAFETY: (gio_dev_qp*, u32, u32, u64, u64, int*); everything outlives the sync.
        unsafe { launch.launch(grid) }.expect("launch");
        s.stream.synchronize().expect("sync");
        assert_eq!(read_i32(&s.status), ffi::GIO_OK, "{kernel}");
        assert_eq!(
            s.local.to_vec().unwrap(),
            pattern(77, 64 * 8192),
            "{kernel} data"
        );
    }
    // p + fence + signal: 300 inline values then one signal.
    let s = setup(&gpu, 300 * 8, 1);
    let f = function(&m, "gio_p_signal");
    let (qp, status) = (s.qp.device_ptr(), s.status.ptr());
    let (remote_mr, base, count, signal_mr, signal_off) = (1u32, 1000u64, 300u64, 2u32, 0u64);
    let mut launch = s.stream.launch_builder(&f);
    launch
        .arg(&qp)
        .arg(&remote_mr)
        .arg(&base)
        .arg(&count)
        .arg(&signal_mr)
        .arg(&signal_off)
        .arg(&status);
    // SAFETY: (gio_dev_qp*, u32, u64, u64, u32, u64, int*); all outlive the sync.
    unsafe { launch.launch(cfg(3, 128)) }.expect("launch");
    s.stream.synchronize().expect("sync");
    assert_eq!(read_i32(&s.status), ffi::GIO_OK);
    for i in 0..300 {
        assert_eq!(read_u64(&s.remote, 8 * i), 1000 + i as u64, "value {i}");
    }
    assert_eq!(read_u64(&s.signal, 0), 1);
    // Out of bounds: blocks past the end of the regions -> GIO_ERR_BOUNDS, nothing written
    // past them (the in-range blocks are written).
    let s = setup(&gpu, 4 * 4096, 5);
    launch_put(&s, &function(&m, "gio_put_thread"), cfg(1, 32), 4096, 8, 0);
    assert_eq!(read_i32(&s.status), ffi::GIO_ERR_BOUNDS, "out-of-range put");
    assert_eq!(
        s.remote.to_vec().unwrap()[..4 * 4096],
        s.local.to_vec().unwrap()[..4 * 4096]
    );
    let _ = &s.qp.counter(0).expect("counter");
    assert!(
        s.qp.counter(2).is_err(),
        "counter index out of range is an error"
    );
}

/// nvcc on the GPU machine: `$CUDA_HOME/bin`, `/usr/local/cuda/bin`, then `PATH`.
fn find_nvcc() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("CUDA_HOME")
        .map(|h| std::path::PathBuf::from(h).join("bin"))
        .into_iter()
        .collect();
    dirs.push("/usr/local/cuda/bin".into());
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs.into_iter()
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}

/// The shipped headers and every device source compile with nvcc too, as a dependent
/// building its own kernels through `DEP_GPUNETIO_INCLUDE` would (NVRTC, which the crate
/// uses, has its own fixed-width typedefs; nvcc's `uint64_t` is `unsigned long`). Needs
/// nvcc, not a GPU: skips with a printed reason without one, fails with
/// NIXL_REQUIRE_GPU=1.
#[test]
fn device_sources_compile_with_nvcc() {
    let Some(nvcc) = find_nvcc() else {
        assert!(
            !gpunetio::gpu_required(),
            "NIXL_REQUIRE_GPU=1 but no nvcc (CUDA_HOME/bin, /usr/local/cuda/bin, PATH)"
        );
        eprintln!("skipped device_sources_compile_with_nvcc: no nvcc here");
        return;
    };
    let dir = std::env::temp_dir().join(format!("gio-nvcc-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("gpunetio")).expect("temp dir");
    for (name, text) in gpunetio_sys::HEADERS {
        std::fs::write(dir.join(name), text).expect("header");
    }
    for (name, text) in gpunetio::DEVICE_SOURCES {
        let src = dir.join(name);
        std::fs::write(&src, text).expect("source");
        let out = std::process::Command::new(&nvcc)
            .args(["-c", "-std=c++17", "-arch=sm_90", "-I"])
            .arg(&dir)
            .arg("-o")
            .arg(dir.join(format!("{name}.o")))
            .arg(&src)
            .output()
            .expect("nvcc runs");
        assert!(
            out.status.success(),
            "nvcc {name}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
