//! `GPUNETIO`: transfers posted by GPU kernels over the `gpunetio` device library, and
//! the device API (GPU request handles, memory views) for kernels of the user's own.
//!
//! NIXL's GPUNetIO plugin, on our transports. `post` launches a transfer kernel
//! (`nixl/device/nixl_gpunetio.cu`) on a CUDA stream:
//! - **stream attached**: the post's [`PostParams::custom`] carries an
//!   `Arc<CudaStream>` of the backend's GPU; the kernel is queued on it, so the transfer
//!   moves what the work queued there before it produced;
//! - **stream pool**: otherwise one of the backend's `cuda_streams` streams, taken in
//!   turn, so concurrent posts run concurrently.
//!
//! The host polls an event recorded after the kernel; the notification goes out only
//! then, strictly after the data. The kernel's first failure (a bounds violation, a
//! transport error, a vanished peer) is a typed [`Error::Backend`] at `check`.
//!
//! # GPU
//! A backend drives one GPU: `gpu_devices` when given (bound at creation). Without it, the
//! first VRAM registration binds its GPU, so a process working on GPU 1 needs no
//! parameter; what needs a GPU before any VRAM was registered (DRAM registration, the
//! connection information, a peer's connection information) binds the device whose
//! context was current on the creating thread, else GPU 0. Binding happens once, under a
//! lock: concurrent first registrations agree on one GPU, and VRAM of another GPU is
//! then refused with an error that names the bound GPU and why.
//!
//! # Paths
//! - **Intra-node** (`IntraNode` handler): a peer on this node (same boot id) whose
//!   regions are VRAM. Its VRAM is mapped here by CUDA IPC (control plane, metadata and
//!   notifications are `CUDA_IPC`'s). A kernel's put (the device API) is a vectorized
//!   copy by its warps; a transfer the host posts runs `CUDA_IPC`'s copy strategies on
//!   the backend's GPU instead (`copy_engine`, default `auto`: the copy engines for a
//!   few large descriptors, the batched gather/scatter kernel for many small ones), or
//!   with `copy_engine=gio` the transfer kernel's warps through the queue pair. Local
//!   memory may be VRAM of the backend's GPU or DRAM (pinned and mapped on first use). A
//!   peer on another GPU of the node is mapped into the backend's GPU with peer access
//!   enabled toward the peer's GPU, so loads, stores and copies cross the link; a pair
//!   without peer access (the pair's topology says so, `query_mem_info` with `"A:B"`
//!   shows the route) takes the NIC path where there is one, else is refused
//!   ([`Error::NotSupported`]) — a kernel is never handed an address it cannot reach.
//! - **NIC** (`CpuProxy` handler, module `nic`): peers on other nodes, a peer's DRAM, and every
//!   peer under `nic_handler=cpu_proxy`. Kernels write work entries into a ring in
//!   host-mapped memory; a proxy thread per peer posts them on a libfabric endpoint
//!   (`provider`, bound to `oob_interface`'s address). Local VRAM is registered with the
//!   provider where it can be (`FI_HMEM`), else staged through pinned bounce buffers by
//!   the proxy (then a peer cannot target it: such a transfer is refused as
//!   unsupported). Notifications travel over TCP on the same address (module `oob`).
//!   The native mlx5 handler of `gpunetio` needs a ConnectX NIC and is not driven here.
//! - **Direct peer copy** (module `peer_dram`): this backend's VRAM ↔ the DRAM of a peer
//!   on this node, in one copy-engine copy by the peer (which imports this side's VRAM
//!   through CUDA IPC), asked for on a control connection of the NIC path's out-of-band
//!   channel (a Unix socket where both processes share a pid namespace, else TCP); the
//!   NIC path is the fallback where the peer declines.
//!
//! Parameters as upstream: `gpu_devices` (one CUDA ordinal: one GPU per backend, as
//! upstream; empty or absent: the GPU of the first VRAM registered — see "GPU" below),
//! `cuda_streams` (the pool, default 4), `network_devices`
//! (must exist; one NIC per backend, as upstream), `oob_interface` (an interface name or
//! address for the NIC path's endpoints and notifications; default loopback, so peers on
//! other nodes need it). Ours: `nic_handler` (`auto`, the default: intra-node where it
//! reaches, the NIC path elsewhere; `intra_node`: no NIC path; `cpu_proxy`: the NIC path
//! for every peer) and `provider` (the proxy's libfabric provider, default
//! `tcp;ofi_rxm`; both sides must use the same), `copy_depth` (16-byte loads each lane of
//! an intra-node copy keeps in flight, 1..=16, default 4), `copy_engine` (how a
//! host-posted intra-node transfer runs: `auto`, `kernel`, `memcpy`, `batch` as for
//! `CUDA_IPC`, or `gio`; kernels of the device API are not affected; it also runs the
//! copies this backend serves for a same-host peer's direct path, `gio` meaning `auto`
//! there), `vram_peer_copy`
//! (`auto`, the default: the direct peer copy where it fits; `off`: the NIC path),
//! `heartbeat_ms` (default 100; 0: no heartbeats) and `heartbeat_misses` (default 5), as
//! `LIBFABRIC`'s: the NIC path's heartbeats (below).
//!
//! # A vanished peer
//! A peer process that dies on this node is seen by `CUDA_IPC`'s watch on its process and
//! by its notification connection closing. A peer *host* that vanishes — its link cut,
//! its machine killed — sends nothing at all, and the proxy's TCP connection gives up
//! only after minutes. So the NIC path runs the backends' heartbeat hub (module
//! `heartbeat`, on the `oob_interface` address, advertised in the connection
//! information): each peer with a NIC path is watched from when its connection
//! information is loaded, and once it was silent for `heartbeat_misses` of its
//! `heartbeat_ms` intervals, transfers to it in flight and posted later, and its
//! notifications, fail with [`Error::RemoteDisconnect`]; its proxy's ring is shut down,
//! so the kernels waiting on it end at once (module `nic`). `peer_gone` then answers
//! `true`. The same peer reached again (a restored link), or a new incarnation, is
//! watched afresh and gets a new proxy once its connection information is loaded again
//! (after `invalidate_remote`, or the same information loaded over a dead watch). A peer
//! that advertises no hub (an older one, `heartbeat_ms=0`) is not watched; its loss is
//! left to the transport and the stall timeout.

use super::cuda_copy::gpu_err;
use super::heartbeat::HeartbeatConfig;
use super::ipc_plane::IpcPlane;
use super::shared::param;
use crate::backend::{
    Backend, BackendInit, BackendXfer, Capabilities, LocalMd, NotifWaker, PostParams, RemoteMd,
    ViewEntry, ViewMd, XferEntry, XferOp, XferProgress, XferStatus,
};
use crate::device::{self, GpuDesc, GpuHandle, HandleTable, SLOT_LOCAL, SLOT_REQUEST, SLOT_VIEW};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use gpunetio::cudarc::driver::{
    sys, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use gpunetio::intra_node::{ExportedQueuePair, IntraNodeQueuePair};
use gpunetio::proxy::{ExportedProxyQueuePair, RemoteDescriptor};
use gpunetio::{DeviceBuffer, Gpu, HostBuffer};
use nic::{Fields, NicLocal, NicPath, NicRemote, NicSink};
use parking_lot::Mutex;
use peer_dram::{DirectPair, PeerDramPath};
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

mod md;
mod nic;
mod oob;
mod peer_dram;
#[cfg(test)]
mod tests;
mod xfer;

use md::*;
use xfer::*;

/// The backend's name.
pub const NAME: &str = "GPUNETIO";
/// The NIC path's libfabric provider unless `provider` names another.
pub const DEFAULT_PROVIDER: &str = "tcp;ofi_rxm";

/// Which NIC handler reaches a peer (`nic_handler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NicHandlerChoice {
    /// Intra-node where it reaches, the NIC path elsewhere.
    Auto,
    /// Intra-node only (no NIC path is set up).
    IntraNode,
    /// The NIC path for every peer.
    CpuProxy,
}

/// How `GPUNETIO` reaches a peer's VRAM on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntraRoute {
    /// The intra-node queue pair: the peer's memory mapped for the backend's GPU (its
    /// kernels load and store it; host posts run the copy strategies on it).
    IntraNode,
    /// The NIC path (CPU proxy).
    Nic,
    /// Neither: refused with a typed error.
    Unreachable,
}

impl IntraRoute {
    /// As `query_mem_info` names it (the handler's parameter value).
    fn as_str(&self) -> &'static str {
        match self {
            IntraRoute::IntraNode => "intra_node",
            IntraRoute::Nic => "cpu_proxy",
            IntraRoute::Unreachable => "none",
        }
    }
}

/// The route to a peer's VRAM on this node under `handler`, given whether the backend's
/// GPU reaches the peer's GPU directly (`direct`: peer access over NVLink or PCIe, from
/// the pair's topology; `None` where it is not known yet, and mapping decides) and
/// whether the backend has a NIC path: a kernel is never handed an address it cannot
/// reach, so a pair without peer access takes the NIC path, or nothing.
fn intra_route(handler: NicHandlerChoice, direct: Option<bool>, nic: bool) -> IntraRoute {
    let nic_or_nothing = if nic {
        IntraRoute::Nic
    } else {
        IntraRoute::Unreachable
    };
    match (handler, direct) {
        (NicHandlerChoice::CpuProxy, _) => nic_or_nothing,
        (NicHandlerChoice::IntraNode, Some(false)) => IntraRoute::Unreachable,
        (NicHandlerChoice::Auto, Some(false)) => nic_or_nothing,
        (_, Some(true) | None) => IntraRoute::IntraNode,
    }
}

/// How a host-posted intra-node transfer moves its bytes (`copy_engine`). Kernels of the
/// user's (the device API) always go through the queue pair; this is only what `post`
/// does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostCopy {
    /// `CUDA_IPC`'s copy strategies on the backend's GPU (`auto|kernel|memcpy|batch`, see
    /// `cuda_copy`): the copy engines for a few large descriptors, the batched
    /// gather/scatter kernel for many small ones. The copy engines move a single
    /// cross-GPU block over the link at the link's speed, where the SM warps of
    /// [`HostCopy::QueuePair`] stay latency-bound up to several MiB.
    Engines(super::cuda_copy::CopyEngine),
    /// `gio`: the transfer kernel's warps through the intra-node queue pair
    /// (gpunetio's vectorized copy), as kernels of the device API move data.
    QueuePair,
}

impl Default for HostCopy {
    fn default() -> Self {
        HostCopy::Engines(super::cuda_copy::CopyEngine::Auto)
    }
}

impl std::str::FromStr for HostCopy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gio" => Ok(HostCopy::QueuePair),
            other => other.parse().map(HostCopy::Engines).map_err(|_| {
                Error::InvalidParam(format!(
                    "{NAME} parameter copy_engine=`{other}`: expected auto, kernel, memcpy, batch or gio"
                ))
            }),
        }
    }
}

/// Device handles a backend can have live at once (requests and views).
const HANDLE_SLOTS: usize = 16_384;
/// Bounds every device-side wait of the queue pairs this backend builds.
const DEVICE_TIMEOUT: Duration = Duration::from_secs(10);
/// Threads per block of the transfer kernel at most (16 warps; a small intra-node transfer
/// takes smaller blocks, see [`plan`]).
const THREADS: u32 = 512;
/// Smallest piece a warp copies: one round of its lanes' loads in flight (32 lanes x 4 x
/// 16 bytes). A warp has only that much in flight at once, so a transfer is cut into
/// enough pieces for every warp to need about one round: larger pieces leave a warp
/// several latency-bound rounds, and the transfer well below CUDA_IPC's bandwidth (see
/// `docs/BENCHMARKS.md`, "nixl: GPUNETIO").
const MIN_CHUNK: u64 = 2 << 10;
/// No descriptor-level cap on a piece beyond this.
const MAX_CHUNK: u64 = 4 << 20;

/// The `GPUNETIO` backend.
#[derive(Debug)]
pub struct GpunetioBackend {
    ipc: Arc<dyn IpcPlane>,
    setup: Setup,
    /// The GPU-bound half, made once (see [`GpunetioBackend::bound_for`]).
    bound: OnceLock<Arc<Bound>>,
    /// Held while binding; holds the notification wakers handed over before the NIC path
    /// exists (given to it when it is made).
    binding: Mutex<Vec<NotifWaker>>,
    network_devices: Vec<String>,
    oob_interface: Option<String>,
    handler: NicHandlerChoice,
}

/// What binding the backend to a GPU needs, checked at creation.
#[derive(Debug)]
struct Setup {
    agent_name: String,
    /// `gpu_devices`, when given: the GPU is bound at creation.
    explicit_gpu: Option<usize>,
    /// The device of the context current on the creating thread, read before this
    /// backend opened any GPU (opening one makes its context current).
    current_gpu: Option<usize>,
    cuda_streams: usize,
    copy_depth: u32,
    /// How host-posted intra-node transfers move their bytes (`copy_engine`).
    host_copy: HostCopy,
    /// `vram_peer_copy`: VRAM <-> a same-host peer's DRAM in one copy (module
    /// `peer_dram`).
    peer_copy: bool,
    /// `provider`, if given (then a failing NIC path fails the binding).
    provider: Option<String>,
    /// `heartbeat_ms`, `heartbeat_misses`: the NIC path's heartbeats (module `nic`).
    heartbeat: HeartbeatConfig,
}

/// Why the backend drives the GPU it drives (for messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BoundBy {
    /// `gpu_devices`.
    Param,
    /// The first VRAM registered.
    FirstVram,
    /// The creating thread's current CUDA device (needed before any VRAM was registered).
    CurrentDevice,
    /// GPU 0: needed before any VRAM was registered, and no device was current.
    Default,
}

impl BoundBy {
    fn describe(&self) -> &'static str {
        match self {
            BoundBy::Param => "gpu_devices",
            BoundBy::FirstVram => "the GPU of the first VRAM registered",
            BoundBy::CurrentDevice => {
                "the current CUDA device when the backend was created, bound before any VRAM was registered"
            }
            BoundBy::Default => "GPU 0, bound before any VRAM was registered",
        }
    }
}

/// The half of the backend tied to one GPU: its streams, the transfer kernel, the device
/// handle table and the NIC path.
#[derive(Debug)]
struct Bound {
    gpu: Gpu,
    by: BoundBy,
    streams: Arc<StreamPool>,
    transfer: CudaFunction,
    handles: Arc<HandleTable>,
    /// Blocks of the transfer kernel resident at once on the whole GPU (one wave).
    resident_blocks: u32,
    /// The GPU's multiprocessors.
    sm_count: u32,
    nic: Option<Arc<NicPath>>,
    /// Streams of `CUDA_IPC`'s copy strategies, for host-posted intra-node transfers.
    copies: super::cuda_copy::StreamPools,
    host_copy: HostCopy,
    /// VRAM <-> a same-host peer's DRAM in one copy (module `peer_dram`): with a NIC
    /// path (its channel carries the requests) and `vram_peer_copy=auto`.
    peer_dram: Option<Arc<PeerDramPath>>,
}

#[derive(Debug)]
struct StreamPool {
    streams: Vec<Arc<CudaStream>>,
    next: AtomicUsize,
}

impl StreamPool {
    fn next(&self) -> Arc<CudaStream> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        self.streams[i].clone()
    }
}

pub(crate) fn create(init: &BackendInit) -> Result<Arc<dyn Backend>> {
    let params = &init.params;
    const KNOWN: &[&str] = &[
        "gpu_devices",
        "cuda_streams",
        "network_devices",
        "oob_interface",
        "nic_handler",
        "provider",
        "copy_depth",
        "copy_engine",
        crate::backends::peer_dram::PARAM,
        HeartbeatConfig::KEYS[0],
        HeartbeatConfig::KEYS[1],
    ];
    if let Some(key) = params.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(Error::InvalidParam(format!(
            "{NAME} takes no parameter `{key}` (only {})",
            KNOWN.join(", ")
        )));
    }
    let cuda_streams: usize = param(NAME, params, "cuda_streams", 4)?;
    if cuda_streams == 0 || cuda_streams > 64 {
        return Err(Error::InvalidParam(format!(
            "{NAME} parameter cuda_streams={cuda_streams} must be 1..=64"
        )));
    }
    // Empty is "not given" (a plugin-parameter table passed back as it came).
    let explicit_gpu = match params.get("gpu_devices") {
        Some(gpu_devices) if !gpu_devices.trim().is_empty() => {
            Some(parse_gpu_devices(gpu_devices)?)
        }
        _ => None,
    };
    let network_devices: Vec<String> = params
        .get("network_devices")
        .map(|v| {
            v.split([',', ' '])
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    if network_devices.len() > 1 {
        return Err(Error::InvalidParam(format!(
            "{NAME} drives one NIC per backend (as upstream): network_devices={network_devices:?}"
        )));
    }
    // A NIC that is not there is said at once (libibverbs finds its devices in this sysfs
    // class too, so one absent here cannot be opened).
    if let Some(nic) = network_devices.first() {
        if !std::path::Path::new("/sys/class/infiniband")
            .join(nic)
            .exists()
        {
            return Err(Error::InvalidParam(format!(
                "{NAME} parameter network_devices={nic}: this machine has no RDMA device \
                 {nic} (/sys/class/infiniband); without network_devices it runs on CUDA IPC \
                 and the CPU proxy"
            )));
        }
    }
    let handler = match params.get("nic_handler").map(String::as_str) {
        None | Some("auto") => NicHandlerChoice::Auto,
        Some("intra_node") => NicHandlerChoice::IntraNode,
        Some("cpu_proxy") => NicHandlerChoice::CpuProxy,
        Some(other) => {
            return Err(Error::InvalidParam(format!(
                "{NAME} parameter nic_handler={other:?} must be auto, intra_node or cpu_proxy"
            )))
        }
    };
    // Loads each lane of the intra-node copy keeps in flight (gio's GIO_COPY_DEPTH).
    let copy_depth: u32 = param(NAME, params, "copy_depth", 4)?;
    if !(1..=16).contains(&copy_depth) {
        return Err(Error::InvalidParam(format!(
            "{NAME} parameter copy_depth={copy_depth} must be 1..=16"
        )));
    }
    let host_copy: HostCopy = param(NAME, params, "copy_engine", HostCopy::default())?;
    let heartbeat = HeartbeatConfig::parse(NAME, params)?;
    // VRAM <-> a same-host peer's DRAM in one copy by the peer (module `peer_dram`).
    let peer_copy = match params
        .get(crate::backends::peer_dram::PARAM)
        .map(String::as_str)
    {
        None | Some("auto") => true,
        Some("off") => false,
        Some(other) => {
            return Err(Error::InvalidParam(format!(
                "{NAME} parameter {}={other:?} must be auto or off",
                crate::backends::peer_dram::PARAM
            )))
        }
    };
    // The NIC path is built with the GPU, later; what would make it fail is checked now.
    if handler != NicHandlerChoice::IntraNode {
        let node = oob::interface_address(params.get("oob_interface").map(String::as_str))?;
        if let Some(provider) = params.get("provider") {
            NicPath::probe_provider(provider, node)?;
        } else if handler == NicHandlerChoice::CpuProxy {
            NicPath::probe_provider(DEFAULT_PROVIDER, node)?;
        }
    }
    // Before anything here opens a GPU: opening one makes its context current.
    let current_gpu = gpu_mem::current_device().ok().flatten();
    let ipc = super::cuda_ipc::open_plane(&init.agent_name, 1)?;
    if let Some(nic) = network_devices.first() {
        tracing::info!(
            "{NAME}: network device {nic} is recorded; the NIC path posts through a CPU proxy on libfabric"
        );
    }
    let backend = GpunetioBackend {
        ipc,
        setup: Setup {
            agent_name: init.agent_name.clone(),
            explicit_gpu,
            current_gpu,
            cuda_streams,
            copy_depth,
            host_copy,
            peer_copy,
            provider: params.get("provider").cloned(),
            heartbeat,
        },
        bound: OnceLock::new(),
        binding: Mutex::new(Vec::new()),
        network_devices,
        oob_interface: params.get("oob_interface").cloned(),
        handler,
    };
    // An explicit GPU is bound now, so that a wrong one fails at creation.
    if explicit_gpu.is_some() {
        backend.bound()?;
    }
    Ok(Arc::new(backend))
}

/// `gpu_devices`: one CUDA ordinal.
fn parse_gpu_devices(gpu_devices: &str) -> Result<usize> {
    let ordinals: Vec<&str> = gpu_devices
        .split([',', ' '])
        .filter(|s| !s.is_empty())
        .collect();
    match ordinals.as_slice() {
        [one] => one.parse().map_err(|_| {
            Error::InvalidParam(format!(
                "{NAME} parameter gpu_devices={gpu_devices:?} is not a CUDA ordinal"
            ))
        }),
        _ => Err(Error::InvalidParam(format!(
            "{NAME} drives one GPU per backend (as upstream): gpu_devices={gpu_devices:?}"
        ))),
    }
}

/// Which GPU a backend binds, and why: `gpu_devices` always; else the GPU of the VRAM
/// being registered (`vram`); else the creating thread's current device; else GPU 0.
fn choose_gpu(
    explicit: Option<usize>,
    vram: Option<usize>,
    current: Option<usize>,
) -> (usize, BoundBy) {
    match (explicit, vram, current) {
        (Some(g), _, _) => (g, BoundBy::Param),
        (None, Some(g), _) => (g, BoundBy::FirstVram),
        (None, None, Some(g)) => (g, BoundBy::CurrentDevice),
        (None, None, None) => (0, BoundBy::Default),
    }
}

impl Bound {
    /// Opens GPU `ordinal` and makes everything of the backend that lives on it: the
    /// NIC path, the streams, the transfer kernel, the device handle table.
    fn new(
        setup: &Setup,
        handler: NicHandlerChoice,
        oob_interface: Option<&str>,
        ordinal: usize,
        by: BoundBy,
    ) -> Result<Self> {
        let gpu = Gpu::open(ordinal).map_err(gpu_err("opening the backend's GPU"))?;
        let nic = match handler {
            NicHandlerChoice::IntraNode => None,
            _ => {
                let provider = setup.provider.as_deref().unwrap_or(DEFAULT_PROVIDER);
                let node = oob::interface_address(oob_interface)?;
                match NicPath::new(
                    &setup.agent_name,
                    &gpu,
                    provider,
                    node,
                    DEVICE_TIMEOUT,
                    setup.heartbeat,
                ) {
                    Ok(nic) => Some(nic),
                    Err(e) if handler == NicHandlerChoice::Auto && setup.provider.is_none() => {
                        tracing::warn!("{NAME}: no NIC path (peers on this node only): {e}");
                        None
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let peer_dram = match &nic {
            Some(nic) => {
                // Peers' requests run on this backend's copy strategy (`gio` is a
                // queue-pair path of its own kernels: the strategies' `auto` there).
                let serving = match setup.host_copy {
                    HostCopy::Engines(engine) => engine,
                    HostCopy::QueuePair => super::cuda_copy::CopyEngine::Auto,
                };
                match PeerDramPath::new(
                    &setup.agent_name,
                    setup.peer_copy,
                    serving,
                    nic.own_conns(),
                )? {
                    Some((path, handler, lanes)) => {
                        nic.serve_control(handler, lanes);
                        Some(path)
                    }
                    None => None,
                }
            }
            None => None,
        };
        let ctx = gpu.context();
        let streams = (0..setup.cuda_streams)
            .map(|_| ctx.new_stream())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Gpu(format!("creating {NAME}'s streams: {e:?}")))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| Error::Gpu(format!("reading the SM count: {e:?}")))?
            .max(1) as u32;
        let options =
            device::compile_options(&gpu)?.define(format!("GIO_COPY_DEPTH={}", setup.copy_depth));
        let (name, source) = device::DEVICE_SOURCES[0];
        let ptx = gpunetio::device_code::compile(name, source, &options)
            .map_err(|e| Error::Gpu(format!("compiling {NAME}'s transfer kernel: {e}")))?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| Error::Gpu(format!("loading {NAME}'s transfer kernel: {e:?}")))?;
        let transfer = module
            .load_function("nixl_gpunetio_xfer")
            .map_err(|e| Error::Gpu(format!("nixl_gpunetio_xfer: {e:?}")))?;
        // One wave: more blocks than fit at once (the kernel's registers decide, 4 of 512
        // threads at most) leave a tail wave that runs with the GPU mostly idle.
        let per_sm = transfer
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)
            .map_err(|e| Error::Gpu(format!("the transfer kernel's occupancy: {e:?}")))?
            .clamp(1, 4);
        tracing::debug!("{NAME}: {per_sm} transfer blocks per SM, {sm_count} SMs");
        Ok(Bound {
            handles: HandleTable::new(&gpu, HANDLE_SLOTS)?,
            gpu,
            by,
            streams: Arc::new(StreamPool {
                streams,
                next: AtomicUsize::new(0),
            }),
            transfer,
            resident_blocks: sm_count * per_sm,
            sm_count,
            nic,
            copies: super::cuda_copy::StreamPools::new(setup.cuda_streams),
            host_copy: setup.host_copy,
            peer_dram,
        })
    }
}

impl GpunetioBackend {
    /// The GPU-bound half, binding it first if it is not yet (see [`Self::bound_for`]).
    fn bound(&self) -> Result<&Arc<Bound>> {
        self.bound_for(None)
    }

    /// The GPU-bound half. The first call binds it, once and under a lock (concurrent
    /// first calls agree on one GPU): to `gpu_devices` when given, else to `vram` (the GPU
    /// of the VRAM a registration brings), else to the creating thread's current device,
    /// else to GPU 0. Later calls return it whatever `vram` says (the caller compares).
    fn bound_for(&self, vram: Option<usize>) -> Result<&Arc<Bound>> {
        if let Some(b) = self.bound.get() {
            return Ok(b);
        }
        let mut wakers = self.binding.lock();
        if let Some(b) = self.bound.get() {
            return Ok(b);
        }
        let (ordinal, by) = choose_gpu(self.setup.explicit_gpu, vram, self.setup.current_gpu);
        let bound = Bound::new(
            &self.setup,
            self.handler,
            self.oob_interface.as_deref(),
            ordinal,
            by,
        )?;
        if let Some(nic) = &bound.nic {
            for w in wakers.drain(..) {
                nic.add_notif_waker(w);
            }
        }
        tracing::info!("{NAME}: drives GPU {ordinal} ({})", by.describe());
        Ok(self.bound.get_or_init(|| Arc::new(bound)))
    }

    /// The NIC path, if the backend is bound and has one.
    fn nic_if_bound(&self) -> Option<&Arc<NicPath>> {
        self.bound.get().and_then(|b| b.nic.as_ref())
    }

    /// The GPU this backend drives, once bound: `gpu_devices`, else the GPU of the first
    /// VRAM registered, else (for anything that needs a GPU before that) the creating
    /// thread's current device or GPU 0.
    pub fn gpu(&self) -> Option<&Gpu> {
        self.bound.get().map(|b| &b.gpu)
    }

    /// The NIC named by `network_devices` (used for peers on other nodes).
    pub fn network_devices(&self) -> &[String] {
        &self.network_devices
    }

    /// The interface named by `oob_interface`.
    pub fn oob_interface(&self) -> Option<&str> {
        self.oob_interface.as_deref()
    }

    /// The `nic_handler` choice.
    pub fn nic_handler(&self) -> NicHandlerChoice {
        self.handler
    }

    /// The NIC path's libfabric provider, if it has one (once bound).
    pub fn nic_provider(&self) -> Option<&str> {
        self.nic_if_bound().map(|n| n.provider())
    }

    /// Notification connections refused for naming a loaded peer (or this agent) that
    /// said they were not its (module `oob`); 0 before the NIC path exists.
    pub fn refused_notification_senders(&self) -> u64 {
        self.nic_if_bound().map_or(0, |n| n.refused_senders())
    }

    /// `query_mem_info`'s answer for meta `peer:<agent>`: `vram_peer_dram` (`direct`: one
    /// copy by the peer; `cpu_proxy`; `none`: no NIC path), `provider`, and the
    /// direct-copy counters over all peers (`peer_copy_bytes`, `peer_copy_served_bytes`,
    /// `peer_copy_fallbacks`, `peer_copy_refused`).
    fn peer_path_info(&self, agent: &str) -> crate::backend::BackendParams {
        let mut info = crate::backend::BackendParams::new();
        let Some(b) = self.bound.get() else {
            info.insert("vram_peer_dram".into(), "none".into());
            return info;
        };
        let Some(nic) = &b.nic else {
            info.insert("vram_peer_dram".into(), "none".into());
            return info;
        };
        info.insert("provider".into(), nic.provider().to_string());
        let path = match &b.peer_dram {
            Some(path) => {
                for (k, v) in path.counters() {
                    info.insert(k.into(), v.to_string());
                }
                path.describe(agent, self.intra_node_peer(agent), nic.provider())
                    .0
            }
            None => "cpu_proxy",
        };
        info.insert("vram_peer_dram".into(), path.into());
        info
    }

    /// Whether `agent` is a peer the intra-node path may serve: on this node, and
    /// `nic_handler` is not `cpu_proxy`.
    fn intra_node_peer(&self, agent: &str) -> bool {
        self.handler != NicHandlerChoice::CpuProxy && self.ipc.reach(agent).is_ok()
    }

    /// Whether the intra-node path carries a transfer to `agent` whose pieces have
    /// these metadata: a peer on this node, reached by CUDA IPC on both sides.
    fn intra_node_reaches<'a>(
        &self,
        agent: &str,
        mut parts: impl Iterator<Item = (&'a GnLocal, &'a GnRemote)>,
    ) -> bool {
        self.intra_node_peer(agent) && parts.all(|(l, r)| l.ipc.is_some() && r.ipc.is_some())
    }

    /// The direct path for a transfer between this backend's VRAM and a same-host
    /// peer's DRAM, where it fits as a whole (module `peer_dram`, "Choice and
    /// fallback"), with the NIC path's transfer beside it; `None`: the NIC path.
    fn prep_peer_dram(
        &self,
        b: &Bound,
        op: XferOp,
        entries: &[XferEntry<'_>],
        parts: &[(&GnLocal, &GnRemote)],
        agent: &str,
    ) -> Result<Option<Box<dyn BackendXfer>>> {
        let Some(path) = &b.peer_dram else {
            return Ok(None);
        };
        let facts =
            entries
                .iter()
                .zip(parts)
                .map(|(e, (l, r))| crate::backends::peer_dram::PairFacts {
                    local: e.local_region.kind,
                    remote: r.kind,
                    local_exported: l.export.is_some(),
                    remote_exported: false,
                });
        let case = crate::backends::peer_dram::choose(
            true,
            self.intra_node_peer(agent),
            path.peer_serves(agent),
            facts,
        );
        if case != Some(crate::backends::peer_dram::Case::TargetOwned) {
            return Ok(None);
        }
        let pairs = entries
            .iter()
            .zip(parts)
            .filter_map(|(e, (l, _))| {
                l.export.map(|x| DirectPair {
                    home: crate::backends::peer_dram::PieceHome {
                        handle: x.handle,
                        vram_region: e.local_region.desc.addr,
                        dram_region: e.remote_region.desc.addr,
                    },
                    vram: e.local.addr,
                    dram: e.remote.addr,
                    len: e.local.len,
                })
            })
            .collect::<Vec<_>>();
        // The control connection first: where it cannot be opened, the NIC path alone.
        if let Err(e) = path.conn(agent) {
            tracing::info!("{NAME}: no control connection to `{agent}` ({e}): the CPU proxy");
            return Ok(None);
        }
        let fallback = b.prep_nic(op, entries, parts, agent)?;
        let xfer = path.prep(
            op == XferOp::Write,
            &pairs,
            agent,
            b.gpu.ordinal(),
            fallback,
        )?;
        Ok(Some(Box::new(xfer)))
    }
}

impl Bound {
    fn nic(&self) -> Result<&Arc<NicPath>> {
        self.nic.as_ref().ok_or_else(|| Error::NotSupported {
            backend: NAME.into(),
            what: "the NIC path (peers on other nodes, a peer's DRAM): nic_handler=intra_node, or no provider opened".into(),
        })
    }

    /// The NIC path's transfer: the proxy toward `agent`, descriptors naming the local
    /// slots and the peer's regions in it.
    fn prep_nic(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        parts: &[(&GnLocal, &GnRemote)],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        let nic = self.nic()?;
        let peer = nic.link(agent)?;
        let mut descs = Vec::with_capacity(entries.len());
        for (e, (l, r)) in entries.iter().zip(parts) {
            let local = l.nic.as_ref().ok_or_else(|| {
                Error::InvalidParam(format!("{NAME}: a registration without a NIC path"))
            })?;
            descs.push(GpuDesc {
                local_addr: e.local.addr,
                remote_addr: 0,
                len: e.local.len,
                local_mr: local.slot,
                remote_mr: r.nic.index(&peer)?,
                local_off: e.local.addr - e.local_region.desc.addr,
                remote_off: e.remote.addr - e.remote_region.desc.addr,
            });
        }
        let qp = peer
            .proxy
            .export()
            .map_err(gpu_err("exporting the peer's proxy queue pair"))?;
        let sink: Arc<dyn super::cuda_copy::NotifSink> = Arc::new(NicSink { peer: peer.clone() });
        let keep: Vec<Arc<dyn Any + Send + Sync>> = vec![peer];
        // One block posts one operation per descriptor (the kernel's NIC branch).
        let grid = Grid {
            blocks: 1,
            threads: THREADS,
            chunk: MIN_CHUNK,
        };
        Ok(Box::new(self.kernel_xfer(
            op,
            DeviceQp::Proxy(qp),
            &descs,
            grid,
            keep,
            sink,
        )?))
    }

    #[allow(clippy::too_many_arguments)]
    fn kernel_xfer(
        &self,
        op: XferOp,
        qp: DeviceQp,
        descs: &[GpuDesc],
        grid: Grid,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
        sink: Arc<dyn super::cuda_copy::NotifSink>,
    ) -> Result<KernelXfer> {
        let table = self.upload(descs)?;
        let status =
            HostBuffer::alloc(&self.gpu, 8).map_err(gpu_err("allocating the status word"))?;
        let status_ptr = status
            .device_ptr()
            .map_err(gpu_err("mapping the status word"))?;
        let event = self
            .gpu
            .context()
            .new_event(None)
            .map_err(|e| Error::Gpu(format!("cuEventCreate: {e:?}")))?;
        Ok(KernelXfer {
            gpu: self.gpu.clone(),
            function: self.transfer.clone(),
            pool: self.streams.clone(),
            handles: self.handles.clone(),
            mem: Arc::new(RequestMem {
                qp,
                table,
                descs: descs.to_vec(),
                _keep: keep,
            }),
            read: op == XferOp::Read,
            grid,
            status,
            status_ptr,
            event,
            in_flight: false,
            pending_notif: None,
            sink,
        })
    }

    /// The copies a host post of an intra-node transfer runs: each resolved pair between
    /// the local range and the peer's range mapped here (for this GPU, peer access on),
    /// on this GPU's streams as `engine` decides (the strategies `CUDA_IPC` uses).
    fn host_copies(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        pairs: &[super::ipc_plane::ResolvedPair],
        engine: super::cuda_copy::CopyEngine,
        sink: Arc<dyn super::cuda_copy::NotifSink>,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Result<super::cuda_copy::GpuXfer> {
        use super::cuda_copy::{Copy, GpuXfer, MemLoc};
        let ordinal = self.gpu.ordinal();
        let copies = pairs.iter().zip(entries).map(|(p, e)| {
            // Local DRAM is pinned (resolve pinned it) but whether the driver took it is
            // not known here: counted as pageable, it stays with the copy engines.
            let local_loc = match e.local_region.kind {
                MemKind::Vram => MemLoc::Gpu(ordinal),
                _ => MemLoc::Host { pinned: false },
            };
            let remote_loc = if p.kernel_reach {
                MemLoc::Gpu(ordinal)
            } else {
                MemLoc::Host { pinned: false }
            };
            let local = (p.local, local_loc);
            let remote = (p.remote, remote_loc);
            let (src, dst) = match op {
                XferOp::Write => (local, remote),
                XferOp::Read => (remote, local),
            };
            (
                ordinal,
                Copy {
                    dst: dst.0,
                    src: src.0,
                    len: p.len as usize,
                    dst_loc: dst.1,
                    src_loc: src.1,
                },
            )
        });
        GpuXfer::new(&self.copies, copies, usize::MAX, engine, sink, keep)
    }

    /// An intra-node queue pair, exported, whose region `i` is `ranges[i]` (address,
    /// length, whether it is the peer's).
    fn queue_pair(&self, ranges: &[(u64, u64, bool)]) -> Result<ExportedQueuePair> {
        let mut qp = IntraNodeQueuePair::new(&self.gpu, 0, DEVICE_TIMEOUT);
        for &(addr, len, remote) in ranges {
            // SAFETY: every range is a registration (or a mapping of the peer's) that the
            // request or view owning this queue pair keeps alive as long as it.
            unsafe { qp.add_range(addr, len, remote, Arc::new(())) }
                .map_err(|e| Error::InvalidParam(format!("{NAME}: {e}")))?;
        }
        qp.export().map_err(gpu_err("exporting the queue pair"))
    }

    fn upload(&self, descs: &[GpuDesc]) -> Result<DeviceBuffer> {
        let bytes = std::mem::size_of_val(descs);
        let buf = DeviceBuffer::alloc(&self.gpu, bytes.max(1))
            .map_err(gpu_err("allocating the descriptor table"))?;
        // SAFETY: GpuDesc is repr(C) plain old data without padding (asserted in
        // crate::device).
        let raw = unsafe { std::slice::from_raw_parts(descs.as_ptr().cast::<u8>(), bytes) };
        buf.copy_from_host(0, raw)
            .map_err(gpu_err("writing the descriptor table"))?;
        Ok(buf)
    }

    fn check_local_gpu(&self, kind: MemKind, dev_id: u64) -> Result<()> {
        if kind == MemKind::Vram && dev_id != self.gpu.ordinal() as u64 {
            return Err(Error::InvalidParam(format!(
                "{NAME} drives GPU {} ({}); this VRAM is on GPU {dev_id} (one GPU per backend: create another agent, or pass gpu_devices={dev_id})",
                self.gpu.ordinal(),
                self.by.describe()
            )));
        }
        Ok(())
    }

    /// Grid and piece size for moving `total` bytes with the transfer kernel.
    fn plan(&self, total: u64, largest: u64) -> Grid {
        plan(total, largest, self.sm_count, self.resident_blocks)
    }
}

impl Backend for GpunetioBackend {
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
        &[MemKind::Dram, MemKind::Vram]
    }
    fn supported_remote_mem(&self) -> &[MemKind] {
        // Before binding, the NIC path is expected unless nic_handler=intra_node.
        let nic = match self.bound.get() {
            Some(b) => b.nic.is_some(),
            None => self.handler != NicHandlerChoice::IntraNode,
        };
        if nic {
            &[MemKind::Dram, MemKind::Vram]
        } else {
            &[MemKind::Vram]
        }
    }
    fn reach(&self, agent: &str) -> Result<()> {
        let intra = if self.handler == NicHandlerChoice::CpuProxy {
            Err(Error::Unreachable {
                backend: NAME.into(),
                agent: agent.to_string(),
                reason: "nic_handler=cpu_proxy and its metadata (NIC path) was not loaded".into(),
            })
        } else {
            self.ipc.reach(agent)
        };
        match intra {
            Ok(()) => Ok(()),
            Err(_) if self.nic_if_bound().is_some_and(|n| n.knows(agent)) => Ok(()),
            Err(Error::Unreachable { agent, reason, .. }) => Err(Error::Unreachable {
                backend: NAME.into(),
                agent,
                reason: if self.nic_if_bound().is_some() {
                    format!("{reason}, and it published no NIC path this backend can use")
                } else {
                    format!("{reason} (no NIC path: nic_handler=intra_node or no provider)")
                },
            }),
            Err(other) => Err(other),
        }
    }
    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        // The first VRAM registered binds its GPU (unless gpu_devices did).
        let vram = (region.kind == MemKind::Vram).then_some(region.desc.dev_id as usize);
        let b = self.bound_for(vram)?;
        b.check_local_gpu(region.kind, region.desc.dev_id)?;
        let ipc = match self.ipc.register_mem(region) {
            Ok(md) => Some(md),
            // Memory CUDA IPC cannot export (stream-ordered pool memory) still moves
            // through the NIC path.
            Err(e) if b.nic.is_some() => {
                tracing::debug!("{NAME}: no intra-node export of this region: {e}");
                None
            }
            Err(e) => return Err(e),
        };
        let nic = match &b.nic {
            Some(nic) => Some(nic.register(region.kind, region.desc.addr, region.desc.len)?),
            None => None,
        };
        // Its part in direct copies with same-host peers: VRAM's export (advertised in
        // its metadata), DRAM served to peers' requests.
        let d = region.desc;
        let (export, served) = match (&b.peer_dram, region.kind) {
            (Some(_), MemKind::Vram) => (
                crate::backends::peer_dram::export_vram(d.addr, d.len, d.dev_id as usize),
                None,
            ),
            (Some(path), MemKind::Dram) => (
                None,
                path.shared.server.as_ref().map(|s| s.add(d.addr, d.len)),
            ),
            _ => (None, None),
        };
        Ok(Arc::new(GnLocal {
            ipc,
            nic,
            export,
            _served: served,
        }))
    }
    fn connection_info(&self) -> Result<Vec<u8>> {
        let ipc = self.ipc.connection_info()?;
        let b = self.bound()?;
        // Same-host control connections: this process and its Unix socket (module `oob`).
        let local = match (&b.peer_dram, &b.nic) {
            (Some(_), Some(nic)) => nic
                .oob_unix()
                .zip(oob::LocalIdentity::me())
                .map(|(name, me)| (name.to_vec(), me)),
            _ => None,
        };
        encode_conn_info(&ConnInfo {
            ipc: &ipc,
            nic: b.nic.as_ref().map(|nic| nic.info()).transpose()?,
            peer_copy: if b.peer_dram.is_some() {
                peer_dram::SERVES_PEER_COPIES | peer_dram::NOTIF_IN_REQUEST
            } else {
                0
            },
            local,
            hub: b.nic.as_ref().and_then(|nic| nic.hub_addr()),
        })
    }
    fn load_remote_conn_info(&self, agent: &str, info: &[u8]) -> Result<()> {
        let parsed = parse_conn_info(agent, info)?;
        self.ipc.load_remote_conn_info(agent, parsed.ipc)?;
        let b = self.bound()?;
        if let Some(path) = &b.peer_dram {
            path.load_peer(
                agent,
                parsed.peer_copy,
                parsed.nic.as_ref().map(|n| n.oob),
                parsed.local.clone(),
            );
        }
        match (&b.nic, parsed.nic) {
            (Some(path), Some(nic_info)) => {
                let who = parsed.local.map(|(_, who)| who);
                // Same node (CUDA IPC's boot id), same pid namespace: the peer's process
                // can be asked of `/proc` (heartbeats then judge it as LIBFABRIC's do).
                let process = who
                    .filter(|_| self.ipc.reach(agent).is_ok())
                    .filter(|who| {
                        oob::LocalIdentity::me().is_some_and(|me| me.pid_ns == who.pid_ns)
                    })
                    .map(|who| crate::backends::shared::LocalProcess {
                        pid: who.pid,
                        start_time: who.start_time,
                    });
                let same_host = self.ipc.reach(agent).is_ok();
                path.load_peer(agent, nic_info, parsed.hub, same_host, process)?;
                path.know_process(agent, who);
                Ok(())
            }
            _ => Ok(()),
        }
    }
    fn load_remote_md(
        &self,
        agent: &str,
        region: &Region,
        public_md: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        let (ipc_md, desc, export) = parse_region_md(agent, public_md)?;
        if let (Some(path), Some(export), MemKind::Vram) =
            (&self.bound()?.peer_dram, export, region.kind)
        {
            // The only VRAM of this peer its direct-copy requests may name.
            path.advertise(agent, region.desc.addr, region.desc.len, export);
        }
        if let Some(d) = &desc {
            if d.len < region.desc.len {
                return Err(Error::MalformedMetadata(format!(
                    "{NAME} region of `{agent}`: its descriptor covers {} of {} bytes",
                    d.len, region.desc.len
                )));
            }
        }
        let ipc = if region.kind == MemKind::Vram && !ipc_md.is_empty() {
            Some(self.ipc.load_remote_md(agent, region, ipc_md)?)
        } else {
            None
        };
        Ok(Arc::new(GnRemote {
            ipc,
            nic: NicRemote::new(desc),
            kind: region.kind,
        }))
    }
    fn peer_gone(&self, agent: &str) -> bool {
        // The peer's process, as CUDA IPC watches it (same node), or its NIC path's
        // heartbeats (a vanished host, a cut link).
        self.ipc.peer_gone(agent) || self.nic_if_bound().is_some_and(|n| n.peer_gone(agent))
    }
    fn disconnect(&self, agent: &str) {
        self.ipc.disconnect(agent);
        if let Some(nic) = self.nic_if_bound() {
            nic.forget(agent);
        }
        if let Some(path) = self.bound.get().and_then(|b| b.peer_dram.as_ref()) {
            path.forget(agent);
        }
    }
    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        let b = self.bound()?;
        for e in entries {
            b.check_local_gpu(e.local_region.kind, e.local.dev_id)?;
        }
        let parts = entries
            .iter()
            .map(|e| Ok((local_md(e.local_md)?, remote_md(e.remote_md)?)))
            .collect::<Result<Vec<_>>>()?;
        if !self.intra_node_reaches(agent, parts.iter().copied()) {
            if b.nic.is_some() {
                if let Some(direct) = self.prep_peer_dram(b, op, entries, &parts, agent)? {
                    return Ok(direct);
                }
                return b.prep_nic(op, entries, &parts, agent);
            }
            // The intra-node path's own refusal says why (another node, a peer's DRAM).
            self.ipc.reach(agent)?;
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: "a transfer to a peer's DRAM or unexported memory without a NIC path (nic_handler=intra_node)".into(),
            });
        }
        if entries.len() > gpunetio::intra_node::MAX_REGIONS / 2 {
            return Err(Error::InvalidParam(format!(
                "{NAME} moves at most {} descriptors per request",
                gpunetio::intra_node::MAX_REGIONS / 2
            )));
        }
        let inner: Vec<XferEntry<'_>> = entries
            .iter()
            .zip(&parts)
            .map(|(e, (l, r))| XferEntry {
                local_md: &**l.ipc.as_ref().expect("checked by intra_node_reaches"),
                remote_md: &**r.ipc.as_ref().expect("checked by intra_node_reaches"),
                ..*e
            })
            .collect();
        // Mapped for the kernel's GPU: peer access toward the peer's GPU is enabled; a
        // pair without it cannot be reached by a kernel and goes to the NIC path, if any.
        let resolved = match self.ipc.resolve(&inner, agent, Some(b.gpu.ordinal())) {
            Ok(r) => r,
            // The pair has no peer access (the plane read its topology).
            Err(e @ Error::NotSupported { .. }) => {
                match intra_route(self.handler, Some(false), b.nic.is_some()) {
                    IntraRoute::Nic => {
                        tracing::info!("{NAME}: {e}; this transfer goes through the NIC path");
                        return b.prep_nic(op, entries, &parts, agent);
                    }
                    _ => {
                        let what = format!(
                            "{e} (and there is no NIC path: nic_handler=intra_node or no provider)"
                        );
                        return Err(Error::NotSupported {
                            backend: NAME.into(),
                            what,
                        });
                    }
                }
            }
            Err(e) => return Err(e),
        };
        let ranges: Vec<(u64, u64, bool)> = resolved
            .pairs
            .iter()
            .flat_map(|p| [(p.local, p.len, false), (p.remote, p.len, true)])
            .collect();
        let descs: Vec<GpuDesc> = resolved
            .pairs
            .iter()
            .enumerate()
            .map(|(i, p)| GpuDesc {
                local_addr: p.local,
                remote_addr: p.remote,
                len: p.len,
                local_mr: 2 * i as u32,
                remote_mr: 2 * i as u32 + 1,
                local_off: 0,
                remote_off: 0,
            })
            .collect();
        if let HostCopy::Engines(engine) = b.host_copy {
            let copies = b.host_copies(
                op,
                entries,
                &resolved.pairs,
                engine,
                resolved.sink,
                resolved.keep.clone(),
            )?;
            return Ok(Box::new(CopyXfer {
                bound: b.clone(),
                copies,
                ranges,
                descs,
                keep: resolved.keep,
                device: None,
            }));
        }
        let qp = b.queue_pair(&ranges)?;
        let total: u64 = descs.iter().map(|d| d.len).sum();
        let largest = descs.iter().map(|d| d.len).max().unwrap_or(0);
        Ok(Box::new(b.kernel_xfer(
            op,
            DeviceQp::IntraNode(qp),
            &descs,
            b.plan(total, largest),
            resolved.keep,
            resolved.sink,
        )?))
    }
    /// The route between a pair of GPUs of this node, each descriptor's metadata `"A:B"`
    /// (the GPU running the kernels, normally the backend's, then the GPU holding a peer's
    /// VRAM): `CUDA_IPC`'s answer for the pair (`path`: `same-gpu`, `peer`,
    /// `host-staged`; `link`: `nvlink`, `pcie`, ...) and `handler`, where `GPUNETIO` sends
    /// transfers and views of such memory under its `nic_handler`: `intra_node`,
    /// `cpu_proxy` (no peer access, or `nic_handler=cpu_proxy`), or `none`. `None` for a
    /// GPU this process does not see.
    fn query_mem_info(
        &self,
        kind: MemKind,
        meta: &[&[u8]],
    ) -> Result<Vec<Option<crate::backend::BackendParams>>> {
        // `peer:<agent>`: how VRAM <-> that peer's DRAM moves (module `peer_dram`).
        if meta.iter().any(|m| m.starts_with(b"peer:")) {
            return Ok(meta
                .iter()
                .map(|m| {
                    let agent = std::str::from_utf8(m.strip_prefix(b"peer:")?).ok()?;
                    Some(self.peer_path_info(agent))
                })
                .collect());
        }
        if kind != MemKind::Vram {
            return Err(Error::UnsupportedMemKind {
                backend: NAME.into(),
                kind,
            });
        }
        let nic = match self.bound.get() {
            Some(b) => b.nic.is_some(),
            None => self.handler != NicHandlerChoice::IntraNode,
        };
        let mut answers = self.ipc.query_mem_info(kind, meta)?;
        for info in answers.iter_mut().flatten() {
            let direct = info.get("path").map(|p| p != "host-staged");
            let route = intra_route(self.handler, direct, nic);
            info.insert("handler".into(), route.as_str().into());
        }
        Ok(answers)
    }
    /// How VRAM <-> `agent`'s DRAM moves (module `peer_dram`), once the backend is bound
    /// and has a NIC path.
    fn peer_transport(&self, agent: &str) -> Option<String> {
        let b = self.bound.get()?;
        let nic = b.nic.as_ref()?;
        let same_host = self.intra_node_peer(agent);
        Some(match &b.peer_dram {
            Some(path) => path.describe(agent, same_host, nic.provider()).1,
            None => format!(
                "VRAM <-> the peer's DRAM: CPU proxy over libfabric {} (vram_peer_copy=off, \
                 or no GPU copies here)",
                nic.provider()
            ),
        })
    }
    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        if let Some(nic) = self.nic_if_bound() {
            if !self.intra_node_peer(agent) && nic.knows(agent) {
                let link = nic.link(agent)?;
                link.alive()?;
                return link.oob.send(msg);
            }
        }
        self.ipc.gen_notif(agent, msg)
    }
    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.ipc.take_notifs(into);
        if let Some(nic) = self.nic_if_bound() {
            nic.take_notifs(into);
        }
    }
    fn set_notif_waker(&self, waker: NotifWaker) -> bool {
        // Both paths queue from their receiving threads (or the completing thread). Before
        // binding, the NIC path does not exist yet: it gets the waker when it is made.
        {
            let mut pending = self.binding.lock();
            match self.bound.get() {
                Some(b) => {
                    if let Some(nic) = &b.nic {
                        nic.add_notif_waker(waker.clone());
                    }
                }
                None => pending.push(waker.clone()),
            }
        }
        self.ipc.set_notif_waker(waker)
    }
    fn prep_mem_view(&self, agent: Option<&str>, entries: &[ViewEntry<'_>]) -> Result<GpuHandle> {
        let b = self.bound()?;
        if entries.len() > gpunetio::intra_node::MAX_REGIONS {
            return Err(Error::InvalidParam(format!(
                "{NAME}: a view holds at most {} elements",
                gpunetio::intra_node::MAX_REGIONS
            )));
        }
        match agent {
            None => {
                let mut descs = Vec::with_capacity(entries.len());
                for e in entries {
                    let ViewMd::Local(md) = e.md else {
                        return Err(Error::InvalidParam(
                            "a local view of a peer's region".into(),
                        ));
                    };
                    let md = local_md(md)?;
                    b.check_local_gpu(e.region.kind, e.desc.dev_id)?;
                    // Intra-node puts read local DRAM through its mapping.
                    let mapped = e.region.kind != MemKind::Dram
                        || md
                            .ipc
                            .as_ref()
                            .is_some_and(|m| self.ipc.pin_local_dram(&**m));
                    if !mapped && md.nic.is_none() {
                        return Err(Error::InvalidParam(format!(
                            "{NAME}: this DRAM cannot be mapped for the GPU"
                        )));
                    }
                    descs.push(GpuDesc {
                        local_addr: e.desc.addr,
                        remote_addr: 0,
                        len: e.desc.len,
                        local_mr: md.nic.as_ref().map_or(u32::MAX, |n| n.slot),
                        remote_mr: u32::MAX,
                        local_off: e.desc.addr - e.region.desc.addr,
                        remote_off: 0,
                    });
                }
                // A local view's elements are sources: kernels read them through their
                // addresses (intra-node) or name their slot (NIC path), so it needs no
                // queue pair of its own.
                b.handles
                    .publish(0, &descs, SLOT_VIEW | SLOT_LOCAL, Box::new(()))
            }
            Some(peer) => {
                let remotes = entries
                    .iter()
                    .map(|e| match e.md {
                        ViewMd::Remote(md) => remote_md(md),
                        ViewMd::Local(_) => Err(Error::InvalidParam(
                            "a remote view of a local region".into(),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let intra = self.intra_node_peer(peer) && remotes.iter().all(|r| r.ipc.is_some());
                if !intra {
                    return b.nic_view(peer, entries, &remotes);
                }
                let ranges: Vec<_> = entries
                    .iter()
                    .zip(&remotes)
                    .map(|(e, r)| (e.desc, &**r.ipc.as_ref().expect("checked above")))
                    .collect();
                let (addrs, keep) = match self.ipc.map_remote(peer, &ranges, b.gpu.ordinal()) {
                    Ok(mapped) => mapped,
                    // No peer access toward the peer's GPU: its kernels cannot reach the
                    // mapping, the NIC path can.
                    Err(e @ Error::NotSupported { .. }) => {
                        return match intra_route(self.handler, Some(false), b.nic.is_some()) {
                            IntraRoute::Nic => {
                                tracing::info!("{NAME}: {e}; this view goes through the NIC path");
                                b.nic_view(peer, entries, &remotes)
                            }
                            _ => Err(e),
                        };
                    }
                    Err(e) => return Err(e),
                };
                let spans: Vec<(u64, u64, bool)> = addrs
                    .iter()
                    .zip(entries)
                    .map(|(&a, e)| (a, e.desc.len, true))
                    .collect();
                let qp = b.queue_pair(&spans)?;
                let descs: Vec<GpuDesc> = addrs
                    .iter()
                    .zip(entries)
                    .enumerate()
                    .map(|(i, (&a, e))| GpuDesc {
                        local_addr: 0,
                        remote_addr: a,
                        len: e.desc.len,
                        local_mr: u32::MAX,
                        remote_mr: i as u32,
                        local_off: 0,
                        remote_off: 0,
                    })
                    .collect();
                b.publish_view(DeviceQp::IntraNode(qp), &descs, keep)
            }
        }
    }
}

impl Bound {
    /// A remote view over the NIC path: the proxy toward `peer`, elements naming the
    /// peer's regions in it.
    fn nic_view(
        &self,
        peer: &str,
        entries: &[ViewEntry<'_>],
        remotes: &[&GnRemote],
    ) -> Result<GpuHandle> {
        let link = self.nic()?.link(peer)?;
        let mut descs = Vec::with_capacity(entries.len());
        for (e, r) in entries.iter().zip(remotes) {
            descs.push(GpuDesc {
                local_addr: 0,
                remote_addr: 0,
                len: e.desc.len,
                local_mr: u32::MAX,
                remote_mr: r.nic.index(&link)?,
                local_off: 0,
                remote_off: e.desc.addr - e.region.desc.addr,
            });
        }
        let qp = link
            .proxy
            .export()
            .map_err(gpu_err("exporting the peer's proxy queue pair"))?;
        self.publish_view(DeviceQp::Proxy(qp), &descs, vec![link])
    }

    fn publish_view(
        &self,
        qp: DeviceQp,
        descs: &[GpuDesc],
        keep: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Result<GpuHandle> {
        let flags = SLOT_VIEW | qp.handle_flags();
        let view = ViewMem { qp, _keep: keep };
        self.handles
            .publish(view.qp.device_ptr(), descs, flags, Box::new(view))
    }
}

/// Fuzzing entry point (not a stable API): the decoders of what peers send `GPUNETIO`
/// on `input` — a sender's stream on the out-of-band notification channel, a NIC path's
/// connection information, the backend's whole connection information (with its
/// heartbeat hub), a remote memory descriptor (in metadata) and a direct-copy
/// request or answer (on a control connection, module `peer_dram`). Returns whether
/// what decoded encodes back to the bytes it was read from (decoding itself must never
/// panic).
#[doc(hidden)]
pub fn fuzz_oob_message(input: &[u8]) -> bool {
    let stream_ok = oob::fuzz_stream(input);
    let mut f = Fields::new(input, "connection info");
    let nic_ok = match nic::NicInfo::decode(&mut f).and_then(|info| f.finish().map(|()| info)) {
        Ok(info) => {
            let mut again = Vec::new();
            // A decoded address may print differently from how it was written (`::1`
            // for `0::1`): compare what the encoding decodes to.
            info.encode(&mut again).is_ok()
                && nic::NicInfo::decode(&mut Fields::new(&again, "connection info")).ok()
                    == Some(info)
        }
        Err(_) => true,
    };
    let desc_ok = match RemoteDescriptor::from_bytes(input) {
        Ok(desc) => desc.to_bytes()[..] == *input,
        Err(_) => true,
    };
    let peer_copy_ok = match crate::backends::peer_dram::decode(input) {
        Ok(crate::backends::peer_dram::Message::Request(r)) => r.encode() == input,
        Ok(crate::backends::peer_dram::Message::Done(d)) => d.encode() == input,
        Ok(crate::backends::peer_dram::Message::Lane(fd)) => {
            crate::backends::peer_dram::encode_lane(fd) == input
        }
        Ok(crate::backends::peer_dram::Message::Doorbell) => {
            crate::backends::peer_dram::encode_doorbell() == input
        }
        Err(_) => true,
    };
    let conn_ok = match parse_conn_info("fuzz", input) {
        // Unknown flag bits are not kept: compare what the encoding decodes to.
        Ok(info) => encode_conn_info(&info)
            .ok()
            .and_then(|again| parse_conn_info("fuzz", &again).ok().map(|p| p == info))
            .unwrap_or(false),
        Err(_) => true,
    };
    stream_ok && nic_ok && desc_ok && peer_copy_ok && conn_ok
}
