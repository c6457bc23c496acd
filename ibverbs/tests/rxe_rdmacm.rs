//! The rdma_cm helper against soft-RoCE over 192.0.2.1 (rdma_cm refuses loopback):
//! two endpoints in one process and in two processes (the test re-executes its own
//! binary), connected by IP address and port with private data carrying the memory
//! descriptors, RDMA WRITE + SEND verified byte for byte on both sides, disconnects
//! seen by the peer, and every error a caller can provoke typed and bounded: nobody
//! listening, a rejecting listener, an address without an RDMA device, a host that does
//! not answer, oversized private data, no request arriving.

mod common;

use common::*;
use ibverbs::cm::{CmOptions, Connection, Listener, Route};
use ibverbs::*;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

const LEN: usize = 64 << 10;
const IP: &str = "192.0.2.1";

fn any_port() -> SocketAddr {
    format!("{IP}:0").parse().unwrap()
}

fn cm_opts(private_data: &[u8]) -> CmOptions {
    CmOptions {
        timeout: Duration::from_secs(20),
        private_data: private_data.to_vec(),
        ..Default::default()
    }
}

/// One side's resources: its own context on the device rdma_cm picked, PD, CQs, a
/// pattern-filled source, the buffer the peer writes into (advertised in the private
/// data), and an inbox for SENDs.
struct Side {
    _ctx: Context,
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    src: MemoryRegion,
    dst: MemoryRegion,
    inbox: MemoryRegion,
}

impl Side {
    fn new(device: &str, seed: u8) -> Side {
        let ctx = Context::open(device).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let send_cq = ctx.create_cq(64, None, 0).unwrap();
        let recv_cq = ctx.create_cq(64, None, 0).unwrap();
        let mut src = mr(&pd, LEN);
        src.as_mut_slice().copy_from_slice(&pattern(LEN, seed));
        let dst = mr(&pd, LEN);
        let inbox = mr(&pd, 4096);
        Side {
            _ctx: ctx,
            pd,
            send_cq,
            recv_cq,
            src,
            dst,
            inbox,
        }
    }
    fn qp(&self) -> PreparedQueuePair {
        self.pd
            .create_qp(QpType::RC, &self.send_cq, &self.recv_cq)
            .max_inline_data(64)
            .build()
            .unwrap()
    }
    fn post_inbox(&self, qp_recv: impl FnOnce(&mut [RecvWr<'_>])) {
        let sge = [self.inbox.sge(..)];
        qp_recv(&mut [RecvWr::new(77, &sge)]);
    }
}

/// WRITE our pattern into the peer's buffer, then SEND `note`; wait for both.
fn write_and_notify(side: &Side, conn: &Connection, peer: RemoteMemory, note: &[u8]) {
    let sge = [side.src.sge(..)];
    let inl = [InlineSge::new(note)];
    conn.post_send(&mut [
        SendWr::write(1, &sge, peer),
        SendWr::send_inline(2, &inl).signaled(),
    ])
    .unwrap();
    let wc = poll_one(&side.send_cq);
    wc.result().unwrap();
    assert_eq!(wc.wr_id(), 2);
}

/// Wait for the peer's SEND (the receive posted with `post_inbox`) and check it and
/// the bytes the peer wrote before it.
fn expect_written(side: &Side, note: &[u8], peer_seed: u8) {
    let wc = poll_one(&side.recv_cq);
    wc.result().unwrap();
    assert_eq!((wc.wr_id(), wc.opcode()), (77, WcOpcode::RECV));
    assert_eq!(&side.inbox.as_slice()[..wc.byte_len() as usize], note);
    assert!(
        side.dst.as_slice() == &pattern(LEN, peer_seed)[..],
        "RDMA WRITE from the peer: the {LEN} bytes differ from its pattern"
    );
}

fn remote_from(private_data: &[u8]) -> RemoteMemory {
    RemoteMemory::from_bytes(private_data).expect("a memory descriptor in the private data")
}

#[test]
fn connect_accept_in_one_process_write_send_disconnect() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let listener = Listener::bind(any_port()).unwrap();
    let addr = listener.local_addr().unwrap();
    assert_eq!(addr.ip().to_string(), IP);
    assert_ne!(addr.port(), 0, "port 0 picks a free port");
    let device = ctx.name().to_owned();

    // Passive side in a thread: accept, advertise its buffer in the accept's private
    // data, receive the client's WRITE + SEND, answer with its own.
    let server = std::thread::spawn(move || {
        let req = listener.get_request(Duration::from_secs(20)).unwrap();
        assert_eq!(req.device_name(), device);
        assert_eq!(req.local_addr(), Some(addr));
        assert_eq!(req.peer_addr().unwrap().ip().to_string(), IP);
        let client_mem = remote_from(req.private_data());
        let side = Side::new(&req.device_name(), 10);
        let mut qp = side.qp();
        req.init_qp(&mut qp).unwrap();
        side.post_inbox(|w| qp.post_recv(w).unwrap());
        let mut conn = req
            .accept(qp, &cm_opts(&side.dst.remote().to_bytes()))
            .unwrap();
        assert_eq!(conn.state().unwrap(), QpState::RTS);
        assert_eq!(remote_from(conn.private_data()), client_mem);
        expect_written(&side, b"from client", 20);
        side.post_inbox(|w| conn.post_recv(w).unwrap());
        write_and_notify(&side, &conn, client_mem, b"from server");
        // The client disconnects: we see it within a bounded time, the QP is in ERR.
        conn.wait_disconnected(Duration::from_secs(20)).unwrap();
        assert_eq!(conn.state().unwrap(), QpState::ERR);
        let wc = poll_one(&side.recv_cq);
        assert!(
            matches!(
                wc.result(),
                Err(Error::RemoteDisconnect {
                    status: WcStatus::WR_FLUSH_ERR,
                    wr_id: 77,
                    ..
                })
            ),
            "the unused receive is flushed: {wc:?}"
        );
    });

    let route = Route::resolve(addr, &cm_opts(&[])).unwrap();
    assert_eq!(route.device_name(), ctx.name());
    assert_eq!(route.port_num(), 1);
    let side = Side::new(&route.device_name(), 20);
    let mut qp = side.qp();
    route.init_qp(&mut qp).unwrap();
    assert_eq!(qp.state().unwrap(), QpState::INIT);
    side.post_inbox(|w| qp.post_recv(w).unwrap());
    let mut conn = route
        .connect(qp, &cm_opts(&side.dst.remote().to_bytes()))
        .unwrap();
    assert_eq!(conn.peer_addr(), Some(addr));
    let server_mem = remote_from(conn.private_data());
    assert_eq!(server_mem.len, LEN as u64);
    write_and_notify(&side, &conn, server_mem, b"from client");
    expect_written(&side, b"from server", 10);
    conn.disconnect(Duration::from_secs(20)).unwrap();
    assert_eq!(conn.state().unwrap(), QpState::ERR);
    conn.disconnect(Duration::from_secs(1)).unwrap(); // idempotent
    server.join().unwrap();
}

#[test]
fn connect_accept_across_two_processes() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let listener = Listener::bind(any_port()).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "peer_process",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("IBVERBS_CM_PEER", addr.to_string())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();

    let req = listener.get_request(Duration::from_secs(60)).unwrap();
    let child_mem = remote_from(req.private_data());
    let side = Side::new(ctx.name(), 30);
    let mut qp = side.qp();
    req.init_qp(&mut qp).unwrap();
    side.post_inbox(|w| qp.post_recv(w).unwrap());
    let mut conn = req
        .accept(qp, &cm_opts(&side.dst.remote().to_bytes()))
        .unwrap();
    // The child writes first; then we write into its buffer and tell it.
    expect_written(&side, b"child wrote", 40);
    write_and_notify(&side, &conn, child_mem, b"parent wrote");
    // The child verifies, disconnects and exits 0.
    conn.wait_disconnected(Duration::from_secs(60)).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "peer process: {status}");
}

/// The active side of `connect_accept_across_two_processes`, run only as its child.
#[test]
#[ignore = "peer process of connect_accept_across_two_processes"]
fn peer_process() {
    let addr: SocketAddr = std::env::var("IBVERBS_CM_PEER")
        .expect("run by connect_accept_across_two_processes")
        .parse()
        .unwrap();
    let _ctx = device().expect("RDMA_TEST_DEVICE is inherited");
    let route = Route::resolve(addr, &cm_opts(&[])).unwrap();
    let side = Side::new(&route.device_name(), 40);
    let mut qp = side.qp();
    route.init_qp(&mut qp).unwrap();
    side.post_inbox(|w| qp.post_recv(w).unwrap());
    let mut conn = route
        .connect(qp, &cm_opts(&side.dst.remote().to_bytes()))
        .unwrap();
    let parent_mem = remote_from(conn.private_data());
    write_and_notify(&side, &conn, parent_mem, b"child wrote");
    expect_written(&side, b"parent wrote", 30);
    conn.disconnect(Duration::from_secs(20)).unwrap();
}

#[test]
fn rejected_with_private_data() {
    let Some(_ctx) = device() else { return };
    let _g = serial();
    let listener = Listener::bind(any_port()).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let req = listener.get_request(Duration::from_secs(20)).unwrap();
        assert_eq!(&req.private_data()[..5], b"knock");
        assert!(
            req.private_data()[5..].iter().all(|&b| b == 0),
            "zero padding"
        );
        req.reject(b"go away").unwrap();
    });
    let route = Route::resolve(addr, &cm_opts(&[])).unwrap();
    let side = Side::new(&route.device_name(), 1);
    let err = route.connect(side.qp(), &cm_opts(b"knock")).unwrap_err();
    match &err {
        Error::Rejected {
            addr: a,
            private_data,
            reason,
        } => {
            assert_eq!(*a, addr);
            assert_eq!(&private_data[..7], b"go away", "{err}");
            assert!(private_data[7..].iter().all(|&b| b == 0), "zero padding");
            assert_eq!(*reason, 28, "IB_CM_REJ_CONSUMER_DEFINED");
        }
        other => panic!("{other}"),
    }
    assert_eq!(err.errno(), Some(libc::ECONNREFUSED));
    server.join().unwrap();
}

#[test]
fn typed_errors_without_a_peer() {
    let Some(ctx) = device() else { return };
    let _g = serial();
    let quick = CmOptions {
        timeout: Duration::from_secs(3),
        ..Default::default()
    };

    // Nobody listens on the port: the peer's CM refuses at once.
    let port = {
        let l = Listener::bind(any_port()).unwrap();
        l.local_addr().unwrap().port()
    };
    let addr: SocketAddr = format!("{IP}:{port}").parse().unwrap();
    let route = Route::resolve(addr, &quick).unwrap();
    let side = Side::new(&route.device_name(), 1);
    let err = route.connect(side.qp(), &quick).unwrap_err();
    assert!(
        matches!(err, Error::ConnectionRefused { addr: a } if a == addr),
        "{err}"
    );
    println!("no listener: {err}");
    assert_eq!(err.errno(), Some(libc::ECONNREFUSED));

    // An address no RDMA device serves (rdma_cm refuses loopback).
    let err = Route::resolve("127.0.0.1:7471".parse().unwrap(), &quick).unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
    println!("loopback: {err}");

    // A host on the subnet that does not exist: no answer, bounded by the timeout.
    let ghost: SocketAddr = "192.0.2.99:7471".parse().unwrap();
    let err = match Route::resolve(ghost, &quick) {
        Ok(route) => {
            let side = Side::new(&route.device_name(), 1);
            route.connect(side.qp(), &quick).unwrap_err()
        }
        Err(e) => e,
    };
    assert!(
        matches!(err, Error::Timeout { .. } | Error::Unreachable { .. }),
        "{err}"
    );
    println!("no such host: {err}");

    // More private data than a connect request carries.
    let l = Listener::bind(any_port()).unwrap();
    let route = Route::resolve(l.local_addr().unwrap(), &quick).unwrap();
    let side = Side::new(ctx.name(), 1);
    let err = route.connect(side.qp(), &cm_opts(&[7; 57])).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");

    // No request arrives.
    let err = l.get_request(Duration::from_millis(200)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert_eq!(err.errno(), Some(libc::ETIMEDOUT));

    // A QP in the wrong state: already connected elsewhere (RTS) QPs are refused by the
    // modify to INIT, typed.
    let route = Route::resolve(l.local_addr().unwrap(), &quick).unwrap();
    let mut qp = side.qp();
    qp.init(&opts(&ctx)).unwrap();
    qp.modify(&QpAttr::default().qp_state(QpState::ERR))
        .unwrap();
    let err = route.connect(qp, &quick).unwrap_err();
    assert!(matches!(err, Error::ModifyQp { .. }), "{err}");
}
