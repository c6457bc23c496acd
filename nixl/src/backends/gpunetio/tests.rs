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
