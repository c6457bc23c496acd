//! `nixlbench`: transfer bandwidth and latency of the `nixl` agent, with the option names
//! and result columns of NIXL's nixlbench.
//!
//! # Runtimes: how the two sides find each other
//! - **SOCKET** (the default, ours): with no role given it starts its own target as a
//!   second process on loopback and drives it (the README's main job). With `--role
//!   target --listen ADDR` and `--role initiator --target_address ADDR` the two sides
//!   run on two hosts, exchanging metadata through the target's listener.
//! - **ETCD** (feature `etcd`; upstream's default, chosen here by `--etcd_endpoints URL`
//!   or `--runtime_type ETCD`): two processes started alike claim ranks in etcd (rank 0
//!   initiator, rank 1 target, a third refused) and exchange agent metadata through
//!   `nixl::etcd` (`etcd_runtime`, `etcd_run`).
//!
//! `LOCAL` moves data inside one agent, so with `--backend LOCAL` both sides live in one
//! process and no runtime is needed. So does `FILE` (feature `file`): storage runs move
//! blocks between the agent's memory and files it registered, through an hf3fs-gdr
//! daemon (`storage`).
//!
//! Memory is DRAM or, with feature `cuda`, VRAM (`gpunetio::DeviceBuffer`) on either side.
//! `--backend GPUNETIO` (feature `cuda`) gets its parameters from nixlbench's flags as
//! upstream builds them (`options::Options::params`): `gpu_devices` the side's GPU,
//! `network_devices` the side's `--device_list` entry, `oob_interface` the side's
//! `--gpunetio_oob_list` entry; `--backend_param` overrides each.
//!
//! # LIBFABRIC provider
//! NIXL's UCX picks shared memory when both agents share a host; LIBFABRIC's `shm` is our
//! equivalent (faster than `tcp;ofi_rxm` over loopback: `docs/BENCHMARKS.md`). The initiator
//! chooses the provider, in this order: the one the target was started with
//! (`--backend_param provider=…` on the target), the user's `--backend_param provider=…`,
//! `shm` when the target is on this host (SOCKET: its address is loopback, unspecified or
//! one of this host's interface addresses; ETCD: its boot id is ours), else NIXL's
//! priority list. A target started without a
//! provider waits for the initiator's choice: the initiator's agent is named
//! `nixlbench-initiator@PROVIDER`, and the target creates its backend with the provider
//! of the first such agent whose metadata reaches it (a target with a provider is named
//! `nixlbench-target@PROVIDER`, which the initiator reads first).

use crate::initiator::{initiator_mem, run_in_process, run_initiator};
use crate::options::{parse_args, Options, Runtime, Side};
use crate::plot::{check_plot_path, plot};
use crate::sweep::Row;
use crate::target::run_target;

#[cfg(feature = "etcd")]
mod etcd_run;
#[cfg(feature = "etcd")]
mod etcd_runtime;
mod initiator;
mod mem;
mod options;
mod plot;
mod progress;
mod provider;
mod setup;
#[cfg(feature = "file")]
mod storage;
mod sweep;
mod target;
#[cfg(feature = "cuda")]
mod vram_pattern;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};

const TARGET: &str = "nixlbench-target";
const INITIATOR: &str = "nixlbench-initiator";
/// Set in the self-launched target's environment: it stays quiet.
const CHILD_ENV: &str = "NIXLBENCH_CHILD";

fn quiet() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

fn main() {
    tools::cli::init_tracing();
    let args: Vec<String> = std::env::args().skip(1).collect();
    #[cfg(feature = "file")]
    if args.first().map(String::as_str) == Some(storage::DAEMON_ARG) {
        if let Err(e) = storage::serve(&args[1..]) {
            tools::cli::fail("nixlbench: daemon", e);
        }
        return;
    }
    let o = parse_args(&args).unwrap_or_else(|stop| stop.exit("nixlbench"));
    if !quiet() {
        for note in &o.notes {
            eprintln!("nixlbench: {note}");
        }
    }
    if let Err(e) = preflight(&o) {
        tools::cli::fail("nixlbench", e);
    }
    let result = match (&o.runtime, o.role, o.target_address) {
        #[cfg(feature = "etcd")]
        (Runtime::Etcd { .. }, _, _) => etcd_run::run(&o),
        (_, Some(Side::Target), _) => run_target(&o).map(|_| None),
        (_, Some(Side::Initiator), Some(addr)) => run_initiator(&o, addr, None).map(Some),
        // The options refuse an initiator without a target address.
        (_, Some(Side::Initiator), None) => {
            Err("--role initiator needs --target_address ADDR".into())
        }
        (_, None, _) if o.backend == "LOCAL" => run_in_process(&o).map(Some),
        #[cfg(feature = "file")]
        (_, None, _) if o.is_storage() => storage::run(&o).map(Some),
        (_, None, _) => run_both(&o, &args).map(Some),
    };
    match result {
        Ok(Some(rows)) => {
            if let Some(path) = &o.plot {
                if let Err(e) = plot(path, &rows, &o) {
                    tools::cli::fail("nixlbench: plot", e);
                }
            }
        }
        Ok(None) => {}
        Err(e) => tools::cli::fail("nixlbench", e),
    }
}

/// What can be found wrong before anything starts: the plot's path, and whether this
/// process's buffers fit (its GPUs first, then its DRAM).
fn preflight(o: &Options) -> Result<(), String> {
    if let Some(path) = &o.plot {
        // The target child writes no plot (the initiator does).
        if !quiet() {
            check_plot_path(path)?;
        }
    }
    let sides: &[&[Side]] = match (&o.runtime, o.role) {
        // Which side this process plays is decided later: each must fit alone.
        (Runtime::Etcd { .. }, _) => &[&[Side::Initiator], &[Side::Target]],
        (_, Some(Side::Target)) => &[&[Side::Target]],
        (_, Some(Side::Initiator)) => &[&[Side::Initiator]],
        // A storage run's target is files.
        _ if o.is_storage() => &[&[Side::Initiator]],
        // Both sides on this machine (LOCAL, or the target a child process).
        _ => &[&[Side::Initiator, Side::Target]],
    };
    // The devices first: a wrong name is the user's to fix whatever the memory.
    check_devices(o, sides.concat().as_slice())?;
    for sides in sides {
        mem::check_fits(o, sides).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The RDMA devices that `--device_list` (or the backend parameter it sets) names for
/// `sides`, for the backends that open one: VERBS (`device`) and GPUNETIO
/// (`network_devices`). LIBFABRIC takes no device from it (it prints the list, as NIXL's
/// nixlbench does: its providers pick their own interfaces), so nothing is checked there.
fn check_devices(o: &Options, sides: &[Side]) -> Result<(), String> {
    let (key, without) = match o.backend.as_str() {
        "VERBS" => (
            "device",
            "opens this machine's first RDMA device without --device_list",
        ),
        "GPUNETIO" => (
            "network_devices",
            "runs without --device_list: peers on this node through CUDA IPC or a CPU \
             proxy over libfabric (tcp;ofi_rxm), peers on other nodes through the proxy",
        ),
        _ => return Ok(()),
    };
    let from_param = o.backend_params.contains_key(key);
    let mut available: Option<Vec<String>> = None;
    for &side in sides {
        let params = o.params(side, None);
        let Some(names) = params.get(key) else {
            continue;
        };
        for name in names.split([',', ' ']).filter(|n| !n.is_empty()) {
            let available = available.get_or_insert_with(tools::rdma::devices);
            let given = if from_param {
                format!("--backend_param {key}={names}")
            } else {
                format!("--device_list {}", o.device_list.join(","))
            };
            tools::rdma::check_device(&given, name, &o.backend, available, without)?;
        }
    }
    Ok(())
}

/// Starts the target as a child process on loopback (with every option given, so its
/// `--target_seg_type`, `--target_gpu` and backend parameters) and runs the initiator
/// against it. The initiator's buffer is set up while the target sets up its own.
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
    let Some(stdout) = child.stdout.take() else {
        let _ = child.kill();
        let _ = child.wait();
        return Err("the target's standard output was not captured".into());
    };
    let (local, announced) = std::thread::scope(|s| {
        let local = s.spawn(|| initiator_mem(o));
        let mut lines = BufReader::new(stdout).lines();
        let announced = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(a) = line.strip_prefix("NIXLBENCH_TARGET ") {
                        break a.parse::<SocketAddr>().map_err(|e| e.to_string());
                    }
                }
                _ => break Err("the target exited before announcing its address".to_string()),
            }
        };
        let local = local
            .join()
            .unwrap_or_else(|_| Err("setting up the initiator's buffer panicked".into()));
        (local, announced)
    });
    let rows = match (local, announced) {
        (Ok(local), Ok(addr)) => run_initiator(o, addr, Some(local)),
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
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
