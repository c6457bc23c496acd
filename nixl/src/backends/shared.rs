//! What the backends share: the inbox of received notifications (which wakes the
//! agent's waiters), assembling notifications on the target, parsing string parameters.

use crate::backend::{BackendParams, NotifWaker};
use crate::error::{Error, Result};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Who an arrival is charged to and attributed to: a transport's name for a peer (a
/// connection, a loaded peer's identity); `None` where the transport cannot tell.
pub(crate) type Owner = Option<u64>;

/// Releases a transfer's notification only once its message has arrived *and* as many
/// data completions as the message says to expect (counted per key), whichever comes
/// first and in whatever order or batching.
///
/// Bounded ([`NotifTracker::bounded`]): each owner may have at most `limit` entries
/// waiting. A message over the bound is dropped ([`Arrival::Refused`] with
/// [`NotifRefusal::TooManyPending`], counted in [`NotifTracker::refused`]); data that
/// arrives before its message over the bound makes room by dropping that owner's oldest
/// such entry (its notification can then never be released — never released *early*).
/// Where arrivals are attributed, data from another owner than its message's is refused
/// ([`NotifRefusal::WrongSender`]), and data from another owner that came before the
/// message is discarded when the message comes.
#[derive(Debug)]
pub(crate) struct NotifTracker<K> {
    state: Mutex<Tracker<K>>,
    ready: NotifInbox,
    /// Entries one owner may have waiting (`usize::MAX`: unbounded).
    limit: usize,
    refused: AtomicU64,
}

#[derive(Debug)]
struct Tracker<K> {
    pending: HashMap<K, Pending>,
    /// Entries charged to each owner.
    charged: HashMap<Owner, usize>,
    /// Per owner, the keys of entries that have data but no message yet, oldest first
    /// (keys whose entry moved on are skipped and compacted away, see
    /// [`Tracker::compact_data_only`]); bounded trackers only.
    data_only: HashMap<Owner, VecDeque<K>>,
}

impl<K> Default for Tracker<K> {
    fn default() -> Self {
        Self {
            pending: HashMap::new(),
            charged: HashMap::new(),
            data_only: HashMap::new(),
        }
    }
}

#[derive(Debug)]
struct Pending {
    received: u64,
    /// Charged to: the message's owner once it is in, else the data's.
    owner: Owner,
    /// Who sent data, where the transport told.
    data_from: Owner,
    /// (expected data completions, sender, message)
    message: Option<(u64, String, Vec<u8>)>,
}

/// What became of an arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// Counted; the notification waits for the rest.
    Counted,
    /// It completed a notification, which was released.
    Released,
    /// Dropped, and why.
    Refused(NotifRefusal),
}

/// Why an arrival was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotifRefusal {
    /// Its owner already has `limit` notifications waiting.
    TooManyPending { limit: usize },
    /// A message for a key whose message is already in.
    Duplicate,
    /// Data or a message from another owner than the one the entry belongs to.
    WrongSender,
}

impl std::fmt::Display for NotifRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotifRefusal::TooManyPending { limit } => {
                write!(f, "the sender already has {limit} notifications waiting")
            }
            NotifRefusal::Duplicate => f.write_str("a second message for one notification"),
            NotifRefusal::WrongSender => {
                f.write_str("it does not come from the sender of the rest of its notification")
            }
        }
    }
}

impl<K> Default for NotifTracker<K> {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            ready: NotifInbox::default(),
            limit: usize::MAX,
            refused: AtomicU64::new(0),
        }
    }
}

impl<K: Hash + Eq + Copy> NotifTracker<K> {
    /// A tracker where each owner may have at most `limit` entries waiting.
    pub(crate) fn bounded(limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            ..Self::default()
        }
    }

    /// One data completion of transfer `key` landed (sender unknown).
    pub(crate) fn data_arrived(&self, key: K) {
        self.data_from(key, None);
    }

    /// One data completion of transfer `key` landed, from `from` where the transport
    /// told.
    pub(crate) fn data_from(&self, key: K, from: Owner) -> Arrival {
        let mut state = self.state.lock();
        let tracker = &mut *state;
        if let Some(p) = tracker.pending.get_mut(&key) {
            let entry_sender = if p.message.is_some() {
                p.owner
            } else {
                p.data_from
            };
            if from.is_some() && entry_sender.is_some() && from != entry_sender {
                return self.refuse(NotifRefusal::WrongSender);
            }
            p.received += 1;
            p.data_from = p.data_from.or(from);
            return self.release_if_complete(tracker, key);
        }
        if self.limit != usize::MAX {
            if tracker.charged.get(&from).copied().unwrap_or(0) >= self.limit
                && !tracker.evict_oldest_data_only(from)
            {
                return self.refuse(NotifRefusal::TooManyPending { limit: self.limit });
            }
            tracker.data_only.entry(from).or_default().push_back(key);
        }
        *tracker.charged.entry(from).or_default() += 1;
        if self.limit != usize::MAX {
            tracker.compact_data_only(from);
        }
        tracker.pending.insert(
            key,
            Pending {
                received: 1,
                owner: from,
                data_from: from,
                message: None,
            },
        );
        Arrival::Counted
    }

    /// The notification message of transfer `key` arrived (sender unknown).
    pub(crate) fn message_arrived(
        &self,
        key: K,
        expected: u64,
        sender: impl Into<String>,
        msg: Vec<u8>,
    ) {
        self.message_from(key, None, expected, sender, msg);
    }

    /// The notification message of transfer `key` arrived from `owner`, delivered under
    /// `sender`.
    pub(crate) fn message_from(
        &self,
        key: K,
        owner: Owner,
        expected: u64,
        sender: impl Into<String>,
        msg: Vec<u8>,
    ) -> Arrival {
        let mut state = self.state.lock();
        let tracker = &mut *state;
        let (previous, foreign_data) = match tracker.pending.get(&key) {
            Some(p) if p.message.is_some() => return self.refuse(NotifRefusal::Duplicate),
            // Data from another sender came first: it was not this notification's.
            Some(p) => (
                Some(p.owner),
                owner.is_some() && p.data_from.is_some() && p.data_from != owner,
            ),
            None => (None, false),
        };
        if previous != Some(owner)
            && tracker.charged.get(&owner).copied().unwrap_or(0) >= self.limit
        {
            return self.refuse(NotifRefusal::TooManyPending { limit: self.limit });
        }
        if previous != Some(owner) {
            if let Some(old) = previous {
                tracker.uncharge(old);
            }
            *tracker.charged.entry(owner).or_default() += 1;
        }
        let p = tracker.pending.entry(key).or_insert(Pending {
            received: 0,
            owner,
            data_from: None,
            message: None,
        });
        p.owner = owner;
        p.message = Some((expected, sender.into(), msg));
        if foreign_data {
            p.received = 0;
            p.data_from = None;
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        self.release_if_complete(tracker, key)
    }

    /// Delivers a notification at once (nothing to wait for: this side sent it to itself).
    pub(crate) fn deliver(&self, sender: impl Into<String>, msg: Vec<u8>) {
        self.ready.push(sender, msg);
    }

    /// Forgets half-assembled notifications whose key matches (a connection went away).
    pub(crate) fn forget(&self, mut matches: impl FnMut(&K) -> bool) {
        let mut state = self.state.lock();
        let tracker = &mut *state;
        let gone: Vec<K> = tracker
            .pending
            .keys()
            .filter(|k| matches(k))
            .copied()
            .collect();
        for key in gone {
            tracker.remove(key);
        }
    }

    /// Forgets the half-assembled notifications charged to or sent by `owner` (a peer
    /// that went away or was replaced).
    pub(crate) fn forget_owner(&self, owner: Owner) {
        let mut state = self.state.lock();
        let tracker = &mut *state;
        let gone: Vec<K> = tracker
            .pending
            .iter()
            .filter(|(_, p)| p.owner == owner || (p.message.is_none() && p.data_from == owner))
            .map(|(k, _)| *k)
            .collect();
        for key in gone {
            tracker.remove(key);
        }
        tracker.data_only.remove(&owner);
    }

    /// Moves the released notifications, in release order, into `into`.
    pub(crate) fn take(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.ready.take(into);
    }

    /// Adds an agent's waker, woken by every notification released from now on.
    pub(crate) fn add_waker(&self, waker: NotifWaker) {
        self.ready.add_waker(waker);
    }

    /// Arrivals dropped so far (see [`NotifRefusal`]).
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Notifications waiting for their message or data.
    #[cfg(test)]
    pub(crate) fn assembling(&self) -> usize {
        self.state.lock().pending.len()
    }

    fn refuse(&self, why: NotifRefusal) -> Arrival {
        self.refused.fetch_add(1, Ordering::Relaxed);
        Arrival::Refused(why)
    }

    fn release_if_complete(&self, tracker: &mut Tracker<K>, key: K) -> Arrival {
        let complete = tracker.pending.get(&key).is_some_and(|p| {
            p.message
                .as_ref()
                .is_some_and(|(expected, ..)| p.received >= *expected)
        });
        if !complete {
            return Arrival::Counted;
        }
        if let Some((_, sender, msg)) = tracker.remove(key).and_then(|p| p.message) {
            self.ready.push(sender, msg);
        }
        Arrival::Released
    }
}

impl<K: Hash + Eq + Copy> Tracker<K> {
    fn uncharge(&mut self, owner: Owner) {
        if let Some(n) = self.charged.get_mut(&owner) {
            *n -= 1;
            if *n == 0 {
                self.charged.remove(&owner);
            }
        }
    }

    fn remove(&mut self, key: K) -> Option<Pending> {
        let p = self.pending.remove(&key)?;
        self.uncharge(p.owner);
        Some(p)
    }

    /// Drops the keys of `owner`'s data-only queue whose entries got their message or went
    /// (nearly every key, soon after its push: a transfer's data usually lands just before
    /// its message), once they are more than the entries charged to `owner` (a bound on
    /// its live data-only entries) twice over, plus a little: the queue stays within a
    /// constant factor of what is waiting, and each key is looked at a constant number
    /// of times on average. Compacting only past a fixed bound (twice the per-owner limit)
    /// let every busy sender's queue keep its last 8,192 keys, released long ago (the
    /// live heap the soak saw grow: issue 27).
    fn compact_data_only(&mut self, owner: Owner) {
        let charged = self.charged.get(&owner).copied().unwrap_or(0);
        let Some(queue) = self.data_only.get_mut(&owner) else {
            return;
        };
        if queue.len() <= 2 * charged + 64 {
            return;
        }
        let pending = &self.pending;
        queue.retain(|k| {
            pending
                .get(k)
                .is_some_and(|p| p.message.is_none() && p.owner == owner)
        });
        if queue.is_empty() {
            self.data_only.remove(&owner);
        } else if queue.capacity() > 4 * queue.len() + 64 {
            queue.shrink_to(2 * queue.len() + 64);
        }
    }

    /// Drops `owner`'s oldest entry that has data and no message; whether there was one.
    fn evict_oldest_data_only(&mut self, owner: Owner) -> bool {
        while let Some(key) = self.data_only.get_mut(&owner).and_then(VecDeque::pop_front) {
            let live = self
                .pending
                .get(&key)
                .is_some_and(|p| p.message.is_none() && p.owner == owner);
            if live {
                self.remove(key);
                return true;
            }
        }
        false
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

/// Test fixture: a real process in a pid namespace of its own (`unshare`), as it sees
/// itself; killed when dropped.
#[cfg(test)]
pub(crate) struct UnsharedProcess {
    pub(crate) child: std::process::Child,
    /// Its pid in its own namespace (1).
    pub(crate) pid_there: u32,
    /// Its start time as `/proc/<pid>/stat` gives it there.
    pub(crate) start_time: u64,
    /// The inode of its pid namespace.
    pub(crate) pid_ns: u64,
}

#[cfg(test)]
impl UnsharedProcess {
    /// `None` (printed why: the caller's test skips) where `unshare` or user namespaces
    /// are not available.
    pub(crate) fn spawn() -> Option<Self> {
        use std::io::BufRead;
        let mut child = match std::process::Command::new("unshare")
            .args([
                "--user",
                "--map-root-user",
                "--pid",
                "--fork",
                "--kill-child",
            ])
            .args(["--mount-proc", "sh", "-c"])
            .arg("cat /proc/1/stat; readlink /proc/self/ns/pid; exec sleep 30")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                println!("skipped: no `unshare` ({e})");
                return None;
            }
        };
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let (Some(Ok(stat)), Some(Ok(ns))) = (lines.next(), lines.next()) else {
            let _ = child.kill();
            let _ = child.wait();
            println!("skipped: unshare could not make a pid namespace here (no user namespaces)");
            return None;
        };
        // The namespace's first process (the shell, then `sleep`): its pid and start
        // time as that namespace sees them.
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        let pid_there: u32 = stat.split(' ').next().unwrap().parse().unwrap();
        let pid_ns: u64 = ns
            .trim()
            .strip_prefix("pid:[")
            .and_then(|n| n.strip_suffix(']'))
            .unwrap()
            .parse()
            .unwrap();
        Some(Self {
            child,
            pid_there,
            start_time: fields[19].parse().unwrap(),
            pid_ns,
        })
    }
}

#[cfg(test)]
impl Drop for UnsharedProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
    fn bounded_owners_and_wrong_senders() {
        let t = NotifTracker::<u64>::bounded(3);
        let (a, b) = (Some(1), Some(2));
        // Messages that never complete: three per owner, the fourth is refused.
        for k in 0..3 {
            assert_eq!(t.message_from(k, a, 1, "a", vec![]), Arrival::Counted);
        }
        assert_eq!(
            t.message_from(3, a, 1, "a", vec![]),
            Arrival::Refused(NotifRefusal::TooManyPending { limit: 3 })
        );
        // Another owner has its own bound.
        assert_eq!(t.message_from(10, b, 1, "b", vec![]), Arrival::Counted);
        assert_eq!(t.assembling(), 4);
        // Data from someone else does not count toward a's notification...
        assert_eq!(
            t.data_from(0, b),
            Arrival::Refused(NotifRefusal::WrongSender)
        );
        assert_eq!(released(&t), 0);
        // ...data from a, or unattributed, does.
        assert_eq!(t.data_from(0, a), Arrival::Released);
        assert_eq!(t.data_from(1, None), Arrival::Released);
        assert_eq!(released(&t), 2);
        // A second message for one key is refused.
        assert_eq!(
            t.message_from(2, a, 1, "a", vec![]),
            Arrival::Refused(NotifRefusal::Duplicate)
        );
        // Data from another owner before the message: not counted once the message is
        // in (and counted as refused); the owner's own data then releases it.
        assert_eq!(t.data_from(20, b), Arrival::Counted);
        assert_eq!(t.data_from(20, b), Arrival::Counted);
        assert_eq!(t.message_from(20, a, 2, "a", vec![]), Arrival::Counted);
        assert_eq!(t.refused(), 4);
        assert_eq!(t.data_from(20, a), Arrival::Counted);
        assert_eq!(t.data_from(20, a), Arrival::Released);
        // Data before its message over the bound: the owner's oldest such entry goes.
        t.forget_owner(a);
        t.forget_owner(b);
        assert_eq!(t.assembling(), 0);
        for k in 100..110 {
            assert_eq!(t.data_from(k, a), Arrival::Counted);
        }
        assert_eq!(t.assembling(), 3);
        // The newest are kept and still complete; the evicted one never releases.
        assert_eq!(t.message_from(109, a, 1, "a", vec![]), Arrival::Released);
        assert_eq!(t.message_from(100, a, 1, "a", vec![]), Arrival::Counted);
        assert_eq!(t.assembling(), 3);
    }

    /// A busy sender whose data lands before each message (the usual order): the keys
    /// remembered for eviction stay a handful, not the last thousands of released
    /// transfers; and the bound still holds (the oldest data-only entry is evicted).
    #[test]
    fn released_transfers_leave_no_keys_behind() {
        let limit = 4096;
        let t = NotifTracker::<u64>::bounded(limit);
        let a = Some(1);
        let queued = |t: &NotifTracker<u64>| {
            let state = t.state.lock();
            state
                .data_only
                .get(&a)
                .map_or((0, 0), |q| (q.len(), q.capacity()))
        };
        let mut largest = 0;
        for k in 0..100_000u64 {
            assert_eq!(t.data_from(k, a), Arrival::Counted);
            assert_eq!(t.message_from(k, a, 1, "a", vec![]), Arrival::Released);
            largest = largest.max(queued(&t).0);
        }
        assert_eq!(released(&t), 100_000);
        assert!(
            largest <= 66,
            "up to {largest} keys of released transfers kept"
        );
        assert!(queued(&t).1 <= 256, "capacity {:?}", queued(&t));
        // Entries that wait (data, no message) are all remembered, and the oldest goes
        // first once the bound is reached.
        for k in 200_000..200_000 + limit as u64 + 1 {
            assert_eq!(t.data_from(k, a), Arrival::Counted);
        }
        assert_eq!(t.assembling(), limit);
        assert!(queued(&t).0 <= 2 * limit + 65, "{:?}", queued(&t));
        let newest = 200_000 + limit as u64;
        assert_eq!(t.message_from(newest, a, 1, "a", vec![]), Arrival::Released);
        assert_eq!(
            t.message_from(200_000, a, 1, "a", vec![]),
            Arrival::Counted,
            "the oldest was evicted: its message waits for data that came before"
        );
        t.forget_owner(a);
        assert_eq!(queued(&t), (0, 0));
    }

    #[test]
    fn bad_parameters_name_the_backend() {
        let params: BackendParams = [("n".to_string(), "x".to_string())].into();
        assert_eq!(param("B", &params, "m", 3u8).unwrap(), 3);
        let err = param::<u8>("B", &params, "n", 3).unwrap_err().to_string();
        assert!(err.contains("B parameter n=`x`"), "{err}");
    }
}

/// State (field 3) and start time (field 22) of `/proc/<pid>/stat`.
pub(crate) fn proc_state(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count after its end.
    let mut fields = stat.get(stat.rfind(')')? + 2..)?.split(' ');
    let state = fields.next()?.chars().next()?;
    Some((state, fields.nth(18)?.parse().ok()?))
}

/// The inode of the pid namespace of process `pid` (`"self"` for this one), as
/// `/proc/<pid>/ns/pid` names it: equal for two processes exactly when their pids are
/// numbers of one namespace. `None` where `/proc` does not say (another user's process
/// may hide it).
pub(crate) fn pid_namespace(pid: &str) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|m| m.ino())
}

/// A peer process on this host, named by its pid in this pid namespace and the start
/// time that tells a reused pid apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LocalProcess {
    pub(crate) pid: u32,
    pub(crate) start_time: u64,
}

impl LocalProcess {
    /// Whether the process still runs and may be scheduled: not gone, not a new process
    /// under the pid, not a zombie, not stopped (`SIGSTOP`, a tracer) — only then is its
    /// silence a matter of scheduling.
    /// It must also share this process's network namespace: a peer behind another
    /// namespace's link (a cut veth) is as far as another host.
    pub(crate) fn runs(&self) -> bool {
        let net_ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net")).ok();
        matches!(
            proc_state(self.pid),
            Some((state, start)) if start == self.start_time
                && matches!(state, 'R' | 'S' | 'D' | 'I' | 'W')
        ) && net_ns(&self.pid.to_string()).is_some_and(|ns| Some(ns) == net_ns("self"))
    }
}
