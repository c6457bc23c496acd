//! `nixlbench`: transfer bandwidth and latency of the `nixl` agent, with the option names
//! and result columns of NIXL's nixlbench.
//!
//! With no role given it starts its own target as a second process on loopback and
//! drives it (the README's main job). With `--role target --listen ADDR` and
//! `--role initiator --target_address ADDR` the two sides run on two hosts.

use nixl::{Agent, AgentConfig, BackendParams, Desc, DescList, MemKind, XferOp};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: nixlbench [options]
  --backend NAME              LIBFABRIC (default) or LOCAL
  --backend_param KEY=VALUE   backend parameter (repeatable), e.g. provider=tcp;ofi_rxm, num_rails=2
  --op_type READ|WRITE        (default WRITE)
  --initiator_seg_type DRAM   --target_seg_type DRAM
  --total_buffer_size BYTES   per side (default 64 MiB)
  --start_block_size BYTES    (default 4096)      --max_block_size BYTES  (default 1048576)
  --start_batch_size N        (default 1)         --max_batch_size N      (default 1)
  --num_iter N                (default 1000)      --warmup_iter N         (default 100)
  --large_blk_iter_ftr N      iterations divided by N for blocks >= 1 MiB (default 16)
  --num_threads N             initiator threads, each with its own request (default 1)
  --check_consistency         verify the data of every block and batch size
  --plot FILE.png             draw bandwidth and latency against block size
  --no_progress               no progress bar
  --role target|initiator     run one side only (default: both, the target as a child process)
  --listen ADDR               target: metadata listener address (default 127.0.0.1:0)
  --target_address ADDR       initiator: the target's listener";

#[derive(Debug, Clone)]
struct Options {
    backend: String,
    backend_params: BackendParams,
    op: XferOp,
    total_buffer_size: usize,
    start_block_size: usize,
    max_block_size: usize,
    start_batch_size: usize,
    max_batch_size: usize,
    num_iter: usize,
    warmup_iter: usize,
    large_blk_iter_ftr: usize,
    num_threads: usize,
    check_consistency: bool,
    plot: Option<String>,
    progress: bool,
    role: Option<String>,
    listen: SocketAddr,
    target_address: Option<SocketAddr>,
}

fn parse_args(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        backend: "LIBFABRIC".into(),
        backend_params: BackendParams::new(),
        op: XferOp::Write,
        total_buffer_size: 64 << 20,
        start_block_size: 4096,
        max_block_size: 1 << 20,
        start_batch_size: 1,
        max_batch_size: 1,
        num_iter: 1000,
        warmup_iter: 100,
        large_blk_iter_ftr: 16,
        num_threads: 1,
        check_consistency: false,
        plot: None,
        progress: true,
        role: None,
        listen: "127.0.0.1:0".parse().expect("literal"),
        target_address: None,
    };
    let mut i = 0;
    while i < args.len() {
        let (key, inline) = match args[i].split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k.to_string(), Some(v.to_string())),
            _ => (args[i].clone(), None),
        };
        let mut value = || -> Result<String, String> {
            if let Some(v) = &inline {
                return Ok(v.clone());
            }
            i += 1;
            args.get(i)
                .cloned()
                .ok_or_else(|| format!("{key} needs a value"))
        };
        let num = |v: String| {
            v.parse::<usize>()
                .map_err(|_| format!("{key}: `{v}` is not a number"))
        };
        match key.as_str() {
            "--backend" => o.backend = value()?.to_ascii_uppercase(),
            "--backend_param" => {
                let v = value()?;
                let (k, val) = v.split_once('=').ok_or("--backend_param takes KEY=VALUE")?;
                o.backend_params.insert(k.to_string(), val.to_string());
            }
            "--op_type" => {
                let v = value()?;
                o.op = XferOp::parse(&v).ok_or(format!("--op_type: READ or WRITE, not {v}"))?;
            }
            "--initiator_seg_type" | "--target_seg_type" => {
                let v = value()?;
                if MemKind::parse(&v) != Some(MemKind::Dram) {
                    return Err(format!("{key} {v}: only DRAM is available in this build"));
                }
            }
            "--total_buffer_size" => o.total_buffer_size = num(value()?)?,
            "--start_block_size" => o.start_block_size = num(value()?)?,
            "--max_block_size" => o.max_block_size = num(value()?)?,
            "--start_batch_size" => o.start_batch_size = num(value()?)?,
            "--max_batch_size" => o.max_batch_size = num(value()?)?,
            "--num_iter" => o.num_iter = num(value()?)?,
            "--warmup_iter" => o.warmup_iter = num(value()?)?,
            "--large_blk_iter_ftr" => o.large_blk_iter_ftr = num(value()?)?.max(1),
            "--num_threads" => o.num_threads = num(value()?)?.max(1),
            "--check_consistency" => o.check_consistency = true,
            "--plot" => o.plot = Some(value()?),
            "--no_progress" => o.progress = false,
            "--role" => o.role = Some(value()?),
            "--listen" => o.listen = value()?.parse().map_err(|e| format!("--listen: {e}"))?,
            "--target_address" => {
                o.target_address = Some(
                    value()?
                        .parse()
                        .map_err(|e| format!("--target_address: {e}"))?,
                )
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other}")),
        }
        i += 1;
    }
    if o.start_block_size == 0 || o.start_block_size > o.max_block_size {
        return Err("need 0 < start_block_size <= max_block_size".into());
    }
    if o.start_batch_size == 0 || o.start_batch_size > o.max_batch_size {
        return Err("need 0 < start_batch_size <= max_batch_size".into());
    }
    Ok(o)
}

/// A page-aligned, zeroed allocation that transfers may write at any time.
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory; threads only touch it through raw copies that the
// benchmark orders (each thread owns its own slice of it).
unsafe impl Send for Buffer {}
// SAFETY: as above.
unsafe impl Sync for Buffer {}

impl Buffer {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(1), 4096).expect("valid layout")
    }

    fn new(len: usize) -> Self {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(len)) };
        assert!(!ptr.is_null(), "out of memory allocating {len} bytes");
        Self { ptr, len }
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn fill_pattern(&self, offset: usize, len: usize, seed: u64) {
        for i in 0..len {
            // SAFETY: in bounds (callers pass ranges inside the buffer).
            unsafe { *self.ptr.add(offset + i) = pattern(seed, offset + i) };
        }
    }

    fn check_pattern(&self, offset: usize, len: usize, seed: u64) -> Result<(), usize> {
        for i in 0..len {
            // SAFETY: in bounds, as above.
            let got = unsafe { std::ptr::read_volatile(self.ptr.add(offset + i)) };
            if got != pattern(seed, offset + i) {
                return Err(offset + i);
            }
        }
        Ok(())
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) };
    }
}

fn pattern(seed: u64, at: usize) -> u8 {
    let x = (at as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
    (x >> 29) as u8
}

const TARGET_SEED: u64 = 0x5EED_7A26;

fn make_agent(name: &str, o: &Options, listen: Option<SocketAddr>) -> nixl::Result<Agent> {
    let agent = Agent::new(
        name,
        AgentConfig {
            listen_addr: listen,
            ..AgentConfig::default()
        },
    )?;
    agent.create_backend(&o.backend, &o.backend_params)?;
    Ok(agent)
}

fn run_target(o: &Options) -> Result<(), String> {
    let agent = make_agent("nixlbench-target", o, Some(o.listen)).map_err(|e| e.to_string())?;
    let buffer = Buffer::new(o.total_buffer_size);
    buffer.fill_pattern(0, buffer.len, TARGET_SEED);
    let regs = DescList::from_descs(
        MemKind::Dram,
        [Desc::new(buffer.addr(), buffer.len as u64, 0)],
    );
    // SAFETY: `buffer` outlives the registration (dropped first, at the end of this fn).
    let _reg = unsafe { agent.register_mem(&regs, None) }.map_err(|e| e.to_string())?;
    println!(
        "NIXLBENCH_TARGET {}",
        agent.listen_addr().expect("listener")
    );
    std::io::stdout().flush().ok();
    // Serve until the initiator says it is done (or goes quiet for a long time).
    let mut last = Instant::now();
    loop {
        for msgs in agent.get_notifs().into_values() {
            if msgs.iter().any(|m| m == b"DONE") {
                return Ok(());
            }
            last = Instant::now();
        }
        if last.elapsed() > Duration::from_secs(600) {
            return Err("target: no word from the initiator for 10 minutes".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[derive(Debug, Clone)]
struct Row {
    block_size: usize,
    batch_size: usize,
    gbps: f64,
    avg_lat_us: f64,
    prep: (f64, f64),
    post: (f64, f64),
    tx: (f64, f64),
}

fn avg_p99(mut samples: Vec<f64>) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort_by(f64::total_cmp);
    let avg = samples.iter().sum::<f64>() / samples.len() as f64;
    let p99 = samples[((samples.len() as f64 * 0.99).ceil() as usize).clamp(1, samples.len()) - 1];
    (avg, p99)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

struct ThreadResult {
    prep: f64,
    post: Vec<f64>,
    tx: Vec<f64>,
}

/// One (block size, batch size) point: every thread moves `batch` blocks per request.
fn run_point(
    agent: &Agent,
    target: &str,
    local: &Buffer,
    remote_base: u64,
    o: &Options,
    block: usize,
    batch: usize,
) -> Result<Row, String> {
    let per_thread = o.total_buffer_size / o.num_threads;
    // Blocks are spaced two apart when there is room, so the descriptors are non-contiguous.
    let stride = if batch * block * 2 <= per_thread {
        2 * block
    } else {
        block
    };
    let iters = if block >= 1 << 20 {
        (o.num_iter / o.large_blk_iter_ftr).max(1)
    } else {
        o.num_iter
    };
    let results: Vec<Result<ThreadResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..o.num_threads)
            .map(|t| {
                s.spawn(move || -> Result<ThreadResult, String> {
                    let base = t * per_thread;
                    let offsets: Vec<usize> = (0..batch).map(|i| base + i * stride).collect();
                    let prep_start = Instant::now();
                    let l = DescList::from_descs(
                        MemKind::Dram,
                        offsets
                            .iter()
                            .map(|&off| Desc::new(local.addr() + off as u64, block as u64, 0)),
                    );
                    let r = DescList::from_descs(
                        MemKind::Dram,
                        offsets
                            .iter()
                            .map(|&off| Desc::new(remote_base + off as u64, block as u64, 0)),
                    );
                    let lh = agent.prep_xfer_dlist(None, &l).map_err(|e| e.to_string())?;
                    let rh = agent
                        .prep_xfer_dlist(Some(target), &r)
                        .map_err(|e| e.to_string())?;
                    let idx: Vec<usize> = (0..batch).collect();
                    let mut req = agent
                        .make_xfer_req(o.op, &lh, &idx, &rh, &idx, None, None)
                        .map_err(|e| e.to_string())?;
                    let prep = us(prep_start.elapsed());
                    if o.check_consistency && o.op == XferOp::Write {
                        for &off in &offsets {
                            local.fill_pattern(off, block, block as u64);
                        }
                    }
                    let timeout = Duration::from_secs(60);
                    for _ in 0..o.warmup_iter.min(iters) {
                        req.post().map_err(|e| e.to_string())?;
                        req.wait(timeout).map_err(|e| e.to_string())?;
                    }
                    let mut post = Vec::with_capacity(iters);
                    let mut tx = Vec::with_capacity(iters);
                    for _ in 0..iters {
                        let start = Instant::now();
                        req.post().map_err(|e| e.to_string())?;
                        post.push(us(start.elapsed()));
                        req.wait(timeout).map_err(|e| e.to_string())?;
                        tx.push(us(start.elapsed()));
                    }
                    if o.check_consistency {
                        check_point(agent, &mut req, local, o, &offsets, block, &lh, &rh)?;
                    }
                    Ok(ThreadResult { prep, post, tx })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .collect()
    });
    let mut prep = Vec::new();
    let mut post = Vec::new();
    let mut tx = Vec::new();
    let mut wall = 0f64;
    for r in results {
        let r = r?;
        wall = wall.max(r.tx.iter().sum::<f64>());
        prep.push(r.prep);
        post.extend(r.post);
        tx.extend(r.tx);
    }
    let bytes = (block * batch * iters * o.num_threads) as f64;
    Ok(Row {
        block_size: block,
        batch_size: batch,
        gbps: bytes / (wall / 1e6) / 1e9,
        avg_lat_us: wall / iters as f64,
        prep: avg_p99(prep),
        post: avg_p99(post),
        tx: avg_p99(tx),
    })
}

/// WRITE: read the blocks back from the target into a cleared local copy and compare
/// with what was written. READ: the local blocks must hold the target's pattern.
#[allow(clippy::too_many_arguments)]
fn check_point(
    agent: &Agent,
    req: &mut nixl::XferReq,
    local: &Buffer,
    o: &Options,
    offsets: &[usize],
    block: usize,
    lh: &nixl::XferDlist,
    rh: &nixl::XferDlist,
) -> Result<(), String> {
    let seed = match o.op {
        XferOp::Read => TARGET_SEED,
        XferOp::Write => {
            for &off in offsets {
                // SAFETY: inside this thread's own slice of the buffer.
                unsafe { std::ptr::write_bytes(local.ptr.add(off), 0, block) };
            }
            let idx: Vec<usize> = (0..offsets.len()).collect();
            let mut back = agent
                .make_xfer_req(XferOp::Read, lh, &idx, rh, &idx, None, None)
                .map_err(|e| e.to_string())?;
            back.post().map_err(|e| e.to_string())?;
            back.wait(Duration::from_secs(60))
                .map_err(|e| e.to_string())?;
            block as u64
        }
    };
    let _ = req;
    for &off in offsets {
        local.check_pattern(off, block, seed).map_err(|at| {
            format!("consistency check failed: block size {block}, byte {at} differs")
        })?;
    }
    Ok(())
}

fn sizes(start: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = start;
    while s <= max {
        v.push(s);
        match s.checked_mul(2) {
            Some(n) => s = n,
            None => break,
        }
    }
    v
}

fn run_initiator(o: &Options, target_addr: SocketAddr) -> Result<Vec<Row>, String> {
    let agent = make_agent("nixlbench-initiator", o, None).map_err(|e| e.to_string())?;
    let target = agent
        .fetch_remote_metadata(target_addr)
        .map_err(|e| e.to_string())?;
    let local = Buffer::new(o.total_buffer_size);
    let regs = DescList::from_descs(
        MemKind::Dram,
        [Desc::new(local.addr(), local.len as u64, 0)],
    );
    // SAFETY: `local` outlives the registration and every request (all inside this fn).
    let _reg = unsafe { agent.register_mem(&regs, None) }.map_err(|e| e.to_string())?;
    // The target registered one buffer; its address is in the metadata we loaded.
    let remote_base = remote_buffer_base(&agent, &target)?;
    let points: Vec<(usize, usize)> = sizes(o.start_block_size, o.max_block_size)
        .into_iter()
        .flat_map(|b| {
            sizes(o.start_batch_size, o.max_batch_size)
                .into_iter()
                .map(move |n| (b, n))
        })
        .filter(|(b, n)| b * n <= o.total_buffer_size / o.num_threads)
        .collect();
    if points.is_empty() {
        return Err("no block/batch size fits in --total_buffer_size / --num_threads".into());
    }
    let bar = if o.progress {
        indicatif::ProgressBar::new(points.len() as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    println!(
        "nixlbench: backend {}, {:?}, {} thread(s), target `{target}` at {target_addr}",
        o.backend, o.op, o.num_threads
    );
    println!("{}", "-".repeat(150));
    println!(
        "{:<18} {:<12} {:<14} {:<16} {:<14} {:<14} {:<14} {:<14} {:<14} {:<14}",
        "Block Size (B)",
        "Batch Size",
        "B/W (GB/Sec)",
        "Avg Lat. (us)",
        "Avg Prep (us)",
        "P99 Prep (us)",
        "Avg Post (us)",
        "P99 Post (us)",
        "Avg Tx (us)",
        "P99 Tx (us)"
    );
    println!("{}", "-".repeat(150));
    let mut rows = Vec::new();
    for (block, batch) in points {
        let row = run_point(&agent, &target, &local, remote_base, o, block, batch)?;
        bar.suspend(|| {
            println!(
                "{:<18} {:<12} {:<14.6} {:<16.3} {:<14.3} {:<14.3} {:<14.3} {:<14.3} {:<14.3} {:<14.3}",
                row.block_size, row.batch_size, row.gbps, row.avg_lat_us, row.prep.0, row.prep.1,
                row.post.0, row.post.1, row.tx.0, row.tx.1
            )
        });
        bar.inc(1);
        rows.push(row);
    }
    bar.finish_and_clear();
    if o.check_consistency {
        println!("consistency check: every block verified");
    }
    agent
        .gen_notif(&target, b"DONE")
        .map_err(|e| e.to_string())?;
    Ok(rows)
}

fn remote_buffer_base(agent: &Agent, target: &str) -> Result<u64, String> {
    // Probe: the first region the target advertised. Partial-metadata users would know it
    // from their own protocol; here the target registers exactly one buffer.
    let md = agent.remote_regions(target).map_err(|e| e.to_string())?;
    md.first()
        .map(|r| r.desc.addr)
        .ok_or_else(|| format!("target `{target}` registered no memory"))
}

fn plot(path: &str, rows: &[Row], o: &Options) -> Result<(), String> {
    use plotters::prelude::*;
    let font = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"]
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .ok_or("--plot needs a TrueType font: install fonts-dejavu-core")?;
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    )
    .map_err(|_| "the font could not be loaded")?;
    let root = BitMapBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (left, right) = root.split_horizontally(600);
    let batch = rows.first().map_or(1, |r| r.batch_size);
    let rows: Vec<&Row> = rows.iter().filter(|r| r.batch_size == batch).collect();
    let xs: Vec<f64> = rows.iter().map(|r| (r.block_size as f64).log2()).collect();
    let (x0, x1) = (
        xs.first().copied().unwrap_or(0.0),
        xs.last().copied().unwrap_or(1.0) + 0.01,
    );
    for (area, title, ys) in [
        (
            &left,
            "Bandwidth (GB/s)",
            rows.iter().map(|r| r.gbps).collect::<Vec<_>>(),
        ),
        (
            &right,
            "Avg latency (us)",
            rows.iter().map(|r| r.avg_lat_us).collect::<Vec<_>>(),
        ),
    ] {
        let ymax = ys.iter().copied().fold(0.0, f64::max) * 1.1 + 1e-9;
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("nixlbench {} {:?} batch {batch}: {title}", o.backend, o.op),
                ("sans-serif", 16),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, 0.0..ymax)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("block size (log2 bytes)")
            .y_desc(title)
            .x_label_formatter(&|x| format!("{}", 1u64 << (*x as u32)))
            .draw()
            .map_err(|e| e.to_string())?;
        let points: Vec<(f64, f64)> = xs.iter().copied().zip(ys.iter().copied()).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), &BLUE))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 3, BLUE.filled())))
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())?;
    println!("plot written to {path}");
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = match parse_args(&args) {
        Ok(o) => o,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("nixlbench: {msg}");
            }
            eprintln!("{USAGE}");
            std::process::exit(if msg.is_empty() { 0 } else { 2 });
        }
    };
    let result = match (o.role.as_deref(), o.target_address) {
        (Some("target"), _) => run_target(&o).map(|_| None),
        (Some("initiator"), Some(addr)) => run_initiator(&o, addr).map(Some),
        (Some("initiator"), None) => Err("--role initiator needs --target_address".into()),
        (Some(other), _) => Err(format!("--role {other}: target or initiator")),
        (None, _) => run_both(&o, &args).map(Some),
    };
    match result {
        Ok(Some(rows)) => {
            if let Some(path) = &o.plot {
                if let Err(e) = plot(path, &rows, &o) {
                    eprintln!("nixlbench: plot: {e}");
                    std::process::exit(1);
                }
            }
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("nixlbench: {e}");
            std::process::exit(1);
        }
    }
}

/// Starts the target as a child process on loopback and runs the initiator against it.
fn run_both(o: &Options, args: &[String]) -> Result<Vec<Row>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(args)
        .args([
            "--role",
            "target",
            "--listen",
            "127.0.0.1:0",
            "--no_progress",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the target: {e}"))?;
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let addr = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(a) = line.strip_prefix("NIXLBENCH_TARGET ") {
                    break a.parse::<SocketAddr>().map_err(|e| e.to_string())?;
                }
            }
            _ => {
                let _ = child.kill();
                return Err("the target exited before announcing its address".into());
            }
        }
    };
    let rows = run_initiator(o, addr);
    if rows.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let rows = rows?;
    if !status.success() {
        return Err(format!("target exited with {status}"));
    }
    Ok(rows)
}
