//! Source addresses (`FI_SOURCE`, [`fabric::CqBuilder::source`]): who sent each receive
//! and each remote CQ data arrival, as a handle of the receiver's address vector — and
//! what libfabric 1.17's providers report for a sender whose address is not in it.

mod common;

use common::*;
use fabric::{
    Access, Address, AddressVector, AvType, Caps, Completion, CompletionQueue, CqFormat, Domain,
    EndpointBuilder, Fabric,
};
use std::time::Instant;

/// An endpoint whose queue reports sources.
fn source_node(prov: &str) -> Node {
    let info = rdm_info(prov, base_caps() | Caps::SOURCE).unwrap_or_else(|e| panic!("{prov}: {e}"));
    assert!(info.caps().contains(Caps::SOURCE), "{prov}: FI_SOURCE");
    let fabric = Fabric::new(&info).expect("fabric");
    let domain = Domain::new(&fabric, &info).expect("domain");
    let cq = CompletionQueue::builder()
        .size(256)
        .format(CqFormat::Data)
        .source(true)
        .open(&domain)
        .expect("cq");
    let av = AddressVector::new(&domain, AvType::Map, 8).expect("av");
    let ep = EndpointBuilder::new(&domain, &info)
        .cq(&cq)
        .av(&av)
        .build()
        .expect("endpoint");
    Node {
        info,
        fabric,
        domain,
        cq,
        av,
        ep,
    }
}

fn next(node: &Node, flag: u64) -> Completion {
    let deadline = Instant::now() + T;
    loop {
        if let Some(c) = node.cq.read_one().unwrap() {
            if c.has(flag) {
                return c;
            }
        }
        assert!(Instant::now() < deadline, "no completion with {flag:#x}");
    }
}

/// Where each kind of arrival comes from: `(message, remote CQ data)` of the known sender
/// and of the stranger, and the handles they could be confused with.
struct Seen {
    known: Address,
    placeholder: Option<Address>,
    known_msg: Option<Address>,
    stranger_msg: Option<Address>,
    known_data: Option<Address>,
    stranger_data: Option<Address>,
}

fn observe(prov: &str) -> Seen {
    watchdog(300);
    let target = source_node(prov);
    // shm reports a sender it was never given as handle 0 (its peer map's default):
    // a name that no endpoint has takes that handle first.
    let placeholder = (prov == "shm").then(|| {
        target
            .av
            .insert(b"fi_shm://fabric-test-no-such-endpoint\0")
            .unwrap()
    });
    let known = Node::new(prov, base_caps());
    let stranger = Node::new(prov, base_caps());
    let known_at_target = target.av.insert(&known.ep.name().unwrap()).unwrap();
    let to_target = |n: &Node| n.av.insert(&target.ep.name().unwrap()).unwrap();
    let senders = [
        (&stranger, to_target(&stranger)),
        (&known, to_target(&known)),
    ];
    let inbox = target.ep.alloc_registered(4096, Access::ALL).unwrap();
    let deadline = Instant::now() + T;
    let mut msg = [None; 2];
    let mut data = [None; 2];
    for (i, (from, dest)) in senders.iter().enumerate() {
        target
            .ep
            .recv(&inbox, i * 64..i * 64 + 64, Address::UNSPEC, i as u64)
            .unwrap();
        from.ep
            .retry(deadline, || from.ep.inject(b"hi", *dest))
            .unwrap();
        let c = next(&target, fabric::ffi::FI_RECV);
        assert_eq!(c.context, i as u64);
        msg[i] = c.src;
        let src = from.ep.alloc_registered(64, Access::ALL).unwrap();
        from.ep
            .retry(deadline, || {
                from.ep
                    .writedata(&src, 0..64, 70 + i as u64, *dest, &inbox.remote(), 1024, 9)
            })
            .unwrap();
        from.cq.wait_for(9, T).unwrap();
        let c = next(&target, fabric::ffi::FI_REMOTE_CQ_DATA);
        assert_eq!(c.data, 70 + i as u64);
        data[i] = c.src;
    }
    let seen = Seen {
        known: known_at_target,
        placeholder,
        stranger_msg: msg[0],
        known_msg: msg[1],
        stranger_data: data[0],
        known_data: data[1],
    };
    println!(
        "{prov}: known {:?} (placeholder {:?}): messages known {:?} stranger {:?}; \
         remote CQ data known {:?} stranger {:?}",
        seen.known,
        seen.placeholder,
        seen.known_msg,
        seen.stranger_msg,
        seen.known_data,
        seen.stranger_data
    );
    seen
}

/// A stranger is reported as no handle, or as the placeholder, never as a peer.
fn stranger_ok(seen: &Seen, src: Option<Address>) -> bool {
    src.is_none() || src == seen.placeholder
}

#[test]
fn shm_reports_senders_and_strangers_as_its_placeholder() {
    let seen = observe("shm");
    assert_eq!(seen.placeholder, Some(Address(0)));
    assert_eq!(seen.known_msg, Some(seen.known));
    assert_eq!(seen.known_data, Some(seen.known));
    assert!(stranger_ok(&seen, seen.stranger_msg));
    assert!(stranger_ok(&seen, seen.stranger_data));
}

#[test]
fn sockets_reports_senders_of_messages_and_remote_cq_data() {
    let seen = observe("sockets");
    assert_eq!(seen.known_msg, Some(seen.known));
    assert_eq!(seen.known_data, Some(seen.known));
    assert_eq!(seen.stranger_msg, None);
    assert_eq!(seen.stranger_data, None);
}

/// `tcp;ofi_rxm` reports the senders of messages; libfabric 1.17 leaves the source of
/// remote CQ data unset (a stale slot of its queue), so it is not asserted.
#[test]
fn tcp_rxm_reports_senders_of_messages() {
    let seen = observe("tcp;ofi_rxm");
    assert_eq!(seen.known_msg, Some(seen.known));
    assert_eq!(seen.stranger_msg, None);
}

#[test]
fn a_queue_without_source_reports_none() {
    let (a, b, b_at_a, _) = pair("tcp;ofi_rxm", base_caps());
    let inbox = b.ep.alloc_registered(64, Access::ALL).unwrap();
    b.ep.recv(&inbox, 0..64, Address::UNSPEC, 3).unwrap();
    let deadline = Instant::now() + T;
    a.ep.retry(deadline, || a.ep.inject(b"x", b_at_a)).unwrap();
    let c = b.cq.wait_for(3, T).unwrap();
    assert_eq!(c.src, None);
}
