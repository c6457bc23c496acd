//! The crate's one error type.

use crate::status::{QpState, WcStatus};
use std::ffi::c_int;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can fail in this crate.
///
/// The codes callers branch on are promoted to their own variants: `EOPNOTSUPP` →
/// [`Error::Unsupported`], `EAGAIN` → [`Error::WouldBlock`], a send queue that is full →
/// [`Error::QueueFull`], a flushed or retry-exceeded completion →
/// [`Error::RemoteDisconnect`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A verbs call failed with an `errno`.
    #[error("{call} failed: {source}")]
    Verbs {
        /// The C function, e.g. `ibv_alloc_pd`.
        call: &'static str,
        /// The `errno` it reported.
        #[source]
        source: io::Error,
    },
    /// The device or the provider library does not implement this (`EOPNOTSUPP`,
    /// `ENOSYS`, or a capability the device attributes do not announce).
    #[error("{call}: not supported by this device or provider")]
    Unsupported {
        /// The C function or feature.
        call: &'static str,
    },
    /// A non-blocking call has nothing to return yet (`EAGAIN`).
    #[error("{call}: would block")]
    WouldBlock {
        /// The C function.
        call: &'static str,
    },
    /// No device of that name (the list is empty when the host has no RDMA subsystem).
    #[error("RDMA device `{name}` not found (devices: {available:?})")]
    DeviceNotFound {
        /// The requested name.
        name: String,
        /// The devices that exist.
        available: Vec<String>,
    },
    /// Querying a GID failed or found no usable GID.
    #[error("port {port}, GID index {gid_index}: {reason}")]
    Gid {
        /// Port number.
        port: u8,
        /// GID table index (or the table size when no entry matched).
        gid_index: u32,
        /// What went wrong.
        reason: String,
    },
    /// `ibv_modify_qp` rejected a state transition.
    #[error("ibv_modify_qp: QP {qp_num} {from:?} -> {to:?} failed: {source}{hint}")]
    ModifyQp {
        /// QP number.
        qp_num: u32,
        /// State before the call.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// The `errno`.
        #[source]
        source: io::Error,
        /// For `EINVAL`: which attribute mask bits this transition requires.
        hint: String,
    },
    /// A post was attempted on a QP that is not in a state that allows it (e.g.
    /// `post_send` before RTS).
    #[error("{call} on QP {qp_num} in state {state:?}: {need}")]
    InvalidQpState {
        /// The C function.
        call: &'static str,
        /// QP number.
        qp_num: u32,
        /// The state the QP is in.
        state: QpState,
        /// The state it must be in.
        need: &'static str,
    },
    /// More work requests than the queue holds were posted (`ENOMEM` from a post).
    #[error("{call}: queue full on QP/SRQ {qp_num} (at work request {index} of the chain)")]
    QueueFull {
        /// The C function.
        call: &'static str,
        /// QP (or SRQ) number.
        qp_num: u32,
        /// Index of the first work request that was not posted.
        index: usize,
    },
    /// A post failed for another reason.
    #[error("{call} on QP {qp_num} failed at work request {index}: {source}")]
    Post {
        /// The C function.
        call: &'static str,
        /// QP number.
        qp_num: u32,
        /// Index of the first work request that was not posted.
        index: usize,
        /// The `errno`.
        #[source]
        source: io::Error,
    },
    /// A work request completed with an error status.
    #[error("work request {wr_id:#x} on QP {qp_num} completed with {status} (vendor error {vendor_err:#x})")]
    WorkCompletion {
        /// The request's `wr_id`.
        wr_id: u64,
        /// Its status.
        status: WcStatus,
        /// Provider-specific detail.
        vendor_err: u32,
        /// The local QP.
        qp_num: u32,
    },
    /// The connection is gone: a completion was flushed (`IBV_WC_WR_FLUSH_ERR`) or the
    /// transport gave up (`IBV_WC_RETRY_EXC_ERR`, `IBV_WC_RNR_RETRY_EXC_ERR`).
    #[error("peer of QP {qp_num} unreachable: work request {wr_id:#x} completed with {status}")]
    RemoteDisconnect {
        /// The request's `wr_id`.
        wr_id: u64,
        /// Its status.
        status: WcStatus,
        /// The local QP.
        qp_num: u32,
    },
    /// An argument was out of range before any C call was made.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// rdma_cm: no route to `addr` over RDMA: no RDMA device serves the address
    /// (e.g. `127.0.0.1`, an interface without RDMA), or address resolution, route
    /// resolution or the connection request got no answer (`RDMA_CM_EVENT_ADDR_ERROR`,
    /// `RDMA_CM_EVENT_ROUTE_ERROR`, `RDMA_CM_EVENT_UNREACHABLE`).
    #[error("{addr} is unreachable over RDMA ({stage}): {source}")]
    Unreachable {
        /// The destination.
        addr: SocketAddr,
        /// The call or event that failed, e.g. `rdma_resolve_addr`.
        stage: &'static str,
        /// The `errno` (the event's status, negated).
        #[source]
        source: io::Error,
    },
    /// rdma_cm: nobody listens on `addr` (the peer's connection manager rejected the
    /// request with "invalid service ID"); the RDMA analogue of `ECONNREFUSED`.
    #[error("{addr}: connection refused (no RDMA listener on that address and port)")]
    ConnectionRefused {
        /// The destination.
        addr: SocketAddr,
    },
    /// rdma_cm: the peer rejected the connection (`RDMA_CM_EVENT_REJECTED`), e.g. with
    /// `ConnectRequest::reject`.
    #[error("{addr}: connection rejected (reason {reason})")]
    Rejected {
        /// The peer.
        addr: SocketAddr,
        /// The InfiniBand CM reject reason (28: rejected by the peer application).
        reason: i32,
        /// The private data of the reject message (zero-padded by the transport).
        private_data: Vec<u8>,
    },
    /// A bounded wait ended before what it waited for happened.
    #[error("{what}: no answer within {after:?}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// The bound.
        after: Duration,
    },
    /// rdma_cm: an event other than the awaited one arrived (e.g. a disconnect while
    /// accepting).
    #[error("{waiting_for}: got {event} (status {status})")]
    UnexpectedCmEvent {
        /// What was awaited.
        waiting_for: &'static str,
        /// The `RDMA_CM_EVENT_*` name that arrived.
        event: &'static str,
        /// The event's status.
        status: i32,
    },
    /// An I/O error on the side channel or an event file descriptor.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Map an `errno` from `call` to the variant callers branch on.
    pub(crate) fn from_errno(call: &'static str, errno: c_int) -> Self {
        match errno {
            libc::EOPNOTSUPP | libc::ENOSYS => Error::Unsupported { call },
            libc::EAGAIN => Error::WouldBlock { call },
            _ => Error::Verbs {
                call,
                source: io::Error::from_raw_os_error(errno),
            },
        }
    }

    /// The current `errno` as an error of `call`.
    pub(crate) fn last(call: &'static str) -> Self {
        Self::from_errno(call, last_errno())
    }

    /// The `errno` value, if this error carries one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Verbs { source, .. }
            | Error::ModifyQp { source, .. }
            | Error::Post { source, .. }
            | Error::Io { source, .. }
            | Error::Unreachable { source, .. } => source.raw_os_error(),
            Error::ConnectionRefused { .. } | Error::Rejected { .. } => Some(libc::ECONNREFUSED),
            Error::Timeout { .. } => Some(libc::ETIMEDOUT),
            Error::Unsupported { .. } => Some(libc::EOPNOTSUPP),
            Error::WouldBlock { .. } => Some(libc::EAGAIN),
            Error::QueueFull { .. } => Some(libc::ENOMEM),
            _ => None,
        }
    }
}

pub(crate) fn last_errno() -> c_int {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Convert a C return code: 0 is success; a positive value is the `errno` (most verbs);
/// a negative value means "see `errno`" (or is `-errno`).
pub(crate) fn cvt(ret: c_int, call: &'static str) -> Result<()> {
    if ret == 0 {
        return Ok(());
    }
    Err(Error::from_errno(call, ret_errno(ret)))
}

/// The `errno` behind a nonzero C return code (see [`cvt`]).
pub(crate) fn ret_errno(ret: c_int) -> c_int {
    if ret > 0 {
        ret
    } else {
        match last_errno() {
            0 => -ret,
            e => e,
        }
    }
}

/// Convert a returned pointer: NULL means "see `errno`".
pub(crate) fn cvt_ptr<T>(p: *mut T, call: &'static str) -> Result<std::ptr::NonNull<T>> {
    std::ptr::NonNull::new(p).ok_or_else(|| Error::last(call))
}

/// The error of a post (`ibv_post_send`, `ibv_post_recv`, `ibv_bind_mw` …) that returned
/// `ret`, naming the first work request that was not posted (`bad`, in the array starting
/// at `first` of `size`-byte requests); `Ok` for 0.
pub(crate) fn post_error(
    ret: i32,
    call: &'static str,
    qp_num: u32,
    first: *const u8,
    bad: *const u8,
    size: usize,
) -> Result<()> {
    if ret == 0 {
        return Ok(());
    }
    let errno = ret_errno(ret);
    let index = if bad.is_null() {
        0
    } else {
        (bad as usize - first as usize) / size
    };
    Err(match errno {
        libc::ENOMEM => Error::QueueFull {
            call,
            qp_num,
            index,
        },
        _ => Error::Post {
            call,
            qp_num,
            index,
            source: std::io::Error::from_raw_os_error(errno),
        },
    })
}
