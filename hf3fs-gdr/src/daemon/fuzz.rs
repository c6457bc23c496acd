//! Entry points for the fuzzers (`hf3fs-gdr/fuzz`) and the stable mutation tests
//! (`tests/hostile_daemon.rs`): what a client can send the daemon — request messages
//! (with or without a descriptor) and ring entries — fed to the real request handler
//! and ring path of a daemon serving a scratch mount in this process. Each returns
//! whether the daemon's invariants held; a panic, a hang or a crash is a bug too.

use super::confine::{Admission, Dirs};
use super::pool::{Pool, WorkerConfig};
use super::stats::Stats;
use super::{DaemonConfig, Session, Shared};
use crate::proto::{Message, IOV_HOST, OP_ADD_IOR, OP_REG_FD, OP_REG_IOV, OP_STATS};
use crate::ring::{ior_size, RingHeader, RingView, Sqe, RING_MAGIC, RING_VERSION};
use crate::shm::{Id, Shm};
use crate::virt;
use parking_lot::Mutex;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Bytes of the iov and of the file a ring's entries may name.
const SCRATCH_BYTES: usize = 64 << 10;
/// The id the registered scratch iov has.
const SCRATCH_IOV: Id = [0xa5; 16];
/// Longest a fuzzed ring may take to complete its entries once the daemon has taken
/// every entry and has none in flight (a lost completion fails).
const RING_DEADLINE: Duration = Duration::from_secs(5);
/// Longest it may take at all. While the daemon still holds entries (not taken, or
/// dispatched and not posted), the wait goes on past [`RING_DEADLINE`] up to this: a
/// fuzzing process starved of CPU by other work (its threads not scheduled for
/// seconds) is slow, not wrong. A request the daemon drops without posting keeps
/// its ring's in-flight count up, so it still fails here.
const RING_HARD_DEADLINE: Duration = Duration::from_secs(60);

/// The daemon state shared by every input: a scratch mount under the temporary
/// directory (removed once its directories are open), one worker, chunks of 16 KiB (so
/// requests split).
fn shared() -> Option<&'static Arc<Shared>> {
    static SHARED: OnceLock<Option<Arc<Shared>>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let mount = std::env::temp_dir().join(format!("hf3fs-gdr-fuzz-{}", std::process::id()));
            std::fs::create_dir_all(&mount).ok()?;
            virt::ensure_dirs(&mount).ok()?;
            // SAFETY: no arguments.
            let daemon_uid = unsafe { libc::geteuid() };
            let mut config = DaemonConfig::with(&mount, 1, 1 << 20);
            config.chunk_bytes = 16 << 10;
            let dirs = Dirs::open(&mount, daemon_uid).ok()?;
            // Nothing here goes through the mount's path again (the directories are held
            // open), so it is removed at once rather than left behind by every run.
            let _ = std::fs::remove_dir_all(&mount);
            let shared = Arc::new(Shared {
                pool: Arc::new(Pool::default()),
                stats: Arc::new(Stats::default()),
                admission: Admission {
                    daemon_uid,
                    ..Admission::default()
                },
                dirs,
                owners: Mutex::default(),
                config,
            });
            let (pool, stats) = (shared.pool.clone(), shared.stats.clone());
            let worker = WorkerConfig {
                chunk_bytes: shared.config.chunk_bytes,
                slots: 1,
                copy_piece: 0,
                inject_delay: Duration::ZERO,
            };
            std::thread::Builder::new()
                .name("hf3fs-fuzz-io".into())
                .spawn(move || pool.work(worker, stats))
                .ok()?;
            Some(shared)
        })
        .as_ref()
}

fn session() -> Option<Arc<Session>> {
    // SAFETY: no arguments.
    let uid = unsafe { libc::geteuid() };
    Some(Session::new(shared()?.clone(), -1, uid))
}

/// A memfd holding `bytes` (at least `len` long), sealed against shrinking if `seal`.
fn memfd(bytes: &[u8], len: usize, seal: bool) -> Option<OwnedFd> {
    let seals = if seal {
        libc::F_SEAL_SHRINK | libc::F_SEAL_GROW
    } else {
        0
    };
    let shm = Shm::create_memfd("hf3fs-gdr-fuzz", len.max(bytes.len()).max(1), seals).ok()?;
    // SAFETY: the mapping has at least `bytes.len()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), shm.as_ptr(), bytes.len()) };
    shm.fd().try_clone_to_owned().ok()
}

/// A sequence of requests on one connection: each is `[flags][len][len bytes]`, where
/// flags bit 0 attaches a 64 KiB memfd holding the message's bytes after its op and id
/// (which the daemon ignores: so a ring header can be crafted) and bit 1 seals it. Every reply must be a value ≥ 0 or a −errno, with a
/// payload only for `OP_STATS`; the session is then released as if the client died.
pub fn fuzz_daemon_requests(data: &[u8]) -> bool {
    // A harness that cannot start fails loudly rather than passing every input.
    let Some(session) = session() else {
        return false;
    };
    let mut rest = data;
    let mut ok = true;
    while let [flags, len, tail @ ..] = rest {
        let len = (*len as usize).min(tail.len());
        let (msg, next) = tail.split_at(len);
        rest = next;
        let fds: Vec<OwnedFd> = if flags & 1 != 0 {
            memfd(msg.get(17..).unwrap_or(&[]), SCRATCH_BYTES, flags & 2 != 0)
                .into_iter()
                .collect()
        } else {
            Vec::new()
        };
        let (value, payload) = session.handle(msg, fds);
        let stats = msg.first() == Some(&OP_STATS);
        ok &= value > -4096 && (payload.is_empty() || (stats && payload.len() == 48));
    }
    session.release();
    ok
}

/// Ring entries as a client writes them: `data[0]` bit 0 says the ring reads (file to
/// iov), then up to 8 entries of 40 bytes each (iov offset, file offset, length,
/// userdata, file id — all little-endian, the id's low bit naming the registered file —
/// and the userdata's low bit naming the registered iov, else a foreign id). Every entry
/// must complete exactly once, within the deadline, with −errno or at most its length.
pub fn fuzz_ring_entries(data: &[u8]) -> bool {
    let Some((&mode, entries)) = data.split_first() else {
        return true;
    };
    let Some(session) = session() else {
        return false;
    };
    let ok = run_ring(&session, mode & 1 != 0, entries).unwrap_or(false);
    session.release();
    ok
}

/// The scratch file's bytes (made once: every input starts from the same file).
fn file_bytes() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| (0..SCRATCH_BYTES).map(|i| (i * 7 + 3) as u8).collect())
}

fn run_ring(session: &Arc<Session>, for_read: bool, data: &[u8]) -> Option<bool> {
    // A fresh file per input: writes at any offset grow it (sparse), which must not
    // carry over to the next input.
    let file = memfd(file_bytes(), SCRATCH_BYTES, false)?;
    let (file_id, _) = session.handle(&Message::new(OP_REG_FD).0, vec![file]);
    let iov = memfd(&[], SCRATCH_BYTES, false)?;
    let reg = Message::new(OP_REG_IOV).id(&SCRATCH_IOV).u8(IOV_HOST);
    if file_id <= 0 || session.handle(&reg.0, vec![iov]).0 != 0 {
        return None;
    }
    const ENTRIES: u32 = 8;
    let ring = Shm::create_sealed("hf3fs-gdr-fuzz-ring", ior_size(ENTRIES)).ok()?;
    let id: Id = [0x3c; 16];
    // SAFETY: fresh zeroed memory of ior_size(ENTRIES) bytes that nobody else maps yet.
    let view = unsafe {
        let h = ring.as_ptr() as *mut RingHeader;
        (*h).version = RING_VERSION;
        (*h).entries = ENTRIES;
        (*h).for_read = for_read as u32;
        (*h).id = id;
        (*h).magic = RING_MAGIC;
        RingView::new(ring.as_ptr(), ENTRIES)
    };
    let mut count = 0u64;
    for raw in data.chunks_exact(40).take(ENTRIES as usize) {
        let u = |i: usize| u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let userdata = u(3);
        let named_file = u(4) as u32;
        view.write_sqe(
            count,
            &Sqe {
                iov_id: if userdata & 1 != 0 {
                    SCRATCH_IOV
                } else {
                    [0x5a; 16]
                },
                iov_offset: u(0),
                file_offset: u(1),
                len: u(2),
                userdata,
                file_id: if named_file & 1 != 0 {
                    file_id as u32
                } else {
                    named_file
                },
                read: for_read as u32,
                _reserved: [0],
            },
        );
        count += 1;
    }
    let fd = ring.fd().try_clone_to_owned().ok()?;
    if session
        .handle(&Message::new(OP_ADD_IOR).id(&id).0, vec![fd])
        .0
        != 0
    {
        return Some(false);
    }
    let h = view.header();
    h.sq_submitted.0.store(count, Ordering::Release);
    h.sq_tail.0.store(count, Ordering::Release);
    // Rung as a client rings it (`ior.rs`): a wake without the increment is lost when
    // the ring thread is between reading the doorbell and sleeping on it.
    h.sq_doorbell.0.fetch_add(1, Ordering::SeqCst);
    crate::shm::futex_wake(&h.sq_doorbell.0);
    // Waits as a client does (`ior.rs`): asleep on the completion doorbell, which the
    // daemon rings after each completion and wakes when `client_sleeping` is set. (A
    // 100 us sleep per check made most of an input's time.)
    let start = Instant::now();
    loop {
        let bell = h.cq_doorbell.0.load(Ordering::SeqCst);
        h.client_sleeping.0.store(1, Ordering::SeqCst);
        if h.cq_tail.0.load(Ordering::SeqCst) >= count {
            h.client_sleeping.0.store(0, Ordering::SeqCst);
            break;
        }
        let waited = start.elapsed();
        if waited >= RING_HARD_DEADLINE {
            return Some(false);
        }
        if waited >= RING_DEADLINE {
            let inflight = session
                .rings
                .lock()
                .get(&id)
                .map_or(0, |r| r.ctx.inflight.load(Ordering::Acquire));
            // Every entry taken and every request posted (a post publishes its
            // completion before it leaves the in-flight count), yet completions missing.
            if h.sq_head.0.load(Ordering::Acquire) >= count
                && inflight == 0
                && h.cq_tail.0.load(Ordering::SeqCst) < count
            {
                return Some(false);
            }
        }
        crate::shm::futex_wait(&h.cq_doorbell.0, bell, Duration::from_millis(10));
        h.client_sleeping.0.store(0, Ordering::SeqCst);
    }
    let mut ok = h.cq_tail.0.load(Ordering::Acquire) == count;
    let mut seen = [false; ENTRIES as usize];
    for seq in 0..count {
        let cqe = view.read_cqe(seq);
        let Some(slot) = seen.get_mut(cqe.index as usize) else {
            return Some(false);
        };
        let sqe = view.read_sqe(cqe.index as u64);
        ok &= !*slot && cqe.userdata == sqe.userdata;
        ok &= cqe.result > -4096 && (cqe.result < 0 || cqe.result as u64 <= sqe.len);
        *slot = true;
    }
    drop(ring);
    Some(ok)
}
