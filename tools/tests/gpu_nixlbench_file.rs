//! nixlbench's storage runs into and out of VRAM (features `cuda` and `file`): READ
//! file → VRAM and WRITE VRAM → file with every block verified, then the bandwidth of
//! nixlbench FILE → VRAM beside hf3fs-gdr's own `gdr_read_bench` on the same daemon and
//! the same size of cached file (the goal: ≥ 0.95× the raw numbers), printed.
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead. The nixlbench binary is
//! `NIXLBENCH_BIN`, else `../bin/nixlbench` beside this test binary (the GPU bundle's
//! layout), else the one cargo built with this test; `gdr_read_bench` is
//! `GDR_READ_BENCH_BIN`, else `../bin/gdr_read_bench` (without it the comparison says so
//! and only nixlbench's number is printed).
#![cfg(all(feature = "cuda", feature = "file"))]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(300);

fn bundled(name: &str) -> Option<PathBuf> {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bin").join(name)))
        .filter(|p| p.is_file())
}

fn nixlbench() -> PathBuf {
    if let Some(p) = std::env::var_os("NIXLBENCH_BIN") {
        return p.into();
    }
    bundled("nixlbench").unwrap_or_else(|| env!("CARGO_BIN_EXE_nixlbench").into())
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p =
            std::env::temp_dir().join(format!("gpu-nixlbench-file-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `bin args` (bounded by [`TIMEOUT`]); returns its stdout, failing on a non-zero
/// exit.
fn run(bin: &Path, args: &[&str]) -> String {
    let mut child = Command::new(bin)
        .args(args)
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
    println!("$ {} {}\n{stdout}{stderr}", bin.display(), args.join(" "));
    assert!(
        out.status.success(),
        "{} exited with {} after {:?}",
        bin.display(),
        out.status,
        start.elapsed()
    );
    stdout
}

/// The number after `marker` on the first line that has it.
fn number_after(text: &str, marker: &str) -> f64 {
    text.lines()
        .find_map(|l| l.split_once(marker))
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no `{marker}` number in:\n{text}"))
}

/// A daemon serving `mount` for the whole test (nixlbench's built-in one), killed on drop.
struct Daemon(Child);

impl Daemon {
    fn start(mount: &Path) -> Self {
        let mut child = Command::new(nixlbench())
            .args(["__hf3fs-gdr-daemon", "--mount"])
            .arg(mount)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        match lines.next() {
            Some(Ok(l)) if l.starts_with("ready ") => {}
            other => {
                let _ = child.kill();
                panic!("the daemon said {other:?}");
            }
        }
        Self(child)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn gpu_nixlbench_file_vram_read_and_write_verified() {
    if gpunetio::gpu_for_test("gpu_nixlbench_file_vram_read_and_write_verified").is_none() {
        return;
    }
    let dir = TempDir::new("rw");
    let path = dir.0.to_str().unwrap();
    for op in ["WRITE", "READ"] {
        let out = run(
            &nixlbench(),
            &[
                "--backend",
                "FILE",
                "--initiator_seg_type",
                "VRAM",
                "--target_seg_type",
                "FILE",
                "--filepath",
                path,
                "--num_files",
                "2",
                "--op_type",
                op,
                "--check_consistency",
                "--total_buffer_size",
                "33554432",
                "--start_block_size",
                "4096",
                "--max_block_size",
                "4194304",
                "--max_batch_size",
                "4",
                "--num_threads",
                "2",
                "--num_iter",
                "16",
                "--warmup_iter",
                "2",
                "--no_progress",
            ],
        );
        assert!(out.contains("VRAM (GPU 0) <-> 2 file(s)"), "{out}");
        assert!(out.contains("FILE(direct)"), "{out}");
        assert!(
            out.contains("consistency check: every block verified"),
            "{op}: {out}"
        );
        assert!(number_after(&out, " peak: ") > 0.0);
    }
}

#[test]
fn gpu_nixlbench_file_to_vram_beside_gdr_read_bench() {
    if gpunetio::gpu_for_test("gpu_nixlbench_file_to_vram_beside_gdr_read_bench").is_none() {
        return;
    }
    let dir = TempDir::new("bw");
    let _daemon = Daemon::start(&dir.0);
    let size: u64 = 1 << 30;
    // nixlbench: one thread posting 1 GiB requests (16 reads of 64 MiB), and two
    // threads posting 512 MiB each (so one request's tail overlaps the other's start).
    let mut nixl_gbps: f64 = 0.0;
    for (threads, batch) in [("1", "16"), ("2", "8")] {
        let out = run(
            &nixlbench(),
            &[
                "--backend",
                "FILE",
                "--initiator_seg_type",
                "VRAM",
                "--filepath",
                dir.0.to_str().unwrap(),
                "--op_type",
                "READ",
                "--total_buffer_size",
                &size.to_string(),
                "--start_block_size",
                "67108864",
                "--max_block_size",
                "67108864",
                "--start_batch_size",
                batch,
                "--max_batch_size",
                batch,
                "--num_threads",
                threads,
                "--num_iter",
                "160",
                "--warmup_iter",
                "2",
                "--no_progress",
            ],
        );
        assert!(
            out.contains("(already running)"),
            "the test's daemon: {out}"
        );
        let gbps = number_after(&out, " peak: ");
        println!("nixlbench FILE->VRAM, {threads} thread(s): {gbps:.2} GB/s");
        nixl_gbps = nixl_gbps.max(gbps);
    }
    let raw = std::env::var_os("GDR_READ_BENCH_BIN")
        .map(PathBuf::from)
        .or_else(|| bundled("gdr_read_bench"));
    let Some(raw) = raw else {
        println!(
            "RESULT nixlbench FILE->VRAM {nixl_gbps:.2} GB/s; gdr_read_bench not found \
             (GDR_READ_BENCH_BIN or ../bin/gdr_read_bench): no comparison"
        );
        return;
    };
    let file = dir.0.join("raw.bin");
    let out = run(
        &raw,
        &[
            "--mount",
            dir.0.to_str().unwrap(),
            "--file",
            file.to_str().unwrap(),
            "--create",
            &size.to_string(),
            "--iters",
            "10",
        ],
    );
    let raw_gbps = number_after(&out, "best ");
    println!(
        "RESULT FILE->VRAM: nixlbench {nixl_gbps:.2} GB/s (best of 1 and 2 threads), \
         gdr_read_bench {raw_gbps:.2} GB/s, ratio {:.3} (goal >= 0.95)",
        nixl_gbps / raw_gbps
    );
}
