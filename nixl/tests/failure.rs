//! The failure model, path by path: injected faults through the FAULT backend (LOCAL and
//! LIBFABRIC inside), and the real thing over LIBFABRIC on the host: a peer killed with
//! SIGKILL mid-transfer, restarted with new metadata, requests released in flight, and
//! agent shutdown.

use nixl::backends::fault::{FaultBackend, FaultPlan, INJECTED_ERRNO};
mod common;

use common::{dram, finish, wait_notifs};
use nixl::{params, Agent, AgentConfig, Desc, Error, XferOp, XferStatus};
use std::sync::Arc;
use std::time::Duration;

fn config(stall: Duration) -> AgentConfig {
    AgentConfig {
        stall_timeout: stall,
        ..AgentConfig::default()
    }
}

/// The one notification from `from` (more than one at a time fails the test).
fn wait_notif(agent: &Agent, from: &str) -> Vec<u8> {
    let mut msgs = wait_notifs(agent, from);
    assert_eq!(msgs.len(), 1, "one notification at a time: {msgs:?}");
    msgs.remove(0)
}

/// One agent with a FAULT-wrapped LOCAL backend and two buffers: `src` → `dst`, 4 KiB
/// blocks.
struct LocalRig {
    agent: Agent,
    fault: Arc<FaultBackend>,
    src: Vec<u8>,
    dst: Vec<u8>,
    _handle: nixl::RegistrationHandle,
}

const BLOCK: usize = 4096;

impl LocalRig {
    fn new(name: &str, plan: &[(&str, &str)], stall: Duration) -> Self {
        let agent = Agent::new(name, config(stall)).unwrap();
        let mut p = vec![("inner", "LOCAL")];
        p.extend_from_slice(plan);
        let fault = FaultBackend::new(&agent.backend_init(params(p))).unwrap();
        agent.add_backend(fault.clone()).unwrap();
        let src: Vec<u8> = (0..16 * BLOCK).map(|i| (i % 253) as u8 + 1).collect();
        let dst = vec![0u8; 16 * BLOCK];
        // SAFETY: the buffers are owned by the rig, which drops the handle first (field
        // order) and every request is dropped before the rig.
        let handle = unsafe {
            agent
                .register_mem(
                    &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
                    None,
                )
                .unwrap()
        };
        Self {
            agent,
            fault,
            src,
            dst,
            _handle: handle,
        }
    }

    /// A WRITE of blocks `blocks` (same offsets on both sides).
    fn req(
        &self,
        blocks: std::ops::Range<usize>,
        notif: Option<&[u8]>,
    ) -> nixl::Result<nixl::XferReq> {
        let at = |base: &Vec<u8>, i: usize| {
            Desc::new(base.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)
        };
        self.agent.create_xfer_req(
            XferOp::Write,
            &dram(blocks.clone().map(|i| at(&self.src, i))),
            &dram(blocks.map(|i| at(&self.dst, i))),
            self.agent.name(),
            notif.map(<[u8]>::to_vec),
        )
    }

    fn copied(&self, block: usize) -> bool {
        let r = block * BLOCK..(block + 1) * BLOCK;
        self.dst[r.clone()] == self.src[r]
    }

    fn untouched(&self, block: usize) -> bool {
        self.dst[block * BLOCK..(block + 1) * BLOCK]
            .iter()
            .all(|b| *b == 0)
    }
}

#[test]
fn nth_completion_fails_with_a_typed_backend_error_and_the_next_request_succeeds() {
    let rig = LocalRig::new(
        "fault-nth",
        &[("fail_completion", "6"), ("fail_error", "backend")],
        Duration::from_secs(30),
    );
    let mut first = rig.req(0..4, None).unwrap();
    first.post().unwrap();
    finish(&mut first).unwrap();
    // Completions 5..=8: the 6th is among them.
    let mut second = rig.req(4..8, Some(b"second")).unwrap();
    second.post().unwrap();
    match finish(&mut second) {
        Err(Error::Backend { code, .. }) => assert_eq!(code, INJECTED_ERRNO),
        other => panic!("expected the injected backend error, got {other:?}"),
    }
    // Terminal: the same error again, and no repost.
    assert!(matches!(
        second.status(),
        Err(Error::Backend {
            code: INJECTED_ERRNO,
            ..
        })
    ));
    assert!(matches!(
        second.post(),
        Err(Error::Backend {
            code: INJECTED_ERRNO,
            ..
        })
    ));
    assert!(!second.is_in_flight());
    assert_eq!(rig.fault.stats().failures, 1);
    // The connection is fine: the next request moves its data.
    let mut third = rig.req(8..12, Some(b"third")).unwrap();
    third.post().unwrap();
    finish(&mut third).unwrap();
    assert!((8..12).all(|b| rig.copied(b)));
    assert!((12..16).all(|b| rig.untouched(b)));
}

#[test]
fn nth_completion_as_disconnect_is_remote_disconnect_naming_the_peer() {
    let rig = LocalRig::new(
        "fault-flush",
        &[("fail_completion", "1")],
        Duration::from_secs(30),
    );
    let mut req = rig.req(0..2, None).unwrap();
    req.post().unwrap();
    match finish(&mut req) {
        Err(Error::RemoteDisconnect { agent, .. }) => assert_eq!(agent, "fault-flush"),
        other => panic!("expected RemoteDisconnect, got {other:?}"),
    }
    // Only that transfer: the peer is still reachable.
    let mut again = rig.req(2..4, None).unwrap();
    again.post().unwrap();
    finish(&mut again).unwrap();
    assert!(rig.copied(2) && rig.copied(3));
}

#[test]
fn no_progress_is_stalled_and_nothing_is_delivered_afterwards() {
    // The post reaches the transport an hour late: the agent must give up long before.
    let rig = LocalRig::new(
        "fault-stall",
        &[("delay_ms", "3600000")],
        Duration::from_millis(200),
    );
    let mut req = rig.req(0..4, Some(b"late")).unwrap();
    assert_eq!(req.post().unwrap(), XferStatus::InProgress);
    match finish(&mut req) {
        Err(Error::Stalled(d)) => assert_eq!(d, Duration::from_millis(200)),
        other => panic!("expected Stalled, got {other:?}"),
    }
    assert!(matches!(req.status(), Err(Error::Stalled(_))));
    // Released: even with the delay lifted, nothing of it is ever issued.
    rig.fault.set_plan(FaultPlan::default());
    assert!(matches!(req.status(), Err(Error::Stalled(_))));
    assert!((0..4).all(|b| rig.untouched(b)));
    assert!(rig.agent.get_notifs().is_empty());
}

#[test]
fn a_short_delay_below_the_stall_timeout_completes() {
    let rig = LocalRig::new(
        "fault-delay",
        &[("delay_ms", "50")],
        Duration::from_secs(30),
    );
    let mut req = rig.req(0..4, Some(b"slow")).unwrap();
    assert_eq!(req.post().unwrap(), XferStatus::InProgress);
    finish(&mut req).unwrap();
    assert!((0..4).all(|b| rig.copied(b)));
    assert_eq!(wait_notif(&rig.agent, "fault-delay"), b"slow");
}

#[test]
fn dropped_notification_is_the_nth_only() {
    let rig = LocalRig::new(
        "fault-notif",
        &[("drop_notif", "2")],
        Duration::from_secs(30),
    );
    for (i, msg) in [&b"one"[..], b"two", b"three"].into_iter().enumerate() {
        let mut req = rig.req(i..i + 1, Some(msg)).unwrap();
        req.post().unwrap();
        finish(&mut req).unwrap();
        assert!(rig.copied(i), "the transfer itself completes");
    }
    rig.agent.gen_notif("fault-notif", b"four").unwrap();
    assert_eq!(
        rig.agent.get_notifs().remove("fault-notif").unwrap(),
        vec![b"one".to_vec(), b"three".to_vec(), b"four".to_vec()]
    );
    let stats = rig.fault.stats();
    assert_eq!((stats.notifs, stats.notifs_dropped), (4, 1));
}

#[test]
fn releasing_an_in_flight_request_cancels_it() {
    let rig = LocalRig::new(
        "fault-release",
        &[("hold", "true")],
        Duration::from_secs(30),
    );
    let mut req = rig.req(0..4, Some(b"canceled")).unwrap();
    assert_eq!(req.post().unwrap(), XferStatus::InProgress);
    assert_eq!(req.status().unwrap(), XferStatus::InProgress);
    assert!(req.is_in_flight());
    drop(req);
    rig.fault.release();
    // Nothing of the released request is ever issued; the next one goes through.
    let mut next = rig.req(4..5, Some(b"next")).unwrap();
    next.post().unwrap();
    finish(&mut next).unwrap();
    assert_eq!(wait_notif(&rig.agent, "fault-release"), b"next");
    assert!((0..4).all(|b| rig.untouched(b)));
    assert!(rig.copied(4));
}

#[test]
fn shutdown_cancels_in_flight_requests() {
    let rig = LocalRig::new(
        "fault-shutdown",
        &[("hold", "true")],
        Duration::from_secs(30),
    );
    let mut held = rig.req(0..4, Some(b"never")).unwrap();
    held.post().unwrap();
    let mut idle = rig.req(4..5, None).unwrap();
    rig.agent.shutdown();
    assert!(rig.agent.is_shut_down());
    assert!(matches!(held.status(), Err(Error::Canceled)));
    assert!(matches!(held.post(), Err(Error::Canceled)));
    assert!(matches!(idle.post(), Err(Error::Canceled)));
    assert!(matches!(rig.req(5..6, None), Err(Error::Canceled)));
    rig.fault.release();
    assert!(matches!(held.status(), Err(Error::Canceled)));
    assert!((0..5).all(|b| rig.untouched(b)));
    assert!(rig.fault.inner().take_notifs_is_empty());
    rig.agent.shutdown(); // idempotent
}

#[test]
fn dropping_the_last_agent_handle_cancels_in_flight_requests() {
    let agent = Agent::new("fault-drop-agent", config(Duration::from_secs(30))).unwrap();
    let fault =
        FaultBackend::new(&agent.backend_init(params([("inner", "LOCAL"), ("hold", "true")])))
            .unwrap();
    agent.add_backend(fault.clone()).unwrap();
    let src = vec![1u8; BLOCK];
    let dst = vec![0u8; BLOCK];
    let mut req = {
        // SAFETY: the buffers outlive the handle (dropped at the end of this block) and
        // the request, which is canceled before they go.
        let _h = unsafe {
            agent
                .register_mem(
                    &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
                    None,
                )
                .unwrap()
        };
        let mut req = agent
            .create_xfer_req(
                XferOp::Write,
                &dram([Desc::from_slice(&src)]),
                &dram([Desc::from_slice(&dst)]),
                "fault-drop-agent",
                None,
            )
            .unwrap();
        req.post().unwrap();
        drop(agent);
        req
    };
    assert!(matches!(req.status(), Err(Error::Canceled)));
    fault.release();
    assert!(matches!(req.status(), Err(Error::Canceled)));
    assert!(dst.iter().all(|b| *b == 0));
}

/// A helper trait so the test can look at the wrapped backend's queue without taking
/// notifications away from an agent that is already shut down.
trait TakeNotifsIsEmpty {
    fn take_notifs_is_empty(&self) -> bool;
}

impl TakeNotifsIsEmpty for Arc<dyn nixl::Backend> {
    fn take_notifs_is_empty(&self) -> bool {
        let mut v = Vec::new();
        self.take_notifs(&mut v);
        v.is_empty()
    }
}

/// FAULT around LIBFABRIC, and real peer processes over LIBFABRIC.
#[cfg(feature = "libfabric")]
mod over_libfabric {
    use super::*;
    use common::{
        announce_agent, announce_path, error_after_peer_died, listening, self_test, PeerProcess,
        TIMEOUT,
    };
    use nixl::backends::fault::FaultError;
    use std::time::Instant;

    const PROVIDER: &str = "tcp;ofi_rxm";

    /// Two agents over LIBFABRIC on loopback; the initiator's backend is FAULT-wrapped.
    struct FabricRig {
        initiator: Agent,
        fault: Arc<FaultBackend>,
        target: Agent,
        src: Vec<u8>,
        dst: Vec<u8>,
        _hi: nixl::RegistrationHandle,
        _ht: nixl::RegistrationHandle,
    }

    impl FabricRig {
        fn new(tag: &str, plan: &[(&str, &str)]) -> Self {
            let initiator =
                Agent::new(format!("{tag}-i"), config(Duration::from_secs(10))).unwrap();
            let mut p = vec![("inner", "LIBFABRIC"), ("provider", PROVIDER)];
            p.extend_from_slice(plan);
            let fault = FaultBackend::new(&initiator.backend_init(params(p))).unwrap();
            initiator.add_backend(fault.clone()).unwrap();
            let target = Agent::new(format!("{tag}-t"), AgentConfig::default()).unwrap();
            target
                .create_backend("LIBFABRIC", &params([("provider", PROVIDER)]))
                .unwrap();
            let src: Vec<u8> = (0..16 * BLOCK).map(|i| (i % 251) as u8 + 1).collect();
            let dst = vec![0u8; 16 * BLOCK];
            // SAFETY: the buffers are owned by the rig; the handles are dropped with it and
            // every request is dropped before it.
            let hi = unsafe {
                initiator
                    .register_mem(&dram([Desc::from_slice(&src)]), None)
                    .unwrap()
            };
            // SAFETY: as above.
            let ht = unsafe {
                target
                    .register_mem(&dram([Desc::from_slice(&dst)]), None)
                    .unwrap()
            };
            initiator
                .load_remote_metadata(&target.local_metadata().unwrap())
                .unwrap();
            Self {
                initiator,
                fault,
                target,
                src,
                dst,
                _hi: hi,
                _ht: ht,
            }
        }

        fn req(
            &self,
            blocks: std::ops::Range<usize>,
            notif: Option<&[u8]>,
        ) -> nixl::Result<nixl::XferReq> {
            let at = |base: &Vec<u8>, i: usize| {
                Desc::new(base.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)
            };
            self.initiator.create_xfer_req(
                XferOp::Write,
                &dram(blocks.clone().map(|i| at(&self.src, i))),
                &dram(blocks.map(|i| at(&self.dst, i))),
                self.target.name(),
                notif.map(<[u8]>::to_vec),
            )
        }

        fn copied(&self, block: usize) -> bool {
            let r = block * BLOCK..(block + 1) * BLOCK;
            self.dst[r.clone()] == self.src[r]
        }
    }

    #[test]
    fn injected_disconnect_over_libfabric_then_reconnect_by_reloading_metadata() {
        let rig = FabricRig::new("fault-fab", &[]);
        let mut first = rig.req(0..4, Some(b"first")).unwrap();
        first.post().unwrap();
        finish(&mut first).unwrap();
        assert_eq!(wait_notif(&rig.target, rig.initiator.name()), b"first");
        // The 2nd completion of the next transfer cuts the peer off.
        let seen = rig.fault.stats().completions;
        rig.fault.set_plan(FaultPlan {
            disconnect_after: Some(seen + 2),
            ..FaultPlan::default()
        });
        let mut second = rig.req(4..8, Some(b"second")).unwrap();
        second.post().unwrap();
        match finish(&mut second) {
            Err(Error::RemoteDisconnect { agent, .. }) => assert_eq!(agent, rig.target.name()),
            other => panic!("expected RemoteDisconnect, got {other:?}"),
        }
        assert_eq!(rig.fault.stats().disconnects, 1);
        // Cut off: old requests, new requests and standalone notifications all say so.
        assert!(matches!(first.post(), Err(Error::RemoteDisconnect { .. })));
        assert!(matches!(
            rig.req(8..12, None),
            Err(Error::RemoteDisconnect { .. })
        ));
        assert!(matches!(
            rig.initiator.gen_notif(rig.target.name(), b"x"),
            Err(Error::RemoteDisconnect { .. })
        ));
        // Reconnect: load the peer's metadata again; the same local agent moves data again.
        rig.fault.set_plan(FaultPlan::default());
        rig.initiator
            .load_remote_metadata(&rig.target.local_metadata().unwrap())
            .unwrap();
        let mut third = rig.req(8..12, Some(b"third")).unwrap();
        third.post().unwrap();
        finish(&mut third).unwrap();
        // The failed transfer's notification either never arrives or arrives with all of
        // its data (its writes and message may all have left before the cut).
        let deadline = Instant::now() + TIMEOUT;
        let mut third_seen = false;
        while !third_seen {
            for msg in rig
                .target
                .get_notifs()
                .remove(rig.initiator.name())
                .unwrap_or_default()
            {
                match msg.as_slice() {
                    b"third" => third_seen = true,
                    b"second" => assert!((4..8).all(|b| rig.copied(b)), "half-done notification"),
                    other => panic!("unexpected notification {other:?}"),
                }
            }
            assert!(
                Instant::now() < deadline,
                "notification of the reconnected transfer lost"
            );
        }
        // The notification is behind all of its data.
        assert!((8..12).all(|b| rig.copied(b)));
    }

    #[test]
    fn runtime_disconnect_fails_a_held_transfer_and_its_notification_never_arrives() {
        let rig = FabricRig::new("fault-cut", &[("hold", "true")]);
        let mut req = rig.req(0..4, Some(b"held")).unwrap();
        req.post().unwrap();
        assert_eq!(req.status().unwrap(), XferStatus::InProgress);
        rig.fault.disconnect(rig.target.name());
        assert!(matches!(req.status(), Err(Error::RemoteDisconnect { .. })));
        rig.fault.release();
        rig.initiator
            .load_remote_metadata(&rig.target.local_metadata().unwrap())
            .unwrap();
        let mut next = rig.req(4..5, Some(b"after")).unwrap();
        next.post().unwrap();
        finish(&mut next).unwrap();
        assert_eq!(wait_notif(&rig.target, rig.initiator.name()), b"after");
        assert!(rig.copied(4));
        assert!(
            rig.dst[..4 * BLOCK].iter().all(|b| *b == 0),
            "the held transfer never ran"
        );
    }

    #[test]
    fn injected_failure_kinds_map_to_typed_errors() {
        // `fail_error` values are the two kinds a completion failure can be reported as.
        for (kind, text) in [
            (FaultError::Disconnect, "disconnect"),
            (FaultError::Backend, "backend"),
        ] {
            let (plan, _, _) =
                FaultPlan::parse(&params([("inner", "LOCAL"), ("fail_error", text)])).unwrap();
            assert_eq!(plan.fail_error, kind);
        }
    }

    // ---------------------------------------------------------------------------------------
    // The real thing over LIBFABRIC: a peer process killed with SIGKILL, then restarted.

    const PEER_LEN: usize = 32 << 20;

    /// The peer process: runs only when re-executed with NIXL_FAILURE_PEER.
    #[test]
    fn peer_process_main() {
        let Ok(announce) = std::env::var("NIXL_FAILURE_PEER") else {
            return;
        };
        let peer = Agent::new("restarting-peer", listening()).unwrap();
        // tcp itself, not shm: a peer killed mid-transfer over libfabric 1.17's shm can
        // leave the survivor spinning on a lock the dead process held.
        peer.create_backend(
            "LIBFABRIC",
            &params([("provider", PROVIDER), ("local_provider", "none")]),
        )
        .unwrap();
        let buf = vec![0u8; PEER_LEN];
        // SAFETY: `buf` lives until the process exits.
        let _h = unsafe {
            peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
                .unwrap()
        };
        announce_agent(&announce, &peer, buf.as_ptr() as u64);
        // Serve until told the data is in (or killed); bounded.
        assert_eq!(
            wait_notifs(&peer, "survivor"),
            vec![b"after restart".to_vec()]
        );
        let expected: Vec<u8> = (0..1 << 20).map(|i| (i % 241) as u8).collect();
        assert_eq!(&buf[..1 << 20], &expected[..]);
        std::fs::write(format!("{announce}.ok"), "PEER OK").unwrap();
    }

    /// A copy of this binary running [`peer_process_main`].
    fn spawn_peer(tag: &str) -> PeerProcess {
        let announce = announce_path("nixl-failure", tag);
        let mut cmd = self_test("over_libfabric::peer_process_main", false);
        cmd.env("NIXL_FAILURE_PEER", &announce);
        PeerProcess::spawn(cmd, announce)
    }

    #[test]
    fn killed_peer_is_remote_disconnect_and_a_restarted_peer_is_reachable_again() {
        // A stall timeout far above the time the transport needs to notice: the error must
        // be the typed disconnect, not the stall bound.
        let stall = Duration::from_secs(20);
        let initiator = Agent::new("survivor", config(stall)).unwrap();
        initiator
            .create_backend(
                "LIBFABRIC",
                &params([("provider", PROVIDER), ("local_provider", "none")]),
            )
            .unwrap();
        let src: Vec<u8> = (0..PEER_LEN).map(|i| (i % 241) as u8).collect();
        // SAFETY: `src` outlives the handle and every request of this test.
        let _h = unsafe {
            initiator
                .register_mem(&dram([Desc::from_slice(&src)]), None)
                .unwrap()
        };
        let write_all =
            |base: u64| {
                // 8192 descriptors of 4 KiB: a transfer that takes a while on loopback tcp.
                let n = PEER_LEN / BLOCK;
                (
                    dram((0..n).map(|i| {
                        Desc::new(src.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)
                    })),
                    dram((0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, 0))),
                )
            };

        let mut first = spawn_peer("first");
        let name = initiator.fetch_remote_metadata(first.addr).unwrap();
        let (local, remote) = write_all(first.base);
        let mut req = initiator
            .create_xfer_req(XferOp::Write, &local, &remote, &name, Some(b"x".to_vec()))
            .unwrap();
        req.post().unwrap();
        finish(&mut req).unwrap();
        // Mid-transfer: post, kill, and keep polling (reposting while the transport has not
        // noticed yet). Every poll is bounded; the first error must be the typed one.
        req.post().unwrap();
        first.child.kill().unwrap();
        first.child.wait().unwrap();
        let err = error_after_peer_died(&mut req);
        match &err {
            Error::RemoteDisconnect { agent, .. } => assert_eq!(agent, "restarting-peer"),
            other => panic!("expected RemoteDisconnect, got {other:?}"),
        }
        // Spent: it stays failed.
        assert!(matches!(req.status(), Err(Error::RemoteDisconnect { .. })));

        // The peer restarts (new process, new address, new keys): loading its metadata
        // replaces the connection; requests of the old incarnation are refused.
        let second = spawn_peer("second");
        let mut stale = {
            let (l, r) = write_all(first.base);
            // Prepared against the old incarnation before the reload.
            initiator.create_xfer_req(XferOp::Write, &l, &r, &name, None)
        };
        assert_eq!(initiator.fetch_remote_metadata(second.addr).unwrap(), name);
        if let Ok(stale) = stale.as_mut() {
            assert!(matches!(stale.post(), Err(Error::RemoteDisconnect { .. })));
        }
        let n = (1 << 20) / BLOCK;
        let mut again = initiator
            .create_xfer_req(
                XferOp::Write,
                &dram(
                    (0..n).map(|i| {
                        Desc::new(src.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)
                    }),
                ),
                &dram((0..n).map(|i| Desc::new(second.base + (i * BLOCK) as u64, BLOCK as u64, 0))),
                &name,
                Some(b"after restart".to_vec()),
            )
            .unwrap();
        again.post().unwrap();
        finish(&mut again).unwrap();
        let mut second = second;
        assert_eq!(
            second.verdict(),
            "PEER OK",
            "the restarted peer saw wrong data or no notification"
        );
    }

    #[test]
    fn released_libfabric_transfer_never_delivers_a_half_done_notification() {
        let initiator = Agent::new("rel-i", AgentConfig::default()).unwrap();
        let target = Agent::new("rel-t", AgentConfig::default()).unwrap();
        for a in [&initiator, &target] {
            a.create_backend(
                "LIBFABRIC",
                &params([("provider", PROVIDER), ("num_rails", "2")]),
            )
            .unwrap();
        }
        let len = 16 << 20;
        let src = vec![0xa5u8; len];
        let small = vec![0x5au8; BLOCK];
        let dst = vec![0u8; len + BLOCK];
        // SAFETY: the buffers outlive the handles and the requests of this test.
        let _hi = unsafe {
            initiator
                .register_mem(
                    &dram([Desc::from_slice(&src), Desc::from_slice(&small)]),
                    None,
                )
                .unwrap()
        };
        // SAFETY: as above.
        let _ht = unsafe {
            target
                .register_mem(&dram([Desc::from_slice(&dst)]), None)
                .unwrap()
        };
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        let n = len / BLOCK;
        let dst_p = dst.as_ptr() as u64;
        let big_local = dram(
            (0..n).map(|i| Desc::new(src.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)),
        );
        let big_remote =
            dram((0..n).map(|i| Desc::new(dst_p + (i * BLOCK) as u64, BLOCK as u64, 0)));
        for round in 0..3 {
            let mut big = initiator
                .create_xfer_req(
                    XferOp::Write,
                    &big_local,
                    &big_remote,
                    &name,
                    Some(b"big".to_vec()),
                )
                .unwrap();
            big.post().unwrap();
            // Released in flight (or just done: the property holds either way).
            drop(big);
            let mut marker = initiator
                .create_xfer_req(
                    XferOp::Write,
                    &dram([Desc::from_slice(&small)]),
                    &dram([Desc::new(dst_p + len as u64, BLOCK as u64, 0)]),
                    &name,
                    Some(format!("marker {round}").into_bytes()),
                )
                .unwrap();
            marker.post().unwrap();
            finish(&mut marker).unwrap();
            // Collect until the marker is in; a "big" notification seen on the way must come
            // with every byte of its data.
            let deadline = Instant::now() + TIMEOUT;
            let mut marker_seen = false;
            while !marker_seen {
                for msg in target.get_notifs().remove("rel-i").unwrap_or_default() {
                    if msg == b"big" {
                        // SAFETY: reading the target buffer; the only writer is the released
                        // transfer, whose notification says it is finished.
                        let seen = unsafe { std::slice::from_raw_parts(dst.as_ptr(), len) };
                        assert!(seen.iter().all(|b| *b == 0xa5), "half-done notification");
                    } else {
                        assert_eq!(msg, format!("marker {round}").into_bytes());
                        marker_seen = true;
                    }
                }
                assert!(Instant::now() < deadline, "marker notification lost");
            }
        }
    }

    #[test]
    fn libfabric_shutdown_cancels_in_flight_requests() {
        let initiator = Agent::new("sd-i", AgentConfig::default()).unwrap();
        let target = Agent::new("sd-t", AgentConfig::default()).unwrap();
        for a in [&initiator, &target] {
            a.create_backend("LIBFABRIC", &params([("provider", PROVIDER)]))
                .unwrap();
        }
        let len = 16 << 20;
        let src = vec![1u8; len];
        let dst = vec![0u8; len];
        // SAFETY: the buffers outlive the handles and the requests of this test.
        let _hi = unsafe {
            initiator
                .register_mem(&dram([Desc::from_slice(&src)]), None)
                .unwrap()
        };
        // SAFETY: as above.
        let _ht = unsafe {
            target
                .register_mem(&dram([Desc::from_slice(&dst)]), None)
                .unwrap()
        };
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        let n = len / BLOCK;
        let mut req =
            initiator
                .create_xfer_req(
                    XferOp::Write,
                    &dram((0..n).map(|i| {
                        Desc::new(src.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)
                    })),
                    &dram((0..n).map(|i| {
                        Desc::new(dst.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)
                    })),
                    &name,
                    Some(b"shutdown".to_vec()),
                )
                .unwrap();
        req.post().unwrap();
        let in_flight = req.status().unwrap() == XferStatus::InProgress;
        initiator.shutdown();
        if in_flight {
            assert!(matches!(req.status(), Err(Error::Canceled)));
        }
        assert!(matches!(req.post(), Err(Error::Canceled)));
        assert!(!initiator.has_remote(&name));
        assert!(initiator.listen_addr().is_none());
        drop(req);
        // The target is unaffected, and a notification, if any, came with all the data.
        if let Some(msgs) = target.get_notifs().remove("sd-i") {
            assert_eq!(msgs, vec![b"shutdown".to_vec()]);
            assert!(dst.iter().all(|b| *b == 1));
        }
    }
}
