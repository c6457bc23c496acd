#![cfg(feature = "verbs")]
//! Issue 28, finding 6 ("the VERBS side channel starts a thread per connection without a
//! cap or idle timeout"), against a VERBS backend on soft-RoCE (run in the guest by
//! `cargo xtask test`, which sets `RDMA_TEST_DEVICE=rxe0`; skipped elsewhere): raw TCP
//! connections to the target's side channel that send junk, nothing, or a byte at a
//! time. The target's handshake threads (counted in `/proc/self/task`) never exceed the
//! cap, a connection over the cap is closed at once, silent and trickling ones are closed
//! by the handshake deadline, and afterwards a real peer still connects and WRITEs
//! (verified bytes, then its notification). The side channel's accept loop is also
//! tested without a device (`side_channel::tests` in the library).
//!
//! One test in its own binary: no other agent of this process serves handshakes while
//! the threads are counted.

mod common;
#[path = "common/slow_clients.rs"]
mod slow_clients;

use common::{dram, pattern, rdma_device as device, wait_notif, TIMEOUT};
use nixl::backends::verbs::VerbsBackend;
use nixl::{params, Agent, AgentConfig, Backend, Desc, XferOp};
use slow_clients::{closed_after, threads_named};
use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Handshakes a side channel serves at once (`side_channel::MAX_HANDSHAKES`).
const MAX_HANDSHAKES: usize = 64;
/// How long a side channel waits for a handshake's first frame (`HANDSHAKE_TIMEOUT`).
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// Slack for a loaded two-CPU guest.
const SLACK: Duration = Duration::from_secs(3);

/// Threads of this process serving a side-channel handshake (`nixl-verbs-hello`).
fn hello_threads() -> usize {
    threads_named("nixl-verbs-hello")
}

/// Waits until `done`, failing after `limit`; meanwhile the handshake threads never
/// exceed the cap.
fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        let threads = hello_threads();
        assert!(
            threads <= MAX_HANDSHAKES,
            "{threads} handshake threads (cap {MAX_HANDSHAKES})"
        );
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn side_channel_floods_are_capped_and_a_real_peer_still_transfers() {
    let Some(dev) = device() else { return };
    let target = Agent::new("sc-flood-target", AgentConfig::default()).unwrap();
    let verbs = Arc::new(
        VerbsBackend::open(&target.backend_init(params([("device", dev.as_str())]))).unwrap(),
    );
    target
        .add_backend(verbs.clone() as Arc<dyn Backend>)
        .unwrap();
    let at = verbs.side_channel_addr();
    assert_eq!(hello_threads(), 0);
    // Junk: a length no frame may have, and a whole frame that is no HELLO: each closed
    // long before the deadline.
    for junk in [
        u32::MAX.to_le_bytes().to_vec(),
        [8u32.to_le_bytes().to_vec(), b"notahelo".to_vec()].concat(),
    ] {
        let mut s = TcpStream::connect(at).unwrap();
        s.write_all(&junk).unwrap();
        let after = closed_after(s, false, HANDSHAKE_DEADLINE).expect("junk left open");
        assert!(
            after < HANDSHAKE_DEADLINE / 2,
            "junk closed after {after:?}"
        );
    }
    wait_for("junk's threads ended", SLACK, || hello_threads() == 0);
    // Every slot taken: half by connections that send nothing, half by ones that
    // announce a frame and send a byte of it every 100 ms.
    let mut holders = Vec::new();
    for i in 0..MAX_HANDSHAKES {
        let mut s = TcpStream::connect(at).unwrap();
        let trickle = i % 2 == 1;
        if trickle {
            s.write_all(&100u32.to_le_bytes()).unwrap();
        }
        holders.push(std::thread::spawn(move || {
            closed_after(s, trickle, HANDSHAKE_DEADLINE * 3)
        }));
    }
    wait_for("every slot held", HANDSHAKE_DEADLINE / 2, || {
        hello_threads() == MAX_HANDSHAKES
    });
    // Over the cap: closed at once, no thread started.
    for _ in 0..32 {
        let s = TcpStream::connect(at).unwrap();
        let after = closed_after(s, false, HANDSHAKE_DEADLINE)
            .expect("a connection over the cap stayed open");
        assert!(after < HANDSHAKE_DEADLINE / 4, "closed after {after:?}");
        assert!(hello_threads() <= MAX_HANDSHAKES);
    }
    // The deadline closes every holder, trickling or silent (each was opened before the
    // over-cap round, so within the deadline and slack of now).
    for holder in holders {
        let closed = holder
            .join()
            .unwrap()
            .expect("a connection that never sent a whole frame stayed open");
        assert!(
            closed < HANDSHAKE_DEADLINE + SLACK,
            "closed after {closed:?}"
        );
    }
    wait_for("every handshake thread ended", SLACK, || {
        hello_threads() == 0
    });
    // A real peer still connects, and its WRITE lands, byte for byte.
    let initiator = Agent::new("sc-flood-init", AgentConfig::default()).unwrap();
    initiator
        .create_backend("VERBS", &params([("device", dev.as_str())]))
        .unwrap();
    let len = 1 << 20;
    let src = pattern(0x5c, len);
    let mut dst = vec![0u8; len];
    // SAFETY: both buffers outlive the handles and the request (dropped at the end).
    let _hi = unsafe {
        initiator
            .register_mem(&dram([Desc::from_slice(&src)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _ht = unsafe {
        target
            .register_mem(
                &dram([Desc::new(dst.as_mut_ptr() as u64, len as u64, 0)]),
                None,
            )
            .unwrap()
    };
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(&src)]),
            &dram([Desc::new(dst.as_ptr() as u64, len as u64, 0)]),
            &name,
            Some(b"after the flood".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&target, initiator.name()), b"after the flood");
    assert!(dst == src, "the WRITE after the flood did not land whole");
    assert_eq!(verbs.refused_hellos(), 0);
}
