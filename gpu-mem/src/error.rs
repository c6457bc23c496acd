//! The crate's one error type, and the helpers that turn a driver's `CUresult` into it.

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
    /// GPU `from` cannot access GPU `to`'s memory directly (`cuDeviceCanAccessPeer`
    /// says no, or the driver refused to enable it): data between them must be staged
    /// through host memory.
    #[error(
        "GPU {from} cannot access the memory of GPU {to} directly (no peer access between them)"
    )]
    NoPeerAccess {
        /// The accessing GPU.
        from: usize,
        /// The GPU whose memory would be accessed.
        to: usize,
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

/// Turns the `CUresult` of a raw driver call (through [`cudarc::driver::sys`]) into a
/// [`Result`] naming the call: for callers that make driver calls this crate does not
/// wrap and want its typed error.
pub fn cvt(call: &'static str, result: CUresult) -> Result<()> {
    result.result().map_err(|code| Error::Driver {
        call,
        code,
        context: None,
    })
}

/// Like [`cvt`], with what was being done (device, size, pointer) for the message.
pub fn cvt_ctx(
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
