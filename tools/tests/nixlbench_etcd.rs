//! nixlbench's ETCD runtime against a real etcd server (Debian's `etcd-server`), started
//! per test on loopback ports with a temporary data directory and removed after: two
//! nixlbench processes started alike find each other and run over LIBFABRIC with the
//! consistency check, a third is refused, a lone one gives up, a vanished initiator is
//! noticed, and every key is gone at the end. Needs `--features etcd`; the `etcd` binary
//! is `NIXL_TEST_ETCD_BIN` or `etcd` on the PATH, and a missing one fails the tests.
#![cfg(feature = "etcd")]

#[path = "../../nixl/tests/support/etcd_server.rs"]
mod etcd_server;

use etcd_server::{free_port, EtcdServer as Etcd};

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const NIXLBENCH: &str = env!("CARGO_BIN_EXE_nixlbench");
const TIMEOUT: Duration = Duration::from_secs(120);

impl Etcd {
    fn url(&self) -> String {
        self.endpoint.clone()
    }

    /// The keys under `prefix`, through etcd's JSON gateway (`/v3/kv/range`).
    fn try_keys(&self, prefix: &str) -> Result<Vec<String>, String> {
        let mut end = prefix.as_bytes().to_vec();
        *end.last_mut().unwrap() += 1;
        let body = format!(
            r#"{{"key":"{}","range_end":"{}","keys_only":true}}"#,
            base64(prefix.as_bytes()),
            base64(&end)
        );
        let mut s = TcpStream::connect_timeout(&self.addr(), Duration::from_secs(2))
            .map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(
            s,
            "POST /v3/kv/range HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr(),
            body.len()
        )
        .map_err(|e| e.to_string())?;
        let mut reply = String::new();
        s.read_to_string(&mut reply).map_err(|e| e.to_string())?;
        let (head, json) = reply.split_once("\r\n\r\n").ok_or("no HTTP body")?;
        if !head.starts_with("HTTP/1.1 200") {
            return Err(format!("etcd answered {head}"));
        }
        // The body may be chunked: the JSON object is between the outer braces.
        let json = &json[json.find('{').ok_or("no JSON")?..=json.rfind('}').ok_or("no JSON")?];
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
        Ok(v["kvs"]
            .as_array()
            .map(|kvs| {
                kvs.iter()
                    .map(|kv| String::from_utf8(unbase64(kv["key"].as_str().unwrap())).unwrap())
                    .collect()
            })
            .unwrap_or_default())
    }

    fn keys(&self, prefix: &str) -> Vec<String> {
        self.try_keys(prefix).unwrap()
    }

    /// Waits until no key is left under `/nixlbench/` (leases revoked or expired).
    fn wait_clean(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = self.keys("/nixlbench/");
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "keys left in etcd: {left:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64(bytes: &[u8]) -> String {
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn unbase64(s: &str) -> Vec<u8> {
    let vals: Vec<u32> = s
        .bytes()
        .filter(|b| *b != b'=')
        .map(|b| B64.iter().position(|c| *c == b).unwrap() as u32)
        .collect();
    let mut out = Vec::new();
    for chunk in vals.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, v)| n | (v << (18 - 6 * i)));
        for i in 0..chunk.len().saturating_sub(1) {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    out
}

/// A nixlbench process with stdout and stderr captured.
fn spawn(args: &[&str]) -> Child {
    spawn_as(None, args)
}

/// [`spawn`], as a process of the host `host_id` (`NIXLBENCH_HOST_ID`) if given.
fn spawn_as(host_id: Option<&str>, args: &[&str]) -> Child {
    let mut cmd = Command::new(NIXLBENCH);
    if let Some(id) = host_id {
        cmd.env("NIXLBENCH_HOST_ID", id);
    }
    cmd.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nixlbench starts")
}

/// Waits for `child` (killed after `within`).
fn finish(mut child: Child, within: Duration) -> Output {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "nixlbench still running after {within:?}; stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A short sweep: a few block sizes and two batch sizes, every block checked.
fn run_args<'a>(endpoint: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--etcd_endpoints",
        endpoint,
        "--no_progress",
        "--num_iter",
        "20",
        "--warmup_iter",
        "2",
        "--start_block_size",
        "4096",
        "--max_block_size",
        "65536",
        "--max_batch_size",
        "2",
        "--total_buffer_size",
        "1048576",
        "--check_consistency",
    ];
    args.extend_from_slice(extra);
    args
}

/// Starts two nixlbench processes alike, the second a little later, and checks that
/// exactly one was the initiator (with a verified table) and the other the target.
fn pair(etcd: &Etcd, extra: &[&str]) -> (String, String) {
    pair_on(etcd, [None, None], extra)
}

/// [`pair`], the two processes claiming the host identities `hosts`.
fn pair_on(etcd: &Etcd, hosts: [Option<&str>; 2], extra: &[&str]) -> (String, String) {
    let endpoint = etcd.url();
    let args = run_args(&endpoint, extra);
    let first = spawn_as(hosts[0], &args);
    std::thread::sleep(Duration::from_millis(300));
    let second = spawn_as(hosts[1], &args);
    let (a, b) = (finish(first, TIMEOUT), finish(second, TIMEOUT));
    let (a_out, a_err) = text(&a);
    let (b_out, b_err) = text(&b);
    assert!(
        a.status.success() && b.status.success(),
        "first ({}): {a_out}{a_err}\nsecond ({}): {b_out}{b_err}",
        a.status,
        b.status
    );
    let (initiator, target) = if a_err.contains("rank 0 of 2 (initiator)") {
        ((a_out, a_err), (b_out, b_err))
    } else {
        ((b_out, b_err), (a_out, a_err))
    };
    assert!(
        initiator.1.contains("rank 0 of 2 (initiator)"),
        "{initiator:?}"
    );
    assert!(target.1.contains("rank 1 of 2 (target)"), "{target:?}");
    assert!(
        initiator
            .0
            .contains("consistency check: every block verified"),
        "{initiator:?}"
    );
    // Every (block, batch) point is a row: 4, 8, 16, 32, 64 KiB by batch 1 and 2.
    let rows = initiator
        .0
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<usize>().is_ok())
        })
        .count();
    assert_eq!(rows, 10, "{}", initiator.0);
    assert!(
        target.0.trim().is_empty(),
        "the target prints no table: {}",
        target.0
    );
    // Both revoked their leases on the way out: nothing is left.
    etcd.wait_clean(Duration::from_secs(3));
    (initiator.0, target.1)
}

#[test]
fn two_processes_meet_through_etcd_and_write() {
    let etcd = Etcd::start("write");
    let (table, target) = pair(&etcd, &[]);
    // The same host (one boot id): the initiator picks shm, and the target follows.
    assert!(
        table.contains("provider shm (default: the target is on this host)"),
        "{table}"
    );
    assert!(table.contains("via etcd"), "{table}");
    assert!(target.contains("nixlbench-target@shm"), "{target}");
    assert!(
        table.contains("WRITE: by the target, in its own memory"),
        "{table}"
    );
}

#[test]
fn two_processes_meet_through_etcd_and_read_over_tcp() {
    let etcd = Etcd::start("read");
    let (table, target) = pair(
        &etcd,
        &[
            "--op_type",
            "READ",
            "--backend_param",
            "provider=tcp;ofi_rxm",
            "--etcd-endpoints",
            &etcd.url(),
            "--benchmark_group",
            "tcp-read",
        ],
    );
    assert!(
        table.contains("provider tcp;ofi_rxm (the target's)"),
        "{table}"
    );
    assert!(target.contains("nixlbench-target@tcp;ofi_rxm"), "{target}");
    assert!(table.contains("READ: in the initiator's memory"), "{table}");
}

/// Two hosts (two host identities): no shm; the initiator takes the first provider of
/// NIXL's list that opens and the target, started without one, follows.
#[test]
fn two_hosts_meet_through_etcd_without_shm() {
    let etcd = Etcd::start("hosts");
    let (table, target) = pair_on(&etcd, [Some("host-a"), Some("host-b")], &[]);
    assert!(
        table.contains("(default: first available of NIXL's priority list)"),
        "{table}"
    );
    assert!(!table.contains("provider shm"), "{table}");
    let provider = table
        .split("provider ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .unwrap();
    assert!(
        target.contains(&format!("nixlbench-target@{provider}")),
        "{provider}: {target}"
    );
}

/// Setting up takes longer than `--etcd_wait` (512 MiB on each side, the target's
/// filled with the pattern): the waits follow the peer's published progress instead of
/// giving up, each side prints its setup stages, and the run completes.
#[test]
fn a_setup_longer_than_the_wait_is_waited_for() {
    let etcd = Etcd::start("slow-setup");
    let endpoint = etcd.url();
    let args = [
        "--etcd_endpoints",
        &endpoint,
        "--etcd_wait",
        "1",
        "--no_progress",
        "--num_iter",
        "2",
        "--warmup_iter",
        "1",
        "--start_block_size",
        "64M",
        "--max_block_size",
        "64M",
        "--max_batch_size",
        "4",
        "--total_buffer_size",
        "512M",
    ];
    let first = spawn(&args);
    std::thread::sleep(Duration::from_millis(300));
    let second = spawn(&args);
    let (a, b) = (finish(first, TIMEOUT), finish(second, TIMEOUT));
    let ((a_out, a_err), (b_out, b_err)) = (text(&a), text(&b));
    let all = format!("first: {a_out}{a_err}\nsecond: {b_out}{b_err}");
    assert!(a.status.success() && b.status.success(), "{all}");
    assert!(
        all.contains("nixlbench target: setup: allocating and filling DRAM (pattern), 512 MiB"),
        "{all}"
    );
    assert!(
        all.contains("nixlbench: setup: allocating and filling DRAM (byte fill), 512 MiB"),
        "{all}"
    );
    assert!(!all.contains("no progress"), "{all}");
    // 64 MiB by batch 1, 2 and 4.
    let table = if a_err.contains("(initiator)") {
        &a_out
    } else {
        &b_out
    };
    assert_eq!(
        table.lines().filter(|l| l.starts_with("67108864")).count(),
        3,
        "{all}"
    );
    etcd.wait_clean(Duration::from_secs(3));
}

/// Rank keys of `group` now.
fn ranks(etcd: &Etcd, group: &str) -> Vec<String> {
    etcd.keys(&format!("/nixlbench/{group}/rank/"))
}

#[test]
fn a_third_process_is_refused_and_a_vanished_initiator_is_noticed() {
    let etcd = Etcd::start("third");
    let endpoint = etcd.url();
    // A run that does not end by itself.
    let long = [
        "--etcd_endpoints",
        &endpoint,
        "--no_progress",
        "--num_iter",
        "1000000000",
        "--warmup_iter",
        "0",
        "--max_block_size",
        "4096",
        "--total_buffer_size",
        "65536",
    ];
    let first = spawn(&long);
    let deadline = Instant::now() + Duration::from_secs(30);
    while ranks(&etcd, "default").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the first process claimed no rank"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = spawn(&long);
    while ranks(&etcd, "default").len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the second process claimed no rank"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let third = finish(spawn(&long), Duration::from_secs(30));
    let (out, err) = text(&third);
    assert_eq!(third.status.code(), Some(1), "{out}{err}");
    assert!(
        err.contains("benchmark group `default` at")
            && err.contains("already has its two processes")
            && err.contains("another --benchmark_group"),
        "{err}"
    );
    // The third took nothing: the two ranks are the first two processes'.
    assert_eq!(ranks(&etcd, "default").len(), 2);
    // In another group it is not refused: it waits for a peer and, alone, gives up.
    let alone = finish(
        spawn(&[
            "--etcd_endpoints",
            &endpoint,
            "--benchmark_group",
            "lonely",
            "--etcd_wait",
            "2",
        ]),
        Duration::from_secs(30),
    );
    let (out, err) = text(&alone);
    assert_eq!(alone.status.code(), Some(1), "{out}{err}");
    assert!(
        err.contains("rank 0 of 2 (initiator), benchmark group `lonely`"),
        "{err}"
    );
    assert!(
        err.contains("the target (rank 1) did not join benchmark group `lonely`")
            && err.contains("within 2s"),
        "{err}"
    );
    assert!(ranks(&etcd, "lonely").is_empty());
    // The initiator (the first process: it claimed while alone, so rank 0) vanishes,
    // killed: no DONE, no revoke. The target sees its rank expire and stops with that
    // reason instead of waiting ten minutes.
    let mut first = first;
    first.kill().unwrap();
    first.wait().unwrap();
    let target = finish(second, Duration::from_secs(60));
    let (out, err) = text(&target);
    assert_eq!(target.status.code(), Some(1), "{out}{err}");
    assert!(
        err.contains(
            "the initiator (rank 0) left the run (its etcd rank is gone) before saying DONE"
        ),
        "{err}"
    );
    // The killed initiator's keys expire with its lease.
    etcd.wait_clean(Duration::from_secs(20));
}

/// Two processes started with different backends meet, see it and both stop, leaving
/// nothing behind.
#[test]
fn mismatched_backends_are_refused_on_both_sides() {
    let etcd = Etcd::start("mismatch");
    let endpoint = etcd.url();
    let first = spawn(&["--etcd_endpoints", &endpoint, "--etcd_wait", "30"]);
    std::thread::sleep(Duration::from_millis(300));
    let second = spawn(&[
        "--etcd_endpoints",
        &endpoint,
        "--etcd_wait",
        "30",
        "--backend",
        "VERBS",
    ]);
    for (out, theirs, ours) in [
        (finish(first, TIMEOUT), "VERBS", "LIBFABRIC"),
        (finish(second, TIMEOUT), "LIBFABRIC", "VERBS"),
    ] {
        let (o, e) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{o}{e}");
        assert!(
            e.contains(&format!(
                "runs --backend {theirs}, this process --backend {ours}: start both with the same options"
            )),
            "{e}"
        );
    }
    etcd.wait_clean(Duration::from_secs(3));
}

/// A side whose backend does not open tells its peer why (not "did not join" or "left"),
/// and both stop at once: the target failing, then the initiator.
#[test]
fn a_failing_side_tells_its_peer_why() {
    let etcd = Etcd::start("fail");
    let endpoint = etcd.url();
    let why = "LIBFABRIC has no parameter `bogus`";
    for failing in ["target", "initiator"] {
        let start = Instant::now();
        let (good, bad) = (
            vec!["--etcd_endpoints", endpoint.as_str()],
            vec![
                "--etcd_endpoints",
                endpoint.as_str(),
                "--backend_param",
                "bogus=1",
            ],
        );
        // The first process started is the initiator.
        let (first_args, second_args) = if failing == "target" {
            (&good, &bad)
        } else {
            (&bad, &good)
        };
        let first = spawn(first_args);
        std::thread::sleep(Duration::from_millis(300));
        let second = spawn(second_args);
        let (first, second) = (finish(first, TIMEOUT), finish(second, TIMEOUT));
        let (failed, peer) = if failing == "target" {
            (second, first)
        } else {
            (first, second)
        };
        let (o, e) = text(&failed);
        assert_eq!(failed.status.code(), Some(1), "{failing}: {o}{e}");
        assert!(e.contains(why), "{failing}: {e}");
        // The roles come from etcd, in the order the processes registered: on a loaded
        // machine the second process started may register first. What the peer reports
        // follows the role the failing side really had.
        let (peer_wait, role) = if e.contains("rank 1 of 2 (target)") {
            ("the target's agent", "the target (rank 1)")
        } else {
            ("the initiator's agent", "the initiator (rank 0)")
        };
        let (o, e) = text(&peer);
        assert_eq!(peer.status.code(), Some(1), "{failing}: {o}{e}");
        assert!(
            e.contains(&format!("waiting for {peer_wait}: {role} failed: ")) && e.contains(why),
            "{failing}: {e}"
        );
        // Well within the 60 s peer wait.
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{failing}: {:?}",
            start.elapsed()
        );
        etcd.wait_clean(Duration::from_secs(3));
    }
}

#[test]
fn unreachable_etcd_and_bad_flags_are_refused() {
    // Nothing listens on this port.
    let port = free_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let start = Instant::now();
    let out = finish(
        spawn(&["--etcd_endpoints", &endpoint]),
        Duration::from_secs(60),
    );
    let (o, e) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{o}{e}");
    assert!(
        e.contains(&format!("cannot reach etcd at {endpoint}")),
        "{e}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    for (args, want) in [
        (
            &["--runtime_type", "ASIO"][..],
            "--runtime_type ASIO is not implemented",
        ),
        (
            &["--runtime_type", "MPI"],
            "--runtime_type MPI: SOCKET or ETCD",
        ),
        (
            &["--etcd_endpoints", "http://h:1", "--role", "target"],
            "--role belongs to the SOCKET runtime",
        ),
        (
            &["--runtime_type", "SOCKET", "--etcd-endpoints", "http://h:1"],
            "--etcd_endpoints belongs to the ETCD runtime",
        ),
        (
            &["--scheme", "manytoone"],
            "--scheme manytoone: this nixlbench runs one initiator",
        ),
        (
            &["--mode", "MG"],
            "--mode MG: this nixlbench runs one GPU per process",
        ),
        (
            &["--num_target_dev", "2"],
            "--num_target_dev 2: this nixlbench runs one device",
        ),
        (
            &["--benchmark_group", "a/b", "--runtime_type", "ETCD"],
            "without `/`",
        ),
        (
            &["--etcd_wait", "soon", "--runtime_type", "ETCD"],
            "`soon` is not a whole number",
        ),
        (
            &["--etcd_wait", "0", "--runtime_type", "ETCD"],
            "must be at least 1",
        ),
        (
            &["--gpunetio_device_list", "0"],
            "GPUNETIO's, not LIBFABRIC's",
        ),
    ] {
        let out = finish(spawn(args), Duration::from_secs(30));
        let (o, e) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {o}{e}");
        assert!(e.contains(want), "{args:?}: {e}");
        // One line that says what to change; the options are in --help.
        assert_eq!(e.trim_end().lines().count(), 1, "{args:?}: {e}");
    }
}

#[test]
fn base64_round_trip() {
    for s in ["", "/", "/n", "/ni", "/nixlbench/", "/nixlbench0"] {
        assert_eq!(unbase64(&base64(s.as_bytes())), s.as_bytes(), "{s}");
    }
    assert_eq!(base64(b"/nixlbench/"), "L25peGxiZW5jaC8=");
}
