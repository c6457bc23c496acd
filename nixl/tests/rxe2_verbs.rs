#![cfg(feature = "verbs")]
//! VERBS between two hosts: the two-guest suite of `cargo xtask test` (each guest has its
//! own `rxe0` on its own NIC, joined by an Ethernet link with MTU 1500; see
//! `common::peer_guest`). This test runs in guest `a` as the initiator; the target runs
//! in guest `b` (192.0.2.2). Metadata, side channel and RDMA all cross the link.
//!
//! Tested: WRITE and READ with the data verified on both sides, each notification
//! arriving only after its data; and the target's host going away in the middle of a
//! transfer — its link cut (eth0 down in guest `b`) or its whole guest killed (the QEMU
//! process): no FIN or RST comes from a vanished host, so the side channel's EOF says
//! nothing; its heartbeats stop. The `*_within_bound` tests assert what issue 14 asks:
//! the initiator's transfer ends in `RemoteDisconnect` within [`BOUND`], with the default
//! stall timeout (30 s), never a hang. The real figures are printed. Outside the
//! two-guest suite the tests print why they skip.

mod common;

use common::peer_guest::{wait_shared_file, PeerGuest};
use common::{announce_agent, dram, pattern, rdma_device, serial, TIMEOUT};
use nixl::{params, Agent, AgentConfig, Desc, Error, XferOp, XferReq, XferStatus};
use std::time::{Duration, Instant};

/// Bytes moved each way: 1 MiB as 64 KiB descriptors (soft-RoCE under TCG moves a few
/// MB/s between the guests).
const LEN: usize = 1 << 20;
const BLOCK: usize = 64 << 10;
/// Bound on `RemoteDisconnect` after the host went away: the (its goal is 1 s),
/// generous for a loaded 2-core machine. (The RC transport alone, with the backend's
/// default `qp_timeout` of 18 — 1.07 s per try — and 6 retries, would give up after
/// about 7.5 s at best; with heartbeats off (`heartbeat_ms=0`) the link-cut test here
/// still ended in `Stalled` at 30 s. Meeting it takes the heartbeats: 0.5 s of silence.)
const BOUND: Duration = Duration::from_secs(5);
const TARGET: &str = "rxe2-target";
const INITIATOR: &str = "rxe2-initiator";
const SEED_WRITE: u8 = 0x5a;
const SEED_READ: u8 = 0xa5;

fn verbs_agent(name: &str, device: &str, addr: &str) -> Agent {
    let config = AgentConfig {
        listen_addr: Some(format!("{addr}:0").parse().unwrap()),
        ..AgentConfig::default()
    };
    assert!(config.stall_timeout >= Duration::from_secs(30));
    let agent = Agent::new(name, config).unwrap();
    agent
        .create_backend("VERBS", &params([("device", device)]))
        .unwrap_or_else(|e| panic!("VERBS on {device}: {e}"));
    agent
}

/// The target, in guest `b`: a buffer of `2 × LEN` (first half written by the
/// initiator, second half read by it). Mode `data`: checks each notification against
/// the data it follows, then writes its verdict; mode `serve`: serves until killed.
#[test]
#[ignore = "target process of the two-guest tests (runs in guest b)"]
fn rxe2_target_process() {
    let announce = std::env::var("NIXL_RXE2_FILE").expect("run by a two-guest test");
    let mode = std::env::var("NIXL_RXE2_MODE").expect("run by a two-guest test");
    let dev = rdma_device().expect("RDMA_TEST_DEVICE is inherited");
    let addr = std::env::var("RXE_ADDR").expect("guest b's address");
    let agent = verbs_agent(TARGET, &dev, &addr);
    let mut buf = vec![0u8; 2 * LEN];
    buf[LEN..].copy_from_slice(&pattern(SEED_READ, LEN));
    // SAFETY: `buf` outlives the handle (both live until the process ends).
    let _h = unsafe {
        agent
            .register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    announce_agent(&announce, &agent, buf.as_ptr() as u64);
    let deadline = Instant::now() + 2 * TIMEOUT;
    if mode == "serve" {
        while Instant::now() < deadline {
            let _ = agent.get_notifs();
            std::thread::sleep(Duration::from_millis(1));
        }
        return;
    }
    let mut seen = Vec::new();
    while seen.len() < 2 {
        assert!(Instant::now() < deadline, "notifications missing: {seen:?}");
        for msg in agent.get_notifs().remove(INITIATOR).unwrap_or_default() {
            if msg == b"written" {
                assert!(
                    buf[..LEN] == pattern(SEED_WRITE, LEN)[..],
                    "`written` arrived before all of the data"
                );
            }
            seen.push(String::from_utf8_lossy(&msg).into_owned());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(seen, ["written", "read"]);
    common::announce(
        format!("{announce}.ok"),
        "WRITE data and both notifications verified",
    );
}

/// The target started in guest `b` in `mode`, with its metadata fetched over the link by
/// a new initiator agent; (initiator, target process, target buffer base, announce file).
fn connect(
    peer: &PeerGuest,
    dev: &str,
    mode: &str,
) -> (
    Agent,
    common::peer_guest::GuestProcess,
    u64,
    std::path::PathBuf,
) {
    let announce = peer.shared(&format!("nixl-rxe2-target-{mode}"));
    for suffix in ["", ".tmp", ".ok"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", announce.display()));
    }
    let exe = std::env::current_exe().unwrap();
    let target = peer.spawn(
        &[
            exe.to_str().unwrap(),
            "--exact",
            "rxe2_target_process",
            "--ignored",
            "--test-threads=1",
        ],
        &[
            ("NIXL_RXE2_FILE", announce.to_str().unwrap()),
            ("NIXL_RXE2_MODE", mode),
        ],
    );
    let text = wait_shared_file(&announce, &target, 2 * TIMEOUT);
    let (addr, base) = text.split_once(' ').unwrap();
    let addr: std::net::SocketAddr = addr.parse().unwrap();
    assert_eq!(
        addr.ip().to_string(),
        peer.peer_addr,
        "the target is in guest b"
    );
    let initiator = verbs_agent(INITIATOR, dev, &peer.addr);
    let t = Instant::now();
    assert_eq!(initiator.fetch_remote_metadata(addr).unwrap(), TARGET);
    println!(
        "{mode}: metadata fetched and QPs connected over the link in {:.2?}",
        t.elapsed()
    );
    (initiator, target, base.parse().unwrap(), announce)
}

fn transfer(agent: &Agent, op: XferOp, local: u64, remote: u64, notif: &[u8]) -> XferReq {
    let n = LEN / BLOCK;
    let blocks =
        |base: u64| dram((0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, 0)));
    agent
        .create_xfer_req(
            op,
            &blocks(local),
            &blocks(remote),
            TARGET,
            Some(notif.to_vec()),
        )
        .unwrap()
}

#[test]
fn write_read_across_the_link() {
    let Some(dev) = rdma_device() else { return };
    let Some(peer) = PeerGuest::get() else { return };
    let _s = serial();
    let (initiator, target, base, announce) = connect(&peer, &dev, "data");
    let src = pattern(SEED_WRITE, LEN);
    let mut back = vec![0u8; LEN];
    // SAFETY: both buffers outlive the handle and every request (dropped first).
    let _h = unsafe {
        initiator
            .register_mem(
                &dram([Desc::from_slice(&src), Desc::from_slice(&back)]),
                None,
            )
            .unwrap()
    };
    let mut write = transfer(
        &initiator,
        XferOp::Write,
        src.as_ptr() as u64,
        base,
        b"written",
    );
    let t = Instant::now();
    write.post().unwrap();
    write.wait(TIMEOUT).unwrap();
    let write_took = t.elapsed();
    let mut read = transfer(
        &initiator,
        XferOp::Read,
        back.as_mut_ptr() as u64,
        base + LEN as u64,
        b"read",
    );
    let t = Instant::now();
    read.post().unwrap();
    read.wait(TIMEOUT).unwrap();
    let read_took = t.elapsed();
    drop((write, read));
    assert!(
        back == pattern(SEED_READ, LEN),
        "READ brought the wrong bytes"
    );
    let (status, output) = target.wait(TIMEOUT);
    assert_eq!(status, 0, "the target failed:\n{output}");
    let verdict = std::fs::read_to_string(format!("{}.ok", announce.display())).unwrap();
    println!(
        "VERBS across the link: WRITE 1 MiB {write_took:.2?}, READ {read_took:.2?}; target: {verdict}"
    );
}

/// How the target's host goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gone {
    /// Guest `b`'s link cut (restored at the end of the test).
    LinkCut,
    /// Guest `b`'s QEMU killed (a fresh guest `b` boots for the next tests).
    GuestKilled,
}

/// The target serves in guest `b`; a WRITE completes, a second one is posted, and the
/// target's host goes away as `how` says. Returns the error and its delay from the order.
fn host_goes_away(label: &str, how: Gone) -> Option<(Error, Duration)> {
    let dev = rdma_device()?;
    let peer = PeerGuest::get()?;
    let _s = serial();
    let (initiator, _target, base, _) = connect(&peer, &dev, "serve");
    let src = pattern(SEED_WRITE, LEN);
    // SAFETY: `src` outlives the handle and the request.
    let _h = unsafe {
        initiator
            .register_mem(&dram([Desc::from_slice(&src)]), None)
            .unwrap()
    };
    let mut write = transfer(
        &initiator,
        XferOp::Write,
        src.as_ptr() as u64,
        base,
        b"written",
    );
    write.post().unwrap();
    write.wait(TIMEOUT).unwrap();
    write.post().unwrap();
    let since = Instant::now();
    let _cut = match how {
        Gone::LinkCut => Some(peer.cut_link()),
        Gone::GuestKilled => {
            peer.kill_guest();
            None
        }
    };
    let ordered = since.elapsed();
    let err = loop {
        let outcome = match write.status() {
            Ok(XferStatus::Done) => write.post().map(|_| ()),
            Ok(XferStatus::InProgress) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            break e;
        }
        assert!(
            since.elapsed() < 2 * TIMEOUT,
            "{label}: the vanished host was never noticed: hang"
        );
        std::thread::sleep(Duration::from_micros(500));
    };
    let took = since.elapsed();
    println!(
        "VERBS, {label}: {took:.2?} after the order (carried out within {ordered:.2?}) -> {err}"
    );
    Some((err, took))
}

/// What the issue asks: `RemoteDisconnect` within [`BOUND`], well before the stall
/// timeout.
fn assert_remote_disconnect(label: &str, outcome: Option<(Error, Duration)>) {
    let Some((err, took)) = outcome else { return };
    match err {
        Error::RemoteDisconnect { agent, .. } => assert_eq!(agent, TARGET),
        other => panic!("{label}: expected RemoteDisconnect, got {other:?}"),
    }
    assert!(
        took < BOUND,
        "{label}: RemoteDisconnect after {took:?} (bound {BOUND:?})"
    );
}

const LINK_CUT: &str = "the target's link cut mid-transfer";
const GUEST_KILLED: &str = "the target's whole guest killed mid-transfer";

#[test]
fn link_cut_is_remote_disconnect_within_bound() {
    assert_remote_disconnect(LINK_CUT, host_goes_away(LINK_CUT, Gone::LinkCut));
}

#[test]
fn guest_killed_is_remote_disconnect_within_bound() {
    assert_remote_disconnect(
        GUEST_KILLED,
        host_goes_away(GUEST_KILLED, Gone::GuestKilled),
    );
}
