//! Prepared descriptor lists and transfer requests as Python objects.
//!
//! Both are released explicitly (`release()`) or when Python collects them: the Rust
//! value is dropped, which for an in-flight request cancels it (the agent's contract:
//! nothing more is issued, and its notification never arrives before all of its data).

use crate::device::GpuHandle;
use crate::errors::{nixlInvalidParamError, IntoPyResult};
use nixl::{PostParams, XferDlist, XferReq, XferStatus};
use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;
use std::sync::OnceLock;
use std::time::Instant;

/// A list prepared by `prep_xfer_dlist` (NIXL's `nixlDlistH`).
#[derive(Debug)]
#[pyclass(module = "rdma_nixl._core", frozen)]
pub struct Dlist {
    pub(crate) inner: Mutex<Option<XferDlist>>,
}

impl Dlist {
    pub(crate) fn new(list: XferDlist) -> Self {
        Self {
            inner: Mutex::new(Some(list)),
        }
    }

    /// The list, or an error once released.
    pub(crate) fn lock(&self) -> PyResult<MutexGuard<'_, Option<XferDlist>>> {
        let guard = self.inner.lock();
        if guard.is_none() {
            return Err(nixlInvalidParamError::new_err(
                "the prepared descriptor list was released",
            ));
        }
        Ok(guard)
    }
}

#[pymethods]
impl Dlist {
    /// Frees the list (idempotent). Freeing may wait on the backend (device tables of
    /// a prepared list), so it runs without the GIL.
    fn release(&self, py: Python<'_>) {
        py.detach(|| {
            let taken = self.inner.lock().take();
            drop(taken);
        });
    }

    /// Whether `release` was called.
    #[getter]
    fn released(&self) -> bool {
        self.inner.lock().is_none()
    }

    /// Number of descriptors (0 once released).
    fn __len__(&self) -> usize {
        self.inner.lock().as_ref().map_or(0, XferDlist::len)
    }
}

/// A transfer request (NIXL's `nixlXferReqH`): posted any number of times.
#[derive(Debug)]
#[pyclass(module = "rdma_nixl._core", frozen)]
pub struct Xfer {
    inner: Mutex<Option<XferReq>>,
    backend: String,
}

impl Xfer {
    pub(crate) fn new(req: XferReq) -> Self {
        Self {
            backend: req.backend_name().to_string(),
            inner: Mutex::new(Some(req)),
        }
    }

    fn with<T>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut XferReq) -> nixl::Result<T> + Send,
    ) -> PyResult<T>
    where
        T: Send,
    {
        // Posting issues the operations and a status poll may progress the transport
        // (no progress thread): both run without the GIL so other Python threads move on.
        py.detach(|| {
            let mut guard = self.inner.lock();
            match guard.as_mut() {
                Some(req) => Ok(f(req)),
                None => Err(()),
            }
        })
        .map_err(|()| {
            crate::errors::nixlInvalidParamError::new_err("the transfer handle was released")
        })?
        .py_err()
    }
}

fn status_str(status: XferStatus) -> &'static str {
    match status {
        XferStatus::Done => "DONE",
        XferStatus::InProgress => "PROC",
    }
}

/// Microseconds since the first telemetry read of the process: NIXL reports a
/// steady-clock start time in microseconds, whose origin is likewise arbitrary.
fn micros_since_origin(t: Instant) -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let origin = *ORIGIN.get_or_init(|| Instant::now() - std::time::Duration::from_secs(1));
    u64::try_from(t.saturating_duration_since(origin).as_micros()).unwrap_or(u64::MAX)
}

#[pymethods]
impl Xfer {
    /// Posts the request; `notif` (when given) replaces its notification from now on.
    /// Returns `"DONE"` when it finished within the call, else `"PROC"`.
    #[pyo3(signature = (notif=None))]
    fn post(&self, py: Python<'_>, notif: Option<Vec<u8>>) -> PyResult<&'static str> {
        let _cuda = crate::keep_cuda_context();
        self.with(py, |req| req.post_with(notif, &PostParams::default()))
            .map(status_str)
    }

    /// Polls: `"DONE"` or `"PROC"`; a failure raises (terminal: the request is spent).
    ///
    /// A poll that finds the transfer still moving yields the CPU once before returning:
    /// Python callers spin on this in a tight loop, and on a machine with few cores that
    /// loop otherwise starves the backend's progress threads that move the data (the
    /// yield multiplies the transfers/s on 2 cores and costs next to nothing when nothing
    /// else wants the CPU: `docs/BENCHMARKS.md` in the repository).
    fn status(&self, py: Python<'_>) -> PyResult<&'static str> {
        let _cuda = crate::keep_cuda_context();
        self.with(py, |req| {
            let status = req.status()?;
            if status == XferStatus::InProgress {
                std::thread::yield_now();
            }
            Ok(status)
        })
        .map(status_str)
    }

    /// The backend carrying it.
    #[getter]
    fn backend(&self) -> &str {
        &self.backend
    }

    /// `(start_us, post_duration_us, xfer_duration_us, total_bytes, desc_count)` of the
    /// last post; durations not yet known are 0. Durations are rounded up to whole
    /// microseconds (NIXL's unit), so a post that took any time never reads as 0.
    fn telemetry(&self, py: Python<'_>) -> PyResult<(u64, u64, u64, u64, u64)> {
        self.with(py, |req| Ok(req.telemetry())).map(|t| {
            let micros = |d: std::time::Duration| {
                u64::try_from(d.as_nanos().div_ceil(1000)).unwrap_or(u64::MAX)
            };
            (
                t.post_time.map_or(0, micros_since_origin),
                micros(t.post_duration),
                t.xfer_duration.map_or(0, micros),
                t.total_bytes,
                t.desc_count as u64,
            )
        })
    }

    /// A handle for kernels to post this request's descriptors themselves (NIXL's
    /// `createGpuXferReq`): descriptor `i` is `desc_idx` `i` of the device calls. The
    /// request's backend must have a device API (`GPUNETIO`), else
    /// `nixlNotSupportedError`.
    fn create_gpu_xfer_req(&self, py: Python<'_>) -> PyResult<GpuHandle> {
        let _cuda = crate::keep_cuda_context();
        self.with(py, |req| req.create_gpu_xfer_req())
            .map(GpuHandle::from_xfer_req)
    }

    /// Releases the request (idempotent); one in flight is canceled.
    fn release(&self, py: Python<'_>) {
        py.detach(|| {
            let taken = self.inner.lock().take();
            drop(taken);
        });
    }

    /// Whether `release` was called.
    #[getter]
    fn released(&self) -> bool {
        self.inner.lock().is_none()
    }
}

/// A prepared list goes with the caller's CUDA context kept (see `Agent`'s `Drop`).
impl Drop for Dlist {
    fn drop(&mut self) {
        let _cuda = crate::keep_cuda_context();
        drop(self.inner.get_mut().take());
    }
}

/// A request goes with the caller's CUDA context kept (see `Agent`'s `Drop`).
impl Drop for Xfer {
    fn drop(&mut self) {
        let _cuda = crate::keep_cuda_context();
        drop(self.inner.get_mut().take());
    }
}
