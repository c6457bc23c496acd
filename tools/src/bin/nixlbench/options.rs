//! The command line: nixlbench's option names, defaults and checks.
//!
//! Arguments are read as NIXL's nixlbench (gflags) reads them ([`tools::gflags`]), then
//! parsed by clap ([`Cli`]), then checked together ([`Cli::into_options`]) before anything
//! starts: a wrong invocation is one line on standard error and exit status 2.
//! `--config_file FILE` (upstream's TOML, top-level keys named as the flags) is read
//! first; flags on the command line win over its keys.

use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, ValueEnum};
use nixl::{AgentConfig, BackendParams, MemKind, XferOp};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use tools::cli::Stop;
use tools::gflags::{self, Kind};
use tools::units::{human_bytes, parse_size_usize};

/// Which side of the run a process (or a backend) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Side {
    Initiator,
    Target,
}

/// Where a batch's blocks lie in each side's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BlockLayout {
    /// Block `j` at `j × block size`, as NIXL's nixlbench lays a batch out: neighbours
    /// touch, so a backend may move them as one.
    Contiguous,
    /// Two block sizes apart where the buffer has room: every descriptor stands alone.
    Spaced,
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

/// When the sweep's progress line is shown (on standard error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProgressMode {
    /// A bar when standard error is a terminal, nothing otherwise.
    Auto,
    /// A bar on a terminal, else a line per point.
    Always,
    Never,
}

/// Upstream nixlbench's default etcd endpoint.
pub(crate) const DEFAULT_ETCD_ENDPOINT: &str = "http://localhost:2379";

const NEEDS_CUDA: &str = "nixlbench was built without feature cuda \
     (cargo build --release -p tools --bin nixlbench --features cuda)";

/// What the long help says after the options.
const DIFFERENCES: &str = "\
Differences from NIXL's nixlbench:
  --backend          LIBFABRIC by default (upstream: UCX, which this nixl does not have:
                     --backend UCX runs LIBFABRIC, as the rdma_nixl Python package maps it)
  --runtime_type     SOCKET by default: no etcd needed (upstream: ETCD)
  --enable_pt        on by default: the agents' progress threads (upstream: off);
                     --enable_pt=false turns them off
  --total_buffer_size  the most each side allocates (default 8 GiB, as upstream); only the
                     part the sweep touches is allocated: 2 x max block x max batch per
                     thread (blocks of a batch are spaced two apart)
  --num_iter         each thread runs all of them (upstream divides them among threads)
  points             a block x batch point larger than --total_buffer_size / --num_threads
                     is skipped (upstream refuses the run)
  --prepared_xfer    either way the same: this nixl's create_xfer_req is prep_xfer_dlist
                     twice and make_xfer_req
  sizes              accept K, M, G and T suffixes (powers of 1024)";

/// Upstream flags this nixlbench refuses, and why.
const REFUSED: &[(&str, Kind, &str)] = &[
    (
        "reregister_mem",
        Kind::Bool,
        "registering memory per iteration is not implemented (--recreate_xfer recreates the request per iteration)",
    ),
    (
        "use_hugepages",
        Kind::Bool,
        "hugepage buffers are not implemented (DRAM is page-aligned memory, every page touched before the run)",
    ),
    (
        "filenames",
        Kind::Value,
        "nixlbench creates its own files in --filepath (and removes them at the end)",
    ),
    (
        "asio_address",
        Kind::Value,
        "the ASIO runtime is not implemented; SOCKET is the two-instance runtime without etcd (--role, --listen, --target_address)",
    ),
    (
        "asio_port",
        Kind::Value,
        "the ASIO runtime is not implemented; SOCKET is the two-instance runtime without etcd (--role, --listen, --target_address)",
    ),
    ("gds_batch_pool_size", Kind::Value, GDS),
    ("gds_batch_limit", Kind::Value, GDS),
    ("gds_mt_num_threads", Kind::Value, GDS),
    ("posix_api_type", Kind::Value, POSIX),
    ("posix_ios_pool_size", Kind::Value, POSIX),
    ("posix_kernel_queue_size", Kind::Value, POSIX),
    (
        "hf3fs_iopool_size",
        Kind::Value,
        "NIXL's HF3FS backend is not in this nixl; --backend FILE runs through an hf3fs-gdr daemon (its ring: --backend_param entries=N)",
    ),
    ("obj_access_key", Kind::Value, OBJECT),
    ("obj_secret_key", Kind::Value, OBJECT),
    ("obj_session_token", Kind::Value, OBJECT),
    ("obj_bucket_name", Kind::Value, OBJECT),
    ("obj_scheme", Kind::Value, OBJECT),
    ("obj_region", Kind::Value, OBJECT),
    ("obj_use_virtual_addressing", Kind::Bool, OBJECT),
    ("obj_endpoint_override", Kind::Value, OBJECT),
    ("obj_req_checksum", Kind::Value, OBJECT),
    ("obj_ca_bundle", Kind::Value, OBJECT),
    ("obj_crt_min_limit", Kind::Value, OBJECT),
    ("obj_accelerated_enable", Kind::Bool, OBJECT),
    ("obj_accelerated_type", Kind::Value, OBJECT),
    ("azure_blob_account_url", Kind::Value, OBJECT),
    ("azure_blob_container_name", Kind::Value, OBJECT),
    ("azure_blob_connection_string", Kind::Value, OBJECT),
    ("infinia_config_file", Kind::Value, OBJECT),
    ("gusli_client_name", Kind::Value, GUSLI),
    ("gusli_max_simultaneous_requests", Kind::Value, GUSLI),
    ("gusli_config_file", Kind::Value, GUSLI),
    ("gusli_device_byte_offsets", Kind::Value, GUSLI),
    ("gusli_device_security", Kind::Value, GUSLI),
    ("gusli_try_use_uring", Kind::Bool, GUSLI),
];
const GDS: &str = "NIXL's GDS backends are not in this nixl (storage runs: --backend FILE)";
const POSIX: &str = "NIXL's POSIX backend is not in this nixl (storage runs: --backend FILE)";
const OBJECT: &str = "NIXL's object-store backends (OBJ, AZURE_BLOB, INFINIA) are not in this nixl";
const GUSLI: &str = "NIXL's GUSLI backend is not in this nixl (block devices are not supported)";

/// nixlbench's command line, as clap parses it once [`gflags::normalize`] has rewritten
/// the gflags forms.
#[derive(Parser, Debug)]
#[command(
    name = "nixlbench",
    version,
    about = "Bandwidth and latency of nixl transfers, with the options and result columns of NIXL's nixlbench",
    long_about = "Bandwidth and latency of nixl transfers, with the options and result columns of \
NIXL's nixlbench. Flags take gflags' forms: --flag value, --flag=value, -flag, - or _ alike \
in names; booleans --x, --x=true|false, --nox.\n\nWith no --role it starts its own target \
as a second process on loopback and drives it; --backend LOCAL and FILE run in one process.",
    after_help = "nixlbench --help also lists the differences from NIXL's nixlbench and the upstream flags it refuses.",
    args_override_self = true,
    max_term_width = 100
)]
pub(crate) struct Cli {
    /// Backend: LIBFABRIC, VERBS, LOCAL (both sides in this process), CUDA_IPC and
    /// GPUNETIO (feature cuda), FILE (feature file: storage, one process); UCX runs
    /// LIBFABRIC
    #[arg(
        long = "backend",
        value_name = "NAME",
        default_value = "LIBFABRIC",
        help_heading = "Transfer"
    )]
    backend: String,

    /// Backend parameter (repeatable; overrides what the flags set), e.g.
    /// provider=tcp;ofi_rxm, num_rails=2, cuda_streams=8. LIBFABRIC's provider defaults to
    /// shm when the target is on this host, else to the first of cxi, efa, tcp;ofi_rxm,
    /// sockets
    #[arg(long = "backend_param", value_name = "KEY=VALUE", value_parser = key_value,
          action = ArgAction::Append, help_heading = "Transfer")]
    backend_param: Vec<(String, String)>,

    /// Network devices, comma-separated; each side takes the first entry. VERBS: its
    /// `device`; GPUNETIO: its `network_devices` (both: an RDMA device this machine has,
    /// checked at once); LIBFABRIC: printed only, as NIXL
    #[arg(
        long = "device_list",
        value_name = "LIST",
        default_value = "all",
        help_heading = "Transfer"
    )]
    device_list: String,

    /// Direction of the transfers
    #[arg(long = "op_type", value_name = "READ|WRITE", default_value = "WRITE",
          value_parser = op_type, help_heading = "Transfer")]
    op_type: XferOp,

    /// Initiator memory (VRAM needs feature cuda)
    #[arg(
        long = "initiator_seg_type",
        value_name = "DRAM|VRAM",
        default_value = "DRAM",
        help_heading = "Transfer"
    )]
    initiator_seg_type: String,

    /// Target memory [default: DRAM; VRAM with GPUNETIO, FILE with FILE]
    #[arg(
        long = "target_seg_type",
        value_name = "DRAM|VRAM|FILE",
        help_heading = "Transfer"
    )]
    target_seg_type: Option<String>,

    /// GPU of initiator VRAM [default: 0; NIXL uses the process rank]
    #[arg(long = "initiator_gpu", value_name = "N", help_heading = "Transfer")]
    initiator_gpu: Option<usize>,

    /// GPU of target VRAM [default: 0]
    #[arg(long = "target_gpu", value_name = "N", help_heading = "Transfer")]
    target_gpu: Option<usize>,

    /// Verify the data of every block and batch size: WRITE on the target's memory, READ on
    /// the initiator's (VRAM copied back to the host)
    #[arg(long = "check_consistency", action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", default_value = "false",
          value_name = "BOOL", value_parser = gflags::parse_bool, help_heading = "Transfer")]
    check_consistency: bool,

    /// Where a batch's blocks lie: `contiguous` (NIXL's nixlbench) or `spaced` (two block
    /// sizes apart where the buffer has room, so no two descriptors touch)
    #[arg(long = "block_layout", value_name = "LAYOUT", value_enum,
          default_value_t = BlockLayout::Contiguous, help_heading = "Transfer")]
    block_layout: BlockLayout,

    /// Buffer of each side, at most (only the part the sweep touches is allocated)
    #[arg(long = "total_buffer_size", value_name = "BYTES", default_value = "8GiB",
          value_parser = parse_size_usize, help_heading = "Sizes and iterations")]
    total_buffer_size: usize,

    /// First block size
    #[arg(long = "start_block_size", value_name = "BYTES", default_value = "4KiB",
          value_parser = parse_size_usize, help_heading = "Sizes and iterations")]
    start_block_size: usize,

    /// Last block size (doubling from the first)
    #[arg(long = "max_block_size", value_name = "BYTES", default_value = "64MiB",
          value_parser = parse_size_usize, help_heading = "Sizes and iterations")]
    max_block_size: usize,

    /// First batch size (descriptors per request)
    #[arg(long = "start_batch_size", value_name = "N", default_value_t = 1,
          value_parser = at_least_one, help_heading = "Sizes and iterations")]
    start_batch_size: u64,

    /// Last batch size (doubling from the first)
    #[arg(long = "max_batch_size", value_name = "N", default_value_t = 1,
          value_parser = at_least_one, help_heading = "Sizes and iterations")]
    max_batch_size: u64,

    /// Timed iterations per point (each thread)
    #[arg(long = "num_iter", value_name = "N", default_value_t = 1000,
          value_parser = at_least_one, help_heading = "Sizes and iterations")]
    num_iter: u64,

    /// Untimed iterations before them
    #[arg(
        long = "warmup_iter",
        value_name = "N",
        default_value_t = 100,
        help_heading = "Sizes and iterations"
    )]
    warmup_iter: u64,

    /// Iterations are divided by N for blocks of 1 MiB and more
    #[arg(long = "large_blk_iter_ftr", value_name = "N", default_value_t = 16,
          value_parser = at_least_one, help_heading = "Sizes and iterations")]
    large_blk_iter_ftr: u64,

    /// Initiator threads, each with its own request
    #[arg(long = "num_threads", value_name = "N", default_value_t = 1,
          value_parser = at_least_one, help_heading = "Sizes and iterations")]
    num_threads: u64,

    /// CUDA device ids, comma-separated: the initiator takes the first, the target the
    /// second (the first if there is one): each side's GPU, VRAM and `gpu_devices`
    /// [default: 0]
    #[arg(
        long = "gpunetio_device_list",
        value_name = "LIST",
        help_heading = "GPUNETIO"
    )]
    gpunetio_device_list: Option<String>,

    /// Out-of-band interfaces, comma-separated, taken the same way: `oob_interface`
    #[arg(
        long = "gpunetio_oob_list",
        value_name = "LIST",
        help_heading = "GPUNETIO"
    )]
    gpunetio_oob_list: Option<String>,

    /// Where the files are created (each created or truncated, filled, removed at the
    /// end) [default: the current directory]
    #[arg(
        long = "filepath",
        value_name = "DIR",
        help_heading = "Storage (--backend FILE, feature file)"
    )]
    filepath: Option<PathBuf>,

    /// Files: descriptor i of thread t goes to file (t * batch + i) mod N [default: 1]
    #[arg(long = "num_files", value_name = "N",
          value_parser = at_least_one,
          help_heading = "Storage (--backend FILE, feature file)")]
    num_files: Option<u64>,

    /// The directory an hf3fs-gdr daemon serves [default: --filepath; env
    /// NIXLBENCH_HF3FS_MOUNT]. If none serves it, nixlbench starts one for the run
    /// ($HF3FS_GDR_DAEMON, hf3fs-gdr-daemon beside nixlbench or on the PATH, else its
    /// own) and stops it after
    #[arg(
        long = "hf3fs_mount",
        value_name = "DIR",
        help_heading = "Storage (--backend FILE, feature file)"
    )]
    hf3fs_mount: Option<PathBuf>,

    /// O_DIRECT for every file read and write (the daemon nixlbench starts runs with
    /// --direct always; one already running keeps its own policy, so that is refused)
    #[arg(long = "storage_enable_direct", action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", default_value = "false",
          value_name = "BOOL", value_parser = gflags::parse_bool,
          help_heading = "Storage (--backend FILE, feature file)")]
    storage_enable_direct: bool,

    /// SOCKET (ours: a target's listener) or ETCD (feature etcd) [default: SOCKET, or ETCD
    /// when --etcd_endpoints is given]
    #[arg(
        long = "runtime_type",
        value_name = "SOCKET|ETCD",
        help_heading = "Runtime"
    )]
    runtime_type: Option<String>,

    /// SOCKET: run one side only [default: both, the target as a child process on
    /// loopback]
    #[arg(long = "role", value_enum, help_heading = "Runtime")]
    role: Option<Side>,

    /// SOCKET, --role target: the metadata listener's address [default: 127.0.0.1:0]
    #[arg(long = "listen", value_name = "ADDR", help_heading = "Runtime")]
    listen: Option<SocketAddr>,

    /// SOCKET, --role initiator: the target's listener
    #[arg(long = "target_address", value_name = "ADDR", help_heading = "Runtime")]
    target_address: Option<SocketAddr>,

    /// ETCD: start nixlbench twice with the same endpoints; the first to claim a rank is
    /// the initiator, the second the target [default: http://localhost:2379]
    #[arg(
        long = "etcd_endpoints",
        value_name = "URL[,URL]",
        help_heading = "Runtime"
    )]
    etcd_endpoints: Option<String>,

    /// ETCD: runs in different groups do not meet [default: default]
    #[arg(
        long = "benchmark_group",
        value_name = "NAME",
        help_heading = "Runtime"
    )]
    benchmark_group: Option<String>,

    /// ETCD: how long to wait for the peer, in seconds, after its last setup progress
    /// (a peer setting up large buffers publishes its progress) [default: 60]
    #[arg(long = "etcd_wait", value_name = "SECS",
          value_parser = at_least_one, help_heading = "Runtime")]
    etcd_wait: Option<u64>,

    /// Draw bandwidth and latency against block size, a line per batch size (checked
    /// before the sweep)
    #[arg(long = "plot", value_name = "FILE.png", help_heading = "Output")]
    plot: Option<PathBuf>,

    /// Progress on standard error: the point, its sizes and the time left [default: a bar
    /// when standard error is a terminal; --progress forces a line per point elsewhere,
    /// --noprogress (or --no_progress) turns it off]
    #[arg(long = "progress", action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_name = "BOOL",
          value_parser = gflags::parse_bool, help_heading = "Output")]
    progress: Option<bool>,

    /// Upstream's TOML file of options (top-level keys named as the flags); flags given
    /// on the command line win
    #[arg(
        long = "config_file",
        value_name = "FILE",
        help_heading = "Upstream options"
    )]
    config_file: Option<PathBuf>,

    /// The agents' progress threads [default: true; upstream: false]
    #[arg(long = "enable_pt", action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_name = "BOOL",
          value_parser = gflags::parse_bool, help_heading = "Upstream options")]
    enable_pt: Option<bool>,

    /// Backend worker threads: 0 only (the backends size their own; LIBFABRIC: one per
    /// rail, --backend_param num_rails=N)
    #[arg(
        long = "progress_threads",
        value_name = "N",
        default_value_t = 0,
        help_heading = "Upstream options"
    )]
    progress_threads: u64,

    /// Prepare, make, post and release the request on every iteration (its time is the
    /// Prep columns)
    #[arg(long = "recreate_xfer", action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", default_value = "false",
          value_name = "BOOL", value_parser = gflags::parse_bool, help_heading = "Upstream options")]
    recreate_xfer: bool,

    /// Prepared lists and make_xfer_req: what nixlbench does either way
    #[arg(long = "prepared_xfer", action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", default_value = "false",
          value_name = "BOOL", value_parser = gflags::parse_bool, help_heading = "Upstream options")]
    prepared_xfer: bool,

    /// VRAM through cuMemCreate (VMM) instead of cuMemAlloc (feature cuda)
    #[arg(long = "enable_vmm", action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", default_value = "false",
          value_name = "BOOL", value_parser = gflags::parse_bool, help_heading = "Upstream options")]
    enable_vmm: bool,

    /// Only pairwise: one initiator, one target
    #[arg(
        long = "scheme",
        value_name = "pairwise",
        help_heading = "Upstream options"
    )]
    scheme: Option<String>,

    /// Only SG: one GPU per process
    #[arg(long = "mode", value_name = "SG", help_heading = "Upstream options")]
    mode: Option<String>,

    /// Only nixl
    #[arg(
        long = "worker_type",
        value_name = "nixl",
        help_heading = "Upstream options"
    )]
    worker_type: Option<String>,

    /// Only 1
    #[arg(
        long = "num_initiator_dev",
        value_name = "1",
        help_heading = "Upstream options"
    )]
    num_initiator_dev: Option<String>,

    /// Only 1
    #[arg(
        long = "num_target_dev",
        value_name = "1",
        help_heading = "Upstream options"
    )]
    num_target_dev: Option<String>,

    /// Only 1: one request in flight per thread
    #[arg(
        long = "pipeline_depth",
        value_name = "1",
        help_heading = "Upstream options"
    )]
    pipeline_depth: Option<String>,

    /// Only none: blocks in order
    #[arg(
        long = "randomize_location_mode",
        value_name = "none",
        help_heading = "Upstream options"
    )]
    randomize_location_mode: Option<String>,

    /// Its seed: no effect with none
    #[arg(
        long = "randomize_location_mode_seed",
        value_name = "N",
        help_heading = "Upstream options"
    )]
    randomize_location_mode_seed: Option<u64>,

    /// Only false (UCX's GPU device API)
    #[arg(long = "use_device_api", action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", default_value = "false",
          value_name = "BOOL", value_parser = gflags::parse_bool, help_heading = "Upstream options")]
    use_device_api: bool,
}

/// A count of at least one.
fn at_least_one(text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{text}` is not a whole number")),
    }
}

fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{text}` is not KEY=VALUE (e.g. provider=shm)")),
    }
}

fn op_type(text: &str) -> Result<XferOp, String> {
    XferOp::parse(text).ok_or_else(|| format!("`{text}` is not READ or WRITE"))
}

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
    pub(crate) block_layout: BlockLayout,
    pub(crate) plot: Option<PathBuf>,
    pub(crate) progress: ProgressMode,
    pub(crate) runtime: Runtime,
    pub(crate) role: Option<Side>,
    pub(crate) listen: SocketAddr,
    pub(crate) target_address: Option<SocketAddr>,
    /// Storage runs: where the files go.
    pub(crate) filepath: Option<PathBuf>,
    #[cfg_attr(not(feature = "file"), allow(dead_code))]
    pub(crate) num_files: usize,
    pub(crate) hf3fs_mount: Option<PathBuf>,
    /// `--storage_enable_direct`: the daemon started for the run uses O_DIRECT always.
    pub(crate) storage_direct: bool,
    /// The agents' progress threads (`--enable_pt`).
    pub(crate) progress_thread: bool,
    /// `--recreate_xfer`: a new request every iteration.
    pub(crate) recreate_xfer: bool,
    /// `--enable_vmm`: VRAM through the CUDA VMM API.
    pub(crate) enable_vmm: bool,
    /// What the user should know about how the options were read (a mapped backend).
    pub(crate) notes: Vec<String>,
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

    /// The memory kind of `side`.
    pub(crate) fn seg(&self, side: Side) -> MemKind {
        match side {
            Side::Initiator => self.initiator_seg,
            Side::Target => self.target_seg,
        }
    }

    /// Bytes of each thread's part of a side's buffer: `--total_buffer_size /
    /// --num_threads`, but no more than the sweep touches (a batch of the largest blocks,
    /// spaced two apart), so that upstream's default of 8 GiB does not allocate 8 GiB for a
    /// sweep of 64 KiB blocks. The blocks land at the same offsets either way.
    pub(crate) fn per_thread_bytes(&self) -> usize {
        let touched = self
            .max_block_size
            .saturating_mul(self.max_batch_size)
            .saturating_mul(2);
        (self.total_buffer_size / self.num_threads).min(touched)
    }

    /// Bytes of each side's buffer (every thread's part).
    pub(crate) fn buffer_bytes(&self) -> usize {
        self.per_thread_bytes() * self.num_threads
    }

    /// The agent configuration of this run (`listen`: the metadata listener, if any).
    pub(crate) fn agent_config(&self, listen: Option<SocketAddr>) -> AgentConfig {
        AgentConfig {
            progress_thread: self.progress_thread,
            listen_addr: listen,
            ..AgentConfig::default()
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

/// A segment type; FILE is accepted here and checked against the backend later.
pub(crate) fn parse_seg_type(key: &str, v: &str) -> Result<MemKind, String> {
    match MemKind::parse(v) {
        Some(MemKind::Dram) => Ok(MemKind::Dram),
        Some(MemKind::Vram) if cfg!(feature = "cuda") => Ok(MemKind::Vram),
        Some(MemKind::Vram) => Err(format!("{key} VRAM: {NEEDS_CUDA}")),
        Some(MemKind::File) if key == "--target_seg_type" => Ok(MemKind::File),
        _ if key == "--target_seg_type" => Err(format!("{key} {v}: DRAM, VRAM or FILE")),
        _ => Err(format!("{key} {v}: DRAM or VRAM")),
    }
}

/// Upstream options this nixlbench accepts at one value only: `(flag, the value)`.
fn fixed_refusal(flag: &str, v: &str) -> String {
    let why = match flag {
        "--scheme" => {
            "one initiator and one target (manytoone, onetomany and tp are not implemented)"
        }
        "--mode" => "one GPU per process (MG is not implemented)",
        "--worker_type" => "the nixl worker (nvshmem is not implemented)",
        "--pipeline_depth" => {
            "one request in flight per thread (deeper pipelines are not implemented)"
        }
        "--randomize_location_mode" => {
            "blocks in order (blockaligned and bytealigned are not implemented)"
        }
        _ => "one device per process: GPUNETIO drives one GPU and one NIC per backend",
    };
    format!("{flag} {v}: this nixlbench runs {why}")
}

/// The flags the command line may name, with their kinds (clap's, and the refused
/// upstream ones).
fn known_flags() -> Vec<(String, Kind)> {
    let mut flags = gflags::flags_of(&Cli::command());
    flags.extend(REFUSED.iter().map(|(n, k, _)| (n.to_string(), *k)));
    flags
}

/// The long help's closing text: the differences, then the refused upstream flags
/// grouped by reason.
fn after_long_help() -> String {
    let mut text = String::from(DIFFERENCES);
    text.push_str("\n\nUpstream flags refused (each names its reason when given):");
    let mut reasons: Vec<&str> = Vec::new();
    for (_, _, why) in REFUSED {
        if !reasons.contains(why) {
            reasons.push(why);
        }
    }
    for why in reasons {
        let names: Vec<String> = REFUSED
            .iter()
            .filter(|(_, _, w)| *w == why)
            .map(|(n, _, _)| format!("--{n}"))
            .collect();
        text.push_str(&format!("\n  {}\n      {why}", names.join(" ")));
    }
    text.push_str(
        "\n\nEnvironment: RUST_LOG (the libraries' log, e.g. RUST_LOG=nixl=debug; default \
         warnings), NIXLBENCH_HOST_ID (ETCD: the host id LIBFABRIC compares to pick shm)",
    );
    text
}

fn command() -> clap::Command {
    Cli::command().after_long_help(after_long_help())
}

/// The refused upstream flag among `tokens` (normalized), as the error to print.
fn refused(tokens: &[String]) -> Option<String> {
    tokens.iter().find_map(|t| {
        let name = t.strip_prefix("--")?;
        let name = name.split_once('=').map_or(name, |(n, _)| n);
        REFUSED
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(n, _, why)| format!("--{n}: {why}"))
    })
}

/// The flags of a `--config_file` (upstream's TOML: top-level keys named as the flags),
/// as normalized tokens.
fn config_tokens(path: &Path, flags: &[(String, Kind)]) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--config_file {}: {e}", path.display()))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let first = e.to_string();
        let first = first.lines().next().unwrap_or_default().to_string();
        format!("--config_file {}: not TOML: {first}", path.display())
    })?;
    let mut tokens = Vec::new();
    for (key, value) in table {
        let name = key.replace('-', "_");
        if name == "config_file" {
            return Err(format!(
                "--config_file {}: a config file cannot name another",
                path.display()
            ));
        }
        if !flags.iter().any(|(n, _)| *n == name) {
            return Err(format!(
                "--config_file {}: `{key}` is not a nixlbench option (see nixlbench --help)",
                path.display()
            ));
        }
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Float(f) => f.to_string(),
            other => {
                return Err(format!(
                    "--config_file {}: `{key}` is a {}; options take a string, a number or a \
                     boolean",
                    path.display(),
                    other.type_str()
                ))
            }
        };
        tokens.push(format!("--{name}={text}"));
    }
    Ok(tokens)
}

/// Parses the command line (without the program name) into checked [`Options`], or the
/// [`Stop`] it asks for: help or version text, or the one-line error.
pub(crate) fn parse_args(args: &[String]) -> Result<Options, Stop> {
    let flags = known_flags();
    let usage = |e: String| Stop::Usage(e);
    let tokens = gflags::normalize(args.iter().cloned(), &flags).map_err(usage)?;
    let parse = |tokens: &[String]| -> Result<Cli, Stop> {
        if let Some(e) = refused(tokens) {
            return Err(Stop::Usage(e));
        }
        let matches = command()
            .try_get_matches_from(
                std::iter::once("nixlbench".to_string()).chain(tokens.iter().cloned()),
            )
            .map_err(|e| tools::cli::stop_of(&e, "nixlbench"))?;
        Cli::from_arg_matches(&matches).map_err(|e| tools::cli::stop_of(&e, "nixlbench"))
    };
    let mut cli = parse(&tokens)?;
    if let Some(path) = cli.config_file.take() {
        // The file's flags first: the command line's, after them, win.
        let mut merged = config_tokens(&path, &flags).map_err(usage)?;
        merged.extend(tokens);
        cli = parse(&merged)?;
        cli.config_file = None;
    }
    cli.into_options().map_err(usage)
}

impl Cli {
    /// Checks the options together and resolves their defaults.
    fn into_options(self) -> Result<Options, String> {
        let backend = tools::backend::resolve(&self.backend)?;
        let notes: Vec<String> = backend.note.into_iter().collect();
        for (flag, value, only) in [
            ("--scheme", &self.scheme, "pairwise"),
            ("--mode", &self.mode, "SG"),
            ("--worker_type", &self.worker_type, "nixl"),
            ("--num_initiator_dev", &self.num_initiator_dev, "1"),
            ("--num_target_dev", &self.num_target_dev, "1"),
            ("--pipeline_depth", &self.pipeline_depth, "1"),
            (
                "--randomize_location_mode",
                &self.randomize_location_mode,
                "none",
            ),
        ] {
            if let Some(v) = value {
                if !v.eq_ignore_ascii_case(only) {
                    return Err(fixed_refusal(flag, v));
                }
            }
        }
        if self.use_device_api {
            return Err(
                "--use_device_api: UCX's GPU device API is not in this nixl (GPU-initiated \
                 transfers are GPUNETIO's device API, not driven by nixlbench)"
                    .into(),
            );
        }
        if self.progress_threads != 0 {
            return Err(format!(
                "--progress_threads {}: the backends size their own worker threads \
                 (LIBFABRIC: one per rail, --backend_param num_rails=N)",
                self.progress_threads
            ));
        }
        if self.enable_vmm && !cfg!(feature = "cuda") {
            return Err(format!("--enable_vmm allocates VRAM: {NEEDS_CUDA}"));
        }
        let _ = (self.prepared_xfer, self.randomize_location_mode_seed);
        let device_list = comma_list(&self.device_list);
        if device_list.is_empty() {
            return Err("--device_list: at least one device, or all".into());
        }
        let oob_list = self
            .gpunetio_oob_list
            .as_deref()
            .map(comma_list)
            .unwrap_or_default();
        if oob_list.len() > 2 {
            return Err(format!(
                "--gpunetio_oob_list {}: one interface for both sides, or two (the \
                 initiator's, then the target's)",
                self.gpunetio_oob_list.as_deref().unwrap_or_default()
            ));
        }
        let gpunetio_devices = match &self.gpunetio_device_list {
            None => None,
            Some(v) => {
                let ids = comma_list(v)
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
                Some(ids)
            }
        };
        let count = |flag: &str, v: u64| {
            usize::try_from(v).map_err(|_| format!("{flag} {v}: too large for this machine"))
        };
        let mut o = Options {
            backend: backend.name,
            backend_params: self.backend_param.into_iter().collect(),
            device_list,
            op: self.op_type,
            initiator_seg: parse_seg_type("--initiator_seg_type", &self.initiator_seg_type)?,
            target_seg: MemKind::Dram,
            initiator_gpu: 0,
            target_gpu: 0,
            oob_list,
            total_buffer_size: self.total_buffer_size,
            start_block_size: self.start_block_size,
            max_block_size: self.max_block_size,
            start_batch_size: count("--start_batch_size", self.start_batch_size)?,
            max_batch_size: count("--max_batch_size", self.max_batch_size)?,
            num_iter: count("--num_iter", self.num_iter)?,
            warmup_iter: count("--warmup_iter", self.warmup_iter)?,
            large_blk_iter_ftr: count("--large_blk_iter_ftr", self.large_blk_iter_ftr)?,
            num_threads: count("--num_threads", self.num_threads)?,
            check_consistency: self.check_consistency,
            block_layout: self.block_layout,
            plot: self.plot,
            progress: match self.progress {
                None => ProgressMode::Auto,
                Some(true) => ProgressMode::Always,
                Some(false) => ProgressMode::Never,
            },
            runtime: Runtime::Socket,
            role: self.role,
            listen: self
                .listen
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0))),
            target_address: self.target_address,
            filepath: self.filepath,
            num_files: match self.num_files {
                Some(n) => count("--num_files", n)?,
                None => 1,
            },
            hf3fs_mount: self.hf3fs_mount,
            storage_direct: self.storage_enable_direct,
            progress_thread: self.enable_pt.unwrap_or(true),
            recreate_xfer: self.recreate_xfer,
            enable_vmm: self.enable_vmm,
            notes: Vec::new(),
        };
        if o.start_block_size == 0 || o.start_block_size > o.max_block_size {
            return Err(format!(
                "--start_block_size {} must be at least 1 and at most --max_block_size {}",
                o.start_block_size, o.max_block_size
            ));
        }
        if o.start_batch_size > o.max_batch_size {
            return Err(format!(
                "--start_batch_size {} exceeds --max_batch_size {}",
                o.start_batch_size, o.max_batch_size
            ));
        }
        if o.total_buffer_size / o.num_threads
            < o.start_block_size.saturating_mul(o.start_batch_size)
        {
            return Err(format!(
                "--total_buffer_size {} leaves {} per thread, less than the first point \
                 (--start_block_size x --start_batch_size = {}): raise it or lower those",
                human_bytes(o.total_buffer_size as u64),
                human_bytes((o.total_buffer_size / o.num_threads) as u64),
                human_bytes(o.start_block_size.saturating_mul(o.start_batch_size) as u64)
            ));
        }
        if let Some(plot) = &o.plot {
            let png = plot
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("png"));
            if !png {
                return Err(format!(
                    "--plot {}: the plot is a PNG file: name it FILE.png",
                    plot.display()
                ));
            }
        }
        o.target_seg = match &self.target_seg_type {
            Some(v) => parse_seg_type("--target_seg_type", v)?,
            // GPUNETIO reaches a peer's VRAM only: upstream's documented command line
            // (`--backend GPUNETIO --gpunetio_device_list 0`, no segment types) runs.
            None if o.backend == "GPUNETIO" => MemKind::Vram,
            None if o.is_storage() => MemKind::File,
            None => MemKind::Dram,
        };
        let storage_flags: Vec<&str> = [
            (o.filepath.is_some(), "--filepath"),
            (self.num_files.is_some(), "--num_files"),
            (o.hf3fs_mount.is_some(), "--hf3fs_mount"),
            (o.storage_direct, "--storage_enable_direct"),
        ]
        .iter()
        .filter(|(set, _)| *set)
        .map(|(_, f)| *f)
        .collect();
        let socket_flags: Vec<&str> = [
            (o.role.is_some(), "--role"),
            (self.listen.is_some(), "--listen"),
            (o.target_address.is_some(), "--target_address"),
        ]
        .iter()
        .filter(|(set, _)| *set)
        .map(|(_, f)| *f)
        .collect();
        check_storage(&o, &storage_flags, &socket_flags)?;
        resolve_gpus(
            &mut o,
            self.initiator_gpu,
            self.target_gpu,
            gpunetio_devices,
        )?;
        let endpoints = match &self.etcd_endpoints {
            None => None,
            Some(v) => {
                let endpoints = comma_list(v);
                if endpoints.is_empty() {
                    return Err(format!(
                        "--etcd_endpoints: at least one endpoint, e.g. {DEFAULT_ETCD_ENDPOINT}"
                    ));
                }
                Some(endpoints)
            }
        };
        if let Some(g) = &self.benchmark_group {
            if g.is_empty() || g.contains('/') {
                return Err(format!(
                    "--benchmark_group `{g}`: a non-empty name without `/`"
                ));
            }
        }
        o.runtime = resolve_runtime(
            self.runtime_type.map(|r| r.to_ascii_uppercase()),
            endpoints,
            self.benchmark_group,
            self.etcd_wait,
        )?;
        match o.runtime {
            Runtime::Etcd { .. } => {
                if let Some(flag) = socket_flags.first() {
                    return Err(format!(
                        "{flag} belongs to the SOCKET runtime: with ETCD the ranks decide the \
                         roles (start nixlbench twice with the same --etcd_endpoints)"
                    ));
                }
                if o.backend == "LOCAL" || o.is_storage() {
                    return Err(format!(
                        "{} moves data inside one agent: it needs no runtime, drop the ETCD \
                         options",
                        o.backend
                    ));
                }
            }
            Runtime::Socket => check_roles(&o, self.listen.is_some())?,
        }
        o.notes = notes;
        Ok(o)
    }
}

/// SOCKET roles: each address flag belongs to one role, and a role needs its own.
fn check_roles(o: &Options, listen_given: bool) -> Result<(), String> {
    match o.role {
        None => {
            if o.target_address.is_some() {
                return Err(
                    "--target_address is the initiator's: add --role initiator (without \
                     --role, nixlbench starts its own target on loopback)"
                        .into(),
                );
            }
            if listen_given {
                return Err(
                    "--listen is the target's: add --role target (without --role, nixlbench \
                     starts its own target on loopback)"
                        .into(),
                );
            }
        }
        Some(_) if o.backend == "LOCAL" => {
            return Err("--backend LOCAL moves data inside one agent: run it without --role".into())
        }
        Some(Side::Initiator) => {
            if o.target_address.is_none() {
                return Err(
                    "--role initiator needs --target_address ADDR (the target's --listen)".into(),
                );
            }
            if listen_given {
                return Err(
                    "--listen is the target's: the initiator reaches the target at \
                     --target_address"
                        .into(),
                );
            }
        }
        Some(Side::Target) => {
            if o.target_address.is_some() {
                return Err(
                    "--target_address is the initiator's: a target listens at --listen".into(),
                );
            }
        }
    }
    Ok(())
}

/// Storage options go with `--backend FILE` and FILE targets, and the other way round.
fn check_storage(o: &Options, storage_flags: &[&str], socket_flags: &[&str]) -> Result<(), String> {
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
            "the ETCD runtime (--etcd_endpoints, --runtime_type ETCD): nixlbench was built \
             without feature etcd (cargo build --release -p tools --bin nixlbench --features \
             etcd)"
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

    fn parse(s: &str) -> Result<Options, String> {
        parse_args(&args(s)).map_err(|stop| match stop {
            Stop::Usage(line) => line,
            Stop::Print(text) => panic!("{s}: printed {text}"),
        })
    }

    fn err(s: &str) -> String {
        let e = parse(s).unwrap_err();
        assert!(!e.contains('\n'), "{s}: not one line: {e}");
        e
    }

    #[test]
    fn options() {
        let o = parse("--backend local --initiator_gpu 1 --target_gpu=2").unwrap();
        assert_eq!(o.backend, "LOCAL");
        assert_eq!((o.initiator_gpu, o.target_gpu), (1, 2));
        assert_eq!(o.runtime, Runtime::Socket);
        let ipc = parse("--backend cuda_ipc");
        if cfg!(feature = "cuda") {
            assert_eq!(ipc.unwrap().backend, "CUDA_IPC");
        } else {
            assert!(ipc.unwrap_err().contains("rebuild with feature cuda"));
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
        let vram = parse("--initiator_seg_type VRAM");
        if cfg!(feature = "cuda") {
            assert_eq!(vram.unwrap().initiator_seg, MemKind::Vram);
        } else {
            assert!(vram.unwrap_err().contains("built without feature cuda"));
        }
        let o = parse("--backend VERBS --device_list mlx5_1,mlx5_0").unwrap();
        assert_eq!(o.params(Side::Initiator, None)["device"], "mlx5_1");
        let o = parse("--backend VERBS --backend_param device=rxe0 --device_list mlx5_1").unwrap();
        assert_eq!(o.params(Side::Target, None)["device"], "rxe0");
        let o = parse("--device_list mlx5_1").unwrap();
        assert_eq!(o.params(Side::Initiator, Some("shm"))["provider"], "shm");
        assert!(!o.params(Side::Initiator, None).contains_key("device"));
        let e = err("--device_list ,");
        assert!(e.contains("at least one device"), "{e}");
    }

    /// NIXL's defaults, and only the part of the buffer the sweep touches allocated.
    #[test]
    fn upstream_defaults() {
        let o = parse("").unwrap();
        assert_eq!(o.backend, "LIBFABRIC");
        assert_eq!(o.op, XferOp::Write);
        assert_eq!(o.total_buffer_size, 8 << 30);
        assert_eq!((o.start_block_size, o.max_block_size), (4096, 64 << 20));
        assert_eq!((o.start_batch_size, o.max_batch_size), (1, 1));
        assert_eq!((o.num_iter, o.warmup_iter), (1000, 100));
        assert_eq!((o.large_blk_iter_ftr, o.num_threads), (16, 1));
        assert!(!o.check_consistency && !o.recreate_xfer && !o.enable_vmm);
        assert!(o.progress_thread);
        assert_eq!(o.progress, ProgressMode::Auto);
        assert_eq!(o.buffer_bytes(), 128 << 20);
        let o = parse("--max_block_size 65536").unwrap();
        assert_eq!(o.buffer_bytes(), 128 << 10);
        let o = parse("--max_block_size 1M --max_batch_size 4 --num_threads 2").unwrap();
        assert_eq!(
            (o.per_thread_bytes(), o.buffer_bytes()),
            (8 << 20, 16 << 20)
        );
        // A buffer smaller than what the sweep would touch: all of it, split by thread.
        let o =
            parse("--total_buffer_size 4M --max_block_size 1M --max_batch_size 4 --num_threads 2")
                .unwrap();
        assert_eq!((o.per_thread_bytes(), o.buffer_bytes()), (2 << 20, 4 << 20));
        let e = err("--total_buffer_size 4K --start_block_size 8K --max_block_size 8K");
        assert!(e.contains("less than the first point"), "{e}");
    }

    /// gflags' forms reach the options alike.
    #[test]
    fn gflags_forms() {
        for line in [
            "--check_consistency",
            "--check_consistency=true",
            "--check-consistency",
            "-check_consistency",
            "--check_consistency=1",
        ] {
            assert!(parse(line).unwrap().check_consistency, "{line}");
        }
        for line in [
            "",
            "--check_consistency=false",
            "--nocheck_consistency",
            "--no-check-consistency",
            "--check_consistency --check_consistency=false",
        ] {
            assert!(!parse(line).unwrap().check_consistency, "{line}");
        }
        for line in [
            "--start_block_size 8192",
            "--start_block_size=8192",
            "--start-block-size 8192",
            "--start-block_size=8K",
            "-start_block_size 8KiB",
            "--start_block_size 4096 --start_block_size 8192",
        ] {
            assert_eq!(parse(line).unwrap().start_block_size, 8192, "{line}");
        }
        for (line, mode) in [
            ("--progress", ProgressMode::Always),
            ("--progress=true", ProgressMode::Always),
            ("--no_progress", ProgressMode::Never),
            ("--noprogress", ProgressMode::Never),
            ("--progress=false", ProgressMode::Never),
        ] {
            assert_eq!(parse(line).unwrap().progress, mode, "{line}");
        }
        // A boolean takes no separate word: `false` is a stray argument.
        let e = err("--check_consistency false");
        assert!(e.contains("unexpected argument 'false'"), "{e}");
        let e = err("--check_consistency=maybe");
        assert!(e.contains("true or false"), "{e}");
        let e = err("--max-blok-size 5");
        assert!(e.contains("'--max_block_size'"), "a suggestion: {e}");
    }

    #[test]
    fn counts_and_sizes_are_checked() {
        for (line, want) in [
            ("--num_iter 0", "must be at least 1"),
            ("--num_iter -1", "--num_iter"),
            ("--num_threads 0", "must be at least 1"),
            ("--large_blk_iter_ftr 0", "must be at least 1"),
            ("--start_batch_size 0", "must be at least 1"),
            ("--num_iter x", "not a whole number"),
            ("--total_buffer_size 1.5G", "not a size"),
            ("--max_block_size 99999999999999999999", "not a size"),
            ("--start_block_size 0", "at least 1"),
            (
                "--start_block_size 8K --max_block_size 4K",
                "at most --max_block_size",
            ),
            (
                "--start_batch_size 4 --max_batch_size 2",
                "exceeds --max_batch_size",
            ),
            ("--op_type COPY", "not READ or WRITE"),
            ("--backend_param novalue", "not KEY=VALUE"),
            ("--plot out.jpg", "name it FILE.png"),
            ("--scheme", "a value is required"),
        ] {
            let e = err(line);
            assert!(e.contains(want), "{line}: {e}");
        }
        // Sizes far beyond the machine parse: the run checks them against its memory.
        let o = parse("--total_buffer_size 10000000000000").unwrap();
        assert_eq!(o.total_buffer_size, 10_000_000_000_000);
    }

    #[test]
    fn backends_are_checked_before_anything_starts() {
        let e = err("--backend UCX|FOO");
        assert!(e.contains("no such backend"), "{e}");
        for name in nixl::Agent::available_backends() {
            assert!(e.contains(name), "{e} lists {name}");
        }
        let o = parse("--backend ucx").unwrap();
        assert_eq!(o.backend, "LIBFABRIC");
        assert!(
            o.notes[0].contains("LIBFABRIC runs in its place"),
            "{:?}",
            o.notes
        );
        let e = err("--backend HF3FS");
        assert!(e.contains("--backend FILE"), "{e}");
    }

    #[test]
    fn roles_and_their_addresses() {
        let e = err("--target_address 127.0.0.1:5");
        assert!(e.contains("add --role initiator"), "{e}");
        let e = err("--listen 127.0.0.1:5");
        assert!(e.contains("add --role target"), "{e}");
        let e = err("--role initiator");
        assert!(e.contains("needs --target_address"), "{e}");
        let e = err("--role initiator --target_address 127.0.0.1:5 --listen 127.0.0.1:6");
        assert!(e.contains("--listen is the target's"), "{e}");
        let e = err("--role target --target_address 127.0.0.1:5");
        assert!(e.contains("a target listens at --listen"), "{e}");
        let e = err("--role server");
        assert!(e.contains("initiator, target"), "{e}");
        let e = err("--role target --backend LOCAL");
        assert!(e.contains("without --role"), "{e}");
        let e = err("--target_address nowhere");
        assert!(e.contains("--target_address"), "{e}");
        let o = parse("--role initiator --target_address 127.0.0.1:5").unwrap();
        assert_eq!(o.role, Some(Side::Initiator));
        assert_eq!(o.target_address, Some("127.0.0.1:5".parse().unwrap()));
        let o = parse("--role target --listen 0.0.0.0:7000").unwrap();
        assert_eq!(o.role, Some(Side::Target));
        assert_eq!(o.listen, "0.0.0.0:7000".parse().unwrap());
    }

    #[test]
    fn upstream_options_at_their_only_values() {
        let o = parse(
            "--scheme pairwise --mode sg --worker_type nixl --num_initiator_dev 1 \
             --num_target_dev=1 --pipeline_depth 1 --randomize_location_mode none \
             --randomize_location_mode_seed 7 --use_device_api=false --prepared_xfer \
             --progress_threads 0",
        )
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
            ("--pipeline_depth 4", "one request in flight"),
            ("--randomize_location_mode blockaligned", "blocks in order"),
            ("--use_device_api", "UCX's GPU device API"),
            ("--progress_threads 2", "num_rails"),
        ] {
            let e = err(line);
            assert!(e.contains(want), "{line}: {e}");
        }
    }

    /// Upstream flags this nixlbench has no use for are refused by name, each with why.
    #[test]
    fn refused_upstream_flags_name_their_reason() {
        for (name, kind, why) in REFUSED {
            let line = match kind {
                Kind::Bool => format!("--{name}"),
                Kind::Value => format!("--{name} x"),
            };
            let e = err(&line);
            assert_eq!(e, format!("--{name}: {why}"));
            // Any form of the name.
            let dashed = format!("--{}=1", name.replace('_', "-"));
            assert!(err(&dashed).starts_with(&format!("--{name}: ")), "{dashed}");
        }
        let help = after_long_help();
        for (name, _, _) in REFUSED {
            assert!(help.contains(&format!("--{name}")), "help lists --{name}");
        }
    }

    #[test]
    fn honoured_upstream_flags() {
        assert!(!parse("--enable_pt=false").unwrap().progress_thread);
        assert!(!parse("--noenable_pt").unwrap().progress_thread);
        assert!(parse("--enable_pt").unwrap().progress_thread);
        assert!(
            !parse("--enable_pt=false")
                .unwrap()
                .agent_config(None)
                .progress_thread
        );
        assert!(parse("--recreate_xfer").unwrap().recreate_xfer);
        assert!(parse("--prepared_xfer=false").is_ok());
        let vmm = parse("--enable_vmm");
        if cfg!(feature = "cuda") {
            assert!(vmm.unwrap().enable_vmm);
        } else {
            assert!(vmm.unwrap_err().contains("built without feature cuda"));
        }
    }

    #[test]
    fn help_and_version_print() {
        for (line, want) in [
            ("--help", "Differences from NIXL's nixlbench"),
            ("--help", "--obj_bucket_name"),
            ("-h", "--total_buffer_size"),
            ("--version", "nixlbench "),
            ("-V", "nixlbench "),
        ] {
            match parse_args(&args(line)) {
                Err(Stop::Print(text)) => assert!(text.contains(want), "{line}: {text}"),
                other => panic!("{line}: {other:?}"),
            }
        }
    }

    /// A temporary file removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, text: &str) -> Self {
            let path =
                std::env::temp_dir().join(format!("nixlbench-{name}-{}.toml", std::process::id()));
            std::fs::write(&path, text).unwrap();
            Self(path)
        }
        fn arg(&self) -> String {
            format!("--config_file {}", self.0.display())
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn config_file_under_the_command_line() {
        let f = TempFile::new(
            "config",
            "# upstream's format\nbackend = \"LOCAL\"\nmax_block_size = 65536\n\
             check_consistency = true\nop_type = \"READ\"\nnum_iter = 10\n",
        );
        let o = parse(&f.arg()).unwrap();
        assert_eq!(o.backend, "LOCAL");
        assert_eq!(o.max_block_size, 65536);
        assert!(o.check_consistency);
        assert_eq!((o.op, o.num_iter), (XferOp::Read, 10));
        // The command line wins, wherever it names the file.
        let o = parse(&format!("--max_block_size 8192 {} --num_iter 3", f.arg())).unwrap();
        assert_eq!(
            (o.max_block_size, o.num_iter, o.backend.as_str()),
            (8192, 3, "LOCAL")
        );
        let o = parse(&format!("{} --nocheck_consistency", f.arg())).unwrap();
        assert!(!o.check_consistency);
        for (name, text, want) in [
            (
                "unknown",
                "no_such_flag = 1\n",
                "`no_such_flag` is not a nixlbench option",
            ),
            (
                "refused",
                "obj_bucket_name = \"b\"\n",
                "--obj_bucket_name: NIXL's object-store",
            ),
            ("bad", "backend = \n", "not TOML"),
            ("array", "device_list = [\"a\"]\n", "is a array"),
            ("value", "num_iter = 0\n", "must be at least 1"),
            ("nested", "config_file = \"x\"\n", "cannot name another"),
        ] {
            let f = TempFile::new(name, text);
            let e = err(&f.arg());
            assert!(e.contains(want), "{name}: {e}");
        }
        let e = err("--config_file /nonexistent/nixlbench.toml");
        assert!(e.contains("/nonexistent/nixlbench.toml"), "{e}");
    }

    /// NIXL's documented command lines (nixlbench's README, the GPUNETIO plugin's
    /// README) parse: each runs here, or is refused for a reason it names (a backend
    /// or a flag this nixl does not have, a feature this build lacks), never for its
    /// syntax.
    #[test]
    fn upstream_documented_lines_parse() {
        let posix_config = TempFile::new(
            "readme",
            "etcd_endpoints=\"http://localhost:2379\"\nbackend=\"POSIX\"\n\
             filepath=\"/mnt/test\"\nposix_api_type=\"AIO\"\nmax_block_size=2097152\n",
        );
        let etcd = cfg!(feature = "etcd");
        let cuda = cfg!(feature = "cuda");
        let config_line = posix_config.arg();
        let lines: &[(&str, Option<&str>)] = &[
            ("--etcd_endpoints http://localhost:2379 --backend UCX", (!etcd).then_some("feature etcd")),
            (
                "--etcd_endpoints http://etcd-server:2379 --backend UCX --initiator_seg_type VRAM \
                 --target_seg_type VRAM",
                (!cuda).then_some("feature cuda").or((!etcd).then_some("feature etcd")),
            ),
            ("--etcd_endpoints http://etcd-server:2379 --backend GDS --filepath /mnt/storage/testfile", Some("GDS")),
            (
                "--etcd_endpoints http://etcd-server:2379 --backend OBJ --obj_bucket_name my-bucket \
                 --obj_access_key KEY --obj_secret_key SECRET",
                Some("object-store"),
            ),
            (
                "--etcd_endpoints http://etcd-server:2379 --backend UCX --num_threads 4 --enable_pt \
                 --progress_threads 2",
                Some("--progress_threads 2"),
            ),
            (
                "--etcd_endpoints http://localhost:2379 --backend POSIX --filepath /mnt/test \
                 --posix_api_type AIO --max_block_size 2097152",
                Some("POSIX"),
            ),
            (&config_line, Some("POSIX")),
            ("--backend GDS --filepath /mnt/storage/testfile", Some("GDS")),
            (
                "--etcd_endpoints http://etcd-server:2379 --backend UCX --device_list mlx5_0,mlx5_1",
                (!etcd).then_some("feature etcd"),
            ),
            (
                "--etcd_endpoints http://etcd-server:2379 --backend GPUNETIO --gpunetio_device_list 0,1",
                (!cuda).then_some("feature cuda").or((!etcd).then_some("feature etcd")),
            ),
            ("--backend GDS --filepath /mnt/storage/testfile --storage_enable_direct", Some("GDS")),
            (
                "--backend GDS --filepath /mnt/storage/testfile --gds_batch_pool_size 64 \
                 --gds_batch_limit 256",
                Some("GDS"),
            ),
            ("--backend GDS_MT --filepath /mnt/storage/testfile --gds_mt_num_threads 8", Some("GDS")),
            ("--backend POSIX --filepath /mnt/storage/testfile --posix_api_type AIO", Some("POSIX")),
            (
                "--backend POSIX --filepath /mnt/storage/testfile --posix_api_type URING \
                 --storage_enable_direct",
                Some("POSIX"),
            ),
            (
                "--backend=GUSLI --device_list=11:F:./store0.bin --num_initiator_dev=1 \
                 --num_target_dev=1 --op_type=WRITE",
                Some("GUSLI"),
            ),
            (
                "--backend=GUSLI --device_list=27:K:/dev/nvme0n1 --gusli_device_security=sec=0x7 \
                 --num_initiator_dev=1 --num_target_dev=1 --op_type=READ",
                Some("GUSLI"),
            ),
            (
                "--backend=GUSLI --device_list=11:F:./store0.bin,14:K:/dev/zero,27:K:/dev/nvme0n1 \
                 --gusli_device_security=sec=0x3,sec=0x71,sec=0x7 --num_initiator_dev=3 \
                 --num_target_dev=3 --op_type=WRITE",
                Some("GUSLI"),
            ),
            (
                "--backend=GUSLI --device_list=20:N:t192.168.1.100 --gusli_device_security=sec=0x10 \
                 --num_initiator_dev=1 --num_target_dev=1 --op_type=WRITE",
                Some("GUSLI"),
            ),
            // The GPUNETIO plugin's README.
            (
                "--etcd-endpoints http://etc_server_ip:2379 --backend=GPUNETIO \
                 --initiator_seg_type=VRAM --target_seg_type=DRAM --runtime_type=ETCD \
                 --gpunetio_device_list=0 --device_list=mlx5_0 --start_batch_size=512 \
                 --max_batch_size=512 --total_buffer_size=34359738368",
                (!cuda).then_some("feature cuda").or((!etcd).then_some("feature etcd")),
            ),
        ];
        for (line, refused) in lines {
            match (parse(line), refused) {
                (Ok(_), None) => {}
                (Err(e), Some(why)) => {
                    assert!(e.contains(why), "{line}: {e}");
                    for syntax in [
                        "unexpected argument",
                        "invalid value",
                        "a value is required",
                    ] {
                        assert!(!e.contains(syntax), "{line}: {e}");
                    }
                }
                (got, want) => panic!("{line}: {got:?}, expected refusal {want:?}"),
            }
        }
        // Upstream's GPUNETIO line sizes a 32 GiB buffer, all of it touched.
        if cuda && etcd {
            let o = parse(lines.last().unwrap().0).unwrap();
            assert_eq!(o.buffer_bytes(), 32 << 30);
        }
    }

    /// What upstream's nixlbench puts in GPUNETIO's parameters, per side.
    #[cfg(feature = "cuda")]
    #[test]
    fn gpunetio_parameters_from_the_flags() {
        let o = parse(
            "--backend gpunetio --initiator_seg_type VRAM --target_seg_type VRAM \
             --gpunetio_device_list 0,1 --device_list mlx5_0 --gpunetio_oob_list eth0,eth1",
        )
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
        let o =
            parse("--backend GPUNETIO --target_seg_type VRAM --gpunetio_device_list 3").unwrap();
        assert_eq!((o.initiator_gpu, o.target_gpu), (3, 3));
        let o = parse("--backend GPUNETIO --target_seg_type VRAM").unwrap();
        assert_eq!(
            pairs(&o.params(Side::Target, None)),
            [s("gpu_devices", "0")]
        );
        // The side flags agree with the list, or set the GPU without it.
        let o = parse("--backend GPUNETIO --target_seg_type VRAM --target_gpu 2").unwrap();
        assert_eq!(o.params(Side::Target, None)["gpu_devices"], "2");
        assert_eq!(o.params(Side::Initiator, None)["gpu_devices"], "0");
        let e = err(
            "--backend GPUNETIO --target_seg_type VRAM --gpunetio_device_list 0,1 --target_gpu 0",
        );
        assert!(e.contains("--target_gpu 0 disagrees"), "{e}");
        // --backend_param overrides what the flags set.
        let o = parse(
            "--backend GPUNETIO --target_seg_type VRAM --device_list mlx5_0 \
             --backend_param network_devices=mlx5_3 --backend_param cuda_streams=8",
        )
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
        // A peer's DRAM goes through the NIC path.
        let o = parse("--backend GPUNETIO --target_seg_type DRAM").unwrap();
        assert_eq!(o.target_seg, MemKind::Dram);
        // Upstream's documented line, no segment types: DRAM -> VRAM, GPUs 0 and 1.
        let o = parse("--backend GPUNETIO --gpunetio_device_list 0,1").unwrap();
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
            assert!(e.contains("rebuild with feature cuda"), "{e}");
        }
    }

    #[test]
    fn storage_options() {
        let r = parse("--backend file --filepath /tmp/x --num_files 3 --hf3fs_mount /tmp/m");
        if !cfg!(feature = "file") {
            assert!(r.unwrap_err().contains("rebuild with feature file"));
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
        assert!(!o.storage_direct);
        assert!(
            parse("--backend FILE --storage_enable_direct")
                .unwrap()
                .storage_direct
        );
        for (line, want) in [
            (
                "--backend FILE --target_seg_type DRAM",
                "--target_seg_type FILE",
            ),
            ("--backend FILE --role target", "runs in one process"),
            ("--backend FILE --num_files 0", "at least 1"),
            ("--backend FILE --initiator_seg_type FILE", "DRAM or VRAM"),
            ("--storage_enable_direct", "belongs to storage runs"),
        ] {
            let e = err(line);
            assert!(e.contains(want), "{line}: {e}");
        }
    }

    #[test]
    fn runtime_choice() {
        let etcd = parse("--etcd_endpoints http://h:2379,http://g:2379");
        let etcd_dash = parse("--etcd-endpoints=http://h:2379 --benchmark_group g1");
        let etcd_default = parse("--runtime_type etcd --etcd_wait 5");
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
            parse("--runtime_type socket --role target")
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
        assert!(e.contains("must be at least 1"), "{e}");
    }
}
