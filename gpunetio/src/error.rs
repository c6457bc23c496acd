//! The crate's one error type. Failures of the GPU memory layer below arrive whole as
//! [`Error::Gpu`].

use crate::status::GioStatus;

/// Everything that can go wrong, typed so callers can branch on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// GPU memory, the driver or NVRTC (the `gpu-mem` layer) failed.
    #[error(transparent)]
    Gpu(#[from] gpu_mem::Error),
    /// An argument is invalid (the message says which and why).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The operation is not supported by this handler, transport or device.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Socket I/O (exchanging queue pairs and descriptors).
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// CPU proxy: the queue pair was shut down (`GIO_ERR_SHUTDOWN`).
    #[error("the queue pair was shut down")]
    Shutdown,
    /// CPU proxy: a bounded wait ran out (`GIO_ERR_TIMEOUT`).
    #[error("{what}: timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// The bound.
        after: std::time::Duration,
    },
    /// CPU proxy: the ring reports a failure (`ctrl.error`), as a producer sees it.
    #[error("the ring failed at ticket {ticket}: {status}")]
    RingFailed {
        /// `ctrl.error`.
        status: GioStatus,
        /// `ctrl.error_ticket`.
        ticket: u64,
    },
    /// CPU proxy: the proxy refused a ring entry (`GIO_ERR_BAD_ENTRY` or
    /// `GIO_ERR_BOUNDS`, also written to `ctrl.error`); nothing of it was posted.
    #[error("ring entry {ticket} refused ({status}): {reason}")]
    BadEntry {
        /// The entry's ticket.
        ticket: u64,
        /// The status written to the ring.
        status: GioStatus,
        /// What is wrong with it.
        reason: String,
    },
    /// CPU proxy: the transport failed ring entry `ticket` (`GIO_ERR_TRANSPORT`, or
    /// `GIO_ERR_PEER_GONE` when the peer went away, also written to `ctrl.error`).
    #[error("ring entry {ticket} failed ({status}): {source}")]
    EntryFailed {
        /// The entry's ticket.
        ticket: u64,
        /// The status written to the ring.
        status: GioStatus,
        /// The transport's error.
        #[source]
        source: Box<Error>,
    },
    /// A libfabric call of a CPU proxy transport failed.
    #[cfg(feature = "fabric")]
    #[error("{context}: {source}")]
    Fabric {
        /// What was being done.
        context: String,
        /// The fabric crate's error.
        #[source]
        source: fabric::Error,
    },
    /// A verbs call of a CPU proxy transport failed.
    #[cfg(feature = "verbs")]
    #[error("{context}: {source}")]
    Verbs {
        /// What was being done.
        context: String,
        /// The ibverbs crate's error.
        #[source]
        source: ibverbs::Error,
    },
    /// Native mlx5 handler: a DEVX call failed (`errno`), or the firmware refused a
    /// command (`status` and `syndrome` of its output, as the PRM and `dmesg` name them).
    #[error("{call} failed: errno {errno}, firmware status {status:#x}, syndrome {syndrome:#x}")]
    Devx {
        /// The DEVX call or PRM command.
        call: &'static str,
        /// `errno` of the call (0 when the firmware status says why).
        errno: i32,
        /// The command output's status (0 when the call itself failed).
        status: u8,
        /// The command output's syndrome.
        syndrome: u32,
    },
    /// Bytes from a peer (connection blob, remote memory descriptor) do not decode.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// What was decoded.
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
