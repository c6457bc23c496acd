//! Direct VRAM ↔ same-host peer DRAM over LIBFABRIC (the backend's `peer_copy` module):
//! two processes on one GPU, VRAM → peer DRAM and DRAM → peer VRAM, WRITE and READ,
//! batch 1 and 64, 4 KiB..64 MiB with odd sizes and offsets. The target checks its
//! memory at the moment each WRITE's notification arrives and answers with its verdict;
//! READs are checked here. Every transfer of the direct path reports no staged bytes;
//! `vram_peer_copy=off` stages; a target that never loaded the initiator's metadata
//! declines and the transfer runs staged, with the same data; a target killed
//! mid-transfer is `RemoteDisconnect`; requests of 512 small blocks. Bandwidth is printed beside a pinned
//! device-to-host and host-to-device copy measured in the same run (no timing is
//! asserted); with `NIXL_PEER_COPY_TRACE=1` each request's steps' mean times too
//! (`REPORT … trace …`, see `gpu_gpunetio_peer_dram`). Two GPUs:
//! `gpu_multi_vram_peer_dram`.
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead.
#![cfg(all(feature = "cuda", feature = "libfabric"))]

mod common;
mod vram_peer_dram;

use common::{listening, TIMEOUT};
use nixl::{AgentConfig, Error, MemKind, XferOp};
use std::time::{Duration, Instant};
use vram_peer_dram::{agent, direct_both_ways, write_and_read, Local, Target};

/// The target process (see [`vram_peer_dram::target_main`]).
#[test]
fn gpu_peer_dram_target_main() {
    vram_peer_dram::target_main();
}

#[test]
fn gpu_vram_to_peer_dram_and_dram_to_peer_vram_direct() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_vram_to_peer_dram_and_dram_to_peer_vram_direct")
    else {
        return;
    };
    direct_both_ways("one-gpu", &[gpu], 0);
}

/// Requests of 512 small blocks VRAM ↔ peer DRAM (LIBFABRIC has no `copy_engine`: the
/// target serves on its default strategy).
#[test]
fn gpu_vram_peer_dram_many_blocks() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_vram_peer_dram_many_blocks") else {
        return;
    };
    vram_peer_dram::many_blocks("libfabric-many", &gpu, &[None]);
}

/// `vram_peer_copy=off` stages; a target that never loaded this side's metadata declines
/// the target-owned case, which then runs staged; the data is the same either way.
#[test]
fn gpu_vram_peer_dram_staged_when_forced_or_declined() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_vram_peer_dram_staged_when_forced_or_declined")
    else {
        return;
    };
    // Forced: every case staged, checked at the target too.
    let forced = agent(
        "peer-dram-initiator",
        &[("vram_peer_copy", "off")],
        listening(),
    );
    let mut local = Local::new(&gpu, &forced);
    let target = Target::spawn("forced", 0);
    let name = forced.fetch_remote_metadata(target.addr).unwrap();
    forced.send_local_metadata(target.addr).unwrap();
    for (lk, rk) in [
        (MemKind::Vram, MemKind::Dram),
        (MemKind::Dram, MemKind::Vram),
    ] {
        let size = (4 << 20) + 1;
        let staged = write_and_read(
            &forced, &name, &mut local, &target, lk, rk, size, 1, 5, true,
        );
        assert_eq!(
            staged,
            (size as u64, size as u64),
            "{lk:?}->peer {rk:?}: vram_peer_copy=off stages"
        );
    }
    let info = vram_peer_dram::peer_copy_info(&forced, &name);
    assert_eq!(info["vram_peer_dram"], "staged", "{info:?}");
    assert_eq!(info["peer_copy_bytes"], "0", "{info:?}");
    target.finish(&forced, &name);
    drop(local);
    drop(forced);
    // Declined: the target does not know this initiator (no metadata sent), so it
    // cannot check its VRAM: the request runs staged (its telemetry was the direct
    // path's when prepared), the data is the same.
    let stranger = agent("peer-dram-stranger", &[], AgentConfig::default());
    let mut local = Local::new(&gpu, &stranger);
    let target = Target::spawn("declined", 0);
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
    // Both declined requests (a WRITE and its READ, per size) ran the ordinary path.
    let info = vram_peer_dram::peer_copy_info(&stranger, &name);
    assert_eq!(info["peer_copy_fallbacks"], "4", "{info:?}");
    assert_eq!(info["peer_copy_bytes"], "0", "{info:?}");
    // The target cannot be told bye (it does not know this agent): dropped, killed.
    drop(target);
}

/// A target killed while the direct path copies: `RemoteDisconnect`, for both cases
/// (this side copying into its VRAM, and it copying on request).
#[test]
fn gpu_vram_peer_dram_dead_target_is_remote_disconnect() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_vram_peer_dram_dead_target_is_remote_disconnect")
    else {
        return;
    };
    for (lk, rk) in [
        (MemKind::Vram, MemKind::Dram),
        (MemKind::Dram, MemKind::Vram),
    ] {
        let initiator = agent("peer-dram-initiator", &[], listening());
        let local = Local::new(&gpu, &initiator);
        let mut target = Target::spawn(&format!("dead-{lk:?}"), 0);
        let name = initiator.fetch_remote_metadata(target.addr).unwrap();
        initiator.send_local_metadata(target.addr).unwrap();
        let len = 64 << 20;
        let mut req = initiator
            .create_xfer_req(
                XferOp::Write,
                &local.blocks(lk, false, 0, len, len, 1),
                &target.blocks(rk, 0, len, len, 1),
                &name,
                Some(b"never checked".to_vec()),
            )
            .unwrap();
        req.post().unwrap();
        target.child.kill().unwrap();
        target.child.wait().unwrap();
        let killed = Instant::now();
        // The post in flight ends (done before the kill, or the peer's death); the next
        // one is refused as the peer's death, promptly.
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
        assert!(
            matches!(seen, Error::RemoteDisconnect { .. }),
            "{lk:?}->peer {rk:?}: {seen:?}"
        );
        println!(
            "REPORT {lk:?}->peer {rk:?}: target's death noticed {:?} after the kill",
            killed.elapsed()
        );
    }
}
