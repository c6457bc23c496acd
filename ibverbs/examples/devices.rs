//! List the RDMA devices, their ports and RoCE v2 GIDs: `cargo run --example devices`.

fn main() -> Result<(), ibverbs::Error> {
    let list = ibverbs::devices()?;
    if list.is_empty() {
        println!("no RDMA devices (is the RDMA subsystem loaded?)");
    }
    for dev in list.iter() {
        let ctx = dev.open()?;
        let attr = ctx.query_device()?;
        println!("{} (guid {:016x}): {attr:?}", dev.name(), dev.guid());
        for port in 1..=attr.phys_port_cnt() {
            let p = ctx.query_port(port)?;
            println!(
                "  port {port}: {:?}, MTU {} bytes",
                p.state(),
                p.active_mtu().bytes()
            );
            for family in [ibverbs::IpFamily::V4, ibverbs::IpFamily::V6] {
                if let Ok(gid) = ctx.find_roce_v2_gid(port, family) {
                    println!("    RoCE v2 GID {} = {}", gid.gid_index, gid.gid.to_ip());
                }
            }
        }
    }
    Ok(())
}
