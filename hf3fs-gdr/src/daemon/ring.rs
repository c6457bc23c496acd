//! The daemon's side of one ring: the mapped ring with the completion poster the last
//! chunk of each I/O calls, and a thread that takes batches of submissions as the ring's
//! `io_depth` says and hands them to its session (which splits them into chunks for the
//! worker pool). Knows nothing of sessions or chunks: the I/O path builds on it.

use super::logging::daemon_error;
use crate::ring::{Cqe, RingView, DAEMON_ATTACHED, DAEMON_DETACHED};
use crate::shm::{futex_wait, futex_wake, Shm};
use parking_lot::Mutex;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest sleep of an idle ring thread (I/Os prepared without `submit_ios` are seen
/// within this).
const IDLE_SLEEP: Duration = Duration::from_millis(1);
/// How long stopping a ring waits for its I/Os in flight (below the client's request
/// timeout, so a detach never makes the client think the daemon died).
const DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// A mapped ring.
#[derive(Debug)]
pub(crate) struct RingCtx {
    _shm: Shm,
    pub view: RingView,
    cq_lock: Mutex<()>,
    /// Requests dispatched and not yet posted.
    pub inflight: AtomicU64,
    /// Set when the client is gone: chunks not started are skipped.
    cancelled: AtomicBool,
}

impl RingCtx {
    pub(crate) fn new(shm: Shm, view: RingView) -> Self {
        Self {
            _shm: shm,
            view,
            cq_lock: Mutex::new(()),
            inflight: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
        }
    }

    pub(crate) fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// Posts one completion and wakes the client if it sleeps.
    pub(crate) fn post(&self, index: i32, result: i64, userdata: u64) {
        let h = self.view.header();
        {
            let _g = self.cq_lock.lock();
            let tail = h.cq_tail.0.load(Ordering::Relaxed);
            // The client prepares only while fewer than `entries` are unreaped, so the
            // slot is free; a client breaking that rule loses this completion.
            if tail - h.cq_head.0.load(Ordering::Acquire) >= self.view.entries() as u64 {
                daemon_error!("completion ring overflow: completion of index {index} dropped");
            } else {
                self.view.write_cqe(
                    tail,
                    &Cqe {
                        index,
                        reserved: 0,
                        result,
                        userdata,
                    },
                );
                h.cq_tail.0.store(tail + 1, Ordering::Release);
            }
        }
        self.inflight.fetch_sub(1, Ordering::AcqRel);
        h.cq_doorbell.0.fetch_add(1, Ordering::SeqCst);
        if h.client_sleeping.0.load(Ordering::SeqCst) != 0 {
            futex_wake(&h.cq_doorbell.0);
        }
    }
}

/// A running ring thread.
#[derive(Debug)]
pub(crate) struct RingRunner {
    pub ctx: Arc<RingCtx>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RingRunner {
    /// Starts the ring thread of client `client` (for messages); `take` is called with
    /// each batch of submission sequence numbers to run.
    pub(crate) fn start(
        ctx: Arc<RingCtx>,
        client: i32,
        take: impl FnMut(&Arc<RingCtx>, Range<u64>) + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let h = ctx.view.header();
        h.daemon_pid
            .store(std::process::id() as i32, Ordering::Relaxed);
        h.daemon_state.store(DAEMON_ATTACHED, Ordering::Release);
        let thread = {
            let (ctx, stop) = (ctx.clone(), stop.clone());
            std::thread::Builder::new()
                .name("hf3fs-ring".into())
                .spawn(move || ring_loop(&ctx, client, take, &stop))?
        };
        Ok(Self {
            ctx,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops taking submissions; `cancel` also skips chunks not started (the client
    /// died). Returns once the thread has drained its I/Os in flight.
    pub(crate) fn stop(mut self, cancel: bool) {
        if cancel {
            self.ctx.cancelled.store(true, Ordering::Relaxed);
        }
        self.stop.store(true, Ordering::Release);
        futex_wake(&self.ctx.view.header().sq_doorbell.0);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.ctx
            .view
            .header()
            .daemon_state
            .store(DAEMON_DETACHED, Ordering::Release);
    }
}

/// How many submissions to take now, given `avail` prepared beyond `head`.
fn batch_size(io_depth: i32, avail: u64, submitted_beyond_head: u64, waited_out: bool) -> u64 {
    match io_depth {
        0 => avail,
        n if n > 0 => {
            if avail >= n as u64 {
                n as u64
            } else {
                0
            }
        }
        n => {
            let most = n.unsigned_abs() as u64;
            if avail >= most {
                most
            } else if waited_out {
                avail
            } else {
                submitted_beyond_head.min(avail)
            }
        }
    }
}

fn ring_loop(
    ctx: &Arc<RingCtx>,
    client: i32,
    mut take: impl FnMut(&Arc<RingCtx>, Range<u64>),
    stop: &AtomicBool,
) {
    let h = ctx.view.header();
    let entries = ctx.view.entries() as u64;
    let io_depth = h.io_depth;
    let timeout = Duration::from_millis(h.timeout_ms.max(0) as u64);
    let mut head = h.sq_head.0.load(Ordering::Acquire);
    let mut partial_since: Option<Instant> = None;
    let mut idle = 0u32;
    while !stop.load(Ordering::Acquire) {
        let tail = h.sq_tail.0.load(Ordering::Acquire);
        let avail = tail.wrapping_sub(head);
        if avail > entries {
            daemon_error!(
                "ring of client {client}: sq_tail {tail} is more than {entries} past sq_head {head}: ring abandoned"
            );
            break;
        }
        let submitted = h
            .sq_submitted
            .0
            .load(Ordering::Acquire)
            .saturating_sub(head);
        let waited_out = avail > 0
            && (timeout.is_zero()
                || partial_since.get_or_insert_with(Instant::now).elapsed() >= timeout);
        let batch = batch_size(io_depth, avail, submitted, waited_out);
        if batch > 0 {
            take(ctx, head..head + batch);
            head += batch;
            h.sq_head.0.store(head, Ordering::Release);
            partial_since = None;
            idle = 0;
            continue;
        }
        idle += 1;
        if idle < 32 {
            std::thread::yield_now();
            continue;
        }
        let bell = h.sq_doorbell.0.load(Ordering::SeqCst);
        h.daemon_sleeping.0.store(1, Ordering::SeqCst);
        if h.sq_tail.0.load(Ordering::SeqCst) == tail && !stop.load(Ordering::Acquire) {
            let mut sleep = IDLE_SLEEP;
            if let Some(since) = partial_since {
                sleep = sleep.min(timeout.saturating_sub(since.elapsed()));
            }
            futex_wait(&h.sq_doorbell.0, bell, sleep);
        }
        h.daemon_sleeping.0.store(0, Ordering::SeqCst);
    }
    // A client that detaches waits for its I/Os (their memory is about to go); for a
    // client that died nobody waits, and chunks hold the mappings they need.
    let start = Instant::now();
    while ctx.inflight.load(Ordering::Acquire) > 0
        && !ctx.cancelled()
        && start.elapsed() < DRAIN_LIMIT
    {
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[cfg(test)]
mod tests {
    use super::batch_size;

    #[test]
    fn io_depth_modes_take_the_right_batches() {
        // 0: everything seen.
        assert_eq!(batch_size(0, 5, 0, false), 5);
        // N > 0: exactly N, never a partial batch.
        assert_eq!(batch_size(4, 3, 3, true), 0);
        assert_eq!(batch_size(4, 9, 9, true), 4);
        // N < 0: up to -N; a partial batch once submitted or waited out.
        assert_eq!(batch_size(-4, 9, 0, false), 4);
        assert_eq!(batch_size(-4, 3, 0, false), 0);
        assert_eq!(batch_size(-4, 3, 2, false), 2);
        assert_eq!(batch_size(-4, 3, 0, true), 3);
    }
}
