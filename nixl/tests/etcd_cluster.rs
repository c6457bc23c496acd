//! The etcd metadata service while etcd members fail (issue 27): a cluster of three local
//! etcd processes (their own client and peer ports and folders) whose leader is killed
//! during a run and started again, and a single etcd killed and started again. Agents are
//! given every endpoint. Through it all, metadata publication, fetch and watch
//! (invalidation and reload seen) keep working, the agents' leases stay alive, and while
//! no member answers the errors are typed and bounded.
//!
//! Needs `--features etcd`; the `etcd` binary is `NIXL_TEST_ETCD_BIN` or `etcd` on the
//! PATH, and a missing one fails the tests (as `tests/etcd.rs`).
#![cfg(all(feature = "etcd", feature = "libfabric"))]

mod common;

use common::{dram, finish, wait_notif};
use nixl::etcd::{EtcdConfig, EtcdMetadata};
use nixl::{Agent, Desc, Error, XferOp};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PROVIDER: &str = "tcp;ofi_rxm";
/// Bound on every wait for something that must happen.
const BOUND: Duration = Duration::from_secs(30);
/// The agents' lease: short, so that a keep-alive that stopped shows within the test
/// (long enough for a keep-alive thread starved for a second or two on a loaded machine).
const LEASE: Duration = Duration::from_secs(5);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One member: its ports and process.
struct Member {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// A local etcd cluster; every member killed and the folder removed on drop.
struct Cluster {
    dir: PathBuf,
    members: Vec<Member>,
    token: String,
}

impl Cluster {
    fn start(tag: &str, size: usize) -> Self {
        let dir = std::env::temp_dir().join(format!("etcd-cluster-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let members = (0..size)
            .map(|i| Member {
                name: format!("m{i}"),
                client: free_port(),
                peer: free_port(),
                child: None,
            })
            .collect();
        let mut cluster = Cluster {
            dir,
            members,
            token: format!("nixl-{}-{tag}", std::process::id()),
        };
        for i in 0..size {
            cluster.spawn(i);
        }
        for i in 0..size {
            cluster.wait_listening(i);
        }
        cluster.wait_leader();
        cluster
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Starts member `i` (again: its data folder is kept, so it rejoins as itself).
    fn spawn(&mut self, i: usize) {
        let bin = std::env::var("NIXL_TEST_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
        let initial = self.initial_cluster();
        let m = &self.members[i];
        let client = format!("http://127.0.0.1:{}", m.client);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", m.name)))
            .unwrap();
        let child = Command::new(&bin)
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(self.dir.join(&m.name))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-token", &self.token])
            // Elections within a few hundred ms once the leader is gone.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run `{bin}` ({e}): install etcd (Debian: etcd-server) or set NIXL_TEST_ETCD_BIN")
            });
        self.members[i].child = Some(child);
    }

    fn addr(&self, i: usize) -> SocketAddr {
        format!("127.0.0.1:{}", self.members[i].client)
            .parse()
            .unwrap()
    }

    fn wait_listening(&mut self, i: usize) {
        let deadline = Instant::now() + BOUND;
        while TcpStream::connect_timeout(&self.addr(i), Duration::from_millis(200)).is_err() {
            if let Some(status) = self.members[i].child.as_mut().unwrap().try_wait().unwrap() {
                let log =
                    std::fs::read_to_string(self.dir.join(format!("m{i}.log"))).unwrap_or_default();
                panic!("etcd member {i} exited ({status}) before listening:\n{log}");
            }
            assert!(Instant::now() < deadline, "etcd member {i} never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client))
            .collect()
    }

    /// A JSON gateway request to member `i` (`None`: it did not answer).
    fn gateway(&self, i: usize, path: &str, body: &str) -> Option<serde_like::Json> {
        let mut s = TcpStream::connect_timeout(&self.addr(i), Duration::from_millis(500)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr(i),
            body.len()
        )
        .ok()?;
        let mut reply = String::new();
        s.read_to_string(&mut reply).ok()?;
        let (head, rest) = reply.split_once("\r\n\r\n")?;
        if !head.starts_with("HTTP/1.1 200") {
            return None;
        }
        Some(serde_like::Json(rest.to_string()))
    }

    /// The member that leads now, by the status API (`/v3/maintenance/status`: a member
    /// whose `member_id` is the `leader` it reports).
    fn leader(&self) -> Option<usize> {
        (0..self.members.len()).find(|&i| {
            self.members[i].child.is_some()
                && self
                    .gateway(i, "/v3/maintenance/status", "{}")
                    .is_some_and(|j| {
                        let member = j.field("member_id");
                        member.is_some() && member == j.field("leader")
                    })
        })
    }

    fn wait_leader(&self) -> usize {
        let deadline = Instant::now() + BOUND;
        loop {
            if let Some(i) = self.leader() {
                return i;
            }
            assert!(Instant::now() < deadline, "the cluster elected no leader");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn restart(&mut self, i: usize) {
        self.spawn(i);
        self.wait_listening(i);
        self.wait_leader();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Just enough JSON for the status reply: string fields of the top level and the header.
mod serde_like {
    pub struct Json(pub String);

    impl Json {
        /// The value of `"name":"value"` (the first such field anywhere).
        pub fn field(&self, name: &str) -> Option<String> {
            let at = self.0.find(&format!("\"{name}\":\""))? + name.len() + 4;
            let end = self.0[at..].find('"')? + at;
            Some(self.0[at..end].to_string())
        }

        /// Every value of `"name":"value"`.
        pub fn all(&self, name: &str) -> Vec<String> {
            let pattern = format!("\"{name}\":\"");
            self.0
                .match_indices(&pattern)
                .filter_map(|(at, _)| {
                    let from = at + pattern.len();
                    let end = self.0[from..].find('"')? + from;
                    Some(self.0[from..end].to_string())
                })
                .collect()
        }
    }
}

fn config(cluster: &Cluster) -> EtcdConfig {
    let mut c = EtcdConfig::new(cluster.endpoints());
    c.namespace = "/nixl/cluster-test".into();
    c.timeout = Duration::from_secs(5);
    c.lease_ttl = Some(LEASE);
    c
}

/// Heartbeats every 500 ms (declared dead after 2.5 s): these tests are about etcd, and
/// on a loaded 2-core machine the default 100 ms ones declared live peers dead.
fn fabric_agent(name: &str) -> Agent {
    common::fabric_agent(name, PROVIDER, &[("heartbeat_ms", "500")])
}

/// Runs `f`, printing how long it took (the figures docs/BENCHMARKS.md records).
fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let value = f();
    println!("{what}: {:.1?}", started.elapsed());
    value
}

fn eventually<T>(what: &str, mut attempt: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + BOUND;
    loop {
        if let Some(v) = attempt() {
            return v;
        }
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A peer with a buffer, published through etcd.
struct Peer {
    agent: Agent,
    buf: Vec<u8>,
    etcd: Option<EtcdMetadata>,
    _handle: nixl::RegistrationHandle,
}

impl Peer {
    /// The agent, registered and published; an etcd error is returned (a member that
    /// just died may cost a request).
    fn try_new(name: &str, cluster: &Cluster) -> nixl::Result<Self> {
        let agent = fabric_agent(name);
        let buf = vec![0u8; 1 << 16];
        // SAFETY: `buf` is moved into the returned value with the handle; a Vec's heap
        // buffer does not move with it, and the handle is dropped with it.
        let handle = unsafe {
            agent
                .register_mem(&dram([Desc::from_slice(&buf)]), None)
                .unwrap()
        };
        let etcd = EtcdMetadata::connect(&agent, config(cluster))?;
        etcd.publish()?;
        Ok(Self {
            agent,
            buf,
            etcd: Some(etcd),
            _handle: handle,
        })
    }

    fn new(name: &str, cluster: &Cluster) -> Self {
        Self::try_new(name, cluster).unwrap()
    }

    fn etcd(&self) -> &EtcdMetadata {
        self.etcd.as_ref().unwrap()
    }
}

/// WRITEs `fill` into `peer`'s buffer with a notification and checks both arrived.
fn write_verified(initiator: &Agent, src: &mut [u8], peer_name: &str, peer: &Peer, fill: u8) {
    src.fill(fill);
    let msg = format!("fill {fill}").into_bytes();
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(src)]),
            &dram([Desc::from_slice(&peer.buf)]),
            peer_name,
            Some(msg.clone()),
        )
        .unwrap();
    req.post().unwrap();
    finish(&mut req).unwrap();
    assert_eq!(wait_notif(&peer.agent, initiator.name()), msg);
    assert!(peer.buf.iter().all(|b| *b == fill));
}

#[test]
fn three_members_lose_the_leader_and_metadata_keeps_flowing() {
    common::init_tracing();
    let mut cluster = Cluster::start("leader", 3);
    let initiator = fabric_agent("reader");
    let mut src = vec![0u8; 1 << 16];
    // SAFETY: `src` outlives the handle and every request of this test.
    let _hi = unsafe {
        initiator
            .register_mem(&dram([Desc::from_slice(&src)]), None)
            .unwrap()
    };
    let ei = EtcdMetadata::connect(&initiator, config(&cluster)).unwrap();
    let first = Peer::new("holder", &cluster);
    ei.fetch("holder").unwrap();
    write_verified(&initiator, &mut src, "holder", &first, 1);

    // The leader dies.
    let leader = cluster.wait_leader();
    let failover = Instant::now();
    cluster.kill(leader);
    let new_leader = timed("a new leader seen after the leader's kill", || {
        cluster.wait_leader()
    });
    assert_ne!(leader, new_leader);
    println!("killed leader m{leader}; m{new_leader} leads");

    // Publication and fetch keep working at once (a request that went to the dead member
    // is sent again to one that answers).
    let second = timed("publication (connect, publish) after the kill", || {
        Peer::new("holder-2", &cluster)
    });
    timed("fetch after the kill", || ei.fetch("holder-2").unwrap());
    write_verified(&initiator, &mut src, "holder-2", &second, 2);
    println!(
        "from the leader's kill to a peer published after it reached: {:.1?}",
        failover.elapsed()
    );
    // The leases live on: after more than a TTL the keys are still there.
    std::thread::sleep(LEASE + LEASE / 2);
    assert!(
        !ei.labels("holder").unwrap().is_empty(),
        "holder's lease lapsed"
    );
    assert!(
        !ei.labels("holder-2").unwrap().is_empty(),
        "holder-2's lease lapsed"
    );
    assert!(initiator.has_remote("holder"));
    // The watch sees a peer leave (invalidation) and come back (reload).
    first.etcd().unpublish().unwrap();
    timed(
        "watch: invalidation seen after the unpublication (leader dead)",
        || {
            eventually("invalidation seen after the leader died", || {
                (!initiator.has_remote("holder")).then_some(())
            })
        },
    );
    first.etcd().publish().unwrap();
    timed(
        "watch: reload seen after the republication (leader dead)",
        || {
            eventually("republication seen after the leader died", || {
                initiator.has_remote("holder").then_some(())
            })
        },
    );
    write_verified(&initiator, &mut src, "holder", &first, 3);

    // The member comes back; then the new leader dies too.
    timed("the killed member restarted and a leader seen", || {
        cluster.restart(leader)
    });
    let again = cluster.wait_leader();
    cluster.kill(again);
    timed("a new leader seen after the second leader's kill", || {
        cluster.wait_leader()
    });
    println!("restarted m{leader}; killed m{again}");
    second.etcd().unpublish().unwrap();
    timed("watch: invalidation seen after the second kill", || {
        eventually("invalidation seen after the second kill", || {
            (!initiator.has_remote("holder-2")).then_some(())
        })
    });
    let third = timed("publication after the second kill", || {
        Peer::new("holder-3", &cluster)
    });
    timed("fetch after the second kill", || {
        ei.fetch("holder-3").unwrap()
    });
    write_verified(&initiator, &mut src, "holder-3", &third, 4);
    std::thread::sleep(LEASE + LEASE / 2);
    assert!(
        !ei.labels("holder").unwrap().is_empty(),
        "holder's lease lapsed"
    );
    assert!(
        !ei.labels("holder-3").unwrap().is_empty(),
        "holder-3's lease lapsed"
    );
    cluster.restart(again);
    // A peer's client dropped: its lease is revoked, the watch invalidates it.
    drop(third);
    timed(
        "watch: invalidation of a peer whose client was dropped",
        || {
            eventually("invalidation of a peer whose client was dropped", || {
                (!initiator.has_remote("holder-3")).then_some(())
            })
        },
    );
}

#[test]
fn a_single_etcd_restarted_during_a_run() {
    common::init_tracing();
    let mut cluster = Cluster::start("single", 1);
    let initiator = fabric_agent("survivor");
    let mut src = vec![0u8; 1 << 16];
    // SAFETY: `src` outlives the handle and every request of this test.
    let _hi = unsafe {
        initiator
            .register_mem(&dram([Desc::from_slice(&src)]), None)
            .unwrap()
    };
    let ei = EtcdMetadata::connect(&initiator, {
        let mut c = config(&cluster);
        c.timeout = Duration::from_secs(2);
        c
    })
    .unwrap();
    let peer = Peer::new("target", &cluster);
    ei.fetch("target").unwrap();
    write_verified(&initiator, &mut src, "target", &peer, 1);

    cluster.kill(0);
    // While it is down: typed errors, each within its client's request bound (and a
    // little).
    let slack = Duration::from_millis(1500);
    for _ in 0..2 {
        let started = Instant::now();
        match peer.etcd().publish() {
            Err(Error::Timeout(_)) | Err(Error::Backend { .. }) => {}
            other => panic!("publication with etcd down: {other:?}"),
        }
        let bound = peer.etcd().config().timeout + slack;
        assert!(started.elapsed() < bound, "took {:?}", started.elapsed());
        println!(
            "publication with etcd down: typed error after {:.1?} (its timeout {:?})",
            started.elapsed(),
            peer.etcd().config().timeout
        );
        let started = Instant::now();
        match ei.fetch("nobody") {
            Err(Error::Timeout(_)) | Err(Error::Backend { .. }) => {}
            other => panic!("fetch with etcd down: {other:?}"),
        }
        let bound = ei.config().timeout + slack;
        assert!(started.elapsed() < bound, "took {:?}", started.elapsed());
        println!(
            "fetch with etcd down: typed error after {:.1?} (its timeout {:?})",
            started.elapsed(),
            ei.config().timeout
        );
    }
    // Transfers do not need etcd.
    write_verified(&initiator, &mut src, "target", &peer, 2);

    timed("etcd restarted (listening, leader)", || cluster.restart(0));
    timed("publication after the restart", || {
        peer.etcd().publish().unwrap()
    });
    let late = timed("a new peer's publication after the restart", || {
        Peer::new("late", &cluster)
    });
    timed("fetch after the restart", || ei.fetch("late").unwrap());
    write_verified(&initiator, &mut src, "late", &late, 3);
    // The watch from before the outage still works: the peer leaves and comes back.
    peer.etcd().unpublish().unwrap();
    timed("watch: invalidation seen after etcd restarted", || {
        eventually("invalidation after etcd restarted", || {
            (!initiator.has_remote("target")).then_some(())
        })
    });
    peer.etcd().publish().unwrap();
    timed("watch: reload seen after etcd restarted", || {
        eventually("reload after etcd restarted", || {
            initiator.has_remote("target").then_some(())
        })
    });
    write_verified(&initiator, &mut src, "target", &peer, 4);
    // The leases were kept alive across the outage.
    std::thread::sleep(LEASE + LEASE / 2);
    assert!(
        !ei.labels("target").unwrap().is_empty(),
        "target's lease lapsed"
    );
    assert!(
        !ei.labels("late").unwrap().is_empty(),
        "late's lease lapsed"
    );
}

#[test]
fn an_outage_longer_than_the_lease_publishes_again() {
    common::init_tracing();
    let mut cluster = Cluster::start("expiry", 1);
    let initiator = fabric_agent("watcher");
    let ei = EtcdMetadata::connect(&initiator, config(&cluster)).unwrap();
    let peer = Peer::new("long-gone", &cluster);
    ei.fetch("long-gone").unwrap();
    cluster.kill(0);
    // Longer than the TTL.
    std::thread::sleep(LEASE * 2);
    cluster.restart(0);
    // etcd renews leases when it starts (their TTL counts again from then): the keys
    // are there, and stay beyond a TTL.
    std::thread::sleep(LEASE * 2);
    assert_eq!(ei.labels("long-gone").unwrap().len(), 2, "keys lapsed");

    // A lease that lapses anyway (an etcd that kept running while this client could not
    // reach it; here every lease is revoked behind the clients' backs): the keys go, the
    // watcher invalidates the peer; the peer's client takes a new lease and publishes
    // again, and the watcher loads it again.
    let leases = cluster
        .gateway(0, "/v3/lease/leases", "{}")
        .expect("lease list");
    let ids = leases.all("ID");
    assert!(ids.len() >= 2, "leases: {}", leases.0);
    for id in &ids {
        cluster
            .gateway(0, "/v3/lease/revoke", &format!(r#"{{"ID":{id}}}"#))
            .expect("revoke");
    }
    timed("keys back under a new lease after the revocation", || {
        eventually("the keys back under a new lease", || {
            ei.labels("long-gone")
                .ok()
                .filter(|l| l.len() == 2)
                .map(drop)
        })
    });
    timed("the peer loaded again after that", || {
        eventually("the peer loaded again", || {
            initiator.has_remote("long-gone").then_some(())
        })
    });
    std::thread::sleep(LEASE * 2);
    assert_eq!(ei.labels("long-gone").unwrap().len(), 2, "keys lapsed");
    drop(peer);
    eventually("invalidation once the peer's client is dropped", || {
        (!initiator.has_remote("long-gone")).then_some(())
    });
}
