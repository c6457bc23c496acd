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
    let b = encode_conn_info(0x1234_5678_9abc_def0, addr, &rails);
    let c = decode_conn_info(&b).unwrap();
    assert_eq!(
        c,
        ConnInfo {
            nonce: 0x1234_5678_9abc_def0,
            addr,
            rails
        }
    );
    for cut in 0..b.len() {
        assert!(decode_conn_info(&b[..cut]).is_err(), "cut at {cut}");
    }
    let mut extra = b.clone();
    extra.push(0);
    assert!(decode_conn_info(&extra).is_err());
    let v6: SocketAddr = "[2001:db8::1]:9".parse().unwrap();
    let b6 = encode_conn_info(1, v6, &c.rails[..1]);
    assert_eq!(decode_conn_info(&b6).unwrap().addr, v6);
    let mut zero_rails = encode_conn_info(1, addr, &[]);
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
    let r = encode_reply(&[(1, 2), (3, 4)]);
    assert_eq!(decode_reply(&r).unwrap(), vec![(1, 2), (3, 4)]);
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
    let md = VerbsRemoteMd {
        rkeys: decode_remote_md(&[2, 1, 0, 0, 0, 2, 0, 0, 0]).unwrap(),
    };
    assert_eq!(md.rkeys, vec![1, 2]);
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
