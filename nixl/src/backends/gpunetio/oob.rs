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
//!
//! # Who sent it
//! A hello's name is the sender's word. Where it names a peer this backend loaded (or
//! this agent itself), the receiver asks that peer, at the notification address its
//! metadata advertised, whether the connection is one it opened (a verification
//! request naming the connection's two addresses, answered with one byte from the
//! peer's record of its own connections, [`OwnConns`]); until the answer is yes nothing
//! more is read from the connection, and a no closes it (counted in
//! [`OobListener::refused`]). A connection naming an agent that is not loaded is taken
//! under that name, as NIXL's targets need not load their initiators' metadata; it is
//! asked about once that agent is loaded. So a process that reached the address may
//! name itself anything this agent does not know, but never a loaded peer.
//!
//! # Same-host control connections
//! The listener also accepts on a Unix-domain socket (abstract namespace, a random name
//! bound before the connection information that advertises it is published), with this
//! process's identity (pid, start time, pid namespace) beside it. An initiator in the
//! same pid namespace opens its control connection there (a request's round trip is
//! shorter than on TCP loopback: docs/BENCHMARKS.md), after checking that the process
//! holding the socket is the one advertised (`SO_PEERCRED`).
//! The listener attributes such a connection by the kernel's word too: its hello may
//! name a loaded peer only from the process that peer advertised (pid and start time,
//! in this pid namespace); from any other process it is refused and counted, and a name
//! nobody loaded is the sender's word ([`ControlFrom::verified`] false), as on TCP.
//!
//! # Bounds
//! One thread serves every connection (poll), at most [`MAX_CONNS`] at once (others are
//! closed at accept); the first frame (hello or verification request) must be whole
//! within [`FIRST_FRAME_TIMEOUT`] and at most [`MAX_FIRST_FRAME`] bytes; frames grow with
//! the bytes that arrive, never from a length field; and the bytes buffered over all
//! connections are bounded ([`MAX_BUFFERED`]: the connection holding the most is shed).
//! Verifications run on one more thread, one at a time, each bounded by
//! [`VERIFY_TIMEOUT`].

use crate::backends::peer_dram::mailbox::Mailbox;
use crate::backends::peer_dram::trace;
use crate::backends::shared::{pid_namespace, proc_state, put_socket_addr, random_u64};
use crate::error::{Error, Result};
use crate::os::{pollfd_in, WakeFd};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

mod control_conn;
pub(super) use control_conn::ControlConn;

/// A connection's socket: TCP, or a Unix-domain stream socket of a same-host peer.
#[derive(Debug)]
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Self> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    /// TCP: no Nagle (small frames that are awaited); nothing to do on a Unix socket.
    fn set_nodelay(&self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nodelay(true),
            Stream::Unix(_) => Ok(()),
        }
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Unix(s) => s.set_write_timeout(t),
        }
    }

    fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            // std sends on TCP with MSG_NOSIGNAL already.
            Stream::Tcp(s) => (&*s).write(buf),
            // A peer that closed must be an error, never SIGPIPE: a host process (a C
            // program) may not ignore that signal.
            Stream::Unix(s) => loop {
                // SAFETY: a valid socket fd and `buf.len()` readable bytes.
                let n = unsafe {
                    libc::send(
                        s.as_raw_fd(),
                        buf.as_ptr().cast(),
                        buf.len(),
                        libc::MSG_NOSIGNAL,
                    )
                };
                if n >= 0 {
                    return Ok(n as usize);
                }
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            },
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A process of this host as it advertises itself for same-host control connections:
/// its pid, its start time (a reused pid has another) and its pid namespace (a pid
/// means the same process only inside one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LocalIdentity {
    pub(super) pid: u32,
    pub(super) start_time: u64,
    pub(super) pid_ns: u64,
}

impl LocalIdentity {
    /// This process (`None` where `/proc` does not say).
    pub(super) fn me() -> Option<Self> {
        let pid = std::process::id();
        Some(Self {
            pid,
            start_time: proc_state(pid)?.1,
            pid_ns: pid_namespace("self")?,
        })
    }

    /// Whether this process's pids mean what `self`'s does (same pid namespace).
    pub(super) fn pid_means_here(&self) -> bool {
        pid_namespace("self") == Some(self.pid_ns)
    }

    /// Whether the process the kernel says is at the other end of Unix socket `fd`
    /// (`SO_PEERCRED`, recorded when it connected or listened) is this one: a pid of
    /// this pid namespace, with this start time.
    pub(super) fn is_at_other_end_of(&self, fd: RawFd) -> bool {
        self.pid_means_here()
            && crate::os::peer_cred(fd).is_ok_and(|cred| cred.pid == self.pid)
            && proc_state(self.pid).is_some_and(|(_, start)| start == self.start_time)
    }
}

/// Largest notification accepted on the wire.
pub(super) const MAX_FRAME: usize = 1 << 20;
/// Largest first frame (a hello with its agent name, or a verification request): all a
/// connection may make this side buffer before it is attributed.
pub(super) const MAX_FIRST_FRAME: usize = 1024;
/// Connections served at once; more are closed as they are accepted.
pub(super) const MAX_CONNS: usize = 256;
/// How long a new connection has to send its whole first frame.
pub(super) const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on one verification (connect, ask, answer).
pub(super) const VERIFY_TIMEOUT: Duration = Duration::from_secs(2);
/// Bytes buffered over all connections (partial frames).
pub(super) const MAX_BUFFERED: usize = 16 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the serving thread looks at the stop flag when nothing else wakes it.
const POLL: Duration = Duration::from_millis(50);
/// How long the serving thread keeps polling without sleeping after a connection had
/// something to read: a transfer's requests and notifications follow each other within
/// microseconds, and a wake-up from `poll` costs more than a small request's work.
const ACTIVE_SPIN: Duration = Duration::from_micros(200);
/// Bytes read from one connection per wake-up (others get their turn).
const READ_CHUNK: usize = 64 << 10;
const HELLO_MAGIC: &[u8; 4] = b"NXOH";
const CONTROL_MAGIC: &[u8; 4] = b"NXOC";
const VERIFY_MAGIC: &[u8; 4] = b"NXOV";
const WIRE_VERSION: u8 = 1;

/// Notifications received, oldest first: (sender, message).
type Inbox = crate::backends::shared::NotifInbox;

/// A control frame's kind (its first byte): a peer-copy message (module `peer_dram`).
pub(super) const CONTROL_PEER_COPY: u8 = 0;
/// A control frame's kind: a notification, delivered as one from a hello connection.
pub(super) const CONTROL_NOTIF: u8 = 1;
/// A control frame's kind: on a same-host connection, the initiator asks for a shared
/// lane (module `peer_dram::mailbox`); the target's answer of this kind carries it
/// (`SCM_RIGHTS`).
pub(super) const CONTROL_LANE: u8 = 2;
/// A control frame's kind: a request waits in the lane of a target that said it sleeps.
pub(super) const CONTROL_DOORBELL: u8 = 3;

/// A control frame: its kind and body.
pub(super) fn control_frame(frame: &[u8]) -> Option<(u8, &[u8])> {
    frame.split_first().map(|(&kind, body)| (kind, body))
}

/// Who sent a control frame: the name its connection gave, and whether that peer (a
/// loaded one) confirmed the connection is its own; an unverified name is the sender's
/// word only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ControlFrom {
    pub(super) agent: String,
    pub(super) verified: bool,
}

/// What serves control connections' peer-copy frames: who sent it, the body, where the
/// answer goes.
pub(super) struct ControlHandler(pub(super) Box<ControlFn>);

/// The function a [`ControlHandler`] holds.
pub(super) type ControlFn = dyn Fn(ControlFrom, &[u8], Arc<ControlReply>) + Send + Sync;

/// Who serves the shared lanes of control connections, where not this listener's
/// thread: `take` gets each lane as it is handed over (the connection's peer, the lane —
/// gone once the connection closes — and where answers go), `wake` a doorbell (a
/// request waits in a lane whose server said it sleeps).
pub(super) struct LaneHandler {
    pub(super) take: Box<LaneTakeFn>,
    pub(super) wake: Box<dyn Fn() + Send + Sync>,
}

/// What a [`LaneHandler`] is handed each lane with.
pub(super) type LaneTakeFn =
    dyn Fn(ControlFrom, std::sync::Weak<Mailbox>, Arc<ControlReply>) + Send + Sync;

impl std::fmt::Debug for LaneHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LaneHandler")
    }
}

impl std::fmt::Debug for ControlHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlHandler")
    }
}

/// How long an answer waits for room in its connection's send buffer (the initiator
/// reads its answers as it polls; one that does not is dropped).
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);

/// The answering half of a control connection (its socket shared with the serving
/// thread, non-blocking), and the inbox its notifications land in.
#[derive(Debug)]
pub(super) struct ControlReply {
    /// The socket, and one buffer every answer is framed in (no allocation per answer).
    out: Mutex<(Stream, Vec<u8>)>,
    inbox: Arc<Inbox>,
    /// The connection's shared lane, once handed over: answers go there while it has
    /// room (and the connection, its owner, is open).
    lane: OnceLock<std::sync::Weak<Mailbox>>,
}

impl ControlReply {
    fn new(stream: Stream, inbox: Arc<Inbox>) -> Self {
        Self {
            out: Mutex::new((stream, Vec::new())),
            inbox,
            lane: OnceLock::new(),
        }
    }

    /// Hands `lane` to the initiator (a `CONTROL_LANE` frame carrying its descriptor);
    /// answers then go there. Only on a Unix socket.
    fn hand_over(&self, lane: Arc<Mailbox>) -> std::io::Result<()> {
        let guard = self.out.lock();
        let Stream::Unix(s) = &guard.0 else {
            return Err(std::io::Error::other("a shared lane only on a Unix socket"));
        };
        let mut bytes = 1u32.to_le_bytes().to_vec();
        bytes.push(CONTROL_LANE);
        let raw = lane
            .fd()
            .ok_or_else(|| std::io::Error::other("the lane was handed over already"))?;
        // SAFETY: the lane's descriptor stays open while `lane` holds it (all of this call).
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) };
        gpu_mem::send_fds(s, &bytes, &[fd]).map_err(std::io::Error::other)?;
        // The message holds its own reference to the file now.
        lane.release_fd();
        let _ = self.lane.set(Arc::downgrade(&lane));
        Ok(())
    }

    /// Sends `body` as one control frame of `kind`; on failure the connection is shut
    /// down (the initiator sees it end). (The serving side frames in place:
    /// [`ControlReply::send_with`].)
    #[cfg(test)]
    pub(super) fn send(&self, kind: u8, body: &[u8]) -> std::io::Result<()> {
        self.send_with(kind, |out| out.extend_from_slice(body))
    }

    /// Sends the body `write` appends as one control frame of `kind` (framed in the
    /// connection's buffer); on failure the connection is shut down.
    pub(super) fn send_with(
        &self,
        kind: u8,
        write: impl FnOnce(&mut Vec<u8>),
    ) -> std::io::Result<()> {
        let mut guard = self.out.lock();
        let (s, bytes) = &mut *guard;
        bytes.clear();
        bytes.extend_from_slice(&[0; 4]);
        bytes.push(kind);
        write(bytes);
        let len = (bytes.len() - 4) as u32;
        bytes[..4].copy_from_slice(&len.to_le_bytes());
        if kind == CONTROL_PEER_COPY
            && self
                .lane
                .get()
                .and_then(std::sync::Weak::upgrade)
                .is_some_and(|l| l.push_answer(&bytes[5..]))
        {
            return Ok(());
        }
        let deadline = Instant::now() + REPLY_TIMEOUT;
        let mut at = 0;
        while at < bytes.len() {
            match (&*s).write(&bytes[at..]) {
                Ok(0) => break,
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        break;
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
                Err(e) => {
                    s.shutdown();
                    return Err(e);
                }
            }
        }
        if at < bytes.len() {
            s.shutdown();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the initiator does not read its answers",
            ));
        }
        Ok(())
    }

    /// A reply on one end of a fresh Unix socket pair, and the other end (tests).
    #[cfg(test)]
    pub(super) fn pair_for_test(inbox: Arc<Inbox>) -> (Self, UnixStream) {
        let (ours, theirs) = UnixStream::pair().expect("a socket pair");
        (Self::new(Stream::Unix(ours), inbox), theirs)
    }

    /// Delivers a notification from `agent` (the peer this connection was attributed
    /// to), as a `CONTROL_NOTIF` frame on it would be: the serving side calls it for a
    /// notification a request carried, once that request's copies completed.
    pub(super) fn deliver(&self, agent: &str, msg: Vec<u8>) {
        self.inbox.push(agent, msg);
    }
}

/// The notification connections this backend opened, by (local, remote) address: what
/// a receiver asks about to learn whether a connection naming this agent is one of
/// its.
#[derive(Debug, Default)]
pub(super) struct OwnConns(Mutex<HashSet<(SocketAddr, SocketAddr)>>);

impl OwnConns {
    fn insert(&self, conn: (SocketAddr, SocketAddr)) {
        self.0.lock().insert(conn);
    }
    fn remove(&self, conn: &(SocketAddr, SocketAddr)) {
        self.0.lock().remove(conn);
    }
    fn contains(&self, conn: &(SocketAddr, SocketAddr)) -> bool {
        self.0.lock().contains(conn)
    }
}

/// Who may be verified: the loaded peers' advertised notification addresses (and this
/// agent's own), and a generation bumped on every change.
#[derive(Debug, Default)]
struct Known {
    addrs: RwLock<HashMap<String, SocketAddr>>,
    /// The processes they advertised for same-host control connections.
    procs: RwLock<HashMap<String, LocalIdentity>>,
    generation: AtomicU64,
}

/// The first frame of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum First {
    /// A sender's hello: the agent name it gives itself.
    Hello(String),
    /// A control connection's hello (module `peer_dram`): requests the receiver answers
    /// on the same connection, and notifications, from the agent it names.
    Control(String),
    /// A receiver asks whether the connection from `sender` to `receiver` is one this
    /// agent opened.
    Verify {
        sender: SocketAddr,
        receiver: SocketAddr,
    },
}

impl First {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        match self {
            First::Hello(name) | First::Control(name) => {
                let magic = match self {
                    First::Hello(_) => HELLO_MAGIC,
                    _ => CONTROL_MAGIC,
                };
                out.extend_from_slice(magic);
                out.push(WIRE_VERSION);
                out.extend_from_slice(name.as_bytes());
            }
            First::Verify { sender, receiver } => {
                out.extend_from_slice(VERIFY_MAGIC);
                out.push(WIRE_VERSION);
                put_socket_addr(&mut out, *sender);
                put_socket_addr(&mut out, *receiver);
            }
        }
        out
    }

    pub(super) fn decode(frame: &[u8]) -> std::result::Result<First, String> {
        if frame.len() < 5 || frame[4] != WIRE_VERSION {
            return Err("a first frame without magic and version".into());
        }
        let (magic, body) = (&frame[..4], &frame[5..]);
        if magic == HELLO_MAGIC || magic == CONTROL_MAGIC {
            if body.is_empty() {
                return Err("an empty agent name".into());
            }
            let name = std::str::from_utf8(body).map_err(|_| "a non-UTF-8 agent name")?;
            return Ok(if magic == HELLO_MAGIC {
                First::Hello(name.to_string())
            } else {
                First::Control(name.to_string())
            });
        }
        if magic == VERIFY_MAGIC {
            let mut rest = body;
            let sender = take_addr(&mut rest)?;
            let receiver = take_addr(&mut rest)?;
            if !rest.is_empty() {
                return Err("trailing bytes after a verification request".into());
            }
            return Ok(First::Verify { sender, receiver });
        }
        Err("an unknown first frame".into())
    }
}

/// Reads an address as `put_socket_addr` wrote it.
fn take_addr(b: &mut &[u8]) -> std::result::Result<SocketAddr, String> {
    let (&family, rest) = b.split_first().ok_or("a truncated address")?;
    let ip_len = match family {
        4 => 4,
        6 => 16,
        _ => return Err("an unknown address family".into()),
    };
    if rest.len() < ip_len + 2 {
        return Err("a truncated address".into());
    }
    let ip = if ip_len == 4 {
        IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&rest[..4]).expect("4")))
    } else {
        IpAddr::V6(Ipv6Addr::from(
            <[u8; 16]>::try_from(&rest[..16]).expect("16"),
        ))
    };
    let port = u16::from_le_bytes([rest[ip_len], rest[ip_len + 1]]);
    *b = &rest[ip_len + 2..];
    Ok(SocketAddr::new(ip, port))
}

/// Frames cut from a byte stream as it arrives: the buffer holds only bytes that came,
/// never what a length field announces.
#[derive(Debug, Default)]
pub(super) struct FrameBuf {
    buf: Vec<u8>,
}

impl FrameBuf {
    pub(super) fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    pub(super) fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next whole frame, `None` until its bytes are in; an error for a frame
    /// announced longer than `max`.
    pub(super) fn next(&mut self, max: usize) -> std::result::Result<Option<Vec<u8>>, String> {
        let Some(head) = self.buf.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(head.try_into().expect("4 bytes")) as usize;
        if len > max {
            return Err(format!("a {len}-byte frame (at most {max})"));
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let frame = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        if self.buf.is_empty() {
            // A large frame's room goes back once it is out.
            self.buf = Vec::new();
        }
        Ok(Some(frame))
    }
}

/// The listening side: accepts senders and queues what they send.
#[derive(Debug)]
pub(super) struct OobListener {
    addr: SocketAddr,
    /// The abstract name of the Unix socket same-host control connections use.
    unix: Option<Vec<u8>>,
    inbox: Arc<Inbox>,
    stop: Arc<AtomicBool>,
    wake: Arc<WakeFd>,
    known: Arc<Known>,
    own: Arc<OwnConns>,
    refused: Arc<AtomicU64>,
    control: Arc<OnceLock<ControlHandler>>,
    lanes: Arc<OnceLock<LaneHandler>>,
}

impl OobListener {
    /// Listens on `ip` (an ephemeral port) for the agent named `me`.
    pub(super) fn bind(ip: IpAddr, me: &str) -> Result<Self> {
        let listener = TcpListener::bind((ip, 0)).map_err(|e| {
            Error::Io(std::io::Error::new(
                e.kind(),
                format!("GPUNETIO: listening for notifications on {ip}: {e}"),
            ))
        })?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let known = Arc::new(Known::default());
        // A hello naming this agent is asked about here too.
        known.addrs.write().insert(me.to_string(), addr);
        if let Some(me_here) = LocalIdentity::me() {
            known.procs.write().insert(me.to_string(), me_here);
        }
        let unix = bind_unix();
        let (jobs, job_rx) = mpsc::channel::<VerifyJob>();
        let (result_tx, results) = mpsc::channel();
        let this = Self {
            addr,
            unix: unix.as_ref().map(|(name, _)| name.clone()),
            inbox: Arc::new(Inbox::default()),
            stop: Arc::new(AtomicBool::new(false)),
            wake: Arc::new(WakeFd::new()?),
            known,
            own: Arc::new(OwnConns::default()),
            refused: Arc::new(AtomicU64::new(0)),
            control: Arc::new(OnceLock::new()),
            lanes: Arc::new(OnceLock::new()),
        };
        let wake = this.wake.clone();
        std::thread::Builder::new()
            .name("gpunetio-oob-verify".into())
            .spawn(move || {
                // Ends when the serving thread (the only sender of jobs) does.
                for job in job_rx {
                    let yes = ask(&job);
                    if result_tx.send((job.conn, yes)).is_err() {
                        break;
                    }
                    let _ = wake.signal();
                }
            })?;
        let mut server = Server {
            listener,
            unix: unix.map(|(_, l)| l),
            inbox: this.inbox.clone(),
            stop: this.stop.clone(),
            wake: this.wake.clone(),
            known: this.known.clone(),
            own: this.own.clone(),
            refused: this.refused.clone(),
            control: this.control.clone(),
            lanes: this.lanes.clone(),
            conns: HashMap::new(),
            next_id: 0,
            generation: 0,
            jobs,
            results,
            scratch: vec![0; READ_CHUNK],
            active_until: Instant::now(),
        };
        std::thread::Builder::new()
            .name("gpunetio-oob".into())
            .spawn(move || server.run())?;
        Ok(this)
    }

    /// Serves control connections' requests with `handler` (set once; until then a
    /// control connection's request closes it). The handler runs on the serving thread:
    /// it may start work (queue copies), never wait for it.
    pub(super) fn serve_control(&self, handler: ControlHandler) {
        let _ = self.control.set(handler);
    }

    /// Hands control connections' shared lanes to `handler` (set once, before the first
    /// lane; without it no lane is made, and requests come on the connections).
    pub(super) fn serve_lanes_with(&self, handler: LaneHandler) {
        let _ = self.lanes.set(handler);
    }

    /// Where senders connect.
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The abstract name of the Unix socket where same-host control connections are
    /// accepted (`None`: none could be bound).
    pub(super) fn unix_name(&self) -> Option<&[u8]> {
        self.unix.as_deref()
    }

    /// A loaded peer `agent` advertised itself as process `who` for same-host control
    /// connections (`None`: it did not): a Unix connection naming it is taken only from
    /// that process.
    pub(super) fn know_process(&self, agent: &str, who: Option<LocalIdentity>) {
        let mut procs = self.known.procs.write();
        let before = match who {
            Some(who) => procs.insert(agent.to_string(), who),
            None => procs.remove(agent),
        };
        drop(procs);
        if before != who {
            self.known.generation.fetch_add(1, Ordering::AcqRel);
            let _ = self.wake.signal();
        }
    }

    /// This backend's own connections, which the senders it makes record.
    pub(super) fn own_conns(&self) -> Arc<OwnConns> {
        self.own.clone()
    }

    /// A loaded peer `agent` advertised `addr` for its notifications: a hello naming it
    /// is asked about there (connections already taken under its name are asked about
    /// now).
    pub(super) fn know(&self, agent: &str, addr: SocketAddr) {
        let changed = self.known.addrs.write().insert(agent.to_string(), addr) != Some(addr);
        if changed {
            self.known.generation.fetch_add(1, Ordering::AcqRel);
            let _ = self.wake.signal();
        }
    }

    /// `agent` is no longer loaded.
    pub(super) fn forget(&self, agent: &str) {
        self.known.addrs.write().remove(agent);
        self.known.procs.write().remove(agent);
        self.known.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Connections refused for whom they named (the named peer said they are not its).
    pub(super) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
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
        let _ = self.wake.signal();
    }
}

/// A Unix socket in the abstract namespace under a random name (bound before it is
/// advertised, so no other process can hold it first), non-blocking; `None` (logged)
/// where none can be bound.
fn bind_unix() -> Option<(Vec<u8>, UnixListener)> {
    let name = format!("nixl-gpunetio-{}-{:016x}", std::process::id(), random_u64()).into_bytes();
    let bound = std::os::unix::net::SocketAddr::from_abstract_name(&name)
        .and_then(|addr| UnixListener::bind_addr(&addr))
        .and_then(|l| l.set_nonblocking(true).map(|()| l));
    match bound {
        Ok(l) => Some((name, l)),
        Err(e) => {
            tracing::debug!("GPUNETIO: no Unix socket for same-host control connections: {e}");
            None
        }
    }
}

/// A connection to ask the peer it names about.
#[derive(Debug)]
struct VerifyJob {
    conn: u64,
    /// Where the named peer advertised its notifications.
    ask: SocketAddr,
    /// The connection as this side sees it: the sender's address and ours.
    sender: SocketAddr,
    receiver: SocketAddr,
}

/// Asks the peer at `job.ask` whether the connection is one it opened.
fn ask(job: &VerifyJob) -> bool {
    let attempt = || -> std::io::Result<bool> {
        let mut s = TcpStream::connect_timeout(&job.ask, VERIFY_TIMEOUT)?;
        s.set_read_timeout(Some(VERIFY_TIMEOUT))?;
        s.set_write_timeout(Some(VERIFY_TIMEOUT))?;
        let request = First::Verify {
            sender: job.sender,
            receiver: job.receiver,
        };
        s.write_all(&frame(&request.encode()))?;
        let mut answer = [0u8; 1];
        s.read_exact(&mut answer)?;
        Ok(answer[0] == 1)
    };
    match attempt() {
        Ok(yes) => yes,
        Err(e) => {
            tracing::debug!(peer = %job.ask, "GPUNETIO: verifying a notification sender: {e}");
            false
        }
    }
}

#[derive(Debug)]
enum State {
    /// Its first frame is due by `deadline`.
    First { deadline: Instant },
    /// Named `name`, a loaded peer, which is being asked: nothing is read meanwhile.
    Verifying { name: String, control: bool },
    /// Its frames are notifications from `name` (`verified`: the peer said so), or on a
    /// control connection (`control`) control frames.
    Open {
        name: String,
        verified: bool,
        control: bool,
    },
}

#[derive(Debug)]
struct Conn {
    stream: Stream,
    /// TCP: the connection's two addresses (what the named peer is asked about); a Unix
    /// socket's peer is known by the kernel's word instead (`SO_PEERCRED`).
    ends: Option<(SocketAddr, SocketAddr)>,
    frames: FrameBuf,
    state: State,
    /// A control connection's answering half, made on its first request.
    reply: Option<Arc<ControlReply>>,
    /// Its shared lane (same host, on the initiator's asking), served by the
    /// [`LaneHandler`], whose hold ends with the connection: requests read from it are
    /// this connection's.
    lane: Option<Arc<Mailbox>>,
}

/// The answering half of control connection `c`, made on first use.
fn reply_of(c: &mut Conn, inbox: &Arc<Inbox>) -> std::io::Result<Arc<ControlReply>> {
    if let Some(r) = &c.reply {
        return Ok(r.clone());
    }
    let s = c.stream.try_clone()?;
    // Answers are small and awaited: no Nagle.
    let _ = s.set_nodelay();
    let r = Arc::new(ControlReply::new(s, inbox.clone()));
    c.reply = Some(r.clone());
    Ok(r)
}

/// What one wait found ready.
#[derive(Debug, Default)]
struct Ready {
    /// The wake descriptor (a verification answered, the known peers changed, stop).
    wake: bool,
    /// The TCP listener (a connection to accept).
    tcp: bool,
    /// The Unix listener.
    unix: bool,
    /// Connections with something to read (or closed).
    conns: Vec<u64>,
}

/// The serving thread's state.
struct Server {
    listener: TcpListener,
    unix: Option<UnixListener>,
    inbox: Arc<Inbox>,
    stop: Arc<AtomicBool>,
    wake: Arc<WakeFd>,
    known: Arc<Known>,
    own: Arc<OwnConns>,
    refused: Arc<AtomicU64>,
    control: Arc<OnceLock<ControlHandler>>,
    lanes: Arc<OnceLock<LaneHandler>>,
    conns: HashMap<u64, Conn>,
    next_id: u64,
    /// The generation of `known` the connections were last looked at in.
    generation: u64,
    jobs: mpsc::Sender<VerifyJob>,
    results: mpsc::Receiver<(u64, bool)>,
    scratch: Vec<u8>,
    /// Until when `wait` polls without sleeping (traffic came recently).
    active_until: Instant,
}

impl Server {
    fn run(&mut self) {
        while !self.stop.load(Ordering::Acquire) {
            let ready = self.wait();
            let now = Instant::now();
            if !ready.conns.is_empty() {
                self.active_until = now + ACTIVE_SPIN;
            } else if now < self.active_until && !crate::os::may_spin() {
                // Where cores are few, the threads moving the transfer need this one;
                // elsewhere the next request is seen a yield sooner.
                std::thread::yield_now();
            }
            // Only what poll said is ready: while traffic flows this loop spins, and each
            // of these is a system call.
            if ready.wake {
                self.wake.drain();
            }
            if ready.tcp {
                self.accept();
            }
            if ready.unix {
                self.accept_unix();
            }
            self.take_answers();
            self.revisit_if_known_changed();
            for id in ready.conns {
                self.read(id);
            }
            self.expire(Instant::now());
            self.shed();
        }
    }

    /// Sleeps until a listener, a connection read (not those being asked about) or the
    /// wake descriptor is ready, a first frame is due, or [`POLL`] passed (does not sleep
    /// while traffic is recent: `active_until`); returns what is ready.
    fn wait(&self) -> Ready {
        let mut fds = vec![
            pollfd_in(self.wake.as_raw_fd()),
            pollfd_in(self.listener.as_raw_fd()),
        ];
        if let Some(unix) = &self.unix {
            fds.push(pollfd_in(unix.as_raw_fd()));
        }
        let listeners = fds.len();
        let mut ids = Vec::with_capacity(self.conns.len());
        let now = Instant::now();
        let mut timeout = POLL;
        for (&id, c) in &self.conns {
            match c.state {
                State::Verifying { .. } => continue,
                State::First { deadline } => {
                    timeout = timeout.min(deadline.saturating_duration_since(now));
                }
                State::Open { .. } => {}
            }
            fds.push(pollfd_in(c.stream.as_raw_fd()));
            ids.push(id);
        }
        let ms = if now < self.active_until {
            0
        } else {
            timeout.as_millis().clamp(1, i32::MAX as u128) as i32
        };
        // SAFETY: `fds` is a live array of pollfds over descriptors this thread owns.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n <= 0 {
            return Ready::default();
        }
        Ready {
            wake: fds[0].revents != 0,
            tcp: fds[1].revents != 0,
            unix: listeners > 2 && fds[2].revents != 0,
            conns: fds[listeners..]
                .iter()
                .zip(ids)
                .filter(|(fd, _)| fd.revents != 0)
                .map(|(_, id)| id)
                .collect(),
        }
    }

    fn accept(&mut self) {
        loop {
            let (stream, sender) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("GPUNETIO: accepting a notification connection: {e}");
                    return;
                }
            };
            if self.conns.len() >= MAX_CONNS {
                // Closed at once: the cap holds whoever connects.
                tracing::debug!(%sender, "GPUNETIO: notification connection over the cap closed");
                continue;
            }
            let Ok(receiver) = stream.local_addr() else {
                continue;
            };
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            self.admit(Stream::Tcp(stream), Some((sender, receiver)));
        }
    }

    /// Accepts same-host control connections on the Unix socket.
    fn accept_unix(&mut self) {
        loop {
            let Some(listener) = &self.unix else {
                return;
            };
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("GPUNETIO: accepting a same-host control connection: {e}");
                    return;
                }
            };
            if self.conns.len() >= MAX_CONNS {
                tracing::debug!("GPUNETIO: same-host control connection over the cap closed");
                continue;
            }
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            self.admit(Stream::Unix(stream), None);
        }
    }

    /// Takes an accepted connection; its first frame is due within
    /// [`FIRST_FRAME_TIMEOUT`].
    fn admit(&mut self, stream: Stream, ends: Option<(SocketAddr, SocketAddr)>) {
        self.next_id += 1;
        self.conns.insert(
            self.next_id,
            Conn {
                stream,
                ends,
                frames: FrameBuf::default(),
                reply: None,
                lane: None,
                state: State::First {
                    deadline: Instant::now() + FIRST_FRAME_TIMEOUT,
                },
            },
        );
    }

    /// The verifier's answers.
    fn take_answers(&mut self) {
        while let Ok((id, yes)) = self.results.try_recv() {
            let Some(c) = self.conns.get_mut(&id) else {
                continue;
            };
            let State::Verifying { name, control } = &c.state else {
                continue;
            };
            if yes {
                c.state = State::Open {
                    name: name.clone(),
                    verified: true,
                    control: *control,
                };
                // Frames that came with the hello.
                self.frames(id);
            } else {
                let name = name.clone();
                self.refuse(id, &name);
            }
        }
    }

    /// A connection taken under a name that has since been loaded is asked about.
    fn revisit_if_known_changed(&mut self) {
        let generation = self.known.generation.load(Ordering::Acquire);
        if generation == self.generation {
            return;
        }
        self.generation = generation;
        let ids: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                matches!(
                    c.state,
                    State::Open {
                        verified: false,
                        ..
                    }
                )
            })
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let (name, control) = match &self.conns[&id].state {
                State::Open { name, control, .. } => (name.clone(), *control),
                _ => continue,
            };
            self.attribute(id, name, control);
        }
    }

    /// Takes connection `id` under `name`, or asks the loaded peer of that name first.
    fn attribute(&mut self, id: u64, name: String, control: bool) {
        let ask = self.known.addrs.read().get(&name).copied();
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.ends.is_none() {
            // A Unix socket: the kernel says which process connected. A loaded peer's
            // name (or this agent's) only from the process it advertised.
            let who = self.known.procs.read().get(&name).copied();
            let verified = match who {
                Some(who) => who.is_at_other_end_of(c.stream.as_raw_fd()),
                None => false,
            };
            if !verified && (who.is_some() || ask.is_some()) {
                return self.refuse(id, &name);
            }
            c.state = State::Open {
                name,
                verified,
                control,
            };
            // Frames that came with the hello, now that it is attributed.
            return self.frames(id);
        }
        match ask {
            Some(ask) => {
                let Some((sender, receiver)) = c.ends else {
                    return;
                };
                let job = VerifyJob {
                    conn: id,
                    ask,
                    sender,
                    receiver,
                };
                c.state = State::Verifying { name, control };
                if self.jobs.send(job).is_err() {
                    self.conns.remove(&id);
                }
            }
            None => {
                c.state = State::Open {
                    name,
                    verified: false,
                    control,
                };
            }
        }
    }

    fn refuse(&mut self, id: u64, name: &str) {
        self.conns.remove(&id);
        let n = self.refused.fetch_add(1, Ordering::Relaxed);
        if n.is_multiple_of(1024) {
            tracing::warn!(
                refused = n + 1,
                "GPUNETIO: a notification connection naming `{name}` is not that peer's: closed"
            );
        }
    }

    fn close(&mut self, id: u64, why: &str) {
        if let Some(c) = self.conns.remove(&id) {
            tracing::debug!(sender = ?c.ends, "GPUNETIO notification connection closed: {why}");
        }
    }

    /// Reads what connection `id` sent (at most its first frame before it is
    /// attributed) and handles the whole frames.
    fn read(&mut self, id: u64) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let room = match c.state {
            State::First { .. } => (4 + MAX_FIRST_FRAME).saturating_sub(c.frames.buffered()),
            State::Open { .. } => READ_CHUNK,
            State::Verifying { .. } => return,
        };
        if room == 0 {
            return;
        }
        match (&c.stream).read(&mut self.scratch[..room]) {
            Ok(0) => return self.close(id, "end of stream"),
            Ok(n) => {
                trace::mark_received();
                c.frames.push(&self.scratch[..n])
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                return
            }
            Err(e) => return self.close(id, &e.to_string()),
        }
        self.frames(id);
    }

    /// Handles connection `id`'s whole frames.
    fn frames(&mut self, id: u64) {
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            match &c.state {
                State::Verifying { .. } => return,
                State::First { .. } => match c.frames.next(MAX_FIRST_FRAME) {
                    Ok(None) => return,
                    Ok(Some(f)) => match First::decode(&f) {
                        Ok(First::Hello(name)) => self.attribute(id, name, false),
                        Ok(First::Control(name)) => self.attribute(id, name, true),
                        Ok(First::Verify { sender, receiver }) => {
                            let yes = self.own.contains(&(sender, receiver));
                            let _ = (&c.stream).write(&[u8::from(yes)]);
                            return self.close(id, "verification answered");
                        }
                        Err(why) => return self.close(id, &why),
                    },
                    Err(why) => return self.close(id, &why),
                },
                State::Open {
                    name,
                    verified,
                    control,
                } => match c.frames.next(MAX_FRAME) {
                    Ok(None) => return,
                    Ok(Some(msg)) if !*control => self.inbox.push(name.clone(), msg),
                    Ok(Some(frame)) => {
                        let from = ControlFrom {
                            agent: name.clone(),
                            verified: *verified,
                        };
                        match control_frame(&frame) {
                            Some((CONTROL_NOTIF, msg)) => self.inbox.push(from.agent, msg.to_vec()),
                            Some((CONTROL_PEER_COPY, msg)) => {
                                let reply = match reply_of(c, &self.inbox) {
                                    Ok(r) => r,
                                    Err(e) => return self.close(id, &e.to_string()),
                                };
                                match self.control.get() {
                                    Some(handler) => (handler.0)(from, msg, reply),
                                    None => return self.close(id, "no control frames served"),
                                }
                            }
                            Some((CONTROL_LANE, _)) => self.open_lane(id, from),
                            // Its request waits in the lane: its server is woken.
                            Some((CONTROL_DOORBELL, _)) => {
                                if let (Some(_), Some(h)) = (&c.lane, self.lanes.get()) {
                                    (h.wake)();
                                }
                            }
                            _ => return self.close(id, "a malformed control frame"),
                        }
                    }
                    Err(why) => return self.close(id, &why),
                },
            }
        }
    }

    /// Makes a shared lane for control connection `id`, hands it over and gives it to the
    /// [`LaneHandler`], where the initiator asked on a same-host (Unix) connection its
    /// peer confirmed and lanes are served; otherwise the connection carries on alone.
    fn open_lane(&mut self, id: u64, from: ControlFrom) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(handler) = self.lanes.get() else {
            return;
        };
        if !from.verified || c.lane.is_some() || !matches!(c.stream, Stream::Unix(_)) {
            return;
        }
        let made = Mailbox::create()
            .map_err(|e| e.to_string())
            .and_then(|lane| {
                let lane = Arc::new(lane);
                let reply = reply_of(c, &self.inbox).map_err(|e| e.to_string())?;
                reply.hand_over(lane.clone()).map_err(|e| e.to_string())?;
                Ok((lane, reply))
            });
        match made {
            Ok((lane, reply)) => {
                (handler.take)(from, Arc::downgrade(&lane), reply);
                c.lane = Some(lane);
            }
            Err(e) => tracing::debug!("GPUNETIO: no shared lane for a control connection: {e}"),
        }
    }

    /// Closes connections whose first frame is overdue.
    fn expire(&mut self, now: Instant) {
        let late: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| matches!(c.state, State::First { deadline } if deadline <= now))
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            self.close(id, "no first frame in time");
        }
    }

    /// Sheds the connections holding the most buffered bytes while the total is over
    /// [`MAX_BUFFERED`].
    fn shed(&mut self) {
        let mut total: usize = self.conns.values().map(|c| c.frames.buffered()).sum();
        while total > MAX_BUFFERED {
            let Some((&id, c)) = self.conns.iter().max_by_key(|(_, c)| c.frames.buffered()) else {
                return;
            };
            total -= c.frames.buffered();
            self.close(id, "too many bytes buffered");
        }
    }
}

/// Fuzzing entry point (not a stable API): a connection's byte stream as the receiving
/// side cuts it, on `input`. Returns whether every frame is within its limit, the
/// stream holds no more frames than bytes, and a first frame that decodes encodes back
/// (cutting and decoding must never panic, and never allocate from a length field).
pub(super) fn fuzz_stream(input: &[u8]) -> bool {
    let mut frames = FrameBuf::default();
    frames.push(input);
    let first_ok = match frames.next(MAX_FIRST_FRAME) {
        Ok(Some(f)) => match First::decode(&f) {
            Ok(first) => first.encode() == f,
            Err(_) => true,
        },
        _ => true,
    };
    let mut got = Vec::new();
    while let Ok(Some(msg)) = frames.next(MAX_FRAME) {
        got.push(msg);
    }
    first_ok && got.len() <= input.len() / 4 && got.iter().all(|msg| msg.len() <= MAX_FRAME)
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
    /// The connection and its (local, remote) addresses, as recorded in `own`.
    conn: Mutex<Option<(TcpStream, (SocketAddr, SocketAddr))>>,
    gone: AtomicBool,
    own: Arc<OwnConns>,
}

impl OobSender {
    /// Sends as `me` to `peer` at `addr`, recording its connection in `own` (what the
    /// peer asks this agent's listener about).
    pub(super) fn new(me: &str, peer: &str, addr: SocketAddr, own: Arc<OwnConns>) -> Self {
        Self {
            me: me.to_string(),
            peer: peer.to_string(),
            addr,
            conn: Mutex::new(None),
            gone: AtomicBool::new(false),
            own,
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
            let ends = (c.local_addr()?, c.peer_addr()?);
            // Recorded before the hello: the peer may ask as soon as it reads it.
            self.own.insert(ends);
            if let Err(e) = c.write_all(&frame(&First::Hello(self.me.clone()).encode())) {
                self.own.remove(&ends);
                return Err(self.disconnected(format!("sending the hello frame: {e}")));
            }
            *conn = Some((c, ends));
        }
        let (c, ends) = conn.as_mut().expect("connected above");
        if let Err(e) = c.write_all(&frame(msg)) {
            self.own.remove(ends);
            *conn = None;
            return Err(self.disconnected(format!("sending a notification: {e}")));
        }
        Ok(())
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
        let Some((c, _)) = conn.as_ref() else {
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

impl Drop for OobSender {
    fn drop(&mut self) {
        if let Some((_, ends)) = self.conn.get_mut() {
            self.own.remove(ends);
        }
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
mod tests;
