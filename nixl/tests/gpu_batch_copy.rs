//! Many-descriptor GPU transfers in `LOCAL` and `CUDA_IPC` with every copy engine
//! (`copy_engine=auto|kernel|memcpy|batch`): thousands of random-sized descriptors at odd
//! alignments in random order, both ways, and a KV-cache-shaped pull of random block ids
//! from prepared lists, every byte verified; notifications only after the data. Prints
//! GB/s per engine (a printout, not an assertion: figures go to docs/BENCHMARKS.md).
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead. With two GPUs the `CUDA_IPC` test also
//! runs with its peer on GPU 1.
#![cfg(feature = "cuda")]

mod common;

use common::{announce_path, dram, self_test, vram, wait_file, wait_notif};
use gpu_mem::{DeviceBuffer, Gpu};
use nixl::{Agent, AgentConfig, Desc, XferDlist, XferOp};
use std::process::Child;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(60);
const ENGINES: [&str; 4] = ["auto", "kernel", "memcpy", "batch"];
/// Random descriptors per transfer, and the largest.
const RANDOM_DESCS: usize = 4096;
const RANDOM_MAX_LEN: u64 = 256 << 10;
/// The KV cache: layers × K/V × blocks of `KV_BLOCK` bytes; a pull moves `KV_PULL` blocks.
const KV_LAYERS: usize = 32;
const KV_BLOCKS: usize = 256;
const KV_BLOCK: u64 = 32 << 10;
const KV_PULL: usize = 8192;
/// Seeds of the peer's images.
const PEER_RANDOM_SEED: u64 = 7;
const PEER_KV_SEED: u64 = 9;
/// The random layout both processes derive.
const LAYOUT_SEED: u64 = 0x5eed;

// ---- data and layouts ------------------------------------------------------------------

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = splitmix(self.0);
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// Byte `i` of image `seed` (no short period: a block at the wrong offset is caught).
fn image(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (i, chunk) in v.chunks_mut(8).enumerate() {
        let w = splitmix(seed ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d)).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
    v
}

/// `RANDOM_DESCS` descriptors: lengths log-uniform in 1..=`RANDOM_MAX_LEN` (many tiny,
/// some large), at odd offsets in a source area, placed in a shuffled order at other odd
/// offsets of a destination area.
struct Layout {
    /// (source offset, destination offset, length) per descriptor.
    descs: Vec<(u64, u64, u64)>,
    src_len: usize,
    dst_len: usize,
}

fn random_layout(seed: u64) -> Layout {
    let mut rng = Rng(seed);
    let max_bits = RANDOM_MAX_LEN.trailing_zeros() as u64 + 1;
    let lens: Vec<u64> = (0..RANDOM_DESCS)
        .map(|_| {
            let bits = rng.below(max_bits);
            (1 + rng.below(1 << bits)).min(RANDOM_MAX_LEN)
        })
        .collect();
    let mut src = Vec::with_capacity(lens.len());
    let mut at = 0;
    for len in &lens {
        at += rng.below(17);
        src.push(at);
        at += len;
    }
    let src_len = at as usize + 64;
    let mut order: Vec<usize> = (0..lens.len()).collect();
    rng.shuffle(&mut order);
    let mut dst = vec![0; lens.len()];
    let mut at = 0;
    for &i in &order {
        at += rng.below(13);
        dst[i] = at;
        at += lens[i];
    }
    Layout {
        descs: (0..lens.len()).map(|i| (src[i], dst[i], lens[i])).collect(),
        src_len,
        dst_len: at as usize + 64,
    }
}

impl Layout {
    /// The destination area after the copy from `src` (gaps zero).
    fn expected(&self, src: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; self.dst_len];
        for &(s, d, n) in &self.descs {
            out[d as usize..(d + n) as usize].copy_from_slice(&src[s as usize..(s + n) as usize]);
        }
        out
    }
    fn src_descs(&self, base: u64, dev: u64) -> Vec<Desc> {
        self.descs
            .iter()
            .map(|&(s, _, n)| Desc::new(base + s, n, dev))
            .collect()
    }
    fn dst_descs(&self, base: u64, dev: u64) -> Vec<Desc> {
        self.descs
            .iter()
            .map(|&(_, d, n)| Desc::new(base + d, n, dev))
            .collect()
    }
    fn bytes(&self) -> u64 {
        self.descs.iter().map(|d| d.2).sum()
    }
}

fn kv_len() -> usize {
    KV_LAYERS * 2 * KV_BLOCKS * KV_BLOCK as usize
}

/// Every block of a KV cache at `base`, as the connector prepares it (layer, K/V, block).
fn kv_descs(base: u64, dev: u64) -> Vec<Desc> {
    (0..KV_LAYERS * 2 * KV_BLOCKS)
        .map(|b| Desc::new(base + b as u64 * KV_BLOCK, KV_BLOCK, dev))
        .collect()
}

/// A request's block ids: per layer and K/V, `KV_PULL / (layers × 2)` distinct random
/// blocks on each side, as list indices (source, destination).
fn kv_pull_indices(seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut rng = Rng(seed);
    let per = KV_PULL / (KV_LAYERS * 2);
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    for lk in 0..KV_LAYERS * 2 {
        let mut a: Vec<usize> = (0..KV_BLOCKS).collect();
        let mut b = a.clone();
        rng.shuffle(&mut a);
        rng.shuffle(&mut b);
        src.extend(a[..per].iter().map(|x| lk * KV_BLOCKS + x));
        dst.extend(b[..per].iter().map(|x| lk * KV_BLOCKS + x));
    }
    (src, dst)
}

/// Checks that each pulled block of `got` (the destination cache) is block `src` of image
/// `seed`.
fn check_kv(got: &[u8], seed: u64, src: &[usize], dst: &[usize], what: &str) {
    let whole = image(seed, kv_len());
    let b = KV_BLOCK as usize;
    for (&s, &d) in src.iter().zip(dst) {
        assert!(
            got[d * b..(d + 1) * b] == whole[s * b..(s + 1) * b],
            "{what}: block {s} -> {d} differs"
        );
    }
}

// ---- helpers ---------------------------------------------------------------------------

fn agent(name: &str, backend: &str, engine: &str, listen: bool) -> Agent {
    let config = AgentConfig {
        listen_addr: listen.then(|| "127.0.0.1:0".parse().unwrap()),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    let params = [("copy_engine".to_string(), engine.to_string())]
        .into_iter()
        .collect();
    agent
        .create_backend(backend, &params)
        .unwrap_or_else(|e| panic!("{backend} copy_engine={engine}: {e}"));
    agent
}

fn filled(gpu: &Gpu, bytes: &[u8]) -> DeviceBuffer {
    let buf = DeviceBuffer::alloc(gpu, bytes.len()).unwrap();
    buf.copy_from_host(0, bytes).unwrap();
    buf
}

fn zeroed(gpu: &Gpu, len: usize) -> DeviceBuffer {
    let buf = DeviceBuffer::alloc(gpu, len).unwrap();
    buf.fill(0).unwrap();
    buf
}

fn whole(buf: &DeviceBuffer) -> Desc {
    Desc::new(buf.ptr(), buf.len() as u64, buf.gpu().ordinal() as u64)
}

/// Posts `req` `times` times (reposts need no new preparation): the best GB/s.
fn best_gbps(req: &mut nixl::XferReq, bytes: u64, times: usize) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..times {
        let t = Instant::now();
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

// ---- LOCAL -----------------------------------------------------------------------------

#[test]
fn gpu_local_random_descriptors_every_engine_both_ways() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_local_random_descriptors_every_engine_both_ways")
    else {
        return;
    };
    let dev = gpu.ordinal() as u64;
    let layout = random_layout(LAYOUT_SEED);
    for (k, engine) in ENGINES.into_iter().enumerate() {
        let name = format!("batch-local-{engine}");
        let a = agent(&name, "LOCAL", engine, false);
        let src_image = image(100 + k as u64, layout.src_len);
        let expected = layout.expected(&src_image);
        let src = filled(&gpu, &src_image);
        let dst = zeroed(&gpu, layout.dst_len);
        let host_src = src_image.clone();
        let mut host_dst = vec![0u8; layout.dst_len];
        // SAFETY: every buffer outlives the handles and requests.
        let _hv = unsafe {
            a.register_mem(&vram([whole(&src), whole(&dst)]), None)
                .unwrap()
        };
        // SAFETY: as above.
        let _hd = unsafe {
            a.register_mem(
                &dram([Desc::from_slice(&host_src), Desc::from_slice(&host_dst)]),
                None,
            )
            .unwrap()
        };
        let what = |case: &str| format!("LOCAL copy_engine={engine}: {case}");
        // VRAM -> VRAM by WRITE, with a notification after the data.
        let mut w = a
            .create_xfer_req(
                XferOp::Write,
                &vram(layout.src_descs(src.ptr(), dev)),
                &vram(layout.dst_descs(dst.ptr(), dev)),
                &name,
                Some(b"written".to_vec()),
            )
            .unwrap();
        assert_eq!(w.op_count(), RANDOM_DESCS);
        w.post().unwrap();
        w.wait(TIMEOUT).unwrap();
        assert_eq!(wait_notif(&a, &name), b"written");
        assert!(
            dst.to_vec().unwrap() == expected,
            "{}",
            what("VRAM -> VRAM WRITE")
        );
        let gbps = best_gbps(&mut w, layout.bytes(), 3);
        // VRAM -> VRAM by READ (the destination is the local side).
        dst.fill(0).unwrap();
        let mut r = a
            .create_xfer_req(
                XferOp::Read,
                &vram(layout.dst_descs(dst.ptr(), dev)),
                &vram(layout.src_descs(src.ptr(), dev)),
                &name,
                None,
            )
            .unwrap();
        r.post().unwrap();
        r.wait(TIMEOUT).unwrap();
        assert!(
            dst.to_vec().unwrap() == expected,
            "{}",
            what("VRAM -> VRAM READ")
        );
        // DRAM -> VRAM by WRITE, VRAM -> DRAM by READ.
        dst.fill(0).unwrap();
        let mut w = a
            .create_xfer_req(
                XferOp::Write,
                &dram(layout.src_descs(host_src.as_ptr() as u64, 0)),
                &vram(layout.dst_descs(dst.ptr(), dev)),
                &name,
                None,
            )
            .unwrap();
        w.post().unwrap();
        w.wait(TIMEOUT).unwrap();
        assert!(
            dst.to_vec().unwrap() == expected,
            "{}",
            what("DRAM -> VRAM WRITE")
        );
        let mut r = a
            .create_xfer_req(
                XferOp::Read,
                &dram(layout.dst_descs(host_dst.as_ptr() as u64, 0)),
                &vram(layout.src_descs(src.ptr(), dev)),
                &name,
                None,
            )
            .unwrap();
        r.post().unwrap();
        r.wait(TIMEOUT).unwrap();
        assert!(host_dst == expected, "{}", what("VRAM -> DRAM READ"));
        host_dst.fill(0);
        println!(
            "LOCAL {RANDOM_DESCS} random descriptors ({} MiB), copy_engine={engine}: {gbps:.1} GB/s VRAM -> VRAM",
            layout.bytes() >> 20
        );
    }
}

#[test]
fn gpu_local_kv_pull_of_random_blocks_every_engine() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_local_kv_pull_of_random_blocks_every_engine") else {
        return;
    };
    let dev = gpu.ordinal() as u64;
    let prefill = filled(&gpu, &image(PEER_KV_SEED, kv_len()));
    for (k, engine) in ENGINES.into_iter().enumerate() {
        let name = format!("batch-kv-{engine}");
        let a = agent(&name, "LOCAL", engine, false);
        let decode = zeroed(&gpu, kv_len());
        // SAFETY: both caches outlive the handle and the requests.
        let _h = unsafe {
            a.register_mem(&vram([whole(&prefill), whole(&decode)]), None)
                .unwrap()
        };
        let local: XferDlist = a
            .prep_xfer_dlist(None, &vram(kv_descs(decode.ptr(), dev)))
            .unwrap();
        let remote: XferDlist = a
            .prep_xfer_dlist(Some(name.as_str()), &vram(kv_descs(prefill.ptr(), dev)))
            .unwrap();
        let (src, dst) = kv_pull_indices(1000 + k as u64);
        let mut req = a
            .make_xfer_req(XferOp::Read, &local, &dst, &remote, &src, None, None)
            .unwrap();
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
        check_kv(
            &decode.to_vec().unwrap(),
            PEER_KV_SEED,
            &src,
            &dst,
            &format!("LOCAL KV pull copy_engine={engine}"),
        );
        let gbps = best_gbps(&mut req, KV_PULL as u64 * KV_BLOCK, 5);
        println!(
            "LOCAL KV pull {KV_PULL} x {} KiB random blocks, copy_engine={engine}: {gbps:.1} GB/s",
            KV_BLOCK >> 10
        );
    }
}

// ---- CUDA_IPC between two processes ----------------------------------------------------

/// The peer process (`NIXL_BATCH_ROLE=target`): exports a random-descriptor source image,
/// a KV cache and a zeroed sink on GPU `NIXL_BATCH_GPU`, and answers each notification
/// `check <seed>` by comparing its sink, at that moment, with what a WRITE of the layout
/// from image `seed` leaves there.
#[test]
fn gpu_batch_peer_main() {
    let Ok(role) = std::env::var("NIXL_BATCH_ROLE") else {
        return;
    };
    assert_eq!(role, "target");
    // Never outlive a failed parent.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(300));
        std::process::exit(3);
    });
    let announce = std::env::var("NIXL_BATCH_ANNOUNCE").unwrap();
    let ordinal: usize = std::env::var("NIXL_BATCH_GPU").unwrap().parse().unwrap();
    let gpu = Gpu::open(ordinal).unwrap();
    let layout = random_layout(LAYOUT_SEED);
    let t = agent("batch-target", "CUDA_IPC", "auto", true);
    let random = filled(&gpu, &image(PEER_RANDOM_SEED, layout.src_len));
    let kv = filled(&gpu, &image(PEER_KV_SEED, kv_len()));
    let sink = zeroed(&gpu, layout.dst_len);
    // SAFETY: the buffers live until the process exits.
    let _h = unsafe {
        t.register_mem(&vram([whole(&random), whole(&kv), whole(&sink)]), None)
            .unwrap()
    };
    common::announce(
        &announce,
        &format!(
            "{} {} {} {}",
            t.listen_addr().unwrap(),
            random.ptr(),
            kv.ptr(),
            sink.ptr()
        ),
    );
    loop {
        let msg = String::from_utf8(wait_notif(&t, "batch-initiator")).unwrap();
        if msg == "bye" {
            break;
        }
        let seed: u64 = msg.strip_prefix("check ").unwrap().parse().unwrap();
        let ok = sink.to_vec().unwrap() == layout.expected(&image(seed, layout.src_len));
        std::fs::write(format!("{announce}.{msg}"), if ok { "OK" } else { "BAD" }).unwrap();
    }
}

fn spawn_target(gpu: usize) -> (Child, std::path::PathBuf) {
    let announce = announce_path("nixl-batch", &format!("gpu{gpu}"));
    let mut cmd = self_test("gpu_batch_peer_main", false);
    cmd.arg("--nocapture")
        .env("NIXL_BATCH_ROLE", "target")
        .env("NIXL_BATCH_ANNOUNCE", &announce)
        .env("NIXL_BATCH_GPU", gpu.to_string());
    (cmd.spawn().unwrap(), announce)
}

/// READ of random descriptors, WRITE of random descriptors (checked by the peer when the
/// notification arrives) and a KV pull, with every engine, the peer on GPU `peer_gpu`.
fn cuda_ipc_round(gpu: &Gpu, peer_gpu: usize) {
    let (mut child, announce) = spawn_target(peer_gpu);
    let text = wait_file(&announce, &mut child);
    let mut it = text.split(' ');
    let addr: std::net::SocketAddr = it.next().unwrap().parse().unwrap();
    let mut ptr = || -> u64 { it.next().unwrap().parse().unwrap() };
    let (remote_random, remote_kv, remote_sink) = (ptr(), ptr(), ptr());
    let dev = gpu.ordinal() as u64;
    let pdev = peer_gpu as u64;
    let layout = random_layout(LAYOUT_SEED);
    let expected_read = layout.expected(&image(PEER_RANDOM_SEED, layout.src_len));
    let decode = zeroed(gpu, kv_len());
    let dst = zeroed(gpu, layout.dst_len);
    let pair = format!("GPU {} <- GPU {peer_gpu}", gpu.ordinal());
    for (k, engine) in ENGINES.into_iter().enumerate() {
        // One agent name throughout: the peer waits for notifications from it.
        let i = agent("batch-initiator", "CUDA_IPC", engine, false);
        let name = i.fetch_remote_metadata(addr).unwrap();
        let seed = 200 + k as u64;
        let src = filled(gpu, &image(seed, layout.src_len));
        // SAFETY: the buffers outlive the handle and the requests.
        let _h = unsafe {
            i.register_mem(&vram([whole(&src), whole(&dst), whole(&decode)]), None)
                .unwrap()
        };
        let what = |case: &str| format!("CUDA_IPC {pair} copy_engine={engine}: {case}");
        // READ random descriptors from the peer.
        dst.fill(0).unwrap();
        let mut r = i
            .create_xfer_req(
                XferOp::Read,
                &vram(layout.dst_descs(dst.ptr(), dev)),
                &vram(layout.src_descs(remote_random, pdev)),
                &name,
                None,
            )
            .unwrap();
        r.post().unwrap();
        r.wait(TIMEOUT).unwrap();
        assert!(dst.to_vec().unwrap() == expected_read, "{}", what("READ"));
        let read_gbps = best_gbps(&mut r, layout.bytes(), 3);
        // WRITE random descriptors into the peer's sink; it checks them on notification.
        let msg = format!("check {seed}");
        let mut w = i
            .create_xfer_req(
                XferOp::Write,
                &vram(layout.src_descs(src.ptr(), dev)),
                &vram(layout.dst_descs(remote_sink, pdev)),
                &name,
                Some(msg.clone().into_bytes()),
            )
            .unwrap();
        w.post().unwrap();
        w.wait(TIMEOUT).unwrap();
        let verdict = wait_file(
            std::path::Path::new(&format!("{}.{msg}", announce.display())),
            &mut child,
        );
        assert_eq!(
            verdict,
            "OK",
            "{}",
            what("WRITE: the peer saw wrong data at the notification")
        );
        // The KV pull, from prepared lists.
        decode.fill(0).unwrap();
        let local = i
            .prep_xfer_dlist(None, &vram(kv_descs(decode.ptr(), dev)))
            .unwrap();
        let remote = i
            .prep_xfer_dlist(Some(name.as_str()), &vram(kv_descs(remote_kv, pdev)))
            .unwrap();
        let (s, d) = kv_pull_indices(3000 + k as u64);
        let mut req = i
            .make_xfer_req(XferOp::Read, &local, &d, &remote, &s, None, None)
            .unwrap();
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
        check_kv(
            &decode.to_vec().unwrap(),
            PEER_KV_SEED,
            &s,
            &d,
            &what("KV pull"),
        );
        let kv_gbps = best_gbps(&mut req, KV_PULL as u64 * KV_BLOCK, 5);
        println!(
            "CUDA_IPC {pair} copy_engine={engine}: {RANDOM_DESCS} random descriptors READ {read_gbps:.1} GB/s; KV pull {KV_PULL} x {} KiB {kv_gbps:.1} GB/s",
            KV_BLOCK >> 10
        );
    }
    let i = agent("batch-initiator", "CUDA_IPC", "auto", false);
    let name = i.fetch_remote_metadata(addr).unwrap();
    i.gen_notif(&name, b"bye").unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the peer did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "the peer failed: {status:?}");
}

#[test]
fn gpu_cuda_ipc_random_descriptors_and_kv_pull_every_engine() {
    let Some(gpu) =
        gpu_mem::gpu_for_test("gpu_cuda_ipc_random_descriptors_and_kv_pull_every_engine")
    else {
        return;
    };
    cuda_ipc_round(&gpu, gpu.ordinal());
    if gpu_mem::device_count() >= 2 {
        cuda_ipc_round(&gpu, 1);
    } else {
        println!("one GPU: the cross-GPU round is not run");
    }
}
