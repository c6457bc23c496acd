//! Send WQEs as ConnectX reads them: the host-side reference of what
//! `gio_mlx5.cuh` builds on the GPU (and what a CPU would post).

use crate::error::{Error, Result};
use gpunetio_sys::mlx5 as abi;

/// Bytes of a WQE basic block (`MLX5_SEND_WQE_BB`).
pub const WQEBB: usize = abi::GIO_MLX5_WQEBB as usize;
/// Largest inline payload that fits one WQEBB (ctrl + raddr + 4-byte inline header).
pub const MAX_INLINE: usize = abi::GIO_MLX5_MAX_INLINE as usize;
/// Largest message a data segment's byte count describes here (0 would mean 2 GiB).
pub const MAX_MESSAGE: u32 = 0x7fff_ffff;

/// Segment offsets inside a WQE and fields inside segments, as `mlx5dv.h` lays them out
/// (checked against `mlx5dv-sys` in `tests/mlx5_encoding.rs`).
pub mod offsets {
    /// `mlx5_wqe_ctrl_seg.opmod_idx_opcode`.
    pub const CTRL_OPMOD_IDX_OPCODE: usize = 0;
    /// `mlx5_wqe_ctrl_seg.qpn_ds`.
    pub const CTRL_QPN_DS: usize = 4;
    /// `mlx5_wqe_ctrl_seg.signature`.
    pub const CTRL_SIGNATURE: usize = 8;
    /// `mlx5_wqe_ctrl_seg.fm_ce_se`.
    pub const CTRL_FM_CE_SE: usize = 11;
    /// `mlx5_wqe_ctrl_seg.imm`.
    pub const CTRL_IMM: usize = 12;
    /// `mlx5_wqe_raddr_seg.raddr`.
    pub const RADDR_RADDR: usize = 0;
    /// `mlx5_wqe_raddr_seg.rkey`.
    pub const RADDR_RKEY: usize = 8;
    /// `mlx5_wqe_data_seg.byte_count`.
    pub const DATA_BYTE_COUNT: usize = 0;
    /// `mlx5_wqe_data_seg.lkey`.
    pub const DATA_LKEY: usize = 4;
    /// `mlx5_wqe_data_seg.addr`.
    pub const DATA_ADDR: usize = 8;
    /// `mlx5_wqe_atomic_seg.swap_add`.
    pub const ATOMIC_SWAP_ADD: usize = 0;
    /// `mlx5_wqe_atomic_seg.compare`.
    pub const ATOMIC_COMPARE: usize = 8;
    /// Bytes of every segment but inline data.
    pub const SEG: usize = 16;
}

/// One send work request, as the device library posts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wqe<'a> {
    /// `MLX5_OPCODE_NOP` (with [`FENCE`]: `gio::fence`).
    Nop,
    /// `MLX5_OPCODE_RDMA_WRITE` of `len` bytes (0: no data segment).
    Write {
        /// Remote address.
        raddr: u64,
        /// Remote key.
        rkey: u32,
        /// Local address.
        laddr: u64,
        /// Local key.
        lkey: u32,
        /// Bytes, at most [`MAX_MESSAGE`].
        len: u32,
    },
    /// `MLX5_OPCODE_RDMA_WRITE_IMM`: a write whose completion at the peer carries `imm`
    /// (stored big-endian, as `ibv_send_wr.imm_data` is given in network order).
    WriteImm {
        /// Remote address.
        raddr: u64,
        /// Remote key.
        rkey: u32,
        /// Local address.
        laddr: u64,
        /// Local key.
        lkey: u32,
        /// Bytes, at most [`MAX_MESSAGE`].
        len: u32,
        /// Immediate value.
        imm: u32,
    },
    /// `MLX5_OPCODE_RDMA_WRITE` with the payload inline (at most [`MAX_INLINE`] bytes).
    WriteInline {
        /// Remote address.
        raddr: u64,
        /// Remote key.
        rkey: u32,
        /// The bytes written.
        data: &'a [u8],
    },
    /// `MLX5_OPCODE_RDMA_READ` of `len` bytes into local memory.
    Read {
        /// Remote address.
        raddr: u64,
        /// Remote key.
        rkey: u32,
        /// Local address.
        laddr: u64,
        /// Local key.
        lkey: u32,
        /// Bytes, at most [`MAX_MESSAGE`].
        len: u32,
    },
    /// `MLX5_OPCODE_ATOMIC_FA`: 64-bit fetch-and-add; the old value lands at `laddr`.
    FetchAdd {
        /// Remote address (8-byte aligned).
        raddr: u64,
        /// Remote key.
        rkey: u32,
        /// Local address of the 8 fetched bytes.
        laddr: u64,
        /// Local key.
        lkey: u32,
        /// Added value.
        add: u64,
    },
    /// `MLX5_OPCODE_ATOMIC_CS`: 64-bit compare-and-swap; the old value lands at `laddr`.
    CompareSwap {
        /// Remote address (8-byte aligned).
        raddr: u64,
        /// Remote key.
        rkey: u32,
        /// Local address of the 8 fetched bytes.
        laddr: u64,
        /// Local key.
        lkey: u32,
        /// Expected value.
        compare: u64,
        /// Value stored when the remote word equals `compare`.
        swap: u64,
    },
}

/// `fm_ce_se` bit: ask for a CQE (`MLX5_WQE_CTRL_CQ_UPDATE`).
pub const CQ_UPDATE: u8 = abi::GIO_MLX5_CTRL_CQ_UPDATE;
/// `fm_ce_se` bits: strong-ordering fence (`MLX5_WQE_CTRL_FENCE`).
pub const FENCE: u8 = abi::GIO_MLX5_CTRL_FENCE;
/// `fm_ce_se` bit: solicited event (`MLX5_WQE_CTRL_SOLICITED`).
pub const SOLICITED: u8 = abi::GIO_MLX5_CTRL_SOLICITED;

impl Wqe<'_> {
    /// The `MLX5_OPCODE_*` of the ctrl segment.
    pub fn opcode(&self) -> u8 {
        match self {
            Wqe::Nop => abi::GIO_MLX5_OPCODE_NOP,
            Wqe::Write { .. } | Wqe::WriteInline { .. } => abi::GIO_MLX5_OPCODE_RDMA_WRITE,
            Wqe::WriteImm { .. } => abi::GIO_MLX5_OPCODE_RDMA_WRITE_IMM,
            Wqe::Read { .. } => abi::GIO_MLX5_OPCODE_RDMA_READ,
            Wqe::FetchAdd { .. } => abi::GIO_MLX5_OPCODE_ATOMIC_FA,
            Wqe::CompareSwap { .. } => abi::GIO_MLX5_OPCODE_ATOMIC_CS,
        }
    }

    /// The WQE's size in 16-byte units (the ds field of `qpn_ds`).
    pub fn ds(&self) -> u8 {
        match *self {
            Wqe::Nop => 1,
            Wqe::Write { len, .. } | Wqe::WriteImm { len, .. } | Wqe::Read { len, .. } => {
                if len == 0 {
                    2
                } else {
                    3
                }
            }
            Wqe::WriteInline { data, .. } => 2 + (4 + data.len()).div_ceil(16) as u8,
            Wqe::FetchAdd { .. } | Wqe::CompareSwap { .. } => 4,
        }
    }
}

/// The ctrl segment: `opmod<<24 | wqe_index<<8 | opcode`, `qpn<<8 | ds`, signature 0,
/// `fm_ce_se`, `imm` (all big-endian).
pub fn ctrl_seg(
    opcode: u8,
    opmod: u8,
    wqe_index: u16,
    qpn: u32,
    ds: u8,
    fm_ce_se: u8,
    imm: u32,
) -> [u8; 16] {
    let mut s = [0u8; 16];
    let word = (u32::from(opmod) << 24) | (u32::from(wqe_index) << 8) | u32::from(opcode);
    s[offsets::CTRL_OPMOD_IDX_OPCODE..][..4].copy_from_slice(&word.to_be_bytes());
    let qpn_ds = ((qpn & 0x00ff_ffff) << 8) | u32::from(ds & 0x3f);
    s[offsets::CTRL_QPN_DS..][..4].copy_from_slice(&qpn_ds.to_be_bytes());
    s[offsets::CTRL_FM_CE_SE] = fm_ce_se;
    s[offsets::CTRL_IMM..][..4].copy_from_slice(&imm.to_be_bytes());
    s
}

/// The remote-address segment.
pub fn raddr_seg(raddr: u64, rkey: u32) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[offsets::RADDR_RADDR..][..8].copy_from_slice(&raddr.to_be_bytes());
    s[offsets::RADDR_RKEY..][..4].copy_from_slice(&rkey.to_be_bytes());
    s
}

/// A data (scatter/gather) segment.
pub fn data_seg(byte_count: u32, lkey: u32, addr: u64) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[offsets::DATA_BYTE_COUNT..][..4].copy_from_slice(&byte_count.to_be_bytes());
    s[offsets::DATA_LKEY..][..4].copy_from_slice(&lkey.to_be_bytes());
    s[offsets::DATA_ADDR..][..8].copy_from_slice(&addr.to_be_bytes());
    s
}

/// The atomic segment (`compare` is 0 for fetch-and-add).
pub fn atomic_seg(swap_add: u64, compare: u64) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[offsets::ATOMIC_SWAP_ADD..][..8].copy_from_slice(&swap_add.to_be_bytes());
    s[offsets::ATOMIC_COMPARE..][..8].copy_from_slice(&compare.to_be_bytes());
    s
}

/// Inline data: `byte_count | MLX5_INLINE_SEG`, the payload, zero padding to 16 bytes.
pub fn inline_seg(data: &[u8]) -> Result<Vec<u8>> {
    if data.len() > MAX_INLINE {
        return Err(Error::InvalidArgument(format!(
            "inline payload of {} bytes: at most {MAX_INLINE} fit one WQEBB",
            data.len()
        )));
    }
    let mut s = vec![0u8; (4 + data.len()).div_ceil(16) * 16];
    let header = data.len() as u32 | abi::GIO_MLX5_INLINE_SEG;
    s[..4].copy_from_slice(&header.to_be_bytes());
    s[4..4 + data.len()].copy_from_slice(data);
    Ok(s)
}

/// Encodes `wqe` as WQE number `wqe_index` (the 16-bit counter) of queue pair `qpn`
/// into one WQEBB, unused bytes zero (as the device code writes them).
pub fn encode(wqe: &Wqe<'_>, wqe_index: u16, qpn: u32, fm_ce_se: u8) -> Result<[u8; WQEBB]> {
    if qpn > 0x00ff_ffff {
        return Err(Error::InvalidArgument(format!(
            "QP number {qpn:#x} exceeds 24 bits"
        )));
    }
    let mut out = [0u8; WQEBB];
    let (imm, len) = match *wqe {
        Wqe::WriteImm { imm, len, .. } => (imm, len),
        Wqe::Write { len, .. } | Wqe::Read { len, .. } => (0, len),
        _ => (0, 0),
    };
    if len > MAX_MESSAGE {
        return Err(Error::InvalidArgument(format!(
            "a {len}-byte message: at most {MAX_MESSAGE} bytes per WQE"
        )));
    }
    out[..16].copy_from_slice(&ctrl_seg(
        wqe.opcode(),
        0,
        wqe_index,
        qpn,
        wqe.ds(),
        fm_ce_se,
        imm,
    ));
    match *wqe {
        Wqe::Nop => {}
        Wqe::Write {
            raddr,
            rkey,
            laddr,
            lkey,
            len,
        }
        | Wqe::WriteImm {
            raddr,
            rkey,
            laddr,
            lkey,
            len,
            ..
        }
        | Wqe::Read {
            raddr,
            rkey,
            laddr,
            lkey,
            len,
        } => {
            out[16..32].copy_from_slice(&raddr_seg(raddr, rkey));
            if len != 0 {
                out[32..48].copy_from_slice(&data_seg(len, lkey, laddr));
            }
        }
        Wqe::WriteInline { raddr, rkey, data } => {
            out[16..32].copy_from_slice(&raddr_seg(raddr, rkey));
            let inl = inline_seg(data)?;
            out[32..32 + inl.len()].copy_from_slice(&inl);
        }
        Wqe::FetchAdd {
            raddr,
            rkey,
            laddr,
            lkey,
            add,
        } => {
            out[16..32].copy_from_slice(&raddr_seg(raddr, rkey));
            out[32..48].copy_from_slice(&atomic_seg(add, 0));
            out[48..64].copy_from_slice(&data_seg(8, lkey, laddr));
        }
        Wqe::CompareSwap {
            raddr,
            rkey,
            laddr,
            lkey,
            compare,
            swap,
        } => {
            out[16..32].copy_from_slice(&raddr_seg(raddr, rkey));
            out[32..48].copy_from_slice(&atomic_seg(swap, compare));
            out[48..64].copy_from_slice(&data_seg(8, lkey, laddr));
        }
    }
    Ok(out)
}

/// A send queue's producer side on the host: the same indexing as the device code
/// (`gio::mlx5::wqe_ptr`, `ring_db`), over a caller-provided WQE buffer.
#[derive(Debug, Clone)]
pub struct SendQueue {
    wqe_cnt: u32,
    qpn: u32,
    pi: u64,
}

impl SendQueue {
    /// A queue of `wqe_cnt` WQEBBs (a power of two) for QP `qpn`, producer index 0.
    pub fn new(wqe_cnt: u32, qpn: u32) -> Result<Self> {
        if !wqe_cnt.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "send queue of {wqe_cnt} WQEBBs: a power of two is needed"
            )));
        }
        if qpn > 0x00ff_ffff {
            return Err(Error::InvalidArgument(format!(
                "QP number {qpn:#x} exceeds 24 bits"
            )));
        }
        Ok(Self {
            wqe_cnt,
            qpn,
            pi: 0,
        })
    }

    /// Continues from producer index `pi` (64-bit, never wrapped).
    pub fn with_producer_index(mut self, pi: u64) -> Self {
        self.pi = pi;
        self
    }

    /// The next WQE's producer index.
    pub fn producer_index(&self) -> u64 {
        self.pi
    }

    /// The WQEBB slot of producer index `pi`.
    pub fn slot(&self, pi: u64) -> usize {
        (pi & u64::from(self.wqe_cnt - 1)) as usize
    }

    /// Encodes `wqe` at the producer index into `buf` (`wqe_cnt` WQEBBs) and advances;
    /// returns the WQE's producer index.
    pub fn post(&mut self, buf: &mut [u8], wqe: &Wqe<'_>, fm_ce_se: u8) -> Result<u64> {
        if buf.len() < self.wqe_cnt as usize * WQEBB {
            return Err(Error::InvalidArgument(format!(
                "a {}-byte send queue buffer for {} WQEBBs",
                buf.len(),
                self.wqe_cnt
            )));
        }
        let pi = self.pi;
        let bytes = encode(wqe, pi as u16, self.qpn, fm_ce_se)?;
        let at = self.slot(pi) * WQEBB;
        buf[at..at + WQEBB].copy_from_slice(&bytes);
        self.pi += 1;
        Ok(pi)
    }

    /// The send doorbell record after everything posted: `BE32(pi & 0xffff)`.
    pub fn doorbell_record(&self) -> [u8; 4] {
        ((self.pi & 0xffff) as u32).to_be_bytes()
    }

    /// The 8 bytes stored to the UAR doorbell: the start of the last WQE's ctrl segment.
    pub fn doorbell(&self, buf: &[u8]) -> Option<[u8; 8]> {
        let last = self.pi.checked_sub(1)?;
        let at = self.slot(last) * WQEBB;
        buf.get(at..at + 8).map(|b| b.try_into().expect("8 bytes"))
    }
}

/// A WQE's ctrl segment, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WqeHeader {
    /// The 16-bit WQE counter.
    pub wqe_index: u16,
    /// The QP number.
    pub qpn: u32,
    /// Size in 16-byte units.
    pub ds: u8,
    /// Fence / CQ update / solicited bits.
    pub fm_ce_se: u8,
}

fn malformed(reason: String) -> Error {
    Error::Malformed {
        what: "mlx5 send WQE",
        reason,
    }
}

/// Decodes one WQEBB as a NIC would (the emulated NIC of the GPU tests; a debugging aid
/// for a send queue dump): the inverse of [`encode`] for every [`Wqe`] it produces.
/// Opcodes it does not produce, a `ds` that disagrees with the opcode, and inline
/// payloads past the WQEBB are [`Error::Malformed`].
pub fn decode(bytes: &[u8; WQEBB]) -> Result<(WqeHeader, Wqe<'_>)> {
    let be32 = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let be64 = |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let w0 = be32(offsets::CTRL_OPMOD_IDX_OPCODE);
    let qpn_ds = be32(offsets::CTRL_QPN_DS);
    let header = WqeHeader {
        wqe_index: (w0 >> 8) as u16,
        qpn: qpn_ds >> 8,
        ds: (qpn_ds & 0x3f) as u8,
        fm_ce_se: bytes[offsets::CTRL_FM_CE_SE],
    };
    let opcode = w0 as u8;
    let (raddr, rkey) = (
        be64(16 + offsets::RADDR_RADDR),
        be32(16 + offsets::RADDR_RKEY),
    );
    let data = |ds: u8| -> Result<(u64, u32, u32)> {
        if ds == 2 {
            return Ok((0, 0, 0));
        }
        Ok((
            be64(32 + offsets::DATA_ADDR),
            be32(32 + offsets::DATA_LKEY),
            be32(32 + offsets::DATA_BYTE_COUNT),
        ))
    };
    let want_ds = |want: &[u8]| -> Result<()> {
        if want.contains(&header.ds) {
            Ok(())
        } else {
            Err(malformed(format!(
                "opcode {opcode:#x} with ds {} (expected one of {want:?})",
                header.ds
            )))
        }
    };
    let wqe = match opcode {
        abi::GIO_MLX5_OPCODE_NOP => {
            want_ds(&[1])?;
            Wqe::Nop
        }
        abi::GIO_MLX5_OPCODE_RDMA_WRITE
            if header.ds >= 3 && be32(32) & abi::GIO_MLX5_INLINE_SEG != 0 =>
        {
            let len = (be32(32) & !abi::GIO_MLX5_INLINE_SEG) as usize;
            if len > MAX_INLINE {
                return Err(malformed(format!(
                    "inline payload of {len} bytes: at most {MAX_INLINE} fit one WQEBB"
                )));
            }
            want_ds(&[2 + (4 + len).div_ceil(16) as u8])?;
            Wqe::WriteInline {
                raddr,
                rkey,
                data: &bytes[36..36 + len],
            }
        }
        abi::GIO_MLX5_OPCODE_RDMA_WRITE
        | abi::GIO_MLX5_OPCODE_RDMA_WRITE_IMM
        | abi::GIO_MLX5_OPCODE_RDMA_READ => {
            want_ds(&[2, 3])?;
            let (laddr, lkey, len) = data(header.ds)?;
            if header.ds == 3 && (len == 0 || len > MAX_MESSAGE) {
                return Err(malformed(format!("a data segment of {len} bytes")));
            }
            match opcode {
                abi::GIO_MLX5_OPCODE_RDMA_WRITE => Wqe::Write {
                    raddr,
                    rkey,
                    laddr,
                    lkey,
                    len,
                },
                abi::GIO_MLX5_OPCODE_RDMA_READ => Wqe::Read {
                    raddr,
                    rkey,
                    laddr,
                    lkey,
                    len,
                },
                _ => Wqe::WriteImm {
                    raddr,
                    rkey,
                    laddr,
                    lkey,
                    len,
                    imm: be32(offsets::CTRL_IMM),
                },
            }
        }
        abi::GIO_MLX5_OPCODE_ATOMIC_FA | abi::GIO_MLX5_OPCODE_ATOMIC_CS => {
            want_ds(&[4])?;
            let swap_add = be64(32 + offsets::ATOMIC_SWAP_ADD);
            let compare = be64(32 + offsets::ATOMIC_COMPARE);
            let (laddr, lkey, len) = (
                be64(48 + offsets::DATA_ADDR),
                be32(48 + offsets::DATA_LKEY),
                be32(48 + offsets::DATA_BYTE_COUNT),
            );
            if len != 8 {
                return Err(malformed(format!(
                    "an atomic whose result segment has {len} bytes (8 expected)"
                )));
            }
            if opcode == abi::GIO_MLX5_OPCODE_ATOMIC_FA {
                Wqe::FetchAdd {
                    raddr,
                    rkey,
                    laddr,
                    lkey,
                    add: swap_add,
                }
            } else {
                Wqe::CompareSwap {
                    raddr,
                    rkey,
                    laddr,
                    lkey,
                    compare,
                    swap: swap_add,
                }
            }
        }
        other => return Err(malformed(format!("opcode {other:#x}"))),
    };
    Ok((header, wqe))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctrl_segment_bytes_are_hand_computed() {
        // opcode WRITE (8), index 0x1234, qpn 0xabcdef, ds 3, CQ update, imm 0.
        let s = ctrl_seg(8, 0, 0x1234, 0xab_cdef, 3, CQ_UPDATE, 0);
        assert_eq!(
            s,
            [0x00, 0x12, 0x34, 0x08, 0xab, 0xcd, 0xef, 0x03, 0, 0, 0, 0x08, 0, 0, 0, 0]
        );
        let s = ctrl_seg(9, 0x5, 0xffff, 1, 63, FENCE | CQ_UPDATE, 0x0102_0304);
        assert_eq!(
            s,
            [0x05, 0xff, 0xff, 0x09, 0, 0, 0x01, 0x3f, 0, 0, 0, 0x88, 1, 2, 3, 4]
        );
    }

    #[test]
    fn write_read_and_atomic_wqes_are_hand_computed() {
        let w = Wqe::Write {
            raddr: 0x1122_3344_5566_7788,
            rkey: 0xaabb_ccdd,
            laddr: 0x0102_0304_0506_0708,
            lkey: 0x1020_3040,
            len: 0x100,
        };
        let b = encode(&w, 7, 0x12, CQ_UPDATE).unwrap();
        assert_eq!(&b[..8], &[0, 0, 7, 8, 0, 0, 0x12, 3]);
        assert_eq!(
            &b[16..32],
            &[0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0xaa, 0xbb, 0xcc, 0xdd, 0, 0, 0, 0]
        );
        assert_eq!(
            &b[32..48],
            &[0, 0, 1, 0, 0x10, 0x20, 0x30, 0x40, 1, 2, 3, 4, 5, 6, 7, 8]
        );
        assert!(b[48..].iter().all(|&x| x == 0));

        let r = Wqe::Read {
            raddr: 1,
            rkey: 2,
            laddr: 3,
            lkey: 4,
            len: 5,
        };
        let b = encode(&r, 0, 1, 0).unwrap();
        assert_eq!(b[3], 0x10);
        assert_eq!(b[7], 3);

        let fa = Wqe::FetchAdd {
            raddr: 0x40,
            rkey: 9,
            laddr: 0x80,
            lkey: 10,
            add: 0x0102,
        };
        let b = encode(&fa, 1, 1, CQ_UPDATE).unwrap();
        assert_eq!(b[3], 0x12);
        assert_eq!(b[7], 4);
        assert_eq!(
            &b[32..48],
            &[0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            &b[48..64],
            &[0, 0, 0, 8, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0x80]
        );

        let cs = Wqe::CompareSwap {
            raddr: 0x40,
            rkey: 9,
            laddr: 0x80,
            lkey: 10,
            compare: 5,
            swap: 6,
        };
        let b = encode(&cs, 1, 1, CQ_UPDATE).unwrap();
        assert_eq!(b[3], 0x11);
        assert_eq!(b[39], 6, "swap first");
        assert_eq!(b[47], 5, "compare second");
    }

    #[test]
    fn zero_length_rdma_has_no_data_segment_and_nop_is_one_unit() {
        let w = Wqe::Write {
            raddr: 1,
            rkey: 2,
            laddr: 3,
            lkey: 4,
            len: 0,
        };
        assert_eq!(w.ds(), 2);
        let b = encode(&w, 0, 0, 0).unwrap();
        assert!(b[32..].iter().all(|&x| x == 0));
        assert_eq!(Wqe::Nop.ds(), 1);
        let b = encode(&Wqe::Nop, 3, 5, FENCE | CQ_UPDATE).unwrap();
        assert_eq!(&b[..12], &[0, 0, 3, 0, 0, 0, 5, 1, 0, 0, 0, 0x88]);
    }

    #[test]
    fn inline_data_is_padded_to_16_bytes_and_counted_in_ds() {
        for (len, ds, seg) in [
            (0usize, 3u8, 16usize),
            (1, 3, 16),
            (12, 3, 16),
            (13, 4, 32),
            (28, 4, 32),
        ] {
            let data: Vec<u8> = (1..=len as u8).collect();
            let s = inline_seg(&data).unwrap();
            assert_eq!(s.len(), seg, "{len}");
            assert_eq!(&s[..4], &(len as u32 | 0x8000_0000).to_be_bytes());
            assert_eq!(&s[4..4 + len], &data[..]);
            assert!(s[4 + len..].iter().all(|&x| x == 0));
            let w = Wqe::WriteInline {
                raddr: 0,
                rkey: 0,
                data: &data,
            };
            assert_eq!(w.ds(), ds, "{len}");
        }
        assert!(matches!(
            inline_seg(&[0; 29]),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn write_imm_carries_the_immediate_big_endian() {
        let w = Wqe::WriteImm {
            raddr: 0,
            rkey: 0,
            laddr: 0,
            lkey: 0,
            len: 4,
            imm: 0xdead_beef,
        };
        let b = encode(&w, 0, 0, 0).unwrap();
        assert_eq!(b[3], 9);
        assert_eq!(&b[12..16], &[0xde, 0xad, 0xbe, 0xef]);
    }

    #[test]
    fn producer_index_wraps_at_the_queue_size_and_the_counter_at_0xffff() {
        let mut buf = vec![0u8; 8 * WQEBB];
        let mut sq = SendQueue::new(8, 0x42).unwrap().with_producer_index(0xfffe);
        for expect in [0xfffeu64, 0xffff, 0x1_0000, 0x1_0001] {
            let pi = sq.post(&mut buf, &Wqe::Nop, CQ_UPDATE).unwrap();
            assert_eq!(pi, expect);
            let at = sq.slot(pi) * WQEBB;
            assert_eq!(sq.slot(pi), (expect % 8) as usize);
            let idx = u16::from_be_bytes([buf[at + 1], buf[at + 2]]);
            assert_eq!(idx, expect as u16, "16-bit WQE counter");
        }
        assert_eq!(sq.producer_index(), 0x1_0002);
        assert_eq!(sq.doorbell_record(), [0, 0, 0, 2]);
        let db = sq.doorbell(&buf).unwrap();
        assert_eq!(db, [0, 0, 1, 0, 0, 0, 0x42, 1]);
        assert!(SendQueue::new(6, 1).is_err());
        assert!(SendQueue::new(8, 1 << 24).is_err());
        assert!(encode(
            &Wqe::Read {
                raddr: 0,
                rkey: 0,
                laddr: 0,
                lkey: 0,
                len: 1 << 31
            },
            0,
            0,
            0
        )
        .is_err());
    }

    #[test]
    fn decode_inverts_encode_for_every_kind() {
        let data: Vec<u8> = (1..=28).collect();
        let all = [
            Wqe::Nop,
            Wqe::Write {
                raddr: 0x1122_3344_5566_7788,
                rkey: 7,
                laddr: 0x99,
                lkey: 8,
                len: 4096,
            },
            Wqe::Write {
                raddr: 1,
                rkey: 2,
                laddr: 0,
                lkey: 0,
                len: 0,
            },
            Wqe::WriteImm {
                raddr: 1,
                rkey: 2,
                laddr: 3,
                lkey: 4,
                len: 5,
                imm: 0xdead_beef,
            },
            Wqe::Read {
                raddr: 1,
                rkey: 2,
                laddr: 3,
                lkey: 4,
                len: MAX_MESSAGE,
            },
            Wqe::FetchAdd {
                raddr: 0x40,
                rkey: 9,
                laddr: 0x80,
                lkey: 10,
                add: 3,
            },
            Wqe::CompareSwap {
                raddr: 0x40,
                rkey: 9,
                laddr: 0x80,
                lkey: 10,
                compare: 5,
                swap: 6,
            },
        ];
        let inline: Vec<Wqe<'_>> = [0usize, 1, 12, 13, 28]
            .iter()
            .map(|&n| Wqe::WriteInline {
                raddr: 0x10,
                rkey: 0x20,
                data: &data[..n],
            })
            .collect();
        for (i, w) in all.iter().chain(inline.iter()).enumerate() {
            let b = encode(w, 0xfff0 + i as u16, 0xab_cdef, CQ_UPDATE | FENCE).unwrap();
            let (h, d) = decode(&b).unwrap_or_else(|e| panic!("{w:?}: {e}"));
            assert_eq!(d, *w);
            assert_eq!(h.wqe_index, 0xfff0 + i as u16);
            assert_eq!(h.qpn, 0xab_cdef);
            assert_eq!(h.ds, w.ds());
            assert_eq!(h.fm_ce_se, CQ_UPDATE | FENCE);
        }
    }

    #[test]
    fn decode_refuses_what_a_nic_would_fault_on() {
        let mut b = encode(&Wqe::Nop, 0, 1, 0).unwrap();
        b[3] = 0x0a; // MLX5_OPCODE_SEND: never posted by the device library
        assert!(matches!(decode(&b), Err(Error::Malformed { .. })));
        let mut b = encode(&Wqe::Nop, 0, 1, 0).unwrap();
        b[7] = 3; // a NOP of 3 units
        assert!(matches!(decode(&b), Err(Error::Malformed { .. })));
        let mut b = encode(
            &Wqe::WriteInline {
                raddr: 0,
                rkey: 0,
                data: &[1, 2],
            },
            0,
            1,
            0,
        )
        .unwrap();
        b[32..36].copy_from_slice(&(0x8000_0000u32 | 40).to_be_bytes());
        assert!(matches!(decode(&b), Err(Error::Malformed { .. })));
    }
}
