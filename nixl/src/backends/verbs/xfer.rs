//! Transfers: a prepared request's work requests per rail, the state one post shares
//! with the rail workers, and how a post queues its share on each rail.

use super::stage_net::{notif_key, VerbsAddr, VerbsSink};
use super::wire::encode_notif;
use super::{Common, Outgoing, Rail, NAME};
use crate::backend::{BackendXfer, PostParams, XferOp, XferProgress, XferStatus};
use crate::backends::staging::{self, Plan, RunSpec};
use crate::error::{Error, Result};
use ibverbs::MemoryRegion;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// One work request, resolved at prepare time.
#[derive(Debug, Clone, Copy)]
pub(super) struct RailOp {
    pub(super) local: u64,
    pub(super) len: u32,
    pub(super) lkey: u32,
    pub(super) remote: u64,
    pub(super) rkey: u32,
}

#[derive(Debug, Clone)]
pub(super) enum Failure {
    Disconnect(String),
    Backend(i32, String),
}

impl Failure {
    pub(super) fn into_error(self, agent: &str) -> Error {
        match self {
            Failure::Disconnect(reason) => Error::RemoteDisconnect {
                agent: agent.to_string(),
                reason,
            },
            Failure::Backend(code, text) => Error::Backend {
                backend: NAME.into(),
                code,
                message: format!("transfer to `{agent}`: {text}"),
            },
        }
    }
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
    /// READ: the message to send once the last read completed.
    pub(super) read_notif: Mutex<Option<Vec<u8>>>,
    pub(super) failed: Mutex<Option<Failure>>,
    pub(super) canceled: AtomicBool,
    /// Staged copies touching the caller's memory still running.
    pub(super) user_copies: AtomicUsize,
}

impl XferShared {
    pub(super) fn fail(&self, failure: Failure) {
        let mut failed = self.failed.lock();
        if failed.is_none() {
            *failed = Some(failure);
        }
    }

    pub(super) fn failure(&self) -> Option<Failure> {
        self.failed.lock().clone()
    }

    /// `n` units of the post finished (data operations, or the whole staged part): the
    /// last one lets a READ's notification go, on rail 0.
    pub(super) fn units_done(self: &Arc<Self>, n: u64, rail0: &Rail, conn: &Arc<Outgoing>) {
        if self.pending.fetch_sub(n, Ordering::AcqRel) != n {
            return;
        }
        let message = self.read_notif.lock().take();
        if let Some(message) = message {
            rail0.submit(RailJob {
                shared: self.clone(),
                conn: conn.clone(),
                ops: Arc::from(Vec::new()),
                _mrs: Arc::from(Vec::new()),
                op: XferOp::Read,
                imm: None,
                notif: Some(message),
            });
        }
    }
}

#[derive(Debug)]
pub(super) struct VerbsXfer {
    /// The part of the transfer that goes through the staging pipeline.
    pub(super) staged: Option<Arc<Plan<VerbsAddr>>>,
    pub(super) op: XferOp,
    pub(super) rail_ops: Vec<Arc<[RailOp]>>,
    pub(super) mrs: Arc<[Arc<MemoryRegion>]>,
    pub(super) common: Arc<Common>,
    /// Rails this transfer progresses when polled: those with operations, and rail 0
    /// (which carries the notification); all of them with a staged part.
    pub(super) used: Vec<usize>,
    pub(super) conn: Arc<Outgoing>,
    pub(super) agent: String,
    pub(super) next_seq: Arc<AtomicU32>,
    pub(super) total: usize,
    pub(super) shared: Arc<XferShared>,
}

impl BackendXfer for VerbsXfer {
    fn post(&mut self, notif: Option<&[u8]>, _params: &PostParams) -> Result<XferStatus> {
        if self.conn.is_dead() || self.conn.process_gone() {
            return Err(self.conn.disconnect_error());
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        // One immediate per rail with plain writes (on its last one), one data unit per
        // staged write from a slot or chunk the target copied in (see `stage_net`).
        let used_rails = self.rail_ops.iter().filter(|ops| !ops.is_empty()).count() as u64;
        let staged_units: u64 = self
            .staged
            .as_ref()
            .map_or(0, |p| p.chunks.iter().map(staging::Chunk::units).sum());
        let expected = match self.op {
            XferOp::Write => u32::try_from(used_rails + staged_units).map_err(|_| {
                Error::InvalidParam(format!(
                    "{NAME}: a notified WRITE of {staged_units} staged data units"
                ))
            })?,
            XferOp::Read => 0,
        };
        let message = notif.map(|m| encode_notif(seq, expected, m)).transpose()?;
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
        let (mut write_notif, imm) = match (self.op, message) {
            (XferOp::Write, Some(m)) => (Some(m), Some(seq)),
            (XferOp::Read, Some(m)) => {
                *shared.read_notif.lock() = Some(m);
                (None, None)
            }
            (_, None) => (None, None),
        };
        for (r, ops) in self.rail_ops.iter().enumerate() {
            // The message goes on rail 0, behind that rail's writes.
            let notif = if r == 0 { write_notif.take() } else { None };
            if ops.is_empty() && notif.is_none() {
                continue;
            }
            // Queued without waking the worker: the first chain is issued from here,
            // the rest by whoever progresses the rail next (a poll, or the worker,
            // woken only if work is left).
            self.common.rails[r].submit.lock().push_back(RailJob {
                shared: shared.clone(),
                conn: self.conn.clone(),
                ops: ops.clone(),
                _mrs: self.mrs.clone(),
                op: self.op,
                imm,
                notif,
            });
        }
        if let Some(plan) = &self.staged {
            self.common.stager.submit(RunSpec {
                plan: plan.clone(),
                key: imm.map(|seq| notif_key(self.conn.remote_id, seq)),
                peer: Arc::as_ptr(&self.conn) as u64,
                sink: Box::new(VerbsSink {
                    shared: shared.clone(),
                    rail0: self.common.rails[0].clone(),
                    conn: self.conn.clone(),
                }),
            });
        }
        for &r in &self.used {
            self.common.rails[r].progress(&self.common, 1);
        }
        Ok(XferStatus::InProgress)
    }

    fn check(&mut self) -> Result<XferProgress> {
        if self.shared.pending.load(Ordering::Acquire) != 0
            || self.shared.notif_pending.load(Ordering::Acquire)
        {
            for &r in &self.used {
                self.common.rails[r].progress(&self.common, usize::MAX);
            }
        }
        if let Some(failure) = self.shared.failure() {
            return Err(failure.into_error(&self.agent));
        }
        let done = self.shared.pending.load(Ordering::Acquire) == 0
            && !self.shared.notif_pending.load(Ordering::Acquire);
        if !done && (self.conn.is_dead() || self.conn.process_gone()) {
            // The side channel (or the OS, for a peer on this host) saw the peer go:
            // fail now, the flushes follow.
            return Err(self.conn.disconnect_error());
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
        self.total + self.staged.as_ref().map_or(0, |p| p.chunks.len())
    }

    fn staged_bytes(&self) -> u64 {
        self.staged.as_ref().map_or(0, |p| p.staged_bytes())
    }
}

impl Drop for VerbsXfer {
    fn drop(&mut self) {
        // Workers stop issuing what is left; issued operations still complete into the
        // workers, which keep the registrations alive until then.
        self.shared.canceled.store(true, Ordering::Relaxed);
        if self.staged.is_some() {
            // A device copy cannot be recalled (see `staging::wait_user_copies`).
            staging::wait_user_copies(&self.shared.user_copies, || {
                self.common.stager.progress();
            });
        }
    }
}

/// A post's share of one rail.
#[derive(Debug)]
pub(super) struct RailJob {
    pub(super) shared: Arc<XferShared>,
    pub(super) conn: Arc<Outgoing>,
    pub(super) ops: Arc<[RailOp]>,
    /// Keeps the registrations alive while operations are in flight.
    pub(super) _mrs: Arc<[Arc<MemoryRegion>]>,
    pub(super) op: XferOp,
    /// Immediate data of the last write (with a notification).
    pub(super) imm: Option<u32>,
    /// Message to send after the operations were issued.
    pub(super) notif: Option<Vec<u8>>,
}
