//! `FILE`: storage transfers between memory (DRAM, VRAM) and files, through the
//! `hf3fs-gdr` daemon serving a mount directory (feature `file`). NIXL's POSIX, GDS and
//! HF3FS plugins play this role upstream; unlike them, this one reads files into VRAM
//! without GPUDirect Storage (the daemon stages through pinned memory or uses cuFile).
//!
//! # Memory
//! - **FILE** regions follow NIXL's `FILE_SEG`: `dev_id` is an open file descriptor,
//!   `addr` the file offset, `len` the bytes addressable from there. Registration checks
//!   that the descriptor is open and hands it to `hf3fs_gdr::reg_fd`; a transfer checks
//!   again that the number still names the same file (a closed or reused descriptor is
//!   a typed `EBADF` error, never I/O on whatever file took its number).
//! - **VRAM** is published to the daemon with `Iov::wrap_gpu` (its CUDA-IPC handle): the
//!   daemon reads into and writes from the user's own allocation, no copy here.
//! - **DRAM** is zero-copy where the daemon can map it: memory that is a shared mapping
//!   of a file under `/dev/shm` (e.g. an `hf3fs_gdr::Iov`, or `shm_open` + `mmap
//!   MAP_SHARED`) is wrapped as a host iov. Other host memory (`malloc`, anonymous
//!   `mmap`) cannot be reached by another process, so it is **staged**: pieces of at
//!   most `staging_slot_size` bytes go through a library-owned shared-memory iov
//!   (`staging_size` bytes per backend), copied by the thread that posts (WRITE) or
//!   checks (READ) the transfer. [`crate::Agent::query_mem`] says which:
//!   `FILE(zero-copy)`, `FILE(staged)` or `FILE(direct)` (VRAM).
//!
//! # Transfers
//! Local only, as NIXL's storage plugins: the "remote" agent is the agent itself, whose
//! FILE registrations the remote list names (`prep_xfer_dlist(Some(own name), ..)`).
//! READ moves file → memory, WRITE memory → file. The local list is DRAM or VRAM, the
//! remote list FILE. A transfer's descriptors are cut into I/Os of at most
//! `max_io_size` bytes, spread round-robin over up to `rings` I/O rings (taken from a
//! pool per direction when posted, returned when done), at most `entries` in flight per
//! ring. `post` submits; `check` reaps completions without blocking and submits more. A
//! short count (a READ past the end of the file) or a −errno completion fails the
//! transfer at `check` with [`Error::Backend`] carrying the errno (`ENODATA` for a
//! short count). A daemon that dies fails it with `ENOTCONN`: while I/O is outstanding
//! and nothing completed for `PROBE_AFTER`, `check` asks the rings whether their
//! daemon lives (at most every `PROBE_EVERY`, without waiting: a poll of the daemon's
//! socket, which closes when it ends, and at most every `DOOM_CHECK_PERIOD` of
//! `hf3fs_gdr`'s client its `/proc` status, which shows a SIGKILL pending as soon as it
//! is sent, long before a loaded host has torn the daemon down).
//!
//! # Daemon restarts
//! A daemon that is killed and started again on the same mount is used again without
//! anything from the application: registrations stay valid (FILE descriptors are
//! registered in this process, keyed by number, and handed to whichever daemon a ring
//! attaches to; host memory is published under the mount, where the new daemon finds
//! it). A post asks an idle ring whether its daemon still serves it before taking it
//! (as `check` asks above); a dead daemon's idle rings are dropped there, and fresh
//! ones are attached to whatever daemon serves the mount now. So while none does, a
//! post fails at once with `ECONNREFUSED` (`ENOTCONN` where the daemon died during the
//! post); a request that failed stays failed (the agent's rule) and a new one is made.
//! A failure with those codes drops every idle ring too. Nothing accumulates across
//! restarts (descriptors, threads, `/dev/shm` mappings and publications are counted in
//! `tests/file_backend.rs`).
//!
//! # Parameters
//! `mount` (required: the directory an `hf3fs-gdr-daemon --mount DIR` serves),
//! `entries` (per ring, default 256), `io_depth` (3FS's meaning: 0, the default, starts
//! I/Os as soon as seen; −N up to N at a time, a partial batch once submitted or after
//! `timeout_ms`; N > 0, batches of exactly N, is refused: a transfer's last partial
//! batch would never start), `timeout_ms` (default 0), `rings` (per transfer, default
//! 4), `max_io_size` (default 16 MiB), `staging_size` (default 64 MiB) and
//! `staging_slot_size` (default 1 MiB).
//!
//! Notifications go to the agent itself, after the data, as `LOCAL`'s do.
//!
//! ```no_run
//! use nixl::{Agent, AgentConfig, Desc, DescList, MemKind, XferOp};
//! use std::os::fd::AsRawFd;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // `hf3fs-gdr-daemon --mount /mnt/data` runs.
//! let agent = Agent::new("me", AgentConfig::default())?;
//! agent.create_backend("FILE", &nixl::params([("mount", "/mnt/data")]))?;
//! let file = std::fs::File::open("/mnt/data/weights.bin")?;
//! let fd = file.as_raw_fd() as u64;
//! let mut buf = vec![0u8; 1 << 20];
//! let files = DescList::from_descs(MemKind::File, [Desc::new(0, 1 << 20, fd)]);
//! let mem = DescList::from_descs(MemKind::Dram, [Desc::from_slice(&buf)]);
//! // SAFETY: `buf` and `file` outlive the registrations and the request.
//! let _m = unsafe { agent.register_mem(&mem, None)? };
//! let _f = unsafe { agent.register_mem(&files, None)? };
//! // READ: file -> memory; the "remote" agent is this one.
//! let mut req = agent.create_xfer_req(XferOp::Read, &mem, &files, "me", None)?;
//! req.post()?;
//! req.wait(std::time::Duration::from_secs(10))?;
//! # drop(req); buf[0] = 0;
//! # Ok(()) }
//! ```

use crate::backend::{
    Backend, BackendInit, BackendParams, BackendXfer, Capabilities, LocalMd, NotifWaker,
    PostParams, RemoteMd, XferEntry, XferOp, XferProgress, XferStatus,
};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use hf3fs_gdr::{Cqe, Ior, Iov};
use parking_lot::Mutex;
use std::any::Any;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

mod shm_map;

/// The backend's name.
pub const NAME: &str = "FILE";

const PARAMS: &[&str] = &[
    "mount",
    "entries",
    "io_depth",
    "timeout_ms",
    "rings",
    "max_io_size",
    "staging_size",
    "staging_slot_size",
];

/// No completion for this long while I/O is outstanding: ask whether the daemon lives.
const PROBE_AFTER: Duration = Duration::from_millis(1);
/// At most one liveness probe per this interval. A probe waits for nothing: a poll of
/// the daemon's socket (its end) and, at most every `DOOM_CHECK_PERIOD` of `hf3fs_gdr`'s
/// client, its `/proc` status (a kill in progress); see `hf3fs_gdr::Ior::check_alive`.
const PROBE_EVERY: Duration = Duration::from_millis(1);

fn backend_err(what: impl std::fmt::Display, e: hf3fs_gdr::Error) -> Error {
    Error::Backend {
        backend: NAME.into(),
        code: e.errno(),
        message: format!("{what}: {e}"),
    }
}

fn os_err(code: i32, message: String) -> Error {
    Error::Backend {
        backend: NAME.into(),
        code,
        message,
    }
}

/// What the backend was created with.
#[derive(Debug, Clone)]
struct Config {
    mount: PathBuf,
    entries: u32,
    io_depth: i32,
    timeout: Duration,
    rings: usize,
    max_io: u64,
    staging_bytes: u64,
    staging_slot: u64,
}

impl Config {
    fn parse(params: &BackendParams) -> Result<Self> {
        if let Some(key) = params.keys().find(|k| !PARAMS.contains(&k.as_str())) {
            return Err(Error::InvalidParam(format!(
                "{NAME} takes no parameter `{key}` (it takes {})",
                PARAMS.join(", ")
            )));
        }
        let p = |key, default| super::shared::param(NAME, params, key, default);
        let mount = params.get("mount").ok_or_else(|| {
            Error::InvalidParam(format!(
                "{NAME} needs parameter `mount`: the directory an hf3fs-gdr-daemon serves"
            ))
        })?;
        let config = Self {
            mount: PathBuf::from(mount),
            entries: p("entries", 256u64)? as u32,
            io_depth: super::shared::param(NAME, params, "io_depth", 0i32)?,
            timeout: Duration::from_millis(p("timeout_ms", 0)?),
            rings: p("rings", 4)? as usize,
            max_io: p("max_io_size", 16 << 20)?,
            staging_bytes: p("staging_size", 64 << 20)?,
            staging_slot: p("staging_slot_size", 1 << 20)?,
        };
        let bad = |what: String| Err(Error::InvalidParam(format!("{NAME}: {what}")));
        if config.entries == 0 || config.entries > hf3fs_gdr::MAX_IOR_ENTRIES {
            return bad(format!(
                "entries={} (1..={})",
                config.entries,
                hf3fs_gdr::MAX_IOR_ENTRIES
            ));
        }
        if config.io_depth.unsigned_abs() > config.entries {
            return bad(format!(
                "io_depth={} exceeds entries={}: batches could never fill",
                config.io_depth, config.entries
            ));
        }
        if config.io_depth > 0 {
            // Batches of exactly N: a transfer whose I/O count on a ring is not a
            // multiple of N would leave a partial batch that never starts.
            return bad(format!(
                "io_depth={} (batches of exactly that many) would hold back a transfer's \
                 last partial batch forever: use io_depth=-{} (up to that many, a partial \
                 batch once submitted) or 0",
                config.io_depth, config.io_depth
            ));
        }
        if config.rings == 0 || config.rings > 64 {
            return bad(format!("rings={} (1..=64)", config.rings));
        }
        if config.max_io == 0 || config.staging_slot == 0 {
            return bad("max_io_size and staging_slot_size must be positive".into());
        }
        if config.staging_bytes < config.staging_slot {
            return bad(format!(
                "staging_size={} is smaller than one staging slot ({})",
                config.staging_bytes, config.staging_slot
            ));
        }
        Ok(config)
    }
}

/// A descriptor registered for I/O: its number and the file it named when registered.
#[derive(Debug)]
struct FileReg {
    fd: RawFd,
    dev: u64,
    ino: u64,
    serial: u64,
    owner: Weak<Shared>,
}

fn identity(fd: RawFd) -> std::io::Result<(u64, u64)> {
    // SAFETY: plain C struct, zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; a bad descriptor is reported as EBADF.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((st.st_dev, st.st_ino))
}

impl FileReg {
    /// Whether the descriptor still names the registered file.
    fn check(&self) -> Result<()> {
        match identity(self.fd) {
            Ok(id) if id == (self.dev, self.ino) => Ok(()),
            Ok(_) => Err(os_err(
                libc::EBADF,
                format!(
                    "fd {} names another file than the one registered (it was closed and \
                     its number reused): deregister and register again",
                    self.fd
                ),
            )),
            Err(e) => Err(os_err(
                e.raw_os_error().unwrap_or(libc::EBADF),
                format!("fd {} registered as FILE memory: {e}", self.fd),
            )),
        }
    }
}

impl Drop for FileReg {
    fn drop(&mut self) {
        if let Some(shared) = self.owner.upgrade() {
            let mut files = shared.files.lock();
            if files.get(&self.fd).is_some_and(|(s, _)| *s == self.serial) {
                files.remove(&self.fd);
            }
        }
        release_fd(self.fd, (self.dev, self.ino));
    }
}

/// Descriptor → (the file it named: device, inode; registrations holding it).
type FdTable = Mutex<HashMap<RawFd, ((u64, u64), usize)>>;

/// `hf3fs_gdr::reg_fd` registrations are per process and keyed by descriptor number:
/// counted here across every FILE backend of the process (several agents may register
/// one descriptor), so the last one to go deregisters it.
fn fd_registrations() -> &'static FdTable {
    static REGS: std::sync::OnceLock<FdTable> = std::sync::OnceLock::new();
    REGS.get_or_init(Default::default)
}

/// One more registration of `fd`, which names the file `id` (device, inode).
fn acquire_fd(fd: RawFd, id: (u64, u64)) -> Result<()> {
    let mut regs = fd_registrations().lock();
    match regs.get_mut(&fd) {
        Some((held, count)) if *held == id => {
            *count += 1;
            return Ok(());
        }
        Some(_) => {
            return Err(Error::InvalidParam(format!(
                "{NAME}: fd {fd} is registered for another file (closed and reused since?): \
                 deregister that registration first"
            )))
        }
        None => {}
    }
    if let Err(e) = hf3fs_gdr::reg_fd(fd, 0) {
        // A registration of an earlier file under this number that nobody holds.
        if !matches!(e, hf3fs_gdr::Error::InvalidArgument(_)) {
            return Err(backend_err(format!("registering fd {fd}"), e));
        }
        hf3fs_gdr::dereg_fd(fd);
        hf3fs_gdr::reg_fd(fd, 0).map_err(|e| backend_err(format!("registering fd {fd}"), e))?;
    }
    regs.insert(fd, (id, 1));
    Ok(())
}

fn release_fd(fd: RawFd, id: (u64, u64)) {
    let mut regs = fd_registrations().lock();
    if let Some((held, count)) = regs.get_mut(&fd) {
        if *held == id {
            *count -= 1;
            if *count == 0 {
                regs.remove(&fd);
                hf3fs_gdr::dereg_fd(fd);
            }
        }
    }
}

/// Host memory in `/dev/shm` published to the daemon under an id of ours.
#[derive(Debug)]
struct ShmWrap {
    iov: Iov,
    link: PathBuf,
}

impl Drop for ShmWrap {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.link) {
            tracing::debug!("{NAME}: removing {}: {e}", self.link.display());
        }
    }
}

/// The backend's metadata of a local registration.
#[derive(Debug)]
enum Md {
    /// Held for its lifetime: the descriptor stays registered while a region names it.
    File { _held: Arc<FileReg> },
    /// DRAM the daemon maps itself.
    ZeroCopy(ShmWrap),
    /// DRAM copied through the staging iov.
    Staged,
    /// VRAM published by its IPC handle.
    Vram(Iov),
}

impl LocalMd for Md {
    fn public_md(&self) -> Vec<u8> {
        Vec::new()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn mode(&self) -> Option<&'static str> {
        match self {
            Md::File { .. } => None,
            Md::ZeroCopy(_) => Some("zero-copy"),
            Md::Staged => Some("staged"),
            Md::Vram(_) => Some("direct"),
        }
    }
}

/// The agent's view of a FILE region: its own registration (weak: the agent's view of
/// itself must not keep a deregistered descriptor registered; empty for another
/// agent's files, which this backend cannot reach).
#[derive(Debug)]
struct RemoteView(Weak<FileReg>);

impl RemoteMd for RemoteView {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The library-owned host iov DRAM is staged through, cut in slots.
#[derive(Debug)]
struct Staging {
    iov: Option<Iov>,
    free: Vec<usize>,
}

type NotifQueue = super::shared::NotifInbox;

/// What the backend and its transfers share.
#[derive(Debug)]
struct Shared {
    agent_name: String,
    config: Config,
    /// fd → (serial, registration): one registration per live descriptor number.
    files: Mutex<HashMap<RawFd, (u64, Weak<FileReg>)>>,
    next_serial: AtomicU64,
    /// Idle rings: [write rings, read rings].
    rings: [Mutex<Vec<Ior>>; 2],
    staging: Mutex<Staging>,
    notifs: NotifQueue,
}

impl Shared {
    fn slots(&self) -> usize {
        (self.config.staging_bytes / self.config.staging_slot) as usize
    }

    fn register_file(self: &Arc<Self>, region: &Region) -> Result<Arc<FileReg>> {
        let fd = RawFd::try_from(region.desc.dev_id).map_err(|_| {
            Error::InvalidParam(format!(
                "{NAME}: FILE dev_id {} is not a file descriptor",
                region.desc.dev_id
            ))
        })?;
        let (dev, ino) = identity(fd).map_err(|e| {
            Error::InvalidParam(format!("{NAME}: fd {fd} is not an open file: {e}"))
        })?;
        let mut files = self.files.lock();
        if let Some(reg) = files.get(&fd).and_then(|(_, w)| w.upgrade()) {
            if (reg.dev, reg.ino) == (dev, ino) {
                return Ok(reg);
            }
            // Unlocked before `reg` goes: if it was the last holder, its drop locks.
            drop(files);
            drop(reg);
            return Err(Error::InvalidParam(format!(
                "{NAME}: fd {fd} is registered for another file (closed and reused since?): \
                 deregister that registration first"
            )));
        }
        acquire_fd(fd, (dev, ino))?;
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let reg = Arc::new(FileReg {
            fd,
            dev,
            ino,
            serial,
            owner: Arc::downgrade(self),
        });
        files.insert(fd, (serial, Arc::downgrade(&reg)));
        Ok(reg)
    }

    fn register_dram(&self, region: &Region) -> Result<Md> {
        let Some(map) = shm_map::find(region.desc.addr, region.desc.len) else {
            return Ok(Md::Staged);
        };
        let id = shm_map::fresh_id(region.desc.addr);
        let link = hf3fs_gdr::virt::iovs_dir(&self.config.mount).join(hf3fs_gdr::to_hex(&id));
        if let Err(e) = std::os::unix::fs::symlink(&map.path, &link) {
            tracing::debug!("{NAME}: publishing {}: {e}; staged", map.path.display());
            return Ok(Md::Staged);
        }
        // SAFETY: `map.base` is where offset 0 of the shared file would be mapped and
        // `[region.addr, region.addr + len)` lies in its mapping (read from
        // /proc/self/maps); the daemon is only given pointers of registered regions,
        // which the registration contract keeps mapped while transfers use them.
        let wrapped = unsafe {
            Iov::wrap(
                map.base as *mut u8,
                &id,
                &self.config.mount,
                map.size,
                0,
                -1,
            )
        };
        match wrapped {
            Ok(iov) => Ok(Md::ZeroCopy(ShmWrap { iov, link })),
            Err(e) => {
                let _ = std::fs::remove_file(&link);
                tracing::debug!("{NAME}: wrapping {}: {e}; staged", map.path.display());
                Ok(Md::Staged)
            }
        }
    }

    fn register_vram(&self, region: &Region) -> Result<Md> {
        let device = usize::try_from(region.desc.dev_id).unwrap_or(usize::MAX);
        let id = shm_map::fresh_id(region.desc.addr);
        // SAFETY: the agent's registration contract keeps the memory allocated until the
        // registration (which owns this iov) is dropped and no transfer uses it.
        let iov = unsafe {
            Iov::wrap_gpu(
                region.desc.addr,
                &id,
                &self.config.mount,
                region.desc.len,
                0,
                device,
            )
        }
        .map_err(|e| {
            backend_err(
                format!(
                    "publishing VRAM {:#x}+{} of GPU {device} to the daemon",
                    region.desc.addr, region.desc.len
                ),
                e,
            )
        })?;
        Ok(Md::Vram(iov))
    }

    /// A staging slot, creating the staging iov on first use; `None` while all are taken.
    fn take_slot(&self) -> Result<Option<(Iov, usize)>> {
        let mut st = self.staging.lock();
        if st.iov.is_none() {
            let iov = Iov::create(
                &self.config.mount,
                self.config.staging_slot * self.slots() as u64,
                0,
                -1,
            )
            .map_err(|e| backend_err("creating the DRAM staging iov", e))?;
            st.iov = Some(iov);
            st.free = (0..self.slots()).rev().collect();
        }
        let iov = st.iov.clone().expect("created above");
        Ok(st.free.pop().map(|slot| (iov, slot)))
    }

    fn give_slot(&self, slot: usize) {
        self.staging.lock().free.push(slot);
    }

    /// An idle ring whose daemon still serves it, else a new one (attached to whatever
    /// daemon serves the mount now). A pooled ring is asked first (a poll of the
    /// daemon's socket, and `/proc` for a kill in progress): a post must not take a ring
    /// of a dead daemon and learn of it only at `check`, milliseconds later.
    fn take_ring(&self, read: bool) -> Result<Ior> {
        let pooled = self.rings[read as usize].lock().pop();
        if let Some(ring) = pooled {
            match ring.check_alive() {
                Ok(()) => return Ok(ring),
                Err(e) => {
                    tracing::debug!("{NAME}: idle rings dropped: {e}");
                    // Every idle ring was attached to the same daemon, or to an older
                    // one; dropped outside the pools' locks.
                    let stale: Vec<Vec<Ior>> = self
                        .rings
                        .iter()
                        .map(|pool| std::mem::take(&mut *pool.lock()))
                        .collect();
                    drop(stale);
                }
            }
        }
        let c = &self.config;
        Ior::create(&c.mount, c.entries, read, c.io_depth, c.timeout, -1, 0).map_err(|e| {
            backend_err(
                format!("creating an I/O ring on {}", self.config.mount.display()),
                e,
            )
        })
    }

    fn give_rings(&self, read: bool, rings: Vec<Ior>) {
        self.rings[read as usize].lock().extend(rings);
    }
}

/// The FILE backend.
#[derive(Debug)]
pub struct FileBackend {
    shared: Arc<Shared>,
}

pub(crate) fn create(init: &BackendInit) -> Result<Arc<dyn Backend>> {
    let params = &init.params;
    let config = Config::parse(params)?;
    if !config.mount.is_dir() {
        return Err(Error::InvalidParam(format!(
            "{NAME}: mount {} is not a directory",
            config.mount.display()
        )));
    }
    // Served? The daemon answers its counters only if it runs.
    hf3fs_gdr::daemon_stats(&config.mount).map_err(|e| {
        Error::InvalidParam(format!(
            "{NAME}: mount {} is not served (start `hf3fs-gdr-daemon --mount {}`): {e}",
            config.mount.display(),
            config.mount.display()
        ))
    })?;
    Ok(Arc::new(FileBackend {
        shared: Arc::new(Shared {
            agent_name: init.agent_name.clone(),
            config,
            files: Mutex::default(),
            next_serial: AtomicU64::new(1),
            rings: [Mutex::default(), Mutex::default()],
            staging: Mutex::new(Staging {
                iov: None,
                free: Vec::new(),
            }),
            notifs: NotifQueue::default(),
        }),
    }))
}

impl FileBackend {
    fn check_self(&self, agent: &str) -> Result<()> {
        if agent == self.shared.agent_name {
            Ok(())
        } else {
            Err(Error::InvalidParam(format!(
                "{NAME} moves data between agent `{}`'s memory and its own files, not to \
                 `{agent}` (storage transfers are local: name the agent itself)",
                self.shared.agent_name
            )))
        }
    }

    /// The mount directory served.
    pub fn mount(&self) -> &Path {
        &self.shared.config.mount
    }
}

impl Backend for FileBackend {
    fn name(&self) -> &str {
        NAME
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: false,
            notif: true,
        }
    }
    fn supported_mem(&self) -> &[MemKind] {
        &[MemKind::Dram, MemKind::Vram, MemKind::File]
    }
    fn supported_remote_mem(&self) -> &[MemKind] {
        &[MemKind::File]
    }
    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        let md = match region.kind {
            MemKind::File => Md::File {
                _held: self.shared.register_file(region)?,
            },
            MemKind::Dram => self.shared.register_dram(region)?,
            MemKind::Vram => self.shared.register_vram(region)?,
            kind => {
                return Err(Error::UnsupportedMemKind {
                    backend: NAME.into(),
                    kind,
                })
            }
        };
        Ok(Arc::new(md))
    }
    fn connection_info(&self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn load_remote_conn_info(&self, _agent: &str, _info: &[u8]) -> Result<()> {
        Ok(())
    }
    fn load_remote_md(
        &self,
        agent: &str,
        region: &Region,
        _public: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        if agent != self.shared.agent_name {
            // Another agent's files are out of reach; prep_xfer says so.
            return Ok(Arc::new(RemoteView(Weak::new())));
        }
        let fd = RawFd::try_from(region.desc.dev_id).unwrap_or(-1);
        let reg = self
            .shared
            .files
            .lock()
            .get(&fd)
            .map_or_else(Weak::new, |(_, w)| w.clone());
        Ok(Arc::new(RemoteView(reg)))
    }
    fn disconnect(&self, _agent: &str) {}
    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        self.check_self(agent)?;
        let c = &self.shared.config;
        let mut pieces = Vec::new();
        let mut files: Vec<Arc<FileReg>> = Vec::new();
        let mut staged_bytes = 0;
        for (i, e) in entries.iter().enumerate() {
            if e.remote_region.kind != MemKind::File {
                return Err(Error::InvalidParam(format!(
                    "{NAME}: remote descriptor {i} is {:?}: the remote side is FILE",
                    e.remote_region.kind
                )));
            }
            let file = match e
                .remote_md
                .as_any()
                .downcast_ref::<RemoteView>()
                .and_then(|v| v.0.upgrade())
            {
                Some(f) => f,
                None => {
                    return Err(Error::InvalidParam(format!(
                        "{NAME}: FILE descriptor {i} (fd {}) is not registered with {NAME}",
                        e.remote.dev_id
                    )))
                }
            };
            let md = e.local_md.as_any().downcast_ref::<Md>();
            let (mem, piece_max) = match md {
                Some(Md::Vram(iov)) | Some(Md::ZeroCopy(ShmWrap { iov, .. })) => {
                    (MemRef::Iov(iov.clone()), c.max_io)
                }
                Some(Md::Staged) => {
                    staged_bytes += e.local.len;
                    (MemRef::Staged, c.max_io.min(c.staging_slot))
                }
                _ => {
                    return Err(Error::InvalidParam(format!(
                        "{NAME}: local descriptor {i} is {:?}: the local side is DRAM or VRAM",
                        e.local_region.kind
                    )))
                }
            };
            let file_index = match files.iter().position(|f| Arc::ptr_eq(f, &file)) {
                Some(k) => k,
                None => {
                    files.push(file.clone());
                    files.len() - 1
                }
            };
            let mut done = 0;
            while done < e.local.len {
                let len = piece_max.min(e.local.len - done);
                pieces.push(Piece {
                    mem: mem.clone(),
                    addr: e.local.addr + done,
                    file: file_index,
                    offset: e.remote.addr + done,
                    len,
                });
                done += len;
            }
        }
        Ok(Box::new(FileXfer {
            shared: self.shared.clone(),
            read: op == XferOp::Read,
            pieces,
            files,
            staged_bytes,
            run: None,
            completed: 0,
        }))
    }
    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        self.check_self(agent)?;
        self.shared
            .notifs
            .push(self.shared.agent_name.clone(), msg.to_vec());
        Ok(())
    }
    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.shared.notifs.take(into);
    }
    fn set_notif_waker(&self, waker: NotifWaker) -> bool {
        // Notifications are queued by the thread that posts or polls the transfer.
        self.shared.notifs.add_waker(waker);
        true
    }
}

/// Where a piece's memory side is.
#[derive(Debug, Clone)]
enum MemRef {
    /// An iov the daemon reaches (VRAM, zero-copy DRAM): the piece's address is in it.
    Iov(Iov),
    /// User DRAM, copied through a staging slot.
    Staged,
}

/// One I/O: `len` bytes between memory at `addr` and file `files[file]` at `offset`.
#[derive(Debug)]
struct Piece {
    mem: MemRef,
    addr: u64,
    file: usize,
    offset: u64,
    len: u64,
}

/// A ring lent to a posted transfer and its I/Os not yet reaped.
#[derive(Debug)]
struct RingUse {
    ior: Ior,
    outstanding: u32,
}

/// One post in flight.
#[derive(Debug)]
struct Run {
    rings: Vec<RingUse>,
    /// Next piece to issue.
    next: usize,
    /// Pieces completed.
    done: usize,
    /// The staging slot of each staged piece in flight: piece → (iov, slot).
    slots: HashMap<usize, (Iov, usize)>,
    /// Ring to try first for the next piece.
    turn: usize,
    notif: Option<Vec<u8>>,
    last_progress: Instant,
    last_probe: Instant,
}

#[derive(Debug)]
struct FileXfer {
    shared: Arc<Shared>,
    read: bool,
    pieces: Vec<Piece>,
    files: Vec<Arc<FileReg>>,
    staged_bytes: u64,
    run: Option<Run>,
    /// Pieces completed by the last (or current) post, for progress.
    completed: u64,
}

impl FileXfer {
    /// Issues pieces while a ring has room (and, for staged ones, a slot is free).
    fn issue(&mut self) -> Result<()> {
        let Some(run) = self.run.as_mut() else {
            return Ok(());
        };
        let entries = self.shared.config.entries;
        let mut touched = vec![false; run.rings.len()];
        while run.next < self.pieces.len() {
            let n = run.rings.len();
            let Some(r) = (0..n)
                .map(|k| (run.turn + k) % n)
                .find(|&r| run.rings[r].outstanding < entries)
            else {
                break;
            };
            let index = run.next;
            let piece = &self.pieces[index];
            let fd = self.files[piece.file].fd;
            let (iov, ptr) = match &piece.mem {
                MemRef::Iov(iov) => (iov.clone(), piece.addr),
                MemRef::Staged => {
                    let Some((iov, slot)) = self.shared.take_slot()? else {
                        break;
                    };
                    let ptr = iov.base() + slot as u64 * self.shared.config.staging_slot;
                    if !self.read {
                        // SAFETY: the piece lies in registered DRAM (checked by the agent;
                        // the registration contract keeps it valid) and fits the slot
                        // (pieces of staged memory are at most one slot long); the slot
                        // is ours until its completion is reaped.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                piece.addr as *const u8,
                                ptr as *mut u8,
                                piece.len as usize,
                            )
                        };
                    }
                    run.slots.insert(index, (iov.clone(), slot));
                    (iov, ptr)
                }
            };
            let prepped = run.rings[r].ior.prep_io(
                &iov,
                self.read,
                ptr,
                fd,
                piece.offset,
                piece.len,
                index as u64,
            );
            if let Err(e) = prepped {
                if let Some((_, slot)) = run.slots.remove(&index) {
                    self.shared.give_slot(slot);
                }
                return Err(backend_err(
                    format!(
                        "preparing I/O {index} (fd {fd}, offset {}, {} bytes)",
                        piece.offset, piece.len
                    ),
                    e,
                ));
            }
            run.rings[r].outstanding += 1;
            touched[r] = true;
            run.turn = (r + 1) % n;
            run.next += 1;
        }
        for (ring, _) in run.rings.iter_mut().zip(&touched).filter(|(_, t)| **t) {
            ring.ior
                .submit_ios()
                .map_err(|e| backend_err("submitting I/O", e))?;
        }
        Ok(())
    }

    /// Handles one completion.
    fn complete(&mut self, cqe: &Cqe) -> Result<()> {
        let run = self.run.as_mut().expect("a run is in flight");
        let index = cqe.userdata as usize;
        let Some(piece) = self.pieces.get(index) else {
            return Err(os_err(
                libc::EIO,
                format!("a completion for unknown I/O {index}"),
            ));
        };
        let slot = run.slots.remove(&index);
        let what = || {
            format!(
                "{} of {} bytes at offset {} of fd {}",
                if self.read { "READ" } else { "WRITE" },
                piece.len,
                piece.offset,
                self.files[piece.file].fd
            )
        };
        let result = if cqe.result < 0 {
            let errno = (-cqe.result) as i32;
            Err(os_err(
                errno,
                format!("{}: {}", what(), std::io::Error::from_raw_os_error(errno)),
            ))
        } else if cqe.result as u64 != piece.len {
            Err(os_err(
                libc::ENODATA,
                format!(
                    "{}: only {} bytes moved{}",
                    what(),
                    cqe.result,
                    if self.read {
                        " (the read reaches past the end of the file)"
                    } else {
                        ""
                    }
                ),
            ))
        } else {
            Ok(())
        };
        if let Some((iov, slot)) = slot {
            if result.is_ok() && self.read {
                let src = iov.base() + slot as u64 * self.shared.config.staging_slot;
                // SAFETY: the daemon finished writing the slot (its completion is
                // reaped); the destination is registered DRAM the piece names.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src as *const u8,
                        piece.addr as *mut u8,
                        piece.len as usize,
                    )
                };
            }
            self.shared.give_slot(slot);
        }
        result?;
        run.done += 1;
        self.completed += 1;
        Ok(())
    }

    /// Reaps what completed on every ring, without waiting.
    fn reap(&mut self) -> Result<usize> {
        let mut cqes = [Cqe::default(); 64];
        let mut reaped = 0;
        let rings = self.run.as_ref().map_or(0, |r| r.rings.len());
        for r in 0..rings {
            loop {
                let run = self.run.as_mut().expect("in flight");
                let ring = &mut run.rings[r];
                if ring.outstanding == 0 {
                    break;
                }
                let n = ring
                    .ior
                    .wait_for_ios(&mut cqes, 0, Some(Instant::now()))
                    .map_err(|e| backend_err("reaping completions", e))?;
                ring.outstanding -= n as u32;
                for cqe in &cqes[..n] {
                    self.complete(cqe)?;
                }
                reaped += n;
                if n < cqes.len() {
                    break;
                }
            }
        }
        Ok(reaped)
    }

    /// Nothing completed for a while: does the daemon of every ring with I/O still
    /// live? Asked without waiting; what a dying daemon completed before it went is
    /// reaped first (the next check fails the transfer if I/O is still outstanding).
    fn probe(&mut self) -> Result<()> {
        let run = self.run.as_mut().expect("in flight");
        let now = Instant::now();
        if now - run.last_progress < PROBE_AFTER || now - run.last_probe < PROBE_EVERY {
            return Ok(());
        }
        run.last_probe = now;
        let gone = run
            .rings
            .iter()
            .filter(|r| r.outstanding > 0)
            .find_map(|r| r.ior.check_alive().err());
        let Some(e) = gone else {
            return Ok(());
        };
        if self.reap()? > 0 {
            self.run.as_mut().expect("in flight").last_progress = Instant::now();
            return Ok(());
        }
        Err(backend_err("waiting for I/O", e))
    }

    fn progress(&mut self) -> Result<XferStatus> {
        let reaped = self.reap()?;
        let run = self.run.as_mut().expect("in flight");
        if reaped > 0 {
            run.last_progress = Instant::now();
        } else if run.rings.iter().any(|r| r.outstanding > 0) {
            self.probe()?;
        }
        self.issue()?;
        let run = self.run.as_mut().expect("in flight");
        if run.done < self.pieces.len() {
            return Ok(XferStatus::InProgress);
        }
        let rings = std::mem::take(&mut run.rings)
            .into_iter()
            .map(|r| r.ior)
            .collect();
        let notif = run.notif.take();
        self.run = None;
        self.shared.give_rings(self.read, rings);
        if let Some(msg) = notif {
            self.shared.notifs.push(self.shared.agent_name.clone(), msg);
        }
        Ok(XferStatus::Done)
    }

    /// Ends a failed post (see [`FileXfer::abandon`]); a daemon that is gone takes the
    /// idle rings with it (they were attached to it), so the next post attaches fresh
    /// ones to whatever daemon serves the mount then.
    fn fail(&mut self, e: Error) -> Error {
        self.abandon();
        if let Error::Backend { code, .. } = &e {
            if [libc::ENOTCONN, libc::ECONNREFUSED].contains(code) {
                for pool in &self.shared.rings {
                    pool.lock().clear();
                }
            }
        }
        e
    }

    /// Ends a post: rings with I/O outstanding are closed (which waits for the daemon
    /// to finish it) before staging slots are reused.
    fn abandon(&mut self) {
        if let Some(mut run) = self.run.take() {
            run.rings.clear();
            for (_, (_, slot)) in run.slots.drain() {
                self.shared.give_slot(slot);
            }
        }
    }
}

impl BackendXfer for FileXfer {
    fn post(&mut self, notif: Option<&[u8]>, _params: &PostParams) -> Result<XferStatus> {
        if self.run.is_some() {
            return Err(Error::RepostActive);
        }
        for f in &self.files {
            f.check()?;
        }
        let want = self.shared.config.rings.min(self.pieces.len()).max(1);
        let mut rings = Vec::with_capacity(want);
        for _ in 0..want {
            match self.shared.take_ring(self.read) {
                Ok(ior) => rings.push(RingUse {
                    ior,
                    outstanding: 0,
                }),
                Err(e) => {
                    self.shared
                        .give_rings(self.read, rings.into_iter().map(|r| r.ior).collect());
                    return Err(self.fail(e));
                }
            }
        }
        let now = Instant::now();
        self.completed = 0;
        self.run = Some(Run {
            rings,
            next: 0,
            done: 0,
            slots: HashMap::new(),
            turn: 0,
            notif: notif.map(<[u8]>::to_vec),
            last_progress: now,
            last_probe: now,
        });
        match self.issue().and_then(|()| self.progress()) {
            Ok(status) => Ok(status),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn check(&mut self) -> Result<XferProgress> {
        if self.run.is_none() {
            return Ok(XferProgress {
                status: XferStatus::Done,
                completed_ops: self.completed,
            });
        }
        match self.progress() {
            Ok(status) => Ok(XferProgress {
                status,
                completed_ops: self.completed,
            }),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn op_count(&self) -> usize {
        self.pieces.len()
    }

    fn staged_bytes(&self) -> u64 {
        self.staged_bytes
    }
}

impl Drop for FileXfer {
    fn drop(&mut self) {
        self.abandon();
    }
}
