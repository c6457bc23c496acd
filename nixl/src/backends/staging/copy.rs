//! Device copies for the staging pipeline: bounce memory and the copier interface.

use crate::error::{Error, Result};
use std::alloc::Layout;
use std::fmt::Debug;
use std::ptr::NonNull;

// ---- device copies ----------------------------------------------------------------------

/// One copy between host and device memory (unified addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyOp {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: usize,
}

/// Bounce memory: page-aligned heap memory, or pinned host memory (feature `cuda`).
#[derive(Debug)]
pub(crate) enum BounceMem {
    Heap {
        ptr: NonNull<u8>,
        layout: Layout,
    },
    #[cfg(feature = "cuda")]
    Pinned(gpu_mem::HostBuffer),
}

// SAFETY: plain memory owned by this value; who reads or writes which slot is decided by
// the engine's slot accounting under its lock.
unsafe impl Send for BounceMem {}
// SAFETY: as above.
unsafe impl Sync for BounceMem {}

impl BounceMem {
    /// `len` bytes of zeroed, page-aligned heap memory.
    pub(crate) fn heap(len: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| Error::InvalidParam(format!("staging pool of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or_else(|| {
            Error::InvalidParam(format!("cannot allocate a staging pool of {len} bytes"))
        })?;
        Ok(BounceMem::Heap { ptr, layout })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        match self {
            BounceMem::Heap { ptr, .. } => ptr.as_ptr(),
            #[cfg(feature = "cuda")]
            BounceMem::Pinned(b) => b.as_ptr() as *mut u8,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            BounceMem::Heap { layout, .. } => layout.size(),
            #[cfg(feature = "cuda")]
            BounceMem::Pinned(b) => b.len(),
        }
    }

    /// Whether it is pinned (copies to and from a GPU run at full speed).
    pub(crate) fn pinned(&self) -> bool {
        !matches!(self, BounceMem::Heap { .. })
    }
}

impl Drop for BounceMem {
    fn drop(&mut self) {
        #[cfg_attr(not(feature = "cuda"), allow(irrefutable_let_patterns))]
        if let BounceMem::Heap { ptr, layout } = self {
            // SAFETY: allocated in `heap` with this layout, freed once.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), *layout) };
        }
    }
}

/// Starts copies and reports their completion.
pub(crate) trait Copier: Send + Debug {
    /// Bounce memory of `len` bytes; pinned for GPU `dev` where one is named and can be.
    fn alloc(&mut self, len: usize, dev: Option<usize>) -> Result<BounceMem>;
    /// Starts `copies` on GPU `dev` (`None`: host memory on both sides); returns a ticket.
    fn start(&mut self, dev: Option<usize>, copies: &[CopyOp]) -> Result<u64>;
    /// Whether the copies of `ticket` completed (a finished ticket is forgotten).
    fn poll(&mut self, ticket: u64) -> Result<bool>;
}

/// Copies host memory with `memcpy`, at once.
#[cfg(any(not(feature = "cuda"), test))]
#[derive(Debug, Default)]
pub(crate) struct HostCopier {
    next: u64,
}

/// Copies host memory.
///
/// # Safety
/// Every copy's ranges must be valid host memory.
pub(crate) unsafe fn host_copy(copies: &[CopyOp]) {
    for c in copies {
        // SAFETY: the caller's contract; `copy` tolerates overlap.
        unsafe { std::ptr::copy(c.src as *const u8, c.dst as *mut u8, c.len) };
    }
}

#[cfg(any(not(feature = "cuda"), test))]
impl Copier for HostCopier {
    fn alloc(&mut self, len: usize, _dev: Option<usize>) -> Result<BounceMem> {
        BounceMem::heap(len)
    }
    fn start(&mut self, dev: Option<usize>, copies: &[CopyOp]) -> Result<u64> {
        if let Some(dev) = dev {
            return Err(Error::Gpu(format!(
                "a copy on GPU {dev} without GPU support (feature cuda)"
            )));
        }
        // SAFETY: the engine only copies between its bounce memory and ranges checked
        // against live staged registrations.
        unsafe { host_copy(copies) };
        self.next += 1;
        Ok(self.next)
    }
    fn poll(&mut self, _ticket: u64) -> Result<bool> {
        Ok(true)
    }
}
