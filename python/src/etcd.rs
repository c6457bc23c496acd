//! NIXL's central metadata store from Python: with `NIXL_ETCD_ENDPOINTS` set when the
//! agent is created, the metadata calls without an IP address (`sendLocalMD`,
//! `sendLocalPartialMD` with a label, `fetchRemoteMD`, `invalidateLocalMD`) go to etcd
//! through [`nixl::etcd::EtcdMetadata`] (same keys as NIXL:
//! `{NIXL_ETCD_NAMESPACE}/{agent}/{label}`).
//!
//! As in NIXL, creating the agent does no I/O: the client connects at the first call
//! that needs the store, and again at the next one if that failed, so a store that is
//! down at start-up does not fail the agent. Every call is bounded by the agent's
//! `etcdWatchTimeout`: an unreachable store is a `nixlBackendError` (a
//! `nixlTimeoutError`, which is one, when it does not answer at all), never a hang.
//!
//! Publishing and invalidating are synchronous (done, or raised, when the call returns).
//! Fetching loads a key that is already there before returning; a key that is not there
//! yet is waited for in the background (NIXL's fetch is asynchronous: the caller polls
//! `checkRemoteMD`), for up to the timeout, and a failure then is logged, as NIXL logs it.

use nixl::{Agent as RustAgent, DescList};
#[cfg(feature = "etcd")]
use parking_lot::Mutex;
#[cfg(feature = "etcd")]
use std::sync::Arc;
use std::time::Duration;

/// Whether this build has the etcd client (the `etcd` feature).
pub const AVAILABLE: bool = cfg!(feature = "etcd");

/// An agent's way to etcd: the configuration read when the agent was created, and the
/// client once connected.
#[cfg(feature = "etcd")]
#[derive(Debug)]
pub struct Store {
    config: nixl::etcd::EtcdConfig,
    client: Mutex<Option<Arc<nixl::etcd::EtcdMetadata>>>,
}

/// Without the `etcd` feature no store can exist (whatever the environment says).
#[cfg(not(feature = "etcd"))]
#[derive(Debug)]
pub enum Store {}

/// How a fetch went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "etcd"), allow(dead_code))] // no fetch happens without etcd
pub enum Fetched {
    /// The metadata is loaded.
    Loaded,
    /// Not published yet: a background thread waits for it (up to the timeout).
    Waiting,
}

#[cfg(feature = "etcd")]
impl Store {
    /// The store named by `NIXL_ETCD_ENDPOINTS` / `NIXL_ETCD_NAMESPACE`, or `None` when no
    /// endpoint is set. `timeout` bounds every request and a fetch's wait.
    pub fn from_env(timeout: Duration) -> Option<Self> {
        let mut config = nixl::etcd::EtcdConfig::from_env()?;
        config.timeout = timeout;
        Some(Self {
            config,
            client: Mutex::new(None),
        })
    }

    /// The connected client, connecting first if needed.
    fn client(&self, agent: &RustAgent) -> nixl::Result<Arc<nixl::etcd::EtcdMetadata>> {
        // Held while connecting so that concurrent first calls make one client.
        let mut client = self.client.lock();
        if let Some(c) = client.as_ref() {
            return Ok(c.clone());
        }
        let connected = Arc::new(nixl::etcd::EtcdMetadata::connect(
            agent,
            self.config.clone(),
        )?);
        *client = Some(connected.clone());
        Ok(connected)
    }

    /// Publishes the full metadata (`{agent}/metadata`).
    pub fn publish(&self, agent: &RustAgent) -> nixl::Result<()> {
        self.client(agent)?.publish()
    }

    /// Publishes partial metadata under `label` (required, as in NIXL).
    pub fn publish_partial(
        &self,
        agent: &RustAgent,
        label: &str,
        list: Option<&DescList>,
        inc_conn_info: bool,
    ) -> nixl::Result<()> {
        if label.is_empty() {
            return Err(nixl::Error::InvalidParam(
                "a metadata label is required to send partial metadata to etcd".into(),
            ));
        }
        self.client(agent)?
            .publish_partial(label, list, inc_conn_info)
    }

    /// Fetches `remote`'s metadata (`label`, or the full metadata when empty) and
    /// watches the peer: its keys deleted invalidate it, a republication reloads it.
    pub fn fetch(&self, agent: &RustAgent, remote: &str, label: &str) -> nixl::Result<Fetched> {
        let client = self.client(agent)?;
        let label = if label.is_empty() {
            nixl::etcd::DEFAULT_LABEL
        } else {
            label
        };
        // A keys-only listing answers at once: a published key is loaded now, and an
        // unreachable store is an error here rather than a line in the log.
        if client.labels(remote)?.iter().any(|l| l == label) {
            client.fetch_partial(remote, label)?;
            return Ok(Fetched::Loaded);
        }
        let (remote, label) = (remote.to_string(), label.to_string());
        std::thread::Builder::new()
            .name(format!("nixl-etcd-fetch-{remote}"))
            .spawn(move || match client.fetch_partial(&remote, &label) {
                Ok(_) => tracing::debug!(peer = %remote, label, "etcd: fetched after waiting"),
                Err(e) => {
                    tracing::error!(peer = %remote, label, error = %e, "etcd: fetching metadata failed")
                }
            })?;
        Ok(Fetched::Waiting)
    }

    /// Removes every key of this agent. Nothing published yet (no client): nothing to
    /// remove, as in NIXL.
    pub fn unpublish(&self) -> nixl::Result<()> {
        let client = self.client.lock().clone();
        match client {
            Some(client) => client.unpublish(),
            None => Ok(()),
        }
    }

    /// Disconnects: the lease is revoked, so this agent's keys go (peers watching it
    /// invalidate it).
    pub fn close(&self) {
        drop(self.client.lock().take());
    }
}

#[cfg(not(feature = "etcd"))]
impl Store {
    /// `None`: this build has no etcd client.
    pub fn from_env(_timeout: Duration) -> Option<Self> {
        None
    }

    pub fn publish(&self, _agent: &RustAgent) -> nixl::Result<()> {
        match *self {}
    }

    pub fn publish_partial(
        &self,
        _agent: &RustAgent,
        _label: &str,
        _list: Option<&DescList>,
        _inc_conn_info: bool,
    ) -> nixl::Result<()> {
        match *self {}
    }

    pub fn fetch(&self, _agent: &RustAgent, _remote: &str, _label: &str) -> nixl::Result<Fetched> {
        match *self {}
    }

    pub fn unpublish(&self) -> nixl::Result<()> {
        match *self {}
    }

    pub fn close(&self) {
        match *self {}
    }
}
