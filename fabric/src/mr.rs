//! Memory registration (`fid_mr`), honouring the provider's `mr_mode`.

use crate::domain::{Domain, DomainInner};
use crate::ep_handle::Endpoint;
use crate::error::{cvt, Error, Result};
use crate::info::MrMode;
use crate::{close_fid, ffi};
use std::alloc::{self, Layout};
use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::atomic::Ordering;
use std::sync::Arc;

bitflags::bitflags! {
    /// Access a registration allows (`fi_mr_reg` `access`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u64 {
        /// `FI_SEND`: source of sends.
        const SEND = ffi::FI_SEND;
        /// `FI_RECV`: target of receives.
        const RECV = ffi::FI_RECV;
        /// `FI_READ`: local buffer of RMA reads (the data lands here).
        const READ = ffi::FI_READ;
        /// `FI_WRITE`: local buffer of RMA writes (the data comes from here).
        const WRITE = ffi::FI_WRITE;
        /// `FI_REMOTE_READ`: peers may read it.
        const REMOTE_READ = ffi::FI_REMOTE_READ;
        /// `FI_REMOTE_WRITE`: peers may write it.
        const REMOTE_WRITE = ffi::FI_REMOTE_WRITE;
    }
}

impl Access {
    /// Everything: local and remote, read and write, send and receive.
    pub const ALL: Access = Access::all();
}

/// Device memory interfaces (`enum fi_hmem_iface`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HmemIface {
    /// `FI_HMEM_SYSTEM`: host memory.
    System,
    /// `FI_HMEM_CUDA`, with the CUDA device ordinal.
    Cuda(i32),
    /// `FI_HMEM_ROCR`.
    Rocr,
    /// `FI_HMEM_ZE`, with the driver and device indices.
    Ze(i32),
}

/// How a peer reaches a registered region: base address (a virtual address with
/// `FI_MR_VIRT_ADDR`, else 0 for offset addressing), key, and length. Plain data: send
/// [`to_bytes`](Self::to_bytes) to the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteMemory {
    /// The target address of byte 0 of the region.
    pub addr: u64,
    /// The remote key (`fi_mr_key`).
    pub key: u64,
    /// The region's length.
    pub len: u64,
}

impl RemoteMemory {
    /// Size of [`to_bytes`](Self::to_bytes).
    pub const WIRE_SIZE: usize = 24;

    /// The target address of byte `offset` (the `addr` argument of `fi_write`/`fi_read`).
    pub fn address_at(&self, offset: u64) -> u64 {
        self.addr.wrapping_add(offset)
    }

    /// Little-endian `addr, key, len`.
    pub fn to_bytes(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        out[..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..16].copy_from_slice(&self.key.to_le_bytes());
        out[16..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Parses [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(b: &[u8]) -> Result<RemoteMemory> {
        if b.len() != Self::WIRE_SIZE {
            return Err(Error::InvalidArgument {
                call: "RemoteMemory::from_bytes",
                detail: format!("{} bytes, expected {}", b.len(), Self::WIRE_SIZE),
            });
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        Ok(RemoteMemory {
            addr: word(0),
            key: word(1),
            len: word(2),
        })
    }
}

/// The bookkeeping `mr_mode` asks for, as pure functions (unit-tested).
pub(crate) mod rules {
    use super::*;

    /// The base address peers use: the virtual address with `FI_MR_VIRT_ADDR`, else 0.
    pub fn remote_base(mode: MrMode, va: u64) -> u64 {
        if mode.contains(MrMode::VIRT_ADDR) {
            va
        } else {
            0
        }
    }

    /// The key to request: ignored with `FI_MR_PROV_KEY`, else a domain-unique value.
    pub fn requested_key(mode: MrMode, next: u64) -> u64 {
        if mode.contains(MrMode::PROV_KEY) {
            0
        } else {
            next
        }
    }

    /// Whether registration needs an endpoint (bind + enable).
    pub fn needs_endpoint(mode: MrMode) -> bool {
        mode.contains(MrMode::ENDPOINT)
    }

    /// Whether local operations must pass a descriptor.
    pub fn needs_desc(mode: MrMode) -> bool {
        mode.contains(MrMode::LOCAL)
    }

    /// Bits this crate cannot honour.
    pub fn unsupported(mode: MrMode) -> MrMode {
        mode.difference(MrMode::SUPPORTED | MrMode::MMU_NOTIFY | MrMode::COLLECTIVE)
    }
}

pub(crate) struct MrInner {
    pub(crate) raw: *mut ffi::fid_mr,
    pub(crate) desc: *mut c_void,
    pub(crate) key: u64,
    pub(crate) base: u64,
    pub(crate) len: usize,
    _domain: Arc<DomainInner>,
    /// Keeps the endpoint a FI_MR_ENDPOINT region is bound to alive.
    _endpoint: Option<Endpoint>,
}

// SAFETY: the MR belongs to an FI_THREAD_SAFE domain; desc is an opaque provider token.
unsafe impl Send for MrInner {}
// SAFETY: as above.
unsafe impl Sync for MrInner {}

impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: the fid of an open MR.
        let _guard = self._domain.control_guard();
        close_fid("memory region", crate::fid_of(self.raw));
    }
}

/// A registered memory region (`fid_mr`).
///
/// `mr_mode` is honoured as follows: `FI_MR_LOCAL` — [`desc`](Self::desc) is passed on
/// every operation of this crate; `FI_MR_VIRT_ADDR` — [`remote`](Self::remote) gives the
/// virtual address as base, else 0 (offsets); `FI_MR_PROV_KEY` — the provider's key is
/// read back with `fi_mr_key`, else a domain-unique key is requested; `FI_MR_ENDPOINT` —
/// the region is bound to its endpoint and enabled (registration needs an endpoint);
/// `FI_MR_ALLOCATED` — only allocated memory is ever registered (owned buffers are heap
/// allocations; raw registrations are the caller's promise); `FI_MR_HMEM` — device memory
/// is registered with its interface through `fi_mr_regattr`
/// ([`MemoryRegion::reg_hmem`]).
#[derive(Clone)]
pub struct MemoryRegion {
    pub(crate) inner: Arc<MrInner>,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("key", &self.inner.key)
            .field("base", &format_args!("{:#x}", self.inner.base))
            .field("len", &self.inner.len)
            .finish()
    }
}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` (`fi_mr_regattr`), binding and enabling the region on
    /// `ep` when the domain's `mr_mode` has `FI_MR_ENDPOINT`.
    ///
    /// # Safety
    /// `addr..addr+len` must be memory of the given interface that stays allocated until the
    /// region is dropped and every operation using it has completed.
    #[doc(alias = "fi_mr_reg")]
    #[doc(alias = "fi_mr_regattr")]
    pub unsafe fn reg_raw(
        domain: &Domain,
        ep: Option<&Endpoint>,
        addr: *const u8,
        len: usize,
        access: Access,
        iface: HmemIface,
    ) -> Result<MemoryRegion> {
        let mode = domain.inner.mr_mode;
        let bad = rules::unsupported(mode);
        if !bad.is_empty() {
            return Err(Error::Unsupported {
                call: "fi_mr_regattr",
                errno: ffi::FI_EOPNOTSUPP,
                detail: format!("mr_mode bits {bad:?}"),
            });
        }
        if rules::needs_endpoint(mode) && ep.is_none() {
            return Err(Error::InvalidArgument {
                call: "fi_mr_regattr",
                detail: "the provider requires FI_MR_ENDPOINT: register through an endpoint".into(),
            });
        }
        let requested_key =
            rules::requested_key(mode, domain.inner.next_key.fetch_add(1, Ordering::Relaxed));
        let iov = libc::iovec {
            iov_base: addr as *mut c_void,
            iov_len: len,
        };
        let mut attr = ffi::fi_mr_attr {
            mr_iov: ptr::addr_of!(iov).cast(),
            iov_count: 1,
            access: access.bits(),
            requested_key,
            ..Default::default()
        };
        match iface {
            HmemIface::System => attr.iface = ffi::FI_HMEM_SYSTEM,
            HmemIface::Cuda(dev) => {
                attr.iface = ffi::FI_HMEM_CUDA;
                attr.device.cuda = dev;
            }
            HmemIface::Rocr => attr.iface = ffi::FI_HMEM_ROCR,
            HmemIface::Ze(dev) => {
                attr.iface = ffi::FI_HMEM_ZE;
                attr.device.ze = dev;
            }
        }
        let control = domain.inner.control_guard();
        let mut raw = ptr::null_mut();
        // SAFETY: attr describes the caller's memory (promised valid); raw receives the MR.
        let ret = unsafe { ffi::fi_mr_regattr(domain.inner.raw, &attr, 0, &mut raw) };
        cvt("fi_mr_regattr", ret).map_err(|e| {
            e.context(|| format!("{len} bytes at {addr:p}, access {access:?}, iface {iface:?}"))
        })?;
        if rules::needs_endpoint(mode) {
            let ep = ep.expect("checked above");
            // SAFETY: raw is an open MR; the endpoint's fid is open.
            let bound = cvt("fi_mr_bind", unsafe { ffi::fi_mr_bind(raw, ep.fid(), 0) })
                // SAFETY: raw is an open, bound MR.
                .and_then(|()| cvt("fi_mr_enable", unsafe { ffi::fi_mr_enable(raw) }));
            if let Err(e) = bound {
                close_fid("memory region", crate::fid_of(raw));
                return Err(e);
            }
        }
        drop(control);
        // From here on, `guard` closes the region on every error path.
        let mut guard = MrInner {
            raw,
            desc: ptr::null_mut(),
            key: 0,
            base: rules::remote_base(mode, addr as u64),
            len,
            _domain: Arc::clone(&domain.inner),
            _endpoint: ep.filter(|_| rules::needs_endpoint(mode)).cloned(),
        };
        // SAFETY: raw is an open MR.
        guard.key = unsafe { ffi::fi_mr_key(raw) };
        if guard.key == ffi::FI_KEY_NOTAVAIL {
            return Err(Error::Unsupported {
                call: "fi_mr_key",
                errno: ffi::FI_ENOKEY,
                detail: "the key needs fi_mr_raw_attr (FI_MR_RAW), not supported".into(),
            });
        }
        // SAFETY: raw is an open MR.
        guard.desc = unsafe { ffi::fi_mr_desc(raw) };
        Ok(MemoryRegion {
            inner: Arc::new(guard),
        })
    }

    /// Registers CUDA/ROCr/ZE device memory (`fi_mr_regattr` with `iface` and `device`).
    /// Needs an `FI_HMEM` provider.
    ///
    /// # Safety
    /// As [`reg_raw`](Self::reg_raw): `addr..addr+len` is device memory of `iface` that
    /// outlives the region and its operations.
    pub unsafe fn reg_hmem(
        domain: &Domain,
        ep: Option<&Endpoint>,
        addr: u64,
        len: usize,
        access: Access,
        iface: HmemIface,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded contract.
        unsafe { Self::reg_raw(domain, ep, addr as *const u8, len, access, iface) }
    }

    /// The raw `fid_mr`.
    pub fn as_raw(&self) -> *mut ffi::fid_mr {
        self.inner.raw
    }

    /// Wraps an open `fid_mr` of `domain` covering `len` bytes at `va`.
    ///
    /// # Safety
    /// `raw` must be an open, enabled MR of `domain` for memory that outlives it, owned by
    /// nobody else (closed on drop).
    pub unsafe fn from_raw(
        domain: &Domain,
        raw: *mut ffi::fid_mr,
        va: u64,
        len: usize,
    ) -> MemoryRegion {
        // SAFETY: raw is an open MR (caller's contract).
        let (key, desc) = unsafe { (ffi::fi_mr_key(raw), ffi::fi_mr_desc(raw)) };
        MemoryRegion {
            inner: Arc::new(MrInner {
                raw,
                desc,
                key,
                base: rules::remote_base(domain.inner.mr_mode, va),
                len,
                _domain: Arc::clone(&domain.inner),
                _endpoint: None,
            }),
        }
    }

    /// The remote key (`fi_mr_key`).
    #[doc(alias = "fi_mr_key")]
    pub fn key(&self) -> u64 {
        self.inner.key
    }

    /// The local descriptor (`fi_mr_desc`), passed with every operation on this memory.
    #[doc(alias = "fi_mr_desc")]
    pub fn desc(&self) -> *mut c_void {
        self.inner.desc
    }

    /// What a peer needs to target this region.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.inner.base,
            key: self.inner.key,
            len: self.inner.len as u64,
        }
    }

    /// Registered length.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
}

pub(crate) struct BufInner {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) len: usize,
    layout: Layout,
    pub(crate) mr: Option<MemoryRegion>,
}

// SAFETY: the buffer is a plain heap allocation; access goes through RegisteredBuffer's
// methods (shared reads, exclusive writes only without in-flight operations).
unsafe impl Send for BufInner {}
// SAFETY: as above.
unsafe impl Sync for BufInner {}

impl Drop for BufInner {
    fn drop(&mut self) {
        let Some(mr) = self.mr.take() else { return };
        if Arc::strong_count(&mr.inner) > 1 {
            // A clone of the registration (from `mr()`) outlives the buffer: keep the
            // memory it covers allocated rather than free registered memory.
            tracing::warn!("a MemoryRegion of a RegisteredBuffer outlives it; leaking the buffer");
            return;
        }
        // Close the registration, then free the memory it covered.
        drop(mr);
        // SAFETY: ptr was allocated with layout in RegisteredBuffer::alloc and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Page-aligned, zeroed heap memory registered with a domain, owned by this crate: the
/// safe operations of [`Endpoint`] take it and keep it alive until their completion is
/// read.
///
/// Peers with the [`RemoteMemory`] of a buffer registered for remote access may write it at
/// any time; reading it while they do sees partial data (as with any RDMA buffer).
pub struct RegisteredBuffer {
    pub(crate) inner: Arc<BufInner>,
}

impl std::fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("ptr", &self.inner.ptr)
            .field("len", &self.inner.len)
            .field("mr", self.mr())
            .finish()
    }
}

impl RegisteredBuffer {
    pub(crate) fn alloc(
        domain: &Domain,
        ep: Option<&Endpoint>,
        len: usize,
        access: Access,
    ) -> Result<RegisteredBuffer> {
        let layout =
            Layout::from_size_align(len.max(1), 4096).map_err(|e| Error::InvalidArgument {
                call: "RegisteredBuffer::alloc",
                detail: e.to_string(),
            })?;
        // SAFETY: layout has a non-zero size.
        let ptr =
            NonNull::new(unsafe { alloc::alloc_zeroed(layout) }).ok_or_else(|| Error::Call {
                call: "RegisteredBuffer::alloc",
                errno: ffi::FI_ENOMEM,
                message: "out of memory".into(),
                context: format!(": {len} bytes"),
            })?;
        // SAFETY: ptr..ptr+len is our allocation; it is freed only after the region closes
        // (BufInner::drop).
        let mr = match unsafe {
            MemoryRegion::reg_raw(domain, ep, ptr.as_ptr(), len, access, HmemIface::System)
        } {
            Ok(mr) => mr,
            Err(e) => {
                // SAFETY: allocated above with layout, never registered.
                unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
                return Err(e);
            }
        };
        Ok(RegisteredBuffer {
            inner: Arc::new(BufInner {
                ptr,
                len,
                layout,
                mr: Some(mr),
            }),
        })
    }

    /// Allocates and registers `len` bytes with `domain`. Fails with
    /// [`Error::InvalidArgument`] when the provider needs `FI_MR_ENDPOINT` (use
    /// [`Endpoint::alloc_registered`]).
    pub fn new(domain: &Domain, len: usize, access: Access) -> Result<RegisteredBuffer> {
        Self::alloc(domain, None, len, access)
    }

    /// The memory registration.
    pub fn mr(&self) -> &MemoryRegion {
        self.inner.mr.as_ref().expect("present until drop")
    }

    /// What a peer needs to target this buffer.
    pub fn remote(&self) -> RemoteMemory {
        self.mr().remote()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The start address.
    pub fn as_ptr(&self) -> *const u8 {
        self.inner.ptr.as_ptr()
    }

    /// The contents. Remote writes and receives in flight may change them concurrently.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is our live allocation, initialised (zeroed) at allocation.
        unsafe { std::slice::from_raw_parts(self.inner.ptr.as_ptr(), self.inner.len) }
    }

    /// A copy of the contents read with volatile loads: the way to look at memory that the
    /// NIC or a peer wrote behind the compiler's back.
    pub fn to_vec_volatile(&self) -> Vec<u8> {
        let p = self.inner.ptr.as_ptr();
        // SAFETY: every index is within the live allocation.
        (0..self.inner.len)
            .map(|i| unsafe { ptr::read_volatile(p.add(i)) })
            .collect()
    }

    /// Mutable contents, or `None` while an operation of this crate still uses the buffer.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        let inner = Arc::get_mut(&mut self.inner)?;
        // SAFETY: exclusive access: no in-flight operation holds the buffer.
        Some(unsafe { std::slice::from_raw_parts_mut(inner.ptr.as_ptr(), inner.len) })
    }

    /// Whether an operation still holds the buffer.
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.inner) > 1
    }

    pub(crate) fn check_range(
        &self,
        call: &'static str,
        range: &std::ops::Range<usize>,
    ) -> Result<()> {
        if range.start > range.end || range.end > self.inner.len {
            return Err(Error::InvalidArgument {
                call,
                detail: format!(
                    "range {range:?} outside a buffer of {} bytes",
                    self.inner.len
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::rules::*;
    use super::*;

    #[test]
    fn virt_addr_selects_address_or_offset() {
        assert_eq!(remote_base(MrMode::VIRT_ADDR, 0x7000_1000), 0x7000_1000);
        assert_eq!(remote_base(MrMode::empty(), 0x7000_1000), 0);
        let r = RemoteMemory {
            addr: remote_base(MrMode::VIRT_ADDR, 0x1000),
            key: 9,
            len: 64,
        };
        assert_eq!(r.address_at(8), 0x1008);
        let r = RemoteMemory {
            addr: remote_base(MrMode::LOCAL, 0x1000),
            key: 9,
            len: 64,
        };
        assert_eq!(r.address_at(8), 8);
    }

    #[test]
    fn prov_key_ignores_requested_key() {
        assert_eq!(requested_key(MrMode::PROV_KEY, 42), 0);
        assert_eq!(requested_key(MrMode::empty(), 42), 42);
    }

    #[test]
    fn endpoint_and_local_bits() {
        assert!(needs_endpoint(MrMode::ENDPOINT | MrMode::LOCAL));
        assert!(!needs_endpoint(MrMode::LOCAL));
        assert!(needs_desc(MrMode::LOCAL));
        assert!(!needs_desc(MrMode::VIRT_ADDR));
    }

    #[test]
    fn unsupported_bits_are_reported() {
        assert_eq!(unsupported(MrMode::SUPPORTED), MrMode::empty());
        assert_eq!(unsupported(MrMode::RAW | MrMode::LOCAL), MrMode::RAW);
        assert_eq!(unsupported(MrMode::RMA_EVENT), MrMode::RMA_EVENT);
    }

    #[test]
    fn remote_memory_round_trips() {
        let r = RemoteMemory {
            addr: 0xdead_beef_0000,
            key: 0x1234,
            len: 1 << 20,
        };
        assert_eq!(RemoteMemory::from_bytes(&r.to_bytes()).unwrap(), r);
        assert!(RemoteMemory::from_bytes(&[0; 3]).is_err());
    }
}
