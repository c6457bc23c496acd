//! `kvbench`: a vLLM-shaped KV-cache transfer through the `nixl` agent — many small
//! descriptors picked by block id from lists prepared once — between two processes.
//!
//! Each side holds a paged KV cache (`--layers` × K/V × `--blocks` blocks of
//! `--block-bytes`, laid out `block-major` or `strided`: [`tools::kv::Layout`]) in DRAM
//! or VRAM, registered whole. The initiator prepares one descriptor list per side with
//! one descriptor per layer × K/V × block (`prep_xfer_dlist`, timed), then runs
//! `--requests` requests of `--blocks-per-request` block ids each, `--inflight` at a
//! time: `make_xfer_req` by descriptor index → post → poll until done, the notification
//! delivered to the target behind the data (vLLM's connector does exactly this). Block
//! ids are seeded random or sequential; requests in flight together never share a block,
//! so the final contents are known and checked afterwards (every byte, unless
//! `--no-verify`): READ on the initiator, WRITE by the target, which answers with its
//! verdict.
//!
//! With no `--role`, it starts its own target as a child process on loopback (as
//! `nixlbench` does) with the same arguments; `--role target --listen ADDR` and `--target
//! ADDR` run the two sides on two hosts (give both the same shape, block-id and request
//! arguments: the target computes the same plan to check a WRITE).
//!
//! Backends: `--backend default` creates what NIXL's default (`UCX`) stands for
//! ([`nixl::Agent::create_default_backends`]: `LIBFABRIC`, and `CUDA_IPC` where there is a
//! GPU) and leaves the choice per transfer to the agent; a name creates that backend alone.
//! The table says which backend the agent picked.

mod mem;

use clap::{Parser, ValueEnum};
use mem::KvMem;
use nixl::{Agent, AgentConfig, BackendParams, DescList, MemKind, XferOp, XferStatus};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tools::kv::{self, BlockOrder, KvShape, Layout, Request};

const PROGRAM: &str = "kvbench";
const TARGET_NAME: &str = "kvbench-target";
const INITIATOR_NAME: &str = "kvbench-initiator";
/// Set in the self-started target's environment: it stays quiet.
const CHILD_ENV: &str = "KVBENCH_CHILD";
/// The line on which a target announces its listener.
const ANNOUNCE: &str = "KVBENCH_TARGET ";
/// Fill seeds of the two caches (what each unit holds before any request).
const INITIATOR_SEED: u64 = 0x1A17_1A70;
const TARGET_SEED: u64 = 0x7A26_E700;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LayoutArg {
    /// Layer by layer, K then V, each a contiguous run of its blocks
    BlockMajor,
    /// Block by block: a layer's blocks are layers × 2 × block-bytes apart
    Strided,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OrderArg {
    Random,
    Sequential,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OpArg {
    #[value(name = "READ", alias = "read")]
    Read,
    #[value(name = "WRITE", alias = "write")]
    Write,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum MemArg {
    #[value(name = "DRAM", alias = "dram")]
    Dram,
    #[value(name = "VRAM", alias = "vram")]
    Vram,
}

impl MemArg {
    fn kind(self) -> MemKind {
        match self {
            Self::Dram => MemKind::Dram,
            Self::Vram => MemKind::Vram,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RoleArg {
    Target,
    Initiator,
}

/// A vLLM-shaped paged KV-cache transfer between two processes through the nixl agent:
/// one descriptor per layer × K/V × block, prepared once, requests by block id
#[derive(Parser, Debug, Clone)]
#[command(name = "kvbench", version, max_term_width = 100)]
struct Cli {
    /// Layers of the cache
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65536))]
    layers: u32,
    /// Blocks per layer (per K and per V) of each side's cache
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    blocks: u32,
    /// Bytes of one block of one layer's K or V (a multiple of 8; 32K, 64KiB, ...)
    #[arg(long, default_value = "32K", value_parser = block_bytes)]
    block_bytes: usize,
    /// Where the blocks lie
    #[arg(long, value_enum, default_value_t = LayoutArg::BlockMajor)]
    layout: LayoutArg,
    /// How each request's block ids are chosen
    #[arg(long, value_enum, default_value_t = OrderArg::Random)]
    block_ids: OrderArg,
    /// Seed of the random block ids
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// READ (the initiator pulls from the target, as a decode engine does) or WRITE
    #[arg(long, value_enum, default_value_t = OpArg::Read)]
    op: OpArg,
    /// Blocks per request (each moves layers × 2 × this many descriptors)
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    blocks_per_request: u32,
    /// Requests timed (after the warm-up)
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    requests: u32,
    /// Requests run first, untimed
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Requests in flight at a time
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    inflight: u32,
    /// The initiator's memory
    #[arg(long, value_enum, default_value_t = MemArg::Dram)]
    initiator_mem: MemArg,
    /// The target's memory
    #[arg(long, value_enum, default_value_t = MemArg::Dram)]
    target_mem: MemArg,
    /// The initiator's GPU (VRAM)
    #[arg(long, default_value_t = 0)]
    initiator_gpu: usize,
    /// The target's GPU (VRAM)
    #[arg(long, default_value_t = 0)]
    target_gpu: usize,
    /// `default` (NIXL's default set: the agent picks per transfer) or a backend name
    /// (UCX means LIBFABRIC)
    #[arg(long, default_value = "default")]
    backend: String,
    /// Parameter of a named backend (repeatable)
    #[arg(long, value_name = "KEY=VALUE", value_parser = key_value)]
    backend_param: Vec<(String, String)>,
    /// Skip the data check (pure speed runs)
    #[arg(long)]
    no_verify: bool,
    /// Also print where a timed request's time went on average: building it
    /// (`make_xfer_req`), posting it, and waiting for it
    #[arg(long)]
    breakdown: bool,
    /// Run one side only: `target` (with --listen) or `initiator` (with --target)
    #[arg(long, value_enum)]
    role: Option<RoleArg>,
    /// The target's metadata listener
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:0")]
    listen: SocketAddr,
    /// The target's listener, for --role initiator
    #[arg(long, value_name = "ADDR")]
    target: Option<SocketAddr>,
}

fn block_bytes(text: &str) -> Result<usize, String> {
    let n = tools::units::parse_size_usize(text)?;
    if n == 0 || !n.is_multiple_of(8) {
        return Err(format!(
            "{n} bytes: a block is a positive multiple of 8 bytes"
        ));
    }
    Ok(n)
}

fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{text}` is not KEY=VALUE (e.g. provider=shm)")),
    }
}

impl Cli {
    fn shape(&self) -> KvShape {
        KvShape {
            layers: self.layers as usize,
            blocks: self.blocks as usize,
            block_bytes: self.block_bytes,
            layout: match self.layout {
                LayoutArg::BlockMajor => Layout::BlockMajor,
                LayoutArg::Strided => Layout::Strided,
            },
        }
    }

    fn xfer_op(&self) -> XferOp {
        match self.op {
            OpArg::Read => XferOp::Read,
            OpArg::Write => XferOp::Write,
        }
    }

    /// Every request, warm-up first (both sides compute the same).
    fn plan(&self) -> Result<Vec<Request>, String> {
        kv::plan(
            self.blocks as usize,
            self.blocks_per_request as usize,
            (self.warmup + self.requests) as usize,
            self.inflight as usize,
            match self.block_ids {
                OrderArg::Random => BlockOrder::Random,
                OrderArg::Sequential => BlockOrder::Sequential,
            },
            self.seed,
        )
    }

    /// What can be found wrong before anything starts (a child target included): the
    /// shape and plan, the backend, and memory this process's sides need.
    fn check(&self) -> Result<(), String> {
        let bytes = self.shape().bytes().ok_or("the cache's size overflows")?;
        if u64::try_from(bytes).is_err() {
            return Err("the cache's size overflows".into());
        }
        self.plan()?;
        if self.backend.eq_ignore_ascii_case("default") {
            if !self.backend_param.is_empty() {
                return Err("--backend-param needs a backend named with --backend".into());
            }
        } else {
            tools::backend::resolve(&self.backend)?;
        }
        let sides: &[(MemArg, usize, &str)] = match (self.role, self.target) {
            (Some(RoleArg::Target), _) => &[(self.target_mem, self.target_gpu, "target")],
            (_, Some(_)) | (Some(RoleArg::Initiator), _) => {
                &[(self.initiator_mem, self.initiator_gpu, "initiator")]
            }
            (None, None) => &[
                (self.initiator_mem, self.initiator_gpu, "initiator"),
                (self.target_mem, self.target_gpu, "target"),
            ],
        };
        for &(mem, gpu, side) in sides {
            if mem == MemArg::Vram {
                mem::check_gpu(gpu).map_err(|e| format!("--{side}-mem VRAM: {e}"))?;
            }
        }
        Ok(())
    }
}

fn quiet() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

fn main() {
    tools::cli::init_tracing();
    let cli: Cli = tools::cli::parse_or_exit(PROGRAM);
    if let Err(e) = cli.check() {
        tools::cli::Stop::Usage(e).exit(PROGRAM);
    }
    let result = match (cli.role, cli.target) {
        (Some(RoleArg::Target), _) => run_target(&cli),
        (Some(RoleArg::Initiator), Some(addr)) => run_initiator(&cli, addr),
        (Some(RoleArg::Initiator), None) => Err("--role initiator needs --target ADDR".into()),
        (None, Some(addr)) => run_initiator(&cli, addr),
        (None, None) => run_both(&cli),
    };
    if let Err(e) = result {
        tools::cli::fail(PROGRAM, e);
    }
}

/// The agent of one side, with its backends: NIXL's default set, or the one named.
fn agent_with_backends(cli: &Cli, name: &str, listen: Option<SocketAddr>) -> Result<Agent, String> {
    let config = AgentConfig {
        listen_addr: listen,
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).map_err(|e| e.to_string())?;
    if cli.backend.eq_ignore_ascii_case("default") {
        agent
            .create_default_backends()
            .map_err(|e| format!("NIXL's default backends: {e}"))?;
    } else {
        let resolved = tools::backend::resolve(&cli.backend)?;
        if let (Some(note), false) = (&resolved.note, quiet()) {
            eprintln!("{PROGRAM}: {note}");
        }
        let params: BackendParams = cli.backend_param.iter().cloned().collect();
        agent
            .create_backend(&resolved.name, &params)
            .map_err(|e| format!("{}: {e}", resolved.name))?;
    }
    Ok(agent)
}

/// Registers the whole cache with every backend of the agent.
fn register(agent: &Agent, mem: &KvMem) -> Result<nixl::RegistrationHandle, String> {
    let list = DescList::from_descs(mem.kind(), [mem.desc(0, mem.len())]);
    // SAFETY: every caller keeps `mem` alive longer than the handle (declared before
    // it); the benchmark tolerates the peer reading or writing the cache at any time.
    unsafe { agent.register_mem(&list, None) }.map_err(|e| format!("registering the cache: {e}"))
}

/// Starts the target as a child process on loopback with the same arguments and runs
/// the initiator against it.
fn run_both(cli: &Cli) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .args(["--role", "target", "--listen", "127.0.0.1:0"])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the target: {e}"))?;
    let announced = child.stdout.take().and_then(|out| {
        BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix(ANNOUNCE).map(str::to_string))
    });
    let Some(addr) = announced.and_then(|a| a.parse::<SocketAddr>().ok()) else {
        let _ = child.kill();
        let status = child.wait().map_err(|e| e.to_string())?;
        return Err(format!(
            "the target exited ({status}) before announcing its address"
        ));
    };
    let run = run_initiator(cli, addr);
    if run.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    run?;
    if !status.success() {
        return Err(format!("the target exited with {status}"));
    }
    Ok(())
}

/// The target: registers its cache, announces its listener, serves until DONE, then
/// checks a WRITE's result and answers the initiator with its verdict.
fn run_target(cli: &Cli) -> Result<(), String> {
    let shape = cli.shape();
    let mut mem = KvMem::alloc(cli.target_mem.kind(), cli.target_gpu, &shape, TARGET_SEED)?;
    let agent = agent_with_backends(cli, TARGET_NAME, Some(cli.listen))?;
    let _reg = register(&agent, &mem)?;
    let listening = agent
        .listen_addr()
        .ok_or("the target's metadata listener did not start")?;
    println!("{ANNOUNCE}{listening}");
    std::io::stdout().flush().ok();
    if !quiet() {
        eprintln!(
            "{PROGRAM} target: {} at {listening}, {}",
            agent.name(),
            mem.describe()
        );
    }
    let mut last = Instant::now();
    let initiator = loop {
        let notifs = agent.wait_notifs(Duration::from_secs(1));
        if !notifs.is_empty() {
            last = Instant::now();
        }
        let done = notifs
            .into_iter()
            .find(|(_, msgs)| msgs.iter().any(|m| m.as_slice() == b"DONE"));
        if let Some((sender, _)) = done {
            break sender;
        }
        if last.elapsed() > Duration::from_secs(600) {
            return Err("target: no word from the initiator for 10 minutes".into());
        }
    };
    let verdict = if cli.no_verify || cli.op == OpArg::Read {
        "skipped".to_string()
    } else {
        let expected = kv::expected(&shape, &cli.plan()?, false);
        match mem.check(&shape, &expected, TARGET_SEED, INITIATOR_SEED) {
            Ok(()) => "ok".to_string(),
            Err(e) => e,
        }
    };
    agent
        .gen_notif(&initiator, format!("VERIFIED {verdict}").as_bytes())
        .map_err(|e| format!("target: answering {initiator}: {e}"))?;
    // The notification is on its way before the process (and its backends) ends.
    std::thread::sleep(Duration::from_millis(200));
    Ok(())
}

/// Fetches the target's metadata until it shows its registered cache; returns its name.
fn wait_for_target(agent: &Agent, addr: SocketAddr, cli: &Cli) -> Result<String, String> {
    tools::backend::wait_for_target(
        agent,
        addr,
        &format!(
            "this agent's backends reach (--target-mem {:?} with --backend {})",
            cli.target_mem, cli.backend
        ),
    )
}

fn run_initiator(cli: &Cli, target_addr: SocketAddr) -> Result<(), String> {
    let shape = cli.shape();
    let plan = cli.plan()?;
    let mut mem = KvMem::alloc(
        cli.initiator_mem.kind(),
        cli.initiator_gpu,
        &shape,
        INITIATOR_SEED,
    )?;
    let agent = agent_with_backends(cli, INITIATOR_NAME, None)?;
    let _reg = register(&agent, &mem)?;
    agent
        .send_local_metadata(target_addr)
        .map_err(|e| format!("sending our metadata to {target_addr}: {e}"))?;
    let target = wait_for_target(&agent, target_addr, cli)?;
    let remote_kind = cli.target_mem.kind();
    let remote_region = agent
        .remote_regions(&target)
        .map_err(|e| e.to_string())?
        .into_iter()
        .find(|r| r.kind == remote_kind)
        .ok_or_else(|| format!("the target shows no {remote_kind:?} region"))?;
    let remote_base = remote_region.desc.addr;
    let remote_dev = remote_region.desc.dev_id;

    // One descriptor per layer × K/V × block on each side, in descriptor-index order.
    let units = shape.units();
    let bb = shape.block_bytes as u64;
    let local_list = DescList::from_descs(
        mem.kind(),
        (0..units).map(|u| mem.desc(shape.offset(u), shape.block_bytes)),
    );
    let remote_list = DescList::from_descs(
        remote_kind,
        (0..units).map(|u| nixl::Desc::new(remote_base + shape.offset(u) as u64, bb, remote_dev)),
    );
    let t = Instant::now();
    let local = agent
        .prep_xfer_dlist(None, &local_list)
        .map_err(|e| format!("prep_xfer_dlist (local): {e}"))?;
    let prep_local = t.elapsed();
    let t = Instant::now();
    let remote = agent
        .prep_xfer_dlist(Some(&target), &remote_list)
        .map_err(|e| format!("prep_xfer_dlist (remote): {e}"))?;
    let prep_remote = t.elapsed();

    let op = cli.xfer_op();
    let warmup = cli.warmup as usize;
    let inflight = cli.inflight as usize;
    let mut active: Vec<(nixl::XferReq, usize, Instant)> = Vec::with_capacity(inflight);
    let mut timed: Vec<Duration> = Vec::with_capacity(cli.requests as usize);
    // Sums over the timed requests: (make_xfer_req, post).
    let mut spent = (Duration::ZERO, Duration::ZERO);
    let mut backend_used = String::new();
    let mut next = 0;
    let mut measured_start: Option<Instant> = None;
    let deadline = Duration::from_secs(600);
    let started = Instant::now();
    while next < plan.len() || !active.is_empty() {
        // Warm-up requests run alone and finish before the timed ones start.
        let window = if next < warmup { 1 } else { inflight };
        let warm_done = next >= warmup && active.iter().all(|(_, i, _)| *i >= warmup);
        while next < plan.len() && active.len() < window && (next < warmup || warm_done) {
            let r = &plan[next];
            let t0 = Instant::now();
            if next == warmup {
                measured_start = Some(t0);
            }
            let mut req = agent
                .make_xfer_req(
                    op,
                    &local,
                    &shape.indices(&r.local),
                    &remote,
                    &shape.indices(&r.remote),
                    Some(format!("KV {next}").into_bytes()),
                    None,
                )
                .map_err(|e| format!("request {next}: make_xfer_req: {e}"))?;
            let made = t0.elapsed();
            if backend_used.is_empty() {
                backend_used = req.backend_name().to_string();
            }
            let status = req
                .post()
                .map_err(|e| format!("request {next}: post: {e}"))?;
            if next >= warmup {
                spent.0 += made;
                spent.1 += t0.elapsed() - made;
            }
            if status == XferStatus::Done {
                if next >= warmup {
                    timed.push(t0.elapsed());
                }
            } else {
                active.push((req, next, t0));
            }
            next += 1;
        }
        let mut i = 0;
        let before = active.len();
        while i < active.len() {
            let status = active[i]
                .0
                .status()
                .map_err(|e| format!("request {}: {e}", active[i].1))?;
            if status == XferStatus::Done {
                let (_, n, t0) = active.swap_remove(i);
                if n >= warmup {
                    timed.push(t0.elapsed());
                }
            } else {
                i += 1;
            }
        }
        if !active.is_empty() && active.len() == before {
            // Nothing completed: let the backends' progress threads (and, on a small
            // machine, the target) run rather than spin against them.
            std::thread::yield_now();
        }
        if started.elapsed() > deadline {
            return Err(format!(
                "requests still in flight after {} s",
                deadline.as_secs()
            ));
        }
    }
    let elapsed = measured_start.map(|s| s.elapsed()).unwrap_or_default();
    agent
        .gen_notif(&target, b"DONE")
        .map_err(|e| format!("telling the target DONE: {e}"))?;

    // The check: READ here, WRITE by the target (its verdict comes back).
    let local_verdict = if cli.no_verify || op == XferOp::Write {
        None
    } else {
        let expected = kv::expected(&shape, &plan, true);
        Some(mem.check(&shape, &expected, INITIATOR_SEED, TARGET_SEED))
    };
    let target_verdict = wait_for_verdict(&agent, &target)?;
    let verified = match (local_verdict, target_verdict.as_str()) {
        (Some(Err(e)), _) => return Err(format!("READ data check failed: {e}")),
        (Some(Ok(())), _) => "verified",
        (None, "ok") => "verified",
        (None, "skipped") => "not checked",
        (None, other) => return Err(format!("WRITE data check failed on the target: {other}")),
    };

    let descs = shape.layers * 2 * cli.blocks_per_request as usize;
    let bytes_per_req = descs as u64 * bb;
    let mut lat = timed.clone();
    lat.sort();
    let total_bytes = bytes_per_req * timed.len() as u64;
    let gbps = total_bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9;
    let us = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e6);
    println!(
        "{PROGRAM}: {} {} -> {}, backend {} ({}), {} layers x K/V x {} blocks x {} ({}), {} block ids, data {verified}",
        if op == XferOp::Read { "READ" } else { "WRITE" },
        mem.describe(),
        describe_kind(remote_kind, remote_dev),
        backend_used,
        if cli.backend.eq_ignore_ascii_case("default") { "the agent's choice" } else { "named" },
        shape.layers,
        shape.blocks,
        tools::units::human_bytes(bb),
        value_name(cli.layout),
        value_name(cli.block_ids),
    );
    println!(
        "{:>10} {:>12} {:>8} {:>9} {:>10} {:>10} {:>10} {:>13} {:>14}",
        "descs/req",
        "bytes/req",
        "inflight",
        "requests",
        "GB/s",
        "p50 us",
        "p99 us",
        "prep local ms",
        "prep remote ms"
    );
    println!(
        "{:>10} {:>12} {:>8} {:>9} {:>10.3} {:>10.1} {:>10.1} {:>13.3} {:>14.3}",
        descs,
        bytes_per_req,
        inflight,
        timed.len(),
        gbps,
        us(kv::percentile(&lat, 50.0)),
        us(kv::percentile(&lat, 99.0)),
        prep_local.as_secs_f64() * 1e3,
        prep_remote.as_secs_f64() * 1e3,
    );
    if cli.breakdown && !timed.is_empty() {
        let n = timed.len() as f64;
        let mean = |d: Duration| d.as_secs_f64() * 1e6 / n;
        let whole: Duration = timed.iter().sum();
        println!(
            "per request (mean us): make_xfer_req {:.1}, post {:.1}, posted to done {:.1}",
            mean(spent.0),
            mean(spent.1),
            mean(whole.saturating_sub(spent.0 + spent.1)),
        );
    }
    Ok(())
}

/// The command-line spelling of a value.
fn value_name(v: impl ValueEnum) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_string())
}

fn describe_kind(kind: MemKind, dev: u64) -> String {
    match kind {
        MemKind::Vram => format!("VRAM (GPU {dev})"),
        other => format!("{other:?}").to_ascii_uppercase(),
    }
}

/// The target's `VERIFIED <verdict>` (after DONE).
fn wait_for_verdict(agent: &Agent, target: &str) -> Result<String, String> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(600) {
        for (sender, msgs) in agent.wait_notifs(Duration::from_millis(200)) {
            if sender != target {
                continue;
            }
            for m in msgs {
                let text = String::from_utf8_lossy(&m);
                if let Some(v) = text.strip_prefix("VERIFIED ") {
                    return Ok(v.to_string());
                }
            }
        }
    }
    Err("the target sent no verdict in 10 minutes".into())
}
