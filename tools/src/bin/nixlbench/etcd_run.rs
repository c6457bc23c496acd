//! The two sides of a run under the ETCD runtime (`--etcd_endpoints URL`).
//!
//! Both processes are started alike; [`EtcdRuntime::join`] makes the first the initiator
//! (rank 0) and the second the target (rank 1). Then, through the run's keys:
//! 1. the initiator waits for the target's rank, picks its backend (LIBFABRIC: the
//!    provider as with SOCKET, `shm` when the target's boot id is ours), registers its
//!    memory, publishes its agent metadata (`nixl::etcd::EtcdMetadata`) and puts its
//!    agent name under `initiator`;
//! 2. the target reads that name (a LIBFABRIC target without a provider takes the one in
//!    it), creates its backend, registers, fetches the initiator's metadata (it answers
//!    consistency checks by notification), publishes its own and puts its name under
//!    `target`;
//! 3. the initiator fetches the target's metadata and runs the sweep; DONE by
//!    notification ends the target, which acknowledges under `done`, so the initiator
//!    leaves only after the target has seen the end. A side that fails says why under
//!    `failed-{rank}` and stays until its peer has read it and left; a side whose peer's
//!    rank vanishes (a crash: the lease expires) stops with that reason instead of
//!    waiting. Every wait for the peer follows its setup progress, which each side
//!    publishes every second (`crate::setup`): buffers of tens of GiB may take their
//!    time, and a waiting side prints what its peer is doing.

use crate::etcd_runtime::{EtcdRuntime, RankInfo};
use crate::initiator::{initiator_agent_for, measure};
use crate::mem::{register, Init, Mem, INITIATOR_FILL, TARGET_SEED};
use crate::options::{Options, Runtime, Side};
use crate::provider::{provider_of, with_provider};
use crate::setup::Setup;
use crate::sweep::Row;
use crate::target::serve;
use crate::TARGET;
use nixl::etcd::EtcdMetadata;
use nixl::Agent;
use std::sync::mpsc;
use std::time::Duration;

/// Label of the initiator's agent name.
const INITIATOR_KEY: &str = "initiator";
/// Label of the target's agent name (put once its metadata is published).
const TARGET_KEY: &str = "target";
/// Label the target puts when it has seen DONE.
const DONE_KEY: &str = "done";
/// How often each side publishes its setup progress (the peer's waits follow it).
const HEARTBEAT: Duration = Duration::from_secs(1);

/// Joins the run and plays the side the rank gives; the initiator returns its rows.
pub(crate) fn run(o: &Options) -> Result<Option<Vec<Row>>, String> {
    let Runtime::Etcd {
        endpoints,
        group,
        wait,
    } = &o.runtime
    else {
        return Err("not the ETCD runtime".into());
    };
    let mut rt = EtcdRuntime::join(endpoints, group, *wait, &o.backend, o.user_provider())?;
    eprintln!(
        "nixlbench: ETCD runtime at {}: rank {} of 2 ({}), benchmark group `{}`, run {}",
        rt.endpoints().join(","),
        crate::etcd_runtime::rank_of(rt.side()),
        match rt.side() {
            Side::Initiator => "initiator",
            Side::Target => "target",
        },
        rt.group(),
        rt.me().run
    );
    let peer = rt.peer()?;
    if peer.backend != o.backend {
        let why = format!(
            "the peer (pid {} on {}) runs --backend {}, this process --backend {}: start \
             both with the same options",
            peer.pid, peer.hostname, peer.backend, o.backend
        );
        if rt.side() == Side::Target {
            // The initiator sees the same mismatch once it reads our rank: let it.
            rt.wait_peer_left();
        }
        return Err(why);
    }
    let who = match rt.side() {
        Side::Initiator => "nixlbench",
        Side::Target => "nixlbench target",
    };
    let setup = Setup::new(who, true);
    let (stop, stopped) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        // The heartbeat: this side's stage and bytes, every HEARTBEAT, until the run ends
        // (the peer's waits for this side are bounded by its progress).
        let (rt, setup) = (&rt, &setup);
        s.spawn(move || loop {
            // etcd unreachable for a moment: the next beat tries again.
            let _ = rt.publish_setup(&setup.report());
            match stopped.recv_timeout(HEARTBEAT) {
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
        });
        let result = match rt.side() {
            Side::Initiator => initiator(o, rt, &peer, setup).map(Some).inspect_err(|e| {
                // The target may be serving or waiting for our keys: tell it why.
                rt.fail(e);
            }),
            Side::Target => target(o, rt, setup).map(|()| None).inspect_err(|e| {
                // The initiator may be waiting for our keys: tell it why they will not come.
                rt.fail(e);
            }),
        };
        let _ = stop.send(());
        result
    })
}

fn metadata(agent: &Agent, rt: &EtcdRuntime) -> Result<EtcdMetadata, String> {
    EtcdMetadata::connect(agent, rt.metadata_config())
        .map_err(|e| format!("etcd metadata service: {e}"))
}

fn initiator(
    o: &Options,
    rt: &EtcdRuntime,
    peer: &RankInfo,
    setup: &Setup,
) -> Result<Vec<Row>, String> {
    let same_host = rt.me().same_host(peer);
    setup.stage(format!("creating the {} backend", o.backend), 0);
    let (agent, how) = initiator_agent_for(o, peer.provider.as_deref(), same_host)?;
    let local = Mem::for_side_init(o, Side::Initiator, Init::Byte(INITIATOR_FILL), setup)?;
    setup.stage(
        format!("registering {}", local.describe()),
        local.len() as u64,
    );
    let reg = register(&agent, &local, None)?;
    setup.stage("publishing its metadata", 0);
    let md = metadata(&agent, rt)?;
    md.publish()
        .map_err(|e| format!("publishing our metadata: {e}"))?;
    rt.put(INITIATOR_KEY, agent.name())?;
    setup.finish("waiting for the target's agent");
    let target = rt.wait_for(TARGET_KEY, "the target's agent")?;
    md.fetch(&target)
        .map_err(|e| format!("fetching the target's metadata: {e}"))?;
    setup.finish("running the sweep");
    let at = format!("{} (pid {}, via etcd)", peer.hostname, peer.pid);
    let rows = measure(o, &agent, &how, &local, &target, &at, same_host)?;
    setup.finish("waiting for the target to see DONE");
    rt.wait_for_or_left(DONE_KEY, "the target's acknowledgement of DONE")?;
    drop(md);
    drop(reg);
    Ok(rows)
}

fn target(o: &Options, rt: &EtcdRuntime, setup: &Setup) -> Result<(), String> {
    let mem = Mem::for_side_init(o, Side::Target, Init::Pattern(TARGET_SEED), setup)?;
    setup.finish("waiting for the initiator's agent");
    let initiator = rt.wait_for(INITIATOR_KEY, "the initiator's agent")?;
    // LIBFABRIC: the user's provider, else the initiator's choice (its name carries it).
    let provider = if o.is_libfabric() {
        let chosen = provider_of(&initiator);
        match (o.user_provider(), chosen) {
            (Some(u), Some(c)) if u != c => {
                return Err(format!(
                    "the initiator uses provider {c}, but --backend_param provider={u}"
                ))
            }
            (Some(u), _) => Some(u.to_string()),
            (None, c) => c.map(str::to_string),
        }
    } else {
        None
    };
    setup.stage(format!("creating the {} backend", o.backend), 0);
    let agent = Agent::new(
        with_provider(TARGET, provider.as_deref()),
        o.agent_config(None),
    )
    .map_err(|e| e.to_string())?;
    agent
        .create_backend(&o.backend, &o.params(Side::Target, provider.as_deref()))
        .map_err(|e| format!("{}: {e}", o.backend))?;
    setup.stage(format!("registering {}", mem.describe()), mem.len() as u64);
    let reg = register(&agent, &mem, None)?;
    setup.stage("exchanging metadata", 0);
    let md = metadata(&agent, rt)?;
    md.fetch(&initiator)
        .map_err(|e| format!("fetching the initiator's metadata: {e}"))?;
    md.publish()
        .map_err(|e| format!("publishing our metadata: {e}"))?;
    rt.put(TARGET_KEY, agent.name())?;
    setup.finish("serving the sweep");
    eprintln!(
        "nixlbench target: {}, {}, serving `{initiator}`",
        agent.name(),
        mem.describe()
    );
    serve(&agent, &mem, &|| rt.peer_failed_or_gone())?;
    rt.put(DONE_KEY, "1")?;
    drop(md);
    drop(reg);
    Ok(())
}
