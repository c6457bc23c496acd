//! Topology-aware NIC choice on hwloc XML topologies of multi-GPU, multi-NIC servers
//! written for these tests (`tests/topo/*.xml`, hwloc 2.x format): every GPU gets the
//! NIC under its own PCIe switch, one NIC per GPU; DRAM on a NUMA node gets that node's
//! NICs.

use nixl::topology::{PciAddr, Topology};
use std::collections::BTreeSet;
use std::path::Path;

fn load(name: &str) -> Topology {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/topo")
        .join(name);
    Topology::from_hwloc_xml_file(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn pci(s: &str) -> PciAddr {
    s.parse().unwrap()
}

const ALL_NICS: [&str; 8] = [
    "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7",
];

/// Two packages, four PCIe switches, each with two GPUs and two NICs side by side.
#[test]
fn flat_switches_each_gpu_gets_a_nic_of_its_own_switch() {
    let topo = load("flat-8gpu-8nic-2numa-4switch.xml");
    let gpus = topo.gpus();
    assert_eq!(gpus.len(), 8);
    let nics = topo.nics();
    assert_eq!(
        nics.iter()
            .map(|n| n.name.as_str())
            .collect::<BTreeSet<_>>(),
        ALL_NICS.into_iter().collect(),
        "the Ethernet port and the GPUs' OS devices are not NICs"
    );
    // Which NICs share a switch with which GPUs (the switch is the bus range).
    let switch_of = |bus: u8| bus & 0xf0;
    let nic_switch = |name: &str| {
        switch_of(
            nics.iter()
                .find(|n| n.name == name)
                .and_then(|n| n.pci)
                .unwrap()
                .bus,
        )
    };
    let chosen = topo.assign_nics(&gpus, &ALL_NICS);
    let mut used = BTreeSet::new();
    for (gpu, nic) in gpus.iter().zip(&chosen) {
        let nic = nic.as_deref().expect("every GPU gets a NIC");
        assert_eq!(
            nic_switch(nic),
            switch_of(gpu.bus),
            "GPU {gpu} got {nic}, which is under another switch"
        );
        assert!(used.insert(nic), "{nic} given to two GPUs");
    }
    assert_eq!(
        chosen,
        ["mlx5_2", "mlx5_5", "mlx5_0", "mlx5_7", "mlx5_3", "mlx5_4", "mlx5_1", "mlx5_6"]
            .map(|s| Some(s.to_string()))
    );
    // Asked alone, a GPU gets the first of its switch's NICs in the caller's order.
    assert_eq!(
        topo.nic_for_gpu(pci("0000:a4:00.0"), &ALL_NICS).as_deref(),
        Some("mlx5_1")
    );
    assert_eq!(
        topo.nic_for_gpu(pci("0000:a4:00.0"), &["mlx5_6", "mlx5_1"])
            .as_deref(),
        Some("mlx5_6")
    );
    // Only NICs of the other package on offer: the nearest is across the interconnect
    // but still chosen; distances grow switch < host bridge < package < machine.
    let g = pci("0000:12:00.0");
    let same_switch = topo.distance(g, "mlx5_5").unwrap();
    let same_package = topo.distance(g, "mlx5_0").unwrap();
    let other_package = topo.distance(g, "mlx5_3").unwrap();
    assert!(same_switch < same_package && same_package < other_package);
    assert_eq!(
        topo.nic_for_gpu(g, &["mlx5_3", "mlx5_7"]).as_deref(),
        Some("mlx5_7")
    );
    assert_eq!(topo.nic_for_gpu(pci("0000:77:00.0"), &ALL_NICS), None);
    assert_eq!(topo.nic_for_gpu(g, &["mlx5_99"]), None);
    // DRAM: the NICs local to the buffer's NUMA node.
    assert_eq!(
        topo.nics_near_numa(0, &ALL_NICS),
        ["mlx5_0", "mlx5_2", "mlx5_5", "mlx5_7"]
    );
    assert_eq!(
        topo.nics_near_numa(1, &ALL_NICS),
        ["mlx5_1", "mlx5_3", "mlx5_4", "mlx5_6"]
    );
}

/// DGX-style: four top-level switches, each with two leaf switches of one GPU and one
/// NIC; a storage NIC on its own host bridge; a NUMA node without I/O.
#[test]
fn nested_switches_each_gpu_gets_the_nic_of_its_leaf_switch() {
    let topo = load("nested-8gpu-9nic-3numa.xml");
    let mut nics: Vec<&str> = ALL_NICS.to_vec();
    nics.push("mlx5_8");
    let gpus = topo.gpus();
    let expected = [
        ("0000:14:00.0", "mlx5_6"),
        ("0000:18:00.0", "mlx5_0"),
        ("0000:24:00.0", "mlx5_3"),
        ("0000:28:00.0", "mlx5_5"),
        ("0000:94:00.0", "mlx5_7"),
        ("0000:98:00.0", "mlx5_1"),
        ("0000:a4:00.0", "mlx5_2"),
        ("0000:a8:00.0", "mlx5_4"),
    ];
    assert_eq!(gpus, expected.map(|(g, _)| pci(g)));
    let chosen = topo.assign_nics(&gpus, &nics);
    for ((gpu, want), got) in expected.iter().zip(&chosen) {
        assert_eq!(got.as_deref(), Some(*want), "GPU {gpu}");
        // The neighbour on the same top-level switch is farther than the leaf's NIC.
        let leaf = topo.distance(pci(gpu), want).unwrap();
        for other in &nics {
            if other != want {
                assert!(
                    topo.distance(pci(gpu), other).unwrap() > leaf,
                    "GPU {gpu}: {other} as near as {want}"
                );
            }
        }
    }
    // Fewer NICs than GPUs: still the nearest, shared evenly within a top switch.
    let two = ["mlx5_6", "mlx5_0"];
    let shared = topo.assign_nics(&gpus[..2], &two);
    assert_eq!(shared, [Some("mlx5_6".into()), Some("mlx5_0".into())]);
    let crowded = topo.assign_nics(&[gpus[0], gpus[0], gpus[0]], &two);
    assert_eq!(
        crowded,
        [
            Some("mlx5_6".into()),
            Some("mlx5_6".into()),
            Some("mlx5_6".into())
        ],
        "a nearer NIC wins over balance"
    );
    // DRAM: node 0 has five NICs (with the storage NIC), node 1 four; node 2 has no
    // I/O, so every NIC is as good as any other.
    assert_eq!(
        topo.nics_near_numa(0, &nics),
        ["mlx5_0", "mlx5_3", "mlx5_5", "mlx5_6", "mlx5_8"]
    );
    assert_eq!(topo.nics_near_numa(1, &nics).len(), 4);
    assert_eq!(topo.nics_near_numa(2, &nics).len(), 9);
    let storage = topo
        .nics()
        .into_iter()
        .find(|n| n.name == "mlx5_8")
        .unwrap();
    assert_eq!(storage.pci, Some(pci("0000:30:00.0")));
    assert_eq!(storage.numa, [0].into());
}
