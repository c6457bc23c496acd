//! The local I/O daemon (`hf3fs-gdr-daemon`): serves one mount directory.
//!
//! - A `SOCK_SEQPACKET` socket at `<mount>/3fs-virt/daemon.sock`; one session per
//!   client connection, with the files it registered (descriptors passed over the
//!   socket), the rings it attached, the iovs it published, and the iov mappings made
//!   for its I/O. When the connection closes (the client exited or died), the session's
//!   rings stop, chunks not started are cancelled, its mappings are released and its
//!   publications (symlinks and `/dev/shm` files) are removed; other sessions go on.
//! - One thread per ring takes submissions (batched by `io_depth`), resolves the iov by
//!   its publication (host: map the `/dev/shm` file; GPU: open the CUDA-IPC handle on
//!   that GPU) and the file by its id, and splits each I/O into chunks.
//! - A pool of worker threads runs chunks: host iovs are read or written in place with
//!   `pread`/`pwrite` (page cache or `O_DIRECT`: see [`DirectPolicy`]); GPU iovs go through each worker's
//!   pinned staging slots with asynchronous host-to-device copies (see `gpu.rs`).
//!
//! A client learns that the daemon died from its socket closing (see
//! [`crate::Ior::wait_for_ios`]).

mod gpu;
mod io;
mod logging;
mod memory;
mod pool;
mod ring;
mod stats;

use crate::error::{Error, Result};
use crate::iov::host_target_allowed;
use crate::proto::{
    Reader, SeqPacket, MAX_MESSAGE, OP_ADD_IOR, OP_DEREG_FD, OP_FORGET_IOV, OP_HELLO, OP_OWN_IOV,
    OP_OWN_IOV_LINK, OP_REG_FD, OP_REMOVE_IOR, OP_STATS,
};
use crate::ring::{ior_size, RingHeader, RingView, RING_MAGIC, RING_VERSION};
use crate::shm::{remove_if_present, to_hex, Id, Shm};
use crate::virt;
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
        }
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    config: DaemonConfig,
    pool: Arc<Pool>,
    stats: Arc<Stats>,
    sessions: Mutex<Vec<Weak<Session>>>,
}

/// One client connection's state.
#[derive(Debug)]
pub(crate) struct Session {
    shared: Arc<Shared>,
    pid: i32,
    files: Mutex<HashMap<u32, Arc<OpenFile>>>,
    next_file: AtomicU32,
    iovs: Mutex<HashMap<Id, Arc<MappedIov>>>,
    rings: Mutex<HashMap<Id, RingRunner>>,
    /// Ring publications attached by this client (removed if it dies).
    ring_links: Mutex<HashMap<Id, PathBuf>>,
    /// Iov publications this client owns, and whether the `/dev/shm` segment a link
    /// names is the client's to remove too (false for a caller's own segment wrapped
    /// with `Iov::wrap_shm`: only the link goes).
    owned_iovs: Mutex<HashMap<Id, bool>>,
}

impl Session {
    fn iov(&self, id: &Id) -> Result<Arc<MappedIov>> {
        if let Some(m) = self.iovs.lock().get(id) {
            return Ok(m.clone());
        }
        let mapped = Arc::new(MappedIov::map(&self.shared.config.mount, id)?);
        self.iovs.lock().insert(*id, mapped.clone());
        Ok(mapped)
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
        let iov = match self.iov(&sqe.iov_id) {
            Ok(iov) => iov,
            Err(e) => {
                tracing::debug!("client {}: iov {}: {e}", self.pid, to_hex(&sqe.iov_id));
                return fail(e.errno());
            }
        };
        if sqe
            .iov_offset
            .checked_add(sqe.len)
            .is_none_or(|end| end > iov.size())
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

    fn add_ring(self: &Arc<Self>, id: &Id) -> Result<()> {
        let mount = &self.shared.config.mount;
        let target = virt::read_publication(&virt::iors_dir(mount), id)?;
        if !host_target_allowed(&target) {
            return Err(Error::InvalidArgument(format!(
                "ring outside /dev/shm: {target}"
            )));
        }
        let shm = Shm::open(Path::new(&target), crate::ring::HEADER_BYTES)?;
        // SAFETY: the mapping holds at least a header (checked by open's min length).
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
        // SAFETY: the mapping has ior_size(entries) bytes and is owned by the context.
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
        self.ring_links
            .lock()
            .insert(*id, virt::link_path(&virt::iors_dir(mount), id));
        Ok(())
    }

    fn handle(self: &Arc<Self>, msg: &[u8], fds: Vec<std::os::fd::OwnedFd>) -> (i64, Vec<u8>) {
        let Some((&op, rest)) = msg.split_first() else {
            return (-(libc::EINVAL as i64), Vec::new());
        };
        let mut r = Reader(rest);
        let einval = (-(libc::EINVAL as i64), Vec::new());
        match op {
            OP_HELLO => (std::process::id() as i64, Vec::new()),
            OP_REG_FD => {
                let Some(fd) = fds.into_iter().next() else {
                    return (-(libc::EBADF as i64), Vec::new());
                };
                let id = self.next_file.fetch_add(1, Ordering::Relaxed);
                self.files
                    .lock()
                    .insert(id, Arc::new(OpenFile::new(fd, self.shared.config.direct)));
                (id as i64, Vec::new())
            }
            OP_DEREG_FD => match r.u32() {
                Some(id) => {
                    self.files.lock().remove(&id);
                    (0, Vec::new())
                }
                None => einval,
            },
            OP_ADD_IOR => match r.id() {
                Some(id) => match self.add_ring(&id) {
                    Ok(()) => (0, Vec::new()),
                    Err(e) => {
                        daemon_warn!("client {}: add ring {}: {e}", self.pid, to_hex(&id));
                        (-(e.errno() as i64), Vec::new())
                    }
                },
                None => einval,
            },
            OP_REMOVE_IOR => match r.id() {
                Some(id) => {
                    let runner = self.rings.lock().remove(&id);
                    self.ring_links.lock().remove(&id);
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
                Some(id) => {
                    self.owned_iovs.lock().insert(id, op == OP_OWN_IOV);
                    (0, Vec::new())
                }
                None => einval,
            },
            OP_FORGET_IOV => match r.id() {
                Some(id) => {
                    self.owned_iovs.lock().remove(&id);
                    for s in self.shared.sessions.lock().iter().filter_map(Weak::upgrade) {
                        s.iovs.lock().remove(&id);
                    }
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
        let mount = &self.shared.config.mount;
        // Publications of a client that died: the links and the /dev/shm files they name.
        let mut links: Vec<(PathBuf, bool)> = self
            .ring_links
            .lock()
            .drain()
            .map(|(_, l)| (l, true))
            .collect();
        links.extend(
            self.owned_iovs
                .lock()
                .drain()
                .map(|(id, segment)| (virt::link_path(&virt::iovs_dir(mount), &id), segment)),
        );
        for (link, segment_too) in links {
            if segment_too {
                if let Ok(target) = std::fs::read_link(&link) {
                    if let Some(t) = target.to_str().filter(|t| host_target_allowed(t)) {
                        let _ = remove_if_present(Path::new(t));
                    }
                }
            }
            let _ = remove_if_present(&link);
        }
    }
}

fn serve_client(shared: Arc<Shared>, sock: SeqPacket) {
    let session = Arc::new(Session {
        pid: sock.peer_pid().unwrap_or(-1),
        shared: shared.clone(),
        files: Mutex::default(),
        next_file: AtomicU32::new(1),
        iovs: Mutex::default(),
        rings: Mutex::default(),
        ring_links: Mutex::default(),
        owned_iovs: Mutex::default(),
    });
    {
        let mut sessions = shared.sessions.lock();
        sessions.retain(|w| w.strong_count() > 0);
        sessions.push(Arc::downgrade(&session));
    }
    shared.stats.clients_now.fetch_add(1, Ordering::Relaxed);
    tracing::info!("client {} connected", session.pid);
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
    let listener = SeqPacket::listen(&path)?;
    let shared = Arc::new(Shared {
        pool: Arc::new(Pool::default()),
        stats: Arc::new(Stats::default()),
        sessions: Mutex::default(),
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
