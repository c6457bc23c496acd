//! Peers come and go (issue 27), the GPU rows of the fault matrix: `CUDA_IPC` and
//! `GPUNETIO` between two processes on one GPU.
//!
//! For each row a survivor agent in this process moves VRAM to and from a peer process
//! holding [`PEER_LEN`] bytes of VRAM, which is SIGKILLed once per fault of [`FAULTS`]
//! — in the middle of 16 MiB WRITEs, in the middle of 16 MiB READs, and while idle (then
//! posted to) — and started again under the same agent name (a new process, new
//! allocations, new IPC handles), whose metadata the survivor fetches. Each case
//! asserts:
//! - the transfer to the dead peer fails with `RemoteDisconnect` naming it within
//!   [`DETECTION_BOUND`];
//! - the restarted peer is reached within [`RECONNECT_BOUND`] of its metadata being
//!   loaded: a 16 MiB WRITE with a notification, whose data the peer checks at the
//!   notification, then a 16 MiB READ of what the peer holds, verified here;
//! - nothing of the dead incarnation is held: GPU memory (`cuMemGetInfo`: an IPC mapping
//!   of the dead peer's allocation still imported here would keep its [`PEER_LEN`]
//!   bytes allocated after its process is gone), file descriptors and threads are as
//!   before the kill, within [`GPU_SLACK`], [`FD_SLACK`] and [`THREAD_SLACK`].
//!
//! The figures are printed per case. Needs a GPU: without one every test prints why it
//! skips; with `NIXL_REQUIRE_GPU=1` (the GPU machine) a missing GPU fails instead.
#![cfg(feature = "cuda")]

mod common;

use common::{announce, announce_path, pattern, self_test, vram, wait_file, PeerProcess, TIMEOUT};
use gpu_mem::Gpu;
use nixl::{params, Agent, BackendParams, Desc, Error, XferOp, XferReq, XferStatus};
use std::time::{Duration, Instant};

/// A dead peer must be reported within this (the goal is 100 ms on one host).
const DETECTION_BOUND: Duration = Duration::from_secs(2);
/// A restarted peer must be reached within this of its metadata being loaded (the
/// goal is 1 s; the proof moves 16 MiB and imports the new allocation).
const RECONNECT_BOUND: Duration = Duration::from_secs(2);
/// GPU memory, file descriptors and threads the survivor may hold more after a case
/// than before it (allocations of the driver's own, a socket opened lazily). A leaked
/// import holds [`PEER_LEN`], far above.
const GPU_SLACK: u64 = 16 << 20;
const FD_SLACK: usize = 2;
const THREAD_SLACK: usize = 1;

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

/// When the peer is killed (SIGKILL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    MidWrite,
    MidRead,
    /// Killed while nothing moves, its end waited for; then a WRITE is posted to it.
    Idle,
}

const FAULTS: &[Fault] = &[Fault::MidWrite, Fault::MidRead, Fault::Idle];

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
/// Ends with the thread that spawned it (`PR_SET_PDEATHSIG`), or when killed; bounded.
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
    common::announce_agent(&announce_at, &peer, buf.ptr());
    let expected = pattern(SURVIVOR_SEED, PEER_LEN);
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
                let verdict = match &misdirected {
                    Some(m) => format!("BAD: received {m}"),
                    None if held[..] != expected[offset..offset + len] => "BAD DATA".into(),
                    None => "OK".to_string(),
                };
                announce(format!("{announce_at}.ok"), &format!("{verdict} {text}"));
            }
        }
    }
}

/// A copy of this binary running [`gpu_restart_peer_main`] as incarnation `incarnation`
/// of agent `name` over `row`.
fn spawn_peer(row: &Row, name: &str, incarnation: u8) -> PeerProcess {
    let announce_at = announce_path("nixl-gpu-restart", &format!("{name}-{incarnation}"));
    let mut cmd = self_test("gpu_restart_peer_main", false);
    cmd.env("NIXL_GPU_RESTART_PEER", &announce_at)
        .env("NIXL_GPU_RESTART_ROW", row.tag)
        .env("NIXL_GPU_RESTART_NAME", name)
        .env("NIXL_GPU_RESTART_INCARNATION", incarnation.to_string());
    PeerProcess::spawn(cmd, announce_at)
}

/// Waits for the peer's verdict on notification `msg` (bounded).
fn verdict(peer: &mut PeerProcess, msg: &str) -> String {
    let ok = peer.ok_path();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let text = wait_file(&ok, &mut peer.child);
        if text.ends_with(msg) {
            return text;
        }
        assert!(Instant::now() < deadline, "no verdict on `{msg}`: {text}");
        std::thread::sleep(Duration::from_millis(5));
    }
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

#[derive(Debug, Clone, Copy)]
struct Held {
    gpu_free: u64,
    fds: usize,
    threads: usize,
}

impl Held {
    fn now(gpu: &Gpu) -> Self {
        let count = |dir: &str| std::fs::read_dir(dir).unwrap().count();
        Self {
            gpu_free: gpu_free(gpu),
            fds: count("/proc/self/fd"),
            threads: count("/proc/self/task"),
        }
    }

    /// What `self` (after a case) holds beyond `before`, or `None` when within the
    /// slack.
    fn leaked_since(&self, before: &Held) -> Option<String> {
        let gpu = before.gpu_free.saturating_sub(self.gpu_free);
        (gpu > GPU_SLACK
            || self.fds > before.fds + FD_SLACK
            || self.threads > before.threads + THREAD_SLACK)
            .then(|| format!("{gpu} bytes of GPU memory; before {before:?}, after {self:?}"))
    }
}

// ---- the survivor ---------------------------------------------------------------------------

/// `n` blocks of VRAM from `base` on `gpu`.
fn blocks(gpu: &Gpu, base: u64, n: usize) -> nixl::DescList {
    let dev = gpu.ordinal() as u64;
    vram((0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, dev)))
}

/// Kills `peer` as `fault` says, `req` in flight or not, and polls `req` until it fails
/// (reposting whenever it completes first), for at most [`TIMEOUT`]. Returns the error
/// and the time from the kill.
fn kill_during(fault: Fault, peer: &mut PeerProcess, req: &mut XferReq) -> (Error, Duration) {
    if fault != Fault::Idle {
        req.post().unwrap();
    }
    peer.child.kill().unwrap();
    let killed = Instant::now();
    if fault == Fault::Idle {
        peer.child.wait().unwrap();
        if let Err(e) = req.post() {
            return (e, killed.elapsed());
        }
    }
    loop {
        let outcome = match req.status() {
            Ok(XferStatus::Done) => req.post().map(|_| ()),
            Ok(XferStatus::InProgress) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            return (e, killed.elapsed());
        }
        assert!(
            killed.elapsed() < TIMEOUT,
            "the dead peer was never noticed"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
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
    let xfer = |op: XferOp, peer: &str, base: u64, n: usize, notif: Option<String>| {
        let local = if op == XferOp::Read {
            dst.ptr()
        } else {
            src.ptr()
        };
        survivor
            .create_xfer_req(
                op,
                &blocks(&gpu, local, n),
                &blocks(&gpu, base, n),
                peer,
                notif.map(String::into_bytes),
            )
            .unwrap()
    };

    let name = format!("restarting-{}", row.tag);
    let mut incarnation = 1u8;
    let mut peer = spawn_peer(row, &name, incarnation);
    assert_eq!(survivor.fetch_remote_metadata(peer.addr).unwrap(), name);
    for &fault in FAULTS {
        let label = format!("{}, {fault:?}", row.tag);
        // The live incarnation is reached (its allocation imported) before counting.
        let mut warm = xfer(XferOp::Write, &name, peer.base, 1, None);
        warm.post().unwrap();
        warm.wait(TIMEOUT).unwrap();
        drop(warm);
        let before = Held::now(&gpu);

        let op = if fault == Fault::MidRead {
            XferOp::Read
        } else {
            XferOp::Write
        };
        let mut req = xfer(op, &name, peer.base, BLOCKS, Some("doomed".into()));
        let (error, detected) = kill_during(fault, &mut peer, &mut req);
        println!(
            "{label}: {:.1} ms after the kill: {error}",
            detected.as_secs_f64() * 1e3
        );
        match &error {
            Error::RemoteDisconnect { agent, .. } => assert_eq!(agent, &name, "{label}"),
            other => panic!("{label}: expected RemoteDisconnect, got {other:?}"),
        }
        assert!(
            detected < DETECTION_BOUND,
            "{label}: RemoteDisconnect after {detected:?} (bound {DETECTION_BOUND:?})"
        );
        drop(req);
        drop(peer);

        // The same name, a new process.
        incarnation += 1;
        let mut restarted = spawn_peer(row, &name, incarnation);
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
            let after = Held::now(&gpu);
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
