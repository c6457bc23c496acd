//! Issue 28's load goals as a run: does an agent keep serving a legitimate peer while
//! strangers attack its metadata listener and its `LIBFABRIC` rail?
//!
//! For each provider (`--provider`, default `shm` and `tcp;ofi_rxm`) the harness starts
//! a target agent process (this binary, `--role target`) and plays, in its own process,
//! a legitimate initiator that moves verified data: each round WRITEs a fresh pattern
//! into one of the target's slots with a notification, the target checks the slot
//! against the pattern and answers, and the initiator READs the slot back and checks it
//! too. It measures a quiet baseline, then runs each attack while the initiator goes on:
//!
//! - `connections`: `--connections` hostile TCP connections to the listener from 250
//!   loopback addresses — a third opened and closed, a third held silent, a third fed a
//!   request header one byte every 100 ms (slowloris);
//! - `junk`: `--junk` bytes of junk frames (metadata pushes of 1 to 48 MiB that fail
//!   their check, oversized announcements, junk fetches, random bytes), 8 at a time;
//! - `notifications`: `--notifications` forged notification messages from a raw
//!   libfabric endpoint on the target's rail 0 (its address read from the metadata the
//!   listener hands anyone): under the initiator's name, under strangers' names, waiting
//!   for data that never comes, malformed;
//! - `all`: the three at once.
//!
//! During each attack a probe fetches the target's metadata from 127.0.0.1 every 200 ms.
//! The table gives, per phase, the transfers and rounds verified, p50/p99 of a transfer
//! (post to done) and of a notified round (WRITE posted to the target's answer), p99
//! against the quiet baseline, the target's peak RSS growth over its RSS after the
//! baseline, the peak growth of its allocator's bytes in use and bytes taken from the
//! system over the same point (glibc's `mallinfo2`: live heap against heap kept, against
//! RSS outside `malloc`), and the probes answered. Goals (issue 28): p99 within 2x of the quiet
//! baseline, RSS growth under 64 MiB, every probe answered. A run whose legitimate data
//! was not all verified, whose target died, or where a forged notification reached the
//! target under the initiator's name exits 1; a missed goal does too with `--strict`.
//!
//! Every process of a run uses `FI_OFI_RXM_BUFFER_SIZE=512` unless the environment or
//! `--rxm-buffer-size` says otherwise (set in the target alone, it stalled a WRITE): with
//! the provider's 16 KiB, `ofi_rxm` kept forged messages in 16 KiB bounce buffers (hundreds
//! of MiB under 100,000 of them) until the rail worker's completion reads took in as many
//! entries as one progress call lets in (docs/BENCHMARKS.md, session 7); `--rxm-buffer-size
//! 0` checks that bound at the provider's default, and the default stays 512 so that runs
//! compare with earlier ones.
//!
//! The connector and the notifier run as processes of their own (this binary in an
//! attacker's role; the junk senders are threads of the harness): the connector raises
//! its `RLIMIT_NOFILE` to the hard limit (it holds the hostile connections); the target
//! runs with the limit it was started with. Every process runs
//! on this host, so the attackers share its cores with the peers: on a machine with few
//! cores the latency figures measure the competition for them as much as the target's
//! defences. Figures go to `docs/BENCHMARKS.md`.

mod attack;
mod target;
mod wire;

use attack::AttackReport;
use clap::Parser;
use nixl::{Agent, AgentConfig, BackendParams, Desc, DescList, MemKind, XferOp, XferReq};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wire::{holds_pattern, pattern};

pub(crate) const PROGRAM: &str = "nixl-attack-bench";
pub(crate) const INITIATOR: &str = "attack-initiator";
/// Slots of the target's buffer the initiator rotates through.
const SLOTS: usize = 16;
/// Longest a transfer or an answer may take before the run counts it failed.
const ROUND_TIMEOUT: Duration = Duration::from_secs(10);
/// `ofi_rxm`'s bounce buffer size (see `--rxm-buffer-size`).
const RXM_BUFFER_SIZE: &str = "FI_OFI_RXM_BUFFER_SIZE";
/// Goals of issue 28.
const P99_GOAL_RATIO: f64 = 2.0;
const RSS_GOAL_BYTES: u64 = 64 << 20;

/// Runs attacks on a target agent's metadata listener and LIBFABRIC rail while a
/// legitimate initiator moves verified data; reports p99 latency and the target's RSS
/// against a quiet baseline
#[derive(Parser, Debug)]
#[command(name = PROGRAM, version, max_term_width = 100)]
struct Cli {
    /// LIBFABRIC providers to run, comma-separated
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "shm,tcp;ofi_rxm"
    )]
    provider: Vec<String>,
    /// Hostile connections to the metadata listener
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    connections: usize,
    /// Bytes of junk frames sent to the listener (binary suffixes: 64M, 1GiB)
    #[arg(long, value_name = "BYTES", default_value = "1GiB", value_parser = tools::units::parse_size)]
    junk: u64,
    /// Forged notification messages sent to the target's rail
    #[arg(long, value_name = "N", default_value_t = 100_000)]
    notifications: u64,
    /// The forged messages of the `notifications` phase are sealed rail control
    /// messages (staging OFFERs) naming strangers, each under a fresh random public key
    /// (each would cost the target an X25519 key agreement), instead of notifications
    #[arg(long)]
    control_frames: bool,
    /// Bytes per legitimate transfer
    #[arg(long, value_name = "BYTES", default_value = "64K",
          value_parser = tools::units::parse_size_usize)]
    block: usize,
    /// Rounds of the quiet baseline (each a WRITE with notification and a READ)
    #[arg(long, value_name = "N", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(10..))]
    baseline: u64,
    /// Fewest rounds during each attack (the initiator goes on while an attack lasts)
    #[arg(long, value_name = "N", default_value_t = 200,
          value_parser = clap::value_parser!(u64).range(1..))]
    min_rounds: u64,
    /// Attack phases to run after the quiet baseline, comma-separated
    #[arg(long, value_name = "LIST", value_delimiter = ',',
          default_value = "connections,junk,notifications,all",
          value_parser = ["connections", "junk", "notifications", "all"])]
    phases: Vec<String>,
    /// LIBFABRIC parameter for both agents (repeatable); `tcp;ofi_rxm` runs get
    /// `local_provider=none` unless given, so that peers on this host use tcp too
    #[arg(long = "backend_param", alias = "backend-param", value_name = "KEY=VALUE",
          value_parser = key_value)]
    backend_param: Vec<(String, String)>,
    /// `FI_OFI_RXM_BUFFER_SIZE` of every process of the run where the environment does
    /// not set it (0: the provider's default, 16 KiB). `ofi_rxm` holds every message that
    /// finds no posted receive in a bounce buffer of this size, without limit (a receiver
    /// that reads fewer completions per read than one progress call lets in grows by
    /// this much per message); larger messages go by rendezvous, which leaves their bytes
    /// at the sender. All processes of a job should use the same size
    #[arg(long, value_name = "BYTES", default_value_t = 512)]
    rxm_buffer_size: usize,
    /// Exit 1 when a goal is missed (p99 within 2x, RSS growth under 64 MiB, probes)
    #[arg(long)]
    strict: bool,
    /// CPUs the target process runs on (e.g. `0-7`; default: those of this process).
    /// The initiator is this process: pin it with `taskset`
    #[arg(long, value_name = "LIST", value_parser = cpu_list)]
    target_cpus: Option<String>,
    /// CPUs the attackers run on: the connector and notifier processes and the junk
    /// senders' threads (e.g. `16-31`)
    #[arg(long, value_name = "LIST", value_parser = cpu_list)]
    attacker_cpus: Option<String>,
    /// (a process in a role) the CPUs to pin itself to
    #[arg(long, hide = true, value_parser = cpu_list)]
    cpus: Option<String>,
    #[arg(long, hide = true)]
    role: Option<String>,
    #[arg(long, hide = true)]
    nonce: Option<String>,
    /// (`--role notifier`) the target rail's endpoint name, hex
    #[arg(long, hide = true)]
    rail: Option<String>,
    /// (`--role connector`) the target's metadata listener
    #[arg(long, hide = true)]
    listen: Option<SocketAddr>,
}

/// Checks a CPU list (`0-7,16,18-20`); keeps its text, which is passed on to children.
fn cpu_list(text: &str) -> Result<String, String> {
    parse_cpus(text).map(|_| text.to_string())
}

/// The CPUs of a list like `0-7,16,18-20`.
pub(crate) fn parse_cpus(text: &str) -> Result<Vec<usize>, String> {
    let bad = || format!("`{text}` is not a CPU list (e.g. 0-7,16)");
    let mut cpus = Vec::new();
    for part in text.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (usize, usize) = (
            lo.trim().parse().map_err(|_| bad())?,
            hi.trim().parse().map_err(|_| bad())?,
        );
        if lo > hi || hi >= libc::CPU_SETSIZE as usize {
            return Err(bad());
        }
        cpus.extend(lo..=hi);
    }
    Ok(cpus)
}

/// Pins the calling thread (and the threads it starts later) to `cpus`.
pub(crate) fn pin_to(cpus: &[usize]) -> Result<(), String> {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes inside it (every cpu
    // is below CPU_SETSIZE, checked by parse_cpus); sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(format!(
                "pinning to CPUs {cpus:?}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!(
            "`{text}` is not KEY=VALUE (e.g. heartbeat_misses=20)"
        )),
    }
}

/// The LIBFABRIC parameters of both agents for `provider`.
pub(crate) fn backend_params(provider: &str, extra: &[(String, String)]) -> BackendParams {
    let mut params: BackendParams = [("provider".to_string(), provider.to_string())].into();
    if provider != "shm" {
        // Otherwise a peer on this host is reached through an `shm` plane.
        params.insert("local_provider".to_string(), "none".to_string());
    }
    params.extend(extra.iter().cloned());
    params
}

fn main() {
    tools::cli::init_tracing();
    let cli: Cli = tools::cli::parse_or_exit(PROGRAM);
    // A process in a role pins itself before it starts any thread (they inherit it).
    if let Some(cpus) = &cli.cpus {
        if let Err(e) = parse_cpus(cpus).and_then(|c| pin_to(&c)) {
            tools::cli::fail(PROGRAM, e);
        }
    }
    if cli.block == 0 || cli.block > 64 << 20 {
        tools::cli::Stop::Usage(format!("--block {} must be 1 byte to 64 MiB", cli.block))
            .exit(PROGRAM);
    }
    // Every process of the run (harness, target, attackers: they inherit it) uses one
    // bounce buffer size: with it set in the target alone, the initiator's first WRITE
    // never completed. Set before libfabric is first used, while this process has one
    // thread.
    if cli.role.is_none() && cli.rxm_buffer_size > 0 && std::env::var_os(RXM_BUFFER_SIZE).is_none()
    {
        std::env::set_var(RXM_BUFFER_SIZE, cli.rxm_buffer_size.to_string());
    }
    if cli.role.as_deref() == Some("target") {
        let args = target::TargetArgs {
            provider: cli.provider.first().cloned().unwrap_or_default(),
            params: backend_params(
                cli.provider.first().map_or("", String::as_str),
                &cli.backend_param,
            ),
            block: cli.block,
            slots: SLOTS,
            nonce: cli.nonce.clone().unwrap_or_default(),
        };
        if let Err(e) = target::run(&args) {
            tools::cli::fail(PROGRAM, e);
        }
        return;
    }
    if cli.role.as_deref() == Some("notifier") {
        let provider = cli.provider.first().cloned().unwrap_or_default();
        let rail = cli.rail.as_deref().and_then(from_hex).unwrap_or_default();
        let forged = if cli.control_frames {
            attack::forged_control_frames(&provider, &rail, cli.notifications)
        } else {
            attack::forged_notifications(&provider, &rail, cli.notifications)
        };
        match forged {
            Ok(r) => println!("ATTACK_NOTIFIER sent={} failed={}", r.done, r.failed),
            Err(e) => tools::cli::fail(PROGRAM, e),
        }
        return;
    }
    if cli.role.as_deref() == Some("connector") {
        raise_fd_limit();
        let Some(listen) = cli.listen else {
            tools::cli::fail(PROGRAM, "--role connector needs --listen");
        };
        let r = attack::connections(listen, cli.connections, Duration::from_secs(2));
        println!("ATTACK_CONNECTOR sent={} failed={}", r.done, r.failed);
        return;
    }
    raise_fd_limit();
    let mut rows = Vec::new();
    let mut broken = Vec::new();
    for provider in &cli.provider {
        match run_provider(&cli, provider, &mut rows) {
            Ok(mut problems) => broken.append(&mut problems),
            Err(e) => broken.push(format!("{provider}: {e}")),
        }
    }
    print_table(&rows);
    let missed: Vec<String> = rows.iter().flat_map(Row::missed_goals).collect();
    for m in &missed {
        eprintln!("{PROGRAM}: goal missed: {m}");
    }
    for b in &broken {
        eprintln!("{PROGRAM}: FAILED: {b}");
    }
    if !broken.is_empty() || (cli.strict && !missed.is_empty()) {
        std::process::exit(tools::cli::FAILURE_EXIT);
    }
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(text: &str) -> Option<Vec<u8>> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Forged notifications from a process of their own (`--role notifier`): an attacker
/// shares no process with the peers (`shm` names a sender by its process's slot).
fn notifier_process(
    provider: &str,
    rail: &[u8],
    total: u64,
    control_frames: bool,
    cpus: Option<&str>,
) -> Result<AttackReport, String> {
    let total = total.to_string();
    let rail = to_hex(rail);
    let mut args = vec![
        "--role",
        "notifier",
        "--provider",
        provider,
        "--rail",
        &rail,
        "--notifications",
        &total,
    ];
    if control_frames {
        args.push("--control-frames");
    }
    attacker_process(&args, cpus, "ATTACK_NOTIFIER ")
}

/// Hostile connections from a process of their own (`--role connector`): thousands of
/// sockets opened and closed in the initiator's own process would compete with its
/// threads (its heartbeat watcher included) inside that process, which no remote
/// attacker can do.
fn connector_process(
    listen: SocketAddr,
    total: usize,
    cpus: Option<&str>,
) -> Result<AttackReport, String> {
    let (listen, total) = (listen.to_string(), total.to_string());
    attacker_process(
        &[
            "--role",
            "connector",
            "--listen",
            &listen,
            "--connections",
            &total,
        ],
        cpus,
        "ATTACK_CONNECTOR ",
    )
}

/// Runs this program in an attacker's role (pinned to `cpus`, if given) and reads its
/// closing line (`prefix`).
fn attacker_process(
    args: &[&str],
    cpus: Option<&str>,
    prefix: &str,
) -> Result<AttackReport, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let out = Command::new(exe)
        .args(args)
        .args(cpus.map(|c| format!("--cpus={c}")))
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("starting an attacker: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with(prefix))
        .ok_or_else(|| format!("the attacker {}: {}", out.status, text.trim()))?;
    let field = |k: &str| {
        line.split(' ')
            .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok(AttackReport {
        done: field("sent"),
        failed: field("failed"),
    })
}

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit (the held connections).
fn raise_fd_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the one struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                eprintln!("{PROGRAM}: could not raise the open-file limit");
            }
        }
    }
}

/// One line of the table.
#[derive(Debug, Clone)]
struct Row {
    provider: String,
    phase: &'static str,
    rounds: u64,
    transfers: u64,
    xfer_p50: Duration,
    xfer_p99: Duration,
    round_p99: Duration,
    /// p99 over the quiet baseline's, for transfers and rounds (`None` for the baseline).
    ratios: Option<(f64, f64)>,
    rss_growth: Option<u64>,
    /// Peak growth of the target's heap: bytes in use, bytes taken from the system.
    heap_growth: Option<(u64, u64)>,
    probes_ok: u64,
    probes_failed: u64,
    attack: String,
}

impl Row {
    fn missed_goals(&self) -> Vec<String> {
        let mut out = Vec::new();
        let what = format!("{} {}", self.provider, self.phase);
        if let Some((x, r)) = self.ratios {
            if x > P99_GOAL_RATIO || r > P99_GOAL_RATIO {
                out.push(format!(
                    "{what}: p99 {x:.2}x (transfer), {r:.2}x (round) of the quiet baseline \
                     (goal: within {P99_GOAL_RATIO}x)"
                ));
            }
        }
        if let Some(g) = self.rss_growth.filter(|g| *g >= RSS_GOAL_BYTES) {
            out.push(format!(
                "{what}: target RSS grew {} MiB (goal: under 64 MiB)",
                g >> 20
            ));
        }
        if self.probes_failed > 0 {
            out.push(format!(
                "{what}: {} of {} metadata fetches unanswered",
                self.probes_failed,
                self.probes_ok + self.probes_failed
            ));
        }
        out
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<12} {:<13} {:>7} {:>9} {:>10} {:>10} {:>11} {:>13} {:>10} {:>12} {:>8}  attack",
        "provider",
        "phase",
        "rounds",
        "transfers",
        "p50 us",
        "p99 us",
        "round p99",
        "p99 vs quiet",
        "RSS +MiB",
        "heap +MiB",
        "probes"
    );
    for r in rows {
        println!(
            "{:<12} {:<13} {:>7} {:>9} {:>10} {:>10} {:>11} {:>13} {:>10} {:>12} {:>8}  {}",
            r.provider,
            r.phase,
            r.rounds,
            r.transfers,
            us(r.xfer_p50),
            us(r.xfer_p99),
            us(r.round_p99),
            r.ratios
                .map_or("-".to_string(), |(x, rd)| format!("{x:.2}/{rd:.2}")),
            r.rss_growth
                .map_or("-".to_string(), |g| format!("{:.1}", mib(g))),
            // Live heap / heap kept (in use or free in the allocator).
            r.heap_growth
                .map_or("-".to_string(), |(used, kept)| format!(
                    "{:.1}/{:.1}",
                    mib(used),
                    mib(kept)
                )),
            format!("{}/{}", r.probes_ok, r.probes_ok + r.probes_failed),
            r.attack
        );
    }
    // One machine-readable line per row (tests and scripts read these).
    for r in rows {
        println!(
            "RESULT provider={} phase={} rounds={} transfers={} xfer_p50_us={} xfer_p99_us={} \
             round_p99_us={} rss_growth_bytes={} heap_in_use_growth_bytes={} \
             heap_system_growth_bytes={} probes_ok={} probes_failed={}",
            r.provider,
            r.phase,
            r.rounds,
            r.transfers,
            us(r.xfer_p50),
            us(r.xfer_p99),
            us(r.round_p99),
            r.rss_growth.map_or(-1, |g| g as i64),
            r.heap_growth.map_or(-1, |(used, _)| used as i64),
            r.heap_growth.map_or(-1, |(_, kept)| kept as i64),
            r.probes_ok,
            r.probes_failed
        );
    }
}

/// The target's heap counters at a mark (bytes).
#[derive(Debug, Clone, Copy)]
struct HeapMark {
    in_use: u64,
    peak_in_use: u64,
    system: u64,
    peak_system: u64,
}

/// The target process and what it printed.
struct TargetProc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
    listen: SocketAddr,
    base: u64,
}

impl TargetProc {
    fn start(cli: &Cli, provider: &str, nonce: &str) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
        let mut command = Command::new(exe);
        command
            .args(["--role", "target", "--provider", provider, "--nonce", nonce])
            .arg("--block")
            .arg(cli.block.to_string())
            .args(cli.target_cpus.as_ref().map(|c| format!("--cpus={c}")));
        for (k, v) in &cli.backend_param {
            command.arg(format!("--backend_param={k}={v}"));
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting the target: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().ok_or("the target's stdout")?;
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut proc = Self {
            child,
            stdin,
            lines,
            listen: "0.0.0.0:0".parse().map_err(|e| format!("{e}"))?,
            base: 0,
        };
        let line = proc.line("ATTACK_TARGET ", Duration::from_secs(60))?;
        let mut f = line.split(' ').skip(1);
        let bad = || format!("unexpected target line `{line}`");
        proc.listen = f.next().and_then(|a| a.parse().ok()).ok_or_else(bad)?;
        proc.base = f.next().and_then(|a| a.parse().ok()).ok_or_else(bad)?;
        Ok(proc)
    }

    /// The next line starting with `prefix`.
    fn line(&mut self, prefix: &str, timeout: Duration) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return Ok(l),
                Ok(_) => {}
                Err(_) => {
                    return Err(format!(
                        "no `{}` line from the target within {timeout:?} ({})",
                        prefix.trim(),
                        self.state()
                    ))
                }
            }
        }
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn state(&mut self) -> String {
        match self.child.try_wait() {
            Ok(None) => "running".into(),
            Ok(Some(status)) => format!("exited: {status}"),
            Err(e) => format!("unknown: {e}"),
        }
    }

    /// The target's heap counters (see `target.rs`): now, and their peaks since the
    /// previous call; `None` where the allocator does not tell or the target did not
    /// answer.
    fn heap_mark(&mut self, phase: &str) -> Option<HeapMark> {
        writeln!(self.stdin.as_mut()?, "mark {phase}").ok()?;
        self.stdin.as_mut()?.flush().ok()?;
        let line = self
            .line("ATTACK_TARGET_HEAP ", Duration::from_secs(10))
            .ok()?;
        let field = |k: &str| -> Option<u64> {
            line.split(' ')
                .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))?
                .parse()
                .ok()
        };
        Some(HeapMark {
            in_use: field("in_use")?,
            peak_in_use: field("peak_in_use")?,
            system: field("system")?,
            peak_system: field("peak_system")?,
        })
    }

    /// Resident memory of the target, in bytes.
    fn rss(&self) -> Option<u64> {
        rss_of(self.child.id())
    }

    /// Closes its standard input and returns its closing statistics.
    fn stop(mut self) -> Result<String, String> {
        drop(self.stdin.take());
        let stats = self.line("ATTACK_TARGET_STATS ", Duration::from_secs(30));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => break,
                Ok(Some(status)) => return Err(format!("the target {status}")),
                Ok(None) if Instant::now() > deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err("the target did not exit within 30 s of being told".into());
                }
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        stats
    }
}

impl Drop for TargetProc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn rss_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// A random nonce for the legitimate notifications of this run.
fn fresh_nonce() -> String {
    let mut bytes = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut bytes);
    }
    let seed = u64::from_le_bytes(bytes) ^ u64::from(std::process::id());
    format!("{:016x}", wire::Rng(seed).next())
}

/// The legitimate initiator: registered source and destination slots and one WRITE and
/// one READ request per slot, reposted round after round.
struct Initiator {
    agent: Agent,
    src: Vec<u8>,
    dst: Vec<u8>,
    block: usize,
    writes: Vec<XferReq>,
    reads: Vec<XferReq>,
    _registration: nixl::RegistrationHandle,
    nonce: String,
    seq: u64,
    answered: HashSet<u64>,
    /// Transfer latencies (post to done) and round latencies (WRITE posted to answer).
    xfer: Vec<Duration>,
    rounds: Vec<Duration>,
}

impl Initiator {
    fn start(
        provider: &str,
        params: &BackendParams,
        target: &TargetProc,
        block: usize,
        nonce: &str,
    ) -> Result<Self, String> {
        let agent = Agent::new(INITIATOR, AgentConfig::default()).map_err(|e| e.to_string())?;
        agent
            .create_backend("LIBFABRIC", params)
            .map_err(|e| format!("LIBFABRIC provider {provider}: {e}"))?;
        let mut src = vec![0u8; block * SLOTS];
        let mut dst = vec![0u8; block * SLOTS];
        let (src_base, dst_base) = (src.as_mut_ptr() as u64, dst.as_mut_ptr() as u64);
        let list = DescList::from_descs(
            MemKind::Dram,
            [
                Desc::new(src_base, (block * SLOTS) as u64, 0),
                Desc::new(dst_base, (block * SLOTS) as u64, 0),
            ],
        );
        // SAFETY: `src` and `dst` live in the returned value with the registration and
        // are never moved (a Vec's heap buffer stays put); the registration is dropped
        // with the requests that use it, before them (field order).
        let registration = unsafe { agent.register_mem(&list, None) }.map_err(|e| e.to_string())?;
        agent
            .fetch_remote_metadata(target.listen)
            .map_err(|e| format!("fetching the target's metadata: {e}"))?;
        agent
            .send_local_metadata(target.listen)
            .map_err(|e| format!("sending metadata to the target: {e}"))?;
        let one = |base: u64, slot: usize| {
            DescList::from_descs(
                MemKind::Dram,
                [Desc::new(base + (slot * block) as u64, block as u64, 0)],
            )
        };
        let mut writes = Vec::with_capacity(SLOTS);
        let mut reads = Vec::with_capacity(SLOTS);
        for slot in 0..SLOTS {
            let remote = one(target.base, slot);
            writes.push(
                agent
                    .create_xfer_req(
                        XferOp::Write,
                        &one(src_base, slot),
                        &remote,
                        target::TARGET,
                        None,
                    )
                    .map_err(|e| format!("WRITE request: {e}"))?,
            );
            reads.push(
                agent
                    .create_xfer_req(
                        XferOp::Read,
                        &one(dst_base, slot),
                        &remote,
                        target::TARGET,
                        None,
                    )
                    .map_err(|e| format!("READ request: {e}"))?,
            );
        }
        Ok(Self {
            agent,
            src,
            dst,
            block,
            writes,
            reads,
            _registration: registration,
            nonce: nonce.to_string(),
            seq: 0,
            answered: HashSet::new(),
            xfer: Vec::new(),
            rounds: Vec::new(),
        })
    }

    /// One round: WRITE a fresh pattern with a notification, wait for the target's
    /// answer, READ the slot back and check it.
    fn round(&mut self) -> Result<(), String> {
        self.seq += 1;
        let seq = self.seq;
        let slot = (seq as usize) % SLOTS;
        let range = slot * self.block..(slot + 1) * self.block;
        pattern(seq, &mut self.src[range.clone()]);
        let notif = format!("w {seq} {slot} {}", self.nonce).into_bytes();
        let start = Instant::now();
        run_xfer(&mut self.writes[slot], Some(notif)).map_err(|e| format!("WRITE {seq}: {e}"))?;
        self.xfer.push(start.elapsed());
        while !self.answered.remove(&seq) {
            let left = ROUND_TIMEOUT.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(format!(
                    "no answer of the target to round {seq} within {ROUND_TIMEOUT:?}"
                ));
            }
            for (sender, messages) in self.agent.wait_notifs(left) {
                for m in messages {
                    let text = String::from_utf8_lossy(&m).into_owned();
                    match text.split_once(' ') {
                        Some(("ok", n)) if sender == target::TARGET => {
                            if let Ok(n) = n.parse() {
                                self.answered.insert(n);
                            }
                        }
                        _ => {
                            return Err(format!(
                                "round {seq}: `{sender}` answered `{text}` (the target found \
                                 other bytes than written)"
                            ))
                        }
                    }
                }
            }
        }
        self.rounds.push(start.elapsed());
        let start = Instant::now();
        run_xfer(&mut self.reads[slot], None).map_err(|e| format!("READ {seq}: {e}"))?;
        self.xfer.push(start.elapsed());
        if !holds_pattern(seq, &self.dst[range]) {
            return Err(format!("READ {seq}: other bytes than written"));
        }
        Ok(())
    }

    fn take_samples(&mut self) -> (Vec<Duration>, Vec<Duration>) {
        (
            std::mem::take(&mut self.xfer),
            std::mem::take(&mut self.rounds),
        )
    }
}

fn run_xfer(req: &mut XferReq, notif: Option<Vec<u8>>) -> Result<(), String> {
    let status = req
        .post_with(notif, &Default::default())
        .map_err(|e| e.to_string())?;
    if status != nixl::XferStatus::Done {
        req.wait(ROUND_TIMEOUT).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

/// Peak RSS of a process while it is sampled (every 10 ms).
struct RssSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(rss_of(pid).unwrap_or(0)));
        let thread = {
            let (stop, peak) = (stop.clone(), peak.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(r) = rss_of(pid) {
                        peak.fetch_max(r, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        Self {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

/// Fetches the target's metadata from 127.0.0.1 every 200 ms until stopped: (answered,
/// unanswered).
struct Prober {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<(u64, u64)>>,
}

impl Prober {
    fn start(to: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut ok, mut failed) = (0, 0);
                while !stop.load(Ordering::Relaxed) {
                    match attack::probe(to, Duration::from_secs(5)) {
                        Ok(_) => ok += 1,
                        Err(e) => {
                            failed += 1;
                            if failed <= 3 {
                                eprintln!("{PROGRAM}: listener probe: {e}");
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                (ok, failed)
            })
        };
        Self {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or((0, 1))
    }
}

/// What one attacker of a phase reported, by its name.
type AttackOutcome = (&'static str, Result<AttackReport, String>);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Connections,
    Junk,
    Notifications,
    All,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Connections => "connections",
            Phase::Junk => "junk",
            Phase::Notifications => "notifications",
            Phase::All => "all",
        }
    }
}

/// Runs one provider's baseline and attacks; returns what broke (the legitimate data,
/// the target).
fn run_provider(cli: &Cli, provider: &str, rows: &mut Vec<Row>) -> Result<Vec<String>, String> {
    let nonce = fresh_nonce();
    let mut target = TargetProc::start(cli, provider, &nonce)?;
    let params = backend_params(provider, &cli.backend_param);
    let mut init = Initiator::start(provider, &params, &target, cli.block, &nonce)?;
    let blob = wire::fetch_metadata(target.listen, Duration::from_secs(10))?;
    let rail = wire::libfabric_rails(&blob)?
        .into_iter()
        .next()
        .ok_or("the target advertises no rail")?;
    let mut broken = Vec::new();

    // Warm-up, then the quiet baseline.
    for _ in 0..cli.baseline.min(100) {
        init.round()?;
    }
    init.take_samples();
    for _ in 0..cli.baseline {
        init.round()?;
    }
    let rss_base = target.rss().ok_or("the target's RSS")?;
    let heap_base = target.heap_mark("quiet");
    let (mut xfer, mut round) = init.take_samples();
    xfer.sort();
    round.sort();
    let quiet = (percentile(&xfer, 0.99), percentile(&round, 0.99));
    rows.push(Row {
        provider: provider.to_string(),
        phase: "quiet",
        rounds: round.len() as u64,
        transfers: xfer.len() as u64,
        xfer_p50: percentile(&xfer, 0.5),
        xfer_p99: quiet.0,
        round_p99: quiet.1,
        ratios: None,
        rss_growth: None,
        heap_growth: None,
        probes_ok: 0,
        probes_failed: 0,
        attack: format!("target RSS {} MiB", rss_base >> 20),
    });

    for phase in [
        Phase::Connections,
        Phase::Junk,
        Phase::Notifications,
        Phase::All,
    ] {
        if !cli.phases.iter().any(|p| p == phase.name()) {
            continue;
        }
        let sampler = RssSampler::start(target.child.id());
        let prober = Prober::start(target.listen);
        let reports: Arc<Mutex<Vec<AttackOutcome>>> = Arc::default();
        let mut attackers = Vec::new();
        let (listen, total_conns, junk) = (target.listen, cli.connections, cli.junk);
        let attacker_cpus = cli.attacker_cpus.clone();
        if matches!(phase, Phase::Connections | Phase::All) {
            let reports = reports.clone();
            let cpus = attacker_cpus.clone();
            attackers.push(std::thread::spawn(move || {
                let r = connector_process(listen, total_conns, cpus.as_deref());
                reports.lock().push(("connections", r));
            }));
        }
        if matches!(phase, Phase::Junk | Phase::All) {
            let reports = reports.clone();
            attackers.push(std::thread::spawn(move || {
                let cpus = attacker_cpus
                    .as_deref()
                    .map(parse_cpus)
                    .and_then(Result::ok);
                let r = attack::junk(listen, junk, cpus);
                reports.lock().push(("junk", Ok(r)));
            }));
        }
        if matches!(phase, Phase::Notifications | Phase::All) {
            let reports = reports.clone();
            let (provider, rail, total) = (provider.to_string(), rail.clone(), cli.notifications);
            let cpus = cli.attacker_cpus.clone();
            let control_frames = cli.control_frames;
            attackers.push(std::thread::spawn(move || {
                let r = notifier_process(&provider, &rail, total, control_frames, cpus.as_deref());
                reports.lock().push(("notifications", r));
            }));
        }
        let started = Instant::now();
        let mut rounds = 0u64;
        let mut error = None;
        while attackers.iter().any(|a| !a.is_finished()) || rounds < cli.min_rounds {
            if let Err(e) = init.round() {
                error = Some(e);
                break;
            }
            rounds += 1;
        }
        for a in attackers {
            let _ = a.join();
        }
        let elapsed = started.elapsed();
        let probes = prober.finish();
        let peak = sampler.finish();
        let alive = target.alive();
        let heap_growth = heap_base
            .zip(target.heap_mark(phase.name()))
            .map(|(base, now)| {
                (
                    now.peak_in_use.saturating_sub(base.in_use),
                    now.peak_system.saturating_sub(base.system),
                )
            });
        let (mut xfer, mut round) = init.take_samples();
        xfer.sort();
        round.sort();
        let (x99, r99) = (percentile(&xfer, 0.99), percentile(&round, 0.99));
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
        let attack = reports
            .lock()
            .iter()
            .map(|(what, r)| match r {
                Ok(r) => format!("{what}: {} sent, {} failed", r.done, r.failed),
                Err(e) => format!("{what}: {e}"),
            })
            .collect::<Vec<_>>()
            .join("; ");
        for (what, r) in reports.lock().iter() {
            if let Err(e) = r {
                broken.push(format!("{provider} {}: attacker {what}: {e}", phase.name()));
            }
        }
        rows.push(Row {
            provider: provider.to_string(),
            phase: phase.name(),
            rounds: round.len() as u64,
            transfers: xfer.len() as u64,
            xfer_p50: percentile(&xfer, 0.5),
            xfer_p99: x99,
            round_p99: r99,
            ratios: Some((ratio(x99, quiet.0), ratio(r99, quiet.1))),
            rss_growth: Some(peak.saturating_sub(rss_base)),
            heap_growth,
            probes_ok: probes.0,
            probes_failed: probes.1,
            attack: format!("{attack} ({:.1} s)", elapsed.as_secs_f64()),
        });
        if let Some(e) = error {
            broken.push(format!(
                "{provider} {}: legitimate traffic: {e}",
                phase.name()
            ));
            break;
        }
        if !alive {
            broken.push(format!(
                "{provider} {}: the target died ({})",
                phase.name(),
                target.state()
            ));
            break;
        }
    }
    let verified_rounds = init.seq - init.answered.len() as u64;
    drop(init);
    match target.stop() {
        Ok(stats) => {
            println!("{provider}: {stats}");
            let field = |k: &str| {
                stats
                    .split(' ')
                    .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(u64::MAX)
            };
            if field("bad") != 0 {
                broken.push(format!("{provider}: the target found bad data ({stats})"));
            }
            if field("forged_as_initiator") != 0 {
                broken.push(format!(
                    "{provider}: forged notifications reached the target under the \
                     initiator's name ({stats})"
                ));
            }
            if field("verified") < verified_rounds.saturating_sub(1) {
                broken.push(format!(
                    "{provider}: the target verified fewer rounds than the initiator saw \
                     answered ({stats}, {verified_rounds} rounds)"
                ));
            }
        }
        Err(e) => broken.push(format!("{provider}: {e}")),
    }
    std::io::stdout().flush().ok();
    Ok(broken)
}
