//! Shared by the integration tests: a daemon process on a temporary mount, patterned
//! files, child processes (this test binary re-executed with a role).

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

/// Longest wait for a daemon or child to say something.
pub const T: Duration = Duration::from_secs(30);

/// The daemon binary: `$HF3FS_GDR_DAEMON`, else cargo's build of it, else
/// `../bin/hf3fs-gdr-daemon` beside this test binary (the GPU bundle's layout:
/// `tests/<name>` and `bin/<tool>`).
pub fn daemon_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("HF3FS_GDR_DAEMON") {
        return p.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_hf3fs-gdr-daemon"));
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().unwrap();
    let bundled = exe
        .parent()
        .and_then(Path::parent)
        .map(|root| root.join("bin").join("hf3fs-gdr-daemon"));
    match bundled {
        Some(p) if p.exists() => p,
        _ => panic!(
            "no hf3fs-gdr-daemon at {} or beside {}: set HF3FS_GDR_DAEMON",
            built.display(),
            exe.display()
        ),
    }
}

/// A running daemon on its own mount directory; killed on drop.
pub struct Daemon {
    pub child: Child,
    pub mount: tempfile::TempDir,
}

impl Daemon {
    pub fn start(threads: usize) -> Self {
        Self::start_with(threads, &[])
    }

    pub fn start_with(threads: usize, extra: &[&str]) -> Self {
        let mount = tempfile::Builder::new()
            .prefix("hf3fs-mnt")
            .tempdir()
            .unwrap();
        let mut child = Command::new(daemon_binary())
            .arg("--mount")
            .arg(mount.path())
            .arg("--threads")
            .arg(threads.to_string())
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn hf3fs-gdr-daemon");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let line = rx
            .recv_timeout(T)
            .expect("the daemon printed no ready line");
        assert!(line.starts_with("ready "), "daemon said {line:?}");
        Self { child, mount }
    }

    pub fn path(&self) -> &Path {
        self.mount.path()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops the process (SIGSTOP) and returns once every thread of it is stopped:
    /// `kill` only queues the signal, and a worker running on another core keeps
    /// serving its rings until it takes it.
    pub fn freeze(&mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: signals our own child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        let stopped = wait_until(T, || all_threads_stopped(pid));
        assert!(stopped, "daemon {pid} not stopped within {T:?}");
    }

    /// Resumes a frozen process.
    pub fn thaw(&mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: signals our own child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Position-dependent bytes; two seeds differ at every byte.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(0x9e37_79b1) >> 24) as u8 ^ (i as u8) ^ seed)
        .collect()
}

/// Panics at the first differing byte (without printing megabytes).
pub fn assert_bytes(got: &[u8], expected: &[u8], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    if let Some(i) = got.iter().zip(expected).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {i} of {} is {:#04x}, expected {:#04x}",
            got.len(),
            got[i],
            expected[i]
        );
    }
}

/// A file of `len` patterned bytes in `dir` (on the disk file system, so `O_DIRECT`
/// works).
pub fn patterned_file(dir: &Path, name: &str, seed: u8, len: usize) -> (PathBuf, Vec<u8>) {
    let path = dir.join(name);
    let data = pattern(seed, len);
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

/// A directory on the disk (not tmpfs) for data files.
pub fn data_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("hf3fs-data")
        .tempdir_in(std::env::temp_dir())
        .unwrap()
}

/// Runs this test binary again as a child playing `role` (the test named `test` reads
/// the role from the environment), with extra environment.
pub fn spawn_child(test: &str, role: &str, env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("HF3FS_TEST_ROLE", role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// The role this process plays (None: the parent).
pub fn role() -> Option<String> {
    std::env::var("HF3FS_TEST_ROLE").ok()
}

/// What a child prints after `@@` on a line, as a channel (the harness prints other
/// things, and may print the test's name on the same line first).
pub fn child_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some((_, rest)) = line.split_once("@@") {
                let _ = tx.send(rest.to_string());
            }
        }
    });
    rx
}

/// Waits until `cond` holds, at most `limit`.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// Whether every thread of `pid` is in the stopped state (`T` in /proc's stat).
fn all_threads_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            // The state follows the command name's closing parenthesis.
            .and_then(|stat| {
                stat.rsplit_once(')')
                    .map(|(_, rest)| rest.trim_start().starts_with('T'))
            })
            .unwrap_or(false)
    })
}

/// A deadline `d` from now.
pub fn after(d: Duration) -> Option<Instant> {
    Some(Instant::now() + d)
}
