#![cfg(feature = "libfabric")]
//! The LIBFABRIC backend between two "hosts": two network namespaces joined by a veth
//! pair (`common::twohost`), the target in one (10.77.0.2, in a pid namespace of its own,
//! so that only the network speaks for it), the initiator in the other (10.77.0.1).
//! Metadata goes over the link through the target's listener; each agent's endpoint is
//! bound to its own address (backend parameter `node`). Tested: WRITE and READ with the
//! data verified on both sides and each notification arriving only after its data; and
//! the peer going away — its host's link cut in the middle of a transfer or while idle
//! (then posted to), or its process killed mid-transfer — ending the initiator's
//! transfer in `RemoteDisconnect` within [`BOUND`], with the default stall timeout (30 s),
//! never a hang (the real figure is printed). TCP reports nothing of a pulled cable for
//! minutes: the backend's heartbeats (issue 14) are what notice the vanished host.
//! A cut link is then restored (issue 27): the same target process, its metadata
//! fetched again, is reached again — a WRITE and a READ back, verified — within
//! [`BOUND`] of the link coming back.
//!
//! Needs root and `ip netns`; skips with the reason otherwise (fails instead with
//! `NIXL_REQUIRE_NETNS=1`, as `cargo xtask test` sets when it runs as root).

mod common;

use common::twohost::{skip_or_fail, NetnsPair, ADDRS};
use common::{
    announce_agent, announce_path, dram, fabric_transport, pattern, PeerProcess, TIMEOUT,
};
use nixl::{params, Agent, AgentConfig, Desc, Error, XferOp, XferReq, XferStatus};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Bytes moved each way (8 MiB as 64 KiB descriptors).
const LEN: usize = 8 << 20;
const BLOCK: usize = 64 << 10;
/// What issue 14 asks of a vanished host: `RemoteDisconnect` within 5 s (goal 1 s;
/// generous for a loaded 2-core machine), well before the default stall timeout.
const BOUND: Duration = Duration::from_secs(5);
const TARGET: &str = "netns-target";
const INITIATOR: &str = "netns-initiator";
const SEED_WRITE: u8 = 0x3c;
const SEED_READ: u8 = 0xc3;

/// What the two processes are told, by environment.
mod env {
    pub const ROLE_FILE: &str = "NIXL_NETNS_FILE";
    pub const PROVIDER: &str = "NIXL_NETNS_PROVIDER";
    pub const ADDR: &str = "NIXL_NETNS_ADDR";
    pub const MODE: &str = "NIXL_NETNS_MODE";
    pub const PEER: &str = "NIXL_NETNS_PEER";
    pub const PEER_BASE: &str = "NIXL_NETNS_PEER_BASE";
    pub const CUT: &str = "NIXL_NETNS_CUT";
    pub const RESTORE: &str = "NIXL_NETNS_RESTORE";
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the orchestrating test"))
}

/// An agent listening on `addr` with a LIBFABRIC backend bound to it.
fn agent(name: &str, provider: &str, addr: &str, stall_timeout: Duration) -> Agent {
    let config = AgentConfig {
        listen_addr: Some(format!("{addr}:0").parse().unwrap()),
        stall_timeout,
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    agent
        .create_backend(
            "LIBFABRIC",
            &params([("provider", provider), ("node", addr)]),
        )
        .unwrap_or_else(|e| panic!("LIBFABRIC on {provider} at {addr}: {e}"));
    agent
}

/// The target process (namespace 1): a buffer of `2 × LEN`, the first half written by
/// the initiator, the second half (pattern [`SEED_READ`]) read by it. Mode `data`: each
/// notification is checked against the data it follows, then the verdict is written;
/// every other mode: serves until killed (bounded).
#[test]
#[ignore = "target process of the two-namespace tests"]
fn netns_target_process() {
    let announce = var(env::ROLE_FILE);
    let agent = agent(
        TARGET,
        &var(env::PROVIDER),
        &var(env::ADDR),
        AgentConfig::default().stall_timeout,
    );
    let mut buf = vec![0u8; 2 * LEN];
    buf[LEN..].copy_from_slice(&pattern(SEED_READ, LEN));
    // SAFETY: `buf` outlives the handle (both live until the process ends).
    let _h = unsafe {
        agent
            .register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    announce_agent(&announce, &agent, buf.as_ptr() as u64);
    let deadline = Instant::now() + TIMEOUT;
    // Every mode but `data` only serves: a cut or killed link's WRITEs and
    // notifications, in flight at the cut, may arrive after the restore.
    if var(env::MODE) != "data" {
        while Instant::now() < deadline {
            let _ = agent.get_notifs();
            std::thread::sleep(Duration::from_millis(1));
        }
        return;
    }
    let mut seen = Vec::new();
    while seen.len() < 2 {
        assert!(Instant::now() < deadline, "notifications missing: {seen:?}");
        let notifs = agent.get_notifs().remove(INITIATOR).unwrap_or_default();
        for msg in notifs {
            if msg == b"written" {
                // The notification follows the data: every byte must be there now.
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
    std::fs::write(
        format!("{announce}.ok"),
        "WRITE data and both notifications verified",
    )
    .unwrap();
}

/// The WRITE (or READ) of the whole first (second) half of the target's buffer.
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

/// The initiator process (namespace 0). Mode `data`: WRITE then READ, data verified.
/// Modes `cut-busy` / `cut-idle` / `kill-busy`: a WRITE completes, then the link is cut
/// (or the target process killed) with a WRITE in flight / before the next post; only
/// `RemoteDisconnect` within [`BOUND`] passes, and the error and its delay are the
/// verdict. Mode `cut-restore`: as `cut-busy`, then the link is restored and the
/// target (the same process) is reached again: see [`reach_again`].
#[test]
#[ignore = "initiator process of the two-namespace tests"]
fn netns_initiator_process() {
    let verdict = var(env::ROLE_FILE);
    let mode = var(env::MODE);
    let stall = AgentConfig::default().stall_timeout;
    assert!(stall >= Duration::from_secs(30));
    let agent = agent(INITIATOR, &var(env::PROVIDER), &var(env::ADDR), stall);
    let peer: std::net::SocketAddr = var(env::PEER).parse().unwrap();
    let base: u64 = var(env::PEER_BASE).parse().unwrap();
    let src = pattern(SEED_WRITE, LEN);
    let mut back = vec![0u8; LEN];
    // SAFETY: both buffers outlive the handle and every request (dropped first).
    let _h = unsafe {
        agent
            .register_mem(
                &dram([Desc::from_slice(&src), Desc::from_slice(&back)]),
                None,
            )
            .unwrap()
    };
    let started = Instant::now();
    assert_eq!(agent.fetch_remote_metadata(peer).unwrap(), TARGET);
    let metadata = started.elapsed();
    // The same kernel (boot id) and /dev/shm, but a pid namespace of its own: reached
    // through the network provider, never through the shm rails both sides have.
    assert_eq!(
        fabric_transport(&agent, TARGET).as_deref(),
        Some(var(env::PROVIDER).as_str()),
        "the target in its own pid namespace"
    );
    let mut write = transfer(&agent, XferOp::Write, src.as_ptr() as u64, base, b"written");
    let t = Instant::now();
    write.post().unwrap();
    write.wait(TIMEOUT).unwrap();
    let write_took = t.elapsed();
    if mode == "data" {
        let mut read = transfer(
            &agent,
            XferOp::Read,
            back.as_mut_ptr() as u64,
            base + LEN as u64,
            b"read",
        );
        let t = Instant::now();
        read.post().unwrap();
        read.wait(TIMEOUT).unwrap();
        let read_took = t.elapsed();
        drop(read);
        assert!(
            back == pattern(SEED_READ, LEN)[..],
            "READ brought the wrong bytes"
        );
        std::fs::write(
            verdict,
            format!(
                "metadata over the link {metadata:.2?}; through {}; WRITE {} MiB {write_took:.2?}, READ {read_took:.2?} (data verified)",
                var(env::PROVIDER),
                LEN >> 20
            ),
        )
        .unwrap();
        return;
    }
    if mode.ends_with("busy") || mode == "cut-restore" {
        write.post().unwrap();
    }
    run_order(&var(env::CUT));
    let since = Instant::now();
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
            since.elapsed() < TIMEOUT,
            "{mode}: the cut link was never noticed: hang"
        );
        std::thread::sleep(Duration::from_micros(200));
    };
    let took = since.elapsed();
    let mut report = format!("{mode}: {took:.2?} after the order (stall timeout {stall:?}): {err}");
    std::fs::write(&verdict, &report).unwrap();
    match &err {
        Error::RemoteDisconnect { agent, .. } => assert_eq!(agent, TARGET),
        other => panic!("{mode}: expected RemoteDisconnect, got {other:?}"),
    }
    assert!(
        took < BOUND,
        "{mode}: RemoteDisconnect after {took:?} (bound {BOUND:?})"
    );
    if mode == "cut-restore" {
        drop(write);
        let again = reach_again(&agent, peer, base, &src, &mut back);
        report.push_str(&format!("; {again}"));
        std::fs::write(&verdict, &report).unwrap();
    }
}

/// Runs `order` (a command line, words split at spaces), which must succeed.
fn run_order(order: &str) {
    let argv: Vec<&str> = order.split(' ').collect();
    let status = Command::new(argv[0]).args(&argv[1..]).status().unwrap();
    assert!(status.success(), "{argv:?} failed");
}

/// Mode `cut-restore`, once the cut link was noticed: a post while the link is still
/// down fails at once (the peer is known dead), the link is restored, and the target
/// — the same process, its metadata fetched again as for any peer declared dead — is
/// reached within [`BOUND`]: a WRITE of `src` to the first half of its buffer, then a
/// READ of it back into `back`, verified. Returns the figures.
fn reach_again(
    agent: &Agent,
    peer: std::net::SocketAddr,
    base: u64,
    src: &[u8],
    back: &mut [u8],
) -> String {
    let mut write = transfer(agent, XferOp::Write, src.as_ptr() as u64, base, b"again");
    let refused = match write.post() {
        Err(e) => e,
        Ok(_) => write
            .wait(TIMEOUT)
            .expect_err("a WRITE over a cut link completed"),
    };
    assert!(
        matches!(&refused, Error::RemoteDisconnect { agent, .. } if agent == TARGET),
        "a post while the link is down: {refused:?}"
    );
    drop(write);
    run_order(&var(env::RESTORE));
    let restored = Instant::now();
    agent.invalidate_remote(TARGET).unwrap();
    // The link may take a moment to carry again: fetches are retried within the bound.
    let fetched = loop {
        match agent.fetch_remote_metadata(peer) {
            Ok(name) => {
                assert_eq!(name, TARGET);
                break restored.elapsed();
            }
            Err(e) => {
                assert!(
                    restored.elapsed() < BOUND,
                    "no metadata after the restore: {e}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    let mut write = transfer(agent, XferOp::Write, src.as_ptr() as u64, base, b"again");
    write.post().unwrap();
    write
        .wait(TIMEOUT)
        .unwrap_or_else(|e| panic!("the first WRITE after the restore: {e}"));
    let reached = restored.elapsed();
    drop(write);
    back.fill(0);
    let mut read = transfer(
        agent,
        XferOp::Read,
        back.as_mut_ptr() as u64,
        base,
        b"read-again",
    );
    read.post().unwrap();
    read.wait(TIMEOUT).unwrap();
    drop(read);
    assert!(
        back == src,
        "READ after the restore brought the wrong bytes"
    );
    assert!(
        reached < BOUND,
        "reached again only {reached:?} after the restore (bound {BOUND:?})"
    );
    format!(
        "restored: a post while down refused ({refused}); metadata fetched {fetched:.2?} \
         and the target reached {reached:.2?} after the restore (WRITE and READ back \
         verified)"
    )
}

/// Runs the target in namespace 1 and the initiator in namespace 0 with `mode`; returns
/// prints the initiator's verdict (and checks the target's in mode `data`).
fn two_hosts(provider: &str, mode: &str) {
    let tag = format!("{}-{mode}", provider.replace(';', "_"));
    let pair = match NetnsPair::create(&mode[..mode.len().min(8)]) {
        Ok(pair) => pair,
        Err(reason) => {
            skip_or_fail(&reason);
            return;
        }
    };
    let exe = std::env::current_exe().unwrap();
    let role = |cmd: &mut Command, test: &str, file: &PathBuf, addr: &str| {
        cmd.args([
            "--exact",
            test,
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(env::ROLE_FILE, file)
        .env(env::PROVIDER, provider)
        .env(env::ADDR, addr)
        .env(env::MODE, mode)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    };
    let target_file = announce_path("nixl-netns-target", &tag);
    let mut cmd = pair.remote_command(1, &exe);
    role(&mut cmd, "netns_target_process", &target_file, ADDRS[1]);
    let mut target = PeerProcess::spawn(cmd, target_file);

    let verdict_file = announce_path("nixl-netns-initiator", &tag);
    let mut cmd = pair.command(0, &exe);
    role(&mut cmd, "netns_initiator_process", &verdict_file, ADDRS[0]);
    // `kill-*`: the target's `unshare --kill-child` killed, and with it the target.
    let cut = if mode.starts_with("kill") {
        format!("kill -KILL {}", target.child.id())
    } else {
        pair.cut_link_argv(1).join(" ")
    };
    cmd.env(env::PEER, target.addr.to_string())
        .env(env::PEER_BASE, target.base.to_string())
        .env(env::CUT, cut)
        .env(env::RESTORE, pair.restore_link_argv(1).join(" "));
    let mut initiator = cmd.spawn().unwrap();
    let deadline = Instant::now() + 2 * TIMEOUT;
    let status = loop {
        if let Some(status) = initiator.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = initiator.kill();
            panic!("{tag}: the initiator hangs");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // Printed even when the initiator failed: a bound missed still shows the figure.
    let verdict = std::fs::read_to_string(&verdict_file).unwrap_or_default();
    let _ = std::fs::remove_file(&verdict_file);
    println!("{provider} between namespaces, {verdict}");
    assert!(status.success(), "{tag}: the initiator failed ({status})");
    if mode == "data" {
        let target_verdict = target.verdict();
        println!("{provider} target: {target_verdict}");
    }
}

#[test]
fn write_read_across_a_link_tcp_rxm() {
    two_hosts("tcp;ofi_rxm", "data");
}

#[test]
fn write_read_across_a_link_sockets() {
    two_hosts("sockets", "data");
}

#[test]
fn link_cut_is_remote_disconnect_within_bound_tcp_rxm() {
    two_hosts("tcp;ofi_rxm", "cut-busy");
}

#[test]
fn link_cut_is_remote_disconnect_within_bound_sockets() {
    two_hosts("sockets", "cut-busy");
}

#[test]
fn link_cut_while_idle_tcp_rxm() {
    two_hosts("tcp;ofi_rxm", "cut-idle");
}

#[test]
fn link_cut_while_idle_sockets() {
    two_hosts("sockets", "cut-idle");
}

/// The link cut mid-WRITE and restored: `RemoteDisconnect` within the bound while it
/// is down, and the same target process reached again once it is up.
#[test]
fn link_cut_and_restored_tcp_rxm() {
    two_hosts("tcp;ofi_rxm", "cut-restore");
}

#[test]
fn link_cut_and_restored_sockets() {
    two_hosts("sockets", "cut-restore");
}

#[test]
fn killed_peer_is_remote_disconnect_tcp_rxm() {
    two_hosts("tcp;ofi_rxm", "kill-busy");
}

#[test]
fn killed_peer_is_remote_disconnect_sockets() {
    two_hosts("sockets", "kill-busy");
}
