//! etcd authentication against a real etcd server with authentication enabled: a job's
//! user whose role grants read-write on the job's namespace, set up through etcd's gRPC
//! gateway (plain HTTP/JSON, so no client library beyond nixl's is needed). The right
//! credentials publish and fetch; wrong ones fail to connect, absent ones fail at every
//! request on keys, and so does a namespace the role does not grant: each with
//! `Error::Unauthenticated`, within the configured timeout.
//! Needs `--features etcd` and an `etcd` binary (see `support/etcd_server.rs`).
#![cfg(feature = "etcd")]

#[path = "support/etcd_server.rs"]
mod etcd_server;

use etcd_server::EtcdServer;
use nixl::etcd::{EtcdConfig, EtcdCredentials, EtcdMetadata};
use nixl::{Agent, AgentConfig, Error};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The job's namespace; its role grants `/auth-job/` to `/auth-job0` (base64 below).
const NAMESPACE: &str = "/auth-job";
const PREFIX_B64: &str = "L2F1dGgtam9iLw=="; // "/auth-job/"
const RANGE_END_B64: &str = "L2F1dGgtam9iMA=="; // "/auth-job0"
const USER: &str = "nixl-job";
const PASSWORD: &str = "job-password";
/// The bound each refusal must come within.
const TIMEOUT: Duration = Duration::from_secs(5);

/// One POST to etcd's gRPC gateway; fails the test unless it answers 200.
fn post(etcd: &EtcdServer, path: &str, body: &str) {
    let mut s = TcpStream::connect(etcd.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        etcd.addr(),
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(
        reply.starts_with("HTTP/1.1 200"),
        "POST {path} {body}: {reply}"
    );
}

/// Users root and `USER` (a role with read-write on the job's namespace), then auth on.
fn enable_auth(etcd: &EtcdServer) {
    post(etcd, "/v3/auth/role/add", r#"{"name":"root"}"#);
    post(
        etcd,
        "/v3/auth/user/add",
        r#"{"name":"root","password":"root-password"}"#,
    );
    post(
        etcd,
        "/v3/auth/user/grant",
        r#"{"user":"root","role":"root"}"#,
    );
    post(etcd, "/v3/auth/role/add", r#"{"name":"job"}"#);
    post(
        etcd,
        "/v3/auth/role/grant",
        &format!(
            r#"{{"name":"job","perm":{{"permType":"READWRITE","key":"{PREFIX_B64}","range_end":"{RANGE_END_B64}"}}}}"#
        ),
    );
    post(
        etcd,
        "/v3/auth/user/add",
        &format!(r#"{{"name":"{USER}","password":"{PASSWORD}"}}"#),
    );
    post(
        etcd,
        "/v3/auth/user/grant",
        &format!(r#"{{"user":"{USER}","role":"job"}}"#),
    );
    post(etcd, "/v3/auth/enable", "{}");
}

fn config(etcd: &EtcdServer, namespace: &str, credentials: Option<(&str, &str)>) -> EtcdConfig {
    let mut config = EtcdConfig::new([etcd.endpoint.clone()]);
    config.namespace = namespace.to_string();
    config.timeout = TIMEOUT;
    config.credentials = credentials.map(|(u, p)| EtcdCredentials::new(u, p));
    config
}

fn agent(name: &str) -> Agent {
    Agent::new(name, AgentConfig::default()).unwrap()
}

/// `result` is `Error::Unauthenticated` and came within the timeout (and some slack).
fn assert_refused<T: std::fmt::Debug>(what: &str, started: Instant, result: nixl::Result<T>) {
    let took = started.elapsed();
    match result {
        Err(Error::Unauthenticated(why)) => {
            assert!(why.contains("etcd"), "{what}: {why}");
            assert!(
                took < TIMEOUT + Duration::from_secs(2),
                "{what}: took {took:?}"
            );
        }
        other => panic!("{what}: expected Unauthenticated, got {other:?} after {took:?}"),
    }
}

#[test]
fn credentials_gate_publish_and_fetch() {
    let etcd = EtcdServer::start("auth");
    enable_auth(&etcd);
    let creds = Some((USER, PASSWORD));

    // The right credentials: publish, fetch from a second agent, unpublish.
    let producer = agent("auth-producer");
    let published = EtcdMetadata::connect(&producer, config(&etcd, NAMESPACE, creds)).unwrap();
    published.publish().unwrap();
    let consumer = agent("auth-consumer");
    let fetching = EtcdMetadata::connect(&consumer, config(&etcd, NAMESPACE, creds)).unwrap();
    assert_eq!(fetching.fetch("auth-producer").unwrap(), "auth-producer");
    assert!(consumer.has_remote("auth-producer"));

    // A wrong password: refused when connecting.
    let stranger = agent("auth-stranger");
    let started = Instant::now();
    assert_refused(
        "wrong password",
        started,
        EtcdMetadata::connect(
            &stranger,
            config(&etcd, NAMESPACE, Some((USER, "not-the-password"))),
        ),
    );
    // An unknown user.
    let started = Instant::now();
    assert_refused(
        "unknown user",
        started,
        EtcdMetadata::connect(
            &stranger,
            config(&etcd, NAMESPACE, Some(("mallory", PASSWORD))),
        ),
    );
    // No credentials: etcd grants leases to anyone, so connecting works, but every
    // request on keys is refused: nothing read, nothing written, nothing deleted.
    let anonymous = EtcdMetadata::connect(&stranger, config(&etcd, NAMESPACE, None)).unwrap();
    let started = Instant::now();
    assert_refused("anonymous fetch", started, anonymous.fetch("auth-producer"));
    let started = Instant::now();
    assert_refused("anonymous publish", started, anonymous.publish());
    let started = Instant::now();
    assert_refused("anonymous unpublish", started, anonymous.unpublish());
    assert!(!stranger.has_remote("auth-producer"));

    // The job's user outside the namespace its role grants: refused too.
    let elsewhere = EtcdMetadata::connect(&stranger, config(&etcd, "/other-job", creds)).unwrap();
    let started = Instant::now();
    assert_refused("another namespace", started, elsewhere.publish());

    // The producer's keys are still there: the refused clients changed nothing.
    let again = agent("auth-consumer-2");
    let check = EtcdMetadata::connect(&again, config(&etcd, NAMESPACE, creds)).unwrap();
    assert_eq!(check.fetch("auth-producer").unwrap(), "auth-producer");
    published.unpublish().unwrap();
}
