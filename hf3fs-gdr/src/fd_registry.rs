//! The process-wide file registry ([`reg_fd`]): every backend reads it (the daemon
//! client sends a registered descriptor's copy to its daemon, 3FS's ring registers it
//! with the library), so it is a leaf module that imports neither. Deregistration
//! ([`crate::dereg_fd`]) tells every backend, so it lives at the crate root, above them.

use crate::error::{cvt, Error, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// A registered descriptor: our own duplicate (so the inode stays open) and its identity.
#[derive(Debug)]
struct RegisteredFd {
    dup: OwnedFd,
    dev: u64,
    ino: u64,
}

fn registry() -> &'static Mutex<HashMap<RawFd, RegisteredFd>> {
    static FDS: std::sync::OnceLock<Mutex<HashMap<RawFd, RegisteredFd>>> =
        std::sync::OnceLock::new();
    FDS.get_or_init(Default::default)
}

fn identity(fd: RawFd) -> Result<(u64, u64)> {
    // SAFETY: plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; an invalid descriptor is reported as EBADF.
    let ret = unsafe { libc::fstat(fd, &mut st) };
    cvt("fstat", ret)?;
    Ok((st.st_dev, st.st_ino))
}

/// Registers `fd` for I/O (3FS's `hf3fs_reg_fd`). Registering the same open file twice
/// is allowed; registering a number that now names another file than the one
/// registered is refused with `InvalidArgument` (deregister first). `flags` must be 0.
/// A backend learns of the descriptor on its first use by one of its rings: the daemon
/// receives a copy, 3FS's library gets `hf3fs_reg_fd` (its failure surfaces from
/// [`crate::Ior::prep_io`]).
#[doc(alias = "hf3fs_reg_fd")]
pub fn reg_fd(fd: RawFd, flags: u64) -> Result<()> {
    if flags != 0 {
        return Err(Error::InvalidArgument(format!(
            "reg_fd flags {flags:#x} (none are defined)"
        )));
    }
    let (dev, ino) = identity(fd)?;
    let mut fds = registry().lock();
    if let Some(old) = fds.get(&fd) {
        if (old.dev, old.ino) == (dev, ino) {
            return Ok(());
        }
        return Err(Error::InvalidArgument(format!(
            "fd {fd} was registered for another file: dereg_fd it first"
        )));
    }
    // SAFETY: `fd` was just checked by fstat; the duplicate is owned below.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    cvt("fcntl(F_DUPFD_CLOEXEC)", dup)?;
    // SAFETY: a new descriptor we own.
    let dup = unsafe { OwnedFd::from_raw_fd(dup) };
    fds.insert(fd, RegisteredFd { dup, dev, ino });
    Ok(())
}

/// Forgets `fd`'s registration; `false` when it was not registered. Only the registry:
/// [`crate::dereg_fd`] tells the backends.
pub(crate) fn unregister(fd: RawFd) -> bool {
    registry().lock().remove(&fd).is_some()
}

/// The `(dev, ino)` a registered descriptor named when [`reg_fd`] took it.
pub(crate) fn registered_identity(fd: RawFd) -> Result<(u64, u64)> {
    registry()
        .lock()
        .get(&fd)
        .map(|r| (r.dev, r.ino))
        .ok_or(Error::FdNotRegistered(fd))
}

/// A registered descriptor's identity and a new duplicate of our copy (to send to a
/// daemon), or `FdNotRegistered`. The duplicate's own failure is the inner `Err`, so
/// the caller reports it after checking what it already knows by the identity.
pub(crate) fn registered_copy(fd: RawFd) -> Result<((u64, u64), std::io::Result<OwnedFd>)> {
    let fds = registry().lock();
    let reg = fds.get(&fd).ok_or(Error::FdNotRegistered(fd))?;
    Ok(((reg.dev, reg.ino), reg.dup.try_clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dereg_fd;
    use std::os::fd::AsRawFd;

    #[test]
    fn reg_fd_checks_the_descriptor_and_its_identity() {
        assert!(matches!(reg_fd(-1, 0), Err(Error::Os { .. })));
        let a = tempfile::tempfile().unwrap();
        let fd = a.as_raw_fd();
        assert!(matches!(reg_fd(fd, 1), Err(Error::InvalidArgument(_))));
        reg_fd(fd, 0).unwrap();
        reg_fd(fd, 0).unwrap();
        assert!(registered_identity(fd).is_ok());
        // The number now names another file: refused until deregistered.
        let b = tempfile::tempfile().unwrap();
        // SAFETY: both descriptors are open; dup2 replaces `fd` with a copy of `b`.
        assert!(unsafe { libc::dup2(b.as_raw_fd(), fd) } >= 0);
        assert!(matches!(reg_fd(fd, 0), Err(Error::InvalidArgument(_))));
        dereg_fd(fd);
        assert!(matches!(
            registered_identity(fd),
            Err(Error::FdNotRegistered(n)) if n == fd
        ));
        reg_fd(fd, 0).unwrap();
        dereg_fd(fd);
        dereg_fd(fd);
    }
}
