//! Shared by the FILE backend tests: an `hf3fs-gdr` daemon as a child process (this
//! test binary re-executed: the daemon library runs in it), temporary directories,
//! patterned data and agents with a FILE backend.

#![allow(dead_code)]

use nixl::{Agent, AgentConfig, BackendParams};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::channel;
use std::time::Duration;

/// Longest wait for the daemon to say it listens.
pub const T: Duration = Duration::from_secs(30);

const ROLE: &str = "NIXL_FILE_TEST_ROLE";
const MOUNT: &str = "NIXL_FILE_TEST_MOUNT";
const DELAY: &str = "NIXL_FILE_TEST_DELAY_MS";
/// MiB of memory the daemon touches before it serves (a teardown that takes a while).
const BALLAST: &str = "NIXL_FILE_TEST_BALLAST_MIB";

/// A directory removed (with its contents) on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh directory under the system temporary directory.
    pub fn new(prefix: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "{prefix}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Call first in every test that starts a daemon: in the daemon child it serves the
/// mount and never returns.
pub fn serve_if_daemon() {
    if std::env::var(ROLE).as_deref() != Ok("daemon") {
        return;
    }
    let mount = PathBuf::from(std::env::var(MOUNT).unwrap());
    let mut config = hf3fs_gdr::daemon::DaemonConfig::with(mount, 4, 32 << 20);
    if let Ok(ms) = std::env::var(DELAY) {
        config.inject_delay = Duration::from_millis(ms.parse().unwrap());
    }
    // Written, so that every page is the process's own until it ends.
    let ballast: Vec<u8> = std::env::var(BALLAST).map_or_else(
        |_| Vec::new(),
        |mib| vec![1u8; mib.parse::<usize>().unwrap() << 20],
    );
    let result = hf3fs_gdr::daemon::run(config, |_| {
        use std::io::Write;
        println!("@@ready");
        let _ = std::io::stdout().flush();
    });
    eprintln!("daemon: {result:?} ({} ballast bytes)", ballast.len());
    std::process::exit(1);
}

/// A daemon child serving its own mount directory; killed on drop.
pub struct Daemon {
    pub child: Child,
    pub mount: TempDir,
}

impl Daemon {
    /// Starts one by re-running `test` (which calls [`serve_if_daemon`] first). Chunks
    /// of files named `*.slow` wait `slow_ms` first (0: no delay).
    pub fn start(test: &str, slow_ms: u64) -> Self {
        Self::start_with_ballast(test, slow_ms, 0)
    }

    /// [`Daemon::start`], the daemon holding `ballast_mib` MiB of memory it wrote (its
    /// teardown, once killed, takes that much longer).
    pub fn start_with_ballast(test: &str, slow_ms: u64, ballast_mib: usize) -> Self {
        let mount = TempDir::new("nixl-file-mnt");
        let child = Self::spawn(test, mount.path(), slow_ms, ballast_mib);
        Self { child, mount }
    }

    /// Kills this daemon and starts another on the same mount (a daemon restart).
    pub fn restart(&mut self, test: &str, slow_ms: u64) {
        self.kill();
        self.child = Self::spawn(test, self.mount.path(), slow_ms, 0);
    }

    fn spawn(test: &str, mount: &Path, slow_ms: u64, ballast_mib: usize) -> Child {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, "daemon")
            .env(MOUNT, mount)
            .env(DELAY, slow_ms.to_string())
            .env(BALLAST, ballast_mib.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.contains("@@ready") {
                    let _ = tx.send(());
                }
            }
        });
        if rx.recv_timeout(T).is_err() {
            let _ = child.kill();
            panic!("the daemon child did not get ready in {T:?}");
        }
        child
    }

    pub fn path(&self) -> &Path {
        self.mount.path()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends this daemon SIGKILL without waiting for its end (its teardown, which closes
    /// its socket, may take long on a loaded host); [`Daemon::kill`] reaps it.
    pub fn send_kill(&mut self) {
        let _ = self.child.kill();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The FILE backend's parameters for `mount`, plus `extra`.
pub fn params(mount: &Path, extra: &[(&str, &str)]) -> BackendParams {
    let mut p: BackendParams = extra
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    p.insert("mount".into(), mount.display().to_string());
    p
}

/// An agent with a FILE backend on `mount`.
pub fn file_agent(name: &str, mount: &Path, extra: &[(&str, &str)]) -> Agent {
    let agent = Agent::new(
        name,
        AgentConfig {
            listen_addr: None,
            ..AgentConfig::default()
        },
    )
    .unwrap();
    agent.create_backend("FILE", &params(mount, extra)).unwrap();
    agent
}

/// Position-dependent bytes; different seeds differ almost everywhere.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let x = (i as u64 / 8) ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (x.wrapping_mul(0xBF58_476D_1CE4_E5B9) >> (8 * (i % 8))) as u8
        })
        .collect()
}

/// FNV-1a, to compare large buffers by checksum.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    })
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

/// Shared host memory: a `/dev/shm` file mapped `MAP_SHARED` (the FILE backend moves
/// it without a copy); unmapped and unlinked on drop.
pub struct ShmBuffer {
    ptr: *mut u8,
    len: usize,
    path: PathBuf,
}

impl ShmBuffer {
    pub fn new(len: usize) -> Self {
        use std::os::fd::AsRawFd;
        static N: AtomicU32 = AtomicU32::new(0);
        let path = PathBuf::from(format!(
            "/dev/shm/nixl-file-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(len as u64).unwrap();
        // SAFETY: a fresh shared mapping of the file, unmapped in drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Self {
            ptr: ptr.cast(),
            len,
            path,
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping has `len` bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for ShmBuffer {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
        let _ = std::fs::remove_file(&self.path);
    }
}
