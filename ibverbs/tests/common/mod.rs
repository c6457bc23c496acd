//! Helpers shared by the soft-RoCE guest tests.
#![allow(dead_code)]

use ibverbs::{
    AccessFlags, CompletionQueue, ConnectOptions, Context, IpFamily, MemoryRegion,
    PreparedQueuePair, ProtectionDomain, QpType, QueuePair, WorkCompletion,
};
use std::sync::{Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

/// The device named by `RDMA_TEST_DEVICE`, or `None` (after printing the skip reason)
/// when the variable is unset. When it is set, a missing device fails the test.
pub fn device() -> Option<Context> {
    let Ok(name) = std::env::var("RDMA_TEST_DEVICE") else {
        println!("skipped: RDMA_TEST_DEVICE not set (run via cargo xtask test)");
        return None;
    };
    watchdog();
    Some(Context::open(&name).unwrap_or_else(|e| panic!("RDMA_TEST_DEVICE={name}: {e}")))
}

/// Abort the whole binary if it runs far too long (a hung completion must fail, not
/// hang the guest).
pub fn watchdog() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_secs(240));
            eprintln!("test watchdog expired after 240 s");
            std::process::abort();
        });
    });
}

/// Tests of one binary run one at a time (TCG has two vCPUs; some tests touch the
/// port).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Options with the RoCE v2 IPv4 GID of port 1.
pub fn opts(ctx: &Context) -> ConnectOptions {
    let gid = ctx
        .find_roce_v2_gid(1, IpFamily::V4)
        .expect("RoCE v2 IPv4 GID");
    ConnectOptions {
        gid_index: gid.gid_index as u8,
        ..Default::default()
    }
}

/// Poll `cq` until one completion arrives (10 s bound).
pub fn poll_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(c) = cq.poll(&mut wc).expect("poll").first() {
            return *c;
        }
        assert!(Instant::now() < deadline, "no completion within 10 s");
        std::thread::yield_now();
    }
}

/// Poll exactly `n` completions.
pub fn poll_n(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::default(); 8];
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.len() < n {
        out.extend_from_slice(cq.poll(&mut buf).expect("poll"));
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions within 10 s",
            out.len()
        );
        std::thread::yield_now();
    }
    out
}

/// Two connected RC QPs in one process, each with its own CQ.
pub struct Pair {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq_a: CompletionQueue,
    pub cq_b: CompletionQueue,
    pub a: QueuePair,
    pub b: QueuePair,
}

pub fn prepared(pd: &ProtectionDomain, cq: &CompletionQueue, qp_type: QpType) -> PreparedQueuePair {
    pd.create_qp(qp_type, cq, cq)
        .max_send_wr(32)
        .max_recv_wr(32)
        .max_send_sge(4)
        .max_recv_sge(4)
        .max_inline_data(64)
        .build()
        .expect("create QP")
}

pub fn pair(ctx: &Context) -> Pair {
    pair_with(ctx, |pd, cq| prepared(pd, cq, QpType::RC))
}

pub fn pair_with(
    ctx: &Context,
    make: impl Fn(&ProtectionDomain, &CompletionQueue) -> PreparedQueuePair,
) -> Pair {
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq_a = ctx.create_cq(64, None, 0).expect("cq");
    let cq_b = ctx.create_cq(64, None, 0).expect("cq");
    let o = opts(ctx);
    let a = make(&pd, &cq_a);
    let b = make(&pd, &cq_b);
    let ea = a.endpoint(&o).expect("endpoint");
    let eb = b.endpoint(&o).expect("endpoint");
    let a = a.connect(&eb, &o).expect("connect a");
    let b = b.connect(&ea, &o).expect("connect b");
    Pair {
        ctx: ctx.clone(),
        pd,
        cq_a,
        cq_b,
        a,
        b,
    }
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

pub fn mr(pd: &ProtectionDomain, len: usize) -> MemoryRegion {
    pd.reg_mr(len, AccessFlags::all_remote()).expect("reg_mr")
}
