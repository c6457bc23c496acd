//! The backend interface: what a transport implements to plug into the agent.
//!
//! It mirrors NIXL's backend engine (`backend_engine.h`): capabilities, memory
//! registration with public metadata, connection information, remote metadata,
//! prepare/post/check/release of transfers, and notifications. Backends are created by
//! name with string parameters ([`crate::Agent::create_backend`]) or handed to the agent
//! directly ([`crate::Agent::add_backend`]) for user-written transports.

mod registry;

pub use registry::{BackendInit, BackendRegistry, CreateBackend};

use crate::error::{Error, Result};
use crate::mem::{Desc, MemKind, Region};
use parking_lot::{Condvar, Mutex};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// String parameters a backend is created with (NIXL's `nixl_b_params_t`).
pub type BackendParams = HashMap<String, String>;

/// What a backend can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Transfers between two buffers of this agent.
    pub local: bool,
    /// Transfers to other agents.
    pub remote: bool,
    /// Notifications delivered to the target.
    pub notif: bool,
}

/// The direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XferOp {
    /// Remote → local.
    Read,
    /// Local → remote.
    Write,
}

impl XferOp {
    /// Parses `READ`/`WRITE` (case-insensitive).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_uppercase().as_str() {
            "READ" | "RD" => Some(Self::Read),
            "WRITE" | "WR" => Some(Self::Write),
            _ => None,
        }
    }
}

/// Backend-private metadata of a local registration (e.g. a memory region with its
/// local descriptor and remote key). Dropping it deregisters.
pub trait LocalMd: Any + Send + Sync + std::fmt::Debug {
    /// What a peer needs to address this region (e.g. the remote key), put in metadata.
    fn public_md(&self) -> Vec<u8>;
    /// For the backend to get its own type back.
    fn as_any(&self) -> &dyn Any;
    /// How the backend reaches this registration where it has a choice (e.g. `LIBFABRIC`
    /// VRAM: `direct` through the provider, or `staged` through pinned host buffers);
    /// [`crate::Agent::query_mem`] reports it as `BACKEND(mode)`. `None`: nothing to say.
    fn mode(&self) -> Option<&'static str> {
        None
    }
}

/// Backend-private metadata of a peer's region, parsed from its public metadata.
pub trait RemoteMd: Any + Send + Sync + std::fmt::Debug {
    /// For the backend to get its own type back.
    fn as_any(&self) -> &dyn Any;
}

/// One (local, remote) pair of a transfer, already checked by the agent: both descriptors
/// are inside the regions given, and have the same length.
#[derive(Debug, Clone, Copy)]
pub struct XferEntry<'a> {
    /// Local range.
    pub local: Desc,
    /// The local registration containing it.
    pub local_region: &'a Region,
    /// This backend's metadata of that registration.
    pub local_md: &'a dyn LocalMd,
    /// Remote range.
    pub remote: Desc,
    /// The peer's region containing it.
    pub remote_region: &'a Region,
    /// This backend's view of the peer's region.
    pub remote_md: &'a dyn RemoteMd,
}

impl<'a> XferEntry<'a> {
    /// The entry's local and remote metadata as backend `backend`'s own types: metadata
    /// of another backend (a caller's mix-up) is `InvalidParam`, not a panic.
    pub fn metadata<L: Any, R: Any>(&self, backend: &str) -> Result<(&'a L, &'a R)> {
        let local = self
            .local_md
            .as_any()
            .downcast_ref::<L>()
            .ok_or_else(|| Error::InvalidParam(format!("local metadata is not {backend}'s")))?;
        let remote =
            self.remote_md.as_any().downcast_ref::<R>().ok_or_else(|| {
                Error::InvalidParam(format!("remote metadata is not {backend}'s"))
            })?;
        Ok((local, remote))
    }
}

/// One descriptor of a prepared list with its registration and this backend's view of
/// it ([`Backend::prep_list`]).
#[derive(Debug, Clone, Copy)]
pub struct ListEntry<'a, M: ?Sized> {
    /// The range.
    pub desc: Desc,
    /// The registration (local) or advertised region (a peer's) containing it.
    pub region: &'a Region,
    /// This backend's metadata of that registration or region.
    pub md: &'a M,
}

/// A whole prepared descriptor list, as [`Backend::prep_list`] sees it.
#[derive(Debug, Clone, Copy)]
pub enum ListSide<'a> {
    /// This agent's own memory (the initiator's side of a transfer).
    Local(&'a [ListEntry<'a, dyn LocalMd>]),
    /// A peer's memory (this agent's own name for loopback transfers).
    Remote {
        /// The peer.
        agent: &'a str,
        /// Its descriptors, in list order.
        entries: &'a [ListEntry<'a, dyn RemoteMd>],
    },
}

/// A descriptor list one backend resolved once ([`Backend::prep_list`]), for requests
/// by index ([`Backend::prep_xfer_indexed`]). The agent keeps it with the prepared list
/// and hands it back only to the backend that made it.
pub trait PreparedList: Any + Send + Sync + std::fmt::Debug {
    /// For the backend to get its own type back.
    fn as_any(&self) -> &dyn Any;
}

/// Per-post options (NIXL's `nixl_opt_b_args_t`): a backend-specific value such as a CUDA
/// stream travels in `custom`.
#[derive(Default)]
pub struct PostParams {
    /// Backend-specific value.
    pub custom: Option<Box<dyn Any + Send>>,
}

impl std::fmt::Debug for PostParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostParams")
            .field("custom", &self.custom.is_some())
            .finish()
    }
}

/// The state of a posted transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferStatus {
    /// All data moved (and, for WRITE with a notification, the notification was sent
    /// behind it).
    Done,
    /// Still moving.
    InProgress,
}

/// Progress of a posted transfer, as the backend counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XferProgress {
    /// Done or still moving.
    pub status: XferStatus,
    /// Operations completed so far (the agent's stall detection watches this move).
    pub completed_ops: u64,
}

/// A backend's prepared transfer. Created once by [`Backend::prep_xfer`], posted any
/// number of times (one at a time), dropped to release (which cancels one in flight).
pub trait BackendXfer: Send + std::fmt::Debug {
    /// Starts the transfer; `notif` is delivered to the target after all of the data.
    fn post(&mut self, notif: Option<&[u8]>, params: &PostParams) -> Result<XferStatus>;
    /// Polls (and, without a progress thread, progresses) the transfer.
    fn check(&mut self) -> Result<XferProgress>;
    /// Number of transport operations one post issues (after striping and splitting).
    fn op_count(&self) -> usize;
    /// Bytes of one post that go through a staging pipeline (host bounce buffers)
    /// rather than directly, e.g. `LIBFABRIC` VRAM without `FI_HMEM` (default 0).
    fn staged_bytes(&self) -> u64 {
        0
    }
    /// A device handle for kernels to post this transfer's descriptors themselves
    /// (NIXL's `createGpuXferReq`); see [`crate::device`]. Default: not supported.
    fn gpu_xfer_req(&mut self) -> Result<crate::device::GpuHandle> {
        Err(crate::Error::NotSupported {
            backend: "this backend".into(),
            what: "GPU transfer requests (the device API)".into(),
        })
    }
}

/// One descriptor of a memory view ([`Backend::prep_mem_view`]), already checked by the
/// agent to lie inside `region`.
#[derive(Debug, Clone, Copy)]
pub struct ViewEntry<'a> {
    /// The range.
    pub desc: Desc,
    /// The registration containing it (local or the peer's).
    pub region: &'a Region,
    /// This backend's metadata of it: a [`LocalMd`] for a local view, else a [`RemoteMd`].
    pub md: ViewMd<'a>,
}

/// The backend metadata of a [`ViewEntry`].
#[derive(Debug, Clone, Copy)]
pub enum ViewMd<'a> {
    /// This agent's registration.
    Local(&'a dyn LocalMd),
    /// The peer's region.
    Remote(&'a dyn RemoteMd),
}

/// A transport. Implementations must be thread-safe: the agent calls them from any thread.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// The name peers see in metadata (e.g. `LIBFABRIC`).
    fn name(&self) -> &str;
    /// What it can do.
    fn capabilities(&self) -> Capabilities;
    /// Memory kinds it can register and move.
    fn supported_mem(&self) -> &[MemKind];
    /// Memory kinds it can reach on a peer (default: the kinds it registers). Regions of
    /// other kinds in a peer's metadata are not loaded into this backend.
    fn supported_remote_mem(&self) -> &[MemKind] {
        self.supported_mem()
    }
    /// Whether it can reach `agent` at all (default: yes). A backend that cannot (e.g.
    /// `CUDA_IPC` to another node) is skipped when the agent picks one; named explicitly,
    /// its error ([`crate::Error::Unreachable`]) is the request's.
    fn reach(&self, _agent: &str) -> Result<()> {
        Ok(())
    }
    /// Whether this backend is the specialised path for transfers from local memory of
    /// kind `local` to or from a peer's memory of kind `remote` (e.g. `CUDA_IPC` for
    /// VRAM to VRAM on one node: copy engines over NVLink rather than a network stack).
    /// When the caller names no backend, the agent picks the first backend (in creation
    /// order) that says so and can carry the transfer, and only then the first other one
    /// that can: an agent with NIXL's default set of backends gets the fastest path
    /// whatever order they were created in. Default: `false`.
    fn prefers(&self, local: MemKind, remote: MemKind) -> bool {
        let _ = (local, remote);
        false
    }
    /// How it reaches `agent` where it chooses per peer (e.g. `LIBFABRIC`: the provider,
    /// `shm` for a peer on this host); `None` for an unknown peer or a backend with one
    /// way only (the default).
    fn peer_transport(&self, _agent: &str) -> Option<String> {
        None
    }
    /// Registers a region; the returned metadata deregisters when dropped.
    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>>;
    /// This agent's connection information for peers.
    fn connection_info(&self) -> Result<Vec<u8>>;
    /// Takes a peer's connection information (replacing an older one: reconnect).
    fn load_remote_conn_info(&self, agent: &str, info: &[u8]) -> Result<()>;
    /// Parses a peer region's public metadata.
    fn load_remote_md(
        &self,
        agent: &str,
        region: &Region,
        public_md: &[u8],
    ) -> Result<Arc<dyn RemoteMd>>;
    /// Forgets a peer (its metadata was invalidated).
    fn disconnect(&self, agent: &str);
    /// Whether the incarnation of `agent` whose connection information this backend
    /// loaded last is known to be over: its process exited, its heartbeats stopped, its
    /// connection was closed for good. The agent binds a peer's name to its connection
    /// information until then (see [`crate::Agent::load_remote_metadata`], "Binding"):
    /// answering `true` lets a restarted peer's new metadata in. Default: `false` (this
    /// backend cannot tell; the agent still learns of a dead peer from a failed request).
    fn peer_gone(&self, agent: &str) -> bool {
        let _ = agent;
        false
    }
    /// Prepares a transfer to `agent` (this agent's own name for a local transfer).
    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>>;
    /// Resolves a whole descriptor list once (addresses mapped, memory located), so that
    /// each request by index ([`Self::prep_xfer_indexed`]) costs a table lookup per
    /// descriptor: NIXL's `prepXferDlist`, which vLLM's connector calls once per cache and
    /// then makes a request per KV-cache pull from. `Ok(None)` (the default): this backend
    /// resolves per request ([`Self::prep_xfer`]).
    fn prep_list(&self, side: ListSide<'_>) -> Result<Option<Arc<dyn PreparedList>>> {
        let _ = side;
        Ok(None)
    }
    /// Prepares a transfer from two lists this backend resolved with [`Self::prep_list`]:
    /// `local_idx[i]` of `local` moves to (WRITE) or from (READ) `remote_idx[i]` of
    /// `remote`, a list of `agent`. The agent checked every index, the lengths, and that
    /// the registrations used are still there. Only called where `prep_list` gave both.
    fn prep_xfer_indexed(
        &self,
        op: XferOp,
        local: &Arc<dyn PreparedList>,
        local_idx: &[usize],
        remote: &Arc<dyn PreparedList>,
        remote_idx: &[usize],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        let _ = (op, local, local_idx, remote, remote_idx, agent);
        Err(Error::NotSupported {
            backend: self.name().to_string(),
            what: "transfers by index of prepared lists".into(),
        })
    }
    /// Sends a standalone notification.
    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()>;
    /// Moves received notifications into `into` as (sender, message).
    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>);
    /// Takes the agent's waker, called when the backend is added to an agent (once per
    /// agent it is added to). Returns whether the backend will call
    /// [`NotifWaker::wake`] after every notification it makes available to
    /// [`Backend::take_notifs`] from then on, without anyone calling into it (e.g. from
    /// the thread that receives them). Default: `false`, and the agent re-polls the
    /// backend while a thread waits in [`crate::Agent::wait_notifs`] (at growing
    /// intervals, at most [`crate::Agent::WAIT_REPOLL_MAX`] apart). A backend that
    /// receives notifications only when called (no progress thread) answers `false` too.
    fn set_notif_waker(&self, waker: NotifWaker) -> bool {
        let _ = waker;
        false
    }
    /// NIXL's `queryMem`: what this backend knows of the storage that each descriptor's
    /// metadata (NIXL's `metaInfo`) names, e.g. for a file path its `size`, `mode` and
    /// `mtime`; `None` where the thing named does not exist. Nothing needs to be
    /// registered. Default: not supported.
    fn query_mem_info(&self, kind: MemKind, meta: &[&[u8]]) -> Result<Vec<Option<BackendParams>>> {
        let _ = (kind, meta);
        Err(crate::Error::NotSupported {
            backend: self.name().to_string(),
            what: "queries of storage by descriptor metadata (queryMem)".into(),
        })
    }
    /// A memory view of `entries` for kernels (NIXL's `prepMemView`): of local memory
    /// when `agent` is `None`, else of that peer's. Default: not supported.
    fn prep_mem_view(
        &self,
        agent: Option<&str>,
        entries: &[ViewEntry<'_>],
    ) -> Result<crate::device::GpuHandle> {
        let _ = (agent, entries);
        Err(crate::Error::NotSupported {
            backend: self.name().to_string(),
            what: "memory views (the device API)".into(),
        })
    }
}

/// Wakes the agent's threads blocked in [`crate::Agent::wait_notifs`]. The agent hands
/// one to every backend it adds ([`Backend::set_notif_waker`]).
///
/// A backend calls [`NotifWaker::wake`] *after* a notification became visible to
/// [`Backend::take_notifs`] (a woken waiter takes it next; one that was about to sleep
/// does not sleep). While nobody waits a wake costs one atomic add and one atomic load:
/// no lock and no system call on the receive path.
#[derive(Debug, Clone)]
pub struct NotifWaker(Arc<NotifSignal>);

impl NotifWaker {
    /// Wakes every thread waiting for this agent's notifications.
    pub fn wake(&self) {
        self.0.signal();
    }

    pub(crate) fn new(signal: Arc<NotifSignal>) -> Self {
        Self(signal)
    }
}

/// The agent's side of [`NotifWaker`]: an epoch that every wake bumps, and a condition
/// variable the waiters sleep on.
///
/// A condition variable rather than an eventfd ([`crate::backends`]' `WakeFd`, which the
/// rail workers poll beside their completion channels): the waiter here blocks on
/// nothing else, `Condvar::wait_timeout` gives the timed wait directly, and the epoch
/// lets a wake that comes while nobody sleeps skip the lock and the system call (an
/// eventfd costs a `write` per notification whether or not anyone waits).
///
/// No lost wake-up: a waiter registers ([`NotifSignal::waiter`]), reads the epoch, takes
/// the notifications, and sleeps only while the epoch is still the one it read, checked
/// under the lock. A wake bumps the epoch and then, if anyone is registered, takes and
/// releases the lock before notifying: either the waiter's check (under the lock) sees the
/// new epoch, or the waiter is already asleep and the notify reaches it. A wake that saw
/// no waiter registered came before the registration in the sequentially consistent
/// order, so the waiter's epoch read, after its registration, includes it, and its take
/// sees the notification pushed before the bump.
#[derive(Debug, Default)]
pub(crate) struct NotifSignal {
    epoch: AtomicU64,
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cond: Condvar,
}

impl NotifSignal {
    fn signal(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            drop(self.lock.lock());
            self.cond.notify_all();
        }
    }

    /// Registers a waiter until the guard is dropped.
    pub(crate) fn waiter(&self) -> NotifWaiter<'_> {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        NotifWaiter(self)
    }
}

/// A registered waiter of a [`NotifSignal`].
#[derive(Debug)]
pub(crate) struct NotifWaiter<'a>(&'a NotifSignal);

impl NotifWaiter<'_> {
    /// The current epoch: read it *before* looking for notifications.
    pub(crate) fn epoch(&self) -> u64 {
        self.0.epoch.load(Ordering::SeqCst)
    }

    /// Sleeps until the epoch moves past `seen` or `until` (`None`: no bound) passes.
    pub(crate) fn sleep(&self, seen: u64, until: Option<Instant>) {
        let s = self.0;
        let mut guard = s.lock.lock();
        while s.epoch.load(Ordering::SeqCst) == seen {
            match until {
                None => s.cond.wait(&mut guard),
                Some(until) => {
                    if s.cond.wait_until(&mut guard, until).timed_out() {
                        return;
                    }
                }
            }
        }
    }
}

impl Drop for NotifWaiter<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Per-transfer telemetry (NIXL's `nixl_xfer_telem_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XferTelemetry {
    /// Bytes moved by one post.
    pub total_bytes: u64,
    /// Descriptors in the request.
    pub desc_count: usize,
    /// When the last post started.
    pub post_time: Option<Instant>,
    /// How long the post call itself took.
    pub post_duration: Duration,
    /// From post to observed completion, once complete.
    pub xfer_duration: Option<Duration>,
    /// Bytes of one post that go through host bounce buffers (staged VRAM) rather than
    /// directly; 0 when nothing is staged.
    pub staged_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct MineLocal;
    #[derive(Debug)]
    struct MineRemote;
    #[derive(Debug)]
    struct OtherLocal;

    impl LocalMd for MineLocal {
        fn public_md(&self) -> Vec<u8> {
            Vec::new()
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }
    impl LocalMd for OtherLocal {
        fn public_md(&self) -> Vec<u8> {
            Vec::new()
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }
    impl RemoteMd for MineRemote {
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[test]
    fn entry_metadata_of_another_backend_is_an_error() {
        let region = Region {
            kind: MemKind::Dram,
            desc: Desc::new(0x1000, 64, 0),
        };
        let entry = |local_md: &'static dyn LocalMd| XferEntry {
            local: region.desc,
            local_region: &region,
            local_md,
            remote: region.desc,
            remote_region: &region,
            remote_md: &MineRemote,
        };
        assert!(entry(&MineLocal)
            .metadata::<MineLocal, MineRemote>("MINE")
            .is_ok());
        let err = entry(&OtherLocal)
            .metadata::<MineLocal, MineRemote>("MINE")
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidParam(m) if m == "local metadata is not MINE's"),
            "{err}"
        );
        let err = entry(&MineLocal)
            .metadata::<MineLocal, MineLocal>("MINE")
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidParam(m) if m == "remote metadata is not MINE's"),
            "{err}"
        );
    }
}
