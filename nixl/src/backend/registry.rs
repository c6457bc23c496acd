//! How backends are built: the init value a constructor gets, and the registry of
//! constructors by name.
//!
//! A backend never sees the agent. Its constructor gets a [`BackendInit`]: the agent's
//! name, whether it runs progress threads, where its metadata listener is bound, the
//! string parameters, and the registry itself (for a backend that wraps another by name,
//! such as `FAULT`). This is NIXL's `nixlBackendInitParams` and plugin table.

use super::{Backend, BackendParams};
use crate::error::{Error, Result};
use std::net::SocketAddr;
use std::sync::Arc;

/// What a backend constructor gets (NIXL's `nixlBackendInitParams`).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BackendInit {
    /// The name of the agent the backend is created for (peers see it as the sender).
    pub agent_name: String,
    /// Whether the backend progresses transfers on its own threads (otherwise the owner's
    /// status polls progress them).
    pub progress_thread: bool,
    /// Where the agent's metadata listener is bound, if it runs one: a backend that
    /// chooses an interface may bind next to it.
    pub listen_addr: Option<SocketAddr>,
    /// The backend's string parameters.
    pub params: BackendParams,
    /// The constructors known where the backend is created (a wrapper such as `FAULT`
    /// builds the backend it wraps from here).
    pub registry: BackendRegistry,
}

impl BackendInit {
    /// An init value for agent `agent_name` with progress threads, no listener, no
    /// parameters and an empty registry; set the public fields as needed.
    pub fn new(agent_name: impl Into<String>) -> Self {
        Self {
            agent_name: agent_name.into(),
            progress_thread: true,
            listen_addr: None,
            params: BackendParams::new(),
            registry: BackendRegistry::new(),
        }
    }

    /// The same init value with other parameters (e.g. for a wrapped backend).
    pub fn with_params(&self, params: BackendParams) -> Self {
        Self {
            params,
            ..self.clone()
        }
    }
}

/// A backend constructor.
pub type CreateBackend = fn(&BackendInit) -> Result<Arc<dyn Backend>>;

/// Backend constructors by name (NIXL's plugin manager). Names compare ignoring ASCII
/// case, as NIXL's backend names are written in capitals by convention only.
#[derive(Clone, Default)]
pub struct BackendRegistry {
    entries: Vec<(&'static str, CreateBackend)>,
}

impl std::fmt::Debug for BackendRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl BackendRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a constructor; a name already present is refused.
    pub fn register(&mut self, name: &'static str, create: CreateBackend) -> Result<()> {
        if self.find(name).is_some() {
            return Err(Error::InvalidParam(format!(
                "a backend constructor named {name} is already registered"
            )));
        }
        self.entries.push((name, create));
        Ok(())
    }

    /// The names, in registration order.
    pub fn names(&self) -> Vec<&'static str> {
        self.entries.iter().map(|(name, _)| *name).collect()
    }

    /// Whether a constructor of this name is known.
    pub fn contains(&self, name: &str) -> bool {
        self.find(name).is_some()
    }

    /// Builds backend `name` from `init`; an unknown name is [`Error::UnknownBackend`].
    pub fn create(&self, name: &str, init: &BackendInit) -> Result<Arc<dyn Backend>> {
        let create = self
            .find(name)
            .ok_or_else(|| Error::UnknownBackend(name.to_string()))?;
        create(init)
    }

    fn find(&self, name: &str) -> Option<CreateBackend> {
        self.entries
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, create)| *create)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refuse(init: &BackendInit) -> Result<Arc<dyn Backend>> {
        Err(Error::InvalidParam(format!(
            "built for {} with {} parameters",
            init.agent_name,
            init.params.len()
        )))
    }

    #[test]
    fn the_registry_finds_constructors_by_name_ignoring_case_and_refuses_duplicates() {
        let mut registry = BackendRegistry::new();
        registry.register("MINE", refuse).unwrap();
        assert!(registry.register("mine", refuse).is_err());
        assert_eq!(registry.names(), vec!["MINE"]);
        assert!(registry.contains("Mine"));
        let init = BackendInit::new("a").with_params([("k".into(), "v".into())].into());
        let err = registry.create("mine", &init).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidParam(m) if m == "built for a with 1 parameters"),
            "{err}"
        );
        let err = registry.create("OTHER", &init).unwrap_err();
        assert!(
            matches!(&err, Error::UnknownBackend(n) if n == "OTHER"),
            "{err}"
        );
    }
}
