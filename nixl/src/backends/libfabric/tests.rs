use super::*;
use crate::Agent;

#[test]
fn notification_messages_round_trip_and_reject_garbage() {
    let key = 0x5ead_beef_0000_002a;
    let m = encode_notif("prefill-7", key, 15_000, b"kv ready").unwrap();
    // The key's halves where the sequence and the sender hash were: low half first.
    assert_eq!(m[4..12], [0x2a, 0, 0, 0, 0xef, 0xbe, 0xad, 0x5e]);
    let (back, expected, sender, msg) = decode_notif(&m).unwrap();
    assert_eq!(back, key);
    assert_eq!(
        (expected, sender.as_str(), msg.as_slice()),
        (15_000, "prefill-7", &b"kv ready"[..])
    );
    for cut in 0..m.len() {
        assert!(decode_notif(&m[..cut]).is_err());
    }
    assert!(encode_notif("a", 1, 0, &vec![0; MAX_NOTIF_BYTES]).is_err());
}

/// shm advertises FI_HMEM even in a libfabric built without CUDA (this machine's and
/// the GPU machine's): the direct registration is then refused, typed `Unsupported`
/// (`vram_mode=direct` opens the FI_HMEM variant to see the provider's own answer).
/// `auto` keeps the provider's plain variant unless a probe registration succeeds.
#[test]
fn direct_vram_registration_is_refused_typed_where_libfabric_has_no_cuda() {
    let agent = Agent::new("hmem-probe", crate::AgentConfig::default()).unwrap();
    for provider in ["shm", "tcp;ofi_rxm"] {
        let auto: BackendParams = [("provider".to_string(), provider.to_string())].into();
        let auto = open_for(&agent, &auto).unwrap();
        assert!(
            !auto.has_hmem(),
            "{provider}: FI_HMEM kept without a working probe"
        );
        println!(
            "{provider} auto: staged because {}",
            auto.direct_vram_refusal().unwrap()
        );
        let params: BackendParams = [
            ("provider".to_string(), provider.to_string()),
            ("vram_mode".to_string(), "direct".to_string()),
        ]
        .into();
        let backend = open_for(&agent, &params).unwrap();
        let host = vec![0u8; 1 << 16];
        let region = Region {
            kind: MemKind::Vram,
            desc: crate::Desc::from_slice(&host),
        };
        let want_hmem = cfg!(feature = "cuda");
        match backend.register_direct(&region, 0) {
            Err(e @ fabric::Error::Unsupported { .. }) => {
                println!("{provider} (FI_HMEM {}): {e}", backend.has_hmem());
            }
            Err(e) => panic!("{provider}: untyped refusal {e:?}"),
            Ok(_) => panic!("{provider}: host memory registered as CUDA memory"),
        }
        if provider == "shm" {
            assert_eq!(backend.has_hmem(), want_hmem, "shm's FI_HMEM variant");
        }
    }
}

#[test]
fn stripes_have_no_piece_under_the_floor() {
    const MIB: usize = 1 << 20;
    // shm with a 2 MiB threshold: the 1 MiB floor, four rails.
    let shm = |len| stripe_pieces(len, 4, 2 * MIB, SHM_MIN_STRIPE_PIECE);
    assert_eq!(shm(MIB), 1);
    assert_eq!(shm(2 * MIB - 4096), 1);
    assert_eq!(shm(2 * MIB), 2);
    assert_eq!(shm(3 * MIB + 5), 3);
    assert_eq!(shm(4 * MIB), 4);
    assert_eq!(shm(64 * MIB), 4);
    let shm_default =
        |len| stripe_pieces(len, 4, DEFAULT_SHM_STRIPING_THRESHOLD, SHM_MIN_STRIPE_PIECE);
    assert_eq!(shm_default(3 * MIB), 1);
    assert_eq!(shm_default(4 * MIB), 4);
    // Network providers: every rail from the threshold, as before the floor.
    let tcp = |len| stripe_pieces(len, 4, DEFAULT_STRIPING_THRESHOLD, 0);
    assert_eq!(tcp(DEFAULT_STRIPING_THRESHOLD - 1), 1);
    assert_eq!(tcp(DEFAULT_STRIPING_THRESHOLD), 4);
    // One rail never stripes.
    assert_eq!(stripe_pieces(64 * MIB, 1, 1, 0), 1);
}

#[test]
fn rails_default_to_one_per_two_or_four_cores_where_a_cpu_copies() {
    assert_eq!(default_rails("tcp;ofi_rxm", 2), 1);
    assert_eq!(default_rails("shm", 16), 4);
    assert_eq!(default_rails("shm", 2), 1);
    assert_eq!(default_rails("tcp;ofi_rxm", 8), 4);
    assert_eq!(default_rails("tcp;ofi_rxm", 16), 8);
    assert_eq!(default_rails("shm", 64), 4);
    assert_eq!(default_rails("sockets", 64), 8);
    assert_eq!(default_rails("efa", 64), 1);
    assert_eq!(default_rails("cxi", 16), 1);
}

/// Two agents of this process (so the pidfd watch is out of play: only heartbeats can
/// tell): the target's hub falls silent, as a vanished host's would. The initiator's
/// WRITEs — one in flight and the next post — and its notifications fail with
/// `RemoteDisconnect` within the bound; the target speaking again and its metadata
/// loaded anew, transfers run again. Over `tcp;ofi_rxm` and `sockets`.
#[test]
fn a_silent_peer_host_fails_transfers_typed_and_a_reloaded_one_works() {
    use crate::{params, Desc, DescList, XferOp, XferStatus};
    for provider in ["tcp;ofi_rxm", "sockets"] {
        let tag = provider.replace(';', "_");
        let target = Agent::new(format!("hb-tgt-{tag}"), crate::AgentConfig::default()).unwrap();
        let target_backend =
            Arc::new(open_for(&target, &params([("provider", provider)])).unwrap());
        target.add_backend(target_backend.clone()).unwrap();
        let initiator =
            Agent::new(format!("hb-init-{tag}"), crate::AgentConfig::default()).unwrap();
        initiator
            .create_backend("LIBFABRIC", &params([("provider", provider)]))
            .unwrap();
        let len = 4 << 20;
        let src = vec![7u8; len];
        let mut dst = vec![0u8; len];
        let dst_p = dst.as_mut_ptr() as u64;
        let one = |p: u64| DescList::from_descs(MemKind::Dram, [Desc::new(p, len as u64, 0)]);
        // SAFETY: both buffers outlive the registrations and the requests.
        let _hi = unsafe { initiator.register_mem(&one(src.as_ptr() as u64), None) }.unwrap();
        // SAFETY: as above.
        let _ht = unsafe { target.register_mem(&one(dst_p), None) }.unwrap();
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        let write = || {
            initiator
                .create_xfer_req(
                    XferOp::Write,
                    &one(src.as_ptr() as u64),
                    &one(dst_p),
                    &name,
                    Some(b"w".to_vec()),
                )
                .unwrap()
        };
        let mut req = write();
        req.post().unwrap();
        req.wait(Duration::from_secs(10)).unwrap();
        // A live peer stays alive across several bounds.
        std::thread::sleep(Duration::from_millis(1500));
        req.post().unwrap();
        req.wait(Duration::from_secs(10)).unwrap();

        target_backend.hub.as_ref().unwrap().set_silent(true);
        let since = Instant::now();
        let err = loop {
            let outcome = match req.status() {
                Ok(XferStatus::Done) => req.post().map(|_| ()),
                Ok(XferStatus::InProgress) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = outcome {
                break e;
            }
            assert!(
                since.elapsed() < Duration::from_secs(20),
                "{provider}: hang"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        let took = since.elapsed();
        println!("{provider}: silent peer -> {err} after {took:?}");
        assert!(
            matches!(&err, Error::RemoteDisconnect { agent, reason }
                if *agent == name && reason.contains("no heartbeat")),
            "{provider}: {err:?}"
        );
        assert!(took < Duration::from_secs(5), "{provider}: after {took:?}");
        // Future work fails at once, typed.
        assert!(matches!(req.post(), Err(Error::RemoteDisconnect { .. })));
        assert!(matches!(
            initiator.gen_notif(&name, b"n"),
            Err(Error::RemoteDisconnect { .. })
        ));
        drop(req);

        // The host is back; its metadata is loaded again: a fresh watch, data moves.
        target_backend.hub.as_ref().unwrap().set_silent(false);
        initiator.invalidate_remote(&name).unwrap();
        initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        let mut req = write();
        req.post().unwrap();
        req.wait(Duration::from_secs(10)).unwrap();
        std::thread::sleep(Duration::from_millis(1000));
        req.post().unwrap();
        req.wait(Duration::from_secs(10)).unwrap();
        drop(req);
        assert!(dst.iter().all(|&b| b == 7), "{provider}: data delivered");
    }
}

/// A peer that is busy moving data (back-to-back 32 MiB WRITEs for 3 s over
/// `tcp;ofi_rxm`, both workers copying) is never declared dead: heartbeats come from a
/// thread that moves no data, over a connection of their own.
#[test]
fn a_busy_live_peer_is_not_declared_dead() {
    use crate::{params, Desc, DescList, XferOp};
    let make = |name: &str| {
        let agent = Agent::new(name, crate::AgentConfig::default()).unwrap();
        agent
            .create_backend(
                "LIBFABRIC",
                &params([("provider", "tcp;ofi_rxm"), ("local_provider", "none")]),
            )
            .unwrap();
        agent
    };
    let initiator = make("hb-busy-init");
    let target = make("hb-busy-tgt");
    let len = 32 << 20;
    let src = vec![3u8; len];
    let mut dst = vec![0u8; len];
    let dst_p = dst.as_mut_ptr() as u64;
    let one = |p: u64| DescList::from_descs(MemKind::Dram, [Desc::new(p, len as u64, 0)]);
    // SAFETY: both buffers outlive the registrations and the request.
    let _hi = unsafe { initiator.register_mem(&one(src.as_ptr() as u64), None) }.unwrap();
    // SAFETY: as above.
    let _ht = unsafe { target.register_mem(&one(dst_p), None) }.unwrap();
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &one(src.as_ptr() as u64),
            &one(dst_p),
            &name,
            None,
        )
        .unwrap();
    let since = Instant::now();
    let mut posts = 0;
    while since.elapsed() < Duration::from_secs(3) {
        req.post().unwrap();
        req.wait(Duration::from_secs(20)).unwrap();
        posts += 1;
    }
    println!(
        "{posts} WRITEs of 32 MiB in {:?}, peer alive",
        since.elapsed()
    );
    drop(req);
    assert!(dst.iter().all(|&b| b == 3));
}

/// A rail whose worker is stuck inside the provider (simulated: its worker's lock held
/// and its round stamped 6 s ago, as a worker spinning on a dead shm peer's region lock
/// looks): over `shm` the transfers that use it fail with a typed error, not at the 30 s
/// stall timeout; over `tcp;ofi_rxm` (where such a round is a starved thread, not a stuck
/// call) they do not fail and complete once the rail moves. Either way, once the rail
/// moves again, so do transfers, and the data arrives whole.
#[test]
fn a_wedged_rail_fails_its_transfers_typed_only_over_shm() {
    use crate::{params, Desc, DescList, XferOp};
    for (provider, wedges) in [("shm", true), ("tcp;ofi_rxm", false)] {
        // Every byte through the rail (no copy in the caller's thread by CMA).
        let p = params([
            ("provider", provider),
            ("num_rails", "1"),
            ("cma_inline", "0"),
        ]);
        let initiator = Agent::new("wedge-init", crate::AgentConfig::default()).unwrap();
        // The one-plane backend itself (no shm plane beside it), to reach its rail.
        let backend = Arc::new(open_for(&initiator, &p).unwrap());
        initiator.add_backend(backend.clone()).unwrap();
        let target = Agent::new("wedge-tgt", crate::AgentConfig::default()).unwrap();
        target
            .add_backend(Arc::new(open_for(&target, &p).unwrap()))
            .unwrap();
        let len = 1 << 20;
        let src = vec![5u8; len];
        let mut dst = vec![0u8; len];
        let dst_p = dst.as_mut_ptr() as u64;
        let one = |p: u64| DescList::from_descs(MemKind::Dram, [Desc::new(p, len as u64, 0)]);
        // SAFETY: both buffers outlive the registrations and the request.
        let _hi = unsafe { initiator.register_mem(&one(src.as_ptr() as u64), None) }.unwrap();
        // SAFETY: as above.
        let _ht = unsafe { target.register_mem(&one(dst_p), None) }.unwrap();
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        let new_req = || {
            initiator
                .create_xfer_req(
                    XferOp::Write,
                    &one(src.as_ptr() as u64),
                    &one(dst_p),
                    &name,
                    None,
                )
                .unwrap()
        };
        let mut req = new_req();
        req.post().unwrap();
        req.wait(Duration::from_secs(10)).unwrap();
        assert!(backend.rails[0].wedged_for().is_none());
        {
            let _stuck = backend.progress.workers[0].lock();
            backend.rails[0]
                .round_since
                .store(round_clock_ns() - 6_000_000_000, Ordering::Relaxed);
            let since = Instant::now();
            req.post().unwrap();
            let err = req.wait(Duration::from_secs(2)).unwrap_err();
            println!("{provider}: stuck rail: {:?} -> {err}", since.elapsed());
            if wedges {
                assert!(backend.rails[0].wedged_for().is_some());
                assert!(
                    matches!(&err, Error::Backend { message, .. } if message.contains("wedged")),
                    "{provider}: {err:?}"
                );
                assert!(since.elapsed() < Duration::from_secs(5));
            } else {
                assert!(backend.rails[0].wedged_for().is_none());
                assert!(matches!(err, Error::Timeout(_)), "{provider}: {err:?}");
            }
        }
        backend.rails[0].in_round(false);
        if !wedges {
            // Not failed: the same post completes once the rail moves.
            req.wait(Duration::from_secs(10)).unwrap();
        }
        drop(req);
        let mut req = new_req();
        req.post().unwrap();
        req.wait(Duration::from_secs(10)).unwrap();
        drop(req);
        assert!(dst.iter().all(|&b| b == 5), "{provider}");
    }
}

/// A transfer released while its operations are in the provider (here: its rail's worker
/// held, so nothing it issued can complete) is not gone until they completed: the
/// caller may reuse the memory as soon as the release returns. The release waits for the
/// rail, and the bytes that arrive are the ones of the post.
#[test]
fn a_released_transfer_waits_for_its_operations_in_the_provider() {
    use crate::{params, Desc, DescList, XferOp};
    let p = params([("provider", "tcp;ofi_rxm"), ("num_rails", "1")]);
    let initiator = Agent::new("drain-init", crate::AgentConfig::default()).unwrap();
    let backend = Arc::new(open_for(&initiator, &p).unwrap());
    initiator.add_backend(backend.clone()).unwrap();
    let target = Agent::new("drain-tgt", crate::AgentConfig::default()).unwrap();
    target
        .add_backend(Arc::new(open_for(&target, &p).unwrap()))
        .unwrap();
    let len = 64 << 20;
    let mut src = vec![7u8; len];
    let mut dst = vec![0u8; len];
    let (src_p, dst_p) = (src.as_mut_ptr() as u64, dst.as_mut_ptr() as u64);
    let one = |p: u64| DescList::from_descs(MemKind::Dram, [Desc::new(p, len as u64, 0)]);
    // SAFETY: both buffers outlive the registrations and the request.
    let _hi = unsafe { initiator.register_mem(&one(src_p), None) }.unwrap();
    // SAFETY: as above.
    let _ht = unsafe { target.register_mem(&one(dst_p), None) }.unwrap();
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    let mut req = initiator
        .create_xfer_req(XferOp::Write, &one(src_p), &one(dst_p), &name, None)
        .unwrap();
    req.post().unwrap();
    // Released while the post runs; a thread holds the rail's worker for a while, so
    // that the release finds operations in the provider (or still to be taken).
    let held = Arc::new(std::sync::Barrier::new(2));
    // Held once the first bytes landed (the target is in this process): the rest of the
    // 64 MiB is then in the provider or still to be issued.
    let first = Instant::now();
    // SAFETY: `dst_p` points into `dst`, alive; a volatile read of a byte the provider
    // may be writing (its value is only compared).
    while unsafe { std::ptr::read_volatile(dst_p as *const u8) } != 7 {
        assert!(first.elapsed() < Duration::from_secs(10), "nothing landed");
        std::hint::spin_loop();
    }
    let holder = {
        let backend = backend.clone();
        let held = held.clone();
        std::thread::spawn(move || {
            let _stuck = backend.progress.workers[0].lock();
            held.wait();
            std::thread::sleep(Duration::from_millis(300));
        })
    };
    held.wait();
    let since = Instant::now();
    drop(req);
    println!("release took {:?}", since.elapsed());
    // The caller reuses its buffer at once (the rail may still be held): nothing of the
    // released post reads it any more.
    src.fill(9);
    holder.join().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // What arrived is the post's (whole or cut short by the release), never the reuse's.
    let reused = dst.iter().filter(|&&b| b == 9).count();
    println!(
        "arrived: {} bytes of the post, {reused} of the reuse",
        dst.iter().filter(|&&b| b == 7).count()
    );
    assert_eq!(
        reused, 0,
        "{reused} bytes of the buffer's reuse reached the target"
    );
    assert!(dst.iter().all(|&b| b == 7 || b == 0));
}

/// shm endpoints are named after more than the pid: processes of one pid in different
/// pid namespaces sharing `/dev/shm` (the network-namespace tests' peers are all pid 1)
/// opened the same region under libfabric 1.17's default name and one crashed.
#[test]
fn shm_endpoints_have_names_no_other_process_has() {
    use crate::params;
    let agent = Agent::new("shm-name", crate::AgentConfig::default()).unwrap();
    let backend = open_for(&agent, &params([("provider", "shm"), ("num_rails", "2")])).unwrap();
    let prefix = format!(
        "fi_shm://nixl-{}-{}-",
        own_pid_namespace(),
        std::process::id()
    );
    let names: Vec<String> = backend
        .rails
        .iter()
        .map(|r| {
            String::from_utf8_lossy(&r.ep.name().unwrap())
                .trim_end_matches('\0')
                .to_string()
        })
        .collect();
    for name in &names {
        let nonce = name
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{name} does not start with {prefix}"));
        assert!(
            nonce.len() > 16 && nonce[..16].chars().all(|c| c.is_ascii_hexdigit()),
            "{name}"
        );
    }
    assert_ne!(names[0], names[1]);
}

/// Regions left by ended processes of this pid namespace are removed; those of live
/// processes, of other namespaces and of other names stay.
#[test]
fn stale_shm_regions_of_ended_processes_are_removed() {
    let dir = std::env::temp_dir().join(format!("nixl-stale-shm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ns = own_pid_namespace();
    assert_ne!(ns, 0, "/proc/self/ns/pid is readable on Linux");
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let me = std::process::id();
    let names = [
        format!("nixl-{ns}-{dead}-0123456789abcdef:0:0"),
        format!("nixl-{ns}-{me}-0123456789abcdef:0:0"),
        format!("nixl-{}-{dead}-0123456789abcdef:0:0", ns + 1),
        format!("{dead}:0:0"),
    ];
    for name in &names {
        std::fs::write(dir.as_path().join(name), b"region").unwrap();
    }
    remove_stale_shm_regions(dir.as_path(), ns);
    let left: Vec<bool> = names
        .iter()
        .map(|n| dir.as_path().join(n).exists())
        .collect();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(left, [false, true, true, true]);
}

/// This process's pid namespace as shm names carry it (0 where unreadable).
fn own_pid_namespace() -> u64 {
    super::super::shared::pid_namespace("self").unwrap_or(0)
}
