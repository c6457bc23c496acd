#![cfg(feature = "verbs")]
//! Peers come and go (issue 27), the two-host VERBS cells of the fault matrix: the link
//! cut and restored. Runs in guest `a` of the two-guest suite of `cargo xtask test`
//! (`--two-guests-only`; each guest has its own `rxe0` on its own NIC, joined by an
//! Ethernet link; see `common::peer_guest`), the target in guest `b`. Outside that suite
//! the test prints why it skips.
//!
//! Each case of [`CASES`]: the survivor (this process) WRITEs to the target across the
//! link, the link of guest `b` is cut in the middle of a WRITE, and the WRITE must end
//! in `RemoteDisconnect` naming the target within [`BOUND`] (no FIN or RST comes over a
//! cut link: the heartbeats tell). Then the link is restored and
//! - `SameProcess`: the target, which ran on through the cut, is loaded again (its
//!   metadata fetched anew across the link);
//! - `Restarted`: the target was killed while the link was down and starts again under
//!   the same name (a new process: new queue pairs, new keys), whose metadata is loaded;
//!
//! and it must be reached within [`BOUND`] of the load: a one-block WRITE with a
//! notification, whose data the target checks at the notification (the first one it
//! sees: nothing of the WRITE cut off may arrive there), then the whole 1 MiB WRITE,
//! checked the same way, then a READ of what it holds, verified here. No
//! file descriptor, thread or pinned memory of the lost connection may stay in the
//! survivor (`common::restart::Held`).

mod common;

use common::peer_guest::{wait_shared_file, GuestProcess, PeerGuest};
use common::restart::{answer_check, Held};
use common::{dram, pattern, rdma_device, serial, TIMEOUT};
use nixl::{params, Agent, AgentConfig, Desc, Error, XferOp, XferReq, XferStatus};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Bound on `RemoteDisconnect` after the cut and on reaching the target after its
/// metadata was loaded again (the goals are the heartbeat bound and 1 s; soft-RoCE under
/// TCG is slow, the real figures are printed).
const BOUND: Duration = Duration::from_secs(5);
/// The heartbeat bound these agents run with (`heartbeat_ms` 100, `heartbeat_misses` 10).
const HEARTBEAT_BOUND: Duration = Duration::from_secs(1);
/// What a starved watcher in a TCG guest may add to it (the figures are printed).
const HEARTBEAT_SLACK: Duration = Duration::from_secs(2);
/// 1 MiB as 64 KiB descriptors (soft-RoCE under TCG moves a few MB/s between guests).
const LEN: usize = 1 << 20;
const BLOCK: usize = 64 << 10;
const TARGET: &str = "rxe2-restart-target";
const SURVIVOR: &str = "rxe2-restart-survivor";
const SURVIVOR_SEED: u8 = 0x6d;

/// What happens to the target while its link is down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    /// Nothing: it runs on, and is loaded again once the link is back.
    SameProcess,
    /// Killed while the link is down; a new incarnation starts once it is back.
    Restarted,
}

const CASES: &[Case] = &[Case::SameProcess, Case::Restarted];

fn verbs_agent(name: &str, device: &str, addr: &str) -> Agent {
    let config = AgentConfig {
        listen_addr: Some(format!("{addr}:0").parse().unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    // Heartbeats that tolerate 1 s of silence (the library's default is 0.5 s: two TCG
    // guests on a loaded host starve a sender for longer); the cut is then told within
    // about a second, inside the bound.
    agent
        .create_backend(
            "VERBS",
            &params([("device", device), ("heartbeat_misses", "10")]),
        )
        .unwrap_or_else(|e| panic!("VERBS on {device}: {e}"));
    agent
}

/// The target, in guest `b`: `2 × LEN` bytes of its incarnation's pattern (the first
/// half written by the survivor, the second half read by it); answers each notification
/// `check <offset> <len>` by comparing that range with the survivor's pattern, writing
/// the verdict to `<announce>.ok` (bad, whatever the data, once any other notification
/// arrived: one of a WRITE cut off by the link); serves until killed (bounded).
#[test]
#[ignore = "target process of the two-guest restart tests (runs in guest b)"]
fn rxe2_restart_target_process() {
    let announce = std::env::var("NIXL_RXE2_RESTART_FILE").expect("run by a two-guest test");
    let seed: u8 = std::env::var("NIXL_RXE2_RESTART_SEED")
        .expect("run by a two-guest test")
        .parse()
        .unwrap();
    let dev = rdma_device().expect("RDMA_TEST_DEVICE is inherited");
    let addr = std::env::var("RXE_ADDR").expect("guest b's address");
    let agent = verbs_agent(TARGET, &dev, &addr);
    let buf = pattern(seed, 2 * LEN);
    // SAFETY: `buf` outlives the handle (both live until the process ends).
    let _h = unsafe { agent.register_mem(&dram([Desc::from_slice(&buf)]), None) }.unwrap();
    common::announce_agent(&announce, &agent, buf.as_ptr() as u64);
    let expected = pattern(SURVIVOR_SEED, LEN);
    let mut misdirected: Option<String> = None;
    let deadline = Instant::now() + 4 * TIMEOUT;
    while Instant::now() < deadline {
        for (from, msgs) in agent.wait_notifs(Duration::from_millis(20)) {
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg).to_string();
                let Some(args) = text.strip_prefix("check ") else {
                    misdirected.get_or_insert(format!("`{text}` from {from}"));
                    continue;
                };
                let n: Vec<usize> = args.split(' ').map(|a| a.parse().unwrap()).collect();
                let (offset, len) = (n[0], n[1]);
                let data_ok = buf[offset..offset + len] == expected[offset..offset + len];
                answer_check(&announce, &misdirected, data_ok, &text);
            }
        }
    }
}

/// A target incarnation running in guest `b`.
struct Target {
    process: GuestProcess,
    addr: std::net::SocketAddr,
    base: u64,
    announce: PathBuf,
}

impl Target {
    /// Starts incarnation `seed` in guest `b` and waits for its announcement.
    fn start(peer: &PeerGuest, seed: u8) -> Self {
        let announce = peer.shared(&format!("nixl-rxe2-restart-{seed}"));
        for suffix in ["", ".tmp", ".ok", ".ok.tmp"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", announce.display()));
        }
        let exe = std::env::current_exe().unwrap();
        let process = peer.spawn(
            &[
                exe.to_str().unwrap(),
                "--exact",
                "rxe2_restart_target_process",
                "--ignored",
                "--test-threads=1",
            ],
            &[
                ("NIXL_RXE2_RESTART_FILE", announce.to_str().unwrap()),
                ("NIXL_RXE2_RESTART_SEED", &seed.to_string()),
            ],
        );
        let text = wait_shared_file(&announce, &process, 2 * TIMEOUT);
        let (addr, base) = text.split_once(' ').unwrap();
        let addr: std::net::SocketAddr = addr.parse().unwrap();
        assert_eq!(
            addr.ip().to_string(),
            peer.peer_addr,
            "the target is in guest b"
        );
        Target {
            process,
            addr,
            base: base.parse().unwrap(),
            announce,
        }
    }

    /// The target's verdict on notification `msg` (bounded).
    fn verdict(&self, msg: &str) -> String {
        let ok = PathBuf::from(format!("{}.ok", self.announce.display()));
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Ok(text) = std::fs::read_to_string(&ok) {
                if text.ends_with(msg) {
                    return text;
                }
            }
            assert!(
                self.process.try_status().is_none(),
                "the target exited; its output:\n{}",
                self.process.output()
            );
            assert!(Instant::now() < deadline, "no verdict on `{msg}`");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A transfer of the first `len` bytes (whole `BLOCK`s) at `local` and `remote`.
fn transfer(
    agent: &Agent,
    op: XferOp,
    (local, remote, len): (u64, u64, usize),
    notif: Option<&str>,
) -> XferReq {
    let n = len / BLOCK;
    let blocks =
        |base: u64| dram((0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, 0)));
    agent
        .create_xfer_req(
            op,
            &blocks(local),
            &blocks(remote),
            TARGET,
            notif.map(|m| m.as_bytes().to_vec()),
        )
        .unwrap()
}

/// Polls `req` (reposting whenever it completes) until it fails; the error and when.
fn until_failed(req: &mut XferReq, since: Instant, label: &str) -> (Error, Duration) {
    loop {
        let outcome = match req.status() {
            Ok(XferStatus::Done) => req.post().map(|_| ()),
            Ok(XferStatus::InProgress) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            return (e, since.elapsed());
        }
        assert!(
            since.elapsed() < 2 * TIMEOUT,
            "{label}: the cut link was never noticed: hang"
        );
        std::thread::sleep(Duration::from_micros(500));
    }
}

#[test]
fn link_cut_and_restored_target_is_reached_again() {
    let Some(dev) = rdma_device() else { return };
    let Some(peer) = PeerGuest::get() else { return };
    let _s = serial();
    common::init_tracing();
    let survivor = verbs_agent(SURVIVOR, &dev, &peer.addr);
    let src = pattern(SURVIVOR_SEED, LEN);
    let mut dst = vec![0u8; LEN];
    // SAFETY: both buffers outlive the handle and every request (dropped first).
    let _h = unsafe {
        survivor.register_mem(
            &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
            None,
        )
    }
    .unwrap();
    let mut incarnation = 1u8;
    let mut target = Target::start(&peer, incarnation);
    assert_eq!(survivor.fetch_remote_metadata(target.addr).unwrap(), TARGET);
    for &case in CASES {
        let label = format!("VERBS across the link, cut and restored, {case:?}");
        let mut warm = transfer(
            &survivor,
            XferOp::Write,
            (src.as_ptr() as u64, target.base, LEN),
            None,
        );
        warm.post().unwrap();
        warm.wait(TIMEOUT).unwrap();
        let before = Held::now();

        warm.post().unwrap();
        // The link goes down somewhere between the order and guest b's word that it ran
        // `ip link set eth0 down` (under TCG, hundreds of milliseconds of polling, forks
        // and execs apart): detection is told from both ends of that window.
        let cut_at = Instant::now();
        let cut = peer.cut_link();
        let cut_took = cut_at.elapsed();
        let (error, detected) = until_failed(&mut warm, cut_at, &label);
        println!(
            "{label}: {detected:.2?} after the cut was ordered, {:.2?} after guest b said \
             it was done ({cut_took:.2?} apart): {error}",
            detected.saturating_sub(cut_took)
        );
        match &error {
            Error::RemoteDisconnect { agent, .. } => assert_eq!(agent, TARGET, "{label}"),
            other => panic!("{label}: expected RemoteDisconnect, got {other:?}"),
        }
        assert!(
            detected < BOUND,
            "{label}: RemoteDisconnect after {detected:?} (bound {BOUND:?})"
        );
        // The link was down by the time guest b said so, and the last heartbeat heard
        // came before the cut: the heartbeat bound runs from no later than that.
        assert!(
            detected.saturating_sub(cut_took) < HEARTBEAT_BOUND + HEARTBEAT_SLACK,
            "{label}: RemoteDisconnect {:?} after the link was down (heartbeat bound \
             {HEARTBEAT_BOUND:?})",
            detected.saturating_sub(cut_took)
        );
        drop(warm);
        if case == Case::Restarted {
            target.process.kill();
            let deadline = Instant::now() + TIMEOUT;
            while target.process.try_status().is_none() {
                assert!(Instant::now() < deadline, "{label}: the target did not die");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        drop(cut);
        let restored = Instant::now();
        if case == Case::Restarted {
            incarnation += 1;
            target = Target::start(&peer, incarnation);
        }

        // Loaded again: the metadata fetched anew across the restored link.
        survivor.invalidate_remote(TARGET).unwrap();
        let fetched = loop {
            match survivor.fetch_remote_metadata(target.addr) {
                Ok(name) => break name,
                // The link may take a moment to carry traffic again.
                Err(e) if restored.elapsed() < TIMEOUT => {
                    println!("{label}: fetch after the restore: {e}; again");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("{label}: no fetch after the restore: {e}"),
            }
        };
        assert_eq!(fetched, TARGET);
        let loaded = Instant::now();
        // Reached: one block WRITTEN (with its notification, checked below). The whole
        // 1 MiB takes up to a second to cross the emulated link by itself.
        let reach_msg = format!("check 0 {BLOCK}");
        let mut first = transfer(
            &survivor,
            XferOp::Write,
            (src.as_ptr() as u64, target.base, BLOCK),
            Some(&reach_msg),
        );
        first.post().unwrap();
        first
            .wait(TIMEOUT)
            .unwrap_or_else(|e| panic!("{label}: the first WRITE after the restore: {e}"));
        let reached = loaded.elapsed();
        drop(first);
        let seen = target.verdict(&reach_msg);
        assert!(seen.starts_with("OK"), "{label}: {seen}");
        let whole_at = Instant::now();
        let msg = format!("check 0 {LEN}");
        let mut whole = transfer(
            &survivor,
            XferOp::Write,
            (src.as_ptr() as u64, target.base, LEN),
            Some(&msg),
        );
        whole.post().unwrap();
        whole
            .wait(TIMEOUT)
            .unwrap_or_else(|e| panic!("{label}: the 1 MiB WRITE after the restore: {e}"));
        let whole_took = whole_at.elapsed();
        drop(whole);
        let seen = target.verdict(&msg);
        assert!(seen.starts_with("OK"), "{label}: {seen}");
        dst.fill(0);
        let mut read = transfer(
            &survivor,
            XferOp::Read,
            (dst.as_mut_ptr() as u64, target.base + LEN as u64, LEN),
            None,
        );
        read.post().unwrap();
        read.wait(TIMEOUT).unwrap();
        drop(read);
        assert!(
            dst[..] == pattern(incarnation, 2 * LEN)[LEN..],
            "{label}: READ after the restore"
        );
        println!(
            "{label}: reached (a {BLOCK}-byte notified WRITE) {reached:.2?} after its \
             metadata was loaded (the load {:.2?} after the link came back); the 1 MiB \
             WRITE then took {whole_took:.2?}",
            loaded - restored
        );
        assert!(
            reached < BOUND,
            "{label}: reached only after {reached:?} (bound {BOUND:?})"
        );
        let after = Held::now();
        if let Some(leak) = after.leaked_since(&before) {
            panic!("{label}: the lost connection left something: {leak}");
        }
    }
}
