//! The virtual memory management steps that allocating (`device_buffer`) and importing
//! (`ipc`) VMM memory share: allocation properties, granularity, and mapping a physical
//! allocation read-write into a reserved address range (a leaf module: both build on it).

use crate::error::{cvt, Result};
use cudarc::driver::sys::{self, CUmemGenericAllocationHandle};

pub(crate) fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// Allocation properties of pinned device memory with a POSIX-fd handle type.
pub(crate) fn vmm_prop(ordinal: usize, gdr: bool) -> sys::CUmemAllocationProp {
    // SAFETY: the C struct is plain data for which all-zeroes is the documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal as i32;
    prop.allocFlags.gpuDirectRDMACapable = u8::from(gdr);
    prop
}

pub(crate) fn vmm_granularity(prop: &sys::CUmemAllocationProp) -> Result<usize> {
    let mut granularity = 0;
    // SAFETY: valid out-pointer and property struct.
    cvt("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    Ok(granularity.max(1))
}

/// Reserves an address range, maps `handle` there and enables read-write access for GPU
/// `ordinal`; undoes what it did on failure.
pub(crate) fn map_vmm(
    ordinal: usize,
    handle: CUmemGenericAllocationHandle,
    size: usize,
) -> Result<u64> {
    let mut ptr = 0;
    // SAFETY: valid out-pointer; size is granularity-aligned.
    cvt("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)
    })?;
    // SAFETY: the range was just reserved with this size.
    if let Err(e) = cvt("cuMemMap", unsafe {
        sys::cuMemMap(ptr, size, 0, handle, 0)
    }) {
        // SAFETY: reserved above, never mapped.
        let _ = unsafe { sys::cuMemAddressFree(ptr, size) };
        return Err(e);
    }
    // SAFETY: the C struct is plain data; all fields are set below.
    let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = ordinal as i32;
    access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: one access descriptor for the mapped range.
    if let Err(e) = cvt("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, size, &access, 1)
    }) {
        let _ = unmap_vmm(ptr, size, None);
        return Err(e);
    }
    Ok(ptr)
}

/// Unmaps and frees the address range; releases `handle` when given.
pub(crate) fn unmap_vmm(
    ptr: u64,
    size: usize,
    handle: Option<CUmemGenericAllocationHandle>,
) -> Result<()> {
    // SAFETY: `ptr`/`size` is a range this crate mapped; each step runs once.
    let unmap = cvt("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size) });
    // SAFETY: as above.
    let free = cvt("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(ptr, size)
    });
    let release = match handle {
        // SAFETY: the handle was created or imported by this crate and is released once.
        Some(h) => cvt("cuMemRelease", unsafe { sys::cuMemRelease(h) }),
        None => Ok(()),
    };
    unmap.and(free).and(release)
}
