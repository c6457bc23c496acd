#![cfg(feature = "libfabric")]
//! A restarted *initiator* (issue 27, found by `nixl-soak`): a peer process that the
//! survivor has loaded is SIGKILLed and started again under the same name; its new
//! incarnation WRITEs to the survivor with a notification before the survivor has loaded
//! its new metadata. The notification must arrive, under the peer's name, with the data:
//! the name's loaded incarnation is dead, so the new endpoint is a stranger's (delivered
//! with the default `notif_senders=any`), not a forgery of a live peer's. Before the fix
//! the rail refused it ("a notification naming `restarter` comes from none of its
//! endpoints") until the survivor reloaded the peer, and the initiator's notification
//! was lost.

mod common;

use common::{
    announce_agent, announce_path, dram, finish, pattern, self_test, PeerProcess, TIMEOUT,
};
use nixl::{params, Agent, Desc, XferOp};
use std::time::{Duration, Instant};

const LEN: usize = 1 << 20;
/// The notification must arrive within this of the peer's WRITE completing.
const NOTIF_BOUND: Duration = Duration::from_secs(10);

fn agent(name: &str, provider: &str) -> Agent {
    let mut p = params([("provider", provider)]);
    if provider != "shm" {
        p.insert("local_provider".into(), "none".into());
    }
    common::agent_with_backend(name, common::listening(), "LIBFABRIC", &p)
}

/// The peer process: runs only when re-executed with `NIXL_RI_SURVIVOR`.
#[test]
fn restarter_main() {
    let Ok(survivor) = std::env::var("NIXL_RI_SURVIVOR") else {
        return;
    };
    let provider = std::env::var("NIXL_RI_PROVIDER").unwrap();
    let announce = std::env::var("NIXL_RI_ANNOUNCE").unwrap();
    let seed: u8 = std::env::var("NIXL_RI_SEED").unwrap().parse().unwrap();
    let a = agent("restarter", &provider);
    let buf = pattern(seed, LEN);
    // SAFETY: `buf` outlives the handle and every request (the process is killed or
    // returns after them).
    let _h = unsafe {
        a.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    let survivor_name = a.fetch_remote_metadata(survivor.parse().unwrap()).unwrap();
    if let Ok(target) = std::env::var("NIXL_RI_WRITE_TO") {
        let mut req = a
            .create_xfer_req(
                XferOp::Write,
                &dram([Desc::from_slice(&buf)]),
                &dram([Desc::new(target.parse().unwrap(), LEN as u64, 0)]),
                &survivor_name,
                Some(format!("incarnation {seed}").into_bytes()),
            )
            .unwrap();
        req.post().unwrap();
        finish(&mut req).unwrap();
    }
    announce_agent(&announce, &a, buf.as_ptr() as u64);
    // Killed by the parent; bounded in case it is not.
    std::thread::sleep(TIMEOUT);
}

fn start(survivor: &Agent, provider: &str, seed: u8, write_to: Option<u64>) -> PeerProcess {
    let announce = announce_path("restarted-initiator", &format!("{provider}-{seed}"));
    let mut cmd = self_test("restarter_main", false);
    cmd.env(
        "NIXL_RI_SURVIVOR",
        survivor.listen_addr().unwrap().to_string(),
    )
    .env("NIXL_RI_PROVIDER", provider)
    .env("NIXL_RI_ANNOUNCE", &announce)
    .env("NIXL_RI_SEED", seed.to_string());
    if let Some(addr) = write_to {
        cmd.env("NIXL_RI_WRITE_TO", addr.to_string());
    }
    PeerProcess::spawn(cmd, announce)
}

fn a_restarted_initiator_is_heard(provider: &str) {
    common::init_tracing();
    let survivor = agent(
        &format!("survivor-{}", provider.replace(';', "_")),
        provider,
    );
    let dst = vec![0u8; LEN];
    let mut scratch = vec![0u8; LEN];
    // SAFETY: both buffers outlive the handle and every request of this test.
    let _h = unsafe {
        survivor
            .register_mem(
                &dram([Desc::from_slice(&dst), Desc::from_slice(&scratch)]),
                None,
            )
            .unwrap()
    };
    // First incarnation: loaded by the survivor, which READs from it.
    let first = start(&survivor, provider, 1, None);
    assert_eq!(
        survivor.fetch_remote_metadata(first.addr).unwrap(),
        "restarter"
    );
    let mut req = survivor
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::from_slice(&scratch)]),
            &dram([Desc::new(first.base, LEN as u64, 0)]),
            "restarter",
            None,
        )
        .unwrap();
    req.post().unwrap();
    finish(&mut req).unwrap();
    drop(req);
    assert_eq!(scratch, pattern(1, LEN));
    scratch.fill(0);
    let old_base = first.base;
    drop(first); // SIGKILL, reaped

    // Second incarnation: WRITEs to the survivor with a notification at once, before the
    // survivor knows of it.
    let second = start(&survivor, provider, 2, Some(dst.as_ptr() as u64));
    let deadline = Instant::now() + NOTIF_BOUND;
    let msgs = loop {
        if let Some(m) = survivor
            .wait_notifs(Duration::from_millis(50))
            .remove("restarter")
        {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "{provider}: the restarted initiator's notification never arrived"
        );
    };
    assert_eq!(msgs, vec![b"incarnation 2".to_vec()], "{provider}");
    assert!(dst == pattern(2, LEN), "{provider}: data");
    // The survivor still has the first incarnation loaded: nothing was reloaded.
    assert!(survivor
        .remote_regions("restarter")
        .unwrap()
        .iter()
        .any(|r| r.desc.addr == old_base));
    // Reloading the new incarnation and reaching it works as before.
    assert_eq!(
        survivor
            .fetch_remote_metadata(second.addr)
            .unwrap_or_else(|e| {
                // The old incarnation is not known gone yet: a transfer to it says so.
                assert!(matches!(e, nixl::Error::MetadataRefused { .. }), "{e}");
                survivor.invalidate_remote("restarter").unwrap();
                survivor.fetch_remote_metadata(second.addr).unwrap()
            }),
        "restarter"
    );
    let mut req = survivor
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::from_slice(&scratch)]),
            &dram([Desc::new(second.base, LEN as u64, 0)]),
            "restarter",
            None,
        )
        .unwrap();
    req.post().unwrap();
    finish(&mut req).unwrap();
    assert_eq!(scratch, pattern(2, LEN));
}

#[test]
fn over_tcp_rxm() {
    a_restarted_initiator_is_heard("tcp;ofi_rxm");
}

#[test]
fn over_sockets() {
    a_restarted_initiator_is_heard("sockets");
}

#[test]
fn over_shm() {
    a_restarted_initiator_is_heard("shm");
}
