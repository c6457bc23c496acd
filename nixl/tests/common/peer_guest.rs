//! The other guest of `cargo xtask test`'s two-guest suite (`rxe2_*` tests; the mode is
//! `cargo xtask rxe --two-guests`, described in xtask/src/rxe/pair.rs): this test runs in
//! guest `a` (192.0.2.1), and asks guest `b` (192.0.2.2, its own `rxe0` across an
//! Ethernet link) to run commands, through the directory both guests share
//! (`RXE_PAIR_DIR`). Guest `b` can also be killed whole (its QEMU process), and comes
//! back as a fresh boot. Depends on std only: ibverbs' tests include this file too.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Bound on guest `b` being up (a fresh boot under TCG on a loaded host included).
const READY_TIMEOUT: Duration = Duration::from_secs(240);

/// Guest `b`, as guest `a` sees it.
#[derive(Debug)]
pub struct PeerGuest {
    dir: PathBuf,
    /// This guest's address on the link.
    pub addr: String,
    /// Guest `b`'s address on the link.
    pub peer_addr: String,
}

impl PeerGuest {
    /// Guest `b` once it serves, or `None` (after printing why) outside the two-guest
    /// suite. Inside it (`RXE_PAIR_DIR` set), a guest `b` that never comes fails.
    pub fn get() -> Option<Self> {
        let (Ok(dir), Ok(guest)) = (std::env::var("RXE_PAIR_DIR"), std::env::var("RXE_GUEST"))
        else {
            println!("skipped: not in the two-guest suite (cargo xtask test runs it)");
            return None;
        };
        assert_eq!(guest, "a", "two-guest tests run in guest a");
        let peer = PeerGuest {
            dir: dir.into(),
            addr: std::env::var("RXE_ADDR").expect("RXE_ADDR"),
            peer_addr: std::env::var("RXE_PEER_ADDR").expect("RXE_PEER_ADDR"),
        };
        peer.wait_ready();
        Some(peer)
    }

    /// A path both guests see (for files the two sides exchange).
    pub fn shared(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Waits until guest `b` serves (after a boot or a reboot).
    pub fn wait_ready(&self) {
        let ready = self.dir.join("b/ready");
        let deadline = Instant::now() + READY_TIMEOUT;
        while !ready.exists() {
            assert!(
                Instant::now() < deadline,
                "guest b did not serve within {READY_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts `argv` in guest `b` in the current directory, with guest `b`'s environment
    /// (the suite's) plus `env`.
    pub fn spawn(&self, argv: &[&str], env: &[(&str, &str)]) -> GuestProcess {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let mut script = String::new();
        for (name, value) in env {
            script += &format!("export {name}={}\n", quote(value));
        }
        let cwd = std::env::current_dir().unwrap();
        script += &format!("cd {} || exit 125\nexec", quote(&cwd.display().to_string()));
        for arg in argv {
            script += &format!(" {}", quote(arg));
        }
        script.push('\n');
        let base = self.dir.join("b").join(&id);
        let tmp = with_suffix(&base, "tmp");
        std::fs::write(&tmp, script).unwrap();
        std::fs::rename(&tmp, with_suffix(&base, "req")).unwrap();
        GuestProcess { base }
    }

    /// Kills guest `b`'s QEMU (the host vanishes: no FIN, no RST, nothing more on the
    /// link) and returns once the host has done it; a fresh guest `b` then boots
    /// ([`wait_ready`](Self::wait_ready) waits for it).
    pub fn kill_guest(&self) {
        let ack = self.dir.join("guest-b-killed");
        let _ = std::fs::remove_file(&ack);
        // Whole (renamed into place): the host removes the order as soon as it sees it,
        // and a 9p create whose file vanishes before it returns fails with ENOENT.
        write_shared_file(&self.dir.join("kill-guest-b"), "");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ack.exists() {
            assert!(Instant::now() < deadline, "the host did not kill guest b");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl PeerGuest {
    /// Runs `argv` in guest `b` and checks that it succeeded (bounded).
    pub fn run(&self, argv: &[&str]) {
        let (status, output) = self.spawn(argv, &[]).wait(Duration::from_secs(60));
        assert_eq!(status, 0, "{argv:?} in guest b failed: {output}");
    }

    /// Cuts guest `b`'s link (its `eth0` down: as a pulled cable, nothing more leaves or
    /// reaches it); the link comes back up when the guard is dropped, so a failed test
    /// leaves it working for the next one.
    pub fn cut_link(&self) -> LinkCut<'_> {
        self.run(&["ip", "link", "set", "eth0", "down"]);
        LinkCut { peer: self }
    }
}

/// Guest `b`'s link, cut until this is dropped.
#[derive(Debug)]
pub struct LinkCut<'a> {
    peer: &'a PeerGuest,
}

impl Drop for LinkCut<'_> {
    fn drop(&mut self) {
        let restore = self.peer.spawn(&["ip", "link", "set", "eth0", "up"], &[]);
        let deadline = Instant::now() + Duration::from_secs(60);
        while restore.try_status().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A command running in guest `b`; killed there when dropped unfinished.
#[derive(Debug)]
pub struct GuestProcess {
    base: PathBuf,
}

impl GuestProcess {
    /// Its exit status once it has ended.
    pub fn try_status(&self) -> Option<i32> {
        let text = std::fs::read_to_string(with_suffix(&self.base, "rc")).ok()?;
        Some(text.trim().parse().expect("exit status"))
    }

    /// Waits (bounded) for it to end: its exit status and output (stdout and stderr).
    pub fn wait(&self, timeout: Duration) -> (i32, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status() {
                return (status, self.output());
            }
            assert!(
                Instant::now() < deadline,
                "the command in guest b did not end within {timeout:?}; its output:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What it printed so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(with_suffix(&self.base, "out")).unwrap_or_default()
    }

    /// Asks guest `b` to kill it (SIGKILL); returns without waiting.
    pub fn kill(&self) {
        // Renamed into place, as the kill order above (guest b removes it once done).
        let order = with_suffix(&self.base, "kill");
        let tmp = with_suffix(&self.base, "kill.tmp");
        if std::fs::write(&tmp, "").is_ok() {
            let _ = std::fs::rename(&tmp, order);
        }
    }
}

impl Drop for GuestProcess {
    fn drop(&mut self) {
        if self.try_status().is_none() {
            self.kill();
        }
    }
}

/// Polls until `path` exists (bounded), failing early when `process` ended first; its
/// text.
pub fn wait_shared_file(path: &Path, process: &GuestProcess, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text;
        }
        if let Some(status) = process.try_status() {
            panic!(
                "the process in guest b exited ({status}) before writing {}; its output:\n{}",
                path.display(),
                process.output()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared; the process's output:\n{}",
            path.display(),
            process.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes `text` to `path` whole (a reader in the other guest never sees part of it).
pub fn write_shared_file(path: &Path, text: &str) {
    let tmp = with_suffix(path, "tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn with_suffix(base: &Path, suffix: &str) -> PathBuf {
    PathBuf::from(format!("{}.{suffix}", base.display()))
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}
