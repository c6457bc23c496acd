//! Scalable endpoints (`fid_ep` with transmit and receive contexts): one address, several
//! contexts each driven by its own thread.

use crate::av::AddressVector;
use crate::cq::CompletionQueue;
use crate::domain::{Domain, DomainInner};
use crate::ep_handle::{Endpoint, EpInner};
use crate::error::{cvt, Result};
use crate::info::{EndpointType, Info};
use crate::{close_fid, ffi, fid_of, get_name};
use std::ptr;
use std::sync::Arc;

pub(crate) struct SepInner {
    raw: *mut ffi::fid_ep,
    domain: Arc<DomainInner>,
    _av: AddressVector,
}

// SAFETY: the scalable endpoint belongs to an FI_THREAD_SAFE domain.
unsafe impl Send for SepInner {}
// SAFETY: as above.
unsafe impl Sync for SepInner {}

impl Drop for SepInner {
    fn drop(&mut self) {
        let _guard = self.domain.control_guard();
        // Its contexts hold an Arc to this and are closed already.
        close_fid("scalable endpoint", crate::fid_of(self.raw));
    }
}

/// A scalable endpoint (`fi_scalable_ep`): one address, several transmit and receive
/// contexts, each an [`Endpoint`] with its own completion queue, usable from its own
/// thread. Peers target receive context `i` with [`Address::rx_context`](crate::Address::rx_context).
///
/// Offered by `sockets` here (`FI_NAMED_RX_CTX`); other providers answer
/// [`Error::Unsupported`](crate::Error::Unsupported).
#[derive(Clone)]
pub struct ScalableEndpoint {
    inner: Arc<SepInner>,
}

impl std::fmt::Debug for ScalableEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScalableEndpoint")
            .field("raw", &self.inner.raw)
            .finish()
    }
}

impl ScalableEndpoint {
    /// Opens a scalable endpoint with `info`'s `tx_ctx_cnt`/`rx_ctx_cnt` contexts and binds
    /// the address vector (`fi_scalable_ep`, `fi_scalable_ep_bind`).
    #[doc(alias = "fi_scalable_ep")]
    pub fn new(domain: &Domain, info: &Info, av: &AddressVector) -> Result<ScalableEndpoint> {
        let _guard = domain.inner.control_guard();
        let mut raw = ptr::null_mut();
        // SAFETY: the domain is open, info valid; raw receives the endpoint.
        let ret = unsafe {
            ffi::fi_scalable_ep(domain.inner.raw, info.as_raw(), &mut raw, ptr::null_mut())
        };
        cvt("fi_scalable_ep", ret).map_err(|e| e.context(|| info.provider_name().to_owned()))?;
        // SAFETY: both objects are open and belong to the same domain.
        let bound = cvt("fi_scalable_ep_bind", unsafe {
            ffi::fi_scalable_ep_bind(raw, fid_of(av.inner.raw), 0)
        });
        if let Err(e) = bound {
            close_fid("scalable endpoint", fid_of(raw));
            return Err(e);
        }
        Ok(ScalableEndpoint {
            inner: Arc::new(SepInner {
                raw,
                domain: Arc::clone(&domain.inner),
                _av: av.clone(),
            }),
        })
    }

    /// The raw `fid_ep` of the scalable endpoint.
    pub fn as_raw(&self) -> *mut ffi::fid_ep {
        self.inner.raw
    }

    /// Wraps an open scalable endpoint of `domain` bound to `av`.
    ///
    /// # Safety
    /// `raw` must be an open scalable endpoint of `domain` bound to `av`, owned by nobody
    /// else (closed on drop).
    pub unsafe fn from_raw(domain: &Domain, raw: *mut ffi::fid_ep, av: &AddressVector) -> Self {
        ScalableEndpoint {
            inner: Arc::new(SepInner {
                raw,
                domain: Arc::clone(&domain.inner),
                _av: av.clone(),
            }),
        }
    }

    fn context(&self, tx: bool, index: i32, cq: &CompletionQueue) -> Result<Endpoint> {
        let call = if tx { "fi_tx_context" } else { "fi_rx_context" };
        let _guard = self.inner.domain.control_guard();
        let mut raw = ptr::null_mut();
        // SAFETY: the scalable endpoint is open; NULL attributes take the endpoint's.
        let ret = unsafe {
            if tx {
                ffi::fi_tx_context(
                    self.inner.raw,
                    index,
                    ptr::null_mut(),
                    &mut raw,
                    ptr::null_mut(),
                )
            } else {
                ffi::fi_rx_context(
                    self.inner.raw,
                    index,
                    ptr::null_mut(),
                    &mut raw,
                    ptr::null_mut(),
                )
            }
        };
        cvt(call, ret).map_err(|e| e.context(|| format!("index {index}")))?;
        let flags = if tx { ffi::FI_TRANSMIT } else { ffi::FI_RECV };
        // SAFETY: the context and the CQ are open objects of the same domain.
        let setup = cvt("fi_ep_bind", unsafe {
            ffi::fi_ep_bind(raw, fid_of(cq.inner.raw), flags)
        })
        // SAFETY: the context is open and bound.
        .and_then(|()| cvt("fi_enable", unsafe { ffi::fi_enable(raw) }));
        if let Err(e) = setup {
            close_fid("endpoint context", fid_of(raw));
            return Err(e);
        }
        Ok(Endpoint {
            inner: Arc::new(EpInner {
                raw,
                domain: Arc::clone(&self.inner.domain),
                tx_cq: tx.then(|| cq.clone()),
                rx_cq: (!tx).then(|| cq.clone()),
                _av: None,
                eq: None,
                _counters: Vec::new(),
                ep_type: EndpointType::RDM,
                _parent: Some(Arc::clone(&self.inner) as Arc<dyn std::any::Any + Send + Sync>),
            }),
        })
    }

    /// Transmit context `index`, bound to `cq` and enabled (`fi_tx_context`).
    #[doc(alias = "fi_tx_context")]
    pub fn tx_context(&self, index: i32, cq: &CompletionQueue) -> Result<Endpoint> {
        self.context(true, index, cq)
    }

    /// Receive context `index`, bound to `cq` and enabled (`fi_rx_context`).
    #[doc(alias = "fi_rx_context")]
    pub fn rx_context(&self, index: i32, cq: &CompletionQueue) -> Result<Endpoint> {
        self.context(false, index, cq)
    }

    /// Enables the scalable endpoint once its contexts exist (`fi_enable`).
    #[doc(alias = "fi_enable")]
    pub fn enable(&self) -> Result<()> {
        let _guard = self.inner.domain.control_guard();
        // SAFETY: the scalable endpoint is open and bound to its AV.
        cvt("fi_enable", unsafe { ffi::fi_enable(self.inner.raw) })
    }

    /// The endpoint's address, shared by all its contexts (`fi_getname`).
    #[doc(alias = "fi_getname")]
    pub fn name(&self) -> Result<Vec<u8>> {
        get_name(fid_of(self.inner.raw), "fi_getname")
    }
}
