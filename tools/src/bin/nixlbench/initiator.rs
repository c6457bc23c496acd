//! The initiator side: its agent and backend, the target's metadata, the run.

use crate::mem::{register, Init, Mem, INITIATOR_FILL, TARGET_SEED};
use crate::options::{Options, Side};
use crate::provider::{is_this_host, provider_of, with_provider};
use crate::setup::Setup;
use crate::sweep::{describe_remote, remote_mem, sweep, Peer, RemoteMem, Row};
use crate::{quiet, INITIATOR};
use nixl::Agent;
use std::net::SocketAddr;
use std::sync::Mutex;

fn new_agent(o: &Options, name: String) -> Result<Agent, String> {
    Agent::new(name, o.agent_config(None)).map_err(|e| e.to_string())
}

/// The initiator's agent for the target listening at `target_addr` (SOCKET runtime).
fn initiator_agent(o: &Options, target_addr: SocketAddr) -> Result<(Agent, String), String> {
    if !o.is_libfabric() {
        return initiator_agent_for(o, None, false);
    }
    // Which provider the target uses, if it was given one: its name says.
    let probe = new_agent(o, "nixlbench-probe".into())?;
    let target_name = probe
        .fetch_remote_metadata(target_addr)
        .map_err(|e| format!("reaching the target at {target_addr}: {e}"))?;
    drop(probe);
    initiator_agent_for(o, provider_of(&target_name), is_this_host(target_addr.ip()))
}

/// The initiator's agent, with its backend (and, for LIBFABRIC, the provider chosen as
/// the module docs say and why), for a target that uses `target_provider` (if it was
/// given one) and is on this host or not.
pub(crate) fn initiator_agent_for(
    o: &Options,
    target_provider: Option<&str>,
    target_on_this_host: bool,
) -> Result<(Agent, String), String> {
    if !o.is_libfabric() {
        let agent = new_agent(o, INITIATOR.into())?;
        agent
            .create_backend(&o.backend, &o.params(Side::Initiator, None))
            .map_err(|e| format!("{}: {e}", o.backend))?;
        return Ok((agent, String::new()));
    }
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
            if target_on_this_host {
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
        let agent = new_agent(o, with_provider(INITIATOR, Some(&provider)))?;
        match agent.create_backend(&o.backend, &o.params(Side::Initiator, Some(&provider))) {
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
pub(crate) fn wait_for_target(
    agent: &Agent,
    addr: SocketAddr,
    o: &Options,
) -> Result<String, String> {
    tools::backend::wait_for_target(
        agent,
        addr,
        &format!(
            "{} reaches here (its --target_seg_type may not be supported by this backend)",
            o.backend
        ),
    )
}

/// The initiator's buffer, its setup stages printed (each long enough to matter).
pub(crate) fn initiator_mem(o: &Options) -> Result<Mem, String> {
    let setup = Setup::new("nixlbench", !quiet());
    let mem = Mem::for_side_init(o, Side::Initiator, Init::Byte(INITIATOR_FILL), &setup)?;
    // Ends (and prints) the allocation's stage.
    setup.finish("set up");
    Ok(mem)
}

/// The initiator against the target at `target_addr`, with its buffer `local` if it was
/// set up already (while the target set up its own), else set up here.
pub(crate) fn run_initiator(
    o: &Options,
    target_addr: SocketAddr,
    local: Option<Mem>,
) -> Result<Vec<Row>, String> {
    if o.backend == "LOCAL" {
        return Err("LOCAL moves data inside one agent: run without --role".into());
    }
    let (agent, how) = initiator_agent(o, target_addr)?;
    let local = match local {
        Some(mem) => mem,
        None => initiator_mem(o)?,
    };
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
    let same_host = is_this_host(target_addr.ip());
    let at = target_addr.to_string();
    measure(o, &agent, &how, &local, &target, &at, same_host)
}

/// The sweep against the target `target` (reached at `at`, on this host or not), once
/// both sides have each other's metadata; tells the target DONE at the end.
pub(crate) fn measure(
    o: &Options,
    agent: &Agent,
    how: &str,
    local: &Mem,
    target: &str,
    at: &str,
    same_host: bool,
) -> Result<Vec<Row>, String> {
    let remote = remote_mem(agent, target)?;
    let peer = Peer::Remote {
        name: target.to_string(),
        check_lock: Mutex::new(()),
    };
    let how = match o.backend.as_str() {
        #[cfg(feature = "cuda")]
        "GPUNETIO" => gpunetio_path(o, agent, target, local.kind(), remote, same_host),
        // VRAM over LIBFABRIC: the backend names its path to this target (the provider,
        // and for a target on this host whether VRAM <-> DRAM is one direct copy).
        "LIBFABRIC"
            if local.kind() == nixl::MemKind::Vram || remote.kind == nixl::MemKind::Vram =>
        {
            let said = agent
                .backends()
                .iter()
                .find(|b| b.name() == "LIBFABRIC")
                .and_then(|b| b.peer_transport(target));
            match said {
                Some(path) if how.is_empty() => format!("(path: {path})"),
                Some(path) => format!("{how} (path: {path})"),
                None => how.to_string(),
            }
        }
        _ => {
            let _ = same_host; // only GPUNETIO's path depends on it
            how.to_string()
        }
    };
    let header = format!(
        "nixlbench: backend {}{}, {:?}, {} -> {}, {} thread(s), device_list {}, target `{target}` at {at}",
        o.backend,
        if how.is_empty() { String::new() } else { format!(" {how}") },
        o.op,
        local.describe(),
        describe_remote(remote),
        o.num_threads,
        o.device_list.join(","),
    );
    let rows = sweep(agent, &peer, local, remote, o, &header)?;
    agent
        .gen_notif(target, b"DONE")
        .map_err(|e| e.to_string())?;
    Ok(rows)
}

/// Which of GPUNETIO's paths carries the transfers to `target`, for the header: for
/// this side's VRAM and a same-host target's DRAM, the backend's own word
/// ([`nixl::backend::Backend::peer_transport`]: a direct peer copy through CUDA IPC, or
/// the CPU proxy over which provider); else its rule (module docs of
/// `nixl::backends::gpunetio`) applied to this run's parameters: intra-node (CUDA IPC)
/// for a target on this host whose memory is VRAM the backend's GPU reaches (the same
/// GPU, or peer access to the target's), unless `nic_handler=cpu_proxy`; otherwise the
/// NIC path, a CPU proxy over a libfabric provider (no ConnectX NIC is driven: the
/// native mlx5 handler is not used).
#[cfg(feature = "cuda")]
fn gpunetio_path(
    o: &Options,
    agent: &Agent,
    target: &str,
    local_kind: nixl::MemKind,
    remote: crate::sweep::RemoteMem,
    same_host: bool,
) -> String {
    if same_host && local_kind == nixl::MemKind::Vram && remote.kind == nixl::MemKind::Dram {
        let said = agent
            .backends()
            .iter()
            .find(|b| b.name() == "GPUNETIO")
            .and_then(|b| b.peer_transport(target));
        if let Some(path) = said {
            return format!("(path: {path})");
        }
    }
    let params = o.params(Side::Initiator, None);
    let handler = params.get("nic_handler").map_or("auto", String::as_str);
    let device = match params.get("network_devices") {
        Some(d) => format!("network device {d} recorded, not driven"),
        None => "no network device".to_string(),
    };
    let (ours, theirs) = (o.gpu(Side::Initiator), remote.dev_id as usize);
    let mut why = if !same_host {
        "the target is on another host".to_string()
    } else if handler == "cpu_proxy" {
        "nic_handler=cpu_proxy".to_string()
    } else if remote.kind != nixl::MemKind::Vram {
        "the target's memory is not VRAM".to_string()
    } else {
        match gpu_link(ours, theirs) {
            Ok(link) => {
                return format!(
                    "(path: intra-node, CUDA IPC: the target's VRAM (GPU {theirs}) mapped here \
                     and written by the transfer kernel on GPU {ours}, {link})"
                )
            }
            Err(no) => no,
        }
    };
    if handler == "intra_node" {
        why += "; nic_handler=intra_node has no other path, so the transfers fail";
    }
    let provider = params
        .get("provider")
        .map_or(nixl::backends::gpunetio::DEFAULT_PROVIDER, String::as_str);
    format!("(path: CPU proxy over libfabric {provider}: {why}; no ConnectX NIC driven, {device})")
}

/// How GPU `ours` reaches GPU `theirs`'s memory (`Err`: it does not, and why).
#[cfg(feature = "cuda")]
fn gpu_link(ours: usize, theirs: usize) -> Result<String, String> {
    if ours == theirs {
        return Ok("same GPU".into());
    }
    let open = |g: usize| gpunetio::Gpu::open(g).map_err(|e| format!("GPU {g}: {e}"));
    let topology = gpunetio::gpu_mem::peer_topology(&open(ours)?, &open(theirs)?)
        .map_err(|e| format!("GPU {ours} -> GPU {theirs}: {e}"))?;
    if topology.can_access_peer {
        Ok(format!("peer access over {}", topology.link))
    } else {
        Err(format!(
            "GPU {ours} has no peer access to the target's GPU {theirs}"
        ))
    }
}

/// `--backend LOCAL`: one agent holds both sides' memory.
pub(crate) fn run_in_process(o: &Options) -> Result<Vec<Row>, String> {
    let target_mem = Mem::for_side_init(
        o,
        Side::Target,
        Init::Pattern(TARGET_SEED),
        &Setup::new("nixlbench", !quiet()),
    )?;
    let local = Mem::for_side(o, Side::Initiator, INITIATOR_FILL)?;
    let agent = Agent::new("nixlbench", o.agent_config(None)).map_err(|e| e.to_string())?;
    agent
        .create_backend(&o.backend, &o.params(Side::Initiator, None))
        .map_err(|e| format!("{}: {e}", o.backend))?;
    let _target_reg = register(&agent, &target_mem, None)?;
    let _local_reg = register(&agent, &local, None)?;
    let remote = RemoteMem {
        kind: target_mem.kind(),
        addr: target_mem.addr(),
        len: target_mem.len() as u64,
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
