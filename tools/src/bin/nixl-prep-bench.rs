//! Times `prep_xfer_dlist` (both sides) + `make_xfer_req` + `post` of one request of many
//! descriptors — the cost NIXL issue #176 measured at 0.6 s for 15,000 descriptors.
//!
//! `nixl-prep-bench [--descs N] [--runs R] [--backend NAME] [--backend_param K=V]...`
//! prints each phase's median and the median of the sum over R runs (a loopback target:
//! the agent transfers to itself, so no second process is needed).

use clap::Parser;
use nixl::{Agent, AgentConfig, BackendParams, Desc, DescList, MemKind, XferOp};
use std::time::{Duration, Instant};

/// Times prep_xfer_dlist (both sides) + make_xfer_req + post of one request of many
/// descriptors, on a loopback target (the agent transfers to itself)
#[derive(Parser, Debug)]
#[command(name = "nixl-prep-bench", version, max_term_width = 100)]
struct Cli {
    /// Descriptors in the request (64 bytes each, spaced 128 apart), at most ten million
    #[arg(long, value_name = "N", default_value_t = 15_000,
          value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    descs: u32,
    /// Timed runs (one more warms up first); each phase's median is printed
    #[arg(long, value_name = "R", default_value_t = 21,
          value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// Backend (UCX runs LIBFABRIC)
    #[arg(long, value_name = "NAME", default_value = "LIBFABRIC")]
    backend: String,
    /// Backend parameter (repeatable)
    #[arg(long = "backend_param", alias = "backend-param", value_name = "KEY=VALUE",
          value_parser = key_value)]
    backend_param: Vec<(String, String)>,
}

fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{text}` is not KEY=VALUE (e.g. provider=shm)")),
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn main() {
    tools::cli::init_tracing();
    let cli: Cli = tools::cli::parse_or_exit("nixl-prep-bench");
    let backend = tools::backend::resolve(&cli.backend)
        .unwrap_or_else(|e| tools::cli::Stop::Usage(e).exit("nixl-prep-bench"));
    if let Some(note) = &backend.note {
        eprintln!("nixl-prep-bench: {note}");
    }
    let params: BackendParams = cli.backend_param.into_iter().collect();
    if let Err(e) = run(
        cli.descs as usize,
        cli.runs as usize,
        &backend.name,
        &params,
    ) {
        tools::cli::fail("nixl-prep-bench", e);
    }
}

fn run(descs: usize, runs: usize, backend: &str, params: &BackendParams) -> Result<(), String> {
    let err = |what: &'static str| move |e: nixl::Error| format!("{what}: {e}");
    let agent = Agent::new("prep-bench", AgentConfig::default()).map_err(err("agent"))?;
    agent
        .create_backend(backend, params)
        .map_err(|e| format!("backend {backend}: {e}"))?;
    let block = 64usize;
    let src = vec![1u8; descs * block * 2];
    let dst = vec![0u8; descs * block * 2];
    let regs = DescList::from_descs(
        MemKind::Dram,
        [Desc::from_slice(&src), Desc::from_slice(&dst)],
    );
    // SAFETY: both buffers outlive the registration and every request (all in main).
    let _reg = unsafe { agent.register_mem(&regs, None) }.map_err(err("registering"))?;
    let local = DescList::from_descs(
        MemKind::Dram,
        (0..descs).map(|i| {
            Desc::new(
                src.as_ptr() as u64 + (2 * i * block) as u64,
                block as u64,
                0,
            )
        }),
    );
    let remote = DescList::from_descs(
        MemKind::Dram,
        (0..descs).map(|i| {
            Desc::new(
                dst.as_ptr() as u64 + (2 * i * block) as u64,
                block as u64,
                0,
            )
        }),
    );
    let idx: Vec<usize> = (0..descs).collect();
    let (mut prep, mut make, mut post, mut total) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs + 1 {
        // Let the rail workers of the last transfer go idle first: on a small machine their
        // spinning would otherwise be measured as preparation time.
        std::thread::sleep(Duration::from_millis(50));
        let t0 = Instant::now();
        let l = agent
            .prep_xfer_dlist(None, &local)
            .map_err(err("prep_xfer_dlist (local)"))?;
        let r = agent
            .prep_xfer_dlist(Some("prep-bench"), &remote)
            .map_err(err("prep_xfer_dlist (remote)"))?;
        let t1 = Instant::now();
        let mut req = agent
            .make_xfer_req(XferOp::Write, &l, &idx, &r, &idx, Some(b"n".to_vec()), None)
            .map_err(err("make_xfer_req"))?;
        let t2 = Instant::now();
        req.post().map_err(err("post"))?;
        let t3 = Instant::now();
        req.wait(Duration::from_secs(120))
            .map_err(err("the transfer"))?;
        prep.push(t1 - t0);
        make.push(t2 - t1);
        post.push(t3 - t2);
        total.push(t3 - t0);
    }
    // The first run warms caches and the loopback connection.
    for v in [&mut prep, &mut make, &mut post, &mut total] {
        v.remove(0);
    }
    if !dst
        .chunks(2 * block)
        .all(|c| c[..block].iter().all(|b| *b == 1))
    {
        return Err("the data did not land in the destination".into());
    }
    println!("{descs} descriptors, {runs} runs, backend {backend}: medians");
    println!(
        "  prep_xfer_dlist x2   {:>10.3} ms",
        median(prep).as_secs_f64() * 1e3
    );
    println!(
        "  make_xfer_req        {:>10.3} ms",
        median(make).as_secs_f64() * 1e3
    );
    println!(
        "  post                 {:>10.3} ms",
        median(post).as_secs_f64() * 1e3
    );
    println!(
        "  prep + make + post   {:>10.3} ms",
        median(total).as_secs_f64() * 1e3
    );
    Ok(())
}
