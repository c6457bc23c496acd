//! `VERBS`: RC queue pairs over the `ibverbs` crate, one or more rails, striping, and
//! notifications that fire only after the data has landed.
//!
//! # Rails
//! A rail is one device context + completion queue (with its completion channel) +
//! shared receive queue, driven by its own worker thread. `device` names one or more
//! devices (`mlx5_0,mlx5_1`); `num_rails` (default: one per device) rails are spread
//! over them round-robin, so several rails may share one device (each with its own QPs,
//! CQ and thread: striping is exercised on a single soft-RoCE device). Descriptors of at
//! least `striping_threshold` bytes (default 128 KiB) are split across all rails;
//! smaller ones go round-robin. Work requests go out in chains of up to 64 (one
//! `ibv_post_send` each, only the last one signaled), at most [`MAX_OUTSTANDING`] in
//! flight per rail.
//!
//! # Progress
//! A rail's state (its jobs, window and CQ) sits behind one lock that whichever thread
//! gets it drives: `post` queues the transfer and issues only its first chain (so a post
//! of 15,000 descriptors stays cheap), status polls issue the rest and read the CQ,
//! `get_notifs` reads the receive queue, and the rail's worker thread (with the agent's
//! `progress_thread`, the default) does all of that when nobody polls. An idle worker
//! sleeps on the CQ's completion channel and an eventfd that a post with work left
//! writes, so a polling caller never waits for a wake-up and a spinning worker never
//! takes the CPU that soft-RoCE needs to move the data.
//!
//! # Connections: why a side channel
//! An RC QP is connected to exactly one remote QP, so the QP numbers and PSNs of a pair
//! exist only once both sides know of each other. NIXL's usage (and `nixlbench`, and the
//! P2P fetch) is one-sided: the initiator loads the target's metadata, the target never
//! loads the initiator's. A pool of pre-created QPs advertised in the metadata cannot
//! work then: the target would have to learn which of its QPs the initiator took, and
//! the initiator's QPN/PSN, before its QP can leave INIT, i.e. it needs a message from
//! the initiator before the first RDMA packet — a side channel anyway.
//!
//! So each agent's connection information carries, per rail, the device index, port,
//! GID, LID and MTU, plus the address of a tiny TCP side channel (by default on the IP
//! address of the RoCE GID, so it is reachable wherever RoCE is) and a random
//! incarnation number. `load_remote_conn_info` creates one RC QP per local rail for that
//! peer and sends the peer a HELLO with each QP's QPN and PSN (and its own GID/MTU); the
//! peer's side-channel thread creates the matching QPs, brings them to RTS, registers
//! them, and answers with their QPNs and PSNs; the initiator then brings its QPs to RTS.
//! Both sides are connected when `load_remote_conn_info` returns, whatever the target
//! loaded. Each direction of traffic has its own QP pairs (A's transfers to B use the
//! pairs A opened; B's to A the pairs B opened), so there is never a race over who
//! connects, and a peer's restart (new incarnation number, new side-channel address)
//! simply replaces the old pairs when its new metadata is loaded.
//!
//! Who a connection is from: the HELLO's name is checked with the agent it names where
//! that is a peer this agent loaded, or this agent (module `side_channel`); notifications
//! and staging messages are attributed to the connection whose QP they arrive on.
//!
//! The side-channel TCP connection stays open as a liveness signal: when the peer's
//! process dies, its kernel closes the socket, our side-channel thread sees the EOF
//! within milliseconds, moves our QPs to the error state (flushing in-flight work) and
//! every transfer to that peer fails with [`Error::RemoteDisconnect`]. A killed process
//! closes its sockets only at the end of its teardown, which a loaded (or emulated)
//! host may take hundreds of milliseconds to finish; so the connection information also
//! carries the process's identity (the `liveness` module LIBFABRIC uses too), and a
//! peer on the same host, in the same pid namespace, is watched through the OS: its end
//! (pidfd) and a SIGKILL pending for it (`/proc/<pid>/status`) kill the connection as
//! the EOF does, asked while transfers to it are polled (at most every 200 µs, `/proc`
//! every 5 ms) and by the side-channel thread, which wakes at least every 20 ms while
//! it watches such a peer. A peer whose host disappears (its link cut, its machine
//! killed) closes nothing: the side channel also carries heartbeats (the private
//! `backends::heartbeat` module). The target's side-channel thread, which moves no
//! data, sends one byte on every incoming connection's socket each `heartbeat_ms`
//! (default 100, advertised in the handshake's reply); the initiator's declares the
//! peer dead after `heartbeat_misses` (default 5) of its intervals without one — 0.5 s
//! — and kills the connection as above (a peer on this host whose process still runs,
//! and whose death the OS would tell, only past 20 times that: as LIBFABRIC's heartbeat
//! hub, so that a loaded machine that did not schedule its beats kills nothing). Behind that, the RC transport
//! itself gives up after `retry_cnt` retries (default 6: rxe retries forever at 7)
//! of `qp_timeout` each: `IBV_WC_RETRY_EXC_ERR` → [`Error::RemoteDisconnect`].
//!
//! # Notifications
//! With a notification, the last WRITE of each rail's share of a transfer is an
//! `RDMA_WRITE_WITH_IMM` whose 32-bit immediate is the transfer's sequence number. RC
//! delivers the operations of one QP in order, so the target's receive completion for
//! that write means every earlier write on the same QP has been placed. The
//! notification message itself is a SEND on rail 0's QP behind its writes, carrying the
//! sequence number and the number of immediates to expect (one per rail used). The
//! target counts immediates per (connection, sequence) — they arrive on any rail, in any
//! order — and releases the notification only when the count is reached and the message
//! is in, so it can neither fire early nor be lost. For READ the message is sent after
//! the last read completed locally, with nothing to count.
//!
//! A staged WRITE (below) adds its data units to the count: each RDMA write from one of
//! the initiator's bounce slots carries the sequence number as its immediate, and each
//! chunk the target pulls into staged memory is counted by the target itself once its
//! copy into that memory completed — so the notification fires only after the last
//! staged byte is in the target's VRAM.
//!
//! # VRAM (feature `cuda`)
//! Each VRAM registration is made one of two ways, chosen per registration and shown by
//! [`crate::Agent::query_mem`] as `VERBS(direct)` or `VERBS(staged)`:
//! - **direct**: the range's DMA-BUF (`cuMemGetHandleForAddressRange` of its pages) is
//!   registered on every device with `ibv_reg_dmabuf_mr`, addressed by its device
//!   address; it then moves like DRAM (GPUDirect RDMA). Its public metadata is the
//!   ordinary key list.
//! - **staged**: where that is refused — soft-RoCE has no DMA-BUF registration (probed
//!   once at creation: [`VerbsBackend::direct_vram_refusal`]), the GPU or kernel cannot
//!   export DMA-BUF, or the registration fails — the region goes through the staging
//!   pipeline ([`super::staging`]): chunks of at most one slot move through pinned,
//!   registered host bounce slots, the device copy of one chunk overlapping the network
//!   operation of another, on both sides (the target copies a WRITE's chunks into its
//!   VRAM, and a READ's out of it, itself). Its public metadata is `0 | 1 | slot size
//!   u32`, so a peer knows to stage.
//!
//! The staging transport (`stage_net`) posts RDMA WRITE (with immediate), RDMA READ and
//! SEND of the protocol's control messages on the existing QPs — the target serving a
//! request on its end of the QP pair the request came through — and the rail workers
//! feed it completions and receives. Immediate data is 32 bits where the engine's remote
//! CQ data is 64: see `stage_net` for how keys and FETCH tokens are carried. A peer's
//! VRAM is reachable without feature `cuda` (it stages, or registered it directly).
//!
//! # Topology
//! With several devices, a registration is bound to the rails whose device is local to
//! the memory ([`crate::topology`]): DRAM to the devices on the NUMA node holding the
//! region's first page (`get_mempolicy`); its descriptors are striped and spread over
//! those rails only. The topology comes from the `topology_xml` parameter or hwloc's
//! `HWLOC_XMLFILE` (an `lstopo --of xml` export), else from sysfs. Memory whose node is
//! unknown, or with no local device, uses every rail.
//!
//! # Parameters
//! `device` (comma-separated; default the first device), `gid_index` (default: the
//! port's RoCE v2 IPv4 GID, else 0), `ib_port` (default 1), `num_rails` (default: one
//! per device), `striping_threshold` (bytes, default 131072), `listen_addr` (the side
//! channel, default `<GID's IP>:0`; required where the GID is no IP address, e.g. on
//! InfiniBand), `topology_xml` (path of an hwloc XML export), `qp_timeout` (the RC
//! local ACK timeout exponent, 4.096 µs × 2^n per try, default
//! [`DEFAULT_QP_TIMEOUT`]), `retry_cnt` (RC retries, 0..=7, default
//! [`DEFAULT_RETRY_CNT`]), `heartbeat_ms` (default 100; 0: no heartbeats) and
//! `heartbeat_misses` (default 5): see "Connections" above.
//!
//! Staging, named as `LIBFABRIC` names them: `vram_mode` (`auto`: direct where possible,
//! else staged — the default; `staged`: always staged; `direct`: a refused direct
//! registration is the registration's error, `Backend` with `EOPNOTSUPP` where it is
//! unsupported, naming why), `staging_chunk` (slot size in bytes, a multiple of 4096,
//! default 524288), `staging_chunks` (slots per half, 2..=1024, default 16),
//! `stage_dram` (`1`: DRAM registrations are staged too, with `memcpy` for the copies —
//! the pipeline end to end without a GPU, for tests).

mod side_channel;
mod stage_net;
mod vram;
mod wire;
mod worker;
mod xfer;

#[cfg(test)]
mod tests;

use super::heartbeat::{Beat, HeartbeatConfig, Pacer};
use super::liveness::{Liveness, ProcessId};
use super::shared::{random_u64, LocalProcess, NotifTracker};
use crate::backend::{
    Backend, BackendInit, BackendParams, BackendXfer, Capabilities, LocalMd, NotifWaker, RemoteMd,
    XferEntry, XferOp,
};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use crate::os::WakeFd;
use crate::topology::{numa_node_of, Topology};
use ibverbs::{
    AccessFlags, CompletionChannel, CompletionQueue, ConnectOptions, Context, Gid, IpFamily,
    MemoryRegion, Mtu, PreparedQueuePair, ProtectionDomain, QpType, QueuePair, SharedReceiveQueue,
};
use parking_lot::{Mutex, RwLock};
use side_channel::side_channel_thread;
use stage_net::Stager;
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vram::{direct_refusal, RegMode, StagedReg, StagingParams};
use wire::{decode_conn_info, encode_conn_info, encode_notif, RailInfo};
use worker::{rail_worker, RailState};
use xfer::{RailJob, RailOp, VerbsXfer, XferShared};

/// The backend's name.
pub const NAME: &str = "VERBS";
/// Default size from which one descriptor is split across all rails.
pub const DEFAULT_STRIPING_THRESHOLD: usize = 128 << 10;
/// Default RC local ACK timeout exponent: 4.096 µs × 2^18 ≈ 1.07 s per try (UCX's RC
/// timeout is 1 s, NCCL's default exponent 20). A dead peer process is seen at once
/// through the side channel, a vanished host through its heartbeats; this sets the
/// transport's own verdict behind them: nominally about 7.5 s with
/// [`DEFAULT_RETRY_CNT`] retries, but soft-RoCE resends a whole message per retry and,
/// under emulation, slowly (with heartbeats off, a WRITE across a cut link between two
/// emulated guests outlasted the stall timeout: `docs/BENCHMARKS.md`). Shorter timeouts
/// make soft-RoCE under load retransmit bursts whose ACKs are merely late.
pub const DEFAULT_QP_TIMEOUT: u8 = 18;
/// Default RC retry count: 6, not the customary 7, because soft-RoCE (rxe) takes 7 to
/// mean "retry forever", so a dead peer's QP would never report `RETRY_EXC_ERR` there.
pub const DEFAULT_RETRY_CNT: u8 = 6;
/// Largest notification message (the user's bytes).
pub const MAX_NOTIF_BYTES: usize = NOTIF_SLOT - NOTIF_HEADER;
/// Work requests one rail keeps in flight (over all its QPs) before it waits for
/// completions; also each QP's send queue depth, so a post never finds its queue full.
pub const MAX_OUTSTANDING: usize = 1024;

const NOTIF_SLOT: usize = 8192;
const NOTIF_HEADER: usize = 12;
/// Receive buffers of a rail's shared receive queue (notifications and immediates).
const RECV_SLOTS: usize = 256;
/// Send buffers of a rail for notification messages.
const SEND_SLOTS: usize = 64;
/// Work requests per `ibv_post_send` chain.
const BATCH: usize = 64;
/// Largest single work request (the SGE length is 32 bits).
const MAX_WR_BYTES: usize = 1 << 30;
const CQ_SIZE: u32 = (MAX_OUTSTANDING + RECV_SLOTS + STAGE_SQ + 256) as u32;
const MAX_RAILS: usize = 16;
/// Bound on every side-channel exchange.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the side-channel thread blocks: a safety net. Its sockets (handshakes,
/// heartbeats, peers' EOFs), the heartbeats it owes or awaits, new connections and the
/// stop (its wake eventfd) wake it, so it wakes only when there is something to do
/// (with the default `heartbeat_ms`, ten times a second per peer).
const MONITOR_PERIOD: Duration = Duration::from_secs(1);
/// How long a worker polls without finding work before it sleeps on its completion
/// channel (and wake-up eventfd). Short: on soft-RoCE the kernel that moves the data
/// needs the CPU a spinning worker would take.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(50);
/// Longest sleep (a safety net: completions and new jobs wake the worker).
const SLEEP_MS: i32 = 100;

/// wr_id bits: receive completions of the SRQ.
const RECV_WR: u64 = 1 << 63;
/// wr_id bits: the staging engine's operations (`stage_net`).
const STAGE_WR: u64 = 1 << 62;
/// Send-queue entries of every QP for the staging engine's operations, and the most a
/// rail keeps in flight.
const STAGE_SQ: usize = 256;

// ---------------------------------------------------------------------------------------
// Devices, rails, shared state

#[derive(Debug)]
struct Device {
    name: String,
    ctx: Context,
    pd: ProtectionDomain,
    opts: ConnectOptions,
    gid: Gid,
    lid: u16,
    mtu: Mtu,
    max_msg: usize,
}

#[derive(Debug)]
struct Rail {
    index: usize,
    dev: usize,
    cq: CompletionQueue,
    channel: CompletionChannel,
    srq: SharedReceiveQueue,
    submit: Mutex<VecDeque<RailJob>>,
    /// The worker blocks on its completion channel and this eventfd when idle.
    wake_fd: WakeFd,
    sleeping: AtomicBool,
    state: Mutex<RailState>,
}

impl Rail {
    /// Queues a job for the rail's worker, waking it if it sleeps.
    fn submit(&self, job: RailJob) {
        self.submit.lock().push_back(job);
        self.nudge();
    }

    /// Wakes the worker if it sleeps (pairs with the store-then-check in `rail_sleep`,
    /// both SeqCst).
    fn nudge(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake();
        }
    }

    /// A round of progress from the calling thread, unless another thread is at it;
    /// then wakes the worker if work is left that nobody is issuing.
    fn progress(&self, common: &Common, chains: usize) {
        match self.state.try_lock() {
            Some(mut state) => {
                state.round(self, common, chains);
                if state.unissued() {
                    drop(state);
                    self.nudge();
                }
            }
            None => self.nudge(),
        }
    }

    fn wake(&self) {
        if let Err(e) = self.wake_fd.signal() {
            tracing::trace!("eventfd write: {e}");
        }
    }
}

/// A connection this agent opened to a peer: one QP per local rail.
#[derive(Debug)]
struct Outgoing {
    peer: String,
    conn_info: Vec<u8>,
    qps: Vec<QueuePair>,
    /// Per local rail: the peer's device index (selects the rkey of a region).
    remote_dev: Vec<usize>,
    dead: AtomicBool,
    reason: Mutex<String>,
    stream: TcpStream,
    /// The peer's heartbeats on `stream` (only the side-channel thread takes it).
    beat: Mutex<Beat>,
    /// The peer's id of this connection (keys of staged notifications carry it).
    remote_id: u64,
    /// The staging engine was told the connection is gone.
    staging_told: AtomicBool,
    /// Its side channel's record in `Common::own_streams`, removed with it.
    _side: side_channel::OwnStream,
    /// The peer's process, where it runs on this host (in this pid namespace): its end
    /// and a kill in progress are seen through the OS, before its teardown closes the
    /// side channel (see [`Outgoing::process_gone`]).
    process: Option<Arc<Liveness>>,
    /// The same process as the heartbeat rules see it (`None`: another host or pid
    /// namespace): its silence is judged more patiently while it runs, in this network
    /// namespace (`LocalProcess::runs`).
    local_process: Option<LocalProcess>,
}

impl Outgoing {
    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Whether the peer's process is known to have ended or to be being killed (asked
    /// of the OS, cheaply: see `liveness`); the connection is then killed with why.
    fn process_gone(&self) -> bool {
        let Some(process) = &self.process else {
            return false;
        };
        match process.check(&self.peer) {
            Ok(()) => false,
            Err(Error::RemoteDisconnect { reason, .. }) => {
                self.kill(&format!("the peer's process is gone: {reason}"));
                true
            }
            Err(e) => {
                self.kill(&e.to_string());
                true
            }
        }
    }

    fn dead_reason(&self) -> Option<String> {
        self.is_dead().then(|| self.reason.lock().clone())
    }

    /// Marks the connection broken (the first reason wins), flushes in-flight work and
    /// tells the peer through the side channel.
    fn kill(&self, reason: &str) {
        {
            let mut r = self.reason.lock();
            if self.dead.load(Ordering::Acquire) {
                return;
            }
            *r = reason.to_string();
            self.dead.store(true, Ordering::Release);
        }
        tracing::debug!(peer = %self.peer, reason, "VERBS connection closed");
        for qp in &self.qps {
            if let Err(e) = qp.to_error() {
                tracing::debug!(error = %e, "moving a QP to ERR failed");
            }
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    fn disconnect_error(&self) -> Error {
        Error::RemoteDisconnect {
            agent: self.peer.clone(),
            reason: self
                .dead_reason()
                .unwrap_or_else(|| "connection closed".into()),
        }
    }
}

/// A connection a peer opened to this agent (we are the target of its transfers).
#[derive(Debug)]
struct Incoming {
    id: u64,
    /// The requester's incarnation number (how its staging requests name it).
    nonce: u64,
    peer: Arc<str>,
    /// (local rail, QP).
    qps: Vec<(usize, QueuePair)>,
    stream: TcpStream,
    /// When the next heartbeat to the peer is due (only the side-channel thread takes
    /// it); `None` until the handshake's reply is out and the socket non-blocking.
    pacer: Mutex<Option<Pacer>>,
}

/// (incoming connection id, the sender's sequence number).
type TrackerKey = (u64, u32);
/// (incoming connection id, peer name).
type IncomingRef = (u64, Arc<str>);

/// Shared between the backend, its rail workers and its side-channel thread.
#[derive(Debug)]
struct Common {
    agent_name: String,
    nonce: u64,
    devices: Vec<Arc<Device>>,
    rails: Vec<Arc<Rail>>,
    /// Notifications, released only after their data.
    notifs: NotifTracker<TrackerKey>,
    /// The VRAM staging pipeline (idle and costless until something is staged).
    stager: Stager,
    outgoing: RwLock<HashMap<String, Arc<Outgoing>>>,
    incoming: RwLock<HashMap<u64, Arc<Incoming>>>,
    /// (local rail, QPN) of an incoming QP → (incoming connection id, peer name).
    incoming_qpn: RwLock<HashMap<(usize, u32), IncomingRef>>,
    next_incoming: AtomicU64,
    /// Incoming connections whose peer left, until the rails retire them (`Closing`).
    closing: Mutex<Vec<Closing>>,
    /// The last ticket handed to a connection put on `closing`.
    closing_ticket: AtomicU64,
    /// Connections on `closing`: a rail's round looks at the list only when it is not 0.
    closing_len: AtomicUsize,
    stop: AtomicBool,
    /// How often this side sends heartbeats, and how many of a peer's it may miss.
    heartbeat: HeartbeatConfig,
    /// Wakes the side-channel thread: a connection to watch (or beat) and the stop.
    monitor_wake: WakeFd,
    /// The side-channel connections this agent opened, by (local, remote) address:
    /// what a target asks about before it takes a HELLO naming this agent.
    own_streams: Arc<side_channel::OwnStreams>,
    /// Handshakes being served (each on a thread of its own), at most
    /// `side_channel::MAX_HANDSHAKES`.
    handshakes: AtomicUsize,
    /// HELLOs refused for the name they gave (the named peer does not know them).
    refused_hellos: AtomicU64,
}

impl Common {
    /// Wakes the side-channel thread (it looks at its connections and the stop again).
    fn wake_monitor(&self) {
        if let Err(e) = self.monitor_wake.signal() {
            tracing::warn!(error = %e, "waking the VERBS side-channel thread failed");
        }
    }

    /// The current connection this agent opened whose QP on `rail` is `qpn`.
    fn outgoing_of_qp(&self, rail: usize, qpn: u32) -> Option<Arc<Outgoing>> {
        self.outgoing
            .read()
            .values()
            .find(|c| c.qps.get(rail).is_some_and(|qp| qp.qp_num() == qpn))
            .cloned()
    }

    /// Incoming connection `id`, while it is open (a closing one takes no requests).
    fn incoming_conn(&self, id: u64) -> Option<Arc<Incoming>> {
        self.incoming.read().get(&id).cloned()
    }

    /// Closes an incoming connection (its peer closed the side channel, a heartbeat could
    /// not be sent, or the handshake failed) without waiting for any rail: the
    /// side-channel thread calls this, and its heartbeats to other peers must not go out
    /// late behind a rail's lock (a rail worker may hold it long on a loaded host). The
    /// connection is no longer watched nor beaten, its QPs go to ERR, and it waits on
    /// `closing` until the rails retire it (`rail_drained`).
    fn close_incoming(&self, id: u64) {
        let Some(conn) = self.incoming.write().remove(&id) else {
            return;
        };
        for (_, qp) in &conn.qps {
            // Nothing more lands on them; staging operations serving the peer that may
            // still hold a QP are flushed.
            if let Err(e) = qp.to_error() {
                tracing::debug!(error = %e, "moving an incoming QP to ERR failed");
            }
        }
        // The peer is done with the socket: close our half now, not at retirement.
        let _ = conn.stream.shutdown(std::net::Shutdown::Both);
        {
            let mut closing = self.closing.lock();
            let ticket = self.closing_ticket.fetch_add(1, Ordering::SeqCst) + 1;
            closing.push(Closing {
                conn,
                ticket,
                drained: 0,
            });
            self.closing_len.store(closing.len(), Ordering::SeqCst);
        }
        // Sleeping workers retire it at once (without progress threads: the next poll).
        for rail in &self.rails {
            rail.nudge();
        }
    }

    /// The ticket a rail reads before it polls its CQ: `Some` while connections are
    /// closing (one load when none is).
    fn closing_ticket(&self) -> Option<u64> {
        (self.closing_len.load(Ordering::SeqCst) != 0)
            .then(|| self.closing_ticket.load(Ordering::SeqCst))
    }

    /// Rail `rail` read its CQ empty in a poll that began after it read `ticket`
    /// (`closing_ticket`): the closing connections up to that ticket are drained on it.
    /// Once every rail drained one, the last unmaps it and forgets its half-assembled
    /// notifications.
    ///
    /// Why no notification is lost: a peer that sends a notification and leaves at once
    /// saw the send complete, i.e. our responder had completed the receive into our CQ
    /// and acknowledged it before the peer closed its socket, before the side channel
    /// read the EOF and handed out the ticket. Every poll from then on sees that receive,
    /// in CQ order, until the CQ reads empty; so once each rail emptied its CQ after the
    /// ticket, every receive (or immediate) of the connection, on any rail, was read
    /// while it was still mapped, and its QPs, in ERR, take no more (unmapped first,
    /// such a receive was dropped as coming from an unknown QP: nixlbench's target waited
    /// for a DONE its initiator had delivered).
    fn rail_drained(&self, rail: usize, ticket: u64) {
        let all = (1u32 << self.rails.len()) - 1;
        let retired: Vec<Closing> = {
            let mut closing = self.closing.lock();
            for c in closing.iter_mut().filter(|c| c.ticket <= ticket) {
                c.drained |= 1 << rail;
            }
            let (retired, left) = std::mem::take(&mut *closing)
                .into_iter()
                .partition(|c| c.drained == all);
            *closing = left;
            self.closing_len.store(closing.len(), Ordering::SeqCst);
            retired
        };
        for c in retired {
            self.unmap_incoming(&c.conn);
            self.notifs.forget(|(conn_id, _)| *conn_id == c.conn.id);
            tracing::debug!(peer = %c.conn.peer, "VERBS incoming connection closed");
        }
    }

    /// Forgets which connection `conn`'s QPs belong to.
    fn unmap_incoming(&self, conn: &Incoming) {
        let mut by_qpn = lock_write(&self.incoming_qpn);
        for (rail, qp) in &conn.qps {
            by_qpn.remove(&(*rail, qp.qp_num()));
        }
    }
}

/// An incoming connection whose peer left, on `Common::closing`: its QPs are in ERR,
/// and it stays mapped in `incoming_qpn` until every rail read its CQ empty after it
/// came (see `Common::rail_drained`).
#[derive(Debug)]
struct Closing {
    conn: Arc<Incoming>,
    /// From `Common::closing_ticket`, taken once its QPs were in ERR.
    ticket: u64,
    /// Bit r: rail r read its CQ empty since.
    drained: u32,
}

// `Closing::drained` has a bit per rail, and room for the mask of all of them.
const _: () = assert!(MAX_RAILS < 32);

/// Write-locks `m`, taking over its data if a holder panicked (`Drop` must not panic).
fn lock_write<T>(m: &RwLock<T>) -> parking_lot::RwLockWriteGuard<'_, T> {
    m.write()
}

/// The VERBS backend.
#[derive(Debug)]
pub struct VerbsBackend {
    common: Arc<Common>,
    conn_info: Vec<u8>,
    listen_addr: SocketAddr,
    threads: Mutex<Vec<JoinHandle<()>>>,
    striping_threshold: usize,
    next_seq: Arc<AtomicU32>,
    next_rail: AtomicUsize,
    /// Serialises connection set-up (the side channel is one round trip per peer).
    connect_lock: Mutex<()>,
    /// Where the devices sit (NUMA/PCIe), for binding registrations to local rails.
    topology: Option<Topology>,
    /// Memory kinds registered (VRAM with feature `cuda`).
    mem_kinds: Vec<MemKind>,
    staging: StagingParams,
    /// Why VRAM will not be registered directly, if it will not (see `vram`).
    direct_refusal: Option<String>,
    /// The first staged VRAM registration was logged with its reason.
    staged_logged: AtomicBool,
    /// Rail workers receive notifications (the agent's `progress_thread`); without
    /// them, only `take_notifs` does.
    progress_thread: bool,
}

fn verbs_error(context: &str, e: ibverbs::Error) -> Error {
    Error::Backend {
        backend: NAME.into(),
        code: e.errno().unwrap_or(0),
        message: format!("{context}: {e}"),
    }
}

fn param<T: std::str::FromStr>(params: &BackendParams, key: &str, default: T) -> Result<T> {
    super::shared::param(NAME, params, key, default)
}

fn open_device(
    name: &str,
    port: u8,
    gid_index: Option<u8>,
    (qp_timeout, retry_cnt): (u8, u8),
) -> Result<Device> {
    let ctx = Context::open(name).map_err(|e| match e {
        ibverbs::Error::DeviceNotFound { .. } => Error::Backend {
            backend: NAME.into(),
            code: libc::ENODEV,
            message: e.to_string(),
        },
        other => verbs_error(&format!("opening {name}"), other),
    })?;
    let attr = ctx
        .query_device()
        .map_err(|e| verbs_error("ibv_query_device", e))?;
    let port_attr = ctx
        .query_port(port)
        .map_err(|e| verbs_error(&format!("{name} port {port}"), e))?;
    let gid_index = match gid_index {
        Some(i) => i,
        None => ctx
            .find_roce_v2_gid(port, IpFamily::V4)
            .map(|g| g.gid_index as u8)
            .unwrap_or(0),
    };
    let gid = ctx
        .query_gid(port, gid_index.into())
        .map_err(|e| verbs_error(&format!("{name} port {port} GID {gid_index}"), e))?;
    let opts = ConnectOptions {
        port_num: port,
        gid_index,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        timeout: qp_timeout,
        retry_cnt,
        rnr_retry: 7,
        max_rd_atomic: attr.max_qp_init_rd_atom().clamp(1, 16) as u8,
        max_dest_rd_atomic: attr.max_qp_rd_atom().clamp(1, 16) as u8,
        ..ConnectOptions::default()
    };
    let pd = ctx.alloc_pd().map_err(|e| verbs_error("ibv_alloc_pd", e))?;
    Ok(Device {
        name: name.to_string(),
        max_msg: (port_attr.max_msg_sz() as usize).clamp(4096, MAX_WR_BYTES),
        lid: port_attr.lid(),
        mtu: port_attr.active_mtu(),
        gid,
        opts,
        pd,
        ctx,
    })
}

fn open_rail(index: usize, dev: usize, device: &Device) -> Result<Rail> {
    let channel = device
        .ctx
        .create_comp_channel()
        .map_err(|e| verbs_error("ibv_create_comp_channel", e))?;
    channel
        .set_nonblocking(true)
        .map_err(|e| verbs_error("completion channel", e))?;
    let cq = device
        .ctx
        .create_cq(CQ_SIZE, Some(&channel), index as u32)
        .or_else(|_| device.ctx.create_cq(CQ_SIZE, Some(&channel), 0))
        .map_err(|e| verbs_error("ibv_create_cq", e))?;
    let srq = device
        .pd
        .create_srq(RECV_SLOTS as u32, 1)
        .map_err(|e| verbs_error("ibv_create_srq", e))?;
    let wake_fd = WakeFd::new()?;
    let state = RailState::new(&device.pd, &srq)?;
    Ok(Rail {
        index,
        dev,
        cq,
        channel,
        srq,
        submit: Mutex::new(VecDeque::new()),
        wake_fd,
        sleeping: AtomicBool::new(false),
        state: Mutex::new(state),
    })
}

/// The side channel's address: `listen_addr` if given, else the GID's IP address.
fn side_channel_ip(gid: &Gid) -> Option<IpAddr> {
    match gid.to_ip() {
        IpAddr::V4(v4) if !v4.is_unspecified() => Some(IpAddr::V4(v4)),
        IpAddr::V6(v6) if !v6.is_unspecified() && (v6.segments()[0] & 0xffc0) != 0xfe80 => {
            Some(IpAddr::V6(v6))
        }
        _ => None,
    }
}

pub(crate) fn create(init: &BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(VerbsBackend::open(init)?))
}

/// Opens the backend (see the module docs for `params`).
fn open(init: &BackendInit) -> Result<VerbsBackend> {
    let params = &init.params;
    const KNOWN: &[&str] = &[
        "device",
        "gid_index",
        "ib_port",
        "num_rails",
        "striping_threshold",
        "listen_addr",
        "topology_xml",
        "qp_timeout",
        "retry_cnt",
        "vram_mode",
        "staging_chunk",
        "staging_chunks",
        "stage_dram",
        HeartbeatConfig::KEYS[0],
        HeartbeatConfig::KEYS[1],
    ];
    if let Some(key) = params.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(Error::InvalidParam(format!(
            "{NAME} has no parameter `{key}` (known: {})",
            KNOWN.join(", ")
        )));
    }
    let names: Vec<String> = match params.get("device") {
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        None => {
            let list = ibverbs::devices().map_err(|e| verbs_error("ibv_get_device_list", e))?;
            list.iter().take(1).map(|d| d.name()).collect()
        }
    };
    if names.is_empty() {
        return Err(Error::Backend {
            backend: NAME.into(),
            code: libc::ENODEV,
            message: "no RDMA device found (set the `device` parameter)".into(),
        });
    }
    let port: u8 = param(params, "ib_port", 1)?;
    let gid_index: Option<u8> = params
        .get("gid_index")
        .map(|_| param(params, "gid_index", 0u8))
        .transpose()?;
    let num_rails: usize = param(params, "num_rails", names.len())?;
    if !(1..=MAX_RAILS).contains(&num_rails) || names.len() > MAX_RAILS {
        return Err(Error::InvalidParam(format!(
            "{NAME}: num_rails must be 1..={MAX_RAILS} (and at most {MAX_RAILS} devices)"
        )));
    }
    let striping_threshold =
        param(params, "striping_threshold", DEFAULT_STRIPING_THRESHOLD)?.max(1);
    let qp_timeout: u8 = param(params, "qp_timeout", DEFAULT_QP_TIMEOUT)?;
    if qp_timeout > 31 {
        return Err(Error::InvalidParam(format!(
            "{NAME}: qp_timeout is a 5-bit exponent (0..=31)"
        )));
    }
    let retry_cnt: u8 = param(params, "retry_cnt", DEFAULT_RETRY_CNT)?;
    if retry_cnt > 7 {
        return Err(Error::InvalidParam(format!(
            "{NAME}: retry_cnt is a 3-bit count (0..=7; 7 means forever on rxe)"
        )));
    }
    let heartbeat = HeartbeatConfig::parse(NAME, params)?;
    let staging = StagingParams::parse(params)?;
    let mut devices = Vec::with_capacity(names.len());
    for name in &names {
        devices.push(Arc::new(open_device(
            name,
            port,
            gid_index,
            (qp_timeout, retry_cnt),
        )?));
    }
    let mut rails = Vec::with_capacity(num_rails);
    for r in 0..num_rails {
        let dev = r % devices.len();
        rails.push(Arc::new(open_rail(r, dev, &devices[dev])?));
    }
    let bind: SocketAddr = match params.get("listen_addr") {
        Some(a) => a.parse().map_err(|_| {
            Error::InvalidParam(format!("{NAME} parameter listen_addr=`{a}` is not IP:PORT"))
        })?,
        None => SocketAddr::new(
            side_channel_ip(&devices[0].gid).ok_or_else(|| {
                Error::InvalidParam(format!(
                    "{NAME}: GID {:?} of {} is no IP address: set listen_addr",
                    devices[0].gid, devices[0].name
                ))
            })?,
            0,
        ),
    };
    let topology = load_topology(params.get("topology_xml").map(String::as_str), &names)?;
    let listener = TcpListener::bind(bind)?;
    let mut listen_addr = listener.local_addr()?;
    if listen_addr.ip().is_unspecified() {
        let ip = side_channel_ip(&devices[0].gid).ok_or_else(|| {
            Error::InvalidParam(format!(
                "{NAME}: listen_addr {bind} is unspecified and the GID is no IP address to advertise"
            ))
        })?;
        listen_addr.set_ip(ip);
    }
    listener.set_nonblocking(true)?;
    let nonce = random_u64();
    let conn_info = encode_conn_info(
        nonce,
        listen_addr,
        &rails
            .iter()
            .map(|r| {
                let d = &devices[r.dev];
                RailInfo {
                    dev: r.dev as u8,
                    gid: d.gid,
                    lid: d.lid,
                    mtu: d.mtu,
                }
            })
            .collect::<Vec<_>>(),
        // Who this process is, for peers on this host to watch it through the OS.
        ProcessId::current().as_ref(),
    );
    let direct_refusal = direct_refusal(staging.vram_mode, &devices);
    // VRAM registers (directly or staged) with GPU support; a peer's VRAM is reachable
    // even without it (the peer stages, or registered it directly).
    let mem_kinds = if cfg!(feature = "cuda") {
        vec![MemKind::Dram, MemKind::Vram]
    } else {
        vec![MemKind::Dram]
    };
    let monitor_wake = WakeFd::new()?;
    let common = Arc::new_cyclic(|common| Common {
        agent_name: init.agent_name.clone(),
        nonce,
        stager: Stager::new(common.clone(), nonce, &rails, &devices, staging.cfg),
        devices,
        rails,
        notifs: NotifTracker::default(),
        outgoing: RwLock::default(),
        incoming: RwLock::default(),
        incoming_qpn: RwLock::default(),
        next_incoming: AtomicU64::new(1),
        closing: Mutex::default(),
        closing_ticket: AtomicU64::new(0),
        closing_len: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        heartbeat,
        monitor_wake,
        own_streams: Arc::default(),
        handshakes: AtomicUsize::new(0),
        refused_hellos: AtomicU64::new(0),
    });
    let backend = VerbsBackend {
        common: common.clone(),
        conn_info,
        listen_addr,
        threads: Mutex::new(Vec::new()),
        striping_threshold,
        next_seq: Arc::new(AtomicU32::new(1)),
        next_rail: AtomicUsize::new(0),
        connect_lock: Mutex::new(()),
        topology,
        mem_kinds,
        staging,
        direct_refusal,
        staged_logged: AtomicBool::new(false),
        progress_thread: init.progress_thread,
    };
    // From here on, `backend`'s Drop stops and joins whatever was started.
    // Without a progress thread, posting and polling transfers (and taking
    // notifications) progress the rails from the caller's thread alone.
    if init.progress_thread {
        for rail in common.rails.iter() {
            let (rail, worker_common) = (rail.clone(), common.clone());
            let handle = std::thread::Builder::new()
                .name(format!("nixl-verbs-rail{}", rail.index))
                .spawn(move || rail_worker(rail, worker_common))?;
            backend.threads.lock().push(handle);
        }
    }
    let monitor_common = common.clone();
    let handle = std::thread::Builder::new()
        .name("nixl-verbs-oob".into())
        .spawn(move || side_channel_thread(listener, monitor_common))?;
    backend.threads.lock().push(handle);
    tracing::debug!(devices = ?names, rails = num_rails, %listen_addr, "VERBS backend up");
    Ok(backend)
}

/// The topology: an hwloc XML export if one is named (parameter, then hwloc's own
/// `HWLOC_XMLFILE`), else what sysfs says about `devices` (nothing on other systems).
fn load_topology(xml: Option<&str>, devices: &[String]) -> Result<Option<Topology>> {
    let from_env = std::env::var("HWLOC_XMLFILE").ok();
    if let Some(path) = xml.or(from_env.as_deref()) {
        return Topology::from_hwloc_xml_file(std::path::Path::new(path))
            .map(Some)
            .map_err(|e| Error::InvalidParam(format!("{NAME} topology_xml `{path}`: {e}")));
    }
    let names: Vec<&str> = devices.iter().map(String::as_str).collect();
    Ok(Topology::from_sysfs(std::path::Path::new("/sys"), &names, &[]).ok())
}

/// The rails to use for memory on NUMA node `node`: those whose device the topology
/// places on that node; every rail when that is none or all of them, or when the node
/// or the topology is unknown.
fn affine_rails(
    topology: Option<&Topology>,
    device_names: &[&str],
    rail_devices: &[usize],
    node: Option<u32>,
) -> Vec<usize> {
    let all: Vec<usize> = (0..rail_devices.len()).collect();
    let (Some(topology), Some(node)) = (topology, node) else {
        return all;
    };
    if topology.nics().is_empty() {
        return all;
    }
    let near = topology.nics_near_numa(node, device_names);
    let rails: Vec<usize> = all
        .iter()
        .copied()
        .filter(|r| near.iter().any(|n| n == device_names[rail_devices[*r]]))
        .collect();
    if rails.is_empty() {
        all
    } else {
        rails
    }
}

impl VerbsBackend {
    /// Opens the backend, for [`crate::Agent::add_backend`] where the caller wants to
    /// keep the concrete type ([`Agent::create_backend`](crate::Agent::create_backend)
    /// does the same by name). `params` as in the module docs.
    pub fn open(init: &BackendInit) -> Result<Self> {
        open(init)
    }

    /// Why VRAM registrations will not be made directly, if they will not (decided at
    /// creation: `vram_mode=staged`, a device that cannot register DMA-BUF memory —
    /// soft-RoCE — or a build without feature `cuda`); `None`: each registration tries.
    pub fn direct_vram_refusal(&self) -> Option<&str> {
        self.direct_refusal.as_deref()
    }

    /// The rails a region of `region` would be bound to (see the module docs).
    pub fn rails_for(&self, region: &Region) -> Vec<usize> {
        let names: Vec<&str> = self
            .common
            .devices
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        let rail_devices: Vec<usize> = self.common.rails.iter().map(|r| r.dev).collect();
        let node = match region.kind {
            MemKind::Dram => numa_node_of(region.desc.addr),
            _ => None,
        };
        affine_rails(self.topology.as_ref(), &names, &rail_devices, node)
    }

    /// HELLOs refused because the loaded peer (or this agent) they named said the
    /// connection was not its own (see `side_channel`).
    pub fn refused_hellos(&self) -> u64 {
        self.common.refused_hellos.load(Ordering::Relaxed)
    }

    /// Where this backend's side channel listens (advertised in its connection info).
    pub fn side_channel_addr(&self) -> SocketAddr {
        self.listen_addr
    }

    /// Number of rails.
    pub fn num_rails(&self) -> usize {
        self.common.rails.len()
    }

    /// Names of the devices in use, in rail order of first use.
    pub fn devices(&self) -> Vec<String> {
        self.common.devices.iter().map(|d| d.name.clone()).collect()
    }

    /// Test hook, not an API: holds rail `rail`'s lock for `hold` on a thread of its own
    /// (as a rail worker descheduled mid-round on a loaded host does); returns once the
    /// lock is held. Panics on an unknown rail.
    #[doc(hidden)]
    pub fn test_hold_rail_lock(&self, rail: usize, hold: Duration) -> JoinHandle<()> {
        let rail = self.common.rails[rail].clone();
        let (held, is_held) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let _state = rail.state.lock();
            let _ = held.send(());
            std::thread::sleep(hold);
        });
        let _ = is_held.recv();
        thread
    }

    /// Test hook, not an API: incoming connections closed and not yet retired by the
    /// rails.
    #[doc(hidden)]
    pub fn test_closing_connections(&self) -> usize {
        self.common.closing_len.load(Ordering::SeqCst)
    }

    fn outgoing(&self, agent: &str) -> Result<Arc<Outgoing>> {
        let conn = self
            .common
            .outgoing
            .read()
            .get(agent)
            .cloned()
            .ok_or_else(|| Error::UnknownAgent(agent.to_string()))?;
        if conn.is_dead() {
            return Err(conn.disconnect_error());
        }
        Ok(conn)
    }
}

/// An RC QP on `rail`; `send_wr` entries for rail jobs, plus the staging engine's.
fn create_qp(dev: &Device, rail: &Rail, send_wr: u32) -> Result<PreparedQueuePair> {
    dev.pd
        .create_qp(QpType::RC, &rail.cq, &rail.cq)
        .srq(&rail.srq)
        .max_send_wr(send_wr + STAGE_SQ as u32)
        .max_send_sge(1)
        .max_recv_sge(1)
        .build()
        .map_err(|e| verbs_error("ibv_create_qp", e))
}

impl Drop for VerbsBackend {
    fn drop(&mut self) {
        self.common.stop.store(true, Ordering::SeqCst);
        self.common.wake_monitor();
        let outgoing: Vec<_> = self.common.outgoing.read().values().cloned().collect();
        for conn in outgoing {
            conn.kill("the local backend shut down");
        }
        for rail in &self.common.rails {
            rail.wake();
        }
        for thread in std::mem::take(self.threads.get_mut()) {
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
        // Connections still closing (without progress threads, no poll came since they
        // closed) are retired here: nothing reads notifications any more.
        let closing = std::mem::take(&mut *self.common.closing.lock());
        self.common.closing_len.store(0, Ordering::SeqCst);
        for c in &closing {
            self.common.unmap_incoming(&c.conn);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Registrations

/// Registrations, one per device, and the rails local to the memory (none of either
/// for a staged region).
#[derive(Debug)]
struct VerbsLocalMd {
    mrs: Vec<Arc<MemoryRegion>>,
    rails: Vec<usize>,
    mode: RegMode,
    staged: Option<StagedReg>,
}

impl LocalMd for VerbsLocalMd {
    /// The rkey on each device (`devices:u8`, then `rkey:u32` each), or for a staged
    /// region `0 | version 1 | slot size u32`: peers send it through the staging
    /// protocol.
    fn public_md(&self) -> Vec<u8> {
        if let Some(staged) = &self.staged {
            return vram::encode_staged_md(staged.slot);
        }
        let mut out = Vec::with_capacity(1 + self.mrs.len() * 4);
        out.push(self.mrs.len() as u8);
        for mr in &self.mrs {
            out.extend_from_slice(&mr.rkey().to_le_bytes());
        }
        out
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn mode(&self) -> Option<&'static str> {
        self.mode.name()
    }
}

/// A peer region's rkey on each of its devices, or (staged) the size of its slots.
#[derive(Debug)]
struct VerbsRemoteMd {
    rkeys: Vec<u32>,
    staged_slot: Option<u64>,
}

impl RemoteMd for VerbsRemoteMd {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Fuzzing entry point (not a stable API): every decoder of what a peer sends `VERBS` —
/// connection information and region metadata (in its metadata), the side channel's
/// handshake, its reply and verification requests, notification messages, staged
/// requesters' names — on `input`.
/// Returns whether whatever decoded encodes back to `input` (decoding itself must never
/// panic).
#[doc(hidden)]
pub fn fuzz_wire_message(input: &[u8]) -> bool {
    let conn_ok = match wire::decode_conn_info(input) {
        Ok(info) => {
            wire::encode_conn_info(info.nonce, info.addr, &info.rails, info.process.as_ref())
                == input
        }
        Err(_) => true,
    };
    let hello_ok = match wire::decode_hello(input) {
        Ok(hello) => wire::encode_hello(&hello) == input,
        Err(_) => true,
    };
    let reply_ok = match wire::decode_reply(input) {
        Ok(reply) => wire::encode_reply(reply.conn, reply.heartbeat_ms, &reply.answers) == input,
        Err(_) => true,
    };
    let notif_ok = match wire::decode_notif(input) {
        Ok((seq, expected, msg)) if msg.len() <= MAX_NOTIF_BYTES => {
            wire::encode_notif(seq, expected, msg).ok().as_deref() == Some(input)
        }
        // Longer than a receive slot: never delivered whole, only decoded without harm.
        Ok(_) | Err(_) => true,
    };
    let md_ok = match decode_remote_md(input) {
        Ok(md) => md.rkeys.len() <= input.len() / 4,
        Err(_) => true,
    };
    let verify_ok = match wire::decode_verify(input) {
        Some((sender, receiver)) => wire::encode_verify(sender, receiver) == input,
        None => true,
    };
    let name_ok = match stage_net::decode_name(input) {
        Some((nonce, rail)) => stage_net::encode_name(nonce, rail) == input,
        None => true,
    };
    conn_ok && hello_ok && reply_ok && notif_ok && md_ok && name_ok && verify_ok
}

fn decode_remote_md(public_md: &[u8]) -> Result<VerbsRemoteMd> {
    let bad = |why: &str| Error::MalformedMetadata(format!("{NAME} region metadata: {why}"));
    let (&count, rest) = public_md.split_first().ok_or_else(|| bad("empty"))?;
    if count == vram::STAGED_MD {
        return Ok(VerbsRemoteMd {
            rkeys: Vec::new(),
            staged_slot: Some(vram::decode_staged_md(rest)?),
        });
    }
    if rest.len() != count as usize * 4 {
        return Err(bad("wrong length"));
    }
    Ok(VerbsRemoteMd {
        rkeys: rest
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
        staged_slot: None,
    })
}

// ---------------------------------------------------------------------------------------
// The Backend implementation

impl Backend for VerbsBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: true,
            notif: true,
        }
    }

    fn supported_mem(&self) -> &[MemKind] {
        &self.mem_kinds
    }

    fn supported_remote_mem(&self) -> &[MemKind] {
        &[MemKind::Dram, MemKind::Vram]
    }

    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        match region.kind {
            MemKind::Dram if self.staging.stage_dram => return self.register_staged(region, None),
            MemKind::Dram => {}
            MemKind::Vram => return self.register_vram(region),
            kind => {
                return Err(Error::UnsupportedMemKind {
                    backend: NAME.into(),
                    kind,
                })
            }
        }
        let len = usize::try_from(region.desc.len)
            .map_err(|_| Error::InvalidParam("region larger than the address space".into()))?;
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let mut mrs = Vec::with_capacity(self.common.devices.len());
        for dev in &self.common.devices {
            // SAFETY: `Agent::register_mem`'s contract keeps the memory valid while the
            // registration (this metadata) and every transfer using it exist, and allows
            // the device and peers to read and write it at any time.
            let mr = unsafe { dev.pd.reg_mr_raw(region.desc.addr as *mut u8, len, access) }
                .map_err(|e| {
                    verbs_error(
                        &format!(
                            "ibv_reg_mr of {:#x}+{} on {}",
                            region.desc.addr, region.desc.len, dev.name
                        ),
                        e,
                    )
                })?;
            mrs.push(Arc::new(mr));
        }
        let rails = self.rails_for(region);
        tracing::debug!(addr = region.desc.addr, ?rails, "VERBS registration");
        Ok(Arc::new(VerbsLocalMd {
            mrs,
            rails,
            mode: RegMode::Plain,
            staged: None,
        }))
    }

    fn connection_info(&self) -> Result<Vec<u8>> {
        Ok(self.conn_info.clone())
    }

    fn load_remote_conn_info(&self, agent: &str, info: &[u8]) -> Result<()> {
        let remote = decode_conn_info(info)?;
        let _serial = self.connect_lock.lock();
        if let Some(old) = self.common.outgoing.read().get(agent) {
            if old.conn_info == info && !old.is_dead() {
                return Ok(());
            }
        }
        let conn = self.connect(agent, info, &remote)?;
        let old = self.common.outgoing.write().insert(agent.to_string(), conn);
        // The side-channel thread watches the new connection's heartbeats from now on.
        self.common.wake_monitor();
        if let Some(old) = old {
            let why = "replaced by a connection from newer metadata";
            old.kill(why);
            self.common.stager.peer_gone(&old, why);
        }
        Ok(())
    }

    fn load_remote_md(
        &self,
        _agent: &str,
        _region: &Region,
        public_md: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        Ok(Arc::new(decode_remote_md(public_md)?))
    }

    fn peer_gone(&self, agent: &str) -> bool {
        self.common
            .outgoing
            .read()
            .get(agent)
            .is_some_and(|c| c.is_dead())
    }

    fn disconnect(&self, agent: &str) {
        let removed = self.common.outgoing.write().remove(agent);
        if let Some(conn) = removed {
            let why = "disconnected: the peer's metadata was invalidated";
            conn.kill(why);
            self.common.stager.peer_gone(&conn, why);
        }
    }

    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        let conn = self.outgoing(agent)?;
        let rails = &self.common.rails;
        let nrails = rails.len();
        let mut rail_ops: Vec<Vec<RailOp>> = vec![Vec::new(); nrails];
        let mut round_robin = self.next_rail.fetch_add(entries.len(), Ordering::Relaxed);
        let mut mrs: Vec<Arc<MemoryRegion>> = Vec::new();
        let mut last_md: Option<*const VerbsLocalMd> = None;
        // Entries with a staged side go through the staging pipeline.
        let mut staged: Vec<usize> = Vec::new();
        for (index, entry) in entries.iter().enumerate() {
            let (local, remote) = entry.metadata::<VerbsLocalMd, VerbsRemoteMd>(NAME)?;
            if last_md != Some(local as *const VerbsLocalMd) {
                // Registrations are shared by many descriptors: keep each alive once.
                mrs.extend(local.mrs.iter().cloned());
                last_md = Some(local as *const VerbsLocalMd);
            }
            if local.staged.is_some() || remote.staged_slot.is_some() {
                staged.push(index);
                continue;
            }
            let len = entry.local.len as usize;
            let mut push = |r: usize, start: usize, piece_len: usize| -> Result<()> {
                let rail = &rails[r];
                let lkey = local.mrs[rail.dev].lkey();
                let rkey = *remote.rkeys.get(conn.remote_dev[r]).ok_or_else(|| {
                    Error::MalformedMetadata(format!(
                        "{NAME}: region of `{agent}` has {} keys, its device {} has none",
                        remote.rkeys.len(),
                        conn.remote_dev[r]
                    ))
                })?;
                let max = self.common.devices[rail.dev].max_msg;
                let mut done = 0;
                while done < piece_len {
                    let n = (piece_len - done).min(max);
                    let at = (start + done) as u64;
                    rail_ops[r].push(RailOp {
                        local: entry.local.addr + at,
                        len: n as u32,
                        lkey,
                        remote: entry.remote.addr + at,
                        rkey,
                    });
                    done += n;
                }
                Ok(())
            };
            // The rails local to this memory (all of them without topology).
            let near = &local.rails;
            if near.len() > 1 && len >= self.striping_threshold {
                let chunk = len.div_ceil(near.len()).next_multiple_of(4096);
                for (i, &r) in near.iter().enumerate() {
                    let start = i * chunk;
                    if start < len {
                        push(r, start, chunk.min(len - start))?;
                    }
                }
            } else {
                round_robin += 1;
                push(near[round_robin % near.len()], 0, len)?;
            }
        }
        let total: usize = rail_ops.iter().map(Vec::len).sum();
        let staged = if staged.is_empty() {
            None
        } else {
            Some(Arc::new(self.plan_staged(op, entries, &staged, &conn)?))
        };
        // Staged chunks (and the requests this side serves) run on any rail.
        let used = (0..nrails)
            .filter(|&r| r == 0 || !rail_ops[r].is_empty() || staged.is_some())
            .collect();
        Ok(Box::new(VerbsXfer {
            staged,
            op,
            rail_ops: rail_ops.into_iter().map(Arc::from).collect(),
            mrs: Arc::from(mrs),
            common: self.common.clone(),
            used,
            conn,
            agent: agent.to_string(),
            next_seq: self.next_seq.clone(),
            total,
            shared: Arc::new(XferShared::default()),
        }))
    }

    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        let conn = self.outgoing(agent)?;
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let message = encode_notif(seq, 0, msg)?;
        let shared = Arc::new(XferShared::default());
        shared.notif_pending.store(true, Ordering::Release);
        self.common.rails[0].submit(RailJob {
            shared: shared.clone(),
            conn: conn.clone(),
            ops: Arc::from(Vec::new()),
            _mrs: Arc::from(Vec::new()),
            op: XferOp::Write,
            imm: None,
            notif: Some(message),
        });
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        while shared.notif_pending.load(Ordering::Acquire) {
            if let Some(failure) = shared.failure() {
                return Err(failure.into_error(agent));
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout(format!(
                    "sending a notification to `{agent}`"
                )));
            }
            self.common.rails[0].progress(&self.common, usize::MAX);
            std::thread::yield_now();
        }
        Ok(())
    }

    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        for rail in &self.common.rails {
            rail.progress(&self.common, usize::MAX);
        }
        self.common.notifs.take(into);
    }

    fn set_notif_waker(&self, waker: NotifWaker) -> bool {
        self.common.notifs.add_waker(waker);
        // The rail workers release notifications (and wake) as their data and messages
        // land; without them nothing arrives until someone calls `take_notifs`.
        self.progress_thread
    }
}
