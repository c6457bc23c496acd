#![cfg(feature = "verbs")]
//! VERBS over soft-RoCE (`RDMA_TEST_DEVICE`, in the guest of `cargo xtask test`): a peer
//! process that dies is reported as `RemoteDisconnect` within about a second, with the
//! stall timeout left at its default (30 s). The backend's side-channel TCP connection is
//! the liveness signal (the dead process's kernel closes it; our side-channel thread
//! moves the QPs to the error state). Killed in the middle of a transfer, and while idle
//! (then posted to); and frozen (SIGSTOP) mid-transfer, as a hung host: its socket stays
//! open and soft-RoCE (in the kernel) still acknowledges the writes, so only the side
//! channel's heartbeats tell; thawed and loaded again, it works. The typed error is
//! asserted within [`BOUND`] and the real figures are printed. On the host (no device)
//! the tests print why they skip.

mod common;

use common::{announce_agent, announce_path, dram, rdma_device, self_test, serial, PeerProcess};
use nixl::{params, Agent, AgentConfig, Desc};
use std::time::{Duration, Instant};

/// The bound the tests assert (the goal is 1 s; the figures printed are the real ones).
const BOUND: Duration = Duration::from_secs(5);
const PEER_LEN: usize = 16 << 20;
const BLOCK: usize = 64 << 10;
const PEER_NAME: &str = "dying-verbs-peer";
/// Bound on anything that should have finished long ago.
const LONG: Duration = Duration::from_secs(120);

fn verbs_agent(name: &str, device: &str) -> Agent {
    let config = AgentConfig {
        listen_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    agent
        .create_backend("VERBS", &params([("device", device)]))
        .unwrap_or_else(|e| panic!("VERBS on {device}: {e}"));
    agent
}

/// The peer process, run only by the tests below (with `--ignored`): registers a buffer,
/// announces itself, and serves until it is killed (bounded).
#[test]
#[ignore = "peer process of the dead-peer tests"]
fn dying_peer_process() {
    let announce = std::env::var("NIXL_DEAD_VERBS_PEER").expect("run by a dead-peer test");
    let dev = rdma_device().expect("RDMA_TEST_DEVICE is inherited");
    let peer = verbs_agent(PEER_NAME, &dev);
    let buf = vec![0u8; PEER_LEN];
    // SAFETY: `buf` lives until the process ends.
    let _h = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    announce_agent(&announce, &peer, buf.as_ptr() as u64);
    let deadline = Instant::now() + LONG;
    while Instant::now() < deadline {
        let _ = peer.get_notifs();
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn spawn_peer(tag: &str) -> PeerProcess {
    let announce = announce_path("nixl-dead-verbs-peer", tag);
    let mut cmd = self_test("dying_peer_process", true);
    cmd.env("NIXL_DEAD_VERBS_PEER", &announce);
    PeerProcess::spawn(cmd, announce)
}

#[test]
fn dead_verbs_peer_is_reported_fast() {
    let Some(dev) = rdma_device() else { return };
    let _s = serial();
    let initiator = verbs_agent("verbs-survivor", &dev);
    common::dead_peer_scenario(
        &initiator,
        "VERBS",
        PEER_NAME,
        PEER_LEN,
        BLOCK,
        spawn_peer,
        LONG,
        BOUND,
        &["busy", "idle", "frozen"],
    );
}
