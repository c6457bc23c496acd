//! nixlbench's `--backend GPUNETIO` (and `LIBFABRIC` between VRAM and a peer's DRAM) on a
//! GPU (feature `cuda`): the self-launched target
//! on this node, VRAM→VRAM and DRAM→VRAM, WRITE and READ, every block of every point
//! verified (`--check_consistency`), with the parameters built from nixlbench's own
//! flags (`--gpunetio_device_list`, `--device_list`, `--gpunetio_oob_list`) and
//! `--backend_param cuda_streams=…` over them; two threads post at once (the stream pool).
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead. The nixlbench binary is
//! `NIXLBENCH_BIN`, else `../bin/nixlbench` beside this test binary (the GPU bundle's
//! layout), else the one cargo built with this test.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(300);

fn nixlbench() -> PathBuf {
    if let Some(p) = std::env::var_os("NIXLBENCH_BIN") {
        return p.into();
    }
    let bundled = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bin/nixlbench")));
    match bundled {
        Some(p) if p.is_file() => p,
        _ => env!("CARGO_BIN_EXE_nixlbench").into(),
    }
}

/// Runs nixlbench with `args` (bounded by [`TIMEOUT`]); returns its stdout, failing the
/// test on a non-zero exit.
fn run(args: &[&str]) -> String {
    let bin = nixlbench();
    let mut child = Command::new(&bin)
        .args(args)
        .args(["--no_progress"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    println!("$ nixlbench {}\n{stdout}{stderr}", args.join(" "));
    assert!(
        out.status.success(),
        "nixlbench {} exited with {} after {:?}:\n{stdout}\n{stderr}",
        args.join(" "),
        out.status,
        start.elapsed()
    );
    stdout
}

/// The table's rows: (block size, batch size, GB/s, average post µs).
fn rows(table: &str) -> Vec<(usize, usize, f64, f64)> {
    table
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.parse().ok()?,
                f.get(1)?.parse().ok()?,
                f.get(2)?.parse().ok()?,
                f.get(6)?.parse().ok()?,
            ))
        })
        .collect()
}

fn checked_run(test: &str, extra: &[&str], op: &str, initiator_seg: &str) {
    if gpunetio::gpu_for_test(test).is_none() {
        return;
    }
    let mut args = vec![
        "--backend",
        "GPUNETIO",
        "--op_type",
        op,
        "--initiator_seg_type",
        initiator_seg,
        "--target_seg_type",
        "VRAM",
        "--start_block_size",
        "4096",
        "--max_block_size",
        "4194304",
        "--max_batch_size",
        "4",
        "--total_buffer_size",
        "67108864",
        "--num_iter",
        "50",
        "--warmup_iter",
        "5",
        "--large_blk_iter_ftr",
        "4",
        "--check_consistency",
    ];
    args.extend_from_slice(extra);
    let table = run(&args);
    let rows = rows(&table);
    // 4 KiB .. 4 MiB (11 sizes) by batch 1, 2, 4: all fit in 64 MiB.
    assert_eq!(rows.len(), 33, "{table}");
    assert!(rows.iter().all(|r| r.2 > 0.0), "{table}");
    assert!(
        table.contains("consistency check: every block verified"),
        "{table}"
    );
    let from = if initiator_seg == "VRAM" {
        "VRAM (GPU 0) -> VRAM (GPU 0)"
    } else {
        "DRAM -> VRAM (GPU 0)"
    };
    assert!(table.contains(from), "{table}");
    // GPUNETIO says which path it takes: a target's VRAM on this host, CUDA IPC.
    assert!(
        table.contains("(path: intra-node, CUDA IPC: the target's VRAM (GPU 0) mapped here and written by the transfer kernel on GPU 0, same GPU)"),
        "{table}"
    );
}

#[test]
fn gpunetio_vram_to_vram_write() {
    checked_run(
        "gpunetio_vram_to_vram_write",
        &["--gpunetio_device_list", "0"],
        "WRITE",
        "VRAM",
    );
}

#[test]
fn gpunetio_vram_to_vram_read() {
    checked_run("gpunetio_vram_to_vram_read", &[], "READ", "VRAM");
}

#[test]
fn gpunetio_dram_to_vram_write_and_read() {
    checked_run("gpunetio_dram_to_vram_write_and_read", &[], "WRITE", "DRAM");
    checked_run("gpunetio_dram_to_vram_write_and_read", &[], "READ", "DRAM");
}

/// Two threads post at once on a pool of two streams; the network device (one this
/// machine has, if any: a missing one is refused, see cli.rs) and OOB interface flags
/// reach the backend (recorded for the NIC path) without harm.
#[test]
fn gpunetio_stream_pool_two_threads_and_nic_flags() {
    let devices = tools::rdma::devices();
    let mut extra = vec![
        "--num_threads",
        "2",
        "--backend_param",
        "cuda_streams=2",
        "--gpunetio_oob_list",
        "lo",
    ];
    if let Some(device) = devices.first() {
        extra.extend(["--device_list", device.as_str()]);
    }
    checked_run(
        "gpunetio_stream_pool_two_threads_and_nic_flags",
        &extra,
        "WRITE",
        "VRAM",
    );
}

/// VRAM to a peer's DRAM (upstream's GPUNETIO line, small): the header names the path.
/// A target on this node is reached by the direct peer copy (it copies from this side's
/// VRAM through CUDA IPC); with `vram_peer_copy=off`, by the NIC path's CPU proxy and its
/// provider, since no ConnectX NIC is driven. Every block verified either way.
#[test]
fn gpunetio_vram_to_peer_dram_names_its_path() {
    if gpunetio::gpu_for_test("gpunetio_vram_to_peer_dram_names_its_path").is_none() {
        return;
    }
    let line = [
        "--backend",
        "GPUNETIO",
        "--initiator_seg_type",
        "VRAM",
        "--target_seg_type",
        "DRAM",
        "--gpunetio_device_list",
        "0",
        "--start_batch_size",
        "4",
        "--max_batch_size",
        "4",
        "--max_block_size",
        "1048576",
        "--total_buffer_size",
        "16777216",
        "--num_iter",
        "20",
        "--warmup_iter",
        "2",
        "--check_consistency",
    ];
    let off = ["--backend_param", "vram_peer_copy=off"];
    for (extra, path) in [
        (&[][..], "(path: VRAM <-> the peer's DRAM: direct peer copy"),
        (&off[..], "CPU proxy over libfabric tcp;ofi_rxm"),
    ] {
        let args: Vec<&str> = line.iter().chain(extra).copied().collect();
        let table = run(&args);
        assert!(table.contains(path), "expected `{path}`:\n{table}");
        assert!(table.contains("VRAM (GPU 0) -> DRAM"), "{table}");
        assert!(
            table.contains("consistency check: every block verified"),
            "{table}"
        );
    }
}

/// A number from the environment, else `default`.
fn env_f64(key: &str, default: f64) -> f64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Issue 11's goals, measured by nixlbench on one node: GPUNETIO (stream pool)
/// VRAM→VRAM at >= 0.9x CUDA_IPC's bandwidth for every block of 1 MiB and more, and a
/// host-side post of <= 10 µs on average. Both tables are printed with the ratios and
/// the goals' verdict (asserted only with `NIXLBENCH_ASSERT_GOALS=1`: timings are no
/// test); `NIXLBENCH_MIN_RATIO` and `NIXLBENCH_MAX_POST_US` change the bounds.
#[test]
fn gpunetio_goals_against_cuda_ipc() {
    if gpunetio::gpu_for_test("gpunetio_goals_against_cuda_ipc").is_none() {
        return;
    }
    let sweep = |backend: &str| {
        rows(&run(&[
            "--backend",
            backend,
            "--initiator_seg_type",
            "VRAM",
            "--target_seg_type",
            "VRAM",
            "--start_block_size",
            "1048576",
            "--max_block_size",
            "67108864",
            "--total_buffer_size",
            "268435456",
            "--num_iter",
            "200",
            "--warmup_iter",
            "20",
            "--large_blk_iter_ftr",
            "1",
        ]))
    };
    let ipc = sweep("CUDA_IPC");
    let gpunetio = sweep("GPUNETIO");
    assert_eq!(ipc.len(), 7, "{ipc:?}");
    assert_eq!(gpunetio.len(), 7, "{gpunetio:?}");
    let (min_ratio, max_post) = (
        env_f64("NIXLBENCH_MIN_RATIO", 0.9),
        env_f64("NIXLBENCH_MAX_POST_US", 10.0),
    );
    let mut misses = Vec::new();
    println!("block (B)    CUDA_IPC GB/s  GPUNETIO GB/s  ratio  GPUNETIO avg post (us)");
    for (i, g) in ipc.iter().zip(&gpunetio) {
        assert_eq!(i.0, g.0);
        let ratio = g.2 / i.2;
        println!(
            "{:<12} {:<14.3} {:<14.3} {:<6.3} {:.3}",
            g.0, i.2, g.2, ratio, g.3
        );
        if ratio < min_ratio {
            misses.push(format!(
                "{} B: {ratio:.3}x CUDA_IPC (goal {min_ratio}x)",
                g.0
            ));
        }
        if g.3 > max_post {
            misses.push(format!(
                "{} B: post {:.3} us (goal <= {max_post} us)",
                g.0, g.3
            ));
        }
    }
    // A benchmark, not a correctness check: timings vary from run to run, so the goals
    // are reported, and enforced only where asked (NIXLBENCH_ASSERT_GOALS=1).
    if misses.is_empty() {
        println!("goals met");
    } else {
        println!("goals missed: {}", misses.join("; "));
        assert!(
            std::env::var("NIXLBENCH_ASSERT_GOALS").as_deref() != Ok("1"),
            "goals missed: {}",
            misses.join("; ")
        );
    }
}

/// `--backend LIBFABRIC` between VRAM and the self-launched target's DRAM (and DRAM and
/// its VRAM), WRITE and READ, every block verified: one direct copy through CUDA IPC by
/// the side that owns the DRAM, which the header names (issue 26).
#[test]
fn libfabric_vram_and_peer_dram_direct_copy() {
    if gpunetio::gpu_for_test("libfabric_vram_and_peer_dram_direct_copy").is_none() {
        return;
    }
    for (initiator_seg, target_seg) in [("VRAM", "DRAM"), ("DRAM", "VRAM")] {
        for op in ["WRITE", "READ"] {
            let table = run(&[
                "--backend",
                "LIBFABRIC",
                "--op_type",
                op,
                "--initiator_seg_type",
                initiator_seg,
                "--target_seg_type",
                target_seg,
                "--start_block_size",
                "4096",
                "--max_block_size",
                "67108864",
                "--max_batch_size",
                "4",
                "--total_buffer_size",
                "268435456",
                "--num_iter",
                "20",
                "--warmup_iter",
                "2",
                "--large_blk_iter_ftr",
                "4",
                "--check_consistency",
            ]);
            let rows = rows(&table);
            assert!(
                !rows.is_empty() && rows.iter().all(|r| r.2 > 0.0),
                "{table}"
            );
            assert!(
                table.contains("consistency check: every block verified"),
                "{table}"
            );
            assert!(
                table.contains("one direct copy through CUDA IPC"),
                "{op} {initiator_seg} -> {target_seg}: the header names the direct path\n{table}"
            );
        }
    }
}
