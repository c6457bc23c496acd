//! Small operating-system helpers that the core (the metadata listener) and the backends
//! share: a leaf module, so neither imports the other for them.

/// A non-blocking eventfd that wakes a thread sleeping in `poll` on it: `signal` makes it
/// readable (a saturated counter, EAGAIN, still leaves it readable), `drain` resets it.
#[derive(Debug)]
pub(crate) struct WakeFd(std::os::fd::OwnedFd);

impl WakeFd {
    pub(crate) fn new() -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: eventfd has no memory arguments; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(Self(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes the descriptor readable; `Err` only for a failure other than a saturated
    /// counter.
    pub(crate) fn signal(&self) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        let n = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        let e = std::io::Error::last_os_error();
        if n < 0 && e.kind() != std::io::ErrorKind::WouldBlock {
            return Err(e);
        }
        Ok(())
    }

    /// Resets the counter (non-blocking: nothing to read is fine).
    pub(crate) fn drain(&self) {
        use std::os::fd::AsRawFd;
        let mut counter = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer from our non-blocking eventfd.
        unsafe {
            libc::read(
                self.0.as_raw_fd(),
                counter.as_mut_ptr().cast(),
                counter.len(),
            )
        };
    }
}

impl std::os::fd::AsRawFd for WakeFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// A pollfd waiting for `stream` to be readable (or hung up).
pub(crate) fn pollfd_in(fd: i32) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    }
}

/// Cores from which a thread that waits on a transfer may spin without yielding: with
/// fewer, the threads that move the transfer (progress threads, a peer's on the same
/// host) need the core, and every small transfer would cost the whole spin.
const CORES_TO_SPIN: usize = 4;

/// Whether this process has the cores to spin without yielding (read once): the one rule
/// for the agent's wait and for backends' serving threads.
pub(crate) fn may_spin() -> bool {
    static SPINS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SPINS.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, |n| n.get()) >= CORES_TO_SPIN
    })
}

/// Fills `buf` from the kernel's cryptographically secure generator (`getrandom(2)`):
/// nonces and ids a peer must not be able to guess.
pub(crate) fn random_bytes(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: writes at most `rest.len()` bytes into the live buffer `rest`.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(())
}

/// A random 64-bit value from [`random_bytes`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn random_u64() -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    random_bytes(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Who is at the other end of a Unix socket, as the kernel recorded it when that process
/// connected or listened (`SO_PEERCRED`): never what the process says of itself. `pid`
/// is 0 where the kernel could not name it in this pid namespace.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerCred {
    pub(crate) pid: u32,
    pub(crate) uid: u32,
}

/// The credentials of the process at the other end of Unix socket `fd`.
#[cfg(feature = "cuda")]
pub(crate) fn peer_cred(fd: std::os::fd::RawFd) -> std::io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live and sized for SO_PEERCRED's ucred.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: u32::try_from(cred.pid).unwrap_or(0),
        uid: cred.uid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_bytes_fill_the_buffer_and_differ() {
        let (mut a, mut b) = ([0u8; 32], [0u8; 32]);
        random_bytes(&mut a).unwrap();
        random_bytes(&mut b).unwrap();
        assert_ne!(a, b);
        assert_ne!(a, [0; 32]);
        assert_ne!(random_u64().unwrap(), random_u64().unwrap());
    }

    #[test]
    fn a_wake_fd_is_readable_once_signalled_until_drained() {
        use std::os::fd::AsRawFd;
        let w = WakeFd::new().unwrap();
        let readable = |w: &WakeFd| {
            let mut p = libc::pollfd {
                fd: w.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd, zero timeout.
            unsafe { libc::poll(&mut p, 1, 0) == 1 }
        };
        assert!(!readable(&w));
        w.signal().unwrap();
        w.signal().unwrap();
        assert!(readable(&w));
        w.drain();
        assert!(!readable(&w));
        w.drain();
    }
}
