//! A latency and bandwidth probe for noisy machines (ignored; run by hand): WRITEs
//! without notification between two agents of this process, one block posted and
//! waited for at a time, reporting the median and 90th percentile per block size.
//! Medians shrug off the scheduler's stalls that averages (nixlbench's columns) show.
//!
//! `NIXL_PROBE_PROVIDER` (default `shm`), `NIXL_PROBE_RAILS` (default 1),
//! `NIXL_PROBE_ITERS` (default 2000; a tenth from 1 MiB), `NIXL_PROBE_MAX` (largest
//! block, default 64 MiB), `NIXL_PROBE_OP` (`write`, the default, or `read`),
//! `NIXL_PROBE_STAGE_TARGET=1` (the target's DRAM is staged, `stage_dram=1`: a WRITE is
//! an OFFER the target pulls, a READ a FETCH it pushes and answers):
//! `cargo test --release -p rdma-rs-nixl --lib latency_probe -- --ignored --nocapture`

use crate::{params, Agent, AgentConfig, Desc, DescList, MemKind, XferOp};
use std::time::{Duration, Instant};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
#[ignore = "a measurement, run by hand"]
fn latency_probe() {
    let provider = std::env::var("NIXL_PROBE_PROVIDER").unwrap_or_else(|_| "shm".into());
    let rails: usize = env_or("NIXL_PROBE_RAILS", 1);
    let iters: usize = env_or("NIXL_PROBE_ITERS", 2000);
    let max: usize = env_or("NIXL_PROBE_MAX", 64 << 20);
    let read = std::env::var("NIXL_PROBE_OP").is_ok_and(|op| op == "read");
    let stage_target = env_or("NIXL_PROBE_STAGE_TARGET", 0) == 1;
    let rails_s = rails.to_string();
    let make = |name: &str, staged: bool| {
        let agent = Agent::new(name, AgentConfig::default()).unwrap();
        let stage = if staged { "1" } else { "0" };
        agent
            .create_backend(
                "LIBFABRIC",
                &params([
                    ("provider", provider.as_str()),
                    ("num_rails", &rails_s),
                    ("stage_dram", stage),
                ]),
            )
            .unwrap();
        agent
    };
    let initiator = make("probe-init", false);
    let target = make("probe-tgt", stage_target);
    let src = vec![7u8; max];
    let mut dst = vec![0u8; max];
    let dst_p = dst.as_mut_ptr() as u64;
    // SAFETY: both buffers outlive the registrations and requests of this function.
    let _hi = unsafe {
        initiator
            .register_mem(
                &DescList::from_descs(
                    MemKind::Dram,
                    [Desc::new(src.as_ptr() as u64, max as u64, 0)],
                ),
                None,
            )
            .unwrap()
    };
    // SAFETY: as above.
    let _ht = unsafe {
        target
            .register_mem(
                &DescList::from_descs(MemKind::Dram, [Desc::new(dst_p, max as u64, 0)]),
                None,
            )
            .unwrap()
    };
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    let op = if read { XferOp::Read } else { XferOp::Write };
    println!(
        "probe: {provider}, {rails} rail(s), {op:?} without notification{}",
        if stage_target {
            ", the target's DRAM staged"
        } else {
            ""
        }
    );
    let mut block = 4096;
    while block <= max {
        let local = DescList::from_descs(
            MemKind::Dram,
            [Desc::new(src.as_ptr() as u64, block as u64, 0)],
        );
        let remote = DescList::from_descs(MemKind::Dram, [Desc::new(dst_p, block as u64, 0)]);
        let mut req = initiator
            .create_xfer_req(op, &local, &remote, &name, None)
            .unwrap();
        let n = if block >= 1 << 20 {
            (iters / 10).max(5)
        } else {
            iters
        };
        let mut lat = Vec::with_capacity(n);
        for i in 0..n + n / 10 {
            let start = Instant::now();
            req.post().unwrap();
            req.wait(Duration::from_secs(30)).unwrap();
            if i >= n / 10 {
                lat.push(start.elapsed());
            }
        }
        lat.sort();
        let median = lat[lat.len() / 2];
        let p90 = lat[lat.len() * 9 / 10];
        println!(
            "{:>9} B  median {:>9.1} us  p90 {:>9.1} us  {:>7.2} GB/s at the median",
            block,
            median.as_secs_f64() * 1e6,
            p90.as_secs_f64() * 1e6,
            block as f64 / median.as_secs_f64() / 1e9
        );
        block *= 4;
    }
}
