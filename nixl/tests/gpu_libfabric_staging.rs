//! VRAM over LIBFABRIC (feature `cuda`) on providers without GPU support (`tcp;ofi_rxm`,
//! and `shm` from a libfabric built without CUDA): registrations fall back to the
//! staging pipeline with the provider's typed refusal, and VRAM↔VRAM, DRAM↔VRAM
//! WRITE and READ move through pinned bounce buffers — one and many descriptors, sizes
//! across chunk boundaries, two agents in one process and two processes, data checked
//! by copying VRAM back to the host, the target checking its VRAM at the moment the
//! notification arrives.
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead.
#![cfg(all(feature = "cuda", feature = "libfabric"))]

mod common;

use common::{
    announce_agent, announce_path, device_buffer as device, dram, listening, on, on_notif, pattern,
    self_test, vram, whole, with_extra, PeerProcess, TIMEOUT,
};
use gpu_mem::Gpu;
use nixl::{params, Agent, AgentConfig, Desc, DescList, Error, MemKind, XferOp, XferStatus};
use std::time::Instant;

const PROVIDERS: &[&str] = &["tcp;ofi_rxm", "shm"];
/// Small slots so that a few MiB cross many chunk boundaries.
const CHUNK: usize = 256 << 10;

fn agent_with(name: &str, provider: &str, extra: &[(&str, &str)], config: AgentConfig) -> Agent {
    let chunk = CHUNK.to_string();
    let p = params([("provider", provider), ("staging_chunk", chunk.as_str())]);
    common::agent_with_backend(name, config, "LIBFABRIC", &with_extra(p, extra))
}

fn agent(name: &str, provider: &str) -> Agent {
    agent_with(name, provider, &[], AgentConfig::default())
}

/// Blocks of `sizes` at odd offsets (one byte apart), and the total span.
fn layout(sizes: &[usize]) -> (Vec<usize>, usize) {
    let mut offs = Vec::with_capacity(sizes.len());
    let mut at = 1;
    for &s in sizes {
        offs.push(at);
        at += s + 1;
    }
    (offs, at + 1)
}

fn assert_blocks(what: &str, got: &[u8], want: &[u8], offs: &[usize], sizes: &[usize]) {
    for (i, (&o, &s)) in offs.iter().zip(sizes).enumerate() {
        assert!(
            got[o..o + s] == want[o..o + s],
            "{what}: block {i} ({s} bytes at {o}) differs"
        );
    }
}

// ---- registration ---------------------------------------------------------------------

#[test]
fn vram_registers_staged_where_direct_registration_is_refused_typed() {
    let Some(gpu) =
        gpu_mem::gpu_for_test("vram_registers_staged_where_direct_registration_is_refused_typed")
    else {
        return;
    };
    let buf = device(&gpu, 1 << 20, &[]);
    for provider in PROVIDERS {
        // `direct` only: the provider's refusal is the registration's error, typed.
        let strict = agent_with(
            &format!("strict-{}", provider.replace(';', "_")),
            provider,
            &[("vram_mode", "direct")],
            AgentConfig::default(),
        );
        // SAFETY: the buffer outlives the handle.
        let direct = unsafe { strict.register_mem(&vram([whole(&buf)]), None) };
        let refused = match direct {
            Ok(_) => {
                println!("REPORT {provider}: VRAM registered directly (FI_HMEM CUDA works)");
                false
            }
            Err(Error::Backend { code, message, .. }) => {
                assert!(
                    code == libc::ENOSYS || code == libc::EOPNOTSUPP,
                    "{provider}: refusal not typed as unsupported: code {code}: {message}"
                );
                println!("REPORT {provider}: direct VRAM registration refused: {message}");
                true
            }
            Err(other) => panic!("{provider}: {other:?}"),
        };
        // `auto` (the default): the same refusal means staged, and says so.
        let a = agent(&format!("auto-{}", provider.replace(';', "_")), provider);
        // SAFETY: as above.
        let _h = unsafe { a.register_mem(&vram([whole(&buf)]), None).unwrap() };
        let modes = a.query_mem(&vram([whole(&buf), on(&buf, 4096, 100)]));
        let want = if refused {
            "LIBFABRIC(staged)"
        } else {
            "LIBFABRIC(direct)"
        };
        for m in &modes {
            assert_eq!(m.as_deref(), Some(&[want.to_string()][..]), "{provider}");
        }
        // `staged` always stages.
        let s = agent_with(
            &format!("staged-{}", provider.replace(';', "_")),
            provider,
            &[("vram_mode", "staged")],
            AgentConfig::default(),
        );
        // SAFETY: as above.
        let _h = unsafe { s.register_mem(&vram([whole(&buf)]), None).unwrap() };
        assert_eq!(
            s.query_mem(&vram([whole(&buf)]))[0].as_deref(),
            Some(&["LIBFABRIC(staged)".to_string()][..])
        );
        // DRAM stays as it was (no mode to report).
        let host = vec![0u8; 4096];
        // SAFETY: `host` outlives the handle.
        let _d = unsafe {
            a.register_mem(&dram([Desc::from_slice(&host)]), None)
                .unwrap()
        };
        assert_eq!(
            a.query_mem(&dram([Desc::from_slice(&host)]))[0].as_deref(),
            Some(&["LIBFABRIC".to_string()][..])
        );
    }
}

// ---- one process ------------------------------------------------------------------------

/// WRITE `sizes` blocks from `src` to the target, then READ them back into `back`; each
/// side VRAM or DRAM as told. The target checks its memory when the notification comes.
fn write_then_read(
    gpu: &Gpu,
    provider: &str,
    local_vram: bool,
    remote_vram: bool,
    sizes: &[usize],
) {
    let tag = format!(
        "{}-{}{}-{}",
        provider.replace(';', "_"),
        u8::from(local_vram),
        u8::from(remote_vram),
        sizes.len()
    );
    let initiator = agent(&format!("i-{tag}"), provider);
    let target = agent(&format!("t-{tag}"), provider);
    let (offs, span) = layout(sizes);
    let want = pattern(sizes.len() as u8 ^ 0x5a, span);
    // Local source and read-back buffers, remote destination: VRAM or DRAM.
    let src_v = device(gpu, span, &want);
    let back_v = device(gpu, span, &[]);
    let dst_v = device(gpu, span, &[]);
    let src_h = want.clone();
    let mut back_h = vec![0u8; span];
    let dst_h = vec![0u8; span];
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
    let dev = |kind: MemKind| {
        if kind == MemKind::Vram {
            gpu.ordinal() as u64
        } else {
            0
        }
    };
    let list = |kind: MemKind, base: u64, blocks: bool| {
        DescList::from_descs(
            kind,
            if blocks {
                offs.iter()
                    .zip(sizes)
                    .map(|(&o, &s)| Desc::new(base + o as u64, s as u64, dev(kind)))
                    .collect::<Vec<_>>()
            } else {
                vec![Desc::new(base, span as u64, dev(kind))]
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
    // Checked at the moment the notification arrives, before the initiator's status.
    let landed = on_notif(&target, initiator.name(), |msg| {
        assert_eq!(msg, b"written");
        read_remote()
    });
    assert_blocks(
        &format!("{tag}: WRITE (at notification)"),
        &landed,
        &want,
        &offs,
        sizes,
    );
    w.wait(TIMEOUT).unwrap();
    // Gaps untouched.
    for &o in &offs {
        assert_eq!(landed[o - 1], 0, "{tag}: byte before a block written");
    }
    // READ back, twice (a repost moves fresh data).
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
        assert_blocks(
            &format!("{tag}: READ round {round}"),
            &got,
            &want,
            &offs,
            sizes,
        );
    }
    let t = w.telemetry();
    assert_eq!(t.total_bytes, sizes.iter().sum::<usize>() as u64);
    // Staged where either side is (DRAM never is; VRAM is unless the provider takes it
    // directly, which a libfabric with CUDA would).
    let staged = |a: &Agent, kind: MemKind, base: u64| {
        kind == MemKind::Vram
            && a.query_mem(&list(kind, base, false))[0]
                .as_deref()
                .is_some_and(|m| m == ["LIBFABRIC(staged)".to_string()])
    };
    let any_staged = staged(&initiator, kind_l, src) || staged(&target, kind_r, dst);
    let want_staged = if any_staged { t.total_bytes } else { 0 };
    assert_eq!(
        t.staged_bytes, want_staged,
        "{tag}: staged bytes in telemetry"
    );
}

const SIZES: &[usize] = &[1, 4097, (3 << 20) + 5];

#[test]
fn staged_vram_to_vram_write_and_read() {
    let Some(gpu) = gpu_mem::gpu_for_test("staged_vram_to_vram_write_and_read") else {
        return;
    };
    for provider in PROVIDERS {
        for &s in SIZES {
            write_then_read(&gpu, provider, true, true, &[s]);
        }
        write_then_read(&gpu, provider, true, true, SIZES);
    }
}

#[test]
fn staged_dram_to_vram_and_vram_to_dram() {
    let Some(gpu) = gpu_mem::gpu_for_test("staged_dram_to_vram_and_vram_to_dram") else {
        return;
    };
    for provider in PROVIDERS {
        // Local DRAM, remote VRAM: the target pulls the WRITE and pushes the READ.
        write_then_read(&gpu, provider, false, true, SIZES);
        // Local VRAM, remote DRAM: this side copies through its own slots.
        write_then_read(&gpu, provider, true, false, SIZES);
        write_then_read(&gpu, provider, true, false, &[(3 << 20) + 5]);
        write_then_read(&gpu, provider, false, true, &[1]);
    }
}

#[test]
fn staged_vram_many_descriptors_and_two_rails() {
    let Some(gpu) = gpu_mem::gpu_for_test("staged_vram_many_descriptors_and_two_rails") else {
        return;
    };
    // 1,000 blocks of odd sizes around 4 KiB: many blocks share a chunk, some cross.
    let sizes: Vec<usize> = (0..1000).map(|i| 4096 + (i * 37) % 5000).collect();
    for provider in PROVIDERS {
        write_then_read(&gpu, provider, true, true, &sizes);
    }
    // Two rails: chunks alternate between them.
    let a = agent_with(
        "rails-i",
        "tcp;ofi_rxm",
        &[("num_rails", "2")],
        AgentConfig::default(),
    );
    let b = agent_with(
        "rails-t",
        "tcp;ofi_rxm",
        &[("num_rails", "2")],
        AgentConfig::default(),
    );
    let len = (8 << 20) + 3;
    let want = pattern(77, len);
    let src = device(&gpu, len, &want);
    let dst = device(&gpu, len, &[]);
    // SAFETY: the buffers outlive the handles and the request.
    let _ha = unsafe { a.register_mem(&vram([whole(&src)]), None).unwrap() };
    // SAFETY: as above.
    let _hb = unsafe { b.register_mem(&vram([whole(&dst)]), None).unwrap() };
    let name = a
        .load_remote_metadata(&b.local_metadata().unwrap())
        .unwrap();
    let mut w = a
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&src)]),
            &vram([whole(&dst)]),
            &name,
            None,
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    assert!(dst.to_vec().unwrap() == want, "two rails");
}

#[test]
fn staged_vram_without_progress_threads() {
    let Some(gpu) = gpu_mem::gpu_for_test("staged_vram_without_progress_threads") else {
        return;
    };
    let config = AgentConfig {
        progress_thread: false,
        ..AgentConfig::default()
    };
    for provider in PROVIDERS {
        let tag = provider.replace(';', "_");
        let a = agent_with(&format!("np-i-{tag}"), provider, &[], config.clone());
        let b = agent_with(&format!("np-t-{tag}"), provider, &[], config.clone());
        let len = (4 << 20) + 1;
        let want = pattern(3, len);
        let src = device(&gpu, len, &want);
        let dst = device(&gpu, len, &[]);
        // SAFETY: the buffers outlive the handles and the request.
        let _ha = unsafe { a.register_mem(&vram([whole(&src)]), None).unwrap() };
        // SAFETY: as above.
        let _hb = unsafe { b.register_mem(&vram([whole(&dst)]), None).unwrap() };
        let name = a
            .load_remote_metadata(&b.local_metadata().unwrap())
            .unwrap();
        let mut w = a
            .create_xfer_req(
                XferOp::Write,
                &vram([whole(&src)]),
                &vram([whole(&dst)]),
                &name,
                Some(b"np".to_vec()),
            )
            .unwrap();
        w.post().unwrap();
        let deadline = Instant::now() + TIMEOUT;
        let (mut done, mut notified) = (false, false);
        while !(done && notified) {
            assert!(Instant::now() < deadline, "{provider}: no progress");
            done = done || w.status().unwrap() == XferStatus::Done;
            if let Some(msgs) = b.get_notifs().remove(a.name()) {
                assert_eq!(msgs, vec![b"np".to_vec()]);
                assert!(
                    dst.to_vec().unwrap() == want,
                    "{provider}: notified before the data"
                );
                notified = true;
            }
        }
    }
}

/// Staged VRAM→VRAM against DRAM→DRAM on the same backend (printed; the goal is ≥ 0.8×
/// at ≥ 1 MiB blocks, checked by the benchmark runs rather than here).
#[test]
fn staged_vram_bandwidth_against_dram() {
    let Some(gpu) = gpu_mem::gpu_for_test("staged_vram_bandwidth_against_dram") else {
        return;
    };
    let total = 64 << 20;
    for provider in PROVIDERS {
        for block in [1 << 20, 4 << 20, 16 << 20] {
            let n = total / block;
            let mut results = Vec::new();
            for vram_sides in [false, true] {
                let tag = format!("bw-{}-{block}-{vram_sides}", provider.replace(';', "_"));
                let a = Agent::new(format!("{tag}-i"), AgentConfig::default()).unwrap();
                let b = Agent::new(format!("{tag}-t"), AgentConfig::default()).unwrap();
                let p = params([("provider", *provider)]);
                a.create_backend("LIBFABRIC", &p).unwrap();
                b.create_backend("LIBFABRIC", &p).unwrap();
                let src_v = device(&gpu, total, &pattern(1, total));
                let dst_v = device(&gpu, total, &[]);
                let src_h = pattern(1, total);
                let dst_h = vec![0u8; total];
                let (kind, src, dst, dev) = if vram_sides {
                    (
                        MemKind::Vram,
                        src_v.ptr(),
                        dst_v.ptr(),
                        gpu.ordinal() as u64,
                    )
                } else {
                    (
                        MemKind::Dram,
                        src_h.as_ptr() as u64,
                        dst_h.as_ptr() as u64,
                        0,
                    )
                };
                let whole = |base| DescList::from_descs(kind, [Desc::new(base, total as u64, dev)]);
                // SAFETY: the buffers outlive the handles and the request.
                let _ha = unsafe { a.register_mem(&whole(src), None).unwrap() };
                // SAFETY: as above.
                let _hb = unsafe { b.register_mem(&whole(dst), None).unwrap() };
                let name = a
                    .load_remote_metadata(&b.local_metadata().unwrap())
                    .unwrap();
                let blocks = |base: u64| {
                    DescList::from_descs(
                        kind,
                        (0..n).map(|i| Desc::new(base + (i * block) as u64, block as u64, dev)),
                    )
                };
                let mut w = a
                    .create_xfer_req(XferOp::Write, &blocks(src), &blocks(dst), &name, None)
                    .unwrap();
                w.post().unwrap();
                w.wait(TIMEOUT).unwrap();
                let rounds = 8;
                let start = Instant::now();
                for _ in 0..rounds {
                    w.post().unwrap();
                    w.wait(TIMEOUT).unwrap();
                }
                results.push((total * rounds) as f64 / start.elapsed().as_secs_f64() / 1e9);
            }
            println!(
                "REPORT {provider:12} WRITE {block:>9} B blocks: DRAM {:.2} GB/s, staged VRAM {:.2} GB/s ({:.2}x)",
                results[0],
                results[1],
                results[1] / results[0]
            );
        }
    }
}

// ---- two processes ----------------------------------------------------------------------

const PEER_LEN: usize = (6 << 20) + 7;

/// The target process of `staged_vram_two_processes`: runs only when re-executed with
/// NIXL_STAGING_PEER (`announce-file provider`).
#[test]
fn staged_vram_peer_process_main() {
    let Some(gpu) = gpu_mem::gpu_for_test("staged_vram_peer_process_main") else {
        return;
    };
    let Ok(role) = std::env::var("NIXL_STAGING_PEER") else {
        return;
    };
    let (announce, provider) = role.split_once(' ').unwrap();
    let peer = agent_with("vram-peer", provider, &[], listening());
    let buf = device(&gpu, PEER_LEN, &pattern(42, PEER_LEN));
    // SAFETY: `buf` lives until the process exits.
    let _h = unsafe { peer.register_mem(&vram([whole(&buf)]), None).unwrap() };
    let mode = peer.query_mem(&vram([whole(&buf)]))[0].clone().unwrap();
    assert!(
        mode == ["LIBFABRIC(staged)"] || mode == ["LIBFABRIC(direct)"],
        "{mode:?}"
    );
    eprintln!("REPORT peer VRAM over {provider}: {mode:?}");
    announce_agent(announce, &peer, buf.ptr());
    let got = on_notif(&peer, "vram-initiator", |msg| {
        assert_eq!(msg, b"second half");
        // At the moment the notification arrives.
        buf.to_vec().unwrap()
    });
    let half = PEER_LEN / 2;
    assert!(
        got[half..] == pattern(7, PEER_LEN)[half..],
        "data after notification"
    );
    assert!(
        got[..half] == pattern(42, PEER_LEN)[..half],
        "first half untouched"
    );
    std::fs::write(format!("{announce}.ok"), "PEER OK").unwrap();
}

/// A copy of this binary running [`staged_vram_peer_process_main`] over `provider`.
fn spawn_peer(provider: &str) -> PeerProcess {
    let announce = announce_path("nixl-gpu-staging", provider);
    let mut cmd = self_test("staged_vram_peer_process_main", false);
    cmd.env(
        "NIXL_STAGING_PEER",
        format!("{} {provider}", announce.display()),
    );
    PeerProcess::spawn(cmd, announce)
}

#[test]
fn staged_vram_two_processes() {
    let Some(gpu) = gpu_mem::gpu_for_test("staged_vram_two_processes") else {
        return;
    };
    for provider in PROVIDERS {
        let initiator = agent("vram-initiator", provider);
        let local = device(&gpu, PEER_LEN, &pattern(7, PEER_LEN));
        let first_half = device(&gpu, PEER_LEN / 2, &[]);
        let host_half = vec![0u8; PEER_LEN / 2];
        // SAFETY: the buffers outlive the handles and the requests.
        let _hv = unsafe {
            initiator
                .register_mem(&vram([whole(&local), whole(&first_half)]), None)
                .unwrap()
        };
        // SAFETY: as above.
        let _hd = unsafe {
            initiator
                .register_mem(&dram([Desc::from_slice(&host_half)]), None)
                .unwrap()
        };
        let mut peer = spawn_peer(provider);
        let name = initiator.fetch_remote_metadata(peer.addr).unwrap();
        let half = (PEER_LEN / 2) as u64;
        let dev = gpu.ordinal() as u64;
        // READ the peer's first half into VRAM, and into DRAM.
        for (what, local_list) in [
            ("VRAM", vram([whole(&first_half)])),
            ("DRAM", dram([Desc::from_slice(&host_half)])),
        ] {
            let mut read = initiator
                .create_xfer_req(
                    XferOp::Read,
                    &local_list,
                    &vram([Desc::new(peer.base, half, dev)]),
                    &name,
                    None,
                )
                .unwrap();
            read.post().unwrap();
            read.wait(TIMEOUT).unwrap();
            let got = if what == "VRAM" {
                first_half.to_vec().unwrap()
            } else {
                host_half.clone()
            };
            assert!(
                got == pattern(42, PEER_LEN)[..PEER_LEN / 2],
                "{provider}: READ into {what}"
            );
        }
        // WRITE the second half from VRAM, with a notification the peer checks.
        let mut write = initiator
            .create_xfer_req(
                XferOp::Write,
                &vram([on(&local, PEER_LEN / 2, PEER_LEN - PEER_LEN / 2)]),
                &vram([Desc::new(
                    peer.base + half,
                    (PEER_LEN - PEER_LEN / 2) as u64,
                    dev,
                )]),
                &name,
                Some(b"second half".to_vec()),
            )
            .unwrap();
        write.post().unwrap();
        write.wait(TIMEOUT).unwrap();
        assert_eq!(peer.verdict(), "PEER OK", "{provider}");
    }
}
