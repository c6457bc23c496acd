//! What the backends share: the inbox of received notifications (which wakes the
//! agent's waiters), assembling notifications on the target, parsing string parameters.

use crate::backend::{BackendParams, NotifWaker};
use crate::error::{Error, Result};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::hash::Hash;

/// Received notifications, oldest first, waiting for [`crate::Backend::take_notifs`];
/// each push wakes the agents' waiters ([`crate::Agent::wait_notifs`]).
#[derive(Debug, Default)]
pub(crate) struct NotifInbox {
    ready: Mutex<Vec<(String, Vec<u8>)>>,
    /// One per agent the backend was added to (almost always one).
    wakers: RwLock<Vec<NotifWaker>>,
}

impl NotifInbox {
    /// Queues a notification, then wakes the waiters (after: a woken waiter takes it).
    pub(crate) fn push(&self, sender: impl Into<String>, msg: Vec<u8>) {
        self.ready.lock().push((sender.into(), msg));
        for waker in self.wakers.read().iter() {
            waker.wake();
        }
    }

    /// Moves the queued notifications, oldest first, into `into`.
    pub(crate) fn take(&self, into: &mut Vec<(String, Vec<u8>)>) {
        into.append(&mut self.ready.lock());
    }

    /// Adds an agent's waker (see [`crate::Backend::set_notif_waker`]).
    pub(crate) fn add_waker(&self, waker: NotifWaker) {
        self.wakers.write().push(waker);
    }
}

/// Releases a transfer's notification only once its message has arrived *and* as many
/// data completions as the message says to expect (counted per key: the sender and its
/// sequence number), whichever comes first and in whatever order or batching.
#[derive(Debug)]
pub(crate) struct NotifTracker<K> {
    pending: Mutex<HashMap<K, Pending>>,
    ready: NotifInbox,
}

#[derive(Debug, Default)]
struct Pending {
    received: u64,
    /// (expected data completions, sender, message)
    message: Option<(u64, String, Vec<u8>)>,
}

impl<K> Default for NotifTracker<K> {
    fn default() -> Self {
        Self {
            pending: Mutex::default(),
            ready: NotifInbox::default(),
        }
    }
}

impl<K: Hash + Eq + Copy> NotifTracker<K> {
    /// One data completion of transfer `key` landed.
    pub(crate) fn data_arrived(&self, key: K) {
        let mut pending = self.pending.lock();
        pending.entry(key).or_default().received += 1;
        self.release_if_complete(&mut pending, key);
    }

    /// The notification message of transfer `key` arrived.
    pub(crate) fn message_arrived(
        &self,
        key: K,
        expected: u64,
        sender: impl Into<String>,
        msg: Vec<u8>,
    ) {
        let mut pending = self.pending.lock();
        pending.entry(key).or_default().message = Some((expected, sender.into(), msg));
        self.release_if_complete(&mut pending, key);
    }

    /// Forgets half-assembled notifications whose key matches (a connection went away).
    pub(crate) fn forget(&self, mut matches: impl FnMut(&K) -> bool) {
        self.pending.lock().retain(|key, _| !matches(key));
    }

    /// Moves the released notifications, in release order, into `into`.
    pub(crate) fn take(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.ready.take(into);
    }

    /// Adds an agent's waker, woken by every notification released from now on.
    pub(crate) fn add_waker(&self, waker: NotifWaker) {
        self.ready.add_waker(waker);
    }

    fn release_if_complete(&self, pending: &mut HashMap<K, Pending>, key: K) {
        let complete = pending.get(&key).is_some_and(|p| {
            p.message
                .as_ref()
                .is_some_and(|(expected, ..)| p.received >= *expected)
        });
        if complete {
            let (_, sender, msg) = pending
                .remove(&key)
                .and_then(|p| p.message)
                .expect("checked above");
            self.ready.push(sender, msg);
        }
    }

    #[cfg(test)]
    fn assembling(&self) -> usize {
        self.pending.lock().len()
    }
}

/// Parses backend parameter `key` (absent: `default`), naming the backend in the error.
pub(crate) fn param<T: std::str::FromStr>(
    backend: &str,
    params: &BackendParams,
    key: &str,
    default: T,
) -> Result<T> {
    match params.get(key) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| {
            Error::InvalidParam(format!("{backend} parameter {key}=`{v}` is not valid"))
        }),
    }
}

/// Appends `addr` as `family:u8 (4|6) ip port:u16 LE` (the heartbeat hub's and VERBS's
/// connection information).
pub(crate) fn put_socket_addr(out: &mut Vec<u8>, addr: std::net::SocketAddr) {
    match addr.ip() {
        std::net::IpAddr::V4(v4) => {
            out.push(4);
            out.extend_from_slice(&v4.octets());
        }
        std::net::IpAddr::V6(v6) => {
            out.push(6);
            out.extend_from_slice(&v6.octets());
        }
    }
    out.extend_from_slice(&addr.port().to_le_bytes());
}

/// The kernel's boot id (`/proc/sys/kernel/random/boot_id`): the same for every process
/// of one boot of one host (containers included), different on any other host.
pub(crate) fn boot_id() -> Option<[u8; 16]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let hex: Vec<u8> = text.trim().bytes().filter(|c| *c != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(std::str::from_utf8(&hex[2 * i..2 * i + 2]).ok()?, 16).ok()?;
    }
    Some(out)
}

/// A random 64-bit number (an incarnation or nonce: tells one run of a backend from the
/// next, not a secret).
pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Joins `threads` (except the calling one), waiting at most `timeout` in all; returns the
/// names of those still running then, which are left detached. A thread stuck inside a
/// provider call (libfabric 1.17's `shm` can spin forever on a lock a dead peer held)
/// must not hang the backend's drop: it keeps what it holds (its `Arc`s) alive, so
/// nothing it may still touch is freed under it.
pub(crate) fn join_bounded(
    threads: Vec<std::thread::JoinHandle<()>>,
    timeout: std::time::Duration,
) -> Vec<String> {
    let deadline = std::time::Instant::now() + timeout;
    let mut stuck = Vec::new();
    for thread in threads {
        if thread.thread().id() == std::thread::current().id() {
            continue;
        }
        while !thread.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        if thread.is_finished() {
            let _ = thread.join();
        } else {
            stuck.push(thread.thread().name().unwrap_or("unnamed").to_string());
        }
    }
    stuck
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_bounded_returns_within_its_bound_and_names_the_stuck() {
        let quick = std::thread::Builder::new()
            .name("quick".into())
            .spawn(|| {})
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let stuck = std::thread::Builder::new()
            .name("stuck".into())
            .spawn(move || {
                let _ = rx.recv();
            })
            .unwrap();
        let start = std::time::Instant::now();
        let left = join_bounded(vec![quick, stuck], std::time::Duration::from_millis(200));
        assert_eq!(left, vec!["stuck".to_string()]);
        // Generous: the bound is 200 ms; a loaded machine may add scheduling delay.
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
        drop(tx);
    }

    fn released(t: &NotifTracker<u64>) -> usize {
        let mut out = Vec::new();
        t.take(&mut out);
        out.len()
    }

    #[test]
    fn releases_only_when_data_and_message_are_in() {
        let t = NotifTracker::<u64>::default();
        t.data_arrived(7);
        t.message_arrived(7, 3, "a", b"m".to_vec());
        assert_eq!(released(&t), 0, "1 of 3 writes landed");
        t.data_arrived(7);
        assert_eq!(released(&t), 0, "2 of 3");
        t.data_arrived(7);
        assert_eq!(released(&t), 1);
        // Message first, then data; a zero-expectation message is immediate.
        t.message_arrived(8, 1, "b", b"x".to_vec());
        assert_eq!(released(&t), 0);
        t.data_arrived(8);
        t.message_arrived(9, 0, "c", b"y".to_vec());
        assert_eq!(released(&t), 2);
        assert_eq!(t.assembling(), 0);
        t.data_arrived(10);
        t.forget(|k| *k == 10);
        assert_eq!(t.assembling(), 0);
    }

    #[test]
    fn bad_parameters_name_the_backend() {
        let params: BackendParams = [("n".to_string(), "x".to_string())].into();
        assert_eq!(param("B", &params, "m", 3u8).unwrap(), 3);
        let err = param::<u8>("B", &params, "n", 3).unwrap_err().to_string();
        assert!(err.contains("B parameter n=`x`"), "{err}");
    }
}
