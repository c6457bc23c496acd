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
//! transport error) is a typed [`Error::Backend`] at `check`.
//!
//! Reach: peers on this node (same boot id), through the `IntraNode` handler — the
//! peer's VRAM is mapped here by CUDA IPC (the control plane, metadata and
//! notifications are `CUDA_IPC`'s) and a put is a vectorized copy by the kernel's warps;
//! local memory may be VRAM of the backend's GPU or DRAM (pinned and mapped on first
//! use). Peers on other nodes, and a peer's DRAM, need the NIC path (`CpuProxy` or
//! native mlx5 queue pairs of `gpunetio`), which this backend does not drive yet: they
//! are refused as unreachable or unsupported, never attempted.
//!
//! Parameters as upstream: `gpu_devices` (one CUDA ordinal, default 0: one GPU per
//! backend, as upstream), `cuda_streams` (the pool, default 4), `network_devices` and
//! `oob_interface` (accepted; recorded for the NIC path and reported by
//! [`GpunetioBackend::network_devices`]).

use super::cuda_copy::gpu_err;
use super::cuda_ipc::CudaIpcBackend;
use super::shared::param;
use crate::agent::Agent;
use crate::backend::{
    Backend, BackendParams, BackendXfer, Capabilities, LocalMd, PostParams, RemoteMd, ViewEntry,
    ViewMd, XferEntry, XferOp, XferProgress, XferStatus,
};
use crate::device::{self, GpuDesc, GpuHandle, HandleTable, SLOT_LOCAL, SLOT_REQUEST, SLOT_VIEW};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use gpunetio::cudarc::driver::{
    sys, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use gpunetio::intra_node::{ExportedQueuePair, IntraNodeQueuePair};
use gpunetio::{DeviceBuffer, Gpu, HostBuffer};
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The backend's name.
pub const NAME: &str = "GPUNETIO";

/// Device handles a backend can have live at once (requests and views).
const HANDLE_SLOTS: usize = 16_384;
/// Bounds every device-side wait of the queue pairs this backend builds.
const DEVICE_TIMEOUT: Duration = Duration::from_secs(10);
/// Threads per block of the transfer kernel (16 warps).
const THREADS: u32 = 512;
/// Smallest piece a warp copies: one round of its lanes' loads in flight (32 lanes x 4 x
/// 16 bytes). A warp has only that much in flight at once, so a transfer is cut into
/// enough pieces for every warp to need about one round: measured on the H100, 16 KiB
/// pieces left a 1 MiB transfer on 64 warps at 8 latency-bound rounds (half of
/// CUDA_IPC's bandwidth); 2 KiB pieces spread it over 512.
const MIN_CHUNK: u64 = 2 << 10;
/// No descriptor-level cap on a piece beyond this.
const MAX_CHUNK: u64 = 4 << 20;

/// The `GPUNETIO` backend.
#[derive(Debug)]
pub struct GpunetioBackend {
    ipc: CudaIpcBackend,
    gpu: Gpu,
    streams: Arc<StreamPool>,
    transfer: CudaFunction,
    handles: Arc<HandleTable>,
    sm_count: u32,
    network_devices: Vec<String>,
    oob_interface: Option<String>,
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

pub(crate) fn create(agent: &Agent, params: &BackendParams) -> Result<Arc<dyn Backend>> {
    const KNOWN: &[&str] = &[
        "gpu_devices",
        "cuda_streams",
        "network_devices",
        "oob_interface",
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
    let gpu_devices = params.get("gpu_devices").map(String::as_str).unwrap_or("0");
    let ordinals: Vec<&str> = gpu_devices
        .split([',', ' '])
        .filter(|s| !s.is_empty())
        .collect();
    let ordinal: usize = match ordinals.as_slice() {
        [one] => one.parse().map_err(|_| {
            Error::InvalidParam(format!(
                "{NAME} parameter gpu_devices={gpu_devices:?} is not a CUDA ordinal"
            ))
        })?,
        _ => {
            return Err(Error::InvalidParam(format!(
                "{NAME} drives one GPU per backend (as upstream): gpu_devices={gpu_devices:?}"
            )))
        }
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
    let ipc = CudaIpcBackend::new(agent, 1)?;
    let gpu = Gpu::open(ordinal).map_err(gpu_err("opening the backend's GPU"))?;
    if let Some(nic) = network_devices.first() {
        tracing::info!(
            "{NAME}: network device {nic} is recorded for peers on other nodes; peers on this node move through CUDA IPC mappings"
        );
    }
    let ctx = gpu.context();
    let streams = (0..cuda_streams)
        .map(|_| ctx.new_stream())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Gpu(format!("creating {NAME}'s streams: {e:?}")))?;
    let sm_count = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| Error::Gpu(format!("reading the SM count: {e:?}")))?
        .max(1) as u32;
    let options = device::compile_options(&gpu)?;
    let (name, source) = device::DEVICE_SOURCES[0];
    let ptx = gpunetio::device_code::compile(name, source, &options)
        .map_err(|e| Error::Gpu(format!("compiling {NAME}'s transfer kernel: {e}")))?;
    let module = ctx
        .load_module(ptx)
        .map_err(|e| Error::Gpu(format!("loading {NAME}'s transfer kernel: {e:?}")))?;
    let transfer = module
        .load_function("nixl_gpunetio_xfer")
        .map_err(|e| Error::Gpu(format!("nixl_gpunetio_xfer: {e:?}")))?;
    Ok(Arc::new(GpunetioBackend {
        ipc,
        handles: HandleTable::new(&gpu, HANDLE_SLOTS)?,
        gpu,
        streams: Arc::new(StreamPool {
            streams,
            next: AtomicUsize::new(0),
        }),
        transfer,
        sm_count,
        network_devices,
        oob_interface: params.get("oob_interface").cloned(),
    }))
}

impl GpunetioBackend {
    /// The GPU this backend drives.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The NIC named by `network_devices` (used for peers on other nodes).
    pub fn network_devices(&self) -> &[String] {
        &self.network_devices
    }

    /// The interface named by `oob_interface`.
    pub fn oob_interface(&self) -> Option<&str> {
        self.oob_interface.as_deref()
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
                "{NAME} drives GPU {} (gpu_devices); this VRAM is on GPU {dev_id}",
                self.gpu.ordinal()
            )));
        }
        Ok(())
    }

    /// Grid and piece size for moving `total` bytes in descriptors of which the largest
    /// has `largest` bytes: enough warps to keep every SM busy, pieces of at least
    /// `MIN_CHUNK`.
    fn plan(&self, total: u64, largest: u64) -> (u32, u64) {
        let warps_per_block = u64::from(THREADS / 32);
        // Four blocks of 16 warps fill an SM (2,048 threads): the most loads in flight.
        let max_blocks = u64::from(self.sm_count) * 4;
        let pieces_wanted = (total / MIN_CHUNK).max(1);
        let blocks = pieces_wanted.div_ceil(warps_per_block).clamp(1, max_blocks);
        let warps = blocks * warps_per_block;
        let chunk = total
            .div_ceil(warps)
            .next_multiple_of(MIN_CHUNK)
            .clamp(MIN_CHUNK, MAX_CHUNK)
            .min(largest.next_multiple_of(16).max(16));
        (blocks as u32, chunk)
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
        &[MemKind::Vram]
    }
    fn reach(&self, agent: &str) -> Result<()> {
        self.ipc.reach(agent).map_err(|e| match e {
            Error::Unreachable { agent, reason, .. } => Error::Unreachable {
                backend: NAME.into(),
                agent,
                reason: format!("{reason} (the NIC path to other nodes is not driven yet)"),
            },
            other => other,
        })
    }
    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        self.check_local_gpu(region.kind, region.desc.dev_id)?;
        self.ipc.register_mem(region)
    }
    fn connection_info(&self) -> Result<Vec<u8>> {
        self.ipc.connection_info()
    }
    fn load_remote_conn_info(&self, agent: &str, info: &[u8]) -> Result<()> {
        self.ipc.load_remote_conn_info(agent, info)
    }
    fn load_remote_md(
        &self,
        agent: &str,
        region: &Region,
        public_md: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        self.ipc.load_remote_md(agent, region, public_md)
    }
    fn disconnect(&self, agent: &str) {
        self.ipc.disconnect(agent)
    }
    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        for e in entries {
            self.check_local_gpu(e.local_region.kind, e.local.dev_id)?;
        }
        if entries.len() > gpunetio::intra_node::MAX_REGIONS / 2 {
            return Err(Error::InvalidParam(format!(
                "{NAME} moves at most {} descriptors per request",
                gpunetio::intra_node::MAX_REGIONS / 2
            )));
        }
        let resolved = self.ipc.resolve(entries, agent)?;
        let ranges: Vec<(u64, u64, bool)> = resolved
            .pairs
            .iter()
            .flat_map(|p| [(p.local, p.len, false), (p.remote, p.len, true)])
            .collect();
        let qp = self.queue_pair(&ranges)?;
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
            })
            .collect();
        let total: u64 = descs.iter().map(|d| d.len).sum();
        let largest = descs.iter().map(|d| d.len).max().unwrap_or(0);
        let (blocks, chunk) = self.plan(total, largest);
        let table = self.upload(&descs)?;
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
        Ok(Box::new(KernelXfer {
            gpu: self.gpu.clone(),
            function: self.transfer.clone(),
            pool: self.streams.clone(),
            handles: self.handles.clone(),
            mem: Arc::new(RequestMem {
                qp,
                table,
                count: descs.len() as u32,
                _keep: resolved.keep,
            }),
            read: op == XferOp::Read,
            blocks,
            chunk,
            status,
            status_ptr,
            event,
            in_flight: false,
            pending_notif: None,
            sink: resolved.sink,
        }))
    }
    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        self.ipc.gen_notif(agent, msg)
    }
    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.ipc.take_notifs(into)
    }
    fn prep_mem_view(&self, agent: Option<&str>, entries: &[ViewEntry<'_>]) -> Result<GpuHandle> {
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
                    self.check_local_gpu(e.region.kind, e.desc.dev_id)?;
                    if e.region.kind == MemKind::Dram && !CudaIpcBackend::pin_local_dram(md) {
                        return Err(Error::InvalidParam(format!(
                            "{NAME}: not a {NAME} registration"
                        )));
                    }
                    descs.push(GpuDesc {
                        local_addr: e.desc.addr,
                        remote_addr: 0,
                        len: e.desc.len,
                        local_mr: u32::MAX,
                        remote_mr: u32::MAX,
                    });
                }
                // A local view's elements are sources: kernels read them through their
                // addresses, so it needs no queue pair of its own.
                let table = self.upload(&descs)?;
                let ptr = table.ptr();
                self.handles.publish(
                    0,
                    ptr,
                    descs.len() as u32,
                    SLOT_VIEW | SLOT_LOCAL,
                    Box::new(table),
                )
            }
            Some(peer) => {
                let ranges = entries
                    .iter()
                    .map(|e| match e.md {
                        ViewMd::Remote(md) => Ok((e.desc, md)),
                        ViewMd::Local(_) => Err(Error::InvalidParam(
                            "a remote view of a local region".into(),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let (addrs, keep) = self.ipc.map_remote(peer, &ranges, self.gpu.ordinal())?;
                let spans: Vec<(u64, u64, bool)> = addrs
                    .iter()
                    .zip(entries)
                    .map(|(&a, e)| (a, e.desc.len, true))
                    .collect();
                let qp = self.queue_pair(&spans)?;
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
                    })
                    .collect();
                let table = self.upload(&descs)?;
                let mem = RequestMem {
                    count: descs.len() as u32,
                    table,
                    qp,
                    _keep: keep,
                };
                self.handles.publish(
                    mem.qp.device_ptr(),
                    mem.table.ptr(),
                    mem.count,
                    SLOT_VIEW,
                    Box::new(mem),
                )
            }
        }
    }
}

/// What a request's kernels read: the queue pair, the descriptor table, and what keeps
/// the peer's memory mapped. Shared by the request and its GPU handle.
#[derive(Debug)]
struct RequestMem {
    qp: ExportedQueuePair,
    table: DeviceBuffer,
    count: u32,
    /// Dropped after the queue pair (declared after it).
    _keep: Vec<Arc<dyn Any + Send + Sync>>,
}

/// A prepared transfer: one kernel launch per post.
#[derive(Debug)]
struct KernelXfer {
    gpu: Gpu,
    function: CudaFunction,
    pool: Arc<StreamPool>,
    handles: Arc<HandleTable>,
    mem: Arc<RequestMem>,
    read: bool,
    blocks: u32,
    chunk: u64,
    /// Host-mapped word the kernel writes its first failure to.
    status: HostBuffer,
    status_ptr: u64,
    event: CudaEvent,
    in_flight: bool,
    pending_notif: Option<Vec<u8>>,
    sink: Arc<dyn super::cuda_copy::NotifSink>,
}

impl KernelXfer {
    fn kernel_status(&self) -> i32 {
        // SAFETY: the buffer holds at least 4 bytes, is aligned, and the kernel that
        // wrote it completed (its event did).
        unsafe { std::ptr::read_volatile(self.status.as_ptr().cast::<i32>()) }
    }
}

impl BackendXfer for KernelXfer {
    fn post(&mut self, notif: Option<&[u8]>, params: &PostParams) -> Result<XferStatus> {
        self.sink.alive()?;
        let attached = match params.custom.as_ref() {
            None => None,
            Some(c) => Some(c.downcast_ref::<Arc<CudaStream>>().ok_or_else(|| {
                Error::InvalidParam(format!(
                    "{NAME}: a post's custom parameter must be an Arc<CudaStream> (the stream to attach to)"
                ))
            })?),
        };
        let stream = match attached {
            Some(s) if s.context().ordinal() != self.gpu.ordinal() => {
                return Err(Error::InvalidParam(format!(
                    "{NAME}: the post's stream is on GPU {}, the backend's GPU is {}",
                    s.context().ordinal(),
                    self.gpu.ordinal()
                )))
            }
            Some(s) => s.clone(),
            None => self.pool.next(),
        };
        // SAFETY: the word is ours and no kernel of this request is running (a post
        // while in flight is refused by the agent).
        unsafe { std::ptr::write_volatile(self.status.as_ptr().cast_mut().cast::<i32>(), 0) };
        let cfg = LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let qp = self.mem.qp.device_ptr();
        let table = self.mem.table.ptr();
        let count = self.mem.count;
        let read = u32::from(self.read);
        let mut launch = stream.launch_builder(&self.function);
        launch
            .arg(&qp)
            .arg(&table)
            .arg(&count)
            .arg(&read)
            .arg(&self.chunk)
            .arg(&self.status_ptr);
        // SAFETY: the kernel's signature is (gio_dev_qp*, const nixl_gpu_desc*, unsigned,
        // unsigned, unsigned long long, int*), matching the arguments; every address it
        // touches is in the queue pair's table, kept alive by `mem` until the event
        // after it completed (see Drop).
        unsafe { launch.launch(cfg) }
            .map_err(|e| Error::Gpu(format!("launching the transfer kernel: {e:?}")))?;
        self.event
            .record(&stream)
            .map_err(|e| Error::Gpu(format!("cuEventRecord: {e:?}")))?;
        self.in_flight = true;
        self.pending_notif = notif.map(<[u8]>::to_vec);
        Ok(XferStatus::InProgress)
    }

    fn check(&mut self) -> Result<XferProgress> {
        if self.in_flight {
            let done = self
                .event
                .try_is_complete()
                .map_err(|e| Error::Gpu(format!("the transfer kernel failed: {e:?}")))?;
            if !done {
                self.sink.alive()?;
                return Ok(XferProgress {
                    status: XferStatus::InProgress,
                    completed_ops: 0,
                });
            }
            self.in_flight = false;
            let st = self.kernel_status();
            if st != 0 {
                self.pending_notif = None;
                return Err(Error::Backend {
                    backend: NAME.into(),
                    code: st,
                    message: format!(
                        "the transfer kernel failed with gpunetio status {st} ({})",
                        gio_status_name(st)
                    ),
                });
            }
        }
        if let Some(msg) = self.pending_notif.take() {
            self.sink.deliver(msg)?;
        }
        Ok(XferProgress {
            status: XferStatus::Done,
            completed_ops: u64::from(self.mem.count),
        })
    }

    fn op_count(&self) -> usize {
        self.mem.count as usize
    }

    fn gpu_xfer_req(&mut self) -> Result<GpuHandle> {
        self.handles.publish(
            self.mem.qp.device_ptr(),
            self.mem.table.ptr(),
            self.mem.count,
            SLOT_REQUEST,
            Box::new(self.mem.clone()),
        )
    }
}

impl Drop for KernelXfer {
    fn drop(&mut self) {
        // A kernel cannot be recalled: wait for it, so that the memory it touches
        // outlives it.
        if self.in_flight {
            if let Err(e) = self.event.synchronize() {
                tracing::warn!("waiting for a released {NAME} transfer: {e:?}");
            }
        }
    }
}

/// The name of a gpunetio device status.
fn gio_status_name(st: i32) -> &'static str {
    use gpunetio::ffi;
    match st {
        ffi::GIO_ERR_BOUNDS => "out of bounds",
        ffi::GIO_ERR_BAD_ENTRY => "bad entry",
        ffi::GIO_ERR_TIMEOUT => "timed out",
        ffi::GIO_ERR_PEER_GONE => "peer gone",
        ffi::GIO_ERR_TRANSPORT => "transport error",
        ffi::GIO_ERR_SHUTDOWN => "shut down",
        ffi::GIO_ERR_MIXED_LEVELS => "high- and low-level calls mixed",
        ffi::GIO_ERR_CQE => "error completion",
        _ => "unknown",
    }
}
