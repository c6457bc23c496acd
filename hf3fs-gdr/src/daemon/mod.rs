//! The local I/O daemon (`hf3fs-gdr-daemon`): serves one mount directory.
//!
//! - A `SOCK_SEQPACKET` socket at `<mount>/3fs-virt/daemon.sock`; a client is admitted by
//!   the credentials the kernel recorded for its connection (`SO_PEERCRED`: root, the
//!   daemon's user, or a listed user or group). One session per client connection, with
//!   the files it passed, the iovs it registered (each handed over as a descriptor or
//!   CUDA-IPC handle, never looked up by name), the rings it attached (sealed memfds) and
//!   the publications it proved it owns. When the connection closes (the client exited
//!   or died), the session's rings stop, chunks not started are cancelled, its mappings
//!   are released and its owned publications (symlinks and `/dev/shm` files) are
//!   removed; other sessions go on. See `confine.rs` and the README's "Deploying the
//!   daemon" for what each check protects against.
//! - One thread per ring takes submissions (batched by `io_depth`), finds the iov among
//!   its session's registrations and the file by its id, and splits each I/O into
//!   chunks.
//! - A pool of worker threads runs chunks: host iovs are read or written in place with
//!   `pread`/`pwrite` (page cache or `O_DIRECT`: see [`DirectPolicy`]); GPU iovs go through each worker's
//!   pinned staging slots with asynchronous host-to-device copies (see `gpu.rs`).
//!
//! A client learns that the daemon died from its socket closing (see
//! [`crate::Ior::wait_for_ios`]).

mod confine;
#[doc(hidden)]
pub mod fuzz;
mod gpu;
mod io;
mod logging;
mod memory;
mod pool;
mod ring;
mod stats;

use crate::error::{Error, Result};
use crate::proto::{
    Reader, SeqPacket, IOV_GPU, IOV_HOST, MAX_MESSAGE, OP_ADD_IOR, OP_DEREG_FD, OP_FORGET_IOV,
    OP_HELLO, OP_OWN_IOV, OP_OWN_IOV_LINK, OP_REG_FD, OP_REG_IOV, OP_REMOVE_IOR, OP_STATS,
};
use crate::ring::{ior_size, RingHeader, RingView, RING_MAGIC, RING_VERSION};
use crate::shm::{remove_if_present, to_hex, Id, Shm};
use crate::virt::{self, GdrLink};
use confine::{Admission, Dirs, OwnedPublication};
use gpu_mem::IPC_HANDLE_BYTES;
pub use io::DirectPolicy;
use io::{Chunk, OpenFile, Request};
use logging::daemon_warn;
pub use logging::log_to_stderr;
use memory::MappedIov;
use parking_lot::Mutex;
use pool::{Pool, WorkerConfig};
use ring::{RingCtx, RingRunner};
use stats::Stats;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};

/// Default pinned staging slots per worker and GPU (one being filled while one is
/// copied).
pub const DEFAULT_SLOTS_PER_WORKER: usize = 2;

/// Largest chunk [`DaemonConfig::with`] picks (see [`DaemonConfig::new`]).
pub const MAX_DEFAULT_CHUNK: usize = 4 << 20;

/// How the daemon runs.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// The directory served.
    pub mount: PathBuf,
    /// Worker threads (readers and writers).
    pub threads: usize,
    /// Pinned staging memory per GPU, in bytes, shared out among the workers.
    pub staging_bytes: usize,
    /// Largest piece one worker moves at a time (also the staging slot size).
    pub chunk_bytes: usize,
    /// Pinned staging slots per worker and GPU: how many of its device copies may be in
    /// flight while it reads the next chunk (at least 1).
    pub slots_per_worker: usize,
    /// For chunks of GPU iovs the page cache serves: bytes read before each device copy
    /// is started, so the device reads them while they are still in the CPU's cache
    /// (0, the default: the whole chunk, then one copy). `O_DIRECT` chunks stay whole.
    pub copy_piece_bytes: usize,
    /// Fault injection for tests of I/O in flight: every chunk of a file whose name
    /// ends in `.slow` waits this long before it runs (in 10 ms steps that end early
    /// when its client is gone). Zero (the default) disables it.
    pub inject_delay: std::time::Duration,
    /// When `O_DIRECT` is used.
    pub direct: DirectPolicy,
    /// Users admitted besides root and the daemon's own user (checked at connect by
    /// the socket's `SO_PEERCRED`). Empty by default; with any user or group listed
    /// the socket is made `0666` (else `0600`) and this check is the gate.
    pub allow_uids: Vec<u32>,
    /// Primary groups admitted (`SO_PEERCRED` carries only the primary group).
    pub allow_gids: Vec<u32>,
    /// What one client may hold at once, so that no client exhausts the daemon's
    /// descriptors, threads or memory for the others.
    pub limits: ClientLimits,
}

/// What one client connection may hold at once (see [`DaemonConfig::limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// Registered files (each a descriptor, two with `O_DIRECT`); more: `EMFILE`.
    pub files: usize,
    /// Registered iovs (a host iov holds a descriptor and a mapping); more: `ENOSPC`.
    pub iovs: usize,
    /// Attached rings (each a thread); more: `ENOSPC`.
    pub rings: usize,
    /// Connections served at once, all clients together; more are refused at connect.
    pub clients: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        Self {
            files: 4096,
            iovs: 4096,
            rings: 128,
            clients: 256,
        }
    }
}

impl DaemonConfig {
    /// Defaults: a worker per CPU (at least 4), 256 MiB of staging per GPU, chunks of
    /// staging / (workers × 2) between 64 KiB and 4 MiB.
    ///
    /// Why at most 4 MiB: a read is done when its slowest chunk is, and the last wave
    /// of chunks spread over the workers ends unevenly by up to a chunk's time (an 8 MiB
    /// chunk's time was about an eighth of a 1 GiB read's: `docs/BENCHMARKS.md`);
    /// smaller chunks also keep a worker's staging slot in the CPU cache between its
    /// fill and the device copy. Smaller still only adds per-chunk costs (a copy
    /// launch, an event), and `O_DIRECT` reads of 4 MiB × workers keep a device's
    /// queue full.
    pub fn new(mount: impl Into<PathBuf>) -> Self {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(4)
            .max(4);
        Self::with(mount, threads, 256 << 20)
    }

    /// The chunk size that gives `threads` workers `slots` slots each out of
    /// `staging_bytes`: a multiple of 64 KiB between 64 KiB and [`MAX_DEFAULT_CHUNK`].
    pub fn default_chunk(staging_bytes: usize, threads: usize, slots: usize) -> usize {
        let per_slot = staging_bytes / (threads.max(1) * slots.max(1));
        (per_slot / (64 << 10) * (64 << 10)).clamp(64 << 10, MAX_DEFAULT_CHUNK)
    }

    /// `threads` workers sharing `staging_bytes` of pinned memory per GPU.
    pub fn with(mount: impl Into<PathBuf>, threads: usize, staging_bytes: usize) -> Self {
        let threads = threads.max(1);
        let chunk_bytes = Self::default_chunk(staging_bytes, threads, DEFAULT_SLOTS_PER_WORKER);
        Self {
            mount: mount.into(),
            threads,
            staging_bytes,
            chunk_bytes,
            slots_per_worker: DEFAULT_SLOTS_PER_WORKER,
            copy_piece_bytes: 0,
            inject_delay: std::time::Duration::ZERO,
            direct: DirectPolicy::Auto,
            allow_uids: Vec::new(),
            allow_gids: Vec::new(),
            limits: ClientLimits::default(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    config: DaemonConfig,
    pool: Arc<Pool>,
    stats: Arc<Stats>,
    admission: Admission,
    dirs: Dirs,
    /// Which session claimed each iov publication (first claim wins while it lives).
    owners: Mutex<HashMap<Id, Weak<Session>>>,
}

/// One client connection's state. Everything in it is the client's own: the iovs it
/// registered, the files it passed, the rings it attached and the publications it
/// proved it owns; no request reaches another session's.
#[derive(Debug)]
pub(crate) struct Session {
    shared: Arc<Shared>,
    pid: i32,
    uid: u32,
    files: Mutex<HashMap<u32, Arc<OpenFile>>>,
    next_file: AtomicU32,
    iovs: Mutex<HashMap<Id, Arc<MappedIov>>>,
    rings: Mutex<HashMap<Id, RingRunner>>,
    /// Iov publications this client owns (removed if it dies).
    owned_iovs: Mutex<HashMap<Id, OwnedPublication>>,
}

impl Session {
    fn new(shared: Arc<Shared>, pid: i32, uid: u32) -> Arc<Self> {
        Arc::new(Session {
            pid,
            uid,
            shared,
            files: Mutex::default(),
            next_file: AtomicU32::new(1),
            iovs: Mutex::default(),
            rings: Mutex::default(),
            owned_iovs: Mutex::default(),
        })
    }

    fn iov(&self, id: &Id) -> Option<Arc<MappedIov>> {
        self.iovs.lock().get(id).cloned()
    }

    /// Turns submission `seq` of `ctx` into chunks, or posts its error at once.
    fn dispatch(&self, ctx: &Arc<RingCtx>, seq: u64, out: &mut Vec<Chunk>) {
        let sqe = ctx.view.read_sqe(seq);
        let index = (seq % ctx.view.entries() as u64) as i32;
        let fail = |errno: i32| {
            ctx.inflight.fetch_add(1, Ordering::AcqRel);
            ctx.post(index, -(errno as i64), sqe.userdata);
        };
        let for_read = ctx.view.header().for_read != 0;
        if (sqe.read != 0) != for_read || sqe.len == 0 {
            return fail(libc::EINVAL);
        }
        let Some(file) = self.files.lock().get(&sqe.file_id).cloned() else {
            return fail(libc::EBADF);
        };
        // Only iovs this client registered (OP_REG_IOV): never one found by its name.
        let Some(iov) = self.iov(&sqe.iov_id) else {
            tracing::debug!(
                "client {}: iov {} not registered",
                self.pid,
                to_hex(&sqe.iov_id)
            );
            return fail(libc::EBADF);
        };
        if sqe
            .iov_offset
            .checked_add(sqe.len)
            .is_none_or(|end| end > iov.size())
        {
            return fail(libc::EINVAL);
        }
        // A file range past what `off_t` holds (found by fuzzing: the chunk offsets
        // overflowed).
        if sqe
            .file_offset
            .checked_add(sqe.len)
            .is_none_or(|end| end > i64::MAX as u64)
        {
            return fail(libc::EINVAL);
        }
        let req = Request::new(
            ctx.clone(),
            index,
            sqe.userdata,
            sqe.len,
            sqe.len.div_ceil(self.shared.config.chunk_bytes as u64),
        );
        let base = Chunk {
            req: req.clone(),
            file,
            iov,
            iov_offset: sqe.iov_offset,
            file_offset: sqe.file_offset,
            len: sqe.len,
            start: 0,
            read: sqe.read != 0,
        };
        io::split(&req, &base, self.shared.config.chunk_bytes as u64, out);
    }

    /// Attaches the ring in `fd`: a memfd sealed against shrinking (`F_SEAL_SHRINK`), so
    /// that the client cannot truncate it under the daemon's mapping (a truncated
    /// mapping turns the ring thread's accesses into `SIGBUS`, ending the daemon).
    fn add_ring(self: &Arc<Self>, id: &Id, fd: std::os::fd::OwnedFd) -> Result<()> {
        use std::os::fd::AsRawFd;
        if self.rings.lock().len() >= self.shared.config.limits.rings {
            return Err(Error::Refused {
                request: "add ior",
                errno: libc::ENOSPC,
            });
        }
        // SAFETY: a descriptor we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::InvalidArgument(format!(
                "ring {}: not a memfd sealed against shrinking",
                to_hex(id)
            )));
        }
        let label = PathBuf::from(format!("ring {}", to_hex(id)));
        let shm = Shm::from_fd(fd, crate::ring::HEADER_BYTES, &label)?;
        // SAFETY: the mapping holds at least a header (checked by from_fd's min length)
        // and cannot shrink (sealed).
        let header = unsafe { &*(shm.as_ptr() as *const RingHeader) };
        if header.magic != RING_MAGIC || header.version != RING_VERSION {
            return Err(Error::Malformed {
                what: "ring header",
                detail: format!("magic {:#x} version {}", header.magic, header.version),
            });
        }
        let entries = header.entries;
        if entries == 0 || shm.len() < ior_size(entries) || header.id != *id {
            return Err(Error::Malformed {
                what: "ring header",
                detail: format!("{entries} entries in {} bytes", shm.len()),
            });
        }
        // SAFETY: the mapping has ior_size(entries) bytes, cannot shrink, and is owned
        // by the context.
        let view = unsafe { RingView::new(shm.as_ptr(), entries) };
        let ctx = Arc::new(RingCtx::new(shm, view));
        let session = self.clone();
        let take = move |ctx: &Arc<RingCtx>, seqs: std::ops::Range<u64>| {
            let mut chunks = Vec::new();
            for seq in seqs {
                session.dispatch(ctx, seq, &mut chunks);
            }
            session.shared.pool.push(chunks);
        };
        let runner = RingRunner::start(ctx, self.pid, take)
            .map_err(|e| crate::error::os_err("spawn", e, "ring thread"))?;
        if let Some(old) = self.rings.lock().insert(*id, runner) {
            old.stop(false);
        }
        Ok(())
    }

    /// Registers an iov for this client's rings (`OP_REG_IOV`).
    fn reg_iov(&self, r: &mut Reader<'_>, fd: Option<std::os::fd::OwnedFd>) -> i64 {
        let (Some(id), Some(kind)) = (r.id(), r.u8()) else {
            return -(libc::EINVAL as i64);
        };
        let mapped = match (kind, fd) {
            (IOV_HOST, Some(fd)) => MappedIov::host(fd, &id),
            (IOV_GPU, None) => {
                let (Some(device), Some(size), Some(offset), Some(ipc)) =
                    (r.u64(), r.u64(), r.u64(), r.take::<{ IPC_HANDLE_BYTES }>())
                else {
                    return -(libc::EINVAL as i64);
                };
                let link = GdrLink {
                    device: device as usize,
                    size,
                    ipc: gpu_mem::IpcHandle(ipc),
                    offset,
                };
                MappedIov::gpu(&id, &link)
            }
            (IOV_HOST, None) => return -(libc::EBADF as i64),
            _ => return -(libc::EINVAL as i64),
        };
        match mapped {
            Ok(m) => {
                let mut iovs = self.iovs.lock();
                if !iovs.contains_key(&id) && iovs.len() >= self.shared.config.limits.iovs {
                    return -(libc::ENOSPC as i64);
                }
                iovs.insert(id, Arc::new(m));
                0
            }
            Err(e) => {
                daemon_warn!("client {}: iov {}: {e}", self.pid, to_hex(&id));
                -(e.errno() as i64)
            }
        }
    }

    /// Records this client's claim on an iov publication (`OP_OWN_IOV[_LINK]`) once the
    /// file system shows it is the client's, and no live session claimed it first.
    fn own_iov(
        self: &Arc<Self>,
        id: Id,
        segment_too: bool,
        fd: Option<std::os::fd::OwnedFd>,
    ) -> i64 {
        let owned = match self
            .shared
            .dirs
            .verify_claim(&id, self.uid, segment_too, fd.as_ref())
        {
            Ok(owned) => owned,
            Err(errno) => {
                daemon_warn!(
                    "client {} (uid {}): claim of iov {} refused (errno {errno})",
                    self.pid,
                    self.uid,
                    to_hex(&id)
                );
                return -(errno as i64);
            }
        };
        {
            let mut owners = self.shared.owners.lock();
            owners.retain(|_, w| w.strong_count() > 0);
            if let Some(other) = owners.get(&id).and_then(Weak::upgrade) {
                if !Arc::ptr_eq(&other, self) {
                    return -(libc::EPERM as i64);
                }
            }
            owners.insert(id, Arc::downgrade(self));
        }
        let mut owned_iovs = self.owned_iovs.lock();
        if !owned_iovs.contains_key(&id) && owned_iovs.len() >= self.shared.config.limits.iovs {
            drop(owned_iovs);
            self.disown(&id);
            return -(libc::ENOSPC as i64);
        }
        owned_iovs.insert(id, owned);
        0
    }

    fn disown(&self, id: &Id) {
        self.owned_iovs.lock().remove(id);
        let mut owners = self.shared.owners.lock();
        if owners
            .get(id)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), self))
        {
            owners.remove(id);
        }
    }

    fn handle(self: &Arc<Self>, msg: &[u8], fds: Vec<std::os::fd::OwnedFd>) -> (i64, Vec<u8>) {
        let Some((&op, rest)) = msg.split_first() else {
            return (-(libc::EINVAL as i64), Vec::new());
        };
        let mut r = Reader(rest);
        let einval = (-(libc::EINVAL as i64), Vec::new());
        if fds.len() > 1 {
            return einval;
        }
        let fd = fds.into_iter().next();
        match op {
            OP_HELLO => (std::process::id() as i64, Vec::new()),
            OP_REG_FD => {
                let Some(fd) = fd else {
                    return (-(libc::EBADF as i64), Vec::new());
                };
                if self.files.lock().len() >= self.shared.config.limits.files {
                    return (-(libc::EMFILE as i64), Vec::new());
                }
                match OpenFile::new(fd, self.shared.config.direct) {
                    Ok(file) => {
                        let id = self.next_file.fetch_add(1, Ordering::Relaxed);
                        self.files.lock().insert(id, Arc::new(file));
                        (id as i64, Vec::new())
                    }
                    Err(errno) => (-(errno as i64), Vec::new()),
                }
            }
            OP_DEREG_FD => match r.u32() {
                Some(id) => {
                    self.files.lock().remove(&id);
                    (0, Vec::new())
                }
                None => einval,
            },
            OP_REG_IOV => (self.reg_iov(&mut r, fd), Vec::new()),
            OP_ADD_IOR => match (r.id(), fd) {
                (Some(id), Some(fd)) => match self.add_ring(&id, fd) {
                    Ok(()) => (0, Vec::new()),
                    Err(e) => {
                        daemon_warn!("client {}: add ring {}: {e}", self.pid, to_hex(&id));
                        (-(e.errno() as i64), Vec::new())
                    }
                },
                (Some(_), None) => (-(libc::EBADF as i64), Vec::new()),
                (None, _) => einval,
            },
            OP_REMOVE_IOR => match r.id() {
                Some(id) => {
                    let runner = self.rings.lock().remove(&id);
                    match runner {
                        Some(runner) => {
                            runner.stop(false);
                            (0, Vec::new())
                        }
                        None => (-(libc::ENOENT as i64), Vec::new()),
                    }
                }
                None => einval,
            },
            OP_OWN_IOV | OP_OWN_IOV_LINK => match r.id() {
                Some(id) => (self.own_iov(id, op == OP_OWN_IOV, fd), Vec::new()),
                None => einval,
            },
            OP_FORGET_IOV => match r.id() {
                Some(id) => {
                    self.disown(&id);
                    self.iovs.lock().remove(&id);
                    (0, Vec::new())
                }
                None => einval,
            },
            OP_STATS => {
                let st = &self.shared.stats;
                let mut out = Vec::new();
                for v in [
                    &st.direct_ops,
                    &st.buffered_ops,
                    &st.host_bytes,
                    &st.gpu_bytes,
                    &st.clients_released,
                    &st.clients_now,
                ] {
                    out.extend_from_slice(&v.load(Ordering::Relaxed).to_le_bytes());
                }
                (0, out)
            }
            _ => einval,
        }
    }

    /// Releases everything of a client whose connection closed.
    fn release(&self) {
        let rings: Vec<RingRunner> = self.rings.lock().drain().map(|(_, r)| r).collect();
        for runner in rings {
            runner.stop(true);
        }
        self.iovs.lock().clear();
        self.files.lock().clear();
        // Publications of a client that died: only those it proved it owns, each entry
        // only while it is still the one it claimed.
        let owned: Vec<(Id, OwnedPublication)> = self.owned_iovs.lock().drain().collect();
        for (id, publication) in owned {
            self.shared.dirs.remove(&id, &publication);
            self.disown(&id);
        }
    }
}

/// How long a refused client may take to send its first request (it gets `EACCES`, or
/// `EAGAIN` when too many clients are connected, as the reply, then the connection
/// closes).
const REFUSED_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

fn refuse(sock: &SeqPacket, cred: Option<libc::ucred>, errno: i32) {
    let why = if errno == libc::EACCES {
        "not admitted"
    } else {
        "too many clients"
    };
    match cred {
        Some(c) => daemon_warn!(
            "client {} (uid {}, gid {}) refused: {why}",
            c.pid,
            c.uid,
            c.gid
        ),
        None => daemon_warn!("a client without peer credentials refused"),
    }
    if sock.set_recv_timeout(REFUSED_WAIT).is_ok() {
        let mut buf = [0u8; MAX_MESSAGE];
        if matches!(sock.recv(&mut buf), Ok((n, _)) if n > 0) {
            let _ = sock.send(&(-(errno as i64)).to_le_bytes(), &[]);
        }
    }
}

fn serve_client(shared: Arc<Shared>, sock: SeqPacket) {
    let cred = sock.peer_cred();
    let Some(cred) = cred.filter(|c| shared.admission.admits(c.uid, c.gid)) else {
        return refuse(&sock, cred, libc::EACCES);
    };
    let served = shared.stats.clients_now.fetch_add(1, Ordering::AcqRel);
    if served >= shared.config.limits.clients as u64 {
        shared.stats.clients_now.fetch_sub(1, Ordering::AcqRel);
        return refuse(&sock, Some(cred), libc::EAGAIN);
    }
    let session = Session::new(shared.clone(), cred.pid, cred.uid);
    tracing::info!("client {} (uid {}) connected", session.pid, session.uid);
    let mut buf = [0u8; MAX_MESSAGE];
    loop {
        let (n, fds) = match sock.recv(&mut buf) {
            Ok((0, _)) => break,
            Ok(got) => got,
            Err(e) => {
                daemon_warn!("client {}: {e}", session.pid);
                break;
            }
        };
        let (value, payload) = session.handle(&buf[..n], fds);
        let mut reply = value.to_le_bytes().to_vec();
        reply.extend_from_slice(&payload);
        if let Err(e) = sock.send(&reply, &[]) {
            daemon_warn!("client {}: reply: {e}", session.pid);
            break;
        }
    }
    session.release();
    shared.stats.clients_now.fetch_sub(1, Ordering::Relaxed);
    shared
        .stats
        .clients_released
        .fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        "client {} gone: its rings, files and publications released",
        session.pid
    );
}

/// Serves `config.mount` until the process ends. `ready` is called once the socket
/// listens (the binary prints a line there, which tests wait for).
pub fn run(config: DaemonConfig, ready: impl FnOnce(&Path)) -> Result<()> {
    virt::ensure_dirs(&config.mount)?;
    let path = virt::daemon_socket(&config.mount);
    if path.exists() {
        if SeqPacket::connect(&path).is_ok() {
            return Err(Error::InvalidArgument(format!(
                "a daemon already serves {}",
                config.mount.display()
            )));
        }
        remove_if_present(&path)?;
    }
    // SAFETY: no arguments.
    let daemon_uid = unsafe { libc::geteuid() };
    let dirs = Dirs::open(&config.mount, daemon_uid)?;
    let admission = Admission {
        daemon_uid,
        uids: config.allow_uids.clone(),
        gids: config.allow_gids.clone(),
    };
    let listener = SeqPacket::listen(&path)?;
    let mode = if admission.owner_only() { 0o600 } else { 0o666 };
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(mode))
        .map_err(|e| crate::error::os_err("chmod", e, path.display()))?;
    let shared = Arc::new(Shared {
        pool: Arc::new(Pool::default()),
        stats: Arc::new(Stats::default()),
        admission,
        dirs,
        owners: Mutex::default(),
        config,
    });
    for i in 0..shared.config.threads {
        let (pool, stats) = (shared.pool.clone(), shared.stats.clone());
        let config = WorkerConfig {
            chunk_bytes: shared.config.chunk_bytes,
            slots: shared.config.slots_per_worker.max(1),
            copy_piece: shared.config.copy_piece_bytes,
            inject_delay: shared.config.inject_delay,
        };
        std::thread::Builder::new()
            .name(format!("hf3fs-io-{i}"))
            .spawn(move || pool.work(config, stats))
            .map_err(|e| crate::error::os_err("spawn", e, "worker thread"))?;
    }
    ready(&path);
    loop {
        let sock = listener.accept()?;
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("hf3fs-client".into())
            .spawn(move || serve_client(shared, sock))
            .map_err(|e| crate::error::os_err("spawn", e, "client thread"))?;
    }
}
