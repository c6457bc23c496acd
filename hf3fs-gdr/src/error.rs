//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong, typed so callers can branch on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A system call failed; `errno` is its error number.
    #[error("{call} failed: {source}{}", context_suffix(context))]
    Os {
        /// The call (`shm_open`, `mmap`, `symlink`, ...).
        call: &'static str,
        /// The OS error.
        source: std::io::Error,
        /// What it was applied to.
        context: Option<String>,
    },
    /// An argument is invalid (the message says which and why).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The request needs something this machine or build lacks (no GPU, no CUDA IPC).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A GPU call failed (from `gpu-mem`).
    #[error(transparent)]
    Gpu(#[from] gpu_mem::Error),
    /// The mount has no running `hf3fs-gdr-daemon` (nothing listens on its socket).
    #[error("no hf3fs-gdr daemon serves {mount}: {why}")]
    NoDaemon {
        /// The mount directory.
        mount: PathBuf,
        /// Why the connection failed.
        why: String,
    },
    /// The daemon that served this ring is gone (its socket closed): nothing in flight
    /// will complete.
    #[error("the hf3fs-gdr daemon of {mount} is gone: {why}")]
    DaemonGone {
        /// The mount directory.
        mount: PathBuf,
        /// What showed it.
        why: String,
    },
    /// The daemon refused a request (`errno` is what it reported).
    #[error("the daemon refused {request}: errno {errno} ({})", std::io::Error::from_raw_os_error(*errno))]
    Refused {
        /// The request.
        request: &'static str,
        /// The daemon's error number.
        errno: i32,
    },
    /// The ring has `entries` I/Os prepared or unreaped: reap completions first.
    #[error("the ring is full ({entries} entries prepared or unreaped)")]
    RingFull {
        /// The ring's capacity.
        entries: u32,
    },
    /// The file descriptor was not registered with [`crate::reg_fd`].
    #[error("fd {0} is not registered (call reg_fd first)")]
    FdNotRegistered(i32),
    /// No iov or ring with this id is published under the mount.
    #[error("nothing published as {id} under {dir}")]
    NotFound {
        /// The iov id in hex.
        id: String,
        /// The directory looked in.
        dir: PathBuf,
    },
    /// A call into 3FS's `libhf3fs_api_shared` failed with `errno`.
    #[error("{call} failed: errno {errno} ({})", std::io::Error::from_raw_os_error(*errno))]
    Hf3fs {
        /// The C function.
        call: &'static str,
        /// Its error number.
        errno: i32,
    },
    /// An RDMA call of the registration manager failed (feature `rdma`).
    #[cfg(feature = "rdma")]
    #[error("{what}: {source}")]
    Rdma {
        /// What was being done.
        what: String,
        /// The verbs error.
        source: ibverbs::Error,
    },
    /// A publication (symlink target, ring header, handle bytes) does not parse.
    #[error("malformed {what}: {detail}")]
    Malformed {
        /// What was parsed.
        what: &'static str,
        /// Why it does not parse.
        detail: String,
    },
}

fn context_suffix(context: &Option<String>) -> String {
    context
        .as_ref()
        .map(|c| format!(" ({c})"))
        .unwrap_or_default()
}

impl Error {
    /// The errno this error stands for, as 3FS's C API would return it negated.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::InvalidArgument(_) | Error::Malformed { .. } => libc::EINVAL,
            Error::Unsupported(_) => libc::ENOTSUP,
            Error::Gpu(_) => libc::EIO,
            Error::NoDaemon { .. } => libc::ECONNREFUSED,
            Error::DaemonGone { .. } => libc::ENOTCONN,
            Error::Refused { errno, .. } | Error::Hf3fs { errno, .. } => *errno,
            Error::RingFull { .. } => libc::EAGAIN,
            Error::FdNotRegistered(_) => libc::EBADF,
            Error::NotFound { .. } => libc::ENOENT,
            #[cfg(feature = "rdma")]
            Error::Rdma { source, .. } => source.errno().unwrap_or(libc::EIO),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Converts a libc return value (-1 and `errno` on failure).
pub(crate) fn cvt(call: &'static str, ret: libc::c_int) -> Result<libc::c_int> {
    if ret < 0 {
        Err(Error::Os {
            call,
            source: std::io::Error::last_os_error(),
            context: None,
        })
    } else {
        Ok(ret)
    }
}

/// An `io::Error` of `call` applied to `context`.
pub(crate) fn os_err(
    call: &'static str,
    source: std::io::Error,
    context: impl std::fmt::Display,
) -> Error {
    Error::Os {
        call,
        source,
        context: Some(context.to_string()),
    }
}
