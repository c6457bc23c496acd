//! `POSIX`: NIXL's POSIX storage plugin. File descriptors registered as FILE memory
//! (`dev_id` = the descriptor, `addr` = the file offset); READ moves file → memory and
//! WRITE memory → file by `pread`/`pwrite`, within the agent (local only, no
//! notifications, as NIXL's). No daemon: the FILE backend's `hf3fs-gdr` path is for
//! storage that needs one.
//!
//! Memory is DRAM, or VRAM with feature `cuda`: VRAM goes through pinned host slots
//! (module `staged`: the file I/O of one piece overlaps the device copies of others),
//! `staging_size` bytes per transfer (default 4 MiB, allocated on its first post with
//! VRAM and kept for its reposts) cut into slots of `staging_slot_size` bytes (default
//! 1 MiB). [`crate::Agent::query_mem`] says `POSIX(staged)` for VRAM.
//!
//! With progress threads (the agent's default) a post hands the transfer's I/O to a
//! thread of its own and returns at once; status reads what it did. Without them the
//! post only arms the transfer and the first status check does the I/O on the caller's
//! thread. A READ that reaches past the end of the file is an error (`ENODATA`), as
//! NIXL's is: the destination would otherwise hold bytes that were never read.
//!
//! [`Backend::query_mem_info`] is NIXL's `queryMem` for this plugin: each descriptor's
//! metadata is a file path, answered by `stat` with `size`, `mode` and `mtime` (decimal
//! strings), or `None` where the path does not exist.

use crate::backend::{
    Backend, BackendInit, BackendParams, BackendXfer, Capabilities, LocalMd, PostParams, RemoteMd,
    XferEntry, XferOp, XferProgress, XferStatus,
};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use parking_lot::Mutex;
#[cfg(feature = "cuda")]
mod staged;
use std::any::Any;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// The backend's name.
pub const NAME: &str = "POSIX";

/// The `pread`/`pwrite` backend.
#[derive(Debug)]
pub struct PosixBackend {
    agent_name: String,
    progress_thread: bool,
    staging: StagingConfig,
}

/// The parameters `create` takes.
const PARAMS: &[&str] = &["staging_size", "staging_slot_size"];

/// How a transfer stages VRAM: `slots` slots of `slot` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StagingConfig {
    slot: usize,
    slots: usize,
}

impl StagingConfig {
    fn parse(params: &BackendParams) -> Result<Self> {
        if let Some(key) = params.keys().find(|k| !PARAMS.contains(&k.as_str())) {
            return Err(Error::InvalidParam(format!(
                "{NAME} takes no parameter `{key}` (it takes {})",
                PARAMS.join(", ")
            )));
        }
        let size: u64 = super::shared::param(NAME, params, "staging_size", 4 << 20)?;
        let slot: u64 = super::shared::param(NAME, params, "staging_slot_size", 1 << 20)?;
        if slot == 0 || size < slot {
            return Err(Error::InvalidParam(format!(
                "{NAME}: staging_size={size} must hold at least one slot of \
                 staging_slot_size={slot} (> 0) bytes"
            )));
        }
        let too_large = || {
            Error::InvalidParam(format!(
                "{NAME}: staging_size={size} does not fit in this machine's address space"
            ))
        };
        Ok(Self {
            slot: usize::try_from(slot).map_err(|_| too_large())?,
            slots: usize::try_from(size / slot).map_err(|_| too_large())?,
        })
    }
}

pub(crate) fn create(init: &BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(PosixBackend {
        agent_name: init.agent_name.clone(),
        progress_thread: init.progress_thread,
        staging: StagingConfig::parse(&init.params)?,
    }))
}

/// A registration: nothing to hold (the caller keeps the descriptor open); VRAM is
/// marked staged (what `query_mem` reports).
#[derive(Debug)]
enum Md {
    Direct,
    #[cfg(feature = "cuda")]
    Staged,
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
            Md::Direct => None,
            #[cfg(feature = "cuda")]
            Md::Staged => Some("staged"),
        }
    }
}

/// Memory kinds a POSIX transfer's memory side may be.
#[cfg(feature = "cuda")]
const MEMORY_KINDS: &[MemKind] = &[MemKind::Dram, MemKind::Vram];
#[cfg(not(feature = "cuda"))]
const MEMORY_KINDS: &[MemKind] = &[MemKind::Dram];

/// The agent's view of its own file region (the descriptor is in the region itself).
#[derive(Debug)]
struct RemoteView;

impl RemoteMd for RemoteView {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn io_error(code: i32, message: String) -> Error {
    Error::Backend {
        backend: NAME.into(),
        code,
        message,
    }
}

/// Checks that `fd` is an open file descriptor (`fstat`).
fn check_open(fd: u64) -> Result<()> {
    let raw = RawFd::try_from(fd)
        .map_err(|_| Error::InvalidParam(format!("{NAME}: {fd} is not an open file descriptor")))?;
    // SAFETY: `fstat` writes only into the zeroed `stat` it is given; any descriptor
    // number is acceptable (a closed one is EBADF).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(raw, &mut st) } == 0 {
        return Ok(());
    }
    let code = errno();
    if code == libc::EBADF {
        Err(Error::InvalidParam(format!(
            "{NAME}: {fd} is not an open file descriptor"
        )))
    } else {
        Err(io_error(
            code,
            format!("fstat of file descriptor {fd} failed"),
        ))
    }
}

/// NIXL's `queryFileInfo`: `size`, `mode` and `mtime` of the file at `path`, or `None`
/// where it cannot be stat'ed (absent, empty path, or a path with a NUL byte).
fn file_info(path: &[u8]) -> Option<BackendParams> {
    if path.is_empty() {
        return None;
    }
    let path = std::ffi::CString::new(path).ok()?;
    // SAFETY: `stat` reads the NUL-terminated path and writes only into `st`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::stat(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(BackendParams::from([
        ("size".to_string(), st.st_size.to_string()),
        ("mode".to_string(), st.st_mode.to_string()),
        ("mtime".to_string(), st.st_mtime.to_string()),
    ]))
}

impl PosixBackend {
    fn check_self(&self, agent: &str) -> Result<()> {
        if agent == self.agent_name {
            Ok(())
        } else {
            Err(Error::InvalidParam(format!(
                "{NAME} only moves data within agent `{}` (between its memory and its files), \
                 not to `{agent}`",
                self.agent_name
            )))
        }
    }
}

impl Backend for PosixBackend {
    fn name(&self) -> &str {
        NAME
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: false,
            notif: false,
        }
    }
    fn supported_mem(&self) -> &[MemKind] {
        #[cfg(feature = "cuda")]
        {
            &[MemKind::Dram, MemKind::Vram, MemKind::File]
        }
        #[cfg(not(feature = "cuda"))]
        {
            &[MemKind::Dram, MemKind::File]
        }
    }
    fn supported_remote_mem(&self) -> &[MemKind] {
        &[MemKind::File]
    }
    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        // VRAM was checked by the agent (a device range of GPU `dev_id`); it is reached
        // through pinned slots when a transfer runs.
        match region.kind {
            MemKind::File => check_open(region.desc.dev_id)?,
            MemKind::Dram => {}
            #[cfg(feature = "cuda")]
            MemKind::Vram => return Ok(Arc::new(Md::Staged)),
            kind => {
                return Err(Error::UnsupportedMemKind {
                    backend: NAME.into(),
                    kind,
                })
            }
        }
        Ok(Arc::new(Md::Direct))
    }
    fn connection_info(&self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn load_remote_conn_info(&self, _agent: &str, _info: &[u8]) -> Result<()> {
        Ok(())
    }
    fn load_remote_md(
        &self,
        _agent: &str,
        _region: &Region,
        _public: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        // Another agent's files are out of reach; prep_xfer says so.
        Ok(Arc::new(RemoteView))
    }
    fn disconnect(&self, _agent: &str) {}
    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        self.check_self(agent)?;
        let mut ios = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            if !MEMORY_KINDS.contains(&e.local_region.kind) || e.remote_region.kind != MemKind::File
            {
                return Err(Error::InvalidParam(format!(
                    "{NAME}: descriptor {i} pairs {:?} with {:?}: the local side is memory \
                     ({MEMORY_KINDS:?}) and the remote side FILE",
                    e.local_region.kind, e.remote_region.kind
                )));
            }
            let gpu = match e.local_region.kind {
                MemKind::Vram => Some(usize::try_from(e.local.dev_id).map_err(|_| {
                    Error::InvalidParam(format!("{NAME}: GPU {} does not exist", e.local.dev_id))
                })?),
                _ => None,
            };
            let fd = RawFd::try_from(e.remote.dev_id).map_err(|_| {
                Error::InvalidParam(format!(
                    "{NAME}: {} is not a file descriptor",
                    e.remote.dev_id
                ))
            })?;
            let offset = libc::off_t::try_from(e.remote.addr).map_err(|_| {
                Error::InvalidParam(format!("{NAME}: file offset {} too large", e.remote.addr))
            })?;
            let len = usize::try_from(e.local.len).map_err(|_| {
                Error::InvalidParam(format!("{NAME}: length {} too large", e.local.len))
            })?;
            ios.push(Io {
                fd,
                offset,
                mem: e.local.addr as usize,
                len,
                gpu,
            });
        }
        Ok(Box::new(PosixXfer {
            op,
            ios: Arc::new(ios),
            threaded: self.progress_thread,
            state: State::Idle,
            done_ops: Arc::new(AtomicU64::new(0)),
            runner: Arc::new(Mutex::new(Runner::new(self.staging))),
        }))
    }
    fn gen_notif(&self, _agent: &str, _msg: &[u8]) -> Result<()> {
        Err(Error::NotSupported {
            backend: NAME.into(),
            what: "notifications".into(),
        })
    }
    fn take_notifs(&self, _into: &mut Vec<(String, Vec<u8>)>) {}
    fn query_mem_info(&self, kind: MemKind, meta: &[&[u8]]) -> Result<Vec<Option<BackendParams>>> {
        if kind != MemKind::File {
            // Memory is answered from the registrations (`Agent::query_mem`): its
            // metadata names no file.
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("queries of {kind:?} by metadata (only FILE names files)"),
            });
        }
        Ok(meta.iter().map(|path| file_info(path)).collect())
    }
}

/// The outcome of a transfer's I/O: a failure as the `Error::Backend` (code, message) it
/// is reported as (kept apart from `Error`, which is not `Clone`, to answer every check).
type IoOutcome = std::result::Result<(), (i32, String)>;

/// One descriptor of a transfer: a `pread`/`pwrite` of DRAM, or of VRAM through the
/// staging slots.
#[derive(Debug, Clone, Copy)]
struct Io {
    fd: RawFd,
    offset: libc::off_t,
    /// The memory's address: DRAM, or VRAM of GPU `gpu`.
    mem: usize,
    len: usize,
    /// The GPU whose VRAM `mem` is; `None`: DRAM.
    gpu: Option<usize>,
}

impl Io {
    /// Moves the whole range of DRAM, retrying partial counts and `EINTR`.
    fn run(&self, op: XferOp) -> IoOutcome {
        let mut done = 0usize;
        while done < self.len {
            let at = self.offset + done as libc::off_t;
            let ptr = self.mem + done;
            let left = self.len - done;
            let n = match op {
                // SAFETY: the DRAM range was checked by the agent to lie inside a
                // registration whose contract keeps it valid while a transfer exists
                // (and a transfer in flight is waited for before it is released).
                XferOp::Read => unsafe { libc::pread(self.fd, ptr as *mut libc::c_void, left, at) },
                // SAFETY: as above.
                XferOp::Write => unsafe {
                    libc::pwrite(self.fd, ptr as *const libc::c_void, left, at)
                },
            };
            match n {
                n if n > 0 => done += n as usize,
                0 if op == XferOp::Read => {
                    return Err((
                        libc::ENODATA,
                        format!(
                            "read of {} bytes at offset {} of file descriptor {} reaches past \
                             the end of the file ({} bytes read)",
                            self.len, self.offset, self.fd, done
                        ),
                    ))
                }
                0 => {
                    return Err((
                        libc::EIO,
                        format!(
                            "write at offset {at} of file descriptor {} wrote nothing",
                            self.fd
                        ),
                    ))
                }
                _ => {
                    let code = errno();
                    if code == libc::EINTR {
                        continue;
                    }
                    return Err((
                        code,
                        format!(
                            "{} of {left} bytes at offset {at} of file descriptor {} failed: {}",
                            if op == XferOp::Read {
                                "pread"
                            } else {
                                "pwrite"
                            },
                            self.fd,
                            std::io::Error::from_raw_os_error(code)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// What runs a transfer's I/O: DRAM directly, VRAM through the staging slots (made on
/// the first run that needs them, kept for the transfer's reposts).
#[derive(Debug)]
struct Runner {
    staging: StagingConfig,
    #[cfg(feature = "cuda")]
    stager: Option<staged::Stager>,
}

impl Runner {
    fn new(staging: StagingConfig) -> Self {
        Self {
            staging,
            #[cfg(feature = "cuda")]
            stager: None,
        }
    }

    /// Runs `ios` in order, counting those done; stops at the first error, given as the
    /// `Error::Backend`'s (code, message). Consecutive VRAM descriptors are staged
    /// together (their pieces share the pipeline).
    fn run_all(&mut self, op: XferOp, ios: &[Io], done_ops: &AtomicU64) -> IoOutcome {
        let mut at = 0;
        while at < ios.len() {
            if ios[at].gpu.is_none() {
                ios[at].run(op)?;
                done_ops.fetch_add(1, Ordering::Relaxed);
                at += 1;
                continue;
            }
            let end = ios[at..]
                .iter()
                .position(|io| io.gpu.is_none())
                .map_or(ios.len(), |n| at + n);
            self.run_staged(op, &ios[at..end])?;
            done_ops.fetch_add((end - at) as u64, Ordering::Relaxed);
            at = end;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn run_staged(&mut self, op: XferOp, ios: &[Io]) -> IoOutcome {
        let stager = match &mut self.stager {
            Some(stager) => stager,
            None => {
                // Pinned for the first VRAM's GPU; portable, so the copies of every GPU
                // use it at pinned speed.
                let gpu = ios.iter().find_map(|io| io.gpu).unwrap_or(0);
                let copier = Box::new(super::cuda_copy::StagingCopier::new(1));
                self.stager.insert(staged::Stager::new(
                    copier,
                    gpu,
                    self.staging.slot,
                    self.staging.slots,
                )?)
            }
        };
        stager.run(op, ios)
    }

    #[cfg(not(feature = "cuda"))]
    fn run_staged(&mut self, _op: XferOp, _ios: &[Io]) -> IoOutcome {
        // prep_xfer takes DRAM only without feature `cuda`.
        let _ = self.staging;
        Err((libc::EINVAL, format!("{NAME}: VRAM needs feature `cuda`")))
    }
}

/// Where a posted transfer is.
#[derive(Debug)]
enum State {
    /// Never posted, or its outcome was reported.
    Idle,
    /// Posted without progress threads: the next check does the I/O.
    Armed,
    /// Posted to a thread of its own, which leaves its outcome in the slot.
    Running {
        thread: Option<JoinHandle<()>>,
        outcome: Arc<Mutex<Option<IoOutcome>>>,
    },
    /// Finished (the outcome is repeated to every check until the next post).
    /// Errors of I/O are all `Error::Backend`: kept as its (code, message) to be
    /// rebuilt for each check.
    Finished(IoOutcome),
}

#[derive(Debug)]
struct PosixXfer {
    op: XferOp,
    ios: Arc<Vec<Io>>,
    threaded: bool,
    state: State,
    done_ops: Arc<AtomicU64>,
    /// Used by one run at a time (a post waits for the previous run's thread).
    runner: Arc<Mutex<Runner>>,
}

impl PosixXfer {
    /// Waits for a thread still moving data (the memory must not be released under it).
    fn join(&mut self) {
        if let State::Running { thread, .. } = &mut self.state {
            if let Some(t) = thread.take() {
                if t.join().is_err() {
                    tracing::error!("{NAME}: an I/O thread panicked");
                }
            }
        }
    }

    fn finished(&self) -> Result<XferProgress> {
        match &self.state {
            State::Finished(Ok(())) => Ok(XferProgress {
                status: XferStatus::Done,
                completed_ops: self.done_ops.load(Ordering::Relaxed),
            }),
            State::Finished(Err((code, message))) => Err(io_error(*code, message.clone())),
            _ => Ok(XferProgress {
                status: XferStatus::InProgress,
                completed_ops: self.done_ops.load(Ordering::Relaxed),
            }),
        }
    }
}

impl BackendXfer for PosixXfer {
    fn post(&mut self, notif: Option<&[u8]>, _params: &PostParams) -> Result<XferStatus> {
        if notif.is_some() {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: "notifications".into(),
            });
        }
        self.join();
        self.done_ops.store(0, Ordering::Relaxed);
        if !self.threaded {
            self.state = State::Armed;
            return Ok(XferStatus::InProgress);
        }
        let outcome = Arc::new(Mutex::new(None));
        let (op, ios, done_ops, slot, runner) = (
            self.op,
            self.ios.clone(),
            self.done_ops.clone(),
            outcome.clone(),
            self.runner.clone(),
        );
        let thread = std::thread::Builder::new()
            .name("nixl-posix-io".into())
            .spawn(move || {
                let result = runner.lock().run_all(op, &ios, &done_ops);
                *slot.lock() = Some(result);
            })
            .map_err(|e| {
                io_error(
                    e.raw_os_error().unwrap_or(0),
                    format!("spawning an I/O thread failed: {e}"),
                )
            })?;
        self.state = State::Running {
            thread: Some(thread),
            outcome,
        };
        Ok(XferStatus::InProgress)
    }

    fn check(&mut self) -> Result<XferProgress> {
        match &self.state {
            State::Idle => {
                return Err(Error::InvalidParam(format!(
                    "{NAME}: the transfer was not posted"
                )))
            }
            State::Armed => {
                let result = self
                    .runner
                    .lock()
                    .run_all(self.op, &self.ios, &self.done_ops);
                self.state = State::Finished(result);
            }
            State::Running { outcome, .. } => {
                let taken = outcome.lock().take();
                if let Some(result) = taken {
                    self.join();
                    self.state = State::Finished(result);
                }
            }
            State::Finished(_) => {}
        }
        self.finished()
    }

    fn op_count(&self) -> usize {
        self.ios.len()
    }
}

impl Drop for PosixXfer {
    fn drop(&mut self) {
        // Released while in flight: the thread finishes its I/O first, so that no write
        // lands in memory the caller frees after the release.
        self.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> BackendParams {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn staging_parameters_default_and_are_checked() {
        assert_eq!(
            StagingConfig::parse(&BackendParams::new()).unwrap(),
            StagingConfig {
                slot: 1 << 20,
                slots: 4
            }
        );
        // A size that is not a multiple of the slot keeps the whole slots.
        assert_eq!(
            StagingConfig::parse(&params(&[
                ("staging_size", "10000"),
                ("staging_slot_size", "4096")
            ]))
            .unwrap(),
            StagingConfig {
                slot: 4096,
                slots: 2
            }
        );
        for bad in [
            params(&[("staging_slot_size", "0")]),
            params(&[("staging_size", "100"), ("staging_slot_size", "4096")]),
            params(&[("staging_size", "lots")]),
            params(&[("use_uring", "1")]),
        ] {
            assert!(
                matches!(StagingConfig::parse(&bad), Err(Error::InvalidParam(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn memory_is_queried_through_registrations_files_by_path() {
        let backend = PosixBackend {
            agent_name: "a".into(),
            progress_thread: false,
            staging: StagingConfig::parse(&BackendParams::new()).unwrap(),
        };
        for kind in [MemKind::Dram, MemKind::Vram] {
            assert!(matches!(
                backend.query_mem_info(kind, &[b"/"]),
                Err(Error::NotSupported { .. })
            ));
        }
        let answers = backend
            .query_mem_info(MemKind::File, &[b"/", b"/nonexistent/x"])
            .unwrap();
        assert!(answers[0].is_some() && answers[1].is_none());
    }

    #[test]
    fn vram_is_registered_staged_where_gpus_are_built_in() {
        let backend = PosixBackend {
            agent_name: "a".into(),
            progress_thread: false,
            staging: StagingConfig::parse(&BackendParams::new()).unwrap(),
        };
        let region = |kind| Region {
            kind,
            desc: crate::mem::Desc::new(0x1000, 64, 0),
        };
        assert_eq!(
            backend.register_mem(&region(MemKind::Dram)).unwrap().mode(),
            None
        );
        let vram = backend.register_mem(&region(MemKind::Vram));
        #[cfg(feature = "cuda")]
        assert_eq!(vram.unwrap().mode(), Some("staged"));
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(vram, Err(Error::UnsupportedMemKind { .. })));
    }
}
