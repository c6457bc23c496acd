//! Descriptor lists checked against registrations, and transfer requests: posting,
//! progress, failure, telemetry.

use super::{spin_before_yield, AgentInner, LocalReg, PeerLife, RemoteReg, ReqSlot};
use crate::backend::{
    Backend, ListEntry, ListSide, LocalMd, PostParams, PreparedList, RemoteMd, XferStatus,
    XferTelemetry,
};
use crate::error::{Error, Result};
use crate::mem::{Desc, MemKind};
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A validated descriptor list (NIXL's `nixlDlistH`), local or of one peer.
#[derive(Debug)]
pub struct XferDlist {
    pub(super) agent: Option<String>,
    pub(super) kind: MemKind,
    pub(super) descs: Vec<Desc>,
    /// Per descriptor, the position in `local_regs` (local list) or `remote_regs` (a
    /// peer's) of the registration containing it, resolved once here so that a request
    /// by index gathers without searching, cloning or locking per descriptor.
    pub(super) slots: Vec<u32>,
    /// The length of every descriptor, where they all have the same.
    pub(super) uniform_len: Option<u64>,
    /// The distinct registrations of a local list's descriptors (empty for a peer's).
    pub(super) local_regs: Vec<Arc<LocalReg>>,
    /// The distinct regions of a peer's list's descriptors (empty for a local list).
    pub(super) remote_regs: Vec<Arc<RemoteReg>>,
    pub(super) generation: u64,
    /// The list as each backend resolved it once ([`Backend::prep_list`]), made at its
    /// first request through that backend: (backend index, backend address, the list,
    /// or `None` where that backend resolves per request).
    pub(super) prepared: Mutex<Vec<PreparedFor>>,
}

/// A [`XferDlist`] as one backend resolved it: (backend index, backend address, list).
pub(super) type PreparedFor = (usize, usize, Option<Arc<dyn PreparedList>>);

impl XferDlist {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.descs.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    /// The peer it was prepared for (`None`: local memory).
    pub fn agent(&self) -> Option<&str> {
        self.agent.as_deref()
    }

    /// The memory kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// Whether descriptor `index` of this (local) list lies in a registration released
    /// since the list was prepared.
    pub(super) fn is_released(&self, index: usize) -> bool {
        self.slots
            .get(index)
            .and_then(|&slot| self.local_regs.get(slot as usize))
            .is_some_and(|reg| reg.released.load(Ordering::Acquire))
    }

    /// This list as backend `bi` resolved it once ([`Backend::prep_list`]): made at the
    /// first request through it and kept with the list. `None` where the backend resolves
    /// per request, or did not register every registration the list touches.
    pub(super) fn prepared_for(
        &self,
        bi: usize,
        backend: &Arc<dyn Backend>,
    ) -> Result<Option<Arc<dyn PreparedList>>> {
        let address = Arc::as_ptr(backend) as *const () as usize;
        let mut cache = self.prepared.lock();
        if let Some((_, _, list)) = cache.iter().find(|(i, a, _)| *i == bi && *a == address) {
            return Ok(list.clone());
        }
        let list = match self.agent.as_deref() {
            None => {
                let regs = self.local_regs.iter().map(|reg| {
                    let md: Option<&dyn LocalMd> = reg.mds.get(bi).and_then(|m| m.as_deref());
                    (&reg.region, md)
                });
                match list_entries(&self.descs, &self.slots, regs) {
                    Some(entries) => backend.prep_list(ListSide::Local(&entries))?,
                    None => None,
                }
            }
            Some(agent) => {
                let regs = self.remote_regs.iter().map(|reg| {
                    let md: Option<&dyn RemoteMd> = reg.mds.get(bi).and_then(|m| m.as_deref());
                    (&reg.region, md)
                });
                match list_entries(&self.descs, &self.slots, regs) {
                    Some(entries) => backend.prep_list(ListSide::Remote {
                        agent,
                        entries: &entries,
                    })?,
                    None => None,
                }
            }
        };
        cache.push((bi, address, list.clone()));
        Ok(list)
    }

    /// [`Error::Deregistered`] for descriptor `index` of this (local) list.
    pub(super) fn deregistered(&self, index: usize) -> Error {
        let d = self.descs.get(index).copied().unwrap_or(Desc::new(0, 0, 0));
        Error::Deregistered {
            index,
            kind: self.kind,
            addr: d.addr,
            len: d.len,
            dev_id: d.dev_id,
        }
    }
}

/// Each descriptor with its registration (by slot) and a backend's metadata of it;
/// `None` where that backend did not register one of the registrations.
fn list_entries<'a, M: ?Sized>(
    descs: &[Desc],
    slots: &[u32],
    regs: impl Iterator<Item = (&'a crate::mem::Region, Option<&'a M>)>,
) -> Option<Vec<ListEntry<'a, M>>> {
    let regs: Vec<(&crate::mem::Region, &M)> = regs
        .map(|(region, md)| md.map(|md| (region, md)))
        .collect::<Option<_>>()?;
    descs
        .iter()
        .zip(slots)
        .map(|(&desc, &slot)| {
            let &(region, md) = regs.get(slot as usize)?;
            Some(ListEntry { desc, region, md })
        })
        .collect()
}

/// A transfer request: made once, posted many times (NIXL's `nixlXferReqH`).
///
/// # Failure model
/// [`XferReq::status`] reports, besides progress:
/// - [`Error::RemoteDisconnect`] when the transport says the peer's process or
///   connection is gone, or when the peer's metadata was invalidated
///   ([`Agent::invalidate_remote`](crate::Agent::invalidate_remote)) or reloaded with different connection information
///   (a restarted peer) while the request was in flight;
/// - [`Error::Stalled`] when no operation completed for [`AgentConfig::stall_timeout`](crate::AgentConfig::stall_timeout)
///   (a dead peer that the transport does not report is caught by this bound: no
///   request polls "in progress" forever);
/// - [`Error::Canceled`] after [`Agent::shutdown`](crate::Agent::shutdown) (or the drop of the agent's last
///   handle) released it;
/// - [`Error::Backend`] for any other transport failure.
///
/// Every error from `status` is terminal: the backend transfer is released at once
/// (nothing more is issued, and its notification is not sent if it has not been), the
/// request is spent, and later `status`/`post` calls return the same error. Make a new
/// request (after [`Agent::load_remote_metadata`](crate::Agent::load_remote_metadata) with the peer's new metadata, for a
/// restarted peer) to move the data again. Errors from `post` itself (e.g. a
/// notification too large) start nothing and leave the request as it was.
///
/// # Release
/// Dropping a request releases it. If it is in flight, the transport stops issuing its
/// remaining operations; operations already issued complete into the backend, which
/// keeps the memory registrations alive until then. Its notification is then either
/// never delivered or delivered only after all of its data landed: a target never sees
/// the notification of a half-done transfer.
#[derive(Debug)]
pub struct XferReq {
    pub(super) backend: Arc<dyn Backend>,
    pub(super) slot: Arc<ReqSlot>,
    pub(super) id: u64,
    pub(super) agent: Weak<AgentInner>,
    pub(super) life: Arc<PeerLife>,
    pub(super) peer: String,
    pub(super) notif: Option<Vec<u8>>,
    pub(super) state: ReqState,
    pub(super) stall_timeout: Duration,
    pub(super) last_progress: (u64, Instant),
    pub(super) telemetry: XferTelemetry,
    pub(super) _keep_local: Vec<Arc<LocalReg>>,
    pub(super) _keep_remote: Vec<Arc<RemoteReg>>,
}

#[derive(Debug)]
pub(super) enum ReqState {
    Idle,
    InFlight,
    Done,
    Failed(Failure),
}

/// A terminal error, kept to be reported again.
#[derive(Debug, Clone)]
pub(super) enum Failure {
    Disconnect {
        agent: String,
        reason: String,
    },
    Stalled(Duration),
    Canceled,
    Backend {
        backend: String,
        code: i32,
        message: String,
    },
}

impl Failure {
    fn new(e: &Error, backend: &str) -> Self {
        match e {
            Error::RemoteDisconnect { agent, reason } => Failure::Disconnect {
                agent: agent.clone(),
                reason: reason.clone(),
            },
            Error::Stalled(d) => Failure::Stalled(*d),
            Error::Canceled => Failure::Canceled,
            Error::Backend {
                backend,
                code,
                message,
            } => Failure::Backend {
                backend: backend.clone(),
                code: *code,
                message: message.clone(),
            },
            other => Failure::Backend {
                backend: backend.to_string(),
                code: 0,
                message: other.to_string(),
            },
        }
    }

    fn error(&self) -> Error {
        match self.clone() {
            Failure::Disconnect { agent, reason } => Error::RemoteDisconnect { agent, reason },
            Failure::Stalled(d) => Error::Stalled(d),
            Failure::Canceled => Error::Canceled,
            Failure::Backend {
                backend,
                code,
                message,
            } => Error::Backend {
                backend,
                code,
                message,
            },
        }
    }
}

impl XferReq {
    /// Starts the transfer with the notification it was made with. Returns
    /// [`XferStatus::Done`] if it finished within the call.
    #[doc(alias = "postXferReq")]
    pub fn post(&mut self) -> Result<XferStatus> {
        self.post_with(None, &PostParams::default())
    }

    /// Starts the transfer, replacing its notification if `notif` is given, with per-post
    /// backend parameters.
    pub fn post_with(&mut self, notif: Option<Vec<u8>>, params: &PostParams) -> Result<XferStatus> {
        match &self.state {
            ReqState::InFlight => return Err(Error::RepostActive),
            ReqState::Failed(f) => return Err(f.error()),
            ReqState::Idle | ReqState::Done => {}
        }
        let mut slot = self.slot.lock();
        let Some(inner) = slot.as_mut() else {
            drop(slot);
            return Err(self.fail(Error::Canceled));
        };
        if let Some(why) = self.life.gone() {
            drop(slot);
            return Err(self.fail(self.gone_error(why)));
        }
        if notif.is_some() {
            self.notif = notif;
        }
        let start = Instant::now();
        let status = inner.post(self.notif.as_deref(), params).inspect_err(|e| {
            if matches!(e, Error::RemoteDisconnect { .. }) {
                self.life.mark_disconnected();
            }
        })?;
        drop(slot);
        self.state = if status == XferStatus::Done {
            ReqState::Done
        } else {
            ReqState::InFlight
        };
        self.last_progress = (0, start);
        self.telemetry.post_time = Some(start);
        self.telemetry.post_duration = start.elapsed();
        self.telemetry.xfer_duration = (status == XferStatus::Done).then(|| start.elapsed());
        Ok(status)
    }

    /// Polls the transfer. See the type's documentation for the errors, all terminal.
    #[doc(alias = "getXferStatus")]
    pub fn status(&mut self) -> Result<XferStatus> {
        match &self.state {
            ReqState::Idle => return Err(Error::NotPosted),
            ReqState::Done => return Ok(XferStatus::Done),
            ReqState::Failed(f) => return Err(f.error()),
            ReqState::InFlight => {}
        }
        let mut slot = self.slot.lock();
        let Some(inner) = slot.as_mut() else {
            drop(slot);
            return Err(self.fail(Error::Canceled));
        };
        let checked = inner.check();
        drop(slot);
        let now = Instant::now();
        match checked {
            Ok(p) if p.status == XferStatus::Done => {
                self.state = ReqState::Done;
                self.telemetry.xfer_duration = self.telemetry.post_time.map(|t| now - t);
                Ok(XferStatus::Done)
            }
            // A peer that went away while in flight: whatever the transport says next
            // (an error for a removed address, or nothing) is about a peer that is gone.
            _ if self.life.gone().is_some() => {
                let why = self.life.gone().expect("checked");
                Err(self.fail(self.gone_error(why)))
            }
            Err(e) => Err(self.fail(e)),
            Ok(p) => {
                if p.completed_ops != self.last_progress.0 {
                    self.last_progress = (p.completed_ops, now);
                } else if now - self.last_progress.1 > self.stall_timeout {
                    return Err(self.fail(Error::Stalled(self.stall_timeout)));
                }
                Ok(XferStatus::InProgress)
            }
        }
    }

    fn gone_error(&self, why: &str) -> Error {
        Error::RemoteDisconnect {
            agent: self.peer.clone(),
            reason: format!(
                "the request was made for an incarnation of the peer that is gone: {why}"
            ),
        }
    }

    /// Makes the request spent: releases the backend transfer, keeps the error.
    fn fail(&mut self, e: Error) -> Error {
        let e = match e {
            Error::RemoteDisconnect { agent, reason } if agent.is_empty() => {
                Error::RemoteDisconnect {
                    agent: self.peer.clone(),
                    reason,
                }
            }
            other => other,
        };
        if matches!(e, Error::RemoteDisconnect { .. }) {
            // The transport says this incarnation is gone: its name may be bound anew.
            self.life.mark_disconnected();
        }
        let taken = self.slot.lock().take();
        drop(taken);
        self.state = ReqState::Failed(Failure::new(&e, self.backend.name()));
        e
    }

    /// Polls until done, an error, or `timeout` (which is [`Error::Timeout`] and, unlike
    /// the errors of [`XferReq::status`], leaves the request in flight).
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.status()? == XferStatus::Done {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited > timeout {
                return Err(Error::Timeout(format!(
                    "transfer to `{}` not done after {timeout:?}",
                    self.peer
                )));
            }
            // Spin briefly before giving the CPU away: a small transfer (a GPU copy of a
            // few MiB takes ~10 us) completes sooner than a yield returns. Not where
            // cores are few: the threads moving the transfer need this one.
            if waited < spin_before_yield() {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Whether a post is in flight (posted, not yet done or failed).
    pub fn is_in_flight(&self) -> bool {
        matches!(self.state, ReqState::InFlight)
    }

    /// Bytes, descriptor count and timings of the last post.
    #[doc(alias = "getXferTelemetry")]
    pub fn telemetry(&self) -> XferTelemetry {
        self.telemetry
    }

    /// The backend carrying it.
    #[doc(alias = "queryXferBackend")]
    pub fn backend_name(&self) -> &str {
        self.backend.name()
    }

    /// Transport operations per post (0 once the request was released).
    pub fn op_count(&self) -> usize {
        self.slot.lock().as_ref().map_or(0, |x| x.op_count())
    }

    /// The peer.
    pub fn peer(&self) -> &str {
        &self.peer
    }
}

impl Drop for XferReq {
    fn drop(&mut self) {
        if let Some(agent) = self.agent.upgrade() {
            agent.requests.lock().remove(&self.id);
        }
        // The slot (and with it the backend transfer) is dropped after this: releasing
        // it cancels what is still in flight.
    }
}
