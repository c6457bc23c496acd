//! The ETCD runtime's coordination (feature `etcd`): ranks, run keys and liveness.
//!
//! Upstream's nixlbench registers each process under a lock and a shared counter; here a
//! rank is one key created by an etcd transaction that succeeds only when the key does
//! not exist yet (compare `create_revision == 0`), so two processes can never hold the
//! same rank and no lock is needed. Keys, under `/nixlbench/{group}/`:
//! - `rank/0`, `rank/1`: the initiator's and the target's [`RankInfo`] (JSON). Rank 0
//!   picks the run id; rank 1 is claimed only while rank 0 is the one it read (a second
//!   compare on rank 0's `mod_revision`), and carries the same run id;
//! - `run/{run}/{label}`: what the two sides tell each other (agent names, the end,
//!   `setup-{rank}`: each side's setup progress, every second, which bounds the peer's
//!   waits: `crate::setup`);
//! - `run/{run}/agents/…`: the agents' metadata, through `nixl::etcd::EtcdMetadata`.
//!
//! Every key is attached to a lease of the process that wrote it: dropping the runtime
//! revokes it, a crash lets it expire ([`RANK_LEASE_TTL`]), so a group is free again
//! once its processes are gone, and a peer that vanished is seen as gone.

use crate::options::Side;
use crate::setup::{PeerWait, SetupReport, Verdict};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::time::{Duration, Instant};

/// TTL of the lease of every key this process writes: how long the keys of a crashed
/// process stay.
pub(crate) const RANK_LEASE_TTL: Duration = Duration::from_secs(5);
/// Bound on connecting and on each request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How often waits look at etcd again.
const POLL: Duration = Duration::from_millis(50);
/// The root of every key nixlbench writes.
pub(crate) const ROOT: &str = "/nixlbench";

/// Overrides this process's host identity (its boot id): containers that share a
/// kernel but not `/dev/shm` are different hosts for the provider choice (and tests run
/// the two-host path on one machine).
pub(crate) const HOST_ID_ENV: &str = "NIXLBENCH_HOST_ID";

/// What a rank tells its peer about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RankInfo {
    /// The run both ranks belong to (chosen by rank 0).
    pub(crate) run: String,
    pub(crate) hostname: String,
    /// `/proc/sys/kernel/random/boot_id`: equal on one host (one boot), different across.
    pub(crate) boot_id: String,
    pub(crate) pid: u32,
    pub(crate) backend: String,
    /// The LIBFABRIC provider the user named on this side, if any.
    pub(crate) provider: Option<String>,
}

impl RankInfo {
    /// This process, for `run`.
    pub(crate) fn this_process(run: &str, backend: &str, provider: Option<&str>) -> Self {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        Self {
            run: run.to_string(),
            hostname: read("/proc/sys/kernel/hostname"),
            boot_id: std::env::var(HOST_ID_ENV)
                .ok()
                .filter(|id| !id.is_empty())
                .unwrap_or_else(|| read("/proc/sys/kernel/random/boot_id")),
            pid: std::process::id(),
            backend: backend.to_string(),
            provider: provider.map(str::to_string),
        }
    }

    /// Whether `other` runs on this host.
    pub(crate) fn same_host(&self, other: &RankInfo) -> bool {
        if self.boot_id.is_empty() || other.boot_id.is_empty() {
            return !self.hostname.is_empty() && self.hostname == other.hostname;
        }
        self.boot_id == other.boot_id
    }

    fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("plain struct")
    }

    fn decode(key: &str, bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|e| {
            format!("`{key}` in etcd is not a nixlbench rank ({e}): another program uses {ROOT}/")
        })
    }
}

/// The rank of `side` (upstream's pairwise scheme: the initiator is rank 0).
pub(crate) fn rank_of(side: Side) -> usize {
    match side {
        Side::Initiator => 0,
        Side::Target => 1,
    }
}

fn side_of(rank: usize) -> Side {
    if rank == 0 {
        Side::Initiator
    } else {
        Side::Target
    }
}

/// A fresh run id: time and process id, unique enough for runs of one group.
fn new_run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{:x}", std::process::id())
}

/// This process's place in a run: its rank, held through a lease until dropped.
pub(crate) struct EtcdRuntime {
    runtime: Option<tokio::runtime::Runtime>,
    client: Client,
    lease: i64,
    keep_alive: Option<tokio::task::JoinHandle<()>>,
    endpoints: Vec<String>,
    group: String,
    side: Side,
    me: RankInfo,
    /// The peer's rank as read (rank 1 reads rank 0 when claiming; rank 0 waits for it).
    peer: Option<RankInfo>,
    wait: Duration,
}

impl std::fmt::Debug for EtcdRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRuntime")
            .field("endpoints", &self.endpoints)
            .field("group", &self.group)
            .field("side", &self.side)
            .field("run", &self.me.run)
            .finish_non_exhaustive()
    }
}

fn bounded<T>(
    runtime: &tokio::runtime::Runtime,
    what: &str,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, String> {
    runtime
        .block_on(async { tokio::time::timeout(REQUEST_TIMEOUT, fut).await })
        .map_err(|_| format!("etcd: {what}: no answer within {REQUEST_TIMEOUT:?}"))?
        .map_err(|e| format!("etcd: {what}: {e}"))
}

impl EtcdRuntime {
    /// Connects to etcd, takes a lease and claims rank 0 (initiator) or, if taken, rank 1
    /// (target) of `group`; a third process is refused. `wait` bounds every later wait
    /// for the peer.
    pub(crate) fn join(
        endpoints: &[String],
        group: &str,
        wait: Duration,
        backend: &str,
        provider: Option<&str>,
    ) -> Result<Self, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("nixlbench-etcd")
            .enable_all()
            .build()
            .map_err(|e| format!("etcd runtime thread: {e}"))?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT);
        // The same credentials the agents' etcd metadata uses (etcd authentication).
        let user = std::env::var(nixl::etcd::USERNAME_ENV).unwrap_or_default();
        if !user.is_empty() {
            let password = std::env::var(nixl::etcd::PASSWORD_ENV).unwrap_or_default();
            options = options.with_user(user, password);
        }
        let reach = |e: String| {
            format!(
                "cannot reach etcd at {} ({e}); start one (Debian: etcd-server) or pass \
                 --etcd_endpoints",
                endpoints.join(",")
            )
        };
        let client = bounded(
            &runtime,
            "connect",
            Client::connect(endpoints, Some(options)),
        )
        .map_err(reach)?;
        let ttl = RANK_LEASE_TTL.as_secs() as i64;
        let mut c = client.clone();
        let (lease, keeper, stream) = bounded(&runtime, "lease", async move {
            let lease = c.lease_grant(ttl, None).await?;
            let (keeper, stream) = c.lease_keep_alive(lease.id()).await?;
            Ok((lease.id(), keeper, stream))
        })
        .map_err(reach)?;
        let keep_alive = runtime.spawn(async move {
            let (mut keeper, mut stream) = (keeper, stream);
            loop {
                if keeper.keep_alive().await.is_err() {
                    return;
                }
                match stream.message().await {
                    Ok(Some(_)) => {}
                    _ => return,
                }
                tokio::time::sleep(RANK_LEASE_TTL / 3).await;
            }
        });
        let mut this = Self {
            runtime: Some(runtime),
            client,
            lease,
            keep_alive: Some(keep_alive),
            endpoints: endpoints.to_vec(),
            group: group.to_string(),
            side: Side::Initiator,
            me: RankInfo::this_process("", backend, provider),
            peer: None,
            wait,
        };
        this.claim()?;
        Ok(this)
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("runtime lives until drop")
    }

    fn rank_key(&self, rank: usize) -> String {
        format!("{ROOT}/{}/rank/{rank}", self.group)
    }

    /// The prefix of this run's keys.
    pub(crate) fn run_prefix(&self) -> String {
        format!("{ROOT}/{}/run/{}", self.group, self.me.run)
    }

    fn put_options(&self) -> Option<PutOptions> {
        Some(PutOptions::new().with_lease(self.lease))
    }

    /// Claims rank 0, else rank 1 of the run rank 0 holds (see the module docs).
    fn claim(&mut self) -> Result<(), String> {
        let (key0, key1) = (self.rank_key(0), self.rank_key(1));
        for _ in 0..100 {
            let mut mine = self.me.clone();
            mine.run = new_run_id();
            let txn = Txn::new()
                .when([Compare::create_revision(key0.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key0.clone(), mine.encode(), self.put_options())])
                .or_else([TxnOp::get(key0.clone(), None)]);
            let mut c = self.client.clone();
            let resp = bounded(
                self.rt(),
                "claiming rank 0",
                async move { c.txn(txn).await },
            )?;
            if resp.succeeded() {
                self.me = mine;
                self.side = Side::Initiator;
                return Ok(());
            }
            let Some((rank0, revision)) = first_kv(&resp.op_responses()) else {
                continue; // rank 0 left in between: try it again
            };
            let rank0 = RankInfo::decode(&key0, &rank0)?;
            let mut mine = self.me.clone();
            mine.run = rank0.run.clone();
            let txn = Txn::new()
                .when([
                    Compare::create_revision(key1.clone(), CompareOp::Equal, 0),
                    Compare::mod_revision(key0.clone(), CompareOp::Equal, revision),
                ])
                .and_then([TxnOp::put(key1.clone(), mine.encode(), self.put_options())])
                .or_else([TxnOp::get(key1.clone(), None)]);
            let mut c = self.client.clone();
            let resp = bounded(
                self.rt(),
                "claiming rank 1",
                async move { c.txn(txn).await },
            )?;
            if resp.succeeded() {
                self.me = mine;
                self.side = Side::Target;
                self.peer = Some(rank0);
                return Ok(());
            }
            if let Some((rank1, _)) = first_kv(&resp.op_responses()) {
                let who = |r: Result<RankInfo, String>| {
                    r.map_or_else(|e| e, |r| format!("pid {} on {}", r.pid, r.hostname))
                };
                return Err(format!(
                    "benchmark group `{}` at {} already has its two processes: rank 0 \
                     (initiator, {}) and rank 1 (target, {}); the pairwise scheme takes \
                     two, so this third one stops. Start it when they are done, or give \
                     it another --benchmark_group",
                    self.group,
                    self.endpoints.join(","),
                    who(Ok(rank0)),
                    who(RankInfo::decode(&key1, &rank1)),
                ));
            }
            // Rank 0 changed in between: start over.
        }
        Err(format!(
            "could not claim a rank in benchmark group `{}`: its keys keep changing",
            self.group
        ))
    }

    /// This process's side (rank 0: initiator, rank 1: target).
    pub(crate) fn side(&self) -> Side {
        self.side
    }

    pub(crate) fn me(&self) -> &RankInfo {
        &self.me
    }

    pub(crate) fn group(&self) -> &str {
        &self.group
    }

    pub(crate) fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    fn peer_rank(&self) -> usize {
        1 - rank_of(self.side)
    }

    fn peer_role(&self) -> &'static str {
        match side_of(self.peer_rank()) {
            Side::Initiator => "the initiator (rank 0)",
            Side::Target => "the target (rank 1)",
        }
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        let mut c = self.client.clone();
        let k = key.to_string();
        let resp = bounded(self.rt(), &format!("get {key}"), async move {
            c.get(k, None).await
        })?;
        Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// The peer's rank, if it holds one in this run.
    fn peer_now(&self) -> Result<Option<RankInfo>, String> {
        let key = self.rank_key(self.peer_rank());
        match self.get(&key)? {
            Some(v) => {
                let info = RankInfo::decode(&key, &v)?;
                Ok((info.run == self.me.run).then_some(info))
            }
            None => Ok(None),
        }
    }

    /// Waits (up to `--etcd_wait`) for the peer's rank in this run.
    pub(crate) fn peer(&mut self) -> Result<RankInfo, String> {
        if let Some(p) = &self.peer {
            return Ok(p.clone());
        }
        let start = Instant::now();
        let mut printed = Instant::now();
        loop {
            if let Some(p) = self.peer_now()? {
                self.peer = Some(p.clone());
                return Ok(p);
            }
            if printed.elapsed() >= Duration::from_secs(5) {
                printed = Instant::now();
                eprintln!(
                    "nixlbench: waiting for {} to join benchmark group `{}` ({:.0} s of {:?})",
                    self.peer_role(),
                    self.group,
                    start.elapsed().as_secs_f64(),
                    self.wait
                );
            }
            if start.elapsed() > self.wait {
                return Err(format!(
                    "{} did not join benchmark group `{}` at {} within {:?} (upstream's \
                     60 s): start the second nixlbench with the same --etcd_endpoints",
                    self.peer_role(),
                    self.group,
                    self.endpoints.join(","),
                    self.wait
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Why the peer is gone, if it is: its rank key is no longer there (it exited, or its
    /// lease expired after a crash).
    pub(crate) fn peer_gone(&self) -> Option<String> {
        match self.peer_now() {
            Ok(Some(_)) => None,
            Ok(None) => Some(format!(
                "{} left the run (its etcd rank is gone)",
                self.peer_role()
            )),
            // etcd itself unreachable for a moment: not a verdict on the peer.
            Err(_) => None,
        }
    }

    /// Waits (up to `--etcd_wait`) until the peer has left: a side that refuses the run
    /// stays until the peer has seen its rank (the peer reads the same mismatch and
    /// leaves), so the peer stops with the reason instead of waiting for a rank that
    /// came and went.
    /// A peer that failed too (it waits for us in turn) ends the wait as well.
    pub(crate) fn wait_peer_left(&self) {
        let start = Instant::now();
        while self.peer_gone().is_none()
            && self.peer_failed().is_none()
            && start.elapsed() < self.wait
        {
            std::thread::sleep(POLL);
        }
    }

    /// Why the peer failed, if it said so (see [`EtcdRuntime::fail`]).
    pub(crate) fn peer_failed(&self) -> Option<String> {
        let key = format!("{}/{}", self.run_prefix(), failed_label(self.peer_rank()));
        // etcd unreachable for a moment: no verdict.
        let why = self.get(&key).ok()??;
        Some(format!(
            "{} failed: {}",
            self.peer_role(),
            String::from_utf8_lossy(&why)
        ))
    }

    /// [`EtcdRuntime::peer_failed`], else [`EtcdRuntime::peer_gone`].
    pub(crate) fn peer_failed_or_gone(&self) -> Option<String> {
        self.peer_failed().or_else(|| self.peer_gone())
    }

    /// Tells the peer this process fails with `why` (under `failed-{rank}`), and stays
    /// until the peer has left (see [`EtcdRuntime::wait_peer_left`]).
    pub(crate) fn fail(&self, why: &str) {
        if self.put(&failed_label(rank_of(self.side)), why).is_ok() {
            self.wait_peer_left();
        }
    }

    /// Puts `run/{run}/{label}` under this process's lease.
    pub(crate) fn put(&self, label: &str, value: &str) -> Result<(), String> {
        let key = format!("{}/{label}", self.run_prefix());
        let mut c = self.client.clone();
        let (k, v, o) = (key.clone(), value.to_string(), self.put_options());
        bounded(self.rt(), &format!("put {key}"), async move {
            c.put(k, v, o).await
        })?;
        Ok(())
    }

    /// Waits for `run/{run}/{label}` (up to `--etcd_wait` after the peer's last setup
    /// progress), failing early when the peer leaves; `what` names the wait in errors.
    pub(crate) fn wait_for(&self, label: &str, what: &str) -> Result<String, String> {
        match self.wait_key(label, what)? {
            Ok(value) => Ok(value),
            Err(why) => Err(format!("waiting for {what}: {why}")),
        }
    }

    /// Waits (bounded as [`EtcdRuntime::wait_for`]) for `run/{run}/{label}` or for the peer to leave,
    /// whichever comes first: a peer that acknowledges and exits at once takes its key
    /// with it (the lease), so its leaving is an answer too.
    pub(crate) fn wait_for_or_left(&self, label: &str, what: &str) -> Result<(), String> {
        self.wait_key(label, what).map(drop)
    }

    /// `Ok(Ok(value))`: the key; `Ok(Err(why))`: the peer left first. The wait is
    /// bounded by the peer's setup progress ([`PeerWait`]), printed every few seconds.
    fn wait_key(&self, label: &str, what: &str) -> Result<Result<String, String>, String> {
        let key = format!("{}/{label}", self.run_prefix());
        let mut bound = PeerWait::new(self.wait, Instant::now());
        let mut last_peer_check = Instant::now();
        loop {
            if let Some(v) = self.get(&key)? {
                return Ok(Ok(String::from_utf8_lossy(&v).into_owned()));
            }
            if last_peer_check.elapsed() > Duration::from_millis(500) {
                last_peer_check = Instant::now();
                if let Some(why) = self.peer_failed() {
                    return Err(format!("waiting for {what}: {why}"));
                }
                if let Some(why) = self.peer_gone() {
                    return Ok(Err(why));
                }
                match bound.observe(Instant::now(), self.peer_setup(), what, self.peer_role()) {
                    Verdict::Wait => {}
                    Verdict::Print(line) => eprintln!("nixlbench: {line}"),
                    Verdict::GiveUp(why) => {
                        return Err(format!(
                            "waiting for {what}: nothing at `{key}`: {why} (--etcd_wait {} s \
                             after its last progress)",
                            self.wait.as_secs()
                        ))
                    }
                }
            }
            std::thread::sleep(POLL);
        }
    }

    /// Publishes this side's setup progress (`setup-{rank}`), which bounds the peer's
    /// waits for it.
    pub(crate) fn publish_setup(&self, report: &SetupReport) -> Result<(), String> {
        let json = serde_json::to_string(report).map_err(|e| e.to_string())?;
        self.put(&setup_label(rank_of(self.side)), &json)
    }

    /// The peer's latest setup progress, if it published any (and etcd answers).
    fn peer_setup(&self) -> Option<SetupReport> {
        let key = format!("{}/{}", self.run_prefix(), setup_label(self.peer_rank()));
        let value = self.get(&key).ok()??;
        serde_json::from_slice(&value).ok()
    }

    /// The configuration of the agents' metadata service: this run's prefix, the
    /// peer-wait as its timeout (a fetch waits for the peer's publication).
    pub(crate) fn metadata_config(&self) -> nixl::etcd::EtcdConfig {
        let mut config = nixl::etcd::EtcdConfig::new(self.endpoints.clone());
        config.namespace = format!("{}/agents", self.run_prefix());
        config.timeout = self.wait;
        config.lease_ttl = Some(RANK_LEASE_TTL);
        config
    }
}

/// The label under which `rank` publishes its setup progress.
fn setup_label(rank: usize) -> String {
    format!("setup-{rank}")
}

/// The label under which `rank` reports its failure.
fn failed_label(rank: usize) -> String {
    format!("failed-{rank}")
}

/// The value and mod revision of the first key of a transaction's `else` get.
fn first_kv(responses: &[TxnOpResponse]) -> Option<(Vec<u8>, i64)> {
    responses.iter().find_map(|r| match r {
        TxnOpResponse::Get(get) => get
            .kvs()
            .first()
            .map(|kv| (kv.value().to_vec(), kv.mod_revision())),
        _ => None,
    })
}

impl Drop for EtcdRuntime {
    fn drop(&mut self) {
        if let Some(task) = self.keep_alive.take() {
            task.abort();
        }
        if let Some(runtime) = self.runtime.take() {
            // Our keys (the rank, the run keys) go with the lease; if etcd does not answer
            // the lease expires on its own.
            let mut c = self.client.clone();
            let lease = self.lease;
            if let Err(e) = bounded(&runtime, "revoking the lease", async move {
                c.lease_revoke(lease).await
            }) {
                eprintln!("nixlbench: {e} (the keys expire in {RANK_LEASE_TTL:?})");
            }
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_info_round_trip_and_hosts() {
        let a = RankInfo::this_process("r1", "LIBFABRIC", Some("tcp"));
        let key = "/nixlbench/g/rank/0";
        assert_eq!(RankInfo::decode(key, &a.encode()).unwrap(), a);
        assert!(a.same_host(&a));
        let mut b = a.clone();
        b.boot_id = "another-boot".into();
        assert!(!a.same_host(&b));
        let e = RankInfo::decode(key, b"not json").unwrap_err();
        assert!(e.contains("is not a nixlbench rank"), "{e}");
        assert_eq!((rank_of(Side::Initiator), rank_of(Side::Target)), (0, 1));
        assert_ne!(new_run_id(), "");
    }
}
