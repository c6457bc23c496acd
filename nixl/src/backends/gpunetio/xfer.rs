//! `GPUNETIO`'s prepared transfers: the transfer kernel's and the copy strategies'.

use super::*;

/// The queue pair a request's kernels post on.
#[derive(Debug)]
pub(super) enum DeviceQp {
    IntraNode(ExportedQueuePair),
    Proxy(ExportedProxyQueuePair),
}

impl DeviceQp {
    pub(super) fn device_ptr(&self) -> u64 {
        match self {
            DeviceQp::IntraNode(qp) => qp.device_ptr(),
            DeviceQp::Proxy(qp) => qp.device_ptr(),
        }
    }

    /// What a device handle on this queue pair may do directly: intra-node descriptors
    /// hold both mapped addresses.
    pub(super) fn handle_flags(&self) -> u32 {
        match self {
            DeviceQp::IntraNode(qp) if qp.peers_on_this_gpu() => {
                device::HANDLE_DIRECT | device::HANDLE_SAME_DEVICE
            }
            DeviceQp::IntraNode(_) => device::HANDLE_DIRECT,
            DeviceQp::Proxy(_) => 0,
        }
    }
}

/// What a memory view's kernels read besides its descriptors (the handle table holds
/// those): the queue pair and what keeps the peer's memory mapped.
#[derive(Debug)]
pub(super) struct ViewMem {
    pub(super) qp: DeviceQp,
    /// Dropped after the queue pair (declared after it).
    pub(super) _keep: Vec<Arc<dyn Any + Send + Sync>>,
}

/// What a request's kernels read: the queue pair, the descriptor table, and what keeps
/// the peer's memory mapped. Shared by the request and its GPU handle.
#[derive(Debug)]
pub(super) struct RequestMem {
    pub(super) qp: DeviceQp,
    /// The descriptors in device memory (the transfer kernel's), and on the host.
    pub(super) table: DeviceBuffer,
    pub(super) descs: Vec<GpuDesc>,
    /// Dropped after the queue pair (declared after it).
    pub(super) _keep: Vec<Arc<dyn Any + Send + Sync>>,
}

/// A prepared transfer: one kernel launch per post.
#[derive(Debug)]
pub(super) struct KernelXfer {
    pub(super) gpu: Gpu,
    pub(super) function: CudaFunction,
    pub(super) pool: Arc<StreamPool>,
    pub(super) handles: Arc<HandleTable>,
    pub(super) mem: Arc<RequestMem>,
    pub(super) read: bool,
    pub(super) grid: Grid,
    /// Host-mapped word the kernel writes its first failure to.
    pub(super) status: HostBuffer,
    pub(super) status_ptr: u64,
    pub(super) event: CudaEvent,
    pub(super) in_flight: bool,
    pub(super) pending_notif: Option<Vec<u8>>,
    pub(super) sink: Arc<dyn crate::backends::cuda_copy::NotifSink>,
}

/// The stream a post attaches to (`PostParams::custom`, an `Arc<CudaStream>` of the
/// backend's GPU `gpu`), if any; anything else there is refused, not ignored.
pub(super) fn attached_stream(params: &PostParams, gpu: usize) -> Result<Option<&Arc<CudaStream>>> {
    let Some(custom) = params.custom.as_ref() else {
        return Ok(None);
    };
    let stream = custom.downcast_ref::<Arc<CudaStream>>().ok_or_else(|| {
        Error::InvalidParam(format!(
            "{NAME}: a post's custom parameter must be an Arc<CudaStream> (the stream to attach to)"
        ))
    })?;
    if stream.context().ordinal() != gpu {
        return Err(Error::InvalidParam(format!(
            "{NAME}: the post's stream is on GPU {}, the backend's GPU is {gpu}",
            stream.context().ordinal(),
        )));
    }
    Ok(Some(stream))
}

/// An intra-node transfer whose host posts run `CUDA_IPC`'s copy strategies
/// (`copy_engine` other than `gio`). Its queue pair and device descriptor table, which
/// only kernels of the device API use, are built on the first
/// [`BackendXfer::gpu_xfer_req`]: preparing a request the host posts costs no device
/// allocation.
#[derive(Debug)]
pub(super) struct CopyXfer {
    pub(super) bound: Arc<Bound>,
    pub(super) copies: crate::backends::cuda_copy::GpuXfer,
    /// The queue pair's regions (address, length, the peer's) and descriptors.
    pub(super) ranges: Vec<(u64, u64, bool)>,
    pub(super) descs: Vec<GpuDesc>,
    pub(super) keep: Vec<Arc<dyn Any + Send + Sync>>,
    pub(super) device: Option<Arc<RequestMem>>,
}

impl BackendXfer for CopyXfer {
    fn post(&mut self, notif: Option<&[u8]>, params: &PostParams) -> Result<XferStatus> {
        // Checked here, as the transfer kernel's posts check it; the copies then order
        // themselves after the stream and send the notification after their last copy.
        attached_stream(params, self.bound.gpu.ordinal())?;
        self.copies.post(notif, params)
    }

    fn check(&mut self) -> Result<XferProgress> {
        self.copies.check()
    }

    fn op_count(&self) -> usize {
        self.descs.len()
    }

    fn gpu_xfer_req(&mut self) -> Result<GpuHandle> {
        let mem = match &self.device {
            Some(mem) => mem.clone(),
            None => {
                let qp = self.bound.queue_pair(&self.ranges)?;
                let mem = Arc::new(RequestMem {
                    qp: DeviceQp::IntraNode(qp),
                    table: self.bound.upload(&self.descs)?,
                    descs: self.descs.clone(),
                    _keep: self.keep.clone(),
                });
                self.device = Some(mem.clone());
                mem
            }
        };
        self.bound.handles.publish(
            mem.qp.device_ptr(),
            &mem.descs,
            SLOT_REQUEST | mem.qp.handle_flags(),
            Box::new(mem.clone()),
        )
    }
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
        let stream = match attached_stream(params, self.gpu.ordinal())? {
            Some(s) => s.clone(),
            None => self.pool.next(),
        };
        // SAFETY: the word is ours and no kernel of this request is running (a post
        // while in flight is refused by the agent).
        unsafe { std::ptr::write_volatile(self.status.as_ptr().cast_mut().cast::<i32>(), 0) };
        let cfg = LaunchConfig {
            grid_dim: (self.grid.blocks, 1, 1),
            block_dim: (self.grid.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let qp = self.mem.qp.device_ptr();
        let table = self.mem.table.ptr();
        let count = self.mem.descs.len() as u32;
        let read = u32::from(self.read);
        let mut launch = stream.launch_builder(&self.function);
        launch
            .arg(&qp)
            .arg(&table)
            .arg(&count)
            .arg(&read)
            .arg(&self.grid.chunk)
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
                // A peer found dead (its heartbeats stopped: its ring was shut down, or
                // its operations failed) is said as such, not as the kernel's status.
                self.sink.alive()?;
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
            completed_ops: self.mem.descs.len() as u64,
        })
    }

    fn op_count(&self) -> usize {
        self.mem.descs.len()
    }

    fn gpu_xfer_req(&mut self) -> Result<GpuHandle> {
        self.handles.publish(
            self.mem.qp.device_ptr(),
            &self.mem.descs,
            SLOT_REQUEST | self.mem.qp.handle_flags(),
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
pub(super) fn gio_status_name(st: i32) -> &'static str {
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

/// A launch of the transfer kernel: blocks, threads per block, bytes per piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Grid {
    pub(super) blocks: u32,
    pub(super) threads: u32,
    pub(super) chunk: u64,
}

/// Fewest warps per block of an intra-node transfer (a block of fewer leaves an SM with
/// too few loads in flight).
pub(super) const MIN_BLOCK_WARPS: u64 = 4;

/// The grid for moving `total` bytes in descriptors of which the largest has `largest`
/// bytes, on a GPU of `sm_count` SMs where `resident_blocks` blocks of [`THREADS`] fit at
/// once: one warp per piece of at least `MIN_CHUNK` bytes, spread over as many SMs as
/// there are pieces for (blocks of 4 to 16 warps) — a warp's loads are latency-bound, and
/// so is an SM's share of them, so a transfer of a few MiB crammed into a few large
/// blocks reaches only a few SMs' worth of bandwidth — and never more than one wave.
pub(super) fn plan(total: u64, largest: u64, sm_count: u32, resident_blocks: u32) -> Grid {
    let max_warps_per_block = u64::from(THREADS / 32);
    let pieces = (total / MIN_CHUNK).max(1);
    let warps_per_block = pieces
        .div_ceil(u64::from(sm_count.max(1)))
        .clamp(MIN_BLOCK_WARPS, max_warps_per_block);
    let blocks = pieces
        .div_ceil(warps_per_block)
        .clamp(1, u64::from(resident_blocks.max(1)));
    let warps = blocks * warps_per_block;
    let chunk = total
        .div_ceil(warps)
        .next_multiple_of(MIN_CHUNK)
        .clamp(MIN_CHUNK, MAX_CHUNK)
        .min(largest.next_multiple_of(16).max(16));
    Grid {
        blocks: blocks as u32,
        threads: (warps_per_block * 32) as u32,
        chunk,
    }
}
