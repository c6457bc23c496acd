//! C enum values that the error type and several modules share (the status of a work
//! completion, the state of a QP): a leaf module, so that `error.rs` names them without
//! importing `cq.rs` or `qp.rs`.

use crate::ffi;
use crate::newtype::c_newtype;
use std::ffi::CStr;
use std::fmt;

c_newtype! {
    /// Work completion status (`enum ibv_wc_status`); unknown values are kept.
    WcStatus(u32) {
        /// `IBV_WC_SUCCESS`
        SUCCESS = ffi::IBV_WC_SUCCESS,
        /// `IBV_WC_LOC_LEN_ERR`
        LOC_LEN_ERR = ffi::IBV_WC_LOC_LEN_ERR,
        /// `IBV_WC_LOC_QP_OP_ERR`
        LOC_QP_OP_ERR = ffi::IBV_WC_LOC_QP_OP_ERR,
        /// `IBV_WC_LOC_EEC_OP_ERR`
        LOC_EEC_OP_ERR = ffi::IBV_WC_LOC_EEC_OP_ERR,
        /// `IBV_WC_LOC_PROT_ERR`
        LOC_PROT_ERR = ffi::IBV_WC_LOC_PROT_ERR,
        /// `IBV_WC_WR_FLUSH_ERR`: flushed because the QP is in the error state.
        WR_FLUSH_ERR = ffi::IBV_WC_WR_FLUSH_ERR,
        /// `IBV_WC_MW_BIND_ERR`
        MW_BIND_ERR = ffi::IBV_WC_MW_BIND_ERR,
        /// `IBV_WC_BAD_RESP_ERR`
        BAD_RESP_ERR = ffi::IBV_WC_BAD_RESP_ERR,
        /// `IBV_WC_LOC_ACCESS_ERR`
        LOC_ACCESS_ERR = ffi::IBV_WC_LOC_ACCESS_ERR,
        /// `IBV_WC_REM_INV_REQ_ERR`
        REM_INV_REQ_ERR = ffi::IBV_WC_REM_INV_REQ_ERR,
        /// `IBV_WC_REM_ACCESS_ERR`: bad rkey, address outside the remote MR, or missing rights.
        REM_ACCESS_ERR = ffi::IBV_WC_REM_ACCESS_ERR,
        /// `IBV_WC_REM_OP_ERR`
        REM_OP_ERR = ffi::IBV_WC_REM_OP_ERR,
        /// `IBV_WC_RETRY_EXC_ERR`: the peer did not answer (transport retries exhausted).
        RETRY_EXC_ERR = ffi::IBV_WC_RETRY_EXC_ERR,
        /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive posted, retries exhausted.
        RNR_RETRY_EXC_ERR = ffi::IBV_WC_RNR_RETRY_EXC_ERR,
        /// `IBV_WC_LOC_RDD_VIOL_ERR`
        LOC_RDD_VIOL_ERR = ffi::IBV_WC_LOC_RDD_VIOL_ERR,
        /// `IBV_WC_REM_INV_RD_REQ_ERR`
        REM_INV_RD_REQ_ERR = ffi::IBV_WC_REM_INV_RD_REQ_ERR,
        /// `IBV_WC_REM_ABORT_ERR`
        REM_ABORT_ERR = ffi::IBV_WC_REM_ABORT_ERR,
        /// `IBV_WC_INV_EECN_ERR`
        INV_EECN_ERR = ffi::IBV_WC_INV_EECN_ERR,
        /// `IBV_WC_INV_EEC_STATE_ERR`
        INV_EEC_STATE_ERR = ffi::IBV_WC_INV_EEC_STATE_ERR,
        /// `IBV_WC_FATAL_ERR`
        FATAL_ERR = ffi::IBV_WC_FATAL_ERR,
        /// `IBV_WC_RESP_TIMEOUT_ERR`
        RESP_TIMEOUT_ERR = ffi::IBV_WC_RESP_TIMEOUT_ERR,
        /// `IBV_WC_GENERAL_ERR`
        GENERAL_ERR = ffi::IBV_WC_GENERAL_ERR,
        /// `IBV_WC_TM_ERR`
        TM_ERR = ffi::IBV_WC_TM_ERR,
        /// `IBV_WC_TM_RNDV_INCOMPLETE`
        TM_RNDV_INCOMPLETE = ffi::IBV_WC_TM_RNDV_INCOMPLETE,
    }
}

impl fmt::Display for WcStatus {
    /// The text of `ibv_wc_status_str`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: ibv_wc_status_str returns a static string for any value.
        let s = unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(self.0)) };
        write!(f, "{} ({:?})", s.to_string_lossy(), self)
    }
}

c_newtype! {
    /// QP state (`enum ibv_qp_state`).
    QpState(u32) {
        /// `IBV_QPS_RESET`
        RESET = ffi::IBV_QPS_RESET,
        /// `IBV_QPS_INIT`
        INIT = ffi::IBV_QPS_INIT,
        /// `IBV_QPS_RTR`: ready to receive.
        RTR = ffi::IBV_QPS_RTR,
        /// `IBV_QPS_RTS`: ready to send.
        RTS = ffi::IBV_QPS_RTS,
        /// `IBV_QPS_SQD`
        SQD = ffi::IBV_QPS_SQD,
        /// `IBV_QPS_SQE`
        SQE = ffi::IBV_QPS_SQE,
        /// `IBV_QPS_ERR`
        ERR = ffi::IBV_QPS_ERR,
        /// `IBV_QPS_UNKNOWN`
        UNKNOWN = ffi::IBV_QPS_UNKNOWN,
    }
}
