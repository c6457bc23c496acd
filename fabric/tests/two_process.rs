//! Two processes: the test re-executes its own binary as the peer (`peer_process`, an
//! ignored test that only runs when called so), exchanging addresses and keys as hex lines
//! over the child's stdin/stdout. RDM on every RDM provider and MSG on `tcp`: 1 MiB RMA
//! write + read back + tagged/untagged messages verified byte for byte on both sides; a
//! killed peer gives an error within a bounded time.

mod common;

use common::*;
use fabric::ffi;
use fabric::{
    Access, Address, CompletionQueue, Domain, Endpoint, EndpointBuilder, EndpointType, Error,
    EventQueue, Fabric, PassiveEndpoint, RegisteredBuffer, RemoteMemory,
};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

const LEN: usize = 1 << 20;
const REPLY_TAG: u64 = 0x5eed;

// ---- the peer (child process) -----------------------------------------------------------

/// Entry point of the peer process; does nothing unless `FABRIC_PEER_ROLE` is set.
#[test]
#[ignore = "the peer process of the two-process tests; run by them"]
fn peer_process() {
    let Ok(role) = std::env::var("FABRIC_PEER_ROLE") else {
        return;
    };
    let prov = std::env::var("FABRIC_PEER_PROV").expect("FABRIC_PEER_PROV");
    watchdog(120);
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines().map(|l| l.expect("stdin"));
    match role.as_str() {
        "rdm-target" | "rdm-sleeper" => {
            let node = Node::new(&prov, base_caps());
            let buf = node.ep.alloc_registered(LEN, Access::ALL).unwrap();
            println!("NAME {}", hex(&node.ep.name().unwrap()));
            println!("REMOTE {}", hex(&buf.remote().to_bytes()));
            if role == "rdm-sleeper" {
                // Wait to be killed (or for the parent to go away).
                for _ in lines.by_ref() {}
                return;
            }
            let parent = unhex(lines.next().unwrap().strip_prefix("NAME ").unwrap());
            let parent = node.av.insert(&parent).unwrap();
            serve(&node.ep, &node.cq, &buf, parent, &mut lines);
        }
        "msg-target" | "msg-sleeper" => {
            let info = hints(
                &prov,
                EndpointType::MSG,
                fabric::Caps::MSG | fabric::Caps::RMA,
            )
            .get_first()
            .unwrap();
            let fabric = Fabric::new(&info).unwrap();
            let eq = EventQueue::new(&fabric).unwrap();
            let pep = PassiveEndpoint::listen(&fabric, &info, &eq).unwrap();
            println!("NAME {}", hex(&pep.name().unwrap()));
            let request = pep.wait_connreq(T).unwrap();
            let domain = Domain::new(&fabric, &request).unwrap();
            let cq = CompletionQueue::builder().open(&domain).unwrap();
            let ep = EndpointBuilder::new(&domain, &request)
                .cq(&cq)
                .eq(&eq)
                .build()
                .unwrap();
            ep.accept().unwrap();
            ep.wait_connected(T).unwrap();
            let buf = ep.alloc_registered(LEN, Access::ALL).unwrap();
            println!("REMOTE {}", hex(&buf.remote().to_bytes()));
            if role == "msg-sleeper" {
                for _ in lines.by_ref() {}
                return;
            }
            serve(&ep, &cq, &buf, Address::UNSPEC, &mut lines);
        }
        other => panic!("unknown role {other}"),
    }
}

/// The target's part: wait for DONE, verify the bytes, report, reply with a tagged message
/// (RDM; tcp MSG has no tagged messages) and a plain one, which the parent checks.
fn serve(
    ep: &Endpoint,
    cq: &CompletionQueue,
    buf: &RegisteredBuffer,
    parent: Address,
    lines: &mut impl Iterator<Item = String>,
) {
    assert_eq!(lines.next().as_deref(), Some("DONE"));
    let expected = pattern(LEN, 0x42);
    let ok = buf.to_vec_volatile() == expected;
    println!("VERIFIED {}", if ok { "ok" } else { "bad" });
    let mut reply = ep.alloc_registered(4096, Access::ALL).unwrap();
    reply
        .as_mut_slice()
        .unwrap()
        .copy_from_slice(&expected[..4096]);
    let deadline = Instant::now() + T;
    let mut sent = 1;
    if ep.ep_type() == EndpointType::RDM {
        ep.retry(deadline, || ep.tsend(&reply, 0..4096, parent, REPLY_TAG, 1))
            .unwrap();
        sent += 1;
    }
    ep.retry(deadline, || ep.send(&reply, 0..64, parent, 2))
        .unwrap();
    cq.wait_n(sent, T).unwrap();
    // Stay until the parent closes stdin, so its reads of our memory can finish.
    for _ in lines.by_ref() {}
}

// ---- the parent -----------------------------------------------------------------------

struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Peer {
    fn spawn(role: &str, prov: &str) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "peer_process",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("FABRIC_PEER_ROLE", role)
            .env("FABRIC_PEER_PROV", prov)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn peer");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Peer {
            stdin: child.stdin.take(),
            child,
            lines: rx,
        }
    }

    /// The next line with `prefix`, within the test timeout.
    fn expect(&self, prefix: &str) -> String {
        let deadline = Instant::now() + T;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("peer: no `{prefix}` line: {e}"));
            // libtest may print `test peer_process ... ` before the first line.
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].trim().to_owned();
            }
        }
    }

    fn say(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Closes stdin and waits (bounded) for a successful exit.
    fn finish(mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + T;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "peer exited with {status}");
                return;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("peer did not exit");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        // A killed shm peer cannot unlink its regions (`/dev/shm/PID:...`); a later
        // process given the same pid would fail fi_enable with EBUSY.
        let prefix = format!("{}:", self.child.id());
        for entry in std::fs::read_dir("/dev/shm")
            .into_iter()
            .flatten()
            .flatten()
        {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The initiator's part against a serving peer: write 1 MiB, read it back, DONE, receive
/// the replies, check the peer's verdict.
fn drive(
    ep: &Endpoint,
    cq: &CompletionQueue,
    peer: &mut Peer,
    dest: Address,
    remote: RemoteMemory,
) {
    let mut src = ep.alloc_registered(LEN, Access::ALL).unwrap();
    src.as_mut_slice()
        .unwrap()
        .copy_from_slice(&pattern(LEN, 0x42));
    ep.write_sync(&src, 0..LEN, dest, &remote, 0, 10, T)
        .unwrap();
    let back = ep.alloc_registered(LEN, Access::ALL).unwrap();
    ep.read_sync(&back, 0..LEN, dest, &remote, 0, 11, T)
        .unwrap();
    assert!(
        back.to_vec_volatile() == src.as_slice(),
        "read back differs"
    );
    let tagged = ep.alloc_registered(4096, Access::ALL).unwrap();
    let plain = ep.alloc_registered(64, Access::ALL).unwrap();
    if ep.ep_type() == EndpointType::RDM {
        ep.trecv(&tagged, 0..4096, Address::UNSPEC, REPLY_TAG, 0, 20)
            .unwrap();
    }
    ep.recv(&plain, 0..64, Address::UNSPEC, 21).unwrap();
    peer.say("DONE");
    assert_eq!(
        peer.expect("VERIFIED "),
        "ok",
        "the peer saw different bytes"
    );
    let expected = pattern(LEN, 0x42);
    if ep.ep_type() == EndpointType::RDM {
        let c = cq.wait_for(20, T).unwrap();
        assert_eq!(c.tag, REPLY_TAG);
        assert_eq!(tagged.to_vec_volatile(), &expected[..4096]);
    }
    let c = cq.wait_for(21, T).unwrap();
    assert!(c.has(ffi::FI_RECV));
    assert_eq!(
        plain.to_vec_volatile(),
        &expected[..64],
        "reply bytes differ"
    );
}

fn rdm_two_process(prov: &str) {
    watchdog(300);
    let mut peer = Peer::spawn("rdm-target", prov);
    let name = unhex(&peer.expect("NAME "));
    let remote = RemoteMemory::from_bytes(&unhex(&peer.expect("REMOTE "))).unwrap();
    let node = Node::new(prov, base_caps());
    let dest = node.av.insert(&name).unwrap();
    peer.say(&format!("NAME {}", hex(&node.ep.name().unwrap())));
    drive(&node.ep, &node.cq, &mut peer, dest, remote);
    peer.finish();
}

fn msg_connect(prov: &str, addr: &[u8]) -> (Endpoint, CompletionQueue) {
    let info = hints(
        prov,
        EndpointType::MSG,
        fabric::Caps::MSG | fabric::Caps::RMA,
    )
    .get_first()
    .unwrap();
    let fabric = Fabric::new(&info).unwrap();
    let domain = Domain::new(&fabric, &info).unwrap();
    let cq = CompletionQueue::builder().open(&domain).unwrap();
    let eq = EventQueue::new(&fabric).unwrap();
    let ep = EndpointBuilder::new(&domain, &info)
        .cq(&cq)
        .eq(&eq)
        .build()
        .unwrap();
    ep.connect(addr).unwrap();
    ep.wait_connected(T).unwrap();
    (ep, cq)
}

#[test]
fn msg_tcp_two_process() {
    watchdog(300);
    let mut peer = Peer::spawn("msg-target", "tcp");
    let addr = unhex(&peer.expect("NAME "));
    let (ep, cq) = msg_connect("tcp", &addr);
    let remote = RemoteMemory::from_bytes(&unhex(&peer.expect("REMOTE "))).unwrap();
    drive(&ep, &cq, &mut peer, Address::UNSPEC, remote);
    peer.finish();
}

/// After the peer is killed, operations towards it fail within a bounded time.
/// Returns the first error that is not a timeout, or the last timeout after `patience`.
fn killed_peer(prov: &str, msg: bool, patience: Duration) -> Error {
    watchdog(300);
    let role = if msg { "msg-sleeper" } else { "rdm-sleeper" };
    let mut peer = Peer::spawn(role, prov);
    let name = unhex(&peer.expect("NAME "));
    let (ep, _cq, _node, dest) = if msg {
        let (ep, cq) = msg_connect(prov, &name);
        (ep, cq, None, Address::UNSPEC)
    } else {
        // An event queue on the RDM endpoint too: rxm reports a refused reconnection there.
        let info = rdm_info(prov, base_caps()).unwrap();
        let fabric = Fabric::new(&info).unwrap();
        let domain = Domain::new(&fabric, &info).unwrap();
        let cq = CompletionQueue::builder().open(&domain).unwrap();
        let av = fabric::AddressVector::new(&domain, fabric::AvType::Table, 4).unwrap();
        let eq = EventQueue::new(&fabric).unwrap();
        let ep = EndpointBuilder::new(&domain, &info)
            .cq(&cq)
            .av(&av)
            .eq(&eq)
            .build()
            .unwrap();
        let dest = av.insert(&name).unwrap();
        (ep, cq, Some((fabric, domain, av, eq)), dest)
    };
    let remote = RemoteMemory::from_bytes(&unhex(&peer.expect("REMOTE "))).unwrap();
    let src = ep.alloc_registered(4096, Access::ALL).unwrap();
    ep.write_sync(&src, 0..4096, dest, &remote, 0, 1, T)
        .unwrap();
    peer.kill();
    let deadline = Instant::now() + patience;
    let mut context = 2;
    let mut successes = 0;
    loop {
        match ep.write_sync(
            &src,
            0..4096,
            dest,
            &remote,
            0,
            context,
            Duration::from_secs(2),
        ) {
            Ok(_) => successes += 1,
            Err(e @ Error::TimedOut { .. }) if Instant::now() >= deadline => return e,
            Err(Error::TimedOut { .. }) => {}
            Err(e) => return e,
        }
        assert!(
            Instant::now() < deadline,
            "{prov}: {successes} writes to a killed peer succeeded, no error"
        );
        context += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_disconnect(prov: &str, err: &Error) {
    match err {
        Error::RemoteDisconnect { .. } | Error::Completion(_) => {}
        other => {
            panic!("{prov}: killed peer gave {other:?}, expected a disconnect/completion error")
        }
    }
}

#[test]
fn rdm_two_process_tcp_rxm() {
    rdm_two_process("tcp;ofi_rxm");
}
#[test]
fn rdm_two_process_sockets() {
    rdm_two_process("sockets");
}
#[test]
fn rdm_two_process_udp_rxd() {
    rdm_two_process("udp;ofi_rxd");
}
#[test]
fn rdm_two_process_shm() {
    rdm_two_process("shm");
}

#[test]
fn killed_peer_tcp_rxm() {
    // Either the failed operation completes in error, or — when the peer dies between
    // operations — rxm 1.17 keeps refusing posts with FI_EAGAIN while it retries the
    // connection (it logs "fi_eq_readerr: Connection refused" and tells the application
    // nothing): then the bounded retry ends in TimedOut. Either way: an error, no hang.
    let err = killed_peer("tcp;ofi_rxm", false, Duration::from_secs(10));
    match err {
        Error::TimedOut {
            call: "fi_write", ..
        } => {}
        other => assert_disconnect("tcp;ofi_rxm", &other),
    }
}
#[test]
fn killed_peer_sockets() {
    // sockets refuses the post itself once its connection to the peer is gone.
    let err = killed_peer("sockets", false, Duration::from_secs(30));
    match err {
        Error::Call {
            call: "fi_write",
            errno,
            ..
        } => assert_eq!(errno, ffi::FI_ENOENT),
        other => assert_disconnect("sockets", &other),
    }
}
#[test]
fn killed_peer_shm() {
    let err = killed_peer("shm", false, Duration::from_secs(30));
    assert_disconnect("shm", &err);
}
#[test]
fn killed_peer_udp_rxd() {
    // rxd has no connection to lose: the write is never acknowledged and the bounded
    // wait ends.
    let err = killed_peer("udp;ofi_rxd", false, Duration::from_secs(5));
    assert!(matches!(err, Error::TimedOut { .. }), "{err:?}");
}
#[test]
fn killed_peer_tcp_msg() {
    let err = killed_peer("tcp", true, Duration::from_secs(30));
    assert_disconnect("tcp", &err);
}
