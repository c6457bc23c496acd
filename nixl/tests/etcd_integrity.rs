//! What etcd stores is checked like any metadata blob: a value corrupted in the store
//! (one bit of a region) is refused by a fetch with `MalformedMetadata` naming the
//! integrity check, and a watch that sees the corrupted value ignores it, the watching
//! agent keeping the peer as it was loaded and moving data with it. Needs
//! `--features etcd` and the `etcd` binary (`NIXL_TEST_ETCD_BIN` or on the PATH; Debian:
//! etcd-server); a missing one fails the test.
#![cfg(feature = "etcd")]

mod common;
#[path = "support/etcd_server.rs"]
mod etcd_server;

use etcd_server::EtcdServer as Etcd;

use common::{dram, fabric_agent, finish, wait_notif, TIMEOUT};
use nixl::etcd::{EtcdConfig, EtcdMetadata, DEFAULT_LABEL};
use nixl::{Agent, Desc, Error, XferOp};
use std::time::{Duration, Instant};

const PROVIDER: &str = "tcp;ofi_rxm";

impl Etcd {
    fn config(&self) -> EtcdConfig {
        let mut config = EtcdConfig::new([self.endpoint.clone()]);
        config.timeout = Duration::from_secs(10);
        config
    }

    /// Reads `key`, lets `edit` change the value, writes it back: what a faulty store,
    /// disk or proxy could do behind the clients' backs.
    fn tamper(&self, key: &str, edit: impl FnOnce(&mut Vec<u8>)) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut client = etcd_client::Client::connect([self.endpoint.as_str()], None)
                .await
                .unwrap();
            let got = client.get(key, None).await.unwrap();
            let mut value = got.kvs().first().expect("the key exists").value().to_vec();
            edit(&mut value);
            client.put(key, value, None).await.unwrap();
        });
    }
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn write_and_verify(initiator: &Agent, target: &Agent, src: &[u8], dst: &[u8], msg: &[u8]) {
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(src)]),
            &dram([Desc::from_slice(dst)]),
            target.name(),
            Some(msg.to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    finish(&mut req).unwrap();
    assert_eq!(wait_notif(target, initiator.name()), msg);
    assert_eq!(src, dst);
}

fn is_integrity_failure(result: &nixl::Result<String>) -> bool {
    matches!(result, Err(Error::MalformedMetadata(m)) if m.contains("integrity check failed"))
}

#[test]
fn corrupted_values_in_etcd_are_refused_and_watchers_keep_their_peer() {
    let etcd = Etcd::start("corrupt");
    let initiator = fabric_agent("integrity-reader", PROVIDER, &[]);
    let target = fabric_agent("integrity-holder", PROVIDER, &[]);
    let src = vec![0x5au8; 1 << 16];
    let dst = vec![0u8; 1 << 16];
    let more = vec![0u8; 1 << 16];
    // SAFETY: the buffers outlive the handles and every request of this test.
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
    let ei = EtcdMetadata::connect(&initiator, etcd.config()).unwrap();
    let et = EtcdMetadata::connect(&target, etcd.config()).unwrap();
    et.publish().unwrap();
    ei.fetch(target.name()).unwrap();
    let regions = initiator.remote_regions(target.name()).unwrap();
    assert_eq!(regions.len(), 1);

    // One bit of the stored full metadata flips (the last bytes are the region's key).
    let key = etcd.config().key(target.name(), DEFAULT_LABEL);
    etcd.tamper(&key, |value| {
        let at = value.len() - 3;
        value[at] ^= 0x04;
    });
    // A new reader refuses it, naming the check.
    let late = fabric_agent("integrity-late", PROVIDER, &[]);
    let el = EtcdMetadata::connect(&late, etcd.config()).unwrap();
    let refused = el.fetch(target.name());
    assert!(is_integrity_failure(&refused), "{refused:?}");
    assert!(!late.has_remote(target.name()), "nothing of it was loaded");

    // The partial metadata under a label is checked too.
    et.publish_partial("layer-0", Some(&dram([Desc::from_slice(&dst)])), false)
        .unwrap();
    etcd.tamper(&etcd.config().key(target.name(), "layer-0"), |value| {
        value[20] ^= 0x80;
    });
    let refused = el.fetch_partial(target.name(), "layer-0");
    assert!(is_integrity_failure(&refused), "{refused:?}");

    // The watching reader saw the corrupted full metadata and ignored it. A valid
    // republication after it (one more region) is loaded: the watch has passed the
    // corrupted value by then, and the peer is as before plus that region.
    // SAFETY: `more` outlives the handle.
    let _hm = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&more)]), None)
            .unwrap()
    };
    et.publish().unwrap();
    wait_until("reload of the valid republication", || {
        initiator
            .remote_regions(target.name())
            .is_ok_and(|r| r.len() == 2)
    });
    assert!(initiator
        .remote_regions(target.name())
        .unwrap()
        .contains(&regions[0]));
    write_and_verify(&initiator, &target, &src, &dst, b"after corruption");
    write_and_verify(&initiator, &target, &src, &more, b"new region");
}
