//! The intra-node NIC handler between two processes: this process's kernel puts (WARP
//! scope) with a signal into a peer process's buffer mapped through CUDA IPC while the
//! peer's kernel polls its signal word, then gets the peer's data back; both sides verify.
//! Skips with a printed reason without a GPU; fails with NIXL_REQUIRE_GPU=1.

use cudarc::driver::{CudaModule, LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::intra_node::IntraNodeQueuePair;
use gpunetio::{gpu_for_test, DeviceBuffer, Gpu, IpcHandle, IpcMapping};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK: u64 = 64 << 10;
const BLOCKS: u64 = 48;
const LEN: usize = (BLOCK * BLOCKS) as usize;
const TIMEOUT: Duration = Duration::from_secs(60);

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed)
        .collect()
}

fn module(gpu: &Gpu) -> Arc<CudaModule> {
    let (name, src) = gpunetio::DEVICE_SOURCES
        .iter()
        .find(|(n, _)| *n == "gio_tests.cu")
        .expect("gio_tests.cu is shipped");
    let options = CompileOptions::for_gpu(gpu).expect("compute capability");
    let ptx = compile(name, src, &options).expect("gio_tests.cu compiles");
    gpu.context().load_module(ptx).expect("module loads")
}

fn one_warp() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn hex(h: &IpcHandle) -> String {
    h.as_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> IpcHandle {
    let bytes: Vec<u8> = (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    IpcHandle::from_bytes(&bytes).expect("64 bytes")
}

/// The peer process: exports a destination buffer, a signal word and a source buffer,
/// then waits in a kernel for the signal and checks the data it announced.
#[test]
fn gpu_intra_node_peer_main() {
    let Ok(announce) = std::env::var("GIO_PEER_ANNOUNCE") else {
        return;
    };
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(120));
        std::process::exit(3);
    });
    let gpu = Gpu::open(0).expect("GPU 0");
    let m = module(&gpu);
    let data = DeviceBuffer::alloc(&gpu, LEN).expect("data");
    data.fill(0).expect("clear");
    let signal = DeviceBuffer::alloc(&gpu, 64).expect("signal");
    signal.fill(0).expect("clear");
    let source = DeviceBuffer::alloc(&gpu, LEN).expect("source");
    source.copy_from_host(0, &pattern(99, LEN)).expect("fill");
    let handles = [&data, &signal, &source].map(|b| hex(&b.export_ipc().expect("export")));
    std::fs::write(format!("{announce}.tmp"), handles.join(" ")).expect("announce");
    std::fs::rename(format!("{announce}.tmp"), &announce).expect("announce");
    // A queue pair with no regions, for the wait's timeout.
    let qp = IntraNodeQueuePair::new(&gpu, 0, Duration::from_secs(30))
        .export()
        .expect("export");
    let out = DeviceBuffer::alloc(&gpu, 16).expect("out");
    out.fill(0).expect("clear");
    let f = m.load_function("gio_signal_wait").expect("kernel");
    let stream = gpu.new_stream().expect("stream");
    let (qp_ptr, word, value, waited, status) = (
        qp.device_ptr(),
        signal.ptr(),
        BLOCKS,
        out.ptr(),
        out.ptr() + 8,
    );
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(&qp_ptr)
        .arg(&word)
        .arg(&value)
        .arg(&waited)
        .arg(&status);
    // SAFETY: gio_signal_wait(gio_dev_qp*, const u64*, u64, u64*, int*); every buffer
    // outlives the synchronize.
    unsafe { launch.launch(one_warp()) }.expect("launch");
    stream.synchronize().expect("wait kernel");
    let mut w = [0u8; 12];
    out.copy_to_host(0, &mut w).expect("read");
    let st = i32::from_le_bytes(w[8..12].try_into().expect("4"));
    let ok = st == 0 && data.to_vec().expect("read") == pattern(7, LEN);
    std::fs::write(
        format!("{announce}.result"),
        format!("{} status {st}", if ok { "OK" } else { "BAD" }),
    )
    .expect("result");
    // Live until the parent has read our source buffer (it closes our stdin).
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

fn wait_file(path: &str, child: &mut Child) -> String {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text;
        }
        assert!(Instant::now() < deadline, "{path} never appeared");
        assert!(
            child.try_wait().expect("try_wait").is_none(),
            "the peer exited early waiting for {path}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn gpu_intra_node_put_signal_and_get_between_two_processes() {
    let Some(gpu) = gpu_for_test("gpu_intra_node_put_signal_and_get_between_two_processes") else {
        return;
    };
    let m = module(&gpu);
    let announce = std::env::temp_dir()
        .join(format!("gio-peer-{}", std::process::id()))
        .display()
        .to_string();
    for suffix in ["", ".tmp", ".result"] {
        let _ = std::fs::remove_file(format!("{announce}{suffix}"));
    }
    let mut child = Command::new(std::env::current_exe().expect("own path"))
        .args([
            "--exact",
            "gpu_intra_node_peer_main",
            "--test-threads=1",
            "--nocapture",
        ])
        .env("GIO_PEER_ANNOUNCE", &announce)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn the peer");
    let text = wait_file(&announce, &mut child);
    let maps: Vec<Arc<IpcMapping>> = text
        .split_whitespace()
        .map(|h| Arc::new(IpcMapping::open(&gpu, &unhex(h)).expect("import")))
        .collect();
    assert_eq!(maps.len(), 3);
    let src = Arc::new(DeviceBuffer::alloc(&gpu, LEN).expect("src"));
    src.copy_from_host(0, &pattern(7, LEN)).expect("fill");
    let dst = Arc::new(DeviceBuffer::alloc(&gpu, LEN).expect("dst"));
    dst.fill(0).expect("clear");
    let mut table = IntraNodeQueuePair::new(&gpu, 0, Duration::from_secs(30));
    let src_mr = table.register_local(&src).expect("src");
    let data_mr = table.add_remote(&maps[0]).expect("peer data");
    let signal_mr = table.add_remote(&maps[1]).expect("peer signal");
    let source_mr = table.add_remote(&maps[2]).expect("peer source");
    let dst_mr = table.register_local(&dst).expect("dst");
    let qp = table.export().expect("export");
    let status = DeviceBuffer::alloc(&gpu, 4).expect("status");
    status.fill(0).expect("clear");
    let stream = gpu.new_stream().expect("stream");
    let grid = LaunchConfig {
        grid_dim: (4, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };

    // Put every block with a signal of 1: the peer's kernel waits for BLOCKS.
    let put = m.load_function("gio_put_warp").expect("kernel");
    let (qp_ptr, st, signal_off, add) = (qp.device_ptr(), status.ptr(), 0u64, 1u64);
    let mut launch = stream.launch_builder(&put);
    launch
        .arg(&qp_ptr)
        .arg(&data_mr)
        .arg(&src_mr)
        .arg(&BLOCK)
        .arg(&BLOCKS)
        .arg(&signal_mr)
        .arg(&signal_off)
        .arg(&add)
        .arg(&st);
    // SAFETY: gio_put_warp(gio_dev_qp*, u32, u32, u64, u64, u32, u64, u64, int*); the queue
    // pair and the regions (mappings kept by it) outlive the synchronize.
    unsafe { launch.launch(grid) }.expect("launch put");
    stream.synchronize().expect("put kernel");
    let mut b = [0u8; 4];
    status.copy_to_host(0, &mut b).expect("status");
    assert_eq!(i32::from_le_bytes(b), 0, "put status");
    let verdict = wait_file(&format!("{announce}.result"), &mut child);
    assert!(verdict.starts_with("OK"), "the peer saw: {verdict}");

    // Get the peer's source buffer into ours.
    let get = m.load_function("gio_get_warp").expect("kernel");
    let mut launch = stream.launch_builder(&get);
    launch
        .arg(&qp_ptr)
        .arg(&dst_mr)
        .arg(&source_mr)
        .arg(&BLOCK)
        .arg(&BLOCKS)
        .arg(&st);
    // SAFETY: gio_get_warp(gio_dev_qp*, u32, u32, u64, u64, int*); as above.
    unsafe { launch.launch(grid) }.expect("launch get");
    stream.synchronize().expect("get kernel");
    status.copy_to_host(0, &mut b).expect("status");
    assert_eq!(i32::from_le_bytes(b), 0, "get status");
    assert!(
        dst.to_vec().expect("read") == pattern(99, LEN),
        "got the peer's data"
    );
    drop(child.stdin.take());
    let code = child.wait().expect("peer exit");
    assert!(code.success(), "peer exit {code}");
    for suffix in ["", ".result"] {
        let _ = std::fs::remove_file(format!("{announce}{suffix}"));
    }
}
