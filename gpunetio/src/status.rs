//! Statuses shared by the ring, the proxy and the crate's error type (a leaf module: it
//! imports nothing of the crate, so `error` and `proxy` both build on it).

use gpunetio_sys as ffi;
use std::fmt;

/// A status the ring reports (`GIO_OK`, `GIO_ERR_*`): a newtype, as an unknown value
/// written by a device must not be undefined behaviour.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GioStatus(pub i32);

impl GioStatus {
    /// `GIO_OK`.
    pub const OK: Self = Self(ffi::GIO_OK);
    /// `GIO_ERR_BAD_ENTRY`: a malformed entry (opcode, flags, length).
    pub const BAD_ENTRY: Self = Self(ffi::GIO_ERR_BAD_ENTRY);
    /// `GIO_ERR_BOUNDS`: a memory index, kind or range outside the table.
    pub const BOUNDS: Self = Self(ffi::GIO_ERR_BOUNDS);
    /// `GIO_ERR_TRANSPORT`: the transport failed an operation.
    pub const TRANSPORT: Self = Self(ffi::GIO_ERR_TRANSPORT);
    /// `GIO_ERR_PEER_GONE`: the peer disconnected.
    pub const PEER_GONE: Self = Self(ffi::GIO_ERR_PEER_GONE);
    /// `GIO_ERR_TIMEOUT`: a bounded wait ran out.
    pub const TIMEOUT: Self = Self(ffi::GIO_ERR_TIMEOUT);
    /// `GIO_ERR_SHUTDOWN`: the host shut the queue pair down.
    pub const SHUTDOWN: Self = Self(ffi::GIO_ERR_SHUTDOWN);
    /// `GIO_ERR_MIXED_LEVELS`.
    pub const MIXED_LEVELS: Self = Self(ffi::GIO_ERR_MIXED_LEVELS);
    /// `GIO_ERR_CQE`: the native mlx5 handler polled an error CQE
    /// (`gio_mlx5_qp.syndrome` says why).
    pub const CQE: Self = Self(ffi::GIO_ERR_CQE);

    /// Every status this version names, in value order.
    pub const ALL: [Self; 9] = [
        Self::OK,
        Self::BAD_ENTRY,
        Self::BOUNDS,
        Self::TRANSPORT,
        Self::PEER_GONE,
        Self::TIMEOUT,
        Self::SHUTDOWN,
        Self::MIXED_LEVELS,
        Self::CQE,
    ];

    /// The constant's name, `None` for a value this version does not know.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            ffi::GIO_OK => "GIO_OK",
            ffi::GIO_ERR_BAD_ENTRY => "GIO_ERR_BAD_ENTRY",
            ffi::GIO_ERR_BOUNDS => "GIO_ERR_BOUNDS",
            ffi::GIO_ERR_TRANSPORT => "GIO_ERR_TRANSPORT",
            ffi::GIO_ERR_PEER_GONE => "GIO_ERR_PEER_GONE",
            ffi::GIO_ERR_TIMEOUT => "GIO_ERR_TIMEOUT",
            ffi::GIO_ERR_SHUTDOWN => "GIO_ERR_SHUTDOWN",
            ffi::GIO_ERR_MIXED_LEVELS => "GIO_ERR_MIXED_LEVELS",
            ffi::GIO_ERR_CQE => "GIO_ERR_CQE",
            _ => return None,
        })
    }
}

impl fmt::Debug for GioStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "GioStatus({})", self.0),
        }
    }
}

impl fmt::Display for GioStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
