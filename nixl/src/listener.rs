//! Peer-to-peer metadata exchange over TCP (NIXL's listener thread and
//! `sendLocalMD`/`fetchRemoteMD` with an IP address).
//!
//! One request and one reply per connection, each a frame:
//! `"NXP" version:u8 type:u8 len:u32le check:u32le payload[len]`, with `len` bounded by
//! [`MAX_METADATA_BYTES`] and every socket operation bounded by the agent's
//! metadata timeout. Version `b'2'` checks the frame with CRC-32C
//! ([`crate::metadata::crc32c`]) over the header before the check and the payload, so a
//! corrupted request type, length or payload is refused before it is acted on (a
//! metadata payload also carries its own check, see [`crate::metadata`]). Version `b'1'`
//! frames (no check) are refused with a message naming the version.

use crate::agent::{Agent, AgentInner};
use crate::error::{Error, Result};
use crate::metadata::{crc32c, crc32c_append, MAX_METADATA_BYTES};
use crate::os::{pollfd_in, WakeFd};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

const FRAME_MAGIC: &[u8; 3] = b"NXP";
/// The frame version this crate writes and reads (2: CRC-32C over header and payload).
const FRAME_VERSION: u8 = b'2';
/// Magic, version, type, payload length and check.
const FRAME_HEADER_BYTES: usize = 3 + 1 + 1 + 4 + 4;
/// Where the check sits in the header: the bytes before it and the payload are checked.
const FRAME_CHECK_AT: usize = 3 + 1 + 1 + 4;
const SEND_MD: u8 = 1;
const FETCH_MD: u8 = 2;
const MD_REPLY: u8 = 3;
const INVALIDATE: u8 = 4;
const ACK: u8 = 5;
const ERROR: u8 = 6;
/// Connections served at once; more are closed at once (a flood costs nothing).
const MAX_CONCURRENT: usize = 64;
/// Pause after a failed accept (e.g. out of descriptors) before the next try.
const ACCEPT_RETRY: Duration = Duration::from_millis(20);

/// The running listener; stops when dropped (with its agent).
#[derive(Debug)]
pub(crate) struct Listener {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Wakes the accept loop, which sleeps until a connection or this (no periodic
    /// wake-ups: on a soft-RoCE guest every wake-up takes CPU from the transfers).
    wake: Arc<WakeFd>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    pub(crate) fn start(agent: &Agent, addr: SocketAddr) -> Result<Self> {
        let socket = TcpListener::bind(addr)?;
        socket.set_nonblocking(true)?;
        let addr = socket.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let wake = Arc::new(WakeFd::new()?);
        let weak = Arc::downgrade(&agent.inner);
        let thread = std::thread::Builder::new()
            .name(format!("nixl-listen-{}", agent.name()))
            .spawn({
                let (stop, wake) = (stop.clone(), wake.clone());
                move || accept_loop(socket, weak, stop, &wake)
            })?;
        Ok(Self {
            addr,
            stop,
            wake,
            thread: Some(thread),
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Err(e) = self.wake.signal() {
            tracing::warn!(error = %e, "waking the metadata listener to stop failed");
        }
        if let Some(thread) = self.thread.take() {
            // The listener may be dropped from its own thread (last Agent clone released
            // while serving); joining oneself would deadlock.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

fn accept_loop(socket: TcpListener, agent: Weak<AgentInner>, stop: Arc<AtomicBool>, wake: &WakeFd) {
    let active = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::SeqCst) {
        match socket.accept() {
            Ok((stream, peer)) => {
                if active.load(Ordering::Relaxed) >= MAX_CONCURRENT {
                    tracing::warn!(%peer, "metadata listener busy: connection dropped");
                    continue;
                }
                let Some(inner) = agent.upgrade() else { return };
                active.fetch_add(1, Ordering::Relaxed);
                let counter = active.clone();
                let spawned = std::thread::Builder::new()
                    .name("nixl-listen-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve(stream, &inner.agent()) {
                            tracing::debug!(%peer, error = %e, "metadata exchange failed");
                        }
                        counter.fetch_sub(1, Ordering::Relaxed);
                    });
                if spawned.is_err() {
                    active.fetch_sub(1, Ordering::Relaxed);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut fds = [pollfd_in(socket.as_raw_fd()), pollfd_in(wake.as_raw_fd())];
                // SAFETY: two live pollfds for the duration of the call. No timeout: a
                // connection or the stop (signalled after the flag is set) wakes it.
                unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
            }
            Err(e) => {
                tracing::warn!(error = %e, "metadata listener accept failed");
                std::thread::sleep(ACCEPT_RETRY);
            }
        }
    }
}

fn serve(mut stream: TcpStream, agent: &Agent) -> Result<()> {
    stream.set_nonblocking(false)?;
    set_timeouts(&stream, agent.config().metadata_timeout)?;
    serve_io(&mut stream, agent)
}

/// The listener's whole request path over any byte stream: one request frame in, one
/// reply frame out.
fn serve_io(stream: &mut (impl Read + Write), agent: &Agent) -> Result<()> {
    let (kind, payload) = match read_frame(stream) {
        Ok(frame) => frame,
        Err(e @ Error::MalformedMetadata(_)) => {
            // Tell the sender why (a corrupted frame, an old version), best effort.
            let _ = write_frame(stream, ERROR, e.to_string().as_bytes());
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    let reply = match kind {
        SEND_MD => agent
            .load_remote_metadata(&payload)
            .map(|_| (ACK, Vec::new())),
        FETCH_MD => agent.local_metadata().map(|md| (MD_REPLY, md)),
        INVALIDATE => {
            let name = String::from_utf8(payload)
                .map_err(|_| Error::MalformedMetadata("agent name is not UTF-8".into()))?;
            // Unknown is fine: the goal (not knowing that agent) holds.
            match agent.invalidate_remote(&name) {
                Ok(()) | Err(Error::UnknownAgent(_)) => Ok((ACK, Vec::new())),
                Err(e) => Err(e),
            }
        }
        other => Err(Error::MalformedMetadata(format!(
            "unknown request type {other}"
        ))),
    };
    match reply {
        Ok((kind, payload)) => write_frame(stream, kind, &payload),
        Err(e) => {
            let _ = write_frame(stream, ERROR, e.to_string().as_bytes());
            Err(e)
        }
    }
}

fn set_timeouts(stream: &TcpStream, timeout: Duration) -> Result<()> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    Ok(())
}

fn write_frame(stream: &mut impl Write, kind: u8, payload: &[u8]) -> Result<()> {
    let header = frame_header(kind, payload)?;
    stream.write_all(&header).map_err(timeout_error)?;
    stream.write_all(payload).map_err(timeout_error)?;
    stream.flush().map_err(timeout_error)
}

fn frame_header(kind: u8, payload: &[u8]) -> Result<[u8; FRAME_HEADER_BYTES]> {
    let len =
        u32::try_from(payload.len()).map_err(|_| Error::InvalidParam("frame too large".into()))?;
    let mut header = [0u8; FRAME_HEADER_BYTES];
    header[..3].copy_from_slice(FRAME_MAGIC);
    header[3] = FRAME_VERSION;
    header[4] = kind;
    header[5..FRAME_CHECK_AT].copy_from_slice(&len.to_le_bytes());
    let check = crc32c_append(crc32c(&header[..FRAME_CHECK_AT]), payload);
    header[FRAME_CHECK_AT..].copy_from_slice(&check.to_le_bytes());
    Ok(header)
}

fn read_frame(stream: &mut impl Read) -> Result<(u8, Vec<u8>)> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    stream.read_exact(&mut header).map_err(timeout_error)?;
    if &header[..3] != FRAME_MAGIC {
        return Err(Error::MalformedMetadata(
            "not a metadata exchange frame".into(),
        ));
    }
    match header[3] {
        FRAME_VERSION => {}
        b'1' => {
            return Err(Error::MalformedMetadata(format!(
                "metadata exchange frame version 1 has no integrity check and is refused; \
                 this build speaks version {} (CRC-32C): upgrade the peer",
                FRAME_VERSION as char
            )))
        }
        other => {
            return Err(Error::MalformedMetadata(format!(
                "unsupported metadata exchange frame version {other:#04x}"
            )))
        }
    }
    let len = u32::from_le_bytes(header[5..FRAME_CHECK_AT].try_into().expect("4 bytes")) as usize;
    if len > MAX_METADATA_BYTES {
        return Err(Error::MalformedMetadata(format!(
            "frame of {len} bytes exceeds the {MAX_METADATA_BYTES}-byte limit"
        )));
    }
    // Grow with what actually arrives, so a lying length cannot make us allocate it.
    let mut payload = Vec::with_capacity(len.min(1 << 16));
    stream
        .take(len as u64)
        .read_to_end(&mut payload)
        .map_err(timeout_error)?;
    if payload.len() != len {
        return Err(Error::MalformedMetadata(format!(
            "frame truncated: {} of {len} bytes",
            payload.len()
        )));
    }
    let stored = u32::from_le_bytes(header[FRAME_CHECK_AT..].try_into().expect("4 bytes"));
    let computed = crc32c_append(crc32c(&header[..FRAME_CHECK_AT]), &payload);
    if stored != computed {
        return Err(Error::MalformedMetadata(format!(
            "metadata exchange frame failed its integrity check: CRC-32C {computed:#010x} \
             does not match the stored {stored:#010x} (corrupted in transit)"
        )));
    }
    Ok((header[4], payload))
}

/// Fuzzing entry point (not a stable API): serves `input` as one connection's bytes, as
/// the listener thread does for a peer, and returns what it would send back. Then reads
/// the reply the way a requesting agent does, so both directions of the framing run.
#[doc(hidden)]
pub fn fuzz_serve(agent: &Agent, input: &[u8]) -> Vec<u8> {
    struct Conn<'a> {
        input: &'a [u8],
        output: Vec<u8>,
    }
    impl Read for Conn<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.input.read(buf)
        }
    }
    impl Write for Conn<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.output.write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut conn = Conn {
        input,
        output: Vec::new(),
    };
    let _ = serve_io(&mut conn, agent);
    let reply = conn.output;
    if !reply.is_empty() {
        let (kind, _) = read_frame(&mut &reply[..]).expect("the listener's own reply parses");
        assert!(
            matches!(kind, ACK | MD_REPLY | ERROR),
            "the listener replied with type {kind}"
        );
    }
    reply
}

fn timeout_error(e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout(format!("metadata exchange: {e}"))
        }
        _ => Error::Io(e),
    }
}

impl Agent {
    fn exchange(&self, addr: SocketAddr, kind: u8, payload: &[u8]) -> Result<(u8, Vec<u8>)> {
        let timeout = self.config().metadata_timeout;
        let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(timeout_error)?;
        set_timeouts(&stream, timeout)?;
        write_frame(&mut stream, kind, payload)?;
        let (reply, body) = read_frame(&mut stream)?;
        if reply == ERROR {
            return Err(Error::Backend {
                backend: "listener".into(),
                code: 0,
                message: format!("peer at {addr} refused: {}", String::from_utf8_lossy(&body)),
            });
        }
        Ok((reply, body))
    }

    fn expect_ack(&self, addr: SocketAddr, kind: u8, payload: &[u8]) -> Result<()> {
        match self.exchange(addr, kind, payload)? {
            (ACK, _) => Ok(()),
            (other, _) => Err(Error::MalformedMetadata(format!(
                "unexpected reply type {other}"
            ))),
        }
    }

    /// Pushes this agent's full metadata to the listener at `addr`.
    #[doc(alias = "sendLocalMD")]
    pub fn send_local_metadata(&self, addr: SocketAddr) -> Result<()> {
        self.expect_ack(addr, SEND_MD, &self.local_metadata()?)
    }

    /// Pushes partial metadata (see [`Agent::local_partial_metadata`]).
    #[doc(alias = "sendLocalPartialMD")]
    pub fn send_local_partial_metadata(
        &self,
        addr: SocketAddr,
        list: Option<&crate::DescList>,
        include_conn_info: bool,
    ) -> Result<()> {
        self.expect_ack(
            addr,
            SEND_MD,
            &self.local_partial_metadata(list, include_conn_info)?,
        )
    }

    /// Fetches the metadata of the agent listening at `addr`, loads it, returns its name.
    #[doc(alias = "fetchRemoteMD")]
    pub fn fetch_remote_metadata(&self, addr: SocketAddr) -> Result<String> {
        match self.exchange(addr, FETCH_MD, &[])? {
            (MD_REPLY, blob) => self.load_remote_metadata(&blob),
            (other, _) => Err(Error::MalformedMetadata(format!(
                "unexpected reply type {other}"
            ))),
        }
    }

    /// Tells the agent at `addr` to forget this one.
    #[doc(alias = "invalidateLocalMD")]
    pub fn invalidate_local_metadata(&self, addr: SocketAddr) -> Result<()> {
        self.expect_ack(addr, INVALIDATE, self.name().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn frames_round_trip() {
        let (mut a, mut b) = pair();
        write_frame(&mut a, SEND_MD, b"hello").unwrap();
        assert_eq!(read_frame(&mut b).unwrap(), (SEND_MD, b"hello".to_vec()));
    }

    #[test]
    fn oversized_and_truncated_frames_are_typed_errors() {
        let (mut a, mut b) = pair();
        let mut header = frame_header(SEND_MD, b"").unwrap();
        header[5..FRAME_CHECK_AT].copy_from_slice(&u32::MAX.to_le_bytes());
        a.write_all(&header).unwrap();
        assert!(
            matches!(read_frame(&mut b), Err(Error::MalformedMetadata(m)) if m.contains("exceeds"))
        );

        let (mut a, mut b) = pair();
        let header = frame_header(SEND_MD, &[0; 100]).unwrap();
        a.write_all(&header).unwrap();
        a.write_all(&[0; 10]).unwrap();
        drop(a);
        assert!(
            matches!(read_frame(&mut b), Err(Error::MalformedMetadata(m)) if m.contains("truncated"))
        );

        let (mut a, mut b) = pair();
        a.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        assert!(matches!(
            read_frame(&mut b),
            Err(Error::MalformedMetadata(_))
        ));
    }

    #[test]
    fn every_corrupted_frame_is_refused() {
        let frame = |kind: u8, payload: &[u8]| {
            let mut f = frame_header(kind, payload).unwrap().to_vec();
            f.extend_from_slice(payload);
            f
        };
        let good = frame(INVALIDATE, b"prefill-7");
        assert_eq!(
            read_frame(&mut &good[..]).unwrap(),
            (INVALIDATE, b"prefill-7".to_vec())
        );
        for i in 0..good.len() {
            for flip in [0x01u8, 0x10, 0x80, 0xff] {
                let mut bad = good.clone();
                bad[i] ^= flip;
                match read_frame(&mut &bad[..]) {
                    Err(Error::MalformedMetadata(_)) => {}
                    other => panic!("byte {i} ^ {flip:#x} was not refused: {other:?}"),
                }
            }
        }
        let mut bad = good.clone();
        bad[FRAME_HEADER_BYTES] ^= 1;
        assert!(matches!(
            read_frame(&mut &bad[..]),
            Err(Error::MalformedMetadata(m)) if m.contains("integrity check")
        ));
        // What version 1 sent: no check field.
        let mut v1 = b"NXP1".to_vec();
        v1.push(INVALIDATE);
        v1.extend_from_slice(&9u32.to_le_bytes());
        v1.extend_from_slice(b"prefill-7");
        assert!(matches!(
            read_frame(&mut &v1[..]),
            Err(Error::MalformedMetadata(m)) if m.contains("version 1 has no integrity check")
        ));
    }

    #[test]
    fn a_corrupted_request_is_refused_with_the_reason() {
        let agent = Agent::new("frame-check", crate::AgentConfig::default()).unwrap();
        let mut request = frame_header(INVALIDATE, b"x").unwrap().to_vec();
        request.push(b'y'); // the payload changed after the check was computed
        let reply = fuzz_serve(&agent, &request);
        let (kind, body) = read_frame(&mut &reply[..]).unwrap();
        assert_eq!(kind, ERROR);
        let text = String::from_utf8(body).unwrap();
        assert!(text.contains("integrity check"), "{text}");
    }

    #[test]
    fn a_silent_peer_times_out() {
        let (_a, mut b) = pair();
        set_timeouts(&b, Duration::from_millis(100)).unwrap();
        assert!(matches!(read_frame(&mut b), Err(Error::Timeout(_))));
    }
}
