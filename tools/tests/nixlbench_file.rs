//! nixlbench's storage runs end to end (feature `file`): `--backend FILE` WRITE and READ
//! of DRAM against two files with the consistency check, the hf3fs-gdr daemon started by
//! nixlbench itself and gone afterwards, the files and the daemon's directory removed,
//! and bad storage options refused.
#![cfg(feature = "file")]

use std::path::PathBuf;
use std::process::{Command, Output};

const NIXLBENCH: &str = env!("CARGO_BIN_EXE_nixlbench");

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("nixlbench-file-{tag}-{}", std::process::id()));
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

fn nixlbench(args: &[&str]) -> Output {
    Command::new(NIXLBENCH).args(args).output().unwrap()
}

#[test]
fn file_backend_write_and_read_dram_with_consistency_check() {
    let dir = TempDir::new("rw");
    let path = dir.0.to_str().unwrap();
    for op in ["WRITE", "READ"] {
        let out = nixlbench(&[
            "--backend",
            "FILE",
            "--target_seg_type",
            "FILE",
            "--initiator_seg_type",
            "DRAM",
            "--filepath",
            path,
            "--num_files",
            "2",
            "--op_type",
            op,
            "--check_consistency",
            "--total_buffer_size",
            "4194304",
            "--start_block_size",
            "4096",
            "--max_block_size",
            "1048576",
            "--max_batch_size",
            "4",
            "--num_threads",
            "2",
            "--num_iter",
            "8",
            "--warmup_iter",
            "1",
            "--no_progress",
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{op}: {}\n{stdout}\n{stderr}",
            out.status
        );
        assert!(
            stdout.contains("backend FILE (one process, FILE(zero-copy))"),
            "{op}: {stdout}"
        );
        assert!(stdout.contains("2 file(s)"), "{stdout}");
        assert!(stdout.contains("hf3fs-gdr daemon on"), "{stdout}");
        assert!(
            stdout.contains("(started "),
            "nixlbench started the daemon: {stdout}"
        );
        assert!(
            stdout.contains("consistency check: every block verified"),
            "{op}: {stdout}"
        );
        let peak = stdout
            .lines()
            .find(|l| l.starts_with("FILE ") && l.contains(" peak: "))
            .unwrap_or_else(|| panic!("no peak line: {stdout}"));
        let gbps: f64 = peak
            .split(" peak: ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{peak}"));
        assert!(gbps > 0.0, "{peak}");
        // 4 KiB .. 1 MiB, batches 1, 2, 4: every row printed.
        let rows = stdout
            .lines()
            .filter(|l| {
                l.split_whitespace()
                    .next()
                    .is_some_and(|w| w.parse::<u64>().is_ok())
            })
            .count();
        assert_eq!(rows, 9 * 3 - 1, "{stdout}"); // 1 MiB x 4 x 2 threads > 4 MiB
                                                 // The files, and the virtual directory of the daemon it started, are gone.
        let left: Vec<_> = std::fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "{op}: left behind: {left:?}");
        // The daemon it started is gone: nothing serves the directory any more.
        assert!(
            hf3fs_gdr::daemon_stats(&dir.0).is_err(),
            "a daemon still serves {path}"
        );
    }
}

#[test]
fn storage_options_are_checked() {
    let dir = TempDir::new("bad");
    let path = dir.0.to_str().unwrap();
    for (args, want) in [
        (
            vec!["--backend", "FILE", "--target_seg_type", "DRAM"],
            "--target_seg_type FILE",
        ),
        (vec!["--num_files", "2"], "belongs to storage runs"),
        (
            vec!["--backend", "FILE", "--filepath", path, "--role", "target"],
            "runs in one process",
        ),
        (
            vec![
                "--backend",
                "FILE",
                "--filepath",
                "/nonexistent/nixlbench",
                "--hf3fs_mount",
                path,
                "--num_iter",
                "1",
                "--max_block_size",
                "4096",
            ],
            "/nonexistent/nixlbench",
        ),
    ] {
        let out = nixlbench(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}
