//! 64-byte CQEs: ownership, opcode, WQE counter and error syndromes, parsed as the
//! device code does (`gio::mlx5::read_cqe`, `cqe_status`), plus synthetic CQEs for tests.

use gpunetio_sys as ffi;
use gpunetio_sys::mlx5 as abi;

/// Bytes of a CQE.
pub const CQE_SIZE: usize = abi::GIO_MLX5_CQE_SIZE as usize;

/// An error CQE's syndrome (`mlx5_err_cqe.syndrome`); any byte is representable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Syndrome(pub u8);

impl Syndrome {
    /// `MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR`.
    pub const LOCAL_LENGTH: Self = Self(abi::GIO_MLX5_SYNDROME_LOCAL_LENGTH_ERR);
    /// `MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR`.
    pub const LOCAL_QP_OPERATION: Self = Self(abi::GIO_MLX5_SYNDROME_LOCAL_QP_OP_ERR);
    /// `MLX5_CQE_SYNDROME_LOCAL_PROT_ERR`.
    pub const LOCAL_PROTECTION: Self = Self(abi::GIO_MLX5_SYNDROME_LOCAL_PROT_ERR);
    /// `MLX5_CQE_SYNDROME_WR_FLUSH_ERR`.
    pub const WR_FLUSH: Self = Self(abi::GIO_MLX5_SYNDROME_WR_FLUSH_ERR);
    /// `MLX5_CQE_SYNDROME_MW_BIND_ERR`.
    pub const MW_BIND: Self = Self(abi::GIO_MLX5_SYNDROME_MW_BIND_ERR);
    /// `MLX5_CQE_SYNDROME_BAD_RESP_ERR`.
    pub const BAD_RESPONSE: Self = Self(abi::GIO_MLX5_SYNDROME_BAD_RESP_ERR);
    /// `MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR`.
    pub const LOCAL_ACCESS: Self = Self(abi::GIO_MLX5_SYNDROME_LOCAL_ACCESS_ERR);
    /// `MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR`.
    pub const REMOTE_INVALID_REQUEST: Self = Self(abi::GIO_MLX5_SYNDROME_REMOTE_INVAL_REQ_ERR);
    /// `MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR`.
    pub const REMOTE_ACCESS: Self = Self(abi::GIO_MLX5_SYNDROME_REMOTE_ACCESS_ERR);
    /// `MLX5_CQE_SYNDROME_REMOTE_OP_ERR`.
    pub const REMOTE_OPERATION: Self = Self(abi::GIO_MLX5_SYNDROME_REMOTE_OP_ERR);
    /// `MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR`.
    pub const TRANSPORT_RETRY_EXCEEDED: Self = Self(abi::GIO_MLX5_SYNDROME_TRANSPORT_RETRY_EXC_ERR);
    /// `MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR`.
    pub const RNR_RETRY_EXCEEDED: Self = Self(abi::GIO_MLX5_SYNDROME_RNR_RETRY_EXC_ERR);
    /// `MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR`.
    pub const REMOTE_ABORTED: Self = Self(abi::GIO_MLX5_SYNDROME_REMOTE_ABORTED_ERR);

    /// What the syndrome means for a caller.
    pub fn kind(self) -> CqeErrorKind {
        match self {
            Self::WR_FLUSH => CqeErrorKind::Flushed,
            Self::LOCAL_LENGTH => CqeErrorKind::LocalLength,
            Self::LOCAL_QP_OPERATION => CqeErrorKind::LocalQpOperation,
            Self::LOCAL_PROTECTION => CqeErrorKind::LocalProtection,
            Self::LOCAL_ACCESS => CqeErrorKind::LocalAccess,
            Self::MW_BIND => CqeErrorKind::MemoryWindowBind,
            Self::BAD_RESPONSE => CqeErrorKind::BadResponse,
            Self::REMOTE_INVALID_REQUEST => CqeErrorKind::RemoteInvalidRequest,
            Self::REMOTE_ACCESS => CqeErrorKind::RemoteAccess,
            Self::REMOTE_OPERATION => CqeErrorKind::RemoteOperation,
            Self::TRANSPORT_RETRY_EXCEEDED => CqeErrorKind::RetryExceeded,
            Self::RNR_RETRY_EXCEEDED => CqeErrorKind::RnrRetryExceeded,
            Self::REMOTE_ABORTED => CqeErrorKind::RemoteAborted,
            Self(other) => CqeErrorKind::Other(other),
        }
    }
}

/// The classes of error completions callers branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CqeErrorKind {
    /// The WQE was flushed: the queue pair was already in error (an earlier failure).
    Flushed,
    /// A local length error (message larger than the buffer or the port's limit).
    LocalLength,
    /// A local queue pair operation error (malformed WQE).
    LocalQpOperation,
    /// A local protection error: the lkey does not cover the local buffer.
    LocalProtection,
    /// A local access error.
    LocalAccess,
    /// A memory window bind error.
    MemoryWindowBind,
    /// The responder sent a malformed response.
    BadResponse,
    /// The responder refused the request as invalid.
    RemoteInvalidRequest,
    /// The rkey does not allow the access (or the range is outside it).
    RemoteAccess,
    /// The responder failed the operation.
    RemoteOperation,
    /// Transport retries exhausted: the peer is unreachable or gone.
    RetryExceeded,
    /// Receiver-not-ready retries exhausted.
    RnrRetryExceeded,
    /// The responder aborted.
    RemoteAborted,
    /// A syndrome this crate does not name.
    Other(u8),
}

/// A successful completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The CQE opcode (`op_own >> 4`, `MLX5_CQE_REQ` for the send queue).
    pub opcode: u8,
    /// The 16-bit counter of the completed WQE.
    pub wqe_counter: u16,
    /// `byte_cnt` (reads and responder completions).
    pub byte_count: u32,
    /// The QP number (`sop_drop_qpn` low 24 bits).
    pub qpn: u32,
}

/// An error completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("error completion of WQE {wqe_counter} on QP {qpn:#x}: syndrome {:#x} ({:?}), vendor syndrome {vendor_syndrome:#x}", syndrome.0, syndrome.kind())]
pub struct CqeError {
    /// `MLX5_CQE_REQ_ERR` or `MLX5_CQE_RESP_ERR`.
    pub opcode: u8,
    /// Why.
    pub syndrome: Syndrome,
    /// The vendor's syndrome (device specific).
    pub vendor_syndrome: u8,
    /// The 16-bit counter of the failed WQE.
    pub wqe_counter: u16,
    /// The QP number.
    pub qpn: u32,
    /// The opcode of the failed WQE (`s_wqe_opcode_qpn` top byte).
    pub wqe_opcode: u8,
}

impl CqeError {
    /// What the syndrome means.
    pub fn kind(&self) -> CqeErrorKind {
        self.syndrome.kind()
    }

    /// The status word device code records (`gio_mlx5_qp.syndrome`).
    pub fn status_word(&self) -> u32 {
        (u32::from(self.vendor_syndrome) << 8) | u32::from(self.syndrome.0)
    }
}

/// What one CQE slot says at a consumer index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqePoll {
    /// Not written by the NIC for this pass (owner bit or INVALID opcode).
    Empty,
    /// A successful completion.
    Ok(Completion),
    /// An error completion.
    Err(CqeError),
    /// An opcode a send CQ does not carry (resize, signature error, ...).
    Unexpected(u8),
}

impl CqePoll {
    /// The device status `gio::mlx5::cqe_status` gives: 1 pending, `GIO_OK`,
    /// `GIO_ERR_CQE`, `GIO_ERR_TRANSPORT`.
    pub fn device_status(&self) -> i32 {
        match self {
            CqePoll::Empty => 1,
            CqePoll::Ok(_) => ffi::GIO_OK,
            CqePoll::Err(_) => ffi::GIO_ERR_CQE,
            CqePoll::Unexpected(_) => ffi::GIO_ERR_TRANSPORT,
        }
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The owner bit software expects at consumer index `ci` of a CQ of `cqe_cnt` entries
/// (a power of two): it flips on every pass over the ring.
pub fn owner_parity(ci: u64, cqe_cnt: u32) -> u8 {
    u8::from(ci & u64::from(cqe_cnt) != 0)
}

/// Parses the CQE at consumer index `ci` (rdma-core's `get_sw_cqe` + `mlx5_parse_cqe`).
pub fn parse_cqe(cqe: &[u8; CQE_SIZE], ci: u64, cqe_cnt: u32) -> CqePoll {
    let op_own = cqe[abi::GIO_MLX5_CQE_OFF_OP_OWN];
    let opcode = op_own >> 4;
    if opcode == abi::GIO_MLX5_CQE_INVALID
        || op_own & abi::GIO_MLX5_CQE_OWNER_MASK != owner_parity(ci, cqe_cnt)
    {
        return CqePoll::Empty;
    }
    let wqe_counter = be16(cqe, abi::GIO_MLX5_CQE_OFF_WQE_COUNTER);
    let qpn_word = be32(cqe, abi::GIO_MLX5_CQE_OFF_SOP_DROP_QPN);
    match opcode {
        abi::GIO_MLX5_CQE_REQ
        | abi::GIO_MLX5_CQE_RESP_WR_IMM
        | abi::GIO_MLX5_CQE_RESP_SEND
        | abi::GIO_MLX5_CQE_RESP_SEND_IMM
        | abi::GIO_MLX5_CQE_RESP_SEND_INV => CqePoll::Ok(Completion {
            opcode,
            wqe_counter,
            byte_count: be32(cqe, abi::GIO_MLX5_CQE_OFF_BYTE_CNT),
            qpn: qpn_word & 0x00ff_ffff,
        }),
        abi::GIO_MLX5_CQE_REQ_ERR | abi::GIO_MLX5_CQE_RESP_ERR => CqePoll::Err(CqeError {
            opcode,
            syndrome: Syndrome(cqe[abi::GIO_MLX5_CQE_OFF_SYNDROME]),
            vendor_syndrome: cqe[abi::GIO_MLX5_CQE_OFF_VENDOR_SYNDROME],
            wqe_counter,
            qpn: qpn_word & 0x00ff_ffff,
            wqe_opcode: (qpn_word >> 24) as u8,
        }),
        other => CqePoll::Unexpected(other),
    }
}

/// A CQE slot as it is before the NIC ever wrote it (`op_own = INVALID << 4`): how a CQ
/// buffer must be initialised.
pub fn empty_cqe() -> [u8; CQE_SIZE] {
    let mut c = [0u8; CQE_SIZE];
    c[abi::GIO_MLX5_CQE_OFF_OP_OWN] = abi::GIO_MLX5_CQE_INVALID << 4;
    c
}

/// A synthetic successful requester CQE for consumer index `ci` (tests: what the NIC
/// would write).
pub fn synthetic_cqe(
    ci: u64,
    cqe_cnt: u32,
    wqe_counter: u16,
    qpn: u32,
    byte_count: u32,
) -> [u8; CQE_SIZE] {
    let mut c = [0u8; CQE_SIZE];
    c[abi::GIO_MLX5_CQE_OFF_BYTE_CNT..][..4].copy_from_slice(&byte_count.to_be_bytes());
    c[abi::GIO_MLX5_CQE_OFF_SOP_DROP_QPN..][..4]
        .copy_from_slice(&(qpn & 0x00ff_ffff).to_be_bytes());
    c[abi::GIO_MLX5_CQE_OFF_WQE_COUNTER..][..2].copy_from_slice(&wqe_counter.to_be_bytes());
    c[abi::GIO_MLX5_CQE_OFF_OP_OWN] = (abi::GIO_MLX5_CQE_REQ << 4) | owner_parity(ci, cqe_cnt);
    c
}

/// A synthetic requester error CQE (`MLX5_CQE_REQ_ERR`) with `syndrome` for consumer
/// index `ci`.
pub fn synthetic_error_cqe(
    ci: u64,
    cqe_cnt: u32,
    wqe_counter: u16,
    qpn: u32,
    wqe_opcode: u8,
    syndrome: Syndrome,
    vendor_syndrome: u8,
) -> [u8; CQE_SIZE] {
    let mut c = [0u8; CQE_SIZE];
    c[abi::GIO_MLX5_CQE_OFF_VENDOR_SYNDROME] = vendor_syndrome;
    c[abi::GIO_MLX5_CQE_OFF_SYNDROME] = syndrome.0;
    let word = (u32::from(wqe_opcode) << 24) | (qpn & 0x00ff_ffff);
    c[abi::GIO_MLX5_CQE_OFF_SOP_DROP_QPN..][..4].copy_from_slice(&word.to_be_bytes());
    c[abi::GIO_MLX5_CQE_OFF_WQE_COUNTER..][..2].copy_from_slice(&wqe_counter.to_be_bytes());
    c[abi::GIO_MLX5_CQE_OFF_OP_OWN] = (abi::GIO_MLX5_CQE_REQ_ERR << 4) | owner_parity(ci, cqe_cnt);
    c
}

/// A completion queue's consumer side on the host, over a caller-provided CQE buffer.
#[derive(Debug, Clone)]
pub struct CompletionQueue {
    cqe_cnt: u32,
    ci: u64,
}

impl CompletionQueue {
    /// A CQ of `cqe_cnt` CQEs (a power of two), consumer index 0.
    pub fn new(cqe_cnt: u32) -> crate::Result<Self> {
        if !cqe_cnt.is_power_of_two() {
            return Err(crate::Error::InvalidArgument(format!(
                "completion queue of {cqe_cnt} CQEs: a power of two is needed"
            )));
        }
        Ok(Self { cqe_cnt, ci: 0 })
    }

    /// The consumer index (64-bit, never wrapped).
    pub fn consumer_index(&self) -> u64 {
        self.ci
    }

    /// Polls one CQE from `buf` (`cqe_cnt` CQEs); advances past anything but `Empty`.
    pub fn poll(&mut self, buf: &[u8]) -> CqePoll {
        let at = (self.ci & u64::from(self.cqe_cnt - 1)) as usize * CQE_SIZE;
        let Some(slot) = buf.get(at..at + CQE_SIZE) else {
            return CqePoll::Empty;
        };
        let cqe: &[u8; CQE_SIZE] = slot.try_into().expect("64 bytes");
        let r = parse_cqe(cqe, self.ci, self.cqe_cnt);
        if r != CqePoll::Empty {
            self.ci += 1;
        }
        r
    }

    /// The CQ doorbell record: `BE32(ci & 0xffffff)`.
    pub fn doorbell_record(&self) -> [u8; 4] {
        ((self.ci & 0x00ff_ffff) as u32).to_be_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_and_error_cqes_parse_to_typed_results() {
        let c = synthetic_cqe(0, 8, 0x1234, 0xabcdef, 77);
        assert_eq!(
            parse_cqe(&c, 0, 8),
            CqePoll::Ok(Completion {
                opcode: 0,
                wqe_counter: 0x1234,
                byte_count: 77,
                qpn: 0xabcdef
            })
        );
        for (syn, kind) in [
            (0x5u8, CqeErrorKind::Flushed),
            (0x4, CqeErrorKind::LocalProtection),
            (0x15, CqeErrorKind::RetryExceeded),
            (0x13, CqeErrorKind::RemoteAccess),
            (0x16, CqeErrorKind::RnrRetryExceeded),
            (0x99, CqeErrorKind::Other(0x99)),
        ] {
            let c = synthetic_error_cqe(3, 8, 3, 7, 0x08, Syndrome(syn), 0x42);
            let CqePoll::Err(e) = parse_cqe(&c, 3, 8) else {
                panic!("{syn:#x}: not an error");
            };
            assert_eq!(e.kind(), kind);
            assert_eq!(e.wqe_counter, 3);
            assert_eq!(e.qpn, 7);
            assert_eq!(e.wqe_opcode, 0x08);
            assert_eq!(e.status_word(), 0x4200 | u32::from(syn));
            assert_eq!(CqePoll::Err(e).device_status(), ffi::GIO_ERR_CQE);
        }
    }

    #[test]
    fn owner_bit_flips_every_pass_and_invalid_is_empty() {
        assert_eq!(parse_cqe(&empty_cqe(), 0, 4), CqePoll::Empty);
        let first_pass = synthetic_cqe(1, 4, 1, 1, 0);
        assert!(matches!(parse_cqe(&first_pass, 1, 4), CqePoll::Ok(_)));
        // Seen at consumer index 5 (second pass) the same bytes are stale.
        assert_eq!(parse_cqe(&first_pass, 5, 4), CqePoll::Empty);
        let second_pass = synthetic_cqe(5, 4, 5, 1, 0);
        assert_eq!(second_pass[63] & 1, 1);
        assert!(matches!(parse_cqe(&second_pass, 5, 4), CqePoll::Ok(_)));
        assert_eq!(parse_cqe(&second_pass, 9, 4), CqePoll::Empty);
        let mut resize = synthetic_cqe(0, 4, 0, 1, 0);
        resize[63] = 5 << 4;
        assert_eq!(parse_cqe(&resize, 0, 4), CqePoll::Unexpected(5));
        assert_eq!(CqePoll::Empty.device_status(), 1);
    }

    #[test]
    fn host_consumer_walks_the_ring_across_wraparound() {
        let n = 4u32;
        let mut buf = Vec::new();
        for _ in 0..n {
            buf.extend_from_slice(&empty_cqe());
        }
        let mut cq = CompletionQueue::new(n).unwrap();
        assert_eq!(cq.poll(&buf), CqePoll::Empty);
        for ci in 0..11u64 {
            let slot = (ci % u64::from(n)) as usize * CQE_SIZE;
            buf[slot..slot + CQE_SIZE].copy_from_slice(&synthetic_cqe(ci, n, ci as u16, 9, 0));
            let CqePoll::Ok(c) = cq.poll(&buf) else {
                panic!("ci {ci}");
            };
            assert_eq!(c.wqe_counter, ci as u16);
            assert_eq!(cq.poll(&buf), CqePoll::Empty, "nothing new after {ci}");
        }
        assert_eq!(cq.consumer_index(), 11);
        assert_eq!(cq.doorbell_record(), [0, 0, 0, 11]);
        assert!(CompletionQueue::new(3).is_err());
    }
}
