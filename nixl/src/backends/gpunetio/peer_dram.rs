//! `GPUNETIO`'s direct path between this backend's VRAM and a same-host peer's DRAM: the
//! peer (which owns the host memory) imports this side's VRAM through CUDA IPC and moves
//! the bytes with one copy-engine copy, instead of the NIC path's CPU proxy (a provider
//! copy through bounce buffers, then the peer's).
//!
//! The transport-neutral parts (exports, requests, planning, the target's checks and
//! copies) are `backends::peer_dram`'s, as for LIBFABRIC. Here they travel on a
//! **control connection** of the NIC path's out-of-band channel (module `oob`): the
//! initiator opens one per peer with a control hello — on the Unix socket the peer
//! advertised where both processes share a pid namespace (the checked holder of the
//! socket, see `oob`), else to its TCP notification address — sends requests on it,
//! reads the answers from it (polling, without blocking, as the agent's wait polls the
//! transfer). A transfer of one request to a peer that says it understands it
//! ([`NOTIF_IN_REQUEST`]) carries its notification in the request, and the target
//! delivers it itself once its copies completed, before it answers (strictly after the
//! last byte; never for a declined or failed request, whose transfer then runs the NIC
//! path with its notification); otherwise the initiator sends the notification on the
//! connection after the last answer. Either way the notification is at the peer when
//! the transfer is Done here.
//!
//! On a same-host (Unix) connection the initiator asks for a **shared lane**
//! (`peer_dram::mailbox`): the target makes one for a connection it confirmed and hands
//! it over with `SCM_RIGHTS`; requests and answers then cross as a few stores in shared
//! memory. This path's serving thread reads the lanes itself, queues the copies, polls
//! them and answers (without yielding its core for the first [`SPIN_NO_YIELD`] where the
//! process has cores to spare), and says in each lane when it is about to block, so that
//! an initiator rings the connection (a doorbell frame the listener forwards). Requests on
//! the connection itself are checked and their copies queued on the listener's thread as
//! soon as they are read; the serving thread polls those copies and answers too.
//!
//! `NIXL_PEER_COPY_TRACE=1` (in both processes) times each post of one request at both
//! ends (`peer_dram::trace`); `query_mem_info` then reports the summed segments as
//! `peer_copy_trace_*`.
//!
//! # Who asks
//! A request is attributed by its connection, never by its bytes: the connection's
//! hello names the initiator, and before it reads a frame the target's listener asks
//! that peer (at the address its loaded connection information advertised) whether a
//! TCP connection is its own, or asks the kernel which process opened a Unix one
//! (`SO_PEERCRED`: it must be the process that peer advertised, pid and start time)
//! (module `oob`, issue 28's check). A request on a connection naming no loaded peer, or
//! a peer that did not confirm it, is declined (`EPERM`) on that connection. The VRAM a
//! request names must then lie inside a region *that peer* advertised with its export in
//! metadata this backend loaded (`EADDRNOTAVAIL` otherwise), the DRAM inside one of this
//! backend's DRAM registrations (`EACCES`).
//!
//! # Choice and fallback
//! A transfer goes this way as a whole when parameter `vram_peer_copy` is `auto` (the
//! default; `off` disables it), the backend has a NIC path (its channel carries the
//! requests), the peer is on this host (the intra-node plane reaches it), its
//! connection information says it serves such requests, and every descriptor pair is
//! this backend's exported VRAM ↔ the peer's DRAM. The NIC path's transfer is prepared
//! beside it: when the peer declines (it cannot import, it did not load this side's
//! metadata), that post and every later post of the request run it instead. A peer on
//! another host, or memory without a legacy IPC handle (VMM), takes the NIC path.
//!
//! A post attached to a stream (`PostParams::custom`) waits for that stream first: the
//! peer's copy engine cannot order itself after this process's stream.

use super::oob::{
    ControlConn, ControlFrom, ControlReply, LocalIdentity, OwnConns, CONTROL_NOTIF,
    CONTROL_PEER_COPY,
};
use super::NAME;
use crate::backend::{BackendXfer, PostParams, XferProgress, XferStatus};
use crate::backends::peer_dram::mailbox::Mailbox;
use crate::backends::peer_dram::{
    self, decode, trace, AdvertisedVram, Direction, Done, Imports, Message, PeerVram, Piece,
    PieceHome, Request, RunState, Serving, Shared, VramExport,
};
use crate::error::{Error, Result};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Flag of the connection information: the backend copies VRAM ↔ its DRAM on request.
pub(super) const SERVES_PEER_COPIES: u8 = 1;
/// Flag of the connection information: the process and Unix socket for same-host control
/// connections follow (module `oob`).
pub(super) const LOCAL_CONTROL: u8 = 2;
/// Flag of the connection information: a request may carry its transfer's notification,
/// which the backend delivers once the request's copies completed.
pub(super) const NOTIF_IN_REQUEST: u8 = 4;
/// How long releasing a transfer waits for the peer's answers to requests in flight (the
/// peer may still be copying into this process's VRAM).
const RELEASE_WAIT: Duration = Duration::from_secs(5);
/// How long the serving thread waits for the next request by polling before it blocks:
/// requests of one transfer follow each other within microseconds, and waking a blocked
/// thread costs more than a MiB's copy gains from the direct path.
const IDLE_SPIN: Duration = Duration::from_micros(200);
/// How long the serving thread polls running copies (yielding its core between polls)
/// before it polls them at a slower pace: a copy of 64 MiB takes about a millisecond, a
/// sleep's wake-up tens of microseconds, and copies far longer than this are rare (a
/// stalled GPU should not keep a core busy).
const BUSY_SPIN: Duration = Duration::from_millis(20);
/// How long the serving thread polls running copies (and waits for the next request)
/// without yielding its core, where the process has the cores to spare
/// ([`crate::os::may_spin`]): a copy of a few MiB takes tens of microseconds, a yield can cost
/// several when other threads are runnable, and answering sooner is what a small
/// transfer waits for.
const SPIN_NO_YIELD: Duration = Duration::from_micros(500);

/// What this backend knows of one peer's incarnation for this path.
#[derive(Debug)]
pub(super) struct PeerState {
    agent: String,
    /// VRAM it advertised with exports (what its requests may name).
    vram: AdvertisedVram,
    /// Its VRAM mapped here (imported on its first request).
    imports: Imports,
    /// Its connection information says it serves requests.
    serves: bool,
    /// Its connection information says a request may carry a notification.
    notif_in_request: bool,
    /// Where its notification listener (and control connections) accept.
    oob: Option<SocketAddr>,
    /// Its Unix socket for same-host control connections and the process holding it.
    local: Option<(Vec<u8>, LocalIdentity)>,
    /// This side's control connection to it, opened on the first direct transfer.
    conn: Mutex<Option<Arc<ControlConn>>>,
}

impl PeerVram for PeerState {
    fn agent(&self) -> &str {
        &self.agent
    }
    fn advertised(&self) -> &AdvertisedVram {
        &self.vram
    }
    fn imports(&self) -> &Imports {
        &self.imports
    }
}

/// A request's copies, queued by the listener's thread as the request arrived, handed to
/// the serving thread, which answers once they completed.
struct Running {
    serving: Serving,
    reply: Arc<ControlReply>,
    id: u64,
    /// The peer the connection was attributed to, and the notification the request
    /// carried: delivered once the copies completed, never when they failed.
    from: String,
    notif: Option<Vec<u8>>,
    /// Where tracing: when the request was read and its copies launched.
    stamps: trace::TargetStamps,
}

/// What the serving thread is handed.
enum Job {
    /// A request's copies, queued by the listener.
    Run(Box<Running>),
    /// A control connection's shared lane, whose requests this thread reads and serves
    /// itself (no hand-off per request): the connection's peer, the lane (gone when the
    /// connection closes) and where answers go.
    Lane(LaneJob),
    /// A request waits in a lane while this thread said it sleeps.
    Wake,
}

struct LaneJob {
    from: ControlFrom,
    lane: std::sync::Weak<Mailbox>,
    reply: Arc<ControlReply>,
}

/// The path of one backend: its peers' states, its requests' waits and its server.
#[derive(Debug)]
pub(super) struct PeerDramPath {
    me: String,
    pub(super) shared: Shared,
    peers: Arc<RwLock<HashMap<String, Arc<PeerState>>>>,
    own: Arc<OwnConns>,
    /// Control connections opened on a same-host Unix socket (rather than TCP).
    local_conns: std::sync::atomic::AtomicU64,
}

impl PeerDramPath {
    /// The path of the agent `me` (`None`: off, or no GPU copies in this process). A
    /// request is checked and its copies queued on the listener's thread as it is read
    /// (no thread hand-off before the copy starts); a thread of its own polls the copies
    /// and answers.
    pub(super) fn new(
        me: &str,
        enabled: bool,
        serving: crate::backends::cuda_copy::CopyEngine,
        own: Arc<OwnConns>,
    ) -> Result<
        Option<(
            Arc<Self>,
            super::oob::ControlHandler,
            super::oob::LaneHandler,
        )>,
    > {
        if !enabled || !peer_dram::gpu_present() {
            return Ok(None);
        }
        let path = Arc::new(Self {
            me: me.to_string(),
            shared: Shared::with_engine(true, true, serving),
            peers: Arc::default(),
            own,
            local_conns: Default::default(),
        });
        let (jobs, incoming) = mpsc::channel::<Job>();
        let server = path.clone();
        std::thread::Builder::new()
            .name("gpunetio-peer-dram".into())
            .spawn(move || server.serve(incoming))?;
        let this = path.clone();
        let lane_jobs = Mutex::new(jobs.clone());
        let wake_jobs = Mutex::new(jobs.clone());
        let lanes = super::oob::LaneHandler {
            take: Box::new(move |from, lane, reply| {
                let _ = lane_jobs
                    .lock()
                    .send(Job::Lane(LaneJob { from, lane, reply }));
            }),
            wake: Box::new(move || {
                let _ = wake_jobs.lock().send(Job::Wake);
            }),
        };
        let jobs = Mutex::new(jobs);
        let handler = super::oob::ControlHandler(Box::new(move |from, body, reply| {
            let request = match decode(body) {
                Ok(Message::Request(r)) => r,
                // Lanes come with the connection here (never by descriptor number).
                Ok(Message::Done(_) | Message::Lane(_) | Message::Doorbell) => return,
                Err(why) => {
                    tracing::debug!("{NAME}: a malformed direct-copy request dropped: {why}");
                    return;
                }
            };
            let id = request.id;
            let read = trace::request_read();
            match this.start(&from, &request) {
                Ok(serving) => {
                    let running = Running {
                        serving,
                        reply,
                        id,
                        from: from.agent,
                        notif: request.notif,
                        stamps: trace::TargetStamps {
                            read,
                            launched: trace::stamp(),
                            ..Default::default()
                        },
                    };
                    if let Err(mpsc::SendError(Job::Run(running))) =
                        jobs.lock().send(Job::Run(Box::new(running)))
                    {
                        // The serving thread is gone (it panicked): nothing will poll the
                        // copies. Dropping them waits for them; the transfer fails (its
                        // notification is not delivered).
                        tracing::warn!("{NAME}: no thread answers direct-copy requests");
                        let Running { serving, reply, .. } = *running;
                        drop(serving);
                        answer(&reply, id, libc::EIO, None);
                    }
                }
                // Declined or refused: its notification is not delivered (a declined
                // transfer sends it with its NIC path's post).
                Err(errno) => answer(
                    &reply,
                    id,
                    errno,
                    trace::on().then(|| trace::TargetStamps {
                        read,
                        ..Default::default()
                    }),
                ),
            }
        }));
        Ok(Some((path, handler, lanes)))
    }

    /// Records `agent`'s connection information: whether it serves requests, where it
    /// accepts connections (TCP, and a same-host Unix socket with the process holding
    /// it). A new incarnation (other information) starts afresh: what the old one
    /// advertised and its imports go.
    /// `flags` are its connection information's ([`SERVES_PEER_COPIES`],
    /// [`NOTIF_IN_REQUEST`]).
    pub(super) fn load_peer(
        &self,
        agent: &str,
        flags: u8,
        oob: Option<SocketAddr>,
        local: Option<(Vec<u8>, LocalIdentity)>,
    ) {
        let serves = flags & SERVES_PEER_COPIES != 0;
        let notif_in_request = flags & NOTIF_IN_REQUEST != 0;
        let mut peers = self.peers.write();
        if peers.get(agent).is_some_and(|p| {
            p.serves == serves
                && p.notif_in_request == notif_in_request
                && p.oob == oob
                && p.local == local
        }) {
            return;
        }
        peers.insert(
            agent.to_string(),
            Arc::new(PeerState {
                agent: agent.to_string(),
                vram: AdvertisedVram::default(),
                imports: Imports::default(),
                serves,
                notif_in_request,
                oob,
                local,
                conn: Mutex::new(None),
            }),
        );
    }

    /// `agent` advertised VRAM at `addr..addr + len` reachable through `export`.
    pub(super) fn advertise(&self, agent: &str, addr: u64, len: u64, export: VramExport) {
        if let Some(p) = self.peers.read().get(agent) {
            p.vram.add(addr, len, export);
        }
    }

    pub(super) fn forget(&self, agent: &str) {
        self.peers.write().remove(agent);
    }

    /// Whether `agent` copies on request (its connection information said so).
    pub(super) fn peer_serves(&self, agent: &str) -> bool {
        self.peers.read().get(agent).is_some_and(|p| p.serves)
    }

    /// The control connection to `agent`, opened on first use: on its Unix socket where
    /// it advertised one and its pids mean the same here, else (or where that fails) on
    /// TCP to its notification address.
    pub(super) fn conn(&self, agent: &str) -> Result<Arc<ControlConn>> {
        let peer = self
            .peers
            .read()
            .get(agent)
            .cloned()
            .ok_or_else(|| Error::Unreachable {
                backend: NAME.into(),
                agent: agent.to_string(),
                reason: "its connection information was not loaded".into(),
            })?;
        let mut conn = peer.conn.lock();
        if let Some(c) = conn.as_ref().filter(|c| !c.is_gone()) {
            return Ok(c.clone());
        }
        let local = peer
            .local
            .as_ref()
            .filter(|(_, who)| who.pid_means_here())
            .and_then(|(name, who)| {
                ControlConn::connect_local(&self.me, agent, name, who, self.own.clone())
                    .inspect_err(|e| {
                        tracing::debug!(
                            "{NAME}: no same-host control connection to `{agent}` ({e}): TCP"
                        )
                    })
                    .ok()
            });
        let c = match local {
            Some(c) => {
                self.local_conns.fetch_add(1, Ordering::Relaxed);
                c
            }
            None => {
                let addr = peer.oob.ok_or_else(|| Error::Unreachable {
                    backend: NAME.into(),
                    agent: agent.to_string(),
                    reason: "it has no notification address for a control connection".into(),
                })?;
                ControlConn::connect(&self.me, agent, addr, self.own.clone())?
            }
        };
        let c = Arc::new(c);
        *conn = Some(c.clone());
        Ok(c)
    }

    /// The serving thread: answers each request once its copies completed, and reads and
    /// serves the requests of the shared lanes it was handed. It polls while there is
    /// traffic (copies running, and briefly for the next request), yielding its core
    /// between polls where cores are few, and blocks only when idle — after saying so in
    /// its lanes (a request pushed then rings the connection, which wakes it).
    fn serve(self: Arc<Self>, incoming: mpsc::Receiver<Job>) {
        let mut running: Vec<Running> = Vec::new();
        let mut lanes: Vec<LaneJob> = Vec::new();
        let mut request = Vec::new();
        let mut progress_at = Instant::now();
        // Ends once the listener is gone (no more requests) and the copies are answered.
        let mut open = true;
        loop {
            // Every request that came meanwhile starts before the copies are polled.
            while open {
                match incoming.try_recv() {
                    Ok(job) => {
                        take_job(job, &mut running, &mut lanes);
                        progress_at = Instant::now();
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            if !open && running.is_empty() {
                return;
            }
            let mut progressed = self.serve_lanes(&mut lanes, &mut running, &mut request);
            let before = running.len();
            let stats = &self.shared.stats;
            running.retain_mut(|r| match r.serving.poll(stats) {
                Some(errno) => {
                    r.stamps.complete = trace::stamp();
                    let stamps = trace::on().then_some(r.stamps);
                    finish(&r.reply, &r.from, r.notif.take(), r.id, errno, stamps);
                    false
                }
                None => true,
            });
            progressed |= running.len() != before;
            if progressed {
                progress_at = Instant::now();
                continue;
            }
            let idle = progress_at.elapsed();
            if running.is_empty() && idle >= IDLE_SPIN && open {
                for l in &lanes {
                    if let Some(lane) = l.lane.upgrade() {
                        lane.set_asleep(true);
                    }
                }
                let waiting = lanes
                    .iter()
                    .any(|l| l.lane.upgrade().is_some_and(|lane| lane.has_request()));
                if !waiting {
                    match incoming.recv() {
                        Ok(job) => take_job(job, &mut running, &mut lanes),
                        Err(_) => open = false,
                    }
                }
                for l in &lanes {
                    if let Some(lane) = l.lane.upgrade() {
                        lane.set_asleep(false);
                    }
                }
                progress_at = Instant::now();
            } else if idle > BUSY_SPIN {
                std::thread::sleep(Duration::from_micros(20));
            } else if idle < SPIN_NO_YIELD && crate::os::may_spin() {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Reads the lanes' requests and starts their copies (or answers why not); whether
    /// there were any. A lane whose connection closed, or which its peer broke, goes.
    fn serve_lanes(
        &self,
        lanes: &mut Vec<LaneJob>,
        running: &mut Vec<Running>,
        buf: &mut Vec<u8>,
    ) -> bool {
        let mut any = false;
        lanes.retain(|l| {
            let Some(lane) = l.lane.upgrade() else {
                return false;
            };
            match lane.take_requests(buf, |body| self.serve_one(&l.from, body, &l.reply, running)) {
                Ok(n) => {
                    any |= n > 0;
                    true
                }
                Err(e) => {
                    tracing::warn!(peer = %l.from.agent, "{NAME}: {e}; its requests go on the connection");
                    false
                }
            }
        });
        any
    }

    /// One request read from a lane of `from`'s connection.
    fn serve_one(
        &self,
        from: &ControlFrom,
        body: &[u8],
        reply: &Arc<ControlReply>,
        running: &mut Vec<Running>,
    ) {
        let request = match decode(body) {
            Ok(Message::Request(r)) => r,
            Ok(_) => return,
            Err(why) => {
                tracing::debug!("{NAME}: a malformed direct-copy request dropped: {why}");
                return;
            }
        };
        let read = trace::request_read();
        match self.start(from, &request) {
            Ok(serving) => running.push(Running {
                serving,
                reply: reply.clone(),
                id: request.id,
                from: from.agent.clone(),
                notif: request.notif,
                stamps: trace::TargetStamps {
                    read,
                    launched: trace::stamp(),
                    ..Default::default()
                },
            }),
            Err(errno) => answer(
                reply,
                request.id,
                errno,
                trace::on().then(|| trace::TargetStamps {
                    read,
                    ..Default::default()
                }),
            ),
        }
    }

    /// Checks a request that came on a connection of `from` and queues its copies, or
    /// says why not (the errno of its answer): only a loaded peer that confirmed the
    /// connection is served.
    fn start(&self, from: &ControlFrom, request: &Request) -> std::result::Result<Serving, i32> {
        let Some(peer) = attribute(&self.peers.read(), from) else {
            return Err(self.shared.stats.refuse(
                libc::EPERM,
                format_args!("its connection is not confirmed as `{}`'s", from.agent),
            ));
        };
        let Some(server) = &self.shared.server else {
            return Err(libc::EOPNOTSUPP);
        };
        server.serve(request, &peer, &self.shared.stats)
    }

    /// The path VRAM <-> `agent`'s DRAM takes (`same_host`: the intra-node plane reaches
    /// it, and `nic_handler` is not `cpu_proxy`), for `query_mem_info`
    /// (`vram_peer_dram`: `direct` or `cpu_proxy`) and nixlbench's header (in words).
    pub(super) fn describe(
        &self,
        agent: &str,
        same_host: bool,
        provider: &str,
    ) -> (&'static str, String) {
        if same_host && self.peer_serves(agent) {
            (
                "direct",
                format!(
                    "VRAM <-> the peer's DRAM: direct peer copy, one copy-engine copy by the \
                     peer through CUDA IPC (the CPU proxy over libfabric {provider} where it \
                     declines)"
                ),
            )
        } else {
            let why = if same_host {
                "the peer does not copy on request"
            } else {
                "the peer is not on this host"
            };
            (
                "cpu_proxy",
                format!("VRAM <-> the peer's DRAM: CPU proxy over libfabric {provider} ({why})"),
            )
        }
    }

    /// What moved this way and what was served, declined or fell back (all peers), the
    /// control connections opened on same-host Unix sockets, and where tracing, the
    /// summed timings of the posts of one request (`peer_dram::trace`).
    pub(super) fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = &self.shared.stats;
        let mut out = vec![
            ("peer_copy_bytes", s.bytes.load(Ordering::Relaxed)),
            (
                "peer_copy_served_bytes",
                s.served_bytes.load(Ordering::Relaxed),
            ),
            ("peer_copy_fallbacks", s.fallbacks.load(Ordering::Relaxed)),
            ("peer_copy_refused", s.refused.load(Ordering::Relaxed)),
            (
                "peer_copy_local_control",
                self.local_conns.load(Ordering::Relaxed),
            ),
            (
                "peer_copy_lane_requests",
                s.lane_requests.load(Ordering::Relaxed),
            ),
        ];
        out.extend(trace::counters());
        out
    }
}

/// The loaded peer a control frame is from: only one whose connection its named peer
/// confirmed.
fn attribute(
    peers: &HashMap<String, Arc<PeerState>>,
    from: &ControlFrom,
) -> Option<Arc<PeerState>> {
    if !from.verified {
        return None;
    }
    peers.get(&from.agent).cloned()
}

/// Hands a job to the serving thread's state.
fn take_job(job: Job, running: &mut Vec<Running>, lanes: &mut Vec<LaneJob>) {
    match job {
        Job::Run(r) => running.push(*r),
        Job::Lane(l) => lanes.push(l),
        Job::Wake => {}
    }
}

/// Ends a served request whose copies ended with `errno`: the notification it carried
/// delivered (as from `from`, the connection's peer) only where they completed (0),
/// before the answer, so the peer's transfer is Done only once it is here; then the
/// answer.
fn finish(
    reply: &ControlReply,
    from: &str,
    notif: Option<Vec<u8>>,
    id: u64,
    errno: i32,
    stamps: Option<trace::TargetStamps>,
) {
    if let Some(msg) = notif.filter(|_| errno == 0) {
        // Every byte is in place: the notification may be seen.
        reply.deliver(from, msg);
    }
    answer(reply, id, errno, stamps);
}

/// Answers request `id` with `errno` (and, where tracing, the target's stamps, the last
/// taken now), framed in the connection's buffer.
fn answer(reply: &ControlReply, id: u64, errno: i32, stamps: Option<trace::TargetStamps>) {
    let trace = stamps.map(|t| trace::TargetStamps {
        answered: trace::now_ns(),
        ..t
    });
    let done = Done { id, errno, trace };
    if let Err(e) = reply.send_with(CONTROL_PEER_COPY, |out| done.encode_into(out)) {
        tracing::debug!("{NAME}: answering a direct-copy request: {e}");
    }
}

/// A transfer prepared for the direct path: its requests, and the NIC path's transfer
/// for a peer that declines.
pub(super) struct PeerDramXfer {
    path: Arc<PeerDramPath>,
    agent: String,
    conn: Arc<ControlConn>,
    direction: Direction,
    requests: Vec<Vec<Piece>>,
    bytes: u64,
    fallback: Box<dyn BackendXfer>,
    on_fallback: bool,
    run: Option<Arc<RunState>>,
    /// The last post's state, reused by the next where nothing else holds it.
    spare_run: Option<Arc<RunState>>,
    ids: Vec<u64>,
    /// The running post's notification (a buffer reused across posts), whether it has
    /// one, and whether its request carried it (the target delivers it).
    notif: Vec<u8>,
    has_notif: bool,
    notif_carried: bool,
    /// The peer takes a notification in a request ([`NOTIF_IN_REQUEST`]).
    peer_takes_notif: bool,
    /// One buffer for every request this transfer sends.
    scratch: Vec<u8>,
    gpu: usize,
    /// Where tracing: this post's stamps.
    stamps: trace::PostStamps,
}

impl std::fmt::Debug for PeerDramXfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerDramXfer")
            .field("agent", &self.agent)
            .field("direction", &self.direction)
            .field("requests", &self.requests.len())
            .field("bytes", &self.bytes)
            .field("on_fallback", &self.on_fallback)
            .finish_non_exhaustive()
    }
}

/// One descriptor pair of a transfer that takes the direct path: this side's VRAM (in
/// the allocation and registration `home` names) and the peer's DRAM (in its
/// registration `home` names).
#[derive(Debug, Clone, Copy)]
pub(super) struct DirectPair {
    pub(super) home: PieceHome,
    pub(super) vram: u64,
    pub(super) dram: u64,
    pub(super) len: u64,
}

impl PeerDramPath {
    /// The transfer of `pairs` to `agent` (WRITE: `write`), with `fallback` beside it.
    pub(super) fn prep(
        self: &Arc<Self>,
        write: bool,
        pairs: &[DirectPair],
        agent: &str,
        gpu: usize,
        fallback: Box<dyn BackendXfer>,
    ) -> Result<PeerDramXfer> {
        let conn = self.conn(agent)?;
        let peer_takes_notif = self
            .peers
            .read()
            .get(agent)
            .is_some_and(|p| p.notif_in_request);
        let mut pieces = Vec::new();
        let mut bytes = 0;
        for p in pairs {
            for (off, len) in peer_dram::cut(p.len) {
                pieces.push((
                    p.home,
                    Piece {
                        vram: p.vram + off,
                        dram: p.dram + off,
                        len,
                    },
                ));
            }
            bytes += p.len;
        }
        // Requests travel on one connection whose frames are far larger than a rail's
        // inject size: as many pieces per request as the wire allows, neighbouring
        // blocks merged into one piece.
        let requests = peer_dram::plan_requests(pieces, peer_dram::MAX_PIECES, 1, 0)
            .into_iter()
            .map(|(_, p)| p)
            .collect();
        Ok(PeerDramXfer {
            path: self.clone(),
            agent: agent.to_string(),
            conn,
            direction: if write {
                Direction::ToDram
            } else {
                Direction::ToVram
            },
            requests,
            bytes,
            fallback,
            on_fallback: false,
            run: None,
            spare_run: None,
            ids: Vec::new(),
            notif: Vec::new(),
            has_notif: false,
            notif_carried: false,
            peer_takes_notif,
            scratch: Vec::new(),
            gpu,
            stamps: trace::PostStamps::default(),
        })
    }
}

impl PeerDramXfer {
    /// Reads the answers that arrived (for any transfer to this peer).
    fn pump(&self) -> Result<()> {
        let waits = &self.path.shared.waits;
        self.conn.poll(|kind, body| {
            if kind != CONTROL_PEER_COPY {
                return;
            }
            match decode(body) {
                Ok(Message::Done(done)) => match waits.take(done.id, Some(&self.agent)) {
                    Some(run) => {
                        run.answer_done(&done);
                        trace::since_received(trace::Step::AnswerReceivedToRead);
                    }
                    None => tracing::debug!(id = done.id, "a direct copy answer for no request"),
                },
                Ok(Message::Request(_) | Message::Lane(_) | Message::Doorbell) => {}
                Err(why) => tracing::debug!("{NAME}: a malformed direct-copy answer: {why}"),
            }
        })
    }

    fn forget(&mut self) {
        self.path.shared.waits.forget(&self.ids);
        self.ids.clear();
        if let Some(run) = self.run.take() {
            self.spare_run = Some(run);
        }
    }

    /// The state of a new post: the last one's where no answer or wait holds it any
    /// more, else a fresh one.
    fn new_run(&mut self) -> Arc<RunState> {
        let requests = self.requests.len();
        if let Some(mut run) = self.spare_run.take() {
            if let Some(state) = Arc::get_mut(&mut run) {
                state.reset(requests);
                return run;
            }
        }
        Arc::new(RunState::new(&self.agent, requests))
    }
}

impl BackendXfer for PeerDramXfer {
    fn post(&mut self, notif: Option<&[u8]>, params: &PostParams) -> Result<XferStatus> {
        if self.on_fallback {
            return self.fallback.post(notif, params);
        }
        let posted = trace::stamp();
        if let Some(stream) = super::attached_stream(params, self.gpu)? {
            // The peer's copy engine cannot wait for this process's stream.
            stream
                .synchronize()
                .map_err(|e| Error::Gpu(format!("{NAME}: the post's stream: {e:?}")))?;
        }
        if self.run.is_some() {
            return Err(Error::InvalidParam(format!(
                "{NAME}: a transfer posted again while it runs"
            )));
        }
        self.forget();
        let run = self.new_run();
        self.run = Some(run.clone());
        self.notif.clear();
        self.notif.extend_from_slice(notif.unwrap_or_default());
        self.has_notif = notif.is_some();
        // One request: the notification rides in it, and the target delivers it after
        // the copies (no second message after the answer).
        self.notif_carried = self.has_notif
            && self.peer_takes_notif
            && self.requests.len() == 1
            && self.notif.len() <= peer_dram::MAX_NOTIF_IN_REQUEST;
        let carried = self.notif_carried.then_some(self.notif.as_slice());
        let waits = &self.path.shared.waits;
        for pieces in &self.requests {
            let id = waits.add(&run);
            self.ids.push(id);
            self.scratch.clear();
            peer_dram::encode_request(
                &mut self.scratch,
                id,
                self.direction,
                pieces,
                self.path.me.as_bytes(),
                carried,
            );
            match self.conn.send_request(&self.scratch) {
                Ok(true) => {
                    self.path
                        .shared
                        .stats
                        .lane_requests
                        .fetch_add(1, Ordering::Relaxed);
                }
                Ok(false) => {}
                Err(e) => {
                    self.forget();
                    return Err(e);
                }
            }
        }
        self.stamps = trace::PostStamps {
            posted,
            sent: trace::stamp(),
            ..Default::default()
        };
        Ok(XferStatus::InProgress)
    }

    fn check(&mut self) -> Result<XferProgress> {
        if self.on_fallback {
            return self.fallback.check();
        }
        let Some(run) = self.run.clone() else {
            return Ok(XferProgress {
                status: XferStatus::Done,
                completed_ops: 0,
            });
        };
        if let Err(e) = self.pump() {
            self.forget();
            return Err(e);
        }
        let answered = run.answered.load(Ordering::Relaxed);
        if let Some((code, text)) = run.failed.lock().clone() {
            self.forget();
            return Err(Error::Backend {
                backend: NAME.into(),
                code,
                message: format!("transfer to `{}`: {text}", self.agent),
            });
        }
        if run.pending.load(Ordering::Acquire) > 0 {
            return Ok(XferProgress {
                status: XferStatus::InProgress,
                completed_ops: answered,
            });
        }
        if run.declined.load(Ordering::Acquire) {
            // The peer will not copy: the NIC path, now and for later posts.
            self.forget();
            self.on_fallback = true;
            self.path
                .shared
                .stats
                .fallbacks
                .fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                peer = %self.agent,
                "{NAME}: the peer declined direct VRAM copies; this request runs on the CPU proxy"
            );
            // The target delivered nothing: the notification goes with the NIC path.
            let notif = std::mem::take(&mut self.notif);
            let has_notif = std::mem::take(&mut self.has_notif);
            let posted = self.fallback.post(
                has_notif.then_some(notif.as_slice()),
                &PostParams::default(),
            );
            self.notif = notif;
            posted?;
            return Ok(XferProgress {
                status: XferStatus::InProgress,
                completed_ops: answered,
            });
        }
        if std::mem::take(&mut self.has_notif) && !self.notif_carried {
            // Every answer is in: the bytes are in place at the peer.
            self.conn.send(CONTROL_NOTIF, &self.notif)?;
        }
        if trace::on() && self.requests.len() == 1 {
            let answer_read = run.answer_read.load(Ordering::Relaxed);
            let post = trace::PostStamps {
                answer_read,
                notified: trace::now_ns(),
                done: 0,
                ..self.stamps
            };
            let done = trace::PostStamps {
                done: trace::now_ns(),
                ..post
            };
            trace::record(&done, &run.target_trace());
        }
        self.forget();
        self.path
            .shared
            .stats
            .bytes
            .fetch_add(self.bytes, Ordering::Relaxed);
        Ok(XferProgress {
            status: XferStatus::Done,
            completed_ops: answered,
        })
    }

    fn op_count(&self) -> usize {
        if self.on_fallback {
            return self.fallback.op_count();
        }
        self.requests.iter().map(Vec::len).sum()
    }

    /// Kernels post through the NIC path's rings (the peer's copy engine cannot be
    /// driven from a kernel): the request's device form is the NIC path's, and its host
    /// posts take that path from now on too, so that both see one transfer.
    fn gpu_xfer_req(&mut self) -> Result<crate::device::GpuHandle> {
        if self.run.is_some() {
            return Err(Error::InvalidParam(format!(
                "{NAME}: a GPU request from a transfer that is running on the direct path"
            )));
        }
        let handle = self.fallback.gpu_xfer_req()?;
        self.on_fallback = true;
        Ok(handle)
    }

    fn staged_bytes(&self) -> u64 {
        if self.on_fallback {
            self.fallback.staged_bytes()
        } else {
            0
        }
    }
}

impl Drop for PeerDramXfer {
    fn drop(&mut self) {
        if let Some(run) = self.run.take() {
            // The peer may still be copying into this process's VRAM: wait (bounded) for
            // its answers while its connection lives.
            let deadline = Instant::now() + RELEASE_WAIT;
            while run.pending.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
                if self.pump().is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        self.path.shared.waits.forget(&self.ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_confirmed_loaded_peer_is_served() {
        let state = Arc::new(PeerState {
            agent: "alice".into(),
            vram: AdvertisedVram::default(),
            imports: Imports::default(),
            serves: true,
            notif_in_request: true,
            oob: None,
            local: None,
            conn: Mutex::new(None),
        });
        let peers: HashMap<_, _> = [("alice".to_string(), state.clone())].into();
        let from = |agent: &str, verified| ControlFrom {
            agent: agent.into(),
            verified,
        };
        assert!(attribute(&peers, &from("alice", true)).is_some_and(|p| Arc::ptr_eq(&p, &state)));
        // Her name on a connection she did not confirm, or a peer never loaded.
        assert!(attribute(&peers, &from("alice", false)).is_none());
        assert!(attribute(&peers, &from("mallory", true)).is_none());
    }

    /// The answer `reply`'s other end reads next: its frame kind and decoded message.
    fn read_answer(end: &mut std::os::unix::net::UnixStream) -> (u8, Message) {
        use std::io::Read;
        let mut len = [0u8; 4];
        end.read_exact(&mut len).unwrap();
        let mut frame = vec![0u8; u32::from_le_bytes(len) as usize];
        end.read_exact(&mut frame).unwrap();
        (frame[0], decode(&frame[1..]).unwrap())
    }

    /// A carried notification is delivered once, as from the connection's peer, before
    /// the answer of a request whose copies completed; never for one that failed (or was
    /// declined: answered without `finish`), whose answer still goes.
    #[test]
    fn a_carried_notification_is_delivered_once_and_only_after_completed_copies() {
        let inbox = Arc::new(crate::backends::shared::NotifInbox::default());
        let (reply, mut end) = ControlReply::pair_for_test(inbox.clone());
        let taken = || {
            let mut got = Vec::new();
            inbox.take(&mut got);
            got
        };
        finish(
            &reply,
            "alice",
            Some(b"after the bytes".to_vec()),
            1,
            0,
            None,
        );
        assert_eq!(
            taken(),
            vec![("alice".to_string(), b"after the bytes".to_vec())]
        );
        let (kind, msg) = read_answer(&mut end);
        assert_eq!(kind, CONTROL_PEER_COPY);
        assert_eq!(
            msg,
            Message::Done(Done {
                id: 1,
                errno: 0,
                trace: None
            })
        );
        assert!(taken().is_empty(), "delivered once");
        // Failed copies: no notification, the failure answered.
        finish(&reply, "alice", Some(b"never".to_vec()), 2, libc::EIO, None);
        assert!(taken().is_empty());
        let (_, msg) = read_answer(&mut end);
        assert!(matches!(
            msg,
            Message::Done(Done {
                id: 2,
                errno: libc::EIO,
                ..
            })
        ));
        // Declined on the listener's thread: only the answer (with the read stamp where
        // tracing), nothing delivered.
        let stamps = trace::TargetStamps {
            read: 5,
            ..Default::default()
        };
        answer(&reply, 3, libc::EADDRNOTAVAIL, Some(stamps));
        assert!(taken().is_empty());
        let (_, msg) = read_answer(&mut end);
        let Message::Done(done) = msg else {
            panic!("not an answer: {msg:?}");
        };
        assert_eq!((done.id, done.errno), (3, libc::EADDRNOTAVAIL));
        let t = done.trace.expect("the stamps travel back");
        assert_eq!(t.read, 5);
        assert!(t.answered > 0, "the answer's own stamp");
        // Without a notification a completed request is answered only.
        finish(&reply, "alice", None, 4, 0, None);
        assert!(taken().is_empty());
        assert!(matches!(
            read_answer(&mut end).1,
            Message::Done(Done {
                id: 4,
                errno: 0,
                ..
            })
        ));
    }
}
