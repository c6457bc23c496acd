//! `gpunetio-put-bw`: bandwidth of GPU-initiated puts, as DOCA's `gpunetio_verbs_put_bw`
//! (an `ib_write_bw`-like client/server) measures it: the client's kernel has every
//! thread (`-e 0`) or warp (`-e 1`) put one message per iteration into the server's GPU
//! buffer, then signal; the server checks the signal count and every written byte.
//!
//! ```text
//! gpunetio-put-bw [-a | -s BYTES] [-n ITERS] [-e 0|1] [-p intra_node] [-d GPU]
//!                 [--blocks N] [--threads N] [--server [--port P] | --client HOST:PORT]
//! ```
//! Without `--server`/`--client` both sides run here, the server as a child process.
//! NIC handlers (`-p`): `intra_node` (the server's memory mapped through CUDA IPC; both
//! sides on this node). Columns as perftest/DOCA print them; Gb/s = 10^9 bits per second.

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
}

fn usage() -> ! {
    eprintln!("usage: gpunetio-put-bw [-a | -s BYTES] [-n ITERS] [-e 0|1] [-p intra_node] [-d GPU] [--blocks N] [--threads N] [--server [--port P] | --client HOST:PORT]");
    std::process::exit(2)
}

fn parse(args: &[String]) -> Opts {
    let mut o = Opts {
        sizes: vec![65536],
        iters: 1000,
        warp: false,
        handler: "intra_node".into(),
        gpu: 0,
        blocks: None,
        threads: 256,
        server: false,
        port: 0,
        client: None,
    };
    let mut i = 0;
    let value = |i: &mut usize| -> String {
        *i += 1;
        args.get(*i).cloned().unwrap_or_else(|| usage())
    };
    while i < args.len() {
        match args[i].as_str() {
            "-a" | "--all" => o.sizes = (3..=26).map(|p| 1usize << p).collect(),
            "-s" | "--size" => o.sizes = vec![value(&mut i).parse().unwrap_or_else(|_| usage())],
            "-n" | "--iters" => o.iters = value(&mut i).parse().unwrap_or_else(|_| usage()),
            "-e" | "--exec-scope" => o.warp = value(&mut i) == "1",
            "-p" | "--nic-handler" => o.handler = value(&mut i),
            "-d" | "--gpu" => o.gpu = value(&mut i).parse().unwrap_or_else(|_| usage()),
            "--blocks" => o.blocks = Some(value(&mut i).parse().unwrap_or_else(|_| usage())),
            "--threads" => o.threads = value(&mut i).parse().unwrap_or_else(|_| usage()),
            "--server" => o.server = true,
            "--port" => o.port = value(&mut i).parse().unwrap_or_else(|_| usage()),
            "--client" => o.client = Some(value(&mut i)),
            "-h" | "--help" => usage(),
            _ => usage(),
        }
        i += 1;
    }
    if o.handler != "intra_node" {
        eprintln!(
            "gpunetio-put-bw: NIC handler `{}` is not available in this build (intra_node)",
            o.handler
        );
        std::process::exit(2);
    }
    o
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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = parse(&args);
    let result = if o.server {
        server(&o)
    } else if let Some(addr) = o.client.clone() {
        client(&o, &addr)
    } else {
        both(&o, &args)
    };
    if let Err(e) = result {
        eprintln!("gpunetio-put-bw: {e}");
        std::process::exit(1);
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
    let port = line
        .trim()
        .strip_prefix("listening on port ")
        .ok_or_else(|| format!("unexpected server line `{}`", line.trim()))?;
    let result = client(o, &format!("127.0.0.1:{port}"));
    let status = child.wait().map_err(|e| e.to_string())?;
    result?;
    if !status.success() {
        return Err(format!("the server failed ({status})"));
    }
    Ok(())
}

fn server(o: &Opts) -> Result<(), String> {
    let gpu = Gpu::open(o.gpu).map_err(|e| e.to_string())?;
    let data = DeviceBuffer::alloc(&gpu, WINDOW).map_err(|e| e.to_string())?;
    data.fill(0).map_err(|e| e.to_string())?;
    let signal = DeviceBuffer::alloc(&gpu, 64).map_err(|e| e.to_string())?;
    signal.fill(0).map_err(|e| e.to_string())?;
    let listener = TcpListener::bind(("127.0.0.1", o.port)).map_err(|e| e.to_string())?;
    println!(
        "listening on port {}",
        listener.local_addr().map_err(|e| e.to_string())?.port()
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let (stream, _) = listener.accept().map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(600)))
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut writer = stream;
    let handles = [&data, &signal].map(|b| b.export_ipc().map(|h| hex(&h)));
    let [d, s] = handles;
    writeln!(
        writer,
        "GIO1 {} {} {WINDOW}",
        d.map_err(|e| e.to_string())?,
        s.map_err(|e| e.to_string())?
    )
    .map_err(|e| e.to_string())?;
    let mut host = vec![0u8; WINDOW];
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
                let extent = extent.min(WINDOW);
                data.copy_to_host(0, &mut host[..extent])
                    .map_err(|e| e.to_string())?;
                let mut word = [0u8; 8];
                signal
                    .copy_to_host(0, &mut word)
                    .map_err(|e| e.to_string())?;
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
                data.fill(0).map_err(|e| e.to_string())?;
                signal.fill(0).map_err(|e| e.to_string())?;
                writeln!(writer, "{verdict}").map_err(|e| e.to_string())?;
            }
            _ => return Err(format!("unexpected request `{}`", line.trim())),
        }
    }
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
    let ["GIO1", data_h, signal_h, window] = words.as_slice() else {
        return Err(format!("unexpected server greeting `{}`", line.trim()));
    };
    let window: usize = window.parse().map_err(|_| "bad window")?;
    let data = Arc::new(IpcMapping::open(&gpu, &unhex(data_h)?).map_err(|e| e.to_string())?);
    let signal = Arc::new(IpcMapping::open(&gpu, &unhex(signal_h)?).map_err(|e| e.to_string())?);
    let src = Arc::new(DeviceBuffer::alloc(&gpu, window).map_err(|e| e.to_string())?);
    let pattern: Vec<u8> = (0..window).map(pattern_byte).collect();
    src.copy_from_host(0, &pattern).map_err(|e| e.to_string())?;
    let mut table = IntraNodeQueuePair::new(&gpu, 0, Duration::from_secs(60));
    let local_mr = table.register_local(&src).map_err(|e| e.to_string())?;
    let remote_mr = table.add_remote(&data).map_err(|e| e.to_string())?;
    let signal_mr = table.add_remote(&signal).map_err(|e| e.to_string())?;
    let qp = table.export().map_err(|e| e.to_string())?;
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
    let stream = gpu.new_stream().map_err(|e| e.to_string())?;
    println!(
        "# gpunetio-put-bw: {} ({}), NIC handler intra_node, {} scope, {blocks} blocks x {} threads = {workers} {}",
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
        let run = |count: u64| -> Result<Duration, String> {
            status.fill(0).map_err(|e| e.to_string())?;
            let (qp_ptr, st, size, window) =
                (qp.device_ptr(), status.ptr(), size as u64, window as u64);
            let mut launch = stream.launch_builder(&kernel);
            launch
                .arg(&qp_ptr)
                .arg(&remote_mr)
                .arg(&local_mr)
                .arg(&size)
                .arg(&count)
                .arg(&window)
                .arg(&signal_mr)
                .arg(&st);
            let t = Instant::now();
            // SAFETY: gio_perf_put_bw_*(gio_dev_qp*, u32, u32, u64, u64, u64, u32, int*);
            // the queue pair, the regions it keeps and the status outlive the synchronize.
            unsafe { launch.launch(cfg) }.map_err(|e| format!("launch: {e:?}"))?;
            stream.synchronize().map_err(|e| format!("kernel: {e:?}"))?;
            let elapsed = t.elapsed();
            let mut b = [0u8; 4];
            status.copy_to_host(0, &mut b).map_err(|e| e.to_string())?;
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
