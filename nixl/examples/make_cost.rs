//! What building a request by descriptor indices costs (`make_xfer_req`), against the
//! LOCAL backend within one agent: the agent core's part of every KV-cache pull (vLLM's
//! connector makes one per request, from lists prepared once).
//!
//! `cargo run --release -p rdma-rs-nixl --example make_cost -- [DESCS] [ROUNDS]`
//! prints the median and minimum over ROUNDS requests of DESCS random 32 KiB blocks
//! from a 65,536-descriptor list (defaults 8192 and 200).

use nixl::{Agent, AgentConfig, Desc, DescList, MemKind, XferOp};
use std::time::{Duration, Instant};

const BLOCK: u64 = 32 << 10;
const LIST: usize = 65_536;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let descs: usize = args.next().map_or(Ok(8192), |a| a.parse())?;
    let rounds: usize = args.next().map_or(Ok(200), |a| a.parse())?;
    let agent = Agent::new("make-cost", AgentConfig::default())?;
    agent.create_backend("LOCAL", &Default::default())?;
    // Two 2 GiB "caches" are not needed: the descriptors only have to lie inside
    // registered memory, never touched here. Reserve address space without backing.
    let bytes = LIST as u64 * BLOCK;
    let layout = std::alloc::Layout::from_size_align(bytes as usize, 4096)?;
    // SAFETY: a non-zero size; freed at the end with the same layout.
    let (a, b) = unsafe { (std::alloc::alloc(layout), std::alloc::alloc(layout)) };
    if a.is_null() || b.is_null() {
        return Err("no memory".into());
    }
    let list = |base: *mut u8| {
        DescList::from_descs(
            MemKind::Dram,
            (0..LIST as u64).map(|i| Desc::new(base as u64 + i * BLOCK, BLOCK, 0)),
        )
    };
    let both = DescList::from_descs(
        MemKind::Dram,
        [Desc::new(a as u64, bytes, 0), Desc::new(b as u64, bytes, 0)],
    );
    // SAFETY: both allocations outlive the handle and every request (dropped first).
    let handle = unsafe { agent.register_mem(&both, None)? };
    let t = Instant::now();
    let local = agent.prep_xfer_dlist(None, &list(a))?;
    let remote = agent.prep_xfer_dlist(Some("make-cost"), &list(b))?;
    println!(
        "prep_xfer_dlist of {LIST} descriptors, both sides: {:?}",
        t.elapsed()
    );
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % LIST as u64) as usize
    };
    let mut times: Vec<Duration> = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let li: Vec<usize> = (0..descs).map(|_| next()).collect();
        let ri: Vec<usize> = (0..descs).map(|_| next()).collect();
        let t = Instant::now();
        let req = agent.make_xfer_req(XferOp::Write, &local, &li, &remote, &ri, None, None)?;
        times.push(t.elapsed());
        drop(req);
    }
    times.sort();
    println!(
        "make_xfer_req of {descs} descriptors: median {:?}, min {:?} ({rounds} rounds)",
        times[rounds / 2],
        times[0]
    );
    drop((local, remote, handle));
    // SAFETY: allocated above with this layout, no longer referenced.
    unsafe {
        std::alloc::dealloc(a, layout);
        std::alloc::dealloc(b, layout);
    }
    Ok(())
}
