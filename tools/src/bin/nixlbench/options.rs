//! The command line: nixlbench's option names, defaults and checks.

use nixl::{BackendParams, MemKind, XferOp};
use std::net::SocketAddr;

pub(crate) const USAGE: &str = "usage: nixlbench [options]
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
    pub(crate) role: Option<String>,
    pub(crate) listen: SocketAddr,
    pub(crate) target_address: Option<SocketAddr>,
}

impl Options {
    pub(crate) fn is_libfabric(&self) -> bool {
        self.backend == "LIBFABRIC"
    }

    /// The provider the user named, if any.
    pub(crate) fn user_provider(&self) -> Option<&str> {
        self.backend_params.get("provider").map(String::as_str)
    }

    /// Backend parameters, with `provider` set (LIBFABRIC) and `--device_list` mapped.
    pub(crate) fn params(&self, provider: Option<&str>) -> BackendParams {
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
    pub(crate) fn device(&self) -> Option<&str> {
        self.device_list
            .first()
            .map(String::as_str)
            .filter(|d| *d != "all")
    }
}

pub(crate) fn parse_seg_type(key: &str, v: &str) -> Result<MemKind, String> {
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
#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
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
}
