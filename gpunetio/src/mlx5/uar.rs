//! A UAR doorbell page mapped into a GPU's address space (a leaf module of `mlx5`).

use crate::error::{Error, Result};
use gpu_mem::Gpu;

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
        if ptr.is_null()
            || len == 0
            || !(ptr as usize).is_multiple_of(4096)
            || !len.is_multiple_of(4096)
        {
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
