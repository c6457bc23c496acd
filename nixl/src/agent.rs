//! The agent: registrations, peers' metadata, transfers and notifications.

mod device_api;
mod request;

use request::ReqState;
pub use request::{XferDlist, XferReq};

use crate::backend::{
    Backend, BackendInit, BackendParams, BackendRegistry, BackendXfer, LocalMd, NotifSignal,
    NotifWaker, RemoteMd, XferEntry, XferOp, XferTelemetry,
};
use crate::error::{Error, Result};
use crate::listener::JobToken;
use crate::mem::{Desc, DescList, Lookup, MemKind, Region, RegionIndex};
use crate::metadata::{AgentMetadata, BackendSection};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long [`XferReq::wait`] polls without yielding the CPU, where there are cores to
/// spare ([`spin_before_yield`]).
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(100);
/// How long [`XferReq::wait`] polls without yielding: [`SPIN_BEFORE_YIELD`] where the
/// process has the cores to spin ([`crate::os::may_spin`]), else nothing. A transfer
/// moves on other threads (the backend's progress threads, a peer's on the same host):
/// where cores are few, a waiter that holds one without yielding keeps them off it until
/// the scheduler's next tick, and every small transfer then costs the whole spin.
fn spin_before_yield() -> Duration {
    if crate::os::may_spin() {
        SPIN_BEFORE_YIELD
    } else {
        Duration::ZERO
    }
}

/// How an agent is set up (NIXL's `nixlAgentConfig`).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Backends progress transfers on their own threads (otherwise the caller's status
    /// polls progress them).
    pub progress_thread: bool,
    /// Where the peer-to-peer metadata listener binds (`None`: no listener).
    pub listen_addr: Option<SocketAddr>,
    /// A posted transfer whose completed-operation count has not moved for this long
    /// fails with [`Error::Stalled`].
    pub stall_timeout: Duration,
    /// Bound on each metadata exchange (connect, send, receive): every request to this
    /// agent's listener must arrive whole within it, and every exchange this agent starts
    /// must be answered within it.
    pub metadata_timeout: Duration,
    /// The job's shared secret for the metadata listener, in both directions: with one,
    /// this agent's listener serves only connections that prove they hold it, and this
    /// agent proves it (and checks the listener's proof) on every exchange it starts;
    /// `None`: no authentication ([`JobToken`] says what each mode protects against).
    /// The default is [`JobToken::from_env`] (`NIXL_JOB_TOKEN`). Without one, every
    /// connection to the listener is unauthenticated and a metadata push over 16 MiB
    /// (about 400,000 regions) is refused; with one, an authenticated push may reach
    /// 64 MiB.
    pub job_token: Option<JobToken>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            progress_thread: true,
            listen_addr: None,
            stall_timeout: Duration::from_secs(30),
            metadata_timeout: Duration::from_secs(10),
            job_token: JobToken::from_env(),
        }
    }
}

/// Checks every VRAM descriptor against what the driver says the pointer is: a host
/// pointer declared VRAM, another GPU's memory or freed memory is refused here, before any
/// backend sees it.
#[cfg(feature = "cuda")]
fn check_vram(list: &DescList) -> Result<()> {
    for (index, d) in list.descs().iter().enumerate() {
        let device = usize::try_from(d.dev_id).unwrap_or(usize::MAX);
        match gpu_mem::check_device_range(d.addr, d.len, device) {
            Ok(_) => {}
            Err(gpu_mem::Error::NotDeviceMemory { found, .. }) => {
                return Err(Error::NotDeviceMemory {
                    index,
                    addr: d.addr,
                    len: d.len,
                    dev_id: d.dev_id,
                    reason: found,
                })
            }
            Err(e) => return Err(Error::Gpu(format!("checking VRAM descriptor {index}: {e}"))),
        }
    }
    Ok(())
}

/// Without GPU support only a user-written backend can take VRAM: nothing to check with.
#[cfg(not(feature = "cuda"))]
fn check_vram(_list: &DescList) -> Result<()> {
    Ok(())
}

/// A peer region as one backend parsed it: (region, backend name, backend index, its view
/// or `None` where the backend cannot reach that kind on a peer).
type LoadedRegion = (Region, String, usize, Option<Arc<dyn RemoteMd>>);

/// One local registration: a region plus each backend's metadata for it.
#[derive(Debug)]
pub(crate) struct LocalReg {
    id: u64,
    region: Region,
    /// Indexed like the agent's backend list; `None` where that backend did not register it.
    mds: Vec<Option<Arc<dyn LocalMd>>>,
    /// Set when its [`RegistrationHandle`] is dropped: lists prepared before still hold
    /// it, but their memory may be freed now, so no new request may use it.
    released: AtomicBool,
}

/// One region a peer advertised, with each local backend's view of it.
#[derive(Debug)]
pub(crate) struct RemoteReg {
    region: Region,
    mds: Vec<Option<Arc<dyn RemoteMd>>>,
}

#[derive(Debug, Default)]
struct LocalState {
    next_id: u64,
    regs: HashMap<u64, Arc<LocalReg>>,
    index: HashMap<(MemKind, u64), RegionIndex<Arc<LocalReg>>>,
    /// Bumped on every (de)registration: tells when the loopback view is stale.
    generation: u64,
}

#[derive(Debug)]
struct RemoteAgent {
    index: HashMap<(MemKind, u64), RegionIndex<Arc<RemoteReg>>>,
    /// Regions already loaded, so partial metadata adds without duplicating.
    known: std::collections::HashSet<(Region, String)>,
    /// Unique per load of this peer: prepared lists from an older load are refused.
    generation: u64,
    /// Local generation this view was built from (loopback only).
    local_generation: Option<u64>,
    /// The incarnation of the peer that requests made now talk to.
    life: Arc<PeerLife>,
    /// Connection information per backend, as bound (sorted by backend name; empty
    /// while only regions were loaded): see "Binding" on [`Agent::load_remote_metadata`].
    conn_infos: Vec<(String, Vec<u8>)>,
    /// Network addresses the peer is known at: the source of the listener connection that
    /// bound it, and every listener address this agent fetched it from. Listener requests
    /// naming the peer (metadata pushes after the binding, invalidations) must come from
    /// one of them.
    addrs: Vec<IpAddr>,
}

/// Where a metadata blob came from: what it may change depends on it (see "Binding" on
/// [`Agent::load_remote_metadata`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MdSource {
    /// The application: [`Agent::load_remote_metadata`] (the etcd client included).
    Application,
    /// The answer of the listener at this address to this agent's fetch.
    Fetched(SocketAddr),
    /// Pushed to this agent's listener over a TCP connection from this address.
    Pushed(SocketAddr),
    /// This agent's own view of itself (loopback transfers), built from its registrations
    /// at this local generation.
    Loopback(u64),
}

impl MdSource {
    fn addr(self) -> Option<IpAddr> {
        match self {
            MdSource::Fetched(a) | MdSource::Pushed(a) => Some(a.ip()),
            MdSource::Application | MdSource::Loopback(_) => None,
        }
    }
}

/// What the binding rules let a blob do to a peer entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admission {
    /// The name is not bound (or its bound incarnation is gone): the blob's connection
    /// information, if any, binds it now.
    Bind,
    /// The bound incarnation, again (identical connection information, or regions only).
    Same,
}

/// A peer entry as the binding rules see it.
#[derive(Debug)]
struct BoundPeer {
    conn_infos: Vec<(String, Vec<u8>)>,
    addrs: Vec<IpAddr>,
    /// Its incarnation is known to be over (a transport reported it disconnected or dead).
    gone: bool,
}

/// The binding rules (see [`Agent::load_remote_metadata`]): whether a blob naming `name`,
/// with connection information `incoming` (`None`: regions only), from `source`, may be
/// loaded over `bound` (`None`: nothing bound yet).
fn admit(
    name: &str,
    bound: Option<&BoundPeer>,
    incoming: Option<&[(String, Vec<u8>)]>,
    source: MdSource,
) -> std::result::Result<Admission, String> {
    if matches!(source, MdSource::Loopback(_)) {
        return Ok(Admission::Bind);
    }
    let Some(bound) = bound.filter(|b| !b.conn_infos.is_empty()) else {
        return Ok(Admission::Bind);
    };
    match incoming {
        Some(info) if info != bound.conn_infos.as_slice() => {
            if bound.gone {
                Ok(Admission::Bind)
            } else {
                Err(format!(
                    "`{name}` is bound to the connection information it first arrived with, \
                     and that incarnation is alive: other connection information is accepted \
                     once its transport reports it gone, or once it is invalidated (by itself \
                     over the listener, or here with invalidate_remote)"
                ))
            }
        }
        _ => match source {
            MdSource::Pushed(from) if !bound.addrs.contains(&from.ip()) => Err(format!(
                "pushed from {from}, but `{name}` is known only at {}",
                describe_addrs(&bound.addrs)
            )),
            _ => Ok(Admission::Same),
        },
    }
}

/// `addrs` for a message: "[a, b]" or a phrase saying there is none.
fn describe_addrs(addrs: &[IpAddr]) -> String {
    if addrs.is_empty() {
        "no network address (it was loaded by the application, not over the listener)".into()
    } else {
        format!("{addrs:?}")
    }
}

/// Whether the incarnation of a peer that a request was made for is still the current one.
#[derive(Debug, Default)]
pub(crate) struct PeerLife {
    state: AtomicU8,
    /// A transport reported this incarnation disconnected ([`Error::RemoteDisconnect`]
    /// from a request or a notification): its name may be bound to a new incarnation.
    disconnected: AtomicBool,
}

impl PeerLife {
    const ALIVE: u8 = 0;
    const INVALIDATED: u8 = 1;
    const REPLACED: u8 = 2;

    fn end(&self, how: u8) {
        let _ = self
            .state
            .compare_exchange(Self::ALIVE, how, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Records that a transport reported this incarnation disconnected.
    pub(crate) fn mark_disconnected(&self) {
        self.disconnected.store(true, Ordering::Release);
    }

    /// The incarnation's connection was loaded again (a reconnect): a disconnection
    /// reported before no longer says it is gone.
    fn clear_disconnected(&self) {
        self.disconnected.store(false, Ordering::Release);
    }

    fn is_disconnected(&self) -> bool {
        self.disconnected.load(Ordering::Acquire)
    }

    /// `None` while alive; otherwise why requests to it are over.
    fn gone(&self) -> Option<&'static str> {
        match self.state.load(Ordering::Acquire) {
            Self::ALIVE => None,
            Self::INVALIDATED => Some("its metadata was invalidated"),
            _ => Some("it was reloaded with new connection information (a new incarnation)"),
        }
    }
}

/// Number of locks peer loads are striped over ([`AgentInner::load_locks`]).
const LOAD_LOCK_STRIPES: usize = 16;

/// A request's backend transfer, reachable from the agent so that shutdown can release it.
type ReqSlot = Mutex<Option<Box<dyn BackendXfer>>>;

pub(crate) struct AgentInner {
    pub(crate) name: String,
    pub(crate) config: AgentConfig,
    /// The constructors [`Agent::create_backend`] builds from.
    registry: BackendRegistry,
    backends: RwLock<Vec<Arc<dyn Backend>>>,
    local: RwLock<LocalState>,
    remotes: RwLock<HashMap<String, RemoteAgent>>,
    /// Serialize the loads and invalidations of one peer name (striped by the name's
    /// hash): the binding decision, the backends' connection set-up and the table update
    /// happen as one step, without holding `remotes` across the set-up (a backend's
    /// handshake may take seconds; transfers read `remotes`).
    load_locks: [Mutex<()>; LOAD_LOCK_STRIPES],
    generation: AtomicU64,
    pub(crate) listener: Mutex<Option<crate::listener::Listener>>,
    /// Set by [`Agent::shutdown`].
    shut: AtomicBool,
    /// Every live request's backend transfer, by request id.
    requests: Mutex<HashMap<u64, Weak<ReqSlot>>>,
    next_request: AtomicU64,
    /// Woken by the backends' notifications ([`Agent::wait_notifs`]).
    notif_signal: Arc<NotifSignal>,
    /// Backends with notifications that do not wake [`Agent::wait_notifs`] (re-polled).
    silent_backends: AtomicUsize,
}

impl AgentInner {
    /// Releases the backend transfer of every live request (they report
    /// [`Error::Canceled`] from then on).
    fn cancel_requests(&self) {
        let slots: Vec<Arc<ReqSlot>> = self
            .requests
            .lock()
            .drain()
            .filter_map(|(_, w)| w.upgrade())
            .collect();
        for slot in slots {
            let taken = slot.lock().take();
            drop(taken);
        }
    }
}

impl Drop for AgentInner {
    fn drop(&mut self) {
        self.cancel_requests();
    }
}

/// A transfer agent (NIXL's `nixlAgent`).
///
/// # Thread safety
/// `Agent` is `Send + Sync` and cheap to clone (an `Arc`). Every method takes `&self`
/// and may be called from any number of threads at once: registration, metadata loads
/// and invalidations take internal locks; preparing, posting and polling transfers do not
/// block each other (each [`XferReq`] is owned by one thread at a time, `&mut`).
/// Backends are required to be thread-safe ([`Backend`] is `Send + Sync`).
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<AgentInner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl Agent {
    /// Creates an agent that builds backends from `registry` ([`Agent::create_backend`]);
    /// starts the metadata listener if `config.listen_addr` is set. [`Agent::new`] is this
    /// with the backends built into this crate.
    pub fn with_registry(
        name: impl Into<String>,
        config: AgentConfig,
        registry: BackendRegistry,
    ) -> Result<Self> {
        let name = name.into();
        if name.is_empty() || name.len() > u16::MAX as usize {
            return Err(Error::InvalidParam(
                "agent name must be 1..=65535 bytes".into(),
            ));
        }
        let listen = config.listen_addr;
        let agent = Agent {
            inner: Arc::new(AgentInner {
                name,
                config,
                registry,
                backends: RwLock::new(Vec::new()),
                local: RwLock::new(LocalState::default()),
                remotes: RwLock::new(HashMap::new()),
                load_locks: std::array::from_fn(|_| Mutex::new(())),
                generation: AtomicU64::new(1),
                listener: Mutex::new(None),
                shut: AtomicBool::new(false),
                requests: Mutex::new(HashMap::new()),
                next_request: AtomicU64::new(1),
                notif_signal: Arc::default(),
                silent_backends: AtomicUsize::new(0),
            }),
        };
        if let Some(addr) = listen {
            let listener = crate::listener::Listener::start(&agent, addr)?;
            *agent.inner.listener.lock() = Some(listener);
        }
        Ok(agent)
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The configuration it was created with.
    pub fn config(&self) -> &AgentConfig {
        &self.inner.config
    }

    /// Where the metadata listener is bound (the port is resolved when 0 was asked for).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.inner.listener.lock().as_ref().map(|l| l.local_addr())
    }

    /// The constructors [`Agent::create_backend`] knows.
    pub fn registry(&self) -> &BackendRegistry {
        &self.inner.registry
    }

    /// What a backend constructor gets from this agent: its name, progress-thread setting
    /// and listener address, with `params`. For building a backend by hand (e.g. to keep
    /// its concrete type) and adding it with [`Agent::add_backend`].
    pub fn backend_init(&self, params: BackendParams) -> BackendInit {
        let mut init = BackendInit::new(self.inner.name.clone());
        init.progress_thread = self.inner.config.progress_thread;
        init.listen_addr = self.listen_addr();
        init.params = params;
        init.registry = self.inner.registry.clone();
        init
    }

    /// Creates a backend by name with string parameters and adds it.
    #[doc(alias = "createBackend")]
    pub fn create_backend(&self, name: &str, params: &BackendParams) -> Result<Arc<dyn Backend>> {
        let backend = self
            .inner
            .registry
            .create(name, &self.backend_init(params.clone()))?;
        self.add_backend(backend.clone())?;
        Ok(backend)
    }

    /// Adds a backend built by the caller (a user-written transport); hands it the
    /// agent's notification waker ([`Backend::set_notif_waker`]).
    pub fn add_backend(&self, backend: Arc<dyn Backend>) -> Result<()> {
        {
            let mut backends = self.inner.backends.write();
            if backends.iter().any(|b| b.name() == backend.name()) {
                return Err(Error::InvalidParam(format!(
                    "a backend named {} already exists",
                    backend.name()
                )));
            }
            backends.push(backend.clone());
        }
        // Outside the lock: the backend's code may call into the agent. A waiter that
        // sleeps meanwhile is woken below and looks at the new backend then.
        let waker = NotifWaker::new(self.inner.notif_signal.clone());
        if !backend.set_notif_waker(waker.clone()) && backend.capabilities().notif {
            self.inner.silent_backends.fetch_add(1, Ordering::SeqCst);
        }
        waker.wake();
        Ok(())
    }

    /// The backends, in creation order.
    pub fn backends(&self) -> Vec<Arc<dyn Backend>> {
        self.inner.backends.read().clone()
    }

    /// Registers memory with every backend that supports its kind (or only those named).
    ///
    /// # Safety
    /// Every descriptor must name memory that stays valid (allocated, not moved) until the
    /// returned handle is dropped and no transfer using it is in flight, and that the
    /// program tolerates being read or written at any time by peers that have this agent's
    /// metadata (RDMA is one-sided: the CPU is not involved).
    #[doc(alias = "registerMem")]
    pub unsafe fn register_mem(
        &self,
        list: &DescList,
        only_backends: Option<&[&str]>,
    ) -> Result<RegistrationHandle> {
        list.validate()?;
        let kind = list.kind();
        let backends = self.backends();
        let chosen: Vec<bool> = backends
            .iter()
            .map(|b| {
                b.supported_mem().contains(&kind)
                    && only_backends
                        .is_none_or(|names| names.iter().any(|n| n.eq_ignore_ascii_case(b.name())))
            })
            .collect();
        if !chosen.iter().any(|c| *c) {
            return Err(match (only_backends, backends.first()) {
                (Some([name, ..]), _) => Error::UnsupportedMemKind {
                    backend: name.to_string(),
                    kind,
                },
                (_, Some(b)) => Error::UnsupportedMemKind {
                    backend: b.name().to_string(),
                    kind,
                },
                (_, None) => Error::InvalidParam("no backend has been created".into()),
            });
        }
        if kind == MemKind::Vram {
            check_vram(list)?;
        }
        let mut regs = Vec::with_capacity(list.len());
        for desc in list.descs() {
            let region = Region { kind, desc: *desc };
            let mut mds = Vec::with_capacity(backends.len());
            for (backend, use_it) in backends.iter().zip(&chosen) {
                mds.push(if *use_it {
                    Some(backend.register_mem(&region)?)
                } else {
                    None
                });
            }
            regs.push((region, mds));
        }
        let mut local = self.inner.local.write();
        let mut ids = Vec::with_capacity(regs.len());
        for (region, mds) in regs {
            local.next_id += 1;
            let reg = Arc::new(LocalReg {
                id: local.next_id,
                region,
                mds,
                released: AtomicBool::new(false),
            });
            local
                .index
                .entry((kind, region.desc.dev_id))
                .or_default()
                .insert(region.desc.addr, region.end(), reg.clone());
            local.regs.insert(reg.id, reg);
            ids.push(local.next_id);
        }
        local.generation += 1;
        Ok(RegistrationHandle {
            agent: self.inner.clone(),
            ids,
        })
    }

    /// Which of `list`'s descriptors are registered, and with which backends: each
    /// backend's name, followed by how it reaches the memory where it has a choice
    /// (`LIBFABRIC(staged)`, `LIBFABRIC(direct)`: see [`crate::backend::LocalMd::mode`]).
    #[doc(alias = "queryMem")]
    pub fn query_mem(&self, list: &DescList) -> Vec<Option<Vec<String>>> {
        let backends = self.backends();
        let local = self.inner.local.read();
        list.descs()
            .iter()
            .map(|d| {
                let end = d.checked_end(0).ok()?;
                match local
                    .index
                    .get(&(list.kind(), d.dev_id))?
                    .lookup(d.addr, end)
                {
                    Lookup::Inside(reg) => Some(
                        reg.mds
                            .iter()
                            .zip(&backends)
                            .filter_map(|(md, b)| {
                                let md = md.as_ref()?;
                                Some(match md.mode() {
                                    Some(mode) => format!("{}({mode})", b.name()),
                                    None => b.name().to_string(),
                                })
                            })
                            .collect(),
                    ),
                    _ => None,
                }
            })
            .collect()
    }

    /// NIXL's `queryMem` with a backend named: asks backend `backend` about the storage
    /// that each descriptor's metadata names (`meta[i]` is descriptor `i`'s `metaInfo`,
    /// e.g. a file path for `POSIX`); per descriptor `None` where it does not exist, else
    /// the backend's information (for files: `size`, `mode`, `mtime`). Nothing needs to be
    /// registered. A backend without such queries answers [`Error::NotSupported`]; a
    /// backend this agent has not created is [`Error::UnknownBackend`].
    #[doc(alias = "queryMem")]
    pub fn query_mem_info(
        &self,
        backend: &str,
        kind: MemKind,
        meta: &[&[u8]],
    ) -> Result<Vec<Option<BackendParams>>> {
        let found = self
            .backends()
            .into_iter()
            .find(|b| b.name().eq_ignore_ascii_case(backend))
            .ok_or_else(|| Error::UnknownBackend(backend.to_string()))?;
        found.query_mem_info(kind, meta)
    }

    /// This agent's full metadata: connection info of every backend and every registration.
    #[doc(alias = "getLocalMD")]
    pub fn local_metadata(&self) -> Result<Vec<u8>> {
        self.build_metadata(None, true)?.encode()
    }

    /// Partial metadata: only the registrations covering `list` (none if `None`), and the
    /// connection information only if `include_conn_info`.
    #[doc(alias = "getLocalPartialMD")]
    pub fn local_partial_metadata(
        &self,
        list: Option<&DescList>,
        include_conn_info: bool,
    ) -> Result<Vec<u8>> {
        let selected = match list {
            None => Some(Vec::new()),
            Some(list) => {
                let prepared = self.prep_xfer_dlist(None, list)?;
                let mut ids: Vec<u64> = prepared.local_regs.iter().map(|r| r.id).collect();
                ids.sort_unstable();
                ids.dedup();
                Some(ids)
            }
        };
        self.build_metadata(selected.as_deref(), include_conn_info)?
            .encode()
    }

    fn build_metadata(
        &self,
        only_ids: Option<&[u64]>,
        include_conn_info: bool,
    ) -> Result<AgentMetadata> {
        let backends = self.backends();
        let local = self.inner.local.read();
        let mut regs: Vec<&Arc<LocalReg>> = match only_ids {
            Some(ids) => ids.iter().filter_map(|id| local.regs.get(id)).collect(),
            None => local.regs.values().collect(),
        };
        regs.sort_by_key(|r| r.id);
        let mut sections = Vec::with_capacity(backends.len());
        for (i, backend) in backends.iter().enumerate() {
            let conn_info = if include_conn_info {
                Some(backend.connection_info()?)
            } else {
                None
            };
            let regions = regs
                .iter()
                .filter_map(|r| {
                    r.mds[..]
                        .get(i)?
                        .as_ref()
                        .map(|md| (r.region, md.public_md()))
                })
                .collect();
            sections.push(BackendSection {
                backend: backend.name().to_string(),
                conn_info,
                regions,
            });
        }
        Ok(AgentMetadata {
            agent: self.inner.name.clone(),
            sections,
        })
    }

    /// Loads a peer's (full or partial) metadata and returns its name. Connection info in
    /// the blob replaces what was known (a restarted peer reconnects: prepared lists made
    /// before are refused and must be prepared again); regions are added.
    ///
    /// # Binding
    /// A peer's name is bound to the connection information (every backend's) that it
    /// first arrived with, until that incarnation ends, so that a blob from anyone else
    /// cannot redirect transfers meant for it. Refused with [`Error::MetadataRefused`]
    /// (logged; nothing of the blob is loaded, no backend sees it):
    /// - a blob that names this agent itself (it would widen the view loopback transfers
    ///   are checked against);
    /// - other connection information under a bound name while the bound incarnation
    ///   lives. It ends, and the name may be bound anew, when a transport reports it
    ///   gone: a request or notification to it failed with [`Error::RemoteDisconnect`],
    ///   or a backend's liveness check declared it dead (its process exited, its
    ///   heartbeats stopped: [`Backend::peer_gone`]); or when it is invalidated — by itself
    ///   over the listener, by [`Agent::invalidate_remote`], or by the etcd watch when its
    ///   keys go. A peer restarted after a crash is therefore accepted as soon as this
    ///   agent has noticed the crash, and a peer that exits cleanly invalidates itself.
    /// - over the listener (see [`Agent::send_local_metadata`]): a blob naming a bound
    ///   peer that was pushed from an address the peer is not known at.
    ///
    /// Identical connection information (the same incarnation publishing again, e.g. new
    /// registrations) and partial metadata without connection information are loaded.
    ///
    /// What "known at" checks, exactly: the IP address (not the port) of the TCP
    /// connection a listener request arrived on must be one of the peer's known addresses
    /// — the source IP of the listener connection that bound it, and the IP of every
    /// listener address this agent fetched its metadata from
    /// ([`Agent::fetch_remote_metadata`]). A peer bound by the application (this method,
    /// etcd) has none, so listener requests naming it are refused. The same check gates an
    /// invalidation over the listener ([`Agent::invalidate_local_metadata`]). An address
    /// names a host, not a process: on a shared host, use a [`JobToken`] as well.
    #[doc(alias = "loadRemoteMD")]
    pub fn load_remote_metadata(&self, blob: &[u8]) -> Result<String> {
        self.load_metadata_from(blob, MdSource::Application)
    }

    /// [`Agent::load_remote_metadata`] of a blob that came from `source`.
    pub(crate) fn load_metadata_from(&self, blob: &[u8], source: MdSource) -> Result<String> {
        let meta = AgentMetadata::decode(blob)?;
        let name = meta.agent.clone();
        self.load_decoded(meta, source)?;
        Ok(name)
    }

    /// The lock that serializes loads and invalidations of peer `name`.
    fn load_lock(&self, name: &str) -> parking_lot::MutexGuard<'_, ()> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(name);
        self.inner.load_locks[hash as usize % LOAD_LOCK_STRIPES].lock()
    }

    /// Applies the binding rules of [`Agent::load_remote_metadata`] to a blob naming
    /// `name`; the error says why it is refused (and is logged).
    fn admit_metadata(
        &self,
        name: &str,
        incoming: Option<&[(String, Vec<u8>)]>,
        source: MdSource,
    ) -> Result<Admission> {
        let refuse = |reason: String| {
            tracing::warn!(agent = name, ?source, %reason, "metadata refused");
            Err(Error::MetadataRefused {
                agent: name.to_string(),
                reason,
            })
        };
        let loopback = matches!(source, MdSource::Loopback(_));
        if name == self.inner.name && !loopback {
            return refuse(
                "it names this agent itself (only the agent's own registrations describe it)"
                    .into(),
            );
        }
        let bound = self.inner.remotes.read().get(name).map(|p| {
            (
                p.conn_infos.clone(),
                p.addrs.clone(),
                p.life.is_disconnected(),
            )
        });
        let bound = bound.map(|(conn_infos, addrs, disconnected)| {
            // Asked of the backends outside the peer table's lock.
            let gone = disconnected
                || self
                    .backends()
                    .iter()
                    .any(|b| conn_infos.iter().any(|(n, _)| n == b.name()) && b.peer_gone(name));
            BoundPeer {
                conn_infos,
                addrs,
                gone,
            }
        });
        admit(name, bound.as_ref(), incoming, source).or_else(refuse)
    }

    fn load_decoded(&self, meta: AgentMetadata, source: MdSource) -> Result<()> {
        let local_generation = match source {
            MdSource::Loopback(generation) => Some(generation),
            _ => None,
        };
        let backends = self.backends();
        let has_conn_info = meta.sections.iter().any(|s| s.conn_info.is_some());
        let mut conn_infos: Vec<(String, Vec<u8>)> = meta
            .sections
            .iter()
            .filter_map(|s| s.conn_info.clone().map(|c| (s.backend.clone(), c)))
            .collect();
        conn_infos.sort();
        let _serial = self.load_lock(&meta.agent);
        // Decided before any backend sees the blob: a refused blob changes nothing.
        let admission = self.admit_metadata(
            &meta.agent,
            has_conn_info.then_some(conn_infos.as_slice()),
            source,
        )?;
        // Parse everything before touching the peer table: a failure changes nothing.
        // The backends' connection set-up (which may wait for the peer) runs outside the
        // table's lock: transfers read it.
        let mut loaded: Vec<LoadedRegion> = Vec::new();
        for section in &meta.sections {
            let Some(bi) = backends.iter().position(|b| b.name() == section.backend) else {
                continue; // a backend this agent lacks: ignored, as NIXL does
            };
            if let Some(info) = &section.conn_info {
                backends[bi].load_remote_conn_info(&meta.agent, info)?;
            }
            let remote_kinds = backends[bi].supported_remote_mem();
            for (region, public) in &section.regions {
                // A kind this backend cannot reach on a peer (CUDA_IPC and host memory)
                // is still indexed, so the region is known and its transfers get
                // NoCommonBackend rather than an out-of-bounds error.
                let md = if remote_kinds.contains(&region.kind) {
                    Some(backends[bi].load_remote_md(&meta.agent, region, public)?)
                } else {
                    None
                };
                loaded.push((*region, section.backend.clone(), bi, md));
            }
        }
        let mut remotes = self.inner.remotes.write();
        if has_conn_info || !remotes.contains_key(&meta.agent) {
            // Connection information starts a fresh view of the peer (prepared lists made
            // before are refused). Only *different* connection information is a new
            // incarnation: requests made for the old one fail with RemoteDisconnect.
            let (life, mut addrs) = match remotes.get(&meta.agent) {
                Some(old) if old.conn_infos.is_empty() || old.conn_infos == conn_infos => {
                    (old.life.clone(), old.addrs.clone())
                }
                Some(old) => {
                    old.life.end(PeerLife::REPLACED);
                    (Arc::default(), Vec::new())
                }
                None => (Arc::default(), Vec::new()),
            };
            if admission == Admission::Bind && has_conn_info {
                // The binding: the new incarnation is known where it came from.
                addrs.clear();
            } else if has_conn_info {
                // The same incarnation, reconnected by the backends just now.
                life.clear_disconnected();
            }
            let conn_infos = if has_conn_info {
                conn_infos
            } else {
                Vec::new()
            };
            remotes.insert(
                meta.agent.clone(),
                RemoteAgent {
                    index: HashMap::new(),
                    known: Default::default(),
                    generation: self.inner.generation.fetch_add(1, Ordering::Relaxed),
                    local_generation,
                    life,
                    conn_infos,
                    addrs,
                },
            );
        }
        let peer = remotes.get_mut(&meta.agent).expect("inserted above");
        peer.local_generation = local_generation.or(peer.local_generation);
        if let Some(ip) = source.addr() {
            if !peer.addrs.contains(&ip) {
                peer.addrs.push(ip);
            }
        }
        // Group the per-backend views of one region into one entry.
        let mut grouped: HashMap<Region, Vec<Option<Arc<dyn RemoteMd>>>> = HashMap::new();
        for (region, backend, bi, md) in loaded {
            if !peer.known.insert((region, backend)) {
                continue;
            }
            let mds = grouped
                .entry(region)
                .or_insert_with(|| vec![None; backends.len()]);
            mds[bi] = md;
        }
        for (region, mds) in grouped {
            peer.index
                .entry((region.kind, region.desc.dev_id))
                .or_default()
                .insert(
                    region.desc.addr,
                    region.end(),
                    Arc::new(RemoteReg { region, mds }),
                );
        }
        Ok(())
    }

    /// Forgets a peer and disconnects it in every backend.
    #[doc(alias = "invalidateRemoteMD")]
    pub fn invalidate_remote(&self, agent: &str) -> Result<()> {
        let _serial = self.load_lock(agent);
        self.invalidate_locked(agent)
    }

    /// [`Agent::invalidate_remote`] asked over the listener by a connection from `from`:
    /// honoured only when `from` is an address `agent` is known at (see "Binding" on
    /// [`Agent::load_remote_metadata`]), so that only the peer itself can make this agent
    /// forget it.
    pub(crate) fn invalidate_remote_from(&self, agent: &str, from: SocketAddr) -> Result<()> {
        let _serial = self.load_lock(agent);
        let addrs = match self.inner.remotes.read().get(agent) {
            Some(peer) => peer.addrs.clone(),
            None => return Err(Error::UnknownAgent(agent.to_string())),
        };
        if !addrs.contains(&from.ip()) {
            let reason = format!(
                "invalidation asked from {from}, but `{agent}` is known only at {}",
                describe_addrs(&addrs)
            );
            tracing::warn!(agent, %from, %reason, "invalidation refused");
            return Err(Error::MetadataRefused {
                agent: agent.to_string(),
                reason,
            });
        }
        self.invalidate_locked(agent)
    }

    fn invalidate_locked(&self, agent: &str) -> Result<()> {
        let removed = self.inner.remotes.write().remove(agent);
        let Some(removed) = removed else {
            return Err(Error::UnknownAgent(agent.to_string()));
        };
        removed.life.end(PeerLife::INVALIDATED);
        for backend in self.backends() {
            backend.disconnect(agent);
        }
        Ok(())
    }

    /// Forgets every peer (NIXL's `invalidateAllRemotes`).
    pub fn invalidate_all_remotes(&self) {
        let removed: Vec<(String, RemoteAgent)> = self.inner.remotes.write().drain().collect();
        let backends = self.backends();
        for (name, peer) in removed {
            peer.life.end(PeerLife::INVALIDATED);
            for backend in &backends {
                backend.disconnect(&name);
            }
        }
    }

    /// Shuts the agent down: every live [`XferReq`] is released at once (its transport
    /// stops issuing operations, its notification is not sent if it has not been) and
    /// reports [`Error::Canceled`] from then on; every peer is forgotten and
    /// disconnected; the metadata listener stops; the backends are dropped from the
    /// agent (each goes away when the last request using it is dropped). New requests
    /// fail with [`Error::Canceled`]. Idempotent. Dropping the last handle of an agent
    /// (every clone and every [`RegistrationHandle`]) cancels live requests the same way.
    pub fn shutdown(&self) {
        if self.inner.shut.swap(true, Ordering::AcqRel) {
            return;
        }
        self.inner.cancel_requests();
        let listener = self.inner.listener.lock().take();
        drop(listener);
        self.invalidate_all_remotes();
        self.inner.backends.write().clear();
        // Waiters in `wait_notifs` return: no backend is left to notify them.
        NotifWaker::new(self.inner.notif_signal.clone()).wake();
    }

    /// Whether [`Agent::shutdown`] was called.
    pub fn is_shut_down(&self) -> bool {
        self.inner.shut.load(Ordering::Acquire)
    }

    /// The regions a peer advertised (sorted by kind, device and address).
    pub fn remote_regions(&self, agent: &str) -> Result<Vec<Region>> {
        let remotes = self.inner.remotes.read();
        let peer = remotes
            .get(agent)
            .ok_or_else(|| Error::UnknownAgent(agent.to_string()))?;
        let mut regions: Vec<Region> = peer.known.iter().map(|(r, _)| *r).collect();
        regions.sort_by_key(|r| (r.kind, r.desc.dev_id, r.desc.addr, r.desc.len));
        regions.dedup();
        Ok(regions)
    }

    /// Whether metadata of `agent` is loaded.
    #[doc(alias = "checkRemoteMD")]
    pub fn has_remote(&self, agent: &str) -> bool {
        self.inner.remotes.read().contains_key(agent)
    }

    /// Validates a descriptor list once, for many transfers: `agent` is `None` for this
    /// agent's own (initiator-side) memory, or a peer's name (this agent's own name for
    /// loopback transfers). Every descriptor must lie inside one registered region.
    #[doc(alias = "prepXferDlist")]
    pub fn prep_xfer_dlist(&self, agent: Option<&str>, list: &DescList) -> Result<XferDlist> {
        if self.is_shut_down() {
            return Err(Error::Canceled);
        }
        let kind = list.kind();
        match agent {
            None => {
                let local = self.inner.local.read();
                let (slots, local_regs) = resolve_descs(
                    list.descs(),
                    |dev_id| local.index.get(&(kind, dev_id)),
                    |index, d, partial| Error::NotRegistered {
                        index,
                        kind,
                        addr: d.addr,
                        len: d.len,
                        dev_id: d.dev_id,
                        partial,
                    },
                )?;
                Ok(XferDlist {
                    agent: None,
                    kind,
                    uniform_len: uniform_len(list.descs()),
                    descs: list.descs().to_vec(),
                    slots,
                    local_regs,
                    remote_regs: Vec::new(),
                    generation: 0,
                    prepared: Default::default(),
                })
            }
            Some(name) => {
                if name == self.inner.name {
                    self.refresh_loopback_view()?;
                }
                let remotes = self.inner.remotes.read();
                let peer = remotes
                    .get(name)
                    .ok_or_else(|| Error::UnknownAgent(name.to_string()))?;
                let (slots, remote_regs) = resolve_descs(
                    list.descs(),
                    |dev_id| peer.index.get(&(kind, dev_id)),
                    |index, d, _partial| Error::RemoteOutOfBounds {
                        agent: name.to_string(),
                        index,
                        kind,
                        addr: d.addr,
                        len: d.len,
                        dev_id: d.dev_id,
                    },
                )?;
                Ok(XferDlist {
                    agent: Some(name.to_string()),
                    kind,
                    uniform_len: uniform_len(list.descs()),
                    descs: list.descs().to_vec(),
                    slots,
                    local_regs: Vec::new(),
                    remote_regs,
                    generation: peer.generation,
                    prepared: Default::default(),
                })
            }
        }
    }

    /// Keeps the agent's view of itself (for loopback transfers) in step with its
    /// registrations.
    fn refresh_loopback_view(&self) -> Result<()> {
        let current = self.inner.local.read().generation;
        let seen = self
            .inner
            .remotes
            .read()
            .get(&self.inner.name)
            .and_then(|p| p.local_generation);
        if seen != Some(current) {
            let meta = self.build_metadata(None, true)?;
            self.load_decoded(meta, MdSource::Loopback(current))?;
        }
        Ok(())
    }

    /// Checks a list prepared with `peer`'s name against the peer's metadata as it is now:
    /// the peer's life token, and the list prepared again where it had to be (else
    /// `None`: use it as it is). A list of this agent itself goes stale whenever its
    /// registrations change (the view it is resolved against is rebuilt): another
    /// thread registering memory must not fail it, so it is resolved again (a descriptor
    /// no longer registered is reported as such). A peer's reload stays an error: it may
    /// be a new incarnation.
    pub(crate) fn current_remote_list(
        &self,
        peer: &str,
        list: &XferDlist,
    ) -> Result<(Option<XferDlist>, Arc<PeerLife>)> {
        let loopback = peer == self.inner.name;
        if loopback {
            self.refresh_loopback_view()?;
        }
        let mut refreshed: Option<XferDlist> = None;
        let mut attempts = 0;
        loop {
            let current = refreshed.as_ref().unwrap_or(list);
            {
                let remotes = self.inner.remotes.read();
                match remotes.get(peer) {
                    Some(p) if p.generation == current.generation => {
                        return Ok((refreshed, p.life.clone()))
                    }
                    Some(_) if loopback && attempts < 3 => {}
                    Some(_) => {
                        return Err(Error::InvalidParam(format!(
                            "metadata of `{peer}` was reloaded since this list was prepared: prepare it again"
                        )))
                    }
                    None => return Err(Error::UnknownAgent(peer.to_string())),
                }
            }
            attempts += 1;
            let again = self.prep_xfer_dlist(
                Some(peer),
                &DescList::from_descs(current.kind, current.descs.iter().copied()),
            )?;
            refreshed = Some(again);
        }
    }

    /// A backend transfer from every (local, remote) pair of a request by index, with the
    /// chosen backend's view of each pair's registrations (`usable` checked that every
    /// touched one has it).
    fn prep_by_entries(
        backend: &Arc<dyn Backend>,
        chosen: usize,
        op: XferOp,
        (local, local_idx): (&XferDlist, &[usize]),
        (remote, remote_idx): (&XferDlist, &[usize]),
        peer: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        // The chosen backend's view of each registration, by slot (`None`: not touched by
        // this request; every touched one has it, as `usable` checked).
        let local_views: Vec<Option<(&Region, &dyn LocalMd)>> = local
            .local_regs
            .iter()
            .map(|reg| Some((&reg.region, reg.mds.get(chosen)?.as_deref()?)))
            .collect();
        let remote_views: Vec<Option<(&Region, &dyn RemoteMd)>> = remote
            .remote_regs
            .iter()
            .map(|reg| Some((&reg.region, reg.mds.get(chosen)?.as_deref()?)))
            .collect();
        let mut entries: Vec<XferEntry<'_>> = Vec::with_capacity(local_idx.len());
        for (&li, &ri) in local_idx.iter().zip(remote_idx) {
            // Indices and slots were all checked by the caller, and every touched slot has
            // a view.
            let (Some(&(local_region, local_md)), Some(&(remote_region, remote_md))) = (
                local_views[local.slots[li] as usize].as_ref(),
                remote_views[remote.slots[ri] as usize].as_ref(),
            ) else {
                return Err(Error::InvalidParam(
                    "a prepared list lost a registration".into(),
                ));
            };
            entries.push(XferEntry {
                local: local.descs[li],
                local_region,
                local_md,
                remote: remote.descs[ri],
                remote_region,
                remote_md,
            });
        }
        backend.prep_xfer(op, &entries, peer)
    }

    /// Builds a transfer from prepared lists by index: `local_idx[i]` of `local` moves
    /// to/from `remote_idx[i]` of `remote`. With `backend` set, only that backend is used;
    /// otherwise the first (in creation order) that can reach both sides, where one that
    /// [prefers](Backend::prefers) this pair of memory kinds goes before the others.
    #[doc(alias = "makeXferReq")]
    #[allow(clippy::too_many_arguments)] // NIXL's makeXferReq, argument for argument
    pub fn make_xfer_req(
        &self,
        op: XferOp,
        local: &XferDlist,
        local_idx: &[usize],
        remote: &XferDlist,
        remote_idx: &[usize],
        notif: Option<Vec<u8>>,
        backend: Option<&str>,
    ) -> Result<XferReq> {
        if local.agent.is_some() {
            return Err(Error::InvalidParam(
                "the local list must be prepared with agent None".into(),
            ));
        }
        let Some(peer) = remote.agent.as_deref() else {
            return Err(Error::InvalidParam(
                "the remote list must be prepared with a peer's name".into(),
            ));
        };
        if local_idx.len() != remote_idx.len() {
            return Err(Error::Mismatch(format!(
                "{} local indices but {} remote indices",
                local_idx.len(),
                remote_idx.len()
            )));
        }
        if local_idx.is_empty() {
            return Err(Error::InvalidParam(
                "a transfer needs at least one descriptor".into(),
            ));
        }
        if self.is_shut_down() {
            return Err(Error::Canceled);
        }
        let loopback = peer == self.inner.name;
        let (refreshed, life) = self.current_remote_list(peer, remote)?;
        let remote = refreshed.as_ref().unwrap_or(remote);
        let backends = self.backends();
        let bad_index = |which: &str, i: usize, n: usize| {
            Error::InvalidParam(format!("{which} index {i} is out of range (list has {n})"))
        };
        // One pass over the indices: bounds, lengths, and which registrations of each
        // list the request touches (a list's slots were resolved at preparation).
        let mut used_local = vec![false; local.local_regs.len()];
        let mut used_remote = vec![false; remote.remote_regs.len()];
        let mut total_bytes = 0u64;
        let uniform = match (local.uniform_len, remote.uniform_len) {
            (Some(l), Some(r)) if l == r => Some(l),
            _ => None,
        };
        if let Some(len) = uniform {
            // Every length is the same on both sides (a KV cache's blocks): bounds, and the
            // slots of lists that span several registrations, are all there is to check.
            let (nl, nr) = (local.descs.len(), remote.descs.len());
            let (one_local, one_remote) = (used_local.len() == 1, used_remote.len() == 1);
            for (&li, &ri) in local_idx.iter().zip(remote_idx) {
                if li >= nl {
                    return Err(bad_index("local", li, nl));
                }
                if ri >= nr {
                    return Err(bad_index("remote", ri, nr));
                }
                if !one_local {
                    if let Some(u) = used_local.get_mut(local.slots[li] as usize) {
                        *u = true;
                    }
                }
                if !one_remote {
                    if let Some(u) = used_remote.get_mut(remote.slots[ri] as usize) {
                        *u = true;
                    }
                }
            }
            if one_local {
                used_local[0] = true;
            }
            if one_remote {
                used_remote[0] = true;
            }
            total_bytes = len.saturating_mul(local_idx.len() as u64);
        }
        if uniform.is_none() {
            for (&li, &ri) in local_idx.iter().zip(remote_idx) {
                let (Some(l), Some(&lslot)) = (local.descs.get(li), local.slots.get(li)) else {
                    return Err(bad_index("local", li, local.descs.len()));
                };
                let (Some(r), Some(&rslot)) = (remote.descs.get(ri), remote.slots.get(ri)) else {
                    return Err(bad_index("remote", ri, remote.descs.len()));
                };
                if l.len != r.len {
                    return Err(Error::Mismatch(format!(
                        "local descriptor {li} has {} bytes, remote descriptor {ri} has {}",
                        l.len, r.len
                    )));
                }
                total_bytes += l.len;
                if let Some(u) = used_local.get_mut(lslot as usize) {
                    *u = true;
                }
                if let Some(u) = used_remote.get_mut(rslot as usize) {
                    *u = true;
                }
            }
        }
        let used_local: Vec<&Arc<LocalReg>> = local
            .local_regs
            .iter()
            .zip(&used_local)
            .filter_map(|(reg, used)| used.then_some(reg))
            .collect();
        let used_remote: Vec<&Arc<RemoteReg>> = remote
            .remote_regs
            .iter()
            .zip(&used_remote)
            .filter_map(|(reg, used)| used.then_some(reg))
            .collect();
        // A registration released after the list was prepared: its memory may be freed.
        if used_local
            .iter()
            .any(|reg| reg.released.load(Ordering::Acquire))
        {
            let li = local_idx
                .iter()
                .copied()
                .find(|&li| local.is_released(li))
                .unwrap_or_default();
            return Err(local.deregistered(li));
        }
        let usable = |bi: usize, b: &Arc<dyn Backend>| {
            let caps = b.capabilities();
            (if loopback {
                caps.local || caps.remote
            } else {
                caps.remote
            }) && b.supported_mem().contains(&local.kind)
                && b.supported_remote_mem().contains(&remote.kind)
                && b.reach(peer).is_ok()
                && used_local
                    .iter()
                    .all(|reg| reg.mds.get(bi).is_some_and(Option::is_some))
                && used_remote
                    .iter()
                    .all(|reg| reg.mds.get(bi).is_some_and(Option::is_some))
        };
        let chosen = match backend {
            Some(name) => {
                let bi = backends
                    .iter()
                    .position(|b| b.name().eq_ignore_ascii_case(name))
                    .ok_or_else(|| Error::UnknownBackend(name.to_string()))?;
                let b = &backends[bi];
                for (kind, kinds) in [
                    (local.kind, b.supported_mem()),
                    (remote.kind, b.supported_remote_mem()),
                ] {
                    if !kinds.contains(&kind) {
                        return Err(Error::UnsupportedMemKind {
                            backend: b.name().to_string(),
                            kind,
                        });
                    }
                }
                b.reach(peer)?;
                if !usable(bi, b) {
                    return Err(Error::InvalidParam(format!(
                        "backend {} has not registered every descriptor on both sides",
                        b.name()
                    )));
                }
                bi
            }
            // A backend specialised for this pair of kinds first (`Backend::prefers`),
            // then creation order.
            None => backends
                .iter()
                .enumerate()
                .position(|(bi, b)| b.prefers(local.kind, remote.kind) && usable(bi, b))
                .or_else(|| {
                    backends
                        .iter()
                        .enumerate()
                        .position(|(bi, b)| usable(bi, b))
                })
                .ok_or_else(|| Error::NoCommonBackend {
                    agent: peer.to_string(),
                    local: local.kind,
                    remote: remote.kind,
                })?,
        };
        let backend = backends[chosen].clone();
        // Lists the backend resolved once serve requests by index directly; otherwise the
        // backend gets every (local, remote) pair with its registrations.
        let prepared = match local.prepared_for(chosen, &backend)? {
            Some(l) => remote.prepared_for(chosen, &backend)?.map(|r| (l, r)),
            None => None,
        };
        let inner = match prepared {
            Some((l, r)) => backend.prep_xfer_indexed(op, &l, local_idx, &r, remote_idx, peer),
            None => Self::prep_by_entries(
                &backend,
                chosen,
                op,
                (local, local_idx),
                (remote, remote_idx),
                peer,
            ),
        }
        .inspect_err(|e| {
            if matches!(e, Error::RemoteDisconnect { .. }) {
                life.mark_disconnected();
            }
        })?;
        let staged_bytes = inner.staged_bytes();
        // Keep every registration used alive while the request exists.
        let keep_local: Vec<Arc<LocalReg>> = used_local.into_iter().cloned().collect();
        let keep_remote: Vec<Arc<RemoteReg>> = used_remote.into_iter().cloned().collect();
        let id = self.inner.next_request.fetch_add(1, Ordering::Relaxed);
        let slot: Arc<ReqSlot> = Arc::new(Mutex::new(Some(inner)));
        self.inner.requests.lock().insert(id, Arc::downgrade(&slot));
        if self.is_shut_down() {
            // Raced with shutdown: it may have missed this slot.
            self.inner.cancel_requests();
            return Err(Error::Canceled);
        }
        Ok(XferReq {
            backend,
            slot,
            id,
            agent: Arc::downgrade(&self.inner),
            life,
            peer: peer.to_string(),
            notif,
            state: ReqState::Idle,
            stall_timeout: self.inner.config.stall_timeout,
            last_progress: (0, Instant::now()),
            telemetry: XferTelemetry {
                total_bytes,
                desc_count: local_idx.len(),
                post_time: None,
                post_duration: Duration::ZERO,
                xfer_duration: None,
                staged_bytes,
            },
            _keep_local: keep_local,
            _keep_remote: keep_remote,
        })
    }

    /// Prepares both lists and makes the request in one call (descriptor `i` to `i`).
    #[doc(alias = "createXferReq")]
    pub fn create_xfer_req(
        &self,
        op: XferOp,
        local: &DescList,
        remote: &DescList,
        remote_agent: &str,
        notif: Option<Vec<u8>>,
    ) -> Result<XferReq> {
        if local.len() != remote.len() {
            return Err(Error::Mismatch(format!(
                "{} local descriptors but {} remote",
                local.len(),
                remote.len()
            )));
        }
        let l = self.prep_xfer_dlist(None, local)?;
        let r = self.prep_xfer_dlist(Some(remote_agent), remote)?;
        let idx: Vec<usize> = (0..local.len()).collect();
        self.make_xfer_req(op, &l, &idx, &r, &idx, notif, None)
    }

    /// Sends a standalone notification through the first backend that has notifications
    /// and knows the peer.
    #[doc(alias = "genNotif")]
    pub fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        if !self.has_remote(agent) && agent != self.inner.name {
            return Err(Error::UnknownAgent(agent.to_string()));
        }
        let mut last = None;
        for backend in self.backends() {
            if backend.capabilities().notif {
                match backend.gen_notif(agent, msg) {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        self.note_failure(agent, &e);
                        last = Some(e)
                    }
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::InvalidParam("no backend supports notifications".into())))
    }

    /// Records a transport's report that `agent`'s current incarnation is disconnected
    /// (its name may then be bound to a new one: see [`Agent::load_remote_metadata`]).
    fn note_failure(&self, agent: &str, e: &Error) {
        if matches!(e, Error::RemoteDisconnect { .. }) {
            if let Some(peer) = self.inner.remotes.read().get(agent) {
                peer.life.mark_disconnected();
            }
        }
    }

    /// Takes the notifications received so far, grouped by sender, in arrival order.
    #[doc(alias = "getNotifs")]
    pub fn get_notifs(&self) -> HashMap<String, Vec<Vec<u8>>> {
        let mut raw = Vec::new();
        for backend in self.backends() {
            backend.take_notifs(&mut raw);
        }
        let mut map: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
        for (agent, msg) in raw {
            map.entry(agent).or_default().push(msg);
        }
        map
    }

    /// Longest interval at which [`Agent::wait_notifs`] re-polls a backend that does not
    /// wake it ([`Backend::set_notif_waker`] returned `false`: a user-written backend,
    /// or `VERBS`/`LIBFABRIC` without a progress thread). It starts at 50 µs and doubles
    /// up to this, so an answer that comes soon is seen soon and an idle wait costs
    /// about a hundred wake-ups a second, not thousands. Backends that wake it are never
    /// re-polled: the wait sleeps until a notification or the timeout.
    pub const WAIT_REPOLL_MAX: Duration = Duration::from_millis(10);

    /// [`Agent::get_notifs`] that blocks, without using the CPU, until at least one
    /// notification is there or `timeout` has passed (then the map is empty). Returns at
    /// once after [`Agent::shutdown`]. Several threads may wait at once; each
    /// notification is returned once, to whichever thread takes it first.
    pub fn wait_notifs(&self, timeout: Duration) -> HashMap<String, Vec<Vec<u8>>> {
        // `None`: a timeout too large for the clock, i.e. no bound.
        let deadline = Instant::now().checked_add(timeout);
        let waiter = self.inner.notif_signal.waiter();
        let mut repoll = Duration::from_micros(50);
        loop {
            // The epoch before the look: a wake after it keeps the sleep below short.
            let seen = waiter.epoch();
            let notifs = self.get_notifs();
            if !notifs.is_empty() || self.is_shut_down() {
                return notifs;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return notifs;
            }
            let mut until = deadline;
            if self.inner.silent_backends.load(Ordering::SeqCst) > 0 {
                let poll_at = now + repoll;
                until = Some(until.map_or(poll_at, |d| d.min(poll_at)));
                repoll = (repoll * 2).min(Self::WAIT_REPOLL_MAX);
            }
            waiter.sleep(seen, until);
        }
    }
}

/// The length every descriptor has, if they all have one.
fn uniform_len(descs: &[Desc]) -> Option<u64> {
    let first = descs.first()?.len;
    descs.iter().all(|d| d.len == first).then_some(first)
}

/// Resolves each descriptor to the registration containing it: per descriptor a slot
/// (its position in the returned distinct registrations, first seen first), or
/// `outside(position, descriptor, partly_registered)`. `index_of(dev_id)` gives the
/// regions of the list's kind on a device. A descriptor inside the same region as the
/// one before it (a KV cache's consecutive blocks) is checked in constant time, and a
/// registration is cloned once per list, not once per descriptor.
fn resolve_descs<'a, T: 'a>(
    descs: &[Desc],
    mut index_of: impl FnMut(u64) -> Option<&'a RegionIndex<Arc<T>>>,
    outside: impl Fn(usize, &Desc, bool) -> Error,
) -> Result<(Vec<u32>, Vec<Arc<T>>)> {
    let mut slots = Vec::with_capacity(descs.len());
    let mut regs: Vec<Arc<T>> = Vec::new();
    let mut slot_of: HashMap<*const T, u32> = HashMap::new();
    // The device whose regions were looked up last, and what the last descriptor
    // resolved to there: (position in the index, slot).
    let mut device: Option<(u64, Option<&'a RegionIndex<Arc<T>>>)> = None;
    let mut last: Option<(usize, u32)> = None;
    for (index, d) in descs.iter().enumerate() {
        let end = d.checked_end(index)?;
        let regions = match device {
            Some((dev, regions)) if dev == d.dev_id => regions,
            _ => {
                last = None;
                let regions = index_of(d.dev_id);
                device = Some((d.dev_id, regions));
                regions
            }
        };
        let Some(regions) = regions else {
            return Err(outside(index, d, false));
        };
        if let Some((at, slot)) = last.filter(|&(at, _)| regions.answers_at(at, d.addr, end)) {
            slots.push(slot);
            last = Some((at, slot));
            continue;
        }
        let at = match regions.lookup_position(d.addr, end) {
            Lookup::Inside(at) => at,
            other => return Err(outside(index, d, matches!(other, Lookup::Partial))),
        };
        let Some(reg) = regions.value_at(at) else {
            return Err(outside(index, d, false));
        };
        let slot = match slot_of.get(&Arc::as_ptr(reg)) {
            Some(&slot) => slot,
            None => {
                let slot = u32::try_from(regs.len()).map_err(|_| {
                    Error::InvalidParam(format!(
                        "a list may span at most {} registrations",
                        u32::MAX
                    ))
                })?;
                slot_of.insert(Arc::as_ptr(reg), slot);
                regs.push(reg.clone());
                slot
            }
        };
        slots.push(slot);
        last = Some((at, slot));
    }
    Ok((slots, regs))
}

/// Deregisters its regions when dropped (NIXL's `deregisterMem`). Transfers already made
/// keep the backend registrations alive until they are dropped.
pub struct RegistrationHandle {
    agent: Arc<AgentInner>,
    ids: Vec<u64>,
}

impl std::fmt::Debug for RegistrationHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistrationHandle")
            .field("agent", &self.agent.name)
            .field("regions", &self.ids.len())
            .finish()
    }
}

impl RegistrationHandle {
    /// Number of regions registered.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

impl Drop for RegistrationHandle {
    fn drop(&mut self) {
        let mut local = self.agent.local.write();
        let ids: std::collections::HashSet<u64> = self.ids.iter().copied().collect();
        for id in &self.ids {
            if let Some(reg) = local.regs.remove(id) {
                reg.released.store(true, Ordering::Release);
            }
        }
        for index in local.index.values_mut() {
            index.remove_where(|reg| ids.contains(&reg.id));
        }
        local.generation += 1;
    }
}

impl AgentInner {
    /// Used by the listener to load metadata pushed by a peer.
    pub(crate) fn agent(self: &Arc<Self>) -> Agent {
        Agent {
            inner: self.clone(),
        }
    }
}

/// Parameters helper: `("key", "value")` pairs into [`BackendParams`].
pub fn params<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> BackendParams {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(tag: &str) -> Vec<(String, Vec<u8>)> {
        vec![("LIBFABRIC".to_string(), tag.as_bytes().to_vec())]
    }

    fn pushed(ip: &str) -> MdSource {
        MdSource::Pushed(SocketAddr::new(ip.parse().unwrap(), 4000))
    }

    #[test]
    fn binding_rules() {
        let bound = BoundPeer {
            conn_infos: info("first"),
            addrs: vec!["10.0.0.1".parse().unwrap()],
            gone: false,
        };
        let y = |incoming: Option<&[(String, Vec<u8>)]>, source| {
            admit("y", Some(&bound), incoming, source)
        };
        // Nothing bound yet (or regions only): the first connection information binds.
        assert_eq!(
            admit("y", None, Some(&info("any")), pushed("10.9.9.9")),
            Ok(Admission::Bind)
        );
        let regions_only = BoundPeer {
            conn_infos: Vec::new(),
            addrs: Vec::new(),
            gone: false,
        };
        assert_eq!(
            admit(
                "y",
                Some(&regions_only),
                Some(&info("x")),
                MdSource::Application
            ),
            Ok(Admission::Bind)
        );
        // The same incarnation again, from its address or by the application.
        assert_eq!(
            y(Some(&info("first")), pushed("10.0.0.1")),
            Ok(Admission::Same)
        );
        assert_eq!(y(None, pushed("10.0.0.1")), Ok(Admission::Same));
        assert_eq!(
            y(Some(&info("first")), MdSource::Application),
            Ok(Admission::Same)
        );
        let fetched = MdSource::Fetched("10.0.0.7:5000".parse().unwrap());
        assert_eq!(y(Some(&info("first")), fetched), Ok(Admission::Same));
        // Other connection information while the incarnation lives: refused, from
        // anywhere (the application and its own address included).
        for source in [
            pushed("10.0.0.1"),
            pushed("10.0.0.2"),
            MdSource::Application,
            fetched,
        ] {
            let err = y(Some(&info("second")), source).unwrap_err();
            assert!(err.contains("bound"), "{err}");
        }
        // Pushed from a stranger's address: refused even when it changes no connection.
        for incoming in [Some(&info("first")[..]), None] {
            let err = y(incoming, pushed("10.0.0.2")).unwrap_err();
            assert!(err.contains("known only at"), "{err}");
        }
        // Once the incarnation is gone, a new one binds.
        let gone = BoundPeer {
            gone: true,
            ..bound
        };
        assert_eq!(
            admit("y", Some(&gone), Some(&info("second")), pushed("10.0.0.3")),
            Ok(Admission::Bind)
        );
        // The agent's own view of itself is not subject to binding.
        assert_eq!(
            admit(
                "y",
                Some(&gone),
                Some(&info("third")),
                MdSource::Loopback(3)
            ),
            Ok(Admission::Bind)
        );
    }

    #[test]
    fn metadata_naming_the_agent_itself_is_refused() {
        let agent = Agent::new("me", AgentConfig::default()).unwrap();
        agent.create_backend("LOCAL", &Default::default()).unwrap();
        let blob = agent.local_partial_metadata(None, true).unwrap();
        assert!(matches!(
            agent.load_remote_metadata(&blob),
            Err(Error::MetadataRefused { agent, .. }) if agent == "me"
        ));
        assert!(!agent.has_remote("me"));
    }
}
