//! The daemon's counters (a leaf module: the data path and the sessions both count).

use std::sync::atomic::AtomicU64;

/// Counters (sent to clients as [`crate::DaemonStats`]).
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub direct_ops: AtomicU64,
    pub buffered_ops: AtomicU64,
    pub host_bytes: AtomicU64,
    pub gpu_bytes: AtomicU64,
    pub clients_released: AtomicU64,
    pub clients_now: AtomicU64,
}
