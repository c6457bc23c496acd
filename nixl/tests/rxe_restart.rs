#![cfg(feature = "verbs")]
//! Peers come and go (issue 27), the VERBS row of the fault matrix, over soft-RoCE
//! (`RDMA_TEST_DEVICE`, in the guest of `cargo xtask test`; on the host the test prints
//! why it skips).
//!
//! A survivor agent in this process moves data to a peer process that is SIGKILLed once
//! per fault of [`FAULTS`] (see `common::restart::Fault`) — in the middle of 4 MiB
//! WRITEs, in the middle of 4 MiB READs, while idle (then posted to), by itself right
//! after a WRITE's data landed and before it took the notification, and while the
//! survivor fetches its metadata (then its stale metadata is loaded again) — and started
//! again under the same agent name (a new process: new queue pairs, new memory keys),
//! whose metadata the survivor fetches. Each case asserts:
//! - the typed error (`RemoteDisconnect` naming the peer) within [`BOUND`];
//! - the restarted peer reached within [`BOUND`] of its metadata being loaded: a WRITE
//!   with a notification whose data the peer checks at the notification (and which must
//!   be the first notification it sees: none meant for the dead incarnation), then a
//!   READ of what the peer holds, verified here;
//! - a second peer process (the bystander), which the survivor WRITEs to and READs back
//!   from on a thread of its own through the whole row, never fails, never returns a
//!   wrong byte, and never takes [`BOUND`] a round;
//! - no file descriptor, thread or pinned memory (`VmPin`: memory registered with the
//!   device) of the dead incarnation left in the survivor (counted before the kill and
//!   after the case; `common::restart::Held`).
//!
//! The figures are printed.

mod common;

use common::restart::{
    announce_metadata, answer_check, blocks_end_with, die_once_landed, kill_during, metadata_of,
    stale_metadata_is_refused_or_fails, verdict, Bystander, Fault, Held,
};
use common::{announce_agent, announce_path, dram, rdma_device, self_test, serial, PeerProcess};
use nixl::{params, Agent, AgentConfig, Desc, XferOp};
use std::time::{Duration, Instant};

/// The bound on detection, on reconnection and on a bystander's round (the goals are
/// 100 ms and 1 s; the guest is software-emulated, the figures printed are the real
/// ones).
const BOUND: Duration = Duration::from_secs(5);
/// Bound on anything that should have finished long ago.
const LONG: Duration = Duration::from_secs(120);
const BLOCK: usize = 1 << 20;
const BLOCKS: usize = 4;
const PEER_LEN: usize = BLOCK * BLOCKS;
/// What the bystander moves each way per round.
const BYSTANDER_LEN: usize = 256 << 10;
const PEER_NAME: &str = "restarting-verbs-peer";
const BYSTANDER_NAME: &str = "bystander-verbs-peer";
const SURVIVOR_SEED: u8 = 0x3c;
/// The bystander's incarnation (its buffer's seed); the restarting peer's count from 1.
const BYSTANDER_SEED: u8 = 0xb0;

const FAULTS: &[Fault] = &[
    Fault::MidWrite,
    Fault::MidRead,
    Fault::Idle,
    Fault::AfterData,
    Fault::DuringMetadata,
];

fn verbs_agent(name: &str, device: &str) -> Agent {
    let config = AgentConfig {
        listen_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    // The library's heartbeats (100 ms x 5). Under TCG on a loaded host a live bystander
    // was declared dead after 644 ms with them, and after 1 s with 10 misses, before a
    // same-host peer that still runs was judged by 20 times that bound (its death is
    // told through the OS and its side channel).
    agent
        .create_backend("VERBS", &params([("device", device)]))
        .unwrap_or_else(|e| panic!("VERBS on {device}: {e}"));
    agent
}

/// The peer process, run only by the test below (with `--ignored`): agent
/// `NIXL_RESTART_VERBS_NAME` holding [`PEER_LEN`] bytes of its incarnation's pattern,
/// its metadata blob at `<announce>.md`; answers each notification `check <offset>
/// <len>` by comparing that range with the survivor's pattern, writing the verdict to
/// `<announce>.ok` (bad, whatever the data, once any other notification arrived);
/// serves until killed (bounded). With `NIXL_RESTART_VERBS_DIE_AFTER_DATA` set it
/// SIGKILLs itself as soon as the last word of every block holds the survivor's pattern
/// (a WRITE's data has landed), taking no notification.
#[test]
#[ignore = "peer process of the VERBS restart test"]
fn restarting_verbs_peer_process() {
    let announce_at = std::env::var("NIXL_RESTART_VERBS_PEER").expect("run by the test");
    let name = std::env::var("NIXL_RESTART_VERBS_NAME").expect("run by the test");
    let seed: u8 = std::env::var("NIXL_RESTART_VERBS_SEED")
        .unwrap()
        .parse()
        .unwrap();
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number; no memory is passed.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let dev = rdma_device().expect("RDMA_TEST_DEVICE is inherited");
    let peer = verbs_agent(&name, &dev);
    let buf = common::pattern(seed, PEER_LEN);
    // SAFETY: `buf` lives until the process ends.
    let _h = unsafe { peer.register_mem(&dram([Desc::from_slice(&buf)]), None) }.unwrap();
    announce_metadata(&announce_at, &peer);
    announce_agent(&announce_at, &peer, buf.as_ptr() as u64);
    let expected = common::pattern(SURVIVOR_SEED, PEER_LEN);
    if std::env::var_os("NIXL_RESTART_VERBS_DIE_AFTER_DATA").is_some() {
        die_once_landed(
            &peer,
            // SAFETY: `buf` holds PEER_LEN = BLOCKS * BLOCK bytes and lives on.
            || unsafe { blocks_end_with(buf.as_ptr(), BLOCK, BLOCKS, &expected) },
            // Not finer: in the TCG guest a 20 µs poll loop starved both vCPUs, and the
            // survivor's heartbeat thread with them (a 4 MiB WRITE takes a second there).
            Duration::from_millis(1),
        );
    }
    let mut misdirected: Option<String> = None;
    let deadline = Instant::now() + LONG;
    while Instant::now() < deadline {
        for (from, msgs) in peer.wait_notifs(Duration::from_millis(20)) {
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg).to_string();
                let Some(args) = text.strip_prefix("check ") else {
                    misdirected.get_or_insert(format!("`{text}` from {from}"));
                    continue;
                };
                let n: Vec<usize> = args.split(' ').map(|a| a.parse().unwrap()).collect();
                let (offset, len) = (n[0], n[1]);
                let data_ok = buf[offset..offset + len] == expected[offset..offset + len];
                answer_check(&announce_at, &misdirected, data_ok, &text);
            }
        }
    }
}

/// Incarnation `seed` of agent `name`; it dies once a WRITE's data landed if
/// `die_after_data`.
fn spawn_peer(name: &str, seed: u8, die_after_data: bool) -> PeerProcess {
    let announce_at = announce_path("nixl-restart-verbs", &format!("{name}-{seed}"));
    let _ = std::fs::remove_file(format!("{}.md", announce_at.display()));
    let mut cmd = self_test("restarting_verbs_peer_process", true);
    cmd.env("NIXL_RESTART_VERBS_PEER", &announce_at)
        .env("NIXL_RESTART_VERBS_NAME", name)
        .env("NIXL_RESTART_VERBS_SEED", seed.to_string());
    if die_after_data {
        cmd.env("NIXL_RESTART_VERBS_DIE_AFTER_DATA", "1");
    }
    PeerProcess::spawn(cmd, announce_at)
}

#[test]
fn restarted_verbs_peer_is_reached_again() {
    let Some(dev) = rdma_device() else { return };
    let _s = serial();
    common::init_tracing();
    let survivor = verbs_agent("verbs-survivor", &dev);
    let src = common::pattern(SURVIVOR_SEED, PEER_LEN);
    let mut dst = vec![0u8; PEER_LEN];
    // SAFETY: both buffers outlive the handle and every request (dropped first).
    let _h = unsafe {
        survivor.register_mem(
            &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
            None,
        )
    }
    .unwrap();
    let blocks = |base: u64, n: usize| {
        dram((0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, 0)))
    };
    let xfer = |op: XferOp, local: u64, remote: u64, n: usize, notif: Option<String>| {
        survivor
            .create_xfer_req(
                op,
                &blocks(local, n),
                &blocks(remote, n),
                PEER_NAME,
                notif.map(String::into_bytes),
            )
            .unwrap()
    };

    let bystander_peer = spawn_peer(BYSTANDER_NAME, BYSTANDER_SEED, false);
    assert_eq!(
        survivor.fetch_remote_metadata(bystander_peer.addr).unwrap(),
        BYSTANDER_NAME
    );
    let bystander = Bystander::start(
        &survivor,
        BYSTANDER_NAME,
        bystander_peer.base,
        BYSTANDER_LEN,
    );

    let mut incarnation = 1u8;
    let mut peer = spawn_peer(PEER_NAME, incarnation, false);
    assert_eq!(
        survivor.fetch_remote_metadata(peer.addr).unwrap(),
        PEER_NAME
    );
    for &fault in FAULTS {
        let label = format!("VERBS, {fault:?}");
        println!(
            "{label}: starts {:.2?} into the bystander's rounds",
            bystander.elapsed()
        );
        if fault == Fault::AfterData {
            // A peer that dies once a WRITE's data has landed: this fault's own.
            drop(peer);
            incarnation += 1;
            peer = spawn_peer(PEER_NAME, incarnation, true);
            survivor.invalidate_remote(PEER_NAME).unwrap();
            assert_eq!(
                survivor.fetch_remote_metadata(peer.addr).unwrap(),
                PEER_NAME
            );
        }
        // The live incarnation is reached (its queue pairs connected) before counting.
        // (The dying peer of AfterData would die of a full block: one word only.)
        let mut warm = survivor
            .create_xfer_req(
                XferOp::Write,
                &dram([Desc::new(src.as_ptr() as u64, 8, 0)]),
                &dram([Desc::new(peer.base, 8, 0)]),
                PEER_NAME,
                None,
            )
            .unwrap();
        warm.post().unwrap();
        warm.wait(LONG).unwrap();
        drop(warm);
        let before = Held::now();

        let local = if fault.op() == XferOp::Read {
            dst.as_mut_ptr() as u64
        } else {
            src.as_ptr() as u64
        };
        let mut req = xfer(fault.op(), local, peer.base, BLOCKS, Some("doomed".into()));
        let dead_base = peer.base;
        let dead_blob = metadata_of(&peer);
        let detection = kill_during(fault, &survivor, &mut peer, &mut req, BOUND);
        println!(
            "{label}: {:.1} ms after the {}, {:.1} ms after the process ended{}{}: {}",
            detection.delay().as_secs_f64() * 1e3,
            detection.measured_from(),
            detection.after_end_ms(),
            detection
                .after_self_kill_ms
                .map(|ms| format!(", {ms:.1} ms after the peer killed itself"))
                .unwrap_or_default(),
            if detection.completed_first {
                "; a post completed first"
            } else {
                ""
            },
            detection.error
        );
        detection.assert_remote_disconnect(&label, PEER_NAME, BOUND);
        drop(req);
        drop(peer);
        if fault == Fault::DuringMetadata {
            stale_metadata_is_refused_or_fails(
                &survivor,
                PEER_NAME,
                &dead_blob,
                || {
                    Ok(xfer(
                        XferOp::Write,
                        src.as_ptr() as u64,
                        dead_base,
                        1,
                        Some("stale".into()),
                    ))
                },
                BOUND,
            );
        }

        incarnation += 1;
        let mut restarted = spawn_peer(PEER_NAME, incarnation, false);
        assert_eq!(
            survivor.fetch_remote_metadata(restarted.addr).unwrap(),
            PEER_NAME
        );
        let loaded = Instant::now();
        let msg = format!("check 0 {BLOCK}");
        let mut first = xfer(
            XferOp::Write,
            src.as_ptr() as u64,
            restarted.base,
            1,
            Some(msg.clone()),
        );
        first.post().unwrap();
        first
            .wait(LONG)
            .unwrap_or_else(|e| panic!("{label}: the first WRITE to the restarted peer: {e}"));
        let reached = loaded.elapsed();
        drop(first);
        let seen = verdict(&mut restarted, &msg);
        assert!(seen.starts_with("OK"), "{label}: {seen}");
        dst.fill(0);
        let mut read = xfer(
            XferOp::Read,
            dst.as_mut_ptr() as u64,
            restarted.base + BLOCK as u64,
            1,
            None,
        );
        read.post().unwrap();
        read.wait(LONG).unwrap();
        drop(read);
        assert!(
            dst[..BLOCK] == common::pattern(incarnation, PEER_LEN)[BLOCK..2 * BLOCK],
            "{label}: READ from the restarted peer"
        );
        println!("{label}: restarted peer reached {reached:?} after its metadata was loaded");
        assert!(
            reached < BOUND,
            "{label}: reached again only after {reached:?}"
        );
        let after = Held::now();
        if let Some(leak) = after.leaked_since(&before) {
            panic!("{label}: the dead incarnation left something: {leak}");
        }
        peer = restarted;
    }
    println!(
        "the row ended {:.2?} into the bystander's rounds",
        bystander.elapsed()
    );
    bystander
        .finish()
        .assert_unaffected("VERBS restart row", BOUND);
    drop(bystander_peer);
}
