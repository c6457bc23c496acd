//! Direct VRAM ↔ same-host peer DRAM over LIBFABRIC across two GPUs: the initiator's
//! VRAM on GPU 0, the target's on GPU 1 (the cases of `gpu_vram_peer_dram`: the side
//! that owns the DRAM imports the other side's VRAM into the GPU holding it).
//!
//! Needs two GPUs: with fewer every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) fewer than two GPUs fail instead.
#![cfg(all(feature = "cuda", feature = "libfabric"))]

mod common;
mod vram_peer_dram;

/// The target process (see [`vram_peer_dram::target_main`]).
#[test]
fn gpu_peer_dram_target_main() {
    vram_peer_dram::target_main();
}

#[test]
fn gpu_vram_peer_dram_direct_2gpu() {
    let Some(gpus) = gpu_mem::gpus_for_test("gpu_vram_peer_dram_direct_2gpu", 2) else {
        return;
    };
    vram_peer_dram::direct_both_ways("two-gpus", &gpus, 1);
}
