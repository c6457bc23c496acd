//! VRAM in the agent (feature `cuda`): registration checks against the driver, `LOCAL`
//! copies between VRAM and DRAM, and the `CUDA_IPC` backend between two processes —
//! data verified, notifications only after the data, bad inputs typed, and a killed
//! importer or exporter leaves the survivor working.
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead.
#![cfg(feature = "cuda")]

mod common;

use common::{announce_path, dram, pattern, self_test, vram, wait_file, wait_notif, whole};
use gpu_mem::{DeviceBuffer, Gpu};
use nixl::metadata::AgentMetadata;
use nixl::{Agent, AgentConfig, Desc, Error, XferOp, XferStatus};
use std::process::Child;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(30);

fn agent(name: &str, backend: &str, listen: bool) -> Agent {
    let config = AgentConfig {
        listen_addr: listen.then(|| "127.0.0.1:0".parse().unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    agent.create_backend(backend, &Default::default()).unwrap();
    agent
}

// ---- registration -------------------------------------------------------------------------

#[test]
fn vram_descriptors_are_checked_against_the_driver() {
    let Some(gpu) = gpu_mem::gpu_for_test("vram_descriptors_are_checked_against_the_driver") else {
        return;
    };
    let a = agent("reg", "LOCAL", false);
    let buf = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    let dev = gpu.ordinal() as u64;
    // SAFETY: the buffer outlives the handle.
    let ok = unsafe { a.register_mem(&vram([whole(&buf)]), None) };
    assert!(ok.is_ok(), "{ok:?}");
    let host = vec![0u8; 4096];
    let cases: Vec<(&str, Desc)> = vec![
        (
            "a host pointer declared VRAM",
            Desc::new(host.as_ptr() as u64, 4096, dev),
        ),
        ("the wrong GPU", Desc::new(buf.ptr(), 4096, dev + 1)),
        (
            "a range past the allocation",
            Desc::new(buf.ptr(), (2 << 20) + 1, dev),
        ),
    ];
    for (what, desc) in cases {
        // SAFETY: refused before anything is touched.
        let r = unsafe { a.register_mem(&vram([desc]), None) };
        assert!(
            matches!(r, Err(Error::NotDeviceMemory { index: 0, .. })),
            "{what}: {r:?}"
        );
        println!("{what}: {}", r.unwrap_err());
    }
    let freed = {
        let gone = DeviceBuffer::alloc(&gpu, 8 << 20).unwrap();
        whole(&gone)
    };
    // SAFETY: refused: the memory was freed.
    let r = unsafe { a.register_mem(&vram([freed]), None) };
    assert!(
        matches!(r, Err(Error::NotDeviceMemory { .. })),
        "freed: {r:?}"
    );
}

// ---- LOCAL ----------------------------------------------------------------------------------

#[test]
fn local_moves_vram_to_vram_and_to_and_from_dram() {
    let Some(gpu) = gpu_mem::gpu_for_test("local_moves_vram_to_vram_and_to_and_from_dram") else {
        return;
    };
    const LEN: usize = 4 << 20;
    let a = agent("local", "LOCAL", false);
    let v1 = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    let v2 = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    let mut host = pattern(3, LEN);
    let dev = gpu.ordinal() as u64;
    // SAFETY: every buffer outlives the handles and requests.
    let _hv = unsafe {
        a.register_mem(&vram([whole(&v1), whole(&v2)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _hd = unsafe {
        a.register_mem(&dram([Desc::from_slice(&host)]), None)
            .unwrap()
    };
    // DRAM -> VRAM (v1), in 1,000 descriptors of 4 KiB and one big remainder.
    let mut local = Vec::new();
    let mut remote = Vec::new();
    for i in 0..1000u64 {
        local.push(Desc::new(host.as_ptr() as u64 + i * 4096, 4096, 0));
        remote.push(Desc::new(v1.ptr() + i * 4096, 4096, dev));
    }
    let rest = LEN as u64 - 1000 * 4096;
    local.push(Desc::new(host.as_ptr() as u64 + 1000 * 4096, rest, 0));
    remote.push(Desc::new(v1.ptr() + 1000 * 4096, rest, dev));
    let mut w = a
        .create_xfer_req(
            XferOp::Write,
            &dram(local),
            &vram(remote),
            "local",
            Some(b"d2v".to_vec()),
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&a, "local"), b"d2v");
    assert_eq!(v1.to_vec().unwrap(), host, "DRAM -> VRAM");
    // VRAM -> VRAM (v1 -> v2), one descriptor.
    let mut w = a
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&v1)]),
            &vram([whole(&v2)]),
            "local",
            None,
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    assert_eq!(v2.to_vec().unwrap(), host, "VRAM -> VRAM");
    // READ: VRAM (v2) -> DRAM, after changing v2.
    v2.copy_from_host(0, &pattern(9, LEN)).unwrap();
    host.fill(0);
    let mut r = a
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::from_slice(&host)]),
            &vram([whole(&v2)]),
            "local",
            Some(b"v2d".to_vec()),
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&a, "local"), b"v2d");
    assert_eq!(host, pattern(9, LEN), "VRAM -> DRAM by READ");
    // Reposting the same request moves fresh data.
    v2.copy_from_host(0, &pattern(11, LEN)).unwrap();
    assert_eq!(r.post().unwrap(), XferStatus::InProgress);
    r.wait(TIMEOUT).unwrap();
    assert_eq!(host, pattern(11, LEN), "repost");
    let t = r.telemetry();
    assert_eq!(t.total_bytes, LEN as u64);
}

#[test]
fn local_notification_comes_only_after_the_vram_data() {
    let Some(gpu) = gpu_mem::gpu_for_test("local_notification_comes_only_after_the_vram_data")
    else {
        return;
    };
    const LEN: usize = 64 << 20;
    let a = agent("order", "LOCAL", false);
    let src = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    let dst = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    // SAFETY: both outlive the handle and the requests.
    let _h = unsafe {
        a.register_mem(&vram([whole(&src), whole(&dst)]), None)
            .unwrap()
    };
    for round in 1..=5u8 {
        src.fill(round).unwrap();
        let mut w = a
            .create_xfer_req(
                XferOp::Write,
                &vram([whole(&src)]),
                &vram([whole(&dst)]),
                "order",
                Some(vec![round]),
            )
            .unwrap();
        w.post().unwrap();
        // Poll notifications (which drives completion) and check the data the moment the
        // notification shows up.
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let _ = w.status().unwrap();
            if let Some(msgs) = a.get_notifs().remove("order") {
                assert_eq!(msgs, vec![vec![round]]);
                let mut tail = vec![0u8; 4096];
                dst.copy_to_host(LEN - 4096, &mut tail).unwrap();
                assert!(
                    tail.iter().all(|b| *b == round),
                    "round {round}: data behind the notification"
                );
                break;
            }
            assert!(Instant::now() < deadline);
        }
    }
}

#[test]
fn a_post_on_the_callers_stream_runs_after_the_work_queued_there() {
    let Some(gpu) =
        gpu_mem::gpu_for_test("a_post_on_the_callers_stream_runs_after_the_work_queued_there")
    else {
        return;
    };
    let a = agent("attached", "LOCAL", false);
    common::attached_post_moves_what_the_stream_produced(&gpu, &a, "attached", |_| {});
}

// ---- CUDA_IPC: one process ------------------------------------------------------------------

#[test]
fn cuda_ipc_loopback_and_bad_inputs() {
    let Some(gpu) = gpu_mem::gpu_for_test("cuda_ipc_loopback_and_bad_inputs") else {
        return;
    };
    let a = agent("ipc-self", "CUDA_IPC", false);
    let v1 = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    let v2 = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    v1.copy_from_host(0, &pattern(1, 1 << 20)).unwrap();
    let host = vec![0u8; 1 << 20];
    // SAFETY: all buffers outlive the handles and requests.
    let _hv = unsafe {
        a.register_mem(&vram([whole(&v1), whole(&v2)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _hd = unsafe {
        a.register_mem(&dram([Desc::from_slice(&host)]), None)
            .unwrap()
    };
    let mut w = a
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&v1)]),
            &vram([whole(&v2)]),
            "ipc-self",
            Some(b"x".to_vec()),
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&a, "ipc-self"), b"x");
    assert_eq!(v2.to_vec().unwrap(), pattern(1, 1 << 20));
    // Remote DRAM is out of CUDA IPC's reach: no backend can do it.
    let r = a.create_xfer_req(
        XferOp::Write,
        &vram([whole(&v1)]),
        &dram([Desc::from_slice(&host)]),
        "ipc-self",
        None,
    );
    assert!(matches!(r, Err(Error::NoCommonBackend { .. })), "{r:?}");
    // Out of the registered range.
    let r = a.create_xfer_req(
        XferOp::Write,
        &vram([whole(&v1)]),
        &vram([Desc::new(v2.ptr() + 1, 1 << 20, gpu.ordinal() as u64)]),
        "ipc-self",
        None,
    );
    assert!(matches!(r, Err(Error::RemoteOutOfBounds { .. })), "{r:?}");
    // Bad parameters are typed.
    let b = Agent::new("p", AgentConfig::default()).unwrap();
    assert!(matches!(
        b.create_backend("CUDA_IPC", &nixl::params([("num_streams", "0")])),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        b.create_backend("CUDA_IPC", &nixl::params([("bogus", "1")])),
        Err(Error::InvalidParam(_))
    ));
}

/// Two agents of one process reach each other's VRAM: CUDA will not open an IPC handle
/// in the process that exported it, so the backend uses the peer's addresses as they are.
#[test]
fn cuda_ipc_two_agents_in_one_process() {
    let Some(gpu) = gpu_mem::gpu_for_test("cuda_ipc_two_agents_in_one_process") else {
        return;
    };
    let a = agent("ipc-one-a", "CUDA_IPC", false);
    let b = agent("ipc-one-b", "CUDA_IPC", false);
    let src = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    let dst = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    src.copy_from_host(0, &pattern(7, 1 << 20)).unwrap();
    dst.fill(0).unwrap();
    // SAFETY: both buffers outlive the registrations and requests.
    let _ha = unsafe { a.register_mem(&vram([whole(&src)]), None).unwrap() };
    // SAFETY: as above.
    let _hb = unsafe { b.register_mem(&vram([whole(&dst)]), None).unwrap() };
    assert_eq!(
        a.load_remote_metadata(&b.local_metadata().unwrap())
            .unwrap(),
        "ipc-one-b"
    );
    // WRITE at an offset into b's buffer, then READ it back into the start of a's.
    let half = 1 << 19;
    let mut w = a
        .create_xfer_req(
            XferOp::Write,
            &vram([Desc::new(src.ptr(), half, gpu.ordinal() as u64)]),
            &vram([Desc::new(dst.ptr() + half, half, gpu.ordinal() as u64)]),
            "ipc-one-b",
            Some(b"one".to_vec()),
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&b, "ipc-one-a"), b"one");
    let got = dst.to_vec().unwrap();
    assert!(got[..half as usize].iter().all(|&x| x == 0));
    assert_eq!(&got[half as usize..], &pattern(7, 1 << 20)[..half as usize]);
    src.fill(0).unwrap();
    let mut r = a
        .create_xfer_req(
            XferOp::Read,
            &vram([Desc::new(src.ptr(), half, gpu.ordinal() as u64)]),
            &vram([Desc::new(dst.ptr() + half, half, gpu.ordinal() as u64)]),
            "ipc-one-b",
            None,
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(
        &src.to_vec().unwrap()[..half as usize],
        &pattern(7, 1 << 20)[..half as usize]
    );
}

#[test]
fn cuda_ipc_peer_on_another_node_is_unreachable() {
    let Some(gpu) = gpu_mem::gpu_for_test("cuda_ipc_peer_on_another_node_is_unreachable") else {
        return;
    };
    let a = agent("near", "CUDA_IPC", false);
    let b = agent("far", "CUDA_IPC", false);
    let va = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    let vb = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    // SAFETY: both outlive the handles.
    let _ha = unsafe { a.register_mem(&vram([whole(&va)]), None).unwrap() };
    // SAFETY: as above.
    let _hb = unsafe { b.register_mem(&vram([whole(&vb)]), None).unwrap() };
    // Pretend b booted elsewhere: change the boot id in its CUDA_IPC connection info.
    let mut md = AgentMetadata::decode(&b.local_metadata().unwrap()).unwrap();
    let info = md
        .sections
        .iter_mut()
        .find_map(|s| s.conn_info.as_mut())
        .unwrap();
    info[5] ^= 0xff;
    a.load_remote_metadata(&md.encode().unwrap()).unwrap();
    let local = a.prep_xfer_dlist(None, &vram([whole(&va)])).unwrap();
    let remote = a.prep_xfer_dlist(Some("far"), &vram([whole(&vb)])).unwrap();
    let r = a.make_xfer_req(
        XferOp::Write,
        &local,
        &[0],
        &remote,
        &[0],
        None,
        Some("CUDA_IPC"),
    );
    assert!(matches!(r, Err(Error::Unreachable { .. })), "{r:?}");
    let r = a.make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], None, None);
    assert!(matches!(r, Err(Error::NoCommonBackend { .. })), "{r:?}");
    // b's real metadata is another incarnation's connection information under the bound
    // name "far": refused while the loaded one lives.
    assert!(matches!(
        a.load_remote_metadata(&b.local_metadata().unwrap()),
        Err(Error::MetadataRefused { .. })
    ));
    // A corrupted region record (of the bound incarnation) is a typed error.
    for s in &mut md.sections {
        for (_, public) in &mut s.regions {
            public.truncate(10);
        }
    }
    assert!(matches!(
        a.load_remote_metadata(&md.encode().unwrap()),
        Err(Error::MalformedMetadata(_))
    ));
}

// ---- CUDA_IPC: two processes ----------------------------------------------------------------

const BUF: usize = 8 << 20;
/// The "framework" allocation: a region inside it at an offset, like a torch tensor in a
/// cached block.
const BIG: usize = 16 << 20;
const REGION_OFF: u64 = (1 << 20) + 256;
const REGION_LEN: u64 = 4 << 20;

/// The child process: a target (exporter), a sleeper (exporter that waits to be killed),
/// or a writer (importer that writes until killed).
#[test]
fn gpu_peer_process_main() {
    let Ok(role) = std::env::var("NIXL_GPU_ROLE") else {
        return;
    };
    // Never outlive a failed parent.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(120));
        std::process::exit(3);
    });
    let announce = std::env::var("NIXL_GPU_ANNOUNCE").unwrap();
    let gpu = Gpu::open(0).unwrap();
    match role.as_str() {
        "target" | "sleeper" => {
            let t = agent("ipc-target", "CUDA_IPC", true);
            let buf = DeviceBuffer::alloc(&gpu, BUF).unwrap();
            buf.copy_from_host(0, &pattern(42, BUF)).unwrap();
            let big = DeviceBuffer::alloc(&gpu, BIG).unwrap();
            big.fill(0).unwrap();
            let region = Desc::new(big.ptr() + REGION_OFF, REGION_LEN, gpu.ordinal() as u64);
            // VMM memory has no legacy IPC handle: CUDA_IPC hands its fd out instead.
            let vmm = DeviceBuffer::alloc_vmm(&gpu, BUF).unwrap();
            vmm.fill(0).unwrap();
            // SAFETY: the allocations live until the process exits.
            let _h = unsafe {
                t.register_mem(&vram([whole(&buf), region, whole(&vmm)]), None)
                    .unwrap()
            };
            let addr = t.listen_addr().unwrap();
            common::announce(
                &announce,
                &format!("{addr} {} {} {}", buf.ptr(), big.ptr(), vmm.ptr()),
            );
            if role == "sleeper" {
                std::thread::sleep(Duration::from_secs(110));
                return;
            }
            // Each notification names the round whose data must already be there.
            loop {
                let msg = String::from_utf8(wait_notif(&t, "ipc-initiator")).unwrap();
                let verdict = match msg.as_str() {
                    "bye" => break,
                    "round 1" => buf.to_vec().unwrap() == pattern(1, BUF),
                    "round 2" => buf.to_vec().unwrap() == pattern(2, BUF),
                    "round 5" => {
                        let all = big.to_vec().unwrap();
                        let r = REGION_OFF as usize..(REGION_OFF + REGION_LEN) as usize;
                        all[r.clone()] == pattern(5, REGION_LEN as usize)[..]
                            && all[..r.start].iter().all(|b| *b == 0)
                            && all[r.end..].iter().all(|b| *b == 0)
                    }
                    "round 6" => vmm.to_vec().unwrap() == pattern(6, BUF),
                    "standalone" => true,
                    other => panic!("unexpected notification {other}"),
                };
                std::fs::write(
                    format!("{announce}.{msg}"),
                    if verdict { "OK" } else { "BAD" },
                )
                .unwrap();
            }
        }
        "writer" => {
            let addr = std::env::var("NIXL_GPU_TARGET").unwrap().parse().unwrap();
            let w = agent("ipc-writer", "CUDA_IPC", false);
            let name = w.fetch_remote_metadata(addr).unwrap();
            let region = w.remote_regions(&name).unwrap()[0];
            let src = DeviceBuffer::alloc(&gpu, region.desc.len as usize).unwrap();
            src.copy_from_host(0, &pattern(77, region.desc.len as usize))
                .unwrap();
            // SAFETY: `src` lives until the process exits.
            let _h = unsafe { w.register_mem(&vram([whole(&src)]), None).unwrap() };
            let mut req = w
                .create_xfer_req(
                    XferOp::Write,
                    &vram([whole(&src)]),
                    &vram([region.desc]),
                    &name,
                    Some(b"written".to_vec()),
                )
                .unwrap();
            req.post().unwrap();
            req.wait(TIMEOUT).unwrap();
            std::fs::write(&announce, "WROTE").unwrap();
            // Keep writing until killed.
            loop {
                req.post().unwrap();
                req.wait(TIMEOUT).unwrap();
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn spawn(role: &str, tag: &str, target: Option<&str>) -> (Child, std::path::PathBuf) {
    let announce = announce_path("nixl-gpu", tag);
    let mut cmd = self_test("gpu_peer_process_main", false);
    cmd.arg("--nocapture")
        .env("NIXL_GPU_ROLE", role)
        .env("NIXL_GPU_ANNOUNCE", &announce);
    if let Some(t) = target {
        cmd.env("NIXL_GPU_TARGET", t);
    }
    (cmd.spawn().unwrap(), announce)
}

#[test]
fn cuda_ipc_two_processes_write_read_with_notifications() {
    let Some(gpu) = gpu_mem::gpu_for_test("cuda_ipc_two_processes_write_read_with_notifications")
    else {
        return;
    };
    let (mut child, announce) = spawn("target", "rw", None);
    let text = wait_file(&announce, &mut child);
    let mut it = text.split(' ');
    let addr = it.next().unwrap().parse().unwrap();
    let remote_buf: u64 = it.next().unwrap().parse().unwrap();
    let remote_big: u64 = it.next().unwrap().parse().unwrap();
    let remote_vmm: u64 = it.next().unwrap().parse().unwrap();
    let dev = gpu.ordinal() as u64;
    let remote = Desc::new(remote_buf, BUF as u64, dev);

    let i = agent("ipc-initiator", "CUDA_IPC", false);
    let name = i.fetch_remote_metadata(addr).unwrap();
    assert_eq!(name, "ipc-target");
    // The target hands a VMM allocation's descriptor (round 6) only to a process whose
    // metadata it loaded.
    i.send_local_metadata(addr).unwrap();
    let local_v = DeviceBuffer::alloc(&gpu, BUF).unwrap();
    let mut local_d = pattern(2, BUF);
    // SAFETY: the buffers outlive the handles and requests.
    let _hv = unsafe { i.register_mem(&vram([whole(&local_v)]), None).unwrap() };
    // SAFETY: as above.
    let _hd = unsafe {
        i.register_mem(&dram([Desc::from_slice(&local_d)]), None)
            .unwrap()
    };
    let check = |round: &str, child: &mut Child| {
        let verdict = wait_file(
            std::path::Path::new(&format!("{}.{round}", announce.display())),
            child,
        );
        assert_eq!(
            verdict, "OK",
            "{round}: the target saw wrong data when the notification arrived"
        );
    };

    // 1. VRAM -> VRAM WRITE, one descriptor.
    local_v.copy_from_host(0, &pattern(1, BUF)).unwrap();
    let mut w = i
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&local_v)]),
            &vram([remote]),
            &name,
            Some(b"round 1".to_vec()),
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    check("round 1", &mut child);
    // 2. DRAM -> VRAM WRITE, 64 descriptors.
    let chunk = (BUF / 64) as u64;
    let locals = (0..64).map(|k| Desc::new(local_d.as_ptr() as u64 + k * chunk, chunk, 0));
    let remotes = (0..64).map(|k| Desc::new(remote_buf + k * chunk, chunk, dev));
    let mut w = i
        .create_xfer_req(
            XferOp::Write,
            &dram(locals),
            &vram(remotes),
            &name,
            Some(b"round 2".to_vec()),
        )
        .unwrap();
    assert_eq!(w.op_count(), 64);
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    check("round 2", &mut child);
    // 3. VRAM <- VRAM READ.
    local_v.fill(0).unwrap();
    let mut r = i
        .create_xfer_req(
            XferOp::Read,
            &vram([whole(&local_v)]),
            &vram([remote]),
            &name,
            None,
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(local_v.to_vec().unwrap(), pattern(2, BUF), "READ into VRAM");
    // 4. DRAM <- VRAM READ.
    local_d.fill(0);
    let mut r = i
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::from_slice(&local_d)]),
            &vram([remote]),
            &name,
            None,
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(local_d, pattern(2, BUF), "READ into DRAM");
    // 5. A region at an offset inside a bigger allocation (framework memory).
    local_v
        .copy_from_host(0, &pattern(5, REGION_LEN as usize))
        .unwrap();
    let mut w = i
        .create_xfer_req(
            XferOp::Write,
            &vram([Desc::new(local_v.ptr(), REGION_LEN, dev)]),
            &vram([Desc::new(remote_big + REGION_OFF, REGION_LEN, dev)]),
            &name,
            Some(b"round 5".to_vec()),
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    check("round 5", &mut child);
    // Out of bounds of that region is refused before anything moves.
    let r = i.create_xfer_req(
        XferOp::Write,
        &vram([Desc::new(local_v.ptr(), 4096, dev)]),
        &vram([Desc::new(remote_big + REGION_OFF - 4096, 4096, dev)]),
        &name,
        None,
    );
    assert!(matches!(r, Err(Error::RemoteOutOfBounds { .. })), "{r:?}");
    // 6. The target's VMM buffer (imported through its fd), WRITE then READ back.
    local_v.copy_from_host(0, &pattern(6, BUF)).unwrap();
    let remote_v = vram([Desc::new(remote_vmm, BUF as u64, dev)]);
    let mut w = i
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&local_v)]),
            &remote_v,
            &name,
            Some(b"round 6".to_vec()),
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    check("round 6", &mut child);
    local_v.fill(0).unwrap();
    let mut r = i
        .create_xfer_req(
            XferOp::Read,
            &vram([whole(&local_v)]),
            &remote_v,
            &name,
            None,
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(local_v.to_vec().unwrap(), pattern(6, BUF), "READ from VMM");
    // 7. A standalone notification, then goodbye.
    i.gen_notif(&name, b"standalone").unwrap();
    check("standalone", &mut child);
    i.gen_notif(&name, b"bye").unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "target did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "target failed: {status:?}");
}

#[test]
fn cuda_ipc_killed_exporter_is_remote_disconnect_and_the_importer_goes_on() {
    let Some(gpu) = gpu_mem::gpu_for_test(
        "cuda_ipc_killed_exporter_is_remote_disconnect_and_the_importer_goes_on",
    ) else {
        return;
    };
    let (mut child, announce) = spawn("sleeper", "kill-exporter", None);
    let text = wait_file(&announce, &mut child);
    let mut it = text.split(' ');
    let addr = it.next().unwrap().parse().unwrap();
    let remote_buf: u64 = it.next().unwrap().parse().unwrap();
    let dev = gpu.ordinal() as u64;
    let i = agent("survivor", "CUDA_IPC", false);
    let name = i.fetch_remote_metadata(addr).unwrap();
    let local_v = DeviceBuffer::alloc(&gpu, BUF).unwrap();
    let other = DeviceBuffer::alloc(&gpu, BUF).unwrap();
    // SAFETY: the buffers outlive the handle and requests.
    let _h = unsafe {
        i.register_mem(&vram([whole(&local_v), whole(&other)]), None)
            .unwrap()
    };
    let mut r = i
        .create_xfer_req(
            XferOp::Read,
            &vram([whole(&local_v)]),
            &vram([Desc::new(remote_buf, BUF as u64, dev)]),
            &name,
            None,
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(local_v.to_vec().unwrap(), pattern(42, BUF));
    child.kill().unwrap();
    child.wait().unwrap();
    let started = Instant::now();
    let err = loop {
        match r.post().and_then(|_| r.wait(TIMEOUT)) {
            Err(e) => break e,
            Ok(()) => assert!(
                started.elapsed() < Duration::from_secs(5),
                "the dead peer was never noticed"
            ),
        }
    };
    assert!(matches!(err, Error::RemoteDisconnect { .. }), "{err:?}");
    println!("dead exporter noticed after {:?}: {err}", started.elapsed());
    drop(r);
    i.invalidate_remote(&name).unwrap();
    // The survivor goes on: its own memory, loopback through the same backend.
    local_v.copy_from_host(0, &pattern(8, BUF)).unwrap();
    let mut w = i
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&local_v)]),
            &vram([whole(&other)]),
            "survivor",
            None,
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    assert_eq!(other.to_vec().unwrap(), pattern(8, BUF));
}

#[test]
fn cuda_ipc_killed_importer_leaves_the_exporter_working() {
    let Some(gpu) = gpu_mem::gpu_for_test("cuda_ipc_killed_importer_leaves_the_exporter_working")
    else {
        return;
    };
    let t = agent("ipc-target", "CUDA_IPC", true);
    let addr = t.listen_addr().unwrap().to_string();
    let dev = gpu.ordinal() as u64;
    for round in 0..2 {
        // A fresh buffer each round: the first is freed after its importer was killed.
        let buf = DeviceBuffer::alloc(&gpu, BUF).unwrap();
        buf.fill(0).unwrap();
        // SAFETY: `buf` outlives the handle (dropped at the end of the round, first).
        let h = unsafe { t.register_mem(&vram([whole(&buf)]), None).unwrap() };
        let (mut child, announce) = spawn("writer", &format!("writer{round}"), Some(&addr));
        assert_eq!(wait_file(&announce, &mut child), "WROTE");
        assert_eq!(wait_notif(&t, "ipc-writer"), b"written");
        assert_eq!(buf.to_vec().unwrap(), pattern(77, BUF), "round {round}");
        child.kill().unwrap();
        child.wait().unwrap();
        // The exporter still moves its own memory and frees it.
        let spare = DeviceBuffer::alloc(&gpu, BUF).unwrap();
        // SAFETY: `spare` outlives the handle.
        let _hs = unsafe { t.register_mem(&vram([whole(&spare)]), None).unwrap() };
        let mut w = t
            .create_xfer_req(
                XferOp::Write,
                &vram([whole(&buf)]),
                &vram([Desc::new(spare.ptr(), BUF as u64, dev)]),
                "ipc-target",
                None,
            )
            .unwrap();
        w.post().unwrap();
        w.wait(TIMEOUT).unwrap();
        assert_eq!(spare.to_vec().unwrap(), pattern(77, BUF));
        drop(w);
        drop(h);
        let _ = t.get_notifs();
    }
}
