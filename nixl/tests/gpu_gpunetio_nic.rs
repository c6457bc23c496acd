//! `GPUNETIO`'s NIC path (feature `gpunetio`) against a peer process whose memory is DRAM,
//! the memory the intra-node path cannot reach: posted WRITEs from VRAM and DRAM and a
//! READ into VRAM through the per-peer CPU proxy, notifications after the data over the
//! OOB channel, the device API's request form (THREAD, WARP, BLOCK write-and-signal) and
//! memory-view form (`nixlPut` + `nixlAtomicAdd`) from kernels, `nic_handler=auto`
//! choosing the NIC path for a peer's DRAM, and the peer's death as a typed error
//! within a bound. Each provider that runs here: `tcp;ofi_rxm` (the default, as between
//! nodes) and `shm`.
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead.
#![cfg(feature = "gpunetio")]

mod common;

use common::write_signal::{self, function, module, pattern_byte};
use common::{announce_path, dram, self_test, vram, wait_file, whole};
use gpunetio::cudarc::driver::{CudaModule, LaunchConfig, PushKernelArg};
use gpunetio::{DeviceBuffer, Gpu, HostBuffer};
use nixl::device::status;
use nixl::{Agent, AgentConfig, Desc, PostParams, XferOp};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(30);
const SLICE: u64 = 64 << 10;
const ROUNDS: u32 = 8;
const LEN: u64 = SLICE * ROUNDS as u64;

fn agent(name: &str, listen: bool, handler: &str, provider: &str) -> Agent {
    let config = AgentConfig {
        listen_addr: listen.then(|| "127.0.0.1:0".parse().unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    agent
        .create_backend(
            "GPUNETIO",
            &nixl::params([
                ("cuda_streams", "2"),
                ("nic_handler", handler),
                ("provider", provider),
            ]),
        )
        .unwrap();
    agent
}

fn expected(len: u64, seed: u32) -> Vec<u8> {
    write_signal::expected(len, SLICE, seed)
}

fn cfg(threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn fill(gpu: &Gpu, m: &Arc<CudaModule>, buf: &DeviceBuffer, seed: u32) {
    let stream = gpu.context().default_stream();
    let f = function(m, "fill_pattern");
    let (ptr, slice, rounds) = (buf.ptr(), SLICE, ROUNDS);
    let mut l = stream.launch_builder(&f);
    l.arg(&ptr).arg(&slice).arg(&rounds).arg(&seed);
    // SAFETY: fill_pattern(unsigned char*, u64, unsigned, unsigned) writes ROUNDS*SLICE
    // bytes of `buf`, which holds that many.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (64, 1, 1),
            ..cfg(256)
        })
    }
    .unwrap();
    stream.synchronize().unwrap();
}

// ---- the target process ------------------------------------------------------------------

/// The peer: DRAM data and signal words, checked at each notification.
#[test]
fn gpunetio_nic_peer_main() {
    let (Ok(announce), Ok(provider)) = (
        std::env::var("NIXL_GNN_ANNOUNCE"),
        std::env::var("NIXL_GNN_PROVIDER"),
    ) else {
        return;
    };
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(240));
        std::process::exit(3);
    });
    let t = agent("gnn-target", true, "auto", &provider);
    let data = vec![0u8; LEN as usize];
    let words: Vec<AtomicU64> = (0..8).map(|_| AtomicU64::new(0)).collect();
    let data_desc = Desc::new(data.as_ptr() as u64, LEN, 0);
    let sig_desc = Desc::new(words.as_ptr() as u64, 64, 0);
    // SAFETY: both live until the process exits.
    let _h = unsafe { t.register_mem(&dram([data_desc, sig_desc]), None).unwrap() };
    common::announce(
        &announce,
        &format!(
            "{} {} {}",
            t.listen_addr().unwrap(),
            data_desc.addr,
            sig_desc.addr
        ),
    );
    // The peer's writes land in `data` behind the compiler's back: read it volatile, after
    // the notification or signal that says they arrived.
    let read_data = |at: usize, n: usize| -> Vec<u8> {
        (0..n)
            .map(|k| {
                // SAFETY: `at + k` is inside `data` (callers stay within LEN bytes).
                unsafe { std::ptr::read_volatile(data.as_ptr().add(at + k)) }
            })
            .collect()
    };
    loop {
        let msgs = t.get_notifs();
        for (sender, list) in msgs {
            for msg in list {
                let msg = String::from_utf8(msg).unwrap();
                let w: Vec<&str> = msg.split(' ').collect();
                match w.as_slice() {
                    ["bye"] => return,
                    ["posted", seed] => {
                        let ok = read_data(0, LEN as usize) == expected(LEN, seed.parse().unwrap());
                        common::announce(
                            format!("{announce}.{msg}"),
                            if ok { "OK" } else { "BAD" },
                        );
                    }
                    // Every round's slice must be there once the signal counts it.
                    ["arm", variant, seed, word] => {
                        let (seed, word): (u32, usize) =
                            (seed.parse().unwrap(), word.parse().unwrap());
                        words[word].store(0, Ordering::Release);
                        common::announce(format!("{announce}.armed-{variant}"), "armed");
                        let mut verdict = "OK".to_string();
                        for r in 0..u64::from(ROUNDS) {
                            let deadline = Instant::now() + TIMEOUT;
                            while words[word].load(Ordering::Acquire) < r + 1 {
                                if Instant::now() > deadline {
                                    verdict = format!("BAD: round {r} never signalled");
                                    break;
                                }
                                std::hint::spin_loop();
                            }
                            let want: Vec<u8> =
                                (0..SLICE).map(|i| pattern_byte(r, i, seed)).collect();
                            if verdict == "OK"
                                && read_data((r * SLICE) as usize, SLICE as usize) != want
                            {
                                verdict = format!("BAD: round {r} signalled before its data");
                            }
                        }
                        common::announce(format!("{announce}.{variant}"), &verdict);
                    }
                    other => panic!("unexpected notification {other:?} from {sender}"),
                }
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

// ---- the initiator ------------------------------------------------------------------------

fn against_a_dram_peer(provider: &str) {
    let Some(gpu) = gpunetio::gpu_for_test("the GPUNETIO NIC path") else {
        return;
    };
    let m = module(&gpu);
    let tag = provider.replace(';', "_");
    let announce = announce_path("nixl-gnn", &tag);
    let child = self_test("gpunetio_nic_peer_main", false)
        .arg("--nocapture")
        .env("NIXL_GNN_ANNOUNCE", &announce)
        .env("NIXL_GNN_PROVIDER", provider)
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let child = &mut child.0;
    let t0 = Instant::now();
    let step = |what: &str| eprintln!("{provider}: {:>8.3} s  {what}", t0.elapsed().as_secs_f64());
    let text = wait_file(&announce, child);
    let parts: Vec<&str> = text.split(' ').collect();
    let addr = parts[0].parse().unwrap();
    let remote_data = Desc::new(parts[1].parse().unwrap(), LEN, 0);
    let sig_base: u64 = parts[2].parse().unwrap();
    let remote_sig = |word: u64| Desc::new(sig_base + 8 * word, 8, 0);
    let verdict = |what: String, child: &mut std::process::Child| {
        let v = wait_file(Path::new(&format!("{}.{what}", announce.display())), child);
        assert_eq!(v, "OK", "{provider}: {what}");
    };

    let i = agent("gnn-init", false, "cpu_proxy", provider);
    assert_eq!(i.fetch_remote_metadata(addr).unwrap(), "gnn-target");
    let src = DeviceBuffer::alloc(&gpu, LEN as usize).unwrap();
    let one = common::device_buffer(&gpu, 256, &[]);
    let back = common::device_buffer(&gpu, LEN as usize, &[]);
    let host = expected(LEN, 12);
    let host_desc = Desc::new(host.as_ptr() as u64, LEN, 0);
    // SAFETY: the buffers outlive the handles, the requests and the GPU handles.
    let _hv = unsafe {
        i.register_mem(&vram([whole(&src), whole(&one), whole(&back)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _hd = unsafe { i.register_mem(&dram([host_desc]), None).unwrap() };
    let mode = i.query_mem(&vram([whole(&src)]));
    eprintln!("{provider}: local VRAM is {:?}", mode[0]);

    // Posted WRITEs from VRAM and from DRAM, checked by the target at the notification.
    fill(&gpu, &m, &src, 11);
    let mut w = posted_write(&i, &vram([whole(&src)]), remote_data, 11);
    verdict("posted 11".into(), child);
    step("posted WRITE from VRAM");
    posted_write(&i, &dram([host_desc]), remote_data, 12);
    verdict("posted 12".into(), child);
    step("posted WRITE from DRAM");

    // READ the peer's DRAM into VRAM, as 8 descriptors at offsets inside the regions.
    let mut r = i
        .create_xfer_req(
            XferOp::Read,
            &vram(
                (0..ROUNDS)
                    .map(|k| common::on(&back, (u64::from(k) * SLICE) as usize, SLICE as usize)),
            ),
            &dram(
                (0..u64::from(ROUNDS)).map(|k| Desc::new(remote_data.addr + k * SLICE, SLICE, 0)),
            ),
            "gnn-target",
            None,
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(back.to_vec().unwrap(), host, "{provider}: READ into VRAM");
    step("READ into VRAM");

    // The request form from kernels: write round by round, signal word 0.
    let req = i
        .create_xfer_req(
            XferOp::Write,
            &vram([whole(&src), common::on(&one, 0, 8)]),
            &dram([remote_data, remote_sig(0)]),
            "gnn-target",
            None,
        )
        .unwrap();
    let handle = req.create_gpu_xfer_req().unwrap();
    let mut status_word = HostBuffer::alloc(&gpu, 8).unwrap();
    let status_ptr = status_word.device_ptr().unwrap();
    let stream = gpu.context().default_stream();
    for (seed, variant, threads) in [
        (21u32, "write_signal_thread", 64u32),
        (22, "write_signal_warp", 256),
        (23, "write_signal_block", 512),
    ] {
        fill(&gpu, &m, &src, seed);
        i.gen_notif("gnn-target", format!("arm {variant} {seed} 0").as_bytes())
            .unwrap();
        wait_file(
            Path::new(&format!("{}.armed-{variant}", announce.display())),
            child,
        );
        status_word.as_mut_slice().fill(0);
        let f = function(&m, variant);
        let (h, slice, rounds) = (handle.raw(), SLICE, ROUNDS);
        let mut l = stream.launch_builder(&f);
        l.arg(&h).arg(&slice).arg(&rounds).arg(&status_ptr);
        // SAFETY: write_signal_*(nixlGpuXferReqH, u64, unsigned, int*); the request's
        // regions and the status word outlive the launch (synchronized below).
        unsafe { l.launch(cfg(threads)) }.unwrap();
        stream.synchronize().unwrap();
        let st = i32::from_le_bytes(status_word.as_slice()[..4].try_into().unwrap());
        assert_eq!(
            st,
            status::SUCCESS,
            "{provider} {variant}: device-API status"
        );
        verdict(variant.to_string(), child);
        step(variant);
    }

    // The memory-view form: nixlPut from a local view, nixlAtomicAdd on signal word 1.
    let local = i.prep_xfer_dlist(None, &vram([whole(&src)])).unwrap();
    let remote = i
        .prep_xfer_dlist(Some("gnn-target"), &dram([remote_data, remote_sig(1)]))
        .unwrap();
    let lv = i.prep_mem_view(&local, None).unwrap();
    let rv = i.prep_mem_view(&remote, Some("GPUNETIO")).unwrap();
    fill(&gpu, &m, &src, 31);
    i.gen_notif("gnn-target", b"arm view_put_signal 31 1")
        .unwrap();
    wait_file(
        Path::new(&format!("{}.armed-view_put_signal", announce.display())),
        child,
    );
    status_word.as_mut_slice().fill(0);
    let f = function(&m, "view_put_signal");
    let (l_raw, r_raw, slice, rounds, timeout) =
        (lv.raw(), rv.raw(), SLICE, ROUNDS, 20_000_000_000u64);
    let mut l = stream.launch_builder(&f);
    l.arg(&l_raw)
        .arg(&r_raw)
        .arg(&slice)
        .arg(&rounds)
        .arg(&timeout)
        .arg(&status_ptr);
    // SAFETY: view_put_signal(nixlMemViewH, nixlMemViewH, u64, unsigned, u64, int*); the
    // views' regions and the status word outlive the launch (synchronized below).
    unsafe { l.launch(cfg(256)) }.unwrap();
    stream.synchronize().unwrap();
    let st = i32::from_le_bytes(status_word.as_slice()[..4].try_into().unwrap());
    assert_eq!(st, status::SUCCESS, "{provider} view_put_signal: status");
    verdict("view_put_signal".into(), child);
    step("view_put_signal");

    // nic_handler=auto: the peer's DRAM is reachable only through the NIC path.
    let a = agent("gnn-auto", false, "auto", provider);
    assert_eq!(a.fetch_remote_metadata(addr).unwrap(), "gnn-target");
    // SAFETY: `src` outlives the handle and the request.
    let _ha = unsafe { a.register_mem(&vram([whole(&src)]), None).unwrap() };
    fill(&gpu, &m, &src, 13);
    posted_write(&a, &vram([whole(&src)]), remote_data, 13);
    verdict("posted 13".into(), child);
    step("nic_handler=auto to the peer's DRAM");

    // The peer goes away: the next transfer is a typed error within the bound, not a
    // hang and not a success.
    i.gen_notif("gnn-target", b"bye").unwrap();
    assert!(child.wait().unwrap().success(), "the target failed");
    let started = Instant::now();
    let outcome = w
        .post_with(Some(b"posted 99".to_vec()), &PostParams::default())
        .and_then(|_| w.wait(TIMEOUT));
    let took = started.elapsed();
    eprintln!("{provider}: a transfer to the vanished peer: {outcome:?} after {took:?}");
    assert!(
        outcome.is_err(),
        "{provider}: a transfer to a dead peer succeeded"
    );
    assert!(took < TIMEOUT, "{provider}: the failure took {took:?}");
}

/// A WRITE of `local` to the peer's `remote` with the notification `posted SEED`, posted
/// and waited for (the peer checks its data at the notification).
fn posted_write(agent: &Agent, local: &nixl::DescList, remote: Desc, seed: u32) -> nixl::XferReq {
    let mut w = agent
        .create_xfer_req(XferOp::Write, local, &dram([remote]), "gnn-target", None)
        .unwrap();
    w.post_with(
        Some(format!("posted {seed}").into_bytes()),
        &PostParams::default(),
    )
    .unwrap();
    w.wait(TIMEOUT).unwrap();
    w
}

/// The peer process, killed if the test fails before it said goodbye.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn nic_path_against_a_dram_peer_over_tcp_rxm() {
    against_a_dram_peer("tcp;ofi_rxm");
}

#[test]
fn nic_path_against_a_dram_peer_over_shm() {
    against_a_dram_peer("shm");
}

/// Bad parameters are refused at creation; `intra_node` has no NIC path to offer.
#[test]
fn nic_parameters() {
    let Some(_gpu) = gpunetio::gpu_for_test("GPUNETIO NIC parameters") else {
        return;
    };
    let a = Agent::new("gnn-params", AgentConfig::default()).unwrap();
    for bad in [
        nixl::params([("nic_handler", "mlx5_native")]),
        nixl::params([
            ("provider", "no-such-provider"),
            ("nic_handler", "cpu_proxy"),
        ]),
        nixl::params([("oob_interface", "no-such-if0")]),
    ] {
        assert!(a.create_backend("GPUNETIO", &bad).is_err(), "{bad:?}");
    }
    a.create_backend("GPUNETIO", &nixl::params([("nic_handler", "intra_node")]))
        .unwrap();
}
