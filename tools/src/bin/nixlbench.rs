//! `nixlbench`: transfer bandwidth and latency of the `nixl` agent, with the option names
//! and result columns of NIXL's nixlbench.
//!
//! With no role given it starts its own target as a second process on loopback and
//! drives it (the README's main job). With `--role target --listen ADDR` and
//! `--role initiator --target_address ADDR` the two sides run on two hosts. `LOCAL`
//! moves data inside one agent, so with `--backend LOCAL` both sides live in one process.
//!
//! Memory is DRAM or, with feature `cuda`, VRAM (`gpunetio::DeviceBuffer`) on either side.
//!
//! # LIBFABRIC provider
//! NIXL's UCX picks shared memory when both agents share a host; LIBFABRIC's `shm` is our
//! equivalent (measured 2x `tcp;ofi_rxm` at 64 KiB–1 MiB on loopback). The initiator
//! chooses the provider, in this order: the one the target was started with
//! (`--backend_param provider=…` on the target), the user's `--backend_param provider=…`,
//! `shm` when the target address is on this host (loopback, unspecified or one of this
//! host's interface addresses), else NIXL's priority list. A target started without a
//! provider waits for the initiator's choice: the initiator's agent is named
//! `nixlbench-initiator@PROVIDER`, and the target creates its backend with the provider
//! of the first such agent whose metadata reaches it (a target with a provider is named
//! `nixlbench-target@PROVIDER`, which the initiator reads first).

use nixl::{Agent, AgentConfig, BackendParams, Desc, DescList, MemKind, PostParams, XferOp};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: nixlbench [options]
  --backend NAME              LIBFABRIC (default), VERBS, CUDA_IPC (feature cuda: GPU
                              memory between processes of one node) or LOCAL (one agent:
                              both sides run in this process)
  --backend_param KEY=VALUE   backend parameter (repeatable), e.g. provider=tcp;ofi_rxm,
                              num_rails=2. LIBFABRIC's provider defaults to shm when the
                              target is on this host (the self-launched one always is),
                              else to the first of cxi, efa, tcp;ofi_rxm, sockets
  --device_list LIST          network devices, comma-separated (default all); each side
                              takes the first entry (NIXL: the entry of its rank in its
                              role). VERBS: its `device`; LIBFABRIC: printed only, as NIXL
  --op_type READ|WRITE        (default WRITE)
  --initiator_seg_type DRAM|VRAM   --target_seg_type DRAM|VRAM   (default DRAM; VRAM needs
                              feature cuda: cargo build --release -p tools --features cuda)
  --initiator_gpu N           GPU ordinal of initiator VRAM (default 0)  [ours: NIXL uses
  --target_gpu N              GPU ordinal of target VRAM (default 0)      the process rank]
  --total_buffer_size BYTES   per side (default 64 MiB)
  --start_block_size BYTES    (default 4096)      --max_block_size BYTES  (default 1048576)
  --start_batch_size N        (default 1)         --max_batch_size N      (default 1)
  --num_iter N                (default 1000)      --warmup_iter N         (default 100)
  --large_blk_iter_ftr N      iterations divided by N for blocks >= 1 MiB (default 16)
  --num_threads N             initiator threads, each with its own request (default 1)
  --check_consistency         verify the data of every block and batch size: WRITE on the
                              target's own memory, READ on the initiator's (VRAM copied
                              back to the host)
  --plot FILE.png             draw bandwidth and latency against block size
  --no_progress               no progress bar
  --role target|initiator     run one side only (default: both, the target as a child process)
  --listen ADDR               target: metadata listener address (default 127.0.0.1:0)
  --target_address ADDR       initiator: the target's listener";

const TARGET: &str = "nixlbench-target";
const INITIATOR: &str = "nixlbench-initiator";
/// Set in the self-launched target's environment: it stays quiet.
const CHILD_ENV: &str = "NIXLBENCH_CHILD";

#[derive(Debug, Clone)]
struct Options {
    backend: String,
    backend_params: BackendParams,
    device_list: Vec<String>,
    op: XferOp,
    initiator_seg: MemKind,
    target_seg: MemKind,
    initiator_gpu: usize,
    target_gpu: usize,
    total_buffer_size: usize,
    start_block_size: usize,
    max_block_size: usize,
    start_batch_size: usize,
    max_batch_size: usize,
    num_iter: usize,
    warmup_iter: usize,
    large_blk_iter_ftr: usize,
    num_threads: usize,
    check_consistency: bool,
    plot: Option<String>,
    progress: bool,
    role: Option<String>,
    listen: SocketAddr,
    target_address: Option<SocketAddr>,
}

impl Options {
    fn is_libfabric(&self) -> bool {
        self.backend == "LIBFABRIC"
    }

    /// The provider the user named, if any.
    fn user_provider(&self) -> Option<&str> {
        self.backend_params.get("provider").map(String::as_str)
    }

    /// Backend parameters, with `provider` set (LIBFABRIC) and `--device_list` mapped.
    fn params(&self, provider: Option<&str>) -> BackendParams {
        let mut params = self.backend_params.clone();
        if let Some(p) = provider {
            params.insert("provider".into(), p.into());
        }
        if self.backend == "VERBS" && !params.contains_key("device") {
            if let Some(dev) = self.device() {
                params.insert("device".into(), dev.into());
            }
        }
        params
    }

    /// This side's entry of `--device_list` (`None` for `all`).
    fn device(&self) -> Option<&str> {
        self.device_list
            .first()
            .map(String::as_str)
            .filter(|d| *d != "all")
    }
}

fn parse_seg_type(key: &str, v: &str) -> Result<MemKind, String> {
    match MemKind::parse(v) {
        Some(MemKind::Dram) => Ok(MemKind::Dram),
        Some(MemKind::Vram) if cfg!(feature = "cuda") => Ok(MemKind::Vram),
        Some(MemKind::Vram) => Err(format!(
            "{key} VRAM: nixlbench was built without feature cuda \
             (cargo build --release -p tools --bin nixlbench --features cuda)"
        )),
        _ => Err(format!("{key} {v}: DRAM or VRAM")),
    }
}

fn parse_args(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        backend: "LIBFABRIC".into(),
        backend_params: BackendParams::new(),
        device_list: vec!["all".into()],
        op: XferOp::Write,
        initiator_seg: MemKind::Dram,
        target_seg: MemKind::Dram,
        initiator_gpu: 0,
        target_gpu: 0,
        total_buffer_size: 64 << 20,
        start_block_size: 4096,
        max_block_size: 1 << 20,
        start_batch_size: 1,
        max_batch_size: 1,
        num_iter: 1000,
        warmup_iter: 100,
        large_blk_iter_ftr: 16,
        num_threads: 1,
        check_consistency: false,
        plot: None,
        progress: true,
        role: None,
        listen: "127.0.0.1:0".parse().expect("literal"),
        target_address: None,
    };
    let mut i = 0;
    while i < args.len() {
        let (key, inline) = match args[i].split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k.to_string(), Some(v.to_string())),
            _ => (args[i].clone(), None),
        };
        let mut value = || -> Result<String, String> {
            if let Some(v) = &inline {
                return Ok(v.clone());
            }
            i += 1;
            args.get(i)
                .cloned()
                .ok_or_else(|| format!("{key} needs a value"))
        };
        let num = |v: String| {
            v.parse::<usize>()
                .map_err(|_| format!("{key}: `{v}` is not a number"))
        };
        match key.as_str() {
            "--backend" => o.backend = value()?.to_ascii_uppercase(),
            "--backend_param" => {
                let v = value()?;
                let (k, val) = v.split_once('=').ok_or("--backend_param takes KEY=VALUE")?;
                o.backend_params.insert(k.to_string(), val.to_string());
            }
            "--device_list" => {
                let v = value()?;
                o.device_list = v
                    .split(',')
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .map(String::from)
                    .collect();
                if o.device_list.is_empty() {
                    return Err("--device_list: at least one device, or all".into());
                }
            }
            "--op_type" => {
                let v = value()?;
                o.op = XferOp::parse(&v).ok_or(format!("--op_type: READ or WRITE, not {v}"))?;
            }
            "--initiator_seg_type" => o.initiator_seg = parse_seg_type(&key, &value()?)?,
            "--target_seg_type" => o.target_seg = parse_seg_type(&key, &value()?)?,
            "--initiator_gpu" => o.initiator_gpu = num(value()?)?,
            "--target_gpu" => o.target_gpu = num(value()?)?,
            "--total_buffer_size" => o.total_buffer_size = num(value()?)?,
            "--start_block_size" => o.start_block_size = num(value()?)?,
            "--max_block_size" => o.max_block_size = num(value()?)?,
            "--start_batch_size" => o.start_batch_size = num(value()?)?,
            "--max_batch_size" => o.max_batch_size = num(value()?)?,
            "--num_iter" => o.num_iter = num(value()?)?,
            "--warmup_iter" => o.warmup_iter = num(value()?)?,
            "--large_blk_iter_ftr" => o.large_blk_iter_ftr = num(value()?)?.max(1),
            "--num_threads" => o.num_threads = num(value()?)?.max(1),
            "--check_consistency" => o.check_consistency = true,
            "--plot" => o.plot = Some(value()?),
            "--no_progress" => o.progress = false,
            "--role" => o.role = Some(value()?),
            "--listen" => o.listen = value()?.parse().map_err(|e| format!("--listen: {e}"))?,
            "--target_address" => {
                o.target_address = Some(
                    value()?
                        .parse()
                        .map_err(|e| format!("--target_address: {e}"))?,
                )
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other}")),
        }
        i += 1;
    }
    if o.start_block_size == 0 || o.start_block_size > o.max_block_size {
        return Err("need 0 < start_block_size <= max_block_size".into());
    }
    if o.start_batch_size == 0 || o.start_batch_size > o.max_batch_size {
        return Err("need 0 < start_batch_size <= max_batch_size".into());
    }
    if o.backend == "CUDA_IPC" && !cfg!(feature = "cuda") {
        return Err(
            "--backend CUDA_IPC: nixlbench was built without feature cuda \
                    (cargo build --release -p tools --bin nixlbench --features cuda)"
                .into(),
        );
    }
    if o.total_buffer_size == 0 {
        return Err("need total_buffer_size > 0".into());
    }
    Ok(o)
}

/// A page-aligned host allocation, every page written once (as NIXL's nixlbench memsets
/// its buffers): an untouched page would be the kernel's shared zero page, which a WRITE
/// source would read from cache.
struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory; threads only touch it through raw copies that the
// benchmark orders (each thread owns its own slice of it).
unsafe impl Send for HostBuffer {}
// SAFETY: as above.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(1), 4096).expect("valid layout")
    }

    /// `len` bytes of `fill` (non-zero, so the writes cannot be folded into a calloc).
    fn new(len: usize, fill: u8) -> Self {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(Self::layout(len)) };
        assert!(!ptr.is_null(), "out of memory allocating {len} bytes");
        // SAFETY: `ptr` holds `len` bytes (the layout's size is at least `len`).
        unsafe { std::ptr::write_bytes(ptr, fill, len) };
        Self { ptr, len }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) };
    }
}

/// One side's benchmark memory: host memory, or (feature `cuda`) device memory.
enum Mem {
    Host(HostBuffer),
    #[cfg(feature = "cuda")]
    Device(gpunetio::DeviceBuffer),
}

impl Mem {
    /// `len` bytes of `kind` (VRAM on GPU `gpu`), every byte set to `fill`.
    fn alloc(kind: MemKind, gpu: usize, len: usize, fill: u8) -> Result<Self, String> {
        match kind {
            MemKind::Dram => Ok(Self::Host(HostBuffer::new(len, fill))),
            #[cfg(feature = "cuda")]
            MemKind::Vram => {
                let open = gpunetio::Gpu::open(gpu).map_err(|e| format!("GPU {gpu}: {e}"))?;
                let buf = gpunetio::DeviceBuffer::alloc(&open, len)
                    .map_err(|e| format!("allocating {len} bytes on GPU {gpu}: {e}"))?;
                buf.fill(fill).map_err(|e| format!("GPU {gpu}: {e}"))?;
                Ok(Self::Device(buf))
            }
            other => {
                let _ = (gpu, fill);
                Err(format!(
                    "{other:?} memory: not in this build (VRAM needs feature cuda)"
                ))
            }
        }
    }

    fn kind(&self) -> MemKind {
        match self {
            Self::Host(_) => MemKind::Dram,
            #[cfg(feature = "cuda")]
            Self::Device(_) => MemKind::Vram,
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Self::Host(b) => b.ptr as u64,
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.ptr(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::Host(b) => b.len,
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.len(),
        }
    }

    /// NIXL's `devId`: the GPU ordinal for VRAM, 0 for DRAM.
    fn dev_id(&self) -> u64 {
        match self {
            Self::Host(_) => 0,
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.gpu().ordinal() as u64,
        }
    }

    fn describe(&self) -> String {
        match self.kind() {
            MemKind::Vram => format!("VRAM (GPU {})", self.dev_id()),
            kind => format!("{kind:?}").to_ascii_uppercase(),
        }
    }

    fn desc(&self, offset: usize, len: usize) -> Desc {
        Desc::new(self.addr() + offset as u64, len as u64, self.dev_id())
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(format!(
                "range {offset}+{len} outside the {} byte buffer",
                self.len()
            )),
        }
    }

    fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), String> {
        self.check_range(offset, bytes.len())?;
        match self {
            Self::Host(b) => {
                // SAFETY: in bounds (checked above); `bytes` cannot alias benchmark memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.ptr.add(offset), bytes.len())
                };
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.copy_from_host(offset, bytes).map_err(|e| e.to_string()),
        }
    }

    fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>, String> {
        self.check_range(offset, len)?;
        match self {
            Self::Host(b) => {
                let mut out = vec![0u8; len];
                // SAFETY: in bounds (checked above); the transfers that wrote the range
                // completed before the caller asked (request completion or notification).
                unsafe { std::ptr::copy_nonoverlapping(b.ptr.add(offset), out.as_mut_ptr(), len) };
                Ok(out)
            }
            #[cfg(feature = "cuda")]
            Self::Device(b) => {
                let mut out = vec![0u8; len];
                b.copy_to_host(offset, &mut out)
                    .map_err(|e| e.to_string())?;
                Ok(out)
            }
        }
    }

    fn fill_pattern(&self, offset: usize, len: usize, seed: u64) -> Result<(), String> {
        self.write(offset, &pattern_bytes(seed, offset, len))
    }

    fn clear(&self, offset: usize, len: usize) -> Result<(), String> {
        self.write(offset, &vec![0u8; len])
    }

    /// Compares `[offset, offset + len)` (read back to the host for VRAM) with the pattern.
    fn check_pattern(&self, offset: usize, len: usize, seed: u64) -> Result<(), String> {
        let got = self.read(offset, len)?;
        let want = pattern_bytes(seed, offset, len);
        match got.iter().zip(&want).position(|(g, w)| g != w) {
            None => Ok(()),
            Some(i) => Err(format!(
                "{} byte {} is {:#04x}, expected {:#04x}",
                self.describe(),
                offset + i,
                got[i],
                want[i]
            )),
        }
    }
}

/// Registers `mem` with the agent's backends (all, or only `only`).
fn register(
    agent: &Agent,
    mem: &Mem,
    only: Option<&[&str]>,
) -> Result<nixl::RegistrationHandle, String> {
    let list = DescList::from_descs(mem.kind(), [mem.desc(0, mem.len())]);
    // SAFETY: every caller declares the handle after `mem`, so it is dropped (and the
    // memory deregistered) first; the benchmark tolerates peers writing it at any time.
    unsafe { agent.register_mem(&list, only) }
        .map_err(|e| format!("registering {}: {e}", mem.describe()))
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The bytes at `[offset, offset + len)` of the pattern `seed`: every 8-byte word of the
/// buffer a different hash of its index and the seed, so a block at the wrong place, a
/// stale block of another point and a partial copy all differ.
fn pattern_bytes(seed: u64, offset: usize, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let end = offset + len;
    let mut at = offset;
    while at < end {
        let word = splitmix64(seed ^ ((at as u64) >> 3).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        let start = at & 7;
        let take = (8 - start).min(end - at);
        out.extend_from_slice(&word.to_le_bytes()[start..start + take]);
        at += take;
    }
    out
}

/// NIXL nixlbench's initial buffer bytes (`XFERBENCH_INITIATOR/TARGET_BUFFER_ELEMENT`).
const INITIATOR_FILL: u8 = 0xbb;
const TARGET_FILL: u8 = 0xaa;

/// What the target's memory holds (READ's source).
const TARGET_SEED: u64 = 0x5EED_7A26;

/// WRITE's source pattern for one (block size, batch size) point.
fn point_seed(block: usize, batch: usize) -> u64 {
    splitmix64(((block as u64) << 24) ^ batch as u64 ^ 0xC0FF_EE00_0000_0000)
}

fn with_provider(role: &str, provider: Option<&str>) -> String {
    match provider {
        Some(p) => format!("{role}@{p}"),
        None => role.to_string(),
    }
}

fn provider_of(agent_name: &str) -> Option<&str> {
    agent_name.split_once('@').map(|(_, p)| p)
}

/// Whether `ip` is this host: loopback, unspecified (connecting to it reaches this host),
/// or an address of one of its interfaces (binding to it succeeds only then).
fn is_this_host(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Providers on this host that offer RDM endpoints with messages and RMA, as LIBFABRIC
/// asks for them.
fn local_providers() -> Vec<String> {
    let infos = fabric::InfoBuilder::new()
        .ep_type(fabric::EndpointType::RDM)
        .caps(fabric::Caps::MSG | fabric::Caps::RMA)
        .get()
        .unwrap_or_default();
    let mut names: Vec<String> = infos
        .iter()
        .map(|i| i.provider_name().to_string())
        .collect();
    names.sort();
    names.dedup();
    names
}

fn quiet() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

fn run_target(o: &Options) -> Result<(), String> {
    if o.backend == "LOCAL" {
        return Err("LOCAL moves data inside one agent: run without --role".into());
    }
    let mem = Mem::alloc(o.target_seg, o.target_gpu, o.total_buffer_size, TARGET_FILL)?;
    mem.fill_pattern(0, mem.len(), TARGET_SEED)?;
    // LIBFABRIC without a provider follows the initiator's choice (module docs).
    let follow = o.is_libfabric() && o.user_provider().is_none();
    let name = if o.is_libfabric() {
        with_provider(TARGET, o.user_provider())
    } else {
        TARGET.to_string()
    };
    let agent = Agent::new(
        name,
        AgentConfig {
            listen_addr: Some(o.listen),
            ..AgentConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let mut reg = None;
    if !follow {
        agent
            .create_backend(&o.backend, &o.params(None))
            .map_err(|e| format!("{}: {e}", o.backend))?;
        reg = Some(register(&agent, &mem, None)?);
    }
    println!(
        "NIXLBENCH_TARGET {}",
        agent.listen_addr().expect("listener")
    );
    std::io::stdout().flush().ok();
    if follow {
        let provider = wait_for_provider(&agent)?;
        agent
            .create_backend(&o.backend, &o.params(Some(&provider)))
            .map_err(|e| format!("{} provider {provider}: {e}", o.backend))?;
        reg = Some(register(&agent, &mem, None)?);
        if !quiet() {
            eprintln!("nixlbench target: LIBFABRIC provider {provider} (the initiator's choice)");
        }
    }
    if !quiet() {
        eprintln!(
            "nixlbench target: {} at {}, {}",
            agent.name(),
            agent.listen_addr().expect("listener"),
            mem.describe()
        );
    }
    let served = serve(&agent, &mem);
    drop(reg);
    served
}

/// Waits for an initiator's metadata (`nixlbench-initiator@PROVIDER`) and returns its
/// provider.
fn wait_for_provider(agent: &Agent) -> Result<String, String> {
    let providers = local_providers();
    if providers.is_empty() {
        return Err("no libfabric provider with RDM endpoints on this host".into());
    }
    let start = Instant::now();
    loop {
        if let Some(p) = providers
            .iter()
            .find(|p| agent.has_remote(&with_provider(INITIATOR, Some(p))))
        {
            return Ok(p.clone());
        }
        if start.elapsed() > Duration::from_secs(600) {
            return Err(format!(
                "target: no initiator named {INITIATOR}@PROVIDER (PROVIDER one of {}) \
                 sent its metadata in 10 minutes",
                providers.join(", ")
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Serves until the initiator says DONE: answers CHECK requests by verifying its own
/// memory (`CHECK id seed block batch stride base` → `CHECKED id ok|<what differs>`).
fn serve(agent: &Agent, mem: &Mem) -> Result<(), String> {
    let mut last = Instant::now();
    loop {
        for (sender, msgs) in agent.get_notifs() {
            last = Instant::now();
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg);
                if text == "DONE" {
                    return Ok(());
                }
                if let Some(rest) = text.strip_prefix("CHECK ") {
                    let (id, verdict) = match check_request(mem, rest) {
                        Ok((id, Ok(()))) => (id, "ok".to_string()),
                        Ok((id, Err(e))) => (id, e),
                        Err(e) => ("?".to_string(), e),
                    };
                    agent
                        .gen_notif(&sender, format!("CHECKED {id} {verdict}").as_bytes())
                        .map_err(|e| format!("target: answering {sender}'s check: {e}"))?;
                }
            }
        }
        if last.elapsed() > Duration::from_secs(600) {
            return Err("target: no word from the initiator for 10 minutes".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

type Verdict = Result<(), String>;

fn check_request(mem: &Mem, request: &str) -> Result<(String, Verdict), String> {
    let f: Vec<&str> = request.split_whitespace().collect();
    let bad = || format!("malformed check request `{request}`");
    if f.len() != 6 {
        return Err(bad());
    }
    let n = |s: &str| s.parse::<u64>().map_err(|_| bad());
    let (seed, block, batch, stride, base) = (n(f[1])?, n(f[2])?, n(f[3])?, n(f[4])?, n(f[5])?);
    let verdict = (0..batch).try_for_each(|i| {
        let off = (base + i * stride) as usize;
        mem.check_pattern(off, block as usize, seed)
    });
    Ok((f[0].to_string(), verdict))
}

#[derive(Debug, Clone)]
struct Row {
    block_size: usize,
    batch_size: usize,
    gbps: f64,
    avg_lat_us: f64,
    prep: (f64, f64),
    post: (f64, f64),
    tx: (f64, f64),
}

fn avg_p99(mut samples: Vec<f64>) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort_by(f64::total_cmp);
    let avg = samples.iter().sum::<f64>() / samples.len() as f64;
    let p99 = samples[((samples.len() as f64 * 0.99).ceil() as usize).clamp(1, samples.len()) - 1];
    (avg, p99)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

struct ThreadResult {
    prep: f64,
    post: Vec<f64>,
    tx: Vec<f64>,
}

/// The other side of the transfers.
enum Peer<'a> {
    /// Another process: WRITE data is verified by the target on request.
    Remote {
        name: String,
        /// One thread at a time sends a check and reads the notifications for its answer.
        check_lock: Mutex<()>,
    },
    /// This agent (LOCAL): WRITE data is verified here.
    InProcess { name: String, mem: &'a Mem },
}

impl Peer<'_> {
    fn name(&self) -> &str {
        match self {
            Self::Remote { name, .. } | Self::InProcess { name, .. } => name,
        }
    }
}

/// Where the target's memory is: the region it registered.
#[derive(Debug, Clone, Copy)]
struct RemoteMem {
    kind: MemKind,
    addr: u64,
    dev_id: u64,
}

/// One (block size, batch size) point: every thread moves `batch` blocks per request.
#[allow(clippy::too_many_arguments)]
fn run_point(
    agent: &Agent,
    peer: &Peer<'_>,
    local: &Mem,
    remote: RemoteMem,
    o: &Options,
    block: usize,
    batch: usize,
) -> Result<Row, String> {
    let per_thread = o.total_buffer_size / o.num_threads;
    // Blocks are spaced two apart when there is room, so the descriptors are non-contiguous.
    let stride = if batch * block * 2 <= per_thread {
        2 * block
    } else {
        block
    };
    let iters = if block >= 1 << 20 {
        (o.num_iter / o.large_blk_iter_ftr).max(1)
    } else {
        o.num_iter
    };
    let seed = point_seed(block, batch);
    let results: Vec<Result<ThreadResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..o.num_threads)
            .map(|t| {
                s.spawn(move || -> Result<ThreadResult, String> {
                    let base = t * per_thread;
                    let offsets: Vec<usize> = (0..batch).map(|i| base + i * stride).collect();
                    let prep_start = Instant::now();
                    let l = DescList::from_descs(
                        local.kind(),
                        offsets.iter().map(|&off| local.desc(off, block)),
                    );
                    let r = DescList::from_descs(
                        remote.kind,
                        offsets.iter().map(|&off| {
                            Desc::new(remote.addr + off as u64, block as u64, remote.dev_id)
                        }),
                    );
                    let lh = agent.prep_xfer_dlist(None, &l).map_err(|e| e.to_string())?;
                    let rh = agent
                        .prep_xfer_dlist(Some(peer.name()), &r)
                        .map_err(|e| e.to_string())?;
                    let idx: Vec<usize> = (0..batch).collect();
                    let mut req = agent
                        .make_xfer_req(o.op, &lh, &idx, &rh, &idx, None, None)
                        .map_err(|e| e.to_string())?;
                    let prep = us(prep_start.elapsed());
                    if o.check_consistency {
                        for &off in &offsets {
                            match o.op {
                                XferOp::Write => local.fill_pattern(off, block, seed)?,
                                // The destination starts cleared: a READ that moved nothing fails.
                                XferOp::Read => local.clear(off, block)?,
                            }
                        }
                    }
                    let timeout = Duration::from_secs(60);
                    for _ in 0..o.warmup_iter.min(iters) {
                        req.post().map_err(|e| e.to_string())?;
                        req.wait(timeout).map_err(|e| e.to_string())?;
                    }
                    let mut post = Vec::with_capacity(iters);
                    let mut tx = Vec::with_capacity(iters);
                    for _ in 0..iters {
                        let start = Instant::now();
                        req.post().map_err(|e| e.to_string())?;
                        post.push(us(start.elapsed()));
                        req.wait(timeout).map_err(|e| e.to_string())?;
                        tx.push(us(start.elapsed()));
                    }
                    if o.check_consistency {
                        let check = Check {
                            id: format!("{block}-{batch}-{t}"),
                            seed,
                            block,
                            batch,
                            stride,
                            base,
                        };
                        verify(agent, peer, &mut req, local, o, &check).map_err(|e| {
                            format!(
                                "consistency check failed: block size {block}, batch {batch}: {e}"
                            )
                        })?;
                    }
                    Ok(ThreadResult { prep, post, tx })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .collect()
    });
    let mut prep = Vec::new();
    let mut post = Vec::new();
    let mut tx = Vec::new();
    let mut wall = 0f64;
    for r in results {
        let r = r?;
        wall = wall.max(r.tx.iter().sum::<f64>());
        prep.push(r.prep);
        post.extend(r.post);
        tx.extend(r.tx);
    }
    let bytes = (block * batch * iters * o.num_threads) as f64;
    Ok(Row {
        block_size: block,
        batch_size: batch,
        gbps: bytes / (wall / 1e6) / 1e9,
        avg_lat_us: wall / iters as f64,
        prep: avg_p99(prep),
        post: avg_p99(post),
        tx: avg_p99(tx),
    })
}

/// One thread's blocks of one point: `batch` blocks at `base + i * stride`.
struct Check {
    id: String,
    seed: u64,
    block: usize,
    batch: usize,
    stride: usize,
    base: usize,
}

impl Check {
    fn offsets(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.batch).map(|i| self.base + i * self.stride)
    }
}

/// Verifies the destination of the point's transfers on the side that owns it.
/// READ: the initiator's blocks must hold the target's pattern. WRITE: the target's
/// blocks must hold the point's pattern — checked by the target itself (its own memory,
/// VRAM copied back to the host), asked through one more transfer whose notification
/// arrives only after the data; in one process, checked here.
fn verify(
    agent: &Agent,
    peer: &Peer<'_>,
    req: &mut nixl::XferReq,
    local: &Mem,
    o: &Options,
    c: &Check,
) -> Result<(), String> {
    match (o.op, peer) {
        (XferOp::Read, _) => c
            .offsets()
            .try_for_each(|off| local.check_pattern(off, c.block, TARGET_SEED)),
        (XferOp::Write, Peer::InProcess { mem, .. }) => c
            .offsets()
            .try_for_each(|off| mem.check_pattern(off, c.block, c.seed)),
        (XferOp::Write, Peer::Remote { name, check_lock }) => {
            let _one_at_a_time = check_lock.lock().expect("check lock");
            let msg = format!(
                "CHECK {} {} {} {} {} {}",
                c.id, c.seed, c.block, c.batch, c.stride, c.base
            );
            req.post_with(Some(msg.into_bytes()), &PostParams::default())
                .map_err(|e| format!("posting the checked transfer: {e}"))?;
            req.wait(Duration::from_secs(60))
                .map_err(|e| format!("the checked transfer: {e}"))?;
            let answer = wait_answer(agent, name, &c.id)?;
            if answer == "ok" {
                Ok(())
            } else {
                Err(format!("the target reports: {answer}"))
            }
        }
    }
}

/// The target's `CHECKED id …` answer.
fn wait_answer(agent: &Agent, target: &str, id: &str) -> Result<String, String> {
    let prefix = format!("CHECKED {id} ");
    let start = Instant::now();
    loop {
        let mut notifs: HashMap<String, Vec<Vec<u8>>> = agent.get_notifs();
        if let Some(msgs) = notifs.remove(target) {
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg);
                if let Some(answer) = text.strip_prefix(&prefix) {
                    return Ok(answer.to_string());
                }
            }
        }
        if start.elapsed() > Duration::from_secs(60) {
            return Err("the target did not answer the check within 60 s".into());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn sizes(start: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = start;
    while s <= max {
        v.push(s);
        match s.checked_mul(2) {
            Some(n) => s = n,
            None => break,
        }
    }
    v
}

/// The initiator's agent, with its backend (and, for LIBFABRIC, the provider chosen as
/// the module docs say and why).
fn initiator_agent(o: &Options, target_addr: SocketAddr) -> Result<(Agent, String), String> {
    let new_agent = |name: String| {
        Agent::new(
            name,
            AgentConfig {
                listen_addr: None,
                ..AgentConfig::default()
            },
        )
        .map_err(|e| e.to_string())
    };
    if !o.is_libfabric() {
        let agent = new_agent(INITIATOR.into())?;
        agent
            .create_backend(&o.backend, &o.params(None))
            .map_err(|e| format!("{}: {e}", o.backend))?;
        return Ok((agent, String::new()));
    }
    // Which provider the target uses, if it was given one: its name says.
    let probe = new_agent("nixlbench-probe".into())?;
    let target_name = probe
        .fetch_remote_metadata(target_addr)
        .map_err(|e| format!("reaching the target at {target_addr}: {e}"))?;
    drop(probe);
    let target_provider = provider_of(&target_name);
    let mut candidates: Vec<(String, String)> = match (target_provider, o.user_provider()) {
        (Some(t), Some(u)) if t != u => {
            return Err(format!(
                "the target uses provider {t}, but --backend_param provider={u}"
            ))
        }
        (Some(t), _) => vec![(t.into(), "the target's".into())],
        (None, Some(u)) => vec![(u.into(), "--backend_param".into())],
        (None, None) => {
            let mut c = Vec::new();
            if is_this_host(target_addr.ip()) {
                c.push((
                    "shm".to_string(),
                    "default: the target is on this host".into(),
                ));
            }
            c.extend(
                nixl::backends::libfabric::PROVIDER_PRIORITY
                    .iter()
                    .map(|p| {
                        (
                            p.to_string(),
                            "default: first available of NIXL's priority list".into(),
                        )
                    }),
            );
            c
        }
    };
    let mut tried = Vec::new();
    for (provider, why) in candidates.drain(..) {
        let agent = new_agent(with_provider(INITIATOR, Some(&provider)))?;
        match agent.create_backend(&o.backend, &o.params(Some(&provider))) {
            Ok(_) => {
                let mut how = format!("provider {provider} ({why})");
                if !tried.is_empty() {
                    how += &format!("; unavailable: {}", tried.join("; "));
                }
                return Ok((agent, how));
            }
            Err(e) => tried.push(format!("{provider}: {e}")),
        }
    }
    Err(format!(
        "LIBFABRIC: no provider opens: {}",
        tried.join("; ")
    ))
}

/// Fetches the target's metadata until it shows registered memory; returns its name.
fn wait_for_target(agent: &Agent, addr: SocketAddr, o: &Options) -> Result<String, String> {
    let start = Instant::now();
    loop {
        let name = agent
            .fetch_remote_metadata(addr)
            .map_err(|e| format!("fetching the target's metadata from {addr}: {e}"))?;
        if !agent
            .remote_regions(&name)
            .map_err(|e| e.to_string())?
            .is_empty()
        {
            return Ok(name);
        }
        if start.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "the target `{name}` at {addr} shows no memory that {} reaches here \
                 (its --target_seg_type may not be supported by this backend)",
                o.backend
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run_initiator(o: &Options, target_addr: SocketAddr) -> Result<Vec<Row>, String> {
    if o.backend == "LOCAL" {
        return Err("LOCAL moves data inside one agent: run without --role".into());
    }
    let (agent, how) = initiator_agent(o, target_addr)?;
    let local = Mem::alloc(
        o.initiator_seg,
        o.initiator_gpu,
        o.total_buffer_size,
        INITIATOR_FILL,
    )?;
    let _reg = register(&agent, &local, None)?;
    // The target learns our name (so our provider) and connection, then registers.
    agent
        .send_local_metadata(target_addr)
        .map_err(|e| format!("sending our metadata to {target_addr}: {e}"))?;
    let target = wait_for_target(&agent, target_addr, o)?;
    // Again: a target that created its backend on our first message has not loaded our
    // connection yet (it needs it to answer consistency checks).
    agent
        .send_local_metadata(target_addr)
        .map_err(|e| format!("sending our metadata to {target_addr}: {e}"))?;
    let remote = remote_mem(&agent, &target)?;
    let peer = Peer::Remote {
        name: target.clone(),
        check_lock: Mutex::new(()),
    };
    let header = format!(
        "nixlbench: backend {}{}, {:?}, {} -> {}, {} thread(s), device_list {}, target `{target}` at {target_addr}",
        o.backend,
        if how.is_empty() { String::new() } else { format!(" {how}") },
        o.op,
        local.describe(),
        describe_remote(remote),
        o.num_threads,
        o.device_list.join(","),
    );
    let rows = sweep(&agent, &peer, &local, remote, o, &header)?;
    agent
        .gen_notif(&target, b"DONE")
        .map_err(|e| e.to_string())?;
    Ok(rows)
}

/// `--backend LOCAL`: one agent holds both sides' memory.
fn run_in_process(o: &Options) -> Result<Vec<Row>, String> {
    let target_mem = Mem::alloc(o.target_seg, o.target_gpu, o.total_buffer_size, TARGET_FILL)?;
    target_mem.fill_pattern(0, target_mem.len(), TARGET_SEED)?;
    let local = Mem::alloc(
        o.initiator_seg,
        o.initiator_gpu,
        o.total_buffer_size,
        INITIATOR_FILL,
    )?;
    let agent = Agent::new(
        "nixlbench",
        AgentConfig {
            listen_addr: None,
            ..AgentConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    agent
        .create_backend(&o.backend, &o.params(None))
        .map_err(|e| format!("{}: {e}", o.backend))?;
    let _target_reg = register(&agent, &target_mem, None)?;
    let _local_reg = register(&agent, &local, None)?;
    let remote = RemoteMem {
        kind: target_mem.kind(),
        addr: target_mem.addr(),
        dev_id: target_mem.dev_id(),
    };
    let peer = Peer::InProcess {
        name: agent.name().to_string(),
        mem: &target_mem,
    };
    let header = format!(
        "nixlbench: backend {} (one process), {:?}, {} -> {}, {} thread(s)",
        o.backend,
        o.op,
        local.describe(),
        target_mem.describe(),
        o.num_threads
    );
    sweep(&agent, &peer, &local, remote, o, &header)
}

fn describe_remote(r: RemoteMem) -> String {
    match r.kind {
        MemKind::Vram => format!("VRAM (GPU {})", r.dev_id),
        kind => format!("{kind:?}").to_ascii_uppercase(),
    }
}

/// Runs every (block, batch) point and prints nixlbench's table.
fn sweep(
    agent: &Agent,
    peer: &Peer<'_>,
    local: &Mem,
    remote: RemoteMem,
    o: &Options,
    header: &str,
) -> Result<Vec<Row>, String> {
    let points: Vec<(usize, usize)> = sizes(o.start_block_size, o.max_block_size)
        .into_iter()
        .flat_map(|b| {
            sizes(o.start_batch_size, o.max_batch_size)
                .into_iter()
                .map(move |n| (b, n))
        })
        .filter(|(b, n)| b * n <= o.total_buffer_size / o.num_threads)
        .collect();
    if points.is_empty() {
        return Err("no block/batch size fits in --total_buffer_size / --num_threads".into());
    }
    let bar = if o.progress {
        indicatif::ProgressBar::new(points.len() as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    println!("{header}");
    println!("{}", "-".repeat(150));
    println!(
        "{:<18} {:<12} {:<14} {:<16} {:<14} {:<14} {:<14} {:<14} {:<14} {:<14}",
        "Block Size (B)",
        "Batch Size",
        "B/W (GB/Sec)",
        "Avg Lat. (us)",
        "Avg Prep (us)",
        "P99 Prep (us)",
        "Avg Post (us)",
        "P99 Post (us)",
        "Avg Tx (us)",
        "P99 Tx (us)"
    );
    println!("{}", "-".repeat(150));
    let mut rows = Vec::new();
    for (block, batch) in points {
        let row = run_point(agent, peer, local, remote, o, block, batch)?;
        bar.suspend(|| {
            println!(
                "{:<18} {:<12} {:<14.6} {:<16.3} {:<14.3} {:<14.3} {:<14.3} {:<14.3} {:<14.3} {:<14.3}",
                row.block_size, row.batch_size, row.gbps, row.avg_lat_us, row.prep.0, row.prep.1,
                row.post.0, row.post.1, row.tx.0, row.tx.1
            )
        });
        bar.inc(1);
        rows.push(row);
    }
    bar.finish_and_clear();
    if o.check_consistency {
        println!(
            "consistency check: every block verified ({})",
            match (o.op, peer) {
                (XferOp::Write, Peer::Remote { .. }) => "WRITE: by the target, in its own memory",
                (XferOp::Write, Peer::InProcess { .. }) => "WRITE: in the target buffer",
                (XferOp::Read, _) => "READ: in the initiator's memory",
            }
        );
    }
    Ok(rows)
}

fn remote_mem(agent: &Agent, target: &str) -> Result<RemoteMem, String> {
    // The first region the target advertised: it registers exactly one buffer.
    let md = agent.remote_regions(target).map_err(|e| e.to_string())?;
    md.first()
        .map(|r| RemoteMem {
            kind: r.kind,
            addr: r.desc.addr,
            dev_id: r.desc.dev_id,
        })
        .ok_or_else(|| format!("target `{target}` registered no memory"))
}

fn plot(path: &str, rows: &[Row], o: &Options) -> Result<(), String> {
    use plotters::prelude::*;
    let font = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"]
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .ok_or("--plot needs a TrueType font: install fonts-dejavu-core")?;
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    )
    .map_err(|_| "the font could not be loaded")?;
    let root = BitMapBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (left, right) = root.split_horizontally(600);
    let batch = rows.first().map_or(1, |r| r.batch_size);
    let rows: Vec<&Row> = rows.iter().filter(|r| r.batch_size == batch).collect();
    let xs: Vec<f64> = rows.iter().map(|r| (r.block_size as f64).log2()).collect();
    let (x0, x1) = (
        xs.first().copied().unwrap_or(0.0),
        xs.last().copied().unwrap_or(1.0) + 0.01,
    );
    for (area, title, ys) in [
        (
            &left,
            "Bandwidth (GB/s)",
            rows.iter().map(|r| r.gbps).collect::<Vec<_>>(),
        ),
        (
            &right,
            "Avg latency (us)",
            rows.iter().map(|r| r.avg_lat_us).collect::<Vec<_>>(),
        ),
    ] {
        let ymax = ys.iter().copied().fold(0.0, f64::max) * 1.1 + 1e-9;
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("nixlbench {} {:?} batch {batch}: {title}", o.backend, o.op),
                ("sans-serif", 16),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, 0.0..ymax)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("block size (log2 bytes)")
            .y_desc(title)
            .x_label_formatter(&|x| format!("{}", 1u64 << (*x as u32)))
            .draw()
            .map_err(|e| e.to_string())?;
        let points: Vec<(f64, f64)> = xs.iter().copied().zip(ys.iter().copied()).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), &BLUE))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 3, BLUE.filled())))
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())?;
    println!("plot written to {path}");
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = match parse_args(&args) {
        Ok(o) => o,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("nixlbench: {msg}");
            }
            eprintln!("{USAGE}");
            std::process::exit(if msg.is_empty() { 0 } else { 2 });
        }
    };
    let result = match (o.role.as_deref(), o.target_address) {
        (Some("target"), _) => run_target(&o).map(|_| None),
        (Some("initiator"), Some(addr)) => run_initiator(&o, addr).map(Some),
        (Some("initiator"), None) => Err("--role initiator needs --target_address".into()),
        (Some(other), _) => Err(format!("--role {other}: target or initiator")),
        (None, _) if o.backend == "LOCAL" => run_in_process(&o).map(Some),
        (None, _) => run_both(&o, &args).map(Some),
    };
    match result {
        Ok(Some(rows)) => {
            if let Some(path) = &o.plot {
                if let Err(e) = plot(path, &rows, &o) {
                    eprintln!("nixlbench: plot: {e}");
                    std::process::exit(1);
                }
            }
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("nixlbench: {e}");
            std::process::exit(1);
        }
    }
}

/// Starts the target as a child process on loopback (with every option given, so its
/// `--target_seg_type`, `--target_gpu` and backend parameters) and runs the initiator
/// against it.
fn run_both(o: &Options, args: &[String]) -> Result<Vec<Row>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(args)
        .args([
            "--role",
            "target",
            "--listen",
            "127.0.0.1:0",
            "--no_progress",
        ])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the target: {e}"))?;
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let addr = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(a) = line.strip_prefix("NIXLBENCH_TARGET ") {
                    break a.parse::<SocketAddr>().map_err(|e| e.to_string())?;
                }
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("the target exited before announcing its address".into());
            }
        }
    };
    let rows = run_initiator(o, addr);
    if rows.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let rows = rows?;
    if !status.success() {
        return Err(format!("target exited with {status}"));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn pattern_differs_by_seed_offset_and_point() {
        let a = pattern_bytes(point_seed(4096, 1), 0, 4096);
        assert_eq!(a, pattern_bytes(point_seed(4096, 1), 0, 4096));
        assert_ne!(a, pattern_bytes(point_seed(8192, 1), 0, 4096));
        assert_ne!(a, pattern_bytes(point_seed(4096, 2), 0, 4096));
        assert_ne!(a, pattern_bytes(point_seed(4096, 1), 8192, 4096));
        // Any sub-range, at any alignment, is the same bytes as the whole.
        assert_eq!(
            &a[13..1000],
            &pattern_bytes(point_seed(4096, 1), 13, 987)[..]
        );
        assert_ne!(a, pattern_bytes(TARGET_SEED, 0, 4096));
    }

    #[test]
    fn check_finds_the_first_wrong_byte() {
        let mem = Mem::alloc(MemKind::Dram, 0, 1 << 16, INITIATOR_FILL).unwrap();
        let seed = point_seed(4096, 2);
        mem.fill_pattern(8192, 4096, seed).unwrap();
        mem.check_pattern(8192, 4096, seed).unwrap();
        // A stale block (another point's pattern) and a cleared block both fail.
        assert!(mem.check_pattern(8192, 4096, point_seed(4096, 1)).is_err());
        assert!(mem.check_pattern(0, 4096, seed).is_err());
        let byte = mem.read(8192 + 1234, 1).unwrap()[0];
        mem.write(8192 + 1234, &[!byte]).unwrap();
        let e = mem.check_pattern(8192, 4096, seed).unwrap_err();
        assert!(e.contains("byte 9426"), "{e}");
        assert!(mem.write(1 << 16, &[0]).is_err());
    }

    #[test]
    fn target_answers_check_requests() {
        let mem = Mem::alloc(MemKind::Dram, 0, 1 << 16, INITIATOR_FILL).unwrap();
        let seed = point_seed(1024, 3);
        for i in 0..3 {
            mem.fill_pattern(4096 + i * 2048, 1024, seed).unwrap();
        }
        let req = format!("1024-3-1 {seed} 1024 3 2048 4096");
        let (id, verdict) = check_request(&mem, &req).unwrap();
        assert_eq!(id, "1024-3-1");
        verdict.unwrap();
        mem.clear(4096 + 2 * 2048 + 1000, 1).unwrap();
        let (_, verdict) = check_request(&mem, &req).unwrap();
        assert!(verdict.unwrap_err().contains("byte 9192"));
        assert!(check_request(&mem, "x 1 2").is_err());
    }

    #[test]
    fn options() {
        let o = parse_args(&args("--backend local --initiator_gpu 1 --target_gpu=2")).unwrap();
        assert_eq!(o.backend, "LOCAL");
        assert_eq!((o.initiator_gpu, o.target_gpu), (1, 2));
        let ipc = parse_args(&args("--backend cuda_ipc"));
        if cfg!(feature = "cuda") {
            assert_eq!(ipc.unwrap().backend, "CUDA_IPC");
        } else {
            assert!(ipc.unwrap_err().contains("built without feature cuda"));
        }
        assert_eq!(
            (o.initiator_seg, o.target_seg),
            (MemKind::Dram, MemKind::Dram)
        );
        let e = parse_args(&args("--target_seg_type FILE")).unwrap_err();
        assert!(e.contains("DRAM or VRAM"), "{e}");
        let vram = parse_args(&args("--initiator_seg_type VRAM"));
        if cfg!(feature = "cuda") {
            assert_eq!(vram.unwrap().initiator_seg, MemKind::Vram);
        } else {
            assert!(vram.unwrap_err().contains("built without feature cuda"));
        }
        let o = parse_args(&args("--backend VERBS --device_list mlx5_1,mlx5_0")).unwrap();
        assert_eq!(o.params(None)["device"], "mlx5_1");
        let o = parse_args(&args(
            "--backend VERBS --backend_param device=rxe0 --device_list mlx5_1",
        ))
        .unwrap();
        assert_eq!(o.params(None)["device"], "rxe0");
        let o = parse_args(&args("--device_list mlx5_1")).unwrap();
        assert_eq!(o.params(Some("shm"))["provider"], "shm");
        assert!(!o.params(None).contains_key("device"));
    }

    #[test]
    fn provider_names_and_hosts() {
        assert_eq!(
            with_provider(TARGET, Some("tcp;ofi_rxm")),
            "nixlbench-target@tcp;ofi_rxm"
        );
        assert_eq!(
            provider_of("nixlbench-target@tcp;ofi_rxm"),
            Some("tcp;ofi_rxm")
        );
        assert_eq!(provider_of(TARGET), None);
        assert!(is_this_host("127.0.0.1".parse().unwrap()));
        assert!(is_this_host("0.0.0.0".parse().unwrap()));
        // TEST-NET-3: never an address of this host.
        assert!(!is_this_host("203.0.113.7".parse().unwrap()));
    }
}
