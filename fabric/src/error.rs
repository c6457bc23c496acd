//! The crate's one error type and the return-code helpers.

use crate::ffi;
use std::ffi::{c_int, CStr};
use std::time::Duration;

/// Everything that can fail in this crate.
///
/// Each variant names the libfabric call (`call`) and carries the positive fi errno
/// (`errno`, compare with `ffi::FI_E*`) where the library returned one. The codes callers
/// branch on have their own variants: [`Error::WouldBlock`] (`FI_EAGAIN`),
/// [`Error::Unsupported`] (`FI_EOPNOTSUPP`, `FI_ENOSYS`, no provider matching the hints),
/// [`Error::RemoteDisconnect`] (a completion or event saying the peer went away).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `FI_EAGAIN`: resources are busy; progress (read a completion queue) and retry.
    #[error("{call}: resource temporarily unavailable (FI_EAGAIN); progress and retry")]
    WouldBlock {
        /// The libfabric call.
        call: &'static str,
    },
    /// The provider does not offer what was asked for.
    #[error("{call}: not supported: {detail}")]
    Unsupported {
        /// The libfabric call (or `"fi_getinfo"` at discovery).
        call: &'static str,
        /// The fi errno (`FI_EOPNOTSUPP`, `FI_ENOSYS`, `FI_ENODATA`, …).
        errno: i32,
        /// What was asked for.
        detail: String,
    },
    /// A libfabric call failed.
    #[error("{call} failed: {message} (fi errno {errno}){context}")]
    Call {
        /// The libfabric call.
        call: &'static str,
        /// The fi errno (positive).
        errno: i32,
        /// `fi_strerror(errno)`.
        message: String,
        /// Extra context (provider, address, key, …), empty or starting with `: `.
        context: String,
    },
    /// An operation completed with an error (`fi_cq_readerr`).
    #[error("{0}")]
    Completion(Box<CompletionError>),
    /// The peer went away: a connection reset/refused/aborted completion, an `FI_SHUTDOWN`
    /// event, or a peer that stopped answering.
    #[error("{call}: remote peer disconnected: {detail}")]
    RemoteDisconnect {
        /// The call or queue that reported it.
        call: &'static str,
        /// The fi errno, where one was reported.
        errno: i32,
        /// `fi_strerror` / provider text.
        detail: String,
        /// The failed completion, when the report was one.
        completion: Option<Box<CompletionError>>,
    },
    /// An event-queue error entry (`fi_eq_readerr`).
    #[error("event queue error: {message} (fi errno {errno}, provider: {prov_message})")]
    Event {
        /// The fi errno.
        errno: i32,
        /// The provider's errno.
        prov_errno: i32,
        /// `fi_strerror(errno)`.
        message: String,
        /// `fi_eq_strerror` of the provider errno.
        prov_message: String,
    },
    /// An event other than the one being waited for arrived.
    #[error("{call}: expected {expected}, got event {got}")]
    UnexpectedEvent {
        /// What was waiting.
        call: &'static str,
        /// The expected event.
        expected: &'static str,
        /// The event number that arrived (`ffi::FI_CONNREQ`, …).
        got: u32,
    },
    /// A blocking wait ran out of time.
    #[error("{call}: timed out after {after:?}")]
    TimedOut {
        /// The waiting call.
        call: &'static str,
        /// The time waited.
        after: Duration,
    },
    /// An argument that the library would reject or that breaks this crate's contract.
    #[error("invalid argument to {call}: {detail}")]
    InvalidArgument {
        /// The call.
        call: &'static str,
        /// What is wrong.
        detail: String,
    },
}

/// A result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A failed completion, from `fi_cq_readerr`.
#[derive(Debug, Clone)]
pub struct CompletionError {
    /// The queue read (`fi_cq_readerr`) or the operation that waited on it.
    pub call: &'static str,
    /// The operation's context (the value passed when posting it).
    pub context: u64,
    /// Completion flags (`FI_WRITE | FI_RMA`, `FI_RECV | FI_MSG`, …).
    pub flags: u64,
    /// Length of the data transferred before the error, where known.
    pub len: usize,
    /// Remote CQ data, where the failed operation carried some.
    pub data: u64,
    /// The tag of a tagged operation.
    pub tag: u64,
    /// Bytes that did not fit (truncation).
    pub olen: usize,
    /// The fi errno (positive).
    pub errno: i32,
    /// The provider's own error number.
    pub prov_errno: i32,
    /// `fi_strerror(errno)`.
    pub message: String,
    /// `fi_cq_strerror` of the provider error.
    pub prov_message: String,
}

impl std::fmt::Display for CompletionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "completion error ({}) for context {:#x}, flags {:#x}: {} (fi errno {}; provider errno {}: {})",
            self.call,
            self.context,
            self.flags,
            self.message,
            self.errno,
            self.prov_errno,
            self.prov_message
        )
    }
}

/// `fi_strerror(errno)` (positive errno).
pub fn strerror(errno: i32) -> String {
    // SAFETY: fi_strerror accepts any value and returns a static NUL-terminated string.
    let msg = unsafe { CStr::from_ptr(ffi::fi_strerror(errno as c_int)) };
    msg.to_string_lossy().into_owned()
}

/// True for the errnos that mean "the peer is gone".
pub(crate) fn is_disconnect_errno(errno: i32) -> bool {
    [
        ffi::FI_ECONNRESET,
        ffi::FI_ECONNREFUSED,
        ffi::FI_ECONNABORTED,
        ffi::FI_ENOTCONN,
        ffi::FI_ESHUTDOWN,
        ffi::FI_EHOSTUNREACH,
        ffi::FI_EHOSTDOWN,
        ffi::FI_ENETUNREACH,
        ffi::FI_ETIMEDOUT,
        libc::EPIPE,
    ]
    .contains(&errno)
}

impl Error {
    /// The error for a negative return value `ret` of `call`.
    pub(crate) fn from_ret(call: &'static str, ret: isize) -> Self {
        Self::from_errno(call, (-ret) as i32, String::new())
    }

    /// The error for a positive fi errno of `call`, with context text.
    pub(crate) fn from_errno(call: &'static str, errno: i32, context: String) -> Self {
        if errno == ffi::FI_EAGAIN {
            return Error::WouldBlock { call };
        }
        if errno == ffi::FI_EOPNOTSUPP || errno == ffi::FI_ENOSYS {
            return Error::Unsupported {
                call,
                errno,
                detail: format!(
                    "{}{}",
                    strerror(errno),
                    if context.is_empty() { "" } else { &context }
                ),
            };
        }
        Error::Call {
            call,
            errno,
            message: strerror(errno),
            context,
        }
    }

    pub(crate) fn completion(err: CompletionError) -> Self {
        if is_disconnect_errno(err.errno) {
            Error::RemoteDisconnect {
                call: err.call,
                errno: err.errno,
                detail: format!("{} ({})", err.message, err.prov_message),
                completion: Some(Box::new(err)),
            }
        } else {
            Error::Completion(Box::new(err))
        }
    }

    /// The fi errno (positive) this error carries, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::WouldBlock { .. } => Some(ffi::FI_EAGAIN),
            Error::Unsupported { errno, .. }
            | Error::Call { errno, .. }
            | Error::RemoteDisconnect { errno, .. }
            | Error::Event { errno, .. } => Some(*errno),
            Error::Completion(c) => Some(c.errno),
            Error::TimedOut { .. } => Some(ffi::FI_ETIMEDOUT),
            Error::UnexpectedEvent { .. } | Error::InvalidArgument { .. } => None,
        }
    }

    /// `true` for [`Error::WouldBlock`].
    pub fn is_would_block(&self) -> bool {
        matches!(self, Error::WouldBlock { .. })
    }

    /// The failed completion, for [`Error::Completion`] and completion-reported
    /// [`Error::RemoteDisconnect`].
    pub fn completion_error(&self) -> Option<&CompletionError> {
        match self {
            Error::Completion(c) => Some(c),
            Error::RemoteDisconnect {
                completion: Some(c),
                ..
            } => Some(c),
            _ => None,
        }
    }

    /// Adds context text to a [`Error::Call`] (other variants are returned unchanged).
    pub(crate) fn context(mut self, text: impl FnOnce() -> String) -> Self {
        if let Error::Call { context, .. } = &mut self {
            *context = format!(": {}", text());
        }
        self
    }
}

/// `0` → `Ok(())`, a negative fi errno → the typed error.
#[inline]
pub(crate) fn cvt(call: &'static str, ret: c_int) -> Result<()> {
    if ret >= 0 {
        Ok(())
    } else {
        Err(Error::from_ret(call, ret as isize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promoted_codes() {
        assert!(Error::from_ret("fi_write", -(ffi::FI_EAGAIN as isize)).is_would_block());
        assert!(matches!(
            Error::from_ret("fi_write", -(ffi::FI_EOPNOTSUPP as isize)),
            Error::Unsupported { errno, .. } if errno == ffi::FI_EOPNOTSUPP
        ));
        let e = Error::from_ret("fi_mr_reg", -(ffi::FI_EINVAL as isize));
        assert_eq!(e.errno(), Some(ffi::FI_EINVAL));
        assert!(e.to_string().contains("fi_mr_reg"), "{e}");
        assert!(cvt("x", 0).is_ok());
    }

    #[test]
    fn strerror_has_text() {
        assert!(!strerror(ffi::FI_EAGAIN).is_empty());
        assert!(strerror(ffi::FI_ETRUNC).to_lowercase().contains("trunc"));
    }
}
