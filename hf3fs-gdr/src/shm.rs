//! POSIX shared memory segments (`/dev/shm` files mapped `MAP_SHARED`), ids, and the
//! futex words that rings sleep on.

use crate::error::{os_err, Error, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Where POSIX shared memory lives on Linux.
pub(crate) const SHM_DIR: &str = "/dev/shm";

/// A 16-byte id (3FS names iovs and rings by a UUID).
pub type Id = [u8; 16];

/// A random version-4 UUID.
pub(crate) fn random_id() -> Result<Id> {
    let mut id = [0u8; 16];
    let mut filled = 0;
    while filled < id.len() {
        // SAFETY: writes at most `len - filled` bytes into the array's tail.
        let n = unsafe { libc::getrandom(id[filled..].as_mut_ptr().cast(), id.len() - filled, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(os_err("getrandom", e, "16 bytes"));
        }
        filled += n as usize;
    }
    id[6] = (id[6] & 0x0f) | 0x40;
    id[8] = (id[8] & 0x3f) | 0x80;
    Ok(id)
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Bytes from hex (even length, `[0-9a-fA-F]`).
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// An id from its 32 hex digits.
pub fn id_from_hex(s: &str) -> Option<Id> {
    from_hex(s)?.try_into().ok()
}

/// A shared mapping of a `/dev/shm` file; unmapped on drop (the file is unlinked only by
/// [`Shm::unlink`]).
#[derive(Debug)]
pub(crate) struct Shm {
    ptr: *mut u8,
    len: usize,
    path: PathBuf,
    /// The open file (kept so it can be passed to the daemon with `SCM_RIGHTS`).
    fd: OwnedFd,
    /// Whether `path` names a file to remove on [`Shm::unlink`] (false for a memfd).
    named: bool,
}

// SAFETY: the mapping is plain shared memory; every access goes through raw pointers or
// atomics whose users synchronise (rings use acquire/release sequence numbers).
unsafe impl Send for Shm {}
// SAFETY: as above.
unsafe impl Sync for Shm {}

impl Shm {
    /// Creates `/dev/shm/<name>` (exclusively, mode 0600) of `len` bytes, zero filled.
    pub(crate) fn create(name: &str, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a shared memory segment of 0 bytes".into(),
            ));
        }
        let path = Path::new(SHM_DIR).join(name);
        let fd = open_path(&path, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600)?;
        // SAFETY: a valid descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } < 0 {
            let e = std::io::Error::last_os_error();
            let _ = std::fs::remove_file(&path);
            return Err(os_err("ftruncate", e, path.display()));
        }
        match map(&fd, len, &path) {
            Ok(ptr) => Ok(Self {
                ptr,
                len,
                path,
                fd,
                named: true,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Maps an existing shared memory file (at least `min_len` bytes; all of it is
    /// mapped).
    pub(crate) fn open(path: &Path, min_len: usize) -> Result<Self> {
        // O_NOFOLLOW: the last component is never a symlink someone planted.
        let fd = open_path(path, libc::O_RDWR | libc::O_NOFOLLOW, 0)?;
        Self::from_fd(fd, min_len, path)
    }

    /// Maps all of an open regular file of at least `min_len` bytes, read-write and
    /// shared (the descriptor must be open for reading and writing: the kernel refuses
    /// a writable shared mapping of anything else, so access is never widened).
    pub(crate) fn from_fd(fd: OwnedFd, min_len: usize, label: &Path) -> Result<Self> {
        let st = fstat(&fd, label)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(Error::InvalidArgument(format!(
                "{} is not a regular file",
                label.display()
            )));
        }
        let len = st.st_size as usize;
        if len < min_len.max(1) {
            return Err(Error::InvalidArgument(format!(
                "{} has {len} bytes, fewer than the {min_len} asked for",
                label.display()
            )));
        }
        let ptr = map(&fd, len, label)?;
        Ok(Self {
            ptr,
            len,
            path: label.to_path_buf(),
            fd,
            named: true,
        })
    }

    /// Creates an anonymous memory file (`memfd`) of `len` bytes, zero filled, sealed
    /// against shrinking and growing: a process it is passed to (the daemon, for a ring)
    /// can map it knowing that nobody can truncate it under the mapping (which would
    /// turn its accesses into `SIGBUS`).
    pub(crate) fn create_sealed(name: &str, len: usize) -> Result<Self> {
        Self::create_memfd(
            name,
            len,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    }

    /// A memfd of `len` bytes with `seals` added (none if 0).
    pub(crate) fn create_memfd(name: &str, len: usize, seals: libc::c_int) -> Result<Self> {
        let label = PathBuf::from(format!("memfd:{name}"));
        let c = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("memfd name {name:?} contains NUL")))?;
        // SAFETY: NUL-terminated name; the returned descriptor is owned below.
        let fd =
            unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(os_err(
                "memfd_create",
                std::io::Error::last_os_error(),
                label.display(),
            ));
        }
        // SAFETY: a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a valid descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } < 0 {
            return Err(os_err(
                "ftruncate",
                std::io::Error::last_os_error(),
                label.display(),
            ));
        }
        // SAFETY: a memfd created with MFD_ALLOW_SEALING.
        if seals != 0 && unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(os_err(
                "fcntl(F_ADD_SEALS)",
                std::io::Error::last_os_error(),
                label.display(),
            ));
        }
        let ptr = map(&fd, len, &label)?;
        Ok(Self {
            ptr,
            len,
            path: label,
            fd,
            named: false,
        })
    }

    /// The open file.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the file (the mapping stays valid until dropped).
    pub(crate) fn unlink(&self) -> Result<()> {
        if !self.named {
            return Ok(());
        }
        remove_if_present(&self.path)
    }

    /// Binds the pages to NUMA node `numa` (preferred, so allocation still succeeds when
    /// the node is full); negative means no binding.
    pub(crate) fn prefer_numa(&self, numa: i32) -> Result<()> {
        if numa < 0 {
            return Ok(());
        }
        if numa >= 64 {
            return Err(Error::InvalidArgument(format!(
                "NUMA node {numa} (at most 63)"
            )));
        }
        const MPOL_PREFERRED: libc::c_long = 1;
        let mask: libc::c_ulong = 1 << numa;
        // SAFETY: the range is this mapping; the mask is one word of 64 bits.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.ptr,
                self.len,
                MPOL_PREFERRED,
                &mask as *const libc::c_ulong,
                64 as libc::c_ulong,
                0 as libc::c_uint,
            )
        };
        if ret < 0 {
            return Err(os_err(
                "mbind",
                std::io::Error::last_os_error(),
                format!("NUMA node {numa}"),
            ));
        }
        Ok(())
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        // SAFETY: mapped by `map` with exactly this length, unmapped once.
        if unsafe { libc::munmap(self.ptr.cast(), self.len) } < 0 {
            tracing::warn!(
                "munmap of {}: {}",
                self.path.display(),
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Opens a `/dev/shm` segment read-write with this process's own rights, never
/// through a symlink in its last component (to pass to the daemon).
pub(crate) fn open_segment(path: &Path) -> Result<OwnedFd> {
    open_path(path, libc::O_RDWR | libc::O_NOFOLLOW, 0)
}

fn open_path(path: &Path, flags: libc::c_int, mode: libc::mode_t) -> Result<OwnedFd> {
    let c = cstring(path)?;
    // SAFETY: NUL-terminated path; the returned descriptor is owned below.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC, mode as libc::c_uint) };
    if fd < 0 {
        return Err(os_err(
            "open",
            std::io::Error::last_os_error(),
            path.display(),
        ));
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fstat` of an open descriptor.
pub(crate) fn fstat(fd: &impl AsRawFd, label: &Path) -> Result<libc::stat> {
    // SAFETY: plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; an invalid descriptor is reported as EBADF.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(os_err(
            "fstat",
            std::io::Error::last_os_error(),
            label.display(),
        ));
    }
    Ok(st)
}

fn map(fd: &OwnedFd, len: usize, path: &Path) -> Result<*mut u8> {
    // SAFETY: a fresh shared mapping of a descriptor we hold; the kernel picks the address.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(os_err(
            "mmap",
            std::io::Error::last_os_error(),
            path.display(),
        ));
    }
    Ok(ptr.cast())
}

pub(crate) fn cstring(path: &Path) -> Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidArgument(format!("path {} contains NUL", path.display())))
}

/// Removes a file or symlink; one that is already gone is fine.
pub(crate) fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(os_err("unlink", e, path.display())),
    }
}

/// Sleeps while `*word == expected`, at most `timeout` (a shared, not process-private,
/// futex: the word lives in memory mapped by two processes).
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the word is a live, aligned u32; the timeout is relative. EAGAIN (value
    // changed), EINTR and ETIMEDOUT all just return to the caller's loop.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every sleeper on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: the word is a live, aligned u32.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_random_v4_and_hex_round_trips() {
        let a = random_id().unwrap();
        let b = random_id().unwrap();
        assert_ne!(a, b);
        assert_eq!(a[6] >> 4, 4);
        let h = to_hex(&a);
        assert_eq!(h.len(), 32);
        assert_eq!(id_from_hex(&h), Some(a));
        assert_eq!(id_from_hex("zz"), None);
        assert_eq!(from_hex("abc"), None);
    }

    #[test]
    fn shm_create_open_unlink() {
        let name = format!("hf3fs-gdr-test-{}", to_hex(&random_id().unwrap()));
        let a = Shm::create(&name, 8192).unwrap();
        // SAFETY: inside the 8192-byte mapping.
        unsafe { a.as_ptr().add(100).write(42) };
        let b = Shm::open(a.path(), 4096).unwrap();
        assert_eq!(b.len(), 8192);
        // SAFETY: inside the mapping, written above through the other mapping.
        assert_eq!(unsafe { b.as_ptr().add(100).read() }, 42);
        assert!(matches!(
            Shm::open(a.path(), 1 << 20),
            Err(Error::InvalidArgument(_))
        ));
        a.unlink().unwrap();
        assert!(matches!(Shm::open(a.path(), 1), Err(Error::Os { .. })));
        assert!(Shm::create("x", 0).is_err());
    }
}
