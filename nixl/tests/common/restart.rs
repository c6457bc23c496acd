//! What the restart tests (issue 27: `restart_matrix`, `rxe_restart`, `gpu_restart`) share:
//! the faults a peer process meets and how each is injected, the survivor's counts of
//! what a dead incarnation could leave behind, the peer's verdict files, the peer's side
//! of a death right after a WRITE's data landed, and a bystander that keeps moving data
//! to a second peer through a whole row.

use super::{announce, dram, pattern, wait_file, PeerProcess, TIMEOUT};
use nixl::{Agent, Desc, Error, XferOp, XferReq, XferStatus};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// When the peer is killed (SIGKILL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL while WRITEs to it are in flight.
    MidWrite,
    /// SIGKILL while READs from it are in flight.
    MidRead,
    /// SIGKILL while nothing moves; then, at once, a WRITE is posted to it.
    Idle,
    /// The peer SIGKILLs itself the moment the data of a WRITE has landed (the last
    /// word of every block is there), before it takes the WRITE's notification (see
    /// [`die_once_landed`]): the WRITE (or, where the notification was handed over
    /// first, its repost) fails with `RemoteDisconnect`, and the notification never
    /// reaches the restarted peer.
    AfterData,
    /// The peer is frozen (SIGSTOP) while the survivor fetches its metadata again, and
    /// killed while the fetch waits (see [`kill_during_fetch`]): the fetch fails with a
    /// typed error within the bound, a transfer to the dead incarnation is
    /// `RemoteDisconnect`, and its last metadata loaded again once it has ended (stale
    /// metadata, as a registry may still hold it) is refused or gives a transfer that
    /// is `RemoteDisconnect` too, never a stall (see [`stale_metadata_is_refused_or_fails`]).
    DuringMetadata,
    /// As `Idle`, and the restarted peer listens on the dead one's metadata address
    /// and port.
    SameAddress,
}

impl Fault {
    /// Whether the doomed transfer is posted before the peer dies.
    fn posted_before(self) -> bool {
        matches!(self, Fault::MidWrite | Fault::MidRead | Fault::AfterData)
    }

    /// The direction of the doomed transfer.
    pub fn op(self) -> XferOp {
        if self == Fault::MidRead {
            XferOp::Read
        } else {
            XferOp::Write
        }
    }
}

/// How a dead peer was noticed.
#[derive(Debug)]
pub struct Detection {
    pub error: Error,
    /// From the kill (under [`Fault::AfterData`], which the peer does itself: from the
    /// post) to the error.
    pub after_kill: Duration,
    /// From the kill to the process's end as its parent sees it (a SIGKILLed process
    /// still runs until the kernel has torn it down: on a loaded machine, for a while).
    pub ended: Duration,
    /// A post completed before the error (under [`Fault::AfterData`]: the notification
    /// was handed over before the peer died; the repost then failed).
    pub completed_first: bool,
    /// Under [`Fault::AfterData`], where the bound is counted from: the first completion
    /// (the data had landed by then, and the peer dies once it sees that), else the post
    /// (a WRITE of megabytes takes seconds in a TCG guest: not the detection's time).
    /// Zero for the other faults (from the kill).
    pub origin: Duration,
    /// Under [`Fault::AfterData`]: from the moment the peer killed itself (its own
    /// stamp, CLOCK_MONOTONIC, one clock for every process of the host) to the error;
    /// negative where the error came first. `None` for the other faults, or where the
    /// peer left no stamp.
    pub after_self_kill_ms: Option<f64>,
    pub fault: Fault,
}

impl Detection {
    /// Milliseconds from the process's end to the error (negative: the transport or the
    /// OS told before the process could be reaped).
    pub fn after_end_ms(&self) -> f64 {
        (self.after_kill.as_secs_f64() - self.ended.as_secs_f64()) * 1e3
    }

    /// What [`Self::delay`] counts from, in words.
    pub fn measured_from(&self) -> &'static str {
        match (self.fault, self.completed_first) {
            (Fault::AfterData, true) => "first completion",
            (Fault::AfterData, false) => "post",
            _ => "kill",
        }
    }

    /// The time the bound applies to: from the kill, or from [`Self::origin`].
    pub fn delay(&self) -> Duration {
        self.after_kill.saturating_sub(self.origin)
    }

    /// Asserts that the error is `RemoteDisconnect` naming `agent`, within `bound` (of
    /// [`Self::delay`]).
    pub fn assert_remote_disconnect(&self, label: &str, agent: &str, bound: Duration) {
        match &self.error {
            Error::RemoteDisconnect { agent: named, .. } => assert_eq!(named, agent, "{label}"),
            other => panic!("{label}: expected RemoteDisconnect, got {other:?}"),
        }
        assert!(
            self.delay() < bound,
            "{label}: RemoteDisconnect after {:?} (bound {bound:?}; {:?} from the kill or post)",
            self.delay(),
            self.after_kill
        );
    }
}

/// Kills `peer` as `fault` says, `req` (a transfer to it) in flight or not, and polls
/// `req` until it fails (reposting whenever it completes first), for at most
/// [`TIMEOUT`]. Under [`Fault::DuringMetadata`] the kill lands while `agent` fetches the
/// peer's metadata ([`kill_during_fetch`], whose failure must come within `bound`).
pub fn kill_during(
    fault: Fault,
    agent: &Agent,
    peer: &mut PeerProcess,
    req: &mut XferReq,
    bound: Duration,
) -> Detection {
    let posted_before = fault.posted_before();
    if posted_before {
        req.post().unwrap();
    }
    let killed = match fault {
        // It dies by itself once the data has landed.
        Fault::AfterData => Instant::now(),
        Fault::DuringMetadata => kill_during_fetch(agent, peer, bound),
        _ => {
            peer.child.kill().unwrap();
            Instant::now()
        }
    };
    let mut ended = None;
    let mut completed_first = false;
    let mut origin = Duration::ZERO;
    if !posted_before {
        // Posted to at once: the OS already says it is being killed, and the post
        // itself may say so.
        if let Err(error) = req.post() {
            let after_kill = killed.elapsed();
            peer.child.wait().unwrap();
            return Detection {
                error,
                after_kill,
                ended: killed.elapsed(),
                completed_first,
                origin,
                after_self_kill_ms: None,
                fault,
            };
        }
    }
    loop {
        let outcome = match req.status() {
            Ok(XferStatus::Done) => {
                if !completed_first && fault == Fault::AfterData {
                    origin = killed.elapsed();
                }
                completed_first = true;
                req.post().map(|_| ())
            }
            Ok(XferStatus::InProgress) => Ok(()),
            Err(e) => Err(e),
        };
        if ended.is_none() && peer.child.try_wait().unwrap().is_some() {
            ended = Some(killed.elapsed());
        }
        if let Err(error) = outcome {
            let after_kill = killed.elapsed();
            let error_ns = monotonic_ns();
            // Told before the process could be reaped: its end comes after.
            let ended = ended.unwrap_or_else(|| {
                peer.child.wait().unwrap();
                killed.elapsed()
            });
            let stamp = self_kill_stamp(peer.child.id());
            let after_self_kill_ms = std::fs::read_to_string(&stamp)
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .map(|at| (error_ns as f64 - at as f64) / 1e6);
            let _ = std::fs::remove_file(&stamp);
            return Detection {
                error,
                after_kill,
                ended,
                completed_first,
                origin,
                after_self_kill_ms,
                fault,
            };
        }
        assert!(
            killed.elapsed() < TIMEOUT,
            "the dead peer was never noticed"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Sends `sig` to the peer process.
pub fn signal(peer: &PeerProcess, sig: libc::c_int) {
    // SAFETY: kill(2) with the pid of our own (not yet reaped) child.
    let rc = unsafe { libc::kill(peer.child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({sig}): {}", std::io::Error::last_os_error());
}

/// [`Fault::DuringMetadata`]: freezes `peer`, starts a fetch of its metadata by `agent`
/// on another thread, kills the peer while the fetch waits for its answer, and checks
/// that the fetch fails with a typed error within `bound` of the kill. Returns when the
/// kill was sent.
pub fn kill_during_fetch(agent: &Agent, peer: &mut PeerProcess, bound: Duration) -> Instant {
    signal(peer, libc::SIGSTOP);
    let fetch = {
        let (agent, addr) = (agent.clone(), peer.addr);
        std::thread::spawn(move || {
            let outcome = agent.fetch_remote_metadata(addr);
            (outcome, Instant::now())
        })
    };
    // The request is sent and waits on the frozen listener.
    std::thread::sleep(Duration::from_millis(50));
    assert!(!fetch.is_finished(), "a frozen peer answered a fetch");
    peer.child.kill().unwrap();
    let killed = Instant::now();
    let (outcome, returned) = fetch.join().unwrap();
    let took = returned.saturating_duration_since(killed);
    match outcome {
        Ok(name) => panic!("a fetch from a peer killed before it answered loaded `{name}`"),
        Err(e) => {
            println!(
                "  the fetch in flight failed {:.1} ms after the kill: {e}",
                took.as_secs_f64() * 1e3
            );
            assert!(
                matches!(
                    e,
                    Error::Io(_)
                        | Error::MalformedMetadata(_)
                        | Error::Timeout(_)
                        | Error::RemoteDisconnect { .. }
                ),
                "the fetch failed with {e:?}"
            );
        }
    }
    assert!(
        took < bound,
        "the fetch failed only {took:?} after the kill"
    );
    killed
}

/// [`Fault::DuringMetadata`], continued once the peer has ended: `name`'s last metadata
/// (`blob`), loaded again after `agent` forgot it, must be refused at load or give a
/// transfer (`write`, made once it is loaded) that ends in `RemoteDisconnect` within
/// `bound` — never stall. The name is forgotten after (a refused load must leave nothing
/// of it), so that the restarted incarnation binds it afresh.
pub fn stale_metadata_is_refused_or_fails(
    agent: &Agent,
    name: &str,
    blob: &[u8],
    write: impl FnOnce() -> nixl::Result<XferReq>,
    bound: Duration,
) {
    agent.invalidate_remote(name).unwrap();
    let loaded = Instant::now();
    match agent.load_remote_metadata(blob) {
        Err(e) => {
            println!("  the dead incarnation's metadata, loaded again: refused: {e}");
            // A refused load leaves nothing of the name behind.
            assert!(
                !agent.has_remote(name),
                "a refused load of `{name}` left it loaded"
            );
        }
        Ok(_) => {
            // The request may fail as it is made (its memory cannot be mapped), as it is
            // posted, or while it runs.
            let error = match write() {
                Err(e) => e,
                Ok(mut req) => match req.post() {
                    Err(e) => e,
                    Ok(_) => req
                        .wait(TIMEOUT)
                        .expect_err("a WRITE to a dead incarnation completed"),
                },
            };
            let took = loaded.elapsed();
            println!(
                "  the dead incarnation's metadata, loaded again: a WRITE failed {:.1} ms \
                 after the load: {error}",
                took.as_secs_f64() * 1e3
            );
            assert!(
                matches!(&error, Error::RemoteDisconnect { agent, .. } if agent == name),
                "a WRITE to a dead incarnation: {error:?}"
            );
            assert!(took < bound, "stale metadata: {took:?}");
            agent.invalidate_remote(name).unwrap();
        }
    }
}

// ---- the peer process's side ------------------------------------------------------------------

/// Writes `agent`'s metadata blob next to the announce file (`<announce>.md`), whole,
/// before the peer announces itself: [`Fault::DuringMetadata`] loads it again once the
/// peer is dead.
pub fn announce_metadata(announce_at: &str, agent: &Agent) {
    let md = agent.local_metadata().unwrap();
    std::fs::write(format!("{announce_at}.md.tmp"), md).unwrap();
    std::fs::rename(format!("{announce_at}.md.tmp"), format!("{announce_at}.md")).unwrap();
}

/// The metadata blob the peer wrote at its start ([`announce_metadata`]).
pub fn metadata_of(peer: &PeerProcess) -> Vec<u8> {
    std::fs::read(metadata_path(peer)).unwrap()
}

fn metadata_path(peer: &PeerProcess) -> PathBuf {
    PathBuf::from(format!("{}.md", peer.announce.display()))
}

/// [`Fault::AfterData`], in the peer process: polls `landed` (whether a WRITE's data is
/// all there) and SIGKILLs this process the moment it says so, without taking
/// notifications (those `agent` takes as a manual-progress provider needs it are
/// dropped with it). Panics when nothing lands within a few [`TIMEOUT`]s.
pub fn die_once_landed(agent: &Agent, mut landed: impl FnMut() -> bool, poll: Duration) -> ! {
    let deadline = Instant::now() + 5 * TIMEOUT;
    while Instant::now() < deadline {
        if landed() {
            // When, for the survivor's figure (`Detection::after_self_kill_ms`).
            let _ = std::fs::write(
                self_kill_stamp(std::process::id()),
                monotonic_ns().to_string(),
            );
            // SAFETY: kill(2) on this very process; no memory is passed.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let _ = agent.get_notifs();
        std::thread::sleep(poll);
    }
    panic!("the WRITE's data never landed");
}

/// Where a peer process `pid` that kills itself leaves the moment it did
/// ([`die_once_landed`]).
fn self_kill_stamp(pid: u32) -> PathBuf {
    std::env::temp_dir().join(format!("nixl-restart-self-kill-{pid}"))
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the host.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: one valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Whether each of the first `blocks` blocks of `block` bytes from `base` ends with
/// the last 8 bytes of `want`'s block (DRAM the provider writes from other threads, or
/// other processes: read volatile).
///
/// # Safety
/// `base .. base + blocks * block` must be readable for the call.
pub unsafe fn blocks_end_with(base: *const u8, block: usize, blocks: usize, want: &[u8]) -> bool {
    (1..=blocks).all(|b| {
        (b * block - 8..b * block).all(|at| {
            // SAFETY: `at < blocks * block`: inside the range the caller vouches for.
            unsafe { std::ptr::read_volatile(base.add(at)) == want[at] }
        })
    })
}

/// Waits for the peer's verdict on notification `msg` (bounded).
pub fn verdict(peer: &mut PeerProcess, msg: &str) -> String {
    let ok = peer.ok_path();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let text = wait_file(&ok, &mut peer.child);
        if text.ends_with(msg) {
            return text;
        }
        assert!(Instant::now() < deadline, "no verdict on `{msg}`: {text}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The peer's answer to a notification `check ...`: `BAD: received ...` once anything
/// else arrived (a notification of a transfer to the dead incarnation, say), `BAD DATA`
/// when `data_ok` says so, `OK` otherwise; written to `<announce>.ok`.
pub fn answer_check(announce_at: &str, misdirected: &Option<String>, data_ok: bool, text: &str) {
    let verdict = match misdirected {
        Some(m) => format!("BAD: received {m}"),
        None if !data_ok => "BAD DATA".to_string(),
        None => "OK".to_string(),
    };
    announce(format!("{announce_at}.ok"), &format!("{verdict} {text}"));
}

// ---- what the survivor holds ------------------------------------------------------------------

/// Counts of what a dead incarnation could leave behind in the survivor: file
/// descriptors, threads, and memory pinned for RDMA (`VmPin`: memory registered with a
/// verbs device — a connection's buffers kept past the peer's death stay pinned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub fds: usize,
    pub threads: usize,
    pub pinned_kib: u64,
}

/// File descriptors and threads the survivor may hold more after a case than before
/// it (a heartbeat handshake's short-lived thread, a socket a provider opens lazily).
pub const FD_SLACK: usize = 2;
pub const THREAD_SLACK: usize = 1;

impl Held {
    pub fn now() -> Self {
        let count = |dir: &str| std::fs::read_dir(dir).unwrap().count();
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let pinned_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmPin:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        Self {
            fds: count("/proc/self/fd"),
            threads: count("/proc/self/task"),
            pinned_kib,
        }
    }

    /// What `self` (after a case) holds beyond `before`, or `None` when within the slack
    /// ([`FD_SLACK`], [`THREAD_SLACK`]; pinned memory: none).
    pub fn leaked_since(&self, before: &Held) -> Option<String> {
        (self.fds > before.fds + FD_SLACK
            || self.threads > before.threads + THREAD_SLACK
            || self.pinned_kib > before.pinned_kib)
            .then(|| format!("before {before:?}, after {self:?}"))
    }
}

// ---- the bystander ----------------------------------------------------------------------------

/// What the bystander's thread saw.
#[derive(Debug)]
pub struct BystanderReport {
    pub rounds: u64,
    pub longest: Duration,
    pub failure: Option<String>,
}

impl BystanderReport {
    /// Asserts that every round passed, at least one ran, and none took `bound`.
    pub fn assert_unaffected(&self, label: &str, bound: Duration) {
        println!(
            "{label}: bystander {} rounds, longest {:?}",
            self.rounds, self.longest
        );
        assert!(self.failure.is_none(), "{label}: bystander: {self:?}");
        assert!(self.rounds > 0, "{label}: the bystander never ran");
        assert!(
            self.longest < bound,
            "{label}: a bystander round took {:?}",
            self.longest
        );
    }
}

/// A thread of the survivor that WRITEs `len` bytes (DRAM) to a second peer and READs
/// them back, each round verified, until [`Bystander::finish`]: the survivor's traffic
/// to a peer that stays up, through every fault of a row.
pub struct Bystander {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<BystanderReport>,
    started: Instant,
}

impl Bystander {
    /// Starts the rounds from `agent` to `peer` (its buffer at `base`, `len` bytes);
    /// returns once the first round passed (its buffers registered: what the survivor
    /// holds is counted after this).
    pub fn start(agent: &Agent, peer: &str, base: u64, len: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let started = Instant::now();
        let thread = {
            let (agent, peer, stop) = (agent.clone(), peer.to_string(), stop.clone());
            std::thread::spawn(move || rounds(agent, peer, base, len, stop, ready_tx, started))
        };
        // A failed first round is reported by `finish`.
        let _ = ready.recv_timeout(TIMEOUT);
        Self {
            stop,
            thread,
            started,
        }
    }

    /// Time since the rounds started (the failure in a report is timed from there too:
    /// a row prints it at each case, so that a failure is placed).
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Stops the rounds; what they saw.
    pub fn finish(self) -> BystanderReport {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

fn rounds(
    agent: Agent,
    peer: String,
    base: u64,
    len: usize,
    stop: Arc<AtomicBool>,
    ready: std::sync::mpsc::Sender<()>,
    since: Instant,
) -> BystanderReport {
    let mut src = vec![0u8; len];
    let back = vec![0u8; len];
    // SAFETY: both buffers outlive the handle and every request of this function.
    let _h = unsafe {
        agent
            .register_mem(
                &dram([Desc::from_slice(&src), Desc::from_slice(&back)]),
                None,
            )
            .unwrap()
    };
    let remote = dram([Desc::new(base, len as u64, 0)]);
    // Polled with short sleeps, not `wait` (which yields and stays runnable): the
    // bystander is traffic to a peer that stays up, not a load on the CPU. On two vCPUs
    // of a TCG guest a bystander that never slept, with the row's own polling, starved
    // the peers' heartbeat threads until live peers were declared dead.
    let run = |op: XferOp, local: &[u8]| -> nixl::Result<()> {
        let mut req =
            agent.create_xfer_req(op, &dram([Desc::from_slice(local)]), &remote, &peer, None)?;
        let posted = Instant::now();
        let mut status = req.post()?;
        while status != XferStatus::Done {
            if posted.elapsed() > TIMEOUT {
                return Err(Error::Timeout(format!(
                    "bystander {op:?} not done after {TIMEOUT:?}"
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
            status = req.status()?;
        }
        Ok(())
    };
    let mut report = BystanderReport {
        rounds: 0,
        longest: Duration::ZERO,
        failure: None,
    };
    while !stop.load(Ordering::Relaxed) && report.failure.is_none() {
        // The round's bytes are made before it is timed (a debug build's pattern costs).
        src.copy_from_slice(&pattern(report.rounds as u8 ^ 0x77, len));
        let started = Instant::now();
        let outcome = run(XferOp::Write, &src).and_then(|_| run(XferOp::Read, &back));
        report.longest = report.longest.max(started.elapsed());
        report.rounds += 1;
        report.failure = match outcome {
            Err(e) => Some(format!(
                "round {} (ended {:.2?} after the start): {e}",
                report.rounds,
                since.elapsed()
            )),
            Ok(()) if back != src => Some(format!("round {}: wrong bytes", report.rounds)),
            Ok(()) => None,
        };
        let _ = ready.send(());
        std::thread::sleep(Duration::from_millis(2));
    }
    report
}
