//! Round trip of a NOP through the CPU proxy with a host thread as the producer (the
//! proxy's own share of a GPU post -> proxy -> GPU round trip, without PCIe):
//! `HostProducer::post` then spin on `poll` until the proxy thread reports it complete.
//!
//! ```text
//! cargo run --release -p gpunetio --example proxy_rtt -- [PROVIDER] [ITERS]
//! ```

use gpunetio::proxy::{CpuProxy, Entry, FabricTransport, HostProducer, RingMemory};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let provider = args.first().map(String::as_str).unwrap_or("shm");
    let iters: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let ring = RingMemory::host(1024, 0).expect("ring");
    let a =
        CpuProxy::new(FabricTransport::new(provider).expect("transport"), &ring).expect("proxy");
    a.start().expect("proxy thread");
    let p = HostProducer::new(&ring, Duration::from_secs(10)).expect("producer");
    let mut ns = Vec::with_capacity(iters);
    for i in 0..iters + 1000 {
        let t = Instant::now();
        let ticket = p.post(&Entry::nop()).expect("post");
        while !p.poll(ticket).expect("poll") {
            std::hint::spin_loop();
        }
        if i >= 1000 {
            ns.push(t.elapsed().as_nanos() as u64);
        }
    }
    ns.sort_unstable();
    println!(
        "proxy NOP round trip ({provider}, host producer, {iters}): median {:.2} us, p99 {:.2} us, min {:.2} us",
        ns[ns.len() / 2] as f64 / 1e3,
        ns[ns.len() * 99 / 100] as f64 / 1e3,
        ns[0] as f64 / 1e3
    );
}
