//! The daemon's command line: help and version on standard output, wrong invocations as
//! one line on standard error before anything is served.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const DAEMON: &str = env!("CARGO_BIN_EXE_hf3fs-gdr-daemon");

/// Runs the daemon with `args` (killed after 20 s: none of these may wait).
fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let mut child = Command::new(DAEMON)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("{args:?} did not exit within 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn help_and_version() {
    let (code, out, err) = run(&["--help"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("--mount <DIR>")
            && out.contains("--direct")
            && out.contains("--allow-uid <UID>")
            && out.contains("--max-clients <N>"),
        "{out}"
    );
    let (code, out, _) = run(&["--version"]);
    assert_eq!(code, Some(0));
    assert!(out.starts_with("hf3fs-gdr-daemon "), "{out}");
}

#[test]
fn wrong_invocations_fail_before_serving() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let file = file.path().to_str().unwrap().to_string();
    for (args, want) in [
        (
            vec!["--mount", "/nonexistent/hf3fs-gdr"],
            "no such directory",
        ),
        (vec!["--mount", file.as_str()], "not a directory"),
        (vec![], "--mount <DIR>"),
        (vec!["--mount", "/tmp", "--copy-kib", "3"], "multiple of 4"),
        (vec!["--mount", "/tmp", "--slots", "0"], "at least 1"),
        (
            vec!["--mount", "/tmp", "--threads", "x"],
            "not a whole number",
        ),
        (
            vec!["--mount", "/tmp", "--direct", "sometimes"],
            "auto, always or never",
        ),
        (vec!["--mount", "/tmp", "--bogus"], "unexpected argument"),
    ] {
        let (code, out, err) = run(&args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: announced {out}");
        assert!(!err.contains("serving"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// A good mount is announced once the daemon listens.
#[test]
fn serving_is_announced_once_listening() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(DAEMON)
        .args(["--mount", dir.path().to_str().unwrap(), "--threads", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let stdout = child.stdout.take().unwrap();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).unwrap();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(line.starts_with("ready "), "{line}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("serving"), "{err}");
}
