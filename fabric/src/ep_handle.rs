//! The endpoint handle: [`Endpoint`]'s type and the `fid_ep` it owns, apart from its
//! builder and operations (`ep`). Memory registration (`mr`) binds a region to an
//! endpoint under `FI_MR_ENDPOINT` and the endpoint's operations take registered memory:
//! with the type here, `mr` and `ep` both import this module and not each other.

use crate::av::AddressVector;
use crate::cntr::Counter;
use crate::cq::CompletionQueue;
use crate::domain::DomainInner;
use crate::eq::EventQueue;
use crate::info::EndpointType;
use crate::{close_fid, ffi};
use std::any::Any;
use std::ptr;
use std::sync::Arc;

pub(crate) struct EpInner {
    pub(crate) raw: *mut ffi::fid_ep,
    pub(crate) domain: Arc<DomainInner>,
    pub(crate) tx_cq: Option<CompletionQueue>,
    pub(crate) rx_cq: Option<CompletionQueue>,
    pub(crate) _av: Option<AddressVector>,
    pub(crate) eq: Option<EventQueue>,
    pub(crate) _counters: Vec<Counter>,
    pub(crate) ep_type: EndpointType,
    /// The scalable endpoint a transmit/receive context belongs to (closed after it; held
    /// as a keepalive only, so this module does not import `scalable`).
    pub(crate) _parent: Option<Arc<dyn Any + Send + Sync>>,
}

// SAFETY: the endpoint belongs to an FI_THREAD_SAFE domain (checked in Domain::new): posts
// may come from any thread.
unsafe impl Send for EpInner {}
// SAFETY: as above.
unsafe impl Sync for EpInner {}

impl Drop for EpInner {
    fn drop(&mut self) {
        // SAFETY: the fid of an open endpoint. Its CQs, AV, EQ and counters are fields,
        // released after this (the endpoint closes first).
        let _guard = self.domain.control_guard();
        close_fid("endpoint", crate::fid_of(self.raw));
    }
}

/// An endpoint (`fid_ep`): RDM (connectionless, with an [`AddressVector`](crate::AddressVector)) or MSG
/// (connected: [`connect`](Self::connect) / [`accept`](Self::accept)).
///
/// Operations come in two forms. Safe ones take a [`RegisteredBuffer`](crate::RegisteredBuffer) and keep it alive
/// until their completion is read from the queue. `unsafe` `*_raw` ones take caller memory
/// and a [`MemoryRegion`](crate::MemoryRegion) descriptor. Both return
/// [`Error::WouldBlock`](crate::Error::WouldBlock) on `FI_EAGAIN`
/// (after progressing the endpoint's queues); the `*_sync` helpers retry and wait.
///
/// A context is any `u64` with the top bit clear (the crate uses the top bit for its own
/// bookkeeping); it comes back in the [`Completion`](crate::Completion).
#[derive(Clone)]
pub struct Endpoint {
    pub(crate) inner: Arc<EpInner>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("type", &self.inner.ep_type)
            .field("raw", &self.inner.raw)
            .finish()
    }
}

impl Endpoint {
    pub(crate) fn fid(&self) -> *mut ffi::fid {
        // SAFETY: the address of the open endpoint's fid.
        unsafe { ptr::addr_of_mut!((*self.inner.raw).fid) }
    }
}
