//! Protection domains and address handles.

use crate::device::{Context, Gid};
use crate::endpoint::Endpoint;
use crate::error::{cvt, cvt_ptr, Result};
use crate::ffi;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<ffi::ibv_pd>,
    pub(crate) ctx: Context,
}

// SAFETY: libibverbs objects may be used from any thread (rdma-core is thread-safe; a PD
// is only read by the verbs that take it).
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR/QP/SRQ/AH of this PD holds a clone, so none is left.
        let ret = unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
        if let Err(err) = cvt(ret, "ibv_dealloc_pd") {
            tracing::error!(%err, "deallocating a protection domain failed");
        }
    }
}

/// A protection domain (`struct ibv_pd`). Cheap to clone.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("handle", &self.handle())
            .finish()
    }
}

impl Context {
    /// Allocate a protection domain (`ibv_alloc_pd`).
    #[doc(alias = "ibv_alloc_pd")]
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        // SAFETY: open context.
        let pd = cvt_ptr(unsafe { ffi::ibv_alloc_pd(self.as_raw()) }, "ibv_alloc_pd")?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                pd,
                ctx: self.clone(),
            }),
        })
    }
}

impl ProtectionDomain {
    /// The raw `ibv_pd`.
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.inner.pd.as_ptr()
    }

    /// Wrap a raw PD, which this wrapper deallocates when the last clone drops.
    ///
    /// # Safety
    /// `pd` must be a valid PD of `ctx` that nothing else deallocates.
    pub unsafe fn from_raw(pd: NonNull<ffi::ibv_pd>, ctx: Context) -> Self {
        ProtectionDomain {
            inner: Arc::new(PdInner { pd, ctx }),
        }
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Kernel handle of the PD.
    pub fn handle(&self) -> u32 {
        // SAFETY: the PD is live.
        unsafe { (*self.as_raw()).handle }
    }

    /// Create an address handle for UD sends (`ibv_create_ah`).
    #[doc(alias = "ibv_create_ah")]
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        let mut raw = attr.raw;
        // SAFETY: live PD; `raw` is a fully initialised `ibv_ah_attr`.
        let ah = cvt_ptr(
            unsafe { ffi::ibv_create_ah(self.as_raw(), &mut raw) },
            "ibv_create_ah",
        )?;
        Ok(AddressHandle {
            inner: AhInner {
                ah,
                _pd: self.clone(),
            },
        })
    }
}

/// Address vector of a UD destination (`struct ibv_ah_attr`); setters are named after
/// the C fields.
#[derive(Clone, Copy)]
pub struct AhAttr {
    raw: ffi::ibv_ah_attr,
}

impl fmt::Debug for AhAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AhAttr")
            .field("dgid", &Gid::from(self.raw.grh.dgid))
            .field("dlid", &self.raw.dlid)
            .field("port_num", &self.raw.port_num)
            .field("sgid_index", &self.raw.grh.sgid_index)
            .finish_non_exhaustive()
    }
}

impl Default for AhAttr {
    fn default() -> Self {
        // SAFETY: all-zero is a valid `ibv_ah_attr`.
        let mut raw: ffi::ibv_ah_attr = unsafe { std::mem::zeroed() };
        raw.port_num = 1;
        raw.grh.hop_limit = 64;
        AhAttr { raw }
    }
}

impl AhAttr {
    /// An address vector towards `remote` (global routing when it has a GID), leaving
    /// through `port_num` with the local GID `sgid_index`.
    pub fn from_endpoint(remote: &Endpoint, port_num: u8, sgid_index: u8) -> Self {
        let mut attr = AhAttr::default().port_num(port_num).dlid(remote.lid);
        if !remote.gid.is_zero() {
            attr = attr.dgid(remote.gid).sgid_index(sgid_index);
        }
        attr
    }
    /// `port_num`
    pub fn port_num(mut self, port: u8) -> Self {
        self.raw.port_num = port;
        self
    }
    /// `dlid`
    pub fn dlid(mut self, lid: u16) -> Self {
        self.raw.dlid = lid;
        self
    }
    /// `sl`
    pub fn sl(mut self, sl: u8) -> Self {
        self.raw.sl = sl;
        self
    }
    /// `grh.dgid`; also sets `is_global`.
    pub fn dgid(mut self, gid: Gid) -> Self {
        self.raw.grh.dgid = gid.into();
        self.raw.is_global = 1;
        self
    }
    /// `grh.sgid_index`
    pub fn sgid_index(mut self, index: u8) -> Self {
        self.raw.grh.sgid_index = index;
        self
    }
    /// `grh.hop_limit`
    pub fn hop_limit(mut self, hops: u8) -> Self {
        self.raw.grh.hop_limit = hops;
        self
    }
    /// `grh.traffic_class`
    pub fn traffic_class(mut self, tc: u8) -> Self {
        self.raw.grh.traffic_class = tc;
        self
    }
    /// `grh.flow_label`
    pub fn flow_label(mut self, label: u32) -> Self {
        self.raw.grh.flow_label = label;
        self
    }
    /// The C struct.
    pub fn as_ffi(&self) -> &ffi::ibv_ah_attr {
        &self.raw
    }
}

struct AhInner {
    ah: NonNull<ffi::ibv_ah>,
    _pd: ProtectionDomain,
}

// SAFETY: an AH is immutable after creation; rdma-core allows its use (posting) from any
// thread.
unsafe impl Send for AhInner {}
// SAFETY: as above.
unsafe impl Sync for AhInner {}

impl Drop for AhInner {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_ah, destroyed once.
        let ret = unsafe { ffi::ibv_destroy_ah(self.ah.as_ptr()) };
        if let Err(err) = cvt(ret, "ibv_destroy_ah") {
            tracing::error!(%err, "destroying an address handle failed");
        }
    }
}

/// An address handle (`struct ibv_ah`): the destination of UD sends.
pub struct AddressHandle {
    inner: AhInner,
}

impl fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AddressHandle").finish_non_exhaustive()
    }
}

impl AddressHandle {
    /// The raw `ibv_ah`.
    pub fn as_raw(&self) -> *mut ffi::ibv_ah {
        self.inner.ah.as_ptr()
    }

    /// Wrap a raw AH, destroyed on drop.
    ///
    /// # Safety
    /// `ah` must be a valid AH of `pd` that nothing else destroys.
    pub unsafe fn from_raw(ah: NonNull<ffi::ibv_ah>, pd: ProtectionDomain) -> Self {
        AddressHandle {
            inner: AhInner { ah, _pd: pd },
        }
    }
}
