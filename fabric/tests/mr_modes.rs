//! `mr_mode` bits requested one at a time in the hints, HMEM registration of host memory
//! through `fi_mr_regattr`, and `FI_EAGAIN` surfacing as `WouldBlock`.

mod common;

use common::*;
use fabric::ffi;
use fabric::{
    Access, AddressVector, AvType, Caps, CompletionQueue, Domain, EndpointBuilder, EndpointType,
    Error, Fabric, HmemIface, MemoryRegion, MrMode,
};
use std::time::Instant;

const BITS: [MrMode; 5] = [
    MrMode::LOCAL,
    MrMode::VIRT_ADDR,
    MrMode::ALLOCATED,
    MrMode::PROV_KEY,
    MrMode::ENDPOINT,
];

/// A write and a read of 64 KiB between two nodes made from `make`, verified.
fn write_read(prov: &str, make: &dyn Fn() -> Node) {
    let a = make();
    let b = make();
    let dest = a.av.insert(&b.ep.name().unwrap()).unwrap();
    let len = 64 * 1024;
    let mut src = a.ep.alloc_registered(len, Access::ALL).unwrap();
    src.as_mut_slice()
        .unwrap()
        .copy_from_slice(&pattern(len, 21));
    let target = b.ep.alloc_registered(len, Access::ALL).unwrap();
    a.ep.write_sync(&src, 0..len, dest, &target.remote(), 0, 1, T)
        .unwrap();
    let back = a.ep.alloc_registered(len, Access::ALL).unwrap();
    a.ep.read_sync(&back, 0..len, dest, &target.remote(), 0, 2, T)
        .unwrap();
    assert!(
        back.to_vec_volatile() == src.as_slice(),
        "{prov}: read back differs"
    );
}

#[test]
fn each_mr_mode_bit_alone() {
    watchdog(300);
    for prov in RDM_PROVIDERS {
        let required = rdm_info(prov, base_caps()).unwrap().mr_mode();
        for bit in BITS {
            match hints(prov, EndpointType::RDM, base_caps())
                .mr_mode(bit)
                .get_first()
            {
                Ok(info) => {
                    // A provider may only require what the application offered.
                    assert!(
                        bit.contains(info.mr_mode()),
                        "{prov}: offered {bit:?}, requires {:?}",
                        info.mr_mode()
                    );
                    write_read(prov, &|| Node::from_info(info.clone()));
                }
                Err(Error::Unsupported { errno, .. }) => {
                    // Refused: the provider needs a bit that was not offered.
                    assert_eq!(errno, ffi::FI_ENODATA);
                    assert!(
                        !bit.contains(required),
                        "{prov}: refused {bit:?} although it requires only {required:?}"
                    );
                }
                Err(e) => panic!("{prov} {bit:?}: {e}"),
            }
        }
    }
}

#[test]
fn shm_requires_virt_addr() {
    watchdog(300);
    let info = rdm_info("shm", base_caps()).unwrap();
    assert!(
        info.mr_mode().contains(MrMode::VIRT_ADDR),
        "{:?}",
        info.mr_mode()
    );
    // Targets are virtual addresses: the remote base is the buffer's address.
    let node = Node::from_info(info);
    let buf = node.ep.alloc_registered(4096, Access::ALL).unwrap();
    assert_eq!(buf.remote().addr, buf.as_ptr() as u64);
    // Offset addressing on the providers that do not ask for FI_MR_VIRT_ADDR.
    let rxm = Node::new("tcp;ofi_rxm", base_caps());
    assert!(!rxm.info.mr_mode().contains(MrMode::VIRT_ADDR));
    let buf = rxm.ep.alloc_registered(4096, Access::ALL).unwrap();
    assert_eq!(buf.remote().addr, 0);
}

#[test]
fn distinct_requested_keys_without_prov_key() {
    watchdog(300);
    let node = Node::new("tcp;ofi_rxm", base_caps());
    assert!(!node.info.mr_mode().contains(MrMode::PROV_KEY));
    let keys: Vec<u64> = (0..8)
        .map(|_| {
            node.ep
                .alloc_registered(64, Access::ALL)
                .unwrap()
                .remote()
                .key
        })
        .collect();
    let mut unique = keys.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), keys.len(), "{keys:?}");
}

#[test]
fn hmem_host_memory_on_shm() {
    watchdog(300);
    let info = rdm_info("shm", base_caps() | Caps::HMEM).unwrap();
    assert!(info.caps().contains(Caps::HMEM));
    assert!(
        info.mr_mode().contains(MrMode::HMEM),
        "{:?}",
        info.mr_mode()
    );
    let a = Node::from_info(info.clone());
    let b = Node::from_info(info);
    let dest = a.av.insert(&b.ep.name().unwrap()).unwrap();
    let len = 1 << 20;
    let src = pattern(len, 33);
    // SAFETY: `src` outlives the region and the write (waited for below).
    let mr = unsafe {
        MemoryRegion::reg_hmem(
            &a.domain,
            Some(&a.ep),
            src.as_ptr() as u64,
            len,
            Access::ALL,
            HmemIface::System,
        )
    }
    .unwrap();
    let target = b.ep.alloc_registered(len, Access::ALL).unwrap();
    let remote = target.remote();
    let deadline = Instant::now() + T;
    a.ep.retry(deadline, || {
        // SAFETY: src stays alive and unmodified until the completion is read below.
        unsafe {
            a.ep.write_raw(
                src.as_ptr(),
                len,
                Some(&mr),
                dest,
                remote.address_at(0),
                remote.key,
                5,
            )
        }
    })
    .unwrap();
    a.cq.wait_for(5, T).unwrap();
    assert!(target.to_vec_volatile() == src);
}

#[test]
fn hmem_unsupported_on_tcp_rxm() {
    watchdog(300);
    match rdm_info("tcp;ofi_rxm", base_caps() | Caps::HMEM) {
        Err(Error::Unsupported {
            call: "fi_getinfo", ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn eagain_is_would_block() {
    watchdog(300);
    // A tiny transmit queue, no background progress and nobody reading the queue: posts
    // must eventually be refused with FI_EAGAIN, surfaced as Error::WouldBlock.
    for prov in ["tcp;ofi_rxm", "shm"] {
        let info = hints(prov, EndpointType::RDM, base_caps())
            .tx_size(4)
            .get_first()
            .unwrap();
        let fabric = Fabric::new(&info).unwrap();
        let domain = Domain::with_progress_interval(&fabric, &info, None).unwrap();
        let cq = CompletionQueue::builder().size(4096).open(&domain).unwrap();
        let av = AddressVector::new(&domain, AvType::Table, 2).unwrap();
        let ep = EndpointBuilder::new(&domain, &info)
            .cq(&cq)
            .av(&av)
            .build()
            .unwrap();
        let peer = Node::new(prov, base_caps());
        let dest = av.insert(&peer.ep.name().unwrap()).unwrap();
        let src = ep.alloc_registered(64 * 1024, Access::ALL).unwrap();
        let target = peer.ep.alloc_registered(64 * 1024, Access::ALL).unwrap();
        let mut posted = 0u64;
        let blocked = loop {
            match ep.write(&src, 0..64 * 1024, dest, &target.remote(), 0, posted) {
                Ok(()) => posted += 1,
                Err(e) => break e,
            }
            assert!(posted < 100_000, "{prov}: never refused");
        };
        assert!(blocked.is_would_block(), "{prov}: {blocked:?}");
        assert_eq!(blocked.errno(), Some(ffi::FI_EAGAIN));
        // (rxm may refuse even the first post, while it connects to the peer.)
        // Everything posted completes once the queue is read.
        cq.wait_n(posted as usize, T).unwrap();
        assert!(!src.in_use(), "{prov}: completions release the buffer");
    }
}
