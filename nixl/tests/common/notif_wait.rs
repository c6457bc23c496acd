//! What `Agent::wait_notifs` promises, checked over any backend: an idle wait returns
//! empty at its timeout without using the CPU, a notification sent meanwhile from
//! another thread wakes it promptly, and a burst arrives complete, once, in order.

use super::TIMEOUT;
use nixl::Agent;
use std::time::{Duration, Instant};

/// How long a woken wait may take at most: far below [`TIMEOUT`] (which the waits are
/// given), generous for the soft-RoCE guest under TCG.
pub const PROMPT: Duration = Duration::from_secs(5);

/// CPU time the calling thread has used.
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: one live timespec to fill; the clock id is a constant.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// An idle wait of `timeout`: returns empty, not before the timeout, and uses little CPU
/// (`cpu_bound`: a busy loop would use about the whole timeout).
pub fn idle_wait_sleeps(target: &Agent, timeout: Duration, cpu_bound: Duration) {
    let (start, cpu) = (Instant::now(), thread_cpu());
    let got = target.wait_notifs(timeout);
    let (waited, used) = (start.elapsed(), thread_cpu() - cpu);
    assert!(got.is_empty(), "nothing was sent, got {got:?}");
    assert!(
        waited >= timeout,
        "returned after {waited:?} of {timeout:?}"
    );
    assert!(
        waited < timeout + PROMPT,
        "returned after {waited:?} of {timeout:?}"
    );
    assert!(
        used < cpu_bound,
        "an idle wait of {waited:?} used {used:?} of CPU (bound {cpu_bound:?})"
    );
}

/// The whole contract, `sender` notifying `target` (the same agent for a loopback-only
/// backend); `sender` must have `target`'s metadata loaded.
pub fn check_wait_notifs(target: &Agent, sender: &Agent) {
    let from = sender.name().to_string();
    let to = target.name().to_string();
    // Whatever an earlier step left.
    target.get_notifs();

    // A busy loop would use about 500 ms; re-polling a backend that does not wake the
    // wait (no progress thread) about a hundred looks a second.
    idle_wait_sleeps(
        target,
        Duration::from_millis(500),
        Duration::from_millis(100),
    );

    // A notification from another thread, sent while the wait sleeps, wakes it.
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            sender.gen_notif(&to, b"wake").unwrap();
        });
        let start = Instant::now();
        let got = target.wait_notifs(TIMEOUT);
        let waited = start.elapsed();
        assert_eq!(got.get(&from), Some(&vec![b"wake".to_vec()]), "{got:?}");
        assert!(waited < PROMPT, "woken after {waited:?}");
    });

    // A burst sent while the target waits over and over: every one exactly once, in order.
    const N: usize = 100;
    let sent: Vec<Vec<u8>> = (0..N).map(|i| format!("n{i}").into_bytes()).collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            for (i, msg) in sent.iter().enumerate() {
                sender.gen_notif(&to, msg).unwrap();
                // Some arrive while the target sleeps, some while it takes.
                if i % 8 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        let deadline = Instant::now() + TIMEOUT;
        let mut got = Vec::new();
        while got.len() < N {
            assert!(Instant::now() < deadline, "{} of {N} arrived", got.len());
            let mut map = target.wait_notifs(Duration::from_secs(1));
            got.extend(map.remove(&from).unwrap_or_default());
            assert!(map.is_empty(), "from nobody else: {map:?}");
        }
        assert_eq!(got, sent);
    });
    let late = target.wait_notifs(Duration::from_millis(100));
    assert!(late.is_empty(), "nothing twice: {late:?}");
}
