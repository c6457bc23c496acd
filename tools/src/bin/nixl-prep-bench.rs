//! Times the host side of many-descriptor transfers: `prep_xfer_dlist` of each side,
//! `make_xfer_req` by index, `post`, and one request end to end (make + post + wait).
//!
//! Default shape: one list of 15,000 descriptors, all of them in one request (NIXL issue
//! #176 measured 0.6 s for that). `--regions 64 --blocks 1024 --request-blocks 128` is
//! vLLM's KV-cache pull: 64 registrations per side (32 layers x K/V) of 1,024 blocks,
//! lists of 65,536 descriptors prepared once, requests of 8,192 ids (128 random blocks
//! in every region).
//!
//! `nixl-prep-bench [--regions R] [--blocks B] [--block-bytes N] [--request-blocks K]
//! [--runs N] [--backend NAME] [--backend_param K=V]...` prints each phase's median over
//! the runs (a loopback target: the agent transfers to itself, so no second process is
//! needed).

use clap::Parser;
use nixl::{Agent, AgentConfig, BackendParams, Desc, DescList, MemKind, XferOp};
use std::time::{Duration, Instant};

/// Times prep_xfer_dlist, make_xfer_req, post and whole requests of many descriptors, on
/// a loopback target (the agent transfers to itself)
#[derive(Parser, Debug)]
#[command(name = "nixl-prep-bench", version, max_term_width = 100)]
struct Cli {
    /// Registrations per side (vLLM: layers x K/V)
    #[arg(long, value_name = "R", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    regions: u32,
    /// Blocks (descriptors) per registration; a list has regions x blocks descriptors
    #[arg(long, value_name = "B", default_value_t = 15_000,
          value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    blocks: u32,
    /// Bytes per block
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    block_bytes: u32,
    /// Blocks per request, picked at random (the same in every region); all blocks, in
    /// order, when not given
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..))]
    request_blocks: Option<u32>,
    /// Timed runs (one more warms up first); each phase's median is printed
    #[arg(long, value_name = "N", default_value_t = 21,
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

/// The request's shape.
struct Shape {
    regions: usize,
    blocks: usize,
    block_bytes: usize,
    request_blocks: Option<usize>,
}

fn main() {
    tools::cli::init_tracing();
    let cli: Cli = tools::cli::parse_or_exit("nixl-prep-bench");
    let backend = tools::backend::resolve(&cli.backend)
        .unwrap_or_else(|e| tools::cli::Stop::Usage(e).exit("nixl-prep-bench"));
    if let Some(note) = &backend.note {
        eprintln!("nixl-prep-bench: {note}");
    }
    let shape = Shape {
        regions: cli.regions as usize,
        blocks: cli.blocks as usize,
        block_bytes: cli.block_bytes as usize,
        request_blocks: cli.request_blocks.map(|k| k as usize),
    };
    if shape.request_blocks.is_some_and(|k| k > shape.blocks) {
        tools::cli::Stop::Usage(format!(
            "--request-blocks {} is more than --blocks {}",
            cli.request_blocks.unwrap_or_default(),
            cli.blocks
        ))
        .exit("nixl-prep-bench");
    }
    let params: BackendParams = cli.backend_param.into_iter().collect();
    if let Err(e) = run(&shape, cli.runs as usize, &backend.name, &params) {
        tools::cli::fail("nixl-prep-bench", e);
    }
}

/// splitmix64: reproducible block picks without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// `k` distinct values below `n` (a partial Fisher-Yates shuffle).
    fn pick(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k {
            let j = i + (self.next() % (n - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

fn run(shape: &Shape, runs: usize, backend: &str, params: &BackendParams) -> Result<(), String> {
    let err = |what: &'static str| move |e: nixl::Error| format!("{what}: {e}");
    let agent = Agent::new("prep-bench", AgentConfig::default()).map_err(err("agent"))?;
    agent
        .create_backend(backend, params)
        .map_err(|e| format!("backend {backend}: {e}"))?;
    let Shape {
        regions,
        blocks,
        block_bytes,
        request_blocks,
    } = *shape;
    let region_bytes = blocks * block_bytes;
    // Source blocks hold their region's number + 1; destination blocks start at zero.
    let src: Vec<Vec<u8>> = (0..regions)
        .map(|r| vec![(r % 251 + 1) as u8; region_bytes])
        .collect();
    let mut dst: Vec<Vec<u8>> = (0..regions).map(|_| vec![0u8; region_bytes]).collect();
    let regs = DescList::from_descs(
        MemKind::Dram,
        src.iter()
            .map(|b| Desc::from_slice(b))
            .chain(dst.iter().map(|b| Desc::from_slice(b))),
    );
    // SAFETY: the buffers outlive the registration and every request (all in this
    // function; `dst` is only read after the last request completed).
    let _reg = unsafe { agent.register_mem(&regs, None) }.map_err(err("registering"))?;
    let list = |bufs: &[Vec<u8>]| {
        DescList::from_descs(
            MemKind::Dram,
            bufs.iter().flat_map(|b| {
                (0..blocks).map(move |i| {
                    Desc::new(
                        b.as_ptr() as u64 + (i * block_bytes) as u64,
                        block_bytes as u64,
                        0,
                    )
                })
            }),
        )
    };
    let (local, remote) = (list(&src), list(&dst));
    let mut rng = Rng(7);
    let mut request_ids = || -> Vec<usize> {
        let picked = match request_blocks {
            Some(k) => rng.pick(blocks, k),
            None => (0..blocks).collect(),
        };
        (0..regions)
            .flat_map(|r| picked.iter().map(move |b| r * blocks + b))
            .collect()
    };
    let mut times: [Vec<Duration>; 6] = Default::default();
    let mut ids = Vec::new();
    for run in 0..runs + 1 {
        ids = request_ids();
        // Let the rail workers of the last transfer go idle first: on a small machine their
        // spinning would otherwise be measured as preparation time.
        std::thread::sleep(Duration::from_millis(50));
        let t0 = Instant::now();
        let l = agent
            .prep_xfer_dlist(None, &local)
            .map_err(err("prep_xfer_dlist (local)"))?;
        let t1 = Instant::now();
        let r = agent
            .prep_xfer_dlist(Some("prep-bench"), &remote)
            .map_err(err("prep_xfer_dlist (remote)"))?;
        let t2 = Instant::now();
        let mut req = agent
            .make_xfer_req(XferOp::Write, &l, &ids, &r, &ids, Some(b"n".to_vec()), None)
            .map_err(err("make_xfer_req"))?;
        let t3 = Instant::now();
        req.post().map_err(err("post"))?;
        let t4 = Instant::now();
        req.wait(Duration::from_secs(120))
            .map_err(err("the transfer"))?;
        drop(req);
        let t5 = Instant::now();
        // The first run warms caches and the loopback connection.
        if run > 0 {
            for (v, d) in
                times
                    .iter_mut()
                    .zip([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t2])
            {
                v.push(d);
            }
        }
    }
    // Every block of the last request landed, and no other block of the regions it
    // touched was written by it (earlier requests wrote theirs; check the last one only
    // when it covers every block).
    let last: std::collections::HashSet<usize> = ids.iter().copied().collect();
    for (r, buf) in dst.iter_mut().enumerate() {
        for (b, block) in buf.chunks(block_bytes).enumerate() {
            let picked = last.contains(&(r * blocks + b));
            let want = (r % 251 + 1) as u8;
            if picked && !block.iter().all(|x| *x == want) {
                return Err(format!(
                    "block {b} of region {r} did not land in the destination"
                ));
            }
            if request_blocks.is_none() && !picked && block.iter().any(|x| *x != 0) {
                return Err(format!(
                    "block {b} of region {r} was written, not asked for"
                ));
            }
        }
    }
    println!(
        "lists of {} descriptors ({regions} regions x {blocks} blocks of {block_bytes} B), \
         requests of {} ids, {runs} runs, backend {backend}: medians",
        regions * blocks,
        ids.len()
    );
    let names = [
        "prep_xfer_dlist (local)",
        "prep_xfer_dlist (remote)",
        "make_xfer_req",
        "post",
        "wait",
        "request (make+post+wait)",
    ];
    for (name, v) in names.iter().zip(times) {
        println!("  {name:<26}{:>10.3} ms", median(v).as_secs_f64() * 1e3);
    }
    Ok(())
}
