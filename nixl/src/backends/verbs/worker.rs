//! The rail worker: a rail's jobs issued in chains within its window, its completion
//! queue read, incoming immediates and notification messages counted — driven by the
//! rail's thread and, inline, by any thread that posts or polls.

use super::stage_net::{failure_of, VerbsSender};
use super::wire::decode_notif;
use super::xfer::{Failure, RailJob};
use super::{
    verbs_error, Common, Rail, BATCH, MAX_OUTSTANDING, NOTIF_SLOT, RECV_SLOTS, RECV_WR, SEND_SLOTS,
    SLEEP_MS, SPIN_BEFORE_SLEEP, STAGE_WR,
};
use crate::backend::XferOp;
use crate::backends::staging;
use crate::error::Result;
use ibverbs::{
    AccessFlags, MemoryRegion, ProtectionDomain, RecvWr, RemoteMemory, SendWr, Sge,
    SharedReceiveQueue, WcOpcode, WorkCompletion,
};
use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug)]
struct ActiveJob {
    job: RailJob,
    next: usize,
    in_flight: usize,
    notif_in_flight: bool,
}

#[derive(Debug, Clone, Copy)]
enum BatchKind {
    Data,
    Notif(usize),
}

/// One `ibv_post_send` chain: every request carries the batch's id as `wr_id`, only the
/// last is signaled; the first completion seen for the id (the signaled one, or an error
/// or flush of any of them) accounts for the whole chain.
#[derive(Debug, Clone, Copy)]
struct Batch {
    job: u64,
    n: usize,
    kind: BatchKind,
}

/// What a rail has in flight, behind the rail's lock: driven by the rail's worker
/// thread and, inline, by any thread that posts or polls a transfer.
pub(super) struct RailState {
    jobs: HashMap<u64, ActiveJob>,
    order: VecDeque<u64>,
    batches: HashMap<u64, Batch>,
    next_id: u64,
    next_batch: u64,
    outstanding: usize,
    recv_mr: MemoryRegion,
    send_mr: MemoryRegion,
    free_send: Vec<usize>,
    wcs: Vec<WorkCompletion>,
}

impl std::fmt::Debug for RailState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailState")
            .field("jobs", &self.jobs.len())
            .field("outstanding", &self.outstanding)
            .finish_non_exhaustive()
    }
}

impl RailState {
    pub(super) fn new(pd: &ProtectionDomain, srq: &SharedReceiveQueue) -> Result<Self> {
        let recv_mr = pd
            .reg_mr(RECV_SLOTS * NOTIF_SLOT, AccessFlags::LOCAL_WRITE)
            .map_err(|e| verbs_error("registering receive buffers", e))?;
        let send_mr = pd
            .reg_mr(SEND_SLOTS * NOTIF_SLOT, AccessFlags::LOCAL_WRITE)
            .map_err(|e| verbs_error("registering send buffers", e))?;
        let state = RailState {
            jobs: HashMap::new(),
            order: VecDeque::new(),
            batches: HashMap::new(),
            next_id: 1,
            next_batch: 1,
            outstanding: 0,
            recv_mr,
            send_mr,
            free_send: (0..SEND_SLOTS).rev().collect(),
            wcs: vec![WorkCompletion::default(); 64],
        };
        for slot in 0..RECV_SLOTS {
            state
                .post_recv(srq, slot)
                .map_err(|e| verbs_error("ibv_post_srq_recv", e))?;
        }
        Ok(state)
    }

    fn post_recv(&self, srq: &SharedReceiveQueue, slot: usize) -> ibverbs::Result<()> {
        let sge = [self.recv_mr.sge(slot * NOTIF_SLOT..(slot + 1) * NOTIF_SLOT)];
        srq.post_recv(&mut [RecvWr::new(RECV_WR | slot as u64, &sge)])
    }

    /// One round: take queued jobs, issue (at most `chains` chains), read completions.
    pub(super) fn round(&mut self, rail: &Rail, common: &Common, chains: usize) -> bool {
        let mut busy = self.accept_jobs(rail);
        busy |= self.issue(rail, chains);
        // Read before the CQ: the connections closed up to this ticket are in ERR, and
        // what they received is in the CQ already (see `Common::rail_drained`).
        let closing = common.closing_ticket();
        let (polled, emptied) = self.poll(rail, common);
        busy |= polled;
        if let (Some(ticket), true) = (closing, emptied) {
            common.rail_drained(rail.index, ticket);
        }
        // Staging copies are polled, not waited for (one relaxed load when idle).
        if common.stager.wants_poll() {
            common.stager.try_progress();
            busy = true;
        }
        busy
    }

    /// Whether a job has operations or a message not yet posted.
    pub(super) fn unissued(&self) -> bool {
        self.jobs
            .values()
            .any(|a| a.next < a.job.ops.len() || a.job.notif.is_some())
    }

    fn accept_jobs(&mut self, rail: &Rail) -> bool {
        let mut submit = rail.submit.lock();
        if submit.is_empty() {
            return false;
        }
        for job in submit.drain(..) {
            let id = self.next_id;
            self.next_id += 1;
            self.jobs.insert(
                id,
                ActiveJob {
                    job,
                    next: 0,
                    in_flight: 0,
                    notif_in_flight: false,
                },
            );
            self.order.push_back(id);
        }
        true
    }

    /// Issues operations of the jobs in arrival order, as far as the window allows
    /// (and at most `chains` chains).
    fn issue(&mut self, rail: &Rail, mut chains: usize) -> bool {
        let mut issued_any = false;
        'jobs: for i in 0..self.order.len() {
            let id = self.order[i];
            let Some(active) = self.jobs.get_mut(&id) else {
                continue;
            };
            let shared = active.job.shared.clone();
            let conn = active.job.conn.clone();
            let len = active.job.ops.len();
            if shared.canceled.load(Ordering::Relaxed) || shared.failed.lock().is_some() {
                active.next = len;
                active.job.notif = None;
            } else if let Some(reason) = conn.dead_reason() {
                shared.fail(Failure::Disconnect(reason));
                active.next = len;
                active.job.notif = None;
            }
            let qp = &conn.qps[rail.index];
            while active.next < len {
                let room = MAX_OUTSTANDING - self.outstanding;
                if room == 0 || chains == 0 {
                    break 'jobs;
                }
                chains -= 1;
                let n = BATCH.min(room).min(len - active.next);
                let batch = self.next_batch;
                self.next_batch += 1;
                let ops = &active.job.ops[active.next..active.next + n];
                let ends_job = active.next + n == len;
                let sges: Vec<Sge<'_>> = ops
                    .iter()
                    // SAFETY: the agent checked every range against registrations; this
                    // job holds those memory regions (and `Agent::register_mem`'s
                    // contract keeps the memory valid) until the batch's completion is
                    // read, which is before the job retires.
                    .map(|op| unsafe { Sge::from_raw(op.local, op.len, op.lkey) })
                    .collect();
                let mut wrs: Vec<SendWr<'_>> = ops
                    .iter()
                    .enumerate()
                    .map(|(k, op)| {
                        let sg = &sges[k..k + 1];
                        let remote = RemoteMemory {
                            addr: op.remote,
                            len: u64::from(op.len),
                            rkey: op.rkey,
                        };
                        let last = k + 1 == n;
                        let wr = match (active.job.op, active.job.imm) {
                            (XferOp::Write, Some(imm)) if last && ends_job => {
                                SendWr::write_with_imm(batch, sg, remote, imm)
                            }
                            (XferOp::Write, _) => SendWr::write(batch, sg, remote),
                            (XferOp::Read, _) => SendWr::read(batch, sg, remote),
                        };
                        if last {
                            wr.signaled()
                        } else {
                            wr
                        }
                    })
                    .collect();
                match qp.post_send(&mut wrs) {
                    Ok(()) => {
                        self.batches.insert(
                            batch,
                            Batch {
                                job: id,
                                n,
                                kind: BatchKind::Data,
                            },
                        );
                        active.next += n;
                        active.in_flight += n;
                        self.outstanding += n;
                        issued_any = true;
                    }
                    Err(e) => {
                        // The window keeps the send queue from filling, so this is a
                        // broken QP: stop using the connection. A prefix of the chain
                        // may have been posted unsignaled; moving the QP to ERR stops it.
                        conn.kill(&format!("posting failed: {e}"));
                        shared.fail(post_failure(&e));
                        active.next = len;
                        active.job.notif = None;
                    }
                }
            }
            if active.next >= len && active.job.notif.is_some() {
                if self.outstanding >= MAX_OUTSTANDING {
                    break 'jobs;
                }
                let Some(slot) = self.free_send.pop() else {
                    break 'jobs;
                };
                let message = active.job.notif.take().expect("checked above");
                let range = slot * NOTIF_SLOT..slot * NOTIF_SLOT + message.len();
                self.send_mr.as_mut_slice()[range.clone()].copy_from_slice(&message);
                let batch = self.next_batch;
                self.next_batch += 1;
                let sge = [self.send_mr.sge(range)];
                match qp.post_send(&mut [SendWr::send(batch, &sge).signaled()]) {
                    Ok(()) => {
                        self.batches.insert(
                            batch,
                            Batch {
                                job: id,
                                n: 1,
                                kind: BatchKind::Notif(slot),
                            },
                        );
                        active.notif_in_flight = true;
                        self.outstanding += 1;
                    }
                    Err(e) => {
                        self.free_send.push(slot);
                        conn.kill(&format!("posting a notification failed: {e}"));
                        shared.fail(post_failure(&e));
                    }
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
                    && a.job.notif.is_none()
                    && !a.notif_in_flight
            });
            if finished {
                jobs.remove(id);
            }
            !finished
        });
    }

    /// Reads the CQ: (completions were read, the CQ read empty — fewer than asked for).
    fn poll(&mut self, rail: &Rail, common: &Common) -> (bool, bool) {
        let mut wcs = std::mem::take(&mut self.wcs);
        let asked = wcs.len();
        let (n, emptied) = match rail.cq.poll(&mut wcs) {
            Ok(done) => (done.len(), done.len() < asked),
            Err(e) => {
                tracing::warn!(rail = rail.index, error = %e, "ibv_poll_cq failed");
                (0, false)
            }
        };
        for wc in &wcs[..n] {
            if wc.wr_id() & RECV_WR != 0 {
                self.on_recv(wc, rail, common);
            } else if wc.wr_id() & STAGE_WR != 0 {
                let result = wc.result().map(drop).map_err(|e| failure_of(&e));
                common.stager.complete(rail.index, wc.wr_id(), result);
            } else {
                self.on_send(wc, common);
            }
        }
        self.wcs = wcs;
        if n == 0 {
            return (false, emptied);
        }
        self.retire();
        (true, emptied)
    }

    fn on_send(&mut self, wc: &WorkCompletion, common: &Common) {
        // Only the first completion of a chain counts (see `Batch`).
        let Some(batch) = self.batches.remove(&wc.wr_id()) else {
            return;
        };
        self.outstanding -= batch.n;
        let rails = &common.rails;
        let Some(active) = self.jobs.get_mut(&batch.job) else {
            return;
        };
        let shared = active.job.shared.clone();
        let result = wc.result();
        if let Err(e) = &result {
            let conn = &active.job.conn;
            let failure = match (conn.dead_reason(), e) {
                (Some(reason), _) => Failure::Disconnect(reason),
                (None, ibverbs::Error::RemoteDisconnect { .. }) => {
                    Failure::Disconnect(e.to_string())
                }
                (None, other) => Failure::Backend(0, other.to_string()),
            };
            // Any error completion leaves an RC QP in the error state.
            conn.kill(&format!("a work request failed: {e}"));
            shared.fail(failure);
        }
        match batch.kind {
            BatchKind::Notif(slot) => {
                self.free_send.push(slot);
                active.notif_in_flight = false;
                if result.is_ok() {
                    shared.notif_pending.store(false, Ordering::Release);
                }
            }
            BatchKind::Data => {
                active.in_flight -= batch.n;
                if result.is_ok() {
                    shared
                        .completed
                        .fetch_add(batch.n as u64, Ordering::Relaxed);
                    let conn = active.job.conn.clone();
                    shared.units_done(batch.n as u64, &rails[0], &conn);
                }
            }
        }
    }

    fn on_recv(&mut self, wc: &WorkCompletion, rail: &Rail, common: &Common) {
        let slot = (wc.wr_id() & 0xffff) as usize;
        if wc.is_success() {
            let from = common
                .incoming_qpn
                .read()
                .get(&(rail.index, wc.qp_num()))
                .cloned();
            let len = (wc.byte_len() as usize).min(NOTIF_SLOT);
            let bytes = &self.recv_mr.as_slice()[slot * NOTIF_SLOT..slot * NOTIF_SLOT + len];
            match (from, wc.opcode()) {
                (Some((id, _)), WcOpcode::RECV_RDMA_WITH_IMM) => {
                    if let Some(seq) = wc.imm_data() {
                        common.notifs.data_arrived((id, seq));
                    }
                }
                // Only a target writes into a QP this side opened: a FETCH's data.
                (None, WcOpcode::RECV_RDMA_WITH_IMM) => {
                    match (
                        common.outgoing_of_qp(rail.index, wc.qp_num()),
                        wc.imm_data(),
                    ) {
                        (Some(conn), Some(imm)) => common.stager.fetch_data(imm, &conn),
                        (None, _) => {
                            tracing::debug!(qp = wc.qp_num(), "write on an unknown QP dropped")
                        }
                        (Some(_), None) => {}
                    }
                }
                // Staging control messages come either way (requests, DONE replies), each
                // attributed to the connection whose QP it came on.
                (from, WcOpcode::RECV) if bytes.starts_with(staging::MAGIC) => {
                    let sender = match from {
                        Some((id, _)) => common.incoming_conn(id).map(VerbsSender::In),
                        None => common
                            .outgoing_of_qp(rail.index, wc.qp_num())
                            .map(VerbsSender::Out),
                    };
                    match sender {
                        Some(sender) => common.stager.message(rail.index, &sender, bytes),
                        None => tracing::debug!(
                            qp = wc.qp_num(),
                            "staging message on an unknown QP dropped"
                        ),
                    }
                }
                (Some((id, sender)), WcOpcode::RECV) => match decode_notif(bytes) {
                    Ok((seq, expected, msg)) => common.notifs.message_arrived(
                        (id, seq),
                        u64::from(expected),
                        &*sender,
                        msg.to_vec(),
                    ),
                    Err(e) => tracing::warn!(error = %e, "malformed notification dropped"),
                },
                (None, _) => {
                    tracing::debug!(qp = wc.qp_num(), "receive on an unknown QP dropped")
                }
                (Some(_), op) => tracing::debug!(?op, "unexpected receive opcode"),
            }
        } else if !common.stop.load(Ordering::Relaxed) {
            tracing::debug!(status = %wc.status(), "receive completed with an error");
        }
        if let Err(e) = self.post_recv(&rail.srq, slot) {
            tracing::warn!(rail = rail.index, error = %e, "re-posting a receive failed");
        }
    }
}

/// A rail's progress thread: rounds while there is work, a short spin, then a sleep on
/// the completion channel and the wake-up eventfd.
pub(super) fn rail_worker(rail: Arc<Rail>, common: Arc<Common>) {
    let mut last_activity = Instant::now();
    while !common.stop.load(Ordering::Relaxed) {
        let busy = rail.state.lock().round(&rail, &common, usize::MAX);
        if busy {
            last_activity = Instant::now();
        } else if last_activity.elapsed() < SPIN_BEFORE_SLEEP {
            std::hint::spin_loop();
        } else {
            rail_sleep(&rail, &common);
            last_activity = Instant::now();
        }
    }
}

/// Nothing to do: arm the CQ and block until a completion event, a new job (the
/// eventfd) or the safety timeout.
fn rail_sleep(rail: &Rail, common: &Common) {
    // Store-then-check pairs with `Rail::submit`'s push-then-load (both SeqCst): a job
    // queued from now on either is seen below or writes the eventfd.
    rail.sleeping.store(true, Ordering::SeqCst);
    let queued = !rail.submit.lock().is_empty();
    if queued || common.stop.load(Ordering::SeqCst) {
        rail.sleeping.store(false, Ordering::SeqCst);
        return;
    }
    if rail.cq.req_notify(false).is_err() {
        rail.sleeping.store(false, Ordering::SeqCst);
        std::thread::sleep(Duration::from_micros(50));
        return;
    }
    // A completion that arrived before the CQ was armed raises no event; work a poster
    // could not finish inline is picked up here too.
    {
        let mut state = rail.state.lock();
        if state.round(rail, common, usize::MAX) || state.unissued() {
            rail.sleeping.store(false, Ordering::SeqCst);
            return;
        }
    }
    let mut fds = [
        libc::pollfd {
            fd: rail.channel.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: rail.wake_fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: two valid pollfds for the duration of the call.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, SLEEP_MS) };
    rail.sleeping.store(false, Ordering::SeqCst);
    if ready > 0 {
        if fds[1].revents != 0 {
            rail.wake_fd.drain();
        }
        // Acknowledge every pending completion event (the channel is non-blocking).
        while rail.channel.get_event().is_ok() {}
    }
}

fn post_failure(e: &ibverbs::Error) -> Failure {
    Failure::Backend(e.errno().unwrap_or(0), e.to_string())
}
