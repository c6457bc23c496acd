//! `VERBS`: RC queue pairs over the `ibverbs` crate, one or more rails, striping, and
//! notifications that fire only after the data has landed.
//!
//! # Rails
//! A rail is one device context + completion queue (with its completion channel) +
//! shared receive queue, driven by its own worker thread. `device` names one or more
//! devices (`mlx5_0,mlx5_1`); `num_rails` (default: one per device) rails are spread
//! over them round-robin, so several rails may share one device (each with its own QPs,
//! CQ and thread: striping is exercised on a single soft-RoCE device). Descriptors of at
//! least `striping_threshold` bytes (default 128 KiB) are split across all rails;
//! smaller ones go round-robin. Work requests go out in chains of up to 64 (one
//! `ibv_post_send` each, only the last one signaled), at most [`MAX_OUTSTANDING`] in
//! flight per rail.
//!
//! # Progress
//! A rail's state (its jobs, window and CQ) sits behind one lock that whichever thread
//! gets it drives: `post` queues the transfer and issues only its first chain (so a post
//! of 15,000 descriptors stays cheap), status polls issue the rest and read the CQ,
//! `get_notifs` reads the receive queue, and the rail's worker thread (with the agent's
//! `progress_thread`, the default) does all of that when nobody polls. An idle worker
//! sleeps on the CQ's completion channel and an eventfd that a post with work left
//! writes, so a polling caller never waits for a wake-up and a spinning worker never
//! takes the CPU that soft-RoCE needs to move the data.
//!
//! # Connections: why a side channel
//! An RC QP is connected to exactly one remote QP, so the QP numbers and PSNs of a pair
//! exist only once both sides know of each other. NIXL's usage (and `nixlbench`, and the
//! P2P fetch) is one-sided: the initiator loads the target's metadata, the target never
//! loads the initiator's. A pool of pre-created QPs advertised in the metadata cannot
//! work then: the target would have to learn which of its QPs the initiator took, and
//! the initiator's QPN/PSN, before its QP can leave INIT, i.e. it needs a message from
//! the initiator before the first RDMA packet — a side channel anyway.
//!
//! So each agent's connection information carries, per rail, the device index, port,
//! GID, LID and MTU, plus the address of a tiny TCP side channel (by default on the IP
//! address of the RoCE GID, so it is reachable wherever RoCE is) and a random
//! incarnation number. `load_remote_conn_info` creates one RC QP per local rail for that
//! peer and sends the peer a HELLO with each QP's QPN and PSN (and its own GID/MTU); the
//! peer's side-channel thread creates the matching QPs, brings them to RTS, registers
//! them, and answers with their QPNs and PSNs; the initiator then brings its QPs to RTS.
//! Both sides are connected when `load_remote_conn_info` returns, whatever the target
//! loaded. Each direction of traffic has its own QP pairs (A's transfers to B use the
//! pairs A opened; B's to A the pairs B opened), so there is never a race over who
//! connects, and a peer's restart (new incarnation number, new side-channel address)
//! simply replaces the old pairs when its new metadata is loaded.
//!
//! The side-channel TCP connection stays open as a liveness signal: when the peer's
//! process dies, its kernel closes the socket, our side-channel thread sees the EOF
//! within milliseconds, moves our QPs to the error state (flushing in-flight work) and
//! every transfer to that peer fails with [`Error::RemoteDisconnect`]. A peer that
//! disappears without closing the socket (host crash) is caught by the RC transport
//! itself: retries exhausted → `IBV_WC_RETRY_EXC_ERR` → [`Error::RemoteDisconnect`].
//!
//! # Notifications
//! With a notification, the last WRITE of each rail's share of a transfer is an
//! `RDMA_WRITE_WITH_IMM` whose 32-bit immediate is the transfer's sequence number. RC
//! delivers the operations of one QP in order, so the target's receive completion for
//! that write means every earlier write on the same QP has been placed. The
//! notification message itself is a SEND on rail 0's QP behind its writes, carrying the
//! sequence number and the number of immediates to expect (one per rail used). The
//! target counts immediates per (connection, sequence) — they arrive on any rail, in any
//! order — and releases the notification only when the count is reached and the message
//! is in, so it can neither fire early nor be lost. For READ the message is sent after
//! the last read completed locally, with nothing to count.
//!
//! # Topology
//! With several devices, a registration is bound to the rails whose device is local to
//! the memory ([`crate::topology`]): DRAM to the devices on the NUMA node holding the
//! region's first page (`get_mempolicy`); its descriptors are striped and spread over
//! those rails only. The topology comes from the `topology_xml` parameter or hwloc's
//! `HWLOC_XMLFILE` (an `lstopo --of xml` export), else from sysfs. Memory whose node is
//! unknown, or with no local device, uses every rail.
//!
//! # Parameters
//! `device` (comma-separated; default the first device), `gid_index` (default: the
//! port's RoCE v2 IPv4 GID, else 0), `ib_port` (default 1), `num_rails` (default: one
//! per device), `striping_threshold` (bytes, default 131072), `listen_addr` (the side
//! channel, default `<GID's IP>:0`; required where the GID is no IP address, e.g. on
//! InfiniBand), `topology_xml` (path of an hwloc XML export), `qp_timeout` (the RC
//! local ACK timeout exponent, 4.096 µs × 2^n per try, default
//! [`DEFAULT_QP_TIMEOUT`]).

use super::shared::NotifTracker;
use crate::agent::Agent;
use crate::backend::{
    Backend, BackendParams, BackendXfer, Capabilities, LocalMd, PostParams, RemoteMd, XferEntry,
    XferOp, XferProgress, XferStatus,
};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use crate::topology::{numa_node_of, Topology};
use ibverbs::{
    AccessFlags, CompletionChannel, CompletionQueue, ConnectOptions, Context, Endpoint, Gid,
    IpFamily, MemoryRegion, Mtu, PreparedQueuePair, ProtectionDomain, QpType, QueuePair, RecvWr,
    RemoteMemory, SendWr, Sge, SharedReceiveQueue, WcOpcode, WorkCompletion,
};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The backend's name.
pub const NAME: &str = "VERBS";
/// Default size from which one descriptor is split across all rails.
pub const DEFAULT_STRIPING_THRESHOLD: usize = 128 << 10;
/// Default RC local ACK timeout exponent: 4.096 µs × 2^18 ≈ 1.07 s per try (UCX's RC
/// timeout is 1 s, NCCL's default exponent 20). A dead peer process is seen at once
/// through the side channel; this only bounds a silent one (host or link gone): about
/// 8.6 s with 7 retries. Shorter timeouts make soft-RoCE under load retransmit bursts
/// whose ACKs are merely late.
pub const DEFAULT_QP_TIMEOUT: u8 = 18;
/// Largest notification message (the user's bytes).
pub const MAX_NOTIF_BYTES: usize = NOTIF_SLOT - NOTIF_HEADER;
/// Work requests one rail keeps in flight (over all its QPs) before it waits for
/// completions; also each QP's send queue depth, so a post never finds its queue full.
pub const MAX_OUTSTANDING: usize = 1024;

const NOTIF_SLOT: usize = 8192;
const NOTIF_HEADER: usize = 12;
const NOTIF_MAGIC: &[u8; 4] = b"NXVN";
/// Receive buffers of a rail's shared receive queue (notifications and immediates).
const RECV_SLOTS: usize = 256;
/// Send buffers of a rail for notification messages.
const SEND_SLOTS: usize = 64;
/// Work requests per `ibv_post_send` chain.
const BATCH: usize = 64;
/// Largest single work request (the SGE length is 32 bits).
const MAX_WR_BYTES: usize = 1 << 30;
const CQ_SIZE: u32 = (MAX_OUTSTANDING + RECV_SLOTS + 256) as u32;
const MAX_RAILS: usize = 16;
/// Bound on every side-channel exchange.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the side-channel thread blocks (new connections and peers' EOFs wake it).
const MONITOR_PERIOD: Duration = Duration::from_millis(50);
const MAX_FRAME: usize = 64 << 10;
/// How long a worker polls without finding work before it sleeps on its completion
/// channel (and wake-up eventfd). Short: on soft-RoCE the kernel that moves the data
/// needs the CPU a spinning worker would take.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(50);
/// Longest sleep (a safety net: completions and new jobs wake the worker).
const SLEEP_MS: i32 = 100;

/// wr_id bits: receive completions of the SRQ.
const RECV_WR: u64 = 1 << 63;
const WIRE_VERSION: u8 = 1;

// ---------------------------------------------------------------------------------------
// Devices, rails, shared state

#[derive(Debug)]
struct Device {
    name: String,
    ctx: Context,
    pd: ProtectionDomain,
    opts: ConnectOptions,
    gid: Gid,
    lid: u16,
    mtu: Mtu,
    max_msg: usize,
}

#[derive(Debug)]
struct Rail {
    index: usize,
    dev: usize,
    cq: CompletionQueue,
    channel: CompletionChannel,
    srq: SharedReceiveQueue,
    submit: Mutex<VecDeque<RailJob>>,
    /// The worker blocks on its completion channel and this eventfd when idle.
    wake_fd: OwnedFd,
    sleeping: AtomicBool,
    state: Mutex<RailState>,
}

impl Rail {
    /// Queues a job for the rail's worker, waking it if it sleeps.
    fn submit(&self, job: RailJob) {
        self.submit.lock().expect("submit lock").push_back(job);
        self.nudge();
    }

    /// Wakes the worker if it sleeps (pairs with the store-then-check in `rail_sleep`,
    /// both SeqCst).
    fn nudge(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake();
        }
    }

    /// A round of progress from the calling thread, unless another thread is at it;
    /// then wakes the worker if work is left that nobody is issuing.
    fn progress(&self, common: &Common, chains: usize) {
        match self.state.try_lock() {
            Ok(mut state) => {
                state.round(self, common, chains);
                if state.unissued() {
                    drop(state);
                    self.nudge();
                }
            }
            Err(_) => self.nudge(),
        }
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of a live u64 to the rail's eventfd.
        let n = unsafe {
            libc::write(
                self.wake_fd.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        if n < 0 {
            // EAGAIN: the counter is saturated, the worker is woken anyway.
            tracing::trace!("eventfd write: {}", std::io::Error::last_os_error());
        }
    }
}

/// A connection this agent opened to a peer: one QP per local rail.
#[derive(Debug)]
struct Outgoing {
    peer: String,
    conn_info: Vec<u8>,
    qps: Vec<QueuePair>,
    /// Per local rail: the peer's device index (selects the rkey of a region).
    remote_dev: Vec<usize>,
    dead: AtomicBool,
    reason: Mutex<String>,
    stream: TcpStream,
}

impl Outgoing {
    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    fn dead_reason(&self) -> Option<String> {
        self.is_dead()
            .then(|| self.reason.lock().expect("reason lock").clone())
    }

    /// Marks the connection broken (the first reason wins), flushes in-flight work and
    /// tells the peer through the side channel.
    fn kill(&self, reason: &str) {
        {
            let mut r = self.reason.lock().expect("reason lock");
            if self.dead.load(Ordering::Acquire) {
                return;
            }
            *r = reason.to_string();
            self.dead.store(true, Ordering::Release);
        }
        tracing::debug!(peer = %self.peer, reason, "VERBS connection closed");
        for qp in &self.qps {
            if let Err(e) = qp.to_error() {
                tracing::debug!(error = %e, "moving a QP to ERR failed");
            }
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    fn disconnect_error(&self) -> Error {
        Error::RemoteDisconnect {
            agent: self.peer.clone(),
            reason: self
                .dead_reason()
                .unwrap_or_else(|| "connection closed".into()),
        }
    }
}

/// A connection a peer opened to this agent (we are the target of its transfers).
#[derive(Debug)]
struct Incoming {
    id: u64,
    peer: Arc<str>,
    /// (local rail, QP).
    qps: Vec<(usize, QueuePair)>,
    stream: TcpStream,
}

/// (incoming connection id, the sender's sequence number).
type TrackerKey = (u64, u32);
/// (incoming connection id, peer name).
type IncomingRef = (u64, Arc<str>);

/// Shared between the backend, its rail workers and its side-channel thread.
#[derive(Debug)]
struct Common {
    agent_name: String,
    nonce: u64,
    devices: Vec<Arc<Device>>,
    rails: Vec<Arc<Rail>>,
    /// Notifications, released only after their data.
    notifs: NotifTracker<TrackerKey>,
    outgoing: RwLock<HashMap<String, Arc<Outgoing>>>,
    incoming: RwLock<HashMap<u64, Arc<Incoming>>>,
    /// (local rail, QPN) of an incoming QP → (incoming connection id, peer name).
    incoming_qpn: RwLock<HashMap<(usize, u32), IncomingRef>>,
    next_incoming: AtomicU64,
    stop: AtomicBool,
}

impl Common {
    fn remove_incoming(&self, id: u64) {
        let Some(conn) = self.incoming.write().expect("incoming lock").remove(&id) else {
            return;
        };
        {
            let mut by_qpn = self.incoming_qpn.write().expect("qpn lock");
            for (rail, qp) in &conn.qps {
                by_qpn.remove(&(*rail, qp.qp_num()));
            }
        }
        self.notifs.forget(|(conn_id, _)| *conn_id == id);
        tracing::debug!(peer = %conn.peer, "VERBS incoming connection closed");
    }
}

/// The VERBS backend.
#[derive(Debug)]
pub struct VerbsBackend {
    common: Arc<Common>,
    conn_info: Vec<u8>,
    listen_addr: SocketAddr,
    threads: Mutex<Vec<JoinHandle<()>>>,
    striping_threshold: usize,
    next_seq: Arc<AtomicU32>,
    next_rail: AtomicUsize,
    /// Serialises connection set-up (the side channel is one round trip per peer).
    connect_lock: Mutex<()>,
    /// Where the devices sit (NUMA/PCIe), for binding registrations to local rails.
    topology: Option<Topology>,
}

fn verbs_error(context: &str, e: ibverbs::Error) -> Error {
    Error::Backend {
        backend: NAME.into(),
        code: e.errno().unwrap_or(0),
        message: format!("{context}: {e}"),
    }
}

fn param<T: std::str::FromStr>(params: &BackendParams, key: &str, default: T) -> Result<T> {
    super::shared::param(NAME, params, key, default)
}

/// A random 64-bit number (incarnation of this backend).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

fn open_device(name: &str, port: u8, gid_index: Option<u8>, qp_timeout: u8) -> Result<Device> {
    let ctx = Context::open(name).map_err(|e| match e {
        ibverbs::Error::DeviceNotFound { .. } => Error::Backend {
            backend: NAME.into(),
            code: libc::ENODEV,
            message: e.to_string(),
        },
        other => verbs_error(&format!("opening {name}"), other),
    })?;
    let attr = ctx
        .query_device()
        .map_err(|e| verbs_error("ibv_query_device", e))?;
    let port_attr = ctx
        .query_port(port)
        .map_err(|e| verbs_error(&format!("{name} port {port}"), e))?;
    let gid_index = match gid_index {
        Some(i) => i,
        None => ctx
            .find_roce_v2_gid(port, IpFamily::V4)
            .map(|g| g.gid_index as u8)
            .unwrap_or(0),
    };
    let gid = ctx
        .query_gid(port, gid_index.into())
        .map_err(|e| verbs_error(&format!("{name} port {port} GID {gid_index}"), e))?;
    let opts = ConnectOptions {
        port_num: port,
        gid_index,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        timeout: qp_timeout,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: attr.max_qp_init_rd_atom().clamp(1, 16) as u8,
        max_dest_rd_atomic: attr.max_qp_rd_atom().clamp(1, 16) as u8,
        ..ConnectOptions::default()
    };
    let pd = ctx.alloc_pd().map_err(|e| verbs_error("ibv_alloc_pd", e))?;
    Ok(Device {
        name: name.to_string(),
        max_msg: (port_attr.max_msg_sz() as usize).clamp(4096, MAX_WR_BYTES),
        lid: port_attr.lid(),
        mtu: port_attr.active_mtu(),
        gid,
        opts,
        pd,
        ctx,
    })
}

fn open_rail(index: usize, dev: usize, device: &Device) -> Result<Rail> {
    let channel = device
        .ctx
        .create_comp_channel()
        .map_err(|e| verbs_error("ibv_create_comp_channel", e))?;
    channel
        .set_nonblocking(true)
        .map_err(|e| verbs_error("completion channel", e))?;
    let cq = device
        .ctx
        .create_cq(CQ_SIZE, Some(&channel), index as u32)
        .or_else(|_| device.ctx.create_cq(CQ_SIZE, Some(&channel), 0))
        .map_err(|e| verbs_error("ibv_create_cq", e))?;
    let srq = device
        .pd
        .create_srq(RECV_SLOTS as u32, 1)
        .map_err(|e| verbs_error("ibv_create_srq", e))?;
    // SAFETY: plain syscall; the returned descriptor is checked and then owned.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let wake_fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let state = RailState::new(&device.pd, &srq)?;
    Ok(Rail {
        index,
        dev,
        cq,
        channel,
        srq,
        submit: Mutex::new(VecDeque::new()),
        wake_fd,
        sleeping: AtomicBool::new(false),
        state: Mutex::new(state),
    })
}

/// The side channel's address: `listen_addr` if given, else the GID's IP address.
fn side_channel_ip(gid: &Gid) -> Option<IpAddr> {
    match gid.to_ip() {
        IpAddr::V4(v4) if !v4.is_unspecified() => Some(IpAddr::V4(v4)),
        IpAddr::V6(v6) if !v6.is_unspecified() && (v6.segments()[0] & 0xffc0) != 0xfe80 => {
            Some(IpAddr::V6(v6))
        }
        _ => None,
    }
}

pub(crate) fn create(agent: &Agent, params: &BackendParams) -> Result<Arc<dyn Backend>> {
    const KNOWN: &[&str] = &[
        "device",
        "gid_index",
        "ib_port",
        "num_rails",
        "striping_threshold",
        "listen_addr",
        "topology_xml",
        "qp_timeout",
    ];
    if let Some(key) = params.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(Error::InvalidParam(format!(
            "{NAME} has no parameter `{key}` (known: {})",
            KNOWN.join(", ")
        )));
    }
    let names: Vec<String> = match params.get("device") {
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        None => {
            let list = ibverbs::devices().map_err(|e| verbs_error("ibv_get_device_list", e))?;
            list.iter().take(1).map(|d| d.name()).collect()
        }
    };
    if names.is_empty() {
        return Err(Error::Backend {
            backend: NAME.into(),
            code: libc::ENODEV,
            message: "no RDMA device found (set the `device` parameter)".into(),
        });
    }
    let port: u8 = param(params, "ib_port", 1)?;
    let gid_index: Option<u8> = params
        .get("gid_index")
        .map(|_| param(params, "gid_index", 0u8))
        .transpose()?;
    let num_rails: usize = param(params, "num_rails", names.len())?;
    if !(1..=MAX_RAILS).contains(&num_rails) || names.len() > MAX_RAILS {
        return Err(Error::InvalidParam(format!(
            "{NAME}: num_rails must be 1..={MAX_RAILS} (and at most {MAX_RAILS} devices)"
        )));
    }
    let striping_threshold =
        param(params, "striping_threshold", DEFAULT_STRIPING_THRESHOLD)?.max(1);
    let qp_timeout: u8 = param(params, "qp_timeout", DEFAULT_QP_TIMEOUT)?;
    if qp_timeout > 31 {
        return Err(Error::InvalidParam(format!(
            "{NAME}: qp_timeout is a 5-bit exponent (0..=31)"
        )));
    }
    let mut devices = Vec::with_capacity(names.len());
    for name in &names {
        devices.push(Arc::new(open_device(name, port, gid_index, qp_timeout)?));
    }
    let mut rails = Vec::with_capacity(num_rails);
    for r in 0..num_rails {
        let dev = r % devices.len();
        rails.push(Arc::new(open_rail(r, dev, &devices[dev])?));
    }
    let bind: SocketAddr = match params.get("listen_addr") {
        Some(a) => a.parse().map_err(|_| {
            Error::InvalidParam(format!("{NAME} parameter listen_addr=`{a}` is not IP:PORT"))
        })?,
        None => SocketAddr::new(
            side_channel_ip(&devices[0].gid).ok_or_else(|| {
                Error::InvalidParam(format!(
                    "{NAME}: GID {:?} of {} is no IP address: set listen_addr",
                    devices[0].gid, devices[0].name
                ))
            })?,
            0,
        ),
    };
    let topology = load_topology(params.get("topology_xml").map(String::as_str), &names)?;
    let listener = TcpListener::bind(bind)?;
    let mut listen_addr = listener.local_addr()?;
    if listen_addr.ip().is_unspecified() {
        let ip = side_channel_ip(&devices[0].gid).ok_or_else(|| {
            Error::InvalidParam(format!(
                "{NAME}: listen_addr {bind} is unspecified and the GID is no IP address to advertise"
            ))
        })?;
        listen_addr.set_ip(ip);
    }
    listener.set_nonblocking(true)?;
    let nonce = random_u64();
    let conn_info = encode_conn_info(
        nonce,
        listen_addr,
        &rails
            .iter()
            .map(|r| {
                let d = &devices[r.dev];
                RailInfo {
                    dev: r.dev as u8,
                    gid: d.gid,
                    lid: d.lid,
                    mtu: d.mtu,
                }
            })
            .collect::<Vec<_>>(),
    );
    let common = Arc::new(Common {
        agent_name: agent.name().to_string(),
        nonce,
        devices,
        rails,
        notifs: NotifTracker::default(),
        outgoing: RwLock::default(),
        incoming: RwLock::default(),
        incoming_qpn: RwLock::default(),
        next_incoming: AtomicU64::new(1),
        stop: AtomicBool::new(false),
    });
    let backend = VerbsBackend {
        common: common.clone(),
        conn_info,
        listen_addr,
        threads: Mutex::new(Vec::new()),
        striping_threshold,
        next_seq: Arc::new(AtomicU32::new(1)),
        next_rail: AtomicUsize::new(0),
        connect_lock: Mutex::new(()),
        topology,
    };
    // From here on, `backend`'s Drop stops and joins whatever was started.
    // Without a progress thread, posting and polling transfers (and taking
    // notifications) progress the rails from the caller's thread alone.
    if agent.config().progress_thread {
        for rail in common.rails.iter() {
            let (rail, worker_common) = (rail.clone(), common.clone());
            let handle = std::thread::Builder::new()
                .name(format!("nixl-verbs-rail{}", rail.index))
                .spawn(move || rail_worker(rail, worker_common))?;
            backend.threads.lock().expect("threads lock").push(handle);
        }
    }
    let monitor_common = common.clone();
    let handle = std::thread::Builder::new()
        .name("nixl-verbs-oob".into())
        .spawn(move || side_channel_thread(listener, monitor_common))?;
    backend.threads.lock().expect("threads lock").push(handle);
    tracing::debug!(devices = ?names, rails = num_rails, %listen_addr, "VERBS backend up");
    Ok(Arc::new(backend))
}

/// The topology: an hwloc XML export if one is named (parameter, then hwloc's own
/// `HWLOC_XMLFILE`), else what sysfs says about `devices` (nothing on other systems).
fn load_topology(xml: Option<&str>, devices: &[String]) -> Result<Option<Topology>> {
    let from_env = std::env::var("HWLOC_XMLFILE").ok();
    if let Some(path) = xml.or(from_env.as_deref()) {
        return Topology::from_hwloc_xml_file(std::path::Path::new(path))
            .map(Some)
            .map_err(|e| Error::InvalidParam(format!("{NAME} topology_xml `{path}`: {e}")));
    }
    let names: Vec<&str> = devices.iter().map(String::as_str).collect();
    Ok(Topology::from_sysfs(std::path::Path::new("/sys"), &names, &[]).ok())
}

/// The rails to use for memory on NUMA node `node`: those whose device the topology
/// places on that node; every rail when that is none or all of them, or when the node
/// or the topology is unknown.
fn affine_rails(
    topology: Option<&Topology>,
    device_names: &[&str],
    rail_devices: &[usize],
    node: Option<u32>,
) -> Vec<usize> {
    let all: Vec<usize> = (0..rail_devices.len()).collect();
    let (Some(topology), Some(node)) = (topology, node) else {
        return all;
    };
    if topology.nics().is_empty() {
        return all;
    }
    let near = topology.nics_near_numa(node, device_names);
    let rails: Vec<usize> = all
        .iter()
        .copied()
        .filter(|r| near.iter().any(|n| n == device_names[rail_devices[*r]]))
        .collect();
    if rails.is_empty() {
        all
    } else {
        rails
    }
}

impl VerbsBackend {
    /// The rails a region of `region` would be bound to (see the module docs).
    pub fn rails_for(&self, region: &Region) -> Vec<usize> {
        let names: Vec<&str> = self
            .common
            .devices
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        let rail_devices: Vec<usize> = self.common.rails.iter().map(|r| r.dev).collect();
        let node = match region.kind {
            MemKind::Dram => numa_node_of(region.desc.addr),
            _ => None,
        };
        affine_rails(self.topology.as_ref(), &names, &rail_devices, node)
    }

    /// Where this backend's side channel listens (advertised in its connection info).
    pub fn side_channel_addr(&self) -> SocketAddr {
        self.listen_addr
    }

    /// Number of rails.
    pub fn num_rails(&self) -> usize {
        self.common.rails.len()
    }

    /// Names of the devices in use, in rail order of first use.
    pub fn devices(&self) -> Vec<String> {
        self.common.devices.iter().map(|d| d.name.clone()).collect()
    }

    /// Opens connection `peer` (one QP per local rail) through the peer's side channel.
    fn connect(&self, peer: &str, info: &[u8], remote: &ConnInfo) -> Result<Arc<Outgoing>> {
        let common = &self.common;
        let disconnect = |reason: String| Error::RemoteDisconnect {
            agent: peer.to_string(),
            reason,
        };
        let mut stream = TcpStream::connect_timeout(&remote.addr, HANDSHAKE_TIMEOUT)
            .map_err(|e| disconnect(format!("side channel {}: {e}", remote.addr)))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let mut prepared = Vec::with_capacity(common.rails.len());
        let mut mine = Vec::with_capacity(common.rails.len());
        for rail in &common.rails {
            let dev = &common.devices[rail.dev];
            let qp = create_qp(dev, rail, MAX_OUTSTANDING as u32)?;
            let ep = qp
                .endpoint(&dev.opts)
                .map_err(|e| verbs_error("QP endpoint", e))?;
            mine.push(ep);
            prepared.push(qp);
        }
        let hello = encode_hello(&Hello {
            target_nonce: remote.nonce,
            nonce: common.nonce,
            name: common.agent_name.clone(),
            endpoints: mine,
        });
        write_frame(&mut stream, &hello)
            .map_err(|e| disconnect(format!("side channel {}: {e}", remote.addr)))?;
        let reply = read_frame(&mut stream)
            .map_err(|e| disconnect(format!("side channel {}: {e}", remote.addr)))?;
        let answers = decode_reply(&reply).map_err(|e| match e {
            ReplyError::Refused(why) => disconnect(format!("refused: {why}")),
            ReplyError::Malformed(why) => Error::MalformedMetadata(why),
        })?;
        if answers.len() != prepared.len() {
            return Err(Error::MalformedMetadata(format!(
                "{NAME} handshake: {} QPs answered for {} rails",
                answers.len(),
                prepared.len()
            )));
        }
        let mut qps = Vec::with_capacity(prepared.len());
        let mut remote_dev = Vec::with_capacity(prepared.len());
        for (r, (qp, (qpn, psn))) in prepared.into_iter().zip(answers).enumerate() {
            let peer_rail = &remote.rails[r % remote.rails.len()];
            let dev = &common.devices[common.rails[r].dev];
            let endpoint = Endpoint {
                qp_num: qpn,
                psn,
                gid: peer_rail.gid,
                lid: peer_rail.lid,
                mtu: peer_rail.mtu,
            };
            qps.push(
                qp.connect(&endpoint, &dev.opts)
                    .map_err(|e| verbs_error("connecting a QP", e))?,
            );
            remote_dev.push(peer_rail.dev as usize);
        }
        stream.set_nonblocking(true)?;
        Ok(Arc::new(Outgoing {
            peer: peer.to_string(),
            conn_info: info.to_vec(),
            qps,
            remote_dev,
            dead: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            stream,
        }))
    }

    fn outgoing(&self, agent: &str) -> Result<Arc<Outgoing>> {
        let conn = self
            .common
            .outgoing
            .read()
            .expect("outgoing lock")
            .get(agent)
            .cloned()
            .ok_or_else(|| Error::UnknownAgent(agent.to_string()))?;
        if conn.is_dead() {
            return Err(conn.disconnect_error());
        }
        Ok(conn)
    }
}

fn create_qp(dev: &Device, rail: &Rail, send_wr: u32) -> Result<PreparedQueuePair> {
    dev.pd
        .create_qp(QpType::RC, &rail.cq, &rail.cq)
        .srq(&rail.srq)
        .max_send_wr(send_wr)
        .max_send_sge(1)
        .max_recv_sge(1)
        .build()
        .map_err(|e| verbs_error("ibv_create_qp", e))
}

impl Drop for VerbsBackend {
    fn drop(&mut self) {
        self.common.stop.store(true, Ordering::Relaxed);
        for conn in self
            .common
            .outgoing
            .read()
            .map(|m| m.values().cloned().collect::<Vec<_>>())
            .unwrap_or_default()
        {
            conn.kill("the local backend shut down");
        }
        for rail in &self.common.rails {
            rail.wake();
        }
        for thread in self
            .threads
            .get_mut()
            .map(std::mem::take)
            .unwrap_or_default()
        {
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Registrations

/// Registrations, one per device, and the rails local to the memory.
#[derive(Debug)]
struct VerbsLocalMd {
    mrs: Vec<Arc<MemoryRegion>>,
    rails: Vec<usize>,
}

impl LocalMd for VerbsLocalMd {
    fn public_md(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.mrs.len() * 4);
        out.push(self.mrs.len() as u8);
        for mr in &self.mrs {
            out.extend_from_slice(&mr.rkey().to_le_bytes());
        }
        out
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A peer region's rkey on each of its devices.
#[derive(Debug)]
struct VerbsRemoteMd {
    rkeys: Vec<u32>,
}

impl RemoteMd for VerbsRemoteMd {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn decode_remote_md(public_md: &[u8]) -> Result<Vec<u32>> {
    let bad = |why: &str| Error::MalformedMetadata(format!("{NAME} region metadata: {why}"));
    let (&count, rest) = public_md.split_first().ok_or_else(|| bad("empty"))?;
    if count == 0 || rest.len() != count as usize * 4 {
        return Err(bad("wrong length"));
    }
    Ok(rest
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect())
}

// ---------------------------------------------------------------------------------------
// The Backend implementation

impl Backend for VerbsBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: true,
            notif: true,
        }
    }

    fn supported_mem(&self) -> &[MemKind] {
        &[MemKind::Dram]
    }

    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        if region.kind != MemKind::Dram {
            return Err(Error::UnsupportedMemKind {
                backend: NAME.into(),
                kind: region.kind,
            });
        }
        let len = usize::try_from(region.desc.len)
            .map_err(|_| Error::InvalidParam("region larger than the address space".into()))?;
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let mut mrs = Vec::with_capacity(self.common.devices.len());
        for dev in &self.common.devices {
            // SAFETY: `Agent::register_mem`'s contract keeps the memory valid while the
            // registration (this metadata) and every transfer using it exist, and allows
            // the device and peers to read and write it at any time.
            let mr = unsafe { dev.pd.reg_mr_raw(region.desc.addr as *mut u8, len, access) }
                .map_err(|e| {
                    verbs_error(
                        &format!(
                            "ibv_reg_mr of {:#x}+{} on {}",
                            region.desc.addr, region.desc.len, dev.name
                        ),
                        e,
                    )
                })?;
            mrs.push(Arc::new(mr));
        }
        let rails = self.rails_for(region);
        tracing::debug!(addr = region.desc.addr, ?rails, "VERBS registration");
        Ok(Arc::new(VerbsLocalMd { mrs, rails }))
    }

    fn connection_info(&self) -> Result<Vec<u8>> {
        Ok(self.conn_info.clone())
    }

    fn load_remote_conn_info(&self, agent: &str, info: &[u8]) -> Result<()> {
        let remote = decode_conn_info(info)?;
        let _serial = self.connect_lock.lock().expect("connect lock");
        if let Some(old) = self
            .common
            .outgoing
            .read()
            .expect("outgoing lock")
            .get(agent)
        {
            if old.conn_info == info && !old.is_dead() {
                return Ok(());
            }
        }
        let conn = self.connect(agent, info, &remote)?;
        let old = self
            .common
            .outgoing
            .write()
            .expect("outgoing lock")
            .insert(agent.to_string(), conn);
        if let Some(old) = old {
            old.kill("replaced by a connection from newer metadata");
        }
        Ok(())
    }

    fn load_remote_md(
        &self,
        _agent: &str,
        _region: &Region,
        public_md: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        Ok(Arc::new(VerbsRemoteMd {
            rkeys: decode_remote_md(public_md)?,
        }))
    }

    fn disconnect(&self, agent: &str) {
        let removed = self
            .common
            .outgoing
            .write()
            .expect("outgoing lock")
            .remove(agent);
        if let Some(conn) = removed {
            conn.kill("disconnected: the peer's metadata was invalidated");
        }
    }

    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        let conn = self.outgoing(agent)?;
        let rails = &self.common.rails;
        let nrails = rails.len();
        let mut rail_ops: Vec<Vec<RailOp>> = vec![Vec::new(); nrails];
        let mut round_robin = self.next_rail.fetch_add(entries.len(), Ordering::Relaxed);
        let mut mrs: Vec<Arc<MemoryRegion>> = Vec::new();
        let mut last_md: Option<*const VerbsLocalMd> = None;
        for entry in entries {
            let local = entry
                .local_md
                .as_any()
                .downcast_ref::<VerbsLocalMd>()
                .ok_or_else(|| Error::InvalidParam("local metadata is not VERBS'".into()))?;
            let remote = entry
                .remote_md
                .as_any()
                .downcast_ref::<VerbsRemoteMd>()
                .ok_or_else(|| Error::InvalidParam("remote metadata is not VERBS'".into()))?;
            if last_md != Some(local as *const VerbsLocalMd) {
                // Registrations are shared by many descriptors: keep each alive once.
                mrs.extend(local.mrs.iter().cloned());
                last_md = Some(local as *const VerbsLocalMd);
            }
            let len = entry.local.len as usize;
            let mut push = |r: usize, start: usize, piece_len: usize| -> Result<()> {
                let rail = &rails[r];
                let lkey = local.mrs[rail.dev].lkey();
                let rkey = *remote.rkeys.get(conn.remote_dev[r]).ok_or_else(|| {
                    Error::MalformedMetadata(format!(
                        "{NAME}: region of `{agent}` has {} keys, its device {} has none",
                        remote.rkeys.len(),
                        conn.remote_dev[r]
                    ))
                })?;
                let max = self.common.devices[rail.dev].max_msg;
                let mut done = 0;
                while done < piece_len {
                    let n = (piece_len - done).min(max);
                    let at = (start + done) as u64;
                    rail_ops[r].push(RailOp {
                        local: entry.local.addr + at,
                        len: n as u32,
                        lkey,
                        remote: entry.remote.addr + at,
                        rkey,
                    });
                    done += n;
                }
                Ok(())
            };
            // The rails local to this memory (all of them without topology).
            let near = &local.rails;
            if near.len() > 1 && len >= self.striping_threshold {
                let chunk = len.div_ceil(near.len()).next_multiple_of(4096);
                for (i, &r) in near.iter().enumerate() {
                    let start = i * chunk;
                    if start < len {
                        push(r, start, chunk.min(len - start))?;
                    }
                }
            } else {
                round_robin += 1;
                push(near[round_robin % near.len()], 0, len)?;
            }
        }
        let total: usize = rail_ops.iter().map(Vec::len).sum();
        let used = (0..nrails)
            .filter(|&r| r == 0 || !rail_ops[r].is_empty())
            .collect();
        Ok(Box::new(VerbsXfer {
            op,
            rail_ops: rail_ops.into_iter().map(Arc::from).collect(),
            mrs: Arc::from(mrs),
            common: self.common.clone(),
            used,
            conn,
            agent: agent.to_string(),
            next_seq: self.next_seq.clone(),
            total,
            shared: Arc::new(XferShared::default()),
        }))
    }

    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        let conn = self.outgoing(agent)?;
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let message = encode_notif(seq, 0, msg)?;
        let shared = Arc::new(XferShared::default());
        shared.notif_pending.store(true, Ordering::Release);
        self.common.rails[0].submit(RailJob {
            shared: shared.clone(),
            conn: conn.clone(),
            ops: Arc::from(Vec::new()),
            _mrs: Arc::from(Vec::new()),
            op: XferOp::Write,
            imm: None,
            notif: Some(message),
        });
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        while shared.notif_pending.load(Ordering::Acquire) {
            if let Some(failure) = shared.failure() {
                return Err(failure.into_error(agent));
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout(format!(
                    "sending a notification to `{agent}`"
                )));
            }
            self.common.rails[0].progress(&self.common, usize::MAX);
            std::thread::yield_now();
        }
        Ok(())
    }

    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        for rail in &self.common.rails {
            rail.progress(&self.common, usize::MAX);
        }
        self.common.notifs.take(into);
    }
}

// ---------------------------------------------------------------------------------------
// Transfers

/// One work request, resolved at prepare time.
#[derive(Debug, Clone, Copy)]
struct RailOp {
    local: u64,
    len: u32,
    lkey: u32,
    remote: u64,
    rkey: u32,
}

#[derive(Debug, Clone)]
enum Failure {
    Disconnect(String),
    Backend(i32, String),
}

impl Failure {
    fn into_error(self, agent: &str) -> Error {
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
struct XferShared {
    /// Data operations of the current post not yet completed.
    pending: AtomicU64,
    /// Operations completed (stall detection watches it move).
    completed: AtomicU64,
    /// The notification message is not yet sent.
    notif_pending: AtomicBool,
    /// READ: the message to send once the last read completed.
    read_notif: Mutex<Option<Vec<u8>>>,
    failed: Mutex<Option<Failure>>,
    canceled: AtomicBool,
}

impl XferShared {
    fn fail(&self, failure: Failure) {
        let mut failed = self.failed.lock().expect("failed lock");
        if failed.is_none() {
            *failed = Some(failure);
        }
    }

    fn failure(&self) -> Option<Failure> {
        self.failed.lock().expect("failed lock").clone()
    }
}

#[derive(Debug)]
struct VerbsXfer {
    op: XferOp,
    rail_ops: Vec<Arc<[RailOp]>>,
    mrs: Arc<[Arc<MemoryRegion>]>,
    common: Arc<Common>,
    /// Rails this transfer progresses when polled: those with operations, and rail 0
    /// (which carries the notification).
    used: Vec<usize>,
    conn: Arc<Outgoing>,
    agent: String,
    next_seq: Arc<AtomicU32>,
    total: usize,
    shared: Arc<XferShared>,
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
struct RailJob {
    shared: Arc<XferShared>,
    conn: Arc<Outgoing>,
    ops: Arc<[RailOp]>,
    /// Keeps the registrations alive while operations are in flight.
    _mrs: Arc<[Arc<MemoryRegion>]>,
    op: XferOp,
    /// Immediate data of the last write (with a notification).
    imm: Option<u32>,
    /// Message to send after the operations were issued.
    notif: Option<Vec<u8>>,
}

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

// ---------------------------------------------------------------------------------------
// Rail worker

/// What a rail has in flight, behind the rail's lock: driven by the rail's worker
/// thread and, inline, by any thread that posts or polls a transfer.
struct RailState {
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
    fn new(pd: &ProtectionDomain, srq: &SharedReceiveQueue) -> Result<Self> {
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
    fn round(&mut self, rail: &Rail, common: &Common, chains: usize) -> bool {
        let mut busy = self.accept_jobs(rail);
        busy |= self.issue(rail, chains);
        busy |= self.poll(rail, common);
        busy
    }

    /// Whether a job has operations or a message not yet posted.
    fn unissued(&self) -> bool {
        self.jobs
            .values()
            .any(|a| a.next < a.job.ops.len() || a.job.notif.is_some())
    }

    fn accept_jobs(&mut self, rail: &Rail) -> bool {
        let mut submit = rail.submit.lock().expect("submit lock");
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
            if shared.canceled.load(Ordering::Relaxed)
                || shared.failed.lock().expect("failed lock").is_some()
            {
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

    fn poll(&mut self, rail: &Rail, common: &Common) -> bool {
        let mut wcs = std::mem::take(&mut self.wcs);
        let n = match rail.cq.poll(&mut wcs) {
            Ok(done) => done.len(),
            Err(e) => {
                tracing::warn!(rail = rail.index, error = %e, "ibv_poll_cq failed");
                0
            }
        };
        for wc in &wcs[..n] {
            if wc.wr_id() & RECV_WR != 0 {
                self.on_recv(wc, rail, common);
            } else {
                self.on_send(wc, common);
            }
        }
        self.wcs = wcs;
        if n == 0 {
            return false;
        }
        self.retire();
        true
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
                    let n = batch.n as u64;
                    if shared.pending.fetch_sub(n, Ordering::AcqRel) == n {
                        // The last data operation: a READ's notification may go now.
                        let message = shared.read_notif.lock().expect("notif lock").take();
                        if let Some(message) = message {
                            rails[0].submit(RailJob {
                                shared: shared.clone(),
                                conn: active.job.conn.clone(),
                                ops: Arc::from(Vec::new()),
                                _mrs: Arc::from(Vec::new()),
                                op: XferOp::Read,
                                imm: None,
                                notif: Some(message),
                            });
                        }
                    }
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
                .expect("qpn lock")
                .get(&(rail.index, wc.qp_num()))
                .cloned();
            match (from, wc.opcode()) {
                (Some((id, _)), WcOpcode::RECV_RDMA_WITH_IMM) => {
                    if let Some(seq) = wc.imm_data() {
                        common.notifs.data_arrived((id, seq));
                    }
                }
                (Some((id, sender)), WcOpcode::RECV) => {
                    let len = (wc.byte_len() as usize).min(NOTIF_SLOT);
                    let bytes =
                        &self.recv_mr.as_slice()[slot * NOTIF_SLOT..slot * NOTIF_SLOT + len];
                    match decode_notif(bytes) {
                        Ok((seq, expected, msg)) => common.notifs.message_arrived(
                            (id, seq),
                            u64::from(expected),
                            &*sender,
                            msg.to_vec(),
                        ),
                        Err(e) => tracing::warn!(error = %e, "malformed notification dropped"),
                    }
                }
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
fn rail_worker(rail: Arc<Rail>, common: Arc<Common>) {
    let mut last_activity = Instant::now();
    while !common.stop.load(Ordering::Relaxed) {
        let busy = rail
            .state
            .lock()
            .expect("rail lock")
            .round(&rail, &common, usize::MAX);
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
    let queued = !rail.submit.lock().expect("submit lock").is_empty();
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
        let mut state = rail.state.lock().expect("rail lock");
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
            let mut counter = 0u64;
            // SAFETY: reads 8 bytes into a live u64 (non-blocking eventfd).
            let _ = unsafe {
                libc::read(
                    rail.wake_fd.as_raw_fd(),
                    (&mut counter as *mut u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
        // Acknowledge every pending completion event (the channel is non-blocking).
        while rail.channel.get_event().is_ok() {}
    }
}

fn post_failure(e: &ibverbs::Error) -> Failure {
    Failure::Backend(e.errno().unwrap_or(0), e.to_string())
}

// ---------------------------------------------------------------------------------------
// Side channel: accepts handshakes, watches every peer's socket for EOF

fn side_channel_thread(listener: TcpListener, common: Arc<Common>) {
    while !common.stop.load(Ordering::Relaxed) {
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    if let Err(e) = serve_handshake(&common, stream) {
                        tracing::warn!(%from, error = %e, "VERBS handshake failed");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!(error = %e, "VERBS side channel accept failed");
                    break;
                }
            }
        }
        let outgoing: Vec<Arc<Outgoing>> = common
            .outgoing
            .read()
            .expect("outgoing lock")
            .values()
            .filter(|c| !c.is_dead())
            .cloned()
            .collect();
        for conn in outgoing {
            if peer_gone(&conn.stream) {
                conn.kill("the peer's process is gone (its side channel closed)");
            }
        }
        let gone: Vec<u64> = common
            .incoming
            .read()
            .expect("incoming lock")
            .values()
            .filter(|c| peer_gone(&c.stream))
            .map(|c| c.id)
            .collect();
        for id in gone {
            common.remove_incoming(id);
        }
        wait_readable(&listener, &common);
    }
}

/// Blocks until the listener or a watched side-channel socket is readable (a new
/// handshake, or a peer's EOF), or `MONITOR_PERIOD` passed.
fn wait_readable(listener: &TcpListener, common: &Common) {
    let mut fds = vec![libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    let watch = |stream: &TcpStream| libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    fds.extend(
        common
            .outgoing
            .read()
            .expect("outgoing lock")
            .values()
            .filter(|c| !c.is_dead())
            .map(|c| watch(&c.stream)),
    );
    fds.extend(
        common
            .incoming
            .read()
            .expect("incoming lock")
            .values()
            .map(|c| watch(&c.stream)),
    );
    // SAFETY: `fds` is a live array of pollfds; the sockets stay open during the call
    // (a connection closed meanwhile only makes its slot report an error or nothing).
    unsafe {
        libc::poll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            MONITOR_PERIOD.as_millis() as i32,
        )
    };
}

/// Whether a (non-blocking) side-channel socket was closed by the other end.
fn peer_gone(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match stream.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => {
            // Peers send nothing after the handshake: discard it (or it would keep the
            // socket readable forever).
            let mut sink = [0u8; 256];
            let _ = (&*stream).read(&mut sink);
            false
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => false,
        Err(_) => true,
    }
}

/// The target side of the handshake: QPs for each of the initiator's rails.
fn serve_handshake(common: &Arc<Common>, mut stream: TcpStream) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let frame = read_frame(&mut stream)?;
    let hello = decode_hello(&frame)?;
    if hello.target_nonce != common.nonce {
        write_frame(
            &mut stream,
            &encode_reply_error("stale metadata: this agent has restarted since"),
        )?;
        return Ok(());
    }
    let mut qps = Vec::with_capacity(hello.endpoints.len());
    let mut answers = Vec::with_capacity(hello.endpoints.len());
    let result = (|| -> Result<()> {
        for (i, endpoint) in hello.endpoints.iter().enumerate() {
            let rail = &common.rails[i % common.rails.len()];
            let dev = &common.devices[rail.dev];
            // Incoming QPs only receive (and answer READs): one send slot.
            let qp = create_qp(dev, rail, 1)?;
            let ep = qp
                .endpoint(&dev.opts)
                .map_err(|e| verbs_error("QP endpoint", e))?;
            let qp = qp
                .connect(endpoint, &dev.opts)
                .map_err(|e| verbs_error("connecting a QP", e))?;
            answers.push((ep.qp_num, ep.psn));
            qps.push((rail.index, qp));
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = write_frame(&mut stream, &encode_reply_error(&e.to_string()));
        return Err(e);
    }
    let id = common.next_incoming.fetch_add(1, Ordering::Relaxed);
    let peer: Arc<str> = Arc::from(hello.name.as_str());
    {
        // Registered before the answer, so the first immediate finds its connection.
        let mut by_qpn = common.incoming_qpn.write().expect("qpn lock");
        for (rail, qp) in &qps {
            by_qpn.insert((*rail, qp.qp_num()), (id, peer.clone()));
        }
    }
    let conn = Arc::new(Incoming {
        id,
        peer: peer.clone(),
        qps,
        stream: stream.try_clone()?,
    });
    common
        .incoming
        .write()
        .expect("incoming lock")
        .insert(id, conn);
    if let Err(e) = write_frame(&mut stream, &encode_reply(&answers)) {
        common.remove_incoming(id);
        return Err(e.into());
    }
    stream.set_nonblocking(true)?;
    tracing::debug!(
        peer = %peer,
        incarnation = hello.nonce,
        rails = answers.len(),
        "VERBS incoming connection"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Wire formats

/// One rail as the connection information describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RailInfo {
    dev: u8,
    gid: Gid,
    lid: u16,
    mtu: Mtu,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct ConnInfo {
    nonce: u64,
    addr: SocketAddr,
    rails: Vec<RailInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Hello {
    target_nonce: u64,
    nonce: u64,
    name: String,
    endpoints: Vec<Endpoint>,
}

#[derive(Debug)]
enum ReplyError {
    Refused(String),
    Malformed(String),
}

const CONN_MAGIC: &[u8; 4] = b"NXVC";
const HELLO_MAGIC: &[u8; 4] = b"NXVH";
const REPLY_MAGIC: &[u8; 4] = b"NXVR";

/// A bounds-checked reader over a received byte string.
struct Rd<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Rd<'a> {
    fn new(b: &'a [u8], what: &'static str) -> Self {
        Rd { b, what }
    }
    fn bad(&self, why: &str) -> Error {
        Error::MalformedMetadata(format!("{NAME} {}: {why}", self.what))
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(self.bad("truncated"));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn gid(&mut self) -> Result<Gid> {
        Ok(Gid {
            raw: self.take(16)?.try_into().expect("16"),
        })
    }
    fn magic(&mut self, magic: &[u8; 4]) -> Result<()> {
        if self.take(4)? != magic || self.u8()? != WIRE_VERSION {
            return Err(self.bad("wrong magic or version"));
        }
        Ok(())
    }
    fn end(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(self.bad("trailing bytes"))
        }
    }
}

fn put_addr(out: &mut Vec<u8>, addr: SocketAddr) {
    match addr.ip() {
        IpAddr::V4(v4) => {
            out.push(4);
            out.extend_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            out.push(6);
            out.extend_from_slice(&v6.octets());
        }
    }
    out.extend_from_slice(&addr.port().to_le_bytes());
}

fn get_addr(rd: &mut Rd<'_>) -> Result<SocketAddr> {
    let ip = match rd.u8()? {
        4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(rd.take(4)?).expect("4"))),
        6 => IpAddr::V6(Ipv6Addr::from(
            <[u8; 16]>::try_from(rd.take(16)?).expect("16"),
        )),
        _ => return Err(rd.bad("bad address family")),
    };
    Ok(SocketAddr::new(ip, rd.u16()?))
}

/// `NXVC ver nonce:u64 addr nrails:u8 {dev:u8 gid:16 lid:u16 mtu:u8}*`
fn encode_conn_info(nonce: u64, addr: SocketAddr, rails: &[RailInfo]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + rails.len() * 20);
    out.extend_from_slice(CONN_MAGIC);
    out.push(WIRE_VERSION);
    out.extend_from_slice(&nonce.to_le_bytes());
    put_addr(&mut out, addr);
    out.push(rails.len() as u8);
    for r in rails {
        out.push(r.dev);
        out.extend_from_slice(&r.gid.raw);
        out.extend_from_slice(&r.lid.to_le_bytes());
        out.push(r.mtu.0 as u8);
    }
    out
}

fn decode_conn_info(b: &[u8]) -> Result<ConnInfo> {
    let mut rd = Rd::new(b, "connection info");
    rd.magic(CONN_MAGIC)?;
    let nonce = rd.u64()?;
    let addr = get_addr(&mut rd)?;
    let n = rd.u8()? as usize;
    if n == 0 || n > MAX_RAILS {
        return Err(rd.bad("rail count out of range"));
    }
    let mut rails = Vec::with_capacity(n);
    for _ in 0..n {
        let dev = rd.u8()?;
        if dev as usize >= MAX_RAILS {
            return Err(rd.bad("device index out of range"));
        }
        rails.push(RailInfo {
            dev,
            gid: rd.gid()?,
            lid: rd.u16()?,
            mtu: Mtu(u32::from(rd.u8()?)),
        });
    }
    rd.end()?;
    Ok(ConnInfo { nonce, addr, rails })
}

/// `NXVH ver target_nonce:u64 nonce:u64 name:str16 n:u8 {qpn:u32 psn:u32 gid:16 lid:u16 mtu:u8}*`
fn encode_hello(h: &Hello) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + h.name.len() + h.endpoints.len() * 27);
    out.extend_from_slice(HELLO_MAGIC);
    out.push(WIRE_VERSION);
    out.extend_from_slice(&h.target_nonce.to_le_bytes());
    out.extend_from_slice(&h.nonce.to_le_bytes());
    out.extend_from_slice(&(h.name.len() as u16).to_le_bytes());
    out.extend_from_slice(h.name.as_bytes());
    out.push(h.endpoints.len() as u8);
    for e in &h.endpoints {
        out.extend_from_slice(&e.qp_num.to_le_bytes());
        out.extend_from_slice(&e.psn.to_le_bytes());
        out.extend_from_slice(&e.gid.raw);
        out.extend_from_slice(&e.lid.to_le_bytes());
        out.push(e.mtu.0 as u8);
    }
    out
}

fn decode_hello(b: &[u8]) -> Result<Hello> {
    let mut rd = Rd::new(b, "handshake");
    rd.magic(HELLO_MAGIC)?;
    let target_nonce = rd.u64()?;
    let nonce = rd.u64()?;
    let name_len = rd.u16()? as usize;
    if name_len == 0 {
        return Err(rd.bad("empty agent name"));
    }
    let name = String::from_utf8(rd.take(name_len)?.to_vec())
        .map_err(|_| rd.bad("agent name is not UTF-8"))?;
    let n = rd.u8()? as usize;
    if n == 0 || n > MAX_RAILS {
        return Err(rd.bad("rail count out of range"));
    }
    let mut endpoints = Vec::with_capacity(n);
    for _ in 0..n {
        endpoints.push(Endpoint {
            qp_num: rd.u32()?,
            psn: rd.u32()?,
            gid: rd.gid()?,
            lid: rd.u16()?,
            mtu: Mtu(u32::from(rd.u8()?)),
        });
    }
    rd.end()?;
    Ok(Hello {
        target_nonce,
        nonce,
        name,
        endpoints,
    })
}

/// `NXVR ver 0 n:u8 {qpn:u32 psn:u32}*` or `NXVR ver 1 why:str16`
fn encode_reply(answers: &[(u32, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + answers.len() * 8);
    out.extend_from_slice(REPLY_MAGIC);
    out.push(WIRE_VERSION);
    out.push(0);
    out.push(answers.len() as u8);
    for (qpn, psn) in answers {
        out.extend_from_slice(&qpn.to_le_bytes());
        out.extend_from_slice(&psn.to_le_bytes());
    }
    out
}

fn encode_reply_error(why: &str) -> Vec<u8> {
    let why = &why.as_bytes()[..why.len().min(4096)];
    let mut out = Vec::with_capacity(8 + why.len());
    out.extend_from_slice(REPLY_MAGIC);
    out.push(WIRE_VERSION);
    out.push(1);
    out.extend_from_slice(&(why.len() as u16).to_le_bytes());
    out.extend_from_slice(why);
    out
}

fn decode_reply(b: &[u8]) -> std::result::Result<Vec<(u32, u32)>, ReplyError> {
    let malformed = |e: Error| ReplyError::Malformed(e.to_string());
    let mut rd = Rd::new(b, "handshake reply");
    rd.magic(REPLY_MAGIC).map_err(malformed)?;
    match rd.u8().map_err(malformed)? {
        0 => {
            let n = rd.u8().map_err(malformed)? as usize;
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                out.push((rd.u32().map_err(malformed)?, rd.u32().map_err(malformed)?));
            }
            rd.end().map_err(malformed)?;
            Ok(out)
        }
        1 => {
            let len = rd.u16().map_err(malformed)? as usize;
            let why = String::from_utf8_lossy(rd.take(len).map_err(malformed)?).into_owned();
            Err(ReplyError::Refused(why))
        }
        _ => Err(malformed(rd.bad("unknown status"))),
    }
}

fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    s.write_all(&frame)
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("side-channel frame of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok(body)
}

/// `NXVN seq:u32 expected:u32 msg`
fn encode_notif(seq: u32, expected: u32, msg: &[u8]) -> Result<Vec<u8>> {
    if msg.len() > MAX_NOTIF_BYTES {
        return Err(Error::InvalidParam(format!(
            "notification of {} bytes is too large for {NAME} (at most {MAX_NOTIF_BYTES})",
            msg.len()
        )));
    }
    let mut out = Vec::with_capacity(NOTIF_HEADER + msg.len());
    out.extend_from_slice(NOTIF_MAGIC);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&expected.to_le_bytes());
    out.extend_from_slice(msg);
    Ok(out)
}

fn decode_notif(b: &[u8]) -> Result<(u32, u32, &[u8])> {
    if b.len() < NOTIF_HEADER || &b[..4] != NOTIF_MAGIC {
        return Err(Error::MalformedMetadata("malformed notification".into()));
    }
    let seq = u32::from_le_bytes(b[4..8].try_into().expect("4"));
    let expected = u32::from_le_bytes(b[8..12].try_into().expect("4"));
    Ok((seq, expected, &b[NOTIF_HEADER..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_bind_to_the_rails_of_their_numa_node() {
        let topo = Topology::from_hwloc_xml(include_str!(
            "../../tests/topo/flat-8gpu-8nic-2numa-4switch.xml"
        ))
        .unwrap();
        // mlx5_0 and mlx5_2 are on NUMA 0, mlx5_1 on NUMA 1; rxe0 is nowhere.
        let names = ["mlx5_0", "mlx5_1", "mlx5_2"];
        let rail_devices = [0, 1, 2, 0, 1, 2];
        let t = Some(&topo);
        assert_eq!(
            affine_rails(t, &names, &rail_devices, Some(0)),
            [0, 2, 3, 5]
        );
        assert_eq!(affine_rails(t, &names, &rail_devices, Some(1)), [1, 4]);
        let all = [0, 1, 2, 3, 4, 5];
        assert_eq!(affine_rails(t, &names, &rail_devices, None), all);
        assert_eq!(affine_rails(None, &names, &rail_devices, Some(0)), all);
        // Node 1 with only node-0 devices: no local one, so every rail.
        assert_eq!(
            affine_rails(t, &["mlx5_0", "mlx5_2"], &[0, 1], Some(1)),
            [0, 1]
        );
        assert_eq!(affine_rails(t, &["rxe0"], &[0, 0], Some(0)), [0, 1]);
    }

    fn gid(last: u8) -> Gid {
        let mut raw = [0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&[192, 0, 2, last]);
        Gid { raw }
    }

    #[test]
    fn connection_info_round_trips_and_rejects_garbage() {
        let rails = vec![
            RailInfo {
                dev: 0,
                gid: gid(1),
                lid: 0,
                mtu: Mtu::MTU_4096,
            },
            RailInfo {
                dev: 1,
                gid: gid(2),
                lid: 7,
                mtu: Mtu::MTU_1024,
            },
        ];
        let addr: SocketAddr = "192.0.2.1:4791".parse().unwrap();
        let b = encode_conn_info(0x1234_5678_9abc_def0, addr, &rails);
        let c = decode_conn_info(&b).unwrap();
        assert_eq!(
            c,
            ConnInfo {
                nonce: 0x1234_5678_9abc_def0,
                addr,
                rails
            }
        );
        for cut in 0..b.len() {
            assert!(decode_conn_info(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = b.clone();
        extra.push(0);
        assert!(decode_conn_info(&extra).is_err());
        let v6: SocketAddr = "[2001:db8::1]:9".parse().unwrap();
        let b6 = encode_conn_info(1, v6, &c.rails[..1]);
        assert_eq!(decode_conn_info(&b6).unwrap().addr, v6);
        let mut zero_rails = encode_conn_info(1, addr, &[]);
        assert!(decode_conn_info(&zero_rails).is_err());
        zero_rails[4] = 9;
        assert!(decode_conn_info(&zero_rails).is_err(), "version");
    }

    #[test]
    fn handshake_messages_round_trip() {
        let hello = Hello {
            target_nonce: 5,
            nonce: 6,
            name: "prefill-0".into(),
            endpoints: vec![
                Endpoint {
                    qp_num: 17,
                    psn: 0xabcdef,
                    gid: gid(1),
                    lid: 0,
                    mtu: Mtu::MTU_4096,
                };
                3
            ],
        };
        let b = encode_hello(&hello);
        assert_eq!(decode_hello(&b).unwrap(), hello);
        for cut in 0..b.len() {
            assert!(decode_hello(&b[..cut]).is_err(), "cut at {cut}");
        }
        let r = encode_reply(&[(1, 2), (3, 4)]);
        assert_eq!(decode_reply(&r).unwrap(), vec![(1, 2), (3, 4)]);
        for cut in 0..r.len() {
            assert!(decode_reply(&r[..cut]).is_err(), "cut at {cut}");
        }
        match decode_reply(&encode_reply_error("stale metadata")) {
            Err(ReplyError::Refused(why)) => assert_eq!(why, "stale metadata"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn notification_messages_round_trip_and_are_bounded() {
        let m = encode_notif(42, 3, b"kv ready").unwrap();
        assert_eq!(decode_notif(&m).unwrap(), (42, 3, &b"kv ready"[..]));
        assert!(decode_notif(&m[..NOTIF_HEADER - 1]).is_err());
        assert!(decode_notif(b"XXXX\0\0\0\0\0\0\0\0").is_err());
        assert!(encode_notif(1, 0, &vec![0; MAX_NOTIF_BYTES]).is_ok());
        assert!(matches!(
            encode_notif(1, 0, &vec![0; MAX_NOTIF_BYTES + 1]),
            Err(Error::InvalidParam(_))
        ));
    }

    #[test]
    fn region_keys_parse_strictly() {
        let md = VerbsRemoteMd {
            rkeys: decode_remote_md(&[2, 1, 0, 0, 0, 2, 0, 0, 0]).unwrap(),
        };
        assert_eq!(md.rkeys, vec![1, 2]);
        assert!(decode_remote_md(&[]).is_err());
        assert!(decode_remote_md(&[0]).is_err());
        assert!(decode_remote_md(&[1, 1, 0, 0]).is_err());
        assert!(decode_remote_md(&[1, 1, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn side_channel_address_comes_from_an_ip_gid_only() {
        assert_eq!(
            side_channel_ip(&gid(1)),
            Some(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)))
        );
        let mut link_local = [0u8; 16];
        link_local[0] = 0xfe;
        link_local[1] = 0x80;
        link_local[15] = 1;
        assert_eq!(side_channel_ip(&Gid { raw: link_local }), None);
        assert_eq!(side_channel_ip(&Gid::default()), None);
        let v6: Ipv6Addr = "2001:db8::5".parse().unwrap();
        assert_eq!(
            side_channel_ip(&Gid { raw: v6.octets() }),
            Some(IpAddr::V6(v6))
        );
    }
}
