//! Helpers shared by the CPU proxy tests: memory the transports register, a proxy pair
//! (initiator `a` with a ring and a host producer standing in for the GPU, target `b`),
//! bounded waits.
#![allow(dead_code)]

use gpunetio::proxy::{
    CpuProxy, CpuProxyBuilder, DeviceCopy, Entry, GioStatus, HostProducer, RemoteDescriptor,
    RingMemory, Transport,
};
use gpunetio::Error;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

/// Bound on every wait of the tests.
pub const T: Duration = Duration::from_secs(20);

/// Aborts the test binary if it runs far too long (a hung completion must fail).
pub fn watchdog(secs: u64) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(secs));
            eprintln!("proxy tests: watchdog expired after {secs} s");
            std::process::abort();
        });
    });
}

/// 8-byte aligned memory that a transport reads and writes behind Rust's back: only
/// volatile or atomic accesses.
pub struct Buf {
    words: Box<[AtomicU64]>,
}

impl Buf {
    pub fn new(bytes: usize) -> Buf {
        Buf {
            words: (0..bytes.div_ceil(8)).map(|_| AtomicU64::new(0)).collect(),
        }
    }
    pub fn ptr(&self) -> *mut u8 {
        self.words.as_ptr() as *mut u8
    }
    pub fn len(&self) -> usize {
        self.words.len() * 8
    }
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len());
        // SAFETY: inside the buffer; volatile reads of memory a NIC may write.
        (0..len)
            .map(|i| unsafe { std::ptr::read_volatile(self.ptr().add(off + i)) })
            .collect()
    }
    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len());
        for (i, b) in data.iter().enumerate() {
            // SAFETY: inside the buffer.
            unsafe { std::ptr::write_volatile(self.ptr().add(off + i), *b) };
        }
    }
    pub fn word(&self, i: usize) -> &AtomicU64 {
        &self.words[i]
    }
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| {
            ((i as u64).wrapping_mul(131) ^ seed.wrapping_mul(0x9e37_79b9) ^ (i as u64 >> 8)) as u8
        })
        .collect()
}

/// Polls `cond` until it holds (bounded by [`T`]).
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

pub const SRC: usize = 256 << 10;
pub const DST: usize = 256 << 10;
pub const SIGNALS: usize = 64;

/// Initiator `a` (ring + producer) and target `b`, with `a`'s table holding: `l` = local
/// source/destination `src`, `r` = `b`'s `dst`, `s` = `b`'s signal words, `g` = a
/// second local buffer `get` (destination of gets).
pub struct Pair<X: Transport> {
    // Proxies first: fields drop in order, and registered memory must outlive them.
    pub a: CpuProxy<X>,
    pub b: CpuProxy<X>,
    pub ring: Arc<RingMemory>,
    pub p: HostProducer,
    pub l: u32,
    pub g: u32,
    pub r: u32,
    pub s: u32,
    pub src: Buf,
    pub get: Buf,
    pub dst: Buf,
    pub sig: Buf,
}

impl<X: Transport> Pair<X> {
    /// Builds the pair from two transports (`a`'s is given `ring_size` entries).
    pub fn new(ta: X, tb: X, ring_size: u32, counters: u32, producer_timeout: Duration) -> Self {
        Self::with_options(
            ta,
            tb,
            ring_size,
            counters,
            producer_timeout,
            CpuProxyBuilder::new(),
        )
    }

    /// As [`new`](Self::new), both proxies built from `options` (`a`'s staging set
    /// small on top).
    pub fn with_options(
        ta: X,
        tb: X,
        ring_size: u32,
        counters: u32,
        producer_timeout: Duration,
        options: CpuProxyBuilder,
    ) -> Self {
        let ring = RingMemory::host(ring_size, counters).unwrap();
        // Small bounce buffers, so staged transfers cycle through them.
        let a = options
            .clone()
            .staging_chunk(16 << 10)
            .staging_slots(4)
            .build(ta, &ring)
            .unwrap();
        let b = options.build(tb, &RingMemory::host(8, 0).unwrap()).unwrap();
        a.connect(&b.local_info().unwrap()).unwrap();
        b.connect(&a.local_info().unwrap()).unwrap();
        let (src, get, dst, sig) = (
            Buf::new(SRC),
            Buf::new(SRC),
            Buf::new(DST),
            Buf::new(SIGNALS * 8),
        );
        // SAFETY: the buffers are fields declared after the proxies: they outlive them.
        let (l, g, bd, bs) = unsafe {
            (
                a.register_local(src.ptr(), src.len()).unwrap(),
                a.register_local(get.ptr(), get.len()).unwrap(),
                b.register_local(dst.ptr(), dst.len()).unwrap(),
                b.register_local(sig.ptr(), sig.len()).unwrap(),
            )
        };
        // The descriptors travel as bytes, as they would between processes.
        let d = RemoteDescriptor::from_bytes(&b.descriptor(bd).unwrap().to_bytes()).unwrap();
        let r = a.add_remote(&d).unwrap();
        let s = a.add_remote(&b.descriptor(bs).unwrap()).unwrap();
        let p = HostProducer::new(&ring, producer_timeout).unwrap();
        Pair {
            a,
            b,
            ring,
            p,
            l,
            g,
            r,
            s,
            src,
            get,
            dst,
            sig,
        }
    }

    /// Drives `a` by hand until `ticket` completed.
    pub fn progress_until_complete(&self, ticket: u64) {
        wait_until("completion", || {
            self.a.cpu_proxy_progress().unwrap();
            self.p.poll(ticket).unwrap()
        });
    }
}

/// "Device memory" for staging tests: host bytes behind copy routines only.
pub struct FakeDevice {
    pub bytes: Mutex<Vec<u8>>,
    pub copies: AtomicU64,
}

impl FakeDevice {
    pub fn new(data: Vec<u8>) -> Arc<FakeDevice> {
        Arc::new(FakeDevice {
            bytes: Mutex::new(data),
            copies: AtomicU64::new(0),
        })
    }
}

impl DeviceCopy for FakeDevice {
    fn len(&self) -> u64 {
        self.bytes.lock().unwrap().len() as u64
    }
    fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> gpunetio::Result<()> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        let b = self.bytes.lock().unwrap();
        dst.copy_from_slice(&b[offset as usize..offset as usize + dst.len()]);
        Ok(())
    }
    fn copy_from_host(&self, offset: u64, src: &[u8]) -> gpunetio::Result<()> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        let mut b = self.bytes.lock().unwrap();
        b[offset as usize..offset as usize + src.len()].copy_from_slice(src);
        Ok(())
    }
}

// ---- scenarios, shared by every transport ------------------------------------------------

/// PUT (sizes and offsets), PUT_INLINE (1/2/4/8 B), GET, SIGNAL, counters; data verified
/// byte for byte. Proxy thread.
pub fn basic<X: Transport>(x: &Pair<X>) {
    x.a.start().unwrap();
    let data = pattern(SRC, 1);
    x.src.write(0, &data);
    for (i, &(len, src_off, dst_off)) in [
        (1usize, 0usize, 0usize),
        (7, 3, 100),
        (64, 64, 4096),
        (4096, 1000, 8192),
        (65536 + 3, 17, 20000),
        (SRC - 5, 5, 0),
    ]
    .iter()
    .enumerate()
    {
        let t =
            x.p.post(&Entry::put(
                x.r,
                dst_off as u64,
                x.l,
                src_off as u64,
                len as u64,
            ))
            .unwrap();
        x.p.wait(t).unwrap();
        assert_eq!(
            x.dst.read(dst_off, len),
            &data[src_off..src_off + len],
            "put {i}: {len} bytes"
        );
    }
    // Inline puts of 1, 2, 4 and 8 bytes leave their neighbours alone.
    x.dst.write(0, &[0xee; 64]);
    let value = 0x1122_3344_5566_7788u64;
    for (n, off) in [(1u64, 1usize), (2, 6), (4, 12), (8, 24)] {
        let t =
            x.p.post(&Entry::put_inline(x.r, off as u64, value, n))
                .unwrap();
        x.p.wait(t).unwrap();
        assert_eq!(
            x.dst.read(off, n as usize),
            &value.to_le_bytes()[..n as usize],
            "inline {n}"
        );
        assert_eq!(x.dst.read(off - 1, 1), [0xee], "byte before inline {n}");
        assert_eq!(
            x.dst.read(off + n as usize, 1),
            [0xee],
            "byte after inline {n}"
        );
    }
    // GET.
    let remote = pattern(30000, 2);
    x.dst.write(1000, &remote);
    let t =
        x.p.post(&Entry::get(x.g, 50, x.r, 1000, remote.len() as u64))
            .unwrap();
    x.p.wait(t).unwrap();
    assert_eq!(x.get.read(50, remote.len()), remote, "get");
    // SIGNAL adds.
    x.p.post(&Entry::signal(x.s, 8, 5)).unwrap();
    let t = x.p.post(&Entry::signal(x.s, 8, 6)).unwrap();
    x.p.wait(t).unwrap();
    assert_eq!(x.sig.word(1).load(Ordering::Acquire), 11);
    // Counters: bumped once per entry that completed.
    for _ in 0..3 {
        x.p.post(&Entry::put(x.r, 0, x.l, 0, 128).with_counter(0))
            .unwrap();
    }
    x.p.post(&Entry::get(x.g, 0, x.r, 0, 64).with_counter(1))
        .unwrap();
    x.p.post(&Entry::put_inline(x.r, 0, 1, 8).with_counter(1))
        .unwrap();
    x.p.post(&Entry::signal(x.s, 16, 1).with_counter(1))
        .unwrap();
    x.p.quiet().unwrap();
    assert_eq!(x.ring.counter(0).unwrap(), 3);
    assert_eq!(x.ring.counter(1).unwrap(), 3);
    assert!(x.ring.error().is_none());
    assert!(x.a.take_error().is_none());
}

/// PUT + SIGNAL: a consumer that sees the signal sees the data (it polls the signal word
/// of its own memory, then checks the slot), over `rounds` rounds of 32 slots.
pub fn put_signal_order<X: Transport>(x: &Pair<X>, rounds: u64) {
    const SLOT: usize = DST / 32;
    x.a.start().unwrap();
    let checked = AtomicU64::new(0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for round in 0..rounds {
                for i in 0..32u64 {
                    let want = round * 32 + i + 1;
                    wait_until("signal", || x.sig.word(0).load(Ordering::Acquire) >= want);
                    let expect = pattern(SLOT, round * 1000 + i);
                    assert_eq!(
                        x.dst.read(i as usize * SLOT, SLOT),
                        expect,
                        "round {round} slot {i}: signal seen before its data"
                    );
                    checked.store(want, Ordering::Release);
                }
            }
        });
        for round in 0..rounds {
            // The consumer checked the previous round before its slots are reused.
            wait_until("consumer", || checked.load(Ordering::Acquire) >= round * 32);
            for i in 0..32u64 {
                let off = i as usize * SLOT;
                x.src.write(off, &pattern(SLOT, round * 1000 + i));
                let t =
                    x.p.post(
                        &Entry::put(x.r, off as u64, x.l, off as u64, SLOT as u64)
                            .with_signal(x.s, 0, 1),
                    )
                    .unwrap();
                // The source may be rewritten only after the put completed (a round
                // later); waiting here keeps the test simple.
                if i == 31 {
                    x.p.wait(t).unwrap();
                }
            }
        }
    });
    assert_eq!(x.sig.word(0).load(Ordering::Acquire), rounds * 32);
}

/// FENCE: a get after a fence reads what the put before it wrote.
pub fn fence<X: Transport>(x: &Pair<X>) {
    x.a.start().unwrap();
    for seed in 0..4 {
        let data = pattern(65536, 10 + seed);
        x.src.write(0, &data);
        x.p.post(&Entry::put(x.r, 0, x.l, 0, 65536)).unwrap();
        x.p.post(&Entry::fence()).unwrap();
        let t = x.p.post(&Entry::get(x.g, 0, x.r, 0, 65536)).unwrap();
        x.p.wait(t).unwrap();
        assert_eq!(x.get.read(0, 65536), data, "fence round {seed}");
    }
}

/// A ring of 8 entries carries `ops` operations (wraparound), counters and data checked.
pub fn wraparound<X: Transport>(x: &Pair<X>, ops: u64) {
    assert_eq!(x.ring.ring_size(), 8);
    x.a.start().unwrap();
    for i in 0..ops {
        let word = i % 512;
        let e = if i % 97 == 0 {
            x.src.write(4096, &pattern(256, i));
            // The source is reused: wait for this one.
            let t =
                x.p.post(&Entry::put(x.r, 8192, x.l, 4096, 256).with_counter(0))
                    .unwrap();
            x.p.wait(t).unwrap();
            assert_eq!(x.dst.read(8192, 256), pattern(256, i));
            continue;
        } else {
            Entry::put_inline(x.r, word * 8, i + 1, 8).with_counter(0)
        };
        x.p.post(&e).unwrap();
    }
    x.p.quiet().unwrap();
    assert_eq!(x.ring.completed(), ops);
    assert_eq!(x.ring.counter(0).unwrap(), ops);
    for word in 0..512u64.min(ops) {
        let last = (0..ops).rev().find(|i| i % 512 == word && i % 97 != 0);
        if let Some(last) = last {
            let got = u64::from_le_bytes(x.dst.read(word as usize * 8, 8).try_into().unwrap());
            assert_eq!(got, last + 1, "word {word}");
        }
    }
}

/// Warp-like batches (1 to 13 tickets reserved at once, then written) on a ring of 16:
/// batches straddle the ring's end, and each mixes puts, inline puts, puts with a
/// signal and signals. Every entry's data, every signal and both counters checked.
pub fn batched_wraparound<X: Transport>(x: &Pair<X>, batches: u64) {
    assert_eq!(x.ring.ring_size(), 16);
    x.a.start().unwrap();
    // Every put reads the same 64 source bytes; each entry owns a 64-byte destination
    // slot (slots are reused every 512 entries, after a quiet).
    let src = pattern(64, 99);
    x.src.write(0, &src);
    let (mut ticket, mut signals, mut counted) = (0u64, 0u64, 0u64);
    let mut expect: Vec<(usize, Vec<u8>)> = Vec::new();
    for b in 0..batches {
        let n = 1 + (b * 7 % 13) as u32;
        let first = x.p.reserve(n);
        assert_eq!(first, ticket);
        for i in 0..n as u64 {
            let t = first + i;
            let slot = (t % 512) as usize * 64;
            let e = match t % 4 {
                0 => {
                    expect.push((slot, src.clone()));
                    Entry::put(x.r, slot as u64, x.l, 0, 64)
                }
                1 => {
                    expect.push((slot, t.to_le_bytes().to_vec()));
                    Entry::put_inline(x.r, slot as u64, t, 8)
                }
                2 => {
                    signals += 1;
                    expect.push((slot, src.clone()));
                    Entry::put(x.r, slot as u64, x.l, 0, 64).with_signal(x.s, 8, 1)
                }
                _ => {
                    signals += 1;
                    Entry::signal(x.s, 8, 1)
                }
            };
            let e = if t.is_multiple_of(3) {
                counted += 1;
                e.with_counter(2)
            } else {
                e
            };
            x.p.write(t, &e).unwrap();
        }
        ticket += n as u64;
        if ticket / 512 != (ticket + 13) / 512 || b + 1 == batches {
            x.p.quiet().unwrap();
            for (off, bytes) in expect.drain(..) {
                assert_eq!(x.dst.read(off, bytes.len()), bytes, "slot at {off}");
            }
            x.dst.write(0, &vec![0; 512 * 64]);
        }
    }
    assert_eq!(x.ring.completed(), ticket);
    assert_eq!(x.sig.word(1).load(Ordering::Acquire), signals);
    assert_eq!(x.ring.counter(2).unwrap(), counted);
    assert!(x.ring.error().is_none());
}

/// A full ring blocks the producer while nobody runs the proxy; starting the proxy
/// resumes it and nothing is lost.
pub fn back_pressure<X: Transport>(x: &Pair<X>) {
    assert_eq!(x.ring.ring_size(), 8);
    let posted = AtomicU64::new(0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for i in 0..40u64 {
                x.p.post(&Entry::put_inline(x.r, i * 8, i + 100, 8))
                    .unwrap();
                posted.fetch_add(1, Ordering::Release);
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            posted.load(Ordering::Acquire),
            8,
            "the producer did not block on a full ring"
        );
        assert_eq!(x.ring.consumed(), 0);
        x.a.start().unwrap();
    });
    x.p.quiet().unwrap();
    for i in 0..40u64 {
        let got = u64::from_le_bytes(x.dst.read(i as usize * 8, 8).try_into().unwrap());
        assert_eq!(got, i + 100, "word {i}");
    }
}

/// A bad entry between two good ones: the first completes, the bad one sets
/// `ctrl.error` with its ticket and the host error, and nothing after it is posted.
pub fn bad_entry<X: Transport>(x: &Pair<X>, bad: Entry, status: GioStatus) {
    x.src.write(0, &pattern(256, 3));
    let t0 = x.p.post(&Entry::put(x.r, 0, x.l, 0, 256)).unwrap();
    let t1 = x.p.post(&bad).unwrap();
    let t2 = x.p.post(&Entry::put(x.r, 4096, x.l, 0, 256)).unwrap();
    assert_eq!((t0, t1, t2), (0, 1, 2));
    let deadline = Instant::now() + T;
    let err = loop {
        match x.a.cpu_proxy_progress() {
            Ok(_) => assert!(Instant::now() < deadline, "no refusal"),
            Err(e) => break e,
        }
    };
    match err {
        Error::BadEntry {
            ticket: 1,
            status: s,
            ref reason,
        } => {
            assert_eq!(s, status, "{reason}");
        }
        other => panic!("expected BadEntry at ticket 1 with {status}, got {other:?}"),
    }
    assert_eq!(x.ring.error(), Some((status, 1)));
    // Later rounds report the ring's status; the entry before completes.
    wait_until("the entry before the bad one", || {
        match x.a.cpu_proxy_progress() {
            Err(Error::RingFailed {
                status: s,
                ticket: 1,
            }) => assert_eq!(s, status),
            other => panic!("after a refusal: {other:?}"),
        }
        x.ring.completed() == 1
    });
    assert_eq!(x.dst.read(0, 256), pattern(256, 3));
    for _ in 0..50 {
        let _ = x.a.cpu_proxy_progress();
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        x.dst.read(4096, 256),
        vec![0; 256],
        "an entry after the bad one was posted"
    );
    assert_eq!(x.ring.completed(), 1);
    assert_eq!(
        x.ring.consumed(),
        1,
        "the bad entry and those after it stay on the ring"
    );
    match x.p.wait(t2) {
        Err(Error::RingFailed {
            status: s,
            ticket: 1,
        }) => assert_eq!(s, status),
        other => panic!("producer wait after a refusal: {other:?}"),
    }
}

/// Every refusal the proxy checks, each on a fresh pair from `make`.
pub fn bad_entries<X: Transport>(make: impl Fn() -> Pair<X>) {
    let probe = make();
    let (l, r, s) = (probe.l, probe.r, probe.s);
    drop(probe);
    let mut raw = Entry::nop().0;
    raw.opcode = 9;
    let cases = [
        ("bad opcode", Entry::raw(raw), GioStatus::BAD_ENTRY),
        (
            "inline of 3 bytes",
            Entry::put_inline(r, 0, 1, 3),
            GioStatus::BAD_ENTRY,
        ),
        (
            "mr index out of range",
            Entry::put(40, 0, l, 0, 8),
            GioStatus::BOUNDS,
        ),
        (
            "range out of bounds",
            Entry::put(r, DST as u64 - 4, l, 0, 8),
            GioStatus::BOUNDS,
        ),
        (
            "misaligned signal",
            Entry::signal(s, 4, 1),
            GioStatus::BOUNDS,
        ),
        (
            "misaligned put signal",
            Entry::put(r, 0, l, 0, 8).with_signal(s, 12, 1),
            GioStatus::BOUNDS,
        ),
        (
            "local used as remote",
            Entry::put(l, 0, l, 0, 8),
            GioStatus::BOUNDS,
        ),
        (
            "remote used as local",
            Entry::get(r, 0, r, 0, 8),
            GioStatus::BOUNDS,
        ),
        (
            "counter out of range",
            Entry::put(r, 0, l, 0, 8).with_counter(99),
            GioStatus::BOUNDS,
        ),
    ];
    for (what, entry, status) in cases {
        eprintln!("bad entry: {what}");
        bad_entry(&make(), entry, status);
    }
}

/// A producer whose wait runs past its bound gets a typed timeout; shutdown ends waits
/// with `Error::Shutdown`.
pub fn timeout_and_shutdown<X: Transport>(x: &Pair<X>) {
    let p = HostProducer::new(&x.ring, Duration::from_millis(100)).unwrap();
    let t = p.post(&Entry::put(x.r, 0, x.l, 0, 8)).unwrap();
    let start = Instant::now();
    match p.wait(t) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(start.elapsed() >= Duration::from_millis(100));
    x.a.shutdown();
    assert!(matches!(p.wait(t), Err(Error::Shutdown)));
    // The proxy takes nothing more once shut down.
    x.a.cpu_proxy_progress().unwrap();
    assert_eq!(x.ring.consumed(), 0);
}

/// Local memory the transport cannot register, staged through bounce buffers (4 × 16
/// KiB): puts copied out chunk by chunk, gets copied in; a staged region has no
/// descriptor for a peer.
pub fn staged<X: Transport>(x: &Pair<X>) {
    let data = pattern(200_000, 7);
    let mut init = data.clone();
    init.extend(vec![0u8; 100_000]);
    let dev = FakeDevice::new(init);
    let d = x.a.register_staged(dev.clone()).unwrap();
    assert!(matches!(x.a.descriptor(d), Err(Error::Unsupported(_))));
    x.a.start().unwrap();
    let t =
        x.p.post(&Entry::put(x.r, 100, d, 0, 200_000).with_signal(x.s, 0, 1))
            .unwrap();
    x.p.wait(t).unwrap();
    assert_eq!(x.dst.read(100, 200_000), data);
    assert_eq!(x.sig.word(0).load(Ordering::Acquire), 1);
    let back = pattern(99_000, 8);
    x.dst.write(0, &back);
    let t =
        x.p.post(&Entry::get(d, 200_500, x.r, 0, 99_000).with_counter(0))
            .unwrap();
    x.p.wait(t).unwrap();
    assert_eq!(&dev.bytes.lock().unwrap()[200_500..299_500], &back[..]);
    assert_eq!(x.ring.counter(0).unwrap(), 1);
    // 13 chunks out, 7 in.
    assert_eq!(dev.copies.load(Ordering::Relaxed), 13 + 7);
}

/// A put to the peer's region with a wrong key fails on the transport: `ctrl.error` =
/// `GIO_ERR_TRANSPORT` (or `GIO_ERR_PEER_GONE` where the transport reads the refusal as a
/// lost connection) and the typed host error. Returns the host error.
pub fn bad_key<X: Transport>(x: &Pair<X>) -> Error {
    let mut d = x.b.descriptor(0).unwrap_or_else(|_| {
        // b's first region is dst (index 0 of b's table).
        unreachable!()
    });
    d.key ^= 0x5a5a_1234;
    let bad = x.a.add_remote(&d).unwrap();
    let t = x.p.post(&Entry::put(bad, 0, x.l, 0, 64)).unwrap();
    let deadline = Instant::now() + T;
    let err = loop {
        match x.a.cpu_proxy_progress() {
            Ok(_) => assert!(
                Instant::now() < deadline,
                "a put with a wrong key did not fail"
            ),
            Err(e) => break e,
        }
    };
    let status = match &err {
        Error::EntryFailed { ticket, status, .. } => {
            assert_eq!(*ticket, t);
            *status
        }
        other => panic!("expected EntryFailed, got {other:?}"),
    };
    assert!(
        status == GioStatus::TRANSPORT || status == GioStatus::PEER_GONE,
        "{status}"
    );
    assert_eq!(x.ring.error(), Some((status, t)));
    assert!(matches!(x.p.wait(t), Err(Error::RingFailed { .. })));
    err
}
