//! LIBFABRIC's side of the staging pipeline ([`super::staging`]): RMA between the
//! bounce pool and peer memory on any rail, control messages from a registered buffer
//! (or injected when small), requesters' addresses resolved into the rail's AV, and
//! the engine driven by the rail workers (completions, messages, fetch data, polling).

use super::notif_mac::Sealer;
use super::sources::{PeerSource, Sources, STRANGER};
use super::{fabric_error, is_disconnect, NotifTracker, PeerAddrs, Rail, XferShared};
use super::{Failure, NetError, RunSink, RunSpec, StageNet, CTRL_SLOTS, MAX_REPLY_ADDRS};
use super::{STAGE_CONTEXT, STAGE_OP_BITS};
use crate::backends::shared::Arrival;
use crate::backends::staging::{self, BounceMem, Engine};
use crate::error::Result;
use fabric::{Access, Address, HmemIface, MemoryRegion};
use parking_lot::{Mutex, MutexGuard};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// A peer's address on one rail, kept in the AV while held.
#[derive(Debug, Clone)]
pub(super) enum FabAddr {
    /// A peer whose metadata this agent loaded (initiator side).
    Peer(Arc<PeerAddrs>, usize),
    /// A requester, resolved from the name it sent (target side).
    Reply(Arc<ReplyAddr>),
    /// A requester this side has not loaded whose request came sealed under the key it
    /// carried (module `notif_mac`, [`super::notif_mac::Channels`]): answers go sealed
    /// under that key.
    Channel(Arc<ReplyAddr>, Arc<Sealer>),
}

impl FabAddr {
    pub(super) fn address(&self) -> Address {
        match self {
            FabAddr::Peer(p, rail) => p.addrs[*rail],
            FabAddr::Reply(r) | FabAddr::Channel(r, _) => r.addr,
        }
    }

    /// What seals control messages to this address: the loaded peer's key, a channel's,
    /// or none (a stranger's plain request gets a plain answer).
    pub(super) fn sealer(&self) -> Option<&Arc<Sealer>> {
        match self {
            FabAddr::Peer(p, _) => Some(&p.sealer),
            FabAddr::Reply(r) => r.sealer.as_ref(),
            FabAddr::Channel(_, s) => Some(s),
        }
    }

    /// `msg`, a plain control message, as it goes to this address (sealed where it can
    /// be).
    pub(super) fn seal<'m>(&self, msg: &'m [u8]) -> Cow<'m, [u8]> {
        match self.sealer() {
            Some(sealer) => Cow::Owned(sealer.seal_control(msg)),
            None => Cow::Borrowed(msg),
        }
    }
}

/// Who sent a staging message or a FETCH's data: for a control message, the loaded peer
/// whose key sealed it (module `notif_mac`); else as the provider names it (module
/// `sources`), never as the message names itself.
#[derive(Debug, Clone)]
pub(super) struct FabSender {
    /// A control message (which proves its sender by its seal), not a FETCH's data
    /// (which only the provider attributes).
    pub(super) message: bool,
    /// The loaded peer whose key sealed the message: the sender, whatever endpoint the
    /// provider names (then `peer` is it too).
    pub(super) proven: Option<Arc<PeerSource>>,
    /// The message came sealed under a channel with a sender this side has not loaded:
    /// answers go sealed under it.
    pub(super) channel: Option<Arc<Sealer>>,
    /// The provider names the senders of this kind of arrival on its rail (messages:
    /// every provider with `FI_SOURCE`; remote CQ data: `shm` and `sockets`). Where it
    /// does not, only the token or key ties an arrival to its request.
    pub(super) named: bool,
    /// The sending endpoint's name, where the sender is in the rail's AV.
    pub(super) endpoint: Option<Vec<u8>>,
    /// The sender was reported as the rail's unattributable handle (`shm`: this rail's
    /// own endpoint, or a sender the AV does not hold).
    pub(super) maybe_self: bool,
    /// The loaded peer whose endpoint it is.
    pub(super) peer: Option<Arc<PeerSource>>,
}

/// A requester's address in one rail's AV; removed when the last user lets go.
#[derive(Debug)]
pub(super) struct ReplyAddr {
    rail: Arc<Rail>,
    addr: Address,
    /// Seals control messages to it: a loaded peer's endpoint (module `sources`).
    sealer: Option<Arc<Sealer>>,
}

impl ReplyAddr {
    /// `addr`, inserted in `rail`'s AV: removed from it when dropped.
    pub(super) fn new(rail: Arc<Rail>, addr: Address, sealer: Option<Arc<Sealer>>) -> Self {
        ReplyAddr { rail, addr, sealer }
    }
}

impl Drop for ReplyAddr {
    fn drop(&mut self) {
        self.rail.forget(self.addr);
    }
}

pub(super) fn failure_of(e: &fabric::Error) -> Failure {
    Failure {
        disconnect: is_disconnect(e),
        code: e.errno().unwrap_or(0),
        text: e.to_string(),
    }
}

fn net_error(e: fabric::Error) -> NetError {
    match e {
        fabric::Error::WouldBlock { .. } => NetError::Busy,
        other => NetError::Failed(failure_of(&other)),
    }
}

/// The bounce pool's registrations (the memory itself belongs to the engine, which is
/// dropped after these).
#[derive(Debug)]
struct Bounce {
    base: u64,
    len: usize,
    mrs: Vec<MemoryRegion>,
}

/// Buffers control messages are sent from.
#[derive(Debug)]
struct CtrlArea {
    // Declared first: the registrations close before the memory goes.
    mrs: Vec<MemoryRegion>,
    mem: BounceMem,
    free: Mutex<Vec<u16>>,
}

/// The transport for the engine.
#[derive(Debug)]
pub(super) struct FabricNet {
    rails: Vec<Arc<Rail>>,
    names: Vec<Vec<u8>>,
    notifs: Arc<NotifTracker<u64>>,
    bounce: OnceLock<Bounce>,
    ctrl: OnceLock<std::result::Result<CtrlArea, Failure>>,
    replies: Mutex<ReplyCache>,
    /// The loaded peers' endpoints (module `sources`): a request from none of them must
    /// not name one.
    sources: Arc<Sources>,
    /// Requests only from loaded peers (`notif_senders=loaded`).
    loaded_senders_only: bool,
}

/// Resolved requesters by (rail, name).
type ReplyCache = HashMap<(usize, Vec<u8>), Arc<ReplyAddr>>;

impl FabricNet {
    fn ctrl(&self) -> std::result::Result<&CtrlArea, NetError> {
        self.ctrl
            .get_or_init(|| {
                let len = CTRL_SLOTS * staging::MAX_CTRL_BYTES;
                let mem = BounceMem::heap(len).map_err(|e| Failure::new(12, e.to_string()))?;
                let mut mrs = Vec::with_capacity(self.rails.len());
                for rail in &self.rails {
                    // SAFETY: `mem` is owned by the area next to the registrations, which
                    // are dropped first.
                    let mr = unsafe {
                        MemoryRegion::reg_raw(
                            &rail.domain,
                            Some(&rail.ep),
                            mem.ptr(),
                            len,
                            Access::SEND,
                            HmemIface::System,
                        )
                    }
                    .map_err(|e| failure_of(&e))?;
                    mrs.push(mr);
                }
                Ok(CtrlArea {
                    mrs,
                    mem,
                    free: Mutex::new((0..CTRL_SLOTS as u16).rev().collect()),
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

    fn context(op: u64, ctrl_slot: Option<u16>) -> u64 {
        STAGE_CONTEXT | (ctrl_slot.map_or(0, |s| u64::from(s) + 1) << STAGE_OP_BITS) | op
    }

    /// Forgets every resolved requester (their AV entries go once no serve holds them).
    #[cfg(test)]
    pub(super) fn forget_requesters(&self) -> usize {
        let mut cache = self.replies.lock();
        let n = cache.len();
        cache.clear();
        n
    }

    /// The requester `name` in `rail`'s AV (cached).
    fn reply_addr(&self, rail: usize, name: &[u8]) -> std::result::Result<Arc<ReplyAddr>, Failure> {
        let mut cache = self.replies.lock();
        if let Some(a) = cache.get(&(rail, name.to_vec())) {
            return Ok(a.clone());
        }
        if cache.len() >= MAX_REPLY_ADDRS {
            // Entries in use stay alive in their serves.
            cache.clear();
        }
        let rail_ref = &self.rails[rail];
        let addr = rail_ref.av.insert(name).map_err(|e| failure_of(&e))?;
        let entry = Arc::new(ReplyAddr {
            rail: rail_ref.clone(),
            addr,
            sealer: None,
        });
        cache.insert((rail, name.to_vec()), entry.clone());
        Ok(entry)
    }

    /// Returns the control buffer an operation context names, if any.
    fn release_ctrl(&self, context: u64) {
        let slot = (context >> STAGE_OP_BITS) & 0xffff;
        if slot != 0 {
            if let Some(Ok(area)) = self.ctrl.get() {
                area.free.lock().push((slot - 1) as u16);
            }
        }
    }
}

impl StageNet for FabricNet {
    type Addr = FabAddr;
    type Sender = FabSender;

    fn rails(&self) -> usize {
        self.rails.len()
    }

    fn register_bounce(&self, ptr: *mut u8, len: usize) -> std::result::Result<(), Failure> {
        let mut mrs = Vec::with_capacity(self.rails.len());
        for rail in &self.rails {
            // SAFETY: the engine owns the memory and drops it after this transport (the
            // stager's field order), and only after every operation completed.
            let mr = unsafe {
                MemoryRegion::reg_raw(
                    &rail.domain,
                    Some(&rail.ep),
                    ptr,
                    len,
                    Access::READ | Access::WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
                    HmemIface::System,
                )
            }
            .map_err(|e| failure_of(&e))?;
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
            Some(b) => {
                let r = b.mrs[rail].remote();
                (r.address_at(offset), r.key)
            }
            None => (0, 0),
        }
    }

    fn local_name(&self, rail: usize) -> Vec<u8> {
        self.names[rail].clone()
    }

    /// A request sealed by a loaded peer names one of that peer's endpoints (answers go
    /// there, sealed). Else the requester must be the endpoint the request came from,
    /// where the provider names it; a sender it cannot name may not claim a loaded peer's
    /// endpoint (that peer's own requests are sealed), nor be anyone with
    /// `notif_senders=loaded`.
    fn resolve(
        &self,
        rail: usize,
        name: &[u8],
        sender: &FabSender,
    ) -> std::result::Result<FabAddr, Failure> {
        if let Some(peer) = &sender.proven {
            return match self.sources.find(rail, name) {
                Some(s) if Arc::ptr_eq(&s.peer, peer) => Ok(s.reply.clone()),
                Some(_) => Err(Failure::new(1, "a request naming another peer's endpoint")),
                None if self.rails[rail].names_senders => Err(Failure::new(
                    1,
                    "a request naming none of its sender's endpoints",
                )),
                // This provider does not name senders, so no endpoint is bound: the
                // peer's word, sealed, with the answers sealed to it.
                None => match peer.sealer() {
                    Some(sealer) => Ok(FabAddr::Channel(
                        self.reply_addr(rail, name)?,
                        sealer.clone(),
                    )),
                    None => Err(Failure::new(1, "a request from a peer not fully loaded")),
                },
            };
        }
        if sender.named {
            let own = self.names.get(rail).is_some_and(|n| n.as_slice() == name);
            let refusal = match &sender.endpoint {
                Some(ep) if ep.as_slice() != name => {
                    Some("a request naming another endpoint than the one it came from")
                }
                _ if self.loaded_senders_only && sender.peer.is_none() => {
                    Some("a request from an endpoint of no loaded peer (notif_senders=loaded)")
                }
                Some(_) => None,
                // `shm` reports this rail's own endpoint as unattributable.
                None if own && sender.maybe_self => None,
                None if own || self.sources.find(rail, name).is_some() => {
                    Some("a request naming a loaded peer's endpoint from none of its endpoints")
                }
                None => None,
            };
            if let Some(why) = refusal {
                return Err(Failure::new(1, why));
            }
        }
        let reply = self.reply_addr(rail, name)?;
        Ok(match &sender.channel {
            Some(sealer) => FabAddr::Channel(reply, sealer.clone()),
            None => FabAddr::Reply(reply),
        })
    }

    fn write(
        &self,
        rail: usize,
        dest: &FabAddr,
        offset: u64,
        len: usize,
        addr: u64,
        key: u64,
        imm: Option<u64>,
        op: u64,
    ) -> std::result::Result<(), NetError> {
        let b = self.bounce(offset, len)?;
        let ep = &self.rails[rail].ep;
        let buf = (b.base + offset) as *const u8;
        let ctx = Self::context(op, None);
        // SAFETY: the range lies in the bounce pool (checked), whose slot the engine holds
        // for this operation until its completion is read; the pool outlives it.
        let posted = unsafe {
            match imm {
                // A served FETCH's data: it completes only once delivered, so the
                // answer sent after the last completion (`fetch_answered`) never
                // overtakes it (`shm` and `tcp;ofi_rxm` otherwise complete a write when
                // its bytes have left).
                Some(data) if data & staging::FETCH_DATA != 0 => ep.writedatamsg_raw(
                    buf,
                    len,
                    Some(&b.mrs[rail]),
                    data,
                    dest.address(),
                    addr,
                    key,
                    ctx,
                    fabric::ffi::FI_COMPLETION | fabric::ffi::FI_DELIVERY_COMPLETE,
                ),
                Some(data) => ep.writedata_raw(
                    buf,
                    len,
                    Some(&b.mrs[rail]),
                    data,
                    dest.address(),
                    addr,
                    key,
                    ctx,
                ),
                None => ep.write_raw(buf, len, Some(&b.mrs[rail]), dest.address(), addr, key, ctx),
            }
        };
        posted.map_err(net_error)
    }

    fn read(
        &self,
        rail: usize,
        src: &FabAddr,
        offset: u64,
        len: usize,
        addr: u64,
        key: u64,
        op: u64,
    ) -> std::result::Result<(), NetError> {
        let b = self.bounce(offset, len)?;
        let ep = &self.rails[rail].ep;
        // SAFETY: as in `write`; nothing reads the slot until the completion.
        let posted = unsafe {
            ep.read_raw(
                (b.base + offset) as *mut u8,
                len,
                Some(&b.mrs[rail]),
                src.address(),
                addr,
                key,
                Self::context(op, None),
            )
        };
        posted.map_err(net_error)
    }

    fn send(
        &self,
        rail: usize,
        dest: &FabAddr,
        msg: &[u8],
        op: u64,
    ) -> std::result::Result<bool, NetError> {
        let r = &self.rails[rail];
        let msg = &*dest.seal(msg);
        if msg.len() <= r.inject_size {
            return r
                .ep
                .inject(msg, dest.address())
                .map(|()| false)
                .map_err(net_error);
        }
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
        let at = area.mem.ptr() as usize + usize::from(slot) * staging::MAX_CTRL_BYTES;
        // SAFETY: slot `slot` of the area is ours (taken from the free list) until the
        // send's completion returns it; the message fits a slot (checked).
        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), at as *mut u8, msg.len()) };
        let ctx = Self::context(op, Some(slot));
        // SAFETY: the slot stays untouched until the completion for `ctx` is read.
        let posted = unsafe {
            r.ep.send_raw(
                at as *const u8,
                msg.len(),
                Some(&area.mrs[rail]),
                dest.address(),
                ctx,
            )
        };
        match posted {
            Ok(()) => Ok(true),
            Err(e) => {
                area.free.lock().push(slot);
                Err(net_error(e))
            }
        }
    }

    /// A DONE or FETCHED counts only when sealed by the key the request went under (no
    /// endpoint's word: `shm` misattributes a flood). A FETCH's data, which cannot be
    /// sealed, is never asked about: it ends nothing without the FETCHED
    /// ([`StageNet::fetch_answered`]), so no provider's attribution is trusted for it.
    fn is_sender(&self, addr: &FabAddr, sender: &FabSender) -> bool {
        if !sender.message {
            return false;
        }
        let Some(proven) = sender.proven.as_ref().and_then(|p| p.sealer()) else {
            return false;
        };
        addr.sealer().is_some_and(|s| Arc::ptr_eq(s, proven))
    }

    /// Remote CQ data proves nothing about its writer here (no seal fits in 64 bits, and
    /// `shm` misattributes a flood): a FETCH completes on the target's sealed FETCHED,
    /// sent once its writes are delivered. Part of the key section's version 3
    /// (module `notif_mac`).
    fn fetch_answered(&self) -> bool {
        true
    }

    /// Counted toward the sender's notifications only (a loaded peer's, or all
    /// strangers' together), as the rail workers count remote CQ data.
    fn landed(&self, key: u64, sender: &FabSender) -> bool {
        let owner = match (&sender.peer, sender.named) {
            (_, false) => None,
            (Some(peer), true) => Some(peer.tag),
            (None, true) => Some(STRANGER),
        };
        !matches!(self.notifs.data_from(key, owner), Arrival::Refused(_))
    }
}

/// The staging engine and its transport, shared by the backend, its registrations,
/// transfers and rail workers.
#[derive(Debug)]
pub(super) struct Stager {
    // Declared before the engine: the bounce registrations close before its memory goes.
    pub(super) net: FabricNet,
    engine: Mutex<Engine<FabAddr, FabSender>>,
    pub(super) cfg: staging::Config,
    /// The engine has copies running or posts waiting: the workers keep polling.
    poll: AtomicBool,
}

impl Stager {
    pub(super) fn new(
        rails: &[Arc<Rail>],
        notifs: Arc<NotifTracker<u64>>,
        (sources, loaded_senders_only): (Arc<Sources>, bool),
        cfg: staging::Config,
    ) -> Result<Self> {
        let names = rails
            .iter()
            .map(|r| r.ep.name().map_err(fabric_error))
            .collect::<Result<Vec<_>>>()?;
        #[cfg(feature = "cuda")]
        let copier: Box<dyn staging::Copier> =
            Box::new(crate::backends::cuda_copy::StagingCopier::new(2));
        #[cfg(not(feature = "cuda"))]
        let copier: Box<dyn staging::Copier> = Box::<staging::HostCopier>::default();
        Ok(Self {
            net: FabricNet {
                rails: rails.to_vec(),
                names,
                notifs,
                bounce: OnceLock::new(),
                ctrl: OnceLock::new(),
                replies: Mutex::default(),
                sources,
                loaded_senders_only,
            },
            engine: Mutex::new(Engine::new(cfg, copier)),
            cfg,
            poll: AtomicBool::new(false),
        })
    }

    pub(super) fn engine(&self) -> MutexGuard<'_, Engine<FabAddr, FabSender>> {
        self.engine.lock()
    }

    fn with(&self, f: impl FnOnce(&mut Engine<FabAddr, FabSender>, &FabricNet)) {
        let mut engine = self.engine();
        f(&mut engine, &self.net);
        let poll = engine.needs_poll();
        self.poll.store(poll, Ordering::Release);
        drop(engine);
        if poll {
            // Any worker drives the engine: wake those that sleep.
            for rail in &self.net.rails {
                rail.idle.wake();
            }
        }
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

    pub(super) fn submit(&self, spec: RunSpec<FabAddr>) {
        self.with(|e, n| e.submit(n, spec));
    }

    /// A staging operation's completion (`context` as posted).
    pub(super) fn complete(&self, context: u64, result: std::result::Result<(), Failure>) {
        self.net.release_ctrl(context);
        let op = context & ((1 << STAGE_OP_BITS) - 1);
        self.with(|e, n| e.on_complete(n, op, result));
    }

    pub(super) fn message(&self, rail: usize, sender: &FabSender, bytes: &[u8]) {
        self.with(|e, n| e.on_message(n, rail, sender, bytes));
    }

    pub(super) fn fetch_data(&self, token: u64, sender: &FabSender) {
        self.with(|e, n| e.on_fetch_data(n, token, sender));
    }

    /// The peer whose addresses these were is gone or replaced.
    pub(super) fn peer_gone(&self, addrs: &Arc<PeerAddrs>, why: &str) {
        let id = Arc::as_ptr(addrs) as u64;
        self.with(|e, n| e.peer_gone(n, id, why));
    }
}

/// A staged run's reports, into its transfer's shared state.
#[derive(Debug)]
pub(super) struct FabricSink {
    pub(super) shared: Arc<XferShared>,
    pub(super) rail0: Arc<Rail>,
    pub(super) peer: Arc<PeerAddrs>,
}

impl RunSink for FabricSink {
    fn canceled(&self) -> bool {
        self.shared.canceled.load(Ordering::Relaxed)
    }
    fn progressed(&self) {
        self.shared.completed.fetch_add(1, Ordering::Relaxed);
    }
    fn finished(&self) {
        self.shared.unit_done(&self.rail0, &self.peer);
    }
    fn failed(&self, failure: Failure) {
        self.shared
            .fail_with(failure.disconnect, failure.code, failure.text);
    }
    fn user_copy(&self, started: bool) {
        if started {
            self.shared.user_copies.fetch_add(1, Ordering::AcqRel);
        } else {
            self.shared.user_copies.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
