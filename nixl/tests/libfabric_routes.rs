#![cfg(feature = "libfabric")]
//! LIBFABRIC chooses its rails per peer (issue 13): with default parameters a peer on
//! this host (another process, or another agent of this one) is reached through `shm`,
//! as NIXL's UCX reaches it through shared memory; with `local_provider=none` on either
//! side through the network provider. Data and notifications verified both ways; the
//! WRITE is one 4 MiB block, which over `shm` the two processes copy together (the
//! initiator pushes half of it: `cma_write`), its notification after all of it; the
//! READ is done twice, as 64 KiB blocks and as one 4 MiB block, which over `shm` the
//! two copy together too (the target pushes half of it on request: `cma_read`).
//! (Peers on this kernel in a pid namespace of their own go through the network:
//! `netns_libfabric.rs`.)

mod common;

use common::{
    announce_agent, announce_path, dram, fabric_transport, listening, pattern, self_test,
    wait_notif, wait_notifs, PeerProcess, TIMEOUT,
};
use nixl::backends::libfabric::PROVIDER_PRIORITY;
use nixl::{Agent, AgentConfig, BackendParams, Desc, Error, XferOp};

const TARGET_PARAMS: &str = "NIXL_ROUTES_TARGET_PARAMS";
const ANNOUNCE: &str = "NIXL_ROUTES_ANNOUNCE";
const INITIATOR: &str = "routes-initiator";
const LEN: usize = 8 << 20;
const BLOCK: usize = 64 << 10;

/// `key=value` pairs separated by spaces (provider names hold `;`).
fn parse(spec: &str) -> BackendParams {
    spec.split_whitespace()
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("key=value");
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn agent(name: &str, spec: &str, config: AgentConfig) -> Agent {
    let agent = Agent::new(name, config).unwrap();
    agent
        .create_backend("LIBFABRIC", &parse(spec))
        .unwrap_or_else(|e| panic!("LIBFABRIC with `{spec}`: {e}"));
    agent
}

/// The target process: the first half of its buffer is READ by the initiator, the second
/// half WRITTEN, with a notification that must follow the data; then a standalone one.
#[test]
fn routes_target_main() {
    let Ok(spec) = std::env::var(TARGET_PARAMS) else {
        return;
    };
    let target = agent("routes-target", &spec, listening());
    let mut buf = pattern(42, LEN);
    buf[LEN / 2..].fill(0);
    // SAFETY: `buf` lives until the process exits.
    let _h = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    let announce = std::env::var(ANNOUNCE).unwrap();
    announce_agent(&announce, &target, buf.as_ptr() as u64);
    let mut seen = Vec::new();
    while seen.len() < 2 {
        for msg in wait_notifs(&target, INITIATOR) {
            if msg == b"second half written" {
                assert!(
                    buf[LEN / 2..] == pattern(7, LEN)[LEN / 2..],
                    "the notification came before the data"
                );
            }
            seen.push(msg);
        }
    }
    assert_eq!(seen, [&b"second half written"[..], b"standalone"]);
    std::fs::write(format!("{announce}.ok"), "TARGET OK").unwrap();
}

/// Runs the target with `target_spec`, moves data from an initiator with `initiator_spec`,
/// and returns the provider the initiator reached it through.
fn across_processes(initiator_spec: &str, target_spec: &str) -> String {
    let announce = announce_path("nixl-routes", &format!("{initiator_spec}|{target_spec}"));
    let mut cmd = self_test("routes_target_main", false);
    cmd.env(TARGET_PARAMS, target_spec).env(ANNOUNCE, &announce);
    let mut target = PeerProcess::spawn(cmd, announce);
    let initiator = agent(INITIATOR, initiator_spec, AgentConfig::default());
    let name = initiator.fetch_remote_metadata(target.addr).unwrap();
    let transport = fabric_transport(&initiator, &name).expect("the target is loaded");
    let local = pattern(7, LEN);
    let mut back = vec![0u8; LEN / 2];
    // SAFETY: both buffers outlive the handle and the requests.
    let _h = unsafe {
        initiator
            .register_mem(
                &dram([Desc::from_slice(&local), Desc::from_slice(&back)]),
                None,
            )
            .unwrap()
    };
    let blocks = |base: u64| {
        dram((0..LEN / 2 / BLOCK).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, 0)))
    };
    let half = (LEN / 2) as u64;
    let one_block = |base: u64| dram([Desc::new(base, half, 0)]);
    for (local, remote, what) in [
        (
            blocks(back.as_mut_ptr() as u64),
            blocks(target.base),
            "64 KiB blocks",
        ),
        (
            one_block(back.as_mut_ptr() as u64),
            one_block(target.base),
            "one block",
        ),
    ] {
        back.fill(0);
        let mut read = initiator
            .create_xfer_req(XferOp::Read, &local, &remote, &name, None)
            .unwrap();
        read.post().unwrap();
        read.wait(TIMEOUT).unwrap();
        assert!(
            back == pattern(42, LEN)[..LEN / 2],
            "{transport}: READ of {what}"
        );
    }
    // One block, so that over shm part of it is pushed by this process.
    let whole = |base: u64| dram([Desc::new(base + half, half, 0)]);
    let mut write = initiator
        .create_xfer_req(
            XferOp::Write,
            &whole(local.as_ptr() as u64),
            &whole(target.base),
            &name,
            Some(b"second half written".to_vec()),
        )
        .unwrap();
    write.post().unwrap();
    write.wait(TIMEOUT).unwrap();
    initiator.gen_notif(&name, b"standalone").unwrap();
    assert_eq!(target.verdict(), "TARGET OK", "{transport}");
    transport
}

#[test]
fn default_parameters_reach_a_process_on_this_host_through_shm() {
    assert_eq!(across_processes("", ""), "shm");
    // An explicit network provider keeps shm for this host too.
    assert_eq!(
        across_processes("provider=tcp;ofi_rxm", "provider=tcp;ofi_rxm"),
        "shm"
    );
}

#[test]
fn local_provider_none_on_either_side_goes_through_the_network() {
    for (initiator, target) in [
        ("local_provider=none", "local_provider=none"),
        ("", "local_provider=none"),
        ("local_provider=none", ""),
    ] {
        let transport = across_processes(initiator, target);
        println!("initiator `{initiator}`, target `{target}`: {transport}");
        assert!(
            PROVIDER_PRIORITY.contains(&transport.as_str()),
            "`{initiator}` to `{target}`: {transport}"
        );
    }
    // Two network providers named, their own shm rails left out.
    assert_eq!(
        across_processes(
            "provider=sockets local_provider=none",
            "provider=sockets local_provider=none"
        ),
        "sockets"
    );
}

/// Two agents of one process share its memory: shm, with notifications both ways.
#[test]
fn agents_of_one_process_use_shm_and_notify_both_ways() {
    let a = agent("routes-a", "", AgentConfig::default());
    let b = agent("routes-b", "", AgentConfig::default());
    let src = pattern(3, LEN);
    let dst = vec![0u8; LEN];
    // SAFETY: the buffers outlive the handles and the request.
    let (_ha, _hb) = unsafe {
        (
            a.register_mem(&dram([Desc::from_slice(&src)]), None)
                .unwrap(),
            b.register_mem(&dram([Desc::from_slice(&dst)]), None)
                .unwrap(),
        )
    };
    let b_name = a
        .load_remote_metadata(&b.local_metadata().unwrap())
        .unwrap();
    let a_name = b
        .load_remote_metadata(&a.local_metadata().unwrap())
        .unwrap();
    assert_eq!(fabric_transport(&a, &b_name).as_deref(), Some("shm"));
    assert_eq!(fabric_transport(&b, &a_name).as_deref(), Some("shm"));
    let mut req = a
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(&src)]),
            &dram([Desc::from_slice(&dst)]),
            &b_name,
            Some(b"done".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&b, a.name()), b"done");
    assert_eq!(src, dst);
    b.gen_notif(&a_name, b"back").unwrap();
    assert_eq!(wait_notif(&a, b.name()), b"back");
}

/// `Agent::wait_notifs` with default parameters: the peer is reached through the shm
/// plane, whose rail workers wake the wait as the network plane's do.
#[test]
fn wait_notifs_is_woken_through_the_shm_plane() {
    let target = agent("wait-shm-t", "", AgentConfig::default());
    let sender = agent("wait-shm-s", "", AgentConfig::default());
    let name = sender
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    assert_eq!(fabric_transport(&sender, &name).as_deref(), Some("shm"));
    common::notif_wait::check_wait_notifs(&target, &sender);
}

/// A peer agent invalidated, dropped and created again under its name in this process,
/// three times: each is reached through shm (libfabric 1.17's shm crashed the new one's
/// rail worker when the old one's address had been removed from the AV).
#[test]
fn a_peer_created_again_after_invalidation_is_reached_through_shm() {
    let a = agent("again-a", "", AgentConfig::default());
    let src = pattern(9, LEN);
    // SAFETY: `src` outlives the handle and the requests.
    let _ha = unsafe {
        a.register_mem(&dram([Desc::from_slice(&src)]), None)
            .unwrap()
    };
    for life in 0..3u8 {
        let b = agent("again-b", "", AgentConfig::default());
        let dst = vec![0u8; LEN];
        // SAFETY: `dst` outlives the handle and the request of this iteration.
        let hb = unsafe {
            b.register_mem(&dram([Desc::from_slice(&dst)]), None)
                .unwrap()
        };
        let name = a
            .load_remote_metadata(&b.local_metadata().unwrap())
            .unwrap();
        assert_eq!(fabric_transport(&a, &name).as_deref(), Some("shm"));
        let mut req = a
            .create_xfer_req(
                XferOp::Write,
                &dram([Desc::from_slice(&src)]),
                &dram([Desc::from_slice(&dst)]),
                &name,
                Some(vec![life]),
            )
            .unwrap();
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
        assert_eq!(wait_notif(&b, a.name()), [life]);
        assert!(src == dst, "life {life}");
        a.invalidate_remote(&name).unwrap();
        drop(req);
        drop(hb);
        drop(b);
    }
}

#[test]
fn a_bad_local_provider_is_refused_typed() {
    let a = Agent::new("routes-bad", AgentConfig::default()).unwrap();
    let e = a
        .create_backend("LIBFABRIC", &parse("local_provider=tcp"))
        .unwrap_err();
    assert!(matches!(e, Error::InvalidParam(_)), "{e:?}");
}
