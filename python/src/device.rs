//! The GPU device API for Python: request and memory-view handles for kernels, the
//! signal helpers, and the device headers kernels include.
//!
//! A handle ([`GpuHandle`]) is the 40-byte kernel argument (`nixlGpuXferReqH` /
//! `nixlMemViewH`, [`RawGpuHandle`]) and what keeps it valid: the agent's
//! [`nixl::GpuXferReqH`] or [`nixl::MemViewH`]. Dropping that (explicitly, or when Python
//! collects the object) releases the handle: its slot's generation moves on, so a kernel
//! still holding the bytes gets `NIXL_ERR_INVALID_PARAM` instead of touching freed memory.

use crate::errors::{nixlInvalidParamError, IntoPyResult};
use nixl::device::RawGpuHandle;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Size of the kernel argument in bytes.
pub const RAW_SIZE: usize = std::mem::size_of::<RawGpuHandle>();
const _: () = assert!(RAW_SIZE == 40);

/// What a handle is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandleKind {
    /// `nixlGpuXferReqH`, from a transfer request.
    XferReq,
    /// `nixlMemViewH`, from a descriptor list.
    MemView,
}

impl HandleKind {
    fn name(self) -> &'static str {
        match self {
            Self::XferReq => "xfer_req",
            Self::MemView => "mem_view",
        }
    }
}

/// A device handle (NIXL's `nixlGpuXferReqH` or `nixlMemViewH`): the kernel argument's
/// bytes and fields, released explicitly or when collected.
// `weakref`: agents find their live handles by int without keeping them alive (the
// Python handle object is an `int` subclass, which cannot be weakly referenced itself).
#[pyclass(module = "rdma_nixl._core", frozen, weakref)]
pub struct GpuHandle {
    raw: RawGpuHandle,
    kind: HandleKind,
    /// What releases the handle when dropped; `None` once released.
    owner: Mutex<Option<Box<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for GpuHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuHandle")
            .field("raw", &self.raw)
            .field("kind", &self.kind)
            .field("released", &self.is_released())
            .finish()
    }
}

impl GpuHandle {
    pub(crate) fn new(
        raw: RawGpuHandle,
        kind: HandleKind,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        Self {
            raw,
            kind,
            owner: Mutex::new(Some(owner)),
        }
    }

    pub(crate) fn from_xfer_req(h: nixl::GpuXferReqH) -> Self {
        Self::new(h.raw(), HandleKind::XferReq, Box::new(h))
    }

    pub(crate) fn from_mem_view(h: nixl::MemViewH) -> Self {
        Self::new(h.raw(), HandleKind::MemView, Box::new(h))
    }

    fn is_released(&self) -> bool {
        self.owner.lock().is_none()
    }
}

/// The kernel argument's bytes: the `#[repr(C)]` layout of `nixl_gpu_handle`, little-endian
/// (the GPU's byte order).
pub fn raw_bytes(raw: &RawGpuHandle) -> [u8; RAW_SIZE] {
    let mut out = [0u8; RAW_SIZE];
    out[0..8].copy_from_slice(&raw.slot.to_le_bytes());
    out[8..16].copy_from_slice(&raw.generation.to_le_bytes());
    out[16..24].copy_from_slice(&raw.descs.to_le_bytes());
    out[24..32].copy_from_slice(&raw.qp.to_le_bytes());
    out[32..36].copy_from_slice(&raw.count.to_le_bytes());
    out[36..40].copy_from_slice(&raw.flags.to_le_bytes());
    out
}

#[pymethods]
impl GpuHandle {
    /// The kernel argument (40 bytes, passed by value).
    #[getter]
    fn raw<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &raw_bytes(&self.raw))
    }

    /// `"xfer_req"` or `"mem_view"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind.name()
    }

    /// Device address of the handle's generation word (unique among live handles).
    #[getter]
    fn slot(&self) -> u64 {
        self.raw.slot
    }

    /// The generation the handle was made with.
    #[getter]
    fn generation(&self) -> u64 {
        self.raw.generation
    }

    /// Device address of the descriptors.
    #[getter]
    fn descs(&self) -> u64 {
        self.raw.descs
    }

    /// Device address of the queue pair (0 for a view of local memory).
    #[getter]
    fn qp(&self) -> u64 {
        self.raw.qp
    }

    /// Number of descriptors (elements).
    #[getter]
    fn count(&self) -> u32 {
        self.raw.count
    }

    /// `NIXL_GPU_SLOT_*` and `NIXL_GPU_DIRECT`/`NIXL_GPU_SAME_DEVICE` bits.
    #[getter]
    fn flags(&self) -> u32 {
        self.raw.flags
    }

    /// Whether `release` was called.
    #[getter]
    fn released(&self) -> bool {
        self.is_released()
    }

    /// Releases the handle (idempotent): kernels using its bytes afterwards get
    /// `NIXL_ERR_INVALID_PARAM`. Must not run while a kernel that uses it still runs.
    fn release(&self, py: Python<'_>) {
        let taken = self.owner.lock().take();
        // Releasing writes the slot's generation on the GPU: without the GIL.
        py.detach(|| drop(taken));
    }
}

/// `getGpuSignalSize`: bytes of a signal word.
pub const GPU_SIGNAL_SIZE: usize = nixl::device::GPU_SIGNAL_SIZE;

/// Zeroes the signal word at device address `ptr` of GPU `dev` (NIXL's `prepGpuSignal`).
#[pyfunction]
pub fn prep_gpu_signal(py: Python<'_>, ptr: u64, dev: usize) -> PyResult<()> {
    let _cuda = crate::keep_cuda_context();
    if !ptr.is_multiple_of(8) {
        return Err(nixlInvalidParamError::new_err(format!(
            "signal word {ptr:#x} is not 8-byte aligned"
        )));
    }
    py.detach(|| gpu_signal(ptr, dev)).py_err()
}

#[cfg(feature = "cuda")]
fn open_gpu(dev: usize) -> nixl::Result<gpunetio::Gpu> {
    gpunetio::Gpu::open(dev).map_err(|e| nixl::Error::Gpu(format!("opening GPU {dev}: {e}")))
}

#[cfg(feature = "cuda")]
fn gpu_signal(ptr: u64, dev: usize) -> nixl::Result<()> {
    nixl::device::prep_gpu_signal(&open_gpu(dev)?, ptr)
}

#[cfg(not(feature = "cuda"))]
fn gpu_signal(_ptr: u64, _dev: usize) -> nixl::Result<()> {
    Err(nixl::Error::NotSupported {
        backend: "this build (no `cuda` feature)".into(),
        what: "GPU signals".into(),
    })
}

/// The virtual architecture of GPU `dev` for NVRTC, e.g. `"compute_90"`.
#[pyfunction]
pub fn gpu_arch(py: Python<'_>, dev: usize) -> PyResult<String> {
    let _cuda = crate::keep_cuda_context();
    py.detach(|| arch(dev)).py_err()
}

#[cfg(feature = "cuda")]
fn arch(dev: usize) -> nixl::Result<String> {
    let (major, minor) = open_gpu(dev)?
        .compute_capability()
        .map_err(|e| nixl::Error::Gpu(format!("reading the compute capability: {e}")))?;
    Ok(format!("compute_{major}{minor}"))
}

#[cfg(not(feature = "cuda"))]
fn arch(_dev: usize) -> nixl::Result<String> {
    Err(nixl::Error::NotSupported {
        backend: "this build (no `cuda` feature)".into(),
        what: "GPUs".into(),
    })
}

/// How many GPUs this process sees (0 without a CUDA driver or without the `cuda`
/// feature): lets the Python layer skip GPU-only backends without a failed creation.
#[pyfunction]
pub fn gpu_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        if gpunetio::gpu_mem::is_available() {
            return gpunetio::gpu_mem::device_count();
        }
    }
    0
}

/// Why the device API cannot be served behind NIXL's backend name `UCX` in this process
/// (`None`: it can): this build must have `GPUNETIO`, a GPU must be seen, and NVRTC
/// must load (the backend compiles its transfer kernel when it binds a GPU). What
/// `_bindings.HAVE_UCX_GPU_DEVICE_API` reports, and the reason an agent logs when it
/// cannot add the device path.
#[pyfunction]
pub fn device_api_unavailable() -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        use gpunetio::gpu_mem;
        if !gpu_mem::is_available() {
            return Some("no CUDA driver (libcuda) could be loaded".into());
        }
        if gpu_mem::device_count() == 0 {
            return Some("the CUDA driver sees no GPU".into());
        }
        if !gpu_mem::device_code::nvrtc_available() {
            return Some(
                "NVRTC (libnvrtc.so.13) does not load: GPUNETIO compiles its transfer kernel \
                 with it (install nvidia-cuda-nvrtc 13 and put its lib folder on \
                 LD_LIBRARY_PATH)"
                    .into(),
            );
        }
        None
    }
    #[cfg(not(feature = "cuda"))]
    {
        Some("this build has no GPUNETIO backend (no `cuda` feature)".into())
    }
}

/// The headers a kernel using the device API includes, by include name: the nixl
/// device API (`nixl/nixl_device.cuh`) and the gpunetio device library it includes.
pub fn headers() -> Vec<(&'static str, &'static str)> {
    let library: &[(&'static str, &'static str)] = {
        #[cfg(feature = "cuda")]
        {
            gpunetio::ffi::HEADERS
        }
        #[cfg(not(feature = "cuda"))]
        {
            &[]
        }
    };
    std::iter::once(nixl::device::HEADER)
        .chain(library.iter().copied())
        .collect()
}

/// Handles of [`_test_gpu_handle`] dropped so far.
static TEST_RELEASED: AtomicUsize = AtomicUsize::new(0);

struct TestOwner;

/// A GPU handle is released with the caller's CUDA context kept (see `Agent`'s `Drop`).
impl Drop for GpuHandle {
    fn drop(&mut self) {
        let _cuda = crate::keep_cuda_context();
        drop(self.owner.get_mut().take());
    }
}

impl Drop for TestOwner {
    fn drop(&mut self) {
        TEST_RELEASED.fetch_add(1, Ordering::SeqCst);
    }
}

/// For the test suite on machines without a GPU: a handle whose release only counts
/// (see [`_test_released`]), so the Python side's release paths can be checked.
#[pyfunction]
pub fn _test_gpu_handle(kind: &str, slot: u64) -> PyResult<GpuHandle> {
    let kind = match kind {
        "xfer_req" => HandleKind::XferReq,
        "mem_view" => HandleKind::MemView,
        other => {
            return Err(nixlInvalidParamError::new_err(format!(
                "unknown handle kind `{other}`"
            )))
        }
    };
    let raw = RawGpuHandle {
        slot,
        generation: 1,
        descs: 0x1000,
        qp: 0x2000,
        count: 3,
        flags: nixl::device::SLOT_VIEW,
    };
    Ok(GpuHandle::new(raw, kind, Box::new(TestOwner)))
}

/// How many [`_test_gpu_handle`] handles were released.
#[pyfunction]
pub fn _test_released() -> usize {
    TEST_RELEASED.load(Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_bytes_follow_the_c_layout() {
        let raw = RawGpuHandle {
            slot: 0x0102_0304_0506_0708,
            generation: 9,
            descs: 0x10,
            qp: 0x20,
            count: 0x30,
            flags: 0x40,
        };
        let b = raw_bytes(&raw);
        // SAFETY: RawGpuHandle is repr(C) plain integers without padding (40 bytes).
        let native: [u8; RAW_SIZE] = unsafe { std::mem::transmute(raw) };
        if cfg!(target_endian = "little") {
            assert_eq!(b, native);
        }
        assert_eq!(&b[0..8], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&b[32..36], &0x30u32.to_le_bytes());
        assert_eq!(&b[36..40], &0x40u32.to_le_bytes());
    }
}
