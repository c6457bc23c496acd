//! The CPU proxy over an ibverbs RC queue pair in the soft-RoCE guest (`cargo xtask
//! test`, `RDMA_TEST_DEVICE=rxe0`), with a host thread standing in for the GPU: real
//! RDMA WRITE / READ / ATOMIC_FETCH_AND_ADD on rxe, data verified; ring wraparound,
//! full-ring back-pressure, refused entries, a failed completion (wrong rkey) and a
//! lost peer surfacing as typed statuses. Skips with a printed reason when
//! `RDMA_TEST_DEVICE` is unset; fails when it names a missing device.

mod proxy_common;

use gpunetio::proxy::{GioStatus, VerbsTransport};
use gpunetio::Error;
use ibverbs::{ConnectOptions, Context, IpFamily};
use proxy_common::*;
use std::sync::{Mutex, MutexGuard};

/// The device named by `RDMA_TEST_DEVICE`, or `None` after printing why the test skips.
fn device(test: &str) -> Option<Context> {
    let Ok(name) = std::env::var("RDMA_TEST_DEVICE") else {
        println!("skipped {test}: RDMA_TEST_DEVICE not set (run via cargo xtask test)");
        return None;
    };
    watchdog(900);
    Some(Context::open(&name).unwrap_or_else(|e| panic!("RDMA_TEST_DEVICE={name}: {e}")))
}

/// One test at a time: the guest has two vCPUs, shared by rxe and the proxy.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn opts(ctx: &Context) -> ConnectOptions {
    let gid = ctx
        .find_roce_v2_gid(1, IpFamily::V4)
        .expect("RoCE v2 IPv4 GID");
    let rd_atomic = ctx
        .query_device()
        .expect("query_device")
        .max_qp_rd_atom()
        .clamp(1, 16) as u8;
    ConnectOptions {
        gid_index: gid.gid_index as u8,
        max_rd_atomic: rd_atomic,
        max_dest_rd_atomic: rd_atomic,
        ..Default::default()
    }
}

fn pair(ctx: &Context, ring_size: u32) -> Pair<VerbsTransport> {
    let o = opts(ctx);
    let t = || VerbsTransport::new(ctx, o, 2 * ring_size).expect("verbs transport");
    Pair::new(t(), t(), ring_size, 4, T)
}

macro_rules! guest_test {
    ($name:ident, |$ctx:ident| $body:expr) => {
        #[test]
        fn $name() {
            let Some($ctx) = device(stringify!($name)) else {
                return;
            };
            let _serial = serial();
            $body;
        }
    };
}

guest_test!(rxe_proxy_put_inline_get_signal_counters, |ctx| basic(
    &pair(&ctx, 64)
));
guest_test!(rxe_proxy_put_signal_data_first, |ctx| put_signal_order(
    &pair(&ctx, 16),
    2
));
guest_test!(rxe_proxy_fence_orders_get_after_put, |ctx| fence(&pair(
    &ctx, 16
)));
guest_test!(rxe_proxy_wraparound_ring_of_8, |ctx| wraparound(
    &pair(&ctx, 8),
    2000
));
guest_test!(rxe_proxy_full_ring_back_pressure, |ctx| back_pressure(
    &pair(&ctx, 8)
));
guest_test!(rxe_proxy_bad_entries_refused, |ctx| bad_entries(|| pair(
    &ctx, 8
)));
guest_test!(rxe_proxy_producer_timeout_and_shutdown, |ctx| {
    timeout_and_shutdown(&pair(&ctx, 8))
});
guest_test!(rxe_proxy_staged_local_memory, |ctx| staged(&pair(&ctx, 16)));

guest_test!(rxe_proxy_wrong_rkey_is_a_transport_error, |ctx| {
    let err = bad_key(&pair(&ctx, 8));
    match &err {
        Error::EntryFailed { status, source, .. } => {
            assert_eq!(*status, GioStatus::TRANSPORT, "{err}");
            assert!(matches!(**source, Error::Verbs { .. }), "{source:?}");
        }
        other => panic!("{other:?}"),
    }
});

guest_test!(rxe_proxy_lost_peer_is_peer_gone, |ctx| {
    // A short transport timeout and few retries, so the lost peer is noticed quickly.
    let o = ConnectOptions {
        timeout: 12,
        retry_cnt: 3,
        ..opts(&ctx)
    };
    let t = || VerbsTransport::new(&ctx, o, 16).expect("verbs transport");
    let x = Pair::new(t(), t(), 8, 4, T);
    x.a.start().unwrap();
    let t =
        x.p.post(&gpunetio::proxy::Entry::put(x.r, 0, x.l, 0, 64))
            .unwrap();
    x.p.wait(t).unwrap();
    // The peer's queue pair is destroyed (as if its process died): nothing answers, and
    // the initiator's retries run out.
    x.b.with_transport(|t| t.close());
    let t =
        x.p.post(&gpunetio::proxy::Entry::put(x.r, 0, x.l, 0, 64))
            .unwrap();
    match x.p.wait(t) {
        Err(Error::RingFailed { status, ticket }) => {
            assert_eq!((status, ticket), (GioStatus::PEER_GONE, t));
        }
        other => panic!("a put to a lost peer: {other:?}"),
    }
    x.a.stop();
    match x.a.take_error() {
        Some(Error::EntryFailed {
            status: GioStatus::PEER_GONE,
            ..
        }) => {}
        other => panic!("host error: {other:?}"),
    }
});

guest_test!(rxe_proxy_malformed_peer_blobs_refused, |ctx| {
    let x = pair(&ctx, 8);
    let mut t = VerbsTransport::new(&ctx, opts(&ctx), 16).unwrap();
    let good = x.a.local_info().unwrap();
    let mut bad = good.clone();
    bad[4] = 7;
    for blob in [&good[..10], &bad[..]] {
        assert!(
            matches!(
                gpunetio::proxy::Transport::connect(&mut t, blob),
                Err(Error::Malformed { .. })
            ),
            "{blob:?}"
        );
    }
    // A fabric descriptor is refused by a verbs proxy.
    let mut d = x.b.descriptor(0).unwrap();
    d.transport = gpunetio::proxy::TransportKind::FABRIC;
    assert!(matches!(x.a.add_remote(&d), Err(Error::InvalidArgument(_))));
});
