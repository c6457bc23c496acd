//! VRAM over VERBS (feature `cuda`): each registration is direct (the range's DMA-BUF
//! registered with `ibv_reg_dmabuf_mr`) where the device can, else staged through pinned
//! bounce buffers with the refusal typed — soft-RoCE registers no DMA-BUF, so there
//! `vram_mode=direct` is refused and `auto` stages. VRAM↔VRAM and DRAM↔VRAM WRITE and
//! READ between two agents, one and many descriptors across chunk boundaries, data
//! checked by copying VRAM back to the host, the target checking its VRAM at the moment
//! the notification arrives.
//!
//! Needs a GPU and an RDMA device: without a GPU every test prints why it skips (with
//! `NIXL_REQUIRE_GPU=1`, the GPU machine, a missing GPU fails instead); without an RDMA
//! device (`RDMA_TEST_DEVICE`, else the first device the host has) it prints why it
//! skips — the GPU machine is not required to have one.
#![cfg(all(feature = "cuda", feature = "verbs"))]

mod common;

use common::{device_buffer as device, on_notif, pattern, vram, whole, with_extra, TIMEOUT};
use gpu_mem::{DeviceBuffer, Gpu};
use nixl::{params, Agent, Desc, DescList, Error, MemKind, XferOp, XferStatus};

/// Small slots, so that a few MiB cross many chunk boundaries.
const CHUNK: &str = "262144";

/// GPU 0 and the RDMA device to use, or `None` after printing why the test skips.
fn hardware(test: &str) -> Option<(Gpu, String)> {
    let gpu = gpu_mem::gpu_for_test(test)?;
    if let Ok(name) = std::env::var("RDMA_TEST_DEVICE") {
        return Some((gpu, name));
    }
    match ibverbs::devices() {
        Ok(list) if !list.is_empty() => Some((gpu, list.iter().next().expect("one").name())),
        Ok(_) => {
            eprintln!("skipped {test}: no RDMA device on this host (set RDMA_TEST_DEVICE)");
            None
        }
        Err(e) => {
            eprintln!("skipped {test}: no RDMA devices ({e})");
            None
        }
    }
}

fn agent(name: &str, device: &str, extra: &[(&str, &str)]) -> Agent {
    let p = params([("device", device), ("staging_chunk", CHUNK)]);
    common::agent_with_backend(name, Default::default(), "VERBS", &with_extra(p, extra))
}

/// The mode `query_mem` shows for `buf`'s registration with `agent`.
fn mode(agent: &Agent, buf: &DeviceBuffer) -> String {
    agent.query_mem(&vram([whole(buf)]))[0]
        .as_ref()
        .expect("registered")[0]
        .clone()
}

#[test]
fn vram_registers_direct_or_staged_with_the_refusal_typed() {
    let test = "vram_registers_direct_or_staged_with_the_refusal_typed";
    let Some((gpu, dev)) = hardware(test) else {
        return;
    };
    let buf = device(&gpu, 1 << 20, &[]);
    let strict = agent("strict", &dev, &[("vram_mode", "direct")]);
    // SAFETY: the buffer outlives the handle.
    let direct = unsafe { strict.register_mem(&vram([whole(&buf)]), None) };
    let refused = match direct {
        Ok(_) => {
            assert_eq!(mode(&strict, &buf), "VERBS(direct)");
            println!("REPORT {dev}: VRAM registered directly (DMA-BUF)");
            false
        }
        Err(Error::Backend { code, message, .. }) => {
            if dev.starts_with("rxe") {
                assert_eq!(code, libc::EOPNOTSUPP, "{message}");
                assert!(message.contains("DMA-BUF"), "{message}");
            }
            println!("REPORT {dev}: direct VRAM registration refused (code {code}): {message}");
            true
        }
        Err(other) => panic!("{dev}: {other:?}"),
    };
    // `auto` (the default): the same outcome, or staged where direct was refused.
    let auto = agent("auto", &dev, &[]);
    // SAFETY: as above.
    let _h = unsafe { auto.register_mem(&vram([whole(&buf)]), None).unwrap() };
    let want = if refused {
        "VERBS(staged)"
    } else {
        "VERBS(direct)"
    };
    assert_eq!(mode(&auto, &buf), want);
    let staged = agent("staged", &dev, &[("vram_mode", "staged")]);
    // SAFETY: as above.
    let _h = unsafe { staged.register_mem(&vram([whole(&buf)]), None).unwrap() };
    assert_eq!(mode(&staged, &buf), "VERBS(staged)");
}

/// WRITE `sizes` blocks (at odd offsets) from the initiator to the target, then READ
/// them back; each side VRAM or DRAM as told. The target checks its memory when the
/// notification arrives.
fn write_then_read(
    gpu: &Gpu,
    dev: &str,
    local_vram: bool,
    remote_vram: bool,
    sizes: &[usize],
    mode: &str,
) {
    let tag = format!(
        "{mode}-{}{}-{}",
        u8::from(local_vram),
        u8::from(remote_vram),
        sizes.len()
    );
    let extra = [("vram_mode", mode)];
    let initiator = agent(&format!("i-{tag}"), dev, &extra);
    let target = agent(&format!("t-{tag}"), dev, &extra);
    let mut offs = Vec::with_capacity(sizes.len());
    let mut at = 1;
    for &s in sizes {
        offs.push(at);
        at += s + 1;
    }
    let span = at + 1;
    let want = pattern(sizes.len() as u8 ^ 0x5a, span);
    let src_v = device(gpu, span, &want);
    let back_v = device(gpu, span, &[]);
    let dst_v = device(gpu, span, &[]);
    let src_h = want.clone();
    let mut back_h = vec![0u8; span];
    let dst_h = vec![0u8; span];
    let ordinal = gpu.ordinal() as u64;
    let (src, back, kind_l) = if local_vram {
        (src_v.ptr(), back_v.ptr(), MemKind::Vram)
    } else {
        (
            src_h.as_ptr() as u64,
            back_h.as_mut_ptr() as u64,
            MemKind::Dram,
        )
    };
    let (dst, kind_r) = if remote_vram {
        (dst_v.ptr(), MemKind::Vram)
    } else {
        (dst_h.as_ptr() as u64, MemKind::Dram)
    };
    let on = |kind: MemKind| if kind == MemKind::Vram { ordinal } else { 0 };
    let list = |kind: MemKind, base: u64, blocks: bool| {
        DescList::from_descs(
            kind,
            if blocks {
                offs.iter()
                    .zip(sizes)
                    .map(|(&o, &s)| Desc::new(base + o as u64, s as u64, on(kind)))
                    .collect::<Vec<_>>()
            } else {
                vec![Desc::new(base, span as u64, on(kind))]
            },
        )
    };
    // SAFETY: every buffer outlives the handles and requests (all dropped at the end).
    let _hi = unsafe {
        initiator
            .register_mem(&list(kind_l, src, false), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _hb = unsafe {
        initiator
            .register_mem(&list(kind_l, back, false), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _ht = unsafe {
        target
            .register_mem(&list(kind_r, dst, false), None)
            .unwrap()
    };
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    let read_remote = || {
        if remote_vram {
            dst_v.to_vec().unwrap()
        } else {
            dst_h.clone()
        }
    };
    let check = |what: &str, got: &[u8]| {
        for (i, (&o, &s)) in offs.iter().zip(sizes).enumerate() {
            assert!(
                got[o..o + s] == want[o..o + s],
                "{tag}: {what}: block {i} ({s} bytes at {o}) differs"
            );
        }
    };
    let mut w = initiator
        .create_xfer_req(
            XferOp::Write,
            &list(kind_l, src, true),
            &list(kind_r, dst, true),
            &name,
            Some(b"written".to_vec()),
        )
        .unwrap();
    w.post().unwrap();
    let landed = on_notif(&target, initiator.name(), |msg| {
        assert_eq!(msg, b"written");
        read_remote()
    });
    check("WRITE (at notification)", &landed);
    w.wait(TIMEOUT).unwrap();
    let staged_expected = local_vram || remote_vram;
    let t = w.telemetry();
    if staged_expected && mode == "staged" {
        assert_eq!(t.staged_bytes, t.total_bytes, "{tag}: telemetry");
    }
    println!(
        "{tag}: {} of {} bytes staged",
        t.staged_bytes, t.total_bytes
    );
    let mut r = initiator
        .create_xfer_req(
            XferOp::Read,
            &list(kind_l, back, true),
            &list(kind_r, dst, true),
            &name,
            Some(b"read".to_vec()),
        )
        .unwrap();
    for round in 0..2 {
        if round == 1 {
            back_v.fill(0).unwrap();
            back_h.fill(0);
        }
        assert_eq!(r.post().unwrap(), XferStatus::InProgress);
        r.wait(TIMEOUT).unwrap();
        assert_eq!(on_notif(&target, initiator.name(), |m| m), b"read");
        let got = if local_vram {
            back_v.to_vec().unwrap()
        } else {
            back_h.clone()
        };
        check(&format!("READ round {round}"), &got);
    }
}

#[test]
fn vram_write_and_read_between_two_agents_staged_and_auto() {
    let test = "vram_write_and_read_between_two_agents_staged_and_auto";
    let Some((gpu, dev)) = hardware(test) else {
        return;
    };
    for mode in ["staged", "auto"] {
        for (local_vram, remote_vram) in [(true, true), (true, false), (false, true)] {
            write_then_read(&gpu, &dev, local_vram, remote_vram, &[1], mode);
            write_then_read(
                &gpu,
                &dev,
                local_vram,
                remote_vram,
                &[4097, (3 << 20) + 5, 1 << 20],
                mode,
            );
        }
    }
    let many: Vec<usize> = (0..1000).map(|i| 1000 + (i % 7) * 700).collect();
    write_then_read(&gpu, &dev, true, true, &many, "staged");
}
