//! Staging: moving memory that a transport cannot register (VRAM without GPUDirect)
//! through host bounce buffers, pipelined, on both sides of a transfer.
//!
//! Internal to the backends (nothing here is public API): this documents the protocol
//! peers speak and the engine's design. The module is transport-independent: a
//! transport (LIBFABRIC in `libfabric/stage_net.rs`, VERBS in `verbs/stage_net.rs`) implements `StageNet` — post an RMA
//! write/read between a bounce slot and peer memory, send a small control message,
//! resolve a requester's address, count a landed notification unit — and feeds the
//! `Engine` its completions, control messages and fetch data. Device copies go through
//! a `Copier` (CUDA streams and reused events with feature `cuda`; `memcpy` for host
//! memory). A staged request's chunks move independently through their stages (copy,
//! network, request), so copies and network operations of different chunks overlap.
//!
//! Safety of the target's memory: a request may only name ranges inside this side's
//! staged registrations (with no key, unlike RMA to plain memory: anyone who can send
//! this endpoint messages can read and write its staged regions, as anyone with a
//! region's key can for plain memory).
//!
//! Who sent what: every control message and FETCH data arrival comes with its sender as
//! the transport proves it (`StageNet::Sender`: the VERBS connection whose QP it arrived
//! on; for LIBFABRIC, the loaded peer whose pair key sealed the control message (its
//! `notif_mac`: `shm`'s `FI_SOURCE` misattributes a flood)), never as the message names
//! itself. A request's requester (`reply_to`) must be its sender (`StageNet::resolve`),
//! so this side never reads from, writes to or answers another peer on a request's word;
//! an OFFER's notification key counts only toward its sender's notifications
//! (`StageNet::landed`); a DONE counts only from the peer the request went to
//! (`StageNet::is_sender`), so a guessed or observed token can neither end a chunk early
//! (its slot reused while the target still reads it) nor fail it. A FETCH's data is
//! remote CQ data, which LIBFABRIC cannot seal: there a FETCH completes only on the
//! target's FETCHED answer, sealed and sent once every write of it is delivered
//! (`StageNet::fetch_answered`), and a data word, whoever wrote it, only counts down
//! what is still to come; on VERBS the data's QP proves its sender. Refusals are counted
//! and logged sparingly. Where a provider cannot name a sender (LIBFABRIC's remote CQ
//! data on `tcp;ofi_rxm`), the key alone ties a notification's data to its transfer.
//!
//! # Slots
//! One bounce allocation (pinned host memory when a GPU is involved) holds `2 × chunks`
//! slots of `chunk` bytes: the first half for this side's own transfers (the *local*
//! slots), the second half for serving peers (the *serve* slots). The halves never lend
//! to each other, so a side busy initiating can always still serve, and no cycle of
//! waits between two agents can form.
//!
//! # The six cases
//! Each descriptor pair is *plain* (the transport reaches the memory: DRAM, or VRAM
//! registered directly) or *staged* on each side. Pairs are grouped and cut into
//! chunks of at most one slot (pieces of a chunk are contiguous on both sides; small
//! descriptors share a chunk, up to `MAX_PIECES` (128)). Per chunk:
//!
//! | | WRITE | READ |
//! |---|---|---|
//! | local staged, remote plain | copy VRAM→local slot, RMA write slot→peer | RMA read peer→local slot, copy slot→VRAM |
//! | local plain, remote staged | OFFER: the target RMA-reads our memory into a serve slot, copies it to its VRAM, answers DONE | FETCH: the target copies VRAM→serve slot and RMA-writes it into our memory with remote CQ data (LIBFABRIC: then answers FETCHED) |
//! | both staged | copy VRAM→local slot, then OFFER from the slot | FETCH into a local slot, then copy slot→VRAM |
//!
//! The target is the active side for a staged remote region: it pulls a WRITE and pushes
//! a READ, so its serve slots are only ever held for its own operations (a dead
//! initiator cannot strand them). Chunks of one transfer are in flight together, so
//! the device copy of chunk k+1 overlaps the network operation of chunk k on each side.
//!
//! # Notifications
//! A WRITE's notification counts *data units*: each RMA write from a local slot carries
//! the notification key as remote CQ data (counted by the target on arrival), and each
//! OFFER carries the key, which the target counts when that chunk's copy into VRAM has
//! completed. The notification therefore fires only when the last staged byte is in
//! the target's VRAM.
//!
//! # Control messages (`NXST`)
//! `magic "NXST" | version 1 | kind u8 | flags u8 | 0 | token u64 | …`, little-endian.
//! OFFER (1) and FETCH (2): `key u64 | name_len u16 | name | count u16 | count × piece`,
//! piece = `peer_addr u64 | peer_key u64 | target_addr u64 | len u32` (the requester's
//! memory as it is addressed remotely, the target's raw address). DONE (3): `status i32 |
//! reason_len u16 | reason`. FETCHED (4): `pieces u16 | bytes u64`, what the target
//! wrote for a FETCH (only where the transport answers FETCHes). Everything is checked
//! on receipt: lengths, counts, the sum of the pieces against a slot, and every target
//! range against a staged registration. A FETCH's data arrives with remote CQ data
//! `1<<63 | token`, one per piece.

mod copy;
mod serve;
mod wire;

#[cfg(test)]
mod tests;

#[cfg(feature = "cuda")]
pub(crate) use copy::host_copy;
#[cfg(any(not(feature = "cuda"), test))]
pub(crate) use copy::HostCopier;
pub(crate) use copy::{BounceMem, Copier, CopyOp};
// `plan_chunks` serves the network backends only.
#[cfg_attr(
    not(any(feature = "libfabric", feature = "verbs")),
    allow(unused_imports)
)]
pub(crate) use wire::{plan_chunks, Ctrl, Request, SlotPool, WirePiece};

use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default slot size (bytes): large enough that the network runs near its peak with a
/// few in flight, small enough that a 1 MiB block is cut in two pipelined chunks.
pub(crate) const DEFAULT_CHUNK: usize = 512 << 10;
/// Default number of slots per half of the pool.
pub(crate) const DEFAULT_CHUNKS: usize = 16;
/// Most pieces in one chunk (bounds a control message to under 4 KiB).
pub(crate) const MAX_PIECES: usize = 128;
/// Remote CQ data bit marking a staged FETCH's data (notification keys never set it).
pub(crate) const FETCH_DATA: u64 = 1 << 63;
/// Largest control message.
pub(crate) const MAX_CTRL_BYTES: usize = 8192;
/// First bytes of every control message.
pub(crate) const MAGIC: &[u8; 4] = b"NXST";
pub(crate) const VERSION: u8 = 1;
pub(crate) const KIND_OFFER: u8 = 1;
pub(crate) const KIND_FETCH: u8 = 2;
pub(crate) const KIND_DONE: u8 = 3;
/// A served FETCH's answer where the transport asks for one
/// ([`StageNet::fetch_answered`]).
pub(crate) const KIND_FETCHED: u8 = 4;
pub(crate) const FLAG_KEY: u8 = 1;
pub(crate) const MAX_NAME: usize = 1024;
pub(crate) const MAX_REASON: usize = 512;
pub(crate) const PIECE_WIRE: usize = 28;
/// Staging operations in flight on the network at once (they share completion queues
/// with the transport's own operations).
const MAX_NET_OPS: usize = 1024;
/// Ids of operations (and tokens) fit in this many bits: a transport packs them into
/// its operation contexts next to its own bits.
pub(crate) const ID_BITS: u32 = 44;
/// Status of a DONE that reports success.
pub(crate) const STATUS_OK: i32 = 0;
/// DONE status: the request was malformed or named memory that is not staged here.
pub(crate) const STATUS_INVALID: i32 = 22; // EINVAL
/// DONE status: an operation of the target failed.
pub(crate) const STATUS_FAILED: i32 = 5; // EIO

// ---- the transport ----------------------------------------------------------------------

/// Why a transport operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// The peer is gone (its process or connection).
    pub(crate) disconnect: bool,
    /// Transport or DONE status code.
    pub(crate) code: i32,
    pub(crate) text: String,
}

impl Failure {
    pub(crate) fn new(code: i32, text: impl Into<String>) -> Self {
        Self {
            disconnect: false,
            code,
            text: text.into(),
        }
    }
}

/// A post that did not go out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NetError {
    /// Resources are busy; try again after progress.
    Busy,
    Failed(Failure),
}

/// What the pipeline needs from a transport. Operations complete by the transport
/// calling [`Engine::on_complete`] with the `op` id given; memory is addressed by
/// offsets into the bounce memory it registered in [`StageNet::register_bounce`].
pub(crate) trait StageNet {
    /// A peer's address on one rail, kept valid while a clone is held.
    type Addr: Clone + Debug + Send;
    /// Who sent a control message or a FETCH's data, as the transport proves it (the
    /// connection or source address it arrived from), never as the message names itself.
    type Sender: Clone + Debug + Send;
    /// Number of rails (independent endpoints).
    fn rails(&self) -> usize;
    /// Registers the bounce memory, for local operations and for peers' access.
    fn register_bounce(&self, ptr: *mut u8, len: usize) -> std::result::Result<(), Failure>;
    /// How a peer addresses byte `offset` of the bounce memory through `rail`: (address, key).
    fn bounce_remote(&self, rail: usize, offset: u64) -> (u64, u64);
    /// This side's address on `rail`, as requesters send it.
    fn local_name(&self, rail: usize) -> Vec<u8>;
    /// A requester's address from the name it sent, to reach it through `rail`; refused
    /// unless the name is `sender`'s own (a request never steers this side's operations
    /// toward another peer).
    fn resolve(
        &self,
        rail: usize,
        name: &[u8],
        sender: &Self::Sender,
    ) -> std::result::Result<Self::Addr, Failure>;
    /// Whether `sender` is the peer at `addr` (where this side sent a request): a DONE or
    /// a FETCH's data counts only from there.
    fn is_sender(&self, addr: &Self::Addr, sender: &Self::Sender) -> bool;
    /// Whether a FETCH completes only on its target's answer (FETCHED, a control message
    /// the transport proves the sender of) on top of its data. Where remote CQ data does
    /// not prove who wrote it (LIBFABRIC: 64 bits, no seal, `shm` misattributes a flood),
    /// a data word with a guessed or observed token must not end a chunk: the target
    /// answers once every piece it wrote is delivered, and the requester takes the chunk
    /// as fetched only on that answer. Both sides of one transport agree (it is part of
    /// the transport's wire version); the default (VERBS: data arrives on the requester's
    /// own connection) completes on the data alone.
    fn fetch_answered(&self) -> bool {
        false
    }
    /// RMA write of bounce bytes `[offset, offset+len)` to (`addr`, `key`) at `dest`,
    /// with remote CQ data `imm`.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        rail: usize,
        dest: &Self::Addr,
        offset: u64,
        len: usize,
        addr: u64,
        key: u64,
        imm: Option<u64>,
        op: u64,
    ) -> std::result::Result<(), NetError>;
    /// RMA read from (`addr`, `key`) at `src` into bounce bytes `[offset, offset+len)`.
    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        rail: usize,
        src: &Self::Addr,
        offset: u64,
        len: usize,
        addr: u64,
        key: u64,
        op: u64,
    ) -> std::result::Result<(), NetError>;
    /// Sends a control message; `Ok(true)` when a completion for `op` will follow.
    fn send(
        &self,
        rail: usize,
        dest: &Self::Addr,
        msg: &[u8],
        op: u64,
    ) -> std::result::Result<bool, NetError>;
    /// Target side: one data unit of the notified transfer `key`, which `sender` offered,
    /// reached its memory. The transport counts it only toward `sender`'s own
    /// notification: a key is no capability another peer may use.
    /// `false`: refused (the key is not `sender`'s to count).
    fn landed(&self, key: u64, sender: &Self::Sender) -> bool;
}

// ---- transfers (initiator side) ---------------------------------------------------------

/// How one side holds a chunk's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Side {
    /// The transport reaches the memory itself.
    Plain,
    /// Through bounce slots, with copies on GPU `dev` (`None`: host memory).
    Staged(Option<usize>),
}

/// One piece of a planned chunk, with the transport's addressing resolved for the
/// chunk's rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Local raw address (copies, or the start of the range).
    pub(crate) local: u64,
    /// Local memory as the peer addresses it (local plain, remote staged).
    pub(crate) local_net: (u64, u64),
    /// Remote plain: (address, key) as the transport addresses it; remote staged: the
    /// target's raw address and 0.
    pub(crate) remote: (u64, u64),
    pub(crate) len: u64,
    pub(crate) slot_off: u64,
}

/// One chunk of a transfer.
#[derive(Debug, Clone)]
pub(crate) struct Chunk<A> {
    pub(crate) rail: usize,
    pub(crate) dest: A,
    pub(crate) local: Side,
    pub(crate) remote_staged: bool,
    pub(crate) pieces: Vec<Piece>,
}

impl<A> Chunk<A> {
    /// Notification data units this chunk produces on a WRITE: one per RMA write into
    /// plain remote memory, one per chunk a target copies into its memory.
    pub(crate) fn units(&self) -> u64 {
        if self.remote_staged {
            1
        } else {
            self.pieces.len() as u64
        }
    }
}

/// The staged part of a prepared transfer.
#[derive(Debug)]
pub(crate) struct Plan<A> {
    pub(crate) write: bool,
    pub(crate) chunks: Vec<Chunk<A>>,
}

impl<A> Plan<A> {
    /// Bytes of one post that go through the bounce buffers.
    pub(crate) fn staged_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .flat_map(|c| &c.pieces)
            .map(|piece| piece.len)
            .sum()
    }
}

/// Waits, at most 10 s, until no staged copy of a released request touches the caller's
/// memory (`user_copies` reaches 0), calling `progress` between looks: a device copy
/// cannot be recalled, and the caller may free the memory once the request is gone.
pub(crate) fn wait_user_copies(user_copies: &AtomicUsize, mut progress: impl FnMut()) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while user_copies.load(Ordering::Acquire) > 0 {
        if Instant::now() > deadline {
            tracing::warn!("a released staged transfer's copies are still running");
            break;
        }
        progress();
        std::thread::yield_now();
    }
}

/// Where a transfer's progress is reported.
pub(crate) trait RunSink: Send + Debug {
    /// The request was released: start nothing more.
    fn canceled(&self) -> bool;
    /// A chunk moved on (stall detection watches this).
    fn progressed(&self);
    /// Every chunk is done.
    fn finished(&self);
    /// The transfer failed (reported once).
    fn failed(&self, failure: Failure);
    /// Copies touching the caller's memory: started (`true`) or finished (`false`).
    fn user_copy(&self, started: bool);
}

/// One post of a staged transfer.
#[derive(Debug)]
pub(crate) struct RunSpec<A> {
    pub(crate) plan: Arc<Plan<A>>,
    /// Notification key of a notified WRITE.
    pub(crate) key: Option<u64>,
    /// Identifies the peer for [`Engine::peer_gone`].
    pub(crate) peer: u64,
    pub(crate) sink: Box<dyn RunSink>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Device copy into (WRITE) or out of (READ) the local slot.
    Copy { ticket: u64, user: bool },
    /// RMA operations: `next` piece to post, `left` completions awaited.
    Net { next: usize, left: usize },
    /// A request to the target: sent yet, replies (DONE or data pieces) awaited, and
    /// (`answer`) a FETCH's answer awaited ([`StageNet::fetch_answered`]).
    Request {
        sent: bool,
        left: usize,
        answer: bool,
    },
}

#[derive(Debug)]
struct ActiveChunk {
    index: usize,
    slot: Option<u32>,
    stage: Stage,
    token: u64,
    /// Network operations (including sends) not yet completed.
    ops: usize,
    /// Resolved: waits only for its operations before its slot is returned.
    dead: bool,
}

#[derive(Debug)]
struct Run<A> {
    id: u64,
    spec: RunSpec<A>,
    next: usize,
    active: Vec<ActiveChunk>,
    done: usize,
    /// Failed or released: nothing more starts.
    failed: bool,
    /// The outcome (finished or failed) was reported: never report again (the sink's
    /// request may be posted anew while this run's last operations drain).
    reported: bool,
}

// ---- serving (target side) --------------------------------------------------------------

/// A staged region of this side, the only memory requests may name.
#[derive(Debug, Clone, Copy)]
struct StagedRegion {
    id: u64,
    start: u64,
    end: u64,
    dev: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServeStage {
    Queued,
    Net { next: usize, left: usize },
    Copy { ticket: u64 },
}

#[derive(Debug)]
struct Serve<A, S> {
    id: u64,
    offer: bool,
    rail: usize,
    from: A,
    /// Who sent the request, as the transport proved it (its key counts only for them).
    sender: S,
    req: Request,
    dev: Option<usize>,
    slot: Option<u32>,
    stage: ServeStage,
    ops: usize,
    failed: bool,
}

#[derive(Debug, Clone, Copy)]
enum Owner {
    /// `rma`: an RMA operation (else a control message).
    Run {
        run: u64,
        token: u64,
        rma: bool,
    },
    Serve {
        serve: u64,
    },
    Reply,
}

/// Engine parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Config {
    /// Slot size in bytes.
    pub(crate) chunk: usize,
    /// Slots per half.
    pub(crate) chunks: usize,
}

/// The pipeline: local transfers' chunks and peers' requests, their slots, copies and
/// network operations. Driven under one lock by the transport's progress.
#[derive(Debug)]
pub(crate) struct Engine<A, S> {
    cfg: Config,
    copier: Box<dyn Copier>,
    bounce: Option<BounceMem>,
    local_slots: SlotPool,
    serve_slots: SlotPool,
    regions: Vec<StagedRegion>,
    runs: VecDeque<Run<A>>,
    serves: VecDeque<Serve<A, S>>,
    replies: VecDeque<(usize, A, Vec<u8>)>,
    owners: HashMap<u64, Owner>,
    net_ops: usize,
    requests: usize,
    /// Copies started and not yet seen complete.
    copies: usize,
    /// Arrivals refused for who sent them (see [`Engine::refused`]).
    refused: u64,
    /// A post found the transport busy (or the operation cap reached) this round.
    blocked: bool,
    next_id: u64,
}

impl<A: Clone + Debug + Send, S: Clone + Debug + Send> Engine<A, S> {
    pub(crate) fn new(cfg: Config, copier: Box<dyn Copier>) -> Self {
        let n = cfg.chunks as u32;
        Self {
            cfg,
            copier,
            bounce: None,
            local_slots: SlotPool::new(0, n),
            serve_slots: SlotPool::new(n, n),
            regions: Vec::new(),
            runs: VecDeque::new(),
            serves: VecDeque::new(),
            replies: VecDeque::new(),
            owners: HashMap::new(),
            net_ops: 0,
            requests: 0,
            copies: 0,
            refused: 0,
            blocked: false,
            next_id: 1,
        }
    }

    /// A fresh id (operations, tokens, runs, regions): never 0, below 2^[`ID_BITS`],
    /// wrapping long after any earlier id stopped being in use.
    fn id(&mut self) -> u64 {
        self.next_id = (self.next_id + 1) & ((1 << ID_BITS) - 1);
        if self.next_id == 0 {
            self.next_id = 1;
        }
        self.next_id
    }

    /// Control messages and FETCH data refused for who sent them (a DONE or data for a
    /// request this side sent elsewhere, a request naming another requester).
    #[cfg(test)]
    pub(crate) fn refused(&self) -> u64 {
        self.refused
    }

    /// Tokens of the FETCHes sent and not yet completed (what an attacker who observed
    /// the traffic knows): for tests.
    #[cfg(test)]
    pub(crate) fn fetches_in_flight(&self) -> Vec<u64> {
        self.runs
            .iter()
            .filter(|r| !r.spec.plan.write)
            .flat_map(|r| &r.active)
            .filter(|c| matches!(c.stage, Stage::Request { sent: true, .. }))
            .map(|c| c.token)
            .collect()
    }

    /// Counts and logs (the first, then one in 1024) an arrival refused for its sender.
    fn refuse(&mut self, sender: &S, why: std::fmt::Arguments<'_>) {
        self.refused += 1;
        if self.refused % 1024 == 1 {
            tracing::warn!(?sender, refused = self.refused, "staging: dropped: {why}");
        }
    }

    /// Whether anything is queued or in flight.
    #[cfg(test)]
    pub(crate) fn busy(&self) -> bool {
        !self.runs.is_empty() || !self.serves.is_empty() || !self.replies.is_empty()
    }

    /// Whether progress must be polled (copies run, or posts wait for room), as opposed
    /// to waiting for completions and messages, which come through the transport.
    pub(crate) fn needs_poll(&self) -> bool {
        self.copies > 0 || self.blocked || !self.replies.is_empty()
    }

    fn start_copy(&mut self, dev: Option<usize>, copies: &[CopyOp]) -> Result<u64> {
        let ticket = self.copier.start(dev, copies)?;
        self.copies += 1;
        Ok(ticket)
    }

    fn poll_copy(&mut self, ticket: u64) -> Result<bool> {
        let r = self.copier.poll(ticket);
        if !matches!(r, Ok(false)) {
            self.copies -= 1;
        }
        r
    }

    /// Allocates and registers the bounce memory if it is not yet (pinned for GPU `dev`
    /// where possible).
    pub(crate) fn ensure_bounce<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        dev: Option<usize>,
    ) -> Result<()> {
        if self.bounce.is_some() {
            return Ok(());
        }
        let len = self.cfg.chunk * self.cfg.chunks * 2;
        let mem = self.copier.alloc(len, dev)?;
        net.register_bounce(mem.ptr(), mem.len())
            .map_err(|f| Error::Backend {
                backend: "staging".into(),
                code: f.code,
                message: format!("registering the staging pool: {}", f.text),
            })?;
        tracing::debug!(
            bytes = len,
            pinned = mem.pinned(),
            "staging pool allocated and registered"
        );
        self.bounce = Some(mem);
        Ok(())
    }

    /// Adds a staged region of this side (peers' requests may name it); returns its id.
    pub(crate) fn add_region(&mut self, start: u64, len: u64, dev: Option<usize>) -> u64 {
        let id = self.id();
        self.regions.push(StagedRegion {
            id,
            start,
            end: start.saturating_add(len),
            dev,
        });
        id
    }

    pub(crate) fn remove_region(&mut self, id: u64) {
        self.regions.retain(|r| r.id != id);
    }

    fn slot_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.cfg.chunk as u64
    }

    fn slot_ptr(&self, slot: u32, off: u64) -> u64 {
        let base = self.bounce.as_ref().map_or(0, |b| b.ptr() as u64);
        base + self.slot_offset(slot) + off
    }

    /// Queues one post of a staged transfer and starts what it can.
    pub(crate) fn submit<N: StageNet<Addr = A, Sender = S>>(&mut self, net: &N, spec: RunSpec<A>) {
        let id = self.id();
        if spec.plan.chunks.is_empty() {
            spec.sink.finished();
            return;
        }
        self.runs.push_back(Run {
            id,
            spec,
            next: 0,
            active: Vec::new(),
            done: 0,
            failed: false,
            reported: false,
        });
        self.progress(net);
    }

    /// One round: poll copies, retry busy posts, start chunks and requests. Returns
    /// whether work remains.
    pub(crate) fn progress<N: StageNet<Addr = A, Sender = S>>(&mut self, net: &N) -> bool {
        self.blocked = false;
        self.send_replies(net);
        // Again while something waiting could start now (a slot freed by a later entry
        // in the same pass): nothing else may come to call us.
        for _ in 0..8 {
            self.progress_serves(net);
            self.progress_runs(net);
            if !self.startable() {
                break;
            }
        }
        // DONEs queued by this round go out now, not a round later.
        self.send_replies(net);
        self.needs_poll()
    }

    /// Whether a waiting chunk or request could start with what is free now.
    fn startable(&self) -> bool {
        let serve = self.serve_slots.available() > 0
            && self.serves.iter().any(|s| s.stage == ServeStage::Queued);
        let run = self.runs.iter().any(|r| {
            !r.failed
                && r.spec.plan.chunks.get(r.next).is_some_and(|c| {
                    let slot_ok = match c.local {
                        Side::Staged(_) => self.local_slots.available() > 0,
                        Side::Plain => true,
                    };
                    let window_ok = !c.remote_staged || self.requests < 2 * self.cfg.chunks;
                    slot_ok && window_ok
                })
        });
        (serve || run) && !self.blocked
    }

    // ---- initiator ----------------------------------------------------------------------

    fn progress_runs<N: StageNet<Addr = A, Sender = S>>(&mut self, net: &N) {
        let mut i = 0;
        while i < self.runs.len() {
            let mut run = self.runs.remove(i).expect("index in range");
            if !run.failed && run.spec.sink.canceled() {
                // Released: nothing more starts, nothing more touches the caller's
                // memory once the copies running now are done.
                run.failed = true;
                run.reported = true;
                for c in &mut run.active {
                    c.dead = true;
                }
            }
            // Advance what is in flight.
            let mut k = 0;
            while k < run.active.len() {
                self.advance_chunk(net, &mut run, k);
                if run.active[k].dead && run.active[k].ops == 0 && !self.quarantined(&run, k) {
                    let c = run.active.swap_remove(k);
                    self.retire_chunk(&mut run, c);
                } else {
                    k += 1;
                }
            }
            // Start new chunks.
            while !run.failed && run.next < run.spec.plan.chunks.len() {
                if !self.start_chunk(net, &mut run) {
                    break;
                }
            }
            let finished =
                run.active.is_empty() && (run.failed || run.next >= run.spec.plan.chunks.len());
            if !finished {
                self.runs.insert(i, run);
                i += 1;
            }
        }
    }

    /// A chunk whose slot a peer may still write into (a FETCH into a local slot that
    /// was neither answered nor given up with the peer: where the transport answers
    /// FETCHes, its answer, never its data words, ends the wait).
    fn quarantined(&self, run: &Run<A>, k: usize) -> bool {
        let c = &run.active[k];
        matches!(c.stage, Stage::Request { sent: true, left, answer } if left > 0 || answer)
            && c.slot.is_some()
    }

    fn retire_chunk(&mut self, run: &mut Run<A>, c: ActiveChunk) {
        if let Stage::Copy { user: true, .. } = c.stage {
            run.spec.sink.user_copy(false);
        }
        if matches!(c.stage, Stage::Request { .. }) {
            self.requests -= 1;
        }
        if let Some(slot) = c.slot {
            self.local_slots.release(slot);
        }
    }

    fn start_chunk<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        run: &mut Run<A>,
    ) -> bool {
        let plan = run.spec.plan.clone();
        let chunk = &plan.chunks[run.next];
        let needs_slot = matches!(chunk.local, Side::Staged(_));
        if chunk.remote_staged && self.requests >= 2 * self.cfg.chunks {
            return false;
        }
        if needs_slot && (self.bounce.is_none() || self.local_slots.available() == 0) {
            if self.bounce.is_none() {
                run.failed = true;
                run.spec.sink.failed(Failure::new(
                    STATUS_FAILED,
                    "staging: no bounce memory for a staged local region",
                ));
            }
            return false;
        }
        let slot = if needs_slot {
            self.local_slots.acquire()
        } else {
            None
        };
        let token = self.id();
        let mut c = ActiveChunk {
            index: run.next,
            slot,
            stage: Stage::Net { next: 0, left: 0 },
            token,
            ops: 0,
            dead: false,
        };
        run.next += 1;
        let result = match (plan.write, chunk.local) {
            (true, Side::Staged(dev)) => {
                // VRAM → local slot first.
                let s = slot.expect("acquired");
                let copies: Vec<CopyOp> = chunk
                    .pieces
                    .iter()
                    .map(|p| CopyOp {
                        dst: self.slot_ptr(s, p.slot_off),
                        src: p.local,
                        len: p.len as usize,
                    })
                    .collect();
                self.start_copy(dev, &copies).map(|ticket| {
                    run.spec.sink.user_copy(true);
                    c.stage = Stage::Copy { ticket, user: true };
                })
            }
            (false, Side::Staged(_)) if !chunk.remote_staged => {
                c.stage = Stage::Net {
                    next: 0,
                    left: chunk.pieces.len(),
                };
                Ok(())
            }
            _ => {
                // A request to the target (remote staged).
                c.stage = Stage::Request {
                    sent: false,
                    left: if plan.write { 1 } else { chunk.pieces.len() },
                    answer: !plan.write && net.fetch_answered(),
                };
                self.requests += 1;
                Ok(())
            }
        };
        if let Err(e) = result {
            c.dead = true;
            self.fail_run(run, Failure::new(STATUS_FAILED, e.to_string()));
        }
        run.active.push(c);
        let k = run.active.len() - 1;
        self.advance_chunk(net, run, k);
        true
    }

    fn fail_run(&mut self, run: &mut Run<A>, failure: Failure) {
        let gone = failure.disconnect;
        run.failed = true;
        if !run.reported && !run.spec.sink.canceled() {
            run.reported = true;
            run.spec.sink.failed(failure);
        }
        for c in &mut run.active {
            c.dead = true;
            // The connection is gone: nothing can arrive for a request any more, so a
            // slot waiting for a peer's writes is quiet.
            if gone {
                if let Stage::Request { .. } = c.stage {
                    c.stage = Stage::Net { next: 0, left: 0 };
                    self.requests -= 1;
                }
            }
        }
    }

    /// Moves chunk `k` of `run` as far as it can go now.
    fn advance_chunk<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        run: &mut Run<A>,
        k: usize,
    ) {
        let plan = run.spec.plan.clone();
        loop {
            let c = &mut run.active[k];
            let chunk = &plan.chunks[c.index];
            if c.dead {
                // Copies still run into or out of the slot: wait for them.
                if let Stage::Copy { ticket, user } = c.stage {
                    match self.poll_copy(ticket) {
                        Ok(false) => return,
                        Ok(true) | Err(_) => {
                            if user {
                                run.spec.sink.user_copy(false);
                            }
                            c.stage = Stage::Net { next: 0, left: 0 };
                        }
                    }
                }
                return;
            }
            match c.stage {
                Stage::Copy { ticket, user } => match self.poll_copy(ticket) {
                    Ok(false) => return,
                    Ok(true) => {
                        if user {
                            run.spec.sink.user_copy(false);
                        }
                        run.spec.sink.progressed();
                        if plan.write {
                            c.stage = if chunk.remote_staged {
                                self.requests += 1;
                                Stage::Request {
                                    sent: false,
                                    left: 1,
                                    answer: false,
                                }
                            } else {
                                Stage::Net {
                                    next: 0,
                                    left: chunk.pieces.len(),
                                }
                            };
                        } else {
                            // READ: the copy out of the slot was the last step.
                            self.chunk_done(run, k);
                            return;
                        }
                    }
                    Err(e) => {
                        if user {
                            run.spec.sink.user_copy(false);
                        }
                        c.stage = Stage::Net { next: 0, left: 0 };
                        self.fail_run(run, Failure::new(STATUS_FAILED, e.to_string()));
                        return;
                    }
                },
                Stage::Net { next, left } => {
                    if next < chunk.pieces.len() {
                        let posted = self.post_pieces(net, run, k);
                        if posted.is_err() {
                            return;
                        }
                        continue;
                    }
                    if left > 0 {
                        return;
                    }
                    run.spec.sink.progressed();
                    if !plan.write {
                        // READ into the local slot landed: copy it out.
                        if let Side::Staged(dev) = chunk.local {
                            self.start_copy_out(run, k, dev);
                            continue;
                        }
                    }
                    self.chunk_done(run, k);
                    return;
                }
                Stage::Request { sent, left, answer } => {
                    if !sent {
                        match self.send_request(net, run, k) {
                            Ok(()) => continue,
                            Err(()) => return,
                        }
                    }
                    if left > 0 || answer {
                        return;
                    }
                    self.requests -= 1;
                    run.spec.sink.progressed();
                    let c = &mut run.active[k];
                    c.stage = Stage::Net { next: 0, left: 0 };
                    if !plan.write {
                        if let Side::Staged(dev) = chunk.local {
                            self.start_copy_out(run, k, dev);
                            continue;
                        }
                    }
                    self.chunk_done(run, k);
                    return;
                }
            }
        }
    }

    fn start_copy_out(&mut self, run: &mut Run<A>, k: usize, dev: Option<usize>) {
        let plan = run.spec.plan.clone();
        let c = &run.active[k];
        let chunk = &plan.chunks[c.index];
        let s = c.slot.expect("staged chunk has a slot");
        let copies: Vec<CopyOp> = chunk
            .pieces
            .iter()
            .map(|p| CopyOp {
                dst: p.local,
                src: self.slot_ptr(s, p.slot_off),
                len: p.len as usize,
            })
            .collect();
        match self.start_copy(dev, &copies) {
            Ok(ticket) => {
                run.spec.sink.user_copy(true);
                run.active[k].stage = Stage::Copy { ticket, user: true };
            }
            Err(e) => {
                run.active[k].stage = Stage::Net { next: 0, left: 0 };
                self.fail_run(run, Failure::new(STATUS_FAILED, e.to_string()));
            }
        }
    }

    fn chunk_done(&mut self, run: &mut Run<A>, k: usize) {
        let c = &mut run.active[k];
        c.dead = true;
        c.stage = Stage::Net { next: 0, left: 0 };
        run.done += 1;
        if run.done == run.spec.plan.chunks.len() && !run.failed && !run.reported {
            run.reported = true;
            run.spec.sink.finished();
        }
    }

    /// Posts the RMA operations of chunk `k` (local slot ↔ plain remote memory).
    fn post_pieces<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        run: &mut Run<A>,
        k: usize,
    ) -> std::result::Result<(), ()> {
        let plan = run.spec.plan.clone();
        let (index, slot, token) = {
            let c = &run.active[k];
            (c.index, c.slot.expect("staged chunk has a slot"), c.token)
        };
        let chunk = &plan.chunks[index];
        let imm = if plan.write { run.spec.key } else { None };
        loop {
            let Stage::Net { next, left } = run.active[k].stage else {
                return Ok(());
            };
            if next >= chunk.pieces.len() {
                return Ok(());
            }
            if self.net_ops >= MAX_NET_OPS {
                self.blocked = true;
                return Err(());
            }
            let p = chunk.pieces[next];
            let op = self.id();
            let offset = self.slot_offset(slot) + p.slot_off;
            let posted = if plan.write {
                net.write(
                    chunk.rail,
                    &chunk.dest,
                    offset,
                    p.len as usize,
                    p.remote.0,
                    p.remote.1,
                    imm,
                    op,
                )
            } else {
                net.read(
                    chunk.rail,
                    &chunk.dest,
                    offset,
                    p.len as usize,
                    p.remote.0,
                    p.remote.1,
                    op,
                )
            };
            match posted {
                Ok(()) => {
                    self.owners.insert(
                        op,
                        Owner::Run {
                            run: run.id,
                            token,
                            rma: true,
                        },
                    );
                    self.net_ops += 1;
                    let c = &mut run.active[k];
                    c.ops += 1;
                    c.stage = Stage::Net {
                        next: next + 1,
                        left,
                    };
                }
                Err(NetError::Busy) => {
                    self.blocked = true;
                    return Err(());
                }
                Err(NetError::Failed(f)) => {
                    // Nothing more of this chunk goes out; what went out completes.
                    let c = &mut run.active[k];
                    c.stage = Stage::Net { next: 0, left: 0 };
                    self.fail_run(run, f);
                    return Err(());
                }
            }
        }
    }

    fn send_request<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        run: &mut Run<A>,
        k: usize,
    ) -> std::result::Result<(), ()> {
        let plan = run.spec.plan.clone();
        let (index, slot, token) = {
            let c = &run.active[k];
            (c.index, c.slot, c.token)
        };
        let chunk = &plan.chunks[index];
        let pieces = chunk
            .pieces
            .iter()
            .map(|p| {
                let (peer_addr, peer_key) = match slot {
                    Some(s) => net.bounce_remote(chunk.rail, self.slot_offset(s) + p.slot_off),
                    None => p.local_net,
                };
                WirePiece {
                    peer_addr,
                    peer_key,
                    target: p.remote.0,
                    len: p.len as u32,
                }
            })
            .collect();
        let req = Request {
            token,
            key: if plan.write { run.spec.key } else { None },
            reply_to: net.local_name(chunk.rail),
            pieces,
        };
        let msg = if plan.write {
            Ctrl::Offer(req)
        } else {
            Ctrl::Fetch(req)
        };
        let bytes = match msg.encode() {
            Ok(b) => b,
            Err(e) => {
                run.active[k].stage = Stage::Net { next: 0, left: 0 };
                self.requests -= 1;
                self.fail_run(run, Failure::new(STATUS_INVALID, e.to_string()));
                return Err(());
            }
        };
        let op = self.id();
        match net.send(chunk.rail, &chunk.dest, &bytes, op) {
            Ok(completes) => {
                if completes {
                    self.owners.insert(
                        op,
                        Owner::Run {
                            run: run.id,
                            token,
                            rma: false,
                        },
                    );
                    run.active[k].ops += 1;
                }
                if let Stage::Request { left, answer, .. } = run.active[k].stage {
                    run.active[k].stage = Stage::Request {
                        sent: true,
                        left,
                        answer,
                    };
                }
                Ok(())
            }
            Err(NetError::Busy) => {
                self.blocked = true;
                Err(())
            }
            Err(NetError::Failed(f)) => {
                run.active[k].stage = Stage::Net { next: 0, left: 0 };
                self.requests -= 1;
                self.fail_run(run, f);
                Err(())
            }
        }
    }

    /// Finds the run and chunk of a token.
    fn find(&mut self, run_id: u64, token: u64) -> Option<(usize, usize)> {
        let ri = self.runs.iter().position(|r| r.id == run_id)?;
        let ci = self.runs[ri].active.iter().position(|c| c.token == token)?;
        Some((ri, ci))
    }

    fn find_token(&self, token: u64) -> Option<(usize, usize)> {
        self.runs.iter().enumerate().find_map(|(ri, r)| {
            r.active
                .iter()
                .position(|c| c.token == token)
                .map(|ci| (ri, ci))
        })
    }

    /// A network operation completed (or failed).
    pub(crate) fn on_complete<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        op: u64,
        result: std::result::Result<(), Failure>,
    ) {
        let Some(owner) = self.owners.remove(&op) else {
            tracing::debug!(op, "staging: completion of an unknown operation");
            return;
        };
        match owner {
            Owner::Reply => {
                if let Err(f) = result {
                    tracing::debug!(error = %f.text, "staging: a DONE reply failed");
                }
            }
            Owner::Run { run, token, rma } => {
                if rma {
                    self.net_ops -= 1;
                }
                let Some((ri, ci)) = self.find(run, token) else {
                    return;
                };
                let mut r = self.runs.remove(ri).expect("found");
                let c = &mut r.active[ci];
                c.ops -= 1;
                if rma {
                    if let Stage::Net { next, left } = c.stage {
                        c.stage = Stage::Net {
                            next,
                            left: left.saturating_sub(1),
                        };
                    }
                }
                if let Err(f) = result {
                    if let (false, Stage::Request { .. }) = (rma, c.stage) {
                        // The request never arrived: nothing will come back for it.
                        c.stage = Stage::Net { next: 0, left: 0 };
                        self.requests -= 1;
                    }
                    self.fail_run(&mut r, f);
                } else if !r.active[ci].dead {
                    self.advance_chunk(net, &mut r, ci);
                }
                self.runs.insert(ri, r);
            }
            Owner::Serve { serve } => {
                let Some(si) = self.serves.iter().position(|s| s.id == serve) else {
                    return;
                };
                let s = &mut self.serves[si];
                s.ops -= 1;
                self.net_ops -= 1;
                if let ServeStage::Net { next, left } = s.stage {
                    s.stage = ServeStage::Net {
                        next,
                        left: left.saturating_sub(1),
                    };
                }
                if let Err(f) = result {
                    tracing::debug!(error = %f.text, "staging: serving a peer's request failed");
                    s.failed = true;
                }
            }
        }
        self.progress(net);
    }

    /// Whether the request of chunk `ci` of run `ri` went to `sender` (its DONE and
    /// data may come only from there).
    fn sent_to<N: StageNet<Addr = A, Sender = S>>(
        &self,
        net: &N,
        ri: usize,
        ci: usize,
        sender: &S,
    ) -> bool {
        let run = &self.runs[ri];
        let chunk = &run.spec.plan.chunks[run.active[ci].index];
        net.is_sender(&chunk.dest, sender)
    }

    /// A piece of a FETCH's data arrived (remote CQ data [`FETCH_DATA`]` | token`) from
    /// `sender`.
    ///
    /// Where the transport answers FETCHes ([`StageNet::fetch_answered`]) a data word
    /// only counts down what is still to arrive; the chunk waits for the target's proven
    /// answer as well, so a forged word (which no transport check can tell from the
    /// target's there) ends nothing and frees no slot. Its sender is not checked then:
    /// the provider's attribution proves nothing, and refusing a misattributed genuine
    /// word would stall the chunk.
    pub(crate) fn on_fetch_data<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        token: u64,
        sender: &S,
    ) {
        let Some((ri, ci)) = self.find_token(token) else {
            tracing::debug!(token, "staging: data for an unknown request");
            return;
        };
        if !net.fetch_answered() && !self.sent_to(net, ri, ci, sender) {
            return self.refuse(
                sender,
                format_args!("FETCH data for token {token} from a peer the FETCH did not go to"),
            );
        }
        let mut r = self.runs.remove(ri).expect("found");
        if let (false, Stage::Request { sent, left, answer }) =
            (r.spec.plan.write, r.active[ci].stage)
        {
            let left = left.saturating_sub(1);
            r.active[ci].stage = Stage::Request { sent, left, answer };
            if !r.active[ci].dead {
                self.advance_chunk(net, &mut r, ci);
            } else if left == 0 && !answer {
                // A given-up FETCH into a slot: the slot is quiet now.
                r.active[ci].stage = Stage::Net { next: 0, left: 0 };
                self.requests -= 1;
            }
        }
        self.runs.insert(ri, r);
        self.progress(net);
    }

    /// A control message arrived on `rail`.
    pub(crate) fn on_message<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        rail: usize,
        sender: &S,
        bytes: &[u8],
    ) {
        let msg = match Ctrl::decode(bytes) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "staging: malformed control message dropped");
                return;
            }
        };
        match msg {
            Ctrl::Done {
                token,
                status,
                reason,
            } => self.on_done(net, sender, token, status, reason),
            Ctrl::Fetched {
                token,
                pieces,
                bytes,
            } => self.on_fetched(net, sender, token, pieces, bytes),
            Ctrl::Offer(req) => self.on_request(net, rail, sender, true, req),
            Ctrl::Fetch(req) => self.on_request(net, rail, sender, false, req),
        }
        self.progress(net);
    }

    fn on_done<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        sender: &S,
        token: u64,
        status: i32,
        reason: String,
    ) {
        let Some((ri, ci)) = self.find_token(token) else {
            tracing::debug!(token, "staging: DONE for an unknown request");
            return;
        };
        // Only the target the request went to ends it: a DONE from anyone else would let
        // the slot go while the target may still read it (a WRITE), or fail the run.
        if !self.sent_to(net, ri, ci, sender) {
            return self.refuse(
                sender,
                format_args!("a DONE for token {token} from a peer the request did not go to"),
            );
        }
        let mut r = self.runs.remove(ri).expect("found");
        if let Stage::Request { sent, .. } = r.active[ci].stage {
            if status == STATUS_OK && r.spec.plan.write {
                r.active[ci].stage = Stage::Request {
                    sent,
                    left: 0,
                    answer: false,
                };
                if !r.active[ci].dead {
                    self.advance_chunk(net, &mut r, ci);
                } else {
                    r.active[ci].stage = Stage::Net { next: 0, left: 0 };
                    self.requests -= 1;
                }
            } else {
                // A refusal (a FETCH succeeds through its data, never a DONE): nothing
                // more comes for this request.
                r.active[ci].stage = Stage::Net { next: 0, left: 0 };
                self.requests -= 1;
                let status = if status == STATUS_OK {
                    STATUS_FAILED
                } else {
                    status
                };
                self.fail_run(
                    &mut r,
                    Failure::new(
                        status,
                        format!("the target refused a staged chunk: {reason}"),
                    ),
                );
            }
        }
        self.runs.insert(ri, r);
    }

    /// The target's answer to a FETCH ([`StageNet::fetch_answered`]): every piece it
    /// wrote for `token` is delivered. Taken only from the peer the FETCH went to (the
    /// transport proves it: LIBFABRIC's seal), and only with the piece and byte counts
    /// the FETCH asked for.
    fn on_fetched<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        sender: &S,
        token: u64,
        pieces: u16,
        bytes: u64,
    ) {
        let Some((ri, ci)) = self.find_token(token) else {
            tracing::debug!(token, "staging: FETCHED for an unknown request");
            return;
        };
        if !self.sent_to(net, ri, ci, sender) {
            return self.refuse(
                sender,
                format_args!("a FETCHED for token {token} from a peer the FETCH did not go to"),
            );
        }
        let mut r = self.runs.remove(ri).expect("found");
        let plan = r.spec.plan.clone();
        let chunk = &plan.chunks[r.active[ci].index];
        match r.active[ci].stage {
            Stage::Request {
                sent,
                left,
                answer: true,
            } if !plan.write => {
                let want_bytes: u64 = chunk.pieces.iter().map(|p| p.len).sum();
                if usize::from(pieces) != chunk.pieces.len() || bytes != want_bytes {
                    // The target's writes are over (it answers after them): the slot
                    // is quiet, and the chunk is not what was asked for.
                    r.active[ci].stage = Stage::Net { next: 0, left: 0 };
                    self.requests -= 1;
                    self.fail_run(
                        &mut r,
                        Failure::new(
                            STATUS_FAILED,
                            format!(
                                "the target answered a FETCH of {} pieces ({want_bytes} \
                                 bytes) with {pieces} pieces ({bytes} bytes)",
                                chunk.pieces.len()
                            ),
                        ),
                    );
                } else if r.active[ci].dead {
                    // A given-up FETCH into a slot: the target's writes are delivered,
                    // the slot is quiet now.
                    r.active[ci].stage = Stage::Net { next: 0, left: 0 };
                    self.requests -= 1;
                } else {
                    r.active[ci].stage = Stage::Request {
                        sent,
                        left,
                        answer: false,
                    };
                    self.advance_chunk(net, &mut r, ci);
                }
            }
            _ => tracing::debug!(token, "staging: FETCHED for a chunk that awaits none"),
        }
        self.runs.insert(ri, r);
    }

    /// The peer `peer` is gone (disconnected or replaced): its transfers fail and slots
    /// that only it could still write into are returned.
    pub(crate) fn peer_gone<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        peer: u64,
        why: &str,
    ) {
        for i in 0..self.runs.len() {
            if self.runs[i].spec.peer != peer {
                continue;
            }
            let mut r = self.runs.remove(i).expect("index in range");
            for c in &mut r.active {
                if let Stage::Request { .. } = c.stage {
                    c.stage = Stage::Net { next: 0, left: 0 };
                    self.requests -= 1;
                }
            }
            self.fail_run(
                &mut r,
                Failure {
                    disconnect: true,
                    code: 0,
                    text: why.to_string(),
                },
            );
            self.runs.insert(i, r);
        }
        self.progress(net);
    }

    /// Slots in use: (local, serve) — for tests and reporting.
    #[cfg(test)]
    pub(crate) fn slots_in_use(&self) -> (usize, usize) {
        (
            self.local_slots.capacity() - self.local_slots.available(),
            self.serve_slots.capacity() - self.serve_slots.available(),
        )
    }
}

/// Fuzzing entry point (not a stable API): the control-message decoder on `input` (what
/// any peer may send to a staging rail). Returns whether whatever decoded re-encodes and
/// decodes back to the same message (decoding itself must never panic).
#[doc(hidden)]
pub fn fuzz_ctrl_message(input: &[u8]) -> bool {
    let Ok(msg) = Ctrl::decode(input) else {
        return true;
    };
    if input.len() > MAX_CTRL_BYTES + 64 {
        // Nothing larger than a control buffer ever reaches the decoder; what it accepts
        // is bounded by its own limits (names, pieces, reasons), far below this.
        return false;
    }
    let Ok(again) = msg.encode() else {
        return false;
    };
    match (Ctrl::decode(&again), &msg) {
        // A non-UTF-8 reason decodes lossily: only its token and status must survive.
        (
            Ok(Ctrl::Done { token, status, .. }),
            Ctrl::Done {
                token: t0,
                status: s0,
                ..
            },
        ) => token == *t0 && status == *s0,
        (Ok(decoded), _) => decoded == msg,
        (Err(_), _) => false,
    }
}

impl<A, S> Drop for Engine<A, S> {
    fn drop(&mut self) {
        if !self.owners.is_empty() {
            // The transport may still touch the bounce memory: keep it allocated.
            tracing::debug!(
                ops = self.owners.len(),
                "staging pool kept: operations still in flight at shutdown"
            );
            if let Some(mem) = self.bounce.take() {
                std::mem::forget(mem);
            }
        }
    }
}
