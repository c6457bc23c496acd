//! Opt-in timing of direct-copy requests: with `NIXL_PEER_COPY_TRACE=1` (read once per
//! process) each side stamps a request's steps with `CLOCK_MONOTONIC` nanoseconds
//! (one clock for every process of a host, so the two sides' stamps compare), the
//! target's stamps travel back in its answer, and the initiator adds each post's
//! segments to process-wide sums that `query_mem_info` reports (`peer_copy_trace_*`).
//! Off, a step costs one relaxed load.
//!
//! Only posts of one request are timed (a transfer of one allocation and at most
//! [`super::MAX_PIECES`] pieces: every batch-1 transfer): with several, which answer
//! ends which segment is not one line.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// The environment variable that turns tracing on (`1`; unset, empty or `0`: off).
pub(crate) const ENV: &str = "NIXL_PEER_COPY_TRACE";

/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether this process traces direct-copy requests.
#[inline]
pub(crate) fn on() -> bool {
    match STATE.load(Ordering::Relaxed) {
        2 => true,
        1 => false,
        _ => read_env(),
    }
}

#[cold]
fn read_env() -> bool {
    let on = std::env::var_os(ENV).is_some_and(|v| !v.is_empty() && v != "0");
    STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    on
}

/// `CLOCK_MONOTONIC` in nanoseconds.
pub(crate) fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// `now_ns()` where tracing is on, else 0 (one relaxed load).
#[inline]
pub(crate) fn stamp() -> u64 {
    if on() {
        now_ns()
    } else {
        0
    }
}

/// The target's stamps of one request, carried back in its answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TargetStamps {
    /// Its listener read the request.
    pub(crate) read: u64,
    /// Its copies were queued on the GPU (checks, import, `cuMemcpyAsync`, event).
    pub(crate) launched: u64,
    /// Its serving thread saw them complete.
    pub(crate) complete: u64,
    /// The answer was about to be sent (after a carried notification was delivered).
    pub(crate) answered: u64,
}

/// The initiator's stamps of one post.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PostStamps {
    /// `post` entered.
    pub(crate) posted: u64,
    /// The request was written to the connection.
    pub(crate) sent: u64,
    /// Its answer was read.
    pub(crate) answer_read: u64,
    /// The notification was sent after the answer (equal to `answer_read` where the
    /// request carried it, or there was none).
    pub(crate) notified: u64,
    /// `check` returned Done.
    pub(crate) done: u64,
}

static SUMS: [AtomicU64; 9] = [const { AtomicU64::new(0) }; 9];
static COUNT: AtomicU64 = AtomicU64::new(0);

/// Each segment's nanoseconds of one post, in [`counters`]' order: each the time from
/// one stamp to the next, then the whole post. A stamp earlier than the one before it
/// counts 0 (never a wrapped difference).
pub(crate) fn segments(post: &PostStamps, target: &TargetStamps) -> [u64; 9] {
    let chain = [
        post.posted,
        post.sent,
        target.read,
        target.launched,
        target.complete,
        target.answered,
        post.answer_read,
        post.notified,
        post.done,
    ];
    let mut out = [0u64; 9];
    for (i, pair) in chain.windows(2).enumerate() {
        out[i] = pair[1].saturating_sub(pair[0]);
    }
    out[8] = post.done.saturating_sub(post.posted);
    out
}

/// Adds one post's segments to the process's sums (a post whose stamps are incomplete
/// is not counted).
pub(crate) fn record(post: &PostStamps, target: &TargetStamps) {
    let all = [
        post.posted,
        post.sent,
        post.answer_read,
        post.notified,
        post.done,
        target.read,
        target.launched,
        target.complete,
        target.answered,
    ];
    if all.contains(&0) {
        return;
    }
    for (sum, ns) in SUMS.iter().zip(segments(post, target)) {
        sum.fetch_add(ns, Ordering::Relaxed);
    }
    COUNT.fetch_add(1, Ordering::Relaxed);
}

/// Steps inside one side's handling, timed where tracing is on and summed per process
/// (each with its own count: a step one side never runs reports 0 of 0), to find where
/// a segment above goes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Step {
    /// Target: the transport handed the request over (a completion read, a socket read)
    /// → the request is decoded and its sender proven.
    TargetReceivedToRead,
    /// Target: checks of the pieces against advertised VRAM and registered DRAM.
    ServeLocate,
    /// Target: the peer's allocation imported (a cache hit after the first).
    ServeImport,
    /// Target: the copies laid out and the batch made (streams, events).
    ServeBatch,
    /// Target: `cuMemcpyAsync`s and the event record.
    ServePost,
    /// Initiator: the transport handed the answer over → the waiting request told.
    AnswerReceivedToRead,
}

/// Each step's keys in `query_mem_info`: its count and its summed nanoseconds.
const STEP_KEYS: [(&str, &str); 6] = [
    (
        "peer_copy_step_target_received_to_read_count",
        "peer_copy_step_target_received_to_read_ns",
    ),
    (
        "peer_copy_step_serve_locate_count",
        "peer_copy_step_serve_locate_ns",
    ),
    (
        "peer_copy_step_serve_import_count",
        "peer_copy_step_serve_import_ns",
    ),
    (
        "peer_copy_step_serve_batch_count",
        "peer_copy_step_serve_batch_ns",
    ),
    (
        "peer_copy_step_serve_post_count",
        "peer_copy_step_serve_post_ns",
    ),
    (
        "peer_copy_step_answer_received_to_read_count",
        "peer_copy_step_answer_received_to_read_ns",
    ),
];

static STEP_SUMS: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];
static STEP_COUNTS: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];

/// Adds the time from `from` (a [`stamp`]) to now to `step`'s sum; nothing where tracing
/// is off or `from` was not stamped. Returns now (the next step's start), or 0.
pub(crate) fn step(step: Step, from: u64) -> u64 {
    if from == 0 || !on() {
        return 0;
    }
    let now = now_ns();
    STEP_SUMS[step as usize].fetch_add(now.saturating_sub(from), Ordering::Relaxed);
    STEP_COUNTS[step as usize].fetch_add(1, Ordering::Relaxed);
    now
}

thread_local! {
    /// When this thread's transport last handed messages over ([`mark_received`]).
    static RECEIVED_AT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Notes that this thread's transport just handed messages over (a completion queue
/// read, a socket read) where tracing is on: the start of [`since_received`].
#[inline]
pub(crate) fn mark_received() {
    if on() {
        RECEIVED_AT.with(|at| at.set(now_ns()));
    }
}

/// [`step`] from this thread's last [`mark_received`]; returns now (or 0, where tracing
/// is off or nothing was marked).
pub(crate) fn since_received(s: Step) -> u64 {
    if !on() {
        return 0;
    }
    step(s, RECEIVED_AT.with(std::cell::Cell::get))
}

/// A target's "read" stamp of a request: the end of [`Step::TargetReceivedToRead`] (which
/// this records), or now where nothing was marked received; 0 where tracing is off.
pub(crate) fn request_read() -> u64 {
    match since_received(Step::TargetReceivedToRead) {
        0 => stamp(),
        now => now,
    }
}

/// The posts timed so far and each segment's summed nanoseconds, as
/// `(peer_copy_trace_count, n)` then `(peer_copy_trace_<segment>_ns, sum)`; empty where
/// tracing is off.
pub(crate) fn counters() -> Vec<(&'static str, u64)> {
    const KEYS: [&str; 9] = [
        "peer_copy_trace_post_to_sent_ns",
        "peer_copy_trace_sent_to_target_read_ns",
        "peer_copy_trace_target_read_to_launched_ns",
        "peer_copy_trace_launched_to_complete_ns",
        "peer_copy_trace_complete_to_answer_sent_ns",
        "peer_copy_trace_answer_sent_to_read_ns",
        "peer_copy_trace_answer_read_to_notif_sent_ns",
        "peer_copy_trace_notif_sent_to_done_ns",
        "peer_copy_trace_post_to_done_ns",
    ];
    if !on() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(1 + KEYS.len());
    out.push(("peer_copy_trace_count", COUNT.load(Ordering::Relaxed)));
    for (key, sum) in KEYS.iter().zip(&SUMS) {
        out.push((*key, sum.load(Ordering::Relaxed)));
    }
    out.extend(step_counters());
    out
}

/// Each [`Step`]'s count and summed nanoseconds.
fn step_counters() -> Vec<(&'static str, u64)> {
    let mut out = Vec::with_capacity(2 * STEP_KEYS.len());
    for (i, (count, ns)) in STEP_KEYS.iter().enumerate() {
        out.push((*count, STEP_COUNTS[i].load(Ordering::Relaxed)));
        out.push((*ns, STEP_SUMS[i].load(Ordering::Relaxed)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_chain_the_stamps_and_never_wrap() {
        let post = PostStamps {
            posted: 100,
            sent: 110,
            answer_read: 200,
            notified: 205,
            done: 207,
        };
        let target = TargetStamps {
            read: 120,
            launched: 130,
            complete: 180,
            answered: 190,
        };
        assert_eq!(
            segments(&post, &target),
            [10, 10, 10, 50, 10, 10, 5, 2, 107]
        );
        // A stamp before the one it follows (another clock, a bug) counts 0.
        let early = TargetStamps { read: 50, ..target };
        assert_eq!(segments(&post, &early)[1], 0);
        assert!(now_ns() > 0);
        assert!(now_ns() <= now_ns());
    }
}
