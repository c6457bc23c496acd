//! mlx5 PRM command mailboxes, built field by field: the firmware commands DEVX passes
//! through (`mlx5dv_devx_obj_create` / `_modify` / `mlx5dv_devx_general_cmd`) to create
//! a completion queue and an RC queue pair on GPU-resident memory and move the queue
//! pair to RTS.
//!
//! Layouts follow the mlx5 Programmer's Reference Manual as the Linux kernel encodes it in
//! `include/linux/mlx5/mlx5_ifc.h` (one byte per bit: a field's offset in a
//! `mlx5_ifc_*_bits` struct is its bit offset from the mailbox's start, bit 0 being the
//! most significant bit of the first big-endian dword) — what `MLX5_SET` / `DEVX_SET`
//! compute. [`set`] and [`get`] do the same from a [`Field`] (bit offset, width); the
//! offsets below are checked by this module's tests against the values read off
//! `mlx5_ifc.h`. Only the fields a GPU-initiated RC queue pair needs are named.

use crate::error::{Error, Result};

/// A field of a PRM layout: bit offset from the layout's start and width in bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Bit offset (bit 0 = most significant bit of the first big-endian dword).
    pub bit: u32,
    /// Width in bits: 1..=32 inside one dword, or 64 on a 64-bit boundary.
    pub width: u32,
}

const fn f(bit: u32, width: u32) -> Field {
    Field { bit, width }
}

impl Field {
    /// The same field inside a sub-layout that starts `base` bits into the mailbox.
    pub const fn at(self, base: u32) -> Field {
        Field {
            bit: base + self.bit,
            width: self.width,
        }
    }
}

fn out_of_range(what: &str) -> Error {
    Error::InvalidArgument(format!("PRM mailbox: {what}"))
}

/// `MLX5_SET`: stores `value` into field `field` of mailbox `buf` (big-endian dwords).
/// A value wider than the field, a field crossing a dword (other than an aligned 64-bit
/// one) or one past the buffer is refused.
pub fn set(buf: &mut [u8], field: Field, value: u64) -> Result<()> {
    let Field { bit, width } = field;
    if width == 64 {
        if bit % 64 != 0 {
            return Err(out_of_range(&format!(
                "64-bit field at bit {bit:#x} unaligned"
            )));
        }
        let at = (bit / 8) as usize;
        let dst = buf
            .get_mut(at..at + 8)
            .ok_or_else(|| out_of_range(&format!("field at bit {bit:#x} past the end")))?;
        dst.copy_from_slice(&value.to_be_bytes());
        return Ok(());
    }
    if width == 0 || width > 32 || bit % 32 + width > 32 {
        return Err(out_of_range(&format!(
            "field at bit {bit:#x} of width {width} crosses a dword"
        )));
    }
    if value >> width != 0 {
        return Err(out_of_range(&format!(
            "value {value:#x} does not fit the {width}-bit field at bit {bit:#x}"
        )));
    }
    let at = (bit / 32 * 4) as usize;
    let dw = buf
        .get_mut(at..at + 4)
        .ok_or_else(|| out_of_range(&format!("field at bit {bit:#x} past the end")))?;
    let shift = 32 - bit % 32 - width;
    let mask = (((1u64 << width) - 1) as u32) << shift;
    let old = u32::from_be_bytes([dw[0], dw[1], dw[2], dw[3]]);
    let new = (old & !mask) | (((value as u32) << shift) & mask);
    dw.copy_from_slice(&new.to_be_bytes());
    Ok(())
}

/// `MLX5_GET`: reads field `field` of mailbox `buf` (0 past the end).
pub fn get(buf: &[u8], field: Field) -> u64 {
    let Field { bit, width } = field;
    if width == 64 {
        let at = (bit / 8) as usize;
        return buf
            .get(at..at + 8)
            .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
            .unwrap_or(0);
    }
    let at = (bit / 32 * 4) as usize;
    let Some(dw) = buf.get(at..at + 4) else {
        return 0;
    };
    let word = u32::from_be_bytes([dw[0], dw[1], dw[2], dw[3]]);
    let shift = 32 - bit % 32 - width.min(32);
    (u64::from(word) >> shift) & ((1u64 << width.min(32)) - 1)
}

/// Copies `bytes` to byte-aligned bit offset `bit` (GIDs, `rgid_rip`).
pub fn set_bytes(buf: &mut [u8], bit: u32, bytes: &[u8]) -> Result<()> {
    if !bit.is_multiple_of(8) {
        return Err(out_of_range(&format!(
            "byte field at bit {bit:#x} unaligned"
        )));
    }
    let at = (bit / 8) as usize;
    buf.get_mut(at..at + bytes.len())
        .ok_or_else(|| out_of_range(&format!("byte field at bit {bit:#x} past the end")))?
        .copy_from_slice(bytes);
    Ok(())
}

/// Command opcodes (`MLX5_CMD_OP_*`).
pub mod opcode {
    /// `MLX5_CMD_OP_QUERY_HCA_CAP`.
    pub const QUERY_HCA_CAP: u16 = 0x100;
    /// `MLX5_CMD_OP_CREATE_CQ`.
    pub const CREATE_CQ: u16 = 0x400;
    /// `MLX5_CMD_OP_DESTROY_CQ`.
    pub const DESTROY_CQ: u16 = 0x401;
    /// `MLX5_CMD_OP_CREATE_QP`.
    pub const CREATE_QP: u16 = 0x500;
    /// `MLX5_CMD_OP_DESTROY_QP`.
    pub const DESTROY_QP: u16 = 0x501;
    /// `MLX5_CMD_OP_RST2INIT_QP`.
    pub const RST2INIT_QP: u16 = 0x502;
    /// `MLX5_CMD_OP_INIT2RTR_QP`.
    pub const INIT2RTR_QP: u16 = 0x503;
    /// `MLX5_CMD_OP_RTR2RTS_QP`.
    pub const RTR2RTS_QP: u16 = 0x504;
    /// `MLX5_CMD_OP_2ERR_QP`.
    pub const QP_2ERR: u16 = 0x507;
    /// `MLX5_CMD_OP_QUERY_QP`.
    pub const QUERY_QP: u16 = 0x50b;
}

/// The header every command input starts with.
pub mod cmd_in {
    use super::{f, Field};
    /// `opcode[0x10]` at 0x00.
    pub const OPCODE: Field = f(0x00, 0x10);
    /// `uid[0x10]` at 0x10 (filled by the kernel for DEVX).
    pub const UID: Field = f(0x10, 0x10);
    /// `op_mod[0x10]` at 0x30.
    pub const OP_MOD: Field = f(0x30, 0x10);
}

/// The header every command output starts with, and the object number of create
/// outputs (`create_cq_out.cqn`, `create_qp_out.qpn`).
pub mod cmd_out {
    use super::{f, Field};
    /// `status[0x8]` at 0x00 (0: OK).
    pub const STATUS: Field = f(0x00, 0x08);
    /// `syndrome[0x20]` at 0x20.
    pub const SYNDROME: Field = f(0x20, 0x20);
    /// `cqn[0x18]` / `qpn[0x18]` at 0x48.
    pub const OBJECT_NUMBER: Field = f(0x48, 0x18);
}

/// `mlx5_ifc_cqc_bits`: the completion queue context.
pub mod cqc {
    use super::{f, Field};
    /// `dbr_umem_valid[0x1]`: `dbr_addr` is an offset into `dbr_umem_id`.
    pub const DBR_UMEM_VALID: Field = f(0x06, 0x01);
    /// `cqe_sz[0x3]`: 0 = 64-byte CQEs.
    pub const CQE_SZ: Field = f(0x08, 0x03);
    /// `cc[0x1]`: collapsed CQ (one CQE slot).
    pub const CC: Field = f(0x0b, 0x01);
    /// `oi[0x1]`: overrun ignore (concurrent GPU consumers update the doorbell record
    /// out of order).
    pub const OI: Field = f(0x0e, 0x01);
    /// `dbr_umem_id[0x20]`.
    pub const DBR_UMEM_ID: Field = f(0x20, 0x20);
    /// `page_offset[0x6]`.
    pub const PAGE_OFFSET: Field = f(0x54, 0x06);
    /// `log_cq_size[0x5]`.
    pub const LOG_CQ_SIZE: Field = f(0x63, 0x05);
    /// `uar_page[0x18]`.
    pub const UAR_PAGE: Field = f(0x68, 0x18);
    /// `c_eqn[0x8]` (low byte of `c_eqn_or_apu_element` in newer headers).
    pub const C_EQN: Field = f(0xb8, 0x08);
    /// `log_page_size[0x5]`: log2(page) - 12.
    pub const LOG_PAGE_SIZE: Field = f(0xc3, 0x05);
    /// `dbr_addr[0x40]`.
    pub const DBR_ADDR: Field = f(0x1c0, 0x40);
    /// Size of the context in bits.
    pub const BITS: u32 = 0x200;
}

/// `mlx5_ifc_create_cq_in_bits`.
pub mod create_cq_in {
    use super::{f, Field};
    /// `cq_context` starts here.
    pub const CQ_CONTEXT: u32 = 0x80;
    /// `cq_umem_offset[0x40]`.
    pub const CQ_UMEM_OFFSET: Field = f(0x280, 0x40);
    /// `cq_umem_id[0x20]`.
    pub const CQ_UMEM_ID: Field = f(0x2c0, 0x20);
    /// `cq_umem_valid[0x1]`.
    pub const CQ_UMEM_VALID: Field = f(0x2e0, 0x01);
    /// Size of the input (without `pas`) in bits.
    pub const BITS: u32 = 0x880;
}

/// `mlx5_ifc_ads_bits`: an address path (primary or alternate).
pub mod ads {
    use super::{f, Field};
    /// `fl[0x1]`: force loopback.
    pub const FL: Field = f(0x00, 0x01);
    /// `pkey_index[0x10]`.
    pub const PKEY_INDEX: Field = f(0x10, 0x10);
    /// `grh[0x1]`: a global route header is present (always on RoCE).
    pub const GRH: Field = f(0x28, 0x01);
    /// `mlid[0x7]`: source path bits.
    pub const MLID: Field = f(0x29, 0x07);
    /// `rlid[0x10]`: the remote LID (InfiniBand).
    pub const RLID: Field = f(0x30, 0x10);
    /// `ack_timeout[0x5]`: 4.096 us * 2^ack_timeout.
    pub const ACK_TIMEOUT: Field = f(0x40, 0x05);
    /// `src_addr_index[0x8]`: the local GID index.
    pub const SRC_ADDR_INDEX: Field = f(0x48, 0x08);
    /// `stat_rate[0x4]`.
    pub const STAT_RATE: Field = f(0x54, 0x04);
    /// `hop_limit[0x8]`.
    pub const HOP_LIMIT: Field = f(0x58, 0x08);
    /// `tclass[0x8]`.
    pub const TCLASS: Field = f(0x64, 0x08);
    /// `flow_label[0x14]`.
    pub const FLOW_LABEL: Field = f(0x6c, 0x14);
    /// `rgid_rip[16][0x8]`: the remote GID (bit offset of its first byte).
    pub const RGID_RIP: u32 = 0x80;
    /// `udp_sport[0x10]` (RoCE v2).
    pub const UDP_SPORT: Field = f(0x110, 0x10);
    /// `sl[0x4]`.
    pub const SL: Field = f(0x124, 0x04);
    /// `vhca_port_num[0x8]`: the port.
    pub const VHCA_PORT_NUM: Field = f(0x128, 0x08);
    /// `rmac_47_32[0x10]`.
    pub const RMAC_47_32: Field = f(0x130, 0x10);
    /// `rmac_31_0[0x20]`.
    pub const RMAC_31_0: Field = f(0x140, 0x20);
    /// Size of an address path in bits.
    pub const BITS: u32 = 0x160;
}

/// `mlx5_ifc_qpc_bits`: the queue pair context.
pub mod qpc {
    use super::{f, Field};
    /// `state[0x4]`.
    pub const STATE: Field = f(0x00, 0x04);
    /// `st[0x8]`: service type (0 = RC).
    pub const ST: Field = f(0x08, 0x08);
    /// `pm_state[0x2]`: path migration state (3 = migrated).
    pub const PM_STATE: Field = f(0x13, 0x02);
    /// `pd[0x18]`.
    pub const PD: Field = f(0x28, 0x18);
    /// `mtu[0x3]` (`MLX5_QPC_MTU_*`, the `IBV_MTU_*` values).
    pub const MTU: Field = f(0x40, 0x03);
    /// `log_msg_max[0x5]`.
    pub const LOG_MSG_MAX: Field = f(0x43, 0x05);
    /// `log_rq_size[0x4]`.
    pub const LOG_RQ_SIZE: Field = f(0x49, 0x04);
    /// `log_rq_stride[0x3]`.
    pub const LOG_RQ_STRIDE: Field = f(0x4d, 0x03);
    /// `no_sq[0x1]`.
    pub const NO_SQ: Field = f(0x50, 0x01);
    /// `log_sq_size[0x4]`: log2 of the send queue's WQEBBs.
    pub const LOG_SQ_SIZE: Field = f(0x51, 0x04);
    /// `ts_format[0x2]` (newer headers; reserved in older ones).
    pub const TS_FORMAT: Field = f(0x58, 0x02);
    /// `counter_set_id[0x8]`.
    pub const COUNTER_SET_ID: Field = f(0x60, 0x08);
    /// `uar_page[0x18]`.
    pub const UAR_PAGE: Field = f(0x68, 0x18);
    /// `user_index[0x18]`.
    pub const USER_INDEX: Field = f(0x88, 0x18);
    /// `log_page_size[0x5]`: log2(page) - 12.
    pub const LOG_PAGE_SIZE: Field = f(0xa3, 0x05);
    /// `remote_qpn[0x18]`.
    pub const REMOTE_QPN: Field = f(0xa8, 0x18);
    /// `primary_address_path` starts here ([`super::ads`]).
    pub const PRIMARY_ADDRESS_PATH: u32 = 0xc0;
    /// `log_sra_max[0x3]`: log2 of outstanding RDMA reads/atomics as requester.
    pub const LOG_SRA_MAX: Field = f(0x388, 0x03);
    /// `retry_count[0x3]`.
    pub const RETRY_COUNT: Field = f(0x38d, 0x03);
    /// `rnr_retry[0x3]`.
    pub const RNR_RETRY: Field = f(0x390, 0x03);
    /// `next_send_psn[0x18]`.
    pub const NEXT_SEND_PSN: Field = f(0x3c8, 0x18);
    /// `cqn_snd[0x18]`.
    pub const CQN_SND: Field = f(0x3e8, 0x18);
    /// `log_rra_max[0x3]`: log2 of outstanding RDMA reads/atomics as responder.
    pub const LOG_RRA_MAX: Field = f(0x488, 0x03);
    /// `atomic_mode[0x4]`.
    pub const ATOMIC_MODE: Field = f(0x48c, 0x04);
    /// `rre[0x1]`: remote read enable.
    pub const RRE: Field = f(0x490, 0x01);
    /// `rwe[0x1]`: remote write enable.
    pub const RWE: Field = f(0x491, 0x01);
    /// `rae[0x1]`: remote atomic enable.
    pub const RAE: Field = f(0x492, 0x01);
    /// `page_offset[0x6]`.
    pub const PAGE_OFFSET: Field = f(0x494, 0x06);
    /// `min_rnr_nak[0x5]`.
    pub const MIN_RNR_NAK: Field = f(0x4a3, 0x05);
    /// `next_rcv_psn[0x18]`.
    pub const NEXT_RCV_PSN: Field = f(0x4a8, 0x18);
    /// `cqn_rcv[0x18]`.
    pub const CQN_RCV: Field = f(0x4e8, 0x18);
    /// `dbr_addr[0x40]`: doorbell record offset (in `dbr_umem_id` when valid).
    pub const DBR_ADDR: Field = f(0x500, 0x40);
    /// `rq_type[0x3]` (3 = zero-length receive queue).
    pub const RQ_TYPE: Field = f(0x565, 0x03);
    /// `dbr_umem_valid[0x1]`.
    pub const DBR_UMEM_VALID: Field = f(0x683, 0x01);
    /// `dbr_umem_id[0x20]`: in DPDK's `mlx5_prm.h` and DOCA GPUNetIO's `mlx5_ifc.h`
    /// (the kernel's header keeps these bits reserved; the kernel itself never uses a
    /// doorbell umem).
    pub const DBR_UMEM_ID: Field = f(0x720, 0x20);
    /// Size of the context in bits.
    pub const BITS: u32 = 0x740;

    /// `st` of an RC queue pair (`MLX5_QPC_ST_RC`).
    pub const ST_RC: u64 = 0x0;
    /// `pm_state` migrated (`MLX5_QPC_PM_STATE_MIGRATED`).
    pub const PM_STATE_MIGRATED: u64 = 0x3;
    /// `rq_type` of a queue pair without receive queue (`MLX5_ZERO_LEN_RQ`).
    pub const RQ_TYPE_ZERO_LEN: u64 = 0x3;
    /// `atomic_mode` for 8-byte atomics (`MLX5_QPC_ATOMIC_MODE_UP_TO_8B`).
    pub const ATOMIC_MODE_UP_TO_8B: u64 = 0x3;
    /// `ts_format` default (`MLX5_QPC_TIMESTAMP_FORMAT_DEFAULT`).
    pub const TS_FORMAT_DEFAULT: u8 = 0x1;
    /// `ts_format` free running (`MLX5_QPC_TIMESTAMP_FORMAT_FREE_RUNNING`).
    pub const TS_FORMAT_FREE_RUNNING: u8 = 0x0;
}

/// `mlx5_ifc_create_qp_in_bits`.
pub mod create_qp_in {
    use super::{f, Field};
    /// `opt_param_mask[0x20]`.
    pub const OPT_PARAM_MASK: Field = f(0x80, 0x20);
    /// `qpc` starts here.
    pub const QPC: u32 = 0xc0;
    /// `wq_umem_offset[0x40]`.
    pub const WQ_UMEM_OFFSET: Field = f(0x800, 0x40);
    /// `wq_umem_id[0x20]`.
    pub const WQ_UMEM_ID: Field = f(0x840, 0x20);
    /// `wq_umem_valid[0x1]`.
    pub const WQ_UMEM_VALID: Field = f(0x860, 0x01);
    /// Size of the input (without `pas`) in bits.
    pub const BITS: u32 = 0x880;
}

/// `mlx5_ifc_{rst2init,init2rtr,rtr2rts}_qp_in_bits` (one layout).
pub mod modify_qp_in {
    use super::{f, Field};
    /// `qpn[0x18]`.
    pub const QPN: Field = f(0x48, 0x18);
    /// `opt_param_mask[0x20]`.
    pub const OPT_PARAM_MASK: Field = f(0x80, 0x20);
    /// `qpc` starts here.
    pub const QPC: u32 = 0xc0;
    /// Size of the input in bits.
    pub const BITS: u32 = 0x880;
}

/// `mlx5_ifc_query_hca_cap_in_bits` (`op_mod` = cap type << 1 | current).
pub mod query_hca_cap_in {
    /// Size of the input in bits.
    pub const BITS: u32 = 0x80;
    /// `op_mod` of the general device capabilities, current values.
    pub const OP_MOD_GENERAL_CUR: u16 = 0x1;
    /// Where `capability` starts in the output.
    pub const OUT_CAPABILITY: u32 = 0x80;
    /// Size of the output in bits (header + 0x8000-bit capability union).
    pub const OUT_BITS: u32 = 0x8080;
}

/// Bytes of every output mailbox this module's commands read (header + object number).
pub const OUT_BYTES: usize = 16;

fn mailbox(bits: u32, op: u16) -> Result<Vec<u8>> {
    let mut b = vec![0u8; bits as usize / 8];
    set(&mut b, cmd_in::OPCODE, u64::from(op))?;
    Ok(b)
}

/// Where a queue's memory lives: a DEVX umem and the offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UmemRef {
    /// `mlx5dv_devx_umem.umem_id`.
    pub umem_id: u32,
    /// Byte offset inside the umem.
    pub offset: u64,
}

/// What CREATE_CQ needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqParams {
    /// log2 of the number of 64-byte CQEs.
    pub log_cq_size: u8,
    /// The UAR page (`mlx5dv_devx_uar.page_id`).
    pub uar_page: u32,
    /// The completion event queue (`mlx5dv_devx_query_eqn`).
    pub eqn: u32,
    /// The CQE buffer.
    pub buf: UmemRef,
    /// The 8-byte doorbell record (consumer index, arm).
    pub dbr: UmemRef,
    /// log2(page) - 12 of the umems.
    pub log_page_size: u8,
}

/// CREATE_CQ: 64-byte CQEs, overrun ignored (GPU consumers may update the doorbell
/// record out of order), buffer and doorbell record in umems.
#[doc(alias = "MLX5_CMD_OP_CREATE_CQ")]
pub fn create_cq(p: &CqParams) -> Result<Vec<u8>> {
    let mut b = mailbox(create_cq_in::BITS, opcode::CREATE_CQ)?;
    let c = create_cq_in::CQ_CONTEXT;
    set(&mut b, cqc::CQE_SZ.at(c), 0)?;
    set(&mut b, cqc::OI.at(c), 1)?;
    set(&mut b, cqc::LOG_CQ_SIZE.at(c), u64::from(p.log_cq_size))?;
    set(&mut b, cqc::UAR_PAGE.at(c), u64::from(p.uar_page))?;
    set(&mut b, cqc::C_EQN.at(c), u64::from(p.eqn))?;
    set(&mut b, cqc::LOG_PAGE_SIZE.at(c), u64::from(p.log_page_size))?;
    set(&mut b, cqc::DBR_UMEM_VALID.at(c), 1)?;
    set(&mut b, cqc::DBR_UMEM_ID.at(c), u64::from(p.dbr.umem_id))?;
    set(&mut b, cqc::DBR_ADDR.at(c), p.dbr.offset)?;
    set(&mut b, create_cq_in::CQ_UMEM_VALID, 1)?;
    set(&mut b, create_cq_in::CQ_UMEM_ID, u64::from(p.buf.umem_id))?;
    set(&mut b, create_cq_in::CQ_UMEM_OFFSET, p.buf.offset)?;
    Ok(b)
}

/// What CREATE_QP needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpParams {
    /// The protection domain number (`mlx5dv_pd.pdn`).
    pub pdn: u32,
    /// The UAR page the doorbells go to.
    pub uar_page: u32,
    /// log2 of the send queue's WQEBBs.
    pub log_sq_size: u8,
    /// The send completion queue (also named as the receive one: there is no RQ).
    pub cqn: u32,
    /// The send queue buffer.
    pub sq: UmemRef,
    /// The queue pair's doorbell record (two big-endian dwords: receive, send).
    pub dbr: UmemRef,
    /// log2(page) - 12 of the umems.
    pub log_page_size: u8,
    /// `qpc.ts_format`: [`qpc::TS_FORMAT_DEFAULT`] where the device reports
    /// `qp_ts_format`, [`qpc::TS_FORMAT_FREE_RUNNING`] on older devices (reserved bits
    /// there).
    pub ts_format: u8,
}

/// CREATE_QP: an RC queue pair with a send queue only (zero-length receive queue, as
/// GPU-initiated queue pairs are), send queue and doorbell record in umems.
#[doc(alias = "MLX5_CMD_OP_CREATE_QP")]
pub fn create_qp(p: &QpParams) -> Result<Vec<u8>> {
    let mut b = mailbox(create_qp_in::BITS, opcode::CREATE_QP)?;
    let q = create_qp_in::QPC;
    set(&mut b, qpc::ST.at(q), qpc::ST_RC)?;
    set(&mut b, qpc::PM_STATE.at(q), qpc::PM_STATE_MIGRATED)?;
    set(&mut b, qpc::PD.at(q), u64::from(p.pdn))?;
    set(&mut b, qpc::UAR_PAGE.at(q), u64::from(p.uar_page))?;
    set(&mut b, qpc::TS_FORMAT.at(q), u64::from(p.ts_format))?;
    set(&mut b, qpc::LOG_SQ_SIZE.at(q), u64::from(p.log_sq_size))?;
    set(&mut b, qpc::RQ_TYPE.at(q), qpc::RQ_TYPE_ZERO_LEN)?;
    set(&mut b, qpc::LOG_PAGE_SIZE.at(q), u64::from(p.log_page_size))?;
    set(&mut b, qpc::CQN_SND.at(q), u64::from(p.cqn))?;
    set(&mut b, qpc::CQN_RCV.at(q), u64::from(p.cqn))?;
    set(&mut b, qpc::DBR_UMEM_VALID.at(q), 1)?;
    set(&mut b, qpc::DBR_UMEM_ID.at(q), u64::from(p.dbr.umem_id))?;
    set(&mut b, qpc::DBR_ADDR.at(q), p.dbr.offset)?;
    set(&mut b, create_qp_in::WQ_UMEM_VALID, 1)?;
    set(&mut b, create_qp_in::WQ_UMEM_ID, u64::from(p.sq.umem_id))?;
    set(&mut b, create_qp_in::WQ_UMEM_OFFSET, p.sq.offset)?;
    Ok(b)
}

fn modify(op: u16, qpn: u32) -> Result<Vec<u8>> {
    let mut b = mailbox(modify_qp_in::BITS, op)?;
    set(&mut b, modify_qp_in::QPN, u64::from(qpn))?;
    Ok(b)
}

/// RST2INIT_QP: remote write, read and 8-byte atomics allowed, on `port`.
#[doc(alias = "MLX5_CMD_OP_RST2INIT_QP")]
pub fn rst2init_qp(qpn: u32, port: u8, pkey_index: u16) -> Result<Vec<u8>> {
    let mut b = modify(opcode::RST2INIT_QP, qpn)?;
    let q = modify_qp_in::QPC;
    let path = q + qpc::PRIMARY_ADDRESS_PATH;
    set(&mut b, qpc::PM_STATE.at(q), qpc::PM_STATE_MIGRATED)?;
    set(&mut b, qpc::RWE.at(q), 1)?;
    set(&mut b, qpc::RRE.at(q), 1)?;
    set(&mut b, qpc::RAE.at(q), 1)?;
    set(&mut b, qpc::ATOMIC_MODE.at(q), qpc::ATOMIC_MODE_UP_TO_8B)?;
    set(&mut b, ads::VHCA_PORT_NUM.at(path), u64::from(port))?;
    set(&mut b, ads::PKEY_INDEX.at(path), u64::from(pkey_index))?;
    Ok(b)
}

/// How the peer is reached: RoCE (GID + MAC) or InfiniBand (LID, optional GRH).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// RoCE: always a GRH; the destination MAC resolved by the kernel.
    Roce {
        /// The peer's GID.
        rgid: [u8; 16],
        /// The peer's (or the next hop's) MAC.
        rmac: [u8; 6],
        /// The local GID index (`src_addr_index`).
        sgid_index: u8,
        /// RoCE v2 UDP source port (0: let the NIC choose).
        udp_sport: u16,
    },
    /// InfiniBand: the peer's LID, and a GRH only when `rgid` is set.
    Ib {
        /// The peer's LID.
        rlid: u16,
        /// The peer's GID and the local GID index, for a routed (GRH) path.
        grh: Option<([u8; 16], u8)>,
    },
}

/// What INIT2RTR needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrParams {
    /// The peer's queue pair number.
    pub remote_qpn: u32,
    /// The peer's first PSN.
    pub next_rcv_psn: u32,
    /// `IBV_MTU_*` (1 = 256 ... 5 = 4096).
    pub mtu: u8,
    /// log2 of the largest message.
    pub log_msg_max: u8,
    /// log2 of RDMA reads/atomics accepted in flight as responder.
    pub log_rra_max: u8,
    /// RNR NAK timer code.
    pub min_rnr_nak: u8,
    /// The port.
    pub port: u8,
    /// The path to the peer.
    pub route: Route,
}

/// INIT2RTR_QP: the peer's QPN and PSN, path MTU, and the primary address path.
#[doc(alias = "MLX5_CMD_OP_INIT2RTR_QP")]
pub fn init2rtr_qp(qpn: u32, p: &RtrParams) -> Result<Vec<u8>> {
    let mut b = modify(opcode::INIT2RTR_QP, qpn)?;
    let q = modify_qp_in::QPC;
    let path = q + qpc::PRIMARY_ADDRESS_PATH;
    set(&mut b, qpc::MTU.at(q), u64::from(p.mtu))?;
    set(&mut b, qpc::LOG_MSG_MAX.at(q), u64::from(p.log_msg_max))?;
    set(&mut b, qpc::REMOTE_QPN.at(q), u64::from(p.remote_qpn))?;
    set(&mut b, qpc::NEXT_RCV_PSN.at(q), u64::from(p.next_rcv_psn))?;
    set(&mut b, qpc::LOG_RRA_MAX.at(q), u64::from(p.log_rra_max))?;
    set(&mut b, qpc::MIN_RNR_NAK.at(q), u64::from(p.min_rnr_nak))?;
    set(&mut b, ads::VHCA_PORT_NUM.at(path), u64::from(p.port))?;
    match p.route {
        Route::Roce {
            rgid,
            rmac,
            sgid_index,
            udp_sport,
        } => {
            set(&mut b, ads::GRH.at(path), 1)?;
            set(&mut b, ads::HOP_LIMIT.at(path), 0xff)?;
            set(&mut b, ads::SRC_ADDR_INDEX.at(path), u64::from(sgid_index))?;
            set_bytes(&mut b, path + ads::RGID_RIP, &rgid)?;
            let mac_hi = u64::from(u16::from_be_bytes([rmac[0], rmac[1]]));
            let mac_lo = u64::from(u32::from_be_bytes([rmac[2], rmac[3], rmac[4], rmac[5]]));
            set(&mut b, ads::RMAC_47_32.at(path), mac_hi)?;
            set(&mut b, ads::RMAC_31_0.at(path), mac_lo)?;
            set(&mut b, ads::UDP_SPORT.at(path), u64::from(udp_sport))?;
        }
        Route::Ib { rlid, grh } => {
            set(&mut b, ads::RLID.at(path), u64::from(rlid))?;
            if let Some((rgid, sgid_index)) = grh {
                set(&mut b, ads::GRH.at(path), 1)?;
                set(&mut b, ads::HOP_LIMIT.at(path), 0xff)?;
                set(&mut b, ads::SRC_ADDR_INDEX.at(path), u64::from(sgid_index))?;
                set_bytes(&mut b, path + ads::RGID_RIP, &rgid)?;
            }
        }
    }
    Ok(b)
}

/// What RTR2RTS needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsParams {
    /// The first PSN this side sends.
    pub next_send_psn: u32,
    /// Transport retries (0..=7).
    pub retry_count: u8,
    /// RNR retries (7: infinite).
    pub rnr_retry: u8,
    /// Local ACK timeout code (4.096 us * 2^code).
    pub ack_timeout: u8,
    /// log2 of RDMA reads/atomics in flight as requester.
    pub log_sra_max: u8,
}

/// RTR2RTS_QP.
#[doc(alias = "MLX5_CMD_OP_RTR2RTS_QP")]
pub fn rtr2rts_qp(qpn: u32, p: &RtsParams) -> Result<Vec<u8>> {
    let mut b = modify(opcode::RTR2RTS_QP, qpn)?;
    let q = modify_qp_in::QPC;
    let path = q + qpc::PRIMARY_ADDRESS_PATH;
    set(&mut b, qpc::NEXT_SEND_PSN.at(q), u64::from(p.next_send_psn))?;
    set(&mut b, qpc::RETRY_COUNT.at(q), u64::from(p.retry_count))?;
    set(&mut b, qpc::RNR_RETRY.at(q), u64::from(p.rnr_retry))?;
    set(&mut b, qpc::LOG_SRA_MAX.at(q), u64::from(p.log_sra_max))?;
    set(&mut b, ads::ACK_TIMEOUT.at(path), u64::from(p.ack_timeout))?;
    Ok(b)
}

/// QUERY_HCA_CAP of the general device capabilities (current values).
#[doc(alias = "MLX5_CMD_OP_QUERY_HCA_CAP")]
pub fn query_hca_cap_general() -> Result<Vec<u8>> {
    let mut b = mailbox(query_hca_cap_in::BITS, opcode::QUERY_HCA_CAP)?;
    set(
        &mut b,
        cmd_in::OP_MOD,
        u64::from(query_hca_cap_in::OP_MOD_GENERAL_CUR),
    )?;
    Ok(b)
}

/// A command's output status: `Ok(())` for status 0, else the firmware's status and
/// syndrome (what `dmesg` and the PRM's syndrome tables name).
pub fn check_out(command: &'static str, out: &[u8]) -> Result<()> {
    let status = get(out, cmd_out::STATUS) as u8;
    if status == 0 {
        return Ok(());
    }
    Err(Error::Devx {
        call: command,
        errno: 0,
        status,
        syndrome: get(out, cmd_out::SYNDROME) as u32,
    })
}

/// The object number (`cqn`, `qpn`) of a create command's output.
pub fn object_number(out: &[u8]) -> u32 {
    get(out, cmd_out::OBJECT_NUMBER) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected bit offsets and widths, read off the Linux kernel's
    // include/linux/mlx5/mlx5_ifc.h (struct mlx5_ifc_cqc_bits, _ads_bits, _qpc_bits,
    // _create_cq_in_bits, _create_qp_in_bits, _rst2init_qp_in_bits, ...: the sum of the
    // widths of the members before each field). `qpc.ts_format` and `qpc.dbr_umem_id`
    // are reserved bits in older kernels; their offsets are those of DPDK's
    // drivers/common/mlx5/mlx5_prm.h and DOCA GPUNetIO's mlx5_ifc.h.
    const IFC: &[(&str, Field, u32, u32)] = &[
        ("cmd_in.opcode", cmd_in::OPCODE, 0x00, 0x10),
        ("cmd_in.uid", cmd_in::UID, 0x10, 0x10),
        ("cmd_in.op_mod", cmd_in::OP_MOD, 0x30, 0x10),
        ("cmd_out.status", cmd_out::STATUS, 0x00, 0x08),
        ("cmd_out.syndrome", cmd_out::SYNDROME, 0x20, 0x20),
        ("create_cq_out.cqn", cmd_out::OBJECT_NUMBER, 0x48, 0x18),
        ("cqc.dbr_umem_valid", cqc::DBR_UMEM_VALID, 0x06, 0x01),
        ("cqc.cqe_sz", cqc::CQE_SZ, 0x08, 0x03),
        ("cqc.cc", cqc::CC, 0x0b, 0x01),
        ("cqc.oi", cqc::OI, 0x0e, 0x01),
        ("cqc.dbr_umem_id", cqc::DBR_UMEM_ID, 0x20, 0x20),
        ("cqc.page_offset", cqc::PAGE_OFFSET, 0x54, 0x06),
        ("cqc.log_cq_size", cqc::LOG_CQ_SIZE, 0x63, 0x05),
        ("cqc.uar_page", cqc::UAR_PAGE, 0x68, 0x18),
        ("cqc.c_eqn", cqc::C_EQN, 0xb8, 0x08),
        ("cqc.log_page_size", cqc::LOG_PAGE_SIZE, 0xc3, 0x05),
        ("cqc.dbr_addr", cqc::DBR_ADDR, 0x1c0, 0x40),
        (
            "create_cq_in.cq_umem_offset",
            create_cq_in::CQ_UMEM_OFFSET,
            0x280,
            0x40,
        ),
        (
            "create_cq_in.cq_umem_id",
            create_cq_in::CQ_UMEM_ID,
            0x2c0,
            0x20,
        ),
        (
            "create_cq_in.cq_umem_valid",
            create_cq_in::CQ_UMEM_VALID,
            0x2e0,
            0x01,
        ),
        ("ads.fl", ads::FL, 0x00, 0x01),
        ("ads.pkey_index", ads::PKEY_INDEX, 0x10, 0x10),
        ("ads.grh", ads::GRH, 0x28, 0x01),
        ("ads.mlid", ads::MLID, 0x29, 0x07),
        ("ads.rlid", ads::RLID, 0x30, 0x10),
        ("ads.ack_timeout", ads::ACK_TIMEOUT, 0x40, 0x05),
        ("ads.src_addr_index", ads::SRC_ADDR_INDEX, 0x48, 0x08),
        ("ads.stat_rate", ads::STAT_RATE, 0x54, 0x04),
        ("ads.hop_limit", ads::HOP_LIMIT, 0x58, 0x08),
        ("ads.tclass", ads::TCLASS, 0x64, 0x08),
        ("ads.flow_label", ads::FLOW_LABEL, 0x6c, 0x14),
        ("ads.udp_sport", ads::UDP_SPORT, 0x110, 0x10),
        ("ads.sl", ads::SL, 0x124, 0x04),
        ("ads.vhca_port_num", ads::VHCA_PORT_NUM, 0x128, 0x08),
        ("ads.rmac_47_32", ads::RMAC_47_32, 0x130, 0x10),
        ("ads.rmac_31_0", ads::RMAC_31_0, 0x140, 0x20),
        ("qpc.state", qpc::STATE, 0x00, 0x04),
        ("qpc.st", qpc::ST, 0x08, 0x08),
        ("qpc.pm_state", qpc::PM_STATE, 0x13, 0x02),
        ("qpc.pd", qpc::PD, 0x28, 0x18),
        ("qpc.mtu", qpc::MTU, 0x40, 0x03),
        ("qpc.log_msg_max", qpc::LOG_MSG_MAX, 0x43, 0x05),
        ("qpc.log_rq_size", qpc::LOG_RQ_SIZE, 0x49, 0x04),
        ("qpc.log_rq_stride", qpc::LOG_RQ_STRIDE, 0x4d, 0x03),
        ("qpc.no_sq", qpc::NO_SQ, 0x50, 0x01),
        ("qpc.log_sq_size", qpc::LOG_SQ_SIZE, 0x51, 0x04),
        ("qpc.ts_format", qpc::TS_FORMAT, 0x58, 0x02),
        ("qpc.counter_set_id", qpc::COUNTER_SET_ID, 0x60, 0x08),
        ("qpc.uar_page", qpc::UAR_PAGE, 0x68, 0x18),
        ("qpc.user_index", qpc::USER_INDEX, 0x88, 0x18),
        ("qpc.log_page_size", qpc::LOG_PAGE_SIZE, 0xa3, 0x05),
        ("qpc.remote_qpn", qpc::REMOTE_QPN, 0xa8, 0x18),
        ("qpc.log_sra_max", qpc::LOG_SRA_MAX, 0x388, 0x03),
        ("qpc.retry_count", qpc::RETRY_COUNT, 0x38d, 0x03),
        ("qpc.rnr_retry", qpc::RNR_RETRY, 0x390, 0x03),
        ("qpc.next_send_psn", qpc::NEXT_SEND_PSN, 0x3c8, 0x18),
        ("qpc.cqn_snd", qpc::CQN_SND, 0x3e8, 0x18),
        ("qpc.log_rra_max", qpc::LOG_RRA_MAX, 0x488, 0x03),
        ("qpc.atomic_mode", qpc::ATOMIC_MODE, 0x48c, 0x04),
        ("qpc.rre", qpc::RRE, 0x490, 0x01),
        ("qpc.rwe", qpc::RWE, 0x491, 0x01),
        ("qpc.rae", qpc::RAE, 0x492, 0x01),
        ("qpc.page_offset", qpc::PAGE_OFFSET, 0x494, 0x06),
        ("qpc.min_rnr_nak", qpc::MIN_RNR_NAK, 0x4a3, 0x05),
        ("qpc.next_rcv_psn", qpc::NEXT_RCV_PSN, 0x4a8, 0x18),
        ("qpc.cqn_rcv", qpc::CQN_RCV, 0x4e8, 0x18),
        ("qpc.dbr_addr", qpc::DBR_ADDR, 0x500, 0x40),
        ("qpc.rq_type", qpc::RQ_TYPE, 0x565, 0x03),
        ("qpc.dbr_umem_valid", qpc::DBR_UMEM_VALID, 0x683, 0x01),
        ("qpc.dbr_umem_id", qpc::DBR_UMEM_ID, 0x720, 0x20),
        (
            "create_qp_in.opt_param_mask",
            create_qp_in::OPT_PARAM_MASK,
            0x80,
            0x20,
        ),
        (
            "create_qp_in.wq_umem_offset",
            create_qp_in::WQ_UMEM_OFFSET,
            0x800,
            0x40,
        ),
        (
            "create_qp_in.wq_umem_id",
            create_qp_in::WQ_UMEM_ID,
            0x840,
            0x20,
        ),
        (
            "create_qp_in.wq_umem_valid",
            create_qp_in::WQ_UMEM_VALID,
            0x860,
            0x01,
        ),
        ("rst2init_qp_in.qpn", modify_qp_in::QPN, 0x48, 0x18),
        (
            "rst2init_qp_in.opt_param_mask",
            modify_qp_in::OPT_PARAM_MASK,
            0x80,
            0x20,
        ),
    ];

    // Sub-layout starts and sizes (mlx5_ifc.h): where a struct member begins, and the
    // sum of a struct's widths.
    const STARTS: &[(&str, u32, u32)] = &[
        ("create_cq_in.cq_context", create_cq_in::CQ_CONTEXT, 0x80),
        ("sizeof cqc", cqc::BITS, 0x200),
        ("sizeof create_cq_in (no pas)", create_cq_in::BITS, 0x880),
        ("qpc.primary_address_path", qpc::PRIMARY_ADDRESS_PATH, 0xc0),
        ("sizeof ads", ads::BITS, 0x160),
        ("ads.rgid_rip", ads::RGID_RIP, 0x80),
        ("sizeof qpc", qpc::BITS, 0x740),
        ("create_qp_in.qpc", create_qp_in::QPC, 0xc0),
        ("sizeof create_qp_in (no pas)", create_qp_in::BITS, 0x880),
        ("rst2init_qp_in.qpc", modify_qp_in::QPC, 0xc0),
        ("sizeof rst2init_qp_in", modify_qp_in::BITS, 0x880),
        ("sizeof query_hca_cap_in", query_hca_cap_in::BITS, 0x80),
    ];

    #[test]
    fn field_offsets_match_mlx5_ifc_h() {
        for &(name, field, bit, width) in IFC {
            assert_eq!((field.bit, field.width), (bit, width), "{name}");
            // Every field fits its dword (or is an aligned 64-bit one), so set() takes it.
            let mut b = vec![0u8; 0x880 / 8];
            let max = if width == 64 {
                u64::MAX
            } else {
                (1u64 << width) - 1
            };
            set(&mut b, field, max).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(get(&b, field), max, "{name}");
            let ones: u32 = b.iter().map(|x| x.count_ones()).sum();
            assert_eq!(ones, width, "{name}: exactly its bits are set");
        }
        for &(name, got, want) in STARTS {
            assert_eq!(got, want, "{name}");
        }
        // Address path fields sit inside the path, and the path inside the context.
        const {
            assert!(qpc::PRIMARY_ADDRESS_PATH + ads::BITS <= qpc::LOG_SRA_MAX.bit);
            assert!(create_qp_in::QPC + qpc::BITS == create_qp_in::WQ_UMEM_OFFSET.bit);
            assert!(create_cq_in::CQ_CONTEXT + cqc::BITS == create_cq_in::CQ_UMEM_OFFSET.bit);
        }
    }

    #[test]
    fn set_is_big_endian_msb_first_like_mlx5_set() {
        let mut b = [0u8; 16];
        // opcode 0x0400 in the first 16 bits; op_mod 0x0001 in bits 0x30..0x40.
        set(&mut b, cmd_in::OPCODE, 0x400).unwrap();
        set(&mut b, cmd_in::OP_MOD, 1).unwrap();
        assert_eq!(&b[..8], &[0x04, 0x00, 0, 0, 0, 0, 0, 0x01]);
        // A 24-bit field at 0x48: low three bytes of the third dword.
        set(&mut b, cmd_out::OBJECT_NUMBER, 0xab_cdef).unwrap();
        assert_eq!(&b[8..12], &[0, 0xab, 0xcd, 0xef]);
        // Neighbouring bits survive: the 3-bit field at 0x40 lands in the top bits.
        let mut q = [0u8; 16];
        set(&mut q, qpc::MTU, 5).unwrap();
        set(&mut q, qpc::LOG_MSG_MAX, 30).unwrap();
        assert_eq!(q[8], (5 << 5) | 30);
        assert_eq!(get(&q, qpc::MTU), 5);
        assert_eq!(get(&q, qpc::LOG_MSG_MAX), 30);
        // 64-bit fields are two big-endian dwords.
        let mut d = vec![0u8; 0x80];
        set(&mut d, cqc::DBR_ADDR, 0x0102_0304_0506_0708).unwrap();
        assert_eq!(&d[0x38..0x40], &[1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn bad_fields_and_values_are_refused() {
        let mut b = [0u8; 8];
        assert!(set(&mut b, f(0x00, 0x08), 0x100).is_err(), "value too wide");
        assert!(set(&mut b, f(0x1c, 0x08), 1).is_err(), "crosses a dword");
        assert!(set(&mut b, f(0x20, 0x40), 1).is_err(), "unaligned 64-bit");
        assert!(set(&mut b, f(0x40, 0x08), 1).is_err(), "past the end");
        assert!(set_bytes(&mut b, 4, &[1]).is_err(), "unaligned bytes");
        assert_eq!(get(&b, f(0x40, 8)), 0);
    }

    #[test]
    fn create_cq_sets_every_field_it_names() {
        let p = CqParams {
            log_cq_size: 7,
            uar_page: 0x12345,
            eqn: 9,
            buf: UmemRef {
                umem_id: 0x11,
                offset: 0x1000,
            },
            dbr: UmemRef {
                umem_id: 0x22,
                offset: 0x40,
            },
            log_page_size: 4,
        };
        let b = create_cq(&p).unwrap();
        assert_eq!(b.len(), 0x880 / 8);
        let c = create_cq_in::CQ_CONTEXT;
        assert_eq!(get(&b, cmd_in::OPCODE), 0x400);
        assert_eq!(get(&b, cqc::LOG_CQ_SIZE.at(c)), 7);
        assert_eq!(get(&b, cqc::UAR_PAGE.at(c)), 0x12345);
        assert_eq!(get(&b, cqc::C_EQN.at(c)), 9);
        assert_eq!(get(&b, cqc::OI.at(c)), 1);
        assert_eq!(get(&b, cqc::CQE_SZ.at(c)), 0);
        assert_eq!(get(&b, cqc::LOG_PAGE_SIZE.at(c)), 4);
        assert_eq!(get(&b, cqc::DBR_UMEM_VALID.at(c)), 1);
        assert_eq!(get(&b, cqc::DBR_UMEM_ID.at(c)), 0x22);
        assert_eq!(get(&b, cqc::DBR_ADDR.at(c)), 0x40);
        assert_eq!(get(&b, create_cq_in::CQ_UMEM_VALID), 1);
        assert_eq!(get(&b, create_cq_in::CQ_UMEM_ID), 0x11);
        assert_eq!(get(&b, create_cq_in::CQ_UMEM_OFFSET), 0x1000);
        // Hand-computed bytes: log_cq_size 7 and uar_page 0x12345 share the dword at
        // byte 0x10 + 0x0c: 0b000_00111 then 0x012345.
        assert_eq!(&b[0x1c..0x20], &[0x07, 0x01, 0x23, 0x45]);
        assert!(create_cq(&CqParams {
            log_cq_size: 32,
            ..p
        })
        .is_err());
    }

    #[test]
    fn create_qp_is_an_rc_send_only_queue_pair_on_umems() {
        let p = QpParams {
            pdn: 0x42,
            uar_page: 0x777,
            log_sq_size: 8,
            cqn: 0x1234,
            sq: UmemRef {
                umem_id: 5,
                offset: 0,
            },
            dbr: UmemRef {
                umem_id: 5,
                offset: 0x4000,
            },
            log_page_size: 0,
            ts_format: qpc::TS_FORMAT_DEFAULT,
        };
        let b = create_qp(&p).unwrap();
        let q = create_qp_in::QPC;
        assert_eq!(get(&b, cmd_in::OPCODE), 0x500);
        assert_eq!(get(&b, qpc::ST.at(q)), qpc::ST_RC);
        assert_eq!(get(&b, qpc::PM_STATE.at(q)), 3);
        assert_eq!(get(&b, qpc::PD.at(q)), 0x42);
        assert_eq!(get(&b, qpc::UAR_PAGE.at(q)), 0x777);
        assert_eq!(get(&b, qpc::LOG_SQ_SIZE.at(q)), 8);
        assert_eq!(get(&b, qpc::NO_SQ.at(q)), 0);
        assert_eq!(get(&b, qpc::RQ_TYPE.at(q)), 3);
        assert_eq!(get(&b, qpc::LOG_RQ_SIZE.at(q)), 0);
        assert_eq!(get(&b, qpc::CQN_SND.at(q)), 0x1234);
        assert_eq!(get(&b, qpc::CQN_RCV.at(q)), 0x1234);
        assert_eq!(get(&b, qpc::DBR_UMEM_VALID.at(q)), 1);
        assert_eq!(get(&b, qpc::DBR_UMEM_ID.at(q)), 5);
        assert_eq!(get(&b, qpc::DBR_ADDR.at(q)), 0x4000);
        assert_eq!(get(&b, create_qp_in::WQ_UMEM_VALID), 1);
        assert_eq!(get(&b, create_qp_in::WQ_UMEM_ID), 5);
        assert_eq!(get(&b, create_qp_in::WQ_UMEM_OFFSET), 0);
        assert_eq!(get(&b, qpc::TS_FORMAT.at(q)), 1);
        // st = RC (0) and pm_state = 3 in the qpc's first dword (byte 0x18): bits
        // 0x13..0x15 of it, i.e. 0b11 << 11.
        assert_eq!(&b[0x18..0x1c], &[0, 0, 0x18, 0]);
    }

    #[test]
    fn the_transitions_carry_qpn_access_path_and_psns() {
        let b = rst2init_qp(0xabcdef, 1, 0).unwrap();
        let q = modify_qp_in::QPC;
        let path = q + qpc::PRIMARY_ADDRESS_PATH;
        assert_eq!(get(&b, cmd_in::OPCODE), 0x502);
        assert_eq!(get(&b, modify_qp_in::QPN), 0xabcdef);
        assert_eq!(
            (
                get(&b, qpc::RWE.at(q)),
                get(&b, qpc::RRE.at(q)),
                get(&b, qpc::RAE.at(q))
            ),
            (1, 1, 1)
        );
        assert_eq!(get(&b, qpc::ATOMIC_MODE.at(q)), 3);
        assert_eq!(get(&b, ads::VHCA_PORT_NUM.at(path)), 1);

        let rgid: [u8; 16] = std::array::from_fn(|i| i as u8 + 1);
        let rtr = RtrParams {
            remote_qpn: 0x10,
            next_rcv_psn: 0x20,
            mtu: 5,
            log_msg_max: 30,
            log_rra_max: 4,
            min_rnr_nak: 12,
            port: 1,
            route: Route::Roce {
                rgid,
                rmac: [0x02, 0x11, 0x22, 0x33, 0x44, 0x55],
                sgid_index: 3,
                udp_sport: 0xc000,
            },
        };
        let b = init2rtr_qp(7, &rtr).unwrap();
        assert_eq!(get(&b, cmd_in::OPCODE), 0x503);
        assert_eq!(get(&b, modify_qp_in::QPN), 7);
        assert_eq!(get(&b, qpc::REMOTE_QPN.at(q)), 0x10);
        assert_eq!(get(&b, qpc::NEXT_RCV_PSN.at(q)), 0x20);
        assert_eq!(get(&b, qpc::MTU.at(q)), 5);
        assert_eq!(get(&b, qpc::LOG_MSG_MAX.at(q)), 30);
        assert_eq!(get(&b, qpc::LOG_RRA_MAX.at(q)), 4);
        assert_eq!(get(&b, qpc::MIN_RNR_NAK.at(q)), 12);
        assert_eq!(get(&b, ads::GRH.at(path)), 1);
        assert_eq!(get(&b, ads::SRC_ADDR_INDEX.at(path)), 3);
        assert_eq!(get(&b, ads::HOP_LIMIT.at(path)), 0xff);
        assert_eq!(get(&b, ads::UDP_SPORT.at(path)), 0xc000);
        assert_eq!(get(&b, ads::RMAC_47_32.at(path)), 0x0211);
        assert_eq!(get(&b, ads::RMAC_31_0.at(path)), 0x2233_4455);
        let g = ((path + ads::RGID_RIP) / 8) as usize;
        assert_eq!(&b[g..g + 16], &rgid);
        // The MAC's bytes in wire order at the end of the path.
        let m = ((path + ads::RMAC_47_32.bit) / 8) as usize;
        assert_eq!(&b[m..m + 6], &[0x02, 0x11, 0x22, 0x33, 0x44, 0x55]);

        let ib = RtrParams {
            route: Route::Ib {
                rlid: 0x1234,
                grh: None,
            },
            ..rtr
        };
        let b = init2rtr_qp(7, &ib).unwrap();
        assert_eq!(get(&b, ads::RLID.at(path)), 0x1234);
        assert_eq!(get(&b, ads::GRH.at(path)), 0);

        let rts = RtsParams {
            next_send_psn: 0x20,
            retry_count: 7,
            rnr_retry: 7,
            ack_timeout: 20,
            log_sra_max: 4,
        };
        let b = rtr2rts_qp(7, &rts).unwrap();
        assert_eq!(get(&b, cmd_in::OPCODE), 0x504);
        assert_eq!(get(&b, qpc::NEXT_SEND_PSN.at(q)), 0x20);
        assert_eq!(get(&b, qpc::RETRY_COUNT.at(q)), 7);
        assert_eq!(get(&b, qpc::RNR_RETRY.at(q)), 7);
        assert_eq!(get(&b, qpc::LOG_SRA_MAX.at(q)), 4);
        assert_eq!(get(&b, ads::ACK_TIMEOUT.at(path)), 20);
        assert!(rtr2rts_qp(
            7,
            &RtsParams {
                retry_count: 8,
                ..rts
            }
        )
        .is_err());
    }

    #[test]
    fn outputs_give_status_syndrome_and_object_number() {
        let mut out = [0u8; OUT_BYTES];
        set(&mut out, cmd_out::OBJECT_NUMBER, 0x5a5a5a).unwrap();
        assert!(check_out("CREATE_QP", &out).is_ok());
        assert_eq!(object_number(&out), 0x5a5a5a);
        set(&mut out, cmd_out::STATUS, 0x3).unwrap();
        set(&mut out, cmd_out::SYNDROME, 0x1234_5678).unwrap();
        match check_out("CREATE_QP", &out) {
            Err(Error::Devx {
                call,
                status,
                syndrome,
                ..
            }) => {
                assert_eq!((call, status, syndrome), ("CREATE_QP", 3, 0x1234_5678));
            }
            other => panic!("{other:?}"),
        }
        let q = query_hca_cap_general().unwrap();
        assert_eq!(get(&q, cmd_in::OPCODE), 0x100);
        assert_eq!(get(&q, cmd_in::OP_MOD), 1);
    }
}
