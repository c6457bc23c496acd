//! The facade that puts the built-in backends ([`crate::backends`]) behind
//! [`Agent::new`]: the only module that knows both the agent and the backends.

use crate::agent::{Agent, AgentConfig};
use crate::error::Result;

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
}
