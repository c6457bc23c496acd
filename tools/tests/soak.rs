//! `nixl-soak` sized for CI: 32 agents in separate processes for about a minute through
//! peer-to-peer metadata, and a shorter run through etcd (feature `etcd`; skipped with a
//! reason when no `etcd` binary is found). Correctness only: every byte verified, no wait
//! past a generous stall bound, no unexpected error or exit, long-lived agents' file
//! descriptors, threads, live heap (the leak check) and resident memory (a loose bound)
//! flat after the warm-up. No timing is asserted beyond the stall bound.
//! `NIXL_SOAK_SECONDS` lengthens (or shortens) the peer-to-peer run.

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

const SOAK: &str = env!("CARGO_BIN_EXE_nixl-soak");

/// Runs `nixl-soak` with `args`, prints its output, and returns the JSON summary.
fn soak(tag: &str, args: &[&str], seconds: u64) -> serde_json::Value {
    let dir = std::env::temp_dir().join(format!("nixl-soak-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("summary.json");
    let child = Command::new(SOAK)
        .args(args)
        .arg("--duration")
        .arg(format!("{seconds}s"))
        .arg("--run-dir")
        .arg(dir.join("logs"))
        .arg("--json")
        .arg(&json)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Start-up, the run, and the leaving of every worker.
    let out = support::finish(child, "nixl-soak", Duration::from_secs(seconds + 240));
    println!("{}", out.stdout);
    eprintln!("{}", out.stderr);
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("no summary ({e})")),
    )
    .unwrap();
    assert_eq!(
        out.code,
        Some(0),
        "nixl-soak failed; problems: {:#}",
        summary["problems"]
    );
    assert_eq!(summary["passed"], true);
    let c = &summary["counters"];
    assert_eq!(c["corrupt_bytes"], 0);
    assert!(c["writes"].as_u64().unwrap() > 0 && c["reads"].as_u64().unwrap() > 0);
    assert!(c["notifs_verified"].as_u64().unwrap() > 0);
    assert!(summary["crashes"].as_u64().unwrap() + summary["leaves"].as_u64().unwrap() > 0);
    let _ = std::fs::remove_dir_all(&dir);
    summary
}

#[test]
fn thirty_two_agents_p2p() {
    let seconds = std::env::var("NIXL_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(75);
    let summary = soak(
        "p2p",
        &[
            "--agents",
            "32",
            "--metadata",
            "p2p",
            "--warmup",
            "20s",
            "--stall-bound",
            "20s",
            "--report-every",
            "15s",
        ],
        seconds,
    );
    // The growth check ran for the long-lived agents, their live heap included (the
    // workers reported their allocator's count).
    let long_lived = summary["long_lived"].as_array().unwrap();
    assert_eq!(long_lived.len(), 4);
    for agent in long_lived {
        assert!(
            agent["baseline"]["heap_kib"].as_u64().unwrap() > 0
                && agent["last"]["heap_kib"].as_u64().unwrap() > 0,
            "no live heap reported: {agent}"
        );
    }
}

#[cfg(feature = "etcd")]
#[test]
fn sixteen_agents_etcd() {
    let bin = std::env::var("NIXL_TEST_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
    if Command::new(&bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        println!("skipped: no etcd binary `{bin}` (Debian: etcd-server; or NIXL_TEST_ETCD_BIN)");
        return;
    }
    soak(
        "etcd",
        &[
            "--agents",
            "16",
            "--metadata",
            "etcd",
            "--etcd-bin",
            &bin,
            "--long-lived",
            "2",
            "--warmup",
            "15s",
            "--stall-bound",
            "20s",
            "--report-every",
            "15s",
        ],
        45,
    );
}
