use super::*;
use crate::backends::peer_dram::mailbox;

fn wait_for(listener: &OobListener, n: usize) -> Vec<(String, Vec<u8>)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} arrived",
            got.len()
        );
        listener.take(&mut got);
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

fn listen(me: &str) -> OobListener {
    OobListener::bind(interface_address(None).unwrap(), me).unwrap()
}

/// A sender whose connections nobody records: a process playing another agent.
fn impostor(name: &str, peer: &str, addr: SocketAddr) -> OobSender {
    OobSender::new(name, peer, addr, Arc::new(OwnConns::default()))
}

/// The next direct-copy answer on `conn` (10 s at most).
fn wait_answer(conn: &ControlConn) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = None;
    while got.is_none() {
        assert!(Instant::now() < deadline, "no answer");
        conn.poll(|kind, body| {
            assert_eq!(kind, CONTROL_PEER_COPY);
            got = Some(body.to_vec());
        })
        .unwrap();
    }
    got.unwrap()
}

/// What a lane server gets: a lane, or a doorbell.
enum LaneJob {
    Lane(ControlFrom, std::sync::Weak<Mailbox>, Arc<ControlReply>),
    Wake,
}

/// Serves the lanes `listener` hands over on a thread of its own, as `peer_dram`'s
/// serving thread does: each request answered with `answer`; after 20 ms without one it
/// says it sleeps in its lanes and blocks until a lane or a doorbell comes. Stops when
/// the listener (its sender) goes.
fn serve_lanes_on_a_thread(
    listener: &OobListener,
    answer: impl Fn(&ControlFrom, &[u8], &ControlReply) + Send + 'static,
) {
    let (jobs, incoming) = mpsc::channel::<LaneJob>();
    let (lanes_to, bells_to) = (Mutex::new(jobs.clone()), Mutex::new(jobs));
    listener.serve_lanes_with(LaneHandler {
        take: Box::new(move |from, lane, reply| {
            let _ = lanes_to.lock().send(LaneJob::Lane(from, lane, reply));
        }),
        wake: Box::new(move || {
            let _ = bells_to.lock().send(LaneJob::Wake);
        }),
    });
    std::thread::spawn(move || {
        let mut lanes = Vec::new();
        let mut buf = Vec::new();
        let mut served_at = Instant::now();
        let take = |job, lanes: &mut Vec<_>| {
            if let LaneJob::Lane(from, lane, reply) = job {
                lanes.push((from, lane, reply));
            }
        };
        loop {
            while let Ok(job) = incoming.try_recv() {
                take(job, &mut lanes);
            }
            for (from, lane, reply) in &lanes {
                let Some(lane) = std::sync::Weak::upgrade(lane) else {
                    continue;
                };
                while let Ok(true) = lane.pop_request(&mut buf) {
                    answer(from, &buf, reply);
                    served_at = Instant::now();
                }
            }
            if served_at.elapsed() < Duration::from_millis(20) {
                std::thread::yield_now();
                continue;
            }
            let live: Vec<Arc<Mailbox>> = lanes
                .iter()
                .filter_map(|(_, lane, _)| lane.upgrade())
                .collect();
            for lane in &live {
                lane.set_asleep(true);
            }
            if !live.iter().any(|lane| lane.has_request()) {
                match incoming.recv() {
                    Ok(job) => take(job, &mut lanes),
                    Err(_) => return,
                }
            }
            for lane in &live {
                lane.set_asleep(false);
            }
            served_at = Instant::now();
        }
    });
}

/// Echoes a request with the verdict on its connection: 1 confirmed, 0 not.
fn echo_verdict(from: &ControlFrom, body: &[u8], reply: &ControlReply) {
    let mut answer = body.to_vec();
    answer.push(u8::from(from.verified));
    reply.send(CONTROL_PEER_COPY, &answer).unwrap();
}

/// Waits until `check` holds (10 s at most).
fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn notifications_arrive_in_order_with_the_sender_name() {
    let listener = listen("bob");
    let tx = impostor("alice", "bob", listener.addr());
    for i in 0..100u32 {
        tx.send(&i.to_le_bytes()).unwrap();
    }
    tx.send(b"").unwrap();
    let got = wait_for(&listener, 101);
    for (i, (who, msg)) in got.iter().enumerate().take(100) {
        assert_eq!(who, "alice");
        assert_eq!(msg, &(i as u32).to_le_bytes());
    }
    assert!(got[100].1.is_empty());
    tx.alive().unwrap();
    assert!(matches!(
        tx.send(&vec![0; MAX_FRAME + 1]),
        Err(Error::InvalidParam(_))
    ));
}

#[test]
fn a_loaded_peer_is_asked_and_its_own_connection_accepted() {
    let bob = listen("bob");
    let alice = listen("alice");
    bob.know("alice", alice.addr());
    let tx = OobSender::new("alice", "bob", bob.addr(), alice.own_conns());
    tx.send(b"hello").unwrap();
    tx.send(b"again").unwrap();
    let got = wait_for(&bob, 2);
    assert_eq!(got[0], ("alice".to_string(), b"hello".to_vec()));
    assert_eq!(got[1], ("alice".to_string(), b"again".to_vec()));
    assert_eq!(bob.refused(), 0);
}

/// A process that is not `alice` names her: once she is loaded at bob's, bob asks
/// her at the address her metadata advertised, she does not know the connection,
/// and nothing it sends is delivered — neither before she was loaded (asked about
/// then) nor after.
#[test]
fn a_hello_naming_a_loaded_peer_from_elsewhere_is_refused() {
    let bob = listen("bob");
    let alice = listen("alice");
    bob.know("alice", alice.addr());
    let forged = impostor("alice", "bob", bob.addr());
    forged.send(b"forged 1").unwrap();
    forged.send(b"forged 2").unwrap();
    eventually("the forged connection was refused", || bob.refused() == 1);
    // Bob's own name, from a process that is not bob.
    let me_too = impostor("bob", "bob", bob.addr());
    me_too.send(b"forged 3").unwrap();
    eventually("the second was refused", || bob.refused() == 2);
    // The real alice still gets through.
    let real = OobSender::new("alice", "bob", bob.addr(), alice.own_conns());
    real.send(b"real").unwrap();
    let got = wait_for(&bob, 1);
    assert_eq!(got, vec![("alice".to_string(), b"real".to_vec())]);
    std::thread::sleep(Duration::from_millis(100));
    let mut more = Vec::new();
    bob.take(&mut more);
    assert!(more.is_empty(), "forged notifications delivered: {more:?}");
}

#[test]
fn a_connection_taken_before_its_name_was_loaded_is_asked_about_then() {
    let bob = listen("bob");
    let alice = listen("alice");
    let forged = impostor("alice", "bob", bob.addr());
    forged.send(b"before").unwrap();
    // Not loaded: taken under its word, as NIXL's targets need not load initiators.
    assert_eq!(wait_for(&bob, 1)[0].0, "alice");
    bob.know("alice", alice.addr());
    eventually("asked about once alice was loaded", || bob.refused() == 1);
    let _ = forged.send(b"after");
    std::thread::sleep(Duration::from_millis(100));
    let mut more = Vec::new();
    bob.take(&mut more);
    assert!(
        more.is_empty(),
        "delivered after alice was loaded: {more:?}"
    );
}

/// Whether the listener closed `s` within `within` (a timeout is not a close).
fn closed_by_listener(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut byte = [0u8; 1];
    match s.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn connections_are_capped_and_first_frames_bounded_in_size_and_time() {
    let bob = listen("bob");
    // Silent connections up to the cap, then one more: closed at once.
    let mut silent: Vec<TcpStream> = (0..MAX_CONNS)
        .map(|_| TcpStream::connect(bob.addr()).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut over = TcpStream::connect(bob.addr()).unwrap();
    assert!(
        closed_by_listener(&mut over, Duration::from_secs(2)),
        "over the cap: closed"
    );
    // A first frame announcing more than the limit: closed without waiting for it.
    let mut big = silent.pop().unwrap();
    drop(silent.drain(..10));
    std::thread::sleep(Duration::from_millis(100));
    let mut huge = TcpStream::connect(bob.addr()).unwrap();
    huge.write_all(&(MAX_FRAME as u32).to_le_bytes()).unwrap();
    assert!(
        closed_by_listener(&mut huge, Duration::from_secs(2)),
        "oversized first frame"
    );
    // The silent ones are closed once their first frame is overdue.
    let started = Instant::now();
    assert!(
        closed_by_listener(&mut big, FIRST_FRAME_TIMEOUT * 2),
        "silent: closed"
    );
    assert!(started.elapsed() >= FIRST_FRAME_TIMEOUT / 2);
    // And a sender still gets through.
    let tx = impostor("alice", "bob", bob.addr());
    tx.send(b"through").unwrap();
    assert_eq!(wait_for(&bob, 1)[0].1, b"through");
}

#[test]
fn frames_grow_with_the_bytes_that_arrive() {
    let mut frames = FrameBuf::default();
    frames.push(&(MAX_FRAME as u32).to_le_bytes());
    frames.push(b"abc");
    assert_eq!(frames.next(MAX_FRAME), Ok(None));
    assert!(
        frames.buf.capacity() < 1024,
        "allocated from the length field"
    );
    assert!(frames.next(MAX_FRAME - 1).is_err());
    let mut frames = FrameBuf::default();
    frames.push(&3u32.to_le_bytes());
    frames.push(b"ab");
    assert_eq!(frames.next(8), Ok(None));
    frames.push(b"c");
    assert_eq!(frames.next(8), Ok(Some(b"abc".to_vec())));
    for first in [
        First::Hello("agent".into()),
        First::Verify {
            sender: "10.0.0.1:5".parse().unwrap(),
            receiver: "[::1]:6".parse().unwrap(),
        },
    ] {
        assert_eq!(First::decode(&first.encode()), Ok(first));
    }
    assert!(First::decode(b"NXOH\x01").is_err());
    assert!(First::decode(b"agent").is_err());
}

#[test]
fn a_vanished_receiver_is_a_remote_disconnect() {
    let listener = listen("bob");
    let addr = listener.addr();
    let tx = impostor("alice", "bob", addr);
    tx.send(b"first").unwrap();
    wait_for(&listener, 1);
    drop(listener);
    // The serving thread stops at once and closes its connections.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tx.alive() {
            Err(Error::RemoteDisconnect { agent, .. }) => {
                assert_eq!(agent, "bob");
                break;
            }
            Err(e) => panic!("{e}"),
            Ok(()) => {
                assert!(Instant::now() < deadline, "the close was not seen");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    assert!(matches!(
        tx.send(b"again"),
        Err(Error::RemoteDisconnect { .. })
    ));
    // Nobody listening at all: refused at connect.
    let never = impostor("alice", "carol", addr);
    assert!(matches!(
        never.send(b"x"),
        Err(Error::RemoteDisconnect { .. })
    ));
}

#[test]
fn interface_names_and_addresses() {
    assert_eq!(
        interface_address(Some("lo")).unwrap(),
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    );
    assert_eq!(
        interface_address(Some("10.1.2.3")).unwrap(),
        "10.1.2.3".parse::<IpAddr>().unwrap()
    );
    assert!(matches!(
        interface_address(Some("no-such-if0")),
        Err(Error::InvalidParam(_))
    ));
}

/// A control connection: requests reach the handler attributed to the connection's
/// confirmed name (an impostor's are marked unconfirmed), answers come back on the
/// same connection, and its notifications land in the inbox under that name. Also
/// measures the host side of one request's round trip (loopback, no GPU).
/// `rounds` request/answer round trips (64-byte requests, 18-byte answers: a 1 MiB
/// request and its `Done`) between this thread and a helper over a connected pair of
/// streams, both sides reading without blocking and yielding between reads (as the
/// initiator's wait and a polling server do). The transport floor of a control
/// connection, without framing, threads' hand-offs or attribution.
fn stream_round_trip<S>(mut near: S, mut far: S, rounds: u32) -> Duration
where
    S: std::io::Read + std::io::Write + Send + 'static,
{
    fn read_exact_spinning(s: &mut impl std::io::Read, buf: &mut [u8]) {
        let mut at = 0;
        while at < buf.len() {
            match s.read(&mut buf[at..]) {
                Ok(0) => panic!("end of stream"),
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
    }
    let helper = std::thread::spawn(move || {
        let mut req = [0u8; 64];
        for _ in 0..rounds + 1 {
            read_exact_spinning(&mut far, &mut req);
            far.write_all(&[1u8; 18]).unwrap();
        }
    });
    let mut answer = [0u8; 18];
    // One round to warm up.
    near.write_all(&[7u8; 64]).unwrap();
    read_exact_spinning(&mut near, &mut answer);
    let start = Instant::now();
    for _ in 0..rounds {
        near.write_all(&[7u8; 64]).unwrap();
        read_exact_spinning(&mut near, &mut answer);
    }
    let per = start.elapsed() / rounds;
    helper.join().unwrap();
    per
}

/// The host side of a direct-copy request's round trip on each layer it crosses,
/// answered without copying (no GPU): TCP on loopback and a Unix-domain socket pair
/// (the transport floor), then a control connection to a listener answering in its
/// handler (the listener thread alone: how `peer_dram` starts copies now), on TCP
/// and on the listener's Unix socket, through a shared lane served by a thread of its
/// own (how `peer_dram` serves same-host peers now), then one handing each request to a
/// serving thread that answers (how `peer_dram` started copies before). Prints the figures
/// (docs/BENCHMARKS.md keeps them, with LIBFABRIC's `shm` rail measured by
/// `fi_pingpong -p shm` beside); the bounds are loose so a loaded CI machine passes.
#[test]
fn control_round_trips_on_the_host_by_layer() {
    let rounds = 5000;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let near = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (far, _) = listener.accept().unwrap();
    for s in [&near, &far] {
        s.set_nodelay(true).unwrap();
        s.set_nonblocking(true).unwrap();
    }
    let tcp = stream_round_trip(near, far, rounds);
    let (near, far) = std::os::unix::net::UnixStream::pair().unwrap();
    for s in [&near, &far] {
        s.set_nonblocking(true).unwrap();
    }
    let unix = stream_round_trip(near, far, rounds);

    let round_trips = |handler: ControlHandler, local: bool, lane: bool| -> Duration {
        let bob = listen("bob");
        let alice = listen("alice");
        bob.know("alice", alice.addr());
        bob.know_process("alice", LocalIdentity::me());
        bob.serve_control(handler);
        if lane {
            // A lane is served by a thread of its own, as `peer_dram`'s serving thread.
            serve_lanes_on_a_thread(&bob, |from, _, reply| {
                assert!(from.verified);
                reply.send(CONTROL_PEER_COPY, &[1u8; 18]).unwrap();
            });
        }
        let conn = if local {
            let me = LocalIdentity::me().unwrap();
            let name = bob.unix_name().unwrap();
            ControlConn::connect_local("alice", "bob", name, &me, alice.own_conns()).unwrap()
        } else {
            ControlConn::connect("alice", "bob", bob.addr(), alice.own_conns()).unwrap()
        };
        assert_eq!(matches!(conn.stream, Stream::Unix(_)), local);
        if lane {
            eventually("the lane", || {
                conn.poll(|_, _| {}).unwrap();
                conn.lane.get().is_some()
            });
        }
        let once = || {
            if lane {
                assert!(conn.send_request(&[7u8; 64]).unwrap(), "through the lane");
            } else {
                conn.send(CONTROL_PEER_COPY, &[7u8; 64]).unwrap();
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut got = false;
            while !got {
                assert!(Instant::now() < deadline, "no answer");
                conn.poll(|_, _| got = true).unwrap();
                if !got {
                    std::thread::yield_now();
                }
            }
        };
        once();
        let start = Instant::now();
        for _ in 0..rounds {
            once();
        }
        start.elapsed() / rounds
    };
    let answer_at_once = || {
        ControlHandler(Box::new(
            |from: ControlFrom, _: &[u8], reply: Arc<ControlReply>| {
                assert!(from.verified);
                reply.send(CONTROL_PEER_COPY, &[1u8; 18]).unwrap();
            },
        ))
    };
    let in_handler = round_trips(answer_at_once(), false, false);
    let on_unix = round_trips(answer_at_once(), true, false);
    let on_lane = round_trips(answer_at_once(), true, true);
    // A serving thread polling for requests (yielding), as `peer_dram`'s does.
    let (jobs, incoming) = std::sync::mpsc::channel::<Arc<ControlReply>>();
    let server = std::thread::spawn(move || loop {
        match incoming.try_recv() {
            Ok(reply) => reply.send(CONTROL_PEER_COPY, &[1u8; 18]).unwrap(),
            Err(std::sync::mpsc::TryRecvError::Empty) => std::thread::yield_now(),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
        }
    });
    let jobs = Mutex::new(jobs);
    let handed_off = round_trips(
        ControlHandler(Box::new(move |_, _, reply| {
            let _ = jobs.lock().send(reply);
        })),
        false,
        false,
    );
    server.join().unwrap();
    eprintln!(
        "request/answer round trip on the host: TCP loopback {tcp:?}, Unix socket pair \
         {unix:?}; control connection answered by its listener: TCP {in_handler:?}, \
         Unix socket {on_unix:?}, shared lane served by its thread {on_lane:?}; TCP, handed to a serving thread \
         {handed_off:?}"
    );
    for per in [tcp, unix, in_handler, on_unix, on_lane, handed_off] {
        assert!(per < Duration::from_millis(5), "{per:?} per round trip");
    }
}

#[test]
fn a_confirmed_same_host_connection_gets_a_lane_that_carries_requests_and_answers() {
    let bob = listen("bob");
    let alice = listen("alice");
    bob.know_process("alice", LocalIdentity::me());
    // Requests on a connection, and in a lane (served by a thread of its own).
    bob.serve_control(ControlHandler(Box::new(
        |from: ControlFrom, body: &[u8], reply: Arc<ControlReply>| {
            echo_verdict(&from, body, &reply)
        },
    )));
    serve_lanes_on_a_thread(&bob, echo_verdict);
    let me = LocalIdentity::me().unwrap();
    let name = bob.unix_name().unwrap().to_vec();
    let round = |conn: &ControlConn, body: &[u8]| -> (bool, Vec<u8>) {
        let laned = conn.send_request(body).unwrap();
        (laned, wait_answer(conn))
    };
    let conn = ControlConn::connect_local("alice", "bob", &name, &me, alice.own_conns()).unwrap();
    // The lane comes with the first frames the initiator reads.
    eventually("the lane", || {
        conn.poll(|_, _| {}).unwrap();
        conn.lane.get().is_some()
    });
    let mut laned = 0;
    for i in 0..(3 * mailbox::REQUEST_SLOTS as u8) {
        let (through_lane, answer) = round(&conn, &[i; 64]);
        laned += usize::from(through_lane);
        let mut want = vec![i; 64];
        want.push(1);
        assert_eq!(answer, want, "request {i}");
    }
    assert_eq!(
        laned,
        3 * mailbox::REQUEST_SLOTS as usize,
        "every request in the lane"
    );
    // A request too long for a slot goes on the connection, and is answered.
    let long = vec![9u8; mailbox::REQUEST_SLOT];
    let (through_lane, answer) = round(&conn, &long);
    assert!(!through_lane);
    assert_eq!(answer.len(), long.len() + 1);
    // An idle lane server says it sleeps; a request then rings the connection, whose
    // listener wakes the server, and is answered.
    let lane = conn.lane.get().unwrap().clone();
    eventually("the target asleep", || lane.target_asleep());
    let (through_lane, answer) = round(&conn, &[42; 8]);
    assert!(through_lane);
    assert_eq!(answer, [42, 42, 42, 42, 42, 42, 42, 42, 1]);

    // No lane on TCP, nor for a same-host name the listener cannot confirm.
    let tcp = ControlConn::connect("alice", "bob", bob.addr(), alice.own_conns()).unwrap();
    let stranger =
        ControlConn::connect_local("mallory", "bob", &name, &me, Arc::new(OwnConns::default()))
            .unwrap();
    for (conn, verified) in [(&tcp, 0u8), (&stranger, 0)] {
        let (through_lane, answer) = round(conn, b"hi");
        assert!(!through_lane);
        assert_eq!(answer, [b'h', b'i', verified]);
        assert!(conn.lane.get().is_none());
    }
}

#[test]
fn a_lane_handler_gets_each_lane_serves_it_and_is_rung_while_it_sleeps() {
    let bob = listen("bob");
    let alice = listen("alice");
    bob.know_process("alice", LocalIdentity::me());
    type Taken = (ControlFrom, std::sync::Weak<Mailbox>, Arc<ControlReply>);
    let taken: Arc<Mutex<Vec<Taken>>> = Arc::default();
    let rung = Arc::new(AtomicU64::new(0));
    let (into, bells) = (taken.clone(), rung.clone());
    bob.serve_lanes_with(LaneHandler {
        take: Box::new(move |from, lane, reply| into.lock().push((from, lane, reply))),
        wake: Box::new(move || {
            bells.fetch_add(1, Ordering::Relaxed);
        }),
    });
    bob.serve_control(ControlHandler(Box::new(|_, _, _| {
        panic!("a laned request reached the listener's handler")
    })));
    let me = LocalIdentity::me().unwrap();
    let name = bob.unix_name().unwrap().to_vec();
    let conn = ControlConn::connect_local("alice", "bob", &name, &me, alice.own_conns()).unwrap();
    eventually("the lane", || {
        conn.poll(|_, _| {}).unwrap();
        conn.lane.get().is_some()
    });
    let (from, lane, reply) = taken.lock().pop().expect("the handler got the lane");
    assert_eq!(from.agent, "alice");
    assert!(from.verified);
    let served = lane.upgrade().unwrap();
    let mut request = Vec::new();
    for round in 0..2u8 {
        if round == 1 {
            // The server says it sleeps: a request then rings the connection.
            served.set_asleep(true);
        }
        assert!(conn.send_request(&[round; 32]).unwrap());
        assert!(served.pop_request(&mut request).unwrap());
        assert_eq!(request, [round; 32]);
        reply.send(CONTROL_PEER_COPY, &[round + 100]).unwrap();
        let mut got = None;
        eventually("the answer", || {
            conn.poll(|_, body| got = Some(body.to_vec())).unwrap();
            got.is_some()
        });
        assert_eq!(got.unwrap(), [round + 100]);
    }
    eventually("the doorbell", || rung.load(Ordering::Relaxed) == 1);
    drop(served);
    // The lane goes with its connection.
    drop(conn);
    eventually("the lane gone", || lane.upgrade().is_none());
}

#[test]
fn control_connections_carry_requests_answers_and_notifications() {
    let bob = listen("bob");
    let alice = listen("alice");
    bob.know("alice", alice.addr());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    bob.serve_control(ControlHandler(Box::new(move |from, body, reply| {
        log.lock().push((from.clone(), body.to_vec()));
        // Echo with the verdict: 1 confirmed, 0 not.
        let mut answer = body.to_vec();
        answer.push(u8::from(from.verified));
        reply.send(CONTROL_PEER_COPY, &answer).unwrap();
    })));
    let conn = ControlConn::connect("alice", "bob", bob.addr(), alice.own_conns()).unwrap();
    conn.send(CONTROL_PEER_COPY, b"req-1").unwrap();
    assert_eq!(wait_answer(&conn), b"req-1\x01");
    // The host side of a request's round trip, answered at once (the figure goes to
    // docs/BENCHMARKS.md; here only a loose bound, so a loaded CI machine passes).
    let rounds = 2000;
    let start = Instant::now();
    for _ in 0..rounds {
        conn.send(CONTROL_PEER_COPY, &[7u8; 64]).unwrap();
        wait_answer(&conn);
    }
    let per = start.elapsed() / rounds;
    eprintln!("control request round trip (loopback, answered at once): {per:?}");
    assert!(per < Duration::from_millis(5), "{per:?} per round trip");
    conn.send(CONTROL_NOTIF, b"after the last byte").unwrap();
    assert_eq!(
        wait_for(&bob, 1),
        vec![("alice".to_string(), b"after the last byte".to_vec())]
    );
    // An impostor naming alice: bob asks her, she does not know the connection, and
    // it is closed before a frame is read.
    let forged =
        ControlConn::connect("alice", "bob", bob.addr(), Arc::new(OwnConns::default())).unwrap();
    forged.send(CONTROL_PEER_COPY, b"forged").unwrap();
    eventually("the forged control connection was refused", || {
        bob.refused() == 1
    });
    eventually("the impostor sees its connection closed", || {
        forged.poll(|_, _| {}).is_err()
    });
    // A name nobody loaded: served, but unconfirmed (the handler declines those).
    let stranger =
        ControlConn::connect("carol", "bob", bob.addr(), Arc::new(OwnConns::default())).unwrap();
    stranger.send(CONTROL_PEER_COPY, b"who").unwrap();
    assert_eq!(wait_answer(&stranger), b"who\x00");
    assert!(seen
        .lock()
        .iter()
        .all(|(from, body)| body != b"forged" && (from.agent == "alice") == from.verified));
}

/// Same-host control connections on the Unix socket are attributed by the kernel's
/// word: a loaded peer's name only from the process it advertised (refused and
/// counted otherwise, as is a loaded peer that advertised no process), a name
/// nobody loaded is the sender's word; an initiator checks that the socket is held
/// by the process advertised before it sends anything.
#[test]
fn unix_control_connections_are_attributed_by_the_connecting_process() {
    let bob = listen("bob");
    let alice = listen("alice");
    let me = LocalIdentity::me().expect("/proc says who this process is");
    let other = LocalIdentity {
        start_time: me.start_time + 1,
        ..me
    };
    bob.know("alice", alice.addr());
    bob.know_process("alice", Some(me));
    // Mallory advertised another process (this pid, another start time); Trent
    // advertised none.
    bob.know("mallory", alice.addr());
    bob.know_process("mallory", Some(other));
    bob.know("trent", alice.addr());
    // Victor advertised another pid (init's, with its real start time).
    bob.know("victor", alice.addr());
    bob.know_process(
        "victor",
        Some(LocalIdentity {
            pid: 1,
            start_time: proc_state(1).map_or(0, |(_, start)| start),
            ..me
        }),
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    bob.serve_control(ControlHandler(Box::new(move |from, body, reply| {
        log.lock().push((from.clone(), body.to_vec()));
        let mut answer = body.to_vec();
        answer.push(u8::from(from.verified));
        reply.send(CONTROL_PEER_COPY, &answer).unwrap();
    })));
    let name = bob.unix_name().expect("a Unix socket is bound").to_vec();
    let local = |agent: &str| {
        ControlConn::connect_local(agent, "bob", &name, &me, Arc::new(OwnConns::default())).unwrap()
    };
    let answer = |conn: &ControlConn| -> Option<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut got = None;
            if conn.poll(|_, body| got = Some(body.to_vec())).is_err() {
                return None;
            }
            if got.is_some() {
                return got;
            }
            assert!(Instant::now() < deadline, "no answer");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // Alice from the process she advertised: confirmed, with no TCP verification.
    let conn = local("alice");
    assert!(matches!(conn.stream, Stream::Unix(_)));
    conn.send(CONTROL_PEER_COPY, b"req").unwrap();
    assert_eq!(answer(&conn).unwrap(), b"req\x01");
    conn.send(CONTROL_NOTIF, b"after the last byte").unwrap();
    assert_eq!(
        wait_for(&bob, 1),
        vec![("alice".to_string(), b"after the last byte".to_vec())]
    );
    // A loaded peer's name from a process it did not advertise (another start time,
    // another pid), or from any process where it advertised none: refused before a
    // frame is read.
    for (n, agent) in ["mallory", "trent", "victor"].into_iter().enumerate() {
        let conn = local(agent);
        // The refusal may close the connection before this is sent.
        let _ = conn.send(CONTROL_PEER_COPY, b"forged");
        eventually("the connection is refused", || {
            bob.refused() == n as u64 + 1
        });
        assert_eq!(answer(&conn), None, "{agent}'s connection is closed");
    }
    // A name nobody loaded: served, but unconfirmed.
    let conn = local("carol");
    conn.send(CONTROL_PEER_COPY, b"who").unwrap();
    assert_eq!(answer(&conn).unwrap(), b"who\x00");
    // Loaded later as this process: the connection taken under the name is
    // confirmed from then on.
    bob.know("carol", alice.addr());
    bob.know_process("carol", Some(me));
    eventually("carol's connection is confirmed", || {
        conn.send(CONTROL_PEER_COPY, b"again").unwrap();
        answer(&conn).unwrap() == b"again\x01"
    });
    assert!(seen.lock().iter().all(|(_, body)| body != b"forged"));
    // The initiator's side: a socket held by another process than the one advertised
    // is not used (nothing is sent on it), nor one nobody holds.
    let before = seen.lock().len();
    let e =
        ControlConn::connect_local("alice", "bob", &name, &other, Arc::new(OwnConns::default()))
            .unwrap_err();
    assert!(matches!(e, Error::Unreachable { .. }), "{e}");
    assert!(ControlConn::connect_local(
        "alice",
        "bob",
        b"nixl-gpunetio-nobody",
        &me,
        Arc::new(OwnConns::default())
    )
    .is_err());
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(seen.lock().len(), before);
    assert_eq!(bob.refused(), 3);
}
