//! The crate's one error type.

use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;

/// Everything that can go wrong, typed so callers can branch on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No CUDA driver library (`libcuda.so.1`) could be loaded on this machine.
    #[error("no CUDA driver: libcuda could not be loaded")]
    NoDriver,
    /// A driver call failed; `code` is the driver's `CUresult`.
    #[error("{call} failed: {code:?}{}", context.as_ref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its result code.
        code: DriverError,
        /// What was being done (device, size, pointer).
        context: Option<String>,
    },
    /// No GPU has this ordinal or PCI bus id.
    #[error("no GPU {0}")]
    NoSuchGpu(String),
    /// An argument is invalid (the message says which and why).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A pointer that was expected to be device memory is not (host memory, freed
    /// memory, or memory of another device).
    #[error("{ptr:#x}+{len} is not device memory of GPU {expected_device}: it is {found}")]
    NotDeviceMemory {
        /// The pointer.
        ptr: u64,
        /// The range length asked for.
        len: u64,
        /// The GPU ordinal the caller expected.
        expected_device: usize,
        /// What the driver says the memory is.
        found: String,
    },
    /// The operation is not supported for this memory or on this device.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// No NVRTC library (`libnvrtc.so.13`) could be loaded: device code cannot be
    /// compiled. Install the CUDA toolkit's NVRTC or the `nvidia-cuda-nvrtc` wheel (13.0
    /// series) and put its `lib` folder on `LD_LIBRARY_PATH`.
    #[error("no NVRTC: libnvrtc could not be loaded (install nvidia-cuda-nvrtc 13.0 and add its lib folder to LD_LIBRARY_PATH)")]
    NoNvrtc,
    /// Device code did not compile; `log` is NVRTC's.
    #[error("device code `{name}` did not compile ({code}):\n{log}")]
    Compile {
        /// The program's name.
        name: String,
        /// NVRTC's result.
        code: String,
        /// NVRTC's log.
        log: String,
    },
    /// Socket I/O (file-descriptor passing).
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
        status: crate::proxy::GioStatus,
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
        status: crate::proxy::GioStatus,
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
        status: crate::proxy::GioStatus,
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

impl Error {
    /// The driver's result code, for [`Error::Driver`].
    pub fn cu_result(&self) -> Option<CUresult> {
        match self {
            Error::Driver { code, .. } => Some(code.0),
            _ => None,
        }
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Turns a `CUresult` into a `Result`, naming the call.
pub(crate) fn cvt(call: &'static str, result: CUresult) -> Result<()> {
    result.result().map_err(|code| Error::Driver {
        call,
        code,
        context: None,
    })
}

/// Like [`cvt`], with what was being done.
pub(crate) fn cvt_ctx(
    call: &'static str,
    result: CUresult,
    context: impl FnOnce() -> String,
) -> Result<()> {
    result.result().map_err(|code| Error::Driver {
        call,
        code,
        context: Some(context()),
    })
}

/// Wraps an error of cudarc's safe layer.
pub(crate) fn from_driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |code| Error::Driver {
        call,
        code,
        context: None,
    }
}
