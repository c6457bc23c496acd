//! The `tcp` provider's MSG endpoints in one process: passive endpoint, connect/accept,
//! every data operation it advertises verified byte for byte, shutdown.

mod common;

use common::*;
use fabric::ffi;
use fabric::{
    Access, Address, Caps, CompletionQueue, Domain, Endpoint, EndpointBuilder, EndpointType, Error,
    EventQueue, Fabric, PassiveEndpoint,
};
use std::time::{Duration, Instant};

struct Connected {
    _fabric: Fabric,
    _pep: PassiveEndpoint,
    server: Endpoint,
    server_cq: CompletionQueue,
    client: Endpoint,
    client_cq: CompletionQueue,
}

fn msg_caps() -> Caps {
    Caps::MSG | Caps::RMA
}

/// A connected pair; `delivery`: the client's operations complete once delivered
/// (`FI_DELIVERY_COMPLETE`), so target-side errors reach its completions.
fn connect(delivery: bool) -> Connected {
    let info = hints("tcp", EndpointType::MSG, msg_caps())
        .get_first()
        .expect("tcp MSG");
    assert_eq!(info.provider_name(), "tcp");
    assert_eq!(info.ep_type(), EndpointType::MSG);
    let fabric = Fabric::new(&info).unwrap();
    let eq = EventQueue::new(&fabric).unwrap();
    let pep = PassiveEndpoint::listen(&fabric, &info, &eq).unwrap();
    let addr = pep.name().unwrap();

    let flags = if delivery {
        ffi::FI_DELIVERY_COMPLETE
    } else {
        0
    };
    let cinfo = hints("tcp", EndpointType::MSG, msg_caps())
        .tx_op_flags(flags)
        .get_first()
        .unwrap();
    let cfabric = Fabric::new(&cinfo).unwrap();
    let cdomain = Domain::new(&cfabric, &cinfo).unwrap();
    let client_cq = CompletionQueue::builder().open(&cdomain).unwrap();
    let ceq = EventQueue::new(&cfabric).unwrap();
    let client = EndpointBuilder::new(&cdomain, &cinfo)
        .cq(&client_cq)
        .eq(&ceq)
        .build()
        .unwrap();
    // Each side's handshake needs the other side progressed: the client connects and
    // waits on its own thread while the server accepts.
    let (server, server_cq) = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            client
                .connect(&addr)
                .and_then(|()| client.wait_connected(T))
        });
        let request = pep.wait_connreq(T).unwrap();
        let sdomain = Domain::new(&fabric, &request).unwrap();
        let server_cq = CompletionQueue::builder().open(&sdomain).unwrap();
        let server = EndpointBuilder::new(&sdomain, &request)
            .cq(&server_cq)
            .eq(&eq)
            .build()
            .unwrap();
        server.accept().unwrap();
        server.wait_connected(T).unwrap();
        waiter.join().unwrap().unwrap();
        (server, server_cq)
    });
    Connected {
        _fabric: fabric,
        _pep: pep,
        server,
        server_cq,
        client,
        client_cq,
    }
}

#[test]
fn connect_send_recv_shutdown() {
    watchdog(240);
    let c = connect(false);
    assert!(!c.client.peer().unwrap().is_empty());
    let len = 256 * 1024;
    let src = c.client.alloc_registered(len, Access::ALL).unwrap();
    let dst = c.server.alloc_registered(len, Access::ALL).unwrap();
    let mut src = src;
    src.as_mut_slice()
        .unwrap()
        .copy_from_slice(&pattern(len, 1));
    c.server.recv(&dst, 0..len, Address::UNSPEC, 1).unwrap();
    c.client
        .send_sync(&src, 0..len, Address::UNSPEC, 2, T)
        .unwrap();
    let got = c.server_cq.wait_for(1, T).unwrap();
    assert_eq!(got.len, len);
    assert!(dst.to_vec_volatile() == src.as_slice());

    // inject and senddata.
    let small = pattern(32, 3);
    c.server.recv(&dst, 0..64, Address::UNSPEC, 3).unwrap();
    c.client
        .retry(Instant::now() + T, || {
            c.client.inject(&small, Address::UNSPEC)
        })
        .unwrap();
    assert_eq!(c.server_cq.wait_for(3, T).unwrap().len, 32);
    assert_eq!(&dst.to_vec_volatile()[..32], &small[..]);
    c.server.recv(&dst, 0..64, Address::UNSPEC, 4).unwrap();
    c.client
        .retry(Instant::now() + T, || {
            c.client.senddata(&src, 0..64, 0x77, Address::UNSPEC, 5)
        })
        .unwrap();
    let got = c.server_cq.wait_for(4, T).unwrap();
    assert!(got.has(ffi::FI_REMOTE_CQ_DATA));
    assert_eq!(got.data, 0x77);
    c.client_cq.wait_for(5, T).unwrap();

    // Shutdown: the peer sees FI_SHUTDOWN.
    c.client.shutdown().unwrap();
    c.server.wait_shutdown(T).unwrap();
}

#[test]
fn rma_over_msg() {
    watchdog(240);
    let c = connect(true);
    let len = 1 << 20;
    let mut src = c.client.alloc_registered(len, Access::ALL).unwrap();
    src.as_mut_slice()
        .unwrap()
        .copy_from_slice(&pattern(len, 9));
    let target = c.server.alloc_registered(len, Access::ALL).unwrap();
    let remote = target.remote();
    c.client
        .write_sync(&src, 0..len, Address::UNSPEC, &remote, 0, 10, T)
        .unwrap();
    let deadline = Instant::now() + T;
    while target.to_vec_volatile() != src.as_slice() {
        assert!(Instant::now() < deadline, "written bytes did not arrive");
        std::thread::sleep(Duration::from_millis(2));
    }
    let back = c.client.alloc_registered(4096, Access::ALL).unwrap();
    c.client
        .read_sync(&back, 0..4096, Address::UNSPEC, &remote, 4096, 11, T)
        .unwrap();
    assert_eq!(back.to_vec_volatile(), &src.as_slice()[4096..8192]);
    // writedata: remote CQ data at the server.
    c.client
        .retry(deadline, || {
            c.client
                .writedata(&src, 0..4096, 0x1234, Address::UNSPEC, &remote, 0, 12)
        })
        .unwrap();
    c.client_cq.wait_for(12, T).unwrap();
    let got = loop {
        if let Some(got) = c.server_cq.read_one().unwrap() {
            break got;
        }
        assert!(Instant::now() < deadline, "no remote CQ data");
    };
    assert!(got.has(ffi::FI_REMOTE_CQ_DATA), "{got:?}");
    assert_eq!(got.data, 0x1234);
    // Wrong key: tcp refuses the write by dropping the connection. The refused write may
    // itself complete (tcp completes writes once sent); at the latest the next operation
    // fails with a typed RemoteDisconnect completion. Nothing lands.
    let mut other = c.client.alloc_registered(4096, Access::ALL).unwrap();
    other
        .as_mut_slice()
        .unwrap()
        .copy_from_slice(&pattern(4096, 99));
    let mut bad = remote;
    bad.key ^= 0xff00;
    let mut outcome = c
        .client
        .write_sync(&other, 0..4096, Address::UNSPEC, &bad, 0, 13, T)
        .map(drop);
    let probe = c.client.alloc_registered(8, Access::ALL).unwrap();
    let deadline = Instant::now() + T;
    let mut context = 14;
    while outcome.is_ok() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        outcome = c
            .client
            .read_sync(&probe, 0..8, Address::UNSPEC, &remote, 0, context, T)
            .map(drop);
        context += 1;
    }
    match outcome {
        Err(Error::RemoteDisconnect {
            completion: Some(failed),
            ..
        }) => {
            assert!(
                failed.errno == ffi::FI_ENOTCONN || failed.errno == ffi::FI_ECONNRESET,
                "{failed}"
            );
        }
        other => panic!("wrong key over tcp MSG: {other:?}"),
    }
    assert!(
        target.to_vec_volatile()[..4096] != other.as_slice()[..],
        "bytes landed with a wrong key"
    );
}

#[test]
fn absent_capabilities_are_unsupported() {
    watchdog(240);
    // tcp's MSG endpoints have no atomics, no tagged messages and no FI_HMEM.
    let info = hints("tcp", EndpointType::MSG, msg_caps())
        .get_first()
        .unwrap();
    assert!(!info.caps().contains(Caps::ATOMIC));
    assert!(!info.caps().contains(Caps::HMEM));
    for caps in [Caps::ATOMIC, Caps::TAGGED, Caps::HMEM] {
        match hints("tcp", EndpointType::MSG, msg_caps() | caps).get() {
            Err(Error::Unsupported { errno, .. }) => assert_eq!(errno, ffi::FI_ENODATA),
            other => panic!("{caps:?}: {other:?}"),
        }
    }
}

#[test]
fn connect_refused_is_an_error() {
    watchdog(240);
    // A listener that is closed before the connect: the client gets an error event.
    let info = hints("tcp", EndpointType::MSG, msg_caps())
        .get_first()
        .unwrap();
    let fabric = Fabric::new(&info).unwrap();
    let addr = {
        let eq = EventQueue::new(&fabric).unwrap();
        let pep = PassiveEndpoint::listen(&fabric, &info, &eq).unwrap();
        pep.name().unwrap()
    };
    let domain = Domain::new(&fabric, &info).unwrap();
    let cq = CompletionQueue::builder().open(&domain).unwrap();
    let eq = EventQueue::new(&fabric).unwrap();
    let ep = EndpointBuilder::new(&domain, &info)
        .cq(&cq)
        .eq(&eq)
        .build()
        .unwrap();
    let result = ep.connect(&addr).and_then(|()| ep.wait_connected(T));
    match result {
        Err(Error::RemoteDisconnect { errno, .. }) => assert_eq!(errno, ffi::FI_ECONNREFUSED),
        other => panic!("connect to a closed listener: {other:?}"),
    }
}
