#![cfg(feature = "libfabric")]
//! A peer process that dies is reported as `RemoteDisconnect` within about a second on
//! every LIBFABRIC provider, with the stall timeout left at its default (30 s): `shm`
//! never reports a dead peer itself, so this holds only because the backend watches the
//! peer's process through the OS (`nixl::backends::libfabric`'s liveness). Each test
//! kills a peer in the middle of a transfer and another one while idle (then posts),
//! asserts the typed error well within the stall timeout (bound [`BOUND`], generous for
//! a loaded 2-core machine) and prints the real figures. Over `tcp;ofi_rxm` a peer is
//! also frozen (SIGSTOP) mid-transfer, as a hung host: its process lives on, so only the
//! backend's heartbeats can tell; thawed and loaded again, it works.

mod common;

use common::{announce_agent, announce_path, dram, self_test, PeerProcess, TIMEOUT};
use nixl::{params, Agent, AgentConfig, Desc};
use std::time::{Duration, Instant};

/// The bound the tests assert (the goal is 1 s; the figures printed are the real ones).
const BOUND: Duration = Duration::from_secs(5);
const PEER_LEN: usize = 32 << 20;
const BLOCK: usize = 4096;
const PEER_NAME: &str = "dying-peer";

fn listening_agent(name: &str, provider: &str, rails: Option<&str>) -> Agent {
    let config = AgentConfig {
        listen_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    // This provider itself, not shm, to the peer on this host; `default`: no parameters.
    let p = match provider {
        DEFAULT => nixl::BackendParams::new(),
        _ => params([("provider", provider), ("local_provider", "none")]),
    };
    let mut p = p;
    if let Some(rails) = rails {
        p.insert("num_rails".into(), rails.into());
    }
    agent
        .create_backend("LIBFABRIC", &p)
        .unwrap_or_else(|e| panic!("LIBFABRIC on {provider}: {e}"));
    agent
}

/// The "provider" that stands for default parameters (the network provider, and shm to
/// a peer on this host).
const DEFAULT: &str = "default";

/// The peer process: runs only when re-executed with NIXL_DEAD_PEER; serves until it is
/// killed (bounded).
#[test]
fn dead_peer_main() {
    let (Ok(announce), Ok(provider)) = (
        std::env::var("NIXL_DEAD_PEER"),
        std::env::var("NIXL_DEAD_PEER_PROVIDER"),
    ) else {
        return;
    };
    let rails = std::env::var("NIXL_DEAD_PEER_RAILS").ok();
    let peer = listening_agent(PEER_NAME, &provider, rails.as_deref());
    let buf = vec![0u8; PEER_LEN];
    // SAFETY: `buf` lives until the process ends.
    let _h = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    announce_agent(&announce, &peer, buf.as_ptr() as u64);
    let deadline = Instant::now() + TIMEOUT;
    while Instant::now() < deadline {
        // Drives manual-progress providers for incoming traffic, as a real target does.
        let _ = peer.get_notifs();
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn spawn_peer(provider: &str, rails: Option<&str>, tag: &str) -> PeerProcess {
    let announce = announce_path("nixl-dead-peer", &format!("{provider}-{tag}"));
    let mut cmd = self_test("dead_peer_main", false);
    cmd.env("NIXL_DEAD_PEER", &announce)
        .env("NIXL_DEAD_PEER_PROVIDER", provider);
    if let Some(rails) = rails {
        cmd.env("NIXL_DEAD_PEER_RAILS", rails);
    }
    PeerProcess::spawn(cmd, announce)
}

fn dead_peers_are_reported_fast(provider: &str, cases: &[&str]) {
    dead_peers_are_reported_fast_on(provider, None, cases);
}

/// `rails`: `num_rails` on both sides (`None`: the provider's default for this machine).
fn dead_peers_are_reported_fast_on(provider: &str, rails: Option<&str>, cases: &[&str]) {
    dead_peers_are_reported_fast_with(provider, rails, BLOCK, cases);
}

/// The same with descriptors of `block` bytes.
fn dead_peers_are_reported_fast_with(
    provider: &str,
    rails: Option<&str>,
    block: usize,
    cases: &[&str],
) {
    // One provider at a time: peers killed mid-transfer by concurrent tests of this
    // process crashed or hung the shm survivor (libfabric 1.17) in 2 of 6 runs.
    let _serial = common::serial();
    let tag = format!(
        "{}-{}",
        provider.replace(';', "_"),
        rails.unwrap_or("default")
    );
    let initiator = listening_agent(&format!("survivor-{tag}"), provider, rails);
    let label = match rails {
        Some(r) => format!("{provider}, {r} rails"),
        None => provider.to_string(),
    };
    common::dead_peer_scenario(
        &initiator,
        &label,
        PEER_NAME,
        PEER_LEN,
        block,
        |tag| spawn_peer(provider, rails, tag),
        TIMEOUT,
        BOUND,
        cases,
    );
}

#[test]
fn dead_peer_over_tcp_rxm() {
    dead_peers_are_reported_fast("tcp;ofi_rxm", &["busy", "idle", "frozen"]);
}

#[test]
#[ignore = "sockets: transfers to a freshly spawned peer stall until the 30 s stall timeout \
            in most runs on the 2-core development machine; a known defect of this \
            provider here, tracked with the two-host work"]
fn dead_peer_over_sockets() {
    dead_peers_are_reported_fast("sockets", &["busy", "idle"]);
}

/// Default parameters: the peer on this host is reached through the shm rails, and its
/// process's end (killed while idle) and its freezing (SIGSTOP mid-transfer: heartbeats
/// from the shm plane's hub) are `RemoteDisconnect` within the bound as on any provider.
#[test]
fn dead_peer_with_default_parameters_over_the_shm_rails() {
    let _serial = common::serial();
    let initiator = listening_agent("survivor-default", DEFAULT, None);
    common::dead_peer_scenario(
        &initiator,
        "default parameters",
        PEER_NAME,
        PEER_LEN,
        BLOCK,
        |tag| spawn_peer(DEFAULT, None, tag),
        TIMEOUT,
        BOUND,
        &["idle", "frozen"],
    );
    assert_eq!(
        common::fabric_transport(&initiator, PEER_NAME).as_deref(),
        Some("shm")
    );
}

/// A shm peer killed while idle, then posted to.
#[test]
fn dead_peer_over_shm() {
    dead_peers_are_reported_fast("shm", &["idle"]);
}

/// A shm peer killed while writes to it are in flight, with this machine's default rail
/// count and with four rails (the 16-core GPU machine's default): the survivor sees
/// `RemoteDisconnect` within the bound. libfabric 1.17's shm crashed the survivor in
/// `fi_writedata` or hung it on the dead peer's lock in about a quarter of runs at stop
/// 16 (9 of 12 whole-binary passes), before the rail workers stopped touching a peer
/// once it is known dead; at stop 21, 0 failures in 68 runs of this test (48 with one
/// rail, 20 with four) and 30 whole-binary runs on the 2-core development machine. A peer
/// killed while holding its shm region's spinlock can still wedge the rail worker that
/// writes to it next (the module documentation's known limit): the error asserted here
/// comes from the OS and the heartbeats either way, and the wedged rail's agent is not
/// used again.
#[test]
fn dead_peer_over_shm_mid_transfer() {
    dead_peers_are_reported_fast("shm", &["busy"]);
    dead_peers_are_reported_fast_on("shm", Some("4"), &["busy"]);
}

/// A shm peer killed while 4 MiB WRITEs to it are in flight, half of each pushed into it
/// by this process (`cma_write`): a push into the dead process fails (`ESRCH`), or the
/// rail worker sees the death first, and the survivor gets `RemoteDisconnect` within the
/// bound as with the provider's own copies.
#[test]
fn dead_peer_over_shm_mid_push() {
    dead_peers_are_reported_fast_with("shm", None, 4 << 20, &["busy"]);
}

/// A shm peer killed while 4 MiB READs from it are in flight, half of each pushed by
/// the peer on request (`cma_read`): the pieces it was asked for are given up once its
/// process is gone, and the survivor gets `RemoteDisconnect` within the bound.
#[test]
fn dead_peer_over_shm_mid_read_assist() {
    let _serial = common::serial();
    let initiator = listening_agent("survivor-shm-read", "shm", None);
    common::dead_peer_scenario_of(
        nixl::XferOp::Read,
        &initiator,
        "shm READs with assists",
        PEER_NAME,
        PEER_LEN,
        4 << 20,
        |tag| spawn_peer("shm", None, &format!("read-{tag}")),
        TIMEOUT,
        BOUND,
        &["busy", "idle"],
    );
}
