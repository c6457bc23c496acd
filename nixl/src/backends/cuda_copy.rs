//! What the GPU backends (`LOCAL` with VRAM, `CUDA_IPC`) share: per-GPU pools of the
//! backend's own streams, host pinning of DRAM registrations, and prepared batches of
//! copies whose completion is polled through events.
//!
//! A prepared batch runs one of three ways ([`CopyEngine`], backend parameter
//! `copy_engine=auto|kernel|memcpy|batch`):
//! - `memcpy`: one `cuMemcpyAsync` per descriptor, spread over the backend's streams. The
//!   copy engines: best for a few large blocks, and for host memory over PCIe.
//! - `kernel`: one launch of the gather/scatter kernel (`nixl/device/nixl_copy_batch.cu`)
//!   over a table of (src, dst, len) work items built and uploaded once when the transfer
//!   is prepared, kept on the GPU and reposted without another upload. A transfer of
//!   thousands of small descriptors costs one launch instead of thousands of copy calls.
//!   Compiled with NVRTC once per GPU and process; without NVRTC the batch falls back to
//!   `memcpy` (warned once).
//! - `batch`: the driver's batched copy, `cuMemcpyBatchAsync` (CUDA 13 driver), one call
//!   per post; falls back to `memcpy` (warned once) where the driver lacks it.
//!
//! `auto` (the default) takes the kernel for many small device-to-device copies
//! ([`KERNEL_MIN_COPIES`], [`KERNEL_MAX_MEAN_BYTES`]) and `memcpy` for the rest.

use crate::error::{Error, Result};
use gpu_mem::cudarc::driver::sys;
use gpu_mem::cudarc::driver::{CudaEvent, CudaStream};
use gpu_mem::cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use gpu_mem::DeviceBuffer;
use gpu_mem::{Gpu, HostRegistration};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Turns a GPU-layer error (`gpu-mem`'s, or `gpunetio`'s for GPUNETIO) into the agent's.
pub(crate) fn gpu_err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> Error + '_ {
    move |e| Error::Gpu(format!("{what}: {e}"))
}

/// Streams of one GPU, handed out round-robin so concurrent requests overlap.
#[derive(Debug)]
pub(crate) struct GpuStreams {
    pub(crate) gpu: Gpu,
    streams: Vec<Arc<CudaStream>>,
    next: AtomicUsize,
    /// Device memory for kernel work tables, reused by later batches (a `cuMemFree` per
    /// transfer would synchronize the device).
    tables: Mutex<Vec<DeviceBuffer>>,
    /// Pinned staging slots of staged batches reading from this GPU, reused by later
    /// batches (`cuMemHostAlloc` costs far more than a request's preparation should).
    stage_slots: Mutex<Vec<gpu_mem::HostBuffer>>,
    /// Pinned buffers the kernel's work tables are written into and uploaded from: an
    /// upload from pageable memory waits for the stream's earlier work (the previous
    /// request's kernel) and copies through the driver's staging first.
    uploads: Mutex<Vec<gpu_mem::HostBuffer>>,
    /// Completion events of finished batches, reused by later ones (a request's
    /// `cuEventCreate` and `cuEventDestroy` are on its latency path).
    events: Mutex<Vec<CudaEvent>>,
}

/// Spare completion events kept per GPU; more are destroyed.
const SPARE_EVENTS: usize = 64;

/// Staging slots kept for reuse per GPU; more are freed.
const SPARE_STAGE_SLOTS: usize = 16;

/// Work tables kept for reuse per GPU; more are freed.
const SPARE_TABLES: usize = 16;
/// Smallest work table allocated (bytes), so that small transfers share buffers.
const MIN_TABLE_BYTES: usize = 64 << 10;

impl GpuStreams {
    fn next_stream(&self) -> Arc<CudaStream> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        self.streams[i].clone()
    }

    /// A device buffer of at least `bytes` for a work table: a spare one, or a new one.
    fn take_table(&self, bytes: usize) -> Result<DeviceBuffer> {
        if let Some(table) = take_spare(&self.tables, bytes, DeviceBuffer::len) {
            return Ok(table);
        }
        DeviceBuffer::alloc(&self.gpu, bytes.max(MIN_TABLE_BYTES).next_power_of_two())
            .map_err(gpu_err("allocating a copy table"))
    }

    /// Gives a table back once no kernel reads it any more.
    fn give_table(&self, table: DeviceBuffer) {
        give_spare(&self.tables, table, SPARE_TABLES);
    }

    /// A pinned buffer of at least `bytes` to upload a work table from.
    fn take_upload(&self, bytes: usize) -> Result<gpu_mem::HostBuffer> {
        if let Some(upload) = take_spare(&self.uploads, bytes, gpu_mem::HostBuffer::len) {
            return Ok(upload);
        }
        gpu_mem::HostBuffer::alloc(&self.gpu, bytes.max(MIN_TABLE_BYTES).next_power_of_two())
            .map_err(gpu_err("allocating a pinned upload buffer"))
    }

    /// A completion event: a spare one, or a new one.
    fn take_event(&self) -> Result<CudaEvent> {
        if let Some(event) = self.events.lock().pop() {
            return Ok(event);
        }
        self.gpu
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| Error::Gpu(format!("cuEventCreate: {e:?}")))
    }

    /// Gives an event back once nothing waits for it or records it any more.
    fn give_event(&self, event: CudaEvent) {
        give_spare(&self.events, event, SPARE_EVENTS);
    }

    /// Gives an upload buffer back once its upload completed.
    fn give_upload(&self, upload: gpu_mem::HostBuffer) {
        give_spare(&self.uploads, upload, SPARE_TABLES);
    }

    /// A pinned staging slot of at least `bytes`: a spare one, or a new one of at least
    /// [`STAGE_CHUNK_BYTES`].
    fn take_stage_slot(&self, bytes: usize) -> Result<gpu_mem::HostBuffer> {
        {
            let mut spare = self.stage_slots.lock();
            if let Some(i) = spare.iter().position(|b| b.len() >= bytes) {
                return Ok(spare.swap_remove(i));
            }
        }
        gpu_mem::HostBuffer::alloc(&self.gpu, bytes.max(STAGE_CHUNK_BYTES))
            .map_err(gpu_err("allocating a pinned staging slot"))
    }

    /// Gives a slot back once no copy uses it any more.
    fn give_stage_slot(&self, slot: gpu_mem::HostBuffer) {
        give_spare(&self.stage_slots, slot, SPARE_STAGE_SLOTS);
    }

    /// Whether a kernel on this GPU can read and write memory at `loc`: its own VRAM, or
    /// pinned host memory. Another GPU's memory is left to the copy engines: an IPC
    /// mapping opened in that GPU's context faulted in a kernel here even with peer
    /// access enabled and the driver's access flags saying read-write (two H200s over
    /// NVLink); a mapping opened in this GPU's own context would be reachable.
    fn kernel_reaches(&self, loc: MemLoc) -> bool {
        match loc {
            MemLoc::Host { pinned } => pinned,
            MemLoc::Gpu(g) => g == self.gpu.ordinal(),
        }
    }
}

/// The smallest of `spare`'s buffers that holds `bytes` (`len` gives a buffer's size),
/// taken out for use.
fn take_spare<B>(spare: &Mutex<Vec<B>>, bytes: usize, len: impl Fn(&B) -> usize) -> Option<B> {
    let mut spare = spare.lock();
    let i = spare
        .iter()
        .enumerate()
        .filter(|(_, b)| len(b) >= bytes)
        .min_by_key(|(_, b)| len(b))
        .map(|(i, _)| i)?;
    Some(spare.swap_remove(i))
}

/// Keeps `buf` in `spare` for a later use, while fewer than `keep` are kept.
fn give_spare<B>(spare: &Mutex<Vec<B>>, buf: B, keep: usize) {
    let mut spare = spare.lock();
    if spare.len() < keep {
        spare.push(buf);
    }
}

/// The backend's streams, created per GPU on first use.
#[derive(Debug)]
pub(crate) struct StreamPools {
    per_gpu: Mutex<HashMap<usize, Arc<GpuStreams>>>,
    streams_per_gpu: usize,
}

impl StreamPools {
    pub(crate) fn new(streams_per_gpu: usize) -> Self {
        Self {
            per_gpu: Mutex::default(),
            streams_per_gpu: streams_per_gpu.max(1),
        }
    }

    /// GPU `ordinal`'s pool.
    pub(crate) fn get(&self, ordinal: usize) -> Result<Arc<GpuStreams>> {
        let mut pools = self.per_gpu.lock();
        if let Some(p) = pools.get(&ordinal) {
            return Ok(p.clone());
        }
        let gpu = Gpu::open(ordinal).map_err(gpu_err("opening the GPU"))?;
        let streams = (0..self.streams_per_gpu)
            .map(|_| gpu.new_stream())
            .collect::<gpu_mem::Result<Vec<_>>>()
            .map_err(gpu_err("creating streams"))?;
        let pool = Arc::new(GpuStreams {
            gpu,
            streams,
            next: AtomicUsize::new(0),
            tables: Mutex::default(),
            stage_slots: Mutex::default(),
            uploads: Mutex::default(),
            events: Mutex::default(),
        });
        pools.insert(ordinal, pool.clone());
        Ok(pool)
    }
}

/// Pins a DRAM registration so that copies between it and VRAM run at pinned speed (a
/// pageable copy is staged by the driver, at a fraction of it: `docs/BENCHMARKS.md`). Best
/// effort: without a GPU, or if the driver refuses, copies still work, only slower.
pub(crate) fn pin_host(addr: u64, len: u64) -> Option<HostRegistration> {
    if gpu_mem::device_count() == 0 {
        return None;
    }
    let gpu = Gpu::open(0).ok()?;
    // SAFETY: `Agent::register_mem`'s contract keeps the range valid until the
    // registration (which owns this pin) is dropped.
    match unsafe { HostRegistration::register(&gpu, addr as *mut u8, len as usize) } {
        Ok(reg) => Some(reg),
        Err(e) => {
            tracing::debug!("DRAM {addr:#x}+{len} stays pageable: {e}");
            None
        }
    }
}

/// A DRAM registration pinned on its first GPU transfer: registering DRAM that never
/// meets a GPU stays as cheap as without feature `cuda`.
#[derive(Debug)]
pub(crate) struct LazyPin {
    addr: u64,
    len: u64,
    pin: std::sync::OnceLock<Option<HostRegistration>>,
}

impl LazyPin {
    pub(crate) fn new(addr: u64, len: u64) -> Self {
        Self {
            addr,
            len,
            pin: std::sync::OnceLock::new(),
        }
    }

    /// Pins the range now if it is not yet (once; a refusal is remembered); whether it is
    /// pinned (and so reachable by kernels at the same address).
    pub(crate) fn ensure(&self) -> bool {
        self.pin
            .get_or_init(|| pin_host(self.addr, self.len))
            .is_some()
    }
}

/// A small device buffer on GPU 0, to probe whether a transport registers device
/// memory; `None` without a driver or a GPU.
pub(crate) fn probe_buffer(len: usize) -> Option<gpu_mem::DeviceBuffer> {
    if !gpu_mem::is_available() || gpu_mem::device_count() == 0 {
        return None;
    }
    let gpu = Gpu::open(0).ok()?;
    gpu_mem::DeviceBuffer::alloc(&gpu, len).ok()
}

/// Where one side of a copy lives, as far as a kernel on the copying GPU is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemLoc {
    /// VRAM of GPU `0` (for an IPC mapping: the GPU whose context maps it).
    Gpu(usize),
    /// Host memory; `pinned`: registered with the driver (portable and mapped), so a
    /// kernel reaches it at the same address.
    Host { pinned: bool },
}

/// One copy: `len` bytes from `src` to `dst` (device or host addresses, unified).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Copy {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: usize,
    pub(crate) dst_loc: MemLoc,
    pub(crate) src_loc: MemLoc,
}

/// How a backend runs its prepared batches: backend parameter `copy_engine`
/// (`auto|kernel|memcpy|batch`, default `auto`; see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum CopyEngine {
    /// The kernel for many small device-to-device copies, `cuMemcpyAsync` otherwise.
    #[default]
    Auto,
    /// The gather/scatter kernel wherever it reaches both sides.
    Kernel,
    /// One `cuMemcpyAsync` per copy.
    Memcpy,
    /// The driver's `cuMemcpyBatchAsync`.
    Batch,
}

impl CopyEngine {
    /// The backend parameter that selects it.
    pub(crate) const PARAM: &'static str = "copy_engine";
}

impl std::str::FromStr for CopyEngine {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "kernel" => Ok(Self::Kernel),
            "memcpy" => Ok(Self::Memcpy),
            "batch" => Ok(Self::Batch),
            other => Err(Error::InvalidParam(format!(
                "copy_engine=`{other}`: expected auto, kernel, memcpy or batch"
            ))),
        }
    }
}

/// `auto` takes the kernel from this many copies in a batch on (fewer are as fast with
/// the copy engines, which need no table).
pub(crate) const KERNEL_MIN_COPIES: usize = 8;
/// ... and only while the copies are this small on average (larger ones keep the copy
/// engines busy enough on their own).
pub(crate) const KERNEL_MAX_MEAN_BYTES: usize = 1 << 20;
/// Largest kernel work item: a larger copy is split so that one huge descriptor still
/// spreads over every SM.
pub(crate) const KERNEL_CHUNK_BYTES: usize = 64 << 10;
/// Threads per block of the copy kernel.
const KERNEL_THREADS: u32 = 256;
/// The kernel's source.
const KERNEL_SOURCE: (&str, &str) = (
    "nixl_copy_batch.cu",
    include_str!("../../device/nixl_copy_batch.cu"),
);

/// How one batch runs, decided when it is prepared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    Memcpy,
    Kernel,
    Batch,
}

/// The strategy `engine` asks for, given the copies and whether a kernel on the copying
/// GPU reaches an address at a location (before checking that the kernel or the driver
/// call exists).
fn wanted(
    engine: CopyEngine,
    copies: &[Copy],
    mut reaches: impl FnMut(MemLoc, u64) -> bool,
) -> Strategy {
    let mut kernel_reaches_all = || {
        copies
            .iter()
            .all(|c| reaches(c.src_loc, c.src) && reaches(c.dst_loc, c.dst))
    };
    match engine {
        CopyEngine::Memcpy => Strategy::Memcpy,
        CopyEngine::Batch => Strategy::Batch,
        CopyEngine::Kernel if kernel_reaches_all() => Strategy::Kernel,
        CopyEngine::Kernel => {
            warn_once(
                &UNREACHABLE_WARNED,
                "copy_engine=kernel: a copy touches memory the copying GPU cannot \
                 dereference (pageable host memory, or another GPU's memory): such \
                 batches use cuMemcpyAsync",
            );
            Strategy::Memcpy
        }
        CopyEngine::Auto => {
            let n = copies.len();
            let total: usize = copies.iter().map(|c| c.len).sum();
            let device_only = copies.iter().all(|c| {
                matches!(c.src_loc, MemLoc::Gpu(_)) && matches!(c.dst_loc, MemLoc::Gpu(_))
            });
            if n >= KERNEL_MIN_COPIES
                && total / n <= KERNEL_MAX_MEAN_BYTES
                && device_only
                && kernel_reaches_all()
            {
                Strategy::Kernel
            } else {
                Strategy::Memcpy
            }
        }
    }
}

static UNREACHABLE_WARNED: AtomicBool = AtomicBool::new(false);
static NO_KERNEL_WARNED: AtomicBool = AtomicBool::new(false);
static NO_BATCH_WARNED: AtomicBool = AtomicBool::new(false);

fn warn_once(flag: &AtomicBool, msg: &str) {
    if !flag.swap(true, Ordering::Relaxed) {
        tracing::warn!("{msg}");
    }
}

/// One work item of the kernel: `nixl_copy_item` in `nixl_copy_batch.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CopyItem {
    src: u64,
    dst: u64,
    len: u64,
}

const _: () = assert!(std::mem::size_of::<CopyItem>() == 24);
const _: () = assert!(std::mem::offset_of!(CopyItem, len) == 16);

/// Work items the kernel's table holds for `copies` (see [`write_work_items`]).
fn work_item_count(copies: &[Copy], chunk: usize) -> usize {
    let chunk = chunk.max(1);
    copies.iter().map(|c| c.len.div_ceil(chunk)).sum()
}

/// Writes the kernel's work table into `out` (exactly [`work_item_count`] items): each
/// copy, split into items of at most `chunk` bytes (cut at multiples of `chunk` from its
/// start, so every item keeps the copy's relative alignment of source and destination);
/// empty copies leave nothing.
fn write_work_items(copies: &[Copy], chunk: usize, out: &mut [CopyItem]) {
    let chunk = chunk.max(1) as u64;
    let mut slots = out.iter_mut();
    for c in copies {
        let len = c.len as u64;
        let mut at = 0;
        while at < len {
            let n = chunk.min(len - at);
            if let Some(slot) = slots.next() {
                *slot = CopyItem {
                    src: c.src + at,
                    dst: c.dst + at,
                    len: n,
                };
            }
            at += n;
        }
    }
}

/// The kernel's work table as a vector (see [`write_work_items`]).
#[cfg(test)]
fn work_items(copies: &[Copy], chunk: usize) -> Vec<CopyItem> {
    let mut items = vec![
        CopyItem {
            src: 0,
            dst: 0,
            len: 0
        };
        work_item_count(copies, chunk)
    ];
    write_work_items(copies, chunk, &mut items);
    items
}

/// The copy kernel loaded on one GPU.
#[derive(Debug)]
struct CopyKernel {
    function: CudaFunction,
    /// `nixl_copy_gather`: a request over lists prepared once.
    gather: CudaFunction,
    _module: Arc<CudaModule>,
    /// Blocks that run at once on the whole GPU (the grid never needs more).
    max_blocks: u32,
}

/// The kernel per GPU ordinal, compiled once per process (`None`: it cannot be).
static KERNELS: Mutex<Vec<(usize, Option<Arc<CopyKernel>>)>> = parking_lot::const_mutex(Vec::new());

/// The copy kernel of `gpu`, compiled and loaded on first use; `None` (warned once)
/// where NVRTC or the compile fails.
fn copy_kernel(gpu: &Gpu) -> Option<Arc<CopyKernel>> {
    let mut kernels = KERNELS.lock();
    if let Some((_, k)) = kernels.iter().find(|(o, _)| *o == gpu.ordinal()) {
        return k.clone();
    }
    let kernel = match load_copy_kernel(gpu) {
        Ok(k) => Some(Arc::new(k)),
        Err(e) => {
            warn_once(
                &NO_KERNEL_WARNED,
                &format!("the batched copy kernel is unavailable, copies use cuMemcpyAsync: {e}"),
            );
            None
        }
    };
    kernels.push((gpu.ordinal(), kernel.clone()));
    kernel
}

fn load_copy_kernel(gpu: &Gpu) -> Result<CopyKernel> {
    let options = gpu_mem::device_code::CompileOptions::for_gpu(gpu)
        .map_err(gpu_err("reading the compute capability"))?;
    let ptx = gpu_mem::device_code::compile(KERNEL_SOURCE.0, KERNEL_SOURCE.1, &options)
        .map_err(gpu_err("compiling the copy kernel"))?;
    let ctx = gpu.context();
    let module = ctx
        .load_module(ptx)
        .map_err(|e| Error::Gpu(format!("loading the copy kernel: {e:?}")))?;
    let function = module
        .load_function("nixl_copy_batch")
        .map_err(|e| Error::Gpu(format!("nixl_copy_batch: {e:?}")))?;
    let gather = module
        .load_function("nixl_copy_gather")
        .map_err(|e| Error::Gpu(format!("nixl_copy_gather: {e:?}")))?;
    let sm_count = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| Error::Gpu(format!("reading the SM count: {e:?}")))?
        .max(1) as u32;
    let per_sm = function
        .occupancy_max_active_blocks_per_multiprocessor(KERNEL_THREADS, 0, None)
        .map_err(|e| Error::Gpu(format!("the copy kernel's occupancy: {e:?}")))?
        .clamp(1, 8);
    tracing::debug!(
        "copy kernel on GPU {}: {per_sm} blocks per SM, {sm_count} SMs",
        gpu.ordinal()
    );
    Ok(CopyKernel {
        function,
        gather,
        _module: module,
        max_blocks: sm_count * per_sm,
    })
}

/// Whether the driver has `cuMemcpyBatchAsync` in the form cudarc binds (CUDA 13's
/// `_v2`); asked once.
fn batch_copy_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        gpu_mem::is_available()
            // SAFETY: looks a symbol up in the loaded driver library, calls nothing.
            && unsafe {
                sys::culib()
                    .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2")
                    .is_ok()
            }
    })
}

#[derive(Debug)]
struct Lane {
    stream: Arc<CudaStream>,
    copies: Range<usize>,
    event: CudaEvent,
    done: bool,
}

impl Lane {
    /// A lane of `pool`'s next stream for `copies`, with its completion event.
    fn new(pool: &GpuStreams, copies: Range<usize>) -> Result<Self> {
        let event = pool.take_event()?;
        Ok(Self {
            stream: pool.next_stream(),
            copies,
            event,
            done: true,
        })
    }
}

/// One pair of a gather request: `nixl_gather_pair` in `nixl_copy_batch.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GatherPair {
    src: u32,
    dst: u32,
}

const _: () = assert!(std::mem::size_of::<GatherPair>() == 8);

/// A table of 64-bit values (addresses or lengths of a prepared list) kept on one GPU
/// for the gather kernel.
#[derive(Debug)]
pub(crate) struct DeviceTable {
    buf: DeviceBuffer,
}

impl DeviceTable {
    /// Uploads `values` to `pool`'s GPU (synchronously: a list is prepared once).
    pub(crate) fn new(pool: &GpuStreams, values: &[u64]) -> Result<Self> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let buf = DeviceBuffer::alloc(&pool.gpu, bytes.len().max(8))
            .map_err(gpu_err("allocating a list's device table"))?;
        buf.copy_from_host(0, &bytes)
            .map_err(gpu_err("uploading a list's device table"))?;
        Ok(Self { buf })
    }

    fn ptr(&self) -> u64 {
        self.buf.ptr()
    }
}

/// The tables a gather request reads: source and destination addresses, and the
/// lengths (of the initiator's list: the destination's for a READ, `lens_by_dst`).
#[derive(Debug, Clone)]
pub(crate) struct GatherLists {
    pub(crate) src: Arc<DeviceTable>,
    pub(crate) dst: Arc<DeviceTable>,
    pub(crate) lens: Arc<DeviceTable>,
    pub(crate) lens_by_dst: bool,
}

/// What a post issues.
#[derive(Debug)]
enum Run {
    /// One `cuMemcpyAsync` per copy, each lane its range of `copies`.
    Memcpy(Vec<Copy>),
    /// One kernel launch over `items` work items uploaded into `table` at prep time.
    Kernel {
        kernel: Arc<CopyKernel>,
        /// Always `Some` until dropped (then given back to the pool).
        table: Option<DeviceBuffer>,
        /// The pinned buffer the table was uploaded from (`None`: an empty table).
        upload: Option<gpu_mem::HostBuffer>,
        items: u64,
        grid: u32,
    },
    /// One launch of the gather kernel over lists prepared once: the request's pairs of
    /// positions uploaded into `table`.
    Gather {
        kernel: Arc<CopyKernel>,
        /// Always `Some` until dropped (then given back to the pool).
        table: Option<DeviceBuffer>,
        upload: Option<gpu_mem::HostBuffer>,
        pairs: u64,
        grid: u32,
        src: Arc<DeviceTable>,
        dst: Arc<DeviceTable>,
        lens: Arc<DeviceTable>,
        lens_by_dst: bool,
    },
    /// One `cuMemcpyBatchAsync` over these arrays (non-empty copies only).
    Batch {
        dsts: Vec<u64>,
        srcs: Vec<u64>,
        sizes: Vec<usize>,
        attrs: sys::CUmemcpyAttributes,
    },
}

/// A prepared batch of copies on one GPU's streams, posted any number of times (one at a
/// time): `cuMemcpyAsync`s spread over several streams in contiguous runs, one kernel
/// launch over a table already on the GPU, or one batched driver call.
#[derive(Debug)]
pub(crate) struct CopyBatch {
    pool: Arc<GpuStreams>,
    count: usize,
    run: Run,
    lanes: Vec<Lane>,
    in_flight: bool,
}

impl CopyBatch {
    /// Prepares `copies` on `pool`'s GPU as `engine` says; `max_lanes` bounds how many
    /// streams one post of `cuMemcpyAsync`s uses.
    pub(crate) fn new(
        pool: Arc<GpuStreams>,
        copies: Vec<Copy>,
        max_lanes: usize,
        engine: CopyEngine,
    ) -> Result<Self> {
        let n = copies.len();
        let strategy = match wanted(engine, &copies, |loc, _| pool.kernel_reaches(loc)) {
            Strategy::Batch if !batch_copy_available() => {
                warn_once(
                    &NO_BATCH_WARNED,
                    "copy_engine=batch: the driver has no cuMemcpyBatchAsync_v2 (CUDA 13), \
                     copies use cuMemcpyAsync",
                );
                Strategy::Memcpy
            }
            s => s,
        };
        let kernel = match strategy {
            Strategy::Kernel => copy_kernel(&pool.gpu),
            _ => None,
        };
        let lanes_wanted = match (strategy, &kernel) {
            (Strategy::Batch, _) | (Strategy::Kernel, Some(_)) => 1,
            _ => max_lanes.clamp(1, pool.streams.len()).min(n.max(1)),
        };
        let lanes = (0..lanes_wanted)
            .map(|l| Lane::new(&pool, (n * l / lanes_wanted)..(n * (l + 1) / lanes_wanted)))
            .collect::<Result<Vec<_>>>()?;
        let mut batch = Self {
            pool,
            count: n,
            run: Run::Memcpy(Vec::new()),
            lanes,
            in_flight: false,
        };
        batch.run = match (strategy, kernel) {
            (Strategy::Kernel, Some(kernel)) => batch.upload(kernel, &copies)?,
            (Strategy::Batch, _) => {
                let copies = copies.iter().filter(|c| c.len > 0);
                let location = sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: batch.pool.gpu.ordinal() as i32,
                };
                Run::Batch {
                    dsts: copies.clone().map(|c| c.dst).collect(),
                    srcs: copies.clone().map(|c| c.src).collect(),
                    sizes: copies.map(|c| c.len).collect(),
                    attrs: sys::CUmemcpyAttributes {
                        srcAccessOrder:
                            sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                        srcLocHint: location,
                        dstLocHint: location,
                        flags: 0,
                    },
                }
            }
            _ => Run::Memcpy(copies),
        };
        Ok(batch)
    }

    /// Builds the kernel's work table in a pinned buffer and uploads it on the lane's
    /// stream (see [`Self::upload_table`]).
    fn upload(&mut self, kernel: Arc<CopyKernel>, copies: &[Copy]) -> Result<Run> {
        let count = work_item_count(copies, KERNEL_CHUNK_BYTES);
        let (table, upload) = self.upload_table::<CopyItem>(count, |items| {
            write_work_items(copies, KERNEL_CHUNK_BYTES, items)
        })?;
        Ok(Run::Kernel {
            grid: (count as u64).clamp(1, u64::from(kernel.max_blocks)) as u32,
            items: count as u64,
            kernel,
            table: Some(table),
            upload,
        })
    }

    /// A device table of `count` entries of `T`, written by `fill` into a pinned buffer
    /// and uploaded on the first lane's stream (ordered before every launch there); the
    /// lane's event marks the upload, so that a batch dropped before its first post still
    /// waits for it before the table and the buffer are reused. The buffer (`None` for an
    /// empty table) must be kept until then.
    fn upload_table<T: std::marker::Copy>(
        &mut self,
        count: usize,
        fill: impl FnOnce(&mut [T]),
    ) -> Result<(DeviceBuffer, Option<gpu_mem::HostBuffer>)> {
        let bytes = count * std::mem::size_of::<T>();
        let table = self.pool.take_table(bytes.max(1))?;
        if bytes == 0 {
            return Ok((table, None));
        }
        let mut host = match self.pool.take_upload(bytes) {
            Ok(h) => h,
            Err(e) => {
                self.pool.give_table(table);
                return Err(e);
            }
        };
        let ptr = host.as_mut_ptr();
        if !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
            self.pool.give_table(table);
            return Err(Error::Gpu(format!(
                "a pinned upload buffer at {ptr:p} is not aligned for a copy table"
            )));
        }
        // SAFETY: the buffer holds at least `bytes` = `count` entries, is aligned for them
        // (checked above), and is borrowed mutably through `host` only here; `T` is plain
        // data (`Copy`), for which the buffer's zeroed or earlier bytes are overwritten by
        // `fill` before the upload reads them.
        let entries = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<T>(), count) };
        fill(entries);
        let lane = &mut self.lanes[0];
        let sent = self
            .pool
            .gpu
            .bind()
            .map_err(gpu_err("binding the context"))
            .and_then(|()| {
                // SAFETY: the table holds at least `bytes`; the source is pinned host
                // memory that the caller keeps until this batch's events completed (see
                // Drop), so the asynchronous copy may read it later.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        table.ptr(),
                        host.as_ptr().cast(),
                        bytes,
                        lane.stream.cu_stream(),
                    )
                }
                .result()
                .map_err(|e| Error::Gpu(format!("uploading a copy table ({bytes} bytes): {e:?}")))
            })
            .and_then(|()| {
                lane.event
                    .record(&lane.stream)
                    .map_err(|e| Error::Gpu(format!("cuEventRecord: {e:?}")))
            });
        if let Err(e) = sent {
            // Whether the upload was queued is not known: wait for the stream before the
            // table and the buffer are reused.
            match lane.stream.synchronize() {
                Ok(()) => {
                    self.pool.give_table(table);
                    self.pool.give_upload(host);
                }
                Err(_) => std::mem::forget((table, host)),
            }
            return Err(e);
        }
        lane.done = false;
        self.in_flight = true;
        Ok((table, Some(host)))
    }

    /// A request over lists prepared once (see [`GatherLists`]): one launch of the gather
    /// kernel over `pairs` (positions in the source and destination tables), uploaded
    /// now. `None` where the kernel is unavailable (the caller then copies otherwise).
    pub(crate) fn gather(
        pool: Arc<GpuStreams>,
        lists: GatherLists,
        pairs: impl ExactSizeIterator<Item = (u32, u32)>,
    ) -> Result<Option<Self>> {
        let Some(kernel) = copy_kernel(&pool.gpu) else {
            return Ok(None);
        };
        let count = pairs.len();
        let lane = Lane::new(&pool, 0..count)?;
        let mut batch = Self {
            pool,
            count,
            run: Run::Memcpy(Vec::new()),
            lanes: vec![lane],
            in_flight: false,
        };
        let (table, upload) = batch.upload_table::<GatherPair>(count, |slots| {
            for (slot, (src, dst)) in slots.iter_mut().zip(pairs) {
                *slot = GatherPair { src, dst };
            }
        })?;
        batch.run = Run::Gather {
            grid: (count as u64).clamp(1, u64::from(kernel.max_blocks)) as u32,
            pairs: count as u64,
            kernel,
            table: Some(table),
            upload,
            src: lists.src,
            dst: lists.dst,
            lens: lists.lens,
            lens_by_dst: lists.lens_by_dst,
        };
        Ok(Some(batch))
    }

    /// Number of copies one post issues.
    pub(crate) fn len(&self) -> usize {
        self.count
    }

    /// Issues every copy, each lane followed by its event. `after` (a stream of the
    /// caller's, on the same GPU) orders the copies after the work already queued there.
    pub(crate) fn post(&mut self, after: Option<&CudaStream>) -> Result<()> {
        self.pool
            .gpu
            .bind()
            .map_err(gpu_err("binding the context"))?;
        let ready =
            match after {
                Some(user) => Some(user.record_event(None).map_err(|e| {
                    Error::Gpu(format!("cuEventRecord on the caller's stream: {e:?}"))
                })?),
                None => None,
            };
        self.in_flight = true;
        for lane in &mut self.lanes {
            if let Some(ready) = &ready {
                lane.stream
                    .wait(ready)
                    .map_err(|e| Error::Gpu(format!("cuStreamWaitEvent: {e:?}")))?;
            }
            match &mut self.run {
                Run::Memcpy(copies) => {
                    for c in &copies[lane.copies.clone()] {
                        // SAFETY: both ranges were bounds-checked by the agent against
                        // live registrations (or a live IPC mapping) that the request
                        // keeps alive until this batch's events completed (see Drop).
                        let r = unsafe {
                            sys::cuMemcpyAsync(c.dst, c.src, c.len, lane.stream.cu_stream())
                        };
                        r.result().map_err(|e| {
                            Error::Gpu(format!(
                                "cuMemcpyAsync {:#x} -> {:#x} ({} bytes): {e:?}",
                                c.src, c.dst, c.len
                            ))
                        })?;
                    }
                }
                Run::Kernel {
                    kernel,
                    table,
                    items,
                    grid,
                    ..
                } => {
                    if *items > 0 {
                        let table_ptr = table.as_ref().map_or(0, DeviceBuffer::ptr);
                        let cfg = LaunchConfig {
                            grid_dim: (*grid, 1, 1),
                            block_dim: (KERNEL_THREADS, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        let mut launch = lane.stream.launch_builder(&kernel.function);
                        launch.arg(&table_ptr).arg(&*items);
                        // SAFETY: the kernel's signature is (const nixl_copy_item *,
                        // unsigned long long), matching the arguments; the table holds
                        // `items` items (uploaded earlier on this stream), each inside
                        // ranges checked by the agent against live registrations or
                        // mappings that the request keeps alive until this batch's event
                        // completed (see Drop), and reachable from this GPU (checked at
                        // prep: same GPU, peer access on, or pinned host memory).
                        unsafe { launch.launch(cfg) }.map_err(|e| {
                            Error::Gpu(format!(
                                "launching the copy kernel ({items} work items): {e:?}"
                            ))
                        })?;
                    }
                }
                Run::Gather {
                    kernel,
                    table,
                    pairs,
                    grid,
                    src,
                    dst,
                    lens,
                    lens_by_dst,
                    ..
                } => {
                    let table_ptr = table.as_ref().map_or(0, DeviceBuffer::ptr);
                    let (src_ptr, dst_ptr, lens_ptr) = (src.ptr(), dst.ptr(), lens.ptr());
                    let by_dst = i32::from(*lens_by_dst);
                    let cfg = LaunchConfig {
                        grid_dim: (*grid, 1, 1),
                        block_dim: (KERNEL_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut launch = lane.stream.launch_builder(&kernel.gather);
                    launch
                        .arg(&src_ptr)
                        .arg(&dst_ptr)
                        .arg(&lens_ptr)
                        .arg(&by_dst)
                        .arg(&table_ptr)
                        .arg(&*pairs);
                    // SAFETY: the kernel's signature is (const u64 *, const u64 *, const
                    // u64 *, int, const nixl_gather_pair *, u64), matching the arguments.
                    // The pairs (uploaded earlier on this stream) hold positions the agent
                    // checked against both lists, inside tables of that many entries; each
                    // table's addresses lie in ranges checked against live registrations
                    // or mappings that the request keeps alive until this batch's event
                    // completed (see Drop), all reachable by this GPU's kernels (checked
                    // when the tables were made).
                    unsafe { launch.launch(cfg) }.map_err(|e| {
                        Error::Gpu(format!(
                            "launching the gather kernel ({pairs} pairs): {e:?}"
                        ))
                    })?;
                }
                Run::Batch {
                    dsts,
                    srcs,
                    sizes,
                    attrs,
                } => {
                    if !sizes.is_empty() {
                        let mut attr_index = [0usize];
                        // SAFETY: the three arrays have `sizes.len()` entries and one
                        // attribute set applies to all (index 0); the driver reads them
                        // during the call. The ranges were checked by the agent as for
                        // `cuMemcpyAsync` above and stay alive until the event completed.
                        let r = unsafe {
                            sys::cuMemcpyBatchAsync_v2(
                                dsts.as_mut_ptr(),
                                srcs.as_mut_ptr(),
                                sizes.as_mut_ptr(),
                                sizes.len(),
                                attrs,
                                attr_index.as_mut_ptr(),
                                1,
                                lane.stream.cu_stream(),
                            )
                        };
                        r.result().map_err(|e| {
                            Error::Gpu(format!(
                                "cuMemcpyBatchAsync ({} copies): {e:?}",
                                sizes.len()
                            ))
                        })?;
                    }
                }
            }
            lane.event
                .record(&lane.stream)
                .map_err(|e| Error::Gpu(format!("cuEventRecord: {e:?}")))?;
            lane.done = false;
        }
        Ok(())
    }

    /// Polls the events: (all done, copies completed so far).
    pub(crate) fn poll(&mut self) -> Result<(bool, u64)> {
        let mut completed = 0u64;
        let mut all = true;
        for lane in &mut self.lanes {
            if !lane.done {
                lane.done = lane
                    .event
                    .try_is_complete()
                    .map_err(|e| Error::Gpu(format!("a copy failed on the GPU: {e:?}")))?;
            }
            if lane.done {
                completed += lane.copies.len() as u64;
            } else {
                all = false;
            }
        }
        if all {
            self.in_flight = false;
        }
        Ok((all, completed))
    }
}

impl Drop for CopyBatch {
    fn drop(&mut self) {
        // A copy cannot be recalled: wait for it, so that the memory it touches (kept
        // alive by the request that owns this batch) outlives it.
        let mut finished = true;
        if self.in_flight {
            for lane in &self.lanes {
                if !lane.done {
                    if let Err(e) = lane.event.synchronize() {
                        tracing::warn!("waiting for a released GPU copy: {e:?}");
                        finished = false;
                    }
                }
            }
        }
        // Events of finished lanes serve later batches (a failed wait's event may still
        // be recorded into: dropped with its lane).
        if finished {
            for lane in self.lanes.drain(..) {
                self.pool.give_event(lane.event);
            }
        }
        // A table a kernel may still read (its wait failed) is leaked rather than reused,
        // and so is the buffer an upload may still read.
        if let Run::Kernel { table, upload, .. } | Run::Gather { table, upload, .. } = &mut self.run
        {
            if let Some(table) = table.take() {
                if finished {
                    self.pool.give_table(table);
                } else {
                    std::mem::forget(table);
                }
            }
            if let Some(upload) = upload.take() {
                if finished {
                    self.pool.give_upload(upload);
                } else {
                    std::mem::forget(upload);
                }
            }
        }
    }
}

/// Where a GPU transfer's notification goes once its copies completed.
pub(crate) trait NotifSink: Send + Sync + std::fmt::Debug {
    /// Delivers `msg` to the target (called strictly after every copy completed).
    fn deliver(&self, msg: Vec<u8>) -> Result<()>;
    /// Fails when the target is gone (checked at post and while polling).
    fn alive(&self) -> Result<()> {
        Ok(())
    }
}

/// A posted-and-polled transfer made of copy batches (one per GPU involved) and staged
/// batches (one per pair of GPUs without peer access).
#[derive(Debug)]
pub(crate) struct GpuXfer {
    batches: Vec<CopyBatch>,
    staged: Vec<StagedBatch>,
    pending_notif: Option<Vec<u8>>,
    sink: Arc<dyn NotifSink>,
    /// Kept alive as long as the transfer (e.g. the peer's IPC mappings).
    _keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
}

impl GpuXfer {
    /// Groups `copies` by the GPU each runs on and prepares a batch per GPU, run as
    /// `engine` says.
    pub(crate) fn new(
        pools: &StreamPools,
        copies: impl IntoIterator<Item = (usize, Copy)>,
        max_lanes: usize,
        engine: CopyEngine,
        sink: Arc<dyn NotifSink>,
        keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> Result<Self> {
        let copies = copies.into_iter();
        // Nearly always one GPU: its batch takes every copy without growing.
        let expected = copies.size_hint().0;
        let mut by_gpu: Vec<(usize, Vec<Copy>)> = Vec::new();
        for (gpu, copy) in copies {
            match by_gpu.iter_mut().find(|(g, _)| *g == gpu) {
                Some((_, v)) => v.push(copy),
                None => {
                    let mut v = Vec::with_capacity(expected.max(1));
                    v.push(copy);
                    by_gpu.push((gpu, v));
                }
            }
        }
        let batches = by_gpu
            .into_iter()
            .map(|(gpu, copies)| CopyBatch::new(pools.get(gpu)?, copies, max_lanes, engine))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            batches,
            staged: Vec::new(),
            pending_notif: None,
            sink,
            _keep: keep,
        })
    }

    /// A transfer of one prepared batch (e.g. [`CopyBatch::gather`]).
    pub(crate) fn of_batch(
        batch: CopyBatch,
        sink: Arc<dyn NotifSink>,
        keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> Self {
        Self {
            batches: vec![batch],
            staged: Vec::new(),
            pending_notif: None,
            sink,
            _keep: keep,
        }
    }

    /// Adds copies between GPUs without peer access, staged through pinned host memory
    /// (a batch per ordered pair of GPUs).
    pub(crate) fn with_staged(
        mut self,
        pools: &StreamPools,
        copies: impl IntoIterator<Item = StagedCopy>,
    ) -> Result<Self> {
        let mut by_pair: Vec<((usize, usize), Vec<Copy>)> = Vec::new();
        for c in copies {
            let pair = (c.src_gpu, c.dst_gpu);
            match by_pair.iter_mut().find(|(p, _)| *p == pair) {
                Some((_, v)) => v.push(c.copy),
                None => by_pair.push((pair, vec![c.copy])),
            }
        }
        for ((src, dst), copies) in by_pair {
            self.staged.push(StagedBatch::new(
                pools.get(src)?,
                pools.get(dst)?,
                &copies,
                STAGE_CHUNK_BYTES,
                STAGE_SLOTS,
            )?);
        }
        Ok(self)
    }
}

impl crate::backend::BackendXfer for GpuXfer {
    fn post(
        &mut self,
        notif: Option<&[u8]>,
        params: &crate::backend::PostParams,
    ) -> Result<crate::backend::XferStatus> {
        self.sink.alive()?;
        // Stream attached: a post carrying the caller's stream (`Arc<CudaStream>`) runs
        // after the work already queued on it.
        let after = params
            .custom
            .as_ref()
            .and_then(|c| c.downcast_ref::<Arc<CudaStream>>());
        for batch in &mut self.batches {
            batch.post(after.map(|s| &**s))?;
        }
        for batch in &mut self.staged {
            batch.post(after.map(|s| &**s))?;
        }
        self.pending_notif = notif.map(<[u8]>::to_vec);
        Ok(crate::backend::XferStatus::InProgress)
    }

    fn check(&mut self) -> Result<crate::backend::XferProgress> {
        let mut all = true;
        let mut completed = 0;
        for batch in &mut self.batches {
            let (done, n) = batch.poll()?;
            all &= done;
            completed += n;
        }
        for batch in &mut self.staged {
            let (done, n) = batch.poll()?;
            all &= done;
            completed += n;
        }
        if !all {
            self.sink.alive()?;
        } else if let Some(msg) = self.pending_notif.take() {
            self.sink.deliver(msg)?;
        }
        Ok(crate::backend::XferProgress {
            status: if all {
                crate::backend::XferStatus::Done
            } else {
                crate::backend::XferStatus::InProgress
            },
            completed_ops: completed,
        })
    }

    fn op_count(&self) -> usize {
        self.batches.iter().map(CopyBatch::len).sum::<usize>()
            + self.staged.iter().map(|b| b.count).sum::<usize>()
    }

    fn staged_bytes(&self) -> u64 {
        self.staged.iter().map(|b| b.bytes).sum()
    }
}

/// Bytes of one staging slot: a copy engine's transfer long enough that the calls
/// around it cost little, short enough that the two halves of a large copy overlap.
pub(crate) const STAGE_CHUNK_BYTES: usize = 2 << 20;
/// Slots of a staged batch: how many chunks are between the two GPUs at once.
pub(crate) const STAGE_SLOTS: usize = 4;

/// A copy from memory of GPU `src_gpu` to memory of GPU `dst_gpu`, a pair without peer
/// access: staged through pinned host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StagedCopy {
    pub(crate) src_gpu: usize,
    pub(crate) dst_gpu: usize,
    pub(crate) copy: Copy,
}

/// A piece of a copy that goes through a staging slot: `len` bytes from `src` to the
/// slot at `at`, then from there to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StagePiece {
    src: u64,
    dst: u64,
    len: usize,
    at: usize,
}

/// The copies cut into segments of at most `chunk` bytes, each one slot's fill: pieces
/// packed one after another (many small copies share a segment; a large copy is cut
/// across several). Empty copies leave nothing.
fn stage_segments(copies: &[Copy], chunk: usize) -> Vec<Vec<StagePiece>> {
    let chunk = chunk.max(1);
    let mut segments = Vec::new();
    let mut current: Vec<StagePiece> = Vec::new();
    let mut used = 0usize;
    for c in copies {
        let mut done = 0usize;
        while done < c.len {
            if used == chunk {
                segments.push(std::mem::take(&mut current));
                used = 0;
            }
            let len = (c.len - done).min(chunk - used);
            current.push(StagePiece {
                src: c.src + done as u64,
                dst: c.dst + done as u64,
                len,
                at: used,
            });
            used += len;
            done += len;
        }
    }
    if !current.is_empty() {
        segments.push(current);
    }
    segments
}

/// One staging slot: pinned host memory and the events that hand it from one GPU to the
/// other.
#[derive(Debug)]
struct StageSlot {
    buf: gpu_mem::HostBuffer,
    /// Recorded on the source GPU's stream after the slot was filled.
    filled: CudaEvent,
    /// Recorded on the destination GPU's stream after the slot was drained.
    drained: CudaEvent,
}

/// Copies from one GPU's memory to another's where the pair has no peer access, through
/// pinned host memory: segment `k` is copied device-to-host into slot `k % slots` on a
/// stream of the source GPU's context, then host-to-device on a stream of the
/// destination's, which waits for the fill; a slot is refilled only after the
/// destination drained it. Everything is queued at post (cross-context event waits, no
/// host thread), so up to `slots` segments are in flight, the source's copies of one
/// overlapping the destination's of another. Completion is an event after the last
/// drain, on the destination's stream.
#[derive(Debug)]
struct StagedBatch {
    src: Arc<GpuStreams>,
    dst: Arc<GpuStreams>,
    d2h: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    segments: Vec<Vec<StagePiece>>,
    slots: Vec<StageSlot>,
    done_event: CudaEvent,
    /// Copies (as the caller counted them) and their bytes.
    count: usize,
    bytes: u64,
    in_flight: bool,
    done: bool,
}

impl StagedBatch {
    fn new(
        src: Arc<GpuStreams>,
        dst: Arc<GpuStreams>,
        copies: &[Copy],
        chunk: usize,
        slots: usize,
    ) -> Result<Self> {
        let segments = stage_segments(copies, chunk);
        let slot_bytes = segments
            .iter()
            .map(|s| s.iter().map(|p| p.at + p.len).max().unwrap_or(0))
            .max()
            .unwrap_or(0);
        let event = |gpu: &Gpu| {
            gpu.context()
                .new_event(None)
                .map_err(|e| Error::Gpu(format!("cuEventCreate: {e:?}")))
        };
        let slots = (0..slots.max(1).min(segments.len()))
            .map(|_| {
                Ok(StageSlot {
                    buf: src.take_stage_slot(slot_bytes)?,
                    filled: event(&src.gpu)?,
                    drained: event(&dst.gpu)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            d2h: src.next_stream(),
            h2d: dst.next_stream(),
            done_event: event(&dst.gpu)?,
            src,
            dst,
            segments,
            slots,
            count: copies.len(),
            bytes: copies.iter().map(|c| c.len as u64).sum(),
            in_flight: false,
            done: true,
        })
    }

    /// Queues every segment's two copies (see the type's documentation). `after` (a
    /// stream of the caller's) orders the first reads after the work queued there.
    fn post(&mut self, after: Option<&CudaStream>) -> Result<()> {
        self.in_flight = true;
        self.done = false;
        let queued = self.queue(after);
        if queued.is_err() {
            // Some copies may be queued without the final event: wait for both streams
            // before the slots can go (leaked if even that fails).
            let drained = self.d2h.synchronize().and(self.h2d.synchronize());
            if drained.is_err() {
                for slot in std::mem::take(&mut self.slots) {
                    std::mem::forget(slot.buf);
                }
            }
            self.in_flight = false;
            self.done = true;
        }
        queued
    }

    fn queue(&mut self, after: Option<&CudaStream>) -> Result<()> {
        let cuda = |what: &'static str| move |e| Error::Gpu(format!("{what}: {e:?}"));
        if let Some(user) = after {
            let ready = user
                .record_event(None)
                .map_err(cuda("cuEventRecord on the caller's stream"))?;
            self.d2h.wait(&ready).map_err(cuda("cuStreamWaitEvent"))?;
        }
        let n_slots = self.slots.len();
        if n_slots == 0 && !self.segments.is_empty() {
            return Err(Error::Gpu(
                "the staging slots were given up after a failed copy: prepare the transfer again"
                    .into(),
            ));
        }
        for (k, segment) in self.segments.iter().enumerate() {
            let slot = &self.slots[k % n_slots];
            let base = slot.buf.as_ptr() as u64;
            if k >= n_slots {
                // The slot's previous segment must have left it (the latest record).
                self.d2h
                    .wait(&slot.drained)
                    .map_err(cuda("cuStreamWaitEvent"))?;
            }
            self.src
                .gpu
                .bind()
                .map_err(gpu_err("binding the context"))?;
            for p in segment {
                // SAFETY: the source range was checked by the agent against a live
                // registration or mapping that the request keeps alive until this
                // batch's last event completed (see Drop); the slot holds `at + len`
                // bytes (sized from the segments) and is pinned and portable.
                let r = unsafe {
                    sys::cuMemcpyAsync(base + p.at as u64, p.src, p.len, self.d2h.cu_stream())
                };
                r.result().map_err(|e| {
                    Error::Gpu(format!(
                        "staging {} bytes from {:#x} (GPU {}): {e:?}",
                        p.len,
                        p.src,
                        self.src.gpu.ordinal()
                    ))
                })?;
            }
            slot.filled
                .record(&self.d2h)
                .map_err(cuda("cuEventRecord"))?;
            self.h2d
                .wait(&slot.filled)
                .map_err(cuda("cuStreamWaitEvent"))?;
            self.dst
                .gpu
                .bind()
                .map_err(gpu_err("binding the context"))?;
            for p in segment {
                // SAFETY: as above, for the destination range; the slot's bytes were
                // written by the copies this stream just waited for.
                let r = unsafe {
                    sys::cuMemcpyAsync(p.dst, base + p.at as u64, p.len, self.h2d.cu_stream())
                };
                r.result().map_err(|e| {
                    Error::Gpu(format!(
                        "unstaging {} bytes to {:#x} (GPU {}): {e:?}",
                        p.len,
                        p.dst,
                        self.dst.gpu.ordinal()
                    ))
                })?;
            }
            slot.drained
                .record(&self.h2d)
                .map_err(cuda("cuEventRecord"))?;
        }
        self.done_event
            .record(&self.h2d)
            .map_err(cuda("cuEventRecord"))?;
        Ok(())
    }

    /// (done, copies completed so far).
    fn poll(&mut self) -> Result<(bool, u64)> {
        if !self.done {
            self.done = self
                .done_event
                .try_is_complete()
                .map_err(|e| Error::Gpu(format!("a staged copy failed on the GPU: {e:?}")))?;
        }
        if self.done {
            self.in_flight = false;
            return Ok((true, self.count as u64));
        }
        Ok((false, 0))
    }
}

impl Drop for StagedBatch {
    fn drop(&mut self) {
        // The copies read and write the slots (given back for reuse) and the request's
        // memory: wait for the last one. Its event follows every drain, and every drain
        // follows its fill, so it follows every copy of the batch.
        if self.in_flight && !self.done {
            if let Err(e) = self.done_event.synchronize() {
                tracing::warn!("waiting for a released staged copy: {e:?}");
                // The slots may still be in use: leaked rather than reused or freed.
                for slot in std::mem::take(&mut self.slots) {
                    std::mem::forget(slot.buf);
                }
            }
        }
        for slot in std::mem::take(&mut self.slots) {
            self.src.give_stage_slot(slot.buf);
        }
    }
}

/// The staging pipeline's copier: bounce memory pinned with `cuMemHostAlloc`, copies
/// between it and VRAM by `cuMemcpyAsync` on the backend's streams (round-robin, so the
/// copies of consecutive chunks overlap each other and the network), completed by
/// events that are reused. Host-to-host copies (a staged DRAM region) are `memcpy`.
#[derive(Debug)]
pub(crate) struct StagingCopier {
    streams: StreamPools,
    pending: HashMap<u64, (usize, CudaEvent)>,
    spare: HashMap<usize, Vec<CudaEvent>>,
    next: u64,
}

impl StagingCopier {
    pub(crate) fn new(streams_per_gpu: usize) -> Self {
        Self {
            streams: StreamPools::new(streams_per_gpu),
            pending: HashMap::new(),
            spare: HashMap::new(),
            next: 0,
        }
    }
}

impl super::staging::Copier for StagingCopier {
    fn alloc(&mut self, len: usize, dev: Option<usize>) -> Result<super::staging::BounceMem> {
        let Some(dev) = dev else {
            return super::staging::BounceMem::heap(len);
        };
        let pool = self.streams.get(dev)?;
        let buf = gpu_mem::HostBuffer::alloc(&pool.gpu, len)
            .map_err(gpu_err("allocating the pinned staging pool"))?;
        Ok(super::staging::BounceMem::Pinned(buf))
    }

    fn start(&mut self, dev: Option<usize>, copies: &[super::staging::CopyOp]) -> Result<u64> {
        self.next += 1;
        let ticket = self.next;
        let Some(dev) = dev else {
            // SAFETY: the staging engine copies only between its bounce memory and ranges
            // checked against live staged registrations.
            unsafe { super::staging::host_copy(copies) };
            return Ok(ticket);
        };
        let pool = self.streams.get(dev)?;
        pool.gpu.bind().map_err(gpu_err("binding the context"))?;
        let stream = pool.next_stream();
        for c in copies {
            // SAFETY: one side is the engine's bounce memory (pinned, alive while the
            // engine is), the other a range checked against a live staged registration
            // whose request waits for this copy before letting the memory go.
            let r = unsafe { sys::cuMemcpyAsync(c.dst, c.src, c.len, stream.cu_stream()) };
            r.result().map_err(|e| {
                Error::Gpu(format!(
                    "cuMemcpyAsync {:#x} -> {:#x} ({} bytes): {e:?}",
                    c.src, c.dst, c.len
                ))
            })?;
        }
        let event = match self.spare.get_mut(&dev).and_then(Vec::pop) {
            Some(e) => e,
            None => pool
                .gpu
                .context()
                .new_event(None)
                .map_err(|e| Error::Gpu(format!("cuEventCreate: {e:?}")))?,
        };
        event
            .record(&stream)
            .map_err(|e| Error::Gpu(format!("cuEventRecord: {e:?}")))?;
        self.pending.insert(ticket, (dev, event));
        Ok(ticket)
    }

    fn poll(&mut self, ticket: u64) -> Result<bool> {
        let Some((_, event)) = self.pending.get(&ticket) else {
            // A host copy (done at start) or an already finished ticket.
            return Ok(true);
        };
        let done = event
            .try_is_complete()
            .map_err(|e| Error::Gpu(format!("a staging copy failed on the GPU: {e:?}")));
        match done {
            Ok(false) => Ok(false),
            Ok(true) => {
                let (dev, event) = self.pending.remove(&ticket).expect("present");
                self.spare.entry(dev).or_default().push(event);
                Ok(true)
            }
            Err(e) => {
                self.pending.remove(&ticket);
                Err(e)
            }
        }
    }
}

impl Drop for StagingCopier {
    fn drop(&mut self) {
        // A copy cannot be recalled: wait for those still running before the memory
        // they touch may go.
        for (_, event) in self.pending.values() {
            if let Err(e) = event.synchronize() {
                tracing::warn!("waiting for a staging copy: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(src: u64, dst: u64, len: usize, src_loc: MemLoc, dst_loc: MemLoc) -> Copy {
        Copy {
            dst,
            src,
            len,
            dst_loc,
            src_loc,
        }
    }

    fn vram(src: u64, dst: u64, len: usize) -> Copy {
        copy(src, dst, len, MemLoc::Gpu(0), MemLoc::Gpu(0))
    }

    #[test]
    fn work_items_split_large_copies_and_cover_every_byte_once() {
        let chunk = 4096;
        let copies = [
            vram(0x1000, 0x9_0003, 1),
            vram(0x2001, 0xa_0001, chunk),
            vram(0x3_0000, 0xb_0000, 3 * chunk + 17),
            vram(0x4_0000, 0xc_0000, 0),
            vram(0x5_0007, 0xd_0003, 2 * chunk),
        ];
        let items = work_items(&copies, chunk);
        assert_eq!(items.len(), 1 + 1 + 4 + 2);
        assert!(items.iter().all(|i| i.len > 0 && i.len <= chunk as u64));
        // Each copy's items tile it exactly, in order, source and destination advancing
        // together (so their relative alignment is the copy's).
        let mut it = items.iter();
        for c in copies.iter().filter(|c| c.len > 0) {
            let mut at = 0u64;
            while at < c.len as u64 {
                let item = it.next().expect("an item per chunk");
                assert_eq!(item.src, c.src + at);
                assert_eq!(item.dst, c.dst + at);
                assert_eq!(item.src.wrapping_sub(item.dst), c.src.wrapping_sub(c.dst));
                at += item.len;
            }
            assert_eq!(at, c.len as u64);
        }
        assert!(it.next().is_none());
        assert!(work_items(&[], chunk).is_empty());
    }

    #[test]
    fn auto_takes_the_kernel_for_many_small_device_copies_only() {
        let reach_all = |_: MemLoc, _: u64| true;
        let small: Vec<Copy> = (0..KERNEL_MIN_COPIES as u64)
            .map(|k| vram(k << 20, (k << 20) + (1 << 30), 32 << 10))
            .collect();
        assert_eq!(
            wanted(CopyEngine::Auto, &small, reach_all),
            Strategy::Kernel
        );
        // Too few copies.
        assert_eq!(
            wanted(CopyEngine::Auto, &small[..KERNEL_MIN_COPIES - 1], reach_all),
            Strategy::Memcpy
        );
        // Too large on average.
        let large: Vec<Copy> = (0..KERNEL_MIN_COPIES as u64)
            .map(|k| vram(k << 30, (k << 30) + (1 << 40), KERNEL_MAX_MEAN_BYTES + 1))
            .collect();
        assert_eq!(
            wanted(CopyEngine::Auto, &large, reach_all),
            Strategy::Memcpy
        );
        // Host memory, even pinned, stays with the copy engines.
        let mut host = small.clone();
        host[3].src_loc = MemLoc::Host { pinned: true };
        assert_eq!(wanted(CopyEngine::Auto, &host, reach_all), Strategy::Memcpy);
        // A peer GPU the kernel cannot reach.
        let mut peer = small.clone();
        peer[5].dst_loc = MemLoc::Gpu(1);
        let only_gpu0 = |l: MemLoc, _: u64| l == MemLoc::Gpu(0);
        assert_eq!(wanted(CopyEngine::Auto, &peer, only_gpu0), Strategy::Memcpy);
        assert_eq!(wanted(CopyEngine::Auto, &peer, reach_all), Strategy::Kernel);
    }

    #[test]
    fn explicit_engines_are_taken_where_they_can_run() {
        let reach = |l: MemLoc, _: u64| !matches!(l, MemLoc::Host { pinned: false });
        let one = [vram(0, 1 << 30, 1 << 30)];
        assert_eq!(wanted(CopyEngine::Kernel, &one, reach), Strategy::Kernel);
        assert_eq!(wanted(CopyEngine::Memcpy, &one, reach), Strategy::Memcpy);
        assert_eq!(wanted(CopyEngine::Batch, &one, reach), Strategy::Batch);
        let pinned = [copy(
            0,
            1 << 30,
            64,
            MemLoc::Host { pinned: true },
            MemLoc::Gpu(0),
        )];
        assert_eq!(wanted(CopyEngine::Kernel, &pinned, reach), Strategy::Kernel);
        let pageable = [copy(
            0,
            1 << 30,
            64,
            MemLoc::Gpu(0),
            MemLoc::Host { pinned: false },
        )];
        assert_eq!(
            wanted(CopyEngine::Kernel, &pageable, reach),
            Strategy::Memcpy
        );
        assert_eq!(wanted(CopyEngine::Batch, &pageable, reach), Strategy::Batch);
    }

    #[test]
    fn staged_segments_pack_small_copies_and_cut_large_ones() {
        let chunk = 1000;
        let g =
            |src: u64, dst: u64, len: usize| copy(src, dst, len, MemLoc::Gpu(0), MemLoc::Gpu(1));
        let copies = [
            g(0x1_0000, 0x9_0000, 300),
            g(0x2_0001, 0xa_0003, 0),
            g(0x3_0003, 0xb_0001, 2_501),
            g(0x4_0000, 0xc_0000, 7),
            g(0x5_0000, 0xd_0000, 192),
        ];
        let segments = stage_segments(&copies, chunk);
        // 3000 bytes in all: three full slots and nothing more.
        assert_eq!(segments.len(), 3);
        for s in &segments {
            // Pieces are packed from the slot's start, one after another, within it.
            let mut at = 0;
            for p in s {
                assert_eq!(p.at, at);
                assert!(p.len > 0);
                at += p.len;
            }
            assert!(at <= chunk);
        }
        // Every copy's bytes pass, in order, exactly once, source and destination
        // advancing together.
        let mut pieces = segments.iter().flatten();
        for c in copies.iter().filter(|c| c.len > 0) {
            let mut done = 0;
            while done < c.len {
                let p = pieces.next().expect("a piece per part of the copy");
                assert_eq!(p.src, c.src + done as u64);
                assert_eq!(p.dst, c.dst + done as u64);
                done += p.len;
            }
            assert_eq!(done, c.len);
        }
        assert!(pieces.next().is_none());
        // The large copy was cut where a slot filled up: 700 bytes in the first.
        assert_eq!(segments[0][1].len, 700);
        assert_eq!(
            segments[1],
            vec![StagePiece {
                src: 0x3_0003 + 700,
                dst: 0xb_0001 + 700,
                len: 1000,
                at: 0
            }]
        );
        assert!(stage_segments(&[], chunk).is_empty());
        assert!(stage_segments(&[g(1, 2, 0)], chunk).is_empty());
        // One odd-sized copy smaller than a slot: one piece.
        assert_eq!(stage_segments(&[g(1, 2, 3)], chunk).len(), 1);
    }

    #[test]
    fn copy_engine_parses_its_four_names_and_refuses_others() {
        for (text, engine) in [
            ("auto", CopyEngine::Auto),
            ("kernel", CopyEngine::Kernel),
            ("memcpy", CopyEngine::Memcpy),
            ("batch", CopyEngine::Batch),
        ] {
            assert_eq!(text.parse::<CopyEngine>().unwrap(), engine);
        }
        assert!(matches!(
            "Kernel".parse::<CopyEngine>(),
            Err(Error::InvalidParam(_))
        ));
        assert_eq!(CopyEngine::default(), CopyEngine::Auto);
    }

    #[test]
    fn the_kernel_compiles_with_nvrtc_where_it_is_installed() {
        if !gpu_mem::device_code::nvrtc_available() {
            eprintln!("skipped: libnvrtc is not installed (cargo xtask nvrtc fetches it)");
            return;
        }
        for arch in ["compute_80", "compute_90"] {
            let options = gpu_mem::device_code::CompileOptions {
                arch: arch.into(),
                ..Default::default()
            };
            let r = gpu_mem::device_code::compile(KERNEL_SOURCE.0, KERNEL_SOURCE.1, &options);
            assert!(r.is_ok(), "{arch}: {r:?}");
        }
    }
}
