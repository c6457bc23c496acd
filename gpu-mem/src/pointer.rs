//! Pointer classification (`cuPointerGetAttributes`) and borrowed views of device memory
//! that a framework (torch, CuPy) owns.

use crate::error::{cvt, cvt_ctx, Error, Result};
use crate::gpu::{driver, Gpu};
use crate::ipc::{IpcHandle, VmmExport};
use cudarc::driver::sys::{self, CUpointer_attribute};
use parking_lot::Mutex;
use std::os::fd::FromRawFd;

/// What kind of memory a pointer points into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host memory CUDA does not know (pageable, or never allocated, or freed).
    Host,
    /// Host memory CUDA pinned (`cuMemHostAlloc` or `cuMemHostRegister`).
    PinnedHost,
    /// Device memory of one GPU.
    Device,
    /// Managed (unified) memory.
    Managed,
}

/// What the driver says about a pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    /// The kind of memory.
    pub kind: MemoryKind,
    /// The GPU ordinal of device or managed memory (for pinned host memory: the device of
    /// the context that allocated it, if the driver says).
    pub device: Option<usize>,
    /// Start of the allocation containing the pointer (0 for unknown host memory).
    pub range_start: u64,
    /// Size of that allocation in bytes (0 for unknown host memory).
    pub range_size: u64,
    /// A number unique to the allocation in this process: tells a freed and reallocated
    /// range from the original.
    pub buffer_id: u64,
    /// Whether a legacy CUDA-IPC handle can be taken of it (`cuMemAlloc` memory).
    pub ipc_capable: bool,
}

impl PointerInfo {
    /// Whether `[ptr, ptr + len)` lies inside the allocation.
    pub fn contains(&self, ptr: u64, len: u64) -> bool {
        ptr >= self.range_start
            && ptr
                .checked_add(len)
                .is_some_and(|end| end <= self.range_start + self.range_size)
    }
}

/// Keeps a context current while classifying: `cuPointerGetAttributes` needs one.
fn any_context() -> Result<()> {
    let mut current = std::ptr::null_mut();
    // SAFETY: `current` is a valid out-pointer.
    cvt("cuCtxGetCurrent", unsafe {
        sys::cuCtxGetCurrent(&mut current)
    })?;
    if !current.is_null() {
        return Ok(());
    }
    // Kept once opened; a failed open is retried next time.
    static FALLBACK: Mutex<Option<Gpu>> = Mutex::new(None);
    let mut fallback = FALLBACK.lock();
    match &*fallback {
        Some(gpu) => gpu.bind(),
        None => {
            let gpu = Gpu::open(0)?;
            gpu.bind()?;
            *fallback = Some(gpu);
            Ok(())
        }
    }
}

/// Classifies any pointer: pageable host, pinned host, device (with its GPU) or managed.
#[doc(alias = "cuPointerGetAttributes")]
pub fn pointer_info(ptr: u64) -> Result<PointerInfo> {
    driver()?;
    any_context()?;
    let mut attrs = [
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    ];
    // Every attribute above is at most 8 bytes; zeroed u64 slots read back correctly
    // whatever width (bool, int, pointer) the driver writes into the low bytes.
    // The ordinal slot starts at -2, the driver's "no device" (unknown memory).
    let mut out = [0u64, (-2i64) as u64, 0, 0, 0, 0, 0];
    let mut ptrs: Vec<*mut std::ffi::c_void> = out
        .iter_mut()
        .map(|v| v as *mut u64 as *mut std::ffi::c_void)
        .collect();
    // SAFETY: `attrs` and `ptrs` both have 7 entries, each pointing at an 8-byte slot.
    cvt("cuPointerGetAttributes", unsafe {
        sys::cuPointerGetAttributes(
            attrs.len() as u32,
            attrs.as_mut_ptr(),
            ptrs.as_mut_ptr(),
            ptr,
        )
    })?;
    let memtype = out[0] as u32;
    let ordinal = out[1] as u32 as i32;
    let managed = out[2] as u8 != 0;
    let kind = match memtype {
        m if m == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 && managed => MemoryKind::Managed,
        m if m == sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32 => MemoryKind::Managed,
        m if m == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemoryKind::Device,
        m if m == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => MemoryKind::PinnedHost,
        _ => MemoryKind::Host,
    };
    let known = kind != MemoryKind::Host;
    Ok(PointerInfo {
        kind,
        device: (known && ordinal >= 0).then_some(ordinal as usize),
        range_start: if known { out[3] } else { 0 },
        range_size: if known { out[4] } else { 0 },
        buffer_id: if known { out[5] } else { 0 },
        ipc_capable: known && out[6] as u8 != 0,
    })
}

/// Checks that `[ptr, ptr + len)` is device memory of GPU `device`, inside one allocation.
pub fn check_device_range(ptr: u64, len: u64, device: usize) -> Result<PointerInfo> {
    let info = pointer_info(ptr)?;
    let found = match (info.kind, info.device) {
        (MemoryKind::Device, Some(d)) if d == device => {
            if info.contains(ptr, len) {
                return Ok(info);
            }
            format!(
                "device memory of GPU {d}, but its allocation {:#x}+{} does not hold the whole range",
                info.range_start, info.range_size
            )
        }
        (MemoryKind::Device, d) => format!("device memory of GPU {d:?}"),
        (MemoryKind::Managed, d) => format!("managed memory (preferred GPU {d:?})"),
        (MemoryKind::PinnedHost, _) => "pinned host memory".to_string(),
        (MemoryKind::Host, _) => {
            "host memory unknown to CUDA (pageable, or device memory already freed)".to_string()
        }
    };
    Err(Error::NotDeviceMemory {
        ptr,
        len,
        expected_device: device,
        found,
    })
}

/// A borrowed view of device memory owned elsewhere (a torch tensor, a CuPy array): it
/// checks the range once and can export it, but never frees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemoryRef {
    ptr: u64,
    len: u64,
    device: usize,
    info: PointerInfo,
}

impl DeviceMemoryRef {
    /// Wraps `len` bytes at `ptr`, checked to be device memory of GPU `device`.
    ///
    /// Taking the view is safe: nothing is read or written through it here. Whoever
    /// copies through [`DeviceMemoryRef::ptr`] must keep the owner's allocation alive.
    pub fn wrap(ptr: u64, len: u64, device: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("a device range of length 0".into()));
        }
        let info = check_device_range(ptr, len, device)?;
        Ok(Self {
            ptr,
            len,
            device,
            info,
        })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false (zero-length views are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU ordinal.
    pub fn device(&self) -> usize {
        self.device
    }

    /// What the driver said about the allocation at wrap time.
    pub fn info(&self) -> &PointerInfo {
        &self.info
    }

    /// Offset of the view inside its allocation.
    pub fn offset_in_allocation(&self) -> u64 {
        self.ptr - self.info.range_start
    }

    /// A CUDA-IPC handle of the whole allocation holding the view, and the view's offset
    /// in it: the importer adds the offset to the mapped base.
    #[doc(alias = "cuIpcGetMemHandle")]
    pub fn export_ipc(&self) -> Result<(IpcHandle, u64)> {
        if !self.info.ipc_capable {
            return Err(Error::Unsupported(format!(
                "{:#x} is not legacy-IPC capable (stream-ordered pool or VMM memory): export it as a VMM fd instead",
                self.ptr
            )));
        }
        let gpu = Gpu::open(self.device)?;
        let handle = IpcHandle::get(&gpu, self.info.range_start)?;
        Ok((handle, self.offset_in_allocation()))
    }

    /// The VMM allocation holding the view as a POSIX file descriptor (for memory that
    /// has no legacy IPC handle: `cuMemCreate` with a POSIX-fd handle type, e.g. torch's
    /// expandable segments), and the view's offset in it. The view must lie inside one
    /// physical allocation mapped whole.
    #[doc(alias = "cuMemRetainAllocationHandle")]
    pub fn export_vmm(&self) -> Result<(VmmExport, u64)> {
        let gpu = Gpu::open(self.device)?;
        gpu.bind()?;
        let mut handle = 0;
        // SAFETY: valid out-pointer; the address is device memory checked at wrap time.
        let result = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, self.ptr as *mut _) };
        cvt_ctx("cuMemRetainAllocationHandle", result, || {
            format!("{:#x} (not VMM memory?)", self.ptr)
        })?;
        let exported = (|| {
            // SAFETY: plain C struct, filled by the driver below.
            let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
            // SAFETY: valid out-pointer and a retained handle.
            let result = unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle) };
            cvt("cuMemGetAllocationPropertiesFromHandle", result)?;
            if prop.requestedHandleTypes.0
                & sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0
                == 0
            {
                return Err(Error::Unsupported(format!(
                    "the VMM allocation at {:#x} was created without a POSIX-fd handle type",
                    self.ptr
                )));
            }
            let (start, size) = (self.info.range_start, self.info.range_size);
            if !self.info.contains(self.ptr, self.len) {
                return Err(Error::Unsupported(format!(
                    "{:#x}+{} spans several VMM mappings",
                    self.ptr, self.len
                )));
            }
            let mut fd: libc::c_int = -1;
            // SAFETY: for POSIX-fd handles the driver writes an `int`.
            let result = unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut libc::c_int).cast(),
                    handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            };
            cvt("cuMemExportToShareableHandle", result)?;
            // SAFETY: a new descriptor the driver handed over.
            let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
            Ok((
                VmmExport {
                    fd,
                    size,
                    len: size,
                },
                self.ptr - start,
            ))
        })();
        // SAFETY: retained above, released once.
        let _ = unsafe { sys::cuMemRelease(handle) };
        exported
    }
}
