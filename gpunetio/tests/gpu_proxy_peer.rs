//! The CPU-proxy NIC handler between two processes: this process's kernels put (THREAD
//! and WARP scope) with signals, get, and write inline values + fence + signal through a
//! `CpuProxy` over libfabric (`tcp;ofi_rxm`, `shm`, and shm with write ordering) into a
//! peer process, whose own kernel spins on its signal word and whose host side then
//! checks the data. The peer's memory is VRAM where its transport registers device
//! memory directly (`FI_HMEM` with RMA and atomics), else pinned host memory its kernel
//! maps (printed as `placement`). This side's source and get destination are VRAM
//! (staged through bounce buffers where not registrable).
//! Skips with a printed reason without a GPU; fails with NIXL_REQUIRE_GPU=1.

use cudarc::driver::{CudaModule, LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::proxy::{CpuProxy, CpuProxyBuilder, FabricTransport, RemoteDescriptor, RingMemory};
use gpunetio::{gpu_for_test, DeviceBuffer, Gpu, HostBuffer};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK: u64 = 16 << 10;
const BLOCKS: u64 = 64;
const LEN: usize = (BLOCK * BLOCKS) as usize;
const TIMEOUT: Duration = Duration::from_secs(60);

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
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

fn cfg(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

fn read_i32(buf: &DeviceBuffer) -> i32 {
    let mut b = [0u8; 4];
    buf.copy_to_host(0, &mut b).expect("status");
    i32::from_le_bytes(b)
}

fn open(prov: &str, ordered: bool) -> FabricTransport {
    if ordered {
        FabricTransport::new_ordered(prov)
    } else {
        FabricTransport::new(prov)
    }
    .unwrap_or_else(|e| panic!("{prov}: {e}"))
}

/// The peer's memory: VRAM registered directly, or pinned mapped host memory.
enum PeerMem {
    Vram(Arc<DeviceBuffer>),
    Dram(Arc<HostBuffer>),
}

impl PeerMem {
    fn place(gpu: &Gpu, proxy: &CpuProxy<FabricTransport>, len: usize) -> (u32, PeerMem) {
        let buf = Arc::new(DeviceBuffer::alloc(gpu, len).expect("VRAM"));
        buf.fill(0).expect("clear");
        let (mr, staged) = proxy.register_device(&buf).expect("register VRAM");
        if !staged {
            return (mr, PeerMem::Vram(buf));
        }
        // A staged region cannot be a peer's target: pinned host memory instead (the
        // staged table entry stays unused).
        let mut host = HostBuffer::alloc(gpu, len).expect("pinned");
        host.as_mut_slice().fill(0);
        let host = Arc::new(host);
        let mr = proxy.register_host_buffer(&host).expect("register DRAM");
        (mr, PeerMem::Dram(host))
    }
    fn device_ptr(&self) -> u64 {
        match self {
            PeerMem::Vram(b) => b.ptr(),
            PeerMem::Dram(b) => b.device_ptr().expect("mapped"),
        }
    }
    fn bytes(&self, len: usize) -> Vec<u8> {
        match self {
            PeerMem::Vram(b) => {
                let mut v = vec![0; len];
                b.copy_to_host(0, &mut v).expect("read");
                v
            }
            // SAFETY: inside the buffer; volatile reads of memory the transport writes.
            PeerMem::Dram(b) => (0..len)
                .map(|i| unsafe { std::ptr::read_volatile(b.as_ptr().add(i)) })
                .collect(),
        }
    }
    fn name(&self) -> &'static str {
        match self {
            PeerMem::Vram(_) => "vram",
            PeerMem::Dram(_) => "dram",
        }
    }
}

/// The peer process: a proxy (thread running) with a destination buffer and signal words,
/// announced on stdout; for each `WAIT word value what args` line on stdin its kernel
/// waits until signal word `word` reaches `value`, then the host checks the destination
/// (`data SEED`: the whole buffer is `pattern(SEED)`; `values BASE COUNT`: word i is
/// BASE + i) and answers `OK` or `BAD why`.
#[test]
#[ignore = "the peer process of gpu_kernels_through_the_cpu_proxy_to_a_peer_process; run by it"]
fn gpu_proxy_peer_main() {
    let Ok(prov) = std::env::var("GIO_PROXY_PEER_PROV") else {
        return;
    };
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(300));
        eprintln!("gpu_proxy_peer_main: watchdog");
        std::process::exit(3);
    });
    let ordered = std::env::var_os("GIO_PROXY_PEER_ORDERED").is_some();
    let gpu = Gpu::open(0).expect("GPU 0");
    let m = module(&gpu);
    let ring = RingMemory::cuda(&gpu, 8, 0).expect("ring");
    let proxy = CpuProxyBuilder::new()
        .gpu(&gpu)
        .busy_poll(true)
        .timeout(Duration::from_secs(30))
        .build(open(&prov, ordered), &ring)
        .expect("proxy");
    let (d, dst) = PeerMem::place(&gpu, &proxy, LEN);
    let (s, sig) = PeerMem::place(&gpu, &proxy, 4096);
    println!("NAME {}", hex(&proxy.local_info().expect("name")));
    println!("DST {}", hex(&proxy.descriptor(d).expect("dst").to_bytes()));
    println!("SIG {}", hex(&proxy.descriptor(s).expect("sig").to_bytes()));
    println!("PLACE {}/{}", dst.name(), sig.name());
    std::io::stdout().flush().expect("stdout");
    // The proxy thread progresses the endpoint: the peer's writes land as it polls.
    proxy.start().expect("proxy thread");
    let qp = proxy.export().expect("export");
    let wait = m.load_function("gio_signal_wait").expect("kernel");
    let out = DeviceBuffer::alloc(&gpu, 16).expect("out");
    let stream = gpu.new_stream().expect("stream");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.first() == Some(&"END") {
            break;
        }
        let ["WAIT", word, value, what, args @ ..] = w.as_slice() else {
            panic!("peer: unexpected `{line}`");
        };
        let (word, value): (u64, u64) = (word.parse().expect("word"), value.parse().expect("v"));
        out.fill(0).expect("clear");
        let (qp_ptr, word_ptr, waited, st) = (
            qp.device_ptr(),
            sig.device_ptr() + 8 * word,
            out.ptr(),
            out.ptr() + 8,
        );
        let mut l = stream.launch_builder(&wait);
        l.arg(&qp_ptr)
            .arg(&word_ptr)
            .arg(&value)
            .arg(&waited)
            .arg(&st);
        // SAFETY: gio_signal_wait(gio_dev_qp*, const u64*, u64, u64*, int*); every buffer
        // outlives the synchronize.
        unsafe { l.launch(cfg(1, 1)) }.expect("launch");
        stream.synchronize().expect("wait kernel");
        let mut o = [0u8; 16];
        out.copy_to_host(0, &mut o).expect("out");
        let status = i32::from_le_bytes(o[8..12].try_into().expect("4"));
        let verdict = if status != 0 {
            format!("BAD wait status {status}")
        } else if let Some(e) = proxy.take_error() {
            format!("BAD proxy {e}")
        } else {
            match (*what, args) {
                ("data", [seed]) => {
                    let want = pattern(seed.parse().expect("seed"), LEN);
                    match dst.bytes(LEN).iter().zip(&want).position(|(a, b)| a != b) {
                        None => "OK".into(),
                        Some(i) => format!("BAD byte {i} after the signal"),
                    }
                }
                ("values", [base, count]) => {
                    let (base, count): (u64, usize) =
                        (base.parse().expect("base"), count.parse().expect("count"));
                    let bytes = dst.bytes(8 * count);
                    match (0..count).find(|&i| {
                        u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8"))
                            != base + i as u64
                    }) {
                        None => "OK".into(),
                        Some(i) => format!("BAD value {i} after the signal"),
                    }
                }
                _ => panic!("peer: unexpected `{line}`"),
            }
        };
        println!("{verdict}");
        std::io::stdout().flush().expect("stdout");
    }
    drop(qp);
    drop(proxy);
}

#[test]
fn gpu_kernels_through_the_cpu_proxy_to_a_peer_process() {
    let Some(gpu) = gpu_for_test("gpu_kernels_through_the_cpu_proxy_to_a_peer_process") else {
        return;
    };
    let tests = module(&gpu);
    let stream = gpu.new_stream().expect("stream");
    let status = DeviceBuffer::alloc(&gpu, 4).expect("status");
    for (prov, ordered) in [("tcp;ofi_rxm", false), ("shm", false), ("shm", true)] {
        let label = format!("{prov}{}", if ordered { " ordered" } else { "" });
        let mut command = Command::new(std::env::current_exe().expect("exe"));
        command
            .args([
                "--exact",
                "gpu_proxy_peer_main",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("GIO_PROXY_PEER_PROV", prov)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if ordered {
            command.env("GIO_PROXY_PEER_ORDERED", "1");
        }
        let mut child = command.spawn().expect("spawn the peer");
        let mut to_peer = child.stdin.take().expect("stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout"))
            .lines()
            .map_while(Result::ok);
        let mut expect = |prefix: &str| -> String {
            for line in lines.by_ref() {
                if let Some(at) = line.find(prefix) {
                    return line[at + prefix.len()..].trim().to_owned();
                }
            }
            panic!("{label}: the peer printed no `{prefix}` line");
        };
        let name = unhex(&expect("NAME "));
        let dst = RemoteDescriptor::from_bytes(&unhex(&expect("DST "))).expect("dst");
        let sig = RemoteDescriptor::from_bytes(&unhex(&expect("SIG "))).expect("sig");
        let placement = expect("PLACE ");
        eprintln!("{label}: peer memory placement (data/signals): {placement}");

        let ring = RingMemory::cuda(&gpu, 256, 4).expect("CUDA ring");
        let a = CpuProxyBuilder::new()
            .gpu(&gpu)
            .busy_poll(true)
            .timeout(Duration::from_secs(30))
            .build(open(prov, ordered), &ring)
            .expect("proxy");
        a.connect(&name).expect("connect");
        let src = Arc::new(DeviceBuffer::alloc(&gpu, LEN).expect("src"));
        let got = Arc::new(DeviceBuffer::alloc(&gpu, LEN).expect("got"));
        got.fill(0).expect("clear");
        let (l, src_staged) = a.register_device(&src).expect("src");
        let (g, _) = a.register_device(&got).expect("got");
        let (r, s) = (
            a.add_remote(&dst).expect("dst"),
            a.add_remote(&sig).expect("sig"),
        );
        a.start().expect("proxy thread");
        let qp = a.export().expect("export");
        let qp_ptr = qp.device_ptr();
        let st = status.ptr();
        let mut round = |request: String, launch: &dyn Fn()| {
            status.fill(0).expect("clear");
            writeln!(to_peer, "{request}").expect("to peer");
            to_peer.flush().expect("to peer");
            let t = Instant::now();
            launch();
            stream.synchronize().expect("kernel");
            assert_eq!(read_i32(&status), 0, "{label} {request}: device status");
            assert!(a.take_error().is_none(), "{label} {request}: proxy error");
            let verdict = lines.next().unwrap_or_else(|| panic!("{label}: peer gone"));
            assert_eq!(
                verdict, "OK",
                "{label} {request} (source staged {src_staged})"
            );
            assert!(t.elapsed() < TIMEOUT, "{label} {request}: too slow");
        };

        // THREAD and WARP scope puts, each with a signal on its own word.
        for (seed, kernel, grid, word, add) in [
            (1u8, "gio_put_thread", cfg(2, 32), 0u64, 1u64),
            (2, "gio_put_warp", cfg(2, 64), 1, 2),
        ] {
            src.copy_from_host(0, &pattern(seed, LEN)).expect("fill");
            let f = tests.load_function(kernel).expect("kernel");
            let (signal_off, remote_mr, local_mr, signal_mr) = (8 * word, r, l, s);
            round(format!("WAIT {word} {} data {seed}", add * BLOCKS), &|| {
                let mut launch = stream.launch_builder(&f);
                launch
                    .arg(&qp_ptr)
                    .arg(&remote_mr)
                    .arg(&local_mr)
                    .arg(&BLOCK)
                    .arg(&BLOCKS)
                    .arg(&signal_mr)
                    .arg(&signal_off)
                    .arg(&add)
                    .arg(&st);
                // SAFETY: (gio_dev_qp*, u32, u32, u64, u64, u32, u64, u64, int*); the
                // queue pair and regions outlive the synchronize.
                unsafe { launch.launch(grid) }.expect("launch");
            });
        }

        // Gets of the peer's data (the WARP round's) in THREAD and WARP scope.
        for (kernel, grid) in [("gio_get_thread", cfg(2, 32)), ("gio_get_warp", cfg(1, 64))] {
            got.fill(0).expect("clear");
            status.fill(0).expect("clear");
            let f = tests.load_function(kernel).expect("kernel");
            let (local_mr, remote_mr) = (g, r);
            let mut launch = stream.launch_builder(&f);
            launch
                .arg(&qp_ptr)
                .arg(&local_mr)
                .arg(&remote_mr)
                .arg(&BLOCK)
                .arg(&BLOCKS)
                .arg(&st);
            // SAFETY: (gio_dev_qp*, u32, u32, u64, u64, int*); as above.
            unsafe { launch.launch(grid) }.expect("launch");
            stream.synchronize().expect("kernel");
            assert_eq!(read_i32(&status), 0, "{label} {kernel}: device status");
            assert!(
                got.to_vec().expect("read") == pattern(2, LEN),
                "{label} {kernel}: data"
            );
        }

        // Inline values, a fence, one signal: the peer sees the values once signalled.
        let f = tests.load_function("gio_p_signal").expect("kernel");
        let (base, count, word) = (500u64, 64u64, 2u64);
        let (remote_mr, signal_mr, signal_off) = (r, s, 8 * word);
        round(format!("WAIT {word} 1 values {base} {count}"), &|| {
            let mut launch = stream.launch_builder(&f);
            launch
                .arg(&qp_ptr)
                .arg(&remote_mr)
                .arg(&base)
                .arg(&count)
                .arg(&signal_mr)
                .arg(&signal_off)
                .arg(&st);
            // SAFETY: (gio_dev_qp*, u32, u64, u64, u32, u64, int*); as above.
            unsafe { launch.launch(cfg(1, 64)) }.expect("launch");
        });

        writeln!(to_peer, "END").expect("to peer");
        drop(to_peer);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(exit) = child.try_wait().expect("wait") {
                assert!(exit.success(), "{label}: peer exited with {exit}");
                break;
            }
            assert!(Instant::now() < deadline, "{label}: peer did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(qp);
        drop(a);
    }
}
