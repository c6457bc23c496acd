//! Queue pairs: creation, typestate bring-up from an exchangeable [`Endpoint`], the
//! classic post API (`ibv_post_send`/`ibv_post_recv`) and the `ibv_wr_*` API.

use crate::cq::CompletionQueue;
use crate::device::Mtu;
use crate::endpoint::Endpoint;
use crate::error::{cvt, cvt_ptr, post_error, ret_errno, Error, Result};
use crate::ffi;
use crate::mr::{AccessFlags, MemoryRegion, RemoteMemory, Sge};
use crate::mw::{MemoryWindow, MwType, SavedBinding};
use crate::newtype::c_newtype;
use crate::pd::{AddressHandle, AhAttr, ProtectionDomain};
use crate::srq::SharedReceiveQueue;
use crate::status::QpState;
use crate::wr::{link, RecvWr, SendFlags, SendWr};
use std::fmt;
use std::ops::RangeBounds;
use std::ptr::NonNull;

c_newtype! {
    /// QP transport type (`enum ibv_qp_type`).
    QpType(u32) {
        /// `IBV_QPT_RC`: reliable connected.
        RC = ffi::IBV_QPT_RC,
        /// `IBV_QPT_UC`: unreliable connected.
        UC = ffi::IBV_QPT_UC,
        /// `IBV_QPT_UD`: unreliable datagram.
        UD = ffi::IBV_QPT_UD,
        /// `IBV_QPT_RAW_PACKET`
        RAW_PACKET = ffi::IBV_QPT_RAW_PACKET,
        /// `IBV_QPT_XRC_SEND`
        XRC_SEND = ffi::IBV_QPT_XRC_SEND,
        /// `IBV_QPT_XRC_RECV`
        XRC_RECV = ffi::IBV_QPT_XRC_RECV,
        /// `IBV_QPT_DRIVER`
        DRIVER = ffi::IBV_QPT_DRIVER,
    }
}

bitflags::bitflags! {
    /// Which fields of a [`QpAttr`] are set (`enum ibv_qp_attr_mask`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct QpAttrMask: u32 {
        /// `IBV_QP_STATE`
        const STATE = ffi::IBV_QP_STATE;
        /// `IBV_QP_CUR_STATE`
        const CUR_STATE = ffi::IBV_QP_CUR_STATE;
        /// `IBV_QP_EN_SQD_ASYNC_NOTIFY`
        const EN_SQD_ASYNC_NOTIFY = ffi::IBV_QP_EN_SQD_ASYNC_NOTIFY;
        /// `IBV_QP_ACCESS_FLAGS`
        const ACCESS_FLAGS = ffi::IBV_QP_ACCESS_FLAGS;
        /// `IBV_QP_PKEY_INDEX`
        const PKEY_INDEX = ffi::IBV_QP_PKEY_INDEX;
        /// `IBV_QP_PORT`
        const PORT = ffi::IBV_QP_PORT;
        /// `IBV_QP_QKEY`
        const QKEY = ffi::IBV_QP_QKEY;
        /// `IBV_QP_AV`
        const AV = ffi::IBV_QP_AV;
        /// `IBV_QP_PATH_MTU`
        const PATH_MTU = ffi::IBV_QP_PATH_MTU;
        /// `IBV_QP_TIMEOUT`
        const TIMEOUT = ffi::IBV_QP_TIMEOUT;
        /// `IBV_QP_RETRY_CNT`
        const RETRY_CNT = ffi::IBV_QP_RETRY_CNT;
        /// `IBV_QP_RNR_RETRY`
        const RNR_RETRY = ffi::IBV_QP_RNR_RETRY;
        /// `IBV_QP_RQ_PSN`
        const RQ_PSN = ffi::IBV_QP_RQ_PSN;
        /// `IBV_QP_MAX_QP_RD_ATOMIC`
        const MAX_QP_RD_ATOMIC = ffi::IBV_QP_MAX_QP_RD_ATOMIC;
        /// `IBV_QP_ALT_PATH`
        const ALT_PATH = ffi::IBV_QP_ALT_PATH;
        /// `IBV_QP_MIN_RNR_TIMER`
        const MIN_RNR_TIMER = ffi::IBV_QP_MIN_RNR_TIMER;
        /// `IBV_QP_SQ_PSN`
        const SQ_PSN = ffi::IBV_QP_SQ_PSN;
        /// `IBV_QP_MAX_DEST_RD_ATOMIC`
        const MAX_DEST_RD_ATOMIC = ffi::IBV_QP_MAX_DEST_RD_ATOMIC;
        /// `IBV_QP_PATH_MIG_STATE`
        const PATH_MIG_STATE = ffi::IBV_QP_PATH_MIG_STATE;
        /// `IBV_QP_CAP`
        const CAP = ffi::IBV_QP_CAP;
        /// `IBV_QP_DEST_QPN`
        const DEST_QPN = ffi::IBV_QP_DEST_QPN;
        /// `IBV_QP_RATE_LIMIT`
        const RATE_LIMIT = ffi::IBV_QP_RATE_LIMIT;
    }
}

bitflags::bitflags! {
    /// Operations the `ibv_wr_*` API may post on a QP (`enum ibv_qp_create_send_ops_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct SendOpsFlags: u64 {
        /// `IBV_QP_EX_WITH_RDMA_WRITE`
        const RDMA_WRITE = ffi::IBV_QP_EX_WITH_RDMA_WRITE as u64;
        /// `IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM`
        const RDMA_WRITE_WITH_IMM = ffi::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM as u64;
        /// `IBV_QP_EX_WITH_SEND`
        const SEND = ffi::IBV_QP_EX_WITH_SEND as u64;
        /// `IBV_QP_EX_WITH_SEND_WITH_IMM`
        const SEND_WITH_IMM = ffi::IBV_QP_EX_WITH_SEND_WITH_IMM as u64;
        /// `IBV_QP_EX_WITH_RDMA_READ`
        const RDMA_READ = ffi::IBV_QP_EX_WITH_RDMA_READ as u64;
        /// `IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP`
        const ATOMIC_CMP_AND_SWP = ffi::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP as u64;
        /// `IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD`
        const ATOMIC_FETCH_AND_ADD = ffi::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD as u64;
        /// `IBV_QP_EX_WITH_LOCAL_INV`
        const LOCAL_INV = ffi::IBV_QP_EX_WITH_LOCAL_INV as u64;
        /// `IBV_QP_EX_WITH_BIND_MW`
        const BIND_MW = ffi::IBV_QP_EX_WITH_BIND_MW as u64;
        /// `IBV_QP_EX_WITH_SEND_WITH_INV`
        const SEND_WITH_INV = ffi::IBV_QP_EX_WITH_SEND_WITH_INV as u64;
    }
}

/// The attribute mask bits that the IB specification (and `ibv_modify_qp(3)`) requires
/// for the transition `from → to` of a `qp_type` QP.
pub fn required_mask(qp_type: QpType, from: QpState, to: QpState) -> QpAttrMask {
    use QpAttrMask as M;
    let connected = qp_type == QpType::RC || qp_type == QpType::UC;
    match (from, to) {
        (_, QpState::RESET) | (_, QpState::ERR) => M::STATE,
        (QpState::RESET, QpState::INIT) if connected => {
            M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS
        }
        (QpState::RESET, QpState::INIT) => M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY,
        (QpState::INIT, QpState::RTR) if qp_type == QpType::RC => {
            M::STATE
                | M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER
        }
        (QpState::INIT, QpState::RTR) if qp_type == QpType::UC => {
            M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN
        }
        (QpState::RTR, QpState::RTS) if qp_type == QpType::RC => {
            M::STATE | M::SQ_PSN | M::MAX_QP_RD_ATOMIC | M::RETRY_CNT | M::RNR_RETRY | M::TIMEOUT
        }
        (QpState::RTR, QpState::RTS) => M::STATE | M::SQ_PSN,
        _ => M::STATE,
    }
}

/// QP attributes for `ibv_modify_qp` (`struct ibv_qp_attr` + its mask). Each setter,
/// named after the C field, sets the matching [`QpAttrMask`] bit.
#[derive(Clone, Copy)]
pub struct QpAttr {
    raw: ffi::ibv_qp_attr,
    mask: QpAttrMask,
}

impl Default for QpAttr {
    fn default() -> Self {
        // SAFETY: all-zero is a valid `ibv_qp_attr`.
        let raw = unsafe { std::mem::zeroed() };
        QpAttr {
            raw,
            mask: QpAttrMask::empty(),
        }
    }
}

impl fmt::Debug for QpAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QpAttr")
            .field("qp_state", &QpState(self.raw.qp_state))
            .field("mask", &self.mask)
            .finish_non_exhaustive()
    }
}

macro_rules! qp_attr_setters {
    ($($(#[$m:meta])* $name:ident: $ty:ty => $bit:ident, |$raw:ident, $v:ident| $body:expr;)*) => {
        impl QpAttr {
            $(
                $(#[$m])*
                pub fn $name(mut self, $v: $ty) -> Self {
                    let $raw = &mut self.raw;
                    $body;
                    self.mask |= QpAttrMask::$bit;
                    self
                }
            )*
        }
    };
}

qp_attr_setters! {
    /// `qp_state`
    qp_state: QpState => STATE, |r, v| r.qp_state = v.0;
    /// `pkey_index`
    pkey_index: u16 => PKEY_INDEX, |r, v| r.pkey_index = v;
    /// `port_num`
    port_num: u8 => PORT, |r, v| r.port_num = v;
    /// `qp_access_flags`
    qp_access_flags: AccessFlags => ACCESS_FLAGS, |r, v| r.qp_access_flags = v.bits();
    /// `qkey` (UD)
    qkey: u32 => QKEY, |r, v| r.qkey = v;
    /// `path_mtu`
    path_mtu: Mtu => PATH_MTU, |r, v| r.path_mtu = v.0;
    /// `dest_qp_num`
    dest_qp_num: u32 => DEST_QPN, |r, v| r.dest_qp_num = v;
    /// `rq_psn`
    rq_psn: u32 => RQ_PSN, |r, v| r.rq_psn = v;
    /// `sq_psn`
    sq_psn: u32 => SQ_PSN, |r, v| r.sq_psn = v;
    /// `max_rd_atomic`: outstanding RDMA READ/atomics as initiator.
    max_rd_atomic: u8 => MAX_QP_RD_ATOMIC, |r, v| r.max_rd_atomic = v;
    /// `max_dest_rd_atomic`: as target.
    max_dest_rd_atomic: u8 => MAX_DEST_RD_ATOMIC, |r, v| r.max_dest_rd_atomic = v;
    /// `min_rnr_timer`
    min_rnr_timer: u8 => MIN_RNR_TIMER, |r, v| r.min_rnr_timer = v;
    /// `timeout` (4.096 µs × 2^timeout; 0 = infinite)
    timeout: u8 => TIMEOUT, |r, v| r.timeout = v;
    /// `retry_cnt`
    retry_cnt: u8 => RETRY_CNT, |r, v| r.retry_cnt = v;
    /// `rnr_retry` (7 = infinite)
    rnr_retry: u8 => RNR_RETRY, |r, v| r.rnr_retry = v;
    /// `ah_attr`
    ah_attr: AhAttr => AV, |r, v| r.ah_attr = *v.as_ffi();
}

impl QpAttr {
    /// Attributes from a C struct and its mask (unknown mask bits are kept), e.g. what
    /// `rdma_init_qp_attr` fills in.
    pub fn from_ffi(raw: ffi::ibv_qp_attr, mask: QpAttrMask) -> Self {
        QpAttr { raw, mask }
    }
    /// The mask of the fields set so far.
    pub fn mask(&self) -> QpAttrMask {
        self.mask
    }
    /// The C struct.
    pub fn as_ffi(&self) -> &ffi::ibv_qp_attr {
        &self.raw
    }
}

/// Connection parameters of [`PreparedQueuePair::connect`]; fields named after the
/// `ibv_qp_attr` fields they set. Defaults: port 1, GID index 0, all remote access,
/// `timeout` 14, `retry_cnt` 7, `rnr_retry` 7, `min_rnr_timer` 12, one outstanding
/// READ/atomic each way, the smaller of both MTUs.
#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    /// Local port.
    pub port_num: u8,
    /// Local GID index (source GID).
    pub gid_index: u8,
    /// `pkey_index`
    pub pkey_index: u16,
    /// `qp_access_flags`
    pub access: AccessFlags,
    /// `qkey` (UD)
    pub qkey: u32,
    /// `timeout`
    pub timeout: u8,
    /// `retry_cnt`
    pub retry_cnt: u8,
    /// `rnr_retry`
    pub rnr_retry: u8,
    /// `min_rnr_timer`
    pub min_rnr_timer: u8,
    /// `max_rd_atomic`
    pub max_rd_atomic: u8,
    /// `max_dest_rd_atomic`
    pub max_dest_rd_atomic: u8,
    /// `path_mtu` (None: min(local active MTU, remote MTU)).
    pub path_mtu: Option<Mtu>,
    /// `ah_attr.grh.hop_limit`
    pub hop_limit: u8,
    /// `ah_attr.grh.traffic_class`
    pub traffic_class: u8,
    /// `ah_attr.sl`
    pub sl: u8,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            port_num: 1,
            gid_index: 0,
            pkey_index: 0,
            access: AccessFlags::all_remote(),
            qkey: 0x1111_1111,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            path_mtu: None,
            hop_limit: 64,
            traffic_class: 0,
            sl: 0,
        }
    }
}

/// Creation attributes of a QP (`struct ibv_qp_init_attr_ex`), built from
/// [`ProtectionDomain::create_qp`].
pub struct QueuePairBuilder {
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    srq: Option<SharedReceiveQueue>,
    raw: ffi::ibv_qp_init_attr_ex,
}

impl fmt::Debug for QueuePairBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePairBuilder")
            .field("qp_type", &QpType(self.raw.qp_type))
            .field("max_send_wr", &self.raw.cap.max_send_wr)
            .field("max_recv_wr", &self.raw.cap.max_recv_wr)
            .finish_non_exhaustive()
    }
}

impl ProtectionDomain {
    /// Start creating a QP of `qp_type` (defaults: 16 send and receive WRs, one SGE each,
    /// no inline data, only `SIGNALED` requests complete).
    #[doc(alias = "ibv_create_qp_ex")]
    #[doc(alias = "ibv_create_qp")]
    pub fn create_qp(
        &self,
        qp_type: QpType,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> QueuePairBuilder {
        // SAFETY: all-zero is a valid `ibv_qp_init_attr_ex`.
        let mut raw: ffi::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        raw.qp_type = qp_type.0;
        raw.send_cq = send_cq.as_raw();
        raw.recv_cq = recv_cq.as_raw();
        raw.cap.max_send_wr = 16;
        raw.cap.max_recv_wr = 16;
        raw.cap.max_send_sge = 1;
        raw.cap.max_recv_sge = 1;
        raw.comp_mask = ffi::IBV_QP_INIT_ATTR_PD;
        raw.pd = self.as_raw();
        QueuePairBuilder {
            pd: self.clone(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            srq: None,
            raw,
        }
    }
}

impl QueuePairBuilder {
    /// `cap.max_send_wr`
    pub fn max_send_wr(mut self, n: u32) -> Self {
        self.raw.cap.max_send_wr = n;
        self
    }
    /// `cap.max_recv_wr`
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.raw.cap.max_recv_wr = n;
        self
    }
    /// `cap.max_send_sge`
    pub fn max_send_sge(mut self, n: u32) -> Self {
        self.raw.cap.max_send_sge = n;
        self
    }
    /// `cap.max_recv_sge`
    pub fn max_recv_sge(mut self, n: u32) -> Self {
        self.raw.cap.max_recv_sge = n;
        self
    }
    /// `cap.max_inline_data`
    pub fn max_inline_data(mut self, n: u32) -> Self {
        self.raw.cap.max_inline_data = n;
        self
    }
    /// `sq_sig_all`: every send request completes, signaled or not.
    pub fn sq_sig_all(mut self, all: bool) -> Self {
        self.raw.sq_sig_all = all as i32;
        self
    }
    /// `srq`: receive from a shared receive queue.
    pub fn srq(mut self, srq: &SharedReceiveQueue) -> Self {
        self.raw.srq = srq.as_raw();
        self.srq = Some(srq.clone());
        self
    }
    /// `send_ops_flags` (sets `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`): enables the `ibv_wr_*`
    /// API ([`QueuePair::wr_start`]) for these operations.
    pub fn send_ops_flags(mut self, ops: SendOpsFlags) -> Self {
        self.raw.send_ops_flags = ops.bits();
        self.raw.comp_mask |= ffi::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        self
    }

    /// Create the QP (`ibv_create_qp_ex`), in the RESET state.
    pub fn build(self) -> Result<PreparedQueuePair> {
        let mut raw = self.raw;
        let ctx = self.pd.context().as_raw();
        // SAFETY: `raw` is fully initialised and points to live PD/CQs/SRQ.
        let qp = unsafe { ffi::ibv_create_qp_ex(ctx, &mut raw) };
        let qp = cvt_ptr(qp, "ibv_create_qp_ex")?;
        let qpx = if raw.comp_mask & ffi::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
            // SAFETY: the QP was created with send ops flags, so it is a `ibv_qp_ex`.
            NonNull::new(unsafe { ffi::ibv_qp_to_qp_ex(qp.as_ptr()) })
        } else {
            None
        };
        let inner = QpInner {
            qp,
            qpx,
            cap: raw.cap,
            _send_cq: self.send_cq,
            _recv_cq: self.recv_cq,
            srq: self.srq,
            pd: self.pd,
        };
        Ok(PreparedQueuePair {
            inner,
            psn: initial_psn(inner_qpn(qp)),
        })
    }
}

fn inner_qpn(qp: NonNull<ffi::ibv_qp>) -> u32 {
    // SAFETY: live QP.
    unsafe { (*qp.as_ptr()).qp_num }
}

/// A 24-bit starting PSN that differs between QPs and runs.
fn initial_psn(qp_num: u32) -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(qp_num);
    (h.finish() as u32) & 0x00ff_ffff
}

struct QpInner {
    qp: NonNull<ffi::ibv_qp>,
    qpx: Option<NonNull<ffi::ibv_qp_ex>>,
    cap: ffi::ibv_qp_cap,
    pd: ProtectionDomain,
    _send_cq: CompletionQueue,
    _recv_cq: CompletionQueue,
    srq: Option<SharedReceiveQueue>,
}

// SAFETY: rdma-core QPs may be used from any thread: ibv_post_send/ibv_post_recv lock the
// queues in the providers (QPs are never created with a thread domain here). The
// `ibv_wr_*` session is guarded by `&mut` (see `QueuePair::wr_start`).
unsafe impl Send for QpInner {}
// SAFETY: as above.
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp_ex, destroyed once; the CQs/SRQ/PD are still
        // alive (fields drop after this).
        let ret = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        if let Err(err) = cvt(ret, "ibv_destroy_qp") {
            tracing::error!(%err, "destroying a queue pair failed");
        }
    }
}

impl QpInner {
    fn raw(&self) -> *mut ffi::ibv_qp {
        self.qp.as_ptr()
    }
    fn qp_num(&self) -> u32 {
        inner_qpn(self.qp)
    }
    fn qp_type(&self) -> QpType {
        // SAFETY: live QP.
        QpType(unsafe { (*self.raw()).qp_type })
    }
    /// The state libibverbs recorded at the last modify (no kernel call).
    fn cached_state(&self) -> QpState {
        // SAFETY: live QP.
        QpState(unsafe { (*self.raw()).state })
    }
    fn query_state(&self) -> Result<QpState> {
        let mut attr = QpAttr::default();
        // SAFETY: all-zero is a valid `ibv_qp_init_attr`.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP, valid out-pointers.
        let ret = unsafe {
            ffi::ibv_query_qp(
                self.raw(),
                &mut attr.raw,
                ffi::IBV_QP_STATE as i32,
                &mut init,
            )
        };
        cvt(ret, "ibv_query_qp")?;
        Ok(QpState(attr.raw.qp_state))
    }

    fn modify(&self, attr: &QpAttr) -> Result<()> {
        let from = self.cached_state();
        let mut raw = attr.raw;
        // SAFETY: live QP; `raw` holds every field named by the mask.
        let ret = unsafe { ffi::ibv_modify_qp(self.raw(), &mut raw, attr.mask.bits() as i32) };
        if ret == 0 {
            return Ok(());
        }
        let errno = ret_errno(ret);
        let to = QpState(attr.raw.qp_state);
        let hint = if errno == libc::EINVAL && attr.mask.contains(QpAttrMask::STATE) {
            let required = required_mask(self.qp_type(), from, to);
            let missing = required - attr.mask;
            let extra = attr.mask - required;
            if !missing.is_empty() {
                format!(" (missing attribute mask bits {missing:?}; {from:?}->{to:?} on a {:?} QP requires {required:?})", self.qp_type())
            } else {
                format!(" (mask {:?}; bits beyond the required {required:?}: {extra:?}; is {from:?}->{to:?} a valid transition and every value in range?)", attr.mask)
            }
        } else {
            String::new()
        };
        Err(Error::ModifyQp {
            qp_num: self.qp_num(),
            from,
            to,
            source: std::io::Error::from_raw_os_error(errno),
            hint,
        })
    }

    fn post_recv(&self, wrs: &mut [RecvWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let state = self.cached_state();
        if state == QpState::RESET {
            return Err(Error::InvalidQpState {
                call: "ibv_post_recv",
                qp_num: self.qp_num(),
                state,
                need: "receives can be posted from INIT on",
            });
        }
        link(wrs, |w| &mut w.raw.next);
        let mut bad = std::ptr::null_mut();
        // SAFETY: live QP; the chain points into `wrs` and the SGE arrays they borrow,
        // all valid for this call (the provider copies them into the queue).
        let ret = unsafe { ffi::ibv_post_recv(self.raw(), &mut wrs[0].raw, &mut bad) };
        post_error(
            ret,
            "ibv_post_recv",
            self.qp_num(),
            wrs.as_ptr().cast(),
            bad.cast(),
            std::mem::size_of::<RecvWr<'_>>(),
        )
    }
}

/// A QP between creation and RTS (RESET or INIT, typestate): connect it with
/// [`connect`](Self::connect) (RC/UC) or [`ready_ud`](Self::ready_ud). Receives may be
/// posted once it is in INIT ([`init`](Self::init)).
///
/// A prepared QP has no `post_send`; sending needs the [`QueuePair`] that `connect`
/// returns:
///
/// ```compile_fail
/// fn f(qp: &ibverbs::PreparedQueuePair) {
///     qp.post_send(&mut []);
/// }
/// ```
pub struct PreparedQueuePair {
    inner: QpInner,
    psn: u32,
}

impl fmt::Debug for PreparedQueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedQueuePair")
            .field("qp_num", &self.qp_num())
            .field("qp_type", &self.qp_type())
            .field("state", &self.inner.cached_state())
            .finish()
    }
}

impl PreparedQueuePair {
    /// The raw `ibv_qp`.
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.inner.raw()
    }
    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.inner.qp_num()
    }
    /// Transport type.
    pub fn qp_type(&self) -> QpType {
        self.inner.qp_type()
    }
    /// Current state (`ibv_query_qp`).
    #[doc(alias = "ibv_query_qp")]
    pub fn state(&self) -> Result<QpState> {
        self.inner.query_state()
    }
    /// Capacities granted at creation (may exceed those requested).
    pub fn cap(&self) -> ffi::ibv_qp_cap {
        self.inner.cap
    }
    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }
    /// Whether the QP receives from a shared receive queue.
    pub fn has_srq(&self) -> bool {
        self.inner.srq.is_some()
    }

    /// The QP as ready to send, once the caller has brought it to RTS by other means
    /// (the rdma_cm helper). Checks the state libibverbs recorded.
    #[cfg_attr(not(feature = "rdmacm"), allow(dead_code))]
    pub(crate) fn into_ready(self) -> Result<QueuePair> {
        let state = self.inner.cached_state();
        if state != QpState::RTS {
            return Err(Error::InvalidQpState {
                call: "connect",
                qp_num: self.qp_num(),
                state,
                need: "a connected QP must be in RTS",
            });
        }
        Ok(QueuePair { inner: self.inner })
    }

    /// What the peer needs to connect to this QP, using `opts.port_num` and
    /// `opts.gid_index`.
    pub fn endpoint(&self, opts: &ConnectOptions) -> Result<Endpoint> {
        let ctx = self.inner.pd.context();
        let port = ctx.query_port(opts.port_num)?;
        let gid = ctx.query_gid(opts.port_num, opts.gid_index.into())?;
        Ok(Endpoint {
            qp_num: self.qp_num(),
            psn: self.psn,
            gid,
            lid: port.lid(),
            mtu: port.active_mtu(),
        })
    }

    /// Low-level `ibv_modify_qp`; an `EINVAL` is explained (missing mask bits).
    #[doc(alias = "ibv_modify_qp")]
    pub fn modify(&mut self, attr: &QpAttr) -> Result<()> {
        self.inner.modify(attr)
    }

    /// RESET → INIT with `opts` (no-op when already in INIT).
    pub fn init(&mut self, opts: &ConnectOptions) -> Result<()> {
        if self.inner.cached_state() == QpState::INIT {
            return Ok(());
        }
        let mut attr = QpAttr::default()
            .qp_state(QpState::INIT)
            .pkey_index(opts.pkey_index)
            .port_num(opts.port_num);
        if self.qp_type() == QpType::UD {
            attr = attr.qkey(opts.qkey);
        } else {
            attr = attr.qp_access_flags(opts.access);
        }
        self.inner.modify(&attr)
    }

    /// Post receives (`ibv_post_recv`); the QP must be in INIT or later.
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&self, wrs: &mut [RecvWr<'_>]) -> Result<()> {
        self.inner.post_recv(wrs)
    }

    /// Connect an RC or UC QP to `remote`: RESET → INIT → RTR → RTS.
    pub fn connect(mut self, remote: &Endpoint, opts: &ConnectOptions) -> Result<QueuePair> {
        let qp_type = self.qp_type();
        if qp_type != QpType::RC && qp_type != QpType::UC {
            return Err(Error::InvalidArgument(format!(
                "connect on a {qp_type:?} QP (use ready_ud)"
            )));
        }
        self.init(opts)?;
        let local_mtu = self
            .inner
            .pd
            .context()
            .query_port(opts.port_num)?
            .active_mtu();
        let mtu = opts.path_mtu.unwrap_or(Mtu(local_mtu.0.min(remote.mtu.0)));
        let mut ah = AhAttr::from_endpoint(remote, opts.port_num, opts.gid_index)
            .hop_limit(opts.hop_limit)
            .traffic_class(opts.traffic_class)
            .sl(opts.sl);
        if remote.gid.is_zero() {
            ah = ah.dlid(remote.lid);
        }
        let mut rtr = QpAttr::default()
            .qp_state(QpState::RTR)
            .ah_attr(ah)
            .path_mtu(mtu)
            .dest_qp_num(remote.qp_num)
            .rq_psn(remote.psn);
        if qp_type == QpType::RC {
            rtr = rtr
                .max_dest_rd_atomic(opts.max_dest_rd_atomic)
                .min_rnr_timer(opts.min_rnr_timer);
        }
        self.inner.modify(&rtr)?;
        let mut rts = QpAttr::default().qp_state(QpState::RTS).sq_psn(self.psn);
        if qp_type == QpType::RC {
            rts = rts
                .timeout(opts.timeout)
                .retry_cnt(opts.retry_cnt)
                .rnr_retry(opts.rnr_retry)
                .max_rd_atomic(opts.max_rd_atomic);
        }
        self.inner.modify(&rts)?;
        Ok(QueuePair { inner: self.inner })
    }

    /// Bring a UD QP to RTS (RESET → INIT with `opts.qkey` → RTR → RTS); destinations are
    /// given per send with [`SendWr::ud`].
    pub fn ready_ud(mut self, opts: &ConnectOptions) -> Result<QueuePair> {
        if self.qp_type() != QpType::UD {
            return Err(Error::InvalidArgument(format!(
                "ready_ud on a {:?} QP",
                self.qp_type()
            )));
        }
        self.init(opts)?;
        self.inner
            .modify(&QpAttr::default().qp_state(QpState::RTR))?;
        self.inner
            .modify(&QpAttr::default().qp_state(QpState::RTS).sq_psn(self.psn))?;
        Ok(QueuePair { inner: self.inner })
    }
}

/// A QP in RTS: posts sends and receives. Share it between threads with `Arc`.
pub struct QueuePair {
    inner: QpInner,
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num())
            .field("qp_type", &self.qp_type())
            .finish()
    }
}

impl QueuePair {
    /// The raw `ibv_qp`.
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.inner.raw()
    }
    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.inner.qp_num()
    }
    /// Transport type.
    pub fn qp_type(&self) -> QpType {
        self.inner.qp_type()
    }
    /// Capacities granted at creation.
    pub fn cap(&self) -> ffi::ibv_qp_cap {
        self.inner.cap
    }
    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }
    /// Current state (`ibv_query_qp`): a QP goes to ERR by itself on a transport error.
    #[doc(alias = "ibv_query_qp")]
    pub fn state(&self) -> Result<QpState> {
        self.inner.query_state()
    }

    /// Low-level `ibv_modify_qp` (the escape hatch: this can leave RTS); an `EINVAL` is
    /// explained.
    #[doc(alias = "ibv_modify_qp")]
    pub fn modify(&self, attr: &QpAttr) -> Result<()> {
        self.inner.modify(attr)
    }

    /// Move to ERR: outstanding work completes with `IBV_WC_WR_FLUSH_ERR`.
    pub fn to_error(&self) -> Result<()> {
        self.inner.modify(&QpAttr::default().qp_state(QpState::ERR))
    }

    /// Recover: back to RESET (drops all queued work), ready to be connected again.
    pub fn reset(self) -> Result<PreparedQueuePair> {
        self.inner
            .modify(&QpAttr::default().qp_state(QpState::RESET))?;
        let psn = initial_psn(self.qp_num());
        Ok(PreparedQueuePair {
            inner: self.inner,
            psn,
        })
    }

    /// Post a chain of send requests (`ibv_post_send`). The slice is linked in place.
    ///
    /// Errors: [`Error::QueueFull`] when the send queue has no room (post fewer, or
    /// signal more often and reap completions), [`Error::InvalidQpState`] when the QP was
    /// moved out of RTS with [`modify`](Self::modify) into a state that cannot send.
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&self, wrs: &mut [SendWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let state = self.inner.cached_state();
        if matches!(state, QpState::RESET | QpState::INIT | QpState::RTR) {
            return Err(Error::InvalidQpState {
                call: "ibv_post_send",
                qp_num: self.qp_num(),
                state,
                need: "sends need RTS",
            });
        }
        link(wrs, |w| &mut w.raw.next);
        let mut bad = std::ptr::null_mut();
        // SAFETY: live QP; the chain points into `wrs` and the SGEs/AHs they borrow, all
        // valid for this call; memory behind the SGEs belongs to live MRs (or is inline
        // data copied now).
        let ret = unsafe { ffi::ibv_post_send(self.as_raw(), &mut wrs[0].raw, &mut bad) };
        post_error(
            ret,
            "ibv_post_send",
            self.qp_num(),
            wrs.as_ptr().cast(),
            bad.cast(),
            std::mem::size_of::<SendWr<'_>>(),
        )
    }

    /// Post receives (`ibv_post_recv`).
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&self, wrs: &mut [RecvWr<'_>]) -> Result<()> {
        self.inner.post_recv(wrs)
    }

    /// Start a batch of the `ibv_wr_*` API (`ibv_wr_start`). The QP must have been
    /// created with [`QueuePairBuilder::send_ops_flags`], else [`Error::Unsupported`].
    /// `&mut self` keeps one session per QP at a time.
    #[doc(alias = "ibv_wr_start")]
    pub fn wr_start(&mut self) -> Result<WrBatch<'_>> {
        let Some(qpx) = self.inner.qpx else {
            return Err(Error::Unsupported {
                call: "ibv_wr_start (QP created without send_ops_flags)",
            });
        };
        // SAFETY: live extended QP; no other session is open (`&mut self`).
        unsafe { ffi::ibv_wr_start(qpx.as_ptr()) };
        Ok(WrBatch {
            qp: self,
            qpx: qpx.as_ptr(),
            done: false,
            binds: Vec::new(),
            error: None,
        })
    }
}

/// A session of the `ibv_wr_*` post API ([`QueuePair::wr_start`]): each call appends one
/// work request; [`complete`](Self::complete) posts them all (`ibv_wr_complete`), and
/// dropping the batch without completing discards them (`ibv_wr_abort`).
pub struct WrBatch<'q> {
    qp: &'q mut QueuePair,
    qpx: *mut ffi::ibv_qp_ex,
    done: bool,
    /// Windows bound in this batch, with their previous state: restored when the batch
    /// is not posted.
    binds: Vec<(&'q mut MemoryWindow, SavedBinding)>,
    /// An argument error found while building: `complete` aborts and returns it.
    error: Option<Error>,
}

impl fmt::Debug for WrBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WrBatch")
            .field("qp_num", &self.qp.qp_num())
            .finish()
    }
}

impl<'q> WrBatch<'q> {
    fn begin(&mut self, wr_id: u64, flags: SendFlags) {
        // SAFETY: live extended QP inside a session; plain field writes.
        unsafe {
            (*self.qpx).wr_id = wr_id;
            (*self.qpx).wr_flags = flags.bits();
        }
    }
    fn sges(&mut self, sg: &[Sge<'_>]) {
        // SAFETY: inside a session, right after an op; the provider copies the SGEs now.
        unsafe { ffi::ibv_wr_set_sge_list(self.qpx, sg.len(), sg.as_ptr().cast()) };
    }
    /// `ibv_wr_send` + `ibv_wr_set_sge_list`.
    #[doc(alias = "ibv_wr_send")]
    pub fn send(&mut self, wr_id: u64, flags: SendFlags, sg: &[Sge<'_>]) -> &mut Self {
        self.begin(wr_id, flags);
        // SAFETY: inside a session.
        unsafe { ffi::ibv_wr_send(self.qpx) };
        self.sges(sg);
        self
    }
    /// `ibv_wr_send_imm` (immediate in host order) + SGEs.
    #[doc(alias = "ibv_wr_send_imm")]
    pub fn send_imm(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        imm: u32,
        sg: &[Sge<'_>],
    ) -> &mut Self {
        self.begin(wr_id, flags);
        // SAFETY: inside a session.
        unsafe { ffi::ibv_wr_send_imm(self.qpx, imm.to_be()) };
        self.sges(sg);
        self
    }
    /// `ibv_wr_send` + `ibv_wr_set_inline_data`.
    #[doc(alias = "ibv_wr_set_inline_data")]
    pub fn send_inline(&mut self, wr_id: u64, flags: SendFlags, data: &[u8]) -> &mut Self {
        self.begin(wr_id, flags | SendFlags::INLINE);
        // SAFETY: inside a session; the data is copied during the call.
        unsafe {
            ffi::ibv_wr_send(self.qpx);
            ffi::ibv_wr_set_inline_data(self.qpx, data.as_ptr().cast_mut().cast(), data.len());
        }
        self
    }
    /// `ibv_wr_rdma_write` + SGEs.
    #[doc(alias = "ibv_wr_rdma_write")]
    pub fn write(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        remote: RemoteMemory,
        sg: &[Sge<'_>],
    ) -> &mut Self {
        self.begin(wr_id, flags);
        // SAFETY: inside a session.
        unsafe { ffi::ibv_wr_rdma_write(self.qpx, remote.rkey, remote.addr) };
        self.sges(sg);
        self
    }
    /// `ibv_wr_rdma_write` + `ibv_wr_set_inline_data`.
    pub fn write_inline(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        remote: RemoteMemory,
        data: &[u8],
    ) -> &mut Self {
        self.begin(wr_id, flags | SendFlags::INLINE);
        // SAFETY: inside a session; the data is copied during the call.
        unsafe {
            ffi::ibv_wr_rdma_write(self.qpx, remote.rkey, remote.addr);
            ffi::ibv_wr_set_inline_data(self.qpx, data.as_ptr().cast_mut().cast(), data.len());
        }
        self
    }
    /// `ibv_wr_rdma_write_imm` + SGEs.
    #[doc(alias = "ibv_wr_rdma_write_imm")]
    pub fn write_imm(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        remote: RemoteMemory,
        imm: u32,
        sg: &[Sge<'_>],
    ) -> &mut Self {
        self.begin(wr_id, flags);
        // SAFETY: inside a session.
        unsafe { ffi::ibv_wr_rdma_write_imm(self.qpx, remote.rkey, remote.addr, imm.to_be()) };
        self.sges(sg);
        self
    }
    /// `ibv_wr_rdma_read` + SGEs.
    #[doc(alias = "ibv_wr_rdma_read")]
    pub fn read(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        remote: RemoteMemory,
        sg: &[Sge<'_>],
    ) -> &mut Self {
        self.begin(wr_id, flags);
        // SAFETY: inside a session.
        unsafe { ffi::ibv_wr_rdma_read(self.qpx, remote.rkey, remote.addr) };
        self.sges(sg);
        self
    }
    /// `ibv_wr_atomic_cmp_swp` + the 8-byte result SGE.
    #[doc(alias = "ibv_wr_atomic_cmp_swp")]
    pub fn compare_swap(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        remote: RemoteMemory,
        compare: u64,
        swap: u64,
        result: Sge<'_>,
    ) -> &mut Self {
        self.begin(wr_id, flags);
        // SAFETY: inside a session.
        unsafe { ffi::ibv_wr_atomic_cmp_swp(self.qpx, remote.rkey, remote.addr, compare, swap) };
        self.sges(&[result]);
        self
    }
    /// `ibv_wr_atomic_fetch_add` + the 8-byte result SGE.
    #[doc(alias = "ibv_wr_atomic_fetch_add")]
    pub fn fetch_add(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        remote: RemoteMemory,
        add: u64,
        result: Sge<'_>,
    ) -> &mut Self {
        self.begin(wr_id, flags);
        // SAFETY: inside a session.
        unsafe { ffi::ibv_wr_atomic_fetch_add(self.qpx, remote.rkey, remote.addr, add) };
        self.sges(&[result]);
        self
    }
    /// UD destination of the request just added (`ibv_wr_set_ud_addr`).
    #[doc(alias = "ibv_wr_set_ud_addr")]
    pub fn ud_addr(&mut self, ah: &AddressHandle, remote_qpn: u32, remote_qkey: u32) -> &mut Self {
        // SAFETY: inside a session; the AH is live for the call (providers copy it).
        unsafe { ffi::ibv_wr_set_ud_addr(self.qpx, ah.as_raw(), remote_qpn, remote_qkey) };
        self
    }
    /// Bind the type 2 window `mw` to `range` of `mr` with the remote rights `access`
    /// (`ibv_wr_bind_mw`, new rkey `ibv_inc_rkey(old)`); the peer of this QP may use it
    /// once the bind has completed. From here on [`MemoryWindow::rkey`] and
    /// [`MemoryWindow::remote`] describe the new binding; if the batch is dropped or
    /// fails, they are restored. A type 1 window makes [`complete`](Self::complete) fail
    /// with [`Error::InvalidArgument`] (bind those with [`QueuePair::bind_mw`]).
    ///
    /// # Panics
    /// If `range` is outside `mr`.
    #[doc(alias = "ibv_wr_bind_mw")]
    pub fn bind_mw(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        mw: &'q mut MemoryWindow,
        mr: &MemoryRegion,
        range: impl RangeBounds<usize>,
        access: AccessFlags,
    ) -> &mut Self {
        if mw.mw_type() != MwType::TYPE_2 {
            self.error.get_or_insert(Error::InvalidArgument(format!(
                "ibv_wr_bind_mw binds type 2 windows, not {:?} (use QueuePair::bind_mw)",
                mw.mw_type()
            )));
            return self;
        }
        // SAFETY: pure function.
        let rkey = unsafe { ffi::ibv_inc_rkey(mw.rkey()) };
        let (info, binding) = MemoryWindow::bind_info(mr, range, access, rkey);
        self.begin(wr_id, flags);
        // SAFETY: inside a session; the window and region are live, `info` is read now.
        unsafe { ffi::ibv_wr_bind_mw(self.qpx, mw.as_raw(), rkey, &info) };
        let saved = mw.set_bound(rkey, binding);
        self.binds.push((mw, saved));
        self
    }
    /// Invalidate `rkey` locally (`ibv_wr_local_inv`): a type 2 window bound through
    /// this QP.
    #[doc(alias = "ibv_wr_local_inv")]
    pub fn local_inv(&mut self, wr_id: u64, flags: SendFlags, rkey: u32) -> &mut Self {
        self.begin(wr_id, flags);
        // SAFETY: inside a session.
        unsafe { ffi::ibv_wr_local_inv(self.qpx, rkey) };
        self
    }
    /// SEND of `sg` that invalidates `rkey` at the peer (`ibv_wr_send_inv` + SGEs).
    #[doc(alias = "ibv_wr_send_inv")]
    pub fn send_inv(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        rkey: u32,
        sg: &[Sge<'_>],
    ) -> &mut Self {
        self.begin(wr_id, flags);
        // SAFETY: inside a session.
        unsafe { ffi::ibv_wr_send_inv(self.qpx, rkey) };
        self.sges(sg);
        self
    }
    /// Restore the windows bound in this batch (it was not posted).
    fn undo_binds(&mut self) {
        for (mw, saved) in self.binds.drain(..).rev() {
            mw.restore(saved);
        }
    }
    /// Post everything added (`ibv_wr_complete`). On error nothing was posted.
    #[doc(alias = "ibv_wr_complete")]
    pub fn complete(mut self) -> Result<()> {
        self.done = true;
        if let Some(err) = self.error.take() {
            // SAFETY: ends the session opened by wr_start, discarding its requests.
            unsafe { ffi::ibv_wr_abort(self.qpx) };
            self.undo_binds();
            return Err(err);
        }
        // SAFETY: ends the session opened by wr_start.
        let ret = unsafe { ffi::ibv_wr_complete(self.qpx) };
        if ret == 0 {
            self.binds.clear();
            return Ok(());
        }
        self.undo_binds();
        let errno = ret_errno(ret);
        Err(match errno {
            libc::ENOMEM => Error::QueueFull {
                call: "ibv_wr_complete",
                qp_num: self.qp.qp_num(),
                index: 0,
            },
            _ => Error::Post {
                call: "ibv_wr_complete",
                qp_num: self.qp.qp_num(),
                index: 0,
                source: std::io::Error::from_raw_os_error(errno),
            },
        })
    }
}

impl Drop for WrBatch<'_> {
    fn drop(&mut self) {
        if !self.done {
            // SAFETY: ends the session opened by wr_start, discarding its requests.
            unsafe { ffi::ibv_wr_abort(self.qpx) };
            self.undo_binds();
        }
    }
}

impl QueuePair {
    /// Bind `mw` to `range` of `mr` with the remote rights `access` (some of
    /// `REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC`); returns what the peer uses (the
    /// range and the window's new rkey).
    ///
    /// - type 1: `ibv_bind_mw` (any QP of the window's PD may bind it);
    /// - type 2: an `IBV_WR_BIND_MW` work request (`ibv_post_send`) on the QP whose peer
    ///   will use the window, with rkey `ibv_inc_rkey(old)`.
    ///
    /// The bind is a work request: with [`SendFlags::SIGNALED`] it completes with
    /// [`WcOpcode::BIND_MW`](crate::WcOpcode::BIND_MW) (or
    /// [`WcStatus::MW_BIND_ERR`](crate::WcStatus::MW_BIND_ERR), e.g. when `mr` was
    /// registered without [`AccessFlags::MW_BIND`]); tell the peer the rkey after that
    /// completion. The window keeps `mr`'s registration alive until it is bound again or
    /// dropped.
    ///
    /// A bind that completes with an error leaves the QP in the error state and the
    /// window with an rkey the device never gave it (the provider advances it when the
    /// bind is posted): drop such a window and allocate a new one.
    ///
    /// # Panics
    /// If `range` is outside `mr`.
    #[doc(alias = "ibv_bind_mw")]
    #[doc(alias = "IBV_WR_BIND_MW")]
    pub fn bind_mw(
        &self,
        mw: &mut MemoryWindow,
        wr_id: u64,
        flags: SendFlags,
        mr: &MemoryRegion,
        range: impl RangeBounds<usize>,
        access: AccessFlags,
    ) -> Result<RemoteMemory> {
        let state = QpState(
            // SAFETY: live QP.
            unsafe { (*self.as_raw()).state },
        );
        if matches!(state, QpState::RESET | QpState::INIT | QpState::RTR) {
            return Err(Error::InvalidQpState {
                call: "ibv_bind_mw",
                qp_num: self.qp_num(),
                state,
                need: "binding a window is a send work request: it needs RTS",
            });
        }
        match mw.mw_type() {
            MwType::TYPE_1 => {
                // The provider picks the new rkey and writes it into the window.
                let (info, mut binding) = MemoryWindow::bind_info(mr, range, access, 0);
                let mut bind = ffi::ibv_mw_bind {
                    wr_id,
                    send_flags: flags.bits(),
                    bind_info: info,
                };
                // SAFETY: live QP, window and region; `bind` is read during the call.
                let ret = unsafe { ffi::ibv_bind_mw(self.as_raw(), mw.as_raw(), &mut bind) };
                post_error(
                    ret,
                    "ibv_bind_mw",
                    self.qp_num(),
                    std::ptr::null(),
                    std::ptr::null(),
                    1,
                )?;
                binding.remote.rkey = mw.rkey();
                let remote = binding.remote;
                mw.set_bound(remote.rkey, binding);
                Ok(remote)
            }
            _ => {
                // SAFETY: pure function.
                let rkey = unsafe { ffi::ibv_inc_rkey(mw.rkey()) };
                let (info, binding) = MemoryWindow::bind_info(mr, range, access, rkey);
                // SAFETY: all-zero is a valid `ibv_send_wr`.
                let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
                wr.wr_id = wr_id;
                wr.opcode = ffi::IBV_WR_BIND_MW;
                wr.send_flags = flags.bits();
                wr.__bindgen_anon_2.bind_mw = ffi::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
                    mw: mw.as_raw(),
                    rkey,
                    bind_info: info,
                };
                let mut bad = std::ptr::null_mut();
                // SAFETY: live QP; one work request that points to the live window and
                // region, read during the call.
                let ret = unsafe { ffi::ibv_post_send(self.as_raw(), &mut wr, &mut bad) };
                post_error(
                    ret,
                    "ibv_post_send (IBV_WR_BIND_MW)",
                    self.qp_num(),
                    std::ptr::null(),
                    std::ptr::null(),
                    1,
                )?;
                let remote = binding.remote;
                mw.set_bound(rkey, binding);
                Ok(remote)
            }
        }
    }
}
