//! Peer-to-peer metadata exchange over TCP (NIXL's listener thread and
//! `sendLocalMD`/`fetchRemoteMD` with an IP address).
//!
//! # Frames
//! One request and one reply per connection, each a frame:
//! `"NXP" version:u8 type:u8 len:u32le check:u32le payload[len]`. Version `b'2'` checks
//! the frame with CRC-32C ([`crate::metadata::crc32c`]) over the header before the check
//! and the payload, so a corrupted request type, length or payload is refused before it
//! is acted on (a metadata payload also carries its own check, see [`crate::metadata`]).
//! Version `b'1'` frames (no check) are refused with a message naming the version.
//!
//! # Job token
//! With a [`JobToken`] configured, a connection first runs a handshake, and a request is
//! served only after it: the client sends `HELLO(client_nonce)`, the listener answers
//! `CHALLENGE(server_nonce, HMAC(token, "server" ‖ client_nonce ‖ server_nonce))`, the
//! client checks that proof and sends `AUTH(HMAC(token, "client" ‖ client_nonce ‖
//! server_nonce))` and its request. Both nonces are 32 bytes from `getrandom(2)`; the
//! token itself never crosses the wire; MACs are compared in constant time. See
//! [`JobToken`] for what each mode protects against.
//!
//! # Bounded resources
//! One thread reads every connection (non-blocking, `poll`), so a connection that sends
//! slowly or not at all costs a descriptor and the bytes it sent, never a thread:
//! - a deadline per request: the handshake and the whole request frame must arrive within
//!   the agent's metadata timeout of the connection's accept (not a timeout per read,
//!   which a peer sending a byte at a time would renew forever); the reply must be taken
//!   within the timeout too;
//! - a frame cap before the request is known: [`PRE_AUTH_MAX_BYTES`] for every frame
//!   except a metadata push, which is accepted only once authenticated where a token is
//!   set (then up to [`MAX_METADATA_BYTES`]), and up to
//!   [`UNAUTHENTICATED_MAX_METADATA_BYTES`] where no token is set;
//! - [`MAX_CONNECTIONS_PER_IP`] connections per source address and [`MAX_CONNECTIONS`]
//!   in all: a new connection over either limit closes the oldest connection of that
//!   address (of the busiest address) that is still sending its request, so connections
//!   that never finish cannot lock anyone out;
//! - [`MAX_BUFFERED_BYTES`] of frames held at once (requests being read or served,
//!   replies being written; a request counts at the length its checked header announces,
//!   allocated once), of which requests of connections that have not authenticated
//!   (every connection, where no token is set) may hold
//!   [`UNAUTHENTICATED_BUFFERED_BYTES`]: over either, connections with unfinished
//!   requests are closed, those that still owe the most bytes first (anyone who can reach
//!   the port can make the listener hold the unauthenticated share, so it bounds what a
//!   stream of junk frames costs);
//! - requests are served by at most [`MAX_WORKERS`] threads (the others wait their turn):
//!   loading metadata may wait for a backend's connection set-up;
//! - the cost of a connection stays small whatever the others do: the kernel queues up to
//!   4096 connections for `accept` (a burst's SYNs are not dropped, which a legitimate
//!   client would pay for with a retransmission), connections per address are counted as
//!   they come and go, one read buffer serves every read, the sum of frame bytes held
//!   is taken only when a frame's header allocates, and at most 256 KiB of one
//!   connection is read before the others get their turn (a sender that keeps its socket
//!   full held the thread for a whole frame, and legitimate fetches waited past 5 s);
//! - after large frames are freed the allocator's free memory is given back (glibc's
//!   `malloc_trim`, at most every 100 ms): a stream of junk frames otherwise left the
//!   process's resident memory at a multiple of what it ever held at once.
//!
//! What these bounds hold under attack is measured in `docs/BENCHMARKS.md` ("nixl:
//! metadata listener under attack", and the junk phase of "nixl: load under attack").

use crate::agent::{Agent, AgentInner, MdSource};
use crate::error::{Error, Result};
use crate::metadata::{crc32c, crc32c_append, MAX_METADATA_BYTES};
use crate::os::{pollfd_in, random_bytes, WakeFd};
use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
/// Job-token handshake: the client's nonce.
const HELLO: u8 = 16;
/// Job-token handshake: the listener's nonce and proof.
const CHALLENGE: u8 = 17;
/// Job-token handshake: the client's proof.
const AUTH: u8 = 18;
/// A refusal because of the job token (missing, wrong, or not configured here).
const AUTH_FAILED: u8 = 19;
const NONCE_BYTES: usize = 32;
const MAC_BYTES: usize = 32;
/// Labels of the two proofs, so that neither side's MAC can be replayed as the other's.
const SERVER_PROOF: &[u8] = b"nixl listener v1 server";
const CLIENT_PROOF: &[u8] = b"nixl listener v1 client";

/// Largest frame accepted before the request is known to be a metadata push (and, with a
/// job token, before the connection authenticated): handshake frames, fetches and
/// invalidations (an agent name is at most 65,535 bytes).
pub(crate) const PRE_AUTH_MAX_BYTES: usize = 64 << 10;
/// Largest metadata push read from a connection that has not authenticated, which is
/// every connection where no job token is set (with a token, an unauthenticated push is
/// refused at [`PRE_AUTH_MAX_BYTES`]). 16 MiB is the metadata of some 400,000 regions
/// (15,000 take about 0.6 MB); larger metadata needs the job token (then up to
/// [`MAX_METADATA_BYTES`]) or etcd.
pub(crate) const UNAUTHENTICATED_MAX_METADATA_BYTES: usize = 16 << 20;
/// Request bytes the connections that have not authenticated may hold at once (being
/// read, waiting for a worker or being served): one push of the largest size they may
/// send, and 4 MiB more.
pub(crate) const UNAUTHENTICATED_BUFFERED_BYTES: usize =
    UNAUTHENTICATED_MAX_METADATA_BYTES + (4 << 20);
/// Connections one source address may hold open at once.
pub(crate) const MAX_CONNECTIONS_PER_IP: usize = 32;
/// Connections held open at once, in all.
pub(crate) const MAX_CONNECTIONS: usize = 512;
/// Frame bytes held at once: requests being read or served, replies being written. Room
/// for one metadata push of the largest size ([`MAX_METADATA_BYTES`]) and 16 MiB more.
pub(crate) const MAX_BUFFERED_BYTES: usize = MAX_METADATA_BYTES + (16 << 20);
/// Requests served at once (each on a thread of its own).
pub(crate) const MAX_WORKERS: usize = 32;
/// Largest read of one connection's bytes at a time.
const READ_CHUNK: usize = 64 << 10;
/// Most bytes read from one connection before the loop turns to the others (it comes back
/// at the next `poll`): a sender that keeps its socket full cannot hold the thread for a
/// whole frame while a legitimate request waits.
const READ_BUDGET: usize = 4 * READ_CHUNK;
/// Connections the kernel may queue for `accept` (capped by `net.core.somaxconn`).
const ACCEPT_BACKLOG: i32 = 4096;
/// A frame at least this large, once freed, asks for the allocator's free memory to be
/// given back to the system ([`LoopState::trim`]).
const TRIM_FRAME_BYTES: usize = 1 << 20;
/// Fewest time between two such give-backs.
const TRIM_INTERVAL: Duration = Duration::from_millis(100);

type HmacSha256 = Hmac<Sha256>;

/// A secret shared by the agents of one job, which authenticates every connection to the
/// metadata listener ([`crate::AgentConfig::job_token`]; `NIXL_JOB_TOKEN`).
///
/// # What each mode protects against
/// Without a token (the default when `NIXL_JOB_TOKEN` is unset), anyone who can reach
/// the listener's port can fetch this agent's metadata (its addresses and remote keys),
/// push metadata under a name that is not bound yet, and push or invalidate under a
/// bound name *from an address that name is known at*. What always holds: a blob naming
/// this agent is refused, a bound name keeps its connection information while its
/// incarnation lives, and metadata pushes and invalidations for a bound name are accepted
/// only from the network address the peer was bound from or fetched at (see "Binding" on
/// [`crate::Agent::load_remote_metadata`]). An address is a host, not a process: another
/// process on the peer's host (every process, when all agents run on one host) passes that
/// check. Anyone can make the listener hold what it reads before a request is known, so
/// without a token it reads metadata pushes of at most 16 MiB (the metadata of some
/// 400,000 regions): larger metadata needs the token (then up to 64 MiB) or etcd.
///
/// With a token, a connection must prove it holds the token before any request is read
/// (a challenge and response with HMAC-SHA256 over fresh nonces of both sides), and the
/// listener proves it to the client too, so an agent neither serves nor loads metadata
/// from anyone outside the job — a process on the same host included, as long as it
/// cannot read the token (keep it out of command lines; the environment of a process is
/// readable by its user and root). It is not encryption: the metadata, remote keys
/// included, crosses the network in clear, and an attacker on the path can read it or
/// take over an authenticated TCP connection. Use a private network for the job, or a
/// tunnel, where that matters. The token authenticates members of a job to each other;
/// a member can still misbehave.
#[derive(Clone)]
pub struct JobToken(Arc<[u8]>);

impl JobToken {
    /// The environment variable [`JobToken::from_env`] reads.
    pub const ENV: &'static str = "NIXL_JOB_TOKEN";

    /// A token from its secret bytes (1 to 4096 of them; use 16 random bytes or more).
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self> {
        let secret = secret.as_ref();
        if secret.is_empty() || secret.len() > 4096 {
            return Err(Error::InvalidParam(format!(
                "a job token must be 1..=4096 bytes, not {}",
                secret.len()
            )));
        }
        Ok(Self(secret.into()))
    }

    /// The token in `NIXL_JOB_TOKEN`, if it is set and not empty (a value over 4096 bytes
    /// is ignored with a warning).
    pub fn from_env() -> Option<Self> {
        let value = std::env::var_os(Self::ENV)?;
        if value.is_empty() {
            return None;
        }
        match Self::new(std::os::unix::ffi::OsStrExt::as_bytes(value.as_os_str())) {
            Ok(token) => Some(token),
            Err(e) => {
                tracing::warn!(error = %e, "{} ignored", Self::ENV);
                None
            }
        }
    }

    /// HMAC-SHA256 under the token of `label ‖ client_nonce ‖ server_nonce`.
    fn mac(&self, label: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any size");
        mac.update(label);
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac
    }

    fn prove(&self, label: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> Vec<u8> {
        self.mac(label, client_nonce, server_nonce)
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Whether `proof` is the MAC of the nonces under `label` (constant time).
    fn verify(&self, label: &[u8], client_nonce: &[u8], server_nonce: &[u8], proof: &[u8]) -> bool {
        self.mac(label, client_nonce, server_nonce)
            .verify_slice(proof)
            .is_ok()
    }
}

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobToken(<redacted>)")
    }
}

// ---- frames ---------------------------------------------------------------------------------

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

/// A whole frame: header and payload.
fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    // Every payload this crate frames is bounded far below 4 GiB (metadata by
    // MAX_METADATA_BYTES, messages by their text): an oversized one is a bug, so it
    // degrades to an error frame rather than a panic.
    match frame_header(kind, payload) {
        Ok(header) => {
            let mut out = Vec::with_capacity(FRAME_HEADER_BYTES + payload.len());
            out.extend_from_slice(&header);
            out.extend_from_slice(payload);
            out
        }
        Err(e) => frame(ERROR, e.to_string().as_bytes()),
    }
}

/// Checks a frame header: magic, version, and the length against `max_len`; returns the
/// type and the payload length.
fn parse_header(header: &[u8; FRAME_HEADER_BYTES], max_len: usize) -> Result<(u8, usize)> {
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
    let mut len = [0u8; 4];
    len.copy_from_slice(&header[5..FRAME_CHECK_AT]);
    let len = u32::from_le_bytes(len) as usize;
    if len > max_len {
        return Err(Error::MalformedMetadata(format!(
            "frame of {len} bytes exceeds the {max_len}-byte limit"
        )));
    }
    Ok((header[4], len))
}

/// Verifies a whole frame's check.
fn check_frame(header: &[u8; FRAME_HEADER_BYTES], payload: &[u8]) -> Result<()> {
    let mut stored = [0u8; 4];
    stored.copy_from_slice(&header[FRAME_CHECK_AT..]);
    let stored = u32::from_le_bytes(stored);
    let computed = crc32c_append(crc32c(&header[..FRAME_CHECK_AT]), payload);
    if stored != computed {
        return Err(Error::MalformedMetadata(format!(
            "metadata exchange frame failed its integrity check: CRC-32C {computed:#010x} \
             does not match the stored {stored:#010x} (corrupted in transit)"
        )));
    }
    Ok(())
}

fn write_frame(stream: &mut impl Write, kind: u8, payload: &[u8]) -> Result<()> {
    let header = frame_header(kind, payload)?;
    stream.write_all(&header).map_err(timeout_error)?;
    stream.write_all(payload).map_err(timeout_error)?;
    stream.flush().map_err(timeout_error)
}

/// Reads one frame of at most `max_len` payload bytes from a blocking stream.
fn read_frame(stream: &mut impl Read, max_len: usize) -> Result<(u8, Vec<u8>)> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    stream.read_exact(&mut header).map_err(timeout_error)?;
    let (kind, len) = parse_header(&header, max_len)?;
    // Grow with what actually arrives, so a lying length cannot make us allocate it.
    let mut payload = Vec::with_capacity(len.min(READ_CHUNK));
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
    check_frame(&header, &payload)?;
    Ok((kind, payload))
}

fn timeout_error(e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout(format!("metadata exchange: {e}"))
        }
        _ => Error::Io(e),
    }
}

// ---- the listener's side of one connection, without I/O ------------------------------------

/// Where a connection is in its exchange.
#[derive(Debug)]
enum Phase {
    /// Waiting for the `HELLO` (with a token) or the request (without).
    Start,
    /// The challenge is out; waiting for the client's proof.
    Challenged {
        client_nonce: [u8; NONCE_BYTES],
        server_nonce: [u8; NONCE_BYTES],
    },
    /// The client proved it holds the token; waiting for the request.
    Authenticated,
}

/// What the listener does once a whole frame of a connection is in.
#[derive(Debug)]
enum Outcome {
    /// Send these bytes (the handshake's challenge), then read on.
    Continue(Vec<u8>),
    /// Serve this request; its reply ends the connection.
    Request { kind: u8, payload: Vec<u8> },
    /// Send these bytes (a refusal), then close; the error says why.
    Refuse(Vec<u8>, Error),
}

/// The listener's side of one connection: bytes in, what to do out. The socket loop and
/// [`fuzz_serve`] both drive it, so the fuzzer runs the listener's real request path.
#[derive(Debug)]
struct Session {
    token: Option<JobToken>,
    phase: Phase,
    /// The header of the frame being read, and how much of it is in.
    header: [u8; FRAME_HEADER_BYTES],
    header_in: usize,
    /// Its payload: allocated once, at the length the checked header states (no
    /// reallocation and copy as it grows), filled as bytes arrive.
    payload: Vec<u8>,
    /// The payload's length, once the header is in and checked.
    payload_len: Option<usize>,
}

impl Session {
    fn new(token: Option<JobToken>) -> Self {
        Self {
            token,
            phase: Phase::Start,
            header: [0; FRAME_HEADER_BYTES],
            header_in: 0,
            payload: Vec::new(),
            payload_len: None,
        }
    }

    /// Bytes the frame being read still lacks (at least 1): reads are never larger, so
    /// a connection holds at most one frame, and never more than its cap.
    fn wanted(&self) -> usize {
        match self.payload_len {
            None => FRAME_HEADER_BYTES - self.header_in,
            Some(len) => (len - self.payload.len()).max(1),
        }
    }

    /// Bytes held for the frame being read (what its payload was allocated at).
    fn buffered(&self) -> usize {
        self.payload.capacity()
    }

    /// Bytes the frame being read was announced with but has not delivered yet.
    fn outstanding(&self) -> usize {
        self.payload_len.map_or(0, |len| len - self.payload.len())
    }

    /// Whether the peer proved it holds the job token (never, where none is set).
    fn authenticated(&self) -> bool {
        matches!(self.phase, Phase::Authenticated)
    }

    /// Largest payload of a frame of type `kind` in the current phase.
    fn cap(&self, kind: u8) -> usize {
        match (kind, &self.token) {
            (SEND_MD, None) => UNAUTHENTICATED_MAX_METADATA_BYTES,
            (SEND_MD, Some(_)) if self.authenticated() => MAX_METADATA_BYTES,
            _ => PRE_AUTH_MAX_BYTES,
        }
    }

    /// Why a frame of `len` bytes over `cap` is refused: for a metadata push where no
    /// token is set, with what lifts the limit.
    fn over_cap(&self, kind: u8, len: usize, cap: usize) -> Error {
        if kind == SEND_MD && self.token.is_none() {
            Error::MalformedMetadata(format!(
                "a metadata push of {len} bytes exceeds the {cap} bytes this listener reads \
                 without a job token: set the same NIXL_JOB_TOKEN (AgentConfig::job_token) \
                 on every agent of the job (then up to {MAX_METADATA_BYTES} bytes), or \
                 exchange metadata through etcd"
            ))
        } else {
            Error::MalformedMetadata(format!("frame of {len} bytes exceeds the {cap}-byte limit"))
        }
    }

    /// Takes bytes read from the connection (at most [`Session::wanted`], or at most the
    /// rest of one frame); returns what to do once a whole frame is in.
    fn received(&mut self, mut data: &[u8]) -> Option<Outcome> {
        let len = match self.payload_len {
            Some(len) => len,
            None => {
                let take = data.len().min(FRAME_HEADER_BYTES - self.header_in);
                self.header[self.header_in..self.header_in + take].copy_from_slice(&data[..take]);
                self.header_in += take;
                data = &data[take..];
                if self.header_in < FRAME_HEADER_BYTES {
                    return None;
                }
                // The type decides the cap: a known request type must be seen before a
                // large frame is read at all.
                let kind = self.header[4];
                if !matches!(kind, SEND_MD | FETCH_MD | INVALIDATE | HELLO | AUTH) {
                    return Some(refuse(Error::MalformedMetadata(format!(
                        "unknown request type {kind}"
                    ))));
                }
                let len = match parse_header(&self.header, usize::MAX) {
                    Ok((_, len)) => len,
                    Err(e) => return Some(refuse(e)),
                };
                let cap = self.cap(kind);
                if len > cap {
                    return Some(refuse(self.over_cap(kind, len, cap)));
                }
                if self.payload.try_reserve_exact(len).is_err() {
                    return Some(refuse(Error::InvalidParam(format!(
                        "no memory for a frame of {len} bytes"
                    ))));
                }
                self.payload_len = Some(len);
                len
            }
        };
        let take = data.len().min(len - self.payload.len());
        self.payload.extend_from_slice(&data[..take]);
        if self.payload.len() < len {
            return None;
        }
        let header = self.header;
        let payload = std::mem::take(&mut self.payload);
        self.header_in = 0;
        self.payload_len = None;
        if let Err(e) = check_frame(&header, &payload) {
            return Some(refuse(e));
        }
        self.frame_in(header[4], payload)
    }

    fn frame_in(&mut self, kind: u8, payload: Vec<u8>) -> Option<Outcome> {
        let Some(token) = self.token.clone() else {
            return Some(match kind {
                HELLO | AUTH => refuse_auth(
                    "this listener has no job token: set the same NIXL_JOB_TOKEN \
                     (AgentConfig::job_token) on every agent of the job, or on none",
                ),
                _ => Outcome::Request { kind, payload },
            });
        };
        match std::mem::replace(&mut self.phase, Phase::Start) {
            Phase::Start => {
                if kind != HELLO {
                    return Some(refuse_auth(
                        "this listener requires the job token (NIXL_JOB_TOKEN, \
                         AgentConfig::job_token): the request was not served",
                    ));
                }
                let Ok(client_nonce) = <[u8; NONCE_BYTES]>::try_from(payload.as_slice()) else {
                    return Some(refuse_auth("a malformed job token handshake"));
                };
                let mut server_nonce = [0u8; NONCE_BYTES];
                if let Err(e) = random_bytes(&mut server_nonce) {
                    return Some(refuse(Error::Io(e)));
                }
                let mut challenge = server_nonce.to_vec();
                challenge.extend(token.prove(SERVER_PROOF, &client_nonce, &server_nonce));
                self.phase = Phase::Challenged {
                    client_nonce,
                    server_nonce,
                };
                Some(Outcome::Continue(frame(CHALLENGE, &challenge)))
            }
            Phase::Challenged {
                client_nonce,
                server_nonce,
            } => {
                if kind == AUTH
                    && token.verify(CLIENT_PROOF, &client_nonce, &server_nonce, &payload)
                {
                    self.phase = Phase::Authenticated;
                    None
                } else {
                    Some(refuse_auth(
                        "the job token does not match this listener's: the request was not served",
                    ))
                }
            }
            Phase::Authenticated => {
                if matches!(kind, HELLO | AUTH) {
                    return Some(refuse_auth("a second job token handshake"));
                }
                self.phase = Phase::Authenticated;
                Some(Outcome::Request { kind, payload })
            }
        }
    }
}

fn refuse(e: Error) -> Outcome {
    Outcome::Refuse(frame(ERROR, e.to_string().as_bytes()), e)
}

fn refuse_auth(why: &str) -> Outcome {
    Outcome::Refuse(
        frame(AUTH_FAILED, why.as_bytes()),
        Error::Unauthenticated(why.to_string()),
    )
}

/// Serves one request of a connection from `from`; returns the reply frame.
fn handle_request(agent: &Agent, kind: u8, payload: &[u8], from: SocketAddr) -> Vec<u8> {
    let reply = match kind {
        SEND_MD => agent
            .load_metadata_from(payload, MdSource::Pushed(from))
            .map(|_| (ACK, Vec::new())),
        FETCH_MD => agent.local_metadata().map(|md| (MD_REPLY, md)),
        INVALIDATE => match std::str::from_utf8(payload) {
            // Unknown is fine: the goal (not knowing that agent) holds.
            Ok(name) => match agent.invalidate_remote_from(name, from) {
                Ok(()) | Err(Error::UnknownAgent(_)) => Ok((ACK, Vec::new())),
                Err(e) => Err(e),
            },
            Err(_) => Err(Error::MalformedMetadata("agent name is not UTF-8".into())),
        },
        other => Err(Error::MalformedMetadata(format!(
            "unknown request type {other}"
        ))),
    };
    match reply {
        Ok((kind, payload)) => frame(kind, &payload),
        Err(e) => {
            tracing::debug!(%from, error = %e, "metadata request refused");
            frame(ERROR, e.to_string().as_bytes())
        }
    }
}

// ---- the socket loop ----------------------------------------------------------------------

/// The running listener; stops when dropped (with its agent).
#[derive(Debug)]
pub(crate) struct Listener {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Wakes the loop, which sleeps until a connection, a finished request, a deadline
    /// or this (no periodic wake-ups: on a soft-RoCE guest every wake-up takes CPU from
    /// the transfers).
    wake: Arc<WakeFd>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    pub(crate) fn start(agent: &Agent, addr: SocketAddr) -> Result<Self> {
        let socket = TcpListener::bind(addr)?;
        // A deeper accept queue than std's 128: a burst of connections (a flood, or many
        // peers starting at once) queues in the kernel instead of having its SYNs dropped,
        // which a legitimate client pays for with a 1 s retransmission or a timeout. Linux
        // takes a second listen() on a listening socket as a new backlog (capped by
        // net.core.somaxconn).
        // SAFETY: listen() on a socket this function owns; no memory is passed.
        if unsafe { libc::listen(socket.as_raw_fd(), ACCEPT_BACKLOG) } != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "metadata listener: keeping the default accept queue"
            );
        }
        socket.set_nonblocking(true)?;
        let addr = socket.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let wake = Arc::new(WakeFd::new()?);
        let state = LoopState {
            agent: Arc::downgrade(&agent.inner),
            token: agent.config().job_token.clone(),
            timeout: agent.config().metadata_timeout,
            stop: stop.clone(),
            wake: wake.clone(),
            finished: Arc::default(),
            workers: Arc::default(),
            conns: HashMap::new(),
            per_ip: HashMap::new(),
            chunk: Vec::new(),
            trim_due: false,
            last_trim: Instant::now(),
            queue: VecDeque::new(),
            next_id: 0,
        };
        let thread = std::thread::Builder::new()
            .name(format!("nixl-listen-{}", agent.name()))
            .spawn(move || state.run(&socket))?;
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
            // The listener may be dropped from its own thread; joining oneself would
            // deadlock.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

/// What a connection is doing.
#[derive(Debug)]
enum Stage {
    /// Reading the handshake and the request.
    Reading,
    /// Its request (of this many bytes) waits for a worker or is being served.
    Serving(usize),
    /// Writing `out` (from `sent` on); then reading on, or closing.
    Writing {
        out: Vec<u8>,
        sent: usize,
        then_close: bool,
    },
}

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    from: SocketAddr,
    opened: Instant,
    /// The request must be in (or the reply out) by then.
    deadline: Instant,
    session: Session,
    stage: Stage,
}

impl Conn {
    /// Frame bytes it holds.
    fn held(&self) -> usize {
        self.session.buffered()
            + match &self.stage {
                Stage::Reading => 0,
                Stage::Serving(n) => *n,
                Stage::Writing { out, .. } => out.len(),
            }
    }

    /// Request bytes it holds while its peer has not authenticated: the frame being
    /// read, or the request waiting for a worker or being served.
    fn unauthenticated_held(&self) -> usize {
        if self.session.authenticated() {
            return 0;
        }
        self.session.buffered()
            + match &self.stage {
                Stage::Serving(n) => *n,
                Stage::Reading | Stage::Writing { .. } => 0,
            }
    }

    fn reading(&self) -> bool {
        matches!(self.stage, Stage::Reading)
            || matches!(
                self.stage,
                Stage::Writing {
                    then_close: false,
                    ..
                }
            )
    }
}

/// A served request's reply frame, for connection `.0`.
type Finished = (u64, Vec<u8>);

/// The listener thread's state.
struct LoopState {
    agent: Weak<AgentInner>,
    token: Option<JobToken>,
    timeout: Duration,
    stop: Arc<AtomicBool>,
    wake: Arc<WakeFd>,
    /// Replies of served requests, by connection id (workers push, the loop takes).
    finished: Arc<Mutex<Vec<Finished>>>,
    /// Workers running.
    workers: Arc<AtomicUsize>,
    conns: HashMap<u64, Conn>,
    /// Connections open per source address (kept with `conns`, so that admitting one is
    /// not a walk over all of them: a flood of connections makes many admissions).
    per_ip: HashMap<IpAddr, usize>,
    /// The read buffer, reused (a slow sender's every byte is a read).
    chunk: Vec<u8>,
    /// A large frame was freed since the last [`LoopState::trim`].
    trim_due: bool,
    last_trim: Instant,
    /// Requests waiting for a worker.
    queue: VecDeque<(u64, u8, Vec<u8>)>,
    next_id: u64,
}

impl LoopState {
    fn run(mut self, socket: &TcpListener) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut ids: Vec<u64> = Vec::new();
        while !self.stop.load(Ordering::SeqCst) {
            fds.clear();
            ids.clear();
            fds.push(pollfd_in(socket.as_raw_fd()));
            fds.push(pollfd_in(self.wake.as_raw_fd()));
            for (id, conn) in &self.conns {
                let events = match conn.stage {
                    Stage::Reading => libc::POLLIN | libc::POLLRDHUP,
                    Stage::Writing { .. } => libc::POLLOUT,
                    Stage::Serving(_) => continue,
                };
                fds.push(libc::pollfd {
                    fd: conn.stream.as_raw_fd(),
                    events,
                    revents: 0,
                });
                ids.push(*id);
            }
            let now = Instant::now();
            let timeout_ms = self
                .conns
                .values()
                .filter(|c| !matches!(c.stage, Stage::Serving(_)))
                .map(|c| c.deadline)
                .min()
                .map_or(-1, |d| {
                    // Rounded up, so the loop does not spin just before a deadline.
                    let ms = d.saturating_duration_since(now).as_micros().div_ceil(1000);
                    i32::try_from(ms).unwrap_or(i32::MAX)
                });
            // SAFETY: `fds` is a live array of `fds.len()` pollfds for the whole call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::warn!(error = %e, "metadata listener poll failed");
                    std::thread::sleep(Duration::from_millis(20));
                }
                continue;
            }
            if fds[1].revents != 0 {
                self.wake.drain();
            }
            self.take_finished();
            for (fd, id) in fds[2..].iter().zip(&ids) {
                if fd.revents != 0 {
                    self.progress(*id);
                }
            }
            if fds[0].revents != 0 {
                self.accept_all(socket);
            }
            // A connection whose budget ran out with bytes still in its socket is readable
            // at the next poll, which then returns at once.
            self.expire();
            self.start_workers();
            self.trim();
        }
    }

    /// Gives the allocator's free memory back to the system after large frames were
    /// freed (at most every [`TRIM_INTERVAL`]). Frames of junk are allocated at the size
    /// their header announces and freed when refused; glibc keeps freed blocks under its
    /// (growing) mmap threshold in the heap, so without this a stream of them left the
    /// process's resident memory at a multiple of the bytes it ever held at once.
    fn trim(&mut self) {
        if !self.trim_due || self.last_trim.elapsed() < TRIM_INTERVAL {
            return;
        }
        self.trim_due = false;
        self.last_trim = Instant::now();
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: malloc_trim takes no pointer and only returns free memory.
            unsafe { libc::malloc_trim(0) };
        }
    }

    fn accept_all(&mut self, socket: &TcpListener) {
        loop {
            match socket.accept() {
                Ok((stream, from)) => self.admit(stream, from),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // E.g. out of descriptors: the connection stays in the backlog.
                    tracing::warn!(error = %e, "metadata listener accept failed");
                    return;
                }
            }
        }
    }

    /// Takes a new connection in, making room under the per-address and total limits.
    fn admit(&mut self, stream: TcpStream, from: SocketAddr) {
        let ip = from.ip();
        if self.per_ip.get(&ip).copied().unwrap_or(0) >= MAX_CONNECTIONS_PER_IP
            && !self.evict_oldest_reading(Some(ip))
        {
            tracing::warn!(%from, "metadata listener: too many connections from this address");
            return;
        }
        if self.conns.len() >= MAX_CONNECTIONS {
            let busiest = self.busiest_ip();
            if !self.evict_oldest_reading(busiest) && !self.evict_oldest_reading(None) {
                tracing::warn!(%from, "metadata listener: too many connections");
                return;
            }
        }
        if let Err(e) = stream
            .set_nonblocking(true)
            .and_then(|()| stream.set_nodelay(true))
        {
            tracing::debug!(%from, error = %e, "metadata listener: connection set-up failed");
            return;
        }
        let now = Instant::now();
        let id = self.next_id;
        self.next_id += 1;
        *self.per_ip.entry(ip).or_default() += 1;
        self.conns.insert(
            id,
            Conn {
                stream,
                from,
                opened: now,
                deadline: now + self.timeout,
                session: Session::new(self.token.clone()),
                stage: Stage::Reading,
            },
        );
        // Often the request is already there: read it now.
        self.progress(id);
    }

    fn busiest_ip(&self) -> Option<IpAddr> {
        self.per_ip
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(ip, _)| *ip)
    }

    /// Closes the oldest connection (of `ip`, if given) that is still sending its
    /// request; `false` if there is none.
    fn evict_oldest_reading(&mut self, ip: Option<IpAddr>) -> bool {
        let victim = self
            .conns
            .iter()
            .filter(|(_, c)| c.reading() && ip.is_none_or(|ip| c.from.ip() == ip))
            .min_by_key(|(_, c)| c.opened)
            .map(|(id, _)| *id);
        match victim {
            Some(id) => {
                self.close(id, "closed to make room for a newer connection");
                true
            }
            None => false,
        }
    }

    fn close(&mut self, id: u64, why: &str) {
        if let Some(conn) = self.conns.remove(&id) {
            self.trim_due |= conn.held() >= TRIM_FRAME_BYTES;
            let ip = conn.from.ip();
            if let Some(n) = self.per_ip.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.per_ip.remove(&ip);
                }
            }
            tracing::debug!(from = %conn.from, why, "metadata listener connection closed");
        }
    }

    /// Frame bytes held by every connection.
    fn held(&self) -> usize {
        self.conns.values().map(Conn::held).sum()
    }

    /// Request bytes held for peers that have not authenticated.
    fn unauthenticated_held(&self) -> usize {
        self.conns.values().map(Conn::unauthenticated_held).sum()
    }

    /// Whether the bytes held are over [`MAX_BUFFERED_BYTES`], and whether those of
    /// unauthenticated peers are over [`UNAUTHENTICATED_BUFFERED_BYTES`].
    fn over_budget(&self) -> (bool, bool) {
        (
            self.held() > MAX_BUFFERED_BYTES,
            self.unauthenticated_held() > UNAUTHENTICATED_BUFFERED_BYTES,
        )
    }

    /// Reads or writes what a connection's socket is ready for.
    fn progress(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        match &mut conn.stage {
            Stage::Serving(_) => {}
            Stage::Writing {
                out,
                sent,
                then_close,
            } => loop {
                match conn.stream.write(&out[*sent..]) {
                    Ok(0) => return self.close(id, "the peer stopped taking the reply"),
                    Ok(n) => {
                        *sent += n;
                        if *sent == out.len() {
                            if *then_close {
                                return self.close(id, "exchange done");
                            }
                            conn.stage = Stage::Reading;
                            return self.progress(id);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return self.close(id, "the reply could not be written"),
                }
            },
            Stage::Reading => self.read(id),
        }
    }

    fn read(&mut self, id: u64) {
        let mut chunk = std::mem::take(&mut self.chunk);
        chunk.resize(READ_CHUNK, 0);
        self.read_with(id, &mut chunk);
        if self.chunk.is_empty() {
            self.chunk = chunk;
        }
    }

    fn read_with(&mut self, id: u64, chunk: &mut [u8]) {
        let mut budget = READ_BUDGET;
        loop {
            if budget == 0 {
                return;
            }
            let Some(conn) = self.conns.get_mut(&id) else {
                return;
            };
            let want = conn.session.wanted().min(READ_CHUNK);
            let n = match conn.stream.read(&mut chunk[..want]) {
                Ok(0) => return self.close(id, "the peer closed its side"),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return self.close(id, "read failed"),
            };
            budget = budget.saturating_sub(n);
            let buffered = conn.session.buffered();
            let outcome = conn.session.received(&chunk[..n]);
            // Only a frame's header allocates (its whole payload, once): the sum over all
            // connections is taken then, not on every byte a slow sender sends.
            let grew = conn.session.buffered() > buffered;
            // A large frame done with (refused, or handed on to be served): freed here
            // or by its worker.
            self.trim_due |= buffered >= TRIM_FRAME_BYTES && conn.session.buffered() == 0;
            let from = conn.from;
            match outcome {
                None => {
                    if grew && self.over_budget() != (false, false) {
                        self.shed_load();
                    }
                }
                Some(Outcome::Continue(out)) => {
                    conn.stage = Stage::Writing {
                        out,
                        sent: 0,
                        then_close: false,
                    };
                    return self.progress(id);
                }
                Some(Outcome::Refuse(out, e)) => {
                    tracing::debug!(%from, error = %e, "metadata request refused");
                    conn.stage = Stage::Writing {
                        out,
                        sent: 0,
                        then_close: true,
                    };
                    conn.deadline = Instant::now() + self.timeout;
                    return self.progress(id);
                }
                Some(Outcome::Request { kind, payload }) => {
                    conn.stage = Stage::Serving(payload.len());
                    self.queue.push_back((id, kind, payload));
                    self.start_workers();
                    return;
                }
            }
        }
    }

    /// Over [`MAX_BUFFERED_BYTES`] or [`UNAUTHENTICATED_BUFFERED_BYTES`]: closes
    /// connections with unfinished requests (of unauthenticated peers, where only their
    /// share is over), those that still owe the most bytes first, until under both.
    fn shed_load(&mut self) {
        loop {
            let (over_all, over_unauthenticated) = self.over_budget();
            if !over_all && !over_unauthenticated {
                return;
            }
            // The one that still owes the most bytes: a frame announced large and never
            // sent goes before one that is streaming in.
            let largest = self
                .conns
                .iter()
                .filter(|(_, c)| {
                    // Closing one that holds nothing would not help.
                    matches!(c.stage, Stage::Reading)
                        && c.session.buffered() > 0
                        && (over_all || !c.session.authenticated())
                })
                .max_by_key(|(_, c)| (c.session.outstanding(), c.session.buffered()))
                .map(|(id, _)| *id);
            match largest {
                Some(id) => self.close(
                    id,
                    "the listener holds too many bytes: the largest unfinished request is dropped",
                ),
                None => return,
            }
        }
    }

    /// Closes connections past their deadline.
    fn expire(&mut self) {
        let now = Instant::now();
        let late: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| !matches!(c.stage, Stage::Serving(_)) && c.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            self.close(
                id,
                "deadline passed (request not in, or reply not taken, in time)",
            );
        }
    }

    /// Hands waiting requests to workers, up to [`MAX_WORKERS`] at once.
    fn start_workers(&mut self) {
        while self.workers.load(Ordering::SeqCst) < MAX_WORKERS {
            let Some((id, kind, payload)) = self.queue.pop_front() else {
                return;
            };
            let Some(from) = self.conns.get(&id).map(|c| c.from) else {
                continue;
            };
            let Some(inner) = self.agent.upgrade() else {
                self.stop.store(true, Ordering::SeqCst);
                return;
            };
            self.workers.fetch_add(1, Ordering::SeqCst);
            let (finished, workers, wake) = (
                self.finished.clone(),
                self.workers.clone(),
                self.wake.clone(),
            );
            let spawned = std::thread::Builder::new()
                .name("nixl-listen-req".into())
                .spawn(move || {
                    let agent = inner.agent();
                    drop(inner);
                    let reply = handle_request(&agent, kind, &payload, from);
                    drop(payload);
                    finished.lock().push((id, reply));
                    workers.fetch_sub(1, Ordering::SeqCst);
                    let _ = wake.signal();
                    // May be the agent's last handle: its listener stops (not from this
                    // thread's join).
                    drop(agent);
                });
            if spawned.is_err() {
                self.workers.fetch_sub(1, Ordering::SeqCst);
                self.close(id, "no thread to serve the request");
            }
        }
    }

    /// Moves finished replies to their connections.
    fn take_finished(&mut self) {
        let done = std::mem::take(&mut *self.finished.lock());
        for (id, reply) in done {
            let over = self.held() + reply.len() > MAX_BUFFERED_BYTES;
            let Some(conn) = self.conns.get_mut(&id) else {
                continue;
            };
            let reply = if over {
                frame(
                    ERROR,
                    b"the metadata listener holds too many bytes to send this reply: retry",
                )
            } else {
                reply
            };
            conn.stage = Stage::Writing {
                out: reply,
                sent: 0,
                then_close: true,
            };
            conn.deadline = Instant::now() + self.timeout;
            self.progress(id);
        }
    }
}

/// Fuzzing entry point (not a stable API): serves `input` as one connection's bytes from
/// 127.0.0.1, as the listener does for a peer (with the agent's job token, if it has
/// one), and returns what it would send back. Then reads the reply the way a requesting
/// agent does, so both directions of the framing run.
#[doc(hidden)]
pub fn fuzz_serve(agent: &Agent, input: &[u8]) -> Vec<u8> {
    let from = SocketAddr::from(([127, 0, 0, 1], 0));
    let mut session = Session::new(agent.config().job_token.clone());
    let mut output = Vec::new();
    let mut rest = input;
    while !rest.is_empty() {
        let (chunk, after) = rest.split_at(session.wanted().min(rest.len()));
        rest = after;
        match session.received(chunk) {
            None => {}
            Some(Outcome::Continue(out)) => output.extend(out),
            Some(Outcome::Refuse(out, _)) => {
                output.extend(out);
                break;
            }
            Some(Outcome::Request { kind, payload }) => {
                output.extend(handle_request(agent, kind, &payload, from));
                break;
            }
        }
    }
    let mut reply = &output[..];
    while !reply.is_empty() {
        let (kind, _) =
            read_frame(&mut reply, MAX_METADATA_BYTES).expect("the listener's own reply parses");
        assert!(
            matches!(kind, ACK | MD_REPLY | ERROR | CHALLENGE | AUTH_FAILED),
            "the listener replied with type {kind}"
        );
    }
    output
}

// ---- the requesting side --------------------------------------------------------------------

/// A blocking stream whose every read and write ends by one deadline (not a timeout per
/// call, which a slow peer would renew with each byte).
struct DeadlineIo<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl DeadlineIo<'_> {
    fn arm(&self, read: bool) -> std::io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the exchange's deadline passed",
            ));
        }
        if read {
            self.stream.set_read_timeout(Some(left))
        } else {
            self.stream.set_write_timeout(Some(left))
        }
    }
}

impl Read for DeadlineIo<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.arm(true)?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for DeadlineIo<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.arm(false)?;
        (&mut &*self.stream).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        (&mut &*self.stream).flush()
    }
}

/// The address an exchange to `dest` should leave from: the IP of this agent's own
/// listener where it is bound to one (so the peer sees this agent at the address it
/// knows it at), if that address can reach `dest` (same family; loopback only to
/// loopback).
fn source_ip(dest: SocketAddr, listener: Option<SocketAddr>) -> Option<IpAddr> {
    let ip = listener?.ip();
    (!ip.is_unspecified()
        && ip.is_ipv4() == dest.is_ipv4()
        && ip.is_loopback() == dest.ip().is_loopback())
    .then_some(ip)
}

fn connect(dest: SocketAddr, source: Option<IpAddr>, timeout: Duration) -> Result<TcpStream> {
    if let Some(ip) = source {
        let bound = (|| {
            let socket = socket2::Socket::new(
                socket2::Domain::for_address(dest),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            socket.bind(&SocketAddr::new(ip, 0).into())?;
            socket.connect_timeout(&dest.into(), timeout)?;
            Ok::<_, std::io::Error>(TcpStream::from(socket))
        })();
        match bound {
            Ok(stream) => return Ok(stream),
            Err(e) => tracing::debug!(%dest, source = %ip, error = %e,
                "connecting from the listener's address failed; connecting from any"),
        }
    }
    TcpStream::connect_timeout(&dest, timeout).map_err(timeout_error)
}

impl Agent {
    fn exchange(&self, addr: SocketAddr, kind: u8, payload: &[u8]) -> Result<(u8, Vec<u8>)> {
        let timeout = self.config().metadata_timeout;
        let deadline = Instant::now() + timeout;
        let stream = connect(addr, source_ip(addr, self.listen_addr()), timeout)?;
        stream.set_nodelay(true)?;
        let mut io = DeadlineIo {
            stream: &stream,
            deadline,
        };
        if let Some(token) = &self.config().job_token {
            let mut client_nonce = [0u8; NONCE_BYTES];
            random_bytes(&mut client_nonce)?;
            write_frame(&mut io, HELLO, &client_nonce)?;
            let (reply, body) = read_frame(&mut io, PRE_AUTH_MAX_BYTES)?;
            let server_nonce = match (reply, body.len()) {
                (CHALLENGE, n) if n == NONCE_BYTES + MAC_BYTES => {
                    let (server_nonce, proof) = body.split_at(NONCE_BYTES);
                    if !token.verify(SERVER_PROOF, &client_nonce, server_nonce, proof) {
                        return Err(Error::Unauthenticated(format!(
                            "the listener at {addr} does not hold this job's token"
                        )));
                    }
                    server_nonce.to_vec()
                }
                (AUTH_FAILED | ERROR, _) => {
                    return Err(Error::Unauthenticated(format!(
                        "the listener at {addr} refused the job token handshake: {}",
                        String::from_utf8_lossy(&body)
                    )))
                }
                (other, n) => {
                    return Err(Error::MalformedMetadata(format!(
                        "unexpected handshake reply type {other} of {n} bytes"
                    )))
                }
            };
            write_frame(
                &mut io,
                AUTH,
                &token.prove(CLIENT_PROOF, &client_nonce, &server_nonce),
            )?;
        }
        write_frame(&mut io, kind, payload)?;
        let (reply, body) = read_frame(&mut io, MAX_METADATA_BYTES)?;
        match reply {
            ERROR => Err(Error::Backend {
                backend: "listener".into(),
                code: 0,
                message: format!("peer at {addr} refused: {}", String::from_utf8_lossy(&body)),
            }),
            AUTH_FAILED => Err(Error::Unauthenticated(format!(
                "the listener at {addr}: {}",
                String::from_utf8_lossy(&body)
            ))),
            _ => Ok((reply, body)),
        }
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
    ///
    /// The connection leaves from this agent's own listener address where that is bound
    /// to a specific IP: the peer attributes later pushes and invalidations to this agent
    /// by that address (see "Binding" on [`Agent::load_remote_metadata`]).
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
    /// The peer is then known at `addr`'s IP: its pushes and invalidations are accepted
    /// from there.
    #[doc(alias = "fetchRemoteMD")]
    pub fn fetch_remote_metadata(&self, addr: SocketAddr) -> Result<String> {
        match self.exchange(addr, FETCH_MD, &[])? {
            (MD_REPLY, blob) => self.load_metadata_from(&blob, MdSource::Fetched(addr)),
            (other, _) => Err(Error::MalformedMetadata(format!(
                "unexpected reply type {other}"
            ))),
        }
    }

    /// Tells the agent at `addr` to forget this one. It does so only if the connection
    /// comes from an address it knows this agent at (see "Binding" on
    /// [`Agent::load_remote_metadata`]).
    #[doc(alias = "invalidateLocalMD")]
    pub fn invalidate_local_metadata(&self, addr: SocketAddr) -> Result<()> {
        self.expect_ack(addr, INVALIDATE, self.name().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(
            read_frame(&mut b, MAX_METADATA_BYTES).unwrap(),
            (SEND_MD, b"hello".to_vec())
        );
    }

    #[test]
    fn oversized_and_truncated_frames_are_typed_errors() {
        let (mut a, mut b) = pair();
        let mut header = frame_header(SEND_MD, b"").unwrap();
        header[5..FRAME_CHECK_AT].copy_from_slice(&u32::MAX.to_le_bytes());
        a.write_all(&header).unwrap();
        assert!(
            matches!(read_frame(&mut b, MAX_METADATA_BYTES), Err(Error::MalformedMetadata(m)) if m.contains("exceeds"))
        );

        let (mut a, mut b) = pair();
        let header = frame_header(SEND_MD, &[0; 100]).unwrap();
        a.write_all(&header).unwrap();
        a.write_all(&[0; 10]).unwrap();
        drop(a);
        assert!(
            matches!(read_frame(&mut b, MAX_METADATA_BYTES), Err(Error::MalformedMetadata(m)) if m.contains("truncated"))
        );

        let (mut a, mut b) = pair();
        a.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        assert!(matches!(
            read_frame(&mut b, MAX_METADATA_BYTES),
            Err(Error::MalformedMetadata(_))
        ));
    }

    #[test]
    fn every_corrupted_frame_is_refused() {
        let good = frame(INVALIDATE, b"prefill-7");
        assert_eq!(
            read_frame(&mut &good[..], MAX_METADATA_BYTES).unwrap(),
            (INVALIDATE, b"prefill-7".to_vec())
        );
        for i in 0..good.len() {
            for flip in [0x01u8, 0x10, 0x80, 0xff] {
                let mut bad = good.clone();
                bad[i] ^= flip;
                match read_frame(&mut &bad[..], MAX_METADATA_BYTES) {
                    Err(Error::MalformedMetadata(_)) => {}
                    other => panic!("byte {i} ^ {flip:#x} was not refused: {other:?}"),
                }
            }
        }
        let mut bad = good.clone();
        bad[FRAME_HEADER_BYTES] ^= 1;
        assert!(matches!(
            read_frame(&mut &bad[..], MAX_METADATA_BYTES),
            Err(Error::MalformedMetadata(m)) if m.contains("integrity check")
        ));
        // What version 1 sent: no check field.
        let mut v1 = b"NXP1".to_vec();
        v1.push(INVALIDATE);
        v1.extend_from_slice(&9u32.to_le_bytes());
        v1.extend_from_slice(b"prefill-7");
        assert!(matches!(
            read_frame(&mut &v1[..], MAX_METADATA_BYTES),
            Err(Error::MalformedMetadata(m)) if m.contains("version 1 has no integrity check")
        ));
    }

    fn agent_with(token: Option<&str>) -> Agent {
        Agent::new(
            "frame-check",
            crate::AgentConfig {
                job_token: token.map(|t| JobToken::new(t).unwrap()),
                ..crate::AgentConfig::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn a_corrupted_request_is_refused_with_the_reason() {
        let agent = agent_with(None);
        let mut request = frame_header(INVALIDATE, b"x").unwrap().to_vec();
        request.push(b'y'); // the payload changed after the check was computed
        let reply = fuzz_serve(&agent, &request);
        let (kind, body) = read_frame(&mut &reply[..], MAX_METADATA_BYTES).unwrap();
        assert_eq!(kind, ERROR);
        let text = String::from_utf8(body).unwrap();
        assert!(text.contains("integrity check"), "{text}");
    }

    #[test]
    fn a_large_frame_other_than_a_metadata_push_is_refused_from_its_header() {
        let mut session = Session::new(None);
        let mut header = frame_header(FETCH_MD, b"").unwrap();
        header[5..FRAME_CHECK_AT].copy_from_slice(&(PRE_AUTH_MAX_BYTES as u32 + 1).to_le_bytes());
        match session.received(&header) {
            Some(Outcome::Refuse(_, Error::MalformedMetadata(m))) => {
                assert!(m.contains("exceeds"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        // An unknown type is refused before its payload is read.
        let mut session = Session::new(None);
        let header = frame_header(42, &[0; 1000]).unwrap();
        assert!(matches!(
            session.received(&header),
            Some(Outcome::Refuse(_, Error::MalformedMetadata(m))) if m.contains("unknown request type")
        ));
        // A metadata push may be large, but only after authentication where a token is set.
        let mut header = frame_header(SEND_MD, b"").unwrap();
        header[5..FRAME_CHECK_AT].copy_from_slice(&(1u32 << 20).to_le_bytes());
        let mut open = Session::new(None);
        assert!(open.received(&header).is_none());
        assert_eq!(open.wanted(), 1 << 20);
        let mut guarded = Session::new(Some(JobToken::new("t").unwrap()));
        assert!(matches!(
            guarded.received(&header),
            Some(Outcome::Refuse(_, Error::MalformedMetadata(m))) if m.contains("exceeds")
        ));
    }

    #[test]
    fn without_a_token_a_push_over_the_unauthenticated_cap_is_refused_naming_the_token() {
        let push = |len: usize| {
            let mut header = frame_header(SEND_MD, b"").unwrap();
            header[5..FRAME_CHECK_AT].copy_from_slice(&(len as u32).to_le_bytes());
            header
        };
        // At the cap: read (one allocation of the announced length).
        let mut open = Session::new(None);
        assert!(open
            .received(&push(UNAUTHENTICATED_MAX_METADATA_BYTES))
            .is_none());
        assert_eq!(open.wanted(), UNAUTHENTICATED_MAX_METADATA_BYTES);
        assert_eq!(open.buffered(), UNAUTHENTICATED_MAX_METADATA_BYTES);
        // Over it: refused from the header, nothing allocated, the fix named.
        let mut open = Session::new(None);
        match open.received(&push(UNAUTHENTICATED_MAX_METADATA_BYTES + 1)) {
            Some(Outcome::Refuse(_, Error::MalformedMetadata(m))) => {
                assert!(m.contains("NIXL_JOB_TOKEN"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(open.buffered(), 0);
        // Authenticated with the token: up to MAX_METADATA_BYTES.
        let token = JobToken::new("job").unwrap();
        let mut guarded = Session::new(Some(token.clone()));
        assert!(handshake(&mut guarded, &token).is_none());
        assert!(guarded.authenticated());
        assert!(guarded.received(&push(MAX_METADATA_BYTES)).is_none());
        assert_eq!(guarded.wanted(), MAX_METADATA_BYTES);
    }

    /// Runs the client's side of the handshake against a session, as `exchange` does.
    fn handshake(session: &mut Session, client: &JobToken) -> Option<Outcome> {
        let client_nonce = [7u8; NONCE_BYTES];
        let Some(Outcome::Continue(challenge)) = session.received(&frame(HELLO, &client_nonce))
        else {
            panic!("no challenge");
        };
        let (kind, body) = read_frame(&mut &challenge[..], PRE_AUTH_MAX_BYTES).unwrap();
        assert_eq!(kind, CHALLENGE);
        let (server_nonce, proof) = body.split_at(NONCE_BYTES);
        let server_knows = client.verify(SERVER_PROOF, &client_nonce, server_nonce, proof);
        let answer = client.prove(CLIENT_PROOF, &client_nonce, server_nonce);
        let outcome = session.received(&frame(AUTH, &answer));
        assert_eq!(server_knows, outcome.is_none(), "both sides agree");
        outcome
    }

    #[test]
    fn the_job_token_handshake_admits_holders_only() {
        let token = JobToken::new("job-42").unwrap();
        let mut session = Session::new(Some(token.clone()));
        assert!(handshake(&mut session, &token).is_none());
        match session.received(&frame(FETCH_MD, b"")) {
            Some(Outcome::Request { kind, .. }) => assert_eq!(kind, FETCH_MD),
            other => panic!("{other:?}"),
        }
        let mut session = Session::new(Some(token.clone()));
        assert!(matches!(
            handshake(&mut session, &JobToken::new("job-43").unwrap()),
            Some(Outcome::Refuse(_, Error::Unauthenticated(_)))
        ));
        // No handshake at all: refused before the request is looked at.
        let mut session = Session::new(Some(token.clone()));
        assert!(matches!(
            session.received(&frame(FETCH_MD, b"")),
            Some(Outcome::Refuse(_, Error::Unauthenticated(m))) if m.contains("requires the job token")
        ));
        // A replayed proof fails: the server's nonce is fresh.
        let mut first = Session::new(Some(token.clone()));
        let Some(Outcome::Continue(c1)) = first.received(&frame(HELLO, &[1; NONCE_BYTES])) else {
            panic!()
        };
        let mut second = Session::new(Some(token.clone()));
        let Some(Outcome::Continue(c2)) = second.received(&frame(HELLO, &[1; NONCE_BYTES])) else {
            panic!()
        };
        assert_ne!(c1, c2);
        let (_, body) = read_frame(&mut &c1[..], PRE_AUTH_MAX_BYTES).unwrap();
        let proof_for_first = token.prove(CLIENT_PROOF, &[1; NONCE_BYTES], &body[..NONCE_BYTES]);
        assert!(matches!(
            second.received(&frame(AUTH, &proof_for_first)),
            Some(Outcome::Refuse(_, Error::Unauthenticated(_)))
        ));
        // A listener without a token says so to a client with one.
        let mut open = Session::new(None);
        assert!(matches!(
            open.received(&frame(HELLO, &[0; NONCE_BYTES])),
            Some(Outcome::Refuse(_, Error::Unauthenticated(m))) if m.contains("no job token")
        ));
        assert_eq!(format!("{token:?}"), "JobToken(<redacted>)");
        assert!(JobToken::new("").is_err());
    }

    #[test]
    fn exchanges_with_and_without_a_token() {
        let config = |token: Option<&str>| crate::AgentConfig {
            listen_addr: Some("127.0.0.1:0".parse().unwrap()),
            metadata_timeout: Duration::from_secs(5),
            job_token: token.map(|t| JobToken::new(t).unwrap()),
            ..crate::AgentConfig::default()
        };
        let guarded = Agent::new("guarded", config(Some("s3cret"))).unwrap();
        let addr = guarded.listen_addr().unwrap();
        let member = Agent::new("member", config(Some("s3cret"))).unwrap();
        assert_eq!(member.fetch_remote_metadata(addr).unwrap(), "guarded");
        member.send_local_metadata(addr).unwrap();
        assert!(guarded.has_remote("member"));
        let outsider = Agent::new("outsider", config(None)).unwrap();
        assert!(matches!(
            outsider.fetch_remote_metadata(addr),
            Err(Error::Unauthenticated(_))
        ));
        let impostor = Agent::new("impostor", config(Some("guess"))).unwrap();
        assert!(matches!(
            impostor.fetch_remote_metadata(addr),
            Err(Error::Unauthenticated(_))
        ));
        assert!(matches!(
            impostor.send_local_metadata(addr),
            Err(Error::Unauthenticated(_))
        ));
        assert!(!guarded.has_remote("impostor"));
        // A member does not trust a listener without the token either.
        let open = outsider.listen_addr().unwrap();
        assert!(matches!(
            member.fetch_remote_metadata(open),
            Err(Error::Unauthenticated(m)) if m.contains("no job token")
        ));
    }

    #[test]
    fn a_silent_peer_times_out() {
        let (_a, b) = pair();
        let mut io = DeadlineIo {
            stream: &b,
            deadline: Instant::now() + Duration::from_millis(100),
        };
        assert!(matches!(
            read_frame(&mut io, MAX_METADATA_BYTES),
            Err(Error::Timeout(_))
        ));
    }

    #[test]
    fn a_peer_that_trickles_bytes_still_hits_the_deadline() {
        let (mut a, b) = pair();
        let start = Instant::now();
        let writer = std::thread::spawn(move || {
            let header = frame_header(SEND_MD, &[0; 64]).unwrap();
            for byte in header.iter().chain(&[0u8; 64]) {
                if a.write_all(&[*byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let mut io = DeadlineIo {
            stream: &b,
            deadline: start + Duration::from_millis(300),
        };
        assert!(matches!(
            read_frame(&mut io, MAX_METADATA_BYTES),
            Err(Error::Timeout(_))
        ));
        assert!(start.elapsed() < Duration::from_secs(1));
        drop(b);
        writer.join().unwrap();
    }

    #[test]
    fn exchanges_leave_from_the_listener_address() {
        let dest: SocketAddr = "10.0.0.9:5000".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let at = |s: &str| Some(s.parse::<SocketAddr>().unwrap());
        assert_eq!(
            source_ip(dest, at("10.0.0.5:7000")),
            Some("10.0.0.5".parse().unwrap())
        );
        assert_eq!(source_ip(dest, at("0.0.0.0:7000")), None);
        assert_eq!(source_ip(dest, at("127.0.0.2:7000")), None);
        assert_eq!(source_ip(dest, None), None);
        assert_eq!(
            source_ip(lo, at("127.0.0.2:7000")),
            Some("127.0.0.2".parse().unwrap())
        );
        assert_eq!(source_ip(lo, at("[::1]:7000")), None);
    }
}
