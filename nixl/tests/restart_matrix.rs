#![cfg(feature = "libfabric")]
//! Peers come and go (issue 27): the fault matrix, one row per transport.
//!
//! For each transport of [`TRANSPORTS`] a survivor agent in this process moves data to a
//! peer process that is SIGKILLed, for each fault of [`FAULTS`] — in the middle of
//! 16 MiB WRITEs, in the middle of 16 MiB READs, and while idle — and then started again
//! under the same agent name (a new process: new port, new endpoints, new keys), whose
//! metadata the survivor fetches. Each case asserts:
//! - the transfer to the dead peer fails with `RemoteDisconnect` naming it within
//!   [`DETECTION_BOUND`];
//! - the restarted peer is reached within [`RECONNECT_BOUND`] of its metadata being
//!   loaded: a 16 MiB WRITE with a notification, whose data and notification the peer
//!   checks, then a 16 MiB READ of what the peer holds;
//! - a second peer process (the bystander) that the survivor WRITEs to and READs back
//!   from, round after round, on its own thread, through the whole row, never fails,
//!   never sees corrupted bytes and never waits longer than [`BYSTANDER_BOUND`];
//! - nothing of the dead incarnation is left: the survivor's file descriptors and threads
//!   are as many as before the kill (a small slack, [`FD_SLACK`] and [`THREAD_SLACK`], for
//!   what the provider opens lazily), and no `/dev/shm` file or mapping names its pid.
//!
//! The figures (detection and reconnect times) are printed per case. A later transport
//! is a new row of [`TRANSPORTS`] (or a new table with its own peer setup); a later
//! fault a new entry of [`FAULTS`].

mod common;

use common::{announce, announce_path, dram, wait_file, PeerProcess, TIMEOUT};
use nixl::{params, Agent, AgentConfig, BackendParams, Desc, Error, XferOp, XferReq, XferStatus};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A dead peer must be reported within this (the goal is 100 ms on one host; the bound
/// leaves room for a loaded 2-core machine).
const DETECTION_BOUND: Duration = Duration::from_secs(2);
/// A restarted peer must be reached within this of its metadata being loaded (the goal
/// is 1 s; the transfer that proves it moves 16 MiB).
const RECONNECT_BOUND: Duration = Duration::from_secs(2);
/// The longest round (a 1 MiB WRITE and its READ back) the bystander may take.
const BYSTANDER_BOUND: Duration = Duration::from_secs(2);
/// File descriptors and threads the survivor may hold more after a case than before it.
const FD_SLACK: usize = 2;
const THREAD_SLACK: usize = 1;

/// The size of each block moved: what the issue measured with.
const BLOCK: usize = 16 << 20;
/// Blocks per transfer, and the peer's buffer.
const BLOCKS: usize = 4;
const PEER_LEN: usize = BLOCK * BLOCKS;
const BYSTANDER_LEN: usize = 1 << 20;

/// One row of the matrix: a LIBFABRIC provider, and how both sides open it.
struct Transport {
    /// Names the row (and the agents: no two rows share a peer name).
    tag: &'static str,
    params: &'static [(&'static str, &'static str)],
}

/// The rows. Same-host peers go over the named provider itself (`local_provider=none`),
/// not the shm plane that a default backend would pick for them.
const TRANSPORTS: &[Transport] = &[
    Transport {
        tag: "tcp_rxm",
        params: &[("provider", "tcp;ofi_rxm"), ("local_provider", "none")],
    },
    Transport {
        tag: "tcp",
        params: &[("provider", "tcp"), ("local_provider", "none")],
    },
    Transport {
        tag: "sockets",
        params: &[("provider", "sockets"), ("local_provider", "none")],
    },
    Transport {
        tag: "shm",
        params: &[("provider", "shm")],
    },
];

/// How the peer dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGKILL while 16 MiB WRITEs to it are in flight.
    KilledMidWrite,
    /// SIGKILL while 16 MiB READs from it are in flight.
    KilledMidRead,
    /// SIGKILL while nothing moves; then a WRITE is posted to it.
    KilledIdle,
}

const FAULTS: &[Fault] = &[Fault::KilledMidWrite, Fault::KilledMidRead, Fault::KilledIdle];

fn transport(tag: &str) -> &'static Transport {
    TRANSPORTS
        .iter()
        .find(|t| t.tag == tag)
        .unwrap_or_else(|| panic!("no transport `{tag}`"))
}

fn backend_params(t: &Transport) -> BackendParams {
    let mut p = params(t.params.iter().copied());
    if let Ok(rails) = std::env::var("NIXL_RESTART_RAILS") {
        p.insert("num_rails".into(), rails);
    }
    p
}

/// What every peer's buffer holds (and what the survivor writes): 8-byte words that
/// differ at every offset and between seeds; cheap to make in a debug build.
fn fill(buf: &mut [u8], seed: u64, offset: usize) {
    for (i, word) in buf.chunks_exact_mut(8).enumerate() {
        let at = (offset / 8 + i) as u64;
        let value = at.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xff51_afd7);
        word.copy_from_slice(&value.to_le_bytes());
    }
}

fn filled(len: usize, seed: u64, offset: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed, offset);
    v
}

// ---- the peer process -----------------------------------------------------------------------

/// The peer process: runs only when re-executed with `NIXL_RESTART_PEER` (see
/// [`spawn_peer`]). Holds [`PEER_LEN`] bytes of its seed's pattern, and answers each
/// notification `check <seed> <offset> <len>` by comparing that range with the seed's
/// pattern and writing the verdict to `<announce>.ok`. Ends with its parent, or after
/// [`TIMEOUT`]s of running at most several times over.
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
    let peer = Agent::new(name, common::listening()).unwrap();
    peer.create_backend("LIBFABRIC", &backend_params(transport(&tag)))
        .unwrap();
    let buf = filled(PEER_LEN, seed, 0);
    // SAFETY: `buf` lives until the process ends.
    let _h = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    common::announce_agent(&announce_at, &peer, buf.as_ptr() as u64);
    let deadline = Instant::now() + 5 * TIMEOUT;
    while Instant::now() < deadline {
        for (_, msgs) in peer.wait_notifs(Duration::from_millis(20)) {
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg).to_string();
                let Some(args) = text.strip_prefix("check ") else {
                    continue;
                };
                let n: Vec<usize> = args.split(' ').map(|a| a.parse().unwrap()).collect();
                let (seed, offset, len) = (n[0] as u64, n[1], n[2]);
                let good = buf[offset..offset + len] == filled(len, seed, offset)[..];
                let verdict = if good { "OK" } else { "BAD DATA" };
                announce(format!("{announce_at}.ok"), &format!("{verdict} {text}"));
            }
        }
    }
}

/// A copy of this binary running [`restart_peer_main`] as agent `name` over `t`.
fn spawn_peer(t: &Transport, name: &str, incarnation: u64) -> PeerProcess {
    let announce_at = announce_path("nixl-restart", &format!("{name}-{incarnation}"));
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "restart_peer_main", "--test-threads=1"])
        .stdout(Stdio::null())
        .env("NIXL_RESTART_PEER", &announce_at)
        .env("NIXL_RESTART_TRANSPORT", t.tag)
        .env("NIXL_RESTART_NAME", name)
        .env("NIXL_RESTART_SEED", incarnation.to_string());
    PeerProcess::spawn(cmd, announce_at)
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
/// `nixl-<pid namespace>-<pid>-<nonce>:...`, or `<pid>:...` by default), and this
/// process's mappings of such regions that still hold memory: the provider never unmaps
/// a departed peer, so the backend empties a dead peer's regions instead (a page or two
/// the provider touches again may come back).
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
            let kib: u64 = rss.trim().trim_end_matches(" kB").trim().parse().unwrap();
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

/// Rounds of a 1 MiB WRITE to `peer` and a READ back, each verified, until `stop`.
fn bystander(agent: Agent, peer: String, base: u64, stop: Arc<AtomicBool>) -> BystanderReport {
    let mut src = vec![0u8; BYSTANDER_LEN];
    let mut back = vec![0u8; BYSTANDER_LEN];
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
    let mut report = BystanderReport {
        rounds: 0,
        longest: Duration::ZERO,
        failure: None,
    };
    let mut run = |op: XferOp, local: &[u8]| -> nixl::Result<()> {
        let mut req =
            agent.create_xfer_req(op, &dram([Desc::from_slice(local)]), &remote, &peer, None)?;
        req.post()?;
        req.wait(TIMEOUT)
    };
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        fill(&mut src, 1000 + report.rounds, 0);
        let outcome = run(XferOp::Write, &src).and_then(|_| run(XferOp::Read, &back));
        report.longest = report.longest.max(started.elapsed());
        report.rounds += 1;
        match outcome {
            Err(e) => report.failure = Some(format!("round {}: {e}", report.rounds)),
            Ok(()) if back != src => {
                report.failure = Some(format!("round {}: corrupted bytes", report.rounds))
            }
            Ok(()) => {}
        }
        if report.failure.is_some() {
            break;
        }
    }
    report
}

// ---- the matrix -----------------------------------------------------------------------------

/// Polls `req` until it fails (reposting whenever it completes first, so that the kill
/// lands mid-transfer whatever the timing), for at most [`TIMEOUT`]: the error and the
/// time since `since`.
fn failure_after(req: &mut XferReq, since: Instant) -> (Error, Duration) {
    loop {
        let outcome = match req.status() {
            Ok(XferStatus::Done) => req.post().map(|_| ()),
            Ok(XferStatus::InProgress) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            return (e, since.elapsed());
        }
        assert!(since.elapsed() < TIMEOUT, "the dead peer was never noticed");
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// One row: every fault of [`FAULTS`] against peers over `t`.
fn restart_row(t: &Transport) {
    let _serial = common::serial();
    common::init_tracing();
    let survivor = Agent::new(format!("survivor-{}", t.tag), common::listening()).unwrap();
    survivor
        .create_backend("LIBFABRIC", &backend_params(t))
        .unwrap_or_else(|e| panic!("LIBFABRIC over {}: {e}", t.tag));
    let src = filled(PEER_LEN, 7, 0);
    let mut dst = vec![0u8; PEER_LEN];
    // SAFETY: both outlive the handle and every request of this function.
    let _h = unsafe {
        survivor
            .register_mem(
                &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
                None,
            )
            .unwrap()
    };
    let blocks = |base: u64, n: usize| {
        dram((0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, 0)))
    };

    let bystander_name = format!("bystander-{}", t.tag);
    let bystander_peer = spawn_peer(t, &bystander_name, 0);
    survivor
        .fetch_remote_metadata(bystander_peer.addr)
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let bystander_thread: JoinHandle<BystanderReport> = {
        let (agent, name, base, stop) = (
            survivor.clone(),
            bystander_name.clone(),
            bystander_peer.base,
            stop.clone(),
        );
        std::thread::spawn(move || bystander(agent, name, base, stop))
    };

    let name = format!("restarting-{}", t.tag);
    let mut incarnation = 1;
    let mut peer = spawn_peer(t, &name, incarnation);
    survivor.fetch_remote_metadata(peer.addr).unwrap();
    for &fault in FAULTS {
        let label = format!("{}, {fault:?}", t.tag);
        // The live incarnation is reached (and its connections exist) before counting.
        let mut warm = survivor
            .create_xfer_req(
                XferOp::Write,
                &blocks(src.as_ptr() as u64, 1),
                &blocks(peer.base, 1),
                &name,
                None,
            )
            .unwrap();
        warm.post().unwrap();
        warm.wait(TIMEOUT).unwrap();
        drop(warm);
        let before = Resources::now();

        let (op, local) = match fault {
            Fault::KilledMidRead => (XferOp::Read, dst.as_mut_ptr() as u64),
            _ => (XferOp::Write, src.as_ptr() as u64),
        };
        let mut req = survivor
            .create_xfer_req(
                op,
                &blocks(local, BLOCKS),
                &blocks(peer.base, BLOCKS),
                &name,
                Some(b"doomed".to_vec()),
            )
            .unwrap();
        if fault != Fault::KilledIdle {
            req.post().unwrap();
        }
        let dead_pid = peer.child.id();
        peer.child.kill().unwrap();
        let killed = Instant::now();
        // Posted to once dead: the post itself may already say so.
        let refused = match fault {
            Fault::KilledIdle => {
                peer.child.wait().unwrap();
                req.post().err()
            }
            _ => None,
        };
        let (err, detection) = match refused {
            Some(e) => (e, killed.elapsed()),
            None => failure_after(&mut req, killed),
        };
        match &err {
            Error::RemoteDisconnect { agent, .. } => assert_eq!(agent, &name, "{label}"),
            other => panic!("{label}: expected RemoteDisconnect, got {other:?}"),
        }
        assert!(
            detection < DETECTION_BOUND,
            "{label}: RemoteDisconnect after {detection:?} (bound {DETECTION_BOUND:?})"
        );
        if std::env::var("NIXL_RESTART_KEEP").is_err() {
            drop(req);
        }
        drop(peer);

        // The same name, a new process.
        incarnation += 1;
        let mut restarted = spawn_peer(t, &name, incarnation);
        if std::env::var("NIXL_RESTART_INVALIDATE").is_ok() {
            survivor.invalidate_remote(&name).unwrap();
        }
        assert_eq!(survivor.fetch_remote_metadata(restarted.addr).unwrap(), name);
        let loaded = Instant::now();
        let msg = format!("check 7 0 {BLOCK}");
        let mut first = survivor
            .create_xfer_req(
                XferOp::Write,
                &blocks(src.as_ptr() as u64, 1),
                &blocks(restarted.base, 1),
                &name,
                Some(msg.clone().into_bytes()),
            )
            .unwrap();
        first.post().unwrap();
        if let Err(e) = first.wait(Duration::from_secs(5)) {
            stop.store(true, Ordering::Relaxed);
            let t0 = Instant::now();
            let report = bystander_thread.join().unwrap();
            panic!("{label}: first WRITE: {e}; bystander {report:?} joined after {:?}", t0.elapsed());
        }
        let reconnect = loaded.elapsed();
        drop(first);
        let seen = verdict(&mut restarted, &msg);
        assert!(seen.starts_with("OK"), "{label}: {seen}");
        // A READ of what the new incarnation holds (its own seed) past what was written.
        dst.fill(0);
        let mut read = survivor
            .create_xfer_req(
                XferOp::Read,
                &blocks(dst.as_mut_ptr() as u64, 1),
                &blocks(restarted.base + BLOCK as u64, 1),
                &name,
                None,
            )
            .unwrap();
        read.post().unwrap();
        read.wait(TIMEOUT).unwrap();
        drop(read);
        assert!(
            dst[..BLOCK] == filled(BLOCK, incarnation, BLOCK)[..],
            "{label}: READ from the restarted peer"
        );
        println!(
            "{label}: RemoteDisconnect {:.1} ms after the kill; restarted peer reached {:.1} ms \
             after its metadata was loaded",
            detection.as_secs_f64() * 1e3,
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
    let _ = Path::new("");
}

#[test]
fn restart_over_tcp_rxm() {
    restart_row(transport("tcp_rxm"));
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
