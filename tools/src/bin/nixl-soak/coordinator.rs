//! The coordinator: starts the workers, keeps the directory of who is up, injects the
//! faults, samples `/proc`, prints the table and the summary, and decides.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};
use tools::soak::{
    agent_name, growth, parse_duration, unix_ms, Counters, FromWorker, HeapSample, MetadataPath,
    ProcSample, Rng, Slack, ToWorker, WorkerConfig,
};
use tools::units::{human_bytes, parse_size_usize};

/// The run's options (the coordinator's command line).
#[derive(clap::Args, Debug, Clone)]
pub struct Options {
    /// Agents, each in its own process.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(2..=1024))]
    agents: u64,
    /// How long faults are injected and transfers run (`90s`, `5m`, `30m`).
    #[arg(long, default_value = "3m", value_parser = parse_duration)]
    duration: Duration,
    /// How agents find each other's metadata.
    #[arg(long, value_enum, default_value_t = MetadataPath::P2p)]
    metadata: MetadataPath,
    /// LIBFABRIC provider (`tcp;ofi_rxm`, `tcp`, `sockets`, `shm`). Same-host peers go
    /// over it (`local_provider=none`) unless it is `shm`.
    #[arg(long, default_value = "tcp;ofi_rxm")]
    provider: String,
    /// More LIBFABRIC parameters, `KEY=VALUE` (repeat); they replace the soak's
    /// defaults `heartbeat_ms=500` and `heartbeat_misses=10` (5 s: with 32 processes on
    /// two cores a heartbeat thread can go unscheduled for longer than the library's
    /// 0.5 s, and a live peer would be declared dead; deaths on one host are seen by the
    /// OS at once anyway).
    #[arg(long = "backend-param", value_name = "KEY=VALUE")]
    backend_params: Vec<String>,
    /// Whether the backends progress on threads of their own (`false`: the workers'
    /// polls progress them; fewer threads per agent).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    progress_thread: bool,
    /// Smallest transfer.
    #[arg(long, default_value = "4K", value_parser = parse_size_usize)]
    min_size: usize,
    /// Largest transfer.
    #[arg(long, default_value = "256K", value_parser = parse_size_usize)]
    max_size: usize,
    /// Transfers each agent starts per second (at most).
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Mean time between faults (exponentially distributed).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    fault_every: Duration,
    /// Share of faults that are crashes (SIGKILL); the others are clean leaves.
    #[arg(long, default_value_t = 0.5)]
    crash_ratio: f64,
    /// Agents (the first ones) that are never faulted: their resource counts are checked.
    #[arg(long, default_value_t = 4)]
    long_lived: usize,
    /// Most agents down at once (default: a quarter).
    #[arg(long)]
    max_down: Option<usize>,
    /// How long a faulted agent stays down before it starts again, at most (uniform
    /// from a tenth of it).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    down_time: Duration,
    /// Time with every agent up and no fault before the faults start: every agent
    /// reaches every other once; the long-lived agents' resource baseline is taken in
    /// its last seconds.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    warmup: Duration,
    /// Time after the faults (every agent up again, every agent reaching every other
    /// once more); the final resource samples, compared with the baseline, are taken in
    /// its last seconds.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    settle: Duration,
    /// A transfer or notification waiting this much beyond its expected completion
    /// fails the run (it is also each agent's stall timeout).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    stall_bound: Duration,
    /// Bound on each metadata request of an agent (a fetch from a peer's listener, every
    /// etcd request: publication, lease, fetch). A request past it is an error no fault
    /// explains; on a machine loaded far beyond its cores, etcd itself can take longer.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    metadata_timeout: Duration,
    /// Interval of the progress table.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    report_every: Duration,
    /// File descriptors a long-lived agent may gain after the warm-up.
    #[arg(long, default_value_t = 8)]
    slack_fds: u64,
    /// Threads a long-lived agent may gain after the warm-up.
    #[arg(long, default_value_t = 2)]
    slack_threads: u64,
    /// Resident MiB a long-lived agent may gain after the warm-up (loose: the allocator
    /// keeps freed memory and fragments, which is not a leak).
    #[arg(long, default_value_t = 32)]
    slack_rss_mib: u64,
    /// MiB of live heap (allocated and not freed, as the worker's allocator reports it)
    /// a long-lived agent may gain after the warm-up: the leak check.
    #[arg(long, default_value_t = 4)]
    slack_heap_mib: u64,
    /// Workers give the allocator's free memory back to the OS (`malloc_trim(0)`) before
    /// each report, so that RSS follows the live heap (to tell a leak from allocator
    /// growth; `MALLOC_ARENA_MAX` in the environment reaches the workers too).
    #[arg(long)]
    malloc_trim: bool,
    /// etcd endpoints (comma-separated); without them a run that uses etcd starts one
    /// (`--etcd-bin`) in its folder.
    #[arg(long)]
    etcd_endpoints: Option<String>,
    /// The etcd binary started when no endpoint is given (Debian: etcd-server).
    #[arg(long, default_value = "etcd")]
    etcd_bin: String,
    /// Seed of every random choice (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Where workers' logs go (default: a temporary folder, removed after a run that
    /// passed).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Writes the summary here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Events from the workers' standard output readers.
enum Event {
    Msg(FromWorker),
    Eof,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Started, not yet ready.
    Starting,
    Up,
    /// Asked to leave at that time.
    Leaving(Instant),
    /// SIGKILLed, not yet reaped.
    Killed,
    /// Not running; starts again at that time (`None`: not again).
    Down(Option<Instant>),
}

struct Slot {
    index: usize,
    incarnation: u64,
    state: State,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    pid: u32,
    listen: Option<String>,
    started: Instant,
    last_sample: Option<ProcSample>,
    /// The worker's last report of its allocator.
    heap: Option<HeapSample>,
    /// Samples of a long-lived agent: seconds since the run started.
    history: Vec<(f64, ProcSample)>,
}

impl Slot {
    fn send(&mut self, msg: &ToWorker) {
        let Some(stdin) = self.stdin.as_mut() else {
            return;
        };
        let line = serde_json::to_string(msg).expect("messages serialize");
        // A worker that died cannot read; its exit is handled where it is reaped.
        let _ = writeln!(stdin, "{line}").and_then(|_| stdin.flush());
    }

    fn is_running(&self) -> bool {
        !matches!(self.state, State::Down(_))
    }

    fn log_path(&self, dir: &Path) -> PathBuf {
        dir.join(format!(
            "{}.{}.log",
            agent_name(self.index),
            self.incarnation
        ))
    }
}

struct Run {
    options: Options,
    dir: PathBuf,
    etcd_endpoints: Vec<String>,
    etcd_namespace: String,
    backend_params: BTreeMap<String, String>,
    slots: Vec<Slot>,
    events: Receiver<(usize, u64, Event)>,
    events_tx: Sender<(usize, u64, Event)>,
    rng: Rng,
    seed: u64,
    start: Instant,
    totals: Counters,
    crashes: u64,
    leaves: u64,
    restarts: u64,
    problems: Vec<String>,
    /// Most resources of any agent that was faulted (they restart: no growth check).
    others_max: ProcSample,
    /// The windows (seconds since the start) of the baseline and final samples.
    baseline_window: (f64, f64),
    final_window: (f64, f64),
    next_sample: Instant,
    next_row: Instant,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// An etcd started for the run; killed on drop.
struct OwnEtcd(Child);

impl Drop for OwnEtcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_etcd(bin: &str, dir: &Path) -> Result<(OwnEtcd, String), String> {
    let (client, peer) = (
        free_port().map_err(|e| e.to_string())?,
        free_port().map_err(|e| e.to_string())?,
    );
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let log = std::fs::File::create(dir.join("etcd.log")).map_err(|e| e.to_string())?;
    let child = Command::new(bin)
        .args(["--name", "soak", "--data-dir"])
        .arg(dir.join("etcd-data"))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("soak={peer_url}")])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| {
            format!("cannot run `{bin}` ({e}): install etcd (Debian: etcd-server), pass --etcd-bin or --etcd-endpoints")
        })?;
    let mut etcd = OwnEtcd(child);
    let addr: SocketAddr = format!("127.0.0.1:{client}").parse().expect("an address");
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if let Ok(Some(status)) = etcd.0.try_wait() {
            return Err(format!(
                "etcd exited ({status}) before listening; see {}",
                dir.join("etcd.log").display()
            ));
        }
        if Instant::now() > deadline {
            return Err("etcd did not listen within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((etcd, client_url))
}

/// The run: `Ok(true)` when every check passed.
pub fn main(options: Options) -> ExitCode {
    match run(options) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => tools::cli::fail("nixl-soak", e),
    }
}

fn run(options: Options) -> Result<bool, String> {
    if options.min_size == 0 || options.min_size > options.max_size {
        return Err("--min-size must be at least 1 and at most --max-size".into());
    }
    if options.long_lived >= options.agents as usize {
        return Err("--long-lived must leave at least one agent to fault".into());
    }
    let mut backend_params = BTreeMap::from([("provider".to_string(), options.provider.clone())]);
    if options.provider != "shm" {
        backend_params.insert("local_provider".into(), "none".into());
    }
    backend_params.insert("heartbeat_ms".into(), "500".into());
    backend_params.insert("heartbeat_misses".into(), "10".into());
    for kv in &options.backend_params {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("--backend-param `{kv}`: expected KEY=VALUE"))?;
        backend_params.insert(k.to_string(), v.to_string());
    }
    let (dir, temporary) = match &options.run_dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("nixl-soak-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let seed = options.seed.unwrap_or_else(unix_ms);
    let mut own_etcd = None;
    let etcd_endpoints = if options.metadata.uses_etcd() {
        match &options.etcd_endpoints {
            Some(list) => list.split(',').map(|s| s.trim().to_string()).collect(),
            None => {
                let (etcd, url) = start_etcd(&options.etcd_bin, &dir)?;
                own_etcd = Some(etcd);
                vec![url]
            }
        }
    } else {
        Vec::new()
    };
    let (events_tx, events) = mpsc::channel();
    let agents = options.agents as usize;
    let mut run = Run {
        etcd_namespace: format!("/nixl-soak/{}-{seed}", std::process::id()),
        etcd_endpoints,
        backend_params,
        slots: (0..agents)
            .map(|index| Slot {
                index,
                incarnation: 0,
                state: State::Down(None),
                child: None,
                stdin: None,
                pid: 0,
                listen: None,
                started: Instant::now(),
                last_sample: None,
                heap: None,
                history: Vec::new(),
            })
            .collect(),
        events,
        events_tx,
        rng: Rng::new(seed),
        seed,
        start: Instant::now(),
        totals: Counters::default(),
        crashes: 0,
        leaves: 0,
        restarts: 0,
        problems: Vec::new(),
        others_max: ProcSample::default(),
        baseline_window: (0.0, 0.0),
        final_window: (0.0, 0.0),
        next_sample: Instant::now(),
        next_row: Instant::now(),
        dir: dir.clone(),
        options,
    };
    println!(
        "nixl-soak: {agents} agents, {:?} of faults, metadata {:?}, LIBFABRIC {:?}, progress thread {}, sizes {}..{}, seed {seed}, logs in {}",
        run.options.duration,
        run.options.metadata,
        run.backend_params,
        run.options.progress_thread,
        human_bytes(run.options.min_size as u64),
        human_bytes(run.options.max_size as u64),
        dir.display()
    );
    let passed = run.go();
    drop(own_etcd);
    if passed && temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(passed)
}

impl Run {
    fn spawn(&mut self, index: usize) -> Result<(), String> {
        let incarnation = self.slots[index].incarnation + 1;
        let config = WorkerConfig {
            index,
            incarnation,
            agents: self.slots.len(),
            seed: self.rng.next_u64(),
            metadata: self.options.metadata,
            etcd_endpoints: self.etcd_endpoints.clone(),
            etcd_namespace: self.etcd_namespace.clone(),
            backend_params: self.backend_params.clone(),
            progress_thread: self.options.progress_thread,
            min_size: self.options.min_size,
            max_size: self.options.max_size,
            rate: self.options.rate,
            stall_bound_ms: self.options.stall_bound.as_millis() as u64,
            metadata_timeout_ms: self.options.metadata_timeout.as_millis() as u64,
            malloc_trim: self.options.malloc_trim,
        };
        let slot = &mut self.slots[index];
        slot.incarnation = incarnation;
        let log = std::fs::File::create(slot.log_path(&self.dir)).map_err(|e| e.to_string())?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .arg("worker")
            .arg("--config")
            .arg(serde_json::to_string(&config).expect("config serializes"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting a worker: {e}"))?;
        let stdout = child.stdout.take().expect("piped");
        let tx = self.events_tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<FromWorker>(&line) {
                    Ok(msg) => {
                        let _ = tx.send((index, incarnation, Event::Msg(msg)));
                    }
                    Err(_) => {
                        let _ = tx.send((
                            index,
                            incarnation,
                            Event::Msg(FromWorker::Problem {
                                what: format!(
                                    "{} wrote a line that is not a message: {line:?}",
                                    agent_name(index)
                                ),
                            }),
                        ));
                    }
                }
            }
            let _ = tx.send((index, incarnation, Event::Eof));
        });
        slot.stdin = child.stdin.take();
        slot.pid = child.id();
        slot.child = Some(child);
        slot.state = State::Starting;
        slot.listen = None;
        slot.started = Instant::now();
        Ok(())
    }

    fn broadcast(&mut self, msg: &ToWorker, except: usize) {
        for slot in &mut self.slots {
            if slot.index != except && slot.is_running() {
                slot.send(msg);
            }
        }
    }

    fn problem(&mut self, what: String) {
        println!("PROBLEM: {what}");
        self.problems.push(what);
    }

    fn log_tail(&self, index: usize) -> String {
        let text =
            std::fs::read_to_string(self.slots[index].log_path(&self.dir)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n    ")
    }

    fn handle(&mut self, index: usize, incarnation: u64, event: Event) {
        if self.slots[index].incarnation != incarnation {
            // A late line of an earlier incarnation: its counters still count.
            if let Event::Msg(FromWorker::Counters(c) | FromWorker::Bye(c)) = &event {
                self.totals.merge(c);
            }
            if let Event::Msg(FromWorker::Problem { what }) = event {
                self.problem(what);
            }
            return;
        }
        match event {
            Event::Msg(FromWorker::Ready { listen }) => {
                let slot = &mut self.slots[index];
                if slot.state != State::Starting {
                    // Asked to leave (or killed) before it was ready: not announced.
                    return;
                }
                slot.state = State::Up;
                slot.listen = listen.clone();
                let up = ToWorker::Up {
                    index,
                    incarnation,
                    listen,
                };
                self.broadcast(&up, index);
                let directory: Vec<ToWorker> = self
                    .slots
                    .iter()
                    .filter(|s| s.index != index && s.state == State::Up)
                    .map(|s| ToWorker::Up {
                        index: s.index,
                        incarnation: s.incarnation,
                        listen: s.listen.clone(),
                    })
                    .collect();
                for msg in &directory {
                    self.slots[index].send(msg);
                }
            }
            Event::Msg(FromWorker::Counters(c)) => self.totals.merge(&c),
            Event::Msg(FromWorker::Bye(c)) => self.totals.merge(&c),
            Event::Msg(FromWorker::Heap(h)) => self.slots[index].heap = Some(h),
            Event::Msg(FromWorker::Problem { what }) => self.problem(what),
            Event::Eof => {}
        }
    }

    /// Reaps workers that exited; an exit nobody asked for is a problem.
    fn reap(&mut self, restart: bool) {
        for index in 0..self.slots.len() {
            let state = self.slots[index].state;
            let Some(child) = self.slots[index].child.as_mut() else {
                continue;
            };
            let Ok(Some(status)) = child.try_wait() else {
                if let State::Leaving(since) = state {
                    if since.elapsed() > Duration::from_secs(30) {
                        let _ = child.kill();
                        self.problem(format!(
                            "{} did not leave within 30 s of being asked: killed",
                            agent_name(index)
                        ));
                    }
                }
                continue;
            };
            let expected = match state {
                State::Killed => true,
                State::Leaving(_) => status.success(),
                _ => false,
            };
            if !expected {
                let tail = self.log_tail(index);
                self.problem(format!(
                    "{} (incarnation {}) exited unexpectedly ({status}); its log ends:\n    {tail}",
                    agent_name(index),
                    self.slots[index].incarnation
                ));
            }
            let down = self.options.down_time;
            let again = restart.then(|| Instant::now() + down.mul_f64(0.1 + 0.9 * self.rng.unit()));
            let slot = &mut self.slots[index];
            slot.child = None;
            slot.stdin = None;
            slot.state = State::Down(again);
            if matches!(state, State::Starting | State::Up) {
                // Announce it, so that survivors' errors about it are explained.
                let msg = ToWorker::Down {
                    index,
                    incarnation: slot.incarnation,
                    at_ms: unix_ms(),
                    how: "exit".into(),
                };
                self.broadcast(&msg, index);
            }
        }
    }

    fn inject_fault(&mut self) {
        let long_lived = self.options.long_lived;
        let max_down = self.options.max_down.unwrap_or(self.slots.len() / 4).max(1);
        let down = self.slots.iter().filter(|s| s.state != State::Up).count();
        if down >= max_down {
            return;
        }
        let candidates: Vec<usize> = self
            .slots
            .iter()
            .filter(|s| s.index >= long_lived && s.state == State::Up)
            .map(|s| s.index)
            .collect();
        if candidates.is_empty() {
            return;
        }
        let index = candidates[self.rng.range(0, candidates.len() as u64 - 1) as usize];
        let crash = self.rng.chance(self.options.crash_ratio);
        let msg = ToWorker::Down {
            index,
            incarnation: self.slots[index].incarnation,
            at_ms: unix_ms(),
            how: if crash { "crash" } else { "leave" }.into(),
        };
        // Announced first: an error a survivor meets after the fault is explained.
        self.broadcast(&msg, index);
        let slot = &mut self.slots[index];
        if crash {
            if let Some(child) = slot.child.as_mut() {
                let _ = child.kill();
            }
            slot.state = State::Killed;
            self.crashes += 1;
        } else {
            slot.send(&ToWorker::Leave);
            slot.state = State::Leaving(Instant::now());
            self.leaves += 1;
        }
    }

    fn sample(&mut self) {
        let t = self.start.elapsed().as_secs_f64();
        let long_lived = self.options.long_lived;
        for slot in &mut self.slots {
            if slot.child.is_none() {
                slot.last_sample = None;
                continue;
            }
            slot.last_sample = ProcSample::of(slot.pid).map(|s| ProcSample {
                heap_kib: slot.heap.map_or(0, |h| h.in_use_kib),
                ..s
            });
            if let Some(s) = slot.last_sample {
                if slot.index < long_lived {
                    slot.history.push((t, s));
                } else {
                    self.others_max = self.others_max.max(s);
                }
            }
        }
    }

    fn print_header(&self) {
        println!(
            "{:>6} {:>3} {:>8} {:>8} {:>8} {:>9} {:>6} {:>6} {:>6} {:>6} {:>8}  long-lived agents fd/threads/RSS MiB/live heap MiB; others' max",
            "t(s)", "up", "writes", "reads", "notifs", "MiB", "crash", "leave", "typed", "unexp", "stall ms"
        );
    }

    fn print_row(&self) {
        let t = &self.totals;
        let up = self.slots.iter().filter(|s| s.state == State::Up).count();
        let fmt = |s: ProcSample| {
            format!(
                "{}/{}/{}/{:.1}",
                s.fds,
                s.threads,
                s.rss_kib / 1024,
                s.heap_kib as f64 / 1024.0
            )
        };
        let long: Vec<String> = self
            .slots
            .iter()
            .take(self.options.long_lived)
            .map(|s| s.last_sample.map_or("-".into(), fmt))
            .collect();
        println!(
            "{:>6.0} {:>3} {:>8} {:>8} {:>8} {:>9.1} {:>6} {:>6} {:>6} {:>6} {:>8}  {}; {}",
            self.start.elapsed().as_secs_f64(),
            up,
            t.writes,
            t.reads,
            t.notifs_verified,
            t.bytes as f64 / (1 << 20) as f64,
            self.crashes,
            self.leaves,
            t.typed_total(),
            t.unexpected_total(),
            t.longest_stall_ms,
            long.join(" "),
            fmt(self.others_max)
        );
    }

    fn pump(&mut self, until: Instant) {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok((index, inc, event)) => self.handle(index, inc, event),
                Err(RecvTimeoutError::Timeout) => return,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn go(&mut self) -> bool {
        for index in 0..self.slots.len() {
            if let Err(e) = self.spawn(index) {
                self.problem(e);
                return self.finish();
            }
        }
        let ready_by = Instant::now() + Duration::from_secs(120);
        while self.slots.iter().any(|s| s.state == State::Starting) {
            if Instant::now() > ready_by {
                self.problem("not every worker was ready within 120 s".into());
                return self.finish();
            }
            self.pump(Instant::now() + Duration::from_millis(100));
            self.reap(false);
            if !self.problems.is_empty() {
                return self.finish();
            }
        }
        println!(
            "all {} agents up after {:.1} s",
            self.slots.len(),
            self.start.elapsed().as_secs_f64()
        );
        self.start = Instant::now();
        self.next_sample = self.start;
        self.next_row = self.start + self.options.report_every;
        self.print_header();
        // Warm-up: everyone up, no fault.
        let warmup_end = self.start + self.options.warmup;
        self.phase(warmup_end, false);
        self.baseline_window = self.sample_window();
        // Faults.
        let faults_end = Instant::now() + self.options.duration;
        self.phase(faults_end, true);
        // Settle: everyone up again, every pair reached again.
        for slot in &mut self.slots {
            if let State::Down(_) = slot.state {
                slot.state = State::Down(Some(Instant::now()));
            }
        }
        let all_up_by = Instant::now() + Duration::from_secs(120);
        while self.slots.iter().any(|s| s.state != State::Up) {
            if Instant::now() > all_up_by {
                self.problem("not every agent was up again within 120 s of the last fault".into());
                break;
            }
            self.tick();
        }
        for slot in &mut self.slots {
            slot.send(&ToWorker::Sweep);
        }
        let settle_end = Instant::now() + self.options.settle;
        self.phase(settle_end, false);
        self.final_window = self.sample_window();
        self.print_row();
        self.finish()
    }

    /// The window of the last samples (the last 5 s, or the last half of a shorter
    /// phase), in seconds since the start.
    fn sample_window(&self) -> (f64, f64) {
        let now = self.start.elapsed().as_secs_f64();
        let len = 5.0f64
            .min(self.options.warmup.as_secs_f64() / 2.0)
            .min(self.options.settle.as_secs_f64() / 2.0);
        (now - len, now)
    }

    /// Runs until `end`, injecting faults if `faults`.
    fn phase(&mut self, end: Instant, faults: bool) {
        let mut next_fault = Instant::now() + self.rng.exponential(self.options.fault_every);
        while Instant::now() < end {
            self.tick();
            if faults && Instant::now() >= next_fault {
                self.inject_fault();
                next_fault = Instant::now() + self.rng.exponential(self.options.fault_every);
            }
        }
    }

    /// Handles events for a while, reaps and restarts workers, samples `/proc` every
    /// second and prints a row every `--report-every`.
    fn tick(&mut self) {
        self.pump(Instant::now() + Duration::from_millis(50));
        self.reap(true);
        let now = Instant::now();
        for index in 0..self.slots.len() {
            if let State::Down(Some(at)) = self.slots[index].state {
                if now >= at {
                    self.restarts += 1;
                    if let Err(e) = self.spawn(index) {
                        self.problem(e);
                    }
                }
            }
        }
        if now >= self.next_sample {
            self.sample();
            self.next_sample = now + Duration::from_secs(1);
        }
        if now >= self.next_row {
            self.print_row();
            self.next_row = now + self.options.report_every;
        }
    }

    /// Asks every worker to leave, waits for them, prints the summary; `true` if passed.
    fn finish(&mut self) -> bool {
        // Everyone leaves: announced first, as every fault is, so that what a worker
        // meets from a peer leaving before it is explained.
        let at_ms = unix_ms();
        let ending: Vec<ToWorker> = self
            .slots
            .iter()
            .filter(|s| s.is_running())
            .map(|s| ToWorker::Down {
                index: s.index,
                incarnation: s.incarnation,
                at_ms,
                how: "end".into(),
            })
            .collect();
        for msg in &ending {
            self.broadcast(msg, usize::MAX);
        }
        for slot in &mut self.slots {
            match slot.state {
                State::Up | State::Starting => {
                    slot.send(&ToWorker::Leave);
                    slot.state = State::Leaving(Instant::now());
                }
                State::Down(_) => slot.state = State::Down(None),
                _ => {}
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.slots.iter().any(|s| s.child.is_some()) && Instant::now() < deadline {
            self.pump(Instant::now() + Duration::from_millis(100));
            self.reap(false);
        }
        for index in 0..self.slots.len() {
            if let Some(child) = self.slots[index].child.as_mut() {
                let _ = child.kill();
                let _ = child.wait();
                self.problem(format!("{} did not exit at the end", agent_name(index)));
            }
        }
        // The readers' last lines (final counters).
        self.pump(Instant::now() + Duration::from_millis(200));
        self.summary()
    }

    fn summary(&mut self) -> bool {
        let o = self.options.clone();
        let t = self.totals.clone();
        let slack = Slack {
            fds: o.slack_fds,
            threads: o.slack_threads,
            rss_kib: o.slack_rss_mib * 1024,
            heap_kib: o.slack_heap_mib * 1024,
        };
        let mut resources = Vec::new();
        let mut growth_problems = Vec::new();
        for slot in self.slots.iter().take(o.long_lived) {
            match growth(
                &slot.history,
                self.baseline_window,
                self.final_window,
                slack,
            ) {
                Some(g) => {
                    resources.push(serde_json::json!({
                        "agent": agent_name(slot.index),
                        "baseline": g.baseline,
                        "last": g.last,
                    }));
                    for b in &g.beyond_slack {
                        growth_problems.push(format!("{}: {b}", agent_name(slot.index)));
                    }
                    println!(
                        "{}: after warm-up fds {} threads {} RSS {} MiB (anon {} file {}) live heap {:.1} MiB; at the end fds {} threads {} RSS {} MiB (anon {} file {}) live heap {:.1} MiB",
                        agent_name(slot.index),
                        g.baseline.fds,
                        g.baseline.threads,
                        g.baseline.rss_kib / 1024,
                        g.baseline.rss_anon_kib / 1024,
                        g.baseline.rss_file_kib / 1024,
                        g.baseline.heap_kib as f64 / 1024.0,
                        g.last.fds,
                        g.last.threads,
                        g.last.rss_kib / 1024,
                        g.last.rss_anon_kib / 1024,
                        g.last.rss_file_kib / 1024,
                        g.last.heap_kib as f64 / 1024.0
                    );
                }
                None => growth_problems.push(format!(
                    "{}: no samples for the growth check",
                    agent_name(slot.index)
                )),
            }
        }
        for p in growth_problems {
            self.problem(format!("growth beyond the slack: {p}"));
        }
        if t.longest_stall_ms > o.stall_bound.as_millis() as u64 {
            self.problem(format!(
                "longest stall {} ms is past the bound {:?}",
                t.longest_stall_ms, o.stall_bound
            ));
        }
        if t.corrupt_bytes > 0 {
            self.problem(format!("{} corrupted bytes", t.corrupt_bytes));
        }
        if t.writes + t.reads == 0 {
            self.problem("no transfer completed".into());
        }
        let passed = self.problems.is_empty();
        println!(
            "summary: {} verified WRITEs, {} verified READs, {} notifications verified, {} acknowledgement READs, {} moved, {} metadata loads",
            t.writes, t.reads, t.notifs_verified, t.ack_reads, human_bytes(t.bytes), t.loads
        );
        println!(
            "faults: {} crashes, {} clean leaves, {} restarts; typed errors {:?}; unexpected {:?}",
            self.crashes, self.leaves, self.restarts, t.typed_errors, t.unexpected
        );
        println!(
            "longest stall {} ms (bound {:?}); longest dead-peer detection {} ms; longest first transfer to a restarted peer {} ms; corrupted bytes {}",
            t.longest_stall_ms, o.stall_bound, t.longest_detection_ms, t.longest_reconnect_ms, t.corrupt_bytes
        );
        println!(
            "faulted agents' largest counts: fds {} threads {} RSS {} MiB",
            self.others_max.fds,
            self.others_max.threads,
            self.others_max.rss_kib / 1024
        );
        println!(
            "{}: {} problem(s)",
            if passed { "PASSED" } else { "FAILED" },
            self.problems.len()
        );
        if let Some(path) = &self.options.json {
            let json = serde_json::json!({
                "passed": passed,
                "seed": self.seed,
                "agents": self.slots.len(),
                "duration_s": o.duration.as_secs_f64(),
                "metadata": o.metadata,
                "provider": o.provider,
                "counters": t,
                "crashes": self.crashes,
                "leaves": self.leaves,
                "restarts": self.restarts,
                "long_lived": resources,
                "others_max": self.others_max,
                "problems": self.problems,
            });
            if let Err(e) = std::fs::write(path, serde_json::to_string_pretty(&json).expect("json"))
            {
                println!("cannot write {}: {e}", path.display());
            }
        }
        passed
    }
}
