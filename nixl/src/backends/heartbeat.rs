//! Heartbeats: how a backend learns, within a bound, that a peer's *host* is gone.
//!
//! A peer process that dies on a live host is seen at once: its kernel closes its
//! sockets (`VERBS`' side channel reads EOF) or its pidfd turns readable (`LIBFABRIC`'s
//! `liveness`). A host that vanishes — its link cut, its machine or guest killed —
//! sends nothing at all: no FIN, no RST, and RDMA or TCP retransmissions give up only
//! after seconds to minutes. So the target side of every connection sends a heartbeat
//! (one byte on a TCP connection of its own, never behind data) every `heartbeat_ms`
//! (default [`DEFAULT_INTERVAL_MS`]) from a thread that does no data work, and the
//! initiator declares the peer dead once it heard nothing for `heartbeat_misses`
//! (default [`DEFAULT_MISSES`]) of the peer's intervals: its connection is marked
//! disconnected and every transfer to it, in flight or posted later, fails with
//! [`crate::Error::RemoteDisconnect`]. With the defaults that is 0.5 s of silence.
//!
//! A live peer that is merely slow is never declared dead: beats come from the peer's
//! monitor thread (which moves no data) over a socket of their own, and the watcher
//! reads every socket before it judges, so beats that arrived while the watcher itself
//! was not scheduled count. A peer process on this host whose beats a loaded machine
//! did not schedule is not declared dead while `/proc` shows it running (its death is
//! seen through the OS; a stopped one is judged by its silence as usual). The cost of an
//! idle connection is one byte and one wake-up per interval on each side.
//!
//! Each side advertises its interval in the handshake (0: it sends none, e.g.
//! `heartbeat_ms=0`); a watcher waits for `misses` of the *peer's* intervals, and only a
//! watcher with heartbeats on watches at all. Set `heartbeat_ms=0` to turn it off.

use super::shared::{put_socket_addr, random_u64, LocalProcess};
use crate::backend::BackendParams;
use crate::error::{Error, Result};
use crate::os::{pollfd_in, WakeFd};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Default interval between two heartbeats a target sends.
pub(crate) const DEFAULT_INTERVAL_MS: u32 = 100;
/// Default number of the peer's intervals without a heartbeat after which it is dead.
pub(crate) const DEFAULT_MISSES: u32 = 5;
/// Largest `heartbeat_ms`.
const MAX_INTERVAL_MS: u32 = 60_000;
/// How many times the usual silence a peer process on this host that still runs may
/// stay silent before it is declared dead (its hub thread wedged): its death is seen
/// through the OS at once, and a loaded machine may not schedule its beats.
pub(crate) const LOCAL_SILENCE_FACTOR: u32 = 20;
/// The byte a heartbeat is (any byte counts).
const BEAT: u8 = 0xb7;

/// A backend's heartbeat parameters (`heartbeat_ms`, `heartbeat_misses`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeartbeatConfig {
    /// How often this side sends heartbeats; `None`: it neither sends nor watches.
    pub(crate) interval: Option<Duration>,
    /// The peer's intervals that may pass in silence before it is declared dead.
    pub(crate) misses: u32,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        Self {
            interval: Some(Duration::from_millis(DEFAULT_INTERVAL_MS.into())),
            misses: DEFAULT_MISSES,
        }
    }
}

impl HeartbeatConfig {
    /// The parameter names, for a backend's list of known ones.
    pub(crate) const KEYS: [&'static str; 2] = ["heartbeat_ms", "heartbeat_misses"];

    /// Reads `heartbeat_ms` (0 turns heartbeats off, at most 60,000) and
    /// `heartbeat_misses` (1..=1000).
    pub(crate) fn parse(backend: &str, params: &BackendParams) -> Result<Self> {
        let ms: u32 = super::shared::param(backend, params, "heartbeat_ms", DEFAULT_INTERVAL_MS)?;
        let misses: u32 =
            super::shared::param(backend, params, "heartbeat_misses", DEFAULT_MISSES)?;
        if ms > MAX_INTERVAL_MS {
            return Err(Error::InvalidParam(format!(
                "{backend}: heartbeat_ms must be 0 (off) ..={MAX_INTERVAL_MS}, not {ms}"
            )));
        }
        if !(1..=1000).contains(&misses) {
            return Err(Error::InvalidParam(format!(
                "{backend}: heartbeat_misses must be 1..=1000, not {misses}"
            )));
        }
        Ok(Self {
            interval: (ms > 0).then(|| Duration::from_millis(ms.into())),
            misses,
        })
    }

    /// The interval as advertised to peers (0: none sent).
    pub(crate) fn wire_ms(&self) -> u32 {
        self.interval.map_or(0, |d| d.as_millis() as u32)
    }
}

/// What a watcher knows of one peer's heartbeats: when it last heard one, and how
/// long a silence means death. Time is passed in, so the rules are tested without
/// waiting.
#[derive(Debug, Clone)]
pub(crate) struct Beat {
    /// The peer's interval; `None`: the peer is not watched (it sends none, or this
    /// side's heartbeats are off).
    every: Option<Duration>,
    misses: u32,
    last_heard: Instant,
}

impl Beat {
    /// A peer that announced `peer_ms` (0: it sends none), heard last `now`.
    pub(crate) fn new(now: Instant, peer_ms: u32, mine: &HeartbeatConfig) -> Self {
        Self {
            every: (mine.interval.is_some() && peer_ms > 0)
                .then(|| Duration::from_millis(peer_ms.into())),
            misses: mine.misses,
            last_heard: now,
        }
    }

    /// Whether the peer is watched at all.
    pub(crate) fn watched(&self) -> bool {
        self.every.is_some()
    }

    /// Something came from the peer at `now`.
    pub(crate) fn heard(&mut self, now: Instant) {
        self.last_heard = self.last_heard.max(now);
    }

    /// Whole intervals of the peer's that passed without a heartbeat.
    pub(crate) fn missed(&self, now: Instant) -> u32 {
        match self.every {
            Some(every) => {
                let silent = now.saturating_duration_since(self.last_heard);
                (silent.as_nanos() / every.as_nanos()).min(u32::MAX.into()) as u32
            }
            None => 0,
        }
    }

    /// When the peer will be declared dead if nothing comes before.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.every
            .map(|every| self.last_heard + every * self.misses)
    }

    /// Whether the silence outlasted `factor` times `misses` intervals.
    pub(crate) fn verdict_scaled(&self, now: Instant, factor: u32) -> bool {
        self.every.is_some_and(|every| {
            now.saturating_duration_since(self.last_heard) > every * self.misses * factor
        })
    }

    /// `Some(why)` once the silence outlasted `misses` intervals: the peer is dead.
    pub(crate) fn verdict(&self, now: Instant) -> Option<String> {
        let every = self.every?;
        let silent = now.saturating_duration_since(self.last_heard);
        (silent > every * self.misses).then(|| {
            format!(
                "no heartbeat for {silent:.0?} ({} of its {every:?} intervals; declared dead \
                 after {}): its host or the link to it is gone",
                self.missed(now),
                self.misses
            )
        })
    }
}

/// When a sender's next heartbeat is due.
#[derive(Debug, Clone)]
pub(crate) struct Pacer {
    every: Option<Duration>,
    next: Instant,
}

impl Pacer {
    /// Sends every `config.interval` (never when off), the first one at once.
    pub(crate) fn new(now: Instant, config: &HeartbeatConfig) -> Self {
        Self {
            every: config.interval,
            next: now,
        }
    }

    /// Whether a heartbeat is due at `now` (then the next one is scheduled).
    pub(crate) fn due(&mut self, now: Instant) -> bool {
        match self.every {
            Some(every) if now >= self.next => {
                self.next = now + every;
                true
            }
            _ => false,
        }
    }

    /// When the next heartbeat is due (`None`: never).
    pub(crate) fn next(&self) -> Option<Instant> {
        self.every.map(|_| self.next)
    }
}

/// What reading a heartbeat socket found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heard {
    /// Nothing new.
    Nothing,
    /// At least one byte (a heartbeat).
    Beat,
    /// End of stream or an error: the peer closed it, or it broke.
    Closed,
}

/// Reads whatever the non-blocking `stream` holds (heartbeats carry nothing else).
pub(crate) fn drain(stream: &TcpStream) -> Heard {
    let mut buf = [0u8; 256];
    let mut heard = Heard::Nothing;
    // Bounded: a peer sends a byte per interval; 64 reads drain any backlog of them.
    for _ in 0..64 {
        match (&*stream).read(&mut buf) {
            Ok(0) => return Heard::Closed,
            Ok(_) => heard = Heard::Beat,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return heard,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return Heard::Closed,
        }
    }
    heard
}

/// Sends one heartbeat on the non-blocking `stream`; `false`: the socket is broken.
/// A full send buffer is no error here: the watcher on the other side judges.
pub(crate) fn send_beat(stream: &TcpStream) -> bool {
    match (&*stream).write(&[BEAT]) {
        Ok(_) => true,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ) =>
        {
            true
        }
        Err(_) => false,
    }
}

/// Milliseconds from `now` to the earliest of `times` (at most `cap`), for `poll`.
pub(crate) fn poll_timeout(
    now: Instant,
    times: impl Iterator<Item = Instant>,
    cap: Duration,
) -> i32 {
    let wait = times
        .map(|t| t.saturating_duration_since(now))
        .fold(cap, Duration::min);
    // Rounded up, so a wake-up is never just before the time it waits for.
    wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
}

// ---------------------------------------------------------------------------------------
// A heartbeat hub: for backends without a side channel of their own (LIBFABRIC)

/// What a backend knows of a watched peer: alive, or dead with the reason.
#[derive(Debug)]
pub(crate) struct PeerWatch {
    dead: AtomicBool,
    reason: Mutex<String>,
}

impl PeerWatch {
    fn new() -> Self {
        Self {
            dead: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
        }
    }

    /// A watch on a peer found dead as it was to be watched (its hub refused the
    /// handshake: nothing listens there any more, or a newer incarnation does).
    pub(crate) fn dead(reason: &str) -> Arc<Self> {
        let watch = Self::new();
        watch.mark_dead(reason);
        Arc::new(watch)
    }

    /// Whether the peer was declared dead.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// `Err(RemoteDisconnect)` naming `agent` once the peer was declared dead.
    pub(crate) fn check(&self, agent: &str) -> Result<()> {
        if !self.is_dead() {
            return Ok(());
        }
        Err(Error::RemoteDisconnect {
            agent: agent.to_string(),
            reason: self.reason.lock().clone(),
        })
    }

    /// Declares the peer dead (the first reason stays).
    pub(crate) fn mark_dead(&self, reason: &str) {
        let mut r = self.reason.lock();
        if !self.dead.load(Ordering::Acquire) {
            *r = reason.to_string();
            self.dead.store(true, Ordering::Release);
        }
    }
}

/// Where a hub listens and which incarnation it is: what a peer needs to be watched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HubAddr {
    pub(crate) nonce: u64,
    pub(crate) addr: SocketAddr,
}

const HUB_MAGIC: &[u8; 4] = b"NXHB";
const HUB_VERSION: u8 = 1;
/// Bound on connecting to a peer's hub and on its handshake.
const HUB_HANDSHAKE: Duration = Duration::from_secs(5);
/// Longest a hub's thread sleeps (new links and the stop wake it sooner).
const HUB_MAX_SLEEP: Duration = Duration::from_secs(1);

impl HubAddr {
    /// `NXHB ver nonce:u64 family:u8 ip port:u16`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(HUB_MAGIC);
        out.push(HUB_VERSION);
        out.extend_from_slice(&self.nonce.to_le_bytes());
        put_socket_addr(out, self.addr);
    }

    /// Decodes a block [`HubAddr::encode`] wrote at the start of `b`; returns it and
    /// what follows.
    pub(crate) fn decode(b: &[u8]) -> Result<(Self, &[u8])> {
        let bad = |why: &str| Error::MalformedMetadata(format!("heartbeat address: {why}"));
        if b.len() < 14 || &b[..4] != HUB_MAGIC {
            return Err(bad("wrong size or tag"));
        }
        if b[4] != HUB_VERSION {
            return Err(bad(&format!(
                "version {} (this build reads {HUB_VERSION})",
                b[4]
            )));
        }
        let nonce = u64::from_le_bytes(b[5..13].try_into().expect("8 bytes"));
        let (ip, rest): (IpAddr, &[u8]) = match b[13] {
            4 if b.len() >= 14 + 4 => {
                (<[u8; 4]>::try_from(&b[14..18]).expect("4").into(), &b[18..])
            }
            6 if b.len() >= 14 + 16 => (
                <[u8; 16]>::try_from(&b[14..30]).expect("16").into(),
                &b[30..],
            ),
            4 | 6 => return Err(bad("truncated")),
            _ => return Err(bad("bad address family")),
        };
        if rest.len() < 2 {
            return Err(bad("truncated"));
        }
        let port = u16::from_le_bytes([rest[0], rest[1]]);
        Ok((
            Self {
                nonce,
                addr: SocketAddr::new(ip, port),
            },
            &rest[2..],
        ))
    }

    /// Whether this is the magic of a heartbeat address block.
    pub(crate) fn starts(b: &[u8]) -> bool {
        b.starts_with(HUB_MAGIC)
    }
}

/// One heartbeat connection of a hub.
#[derive(Debug)]
struct Link {
    stream: TcpStream,
    role: Role,
}

#[derive(Debug)]
enum Role {
    /// This side watches the peer (it opened the link); gone once nobody holds the watch.
    Watch {
        watch: Weak<PeerWatch>,
        beat: Beat,
        peer: String,
        /// The peer's process where it runs on this host.
        process: Option<LocalProcess>,
    },
    /// This side sends heartbeats to the peer that watches it.
    Serve { pacer: Pacer },
}

#[derive(Debug)]
struct HubShared {
    config: HeartbeatConfig,
    nonce: u64,
    name: String,
    /// Links set up by `watch` and by accepted handshakes, for the thread to take.
    new_links: Mutex<Vec<Link>>,
    wake: WakeFd,
    stop: AtomicBool,
    /// Tests: stop sending heartbeats, as a vanished host would.
    silent: AtomicBool,
}

impl HubShared {
    fn add(&self, link: Link) {
        self.new_links.lock().push(link);
        self.wake();
    }

    fn wake(&self) {
        let _ = self.wake.signal();
    }
}

/// A listener and a thread that send heartbeats to the peers that watch this backend
/// and watch the peers this backend loaded. The thread moves no data: a busy backend
/// still answers in time. Without peers it wakes once a second; with peers once per
/// interval per direction (to send, and when a heartbeat arrives).
#[derive(Debug)]
pub(crate) struct Hub {
    shared: Arc<HubShared>,
    addr: HubAddr,
    thread: Option<JoinHandle<()>>,
}

impl Hub {
    /// A hub listening on `ip` (port chosen by the OS) for backend `backend` of agent
    /// `name`.
    pub(crate) fn start(
        backend: &str,
        name: &str,
        ip: IpAddr,
        config: HeartbeatConfig,
    ) -> Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))?;
        listener.set_nonblocking(true)?;
        let addr = HubAddr {
            nonce: random_u64(),
            addr: listener.local_addr()?,
        };
        let shared = Arc::new(HubShared {
            config,
            nonce: addr.nonce,
            name: name.to_string(),
            new_links: Mutex::new(Vec::new()),
            wake: WakeFd::new()?,
            stop: AtomicBool::new(false),
            silent: AtomicBool::new(false),
        });
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("nixl-{}-heartbeat", backend.to_ascii_lowercase()))
                .spawn(move || hub_thread(&listener, &shared))?
        };
        Ok(Self {
            shared,
            addr,
            thread: Some(thread),
        })
    }

    /// Where peers reach this hub.
    pub(crate) fn addr(&self) -> HubAddr {
        self.addr
    }

    /// [`Hub::watch_process`] of a peer on another host.
    #[cfg(test)]
    pub(crate) fn watch(&self, agent: &str, at: HubAddr) -> Result<Option<Arc<PeerWatch>>> {
        self.watch_process(agent, at, None)
    }

    /// Watches `agent` through its hub at `at` for a backend (`backend`: its name, in
    /// the log): `None` where this side has heartbeats off, or the peer's hub is on the
    /// loopback of another host (`same_host` false: nothing of it is reachable from
    /// here), or the hub cannot be reached (logged: the peer is then left to the
    /// transport and the stall timeout). Metadata of an incarnation that is gone (a
    /// registry's stale copy, or a fetch answered just before the peer died) finds its
    /// hub closed, or a newer incarnation's hub in its place: that gives a watch dead
    /// from the start, so transfers to it are `RemoteDisconnect` at once (over `shm`,
    /// which never reports a dead peer, they would otherwise wait for the stall
    /// timeout) and a new incarnation may bind the name. `process` (a peer in this
    /// node's pid namespace) keeps a silent but running process alive (see
    /// [`Hub::watch_process`]).
    pub(crate) fn watch_peer(
        &self,
        backend: &str,
        agent: &str,
        at: HubAddr,
        same_host: bool,
        process: Option<LocalProcess>,
    ) -> Option<Arc<PeerWatch>> {
        if at.addr.ip().is_loopback() && !same_host {
            tracing::debug!(
                peer = agent,
                "{backend}: the peer's heartbeat hub is on its loopback"
            );
            return None;
        }
        match self.watch_process(agent, at, process) {
            Ok(watch) => watch,
            Err(Error::RemoteDisconnect { reason, .. }) => Some(PeerWatch::dead(&reason)),
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                Some(PeerWatch::dead(&format!(
                    "its heartbeat hub at {} refused the connection: the peer's backend is gone",
                    at.addr
                )))
            }
            Err(e) => {
                tracing::warn!(
                    peer = agent,
                    hub = %at.addr,
                    error = %e,
                    "{backend}: no heartbeats from this peer (a vanished host will be found \
                     only by the transport or the stall timeout)"
                );
                None
            }
        }
    }

    /// Starts watching `agent`, whose hub is at `at`: connects, asks it for heartbeats,
    /// and returns the watch the hub's thread marks dead once they stop. `None` where
    /// heartbeats are off on either side. A peer whose process runs on this host
    /// (`process`) has its death seen through the OS, so its silence is judged death only
    /// while the process is stopped or gone, or past [`LOCAL_SILENCE_FACTOR`] times the
    /// usual bound — a process that runs but was not scheduled (a loaded machine) is not
    /// declared dead.
    pub(crate) fn watch_process(
        &self,
        agent: &str,
        at: HubAddr,
        process: Option<LocalProcess>,
    ) -> Result<Option<Arc<PeerWatch>>> {
        let config = &self.shared.config;
        if config.interval.is_none() {
            return Ok(None);
        }
        let mut stream = TcpStream::connect_timeout(&at.addr, HUB_HANDSHAKE)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(HUB_HANDSHAKE))?;
        stream.set_write_timeout(Some(HUB_HANDSHAKE))?;
        // `NXHB ver target_nonce:u64 name:str16`
        let mut hello = Vec::with_capacity(16 + self.shared.name.len());
        hello.extend_from_slice(HUB_MAGIC);
        hello.push(HUB_VERSION);
        hello.extend_from_slice(&at.nonce.to_le_bytes());
        let name = &self.shared.name.as_bytes()[..self.shared.name.len().min(1024)];
        hello.extend_from_slice(&(name.len() as u16).to_le_bytes());
        hello.extend_from_slice(name);
        stream.write_all(&hello)?;
        // `NXHB ver status:u8 interval_ms:u32` (status 0: accepted, 1: stale nonce)
        let mut reply = [0u8; 10];
        stream.read_exact(&mut reply)?;
        let Some(peer_ms) = decode_hello_reply(&reply)? else {
            return Err(Error::RemoteDisconnect {
                agent: agent.to_string(),
                reason: "stale metadata: the peer has restarted since".into(),
            });
        };
        let beat = Beat::new(Instant::now(), peer_ms, config);
        if !beat.watched() {
            return Ok(None);
        }
        stream.set_nonblocking(true)?;
        let watch = Arc::new(PeerWatch::new());
        self.shared.add(Link {
            stream,
            role: Role::Watch {
                watch: Arc::downgrade(&watch),
                beat,
                peer: agent.to_string(),
                process,
            },
        });
        Ok(Some(watch))
    }

    /// Tests: stop (or resume) sending heartbeats, as a vanished host would.
    #[cfg(test)]
    pub(crate) fn set_silent(&self, silent: bool) {
        self.shared.silent.store(silent, Ordering::Relaxed);
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake();
        if let Some(thread) = self.thread.take() {
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

fn hub_thread(listener: &TcpListener, shared: &Arc<HubShared>) {
    let mut links: Vec<Link> = Vec::new();
    while !shared.stop.load(Ordering::Acquire) {
        links.append(&mut shared.new_links.lock());
        let now = Instant::now();
        let times = links.iter().filter_map(|l| match &l.role {
            Role::Watch { beat, .. } => beat.deadline(),
            Role::Serve { pacer } => pacer.next(),
        });
        let timeout = poll_timeout(now, times, HUB_MAX_SLEEP);
        let mut fds = vec![
            pollfd_in(listener.as_raw_fd()),
            pollfd_in(shared.wake.as_raw_fd()),
        ];
        fds.extend(links.iter().map(|l| pollfd_in(l.stream.as_raw_fd())));
        // SAFETY: `fds` is a live array of pollfds whose descriptors stay open.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        shared.wake.drain();
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    // The handshake waits for the peer: never on this thread.
                    let shared = shared.clone();
                    let spawned = std::thread::Builder::new()
                        .name("nixl-heartbeat-hello".into())
                        .spawn(move || {
                            if let Err(e) = serve_hello(&shared, stream) {
                                tracing::debug!(%from, error = %e, "heartbeat handshake failed");
                            }
                        });
                    if let Err(e) = spawned {
                        tracing::warn!(error = %e, "no thread for a heartbeat handshake");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::debug!(error = %e, "heartbeat accept failed");
                    break;
                }
            }
        }
        // Every socket is read before anything is judged: heartbeats that came while
        // this thread was not scheduled count.
        let heard: Vec<Heard> = links.iter().map(|l| drain(&l.stream)).collect();
        let now = Instant::now();
        let silent = shared.silent.load(Ordering::Relaxed);
        let mut i = 0;
        links.retain_mut(|link| {
            let heard = heard[i];
            i += 1;
            match &mut link.role {
                Role::Watch {
                    watch,
                    beat,
                    peer,
                    process,
                } => {
                    let Some(watch) = watch.upgrade() else {
                        return false; // the peer was forgotten: close the link
                    };
                    let verdict = match heard {
                        Heard::Closed => Some(
                            "its heartbeat connection closed: the peer's process or backend is gone"
                                .to_string(),
                        ),
                        Heard::Beat => {
                            beat.heard(now);
                            None
                        }
                        Heard::Nothing => beat.verdict(now).filter(|_| {
                            process.is_none_or(|p| {
                                !p.runs() || beat.verdict_scaled(now, LOCAL_SILENCE_FACTOR)
                            })
                        }),
                    };
                    match verdict {
                        Some(reason) => {
                            tracing::debug!(peer = %peer, %reason, "peer declared dead");
                            watch.mark_dead(&reason);
                            false
                        }
                        None => true,
                    }
                }
                Role::Serve { pacer } => {
                    // The watcher closed it (forgot us, or died): done.
                    if heard == Heard::Closed {
                        return false;
                    }
                    !pacer.due(now) || silent || send_beat(&link.stream)
                }
            }
        });
    }
}

/// Bytes of a watcher's handshake before its name.
const HELLO_HEAD: usize = 15;
/// Longest watcher name a hub reads.
const MAX_HELLO_NAME: usize = 1024;

/// A watcher's handshake head, `NXHB ver target_nonce:u64 name_len:u16`: the nonce it
/// expects and the length of the name that follows (at most [`MAX_HELLO_NAME`]).
fn decode_hello_head(head: &[u8; HELLO_HEAD]) -> Result<(u64, usize)> {
    if &head[..4] != HUB_MAGIC || head[4] != HUB_VERSION {
        return Err(Error::MalformedMetadata(
            "heartbeat handshake: wrong magic or version".into(),
        ));
    }
    let nonce = u64::from_le_bytes(head[5..13].try_into().expect("8"));
    let name_len = u16::from_le_bytes([head[13], head[14]]) as usize;
    if name_len > MAX_HELLO_NAME {
        return Err(Error::MalformedMetadata(
            "heartbeat handshake: name too long".into(),
        ));
    }
    Ok((nonce, name_len))
}

/// A hub's answer to a handshake, `NXHB ver status:u8 interval_ms:u32`: its interval if
/// it accepted (status 0), `None` if it refused a stale nonce (any other status).
fn decode_hello_reply(reply: &[u8; 10]) -> Result<Option<u32>> {
    if &reply[..4] != HUB_MAGIC || reply[4] != HUB_VERSION {
        return Err(Error::MalformedMetadata(
            "heartbeat handshake: wrong magic or version".into(),
        ));
    }
    if reply[5] != 0 {
        return Ok(None);
    }
    Ok(Some(u32::from_le_bytes(
        reply[6..10].try_into().expect("4"),
    )))
}

/// Fuzzing entry point (not a stable API): the heartbeat decoders on `input` — a hub's
/// address block (in metadata), and the head of a watcher's handshake and of a hub's
/// answer (the first bytes of `input`). Returns whether a decoded address block encodes
/// back to the bytes it was read from (decoding itself must never panic).
#[doc(hidden)]
pub fn fuzz_message(input: &[u8]) -> bool {
    let addr_ok = match HubAddr::decode(input) {
        Ok((addr, rest)) => {
            let mut again = Vec::new();
            addr.encode(&mut again);
            again.extend_from_slice(rest);
            again == input
        }
        Err(_) => true,
    };
    let head_ok = match input.first_chunk::<HELLO_HEAD>().map(decode_hello_head) {
        Some(Ok((_, name_len))) => name_len <= MAX_HELLO_NAME,
        Some(Err(_)) | None => true,
    };
    if let Some(reply) = input.first_chunk::<10>() {
        let _ = decode_hello_reply(reply);
    }
    addr_ok && head_ok
}

/// The hub's side of a watcher's handshake: checks the incarnation, answers with this
/// side's interval, and hands the link to the hub's thread.
fn serve_hello(shared: &HubShared, mut stream: TcpStream) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HUB_HANDSHAKE))?;
    stream.set_write_timeout(Some(HUB_HANDSHAKE))?;
    let mut head = [0u8; HELLO_HEAD];
    stream.read_exact(&mut head)?;
    let (nonce, name_len) = decode_hello_head(&head)?;
    let mut name = vec![0u8; name_len];
    stream.read_exact(&mut name)?;
    let stale = nonce != shared.nonce;
    let mut reply = Vec::with_capacity(10);
    reply.extend_from_slice(HUB_MAGIC);
    reply.push(HUB_VERSION);
    reply.push(u8::from(stale));
    reply.extend_from_slice(&shared.config.wire_ms().to_le_bytes());
    stream.write_all(&reply)?;
    if stale || shared.config.interval.is_none() {
        return Ok(());
    }
    stream.set_nonblocking(true)?;
    tracing::debug!(peer = %String::from_utf8_lossy(&name), "heartbeats to a watcher");
    shared.add(Link {
        stream,
        role: Role::Serve {
            pacer: Pacer::new(Instant::now(), &shared.config),
        },
    });
    Ok(())
}

#[cfg(test)]
mod tests;
