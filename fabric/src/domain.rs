//! `fid_fabric` and `fid_domain`, and the background progress of manual-progress domains.

use crate::error::{cvt, Error, Result};
use crate::info::{Info, MrMode, Threading};
use crate::{close_fid, ffi};
use parking_lot::Mutex;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

pub(crate) struct FabricInner {
    raw: *mut ffi::fid_fabric,
}

// SAFETY: libfabric fabric objects are thread-safe (fi_fabric(3): the fabric is shared by
// all domains, and every domain this crate opens is FI_THREAD_SAFE).
unsafe impl Send for FabricInner {}
// SAFETY: as above.
unsafe impl Sync for FabricInner {}

impl FabricInner {
    pub(crate) fn raw_ptr(&self) -> *mut ffi::fid_fabric {
        self.raw
    }
}

impl Drop for FabricInner {
    fn drop(&mut self) {
        // SAFETY: the fid of an open fabric.
        close_fid("fabric", crate::fid_of(self.raw));
    }
}

/// A fabric (`fid_fabric`): the root of a provider's objects.
#[derive(Clone)]
pub struct Fabric {
    pub(crate) inner: Arc<FabricInner>,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fabric")
            .field("raw", &self.inner.raw)
            .finish()
    }
}

impl Fabric {
    /// Opens the fabric described by `info` (`fi_fabric`).
    #[doc(alias = "fi_fabric")]
    pub fn new(info: &Info) -> Result<Fabric> {
        let mut raw = ptr::null_mut();
        // SAFETY: info's fabric_attr is valid; raw receives the new object.
        let ret =
            unsafe { ffi::fi_fabric((*info.as_raw()).fabric_attr, &mut raw, ptr::null_mut()) };
        cvt("fi_fabric", ret).map_err(|e| e.context(|| info.provider_name().to_owned()))?;
        Ok(Fabric {
            inner: Arc::new(FabricInner { raw }),
        })
    }

    /// The raw `fid_fabric`.
    pub fn as_raw(&self) -> *mut ffi::fid_fabric {
        self.inner.raw
    }

    /// Wraps an open `fid_fabric`.
    ///
    /// # Safety
    /// `raw` must be an open fabric, owned by nobody else: it is closed when the last
    /// clone (and every child object) is dropped.
    pub unsafe fn from_raw(raw: *mut ffi::fid_fabric) -> Fabric {
        Fabric {
            inner: Arc::new(FabricInner { raw }),
        }
    }
}

/// What a domain's background thread progresses: its completion queues (`cq`). A trait
/// here, so that the domain (which every queue holds) does not import the queues.
pub(crate) trait Progressed: Send + Sync {
    /// Progresses the provider without consuming entries.
    fn progress(&self);
}

/// Completion queues progressed by a manual-progress domain's background thread.
pub(crate) struct ProgressSet {
    cqs: Mutex<Vec<Weak<dyn Progressed>>>,
    /// Held while the thread progresses a queue and while the domain's objects are
    /// created, bound, enabled or closed: libfabric 1.17's rxm crashes when an endpoint is
    /// enabled or closed during another thread's progress of a queue of the domain.
    lock: Mutex<()>,
    stop: AtomicBool,
    interval: Duration,
}

impl ProgressSet {
    pub(crate) fn add<Q: Progressed + 'static>(&self, cq: &Arc<Q>) {
        let cq: Weak<Q> = Arc::downgrade(cq);
        let cq: Weak<dyn Progressed> = cq;
        let mut cqs = self.cqs.lock();
        cqs.retain(|w| w.strong_count() > 0);
        cqs.push(cq);
    }

    fn run(self: Arc<Self>) {
        while !self.stop.load(Ordering::Relaxed) {
            let cqs: Vec<Arc<dyn Progressed>> = {
                let cqs = self.cqs.lock();
                cqs.iter().filter_map(Weak::upgrade).collect()
            };
            for cq in &cqs {
                let _guard = self.lock.lock();
                cq.progress();
            }
            // Dropping the last reference to a queue here closes it on this thread, which
            // is fine: the domain it holds never joins this thread.
            drop(cqs);
            std::thread::sleep(self.interval);
        }
    }
}

pub(crate) struct DomainInner {
    pub(crate) raw: *mut ffi::fid_domain,
    pub(crate) fabric: Arc<FabricInner>,
    pub(crate) info: Info,
    pub(crate) mr_mode: MrMode,
    pub(crate) next_key: AtomicU64,
    pub(crate) progress: Option<Arc<ProgressSet>>,
}

// SAFETY: Domain::new only opens FI_THREAD_SAFE domains: every call may come from any
// thread (fi_domain(3), "FI_THREAD_SAFE").
unsafe impl Send for DomainInner {}
// SAFETY: as above.
unsafe impl Sync for DomainInner {}

impl DomainInner {
    /// Serialises control operations on this domain's objects with the background
    /// progress.
    pub(crate) fn control_guard(&self) -> Option<parking_lot::MutexGuard<'_, ()>> {
        self.progress.as_ref().map(|p| p.lock.lock())
    }

    pub(crate) fn fabric_raw(&self) -> *mut ffi::fid_fabric {
        self.fabric.raw
    }
}

impl Drop for DomainInner {
    fn drop(&mut self) {
        if let Some(p) = &self.progress {
            p.stop.store(true, Ordering::Relaxed);
        }
        // SAFETY: the fid of an open domain; every child holds an Arc to this, so all of
        // them are closed already.
        close_fid("domain", crate::fid_of(self.raw));
    }
}

/// A resource domain (`fid_domain`): one NIC/port of a provider.
///
/// A domain runs a background thread (every 200 µs by default) that progresses its
/// completion queues without reading their entries, so RMA targets, receivers and
/// connection teardown advance even when the application is not polling: needed by
/// `FI_PROGRESS_MANUAL` providers (`tcp;ofi_rxm`, `shm`, `udp;ofi_rxd`) and in practice by
/// `tcp` 1.17's MSG endpoints. [`Domain::with_progress_interval`] changes or disables it
/// (a busy-polling application, such as a benchmark, does not need it).
#[derive(Clone)]
pub struct Domain {
    pub(crate) inner: Arc<DomainInner>,
}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain")
            .field("provider", &self.inner.info.provider_name())
            .field("mr_mode", &self.inner.mr_mode)
            .field("auto_progress", &self.inner.progress.is_some())
            .finish()
    }
}

/// Default interval of the background progress thread.
pub(crate) const DEFAULT_PROGRESS_INTERVAL: Duration = Duration::from_micros(200);

impl Domain {
    /// Opens a domain of `fabric` (`fi_domain`), with background progress.
    #[doc(alias = "fi_domain")]
    pub fn new(fabric: &Fabric, info: &Info) -> Result<Domain> {
        Self::with_progress_interval(fabric, info, Some(DEFAULT_PROGRESS_INTERVAL))
    }

    /// Like [`new`](Self::new); `interval` sets the background progress period (`None`:
    /// no thread; the application's own queue reads and posts are then the only progress,
    /// as in a busy-polling benchmark).
    pub fn with_progress_interval(
        fabric: &Fabric,
        info: &Info,
        interval: Option<Duration>,
    ) -> Result<Domain> {
        if info.threading() != Threading::SAFE {
            return Err(Error::Unsupported {
                call: "fi_domain",
                errno: ffi::FI_EINVAL,
                detail: format!(
                    "threading {:?}: this crate shares objects across threads and needs FI_THREAD_SAFE",
                    info.threading()
                ),
            });
        }
        let mut raw = ptr::null_mut();
        // SAFETY: fabric is open and info is valid; raw receives the new object.
        let ret =
            unsafe { ffi::fi_domain(fabric.inner.raw, info.as_raw(), &mut raw, ptr::null_mut()) };
        cvt("fi_domain", ret).map_err(|e| e.context(|| info.provider_name().to_owned()))?;
        // Manual-progress providers need it; so does `tcp` 1.17 although it reports
        // FI_PROGRESS_AUTO (a passive RMA target or a peer's FI_SHUTDOWN only advance when
        // its queues are read). Progressing an auto-progress domain is harmless.
        let progress = match interval {
            Some(interval) => {
                let set = Arc::new(ProgressSet {
                    cqs: Mutex::new(Vec::new()),
                    lock: Mutex::new(()),
                    stop: AtomicBool::new(false),
                    interval,
                });
                let thread_set = Arc::clone(&set);
                std::thread::Builder::new()
                    .name("fabric-progress".into())
                    .spawn(move || thread_set.run())
                    .map_err(|e| Error::Call {
                        call: "fi_domain",
                        errno: e.raw_os_error().unwrap_or(ffi::FI_EOTHER),
                        message: e.to_string(),
                        context: ": spawning the progress thread".into(),
                    })?;
                Some(set)
            }
            None => None,
        };
        Ok(Domain {
            inner: Arc::new(DomainInner {
                raw,
                fabric: Arc::clone(&fabric.inner),
                info: info.clone(),
                mr_mode: info.mr_mode(),
                next_key: AtomicU64::new(1),
                progress,
            }),
        })
    }

    /// The raw `fid_domain`.
    pub fn as_raw(&self) -> *mut ffi::fid_domain {
        self.inner.raw
    }

    /// Wraps an open `fid_domain` of `fabric`.
    ///
    /// # Safety
    /// `raw` must be an open `FI_THREAD_SAFE` domain of `fabric`, opened from `info`,
    /// owned by nobody else (it is closed on drop).
    pub unsafe fn from_raw(fabric: &Fabric, info: &Info, raw: *mut ffi::fid_domain) -> Domain {
        Domain {
            inner: Arc::new(DomainInner {
                raw,
                fabric: Arc::clone(&fabric.inner),
                info: info.clone(),
                mr_mode: info.mr_mode(),
                next_key: AtomicU64::new(1),
                progress: None,
            }),
        }
    }

    /// The `mr_mode` bits the provider requires of this domain's registrations.
    pub fn mr_mode(&self) -> MrMode {
        self.inner.mr_mode
    }

    /// The info the domain was opened with.
    pub fn info(&self) -> &Info {
        &self.inner.info
    }

    /// Whether a background thread progresses this domain.
    pub fn has_auto_progress(&self) -> bool {
        self.inner.progress.is_some()
    }
}
