//! Memory windows: allocation, binding (type 1 through `ibv_bind_mw`, type 2 through a
//! `BIND_MW` work request) and invalidation.
//!
//! A window is a second remote key onto part of a [`MemoryRegion`], with its own access
//! rights, that can be moved or revoked cheaply without re-registering the region:
//!
//! - **type 1** ([`MwType::TYPE_1`]) is bound with [`QueuePair::bind_mw`]
//!   (`ibv_bind_mw`), on any QP of the window's protection domain; every bind gives it a
//!   new rkey, so re-binding revokes the previous one;
//! - **type 2** ([`MwType::TYPE_2`]) is bound by a work request on the QP through which
//!   the peer will use it ([`QueuePair::bind_mw`], or [`WrBatch::bind_mw`]
//!   for the `ibv_wr_*` API), and only that QP's peer may use the rkey; it is revoked by
//!   a local invalidation ([`SendWr::local_inv`], [`WrBatch::local_inv`]) or by the
//!   peer with a SEND that invalidates it ([`SendWr::send_with_inv`],
//!   [`WrBatch::send_inv`]).
//!
//! After a revocation, remote access with the old rkey completes at the peer with
//! [`WcStatus::REM_ACCESS_ERR`](crate::WcStatus::REM_ACCESS_ERR).
//!
//! A bound window keeps the region's registration and buffer alive (it holds a share
//! of it) until the window is bound elsewhere or dropped, so remote access through a
//! window never reaches freed memory.
//!
//! [`QueuePair::bind_mw`]: crate::QueuePair::bind_mw
//! [`WrBatch`]: crate::WrBatch
//! [`WrBatch::bind_mw`]: crate::WrBatch::bind_mw
//! [`WrBatch::local_inv`]: crate::WrBatch::local_inv
//! [`WrBatch::send_inv`]: crate::WrBatch::send_inv
//! [`SendWr::local_inv`]: crate::SendWr::local_inv
//! [`SendWr::send_with_inv`]: crate::SendWr::send_with_inv

use crate::error::{cvt, cvt_ptr, Result};
use crate::ffi;
use crate::mr::{AccessFlags, MemoryRegion, MrInner, RemoteMemory};
use crate::newtype::c_newtype;
use crate::pd::ProtectionDomain;
use std::fmt;
use std::ops::RangeBounds;
use std::ptr::NonNull;
use std::sync::Arc;

c_newtype! {
    /// Memory window type (`enum ibv_mw_type`).
    #[doc(alias = "ibv_mw_type")]
    MwType(u32) {
        /// `IBV_MW_TYPE_1`: bound with `ibv_bind_mw`, usable through any QP of the PD.
        TYPE_1 = ffi::IBV_MW_TYPE_1,
        /// `IBV_MW_TYPE_2`: bound by a work request, usable only through the QP that
        /// bound it; invalidated by `LOCAL_INV` or `SEND_WITH_INV`.
        TYPE_2 = ffi::IBV_MW_TYPE_2,
    }
}

/// What a window is bound to: a share of the region (keeps it registered) and the range.
#[derive(Clone)]
pub(crate) struct Binding {
    _mr: Arc<MrInner>,
    pub(crate) remote: RemoteMemory,
}

/// A window's state before a bind, to undo a bind that was never posted.
pub(crate) struct SavedBinding {
    rkey: u32,
    bound: Option<Binding>,
}

struct MwInner {
    mw: NonNull<ffi::ibv_mw>,
    bound: Option<Binding>,
}

// SAFETY: rdma-core objects may be used from any thread (libibverbs is thread-safe); the
// window is only changed through `&mut MemoryWindow`.
unsafe impl Send for MwInner {}
// SAFETY: shared access only reads the handle.
unsafe impl Sync for MwInner {}

impl Drop for MwInner {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_mw (or handed over through `from_raw`),
        // deallocated once.
        let ret = unsafe { ffi::ibv_dealloc_mw(self.mw.as_ptr()) };
        if let Err(err) = cvt(ret, "ibv_dealloc_mw") {
            tracing::error!(
                %err,
                "deallocating a memory window failed; keeping its region registered"
            );
            // The device may still reach the region through the window: never
            // deregister it or free its buffer.
            if let Some(binding) = self.bound.take() {
                std::mem::forget(binding);
            }
        }
    }
}

/// A memory window (`struct ibv_mw`), allocated with [`ProtectionDomain::alloc_mw`]. See
/// the [module docs](crate::mw) for types 1 and 2.
#[doc(alias = "ibv_mw")]
pub struct MemoryWindow {
    inner: MwInner,
    pd: ProtectionDomain,
}

impl fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow")
            .field("type", &self.mw_type())
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("bound", &self.remote())
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocate a memory window of `mw_type` (`ibv_alloc_mw`).
    /// [`Error::Unsupported`](crate::Error::Unsupported) where the provider or device has
    /// no memory windows (see
    /// [`DeviceAttr::max_mw`](crate::DeviceAttr::max_mw) and the `MEM_WINDOW*` bits of
    /// [`DeviceAttr::device_cap_flags`](crate::DeviceAttr::device_cap_flags)).
    #[doc(alias = "ibv_alloc_mw")]
    pub fn alloc_mw(&self, mw_type: MwType) -> Result<MemoryWindow> {
        // SAFETY: live PD; the library checks that the provider implements the call.
        let mw = cvt_ptr(
            unsafe { ffi::ibv_alloc_mw(self.as_raw(), mw_type.0) },
            "ibv_alloc_mw",
        )?;
        Ok(MemoryWindow {
            inner: MwInner { mw, bound: None },
            pd: self.clone(),
        })
    }
}

impl MemoryWindow {
    /// The raw `ibv_mw`.
    pub fn as_raw(&self) -> *mut ffi::ibv_mw {
        self.inner.mw.as_ptr()
    }

    /// Wrap a raw, unbound window, deallocated on drop.
    ///
    /// # Safety
    /// `mw` must be a valid window of `pd` that nothing else deallocates, and must not
    /// be bound (the wrapper could not keep the bound region alive).
    pub unsafe fn from_raw(mw: NonNull<ffi::ibv_mw>, pd: ProtectionDomain) -> Self {
        MemoryWindow {
            inner: MwInner { mw, bound: None },
            pd,
        }
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Type 1 or 2.
    pub fn mw_type(&self) -> MwType {
        // SAFETY: live window.
        MwType(unsafe { (*self.as_raw()).type_ })
    }

    /// The current remote key: the one the last bind gave it (from the moment the bind
    /// was posted).
    pub fn rkey(&self) -> u32 {
        // SAFETY: live window.
        unsafe { (*self.as_raw()).rkey }
    }

    /// Kernel handle.
    pub fn handle(&self) -> u32 {
        // SAFETY: live window.
        unsafe { (*self.as_raw()).handle }
    }

    /// What a peer uses: the range and rkey of the last bind, if any. After an
    /// invalidation (local or by the peer) the rkey no longer works, but the window still
    /// reports it until it is bound again.
    pub fn remote(&self) -> Option<RemoteMemory> {
        self.inner.bound.as_ref().map(|b| b.remote)
    }

    /// The bind description for `range` of `mr`, and the binding it will create with
    /// `rkey`.
    pub(crate) fn bind_info(
        mr: &MemoryRegion,
        range: impl RangeBounds<usize>,
        access: AccessFlags,
        rkey: u32,
    ) -> (ffi::ibv_mw_bind_info, Binding) {
        let (start, end) = mr.bounds(range);
        let info = ffi::ibv_mw_bind_info {
            mr: mr.as_raw(),
            addr: mr.addr() + start as u64,
            length: (end - start) as u64,
            mw_access_flags: access.bits(),
        };
        let binding = Binding {
            _mr: Arc::clone(&mr.inner),
            remote: RemoteMemory {
                addr: info.addr,
                len: info.length,
                rkey,
            },
        };
        (info, binding)
    }

    /// Record a posted bind: the new rkey and the region it holds. Returns what to
    /// restore if the bind is withdrawn before it is posted.
    pub(crate) fn set_bound(&mut self, rkey: u32, binding: Binding) -> SavedBinding {
        // SAFETY: live window; `&mut self` is the only access.
        let old = unsafe { std::mem::replace(&mut (*self.as_raw()).rkey, rkey) };
        SavedBinding {
            rkey: old,
            bound: self.inner.bound.replace(binding),
        }
    }

    /// Undo [`set_bound`](Self::set_bound) for a bind that was not posted.
    pub(crate) fn restore(&mut self, saved: SavedBinding) {
        // SAFETY: live window; `&mut self` is the only access.
        unsafe { (*self.as_raw()).rkey = saved.rkey };
        self.inner.bound = saved.bound;
    }
}
