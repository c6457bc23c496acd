//! The out-of-band channel of `GPUNETIO`'s NIC path: notifications to peers on other
//! nodes (or reached through the NIC on this one), over TCP on the `oob_interface`
//! address, as upstream's plugin sets up its peers over an OOB interface.
//!
//! One connection per (sender, receiver), opened by the sender on its first message:
//! a hello frame with the sender's agent name, then one frame per notification
//! (`u32` little-endian length, bytes). A notification is sent only after the transfer
//! it follows completed (the proxy reported every write delivered), so it arrives after
//! the data. The receiver never writes back: a readable sender socket means the peer
//! closed it (liveness); a refused connection or a failed write is
//! [`Error::RemoteDisconnect`].

use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Largest notification or agent name accepted on the wire.
pub(super) const MAX_FRAME: usize = 1 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often idle listener and reader threads look at the stop flag.
const POLL: Duration = Duration::from_millis(50);

/// Notifications received, oldest first: (sender, message).
type Inbox = crate::backends::shared::NotifInbox;

/// The listening side: accepts senders and queues what they send.
#[derive(Debug)]
pub(super) struct OobListener {
    addr: SocketAddr,
    inbox: Arc<Inbox>,
    stop: Arc<AtomicBool>,
}

impl OobListener {
    /// Listens on `ip` (an ephemeral port).
    pub(super) fn bind(ip: IpAddr) -> Result<Self> {
        let listener = TcpListener::bind((ip, 0)).map_err(|e| {
            Error::Io(std::io::Error::new(
                e.kind(),
                format!("GPUNETIO: listening for notifications on {ip}: {e}"),
            ))
        })?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let inbox = Arc::new(Inbox::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (q, s) = (inbox.clone(), stop.clone());
        std::thread::Builder::new()
            .name("gpunetio-oob".into())
            .spawn(move || accept_loop(&listener, &q, &s))?;
        Ok(Self { addr, inbox, stop })
    }

    /// Where senders connect.
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Moves the received notifications into `into`.
    pub(super) fn take(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.inbox.take(into);
    }

    /// Adds an agent's waker, woken by each notification received from now on.
    pub(super) fn add_waker(&self, waker: crate::backend::NotifWaker) {
        self.inbox.add_waker(waker);
    }
}

impl Drop for OobListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

fn accept_loop(listener: &TcpListener, inbox: &Arc<Inbox>, stop: &Arc<AtomicBool>) {
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((conn, _)) => {
                let (q, s) = (inbox.clone(), stop.clone());
                let spawned = std::thread::Builder::new()
                    .name("gpunetio-oob-rx".into())
                    .spawn(move || {
                        if let Err(e) = serve(conn, &q, &s) {
                            tracing::debug!("GPUNETIO notification connection closed: {e}");
                        }
                    });
                if let Err(e) = spawned {
                    tracing::warn!("GPUNETIO: no thread for a notification connection: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(e) => {
                tracing::warn!("GPUNETIO: accepting a notification connection: {e}");
                std::thread::sleep(POLL);
            }
        }
    }
}

/// Reads exactly `buf.len()` bytes, looking at `stop` while idle; `Ok(false)` on a clean
/// end of stream before the first byte.
fn read_full(conn: &mut impl Read, buf: &mut [u8], stop: &AtomicBool) -> std::io::Result<bool> {
    let mut at = 0;
    while at < buf.len() {
        if stop.load(Ordering::Acquire) {
            return Err(std::io::Error::other("the backend is shutting down"));
        }
        match conn.read(&mut buf[at..]) {
            Ok(0) if at == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn read_frame(conn: &mut impl Read, stop: &AtomicBool) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    if !read_full(conn, &mut len, stop)? {
        return Ok(None);
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a {len}-byte frame (at most {MAX_FRAME})"),
        ));
    }
    let mut frame = vec![0u8; len];
    if !read_full(conn, &mut frame, stop)? && len > 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(frame))
}

fn serve(mut conn: TcpStream, inbox: &Inbox, stop: &AtomicBool) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(POLL))?;
    serve_stream(&mut conn, inbox, stop)
}

/// A sender's stream: its hello frame (its name), then one frame per notification.
fn serve_stream(conn: &mut impl Read, inbox: &Inbox, stop: &AtomicBool) -> std::io::Result<()> {
    let Some(hello) = read_frame(conn, stop)? else {
        return Ok(());
    };
    let sender = String::from_utf8(hello)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "a non-UTF-8 name"))?;
    while let Some(msg) = read_frame(conn, stop)? {
        inbox.push(sender.clone(), msg);
    }
    Ok(())
}

/// Fuzzing entry point (not a stable API): a sender's byte stream as the receiving side
/// reads it, on `input`. Returns whether every notification taken from it is within
/// [`MAX_FRAME`] and the stream holds no more frames than bytes (reading must never
/// panic, and never allocate more than the frame limit from a length field).
pub(super) fn fuzz_stream(input: &[u8]) -> bool {
    let inbox = Inbox::default();
    let stop = AtomicBool::new(false);
    let _ = serve_stream(&mut &input[..], &inbox, &stop);
    let mut got = Vec::new();
    inbox.take(&mut got);
    got.len() <= input.len() / 4 && got.iter().all(|(_, msg)| msg.len() <= MAX_FRAME)
}

fn frame(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + bytes.len());
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
    out
}

/// The sending side toward one peer.
#[derive(Debug)]
pub(super) struct OobSender {
    me: String,
    peer: String,
    addr: SocketAddr,
    conn: Mutex<Option<TcpStream>>,
    gone: AtomicBool,
}

impl OobSender {
    pub(super) fn new(me: &str, peer: &str, addr: SocketAddr) -> Self {
        Self {
            me: me.to_string(),
            peer: peer.to_string(),
            addr,
            conn: Mutex::new(None),
            gone: AtomicBool::new(false),
        }
    }

    fn disconnected(&self, reason: String) -> Error {
        self.gone.store(true, Ordering::Release);
        Error::RemoteDisconnect {
            agent: self.peer.clone(),
            reason,
        }
    }

    /// Sends one notification (connecting first if needed).
    pub(super) fn send(&self, msg: &[u8]) -> Result<()> {
        if msg.len() > MAX_FRAME {
            return Err(Error::InvalidParam(format!(
                "a {}-byte notification (GPUNETIO carries at most {MAX_FRAME})",
                msg.len()
            )));
        }
        self.alive()?;
        let mut conn = self.conn.lock();
        if conn.is_none() {
            let mut c = TcpStream::connect_timeout(&self.addr, CONNECT_TIMEOUT).map_err(|e| {
                self.disconnected(format!(
                    "connecting to its notification address {}: {e}",
                    self.addr
                ))
            })?;
            c.set_nodelay(true)?;
            c.write_all(&frame(self.me.as_bytes()))
                .map_err(|e| self.disconnected(format!("sending the hello frame: {e}")))?;
            *conn = Some(c);
        }
        let c = conn.as_mut().expect("connected above");
        c.write_all(&frame(msg)).map_err(|e| {
            *conn = None;
            self.disconnected(format!("sending a notification: {e}"))
        })
    }

    /// Fails once the peer closed the connection (it never writes on it, so anything
    /// readable is the end of the stream or an error).
    pub(super) fn alive(&self) -> Result<()> {
        if self.gone.load(Ordering::Acquire) {
            return Err(Error::RemoteDisconnect {
                agent: self.peer.clone(),
                reason: "its notification connection closed".into(),
            });
        }
        let conn = self.conn.lock();
        let Some(c) = conn.as_ref() else {
            return Ok(());
        };
        let mut byte = 0u8;
        // SAFETY: a valid socket fd and a one-byte buffer; MSG_PEEK | MSG_DONTWAIT
        // neither consumes nor blocks.
        let n = unsafe {
            libc::recv(
                c.as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        let would_block = n < 0
            && matches!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EAGAIN) | Some(libc::EINTR)
            );
        if n < 0 && !would_block || n == 0 {
            drop(conn);
            return Err(self.disconnected("its notification connection closed".into()));
        }
        Ok(())
    }
}

/// The IPv4 address of `oob_interface` (an interface name such as `eth0`, or an address);
/// loopback when not given.
pub(super) fn interface_address(oob_interface: Option<&str>) -> Result<IpAddr> {
    let Some(name) = oob_interface.filter(|s| !s.is_empty()) else {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    };
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(ip);
    }
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` receives a list freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::Io(std::io::Error::last_os_error()));
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string of the list.
        let ifname = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: ifa_addr is non-null and points at a sockaddr of the list.
        let family = unsafe { (*ifa.ifa_addr).sa_family };
        if ifname.to_bytes() == name.as_bytes() && i32::from(family) == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
            found = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                sin.sin_addr.s_addr,
            ))));
            break;
        }
    }
    // SAFETY: the list from getifaddrs above, freed once.
    unsafe { libc::freeifaddrs(head) };
    found.ok_or_else(|| {
        Error::InvalidParam(format!(
            "GPUNETIO parameter oob_interface={name:?}: no interface with an IPv4 address has that name"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn wait_for(listener: &OobListener, n: usize) -> Vec<(String, Vec<u8>)> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while got.len() < n {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} arrived",
                got.len()
            );
            listener.take(&mut got);
            std::thread::sleep(Duration::from_millis(1));
        }
        got
    }

    #[test]
    fn notifications_arrive_in_order_with_the_sender_name() {
        let listener = OobListener::bind(interface_address(None).unwrap()).unwrap();
        let tx = OobSender::new("alice", "bob", listener.addr());
        for i in 0..100u32 {
            tx.send(&i.to_le_bytes()).unwrap();
        }
        tx.send(b"").unwrap();
        let got = wait_for(&listener, 101);
        for (i, (who, msg)) in got.iter().enumerate().take(100) {
            assert_eq!(who, "alice");
            assert_eq!(msg, &(i as u32).to_le_bytes());
        }
        assert!(got[100].1.is_empty());
        tx.alive().unwrap();
        assert!(matches!(
            tx.send(&vec![0; MAX_FRAME + 1]),
            Err(Error::InvalidParam(_))
        ));
    }

    #[test]
    fn a_vanished_receiver_is_a_remote_disconnect() {
        let listener = OobListener::bind(interface_address(None).unwrap()).unwrap();
        let addr = listener.addr();
        let tx = OobSender::new("alice", "bob", addr);
        tx.send(b"first").unwrap();
        wait_for(&listener, 1);
        drop(listener);
        // The reader thread notices the stop flag within its poll period and closes.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match tx.alive() {
                Err(Error::RemoteDisconnect { agent, .. }) => {
                    assert_eq!(agent, "bob");
                    break;
                }
                Err(e) => panic!("{e}"),
                Ok(()) => {
                    assert!(Instant::now() < deadline, "the close was not seen");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        assert!(matches!(
            tx.send(b"again"),
            Err(Error::RemoteDisconnect { .. })
        ));
        // Nobody listening at all: refused at connect.
        let never = OobSender::new("alice", "carol", addr);
        assert!(matches!(
            never.send(b"x"),
            Err(Error::RemoteDisconnect { .. })
        ));
    }

    #[test]
    fn interface_names_and_addresses() {
        assert_eq!(
            interface_address(Some("lo")).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(
            interface_address(Some("10.1.2.3")).unwrap(),
            "10.1.2.3".parse::<IpAddr>().unwrap()
        );
        assert!(matches!(
            interface_address(Some("no-such-if0")),
            Err(Error::InvalidParam(_))
        ));
    }
}
