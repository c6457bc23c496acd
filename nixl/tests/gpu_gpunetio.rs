//! The `GPUNETIO` backend and the GPU device API (feature `gpunetio`): transfers posted as
//! kernels in both stream modes (VRAM->VRAM, DRAM->VRAM, VRAM->DRAM by READ), ordering
//! after the caller's stream, notifications after the data, the device API's request
//! and memory-view forms with bad uses answered by error statuses, and the
//! write-and-signal pattern against a peer process in THREAD, WARP and BLOCK levels.
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead.
#![cfg(feature = "gpunetio")]

mod common;

use common::write_signal::{self, function, module};
use common::{announce_path, dram, self_test, vram, wait_file, wait_notif, whole};
use gpunetio::cudarc::driver::{CudaModule, LaunchConfig, PushKernelArg};
use gpunetio::{DeviceBuffer, Gpu, HostBuffer};
use nixl::device::{self, status, RawGpuHandle};
use nixl::{Agent, AgentConfig, Desc, Error, PostParams, XferOp};
use std::sync::Arc;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(30);
const SLICE: u64 = 256 << 10;
const ROUNDS: u32 = 8;

fn agent(name: &str, listen: bool) -> Agent {
    let config = AgentConfig {
        listen_addr: listen.then(|| "127.0.0.1:0".parse().unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    agent
        .create_backend("GPUNETIO", &nixl::params([("cuda_streams", "2")]))
        .unwrap();
    agent
}

fn expected(len: u64, seed: u32) -> Vec<u8> {
    write_signal::expected(len, SLICE, seed)
}

fn cfg(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn fill(gpu: &Gpu, m: &Arc<CudaModule>, buf: &DeviceBuffer, rounds: u32, seed: u32) {
    let stream = gpu.context().default_stream();
    let f = function(m, "fill_pattern");
    let (ptr, slice) = (buf.ptr(), SLICE);
    let mut l = stream.launch_builder(&f);
    l.arg(&ptr).arg(&slice).arg(&rounds).arg(&seed);
    // SAFETY: fill_pattern(unsigned char*, u64, unsigned, unsigned) writes rounds*SLICE
    // bytes of `buf`, which holds at least that many.
    unsafe { l.launch(cfg(64, 256)) }.unwrap();
    stream.synchronize().unwrap();
}

// ---- the post path ----------------------------------------------------------------------------

#[test]
fn posts_move_vram_and_dram_in_both_stream_modes_with_notifications_after_the_data() {
    let Some(gpu) = gpunetio::gpu_for_test("posts_move_vram_and_dram_in_both_stream_modes") else {
        return;
    };
    let m = module(&gpu);
    let a = agent("gn-loop", false);
    let len = u64::from(ROUNDS) * SLICE;
    let src = DeviceBuffer::alloc(&gpu, len as usize).unwrap();
    let dst = DeviceBuffer::alloc(&gpu, len as usize).unwrap();
    let host = vec![0u8; len as usize];
    let host_desc = Desc::new(host.as_ptr() as u64, len, 0);
    // SAFETY: the buffers outlive the handle and every request.
    let _hv = unsafe {
        a.register_mem(&vram([whole(&src), whole(&dst)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _hd = unsafe { a.register_mem(&dram([host_desc]), None).unwrap() };
    let stream = gpu.new_stream().unwrap();
    for (round, attached) in [(1u32, false), (2, true), (3, false), (4, true)] {
        fill(&gpu, &m, &src, ROUNDS, round);
        dst.fill(0).unwrap();
        // VRAM -> VRAM, as 8 descriptors of one slice each.
        let pieces = |buf: &DeviceBuffer| {
            vram(
                (0..ROUNDS)
                    .map(|r| common::on(buf, (u64::from(r) * SLICE) as usize, SLICE as usize)),
            )
        };
        let mut w = a
            .create_xfer_req(XferOp::Write, &pieces(&src), &pieces(&dst), "gn-loop", None)
            .unwrap();
        let params = PostParams {
            custom: attached.then(|| Box::new(stream.clone()) as Box<dyn std::any::Any + Send>),
        };
        w.post_with(Some(format!("vv {round}").into_bytes()), &params)
            .unwrap();
        // Polling the request progresses it; its notification goes out once the kernel
        // finished, so the data is there when the notification is.
        w.wait(TIMEOUT).unwrap();
        let msg = wait_notif(&a, "gn-loop");
        assert_eq!(msg, format!("vv {round}").into_bytes());
        assert_eq!(
            dst.to_vec().unwrap(),
            expected(len, round),
            "VRAM->VRAM round {round}"
        );
        // VRAM -> DRAM: a READ of VRAM (the "remote" side, this agent's own) into DRAM.
        let mut r = a
            .create_xfer_req(
                XferOp::Read,
                &dram([host_desc]),
                &vram([whole(&dst)]),
                "gn-loop",
                None,
            )
            .unwrap();
        r.post_with(None, &params).unwrap();
        r.wait(TIMEOUT).unwrap();
        assert!(host == expected(len, round), "VRAM->DRAM round {round}");
        // DRAM -> VRAM.
        src.fill(0).unwrap();
        let mut d = a
            .create_xfer_req(
                XferOp::Write,
                &dram([host_desc]),
                &vram([whole(&src)]),
                "gn-loop",
                None,
            )
            .unwrap();
        d.post_with(None, &params).unwrap();
        d.wait(TIMEOUT).unwrap();
        assert_eq!(
            src.to_vec().unwrap(),
            expected(len, round),
            "DRAM->VRAM round {round}"
        );
    }
    let q = a.query_mem(&vram([whole(&src)]));
    assert!(q[0].is_some());
}

#[test]
fn an_attached_post_moves_what_the_stream_produced_before_it() {
    let Some(gpu) = gpunetio::gpu_for_test("an_attached_post_moves_what_the_stream_produced")
    else {
        return;
    };
    let a = agent("gn-attached", false);
    common::attached_post_moves_what_the_stream_produced(&gpu, &a, "gn-attached", |w| {
        let wrong = PostParams {
            custom: Some(Box::new(7u32)),
        };
        assert!(
            matches!(w.post_with(None, &wrong), Err(Error::InvalidParam(_))),
            "a custom parameter that is not a stream is refused, not ignored"
        );
    });
}

// ---- the device API in one process ------------------------------------------------------------

#[test]
fn device_api_statuses_for_good_and_bad_use() {
    let Some(gpu) = gpunetio::gpu_for_test("device_api_statuses_for_good_and_bad_use") else {
        return;
    };
    const DESC: u64 = 4096;
    let m = module(&gpu);
    let a = agent("gn-api", false);
    let src = common::device_buffer(&gpu, DESC as usize, &common::pattern(9, DESC as usize));
    let dst = common::device_buffer(&gpu, DESC as usize, &[]);
    let sig = common::device_buffer(&gpu, 256, &[]);
    let sig_src = common::device_buffer(&gpu, 256, &[]);
    // SAFETY: the buffers outlive the handle, the requests and the views.
    let _h = unsafe {
        a.register_mem(
            &vram([whole(&src), whole(&dst), whole(&sig), whole(&sig_src)]),
            None,
        )
        .unwrap()
    };
    let req = a
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&src), common::on(&sig_src, 0, 8)]),
            &vram([whole(&dst), common::on(&sig, 0, 8)]),
            "gn-api",
            None,
        )
        .unwrap();
    let handle = req.create_gpu_xfer_req().unwrap();
    let stale = req.create_gpu_xfer_req().unwrap();
    let stale_raw = stale.raw();
    a.release_gpu_xfer_req(stale);
    let local = a.prep_xfer_dlist(None, &vram([whole(&src)])).unwrap();
    let remote = a
        .prep_xfer_dlist(Some("gn-api"), &vram([whole(&dst), common::on(&sig, 8, 8)]))
        .unwrap();
    let lv = a.prep_mem_view(&local, None).unwrap();
    let rv = a.prep_mem_view(&remote, Some("GPUNETIO")).unwrap();
    let out = DeviceBuffer::alloc(&gpu, 14 * 8).unwrap();
    out.fill(0xee).unwrap();
    let f = function(&m, "device_api_probe");
    let stream = gpu.context().default_stream();
    let (h, s, l, r): (RawGpuHandle, RawGpuHandle, RawGpuHandle, RawGpuHandle) =
        (handle.raw(), stale_raw, lv.raw(), rv.raw());
    let (desc_len, out_ptr) = (DESC, out.ptr());
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(&h)
        .arg(&s)
        .arg(&l)
        .arg(&r)
        .arg(&desc_len)
        .arg(&out_ptr);
    // SAFETY: device_api_probe(nixlGpuXferReqH, nixlGpuXferReqH, nixlMemViewH,
    // nixlMemViewH, u64, long long*) with `out` holding 14 values.
    unsafe { launch.launch(cfg(1, 32)) }.unwrap();
    stream.synchronize().unwrap();
    let raw = out.to_vec().unwrap();
    let v: Vec<i64> = raw
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(v[0], i64::from(status::SUCCESS), "a good write");
    assert_eq!(
        v[1],
        i64::from(status::ERR_INVALID_PARAM),
        "offset past the descriptor"
    );
    assert_eq!(
        v[2],
        i64::from(status::ERR_INVALID_PARAM),
        "size past the descriptor"
    );
    assert_eq!(
        v[3],
        i64::from(status::ERR_INVALID_PARAM),
        "descriptor index out of range"
    );
    assert_eq!(
        v[4],
        i64::from(status::ERR_INVALID_PARAM),
        "a released request's handle"
    );
    assert_eq!(
        v[5],
        i64::from(status::ERR_INVALID_PARAM),
        "an unaligned signal"
    );
    assert_eq!(v[6], i64::from(status::SUCCESS), "nixlPut");
    assert_eq!(v[7], i64::from(status::SUCCESS), "nixlPut's status");
    assert_eq!(v[8], i64::from(status::SUCCESS), "nixlAtomicAdd");
    assert_eq!(v[9], i64::from(status::SUCCESS), "nixlAtomicAdd's status");
    assert_eq!(v[10] as u64, dst.ptr(), "nixlGetPtr of a mapped element");
    assert_eq!(v[11], 0, "nixlGetPtr of a bad index");
    assert_eq!(
        v[12],
        i64::from(status::ERR_INVALID_PARAM),
        "a view element past its end"
    );
    assert_eq!(
        v[13],
        i64::from(status::ERR_INVALID_PARAM),
        "source and destination swapped"
    );
    let got = dst.to_vec().unwrap();
    let want = common::pattern(9, DESC as usize);
    assert_eq!(got[..64], want[..64], "the request's 64-byte write");
    assert_eq!(got[64..192], want[64..192], "the view's 128-byte put");
    assert!(
        got[192..].iter().all(|b| *b == 0),
        "nothing written past the put"
    );
    let mut word = [0u8; 8];
    sig.copy_to_host(8, &mut word).unwrap();
    assert_eq!(u64::from_le_bytes(word), 5, "the atomic add");
    // Host-side refusals: a request of a backend without a device API, a signal word that
    // is not device memory.
    let plain = Agent::new("gn-plain", AgentConfig::default()).unwrap();
    plain.create_backend("LOCAL", &Default::default()).unwrap();
    let buf = [0u8; 64];
    let d = Desc::from_slice(&buf);
    // SAFETY: `buf` outlives the registration and the request.
    let _p = unsafe { plain.register_mem(&dram([d]), None).unwrap() };
    let lr = plain
        .create_xfer_req(XferOp::Write, &dram([d]), &dram([d]), "gn-plain", None)
        .unwrap();
    assert!(matches!(
        lr.create_gpu_xfer_req(),
        Err(Error::NotSupported { .. })
    ));
    assert!(device::prep_gpu_signal(&gpu, buf.as_ptr() as u64).is_err());
    device::prep_gpu_signal(&gpu, sig.ptr() + 8).unwrap();
    sig.copy_to_host(8, &mut word).unwrap();
    assert_eq!(
        u64::from_le_bytes(word),
        0,
        "prep_gpu_signal zeroes the word"
    );
}

// ---- write and signal against a peer process ------------------------------------------------

#[test]
fn gpunetio_peer_process_main() {
    let Ok(announce) = std::env::var("NIXL_GN_ANNOUNCE") else {
        return;
    };
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(170));
        std::process::exit(3);
    });
    let gpu = Gpu::open(0).unwrap();
    let m = module(&gpu);
    let t = agent("gn-target", true);
    let len = u64::from(ROUNDS) * SLICE;
    let data = common::device_buffer(&gpu, len as usize, &[]);
    let sig = common::device_buffer(&gpu, 256, &[]);
    // SAFETY: both live until the process exits.
    let _h = unsafe {
        t.register_mem(&vram([whole(&data), whole(&sig)]), None)
            .unwrap()
    };
    common::announce(
        &announce,
        &format!("{} {} {}", t.listen_addr().unwrap(), data.ptr(), sig.ptr()),
    );
    let check = function(&m, "wait_and_check");
    let bad = DeviceBuffer::alloc(&gpu, 16).unwrap();
    let stream = gpu.new_stream().unwrap();
    loop {
        let msg = String::from_utf8(wait_notif(&t, "gn-init")).unwrap();
        let words: Vec<&str> = msg.split(' ').collect();
        match words.as_slice() {
            ["bye"] => break,
            // The data of a posted WRITE must be there when its notification is.
            ["posted", seed] => {
                let ok = data.to_vec().unwrap() == expected(len, seed.parse().unwrap());
                common::announce(format!("{announce}.{msg}"), if ok { "OK" } else { "BAD" });
            }
            // Arm the checking kernel, then say so; it reports once every round came.
            ["arm", variant, seed] => {
                let seed: u32 = seed.parse().unwrap();
                device::prep_gpu_signal(&gpu, sig.ptr()).unwrap();
                bad.fill(0).unwrap();
                let (s, d, slice, rounds, timeout, b) = (
                    sig.ptr(),
                    data.ptr(),
                    SLICE,
                    ROUNDS,
                    20_000_000_000u64,
                    bad.ptr(),
                );
                let mut l = stream.launch_builder(&check);
                l.arg(&s)
                    .arg(&d)
                    .arg(&slice)
                    .arg(&rounds)
                    .arg(&seed)
                    .arg(&timeout)
                    .arg(&b);
                // SAFETY: wait_and_check(const u64*, const u8*, u64, unsigned, unsigned,
                // u64, u64*) over live buffers of the sizes given.
                unsafe { l.launch(cfg(1, 256)) }.unwrap();
                common::announce(format!("{announce}.armed-{variant}"), "armed");
                stream.synchronize().unwrap();
                let v = bad.to_vec().unwrap();
                let wrong = u64::from_le_bytes(v[..8].try_into().unwrap());
                let seen = u64::from_le_bytes(v[8..].try_into().unwrap());
                let verdict = if wrong == 0 && seen == u64::from(ROUNDS) {
                    "OK".to_string()
                } else {
                    format!("BAD: {wrong} wrong bytes, {seen} of {ROUNDS} rounds seen")
                };
                common::announce(format!("{announce}.{variant}"), &verdict);
            }
            other => panic!("unexpected notification {other:?}"),
        }
    }
}

#[test]
fn write_and_signal_against_a_peer_process_in_thread_warp_and_block_levels() {
    let Some(gpu) = gpunetio::gpu_for_test("write_and_signal_against_a_peer_process") else {
        return;
    };
    let m = module(&gpu);
    let announce = announce_path("nixl-gn", "peer");
    let mut child = self_test("gpunetio_peer_process_main", false)
        .arg("--nocapture")
        .env("NIXL_GN_ANNOUNCE", &announce)
        .spawn()
        .unwrap();
    let text = wait_file(&announce, &mut child);
    let parts: Vec<&str> = text.split(' ').collect();
    let addr = parts[0].parse().unwrap();
    let data_ptr: u64 = parts[1].parse().unwrap();
    let sig_ptr: u64 = parts[2].parse().unwrap();
    let i = agent("gn-init", false);
    let name = i.fetch_remote_metadata(addr).unwrap();
    assert_eq!(name, "gn-target");
    let len = u64::from(ROUNDS) * SLICE;
    let src = DeviceBuffer::alloc(&gpu, len as usize).unwrap();
    let one = common::device_buffer(&gpu, 256, &[]);
    // SAFETY: both outlive the handle, the requests and the GPU handles.
    let _h = unsafe {
        i.register_mem(&vram([whole(&src), whole(&one)]), None)
            .unwrap()
    };
    let remote_data = Desc::new(data_ptr, len, 0);
    let remote_sig = Desc::new(sig_ptr, 8, 0);
    let wait_verdict = |path: String, child: &mut std::process::Child| {
        let v = wait_file(std::path::Path::new(&path), child);
        assert_eq!(v, "OK", "{path}");
    };

    // A posted WRITE, verified by the target at its notification.
    fill(&gpu, &m, &src, ROUNDS, 11);
    let mut w = i
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&src)]),
            &vram([remote_data]),
            &name,
            None,
        )
        .unwrap();
    w.post_with(Some(b"posted 11".to_vec()), &PostParams::default())
        .unwrap();
    w.wait(TIMEOUT).unwrap();
    wait_verdict(format!("{}.posted 11", announce.display()), &mut child);

    // Kernels writing round by round and signalling, the target checking each round.
    let req = i
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&src), common::on(&one, 0, 8)]),
            &vram([remote_data, remote_sig]),
            &name,
            None,
        )
        .unwrap();
    let handle = req.create_gpu_xfer_req().unwrap();
    let mut status_word = HostBuffer::alloc(&gpu, 8).unwrap();
    let status_ptr = status_word.device_ptr().unwrap();
    for (seed, variant, threads) in [
        (21u32, "write_signal_thread", 256u32),
        (22, "write_signal_warp", 256),
        (23, "write_signal_block", 512),
    ] {
        fill(&gpu, &m, &src, ROUNDS, seed);
        i.gen_notif(&name, format!("arm {variant} {seed}").as_bytes())
            .unwrap();
        wait_file(
            std::path::Path::new(&format!("{}.armed-{variant}", announce.display())),
            &mut child,
        );
        status_word.as_mut_slice().fill(0);
        let f = function(&m, variant);
        let stream = gpu.context().default_stream();
        let (h, slice, rounds) = (handle.raw(), SLICE, ROUNDS);
        let mut l = stream.launch_builder(&f);
        l.arg(&h).arg(&slice).arg(&rounds).arg(&status_ptr);
        // SAFETY: write_signal_*(nixlGpuXferReqH, u64, unsigned, int*); the request's
        // regions and the status word outlive the launch (synchronized below).
        unsafe { l.launch(cfg(1, threads)) }.unwrap();
        stream.synchronize().unwrap();
        let st = i32::from_le_bytes(status_word.as_slice()[..4].try_into().unwrap());
        assert_eq!(
            st,
            status::SUCCESS,
            "{variant}: the kernel's device-API status"
        );
        wait_verdict(format!("{}.{variant}", announce.display()), &mut child);
    }

    // READ back what the last kernel wrote.
    let back = common::device_buffer(&gpu, len as usize, &[]);
    // SAFETY: `back` outlives the registration and the request.
    let _hb = unsafe { i.register_mem(&vram([whole(&back)]), None).unwrap() };
    let mut r = i
        .create_xfer_req(
            XferOp::Read,
            &vram([whole(&back)]),
            &vram([remote_data]),
            &name,
            None,
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(
        back.to_vec().unwrap(),
        expected(len, 23),
        "READ from the peer"
    );

    i.gen_notif(&name, b"bye").unwrap();
    assert!(child.wait().unwrap().success(), "the target failed");
}
