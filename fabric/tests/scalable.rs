//! Scalable endpoints on `sockets` (the tested provider that offers them): two transmit and
//! two receive contexts per endpoint, each with its own queue; messages addressed to a
//! named receive context land there. Providers without them answer `Unsupported`.

mod common;

use common::*;
use fabric::{
    Access, Address, AddressVector, AvType, Caps, CompletionQueue, Domain, Endpoint, EndpointType,
    Error, Fabric, ScalableEndpoint,
};
use std::time::Instant;

const CTX: usize = 2;
const BITS: i32 = 1; // log2(CTX)

struct Sep {
    _fabric: Fabric,
    _domain: Domain,
    av: AddressVector,
    sep: ScalableEndpoint,
    tx: Vec<(Endpoint, CompletionQueue)>,
    rx: Vec<(Endpoint, CompletionQueue)>,
}

fn sep(prov: &str) -> fabric::Result<Sep> {
    let info = hints(prov, EndpointType::RDM, Caps::MSG | Caps::NAMED_RX_CTX)
        .tx_ctx_cnt(CTX)
        .rx_ctx_cnt(CTX)
        .get_first()?;
    assert!(
        info.tx_ctx_cnt() >= CTX && info.rx_ctx_cnt() >= CTX,
        "{info:?}"
    );
    let fabric = Fabric::new(&info)?;
    let domain = Domain::new(&fabric, &info)?;
    let av = AddressVector::with_rx_ctx_bits(&domain, AvType::Table, 4, BITS)?;
    let sep = ScalableEndpoint::new(&domain, &info, &av)?;
    let mut tx = Vec::new();
    let mut rx = Vec::new();
    for i in 0..CTX as i32 {
        let cq = CompletionQueue::builder().open(&domain)?;
        tx.push((sep.tx_context(i, &cq)?, cq));
        let cq = CompletionQueue::builder().open(&domain)?;
        rx.push((sep.rx_context(i, &cq)?, cq));
    }
    sep.enable()?;
    Ok(Sep {
        _fabric: fabric,
        _domain: domain,
        av,
        sep,
        tx,
        rx,
    })
}

#[test]
fn sockets_contexts_are_addressable() {
    watchdog(240);
    let a = sep("sockets").unwrap();
    let b = sep("sockets").unwrap();
    let b_addr = a.av.insert(&b.sep.name().unwrap()).unwrap();
    let len = 8192;
    let mut recvs = Vec::new();
    for (i, (ep, _)) in b.rx.iter().enumerate() {
        let buf = ep.alloc_registered(len, Access::ALL).unwrap();
        ep.recv(&buf, 0..len, Address::UNSPEC, 100 + i as u64)
            .unwrap();
        recvs.push(buf);
    }
    // Transmit context j sends to receive context 1 - j.
    let mut sends = Vec::new();
    for (j, (ep, _)) in a.tx.iter().enumerate() {
        let mut buf = ep.alloc_registered(len, Access::ALL).unwrap();
        buf.as_mut_slice()
            .unwrap()
            .copy_from_slice(&pattern(len, j as u8));
        let target = b_addr.rx_context((1 - j) as i32, BITS);
        ep.retry(Instant::now() + T, || {
            ep.send(&buf, 0..len, target, 200 + j as u64)
        })
        .unwrap();
        sends.push(buf);
    }
    for (j, (_, cq)) in a.tx.iter().enumerate() {
        cq.wait_for(200 + j as u64, T).unwrap();
    }
    for (i, (_, cq)) in b.rx.iter().enumerate() {
        let c = cq.wait_for(100 + i as u64, T).unwrap();
        assert_eq!(c.len, len);
        // Receive context i got the message of transmit context 1 - i.
        assert_eq!(
            recvs[i].to_vec_volatile(),
            pattern(len, (1 - i) as u8),
            "rx context {i}"
        );
    }
}

#[test]
fn unsupported_elsewhere() {
    watchdog(240);
    for prov in ["tcp;ofi_rxm", "shm"] {
        match sep(prov) {
            Err(Error::Unsupported { .. }) => {}
            Err(e) => panic!("{prov}: untyped refusal of scalable endpoints: {e:?}"),
            Ok(_) => panic!("{prov}: scalable endpoints unexpectedly offered"),
        }
    }
}
