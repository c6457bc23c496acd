//! Agent behaviour that needs no network: the LOCAL backend, every bad-input check,
//! metadata round trips and the peer-to-peer listener.

mod common;

use nixl::{Agent, AgentConfig, Desc, DescList, Error, MemKind, XferOp, XferStatus};
use std::time::{Duration, Instant};

fn agent(name: &str) -> Agent {
    let agent = Agent::new(name, AgentConfig::default()).unwrap();
    agent.create_backend("LOCAL", &Default::default()).unwrap();
    agent
}

fn dram(descs: impl IntoIterator<Item = Desc>) -> DescList {
    DescList::from_descs(MemKind::Dram, descs)
}

#[test]
fn write_and_read_within_one_agent() {
    let a = agent("self");
    let mut src: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; 64 * 1024];
    let dst_base = dst.as_mut_ptr() as u64;
    // SAFETY: both vectors outlive the handle and every request below.
    let _h = unsafe {
        a.register_mem(
            &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
            None,
        )
        .unwrap()
    };
    // 16 non-contiguous 1 KiB pieces, reversed order on the other side.
    let piece = 1024u64;
    let local: Vec<Desc> = (0..16)
        .map(|i| Desc::new(src.as_ptr() as u64 + i * 4096, piece, 0))
        .collect();
    let remote: Vec<Desc> = (0..16)
        .map(|i| Desc::new(dst_base + (15 - i) * 4096, piece, 0))
        .collect();
    let mut req = a
        .create_xfer_req(
            XferOp::Write,
            &dram(local.clone()),
            &dram(remote.clone()),
            "self",
            None,
        )
        .unwrap();
    assert_eq!(req.post().unwrap(), XferStatus::Done);
    assert_eq!(req.telemetry().total_bytes, 16 * 1024);
    for i in 0..16usize {
        let s = &src[i * 4096..i * 4096 + 1024];
        let d = &dst[(15 - i) * 4096..(15 - i) * 4096 + 1024];
        assert_eq!(s, d, "piece {i}");
    }
    drop(req);
    // READ brings it back into a cleared source.
    src.iter_mut().for_each(|b| *b = 0);
    let mut req = a
        .create_xfer_req(
            XferOp::Read,
            &dram(local),
            &dram(remote),
            "self",
            Some(b"n1".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    req.wait(Duration::from_secs(5)).unwrap();
    drop(req);
    for i in 0..16usize {
        assert!(src[i * 4096..i * 4096 + 1024]
            .iter()
            .enumerate()
            .all(|(j, b)| *b == ((i * 4096 + j) % 251) as u8));
    }
    assert_eq!(a.get_notifs()["self"], vec![b"n1".to_vec()]);
    assert!(a.get_notifs().is_empty(), "notifications are taken once");
}

#[test]
fn bad_local_descriptors_are_refused_before_posting() {
    let a = agent("checks");
    let buf = vec![0u8; 8192];
    let base = buf.as_ptr() as u64;
    // SAFETY: `buf` outlives the handle.
    let _h = unsafe {
        a.register_mem(&dram([Desc::new(base, 4096, 0)]), None)
            .unwrap()
    };
    let prep = |d: Desc| a.prep_xfer_dlist(None, &dram([d]));
    assert!(prep(Desc::new(base, 4096, 0)).is_ok());
    assert!(matches!(
        prep(Desc::new(base + 4096, 16, 0)),
        Err(Error::NotRegistered { partial: false, .. })
    ));
    assert!(matches!(
        prep(Desc::new(base + 4000, 200, 0)),
        Err(Error::NotRegistered { partial: true, .. })
    ));
    assert!(matches!(
        prep(Desc::new(base, 0, 0)),
        Err(Error::ZeroLength { index: 0 })
    ));
    assert!(matches!(
        prep(Desc::new(u64::MAX - 1, 8, 0)),
        Err(Error::Overflow { .. })
    ));
    assert!(matches!(
        prep(Desc::new(base, 16, 1)),
        Err(Error::NotRegistered { dev_id: 1, .. })
    ));
    assert!(matches!(
        a.prep_xfer_dlist(
            None,
            &DescList::from_descs(MemKind::Vram, [Desc::new(base, 16, 0)])
        ),
        Err(Error::NotRegistered {
            kind: MemKind::Vram,
            ..
        })
    ));
    // SAFETY: never used: the registration is refused.
    let err = unsafe {
        a.register_mem(
            &DescList::from_descs(MemKind::Vram, [Desc::new(base, 16, 0)]),
            None,
        )
    };
    // Without feature `cuda` LOCAL has no VRAM; with it, a host pointer declared VRAM is
    // refused by the driver check (or, without a driver, as a GPU error).
    if cfg!(feature = "cuda") {
        assert!(
            matches!(err, Err(Error::NotDeviceMemory { .. }) | Err(Error::Gpu(_))),
            "{err:?}"
        );
    } else {
        assert!(
            matches!(err, Err(Error::UnsupportedMemKind { ref backend, kind: MemKind::Vram }) if backend == "LOCAL")
        );
    }
    assert!(
        matches!(a.prep_xfer_dlist(Some("nobody"), &dram([Desc::new(base, 1, 0)])), Err(Error::UnknownAgent(n)) if n == "nobody")
    );
    assert!(matches!(
        a.create_backend("NOPE", &Default::default()),
        Err(Error::UnknownBackend(_))
    ));
}

#[test]
fn remote_descriptors_are_bounds_checked_against_peer_metadata() {
    let a = agent("loop");
    let buf = vec![0u8; 8192];
    let base = buf.as_ptr() as u64;
    // SAFETY: `buf` outlives the handle.
    let h = unsafe {
        a.register_mem(&dram([Desc::new(base, 4096, 0)]), None)
            .unwrap()
    };
    let local = a
        .prep_xfer_dlist(None, &dram([Desc::new(base, 64, 0)]))
        .unwrap();
    let err = a
        .prep_xfer_dlist(Some("loop"), &dram([Desc::new(base + 4090, 64, 0)]))
        .unwrap_err();
    assert!(
        matches!(err, Error::RemoteOutOfBounds { index: 0, .. }),
        "{err}"
    );
    let remote = a
        .prep_xfer_dlist(
            Some("loop"),
            &dram([Desc::new(base + 128, 64, 0), Desc::new(base, 32, 0)]),
        )
        .unwrap();
    assert!(matches!(
        a.make_xfer_req(XferOp::Write, &local, &[0], &remote, &[1], None, None),
        Err(Error::Mismatch(_))
    ));
    assert!(matches!(
        a.make_xfer_req(XferOp::Write, &local, &[0, 0], &remote, &[0], None, None),
        Err(Error::Mismatch(_))
    ));
    assert!(matches!(
        a.make_xfer_req(XferOp::Write, &local, &[5], &remote, &[0], None, None),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        a.make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], None, Some("X")),
        Err(Error::UnknownBackend(_))
    ));
    a.make_xfer_req(
        XferOp::Write,
        &local,
        &[0],
        &remote,
        &[0],
        None,
        Some("local"),
    )
    .unwrap();
    // After deregistration nothing validates any more.
    drop(h);
    assert!(matches!(
        a.prep_xfer_dlist(None, &dram([Desc::new(base, 64, 0)])),
        Err(Error::NotRegistered { .. })
    ));
    assert!(matches!(
        a.prep_xfer_dlist(Some("loop"), &dram([Desc::new(base, 64, 0)])),
        Err(Error::RemoteOutOfBounds { .. })
    ));
}

#[test]
fn metadata_full_partial_invalidate() {
    let a = agent("owner");
    let b = agent("viewer");
    let buf = vec![0u8; 3 * 4096];
    let base = buf.as_ptr() as u64;
    let regions: Vec<Desc> = (0..3)
        .map(|i| Desc::new(base + i * 4096, 4096, 0))
        .collect();
    // SAFETY: `buf` outlives the handle.
    let _h = unsafe { a.register_mem(&dram(regions.clone()), None).unwrap() };

    // Partial: only the second region, no connection info.
    let partial = a
        .local_partial_metadata(Some(&dram([Desc::new(base + 4096 + 8, 8, 0)])), false)
        .unwrap();
    assert_eq!(b.load_remote_metadata(&partial).unwrap(), "owner");
    assert!(b
        .prep_xfer_dlist(Some("owner"), &dram([Desc::new(base + 4096, 4096, 0)]))
        .is_ok());
    assert!(matches!(
        b.prep_xfer_dlist(Some("owner"), &dram([Desc::new(base, 8, 0)])),
        Err(Error::RemoteOutOfBounds { .. })
    ));
    // The rest arrives: regions add up.
    b.load_remote_metadata(&a.local_metadata().unwrap())
        .unwrap();
    assert!(b
        .prep_xfer_dlist(Some("owner"), &dram([Desc::new(base, 8, 0)]))
        .is_ok());
    // Connection info only.
    let conn_only = a.local_partial_metadata(None, true).unwrap();
    assert!(conn_only.len() < a.local_metadata().unwrap().len());
    b.invalidate_remote("owner").unwrap();
    assert!(matches!(
        b.prep_xfer_dlist(Some("owner"), &dram([Desc::new(base, 8, 0)])),
        Err(Error::UnknownAgent(_))
    ));
    assert!(matches!(
        b.invalidate_remote("owner"),
        Err(Error::UnknownAgent(_))
    ));
    assert!(matches!(
        b.load_remote_metadata(b"garbage"),
        Err(Error::MalformedMetadata(_))
    ));
}

#[test]
fn prepared_lists_are_refused_after_the_peer_reloads() {
    let a = agent("peer");
    let b = agent("me");
    let buf = vec![0u8; 4096];
    // SAFETY: `buf` outlives the handles.
    let _ha = unsafe {
        a.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _hb = unsafe {
        b.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    b.load_remote_metadata(&a.local_metadata().unwrap())
        .unwrap();
    let remote = b
        .prep_xfer_dlist(Some("peer"), &dram([Desc::from_slice(&buf)]))
        .unwrap();
    let local = b
        .prep_xfer_dlist(None, &dram([Desc::from_slice(&buf)]))
        .unwrap();
    // A new incarnation (new connection info) arrives.
    b.load_remote_metadata(&a.local_metadata().unwrap())
        .unwrap();
    let err = b
        .make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], None, None)
        .unwrap_err();
    assert!(err.to_string().contains("prepare it again"), "{err}");
    // LOCAL cannot reach another agent: no backend is usable.
    let remote = b
        .prep_xfer_dlist(Some("peer"), &dram([Desc::from_slice(&buf)]))
        .unwrap();
    assert!(matches!(
        b.make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], None, None),
        Err(Error::NoCommonBackend { .. })
    ));
}

/// A list of the agent itself stays usable while its registrations change (another
/// thread of a multi-threaded benchmark registering its own memory), and a descriptor
/// whose memory was deregistered meanwhile is refused (outside every region), not moved.
#[test]
fn loopback_lists_survive_other_registrations() {
    let a = agent("loop");
    let src: Vec<u8> = (0..8192).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; 8192];
    let other = vec![0u8; 4096];
    // SAFETY: the vectors outlive the handles and requests.
    let _h = unsafe {
        a.register_mem(
            &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
            None,
        )
        .unwrap()
    };
    let local = a
        .prep_xfer_dlist(None, &dram([Desc::from_slice(&src)]))
        .unwrap();
    let remote = a
        .prep_xfer_dlist(Some("loop"), &dram([Desc::from_slice(&dst)]))
        .unwrap();
    // Registering (and releasing) other memory rebuilds the agent's view of itself.
    // SAFETY: `other` outlives the handle.
    let h_other = unsafe {
        a.register_mem(&dram([Desc::from_slice(&other)]), None)
            .unwrap()
    };
    drop(h_other);
    let mut req = a
        .make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], None, None)
        .unwrap();
    req.post().unwrap();
    req.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(dst, src);
    // The list's own memory deregistered: refused, not moved.
    let spare = vec![0u8; 4096];
    // SAFETY: `spare` outlives the handle.
    let h_spare = unsafe {
        a.register_mem(&dram([Desc::from_slice(&spare)]), None)
            .unwrap()
    };
    let remote = a
        .prep_xfer_dlist(
            Some("loop"),
            &dram([Desc::new(spare.as_ptr() as u64, 4096, 0)]),
        )
        .unwrap();
    drop(h_spare);
    let local = a
        .prep_xfer_dlist(None, &dram([Desc::new(src.as_ptr() as u64, 4096, 0)]))
        .unwrap();
    let err = a
        .make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], None, None)
        .unwrap_err();
    assert!(matches!(err, Error::RemoteOutOfBounds { .. }), "{err}");
    dst.clear();
}

/// A local list prepared before its registration is released must not reach that memory
/// (it may be freed): a request from it is refused with a typed error naming the
/// descriptor, while descriptors of registrations still held keep working, and the list
/// prepared again after a new registration works.
#[test]
fn local_lists_are_refused_after_their_registration_is_released() {
    let a = agent("dereg");
    let kept = vec![3u8; 4096];
    let released = vec![5u8; 4096];
    let mut dst = vec![0u8; 8192];
    // SAFETY: the vectors outlive the handles and requests.
    let h_kept = unsafe {
        a.register_mem(
            &dram([Desc::from_slice(&kept), Desc::from_slice(&dst)]),
            None,
        )
        .unwrap()
    };
    // SAFETY: as above.
    let h_released = unsafe {
        a.register_mem(&dram([Desc::from_slice(&released)]), None)
            .unwrap()
    };
    let local = a
        .prep_xfer_dlist(
            None,
            &dram([Desc::from_slice(&kept), Desc::from_slice(&released)]),
        )
        .unwrap();
    let remote = a
        .prep_xfer_dlist(
            Some("dereg"),
            &dram([
                Desc::new(dst.as_mut_ptr() as u64, 4096, 0),
                Desc::new(dst.as_mut_ptr() as u64 + 4096, 4096, 0),
            ]),
        )
        .unwrap();
    drop(h_released);
    let err = a
        .make_xfer_req(XferOp::Write, &local, &[0, 1], &remote, &[0, 1], None, None)
        .unwrap_err();
    match err {
        Error::Deregistered {
            index, addr, len, ..
        } => {
            assert_eq!((index, addr, len), (1, released.as_ptr() as u64, 4096));
        }
        other => panic!("expected Deregistered, got {other}"),
    }
    assert!(dst.iter().all(|b| *b == 0), "nothing may have moved");
    // The descriptor of the registration still held works.
    let mut req = a
        .make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], None, None)
        .unwrap();
    req.post().unwrap();
    req.wait(Duration::from_secs(10)).unwrap();
    drop(req);
    assert!(dst[..4096].iter().all(|b| *b == 3));
    // Registered again and prepared again: the released memory moves once more.
    // SAFETY: `released` outlives the handle.
    let _h_again = unsafe {
        a.register_mem(&dram([Desc::from_slice(&released)]), None)
            .unwrap()
    };
    let err = a
        .make_xfer_req(XferOp::Write, &local, &[1], &remote, &[1], None, None)
        .unwrap_err();
    assert!(matches!(err, Error::Deregistered { index: 1, .. }), "{err}");
    let local = a
        .prep_xfer_dlist(
            None,
            &dram([Desc::from_slice(&kept), Desc::from_slice(&released)]),
        )
        .unwrap();
    let mut req = a
        .make_xfer_req(XferOp::Write, &local, &[1], &remote, &[1], None, None)
        .unwrap();
    req.post().unwrap();
    req.wait(Duration::from_secs(10)).unwrap();
    drop(req);
    assert!(dst[4096..].iter().all(|b| *b == 5));
    drop(h_kept);
}

/// Many descriptors over many registrations, gathered by random indices (vLLM's KV pull):
/// every picked block lands where its index says, and nothing else is written.
#[test]
fn many_descriptor_requests_gather_by_index() {
    let a = agent("gather");
    let (regions, blocks, block) = (8usize, 64usize, 32usize);
    // Written by the READs below through the agent: declared mutable for that.
    let mut src: Vec<Vec<u8>> = (0..regions)
        .map(|r| {
            (0..blocks * block)
                .map(|i| (r * 31 + i / block) as u8)
                .collect()
        })
        .collect();
    let mut dst: Vec<Vec<u8>> = (0..regions).map(|_| vec![0xffu8; blocks * block]).collect();
    // SAFETY: the vectors outlive the handle and the request.
    let _h = unsafe {
        a.register_mem(
            &dram(
                src.iter()
                    .map(|b| Desc::from_slice(b))
                    .chain(dst.iter().map(|b| Desc::from_slice(b))),
            ),
            None,
        )
        .unwrap()
    };
    let list = |bufs: &[Vec<u8>]| {
        dram(bufs.iter().flat_map(|b| {
            (0..blocks)
                .map(move |i| Desc::new(b.as_ptr() as u64 + (i * block) as u64, block as u64, 0))
        }))
    };
    let local = a.prep_xfer_dlist(None, &list(&src)).unwrap();
    let remote = a.prep_xfer_dlist(Some("gather"), &list(&dst)).unwrap();
    // Local descriptor i goes to remote descriptor perm(i): a permutation that crosses
    // regions, over every other descriptor.
    let n = regions * blocks;
    let picked: Vec<usize> = (0..n).step_by(2).collect();
    let target: Vec<usize> = picked.iter().map(|i| (i * 37 + 11) % n).collect();
    let mut req = a
        .make_xfer_req(XferOp::Write, &local, &picked, &remote, &target, None, None)
        .unwrap();
    req.post().unwrap();
    req.wait(Duration::from_secs(10)).unwrap();
    drop(req);
    let mut expected = vec![vec![0xffu8; blocks * block]; regions];
    for (&l, &r) in picked.iter().zip(&target) {
        let from = &src[l / blocks][(l % blocks) * block..][..block];
        expected[r / blocks][(r % blocks) * block..][..block].copy_from_slice(from);
    }
    assert!(dst == expected, "blocks landed in the wrong places");
    // Later requests reuse the lists as the backend resolved them at the first: READ the
    // blocks just written back into the odd local descriptors, several requests over.
    let back: Vec<usize> = picked.iter().map(|i| i + 1).collect();
    let mut src_expected = src.clone();
    for (&l, &r) in back.iter().zip(&target) {
        let from = &dst[r / blocks][(r % blocks) * block..][..block];
        src_expected[l / blocks][(l % blocks) * block..][..block].copy_from_slice(from);
    }
    for (ls, rs) in back.chunks(50).zip(target.chunks(50)) {
        let mut req = a
            .make_xfer_req(XferOp::Read, &local, ls, &remote, rs, None, None)
            .unwrap();
        req.post().unwrap();
        req.wait(Duration::from_secs(10)).unwrap();
    }
    assert!(
        src == src_expected,
        "READ blocks landed in the wrong places"
    );
    let err = a
        .make_xfer_req(XferOp::Write, &local, &[n], &remote, &[0], None, None)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidParam(_)), "{err}");
    dst.clear();
    src.clear();
}

#[test]
fn listener_exchanges_metadata_with_timeouts() {
    let config = AgentConfig {
        listen_addr: Some("127.0.0.1:0".parse().unwrap()),
        metadata_timeout: Duration::from_secs(2),
        ..AgentConfig::default()
    };
    let server = Agent::new("server", config.clone()).unwrap();
    server.create_backend("LOCAL", &Default::default()).unwrap();
    let buf = vec![0u8; 4096];
    // SAFETY: `buf` outlives the handle.
    let _h = unsafe {
        server
            .register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    let addr = server.listen_addr().unwrap();
    let client = agent("client");
    assert_eq!(client.fetch_remote_metadata(addr).unwrap(), "server");
    assert!(client.has_remote("server"));
    client.send_local_metadata(addr).unwrap();
    assert!(server.has_remote("client"));
    client.invalidate_local_metadata(addr).unwrap();
    assert!(!server.has_remote("client"));
    // A peer that accepts and says nothing: bounded by the timeout, typed.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let quick = Agent::new(
        "quick",
        AgentConfig {
            metadata_timeout: Duration::from_millis(200),
            ..AgentConfig::default()
        },
    )
    .unwrap();
    assert!(matches!(
        quick.fetch_remote_metadata(silent.local_addr().unwrap()),
        Err(Error::Timeout(_))
    ));
    // Nobody listening.
    drop(silent);
    assert!(quick
        .fetch_remote_metadata("127.0.0.1:1".parse().unwrap())
        .is_err());
}

#[test]
fn concurrent_posting_from_eight_threads() {
    let a = agent("mt");
    let src: Vec<u8> = (0..8 * 4096).map(|i| (i / 4096) as u8 + 1).collect();
    let mut dst = vec![0u8; 8 * 4096];
    let dst_base = dst.as_mut_ptr() as u64;
    // SAFETY: both vectors outlive every thread (scoped) and the handle.
    let _h = unsafe {
        a.register_mem(
            &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
            None,
        )
        .unwrap()
    };
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let a = a.clone();
            let (sp, dp) = (src.as_ptr() as u64, dst_base);
            s.spawn(move || {
                for _ in 0..50 {
                    let l = dram([Desc::new(sp + t * 4096, 4096, 0)]);
                    let r = dram([Desc::new(dp + t * 4096, 4096, 0)]);
                    let mut req = a
                        .create_xfer_req(XferOp::Write, &l, &r, "mt", Some(vec![t as u8]))
                        .unwrap();
                    req.post().unwrap();
                }
            });
        }
    });
    assert!(dst
        .chunks(4096)
        .enumerate()
        .all(|(t, c)| c.iter().all(|b| *b == t as u8 + 1)));
    let notifs = a.get_notifs();
    assert_eq!(notifs["mt"].len(), 400);
}

#[test]
fn wait_notifs_sleeps_wakes_and_loses_nothing() {
    let a = agent("waiter");
    common::notif_wait::check_wait_notifs(&a, &a);
}

#[test]
fn wait_notifs_from_two_threads_returns_each_notification_once() {
    let a = agent("two-waiters");
    const N: usize = 2000;
    let got = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let deadline = Instant::now() + common::TIMEOUT;
                while got.lock().unwrap().len() < N {
                    assert!(Instant::now() < deadline, "notifications lost");
                    let mut map = a.wait_notifs(Duration::from_millis(200));
                    let msgs = map.remove("two-waiters").unwrap_or_default();
                    // Each waiter takes a contiguous run, in order.
                    let ids: Vec<usize> = msgs
                        .iter()
                        .map(|m| String::from_utf8_lossy(m).parse().unwrap())
                        .collect();
                    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
                    got.lock().unwrap().extend(ids);
                }
            });
        }
        for i in 0..N {
            a.gen_notif("two-waiters", i.to_string().as_bytes())
                .unwrap();
            if i % 64 == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    });
    let mut got = got.into_inner().unwrap();
    got.sort_unstable();
    assert_eq!(got, (0..N).collect::<Vec<_>>(), "each exactly once");
}

#[test]
fn shutdown_ends_a_wait_for_notifications() {
    let a = agent("shut");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let start = Instant::now();
            // No bound at all: only the shutdown ends it.
            let got = a.wait_notifs(Duration::MAX);
            (got, start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        a.shutdown();
        let (got, waited) = waiter.join().unwrap();
        assert!(got.is_empty());
        assert!(waited < common::notif_wait::PROMPT, "{waited:?}");
    });
    assert!(a.wait_notifs(Duration::from_secs(60)).is_empty(), "at once");
}

/// A user-written backend that queues notifications without waking the agent (the
/// trait's default `set_notif_waker`): a wait still sees them, by re-polling.
#[derive(Debug, Default)]
struct Silent {
    queue: std::sync::Mutex<Vec<(String, Vec<u8>)>>,
}

#[derive(Debug)]
struct NoMd;

impl nixl::backend::LocalMd for NoMd {
    fn public_md(&self) -> Vec<u8> {
        Vec::new()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl nixl::Backend for Silent {
    fn name(&self) -> &str {
        "SILENT"
    }
    fn capabilities(&self) -> nixl::Capabilities {
        nixl::Capabilities {
            local: false,
            remote: false,
            notif: true,
        }
    }
    fn supported_mem(&self) -> &[MemKind] {
        &[]
    }
    fn register_mem(
        &self,
        _region: &nixl::Region,
    ) -> nixl::Result<std::sync::Arc<dyn nixl::backend::LocalMd>> {
        Ok(std::sync::Arc::new(NoMd))
    }
    fn connection_info(&self) -> nixl::Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn load_remote_conn_info(&self, _agent: &str, _info: &[u8]) -> nixl::Result<()> {
        Ok(())
    }
    fn load_remote_md(
        &self,
        _agent: &str,
        _region: &nixl::Region,
        _public_md: &[u8],
    ) -> nixl::Result<std::sync::Arc<dyn nixl::backend::RemoteMd>> {
        Err(Error::InvalidParam("SILENT has no remote memory".into()))
    }
    fn disconnect(&self, _agent: &str) {}
    fn prep_xfer(
        &self,
        _op: XferOp,
        _entries: &[nixl::backend::XferEntry<'_>],
        _agent: &str,
    ) -> nixl::Result<Box<dyn nixl::backend::BackendXfer>> {
        Err(Error::InvalidParam("SILENT moves no data".into()))
    }
    fn gen_notif(&self, agent: &str, msg: &[u8]) -> nixl::Result<()> {
        self.queue
            .lock()
            .unwrap()
            .push((agent.to_string(), msg.to_vec()));
        Ok(())
    }
    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        into.append(&mut self.queue.lock().unwrap());
    }
}

#[test]
fn wait_notifs_repolls_a_backend_that_does_not_wake_it() {
    let a = Agent::new("silent", AgentConfig::default()).unwrap();
    let backend = std::sync::Arc::new(Silent::default());
    a.add_backend(backend.clone()).unwrap();
    // Idle: bounded re-polls (at most ~100 a second), not a busy loop.
    common::notif_wait::idle_wait_sleeps(
        &a,
        Duration::from_millis(500),
        Duration::from_millis(100),
    );
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            backend
                .queue
                .lock()
                .unwrap()
                .push(("p".into(), b"x".to_vec()));
        });
        let start = Instant::now();
        let got = a.wait_notifs(common::TIMEOUT);
        assert_eq!(got["p"], vec![b"x".to_vec()]);
        // Seen at the next re-poll, at most WAIT_REPOLL_MAX after it was queued.
        let waited = start.elapsed();
        assert!(waited < common::notif_wait::PROMPT, "{waited:?}");
    });
}
