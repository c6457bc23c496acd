//! Soft-RoCE guest test through the raw FFI only: device list, open, query port and GID,
//! PD, 1 MiB MR, CQs, an RC QP pair in one process connected with the RoCE v2 GID,
//! RDMA WRITE of 64 KiB, byte check, completion polled with a deadline.
//!
//! Runs only when `RDMA_TEST_DEVICE` names the device (`cargo xtask test` sets it to
//! `rxe0` in the guest); then a missing device is a failure.

use ibverbs_sys::*;
use std::ffi::CStr;
use std::mem::zeroed;
use std::ptr;
use std::time::{Duration, Instant};

const PORT: u8 = 1;
const GID_INDEX: u8 = 1;
const MR_LEN: usize = 1 << 20;
const WRITE_LEN: usize = 64 << 10;
const DST_OFFSET: usize = MR_LEN / 2;

fn check(ret: std::ffi::c_int, what: &str) {
    assert_eq!(
        ret,
        0,
        "{what} failed: {}",
        std::io::Error::from_raw_os_error(ret.abs())
    );
}

fn nonnull<T>(p: *mut T, what: &str) -> *mut T {
    assert!(
        !p.is_null(),
        "{what} failed: {}",
        std::io::Error::last_os_error()
    );
    p
}

struct Side {
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
}

fn create_side(ctx: *mut ibv_context, pd: *mut ibv_pd) -> Side {
    // SAFETY: `ctx` is an open device context; no channel, no CQ context.
    let cq = nonnull(
        unsafe { ibv_create_cq(ctx, 16, ptr::null_mut(), ptr::null_mut(), 0) },
        "ibv_create_cq",
    );
    // SAFETY: all-zero is a valid `ibv_qp_init_attr` (plain integers and null pointers).
    let mut init: ibv_qp_init_attr = unsafe { zeroed() };
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 16;
    init.cap.max_recv_wr = 16;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    // SAFETY: `pd` is a live PD of `ctx`; `init` is fully initialised.
    let qp = nonnull(unsafe { ibv_create_qp(pd, &mut init) }, "ibv_create_qp");
    Side { cq, qp }
}

fn modify(qp: *mut ibv_qp, attr: &mut ibv_qp_attr, mask: u32, what: &str) {
    // SAFETY: `qp` is live and `attr` holds every field named by `mask`.
    check(
        unsafe { ibv_modify_qp(qp, attr, mask as std::ffi::c_int) },
        what,
    );
}

fn connect(qp: *mut ibv_qp, remote_qpn: u32, gid: ibv_gid, mtu: ibv_mtu) {
    // SAFETY: all-zero is a valid `ibv_qp_attr`.
    let mut attr: ibv_qp_attr = unsafe { zeroed() };
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = PORT;
    attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    modify(
        qp,
        &mut attr,
        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
        "modify to INIT",
    );

    // SAFETY: as above.
    let mut attr: ibv_qp_attr = unsafe { zeroed() };
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = mtu;
    attr.dest_qp_num = remote_qpn;
    attr.rq_psn = 0;
    attr.max_dest_rd_atomic = 1;
    attr.min_rnr_timer = 12;
    attr.ah_attr.is_global = 1;
    attr.ah_attr.port_num = PORT;
    attr.ah_attr.grh.dgid = gid;
    attr.ah_attr.grh.sgid_index = GID_INDEX;
    attr.ah_attr.grh.hop_limit = 1;
    modify(
        qp,
        &mut attr,
        IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER,
        "modify to RTR",
    );

    // SAFETY: as above.
    let mut attr: ibv_qp_attr = unsafe { zeroed() };
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;
    attr.sq_psn = 0;
    attr.max_rd_atomic = 1;
    modify(
        qp,
        &mut attr,
        IBV_QP_STATE
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_SQ_PSN
            | IBV_QP_MAX_QP_RD_ATOMIC,
        "modify to RTS",
    );
}

#[test]
fn rc_write_64k_between_two_qps() {
    let Ok(device) = std::env::var("RDMA_TEST_DEVICE") else {
        println!("skipped: RDMA_TEST_DEVICE not set (run via cargo xtask test)");
        return;
    };
    // A hung completion must fail the test, not the whole guest run.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(120));
        eprintln!("rxe_rc_write: watchdog expired");
        std::process::abort();
    });

    let mut num = 0;
    // SAFETY: valid out-pointer; the list is freed at the end.
    let list = nonnull(
        unsafe { ibv_get_device_list(&mut num) },
        "ibv_get_device_list",
    );
    let mut names = Vec::new();
    let mut found = ptr::null_mut();
    for i in 0..num as usize {
        // SAFETY: `list` has `num` valid entries.
        let dev = unsafe { *list.add(i) };
        // SAFETY: `dev` is a listed device; the name is a NUL-terminated string it owns.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }
            .to_string_lossy()
            .into_owned();
        if name == device {
            found = dev;
        }
        names.push(name);
    }
    assert!(
        !found.is_null(),
        "device {device} not in the device list {names:?}"
    );

    // SAFETY: `found` is an entry of the live device list.
    let ctx = nonnull(unsafe { ibv_open_device(found) }, "ibv_open_device");

    // SAFETY: all-zero is a valid `ibv_port_attr`.
    let mut port: ibv_port_attr = unsafe { zeroed() };
    // SAFETY: `ctx` is open, `port` a valid out-pointer.
    check(
        unsafe { ibv_query_port(ctx, PORT, &mut port) },
        "ibv_query_port",
    );
    assert_eq!(port.state, IBV_PORT_ACTIVE, "port {PORT} not active");
    assert_eq!(
        port.link_layer, IBV_LINK_LAYER_ETHERNET as u8,
        "rxe is RoCE"
    );

    // SAFETY: all-zero is a valid `ibv_gid`.
    let mut gid: ibv_gid = unsafe { zeroed() };
    // SAFETY: `ctx` open, valid out-pointer.
    check(
        unsafe { ibv_query_gid(ctx, PORT, GID_INDEX.into(), &mut gid) },
        "ibv_query_gid",
    );
    // SAFETY: all-zero is a valid `ibv_gid_entry`.
    let mut entry: ibv_gid_entry = unsafe { zeroed() };
    // SAFETY: `ctx` open, valid out-pointer, flags 0.
    check(
        unsafe { ibv_query_gid_ex(ctx, PORT.into(), GID_INDEX.into(), &mut entry, 0) },
        "ibv_query_gid_ex",
    );
    assert_eq!(
        entry.gid_type, IBV_GID_TYPE_ROCE_V2,
        "GID {GID_INDEX} is not RoCE v2"
    );
    // SAFETY: both union views are plain bytes.
    let (raw, raw_ex) = unsafe { (gid.raw, entry.gid.raw) };
    assert_eq!(raw, raw_ex, "ibv_query_gid and ibv_query_gid_ex disagree");
    assert_eq!(
        &raw[..12],
        &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff],
        "not IPv4-mapped"
    );

    // SAFETY: `ctx` is open.
    let pd = nonnull(unsafe { ibv_alloc_pd(ctx) }, "ibv_alloc_pd");
    let mut buf = vec![0u8; MR_LEN];
    for (i, b) in buf[..WRITE_LEN].iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    // SAFETY: `buf` outlives the MR (deregistered before `buf` drops) and is not moved.
    let mr = nonnull(
        unsafe {
            ibv_reg_mr(
                pd,
                buf.as_mut_ptr().cast(),
                MR_LEN,
                access as std::ffi::c_int,
            )
        },
        "ibv_reg_mr",
    );

    let a = create_side(ctx, pd);
    let b = create_side(ctx, pd);
    // SAFETY: both QPs are live.
    let (qpn_a, qpn_b) = unsafe { ((*a.qp).qp_num, (*b.qp).qp_num) };
    connect(a.qp, qpn_b, gid, port.active_mtu);
    connect(b.qp, qpn_a, gid, port.active_mtu);

    // SAFETY: `mr` is live.
    let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
    let base = buf.as_mut_ptr() as u64;
    let mut sge = ibv_sge {
        addr: base,
        length: WRITE_LEN as u32,
        lkey,
    };
    // SAFETY: all-zero is a valid `ibv_send_wr`.
    let mut wr: ibv_send_wr = unsafe { zeroed() };
    wr.wr_id = 0xfeed;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = base + DST_OFFSET as u64;
    wr.wr.rdma.rkey = rkey;
    let mut bad = ptr::null_mut();
    // SAFETY: `a.qp` is in RTS; `sge` and `buf` stay valid until the completion is polled.
    check(
        unsafe { ibv_post_send(a.qp, &mut wr, &mut bad) },
        "ibv_post_send",
    );

    // SAFETY: all-zero is a valid `ibv_wc`.
    let mut wc: ibv_wc = unsafe { zeroed() };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // SAFETY: `a.cq` is live, room for one completion.
        let n = unsafe { ibv_poll_cq(a.cq, 1, &mut wc) };
        assert!(n >= 0, "ibv_poll_cq failed: {n}");
        if n == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "no completion within 30 s");
        std::thread::sleep(Duration::from_micros(100));
    }
    // SAFETY: ibv_wc_status_str returns a static string.
    let status = unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) };
    assert_eq!(wc.status, IBV_WC_SUCCESS, "completion status {status:?}");
    assert_eq!(wc.opcode, IBV_WC_RDMA_WRITE);
    assert_eq!(wc.wr_id, 0xfeed);
    // The completion means the data is placed in the target buffer.
    // SAFETY: the HCA has finished writing; read through a volatile-free copy of the bytes.
    let written = unsafe { std::slice::from_raw_parts(buf.as_ptr().add(DST_OFFSET), WRITE_LEN) };
    assert!(written == &buf[..WRITE_LEN], "RDMA WRITE data differs");

    // SAFETY: every object is live and destroyed once, children before parents.
    unsafe {
        check(ibv_destroy_qp(a.qp), "ibv_destroy_qp");
        check(ibv_destroy_qp(b.qp), "ibv_destroy_qp");
        check(ibv_destroy_cq(a.cq), "ibv_destroy_cq");
        check(ibv_destroy_cq(b.cq), "ibv_destroy_cq");
        check(ibv_dereg_mr(mr), "ibv_dereg_mr");
        check(ibv_dealloc_pd(pd), "ibv_dealloc_pd");
        check(ibv_close_device(ctx), "ibv_close_device");
        ibv_free_device_list(list);
    }
    drop(buf);
}
