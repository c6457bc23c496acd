//! Every binary's command line as a user meets it: `--help` and `--version` on standard
//! output, wrong invocations refused with one line on standard error (never a panic,
//! never a hang), and nixlbench's progress, plot and flags on real (loopback) runs.

mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{finish, Outcome};

/// Runs `program` with `args`; fails the test if it has not exited within `limit`.
fn run_for(program: &str, args: &[&str], limit: Duration) -> Outcome {
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    finish(child, &format!("{program} {args:?}"), limit)
}

fn run(program: &str, args: &[&str]) -> Outcome {
    run_for(program, args, Duration::from_secs(30))
}

const NIXLBENCH: &str = env!("CARGO_BIN_EXE_nixlbench");
const PREP: &str = env!("CARGO_BIN_EXE_nixl-prep-bench");
const VERBS: &str = env!("CARGO_BIN_EXE_verbs-bench");
const FABRIC: &str = env!("CARGO_BIN_EXE_fabric-bench");

fn binaries() -> Vec<(&'static str, &'static str)> {
    #[allow(unused_mut)]
    let mut list = vec![
        ("nixlbench", NIXLBENCH),
        ("nixl-prep-bench", PREP),
        ("verbs-bench", VERBS),
        ("fabric-bench", FABRIC),
        ("kvbench", env!("CARGO_BIN_EXE_kvbench")),
    ];
    #[cfg(feature = "cuda")]
    list.extend([
        ("gpunetio-put-bw", env!("CARGO_BIN_EXE_gpunetio-put-bw")),
        (
            "gpunetio-write-lat",
            env!("CARGO_BIN_EXE_gpunetio-write-lat"),
        ),
    ]);
    list
}

#[test]
fn help_and_version_on_stdout() {
    for (name, program) in binaries() {
        for flag in ["--help", "-h"] {
            let o = run(program, &[flag]);
            assert_eq!(o.code, Some(0), "{name} {flag}: {}", o.stderr);
            assert!(o.stdout.contains("Usage:"), "{name} {flag}: {}", o.stdout);
            assert!(o.stderr.is_empty(), "{name} {flag}: {}", o.stderr);
        }
        let o = run(program, &["--version"]);
        assert_eq!(o.code, Some(0), "{name}: {}", o.stderr);
        assert_eq!(
            o.stdout.trim(),
            format!("{name} {}", env!("CARGO_PKG_VERSION"))
        );
    }
    let o = run(NIXLBENCH, &["--help"]);
    for want in [
        "Differences from NIXL's nixlbench",
        "--storage_enable_direct",
        "--reregister_mem",
        "RUST_LOG",
    ] {
        assert!(o.stdout.contains(want), "nixlbench --help: {want}");
    }
}

/// The wrong invocations of issue 25 and their kin: each exits non-zero with one line
/// that says what to do, quickly, without a panic.
#[test]
fn wrong_invocations_are_one_line() {
    let plot_dir = std::env::temp_dir().join(format!("nixlbench-cli-{}", std::process::id()));
    let missing_plot = plot_dir.join("missing/plot.png");
    let missing_plot = missing_plot.to_str().unwrap();
    let mut cases: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            NIXLBENCH,
            vec!["--target_address", "127.0.0.1:5"],
            "add --role initiator",
        ),
        (
            NIXLBENCH,
            vec!["--listen", "127.0.0.1:5"],
            "add --role target",
        ),
        (
            NIXLBENCH,
            vec!["--role", "initiator"],
            "needs --target_address",
        ),
        (
            NIXLBENCH,
            vec![
                "--total_buffer_size",
                "10000000000000",
                "--max_block_size",
                "4000000000000",
            ],
            "of DRAM",
        ),
        (
            NIXLBENCH,
            vec!["--check_consistency=maybe"],
            "true or false",
        ),
        (NIXLBENCH, vec!["--num_iter", "0"], "at least 1"),
        (NIXLBENCH, vec!["--num_threads", "0"], "at least 1"),
        (NIXLBENCH, vec!["--backend", "UCX|FOO"], "LIBFABRIC"),
        (NIXLBENCH, vec!["--backend", "GDS"], "--backend FILE"),
        (
            NIXLBENCH,
            vec!["--plot", missing_plot, "--max_block_size", "4K"],
            "no directory",
        ),
        (NIXLBENCH, vec!["--plot", "plot.svg"], "FILE.png"),
        (NIXLBENCH, vec!["--reregister_mem"], "not implemented"),
        (
            NIXLBENCH,
            vec!["--obj_bucket_name", "b"],
            "not in this nixl",
        ),
        (NIXLBENCH, vec!["--progress_threads", "2"], "num_rails"),
        (NIXLBENCH, vec!["--scheme", "tp"], "not implemented"),
        (NIXLBENCH, vec!["--runtime_type", "ASIO"], "SOCKET"),
        (NIXLBENCH, vec!["--op_type", "COPY"], "READ or WRITE"),
        (NIXLBENCH, vec!["--max-blok-size", "4K"], "--max_block_size"),
        (
            NIXLBENCH,
            vec!["--config_file", "/nonexistent/nixlbench.toml"],
            "--config_file",
        ),
        (PREP, vec!["--descs", "x"], "--descs"),
        (PREP, vec!["--descs", "0"], "--descs"),
        (PREP, vec!["--runs", "-1"], "-1"),
        (PREP, vec!["--backend", "FOO"], "no such backend"),
        (PREP, vec!["--backend_param", "x"], "KEY=VALUE"),
        (FABRIC, vec![], "pingpong, rma-bw, compare"),
        (
            FABRIC,
            vec!["pingpong", "-p", "nosuchprov", "-B", "47611"],
            "no provider `nosuchprov`",
        ),
        (
            FABRIC,
            vec!["rma-bw", "-p", "nosuchprov", "-B", "47612"],
            "no provider `nosuchprov`",
        ),
        (FABRIC, vec!["pingpong", "-e", "dgram"], "msg, rdm"),
        (FABRIC, vec!["pingpong", "-S", "4q"], "not a size"),
        (VERBS, vec![], "write-bw"),
        (VERBS, vec!["write-bw", "-s", "0"], "at least 1"),
        (
            VERBS,
            vec!["write-bw", "-d", "nosuchdev", "-p", "18611"],
            "nosuchdev",
        ),
        (VERBS, vec!["compare", "--tests", "nope"], "`nope`"),
    ];
    if cfg!(feature = "cuda") {
        #[cfg(feature = "cuda")]
        cases.extend([
            (
                env!("CARGO_BIN_EXE_gpunetio-put-bw"),
                vec!["-q", "2"],
                "cpu_proxy",
            ),
            (
                env!("CARGO_BIN_EXE_gpunetio-put-bw"),
                vec!["-e", "2"],
                "0, 1",
            ),
            (
                env!("CARGO_BIN_EXE_gpunetio-write-lat"),
                vec!["-p", "foo"],
                "intra_node",
            ),
        ]);
    } else {
        // Without feature cuda these are refused by the options (with it, on a GPU
        // machine, they would run).
        cases.extend([
            (
                NIXLBENCH,
                vec!["--initiator_seg_type", "VRAM"],
                "feature cuda",
            ),
            (
                NIXLBENCH,
                vec![
                    "--etcd-endpoints",
                    "http://etc_server_ip:2379",
                    "--backend=GPUNETIO",
                    "--initiator_seg_type=VRAM",
                    "--target_seg_type=DRAM",
                    "--runtime_type=ETCD",
                    "--gpunetio_device_list=0",
                    "--device_list=mlx5_0",
                    "--start_batch_size=512",
                    "--max_batch_size=512",
                    "--total_buffer_size=34359738368",
                ],
                "feature cuda",
            ),
        ]);
    }
    for (program, args, want) in cases {
        let o = run(program, &args);
        let shown = format!("{program} {args:?}: {}", o.stderr);
        assert!(
            matches!(o.code, Some(c) if c != 0),
            "{shown}: exit {:?}",
            o.code
        );
        assert!(!o.stderr.contains("panicked"), "{shown}");
        assert_eq!(o.stderr.trim_end().lines().count(), 1, "{shown}");
        assert!(o.stderr.contains(want), "{shown}: wants {want:?}");
        assert!(o.stdout.is_empty(), "{shown}: stdout {}", o.stdout);
    }
    let _ = std::fs::remove_dir_all(plot_dir);
}

/// A `--device_list` naming an RDMA device this machine lacks (VERBS, GPUNETIO): one
/// line within 5 s that names the device and what the machine has, before any memory is
/// set up (upstream's GPUNETIO line on a machine without a ConnectX NIC was silent for
/// minutes).
#[test]
fn a_missing_rdma_device_is_refused_at_once() {
    let upstream_gpunetio_line = [
        "--etcd-endpoints",
        "http://127.0.0.1:9",
        "--backend=GPUNETIO",
        "--initiator_seg_type=VRAM",
        "--target_seg_type=DRAM",
        "--runtime_type=ETCD",
        "--gpunetio_device_list=0",
        "--device_list=nosuchdev0",
        "--start_batch_size=512",
        "--max_batch_size=512",
        "--total_buffer_size=34359738368",
    ];
    let mut cases: Vec<Vec<&str>> = vec![
        vec!["--backend", "VERBS", "--device_list", "nosuchdev0"],
        vec![
            "--backend",
            "VERBS",
            "--role",
            "target",
            "--listen",
            "127.0.0.1:0",
            "--backend_param",
            "device=nosuchdev0",
        ],
    ];
    if cfg!(feature = "cuda") {
        cases.push(vec![
            "--backend=GPUNETIO",
            "--initiator_seg_type=VRAM",
            "--target_seg_type=DRAM",
            "--gpunetio_device_list=0",
            "--device_list=nosuchdev0",
        ]);
        if cfg!(feature = "etcd") {
            cases.push(upstream_gpunetio_line.to_vec());
        }
    }
    for args in cases {
        let start = Instant::now();
        let o = run_for(NIXLBENCH, &args, Duration::from_secs(5));
        let shown = format!("{args:?}: {}", o.stderr);
        assert!(
            matches!(o.code, Some(c) if c != 0),
            "{shown}: exit {:?}",
            o.code
        );
        assert_eq!(o.stderr.trim_end().lines().count(), 1, "{shown}");
        assert!(
            o.stderr.contains("no RDMA device nosuchdev0") && o.stderr.contains("it has"),
            "{shown}"
        );
        assert!(start.elapsed() < Duration::from_secs(5), "{shown}");
        assert!(o.stdout.is_empty(), "{shown}: stdout {}", o.stdout);
    }
}

/// A small LOCAL sweep (one process): `extra` flags on top.
fn local_run(extra: &[&str]) -> Outcome {
    let mut args = vec![
        "--backend",
        "LOCAL",
        "--max_block_size",
        "16K",
        "--num_iter",
        "5",
        "--warmup_iter",
        "1",
    ];
    args.extend_from_slice(extra);
    let o = run_for(NIXLBENCH, &args, Duration::from_secs(120));
    assert_eq!(o.code, Some(0), "{args:?}: {}\n{}", o.stdout, o.stderr);
    o
}

/// Rows of nixlbench's table: (block size, batch size).
fn rows(stdout: &str) -> Vec<(usize, usize)> {
    stdout
        .lines()
        .filter_map(|l| {
            let mut cols = l.split_whitespace();
            let block = cols.next()?.parse().ok()?;
            let batch = cols.next()?.parse().ok()?;
            Some((block, batch))
        })
        .collect()
}

#[test]
fn progress_goes_to_stderr_only_when_asked_off_a_terminal() {
    // Standard error is a pipe here: no progress unless --progress.
    let quiet = local_run(&[]);
    assert!(!quiet.stderr.contains("ETA"), "{}", quiet.stderr);
    assert_eq!(rows(&quiet.stdout), [(4096, 1), (8192, 1), (16384, 1)]);
    let shown = local_run(&["--progress", "--max_batch_size", "2"]);
    assert!(
        !shown.stdout.contains("ETA"),
        "the table stays clean: {}",
        shown.stdout
    );
    let lines: Vec<&str> = shown
        .stderr
        .lines()
        .filter(|l| l.contains("point"))
        .collect();
    assert_eq!(lines.len(), 6, "{}", shown.stderr);
    assert!(
        lines[0].contains("point 1/6: block 4K batch 1 (6 iterations), ETA"),
        "{}",
        lines[0]
    );
    assert!(lines[5].contains("block 16K batch 2"), "{}", lines[5]);
    assert!(lines[5].contains("ETA 0s"), "{}", lines[5]);
    let off = local_run(&["--progress", "--no_progress"]);
    assert!(!off.stderr.contains("ETA"), "{}", off.stderr);
}

#[test]
fn boolean_flags_mean_what_they_say() {
    let on = local_run(&["--check_consistency"]);
    assert!(
        on.stdout
            .contains("consistency check: every block verified"),
        "{}",
        on.stdout
    );
    for off in ["--check_consistency=false", "--nocheck_consistency"] {
        let o = local_run(&[off]);
        assert!(
            !o.stdout.contains("consistency check"),
            "{off}: {}",
            o.stdout
        );
    }
    // Upstream's flags that are honoured run.
    let o = local_run(&[
        "--recreate_xfer",
        "--check_consistency",
        "--enable_pt=false",
    ]);
    assert_eq!(rows(&o.stdout).len(), 3, "{}", o.stdout);
    let o = local_run(&[
        "--backend",
        "local",
        "--op_type",
        "READ",
        "--check-consistency",
    ]);
    assert!(
        o.stdout.contains("READ: in the initiator's memory"),
        "{}",
        o.stdout
    );
}

#[test]
fn plot_has_a_line_per_batch_size() {
    let dir = std::env::temp_dir().join(format!("nixlbench-plot-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path: PathBuf = dir.join("sweep.png");
    let p = path.to_str().unwrap();
    let o = local_run(&["--max_batch_size", "4", "--plot", p]);
    assert_eq!(rows(&o.stdout).len(), 9, "{}", o.stdout);
    assert!(o.stdout.contains("plot written to"), "{}", o.stdout);
    let png = std::fs::read(&path).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let _ = std::fs::remove_dir_all(dir);
}

/// The default backend between two processes (the target started on loopback), and
/// `UCX` (upstream's default name) running it.
#[test]
fn a_real_run_of_two_processes() {
    for backend in ["LIBFABRIC", "UCX"] {
        let o = run_for(
            NIXLBENCH,
            &[
                "--backend",
                backend,
                "--max_block_size",
                "8K",
                "--num_iter",
                "5",
                "--warmup_iter",
                "1",
                "--check_consistency",
            ],
            Duration::from_secs(120),
        );
        assert_eq!(o.code, Some(0), "{backend}: {}\n{}", o.stdout, o.stderr);
        assert_eq!(rows(&o.stdout), [(4096, 1), (8192, 1)], "{}", o.stdout);
        assert!(o.stdout.contains("backend LIBFABRIC"), "{}", o.stdout);
        if backend == "UCX" {
            assert!(
                o.stderr.contains("LIBFABRIC runs in its place"),
                "{}",
                o.stderr
            );
        }
    }
}
