//! The daemon's data path on the host side: registered files (a buffered and, where the
//! file system allows, an `O_DIRECT` descriptor of the same inode), requests split into
//! chunks, and the worker pool that runs them.

use super::gpu::Staging;
use super::ring::RingCtx;
use super::{MappedIov, Stats};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Alignment `O_DIRECT` needs of offset, length and buffer (a safe bound for every
/// logical block size in use).
pub(crate) const DIRECT_ALIGN: u64 = 4096;

/// A file a client registered.
#[derive(Debug)]
pub(crate) struct OpenFile {
    buffered: OwnedFd,
    direct: Option<OwnedFd>,
    policy: DirectPolicy,
    /// Whether its name ends in [`SLOW_SUFFIX`] (fault injection, see
    /// [`super::DaemonConfig::inject_delay`]).
    slow: bool,
}

/// Files whose name ends so get the daemon's injected delay.
pub const SLOW_SUFFIX: &str = ".slow";

impl OpenFile {
    /// Wraps the descriptor the client passed; reopens the same inode with `O_DIRECT`
    /// through `/proc/self/fd` (a new open file description: the client's flags are
    /// untouched) where the file system supports it.
    pub(crate) fn new(fd: OwnedFd, policy: DirectPolicy) -> Self {
        // SAFETY: a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        // SAFETY: plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        let regular = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0
            && st.st_mode & libc::S_IFMT == libc::S_IFREG;
        let direct = (flags >= 0 && regular)
            .then(|| {
                let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                    .expect("no NUL");
                let acc = flags & libc::O_ACCMODE;
                // SAFETY: NUL-terminated path; the descriptor is owned below.
                let d =
                    unsafe { libc::open(path.as_ptr(), acc | libc::O_DIRECT | libc::O_CLOEXEC) };
                // SAFETY: a new descriptor we own.
                (d >= 0).then(|| unsafe { OwnedFd::from_raw_fd(d) })
            })
            .flatten();
        let slow = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .is_ok_and(|p| p.to_string_lossy().ends_with(SLOW_SUFFIX));
        Self {
            buffered: fd,
            direct,
            policy,
            slow,
        }
    }
}

/// When the daemon uses `O_DIRECT` (always only for aligned offset, length and buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectPolicy {
    /// Reads take what the page cache holds (`preadv2` with `RWF_NOWAIT`) and the rest
    /// with `O_DIRECT`: cached files at memory speed, cold ones without the cache's
    /// copy. Writes use `O_DIRECT`.
    #[default]
    Auto,
    /// `O_DIRECT` for every aligned request.
    Always,
    /// The page cache only.
    Never,
}

impl std::str::FromStr for DirectPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "always" => Ok(Self::Always),
            "never" => Ok(Self::Never),
            other => Err(format!("direct policy {other:?} (auto, always or never)")),
        }
    }
}

/// Reads from the page cache only, until it lacks data: (bytes read, end of file).
///
/// # Safety
/// `[ptr, ptr + len)` is valid writable memory.
unsafe fn cached_read(fd: libc::c_int, ptr: *mut u8, len: u64, offset: u64) -> (u64, bool) {
    let mut done = 0u64;
    while done < len {
        let iov = libc::iovec {
            // SAFETY: inside the caller's range.
            iov_base: unsafe { ptr.add(done as usize) }.cast(),
            iov_len: (len - done) as usize,
        };
        // SAFETY: one iovec over the caller's memory.
        let n = unsafe {
            libc::preadv2(
                fd,
                &iov,
                1,
                (offset + done) as libc::off_t,
                libc::RWF_NOWAIT,
            )
        };
        match n {
            0 => return (done, true),
            n if n > 0 => done += n as u64,
            _ if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
            // EAGAIN: not cached; EOPNOTSUPP: no RWF_NOWAIT here. The caller reads on.
            _ => break,
        }
    }
    (done, false)
}

/// Reads (`read`) `len` bytes of `file` at `offset` into `ptr`, or writes them from it:
/// bytes moved (short only at end of file) or −errno, by the file's [`DirectPolicy`].
///
/// # Safety
/// `[ptr, ptr + len)` is valid memory of this process for the whole call.
pub(crate) unsafe fn file_io(
    file: &OpenFile,
    ptr: *mut u8,
    len: u64,
    offset: u64,
    read: bool,
    stats: &Stats,
) -> i64 {
    let aligned =
        offset % DIRECT_ALIGN == 0 && len % DIRECT_ALIGN == 0 && (ptr as u64) % DIRECT_ALIGN == 0;
    let buffered = file.buffered.as_raw_fd();
    let direct = file
        .direct
        .as_ref()
        .filter(|_| aligned && file.policy != DirectPolicy::Never)
        .map(|d| d.as_raw_fd());
    let mut done = 0u64;
    let mut fd = buffered;
    if let Some(direct) = direct {
        fd = direct;
        if read && file.policy == DirectPolicy::Auto {
            // SAFETY: the caller's range.
            let (cached, eof) = unsafe { cached_read(buffered, ptr, len, offset) };
            if eof || cached == len {
                stats.buffered_ops.fetch_add(1, Ordering::Relaxed);
                return cached as i64;
            }
            done = cached;
            if done % DIRECT_ALIGN != 0 {
                fd = buffered;
            }
        }
    }
    while done < len {
        let rest = (len - done) as usize;
        // SAFETY: inside the caller's range.
        let p = unsafe { ptr.add(done as usize) };
        let off = (offset + done) as libc::off_t;
        // SAFETY: `p` has `rest` valid bytes (caller's contract).
        let n = unsafe {
            if read {
                libc::pread(fd, p.cast(), rest, off)
            } else {
                libc::pwrite(fd, p.cast(), rest, off)
            }
        };
        if n < 0 {
            let errno = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            if errno == libc::EINTR {
                continue;
            }
            if errno == libc::EINVAL && fd != buffered {
                // The file system refused this O_DIRECT request: the page cache serves it.
                fd = buffered;
                continue;
            }
            return -(errno as i64);
        }
        if n == 0 {
            break;
        }
        done += n as u64;
    }
    if fd == buffered {
        stats.buffered_ops.fetch_add(1, Ordering::Relaxed);
    } else {
        stats.direct_ops.fetch_add(1, Ordering::Relaxed);
    }
    done as i64
}

/// One I/O of a ring: done when all its chunks are.
#[derive(Debug)]
pub(crate) struct Request {
    pub ring: Arc<RingCtx>,
    pub index: i32,
    pub userdata: u64,
    pub len: u64,
    remaining: AtomicU64,
    /// The smallest request offset at which a chunk came up short (end of file).
    short_at: AtomicU64,
    /// The first −errno, 0 if none.
    error: AtomicI64,
}

impl Request {
    pub(crate) fn new(
        ring: Arc<RingCtx>,
        index: i32,
        userdata: u64,
        len: u64,
        chunks: u64,
    ) -> Arc<Self> {
        ring.inflight.fetch_add(1, Ordering::AcqRel);
        Arc::new(Self {
            ring,
            index,
            userdata,
            len,
            remaining: AtomicU64::new(chunks),
            short_at: AtomicU64::new(u64::MAX),
            error: AtomicI64::new(0),
        })
    }

    /// Records a chunk of `len` bytes at `start` (request offset) that moved `result`
    /// bytes or failed with −errno; the last chunk posts the completion.
    pub(crate) fn chunk_done(&self, start: u64, len: u64, result: i64) {
        if result < 0 {
            let _ = self
                .error
                .compare_exchange(0, result, Ordering::AcqRel, Ordering::Acquire);
        } else if (result as u64) < len {
            self.short_at
                .fetch_min(start + result as u64, Ordering::AcqRel);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let error = self.error.load(Ordering::Acquire);
            let result = if error < 0 {
                error
            } else {
                self.len.min(self.short_at.load(Ordering::Acquire)) as i64
            };
            self.ring.post(self.index, result, self.userdata);
        }
    }
}

/// A piece of a request a worker runs on its own.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub req: Arc<Request>,
    pub file: Arc<OpenFile>,
    pub iov: Arc<MappedIov>,
    /// Offset in the iov.
    pub iov_offset: u64,
    pub file_offset: u64,
    pub len: u64,
    /// Offset in the request.
    pub start: u64,
    pub read: bool,
}

impl Chunk {
    pub(crate) fn finish(self, result: i64) {
        self.req.chunk_done(self.start, self.len, result);
    }
}

/// The worker threads and their queue.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    queue: Mutex<VecDeque<Chunk>>,
    ready: Condvar,
}

impl Pool {
    pub(crate) fn push(&self, chunks: impl IntoIterator<Item = Chunk>) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let before = q.len();
        q.extend(chunks);
        let added = q.len() - before;
        drop(q);
        if added == 1 {
            self.ready.notify_one();
        } else if added > 1 {
            self.ready.notify_all();
        }
    }

    /// A worker's loop: runs chunks; when the queue is empty, first finishes the device
    /// copies it left in flight, then sleeps.
    pub(crate) fn work(
        self: Arc<Self>,
        chunk_bytes: usize,
        slots: usize,
        inject_delay: Duration,
        stats: Arc<Stats>,
    ) {
        let mut staging: HashMap<usize, Staging> = HashMap::new();
        loop {
            let next = {
                let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(c) = q.pop_front() {
                        break Some(c);
                    }
                    if staging.values().any(Staging::has_pending) {
                        break None;
                    }
                    q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let Some(chunk) = next else {
                staging.values_mut().for_each(|s| s.flush(Some(&stats)));
                continue;
            };
            if chunk.file.slow && !inject_delay.is_zero() {
                let start = Instant::now();
                while start.elapsed() < inject_delay && !chunk.req.ring.cancelled() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            if chunk.req.ring.cancelled() {
                chunk.finish(-(libc::ECANCELED as i64));
                continue;
            }
            match &*chunk.iov {
                MappedIov::Host { shm } => {
                    // SAFETY: the ring thread checked iov_offset + len against the
                    // mapping, which the chunk keeps alive.
                    let ptr = unsafe { shm.as_ptr().add(chunk.iov_offset as usize) };
                    // SAFETY: `ptr..ptr+len` is inside the mapping (above).
                    let result = unsafe {
                        file_io(
                            &chunk.file,
                            ptr,
                            chunk.len,
                            chunk.file_offset,
                            chunk.read,
                            &stats,
                        )
                    };
                    if result > 0 {
                        stats.host_bytes.fetch_add(result as u64, Ordering::Relaxed);
                    }
                    chunk.finish(result);
                }
                MappedIov::Gpu { gpu, .. } => {
                    let device = gpu.ordinal();
                    if let std::collections::hash_map::Entry::Vacant(e) = staging.entry(device) {
                        match Staging::new(gpu.clone(), chunk_bytes, slots) {
                            Ok(s) => {
                                e.insert(s);
                            }
                            Err(err) => {
                                tracing::error!("staging on GPU {device}: {err}");
                                chunk.finish(-(libc::ENOMEM as i64));
                                continue;
                            }
                        }
                    }
                    staging
                        .get_mut(&device)
                        .expect("inserted above")
                        .run(chunk, &stats);
                }
            }
        }
    }
}
