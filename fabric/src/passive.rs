//! Passive endpoints (`fid_pep`): listening for MSG connections, accepting or rejecting them.

use crate::domain::{Fabric, FabricInner};
use crate::eq::EventQueue;
use crate::error::{cvt, Error, Result};
use crate::info::Info;
use crate::{close_fid, ffi, get_name};
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

pub(crate) struct PepInner {
    raw: *mut ffi::fid_pep,
    _fabric: Arc<FabricInner>,
    eq: EventQueue,
}

// SAFETY: passive endpoints are fabric objects used from any thread (FI_THREAD_SAFE).
unsafe impl Send for PepInner {}
// SAFETY: as above.
unsafe impl Sync for PepInner {}

impl Drop for PepInner {
    fn drop(&mut self) {
        // SAFETY: the fid of an open passive endpoint; the EQ field is released after.
        close_fid("passive endpoint", crate::fid_of(self.raw));
    }
}

/// A listening endpoint (`fid_pep`) for MSG connections.
#[derive(Clone)]
pub struct PassiveEndpoint {
    inner: Arc<PepInner>,
}

impl std::fmt::Debug for PassiveEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PassiveEndpoint")
            .field("raw", &self.inner.raw)
            .finish()
    }
}

impl PassiveEndpoint {
    /// Opens a passive endpoint bound to `eq` and starts listening (`fi_passive_ep`,
    /// `fi_pep_bind`, `fi_listen`).
    #[doc(alias = "fi_passive_ep")]
    #[doc(alias = "fi_listen")]
    pub fn listen(fabric: &Fabric, info: &Info, eq: &EventQueue) -> Result<PassiveEndpoint> {
        let mut raw = ptr::null_mut();
        // SAFETY: fabric is open, info valid; raw receives the pep.
        cvt("fi_passive_ep", unsafe {
            ffi::fi_passive_ep(
                fabric.inner.raw_ptr(),
                info.as_raw(),
                &mut raw,
                ptr::null_mut(),
            )
        })?;
        let pep = PepInner {
            raw,
            _fabric: Arc::clone(&fabric.inner),
            eq: eq.clone(),
        };
        // SAFETY: both are open objects of the same fabric.
        cvt("fi_pep_bind", unsafe {
            ffi::fi_pep_bind(raw, ptr::addr_of_mut!((*eq.inner.raw).fid), 0)
        })?;
        // SAFETY: the pep is open and bound.
        cvt("fi_listen", unsafe { ffi::fi_listen(raw) })?;
        Ok(PassiveEndpoint {
            inner: Arc::new(pep),
        })
    }

    /// The raw `fid_pep`.
    pub fn as_raw(&self) -> *mut ffi::fid_pep {
        self.inner.raw
    }

    /// Wraps an open, listening `fid_pep` bound to `eq`.
    ///
    /// # Safety
    /// `raw` must be an open passive endpoint of `fabric` bound to `eq`, owned by nobody
    /// else (closed on drop).
    pub unsafe fn from_raw(
        fabric: &Fabric,
        raw: *mut ffi::fid_pep,
        eq: &EventQueue,
    ) -> PassiveEndpoint {
        PassiveEndpoint {
            inner: Arc::new(PepInner {
                raw,
                _fabric: Arc::clone(&fabric.inner),
                eq: eq.clone(),
            }),
        }
    }

    /// The listening address, as bytes to give to connecting peers (`fi_getname`).
    #[doc(alias = "fi_getname")]
    pub fn name(&self) -> Result<Vec<u8>> {
        // SAFETY: the address of the open pep's fid.
        get_name(
            unsafe { ptr::addr_of_mut!((*self.inner.raw).fid) },
            "fi_getname",
        )
    }

    /// Waits for a connection request and returns the info to open the accepting
    /// endpoint with.
    pub fn wait_connreq(&self, timeout: Duration) -> Result<Info> {
        let ev = self
            .inner
            .eq
            .wait_event(ffi::FI_CONNREQ, "FI_CONNREQ", timeout)?;
        let got = ev.event;
        ev.info.ok_or(Error::UnexpectedEvent {
            call: "fi_eq_sread",
            expected: "FI_CONNREQ with info",
            got,
        })
    }

    /// Rejects a connection request (`fi_reject`).
    #[doc(alias = "fi_reject")]
    pub fn reject(&self, request: &Info) -> Result<()> {
        // SAFETY: handle comes from the connreq info.
        cvt("fi_reject", unsafe {
            ffi::fi_reject(self.inner.raw, (*request.as_raw()).handle, ptr::null(), 0)
        })
    }
}
