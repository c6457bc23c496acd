//! GPUs: discovery, opening by ordinal or PCI bus id, and the attributes that decide how
//! memory can be shared (DOCA's `doca_gpu_create`).

use crate::error::{cvt, cvt_ctx, from_driver, Error, Result};
use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{CudaContext, CudaStream};
use std::ffi::{CStr, CString};
use std::sync::{Arc, OnceLock};

/// Whether a CUDA driver can be loaded and initialised on this machine (it may still
/// have no GPU: see [`device_count`]).
pub fn is_available() -> bool {
    driver().is_ok()
}

/// Loads and initialises the driver once; every entry point calls this first, so that a
/// machine without CUDA gets [`Error::NoDriver`] instead of a panic from the loader.
pub(crate) fn driver() -> Result<()> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    let state = INIT.get_or_init(|| {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(String::new());
        }
        // SAFETY: cuInit takes no pointers; flags must be 0.
        unsafe { sys::cuInit(0) }
            .result()
            .map_err(|e| format!("{e:?}"))
    });
    match state {
        Ok(()) => Ok(()),
        Err(msg) if msg.is_empty() => Err(Error::NoDriver),
        Err(msg) => Err(Error::Unsupported(format!("cuInit failed: {msg}"))),
    }
}

/// The calling thread's current CUDA context, made current again when this is dropped.
///
/// Calls into this stack bind the contexts of the GPUs they use to the calling thread; a
/// caller that works on one GPU through the CUDA runtime (torch, CuPy: the runtime's
/// current device follows the current context) must find its own device current
/// afterwards. Without a CUDA driver it holds nothing.
#[derive(Debug)]
pub struct ContextScope {
    saved: Option<sys::CUcontext>,
}

impl ContextScope {
    /// Remembers the current context (none is remembered where no driver loads).
    pub fn save() -> Self {
        if driver().is_err() {
            return Self { saved: None };
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a live out-pointer; a thread without a context gets null.
        let saved = unsafe { sys::cuCtxGetCurrent(&mut ctx) }
            .result()
            .ok()
            .map(|()| ctx);
        Self { saved }
    }
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        if let Some(ctx) = self.saved {
            // SAFETY: `ctx` was current on this thread (or null, which unbinds); a
            // context destroyed meanwhile makes this fail, which changes nothing.
            let _ = unsafe { sys::cuCtxSetCurrent(ctx) };
        }
    }
}

/// Number of GPUs the driver sees (0 without a driver).
pub fn device_count() -> usize {
    if driver().is_err() {
        return 0;
    }
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer.
    match unsafe { sys::cuDeviceGetCount(&mut n) }.result() {
        Ok(()) => usize::try_from(n).unwrap_or(0),
        Err(_) => 0,
    }
}

/// One GPU, with its primary context retained (cudarc's [`CudaContext`]). Cheap to clone.
#[derive(Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ordinal())
            .finish()
    }
}

impl Gpu {
    /// Opens GPU `ordinal` (as CUDA numbers them in this process).
    #[doc(alias = "doca_gpu_create")]
    pub fn open(ordinal: usize) -> Result<Self> {
        driver()?;
        if ordinal >= device_count() {
            return Err(Error::NoSuchGpu(format!(
                "{ordinal} (this process sees {} GPUs)",
                device_count()
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(from_driver("cuDevicePrimaryCtxRetain"))?;
        Ok(Self { ctx })
    }

    /// Opens the GPU at a PCI bus id, as DOCA takes it: `"8A:00.0"`, `"0000:8a:00.0"`.
    #[doc(alias = "doca_gpu_create")]
    pub fn open_pci(bus_id: &str) -> Result<Self> {
        driver()?;
        let c = CString::new(bus_id)
            .map_err(|_| Error::InvalidArgument(format!("PCI bus id {bus_id:?} contains NUL")))?;
        let mut dev = 0;
        // SAFETY: `c` is NUL-terminated, `dev` a valid out-pointer.
        match unsafe { sys::cuDeviceGetByPCIBusId(&mut dev, c.as_ptr()) } {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_INVALID_DEVICE | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                return Err(Error::NoSuchGpu(format!("at PCI bus id {bus_id}")))
            }
            other => cvt("cuDeviceGetByPCIBusId", other)?,
        }
        Self::open(usize::try_from(dev).map_err(|_| Error::NoSuchGpu(bus_id.to_string()))?)
    }

    /// Every GPU of this process.
    pub fn all() -> Result<Vec<Self>> {
        (0..device_count()).map(Self::open).collect()
    }

    /// Wraps a context cudarc already made.
    pub fn from_context(ctx: Arc<CudaContext>) -> Self {
        Self { ctx }
    }

    /// cudarc's context (for streams, kernels, cudarc's own allocations).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes this GPU's context current on the calling thread (every raw driver call of
    /// this crate does it first).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(from_driver("cuCtxSetCurrent"))
    }

    /// A new stream on this GPU.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(from_driver("cuStreamCreate"))
    }

    /// The device name (`"NVIDIA H100 80GB HBM3"`).
    pub fn name(&self) -> Result<String> {
        self.ctx.name().map_err(from_driver("cuDeviceGetName"))
    }

    /// The 16-byte UUID: the same GPU has the same UUID in every process, whatever
    /// `CUDA_VISIBLE_DEVICES` says.
    pub fn uuid(&self) -> Result<[u8; 16]> {
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: `uuid` is a valid out-pointer; the device handle comes from cudarc.
        cvt("cuDeviceGetUuid", unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, self.ctx.cu_device())
        })?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// The UUID as `nvidia-smi` prints it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
    pub fn uuid_string(&self) -> Result<String> {
        Ok(format_uuid(&self.uuid()?))
    }

    /// The PCI bus id (`"0000:8A:00.0"`), for topology.
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer is 32 bytes and its length is passed.
        cvt("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.ctx.cu_device())
        })?;
        // SAFETY: the driver NUL-terminates within the given length.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        self.ctx
            .compute_capability()
            .map_err(from_driver("cuDeviceGetAttribute"))
    }

    /// Device memory in bytes.
    pub fn total_mem(&self) -> Result<usize> {
        self.ctx
            .total_mem()
            .map_err(from_driver("cuDeviceTotalMem"))
    }

    /// A raw device attribute.
    pub fn attribute(&self, attr: CUdevice_attribute) -> Result<i32> {
        let mut value = 0;
        cvt_ctx(
            "cuDeviceGetAttribute",
            // SAFETY: `value` is a valid out-pointer.
            unsafe { sys::cuDeviceGetAttribute(&mut value, attr, self.ctx.cu_device()) },
            || format!("{attr:?}"),
        )?;
        Ok(value)
    }

    /// Whether device memory can be exported as a DMA-BUF fd (for NIC registration with
    /// `ibv_reg_dmabuf_mr`).
    pub fn dmabuf_supported(&self) -> bool {
        self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
            .is_ok_and(|v| v != 0)
    }

    /// Whether the device supports GPUDirect RDMA (a NIC reading and writing its memory).
    pub fn gpudirect_rdma_supported(&self) -> bool {
        self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)
            .is_ok_and(|v| v != 0)
    }

    /// Whether the virtual memory management API (`cuMemCreate`) is supported.
    pub fn vmm_supported(&self) -> bool {
        self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)
            .is_ok_and(|v| v != 0)
    }

    /// Whether VMM allocations can be exported as POSIX file descriptors.
    pub fn posix_fd_supported(&self) -> bool {
        self.attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )
        .is_ok_and(|v| v != 0)
    }

    /// Whether this GPU can access `other`'s memory directly (NVLink or PCIe P2P).
    pub fn can_access_peer(&self, other: &Gpu) -> Result<bool> {
        if self.ordinal() == other.ordinal() {
            return Ok(true);
        }
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer; both device handles come from cudarc.
        cvt("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut v, self.ctx.cu_device(), other.ctx.cu_device())
        })?;
        Ok(v != 0)
    }
}

/// Formats a UUID as `nvidia-smi` does.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// The GPU of this process with that UUID, if it sees one.
pub fn find_by_uuid(uuid: &[u8; 16]) -> Result<Option<Gpu>> {
    for ordinal in 0..device_count() {
        let gpu = Gpu::open(ordinal)?;
        if &gpu.uuid()? == uuid {
            return Ok(Some(gpu));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_format_matches_nvidia_smi() {
        let u: [u8; 16] = [
            0x8a, 0x2f, 0x1e, 0x00, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x02,
            0x03, 0x04,
        ];
        assert_eq!(format_uuid(&u), "GPU-8a2f1e00-1234-5678-9abc-def001020304");
    }
}
