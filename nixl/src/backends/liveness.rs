//! Whether a peer's process still runs, asked of the operating system (LIBFABRIC and
//! VERBS: both carry [`ProcessId`] in their connection information). Written first for
//! LIBFABRIC, whose case the text below tells; VERBS' own signal is its side channel's
//! EOF, which comes only at the end of the teardown, as a pidfd's does.
//!
//! Some providers never report a dead peer: over `shm` a write to a SIGKILLed process
//! simply never completes, so only the stall timeout (30 s by default) ended such a
//! transfer. So the connection information carries the process's identity — the
//! kernel's boot id, its pid namespace, its pid and its start time — and a peer on the
//! same host, in the same pid namespace (all checked: same boot id, same pid namespace
//! inode, and the pid's start time here equals the advertised one, so a reused pid or
//! another container's pid is never watched), is watched through a pidfd (`pidfd_open`, Linux 5.3), which becomes readable when the
//! process ends. A transfer's status poll asks it (a `poll` with zero timeout, at most
//! every [`CHECK_PERIOD`]), so a dead peer fails the transfer with
//! [`crate::Error::RemoteDisconnect`] within milliseconds, on every provider. Where no
//! pidfd can be opened (an older kernel, a sandbox), `/proc/<pid>/stat` is read instead,
//! at most every [`PROC_CHECK_PERIOD`]. Peers on other hosts or in other pid namespaces
//! are left to the transport, the heartbeats and the stall timeout: a pid advertised
//! from another pid namespace names another process here, or none (which must not read
//! as the peer having ended), and its start time can match by chance (containers
//! started in the same clock tick), so the namespace itself is compared.
//!
//! A killed process is doomed well before it has ended: `kill(SIGKILL)` marks every
//! thread with the signal at once, but the process ends (its pidfd becomes readable,
//! its sockets close) only after each of its threads has been scheduled to exit and
//! its memory has been torn down — on a loaded host, a few hundred milliseconds
//! (docs/BENCHMARKS.md, the restart matrix). It will never run code of its own again,
//! so [`Liveness::check`] also reads `/proc/<pid>/status` at most every
//! [`DOOM_CHECK_PERIOD`] and reports a process that is doomed: SIGKILL pending for it
//! (see [`proc_doomed`]). Only the end itself ([`Liveness::has_ended`]) lets the
//! backend do what the dead process would have done (release its `shm` locks, give up
//! pieces it was to push), since a dying process's last system call may still be
//! running.

use super::shared::{boot_id, pid_namespace, proc_state, LocalProcess};
use crate::error::{Error, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Tag of the identity block after the rail list in the connection information.
const MAGIC: &[u8; 4] = b"LIVE";
/// 2: the pid namespace inode follows the start time.
const VERSION: u8 = 2;
/// Magic, version, boot id, pid, start time, pid namespace.
pub(super) const WIRE_SIZE: usize = 4 + 1 + 16 + 4 + 8 + 8;
/// How often a pidfd is polled while transfers are polled.
pub(super) const CHECK_PERIOD: Duration = Duration::from_micros(200);
/// How often `/proc/<pid>/stat` is read where there is no pidfd.
pub(super) const PROC_CHECK_PERIOD: Duration = Duration::from_millis(20);
/// How often `/proc/<pid>/status` is read for a process that is being killed, per watched
/// peer while transfers to it are polled: a read costs microseconds of CPU (far more
/// than a pidfd poll; docs/BENCHMARKS.md), and this keeps it under a percent of a core
/// for each peer polled without pause, well inside the 100 ms detection goal.
pub(super) const DOOM_CHECK_PERIOD: Duration = Duration::from_millis(5);

/// Who a process is, as another process on the same host can check it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct ProcessId {
    boot_id: [u8; 16],
    pid: u32,
    /// Clock ticks after boot (field 22 of `/proc/<pid>/stat`): tells a reused pid apart.
    start_time: u64,
    /// Inode of its pid namespace (`/proc/self/ns/pid`); 0 where `/proc` did not say.
    /// The pid means something here only within the same namespace.
    pid_ns: u64,
}

impl ProcessId {
    /// This process; `None` where `/proc` does not say (then no peer can watch it). Not
    /// cached: a forked child (Python's multiprocessing) must not advertise its parent.
    pub(super) fn current() -> Option<Self> {
        static BOOT_ID: OnceLock<Option<[u8; 16]>> = OnceLock::new();
        // Kept per pid: the receive path asks for it per message (a peer's end is
        // judged against it), and three reads of `/proc` each time made a flood of
        // forged messages cost the rail worker tens of microseconds apiece.
        static CURRENT: parking_lot::Mutex<Option<ProcessId>> = parking_lot::Mutex::new(None);
        let pid = std::process::id();
        let mut current = CURRENT.lock();
        if let Some(me) = *current {
            if me.pid == pid {
                return Some(me);
            }
        }
        let me = ProcessId {
            boot_id: (*BOOT_ID.get_or_init(boot_id))?,
            pid,
            start_time: start_time(pid)?,
            pid_ns: pid_namespace("self").unwrap_or(0),
        };
        *current = Some(me);
        Some(me)
    }

    /// Whether this process runs on the same host (boot) as this one.
    pub(super) fn on_this_host(&self) -> bool {
        ProcessId::current().is_some_and(|me| me.boot_id == self.boot_id)
    }

    /// The pid that names this process here: same host and pid namespace, and the pid's
    /// start time equals the advertised one (this very process included).
    pub(super) fn local_pid(&self) -> Option<u32> {
        let me = ProcessId::current()?;
        self.is_local_to(&me).then_some(self.pid)
    }

    /// Whether this process is known to have ended: it ran on this host, in this pid
    /// namespace, and no process with its pid and start time exists any more. A process
    /// of another host or another pid namespace (its pid names nothing here, or another
    /// process) is never known to have ended this way: its heartbeats say.
    pub(super) fn has_ended_here(&self) -> bool {
        ProcessId::current().is_some_and(|me| {
            self.boot_id == me.boot_id && self.same_pid_namespace(&me) && !self.is_local_to(&me)
        })
    }

    /// The process as the heartbeat hub checks it here: pid and start time, where the
    /// pid names it in this pid namespace — another process only (a peer in this very
    /// process runs as long as the check does, which says nothing about its hub).
    pub(super) fn local_process(&self) -> Option<LocalProcess> {
        let me = std::process::id();
        self.local_pid()
            .filter(|pid| *pid != me)
            .map(|pid| LocalProcess {
                pid,
                start_time: self.start_time,
            })
    }

    /// Its open descriptor `fd`, duplicated into this process (`pidfd_getfd`): only where
    /// its pid names it here (same host and pid namespace, the advertised start time,
    /// read again once the pidfd pins the pid) and the OS lets this process reach into
    /// it (the permission `ptrace` asks, as cross-memory attach does).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn take_fd(&self, fd: i32) -> std::io::Result<OwnedFd> {
        let pid = self.local_pid().ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the process is not one of this host's pid namespace",
            )
        })?;
        let pidfd = pidfd_open(pid).ok_or_else(std::io::Error::last_os_error)?;
        if start_time(pid) != Some(self.start_time) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the process ended (its pid names another)",
            ));
        }
        // SAFETY: pidfd_getfd takes a pidfd, a descriptor number of that process and
        // flags; it returns a new descriptor (close-on-exec) or -1.
        let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if got < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a non-negative return is a descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
    }

    /// Whether this process runs on `me`'s host and its pid names it in `me`'s pid
    /// namespace: the same namespace, and the pid's start time is the advertised one (a
    /// reused pid has another).
    fn is_local_to(&self, me: &ProcessId) -> bool {
        self.boot_id == me.boot_id
            && self.same_pid_namespace(me)
            && start_time(self.pid) == Some(self.start_time)
    }

    /// Whether both processes are known to share a pid namespace (an unknown one, 0,
    /// shares none: the pid is then left alone).
    fn same_pid_namespace(&self, me: &ProcessId) -> bool {
        self.pid_ns != 0 && self.pid_ns == me.pid_ns
    }

    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.boot_id);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.start_time.to_le_bytes());
        out.extend_from_slice(&self.pid_ns.to_le_bytes());
    }

    /// The identity block (what follows the rail list): empty means none was sent.
    pub(super) fn decode(bytes: &[u8]) -> Result<Option<Self>> {
        let bad = |why: &str| {
            Error::MalformedMetadata(format!("connection info: process identity {why}"))
        };
        if bytes.is_empty() {
            return Ok(None);
        }
        if bytes.len() != WIRE_SIZE || &bytes[..4] != MAGIC {
            return Err(bad("has the wrong size or tag"));
        }
        if bytes[4] != VERSION {
            return Err(bad(&format!(
                "version {} (this build reads {VERSION})",
                bytes[4]
            )));
        }
        Ok(Some(ProcessId {
            boot_id: bytes[5..21].try_into().expect("16 bytes"),
            pid: u32::from_le_bytes(bytes[21..25].try_into().expect("4 bytes")),
            start_time: u64::from_le_bytes(bytes[25..33].try_into().expect("8 bytes")),
            pid_ns: u64::from_le_bytes(bytes[33..41].try_into().expect("8 bytes")),
        }))
    }
}

/// A watched peer process.
#[derive(Debug)]
pub(super) struct Liveness {
    id: ProcessId,
    /// Readable once the process has ended; `None`: `/proc` is read instead.
    pidfd: Option<OwnedFd>,
    gone: AtomicBool,
    /// `clock_ns` of the last look; [`NEVER`] before the first.
    checked_ns: AtomicU64,
    /// Killed or exiting, though perhaps not ended yet (see the module documentation).
    doomed: AtomicBool,
    /// `clock_ns` of the last look for it; [`NEVER`] before the first.
    doom_checked_ns: AtomicU64,
}

/// A look's time stamp before the first look ([`due`]).
pub(super) const NEVER: u64 = u64::MAX;

impl Liveness {
    /// A watch on `peer`, if the OS can answer for it: same host and pid namespace, and
    /// not this very process (agents of one process never outlive each other's process).
    pub(super) fn watch(peer: &ProcessId) -> Option<Arc<Self>> {
        let me = ProcessId::current()?;
        // The pidfd is opened only after the start time matched, and the start time is
        // read again after: if the pid was reused in between, the pidfd names the wrong
        // process and is dropped.
        if *peer == me || !peer.is_local_to(&me) {
            return None;
        }
        let pidfd = pidfd_open(peer.pid);
        if start_time(peer.pid) != Some(peer.start_time) {
            return None;
        }
        Some(Arc::new(Self {
            id: *peer,
            pidfd,
            gone: AtomicBool::new(false),
            checked_ns: AtomicU64::new(NEVER),
            doomed: AtomicBool::new(false),
            doom_checked_ns: AtomicU64::new(NEVER),
        }))
    }

    /// `Err(RemoteDisconnect)` once the process is known to have ended, or to be
    /// ending (killed: see the module documentation). Cheap: the OS is asked at most
    /// every [`CHECK_PERIOD`] (or [`PROC_CHECK_PERIOD`]), and `/proc` for a kill at
    /// most every [`DOOM_CHECK_PERIOD`].
    pub(super) fn check(&self, agent: &str) -> Result<()> {
        let how = if self.has_ended() {
            if self.pidfd.is_some() {
                "ended (seen through its pidfd)"
            } else {
                "ended (seen through /proc)"
            }
        } else if self.is_doomed() {
            "is being killed (SIGKILL pending, seen through /proc)"
        } else {
            return Ok(());
        };
        Err(Error::RemoteDisconnect {
            agent: agent.to_string(),
            reason: format!("its process (pid {}) {how}", self.id.pid),
        })
    }

    /// `Err(RemoteDisconnect)` once the process is known to have ended (not merely to
    /// be ending): whatever it was doing in the kernel is over.
    pub(super) fn check_ended(&self, agent: &str) -> Result<()> {
        if self.has_ended() {
            return self.check(agent);
        }
        Ok(())
    }

    /// Whether the process was killed or is exiting (asked of `/proc` at most every
    /// [`DOOM_CHECK_PERIOD`]); once true, stays true.
    fn is_doomed(&self) -> bool {
        if !self.doomed.load(Ordering::Relaxed)
            && due(&self.doom_checked_ns, DOOM_CHECK_PERIOD)
            && proc_doomed(self.id.pid)
        {
            self.doomed.store(true, Ordering::Relaxed);
        }
        self.doomed.load(Ordering::Relaxed)
    }

    /// Whether the process is known to have ended (asked of the OS as [`Self::check`]).
    pub(super) fn has_ended(&self) -> bool {
        if !self.gone.load(Ordering::Relaxed) && self.due() && self.ended() {
            self.gone.store(true, Ordering::Relaxed);
        }
        self.gone.load(Ordering::Relaxed)
    }

    /// Whether the process has ended, asked of the OS now (not at most every
    /// [`CHECK_PERIOD`]).
    pub(super) fn has_ended_now(&self) -> bool {
        if !self.gone.load(Ordering::Relaxed) && self.ended() {
            self.gone.store(true, Ordering::Relaxed);
        }
        self.gone.load(Ordering::Relaxed)
    }

    /// The watched process's pid.
    pub(super) fn pid(&self) -> u32 {
        self.id.pid
    }

    fn due(&self) -> bool {
        let period = if self.pidfd.is_some() {
            CHECK_PERIOD
        } else {
            PROC_CHECK_PERIOD
        };
        due(&self.checked_ns, period)
    }

    fn ended(&self) -> bool {
        match &self.pidfd {
            Some(fd) => {
                let mut pfd = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd that lives across the call; zero timeout.
                let n = unsafe { libc::poll(&mut pfd, 1, 0) };
                n > 0 && pfd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
            }
            // Gone from /proc, a new process under the pid, or a zombie: ended.
            None => proc_state(self.id.pid)
                .is_none_or(|(state, start)| start != self.id.start_time || state == 'Z'),
        }
    }
}

/// Whether a look whose last one was at `checked_ns` is due (at most every `period`);
/// of the threads that ask at once, one is told so.
pub(super) fn due(checked_ns: &AtomicU64, period: Duration) -> bool {
    let now = clock_ns();
    let last = checked_ns.load(Ordering::Relaxed);
    if last != NEVER && now.saturating_sub(last) < period.as_nanos() as u64 {
        return false;
    }
    checked_ns
        .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
        .is_ok()
}

/// Monotonic nanoseconds since the first call in this process.
fn clock_ns() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Whether process `pid` is doomed: gone, or SIGKILL pending for it as a whole (`ShdPnd`
/// of `/proc/<pid>/status`: what `kill(2)` and the OOM killer send stays there until
/// the process is gone) or for its main thread (`SigPnd`: a fatal signal is turned into
/// a SIGKILL for every thread as it is sent), or a zombie without other threads. A main
/// thread that ended while others run on (`pthread_exit`) is a zombie too, and is not
/// doomed. Only the pid's absence counts as gone: another failure to read (no
/// descriptor left, say) says nothing. A pid reused since is not a concern: the end of
/// the process it named is seen through its pidfd (or start time) first.
fn proc_doomed(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(status) => status_says_doomed(&status),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH),
    }
}

/// [`proc_doomed`] on the text of a `/proc/<pid>/status`; what it cannot read says
/// nothing (not doomed).
fn status_says_doomed(status: &str) -> bool {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let signals = |name: &str| field(name).and_then(|hex| u64::from_str_radix(hex, 16).ok());
    let sigkill = 1u64 << (libc::SIGKILL - 1);
    let killed = [signals("SigPnd"), signals("ShdPnd")]
        .iter()
        .any(|pending| pending.is_some_and(|p| p & sigkill != 0));
    let zombie = field("State").is_some_and(|s| s.starts_with('Z') || s.starts_with('X'));
    let alone = field("Threads")
        .and_then(|n| n.parse::<u32>().ok())
        .is_some_and(|n| n <= 1);
    killed || (zombie && alone)
}

fn start_time(pid: u32) -> Option<u64> {
    proc_state(pid).map(|(_, start)| start)
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a non-negative return is a descriptor nobody else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn a_descriptor_is_taken_only_from_the_process_the_identity_names() {
        use std::io::{Read, Seek, Write};
        let me = ProcessId::current().unwrap();
        let mut file = tempfile_in_proc();
        file.write_all(b"lane").unwrap();
        let mut taken = std::fs::File::from(me.take_fd(file.as_raw_fd()).unwrap());
        let mut text = String::new();
        taken.rewind().unwrap();
        taken.read_to_string(&mut text).unwrap();
        assert_eq!(text, "lane");
        // A descriptor number the process does not have.
        assert!(me.take_fd(1 << 20).is_err());
        // The same pid with another start time: a reused pid, never reached into.
        let reused = ProcessId {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(reused.take_fd(file.as_raw_fd()).is_err());
        // Another host's process.
        let elsewhere = ProcessId {
            boot_id: [0xee; 16],
            ..me
        };
        assert!(elsewhere.take_fd(file.as_raw_fd()).is_err());
    }

    /// An anonymous file of this process.
    fn tempfile_in_proc() -> std::fs::File {
        // SAFETY: a NUL-terminated name and valid flags.
        let fd = unsafe { libc::memfd_create(c"liveness-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor, owned by the File.
        unsafe { std::fs::File::from_raw_fd(fd) }
    }

    #[test]
    fn identity_round_trips_and_bad_blocks_are_typed_errors() {
        let me = ProcessId::current().expect("/proc answers on Linux");
        let mut wire = Vec::new();
        me.encode(&mut wire);
        assert_eq!(wire.len(), WIRE_SIZE);
        assert_eq!(ProcessId::decode(&wire).unwrap(), Some(me));
        assert_eq!(ProcessId::decode(&[]).unwrap(), None);
        for cut in 1..wire.len() {
            assert!(ProcessId::decode(&wire[..cut]).is_err());
        }
        let mut bad = wire.clone();
        bad[4] = 9;
        assert!(ProcessId::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("version 9"));
    }

    #[test]
    fn this_process_and_other_hosts_are_not_watched() {
        let me = ProcessId::current().unwrap();
        assert!(Liveness::watch(&me).is_none());
        let mut elsewhere = me;
        elsewhere.boot_id[0] ^= 1;
        elsewhere.pid = 1;
        assert!(Liveness::watch(&elsewhere).is_none());
        // The same pid with another start time is another process (a reused pid).
        let mut reused = me;
        reused.start_time += 1;
        reused.pid = std::os::unix::process::parent_id();
        assert!(Liveness::watch(&reused).is_none());
    }

    /// A peer in another pid namespace of this host is never watched through `/proc`
    /// (its pid names another process here, or none) and never counts as ended: only
    /// its heartbeats (the transport's hub) say. In this pid namespace, a pid that names
    /// no process with the advertised start time has ended.
    #[test]
    fn a_peer_in_another_pid_namespace_is_left_to_heartbeats() {
        let me = ProcessId::current().unwrap();
        assert_ne!(me.pid_ns, 0, "/proc/self/ns/pid is readable");
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let here = ProcessId {
            boot_id: me.boot_id,
            pid,
            start_time: start_time(pid).unwrap(),
            pid_ns: me.pid_ns,
        };
        assert_eq!(here.local_pid(), Some(pid));
        assert!(here.local_process().is_some());
        assert!(!here.has_ended_here());
        // The same pid and start time advertised from another pid namespace (a start
        // time that matches by chance): not this process, not watched, not ended.
        let elsewhere = ProcessId {
            pid_ns: me.pid_ns ^ 1,
            ..here
        };
        assert_eq!(elsewhere.local_pid(), None);
        assert!(elsewhere.local_process().is_none());
        assert!(Liveness::watch(&elsewhere).is_none());
        assert!(!elsewhere.has_ended_here());
        // A pid that names nothing here: ended in this namespace, unknown in another.
        let gone = ProcessId {
            pid: u32::MAX - 1,
            ..here
        };
        assert!(gone.has_ended_here());
        assert!(!ProcessId {
            pid_ns: me.pid_ns ^ 1,
            ..gone
        }
        .has_ended_here());
        // An unknown namespace (an identity without one) is another namespace.
        assert!(!ProcessId { pid_ns: 0, ..gone }.has_ended_here());
        assert_eq!(ProcessId { pid_ns: 0, ..here }.local_pid(), None);
        // Another host: never ended here.
        let mut other_host = gone;
        other_host.boot_id[0] ^= 1;
        assert!(!other_host.has_ended_here());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(here.has_ended_here(), "reaped: no process with that pid");
    }

    /// A real process in a pid namespace of its own (`unshare`, where user namespaces
    /// are allowed): what it advertises — pid 1 there, its namespace — is neither
    /// watched nor taken for ended here, though pid 1 here is another process.
    #[test]
    fn a_process_in_a_new_pid_namespace_is_not_ended_here() {
        let Some(contained) = crate::backends::shared::UnsharedProcess::spawn() else {
            return;
        };
        let (pid_there, inode) = (contained.pid_there, contained.pid_ns);
        let me = ProcessId::current().unwrap();
        assert_ne!(inode, me.pid_ns, "another pid namespace");
        let peer = ProcessId {
            boot_id: me.boot_id,
            pid: pid_there,
            start_time: contained.start_time,
            pid_ns: inode,
        };
        assert!(peer.on_this_host());
        assert_eq!(peer.local_pid(), None, "{peer:?}");
        assert!(Liveness::watch(&peer).is_none());
        assert!(!peer.has_ended_here(), "{peer:?} counted as ended");
    }

    /// A child process is watched; killed, it is reported within a few milliseconds,
    /// both through its pidfd and through `/proc` (before it is reaped: a zombie).
    #[test]
    fn a_killed_process_is_seen_ended() {
        for use_pidfd in [true, false] {
            let mut child = Command::new("sleep").arg("30").spawn().unwrap();
            let pid = child.id();
            let id = ProcessId {
                boot_id: boot_id().unwrap(),
                pid,
                start_time: start_time(pid).unwrap(),
                pid_ns: pid_namespace(&pid.to_string()).unwrap(),
            };
            let watch = Liveness::watch(&id).expect("a child on this host is watched");
            let watch = if use_pidfd {
                assert!(watch.pidfd.is_some(), "pidfd_open works on this kernel");
                watch
            } else {
                Arc::new(Liveness {
                    id,
                    pidfd: None,
                    gone: AtomicBool::new(false),
                    checked_ns: AtomicU64::new(NEVER),
                    doomed: AtomicBool::new(false),
                    doom_checked_ns: AtomicU64::new(NEVER),
                })
            };
            watch.check("child").unwrap();
            child.kill().unwrap();
            let killed = Instant::now();
            let err = loop {
                if let Err(e) = watch.check("child") {
                    break e;
                }
                assert!(killed.elapsed() < Duration::from_secs(5), "never seen");
                std::thread::sleep(Duration::from_micros(100));
            };
            println!(
                "{} saw the kill after {:?}: {err}",
                if use_pidfd { "pidfd" } else { "/proc" },
                killed.elapsed()
            );
            assert!(
                matches!(&err, Error::RemoteDisconnect { agent, .. } if agent == "child"),
                "{err:?}"
            );
            child.wait().unwrap();
            assert!(watch.check("child").is_err(), "gone stays gone");
        }
    }

    /// A `/proc/<pid>/status` text with `state`, `threads` and the pending signal masks.
    fn status_text(state: &str, threads: u32, sig_pnd: u64, shd_pnd: u64) -> String {
        format!(
            "Name:\tpeer\nUmask:\t0022\nState:\t{state}\nTgid:\t4242\nPid:\t4242\n\
             Threads:\t{threads}\nSigQ:\t0/63704\nSigPnd:\t{sig_pnd:016x}\n\
             ShdPnd:\t{shd_pnd:016x}\nSigBlk:\t0000000000000000\n"
        )
    }

    #[test]
    fn a_kill_in_progress_is_read_from_the_status() {
        let sigkill = 1 << 8;
        let sigstop = 1 << 18;
        let sigterm = 1 << 14;
        assert!(!status_says_doomed(&status_text("S (sleeping)", 9, 0, 0)));
        // Stopped, or only SIGSTOP or a catchable signal pending: not dying (heartbeats
        // decide about a frozen peer).
        assert!(!status_says_doomed(&status_text(
            "T (stopped)",
            9,
            0,
            sigstop
        )));
        assert!(!status_says_doomed(&status_text(
            "R (running)",
            9,
            0,
            sigterm
        )));
        assert!(status_says_doomed(&status_text(
            "R (running)",
            9,
            0,
            sigkill
        )));
        assert!(status_says_doomed(&status_text(
            "D (disk sleep)",
            9,
            sigkill,
            0
        )));
        assert!(status_says_doomed(&status_text(
            "Z (zombie)",
            9,
            0,
            sigkill
        )));
        assert!(status_says_doomed(&status_text("Z (zombie)", 1, 0, 0)));
        assert!(status_says_doomed(&status_text("X (dead)", 0, 0, 0)));
        // The main thread ended (`pthread_exit`) while others run on: alive.
        assert!(!status_says_doomed(&status_text("Z (zombie)", 4, 0, 0)));
        assert!(!status_says_doomed("garbage"));
    }

    /// Against real processes: a running child and a stopped one are not doomed; once
    /// killed, it is (a zombie until reaped, then gone).
    #[test]
    fn a_killed_child_is_doomed_and_a_stopped_one_is_not() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        assert!(!proc_doomed(pid));
        // SAFETY: kill(2) on our own unreaped child.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
        assert!(!proc_doomed(pid));
        child.kill().unwrap();
        let killed = Instant::now();
        while !proc_doomed(pid) {
            assert!(killed.elapsed() < Duration::from_secs(5), "never doomed");
            std::thread::sleep(Duration::from_micros(100));
        }
        println!("/proc said doomed {:?} after the kill", killed.elapsed());
        child.wait().unwrap();
        assert!(proc_doomed(pid), "reaped: gone");
    }
}
