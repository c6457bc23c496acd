//! Transfers across two GPUs of one node (feature `cuda`; the `GPUNETIO` cases with
//! feature `gpunetio`): two processes, the initiator on GPU 0 and the target on GPU 1,
//! WRITE and READ through `CUDA_IPC` (peer access, and forced onto its host-staged path)
//! and through `GPUNETIO`'s intra-node path, one descriptor, a batch of many in a
//! scrambled order and odd sizes at odd offsets, every byte verified on the side that
//! receives it; `LOCAL` VRAM from GPU 0 to GPU 1 in one process; `GPUNETIO` without
//! `gpu_devices` in a process working on GPU 1; and the pair's topology and copy path as
//! `gpu_mem` and `CUDA_IPC`'s `query_mem_info` report them.
//!
//! Needs two GPUs: with fewer every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) fewer than two GPUs fail instead.
#![cfg(feature = "cuda")]

mod common;

use common::{announce, announce_path, pattern, self_test, vram, wait_file, wait_notif};
use gpu_mem::{DeviceBuffer, Gpu};
use nixl::{Agent, AgentConfig, BackendParams, Desc, MemKind, XferOp};
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(60);
/// The target's buffer, and each transfer's size.
const LEN: usize = 16 << 20;
/// Descriptors of a batch (blocks of `LEN / BLOCKS` bytes).
const BLOCKS: u64 = 1024;

fn agent(name: &str, backend: &str, params: BackendParams, listen: bool) -> Agent {
    let config = AgentConfig {
        listen_addr: listen.then(|| "127.0.0.1:0".parse().unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    agent.create_backend(backend, &params).unwrap();
    agent
}

/// The backend's parameters here: `GPUNETIO` on its intra-node path only (the pair is
/// on one node; the NIC path would hide a failing intra-node path), and never
/// `gpu_devices` — each side binds the GPU of the VRAM it registers.
fn params(backend: &str) -> BackendParams {
    match backend {
        "GPUNETIO" => nixl::params([("nic_handler", "intra_node")]),
        _ => BackendParams::new(),
    }
}

/// Where batch block `k` of the initiator goes in the target's buffer: a permutation
/// (7 is prime to `BLOCKS`), so a block copied to its own index is caught.
fn scrambled(k: u64) -> u64 {
    (k * 7 + 3) % BLOCKS
}

/// The bytes of `data` (a whole buffer) with block `k` moved to block `scrambled(k)`.
fn scatter(data: &[u8]) -> Vec<u8> {
    let block = data.len() / BLOCKS as usize;
    let mut out = vec![0u8; data.len()];
    for k in 0..BLOCKS {
        let to = scrambled(k) as usize * block;
        let from = k as usize * block;
        out[to..to + block].copy_from_slice(&data[from..from + block]);
    }
    out
}

/// The target process (this binary run again on GPU 1): exports one buffer through
/// the backend named by `NIXL_MGPU_BACKEND` and answers notifications:
/// `check N` (the buffer holds `pattern(N)`), `scattered N` (it holds `pattern(N)`
/// scattered by [`scrambled`]), `fill N` (fill it with `pattern(N)`), `bye`. Each answer
/// is a file `ANNOUNCE.MSG` holding `OK` or what was wrong.
#[test]
fn gpu_multi_gpu_target_main() {
    let Ok(backend) = std::env::var("NIXL_MGPU_BACKEND") else {
        return;
    };
    // Never outlive a failed parent.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(240));
        std::process::exit(3);
    });
    let announce_at = std::env::var("NIXL_MGPU_ANNOUNCE").unwrap();
    let gpu = Gpu::open(1).unwrap();
    let t = agent("mgpu-target", &backend, params(&backend), true);
    let buf = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    buf.copy_from_host(0, &pattern(42, LEN)).unwrap();
    // SAFETY: the buffer lives until the process exits.
    let _h = unsafe {
        t.register_mem(
            &vram([Desc::new(buf.ptr(), LEN as u64, gpu.ordinal() as u64)]),
            None,
        )
        .unwrap()
    };
    announce(
        &announce_at,
        &format!("{} {}", t.listen_addr().unwrap(), buf.ptr()),
    );
    loop {
        let msg = String::from_utf8(wait_notif(&t, "mgpu-initiator")).unwrap();
        if let Some(seeds) = msg.strip_prefix("spliced ") {
            let (base, written) = seeds.split_once(' ').unwrap();
            let want = spliced(base.parse().unwrap(), written.parse().unwrap());
            announce(
                format!("{announce_at}.{msg}"),
                &compare(&buf.to_vec().unwrap(), &want),
            );
            continue;
        }
        let (what, seed) = match msg.split_once(' ') {
            Some((w, n)) => (w, n.parse::<u8>().unwrap()),
            None => (msg.as_str(), 0),
        };
        let verdict = match what {
            "bye" => break,
            "check" => compare(&buf.to_vec().unwrap(), &pattern(seed, LEN)),
            "scattered" => compare(&buf.to_vec().unwrap(), &scatter(&pattern(seed, LEN))),
            "fill" => {
                buf.copy_from_host(0, &pattern(seed, LEN)).unwrap();
                "OK".to_string()
            }
            other => format!("unexpected notification {other}"),
        };
        announce(format!("{announce_at}.{msg}"), &verdict);
    }
}

/// The odd-sized WRITE of the staged case: `ODD_LEN` bytes from offset `ODD_SRC` of the
/// initiator's buffer to offset `ODD_DST` of the target's.
const ODD_SRC: usize = 1;
const ODD_DST: usize = 3;
const ODD_LEN: usize = LEN - 5;

/// The target's buffer after it held `pattern(base)` and the odd-sized WRITE brought
/// `pattern(written)`'s bytes.
fn spliced(base: u8, written: u8) -> Vec<u8> {
    let mut out = pattern(base, LEN);
    out[ODD_DST..ODD_DST + ODD_LEN]
        .copy_from_slice(&pattern(written, LEN)[ODD_SRC..ODD_SRC + ODD_LEN]);
    out
}

/// `OK`, or where `got` first differs from `want`.
fn compare(got: &[u8], want: &[u8]) -> String {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None if got.len() == want.len() => "OK".into(),
        None => format!("{} bytes, expected {}", got.len(), want.len()),
        Some(at) => format!(
            "first wrong byte at {at} (block {}): {:#04x}, expected {:#04x}",
            at / (LEN / BLOCKS as usize),
            got[at],
            want[at]
        ),
    }
}

/// The target of `backend` on GPU 1: the process, its announce file, its metadata
/// address and its buffer's address.
/// The target of test `test`: its announce files are named after the test, since the
/// step files (`.check 1`, `.fill 2`, ...) of an earlier case of this process would
/// otherwise answer for this one's target before it acted.
fn spawn_target(
    test: &str,
    backend: &str,
) -> (Child, std::path::PathBuf, std::net::SocketAddr, u64) {
    let announce_at = announce_path("nixl-mgpu", &format!("{backend}-{test}"));
    let mut cmd = self_test("gpu_multi_gpu_target_main", false);
    cmd.arg("--nocapture")
        .env("NIXL_MGPU_BACKEND", backend)
        .env("NIXL_MGPU_ANNOUNCE", &announce_at);
    let mut child = cmd.spawn().unwrap();
    let text = wait_file(&announce_at, &mut child);
    let (addr, ptr) = text.split_once(' ').unwrap();
    (
        child,
        announce_at,
        addr.parse().unwrap(),
        ptr.parse().unwrap(),
    )
}

/// Sends `msg` to the target and waits for its verdict.
fn ask(i: &Agent, peer: &str, msg: &str, announce_at: &Path, child: &mut Child) {
    i.gen_notif(peer, msg.as_bytes()).unwrap();
    let verdict = wait_file(
        Path::new(&format!("{}.{msg}", announce_at.display())),
        child,
    );
    assert_eq!(verdict, "OK", "the target, on `{msg}`");
}

/// WRITE and READ between this process on GPU 0 and a target process on GPU 1 through
/// `backend`: one descriptor of `LEN` bytes, then `BLOCKS` descriptors in scrambled
/// order; the WRITEs verified by the target when their notification arrives, the READs
/// here.
fn two_processes(test: &str, backend: &str) {
    two_processes_with(test, backend, params(backend));
}

/// [`two_processes`] with the initiator's backend created with `initiator_params`.
fn two_processes_with(test: &str, backend: &str, initiator_params: BackendParams) {
    let Some(gpus) = gpu_mem::gpus_for_test(test, 2) else {
        return;
    };
    let gpu0 = &gpus[0];
    let (mut child, announce_at, addr, remote_ptr) = spawn_target(test, backend);
    let i = agent("mgpu-initiator", backend, initiator_params, false);
    let staged = backend == "CUDA_IPC"
        && i.query_mem_info(backend, MemKind::Vram, &[b"0:1".as_slice()])
            .unwrap()
            .remove(0)
            .is_some_and(|info| info["path"] == "host-staged");
    // Registered before the metadata exchange, as a serving engine registers its KV cache
    // first: GPUNETIO without gpu_devices binds the GPU of the first VRAM registered (an
    // exchange before any registration binds the thread's current device, here GPU 1,
    // the last one `gpus_for_test` opened).
    let local = DeviceBuffer::alloc(gpu0, LEN).unwrap();
    let dev0 = gpu0.ordinal() as u64;
    let whole_local = Desc::new(local.ptr(), LEN as u64, dev0);
    let whole_remote = Desc::new(remote_ptr, LEN as u64, 1);
    // SAFETY: the buffer outlives the handle and the requests.
    let _h = unsafe { i.register_mem(&vram([whole_local]), None).unwrap() };
    let peer = i.fetch_remote_metadata(addr).unwrap();
    assert_eq!(peer, "mgpu-target");
    i.send_local_metadata(addr).unwrap();
    let run = |op: XferOp, locals: Vec<Desc>, remotes: Vec<Desc>, notif: Option<&str>| {
        let n = locals.len();
        let bytes: u64 = locals.iter().map(|d| d.len).sum();
        let mut req = i
            .create_xfer_req(
                op,
                &vram(locals),
                &vram(remotes),
                &peer,
                notif.map(|m| m.as_bytes().to_vec()),
            )
            .unwrap();
        req.post().unwrap();
        req.wait(TIMEOUT)
            .unwrap_or_else(|e| panic!("{backend} {op:?} of {n} descriptors: {e}"));
        // A staged pair says so in the request's telemetry: every byte went through host
        // memory; a peer pair stages nothing.
        let expected_staged = if staged { bytes } else { 0 };
        assert_eq!(
            req.telemetry().staged_bytes,
            expected_staged,
            "{backend} {op:?} of {n} descriptors, staged: {staged}"
        );
    };
    let block = (LEN as u64) / BLOCKS;
    let blocks_local = || {
        (0..BLOCKS)
            .map(|k| Desc::new(local.ptr() + k * block, block, dev0))
            .collect::<Vec<_>>()
    };
    let blocks_remote = || {
        (0..BLOCKS)
            .map(|k| Desc::new(remote_ptr + scrambled(k) * block, block, 1))
            .collect::<Vec<_>>()
    };

    // 1. WRITE, one descriptor: the target checks when the notification comes.
    local.copy_from_host(0, &pattern(1, LEN)).unwrap();
    run(
        XferOp::Write,
        vec![whole_local],
        vec![whole_remote],
        Some("check 1"),
    );
    let verdict = wait_file(
        Path::new(&format!("{}.check 1", announce_at.display())),
        &mut child,
    );
    assert_eq!(verdict, "OK", "{backend} WRITE GPU 0 -> GPU 1");
    // 2. READ, one descriptor, of what the target filled.
    ask(&i, &peer, "fill 2", &announce_at, &mut child);
    local.fill(0).unwrap();
    run(XferOp::Read, vec![whole_local], vec![whole_remote], None);
    assert_eq!(
        compare(&local.to_vec().unwrap(), &pattern(2, LEN)),
        "OK",
        "{backend} READ GPU 1 -> GPU 0"
    );
    // 3. WRITE, BLOCKS descriptors, scattered over the target's buffer.
    local.copy_from_host(0, &pattern(3, LEN)).unwrap();
    run(
        XferOp::Write,
        blocks_local(),
        blocks_remote(),
        Some("scattered 3"),
    );
    let verdict = wait_file(
        Path::new(&format!("{}.scattered 3", announce_at.display())),
        &mut child,
    );
    assert_eq!(
        verdict, "OK",
        "{backend} batched WRITE GPU 0 -> GPU 1 ({BLOCKS} descriptors)"
    );
    // 4. READ, BLOCKS descriptors, gathered from the target's scattered blocks.
    ask(&i, &peer, "fill 4", &announce_at, &mut child);
    local.fill(0).unwrap();
    run(XferOp::Read, blocks_local(), blocks_remote(), None);
    let expected = {
        // Local block k holds the target's block scrambled(k).
        let all = pattern(4, LEN);
        let b = block as usize;
        let mut out = vec![0u8; LEN];
        for k in 0..BLOCKS as usize {
            let from = scrambled(k as u64) as usize * b;
            out[k * b..(k + 1) * b].copy_from_slice(&all[from..from + b]);
        }
        out
    };
    assert_eq!(
        compare(&local.to_vec().unwrap(), &expected),
        "OK",
        "{backend} batched READ GPU 1 -> GPU 0 ({BLOCKS} descriptors)"
    );
    // 5. Odd sizes at odd offsets, both directions (the staged path cuts them across
    // its slots).
    ask(&i, &peer, "fill 5", &announce_at, &mut child);
    local.copy_from_host(0, &pattern(6, LEN)).unwrap();
    run(
        XferOp::Write,
        vec![Desc::new(
            local.ptr() + ODD_SRC as u64,
            ODD_LEN as u64,
            dev0,
        )],
        vec![Desc::new(remote_ptr + ODD_DST as u64, ODD_LEN as u64, 1)],
        Some("spliced 5 6"),
    );
    let verdict = wait_file(
        Path::new(&format!("{}.spliced 5 6", announce_at.display())),
        &mut child,
    );
    assert_eq!(verdict, "OK", "{backend} odd-sized WRITE GPU 0 -> GPU 1");
    ask(&i, &peer, "fill 7", &announce_at, &mut child);
    local.fill(0).unwrap();
    // 37 descriptors of 12,345 bytes from odd offsets of the target to even ones here.
    let odd = 12_345u64;
    let odd_descs = |base: u64, first: u64, stride: u64, dev: u64| {
        (0..37)
            .map(|k| Desc::new(base + first + k * stride, odd, dev))
            .collect::<Vec<_>>()
    };
    run(
        XferOp::Read,
        odd_descs(local.ptr(), 2, 2 * odd + 4, dev0),
        odd_descs(remote_ptr, 7, 3 * odd + 1, 1),
        None,
    );
    let expected = {
        let all = pattern(7, LEN);
        let mut out = vec![0u8; LEN];
        for k in 0..37usize {
            let (to, from, n) = (
                2 + k * (2 * odd as usize + 4),
                7 + k * (3 * odd as usize + 1),
                odd as usize,
            );
            out[to..to + n].copy_from_slice(&all[from..from + n]);
        }
        out
    };
    assert_eq!(
        compare(&local.to_vec().unwrap(), &expected),
        "OK",
        "{backend} odd-sized READ GPU 1 -> GPU 0 (37 descriptors)"
    );
    // 6. Goodbye: the target exits cleanly.
    i.gen_notif(&peer, b"bye").unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the target did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "the target failed: {status:?}");
}

#[test]
fn cuda_ipc_write_and_read_between_processes_on_gpu0_and_gpu1() {
    two_processes(
        "cuda_ipc_write_and_read_between_processes_on_gpu0_and_gpu1",
        "CUDA_IPC",
    );
}

#[cfg(feature = "gpunetio")]
#[test]
fn gpunetio_write_and_read_between_processes_on_gpu0_and_gpu1() {
    two_processes(
        "gpunetio_write_and_read_between_processes_on_gpu0_and_gpu1",
        "GPUNETIO",
    );
}

/// `GPUNETIO` with host posts on its queue-pair kernel (`copy_engine=gio`, the warps'
/// copy the device API uses) rather than the copy strategies it takes by default.
#[cfg(feature = "gpunetio")]
#[test]
fn gpunetio_gio_kernel_write_and_read_between_processes_on_gpu0_and_gpu1() {
    two_processes_with(
        "gpunetio_gio_kernel_write_and_read_between_processes_on_gpu0_and_gpu1",
        "GPUNETIO",
        nixl::params([("nic_handler", "intra_node"), ("copy_engine", "gio")]),
    );
}

/// `CUDA_IPC` forced onto its host-staged path (`peer_access=off`): the same WRITEs and
/// READs, odd sizes included, every byte verified, every byte counted as staged in the
/// telemetry, and `query_mem_info` saying `host-staged` for the pair.
#[test]
fn cuda_ipc_host_staged_write_and_read_between_gpu0_and_gpu1() {
    let test = "cuda_ipc_host_staged_write_and_read_between_gpu0_and_gpu1";
    if gpu_mem::gpus_for_test(test, 2).is_none() {
        return;
    }
    let forced = nixl::params([("peer_access", "off")]);
    let probe = agent("mgpu-staged-probe", "CUDA_IPC", forced.clone(), false);
    for pair in [b"0:1", b"1:0"] {
        let info = probe
            .query_mem_info("CUDA_IPC", MemKind::Vram, &[pair.as_slice()])
            .unwrap()
            .remove(0)
            .expect("both GPUs are visible");
        assert_eq!(info["path"], "host-staged", "{info:?}");
    }
    drop(probe);
    two_processes_with(test, "CUDA_IPC", forced);
}

/// `LOCAL` in one process: VRAM of GPU 0 to VRAM of GPU 1 and back, one descriptor and
/// a scrambled batch.
#[test]
fn local_moves_vram_between_gpu0_and_gpu1() {
    let Some(gpus) = gpu_mem::gpus_for_test("local_moves_vram_between_gpu0_and_gpu1", 2) else {
        return;
    };
    let a = agent("mgpu-local", "LOCAL", BackendParams::new(), false);
    let v0 = DeviceBuffer::alloc(&gpus[0], LEN).unwrap();
    let v1 = DeviceBuffer::alloc(&gpus[1], LEN).unwrap();
    let d0 = Desc::new(v0.ptr(), LEN as u64, 0);
    let d1 = Desc::new(v1.ptr(), LEN as u64, 1);
    // SAFETY: the buffers outlive the handle and the requests.
    let _h = unsafe { a.register_mem(&vram([d0, d1]), None).unwrap() };
    let xfer = |op: XferOp, locals: Vec<Desc>, remotes: Vec<Desc>| {
        let mut req = a
            .create_xfer_req(op, &vram(locals), &vram(remotes), "mgpu-local", None)
            .unwrap();
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
    };
    v0.copy_from_host(0, &pattern(11, LEN)).unwrap();
    v1.fill(0).unwrap();
    xfer(XferOp::Write, vec![d0], vec![d1]);
    assert_eq!(
        compare(&v1.to_vec().unwrap(), &pattern(11, LEN)),
        "OK",
        "GPU 0 -> GPU 1"
    );
    v1.copy_from_host(0, &pattern(12, LEN)).unwrap();
    xfer(XferOp::Read, vec![d0], vec![d1]);
    assert_eq!(
        compare(&v0.to_vec().unwrap(), &pattern(12, LEN)),
        "OK",
        "GPU 1 -> GPU 0 (READ)"
    );
    let block = LEN as u64 / BLOCKS;
    v0.copy_from_host(0, &pattern(13, LEN)).unwrap();
    v1.fill(0).unwrap();
    xfer(
        XferOp::Write,
        (0..BLOCKS)
            .map(|k| Desc::new(v0.ptr() + k * block, block, 0))
            .collect(),
        (0..BLOCKS)
            .map(|k| Desc::new(v1.ptr() + scrambled(k) * block, block, 1))
            .collect(),
    );
    assert_eq!(
        compare(&v1.to_vec().unwrap(), &scatter(&pattern(13, LEN))),
        "OK",
        "GPU 0 -> GPU 1, {BLOCKS} scrambled descriptors"
    );
}

/// `GPUNETIO` without `gpu_devices` in a process working on GPU 1: registering VRAM of
/// GPU 1 binds GPU 1 (no "drives GPU 0" refusal), a transfer runs there (loopback,
/// within GPU 1, and from DRAM), and VRAM of GPU 0 is then refused with an error naming
/// the bound GPU.
#[cfg(feature = "gpunetio")]
#[test]
fn gpunetio_without_gpu_devices_drives_the_gpu_of_its_vram() {
    let Some(gpus) =
        gpu_mem::gpus_for_test("gpunetio_without_gpu_devices_drives_the_gpu_of_its_vram", 2)
    else {
        return;
    };
    let a = agent(
        "mgpu-gn1",
        "GPUNETIO",
        nixl::params([("nic_handler", "intra_node")]),
        false,
    );
    let src = DeviceBuffer::alloc(&gpus[1], LEN).unwrap();
    let dst = DeviceBuffer::alloc(&gpus[1], LEN).unwrap();
    let d_src = Desc::new(src.ptr(), LEN as u64, 1);
    let d_dst = Desc::new(dst.ptr(), LEN as u64, 1);
    // SAFETY: the buffers outlive the handle and the requests.
    let _h = unsafe { a.register_mem(&vram([d_src, d_dst]), None).unwrap() };
    src.copy_from_host(0, &pattern(21, LEN)).unwrap();
    dst.fill(0).unwrap();
    let mut req = a
        .create_xfer_req(
            XferOp::Write,
            &vram([d_src]),
            &vram([d_dst]),
            "mgpu-gn1",
            Some(b"done".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&a, "mgpu-gn1"), b"done");
    assert_eq!(
        compare(&dst.to_vec().unwrap(), &pattern(21, LEN)),
        "OK",
        "GPUNETIO on GPU 1"
    );
    // DRAM -> VRAM of GPU 1 (the DRAM is mapped for GPU 1's kernel).
    let host = pattern(22, LEN);
    // SAFETY: `host` outlives the handle and the request.
    let _hd = unsafe {
        a.register_mem(&common::dram([Desc::from_slice(&host)]), None)
            .unwrap()
    };
    let mut req = a
        .create_xfer_req(
            XferOp::Write,
            &common::dram([Desc::from_slice(&host)]),
            &vram([d_dst]),
            "mgpu-gn1",
            None,
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert_eq!(
        compare(&dst.to_vec().unwrap(), &host),
        "OK",
        "DRAM -> GPU 1"
    );
    // VRAM of GPU 0 is refused: the backend drives GPU 1.
    let other = DeviceBuffer::alloc(&gpus[0], 1 << 20).unwrap();
    // SAFETY: refused before anything is touched.
    let r = unsafe { a.register_mem(&vram([Desc::new(other.ptr(), 1 << 20, 0)]), None) };
    let e = r.expect_err("VRAM of GPU 0 in a backend bound to GPU 1");
    let text = e.to_string();
    assert!(
        text.contains("drives GPU 1") && text.contains("first VRAM"),
        "{text}"
    );
}

/// Prints the topology of every GPU pair and the path `CUDA_IPC` takes for it, and
/// checks they agree: a pair with peer access copies over the link, one without is
/// staged through host memory, a GPU with itself is `same-gpu`; `GPUNETIO` reports the
/// same path and its handler for the pair.
#[test]
fn gpu_pairs_topology_and_cuda_ipc_paths() {
    let Some(gpus) = gpu_mem::gpus_for_test("gpu_pairs_topology_and_cuda_ipc_paths", 2) else {
        return;
    };
    let a = agent("mgpu-topo", "CUDA_IPC", BackendParams::new(), false);
    #[cfg(feature = "gpunetio")]
    let gpunetio_topo = agent(
        "mgpu-topo-gn",
        "GPUNETIO",
        nixl::params([("nic_handler", "intra_node")]),
        false,
    );
    let all = Gpu::all().unwrap();
    assert!(all.len() >= gpus.len());
    for from in &all {
        for to in &all {
            let t = gpu_mem::peer_topology(from, to).unwrap();
            let pair = format!("{}:{}", from.ordinal(), to.ordinal());
            let info = a
                .query_mem_info("CUDA_IPC", MemKind::Vram, &[pair.as_bytes()])
                .unwrap()
                .remove(0)
                .expect("both GPUs are visible");
            println!("{} -> CUDA_IPC path {:?}", t.describe(), info);
            let expected = if from.ordinal() == to.ordinal() {
                "same-gpu"
            } else if t.can_access_peer {
                "peer"
            } else {
                "host-staged"
            };
            assert_eq!(info["path"], expected, "{pair}: {info:?}");
            assert_eq!(info["link"], t.link.as_str(), "{pair}: {info:?}");
            // GPUNETIO (intra-node only) maps a peer GPU's memory for its kernels where
            // the pair has peer access, and has no route where it has none.
            #[cfg(feature = "gpunetio")]
            {
                let g = gpunetio_topo
                    .query_mem_info("GPUNETIO", MemKind::Vram, &[pair.as_bytes()])
                    .unwrap()
                    .remove(0)
                    .expect("both GPUs are visible");
                let handler = if expected == "host-staged" {
                    "none"
                } else {
                    "intra_node"
                };
                assert_eq!(g["handler"], handler, "{pair}: {g:?}");
                assert_eq!(g["path"], expected, "{pair}: {g:?}");
            }
        }
    }
    // A GPU this process does not see is `None`; a malformed pair is a typed error.
    let n = all.len();
    let answers = a
        .query_mem_info("CUDA_IPC", MemKind::Vram, &[format!("0:{n}").as_bytes()])
        .unwrap();
    assert_eq!(answers, vec![None]);
    assert!(matches!(
        a.query_mem_info("CUDA_IPC", MemKind::Vram, &[b"zero"]),
        Err(nixl::Error::InvalidParam(_))
    ));
}
