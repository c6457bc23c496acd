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
//! [`WrBatch`]: crate::WrBatch
//! [`WrBatch::bind_mw`]: crate::WrBatch::bind_mw
//! [`WrBatch::local_inv`]: crate::WrBatch::local_inv
//! [`WrBatch::send_inv`]: crate::WrBatch::send_inv
//! [`SendWr::local_inv`]: crate::SendWr::local_inv
//! [`SendWr::send_with_inv`]: crate::SendWr::send_with_inv

use crate::device::c_newtype;
use crate::error::{cvt, cvt_ptr, Error, Result};
use crate::ffi;
use crate::mr::{AccessFlags, MemoryRegion, MrInner, RemoteMemory};
use crate::pd::ProtectionDomain;
use crate::qp::{post_error, QpState, QueuePair, SendFlags};
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
    remote: RemoteMemory,
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
    /// Allocate a memory window of `mw_type` (`ibv_alloc_mw`). [`Error::Unsupported`]
    /// where the provider or device has no memory windows (see
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

impl QueuePair {
    /// Bind `mw` to `range` of `mr` with the remote rights `access` (some of
    /// `REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC`); returns what the peer uses (the
    /// range and the window's new rkey).
    ///
    /// - type 1: `ibv_bind_mw` (any QP of the window's PD may bind it);
    /// - type 2: an `IBV_WR_BIND_MW` work request (`ibv_post_send`) on the QP whose peer
    ///   will use the window, with rkey `ibv_inc_rkey(old)`.
    ///
    /// The bind is a work request: with [`SendFlags::SIGNALED`] it completes with
    /// [`WcOpcode::BIND_MW`](crate::WcOpcode::BIND_MW) (or
    /// [`WcStatus::MW_BIND_ERR`](crate::WcStatus::MW_BIND_ERR), e.g. when `mr` was
    /// registered without [`AccessFlags::MW_BIND`]); tell the peer the rkey after that
    /// completion. The window keeps `mr`'s registration alive until it is bound again or
    /// dropped.
    ///
    /// A bind that completes with an error leaves the QP in the error state and the
    /// window with an rkey the device never gave it (the provider advances it when the
    /// bind is posted): drop such a window and allocate a new one.
    ///
    /// # Panics
    /// If `range` is outside `mr`.
    #[doc(alias = "ibv_bind_mw")]
    #[doc(alias = "IBV_WR_BIND_MW")]
    pub fn bind_mw(
        &self,
        mw: &mut MemoryWindow,
        wr_id: u64,
        flags: SendFlags,
        mr: &MemoryRegion,
        range: impl RangeBounds<usize>,
        access: AccessFlags,
    ) -> Result<RemoteMemory> {
        let state = QpState(
            // SAFETY: live QP.
            unsafe { (*self.as_raw()).state },
        );
        if matches!(state, QpState::RESET | QpState::INIT | QpState::RTR) {
            return Err(Error::InvalidQpState {
                call: "ibv_bind_mw",
                qp_num: self.qp_num(),
                state,
                need: "binding a window is a send work request: it needs RTS",
            });
        }
        match mw.mw_type() {
            MwType::TYPE_1 => {
                // The provider picks the new rkey and writes it into the window.
                let (info, mut binding) = MemoryWindow::bind_info(mr, range, access, 0);
                let mut bind = ffi::ibv_mw_bind {
                    wr_id,
                    send_flags: flags.bits(),
                    bind_info: info,
                };
                // SAFETY: live QP, window and region; `bind` is read during the call.
                let ret = unsafe { ffi::ibv_bind_mw(self.as_raw(), mw.as_raw(), &mut bind) };
                post_error(
                    ret,
                    "ibv_bind_mw",
                    self.qp_num(),
                    std::ptr::null(),
                    std::ptr::null(),
                    1,
                )?;
                binding.remote.rkey = mw.rkey();
                let remote = binding.remote;
                mw.set_bound(remote.rkey, binding);
                Ok(remote)
            }
            _ => {
                // SAFETY: pure function.
                let rkey = unsafe { ffi::ibv_inc_rkey(mw.rkey()) };
                let (info, binding) = MemoryWindow::bind_info(mr, range, access, rkey);
                // SAFETY: all-zero is a valid `ibv_send_wr`.
                let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
                wr.wr_id = wr_id;
                wr.opcode = ffi::IBV_WR_BIND_MW;
                wr.send_flags = flags.bits();
                wr.__bindgen_anon_2.bind_mw = ffi::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
                    mw: mw.as_raw(),
                    rkey,
                    bind_info: info,
                };
                let mut bad = std::ptr::null_mut();
                // SAFETY: live QP; one work request that points to the live window and
                // region, read during the call.
                let ret = unsafe { ffi::ibv_post_send(self.as_raw(), &mut wr, &mut bad) };
                post_error(
                    ret,
                    "ibv_post_send (IBV_WR_BIND_MW)",
                    self.qp_num(),
                    std::ptr::null(),
                    std::ptr::null(),
                    1,
                )?;
                let remote = binding.remote;
                mw.set_bound(rkey, binding);
                Ok(remote)
            }
        }
    }
}
