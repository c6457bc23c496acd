//! `FAULT`: wraps another backend and injects failures deterministically, so that every
//! failure path of the (unmodified) agent can be tested without waiting for a real
//! network to misbehave.
//!
//! The wrapper reports the inner backend's name, so its metadata sections match a peer
//! that runs the plain backend: only one side needs the faults.
//!
//! # Faults
//! Completions are counted over every transfer of the backend, as the agent observes
//! them by polling ([`crate::XferReq::status`]), starting at 1.
//! - `fail_completion=N`: the transfer whose poll observes the Nth completed operation
//!   fails, with [`Error::RemoteDisconnect`] (`fail_error=disconnect`, the default: a
//!   flushed completion) or [`Error::Backend`] with `EIO` (`fail_error=backend`). The
//!   connection stays up: the next request succeeds.
//! - `disconnect_after=N`: the same, and the peer of that transfer is cut off for real:
//!   the inner backend forgets it ([`Backend::disconnect`]), requests made for it fail
//!   with [`Error::RemoteDisconnect`], new ones cannot be made, and standalone
//!   notifications to it fail, until its connection information is loaded again
//!   ([`crate::Agent::load_remote_metadata`]): the reconnect path.
//! - `delay_ms=D`: each post is handed to the inner backend D ms after the caller posted
//!   it, data and notification alike (with D above the agent's stall timeout, the agent
//!   reports [`Error::Stalled`]).
//! - `hold=true`: posts are held (no progress at all) until [`FaultBackend::release`].
//! - `drop_notif=N`: the Nth notification this backend sends (with a transfer or
//!   standalone) is not sent; the transfer itself completes.
//!
//! # Parameters
//! `inner` (required: the wrapped backend's name, e.g. `LIBFABRIC` or `LOCAL`), the
//! faults above, and every other parameter is passed on to the inner backend.
//! [`FaultBackend::new`] gives the typed handle whose methods inject faults at run time
//! ([`FaultBackend::disconnect`], [`FaultBackend::set_plan`], [`FaultBackend::release`]).

use crate::backend::{
    Backend, BackendInit, BackendParams, BackendXfer, Capabilities, LocalMd, NotifWaker,
    PostParams, RemoteMd, XferEntry, XferOp, XferProgress, XferStatus,
};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The name it is created by (it reports its inner backend's name to peers).
pub const NAME: &str = "FAULT";
/// The error number of an injected backend failure (`EIO`).
pub const INJECTED_ERRNO: i32 = 5;

/// How an injected completion failure is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FaultError {
    /// [`Error::RemoteDisconnect`] (a flushed completion).
    #[default]
    Disconnect,
    /// [`Error::Backend`] with code [`INJECTED_ERRNO`].
    Backend,
}

/// The faults to inject (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// The transfer that completes the Nth operation fails.
    pub fail_completion: Option<u64>,
    /// How that failure is reported.
    pub fail_error: FaultError,
    /// The Nth completed operation cuts its peer off.
    pub disconnect_after: Option<u64>,
    /// Posts reach the inner backend this long after the caller posted.
    pub delay: Option<Duration>,
    /// Posts are held until [`FaultBackend::release`].
    pub hold: bool,
    /// The Nth notification sent is dropped.
    pub drop_notif: Option<u64>,
}

impl FaultPlan {
    /// Parses the fault parameters out of `params`; returns the plan, the inner backend's
    /// name, and the parameters left for it.
    pub fn parse(params: &BackendParams) -> Result<(Self, String, BackendParams)> {
        let mut plan = FaultPlan::default();
        let mut rest = BackendParams::new();
        let mut inner = None;
        for (key, value) in params {
            let bad =
                || Error::InvalidParam(format!("{NAME} parameter {key}=`{value}` is not valid"));
            let count = || -> Result<u64> {
                value
                    .parse::<u64>()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(bad)
            };
            match key.as_str() {
                "inner" => inner = Some(value.clone()),
                "fail_completion" => plan.fail_completion = Some(count()?),
                "disconnect_after" => plan.disconnect_after = Some(count()?),
                "drop_notif" => plan.drop_notif = Some(count()?),
                "fail_error" => {
                    plan.fail_error = match value.to_ascii_lowercase().as_str() {
                        "disconnect" => FaultError::Disconnect,
                        "backend" => FaultError::Backend,
                        _ => return Err(bad()),
                    }
                }
                "delay_ms" => {
                    plan.delay = Some(Duration::from_millis(value.parse().map_err(|_| bad())?))
                }
                "hold" => plan.hold = value.parse().map_err(|_| bad())?,
                _ => {
                    rest.insert(key.clone(), value.clone());
                }
            }
        }
        let inner = inner.ok_or_else(|| {
            Error::InvalidParam(format!("{NAME} needs `inner`: the backend to wrap"))
        })?;
        if inner.eq_ignore_ascii_case(NAME) {
            return Err(Error::InvalidParam(format!("{NAME} cannot wrap itself")));
        }
        Ok((plan, inner, rest))
    }
}

/// What the wrapper has seen and done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Completed operations observed.
    pub completions: u64,
    /// Notifications the backend was asked to send.
    pub notifs: u64,
    /// Notifications dropped.
    pub notifs_dropped: u64,
    /// Transfers failed on purpose.
    pub failures: u64,
    /// Peers cut off.
    pub disconnects: u64,
}

#[derive(Debug, Default, Clone, Copy)]
struct PeerState {
    /// Bumped whenever the peer is cut off: transfers prepared before are dead.
    epoch: u64,
    cut: bool,
}

#[derive(Debug, Default)]
struct Shared {
    plan: Mutex<FaultPlan>,
    peers: Mutex<HashMap<String, PeerState>>,
    completions: AtomicU64,
    notifs: AtomicU64,
    notifs_dropped: AtomicU64,
    failures: AtomicU64,
    disconnects: AtomicU64,
}

impl Shared {
    fn plan(&self) -> FaultPlan {
        self.plan.lock().clone()
    }

    fn peer(&self, agent: &str) -> PeerState {
        self.peers.lock().get(agent).copied().unwrap_or_default()
    }

    /// Counts a notification about to be sent; `false` if this one is to be dropped.
    fn send_notif(&self) -> bool {
        let n = self.notifs.fetch_add(1, Ordering::Relaxed) + 1;
        if self.plan().drop_notif == Some(n) {
            self.notifs_dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(n, "FAULT: notification dropped");
            false
        } else {
            true
        }
    }
}

/// The fault-injecting wrapper.
#[derive(Debug)]
pub struct FaultBackend {
    inner: Arc<dyn Backend>,
    shared: Arc<Shared>,
}

pub(crate) fn create(init: &BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(FaultBackend::new(init)?)
}

impl FaultBackend {
    /// Creates the inner backend by name (parameter `inner`) from `init`'s registry,
    /// wrapped with the faults in `init.params`. Add it with
    /// [`Agent::add_backend`](crate::Agent::add_backend) (`Agent::backend_init` gives the
    /// init value) and keep the handle to inject faults at run time.
    pub fn new(init: &BackendInit) -> Result<Arc<Self>> {
        let (plan, inner_name, rest) = FaultPlan::parse(&init.params)?;
        let inner = init.registry.create(&inner_name, &init.with_params(rest))?;
        Ok(Self::wrap(inner, plan))
    }

    /// Wraps a backend that already exists (and is not added to an agent itself).
    pub fn wrap(inner: Arc<dyn Backend>, plan: FaultPlan) -> Arc<Self> {
        Arc::new(Self {
            inner,
            shared: Arc::new(Shared {
                plan: Mutex::new(plan),
                ..Default::default()
            }),
        })
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    /// Replaces the plan (counters keep running).
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.shared.plan.lock() = plan;
    }

    /// The current plan.
    pub fn plan(&self) -> FaultPlan {
        self.shared.plan()
    }

    /// Lets held posts go (clears [`FaultPlan::hold`]).
    pub fn release(&self) {
        self.shared.plan.lock().hold = false;
    }

    /// Cuts `agent` off now, as `disconnect_after` does.
    pub fn disconnect(&self, agent: &str) {
        cut(&self.shared, &*self.inner, agent);
    }

    /// Counters.
    pub fn stats(&self) -> FaultStats {
        let s = &self.shared;
        FaultStats {
            completions: s.completions.load(Ordering::Relaxed),
            notifs: s.notifs.load(Ordering::Relaxed),
            notifs_dropped: s.notifs_dropped.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            disconnects: s.disconnects.load(Ordering::Relaxed),
        }
    }

    fn check_peer(&self, agent: &str) -> Result<PeerState> {
        let state = self.shared.peer(agent);
        if state.cut {
            return Err(disconnected(agent));
        }
        Ok(state)
    }
}

fn cut(shared: &Shared, inner: &dyn Backend, agent: &str) {
    {
        let mut peers = shared.peers.lock();
        let state = peers.entry(agent.to_string()).or_default();
        state.epoch += 1;
        state.cut = true;
    }
    shared.disconnects.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(agent, "FAULT: peer cut off");
    inner.disconnect(agent);
}

fn disconnected(agent: &str) -> Error {
    Error::RemoteDisconnect {
        agent: agent.to_string(),
        reason: format!("{NAME}: connection cut by fault injection"),
    }
}

impl Backend for FaultBackend {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn supported_mem(&self) -> &[MemKind] {
        self.inner.supported_mem()
    }
    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        self.inner.register_mem(region)
    }
    fn connection_info(&self) -> Result<Vec<u8>> {
        self.inner.connection_info()
    }
    fn load_remote_conn_info(&self, agent: &str, info: &[u8]) -> Result<()> {
        self.inner.load_remote_conn_info(agent, info)?;
        if let Some(state) = self.shared.peers.lock().get_mut(agent) {
            state.cut = false;
        }
        Ok(())
    }
    fn load_remote_md(
        &self,
        agent: &str,
        region: &Region,
        public_md: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        self.inner.load_remote_md(agent, region, public_md)
    }
    fn disconnect(&self, agent: &str) {
        self.inner.disconnect(agent);
    }
    fn peer_gone(&self, agent: &str) -> bool {
        self.shared.peer(agent).cut || self.inner.peer_gone(agent)
    }
    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        let state = self.check_peer(agent)?;
        let inner = self.inner.prep_xfer(op, entries, agent)?;
        Ok(Box::new(FaultXfer {
            inner,
            backend: self.inner.clone(),
            shared: self.shared.clone(),
            peer: agent.to_string(),
            epoch: state.epoch,
            waiting: None,
            seen_ops: 0,
            failed: None,
        }))
    }
    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        self.check_peer(agent)?;
        if self.shared.send_notif() {
            self.inner.gen_notif(agent, msg)
        } else {
            Ok(())
        }
    }
    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.inner.take_notifs(into)
    }
    fn set_notif_waker(&self, waker: NotifWaker) -> bool {
        // Faults are injected on the sending side: the inner backend receives as it would.
        self.inner.set_notif_waker(waker)
    }
}

/// A post not yet handed to the inner backend.
#[derive(Debug)]
struct Waiting {
    due: Option<Instant>,
    notif: Option<Vec<u8>>,
}

#[derive(Debug)]
struct FaultXfer {
    inner: Box<dyn BackendXfer>,
    backend: Arc<dyn Backend>,
    shared: Arc<Shared>,
    peer: String,
    epoch: u64,
    waiting: Option<Waiting>,
    /// Inner completed operations of the current post already counted.
    seen_ops: u64,
    /// The injected failure of the current post.
    failed: Option<FaultError>,
}

impl FaultXfer {
    fn peer_alive(&self) -> Result<()> {
        let state = self.shared.peer(&self.peer);
        if state.cut || state.epoch != self.epoch {
            Err(disconnected(&self.peer))
        } else {
            Ok(())
        }
    }

    fn hand_on(&mut self, notif: Option<Vec<u8>>) -> Result<XferStatus> {
        let notif = notif.filter(|_| self.shared.send_notif());
        let status = self.inner.post(notif.as_deref(), &PostParams::default())?;
        if status == XferStatus::Done {
            // Done within the call (e.g. LOCAL): count its completions now, so an
            // injected failure among them still shows.
            let progress = self.inner.check()?;
            self.count(progress.completed_ops);
            if self.failed.is_some() {
                return Ok(XferStatus::InProgress);
            }
        }
        Ok(status)
    }

    /// Adds newly observed completions to the backend's count and injects the planned
    /// failure if the Nth one is among them.
    fn count(&mut self, completed: u64) {
        let delta = completed.saturating_sub(self.seen_ops);
        self.seen_ops = self.seen_ops.max(completed);
        if delta == 0 {
            return;
        }
        let before = self.shared.completions.fetch_add(delta, Ordering::Relaxed);
        let after = before + delta;
        let hit = |n: Option<u64>| n.is_some_and(|n| before < n && n <= after);
        let plan = self.shared.plan();
        if hit(plan.disconnect_after) {
            self.shared.failures.fetch_add(1, Ordering::Relaxed);
            self.failed = Some(FaultError::Disconnect);
            cut(&self.shared, &*self.backend, &self.peer);
        } else if hit(plan.fail_completion) {
            self.shared.failures.fetch_add(1, Ordering::Relaxed);
            self.failed = Some(plan.fail_error);
        }
    }

    fn failure(&self) -> Option<Error> {
        self.failed.map(|kind| match kind {
            FaultError::Disconnect => disconnected(&self.peer),
            FaultError::Backend => Error::Backend {
                backend: self.backend.name().to_string(),
                code: INJECTED_ERRNO,
                message: format!(
                    "{NAME}: injected completion failure (transfer to `{}`)",
                    self.peer
                ),
            },
        })
    }
}

impl BackendXfer for FaultXfer {
    fn post(&mut self, notif: Option<&[u8]>, _params: &PostParams) -> Result<XferStatus> {
        self.peer_alive()?;
        self.failed = None;
        self.seen_ops = 0;
        let plan = self.shared.plan();
        if plan.hold || plan.delay.is_some() {
            self.waiting = Some(Waiting {
                due: plan.delay.map(|d| Instant::now() + d),
                notif: notif.map(<[u8]>::to_vec),
            });
            return Ok(XferStatus::InProgress);
        }
        self.hand_on(notif.map(<[u8]>::to_vec))
    }

    fn check(&mut self) -> Result<XferProgress> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        self.peer_alive()?;
        if let Some(waiting) = &self.waiting {
            let held = self.shared.plan().hold;
            let early = waiting.due.is_some_and(|due| Instant::now() < due);
            if held || early {
                return Ok(XferProgress {
                    status: XferStatus::InProgress,
                    completed_ops: 0,
                });
            }
            let notif = self.waiting.take().and_then(|w| w.notif);
            self.hand_on(notif)?;
            if let Some(e) = self.failure() {
                return Err(e);
            }
        }
        let progress = self.inner.check()?;
        self.count(progress.completed_ops);
        match self.failure() {
            Some(e) => Err(e),
            None => Ok(progress),
        }
    }

    fn op_count(&self) -> usize {
        self.inner.op_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_parsed_and_checked() {
        let p = |pairs: &[(&str, &str)]| FaultPlan::parse(&crate::params(pairs.iter().copied()));
        let (plan, inner, rest) = p(&[
            ("inner", "LIBFABRIC"),
            ("fail_completion", "3"),
            ("fail_error", "backend"),
            ("delay_ms", "250"),
            ("drop_notif", "2"),
            ("provider", "tcp;ofi_rxm"),
        ])
        .unwrap();
        assert_eq!(inner, "LIBFABRIC");
        assert_eq!(rest, crate::params([("provider", "tcp;ofi_rxm")]));
        assert_eq!(
            plan,
            FaultPlan {
                fail_completion: Some(3),
                fail_error: FaultError::Backend,
                delay: Some(Duration::from_millis(250)),
                drop_notif: Some(2),
                ..Default::default()
            }
        );
        for bad in [
            &[("fail_completion", "1")][..],
            &[("inner", "FAULT")],
            &[("inner", "LOCAL"), ("fail_completion", "0")],
            &[("inner", "LOCAL"), ("fail_error", "maybe")],
            &[("inner", "LOCAL"), ("hold", "yes")],
        ] {
            assert!(matches!(p(bad), Err(Error::InvalidParam(_))), "{bad:?}");
        }
    }
}
