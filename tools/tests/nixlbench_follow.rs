//! Issue 28, finding 4: "a nixlbench target in follow mode took its provider from a
//! stranger". A LIBFABRIC target started without a provider follows the provider of the
//! first initiator whose metadata (`nixlbench-initiator@PROVIDER`) reaches its listener.
//! The real `nixlbench` binary runs both sides on loopback; this test process plays the
//! stranger, with a nixl agent of its own or raw listener frames.
//!
//! - With a job token (`NIXL_JOB_TOKEN` on both sides), a stranger without it (or with
//!   another) that pushes `nixlbench-initiator@OTHER` before the initiator is refused:
//!   the target follows the genuine initiator's provider, and the run's table prints.
//! - Without a token, what the listener guarantees: a push naming the target itself is
//!   refused, and once the genuine initiator's name is bound, pushes under it from
//!   another address (`127.0.0.2`, another host as far as the target can tell) are
//!   refused for the whole run, which completes with its consistency checks. What no
//!   token can stop: a stranger that pushes `nixlbench-initiator@P` *before* the
//!   initiator is followed (the name is not bound yet); only the job token closes that.

mod support;

use nixl::metadata::{crc32c, crc32c_append};
use nixl::{params, Agent, AgentConfig, JobToken};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const NIXLBENCH: &str = env!("CARGO_BIN_EXE_nixlbench");
const TOKEN: &str = "nixlbench-follow-test-token";
/// The listener's metadata push, its acknowledgement and its refusal.
const SEND_MD: u8 = 1;
const ACK: u8 = 5;
const ERROR: u8 = 6;
const LIMIT: Duration = Duration::from_secs(180);

/// The genuine initiator's provider (`shm` where there is one) and another one for the
/// stranger (`None` where there is no other); `None` (printed) without any.
fn providers(test: &str) -> Option<(String, Option<String>)> {
    let all = tools::rdma::local_providers();
    let Some(genuine) = all.iter().find(|p| *p == "shm").or(all.first()).cloned() else {
        println!("skipped {test}: no libfabric provider with RDM endpoints");
        return None;
    };
    let other = all.iter().find(|p| **p != genuine).cloned();
    Some((genuine, other))
}

/// nixlbench with `args`, `NIXL_JOB_TOKEN` set to `token` (or unset), pipes taken.
fn nixlbench(args: &[&str], token: Option<&str>) -> Child {
    let mut cmd = Command::new(NIXLBENCH);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match token {
        Some(t) => cmd.env("NIXL_JOB_TOKEN", t),
        None => cmd.env_remove("NIXL_JOB_TOKEN"),
    };
    cmd.spawn().unwrap()
}

/// A target in follow mode (LIBFABRIC, no provider): the child, its listener's address,
/// its stderr lines as they come, and a thread draining the rest of its stdout.
struct Target {
    child: Child,
    addr: SocketAddr,
    stderr: mpsc::Receiver<String>,
    stdout: std::thread::JoinHandle<String>,
}

fn follow_target(sizes: &[&str], token: Option<&str>) -> Target {
    let mut args = vec!["--backend", "LIBFABRIC", "--role", "target"];
    args.extend_from_slice(&["--listen", "127.0.0.1:0"]);
    args.extend_from_slice(sizes);
    let mut child = nixlbench(&args, token);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("NIXLBENCH_TARGET ")
        .unwrap_or_else(|| panic!("announce line: {line:?}"))
        .parse()
        .unwrap();
    let stdout = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = out.read_to_string(&mut rest);
        rest
    });
    let (tx, stderr) = mpsc::channel();
    let err = BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in err.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Target {
        child,
        addr,
        stderr,
        stdout,
    }
}

impl Target {
    /// Waits (bounded) for the target to exit; its exit code and every stderr line.
    fn finish(mut self) -> (Option<i32>, String) {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > LIMIT {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the target still runs after {LIMIT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = self.stdout.join();
        let lines: Vec<String> = self.stderr.iter().collect();
        (status.code(), lines.join("\n"))
    }
}

/// The genuine initiator against `target`, with `provider`.
fn initiator(target: SocketAddr, provider: &str, sizes: &[&str], token: Option<&str>) -> Child {
    let target = target.to_string();
    let provider = format!("provider={provider}");
    let mut args = vec!["--backend", "LIBFABRIC", "--role", "initiator"];
    args.extend_from_slice(&["--target_address", &target, "--backend_param", &provider]);
    args.extend_from_slice(sizes);
    nixlbench(&args, token)
}

/// Rows of nixlbench's table: (block size, batch size).
fn rows(stdout: &str) -> Vec<(usize, usize)> {
    stdout
        .lines()
        .filter_map(|l| {
            let mut cols = l.split_whitespace();
            Some((cols.next()?.parse().ok()?, cols.next()?.parse().ok()?))
        })
        .collect()
}

/// A stranger's agent named `name`, with the job token `token` (or none) and, where the
/// provider opens here, a LIBFABRIC backend on `provider` (its connection information
/// in what it pushes; a follow-mode target follows the name alone).
fn stranger(name: &str, provider: &str, token: Option<&str>) -> Agent {
    let config = AgentConfig {
        job_token: token.map(|t| JobToken::new(t).unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    if let Err(e) = agent.create_backend("LIBFABRIC", &params([("provider", provider)])) {
        println!("the stranger pushes no LIBFABRIC section: provider {provider}: {e}");
    }
    agent
}

/// Pushes `blob` to the listener at `to` from the loopback address `from_ip`, as a raw
/// client without a token; the reply's frame type (`None`: refused or closed
/// unanswered).
fn push_from(from_ip: &str, to: SocketAddr, blob: &[u8]) -> Option<u8> {
    let socket = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )
    .unwrap();
    let from: SocketAddr = format!("{from_ip}:0").parse().unwrap();
    socket.bind(&from.into()).unwrap();
    socket.connect(&to.into()).ok()?;
    let mut s = TcpStream::from(socket);
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut frame = b"NXP2".to_vec();
    frame.push(SEND_MD);
    frame.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    let check = crc32c_append(crc32c(&frame), blob);
    frame.extend_from_slice(&check.to_le_bytes());
    frame.extend_from_slice(blob);
    s.write_all(&frame).ok()?;
    let mut header = [0u8; 13];
    s.read_exact(&mut header).ok()?;
    Some(header[4])
}

const SMALL: &[&str] = &[
    "--max_block_size",
    "8K",
    "--num_iter",
    "5",
    "--warmup_iter",
    "1",
    "--check_consistency",
];

#[test]
fn with_a_job_token_a_stranger_cannot_choose_the_followed_provider() {
    let test = "with_a_job_token_a_stranger_cannot_choose_the_followed_provider";
    let Some((genuine, Some(other))) = providers(test) else {
        println!("skipped {test}: fewer than two libfabric providers");
        return;
    };
    let target = follow_target(SMALL, Some(TOKEN));
    // Before the initiator: strangers without the token, and with another one, push
    // metadata naming an initiator on another provider.
    let name = format!("nixlbench-initiator@{other}");
    for token in [None, Some("not-the-job-token")] {
        let s = stranger(&name, &other, token);
        let pushed = s.send_local_metadata(target.addr);
        assert!(
            pushed.is_err(),
            "a push without the job token (token {token:?}) was taken"
        );
    }
    // Time for a target that took a push to follow it (it looks every 2 ms).
    std::thread::sleep(Duration::from_millis(500));
    let run = initiator(target.addr, &genuine, SMALL, Some(TOKEN));
    let o = support::finish(run, "the initiator", LIMIT);
    let (code, stderr) = target.finish();
    assert_eq!(o.code, Some(0), "initiator: {}\n{}", o.stdout, o.stderr);
    assert_eq!(rows(&o.stdout), [(4096, 1), (8192, 1)], "{}", o.stdout);
    assert_eq!(code, Some(0), "target: {stderr}");
    assert!(
        stderr.contains(&format!(
            "LIBFABRIC provider {genuine} (the initiator's choice)"
        )),
        "the target did not follow the genuine initiator: {stderr}"
    );
}

#[test]
fn without_a_token_the_followed_initiator_stays_bound_and_the_target_refuses_its_own_name() {
    let test =
        "without_a_token_the_followed_initiator_stays_bound_and_the_target_refuses_its_own_name";
    let Some((genuine, _)) = providers(test) else {
        return;
    };
    // Long enough a run for the stranger to push many times during it.
    let sizes: &[&str] = &[
        "--max_block_size",
        "64K",
        "--num_iter",
        "20000",
        "--warmup_iter",
        "10",
        "--check_consistency",
    ];
    let target = follow_target(sizes, None);
    // Metadata naming the target itself is refused.
    let me = stranger("nixlbench-target", &genuine, None);
    assert!(
        me.send_local_metadata(target.addr).is_err(),
        "metadata naming the target itself was taken"
    );
    drop(me);
    let mut run = initiator(target.addr, &genuine, sizes, None);
    let choice = format!("LIBFABRIC provider {genuine} (the initiator's choice)");
    let mut seen = Vec::new();
    let deadline = Instant::now() + LIMIT;
    while !seen.iter().any(|l: &String| l.contains(&choice)) {
        let left = deadline.saturating_duration_since(Instant::now());
        match target.stderr.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(e) => panic!("the target never followed: {e}; it said {seen:?}"),
        }
    }
    // The initiator's name is bound: a stranger's metadata under it, pushed from another
    // address while the run goes on, is refused every time.
    let name = format!("nixlbench-initiator@{genuine}");
    let blob = stranger(&name, &genuine, None).local_metadata().unwrap();
    let drain = |r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let mut r = r;
            let _ = r.read_to_string(&mut text);
            text
        })
    };
    let run_stdout = drain(Box::new(run.stdout.take().unwrap()));
    let run_stderr = drain(Box::new(run.stderr.take().unwrap()));
    let mut refused = 0;
    // Until the target's listener closes: the run is ending (DONE was sent), and the
    // target's exit status and the initiator's say whether it ended well.
    let mut listening = true;
    let status = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = run.kill();
            let _ = run.wait();
            panic!("the initiator still runs after {LIMIT:?}");
        }
        if listening {
            match push_from("127.0.0.2", target.addr, &blob) {
                Some(ERROR) => refused += 1,
                Some(ACK) => panic!("a stranger rebound the followed initiator's name"),
                Some(other) => panic!("a push answered frame type {other}"),
                None => listening = false,
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (run_stdout, run_stderr) = (run_stdout.join().unwrap(), run_stderr.join().unwrap());
    let (code, stderr) = target.finish();
    assert!(status.success(), "initiator: {run_stdout}\n{run_stderr}");
    assert!(!rows(&run_stdout).is_empty(), "no table: {run_stdout}");
    assert_eq!(code, Some(0), "target: {stderr}");
    assert!(refused >= 3, "only {refused} pushes during the run");
    println!("{refused} pushes under the bound name refused during the run");
}
