//! Two processes connected over a TCP side channel on 127.0.0.1 (the test re-executes
//! its own binary as the peer): RDMA READ and WRITE + SEND_WITH_IMM verified byte for
//! byte on both sides, then the peer is killed mid-stream and our next work request must
//! complete with a typed retry-exceeded (then flushed) error within a bounded time.

mod common;

use common::*;
use ibverbs::*;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LEN: usize = 64 << 10;

#[derive(Serialize, Deserialize)]
struct Hello {
    endpoint: Endpoint,
    memory: RemoteMemory,
}

fn send_line<T: Serialize>(s: &mut TcpStream, v: &T) {
    let mut line = serde_json::to_string(v).unwrap();
    line.push('\n');
    s.write_all(line.as_bytes()).unwrap();
}

fn recv_line<T: for<'de> Deserialize<'de>>(r: &mut BufReader<TcpStream>) -> T {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(!line.is_empty(), "side channel closed");
    serde_json::from_str(&line).unwrap()
}

#[test]
fn two_processes_rc_then_peer_killed() {
    let Some(ctx) = device() else { return };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "peer_process",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("IBVERBS_TEST_PEER", &addr)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "peer exited before connecting"
                );
                assert!(Instant::now() < deadline, "peer did not connect");
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("{e}"),
        }
    };
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut w = stream.try_clone().unwrap();
    let mut r = BufReader::new(stream);

    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None, 0).unwrap();
    // Short transport timeout and few retries so a dead peer is detected quickly.
    let o = ConnectOptions {
        timeout: 12,
        retry_cnt: 3,
        ..opts(&ctx)
    };
    let qp = prepared(&pd, &cq, QpType::RC);
    let local = qp.endpoint(&o).unwrap();
    let mut buf = mr(&pd, LEN);
    send_line(
        &mut w,
        &Hello {
            endpoint: local,
            memory: buf.remote(),
        },
    );
    let peer: Hello = recv_line(&mut r);
    let qp = qp.connect(&peer.endpoint, &o).unwrap();
    let _: String = recv_line(&mut r); // peer connected

    // READ the peer's pattern.
    let sge = [buf.sge(..)];
    qp.post_send(&mut [SendWr::read(1, &sge, peer.memory).signaled()])
        .unwrap();
    poll_one(&cq).result().unwrap();
    assert_eq!(
        buf.as_slice(),
        &pattern(LEN, 5)[..],
        "RDMA READ from the other process"
    );

    // WRITE ours, then tell the peer with SEND_WITH_IMM.
    buf.as_mut_slice().copy_from_slice(&pattern(LEN, 9));
    let sge = [buf.sge(..)];
    let note = [InlineSge::new(b"written")];
    qp.post_send(&mut [
        SendWr::write(2, &sge, peer.memory),
        SendWr::send_inline(3, &note).flags(SendFlags::SIGNALED),
    ])
    .unwrap();
    let wc = poll_one(&cq);
    wc.result().unwrap();
    assert_eq!(wc.wr_id(), 3);
    let verdict: String = recv_line(&mut r);
    assert_eq!(
        verdict, "verified",
        "the peer checked the bytes it received"
    );

    // Kill the peer mid-stream: its QP disappears; ours must report it.
    child.kill().unwrap();
    child.wait().unwrap();
    let start = Instant::now();
    qp.post_send(&mut [SendWr::write(4, &sge, peer.memory).signaled()])
        .unwrap();
    let wc = poll_one(&cq);
    let err = wc.result().unwrap_err();
    assert!(
        matches!(
            err,
            Error::RemoteDisconnect {
                status: WcStatus::RETRY_EXC_ERR,
                wr_id: 4,
                ..
            }
        ),
        "{err}"
    );
    println!("dead peer detected after {:?}", start.elapsed());
    assert_eq!(qp.state().unwrap(), QpState::ERR);
    qp.post_send(&mut [SendWr::write(5, &sge, peer.memory).signaled()])
        .unwrap();
    let err = poll_one(&cq).result().unwrap_err();
    assert!(
        matches!(
            err,
            Error::RemoteDisconnect {
                status: WcStatus::WR_FLUSH_ERR,
                ..
            }
        ),
        "{err}"
    );
}

/// The peer side, run only as a child of the test above.
#[test]
#[ignore = "peer process of two_processes_rc_then_peer_killed"]
fn peer_process() {
    let addr =
        std::env::var("IBVERBS_TEST_PEER").expect("run by two_processes_rc_then_peer_killed");
    let ctx = device().expect("RDMA_TEST_DEVICE is inherited");
    let stream = TcpStream::connect(addr).unwrap();
    let mut w = stream.try_clone().unwrap();
    let mut r = BufReader::new(stream);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None, 0).unwrap();
    let o = opts(&ctx);
    let qp = prepared(&pd, &cq, QpType::RC);
    let mut buf = mr(&pd, LEN);
    buf.as_mut_slice().copy_from_slice(&pattern(LEN, 5));
    let note = mr(&pd, 64);
    let nsg = [note.sge(..)];
    qp.post_recv(&mut [RecvWr::new(7, &nsg)]).unwrap_err(); // RESET: typed error
    let peer: Hello = recv_line(&mut r);
    send_line(
        &mut w,
        &Hello {
            endpoint: qp.endpoint(&o).unwrap(),
            memory: buf.remote(),
        },
    );
    let mut qp = qp;
    qp.init(&o).unwrap();
    qp.post_recv(&mut [RecvWr::new(7, &nsg)]).unwrap();
    let qp = qp.connect(&peer.endpoint, &o).unwrap();
    send_line(&mut w, &"connected");
    let wc = poll_one(&cq);
    wc.result().unwrap();
    assert_eq!((wc.wr_id(), wc.byte_len()), (7, 7));
    assert_eq!(&note.as_slice()[..7], b"written");
    assert_eq!(
        buf.as_slice(),
        &pattern(LEN, 9)[..],
        "RDMA WRITE from the other process"
    );
    send_line(&mut w, &"verified");
    // Stay alive (QP up) until killed.
    std::thread::sleep(Duration::from_secs(120));
    drop(qp);
}
