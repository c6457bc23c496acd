//! The native mlx5 NIC handler (`GIO_NIC_HANDLER_MLX5`, DOCA GPUNetIO's `GPU_SM_DB` /
//! `GPU_SM_BF`): kernels build ConnectX send WQEs in a GPU-resident send queue, ring
//! the doorbell through a UAR page mapped into the GPU, and poll CQEs themselves
//! (`gpunetio/gio_mlx5.cuh`, dispatched from the high-level calls of
//! `gpunetio/gio_device.cuh`).
//!
//! This module holds the host half:
//! - [`wqe`]: the WQE encoder (ctrl, remote-address, data, inline and atomic segments;
//!   [`wqe::SendQueue`] indexing, doorbell record and doorbell value) — the reference the
//!   GPU-built bytes are compared with, and what a CPU would post;
//! - [`cqe`]: CQE parsing (owner bit, opcode, WQE counter, error syndromes as
//!   [`cqe::CqeErrorKind`]), synthetic CQEs, [`cqe::CompletionQueue`];
//! - [`probe`]: whether an mlx5 device with DEVX is present ([`crate::Error::Unsupported`]
//!   naming why not);
//! - [`UarMapping`]: a UAR doorbell page registered as I/O memory for the GPU
//!   (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_IOMEMORY`, as DOCA's
//!   `doca_gpu_verbs_export_uar`).
//!
//! - [`prm`]: PRM command mailboxes (CREATE_CQ, CREATE_QP, RST2INIT / INIT2RTR / RTR2RTS,
//!   QUERY_HCA_CAP) built by an `MLX5_SET`-style bit-field encoder;
//! - [`devx`] (feature `mlx5`): the DEVX context, UAR, DMA-BUF umems and firmware objects;
//! - [`Mlx5QueuePair`] (feature `mlx5`): the queue pair itself on GPU-resident queues,
//!   connected through DEVX modify commands and exported to kernels;
//! - [`export`]: filling `gio_mlx5_qp` and `gio_dev_qp` for any queue laid out the way a
//!   ConnectX reads it ([`export::QueueLayout`]).
//!
//! # What runs without a ConnectX
//! Everything but the DEVX calls: encoders, the CQE parser, the export and the device
//! code are tested on the GPU against an emulated NIC (`tests/gpu_mlx5_emulated.rs`).
//! Creating the DEVX objects and ringing doorbells on silicon needs a ConnectX with
//! DEVX; elsewhere [`probe`] and [`DevxContext::open`] return [`Error::Unsupported`].

pub mod cqe;
#[cfg(feature = "mlx5")]
pub mod devx;
pub mod export;
pub mod prm;
#[cfg(feature = "mlx5")]
mod queue_pair;
pub mod wqe;

#[cfg(feature = "mlx5")]
pub use devx::DevxContext;
pub use export::{ExportedMlx5QueuePair, Mlx5DeviceState};
#[cfg(feature = "mlx5")]
pub use queue_pair::{queue_offsets, Mlx5Options, Mlx5QueuePair, QpState, QueueOffsets};

use crate::error::{Error, Result};
use gpu_mem::Gpu;

/// An mlx5 RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mlx5Device {
    /// The verbs device name (`mlx5_0`).
    pub name: String,
    /// Whether a DEVX context opens on it (`mlx5dv_open_device` with
    /// `MLX5DV_CONTEXT_FLAGS_DEVX`): needed to create GPU-resident queues.
    pub devx: bool,
}

/// Every verbs device, with whether it is an mlx5 device (`mlx5dv_is_supported`) and
/// then whether DEVX opens on it; non-mlx5 devices are listed with `None`.
#[cfg(feature = "mlx5")]
#[doc(alias = "mlx5dv_is_supported")]
pub fn devices() -> Result<Vec<(String, Option<Mlx5Device>)>> {
    use mlx5dv_sys as dv;
    let list = ibverbs::devices().map_err(|source| Error::Verbs {
        context: "listing RDMA devices".into(),
        source,
    })?;
    let mut out = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        // SAFETY: a device of a live list.
        let is_mlx5 = unsafe { dv::mlx5dv_is_supported(dev.as_raw()) };
        if !is_mlx5 {
            out.push((name, None));
            continue;
        }
        let mut attr = dv::mlx5dv_context_attr {
            flags: dv::MLX5DV_CONTEXT_FLAGS_DEVX,
            comp_mask: 0,
        };
        // SAFETY: a device of a live list and a valid attribute struct.
        let ctx = unsafe { dv::mlx5dv_open_device(dev.as_raw(), &mut attr) };
        let devx = !ctx.is_null();
        if devx {
            // SAFETY: opened just above, closed once.
            let r = unsafe { dv::ibverbs_sys::ibv_close_device(ctx) };
            if r != 0 {
                tracing::warn!("ibv_close_device({name}) after the DEVX probe: {r}");
            }
        }
        out.push((name.clone(), Some(Mlx5Device { name, devx })));
    }
    Ok(out)
}

/// The first mlx5 device that opens with DEVX, or [`Error::Unsupported`] saying why the
/// native mlx5 handler cannot run here (no RDMA device, no mlx5 device, no DEVX).
pub fn probe() -> Result<Mlx5Device> {
    #[cfg(feature = "mlx5")]
    {
        let all = devices()?;
        if all.is_empty() {
            return Err(Error::Unsupported(
                "native mlx5 handler: no RDMA device on this machine".into(),
            ));
        }
        let mut mlx5_without_devx = Vec::new();
        for (_, dev) in &all {
            match dev {
                Some(d) if d.devx => return Ok(d.clone()),
                Some(d) => mlx5_without_devx.push(d.name.clone()),
                None => {}
            }
        }
        let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
        if mlx5_without_devx.is_empty() {
            Err(Error::Unsupported(format!(
                "native mlx5 handler: no mlx5 (ConnectX) device among {names:?}"
            )))
        } else {
            Err(Error::Unsupported(format!(
                "native mlx5 handler: DEVX does not open on {mlx5_without_devx:?} (kernel without DEVX, or missing permissions)"
            )))
        }
    }
    #[cfg(not(feature = "mlx5"))]
    {
        Err(Error::Unsupported(
            "native mlx5 handler: gpunetio was built without the `mlx5` feature".into(),
        ))
    }
}

/// A NIC register page (a UAR's doorbell / BlueFlame registers) mapped into a GPU's
/// address space as I/O memory, so kernels can ring doorbells with MMIO stores
/// (DOCA: `doca_gpu_verbs_export_uar`). Unregistered on drop.
#[derive(Debug)]
pub struct UarMapping {
    gpu: Gpu,
    host: *mut std::ffi::c_void,
    len: usize,
    device_ptr: u64,
}

// SAFETY: only addresses are held; unregistering is allowed from any thread.
unsafe impl Send for UarMapping {}
// SAFETY: no method mutates through `&self`.
unsafe impl Sync for UarMapping {}

impl UarMapping {
    /// Registers `[ptr, ptr + len)` (page aligned: a UAR's `base_addr` and page size) with
    /// `CU_MEMHOSTREGISTER_IOMEMORY | PORTABLE | DEVICEMAP`. The driver refuses it where
    /// the platform cannot map PCIe BARs for the GPU; that error is returned as is.
    ///
    /// # Safety
    /// `ptr` must be a mapping of device registers (or memory) that stays mapped until
    /// this value is dropped.
    #[doc(alias = "cuMemHostRegister")]
    pub unsafe fn register(gpu: &Gpu, ptr: *mut u8, len: usize) -> Result<Self> {
        use cudarc::driver::sys;
        if ptr.is_null() || len == 0 || (ptr as usize) % 4096 != 0 || len % 4096 != 0 {
            return Err(Error::InvalidArgument(format!(
                "UAR registration of {ptr:p}+{len}: a non-empty page-aligned range is needed"
            )));
        }
        gpu.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE
            | sys::CU_MEMHOSTREGISTER_DEVICEMAP
            | sys::CU_MEMHOSTREGISTER_IOMEMORY;
        // SAFETY: the caller guarantees the range stays mapped.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) };
        gpu_mem::cvt_ctx("cuMemHostRegister", r, || {
            format!("UAR {ptr:p}+{len} as I/O memory")
        })?;
        let mut device_ptr = 0;
        // SAFETY: valid out-pointer; the range was registered device-mapped above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, ptr.cast(), 0) };
        if let Err(e) = gpu_mem::cvt("cuMemHostGetDevicePointer", r) {
            // SAFETY: registered above, unregistered once.
            let u = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
            if u != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!("cuMemHostUnregister({ptr:p}): {u:?}");
            }
            return Err(e.into());
        }
        Ok(Self {
            gpu: gpu.clone(),
            host: ptr.cast(),
            len,
            device_ptr,
        })
    }

    /// Where kernels address the registers (`gio_mlx5_qp.db` is inside this range).
    pub fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    /// The registered length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for UarMapping {
    fn drop(&mut self) {
        let result = self.gpu.bind().and_then(|()| {
            // SAFETY: registered by `register`, unregistered once.
            gpu_mem::cvt("cuMemHostUnregister", unsafe {
                cudarc::driver::sys::cuMemHostUnregister(self.host)
            })
        });
        if let Err(e) = result {
            tracing::warn!("UAR mapping {:p}: {e}", self.host);
        }
    }
}
