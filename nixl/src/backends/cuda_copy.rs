//! What the GPU backends (`LOCAL` with VRAM, `CUDA_IPC`) share: per-GPU pools of the
//! backend's own streams, host pinning of DRAM registrations, and prepared batches of
//! `cuMemcpyAsync` whose completion is polled through events.

use crate::error::{Error, Result};
use gpu_mem::cudarc::driver::sys;
use gpu_mem::cudarc::driver::{CudaEvent, CudaStream};
use gpu_mem::{Gpu, HostRegistration};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
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
}

impl GpuStreams {
    fn next_stream(&self) -> Arc<CudaStream> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        self.streams[i].clone()
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

    /// Pins the range now if it is not yet (once; a refusal is remembered).
    pub(crate) fn ensure(&self) {
        self.pin.get_or_init(|| pin_host(self.addr, self.len));
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

/// One copy: `len` bytes from `src` to `dst` (device or host addresses, unified).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Copy {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: usize,
}

#[derive(Debug)]
struct Lane {
    stream: Arc<CudaStream>,
    copies: Range<usize>,
    event: CudaEvent,
    done: bool,
}

/// A prepared batch of copies on one GPU's streams, posted any number of times (one at a
/// time). Large batches are spread over several streams in contiguous runs.
#[derive(Debug)]
pub(crate) struct CopyBatch {
    pool: Arc<GpuStreams>,
    copies: Vec<Copy>,
    lanes: Vec<Lane>,
    in_flight: bool,
}

impl CopyBatch {
    /// Prepares `copies` on `pool`'s GPU; `max_lanes` bounds how many streams one post uses.
    pub(crate) fn new(pool: Arc<GpuStreams>, copies: Vec<Copy>, max_lanes: usize) -> Result<Self> {
        let n = copies.len();
        let lanes_wanted = max_lanes.clamp(1, pool.streams.len()).min(n.max(1));
        let mut lanes = Vec::with_capacity(lanes_wanted);
        for l in 0..lanes_wanted {
            let range = (n * l / lanes_wanted)..(n * (l + 1) / lanes_wanted);
            let stream = pool.next_stream();
            let event = pool
                .gpu
                .context()
                .new_event(None)
                .map_err(|e| Error::Gpu(format!("cuEventCreate: {e:?}")))?;
            lanes.push(Lane {
                stream,
                copies: range,
                event,
                done: true,
            });
        }
        Ok(Self {
            pool,
            copies,
            lanes,
            in_flight: false,
        })
    }

    /// Number of copies one post issues.
    pub(crate) fn len(&self) -> usize {
        self.copies.len()
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
            for c in &self.copies[lane.copies.clone()] {
                // SAFETY: both ranges were bounds-checked by the agent against live
                // registrations (or a live IPC mapping) that the request keeps alive until
                // this batch's events completed (see Drop).
                let r = unsafe { sys::cuMemcpyAsync(c.dst, c.src, c.len, lane.stream.cu_stream()) };
                r.result().map_err(|e| {
                    Error::Gpu(format!(
                        "cuMemcpyAsync {:#x} -> {:#x} ({} bytes): {e:?}",
                        c.src, c.dst, c.len
                    ))
                })?;
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
        if self.in_flight {
            for lane in &self.lanes {
                if !lane.done {
                    if let Err(e) = lane.event.synchronize() {
                        tracing::warn!("waiting for a released GPU copy: {e:?}");
                    }
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

/// A posted-and-polled transfer made of copy batches (one per GPU involved).
#[derive(Debug)]
pub(crate) struct GpuXfer {
    batches: Vec<CopyBatch>,
    pending_notif: Option<Vec<u8>>,
    sink: Arc<dyn NotifSink>,
    /// Kept alive as long as the transfer (e.g. the peer's IPC mappings).
    _keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
}

impl GpuXfer {
    /// Groups `copies` by the GPU each runs on and prepares a batch per GPU.
    pub(crate) fn new(
        pools: &StreamPools,
        copies: impl IntoIterator<Item = (usize, Copy)>,
        max_lanes: usize,
        sink: Arc<dyn NotifSink>,
        keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> Result<Self> {
        let mut by_gpu: Vec<(usize, Vec<Copy>)> = Vec::new();
        for (gpu, copy) in copies {
            match by_gpu.iter_mut().find(|(g, _)| *g == gpu) {
                Some((_, v)) => v.push(copy),
                None => by_gpu.push((gpu, vec![copy])),
            }
        }
        let batches = by_gpu
            .into_iter()
            .map(|(gpu, copies)| CopyBatch::new(pools.get(gpu)?, copies, max_lanes))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            batches,
            pending_notif: None,
            sink,
            _keep: keep,
        })
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
        self.batches.iter().map(CopyBatch::len).sum()
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
