//! The etcd metadata service against a real etcd server (Debian's `etcd-server`),
//! started per test on loopback ports with a temporary data directory and removed after.
//! Needs `--features etcd`; the `etcd` binary is `NIXL_TEST_ETCD_BIN` or `etcd` on the
//! PATH, and a missing one fails the tests.
#![cfg(feature = "etcd")]

mod common;
#[path = "support/etcd_server.rs"]
mod etcd_server;

use etcd_server::{free_port, EtcdServer as Etcd};
use std::process::{Child, Command, Stdio};

use common::{dram, finish, wait_notif, TIMEOUT};
use nixl::etcd::{EtcdConfig, EtcdMetadata, DEFAULT_LABEL};
use nixl::{Agent, AgentConfig, Desc, Error, XferOp};
use std::time::{Duration, Instant};

const PROVIDER: &str = "tcp;ofi_rxm";

impl Etcd {
    fn config(&self, namespace: &str) -> EtcdConfig {
        let mut config = EtcdConfig::new([self.endpoint.clone()]);
        config.namespace = namespace.to_string();
        config.timeout = Duration::from_secs(10);
        config
    }
}

fn fabric_agent(name: &str) -> Agent {
    common::fabric_agent(name, PROVIDER, &[])
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Writes `src` into the peer's `dst` and checks it arrived.
fn write_and_verify(initiator: &Agent, peer: &str, src: &[u8], dst: &[u8], msg: &[u8]) {
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(src)]),
            &dram([Desc::from_slice(dst)]),
            peer,
            Some(msg.to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    finish(&mut req).unwrap();
}

#[test]
fn publish_fetch_and_transfer_with_nixl_key_layout() {
    let etcd = Etcd::start("basic");
    let initiator = fabric_agent("decode-0");
    let target = fabric_agent("prefill-0");
    let src = vec![0x3cu8; 1 << 16];
    let dst = vec![0u8; 1 << 16];
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
    let ei = EtcdMetadata::connect(&initiator, etcd.config("/nixl/agents")).unwrap();
    let et = EtcdMetadata::connect(&target, etcd.config("/nixl/agents/")).unwrap();
    et.publish().unwrap();
    // NIXL's layout: a presence key and the full metadata under the default label.
    assert_eq!(
        ei.labels("prefill-0").unwrap(),
        vec!["".to_string(), DEFAULT_LABEL.to_string()]
    );
    assert_eq!(
        et.config().key("prefill-0", DEFAULT_LABEL),
        "/nixl/agents/prefill-0/metadata"
    );
    assert_eq!(ei.fetch("prefill-0").unwrap(), "prefill-0");
    assert!(initiator.has_remote("prefill-0"));
    assert_eq!(ei.watched(), vec!["prefill-0".to_string()]);
    write_and_verify(&initiator, "prefill-0", &src, &dst, b"via etcd");
    assert_eq!(wait_notif(&target, "decode-0"), b"via etcd");
    assert_eq!(src, dst);
    // Another namespace does not see it.
    let other = EtcdMetadata::connect(&initiator, {
        let mut c = etcd.config("/elsewhere");
        c.timeout = Duration::from_millis(500);
        c
    })
    .unwrap();
    assert!(other.labels("prefill-0").unwrap().is_empty());
    assert!(matches!(other.fetch("prefill-0"), Err(Error::Timeout(_))));
    // Hostile names are refused before any key is built.
    assert!(matches!(ei.fetch("a/b"), Err(Error::InvalidParam(_))));
}

#[test]
fn fetch_waits_for_a_late_publisher() {
    let etcd = Etcd::start("late");
    let initiator = fabric_agent("early");
    let target = fabric_agent("late");
    let ei = EtcdMetadata::connect(&initiator, etcd.config("/nixl/agents")).unwrap();
    let et = EtcdMetadata::connect(&target, etcd.config("/nixl/agents")).unwrap();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| ei.fetch("late"));
        // Publish after the fetch started (it may or may not be waiting yet: both paths
        // end with the metadata loaded).
        std::thread::sleep(Duration::from_millis(100));
        et.publish().unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), "late");
    });
    assert!(initiator.has_remote("late"));
}

#[test]
fn partial_metadata_by_label() {
    let etcd = Etcd::start("partial");
    let initiator = fabric_agent("reader");
    let target = fabric_agent("holder");
    let a = vec![1u8; 8192];
    let b = vec![2u8; 8192];
    // SAFETY: the buffers outlive the handle.
    let _ht = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&a), Desc::from_slice(&b)]), None)
            .unwrap()
    };
    let ei = EtcdMetadata::connect(&initiator, {
        let mut c = etcd.config("/nixl/agents");
        c.timeout = Duration::from_secs(2);
        c
    })
    .unwrap();
    let et = EtcdMetadata::connect(&target, etcd.config("/nixl/agents")).unwrap();
    et.publish_partial("layer-0", Some(&dram([Desc::from_slice(&a)])), true)
        .unwrap();
    et.publish_partial("layer-1", Some(&dram([Desc::from_slice(&b)])), false)
        .unwrap();
    assert_eq!(
        ei.labels("holder").unwrap(),
        vec!["".to_string(), "layer-0".into(), "layer-1".into()]
    );
    ei.fetch_partial("holder", "layer-0").unwrap();
    let regions = initiator.remote_regions("holder").unwrap();
    assert_eq!(regions.len(), 1);
    assert_eq!(regions[0].desc.addr, a.as_ptr() as u64);
    ei.fetch_partial("holder", "layer-1").unwrap();
    assert_eq!(initiator.remote_regions("holder").unwrap().len(), 2);
    // No such label: bounded wait, typed error.
    assert!(matches!(
        ei.fetch_partial("holder", "layer-9"),
        Err(Error::Timeout(_))
    ));
    assert!(matches!(
        et.publish_partial(DEFAULT_LABEL, None, true),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        et.publish_partial("", None, true),
        Err(Error::InvalidParam(_))
    ));
}

#[test]
fn watch_invalidates_a_peer_that_leaves_and_reloads_one_that_republishes() {
    let etcd = Etcd::start("watch");
    let initiator = fabric_agent("watcher");
    let src = vec![0x11u8; 1 << 16];
    // SAFETY: `src` outlives the handle and the requests.
    let _hi = unsafe {
        initiator
            .register_mem(&dram([Desc::from_slice(&src)]), None)
            .unwrap()
    };
    let ei = EtcdMetadata::connect(&initiator, etcd.config("/nixl/agents")).unwrap();

    // First incarnation of the peer.
    let dst1 = vec![0u8; 1 << 16];
    let peer1 = fabric_agent("worker");
    // SAFETY: `dst1` outlives the handle.
    let h1 = unsafe {
        peer1
            .register_mem(&dram([Desc::from_slice(&dst1)]), None)
            .unwrap()
    };
    let e1 = EtcdMetadata::connect(&peer1, etcd.config("/nixl/agents")).unwrap();
    e1.publish().unwrap();
    ei.fetch("worker").unwrap();
    let mut old = initiator
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(&src)]),
            &dram([Desc::from_slice(&dst1)]),
            "worker",
            None,
        )
        .unwrap();
    old.post().unwrap();
    finish(&mut old).unwrap();

    // It leaves: the watch invalidates it, and its old request is refused.
    e1.unpublish().unwrap();
    wait_until("invalidation of a peer that left", || {
        !initiator.has_remote("worker")
    });
    assert!(matches!(old.post(), Err(Error::RemoteDisconnect { .. })));
    drop(e1);
    drop(h1);
    drop(peer1);

    // It comes back as a new process would: same name, new connection and keys. The
    // watch loads it without the application doing anything.
    let dst2 = vec![0u8; 1 << 16];
    let peer2 = fabric_agent("worker");
    // SAFETY: `dst2` outlives the handle.
    let _h2 = unsafe {
        peer2
            .register_mem(&dram([Desc::from_slice(&dst2)]), None)
            .unwrap()
    };
    let e2 = EtcdMetadata::connect(&peer2, etcd.config("/nixl/agents")).unwrap();
    e2.publish().unwrap();
    wait_until("reload of a republished peer", || {
        initiator
            .remote_regions("worker")
            .is_ok_and(|r| r.iter().any(|r| r.desc.addr == dst2.as_ptr() as u64))
    });
    write_and_verify(&initiator, "worker", &src, &dst2, b"second life");
    assert_eq!(wait_notif(&peer2, "watcher"), b"second life");
    assert_eq!(src, dst2);

    // Republishing while known (new registration) reloads too.
    let extra = vec![0u8; 4096];
    // SAFETY: `extra` outlives the handle.
    let _h3 = unsafe {
        peer2
            .register_mem(&dram([Desc::from_slice(&extra)]), None)
            .unwrap()
    };
    e2.publish().unwrap();
    wait_until("reload after republish", || {
        initiator
            .remote_regions("worker")
            .is_ok_and(|r| r.iter().any(|r| r.desc.addr == extra.as_ptr() as u64))
    });
    // Dropping the peer's client revokes its lease: it leaves.
    drop(e2);
    wait_until("invalidation after the client was dropped", || {
        !initiator.has_remote("worker")
    });
}

/// The peer side of the lease test: runs only when re-executed with NIXL_ETCD_CHILD.
#[test]
fn crashing_peer_main() {
    let Ok(endpoint) = std::env::var("NIXL_ETCD_CHILD") else {
        return;
    };
    let agent = fabric_agent("crashy");
    let mut config = EtcdConfig::new([endpoint]);
    config.lease_ttl = Some(Duration::from_secs(2));
    let etcd = EtcdMetadata::connect(&agent, config).unwrap();
    etcd.publish().unwrap();
    std::fs::write(std::env::var("NIXL_ETCD_ANNOUNCE").unwrap(), "up").unwrap();
    // Killed by the parent; bounded in case it is not.
    std::thread::sleep(TIMEOUT);
}

#[test]
fn a_crashed_peer_is_invalidated_when_its_lease_expires() {
    let etcd = Etcd::start("lease");
    let announce = etcd.dir.join("child-up");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crashing_peer_main", "--test-threads=1"])
        .env("NIXL_ETCD_CHILD", &etcd.endpoint)
        .env("NIXL_ETCD_ANNOUNCE", &announce)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = Kill(&mut child);
    wait_until("the child published", || announce.exists());
    let initiator = fabric_agent("bystander");
    let ei = EtcdMetadata::connect(&initiator, etcd.config("/nixl/agents")).unwrap();
    ei.fetch("crashy").unwrap();
    assert!(initiator.has_remote("crashy"));
    drop(child); // SIGKILL: no unpublish, no revoke; only the lease can tell.
    wait_until("invalidation by lease expiry", || {
        !initiator.has_remote("crashy")
    });
    assert!(ei.labels("crashy").unwrap().is_empty());
}

#[test]
fn unreachable_etcd_is_a_bounded_typed_error() {
    let agent = Agent::new("lonely", AgentConfig::default()).unwrap();
    let mut config = EtcdConfig::new([format!("http://127.0.0.1:{}", free_port())]);
    config.timeout = Duration::from_millis(500);
    match EtcdMetadata::connect(&agent, config) {
        Err(Error::Timeout(_)) | Err(Error::Backend { .. }) => {}
        other => panic!("expected a timeout or a connection error, got {other:?}"),
    }
    assert!(matches!(
        EtcdMetadata::connect(&agent, EtcdConfig::new(Vec::<String>::new())),
        Err(Error::InvalidParam(_))
    ));
}
