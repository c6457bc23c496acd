//! Shared receive queues.

use crate::error::{cvt, cvt_ptr, ret_errno, Error, Result};
use crate::ffi;
use crate::pd::ProtectionDomain;
use crate::wr::{link_recv, RecvWr};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

pub(crate) struct SrqInner {
    srq: NonNull<ffi::ibv_srq>,
    _pd: ProtectionDomain,
}

// SAFETY: rdma-core SRQs may be posted to and modified from any thread (providers lock
// the queue).
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using the SRQ holds a clone, so none is left.
        let ret = unsafe { ffi::ibv_destroy_srq(self.srq.as_ptr()) };
        if let Err(err) = cvt(ret, "ibv_destroy_srq") {
            tracing::error!(%err, "destroying a shared receive queue failed");
        }
    }
}

/// A shared receive queue (`struct ibv_srq`). Cheap to clone.
#[derive(Clone)]
pub struct SharedReceiveQueue {
    inner: Arc<SrqInner>,
}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("handle", &self.handle())
            .finish()
    }
}

/// SRQ attributes (`struct ibv_srq_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrqAttr {
    /// `max_wr`
    pub max_wr: u32,
    /// `max_sge`
    pub max_sge: u32,
    /// `srq_limit`: armed limit (0 = not armed).
    pub srq_limit: u32,
}

impl ProtectionDomain {
    /// Create a shared receive queue (`ibv_create_srq`). [`Error::Unsupported`] when the
    /// device announces no SRQ support (`max_srq == 0`).
    #[doc(alias = "ibv_create_srq")]
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        if self.context().query_device()?.max_srq() == 0 {
            return Err(Error::Unsupported {
                call: "ibv_create_srq",
            });
        }
        // SAFETY: all-zero is a valid `ibv_srq_init_attr`.
        let mut init: ffi::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        init.attr.max_wr = max_wr;
        init.attr.max_sge = max_sge;
        // SAFETY: live PD; `init` fully initialised.
        let srq = cvt_ptr(
            unsafe { ffi::ibv_create_srq(self.as_raw(), &mut init) },
            "ibv_create_srq",
        )?;
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                srq,
                _pd: self.clone(),
            }),
        })
    }
}

impl SharedReceiveQueue {
    /// The raw `ibv_srq`.
    pub fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.inner.srq.as_ptr()
    }

    /// Kernel handle (matches `AsyncElement::Srq`).
    pub fn handle(&self) -> u32 {
        // SAFETY: live SRQ.
        unsafe { (*self.as_raw()).handle }
    }

    /// Post receives (`ibv_post_srq_recv`).
    #[doc(alias = "ibv_post_srq_recv")]
    pub fn post_recv(&self, wrs: &mut [RecvWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        link_recv(wrs);
        let mut bad = std::ptr::null_mut();
        // SAFETY: live SRQ; the chain and its SGEs are valid for the call.
        let ret = unsafe { ffi::ibv_post_srq_recv(self.as_raw(), &mut wrs[0].raw, &mut bad) };
        if ret == 0 {
            return Ok(());
        }
        let index = if bad.is_null() {
            0
        } else {
            (bad as usize - wrs.as_ptr() as usize) / std::mem::size_of::<RecvWr<'_>>()
        };
        Err(match ret_errno(ret) {
            libc::ENOMEM => Error::QueueFull {
                call: "ibv_post_srq_recv",
                qp_num: self.handle(),
                index,
            },
            errno => Error::Post {
                call: "ibv_post_srq_recv",
                qp_num: self.handle(),
                index,
                source: std::io::Error::from_raw_os_error(errno),
            },
        })
    }

    /// Arm the limit event: when fewer than `limit` receives remain, the context reports
    /// `SRQ_LIMIT_REACHED` once (`ibv_modify_srq` with `IBV_SRQ_LIMIT`).
    #[doc(alias = "ibv_modify_srq")]
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        // SAFETY: all-zero is a valid `ibv_srq_attr`.
        let mut attr: ffi::ibv_srq_attr = unsafe { std::mem::zeroed() };
        attr.srq_limit = limit;
        // SAFETY: live SRQ.
        cvt(
            unsafe { ffi::ibv_modify_srq(self.as_raw(), &mut attr, ffi::IBV_SRQ_LIMIT as i32) },
            "ibv_modify_srq",
        )
    }

    /// Current attributes (`ibv_query_srq`).
    #[doc(alias = "ibv_query_srq")]
    pub fn query(&self) -> Result<SrqAttr> {
        // SAFETY: all-zero is a valid `ibv_srq_attr`.
        let mut attr: ffi::ibv_srq_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live SRQ, valid out-pointer.
        let ret = unsafe { ffi::ibv_query_srq(self.as_raw(), &mut attr) };
        cvt(ret, "ibv_query_srq")?;
        Ok(SrqAttr {
            max_wr: attr.max_wr,
            max_sge: attr.max_sge,
            srq_limit: attr.srq_limit,
        })
    }
}
