//! The facade that puts the built-in backends ([`crate::backends`]) behind
//! [`Agent::new`]: the only module that knows both the agent and the backends.

use crate::agent::{Agent, AgentConfig};
use crate::backend::{Backend, BackendParams};
use crate::error::{Error, Result};
use std::sync::Arc;

impl Agent {
    /// Creates an agent that builds the backends of this crate's enabled features
    /// ([`crate::backends::builtin_registry`]); starts the metadata listener if
    /// `config.listen_addr` is set. [`Agent::with_registry`] takes another registry.
    #[doc(alias = "nixlAgent")]
    pub fn new(name: impl Into<String>, config: AgentConfig) -> Result<Self> {
        Self::with_registry(name, config, crate::backends::builtin_registry())
    }

    /// Backend names [`Agent::create_backend`] knows in this build.
    #[doc(alias = "getAvailPlugins")]
    pub fn available_backends() -> Vec<&'static str> {
        crate::backends::builtin_registry().names()
    }

    /// Creates what NIXL's default backend (`UCX`, which picks shared memory, CUDA IPC
    /// or the network per peer) stands for in this build, with default parameters:
    /// `LIBFABRIC` (feature `libfabric`: shared memory to peers on this host, the NIC to
    /// others) and, with feature `cuda` and a GPU present, `CUDA_IPC` (VRAM to VRAM on
    /// this node). Transfers that name no backend then take the fastest of them for each
    /// pair of memory kinds and peer ([`Backend::prefers`], [`Backend::reach`]). Backends
    /// of these names that already exist are kept as they are. Returns the backends
    /// created.
    #[doc(alias = "UCX")]
    pub fn create_default_backends(&self) -> Result<Vec<Arc<dyn Backend>>> {
        let have: Vec<String> = self.backends().iter().map(|b| b.name().into()).collect();
        let candidates: &[Option<&str>] = &[
            #[cfg(feature = "libfabric")]
            Some(crate::backends::libfabric::NAME),
            #[cfg(feature = "cuda")]
            (gpu_mem::device_count() > 0).then_some(crate::backends::cuda_ipc::NAME),
        ];
        let wanted: Vec<&str> = candidates.iter().flatten().copied().collect();
        if wanted.is_empty() {
            return Err(Error::InvalidParam(
                "this build has no default backend (LIBFABRIC needs feature libfabric, \
                 CUDA_IPC feature cuda and a GPU): create one by name"
                    .into(),
            ));
        }
        let mut made = Vec::new();
        for name in wanted {
            if !have.iter().any(|h| h.eq_ignore_ascii_case(name)) {
                made.push(self.create_backend(name, &BackendParams::new())?);
            }
        }
        Ok(made)
    }
}
