//! The daemon's error and warning reports: `tracing`, and standard error when the daemon
//! binary asks (it installs no `tracing` subscriber, and a failed chunk must leave a
//! trace where its operator looks). A leaf module: every other daemon module uses it.

/// Whether the daemon's errors and warnings also go to standard error (the daemon
/// binary turns it on: it installs no `tracing` subscriber, and a failed chunk must
/// leave a trace where its operator looks).
pub(crate) static LOG_TO_STDERR: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Sends the daemon's errors and warnings to standard error too (for the daemon binary).
pub fn log_to_stderr(on: bool) {
    LOG_TO_STDERR.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// `tracing::error!`, and standard error when [`log_to_stderr`] is on.
macro_rules! daemon_error {
    ($($arg:tt)*) => {{
        let msg = format!($($arg)*);
        tracing::error!("{msg}");
        if $crate::daemon::logging::LOG_TO_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
            eprintln!("hf3fs-gdr-daemon: error: {msg}");
        }
    }};
}

/// `tracing::warn!`, and standard error when [`log_to_stderr`] is on.
macro_rules! daemon_warn {
    ($($arg:tt)*) => {{
        let msg = format!($($arg)*);
        tracing::warn!("{msg}");
        if $crate::daemon::logging::LOG_TO_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
            eprintln!("hf3fs-gdr-daemon: warning: {msg}");
        }
    }};
}
pub(crate) use {daemon_error, daemon_warn};
