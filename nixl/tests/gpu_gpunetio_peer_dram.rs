//! GPUNETIO between VRAM and a same-host peer's DRAM (the backend's `peer_dram` module):
//! two processes on one GPU, VRAM → peer DRAM in one copy by the peer (WRITE and READ,
//! batch 1 and 64, 4 KiB..64 MiB with odd sizes and offsets, the target checking each
//! WRITE's memory at the moment its notification arrives), DRAM → peer VRAM on the
//! intra-node path; `vram_peer_copy=off` and a target that never loaded this side's
//! metadata take the CPU proxy with the same data; a target killed mid-transfer is
//! `RemoteDisconnect`; requests of 512 small blocks on each of the target's copy
//! strategies. Bandwidth is printed beside pinned copies of the same block size
//! measured in the same run (no timing is asserted). With `NIXL_PEER_COPY_TRACE=1`
//! (both processes: the target inherits it) each bandwidth row is preceded by a
//! `REPORT … trace …` line: the mean time of each step of a request (post → sent →
//! the target read it → copies launched → seen complete → answer sent → read here →
//! notification sent → Done), in microseconds.
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead.
#![cfg(all(feature = "gpunetio", feature = "libfabric"))]

mod common;
mod vram_peer_dram;

use common::{listening, TIMEOUT};
use nixl::{AgentConfig, Error, MemKind, XferOp};
use std::time::{Duration, Instant};
use vram_peer_dram::{agent, direct_both_ways, write_and_read, Local, Target, BACKEND};

fn gpunetio() {
    let _ = BACKEND.set("GPUNETIO");
}

/// The target process (see [`vram_peer_dram::target_main`]).
#[test]
fn gpu_peer_dram_target_main() {
    vram_peer_dram::target_main();
}

#[test]
fn gpu_gpunetio_vram_to_peer_dram_direct() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_gpunetio_vram_to_peer_dram_direct") else {
        return;
    };
    gpunetio();
    direct_both_ways("gpunetio-one-gpu", &[gpu], 0);
}

/// Requests of 512 small blocks (upstream's GPUNETIO line's batch), the target serving
/// them on each copy strategy.
#[test]
fn gpu_gpunetio_peer_dram_many_blocks() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_gpunetio_peer_dram_many_blocks") else {
        return;
    };
    gpunetio();
    vram_peer_dram::many_blocks(
        "gpunetio-many",
        &gpu,
        &[Some("memcpy"), Some("kernel"), Some("batch"), None],
    );
}

/// `vram_peer_copy=off`: the CPU proxy, counted as such; a target that never loaded this
/// side's metadata declines (its control connection names a peer it cannot confirm), and
/// the request runs on the CPU proxy with the same data.
#[test]
fn gpu_gpunetio_peer_dram_cpu_proxy_when_off_or_declined() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_gpunetio_peer_dram_cpu_proxy_when_off_or_declined")
    else {
        return;
    };
    gpunetio();
    let forced = agent(
        "peer-dram-initiator",
        &[("vram_peer_copy", "off")],
        listening(),
    );
    let mut local = Local::new(&gpu, &forced);
    let target = Target::spawn("gio-forced", 0);
    let name = forced.fetch_remote_metadata(target.addr).unwrap();
    forced.send_local_metadata(target.addr).unwrap();
    for size in [4097, (4 << 20) + 1] {
        write_and_read(
            &forced,
            &name,
            &mut local,
            &target,
            MemKind::Vram,
            MemKind::Dram,
            size,
            2,
            5,
            true,
        );
    }
    let info = vram_peer_dram::peer_copy_info(&forced, &name);
    assert_eq!(info["vram_peer_dram"], "cpu_proxy", "{info:?}");
    target.finish(&forced, &name);
    drop(local);
    drop(forced);
    // Declined: the target does not know this initiator.
    let stranger = agent("peer-dram-stranger", &[], AgentConfig::default());
    let mut local = Local::new(&gpu, &stranger);
    let target = Target::spawn("gio-declined", 0);
    let name = stranger.fetch_remote_metadata(target.addr).unwrap();
    for size in [4097, (8 << 20) + 3] {
        write_and_read(
            &stranger,
            &name,
            &mut local,
            &target,
            MemKind::Vram,
            MemKind::Dram,
            size,
            2,
            9,
            false,
        );
    }
    let info = vram_peer_dram::peer_copy_info(&stranger, &name);
    assert_eq!(info["peer_copy_fallbacks"], "4", "{info:?}");
    assert_eq!(info["peer_copy_bytes"], "0", "{info:?}");
    drop(target);
}

/// A target killed while it copies on request: `RemoteDisconnect` (its control
/// connection ends).
#[test]
fn gpu_gpunetio_peer_dram_dead_target_is_remote_disconnect() {
    let Some(gpu) =
        gpu_mem::gpu_for_test("gpu_gpunetio_peer_dram_dead_target_is_remote_disconnect")
    else {
        return;
    };
    gpunetio();
    let initiator = agent("peer-dram-initiator", &[], listening());
    let local = Local::new(&gpu, &initiator);
    let mut target = Target::spawn("gio-dead", 0);
    let name = initiator.fetch_remote_metadata(target.addr).unwrap();
    initiator.send_local_metadata(target.addr).unwrap();
    let len = 64 << 20;
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &local.blocks(MemKind::Vram, false, 0, len, len, 1),
            &target.blocks(MemKind::Dram, 0, len, len, 1),
            &name,
            Some(b"never checked".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    target.child.kill().unwrap();
    target.child.wait().unwrap();
    let killed = Instant::now();
    let mut seen = None;
    while seen.is_none() && killed.elapsed() < TIMEOUT {
        match req.wait(Duration::from_secs(1)) {
            Ok(()) => match req.post() {
                Err(e) => seen = Some(e),
                Ok(_) => continue,
            },
            Err(Error::Timeout(_)) => continue,
            Err(e) => seen = Some(e),
        }
    }
    let seen = seen.expect("the dead target was never noticed");
    assert!(matches!(seen, Error::RemoteDisconnect { .. }), "{seen:?}");
    println!(
        "REPORT gpunetio VRAM->peer DRAM: target's death noticed {:?} after the kill",
        killed.elapsed()
    );
}
