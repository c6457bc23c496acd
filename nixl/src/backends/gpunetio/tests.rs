use super::*;

/// A region's metadata carries its VRAM export after the NIC descriptor; a damaged,
/// cut or extended one is malformed, never misread.
#[test]
fn region_metadata_carries_the_vram_export() {
    let export = crate::backends::peer_dram::VramExport {
        handle: std::array::from_fn(|i| i as u8),
        offset: 4096,
        alloc_len: 1 << 30,
        gpu_uuid: [9; 16],
    };
    for e in [Some(export), None] {
        let md = GnLocal {
            ipc: None,
            nic: None,
            export: e,
            _served: None,
        }
        .public_md();
        let (ipc, desc, got) = parse_region_md("peer", &md).unwrap();
        assert!(ipc.is_empty() && desc.is_none());
        assert_eq!(got, e);
        for cut in 0..md.len() {
            assert!(matches!(
                parse_region_md("peer", &md[..cut]),
                Err(Error::MalformedMetadata(_))
            ));
        }
        let mut long = md.clone();
        long.push(0);
        assert!(parse_region_md("peer", &long).is_err());
    }
    let md = GnLocal {
        ipc: None,
        nic: None,
        export: Some(export),
        _served: None,
    }
    .public_md();
    // Version, descriptor flag, export flag, the export's own version.
    for (at, value) in [(0, 1u8), (3, 2), (4, 2), (9, 9)] {
        let mut bad = md.clone();
        bad[at] = value;
        assert!(parse_region_md("peer", &bad).is_err(), "byte {at}");
    }
}

#[test]
fn gpu_devices_wins_then_the_first_vram_then_the_current_device() {
    assert_eq!(choose_gpu(Some(2), Some(1), Some(3)), (2, BoundBy::Param));
    assert_eq!(choose_gpu(None, Some(1), Some(3)), (1, BoundBy::FirstVram));
    assert_eq!(choose_gpu(None, None, Some(3)), (3, BoundBy::CurrentDevice));
    assert_eq!(choose_gpu(None, None, None), (0, BoundBy::Default));
    assert!(BoundBy::FirstVram.describe().contains("first VRAM"));
}

/// A NIC this machine lacks is refused at creation, before any GPU is touched.
#[test]
fn a_missing_network_device_is_refused() {
    let agent = crate::Agent::new("gio-nic-check", crate::AgentConfig::default()).unwrap();
    let e = agent
        .create_backend(NAME, &crate::params([("network_devices", "nosuchdev0")]))
        .unwrap_err();
    assert!(matches!(e, Error::InvalidParam(_)), "{e}");
    assert!(e.to_string().contains("no RDMA device nosuchdev0"), "{e}");
}

#[test]
fn copy_engine_takes_cuda_ipcs_strategies_or_the_queue_pair() {
    use super::super::cuda_copy::CopyEngine;
    assert_eq!(
        HostCopy::default(),
        HostCopy::Engines(CopyEngine::Auto),
        "host posts use the copy strategies unless told otherwise"
    );
    for (text, want) in [
        ("auto", HostCopy::Engines(CopyEngine::Auto)),
        ("kernel", HostCopy::Engines(CopyEngine::Kernel)),
        ("memcpy", HostCopy::Engines(CopyEngine::Memcpy)),
        ("batch", HostCopy::Engines(CopyEngine::Batch)),
        ("gio", HostCopy::QueuePair),
    ] {
        assert_eq!(text.parse::<HostCopy>().unwrap(), want);
    }
    let e = "warps".parse::<HostCopy>().unwrap_err();
    assert!(matches!(e, Error::InvalidParam(_)), "{e}");
    assert!(e.to_string().contains("gio"), "{e}");
}

/// An H200: 132 SMs, 4 blocks of 512 threads each.
const SMS: u32 = 132;
const RESIDENT: u32 = 4 * SMS;

#[test]
fn a_transfer_of_a_few_mib_spreads_over_every_sm() {
    for total in [1u64 << 20, 2 << 20, 4 << 20, 8 << 20] {
        let g = plan(total, total, SMS, RESIDENT);
        let warps = u64::from(g.blocks) * u64::from(g.threads / 32);
        // One piece per warp, and every byte in some warp's pieces.
        assert!(warps * g.chunk >= total, "{total}: {g:?}");
        assert!(g.chunk >= MIN_CHUNK, "{total}: {g:?}");
        // Blocks of 4..=16 warps, and one on (almost) every SM before any SM gets a
        // second: a 1 MiB block no longer lands on 32 SMs only.
        assert!((128..=512).contains(&g.threads), "{total}: {g:?}");
        assert!(g.threads.is_multiple_of(32), "{total}: {g:?}");
        assert!(g.blocks >= SMS - 4, "{total}: {g:?}");
        assert!(g.blocks <= RESIDENT, "{total}: {g:?}");
    }
    let one_mib = plan(1 << 20, 1 << 20, SMS, RESIDENT);
    assert_eq!(one_mib.threads, 128);
    assert_eq!(one_mib.blocks, 128);
    assert_eq!(one_mib.chunk, MIN_CHUNK);
}

#[test]
fn small_and_huge_transfers_keep_their_limits() {
    // A tiny transfer: one block of the fewest warps, a piece no larger than needed.
    let tiny = plan(100, 100, SMS, RESIDENT);
    assert_eq!((tiny.blocks, tiny.threads), (1, 128));
    assert_eq!(
        tiny.chunk, 112,
        "the largest descriptor rounded up to 16 bytes"
    );
    // A huge one: one wave of full blocks, pieces capped.
    let huge = plan(1 << 36, 1 << 36, SMS, RESIDENT);
    assert_eq!((huge.blocks, huge.threads), (RESIDENT, THREADS));
    assert_eq!(huge.chunk, MAX_CHUNK);
    // Many small descriptors: pieces never exceed the largest descriptor.
    let kv = plan(8192 * (32 << 10), 32 << 10, SMS, RESIDENT);
    assert!(kv.chunk <= 32 << 10, "{kv:?}");
    // A GPU with few SMs fills its blocks before adding more.
    let small_gpu = plan(8 << 20, 8 << 20, 8, 16);
    assert_eq!((small_gpu.blocks, small_gpu.threads), (16, THREADS));
}

#[test]
fn the_route_to_a_peer_gpu_follows_its_peer_access_and_the_handler() {
    use NicHandlerChoice::{Auto, CpuProxy, IntraNode};
    // Peer access (NVLink or PCIe): intra-node unless cpu_proxy is asked for.
    assert_eq!(intra_route(Auto, Some(true), true), IntraRoute::IntraNode);
    assert_eq!(intra_route(Auto, Some(true), false), IntraRoute::IntraNode);
    assert_eq!(
        intra_route(IntraNode, Some(true), false),
        IntraRoute::IntraNode
    );
    assert_eq!(intra_route(CpuProxy, Some(true), true), IntraRoute::Nic);
    // No peer access: never a mapping a kernel cannot reach.
    assert_eq!(intra_route(Auto, Some(false), true), IntraRoute::Nic);
    assert_eq!(
        intra_route(Auto, Some(false), false),
        IntraRoute::Unreachable
    );
    assert_eq!(
        intra_route(IntraNode, Some(false), true),
        IntraRoute::Unreachable
    );
    assert_eq!(
        intra_route(CpuProxy, Some(false), false),
        IntraRoute::Unreachable
    );
    // Not known yet: the mapping decides (and refuses a pair without peer access).
    assert_eq!(intra_route(Auto, None, true), IntraRoute::IntraNode);
    assert_eq!(IntraRoute::Nic.as_str(), "cpu_proxy");
}

#[test]
fn gpu_devices_is_one_ordinal() {
    assert_eq!(parse_gpu_devices("1").unwrap(), 1);
    assert_eq!(parse_gpu_devices(" 3 ").unwrap(), 3);
    assert!(matches!(
        parse_gpu_devices("0,1"),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        parse_gpu_devices("x"),
        Err(Error::InvalidParam(_))
    ));
}

/// Connection information as a peer with a NIC path, a same-host section and a
/// heartbeat hub writes it.
fn full_conn_info() -> (Vec<u8>, crate::backends::heartbeat::HubAddr) {
    let hub = crate::backends::heartbeat::HubAddr {
        nonce: 0x0123_4567_89ab_cdef,
        addr: "10.77.0.2:40123".parse().unwrap(),
    };
    let info = ConnInfo {
        ipc: b"ipc-section",
        nic: Some(nic::NicInfo {
            provider: "tcp;ofi_rxm".into(),
            endpoint: vec![7; 24],
            oob: "10.77.0.2:4242".parse().unwrap(),
        }),
        peer_copy: peer_dram::SERVES_PEER_COPIES | peer_dram::NOTIF_IN_REQUEST,
        local: Some((
            b"\0gnio-sock".to_vec(),
            oob::LocalIdentity {
                pid: 4242,
                start_time: 99,
                pid_ns: 4026531836,
            },
        )),
        hub: Some(hub),
    };
    (encode_conn_info(&info).unwrap(), hub)
}

/// The heartbeat hub travels in the connection information behind its flag; without
/// the flag (an older peer, `heartbeat_ms=0`) the rest reads as before, the peer just
/// unwatched; a cut, extended or damaged block is `MalformedMetadata`, never misread.
#[test]
fn connection_info_carries_the_heartbeat_hub() {
    let (bytes, hub) = full_conn_info();
    let parsed = parse_conn_info("peer", &bytes).unwrap();
    assert_eq!(parsed.hub, Some(hub));
    assert!(
        parsed.peer_copy == peer_dram::SERVES_PEER_COPIES | peer_dram::NOTIF_IN_REQUEST
            && parsed.local.is_some()
            && parsed.nic.is_some()
    );
    assert_eq!(parsed.ipc, b"ipc-section");
    assert_eq!(encode_conn_info(&parsed).unwrap(), bytes);

    // Without a hub: the old layout, byte for byte (the flags byte is the last but the
    // same-host section), read back without one.
    let no_hub = ConnInfo {
        hub: None,
        ..parsed.clone()
    };
    let old = encode_conn_info(&no_hub).unwrap();
    let flags_at = old.len() - (4 + 8 + 8 + 2 + b"\0gnio-sock".len()) - 1;
    assert_eq!(
        old[flags_at],
        peer_dram::SERVES_PEER_COPIES | peer_dram::NOTIF_IN_REQUEST | peer_dram::LOCAL_CONTROL
    );
    assert_eq!(parse_conn_info("peer", &old).unwrap(), no_hub);
    // Nothing but the NIC path (no direct copies, no hub): one zero flags byte.
    let bare = ConnInfo {
        ipc: b"",
        nic: parsed.nic.clone(),
        peer_copy: 0,
        local: None,
        hub: None,
    };
    let bare_bytes = encode_conn_info(&bare).unwrap();
    assert_eq!(bare_bytes.last(), Some(&0));
    assert_eq!(parse_conn_info("peer", &bare_bytes).unwrap(), bare);

    for cut in 0..bytes.len() {
        assert!(
            matches!(
                parse_conn_info("peer", &bytes[..cut]),
                Err(Error::MalformedMetadata(_))
            ),
            "cut at {cut}"
        );
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(
        parse_conn_info("peer", &long),
        Err(Error::MalformedMetadata(_))
    ));
    // The hub flag set on information that carries none (garbage where the block
    // should be), a damaged magic, an unknown address family.
    let mut flagged = old.clone();
    flagged[flags_at] |= HEARTBEAT_HUB;
    assert!(matches!(
        parse_conn_info("peer", &flagged),
        Err(Error::MalformedMetadata(_))
    ));
    flagged.extend_from_slice(b"NXHBgarbage-garbage");
    assert!(matches!(
        parse_conn_info("peer", &flagged),
        Err(Error::MalformedMetadata(_))
    ));
    let hub_at = old.len();
    let mut bad_magic = bytes.clone();
    bad_magic[hub_at] ^= 0xff;
    assert!(matches!(
        parse_conn_info("peer", &bad_magic),
        Err(Error::MalformedMetadata(_))
    ));
    let mut bad_family = bytes.clone();
    bad_family[hub_at + 13] = 5;
    assert!(matches!(
        parse_conn_info("peer", &bad_family),
        Err(Error::MalformedMetadata(_))
    ));
}

/// Every single-byte change and every prefix of valid connection information decodes
/// or is refused with a typed error, never a panic; what decodes encodes back to what
/// decodes the same.
#[test]
fn connection_info_mutations_never_panic() {
    let (bytes, _) = full_conn_info();
    let mut decoded = 0;
    for i in 0..bytes.len() {
        for v in [0u8, 1, 2, 0x7f, 0x80, 0xff, bytes[i] ^ 0x80] {
            let mut m = bytes.clone();
            m[i] = v;
            match parse_conn_info("peer", &m) {
                Ok(p) => {
                    decoded += 1;
                    let again = encode_conn_info(&p).unwrap();
                    assert_eq!(parse_conn_info("peer", &again).unwrap(), p);
                }
                Err(Error::MalformedMetadata(_)) => {}
                Err(e) => panic!("byte {i} = {v:#x}: {e:?}"),
            }
        }
    }
    assert!(decoded > 0);
    assert!(fuzz_oob_message(&bytes));
}

/// The NIC path's watch on a peer: a live hub gives a live watch that dies once the
/// peer falls silent (a cut link) and a fresh watch on the same, now answering, hub is
/// alive again (the restored link, its metadata reloaded); a hub that is gone or of a
/// newer incarnation gives a dead watch at once; a loopback hub of another host and
/// heartbeats off give none.
#[test]
fn nic_watch_follows_the_peers_heartbeats() {
    use crate::backends::heartbeat::{HeartbeatConfig, Hub, HubAddr};
    let lo = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    let fast = HeartbeatConfig {
        interval: Some(Duration::from_millis(20)),
        misses: 5,
    };
    let mine = Hub::start(NAME, "initiator", lo, fast).unwrap();
    let theirs = Hub::start(NAME, "target", lo, fast).unwrap();
    let at = theirs.addr();

    let watch = nic::watch_peer(Some(&mine), "target", Some(at), true, None).expect("watched");
    assert!(!watch.is_dead());
    theirs.set_silent(true);
    let since = std::time::Instant::now();
    while !watch.is_dead() {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "a silent peer was never declared dead"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    match watch.check("target") {
        Err(Error::RemoteDisconnect { agent, reason }) => {
            assert_eq!(agent, "target");
            assert!(reason.contains("heartbeat"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    theirs.set_silent(false);
    let again = nic::watch_peer(Some(&mine), "target", Some(at), true, None).expect("watched");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!again.is_dead(), "the answering peer, watched afresh");

    let stale = HubAddr {
        nonce: at.nonce ^ 1,
        ..at
    };
    let dead = nic::watch_peer(Some(&mine), "target", Some(stale), true, None).expect("dead");
    assert!(matches!(
        dead.check("target"),
        Err(Error::RemoteDisconnect { .. })
    ));
    drop(theirs);
    let gone = nic::watch_peer(Some(&mine), "target", Some(at), true, None).expect("dead");
    assert!(gone.is_dead());

    // A loopback hub of a peer on another node says nothing of it: not watched.
    assert!(nic::watch_peer(Some(&mine), "target", Some(at), false, None).is_none());
    // Heartbeats off here, or none advertised: not watched.
    assert!(nic::watch_peer(None, "target", Some(at), true, None).is_none());
    assert!(nic::watch_peer(Some(&mine), "target", None, true, None).is_none());
}

/// `heartbeat_ms` / `heartbeat_misses` are GPUNETIO parameters, checked at creation.
#[test]
fn heartbeat_parameters_are_known_and_checked() {
    let init = |k: &str, v: &str| crate::backend::BackendInit {
        agent_name: "a".into(),
        params: [
            (k.to_string(), v.to_string()),
            ("nic_handler".to_string(), "intra_node".to_string()),
        ]
        .into(),
        progress_thread: false,
        listen_addr: None,
        registry: crate::backends::builtin_registry(),
    };
    for (k, v) in [("heartbeat_ms", "70000"), ("heartbeat_misses", "0")] {
        match create(&init(k, v)).err() {
            Some(Error::InvalidParam(m)) => assert!(m.contains(k), "{m}"),
            other => panic!("{k}={v}: {other:?}"),
        }
    }
}
