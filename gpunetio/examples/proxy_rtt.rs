//! The CPU proxy's own costs with a host thread as the producer (no GPU, no PCIe):
//!
//! - round trip of a NOP: `HostProducer::post`, then spin on `poll` until the proxy
//!   thread reports it complete (the proxy's share of a GPU post -> proxy -> GPU round
//!   trip);
//! - `throughput`: entries per second to a target proxy in this process, a producer
//!   reserving 32 tickets at once as a warp does (8-byte puts, 8-byte inline puts, 8-byte
//!   puts with a signal), over each provider with the unordered transport
//!   (`FabricTransport::new`) and the write-ordered one (`new_ordered`) alternating, and
//!   through a transport that completes everything at once (the ring and proxy alone).
//!   Both proxy threads busy-poll; give the machine four free cores.
//!
//! ```text
//! cargo run --release -p rdma-rs-gpunetio --example proxy_rtt -- [PROVIDER] [ITERS]
//! cargo run --release -p rdma-rs-gpunetio --example proxy_rtt -- throughput [ENTRIES] [PROVIDERS] [ROUNDS]
//! ```
//! PROVIDERS is comma-separated (default `shm,tcp;ofi_rxm`); ROUNDS (default 3) repeats
//! the matrix, and the median of each line is printed last.

use gpunetio::proxy::{
    CpuProxy, CpuProxyBuilder, Entry, FabricTransport, HostProducer, Posted, RemoteDescriptor,
    RingMemory, Transport, TransportCompletion, TransportKind, WorkRequest,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: proxy_rtt [PROVIDER] [ITERS]
       proxy_rtt throughput [ENTRIES] [PROVIDERS] [ROUNDS]
  PROVIDER   libfabric provider of the round trips (default shm)
  ITERS      timed round trips (default 20000)
  ENTRIES    entries per throughput run (default 1048576, rounded up to 32)
  PROVIDERS  comma-separated (default shm,tcp;ofi_rxm)
  ROUNDS     repeats of the matrix (default 3)";

/// Ends the example with a one-line error (status 2: a wrong invocation).
fn usage_error(message: String) -> ! {
    eprintln!("proxy_rtt: {message}; see 'proxy_rtt --help'");
    std::process::exit(2)
}

/// The positional number `arg`, `default` when absent.
fn number<T: std::str::FromStr>(arg: Option<&String>, name: &str, default: T) -> T {
    match arg {
        None => default,
        Some(v) => v
            .parse()
            .unwrap_or_else(|_| usage_error(format!("{name} `{v}` is not a number"))),
    }
}

/// Opens a transport of `provider`, or ends with a one-line error.
fn transport(provider: &str) -> FabricTransport {
    FabricTransport::new(provider).unwrap_or_else(|e| {
        eprintln!("proxy_rtt: provider `{provider}`: {e}");
        std::process::exit(1)
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(flag) = args.iter().find(|a| a.starts_with('-')) {
        if matches!(flag.as_str(), "-h" | "--help") {
            println!("{USAGE}");
            return;
        }
        usage_error(format!("unknown option {flag}"));
    }
    if args.first().map(String::as_str) == Some("throughput") {
        if args.len() > 4 {
            usage_error(format!("unexpected argument `{}`", args[4]));
        }
        let n: u64 = number(args.get(1), "ENTRIES", 1 << 20);
        let provs = args
            .get(2)
            .cloned()
            .unwrap_or_else(|| "shm,tcp;ofi_rxm".into());
        let rounds: usize = number(args.get(3), "ROUNDS", 3);
        // Every provider opens before the matrix starts.
        for prov in provs.split(',') {
            drop(transport(prov));
        }
        throughput(n.next_multiple_of(32), &provs, rounds);
        return;
    }
    if args.len() > 2 {
        usage_error(format!("unexpected argument `{}`", args[2]));
    }
    let provider = args.first().map(String::as_str).unwrap_or("shm");
    let iters: usize = number(args.get(1), "ITERS", 20_000);
    let ring = RingMemory::host(1024, 0).expect("ring");
    let a = CpuProxy::new(transport(provider), &ring).expect("proxy");
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

const KINDS: [&str; 3] = ["put 8 B", "inline 8 B", "put 8 B + signal"];

fn throughput(n: u64, provs: &str, rounds: usize) {
    let mut results: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        let mut record = |line: String, eps: f64| {
            println!("round {round}: {line}: {eps:.0} entries/s");
            results.entry(line).or_default().push(eps);
        };
        record("null transport put 8 B".into(), run_null(n));
        for prov in provs.split(',') {
            for kind in KINDS {
                for ordered in [false, true] {
                    let mode = if ordered { "ordered" } else { "unordered" };
                    let open = if ordered {
                        FabricTransport::new_ordered
                    } else {
                        FabricTransport::new
                    };
                    let t = || open(prov).unwrap_or_else(|e| panic!("{prov}: {e}"));
                    let granted = t().ordered();
                    let eps = run(t(), t(), kind, n);
                    record(
                        format!(
                            "{prov} {mode}{} {kind}",
                            if ordered && !granted {
                                " (not granted)"
                            } else {
                                ""
                            }
                        ),
                        eps,
                    );
                }
            }
        }
    }
    println!("median of {rounds} rounds, {n} entries each:");
    for (line, mut v) in results {
        v.sort_by(f64::total_cmp);
        println!("  {line}: {:.0} entries/s", v[v.len() / 2]);
    }
}

/// 8-byte aligned memory the transport reads and writes: only atomic accesses here.
fn words(n: usize) -> Box<[AtomicU64]> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

fn run<T: Transport>(ta: T, tb: T, kind: &str, n: u64) -> f64 {
    let (src, dst, sig) = (words(1), words(1024), words(1));
    let ring = RingMemory::host(1024, 0).expect("ring");
    let options = CpuProxyBuilder::new().busy_poll(true);
    let a = options.clone().build(ta, &ring).expect("proxy a");
    let b = options
        .build(tb, &RingMemory::host(8, 0).expect("ring b"))
        .expect("proxy b");
    a.connect(&b.local_info().expect("info")).expect("connect");
    b.connect(&a.local_info().expect("info")).expect("connect");
    // SAFETY: the buffers outlive both proxies (dropped explicitly below, first).
    let (l, d, s) = unsafe {
        (
            a.register_local(src.as_ptr() as *mut u8, 8).expect("src"),
            b.register_local(dst.as_ptr() as *mut u8, 8 * 1024)
                .expect("dst"),
            b.register_local(sig.as_ptr() as *mut u8, 8).expect("sig"),
        )
    };
    let r = a.add_remote(&b.descriptor(d).expect("desc")).expect("dst");
    let s = a.add_remote(&b.descriptor(s).expect("desc")).expect("sig");
    a.start().expect("proxy a thread");
    b.start().expect("proxy b thread");
    let p = HostProducer::new(&ring, Duration::from_secs(30)).expect("producer");
    let start = Instant::now();
    for first in (0..n).step_by(32) {
        let ticket = p.reserve(32);
        for i in first..first + 32 {
            let off = (i % 1024) * 8;
            let e = match kind {
                "put 8 B" => Entry::put(r, off, l, 0, 8),
                "inline 8 B" => Entry::put_inline(r, off, i, 8),
                _ => Entry::put(r, off, l, 0, 8).with_signal(s, 0, 1),
            };
            p.write(ticket + i - first, &e).expect("post");
        }
    }
    p.quiet().expect("quiet");
    let eps = n as f64 / start.elapsed().as_secs_f64();
    if kind.ends_with("signal") {
        assert_eq!(sig[0].load(Ordering::Acquire), n, "signals");
    }
    if let Some(e) = a.take_error() {
        panic!("proxy: {e}");
    }
    drop((a, b));
    eps
}

/// Completes every request at its next poll: the ring and the proxy alone.
struct NullTransport(Vec<u64>);

impl Transport for NullTransport {
    type Registration = ();
    fn kind(&self) -> TransportKind {
        TransportKind::FABRIC
    }
    fn local_info(&self) -> gpunetio::Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn connect(&mut self, _: &[u8]) -> gpunetio::Result<()> {
        Ok(())
    }
    fn prepare(&mut self, _: usize) -> gpunetio::Result<()> {
        Ok(())
    }
    unsafe fn register_host(&mut self, _: *mut u8, _: usize) -> gpunetio::Result<()> {
        Ok(())
    }
    fn register_device(&mut self, _: &gpunetio::DeviceBuffer) -> gpunetio::Result<()> {
        Err(gpunetio::Error::Unsupported("null transport".into()))
    }
    fn descriptor(&self, _: &()) -> RemoteDescriptor {
        RemoteDescriptor {
            transport: TransportKind::FABRIC,
            addr: 0,
            len: 1 << 20,
            key: 0,
        }
    }
    fn post(&mut self, wr: &WorkRequest<'_, ()>) -> gpunetio::Result<Posted> {
        let (WorkRequest::Write { wr_id, .. }
        | WorkRequest::WriteInline { wr_id, .. }
        | WorkRequest::Read { wr_id, .. }
        | WorkRequest::AtomicAdd { wr_id, .. }) = *wr;
        self.0.push(wr_id);
        Ok(Posted::Yes)
    }
    fn poll(&mut self, out: &mut Vec<TransportCompletion>) -> gpunetio::Result<()> {
        out.extend(self.0.drain(..).map(|wr_id| TransportCompletion {
            wr_id,
            result: Ok(()),
        }));
        Ok(())
    }
}

fn run_null(n: u64) -> f64 {
    let ring = RingMemory::host(1024, 0).expect("ring");
    let a = CpuProxyBuilder::new()
        .busy_poll(true)
        .build(NullTransport(Vec::new()), &ring)
        .expect("proxy");
    let src = words(1);
    // SAFETY: the null transport never touches memory.
    let l = unsafe { a.register_local(src.as_ptr() as *mut u8, 8).expect("src") };
    let r = a
        .add_remote(&a.with_transport(|t| t.descriptor(&())))
        .expect("remote");
    a.start().expect("proxy thread");
    let p = HostProducer::new(&ring, Duration::from_secs(30)).expect("producer");
    let start = Instant::now();
    for first in (0..n).step_by(32) {
        let ticket = p.reserve(32);
        for i in first..first + 32 {
            p.write(ticket + i - first, &Entry::put(r, (i % 1024) * 8, l, 0, 8))
                .expect("post");
        }
    }
    p.quiet().expect("quiet");
    n as f64 / start.elapsed().as_secs_f64()
}
