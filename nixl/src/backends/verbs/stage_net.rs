//! VERBS's side of the staging pipeline ([`crate::backends::staging`]): RDMA WRITE (with
//! immediate), RDMA READ and SEND of control messages on the backend's own RC QPs,
//! completions and receives delivered by the rail workers.
//!
//! # Who posts where
//! The initiator's chunks go on the QPs it opened to the target (one per local rail).
//! The target serves a request on the QP pair the request came through — its end of the
//! pair the requester opened — so it needs no connection of its own to the requester
//! (which one-sided use never makes) and the requester's keys (taken on that rail's
//! device) are the ones that QP reaches. A requester names itself by its incarnation
//! number and rail (`nonce:u64 rail:u8`); the target finds the newest incoming
//! connection of that incarnation.
//!
//! # Immediate data: 64-bit keys in 32 bits
//! The engine's remote CQ data is 64 bits — a notification key, or
//! [`FETCH_DATA`](staging::FETCH_DATA)` | token` on a FETCH's data — where an RDMA
//! WRITE's immediate has 32. The direction of the QP pair tells the two apart, so no
//! bit is spent on it:
//! - on a pair the *initiator* opened, written from its side (plain writes and staged
//!   writes from its slots): a notification's sequence number. The key is `target's
//!   connection id << 32 | sequence` (the id comes with the handshake's reply), so the
//!   low 32 bits are the sequence, and the target reads the id from the QP the write
//!   arrived on — the tracker key `(connection, sequence)` either way;
//! - written from the *target's* side of a pair (FETCH data, the only thing a target
//!   writes): the low 32 bits of the token. The requester recorded every token it sent
//!   in a FETCH, by its low 32 bits, and maps the immediate back. Tokens are engine ids
//!   (44 bits) that grow by one per id handed out, so two FETCHes in the table share low
//!   bits only 2^32 ids apart; the table keeps the newest [`FETCH_TABLE`] tokens (far more
//!   than the `2 × staging_chunks` requests in flight), and data for a token it no longer
//!   holds is dropped, never credited to another request.
//!
//! # Resources
//! Every QP has [`STAGE_SQ`] send-queue entries beyond the rail jobs' window, and a
//! rail keeps at most that many staging operations in flight (busy beyond it), so
//! neither a send queue nor a completion queue can overflow. Control messages go from
//! [`CTRL_SLOTS`] registered buffers; a sent message's slot (and the QP it went on) is
//! held until its completion.

use super::xfer::{Failure as XferFailure, XferShared};
use super::{Common, Device, Incoming, Outgoing, Rail, STAGE_SQ, STAGE_WR};
use crate::backends::staging::{
    self, BounceMem, Engine, Failure, NetError, RunSink, RunSpec, StageNet,
};
use ibverbs::{AccessFlags, MemoryRegion, QueuePair, RemoteMemory, SendWr, Sge};
use parking_lot::{Mutex, MutexGuard};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

/// Control-message send buffers (each [`staging::MAX_CTRL_BYTES`]).
pub(super) const CTRL_SLOTS: usize = 64;
/// FETCH tokens a requester remembers (see the module docs).
const FETCH_TABLE: usize = 16384;
/// Bits of a staging wr_id below the control slot: the engine's operation id.
const OP_BITS: u32 = staging::ID_BITS;
/// Length of a requester's name: incarnation number and rail.
const NAME_LEN: usize = 9;

/// A peer's end of one QP pair, kept alive (with its connection) while held.
#[derive(Debug, Clone)]
pub(super) enum VerbsAddr {
    /// The QP of local rail `.1` of a connection this side opened (initiator side).
    Out(Arc<Outgoing>, usize),
    /// QP `.1` of a connection a requester opened to this side (target side).
    In(Arc<Incoming>, usize),
}

impl VerbsAddr {
    /// The local QP and the rail it lives on.
    fn qp(&self) -> (&QueuePair, usize) {
        match self {
            VerbsAddr::Out(conn, rail) => (&conn.qps[*rail], *rail),
            VerbsAddr::In(conn, i) => (&conn.qps[*i].1, conn.qps[*i].0),
        }
    }

    fn dead(&self) -> Option<Failure> {
        match self {
            VerbsAddr::Out(conn, _) => conn.dead_reason().map(|reason| Failure {
                disconnect: true,
                code: 0,
                text: reason,
            }),
            VerbsAddr::In(..) => None,
        }
    }
}

/// Who sent a staging message or a FETCH's data: the connection whose QP it arrived on
/// (never the name or key it carries).
#[derive(Debug, Clone)]
pub(super) enum VerbsSender {
    /// The peer of a connection this side opened: its answers (DONE, FETCH data).
    Out(Arc<Outgoing>),
    /// A requester's connection to this side: its requests (OFFER, FETCH).
    In(Arc<Incoming>),
}

/// The low 32 bits of the engine's remote CQ data: what a write's immediate carries
/// (see the module docs for how the receiver restores the rest).
pub(super) fn imm32(data: u64) -> u32 {
    data as u32
}

/// A notification key of a staged WRITE: the target's id of the connection and the
/// post's sequence number.
pub(super) fn notif_key(remote_conn: u64, seq: u32) -> u64 {
    (remote_conn << 32) | u64::from(seq)
}

/// The tracker key `(connection, sequence)` of a notification key.
pub(super) fn tracker_key(key: u64) -> (u64, u32) {
    (key >> 32, key as u32)
}

/// A requester's name: its incarnation number and the rail it sent from.
pub(super) fn encode_name(nonce: u64, rail: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(NAME_LEN);
    out.extend_from_slice(&nonce.to_le_bytes());
    out.push(rail as u8);
    out
}

pub(super) fn decode_name(name: &[u8]) -> Option<(u64, usize)> {
    let bytes: &[u8; NAME_LEN] = name.try_into().ok()?;
    let nonce = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    Some((nonce, usize::from(bytes[8])))
}

/// The tokens of FETCHes sent, by their low 32 bits, newest [`FETCH_TABLE`] kept.
#[derive(Debug, Default)]
pub(super) struct FetchTokens {
    by_imm: HashMap<u32, u64>,
    order: VecDeque<u32>,
}

impl FetchTokens {
    pub(super) fn insert(&mut self, token: u64) {
        let imm = imm32(token);
        if self.by_imm.insert(imm, token).is_none() {
            self.order.push_back(imm);
        }
        while self.order.len() > FETCH_TABLE {
            if let Some(old) = self.order.pop_front() {
                self.by_imm.remove(&old);
            }
        }
    }

    pub(super) fn lookup(&self, imm: u32) -> Option<u64> {
        self.by_imm.get(&imm).copied()
    }
}

/// The FETCH token of a control message about to be sent, if it is a FETCH (header:
/// magic, version, kind, flags, 0, token u64).
pub(super) fn fetch_token(msg: &[u8]) -> Option<u64> {
    if msg.len() < 16 || !msg.starts_with(staging::MAGIC) || msg[5] != staging::KIND_FETCH {
        return None;
    }
    Some(u64::from_le_bytes(msg[8..16].try_into().expect("8 bytes")))
}

/// The bounce pool's registrations, one per device (the memory belongs to the engine,
/// which is dropped after these).
#[derive(Debug)]
struct Bounce {
    base: u64,
    len: usize,
    mrs: Vec<MemoryRegion>,
}

/// Buffers control messages are sent from, registered on every device.
#[derive(Debug)]
struct CtrlArea {
    // Declared first: the registrations close before the memory goes.
    mrs: Vec<MemoryRegion>,
    mem: BounceMem,
    free: Mutex<Vec<u16>>,
    /// The QP each slot's message went on, held until its completion.
    held: Mutex<Vec<Option<VerbsAddr>>>,
}

/// The transport for the engine.
#[derive(Debug)]
pub(super) struct VerbsNet {
    common: Weak<Common>,
    nonce: u64,
    rails: Vec<Arc<Rail>>,
    devices: Vec<Arc<Device>>,
    bounce: OnceLock<Bounce>,
    ctrl: OnceLock<std::result::Result<CtrlArea, Failure>>,
    /// Staging operations in flight per rail (at most [`STAGE_SQ`]).
    in_flight: Vec<AtomicUsize>,
    fetches: Mutex<FetchTokens>,
}

/// A failed verbs call or completion, as the engine takes it.
pub(super) fn failure_of(e: &ibverbs::Error) -> Failure {
    Failure {
        disconnect: matches!(e, ibverbs::Error::RemoteDisconnect { .. }),
        code: e.errno().unwrap_or(0),
        text: e.to_string(),
    }
}

fn net_error(e: ibverbs::Error) -> NetError {
    match e {
        ibverbs::Error::QueueFull { .. } | ibverbs::Error::WouldBlock { .. } => NetError::Busy,
        other => NetError::Failed(failure_of(&other)),
    }
}

impl VerbsNet {
    fn ctrl(&self) -> std::result::Result<&CtrlArea, NetError> {
        self.ctrl
            .get_or_init(|| {
                let len = CTRL_SLOTS * staging::MAX_CTRL_BYTES;
                let mem = BounceMem::heap(len).map_err(|e| Failure::new(12, e.to_string()))?;
                let mut mrs = Vec::with_capacity(self.devices.len());
                for dev in &self.devices {
                    // SAFETY: `mem` is owned by the area next to the registrations, which
                    // are dropped first; only the device reads it (SENDs).
                    let mr = unsafe { dev.pd.reg_mr_raw(mem.ptr(), len, AccessFlags::empty()) }
                        .map_err(|e| failure_of(&e))?;
                    mrs.push(mr);
                }
                Ok(CtrlArea {
                    mrs,
                    mem,
                    free: Mutex::new((0..CTRL_SLOTS as u16).rev().collect()),
                    held: Mutex::new(vec![None; CTRL_SLOTS]),
                })
            })
            .as_ref()
            .map_err(|f| NetError::Failed(f.clone()))
    }

    fn bounce(&self, offset: u64, len: usize) -> std::result::Result<&Bounce, NetError> {
        let b = self
            .bounce
            .get()
            .ok_or_else(|| NetError::Failed(Failure::new(22, "no staging pool")))?;
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > b.len as u64)
        {
            return Err(NetError::Failed(Failure::new(
                22,
                format!("{len} bytes at {offset} outside the staging pool"),
            )));
        }
        Ok(b)
    }

    /// Takes one of `rail`'s staging send-queue entries.
    fn reserve(&self, rail: usize) -> std::result::Result<(), NetError> {
        if self.in_flight[rail].fetch_add(1, Ordering::AcqRel) >= STAGE_SQ {
            self.in_flight[rail].fetch_sub(1, Ordering::AcqRel);
            return Err(NetError::Busy);
        }
        Ok(())
    }

    fn unreserve(&self, rail: usize) {
        self.in_flight[rail].fetch_sub(1, Ordering::AcqRel);
    }

    /// Posts one work request on `dest`'s QP within the rail's staging window.
    fn post(
        &self,
        dest: &VerbsAddr,
        wr: impl FnOnce(usize) -> std::result::Result<(), ibverbs::Error>,
    ) -> std::result::Result<(), NetError> {
        if let Some(f) = dest.dead() {
            return Err(NetError::Failed(f));
        }
        let (_, rail) = dest.qp();
        self.reserve(rail)?;
        wr(rail).map_err(|e| {
            self.unreserve(rail);
            net_error(e)
        })
    }

    fn remote(addr: u64, len: usize, key: u64) -> std::result::Result<RemoteMemory, NetError> {
        let rkey = u32::try_from(key)
            .map_err(|_| NetError::Failed(Failure::new(22, format!("remote key {key:#x}"))))?;
        Ok(RemoteMemory {
            addr,
            len: len as u64,
            rkey,
        })
    }
}

impl StageNet for VerbsNet {
    type Addr = VerbsAddr;
    type Sender = VerbsSender;

    fn rails(&self) -> usize {
        self.rails.len()
    }

    fn register_bounce(&self, ptr: *mut u8, len: usize) -> std::result::Result<(), Failure> {
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let mut mrs = Vec::with_capacity(self.devices.len());
        for dev in &self.devices {
            // SAFETY: the engine owns the memory and drops it after this transport (the
            // stager's field order), and only after every operation completed.
            let mr = unsafe { dev.pd.reg_mr_raw(ptr, len, access) }.map_err(|e| failure_of(&e))?;
            mrs.push(mr);
        }
        self.bounce
            .set(Bounce {
                base: ptr as u64,
                len,
                mrs,
            })
            .map_err(|_| Failure::new(17, "the staging pool is registered already"))
    }

    fn bounce_remote(&self, rail: usize, offset: u64) -> (u64, u64) {
        match self.bounce.get() {
            Some(b) => (
                b.base + offset,
                u64::from(b.mrs[self.rails[rail].dev].rkey()),
            ),
            None => (0, 0),
        }
    }

    fn local_name(&self, rail: usize) -> Vec<u8> {
        encode_name(self.nonce, rail)
    }

    /// The requester is the connection the request arrived on: its name must be that
    /// connection's incarnation (a request naming another requester would have this side
    /// read from or write to that one with the keys the request gives).
    fn resolve(
        &self,
        _rail: usize,
        name: &[u8],
        sender: &VerbsSender,
    ) -> std::result::Result<VerbsAddr, Failure> {
        let (nonce, index) =
            decode_name(name).ok_or_else(|| Failure::new(22, "malformed requester name"))?;
        let VerbsSender::In(conn) = sender else {
            return Err(Failure::new(
                1,
                "a request on a connection this side opened (requests come on the requester's)",
            ));
        };
        if conn.nonce != nonce {
            return Err(Failure::new(
                1,
                format!(
                    "a request naming incarnation {nonce:#x} on a connection of `{}` ({:#x})",
                    conn.peer, conn.nonce
                ),
            ));
        }
        if index >= conn.qps.len() {
            return Err(Failure::new(22, format!("requester rail {index} unknown")));
        }
        Ok(VerbsAddr::In(conn.clone(), index))
    }

    fn is_sender(&self, addr: &VerbsAddr, sender: &VerbsSender) -> bool {
        match (addr, sender) {
            (VerbsAddr::Out(a, _), VerbsSender::Out(b)) => Arc::ptr_eq(a, b),
            (VerbsAddr::In(a, _), VerbsSender::In(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    fn write(
        &self,
        _rail: usize,
        dest: &VerbsAddr,
        offset: u64,
        len: usize,
        addr: u64,
        key: u64,
        imm: Option<u64>,
        op: u64,
    ) -> std::result::Result<(), NetError> {
        let b = self.bounce(offset, len)?;
        let remote = Self::remote(addr, len, key)?;
        self.post(dest, |rail| {
            let lkey = b.mrs[self.rails[rail].dev].lkey();
            // SAFETY: the range lies in the bounce pool (checked), registered as `lkey`;
            // the engine holds its slot for this operation until the completion is read,
            // and the pool outlives every operation.
            let sge = [unsafe { Sge::from_raw(b.base + offset, len as u32, lkey) }];
            let wr = match imm {
                Some(data) => SendWr::write_with_imm(STAGE_WR | op, &sge, remote, imm32(data)),
                None => SendWr::write(STAGE_WR | op, &sge, remote),
            };
            dest.qp().0.post_send(&mut [wr.signaled()])
        })
    }

    fn read(
        &self,
        _rail: usize,
        src: &VerbsAddr,
        offset: u64,
        len: usize,
        addr: u64,
        key: u64,
        op: u64,
    ) -> std::result::Result<(), NetError> {
        let b = self.bounce(offset, len)?;
        let remote = Self::remote(addr, len, key)?;
        self.post(src, |rail| {
            let lkey = b.mrs[self.rails[rail].dev].lkey();
            // SAFETY: as in `write`; nothing reads the slot until the completion.
            let sge = [unsafe { Sge::from_raw(b.base + offset, len as u32, lkey) }];
            src.qp()
                .0
                .post_send(&mut [SendWr::read(STAGE_WR | op, &sge, remote).signaled()])
        })
    }

    fn send(
        &self,
        _rail: usize,
        dest: &VerbsAddr,
        msg: &[u8],
        op: u64,
    ) -> std::result::Result<bool, NetError> {
        if msg.len() > staging::MAX_CTRL_BYTES {
            return Err(NetError::Failed(Failure::new(
                90,
                "control message too large",
            )));
        }
        let area = self.ctrl()?;
        let Some(slot) = area.free.lock().pop() else {
            return Err(NetError::Busy);
        };
        if let Some(token) = fetch_token(msg) {
            // Recorded before the request can be answered.
            self.fetches.lock().insert(token);
        }
        let at = area.mem.ptr() as u64 + u64::from(slot) * staging::MAX_CTRL_BYTES as u64;
        // SAFETY: slot `slot` of the area is ours (taken from the free list) until the
        // send's completion returns it; the message fits a slot (checked).
        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), at as *mut u8, msg.len()) };
        let wr_id = STAGE_WR | ((u64::from(slot) + 1) << OP_BITS) | op;
        let posted = self.post(dest, |rail| {
            let lkey = area.mrs[self.rails[rail].dev].lkey();
            // SAFETY: the slot stays untouched until the completion for `wr_id` is read;
            // the area is registered as `lkey` and outlives the operation.
            let sge = [unsafe { Sge::from_raw(at, msg.len() as u32, lkey) }];
            dest.qp()
                .0
                .post_send(&mut [SendWr::send(wr_id, &sge).signaled()])
        });
        match posted {
            Ok(()) => {
                area.held.lock()[usize::from(slot)] = Some(dest.clone());
                Ok(true)
            }
            Err(e) => {
                area.free.lock().push(slot);
                Err(e)
            }
        }
    }

    /// A key names its connection (`notif_key`): it counts only when that is the
    /// connection the OFFER came on.
    fn landed(&self, key: u64, sender: &VerbsSender) -> bool {
        let (conn, seq) = tracker_key(key);
        match sender {
            VerbsSender::In(c) if c.id == conn => {
                if let Some(common) = self.common.upgrade() {
                    common.notifs.data_arrived((conn, seq));
                }
                true
            }
            _ => false,
        }
    }
}

/// The staging engine and its transport, shared by the backend, its registrations,
/// transfers and rail workers.
#[derive(Debug)]
pub(super) struct Stager {
    // Declared before the engine: the bounce registrations close before its memory goes.
    pub(super) net: VerbsNet,
    engine: Mutex<Engine<VerbsAddr, VerbsSender>>,
    pub(super) cfg: staging::Config,
    /// The engine has copies running or posts waiting: the workers keep polling.
    poll: AtomicBool,
}

impl Stager {
    pub(super) fn new(
        common: Weak<Common>,
        nonce: u64,
        rails: &[Arc<Rail>],
        devices: &[Arc<Device>],
        cfg: staging::Config,
    ) -> Self {
        #[cfg(feature = "cuda")]
        let copier: Box<dyn staging::Copier> =
            Box::new(crate::backends::cuda_copy::StagingCopier::new(2));
        #[cfg(not(feature = "cuda"))]
        let copier: Box<dyn staging::Copier> = Box::<staging::HostCopier>::default();
        Self {
            net: VerbsNet {
                common,
                nonce,
                rails: rails.to_vec(),
                devices: devices.to_vec(),
                bounce: OnceLock::new(),
                ctrl: OnceLock::new(),
                in_flight: rails.iter().map(|_| AtomicUsize::new(0)).collect(),
                fetches: Mutex::default(),
            },
            engine: Mutex::new(Engine::new(cfg, copier)),
            cfg,
            poll: AtomicBool::new(false),
        }
    }

    pub(super) fn engine(&self) -> MutexGuard<'_, Engine<VerbsAddr, VerbsSender>> {
        self.engine.lock()
    }

    fn with(&self, f: impl FnOnce(&mut Engine<VerbsAddr, VerbsSender>, &VerbsNet)) {
        let mut engine = self.engine();
        f(&mut engine, &self.net);
        self.poll.store(engine.needs_poll(), Ordering::Release);
    }

    /// Whether a worker should poll the engine (one relaxed load).
    pub(super) fn wants_poll(&self) -> bool {
        self.poll.load(Ordering::Relaxed)
    }

    /// One round, unless another thread is driving the engine right now.
    pub(super) fn try_progress(&self) {
        if let Some(mut engine) = self.engine.try_lock() {
            let more = engine.progress(&self.net);
            self.poll.store(more, Ordering::Release);
        }
    }

    /// One round (waits for the lock).
    pub(super) fn progress(&self) {
        self.with(|e, n| {
            e.progress(n);
        });
    }

    pub(super) fn submit(&self, spec: RunSpec<VerbsAddr>) {
        self.with(|e, n| e.submit(n, spec));
    }

    /// A staging operation's completion on `rail` (`wr_id` as posted).
    pub(super) fn complete(
        &self,
        rail: usize,
        wr_id: u64,
        result: std::result::Result<(), Failure>,
    ) {
        self.net.unreserve(rail);
        let slot = (wr_id & !STAGE_WR) >> OP_BITS;
        if slot != 0 {
            if let Some(Ok(area)) = self.net.ctrl.get() {
                let slot = (slot - 1) as usize;
                // The QP may go once its operation is done.
                let held = area.held.lock()[slot].take();
                area.free.lock().push(slot as u16);
                drop(held);
            }
        }
        let op = wr_id & ((1 << OP_BITS) - 1);
        self.with(|e, n| e.on_complete(n, op, result));
    }

    /// A control message arrived on `rail`, on a QP of `sender`'s connection.
    pub(super) fn message(&self, rail: usize, sender: &VerbsSender, bytes: &[u8]) {
        self.with(|e, n| e.on_message(n, rail, sender, bytes));
    }

    /// A FETCH's data piece arrived with immediate `imm` on a QP of `conn`, a connection
    /// this side opened.
    pub(super) fn fetch_data(&self, imm: u32, conn: &Arc<Outgoing>) {
        let token = self.net.fetches.lock().lookup(imm);
        let sender = VerbsSender::Out(conn.clone());
        match token {
            Some(token) => self.with(|e, n| e.on_fetch_data(n, token, &sender)),
            None => tracing::debug!(imm, "VERBS staging: data for an unknown FETCH dropped"),
        }
    }

    /// Connection `conn` is gone or replaced: its runs fail, its slots come back.
    pub(super) fn peer_gone(&self, conn: &Arc<Outgoing>, why: &str) {
        if conn.staging_told.swap(true, Ordering::AcqRel) {
            return;
        }
        let id = Arc::as_ptr(conn) as u64;
        self.with(|e, n| e.peer_gone(n, id, why));
    }

    /// `peer_gone` unless another thread holds the engine (a rail worker may, through a
    /// staged copy): then `false` and nothing done, to be tried again. For the
    /// side-channel thread, whose heartbeats must not wait for a rail.
    pub(super) fn try_peer_gone(&self, conn: &Arc<Outgoing>, why: &str) -> bool {
        if conn.staging_told.load(Ordering::Acquire) {
            return true;
        }
        let Some(mut engine) = self.engine.try_lock() else {
            return false;
        };
        if !conn.staging_told.swap(true, Ordering::AcqRel) {
            engine.peer_gone(&self.net, Arc::as_ptr(conn) as u64, why);
            self.poll.store(engine.needs_poll(), Ordering::Release);
        }
        true
    }
}

/// A staged run's reports, into its transfer's shared state.
#[derive(Debug)]
pub(super) struct VerbsSink {
    pub(super) shared: Arc<XferShared>,
    pub(super) rail0: Arc<Rail>,
    pub(super) conn: Arc<Outgoing>,
}

impl RunSink for VerbsSink {
    fn canceled(&self) -> bool {
        self.shared.canceled.load(Ordering::Relaxed)
    }
    fn progressed(&self) {
        self.shared.completed.fetch_add(1, Ordering::Relaxed);
    }
    fn finished(&self) {
        self.shared.units_done(1, &self.rail0, &self.conn);
    }
    fn failed(&self, failure: Failure) {
        self.shared.fail(if failure.disconnect {
            XferFailure::Disconnect(failure.text)
        } else {
            XferFailure::Backend(failure.code, failure.text)
        });
    }
    fn user_copy(&self, started: bool) {
        if started {
            self.shared.user_copies.fetch_add(1, Ordering::AcqRel);
        } else {
            self.shared.user_copies.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
