#![cfg(feature = "verbs")]
//! The VERBS staging pipeline on soft-RoCE (run in the guest by `cargo xtask test`, which
//! sets `RDMA_TEST_DEVICE=rxe0`), without a GPU: DRAM registered as staged
//! (`stage_dram=1`) goes through exactly the protocol VRAM does, with `memcpy` in place
//! of the device copies. Two agents WRITE and READ in every case (initiator staged,
//! target staged, both) with the data verified, notifications only after the last staged
//! byte, a target refusing memory that is not staged (typed), released requests,
//! polling without progress threads, two processes and a peer killed mid-pipeline; and
//! direct VRAM registration refused typed on soft-RoCE (no DMA-BUF registration).

mod common;

use common::staged::StagedBackend;
use common::{
    announce_agent, announce_path, dram, error_after_peer_died, listening, pattern,
    rdma_device as device, self_test, serial, wait_notif, wait_notifs, PeerProcess, TIMEOUT,
};
use nixl::backend::Backend;
use nixl::backends::verbs::VerbsBackend;
use nixl::{params, Agent, AgentConfig, Desc, Error, MemKind, Region, XferOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Small slots, so that a few MiB cross many chunk boundaries and reuse every slot.
const CHUNK: &str = "262144";

/// VERBS on `device`, with small slots: a few MiB cross many chunk boundaries and reuse
/// every slot.
fn verbs(device: &str) -> StagedBackend {
    StagedBackend::new(
        "VERBS",
        params([("device", device), ("staging_chunk", CHUNK)]),
    )
}

fn verbs_params(device: &str, stage: bool, extra: &[(&str, &str)]) -> nixl::BackendParams {
    verbs(device).params(stage, extra)
}

fn agent_with(
    name: &str,
    device: &str,
    stage: bool,
    extra: &[(&str, &str)],
    config: AgentConfig,
) -> Agent {
    verbs(device).agent_with(name, stage, extra, config)
}

fn agent(name: &str, device: &str, stage: bool, extra: &[(&str, &str)]) -> Agent {
    verbs(device).agent(name, stage, extra)
}

/// An agent with the backend it uses, kept as its concrete type.
fn agent_and_backend(
    name: &str,
    device: &str,
    extra: &[(&str, &str)],
) -> (Agent, Arc<VerbsBackend>) {
    let agent = Agent::new(name, AgentConfig::default()).unwrap();
    let backend = Arc::new(
        VerbsBackend::open(&agent.backend_init(verbs_params(device, false, extra)))
            .unwrap_or_else(|e| panic!("VERBS on {device}: {e}")),
    );
    agent
        .add_backend(backend.clone() as Arc<dyn Backend>)
        .unwrap();
    (agent, backend)
}

#[test]
fn staged_write_and_read_in_every_case() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let start = Instant::now();
    // Local staged / remote plain, local plain / remote staged, both staged: WRITE and
    // READ each, one byte to several chunks, slots reused (4 per half).
    for (init, tgt) in [(true, false), (false, true), (true, true)] {
        verbs(&dev).round_trip(
            init,
            tgt,
            &[1, 4097, (3 << 20) + 5, 1 << 20],
            &[("staging_chunks", "4")],
        );
    }
    println!("every case in {:?}", start.elapsed());
}

#[test]
fn staged_two_rails_many_descriptors() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let sizes: Vec<usize> = (0..1000).map(|i| 1000 + (i % 7) * 700).collect();
    let verbs = verbs(&dev);
    verbs.round_trip(true, true, &sizes, &[("num_rails", "2")]);
    verbs.round_trip(false, true, &sizes[..300], &[("num_rails", "2")]);
    verbs.round_trip(true, false, &sizes[..300], &[("num_rails", "2")]);
}

/// The target checks its memory at the moment the notification arrives (the initiator's
/// request is not waited for first), over rounds of a staged WRITE of many descriptors
/// whose chunks land in any order.
#[test]
fn staged_notification_only_after_the_last_chunk_landed() {
    let Some(dev) = device() else { return };
    let _s = serial();
    for init_stages in [false, true] {
        verbs(&dev).notification_only_after_the_last_chunk(
            init_stages,
            6 << 20,
            &[("num_rails", "2")],
        );
    }
}

#[test]
fn staged_without_progress_threads_the_callers_polls_drive_the_pipeline() {
    let Some(dev) = device() else { return };
    let _s = serial();
    verbs(&dev).without_progress_threads((3 << 20) + 3);
}

/// A target asked to move memory that is not (or no longer) staged refuses the chunk:
/// the transfer fails typed, nothing of that memory is touched, and the connection keeps
/// working.
#[test]
fn staged_requests_for_memory_that_is_not_staged_fail_typed() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let initiator = agent("bad-i", &dev, false, &[]);
    let target = agent("bad-t", &dev, true, &[]);
    let len = 1 << 20;
    let src = pattern(5, len);
    let mut back = vec![0u8; len];
    let back_p = back.as_mut_ptr() as u64;
    let dst = vec![0u8; len];
    // SAFETY: the buffers outlive the handles and the requests.
    let _hi = unsafe {
        initiator
            .register_mem(
                &dram([Desc::from_slice(&src), Desc::new(back_p, len as u64, 0)]),
                None,
            )
            .unwrap()
    };
    // SAFETY: as above.
    let ht = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&dst)]), None)
            .unwrap()
    };
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    // Outside every region the target published: refused before anything is posted.
    let outside = dram([Desc::new(dst.as_ptr() as u64 + len as u64, 4096, 0)]);
    let local4k = dram([Desc::new(src.as_ptr() as u64, 4096, 0)]);
    match initiator.create_xfer_req(XferOp::Write, &local4k, &outside, &name, None) {
        Err(Error::RemoteOutOfBounds { .. }) => {}
        other => panic!("outside the target's regions: {other:?}"),
    }
    // The target releases its staged region; the initiator still has the old metadata.
    drop(ht);
    for op in [XferOp::Write, XferOp::Read] {
        let local = if op == XferOp::Write {
            Desc::from_slice(&src)
        } else {
            Desc::new(back_p, len as u64, 0)
        };
        let mut req = initiator
            .create_xfer_req(
                op,
                &dram([local]),
                &dram([Desc::from_slice(&dst)]),
                &name,
                None,
            )
            .unwrap();
        req.post().unwrap();
        match req.wait(TIMEOUT) {
            Err(Error::Backend { code, message, .. }) => {
                assert_eq!(code, libc::EINVAL, "{op:?}: {message}");
                assert!(
                    message.contains("not inside a staged registration"),
                    "{op:?}: {message}"
                );
                println!("{op:?} into released staged memory: {message}");
            }
            other => panic!("{op:?} into released staged memory: {other:?}"),
        }
    }
    assert!(dst.iter().all(|b| *b == 0), "refused memory was written");
    assert!(back.iter().all(|b| *b == 0), "a refused READ wrote data");
    // Registered again and republished: the same connection carries it.
    // SAFETY: `dst` outlives the handle and the request.
    let _ht = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&dst)]), None)
            .unwrap()
    };
    initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(&src)]),
            &dram([Desc::from_slice(&dst)]),
            &name,
            Some(b"again".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&target, initiator.name()), b"again");
    assert!(src == dst);
}

/// Requests released mid-pipeline (WRITE and READ, at different moments) leave both
/// sides able to run full transfers with every slot; forgetting the peer too.
#[test]
fn released_staged_requests_leave_everything_working() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let extra = [("staging_chunk", "65536"), ("staging_chunks", "4")];
    let initiator = agent("rel-i", &dev, true, &extra);
    let target = agent("rel-t", &dev, true, &extra);
    let len = 4 << 20;
    let src = pattern(2, len);
    let dst = vec![0u8; len];
    let mut back = vec![0u8; len];
    let back_p = back.as_mut_ptr() as u64;
    // SAFETY: the buffers outlive the handles and the requests.
    let _hi = unsafe {
        initiator
            .register_mem(
                &dram([Desc::from_slice(&src), Desc::new(back_p, len as u64, 0)]),
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
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    for round in 0..12u64 {
        let op = if round % 2 == 0 {
            XferOp::Write
        } else {
            XferOp::Read
        };
        let local = if op == XferOp::Write {
            Desc::from_slice(&src)
        } else {
            Desc::new(back_p, len as u64, 0)
        };
        let mut req = initiator
            .create_xfer_req(
                op,
                &dram([local]),
                &dram([Desc::from_slice(&dst)]),
                &name,
                Some(b"x".to_vec()),
            )
            .unwrap();
        req.post().unwrap();
        std::thread::sleep(Duration::from_micros(300 * (round % 5)));
        drop(req);
    }
    // Whatever the released requests left behind settles; full transfers still work.
    for _ in 0..2 {
        let mut w = initiator
            .create_xfer_req(
                XferOp::Write,
                &dram([Desc::from_slice(&src)]),
                &dram([Desc::from_slice(&dst)]),
                &name,
                None,
            )
            .unwrap();
        w.post().unwrap();
        w.wait(TIMEOUT).unwrap();
        assert!(src == dst);
        back.fill(0);
        let mut r = initiator
            .create_xfer_req(
                XferOp::Read,
                &dram([Desc::new(back_p, len as u64, 0)]),
                &dram([Desc::from_slice(&dst)]),
                &name,
                None,
            )
            .unwrap();
        r.post().unwrap();
        r.wait(TIMEOUT).unwrap();
        assert!(back == src);
    }
    initiator.invalidate_remote(&name).unwrap();
}

/// Soft-RoCE cannot register DMA-BUF memory: direct VRAM registration is refused typed
/// (`vram_mode=direct`: the registration's error, `EOPNOTSUPP`, naming why), `auto`
/// knows it will stage, `staged` always stages.
#[test]
fn direct_vram_registration_is_refused_typed_and_auto_stages() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let host = vec![0u8; 1 << 16];
    // Host memory declared VRAM: the refusal comes before anything looks at it.
    let region = Region {
        kind: MemKind::Vram,
        desc: Desc::from_slice(&host),
    };
    let (_a, direct) = agent_and_backend("vram-direct", &dev, &[("vram_mode", "direct")]);
    let why = direct
        .direct_vram_refusal()
        .expect("rxe registers no DMA-BUF");
    println!("{dev} vram_mode=direct: {why}");
    if dev.starts_with("rxe") {
        assert!(why.contains("DMA-BUF"), "the device's refusal first: {why}");
        assert!(why.contains("unsupported"), "{why}");
    }
    match direct.register_mem(&region) {
        Err(Error::Backend { code, message, .. }) => {
            assert_eq!(code, libc::EOPNOTSUPP, "{message}");
            assert!(message.contains("(unsupported)"), "{message}");
            assert!(message.contains(why), "names why: {message}");
        }
        other => panic!("direct VRAM on {dev}: {other:?}"),
    }

    let (_a, auto) = agent_and_backend("vram-auto", &dev, &[("stage_dram", "1")]);
    assert_eq!(
        auto.direct_vram_refusal(),
        Some(why),
        "auto sees the same refusal"
    );
    // The staging pool exists once something is staged (here DRAM, on the heap).
    let dram_region = Region {
        kind: MemKind::Dram,
        desc: Desc::from_slice(&host),
    };
    let staged_dram = auto.register_mem(&dram_region).unwrap();
    assert_eq!(staged_dram.mode(), Some("staged"));
    match (cfg!(feature = "cuda"), auto.register_mem(&region)) {
        // With GPU support the refused direct registration falls back to staged.
        (true, Ok(md)) => {
            assert_eq!(md.mode(), Some("staged"));
            assert_eq!(md.public_md()[0], 0, "staged metadata");
        }
        // Without it nothing could copy VRAM: the kind is refused.
        (false, Err(Error::UnsupportedMemKind { kind, .. })) => assert_eq!(kind, MemKind::Vram),
        (cuda, other) => panic!("auto VRAM on {dev} (feature cuda: {cuda}): {other:?}"),
    }
    assert_eq!(
        auto.supported_mem().contains(&MemKind::Vram),
        cfg!(feature = "cuda")
    );
    assert!(auto.supported_remote_mem().contains(&MemKind::Vram));

    let (_a, staged) = agent_and_backend("vram-staged", &dev, &[("vram_mode", "staged")]);
    assert_eq!(staged.direct_vram_refusal(), Some("vram_mode=staged"));
    // Bad staging parameters are typed too.
    for bad in [
        ("vram_mode", "sometimes"),
        ("staging_chunk", "1000"),
        ("staging_chunks", "1"),
        ("stage_dram", "maybe"),
    ] {
        let a = Agent::new("bad-params", AgentConfig::default()).unwrap();
        match a.create_backend("VERBS", &verbs_params(&dev, false, &[bad])) {
            Err(Error::InvalidParam(why)) => println!("{bad:?}: {why}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

// ---- two processes ----------------------------------------------------------------------

const PEER_LEN: usize = 8 << 20;
const PEER_NAME: &str = "staged-peer";
const INITIATOR_NAME: &str = "staged-initiator";

/// The target side of the two-process test: runs only when re-executed with
/// NIXL_STAGED_PEER (the announce file). It stages its buffer, checks the second half
/// the moment the notification arrives, and reports through `<announce>.ok`.
#[test]
#[ignore = "target process of staged_two_processes_then_a_killed_peer"]
fn staged_peer_process() {
    let announce =
        std::env::var("NIXL_STAGED_PEER").expect("run by staged_two_processes_then_a_killed_peer");
    let dev = device().expect("RDMA_TEST_DEVICE is inherited");
    let peer = agent_with(PEER_NAME, &dev, true, &[], listening());
    let buf = pattern(42, PEER_LEN);
    // SAFETY: `buf` lives until the process exits.
    let _h = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    announce_agent(&announce, &peer, buf.as_ptr() as u64);
    assert_eq!(
        wait_notifs(&peer, INITIATOR_NAME),
        vec![b"second half".to_vec()]
    );
    // Checked the moment the notification arrives.
    let half = PEER_LEN / 2;
    assert!(
        buf[half..] == pattern(7, PEER_LEN)[half..],
        "data after notification"
    );
    assert!(
        buf[..half] == pattern(42, PEER_LEN)[..half],
        "first half untouched"
    );
    std::fs::write(format!("{announce}.ok"), "PEER OK").unwrap();
}

/// A copy of this binary running [`staged_peer_process`].
fn spawn_peer(tag: &str) -> PeerProcess {
    let announce = announce_path("nixl-verbs-staged", tag);
    let mut cmd = self_test("staged_peer_process", true);
    cmd.env("NIXL_STAGED_PEER", &announce);
    PeerProcess::spawn(cmd, announce)
}

#[test]
fn staged_two_processes_then_a_killed_peer() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let stall_timeout = Duration::from_secs(10);
    let initiator = agent_with(
        INITIATOR_NAME,
        &dev,
        true,
        &[],
        AgentConfig {
            stall_timeout,
            ..AgentConfig::default()
        },
    );
    let local = pattern(7, PEER_LEN);
    let mut first_half = vec![0u8; PEER_LEN / 2];
    let fh = first_half.as_mut_ptr() as u64;
    // SAFETY: both buffers outlive the handle and the requests.
    let _h = unsafe {
        initiator
            .register_mem(
                &dram([
                    Desc::from_slice(&local),
                    Desc::new(fh, (PEER_LEN / 2) as u64, 0),
                ]),
                None,
            )
            .unwrap()
    };
    let half = (PEER_LEN / 2) as u64;
    let mut peer = spawn_peer("data");
    let name = initiator.fetch_remote_metadata(peer.addr).unwrap();
    let mut read = initiator
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::new(fh, half, 0)]),
            &dram([Desc::new(peer.base, half, 0)]),
            &name,
            None,
        )
        .unwrap();
    read.post().unwrap();
    read.wait(TIMEOUT).unwrap();
    assert!(first_half == pattern(42, PEER_LEN)[..PEER_LEN / 2], "READ");
    let mut write = initiator
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::new(local.as_ptr() as u64 + half, half, 0)]),
            &dram([Desc::new(peer.base + half, half, 0)]),
            &name,
            Some(b"second half".to_vec()),
        )
        .unwrap();
    write.post().unwrap();
    write.wait(TIMEOUT).unwrap();
    assert_eq!(peer.verdict(), "PEER OK");
    drop(peer);

    // A peer killed mid-pipeline: the transfer fails typed (the side channel saw the
    // process go, or the stall bound), never hangs.
    let mut victim = spawn_peer("victim");
    let name = initiator.fetch_remote_metadata(victim.addr).unwrap();
    let mut big = initiator
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(&local)]),
            &dram([Desc::new(victim.base, PEER_LEN as u64, 0)]),
            &name,
            None,
        )
        .unwrap();
    big.post().unwrap();
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    let started = Instant::now();
    let err = error_after_peer_died(&mut big);
    assert!(
        matches!(err, Error::RemoteDisconnect { .. } | Error::Stalled(_)),
        "{err:?}"
    );
    println!("killed peer -> {err} after {:?}", started.elapsed());
    drop(big);
    initiator.invalidate_remote(&name).unwrap();
}

/// GB/s of `rounds` posts of a WRITE (or READ) of `batch` blocks of `block` bytes.
fn bandwidth(
    device: &str,
    op: XferOp,
    stage: bool,
    block: usize,
    batch: usize,
    rounds: usize,
) -> f64 {
    let tag = format!("bw-{op:?}-{stage}-{block}");
    let initiator = agent(&format!("{tag}-i"), device, stage, &[]);
    let target = agent(&format!("{tag}-t"), device, stage, &[]);
    let span = block * batch;
    let src = pattern(3, span);
    let dst = vec![0u8; span];
    // SAFETY: the buffers outlive the handles and the request.
    let _hi = unsafe {
        initiator
            .register_mem(&dram([Desc::from_slice(&src)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _ht = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&dst)]), None)
            .unwrap()
    };
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    let at = |base: u64, i: usize| Desc::new(base + (i * block) as u64, block as u64, 0);
    let mut req = initiator
        .create_xfer_req(
            op,
            &dram((0..batch).map(|i| at(src.as_ptr() as u64, i))),
            &dram((0..batch).map(|i| at(dst.as_ptr() as u64, i))),
            &name,
            None,
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    let start = Instant::now();
    for _ in 0..rounds {
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    if op == XferOp::Write {
        assert!(src == dst);
    }
    (span * rounds) as f64 / secs / 1e9
}

/// Staged (both sides, memcpy in place of the device copies) against plain DRAM on the
/// same device: a measurement, not a check (soft-RoCE in the guest shares two vCPUs
/// with the copies). `cargo xtask rxe -- env RDMA_TEST_DEVICE=rxe0 <this binary>
/// staged_bandwidth --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn staged_bandwidth() {
    let Some(dev) = device() else { return };
    let _s = serial();
    for op in [XferOp::Write, XferOp::Read] {
        for block in [64 << 10, 1 << 20] {
            let batch = (8 << 20) / block;
            let plain = bandwidth(&dev, op, false, block, batch, 5);
            let staged = bandwidth(&dev, op, true, block, batch, 5);
            println!(
                "REPORT {dev} {op:?} {block:>8} B x{batch:<4}: DRAM {plain:.3} GB/s, staged both sides {staged:.3} GB/s ({:.2}x)",
                staged / plain
            );
        }
    }
}
