//! Operations a dead peer left unanswered in libfabric 1.17's `shm`, failed so that the
//! rail keeps moving.
//!
//! Over `shm` every operation larger than a command's inline data (RMA from 4 KiB,
//! through CMA or the peer's bounce buffers, and messages of that size) takes a slot in
//! the *sender's* response queue, in its own shared region; the peer writes the slot's
//! status once it has copied the data. The sender's progress reaps that queue strictly in
//! order: it stops at the first slot still unanswered, and also at a slot whose peer's
//! region lock it cannot take (`pthread_spin_trylock`). A peer killed before answering —
//! or while holding its own region lock, which it holds while it copies — so blocks every
//! later completion of the endpoint, to *any* peer, for good: after a peer was killed in
//! the middle of 16 MiB WRITEs, the first WRITE to its restarted incarnation stalled,
//! and so did every transfer to a second peer on that rail (`nixl/tests/restart_matrix.rs`).
//! The provider has no call that gives such an operation up (`fi_cancel` cancels
//! receives only; removing the peer's address leaves the queue as it is).
//!
//! So once the OS says that a peer's process ended (its pidfd or `/proc`; never on
//! heartbeats alone: a frozen peer may yet answer, into a slot that would by then belong
//! to another operation), [`settle`] does what the dead process would have done, for
//! every `shm` endpoint of this process (a rail's worker asks when jobs of that peer
//! have operations pending, a transfer to it when it is polled, and the peer's
//! addresses when they are let go):
//! - it releases the lock of each of the dead process's regions mapped here, if the
//!   process left it taken (it holds it while it copies);
//! - holding every endpoint's region lock, as the provider's progress holds its own, it
//!   writes `-ECONNRESET` into each slot of the response queues that is still unanswered
//!   and belongs to that peer (its index in the endpoint's peer table, found by its
//!   endpoint names), and wakes the endpoint's progress (`smr_signal`): the provider
//!   then completes those operations with that error, and what was queued behind them
//!   moves on;
//! - it empties the dead process's region files and removes them. The provider never
//!   unmaps a departed peer (the backend keeps departed peers in the AV, see
//!   `Rail::forget`), so the mappings would otherwise keep that memory (up to 16 MiB a
//!   region) for as long as the backend lives. The region lock of an emptied region is
//!   left free: in glibc's x86 spinlocks, 0 is a taken lock.
//!
//! This reaches into the provider's private layout (`include/ofi_shm.h` and
//! `prov/shm/src/smr.h` of libfabric 1.17.0 and 1.17.1, which lay it out alike; 1.18
//! keeps the version number and changes the layout), so it runs only where everything
//! checks: the runtime is 1.17, and each region of this process holds in its header the
//! values the provider itself wrote there (version 4, no debug layout, this pid, a
//! header of 128 bytes, the size of its mapping, its own name, offsets that follow from
//! each other as the provider computes them, the address it is mapped at); an
//! unanswered slot is touched only if the operation it names lies in this process's
//! writable memory and points back at that very slot. The dead process's regions, which
//! an address vector closing on another thread may unmap at any time, are read and
//! written through the kernel (`process_vm_readv`), never directly, and only if their
//! header names that process. Anything else is refused with the reason, logged, and the
//! rail left as the provider has it (transfers behind the dead peer's operations then
//! end at the stall timeout, as before).

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// The libfabric release whose `shm` layout this module knows.
const KNOWN_RELEASE: (u32, u32) = (1, 17);
/// Where the provider's regions live.
const SHM_DIR: &str = "/dev/shm/";

/// `struct smr_region` and what it points at (libfabric 1.17, non-debug build).
mod layout {
    /// `uint8_t version` (`SMR_VERSION`).
    pub(super) const VERSION: usize = 0;
    /// `uint16_t flags`.
    pub(super) const FLAGS: usize = 2;
    /// `int pid`: the owner's, written last when the region is set up.
    pub(super) const PID: usize = 4;
    /// `void *base_addr`: where the owner mapped the region.
    pub(super) const BASE_ADDR: usize = 16;
    /// `pthread_spinlock_t lock` (shared between processes).
    pub(super) const LOCK: usize = 24;
    /// `ofi_atomic32_t signal`: the owner's progress runs only once it is set (by the
    /// peers that answer or send, `smr_signal`).
    pub(super) const SIGNAL: usize = 28;
    /// `size_t total_size`.
    pub(super) const TOTAL_SIZE: usize = 40;
    /// `size_t cmd_queue_offset` (`sizeof(struct smr_region)` rounded up to 16).
    pub(super) const CMD_QUEUE: usize = 64;
    /// `size_t resp_queue_offset`.
    pub(super) const RESP_QUEUE: usize = 72;
    /// `size_t inject_pool_offset` (right after the response queue).
    pub(super) const INJECT_POOL: usize = 80;
    /// `size_t peer_data_offset`.
    pub(super) const PEER_DATA: usize = 96;
    /// `size_t name_offset` (right after the peer data).
    pub(super) const NAME: usize = 104;
    /// What `cmd_queue_offset` holds in this layout.
    pub(super) const HEADER_SIZE: u64 = 128;
    pub(super) const REGION_VERSION: u8 = 4;
    /// `SMR_FLAG_DEBUG`: a debug build lays `signal` out larger.
    pub(super) const FLAG_DEBUG: u16 = 1 << 1;
    /// `SMR_NAME_MAX`.
    pub(super) const NAME_MAX: usize = 256;
    /// `SMR_MAX_PEERS`.
    pub(super) const MAX_PEERS: usize = 256;
    /// `struct smr_peer_data`: `{ char name[256]; int64_t id; }`, `sar_status`,
    /// `name_sent`.
    pub(super) const PEER_DATA_SIZE: usize = 272;
    /// `OFI_DECLARE_CIRQUE`: `size`, `size_mask`, `rcnt`, `wcnt`, then the entries.
    pub(super) const QUEUE_HEADER: usize = 32;
    /// `struct smr_resp`: `msg_id` (the sender's `struct smr_tx_entry *`), `status`.
    pub(super) const RESP_SIZE: usize = 16;
    /// Statuses of a slot not answered yet: `FI_EBUSY`, `SMR_STATUS_SAR_FREE`,
    /// `SMR_STATUS_SAR_READY`.
    pub(super) const UNANSWERED: [u64; 3] = [16, 1025, 1026];
    /// `struct smr_tx_entry` begins with the 256-byte `struct smr_cmd`, whose header
    /// holds `op_src` (u16) at 20 and `src_data` (the slot's offset in the region) at 32;
    /// `int64_t peer_id` follows the command.
    pub(super) const TX_OP_SRC: usize = 20;
    pub(super) const TX_SRC_DATA: usize = 32;
    pub(super) const TX_PEER_ID: usize = 256;
    pub(super) const TX_LEN: usize = 264;
    /// `smr_src_iov` (CMA: nothing to give back), `smr_src_sar` (the peer's bounce
    /// buffers, which a dead peer no longer needs back).
    pub(super) const SRC_IOV: u16 = 2;
    pub(super) const SRC_SAR: u16 = 4;
}

/// One line of `/proc/self/maps`.
#[derive(Debug, Clone)]
struct Mapping {
    start: usize,
    end: usize,
    /// `rw-s`, `rw-p`, ...
    perms: String,
    inode: u64,
    path: String,
}

impl Mapping {
    /// The `/dev/shm` file this maps (without a `(deleted)` mark), if any.
    fn shm_name(&self) -> Option<&str> {
        let name = self.path.strip_prefix(SHM_DIR)?;
        Some(name.strip_suffix(" (deleted)").unwrap_or(name))
    }

    fn writable_private(&self) -> bool {
        self.perms.starts_with("rw") && self.perms.ends_with('p')
    }
}

fn mappings() -> Result<Vec<Mapping>, String> {
    let maps =
        std::fs::read_to_string("/proc/self/maps").map_err(|e| format!("/proc/self/maps: {e}"))?;
    Ok(maps.lines().filter_map(parse_mapping).collect())
}

fn parse_mapping(line: &str) -> Option<Mapping> {
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?.to_string();
    // offset, device, inode, then the path after padding.
    let inode = fields.nth(2)?.parse().ok()?;
    let path = fields.next().unwrap_or("").trim_start().to_string();
    Some(Mapping {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        perms,
        inode,
        path,
    })
}

/// An `shm` region mapped in this process whose header checked out.
#[derive(Debug)]
struct Region {
    base: usize,
    len: usize,
    name: String,
}

impl Region {
    /// The region mapped at `m`, if its header is the one libfabric 1.17 writes for a
    /// region of process `pid` named after its file (and, for this process's own
    /// regions, mapped where the header says).
    fn checked(m: &Mapping, pid: u32, own: bool) -> Result<Self, String> {
        use layout::*;
        let name = m.shm_name().ok_or("not an shm file")?.to_string();
        if !m.perms.starts_with("rw") || !m.perms.ends_with('s') {
            return Err(format!("{name}: not a shared writable mapping"));
        }
        let region = Region {
            base: m.start,
            len: m.end - m.start,
            name,
        };
        if region.len < HEADER_SIZE as usize {
            return Err(format!("{}: smaller than a region header", region.name));
        }
        let bad = |what: &str| Err(format!("{}: {what}", region.name));
        if region.u8_at(VERSION) != REGION_VERSION {
            return bad("not a version 4 region");
        }
        if region.u16_at(FLAGS) & FLAG_DEBUG != 0 {
            return bad("laid out by a debug build");
        }
        if region.u32_at(PID) != pid {
            return bad("another process's");
        }
        if region.u64_at(CMD_QUEUE) != HEADER_SIZE {
            return bad("header of another size");
        }
        if region.u64_at(TOTAL_SIZE) != region.len as u64 {
            return bad("size differs from its mapping");
        }
        if own && region.u64_at(BASE_ADDR) != region.base as u64 {
            return bad("mapped elsewhere than it says");
        }
        let (resp, inject) = (region.u64_at(RESP_QUEUE), region.u64_at(INJECT_POOL));
        let (peers, name_at) = (region.u64_at(PEER_DATA), region.u64_at(NAME));
        let within = |at: u64, n: u64| at.checked_add(n).is_some_and(|e| e <= region.len as u64);
        // Read as 0 where out of bounds (then refused below).
        let slots = region.u64_at(resp as usize);
        let fits = within(resp, QUEUE_HEADER as u64)
            && slots.is_power_of_two()
            && slots < 1 << 24
            && region.u64_at(resp as usize + 8) == slots - 1
            && inject == resp + QUEUE_HEADER as u64 + RESP_SIZE as u64 * slots
            && name_at == peers + (PEER_DATA_SIZE * MAX_PEERS) as u64
            && within(name_at, NAME_MAX as u64)
            && resp % 8 == 0
            && peers % 8 == 0;
        if !fits {
            return bad("offsets that do not follow from each other");
        }
        if region.c_str_at(name_at as usize) != region.name.as_bytes() {
            return bad("named otherwise inside");
        }
        Ok(region)
    }

    fn ptr(&self, at: usize) -> *mut u8 {
        (self.base + at) as *mut u8
    }

    fn u8_at(&self, at: usize) -> u8 {
        debug_assert!(at < self.len);
        // SAFETY: `at` lies inside the live shared mapping (checked by the caller).
        unsafe { (*self.ptr(at).cast::<AtomicU8>()).load(Ordering::Acquire) }
    }

    fn u16_at(&self, at: usize) -> u16 {
        debug_assert!(at + 2 <= self.len && at.is_multiple_of(2));
        // SAFETY: as in `u8_at`; aligned (offsets of the C struct).
        unsafe { self.ptr(at).cast::<u16>().read_volatile() }
    }

    fn u32_at(&self, at: usize) -> u32 {
        debug_assert!(at + 4 <= self.len && at.is_multiple_of(4));
        // SAFETY: as in `u16_at`.
        unsafe { (*self.ptr(at).cast::<AtomicI32>()).load(Ordering::Acquire) as u32 }
    }

    /// The word at `at`; 0 where `at` is out of bounds or unaligned (offsets read from
    /// the header are checked with it).
    fn u64_at(&self, at: usize) -> u64 {
        if !at.is_multiple_of(8) || at.checked_add(8).is_none_or(|end| end > self.len) {
            return 0;
        }
        // SAFETY: as in `u16_at`.
        unsafe { (*self.ptr(at).cast::<AtomicU64>()).load(Ordering::Acquire) }
    }

    /// The NUL-terminated string of at most [`layout::NAME_MAX`] bytes at `at`.
    fn c_str_at(&self, at: usize) -> Vec<u8> {
        (0..layout::NAME_MAX.min(self.len - at))
            .map(|i| self.u8_at(at + i))
            .take_while(|b| *b != 0)
            .collect()
    }

    fn lock(&self) -> *mut libc::pthread_spinlock_t {
        self.ptr(layout::LOCK).cast()
    }

    /// Takes the region's lock, trying for at most `patience`.
    fn try_lock_for(&self, patience: Duration) -> bool {
        let until = Instant::now() + patience;
        loop {
            // SAFETY: the lock lives in the checked header of the shared mapping,
            // initialised by the provider as a process-shared spinlock.
            if unsafe { libc::pthread_spin_trylock(self.lock()) } == 0 {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Wakes the owner's progress (`smr_signal`).
    fn signal(&self) {
        // SAFETY: the `signal` word in the checked header (a 32-bit atomic in a build
        // without debug layout).
        unsafe { (*self.ptr(layout::SIGNAL).cast::<AtomicI32>()).store(1, Ordering::Release) };
    }

    fn unlock(&self) {
        // SAFETY: taken by `try_lock_for` on this thread.
        unsafe { libc::pthread_spin_unlock(self.lock()) };
    }
}

/// This process's `shm` endpoints (their region names): a repair holds every one's
/// region lock, and an endpoint leaves the list (waiting for a repair under way) before
/// it closes, so that no repair reads a region the provider unmapped.
static ENDPOINTS: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// A rail's part in repairs: its endpoint, registered while it is open, and when each
/// ended process was last looked at from it.
#[derive(Debug)]
pub(super) struct Repairs {
    name: Vec<u8>,
    tried: Mutex<HashMap<u32, Instant>>,
    /// When the rail's worker last looked for jobs of ended peers ([`Repairs::scan_due`]).
    scanned: Mutex<Option<Instant>>,
}

/// How often a rail's worker looks for jobs whose peer's process ended (the OS is asked
/// at most this often anyway: `liveness::CHECK_PERIOD`).
const SCAN_PERIOD: Duration = Duration::from_micros(200);

/// How soon the operations of one ended process are looked for again from one rail
/// (some may have been posted from another thread just before it was seen ended).
const RETRY: Duration = Duration::from_millis(50);
/// How long an ended process is remembered.
const FORGET: Duration = Duration::from_secs(60);

impl Repairs {
    /// Registers the `shm` endpoint named `name` (as `fi_getname` gives it).
    pub(super) fn new(name: Vec<u8>) -> Self {
        let name = bare_name(&name).to_vec();
        ENDPOINTS.lock().push(name.clone());
        Self {
            name,
            tried: Mutex::new(HashMap::new()),
            scanned: Mutex::new(None),
        }
    }

    /// Whether the rail's worker should look for jobs of ended peers now: at most every
    /// [`SCAN_PERIOD`], so that a busy rail pays next to nothing for it.
    pub(super) fn scan_due(&self) -> bool {
        let now = Instant::now();
        let mut scanned = self.scanned.lock();
        if scanned.is_some_and(|at| now < at + SCAN_PERIOD) {
            return false;
        }
        *scanned = Some(now);
        true
    }

    /// Process `dead_pid` (known to have ended; its `shm` endpoints are `dead_names`)
    /// may have left operations of this process unanswered: they are failed (at most
    /// every [`RETRY`] per process from this rail), and its regions' memory is freed.
    pub(super) fn after_death(&self, dead_pid: u32, dead_names: &[Vec<u8>]) {
        let now = Instant::now();
        let first = {
            let mut tried = self.tried.lock();
            if tried.get(&dead_pid).is_some_and(|at| now < *at + RETRY) {
                return;
            }
            tried.retain(|_, at| now < *at + FORGET);
            tried.insert(dead_pid, now).is_none()
        };
        settle_logged(dead_pid, dead_names, first);
    }
}

impl Drop for Repairs {
    fn drop(&mut self) {
        // Waits for a repair under way (it holds the list's lock).
        let mut endpoints = ENDPOINTS.lock();
        if let Some(at) = endpoints.iter().position(|n| *n == self.name) {
            endpoints.swap_remove(at);
        }
    }
}

/// [`settle`], its outcome logged (a refusal as a warning the `first` time for this
/// process: transfers behind the operations it left end at the stall timeout).
pub(super) fn settle_logged(dead_pid: u32, dead_names: &[Vec<u8>], first: bool) {
    match settle(dead_pid, dead_names) {
        Ok(0) => {}
        Ok(n) => tracing::debug!(
            pid = dead_pid,
            operations = n,
            "shm: failed the operations an ended peer left unanswered"
        ),
        Err(why) if first => tracing::warn!(
            pid = dead_pid,
            "shm: the operations an ended peer left unanswered stay (transfers behind \
             them on its rails end at the stall timeout): {why}"
        ),
        Err(why) => tracing::debug!(pid = dead_pid, "shm: {why}"),
    }
}

/// For process `dead_pid`, which has ended, and whose `shm` endpoints were named
/// `dead_names`: releases its regions' locks if it left them taken, fails every
/// operation of this process's `shm` endpoints that it left unanswered (see the module
/// documentation), and frees its regions' memory (their files are emptied and removed:
/// the mappings this process keeps of them — the provider's peer table is never pruned
/// on `shm` — then hold no memory). Returns how many operations it failed; `Err` says
/// why none was (then no slot was touched and no file emptied; a lock the process left
/// taken may have been released).
pub(super) fn settle(dead_pid: u32, dead_names: &[Vec<u8>]) -> Result<usize, String> {
    let release = fabric::version();
    if release != KNOWN_RELEASE {
        return Err(format!(
            "libfabric {}.{}'s shm layout is not known here (only {}.{}'s)",
            release.0, release.1, KNOWN_RELEASE.0, KNOWN_RELEASE.1
        ));
    }
    let dead_names: Vec<&[u8]> = dead_names.iter().map(|n| bare_name(n)).collect();
    let endpoints = ENDPOINTS.lock();
    let maps = mappings()?;
    let me = std::process::id();
    let own: Vec<Region> = endpoints
        .iter()
        .filter_map(|name| {
            let name = std::str::from_utf8(name).ok()?;
            let m = maps
                .iter()
                .find(|m| m.shm_name() == Some(name) && m.perms.ends_with('s'))?;
            match Region::checked(m, me, true) {
                Ok(region) => Some(region),
                Err(why) => {
                    tracing::debug!("shm: own region left alone: {why}");
                    None
                }
            }
        })
        .collect();
    if own.is_empty() {
        return Err("no region of this process's shm endpoints checks out".into());
    }
    // The dead process's regions as mapped here (by this process's address vectors):
    // read and written through the kernel only, since an address vector closing on
    // another thread may unmap them at any time.
    let dead: Vec<&Mapping> = maps
        .iter()
        .filter(|m| {
            m.shm_name()
                .is_some_and(|n| dead_names.contains(&n.as_bytes()))
        })
        .collect();
    for m in &dead {
        release_lock_of_ended(m, dead_pid);
    }
    // Their indices in each endpoint's peer table: the peer data holds each peer's name.
    let ids: Vec<Vec<u64>> = own
        .iter()
        .map(|region| {
            let peers_at = region.u64_at(layout::PEER_DATA) as usize;
            (0..layout::MAX_PEERS)
                .filter(|id| {
                    let name = region.c_str_at(peers_at + id * layout::PEER_DATA_SIZE);
                    !name.is_empty() && dead_names.contains(&bare_name(&name))
                })
                .map(|id| id as u64)
                .collect()
        })
        .collect();
    let mut failed = 0;
    if ids.iter().any(|i| !i.is_empty()) {
        // Every endpoint's region lock, as the provider's progress takes its own: no
        // progress of this process reads a response queue (or a peer region) meanwhile.
        let mut locked = Vec::with_capacity(own.len());
        for region in &own {
            if !region.try_lock_for(Duration::from_millis(100)) {
                locked.iter().for_each(|r: &&Region| r.unlock());
                return Err(format!("{}: its lock stayed taken", region.name));
            }
            locked.push(region);
        }
        for (region, ids) in own.iter().zip(&ids) {
            let n = if ids.is_empty() {
                0
            } else {
                fail_slots(region, &maps, ids)
            };
            if n > 0 {
                failed += n;
                // As a peer that answers does: the endpoint's next progress reaps them.
                region.signal();
            }
        }
        locked.iter().for_each(|r| r.unlock());
    }
    drop(endpoints);
    for m in dead {
        free_region_file(m, dead_pid);
    }
    Ok(failed)
}

/// Reads `buf.len()` bytes of this process's memory at `at` through the kernel (an
/// unmapped address is an error, not a fault).
fn read_own(at: usize, buf: &mut [u8]) -> bool {
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: at as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: `local` covers `buf`; the kernel checks `remote` (this process's memory).
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    n == buf.len() as isize
}

/// Writes `bytes` into this process's memory at `at` through the kernel.
fn write_own(at: usize, bytes: &[u8]) -> bool {
    let local = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let remote = libc::iovec {
        iov_base: at as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: `local` covers `bytes`; the kernel checks `remote` (this process's memory).
    let n = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
    n == bytes.len() as isize
}

/// How long a dead process's region lock may stay taken before it counts as left taken
/// by that process: others take it for microseconds, to post one operation.
const LOCK_PATIENCE: Duration = Duration::from_millis(2);

/// Releases the region lock of the ended process `pid` mapped at `m`, if it left it
/// taken (it holds it while it copies); nobody else holds it for long, so a lock taken
/// for longer than [`LOCK_PATIENCE`] is its.
fn release_lock_of_ended(m: &Mapping, pid: u32) {
    let mut header = [0u8; layout::HEADER_SIZE as usize];
    // Its own header, or one emptied by whoever freed the file before (whose lock word
    // reads 0: taken, in glibc's x86 spinlocks).
    let is_its = |h: &[u8]| {
        h.iter().all(|b| *b == 0)
            || (h[layout::VERSION] == layout::REGION_VERSION
                && u32::from_ne_bytes(h[layout::PID..layout::PID + 4].try_into().expect("4"))
                    == pid)
    };
    let unlocked = spin_unlocked().to_ne_bytes();
    let until = Instant::now() + LOCK_PATIENCE;
    loop {
        if !read_own(m.start, &mut header) || !is_its(&header) {
            return;
        }
        if header[layout::LOCK..layout::LOCK + 4] == unlocked {
            return;
        }
        if Instant::now() >= until || header.iter().all(|b| *b == 0) {
            break;
        }
        std::thread::yield_now();
    }
    if write_own(m.start + layout::LOCK, &unlocked) {
        tracing::debug!(region = ?m.shm_name(), "shm: released the lock an ended process held");
    }
}

/// The value of an unlocked `pthread_spinlock_t` (glibc's x86 spinlocks count down from
/// 1: 0 is taken).
fn spin_unlocked() -> i32 {
    static UNLOCKED: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *UNLOCKED.get_or_init(|| {
        let mut lock: libc::pthread_spinlock_t = 0;
        // SAFETY: initialises a local spinlock (no resources are held by one).
        unsafe { libc::pthread_spin_init(&mut lock, libc::PTHREAD_PROCESS_SHARED) };
        lock
    })
}

/// Empties and removes the file of the ended process `pid`'s region mapped at `m`, if
/// it is still there and still that file (same inode, its header naming `pid` or
/// already emptied). Its memory then goes although mappings of it stay.
fn free_region_file(m: &Mapping, pid: u32) {
    let Some(name) = m.shm_name() else {
        return;
    };
    let path = format!("{SHM_DIR}{name}");
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
    else {
        return;
    };
    use std::os::unix::fs::MetadataExt;
    let same = file.metadata().is_ok_and(|md| md.ino() == m.inode);
    let mut head = [0u8; 8];
    let owner_ok = std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0).is_ok()
        && (head == [0; 8]
            || (head[layout::VERSION] == layout::REGION_VERSION
                && u32::from_ne_bytes(head[4..8].try_into().expect("4")) == pid));
    if !same || !owner_ok {
        return;
    }
    let punched = punch(&file);
    let removed = std::fs::remove_file(&path).is_ok();
    tracing::debug!(%path, punched, removed, "shm: freed the region of an ended process");
}

/// Zeroes the whole of `file` (a hole: its memory is freed, mappings of it stay valid and
/// read zeroes), but for the region lock of a region in the known layout, left free.
fn punch(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let len = file.metadata().map_or(0, |md| md.len()) as libc::off_t;
    let mut header = [0u8; layout::HEADER_SIZE as usize];
    let known = file.read_exact_at(&mut header, 0).is_ok()
        && fabric::version() == KNOWN_RELEASE
        && header[layout::VERSION] == layout::REGION_VERSION
        && u16::from_ne_bytes([header[layout::FLAGS], header[layout::FLAGS + 1]])
            & layout::FLAG_DEBUG
            == 0
        && header[layout::CMD_QUEUE..layout::CMD_QUEUE + 8] == layout::HEADER_SIZE.to_ne_bytes();
    // SAFETY: fallocate on an open descriptor; punching a hole only zeroes the file.
    let punched = len > 0
        && unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                len,
            )
        } == 0;
    // Zero is a taken lock (glibc's x86 spinlocks): whoever still maps the region and
    // reaps an operation to it must find it free.
    if punched && known {
        let _ = file.write_all_at(&spin_unlocked().to_ne_bytes(), layout::LOCK as u64);
    }
    punched
}

/// Empties the region file at `path` of a process known to have ended, before it is
/// removed: processes that had it as a peer keep mapping it, which would keep its memory
/// alive after its name is gone.
pub(super) fn empty_file(path: &std::path::Path) {
    if let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        punch(&file);
    }
}

/// Strips a provider address prefix (`fi_shm://`) and what follows a NUL.
fn bare_name(name: &[u8]) -> &[u8] {
    let name = name.split(|b| *b == 0).next().unwrap_or(name);
    match name.windows(3).position(|w| w == b"://") {
        Some(at) => &name[at + 3..],
        None => name,
    }
}

/// With `own`'s lock held: writes `-ECONNRESET` into every unanswered slot of its
/// response queue whose operation went to a peer of `ids`.
fn fail_slots(own: &Region, maps: &[Mapping], ids: &[u64]) -> usize {
    use layout::*;
    let queue = own.u64_at(RESP_QUEUE) as usize;
    let mask = own.u64_at(queue + 8);
    let (read, write) = (own.u64_at(queue + 16), own.u64_at(queue + 24));
    let mut failed = 0;
    for count in read..write.max(read) {
        let slot = queue + QUEUE_HEADER + (count & mask) as usize * RESP_SIZE;
        let status = own.u64_at(slot + 8);
        if !UNANSWERED.contains(&status) {
            continue;
        }
        let entry = own.u64_at(slot) as usize;
        // The operation record lies in this process's own writable memory, and its
        // command names this slot.
        let inside = entry.is_multiple_of(8)
            && maps.iter().any(|m| {
                m.writable_private() && m.start <= entry && entry.saturating_add(TX_LEN) <= m.end
            });
        if !inside {
            continue;
        }
        // SAFETY: `entry` and the TX_LEN bytes after it lie in a writable mapping of
        // this process (checked above); the provider's own record of the operation,
        // which its progress reads only under the region lock this thread holds.
        let (src_data, op_src, peer_id) = unsafe {
            (
                (entry as *const u8)
                    .add(TX_SRC_DATA)
                    .cast::<u64>()
                    .read_volatile(),
                (entry as *const u8)
                    .add(TX_OP_SRC)
                    .cast::<u16>()
                    .read_volatile(),
                (entry as *const u8)
                    .add(TX_PEER_ID)
                    .cast::<u64>()
                    .read_volatile(),
            )
        };
        if src_data != slot as u64 || !ids.contains(&peer_id) {
            continue;
        }
        match op_src {
            SRC_IOV => {}
            // The dead peer's bounce buffers need not come back: reaped as a CMA
            // operation, the slot only completes.
            SRC_SAR => {
                // SAFETY: as above.
                unsafe {
                    (entry as *mut u8)
                        .add(TX_OP_SRC)
                        .cast::<u16>()
                        .write_volatile(SRC_IOV)
                }
            }
            other => {
                tracing::debug!(
                    op_src = other,
                    "an unanswered shm operation of a kind left alone"
                );
                continue;
            }
        }
        let reset = (-i64::from(libc::ECONNRESET)) as u64;
        // SAFETY: the slot's status word in the checked queue of this process's region.
        unsafe { (*own.ptr(slot + 8).cast::<AtomicU64>()).store(reset, Ordering::Release) };
        failed += 1;
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_and_names_parse() {
        let m = parse_mapping(
            "7f0000000000-7f0001000000 rw-s 00000000 00:1a 1234      /dev/shm/nixl-1-2-ab:0:0 (deleted)",
        )
        .unwrap();
        assert_eq!(m.end - m.start, 1 << 24);
        assert_eq!(m.shm_name(), Some("nixl-1-2-ab:0:0"));
        assert_eq!(m.inode, 1234);
        assert!(!m.writable_private());
        let anon = parse_mapping("55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0 ").unwrap();
        assert!(anon.writable_private());
        assert_eq!(anon.shm_name(), None);
        assert_eq!(bare_name(b"fi_shm://x:0:0\0\0"), b"x:0:0");
        assert_eq!(bare_name(b"x:0:0"), b"x:0:0");
    }

    /// A region that is not laid out as libfabric 1.17's is refused, whatever it holds.
    #[test]
    fn foreign_shm_files_are_refused() {
        let path = format!("/dev/shm/nixl-orphans-test-{}", std::process::id());
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(1 << 16).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of the file, unmapped below.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                1 << 16,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        // SAFETY: writes inside the 64 KiB mapping.
        unsafe {
            let b = at.cast::<u8>();
            *b = layout::REGION_VERSION;
            b.add(layout::PID).cast::<u32>().write(std::process::id());
        }
        let maps = mappings().unwrap();
        let m = maps
            .iter()
            .find(|m| m.start == at as usize)
            .expect("the mapping is listed");
        let err = Region::checked(m, std::process::id(), true).unwrap_err();
        assert!(err.contains("header of another size"), "{err}");
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(at, 1 << 16) };
        std::fs::remove_file(&path).unwrap();
        // A process none of whose regions is mapped here: no operation is failed.
        assert!(matches!(
            settle(1, &[b"no-such-region".to_vec()]),
            Ok(0) | Err(_)
        ));
    }
}
