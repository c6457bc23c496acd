//! Memory regions.

use crate::error::{cvt, cvt_ptr, Error, Result};
use crate::ffi;
use crate::pd::ProtectionDomain;
use serde::{Deserialize, Serialize};
use std::alloc::Layout;
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::Arc;

bitflags::bitflags! {
    /// Access rights of a memory region or QP (`enum ibv_access_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AccessFlags: u32 {
        /// `IBV_ACCESS_LOCAL_WRITE` (needed by RECV and RDMA READ targets, and any remote write).
        const LOCAL_WRITE = ffi::IBV_ACCESS_LOCAL_WRITE;
        /// `IBV_ACCESS_REMOTE_WRITE`
        const REMOTE_WRITE = ffi::IBV_ACCESS_REMOTE_WRITE;
        /// `IBV_ACCESS_REMOTE_READ`
        const REMOTE_READ = ffi::IBV_ACCESS_REMOTE_READ;
        /// `IBV_ACCESS_REMOTE_ATOMIC`
        const REMOTE_ATOMIC = ffi::IBV_ACCESS_REMOTE_ATOMIC;
        /// `IBV_ACCESS_MW_BIND`
        const MW_BIND = ffi::IBV_ACCESS_MW_BIND;
        /// `IBV_ACCESS_ZERO_BASED`
        const ZERO_BASED = ffi::IBV_ACCESS_ZERO_BASED;
        /// `IBV_ACCESS_ON_DEMAND`
        const ON_DEMAND = ffi::IBV_ACCESS_ON_DEMAND;
        /// `IBV_ACCESS_HUGETLB`
        const HUGETLB = ffi::IBV_ACCESS_HUGETLB;
        /// `IBV_ACCESS_RELAXED_ORDERING` (optional: ignored where unsupported)
        const RELAXED_ORDERING = ffi::IBV_ACCESS_RELAXED_ORDERING;
    }
}

impl AccessFlags {
    /// Local write plus remote read, write and atomic.
    pub fn all_remote() -> Self {
        Self::LOCAL_WRITE | Self::REMOTE_WRITE | Self::REMOTE_READ | Self::REMOTE_ATOMIC
    }
}

/// Page-aligned, zeroed heap memory owned by a [`MemoryRegion`].
struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl AlignedBuf {
    fn new(len: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| Error::InvalidArgument(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: the layout has a nonzero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        Ok(AlignedBuf { ptr, layout })
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

enum Backing {
    Owned(AlignedBuf),
    Caller,
    DmaBuf,
}

pub(crate) struct MrInner {
    mr: NonNull<ffi::ibv_mr>,
    addr: *mut u8,
    len: usize,
    backing: Backing,
}

// SAFETY: an MR may be used by verbs on any thread (rdma-core is thread-safe); the owned
// buffer is plain heap memory and caller memory is registered under a contract that
// allows any thread to reach it.
unsafe impl Send for MrInner {}
// SAFETY: shared access only reads the handle; buffer access goes through `&self`/`&mut
// self` methods with the usual borrow rules.
unsafe impl Sync for MrInner {}

impl Drop for MrInner {
    fn drop(&mut self) {
        // Deregister before the buffer is freed: after this the HCA can no longer reach
        // the memory, and work still in flight on it completes with an error.
        // SAFETY: registered by this wrapper, deregistered once.
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if let Err(err) = cvt(ret, "ibv_dereg_mr") {
            tracing::error!(%err, "deregistering a memory region failed; leaking its buffer");
            // The device may still reach the memory: never give it back to the allocator.
            if let Backing::Owned(buf) = std::mem::replace(&mut self.backing, Backing::Caller) {
                std::mem::forget(buf);
            }
        }
    }
}

/// A registered memory region (`struct ibv_mr`).
///
/// [`ProtectionDomain::reg_mr`] allocates and owns its (page-aligned, zeroed) buffer;
/// [`ProtectionDomain::reg_mr_raw`] registers caller memory (`unsafe`);
/// [`ProtectionDomain::reg_dmabuf_mr`] a DMA-BUF.
///
/// The buffer is also written by the device (RECV, RDMA READ results, remote RDMA
/// WRITE/atomics). Read it after the completion (yours or the peer's message) that
/// says the data has arrived; the crate cannot order a remote writer for you.
///
/// Dropping the region while work on it is in flight is allowed: the region is
/// deregistered before its buffer is freed, so the device can no longer reach the
/// memory, and that work completes with an error (local protection, remote access or
/// flush) instead of touching freed memory.
///
/// A [`MemoryWindow`](crate::MemoryWindow) bound to the region keeps the registration and
/// the buffer alive until the window is dropped or bound elsewhere: remote access
/// through the window never reaches freed memory.
pub struct MemoryRegion {
    // Shared with the memory windows bound to this region, which keep the registration
    // (and the buffer) alive while the device may still reach it through them.
    pub(crate) inner: Arc<MrInner>,
    pd: ProtectionDomain,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.inner.addr)
            .field("len", &self.inner.len)
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocate a zeroed, page-aligned buffer of `len` bytes and register it
    /// (`ibv_reg_mr`).
    #[doc(alias = "ibv_reg_mr")]
    pub fn reg_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        let buf = AlignedBuf::new(len)?;
        let addr = buf.ptr.as_ptr();
        // SAFETY: `buf` is live heap memory of `len` bytes that the MR owns and frees
        // only after deregistration.
        let mr = unsafe { ffi::ibv_reg_mr(self.as_raw(), addr.cast(), len, access.bits() as i32) };
        let mr = cvt_ptr(mr, "ibv_reg_mr")?;
        Ok(MemoryRegion {
            inner: Arc::new(MrInner {
                mr,
                addr,
                len,
                backing: Backing::Owned(buf),
            }),
            pd: self.clone(),
        })
    }

    /// Register caller memory (`ibv_reg_mr`).
    ///
    /// # Safety
    /// - `addr..addr+len` is memory of this process that stays allocated (and is not
    ///   unmapped) until the returned region and every
    ///   [`MemoryWindow`](crate::MemoryWindow) bound to it are dropped;
    /// - while registered it may be read and written by the device at any time the
    ///   access flags allow: the caller must not hold Rust references to it across
    ///   such accesses and must synchronise through completions;
    /// - it may be reached from any thread.
    #[doc(alias = "ibv_reg_mr")]
    pub unsafe fn reg_mr_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: the caller guarantees the memory stays valid while registered.
        let mr = unsafe { ffi::ibv_reg_mr(self.as_raw(), addr.cast(), len, access.bits() as i32) };
        let mr = cvt_ptr(mr, "ibv_reg_mr")?;
        Ok(MemoryRegion {
            inner: Arc::new(MrInner {
                mr,
                addr,
                len,
                backing: Backing::Caller,
            }),
            pd: self.clone(),
        })
    }

    /// Register `len` bytes at `offset` of a DMA-BUF (`ibv_reg_dmabuf_mr`), addressed by
    /// the device as `iova`. The exporter keeps the memory alive while registered.
    /// [`Error::Unsupported`] where the provider/kernel has no DMA-BUF support.
    #[doc(alias = "ibv_reg_dmabuf_mr")]
    pub fn reg_dmabuf_mr(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: live PD; the kernel validates the fd; no process memory is involved.
        let mr = unsafe {
            ffi::ibv_reg_dmabuf_mr(
                self.as_raw(),
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                access.bits() as i32,
            )
        };
        let mr = cvt_ptr(mr, "ibv_reg_dmabuf_mr")?;
        Ok(MemoryRegion {
            inner: Arc::new(MrInner {
                mr,
                addr: iova as *mut u8,
                len,
                backing: Backing::DmaBuf,
            }),
            pd: self.clone(),
        })
    }
}

/// Where a peer may read or write: address, length and rkey of (part of) a remote memory
/// region. Serializable, to send over a side channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteMemory {
    /// Remote virtual address (the IOVA of the region).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteMemory {
    /// Size of [`to_bytes`](Self::to_bytes)' encoding.
    pub const ENCODED_LEN: usize = 20;

    /// A compact encoding (address and length as big-endian `u64`, then the rkey as
    /// big-endian `u32`), small enough for rdma_cm private data.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0; Self::ENCODED_LEN];
        out[..8].copy_from_slice(&self.addr.to_be_bytes());
        out[8..16].copy_from_slice(&self.len.to_be_bytes());
        out[16..].copy_from_slice(&self.rkey.to_be_bytes());
        out
    }

    /// Decode [`to_bytes`](Self::to_bytes)' encoding from the start of `bytes` (what
    /// follows, e.g. zero padding, is ignored); `None` if `bytes` is too short.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let b = bytes.get(..Self::ENCODED_LEN)?;
        Some(RemoteMemory {
            addr: u64::from_be_bytes(b[..8].try_into().ok()?),
            len: u64::from_be_bytes(b[8..16].try_into().ok()?),
            rkey: u32::from_be_bytes(b[16..].try_into().ok()?),
        })
    }

    /// The part starting `offset` bytes in, `len` long (no bounds check: an
    /// out-of-range access fails remotely with a remote access error).
    pub fn slice(&self, offset: u64, len: u64) -> RemoteMemory {
        RemoteMemory {
            addr: self.addr.wrapping_add(offset),
            len,
            rkey: self.rkey,
        }
    }
}

/// One scatter/gather element (`struct ibv_sge`) borrowing a [`MemoryRegion`].
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct Sge<'a> {
    pub(crate) raw: ffi::ibv_sge,
    _mr: PhantomData<&'a MemoryRegion>,
}

impl fmt::Debug for Sge<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sge")
            .field("addr", &format_args!("{:#x}", self.raw.addr))
            .field("length", &self.raw.length)
            .field("lkey", &self.raw.lkey)
            .finish()
    }
}

impl Sge<'_> {
    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.raw.length
    }
    /// Whether the element is empty.
    pub fn is_empty(&self) -> bool {
        self.raw.length == 0
    }
    /// An SGE from raw parts.
    ///
    /// # Safety
    /// `addr..addr+length` must lie in a memory region with key `lkey` that outlives
    /// `'a` and any work request using it.
    pub unsafe fn from_raw(addr: u64, length: u32, lkey: u32) -> Self {
        Sge {
            raw: ffi::ibv_sge { addr, length, lkey },
            _mr: PhantomData,
        }
    }
}

impl MemoryRegion {
    /// The raw `ibv_mr`.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.inner.mr.as_ptr()
    }

    /// Wrap a raw MR over caller memory; deregistered on drop.
    ///
    /// # Safety
    /// `mr` must be a valid MR of `pd` that nothing else deregisters, over memory that
    /// satisfies the contract of [`ProtectionDomain::reg_mr_raw`].
    pub unsafe fn from_raw(mr: NonNull<ffi::ibv_mr>, pd: ProtectionDomain) -> Self {
        // SAFETY: the caller guarantees `mr` is valid.
        let (addr, len) = unsafe { ((*mr.as_ptr()).addr.cast(), (*mr.as_ptr()).length) };
        MemoryRegion {
            inner: Arc::new(MrInner {
                mr,
                addr,
                len,
                backing: Backing::Caller,
            }),
            pd,
        }
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.as_raw()).lkey }
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.as_raw()).rkey }
    }
    /// Start address (the IOVA for a DMA-BUF region).
    pub fn addr(&self) -> u64 {
        self.inner.addr as u64
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The whole region as a remote peer addresses it.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.addr(),
            len: self.len() as u64,
            rkey: self.rkey(),
        }
    }

    pub(crate) fn bounds(&self, range: impl RangeBounds<usize>) -> (usize, usize) {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e + 1,
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len(),
        };
        assert!(
            start <= end && end <= self.len(),
            "range {start}..{end} outside the {}-byte region",
            self.len()
        );
        (start, end)
    }

    /// A scatter/gather element over `range` of this region.
    ///
    /// # Panics
    /// If the range is outside the region or longer than 4 GiB.
    pub fn sge(&self, range: impl RangeBounds<usize>) -> Sge<'_> {
        let (start, end) = self.bounds(range);
        let length = u32::try_from(end - start).expect("an SGE is at most 4 GiB");
        Sge {
            raw: ffi::ibv_sge {
                addr: self.addr() + start as u64,
                length,
                lkey: self.lkey(),
            },
            _mr: PhantomData,
        }
    }

    /// The buffer (owned or caller memory; empty for a DMA-BUF region). See the type
    /// docs about device writes.
    pub fn as_slice(&self) -> &[u8] {
        match self.inner.backing {
            Backing::DmaBuf => &[],
            // SAFETY: `addr..addr+len` is live memory owned by (or registered for) `self`.
            _ => unsafe { std::slice::from_raw_parts(self.inner.addr, self.inner.len) },
        }
    }

    /// The buffer, mutably (empty for a DMA-BUF region).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self.inner.backing {
            Backing::DmaBuf => &mut [],
            // SAFETY: as above, and `&mut self` makes this the only Rust reference.
            _ => unsafe { std::slice::from_raw_parts_mut(self.inner.addr, self.inner.len) },
        }
    }

    /// Change the access rights in place (`ibv_rereg_mr` with
    /// `IBV_REREG_MR_CHANGE_ACCESS`). The keys may change.
    #[doc(alias = "ibv_rereg_mr")]
    pub fn rereg_access(&mut self, access: AccessFlags) -> Result<()> {
        // SAFETY: live MR; only the access flags change, addr/len/pd are ignored.
        let ret = unsafe {
            ffi::ibv_rereg_mr(
                self.as_raw(),
                ffi::IBV_REREG_MR_CHANGE_ACCESS as i32,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                access.bits() as i32,
            )
        };
        rereg_result(ret)
    }

    /// Move the region to another protection domain (`ibv_rereg_mr` with
    /// `IBV_REREG_MR_CHANGE_PD`).
    #[doc(alias = "ibv_rereg_mr")]
    pub fn rereg_pd(&mut self, pd: &ProtectionDomain) -> Result<()> {
        // SAFETY: live MR and PD of the same context.
        let ret = unsafe {
            ffi::ibv_rereg_mr(
                self.as_raw(),
                ffi::IBV_REREG_MR_CHANGE_PD as i32,
                pd.as_raw(),
                std::ptr::null_mut(),
                0,
                0,
            )
        };
        rereg_result(ret)?;
        self.pd = pd.clone();
        Ok(())
    }
}

fn rereg_result(ret: i32) -> Result<()> {
    // ibv_rereg_mr returns 0, or an `enum ibv_rereg_mr_err_code` with errno set.
    if ret == 0 {
        Ok(())
    } else {
        Err(Error::from_errno(
            "ibv_rereg_mr",
            crate::error::last_errno(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_memory_encoding_round_trips() {
        let m = RemoteMemory {
            addr: 0x7f00_1234_5678_9abc,
            len: 1 << 20,
            rkey: 0xdead_beef,
        };
        let mut padded = m.to_bytes().to_vec();
        padded.extend_from_slice(&[0; 36]);
        assert_eq!(RemoteMemory::from_bytes(&padded), Some(m));
        assert_eq!(RemoteMemory::from_bytes(&padded[..19]), None);
    }
}
