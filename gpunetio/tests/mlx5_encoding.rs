//! The mlx5 encoder and the device ABI against rdma-core's `mlx5dv.h` (through
//! `mlx5dv-sys`): every segment offset, opcode, flag, CQE offset and syndrome, and
//! encoded WQEs read back through the C structs. No hardware needed.

use core::mem::{offset_of, size_of};
use gpunetio::ffi::mlx5 as abi;
use gpunetio::mlx5::cqe::{self, CqeErrorKind, CqePoll, Syndrome};
use gpunetio::mlx5::wqe::{self, offsets, Wqe, CQ_UPDATE, FENCE, WQEBB};
use mlx5dv_sys as dv;

#[test]
fn segment_offsets_match_mlx5dv_h() {
    assert_eq!(size_of::<dv::mlx5_wqe_ctrl_seg>(), offsets::SEG);
    assert_eq!(
        offset_of!(dv::mlx5_wqe_ctrl_seg, opmod_idx_opcode),
        offsets::CTRL_OPMOD_IDX_OPCODE
    );
    assert_eq!(
        offset_of!(dv::mlx5_wqe_ctrl_seg, qpn_ds),
        offsets::CTRL_QPN_DS
    );
    assert_eq!(
        offset_of!(dv::mlx5_wqe_ctrl_seg, signature),
        offsets::CTRL_SIGNATURE
    );
    assert_eq!(
        offset_of!(dv::mlx5_wqe_ctrl_seg, fm_ce_se),
        offsets::CTRL_FM_CE_SE
    );
    assert_eq!(offset_of!(dv::mlx5_wqe_ctrl_seg, imm), offsets::CTRL_IMM);
    assert_eq!(size_of::<dv::mlx5_wqe_raddr_seg>(), offsets::SEG);
    assert_eq!(
        offset_of!(dv::mlx5_wqe_raddr_seg, raddr),
        offsets::RADDR_RADDR
    );
    assert_eq!(
        offset_of!(dv::mlx5_wqe_raddr_seg, rkey),
        offsets::RADDR_RKEY
    );
    assert_eq!(size_of::<dv::mlx5_wqe_data_seg>(), offsets::SEG);
    assert_eq!(
        offset_of!(dv::mlx5_wqe_data_seg, byte_count),
        offsets::DATA_BYTE_COUNT
    );
    assert_eq!(offset_of!(dv::mlx5_wqe_data_seg, lkey), offsets::DATA_LKEY);
    assert_eq!(offset_of!(dv::mlx5_wqe_data_seg, addr), offsets::DATA_ADDR);
    assert_eq!(size_of::<dv::mlx5_wqe_atomic_seg>(), offsets::SEG);
    assert_eq!(
        offset_of!(dv::mlx5_wqe_atomic_seg, swap_add),
        offsets::ATOMIC_SWAP_ADD
    );
    assert_eq!(
        offset_of!(dv::mlx5_wqe_atomic_seg, compare),
        offsets::ATOMIC_COMPARE
    );
    assert_eq!(size_of::<dv::mlx5_wqe_inl_data_seg>(), 4);
    assert_eq!(WQEBB, dv::MLX5_SEND_WQE_BB as usize);
}

#[test]
fn cqe_offsets_match_mlx5dv_h() {
    assert_eq!(size_of::<dv::mlx5_cqe64>(), cqe::CQE_SIZE);
    assert_eq!(size_of::<dv::mlx5_err_cqe>(), cqe::CQE_SIZE);
    assert_eq!(
        offset_of!(dv::mlx5_cqe64, op_own),
        abi::GIO_MLX5_CQE_OFF_OP_OWN
    );
    assert_eq!(
        offset_of!(dv::mlx5_cqe64, wqe_counter),
        abi::GIO_MLX5_CQE_OFF_WQE_COUNTER
    );
    assert_eq!(
        offset_of!(dv::mlx5_cqe64, byte_cnt),
        abi::GIO_MLX5_CQE_OFF_BYTE_CNT
    );
    assert_eq!(
        offset_of!(dv::mlx5_cqe64, sop_drop_qpn),
        abi::GIO_MLX5_CQE_OFF_SOP_DROP_QPN
    );
    assert_eq!(
        offset_of!(dv::mlx5_err_cqe, syndrome),
        abi::GIO_MLX5_CQE_OFF_SYNDROME
    );
    assert_eq!(
        offset_of!(dv::mlx5_err_cqe, vendor_err_synd),
        abi::GIO_MLX5_CQE_OFF_VENDOR_SYNDROME
    );
    assert_eq!(
        offset_of!(dv::mlx5_err_cqe, s_wqe_opcode_qpn),
        abi::GIO_MLX5_CQE_OFF_SOP_DROP_QPN
    );
    assert_eq!(
        offset_of!(dv::mlx5_err_cqe, wqe_counter),
        abi::GIO_MLX5_CQE_OFF_WQE_COUNTER
    );
    assert_eq!(
        offset_of!(dv::mlx5_err_cqe, op_own),
        abi::GIO_MLX5_CQE_OFF_OP_OWN
    );
}

#[test]
fn device_constants_match_mlx5dv_h() {
    let pairs: &[(&str, u32, u32)] = &[
        ("NOP", abi::GIO_MLX5_OPCODE_NOP.into(), dv::MLX5_OPCODE_NOP),
        (
            "RDMA_WRITE",
            abi::GIO_MLX5_OPCODE_RDMA_WRITE.into(),
            dv::MLX5_OPCODE_RDMA_WRITE,
        ),
        (
            "RDMA_WRITE_IMM",
            abi::GIO_MLX5_OPCODE_RDMA_WRITE_IMM.into(),
            dv::MLX5_OPCODE_RDMA_WRITE_IMM,
        ),
        (
            "RDMA_READ",
            abi::GIO_MLX5_OPCODE_RDMA_READ.into(),
            dv::MLX5_OPCODE_RDMA_READ,
        ),
        (
            "ATOMIC_CS",
            abi::GIO_MLX5_OPCODE_ATOMIC_CS.into(),
            dv::MLX5_OPCODE_ATOMIC_CS,
        ),
        (
            "ATOMIC_FA",
            abi::GIO_MLX5_OPCODE_ATOMIC_FA.into(),
            dv::MLX5_OPCODE_ATOMIC_FA,
        ),
        (
            "CQ_UPDATE",
            abi::GIO_MLX5_CTRL_CQ_UPDATE.into(),
            dv::MLX5_WQE_CTRL_CQ_UPDATE,
        ),
        (
            "SOLICITED",
            abi::GIO_MLX5_CTRL_SOLICITED.into(),
            dv::MLX5_WQE_CTRL_SOLICITED,
        ),
        (
            "FENCE",
            abi::GIO_MLX5_CTRL_FENCE.into(),
            dv::MLX5_WQE_CTRL_FENCE,
        ),
        ("INLINE_SEG", abi::GIO_MLX5_INLINE_SEG, dv::MLX5_INLINE_SEG),
        ("WQEBB", abi::GIO_MLX5_WQEBB, dv::MLX5_SEND_WQE_BB),
        ("CQE_REQ", abi::GIO_MLX5_CQE_REQ.into(), dv::MLX5_CQE_REQ),
        (
            "CQE_RESP_WR_IMM",
            abi::GIO_MLX5_CQE_RESP_WR_IMM.into(),
            dv::MLX5_CQE_RESP_WR_IMM,
        ),
        (
            "CQE_RESP_SEND",
            abi::GIO_MLX5_CQE_RESP_SEND.into(),
            dv::MLX5_CQE_RESP_SEND,
        ),
        (
            "CQE_RESP_SEND_IMM",
            abi::GIO_MLX5_CQE_RESP_SEND_IMM.into(),
            dv::MLX5_CQE_RESP_SEND_IMM,
        ),
        (
            "CQE_RESP_SEND_INV",
            abi::GIO_MLX5_CQE_RESP_SEND_INV.into(),
            dv::MLX5_CQE_RESP_SEND_INV,
        ),
        (
            "CQE_REQ_ERR",
            abi::GIO_MLX5_CQE_REQ_ERR.into(),
            dv::MLX5_CQE_REQ_ERR,
        ),
        (
            "CQE_RESP_ERR",
            abi::GIO_MLX5_CQE_RESP_ERR.into(),
            dv::MLX5_CQE_RESP_ERR,
        ),
        (
            "CQE_INVALID",
            abi::GIO_MLX5_CQE_INVALID.into(),
            dv::MLX5_CQE_INVALID,
        ),
        (
            "CQE_OWNER_MASK",
            abi::GIO_MLX5_CQE_OWNER_MASK.into(),
            dv::MLX5_CQE_OWNER_MASK,
        ),
    ];
    for (name, ours, theirs) in pairs {
        assert_eq!(ours, theirs, "{name}");
    }
    let syndromes: &[(Syndrome, u32)] = &[
        (
            Syndrome::LOCAL_LENGTH,
            dv::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR,
        ),
        (
            Syndrome::LOCAL_QP_OPERATION,
            dv::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR,
        ),
        (
            Syndrome::LOCAL_PROTECTION,
            dv::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR,
        ),
        (Syndrome::WR_FLUSH, dv::MLX5_CQE_SYNDROME_WR_FLUSH_ERR),
        (Syndrome::MW_BIND, dv::MLX5_CQE_SYNDROME_MW_BIND_ERR),
        (Syndrome::BAD_RESPONSE, dv::MLX5_CQE_SYNDROME_BAD_RESP_ERR),
        (
            Syndrome::LOCAL_ACCESS,
            dv::MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR,
        ),
        (
            Syndrome::REMOTE_INVALID_REQUEST,
            dv::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR,
        ),
        (
            Syndrome::REMOTE_ACCESS,
            dv::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR,
        ),
        (
            Syndrome::REMOTE_OPERATION,
            dv::MLX5_CQE_SYNDROME_REMOTE_OP_ERR,
        ),
        (
            Syndrome::TRANSPORT_RETRY_EXCEEDED,
            dv::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR,
        ),
        (
            Syndrome::RNR_RETRY_EXCEEDED,
            dv::MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR,
        ),
        (
            Syndrome::REMOTE_ABORTED,
            dv::MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR,
        ),
    ];
    for (s, theirs) in syndromes {
        assert_eq!(u32::from(s.0), *theirs, "{s:?}");
        assert!(
            !matches!(s.kind(), CqeErrorKind::Other(_)),
            "{s:?} is named"
        );
    }
}

/// Reads an encoded WQE back through the C structs (what the NIC would see).
fn segments(b: &[u8; WQEBB]) -> [[u8; 16]; 4] {
    let mut s = [[0u8; 16]; 4];
    for (i, seg) in s.iter_mut().enumerate() {
        seg.copy_from_slice(&b[16 * i..16 * i + 16]);
    }
    s
}

fn ctrl(seg: &[u8; 16]) -> dv::mlx5_wqe_ctrl_seg {
    // SAFETY: mlx5_wqe_ctrl_seg is 16 bytes of integers; any bit pattern is valid.
    unsafe { core::ptr::read_unaligned(seg.as_ptr().cast()) }
}

#[test]
fn encoded_wqes_read_back_through_the_c_structs() {
    let data = [0xa5u8; 13];
    let cases = [
        Wqe::Nop,
        Wqe::Write {
            raddr: 0xdead_0000_1000,
            rkey: 0x1234,
            laddr: 0x7f00_0000_2000,
            lkey: 0x5678,
            len: 4096,
        },
        Wqe::WriteImm {
            raddr: 1,
            rkey: 2,
            laddr: 3,
            lkey: 4,
            len: 5,
            imm: 6,
        },
        Wqe::WriteInline {
            raddr: 0x40,
            rkey: 7,
            data: &data,
        },
        Wqe::Read {
            raddr: 0x80,
            rkey: 8,
            laddr: 0x100,
            lkey: 9,
            len: 64,
        },
        Wqe::FetchAdd {
            raddr: 0x200,
            rkey: 10,
            laddr: 0x300,
            lkey: 11,
            add: 1,
        },
        Wqe::CompareSwap {
            raddr: 0x200,
            rkey: 10,
            laddr: 0x300,
            lkey: 11,
            compare: 2,
            swap: 3,
        },
    ];
    for (i, w) in cases.iter().enumerate() {
        let idx = 0xfff0u16.wrapping_add(i as u16 * 5);
        let b = wqe::encode(w, idx, 0x00c0_ffee, CQ_UPDATE | FENCE).unwrap();
        let s = segments(&b);
        let c = ctrl(&s[0]);
        let word = u32::from_be(c.opmod_idx_opcode);
        assert_eq!(word & 0xff, u32::from(w.opcode()), "{w:?}");
        assert_eq!((word >> 8) & 0xffff, u32::from(idx));
        let qpn_ds = u32::from_be(c.qpn_ds);
        assert_eq!(qpn_ds >> 8, 0x00c0_ffee);
        assert_eq!(qpn_ds & 0x3f, u32::from(w.ds()));
        assert_eq!(
            c.fm_ce_se,
            dv::MLX5_WQE_CTRL_CQ_UPDATE as u8 | dv::MLX5_WQE_CTRL_FENCE as u8
        );
        // Nothing beyond ds * 16 bytes.
        assert!(
            b[usize::from(w.ds()) * 16..].iter().all(|&x| x == 0),
            "{w:?}"
        );
        match *w {
            Wqe::Write {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
            }
            | Wqe::Read {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
            } => {
                // SAFETY: plain integer structs of 16 bytes.
                let r: dv::mlx5_wqe_raddr_seg =
                    unsafe { core::ptr::read_unaligned(s[1].as_ptr().cast()) };
                assert_eq!(u64::from_be(r.raddr), raddr);
                assert_eq!(u32::from_be(r.rkey), rkey);
                // SAFETY: as above.
                let d: dv::mlx5_wqe_data_seg =
                    unsafe { core::ptr::read_unaligned(s[2].as_ptr().cast()) };
                assert_eq!(u32::from_be(d.byte_count), len);
                assert_eq!(u32::from_be(d.lkey), lkey);
                assert_eq!(u64::from_be(d.addr), laddr);
            }
            Wqe::WriteImm { imm, .. } => assert_eq!(u32::from_be(c.imm), imm),
            Wqe::WriteInline { data, .. } => {
                // SAFETY: as above (4 bytes).
                let inl: dv::mlx5_wqe_inl_data_seg =
                    unsafe { core::ptr::read_unaligned(s[2].as_ptr().cast()) };
                assert_eq!(
                    u32::from_be(inl.byte_count),
                    data.len() as u32 | dv::MLX5_INLINE_SEG
                );
                assert_eq!(&b[36..36 + data.len()], data);
            }
            Wqe::FetchAdd { add, .. } => {
                // SAFETY: as above.
                let a: dv::mlx5_wqe_atomic_seg =
                    unsafe { core::ptr::read_unaligned(s[2].as_ptr().cast()) };
                assert_eq!(u64::from_be(a.swap_add), add);
                assert_eq!(a.compare, 0);
            }
            Wqe::CompareSwap { compare, swap, .. } => {
                // SAFETY: as above.
                let a: dv::mlx5_wqe_atomic_seg =
                    unsafe { core::ptr::read_unaligned(s[2].as_ptr().cast()) };
                assert_eq!(u64::from_be(a.swap_add), swap);
                assert_eq!(u64::from_be(a.compare), compare);
            }
            Wqe::Nop => {}
        }
    }
}

#[test]
fn synthetic_error_cqes_read_back_through_mlx5_err_cqe() {
    let c = cqe::synthetic_error_cqe(
        7,
        4,
        0xbeef,
        0x12_3456,
        0x12,
        Syndrome::TRANSPORT_RETRY_EXCEEDED,
        0x81,
    );
    // SAFETY: mlx5_err_cqe is 64 bytes of integers.
    let e: dv::mlx5_err_cqe = unsafe { core::ptr::read_unaligned(c.as_ptr().cast()) };
    assert_eq!(e.syndrome, 0x15);
    assert_eq!(e.vendor_err_synd, 0x81);
    assert_eq!(u16::from_be(e.wqe_counter), 0xbeef);
    assert_eq!(u32::from_be(e.s_wqe_opcode_qpn), 0x1212_3456);
    assert_eq!(e.op_own >> 4, dv::MLX5_CQE_REQ_ERR as u8);
    assert_eq!(
        u32::from(e.op_own) & dv::MLX5_CQE_OWNER_MASK,
        1,
        "second pass"
    );
    let CqePoll::Err(err) = cqe::parse_cqe(&c, 7, 4) else {
        panic!("an error CQE");
    };
    assert_eq!(err.kind(), CqeErrorKind::RetryExceeded);
}

#[test]
fn probe_without_an_mlx5_device_is_a_typed_unsupported_error() {
    match gpunetio::mlx5::probe() {
        Ok(dev) => {
            // A machine with a ConnectX: the probe must have found DEVX on it.
            assert!(dev.devx, "{dev:?}");
            eprintln!("mlx5 device with DEVX: {}", dev.name);
        }
        Err(gpunetio::Error::Unsupported(why)) => {
            assert!(why.contains("native mlx5 handler"), "{why}");
            // On a ConnectX machine the suite sets this: no device there is a failure.
            assert!(
                !std::env::var("GPUNETIO_REQUIRE_MLX5").is_ok_and(|v| v == "1"),
                "GPUNETIO_REQUIRE_MLX5=1 but {why}"
            );
            eprintln!("probe: {why}");
        }
        Err(other) => panic!("expected Unsupported, got {other:?}"),
    }
}
