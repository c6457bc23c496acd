//! The GPU memory registration manager on soft-RoCE with host memory (run in the guest
//! by `cargo xtask test`, which sets `RDMA_TEST_DEVICE=rxe0`; feature `rdma`): its
//! registrations move data by RDMA WRITE and READ, the cache hands out covering
//! registrations and forgets invalidated ones, owned memory lives exactly as long as
//! its registrations, and DMA-BUF registration is a typed `Unsupported` on rxe.

use hf3fs_gdr::gdr::{GpuRegistration, HostMemory, MemoryRegistrar, RegistrationMethod};
use hf3fs_gdr::regcache::MemoryDomain;
use hf3fs_gdr::Error;
use ibverbs::{
    CompletionQueue, ConnectOptions, IpFamily, QpType, QueuePair, SendWr, WorkCompletion,
};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const H: MemoryDomain = MemoryDomain::Host;

/// The registrar over `RDMA_TEST_DEVICE`, or `None` (with the skip printed) when it is
/// unset; set but missing fails.
fn registrar() -> Option<MemoryRegistrar> {
    let Ok(name) = std::env::var("RDMA_TEST_DEVICE") else {
        println!("skipped: RDMA_TEST_DEVICE not set (run via cargo xtask test)");
        return None;
    };
    Some(
        MemoryRegistrar::open(&[name.as_str()])
            .unwrap_or_else(|e| panic!("RDMA_TEST_DEVICE={name}: {e}")),
    )
}

/// The guest has two vCPUs: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A loopback RC connection on the registrar's protection domain.
struct Loop {
    cq: CompletionQueue,
    a: QueuePair,
    _b: QueuePair,
}

fn connect(r: &MemoryRegistrar) -> Loop {
    let dev = &r.devices()[0];
    let ctx = dev.context();
    let gid = ctx
        .find_roce_v2_gid(1, IpFamily::V4)
        .expect("RoCE v2 IPv4 GID");
    let o = ConnectOptions {
        gid_index: gid.gid_index as u8,
        ..Default::default()
    };
    let cq = ctx.create_cq(16, None, 0).unwrap();
    let cq_b = ctx.create_cq(16, None, 0).unwrap();
    let make = |cq: &CompletionQueue| {
        dev.pd()
            .create_qp(QpType::RC, cq, cq)
            .max_send_wr(8)
            .max_recv_wr(8)
            .max_send_sge(2)
            .max_recv_sge(2)
            .build()
            .unwrap()
    };
    let (a, b) = (make(&cq), make(&cq_b));
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    let a = a.connect(&eb, &o).unwrap();
    let b = b.connect(&ea, &o).unwrap();
    Loop { cq, a, _b: b }
}

fn poll_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(c) = cq.poll(&mut wc).unwrap().first() {
            return *c;
        }
        assert!(Instant::now() < deadline, "no completion within 10 s");
        std::thread::yield_now();
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn rxe_registrations_move_data_and_covering_lookups_reuse_them() {
    let _g = serial();
    let Some(r) = registrar() else {
        return;
    };
    let l = connect(&r);
    const LEN: usize = 256 << 10;
    // Source: memory the registration owns. Destination: caller memory.
    let src = Arc::new(HostMemory::alloc(LEN).unwrap());
    let data = pattern(LEN, 7);
    // SAFETY: `src` is LEN bytes, nothing else touches it now.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), src.as_ptr(), LEN) };
    let src_reg = r.register_owned(src.clone()).unwrap();
    assert_eq!(src_reg.value().method(), RegistrationMethod::Host);
    let mut dst = vec![0u8; LEN];
    // SAFETY: `dst` lives to the end of the test and is invalidated before it goes.
    let dst_reg = unsafe { r.register(H, dst.as_mut_ptr() as u64, LEN) }.unwrap();
    let (smr, dmr) = (
        src_reg.value().mr(0).unwrap(),
        dst_reg.value().mr(0).unwrap(),
    );
    assert_eq!((smr.addr(), smr.len()), (src.as_ptr() as u64, LEN));
    assert_eq!((dmr.addr(), dmr.len()), (dst.as_ptr() as u64, LEN));

    // RDMA WRITE the whole source into the destination.
    let sge = [smr.sge(..)];
    l.a.post_send(&mut [SendWr::write(1, &sge, dmr.remote()).signaled()])
        .unwrap();
    let wc = poll_one(&l.cq);
    assert!(wc.is_success(), "{wc:?}");
    assert_eq!(dst, data);

    // A sub-range lookup hands out the covering registration; an RDMA READ through it
    // (at its offset inside the region) brings back the same bytes.
    let inner_addr = dst.as_ptr() as u64 + 4096;
    let sub = r
        .lookup(H, inner_addr, 8192)
        .expect("covering registration");
    assert!(sub.same_registration(&dst_reg));
    assert_eq!(dst_reg.users(), 2);
    let back = Arc::new(HostMemory::alloc(8192).unwrap());
    let back_reg = r.register_owned(back.clone()).unwrap();
    let off = (inner_addr - sub.addr()) as u64;
    let bsge = [back_reg.value().mr(0).unwrap().sge(..)];
    let remote = sub.value().mr(0).unwrap().remote().slice(off, 8192);
    l.a.post_send(&mut [SendWr::read(2, &bsge, remote).signaled()])
        .unwrap();
    let wc = poll_one(&l.cq);
    assert!(wc.is_success(), "{wc:?}");
    // SAFETY: 8192 bytes the READ completed into.
    let got = unsafe { std::slice::from_raw_parts(back.as_ptr(), 8192) };
    assert_eq!(got, &data[4096..4096 + 8192]);
    let stats = r.cache().stats();
    assert_eq!((stats.hits, stats.misses), (1, 3));

    // The destination is about to be freed: invalidate it first.
    drop(sub);
    assert_eq!(r.invalidate(H, dst.as_ptr() as u64, LEN), 1);
    assert!(dst_reg.is_invalidated());
    assert!(r.lookup(H, dst.as_ptr() as u64, 1).is_none());
    drop(dst_reg);
    drop(dst);
}

#[test]
fn rxe_invalidated_ranges_are_registered_anew() {
    let _g = serial();
    let Some(r) = registrar() else {
        return;
    };
    let mut buf = vec![0u8; 1 << 20];
    let addr = buf.as_mut_ptr() as u64;
    // SAFETY: `buf` outlives every registration (invalidated before it goes).
    let first = unsafe { r.register(H, addr, 1 << 20) }.unwrap();
    // SAFETY: as above.
    let again = unsafe { r.register(H, addr + 512, 4096) }.unwrap();
    assert!(again.same_registration(&first));
    assert_eq!(
        first.value().mr(0).unwrap().lkey(),
        again.value().mr(0).unwrap().lkey()
    );
    drop(again);
    assert_eq!(r.invalidate(H, addr + 100, 1), 1);
    // SAFETY: as above.
    let fresh = unsafe { r.register(H, addr, 1 << 20) }.unwrap();
    assert!(!fresh.same_registration(&first));
    assert_ne!(
        fresh.value().mr(0).unwrap().lkey(),
        first.value().mr(0).unwrap().lkey()
    );
    assert_eq!(r.cache().len(), 1);
    assert_eq!(r.invalidate(H, addr, 1 << 20), 1);
    drop((first, fresh));
    assert!(r.cache().is_empty());
    drop(buf);
}

#[test]
fn rxe_owned_memory_is_released_with_its_last_registration() {
    let _g = serial();
    let Some(r) = registrar() else {
        return;
    };
    let mem = Arc::new(HostMemory::alloc(64 << 10).unwrap());
    let weak = Arc::downgrade(&mem);
    let addr = mem.as_ptr() as u64;
    let reg = r.register_owned(mem).unwrap();
    assert!(
        weak.upgrade().is_some(),
        "the registration holds the memory"
    );
    let hit = r.lookup(H, addr + 4096, 4096).unwrap();
    drop(reg);
    assert!(weak.upgrade().is_some(), "a handle is still out");
    drop(hit);
    assert!(weak.upgrade().is_none(), "deregistered, then freed");
    assert!(r.lookup(H, addr, 1).is_none());
    assert!(r.cache().is_empty());
}

#[test]
fn rxe_dmabuf_registration_is_unsupported() {
    let _g = serial();
    let Some(r) = registrar() else {
        return;
    };
    // Soft-RoCE registers no DMA-BUF memory: the provider refuses before looking at
    // the descriptor.
    let not_dmabuf = std::fs::File::open("/dev/null").unwrap();
    use std::os::fd::AsFd;
    match r.register_dmabuf(
        MemoryDomain::Gpu(0),
        not_dmabuf.as_fd(),
        0,
        4096,
        0x1000_0000,
    ) {
        Err(Error::Unsupported(why)) => assert!(why.contains("ibv_reg_dmabuf_mr"), "{why}"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert!(r.cache().is_empty());
    // GPU memory with DMA-BUF only: no GPU here either way, a typed error.
    let dmabuf_only = MemoryRegistrar::open(&[r.devices()[0].name()])
        .unwrap()
        .with_gpu_registration(GpuRegistration::DmaBufOnly);
    // SAFETY: nothing is registered (it fails before any registration).
    let err =
        unsafe { dmabuf_only.register(MemoryDomain::Gpu(0), 0x7f00_0000_0000, 4096) }.unwrap_err();
    assert!(
        matches!(err, Error::Unsupported(_) | Error::Gpu(_)),
        "{err:?}"
    );
    // DMA-BUF first falls back to peer memory, which an unmapped address also fails:
    // the error names both reasons.
    // SAFETY: as above.
    match unsafe { r.register(MemoryDomain::Gpu(0), 0x7f00_0000_0000, 4096) } {
        Err(Error::Unsupported(why)) => {
            assert!(
                why.contains("DMA-BUF") && why.contains("peer memory"),
                "{why}"
            )
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn rxe_unknown_devices_and_empty_memory_are_refused() {
    let _g = serial();
    let Some(r) = registrar() else {
        return;
    };
    assert!(matches!(
        MemoryRegistrar::open(&[r.devices()[0].name(), "no_such_dev0"]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        MemoryRegistrar::from_pds(Vec::new()),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        HostMemory::alloc(0),
        Err(Error::InvalidArgument(_))
    ));
    let mut buf = [0u8; 16];
    // SAFETY: refused before anything is registered.
    let err = unsafe { r.register(H, buf.as_mut_ptr() as u64, 0) }.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(r.cache().is_empty());
}
