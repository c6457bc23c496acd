//! Python exceptions for the agent's typed errors.
//!
//! NIXL's bindings raise one exception class per status code (`nixlNotFoundError`,
//! `nixlInvalidParamError`, …), each a plain `Exception`. Ours keep those names, so code
//! catching NIXL's classes by name keeps working, and share a base `nixlError`. Every
//! raised instance also carries the Rust error it came from: `kind` (the variant's
//! name, e.g. `"RemoteDisconnect"`), and where the variant has them `agent`, `backend`
//! and `code` (the transport's error number).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    rdma_nixl._core,
    nixlError,
    PyException,
    "Base class of every error the agent raises."
);
create_exception!(
    rdma_nixl._core,
    nixlInvalidParamError,
    nixlError,
    "An argument is invalid (NIXL_ERR_INVALID_PARAM)."
);
create_exception!(
    rdma_nixl._core,
    nixlNotFoundError,
    nixlError,
    "No such agent, backend, registration or registered range (NIXL_ERR_NOT_FOUND)."
);
create_exception!(
    rdma_nixl._core,
    nixlMismatchError,
    nixlError,
    "Malformed or mismatching metadata (NIXL_ERR_MISMATCH)."
);
create_exception!(
    rdma_nixl._core,
    nixlBackendError,
    nixlError,
    "The transport failed (NIXL_ERR_BACKEND); `code` is its error number."
);
create_exception!(
    rdma_nixl._core,
    nixlRemoteDisconnectError,
    nixlError,
    "The peer's process or connection is gone (NIXL_ERR_REMOTE_DISCONNECT)."
);
create_exception!(
    rdma_nixl._core,
    nixlCancelledError,
    nixlError,
    "The transfer was released or the agent shut down (NIXL_ERR_CANCELED)."
);
create_exception!(
    rdma_nixl._core,
    nixlNotPostedError,
    nixlError,
    "The transfer was never posted (NIXL_ERR_NOT_POSTED)."
);
create_exception!(
    rdma_nixl._core,
    nixlRepostActiveError,
    nixlError,
    "The transfer is still in flight (NIXL_ERR_REPOST_ACTIVE)."
);
create_exception!(
    rdma_nixl._core,
    nixlNotSupportedError,
    nixlError,
    "The backend cannot do this (NIXL_ERR_NOT_SUPPORTED)."
);
create_exception!(
    rdma_nixl._core,
    nixlNotAllowedError,
    nixlError,
    "Not allowed in this state (NIXL_ERR_NOT_ALLOWED)."
);
create_exception!(
    rdma_nixl._core,
    nixlNoTelemetryError,
    nixlError,
    "Telemetry was not enabled (capture_telemetry=False)."
);
create_exception!(
    rdma_nixl._core,
    nixlUnknownError,
    nixlError,
    "An error this version does not classify (NIXL_ERR_UNKNOWN)."
);
create_exception!(
    rdma_nixl._core,
    nixlStalledError,
    nixlBackendError,
    "A transfer made no progress within the stall timeout (ours; a nixlBackendError)."
);
create_exception!(
    rdma_nixl._core,
    nixlTimeoutError,
    nixlBackendError,
    "A metadata exchange or connection timed out (ours; a nixlBackendError)."
);

/// Registers every exception class in the module.
pub fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("nixlError", py.get_type::<nixlError>())?;
    m.add(
        "nixlInvalidParamError",
        py.get_type::<nixlInvalidParamError>(),
    )?;
    m.add("nixlNotFoundError", py.get_type::<nixlNotFoundError>())?;
    m.add("nixlMismatchError", py.get_type::<nixlMismatchError>())?;
    m.add("nixlBackendError", py.get_type::<nixlBackendError>())?;
    m.add(
        "nixlRemoteDisconnectError",
        py.get_type::<nixlRemoteDisconnectError>(),
    )?;
    m.add("nixlCancelledError", py.get_type::<nixlCancelledError>())?;
    m.add("nixlNotPostedError", py.get_type::<nixlNotPostedError>())?;
    m.add(
        "nixlRepostActiveError",
        py.get_type::<nixlRepostActiveError>(),
    )?;
    m.add(
        "nixlNotSupportedError",
        py.get_type::<nixlNotSupportedError>(),
    )?;
    m.add("nixlNotAllowedError", py.get_type::<nixlNotAllowedError>())?;
    m.add(
        "nixlNoTelemetryError",
        py.get_type::<nixlNoTelemetryError>(),
    )?;
    m.add("nixlUnknownError", py.get_type::<nixlUnknownError>())?;
    m.add("nixlStalledError", py.get_type::<nixlStalledError>())?;
    m.add("nixlTimeoutError", py.get_type::<nixlTimeoutError>())?;
    Ok(())
}

/// The variant's name, for the exception's `kind` attribute.
fn kind_name(e: &nixl::Error) -> &'static str {
    use nixl::Error as E;
    match e {
        E::InvalidParam(_) => "InvalidParam",
        E::ZeroLength { .. } => "ZeroLength",
        E::Overflow { .. } => "Overflow",
        E::NotRegistered { .. } => "NotRegistered",
        E::Deregistered { .. } => "Deregistered",
        E::RemoteOutOfBounds { .. } => "RemoteOutOfBounds",
        E::UnknownAgent(_) => "UnknownAgent",
        E::UnknownBackend(_) => "UnknownBackend",
        E::UnsupportedMemKind { .. } => "UnsupportedMemKind",
        E::NoCommonBackend { .. } => "NoCommonBackend",
        E::Mismatch(_) => "Mismatch",
        E::MalformedMetadata(_) => "MalformedMetadata",
        E::RepostActive => "RepostActive",
        E::NotPosted => "NotPosted",
        E::RemoteDisconnect { .. } => "RemoteDisconnect",
        E::Stalled(_) => "Stalled",
        E::Canceled => "Canceled",
        E::Timeout(_) => "Timeout",
        E::Backend { .. } => "Backend",
        E::NotDeviceMemory { .. } => "NotDeviceMemory",
        E::Gpu(_) => "Gpu",
        E::Unreachable { .. } => "Unreachable",
        E::NotSupported { .. } => "NotSupported",
        E::Io(_) => "Io",
        E::MetadataRefused { .. } => "MetadataRefused",
        E::Unauthenticated(_) => "Unauthenticated",
        _ => "Unknown",
    }
}

/// The exception for an agent error: NIXL's class for the status NIXL returns in the
/// same situation (a descriptor-length mismatch is `NIXL_ERR_INVALID_PARAM` there,
/// unparsable metadata `NIXL_ERR_MISMATCH`, memory no backend registered
/// `NIXL_ERR_NOT_FOUND`), with the typed details as attributes.
pub fn to_py(e: nixl::Error) -> PyErr {
    use nixl::Error as E;
    let message = e.to_string();
    let err = match &e {
        E::InvalidParam(_)
        | E::ZeroLength { .. }
        | E::Overflow { .. }
        | E::Mismatch(_)
        | E::NotDeviceMemory { .. } => nixlInvalidParamError::new_err(message),
        E::NotRegistered { .. }
        | E::Deregistered { .. }
        | E::RemoteOutOfBounds { .. }
        | E::UnknownAgent(_)
        | E::UnknownBackend(_)
        | E::NoCommonBackend { .. } => nixlNotFoundError::new_err(message),
        E::UnsupportedMemKind { .. } | E::Unreachable { .. } | E::NotSupported { .. } => {
            nixlNotSupportedError::new_err(message)
        }
        E::MalformedMetadata(_) => nixlMismatchError::new_err(message),
        // Another incarnation's metadata under a bound name, or the agent's own name; a
        // peer that cannot prove the job token: NIXL's "not allowed".
        E::MetadataRefused { .. } | E::Unauthenticated(_) => nixlNotAllowedError::new_err(message),
        E::RepostActive => nixlRepostActiveError::new_err(message),
        E::NotPosted => nixlNotPostedError::new_err(message),
        E::RemoteDisconnect { .. } => nixlRemoteDisconnectError::new_err(message),
        E::Stalled(_) => nixlStalledError::new_err(message),
        E::Canceled => nixlCancelledError::new_err(message),
        E::Timeout(_) => nixlTimeoutError::new_err(message),
        E::Backend { .. } | E::Gpu(_) | E::Io(_) => nixlBackendError::new_err(message),
        _ => nixlUnknownError::new_err(message),
    };
    Python::attach(|py| {
        let value = err.value(py);
        // Attribute failures are ignored: the exception itself is what matters.
        let _ = value.setattr("kind", kind_name(&e));
        let (agent, backend, code): (Option<&str>, Option<&str>, Option<i64>) = match &e {
            E::RemoteDisconnect { agent, .. }
            | E::UnknownAgent(agent)
            | E::RemoteOutOfBounds { agent, .. }
            | E::NoCommonBackend { agent, .. }
            | E::MetadataRefused { agent, .. } => (Some(agent), None, None),
            E::Backend { backend, code, .. } => (None, Some(backend), Some(i64::from(*code))),
            E::Unreachable { backend, agent, .. } => (Some(agent), Some(backend), None),
            E::UnsupportedMemKind { backend, .. }
            | E::UnknownBackend(backend)
            | E::NotSupported { backend, .. } => (None, Some(backend), None),
            E::Io(io) => (None, None, io.raw_os_error().map(i64::from)),
            _ => (None, None, None),
        };
        let _ = value.setattr("agent", agent);
        let _ = value.setattr("backend", backend);
        let _ = value.setattr("code", code);
    });
    err
}

/// `?` on agent results inside `#[pymethods]`.
pub trait IntoPyResult<T> {
    /// Converts the error with [`to_py`].
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for nixl::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
