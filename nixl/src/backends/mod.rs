//! Backends the agent can create by name.

use crate::agent::Agent;
use crate::backend::{Backend, BackendParams};
use crate::error::Result;
use std::sync::Arc;

#[cfg(feature = "cuda")]
mod cuda_copy;
#[cfg(feature = "cuda")]
pub mod cuda_ipc;
pub mod fault;
#[cfg(feature = "file")]
pub mod file;
#[cfg(feature = "gpunetio")]
pub mod gpunetio;
pub(crate) mod heartbeat;
pub mod libfabric;
pub mod local;
pub(crate) mod shared;
pub mod staging;
pub mod verbs;

/// A constructor: the agent creating it and its string parameters.
pub type CreateBackend = fn(&Agent, &BackendParams) -> Result<Arc<dyn Backend>>;

/// Name → constructor, for [`Agent::create_backend`].
pub(crate) const AVAILABLE: &[(&str, CreateBackend)] = &[
    #[cfg(feature = "cuda")]
    (cuda_ipc::NAME, cuda_ipc::create),
    (fault::NAME, fault::create),
    #[cfg(feature = "file")]
    (file::NAME, file::create),
    #[cfg(feature = "gpunetio")]
    (gpunetio::NAME, gpunetio::create),
    (libfabric::NAME, libfabric::create),
    (local::NAME, local::create),
    (verbs::NAME, verbs::create),
];
