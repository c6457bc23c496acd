//! `nixl-attack-bench` at a small size (1,000 hostile connections, 64 MiB of junk
//! frames, 10,000 forged notifications): the legitimate initiator's data is all verified
//! by both sides, the target survives every phase and exits cleanly, the listener keeps
//! answering, and the target's memory stays bounded (generously: this checks for a leak
//! or an unbounded buffer, not for the 64 MiB goal, which the full run measures). No
//! timing is asserted. The harness exits non-zero on any correctness failure (data,
//! target death, a forged notification delivered under the initiator's name).

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

/// Bound on the target's peak RSS growth in any phase.
const RSS_BOUND: u64 = 512 << 20;

/// One `RESULT` line's fields.
fn fields(line: &str) -> std::collections::HashMap<&str, &str> {
    line.split(' ').filter_map(|f| f.split_once('=')).collect()
}

/// One run at a time: each loads the machine's cores with its attackers.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(provider: &str, phases: &str) -> String {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let child = Command::new(env!("CARGO_BIN_EXE_nixl-attack-bench"))
        .args(["--provider", provider, "--phases", phases])
        .args([
            "--connections",
            "1000",
            "--junk",
            "64M",
            "--notifications",
            "10000",
        ])
        .args(["--baseline", "100", "--min-rounds", "20"])
        // Heartbeats tolerate 4 s of silence: on a loaded 2-core machine the attackers
        // can keep the target's heartbeat thread off a core for the default 0.5 s, which
        // is scheduling, not what this test checks.
        .arg("--backend_param=heartbeat_misses=40")
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = support::finish(child, "nixl-attack-bench", Duration::from_secs(600));
    assert_eq!(
        out.code,
        Some(0),
        "{provider}: stdout:\n{}\nstderr:\n{}",
        out.stdout,
        out.stderr
    );
    let results: Vec<_> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("RESULT "))
        .collect();
    let want = 1 + phases.split(',').count();
    assert_eq!(results.len(), want, "{}", out.stdout);
    for line in &results {
        let f = fields(line);
        assert!(
            f["rounds"].parse::<u64>().unwrap() >= 20,
            "{provider}: too few verified rounds: {line}"
        );
        if f["phase"] != "quiet" {
            let growth: i64 = f["rss_growth_bytes"].parse().unwrap();
            assert!(
                (0..RSS_BOUND as i64).contains(&growth),
                "{provider}: target RSS grew {growth} bytes: {line}"
            );
            assert!(
                f["probes_ok"].parse::<u64>().unwrap() > 0,
                "{provider}: the listener answered no probe: {line}"
            );
        }
    }
    // The target's own count of the rounds it checked.
    let stats = out
        .stdout
        .lines()
        .find(|l| l.contains("ATTACK_TARGET_STATS"))
        .unwrap_or_else(|| panic!("{}", out.stdout));
    let s = fields(stats);
    assert_eq!(s["bad"], "0", "{stats}");
    assert_eq!(s["forged_as_initiator"], "0", "{stats}");
    assert!(s["verified"].parse::<u64>().unwrap() > 0, "{stats}");
    out.stdout
}

#[test]
fn tcp_target_serves_through_every_attack() {
    run("tcp;ofi_rxm", "connections,junk,notifications,all");
}

/// `shm`'s notifications phase is left out: libfabric 1.17's `shm` attributed forged
/// messages of a flood to the loaded initiator (see docs/BENCHMARKS.md, "nixl: load
/// under attack"); the listener attacks are the same as over tcp.
#[test]
fn shm_target_serves_through_listener_attacks() {
    run("shm", "connections,junk");
}
