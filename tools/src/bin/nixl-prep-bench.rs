//! Times `prep_xfer_dlist` (both sides) + `make_xfer_req` + `post` of one request of many
//! descriptors — the cost NIXL issue #176 measured at 0.6 s for 15,000 descriptors.
//!
//! `nixl-prep-bench [--descs N] [--runs R] [--backend NAME] [--backend_param K=V]...`
//! prints each phase's median and the median of the sum over R runs (a loopback target:
//! the agent transfers to itself, so no second process is needed).

use nixl::{Agent, AgentConfig, BackendParams, Desc, DescList, MemKind, XferOp};
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut descs = 15_000usize;
    let mut runs = 21usize;
    let mut backend = "LIBFABRIC".to_string();
    let mut params = BackendParams::new();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--descs" => descs = value.parse().expect("--descs N"),
            "--runs" => runs = value.parse::<usize>().expect("--runs R").max(1),
            "--backend" => backend = value,
            "--backend_param" => {
                let (k, v) = value.split_once('=').expect("--backend_param K=V");
                params.insert(k.into(), v.into());
            }
            other => {
                eprintln!("nixl-prep-bench: unknown option {other}");
                std::process::exit(2);
            }
        }
        i += 2;
    }
    let agent = Agent::new("prep-bench", AgentConfig::default()).expect("agent");
    agent.create_backend(&backend, &params).expect("backend");
    let block = 64usize;
    let src = vec![1u8; descs * block * 2];
    let dst = vec![0u8; descs * block * 2];
    let regs = DescList::from_descs(
        MemKind::Dram,
        [Desc::from_slice(&src), Desc::from_slice(&dst)],
    );
    // SAFETY: both buffers outlive the registration and every request (all in main).
    let _reg = unsafe { agent.register_mem(&regs, None) }.expect("register");
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
        let l = agent.prep_xfer_dlist(None, &local).expect("prep local");
        let r = agent
            .prep_xfer_dlist(Some("prep-bench"), &remote)
            .expect("prep remote");
        let t1 = Instant::now();
        let mut req = agent
            .make_xfer_req(XferOp::Write, &l, &idx, &r, &idx, Some(b"n".to_vec()), None)
            .expect("make");
        let t2 = Instant::now();
        req.post().expect("post");
        let t3 = Instant::now();
        req.wait(Duration::from_secs(120)).expect("transfer");
        prep.push(t1 - t0);
        make.push(t2 - t1);
        post.push(t3 - t2);
        total.push(t3 - t0);
    }
    // The first run warms caches and the loopback connection.
    for v in [&mut prep, &mut make, &mut post, &mut total] {
        v.remove(0);
    }
    assert!(
        dst.chunks(2 * block)
            .all(|c| c[..block].iter().all(|b| *b == 1)),
        "data did not land"
    );
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
}
