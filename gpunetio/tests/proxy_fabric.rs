//! The CPU proxy over libfabric RDM endpoints (`tcp;ofi_rxm` and `shm`) with a host
//! thread standing in for the GPU: the same ring protocol and entry layout the device
//! library uses. Two endpoints in one process, and one two-process test.

mod proxy_common;

use gpunetio::proxy::{
    CpuProxy, Entry, FabricTransport, GioStatus, HostProducer, RemoteDescriptor, RingMemory,
};
use proxy_common::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn pair(prov: &str, ring_size: u32) -> Pair<FabricTransport> {
    pair_with(FabricTransport::new, prov, ring_size)
}

fn pair_with(
    open: fn(&str) -> gpunetio::Result<FabricTransport>,
    prov: &str,
    ring_size: u32,
) -> Pair<FabricTransport> {
    watchdog(600);
    let t = || open(prov).unwrap_or_else(|e| panic!("{prov}: {e}"));
    Pair::new(t(), t(), ring_size, 4, T)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

macro_rules! providers {
    ($($module:ident => $open:path, $prov:expr;)*) => {$(
        mod $module {
            use super::*;
            fn pair(prov: &str, ring_size: u32) -> Pair<FabricTransport> {
                pair_with($open, prov, ring_size)
            }
            #[test] fn put_inline_get_signal_counters() { basic(&pair($prov, 64)) }
            #[test] fn put_signal_data_first() { put_signal_order(&pair($prov, 16), 8) }
            #[test] fn fence_orders_get_after_put() { fence(&pair($prov, 16)) }
            #[test] fn wraparound_ring_of_8() { wraparound(&pair($prov, 8), 5000) }
            #[test] fn batches_across_wraparound() { batched_wraparound(&pair($prov, 16), 300) }
            #[test] fn full_ring_back_pressure() { back_pressure(&pair($prov, 8)) }
            #[test] fn bad_entries_refused() { bad_entries(|| pair($prov, 8)) }
            #[test] fn producer_timeout_and_shutdown() { timeout_and_shutdown(&pair($prov, 8)) }
            #[test] fn staged_local_memory() { staged(&pair($prov, 16)) }
            #[test] fn two_processes() { super::two_processes($open, $prov) }
        }
    )*};
}

providers! {
    tcp_rxm => FabricTransport::new, "tcp;ofi_rxm";
    shm => FabricTransport::new, "shm";
    // Write ordering granted (shm): batches complete once, signals follow their data.
    shm_ordered => FabricTransport::new_ordered, "shm";
    // Not granted (rxm): the same behaviour as without asking.
    tcp_rxm_ordered => FabricTransport::new_ordered, "tcp;ofi_rxm";
}

#[test]
fn ordering_is_granted_by_shm_only() {
    assert!(gpunetio::proxy::Transport::ordered(
        &FabricTransport::new_ordered("shm").unwrap()
    ));
    for t in [
        FabricTransport::new("shm"),
        FabricTransport::new("tcp;ofi_rxm"),
        FabricTransport::new_ordered("tcp;ofi_rxm"),
    ] {
        assert!(!gpunetio::proxy::Transport::ordered(&t.unwrap()));
    }
}

#[test]
fn wrong_key_is_a_transport_error_tcp_rxm() {
    // tcp;ofi_rxm checks keys and fails the write's completion; shm does not check them.
    let err = bad_key(&pair("tcp;ofi_rxm", 8));
    assert!(
        matches!(&err, gpunetio::Error::EntryFailed { source, .. } if matches!(**source, gpunetio::Error::Fabric { .. })),
        "{err:?}"
    );
}

#[test]
fn descriptors_of_another_transport_are_refused() {
    let x = pair("shm", 8);
    let mut d = x.b.descriptor(0).unwrap();
    d.transport = gpunetio::proxy::TransportKind::VERBS;
    assert!(matches!(
        x.a.add_remote(&d),
        Err(gpunetio::Error::InvalidArgument(_))
    ));
    assert!(x.a.cpu_proxy_progress().is_ok());
}

// ---- two processes --------------------------------------------------------------------

const CHILD_SLOTS: u64 = 64;
const CHILD_SLOT: usize = 4096;

/// The target process: registers a region and a signal word, prints its address and
/// descriptors, waits until the signal says every slot arrived, checks them, says OK.
#[test]
#[ignore = "the peer process of two_processes; run by it"]
fn proxy_peer_process() {
    let Ok(prov) = std::env::var("GIO_PROXY_PEER_PROV") else {
        return;
    };
    watchdog(120);
    let open = if std::env::var_os("GIO_PROXY_PEER_ORDERED").is_some() {
        FabricTransport::new_ordered
    } else {
        FabricTransport::new
    };
    let b = CpuProxy::new(open(&prov).unwrap(), &RingMemory::host(8, 0).unwrap()).unwrap();
    let (dst, sig) = (Buf::new(CHILD_SLOTS as usize * CHILD_SLOT), Buf::new(8));
    // SAFETY: the buffers outlive `b` (dropped at the end of this function, after it).
    let (d, s) = unsafe {
        (
            b.register_local(dst.ptr(), dst.len()).unwrap(),
            b.register_local(sig.ptr(), sig.len()).unwrap(),
        )
    };
    // A target progresses its endpoint: over a manual-progress provider the peer's
    // writes and atomics land when this side polls (shm with write ordering queues them).
    b.start().unwrap();
    println!("NAME {}", hex(&b.local_info().unwrap()));
    println!("DST {}", hex(&b.descriptor(d).unwrap().to_bytes()));
    println!("SIG {}", hex(&b.descriptor(s).unwrap().to_bytes()));
    std::io::stdout().flush().unwrap();
    for i in 0..CHILD_SLOTS {
        let deadline = Instant::now() + T;
        while sig.word(0).load(Ordering::Acquire) < i + 1 {
            assert!(Instant::now() < deadline, "signal {i} did not arrive");
            std::thread::yield_now();
        }
        assert_eq!(
            dst.read(i as usize * CHILD_SLOT, CHILD_SLOT),
            pattern(CHILD_SLOT, i),
            "slot {i}: signal before data"
        );
    }
    println!("OK {}", sig.word(0).load(Ordering::Acquire));
    std::io::stdout().flush().unwrap();
    // Wait for the parent to finish (stdin closes).
    for _ in std::io::stdin().lock().lines() {}
    drop(b);
}

fn two_processes(open: fn(&str) -> gpunetio::Result<FabricTransport>, prov: &str) {
    watchdog(600);
    let ordered = gpunetio::proxy::Transport::ordered(&open(prov).unwrap());
    let mut command = Command::new(std::env::current_exe().unwrap());
    if ordered {
        command.env("GIO_PROXY_PEER_ORDERED", "1");
    }
    let mut child = command
        .args([
            "--exact",
            "proxy_peer_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("GIO_PROXY_PEER_PROV", prov)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the peer");
    let mut lines = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok);
    let mut expect = |prefix: &str| -> String {
        for line in lines.by_ref() {
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].trim().to_owned();
            }
        }
        panic!("peer: no `{prefix}` line");
    };
    let name = unhex(&expect("NAME "));
    let dst = RemoteDescriptor::from_bytes(&unhex(&expect("DST "))).unwrap();
    let sig = RemoteDescriptor::from_bytes(&unhex(&expect("SIG "))).unwrap();

    let ring = RingMemory::host(16, 1).unwrap();
    let a = CpuProxy::new(open(prov).unwrap(), &ring).unwrap();
    a.connect(&name).unwrap();
    let src = Buf::new(CHILD_SLOTS as usize * CHILD_SLOT);
    for i in 0..CHILD_SLOTS {
        src.write(i as usize * CHILD_SLOT, &pattern(CHILD_SLOT, i));
    }
    // SAFETY: `src` outlives `a` (declared after it is dropped below).
    let l = unsafe { a.register_local(src.ptr(), src.len()).unwrap() };
    let (r, s) = (a.add_remote(&dst).unwrap(), a.add_remote(&sig).unwrap());
    a.start().unwrap();
    let p = HostProducer::new(&ring, T).unwrap();
    for i in 0..CHILD_SLOTS {
        let off = i * CHILD_SLOT as u64;
        p.post(
            &Entry::put(r, off, l, off, CHILD_SLOT as u64)
                .with_signal(s, 0, 1)
                .with_counter(0),
        )
        .unwrap();
    }
    p.quiet().unwrap();
    assert_eq!(ring.counter(0).unwrap(), CHILD_SLOTS);
    assert_eq!(expect("OK "), CHILD_SLOTS.to_string());
    drop(child.stdin.take());
    let deadline = Instant::now() + T;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "peer exited with {status}");
            break;
        }
        assert!(Instant::now() < deadline, "peer did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(a);
}

/// Entries per second through the proxy with a host producer standing in for a warp:
/// 32 tickets reserved at once, 32 entries written (8-byte puts from registered memory,
/// 8-byte inline puts, 8-byte puts with a signal), ring of 1024, busy-polling proxy
/// threads on both sides, for each provider in `GIO_PROXY_BENCH_PROV` (comma-separated;
/// default `shm` and `tcp;ofi_rxm`), ordered transport (the default) and unordered
/// alternating, `GIO_PROXY_BENCH_N` entries each. Run with `--ignored --nocapture` in
/// release mode.
#[test]
#[ignore = "a measurement; run by hand"]
fn throughput() {
    let n: u64 = std::env::var("GIO_PROXY_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000u64)
        .next_multiple_of(32);
    let provs = std::env::var("GIO_PROXY_BENCH_PROV").unwrap_or_else(|_| "shm,tcp;ofi_rxm".into());
    // GIO_PROXY_BENCH_WHAT / GIO_PROXY_BENCH_MODE narrow the runs (substring match).
    let filter = |var: &str, item: &str| std::env::var(var).map_or(true, |f| item.contains(&f));
    for prov in provs.split(',') {
        for what in ["put 8 B", "inline 8 B", "put 8 B + signal"] {
            for ordered in [true, false] {
                let mode = if ordered { "ordered" } else { "unordered" };
                if !filter("GIO_PROXY_BENCH_WHAT", what) || !filter("GIO_PROXY_BENCH_MODE", mode) {
                    continue;
                }
                let eps = throughput_run(prov, ordered, what, n);
                println!("{prov} {mode} {what}: {eps:.0} entries/s");
            }
        }
    }
}

fn throughput_run(prov: &str, ordered: bool, what: &str, n: u64) -> f64 {
    watchdog(600);
    let t = || {
        if ordered {
            FabricTransport::new_ordered(prov)
        } else {
            FabricTransport::new(prov)
        }
        .unwrap_or_else(|e| panic!("{prov}: {e}"))
    };
    let x = Pair::with_options(
        t(),
        t(),
        1024,
        1,
        T,
        gpunetio::proxy::CpuProxyBuilder::new().busy_poll(true),
    );
    x.a.start().unwrap();
    // The target's proxy thread progresses its endpoint (shm and rxm move data when
    // the target calls into them).
    x.b.start().unwrap();
    let start = Instant::now();
    for first in (0..n).step_by(32) {
        let ticket = x.p.reserve(32);
        for i in first..first + 32 {
            let off = (i % 1024) * 8;
            let e = match what {
                "put 8 B" => Entry::put(x.r, off, x.l, 0, 8),
                "inline 8 B" => Entry::put_inline(x.r, off, i, 8),
                _ => Entry::put(x.r, off, x.l, 0, 8).with_signal(x.s, 0, 1),
            };
            x.p.write(ticket + i - first, &e).unwrap();
        }
    }
    x.p.quiet().unwrap();
    let secs = start.elapsed().as_secs_f64();
    if what.ends_with("signal") {
        assert_eq!(x.sig.word(0).load(Ordering::Acquire), n);
    }
    assert!(x.a.take_error().is_none());
    n as f64 / secs
}

/// A transport that completes everything at once: what the ring and the proxy cost by
/// themselves (host producer thread + proxy thread).
struct NullTransport(Vec<u64>);

impl gpunetio::proxy::Transport for NullTransport {
    type Registration = ();
    fn kind(&self) -> gpunetio::proxy::TransportKind {
        gpunetio::proxy::TransportKind::FABRIC
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
            transport: gpunetio::proxy::TransportKind::FABRIC,
            addr: 0,
            len: 1 << 20,
            key: 0,
        }
    }
    fn post(
        &mut self,
        wr: &gpunetio::proxy::WorkRequest<'_, ()>,
    ) -> gpunetio::Result<gpunetio::proxy::Posted> {
        use gpunetio::proxy::WorkRequest::*;
        let (Write { wr_id, .. }
        | WriteInline { wr_id, .. }
        | Read { wr_id, .. }
        | AtomicAdd { wr_id, .. }) = *wr;
        self.0.push(wr_id);
        Ok(gpunetio::proxy::Posted::Yes)
    }
    fn poll(
        &mut self,
        out: &mut Vec<gpunetio::proxy::TransportCompletion>,
    ) -> gpunetio::Result<()> {
        out.extend(
            self.0
                .drain(..)
                .map(|wr_id| gpunetio::proxy::TransportCompletion {
                    wr_id,
                    result: Ok(()),
                }),
        );
        Ok(())
    }
}

/// Entries per second through the ring and the proxy alone (no network). Run with
/// `--ignored --nocapture` in release mode.
#[test]
#[ignore = "a measurement; run by hand"]
fn throughput_null_transport() {
    let n: u64 = 2_000_000;
    let ring = RingMemory::host(1024, 0).unwrap();
    let a = CpuProxy::new(NullTransport(Vec::new()), &ring).unwrap();
    let local = Buf::new(4096);
    // SAFETY: `local` outlives `a` (dropped at the end, after it).
    let l = unsafe { a.register_local(local.ptr(), local.len()).unwrap() };
    let r = a
        .add_remote(&a.with_transport(|t| gpunetio::proxy::Transport::descriptor(t, &())))
        .unwrap();
    a.start().unwrap();
    let p = HostProducer::new(&ring, T).unwrap();
    let start = Instant::now();
    for i in 0..n {
        p.post(&Entry::put(r, (i % 1024) * 8, l, 0, 8)).unwrap();
    }
    p.quiet().unwrap();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "null transport: {n} entries in {secs:.3} s = {:.0} entries/s",
        n as f64 / secs
    );
    drop(a);
}

/// A removed region: entries naming it are refused as out of bounds (never posted), and
/// memory placed again at the vacated index is used through it.
#[test]
fn removed_regions_are_refused_and_placed_again() {
    let x = pair("tcp;ofi_rxm", 16);
    x.a.remove_region(x.g).unwrap();
    assert!(x.a.remove_region(x.g).is_err(), "removed twice");
    bad_entry(&x, Entry::get(x.g, 0, x.r, 0, 64), GioStatus::BOUNDS);

    let y = pair("tcp;ofi_rxm", 16);
    y.a.remove_region(y.g).unwrap();
    // SAFETY: `y.get` outlives `y.a` (a field declared after the proxies).
    unsafe { y.a.register_local_at(y.g, y.get.ptr(), y.get.len()) }.unwrap();
    // SAFETY: as above; the index is taken, so nothing is registered.
    let taken = unsafe { y.a.register_local_at(y.l, y.get.ptr(), y.get.len()) };
    assert!(taken.is_err(), "placed over a live region");
    y.a.start().unwrap();
    let data = pattern(4096, 9);
    y.dst.write(0, &data);
    let t = y.p.post(&Entry::get(y.g, 0, y.r, 0, 4096)).unwrap();
    y.p.wait(t).unwrap();
    assert_eq!(
        y.get.read(0, 4096),
        data,
        "a get into the region placed again"
    );
}
