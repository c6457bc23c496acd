//! Peers come and go (issue 27), the GPU rows of the fault matrix: `CUDA_IPC` and
//! `GPUNETIO` between two processes on one GPU.
//!
//! For each row a survivor agent in this process moves VRAM to and from a peer process
//! holding [`PEER_LEN`] bytes of VRAM, which is SIGKILLed once per fault of [`FAULTS`]
//! (see `common::restart::Fault`) — in the middle of 16 MiB WRITEs, in the middle of 16
//! MiB READs, while idle (then posted to), by itself right after a WRITE's data landed
//! in its VRAM and before it took the notification, and while the survivor fetches its
//! metadata (then its stale metadata, naming IPC handles of a dead process, is loaded
//! again: refused, or a WRITE that is `RemoteDisconnect`, never a stall) — and started
//! again under the same agent name (a new process, new allocations, new IPC handles),
//! whose metadata the survivor fetches. Each case asserts:
//! - the transfer to the dead peer fails with `RemoteDisconnect` naming it within
//!   [`DETECTION_BOUND`];
//! - the restarted peer is reached within [`RECONNECT_BOUND`] of its metadata being
//!   loaded: a 16 MiB WRITE with a notification, whose data the peer checks at the
//!   notification, then a 16 MiB READ of what the peer holds, verified here;
//! - nothing of the dead incarnation is held: GPU memory (`cuMemGetInfo`: an IPC mapping
//!   of the dead peer's allocation still imported here would keep its [`PEER_LEN`]
//!   bytes allocated after its process is gone), file descriptors and threads are as
//!   before the kill, within [`GPU_SLACK`] and `common::restart::{FD_SLACK, THREAD_SLACK}`.
//!
//! The figures are printed per case. Needs a GPU: without one every test prints why it
//! skips; with `NIXL_REQUIRE_GPU=1` (the GPU machine) a missing GPU fails instead.
#![cfg(feature = "cuda")]

mod common;

use common::restart::{
    announce_metadata, answer_check, die_once_landed, kill_during, metadata_of,
    stale_metadata_is_refused_or_fails, verdict, Fault, Held,
};
use common::{announce_path, pattern, self_test, vram, PeerProcess, TIMEOUT};
use gpu_mem::Gpu;
use nixl::{params, Agent, BackendParams, Desc, XferOp};
use std::time::{Duration, Instant};

/// A dead peer must be reported within this (the goal is 100 ms on one host).
const DETECTION_BOUND: Duration = Duration::from_secs(2);
/// A restarted peer must be reached within this of its metadata being loaded (the
/// goal is 1 s; the proof moves 16 MiB and imports the new allocation).
const RECONNECT_BOUND: Duration = Duration::from_secs(2);
/// GPU memory the survivor may hold more after a case than before it (allocations of
/// the driver's own). A leaked import holds [`PEER_LEN`], far above.
const GPU_SLACK: u64 = 16 << 20;

const BLOCK: usize = 16 << 20;
const BLOCKS: usize = 4;
const PEER_LEN: usize = BLOCK * BLOCKS;
/// The pattern the survivor writes.
const SURVIVOR_SEED: u8 = 0x5a;

/// One row: a backend and its parameters (the same on both sides).
struct Row {
    tag: &'static str,
    backend: &'static str,
    params: &'static [(&'static str, &'static str)],
}

const CUDA_IPC: Row = Row {
    tag: "cuda_ipc",
    backend: "CUDA_IPC",
    params: &[],
};

#[cfg(feature = "gpunetio")]
const GPUNETIO: Row = Row {
    tag: "gpunetio",
    backend: "GPUNETIO",
    params: &[("cuda_streams", "2")],
};

fn row(tag: &str) -> &'static Row {
    match tag {
        "cuda_ipc" => &CUDA_IPC,
        #[cfg(feature = "gpunetio")]
        "gpunetio" => &GPUNETIO,
        other => panic!("no row `{other}`"),
    }
}

fn backend_params(row: &Row) -> BackendParams {
    params(row.params.iter().copied())
}

const FAULTS: &[Fault] = &[
    Fault::MidWrite,
    Fault::MidRead,
    Fault::Idle,
    Fault::AfterData,
    Fault::DuringMetadata,
];

/// An incarnation's seed: what its VRAM holds.
fn seed_of(incarnation: u8) -> u8 {
    incarnation.wrapping_mul(37)
}

// ---- the peer process -----------------------------------------------------------------------

/// The peer process: runs only when re-executed with `NIXL_GPU_RESTART_PEER` (see
/// [`spawn_peer`]). Holds [`PEER_LEN`] bytes of VRAM filled with its seed's pattern and
/// answers each notification `check <offset> <len>` by comparing that range of its VRAM
/// with the survivor's pattern, writing the verdict to `<announce>.ok` (bad, whatever
/// the data, once any other notification arrived: one meant for the dead incarnation).
/// Its metadata blob is at `<announce>.md`. With `NIXL_GPU_RESTART_DIE_AFTER_DATA` set
/// it SIGKILLs itself as soon as the last 8 bytes of every block of its VRAM hold the
/// survivor's pattern (a WRITE's data has landed), taking no notification. Ends with the
/// thread that spawned it (`PR_SET_PDEATHSIG`), or when killed; bounded.
#[test]
fn gpu_restart_peer_main() {
    let (Ok(announce_at), Ok(tag), Ok(name), Ok(incarnation)) = (
        std::env::var("NIXL_GPU_RESTART_PEER"),
        std::env::var("NIXL_GPU_RESTART_ROW"),
        std::env::var("NIXL_GPU_RESTART_NAME"),
        std::env::var("NIXL_GPU_RESTART_INCARNATION"),
    ) else {
        return;
    };
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number; no memory is passed.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let row = row(&tag);
    let gpu = Gpu::open(0).unwrap();
    let peer = Agent::new(name, common::listening()).unwrap();
    peer.create_backend(row.backend, &backend_params(row))
        .unwrap();
    let seed = seed_of(incarnation.parse().unwrap());
    let buf = common::device_buffer(&gpu, PEER_LEN, &pattern(seed, PEER_LEN));
    // SAFETY: `buf` lives until the process ends.
    let _h = unsafe { peer.register_mem(&vram([common::whole(&buf)]), None) }.unwrap();
    announce_metadata(&announce_at, &peer);
    common::announce_agent(&announce_at, &peer, buf.ptr());
    let expected = pattern(SURVIVOR_SEED, PEER_LEN);
    if std::env::var_os("NIXL_GPU_RESTART_DIE_AFTER_DATA").is_some() {
        let landed = || {
            let mut word = [0u8; 8];
            (1..=BLOCKS).all(|b| {
                let at = b * BLOCK - 8;
                buf.copy_to_host(at, &mut word).unwrap();
                word[..] == expected[at..at + 8]
            })
        };
        die_once_landed(&peer, landed, Duration::from_micros(100));
    }
    let mut misdirected: Option<String> = None;
    let deadline = Instant::now() + 3 * TIMEOUT;
    while Instant::now() < deadline {
        for (from, msgs) in peer.wait_notifs(Duration::from_millis(20)) {
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg).to_string();
                let Some(args) = text.strip_prefix("check ") else {
                    misdirected.get_or_insert(format!("`{text}` from {from}"));
                    continue;
                };
                let n: Vec<usize> = args.split(' ').map(|a| a.parse().unwrap()).collect();
                let (offset, len) = (n[0], n[1]);
                let mut held = vec![0u8; len];
                buf.copy_to_host(offset, &mut held).unwrap();
                let data_ok = held[..] == expected[offset..offset + len];
                answer_check(&announce_at, &misdirected, data_ok, &text);
            }
        }
    }
}

/// A copy of this binary running [`gpu_restart_peer_main`] as incarnation `incarnation`
/// of agent `name` over `row`; it dies once a WRITE's data landed if `die_after_data`.
fn spawn_peer(row: &Row, name: &str, incarnation: u8, die_after_data: bool) -> PeerProcess {
    let announce_at = announce_path("nixl-gpu-restart", &format!("{name}-{incarnation}"));
    let _ = std::fs::remove_file(format!("{}.md", announce_at.display()));
    let mut cmd = self_test("gpu_restart_peer_main", false);
    cmd.env("NIXL_GPU_RESTART_PEER", &announce_at)
        .env("NIXL_GPU_RESTART_ROW", row.tag)
        .env("NIXL_GPU_RESTART_NAME", name)
        .env("NIXL_GPU_RESTART_INCARNATION", incarnation.to_string());
    if die_after_data {
        cmd.env("NIXL_GPU_RESTART_DIE_AFTER_DATA", "1");
    }
    PeerProcess::spawn(cmd, announce_at)
}

// ---- what the survivor holds ----------------------------------------------------------------

/// Free GPU memory (device-wide: an allocation of the dead peer that an import here
/// still holds stays counted as used).
fn gpu_free(gpu: &Gpu) -> u64 {
    gpu.bind().unwrap();
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: two out-pointers to live locals; a context is current (bound above).
    unsafe { gpu_mem::cudarc::driver::sys::cuMemGetInfo_v2(&mut free, &mut total) }
        .result()
        .unwrap();
    free as u64
}

/// What the survivor holds: free GPU memory, and what `common::restart::Held` counts.
#[derive(Debug, Clone, Copy)]
struct GpuHeld {
    gpu_free: u64,
    host: Held,
}

impl GpuHeld {
    fn now(gpu: &Gpu) -> Self {
        Self {
            gpu_free: gpu_free(gpu),
            host: Held::now(),
        }
    }

    /// What `self` (after a case) holds beyond `before`, or `None` when within the
    /// slack.
    fn leaked_since(&self, before: &GpuHeld) -> Option<String> {
        let gpu = before.gpu_free.saturating_sub(self.gpu_free);
        (gpu > GPU_SLACK || self.host.leaked_since(&before.host).is_some())
            .then(|| format!("{gpu} bytes of GPU memory; before {before:?}, after {self:?}"))
    }
}

// ---- the survivor ---------------------------------------------------------------------------

/// `n` blocks of VRAM from `base` on `gpu`.
fn blocks(gpu: &Gpu, base: u64, n: usize) -> nixl::DescList {
    let dev = gpu.ordinal() as u64;
    vram((0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, dev)))
}

fn restart_row(row: &Row) {
    let test = format!("restart_over_{}", row.tag);
    let Some(gpu) = gpu_mem::gpu_for_test(&test) else {
        return;
    };
    let _serial = common::serial();
    let survivor = Agent::new(format!("survivor-{}", row.tag), common::listening()).unwrap();
    survivor
        .create_backend(row.backend, &backend_params(row))
        .unwrap_or_else(|e| panic!("{}: {e}", row.backend));
    let src = common::device_buffer(&gpu, PEER_LEN, &pattern(SURVIVOR_SEED, PEER_LEN));
    let dst = common::device_buffer(&gpu, PEER_LEN, &[]);
    // SAFETY: both buffers outlive the handle and every request (dropped first).
    let _h =
        unsafe { survivor.register_mem(&vram([common::whole(&src), common::whole(&dst)]), None) }
            .unwrap();
    let try_xfer = |op: XferOp, peer: &str, base: u64, n: usize, notif: Option<String>| {
        let local = if op == XferOp::Read {
            dst.ptr()
        } else {
            src.ptr()
        };
        survivor.create_xfer_req(
            op,
            &blocks(&gpu, local, n),
            &blocks(&gpu, base, n),
            peer,
            notif.map(String::into_bytes),
        )
    };
    let xfer = |op: XferOp, peer: &str, base: u64, n: usize, notif: Option<String>| {
        try_xfer(op, peer, base, n, notif).unwrap()
    };

    let name = format!("restarting-{}", row.tag);
    let mut incarnation = 1u8;
    let mut peer = spawn_peer(row, &name, incarnation, false);
    assert_eq!(survivor.fetch_remote_metadata(peer.addr).unwrap(), name);
    for &fault in FAULTS {
        let label = format!("{}, {fault:?}", row.tag);
        if fault == Fault::AfterData {
            // A peer that dies once a WRITE's data has landed: this fault's own.
            drop(peer);
            incarnation += 1;
            peer = spawn_peer(row, &name, incarnation, true);
            survivor.invalidate_remote(&name).unwrap();
            assert_eq!(survivor.fetch_remote_metadata(peer.addr).unwrap(), name);
        }
        // The live incarnation is reached (its allocation imported) before counting:
        // one word (a dying peer of AfterData dies of whole blocks only).
        let dev = gpu.ordinal() as u64;
        let mut warm = survivor
            .create_xfer_req(
                XferOp::Write,
                &vram([Desc::new(src.ptr(), 8, dev)]),
                &vram([Desc::new(peer.base, 8, dev)]),
                &name,
                None,
            )
            .unwrap();
        warm.post().unwrap();
        warm.wait(TIMEOUT).unwrap();
        drop(warm);
        let before = GpuHeld::now(&gpu);

        let mut req = xfer(fault.op(), &name, peer.base, BLOCKS, Some("doomed".into()));
        let dead_base = peer.base;
        let dead_blob = metadata_of(&peer);
        let detection = kill_during(fault, &survivor, &mut peer, &mut req, DETECTION_BOUND);
        println!(
            "{label}: {:.1} ms after the {}, {:.1} ms after the process ended{}: {}",
            detection.delay().as_secs_f64() * 1e3,
            detection.measured_from(),
            detection.after_end_ms(),
            if detection.completed_first {
                "; a post completed first"
            } else {
                ""
            },
            detection.error
        );
        detection.assert_remote_disconnect(&label, &name, DETECTION_BOUND);
        drop(req);
        drop(peer);
        if fault == Fault::DuringMetadata {
            stale_metadata_is_refused_or_fails(
                &survivor,
                &name,
                &dead_blob,
                || try_xfer(XferOp::Write, &name, dead_base, 1, Some("stale".into())),
                DETECTION_BOUND,
            );
        }

        // The same name, a new process.
        incarnation += 1;
        let mut restarted = spawn_peer(row, &name, incarnation, false);
        assert_eq!(
            survivor.fetch_remote_metadata(restarted.addr).unwrap(),
            name
        );
        let loaded = Instant::now();
        let msg = format!("check 0 {BLOCK}");
        let mut first = xfer(XferOp::Write, &name, restarted.base, 1, Some(msg.clone()));
        first.post().unwrap();
        first
            .wait(TIMEOUT)
            .unwrap_or_else(|e| panic!("{label}: the first WRITE to the restarted peer: {e}"));
        let reconnect = loaded.elapsed();
        drop(first);
        let seen = verdict(&mut restarted, &msg);
        assert!(seen.starts_with("OK"), "{label}: {seen}");
        // A READ of what the new incarnation holds past what was written.
        dst.fill(0).unwrap();
        let mut read = xfer(XferOp::Read, &name, restarted.base + BLOCK as u64, 1, None);
        read.post().unwrap();
        read.wait(TIMEOUT).unwrap();
        drop(read);
        let mut back = vec![0u8; BLOCK];
        dst.copy_to_host(0, &mut back).unwrap();
        assert!(
            back[..] == pattern(seed_of(incarnation), PEER_LEN)[BLOCK..2 * BLOCK],
            "{label}: READ from the restarted peer"
        );
        println!(
            "{label}: restarted peer reached {:.1} ms after its metadata was loaded",
            reconnect.as_secs_f64() * 1e3
        );
        assert!(
            reconnect < RECONNECT_BOUND,
            "{label}: reached again only after {reconnect:?} (bound {RECONNECT_BOUND:?})"
        );

        // The driver frees the dead process's memory as it tears the process down, and
        // an import released here frees it then: give both a moment.
        let settle = Instant::now();
        let after = loop {
            let after = GpuHeld::now(&gpu);
            if after.leaked_since(&before).is_none() || settle.elapsed() > Duration::from_secs(5) {
                break after;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(leak) = after.leaked_since(&before) {
            panic!("{label}: the dead incarnation left {leak}");
        }
        println!("{label}: held before {before:?}, after {after:?}");
        peer = restarted;
    }
}

#[test]
fn restart_over_cuda_ipc() {
    restart_row(row("cuda_ipc"));
}

#[cfg(feature = "gpunetio")]
#[test]
fn restart_over_gpunetio() {
    restart_row(row("gpunetio"));
}
