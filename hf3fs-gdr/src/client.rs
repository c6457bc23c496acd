//! The client side of the local daemon: one connection per mount per process, and the
//! backend trait rings talk through.
//!
//! Files registered with [`crate::reg_fd`] (`fd_registry`) reach the daemon as descriptors (`SCM_RIGHTS`) on first use by a ring of that
//! mount: the daemon then holds its own reference to the open file, so it reads the
//! same inode even if the caller closes or reuses the descriptor number — which is
//! 3FS's rule ("registered fds should not be closed, and even if closed, the old inode
//! will still be used"). Publishing `/proc/<pid>/fd/<n>` instead would break as soon as
//! the client closed the descriptor or died.

use crate::error::{Error, Result};
use crate::fd_registry;
use crate::proto::{
    Message, Reader, SeqPacket, IOV_GPU, IOV_HOST, MAX_MESSAGE, OP_ADD_IOR, OP_DEREG_FD,
    OP_FORGET_IOV, OP_HELLO, OP_OWN_IOV, OP_OWN_IOV_LINK, OP_REG_FD, OP_REG_IOV, OP_REMOVE_IOR,
    OP_STATS,
};
use crate::shm::Id;
use crate::virt::{self, IovRegistration};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long one request to the daemon may take before it counts as gone.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// At most one read of the daemon's `/proc/<pid>/status` per this interval (a read
/// costs microseconds of CPU; liveness is asked every few milliseconds while I/O waits).
const DOOM_CHECK_PERIOD: Duration = Duration::from_millis(5);

/// What a ring needs from whatever moves its data: a local daemon today, the official
/// `libhf3fs_api_shared` later.
pub(crate) trait IoBackend: Send + Sync + std::fmt::Debug {
    /// The backend's id for a registered descriptor (registering it on first use).
    fn file_id(&self, fd: RawFd) -> Result<u32>;
    /// Makes iov `id` usable by this process's rings (on its first use by one of them);
    /// `registration` says how it is handed over, asked only when it is new here.
    fn register_iov(
        &self,
        id: &Id,
        registration: &dyn Fn() -> Result<IovRegistration>,
    ) -> Result<()>;
    /// Starts serving ring `id`, whose memory `fd` holds (a sealed memfd).
    fn attach_ring(&self, id: &Id, fd: BorrowedFd<'_>) -> Result<()>;
    /// Stops serving it (after its I/Os in flight finish).
    fn detach_ring(&self, id: &Id) -> Result<()>;
    /// `Ok` while the backend can still complete I/O.
    fn check_alive(&self) -> Result<()>;
    /// The mount it serves.
    fn mount(&self) -> &Path;
}

/// Every live connection of this process drops its daemon's copy of `fd` (for
/// [`crate::dereg_fd`]).
pub(crate) fn forget_file(fd: RawFd) {
    for conn in live_connections() {
        conn.forget_file(fd);
    }
}

/// Connections by mount; weak so that the last ring or iov of a mount closes it.
type ConnTable = Mutex<Vec<(PathBuf, Weak<DaemonConn>)>>;

fn connections() -> &'static ConnTable {
    static CONNS: std::sync::OnceLock<ConnTable> = std::sync::OnceLock::new();
    CONNS.get_or_init(Default::default)
}

fn live_connections() -> Vec<Arc<DaemonConn>> {
    connections()
        .lock()
        .iter()
        .filter_map(|(_, w)| w.upgrade())
        .collect()
}

fn canonical(mount: &Path) -> Result<PathBuf> {
    mount
        .canonicalize()
        .map_err(|e| crate::error::os_err("realpath", e, mount.display()))
}

/// The process's connection to the daemon of `mount`, made if needed.
pub(crate) fn connect(mount: &Path) -> Result<Arc<DaemonConn>> {
    let mount = canonical(mount)?;
    let mut conns = connections().lock();
    conns.retain(|(_, w)| w.strong_count() > 0);
    if let Some(conn) = conns
        .iter()
        .filter(|(m, _)| *m == mount)
        .find_map(|(_, w)| w.upgrade())
    {
        if !conn.dead.load(Ordering::Acquire) && !conn.sock_closed() {
            return Ok(conn);
        }
    }
    let conn = Arc::new(DaemonConn::open(&mount)?);
    conns.push((mount, Arc::downgrade(&conn)));
    Ok(conn)
}

/// The live connection to `mount`'s daemon, if this process has one.
pub(crate) fn existing(mount: &Path) -> Option<Arc<DaemonConn>> {
    let mount = canonical(mount).ok()?;
    connections()
        .lock()
        .iter()
        .filter(|(m, _)| *m == mount)
        .find_map(|(_, w)| w.upgrade())
}

/// What the daemon counted since it started ([`daemon_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DaemonStats {
    /// Chunks read or written with `O_DIRECT`.
    pub direct_ops: u64,
    /// Chunks read or written through the page cache.
    pub buffered_ops: u64,
    /// Bytes moved into or out of host iovs.
    pub host_bytes: u64,
    /// Bytes moved into or out of GPU iovs.
    pub gpu_bytes: u64,
    /// Clients whose connection closed (and whose resources were released).
    pub clients_released: u64,
    /// Clients connected now.
    pub clients_now: u64,
}

/// Asks the daemon of `mount` for its counters.
pub fn daemon_stats(mount: impl AsRef<Path>) -> Result<DaemonStats> {
    let conn = connect(mount.as_ref())?;
    let (_, payload) = conn.request("stats", &Message::new(OP_STATS), &[])?;
    let mut r = Reader(&payload);
    let mut next = || r.u64().unwrap_or(0);
    Ok(DaemonStats {
        direct_ops: next(),
        buffered_ops: next(),
        host_bytes: next(),
        gpu_bytes: next(),
        clients_released: next(),
        clients_now: next(),
    })
}

/// One connection to a mount's daemon.
#[derive(Debug)]
pub(crate) struct DaemonConn {
    mount: PathBuf,
    sock: Mutex<SeqPacket>,
    /// The same socket, polled for liveness without waiting for `sock`'s lock (a
    /// request may hold it for seconds).
    probe: SeqPacket,
    /// Client fd number → (daemon file id, dev, ino).
    files: Mutex<HashMap<RawFd, (u32, u64, u64)>>,
    /// Iovs registered with the daemon by this connection.
    iovs: Mutex<HashSet<Id>>,
    dead: AtomicBool,
    /// The daemon's process, watched for a kill in progress (see [`DaemonProcess`]).
    daemon: Option<DaemonProcess>,
}

/// The daemon's process, as `SO_PEERCRED` named it when this connection was made.
///
/// A killed daemon closes its socket only at the end of its teardown (every thread
/// scheduled to exit, its mappings torn down): on a loaded host tens to hundreds of
/// milliseconds after `kill(2)`, all the while the socket looks healthy. It will never
/// complete another I/O, so a SIGKILL pending for it (`/proc/<pid>/status`) counts as
/// gone at once. The pid is read only while the socket is still open, i.e. before the
/// daemon could have been reaped and its pid reused.
#[derive(Debug)]
struct DaemonProcess {
    pid: u32,
    /// When `/proc` was last read; `None` before the first read.
    checked: Mutex<Option<Instant>>,
}

impl DaemonProcess {
    /// The peer of `sock`, where its pid is known in this pid namespace.
    fn of(sock: &SeqPacket) -> Option<Self> {
        let pid = u32::try_from(sock.peer_cred()?.pid).ok()?;
        (pid != 0 && pid != std::process::id()).then(|| Self {
            pid,
            checked: Mutex::new(None),
        })
    }

    /// Whether SIGKILL is pending for the daemon (read at most every
    /// [`DOOM_CHECK_PERIOD`]; `false` between reads).
    fn killed(&self) -> bool {
        let now = Instant::now();
        {
            let mut checked = self.checked.lock();
            if checked.is_some_and(|at| now - at < DOOM_CHECK_PERIOD) {
                return false;
            }
            *checked = Some(now);
        }
        std::fs::read_to_string(format!("/proc/{}/status", self.pid))
            .is_ok_and(|status| sigkill_pending(&status))
    }
}

/// Whether a `/proc/<pid>/status` text shows SIGKILL pending for the process as a whole
/// (`ShdPnd`: what `kill(2)` and the OOM killer send) or for its main thread (`SigPnd`:
/// a fatal signal becomes a SIGKILL for every thread as it is sent). Text it cannot
/// read says nothing.
fn sigkill_pending(status: &str) -> bool {
    let sigkill = 1u64 << (libc::SIGKILL - 1);
    ["SigPnd", "ShdPnd"].iter().any(|name| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .is_some_and(|pending| pending & sigkill != 0)
    })
}

impl DaemonConn {
    fn open(mount: &Path) -> Result<Self> {
        let path = virt::daemon_socket(mount);
        let sock = SeqPacket::connect(&path).map_err(|e| Error::NoDaemon {
            mount: mount.to_path_buf(),
            why: format!("connect {}: {e}", path.display()),
        })?;
        sock.set_recv_timeout(REQUEST_TIMEOUT)?;
        let probe = sock
            .try_clone()
            .map_err(|e| crate::error::os_err("dup", e, "daemon socket"))?;
        let daemon = DaemonProcess::of(&sock);
        let conn = Self {
            mount: mount.to_path_buf(),
            probe,
            sock: Mutex::new(sock),
            files: Mutex::default(),
            iovs: Mutex::default(),
            dead: AtomicBool::new(false),
            daemon,
        };
        conn.request(
            "hello",
            &Message::new(OP_HELLO).u32(std::process::id()),
            &[],
        )?;
        Ok(conn)
    }

    fn gone(&self, why: String) -> Error {
        self.dead.store(true, Ordering::Release);
        Error::DaemonGone {
            mount: self.mount.clone(),
            why,
        }
    }

    fn sock_closed(&self) -> bool {
        self.probe.peer_closed()
    }

    /// One request and its reply: `(value, payload)`; a negative value is `Refused`.
    pub(crate) fn request(
        &self,
        what: &'static str,
        msg: &Message,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(i64, Vec<u8>)> {
        if self.dead.load(Ordering::Acquire) {
            return Err(self.gone("an earlier request found it gone".into()));
        }
        let sock = self.sock.lock();
        sock.send(&msg.0, fds)
            .map_err(|e| self.gone(format!("sending {what}: {e}")))?;
        let mut buf = [0u8; MAX_MESSAGE];
        let (n, _) = sock
            .recv(&mut buf)
            .map_err(|e| self.gone(format!("waiting for the reply to {what}: {e}")))?;
        if n == 0 {
            return Err(self.gone(format!("it closed the socket during {what}")));
        }
        let mut r = Reader(&buf[..n]);
        let value = r.i64().ok_or_else(|| Error::Malformed {
            what: "daemon reply",
            detail: format!("{n} bytes"),
        })?;
        if value < 0 {
            return Err(Error::Refused {
                request: what,
                errno: (-value) as i32,
            });
        }
        Ok((value, r.0.to_vec()))
    }

    /// Tells the daemon this process owns publication `id`: if it dies, the daemon
    /// removes the link and, with `segment_too`, the `/dev/shm` segment it names.
    /// `segment` (host iovs): the segment the link names, opened here, which the daemon
    /// compares with the link's target (it checks the link and segment are ours).
    pub(crate) fn own_iov(
        &self,
        id: &Id,
        segment_too: bool,
        segment: Option<BorrowedFd<'_>>,
    ) -> Result<()> {
        let op = if segment_too {
            OP_OWN_IOV
        } else {
            OP_OWN_IOV_LINK
        };
        let fds: Vec<BorrowedFd<'_>> = segment.into_iter().collect();
        self.request("own iov", &Message::new(op).id(id), &fds)
            .map(drop)
    }

    /// Best effort: the daemon drops its mapping of an iov being destroyed, if this
    /// connection registered or owns it.
    pub(crate) fn forget_registered(&self, id: &Id) {
        if self.iovs.lock().contains(id) {
            self.forget_iov(id);
        }
    }

    /// Best effort: the daemon drops its mapping of an iov being destroyed.
    pub(crate) fn forget_iov(&self, id: &Id) {
        self.iovs.lock().remove(id);
        if let Err(e) = self.request("forget iov", &Message::new(OP_FORGET_IOV).id(id), &[]) {
            tracing::debug!("forget iov: {e}");
        }
    }

    fn forget_file(&self, fd: RawFd) {
        let Some((file_id, ..)) = self.files.lock().remove(&fd) else {
            return;
        };
        if let Err(e) = self.request("dereg fd", &Message::new(OP_DEREG_FD).u32(file_id), &[]) {
            tracing::debug!("dereg fd {fd}: {e}");
        }
    }
}

impl IoBackend for DaemonConn {
    fn file_id(&self, fd: RawFd) -> Result<u32> {
        let ((dev, ino), dup) = fd_registry::registered_copy(fd)?;
        if let Some(&(id, d, i)) = self.files.lock().get(&fd) {
            if (d, i) == (dev, ino) {
                return Ok(id);
            }
        }
        let dup = dup.map_err(|e| crate::error::os_err("dup", e, format!("fd {fd}")))?;
        let (id, _) = self.request(
            "reg fd",
            &Message::new(OP_REG_FD).u32(fd as u32),
            &[dup.as_fd()],
        )?;
        let id = id as u32;
        self.files.lock().insert(fd, (id, dev, ino));
        Ok(id)
    }

    fn register_iov(
        &self,
        id: &Id,
        registration: &dyn Fn() -> Result<IovRegistration>,
    ) -> Result<()> {
        if self.iovs.lock().contains(id) {
            return Ok(());
        }
        let msg = Message::new(OP_REG_IOV).id(id);
        match registration()? {
            IovRegistration::Host(fd) => {
                self.request("reg iov", &msg.u8(IOV_HOST), &[fd.as_fd()])?;
            }
            IovRegistration::Gpu(link) => {
                let msg = msg
                    .u8(IOV_GPU)
                    .u64(link.device as u64)
                    .u64(link.size)
                    .u64(link.offset)
                    .bytes(link.ipc.as_bytes());
                self.request("reg iov", &msg, &[])?;
            }
        }
        self.iovs.lock().insert(*id);
        Ok(())
    }

    fn attach_ring(&self, id: &Id, fd: BorrowedFd<'_>) -> Result<()> {
        self.request("add ior", &Message::new(OP_ADD_IOR).id(id), &[fd])
            .map(drop)
    }

    fn detach_ring(&self, id: &Id) -> Result<()> {
        self.request("remove ior", &Message::new(OP_REMOVE_IOR).id(id), &[])
            .map(drop)
    }

    fn mount(&self) -> &Path {
        &self.mount
    }

    fn check_alive(&self) -> Result<()> {
        if self.dead.load(Ordering::Acquire) {
            return Err(self.gone("an earlier request found it gone".into()));
        }
        if self.sock_closed() {
            return Err(self.gone("its socket closed".into()));
        }
        // Asked after the socket: an open socket means the pid is still the daemon's.
        if let Some(daemon) = self.daemon.as_ref().filter(|d| d.killed()) {
            return Err(self.gone(format!(
                "it is being killed (SIGKILL pending for pid {}, seen through /proc)",
                daemon.pid
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_text(sig_pnd: u64, shd_pnd: u64) -> String {
        format!(
            "Name:\thf3fs-gdr-daemon\nState:\tR (running)\nThreads:\t5\n\
             SigPnd:\t{sig_pnd:016x}\nShdPnd:\t{shd_pnd:016x}\nSigBlk:\t0000000000000000\n"
        )
    }

    #[test]
    fn only_a_pending_sigkill_counts_as_a_kill() {
        let sigkill = 1 << 8;
        let (sigterm, sigstop) = (1 << 14, 1 << 18);
        assert!(!sigkill_pending(&status_text(0, 0)));
        assert!(!sigkill_pending(&status_text(sigterm, sigstop)));
        assert!(sigkill_pending(&status_text(0, sigkill)));
        assert!(sigkill_pending(&status_text(sigkill | sigterm, 0)));
        assert!(!sigkill_pending("garbage"));
    }

    /// A real process is not taken for killed while it runs, nor while it is stopped
    /// (a frozen daemon is left to the deadlines of `wait_for_ios`).
    #[test]
    fn a_running_or_stopped_process_is_not_killed() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let watch = DaemonProcess {
            pid: child.id(),
            checked: Mutex::new(None),
        };
        assert!(!watch.killed());
        // SAFETY: kill(2) on our own unreaped child.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) }, 0);
        std::thread::sleep(DOOM_CHECK_PERIOD);
        assert!(!watch.killed(), "a stopped process is not being killed");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
