//! The etcd metadata service (feature `etcd`): NIXL's central metadata store.
//!
//! The peer-to-peer exchange ([`Agent::send_local_metadata`],
//! [`Agent::fetch_remote_metadata`]) stays the default; this is used only when asked for,
//! typically when [`EtcdConfig::from_env`] finds `NIXL_ETCD_ENDPOINTS`.
//!
//! # Keys
//! As in NIXL, every key is `{namespace}/{agent}/{label}`:
//! - `{namespace}/{agent}/` (empty label, empty value): the presence key, written on the
//!   first publish;
//! - `{namespace}/{agent}/metadata` ([`DEFAULT_LABEL`]): the full metadata
//!   ([`EtcdMetadata::publish`]);
//! - `{namespace}/{agent}/{label}`: partial metadata ([`EtcdMetadata::publish_partial`]).
//!
//! The namespace is `NIXL_ETCD_NAMESPACE`, default `/nixl/agents` ([`DEFAULT_NAMESPACE`];
//! a trailing `/` is ignored). Values are the agent's binary metadata
//! ([`crate::metadata`]); etcd's default request limit (1.5 MiB, server flag
//! `--max-request-bytes`) bounds the metadata size, about 35,000 regions.
//!
//! # Integrity
//! A value carries the metadata's own integrity check (CRC-32C over the whole blob, see
//! [`crate::metadata`]), so a value corrupted in the store or on the way is never taken
//! at face value: [`EtcdMetadata::fetch`] and [`EtcdMetadata::fetch_partial`] refuse it
//! with [`crate::Error::MalformedMetadata`] and load nothing, and a watch that sees a
//! corrupted republication logs and ignores it (the peer stays as it was loaded).
//!
//! # Liveness and invalidation
//! Every key this client writes is attached to a lease it keeps alive
//! ([`EtcdConfig::lease_ttl`]): when the client is dropped the lease is revoked, and when
//! the process dies the lease expires, so the agent's keys disappear either way.
//! [`EtcdMetadata::fetch`] also starts a watch on the peer's prefix, served by the
//! client's own runtime thread:
//! - a deleted key (the peer left: [`EtcdMetadata::unpublish`], its client dropped, its
//!   lease expired) → [`Agent::invalidate_remote`]: in-flight requests to it fail with
//!   [`crate::Error::RemoteDisconnect`] at their next poll;
//! - a new value of its full metadata, or of a label this client fetched (the peer
//!   republished, e.g. after a restart) → [`Agent::load_remote_metadata`]: a new
//!   incarnation replaces the old connection and new requests reach it, with no call by
//!   the application.
//!
//! # When etcd members fail
//! A client given several endpoints spreads its requests over them; a request that went
//! to a member that does not answer (dead, restarting, or without a leader) is sent again
//! (reaching one that does) until [`EtcdConfig::timeout`] ends it. The lease keep-alive
//! and the watches are long-lived streams on one connection: when one ends (its member
//! died or restarted), it is opened again (on any member that answers), with a growing
//! pause (up to [`RECONNECT_PAUSE_MAX`]) while none does:
//! - the keep-alive resumes with the same lease; if that lease expired meanwhile (etcd
//!   was unreachable for longer than the TTL), a new lease is taken and every key this
//!   client published is written again under it (peers watching see a republication);
//! - a watch resumes from the revision after the last event it handled, so no deletion
//!   or republication in between is missed (where etcd compacted that history, it
//!   resumes from the oldest revision kept).
//!
//! Requests made while no member answers fail with [`crate::Error::Timeout`] or
//! [`crate::Error::Backend`] (`backend: "etcd"`) within [`EtcdConfig::timeout`], and
//! work again once one does.
//!
//! # Authentication
//! etcd's own user/password authentication ([`EtcdConfig::credentials`];
//! `NIXL_ETCD_USERNAME`, `NIXL_ETCD_PASSWORD`): the client authenticates when it
//! connects and every request carries the token etcd issued. Refused credentials are
//! [`crate::Error::Unauthenticated`] within [`EtcdConfig::timeout`]: wrong ones when
//! connecting; none where the server requires them at the first request on keys (etcd
//! grants leases to anyone); a namespace the user's role does not grant likewise.
//!
//! What each mode protects against:
//! - Without authentication (etcd's default), anyone who can reach etcd's client port can
//!   read every agent's metadata (its addresses and remote keys), publish metadata under
//!   any name — which peers fetching or watching that name load — and delete an agent's
//!   keys, which makes every watching peer invalidate it.
//! - With authentication enabled on the server (`etcdctl auth enable`) and a user whose
//!   role grants read-write on the namespace prefix, only holders of a password can do
//!   any of that. Give each job its own user and namespace (roles grant key prefixes) so
//!   that one job's agents cannot rewrite another's. Every agent of a job holds the same
//!   password, so a member can still publish under another member's name; the binding of
//!   names to their first connection information (see [`Agent::load_remote_metadata`])
//!   still applies to what a watch loads.
//! - Not encryption: this client speaks plain gRPC (no TLS in this build), so the
//!   password at connection, the token and the metadata cross the network in clear, and
//!   an attacker on the path can read them or replay the token until it expires. Run etcd
//!   on a private network or behind a tunnel where that matters; the password in the
//!   environment is readable by the same user and root, like `NIXL_JOB_TOKEN`.
//!
//! # Threads
//! The client owns a small tokio runtime (one worker thread) that runs the etcd client,
//! the lease keep-alive and the watches. Its methods block the calling thread (each
//! request bounded by [`EtcdConfig::timeout`]); do not call them from inside an async
//! runtime's worker thread.

use crate::agent::{Agent, AgentInner};
use crate::error::{Error, Result};
use crate::mem::DescList;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Environment variable with the comma-separated etcd endpoints (e.g.
/// `http://127.0.0.1:2379`).
pub const ENDPOINTS_ENV: &str = "NIXL_ETCD_ENDPOINTS";
/// Environment variable with the key namespace.
pub const NAMESPACE_ENV: &str = "NIXL_ETCD_NAMESPACE";
/// Longest pause between attempts to reopen a keep-alive or watch stream while no etcd
/// member answers.
pub const RECONNECT_PAUSE_MAX: Duration = Duration::from_secs(1);
/// First pause between those attempts (doubling up to [`RECONNECT_PAUSE_MAX`]).
const RECONNECT_PAUSE_MIN: Duration = Duration::from_millis(50);

/// Environment variable with the etcd user name (etcd authentication).
pub const USERNAME_ENV: &str = "NIXL_ETCD_USERNAME";
/// Environment variable with the etcd user's password.
pub const PASSWORD_ENV: &str = "NIXL_ETCD_PASSWORD";
/// NIXL's default namespace.
pub const DEFAULT_NAMESPACE: &str = "/nixl/agents";
/// The label of the full metadata (NIXL's `default_metadata_label`).
pub const DEFAULT_LABEL: &str = "metadata";

/// How to reach etcd and lay out the keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Endpoints (`host:port` or `http://host:port`).
    pub endpoints: Vec<String>,
    /// Key prefix, without a trailing `/`.
    pub namespace: String,
    /// Bound on connecting, on each request, and on how long a fetch waits for a key
    /// that is not there yet (NIXL's `etcdWatchTimeout`, 5 s).
    pub timeout: Duration,
    /// TTL of the lease this client's keys are attached to; `None`: keys without a lease
    /// (they stay after a crash, as in NIXL).
    pub lease_ttl: Option<Duration>,
    /// etcd user and password (see "Authentication" in the module documentation); `None`:
    /// no authentication.
    pub credentials: Option<EtcdCredentials>,
}

/// An etcd user name and its password. `Debug` does not show the password.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdCredentials {
    /// The etcd user.
    pub user: String,
    /// Its password.
    pub password: String,
}

impl EtcdCredentials {
    /// Credentials of `user` with `password`.
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Self {
        Self {
            user: user.into(),
            password: password.into(),
        }
    }
}

impl std::fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl EtcdConfig {
    /// A configuration for `endpoints` with the defaults: namespace `/nixl/agents`, 5 s
    /// timeout, 10 s lease.
    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            namespace: DEFAULT_NAMESPACE.to_string(),
            timeout: Duration::from_secs(5),
            lease_ttl: Some(Duration::from_secs(10)),
            credentials: None,
        }
    }

    /// From `NIXL_ETCD_ENDPOINTS`, `NIXL_ETCD_NAMESPACE`, and `NIXL_ETCD_USERNAME` with
    /// `NIXL_ETCD_PASSWORD` (a user without a password is sent with an empty one; a
    /// password without a user is ignored with a warning); `None` when no endpoint is set
    /// (the peer-to-peer exchange is then the way).
    pub fn from_env() -> Option<Self> {
        Self::from_lookup(|key| std::env::var(key).ok())
    }

    /// [`EtcdConfig::from_env`] with the variables read through `lookup`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let endpoints: Vec<String> = lookup(ENDPOINTS_ENV)?
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .collect();
        if endpoints.is_empty() {
            return None;
        }
        let mut config = Self::new(endpoints);
        if let Some(ns) = lookup(NAMESPACE_ENV).filter(|ns| !ns.is_empty()) {
            config.namespace = ns;
        }
        let password = lookup(PASSWORD_ENV);
        match lookup(USERNAME_ENV).filter(|u| !u.is_empty()) {
            Some(user) => {
                config.credentials = Some(EtcdCredentials::new(user, password.unwrap_or_default()))
            }
            None if password.is_some() => {
                tracing::warn!(
                    "{PASSWORD_ENV} is set but {USERNAME_ENV} is not: no etcd authentication"
                )
            }
            None => {}
        }
        Some(config)
    }

    fn prefix(&self) -> &str {
        self.namespace.trim_end_matches('/')
    }

    /// The key of `agent`'s `label` (`""`: the presence key).
    pub fn key(&self, agent: &str, label: &str) -> String {
        format!("{}/{agent}/{label}", self.prefix())
    }
}

/// A watch on one peer's keys.
#[derive(Debug)]
struct PeerWatch {
    task: tokio::task::JoinHandle<()>,
    /// Partial labels fetched for this peer: their new values are loaded too.
    labels: Arc<Mutex<HashSet<String>>>,
}

/// A connection to etcd on behalf of one agent (NIXL's etcd metadata backend).
pub struct EtcdMetadata {
    agent: Weak<AgentInner>,
    name: String,
    config: EtcdConfig,
    runtime: Option<tokio::runtime::Runtime>,
    client: Client,
    /// The lease every key is written under (0: none); replaced by the keep-alive task
    /// when the lease expired while etcd was unreachable.
    lease: Arc<AtomicI64>,
    /// What this client published (key → value, the presence key included), written
    /// again under a new lease when the old one expired.
    published: Arc<Mutex<BTreeMap<String, Vec<u8>>>>,
    keep_alive: Option<tokio::task::JoinHandle<()>>,
    watches: Mutex<HashMap<String, PeerWatch>>,
    announced: Mutex<bool>,
}

impl std::fmt::Debug for EtcdMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdMetadata")
            .field("agent", &self.name)
            .field("config", &self.config)
            .field("lease", &self.lease.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// etcd's error for `what`: [`Error::Unauthenticated`] where etcd refused this client's
/// credentials or their absence, else a backend error.
fn etcd_error(what: &str, e: etcd_client::Error) -> Error {
    if let etcd_client::Error::GRpcStatus(status) = &e {
        // gRPC codes: 3 InvalidArgument (etcd's ErrAuthFailed, ErrUserEmpty), 7
        // PermissionDenied, 16 Unauthenticated (an invalid or expired token).
        let code = i32::from(status.code());
        let message = status.message();
        let refused = matches!(code, 7 | 16)
            || (code == 3
                && (message.contains("authentication failed")
                    || message.contains("user name is empty")
                    || message.contains("user name not found")));
        if refused {
            return Error::Unauthenticated(format!(
                "etcd {what}: {message} (credentials: NIXL_ETCD_USERNAME and \
                 NIXL_ETCD_PASSWORD, EtcdConfig::credentials)"
            ));
        }
    }
    Error::Backend {
        backend: "etcd".into(),
        code: 0,
        message: format!("{what}: {e}"),
    }
}

fn check_name(name: &str) -> Result<()> {
    if name.contains('/') {
        return Err(Error::InvalidParam(format!(
            "`{name}`: agent names and labels used with etcd cannot contain `/`"
        )));
    }
    Ok(())
}

impl EtcdMetadata {
    /// Connects (bounded by `config.timeout`) on behalf of `agent`, and takes the lease.
    pub fn connect(agent: &Agent, config: EtcdConfig) -> Result<Self> {
        check_name(agent.name())?;
        if config.endpoints.is_empty() {
            return Err(Error::InvalidParam("no etcd endpoint given".into()));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(format!("nixl-etcd-{}", agent.name()))
            .enable_all()
            .build()?;
        let timeout = config.timeout;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        if let Some(c) = &config.credentials {
            options = options.with_user(c.user.clone(), c.password.clone());
        }
        let endpoints = config.endpoints.clone();
        let client = bounded(&runtime, timeout, "connecting to etcd", async move {
            Client::connect(endpoints, Some(options))
                .await
                .map_err(|e| etcd_error("connect", e))
        })?;
        let mut this = Self {
            agent: Arc::downgrade(&agent.inner),
            name: agent.name().to_string(),
            config,
            runtime: Some(runtime),
            client,
            lease: Arc::new(AtomicI64::new(0)),
            published: Arc::new(Mutex::new(BTreeMap::new())),
            keep_alive: None,
            watches: Mutex::new(HashMap::new()),
            announced: Mutex::new(false),
        };
        if let Some(ttl) = this.config.lease_ttl {
            this.take_lease(ttl)?;
        }
        Ok(this)
    }

    /// Connects with [`EtcdConfig::from_env`]; `Ok(None)` when `NIXL_ETCD_ENDPOINTS` is
    /// not set.
    pub fn from_env(agent: &Agent) -> Result<Option<Self>> {
        EtcdConfig::from_env()
            .map(|config| Self::connect(agent, config))
            .transpose()
    }

    /// The configuration in use.
    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("runtime lives until drop")
    }

    fn block<T>(&self, what: &str, fut: impl Future<Output = Result<T>>) -> Result<T> {
        bounded(self.runtime(), self.config.timeout, what, fut)
    }

    fn take_lease(&mut self, ttl: Duration) -> Result<()> {
        let secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let client = self.client.clone();
        let id = self.block("taking an etcd lease", async move {
            retry_unreachable(|| {
                let mut client = client.clone();
                async move { client.lease_grant(secs, None).await }
            })
            .await
            .map(|lease| lease.id())
            .map_err(|e| etcd_error("lease grant", e))
        })?;
        self.lease.store(id, Ordering::Release);
        self.keep_alive = Some(self.runtime().spawn(keep_lease_alive(
            self.client.clone(),
            self.name.clone(),
            secs,
            self.lease.clone(),
            self.published.clone(),
        )));
        Ok(())
    }

    fn put_options(&self) -> Option<PutOptions> {
        let id = self.lease.load(Ordering::Acquire);
        (id != 0).then(|| PutOptions::new().with_lease(id))
    }

    fn put(&self, label: &str, value: Vec<u8>) -> Result<()> {
        let client = self.client.clone();
        let presence = {
            let mut announced = self.announced.lock();
            let first = !*announced;
            *announced = true;
            first.then(|| self.config.key(&self.name, ""))
        };
        let key = self.config.key(&self.name, label);
        let options = self.put_options();
        // Remembered before the request: a lease that expires while it is in flight has
        // its keys written again by the keep-alive task, this one included.
        {
            let mut published = self.published.lock();
            published.insert(self.config.key(&self.name, ""), Vec::new());
            published.insert(key.clone(), value.clone());
        }
        let result = self.block("publishing to etcd", async move {
            if let Some(presence) = presence {
                retry_unreachable(|| {
                    let (mut client, presence, options) =
                        (client.clone(), presence.clone(), options.clone());
                    async move { client.put(presence, Vec::new(), options).await }
                })
                .await
                .map_err(|e| etcd_error("put presence key", e))?;
            }
            retry_unreachable(|| {
                let (mut client, key, value, options) =
                    (client.clone(), key.clone(), value.clone(), options.clone());
                async move { client.put(key, value, options).await }
            })
            .await
            .map_err(|e| etcd_error("put metadata", e))?;
            Ok(())
        });
        if result.is_err() {
            *self.announced.lock() = false;
        }
        result
    }

    fn agent(&self) -> Result<Agent> {
        self.agent
            .upgrade()
            .map(|inner| inner.agent())
            .ok_or(Error::Canceled)
    }

    /// Publishes this agent's full metadata under `{namespace}/{agent}/metadata`
    /// (NIXL's `sendLocalMD` without an IP address).
    #[doc(alias = "sendLocalMD")]
    pub fn publish(&self) -> Result<()> {
        let md = self.agent()?.local_metadata()?;
        self.put(DEFAULT_LABEL, md)
    }

    /// Publishes partial metadata (see [`Agent::local_partial_metadata`]) under
    /// `{namespace}/{agent}/{label}` (NIXL's `sendLocalPartialMD` with `metadataLabel`).
    #[doc(alias = "sendLocalPartialMD")]
    pub fn publish_partial(
        &self,
        label: &str,
        list: Option<&DescList>,
        include_conn_info: bool,
    ) -> Result<()> {
        if label.is_empty() || label == DEFAULT_LABEL {
            return Err(Error::InvalidParam(format!(
                "a partial metadata label must be non-empty and not `{DEFAULT_LABEL}`"
            )));
        }
        check_name(label)?;
        let md = self
            .agent()?
            .local_partial_metadata(list, include_conn_info)?;
        self.put(label, md)
    }

    /// Removes every key of this agent (NIXL's `invalidateLocalMD`): peers watching it
    /// invalidate it.
    #[doc(alias = "invalidateLocalMD")]
    pub fn unpublish(&self) -> Result<()> {
        let client = self.client.clone();
        let prefix = self.config.key(&self.name, "");
        *self.announced.lock() = false;
        self.published.lock().clear();
        self.block("removing keys from etcd", async move {
            retry_unreachable(|| {
                let (mut client, prefix) = (client.clone(), prefix.clone());
                let options = etcd_client::DeleteOptions::new().with_prefix();
                async move { client.delete(prefix, Some(options)).await }
            })
            .await
            .map_err(|e| etcd_error("delete", e))?;
            Ok(())
        })
    }

    /// Fetches `remote`'s full metadata, waiting up to [`EtcdConfig::timeout`] for it to
    /// be published, loads it, and watches the peer (see the module documentation).
    /// Returns the peer's name.
    #[doc(alias = "fetchRemoteMD")]
    pub fn fetch(&self, remote: &str) -> Result<String> {
        self.fetch_label(remote, DEFAULT_LABEL)
    }

    /// Fetches and loads `remote`'s partial metadata published under `label`; later
    /// values of that label are loaded by the watch too.
    pub fn fetch_partial(&self, remote: &str, label: &str) -> Result<String> {
        if label.is_empty() {
            return Err(Error::InvalidParam("empty metadata label".into()));
        }
        self.fetch_label(remote, label)
    }

    fn fetch_label(&self, remote: &str, label: &str) -> Result<String> {
        check_name(remote)?;
        check_name(label)?;
        let agent = self.agent()?;
        let key = self.config.key(remote, label);
        let mut client = self.client.clone();
        let wait_key = key.clone();
        let (blob, revision) = self.block(&format!("waiting for `{key}` in etcd"), async move {
            let got = retry_unreachable(|| {
                let (mut client, key) = (client.clone(), wait_key.clone());
                async move { client.get(key, None).await }
            })
            .await
            .map_err(|e| etcd_error("get", e))?;
            let revision = got.header().map_or(0, |h| h.revision());
            if let Some(kv) = got.kvs().first().filter(|kv| !kv.value().is_empty()) {
                return Ok((kv.value().to_vec(), revision));
            }
            // Not there yet: wait for it (NIXL's fetchOrWaitForMetadata).
            let mut stream = client
                .watch(
                    wait_key.clone(),
                    Some(WatchOptions::new().with_start_revision(revision + 1)),
                )
                .await
                .map_err(|e| etcd_error("watch", e))?;
            loop {
                let Some(msg) = stream.message().await.map_err(|e| etcd_error("watch", e))? else {
                    return Err(etcd_error(
                        "watch",
                        etcd_client::Error::WatchError("stream ended".into()),
                    ));
                };
                for event in msg.events() {
                    if event.event_type() == EventType::Put {
                        if let Some(kv) = event.kv().filter(|kv| !kv.value().is_empty()) {
                            return Ok((kv.value().to_vec(), kv.mod_revision()));
                        }
                    }
                }
            }
        })?;
        let meta = crate::metadata::AgentMetadata::decode(&blob)?;
        if meta.agent != remote {
            return Err(Error::MalformedMetadata(format!(
                "`{key}` holds the metadata of `{}`",
                meta.agent
            )));
        }
        let name = agent.load_remote_metadata(&blob)?;
        self.watch_peer(remote, label, revision + 1);
        Ok(name)
    }

    /// The labels `agent` has published (`""` is its presence key), sorted.
    pub fn labels(&self, agent: &str) -> Result<Vec<String>> {
        check_name(agent)?;
        let prefix = self.config.key(agent, "");
        let client = self.client.clone();
        let keys = self.block("listing etcd keys", async move {
            let got = retry_unreachable(|| {
                let (mut client, prefix) = (client.clone(), prefix.clone());
                let options = GetOptions::new().with_prefix().with_keys_only();
                async move { client.get(prefix, Some(options)).await }
            })
            .await
            .map_err(|e| etcd_error("get", e))?;
            Ok(got
                .kvs()
                .iter()
                .filter_map(|kv| {
                    kv.key_str()
                        .ok()
                        .and_then(|k| k.strip_prefix(prefix.as_str()))
                        .map(str::to_string)
                })
                .collect::<Vec<_>>())
        })?;
        let mut keys = keys;
        keys.sort();
        Ok(keys)
    }

    /// The peers watched (those fetched), sorted.
    pub fn watched(&self) -> Vec<String> {
        let watches = self.watches.lock();
        let mut names: Vec<String> = watches
            .iter()
            .filter(|(_, w)| !w.task.is_finished())
            .map(|(n, _)| n.clone())
            .collect();
        names.sort();
        names
    }

    /// Stops watching `remote` (its metadata stays loaded).
    pub fn unwatch(&self, remote: &str) {
        if let Some(w) = self.watches.lock().remove(remote) {
            w.task.abort();
        }
    }

    fn watch_peer(&self, remote: &str, label: &str, from_revision: i64) {
        let mut watches = self.watches.lock();
        if let Some(w) = watches.get(remote).filter(|w| !w.task.is_finished()) {
            w.labels.lock().insert(label.to_string());
            return;
        }
        let labels = Arc::new(Mutex::new(HashSet::from([label.to_string()])));
        let task = self.runtime().spawn(watch_loop(
            self.client.clone(),
            self.config.key(remote, ""),
            remote.to_string(),
            labels.clone(),
            self.agent.clone(),
            from_revision,
        ));
        watches.insert(remote.to_string(), PeerWatch { task, labels });
    }
}

/// Whether `e` says the member the request went to did not answer (it died, restarted,
/// or is between leaders): another attempt may reach one that does.
fn member_unreachable(e: &etcd_client::Error) -> bool {
    // gRPC status 14, UNAVAILABLE: what a dead connection, a refused connect and "no
    // leader" come back as.
    const UNAVAILABLE: i32 = 14;
    match e {
        etcd_client::Error::GRpcStatus(status) => status.code() as i32 == UNAVAILABLE,
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// Runs the request `attempt` makes until it succeeds, fails otherwise than by an
/// unreachable member, or the caller's bound ([`bounded`]) ends the wait: with several
/// endpoints, a request that went to a dead member is sent again (to one that answers).
async fn retry_unreachable<T, F, Fut>(mut attempt: F) -> std::result::Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    let mut pause = RECONNECT_PAUSE_MIN;
    loop {
        match attempt().await {
            Err(e) if member_unreachable(&e) => {
                tracing::debug!(error = %e, "etcd member unreachable: trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
            }
            other => return other,
        }
    }
}

/// Runs `fut` on the runtime, bounded by `timeout`.
fn bounded<T>(
    runtime: &tokio::runtime::Runtime,
    timeout: Duration,
    what: &str,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    runtime
        .block_on(async { tokio::time::timeout(timeout, fut).await })
        .unwrap_or_else(|_| Err(Error::Timeout(format!("{what} (after {timeout:?})"))))
}

/// Keeps lease `lease` alive for as long as the client lives: the keep-alive stream is
/// opened again whenever it ends (its member died); a lease that expired meanwhile is
/// replaced by a new one of `ttl_secs`, under which every key of `published` is written
/// again.
async fn keep_lease_alive(
    mut client: Client,
    name: String,
    ttl_secs: i64,
    lease: Arc<AtomicI64>,
    published: Arc<Mutex<BTreeMap<String, Vec<u8>>>>,
) {
    let ttl = Duration::from_secs(ttl_secs.unsigned_abs());
    let period = (ttl / 3).max(Duration::from_millis(200));
    // A keep-alive unanswered for this long: its connection is presumed dead.
    let answer_bound = (ttl / 3).max(Duration::from_millis(500));
    let mut pause = RECONNECT_PAUSE_MIN;
    loop {
        let id = lease.load(Ordering::Acquire);
        match client.lease_keep_alive(id).await {
            Ok((mut keeper, mut stream)) => loop {
                let answer = tokio::time::timeout(answer_bound, async {
                    keeper.keep_alive().await?;
                    stream.message().await
                })
                .await;
                match answer {
                    Ok(Ok(Some(reply))) if reply.ttl() > 0 => {
                        pause = RECONNECT_PAUSE_MIN;
                        tokio::time::sleep(period).await;
                    }
                    Ok(Ok(Some(_))) => {
                        tracing::warn!(agent = %name, lease = id, "etcd lease expired while etcd was unreachable: taking a new one and publishing again");
                        renew_lease(&mut client, &name, ttl_secs, &lease, &published).await;
                        break;
                    }
                    Ok(Ok(None)) => {
                        tracing::warn!(agent = %name, "etcd lease keep-alive stream ended: reopening");
                        break;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(agent = %name, error = %e, "etcd lease keep-alive failed: reopening");
                        break;
                    }
                    Err(_) => {
                        tracing::warn!(agent = %name, "etcd lease keep-alive unanswered: reopening");
                        break;
                    }
                }
            },
            Err(e) => {
                tracing::debug!(agent = %name, error = %e, "etcd lease keep-alive cannot open yet");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
    }
}

/// Takes a new lease and writes every published key under it (a failure is logged; the
/// keep-alive loop tries again).
async fn renew_lease(
    client: &mut Client,
    name: &str,
    ttl_secs: i64,
    lease: &AtomicI64,
    published: &Mutex<BTreeMap<String, Vec<u8>>>,
) {
    let id = match client.lease_grant(ttl_secs, None).await {
        Ok(granted) => granted.id(),
        Err(e) => {
            tracing::warn!(agent = %name, error = %e, "etcd lease grant failed");
            return;
        }
    };
    lease.store(id, Ordering::Release);
    let keys: Vec<(String, Vec<u8>)> = published
        .lock()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (key, value) in keys {
        let options = PutOptions::new().with_lease(id);
        if let Err(e) = client.put(key.clone(), value, Some(options)).await {
            tracing::warn!(agent = %name, key, error = %e, "etcd: publishing again failed");
        }
    }
}

/// Serves one peer's watch: deletions invalidate it, new metadata is loaded. A stream
/// that ends (its member died) is opened again from the revision after the last event
/// handled.
async fn watch_loop(
    mut client: Client,
    prefix: String,
    remote: String,
    labels: Arc<Mutex<HashSet<String>>>,
    agent: Weak<AgentInner>,
    from_revision: i64,
) {
    let mut next_revision = from_revision;
    let mut pause = RECONNECT_PAUSE_MIN;
    loop {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(next_revision);
        match client.watch(prefix.clone(), Some(options)).await {
            Ok(mut stream) => loop {
                let msg = match stream.message().await {
                    Ok(Some(msg)) => msg,
                    Ok(None) => {
                        tracing::warn!(peer = %remote, "etcd watch ended: reopening");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(peer = %remote, error = %e, "etcd watch failed: reopening");
                        break;
                    }
                };
                if msg.canceled() {
                    if msg.compact_revision() > next_revision {
                        // The history from `next_revision` on is gone: resume from what
                        // is kept.
                        next_revision = msg.compact_revision();
                    }
                    tracing::warn!(peer = %remote, reason = msg.cancel_reason(), "etcd watch canceled: reopening");
                    break;
                }
                pause = RECONNECT_PAUSE_MIN;
                let Some(agent) = agent.upgrade().map(|inner| inner.agent()) else {
                    return;
                };
                if agent.is_shut_down() {
                    return;
                }
                for event in msg.events() {
                    let Some(kv) = event.kv() else { continue };
                    next_revision = next_revision.max(kv.mod_revision() + 1);
                    handle_event(&agent, &remote, &prefix, &labels, event.event_type(), kv);
                }
            },
            Err(e) => {
                tracing::debug!(peer = %remote, error = %e, "etcd watch cannot open yet");
            }
        }
        match agent.upgrade() {
            Some(inner) if !inner.agent().is_shut_down() => {}
            _ => return,
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
    }
}

/// One event of a peer's watch.
fn handle_event(
    agent: &Agent,
    remote: &str,
    prefix: &str,
    labels: &Mutex<HashSet<String>>,
    event_type: EventType,
    kv: &etcd_client::KeyValue,
) {
    let label = kv
        .key_str()
        .ok()
        .and_then(|k| k.strip_prefix(prefix))
        .unwrap_or_default();
    match event_type {
        EventType::Delete => match agent.invalidate_remote(remote) {
            Ok(()) => {
                tracing::debug!(peer = %remote, key = label, "etcd: peer left, invalidated")
            }
            Err(Error::UnknownAgent(_)) => {}
            Err(e) => {
                tracing::warn!(peer = %remote, error = %e, "etcd: invalidation failed")
            }
        },
        EventType::Put => {
            let wanted = label == DEFAULT_LABEL || labels.lock().contains(label);
            if !wanted || kv.value().is_empty() {
                return;
            }
            match crate::metadata::AgentMetadata::decode(kv.value()) {
                Ok(meta) if meta.agent == remote => match agent.load_remote_metadata(kv.value()) {
                    Ok(_) => {
                        tracing::debug!(peer = %remote, label, "etcd: peer republished, reloaded")
                    }
                    Err(e) => {
                        tracing::warn!(peer = %remote, error = %e, "etcd: reloading failed")
                    }
                },
                Ok(meta) => {
                    tracing::warn!(peer = %remote, found = %meta.agent, "etcd: metadata of another agent ignored")
                }
                Err(e) => {
                    tracing::warn!(peer = %remote, error = %e, "etcd: malformed metadata ignored")
                }
            }
        }
    }
}

impl Drop for EtcdMetadata {
    fn drop(&mut self) {
        for (_, w) in std::mem::take(self.watches.get_mut()) {
            w.task.abort();
        }
        if let Some(task) = self.keep_alive.take() {
            task.abort();
        }
        let lease = Some(self.lease.load(Ordering::Acquire)).filter(|id| *id != 0);
        if let (Some(id), Some(runtime)) = (lease, self.runtime.as_ref()) {
            // The agent leaves: its keys go with the lease.
            let mut client = self.client.clone();
            let revoked = bounded(
                runtime,
                self.config.timeout,
                "revoking the lease",
                async move {
                    client
                        .lease_revoke(id)
                        .await
                        .map(drop)
                        .map_err(|e| etcd_error("lease revoke", e))
                },
            );
            if let Err(e) = revoked {
                tracing::warn!(agent = %self.name, error = %e, "etcd lease not revoked (it expires)");
            }
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(EtcdConfig::from_lookup(env(&[])), None);
        assert_eq!(
            EtcdConfig::from_lookup(env(&[(ENDPOINTS_ENV, " , ")])),
            None
        );
        let c = EtcdConfig::from_lookup(env(&[(ENDPOINTS_ENV, "http://a:2379, b:2379")])).unwrap();
        assert_eq!(c.endpoints, vec!["http://a:2379", "b:2379"]);
        assert_eq!(c.namespace, DEFAULT_NAMESPACE);
        assert_eq!(
            c.key("prefill-0", DEFAULT_LABEL),
            "/nixl/agents/prefill-0/metadata"
        );
        assert_eq!(c.key("prefill-0", ""), "/nixl/agents/prefill-0/");
        let c =
            EtcdConfig::from_lookup(env(&[(ENDPOINTS_ENV, "x:1"), (NAMESPACE_ENV, "/team/kv/")]))
                .unwrap();
        assert_eq!(c.key("d", "layer-3"), "/team/kv/d/layer-3");
        assert_eq!(c.credentials, None);
        let c = EtcdConfig::from_lookup(env(&[
            (ENDPOINTS_ENV, "x:1"),
            (USERNAME_ENV, "job-7"),
            (PASSWORD_ENV, "s3cret"),
        ]))
        .unwrap();
        assert_eq!(c.credentials, Some(EtcdCredentials::new("job-7", "s3cret")));
        assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
        // A password alone is no authentication; a user alone sends an empty password.
        let c = EtcdConfig::from_lookup(env(&[(ENDPOINTS_ENV, "x:1"), (PASSWORD_ENV, "p")]));
        assert_eq!(c.unwrap().credentials, None);
        let c = EtcdConfig::from_lookup(env(&[(ENDPOINTS_ENV, "x:1"), (USERNAME_ENV, "u")]));
        assert_eq!(c.unwrap().credentials, Some(EtcdCredentials::new("u", "")));
    }
}
