//! Transfers: a prepared request's work requests per rail, the state one post shares
//! with the rail workers, and how a post queues its share on each rail.

use super::wire::encode_notif;
use super::{Common, Outgoing, NAME};
use crate::backend::{BackendXfer, PostParams, XferOp, XferProgress, XferStatus};
use crate::error::{Error, Result};
use ibverbs::MemoryRegion;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
}

impl XferShared {
    pub(super) fn fail(&self, failure: Failure) {
        let mut failed = self.failed.lock().expect("failed lock");
        if failed.is_none() {
            *failed = Some(failure);
        }
    }

    pub(super) fn failure(&self) -> Option<Failure> {
        self.failed.lock().expect("failed lock").clone()
    }
}

#[derive(Debug)]
pub(super) struct VerbsXfer {
    pub(super) op: XferOp,
    pub(super) rail_ops: Vec<Arc<[RailOp]>>,
    pub(super) mrs: Arc<[Arc<MemoryRegion>]>,
    pub(super) common: Arc<Common>,
    /// Rails this transfer progresses when polled: those with operations, and rail 0
    /// (which carries the notification).
    pub(super) used: Vec<usize>,
    pub(super) conn: Arc<Outgoing>,
    pub(super) agent: String,
    pub(super) next_seq: Arc<AtomicU32>,
    pub(super) total: usize,
    pub(super) shared: Arc<XferShared>,
}

impl BackendXfer for VerbsXfer {
    fn post(&mut self, notif: Option<&[u8]>, _params: &PostParams) -> Result<XferStatus> {
        if self.conn.is_dead() {
            return Err(self.conn.disconnect_error());
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let used_rails = self.rail_ops.iter().filter(|ops| !ops.is_empty()).count();
        let expected = match self.op {
            XferOp::Write => used_rails as u32,
            XferOp::Read => 0,
        };
        let message = notif.map(|m| encode_notif(seq, expected, m)).transpose()?;
        let shared = &self.shared;
        *shared.failed.lock().expect("failed lock") = None;
        shared.completed.store(0, Ordering::Relaxed);
        shared.pending.store(self.total as u64, Ordering::Relaxed);
        shared
            .notif_pending
            .store(message.is_some(), Ordering::Relaxed);
        let (mut write_notif, imm) = match (self.op, message) {
            (XferOp::Write, Some(m)) => (Some(m), Some(seq)),
            (XferOp::Read, Some(m)) => {
                *shared.read_notif.lock().expect("notif lock") = Some(m);
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
            self.common.rails[r]
                .submit
                .lock()
                .expect("submit lock")
                .push_back(RailJob {
                    shared: shared.clone(),
                    conn: self.conn.clone(),
                    ops: ops.clone(),
                    _mrs: self.mrs.clone(),
                    op: self.op,
                    imm,
                    notif,
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
        if !done && self.conn.is_dead() {
            // The side channel saw the peer go: fail now, the flushes follow.
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
        self.total
    }
}

impl Drop for VerbsXfer {
    fn drop(&mut self) {
        // Workers stop issuing what is left; issued operations still complete into the
        // workers, which keep the registrations alive until then.
        self.shared.canceled.store(true, Ordering::Relaxed);
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
