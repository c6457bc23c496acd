//! Counters (`fid_cntr`).

use crate::domain::{Domain, DomainInner};
use crate::error::{cvt, Error, Result};
use crate::{close_fid, ffi};
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) struct CntrInner {
    pub(crate) raw: *mut ffi::fid_cntr,
    _domain: Arc<DomainInner>,
}

// SAFETY: the counter belongs to an FI_THREAD_SAFE domain (checked in Domain::new).
unsafe impl Send for CntrInner {}
// SAFETY: as above.
unsafe impl Sync for CntrInner {}

impl Drop for CntrInner {
    fn drop(&mut self) {
        // SAFETY: the fid of an open counter; bound endpoints hold an Arc and are closed.
        let _guard = self._domain.control_guard();
        close_fid("counter", crate::fid_of(self.raw));
    }
}

/// A completion counter (`fid_cntr`), bound to endpoints with
/// [`crate::EndpointBuilder::counter`].
#[derive(Clone)]
pub struct Counter {
    pub(crate) inner: Arc<CntrInner>,
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counter")
            .field("value", &self.read())
            .finish()
    }
}

impl Counter {
    /// Opens a counter of completed operations (`fi_cntr_open`, `FI_CNTR_EVENTS_COMP`),
    /// waitable with [`Counter::wait`].
    #[doc(alias = "fi_cntr_open")]
    pub fn new(domain: &Domain) -> Result<Counter> {
        let mut attr = ffi::fi_cntr_attr {
            events: ffi::FI_CNTR_EVENTS_COMP,
            wait_obj: ffi::FI_WAIT_UNSPEC,
            ..Default::default()
        };
        let mut raw = ptr::null_mut();
        // SAFETY: domain is open; attr is valid; raw receives the counter.
        let ret =
            unsafe { ffi::fi_cntr_open(domain.inner.raw, &mut attr, &mut raw, ptr::null_mut()) };
        cvt("fi_cntr_open", ret)?;
        Ok(Counter {
            inner: Arc::new(CntrInner {
                raw,
                _domain: Arc::clone(&domain.inner),
            }),
        })
    }

    /// The raw `fid_cntr`.
    pub fn as_raw(&self) -> *mut ffi::fid_cntr {
        self.inner.raw
    }

    /// Wraps an open `fid_cntr` of `domain`.
    ///
    /// # Safety
    /// `raw` must be an open counter of `domain`, owned by nobody else (closed on drop).
    pub unsafe fn from_raw(domain: &Domain, raw: *mut ffi::fid_cntr) -> Counter {
        Counter {
            inner: Arc::new(CntrInner {
                raw,
                _domain: Arc::clone(&domain.inner),
            }),
        }
    }

    /// Completed operations (`fi_cntr_read`).
    #[doc(alias = "fi_cntr_read")]
    pub fn read(&self) -> u64 {
        // SAFETY: the counter is open.
        unsafe { ffi::fi_cntr_read(self.inner.raw) }
    }

    /// Failed operations (`fi_cntr_readerr`).
    #[doc(alias = "fi_cntr_readerr")]
    pub fn read_err(&self) -> u64 {
        // SAFETY: the counter is open.
        unsafe { ffi::fi_cntr_readerr(self.inner.raw) }
    }

    /// Adds to the value (`fi_cntr_add`).
    #[doc(alias = "fi_cntr_add")]
    pub fn add(&self, value: u64) -> Result<()> {
        // SAFETY: the counter is open.
        cvt("fi_cntr_add", unsafe {
            ffi::fi_cntr_add(self.inner.raw, value)
        })
    }

    /// Sets the value (`fi_cntr_set`).
    #[doc(alias = "fi_cntr_set")]
    pub fn set(&self, value: u64) -> Result<()> {
        // SAFETY: the counter is open.
        cvt("fi_cntr_set", unsafe {
            ffi::fi_cntr_set(self.inner.raw, value)
        })
    }

    /// Waits until the value reaches `threshold`; [`Error::TimedOut`] after `timeout`, or
    /// the counter's error count as [`Error::Call`] if it rises meanwhile.
    ///
    /// Implemented by polling `fi_cntr_read` (which progresses the provider), not with
    /// `fi_cntr_wait`: libfabric 1.17's utility counters (shm) ignore its timeout.
    #[doc(alias = "fi_cntr_wait")]
    pub fn wait(&self, threshold: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let errors = self.read_err();
        loop {
            if self.read() >= threshold {
                return Ok(());
            }
            let now_errors = self.read_err();
            if now_errors > errors {
                return Err(Error::Call {
                    call: "fi_cntr_readerr",
                    errno: ffi::FI_EIO,
                    message: format!("{} operation(s) failed", now_errors - errors),
                    context: format!(": waiting for {threshold}"),
                });
            }
            if Instant::now() >= deadline {
                return Err(Error::TimedOut {
                    call: "fi_cntr_wait",
                    after: timeout,
                });
            }
            std::thread::yield_now();
        }
    }
}
