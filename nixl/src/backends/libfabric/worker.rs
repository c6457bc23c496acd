//! The rail workers: each rail's jobs (a post's share of it), issued in arrival order
//! within a window, its completion queue read, incoming notifications and staging
//! messages dispatched — driven by one thread per rail, or (`progress_thread = false`)
//! by the callers' own polls.

mod peer_copies;

use super::assist;
use super::cma::CopyError;
use super::idle::nap_after;
use super::liveness::ProcessId;
use super::notif_mac::{self, ControlFrame, Sealed};
use super::peer_copy;
use super::sources::{Source, STRANGER};
use super::stage_net::{FabAddr, FabSender};
use super::xfer::NotifView;
use super::{
    fabric_error, failure_of, send_message, staging, Common, Copier, PeerAddrs, Rail, RailOp,
    XferShared, MAX_OUTSTANDING, NOTIF_SLOT, NOTIF_SLOTS, RECV_CONTEXT, STAGE_CONTEXT,
};
use crate::backend::XferOp;
use crate::backends::shared::Arrival;
use crate::backends::staging::StageNet;
use crate::error::Result;
use fabric::{Access, Address, Caps, Completion, MemoryRegion, RegisteredBuffer};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A post's share of one rail.
#[derive(Debug)]
pub(super) struct RailJob {
    pub(super) shared: Arc<XferShared>,
    pub(super) ops: Arc<Vec<RailOp>>,
    /// Keeps the registrations alive while operations are in flight.
    pub(super) mrs: Arc<[MemoryRegion]>,
    pub(super) op: XferOp,
    /// Remote CQ data for every write (with a notification).
    pub(super) imm: Option<u64>,
    /// Message to send after the operations were issued.
    pub(super) notif: Option<(Address, Vec<u8>)>,
    /// Keeps the destination addresses in the AVs until the job is retired.
    pub(super) peer: Arc<PeerAddrs>,
}

#[derive(Debug)]
struct ActiveJob {
    job: RailJob,
    next: usize,
    /// Operations issued and not completed, READ assists included.
    in_flight: usize,
    /// READ pieces the peer was asked to push, not yet answered (see `assist`).
    assists: usize,
    /// Assisted pieces the peer refused, to read through the provider.
    redo: Vec<usize>,
    /// A notification send completion is awaited.
    notif_in_flight: Option<RegisteredBuffer>,
}

impl Drop for ActiveJob {
    fn drop(&mut self) {
        self.job.shared.in_workers.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ActiveJob {
    /// Issues nothing more of the job (it failed or was canceled); what is in flight
    /// still completes.
    fn stop_issuing(&mut self) {
        self.next = self.job.ops.len();
        self.job.notif = None;
        self.redo.clear();
    }
}

/// Who sent a rail control message, as its seal proves (module `notif_mac`).
#[derive(Debug)]
enum Proof {
    /// Sealed by this loaded peer (under the pair key its connection information gave).
    Peer(Arc<super::sources::PeerSource>),
    /// Sealed under the key it carries by a sender this side has not loaded (or whose
    /// loaded incarnation's process ended): answers go sealed under that channel.
    Channel(Arc<notif_mac::Sealer>),
    /// Not sealed, and from no live loaded peer's endpoint as far as the provider says:
    /// a stranger's, judged as before sealing (only a refusal answers it).
    Unsealed,
}

/// Whether `bytes` is a plain rail control message (staging, READ assist, direct copy).
fn is_control(bytes: &[u8]) -> bool {
    [staging::MAGIC, assist::MAGIC, peer_copy::MAGIC]
        .iter()
        .any(|m| bytes.starts_with(&m[..]))
}

const NOTIF_CONTEXT: u64 = 1 << 61;
/// Handles a worker keeps attributed (an AV holds at most a few hundred).
const MAX_SOURCES_SEEN: usize = 4096;
/// Refusals of requests no seal proved (READ assists, direct copies) a worker keeps
/// queued while its endpoint is busy; more are dropped (their senders are no loaded
/// peers: a refusal only spares them a timeout).
const MAX_QUEUED_REFUSALS: usize = 1024;
/// How often a worker with nothing else to do reads the remote operation counter.
const COUNTER_CHECK_INTERVAL: Duration = Duration::from_micros(100);

/// The rail workers, driven by one thread each, or (`progress_thread = false`) by the
/// callers' own polls.
pub(super) struct Progress {
    pub(super) workers: Vec<Mutex<Worker>>,
    pub(super) inline: bool,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field("rails", &self.workers.len())
            .field("inline", &self.inline)
            .finish()
    }
}

impl Progress {
    /// Without progress threads: one round of every rail not being driven by another
    /// caller right now.
    pub(super) fn poll_inline(&self) {
        if !self.inline {
            return;
        }
        for worker in &self.workers {
            if let Some(mut worker) = worker.try_lock() {
                worker.step();
            }
        }
    }
}

/// A rail's progress thread: spins while there is work and for a while after any
/// activity, then sleeps until work, traffic or a nap's end (see `idle`), or keeps
/// spinning with `busy_poll`.
pub(super) fn run_worker(progress: &Progress, index: usize) {
    progress.workers[index].lock().rail.idle.worker_started();
    let spin_for = progress.workers[index]
        .lock()
        .rail
        .idle
        .spin_after_activity();
    let mut last_activity = Instant::now();
    loop {
        let mut worker = progress.workers[index].lock();
        if worker.common.stop.load(Ordering::SeqCst) {
            return;
        }
        let busy = worker.step();
        if busy || !worker.jobs.is_empty() {
            last_activity = Instant::now();
            drop(worker);
            if !busy {
                std::thread::yield_now();
            }
        } else if worker.common.busy_poll {
            // Never sleeps, yet yields: a pure spin keeps the threads that feed this
            // rail (the caller's, a same-host peer's) off the core until the scheduler's
            // tick where cores are few (4 ms per WRITE on two cores).
            drop(worker);
            std::thread::yield_now();
        } else if last_activity.elapsed() < spin_for {
            drop(worker);
            std::thread::yield_now();
        } else if worker.wait_idle(last_activity.elapsed() - spin_for) {
            last_activity = Instant::now();
        }
    }
}

pub(super) struct Worker {
    index: usize,
    rail: Arc<Rail>,
    rails: Vec<Arc<Rail>>,
    common: Arc<Common>,
    jobs: HashMap<u64, ActiveJob>,
    order: VecDeque<u64>,
    next_id: u64,
    outstanding: usize,
    recv_buf: RegisteredBuffer,
    /// The message being judged, copied out of its receive slot so that the slot is
    /// posted again before the message is judged (kept from message to message: no
    /// allocation per message).
    message: Vec<u8>,
    /// Reused completion buffer.
    completions: Vec<Completion>,
    /// When the remote operation counter is read next.
    next_counter_check: Instant,
    /// This rail's endpoint name and this process: what a READ assist request carries.
    name: Vec<u8>,
    me: Option<ProcessId>,
    /// Answers to peers' assist requests not yet sent (the endpoint was busy).
    replies: VecDeque<(FabAddr, Vec<u8>)>,
    /// A send of `replies` found the endpoint busy in this round: no more tries until
    /// the next (each try that finds it busy progresses the provider, which takes in
    /// more messages without this worker reading them).
    replies_blocked: bool,
    /// Answers to unproven requesters dropped for [`MAX_QUEUED_REFUSALS`].
    dropped_refusals: u64,
    /// Senders' handles on this rail, attributed (module `sources`), as of
    /// `sources_generation`.
    sources_seen: HashMap<Address, Option<Arc<Source>>>,
    sources_generation: u64,
    /// READ assist answers dropped for coming from another endpoint than the job's peer.
    foreign_answers: u64,
    /// Peers' direct copy requests whose copies run: (copies, where the answer goes,
    /// the request's id).
    #[cfg(feature = "cuda")]
    serving: Vec<(
        peer_copy::Serving,
        peer_copies::AnswerTo,
        u64,
        peer_copy::trace::TargetStamps,
    )>,
    /// Shared lanes this worker made for same-host peers' notifications and requests
    /// (module `peer_copies`), as of `lanes_generation` of the loaded peers, and an
    /// entry copied out of one.
    lanes: Vec<peer_copies::ServedLane>,
    lanes_generation: u64,
    lane_buf: Vec<u8>,
}

impl Worker {
    pub(super) fn new(
        index: usize,
        rail: Arc<Rail>,
        rails: Vec<Arc<Rail>>,
        common: Arc<Common>,
    ) -> Result<Self> {
        let recv_buf = rail
            .ep
            .alloc_registered(NOTIF_SLOTS * NOTIF_SLOT, Access::RECV)
            .map_err(fabric_error)?;
        let worker = Worker {
            index,
            rails,
            common,
            jobs: HashMap::new(),
            order: VecDeque::new(),
            next_id: 1,
            outstanding: 0,
            recv_buf,
            message: Vec::with_capacity(NOTIF_SLOT),
            // More than the receives posted: one read takes every completion that the
            // provider's progress (inside that read) produced, so that each receive is
            // posted again before the next read pulls more messages (`ofi_rxm` keeps
            // those that find no posted receive in bounce buffers, without bound).
            completions: vec![Completion::default(); 2 * NOTIF_SLOTS],
            next_counter_check: Instant::now(),
            name: rail.ep.name().map_err(fabric_error)?,
            me: ProcessId::current(),
            replies: VecDeque::new(),
            replies_blocked: false,
            dropped_refusals: 0,
            sources_seen: HashMap::new(),
            sources_generation: u64::MAX,
            foreign_answers: 0,
            #[cfg(feature = "cuda")]
            serving: Vec::new(),
            lanes: Vec::new(),
            lanes_generation: 0,
            lane_buf: Vec::new(),
            rail,
        };
        for slot in 0..NOTIF_SLOTS {
            worker.post_recv(slot)?;
        }
        Ok(worker)
    }

    fn post_recv(&self, slot: usize) -> Result<()> {
        let range = slot * NOTIF_SLOT..(slot + 1) * NOTIF_SLOT;
        let deadline = Instant::now() + Duration::from_secs(5);
        self.rail
            .ep
            .retry(deadline, || {
                self.rail.ep.recv(
                    &self.recv_buf,
                    range.clone(),
                    Address::UNSPEC,
                    RECV_CONTEXT | slot as u64,
                )
            })
            .map_err(fabric_error)
    }

    /// One round: take new jobs, issue what the window allows, read completions.
    /// Returns whether anything happened.
    fn step(&mut self) -> bool {
        self.rail.in_round(true);
        let busy = self.round();
        self.rail.in_round(false);
        busy
    }

    fn round(&mut self) -> bool {
        let mut completions = std::mem::take(&mut self.completions);
        let mut busy = self.accept_jobs();
        self.replies_blocked = false;
        if !self.replies.is_empty() {
            busy |= self.send_replies();
        }
        busy |= self.issue();
        if self.rail.orphans.is_some() && self.outstanding > 0 {
            self.fail_orphans();
        }
        busy |= self.poll(&mut completions);
        self.completions = completions;
        // What same-host peers put in their shared lanes is read as a rail's messages
        // are; peers' direct copies running here are polled, as staging copies are.
        if !self.lanes.is_empty() {
            busy |= self.serve_lanes();
        }
        #[cfg(feature = "cuda")]
        if !self.serving.is_empty() {
            self.poll_serving();
            busy = true;
        }
        // Staging copies are polled, not waited for (one relaxed load when idle).
        if self.common.stager.wants_poll() {
            self.common.stager.try_progress();
            busy = true;
        }
        // Remote operations this endpoint progressed (WRITEs without notification leave
        // no completion here, yet their initiator waits for this side's progress). Read
        // now and then only: reading the counter progresses the endpoint once more, and
        // the spin after activity lasts far longer than the interval.
        if !busy && self.rail.idle.counts_remote_ops() {
            let now = Instant::now();
            if now >= self.next_counter_check {
                self.next_counter_check = now + COUNTER_CHECK_INTERVAL;
                busy = self.rail.idle.remote_activity();
            }
        }
        busy
    }

    /// Over `shm`: operations to a peer whose process ended that it never answered are
    /// failed, or they would hold this rail's window and completions for good (see
    /// `shm_orphans`).
    fn fail_orphans(&self) {
        let Some(repairs) = self.rail.orphans.as_ref().filter(|r| r.scan_due()) else {
            return;
        };
        for active in self.jobs.values() {
            let provider_ops =
                active.in_flight - active.assists > 0 || active.notif_in_flight.is_some();
            match &active.job.shared.peer.liveness {
                Some(liveness) if provider_ops && liveness.has_ended() => {
                    repairs.after_death(liveness.pid(), &active.job.peer.names)
                }
                _ => {}
            }
        }
    }

    /// Sleeping (on and off) for `sleeping`: sleeps until local work, incoming traffic
    /// (where the queue has a wait fd) or a nap's end. Returns whether traffic woke it.
    fn wait_idle(&mut self, sleeping: Duration) -> bool {
        if self.lanes_going_to_sleep() {
            self.lanes_awake();
            return true;
        }
        let common = &self.common;
        let rail = &self.rail;
        let woke = rail.idle.sleep(&rail.cq, nap_after(sleeping), || {
            common.stop.load(Ordering::SeqCst)
                || common.stager.wants_poll()
                || !rail.submit.lock().is_empty()
        });
        self.lanes_awake();
        woke
    }

    fn accept_jobs(&mut self) -> bool {
        let new: Vec<RailJob> = self.rail.submit.lock().drain(..).collect();
        let any = !new.is_empty();
        for job in new {
            let id = self.next_id;
            self.next_id += 1;
            // Undone when the job is dropped (retired, or the worker ends).
            job.shared.in_workers.fetch_add(1, Ordering::AcqRel);
            self.jobs.insert(
                id,
                ActiveJob {
                    job,
                    next: 0,
                    in_flight: 0,
                    assists: 0,
                    redo: Vec::new(),
                    notif_in_flight: None,
                },
            );
            self.order.push_back(id);
        }
        any
    }

    /// Issues operations of the jobs in arrival order, as far as the window allows.
    fn issue(&mut self) -> bool {
        let mut issued_any = false;
        let ids: Vec<u64> = self.order.iter().copied().collect();
        'jobs: for id in ids {
            let Some(active) = self.jobs.get_mut(&id) else {
                continue;
            };
            let shared = active.job.shared.clone();
            let work_left = active.next < active.job.ops.len() || active.job.notif.is_some();
            if work_left {
                // Never call into the provider for a peer known to be gone (see
                // `XferShared::peer_alive`: over shm such a call can spin forever).
                if let Err(crate::Error::RemoteDisconnect { reason, .. }) = shared.peer_alive() {
                    shared.fail_with(true, 0, reason);
                }
            }
            if active.assists > 0 {
                if let Some(liveness) = &shared.peer.liveness {
                    if let Err(crate::Error::RemoteDisconnect { reason, .. }) =
                        liveness.check_ended(&shared.peer.agent)
                    {
                        // Its process ended (the OS says so, not a heartbeat; not merely
                        // killed, whose last push may still be running): nothing will
                        // write those pieces any more.
                        shared.fail_with(true, 0, reason);
                        active.in_flight -= active.assists;
                        self.outstanding -= active.assists;
                        active.assists = 0;
                    }
                }
            }
            if shared.canceled.load(Ordering::Relaxed) || shared.failed.lock().is_some() {
                active.stop_issuing();
            }
            // Pieces the peer refused to push: read them through the provider.
            while let Some(&index) = active.redo.last() {
                if self.outstanding >= MAX_OUTSTANDING {
                    break 'jobs;
                }
                // SAFETY: as for every provider operation below.
                match unsafe { post(&self.rail.ep, &active.job, &active.job.ops[index], id) } {
                    Ok(()) => {
                        active.redo.pop();
                        active.in_flight += 1;
                        self.outstanding += 1;
                        issued_any = true;
                    }
                    Err(fabric::Error::WouldBlock { .. }) => break 'jobs,
                    Err(e) => {
                        shared.fail(&e);
                        active.stop_issuing();
                    }
                }
            }
            while active.next < active.job.ops.len() {
                if self.outstanding >= MAX_OUTSTANDING {
                    break 'jobs;
                }
                let op = &active.job.ops[active.next];
                if op.copier == Copier::Peer {
                    // Asked of the peer, which pushes it into this memory (see `assist`);
                    // where this process cannot tell who it is, or the peer refused an
                    // earlier request, the provider reads it.
                    let asks = shared.peer.cma.as_ref().is_some_and(|cma| cma.assists());
                    let request = self.me.filter(|_| asks).map(|requester| {
                        assist::Request {
                            job: id,
                            op: active.next as u32,
                            requester,
                            src: op.remote_addr,
                            key: op.key,
                            dst: op.local,
                            len: op.len as u64,
                            reply_to: self.name.clone(),
                        }
                        .encode()
                    });
                    // Sealed for the peer, which acts only on what its key proves.
                    let request = request.map(|r| active.job.peer.sealer.seal_control(&r));
                    let sent = match request {
                        Some(r) if r.len() <= self.rail.inject_size => {
                            self.rail.ep.inject(&r, op.dest).map(|()| true)
                        }
                        _ => Ok(false),
                    };
                    match sent {
                        Ok(true) => {
                            active.in_flight += 1;
                            active.assists += 1;
                            self.outstanding += 1;
                        }
                        Ok(false) => active.redo.push(active.next),
                        Err(fabric::Error::WouldBlock { .. }) => break 'jobs,
                        Err(e) => {
                            shared.fail(&e);
                            active.stop_issuing();
                            continue;
                        }
                    }
                    active.next += 1;
                    issued_any = true;
                    continue;
                }
                if op.copier == Copier::ThisProcess {
                    // Copied here and now, while the peer copies the piece beside it.
                    let write = active.job.op == XferOp::Write;
                    let copied = match &shared.peer.cma {
                        // SAFETY: as for the provider's operations below: the range lies
                        // in a registration the prepared request keeps alive, and the
                        // request owns it (nothing else writes it) while it runs.
                        Some(cma) if write => unsafe { cma.push(op.local, op.len, op.remote_addr) },
                        // SAFETY: as above.
                        Some(cma) => unsafe { cma.pull(op.local, op.len, op.remote_addr) },
                        None => Err(CopyError::unroutable()),
                    };
                    issued_any = true;
                    active.next += 1;
                    match copied {
                        Ok(()) => {
                            let counter = if write {
                                &self.common.pushed_bytes
                            } else {
                                &self.common.pulled_bytes
                            };
                            counter.fetch_add(op.len as u64, Ordering::Relaxed);
                            shared.unit_done(&self.rails[0], &active.job.peer)
                        }
                        Err(e) => {
                            shared.fail_with(e.disconnect, e.errno, e.text);
                            active.stop_issuing();
                        }
                    }
                    continue;
                }
                // SAFETY: the agent checked every range against registrations that the
                // prepared request keeps alive; `Agent::register_mem`'s contract keeps the
                // memory valid until the request is dropped, and this worker holds the
                // job (and its memory regions) until the completion is read.
                let posted = unsafe { post(&self.rail.ep, &active.job, op, id) };
                match posted {
                    Ok(()) => {
                        active.next += 1;
                        active.in_flight += 1;
                        self.outstanding += 1;
                        issued_any = true;
                    }
                    Err(fabric::Error::WouldBlock { .. }) => break 'jobs,
                    Err(e) => {
                        shared.fail(&e);
                        active.stop_issuing();
                    }
                }
            }
            if let Some((dest, message)) = active.job.notif.take() {
                // A same-host peer's lane, where it offered one (its notifications then
                // skip the rail's queue, shared with anyone who reaches it).
                if message.starts_with(notif_mac::SEALED_MAGIC) {
                    match active.job.peer.send_by_lane(&message) {
                        Some(Ok(())) => {
                            shared.notif_pending.store(false, Ordering::Release);
                            issued_any = true;
                            continue;
                        }
                        Some(Err(fabric::Error::WouldBlock { .. })) => {
                            // The peer is behind: this job's notification waits its turn.
                            active.job.notif = Some((dest, message));
                            continue;
                        }
                        Some(Err(e)) => {
                            shared.fail(&e);
                            issued_any = true;
                            continue;
                        }
                        None => {}
                    }
                }
                match send_message(&self.rail, dest, &message, id | NOTIF_CONTEXT) {
                    Ok(None) => shared.notif_pending.store(false, Ordering::Release),
                    Ok(Some(buf)) => active.notif_in_flight = Some(buf),
                    Err(fabric::Error::WouldBlock { .. }) => {
                        active.job.notif = Some((dest, message))
                    }
                    Err(e) => shared.fail(&e),
                }
                issued_any = true;
            }
        }
        self.retire();
        issued_any
    }

    fn retire(&mut self) {
        let jobs = &mut self.jobs;
        self.order.retain(|id| {
            let finished = jobs.get(id).is_none_or(|a| {
                a.next >= a.job.ops.len()
                    && a.in_flight == 0
                    && a.redo.is_empty()
                    && a.job.notif.is_none()
                    && a.notif_in_flight.is_none()
            });
            if finished {
                jobs.remove(id);
            }
            !finished
        });
    }

    fn poll(&mut self, completions: &mut [Completion]) -> bool {
        match self.rail.cq.read(completions) {
            Ok(0) => false,
            Ok(n) => {
                peer_copy::trace::mark_received();
                for &c in &completions[..n] {
                    self.complete(c.context, Ok(c));
                }
                self.retire();
                true
            }
            Err(fabric::Error::WouldBlock { .. }) => false,
            Err(e) => {
                let context = match &e {
                    fabric::Error::Completion(ce) => Some(ce.context),
                    fabric::Error::RemoteDisconnect {
                        completion: Some(ce),
                        ..
                    } => Some(ce.context),
                    _ => None,
                };
                match context {
                    Some(ctx) => self.complete(ctx, Err(e)),
                    None => {
                        tracing::warn!(rail = self.index, error = %e, "completion queue read failed")
                    }
                }
                self.retire();
                true
            }
        }
    }

    fn complete(&mut self, context: u64, result: std::result::Result<Completion, fabric::Error>) {
        if let Ok(c) = &result {
            if c.has(Caps::REMOTE_CQ_DATA.bits()) && c.has(Caps::REMOTE_WRITE.bits()) {
                if c.data & staging::FETCH_DATA != 0 {
                    // Not attributed: no provider's word about its writer is trusted, a
                    // FETCH ends only on its target's sealed FETCHED
                    // (`StageNet::fetch_answered`).
                    let sender = self.stage_sender(c.src, false, false);
                    self.common
                        .stager
                        .fetch_data(c.data & !staging::FETCH_DATA, &sender);
                } else {
                    self.data_arrived(c.data, c.src);
                }
                if context & RECV_CONTEXT != 0 {
                    self.repost((context & 0xffff) as usize);
                }
                return;
            }
        }
        if context & STAGE_CONTEXT != 0 && context & RECV_CONTEXT == 0 {
            let result = result.map(drop).map_err(|e| failure_of(&e));
            self.common.stager.complete(context, result);
            return;
        }
        if context & RECV_CONTEXT != 0 {
            let slot = (context & 0xffff) as usize;
            match result {
                Ok(c) => {
                    let mut message = std::mem::take(&mut self.message);
                    message.clear();
                    let at = slot * NOTIF_SLOT;
                    message.extend_from_slice(
                        &self.recv_buf.as_slice()[at..at + c.len.min(NOTIF_SLOT)],
                    );
                    // Posted again before the message is judged: under a flood the
                    // provider finds a posted receive for what comes next rather than
                    // keeping it in bounce buffers of its own (`ofi_rxm`: without bound).
                    self.repost(slot);
                    self.handle_message(&message, c.src);
                    self.message = message;
                }
                Err(e) => {
                    if !self.common.stop.load(Ordering::Relaxed) {
                        tracing::warn!(error = %e, "notification receive failed");
                    }
                    self.repost(slot);
                }
            }
            return;
        }
        let id = context & !NOTIF_CONTEXT;
        let Some(active) = self.jobs.get_mut(&id) else {
            tracing::debug!(context, "completion for an unknown job");
            return;
        };
        let shared = active.job.shared.clone();
        let peer = active.job.peer.clone();
        if let Err(e) = &result {
            shared.fail(e);
        }
        if context & NOTIF_CONTEXT != 0 {
            active.notif_in_flight = None;
            shared.notif_pending.store(false, Ordering::Release);
            return;
        }
        active.in_flight -= 1;
        self.outstanding -= 1;
        if result.is_ok() {
            // The last data operation lets a READ's notification go.
            shared.unit_done(&self.rails[0], &peer);
        }
    }

    fn repost(&self, slot: usize) {
        if let Err(e) = self.post_recv(slot) {
            tracing::warn!(rail = self.index, error = %e, "re-posting a notification receive failed");
        }
    }

    /// A message from `src` (the sender's handle, where the transport named it). Judged
    /// in place: nothing is allocated for a message that is refused.
    fn handle_message(&mut self, bytes: &[u8], src: Option<Address>) {
        if bytes.starts_with(notif_mac::CONTROL_MAGIC) {
            let Some(frame) = ControlFrame::split(bytes) else {
                return self.drop_malformed("sealed control message", &"truncated seal");
            };
            if let Some(proof) = self.prove_control(&frame, src) {
                self.control(frame.sealed.inner, proof, src);
            }
            return;
        }
        if is_control(bytes) {
            // Unsealed: never a loaded peer's (its control messages are all sealed).
            if let Some(s) = self.attribute(src) {
                if !self.common.sources.loaded_process_ended(&s.peer.agent) {
                    return self.refuse_control(format_args!(
                        "an unsealed control message from `{}`'s endpoint",
                        s.peer.agent
                    ));
                }
            }
            return self.control(bytes, Proof::Unsealed, src);
        }
        // A sealed notification ([`notif_mac`]) carries a plain one inside.
        let sealed = if bytes.starts_with(notif_mac::SEALED_MAGIC) {
            match Sealed::split(bytes) {
                Some(frame) => Some(frame),
                None => return self.drop_malformed("sealed notification", &"truncated seal"),
            }
        } else {
            None
        };
        let plain = sealed.map_or(bytes, |frame| frame.inner);
        match NotifView::parse(plain) {
            Some(notif) => self.notification(src, sealed.as_ref(), &notif),
            None => self.drop_malformed("notification", &"malformed notification"),
        }
    }

    /// Who sealed a control frame, or `None` (counted, logged) where it proves nothing:
    /// a frame naming a loaded peer (whose process has not ended) opens under that
    /// peer's key only; one naming anyone else under the channel key it carries
    /// ([`notif_mac::Channels`]), and then it may not come from a live loaded peer's
    /// endpoint (that peer sends under its own name).
    fn prove_control(&mut self, frame: &ControlFrame<'_>, src: Option<Address>) -> Option<Proof> {
        let Ok(name) = std::str::from_utf8(frame.sender) else {
            self.refuse_control(format_args!("a control message naming no valid agent"));
            return None;
        };
        let sources = &self.common.sources;
        let live =
            |agent: &str| sources.peer(agent).is_some() && !sources.loaded_process_ended(agent);
        if live(name) {
            let peer = sources.peer(name)?;
            let proof = match peer.opener() {
                Some(opener) => opener.open(&frame.sealed),
                None => Err(notif_mac::Refusal::BadTag),
            };
            return match proof {
                Ok(()) => Some(Proof::Peer(peer)),
                Err(why) => {
                    self.refuse_control(format_args!(
                        "a control message naming `{name}` is not its own: {why}"
                    ));
                    None
                }
            };
        }
        let channel = match self.common.channels.open(frame, live) {
            Ok(channel) => channel,
            Err(why) => {
                self.refuse_control(format_args!(
                    "a control message naming `{name}` (not loaded) does not open under the \
                     key it carries: {why}"
                ));
                return None;
            }
        };
        if self.rail.names_senders {
            if let Some(s) = self.attribute(src) {
                if s.peer.agent != name && !self.common.sources.loaded_process_ended(&s.peer.agent)
                {
                    self.refuse_control(format_args!(
                        "a control message from `{}`'s endpoint names `{name}`",
                        s.peer.agent
                    ));
                    return None;
                }
            }
        }
        Some(Proof::Channel(channel.sealer.clone()))
    }

    /// A control message (plain `inner`) whose sender `proof` says who it is.
    fn control(&mut self, inner: &[u8], proof: Proof, src: Option<Address>) {
        if inner.starts_with(staging::MAGIC) {
            let sender = self.control_sender(&proof, src);
            self.common.stager.message(self.index, &sender, inner);
        } else if inner.starts_with(peer_copy::MAGIC) {
            match peer_copy::decode(inner) {
                Ok(peer_copy::Message::Request(request)) => {
                    self.serve_peer_copy(&request, &proof, src)
                }
                Ok(peer_copy::Message::Done(done)) => self.peer_copy_done(done, &proof),
                Ok(peer_copy::Message::Lane(fd)) => self.take_lane(fd, &proof),
                // Its arrival woke this worker, which reads its lanes each round.
                Ok(peer_copy::Message::Doorbell) => {}
                Err(e) => self.drop_malformed("direct copy message", &e),
            }
        } else if inner.starts_with(assist::MAGIC) {
            match assist::decode(inner) {
                Ok(assist::Message::Request(request)) => self.serve_assist(&request, &proof, src),
                Ok(assist::Message::Done(done)) => self.assist_done(done, &proof),
                Err(e) => self.drop_malformed("READ assist message", &e),
            }
        } else {
            self.drop_malformed("sealed control message", &"no control message inside");
        }
    }

    /// The sender of a control message, for the staging engine and the answers.
    fn control_sender(&self, proof: &Proof, src: Option<Address>) -> FabSender {
        match proof {
            Proof::Peer(peer) => FabSender {
                message: true,
                proven: Some(peer.clone()),
                channel: None,
                named: self.rail.names_senders,
                endpoint: None,
                maybe_self: false,
                peer: Some(peer.clone()),
            },
            Proof::Channel(sealer) => FabSender {
                channel: Some(sealer.clone()),
                ..self.stage_sender(src, self.rail.names_senders, true)
            },
            Proof::Unsealed => self.stage_sender(src, self.rail.names_senders, true),
        }
    }

    /// Counts and logs a control message dropped for its seal (never acted upon).
    fn refuse_control(&self, why: std::fmt::Arguments<'_>) {
        let n = self
            .common
            .unproven_controls
            .fetch_add(1, Ordering::Relaxed);
        // The first, then one in 1024: a flood must not flood the log.
        if n.is_multiple_of(1024) {
            tracing::warn!(
                rail = self.index,
                dropped = n + 1,
                "control message dropped: {why}"
            );
        }
    }

    /// Counts and logs (the first, then one in 1024) a message that did not decode.
    fn drop_malformed(&self, what: &str, error: &dyn std::fmt::Display) {
        let n = self.common.malformed.fetch_add(1, Ordering::Relaxed);
        // The first, then one in 1024: a flood must not flood the log.
        if n.is_multiple_of(1024) {
            tracing::warn!(
                rail = self.index,
                dropped = n + 1,
                error = %error,
                "malformed {what} dropped (one in 1024 is logged)"
            );
        }
    }
}

/// Who sent what (module `sources`): notifications and their data.
impl Worker {
    /// The sender of a staging arrival from `src`, for the staging engine; `named`:
    /// whether this rail's provider names senders of that kind of arrival.
    fn stage_sender(&self, src: Option<Address>, named: bool, message: bool) -> FabSender {
        if !named {
            return FabSender {
                message,
                proven: None,
                channel: None,
                named,
                endpoint: None,
                maybe_self: false,
                peer: None,
            };
        }
        let maybe_self = src.is_some_and(|a| self.rail.is_unattributable(a));
        let endpoint = src
            .filter(|_| !maybe_self)
            .and_then(|a| self.rail.av.lookup(a).ok());
        let peer = endpoint
            .as_ref()
            .and_then(|name| self.common.sources.find(self.index, name))
            .map(|s| s.peer.clone());
        FabSender {
            message,
            proven: None,
            channel: None,
            named,
            endpoint,
            maybe_self,
            peer,
        }
    }

    /// The loaded peer whose endpoint sent a completion, as the transport names it.
    fn attribute(&mut self, src: Option<Address>) -> Option<Arc<Source>> {
        let addr = src.filter(|a| !self.rail.is_unattributable(*a))?;
        let generation = self.common.sources.generation();
        if generation != self.sources_generation {
            self.sources_seen.clear();
            self.sources_generation = generation;
        }
        if let Some(seen) = self.sources_seen.get(&addr) {
            return seen.clone();
        }
        let found = self
            .rail
            .av
            .lookup(addr)
            .ok()
            .and_then(|name| self.common.sources.find(self.index, &name));
        if self.sources_seen.len() >= MAX_SOURCES_SEEN {
            self.sources_seen.clear();
        }
        self.sources_seen.insert(addr, found.clone());
        found
    }

    /// A notification message naming `sender` arrived from `src`, `sealed` where it
    /// came in a seal ([`notif_mac`]).
    fn notification(
        &mut self,
        src: Option<Address>,
        sealed: Option<&Sealed<'_>>,
        notif: &NotifView<'_>,
    ) {
        let NotifView {
            key,
            expected,
            sender,
            msg,
        } = *notif;
        // A notification naming a loaded peer proves itself with the pair's key: then it
        // is that peer's whatever endpoint the provider names (`shm` misattributes a
        // flood); without the proof it is dropped, never attributed. Only where the
        // loaded incarnation's process ended is it judged as before: its restarted
        // successor seals under a key not loaded yet.
        if let Some(peer) = self.common.sources.peer(sender) {
            if let Some(opener) = peer.opener() {
                let proof = match sealed {
                    Some(frame) => opener.open(frame),
                    None => Err(notif_mac::Refusal::Unsealed),
                };
                match proof {
                    Ok(()) => {
                        // Where the rail cannot name senders, its data is matched by
                        // key alone: the message must be too.
                        let owner = self.rail.names_senders.then_some(peer.tag);
                        let arrival = self.common.notifs.message_from(
                            key,
                            owner,
                            expected,
                            sender.to_string(),
                            msg.to_vec(),
                        );
                        self.note_arrival(arrival);
                        // A same-host peer's next ones skip this rail's queue (shared
                        // with anyone who can reach it): a lane of their own.
                        if peer.served_lane.get().is_none() {
                            if let Some(s) =
                                self.attribute(src).filter(|s| Arc::ptr_eq(&s.peer, &peer))
                            {
                                self.offer_lane(&s);
                            }
                        }
                        return;
                    }
                    Err(why) if !self.common.sources.loaded_process_ended(sender) => {
                        self.common.unproven_notifs.fetch_add(1, Ordering::Relaxed);
                        return self.refuse_notif(format_args!(
                            "a notification naming `{sender}` is not its own: {why}"
                        ));
                    }
                    Err(_) => {}
                }
            }
        }
        let owner = if !self.rail.names_senders {
            // This provider cannot tell (no `FI_SOURCE`): the message's word.
            None
        } else {
            match self.attribute(src) {
                Some(s) if s.peer.agent == sender => Some(s.peer.tag),
                Some(s) => {
                    return self.refuse_notif(format_args!(
                        "a notification from `{}`'s endpoint names `{sender}`",
                        s.peer.agent
                    ))
                }
                None if self.common.loaded_senders_only => {
                    return self.refuse_notif(format_args!(
                        "a notification naming `{sender}` comes from an endpoint of no loaded \
                         peer (notif_senders=loaded)"
                    ))
                }
                // A loaded peer's name from another endpoint is refused while the
                // loaded incarnation lives; once its process ended, the name is free
                // (its restarted incarnation's notifications must not be lost until
                // this side reloads it).
                None if sender == self.common.agent_name
                    || (self.common.sources.is_loaded(sender)
                        && !self.common.sources.loaded_process_ended(sender)) =>
                {
                    return self.refuse_notif(format_args!(
                        "a notification naming `{sender}` comes from none of its endpoints"
                    ))
                }
                None => Some(STRANGER),
            }
        };
        let arrival =
            self.common
                .notifs
                .message_from(key, owner, expected, sender.to_string(), msg.to_vec());
        self.note_arrival(arrival);
    }

    /// Remote CQ data `key` (a notified WRITE's) arrived from `src`.
    fn data_arrived(&mut self, key: u64, src: Option<Address>) {
        let from = if !self.rail.names_data_senders {
            // Matched by its key alone, which only the sender and this side know.
            None
        } else {
            match self.attribute(src) {
                Some(s) => Some(s.peer.tag),
                None if self.common.loaded_senders_only => {
                    return self.refuse_notif(format_args!(
                        "remote CQ data from an endpoint of no loaded peer \
                         (notif_senders=loaded)"
                    ))
                }
                None => Some(STRANGER),
            }
        };
        let arrival = self.common.notifs.data_from(key, from);
        self.note_arrival(arrival);
    }

    /// Counts and logs a notification arrival refused for who sent it.
    fn refuse_notif(&self, why: std::fmt::Arguments<'_>) {
        let n = self.common.refused_notifs.fetch_add(1, Ordering::Relaxed);
        // The first, then one in 1024: a flood must not flood the log.
        if n.is_multiple_of(1024) {
            tracing::warn!(rail = self.index, refused = n + 1, "dropped: {why}");
        }
    }

    /// Logs an arrival the notification bookkeeping dropped (it counts them).
    fn note_arrival(&self, arrival: Arrival) {
        if let Arrival::Refused(why) = arrival {
            let n = self.common.notifs.refused();
            if n % 1024 == 1 {
                tracing::warn!(
                    rail = self.index,
                    refused = n,
                    "notification dropped: {why}"
                );
            }
        }
    }
}

/// READ assists (see `assist`): serving a peer's requests, and their answers.
impl Worker {
    /// Pushes a requested piece of a READ into the peer that sealed the request (or
    /// refuses: see the `assist` module's trust model) and answers it, sealed.
    fn serve_assist(&mut self, request: &assist::Request, proof: &Proof, src: Option<Address>) {
        let (errno, answer_to) = match (&self.common.assist, proof) {
            (None, _) => (libc::EOPNOTSUPP, None),
            (Some(server), Proof::Peer(peer)) => {
                match self.common.sources.find(self.index, &request.reply_to) {
                    Some(s) if Arc::ptr_eq(&s.peer, peer) => (
                        server.serve(self.index, request, &s.peer),
                        Some(s.reply.clone()),
                    ),
                    _ => (
                        server.refuse(
                            libc::EPERM,
                            format_args!("it names none of its sender's endpoints on this rail"),
                        ),
                        None,
                    ),
                }
            }
            (Some(server), _) => (
                server.refuse(
                    libc::EPERM,
                    format_args!(
                        "no loaded peer sealed it (a target serves the initiators whose \
                         metadata it loaded)"
                    ),
                ),
                None,
            ),
        };
        let done = assist::Done {
            job: request.job,
            op: request.op,
            errno,
        };
        let sender = self.control_sender(proof, src);
        self.answer(
            answer_to,
            &sender,
            &request.reply_to,
            done.encode(),
            "a READ assist's",
        );
    }

    /// Queues `message`, a request's answer: to the sealing peer's endpoint the request
    /// names (`answer_to`, where it was proven), else — a refusal for no one in
    /// particular, so that an initiator this side did not load stops asking — where the
    /// request says (`reply_to`) as the staging engine resolves a requester (never toward
    /// a loaded peer's endpoint that did not send it). Sealed where the address has a key
    /// (a loaded peer's, or the channel the request came under).
    fn answer(
        &mut self,
        answer_to: Option<FabAddr>,
        sender: &FabSender,
        reply_to: &[u8],
        message: Vec<u8>,
        what: &str,
    ) {
        // A refusal for a requester no seal proved: a flood of requests whose senders do
        // not take their answers must not grow the queue without bound.
        if answer_to.is_none() && self.replies.len() >= MAX_QUEUED_REFUSALS {
            self.dropped_refusals += 1;
            if self.dropped_refusals % 1024 == 1 {
                tracing::warn!(
                    rail = self.index,
                    dropped = self.dropped_refusals,
                    "{what} refusal not sent: {MAX_QUEUED_REFUSALS} answers wait already"
                );
            }
            return;
        }
        let dest = match answer_to {
            Some(dest) => Ok(dest),
            None => self.common.stager.net.resolve(self.index, reply_to, sender),
        };
        match dest {
            Ok(dest) => {
                self.replies.push_back((dest, message));
                if !self.replies_blocked {
                    self.send_replies();
                }
            }
            Err(f) => tracing::warn!(
                error = %f.text,
                "{what} requester cannot be answered (its transfer will stall)"
            ),
        }
    }

    /// Sends queued answers while the endpoint takes them; whether any went.
    fn send_replies(&mut self) -> bool {
        let mut sent = false;
        while let Some((dest, message)) = self.replies.front() {
            // Sealed as it goes (each attempt takes a fresh sequence number: one that
            // waited behind a busy endpoint never falls behind the peer's window).
            let sealed = dest.seal(message);
            match self.rail.ep.inject(&sealed, dest.address()) {
                Ok(()) => sent = true,
                Err(fabric::Error::WouldBlock { .. }) => {
                    self.replies_blocked = true;
                    break;
                }
                Err(e) => tracing::warn!(error = %e, "a READ assist's answer was not sent"),
            }
            self.replies.pop_front();
        }
        sent
    }

    /// An answer to an assist request of one of this rail's jobs.
    fn assist_done(&mut self, done: assist::Done, proof: &Proof) {
        let Some(active) = self.jobs.get_mut(&done.job) else {
            tracing::debug!(job = done.job, "READ assist answer for a finished job");
            return;
        };
        // Only the job's peer may say that a piece is in place (or that it refuses): the
        // answer must be sealed by the key the request went under.
        let from_peer = match proof {
            Proof::Peer(peer) => peer
                .sealer()
                .is_some_and(|s| Arc::ptr_eq(s, &active.job.peer.sealer)),
            _ => false,
        };
        if !from_peer {
            self.foreign_answers += 1;
            if self.foreign_answers % 1024 == 1 {
                tracing::warn!(
                    job = done.job,
                    dropped = self.foreign_answers,
                    "READ assist answer not sealed by the job's peer dropped"
                );
            }
            return;
        }
        let op = match active.job.ops.get(done.op as usize) {
            Some(op) if op.copier == Copier::Peer && active.assists > 0 => op,
            _ => {
                tracing::warn!(
                    job = done.job,
                    op = done.op,
                    "unexpected READ assist answer"
                );
                return;
            }
        };
        active.assists -= 1;
        active.in_flight -= 1;
        self.outstanding -= 1;
        let shared = &active.job.shared;
        match done.errno {
            0 => {
                self.common
                    .assisted_bytes
                    .fetch_add(op.len as u64, Ordering::Relaxed);
                shared.unit_done(&self.rails[0], &active.job.peer);
            }
            e if assist::is_refusal(e) => {
                if let Some(cma) = &shared.peer.cma {
                    cma.refuse_assists();
                }
                active.redo.push(done.op as usize);
            }
            e if assist::is_declined(e) => active.redo.push(done.op as usize),
            e => shared.fail_with(false, e, assist::describe(e, op.len)),
        }
    }
}

/// Issues one provider operation of `job` on `ep`.
///
/// # Safety
/// `op`'s local range must lie in a registration of `job` whose memory stays valid until
/// the operation's completion is read (the agent's checks and `Agent::register_mem`'s
/// contract; the worker holds the job until then).
unsafe fn post(
    ep: &fabric::Endpoint,
    job: &RailJob,
    op: &RailOp,
    context: u64,
) -> std::result::Result<(), fabric::Error> {
    // SAFETY: the caller vouches for the local range; the provider checks the remote one
    // against the peer's registration key.
    unsafe {
        match (job.op, job.imm) {
            (XferOp::Write, Some(imm)) => ep.writedata_raw(
                op.local as *const u8,
                op.len,
                Some(&job.mrs[op.mr as usize]),
                imm,
                op.dest,
                op.remote_addr,
                op.key,
                context,
            ),
            // Without a notification the initiator's DONE is the only
            // sign the data is there: ask for delivery, not just for the
            // bytes to have left (tcp;ofi_rxm completed writes before the
            // target had them; measured by the Python suite's
            // test_write_done_means_data_is_at_target).
            (XferOp::Write, None) => ep.writemsg_raw(
                op.local as *const u8,
                op.len,
                Some(&job.mrs[op.mr as usize]),
                op.dest,
                op.remote_addr,
                op.key,
                context,
                fabric::ffi::FI_COMPLETION | fabric::ffi::FI_DELIVERY_COMPLETE,
            ),
            (XferOp::Read, _) => ep.read_raw(
                op.local as *mut u8,
                op.len,
                Some(&job.mrs[op.mr as usize]),
                op.dest,
                op.remote_addr,
                op.key,
                context,
            ),
        }
    }
}
