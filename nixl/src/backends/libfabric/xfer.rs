//! A prepared transfer: its operations resolved per rail at prepare time, the state
//! one post shares with the rail workers, what it reports to the agent, and the
//! notification messages (encoding, sending).

use super::cma::CmaPeer;
use super::conn::DEATH_GRACE;
use super::liveness::Liveness;
use super::stage_net::{FabAddr, FabricSink, Stager};
use super::worker::{Progress, RailJob};
use super::{
    fabric_error, staging, NotifKeys, NotifTracker, PeerAddrs, PeerWatch, Plan, Rail, RunSpec,
    MAX_NOTIF_BYTES, NAME, NOTIF_MAGIC,
};
use crate::backend::{BackendXfer, PostParams, XferOp, XferProgress, XferStatus};
use crate::error::{Error, Result};
use fabric::{Access, Address, MemoryRegion, RegisteredBuffer};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One transport operation, resolved at prepare time.
#[derive(Debug, Clone)]
pub(super) struct RailOp {
    pub(super) local: u64,
    pub(super) len: usize,
    /// Index into the transfer's registration table.
    pub(super) mr: u32,
    pub(super) dest: Address,
    /// The provider's remote address, or the peer's virtual address where this process
    /// copies.
    pub(super) remote_addr: u64,
    pub(super) key: u64,
    pub(super) copier: Copier,
}

/// Who copies an operation's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Copier {
    /// The provider (`fi_writedata`, `fi_writemsg`, `fi_read`).
    Provider,
    /// This process's rail worker, by CMA: a WRITE's piece pushed into the peer, a READ's
    /// pulled from it (the `cma` module).
    ThisProcess,
    /// The peer's rail worker, on request: a READ's piece pushed into this process (the
    /// `assist` module).
    Peer,
}

/// State of one prepared transfer's current post, shared with the rail workers.
#[derive(Debug, Default)]
pub(super) struct XferShared {
    /// Data operations of the current post not yet completed.
    pub(super) pending: AtomicU64,
    /// Operations completed (stall detection watches it move).
    pub(super) completed: AtomicU64,
    /// The notification message is not yet sent.
    pub(super) notif_pending: AtomicBool,
    /// The notification to send once every operation completed: a READ's, a WRITE's
    /// with pushed pieces (which the peer cannot count as it counts the provider's), or
    /// one to this agent itself.
    pub(super) notif_after_all: Mutex<Option<AfterAll>>,
    /// First failure: (peer gone, errno, text).
    pub(super) failed: Mutex<Option<(bool, i32, String)>>,
    pub(super) canceled: AtomicBool,
    /// Staged copies touching the caller's memory still running.
    pub(super) user_copies: AtomicUsize,
    /// Jobs of this transfer a rail worker holds (accepted and not yet retired): their
    /// issued operations may still read or write the caller's memory.
    pub(super) in_workers: AtomicUsize,
    /// The peer (its name, process and heartbeats): the rail workers ask before they
    /// call into the provider for it, see [`XferShared::peer_alive`].
    pub(super) peer: PeerHealth,
}

/// A notification that goes once every operation of its transfer completed.
#[derive(Debug)]
pub(super) enum AfterAll {
    /// The encoded message, to send to the peer on rail 0.
    Send(Address, Vec<u8>),
    /// To this agent itself: delivered here, directly (module `sources`: its own
    /// endpoints are no one's to the transport).
    Deliver {
        notifs: Arc<NotifTracker<u64>>,
        sender: String,
        msg: Vec<u8>,
    },
}

/// What tells that a transfer's peer is gone: the OS (same host) and its heartbeats.
#[derive(Debug, Default)]
pub(super) struct PeerHealth {
    pub(super) agent: String,
    pub(super) liveness: Option<Arc<Liveness>>,
    pub(super) watch: Option<Arc<PeerWatch>>,
    /// The peer's process, for the pieces copied by CMA (same host).
    pub(super) cma: Option<Arc<CmaPeer>>,
}

impl XferShared {
    /// `Err(RemoteDisconnect)` once the peer's process ended (same host) or its
    /// heartbeats stopped. The rail workers ask before issuing a job's operations:
    /// libfabric 1.17's `shm` takes the peer's region spinlock for every operation, and
    /// a peer killed while holding it (its progress holds it while it reads its queue)
    /// leaves whoever writes to it next spinning forever — a rail worker, and every
    /// transfer queued behind it on that rail. Asking first keeps a peer known to be
    /// dead from being called into at all; one that dies holding the lock just before
    /// a call still wedges that rail (see the module documentation).
    pub(super) fn peer_alive(&self) -> Result<()> {
        if let Some(watch) = &self.peer.watch {
            watch.check(&self.peer.agent)?;
        }
        if let Some(liveness) = &self.peer.liveness {
            liveness.check(&self.peer.agent)?;
        }
        Ok(())
    }

    pub(super) fn fail(&self, e: &fabric::Error) {
        self.fail_with(is_disconnect(e), e.errno().unwrap_or(0), e.to_string());
    }

    pub(super) fn fail_with(&self, disconnect: bool, code: i32, text: String) {
        let mut failed = self.failed.lock();
        if failed.is_none() {
            *failed = Some((disconnect, code, text));
        }
    }

    /// One unit of the post finished (a data operation, or the whole staged part): the
    /// last one lets a READ's notification go.
    pub(super) fn unit_done(self: &Arc<Self>, rail0: &Rail, peer: &Arc<PeerAddrs>) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            let after_all = self.notif_after_all.lock().take();
            if let Some(AfterAll::Deliver {
                notifs,
                sender,
                msg,
            }) = after_all
            {
                notifs.deliver(sender, msg);
                self.notif_pending.store(false, Ordering::Release);
            } else if let Some(AfterAll::Send(dest, message)) = after_all {
                rail0.push_job(RailJob {
                    shared: self.clone(),
                    ops: Arc::new(Vec::new()),
                    mrs: Arc::from(Vec::new()),
                    op: XferOp::Read,
                    imm: None,
                    notif: Some((dest, message)),
                    peer: peer.clone(),
                });
            }
        }
    }
}

/// Whether a failed operation means the peer's process or connection is gone: the
/// fabric crate's `RemoteDisconnect`, or an operation that the provider canceled because
/// its connection went away (`tcp;ofi_rxm` flushes in-flight operations of a dead peer
/// as `FI_ECANCELED` with the socket's `ENOTCONN`/`ECONNRESET` as provider errno).
pub(super) fn is_disconnect(e: &fabric::Error) -> bool {
    const GONE: &[i32] = &[
        fabric::ffi::FI_ENOTCONN,
        fabric::ffi::FI_ECONNRESET,
        fabric::ffi::FI_ECONNREFUSED,
        fabric::ffi::FI_ECONNABORTED,
        fabric::ffi::FI_ESHUTDOWN,
        fabric::ffi::FI_EHOSTUNREACH,
        fabric::ffi::FI_ENETUNREACH,
        32, // EPIPE
    ];
    match e {
        fabric::Error::RemoteDisconnect { .. } => true,
        _ => e.completion_error().is_some_and(|c| {
            c.errno == fabric::ffi::FI_ECANCELED && GONE.contains(&c.prov_errno.abs())
        }),
    }
}

#[derive(Debug)]
pub(super) struct FabricXfer {
    /// The part of the transfer that goes through the staging pipeline.
    pub(super) staged: Option<Arc<Plan<FabAddr>>>,
    pub(super) stager: Arc<Stager>,
    pub(super) op: XferOp,
    pub(super) rail_ops: Vec<Arc<Vec<RailOp>>>,
    pub(super) mrs: Arc<[MemoryRegion]>,
    pub(super) rails: Vec<Arc<Rail>>,
    pub(super) agent: String,
    pub(super) notif_dest: Address,
    pub(super) self_name: String,
    pub(super) keys: Arc<NotifKeys>,
    /// A transfer of this agent to itself: its notification is delivered here.
    pub(super) loopback: bool,
    /// Where a loopback notification goes.
    pub(super) notifs: Arc<NotifTracker<u64>>,
    pub(super) total: usize,
    /// Of those, operations the provider does not copy (see [`Copier`]): the peer
    /// cannot count them as it counts the provider's.
    pub(super) cma_ops: usize,
    pub(super) shared: Arc<XferShared>,
    /// Keeps the peer's addresses in the AVs while this transfer can post to them.
    pub(super) peer: Arc<PeerAddrs>,
    /// Since when a provider error is held while the watches confirm the peer's death.
    pub(super) error_held: Option<Instant>,
    /// Since when the watches report the peer dead while operations are still pending.
    pub(super) death_seen: Option<DeathSeen>,
    pub(super) progress: Arc<Progress>,
    /// The whole transfer is copied by CMA in the posting thread (small transfers to a
    /// peer on this host: see [`InlineCopy`]); `rail_ops` are then empty.
    pub(super) inline: Option<InlineCopy>,
}

/// A small transfer to or from a peer on this host, copied by CMA in the thread that
/// posts it (`process_vm_writev` for a WRITE, `process_vm_readv` for a READ), as UCX's
/// CMA transport does: no progress thread of either side takes part, so it costs one
/// system call where the provider costs a round trip through both sides' progress (the
/// initiator's worker issues, the target's progress copies and answers, the worker reaps
/// the delivery completion, the caller sees it: four thread hand-offs, which on a
/// machine of few cores wait for the scheduler). Its bytes are in place when the call
/// returns: the notification, if any, is sent after that, counting no operation. The
/// same checks as a push (`cma`): DRAM on both sides, inside what the peer advertised,
/// CMA allowed, the peer alive when posted.
#[derive(Debug)]
pub(super) struct InlineCopy {
    pub(super) cma: Arc<CmaPeer>,
    /// Every block: (this process's address, the peer's virtual address, length).
    pub(super) blocks: Vec<(u64, u64, usize)>,
    /// Threads that copy the blocks, each a contiguous share of about equal bytes (a
    /// bulk transfer: `cma_threads`), or 1.
    pub(super) threads: usize,
    /// Bytes the backend copied so (`LibfabricBackend::inline_bytes`).
    pub(super) copied: Arc<AtomicU64>,
}

impl InlineCopy {
    /// Copies every block, in this thread or, for a bulk transfer, in `threads` threads
    /// that each take a contiguous share of about equal bytes; the first error is
    /// returned once every thread ended.
    ///
    /// # Safety
    /// As [`CmaPeer::copy_blocks`] for every block.
    unsafe fn copy(&self, push: bool) -> Result<(), super::cma::CopyError> {
        let shares = split_by_bytes(&self.blocks, self.threads);
        if shares.len() <= 1 {
            // SAFETY: as the caller vouches.
            return unsafe { self.cma.copy_blocks(&self.blocks, push) };
        }
        std::thread::scope(|scope| {
            let running: Vec<_> = shares
                .iter()
                .map(|share| {
                    let cma = &self.cma;
                    // SAFETY: as the caller vouches, for a part of the blocks; the scope
                    // ends every thread before this call returns.
                    scope.spawn(move || unsafe { cma.copy_blocks(share, push) })
                })
                .collect();
            let mut first = Ok(());
            for thread in running {
                let result = thread.join().unwrap_or_else(|_| {
                    Err(super::cma::CopyError {
                        disconnect: false,
                        errno: 0,
                        text: "a CMA copy thread panicked".into(),
                    })
                });
                if first.is_ok() {
                    first = result;
                }
            }
            first
        })
    }
}

/// `blocks` cut into at most `parts` contiguous shares of about equal bytes (none empty).
pub(super) fn split_by_bytes(
    blocks: &[(u64, u64, usize)],
    parts: usize,
) -> Vec<&[(u64, u64, usize)]> {
    let total: usize = blocks.iter().map(|b| b.2).sum();
    let parts = parts.clamp(1, blocks.len().max(1));
    let mut shares = Vec::with_capacity(parts);
    let (mut start, mut sum) = (0, 0usize);
    for (i, b) in blocks.iter().enumerate() {
        sum += b.2;
        // Close a share once it holds its part of the bytes (the last takes the rest).
        if shares.len() + 1 < parts && sum * parts >= total * (shares.len() + 1) {
            shares.push(&blocks[start..=i]);
            start = i + 1;
        }
    }
    if start < blocks.len() {
        shares.push(&blocks[start..]);
    }
    shares
}

/// When a transfer's peer was seen dead with operations pending, and how far its rails'
/// progress and its completions were then.
#[derive(Debug)]
pub(super) struct DeathSeen {
    at: Instant,
    /// Each rail's [`Rail::rounds`] when the death was seen (or the last completion
    /// reaped after it).
    rounds: Vec<u64>,
    completed: u64,
}

/// Rounds of progress each rail of a transfer completes after its peer was seen dead
/// (with nothing of the transfer completing meanwhile) before the death is its: whatever
/// the peer answered before it ended is in the rails' queues by then and has been read
/// (one round may have begun before the death was seen; the next reads all of it).
const ROUNDS_AFTER_DEATH: u64 = 2;
/// And at least this long, for a completion that the kernel delivers a little after the
/// process's end is visible (the peer's last bytes on a socket it closed).
const DEATH_SETTLE: Duration = Duration::from_millis(1);

impl DeathSeen {
    fn now(rails: &[Arc<Rail>], completed: u64) -> Self {
        Self {
            at: Instant::now(),
            rounds: rails.iter().map(|r| r.rounds()).collect(),
            completed,
        }
    }

    /// Whether every rail with operations of this transfer (rail 0 for its
    /// notification; every rail with `all_rails`: a staged part uses them all) has
    /// completed [`ROUNDS_AFTER_DEATH`] rounds since.
    fn reaped(&self, rails: &[Arc<Rail>], rail_ops: &[Arc<Vec<RailOp>>], all_rails: bool) -> bool {
        self.at.elapsed() >= DEATH_SETTLE
            && rails.iter().enumerate().all(|(r, rail)| {
                (r != 0 && !all_rails && rail_ops[r].is_empty())
                    || rail.rounds() >= self.rounds[r] + ROUNDS_AFTER_DEATH
            })
    }
}

impl FabricXfer {
    /// `Err(RemoteDisconnect)` once the peer's process ended (same host) or its
    /// heartbeats stopped (any host).
    pub(super) fn peer_alive(&self) -> Result<()> {
        self.shared.peer_alive()
    }

    /// `Err` once a rail this transfer uses has been stuck inside the provider for
    /// [`WEDGED_AFTER`]: its operations will never be issued or completed, so the
    /// transfer fails now rather than at the stall timeout.
    fn rails_not_wedged(&self) -> Result<()> {
        for (r, ops) in self.rail_ops.iter().enumerate() {
            if ops.is_empty() && !(r == 0 && self.shared.notif_pending.load(Ordering::Relaxed)) {
                continue;
            }
            if let Some(lasted) = self.rails[r].wedged_for() {
                return Err(Error::Backend {
                    backend: NAME.into(),
                    code: 0,
                    message: format!(
                        "transfer to `{}`: rail {r} has been inside one provider call for \
                         {lasted:?} and is wedged (over shm: a peer that died holding its \
                         region's lock); create the backend anew",
                        self.agent
                    ),
                });
            }
        }
        Ok(())
    }

    /// Posts a transfer copied in this thread (see [`InlineCopy`]): done on return,
    /// unless its notification is still to be sent.
    fn post_inline(&mut self, key: u64, notif: Option<&[u8]>) -> Result<XferStatus> {
        let Some(inline) = &self.inline else {
            return Err(Error::Backend {
                backend: NAME.into(),
                code: 0,
                message: "an inline post of a transfer prepared for the provider".into(),
            });
        };
        // Nothing for the peer to count: every byte is in place before the message goes.
        let message = notif
            .map(|msg| encode_notif(&self.self_name, key, 0, msg))
            .transpose()?;
        let shared = &self.shared;
        *shared.failed.lock() = None;
        shared.completed.store(0, Ordering::Relaxed);
        shared.pending.store(0, Ordering::Relaxed);
        shared.notif_pending.store(false, Ordering::Relaxed);
        let write = self.op == XferOp::Write;
        // SAFETY: every block's local range lies in a registration of this transfer (the
        // agent checked it at prepare time, and `Agent::register_mem`'s contract keeps it
        // valid while the transfer runs); a READ's destination is the caller's, which
        // nothing else writes while the request is posted.
        if let Err(e) = unsafe { inline.copy(write) } {
            return Err(if e.disconnect {
                Error::RemoteDisconnect {
                    agent: self.agent.clone(),
                    reason: e.text,
                }
            } else {
                Error::Backend {
                    backend: NAME.into(),
                    code: e.errno,
                    message: format!("transfer to `{}`: {}", self.agent, e.text),
                }
            });
        }
        let bytes: usize = inline.blocks.iter().map(|b| b.2).sum();
        inline.copied.fetch_add(bytes as u64, Ordering::Relaxed);
        shared
            .completed
            .store(inline.blocks.len() as u64, Ordering::Relaxed);
        let Some(message) = message else {
            return Ok(XferStatus::Done);
        };
        shared.notif_pending.store(true, Ordering::Relaxed);
        self.rails[0].push_job(RailJob {
            shared: shared.clone(),
            ops: self.rail_ops[0].clone(),
            mrs: self.mrs.clone(),
            op: self.op,
            imm: None,
            notif: Some((self.notif_dest, message)),
            peer: self.peer.clone(),
        });
        self.progress.poll_inline();
        Ok(XferStatus::InProgress)
    }
}

impl BackendXfer for FabricXfer {
    fn post(&mut self, notif: Option<&[u8]>, _params: &PostParams) -> Result<XferStatus> {
        if let Err(e) = self.peer_alive() {
            self.peer.settle_if_ended();
            return Err(e);
        }
        self.error_held = None;
        self.death_seen = None;
        let key = self.keys.next();
        if self.inline.is_some() {
            return self.post_inline(key, notif);
        }
        let staged_units: u64 = self
            .staged
            .as_ref()
            .map_or(0, |p| p.chunks.iter().map(staging::Chunk::units).sum());
        // What the peer counts before it delivers the notification: the provider's
        // operations (what CMA copies leaves no trace there) and the staged ones.
        let expected = if self.op == XferOp::Write {
            (self.total - self.cma_ops) as u64 + staged_units
        } else {
            0
        };
        let message = notif
            .map(|msg| encode_notif(&self.self_name, key, expected, msg))
            .transpose()?;
        let shared = &self.shared;
        *shared.failed.lock() = None;
        shared.completed.store(0, Ordering::Relaxed);
        // The staged part counts as one unit, done when its last chunk is.
        shared.pending.store(
            self.total as u64 + u64::from(self.staged.is_some()),
            Ordering::Relaxed,
        );
        shared
            .notif_pending
            .store(message.is_some(), Ordering::Relaxed);
        let (write_notif, imm) = match (self.op, message) {
            // To itself: delivered once every operation completed (WRITEs then ask for
            // delivery: without remote CQ data, see `worker::post`).
            (_, Some(_)) if self.loopback => {
                *shared.notif_after_all.lock() = Some(AfterAll::Deliver {
                    notifs: self.notifs.clone(),
                    sender: self.self_name.clone(),
                    msg: notif.map(<[u8]>::to_vec).unwrap_or_default(),
                });
                (None, None)
            }
            (XferOp::Write, Some(m)) if self.cma_ops == 0 => {
                (Some((self.notif_dest, m)), Some(key))
            }
            // A READ's message, and a WRITE's with pushed pieces (whose bytes are in place
            // once their copy returned), go after the last operation.
            (op, Some(m)) => {
                *shared.notif_after_all.lock() = Some(AfterAll::Send(self.notif_dest, m));
                (None, (op == XferOp::Write).then_some(key))
            }
            (_, None) => (None, None),
        };
        let mut write_notif = write_notif;
        for (r, ops) in self.rail_ops.iter().enumerate() {
            let notif = if r == 0 { write_notif.take() } else { None };
            if ops.is_empty() && notif.is_none() {
                continue;
            }
            self.rails[r].push_job(RailJob {
                shared: shared.clone(),
                ops: ops.clone(),
                mrs: self.mrs.clone(),
                op: self.op,
                imm,
                notif,
                peer: self.peer.clone(),
            });
        }
        if let Some(plan) = &self.staged {
            self.stager.submit(RunSpec {
                plan: plan.clone(),
                key: imm,
                peer: Arc::as_ptr(&self.peer) as u64,
                sink: Box::new(FabricSink {
                    shared: shared.clone(),
                    rail0: self.rails[0].clone(),
                    peer: self.peer.clone(),
                }),
            });
        }
        self.progress.poll_inline();
        Ok(XferStatus::InProgress)
    }

    fn check(&mut self) -> Result<XferProgress> {
        self.progress.poll_inline();
        if let Some((disconnect, code, text)) = self.shared.failed.lock().clone() {
            if !disconnect
                && (self.shared.peer.watch.is_some() || self.shared.peer.liveness.is_some())
            {
                // Providers report some deaths as plain errors (`sockets` fails the
                // operations of a lost connection with FI_EIO): a dead peer's is typed
                // as its death, which the watches confirm within a short grace.
                self.peer_alive()?;
                let since = *self.error_held.get_or_insert_with(Instant::now);
                if since.elapsed() < DEATH_GRACE {
                    return Ok(XferProgress {
                        status: XferStatus::InProgress,
                        completed_ops: self.shared.completed.load(Ordering::Relaxed),
                    });
                }
            }
            return Err(if disconnect {
                Error::RemoteDisconnect {
                    agent: self.agent.clone(),
                    reason: text,
                }
            } else {
                Error::Backend {
                    backend: NAME.into(),
                    code,
                    message: format!("transfer to `{}`: {text}", self.agent),
                }
            });
        }
        let done = self.shared.pending.load(Ordering::Acquire) == 0
            && !self.shared.notif_pending.load(Ordering::Acquire);
        if !done {
            self.rails_not_wedged()?;
            // A provider that never reports a dead peer (shm) would leave only the stall
            // timeout: the OS tells sooner. A peer may also leave right after our last
            // operation reached it (a target that exits once it has the notification,
            // before our worker reaped that send's completion): what was delivered
            // completes once the rails have read their queues after the death was seen,
            // and only then is the death the transfer's.
            if let Err(e) = self.peer_alive() {
                self.peer.settle_if_ended();
                let completed = self.shared.completed.load(Ordering::Relaxed);
                let seen = self
                    .death_seen
                    .get_or_insert_with(|| DeathSeen::now(&self.rails, completed));
                if seen.completed != completed {
                    // Still completing: what arrived before the death is being reaped.
                    let since = seen.at;
                    *seen = DeathSeen::now(&self.rails, completed);
                    seen.at = since;
                }
                let all_rails = self.staged.is_some();
                if seen.at.elapsed() >= DEATH_GRACE
                    || seen.reaped(&self.rails, &self.rail_ops, all_rails)
                {
                    return Err(e);
                }
            }
        }
        Ok(XferProgress {
            status: if done {
                XferStatus::Done
            } else {
                XferStatus::InProgress
            },
            completed_ops: self.shared.completed.load(Ordering::Relaxed),
        })
    }

    fn op_count(&self) -> usize {
        self.total
            + self.staged.as_ref().map_or(0, |p| p.chunks.len())
            + self.inline.as_ref().map_or(0, |i| i.blocks.len())
    }

    fn staged_bytes(&self) -> u64 {
        self.staged.as_ref().map_or(0, |p| p.staged_bytes())
    }
}

/// How long releasing a transfer waits for operations already in the provider.
const DRAIN_ON_DROP: Duration = Duration::from_secs(10);

impl Drop for FabricXfer {
    fn drop(&mut self) {
        // Workers stop issuing what is left. Operations already issued may still read the
        // caller's source or write its destination, also those of a transfer that failed
        // (a stall, a rail thread starved past the wedge bound): the caller may reuse the
        // memory once the request is gone, so the request goes once the workers retired
        // its jobs — at once for a peer that is gone (nothing of it reads the memory
        // any more that anyone would see), else within a bound.
        self.shared.canceled.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + DRAIN_ON_DROP;
        while self.shared.in_workers.load(Ordering::Acquire) > 0 {
            if self.peer_alive().is_err() {
                break;
            }
            if Instant::now() > deadline {
                tracing::warn!(
                    peer = %self.agent,
                    "{NAME}: a released transfer's operations are still in the provider after {DRAIN_ON_DROP:?}"
                );
                break;
            }
            self.progress.poll_inline();
            std::thread::yield_now();
        }
        if self.staged.is_some() {
            // A device copy cannot be recalled (see `staging::wait_user_copies`).
            staging::wait_user_copies(&self.shared.user_copies, || {
                self.stager.progress();
                self.progress.poll_inline();
            });
        }
    }
}

/// `NXNT key-low:u32 key-high:u32 expected:u64 name:str16 msg:u32-prefixed` (the key's
/// halves where a sequence number and a hash of the sender's name were before). Sent
/// sealed ([`super::notif_mac`]): the frame leaves room for the seal.
pub(super) fn encode_notif(sender: &str, key: u64, expected: u64, msg: &[u8]) -> Result<Vec<u8>> {
    let (low, high) = (key as u32, (key >> 32) as u32);
    let len = 4 + 4 + 4 + 8 + 2 + sender.len() + 4 + msg.len();
    let most = MAX_NOTIF_BYTES - super::notif_mac::SEAL_OVERHEAD;
    if len > most {
        return Err(Error::InvalidParam(format!(
            "notification of {} bytes is too large for {NAME} (at most {} with this agent name)",
            msg.len(),
            most.saturating_sub(len - msg.len())
        )));
    }
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(NOTIF_MAGIC);
    out.extend_from_slice(&low.to_le_bytes());
    out.extend_from_slice(&high.to_le_bytes());
    out.extend_from_slice(&expected.to_le_bytes());
    out.extend_from_slice(&(sender.len() as u16).to_le_bytes());
    out.extend_from_slice(sender.as_bytes());
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(msg);
    Ok(out)
}

/// A notification message: (key, expected data completions, the name it gives its
/// sender, the message); bounded against hostile input.
pub(super) fn decode_notif(b: &[u8]) -> Result<(u64, u64, String, Vec<u8>)> {
    let view = NotifView::parse(b)
        .ok_or_else(|| Error::MalformedMetadata("malformed notification".into()))?;
    Ok((
        view.key,
        view.expected,
        view.sender.to_string(),
        view.msg.to_vec(),
    ))
}

/// A notification message as it lies in a receive buffer (nothing copied): what a rail
/// worker judges before it keeps anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct NotifView<'a> {
    pub(super) key: u64,
    pub(super) expected: u64,
    pub(super) sender: &'a str,
    pub(super) msg: &'a [u8],
}

impl<'a> NotifView<'a> {
    /// Splits `NXNT key_lo:u32 key_hi:u32 expected:u64 name_len:u16 name msg_len:u32 msg`
    /// (little endian, nothing after); `None` for anything else.
    pub(super) fn parse(b: &'a [u8]) -> Option<Self> {
        let rest = b.strip_prefix(&NOTIF_MAGIC[..])?;
        let (low, rest) = rest.split_first_chunk::<4>()?;
        let (high, rest) = rest.split_first_chunk::<4>()?;
        let (expected, rest) = rest.split_first_chunk::<8>()?;
        let (name_len, rest) = rest.split_first_chunk::<2>()?;
        let name_len = usize::from(u16::from_le_bytes(*name_len));
        let sender = std::str::from_utf8(rest.get(..name_len)?).ok()?;
        let (msg_len, msg) = rest[name_len..].split_first_chunk::<4>()?;
        if msg.len() != u32::from_le_bytes(*msg_len) as usize {
            return None;
        }
        Some(NotifView {
            key: (u64::from(u32::from_le_bytes(*high)) << 32) | u64::from(u32::from_le_bytes(*low)),
            expected: u64::from_le_bytes(*expected),
            sender,
            msg,
        })
    }
}

/// Sends a notification message: injected when small (no completion: `Ok(None)`), else
/// from a registered copy whose completion carries `context` (`Ok(Some(buffer))`).
pub(super) fn send_message(
    rail: &Rail,
    dest: Address,
    message: &[u8],
    context: u64,
) -> std::result::Result<Option<RegisteredBuffer>, fabric::Error> {
    if message.len() <= rail.inject_size {
        rail.ep.inject(message, dest)?;
        return Ok(None);
    }
    let mut buf = rail.ep.alloc_registered(message.len(), Access::SEND)?;
    buf.as_mut_slice()
        .expect("a fresh buffer is not in use")
        .copy_from_slice(message);
    rail.ep.send(&buf, 0..message.len(), dest, context)?;
    Ok(Some(buf))
}

/// A standalone notification, sent from the caller's thread (bounded wait).
pub(super) fn send_message_blocking(
    rail: &Rail,
    peer: Arc<PeerAddrs>,
    message: &[u8],
    progress: &Progress,
) -> Result<()> {
    let dest = peer.addrs[0];
    let deadline = Instant::now() + Duration::from_secs(10);
    let message = &peer.seal_notif(message.to_vec());
    if message.starts_with(super::notif_mac::SEALED_MAGIC) {
        loop {
            match peer.send_by_lane(message) {
                None => break,
                Some(Err(fabric::Error::WouldBlock { .. })) if Instant::now() < deadline => {
                    progress.poll_inline();
                    std::thread::yield_now();
                }
                Some(Err(fabric::Error::WouldBlock { .. })) => {
                    return Err(Error::Timeout(
                        "sending a notification (the peer's shared lane stayed full)".into(),
                    ))
                }
                Some(sent) => return sent.map_err(fabric_error),
            }
        }
    }
    if message.len() <= rail.inject_size {
        return rail
            .ep
            .retry(deadline, || rail.ep.inject(message, dest))
            .map_err(fabric_error);
    }
    // Too large to inject: hand it to the rail worker as a job of its own.
    let shared = Arc::new(XferShared::default());
    shared.notif_pending.store(true, Ordering::Release);
    rail.push_job(RailJob {
        shared: shared.clone(),
        ops: Arc::new(Vec::new()),
        mrs: Arc::from(Vec::new()),
        op: XferOp::Write,
        imm: None,
        notif: Some((dest, message.to_vec())),
        peer,
    });
    while shared.notif_pending.load(Ordering::Acquire) {
        if let Some((_, code, text)) = shared.failed.lock().clone() {
            return Err(Error::Backend {
                backend: NAME.into(),
                code,
                message: text,
            });
        }
        if Instant::now() > deadline {
            return Err(Error::Timeout("sending a notification".into()));
        }
        progress.poll_inline();
        std::thread::yield_now();
    }
    Ok(())
}
