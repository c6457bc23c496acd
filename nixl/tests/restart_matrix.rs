#![cfg(feature = "libfabric")]
//! Peers come and go (issue 27): the fault matrix, one row per transport.
//!
//! For each row of [`TRANSPORTS`] a survivor agent in this process moves data to a peer
//! process that is SIGKILLed, once per fault of [`FAULTS`] — in the middle of 16 MiB
//! WRITEs, in the middle of 16 MiB READs, while idle, by itself right after a WRITE's
//! data landed and before it took the notification, and while the survivor fetches its
//! metadata (then its stale metadata is loaded again) — and then started again under
//! the same agent name (a new process: new port — or, in `SameAddress`, the dead one's
//! metadata address and port — new endpoints, new keys), whose metadata the survivor
//! fetches. Each case asserts:
//! - the transfer to the dead peer fails with `RemoteDisconnect` naming it within
//!   [`DETECTION_BOUND`];
//! - the restarted peer is reached within [`RECONNECT_BOUND`] of its metadata being
//!   loaded: a 16 MiB WRITE with a notification, whose data and notification the peer
//!   checks, then a 16 MiB READ of what the peer holds;
//! - a second peer process (the bystander), which the survivor WRITEs to and READs back
//!   from round after round on a thread of its own through the whole row, never fails,
//!   never returns a wrong byte and never takes longer than [`BYSTANDER_BOUND`] a round;
//! - nothing of the dead incarnation is left: the survivor holds as many file
//!   descriptors and threads as before the kill (a small slack, `common::restart::Held`),
//!   no `/dev/shm` file names the dead process, and no mapping of its regions still
//!   holds memory.
//!
//! The figures (detection and reconnect times, with the error that reported the death)
//! are printed per case. Rows run one at a time (a 2-core machine). A later transport is
//! a row of [`TRANSPORTS`], a later fault an entry of [`FAULTS`] and a branch of
//! `common::restart::kill_during` (shared with the VERBS and GPU rows).

mod common;

use common::restart::{
    announce_metadata, answer_check, die_once_landed, kill_during, metadata_of,
    stale_metadata_is_refused_or_fails, verdict, Bystander, Fault, Held,
};
use common::{announce_path, dram, self_test, PeerProcess, TIMEOUT};
use nixl::{params, Agent, BackendParams, Desc, XferOp, XferReq};
use std::time::{Duration, Instant};

/// A dead peer must be reported within this (the goal is 100 ms on one host; the bound
/// leaves room for a loaded 2-core machine).
const DETECTION_BOUND: Duration = Duration::from_secs(2);
/// A restarted peer must be reached within this of its metadata being loaded (the goal
/// is 1 s; the transfer that proves it moves 16 MiB).
const RECONNECT_BOUND: Duration = Duration::from_secs(2);
/// The longest round (a 1 MiB WRITE and its READ back) the bystander may take.
const BYSTANDER_BOUND: Duration = Duration::from_secs(2);

/// The size of each block moved: what the issue measured with.
const BLOCK: usize = 16 << 20;
/// Blocks per transfer, and the peer's buffer.
const BLOCKS: usize = 4;
const PEER_LEN: usize = BLOCK * BLOCKS;
const BYSTANDER_LEN: usize = 1 << 20;
/// The pattern of what the survivor writes.
const SURVIVOR_SEED: u64 = 7;

/// One row of the matrix: LIBFABRIC parameters (the same on both sides) and the provider
/// the survivor must then reach its peers through.
struct Transport {
    /// Names the row, its test and its agents.
    tag: &'static str,
    params: &'static [(&'static str, &'static str)],
    /// What `peer_transport` must say (the row tests what it claims to).
    reached_by: &'static str,
}

/// The rows. Same-host peers go over the named provider itself (`local_provider=none`),
/// except in `default`, where they go through the shm plane as a default backend's do.
/// libfabric 1.17's `tcp` provider has no RDM endpoints of its own: `provider=tcp` opens
/// `tcp;ofi_rxm` (its row checks that it still works as named).
const TRANSPORTS: &[Transport] = &[
    Transport {
        tag: "tcp_rxm",
        params: &[("provider", "tcp;ofi_rxm"), ("local_provider", "none")],
        reached_by: "tcp;ofi_rxm",
    },
    Transport {
        tag: "tcp_rxm_4rails",
        params: &[
            ("provider", "tcp;ofi_rxm"),
            ("local_provider", "none"),
            ("num_rails", "4"),
        ],
        reached_by: "tcp;ofi_rxm",
    },
    Transport {
        tag: "tcp",
        params: &[("provider", "tcp"), ("local_provider", "none")],
        reached_by: "tcp;ofi_rxm",
    },
    Transport {
        tag: "sockets",
        params: &[("provider", "sockets"), ("local_provider", "none")],
        reached_by: "sockets",
    },
    Transport {
        tag: "shm",
        params: &[("provider", "shm")],
        reached_by: "shm",
    },
    // Every byte through the provider: no pieces copied by the processes themselves,
    // whose failures would tell of the death first (`cma_write`, `cma_read`).
    Transport {
        tag: "shm_2rails_provider_copies",
        params: &[
            ("provider", "shm"),
            ("num_rails", "2"),
            ("cma_write", "0"),
            ("cma_read", "0"),
        ],
        reached_by: "shm",
    },
    Transport {
        tag: "default",
        params: &[],
        reached_by: "shm",
    },
];

const FAULTS: &[Fault] = &[
    Fault::MidWrite,
    Fault::MidRead,
    Fault::Idle,
    Fault::AfterData,
    Fault::DuringMetadata,
    Fault::SameAddress,
];

fn transport(tag: &str) -> &'static Transport {
    TRANSPORTS
        .iter()
        .find(|t| t.tag == tag)
        .unwrap_or_else(|| panic!("no transport `{tag}`"))
}

fn backend_params(t: &Transport) -> BackendParams {
    params(t.params.iter().copied())
}

/// What every peer's buffer holds (and what the survivor writes): 8-byte words that
/// differ at every offset and between seeds; cheap to make in a debug build.
fn fill(buf: &mut [u8], seed: u64, offset: usize) {
    for (i, word) in buf.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(&word_at(seed, offset + 8 * i).to_le_bytes());
    }
}

/// The word of seed `seed`'s pattern at byte `offset` (a multiple of 8).
fn word_at(seed: u64, offset: usize) -> u64 {
    let at = (offset / 8) as u64;
    at.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xff51_afd7)
}

fn filled(len: usize, seed: u64, offset: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed, offset);
    v
}

// ---- the peer process -----------------------------------------------------------------------

/// The peer process: runs only when re-executed with `NIXL_RESTART_PEER` (see
/// [`spawn_peer`]). Holds [`PEER_LEN`] bytes of its seed's pattern and answers each
/// notification `check <seed> <offset> <len>` by comparing that range with the seed's
/// pattern, writing the verdict to `<announce>.ok` (bad, whatever the data, once any
/// other notification arrived). Its metadata blob is at `<announce>.md`; it listens on
/// `NIXL_RESTART_LISTEN` where that is set. With `NIXL_RESTART_DIE_AFTER_DATA=<seed>`
/// it SIGKILLs itself as soon as the last word of every block holds that seed's
/// pattern (a WRITE's data has landed), without taking notifications. Ends with the
/// thread that spawned it (`PR_SET_PDEATHSIG`), or when killed; bounded.
#[test]
fn restart_peer_main() {
    let (Ok(announce_at), Ok(tag), Ok(name), Ok(seed)) = (
        std::env::var("NIXL_RESTART_PEER"),
        std::env::var("NIXL_RESTART_TRANSPORT"),
        std::env::var("NIXL_RESTART_NAME"),
        std::env::var("NIXL_RESTART_SEED"),
    ) else {
        return;
    };
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number; no memory is passed.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    common::init_tracing();
    tracing::info!(agent = %name, "peer process");
    let seed: u64 = seed.parse().unwrap();
    let mut config = common::listening();
    if let Ok(addr) = std::env::var("NIXL_RESTART_LISTEN") {
        config.listen_addr = Some(addr.parse().unwrap());
    }
    let peer = Agent::new(name, config).unwrap();
    peer.create_backend("LIBFABRIC", &backend_params(transport(&tag)))
        .unwrap();
    let buf = filled(PEER_LEN, seed, 0);
    // SAFETY: `buf` lives until the process ends.
    let _h = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    announce_metadata(&announce_at, &peer);
    common::announce_agent(&announce_at, &peer, buf.as_ptr() as u64);
    if let Ok(seed) = std::env::var("NIXL_RESTART_DIE_AFTER_DATA") {
        die_after_data(&peer, &buf, seed.parse().unwrap());
    }
    // Anything else that arrives (a notification of a transfer to the dead incarnation,
    // say) spoils every later verdict.
    let mut misdirected: Option<String> = None;
    let deadline = Instant::now() + 5 * TIMEOUT;
    while Instant::now() < deadline {
        for (from, msgs) in peer.wait_notifs(Duration::from_millis(20)) {
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg).to_string();
                let Some(args) = text.strip_prefix("check ") else {
                    misdirected.get_or_insert(format!("`{text}` from {from}"));
                    continue;
                };
                let n: Vec<usize> = args.split(' ').map(|a| a.parse().unwrap()).collect();
                let (seed, offset, len) = (n[0] as u64, n[1], n[2]);
                let data_ok = buf[offset..offset + len] == filled(len, seed, offset)[..];
                answer_check(&announce_at, &misdirected, data_ok, &text);
            }
        }
    }
}

/// [`restart_peer_main`]'s end under [`Fault::AfterData`]: waits until the last word
/// of each of the first [`BLOCKS`] blocks of `buf` holds seed `seed`'s pattern, then
/// SIGKILLs this process (bounded). Takes notifications meanwhile only as the progress
/// of a manual-progress provider needs it (whatever it takes is dropped with it).
fn die_after_data(peer: &Agent, buf: &[u8], seed: u64) -> ! {
    let ends: Vec<(usize, u64)> = (1..=BLOCKS)
        .map(|b| (b * BLOCK - 8, word_at(seed, b * BLOCK - 8)))
        .collect();
    let landed = || {
        ends.iter().all(|&(at, want)| {
            // SAFETY: `at + 8 <= buf.len()`, and `at` is a multiple of 8 in an
            // allocation the allocator aligns to 16 at least; the provider writes the
            // buffer from other threads (or processes), hence a volatile read.
            let word = unsafe { std::ptr::read_volatile(buf.as_ptr().add(at) as *const u64) };
            u64::from_le(word) == want
        })
    };
    die_once_landed(peer, landed, Duration::from_micros(20))
}

/// How a peer process is started.
#[derive(Debug, Clone, Default)]
struct PeerOptions {
    /// Listen for metadata there (a dead incarnation's address, say).
    listen: Option<std::net::SocketAddr>,
    /// Die as soon as a WRITE of this seed's data has landed ([`Fault::AfterData`]).
    die_after_data: Option<u64>,
}

/// A copy of this binary running [`restart_peer_main`] as agent `name` over `t`, its
/// buffer filled with seed `seed`.
fn spawn_peer(t: &Transport, name: &str, seed: u64) -> PeerProcess {
    spawn_peer_with(t, name, seed, &PeerOptions::default())
}

fn spawn_peer_with(t: &Transport, name: &str, seed: u64, options: &PeerOptions) -> PeerProcess {
    let announce_at = announce_path("nixl-restart", &format!("{name}-{seed}"));
    let _ = std::fs::remove_file(format!("{}.md", announce_at.display()));
    let mut cmd = self_test("restart_peer_main", false);
    cmd.env("NIXL_RESTART_PEER", &announce_at)
        .env("NIXL_RESTART_TRANSPORT", t.tag)
        .env("NIXL_RESTART_NAME", name)
        .env("NIXL_RESTART_SEED", seed.to_string());
    if let Some(addr) = options.listen {
        cmd.env("NIXL_RESTART_LISTEN", addr.to_string());
    }
    if let Some(seed) = options.die_after_data {
        cmd.env("NIXL_RESTART_DIE_AFTER_DATA", seed.to_string());
    }
    PeerProcess::spawn(cmd, announce_at)
}

// ---- what the survivor holds ----------------------------------------------------------------

/// What process `pid` left in `/dev/shm` (libfabric's `shm` regions are named
/// `nixl-<pid namespace>-<pid>-<nonce>:...` by the backend, `<pid>:...` by default), and
/// this process's mappings of such regions that still hold memory: the provider never
/// unmaps a departed peer, so the backend empties a dead peer's regions instead (a page
/// or two that the provider touches again may come back).
fn shm_traces_of(pid: u32) -> Vec<String> {
    const KEPT_KIB: u64 = 16;
    let names = |name: &str| {
        name.starts_with(&format!("{pid}:"))
            || name
                .strip_prefix("nixl-")
                .and_then(|rest| rest.split('-').nth(1))
                .is_some_and(|p| p == pid.to_string())
    };
    let mut traces: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| names(n))
                .map(|n| format!("/dev/shm/{n}"))
                .collect()
        })
        .unwrap_or_default();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut current: Option<String> = None;
    for line in smaps.lines() {
        if let Some((_, name)) = line.split_once("/dev/shm/") {
            let name = name.trim_end_matches(" (deleted)");
            current = names(name).then(|| name.to_string());
        } else if line.starts_with(|c: char| c.is_ascii_hexdigit()) && line.contains('-') {
            current = None;
        } else if let (Some(name), Some(rss)) = (&current, line.strip_prefix("Rss:")) {
            let kib: u64 = rss.trim().trim_end_matches("kB").trim().parse().unwrap();
            if kib > KEPT_KIB {
                traces.push(format!("mapped with {kib} KiB: /dev/shm/{name}"));
            }
        }
    }
    traces
}

/// The survivor's side of one row: its agent, its buffers, and the block lists.
struct Survivor {
    /// First: dropped before the buffers it registers.
    _h: Option<nixl::RegistrationHandle>,
    agent: Agent,
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Survivor {
    fn new(t: &Transport) -> Self {
        let agent = Agent::new(format!("survivor-{}", t.tag), common::listening()).unwrap();
        agent
            .create_backend("LIBFABRIC", &backend_params(t))
            .unwrap_or_else(|e| panic!("LIBFABRIC over {}: {e}", t.tag));
        let mut s = Self {
            agent,
            src: filled(PEER_LEN, SURVIVOR_SEED, 0),
            dst: vec![0u8; PEER_LEN],
            _h: None,
        };
        // SAFETY: both buffers live in `s`, whose handle is dropped before them (declared
        // first), after every request (each is dropped before `s`).
        s._h = Some(unsafe {
            s.agent
                .register_mem(
                    &dram([Desc::from_slice(&s.src), Desc::from_slice(&s.dst)]),
                    None,
                )
                .unwrap()
        });
        s
    }

    /// `n` blocks from `base`.
    fn blocks(base: u64, n: usize) -> nixl::DescList {
        dram((0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, 0)))
    }

    /// A transfer of `n` blocks with `peer`'s buffer (at `base`).
    fn xfer(
        &mut self,
        op: XferOp,
        peer: &str,
        base: u64,
        n: usize,
        notif: Option<&str>,
    ) -> XferReq {
        let local = match op {
            XferOp::Read => self.dst.as_mut_ptr() as u64,
            XferOp::Write => self.src.as_ptr() as u64,
        };
        self.agent
            .create_xfer_req(
                op,
                &Self::blocks(local, n),
                &Self::blocks(base, n),
                peer,
                notif.map(|m| m.as_bytes().to_vec()),
            )
            .unwrap()
    }
}

/// One row: every fault of [`FAULTS`] against peers over `t`.
fn restart_row(t: &Transport) {
    let _serial = common::serial();
    common::init_tracing();
    let mut survivor = Survivor::new(t);

    let bystander_name = format!("bystander-{}", t.tag);
    let bystander_peer = spawn_peer(t, &bystander_name, 0);
    survivor
        .agent
        .fetch_remote_metadata(bystander_peer.addr)
        .unwrap();
    let bystander = Bystander::start(
        &survivor.agent,
        &bystander_name,
        bystander_peer.base,
        BYSTANDER_LEN,
    );

    let name = format!("restarting-{}", t.tag);
    let mut incarnation = 1;
    let mut peer = spawn_peer(t, &name, incarnation);
    survivor.agent.fetch_remote_metadata(peer.addr).unwrap();
    assert_eq!(
        common::fabric_transport(&survivor.agent, &name).as_deref(),
        Some(t.reached_by),
        "{}: the peer is reached through another provider",
        t.tag
    );
    for &fault in FAULTS {
        let label = format!("{}, {fault:?}", t.tag);
        if fault == Fault::AfterData {
            // A peer that dies once a WRITE's data has landed: this fault's own.
            drop(peer);
            incarnation += 1;
            let options = PeerOptions {
                die_after_data: Some(SURVIVOR_SEED),
                ..PeerOptions::default()
            };
            peer = spawn_peer_with(t, &name, incarnation, &options);
            survivor.agent.invalidate_remote(&name).unwrap();
            assert_eq!(
                survivor.agent.fetch_remote_metadata(peer.addr).unwrap(),
                name
            );
        }
        // The live incarnation is reached (its connections exist) before counting.
        let mut warm = survivor.xfer(XferOp::Write, &name, peer.base, 1, None);
        warm.post().unwrap();
        warm.wait(TIMEOUT).unwrap();
        drop(warm);
        let before = Held::now();

        let mut req = survivor.xfer(fault.op(), &name, peer.base, BLOCKS, Some("doomed"));
        let dead_pid = peer.child.id();
        let dead_addr = peer.addr;
        let dead_base = peer.base;
        let dead_blob = metadata_of(&peer);
        let detection = kill_during(fault, &survivor.agent, &mut peer, &mut req, DETECTION_BOUND);
        println!(
            "{label}: RemoteDisconnect {:.1} ms after the {}, {:.1} ms after the process \
             ended{} ({})",
            detection.delay().as_secs_f64() * 1e3,
            detection.measured_from(),
            detection.after_end_ms(),
            if detection.completed_first {
                "; a post completed first"
            } else {
                ""
            },
            detection.error,
        );
        detection.assert_remote_disconnect(&label, &name, DETECTION_BOUND);
        drop(req);
        drop(peer);
        if fault == Fault::DuringMetadata {
            let agent = survivor.agent.clone();
            stale_metadata_is_refused_or_fails(
                &agent,
                &name,
                &dead_blob,
                || Ok(survivor.xfer(XferOp::Write, &name, dead_base, 1, Some("stale"))),
                DETECTION_BOUND,
            );
        }

        // The same name, a new process.
        incarnation += 1;
        let options = PeerOptions {
            listen: (fault == Fault::SameAddress).then_some(dead_addr),
            ..PeerOptions::default()
        };
        let mut restarted = spawn_peer_with(t, &name, incarnation, &options);
        if fault == Fault::SameAddress {
            assert_eq!(restarted.addr, dead_addr, "{label}: another address");
        }
        assert_eq!(
            survivor
                .agent
                .fetch_remote_metadata(restarted.addr)
                .unwrap(),
            name
        );
        let loaded = Instant::now();
        let msg = format!("check {SURVIVOR_SEED} 0 {BLOCK}");
        let mut first = survivor.xfer(XferOp::Write, &name, restarted.base, 1, Some(&msg));
        first.post().unwrap();
        first
            .wait(TIMEOUT)
            .unwrap_or_else(|e| panic!("{label}: the first WRITE to the restarted peer: {e}"));
        let reconnect = loaded.elapsed();
        drop(first);
        let seen = verdict(&mut restarted, &msg);
        assert!(seen.starts_with("OK"), "{label}: {seen}");
        // A READ of what the new incarnation holds (its own seed) past what was written.
        survivor.dst.fill(0);
        let mut read = survivor.xfer(XferOp::Read, &name, restarted.base + BLOCK as u64, 1, None);
        read.post().unwrap();
        read.wait(TIMEOUT).unwrap();
        drop(read);
        assert!(
            survivor.dst[..BLOCK] == filled(BLOCK, incarnation, BLOCK)[..],
            "{label}: READ from the restarted peer"
        );
        println!(
            "{label}: restarted peer reached {:.1} ms after its metadata was loaded",
            reconnect.as_secs_f64() * 1e3,
        );
        assert!(
            reconnect < RECONNECT_BOUND,
            "{label}: reached again only after {reconnect:?} (bound {RECONNECT_BOUND:?})"
        );

        if let Some(leak) = Held::now().leaked_since(&before) {
            panic!("{label}: leaked: {leak}");
        }
        let traces = shm_traces_of(dead_pid);
        assert!(
            traces.is_empty(),
            "{label}: the dead incarnation left {traces:?}"
        );
        peer = restarted;
    }

    bystander.finish().assert_unaffected(t.tag, BYSTANDER_BOUND);
}

#[test]
fn restart_over_tcp_rxm() {
    restart_row(transport("tcp_rxm"));
}

#[test]
fn restart_over_tcp_rxm_with_four_rails() {
    restart_row(transport("tcp_rxm_4rails"));
}

#[test]
fn restart_over_tcp() {
    restart_row(transport("tcp"));
}

#[test]
fn restart_over_sockets() {
    restart_row(transport("sockets"));
}

#[test]
fn restart_over_shm() {
    restart_row(transport("shm"));
}

#[test]
fn restart_over_shm_with_two_rails_and_provider_copies() {
    restart_row(transport("shm_2rails_provider_copies"));
}

/// Default parameters: the network provider, and the shm plane for a peer on this host.
#[test]
fn restart_with_default_parameters() {
    restart_row(transport("default"));
}

/// Every row has its test above.
#[test]
fn every_row_has_a_test() {
    let source = include_str!("restart_matrix.rs");
    for t in TRANSPORTS {
        assert!(
            source.contains(&format!("transport(\"{}\")", t.tag)),
            "row `{}` has no test",
            t.tag
        );
    }
}
