//! Two RDM endpoints in one process: discover a provider, exchange endpoint names through
//! the address vector, write 1 MiB with `fi_write`, read it back with `fi_read`, and send a
//! message with remote CQ data.
//!
//! ```text
//! cargo run -p rdma-rs-fabric --example rdm_write -- [provider]   # default: tcp;ofi_rxm
//! ```

use fabric::{
    Access, Address, AddressVector, AvType, Caps, CompletionQueue, Domain, Endpoint,
    EndpointBuilder, EndpointType, Fabric, InfoBuilder,
};
use std::time::Duration;

struct Side {
    _fabric: Fabric,
    cq: CompletionQueue,
    av: AddressVector,
    ep: Endpoint,
}

fn side(provider: &str) -> fabric::Result<Side> {
    let mut hints = InfoBuilder::new()
        .provider(provider)
        .ep_type(EndpointType::RDM)
        .caps(Caps::MSG | Caps::RMA);
    if provider != "shm" {
        hints = hints.node("127.0.0.1").source(true);
    }
    let info = hints.get_first()?;
    let fabric = Fabric::new(&info)?;
    let domain = Domain::new(&fabric, &info)?;
    let cq = CompletionQueue::builder().open(&domain)?;
    let av = AddressVector::new(&domain, AvType::Table, 4)?;
    let ep = EndpointBuilder::new(&domain, &info)
        .cq(&cq)
        .av(&av)
        .build()?;
    Ok(Side {
        _fabric: fabric,
        cq,
        av,
        ep,
    })
}

fn main() -> fabric::Result<()> {
    let provider = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tcp;ofi_rxm".into());
    let (major, minor) = fabric::version();
    println!("libfabric {major}.{minor}, provider {provider}");
    let a = side(&provider)?;
    let b = side(&provider)?;
    // Names are plain bytes: in two processes they travel over any side channel.
    let b_addr = a.av.insert(&b.ep.name()?)?;
    println!("peer {}", a.av.straddr(&b.ep.name()?));

    let len = 1 << 20;
    let mut src = a.ep.alloc_registered(len, Access::ALL)?;
    for (i, byte) in src
        .as_mut_slice()
        .expect("not in use")
        .iter_mut()
        .enumerate()
    {
        *byte = i as u8;
    }
    let target = b.ep.alloc_registered(len, Access::ALL)?;
    // What B would send to A: address/offset base, key, length.
    let remote = target.remote();

    let timeout = Duration::from_secs(10);
    a.ep.write_sync(&src, 0..len, b_addr, &remote, 0, 1, timeout)?;
    let back = a.ep.alloc_registered(len, Access::ALL)?;
    a.ep.read_sync(&back, 0..len, b_addr, &remote, 0, 2, timeout)?;
    assert!(back.to_vec_volatile() == src.as_slice());
    println!("wrote and read back {len} bytes");

    let inbox = b.ep.alloc_registered(64, Access::ALL)?;
    b.ep.recv(&inbox, 0..64, Address::UNSPEC, 3)?;
    a.ep.retry(std::time::Instant::now() + timeout, || {
        a.ep.senddata(&src, 0..64, 0xC0FFEE, b_addr, 4)
    })?;
    let got = b.cq.wait_for(3, timeout)?;
    a.cq.wait_for(4, timeout)?;
    println!(
        "received {} bytes with remote CQ data {:#x}",
        got.len, got.data
    );
    Ok(())
}
