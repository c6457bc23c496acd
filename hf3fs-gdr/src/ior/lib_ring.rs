//! A ring served by 3FS: `hf3fs_iorcreate4` / `hf3fs_prep_io` / `hf3fs_submit_ios` /
//! `hf3fs_wait_for_ios` / `hf3fs_iordestroy` behind [`crate::Ior`]. It lives with the
//! rings, not in [`crate::hf3fs`]: a ring holds [`Iov`]s, which are built on `hf3fs`'s
//! library iovs, so the library layer stays below the iovs and the rings above them.

use crate::error::{Error, Result};
use crate::fd_registry;
use crate::hf3fs::{c_mount, cvt, ffi, Library};
use crate::iov::{Iov, IovInner};
use crate::ring::Cqe;
use crate::ring_ops::RingOps;
use crate::shm::Id;
use std::cell::UnsafeCell;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug)]
pub(crate) struct LibRing {
    lib: Arc<Library>,
    /// In a cell: the library owns its contents once created.
    raw: Box<UnsafeCell<ffi::hf3fs_ior>>,
    id: Id,
    entries: u32,
    prepared: u64,
    reaped: u64,
    /// The iov of each index's I/O in flight, kept alive until its completion is reaped.
    in_flight: Vec<Option<Arc<IovInner>>>,
    /// Completions as the library writes them, converted into the caller's [`Cqe`]s.
    scratch: Vec<ffi::hf3fs_cqe>,
}

// SAFETY: the ring struct and its handle are the library's, usable from any thread;
// 3FS forbids concurrent preparation on one ring, which `&mut self` on every call that
// touches it enforces.
unsafe impl Send for LibRing {}
// SAFETY: shared references reach only plain fields of ours (id, counts).
unsafe impl Sync for LibRing {}

impl LibRing {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create(
        lib: Arc<Library>,
        mount_point: &Path,
        entries: u32,
        for_read: bool,
        io_depth: i32,
        timeout_ms: i32,
        numa: i32,
        flags: u64,
    ) -> Result<Self> {
        let cmount = c_mount(mount_point)?;
        let entries_arg = libc::c_int::try_from(entries)
            .map_err(|_| Error::InvalidArgument(format!("{entries} ring entries")))?;
        let raw = Box::new(UnsafeCell::new(ffi::hf3fs_ior::zeroed()));
        // SAFETY: a writable zeroed struct the library fills; NUL-terminated mount.
        let ret = unsafe {
            (lib.usrbio.iorcreate4)(
                raw.get(),
                cmount.as_ptr(),
                entries_arg,
                for_read,
                io_depth,
                timeout_ms,
                numa,
                flags,
            )
        };
        cvt("hf3fs_iorcreate4", ret)?;
        // SAFETY: filled by the library; `iov.id` is the ring's shared-memory id.
        let id = unsafe { (*raw.get()).iov.id };
        Ok(Self {
            lib,
            raw,
            id,
            entries,
            prepared: 0,
            reaped: 0,
            in_flight: vec![None; entries as usize],
            scratch: Vec::new(),
        })
    }
}

/// `deadline` as the absolute `CLOCK_REALTIME` time 3FS's wait takes.
fn realtime_deadline(deadline: Instant) -> libc::timespec {
    let left = deadline.saturating_duration_since(Instant::now());
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
    let nsec = now.tv_nsec as u64 + left.subsec_nanos() as u64;
    libc::timespec {
        tv_sec: now.tv_sec
            + left.as_secs() as libc::time_t
            + (nsec / 1_000_000_000) as libc::time_t,
        tv_nsec: (nsec % 1_000_000_000) as _,
    }
}

impl RingOps for LibRing {
    fn id(&self) -> &Id {
        &self.id
    }

    fn entries(&self) -> u32 {
        self.entries
    }

    fn outstanding(&self) -> u64 {
        self.prepared - self.reaped
    }

    fn prep_io(
        &mut self,
        iov: &Iov,
        read: bool,
        ptr: u64,
        fd: RawFd,
        offset: u64,
        len: u64,
        userdata: u64,
    ) -> Result<i32> {
        let lib_iov = iov
            .inner
            .lib_iov()
            .ok_or_else(|| Error::InvalidArgument("a local-daemon iov on a 3FS ring".into()))?;
        if !Arc::ptr_eq(&lib_iov.lib, &self.lib) {
            return Err(Error::InvalidArgument(format!(
                "iov of {} on a ring of {}",
                lib_iov.lib.path().display(),
                self.lib.path().display()
            )));
        }
        if self.outstanding() >= self.entries as u64 {
            return Err(Error::RingFull {
                entries: self.entries,
            });
        }
        let identity = fd_registry::registered_identity(fd)?;
        self.lib.ensure_registered(fd, identity)?;
        // SAFETY: a live ring and iov of this library; `ptr..ptr+len` lies inside the iov
        // (checked by `Ior`) which `in_flight` keeps alive until the completion is
        // reaped; userdata is an opaque value 3FS hands back.
        let ret = unsafe {
            (self.lib.usrbio.prep_io)(
                self.raw.get(),
                lib_iov.as_ptr(),
                read,
                ptr as *mut libc::c_void,
                fd,
                offset as usize,
                len,
                userdata as *const libc::c_void,
            )
        };
        if ret == -libc::EAGAIN {
            return Err(Error::RingFull {
                entries: self.entries,
            });
        }
        let index = cvt("hf3fs_prep_io", ret)?;
        let slot = index as usize;
        if slot >= self.in_flight.len() {
            self.in_flight.resize(slot + 1, None);
        }
        self.in_flight[slot] = Some(iov.inner.clone());
        self.prepared += 1;
        Ok(index)
    }

    fn submit_ios(&mut self) -> Result<()> {
        // SAFETY: a live ring.
        cvt("hf3fs_submit_ios", unsafe {
            (self.lib.usrbio.submit_ios)(self.raw.get())
        })
        .map(drop)
    }

    fn wait_for_ios(
        &mut self,
        cqes: &mut [Cqe],
        min_results: usize,
        deadline: Option<Instant>,
    ) -> Result<usize> {
        if cqes.is_empty() {
            return Ok(0);
        }
        let cqec = libc::c_int::try_from(cqes.len()).unwrap_or(libc::c_int::MAX);
        self.scratch.clear();
        self.scratch.resize(cqec as usize, ffi::hf3fs_cqe::zeroed());
        let abs = deadline.map(realtime_deadline);
        let abs_ptr = abs
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: a live ring; `scratch` has `cqec` writable entries; `abs` outlives the
        // call.
        let ret = unsafe {
            (self.lib.usrbio.wait_for_ios)(
                self.raw.get(),
                self.scratch.as_mut_ptr(),
                cqec,
                min_results as libc::c_int,
                abs_ptr,
            )
        };
        let n = (cvt("hf3fs_wait_for_ios", ret)? as usize).min(cqes.len());
        for (out, c) in cqes.iter_mut().zip(&self.scratch[..n]) {
            if let Some(slot) = self.in_flight.get_mut(c.index as usize) {
                *slot = None;
            }
            *out = Cqe {
                index: c.index,
                reserved: c.reserved,
                result: c.result,
                userdata: c.userdata as u64,
            };
        }
        self.reaped += n as u64;
        Ok(n)
    }

    fn attached(&self) -> bool {
        true
    }

    fn check_alive(&self) -> Result<()> {
        // The library gives no liveness signal; waits are bounded by their deadlines.
        Ok(())
    }
}

impl Drop for LibRing {
    fn drop(&mut self) {
        // SAFETY: created by the library, destroyed once; iovs of I/O in flight are
        // released only after (the `in_flight` field drops after this body).
        unsafe { (self.lib.usrbio.iordestroy)(self.raw.get()) };
    }
}
