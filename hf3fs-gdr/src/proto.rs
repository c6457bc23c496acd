//! The client ⇄ daemon socket: `SOCK_SEQPACKET` (message boundaries kept, descriptors
//! passed with `SCM_RIGHTS`, and a closed peer reads as end of file — how each side
//! learns that the other died).
//!
//! A request is one message, `op` byte first, little-endian fields after; the reply is
//! one message: an `i64` (≥ 0 a value, < 0 −errno) and optional payload.

use crate::error::{os_err, Error, Result};
use crate::shm::{cstring, Id};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;

pub(crate) const OP_HELLO: u8 = 1;
pub(crate) const OP_REG_FD: u8 = 2;
pub(crate) const OP_DEREG_FD: u8 = 3;
pub(crate) const OP_ADD_IOR: u8 = 4;
pub(crate) const OP_REMOVE_IOR: u8 = 5;
pub(crate) const OP_OWN_IOV: u8 = 6;
pub(crate) const OP_FORGET_IOV: u8 = 7;
pub(crate) const OP_STATS: u8 = 8;
/// Like [`OP_OWN_IOV`], for a publication naming the caller's own `/dev/shm` segment:
/// if the client dies only the link is removed, never the segment.
pub(crate) const OP_OWN_IOV_LINK: u8 = 9;
/// Makes an iov usable by this client's rings: a host iov's `/dev/shm` file as a
/// descriptor the client opened itself (`SCM_RIGHTS`, read-write), or a GPU iov's
/// device, size, offset and CUDA-IPC handle. The daemon never resolves an iov by its
/// name: a client reaches only memory it could open itself.
pub(crate) const OP_REG_IOV: u8 = 10;

/// [`OP_REG_IOV`] kinds.
pub(crate) const IOV_HOST: u8 = 1;
pub(crate) const IOV_GPU: u8 = 2;

/// Largest message either side sends.
pub(crate) const MAX_MESSAGE: usize = 256;

/// A connected or listening `SOCK_SEQPACKET` Unix socket.
#[derive(Debug)]
pub(crate) struct SeqPacket(OwnedFd);

fn sockaddr(path: &Path) -> Result<(libc::sockaddr_un, libc::socklen_t)> {
    let c = cstring(path)?;
    let bytes = c.as_bytes_with_nul();
    // SAFETY: plain C struct, zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() > addr.sun_path.len() {
        return Err(Error::InvalidArgument(format!(
            "socket path {} is longer than {} bytes",
            path.display(),
            addr.sun_path.len() - 1
        )));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len();
    Ok((addr, len as libc::socklen_t))
}

fn new_socket() -> Result<OwnedFd> {
    // SAFETY: plain socket creation; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(os_err(
            "socket",
            std::io::Error::last_os_error(),
            "AF_UNIX SOCK_SEQPACKET",
        ));
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl SeqPacket {
    /// Connects to the socket at `path`.
    pub(crate) fn connect(path: &Path) -> std::io::Result<Self> {
        let sock = new_socket().map_err(std::io::Error::other)?;
        let (addr, len) = sockaddr(path).map_err(std::io::Error::other)?;
        // SAFETY: `addr` is a filled sockaddr_un of `len` bytes.
        let ret = unsafe {
            libc::connect(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if ret < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(sock))
    }

    /// Listens at `path` (the file must not exist).
    pub(crate) fn listen(path: &Path) -> Result<Self> {
        let sock = new_socket()?;
        let (addr, len) = sockaddr(path)?;
        // SAFETY: `addr` is a filled sockaddr_un of `len` bytes.
        let ret = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if ret < 0 {
            return Err(os_err(
                "bind",
                std::io::Error::last_os_error(),
                path.display(),
            ));
        }
        // SAFETY: a bound socket.
        if unsafe { libc::listen(sock.as_raw_fd(), 128) } < 0 {
            return Err(os_err(
                "listen",
                std::io::Error::last_os_error(),
                path.display(),
            ));
        }
        Ok(Self(sock))
    }

    /// Accepts one connection.
    pub(crate) fn accept(&self) -> Result<Self> {
        loop {
            // SAFETY: a listening socket; no address wanted.
            let fd = unsafe {
                libc::accept4(
                    self.0.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            if fd >= 0 {
                // SAFETY: a new descriptor we own.
                return Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(os_err("accept", e, "daemon socket"));
            }
        }
    }

    /// Sends one message with `fds` attached.
    pub(crate) fn send(&self, data: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let fd_bytes = std::mem::size_of_val(raw.as_slice());
        // SAFETY: pure size computation.
        let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
        let mut control = vec![0u8; space];
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        // SAFETY: plain C struct; fields set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !raw.is_empty() {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: the control buffer has CMSG_SPACE(fd_bytes) bytes.
            unsafe {
                let cmsg = libc::CMSG_FIRSTHDR(&msg);
                (*cmsg).cmsg_level = libc::SOL_SOCKET;
                (*cmsg).cmsg_type = libc::SCM_RIGHTS;
                (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
                std::ptr::copy_nonoverlapping(
                    raw.as_ptr(),
                    libc::CMSG_DATA(cmsg).cast(),
                    raw.len(),
                );
            }
        }
        loop {
            // SAFETY: `msg` points at live buffers for the call.
            let n = unsafe { libc::sendmsg(self.0.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
            if n >= 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Receives one message (0 bytes: the peer closed) and its descriptors.
    pub(crate) fn recv(&self, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
        // SAFETY: pure size computation.
        let space = unsafe { libc::CMSG_SPACE((4 * std::mem::size_of::<RawFd>()) as u32) } as usize;
        let mut control = vec![0u8; space];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: plain C struct; fields set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let n = loop {
            // SAFETY: `msg` points at live buffers; CLOEXEC so descriptors do not leak.
            let n = unsafe { libc::recvmsg(self.0.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n >= 0 {
                break n as usize;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let mut fds = Vec::new();
        // SAFETY: walking the control messages the kernel wrote, within `msg_controllen`.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                    let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    for i in 0..bytes / std::mem::size_of::<RawFd>() {
                        fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "message or its descriptors truncated",
            ));
        }
        Ok((n, fds))
    }

    /// A second descriptor of the same socket (for liveness checks while another thread
    /// waits for a reply on the first).
    pub(crate) fn try_clone(&self) -> std::io::Result<Self> {
        self.0.try_clone().map(Self)
    }

    /// Whether the peer has closed (or the socket failed), without consuming anything.
    pub(crate) fn peer_closed(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        if n <= 0 {
            return false;
        }
        if pfd.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            return true;
        }
        let mut b = [0u8; 1];
        // SAFETY: peeks one byte into a live buffer without blocking.
        let r = unsafe {
            libc::recv(
                self.0.as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        r == 0
    }

    /// Bounds blocking receives (so a request to a hung daemon fails, never hangs).
    pub(crate) fn set_recv_timeout(&self, timeout: Duration) -> Result<()> {
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        // SAFETY: a valid timeval of the size passed.
        let ret = unsafe {
            libc::setsockopt(
                self.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if ret < 0 {
            return Err(os_err(
                "setsockopt",
                std::io::Error::last_os_error(),
                "SO_RCVTIMEO",
            ));
        }
        Ok(())
    }

    /// The peer's process, user and group ids (`SO_PEERCRED`: what the kernel recorded
    /// when the peer connected; nothing the peer says).
    pub(crate) fn peer_cred(&self) -> Option<libc::ucred> {
        // SAFETY: plain C struct.
        let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: valid out-pointers of the sizes given.
        let ret = unsafe {
            libc::getsockopt(
                self.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        (ret == 0).then_some(cred)
    }
}

/// Builds a request: op, then fields appended with the `put_*` helpers.
pub(crate) struct Message(pub Vec<u8>);

impl Message {
    pub(crate) fn new(op: u8) -> Self {
        Self(vec![op])
    }
    pub(crate) fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub(crate) fn id(mut self, id: &Id) -> Self {
        self.0.extend_from_slice(id);
        self
    }
    pub(crate) fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
}

/// Reads fields from a received message.
pub(crate) struct Reader<'a>(pub &'a [u8]);

impl Reader<'_> {
    pub(crate) fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_at_checked(N)?;
        self.0 = rest;
        head.try_into().ok()
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    pub(crate) fn i64(&mut self) -> Option<i64> {
        self.take().map(i64::from_le_bytes)
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.take().map(|[b]: [u8; 1]| b)
    }
    pub(crate) fn id(&mut self) -> Option<Id> {
        self.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seqpacket_keeps_boundaries_passes_fds_and_sees_close() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = SeqPacket::listen(&path).unwrap();
        let client = SeqPacket::connect(&path).unwrap();
        let server = listener.accept().unwrap();
        let cred = server.peer_cred().unwrap();
        assert_eq!(cred.pid, std::process::id() as i32);
        // SAFETY: no arguments.
        assert_eq!(cred.uid, unsafe { libc::geteuid() });
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        use std::os::fd::AsFd;
        client
            .send(&Message::new(OP_REG_FD).u32(7).0, &[file.as_fd()])
            .unwrap();
        client.send(&[OP_STATS], &[]).unwrap();
        let mut buf = [0u8; MAX_MESSAGE];
        let (n, fds) = server.recv(&mut buf).unwrap();
        assert_eq!((n, fds.len()), (5, 1));
        let mut r = Reader(&buf[1..n]);
        assert_eq!(r.u32(), Some(7));
        assert_eq!(r.u32(), None);
        let (n, fds) = server.recv(&mut buf).unwrap();
        assert_eq!((n, fds.len(), buf[0]), (1, 0, OP_STATS));
        assert!(!server.peer_closed());
        drop(client);
        assert!(server.peer_closed());
        assert_eq!(server.recv(&mut buf).unwrap().0, 0);
        assert!(SeqPacket::listen(&path).is_err(), "the path is taken");
        assert!(SeqPacket::connect(&dir.path().join("none")).is_err());
    }
}
