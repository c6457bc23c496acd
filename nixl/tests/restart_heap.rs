#![cfg(feature = "libfabric")]
//! Live heap of a long-lived agent (issue 27): the soak saw its long-lived agents' live
//! heap (glibc `mallinfo2`: allocated and not freed) creep (figures: `docs/SOAK.md`).
//! It was not the restarts: every notified WRITE whose data landed before its message
//! left its key in a per-sender queue, compacted only past 8,192 keys (the notification
//! tracker in `backends/shared.rs`). These tests count this process's live heap over
//! thousands of transfers, and over hundreds of restarts of a peer under the same name
//! (in this process and as SIGKILLed processes), against bounds that the old growth
//! exceeded (transfers) or that a leak of a few hundred bytes per restart would.

mod common;

use common::{
    announce_agent, announce_path, dram, finish, pattern, self_test, wait_notif, PeerProcess,
    TIMEOUT,
};
use nixl::{params, Agent, Desc, XferOp};

const LEN: usize = 64 << 10;

/// This process's allocator: bytes allocated and not freed (`uordblks + hblkhd`), or
/// `None` where the C library is not glibc.
fn live_heap() -> Option<i64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments and returns a plain struct by value
        // (glibc 2.33 and later); it takes the arenas' locks itself.
        let info = unsafe { libc::mallinfo2() };
        Some((info.uordblks + info.hblkhd) as i64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}

/// As the soak's agents: `tcp;ofi_rxm` for same-host peers too, listening for metadata.
fn agent(name: &str) -> Agent {
    let p = params([("provider", "tcp;ofi_rxm"), ("local_provider", "none")]);
    common::agent_with_backend(name, common::listening(), "LIBFABRIC", &p)
}

/// `survivor` and a buffer of [`LEN`] bytes it registered.
struct Survivor {
    // Dropped in this order: the registration before the agent and the buffer.
    _handle: nixl::RegistrationHandle,
    agent: Agent,
    buf: Vec<u8>,
}

impl Survivor {
    fn new() -> Self {
        let agent = agent("survivor");
        let buf = vec![0u8; LEN];
        // SAFETY: `buf` lives in the same struct as the handle and is dropped after it
        // (field order); moving the Vec does not move its heap buffer.
        let handle = unsafe {
            agent
                .register_mem(&dram([Desc::from_slice(&buf)]), None)
                .unwrap()
        };
        Self {
            agent,
            buf,
            _handle: handle,
        }
    }

    fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }

    /// Loads `peer`'s metadata from its listener; the previous incarnation, not known to
    /// be gone yet, is invalidated first where the load is refused for it.
    fn load(&self, listen: std::net::SocketAddr) {
        match self.agent.fetch_remote_metadata(listen) {
            Ok(_) => {}
            Err(nixl::Error::MetadataRefused { .. }) => {
                self.agent.invalidate_remote("peer").unwrap();
                self.agent.fetch_remote_metadata(listen).unwrap();
            }
            Err(e) => panic!("loading the peer: {e}"),
        }
    }

    /// READs the peer's buffer at `remote` into its own.
    fn read_from_peer(&self, remote: u64) {
        let mut req = self
            .agent
            .create_xfer_req(
                XferOp::Read,
                &dram([Desc::new(self.addr(), LEN as u64, 0)]),
                &dram([Desc::new(remote, LEN as u64, 0)]),
                "peer",
                None,
            )
            .unwrap();
        req.post().unwrap();
        finish(&mut req).unwrap();
    }
}

/// `peer` WRITEs `buf` to the survivor's buffer with a notification, which the survivor
/// takes.
fn notified_write(peer: &Agent, buf: &[u8], survivor: &Survivor) {
    let mut req = peer
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(buf)]),
            &dram([Desc::new(survivor.addr(), LEN as u64, 0)]),
            "survivor",
            Some(b"from the peer".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    finish(&mut req).unwrap();
    drop(req);
    wait_notif(&survivor.agent, "peer");
}

/// Runs `rounds` of `round` after `warmup` of them and returns the live heap's growth
/// over the measured ones, printing it every `every` rounds.
fn growth(warmup: usize, rounds: usize, every: usize, mut round: impl FnMut(usize)) -> i64 {
    for i in 0..warmup {
        round(i);
    }
    let base = live_heap().unwrap();
    for i in 0..rounds {
        round(warmup + i);
        if (i + 1) % every == 0 {
            println!(
                "after {} rounds: live heap {:+} B",
                i + 1,
                live_heap().unwrap() - base
            );
        }
    }
    live_heap().unwrap() - base
}

/// The live heap is the whole process's: the measuring tests run one at a time (the
/// guard), and only where the C library is glibc (`None` after printing why not).
fn measuring() -> Option<std::sync::MutexGuard<'static, ()>> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    common::init_tracing();
    if live_heap().is_none() {
        println!("skipped: the C library is not glibc (no mallinfo2)");
        return None;
    }
    Some(ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A peer that keeps WRITEing with notifications (data landing before each message) and
/// is READ from: after a warm-up the survivor's live heap stays flat. Before the fix
/// every transfer left its 8-byte key in the queue (before/after figures:
/// `docs/SOAK.md`).
#[test]
fn thousands_of_notified_transfers_leave_the_live_heap_flat() {
    let Some(_one_at_a_time) = measuring() else {
        return;
    };
    let survivor = Survivor::new();
    let peer = agent("peer");
    let buf = pattern(3, LEN);
    // SAFETY: `buf` outlives the handle and every request (dropped after them).
    let _h = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    peer.fetch_remote_metadata(survivor.agent.listen_addr().unwrap())
        .unwrap();
    survivor.load(peer.listen_addr().unwrap());
    let grew = growth(1000, 5000, 1000, |_| {
        notified_write(&peer, &buf, &survivor);
        survivor.read_from_peer(buf.as_ptr() as u64);
    });
    assert!(
        grew < 24 << 10,
        "the survivor's live heap grew by {grew} B over 5,000 transfers"
    );
}

/// One incarnation of `peer` in this process: both sides load each other, the peer
/// WRITEs to the survivor with a notification, the survivor READs from the peer, and the
/// peer leaves cleanly (invalidating itself at the survivor).
fn one_incarnation(survivor: &Survivor, round: usize) {
    let peer = agent("peer");
    let buf = pattern(round as u8, LEN);
    // SAFETY: `buf` outlives the handle and every request (dropped at the end).
    let handle = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    let survivor_listen = survivor.agent.listen_addr().unwrap();
    peer.fetch_remote_metadata(survivor_listen).unwrap();
    survivor.load(peer.listen_addr().unwrap());
    notified_write(&peer, &buf, survivor);
    survivor.read_from_peer(buf.as_ptr() as u64);
    peer.invalidate_local_metadata(survivor_listen).unwrap();
    peer.shutdown();
    drop(handle);
    drop(peer);
}

/// 500 restarts of a peer under the same name, each reaching the survivor and reached by
/// it: the survivor keeps nothing per incarnation beyond hash tables' high-water marks
/// (the fabric crate's completion table; measured growth: `docs/SOAK.md`). The bound is
/// 200 B per restart.
#[test]
fn five_hundred_restarts_leave_the_live_heap_flat() {
    let Some(_one_at_a_time) = measuring() else {
        return;
    };
    let survivor = Survivor::new();
    let grew = growth(50, 500, 100, |i| one_incarnation(&survivor, i));
    assert!(
        grew < 100 << 10,
        "the survivor's live heap grew by {grew} B over 500 restarts of a peer"
    );
}

/// The peer process: runs only when re-executed with `NIXL_RH_SURVIVOR`. WRITEs to the
/// survivor with a notification before the survivor loaded it (a restarted initiator),
/// announces itself and waits to be killed.
#[test]
fn crashing_peer_main() {
    let Ok(survivor) = std::env::var("NIXL_RH_SURVIVOR") else {
        return;
    };
    let announce = std::env::var("NIXL_RH_ANNOUNCE").unwrap();
    let target: u64 = std::env::var("NIXL_RH_TARGET").unwrap().parse().unwrap();
    let peer = agent("peer");
    let buf = pattern(7, LEN);
    // SAFETY: `buf` outlives the handle and every request (the process is killed).
    let _h = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    let survivor_name = peer
        .fetch_remote_metadata(survivor.parse().unwrap())
        .unwrap();
    let mut req = peer
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(&buf)]),
            &dram([Desc::new(target, LEN as u64, 0)]),
            &survivor_name,
            Some(b"from the peer".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    finish(&mut req).unwrap();
    announce_agent(&announce, &peer, buf.as_ptr() as u64);
    std::thread::sleep(TIMEOUT);
}

/// One incarnation of `peer` as a process of its own, SIGKILLed at the end.
fn crashed_incarnation(survivor: &Survivor, round: usize) {
    let announce = announce_path("restart-heap", &round.to_string());
    let mut cmd = self_test("crashing_peer_main", false);
    cmd.env(
        "NIXL_RH_SURVIVOR",
        survivor.agent.listen_addr().unwrap().to_string(),
    )
    .env("NIXL_RH_ANNOUNCE", &announce)
    .env("NIXL_RH_TARGET", survivor.addr().to_string());
    let peer = PeerProcess::spawn(cmd, announce);
    wait_notif(&survivor.agent, "peer");
    survivor.load(peer.addr);
    survivor.read_from_peer(peer.base);
    drop(peer); // SIGKILL, reaped
}

/// Crashed and restarted peer processes (the soak's faults: a new pid, a restarted
/// initiator heard before it is loaded, the dead incarnation replaced at the next load):
/// the first ones settle (measured growth: `docs/SOAK.md`); the bound is 1 KiB per
/// restart.
#[test]
fn crashed_peers_leave_the_live_heap_flat() {
    let Some(_one_at_a_time) = measuring() else {
        return;
    };
    let survivor = Survivor::new();
    let grew = growth(10, 60, 20, |i| crashed_incarnation(&survivor, i));
    assert!(
        grew < 60 << 10,
        "the survivor's live heap grew by {grew} B over 60 crashed peers"
    );
}
