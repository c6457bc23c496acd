//! The RDM provider matrix in one process: every data operation a provider advertises,
//! verified byte for byte; the ones it does not advertise asserted absent.

mod common;

use common::*;
use fabric::ffi;
use fabric::{
    Access, Address, AtomicDatatype, AtomicOp, Caps, CompletionQueue, Counter, CqFormat,
    EndpointBuilder, Error, RegisteredBuffer, RemoteMemory, WaitObj, WriteOp,
};
use std::ptr;
use std::time::{Duration, Instant};

const ALL: Access = Access::ALL;

fn filled(node: &Node, len: usize, seed: u8) -> RegisteredBuffer {
    let mut buf = node
        .ep
        .alloc_registered(len, ALL)
        .expect("alloc_registered");
    buf.as_mut_slice()
        .expect("unused")
        .copy_from_slice(&pattern(len, seed));
    buf
}

/// Polls `node`'s CQ for the completion with `context`.
fn wait(node: &Node, context: u64) -> fabric::Completion {
    node.cq
        .wait_for(context, T)
        .unwrap_or_else(|e| panic!("waiting for {context}: {e}"))
}

fn send_recv(prov: &str) {
    watchdog(300);
    let (a, b, b_at_a, _) = pair(prov, base_caps());
    assert!(a.info.caps().contains(Caps::MSG));
    let len = 64 * 1024;
    let src = filled(&a, len, 1);
    let dst = b.ep.alloc_registered(len, ALL).unwrap();
    b.ep.recv(&dst, 0..len, Address::UNSPEC, 11).unwrap();
    let deadline = Instant::now() + T;
    a.ep.retry(deadline, || a.ep.send(&src, 0..len, b_at_a, 12))
        .unwrap();
    let c = wait(&b, 11);
    assert!(c.has(ffi::FI_RECV) && c.has(ffi::FI_MSG), "{c:?}");
    assert_eq!(c.len, len);
    assert!(wait(&a, 12).has(ffi::FI_SEND));
    assert!(
        dst.to_vec_volatile() == src.as_slice(),
        "{prov}: received bytes differ"
    );
    assert!(
        !dst.in_use() && !src.in_use(),
        "completions release the buffers"
    );
}

fn tagged(prov: &str) {
    watchdog(300);
    let (a, b, b_at_a, _) = pair(prov, base_caps());
    assert!(a.info.caps().contains(Caps::TAGGED));
    let len = 4096;
    let s1 = filled(&a, len, 2);
    let s2 = filled(&a, len, 3);
    let r1 = b.ep.alloc_registered(len, ALL).unwrap();
    let r2 = b.ep.alloc_registered(len, ALL).unwrap();
    // Receives posted in the opposite order of the sends: matching is by tag.
    b.ep.trecv(&r2, 0..len, Address::UNSPEC, 0x22, 0, 2)
        .unwrap();
    b.ep.trecv(&r1, 0..len, Address::UNSPEC, 0x11, 0, 1)
        .unwrap();
    let deadline = Instant::now() + T;
    a.ep.retry(deadline, || a.ep.tsend(&s1, 0..len, b_at_a, 0x11, 3))
        .unwrap();
    a.ep.retry(deadline, || a.ep.tsend(&s2, 0..len, b_at_a, 0x22, 4))
        .unwrap();
    let c1 = wait(&b, 1);
    let c2 = wait(&b, 2);
    assert!(c1.has(ffi::FI_TAGGED) && c1.has(ffi::FI_RECV), "{c1:?}");
    assert_eq!((c1.tag, c2.tag), (0x11, 0x22));
    wait(&a, 3);
    wait(&a, 4);
    assert!(r1.to_vec_volatile() == s1.as_slice());
    assert!(r2.to_vec_volatile() == s2.as_slice());
}

fn inject(prov: &str) {
    watchdog(300);
    let (a, b, b_at_a, _) = pair(prov, base_caps());
    let n = a.info.inject_size().min(64);
    assert!(n > 0, "{prov}: inject_size 0");
    let r1 = b.ep.alloc_registered(n, ALL).unwrap();
    let r2 = b.ep.alloc_registered(n, ALL).unwrap();
    let r3 = b.ep.alloc_registered(n, ALL).unwrap();
    b.ep.recv(&r1, 0..n, Address::UNSPEC, 1).unwrap();
    b.ep.recv(&r2, 0..n, Address::UNSPEC, 2).unwrap();
    b.ep.trecv(&r3, 0..n, Address::UNSPEC, 7, 0, 3).unwrap();
    let deadline = Instant::now() + T;
    let d1 = pattern(n, 4);
    let d2 = pattern(n, 5);
    let d3 = pattern(n, 6);
    a.ep.retry(deadline, || a.ep.inject(&d1, b_at_a)).unwrap();
    a.ep.retry(deadline, || a.ep.injectdata(&d2, 0xfeed, b_at_a))
        .unwrap();
    a.ep.retry(deadline, || a.ep.tinject(&d3, b_at_a, 7))
        .unwrap();
    wait(&b, 1);
    let c2 = wait(&b, 2);
    assert!(c2.has(ffi::FI_REMOTE_CQ_DATA), "{c2:?}");
    assert_eq!(c2.data, 0xfeed);
    assert_eq!(wait(&b, 3).tag, 7);
    assert_eq!(r1.to_vec_volatile(), d1);
    assert_eq!(r2.to_vec_volatile(), d2);
    assert_eq!(r3.to_vec_volatile(), d3);
    // Injects produce no completion at the initiator.
    assert!(a.cq.read_one().unwrap().is_none());
}

fn rma(prov: &str) {
    watchdog(300);
    let (a, b, b_at_a, _) = pair(prov, base_caps());
    assert!(a.info.caps().contains(Caps::RMA));
    let len = 1 << 20;
    let src = filled(&a, len, 7);
    let target = filled(&b, len, 0);
    let remote = RemoteMemory::from_bytes(&target.remote().to_bytes()).unwrap();
    // Write 1 MiB; the target does nothing (background progress).
    let c =
        a.ep.write_sync(&src, 0..len, b_at_a, &remote, 0, 21, T)
            .unwrap();
    assert!(c.has(ffi::FI_WRITE | ffi::FI_RMA), "{c:?}");
    let deadline = Instant::now() + T;
    while target.to_vec_volatile() != src.as_slice() {
        assert!(
            Instant::now() < deadline,
            "{prov}: written bytes did not arrive"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Read back a window at an offset.
    let back = a.ep.alloc_registered(len, ALL).unwrap();
    let c =
        a.ep.read_sync(&back, 0..4096, b_at_a, &remote, 8192, 22, T)
            .unwrap();
    assert!(c.has(ffi::FI_READ | ffi::FI_RMA), "{c:?}");
    assert_eq!(
        &back.to_vec_volatile()[..4096],
        &src.as_slice()[8192..8192 + 4096]
    );
    // inject_write: small, copied, no completion.
    let small = pattern(16, 9);
    a.ep.retry(deadline, || a.ep.inject_write(&small, b_at_a, &remote, 100))
        .unwrap();
    while target.to_vec_volatile()[100..116] != small[..] {
        assert!(
            Instant::now() < deadline,
            "{prov}: inject_write did not arrive"
        );
        a.ep.progress();
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn writedata(prov: &str) {
    watchdog(300);
    let (a, b, b_at_a, _) = pair(prov, base_caps());
    assert_eq!(a.info.cq_data_size(), 8, "{prov}: cq_data_size");
    let len = 64 * 1024;
    let src = filled(&a, len, 8);
    let target = filled(&b, len, 0);
    let deadline = Instant::now() + T;
    a.ep.retry(deadline, || {
        a.ep.writedata(
            &src,
            0..len,
            0xabcd_0123_4567_89ef,
            b_at_a,
            &target.remote(),
            0,
            31,
        )
    })
    .unwrap();
    wait(&a, 31);
    // The remote CQ data arrives as a completion at the target.
    let got = loop {
        if let Some(c) = b.cq.read_one().unwrap() {
            break c;
        }
        assert!(
            Instant::now() < deadline,
            "{prov}: no FI_REMOTE_CQ_DATA completion"
        );
    };
    assert!(got.has(ffi::FI_REMOTE_CQ_DATA), "{got:?}");
    assert_eq!(got.data, 0xabcd_0123_4567_89ef);
    assert!(target.to_vec_volatile() == src.as_slice());
}

fn write_batch(prov: &str) {
    watchdog(300);
    let (a, b, b_at_a, _) = pair(prov, base_caps());
    let len = 4 * 16384;
    let src = filled(&a, len, 10);
    let target = filled(&b, len, 0);
    let remote = target.remote();
    let ops: Vec<WriteOp<'_>> = (0..4)
        .map(|i| WriteOp {
            buf: &src,
            range: i * 16384..(i + 1) * 16384,
            dest: b_at_a,
            remote,
            remote_offset: (i * 16384) as u64,
            context: 40 + i as u64,
        })
        .collect();
    let deadline = Instant::now() + T;
    a.ep.retry(deadline, || a.ep.write_batch(&ops)).unwrap();
    let done = a.cq.wait_n(4, T).unwrap();
    let mut ctx: Vec<u64> = done.iter().map(|c| c.context).collect();
    ctx.sort_unstable();
    assert_eq!(ctx, vec![40, 41, 42, 43]);
    let deadline = Instant::now() + T;
    while target.to_vec_volatile() != src.as_slice() {
        assert!(
            Instant::now() < deadline,
            "{prov}: batched writes did not arrive"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn atomics(prov: &str, offered: bool) {
    watchdog(300);
    let asked = rdm_info(prov, base_caps() | Caps::ATOMIC);
    if !offered {
        // Absent: asserted, not skipped.
        match asked {
            Err(Error::Unsupported {
                call: "fi_getinfo", ..
            }) => {}
            other => panic!("{prov}: atomics not expected, but discovery gave {other:?}"),
        }
        return;
    }
    assert!(asked
        .expect("atomic discovery")
        .caps()
        .contains(Caps::ATOMIC));
    let (a, b, b_at_a, _) = pair(prov, base_caps() | Caps::ATOMIC);
    assert!(
        a.ep.atomic_valid(AtomicDatatype::U64, AtomicOp::SUM)
            .unwrap()
            >= 1
    );
    let target = b.ep.alloc_registered(64, ALL).unwrap();
    let operand = a.ep.alloc_registered(8, ALL).unwrap();
    let result = a.ep.alloc_registered(8, ALL).unwrap();
    let compare = a.ep.alloc_registered(8, ALL).unwrap();
    let mut operand = operand;
    operand
        .as_mut_slice()
        .unwrap()
        .copy_from_slice(&5u64.to_ne_bytes());
    let remote = target.remote();
    let deadline = Instant::now() + T;
    for i in 0..3u64 {
        a.ep.retry(deadline, || {
            a.ep.atomic(
                &operand,
                0..8,
                b_at_a,
                &remote,
                0,
                AtomicDatatype::U64,
                AtomicOp::SUM,
                50 + i,
            )
        })
        .unwrap();
        wait(&a, 50 + i);
    }
    // fetch-add returns 15 and leaves 20.
    a.ep.retry(deadline, || {
        a.ep.fetch_atomic(
            &operand,
            0..8,
            &result,
            0,
            b_at_a,
            &remote,
            0,
            AtomicDatatype::U64,
            AtomicOp::SUM,
            60,
        )
    })
    .unwrap();
    wait(&a, 60);
    assert_eq!(
        u64::from_ne_bytes(result.to_vec_volatile().try_into().unwrap()),
        15
    );
    // compare-and-swap 20 -> 5.
    let mut compare = compare;
    compare
        .as_mut_slice()
        .unwrap()
        .copy_from_slice(&20u64.to_ne_bytes());
    a.ep.retry(deadline, || {
        a.ep.compare_atomic(
            &operand,
            0..8,
            &compare,
            &result,
            b_at_a,
            &remote,
            0,
            AtomicDatatype::U64,
            AtomicOp::CSWAP,
            61,
        )
    })
    .unwrap();
    wait(&a, 61);
    assert_eq!(
        u64::from_ne_bytes(result.to_vec_volatile().try_into().unwrap()),
        20
    );
    let v = u64::from_ne_bytes(target.to_vec_volatile()[..8].try_into().unwrap());
    assert_eq!(v, 5, "{prov}: value after CSWAP");
}

fn counters(prov: &str) {
    watchdog(300);
    let info = rdm_info(prov, base_caps()).unwrap();
    let b = Node::new(prov, base_caps());
    let fabric = fabric::Fabric::new(&info).unwrap();
    let domain = fabric::Domain::new(&fabric, &info).unwrap();
    let cq = CompletionQueue::builder().open(&domain).unwrap();
    let av = fabric::AddressVector::new(&domain, fabric::AvType::Table, 4).unwrap();
    let cntr = Counter::new(&domain).unwrap();
    let ep = EndpointBuilder::new(&domain, &info)
        .cq(&cq)
        .av(&av)
        .counter(&cntr, Access::WRITE)
        .build()
        .unwrap();
    let dest = av.insert(&b.ep.name().unwrap()).unwrap();
    let src = ep.alloc_registered(4096, ALL).unwrap();
    let target = b.ep.alloc_registered(4096, ALL).unwrap();
    for i in 0..3 {
        ep.write_sync(&src, 0..4096, dest, &target.remote(), 0, 70 + i, T)
            .unwrap();
    }
    cntr.wait(3, T).unwrap();
    assert_eq!(cntr.read(), 3);
    assert_eq!(cntr.read_err(), 0);
    cntr.add(2).unwrap();
    assert_eq!(cntr.read(), 5);
    cntr.set(0).unwrap();
    assert_eq!(cntr.read(), 0);
    assert!(matches!(
        cntr.wait(1, Duration::from_millis(50)),
        Err(Error::TimedOut { .. })
    ));
}

/// A pair whose operations complete only once delivered at the target
/// (`FI_DELIVERY_COMPLETE`), so target-side errors reach the initiator's completion.
fn delivery_pair(prov: &str) -> (Node, Node, Address) {
    let info = || {
        hints(prov, fabric::EndpointType::RDM, base_caps())
            .tx_op_flags(ffi::FI_DELIVERY_COMPLETE)
            .get_first()
            .unwrap_or_else(|e| panic!("{prov}: FI_DELIVERY_COMPLETE: {e}"))
    };
    let a = Node::from_info(info());
    let b = Node::from_info(info());
    let b_at_a = a.av.insert(&b.ep.name().unwrap()).unwrap();
    b.av.insert(&a.ep.name().unwrap()).unwrap();
    (a, b, b_at_a)
}

/// How a provider reports an RMA that the target must refuse.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Refusal {
    /// An error completion at the initiator (tcp;ofi_rxm, sockets, shm out of range).
    CompletionError,
    /// The key is not checked: the write lands (shm: FI_MR_VIRT_ADDR writes through CMA).
    Unchecked,
    /// The target drops it and the operation never completes: the bounded wait ends in
    /// `Error::TimedOut` (udp;ofi_rxd).
    NeverCompletes,
}

fn expect_refusal(
    prov: &str,
    what: &str,
    expect: Refusal,
    result: fabric::Result<fabric::Completion>,
    context: u64,
) {
    match (expect, result) {
        (Refusal::CompletionError, Err(err)) => {
            let c = err
                .completion_error()
                .unwrap_or_else(|| panic!("{prov} {what}: not a completion error: {err:?}"));
            assert!(c.errno > 0, "{prov} {what}: {c}");
            assert!(!c.message.is_empty());
            // shm's error entries lose the context; the others keep it.
            assert!(c.context == context || prov == "shm", "{prov} {what}: {c}");
        }
        (Refusal::Unchecked, Ok(c)) => assert_eq!(c.context, context),
        (Refusal::NeverCompletes, Err(Error::TimedOut { .. })) => {}
        (expect, got) => panic!("{prov} {what}: expected {expect:?}, got {got:?}"),
    }
}

/// The pair for refusal tests: `FI_DELIVERY_COMPLETE` so target-side errors reach the
/// initiator, except on shm, which never completes a refused write with it.
fn refusal_pair(prov: &str) -> (Node, Node, Address) {
    if prov == "shm" {
        let (a, b, b_at_a, _) = pair(prov, base_caps());
        (a, b, b_at_a)
    } else {
        delivery_pair(prov)
    }
}

fn wrong_key(prov: &str, expect: Refusal) {
    watchdog(300);
    let (a, b, b_at_a) = refusal_pair(prov);
    let src = filled(&a, 4096, 11);
    let target = b.ep.alloc_registered(4096, ALL).unwrap();
    let mut bad = target.remote();
    bad.key ^= 0x5a5a_0000_00a5;
    let timeout = if expect == Refusal::NeverCompletes {
        Duration::from_secs(3)
    } else {
        T
    };
    let result = a.ep.write_sync(&src, 0..4096, b_at_a, &bad, 0, 80, timeout);
    expect_refusal(prov, "wrong key", expect, result, 80);
    if expect != Refusal::Unchecked {
        assert!(
            target.to_vec_volatile().iter().all(|&x| x == 0),
            "{prov}: bytes landed with a wrong key"
        );
    }
}

/// One registered page followed by an inaccessible guard page, so a write past the region
/// faults instead of corrupting memory.
struct Guarded {
    mr: Option<fabric::MemoryRegion>,
    base: *mut libc::c_void,
}

impl Guarded {
    fn new(node: &Node) -> Guarded {
        // SAFETY: a fresh private anonymous mapping of two pages.
        let base = unsafe {
            libc::mmap(
                ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: the second page of the mapping.
        let protected =
            unsafe { libc::mprotect(base.cast::<u8>().add(4096).cast(), 4096, libc::PROT_NONE) };
        assert_eq!(protected, 0);
        // SAFETY: the first page stays mapped until the region is dropped (Drop below).
        let mr = unsafe {
            fabric::MemoryRegion::reg_raw(
                &node.domain,
                Some(&node.ep),
                base.cast(),
                4096,
                ALL,
                fabric::HmemIface::System,
            )
        }
        .unwrap();
        Guarded { mr: Some(mr), base }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        drop(self.mr.take());
        // SAFETY: the mapping made in new(); the region covering it is closed.
        unsafe { libc::munmap(self.base, 8192) };
    }
}

fn out_of_range(prov: &str, expect: Refusal) {
    watchdog(300);
    let (a, b, b_at_a) = refusal_pair(prov);
    let src = filled(&a, 8192, 12);
    let target = Guarded::new(&b);
    let remote = target.mr.as_ref().unwrap().remote();
    // Checked by the crate before posting...
    let err =
        a.ep.write(&src, 0..8192, b_at_a, &remote, 0, 90)
            .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                call: "fi_write",
                ..
            }
        ),
        "{err:?}"
    );
    // ...and by the provider when the peer lies about the length.
    let lying = RemoteMemory {
        len: 1 << 30,
        ..remote
    };
    let timeout = if expect == Refusal::NeverCompletes {
        Duration::from_secs(3)
    } else {
        T
    };
    let result =
        a.ep.write_sync(&src, 0..8192, b_at_a, &lying, 0, 91, timeout);
    expect_refusal(prov, "out of range", expect, result, 91);
    // Keep the target's objects alive until the initiator is done.
    drop(a);
    drop(target);
}

fn av_and_cq(prov: &str) {
    watchdog(300);
    let (a, b, b_at_a, _) = pair(prov, base_caps());
    let name = b.ep.name().unwrap();
    match a.av.lookup(b_at_a) {
        Ok(raw) => assert_eq!(raw, name),
        // rxd keeps no reverse mapping in 1.17: its fi_av_lookup answers FI_ENODATA.
        Err(Error::Call { errno, .. }) if prov == "udp;ofi_rxd" => {
            assert_eq!(errno, ffi::FI_ENODATA)
        }
        Err(e) => panic!("{prov}: fi_av_lookup: {e}"),
    }
    assert!(!a.av.straddr(&name).is_empty());
    a.av.remove(&[b_at_a]).unwrap();
    // A queue with a wait object: sread times out when empty, then returns a completion.
    let cq = CompletionQueue::builder()
        .format(CqFormat::Data)
        .wait_obj(WaitObj::Unspec)
        .open(&a.domain)
        .unwrap();
    let mut out = [fabric::Completion::default(); 4];
    assert!(matches!(
        cq.sread(&mut out, Duration::from_millis(20)),
        Err(Error::TimedOut { .. })
    ));
    let av = fabric::AddressVector::new(&a.domain, fabric::AvType::Map, 4).unwrap();
    let ep = EndpointBuilder::new(&a.domain, &a.info)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap();
    let dest = av.insert(&name).unwrap();
    let src = ep.alloc_registered(1024, ALL).unwrap();
    let target = b.ep.alloc_registered(1024, ALL).unwrap();
    ep.retry(Instant::now() + T, || {
        ep.write(&src, 0..1024, dest, &target.remote(), 0, 5)
    })
    .unwrap();
    let n = cq.sread(&mut out, T).unwrap();
    assert_eq!(n, 1);
    assert_eq!(out[0].context, 5);
    // A queue with an fd.
    let fd_cq = CompletionQueue::builder()
        .wait_obj(WaitObj::Fd)
        .open(&a.domain);
    match fd_cq {
        Ok(q) => match q.wait_fd() {
            Ok(fd) => assert!(fd >= 0),
            // rxd opens the queue but has no fd to give.
            Err(Error::Unsupported { .. }) if prov == "udp;ofi_rxd" => {}
            Err(e) => panic!("{prov}: FI_GETWAIT: {e}"),
        },
        Err(e) => assert!(
            matches!(e, Error::Unsupported { .. } | Error::Call { .. }),
            "{e}"
        ),
    }
}

fn bad_context(prov: &str) {
    watchdog(300);
    let (a, _b, b_at_a, _) = pair(prov, base_caps());
    let src = a.ep.alloc_registered(64, ALL).unwrap();
    let err = a.ep.send(&src, 0..64, b_at_a, 1 << 63).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(!src.in_use());
}

macro_rules! matrix {
    ($($module:ident => $prov:expr, key: $key:ident, range: $range:ident;)*) => {$(
        mod $module {
            #[test] fn send_recv() { super::send_recv($prov) }
            #[test] fn tagged() { super::tagged($prov) }
            #[test] fn inject() { super::inject($prov) }
            #[test] fn rma_write_read() { super::rma($prov) }
            #[test] fn writedata() { super::writedata($prov) }
            #[test] fn write_batch_more() { super::write_batch($prov) }
            #[test] fn atomics() { super::atomics($prov, true) }
            #[test] fn counters() { super::counters($prov) }
            #[test] fn wrong_key_refused() { super::wrong_key($prov, super::Refusal::$key) }
            #[test] fn out_of_range_refused() { super::out_of_range($prov, super::Refusal::$range) }
            #[test] fn av_and_cq_waits() { super::av_and_cq($prov) }
            #[test] fn reserved_context_rejected() { super::bad_context($prov) }
        }
    )*};
}

matrix! {
    tcp_rxm => "tcp;ofi_rxm", key: CompletionError, range: CompletionError;
    sockets => "sockets", key: CompletionError, range: CompletionError;
    udp_rxd => "udp;ofi_rxd", key: NeverCompletes, range: NeverCompletes;
    shm => "shm", key: Unchecked, range: CompletionError;
}

#[test]
fn unsupported_capability_at_discovery() {
    // tcp;ofi_rxm has no FI_HMEM and no triggered operations: asking is a typed Unsupported.
    for caps in [Caps::HMEM | Caps::RMA, Caps::TRIGGER | Caps::MSG] {
        match rdm_info("tcp;ofi_rxm", caps) {
            Err(Error::Unsupported {
                call: "fi_getinfo",
                errno,
                ..
            }) => assert_eq!(errno, ffi::FI_ENODATA),
            other => panic!("{caps:?}: {other:?}"),
        }
    }
    assert!(matches!(
        rdm_info("no-such-provider", base_caps()),
        Err(Error::Unsupported { .. })
    ));
}

#[test]
fn info_attributes_are_typed() {
    for prov in RDM_PROVIDERS {
        let info = rdm_info(prov, base_caps()).unwrap();
        assert_eq!(info.threading(), fabric::Threading::SAFE);
        assert!(info.max_msg_size() >= 1 << 20);
        assert!(!format!("{info}").is_empty());
        let progress = info.data_progress();
        assert!(progress == fabric::Progress::AUTO || progress == fabric::Progress::MANUAL);
    }
    assert!(fabric::version() >= fabric::MIN_VERSION);
    fabric::check_version().unwrap();
}
