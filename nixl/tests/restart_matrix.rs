#![cfg(feature = "libfabric")]
//! Peers come and go (issue 27): the fault matrix, one row per transport.
//!
//! For each row of [`TRANSPORTS`] a survivor agent in this process moves data to a peer
//! process that is SIGKILLed, once per fault of [`FAULTS`] — in the middle of 16 MiB
//! WRITEs, in the middle of 16 MiB READs, while idle, by itself right after a WRITE's
//! data landed and before it took the notification, and while the survivor fetches its
//! metadata (then its stale metadata is loaded again) — and then started again under
//! the same agent name (a new process: new port — or, in `SameAddress`, the dead one's
//! metadata address and port — new endpoints, new keys), whose metadata the survivor
//! fetches. Each case asserts:
//! - the transfer to the dead peer fails with `RemoteDisconnect` naming it within
//!   [`DETECTION_BOUND`];
//! - the restarted peer is reached within [`RECONNECT_BOUND`] of its metadata being
//!   loaded: a 16 MiB WRITE with a notification, whose data and notification the peer
//!   checks, then a 16 MiB READ of what the peer holds;
//! - a second peer process (the bystander), which the survivor WRITEs to and READs back
//!   from round after round on a thread of its own through the whole row, never fails,
//!   never returns a wrong byte and never takes longer than [`BYSTANDER_BOUND`] a round;
//! - nothing of the dead incarnation is left: the survivor holds as many file
//!   descriptors and threads as before the kill (a small slack, [`FD_SLACK`] and
//!   [`THREAD_SLACK`]), no `/dev/shm` file names the dead process, and no mapping of its
//!   regions still holds memory.
//!
//! The figures (detection and reconnect times, with the error that reported the death)
//! are printed per case. Rows run one at a time (a 2-core machine). A later transport is
//! a row of [`TRANSPORTS`], a later fault an entry of [`FAULTS`] and a branch of
//! [`kill_during`].

mod common;

use common::{announce, announce_path, dram, self_test, wait_file, PeerProcess, TIMEOUT};
use nixl::{params, Agent, BackendParams, Desc, Error, XferOp, XferReq, XferStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A dead peer must be reported within this (the goal is 100 ms on one host; the bound
/// leaves room for a loaded 2-core machine).
const DETECTION_BOUND: Duration = Duration::from_secs(2);
/// A restarted peer must be reached within this of its metadata being loaded (the goal
/// is 1 s; the transfer that proves it moves 16 MiB).
const RECONNECT_BOUND: Duration = Duration::from_secs(2);
/// The longest round (a 1 MiB WRITE and its READ back) the bystander may take.
const BYSTANDER_BOUND: Duration = Duration::from_secs(2);
/// File descriptors and threads the survivor may hold more after a case than before it
/// (a heartbeat handshake's short-lived thread, a socket the provider opens lazily).
const FD_SLACK: usize = 2;
const THREAD_SLACK: usize = 1;

/// The size of each block moved: what the issue measured with.
const BLOCK: usize = 16 << 20;
/// Blocks per transfer, and the peer's buffer.
const BLOCKS: usize = 4;
const PEER_LEN: usize = BLOCK * BLOCKS;
const BYSTANDER_LEN: usize = 1 << 20;
/// The pattern of what the survivor writes.
const SURVIVOR_SEED: u64 = 7;

/// One row of the matrix: LIBFABRIC parameters (the same on both sides) and the provider
/// the survivor must then reach its peers through.
struct Transport {
    /// Names the row, its test and its agents.
    tag: &'static str,
    params: &'static [(&'static str, &'static str)],
    /// What `peer_transport` must say (the row tests what it claims to).
    reached_by: &'static str,
}

/// The rows. Same-host peers go over the named provider itself (`local_provider=none`),
/// except in `default`, where they go through the shm plane as a default backend's do.
/// libfabric 1.17's `tcp` provider has no RDM endpoints of its own: `provider=tcp` opens
/// `tcp;ofi_rxm` (its row checks that it still works as named).
const TRANSPORTS: &[Transport] = &[
    Transport {
        tag: "tcp_rxm",
        params: &[("provider", "tcp;ofi_rxm"), ("local_provider", "none")],
        reached_by: "tcp;ofi_rxm",
    },
    Transport {
        tag: "tcp_rxm_4rails",
        params: &[
            ("provider", "tcp;ofi_rxm"),
            ("local_provider", "none"),
            ("num_rails", "4"),
        ],
        reached_by: "tcp;ofi_rxm",
    },
    Transport {
        tag: "tcp",
        params: &[("provider", "tcp"), ("local_provider", "none")],
        reached_by: "tcp;ofi_rxm",
    },
    Transport {
        tag: "sockets",
        params: &[("provider", "sockets"), ("local_provider", "none")],
        reached_by: "sockets",
    },
    Transport {
        tag: "shm",
        params: &[("provider", "shm")],
        reached_by: "shm",
    },
    // Every byte through the provider: no pieces copied by the processes themselves,
    // whose failures would tell of the death first (`cma_write`, `cma_read`).
    Transport {
        tag: "shm_2rails_provider_copies",
        params: &[
            ("provider", "shm"),
            ("num_rails", "2"),
            ("cma_write", "0"),
            ("cma_read", "0"),
        ],
        reached_by: "shm",
    },
    Transport {
        tag: "default",
        params: &[],
        reached_by: "shm",
    },
];

/// When the peer is killed (SIGKILL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGKILL while 16 MiB WRITEs to it are in flight.
    MidWrite,
    /// SIGKILL while 16 MiB READs from it are in flight.
    MidRead,
    /// SIGKILL while nothing moves; then, at once, a WRITE is posted to it.
    Idle,
    /// The peer SIGKILLs itself the moment the data of a WRITE has landed (the last
    /// word of every block is there), before it takes the WRITE's notification: the
    /// WRITE (or, where the notification was handed over first, its repost) fails with
    /// `RemoteDisconnect`, and the notification never reaches the restarted peer.
    AfterData,
    /// The peer is frozen (SIGSTOP) while the survivor fetches its metadata again, and
    /// killed while the fetch waits: the fetch fails with a typed error within the
    /// bound, a transfer to the dead incarnation is `RemoteDisconnect`, and its last
    /// metadata, loaded again once it has ended (stale metadata, as a registry may
    /// still hold it), gives a transfer that is `RemoteDisconnect` too, never a stall.
    DuringMetadata,
    /// As `Idle`, and the restarted peer listens on the dead one's metadata address
    /// and port (the fabric endpoints' ports are the provider's choice: there is no
    /// parameter that fixes them).
    SameAddress,
}

const FAULTS: &[Fault] = &[
    Fault::MidWrite,
    Fault::MidRead,
    Fault::Idle,
    Fault::AfterData,
    Fault::DuringMetadata,
    Fault::SameAddress,
];

fn transport(tag: &str) -> &'static Transport {
    TRANSPORTS
        .iter()
        .find(|t| t.tag == tag)
        .unwrap_or_else(|| panic!("no transport `{tag}`"))
}

fn backend_params(t: &Transport) -> BackendParams {
    params(t.params.iter().copied())
}

/// What every peer's buffer holds (and what the survivor writes): 8-byte words that
/// differ at every offset and between seeds; cheap to make in a debug build.
fn fill(buf: &mut [u8], seed: u64, offset: usize) {
    for (i, word) in buf.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(&word_at(seed, offset + 8 * i).to_le_bytes());
    }
}

/// The word of seed `seed`'s pattern at byte `offset` (a multiple of 8).
fn word_at(seed: u64, offset: usize) -> u64 {
    let at = (offset / 8) as u64;
    at.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xff51_afd7)
}

fn filled(len: usize, seed: u64, offset: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed, offset);
    v
}

// ---- the peer process -----------------------------------------------------------------------

/// The peer process: runs only when re-executed with `NIXL_RESTART_PEER` (see
/// [`spawn_peer`]). Holds [`PEER_LEN`] bytes of its seed's pattern and answers each
/// notification `check <seed> <offset> <len>` by comparing that range with the seed's
/// pattern, writing the verdict to `<announce>.ok` (bad, whatever the data, once any
/// other notification arrived). Its metadata blob is at `<announce>.md`; it listens on
/// `NIXL_RESTART_LISTEN` where that is set. With `NIXL_RESTART_DIE_AFTER_DATA=<seed>`
/// it SIGKILLs itself as soon as the last word of every block holds that seed's
/// pattern (a WRITE's data has landed), without taking notifications. Ends with the
/// thread that spawned it (`PR_SET_PDEATHSIG`), or when killed; bounded.
#[test]
fn restart_peer_main() {
    let (Ok(announce_at), Ok(tag), Ok(name), Ok(seed)) = (
        std::env::var("NIXL_RESTART_PEER"),
        std::env::var("NIXL_RESTART_TRANSPORT"),
        std::env::var("NIXL_RESTART_NAME"),
        std::env::var("NIXL_RESTART_SEED"),
    ) else {
        return;
    };
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number; no memory is passed.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    common::init_tracing();
    tracing::info!(agent = %name, "peer process");
    let seed: u64 = seed.parse().unwrap();
    let mut config = common::listening();
    if let Ok(addr) = std::env::var("NIXL_RESTART_LISTEN") {
        config.listen_addr = Some(addr.parse().unwrap());
    }
    let peer = Agent::new(name, config).unwrap();
    peer.create_backend("LIBFABRIC", &backend_params(transport(&tag)))
        .unwrap();
    let buf = filled(PEER_LEN, seed, 0);
    // SAFETY: `buf` lives until the process ends.
    let _h = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    let md = peer.local_metadata().unwrap();
    std::fs::write(format!("{announce_at}.md.tmp"), md).unwrap();
    std::fs::rename(format!("{announce_at}.md.tmp"), format!("{announce_at}.md")).unwrap();
    common::announce_agent(&announce_at, &peer, buf.as_ptr() as u64);
    if let Ok(seed) = std::env::var("NIXL_RESTART_DIE_AFTER_DATA") {
        die_after_data(&peer, &buf, seed.parse().unwrap());
    }
    // Anything else that arrives (a notification of a transfer to the dead incarnation,
    // say) spoils every later verdict.
    let mut misdirected: Option<String> = None;
    let deadline = Instant::now() + 5 * TIMEOUT;
    while Instant::now() < deadline {
        for (from, msgs) in peer.wait_notifs(Duration::from_millis(20)) {
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg).to_string();
                let Some(args) = text.strip_prefix("check ") else {
                    misdirected.get_or_insert(format!("`{text}` from {from}"));
                    continue;
                };
                let n: Vec<usize> = args.split(' ').map(|a| a.parse().unwrap()).collect();
                let (seed, offset, len) = (n[0] as u64, n[1], n[2]);
                let verdict = match &misdirected {
                    Some(m) => format!("BAD: received {m}"),
                    None if buf[offset..offset + len] != filled(len, seed, offset)[..] => {
                        "BAD DATA".to_string()
                    }
                    None => "OK".to_string(),
                };
                announce(format!("{announce_at}.ok"), &format!("{verdict} {text}"));
            }
        }
    }
}

/// [`restart_peer_main`]'s end under [`Fault::AfterData`]: waits until the last word
/// of each of the first [`BLOCKS`] blocks of `buf` holds seed `seed`'s pattern, then
/// SIGKILLs this process (bounded). Takes notifications meanwhile only as the progress
/// of a manual-progress provider needs it (whatever it takes is dropped with it).
fn die_after_data(peer: &Agent, buf: &[u8], seed: u64) {
    let ends: Vec<(usize, u64)> = (1..=BLOCKS)
        .map(|b| (b * BLOCK - 8, word_at(seed, b * BLOCK - 8)))
        .collect();
    let landed = || {
        ends.iter().all(|&(at, want)| {
            // SAFETY: `at + 8 <= buf.len()`, and `at` is a multiple of 8 in an
            // allocation the allocator aligns to 16 at least; the provider writes the
            // buffer from other threads (or processes), hence a volatile read.
            let word = unsafe { std::ptr::read_volatile(buf.as_ptr().add(at) as *const u64) };
            u64::from_le(word) == want
        })
    };
    let deadline = Instant::now() + 5 * TIMEOUT;
    while Instant::now() < deadline {
        if landed() {
            // SAFETY: kill(2) on this very process; no memory is passed.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let _ = peer.get_notifs();
        std::thread::sleep(Duration::from_micros(20));
    }
    panic!("the WRITE's data never landed");
}

/// How a peer process is started.
#[derive(Debug, Clone, Default)]
struct PeerOptions {
    /// Listen for metadata there (a dead incarnation's address, say).
    listen: Option<std::net::SocketAddr>,
    /// Die as soon as a WRITE of this seed's data has landed ([`Fault::AfterData`]).
    die_after_data: Option<u64>,
}

/// A copy of this binary running [`restart_peer_main`] as agent `name` over `t`, its
/// buffer filled with seed `seed`.
fn spawn_peer(t: &Transport, name: &str, seed: u64) -> PeerProcess {
    spawn_peer_with(t, name, seed, &PeerOptions::default())
}

fn spawn_peer_with(t: &Transport, name: &str, seed: u64, options: &PeerOptions) -> PeerProcess {
    let announce_at = announce_path("nixl-restart", &format!("{name}-{seed}"));
    let _ = std::fs::remove_file(format!("{}.md", announce_at.display()));
    let mut cmd = self_test("restart_peer_main", false);
    cmd.env("NIXL_RESTART_PEER", &announce_at)
        .env("NIXL_RESTART_TRANSPORT", t.tag)
        .env("NIXL_RESTART_NAME", name)
        .env("NIXL_RESTART_SEED", seed.to_string());
    if let Some(addr) = options.listen {
        cmd.env("NIXL_RESTART_LISTEN", addr.to_string());
    }
    if let Some(seed) = options.die_after_data {
        cmd.env("NIXL_RESTART_DIE_AFTER_DATA", seed.to_string());
    }
    PeerProcess::spawn(cmd, announce_at)
}

/// The metadata blob the peer wrote at its start.
fn metadata_of(peer: &PeerProcess) -> Vec<u8> {
    std::fs::read(format!("{}.md", peer.announce.display())).unwrap()
}

/// Sends `sig` to the peer process.
fn signal(peer: &PeerProcess, sig: libc::c_int) {
    // SAFETY: kill(2) with the pid of our own (not yet reaped) child.
    let rc = unsafe { libc::kill(peer.child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({sig}): {}", std::io::Error::last_os_error());
}

/// Waits for the peer's verdict on notification `msg` (bounded).
fn verdict(peer: &mut PeerProcess, msg: &str) -> String {
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

// ---- what the survivor holds ----------------------------------------------------------------

/// Counts of what a dead incarnation could leave behind in the survivor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Resources {
    fds: usize,
    threads: usize,
}

impl Resources {
    fn now() -> Self {
        let count = |dir: &str| std::fs::read_dir(dir).unwrap().count();
        Self {
            fds: count("/proc/self/fd"),
            threads: count("/proc/self/task"),
        }
    }
}

/// What process `pid` left in `/dev/shm` (libfabric's `shm` regions are named
/// `nixl-<pid namespace>-<pid>-<nonce>:...` by the backend, `<pid>:...` by default), and
/// this process's mappings of such regions that still hold memory: the provider never
/// unmaps a departed peer, so the backend empties a dead peer's regions instead (a page
/// or two that the provider touches again may come back).
fn shm_traces_of(pid: u32) -> Vec<String> {
    const KEPT_KIB: u64 = 16;
    let names = |name: &str| {
        name.starts_with(&format!("{pid}:"))
            || name
                .strip_prefix("nixl-")
                .and_then(|rest| rest.split('-').nth(1))
                .is_some_and(|p| p == pid.to_string())
    };
    let mut traces: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| names(n))
                .map(|n| format!("/dev/shm/{n}"))
                .collect()
        })
        .unwrap_or_default();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut current: Option<String> = None;
    for line in smaps.lines() {
        if let Some((_, name)) = line.split_once("/dev/shm/") {
            let name = name.trim_end_matches(" (deleted)");
            current = names(name).then(|| name.to_string());
        } else if line.starts_with(|c: char| c.is_ascii_hexdigit()) && line.contains('-') {
            current = None;
        } else if let (Some(name), Some(rss)) = (&current, line.strip_prefix("Rss:")) {
            let kib: u64 = rss.trim().trim_end_matches("kB").trim().parse().unwrap();
            if kib > KEPT_KIB {
                traces.push(format!("mapped with {kib} KiB: /dev/shm/{name}"));
            }
        }
    }
    traces
}

// ---- the bystander --------------------------------------------------------------------------

/// What the bystander's thread saw.
#[derive(Debug)]
struct BystanderReport {
    rounds: u64,
    longest: Duration,
    failure: Option<String>,
}

/// Rounds of a 1 MiB WRITE to `peer` (its buffer at `base`) and a READ back, each
/// verified, until `stop`.
fn bystander(agent: Agent, peer: String, base: u64, stop: Arc<AtomicBool>) -> BystanderReport {
    let mut src = vec![0u8; BYSTANDER_LEN];
    let back = vec![0u8; BYSTANDER_LEN];
    // SAFETY: both buffers outlive the handle and every request of this function.
    let _h = unsafe {
        agent
            .register_mem(
                &dram([Desc::from_slice(&src), Desc::from_slice(&back)]),
                None,
            )
            .unwrap()
    };
    let remote = dram([Desc::new(base, BYSTANDER_LEN as u64, 0)]);
    let run = |op: XferOp, local: &[u8]| -> nixl::Result<()> {
        let mut req =
            agent.create_xfer_req(op, &dram([Desc::from_slice(local)]), &remote, &peer, None)?;
        req.post()?;
        req.wait(TIMEOUT)
    };
    let mut report = BystanderReport {
        rounds: 0,
        longest: Duration::ZERO,
        failure: None,
    };
    while !stop.load(Ordering::Relaxed) && report.failure.is_none() {
        let started = Instant::now();
        fill(&mut src, 1000 + report.rounds, 0);
        let outcome = run(XferOp::Write, &src).and_then(|_| run(XferOp::Read, &back));
        report.longest = report.longest.max(started.elapsed());
        report.rounds += 1;
        report.failure = match outcome {
            Err(e) => Some(format!("round {}: {e}", report.rounds)),
            Ok(()) if back != src => Some(format!("round {}: wrong bytes", report.rounds)),
            Ok(()) => None,
        };
    }
    report
}

// ---- the matrix -----------------------------------------------------------------------------

/// How a dead peer was noticed.
struct Detection {
    error: Error,
    /// From the kill (under [`Fault::AfterData`], which the peer does itself: from the
    /// post) to the error.
    after_kill: Duration,
    /// From the kill to the process's end as its parent sees it (a SIGKILLed process
    /// still runs until the kernel has torn it down: on a loaded machine, for a while).
    ended: Duration,
    /// A post completed before the error (under [`Fault::AfterData`]: the notification
    /// was handed over before the peer died; the repost then failed).
    completed_first: bool,
}

impl Detection {
    /// Milliseconds from the process's end to the error (negative: the transport or the
    /// OS told before the process could be reaped).
    fn after_end_ms(&self) -> f64 {
        (self.after_kill.as_secs_f64() - self.ended.as_secs_f64()) * 1e3
    }
}

/// Kills `peer` as `fault` says, `req` (a transfer to it of [`BLOCKS`] blocks) in
/// flight or not, and polls `req` until it fails (reposting whenever it completes
/// first), for at most [`TIMEOUT`]. Under [`Fault::DuringMetadata`] the kill lands
/// while `agent` fetches the peer's metadata (see [`kill_during_fetch`]).
fn kill_during(
    fault: Fault,
    agent: &Agent,
    peer: &mut PeerProcess,
    req: &mut XferReq,
) -> Detection {
    let posted_before = matches!(fault, Fault::MidWrite | Fault::MidRead | Fault::AfterData);
    if posted_before {
        req.post().unwrap();
    }
    let killed = match fault {
        // It dies by itself once the data has landed.
        Fault::AfterData => Instant::now(),
        Fault::DuringMetadata => kill_during_fetch(agent, peer),
        _ => {
            peer.child.kill().unwrap();
            Instant::now()
        }
    };
    let mut ended = None;
    let mut completed_first = false;
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
            };
        }
    }
    loop {
        let outcome = match req.status() {
            Ok(XferStatus::Done) => {
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
            // Told before the process could be reaped: its end comes after.
            let ended = ended.unwrap_or_else(|| {
                peer.child.wait().unwrap();
                killed.elapsed()
            });
            return Detection {
                error,
                after_kill,
                ended,
                completed_first,
            };
        }
        assert!(
            killed.elapsed() < TIMEOUT,
            "the dead peer was never noticed"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// [`Fault::DuringMetadata`]: freezes `peer`, starts a fetch of its metadata by `agent`
/// on another thread, kills the peer while the fetch waits for its answer, and checks
/// that the fetch fails with a typed error within [`DETECTION_BOUND`] of the kill.
/// Returns when the kill was sent.
fn kill_during_fetch(agent: &Agent, peer: &mut PeerProcess) -> Instant {
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
        took < DETECTION_BOUND,
        "the fetch failed only {took:?} after the kill"
    );
    killed
}

/// [`Fault::DuringMetadata`], continued once the peer has ended: its last metadata
/// (`blob`), loaded again after the agent forgot it, must give a transfer that ends in
/// `RemoteDisconnect` within [`DETECTION_BOUND`] — or be refused at load — never stall.
fn stale_metadata_of_a_dead_peer(survivor: &mut Survivor, name: &str, base: u64, blob: &[u8]) {
    survivor.agent.invalidate_remote(name).unwrap();
    let loaded = Instant::now();
    match survivor.agent.load_remote_metadata(blob) {
        Err(e) => println!("  the dead incarnation's metadata, loaded again: refused: {e}"),
        Ok(_) => {
            let mut req = survivor.xfer(XferOp::Write, name, base, 1, Some("stale"));
            let error = match req.post() {
                Err(e) => e,
                Ok(_) => req
                    .wait(TIMEOUT)
                    .expect_err("a WRITE to a dead incarnation completed"),
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
            assert!(took < DETECTION_BOUND, "stale metadata: {took:?}");
        }
    }
    // Forgotten again, so the restarted incarnation binds the name afresh.
    survivor.agent.invalidate_remote(name).unwrap();
}

/// The survivor's side of one row: its agent, its buffers, and the block lists.
struct Survivor {
    /// First: dropped before the buffers it registers.
    _h: Option<nixl::RegistrationHandle>,
    agent: Agent,
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Survivor {
    fn new(t: &Transport) -> Self {
        let agent = Agent::new(format!("survivor-{}", t.tag), common::listening()).unwrap();
        agent
            .create_backend("LIBFABRIC", &backend_params(t))
            .unwrap_or_else(|e| panic!("LIBFABRIC over {}: {e}", t.tag));
        let mut s = Self {
            agent,
            src: filled(PEER_LEN, SURVIVOR_SEED, 0),
            dst: vec![0u8; PEER_LEN],
            _h: None,
        };
        // SAFETY: both buffers live in `s`, whose handle is dropped before them (declared
        // first), after every request (each is dropped before `s`).
        s._h = Some(unsafe {
            s.agent
                .register_mem(
                    &dram([Desc::from_slice(&s.src), Desc::from_slice(&s.dst)]),
                    None,
                )
                .unwrap()
        });
        s
    }

    /// `n` blocks from `base`.
    fn blocks(base: u64, n: usize) -> nixl::DescList {
        dram((0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, 0)))
    }

    /// A transfer of `n` blocks with `peer`'s buffer (at `base`).
    fn xfer(
        &mut self,
        op: XferOp,
        peer: &str,
        base: u64,
        n: usize,
        notif: Option<&str>,
    ) -> XferReq {
        let local = match op {
            XferOp::Read => self.dst.as_mut_ptr() as u64,
            XferOp::Write => self.src.as_ptr() as u64,
        };
        self.agent
            .create_xfer_req(
                op,
                &Self::blocks(local, n),
                &Self::blocks(base, n),
                peer,
                notif.map(|m| m.as_bytes().to_vec()),
            )
            .unwrap()
    }
}

/// One row: every fault of [`FAULTS`] against peers over `t`.
fn restart_row(t: &Transport) {
    let _serial = common::serial();
    common::init_tracing();
    let mut survivor = Survivor::new(t);

    let bystander_name = format!("bystander-{}", t.tag);
    let bystander_peer = spawn_peer(t, &bystander_name, 0);
    survivor
        .agent
        .fetch_remote_metadata(bystander_peer.addr)
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let bystander_thread = {
        let (agent, name, base, stop) = (
            survivor.agent.clone(),
            bystander_name.clone(),
            bystander_peer.base,
            stop.clone(),
        );
        std::thread::spawn(move || bystander(agent, name, base, stop))
    };

    let name = format!("restarting-{}", t.tag);
    let mut incarnation = 1;
    let mut peer = spawn_peer(t, &name, incarnation);
    survivor.agent.fetch_remote_metadata(peer.addr).unwrap();
    assert_eq!(
        common::fabric_transport(&survivor.agent, &name).as_deref(),
        Some(t.reached_by),
        "{}: the peer is reached through another provider",
        t.tag
    );
    for &fault in FAULTS {
        let label = format!("{}, {fault:?}", t.tag);
        if fault == Fault::AfterData {
            // A peer that dies once a WRITE's data has landed: this fault's own.
            drop(peer);
            incarnation += 1;
            let options = PeerOptions {
                die_after_data: Some(SURVIVOR_SEED),
                ..PeerOptions::default()
            };
            peer = spawn_peer_with(t, &name, incarnation, &options);
            survivor.agent.invalidate_remote(&name).unwrap();
            assert_eq!(
                survivor.agent.fetch_remote_metadata(peer.addr).unwrap(),
                name
            );
        }
        // The live incarnation is reached (its connections exist) before counting.
        let mut warm = survivor.xfer(XferOp::Write, &name, peer.base, 1, None);
        warm.post().unwrap();
        warm.wait(TIMEOUT).unwrap();
        drop(warm);
        let before = Resources::now();

        let op = match fault {
            Fault::MidRead => XferOp::Read,
            _ => XferOp::Write,
        };
        let mut req = survivor.xfer(op, &name, peer.base, BLOCKS, Some("doomed"));
        let dead_pid = peer.child.id();
        let dead_addr = peer.addr;
        let dead_base = peer.base;
        let dead_blob = metadata_of(&peer);
        let detection = kill_during(fault, &survivor.agent, &mut peer, &mut req);
        println!(
            "{label}: RemoteDisconnect {:.1} ms after the {}, {:.1} ms after the process \
             ended{} ({})",
            detection.after_kill.as_secs_f64() * 1e3,
            if fault == Fault::AfterData {
                "post"
            } else {
                "kill"
            },
            detection.after_end_ms(),
            if detection.completed_first {
                "; a post completed first"
            } else {
                ""
            },
            detection.error,
        );
        match &detection.error {
            Error::RemoteDisconnect { agent, .. } => assert_eq!(agent, &name, "{label}"),
            other => panic!("{label}: expected RemoteDisconnect, got {other:?}"),
        }
        assert!(
            detection.after_kill < DETECTION_BOUND,
            "{label}: RemoteDisconnect after {:?} (bound {DETECTION_BOUND:?})",
            detection.after_kill
        );
        drop(req);
        drop(peer);
        if fault == Fault::DuringMetadata {
            stale_metadata_of_a_dead_peer(&mut survivor, &name, dead_base, &dead_blob);
        }

        // The same name, a new process.
        incarnation += 1;
        let options = PeerOptions {
            listen: (fault == Fault::SameAddress).then_some(dead_addr),
            ..PeerOptions::default()
        };
        let mut restarted = spawn_peer_with(t, &name, incarnation, &options);
        if fault == Fault::SameAddress {
            assert_eq!(restarted.addr, dead_addr, "{label}: another address");
        }
        assert_eq!(
            survivor
                .agent
                .fetch_remote_metadata(restarted.addr)
                .unwrap(),
            name
        );
        let loaded = Instant::now();
        let msg = format!("check {SURVIVOR_SEED} 0 {BLOCK}");
        let mut first = survivor.xfer(XferOp::Write, &name, restarted.base, 1, Some(&msg));
        first.post().unwrap();
        first
            .wait(TIMEOUT)
            .unwrap_or_else(|e| panic!("{label}: the first WRITE to the restarted peer: {e}"));
        let reconnect = loaded.elapsed();
        drop(first);
        let seen = verdict(&mut restarted, &msg);
        assert!(seen.starts_with("OK"), "{label}: {seen}");
        // A READ of what the new incarnation holds (its own seed) past what was written.
        survivor.dst.fill(0);
        let mut read = survivor.xfer(XferOp::Read, &name, restarted.base + BLOCK as u64, 1, None);
        read.post().unwrap();
        read.wait(TIMEOUT).unwrap();
        drop(read);
        assert!(
            survivor.dst[..BLOCK] == filled(BLOCK, incarnation, BLOCK)[..],
            "{label}: READ from the restarted peer"
        );
        println!(
            "{label}: restarted peer reached {:.1} ms after its metadata was loaded",
            reconnect.as_secs_f64() * 1e3,
        );
        assert!(
            reconnect < RECONNECT_BOUND,
            "{label}: reached again only after {reconnect:?} (bound {RECONNECT_BOUND:?})"
        );

        let after = Resources::now();
        assert!(
            after.fds <= before.fds + FD_SLACK && after.threads <= before.threads + THREAD_SLACK,
            "{label}: leaked: before {before:?}, after {after:?}"
        );
        let traces = shm_traces_of(dead_pid);
        assert!(
            traces.is_empty(),
            "{label}: the dead incarnation left {traces:?}"
        );
        peer = restarted;
    }

    stop.store(true, Ordering::Relaxed);
    let report = bystander_thread.join().unwrap();
    println!(
        "{}: bystander {} rounds, longest {:?}",
        t.tag, report.rounds, report.longest
    );
    assert!(report.failure.is_none(), "{}: bystander: {report:?}", t.tag);
    assert!(report.rounds > 0, "{}: the bystander never ran", t.tag);
    assert!(
        report.longest < BYSTANDER_BOUND,
        "{}: a bystander round took {:?}",
        t.tag,
        report.longest
    );
}

#[test]
fn restart_over_tcp_rxm() {
    restart_row(transport("tcp_rxm"));
}

#[test]
fn restart_over_tcp_rxm_with_four_rails() {
    restart_row(transport("tcp_rxm_4rails"));
}

#[test]
fn restart_over_tcp() {
    restart_row(transport("tcp"));
}

#[test]
fn restart_over_sockets() {
    restart_row(transport("sockets"));
}

#[test]
fn restart_over_shm() {
    restart_row(transport("shm"));
}

#[test]
fn restart_over_shm_with_two_rails_and_provider_copies() {
    restart_row(transport("shm_2rails_provider_copies"));
}

/// Default parameters: the network provider, and the shm plane for a peer on this host.
#[test]
fn restart_with_default_parameters() {
    restart_row(transport("default"));
}

/// Every row has its test above.
#[test]
fn every_row_has_a_test() {
    let source = include_str!("restart_matrix.rs");
    for t in TRANSPORTS {
        assert!(
            source.contains(&format!("transport(\"{}\")", t.tag)),
            "row `{}` has no test",
            t.tag
        );
    }
}
