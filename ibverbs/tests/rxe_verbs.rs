//! Every operation of the safe layer against soft-RoCE, in one process: two QPs per
//! test, data verified byte for byte, every user-triggerable error path asserting its
//! typed error. Runs only with `RDMA_TEST_DEVICE` set (the guest suite); a missing
//! device then fails.

mod common;

use common::*;
use ibverbs::*;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

#[test]
fn device_port_and_gids() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let list = devices().unwrap();
    assert!(list.iter().any(|d| d.name() == ctx.name()), "{list:?}");
    let attr = ctx.query_device().unwrap();
    assert!(attr.phys_port_cnt() >= 1);
    assert!(
        attr.max_qp_wr() >= 16 && attr.max_cqe() >= 16 && attr.max_sge() >= 1,
        "{attr:?}"
    );
    let port = ctx.query_port(1).unwrap();
    assert_eq!(port.state(), PortState::ACTIVE);
    assert_eq!(port.link_layer(), LinkLayer::ETHERNET);
    assert_eq!(port.active_mtu(), Mtu::MTU_4096, "dummy0 has MTU 9000");
    assert_eq!(port.active_mtu().bytes(), 4096);
    assert_eq!(port.lid(), 0, "RoCE has no LID");

    let v4 = ctx.find_roce_v2_gid(1, IpFamily::V4).unwrap();
    assert_eq!(v4.gid.to_ipv4(), Some("192.0.2.1".parse().unwrap()));
    assert_eq!(v4.gid_type, GidType::ROCE_V2);
    assert_eq!(ctx.query_gid(1, v4.gid_index).unwrap(), v4.gid);
    let v6 = ctx.find_roce_v2_gid(1, IpFamily::V6).unwrap();
    assert!(v6.gid.to_ipv4().is_none() && !v6.gid.is_zero());
    let table = ctx.gid_table().unwrap();
    assert!(table.contains(&v4) && table.contains(&v6), "{table:?}");

    assert!(matches!(
        Context::open("no_such_device"),
        Err(Error::DeviceNotFound { ref available, .. }) if available.iter().any(|n| n == ctx.name())
    ));
    assert!(matches!(
        ctx.query_gid_entry(1, 100_000),
        Err(Error::Gid { .. })
    ));
}

#[test]
fn rc_write_read_send_imm_inline_sgl_chain_atomics() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let p = pair(&ctx);
    let mut src = mr(&p.pd, 64 << 10);
    let mut dst = mr(&p.pd, 64 << 10);
    let data = pattern(64 << 10, 7);
    src.as_mut_slice().copy_from_slice(&data);

    // RDMA WRITE 64 KiB.
    let sge = [src.sge(..)];
    p.a.post_send(&mut [SendWr::write(1, &sge, dst.remote()).signaled()])
        .unwrap();
    let wc = poll_one(&p.cq_a);
    wc.result().unwrap();
    assert_eq!((wc.wr_id(), wc.opcode()), (1, WcOpcode::RDMA_WRITE));
    assert_eq!(dst.as_slice(), &data[..]);

    // RDMA READ 32 KiB back into another part of `src`.
    dst.as_mut_slice()[..32 << 10].copy_from_slice(&pattern(32 << 10, 99));
    let sge = [src.sge(32 << 10..)];
    p.a.post_send(&mut [SendWr::read(2, &sge, dst.remote().slice(0, 32 << 10)).signaled()])
        .unwrap();
    let wc = poll_one(&p.cq_a);
    wc.result().unwrap();
    assert_eq!(wc.opcode(), WcOpcode::RDMA_READ);
    assert_eq!(&src.as_slice()[32 << 10..], &pattern(32 << 10, 99)[..]);

    // SEND / RECV with an SGL of three pieces on both sides, and SEND_WITH_IMM.
    let rbuf = mr(&p.pd, 4096);
    {
        let rsg = [rbuf.sge(0..100), rbuf.sge(1000..1100), rbuf.sge(2000..2200)];
        let rsg2 = [rbuf.sge(3000..4096)];
        p.b.post_recv(&mut [RecvWr::new(10, &rsg), RecvWr::new(11, &rsg2)])
            .unwrap();
        let ssg = [src.sge(0..150), src.sge(500..600), src.sge(900..1050)];
        let ssg2 = [src.sge(5000..5010)];
        // A chain of two: only the last is signaled.
        p.a.post_send(&mut [
            SendWr::send(3, &ssg),
            SendWr::send_with_imm(4, &ssg2, 0xdead_beef).signaled(),
        ])
        .unwrap();
    }
    let wc = poll_one(&p.cq_a);
    wc.result().unwrap();
    assert_eq!(wc.wr_id(), 4, "unsignaled request 3 must not complete");
    let r = poll_n(&p.cq_b, 2);
    r[0].result().unwrap();
    r[1].result().unwrap();
    assert_eq!(
        (
            r[0].wr_id(),
            r[0].opcode(),
            r[0].byte_len(),
            r[0].imm_data()
        ),
        (10, WcOpcode::RECV, 400, None)
    );
    assert_eq!(
        (r[1].wr_id(), r[1].byte_len(), r[1].imm_data()),
        (11, 10, Some(0xdead_beef))
    );
    let mut sent = Vec::new();
    sent.extend_from_slice(&src.as_slice()[0..150]);
    sent.extend_from_slice(&src.as_slice()[500..600]);
    sent.extend_from_slice(&src.as_slice()[900..1050]);
    let mut got = Vec::new();
    got.extend_from_slice(&rbuf.as_slice()[0..100]);
    got.extend_from_slice(&rbuf.as_slice()[1000..1100]);
    got.extend_from_slice(&rbuf.as_slice()[2000..2200]);
    assert_eq!(got, sent);
    assert_eq!(&rbuf.as_slice()[3000..3010], &src.as_slice()[5000..5010]);

    // WRITE_WITH_IMM consumes a receive and carries the immediate.
    {
        let rsg = [rbuf.sge(0..1)];
        p.b.post_recv(&mut [RecvWr::new(12, &rsg)]).unwrap();
        let sge = [src.sge(0..1024)];
        p.a.post_send(&mut [
            SendWr::write_with_imm(5, &sge, dst.remote().slice(4096, 1024), 42).signaled(),
        ])
        .unwrap();
    }
    poll_one(&p.cq_a).result().unwrap();
    let wc = poll_one(&p.cq_b);
    wc.result().unwrap();
    assert_eq!(
        (wc.opcode(), wc.imm_data(), wc.byte_len()),
        (WcOpcode::RECV_RDMA_WITH_IMM, Some(42), 1024)
    );
    assert_eq!(&dst.as_slice()[4096..5120], &src.as_slice()[..1024]);

    // Inline SEND and inline WRITE from plain (unregistered) bytes.
    let msg = b"inline payload, not registered".to_vec();
    {
        let rsg = [rbuf.sge(0..64)];
        p.b.post_recv(&mut [RecvWr::new(13, &rsg)]).unwrap();
        let inl = [InlineSge::new(&msg)];
        p.a.post_send(&mut [
            SendWr::send_inline(6, &inl),
            SendWr::write_inline(7, &inl, dst.remote().slice(100, msg.len() as u64)).signaled(),
        ])
        .unwrap();
    }
    poll_one(&p.cq_a).result().unwrap();
    let wc = poll_one(&p.cq_b);
    wc.result().unwrap();
    assert_eq!(wc.byte_len() as usize, msg.len());
    assert_eq!(&rbuf.as_slice()[..msg.len()], &msg[..]);
    assert_eq!(&dst.as_slice()[100..100 + msg.len()], &msg[..]);

    // Atomics: compare-and-swap then fetch-and-add on an 8-byte word.
    let attr = ctx.query_device().unwrap();
    assert_ne!(attr.atomic_cap(), AtomicCap::NONE, "rxe announces atomics");
    dst.as_mut_slice()[..8].copy_from_slice(&100u64.to_ne_bytes());
    let word = dst.remote().slice(0, 8);
    {
        let res = [src.sge(0..8)];
        p.a.post_send(&mut [SendWr::compare_swap(8, &res, word, 100, 555).signaled()])
            .unwrap();
    }
    let wc = poll_one(&p.cq_a);
    wc.result().unwrap();
    assert_eq!(wc.opcode(), WcOpcode::COMP_SWAP);
    assert_eq!(
        u64::from_ne_bytes(src.as_slice()[..8].try_into().unwrap()),
        100,
        "old value"
    );
    assert_eq!(
        u64::from_ne_bytes(dst.as_slice()[..8].try_into().unwrap()),
        555
    );
    {
        let res = [src.sge(8..16)];
        p.a.post_send(&mut [SendWr::fetch_add(9, &res, word, 45).signaled()])
            .unwrap();
    }
    let wc = poll_one(&p.cq_a);
    wc.result().unwrap();
    assert_eq!(wc.opcode(), WcOpcode::FETCH_ADD);
    assert_eq!(
        u64::from_ne_bytes(src.as_slice()[8..16].try_into().unwrap()),
        555
    );
    assert_eq!(
        u64::from_ne_bytes(dst.as_slice()[..8].try_into().unwrap()),
        600
    );
}

#[test]
fn wr_api_and_extended_cq() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = ctx
        .create_cq_ex(
            &CqInitAttrEx::new(64).wc_flags(WcFlags::BYTE_LEN | WcFlags::IMM | WcFlags::QP_NUM),
        )
        .unwrap();
    let cq_b = ctx.create_cq_ex(&CqInitAttrEx::new(64)).unwrap();
    let o = opts(&ctx);
    let ops = SendOpsFlags::RDMA_WRITE
        | SendOpsFlags::RDMA_WRITE_WITH_IMM
        | SendOpsFlags::RDMA_READ
        | SendOpsFlags::SEND
        | SendOpsFlags::SEND_WITH_IMM
        | SendOpsFlags::ATOMIC_CMP_AND_SWP
        | SendOpsFlags::ATOMIC_FETCH_AND_ADD;
    let mk = |cq: &CompletionQueue| {
        pd.create_qp(QpType::RC, cq, cq)
            .max_inline_data(64)
            .max_send_sge(2)
            .send_ops_flags(ops)
            .build()
            .unwrap()
    };
    let (a, b) = (mk(&cq_a), mk(&cq_b));
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    let mut a = a.connect(&eb, &o).unwrap();
    let b = b.connect(&ea, &o).unwrap();

    let mut src = mr(&pd, 8192);
    let mut dst = mr(&pd, 8192);
    src.as_mut_slice().copy_from_slice(&pattern(8192, 3));
    dst.as_mut_slice()[4096..4104].copy_from_slice(&7u64.to_ne_bytes());
    let rbuf = mr(&pd, 4096);
    {
        let rsg = [rbuf.sge(0..2048)];
        let rsg2 = [rbuf.sge(2048..4000)];
        let rsg3 = [rbuf.sge(4000..4096)];
        b.post_recv(&mut [
            RecvWr::new(50, &rsg),
            RecvWr::new(51, &rsg2),
            RecvWr::new(52, &rsg3),
        ])
        .unwrap();
    }
    {
        let mut batch = a.wr_start().unwrap();
        batch
            .write(
                1,
                SendFlags::SIGNALED,
                dst.remote().slice(0, 1000),
                &[src.sge(0..1000)],
            )
            .read(
                2,
                SendFlags::SIGNALED,
                dst.remote().slice(0, 500),
                &[src.sge(2000..2500)],
            )
            .send_imm(
                3,
                SendFlags::SIGNALED,
                77,
                &[src.sge(3000..3100), src.sge(3200..3300)],
            )
            .send_inline(4, SendFlags::SIGNALED, b"wr-inline")
            .compare_swap(
                5,
                SendFlags::SIGNALED,
                dst.remote().slice(4096, 8),
                7,
                70,
                src.sge(5000..5008),
            )
            .fetch_add(
                6,
                SendFlags::SIGNALED,
                dst.remote().slice(4096, 8),
                5,
                src.sge(5008..5016),
            )
            .write_imm(
                7,
                SendFlags::SIGNALED,
                dst.remote().slice(6000, 10),
                99,
                &[src.sge(6000..6010)],
            );
        batch.complete().unwrap();
    }
    let wcs = poll_n(&cq_a, 7);
    for (i, wc) in wcs.iter().enumerate() {
        wc.result().unwrap();
        assert_eq!(wc.wr_id(), i as u64 + 1);
    }
    assert_eq!(wcs[1].opcode(), WcOpcode::RDMA_READ);
    assert_eq!(wcs[4].opcode(), WcOpcode::COMP_SWAP);
    let src_pat = pattern(8192, 3);
    assert_eq!(&dst.as_slice()[..1000], &src_pat[..1000]);
    assert_eq!(
        &src.as_slice()[2000..2500],
        &src_pat[..500],
        "read back what was written"
    );
    assert_eq!(
        u64::from_ne_bytes(src.as_slice()[5000..5008].try_into().unwrap()),
        7
    );
    assert_eq!(
        u64::from_ne_bytes(src.as_slice()[5008..5016].try_into().unwrap()),
        70
    );
    assert_eq!(
        u64::from_ne_bytes(dst.as_slice()[4096..4104].try_into().unwrap()),
        75
    );
    assert_eq!(&dst.as_slice()[6000..6010], &src_pat[6000..6010]);

    // The extended CQ reports opcode, byte length, immediate and QP number.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.len() < 3 {
        cq_b.poll_ex_with(4, |c| seen.push(*c)).unwrap();
        assert!(Instant::now() < deadline);
    }
    assert_eq!(
        (
            seen[0].wr_id,
            seen[0].opcode,
            seen[0].byte_len,
            seen[0].imm_data
        ),
        (50, WcOpcode::RECV, 200, Some(77))
    );
    assert_eq!(seen[0].qp_num, b.qp_num());
    assert_eq!(
        (seen[1].wr_id, seen[1].byte_len, seen[1].imm_data),
        (51, 9, None)
    );
    assert_eq!(
        (seen[2].wr_id, seen[2].opcode, seen[2].imm_data),
        (52, WcOpcode::RECV_RDMA_WITH_IMM, Some(99))
    );
    let mut expect = src_pat[3000..3100].to_vec();
    expect.extend_from_slice(&src_pat[3200..3300]);
    assert_eq!(&rbuf.as_slice()[..200], &expect[..]);
    assert_eq!(&rbuf.as_slice()[2048..2057], b"wr-inline");

    // An aborted batch posts nothing.
    {
        let mut batch = a.wr_start().unwrap();
        batch.write(100, SendFlags::SIGNALED, dst.remote(), &[src.sge(0..8)]);
        drop(batch);
    }
    let mut wc = [WorkCompletion::default(); 4];
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        cq_a.poll(&mut wc).unwrap().is_empty(),
        "aborted batch must not complete"
    );
    // poll_ex_with on a classic CQ, and wr_start without send_ops_flags.
    let classic = ctx.create_cq(4, None, 0).unwrap();
    assert!(matches!(
        classic.poll_ex_with(1, |_| ()),
        Err(Error::Unsupported { .. })
    ));
    let mut p = pair(&ctx);
    assert!(matches!(p.a.wr_start(), Err(Error::Unsupported { .. })));
}

#[test]
fn completion_channel_is_pollable() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let pd = ctx.alloc_pd().unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    ch.set_nonblocking(true).unwrap();
    let cq_a = ctx.create_cq(16, None, 0).unwrap();
    let cq_b = ctx.create_cq(16, Some(&ch), 0).unwrap();
    assert!(matches!(ch.get_event(), Err(Error::WouldBlock { .. })));
    let o = opts(&ctx);
    let a = prepared(&pd, &cq_a, QpType::RC);
    let b = prepared(&pd, &cq_b, QpType::RC);
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    let a = a.connect(&eb, &o).unwrap();
    let b = b.connect(&ea, &o).unwrap();
    let buf = mr(&pd, 64);
    let rsg = [buf.sge(0..64)];
    b.post_recv(&mut [RecvWr::new(1, &rsg)]).unwrap();
    cq_b.req_notify(false).unwrap();
    let msg = [InlineSge::new(b"event!")];
    a.post_send(&mut [SendWr::send_inline(2, &msg).signaled()])
        .unwrap();
    // Wait on the fd as an event loop would.
    let mut pfd = libc::pollfd {
        fd: ch.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, 10 s timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 10_000) };
    assert_eq!(n, 1, "channel fd did not become readable");
    let ev = ch.get_event().unwrap();
    assert_eq!(ev.cq_handle, cq_b.handle());
    let wc = poll_one(&cq_b);
    wc.result().unwrap();
    assert_eq!(&buf.as_slice()[..6], b"event!");
    poll_one(&cq_a).result().unwrap();
    // A CQ without a channel cannot be armed.
    assert!(matches!(
        cq_a.req_notify(false),
        Err(Error::InvalidArgument(_))
    ));
    // CQ resize.
    cq_a.resize(256).unwrap();
    assert!(cq_a.cqe() >= 256, "cqe {}", cq_a.cqe());
}

#[test]
fn ud_send_recv_with_address_handle() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = ctx.create_cq(16, None, 0).unwrap();
    let cq_b = ctx.create_cq(16, None, 0).unwrap();
    let o = opts(&ctx);
    let a = prepared(&pd, &cq_a, QpType::UD);
    let b = prepared(&pd, &cq_b, QpType::UD);
    let eb = b.endpoint(&o).unwrap();
    let a = a.ready_ud(&o).unwrap();
    let b = b.ready_ud(&o).unwrap();
    assert_eq!(a.state().unwrap(), QpState::RTS);
    let ah = pd
        .create_ah(&AhAttr::from_endpoint(&eb, o.port_num, o.gid_index))
        .unwrap();
    let mut sbuf = mr(&pd, 1024);
    let rbuf = mr(&pd, 40 + 1024);
    sbuf.as_mut_slice().copy_from_slice(&pattern(1024, 11));
    let rsg = [rbuf.sge(..)];
    b.post_recv(&mut [RecvWr::new(1, &rsg)]).unwrap();
    let ssg = [sbuf.sge(0..1000)];
    a.post_send(&mut [SendWr::send_with_imm(2, &ssg, 5)
        .ud(&ah, eb.qp_num, o.qkey)
        .signaled()])
        .unwrap();
    poll_one(&cq_a).result().unwrap();
    let wc = poll_one(&cq_b);
    wc.result().unwrap();
    assert!(wc.has_grh());
    assert_eq!(
        (wc.byte_len(), wc.src_qp(), wc.imm_data()),
        (40 + 1000, a.qp_num(), Some(5))
    );
    assert_eq!(&rbuf.as_slice()[40..1040], &pattern(1024, 11)[..1000]);
    // connect() is for connected QPs only.
    let c = prepared(&pd, &cq_a, QpType::UD);
    assert!(matches!(c.connect(&eb, &o), Err(Error::InvalidArgument(_))));
}

#[test]
fn uc_write_if_supported() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    // rxe implements UC (SEND and RDMA WRITE).
    let p = pair_with(&ctx, |pd, cq| prepared(pd, cq, QpType::UC));
    let mut src = mr(&p.pd, 4096);
    let dst = mr(&p.pd, 4096);
    src.as_mut_slice().copy_from_slice(&pattern(4096, 21));
    let sge = [src.sge(..)];
    p.a.post_send(&mut [SendWr::write(1, &sge, dst.remote()).signaled()])
        .unwrap();
    poll_one(&p.cq_a).result().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while dst.as_slice() != src.as_slice() {
        assert!(Instant::now() < deadline, "UC write did not land");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn srq_and_limit_event() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let pd = ctx.alloc_pd().unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let cq_a = ctx.create_cq(32, None, 0).unwrap();
    let cq_b = ctx.create_cq(32, None, 0).unwrap();
    let o = opts(&ctx);
    let a = prepared(&pd, &cq_a, QpType::RC);
    let b = pd
        .create_qp(QpType::RC, &cq_b, &cq_b)
        .srq(&srq)
        .build()
        .unwrap();
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    let a = a.connect(&eb, &o).unwrap();
    let _b = b.connect(&ea, &o).unwrap();
    let rbuf = mr(&pd, 8 * 64);
    let sges: Vec<_> = (0..8).map(|i| [rbuf.sge(i * 64..(i + 1) * 64)]).collect();
    let mut wrs: Vec<_> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr::new(i as u64, s))
        .collect();
    srq.post_recv(&mut wrs).unwrap();
    srq.arm_limit(4).unwrap();
    assert_eq!(srq.query().unwrap().srq_limit, 4);
    ctx.set_async_nonblocking(true).unwrap();
    for i in 0..5u8 {
        let msg = [i; 16];
        let inl = [InlineSge::new(&msg)];
        a.post_send(&mut [SendWr::send_inline(100 + i as u64, &inl).signaled()])
            .unwrap();
        poll_one(&cq_a).result().unwrap();
    }
    let got = poll_n(&cq_b, 5);
    for (i, wc) in got.iter().enumerate() {
        wc.result().unwrap();
        let slot = wc.wr_id() as usize;
        assert_eq!(slot, i, "SRQ consumes receives in order");
        assert_eq!(&rbuf.as_slice()[slot * 64..slot * 64 + 16], &[i as u8; 16]);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let ev = loop {
        match ctx.get_async_event() {
            Ok(ev) => break ev,
            Err(Error::WouldBlock { .. }) => {
                assert!(Instant::now() < deadline, "no SRQ limit event");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(ev.event_type, AsyncEventType::SRQ_LIMIT_REACHED);
    assert_eq!(
        ev.element,
        AsyncElement::Srq {
            handle: srq.handle()
        }
    );
    assert_eq!(
        srq.query().unwrap().srq_limit,
        0,
        "the limit disarms after firing"
    );
}

#[test]
fn error_paths_are_typed() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let p = pair(&ctx);
    let src = mr(&p.pd, 4096);
    let dst = mr(&p.pd, 4096);
    let sge = [src.sge(0..64)];

    // Write outside the remote MR: remote access error; the QP goes to ERR.
    p.a.post_send(&mut [SendWr::write(1, &sge, dst.remote().slice(4090, 64)).signaled()])
        .unwrap();
    let wc = poll_one(&p.cq_a);
    assert_eq!(wc.status(), WcStatus::REM_ACCESS_ERR, "{wc:?}");
    assert!(matches!(
        wc.result(),
        Err(Error::WorkCompletion {
            status: WcStatus::REM_ACCESS_ERR,
            wr_id: 1,
            ..
        })
    ));
    assert_eq!(p.a.state().unwrap(), QpState::ERR);
    // Further work is flushed.
    p.a.post_send(&mut [SendWr::write(2, &sge, dst.remote()).signaled()])
        .unwrap();
    let wc = poll_one(&p.cq_a);
    assert!(matches!(
        wc.result(),
        Err(Error::RemoteDisconnect {
            status: WcStatus::WR_FLUSH_ERR,
            wr_id: 2,
            ..
        })
    ));

    // Recovery: back to RESET and reconnect both sides, then a write succeeds.
    let o = opts(&ctx);
    let a = p.a.reset().unwrap();
    let b = p.b.reset().unwrap();
    assert_eq!(a.state().unwrap(), QpState::RESET);
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    let a = a.connect(&eb, &o).unwrap();
    let b = b.connect(&ea, &o).unwrap();
    a.post_send(&mut [SendWr::write(3, &sge, dst.remote()).signaled()])
        .unwrap();
    poll_one(&p.cq_a).result().unwrap();

    // Wrong rkey.
    let bad = RemoteMemory {
        rkey: dst.rkey() ^ 0x5a5a00,
        ..dst.remote()
    };
    a.post_send(&mut [SendWr::write(4, &sge, bad).signaled()])
        .unwrap();
    let wc = poll_one(&p.cq_a);
    assert!(
        matches!(
            wc.result(),
            Err(Error::WorkCompletion {
                status: WcStatus::REM_ACCESS_ERR,
                ..
            })
        ),
        "{wc:?}"
    );

    // QP used before RTS: a QP moved back to INIT cannot send; RESET cannot receive.
    a.modify(&QpAttr::default().qp_state(QpState::RESET))
        .unwrap();
    a.modify(
        &QpAttr::default()
            .qp_state(QpState::INIT)
            .pkey_index(0)
            .port_num(1)
            .qp_access_flags(AccessFlags::all_remote()),
    )
    .unwrap();
    let err = a
        .post_send(&mut [SendWr::write(5, &sge, dst.remote())])
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidQpState {
                state: QpState::INIT,
                ..
            }
        ),
        "{err}"
    );
    let fresh = prepared(&p.pd, &p.cq_a, QpType::RC);
    let rsg = [dst.sge(0..8)];
    let err = fresh.post_recv(&mut [RecvWr::new(6, &rsg)]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidQpState {
                state: QpState::RESET,
                ..
            }
        ),
        "{err}"
    );

    // A modify with missing mask bits is explained.
    let mut fresh = fresh;
    fresh.init(&o).unwrap();
    let err = fresh
        .modify(&QpAttr::default().qp_state(QpState::RTR))
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            Error::ModifyQp {
                from: QpState::INIT,
                to: QpState::RTR,
                ..
            }
        ),
        "{text}"
    );
    assert!(
        text.contains("missing attribute mask bits") && text.contains("DEST_QPN"),
        "{text}"
    );

    // Posting more than the send queue holds.
    let small =
        p.pd.create_qp(QpType::RC, &p.cq_a, &p.cq_a)
            .max_send_wr(4)
            .build()
            .unwrap();
    let cap = small.cap().max_send_wr as usize;
    let peer = prepared(&p.pd, &p.cq_b, QpType::RC);
    let (es, ep) = (small.endpoint(&o).unwrap(), peer.endpoint(&o).unwrap());
    let small = small.connect(&ep, &o).unwrap();
    let _peer = peer.connect(&es, &o).unwrap();
    // One chain far longer than the queue: the provider fills the queue before the
    // device consumes anything (the doorbell rings after the chain).
    let mut wrs: Vec<_> = (0..1024)
        .map(|i| SendWr::write(100 + i as u64, &sge, dst.remote()))
        .collect();
    let err = small.post_send(&mut wrs).unwrap_err();
    assert!(
        matches!(err, Error::QueueFull { index, .. } if index >= cap && index < 1024),
        "{err} (cap {cap})"
    );
    drop(b);
}

#[test]
fn memory_region_features() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let p = pair(&ctx);
    // Caller memory through the unsafe path.
    let mut own = vec![0u8; 4096];
    // SAFETY: `own` outlives the region (dropped at the end of the test after it) and is
    // not touched while the write below is in flight.
    let raw = unsafe {
        p.pd.reg_mr_raw(own.as_mut_ptr(), own.len(), AccessFlags::all_remote())
    }
    .unwrap();
    let mut src = mr(&p.pd, 4096);
    src.as_mut_slice().copy_from_slice(&pattern(4096, 33));
    let sge = [src.sge(..)];
    p.a.post_send(&mut [SendWr::write(1, &sge, raw.remote()).signaled()])
        .unwrap();
    poll_one(&p.cq_a).result().unwrap();
    drop(raw);
    assert_eq!(own, pattern(4096, 33));

    // Re-registration: access rights change; without REMOTE_WRITE a write is refused.
    let mut dst = mr(&p.pd, 4096);
    match dst.rereg_access(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ) {
        Ok(()) => {
            p.a.post_send(&mut [SendWr::write(2, &sge, dst.remote()).signaled()])
                .unwrap();
            let wc = poll_one(&p.cq_a);
            assert_eq!(
                wc.status(),
                WcStatus::REM_ACCESS_ERR,
                "write after removing REMOTE_WRITE"
            );
        }
        Err(Error::Unsupported { .. }) => {
            println!("rxe: ibv_rereg_mr is not supported (asserted Unsupported)")
        }
        Err(e) => panic!("rereg: {e}"),
    }

    // DMA-BUF: rxe (kernel 6.1) has no reg_user_mr_dmabuf.
    let memfd = std::fs::File::open("/dev/null").unwrap();
    use std::os::fd::AsFd;
    let err =
        p.pd.reg_dmabuf_mr(memfd.as_fd(), 0, 4096, 0, AccessFlags::LOCAL_WRITE)
            .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Unsupported {
                call: "ibv_reg_dmabuf_mr"
            }
        ),
        "{err}"
    );
}

#[test]
fn dereg_with_work_in_flight_is_an_error_completion() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let p = pair(&ctx);
    let dst = mr(&p.pd, 256 << 10);
    let src = mr(&p.pd, 256 << 10);
    let sge = [src.sge(..)];
    let remote = dst.remote();
    // The local source is deregistered right after posting: the completion is either a
    // success (the device finished first) or a typed error, never a crash or a hang.
    p.a.post_send(&mut [SendWr::write(1, &sge, remote).signaled()])
        .unwrap();
    drop(src);
    let wc = poll_one(&p.cq_a);
    match wc.result() {
        Ok(()) => println!("write finished before deregistration"),
        Err(Error::WorkCompletion { status, .. }) => {
            assert!(
                matches!(status, WcStatus::LOC_PROT_ERR | WcStatus::LOC_ACCESS_ERR),
                "{status}"
            )
        }
        Err(e) => panic!("unexpected: {e}"),
    }
}

#[test]
fn async_event_port_down_and_up() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    ctx.set_async_nonblocking(true).unwrap();
    while ctx.get_async_event().is_ok() {}
    let ip = |state: &str| {
        let st = std::process::Command::new("ip")
            .args(["link", "set", "dummy0", state])
            .status()
            .unwrap();
        assert!(st.success(), "ip link set dummy0 {state}");
    };
    let wait = |want: AsyncEventType| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            match ctx.get_async_event() {
                Ok(ev) if ev.event_type == want => return ev,
                Ok(_) => {}
                Err(Error::WouldBlock { .. }) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => panic!("{e}"),
            }
            assert!(Instant::now() < deadline, "no {want:?} event");
        }
    };
    ip("down");
    let ev = wait(AsyncEventType::PORT_ERR);
    assert_eq!(ev.element, AsyncElement::Port { port_num: 1 });
    assert_ne!(ctx.query_port(1).unwrap().state(), PortState::ACTIVE);
    ip("up");
    wait(AsyncEventType::PORT_ACTIVE);
    let deadline = Instant::now() + Duration::from_secs(15);
    while ctx.query_port(1).unwrap().state() != PortState::ACTIVE {
        assert!(Instant::now() < deadline, "port did not come back");
        std::thread::sleep(Duration::from_millis(10));
    }
}
