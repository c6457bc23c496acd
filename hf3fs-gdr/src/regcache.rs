//! A cache of memory registrations keyed by memory domain (host, or a GPU) and address
//! range, as 3FS's GDR manager keeps one (`AcceleratorMemoryRegionCache`): a lookup
//! finds any cached registration covering the range asked for, handles count their
//! users, and [`RegistrationCache::invalidate`] drops every registration overlapping
//! memory that is being freed.
//!
//! Two kinds of entries:
//! - **caller memory** ([`RegistrationCache::get_or_register`]): the cache keeps the
//!   registration until the range is invalidated — whoever frees the memory must call
//!   [`RegistrationCache::invalidate`] first;
//! - **owned memory** ([`RegistrationCache::get_or_register_owned`]): the entry holds
//!   the buffer (an `Arc`), so the memory cannot be freed while registered; the cache
//!   holds it weakly, and the registration and then the buffer go when the last handle
//!   does. Nothing stale can be found.
//!
//! The registration payload is generic (`R`): the RDMA manager
//! (`gdr::MemoryRegistrar`, feature `rdma`) stores memory regions, the unit
//! tests a counter.

use parking_lot::Mutex;
use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

/// Which address space a range lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MemoryDomain {
    /// Host virtual memory of this process.
    Host,
    /// Device memory of this GPU ordinal.
    Gpu(usize),
}

/// One cached registration.
#[derive(Debug)]
struct Entry<R> {
    domain: MemoryDomain,
    addr: u64,
    len: u64,
    value: R,
    users: AtomicUsize,
    invalidated: AtomicBool,
    /// The buffer an owned registration keeps alive; dropped after `value`.
    _owner: Option<Arc<dyn Any + Send + Sync>>,
}

impl<R> Entry<R> {
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.saturating_add(len) <= self.addr + self.len
    }
}

/// A counted reference to a cached registration: the registration lives at least as
/// long as any handle to it.
#[derive(Debug)]
pub struct Handle<R> {
    entry: Arc<Entry<R>>,
}

impl<R> Handle<R> {
    fn new(entry: Arc<Entry<R>>) -> Self {
        entry.users.fetch_add(1, Ordering::AcqRel);
        Self { entry }
    }

    /// The registration.
    pub fn value(&self) -> &R {
        &self.entry.value
    }

    /// The domain of the registered range.
    pub fn domain(&self) -> MemoryDomain {
        self.entry.domain
    }

    /// Start of the registered range (may lie before the range asked for).
    pub fn addr(&self) -> u64 {
        self.entry.addr
    }

    /// Length of the registered range.
    pub fn len(&self) -> u64 {
        self.entry.len
    }

    /// Whether the range is empty (never: empty ranges are refused).
    pub fn is_empty(&self) -> bool {
        self.entry.len == 0
    }

    /// Handles alive on this registration, this one included.
    pub fn users(&self) -> usize {
        self.entry.users.load(Ordering::Acquire)
    }

    /// Whether the range was invalidated: the cache no longer hands it out, and it is
    /// released when the last handle goes.
    pub fn is_invalidated(&self) -> bool {
        self.entry.invalidated.load(Ordering::Acquire)
    }

    /// Whether both handles name the same registration.
    pub fn same_registration(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.entry, &other.entry)
    }
}

impl<R> Clone for Handle<R> {
    fn clone(&self) -> Self {
        Self::new(self.entry.clone())
    }
}

impl<R> Drop for Handle<R> {
    fn drop(&mut self) {
        self.entry.users.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug)]
enum Cached<R> {
    /// Caller memory: kept until invalidated.
    Strong(Arc<Entry<R>>),
    /// Owned memory: alive while handles are.
    Weak(Weak<Entry<R>>),
}

impl<R> Cached<R> {
    fn get(&self) -> Option<Arc<Entry<R>>> {
        match self {
            Cached::Strong(e) => Some(e.clone()),
            Cached::Weak(w) => w.upgrade(),
        }
    }
}

/// What the cache counted ([`RegistrationCache::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups and registrations served by a cached registration.
    pub hits: u64,
    /// Registrations made because nothing cached covered the range.
    pub misses: u64,
    /// Registrations removed by [`RegistrationCache::invalidate`].
    pub invalidated: u64,
}

/// Key: domain, start, end (so overlapping ranges with one start coexist).
type Key = (MemoryDomain, u64, u64);

/// Registrations by domain and address range (see the module docs).
#[derive(Debug)]
pub struct RegistrationCache<R> {
    entries: Mutex<BTreeMap<Key, Cached<R>>>,
    hits: AtomicU64,
    misses: AtomicU64,
    invalidated: AtomicU64,
}

impl<R> Default for RegistrationCache<R> {
    fn default() -> Self {
        Self {
            entries: Mutex::default(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            invalidated: AtomicU64::new(0),
        }
    }
}

/// Why a range cannot be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid range {addr:#x}+{len}: {why}")]
pub struct RangeError {
    /// Start.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Why.
    pub why: &'static str,
}

impl From<RangeError> for crate::Error {
    fn from(e: RangeError) -> Self {
        crate::Error::InvalidArgument(e.to_string())
    }
}

fn check_range(addr: u64, len: u64) -> Result<(), RangeError> {
    if len == 0 {
        return Err(RangeError {
            addr,
            len,
            why: "empty",
        });
    }
    if addr.checked_add(len).is_none() {
        return Err(RangeError {
            addr,
            len,
            why: "wraps around the address space",
        });
    }
    Ok(())
}

impl<R> RegistrationCache<R> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    fn find(
        entries: &mut BTreeMap<Key, Cached<R>>,
        domain: MemoryDomain,
        addr: u64,
        len: u64,
    ) -> Option<Arc<Entry<R>>> {
        // Candidates start at or below `addr`; the nearest start first, since it is the
        // likeliest to cover. Dead weak entries met on the way are pruned.
        let mut dead = Vec::new();
        let mut found = None;
        for (key, cached) in entries
            .range((domain, 0, 0)..=(domain, addr, u64::MAX))
            .rev()
        {
            match cached.get() {
                Some(e) if e.covers(addr, len) => {
                    found = Some(e);
                    break;
                }
                Some(_) => {}
                None => dead.push(*key),
            }
        }
        for key in dead {
            entries.remove(&key);
        }
        found
    }

    /// A handle on a cached registration covering `[addr, addr + len)` of `domain`.
    pub fn lookup(&self, domain: MemoryDomain, addr: u64, len: u64) -> Option<Handle<R>> {
        check_range(addr, len).ok()?;
        let mut entries = self.entries.lock();
        let e = Self::find(&mut entries, domain, addr, len)?;
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(Handle::new(e))
    }

    /// A cached registration covering the range, or a new one made by `register` and
    /// kept until the range is invalidated (caller memory).
    pub fn get_or_register<E: From<RangeError>>(
        &self,
        domain: MemoryDomain,
        addr: u64,
        len: u64,
        register: impl FnOnce() -> Result<R, E>,
    ) -> Result<Handle<R>, E> {
        self.get_or_insert(domain, addr, len, None, register)
    }

    /// As [`Self::get_or_register`] for memory `owner` holds: a new registration keeps
    /// `owner` alive, and is released (then `owner`) with its last handle.
    pub fn get_or_register_owned<E: From<RangeError>>(
        &self,
        owner: Arc<dyn Any + Send + Sync>,
        domain: MemoryDomain,
        addr: u64,
        len: u64,
        register: impl FnOnce() -> Result<R, E>,
    ) -> Result<Handle<R>, E> {
        self.get_or_insert(domain, addr, len, Some(owner), register)
    }

    fn get_or_insert<E: From<RangeError>>(
        &self,
        domain: MemoryDomain,
        addr: u64,
        len: u64,
        owner: Option<Arc<dyn Any + Send + Sync>>,
        register: impl FnOnce() -> Result<R, E>,
    ) -> Result<Handle<R>, E> {
        check_range(addr, len)?;
        // Registration happens under the lock: two threads asking for one range make
        // one registration.
        let mut entries = self.entries.lock();
        if let Some(e) = Self::find(&mut entries, domain, addr, len) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(Handle::new(e));
        }
        let value = register()?;
        self.misses.fetch_add(1, Ordering::Relaxed);
        let owned = owner.is_some();
        let entry = Arc::new(Entry {
            domain,
            addr,
            len,
            value,
            users: AtomicUsize::new(0),
            invalidated: AtomicBool::new(false),
            _owner: owner,
        });
        let cached = if owned {
            Cached::Weak(Arc::downgrade(&entry))
        } else {
            Cached::Strong(entry.clone())
        };
        entries.insert((domain, addr, addr + len), cached);
        Ok(Handle::new(entry))
    }

    /// Drops from the cache every registration of `domain` overlapping
    /// `[addr, addr + len)` (call it before freeing that memory); returns how many.
    /// Handles still held keep their registration until dropped, marked invalidated.
    pub fn invalidate(&self, domain: MemoryDomain, addr: u64, len: u64) -> usize {
        if len == 0 {
            return 0;
        }
        let end = addr.saturating_add(len);
        let mut entries = self.entries.lock();
        let doomed: Vec<Key> = entries
            .range((domain, 0, 0)..(domain, end, 0))
            .filter(|((_, _, e_end), _)| *e_end > addr)
            .map(|(k, _)| *k)
            .collect();
        let mut removed = 0;
        for key in doomed {
            if let Some(e) = entries.remove(&key).and_then(|c| c.get()) {
                e.invalidated.store(true, Ordering::Release);
                removed += 1;
            }
        }
        self.invalidated
            .fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    /// Registrations cached now (owned ones whose handles are all gone excluded).
    pub fn len(&self) -> usize {
        let mut entries = self.entries.lock();
        entries.retain(|_, c| c.get().is_some());
        entries.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops cached caller-memory registrations that no handle uses; returns how many.
    pub fn release_unused(&self) -> usize {
        let mut entries = self.entries.lock();
        let before = entries.len();
        entries.retain(|_, c| c.get().is_some_and(|e| e.users.load(Ordering::Acquire) > 0));
        before - entries.len()
    }

    /// Hits, misses and invalidations so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            invalidated: self.invalidated.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A fake registration that counts its deregistrations.
    #[derive(Debug)]
    struct FakeMr {
        id: usize,
        deregistered: Arc<AtomicUsize>,
    }

    impl Drop for FakeMr {
        fn drop(&mut self) {
            self.deregistered.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[derive(Debug, PartialEq)]
    enum TestError {
        Range,
        Refused,
    }

    impl From<RangeError> for TestError {
        fn from(_: RangeError) -> Self {
            TestError::Range
        }
    }

    struct Fixture {
        cache: RegistrationCache<FakeMr>,
        made: AtomicUsize,
        dereg: Arc<AtomicUsize>,
    }

    impl Fixture {
        fn new() -> Self {
            Self {
                cache: RegistrationCache::new(),
                made: AtomicUsize::new(0),
                dereg: Arc::default(),
            }
        }

        fn register(&self, domain: MemoryDomain, addr: u64, len: u64) -> Handle<FakeMr> {
            self.cache
                .get_or_register(domain, addr, len, || Ok::<_, TestError>(self.mr()))
                .unwrap()
        }

        fn mr(&self) -> FakeMr {
            FakeMr {
                id: self.made.fetch_add(1, Ordering::SeqCst),
                deregistered: self.dereg.clone(),
            }
        }

        fn made(&self) -> usize {
            self.made.load(Ordering::SeqCst)
        }

        fn deregistered(&self) -> usize {
            self.dereg.load(Ordering::SeqCst)
        }
    }

    const H: MemoryDomain = MemoryDomain::Host;

    #[test]
    fn a_covering_registration_is_reused() {
        let f = Fixture::new();
        let big = f.register(H, 0x1000, 0x10000);
        // Inside it, at its start, at its end: the same registration.
        for (addr, len) in [
            (0x1000, 1),
            (0x2000, 0x100),
            (0x10fff, 1),
            (0x1000, 0x10000),
        ] {
            let h = f.register(H, addr, len);
            assert!(h.same_registration(&big), "{addr:#x}+{len:#x}");
            assert_eq!((h.addr(), h.len()), (0x1000, 0x10000));
        }
        assert_eq!(f.made(), 1);
        // Crossing either end, or in another domain: a new registration.
        f.register(H, 0xfff, 2);
        f.register(H, 0x10fff, 2);
        f.register(MemoryDomain::Gpu(0), 0x2000, 0x100);
        assert_eq!(f.made(), 4);
        assert_eq!(
            f.cache.stats(),
            CacheStats {
                hits: 4,
                misses: 4,
                invalidated: 0
            }
        );
    }

    #[test]
    fn lookups_find_a_covering_range_behind_a_nearer_one() {
        let f = Fixture::new();
        // A narrow range first, then a wide one around it (not covered: a new one).
        let narrow = f.register(H, 0x8000, 0x100);
        let wide = f.register(H, 0, 1 << 20);
        assert!(!narrow.same_registration(&wide));
        assert_eq!(f.made(), 2);
        // The nearest start below 0x9000 is the narrow range, which does not cover it.
        let got = f.cache.lookup(H, 0x9000, 0x1000).unwrap();
        assert!(got.same_registration(&wide));
        // Inside the narrow one either is right; the nearest start is taken.
        assert!(f
            .cache
            .lookup(H, 0x8010, 0x10)
            .unwrap()
            .same_registration(&narrow));
        assert!(f.cache.lookup(H, (1 << 20) - 1, 2).is_none());
        assert!(f.cache.lookup(MemoryDomain::Gpu(1), 0x9000, 1).is_none());
        assert!(f.cache.lookup(H, 5, 0).is_none());
    }

    #[test]
    fn overlapping_registrations_coexist_and_the_covering_one_is_found() {
        let f = Fixture::new();
        let a = f.register(H, 0x1000, 0x2000); // [0x1000, 0x3000)
        let b = f.register(H, 0x2000, 0x2000); // [0x2000, 0x4000): overlaps, not covered
        assert!(!a.same_registration(&b));
        assert!(f
            .cache
            .lookup(H, 0x1800, 0x100)
            .unwrap()
            .same_registration(&a));
        assert!(f
            .cache
            .lookup(H, 0x3800, 0x100)
            .unwrap()
            .same_registration(&b));
        // Both cover [0x2000, 0x2800): either is right; the nearest start is taken.
        assert!(f
            .cache
            .lookup(H, 0x2000, 0x800)
            .unwrap()
            .same_registration(&b));
        // Neither covers [0x1000, 0x4000).
        assert!(f.cache.lookup(H, 0x1000, 0x3000).is_none());
        assert_eq!(f.cache.len(), 2);
    }

    #[test]
    fn handles_count_users() {
        let f = Fixture::new();
        let h = f.register(H, 0x1000, 0x1000);
        assert_eq!(h.users(), 1);
        let h2 = h.clone();
        let h3 = f.cache.lookup(H, 0x1800, 8).unwrap();
        assert_eq!(h.users(), 3);
        drop(h2);
        drop(h3);
        assert_eq!(h.users(), 1);
        drop(h);
        // Caller memory stays cached without users, until released or invalidated.
        assert_eq!(f.cache.len(), 1);
        assert_eq!(f.deregistered(), 0);
        assert_eq!(f.cache.release_unused(), 1);
        assert_eq!(f.deregistered(), 1);
        assert!(f.cache.is_empty());
    }

    #[test]
    fn invalidation_removes_overlapping_ranges_only() {
        let f = Fixture::new();
        let _a = f.register(H, 0x0000, 0x1000); // [0, 0x1000)
        let b = f.register(H, 0x1000, 0x1000); // [0x1000, 0x2000)
        let c = f.register(H, 0x1800, 0x1000); // [0x1800, 0x2800)
        let _d = f.register(H, 0x3000, 0x1000); // [0x3000, 0x4000)
        let _g = f.register(MemoryDomain::Gpu(0), 0x1000, 0x1000);
        assert_eq!(f.made(), 5);
        // Freeing [0x1c00, 0x2000) touches b and c, not the neighbours or the GPU.
        assert_eq!(f.cache.invalidate(H, 0x1c00, 0x400), 2);
        assert!(b.is_invalidated() && c.is_invalidated());
        assert!(f.cache.lookup(H, 0x1000, 1).is_none());
        assert!(f.cache.lookup(H, 0x0, 0x1000).is_some());
        assert!(f.cache.lookup(H, 0x3000, 0x1000).is_some());
        assert!(f.cache.lookup(MemoryDomain::Gpu(0), 0x1000, 1).is_some());
        // Handles keep their registration until dropped: then it is deregistered.
        assert_eq!(f.deregistered(), 0);
        assert_eq!(b.value().id, 1);
        drop(b);
        drop(c);
        assert_eq!(f.deregistered(), 2);
        // The next registration of the range is a new one.
        f.register(H, 0x1000, 0x100);
        assert_eq!(f.made(), 6);
        // Touching exactly at an end is not overlapping.
        assert_eq!(f.cache.invalidate(H, 0x2000, 0x1000), 0);
        assert_eq!(f.cache.invalidate(H, 0x4000, 0x1000), 0);
        assert_eq!(f.cache.stats().invalidated, 2);
    }

    #[test]
    fn owned_memory_lives_with_its_handles() {
        let f = Fixture::new();
        let buffer = Arc::new(vec![0u8; 4096]);
        let addr = buffer.as_ptr() as u64;
        let h = f
            .cache
            .get_or_register_owned(buffer.clone(), H, addr, 4096, || Ok::<_, TestError>(f.mr()))
            .unwrap();
        let weak = Arc::downgrade(&buffer);
        drop(buffer);
        // The registration keeps the buffer: it cannot be freed while registered.
        assert!(weak.upgrade().is_some());
        let again = f.cache.lookup(H, addr + 100, 100).unwrap();
        assert!(again.same_registration(&h));
        drop(again);
        drop(h);
        // The last handle took the registration, then the buffer, with it.
        assert_eq!(f.deregistered(), 1);
        assert!(weak.upgrade().is_none());
        assert!(f.cache.lookup(H, addr, 1).is_none());
        assert!(f.cache.is_empty());
    }

    #[test]
    fn a_failed_registration_caches_nothing_and_bad_ranges_are_refused() {
        let f = Fixture::new();
        let err = f
            .cache
            .get_or_register(H, 0x1000, 0x1000, || Err::<FakeMr, _>(TestError::Refused))
            .unwrap_err();
        assert_eq!(err, TestError::Refused);
        assert!(f.cache.is_empty());
        for (addr, len) in [(0x1000, 0), (u64::MAX - 10, 100)] {
            let err = f
                .cache
                .get_or_register(H, addr, len, || Ok::<_, TestError>(f.mr()))
                .unwrap_err();
            assert_eq!(err, TestError::Range);
        }
        assert_eq!(f.made(), 0);
    }

    #[test]
    fn concurrent_requests_for_one_range_make_one_registration() {
        let f = Arc::new(Fixture::new());
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let h = f.register(H, 0x10000, 0x10000);
                    let inner = f.register(H, 0x10000 + i * 0x100, 0x100);
                    assert!(inner.same_registration(&h));
                    (h, inner)
                })
            })
            .map(|t| t.join().unwrap())
            .collect();
        assert_eq!(f.made(), 1);
        assert_eq!(handles[0].0.users(), 16);
    }
}
