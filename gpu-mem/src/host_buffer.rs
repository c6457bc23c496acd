//! Pinned host memory: allocated (`cuMemHostAlloc`, portable and mapped, DOCA's
//! `DOCA_GPU_MEM_TYPE_CPU_GPU`) or registered in place (`cuMemHostRegister`), each with the
//! device pointer a kernel uses to reach it.

use crate::error::{cvt, cvt_ctx, Error, Result};
use crate::gpu::Gpu;
use cudarc::driver::sys;
use std::ffi::c_void;

const FLAGS_ALLOC: u32 = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
const FLAGS_REGISTER: u32 = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;

/// Pinned, portable (every context sees it pinned), device-mapped host memory; freed on
/// drop. Zeroed at allocation.
#[derive(Debug)]
pub struct HostBuffer {
    gpu: Gpu,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; the driver allows freeing it
// from any thread (portable allocation), and `&HostBuffer` only hands out `&[u8]`.
unsafe impl Send for HostBuffer {}
// SAFETY: as above; mutation needs `&mut`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// `len` bytes of pinned host memory.
    #[doc(alias = "cuMemHostAlloc")]
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("a host buffer of 0 bytes".into()));
        }
        gpu.bind()?;
        let mut ptr = std::ptr::null_mut();
        cvt_ctx(
            "cuMemHostAlloc",
            // SAFETY: `ptr` is a valid out-pointer.
            unsafe { sys::cuMemHostAlloc(&mut ptr, len, FLAGS_ALLOC) },
            || format!("{len} bytes"),
        )?;
        // SAFETY: the driver returned `len` writable bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, len) };
        Ok(Self {
            gpu: gpu.clone(),
            ptr: ptr.cast(),
            len,
        })
    }

    /// The host address.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The host address, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes owned by this value, initialised at allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The address kernels use to reach this memory.
    pub fn device_ptr(&self) -> Result<u64> {
        device_ptr_of(&self.gpu, self.ptr.cast())
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let result = self.gpu.bind().and_then(|()| {
            // SAFETY: allocated by cuMemHostAlloc, freed once.
            cvt("cuMemFreeHost", unsafe {
                sys::cuMemFreeHost(self.ptr.cast())
            })
        });
        if let Err(e) = result {
            tracing::warn!("host buffer {:p}: {e}", self.ptr);
        }
    }
}

/// Existing host memory pinned in place; unpinned on drop.
#[derive(Debug)]
pub struct HostRegistration {
    gpu: Gpu,
    ptr: *mut c_void,
    len: usize,
    /// False when the range was already pinned by someone else (we then unpin nothing).
    owned: bool,
}

// SAFETY: only addresses are held; unregistering is allowed from any thread.
unsafe impl Send for HostRegistration {}
// SAFETY: no method mutates through `&self`.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Pins `[ptr, ptr + len)` (portable, device-mapped). Memory that is already pinned
    /// (by `cuMemHostAlloc` or another registration) is accepted and left as it is.
    ///
    /// # Safety
    /// The range must be valid host memory that stays allocated until this value is
    /// dropped.
    #[doc(alias = "cuMemHostRegister")]
    pub unsafe fn register(gpu: &Gpu, ptr: *mut u8, len: usize) -> Result<Self> {
        if len == 0 || ptr.is_null() {
            return Err(Error::InvalidArgument(
                "host registration of a null or empty range".into(),
            ));
        }
        gpu.bind()?;
        // SAFETY: the caller guarantees the range is valid host memory.
        let result = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, FLAGS_REGISTER) };
        let owned = match result {
            sys::CUresult::CUDA_SUCCESS => true,
            sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => false,
            other => {
                return Err(Error::Driver {
                    call: "cuMemHostRegister",
                    code: cudarc::driver::DriverError(other),
                    context: Some(format!("{ptr:p}+{len}")),
                })
            }
        };
        Ok(Self {
            gpu: gpu.clone(),
            ptr: ptr.cast(),
            len,
            owned,
        })
    }

    /// The host address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.cast()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this registration pinned the range (false: it was pinned already).
    pub fn pinned_here(&self) -> bool {
        self.owned
    }

    /// The address kernels use to reach this memory.
    pub fn device_ptr(&self) -> Result<u64> {
        device_ptr_of(&self.gpu, self.ptr)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let result = self.gpu.bind().and_then(|()| {
            // SAFETY: registered by `register`, unregistered once.
            cvt("cuMemHostUnregister", unsafe {
                sys::cuMemHostUnregister(self.ptr)
            })
        });
        if let Err(e) = result {
            tracing::warn!("host registration {:p}: {e}", self.ptr);
        }
    }
}

fn device_ptr_of(gpu: &Gpu, ptr: *mut c_void) -> Result<u64> {
    gpu.bind()?;
    let mut dptr = 0;
    // SAFETY: valid out-pointer; `ptr` is pinned, mapped memory.
    cvt("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr, 0)
    })?;
    Ok(dptr)
}
