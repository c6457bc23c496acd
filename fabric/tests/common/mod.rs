//! Shared test helpers: endpoints on a provider over loopback, a watchdog.
#![allow(dead_code)]

use fabric::{
    Address, AddressVector, AvType, Caps, CompletionQueue, Domain, Endpoint, EndpointBuilder,
    EndpointType, Fabric, Info, InfoBuilder,
};
use std::sync::Once;
use std::time::Duration;

/// Bound for any single wait in the tests.
pub const T: Duration = Duration::from_secs(20);

/// The RDM providers of the matrix.
pub const RDM_PROVIDERS: &[&str] = &["tcp;ofi_rxm", "sockets", "udp;ofi_rxd", "shm"];

/// Aborts the test binary if it runs for more than `secs` (nothing may hang in C).
pub fn watchdog(secs: u64) {
    static START: Once = Once::new();
    START.call_once(|| {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(secs));
            eprintln!("fabric tests: watchdog expired after {secs} s, aborting");
            std::process::abort();
        });
    });
}

/// The capabilities the data-path tests ask for.
pub fn base_caps() -> Caps {
    Caps::MSG | Caps::RMA | Caps::TAGGED
}

/// Hints for `prov` on loopback.
pub fn hints(prov: &str, ep_type: EndpointType, caps: Caps) -> InfoBuilder {
    let b = InfoBuilder::new()
        .provider(prov)
        .ep_type(ep_type)
        .caps(caps);
    if prov == "shm" {
        b
    } else {
        b.node("127.0.0.1").source(true)
    }
}

/// Discovery for an RDM endpoint of `prov`, checking the provider name.
pub fn rdm_info(prov: &str, caps: Caps) -> fabric::Result<Info> {
    let info = hints(prov, EndpointType::RDM, caps).get_first()?;
    assert_eq!(info.provider_name(), prov);
    assert_eq!(info.ep_type(), EndpointType::RDM);
    Ok(info)
}

/// One RDM endpoint with its own fabric, domain, CQ and AV.
pub struct Node {
    pub info: Info,
    pub fabric: Fabric,
    pub domain: Domain,
    pub cq: CompletionQueue,
    pub av: AddressVector,
    pub ep: Endpoint,
}

impl Node {
    pub fn new(prov: &str, caps: Caps) -> Node {
        let info = rdm_info(prov, caps).unwrap_or_else(|e| panic!("{prov}: {e}"));
        Self::from_info(info)
    }

    pub fn from_info(info: Info) -> Node {
        let fabric = Fabric::new(&info).expect("fabric");
        let domain = Domain::new(&fabric, &info).expect("domain");
        let cq = CompletionQueue::builder()
            .size(256)
            .open(&domain)
            .expect("cq");
        let av = AddressVector::new(&domain, AvType::Table, 8).expect("av");
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
}

/// Two connected RDM nodes: `(a, b, b's address at a, a's address at b)`.
pub fn pair(prov: &str, caps: Caps) -> (Node, Node, Address, Address) {
    let a = Node::new(prov, caps);
    let b = Node::new(prov, caps);
    let b_at_a = a.av.insert(&b.ep.name().expect("name")).expect("insert b");
    let a_at_b = b.av.insert(&a.ep.name().expect("name")).expect("insert a");
    (a, b, b_at_a, a_at_b)
}

/// A deterministic pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ ((i >> 9) as u8))
        .collect()
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}
