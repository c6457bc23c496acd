//! Unit tests of the parts that need no device: rail affinity, wire formats, region keys.

use super::wire::*;
use super::*;
use ibverbs::Endpoint;
use std::net::{Ipv4Addr, Ipv6Addr};

#[test]
fn registrations_bind_to_the_rails_of_their_numa_node() {
    let topo = Topology::from_hwloc_xml(include_str!(
        "../../../tests/topo/flat-8gpu-8nic-2numa-4switch.xml"
    ))
    .unwrap();
    // mlx5_0 and mlx5_2 are on NUMA 0, mlx5_1 on NUMA 1; rxe0 is nowhere.
    let names = ["mlx5_0", "mlx5_1", "mlx5_2"];
    let rail_devices = [0, 1, 2, 0, 1, 2];
    let t = Some(&topo);
    assert_eq!(
        affine_rails(t, &names, &rail_devices, Some(0)),
        [0, 2, 3, 5]
    );
    assert_eq!(affine_rails(t, &names, &rail_devices, Some(1)), [1, 4]);
    let all = [0, 1, 2, 3, 4, 5];
    assert_eq!(affine_rails(t, &names, &rail_devices, None), all);
    assert_eq!(affine_rails(None, &names, &rail_devices, Some(0)), all);
    // Node 1 with only node-0 devices: no local one, so every rail.
    assert_eq!(
        affine_rails(t, &["mlx5_0", "mlx5_2"], &[0, 1], Some(1)),
        [0, 1]
    );
    assert_eq!(affine_rails(t, &["rxe0"], &[0, 0], Some(0)), [0, 1]);
}

fn gid(last: u8) -> Gid {
    let mut raw = [0u8; 16];
    raw[10] = 0xff;
    raw[11] = 0xff;
    raw[12..].copy_from_slice(&[192, 0, 2, last]);
    Gid { raw }
}

#[test]
fn connection_info_round_trips_and_rejects_garbage() {
    let rails = vec![
        RailInfo {
            dev: 0,
            gid: gid(1),
            lid: 0,
            mtu: Mtu::MTU_4096,
        },
        RailInfo {
            dev: 1,
            gid: gid(2),
            lid: 7,
            mtu: Mtu::MTU_1024,
        },
    ];
    let addr: SocketAddr = "192.0.2.1:4791".parse().unwrap();
    let b = encode_conn_info(0x1234_5678_9abc_def0, addr, &rails, None);
    let c = decode_conn_info(&b).unwrap();
    assert_eq!(
        c,
        ConnInfo {
            nonce: 0x1234_5678_9abc_def0,
            addr,
            rails: rails.clone(),
            process: None,
        }
    );
    for cut in 0..b.len() {
        assert!(decode_conn_info(&b[..cut]).is_err(), "cut at {cut}");
    }
    let mut extra = b.clone();
    extra.push(0);
    assert!(decode_conn_info(&extra).is_err());
    // With the process identity (what a peer on the same host watches): every cut
    // inside it is refused too, and so is a byte after it.
    let me = ProcessId::current().expect("/proc answers on Linux");
    let with_id = encode_conn_info(7, addr, &rails, Some(&me));
    assert_eq!(decode_conn_info(&with_id).unwrap().process, Some(me));
    for cut in b.len() + 1..with_id.len() {
        assert!(decode_conn_info(&with_id[..cut]).is_err(), "cut at {cut}");
    }
    let mut extra = with_id.clone();
    extra.push(0);
    assert!(decode_conn_info(&extra).is_err());
    let v6: SocketAddr = "[2001:db8::1]:9".parse().unwrap();
    let b6 = encode_conn_info(1, v6, &c.rails[..1], None);
    assert_eq!(decode_conn_info(&b6).unwrap().addr, v6);
    let mut zero_rails = encode_conn_info(1, addr, &[], None);
    assert!(decode_conn_info(&zero_rails).is_err());
    zero_rails[4] = 9;
    assert!(decode_conn_info(&zero_rails).is_err(), "version");
}

#[test]
fn handshake_messages_round_trip() {
    let hello = Hello {
        target_nonce: 5,
        nonce: 6,
        name: "prefill-0".into(),
        endpoints: vec![
            Endpoint {
                qp_num: 17,
                psn: 0xabcdef,
                gid: gid(1),
                lid: 0,
                mtu: Mtu::MTU_4096,
            };
            3
        ],
    };
    let b = encode_hello(&hello);
    assert_eq!(decode_hello(&b).unwrap(), hello);
    for cut in 0..b.len() {
        assert!(decode_hello(&b[..cut]).is_err(), "cut at {cut}");
    }
    let r = encode_reply(7, 100, &[(1, 2), (3, 4)]);
    assert_eq!(
        decode_reply(&r).unwrap(),
        Reply {
            conn: 7,
            heartbeat_ms: 100,
            answers: vec![(1, 2), (3, 4)]
        }
    );
    for cut in 0..r.len() {
        assert!(decode_reply(&r[..cut]).is_err(), "cut at {cut}");
    }
    match decode_reply(&encode_reply_error("stale metadata")) {
        Err(ReplyError::Refused(why)) => assert_eq!(why, "stale metadata"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn notification_messages_round_trip_and_are_bounded() {
    let m = encode_notif(42, 3, b"kv ready").unwrap();
    assert_eq!(decode_notif(&m).unwrap(), (42, 3, &b"kv ready"[..]));
    assert!(decode_notif(&m[..NOTIF_HEADER - 1]).is_err());
    assert!(decode_notif(b"XXXX\0\0\0\0\0\0\0\0").is_err());
    assert!(encode_notif(1, 0, &vec![0; MAX_NOTIF_BYTES]).is_ok());
    assert!(matches!(
        encode_notif(1, 0, &vec![0; MAX_NOTIF_BYTES + 1]),
        Err(Error::InvalidParam(_))
    ));
}

#[test]
fn region_keys_parse_strictly() {
    let md = decode_remote_md(&[2, 1, 0, 0, 0, 2, 0, 0, 0]).unwrap();
    assert_eq!(md.rkeys, vec![1, 2]);
    assert_eq!(md.staged_slot, None);
    assert!(decode_remote_md(&[]).is_err());
    assert!(decode_remote_md(&[0]).is_err());
    assert!(decode_remote_md(&[1, 1, 0, 0]).is_err());
    assert!(decode_remote_md(&[1, 1, 0, 0, 0, 0]).is_err());
}

#[test]
fn side_channel_address_comes_from_an_ip_gid_only() {
    assert_eq!(
        side_channel_ip(&gid(1)),
        Some(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)))
    );
    let mut link_local = [0u8; 16];
    link_local[0] = 0xfe;
    link_local[1] = 0x80;
    link_local[15] = 1;
    assert_eq!(side_channel_ip(&Gid { raw: link_local }), None);
    assert_eq!(side_channel_ip(&Gid::default()), None);
    let v6: Ipv6Addr = "2001:db8::5".parse().unwrap();
    assert_eq!(
        side_channel_ip(&Gid { raw: v6.octets() }),
        Some(IpAddr::V6(v6))
    );
}

#[test]
fn staged_notification_keys_travel_as_32_bit_immediates() {
    use super::stage_net::{imm32, notif_key, tracker_key};
    // The initiator's key: the target's connection id above the sequence number; the
    // immediate is the sequence, the target takes the id from the QP it arrived on.
    let key = notif_key(5, 0xfedc_ba98);
    assert_eq!(tracker_key(key), (5, 0xfedc_ba98));
    assert_eq!(imm32(key), 0xfedc_ba98);
    assert_eq!(key & crate::backends::staging::FETCH_DATA, 0);
    // FETCH data: the low 32 bits of the token.
    let token = (3u64 << 32) | 77;
    assert_eq!(imm32(crate::backends::staging::FETCH_DATA | token), 77);
}

#[test]
fn fetch_tokens_map_back_from_their_low_bits_and_stay_bounded() {
    use super::stage_net::FetchTokens;
    let mut t = FetchTokens::default();
    let base = (7u64 << 32) | 10;
    for i in 0..20_000u64 {
        t.insert(base + i);
    }
    // The newest 16,384 are kept; older ones are forgotten, never confused.
    assert_eq!(
        t.lookup(((base + 19_999) & 0xffff_ffff) as u32),
        Some(base + 19_999)
    );
    assert_eq!(
        t.lookup(((base + 3_616) & 0xffff_ffff) as u32),
        Some(base + 3_616)
    );
    assert_eq!(t.lookup(((base + 3_615) & 0xffff_ffff) as u32), None);
    assert_eq!(t.lookup(1), None);
    // A token 2^32 ids later with the same low bits replaces the stale one.
    t.insert(base + 19_999 + (1 << 32));
    assert_eq!(
        t.lookup(((base + 19_999) & 0xffff_ffff) as u32),
        Some(base + 19_999 + (1 << 32))
    );
}

#[test]
fn requester_names_and_fetch_headers_parse_strictly() {
    use super::stage_net::{decode_name, encode_name, fetch_token};
    use crate::backends::staging::{Ctrl, Request, WirePiece};
    let name = encode_name(0x0123_4567_89ab_cdef, 3);
    assert_eq!(decode_name(&name), Some((0x0123_4567_89ab_cdef, 3)));
    assert_eq!(decode_name(&name[..8]), None);
    assert_eq!(decode_name(&[name.clone(), vec![0]].concat()), None);
    let req = Request {
        token: 0xabc_def0_1234,
        key: None,
        reply_to: name,
        pieces: vec![WirePiece {
            peer_addr: 1,
            peer_key: 2,
            target: 3,
            len: 4,
        }],
    };
    let fetch = Ctrl::Fetch(req.clone()).encode().unwrap();
    assert_eq!(fetch_token(&fetch), Some(0xabc_def0_1234));
    let offer = Ctrl::Offer(req).encode().unwrap();
    assert_eq!(fetch_token(&offer), None, "only FETCHes are recorded");
    assert_eq!(fetch_token(&fetch[..15]), None);
}

#[test]
fn staged_region_metadata_round_trips_and_is_checked() {
    use super::vram::{decode_staged_md, encode_staged_md};
    let md = encode_staged_md(1 << 19);
    let remote = decode_remote_md(&md).unwrap();
    assert_eq!(remote.staged_slot, Some(1 << 19));
    assert!(remote.rkeys.is_empty());
    assert!(decode_staged_md(&md[1..md.len() - 1]).is_err(), "short");
    assert!(decode_staged_md(&[2, 0, 0, 8, 0]).is_err(), "version");
    assert!(
        decode_staged_md(&encode_staged_md(100)[1..]).is_err(),
        "tiny slot"
    );
}

#[test]
fn staging_parameters_are_named_as_libfabric_names_them() {
    use super::vram::{StagingParams, VramMode};
    let p = |kv: &[(&str, &str)]| {
        StagingParams::parse(
            &kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    };
    let d = p(&[]).unwrap();
    assert_eq!(d.vram_mode, VramMode::Auto);
    assert_eq!(
        (d.cfg.chunk, d.cfg.chunks, d.stage_dram),
        (
            crate::backends::staging::DEFAULT_CHUNK,
            crate::backends::staging::DEFAULT_CHUNKS,
            false
        )
    );
    let s = p(&[
        ("vram_mode", "direct"),
        ("staging_chunk", "65536"),
        ("staging_chunks", "4"),
        ("stage_dram", "1"),
    ])
    .unwrap();
    assert_eq!(s.vram_mode, VramMode::Direct);
    assert_eq!((s.cfg.chunk, s.cfg.chunks, s.stage_dram), (65536, 4, true));
    for bad in [
        ("vram_mode", "x"),
        ("staging_chunk", "4097"),
        ("staging_chunk", "0"),
        ("staging_chunks", "1025"),
        ("stage_dram", "2"),
    ] {
        assert!(matches!(p(&[bad]), Err(Error::InvalidParam(_))), "{bad:?}");
    }
}

/// Staging (issue 28): an agent with a connection of its own to the target (`mallory`)
/// sends an OFFER that names another requester (`victim`, whose memory key it has) as
/// its `reply_to`: the target refuses it (counted) and pulls nothing into its staged
/// memory. Before, the target found the named requester's connection by the nonce in
/// the message and read the victim's memory with the key the message gave. Needs
/// soft-RoCE (`RDMA_TEST_DEVICE`, as in the guest suite); skipped elsewhere.
#[test]
fn rxe_a_staged_request_naming_another_requester_is_refused() {
    use crate::backends::staging::{Ctrl, Request, StageNet, WirePiece};
    use crate::{Agent, AgentConfig, Desc, DescList};
    let Ok(dev) = std::env::var("RDMA_TEST_DEVICE") else {
        println!("skipped: RDMA_TEST_DEVICE not set (run in the soft-RoCE guest)");
        return;
    };
    let open = |name: &str, stage: &str| {
        let agent = Agent::new(name, AgentConfig::default()).unwrap();
        let params: BackendParams = [
            ("device".to_string(), dev.clone()),
            ("stage_dram".to_string(), stage.to_string()),
        ]
        .into();
        let backend = Arc::new(VerbsBackend::open(&agent.backend_init(params)).unwrap());
        agent.add_backend(backend.clone()).unwrap();
        (agent, backend)
    };
    let (target, t) = open("stage-forge-t", "1");
    let (victim, v) = open("stage-forge-victim", "0");
    let (mallory, m) = open("stage-forge-mallory", "0");
    let staged = vec![0u8; 4096];
    // SAFETY: `staged` outlives the handle and every request.
    let _h = unsafe {
        target
            .register_mem(
                &DescList::from_descs(MemKind::Dram, [Desc::from_slice(&staged)]),
                None,
            )
            .unwrap()
    };
    let md = target.local_metadata().unwrap();
    victim.load_remote_metadata(&md).unwrap();
    mallory.load_remote_metadata(&md).unwrap();
    // The victim's registered memory and its key, which mallory holds.
    let planted = vec![0x41u8; 4096];
    let region = Region {
        kind: MemKind::Dram,
        desc: Desc::new(planted.as_ptr() as u64, planted.len() as u64, 0),
    };
    let reg = v.register_mem(&region).unwrap();
    let rkey = reg.as_any().downcast_ref::<VerbsLocalMd>().unwrap().mrs[0].rkey();
    let offer = Ctrl::Offer(Request {
        token: 9,
        key: None,
        reply_to: stage_net::encode_name(v.common.nonce, 0),
        pieces: vec![WirePiece {
            peer_addr: planted.as_ptr() as u64,
            peer_key: u64::from(rkey),
            target: staged.as_ptr() as u64,
            len: 4096,
        }],
    })
    .encode()
    .unwrap();
    let conn = m.outgoing("stage-forge-t").unwrap();
    m.common
        .stager
        .net
        .send(0, &stage_net::VerbsAddr::Out(conn, 0), &offer, 1)
        .unwrap();
    let refused = || t.common.stager.engine().refused();
    let deadline = Instant::now() + Duration::from_secs(10);
    while refused() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Room for a pull that would have been served.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        staged.iter().all(|&b| b == 0),
        "the target pulled the named requester's memory"
    );
    assert_eq!(refused(), 1);
    drop(reg);
}
