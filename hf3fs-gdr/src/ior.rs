//! I/O rings (3FS's `struct hf3fs_ior`): a submission and a completion ring in shared
//! memory, handed to the daemon as a sealed memfd and served by it (`LocalRing`, here), or a
//! ring of 3FS's library (`lib_ring`).

mod lib_ring;

use crate::client::{self, IoBackend};
use crate::error::{Error, Result};
use crate::hf3fs::{self, Backend, Resolved};
use crate::iov::{Iov, IovInner};
use crate::ring::{
    ior_size, Cqe, RingView, Sqe, DAEMON_ATTACHED, DAEMON_NONE, RING_MAGIC, RING_VERSION,
};
use crate::ring_ops::RingOps;
use crate::shm::{futex_wait, futex_wake, random_id, to_hex, Id, Shm};
use crate::virt;
use lib_ring::LibRing;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most entries one ring may have.
pub const MAX_IOR_ENTRIES: u32 = 1 << 20;
/// `flags` bits 3FS defines (accepted; the local daemon reads only committed data).
pub const IOR_ALLOW_READ_UNCOMMITTED: u64 = 1;
/// See [`IOR_ALLOW_READ_UNCOMMITTED`].
pub const IOR_FORBID_READ_HOLES: u64 = 2;

/// How often a waiter checks that the daemon still lives.
const LIVENESS_EVERY: Duration = Duration::from_millis(2);
/// Longest single sleep of a waiter.
const MAX_SLEEP: Duration = Duration::from_millis(1);

/// An I/O ring. Like 3FS's, one thread prepares on a ring at a time: every method
/// that touches the rings takes `&mut self`. Served by the local daemon or by 3FS's
/// library, whichever serves its mount (see [`crate::hf3fs`]).
#[derive(Debug)]
pub struct Ior {
    ring: Box<dyn RingOps>,
    mount: PathBuf,
    for_read: bool,
    io_depth: i32,
    backend: Backend,
}

/// The local daemon's ring in shared memory.
#[derive(Debug)]
pub(crate) struct LocalRing {
    /// The ring's memory, mapped while the ring lives.
    _shm: Shm,
    view: RingView,
    id: Id,
    backend: Arc<dyn IoBackend>,
    /// Our copy of `sq_tail`.
    tail: u64,
    /// Our copy of `cq_head`.
    head: u64,
    /// The iov of each slot's I/O in flight, kept alive until its completion is reaped.
    in_flight: Vec<Option<Arc<IovInner>>>,
}

impl Ior {
    /// A ring of `entries` I/Os for reads (`for_read`) or writes, served by the daemon
    /// of `mount` (3FS's `hf3fs_iorcreate4`). `io_depth`: 0 = process I/Os as soon as
    /// they are seen; N > 0 = in batches of exactly N; N < 0 = at most −N at a time, a
    /// partial batch once `submit_ios` covered it or it waited `timeout`.
    #[doc(alias = "hf3fs_iorcreate4")]
    #[doc(alias = "hf3fs_iorcreate")]
    pub fn create(
        mount: impl AsRef<Path>,
        entries: u32,
        for_read: bool,
        io_depth: i32,
        timeout: Duration,
        numa: i32,
        flags: u64,
    ) -> Result<Self> {
        let mount = mount.as_ref();
        if entries == 0 || entries > MAX_IOR_ENTRIES {
            return Err(Error::InvalidArgument(format!(
                "{entries} ring entries (1..={MAX_IOR_ENTRIES})"
            )));
        }
        if io_depth.unsigned_abs() > entries {
            return Err(Error::InvalidArgument(format!(
                "io_depth {io_depth} exceeds the {entries} entries: batches could never fill"
            )));
        }
        if flags & !(IOR_ALLOW_READ_UNCOMMITTED | IOR_FORBID_READ_HOLES) != 0 {
            return Err(Error::InvalidArgument(format!(
                "unknown ior flags {flags:#x}"
            )));
        }
        let timeout_ms = i32::try_from(timeout.as_millis())
            .map_err(|_| Error::InvalidArgument(format!("timeout {timeout:?}")))?;
        let (ring, backend): (Box<dyn RingOps>, Backend) = match hf3fs::resolve(mount)? {
            Resolved::Daemon => (
                Box::new(LocalRing::create(
                    mount, entries, for_read, io_depth, timeout_ms, numa, flags,
                )?),
                Backend::LocalDaemon,
            ),
            Resolved::Hf3fs { lib, mount_point } => (
                Box::new(LibRing::create(
                    lib,
                    &mount_point,
                    entries,
                    for_read,
                    io_depth,
                    timeout_ms,
                    numa,
                    flags,
                )?),
                Backend::Hf3fs,
            ),
        };
        Ok(Self {
            ring,
            mount: mount.to_path_buf(),
            for_read,
            io_depth,
            backend,
        })
    }

    /// The ring's id (its name in the mount's ior directory).
    pub fn id(&self) -> &Id {
        self.ring.id()
    }

    /// How many I/Os the ring holds (3FS's `hf3fs_io_entries`).
    #[doc(alias = "hf3fs_io_entries")]
    pub fn entries(&self) -> u32 {
        self.ring.entries()
    }

    /// Whether it is a read ring.
    pub fn for_read(&self) -> bool {
        self.for_read
    }

    /// The `io_depth` it was created with.
    pub fn io_depth(&self) -> i32 {
        self.io_depth
    }

    /// I/Os prepared and not yet reaped.
    pub fn outstanding(&self) -> u64 {
        self.ring.outstanding()
    }

    /// Which backend serves it.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Prepares one I/O (3FS's `hf3fs_prep_io`): `len` bytes between `ptr` (inside
    /// `iov`: a host pointer, or a device pointer of a GPU iov) and file `fd`
    /// (registered with [`crate::reg_fd`]) at `offset`. Returns the I/O's index, which
    /// its completion carries with `userdata`. The daemon may start it before
    /// [`Ior::submit_ios`]; the iov's memory stays alive until the completion is reaped.
    #[doc(alias = "hf3fs_prep_io")]
    #[allow(clippy::too_many_arguments)]
    pub fn prep_io(
        &mut self,
        iov: &Iov,
        read: bool,
        ptr: u64,
        fd: RawFd,
        offset: u64,
        len: u64,
        userdata: u64,
    ) -> Result<i32> {
        if read != self.for_read {
            return Err(Error::InvalidArgument(format!(
                "a {} on a ring created for {}",
                if read { "read" } else { "write" },
                if self.for_read { "reads" } else { "writes" }
            )));
        }
        if len == 0 {
            return Err(Error::InvalidArgument("an I/O of 0 bytes".into()));
        }
        let base = iov.base();
        let inside = ptr >= base
            && (ptr - base)
                .checked_add(len)
                .is_some_and(|end| end <= iov.size());
        if !inside {
            return Err(Error::InvalidArgument(format!(
                "{ptr:#x}+{len} is not inside iov {:#x}+{}",
                base,
                iov.size()
            )));
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > i64::MAX as u64)
        {
            return Err(Error::InvalidArgument(format!("file range {offset}+{len}")));
        }
        if iov.backend() != self.backend {
            return Err(Error::InvalidArgument(format!(
                "iov {} is served by {:?}, the ring by {:?}",
                to_hex(iov.id()),
                iov.backend(),
                self.backend
            )));
        }
        self.ring.prep_io(iov, read, ptr, fd, offset, len, userdata)
    }

    /// Tells the daemon the prepared I/Os are complete batches (3FS's
    /// `hf3fs_submit_ios`): a partial batch of an `io_depth < 0` ring starts now.
    #[doc(alias = "hf3fs_submit_ios")]
    pub fn submit_ios(&mut self) -> Result<()> {
        self.ring.submit_ios()
    }

    /// Reaps completions into `cqes` (3FS's `hf3fs_wait_for_ios`), waiting until at
    /// least `min_results` arrived or `deadline` passed; returns how many were written
    /// (fewer than `min_results` only at the deadline). A daemon that died makes it
    /// return [`Error::DaemonGone`] within a few milliseconds, once the completions it
    /// posted before dying are reaped. Without a deadline, `min_results` may not exceed
    /// the I/Os outstanding (it could never be met).
    #[doc(alias = "hf3fs_wait_for_ios")]
    pub fn wait_for_ios(
        &mut self,
        cqes: &mut [Cqe],
        min_results: usize,
        deadline: Option<Instant>,
    ) -> Result<usize> {
        if min_results > cqes.len() {
            return Err(Error::InvalidArgument(format!(
                "min_results {min_results} > {} completion slots",
                cqes.len()
            )));
        }
        if deadline.is_none() && min_results as u64 > self.outstanding() {
            return Err(Error::InvalidArgument(format!(
                "waiting without a deadline for {min_results} completions with {} I/Os outstanding",
                self.outstanding()
            )));
        }
        self.ring.wait_for_ios(cqes, min_results, deadline)
    }

    /// Whether the daemon has attached (false only before it answered `create`, or if
    /// it detached). Always true for a 3FS ring.
    pub fn daemon_attached(&self) -> bool {
        self.ring.attached()
    }

    /// Whether the ring can still complete I/O, checked without waiting and without a
    /// request to the daemon (for pooled rings before reuse): [`Error::DaemonGone`] if
    /// the daemon's connection closed (it died or exited), SIGKILL is pending for it (its
    /// `/proc` status, read at most every `DOOM_CHECK_PERIOD` of the client: a killed
    /// daemon closes its socket only once the kernel has torn it down) or it stopped
    /// serving this ring. A daemon that is alive but frozen passes; deadlines of
    /// [`Ior::wait_for_ios`] bound that case. Always `Ok` for a 3FS ring (its library
    /// gives no liveness signal). A ring that failed stays failed: make a new one.
    pub fn check_alive(&self) -> Result<()> {
        self.ring.check_alive()
    }

    /// The mount it belongs to.
    pub fn mount(&self) -> &Path {
        &self.mount
    }
}

impl LocalRing {
    fn create(
        mount: &Path,
        entries: u32,
        for_read: bool,
        io_depth: i32,
        timeout_ms: i32,
        numa: i32,
        flags: u64,
    ) -> Result<Self> {
        virt::ensure_dirs(mount)?;
        let backend: Arc<dyn IoBackend> = client::connect(mount)?;
        let id = random_id()?;
        // A sealed memfd, passed to the daemon: no name anyone could open or truncate,
        // and the daemon can trust that its mapping never shrinks.
        let shm = Shm::create_sealed(&format!("hf3fs-gdr-ior-{}", to_hex(&id)), ior_size(entries))?;
        shm.prefer_numa(numa)?;
        // SAFETY: the mapping has ior_size(entries) bytes, page aligned, and lives in `shm`
        // as long as the view (both owned by the ring).
        let view = unsafe { RingView::new(shm.as_ptr(), entries) };
        // SAFETY: fresh zeroed memory nobody else has mapped yet: plain writes of the
        // immutable fields, then the magic last.
        unsafe {
            let h = shm.as_ptr() as *mut crate::ring::RingHeader;
            (*h).version = RING_VERSION;
            (*h).entries = entries;
            (*h).for_read = for_read as u32;
            (*h).io_depth = io_depth;
            (*h).timeout_ms = timeout_ms;
            (*h).numa = numa;
            (*h).flags = flags;
            (*h).id = id;
            (*h).client_pid = std::process::id();
            (*h).magic = RING_MAGIC;
        }
        backend.attach_ring(&id, shm.fd())?;
        Ok(Self {
            _shm: shm,
            view,
            id,
            backend,
            tail: 0,
            head: 0,
            in_flight: vec![None; entries as usize],
        })
    }

    fn reap(&mut self, cqes: &mut [Cqe], got: &mut usize) {
        let h = self.view.header();
        let tail = h.cq_tail.0.load(Ordering::Acquire);
        let mut head = self.head;
        while head < tail && *got < cqes.len() {
            let cqe = self.view.read_cqe(head);
            if let Some(slot) = self.in_flight.get_mut(cqe.index as usize) {
                *slot = None;
            }
            cqes[*got] = cqe;
            *got += 1;
            head += 1;
        }
        if head != self.head {
            self.head = head;
            h.cq_head.0.store(head, Ordering::Release);
        }
    }
}

impl RingOps for LocalRing {
    fn id(&self) -> &Id {
        &self.id
    }

    fn entries(&self) -> u32 {
        self.view.entries()
    }

    fn outstanding(&self) -> u64 {
        self.tail - self.head
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
        let entries = self.view.entries();
        if self.tail - self.head >= entries as u64 {
            return Err(Error::RingFull { entries });
        }
        self.backend
            .register_iov(&iov.inner.id, &|| iov.inner.registration())?;
        let file_id = self.backend.file_id(fd)?;
        let sqe = Sqe {
            iov_id: *iov.id(),
            iov_offset: ptr - iov.base(),
            file_offset: offset,
            len,
            userdata,
            file_id,
            read: read as u32,
            _reserved: [0],
        };
        let seq = self.tail;
        self.view.write_sqe(seq, &sqe);
        let slot = (seq % entries as u64) as usize;
        self.in_flight[slot] = Some(iov.inner.clone());
        self.tail += 1;
        self.view
            .header()
            .sq_tail
            .0
            .store(self.tail, Ordering::Release);
        Ok(slot as i32)
    }

    fn submit_ios(&mut self) -> Result<()> {
        let h = self.view.header();
        h.sq_submitted.0.store(self.tail, Ordering::Release);
        h.sq_doorbell.0.fetch_add(1, Ordering::SeqCst);
        if h.daemon_sleeping.0.load(Ordering::SeqCst) != 0 {
            futex_wake(&h.sq_doorbell.0);
        }
        Ok(())
    }

    fn wait_for_ios(
        &mut self,
        cqes: &mut [Cqe],
        min_results: usize,
        deadline: Option<Instant>,
    ) -> Result<usize> {
        let mut got = 0;
        let mut idle_rounds = 0u32;
        let mut last_check = Instant::now();
        loop {
            self.reap(cqes, &mut got);
            if got >= min_results || got == cqes.len() {
                return Ok(got);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(got);
            }
            if now - last_check >= LIVENESS_EVERY {
                last_check = now;
                if let Err(e) = self.backend.check_alive() {
                    // Whatever it posted before dying is still reaped.
                    self.reap(cqes, &mut got);
                    return if got > 0 { Ok(got) } else { Err(e) };
                }
            }
            idle_rounds += 1;
            if idle_rounds < 64 {
                std::hint::spin_loop();
            } else if idle_rounds < 96 {
                std::thread::yield_now();
            } else {
                let h = self.view.header();
                let bell = h.cq_doorbell.0.load(Ordering::SeqCst);
                h.client_sleeping.0.store(1, Ordering::SeqCst);
                if h.cq_tail.0.load(Ordering::SeqCst) == self.head {
                    let mut sleep = MAX_SLEEP;
                    if let Some(d) = deadline {
                        sleep = sleep.min(d.saturating_duration_since(now));
                    }
                    futex_wait(&h.cq_doorbell.0, bell, sleep);
                }
                h.client_sleeping.0.store(0, Ordering::SeqCst);
            }
        }
    }

    fn attached(&self) -> bool {
        self.view.header().daemon_state.load(Ordering::Acquire) != DAEMON_NONE
    }

    fn check_alive(&self) -> Result<()> {
        self.backend.check_alive()?;
        match self.view.header().daemon_state.load(Ordering::Acquire) {
            DAEMON_ATTACHED => Ok(()),
            state => Err(Error::DaemonGone {
                mount: self.backend.mount().to_path_buf(),
                why: format!(
                    "it does not serve ring {} (state {state}: {})",
                    to_hex(&self.id),
                    if state == DAEMON_NONE {
                        "never attached"
                    } else {
                        "detached"
                    }
                ),
            }),
        }
    }
}

impl Drop for LocalRing {
    fn drop(&mut self) {
        // The daemon stops serving the ring after its I/Os in flight finish, so no
        // completion lands in memory we are about to release.
        if let Err(e) = self.backend.detach_ring(&self.id) {
            tracing::debug!("ior {}: detach: {e}", to_hex(&self.id));
        }
    }
}
