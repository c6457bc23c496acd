//! `kvbench` end to end on DRAM: two processes (the target started by the initiator)
//! through the agent's default backends (`LIBFABRIC` shared memory on this host), every
//! block checked; a target whose plan differs fails the check; wrong invocations are
//! refused with one line.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use support::{finish, Outcome};

const KVBENCH: &str = env!("CARGO_BIN_EXE_kvbench");

fn spawn(args: &[&str]) -> Child {
    Command::new(KVBENCH)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvbench starts")
}

fn run(args: &[&str]) -> Outcome {
    finish(
        spawn(args),
        &format!("kvbench {args:?}"),
        Duration::from_secs(120),
    )
}

/// A small cache: 2 layers × K/V × 64 blocks of 4 KiB, 8 blocks per request.
const SMALL: &[&str] = &[
    "--layers",
    "2",
    "--blocks",
    "64",
    "--block-bytes",
    "4K",
    "--blocks-per-request",
    "8",
    "--requests",
    "12",
];

/// The numbers of the result row (the line after the column names).
fn result_row(stdout: &str) -> Vec<f64> {
    let mut lines = stdout.lines().skip_while(|l| !l.contains("descs/req"));
    lines.next();
    lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect()
}

#[test]
fn reads_and_writes_every_layout_and_order_verified() {
    for (op, layout, ids, inflight) in [
        ("READ", "block-major", "random", "1"),
        ("READ", "strided", "sequential", "4"),
        ("WRITE", "block-major", "sequential", "1"),
        ("WRITE", "strided", "random", "4"),
    ] {
        let mut args = SMALL.to_vec();
        args.extend([
            "--op",
            op,
            "--layout",
            layout,
            "--block-ids",
            ids,
            "--inflight",
            inflight,
        ]);
        let o = run(&args);
        let case = format!("{args:?}: {}\n{}", o.stdout, o.stderr);
        assert_eq!(o.code, Some(0), "{case}");
        assert!(o.stdout.contains("data verified"), "{case}");
        assert!(
            o.stdout.contains(&format!(
                "{op} DRAM -> DRAM, backend LIBFABRIC (the agent's choice)"
            )),
            "{case}"
        );
        assert!(
            o.stdout.contains(&format!("({layout}), {ids} block ids")),
            "{case}"
        );
        let row = result_row(&o.stdout);
        // descs/req, bytes/req, inflight, requests, GB/s, p50, p99, prep local, remote
        assert_eq!(row.len(), 9, "{case}");
        assert_eq!(row[0], 32.0, "2 layers × K/V × 8 blocks: {case}");
        assert_eq!(row[1], (32 * 4096) as f64, "{case}");
        assert_eq!(row[2], inflight.parse::<f64>().unwrap(), "{case}");
        assert_eq!(row[3], 12.0, "{case}");
        assert!(row[4] > 0.0 && row[5] > 0.0 && row[6] >= row[5], "{case}");
    }
}

/// NIXL's default name, named: `UCX` runs `LIBFABRIC` (and says so).
#[test]
fn a_named_backend_runs_it() {
    let mut args = SMALL.to_vec();
    args.extend(["--backend", "UCX", "--no-verify"]);
    let o = run(&args);
    assert_eq!(o.code, Some(0), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains("backend LIBFABRIC (named)"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("data not checked"), "{}", o.stdout);
    assert!(
        o.stderr.contains("LIBFABRIC runs in its place"),
        "{}",
        o.stderr
    );
}

/// Two sides started by hand with different seeds write different blocks than the
/// target expects: the target's check fails, and the initiator exits with its verdict.
#[test]
fn a_wrong_write_is_caught_by_the_target() {
    let mut target_args = SMALL.to_vec();
    target_args.extend([
        "--op",
        "WRITE",
        "--seed",
        "2",
        "--role",
        "target",
        "--listen",
        "127.0.0.1:0",
    ]);
    let mut target = spawn(&target_args);
    let mut out = BufReader::new(target.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("KVBENCH_TARGET ")
        .unwrap_or_else(|| panic!("announce line: {line:?}"))
        .to_string();
    let mut args = SMALL.to_vec();
    args.extend(["--op", "WRITE", "--seed", "1", "--target", &addr]);
    let o = run(&args);
    assert_eq!(o.code, Some(1), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stderr
            .contains("WRITE data check failed on the target: layer"),
        "{}",
        o.stderr
    );
    target.stdout = Some(out.into_inner());
    let t = finish(target, "the target", Duration::from_secs(30));
    assert_eq!(t.code, Some(0), "{}", t.stderr);
}

#[test]
fn wrong_invocations_are_one_line() {
    for (args, code, want) in [
        (&["--block-bytes", "12"][..], 2, "a positive multiple of 8"),
        (
            &[
                "--blocks",
                "8",
                "--blocks-per-request",
                "4",
                "--inflight",
                "4",
            ][..],
            2,
            "raise --blocks",
        ),
        (&["--layers", "0"][..], 2, "--layers"),
        (&["--op", "COPY"][..], 2, "READ, WRITE"),
        (
            &[
                "--backend",
                "FOO",
                "--blocks",
                "16",
                "--blocks-per-request",
                "4",
            ][..],
            2,
            "no such backend",
        ),
        (
            &[
                "--backend-param",
                "x=1",
                "--blocks",
                "16",
                "--blocks-per-request",
                "4",
            ][..],
            2,
            "--backend-param needs a backend",
        ),
    ] {
        let o = run(args);
        assert_eq!(o.code, Some(code), "{args:?}: {}", o.stderr);
        let err = o.stderr.trim();
        assert!(!err.contains('\n'), "{args:?}: one line: {err}");
        assert!(
            err.starts_with("kvbench: ") && err.contains(want),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // Without a GPU (or without feature cuda), VRAM is refused with the reason.
    let mut args = SMALL.to_vec();
    args.extend(["--initiator-mem", "VRAM"]);
    let o = run(&args);
    if o.code != Some(0) {
        assert_eq!(o.code, Some(2), "{}", o.stderr);
        assert!(o.stderr.contains("--initiator-mem VRAM: "), "{}", o.stderr);
    }
}
