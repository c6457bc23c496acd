//! The staging pipeline over real providers without a GPU: DRAM registered as staged
//! (`stage_dram=1`) goes through exactly the protocol VRAM does, with `memcpy` in place
//! of the device copies.

use crate::{params, Agent, AgentConfig, Desc, DescList, MemKind, XferOp, XferStatus};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(60);

fn agent(name: &str, provider: &str, stage: bool, extra: &[(&str, &str)]) -> Agent {
    let agent = Agent::new(name, AgentConfig::default()).unwrap();
    let mut p = params([
        ("provider", provider),
        ("stage_dram", if stage { "1" } else { "0" }),
    ]);
    for (k, v) in extra {
        p.insert(k.to_string(), v.to_string());
    }
    agent.create_backend("LIBFABRIC", &p).unwrap();
    agent
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .rotate_left(u32::from(seed) % 31) as u8
                ^ seed
        })
        .collect()
}

fn dram(descs: impl IntoIterator<Item = Desc>) -> DescList {
    DescList::from_descs(MemKind::Dram, descs)
}

fn wait_notif(agent: &Agent, from: &str) -> Vec<u8> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(mut msgs) = agent.get_notifs().remove(from) {
            return msgs.remove(0);
        }
        assert!(Instant::now() < deadline, "no notification from {from}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// WRITE then READ back `sizes` blocks (placed at odd offsets) between an initiator and a
/// target that stage (or not) as told.
fn round_trip(
    provider: &str,
    init_stages: bool,
    tgt_stages: bool,
    sizes: &[usize],
    extra: &[(&str, &str)],
) {
    let tag = format!(
        "{}-{}{}-{}",
        provider.replace(';', "_"),
        u8::from(init_stages),
        u8::from(tgt_stages),
        sizes.len()
    );
    let initiator = agent(&format!("si-{tag}"), provider, init_stages, extra);
    let target = agent(&format!("st-{tag}"), provider, tgt_stages, extra);
    let span: usize = sizes.iter().map(|s| s + 3).sum::<usize>() + 64;
    let src = pattern(sizes.len() as u8, span);
    let dst = vec![0u8; span];
    let mut back = vec![0u8; span];
    let back_p = back.as_mut_ptr() as u64;
    // SAFETY: the buffers outlive the handles and requests (dropped at the end).
    let _hi = unsafe {
        initiator
            .register_mem(
                &dram([Desc::from_slice(&src), Desc::new(back_p, span as u64, 0)]),
                None,
            )
            .unwrap()
    };
    // SAFETY: as above.
    let _ht = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&dst)]), None)
            .unwrap()
    };
    let q = initiator.query_mem(&dram([Desc::from_slice(&src)]));
    let expect = if init_stages {
        "LIBFABRIC(staged)"
    } else {
        "LIBFABRIC"
    };
    assert_eq!(q[0].as_deref(), Some(&[expect.to_string()][..]), "{tag}");
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    // Blocks at odd offsets, mapped in reverse order on the target.
    let mut offs = Vec::new();
    let mut at = 1usize;
    for &s in sizes {
        offs.push(at);
        at += s + 3;
    }
    let n = sizes.len();
    let local =
        dram((0..n).map(|i| Desc::new(src.as_ptr() as u64 + offs[i] as u64, sizes[i] as u64, 0)));
    // Target offsets: the same layout (sizes differ, so no reversal).
    let remote =
        dram((0..n).map(|i| Desc::new(dst.as_ptr() as u64 + offs[i] as u64, sizes[i] as u64, 0)));
    let mut w = initiator
        .create_xfer_req(XferOp::Write, &local, &remote, &name, Some(b"w".to_vec()))
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&target, initiator.name()), b"w", "{tag}");
    for i in 0..n {
        let r = offs[i]..offs[i] + sizes[i];
        assert!(
            src[r.clone()] == dst[r.clone()],
            "{tag}: block {i} of {} bytes",
            sizes[i]
        );
        assert_eq!(dst[offs[i] - 1], 0, "{tag}: byte before block {i}");
        assert_eq!(dst[offs[i] + sizes[i]], 0, "{tag}: byte after block {i}");
    }
    let readback = dram((0..n).map(|i| Desc::new(back_p + offs[i] as u64, sizes[i] as u64, 0)));
    let mut r = initiator
        .create_xfer_req(XferOp::Read, &readback, &remote, &name, Some(b"r".to_vec()))
        .unwrap();
    for round in 0..2 {
        if round == 1 {
            back.fill(0);
        }
        assert_eq!(r.post().unwrap(), XferStatus::InProgress);
        r.wait(TIMEOUT).unwrap();
        assert_eq!(wait_notif(&target, initiator.name()), b"r", "{tag}");
        for i in 0..n {
            let rg = offs[i]..offs[i] + sizes[i];
            assert!(
                back[rg.clone()] == src[rg.clone()],
                "{tag}: read block {i} round {round}"
            );
        }
    }
}

#[test]
fn staged_both_sides_tcp() {
    round_trip("tcp;ofi_rxm", true, true, &[1, 4097, (3 << 20) + 5], &[]);
}

#[test]
fn staged_each_side_and_both_shm() {
    for (i, t) in [(true, false), (false, true), (true, true)] {
        round_trip("shm", i, t, &[1, 4097, (3 << 20) + 5, 1 << 20], &[]);
    }
}
