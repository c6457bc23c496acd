//! Exportable device memory (DOCA's `doca_gpu_mem_alloc` with `DOCA_GPU_MEM_TYPE_GPU`).
//!
//! Never cudarc's stream-ordered pool: pool memory cannot be exported as an IPC handle
//! or a DMA-BUF fd (the driver answers `CUDA_ERROR_INVALID_VALUE`), so it could not
//! reach a peer process or a NIC. Two allocators instead:
//! - [`DeviceBuffer::alloc`]: `cuMemAlloc`, exportable as a CUDA-IPC handle and DMA-BUF;
//! - [`DeviceBuffer::alloc_vmm`]: `cuMemCreate` with a POSIX-fd handle type, exportable
//!   as a file descriptor (passed over a Unix socket) and DMA-BUF.

use crate::error::{cvt, cvt_ctx, Error, Result};
use crate::gpu::Gpu;
use crate::ipc::{IpcHandle, VmmExport};
use crate::vmm::{map_vmm, round_up, unmap_vmm, vmm_granularity, vmm_prop};
use cudarc::driver::sys::{self, CUmemGenericAllocationHandle};
use std::os::fd::{FromRawFd, OwnedFd};

/// Alignment every [`DeviceBuffer`] start has at least.
pub const DEVICE_BUFFER_ALIGN: u64 = 256;
const HOST_PAGE: u64 = 4096;

#[derive(Debug)]
enum Backing {
    /// `cuMemAlloc` of `size` bytes.
    Plain { size: usize },
    /// `cuMemCreate` handle mapped at `ptr` over `size` (granularity-rounded) bytes.
    Vmm {
        handle: CUmemGenericAllocationHandle,
        size: usize,
    },
}

/// Device memory this crate allocated and frees on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    gpu: Gpu,
    ptr: u64,
    len: usize,
    backing: Backing,
}

/// A DMA-BUF file descriptor covering a device buffer, as `ibv_reg_dmabuf_mr` takes it:
/// register `len` bytes at `offset` of `fd`.
#[derive(Debug)]
pub struct DmaBuf {
    /// The DMA-BUF file descriptor (closed on drop).
    pub fd: OwnedFd,
    /// Where the buffer starts inside the exported range.
    pub offset: u64,
    /// The buffer's length.
    pub len: u64,
    /// Device address of the exported range's start (page aligned).
    pub range_start: u64,
    /// Length of the exported range (page multiple).
    pub range_len: u64,
}

impl DeviceBuffer {
    /// `len` bytes of `cuMemAlloc` memory (IPC- and DMA-BUF-exportable).
    #[doc(alias = "doca_gpu_mem_alloc")]
    #[doc(alias = "cuMemAlloc")]
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("a device buffer of 0 bytes".into()));
        }
        gpu.bind()?;
        // Whole host pages, so that a DMA-BUF export of the buffer never spans into a
        // neighbouring allocation.
        let size = round_up(len as u64, HOST_PAGE) as usize;
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the GPU's context is current.
        let result = unsafe { sys::cuMemAlloc_v2(&mut ptr, size) };
        cvt_ctx("cuMemAlloc", result, || {
            format!("{size} bytes on GPU {}", gpu.ordinal())
        })?;
        Ok(Self {
            gpu: gpu.clone(),
            ptr,
            len,
            backing: Backing::Plain { size },
        })
    }

    /// `len` bytes of VMM memory (`cuMemCreate`, POSIX-fd exportable, GPUDirect-RDMA
    /// capable where the device is), mapped read-write for this GPU.
    #[doc(alias = "cuMemCreate")]
    pub fn alloc_vmm(gpu: &Gpu, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("a device buffer of 0 bytes".into()));
        }
        if !gpu.vmm_supported() || !gpu.posix_fd_supported() {
            return Err(Error::Unsupported(format!(
                "GPU {} has no VMM with POSIX-fd handles",
                gpu.ordinal()
            )));
        }
        gpu.bind()?;
        let prop = vmm_prop(gpu.ordinal(), gpu.gpudirect_rdma_supported());
        let granularity = vmm_granularity(&prop)?;
        let size = round_up(len as u64, granularity as u64) as usize;
        let mut handle = 0;
        cvt_ctx(
            "cuMemCreate",
            // SAFETY: `handle` is a valid out-pointer, `prop` a fully initialised struct.
            unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) },
            || format!("{size} bytes on GPU {}", gpu.ordinal()),
        )?;
        match map_vmm(gpu.ordinal(), handle, size) {
            Ok(ptr) => Ok(Self {
                gpu: gpu.clone(),
                ptr,
                len,
                backing: Backing::Vmm { handle, size },
            }),
            Err(e) => {
                // SAFETY: the handle was created above and is not mapped.
                let _ = unsafe { sys::cuMemRelease(handle) };
                Err(e)
            }
        }
    }

    /// The device address (at least 256-byte aligned).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes, as asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (empty buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU it lives on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Whether it is VMM memory (exported as a file descriptor, not an IPC handle).
    pub fn is_vmm(&self) -> bool {
        matches!(self.backing, Backing::Vmm { .. })
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.ptr + offset as u64),
            _ => Err(Error::InvalidArgument(format!(
                "range {offset}+{len} outside a device buffer of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies `src` to `offset` (synchronous).
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        let dst = self.check_range(offset, src.len())?;
        self.gpu.bind()?;
        // SAFETY: the destination range is inside this allocation; `src` is a live slice.
        cvt("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
        })?;
        // From pageable memory the call returns once the bytes are staged, before the
        // DMA lands: another process or context reading the buffer next must see them.
        sync_default_stream()
    }

    /// Copies from `offset` into `dst` (synchronous).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.check_range(offset, dst.len())?;
        self.gpu.bind()?;
        // SAFETY: the source range is inside this allocation; `dst` is a live slice.
        cvt("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }

    /// The whole buffer read back to the host.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len];
        self.copy_to_host(0, &mut v)?;
        Ok(v)
    }

    /// Sets every byte to `value` (synchronous).
    pub fn fill(&self, value: u8) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the range is exactly this allocation.
        cvt("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.ptr, value, self.len)
        })?;
        // A memset of device memory is asynchronous to the host.
        sync_default_stream()
    }

    /// A CUDA-IPC handle another process opens with [`crate::IpcMapping::open`].
    #[doc(alias = "cuIpcGetMemHandle")]
    pub fn export_ipc(&self) -> Result<IpcHandle> {
        if self.is_vmm() {
            return Err(Error::Unsupported(
                "VMM memory has no legacy IPC handle: use export_fd".into(),
            ));
        }
        IpcHandle::get(&self.gpu, self.ptr)
    }

    /// The VMM allocation as a POSIX file descriptor (with the size to map), to pass to
    /// another process over a Unix socket ([`crate::send_fds`]).
    #[doc(alias = "cuMemExportToShareableHandle")]
    pub fn export_fd(&self) -> Result<VmmExport> {
        let Backing::Vmm { handle, size } = self.backing else {
            return Err(Error::Unsupported(
                "cuMemAlloc memory has no POSIX-fd handle: use export_ipc, or alloc_vmm".into(),
            ));
        };
        self.gpu.bind()?;
        let mut fd: libc::c_int = -1;
        // SAFETY: for POSIX-fd handles the driver writes an `int` to the out-pointer.
        cvt("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut libc::c_int).cast(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the driver returned a new descriptor that we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(VmmExport {
            fd,
            size: size as u64,
            len: self.len as u64,
        })
    }

    /// A DMA-BUF fd of the page-aligned range covering the buffer, for NIC registration.
    #[doc(alias = "doca_gpu_dmabuf_fd")]
    #[doc(alias = "cuMemGetHandleForAddressRange")]
    pub fn dmabuf_fd(&self) -> Result<DmaBuf> {
        if !self.gpu.dmabuf_supported() {
            return Err(Error::Unsupported(format!(
                "GPU {} cannot export DMA-BUF (driver or kernel lacks support)",
                self.gpu.ordinal()
            )));
        }
        let size = match self.backing {
            Backing::Plain { size } | Backing::Vmm { size, .. } => size as u64,
        };
        export_dmabuf(&self.gpu, self.ptr, size, self.ptr, self.len as u64)
    }
}

/// DMA-BUF of `[range_start, range_start + range_len)` (page-aligned), describing the
/// buffer `[ptr, ptr + len)` inside it.
pub(crate) fn export_dmabuf(
    gpu: &Gpu,
    range_start: u64,
    range_len: u64,
    ptr: u64,
    len: u64,
) -> Result<DmaBuf> {
    if !range_start.is_multiple_of(HOST_PAGE) || !range_len.is_multiple_of(HOST_PAGE) {
        return Err(Error::Unsupported(format!(
            "DMA-BUF export needs a page-aligned range, got {range_start:#x}+{range_len}"
        )));
    }
    gpu.bind()?;
    let mut fd: libc::c_int = -1;
    cvt_ctx(
        "cuMemGetHandleForAddressRange",
        // SAFETY: for DMA_BUF_FD the driver writes an `int`; the range is page aligned.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut libc::c_int).cast(),
                range_start,
                range_len as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        },
        || format!("{range_start:#x}+{range_len}"),
    )?;
    // SAFETY: a new descriptor the driver handed over.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(DmaBuf {
        fd,
        offset: ptr - range_start,
        len,
        range_start,
        range_len,
    })
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.bind() {
            tracing::warn!(
                "device buffer {:#x}: cannot bind its context to free it: {e}",
                self.ptr
            );
            return;
        }
        let result = match self.backing {
            // SAFETY: allocated by cuMemAlloc above, freed once.
            Backing::Plain { .. } => cvt("cuMemFree", unsafe { sys::cuMemFree_v2(self.ptr) }),
            Backing::Vmm { handle, size } => unmap_vmm(self.ptr, size, Some(handle)),
        };
        if let Err(e) = result {
            tracing::warn!("device buffer {:#x}: {e}", self.ptr);
        }
    }
}

/// Waits for the work on the current context's legacy default stream (where the
/// synchronous-looking copies and memsets above run).
fn sync_default_stream() -> Result<()> {
    // SAFETY: the null stream names the current context's legacy default stream.
    cvt("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(std::ptr::null_mut())
    })
}
