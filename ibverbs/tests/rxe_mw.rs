//! Memory windows against soft-RoCE: type 1 (`ibv_bind_mw`) and type 2 (BIND_MW work
//! requests, classic and `ibv_wr_*`), remote access through the window's rkey verified
//! byte for byte, and every way to revoke it (re-bind, LOCAL_INV, SEND_WITH_INV) ending
//! in a typed remote access error. Where the device announces no memory windows, the
//! tests assert `Unsupported` instead.

mod common;

use common::*;
use ibverbs::*;

const LEN: usize = 16 << 10;

fn window_access() -> AccessFlags {
    AccessFlags::all_remote() | AccessFlags::MW_BIND
}

/// Whether the device announces windows of `ty`; when it does not, asserts that
/// allocating one is `Unsupported` and returns false.
fn supports(ctx: &Context, pd: &ProtectionDomain, ty: MwType) -> bool {
    let attr = ctx.query_device().unwrap();
    let flags = attr.device_cap_flags();
    let announced = attr.max_mw() > 0
        && match ty {
            MwType::TYPE_1 => flags & ffi::IBV_DEVICE_MEM_WINDOW != 0,
            _ => {
                flags & (ffi::IBV_DEVICE_MEM_WINDOW_TYPE_2A | ffi::IBV_DEVICE_MEM_WINDOW_TYPE_2B)
                    != 0
            }
        };
    if !announced {
        let err = pd.alloc_mw(ty).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{ty:?}: {err}");
        println!(
            "{}: no {ty:?} memory windows (asserted Unsupported)",
            ctx.name()
        );
    }
    announced
}

/// Two RC QPs on `pd` that can use both post APIs for every window operation.
fn qps(
    ctx: &Context,
    pd: &ProtectionDomain,
) -> (CompletionQueue, QueuePair, CompletionQueue, QueuePair) {
    let o = opts(ctx);
    let ops = SendOpsFlags::RDMA_WRITE
        | SendOpsFlags::RDMA_READ
        | SendOpsFlags::SEND
        | SendOpsFlags::BIND_MW
        | SendOpsFlags::LOCAL_INV
        | SendOpsFlags::SEND_WITH_INV;
    let make = |cq: &CompletionQueue| {
        pd.create_qp(QpType::RC, cq, cq)
            .max_send_wr(32)
            .max_recv_wr(32)
            .send_ops_flags(ops)
            .build()
            .unwrap()
    };
    let cq_a = ctx.create_cq(64, None, 0).unwrap();
    let cq_b = ctx.create_cq(64, None, 0).unwrap();
    let (a, b) = (make(&cq_a), make(&cq_b));
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    let a = a.connect(&eb, &o).unwrap();
    let b = b.connect(&ea, &o).unwrap();
    (cq_a, a, cq_b, b)
}

fn expect_ok(cq: &CompletionQueue, wr_id: u64, opcode: WcOpcode) -> WorkCompletion {
    let wc = poll_one(cq);
    wc.result().unwrap_or_else(|e| panic!("{e} ({wc:?})"));
    assert_eq!((wc.wr_id(), wc.opcode()), (wr_id, opcode), "{wc:?}");
    wc
}

fn expect_remote_access_error(cq: &CompletionQueue, wr_id: u64) {
    let wc = poll_one(cq);
    assert!(
        matches!(
            wc.result(),
            Err(Error::WorkCompletion {
                status: WcStatus::REM_ACCESS_ERR,
                wr_id: id,
                ..
            }) if id == wr_id
        ),
        "{wc:?}"
    );
}

#[test]
fn windows_match_the_device_attributes() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let pd = ctx.alloc_pd().unwrap();
    let mut kinds = 0;
    for ty in [MwType::TYPE_1, MwType::TYPE_2] {
        if supports(&ctx, &pd, ty) {
            let mw = pd.alloc_mw(ty).unwrap();
            assert_eq!(mw.mw_type(), ty);
            assert_eq!(mw.remote(), None, "a new window is unbound");
            assert_ne!(mw.rkey(), 0);
            kinds += 1;
        }
    }
    if ctx.name().starts_with("rxe") {
        // rdma_rxe implements type 1 and type 2B windows (kernel 5.13 and later).
        assert_eq!(kinds, 2, "rxe announces both window types");
    }
}

#[test]
fn type1_bind_write_read_then_rebind_revokes_the_old_rkey() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let pd = ctx.alloc_pd().unwrap();
    if !supports(&ctx, &pd, MwType::TYPE_1) {
        return;
    }
    let (cq_a, a, cq_b, b) = qps(&ctx, &pd);
    let mut target = pd.reg_mr(LEN, window_access()).unwrap();
    target.as_mut_slice().copy_from_slice(&pattern(LEN, 1));
    let mut src = mr(&pd, LEN);
    src.as_mut_slice().copy_from_slice(&pattern(LEN, 2));
    let mut mw = pd.alloc_mw(MwType::TYPE_1).unwrap();

    // Bind [4096, 8192) read/write on the target side's QP.
    let remote = b
        .bind_mw(
            &mut mw,
            1,
            SendFlags::SIGNALED,
            &target,
            4096..8192,
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .unwrap();
    expect_ok(&cq_b, 1, WcOpcode::BIND_MW);
    assert_eq!(
        remote,
        RemoteMemory {
            addr: target.addr() + 4096,
            len: 4096,
            rkey: mw.rkey()
        }
    );
    assert_eq!(mw.remote(), Some(remote));
    assert_ne!(remote.rkey, target.rkey(), "the window has its own key");

    // WRITE through the window lands in the region at the window's offset.
    let sge = [src.sge(0..4096)];
    a.post_send(&mut [SendWr::write(2, &sge, remote).signaled()])
        .unwrap();
    expect_ok(&cq_a, 2, WcOpcode::RDMA_WRITE);
    assert_eq!(&target.as_slice()[4096..8192], &pattern(LEN, 2)[..4096]);
    assert_eq!(
        &target.as_slice()[..4096],
        &pattern(LEN, 1)[..4096],
        "outside the window"
    );
    assert_eq!(
        &target.as_slice()[8192..],
        &pattern(LEN, 1)[8192..],
        "outside the window"
    );

    // READ through the window.
    let sge = [src.sge(8192..8192 + 1000)];
    a.post_send(&mut [SendWr::read(3, &sge, remote.slice(100, 1000)).signaled()])
        .unwrap();
    expect_ok(&cq_a, 3, WcOpcode::RDMA_READ);
    assert_eq!(&src.as_slice()[8192..9192], &target.as_slice()[4196..5196]);

    // Re-bind (read only, another range): a new rkey that works for READ...
    let old = remote;
    let remote = b
        .bind_mw(
            &mut mw,
            4,
            SendFlags::SIGNALED,
            &target,
            12288..LEN,
            AccessFlags::REMOTE_READ,
        )
        .unwrap();
    expect_ok(&cq_b, 4, WcOpcode::BIND_MW);
    assert_ne!(remote.rkey, old.rkey, "every type 1 bind changes the rkey");
    let sge = [src.sge(0..4096)];
    a.post_send(&mut [SendWr::read(5, &sge, remote).signaled()])
        .unwrap();
    expect_ok(&cq_a, 5, WcOpcode::RDMA_READ);
    assert_eq!(&src.as_slice()[..4096], &target.as_slice()[12288..]);

    // ...while the old one is revoked: remote access error.
    a.post_send(&mut [SendWr::write(6, &sge, old).signaled()])
        .unwrap();
    expect_remote_access_error(&cq_a, 6);

    // The window's rights and range are enforced (fresh QPs: the error moved `a` to ERR).
    let (cq_c, c, _cq_d, _d) = qps(&ctx, &pd);
    c.post_send(&mut [SendWr::write(7, &sge, remote).signaled()])
        .unwrap();
    expect_remote_access_error(&cq_c, 7); // read-only window
    let (cq_e, e, _cq_f, _f) = qps(&ctx, &pd);
    let sge = [src.sge(0..64)];
    let past_end = RemoteMemory {
        addr: remote.addr + remote.len - 32,
        len: 64,
        rkey: remote.rkey,
    };
    e.post_send(&mut [SendWr::read(8, &sge, past_end).signaled()])
        .unwrap();
    expect_remote_access_error(&cq_e, 8); // inside the region, past the window
}

#[test]
fn type2_bind_write_then_local_inv_revokes_both_apis() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let pd = ctx.alloc_pd().unwrap();
    if !supports(&ctx, &pd, MwType::TYPE_2) {
        return;
    }
    let mut target = pd.reg_mr(LEN, window_access()).unwrap();
    let mut src = mr(&pd, LEN);
    src.as_mut_slice().copy_from_slice(&pattern(LEN, 3));
    let mut mw = pd.alloc_mw(MwType::TYPE_2).unwrap();

    // Classic API: IBV_WR_BIND_MW posted by the target side, then IBV_WR_LOCAL_INV.
    let (cq_a, a, cq_b, b) = qps(&ctx, &pd);
    let before = mw.rkey();
    let remote = b
        .bind_mw(
            &mut mw,
            1,
            SendFlags::SIGNALED,
            &target,
            0..8192,
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    expect_ok(&cq_b, 1, WcOpcode::BIND_MW);
    assert_ne!(remote.rkey, before);
    assert_eq!(
        remote.rkey & 0xff,
        before.wrapping_add(1) & 0xff,
        "ibv_inc_rkey"
    );
    assert_eq!(mw.rkey(), remote.rkey);
    let sge = [src.sge(0..8192)];
    a.post_send(&mut [SendWr::write(2, &sge, remote).signaled()])
        .unwrap();
    expect_ok(&cq_a, 2, WcOpcode::RDMA_WRITE);
    assert_eq!(&target.as_slice()[..8192], &pattern(LEN, 3)[..8192]);

    b.post_send(&mut [SendWr::local_inv(3, remote.rkey).signaled()])
        .unwrap();
    expect_ok(&cq_b, 3, WcOpcode::LOCAL_INV);
    a.post_send(&mut [SendWr::write(4, &sge, remote).signaled()])
        .unwrap();
    expect_remote_access_error(&cq_a, 4);

    // `ibv_wr_*` API on fresh QPs: ibv_wr_bind_mw (the invalidated window is free
    // again), then ibv_wr_local_inv.
    target.as_mut_slice().fill(0);
    let (cq_c, c, cq_d, mut d) = qps(&ctx, &pd);
    {
        let mut batch = d.wr_start().unwrap();
        batch.bind_mw(
            10,
            SendFlags::SIGNALED,
            &mut mw,
            &target,
            8192..LEN,
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        );
        batch.complete().unwrap();
    }
    expect_ok(&cq_d, 10, WcOpcode::BIND_MW);
    let remote2 = mw.remote().unwrap();
    assert_eq!((remote2.addr, remote2.len), (target.addr() + 8192, 8192));
    assert_ne!(remote2.rkey, remote.rkey);
    let sge = [src.sge(100..100 + 8192)];
    c.post_send(&mut [SendWr::write(11, &sge, remote2).signaled()])
        .unwrap();
    expect_ok(&cq_c, 11, WcOpcode::RDMA_WRITE);
    assert_eq!(
        &target.as_slice()[8192..],
        &pattern(LEN, 3)[100..100 + 8192]
    );
    assert!(target.as_slice()[..8192].iter().all(|&x| x == 0));

    // A type 2 window belongs to the QP that bound it: `g`'s peer is `h`, not `d`.
    let (cq_g, g, _cq_h, _h) = qps(&ctx, &pd);
    let sge = [src.sge(0..64)];
    g.post_send(&mut [SendWr::read(12, &sge, remote2.slice(0, 64)).signaled()])
        .unwrap();
    expect_remote_access_error(&cq_g, 12);

    {
        let mut batch = d.wr_start().unwrap();
        batch.local_inv(13, SendFlags::SIGNALED, remote2.rkey);
        batch.complete().unwrap();
    }
    expect_ok(&cq_d, 13, WcOpcode::LOCAL_INV);
    c.post_send(&mut [SendWr::read(14, &sge, remote2.slice(0, 64)).signaled()])
        .unwrap();
    expect_remote_access_error(&cq_c, 14);
}

#[test]
fn type2_send_with_invalidate_revokes_at_the_peer() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let pd = ctx.alloc_pd().unwrap();
    if !supports(&ctx, &pd, MwType::TYPE_2) {
        return;
    }
    let mut target = pd.reg_mr(LEN, window_access()).unwrap();
    target.as_mut_slice().copy_from_slice(&pattern(LEN, 4));
    let mut src = mr(&pd, LEN);
    let inbox = mr(&pd, 4096);
    let mut mw = pd.alloc_mw(MwType::TYPE_2).unwrap();
    let (cq_a, mut a, cq_b, mut b) = qps(&ctx, &pd);

    for round in 0..2u64 {
        // `b` binds its window (wr API) and `a` reads through it.
        {
            let mut batch = b.wr_start().unwrap();
            batch.bind_mw(
                100 + round,
                SendFlags::SIGNALED,
                &mut mw,
                &target,
                1024..1024 + 4096,
                AccessFlags::REMOTE_READ,
            );
            batch.complete().unwrap();
        }
        expect_ok(&cq_b, 100 + round, WcOpcode::BIND_MW);
        let remote = mw.remote().unwrap();
        let sge = [src.sge(0..4096)];
        a.post_send(&mut [SendWr::read(200 + round, &sge, remote).signaled()])
            .unwrap();
        expect_ok(&cq_a, 200 + round, WcOpcode::RDMA_READ);
        assert_eq!(&src.as_slice()[..4096], &pattern(LEN, 4)[1024..1024 + 4096]);

        // `a` sends a message that also invalidates the window at `b`: round 0 with
        // the wr API, round 1 with the classic one.
        let rsg = [inbox.sge(..)];
        b.post_recv(&mut [RecvWr::new(300 + round, &rsg)]).unwrap();
        src.as_mut_slice()[..16].copy_from_slice(&[round as u8 + 1; 16]);
        let ssg = [src.sge(0..16)];
        if round == 0 {
            let mut batch = a.wr_start().unwrap();
            batch.send_inv(400, SendFlags::SIGNALED, remote.rkey, &ssg);
            batch.complete().unwrap();
        } else {
            a.post_send(&mut [SendWr::send_with_inv(401, &ssg, remote.rkey).signaled()])
                .unwrap();
        }
        expect_ok(&cq_a, 400 + round, WcOpcode::SEND);
        let wc = expect_ok(&cq_b, 300 + round, WcOpcode::RECV);
        assert_eq!(wc.invalidated_rkey(), Some(remote.rkey), "{wc:?}");
        assert_eq!(wc.imm_data(), None);
        assert_eq!(&inbox.as_slice()[..16], &[round as u8 + 1; 16]);

        if round == 1 {
            // The invalidated rkey no longer works.
            let sge = [src.sge(0..64)];
            a.post_send(&mut [SendWr::read(500, &sge, remote.slice(0, 64)).signaled()])
                .unwrap();
            expect_remote_access_error(&cq_a, 500);
        }
    }
}

#[test]
fn window_error_paths_and_lifetime() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let pd = ctx.alloc_pd().unwrap();
    if !supports(&ctx, &pd, MwType::TYPE_1) || !supports(&ctx, &pd, MwType::TYPE_2) {
        return;
    }
    let (cq_a, a, cq_b, mut b) = qps(&ctx, &pd);
    let src = mr(&pd, 4096);

    // A bound window keeps its region registered and its buffer alive: drop the
    // region, then read its bytes through the window.
    let mut mw1 = pd.alloc_mw(MwType::TYPE_1).unwrap();
    let remote = {
        let mut target = pd.reg_mr(4096, window_access()).unwrap();
        target.as_mut_slice().copy_from_slice(&pattern(4096, 5));
        let remote = b
            .bind_mw(
                &mut mw1,
                1,
                SendFlags::SIGNALED,
                &target,
                ..,
                AccessFlags::REMOTE_READ,
            )
            .unwrap();
        expect_ok(&cq_b, 1, WcOpcode::BIND_MW);
        remote
    };
    let sge = [src.sge(..)];
    a.post_send(&mut [SendWr::read(2, &sge, remote).signaled()])
        .unwrap();
    expect_ok(&cq_a, 2, WcOpcode::RDMA_READ);
    assert_eq!(src.as_slice(), &pattern(4096, 5)[..]);
    drop(mw1); // now the region is deregistered and freed

    // ibv_wr_bind_mw is for type 2 windows: the batch fails and the window is unchanged.
    let other = pd.reg_mr(4096, window_access()).unwrap();
    let mut mw = pd.alloc_mw(MwType::TYPE_1).unwrap();
    let rkey = mw.rkey();
    {
        let mut batch = b.wr_start().unwrap();
        batch.bind_mw(
            3,
            SendFlags::SIGNALED,
            &mut mw,
            &other,
            ..,
            AccessFlags::REMOTE_READ,
        );
        let err = batch.complete().unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    assert_eq!((mw.rkey(), mw.remote()), (rkey, None));

    // An aborted batch restores a type 2 window's key and binding.
    let mut mw2 = pd.alloc_mw(MwType::TYPE_2).unwrap();
    let rkey2 = mw2.rkey();
    {
        let mut batch = b.wr_start().unwrap();
        batch.bind_mw(
            4,
            SendFlags::SIGNALED,
            &mut mw2,
            &other,
            ..,
            AccessFlags::REMOTE_READ,
        );
        drop(batch);
    }
    assert_eq!((mw2.rkey(), mw2.remote()), (rkey2, None));

    // Binding to a region registered without MW_BIND: typed bind error completion.
    let plain = mr(&pd, 4096);
    b.bind_mw(
        &mut mw,
        5,
        SendFlags::SIGNALED,
        &plain,
        ..,
        AccessFlags::REMOTE_READ,
    )
    .unwrap();
    let wc = poll_one(&cq_b);
    assert!(
        matches!(
            wc.result(),
            Err(Error::WorkCompletion {
                status: WcStatus::MW_BIND_ERR,
                wr_id: 5,
                ..
            })
        ),
        "{wc:?}"
    );
}
