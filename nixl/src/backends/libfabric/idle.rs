//! How an idle rail worker waits without burning a core, and what wakes it.
//!
//! A worker spins while it has work and for a while after its last activity
//! ([`IdleWait::spin_after_activity`]), then sleeps until one of:
//! - **local work**: a job queued on the rail, staging work, or the backend stopping
//!   ([`IdleWait::wake`] writes an eventfd, only while the worker sleeps);
//! - **incoming traffic**, where the provider can tell: the completion queue's wait fd
//!   (`FI_WAIT_FD`: `tcp;ofi_rxm`, `sockets`), after `fi_trywait` said blocking is safe;
//! - **the nap's end**, where it cannot (`shm` has no wait fd): the worker naps
//!   50 µs at first, growing to 1 ms after 0.4 s, then progresses the endpoint.
//!
//! Without a wait fd the spin after activity lasts 1 s, not 20 ms: a peer that naps
//! while a burst arrives falls behind and holds a backlog, and libfabric 1.17's `shm`
//! corrupts the shared queues of a peer killed while it works through one (survivors
//! posting to it then crashed in `fi_writedata`, in `dead_peer_over_shm` far more often
//! with a 20 ms spin than when spinning always: `docs/BENCHMARKS.md`). Spinning for a second
//! after traffic keeps bursts as they were and still frees the core of an idle peer.
//!
//! Activity is more than completions: a target of WRITEs without notification gets no
//! completion at all, yet on manual-progress providers (`shm`, `tcp;ofi_rxm`) the
//! initiator's delivery completion waits for the target to progress. Where the provider
//! grants `FI_RMA_EVENT` (`shm`), a counter bound with `FI_REMOTE_WRITE | FI_REMOTE_READ`
//! counts the remote operations this endpoint progressed: a change is activity, so a
//! target keeps spinning while traffic flows and pays a nap only for the first operation
//! after an idle spell. A readable wait fd counts as activity too.

use crate::os::WakeFd;
use fabric::{CompletionQueue, Counter};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::Duration;

/// Longest sleep on the wait fd (local work and traffic wake it sooner).
const FD_WAIT: Duration = Duration::from_millis(10);
/// Spin after activity where traffic wakes a sleeping worker (a wait fd)...
const SPIN_WITH_WAIT_FD: Duration = Duration::from_millis(20);
/// ...and where naps stand in for that (see the module docs).
pub(super) const SPIN_BEFORE_NAPS: Duration = Duration::from_secs(1);
/// Shortest and longest nap where there is no wait fd.
const MIN_NAP: Duration = Duration::from_micros(50);
const MAX_NAP: Duration = Duration::from_millis(1);

/// The nap after napping for `napping`: short at first (the next operation waits
/// little), longer after a while (fewer wake-ups).
pub(super) fn nap_after(napping: Duration) -> Duration {
    (napping / 400).clamp(MIN_NAP, MAX_NAP)
}

/// A rail's idle wait: the eventfd that wakes it, and the provider's signs of traffic.
#[derive(Debug)]
pub(super) struct IdleWait {
    wake: WakeFd,
    /// The worker is (about to be) asleep: queuing work must write `wake`.
    sleeping: AtomicBool,
    /// The completion queue's wait fd (`FI_WAIT_FD`).
    cq_fd: Option<RawFd>,
    /// Remote RMA operations this endpoint progressed (`FI_RMA_EVENT`).
    remote_ops: Option<Counter>,
    /// `remote_ops` as last seen (only the worker reads it).
    remote_seen: AtomicU64,
    /// The worker thread's Linux thread id (0 until it runs): its CPU time is in
    /// `/proc/self/task/<tid>/stat`.
    worker_tid: AtomicI32,
}

impl IdleWait {
    pub(super) fn new(cq: &CompletionQueue, remote_ops: Option<Counter>) -> std::io::Result<Self> {
        let wake = WakeFd::new()?;
        Ok(IdleWait {
            wake,
            sleeping: AtomicBool::new(false),
            cq_fd: cq.wait_fd().ok(),
            remote_ops,
            remote_seen: AtomicU64::new(0),
            worker_tid: AtomicI32::new(0),
        })
    }

    /// Called by the worker thread when it starts: records its thread id and lets its
    /// short sleeps end on time (the default timer slack, 50 µs, would double a 50 µs
    /// nap).
    pub(super) fn worker_started(&self) {
        // SAFETY: gettid has no arguments.
        let tid = unsafe { libc::gettid() };
        self.worker_tid.store(tid, Ordering::Relaxed);
        // SAFETY: PR_SET_TIMERSLACK takes a value, no pointers; it affects this thread.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0) };
    }

    /// The worker thread's Linux thread id, once it runs.
    #[cfg(test)]
    pub(super) fn worker_tid(&self) -> Option<i32> {
        Some(self.worker_tid.load(Ordering::Relaxed)).filter(|&t| t > 0)
    }

    /// How long the worker keeps spinning after its last activity.
    pub(super) fn spin_after_activity(&self) -> Duration {
        if self.has_wait_fd() {
            SPIN_WITH_WAIT_FD
        } else {
            SPIN_BEFORE_NAPS
        }
    }

    /// Whether incoming traffic wakes the worker (a wait fd), rather than its naps.
    pub(super) fn has_wait_fd(&self) -> bool {
        self.cq_fd.is_some()
    }

    /// Whether remote operations are counted (an `FI_RMA_EVENT` counter is bound).
    pub(super) fn counts_remote_ops(&self) -> bool {
        self.remote_ops.is_some()
    }

    /// Wakes the worker if it sleeps (call after queuing its work).
    pub(super) fn wake(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            let _ = self.wake.signal();
        }
    }

    /// Whether remote operations were progressed since the last call.
    pub(super) fn remote_activity(&self) -> bool {
        let Some(counter) = &self.remote_ops else {
            return false;
        };
        let now = counter.read();
        now != self.remote_seen.swap(now, Ordering::Relaxed)
    }

    /// Sleeps until woken, traffic, or `nap` (no wait fd) / [`FD_WAIT`] (wait fd).
    /// `pending` is asked after the worker announced its sleep, so that work queued
    /// meanwhile is not slept through. Returns whether traffic woke it.
    pub(super) fn sleep(
        &self,
        cq: &CompletionQueue,
        nap: Duration,
        pending: impl FnOnce() -> bool,
    ) -> bool {
        self.sleeping.store(true, Ordering::SeqCst);
        if pending() {
            self.sleeping.store(false, Ordering::SeqCst);
            return false;
        }
        let wake = self.wake.as_raw_fd();
        let traffic = match self.cq_fd {
            // Blocking on the fd is safe only when fi_trywait says nothing is pending.
            Some(cq_fd) if matches!(cq.trywait(), Ok(true)) => {
                let ready = poll(&[wake, cq_fd], FD_WAIT);
                ready.get(1).copied().unwrap_or(false)
            }
            _ => {
                poll(&[wake], nap);
                false
            }
        };
        self.sleeping.store(false, Ordering::SeqCst);
        self.wake.drain();
        traffic
    }
}

/// `ppoll` on `fds` for reading, up to `timeout`: which of them are readable.
fn poll(fds: &[RawFd], timeout: Duration) -> Vec<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: pfds and ts are live for the call; no signal mask is changed.
    let n = unsafe {
        libc::ppoll(
            pfds.as_mut_ptr(),
            pfds.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
    pfds.iter()
        .map(|p| n > 0 && p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naps_grow_with_idleness_within_bounds() {
        assert_eq!(nap_after(Duration::ZERO), MIN_NAP);
        assert_eq!(nap_after(Duration::from_millis(20)), MIN_NAP);
        assert!(nap_after(Duration::from_millis(60)) > MIN_NAP);
        assert_eq!(nap_after(Duration::from_secs(10)), MAX_NAP);
    }
}
