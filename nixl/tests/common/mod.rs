//! What the integration tests share: agents, buffers, bounded waits, the soft-RoCE
//! guest's guards, and copies of the test binary run as peer processes. Each test binary
//! uses a part of it (`mod common;`), hence `dead_code` allowed.
#![allow(dead_code)]

use nixl::XferStatus;
use nixl::{params, Agent, AgentConfig, BackendParams, Desc, DescList, Error, MemKind, XferReq};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

pub mod notif_wait;
pub mod peer_guest;
pub mod restart;
pub mod staged;
pub mod twohost;
pub mod write_signal;

/// Prints the library's `tracing` events to stderr as `RUST_LOG` asks (nothing where it
/// is unset); the first line names this process (peer processes log beside the test).
pub fn init_tracing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("RUST_LOG").is_none() {
            return;
        }
        let pid = std::process::id();
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .with_thread_names(true)
            .with_ansi(false)
            .try_init();
        tracing::info!(pid, "tracing on");
    });
}

/// Bound on every wait: generous, so that a slow machine fails only when something hangs.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// Bytes that differ at every offset and between seeds (no short period, so a block that
/// lands at the wrong offset is caught).
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed)
        .collect()
}

pub fn dram(descs: impl IntoIterator<Item = Desc>) -> DescList {
    DescList::from_descs(MemKind::Dram, descs)
}

pub fn vram(descs: impl IntoIterator<Item = Desc>) -> DescList {
    DescList::from_descs(MemKind::Vram, descs)
}

/// `base` with the pairs of `extra` added (or replacing its own).
pub fn with_extra(mut base: BackendParams, extra: &[(&str, &str)]) -> BackendParams {
    for (k, v) in extra {
        base.insert(k.to_string(), v.to_string());
    }
    base
}

/// An agent with one backend; a backend that does not open fails the test naming it.
pub fn agent_with_backend(
    name: &str,
    config: AgentConfig,
    backend: &str,
    backend_params: &BackendParams,
) -> Agent {
    let agent = Agent::new(name, config).unwrap();
    agent
        .create_backend(backend, backend_params)
        .unwrap_or_else(|e| panic!("{backend} ({backend_params:?}): {e}"));
    agent
}

/// An agent with one LIBFABRIC backend over `provider`, `extra` added to its parameters.
pub fn fabric_agent(name: &str, provider: &str, extra: &[(&str, &str)]) -> Agent {
    let p = with_extra(params([("provider", provider)]), extra);
    agent_with_backend(name, AgentConfig::default(), "LIBFABRIC", &p)
}

/// An agent configuration that listens for metadata requests on loopback.
pub fn listening() -> AgentConfig {
    AgentConfig {
        listen_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..AgentConfig::default()
    }
}

/// The notifications from `from`, waited for (bounded; others are dropped).
pub fn wait_notifs(agent: &Agent, from: &str) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no notification from {from}");
        if let Some(msgs) = agent.wait_notifs(left).remove(from) {
            return msgs;
        }
    }
}

/// The first notification from `from`, waited for (bounded).
pub fn wait_notif(agent: &Agent, from: &str) -> Vec<u8> {
    wait_notifs(agent, from).remove(0)
}

/// Waits for a notification from `from`; runs `at_arrival` the moment it arrives, before
/// anything else is waited for.
pub fn on_notif<T>(agent: &Agent, from: &str, at_arrival: impl FnOnce(Vec<u8>) -> T) -> T {
    at_arrival(wait_notif(agent, from))
}

/// Polls until the request is done or fails; one still in progress after [`TIMEOUT`] is a
/// hang and fails the test.
pub fn finish(req: &mut XferReq) -> nixl::Result<()> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if req.status()? == XferStatus::Done {
            return Ok(());
        }
        assert!(
            Instant::now() < deadline,
            "transfer neither done nor failed: hang"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The error a posted request to a peer that was killed ends in: polled, and posted again
/// whenever it completes before the transport notices, never longer than [`TIMEOUT`].
pub fn error_after_peer_died(req: &mut XferReq) -> Error {
    let started = Instant::now();
    loop {
        match req.status() {
            Ok(XferStatus::Done) => {
                if let Err(e) = req.post() {
                    return e;
                }
            }
            Ok(XferStatus::InProgress) => std::thread::sleep(Duration::from_micros(200)),
            Err(e) => return e,
        }
        assert!(
            started.elapsed() < TIMEOUT,
            "the dead peer was never noticed"
        );
    }
}

// ---- the soft-RoCE guest ------------------------------------------------------------------

/// The device named by `RDMA_TEST_DEVICE`, or `None` (after printing why) when unset.
pub fn rdma_device() -> Option<String> {
    let Ok(name) = std::env::var("RDMA_TEST_DEVICE") else {
        println!("skipped: RDMA_TEST_DEVICE not set (run via cargo xtask test)");
        return None;
    };
    watchdog();
    Some(name)
}

/// Aborts the binary if it runs far too long: a hang must fail, not stall the guest.
fn watchdog() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_secs(600));
            eprintln!("test watchdog expired after 600 s");
            std::process::abort();
        });
    });
}

/// The guest has two vCPUs: one test at a time.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The dead-peer scenario of the LIBFABRIC and VERBS tests: `initiator` (with the
/// default stall timeout) WRITEs `len` bytes as `block`-byte descriptors with a
/// notification to a peer named `peer_name` that `spawn(tag)` starts and announces; the
/// peer is killed once mid-transfer (`"busy"`) and once idle (`"idle"`), or frozen
/// (SIGSTOP) mid-transfer (`"frozen"`: a hung host, whose kernel keeps its sockets open
/// and, on soft-RoCE, even acknowledges RDMA: only the backend's heartbeats tell), and
/// each must be `RemoteDisconnect` naming it within `bound` (polls give up after
/// `limit`). The frozen peer is then thawed and loaded again (its metadata invalidated
/// and fetched anew): a transfer to it must complete. The figures are printed under
/// `label`.
#[allow(clippy::too_many_arguments)]
pub fn dead_peer_scenario(
    initiator: &Agent,
    label: &str,
    peer_name: &str,
    len: usize,
    block: usize,
    spawn: impl Fn(&str) -> PeerProcess,
    limit: Duration,
    bound: Duration,
    cases: &[&str],
) {
    dead_peer_scenario_of(
        nixl::XferOp::Write,
        initiator,
        label,
        peer_name,
        len,
        block,
        spawn,
        limit,
        bound,
        cases,
    );
}

/// [`dead_peer_scenario`] with READs (`op`) instead of WRITEs.
#[allow(clippy::too_many_arguments)]
pub fn dead_peer_scenario_of(
    op: nixl::XferOp,
    initiator: &Agent,
    label: &str,
    peer_name: &str,
    len: usize,
    block: usize,
    spawn: impl Fn(&str) -> PeerProcess,
    limit: Duration,
    bound: Duration,
    cases: &[&str],
) {
    let stall = initiator.config().stall_timeout;
    assert!(
        stall >= Duration::from_secs(30),
        "the default stall timeout ({stall:?}) must stay"
    );
    let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    // SAFETY: `src` outlives the handle and every request of this function.
    let _h = unsafe {
        initiator
            .register_mem(&dram([Desc::from_slice(&src)]), None)
            .unwrap()
    };
    let transfer = |base: u64| {
        let n = len / block;
        let src_p = src.as_ptr() as u64;
        initiator
            .create_xfer_req(
                op,
                &dram((0..n).map(|i| Desc::new(src_p + (i * block) as u64, block as u64, 0))),
                &dram((0..n).map(|i| Desc::new(base + (i * block) as u64, block as u64, 0))),
                peer_name,
                Some(b"x".to_vec()),
            )
            .unwrap()
    };
    for (tag, case) in [
        ("busy", "killed mid-transfer"),
        ("idle", "killed while idle, then posted to"),
        ("frozen", "frozen (SIGSTOP) mid-transfer"),
    ]
    .into_iter()
    .filter(|(tag, _)| cases.contains(tag))
    {
        let mut peer = spawn(tag);
        assert_eq!(
            initiator.fetch_remote_metadata(peer.addr).unwrap(),
            peer_name
        );
        let mut req = transfer(peer.base);
        req.post().unwrap();
        req.wait(limit).unwrap();
        if tag != "idle" {
            // A second post, so the kill lands while its writes are in flight.
            req.post().unwrap();
        }
        if tag == "frozen" {
            signal(&peer, libc::SIGSTOP);
        } else {
            peer.child.kill().unwrap();
        }
        let killed = Instant::now();
        if tag == "idle" {
            // Posted to once dead: the process has ended before the post. (A post racing
            // the kill can reach libfabric 1.17's shm while the dying peer holds its
            // region's spinlock, which wedges the rail: the busy case is that race.)
            peer.child.wait().unwrap();
        }
        let (err, took) = fail_time(&mut req, killed, limit);
        let label = format!("{label}, {case}");
        println!("{label}: {took:?} -> {err}");
        match err {
            Error::RemoteDisconnect { agent, .. } => assert_eq!(agent, peer_name),
            other => panic!("{label}: expected RemoteDisconnect, got {other:?}"),
        }
        assert!(
            took < bound,
            "{label}: RemoteDisconnect after {took:?} (bound {bound:?})"
        );
        drop(req);
        if tag == "frozen" {
            signal(&peer, libc::SIGCONT);
            initiator.invalidate_remote(peer_name).unwrap();
            assert_eq!(
                initiator.fetch_remote_metadata(peer.addr).unwrap(),
                peer_name
            );
            let mut req = transfer(peer.base);
            req.post().unwrap();
            req.wait(limit)
                .unwrap_or_else(|e| panic!("{label}: thawed and reloaded, the peer fails: {e}"));
            println!("{label}: thawed and loaded again, a transfer completes");
            drop(req);
            peer.child.kill().unwrap();
        }
        peer.child.wait().unwrap();
    }
}

/// Sends `sig` to the peer process.
fn signal(peer: &PeerProcess, sig: libc::c_int) {
    // SAFETY: kill(2) with the pid of our own (not yet reaped) child.
    let rc = unsafe { libc::kill(peer.child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({sig}): {}", std::io::Error::last_os_error());
}

/// Polls `req` (reposting whenever it completes first) until it fails, for at most
/// `limit`: the error and the time from `since` (a dead peer's detection delay).
fn fail_time(req: &mut XferReq, since: Instant, limit: Duration) -> (Error, Duration) {
    loop {
        let outcome = match req.status() {
            Ok(XferStatus::Done) => req.post().map(|_| ()),
            Ok(XferStatus::InProgress) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            return (e, since.elapsed());
        }
        assert!(since.elapsed() < limit, "the dead peer was never noticed");
        std::thread::sleep(Duration::from_micros(100));
    }
}

// ---- peer processes -----------------------------------------------------------------------

/// A file in the temporary folder named after `prefix`, this process and `tag`, with
/// what an earlier run left there removed.
pub fn announce_path(prefix: &str, tag: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "{prefix}-{}-{}",
        std::process::id(),
        tag.replace(';', "_")
    ));
    for suffix in ["", ".tmp", ".ok"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    path
}

/// This test binary run again for test `test` alone (`--ignored` where it is ignored);
/// its stdout is dropped (the harness owns it: peers speak through files).
pub fn self_test(test: &str, ignored: bool) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--test-threads=1"])
        .stdout(Stdio::null());
    if ignored {
        cmd.arg("--ignored");
    }
    cmd
}

/// Writes `text` to `path` whole: the reader never sees a partial file.
pub fn announce(path: impl AsRef<Path>, text: &str) {
    let path = path.as_ref().display().to_string();
    std::fs::write(format!("{path}.tmp"), text).unwrap();
    std::fs::rename(format!("{path}.tmp"), path).unwrap();
}

/// Announces `agent`'s metadata address and the base address of its buffer at `path`,
/// as [`PeerProcess::spawn`] reads them.
pub fn announce_agent(path: impl AsRef<Path>, agent: &Agent, base: u64) {
    announce(path, &format!("{} {base}", agent.listen_addr().unwrap()));
}

/// The text of `path` once it exists; bounded, and failing when `child` exits first.
pub fn wait_file(path: &Path, child: &mut Child) -> String {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the peer exited early waiting for {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A peer process that announced its metadata address and buffer base (see
/// [`announce_agent`]); killed, and its files removed, when dropped.
pub struct PeerProcess {
    pub child: Child,
    pub addr: std::net::SocketAddr,
    pub base: u64,
    pub announce: PathBuf,
}

impl PeerProcess {
    /// Starts `cmd` and waits until it announced itself at `announce`.
    pub fn spawn(mut cmd: Command, announce: PathBuf) -> Self {
        let mut child = cmd.spawn().unwrap();
        let text = wait_file(&announce, &mut child);
        let (addr, base) = text.split_once(' ').unwrap();
        Self {
            child,
            addr: addr.parse().unwrap(),
            base: base.parse().unwrap(),
            announce,
        }
    }

    /// The file the peer writes its verdict to when it is done.
    pub fn ok_path(&self) -> PathBuf {
        PathBuf::from(format!("{}.ok", self.announce.display()))
    }

    /// Waits for the peer to exit successfully and returns its verdict.
    pub fn verdict(&mut self) -> String {
        assert!(self.child.wait().unwrap().success(), "the peer failed");
        std::fs::read_to_string(self.ok_path()).unwrap()
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.announce);
        let _ = std::fs::remove_file(self.ok_path());
        remove_shm_of(self.child.id());
    }
}

/// Removes what libfabric's shm provider left in `/dev/shm` for process `pid` (its
/// regions are named `PID:...`): a killed peer cannot unlink them, and a later process
/// that gets the same pid then fails `fi_enable` with EBUSY.
pub fn remove_shm_of(pid: u32) {
    let prefix = format!("{pid}:");
    if let Ok(dir) = std::fs::read_dir("/dev/shm") {
        for entry in dir.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

// ---- GPU memory ---------------------------------------------------------------------------

/// Device memory of `len` bytes holding `fill` (zeroes where `fill` is empty).
#[cfg(feature = "cuda")]
pub fn device_buffer(gpu: &gpu_mem::Gpu, len: usize, fill: &[u8]) -> gpu_mem::DeviceBuffer {
    let buf = gpu_mem::DeviceBuffer::alloc(gpu, len).unwrap();
    if fill.is_empty() {
        buf.fill(0).unwrap();
    } else {
        buf.copy_from_host(0, fill).unwrap();
    }
    buf
}

/// `len` bytes of `buf` from `offset`.
#[cfg(feature = "cuda")]
pub fn on(buf: &gpu_mem::DeviceBuffer, offset: usize, len: usize) -> Desc {
    Desc::new(
        buf.ptr() + offset as u64,
        len as u64,
        buf.gpu().ordinal() as u64,
    )
}

/// All of `buf`.
#[cfg(feature = "cuda")]
pub fn whole(buf: &gpu_mem::DeviceBuffer) -> Desc {
    on(buf, 0, buf.len())
}

/// A post attached to the caller's stream (`PostParams::custom` = `Arc<CudaStream>`)
/// moves what the stream produced before it: a 1 GiB memset is queued on the stream,
/// then the WRITE (1 GiB, VRAM to VRAM within `agent`, named `name`) is posted on it,
/// twice with different bytes; `before_each` may check the request first (e.g. a bad
/// parameter). `agent` must have a backend that takes VRAM and attached posts.
#[cfg(feature = "cuda")]
pub fn attached_post_moves_what_the_stream_produced(
    gpu: &gpu_mem::Gpu,
    agent: &Agent,
    name: &str,
    before_each: impl Fn(&mut XferReq),
) {
    const LEN: usize = 1 << 30;
    let src = gpu_mem::DeviceBuffer::alloc(gpu, LEN).unwrap();
    let dst = gpu_mem::DeviceBuffer::alloc(gpu, LEN).unwrap();
    // SAFETY: both outlive the handle and the request.
    let _h = unsafe {
        agent
            .register_mem(&vram([whole(&src), whole(&dst)]), None)
            .unwrap()
    };
    let mut w = agent
        .create_xfer_req(
            nixl::XferOp::Write,
            &vram([whole(&src)]),
            &vram([whole(&dst)]),
            name,
            None,
        )
        .unwrap();
    let stream = gpu.new_stream().unwrap();
    for value in [0x5a_u8, 0xa5] {
        before_each(&mut w);
        src.fill(0).unwrap();
        dst.fill(0).unwrap();
        gpu.bind().unwrap();
        // SAFETY: `src` is a live allocation of LEN bytes; the stream is live.
        unsafe {
            gpu_mem::cudarc::driver::sys::cuMemsetD8Async(src.ptr(), value, LEN, stream.cu_stream())
        }
        .result()
        .unwrap();
        let params = nixl::PostParams {
            custom: Some(Box::new(stream.clone())),
        };
        w.post_with(None, &params).unwrap();
        w.wait(TIMEOUT).unwrap();
        let mut probe = vec![0u8; 4096];
        dst.copy_to_host(LEN - 4096, &mut probe).unwrap();
        assert!(
            probe.iter().all(|b| *b == value),
            "the transfer ran before the producer"
        );
    }
}

/// The provider `agent`'s LIBFABRIC backend reaches `peer` through (`shm` for a peer on
/// this host, else the network provider); `None` before the peer is loaded.
pub fn fabric_transport(agent: &Agent, peer: &str) -> Option<String> {
    agent
        .backends()
        .iter()
        .find(|b| b.name() == "LIBFABRIC")?
        .peer_transport(peer)
}
