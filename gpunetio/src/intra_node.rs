//! The `IntraNode` NIC handler: queue pairs whose peer memory is mapped into this GPU's
//! address space through CUDA IPC, so a put is a copy by the calling thread or warp and
//! a signal a system-scope atomic add; no CPU is on the path.
//!
//! Build the memory table (local buffers, the peer's mapped buffers), then
//! [`IntraNodeQueuePair::export`] it: the returned [`ExportedQueuePair`] owns the device
//! copy of the `gio_dev_qp` a kernel takes as its argument, and keeps every region it
//! names mapped until it is dropped.

use crate::error::{Error, Result};
use gpu_mem::{DeviceBuffer, Gpu, IpcMapping};
use gpunetio_sys as ffi;
use std::any::Any;
use std::sync::Arc;

/// Something that must outlive the regions a table names (a buffer, a mapping).
type Keep = Arc<dyn Any + Send + Sync>;

/// The memory table and counters of an intra-node queue pair, before export.
#[derive(Debug)]
pub struct IntraNodeQueuePair {
    gpu: Gpu,
    mrs: Vec<ffi::gio_dev_mr>,
    keep: Vec<KeepDebug>,
    num_counters: u32,
    timeout_ns: u64,
    /// Every peer region lives in this GPU's own memory (GPU-scope ordering suffices).
    peers_on_this_gpu: bool,
}

/// `Keep` with a `Debug` the table can print.
struct KeepDebug(#[allow(dead_code)] Keep);

impl std::fmt::Debug for KeepDebug {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<kept alive>")
    }
}

/// Most regions in one table (indices are 16 bits in ring entries).
pub const MAX_REGIONS: usize = u16::MAX as usize;

impl IntraNodeQueuePair {
    /// An empty table on `gpu`, with `num_counters` completion counters and every
    /// device-side wait bounded by `timeout` (zero: unbounded).
    pub fn new(gpu: &Gpu, num_counters: u32, timeout: std::time::Duration) -> Self {
        Self {
            gpu: gpu.clone(),
            mrs: Vec::new(),
            keep: Vec::new(),
            num_counters,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            peers_on_this_gpu: true,
        }
    }

    fn push(&mut self, addr: u64, len: u64, flags: u32, keep: Keep) -> Result<u32> {
        if self.mrs.len() >= MAX_REGIONS {
            return Err(Error::InvalidArgument(format!(
                "a queue pair's memory table holds at most {MAX_REGIONS} regions"
            )));
        }
        let index = self.mrs.len() as u32;
        self.mrs.push(ffi::gio_dev_mr {
            addr,
            length: len,
            flags,
            index,
            reserved: 0,
        });
        self.keep.push(KeepDebug(keep));
        Ok(index)
    }

    /// Adds a local buffer (a source of puts, a destination of gets); returns its index.
    pub fn register_local(&mut self, buf: &Arc<DeviceBuffer>) -> Result<u32> {
        self.check_gpu(buf.gpu())?;
        self.push(buf.ptr(), buf.len() as u64, ffi::GIO_MR_MAPPED, buf.clone())
    }

    /// Adds the peer's buffer, mapped here through CUDA IPC (into this queue pair's GPU:
    /// [`IpcMapping::open`] with it); returns its index. Memory of another GPU needs peer
    /// access from this GPU, enabled here (a pair without it is refused).
    pub fn add_remote(&mut self, mapping: &Arc<IpcMapping>) -> Result<u32> {
        self.check_gpu(mapping.gpu())?;
        // Memory of a peer GPU mapped here needs system-scope ordering and atomics; the
        // driver says where the allocation lives.
        let info = gpu_mem::pointer_info(mapping.ptr())?;
        self.reach(&info)?;
        self.peers_on_this_gpu &= info.device == Some(self.gpu.ordinal());
        self.push(
            mapping.ptr(),
            mapping.len(),
            ffi::GIO_MR_MAPPED | ffi::GIO_MR_REMOTE,
            mapping.clone(),
        )
    }

    /// Adds a buffer of this process as if it were the peer's (both sides of a test, or
    /// two kernels of one process exchanging through the device library).
    pub fn add_remote_local(&mut self, buf: &Arc<DeviceBuffer>) -> Result<u32> {
        self.check_gpu(buf.gpu())?;
        self.push(
            buf.ptr(),
            buf.len() as u64,
            ffi::GIO_MR_MAPPED | ffi::GIO_MR_REMOTE,
            buf.clone(),
        )
    }

    /// Adds `len` bytes at `addr`, memory this GPU can address (device memory of this
    /// GPU, mapped pinned host memory, a range inside a peer's IPC mapping), as a local
    /// region (`remote` false: a put's source, a get's destination) or a peer's region;
    /// `keep` is held until the exported queue pair is dropped. Returns its index. Device
    /// memory of another GPU needs peer access from this GPU, enabled here (a pair
    /// without it is refused).
    ///
    /// # Safety
    /// The range must stay addressable by this GPU for as long as `keep` lives (kernels
    /// using the exported queue pair read and write it).
    pub unsafe fn add_range(
        &mut self,
        addr: u64,
        len: u64,
        remote: bool,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Result<u32> {
        if addr.checked_add(len).is_none() {
            return Err(Error::InvalidArgument(format!(
                "range {addr:#x}+{len} wraps the address space"
            )));
        }
        let info = gpu_mem::pointer_info(addr)?;
        if info.kind == gpu_mem::MemoryKind::Host {
            return Err(Error::InvalidArgument(format!(
                "{addr:#x} is pageable host memory, which a kernel cannot address: pin it first"
            )));
        }
        self.reach(&info)?;
        if remote {
            self.peers_on_this_gpu &= matches!(info.kind, gpu_mem::MemoryKind::Device)
                && info.device == Some(self.gpu.ordinal());
        }
        let flags = if remote {
            ffi::GIO_MR_MAPPED | ffi::GIO_MR_REMOTE
        } else {
            ffi::GIO_MR_MAPPED
        };
        self.push(addr, len, flags, keep)
    }

    /// Makes device memory of another GPU reachable by this GPU's kernels (peer access
    /// enabled toward its GPU; idempotent), or refuses it: a kernel must never be handed
    /// an address it would fault on.
    fn reach(&self, info: &gpu_mem::PointerInfo) -> Result<()> {
        let home = match (info.kind, info.device) {
            (gpu_mem::MemoryKind::Device, Some(home)) if home != self.gpu.ordinal() => home,
            _ => return Ok(()),
        };
        let home_gpu = Gpu::open(home)?;
        gpu_mem::enable_peer_access(&self.gpu, &home_gpu).map_err(|e| match e {
            gpu_mem::Error::NoPeerAccess { from, to } => Error::InvalidArgument(format!(
                "memory of GPU {to} in a queue pair of GPU {from}: the pair has no peer access, so its kernels cannot reach it"
            )),
            other => other.into(),
        })
    }

    fn check_gpu(&self, gpu: &Gpu) -> Result<()> {
        if gpu.ordinal() != self.gpu.ordinal() {
            return Err(Error::InvalidArgument(format!(
                "memory of GPU {} in a queue pair of GPU {}",
                gpu.ordinal(),
                self.gpu.ordinal()
            )));
        }
        Ok(())
    }

    /// Copies the table, the counters and the queue pair to device memory.
    pub fn export(self) -> Result<ExportedQueuePair> {
        let bytes_of = |n: usize| n.max(1);
        let mrs_bytes = std::mem::size_of::<ffi::gio_dev_mr>() * self.mrs.len();
        let mrs = DeviceBuffer::alloc(&self.gpu, bytes_of(mrs_bytes))?;
        // SAFETY: gio_dev_mr is plain old data (repr(C) integers); viewing the vector's
        // initialized elements as bytes is sound.
        let table =
            unsafe { std::slice::from_raw_parts(self.mrs.as_ptr().cast::<u8>(), mrs_bytes) };
        mrs.copy_from_host(0, table)?;
        let counters = DeviceBuffer::alloc(&self.gpu, bytes_of(8 * self.num_counters as usize))?;
        counters.fill(0)?;
        let state = DeviceBuffer::alloc(&self.gpu, std::mem::size_of::<ffi::gio_ring_dev_state>())?;
        state.fill(0)?;
        let dev = ffi::gio_dev_qp {
            nic_handler: ffi::GIO_NIC_HANDLER_INTRA_NODE,
            num_mrs: self.mrs.len() as u32,
            state: state.ptr(),
            mrs: mrs.ptr(),
            counters: counters.ptr(),
            num_counters: self.num_counters,
            timeout_ns: self.timeout_ns,
            flags: if self.peers_on_this_gpu {
                ffi::GIO_QP_SAME_DEVICE
            } else {
                0
            },
            ..ffi::gio_dev_qp::default()
        };
        let qp = DeviceBuffer::alloc(&self.gpu, std::mem::size_of::<ffi::gio_dev_qp>())?;
        // SAFETY: as above, a repr(C) struct of integers and byte arrays.
        let qp_bytes = unsafe {
            std::slice::from_raw_parts(
                (&dev as *const ffi::gio_dev_qp).cast::<u8>(),
                std::mem::size_of::<ffi::gio_dev_qp>(),
            )
        };
        qp.copy_from_host(0, qp_bytes)?;
        Ok(ExportedQueuePair {
            qp,
            _mrs: mrs,
            counters,
            _state: state,
            num_counters: self.num_counters,
            peers_on_this_gpu: self.peers_on_this_gpu,
            _keep: self.keep,
        })
    }
}

/// An exported intra-node queue pair: [`ExportedQueuePair::device_ptr`] is the kernel
/// argument (`gio_dev_qp *`). Dropping it frees the device copies and lets go of the
/// regions; no kernel may still use it then.
#[derive(Debug)]
pub struct ExportedQueuePair {
    qp: DeviceBuffer,
    _mrs: DeviceBuffer,
    counters: DeviceBuffer,
    _state: DeviceBuffer,
    num_counters: u32,
    peers_on_this_gpu: bool,
    _keep: Vec<KeepDebug>,
}

impl ExportedQueuePair {
    /// The device address of the `gio_dev_qp`, to pass to a kernel.
    pub fn device_ptr(&self) -> u64 {
        self.qp.ptr()
    }

    /// Whether every region is on this queue pair's GPU (then GPU-scope ordering and
    /// atomics reach the peer; `GIO_QP_SAME_DEVICE`).
    pub fn peers_on_this_gpu(&self) -> bool {
        self.peers_on_this_gpu
    }

    /// Completion counter `index` (read from device memory; synchronous).
    pub fn counter(&self, index: u32) -> Result<u64> {
        if index >= self.num_counters {
            return Err(Error::InvalidArgument(format!(
                "counter {index} of a queue pair with {}",
                self.num_counters
            )));
        }
        let mut v = [0u8; 8];
        self.counters.copy_to_host(8 * index as usize, &mut v)?;
        Ok(u64::from_le_bytes(v))
    }
}
