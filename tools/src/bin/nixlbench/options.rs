//! The command line: nixlbench's option names, defaults and checks.

use nixl::{BackendParams, MemKind, XferOp};
use std::net::SocketAddr;
use std::path::PathBuf;

pub(crate) const USAGE: &str = "usage: nixlbench [options]
  --backend NAME              LIBFABRIC (default), VERBS, CUDA_IPC or GPUNETIO (feature
                              cuda: GPU memory between processes of one node), LOCAL
                              (one agent: both sides run in this process), or FILE
                              (feature file: storage, one process, see below)
  --backend_param KEY=VALUE   backend parameter (repeatable, overrides what the flags
                              below set), e.g. provider=tcp;ofi_rxm, num_rails=2,
                              cuda_streams=8. LIBFABRIC's provider defaults to shm when
                              the target is on this host (the self-launched one always
                              is), else to the first of cxi, efa, tcp;ofi_rxm, sockets
  --device_list LIST          network devices, comma-separated (default all); each side
                              takes the first entry (NIXL: the entry of its rank in its
                              role). VERBS: its `device`; GPUNETIO: its `network_devices`;
                              LIBFABRIC: printed only, as NIXL
  --op_type READ|WRITE        (default WRITE)
  --initiator_seg_type DRAM|VRAM   --target_seg_type DRAM|VRAM|FILE   (default DRAM;
                              the target's is VRAM with GPUNETIO and FILE with FILE; VRAM
                              needs feature cuda: cargo build --release -p tools
                              --features cuda)
  --initiator_gpu N           GPU ordinal of initiator VRAM (default 0)  [ours: NIXL uses
  --target_gpu N              GPU ordinal of target VRAM (default 0)      the process rank]
  --gpunetio_device_list LIST GPUNETIO: CUDA device ids, comma-separated (upstream's
                              default 0); the initiator takes the first, the target the
                              second (the first if there is one): each side's GPU, its
                              VRAM and the backend's `gpu_devices`
  --gpunetio_oob_list LIST    GPUNETIO: out-of-band interfaces, comma-separated, taken
                              the same way: the backend's `oob_interface`
  --total_buffer_size BYTES   per side (default 64 MiB)
  --start_block_size BYTES    (default 4096)      --max_block_size BYTES  (default 1048576)
  --start_batch_size N        (default 1)         --max_batch_size N      (default 1)
  --num_iter N                (default 1000)      --warmup_iter N         (default 100)
  --large_blk_iter_ftr N      iterations divided by N for blocks >= 1 MiB (default 16)
  --num_threads N             initiator threads, each with its own request (default 1)
  --scheme pairwise  --mode SG  --worker_type nixl  --num_initiator_dev 1
  --num_target_dev 1          upstream's options, at the only values this nixlbench runs
                              (one initiator, one target, one GPU each); others are refused
  --check_consistency         verify the data of every block and batch size: WRITE on the
                              target's own memory, READ on the initiator's (VRAM copied
                              back to the host)
  --plot FILE.png             draw bandwidth and latency against block size
 storage (--backend FILE --target_seg_type FILE, feature file):
  --filepath DIR              where the files are created (default: the current
                              directory); each is created or truncated, filled, and
                              removed at the end
  --num_files N               files (default 1): descriptor i of thread t goes to file
                              (t * batch + i) mod N, blocks packed from its start
  --hf3fs_mount DIR           the directory an hf3fs-gdr daemon serves (default: the
                              --filepath directory; env NIXLBENCH_HF3FS_MOUNT). If none
                              serves it, nixlbench starts one for the run
                              ($HF3FS_GDR_DAEMON, hf3fs-gdr-daemon beside nixlbench or on
                              the PATH, else its own built-in daemon) and stops it after
  --no_progress               no progress bar
 runtime (how the two sides find each other):
  --runtime_type SOCKET|ETCD  default SOCKET, or ETCD when --etcd_endpoints is given
                              (upstream's default is ETCD; ours runs without an etcd)
  SOCKET: --role target|initiator   one side only (default: both, the target as a child
                              process on loopback)
          --listen ADDR       target: metadata listener address (default 127.0.0.1:0)
          --target_address ADDR   initiator: the target's listener
  ETCD (feature etcd): start nixlbench twice, on one host or two, with the same endpoints
          --etcd_endpoints URL[,URL]   (also --etcd-endpoints; default
                              http://localhost:2379): the first process to claim a rank
                              is the initiator (rank 0), the second the target (rank 1),
                              a third is refused
          --benchmark_group NAME   runs in different groups do not meet (default default)
          --etcd_wait SECS    how long to wait for the peer (default 60, as upstream)
          LIBFABRIC picks shm when both ranks show the same boot id; the environment
          variable NIXLBENCH_HOST_ID replaces it (containers that share a kernel but not
          /dev/shm: give each its own)";

/// Which side of the run a process (or a backend) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Initiator,
    Target,
}

/// How the initiator and the target find each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Runtime {
    /// Ours: the target's metadata listener, reached by address (or the self-launched
    /// target on loopback).
    Socket,
    /// Upstream's: ranks and metadata through etcd.
    Etcd {
        endpoints: Vec<String>,
        group: String,
        wait: std::time::Duration,
    },
}

/// Upstream nixlbench's default etcd endpoint.
pub(crate) const DEFAULT_ETCD_ENDPOINT: &str = "http://localhost:2379";

#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) backend: String,
    pub(crate) backend_params: BackendParams,
    pub(crate) device_list: Vec<String>,
    pub(crate) op: XferOp,
    pub(crate) initiator_seg: MemKind,
    pub(crate) target_seg: MemKind,
    pub(crate) initiator_gpu: usize,
    pub(crate) target_gpu: usize,
    /// `--gpunetio_oob_list`, one entry per side at most.
    pub(crate) oob_list: Vec<String>,
    pub(crate) total_buffer_size: usize,
    pub(crate) start_block_size: usize,
    pub(crate) max_block_size: usize,
    pub(crate) start_batch_size: usize,
    pub(crate) max_batch_size: usize,
    pub(crate) num_iter: usize,
    pub(crate) warmup_iter: usize,
    pub(crate) large_blk_iter_ftr: usize,
    pub(crate) num_threads: usize,
    pub(crate) check_consistency: bool,
    pub(crate) plot: Option<String>,
    pub(crate) progress: bool,
    pub(crate) runtime: Runtime,
    pub(crate) role: Option<String>,
    pub(crate) listen: SocketAddr,
    pub(crate) target_address: Option<SocketAddr>,
    /// Storage runs: where the files go.
    pub(crate) filepath: Option<PathBuf>,
    pub(crate) num_files: usize,
    pub(crate) hf3fs_mount: Option<PathBuf>,
}

impl Options {
    pub(crate) fn is_libfabric(&self) -> bool {
        self.backend == "LIBFABRIC"
    }

    /// A storage run (`--backend FILE`): one process, files as the target.
    pub(crate) fn is_storage(&self) -> bool {
        self.backend == "FILE"
    }

    /// The provider the user named, if any.
    pub(crate) fn user_provider(&self) -> Option<&str> {
        self.backend_params.get("provider").map(String::as_str)
    }

    /// The GPU of `side`: its VRAM and, for GPUNETIO, the GPU its backend drives.
    pub(crate) fn gpu(&self, side: Side) -> usize {
        match side {
            Side::Initiator => self.initiator_gpu,
            Side::Target => self.target_gpu,
        }
    }

    /// `side`'s backend parameters: `--backend_param`s over what nixlbench's own flags
    /// set (as upstream's nixlbench builds them), with `provider` set (LIBFABRIC).
    pub(crate) fn params(&self, side: Side, provider: Option<&str>) -> BackendParams {
        let mut params = BackendParams::new();
        match self.backend.as_str() {
            "VERBS" => {
                if let Some(dev) = self.device() {
                    params.insert("device".into(), dev.into());
                }
            }
            "GPUNETIO" => {
                params.insert("gpu_devices".into(), self.gpu(side).to_string());
                if let Some(dev) = self.device() {
                    params.insert("network_devices".into(), dev.into());
                }
                if let Some(oob) = side_entry(&self.oob_list, side) {
                    params.insert("oob_interface".into(), oob.clone());
                }
            }
            _ => {}
        }
        params.extend(
            self.backend_params
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        if let Some(p) = provider {
            params.insert("provider".into(), p.into());
        }
        params
    }

    /// This side's entry of `--device_list` (`None` for `all`).
    pub(crate) fn device(&self) -> Option<&str> {
        self.device_list
            .first()
            .map(String::as_str)
            .filter(|d| *d != "all")
    }
}

/// `side`'s entry of a per-side list: the initiator the first, the target the second,
/// or the first when there is only one.
fn side_entry<T>(list: &[T], side: Side) -> Option<&T> {
    match side {
        Side::Initiator => list.first(),
        Side::Target => list.get(1).or_else(|| list.first()),
    }
}

fn comma_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(String::from)
        .collect()
}

const NEEDS_CUDA: &str = "nixlbench was built without feature cuda \
     (cargo build --release -p tools --bin nixlbench --features cuda)";
const NEEDS_FILE: &str = "nixlbench was built without feature file \
     (cargo build --release -p tools --bin nixlbench --features file)";

/// A segment type; FILE is accepted here and checked against the backend later.
pub(crate) fn parse_seg_type(key: &str, v: &str) -> Result<MemKind, String> {
    match MemKind::parse(v) {
        Some(MemKind::Dram) => Ok(MemKind::Dram),
        Some(MemKind::Vram) if cfg!(feature = "cuda") => Ok(MemKind::Vram),
        Some(MemKind::Vram) => Err(format!("{key} VRAM: {NEEDS_CUDA}")),
        Some(MemKind::File) if key == "--target_seg_type" => Ok(MemKind::File),
        _ => Err(format!("{key} {v}: DRAM or VRAM")),
    }
}

/// Upstream options this nixlbench accepts at one value only: `(flag, the value)`.
const FIXED: &[(&str, &str)] = &[
    ("--scheme", "pairwise"),
    ("--mode", "SG"),
    ("--worker_type", "nixl"),
    ("--num_initiator_dev", "1"),
    ("--num_target_dev", "1"),
];

/// Why a fixed option's other values are refused.
fn fixed_refusal(flag: &str, v: &str) -> String {
    let why = match flag {
        "--scheme" => {
            "one initiator and one target (manytoone, onetomany and tp are not implemented)"
        }
        "--mode" => "one GPU per process (MG is not implemented)",
        "--worker_type" => "the nixl worker (nvshmem is not implemented)",
        _ => "one device per process: GPUNETIO drives one GPU and one NIC per backend",
    };
    format!("{flag} {v}: this nixlbench runs {why}")
}

pub(crate) fn parse_args(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        backend: "LIBFABRIC".into(),
        backend_params: BackendParams::new(),
        device_list: vec!["all".into()],
        op: XferOp::Write,
        initiator_seg: MemKind::Dram,
        target_seg: MemKind::Dram,
        initiator_gpu: 0,
        target_gpu: 0,
        oob_list: Vec::new(),
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
        runtime: Runtime::Socket,
        role: None,
        listen: "127.0.0.1:0".parse().expect("literal"),
        target_address: None,
        filepath: None,
        num_files: 1,
        hf3fs_mount: None,
    };
    let mut storage_flags: Vec<&'static str> = Vec::new();
    let (mut initiator_gpu, mut target_gpu) = (None, None);
    let mut gpunetio_devices: Option<Vec<usize>> = None;
    let mut target_seg: Option<MemKind> = None;
    let mut runtime_type: Option<String> = None;
    let mut etcd_endpoints: Option<Vec<String>> = None;
    let mut group: Option<String> = None;
    let mut etcd_wait: Option<u64> = None;
    let mut socket_flags: Vec<&'static str> = Vec::new();
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
                o.device_list = comma_list(&value()?);
                if o.device_list.is_empty() {
                    return Err("--device_list: at least one device, or all".into());
                }
            }
            "--gpunetio_device_list" => {
                let v = value()?;
                let ids = comma_list(&v)
                    .iter()
                    .map(|d| {
                        d.parse::<usize>().map_err(|_| {
                            format!(
                                "--gpunetio_device_list {v}: `{d}` is not a CUDA device id \
                                 (upstream: GPU ids, e.g. 0,1); name the network device \
                                 with --device_list"
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if ids.is_empty() || ids.len() > 2 {
                    return Err(format!(
                        "--gpunetio_device_list {v}: one CUDA device id for both sides, \
                         or two (the initiator's, then the target's)"
                    ));
                }
                gpunetio_devices = Some(ids);
            }
            "--gpunetio_oob_list" => {
                let v = value()?;
                o.oob_list = comma_list(&v);
                if o.oob_list.len() > 2 {
                    return Err(format!(
                        "--gpunetio_oob_list {v}: one interface for both sides, or two \
                         (the initiator's, then the target's)"
                    ));
                }
            }
            "--op_type" => {
                let v = value()?;
                o.op = XferOp::parse(&v).ok_or(format!("--op_type: READ or WRITE, not {v}"))?;
            }
            "--initiator_seg_type" => o.initiator_seg = parse_seg_type(&key, &value()?)?,
            "--target_seg_type" => target_seg = Some(parse_seg_type(&key, &value()?)?),
            "--initiator_gpu" => initiator_gpu = Some(num(value()?)?),
            "--target_gpu" => target_gpu = Some(num(value()?)?),
            "--total_buffer_size" => o.total_buffer_size = num(value()?)?,
            "--start_block_size" => o.start_block_size = num(value()?)?,
            "--max_block_size" => o.max_block_size = num(value()?)?,
            "--start_batch_size" => o.start_batch_size = num(value()?)?,
            "--max_batch_size" => o.max_batch_size = num(value()?)?,
            "--num_iter" => o.num_iter = num(value()?)?,
            "--warmup_iter" => o.warmup_iter = num(value()?)?,
            "--large_blk_iter_ftr" => o.large_blk_iter_ftr = num(value()?)?.max(1),
            "--num_threads" => o.num_threads = num(value()?)?.max(1),
            flag if FIXED.iter().any(|(f, _)| *f == flag) => {
                let (flag, only) = *FIXED.iter().find(|(f, _)| *f == flag).expect("matched");
                let v = value()?;
                if !v.eq_ignore_ascii_case(only) {
                    return Err(fixed_refusal(flag, &v));
                }
            }
            "--check_consistency" => o.check_consistency = true,
            "--filepath" => {
                o.filepath = Some(PathBuf::from(value()?));
                storage_flags.push("--filepath");
            }
            "--num_files" => {
                o.num_files = num(value()?)?;
                if o.num_files == 0 {
                    return Err("--num_files: at least 1".into());
                }
                storage_flags.push("--num_files");
            }
            "--hf3fs_mount" => {
                o.hf3fs_mount = Some(PathBuf::from(value()?));
                storage_flags.push("--hf3fs_mount");
            }
            "--plot" => o.plot = Some(value()?),
            "--no_progress" => o.progress = false,
            "--runtime_type" => runtime_type = Some(value()?.to_ascii_uppercase()),
            "--etcd_endpoints" | "--etcd-endpoints" => {
                let v = value()?;
                let endpoints = comma_list(&v);
                if endpoints.is_empty() {
                    return Err(format!(
                        "{key}: at least one endpoint, e.g. {DEFAULT_ETCD_ENDPOINT}"
                    ));
                }
                etcd_endpoints = Some(endpoints);
            }
            "--benchmark_group" => {
                let v = value()?;
                if v.is_empty() || v.contains('/') {
                    return Err(format!(
                        "--benchmark_group `{v}`: a non-empty name without `/`"
                    ));
                }
                group = Some(v);
            }
            "--etcd_wait" => {
                let v = value()?;
                etcd_wait = Some(v.parse::<u64>().ok().filter(|s| *s > 0).ok_or(format!(
                    "--etcd_wait: `{v}` is not a positive number of seconds"
                ))?);
            }
            "--role" => {
                o.role = Some(value()?);
                socket_flags.push("--role");
            }
            "--listen" => {
                o.listen = value()?.parse().map_err(|e| format!("--listen: {e}"))?;
                socket_flags.push("--listen");
            }
            "--target_address" => {
                o.target_address = Some(
                    value()?
                        .parse()
                        .map_err(|e| format!("--target_address: {e}"))?,
                );
                socket_flags.push("--target_address");
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
    if matches!(o.backend.as_str(), "CUDA_IPC" | "GPUNETIO") && !cfg!(feature = "cuda") {
        return Err(format!("--backend {}: {NEEDS_CUDA}", o.backend));
    }
    if o.total_buffer_size == 0 {
        return Err("need total_buffer_size > 0".into());
    }
    o.target_seg = match target_seg {
        Some(kind) => kind,
        // GPUNETIO reaches a peer's VRAM only: upstream's documented command line
        // (`--backend GPUNETIO --gpunetio_device_list 0`, no segment types) runs.
        None if o.backend == "GPUNETIO" => MemKind::Vram,
        None if o.is_storage() => MemKind::File,
        None => MemKind::Dram,
    };
    check_storage(&o, &storage_flags, &socket_flags)?;
    resolve_gpus(&mut o, initiator_gpu, target_gpu, gpunetio_devices)?;
    o.runtime = resolve_runtime(runtime_type, etcd_endpoints, group, etcd_wait)?;
    if let Runtime::Etcd { .. } = o.runtime {
        if let Some(flag) = socket_flags.first() {
            return Err(format!(
                "{flag} belongs to the SOCKET runtime: with ETCD the ranks decide the roles \
                 (start nixlbench twice with the same --etcd_endpoints)"
            ));
        }
        if o.backend == "LOCAL" || o.is_storage() {
            return Err(format!(
                "{} moves data inside one agent: it needs no runtime, drop the ETCD options",
                o.backend
            ));
        }
    }
    Ok(o)
}

/// Storage options go with `--backend FILE` and FILE targets, and the other way round.
fn check_storage(
    o: &Options,
    storage_flags: &[&'static str],
    socket_flags: &[&'static str],
) -> Result<(), String> {
    if !o.is_storage() {
        if o.target_seg == MemKind::File {
            return Err(format!(
                "--target_seg_type FILE: files are --backend FILE's target (storage); \
                 {} moves DRAM or VRAM",
                o.backend
            ));
        }
        if let Some(flag) = storage_flags.first() {
            return Err(format!("{flag} belongs to storage runs (--backend FILE)"));
        }
        return Ok(());
    }
    if !cfg!(feature = "file") {
        return Err(format!("--backend FILE: {NEEDS_FILE}"));
    }
    if o.target_seg != MemKind::File {
        return Err(format!(
            "--backend FILE moves between memory and files: --target_seg_type FILE (its \
             default), not {:?}",
            o.target_seg
        ));
    }
    if let Some(flag) = socket_flags.first() {
        return Err(format!(
            "{flag}: --backend FILE runs in one process (storage transfers are local)"
        ));
    }
    Ok(())
}

/// Each side's GPU: `--initiator_gpu`/`--target_gpu`, or GPUNETIO's
/// `--gpunetio_device_list` (which must agree with them when both are given).
fn resolve_gpus(
    o: &mut Options,
    initiator_gpu: Option<usize>,
    target_gpu: Option<usize>,
    gpunetio_devices: Option<Vec<usize>>,
) -> Result<(), String> {
    if o.backend != "GPUNETIO" {
        if gpunetio_devices.is_some() || !o.oob_list.is_empty() {
            return Err(format!(
                "--gpunetio_device_list and --gpunetio_oob_list are GPUNETIO's, not {}'s",
                o.backend
            ));
        }
    } else if !matches!(o.target_seg, MemKind::Vram | MemKind::Dram) {
        return Err(
            "--backend GPUNETIO moves to the target's VRAM (its default with GPUNETIO) or DRAM \
             (through the NIC path): --target_seg_type VRAM|DRAM"
                .into(),
        );
    }
    let devices = gpunetio_devices.unwrap_or_default();
    for (side, flag, given) in [
        (Side::Initiator, "--initiator_gpu", initiator_gpu),
        (Side::Target, "--target_gpu", target_gpu),
    ] {
        let listed = side_entry(&devices, side).copied();
        let gpu = match (given, listed) {
            (Some(g), Some(l)) if g != l => {
                return Err(format!(
                "{flag} {g} disagrees with --gpunetio_device_list, which gives this side GPU {l}"
            ))
            }
            (g, l) => g.or(l).unwrap_or(0),
        };
        match side {
            Side::Initiator => o.initiator_gpu = gpu,
            Side::Target => o.target_gpu = gpu,
        }
    }
    Ok(())
}

fn resolve_runtime(
    runtime_type: Option<String>,
    endpoints: Option<Vec<String>>,
    group: Option<String>,
    wait: Option<u64>,
) -> Result<Runtime, String> {
    let etcd = match runtime_type.as_deref() {
        None => endpoints.is_some(),
        Some("ETCD") => true,
        Some("SOCKET") => false,
        Some("ASIO") => {
            return Err(
                "--runtime_type ASIO is not implemented: SOCKET is this nixlbench's \
                        two-instance runtime without etcd (--role, --listen, --target_address)"
                    .into(),
            )
        }
        Some(other) => return Err(format!("--runtime_type {other}: SOCKET or ETCD")),
    };
    if !etcd {
        if let Some(flag) = [
            (endpoints.is_some(), "--etcd_endpoints"),
            (group.is_some(), "--benchmark_group"),
            (wait.is_some(), "--etcd_wait"),
        ]
        .iter()
        .find_map(|(set, flag)| set.then_some(flag))
        {
            return Err(format!("{flag} belongs to the ETCD runtime, not SOCKET"));
        }
        return Ok(Runtime::Socket);
    }
    if !cfg!(feature = "etcd") {
        return Err(
            "--runtime_type ETCD: nixlbench was built without feature etcd \
                    (cargo build --release -p tools --bin nixlbench --features etcd)"
                .into(),
        );
    }
    Ok(Runtime::Etcd {
        endpoints: endpoints.unwrap_or_else(|| vec![DEFAULT_ETCD_ENDPOINT.into()]),
        group: group.unwrap_or_else(|| "default".into()),
        wait: std::time::Duration::from_secs(wait.unwrap_or(60)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn err(s: &str) -> String {
        parse_args(&args(s)).unwrap_err()
    }

    #[test]
    fn options() {
        let o = parse_args(&args("--backend local --initiator_gpu 1 --target_gpu=2")).unwrap();
        assert_eq!(o.backend, "LOCAL");
        assert_eq!((o.initiator_gpu, o.target_gpu), (1, 2));
        assert_eq!(o.runtime, Runtime::Socket);
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
        let e = err("--target_seg_type FILE");
        assert!(e.contains("LIBFABRIC moves DRAM or VRAM"), "{e}");
        let e = err("--initiator_seg_type FILE");
        assert!(e.contains("DRAM or VRAM"), "{e}");
        let e = err("--num_files 2");
        assert!(e.contains("belongs to storage runs"), "{e}");
        let vram = parse_args(&args("--initiator_seg_type VRAM"));
        if cfg!(feature = "cuda") {
            assert_eq!(vram.unwrap().initiator_seg, MemKind::Vram);
        } else {
            assert!(vram.unwrap_err().contains("built without feature cuda"));
        }
        let o = parse_args(&args("--backend VERBS --device_list mlx5_1,mlx5_0")).unwrap();
        assert_eq!(o.params(Side::Initiator, None)["device"], "mlx5_1");
        let o = parse_args(&args(
            "--backend VERBS --backend_param device=rxe0 --device_list mlx5_1",
        ))
        .unwrap();
        assert_eq!(o.params(Side::Target, None)["device"], "rxe0");
        let o = parse_args(&args("--device_list mlx5_1")).unwrap();
        assert_eq!(o.params(Side::Initiator, Some("shm"))["provider"], "shm");
        assert!(!o.params(Side::Initiator, None).contains_key("device"));
    }

    #[test]
    fn upstream_options_at_their_only_values() {
        let o = parse_args(&args(
            "--scheme pairwise --mode sg --worker_type nixl --num_initiator_dev 1 --num_target_dev=1",
        ))
        .unwrap();
        assert_eq!(o.backend, "LIBFABRIC");
        for (line, want) in [
            (
                "--scheme manytoone",
                "--scheme manytoone: this nixlbench runs one initiator",
            ),
            (
                "--scheme tp",
                "manytoone, onetomany and tp are not implemented",
            ),
            (
                "--mode MG",
                "--mode MG: this nixlbench runs one GPU per process",
            ),
            ("--worker_type nvshmem", "nvshmem is not implemented"),
            (
                "--num_initiator_dev 2",
                "--num_initiator_dev 2: this nixlbench runs one device",
            ),
            ("--num_target_dev 0", "--num_target_dev 0"),
            ("--scheme", "--scheme needs a value"),
        ] {
            let e = err(line);
            assert!(e.contains(want), "{line}: {e}");
        }
    }

    /// What upstream's nixlbench puts in GPUNETIO's parameters, per side.
    #[cfg(feature = "cuda")]
    #[test]
    fn gpunetio_parameters_from_the_flags() {
        let o = parse_args(&args(
            "--backend gpunetio --initiator_seg_type VRAM --target_seg_type VRAM \
             --gpunetio_device_list 0,1 --device_list mlx5_0 --gpunetio_oob_list eth0,eth1",
        ))
        .unwrap();
        let (i, t) = (
            o.params(Side::Initiator, None),
            o.params(Side::Target, None),
        );
        let pairs = |p: &BackendParams| {
            let mut v: Vec<(String, String)> =
                p.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            v.sort();
            v
        };
        let s = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(
            pairs(&i),
            [
                s("gpu_devices", "0"),
                s("network_devices", "mlx5_0"),
                s("oob_interface", "eth0")
            ]
        );
        assert_eq!(
            pairs(&t),
            [
                s("gpu_devices", "1"),
                s("network_devices", "mlx5_0"),
                s("oob_interface", "eth1")
            ]
        );
        assert_eq!((o.initiator_gpu, o.target_gpu), (0, 1));
        // One entry serves both sides; no list: GPU 0 (upstream's default), no NIC, no OOB.
        let o = parse_args(&args(
            "--backend GPUNETIO --target_seg_type VRAM --gpunetio_device_list 3",
        ))
        .unwrap();
        assert_eq!((o.initiator_gpu, o.target_gpu), (3, 3));
        let o = parse_args(&args("--backend GPUNETIO --target_seg_type VRAM")).unwrap();
        assert_eq!(
            pairs(&o.params(Side::Target, None)),
            [s("gpu_devices", "0")]
        );
        // The side flags agree with the list, or set the GPU without it.
        let o = parse_args(&args(
            "--backend GPUNETIO --target_seg_type VRAM --target_gpu 2",
        ))
        .unwrap();
        assert_eq!(o.params(Side::Target, None)["gpu_devices"], "2");
        assert_eq!(o.params(Side::Initiator, None)["gpu_devices"], "0");
        let e = err(
            "--backend GPUNETIO --target_seg_type VRAM --gpunetio_device_list 0,1 --target_gpu 0",
        );
        assert!(e.contains("--target_gpu 0 disagrees"), "{e}");
        // --backend_param overrides what the flags set.
        let o = parse_args(&args(
            "--backend GPUNETIO --target_seg_type VRAM --device_list mlx5_0 \
             --backend_param network_devices=mlx5_3 --backend_param cuda_streams=8",
        ))
        .unwrap();
        let p = o.params(Side::Initiator, None);
        assert_eq!(
            (p["network_devices"].as_str(), p["cuda_streams"].as_str()),
            ("mlx5_3", "8")
        );
        // Bad values.
        let e = err("--backend GPUNETIO --target_seg_type VRAM --gpunetio_device_list mlx5_0");
        assert!(e.contains("`mlx5_0` is not a CUDA device id"), "{e}");
        assert!(e.contains("--device_list"), "{e}");
        let e = err("--backend GPUNETIO --target_seg_type VRAM --gpunetio_device_list 0,1,2");
        assert!(
            e.contains("one CUDA device id for both sides, or two"),
            "{e}"
        );
        let e = err("--backend GPUNETIO --target_seg_type VRAM --gpunetio_oob_list a,b,c");
        assert!(e.contains("one interface for both sides"), "{e}");
        if cfg!(feature = "cuda") {
            // A peer's DRAM goes through the NIC path.
            let o = parse_args(&args("--backend GPUNETIO --target_seg_type DRAM")).unwrap();
            assert_eq!(o.target_seg, MemKind::Dram);
        }
        // Upstream's documented line, no segment types: DRAM -> VRAM, GPUs 0 and 1.
        let o = parse_args(&args("--backend GPUNETIO --gpunetio_device_list 0,1")).unwrap();
        assert_eq!(
            (o.initiator_seg, o.target_seg),
            (MemKind::Dram, MemKind::Vram)
        );
        assert_eq!((o.initiator_gpu, o.target_gpu), (0, 1));
    }

    #[test]
    fn gpunetio_flags_belong_to_gpunetio() {
        let e = err("--gpunetio_device_list 0");
        assert!(e.contains("GPUNETIO's, not LIBFABRIC's"), "{e}");
        let e = err("--backend VERBS --gpunetio_oob_list eth0");
        assert!(e.contains("GPUNETIO's, not VERBS's"), "{e}");
        if !cfg!(feature = "cuda") {
            let e = err("--backend GPUNETIO --target_seg_type DRAM");
            assert!(e.contains("built without feature cuda"), "{e}");
        }
    }

    #[test]
    fn storage_options() {
        let r = parse_args(&args(
            "--backend file --filepath /tmp/x --num_files 3 --hf3fs_mount /tmp/m",
        ));
        if !cfg!(feature = "file") {
            assert!(r.unwrap_err().contains("built without feature file"));
            return;
        }
        let o = r.unwrap();
        assert!(o.is_storage());
        assert_eq!(
            (o.initiator_seg, o.target_seg),
            (MemKind::Dram, MemKind::File)
        );
        assert_eq!(o.num_files, 3);
        assert_eq!(o.filepath, Some(PathBuf::from("/tmp/x")));
        assert_eq!(o.hf3fs_mount, Some(PathBuf::from("/tmp/m")));
        for (line, want) in [
            (
                "--backend FILE --target_seg_type DRAM",
                "--target_seg_type FILE",
            ),
            ("--backend FILE --role target", "runs in one process"),
            ("--backend FILE --num_files 0", "at least 1"),
            ("--backend FILE --initiator_seg_type FILE", "DRAM or VRAM"),
        ] {
            let e = err(line);
            assert!(e.contains(want), "{line}: {e}");
        }
    }

    #[test]
    fn runtime_choice() {
        let etcd = parse_args(&args("--etcd_endpoints http://h:2379,http://g:2379"));
        let etcd_dash = parse_args(&args("--etcd-endpoints=http://h:2379 --benchmark_group g1"));
        let etcd_default = parse_args(&args("--runtime_type etcd --etcd_wait 5"));
        if cfg!(feature = "etcd") {
            assert_eq!(
                etcd.unwrap().runtime,
                Runtime::Etcd {
                    endpoints: vec!["http://h:2379".into(), "http://g:2379".into()],
                    group: "default".into(),
                    wait: std::time::Duration::from_secs(60),
                }
            );
            assert_eq!(
                etcd_dash.unwrap().runtime,
                Runtime::Etcd {
                    endpoints: vec!["http://h:2379".into()],
                    group: "g1".into(),
                    wait: std::time::Duration::from_secs(60),
                }
            );
            assert_eq!(
                etcd_default.unwrap().runtime,
                Runtime::Etcd {
                    endpoints: vec![DEFAULT_ETCD_ENDPOINT.into()],
                    group: "default".into(),
                    wait: std::time::Duration::from_secs(5),
                }
            );
            let e = err("--etcd_endpoints http://h:2379 --role target");
            assert!(e.contains("--role belongs to the SOCKET runtime"), "{e}");
            let e = err("--runtime_type ETCD --target_address 127.0.0.1:5");
            assert!(
                e.contains("--target_address belongs to the SOCKET runtime"),
                "{e}"
            );
            let e = err("--runtime_type ETCD --backend LOCAL");
            assert!(e.contains("LOCAL moves data inside one agent"), "{e}");
        } else {
            for e in [etcd, etcd_dash, etcd_default] {
                assert!(e.unwrap_err().contains("built without feature etcd"));
            }
        }
        assert_eq!(
            parse_args(&args("--runtime_type socket --role target"))
                .unwrap()
                .runtime,
            Runtime::Socket
        );
        let e = err("--runtime_type SOCKET --etcd_endpoints http://h:2379");
        assert!(
            e.contains("--etcd_endpoints belongs to the ETCD runtime"),
            "{e}"
        );
        let e = err("--benchmark_group g");
        assert!(
            e.contains("--benchmark_group belongs to the ETCD runtime"),
            "{e}"
        );
        let e = err("--runtime_type ASIO");
        assert!(e.contains("ASIO is not implemented"), "{e}");
        let e = err("--runtime_type MPI");
        assert!(e.contains("SOCKET or ETCD"), "{e}");
        let e = err("--etcd_endpoints ,");
        assert!(e.contains("at least one endpoint"), "{e}");
        let e = err("--benchmark_group a/b");
        assert!(e.contains("without `/`"), "{e}");
        let e = err("--etcd_wait 0");
        assert!(e.contains("not a positive number"), "{e}");
    }
}
