//! The native mlx5 handler's ABI (`include/gpunetio/gio_mlx5.cuh`): the state struct
//! device code reads through `gio_dev_qp.mlx5`, the memory-key table, and the mlx5
//! wire constants the device code uses (the values of rdma-core's `mlx5dv.h`; the
//! `gpunetio` crate's tests check them against `mlx5dv-sys`).

use core::mem::{offset_of, size_of};

pub const GIO_MLX5_OPCODE_NOP: u8 = 0x00;
pub const GIO_MLX5_OPCODE_RDMA_WRITE: u8 = 0x08;
pub const GIO_MLX5_OPCODE_RDMA_WRITE_IMM: u8 = 0x09;
pub const GIO_MLX5_OPCODE_RDMA_READ: u8 = 0x10;
pub const GIO_MLX5_OPCODE_ATOMIC_CS: u8 = 0x11;
pub const GIO_MLX5_OPCODE_ATOMIC_FA: u8 = 0x12;

pub const GIO_MLX5_CTRL_SOLICITED: u8 = 0x02;
pub const GIO_MLX5_CTRL_CQ_UPDATE: u8 = 0x08;
pub const GIO_MLX5_CTRL_FENCE: u8 = 0x80;

pub const GIO_MLX5_INLINE_SEG: u32 = 0x8000_0000;
pub const GIO_MLX5_WQEBB: u32 = 64;
pub const GIO_MLX5_MAX_INLINE: u32 = 28;

pub const GIO_MLX5_CQE_REQ: u8 = 0x0;
pub const GIO_MLX5_CQE_RESP_WR_IMM: u8 = 0x1;
pub const GIO_MLX5_CQE_RESP_SEND: u8 = 0x2;
pub const GIO_MLX5_CQE_RESP_SEND_IMM: u8 = 0x3;
pub const GIO_MLX5_CQE_RESP_SEND_INV: u8 = 0x4;
pub const GIO_MLX5_CQE_REQ_ERR: u8 = 0xd;
pub const GIO_MLX5_CQE_RESP_ERR: u8 = 0xe;
pub const GIO_MLX5_CQE_INVALID: u8 = 0xf;
pub const GIO_MLX5_CQE_OWNER_MASK: u8 = 0x1;
pub const GIO_MLX5_CQE_SIZE: u32 = 64;

pub const GIO_MLX5_SYNDROME_LOCAL_LENGTH_ERR: u8 = 0x01;
pub const GIO_MLX5_SYNDROME_LOCAL_QP_OP_ERR: u8 = 0x02;
pub const GIO_MLX5_SYNDROME_LOCAL_PROT_ERR: u8 = 0x04;
pub const GIO_MLX5_SYNDROME_WR_FLUSH_ERR: u8 = 0x05;
pub const GIO_MLX5_SYNDROME_MW_BIND_ERR: u8 = 0x06;
pub const GIO_MLX5_SYNDROME_BAD_RESP_ERR: u8 = 0x10;
pub const GIO_MLX5_SYNDROME_LOCAL_ACCESS_ERR: u8 = 0x11;
pub const GIO_MLX5_SYNDROME_REMOTE_INVAL_REQ_ERR: u8 = 0x12;
pub const GIO_MLX5_SYNDROME_REMOTE_ACCESS_ERR: u8 = 0x13;
pub const GIO_MLX5_SYNDROME_REMOTE_OP_ERR: u8 = 0x14;
pub const GIO_MLX5_SYNDROME_TRANSPORT_RETRY_EXC_ERR: u8 = 0x15;
pub const GIO_MLX5_SYNDROME_RNR_RETRY_EXC_ERR: u8 = 0x16;
pub const GIO_MLX5_SYNDROME_REMOTE_ABORTED_ERR: u8 = 0x22;

pub const GIO_MLX5_CQE_OFF_VENDOR_SYNDROME: usize = 54;
pub const GIO_MLX5_CQE_OFF_SYNDROME: usize = 55;
pub const GIO_MLX5_CQE_OFF_BYTE_CNT: usize = 44;
pub const GIO_MLX5_CQE_OFF_SOP_DROP_QPN: usize = 56;
pub const GIO_MLX5_CQE_OFF_WQE_COUNTER: usize = 60;
pub const GIO_MLX5_CQE_OFF_OP_OWN: usize = 63;

pub const GIO_MLX5_SND_DBR: u32 = 1;

pub const GIO_MLX5_QP_BLUEFLAME: u32 = 0x1;

/// Wire address and key of one memory table entry (lkey local, rkey remote).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct gio_mlx5_key {
    pub addr: u64,
    pub key: u32,
    pub reserved: u32,
}

/// The mlx5 handler's state (device memory): host-written first cache line, then the
/// device-written counters.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gio_mlx5_qp {
    pub sq_buf: u64,
    pub dbrec: u64,
    pub db: u64,
    pub cq_buf: u64,
    pub cq_dbrec: u64,
    pub keys: u64,
    pub scratch_addr: u64,
    pub scratch_lkey: u32,
    pub qpn: u32,
    pub sq_wqe_cnt: u32,
    pub cq_cqe_cnt: u32,
    pub flags: u32,
    pub num_keys: u32,
    pub pad0: [u8; 48],
    pub sq_rung: u64,
    pub sq_completed: u64,
    pub error_wqe: u64,
    pub error: i32,
    pub syndrome: u32,
    pub pad1: [u8; 32],
}

impl Default for gio_mlx5_qp {
    fn default() -> Self {
        Self {
            sq_buf: 0,
            dbrec: 0,
            db: 0,
            cq_buf: 0,
            cq_dbrec: 0,
            keys: 0,
            scratch_addr: 0,
            scratch_lkey: 0,
            qpn: 0,
            sq_wqe_cnt: 0,
            cq_cqe_cnt: 0,
            flags: 0,
            num_keys: 0,
            pad0: [0; 48],
            sq_rung: 0,
            sq_completed: 0,
            error_wqe: 0,
            error: crate::GIO_OK,
            syndrome: 0,
            pad1: [0; 32],
        }
    }
}

/// `(struct, field, offset)` / `(struct, "sizeof", size)` of the mlx5 structs, in the
/// order the `gio_mlx5_layout` test kernel measures them.
pub const MLX5_LAYOUT: &[(&str, &str, usize)] = &[
    ("gio_mlx5_key", "sizeof", size_of::<gio_mlx5_key>()),
    ("gio_mlx5_key", "addr", offset_of!(gio_mlx5_key, addr)),
    ("gio_mlx5_key", "key", offset_of!(gio_mlx5_key, key)),
    ("gio_mlx5_qp", "sizeof", size_of::<gio_mlx5_qp>()),
    ("gio_mlx5_qp", "sq_buf", offset_of!(gio_mlx5_qp, sq_buf)),
    ("gio_mlx5_qp", "dbrec", offset_of!(gio_mlx5_qp, dbrec)),
    ("gio_mlx5_qp", "db", offset_of!(gio_mlx5_qp, db)),
    ("gio_mlx5_qp", "cq_buf", offset_of!(gio_mlx5_qp, cq_buf)),
    ("gio_mlx5_qp", "cq_dbrec", offset_of!(gio_mlx5_qp, cq_dbrec)),
    ("gio_mlx5_qp", "keys", offset_of!(gio_mlx5_qp, keys)),
    (
        "gio_mlx5_qp",
        "scratch_addr",
        offset_of!(gio_mlx5_qp, scratch_addr),
    ),
    (
        "gio_mlx5_qp",
        "scratch_lkey",
        offset_of!(gio_mlx5_qp, scratch_lkey),
    ),
    ("gio_mlx5_qp", "qpn", offset_of!(gio_mlx5_qp, qpn)),
    (
        "gio_mlx5_qp",
        "sq_wqe_cnt",
        offset_of!(gio_mlx5_qp, sq_wqe_cnt),
    ),
    (
        "gio_mlx5_qp",
        "cq_cqe_cnt",
        offset_of!(gio_mlx5_qp, cq_cqe_cnt),
    ),
    ("gio_mlx5_qp", "flags", offset_of!(gio_mlx5_qp, flags)),
    ("gio_mlx5_qp", "num_keys", offset_of!(gio_mlx5_qp, num_keys)),
    ("gio_mlx5_qp", "sq_rung", offset_of!(gio_mlx5_qp, sq_rung)),
    (
        "gio_mlx5_qp",
        "sq_completed",
        offset_of!(gio_mlx5_qp, sq_completed),
    ),
    (
        "gio_mlx5_qp",
        "error_wqe",
        offset_of!(gio_mlx5_qp, error_wqe),
    ),
    ("gio_mlx5_qp", "error", offset_of!(gio_mlx5_qp, error)),
    ("gio_mlx5_qp", "syndrome", offset_of!(gio_mlx5_qp, syndrome)),
];

// The header's static asserts, on the Rust side.
const _: () = {
    assert!(size_of::<gio_mlx5_key>() == 16);
    assert!(offset_of!(gio_mlx5_key, key) == 8);
    assert!(size_of::<gio_mlx5_qp>() == 192);
    assert!(offset_of!(gio_mlx5_qp, dbrec) == 8);
    assert!(offset_of!(gio_mlx5_qp, db) == 16);
    assert!(offset_of!(gio_mlx5_qp, cq_buf) == 24);
    assert!(offset_of!(gio_mlx5_qp, cq_dbrec) == 32);
    assert!(offset_of!(gio_mlx5_qp, keys) == 40);
    assert!(offset_of!(gio_mlx5_qp, scratch_addr) == 48);
    assert!(offset_of!(gio_mlx5_qp, scratch_lkey) == 56);
    assert!(offset_of!(gio_mlx5_qp, qpn) == 60);
    assert!(offset_of!(gio_mlx5_qp, sq_wqe_cnt) == 64);
    assert!(offset_of!(gio_mlx5_qp, cq_cqe_cnt) == 68);
    assert!(offset_of!(gio_mlx5_qp, flags) == 72);
    assert!(offset_of!(gio_mlx5_qp, num_keys) == 76);
    assert!(offset_of!(gio_mlx5_qp, sq_rung) == 128);
    assert!(offset_of!(gio_mlx5_qp, sq_completed) == 136);
    assert!(offset_of!(gio_mlx5_qp, error_wqe) == 144);
    assert!(offset_of!(gio_mlx5_qp, error) == 152);
    assert!(offset_of!(gio_mlx5_qp, syndrome) == 156);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_constants_match_the_rust_constants() {
        let consts: &[(&str, i128)] = &[
            ("GIO_MLX5_OPCODE_NOP", GIO_MLX5_OPCODE_NOP as i128),
            (
                "GIO_MLX5_OPCODE_RDMA_WRITE",
                GIO_MLX5_OPCODE_RDMA_WRITE as i128,
            ),
            (
                "GIO_MLX5_OPCODE_RDMA_WRITE_IMM",
                GIO_MLX5_OPCODE_RDMA_WRITE_IMM as i128,
            ),
            (
                "GIO_MLX5_OPCODE_RDMA_READ",
                GIO_MLX5_OPCODE_RDMA_READ as i128,
            ),
            (
                "GIO_MLX5_OPCODE_ATOMIC_CS",
                GIO_MLX5_OPCODE_ATOMIC_CS as i128,
            ),
            (
                "GIO_MLX5_OPCODE_ATOMIC_FA",
                GIO_MLX5_OPCODE_ATOMIC_FA as i128,
            ),
            ("GIO_MLX5_CTRL_SOLICITED", GIO_MLX5_CTRL_SOLICITED as i128),
            ("GIO_MLX5_CTRL_CQ_UPDATE", GIO_MLX5_CTRL_CQ_UPDATE as i128),
            ("GIO_MLX5_CTRL_FENCE", GIO_MLX5_CTRL_FENCE as i128),
            ("GIO_MLX5_INLINE_SEG", GIO_MLX5_INLINE_SEG as i128),
            ("GIO_MLX5_WQEBB", GIO_MLX5_WQEBB as i128),
            ("GIO_MLX5_MAX_INLINE", GIO_MLX5_MAX_INLINE as i128),
            ("GIO_MLX5_CQE_REQ", GIO_MLX5_CQE_REQ as i128),
            ("GIO_MLX5_CQE_RESP_WR_IMM", GIO_MLX5_CQE_RESP_WR_IMM as i128),
            ("GIO_MLX5_CQE_RESP_SEND", GIO_MLX5_CQE_RESP_SEND as i128),
            (
                "GIO_MLX5_CQE_RESP_SEND_IMM",
                GIO_MLX5_CQE_RESP_SEND_IMM as i128,
            ),
            (
                "GIO_MLX5_CQE_RESP_SEND_INV",
                GIO_MLX5_CQE_RESP_SEND_INV as i128,
            ),
            ("GIO_MLX5_CQE_REQ_ERR", GIO_MLX5_CQE_REQ_ERR as i128),
            ("GIO_MLX5_CQE_RESP_ERR", GIO_MLX5_CQE_RESP_ERR as i128),
            ("GIO_MLX5_CQE_INVALID", GIO_MLX5_CQE_INVALID as i128),
            ("GIO_MLX5_CQE_OWNER_MASK", GIO_MLX5_CQE_OWNER_MASK as i128),
            ("GIO_MLX5_CQE_SIZE", GIO_MLX5_CQE_SIZE as i128),
            (
                "GIO_MLX5_SYNDROME_LOCAL_LENGTH_ERR",
                GIO_MLX5_SYNDROME_LOCAL_LENGTH_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_LOCAL_QP_OP_ERR",
                GIO_MLX5_SYNDROME_LOCAL_QP_OP_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_LOCAL_PROT_ERR",
                GIO_MLX5_SYNDROME_LOCAL_PROT_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_WR_FLUSH_ERR",
                GIO_MLX5_SYNDROME_WR_FLUSH_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_MW_BIND_ERR",
                GIO_MLX5_SYNDROME_MW_BIND_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_BAD_RESP_ERR",
                GIO_MLX5_SYNDROME_BAD_RESP_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_LOCAL_ACCESS_ERR",
                GIO_MLX5_SYNDROME_LOCAL_ACCESS_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_REMOTE_INVAL_REQ_ERR",
                GIO_MLX5_SYNDROME_REMOTE_INVAL_REQ_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_REMOTE_ACCESS_ERR",
                GIO_MLX5_SYNDROME_REMOTE_ACCESS_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_REMOTE_OP_ERR",
                GIO_MLX5_SYNDROME_REMOTE_OP_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_TRANSPORT_RETRY_EXC_ERR",
                GIO_MLX5_SYNDROME_TRANSPORT_RETRY_EXC_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_RNR_RETRY_EXC_ERR",
                GIO_MLX5_SYNDROME_RNR_RETRY_EXC_ERR as i128,
            ),
            (
                "GIO_MLX5_SYNDROME_REMOTE_ABORTED_ERR",
                GIO_MLX5_SYNDROME_REMOTE_ABORTED_ERR as i128,
            ),
            (
                "GIO_MLX5_CQE_OFF_VENDOR_SYNDROME",
                GIO_MLX5_CQE_OFF_VENDOR_SYNDROME as i128,
            ),
            (
                "GIO_MLX5_CQE_OFF_SYNDROME",
                GIO_MLX5_CQE_OFF_SYNDROME as i128,
            ),
            (
                "GIO_MLX5_CQE_OFF_BYTE_CNT",
                GIO_MLX5_CQE_OFF_BYTE_CNT as i128,
            ),
            (
                "GIO_MLX5_CQE_OFF_SOP_DROP_QPN",
                GIO_MLX5_CQE_OFF_SOP_DROP_QPN as i128,
            ),
            (
                "GIO_MLX5_CQE_OFF_WQE_COUNTER",
                GIO_MLX5_CQE_OFF_WQE_COUNTER as i128,
            ),
            ("GIO_MLX5_CQE_OFF_OP_OWN", GIO_MLX5_CQE_OFF_OP_OWN as i128),
            ("GIO_MLX5_SND_DBR", GIO_MLX5_SND_DBR as i128),
            ("GIO_MLX5_QP_BLUEFLAME", GIO_MLX5_QP_BLUEFLAME as i128),
        ];
        crate::tests::assert_header_defines(crate::GIO_MLX5_CUH, "GIO_MLX5_", consts);
    }
}
