//! The daemon's data path on the host side: registered files (a buffered and, where the
//! file system allows, an `O_DIRECT` descriptor of the same inode), and requests split
//! into chunks (the worker pool in `pool.rs` runs them).

use super::logging::daemon_error;
use super::memory::MappedIov;
use super::ring::RingCtx;
use super::stats::Stats;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

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
    pub(crate) slow: bool,
}

/// Files whose name ends so get the daemon's injected delay.
pub const SLOW_SUFFIX: &str = ".slow";

impl OpenFile {
    /// Wraps the descriptor the client passed; reopens the same inode with `O_DIRECT`
    /// through `/proc/self/fd` (a new open file description: the client's flags are
    /// untouched) where the file system supports it.
    ///
    /// Only a regular file opened for reading or writing is taken: an `O_PATH`
    /// descriptor carries no right to read or write, and reopening it through
    /// `/proc/self/fd` (with the daemon's credentials) would create one. The reopen uses
    /// exactly the client's access mode, and keeps `O_APPEND` (an append-only descriptor
    /// never becomes one that writes anywhere), so it never widens it.
    pub(crate) fn new(fd: OwnedFd, policy: DirectPolicy) -> Result<Self, i32> {
        // SAFETY: a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 || flags & libc::O_PATH != 0 {
            return Err(libc::EBADF);
        }
        // SAFETY: plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        let regular = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0
            && st.st_mode & libc::S_IFMT == libc::S_IFREG;
        if !regular {
            return Err(libc::EINVAL);
        }
        let acc = flags & (libc::O_ACCMODE | libc::O_APPEND);
        let path =
            std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("no NUL");
        // SAFETY: NUL-terminated path; the descriptor is owned below.
        let d = unsafe { libc::open(path.as_ptr(), acc | libc::O_DIRECT | libc::O_CLOEXEC) };
        // SAFETY: a new descriptor we own.
        let direct = (d >= 0).then(|| unsafe { OwnedFd::from_raw_fd(d) });
        let slow = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .is_ok_and(|p| p.to_string_lossy().ends_with(SLOW_SUFFIX));
        Ok(Self {
            buffered: fd,
            direct,
            policy,
            slow,
        })
    }
}

/// When the daemon uses `O_DIRECT` (always only for aligned offset, length and buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectPolicy {
    /// Reads of a range the page cache holds (at least half its pages, or any dirty
    /// one; asked with `cachestat`, or `mincore` on a mapping where the kernel lacks
    /// it) go through the cache at memory speed; the rest use `O_DIRECT`, which neither
    /// copies through the cache nor fills it. Writes use `O_DIRECT`.
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

/// Page-cache state of a file range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Residency {
    /// Pages of the range inside the file.
    pub pages: u64,
    /// Of those, pages in the page cache.
    pub cached: u64,
    /// Of those, dirty pages (0 where only `mincore` could tell).
    pub dirty: u64,
}

impl Residency {
    /// Whether the page cache should serve a read of the range: most of it is there
    /// (reading it again from the device would cost more than the copy), or some of it
    /// is dirty (`O_DIRECT` would first have to write it back).
    pub(crate) fn prefer_cache(&self) -> bool {
        self.dirty > 0 || (self.pages > 0 && self.cached * 2 >= self.pages)
    }
}

/// `cachestat(2)`'s number (Linux 6.5; the same on every architecture that has it).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const SYS_CACHESTAT: libc::c_long = 451;

/// Cleared once the kernel answers `ENOSYS` (older than 6.5): `mincore` from then on.
static CACHESTAT_WORKS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn cachestat(fd: libc::c_int, offset: u64, len: u64) -> Option<(u64, u64)> {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    if !CACHESTAT_WORKS.load(Ordering::Relaxed) {
        return None;
    }
    let range = Range { off: offset, len };
    let mut st = Stat::default();
    // SAFETY: cachestat(fd, &range, &stat, 0) reads `range` and writes `st`, both live
    // and laid out as in <linux/mman.h>.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            fd,
            &range as *const Range,
            &mut st as *mut Stat,
            0u32,
        )
    };
    if r != 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
            CACHESTAT_WORKS.store(false, Ordering::Relaxed);
        }
        return None;
    }
    Some((st.nr_cache, st.nr_dirty))
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn cachestat(_fd: libc::c_int, _offset: u64, _len: u64) -> Option<(u64, u64)> {
    None
}

/// Resident pages of `[offset, offset + len)` by `mincore` on a read-only mapping that
/// is never touched (no page is faulted in).
fn mincore_resident(fd: libc::c_int, offset: u64, len: u64) -> Option<u64> {
    // SAFETY: no arguments.
    let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as u64;
    let start = offset / page * page;
    let map_len = (offset + len - start).next_multiple_of(page) as usize;
    // SAFETY: a fresh read-only shared mapping of the file, unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            start as libc::off_t,
        )
    };
    if map == libc::MAP_FAILED {
        return None;
    }
    let mut vec = vec![0u8; map_len / page as usize];
    // SAFETY: `vec` has one byte per page of the mapping.
    let r = unsafe { libc::mincore(map, map_len, vec.as_mut_ptr()) };
    // SAFETY: mapped above, never used again.
    unsafe { libc::munmap(map, map_len) };
    (r == 0).then(|| vec.iter().filter(|b| **b & 1 != 0).count() as u64 * page / 4096)
}

/// How much of `[offset, offset + len)` of `fd` the page cache holds, in 4 KiB pages,
/// without reading anything (unlike a `RWF_NOWAIT` read, which starts readahead of
/// what is missing: a cold read would then fetch the range twice). `None` if the
/// kernel can tell neither way.
pub(crate) fn residency(fd: libc::c_int, offset: u64, len: u64) -> Option<Residency> {
    let range_pages = (offset + len).div_ceil(4096) - offset / 4096;
    let stat = cachestat(fd, offset, len);
    if let Some((_, dirty)) = stat.filter(|(cached, _)| *cached >= range_pages) {
        // All cached (the common case of a warm file): one system call.
        return Some(Residency {
            pages: range_pages,
            cached: range_pages,
            dirty,
        });
    }
    // Pages past the end of the file cannot be cached: count only those inside it.
    // SAFETY: plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    let end = (offset + len).min(st.st_size.max(0) as u64);
    if end <= offset {
        return Some(Residency {
            pages: 0,
            cached: 0,
            dirty: 0,
        });
    }
    let pages = end.div_ceil(4096) - offset / 4096;
    let (cached, dirty) = match stat {
        Some(c) => c,
        None => (mincore_resident(fd, offset, end - offset)?, 0),
    };
    Some(Residency {
        pages,
        cached: cached.min(pages),
        dirty,
    })
}

/// Whether [`file_io`] would read `[offset, offset + len)` of `file` through the page
/// cache (no `O_DIRECT` descriptor, policy `Never`, or `Auto` finding it cached).
pub(crate) fn cache_serves(file: &OpenFile, offset: u64, len: u64) -> bool {
    match (&file.direct, file.policy) {
        (None, _) | (_, DirectPolicy::Never) => true,
        (Some(_), DirectPolicy::Always) => false,
        (Some(_), DirectPolicy::Auto) => {
            residency(file.buffered.as_raw_fd(), offset, len).is_none_or(|r| r.prefer_cache())
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
    let aligned = offset.is_multiple_of(DIRECT_ALIGN)
        && len.is_multiple_of(DIRECT_ALIGN)
        && (ptr as u64).is_multiple_of(DIRECT_ALIGN);
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
            match residency(buffered, offset, len) {
                Some(r) if r.prefer_cache() => fd = buffered,
                Some(_) => {}
                None => {
                    // The kernel cannot tell: take what the cache holds, the rest direct.
                    // SAFETY: the caller's range.
                    let (cached, eof) = unsafe { cached_read(buffered, ptr, len, offset) };
                    if eof || cached == len {
                        stats.buffered_ops.fetch_add(1, Ordering::Relaxed);
                        return cached as i64;
                    }
                    done = cached;
                    if !done.is_multiple_of(DIRECT_ALIGN) {
                        fd = buffered;
                    }
                }
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
        if result < 0 {
            daemon_error!(
                "ring index {}: {} of {} bytes at file offset {} failed: {}",
                self.req.index,
                if self.read { "read" } else { "write" },
                self.len,
                self.file_offset,
                std::io::Error::from_raw_os_error((-result) as i32)
            );
        }
        self.req.chunk_done(self.start, self.len, result);
    }
}

/// Splits `[0, len)` of a request into pool chunks of at most `chunk` bytes.
pub(crate) fn split(req: &Arc<Request>, base: &Chunk, chunk: u64, out: &mut Vec<Chunk>) {
    let mut start = 0;
    while start < req.len {
        let len = chunk.min(req.len - start);
        out.push(Chunk {
            req: req.clone(),
            file: base.file.clone(),
            iov: base.iov.clone(),
            iov_offset: base.iov_offset + start,
            file_offset: base.file_offset + start,
            len,
            start,
            read: base.read,
        });
        start += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn evict(f: &std::fs::File) {
        f.sync_all().unwrap();
        // SAFETY: a valid descriptor; advice only.
        let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(r, 0);
    }

    #[test]
    fn passed_descriptors_keep_their_rights() {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, [1u8; 8192]).unwrap();
        // O_PATH: no right to read or write, and none is made by reopening it.
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: NUL-terminated path; owned below.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor we own.
        let o_path = unsafe { OwnedFd::from_raw_fd(fd) };
        assert_eq!(
            OpenFile::new(o_path, DirectPolicy::Always).err(),
            Some(libc::EBADF)
        );
        // Not a regular file.
        let d = std::fs::File::open(dir.path()).unwrap();
        assert_eq!(
            OpenFile::new(d.into(), DirectPolicy::Always).err(),
            Some(libc::EINVAL)
        );
        // The O_DIRECT copy has the client's access mode and O_APPEND.
        for (opts, mode) in [
            (
                std::fs::OpenOptions::new().read(true).clone(),
                libc::O_RDONLY,
            ),
            (
                std::fs::OpenOptions::new().append(true).clone(),
                libc::O_WRONLY | libc::O_APPEND,
            ),
        ] {
            let f = opts.open(&path).unwrap();
            let file = OpenFile::new(f.into(), DirectPolicy::Always).unwrap();
            if let Some(direct) = &file.direct {
                // SAFETY: a descriptor we own.
                let flags = unsafe { libc::fcntl(direct.as_raw_fd(), libc::F_GETFL) };
                assert_eq!(flags & (libc::O_ACCMODE | libc::O_APPEND), mode);
            }
        }
    }

    #[test]
    fn residency_counts_cached_pages_without_reading_any() {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        let path = dir.path().join("f");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        let fd = f.as_raw_fd();
        evict(&f);
        let cold = residency(fd, 0, 1 << 20).unwrap();
        assert_eq!((cold.pages, cold.cached, cold.dirty), (256, 0, 0));
        assert!(!cold.prefer_cache());
        // Asking twice reads nothing in.
        assert_eq!(residency(fd, 0, 1 << 20).unwrap().cached, 0);
        assert_eq!(mincore_resident(fd, 0, 1 << 20), Some(0));

        // The first 768 KiB read: cached, and both probes agree.
        let mut buf = vec![0u8; 768 << 10];
        (&f).read_exact(&mut buf).unwrap();
        let warm = residency(fd, 0, 1 << 20).unwrap();
        assert!(warm.cached >= 192 && warm.prefer_cache(), "{warm:?}");
        let by_mincore = mincore_resident(fd, 0, 1 << 20).unwrap();
        assert!(by_mincore >= 192, "mincore saw {by_mincore} pages");
        // A range past the end of the file has no pages; one crossing it counts only
        // its pages inside.
        assert_eq!(residency(fd, 2 << 20, 4096).unwrap().pages, 0);
        assert_eq!(residency(fd, 1020 << 10, 64 << 10).unwrap().pages, 1);
        // Dirty pages make the cache serve the read.
        let w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        evict(&w);
        // SAFETY: 4096 bytes from a live buffer at offset 0.
        let n = unsafe { libc::pwrite(w.as_raw_fd(), buf.as_ptr().cast(), 4096, 0) };
        assert_eq!(n, 4096);
        let dirty = residency(fd, 0, 1 << 20).unwrap();
        if CACHESTAT_WORKS.load(Ordering::Relaxed) {
            assert!(dirty.dirty >= 1 && dirty.prefer_cache(), "{dirty:?}");
        }
    }
}
