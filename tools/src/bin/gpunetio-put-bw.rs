//! `gpunetio-put-bw`: bandwidth of GPU-initiated puts, as DOCA's `gpunetio_verbs_put_bw`
//! (an `ib_write_bw`-like client/server) measures it: the client's kernel has every
//! thread (`-e 0`) or warp (`-e 1`) put one message per iteration into the server's GPU
//! buffer, then signal; the server checks the signal count and every written byte.
//!
//! ```text
//! gpunetio-put-bw [-a | -s BYTES] [-n ITERS] [-e 0|1] [-p intra_node|cpu_proxy] [-d GPU]
//!                 [--provider PROV] [--mem auto|vram|dram]
//!                 [-q QPS] [--blocks N] [--threads N] [--server [--port P] | --client HOST:PORT]
//! ```
//! Without `--server`/`--client` both sides run here, the server as a child process.
//! NIC handlers (`-p`): `intra_node` (the server's memory mapped through CUDA IPC; both
//! sides on this node); `cpu_proxy` (the client's kernel posts into a ring its CPU proxy
//! drains onto a libfabric endpoint of `--provider`, default `shm` towards this host and
//! `tcp;ofi_rxm` otherwise; each side's memory in VRAM where the provider registers it
//! directly, else pinned host memory, or as `--mem` says; the server's proxy thread
//! progresses its endpoint). `-q` spreads the client's blocks over that many queue pairs
//! (as `ib_write_bw -q`): through the CPU proxy each is a ring, a proxy thread and an
//! endpoint on each side, all onto the same buffers. Columns as perftest/DOCA print them;
//! Gb/s = 10^9 bits per second.

#[path = "../gio_cpu_proxy.rs"]
mod gio_cpu_proxy;

use clap::Parser;
use cudarc::driver::sys;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::intra_node::IntraNodeQueuePair;
use gpunetio::{cudarc, DeviceBuffer, Gpu, IpcHandle, IpcMapping};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes of the server's buffer messages cycle through (larger than L2).
const WINDOW: usize = 1 << 30;
/// Bytes one size moves at most (iterations shrink for large messages).
const BYTES_PER_SIZE: u64 = 32 << 30;
/// The CPU proxy's buffers (pinned host memory where VRAM cannot be registered).
const PROXY_WINDOW: usize = 256 << 20;
/// Messages and bytes one timed run moves at most through the CPU proxy.
const PROXY_MSGS_PER_RUN: u64 = 1 << 20;
const PROXY_BYTES_PER_RUN: u64 = 4 << 30;
/// Entries of the client's CUDA ring.
const PROXY_RING: u32 = 8192;

#[derive(Debug, Clone)]
struct Opts {
    sizes: Vec<usize>,
    iters: u64,
    warp: bool,
    handler: String,
    gpu: usize,
    blocks: Option<u32>,
    threads: u32,
    server: bool,
    port: u16,
    client: Option<String>,
    provider: Option<String>,
    mem: gio_cpu_proxy::MemChoice,
    qps: u32,
}

/// Bandwidth of GPU-initiated puts, as DOCA's gpunetio_verbs_put_bw measures it
#[derive(Parser, Debug)]
#[command(
    name = "gpunetio-put-bw",
    version,
    max_term_width = 100,
    after_help = "Without --server or --client both sides run here, the server as a child process. \
RUST_LOG sets the libraries' log (default: warnings)."
)]
struct Cli {
    /// Every size from 8 B to 64 MiB
    #[arg(short = 'a', long = "all", conflicts_with = "size")]
    all: bool,
    /// Message size in bytes
    #[arg(short = 's', long = "size", value_name = "BYTES", default_value_t = 65536,
          value_parser = positive)]
    size: usize,
    /// Iterations
    #[arg(short = 'n', long = "iters", value_name = "ITERS", default_value_t = 1000,
          value_parser = positive)]
    iters: usize,
    /// Execution scope: 0 a thread per message, 1 a warp per message
    #[arg(short = 'e', long = "exec-scope", value_name = "0|1", default_value = "0",
          value_parser = ["0", "1"])]
    exec_scope: String,
    /// NIC handler
    #[arg(short = 'p', long = "nic-handler", value_enum, default_value_t = Handler::IntraNode)]
    handler: Handler,
    /// CUDA device
    #[arg(short = 'd', long = "gpu", value_name = "GPU", default_value_t = 0)]
    gpu: usize,
    /// cpu_proxy: libfabric provider [default: shm towards this host, else tcp;ofi_rxm]
    #[arg(long = "provider", value_name = "PROV")]
    provider: Option<String>,
    /// cpu_proxy: where each side's memory lives
    #[arg(long = "mem", value_enum, default_value_t = gio_cpu_proxy::MemChoice::Auto)]
    mem: gio_cpu_proxy::MemChoice,
    /// Queue pairs (cpu_proxy: a ring, proxy thread and endpoint each), 1 to 64
    #[arg(short = 'q', long = "qps", value_name = "QPS", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    qps: u32,
    /// Thread blocks [default: as many as the GPU runs at once]
    #[arg(long = "blocks", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    blocks: Option<u32>,
    /// Threads per block
    #[arg(long = "threads", value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: u32,
    /// Be the server only
    #[arg(long = "server", conflicts_with = "client")]
    server: bool,
    /// The server's TCP port (0: any; it prints the one it got)
    #[arg(long = "port", value_name = "P", default_value_t = 0)]
    port: u16,
    /// Be the client of the server at HOST:PORT
    #[arg(long = "client", value_name = "HOST:PORT")]
    client: Option<String>,
}

/// `-p`'s NIC handlers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Handler {
    #[value(name = "intra_node")]
    IntraNode,
    #[value(name = "cpu_proxy")]
    CpuProxy,
}

fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{text}` is not a whole number")),
    }
}

fn parse(cli: Cli) -> Result<Opts, String> {
    if cli.qps > 1 && cli.handler != Handler::CpuProxy {
        return Err(format!(
            "-q {}: more than one queue pair needs -p cpu_proxy",
            cli.qps
        ));
    }
    Ok(Opts {
        sizes: if cli.all {
            (3..=26).map(|p| 1usize << p).collect()
        } else {
            vec![cli.size]
        },
        iters: cli.iters as u64,
        warp: cli.exec_scope == "1",
        handler: match cli.handler {
            Handler::IntraNode => "intra_node".into(),
            Handler::CpuProxy => "cpu_proxy".into(),
        },
        gpu: cli.gpu,
        blocks: cli.blocks,
        threads: cli.threads,
        server: cli.server,
        port: cli.port,
        client: cli.client,
        provider: cli.provider,
        mem: cli.mem,
        qps: cli.qps,
    })
}

fn pattern_byte(i: usize) -> u8 {
    (i % 251) as u8
}

fn hex(h: &IpcHandle) -> String {
    h.as_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<IpcHandle, String> {
    let bytes: Result<Vec<u8>, _> = (0..s.len() / 2)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2).unwrap_or("zz"), 16))
        .collect();
    IpcHandle::from_bytes(&bytes.map_err(|e| e.to_string())?).map_err(|e| e.to_string())
}

fn main() {
    tools::cli::init_tracing();
    let cli: Cli = tools::cli::parse_or_exit("gpunetio-put-bw");
    let o = parse(cli).unwrap_or_else(|e| tools::cli::Stop::Usage(e).exit("gpunetio-put-bw"));
    if let Err(e) = gio_cpu_proxy::check_gpu(o.gpu) {
        tools::cli::fail("gpunetio-put-bw", e);
    }
    let result = if o.server {
        server(&o)
    } else if let Some(addr) = o.client.clone() {
        client(&o, &addr)
    } else {
        // The server child takes the same options, and --server.
        let args: Vec<String> = std::env::args().skip(1).collect();
        both(&o, &args)
    };
    if let Err(e) = result {
        tools::cli::fail("gpunetio-put-bw", e);
    }
}

/// Both sides: the server as a child process on loopback.
fn both(o: &Opts, args: &[String]) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(args)
        .arg("--server")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the server: {e}"))?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().ok_or("server stdout")?)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let Some(port) = line.trim().strip_prefix("listening on port ") else {
        // It said why on standard error.
        let status = child.wait().map_err(|e| e.to_string())?;
        return Err(format!(
            "the server exited ({status}) before announcing its port"
        ));
    };
    let result = client(o, &format!("127.0.0.1:{port}"));
    let status = child.wait().map_err(|e| e.to_string())?;
    result?;
    if !status.success() {
        return Err(format!("the server failed ({status})"));
    }
    Ok(())
}

/// What the server checks at the end of each size: the buffer and the signal word.
enum Target {
    Ipc(DeviceBuffer, DeviceBuffer),
    /// One side per queue pair, all on the first side's memory.
    Proxy(Vec<gio_cpu_proxy::Side>),
}

impl Target {
    fn read(&self, which: usize, off: usize, out: &mut [u8]) -> Result<(), String> {
        match self {
            Target::Ipc(d, s) => [d, s][which]
                .copy_to_host(off, out)
                .map_err(|e| e.to_string()),
            Target::Proxy(sides) => sides[0].mems[which].read(off, out),
        }
    }
    fn zero(&self) -> Result<(), String> {
        match self {
            Target::Ipc(d, s) => {
                d.fill(0).map_err(|e| e.to_string())?;
                s.fill(0).map_err(|e| e.to_string())
            }
            Target::Proxy(sides) => {
                sides.iter().try_for_each(|s| s.check())?;
                sides[0].mems.iter().try_for_each(|m| m.zero())
            }
        }
    }
}

fn server(o: &Opts) -> Result<(), String> {
    let gpu = Gpu::open(o.gpu).map_err(|e| e.to_string())?;
    let bind = if o.handler == "cpu_proxy" {
        "0.0.0.0"
    } else {
        "127.0.0.1"
    };
    let listener = TcpListener::bind((bind, o.port)).map_err(|e| e.to_string())?;
    println!(
        "listening on port {}",
        listener.local_addr().map_err(|e| e.to_string())?.port()
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let (stream, peer) = listener.accept().map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(600)))
        .map_err(|e| e.to_string())?;
    let (target, greeting, window) = if o.handler == "cpu_proxy" {
        // The client's address picks the default provider, as on the client.
        let provider = o
            .provider
            .clone()
            .unwrap_or_else(|| gio_cpu_proxy::default_provider(&peer.ip().to_string()).into());
        let first = gio_cpu_proxy::side(&gpu, &provider, o.mem, &[PROXY_WINDOW, 64], 0)?;
        let mut sides = vec![first];
        for _ in 1..o.qps {
            let mems = sides[0].mems.clone();
            sides.push(gio_cpu_proxy::side_sharing(&gpu, &provider, &mems, 0)?);
        }
        let mut words = Vec::new();
        for side in &mut sides {
            side.start()?;
            words.push(side.info_words()?);
        }
        let greeting = format!(
            "GIOP {PROXY_WINDOW} {} {}",
            sides[0].placement(),
            words.join(" | ")
        );
        (Target::Proxy(sides), greeting, PROXY_WINDOW)
    } else {
        ipc_target(&gpu)?
    };
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut writer = stream;
    writeln!(writer, "{greeting}").map_err(|e| e.to_string())?;
    let mut host = vec![0u8; window];
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            return Err("the client went away".into());
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["BYE"] => return Ok(()),
            ["CHECK", extent, signals] => {
                let extent: usize = extent.parse().map_err(|_| "bad CHECK")?;
                let signals: u64 = signals.parse().map_err(|_| "bad CHECK")?;
                let extent = extent.min(window);
                target.read(0, 0, &mut host[..extent])?;
                let mut word = [0u8; 8];
                target.read(1, 0, &mut word)?;
                let seen = u64::from_le_bytes(word);
                let bad = host[..extent]
                    .iter()
                    .enumerate()
                    .find(|(i, b)| **b != pattern_byte(*i));
                let verdict = match (seen == signals, bad) {
                    (false, _) => format!("BAD signal {seen}, expected {signals}"),
                    (true, Some((i, b))) => {
                        format!("BAD byte {i} is {b}, expected {}", pattern_byte(i))
                    }
                    (true, None) => "OK".to_string(),
                };
                target.zero()?;
                writeln!(writer, "{verdict}").map_err(|e| e.to_string())?;
            }
            _ => return Err(format!("unexpected request `{}`", line.trim())),
        }
    }
}

/// The intra-node server: VRAM exported through CUDA IPC.
fn ipc_target(gpu: &Gpu) -> Result<(Target, String, usize), String> {
    let data = DeviceBuffer::alloc(gpu, WINDOW).map_err(|e| e.to_string())?;
    data.fill(0).map_err(|e| e.to_string())?;
    let signal = DeviceBuffer::alloc(gpu, 64).map_err(|e| e.to_string())?;
    signal.fill(0).map_err(|e| e.to_string())?;
    let greeting = format!(
        "GIO1 {} {} {WINDOW}",
        hex(&data.export_ipc().map_err(|e| e.to_string())?),
        hex(&signal.export_ipc().map_err(|e| e.to_string())?)
    );
    Ok((Target::Ipc(data, signal), greeting, WINDOW))
}

fn client(o: &Opts, addr: &str) -> Result<(), String> {
    let gpu = Gpu::open(o.gpu).map_err(|e| e.to_string())?;
    let stream_tcp = TcpStream::connect(addr).map_err(|e| format!("connecting to {addr}: {e}"))?;
    stream_tcp
        .set_read_timeout(Some(Duration::from_secs(600)))
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream_tcp.try_clone().map_err(|e| e.to_string())?);
    let mut writer = stream_tcp;
    let mut line = String::new();
    reader.read_line(&mut line).map_err(|e| e.to_string())?;
    let words: Vec<&str> = line.split_whitespace().collect();
    // Kept alive until the end: the intra-node export, or the CPU proxy sides.
    let (mut _intra, mut proxy) = (None, Vec::new());
    let (qp_ptrs, local_mr, remote_mr, signal_mr, window, handler) = match words.as_slice() {
        ["GIO1", data_h, signal_h, window] => {
            let window: usize = window.parse().map_err(|_| "bad window")?;
            let data =
                Arc::new(IpcMapping::open(&gpu, &unhex(data_h)?).map_err(|e| e.to_string())?);
            let signal =
                Arc::new(IpcMapping::open(&gpu, &unhex(signal_h)?).map_err(|e| e.to_string())?);
            let src = Arc::new(DeviceBuffer::alloc(&gpu, window).map_err(|e| e.to_string())?);
            let pattern: Vec<u8> = (0..window).map(pattern_byte).collect();
            src.copy_from_host(0, &pattern).map_err(|e| e.to_string())?;
            let mut table = IntraNodeQueuePair::new(&gpu, 0, Duration::from_secs(60));
            let local_mr = table.register_local(&src).map_err(|e| e.to_string())?;
            let remote_mr = table.add_remote(&data).map_err(|e| e.to_string())?;
            let signal_mr = table.add_remote(&signal).map_err(|e| e.to_string())?;
            let qp = table.export().map_err(|e| e.to_string())?;
            let ptr = qp.device_ptr();
            _intra = Some(qp);
            (
                vec![ptr],
                local_mr,
                remote_mr,
                signal_mr,
                window,
                "intra_node".to_string(),
            )
        }
        ["GIOP", window, placement, peers @ ..] => {
            let window: usize = window.parse().map_err(|_| "bad window")?;
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
            let provider = o
                .provider
                .clone()
                .unwrap_or_else(|| gio_cpu_proxy::default_provider(host).into());
            let peers: Vec<&[&str]> = peers.split(|w| *w == "|").collect();
            if peers.len() != o.qps as usize {
                return Err(format!(
                    "the server offers {} queue pairs, -q asks for {}",
                    peers.len(),
                    o.qps
                ));
            }
            let first = gio_cpu_proxy::side(&gpu, &provider, o.mem, &[window], PROXY_RING)?;
            let pattern: Vec<u8> = (0..window).map(pattern_byte).collect();
            first.mems[0].write(0, &pattern)?;
            let mut sides = vec![first];
            for _ in 1..o.qps {
                let mems = sides[0].mems.clone();
                sides.push(gio_cpu_proxy::side_sharing(
                    &gpu, &provider, &mems, PROXY_RING,
                )?);
            }
            let mut regions = None;
            let mut ptrs = Vec::new();
            for (side, peer) in sides.iter_mut().zip(&peers) {
                let remote = side.connect(peer)?;
                let [remote_mr, signal_mr] = remote[..] else {
                    return Err(format!(
                        "the server offered {} buffers, expected 2",
                        remote.len()
                    ));
                };
                // The kernel names regions by one set of indices for every queue pair.
                let these = (side.mrs[0], remote_mr, signal_mr);
                if *regions.get_or_insert(these) != these {
                    return Err("the queue pairs' memory tables differ".into());
                }
                side.start()?;
                ptrs.push(
                    side.qp
                        .as_ref()
                        .ok_or("no exported queue pair")?
                        .device_ptr(),
                );
            }
            let (local_mr, remote_mr, signal_mr) = regions.ok_or("no queue pair")?;
            let handler = format!(
                "cpu_proxy over {provider} (client {}, server {placement}), {} queue pair{}",
                sides[0].placement(),
                o.qps,
                if o.qps == 1 { "" } else { "s" }
            );
            proxy = sides;
            (ptrs, local_mr, remote_mr, signal_mr, window, handler)
        }
        _ => return Err(format!("unexpected server greeting `{}`", line.trim())),
    };
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
        .load_function(if o.warp {
            "gio_perf_put_bw_warp"
        } else {
            "gio_perf_put_bw_thread"
        })
        .map_err(|e| format!("{e:?}"))?;
    let sms = gpu
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| format!("{e:?}"))? as u32;
    let blocks = o.blocks.unwrap_or(sms);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (o.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let workers = (blocks * o.threads / if o.warp { 32 } else { 1 }) as u64;
    let status = DeviceBuffer::alloc(&gpu, 4).map_err(|e| e.to_string())?;
    let qps = DeviceBuffer::alloc(&gpu, 8 * qp_ptrs.len()).map_err(|e| e.to_string())?;
    let ptr_bytes: Vec<u8> = qp_ptrs.iter().flat_map(|p| p.to_le_bytes()).collect();
    qps.copy_from_host(0, &ptr_bytes)
        .map_err(|e| e.to_string())?;
    let (qps_ptr, nqp) = (qps.ptr(), qp_ptrs.len() as u32);
    let stream = gpu.new_stream().map_err(|e| e.to_string())?;
    println!(
        "# gpunetio-put-bw: {} ({}), NIC handler {handler}, {} scope, {blocks} blocks x {} threads = {workers} {}",
        gpu.name().unwrap_or_default(),
        gpu.pci_bus_id().unwrap_or_default(),
        if o.warp { "WARP" } else { "THREAD" },
        o.threads,
        if o.warp { "warps" } else { "threads" },
    );
    println!(
        "{:>10} {:>12} {:>18} {:>20} {:>14}",
        "#bytes", "#iterations", "BW peak[Gb/sec]", "BW average[Gb/sec]", "MsgRate[Mpps]"
    );
    for &size in &o.sizes {
        if size == 0 || size > window {
            return Err(format!("message size {size} outside 1..={window}"));
        }
        let iters = o
            .iters
            .min((BYTES_PER_SIZE / (size as u64 * workers)).max(1));
        // Through the CPU proxy a run is bounded by messages as well as bytes.
        let iters = if !proxy.is_empty() {
            iters
                .min(PROXY_MSGS_PER_RUN / workers)
                .min(PROXY_BYTES_PER_RUN / (size as u64 * workers))
                .max(1)
        } else {
            iters
        };
        let run = |count: u64| -> Result<Duration, String> {
            status.fill(0).map_err(|e| e.to_string())?;
            let (st, size, window) = (status.ptr(), size as u64, window as u64);
            let mut launch = stream.launch_builder(&kernel);
            launch
                .arg(&qps_ptr)
                .arg(&nqp)
                .arg(&remote_mr)
                .arg(&local_mr)
                .arg(&size)
                .arg(&count)
                .arg(&window)
                .arg(&signal_mr)
                .arg(&st);
            let t = Instant::now();
            // SAFETY: gio_perf_put_bw_*(gio_dev_qp *const *, u32, u32, u32, u64, u64, u64,
            // u32, int*); the queue pairs (their pointers in `qps`), the regions they keep
            // and the status outlive the synchronize.
            unsafe { launch.launch(cfg) }.map_err(|e| format!("launch: {e:?}"))?;
            stream.synchronize().map_err(|e| format!("kernel: {e:?}"))?;
            let elapsed = t.elapsed();
            let mut b = [0u8; 4];
            status.copy_to_host(0, &mut b).map_err(|e| e.to_string())?;
            for side in &proxy {
                side.check()?;
            }
            match i32::from_le_bytes(b) {
                0 => Ok(elapsed),
                st => Err(format!("device status {st} (gpunetio_sys::GIO_ERR_*)")),
            }
        };
        // Warm up (module load, first touch), then three timed runs; the server checks
        // the signals and bytes of all of them.
        run(1)?;
        let mut times = Vec::new();
        for _ in 0..3 {
            times.push(run(iters)?);
        }
        // The kernel lets at most window / size workers put (distinct memory in flight).
        let active = workers.min((window / size) as u64);
        let msgs = iters * active;
        let bytes = (msgs * size as u64) as f64;
        let total: Duration = times.iter().sum();
        let best = times.iter().min().copied().unwrap_or(total);
        let peak = bytes * 8.0 / best.as_secs_f64() / 1e9;
        let avg = bytes * 8.0 * 3.0 / total.as_secs_f64() / 1e9;
        let rate = msgs as f64 * 3.0 / total.as_secs_f64() / 1e6;
        let extent = ((msgs as usize).min(window / size)) * size;
        writeln!(writer, "CHECK {extent} {}", 4 * workers).map_err(|e| e.to_string())?;
        let mut verdict = String::new();
        reader.read_line(&mut verdict).map_err(|e| e.to_string())?;
        if verdict.trim() != "OK" {
            return Err(format!(
                "the server checked {size}-byte messages: {}",
                verdict.trim()
            ));
        }
        println!("{size:>10} {iters:>12} {peak:>18.2} {avg:>20.2} {rate:>14.3}");
    }
    writeln!(writer, "BYE").map_err(|e| e.to_string())?;
    Ok(())
}
