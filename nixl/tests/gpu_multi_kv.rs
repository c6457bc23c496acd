//! A vLLM-shaped KV-cache pull between two GPUs of one node, through agents created
//! with NIXL's default backends (`Agent::create_default_backends`) — no backend named:
//! a prefill process holds a paged cache on GPU 0, a decode process (this test) READs
//! random blocks of it into random blocks of its own cache on GPU 1, many descriptors
//! per request (one per layer × K/V × block) picked by index from lists prepared once;
//! every request must go through `CUDA_IPC` (the agent's choice for VRAM to VRAM on one
//! node), every block is checked afterwards, and every request's notification reaches
//! the prefill.
//!
//! Needs 2 GPUs: with fewer it prints why it skips; with `NIXL_REQUIRE_GPU=1` (the GPU
//! machine) it fails.
#![cfg(all(feature = "cuda", feature = "libfabric"))]

mod common;
mod multi_gpu;

use common::{announce_agent, announce_path, listening, self_test, PeerProcess};
use gpu_mem::gpus_for_test;
use gpu_mem::{DeviceBuffer, Gpu};
use multi_gpu::{distinct_ids, unit_bytes, watchdog};
use nixl::{Agent, AgentConfig, Desc, DescList, MemKind, XferOp};
use std::time::{Duration, Instant};

const LAYERS: usize = 16;
const BLOCKS: usize = 512;
const BLOCK_BYTES: usize = 32 << 10;
/// Units (descriptors of a prepared list): layers × K/V × blocks.
const UNITS: usize = LAYERS * 2 * BLOCKS;
const CACHE_BYTES: usize = UNITS * BLOCK_BYTES;
/// 128 blocks: 16 × 2 × 128 = 4,096 descriptors (128 MiB) per request.
const BLOCKS_PER_REQUEST: usize = 128;
const REQUESTS: usize = 8;
/// Fill tags of the two caches.
const PREFILL_TAG: u64 = 0x51;
const DECODE_TAG: u64 = 0xDE;
const PREFILL_GPU: usize = 0;
const DECODE_GPU: usize = 1;
const ROLE_ENV: &str = "NIXL_KV_ROLE";
const ANNOUNCE_ENV: &str = "NIXL_KV_ANNOUNCE";
const TIMEOUT: Duration = Duration::from_secs(60);

/// Unit `(layer * 2 + kv) * BLOCKS + block` lies at `unit * BLOCK_BYTES` (block-major).
fn indices(blocks: &[usize]) -> Vec<usize> {
    (0..LAYERS * 2)
        .flat_map(|lk| blocks.iter().map(move |b| lk * BLOCKS + b))
        .collect()
}

/// A cache on `gpu` holding `tag`'s pattern in every unit.
fn cache(gpu: &Gpu, tag: u64) -> DeviceBuffer {
    let buf = DeviceBuffer::alloc(gpu, CACHE_BYTES).unwrap();
    let mut host = Vec::with_capacity(CACHE_BYTES);
    for unit in 0..UNITS as u64 {
        host.extend_from_slice(&unit_bytes(tag, unit, BLOCK_BYTES));
    }
    buf.copy_from_host(0, &host).unwrap();
    buf
}

/// An agent with NIXL's default backends: with a GPU, `LIBFABRIC` and `CUDA_IPC`.
fn default_agent(name: &str, config: AgentConfig) -> Agent {
    let agent = Agent::new(name, config).unwrap();
    let made = agent.create_default_backends().unwrap();
    let names: Vec<&str> = made.iter().map(|b| b.name()).collect();
    assert_eq!(
        names,
        ["LIBFABRIC", "CUDA_IPC"],
        "the default set with a GPU"
    );
    agent
}

/// The prefill process (run by the test below as a copy of this binary).
#[test]
fn kv_prefill_peer_main() {
    let Ok(announce) = std::env::var(ANNOUNCE_ENV) else {
        return;
    };
    assert_eq!(std::env::var(ROLE_ENV).as_deref(), Ok("prefill"));
    watchdog(Duration::from_secs(240));
    let gpu = Gpu::open(PREFILL_GPU).unwrap();
    let agent = default_agent("kv-prefill", listening());
    let cache = cache(&gpu, PREFILL_TAG);
    let whole = Desc::new(cache.ptr(), CACHE_BYTES as u64, PREFILL_GPU as u64);
    // SAFETY: the cache lives until the process exits.
    let _reg = unsafe {
        agent
            .register_mem(&DescList::from_descs(MemKind::Vram, [whole]), None)
            .unwrap()
    };
    announce_agent(&announce, &agent, cache.ptr());
    // Count the requests' notifications until `bye N` (N: how many the decode sent); a
    // notification of another backend may overtake `bye`, so wait a little for the rest.
    let mut seen = 0usize;
    let mut expected: Option<usize> = None;
    let deadline = Instant::now() + Duration::from_secs(200);
    while expected != Some(seen) && Instant::now() < deadline {
        for msg in agent
            .wait_notifs(Duration::from_millis(100))
            .remove("kv-decode")
            .unwrap_or_default()
        {
            let text = String::from_utf8(msg).unwrap();
            if let Some(n) = text.strip_prefix("bye ") {
                expected = Some(n.parse().unwrap());
            } else {
                assert!(text.starts_with("kv "), "unexpected notification {text}");
                seen += 1;
            }
        }
    }
    std::fs::write(
        format!("{announce}.ok"),
        format!("notifications {seen} of {expected:?}"),
    )
    .unwrap();
}

#[test]
fn gpu_multi_kv_pull_random_ids_gpu0_to_gpu1() {
    let test = "gpu_multi_kv_pull_random_ids_gpu0_to_gpu1";
    let Some(gpus) = gpus_for_test(test, 2) else {
        return;
    };
    let announce = announce_path("nixl-kv", "pull");
    let mut cmd = self_test("kv_prefill_peer_main", false);
    cmd.arg("--nocapture")
        .env(ROLE_ENV, "prefill")
        .env(ANNOUNCE_ENV, &announce);
    let mut prefill = PeerProcess::spawn(cmd, announce);

    let decode = default_agent("kv-decode", AgentConfig::default());
    let local_cache = cache(&gpus[DECODE_GPU], DECODE_TAG);
    let whole = Desc::new(local_cache.ptr(), CACHE_BYTES as u64, DECODE_GPU as u64);
    // SAFETY: the cache outlives the registration and every request (declared first).
    let _reg = unsafe {
        decode
            .register_mem(&DescList::from_descs(MemKind::Vram, [whole]), None)
            .unwrap()
    };
    let peer = decode.fetch_remote_metadata(prefill.addr).unwrap();
    assert_eq!(peer, "kv-prefill");
    decode.send_local_metadata(prefill.addr).unwrap();

    // One descriptor per layer × K/V × block on each side, prepared once.
    let descs = |base: u64, gpu: usize| {
        DescList::from_descs(
            MemKind::Vram,
            (0..UNITS).map(|u| {
                Desc::new(
                    base + (u * BLOCK_BYTES) as u64,
                    BLOCK_BYTES as u64,
                    gpu as u64,
                )
            }),
        )
    };
    let t = Instant::now();
    let local = decode
        .prep_xfer_dlist(None, &descs(local_cache.ptr(), DECODE_GPU))
        .unwrap();
    let remote = decode
        .prep_xfer_dlist(Some(&peer), &descs(prefill.base, PREFILL_GPU))
        .unwrap();
    let prep = t.elapsed();

    // Each request: random decode blocks <- random prefill blocks; what each decode
    // unit holds at the end is the prefill unit the last request read into it.
    let mut expected: Vec<Option<usize>> = vec![None; UNITS];
    let mut moved = Duration::ZERO;
    for i in 0..REQUESTS {
        let into = distinct_ids(0xDEC0 + i as u64, BLOCKS_PER_REQUEST, BLOCKS);
        let from = distinct_ids(0x9EF1 + i as u64, BLOCKS_PER_REQUEST, BLOCKS);
        let (li, ri) = (indices(&into), indices(&from));
        for (l, r) in li.iter().zip(&ri) {
            expected[*l] = Some(*r);
        }
        let t = Instant::now();
        let mut req = decode
            .make_xfer_req(
                XferOp::Read,
                &local,
                &li,
                &remote,
                &ri,
                Some(format!("kv {i}").into_bytes()),
                None,
            )
            .unwrap();
        assert_eq!(
            req.backend_name(),
            "CUDA_IPC",
            "the default agent moves VRAM to VRAM on one node through CUDA_IPC"
        );
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
        moved += t.elapsed();
    }
    decode
        .gen_notif(&peer, format!("bye {REQUESTS}").as_bytes())
        .unwrap();
    let bytes = (REQUESTS * LAYERS * 2 * BLOCKS_PER_REQUEST * BLOCK_BYTES) as f64;
    eprintln!(
        "{test}: {REQUESTS} requests of {} descriptors ({} KiB each), GPU {PREFILL_GPU} -> GPU \
         {DECODE_GPU}: {:.2} GB/s (make + post + wait), prep_xfer_dlist of 2 x {UNITS}: {:.1} ms",
        LAYERS * 2 * BLOCKS_PER_REQUEST,
        BLOCK_BYTES >> 10,
        bytes / moved.as_secs_f64() / 1e9,
        prep.as_secs_f64() * 1e3
    );

    // Every unit of the decode cache: the prefill unit read into it, or its own fill.
    let got = local_cache.to_vec().unwrap();
    for (unit, want) in expected.iter().enumerate() {
        let (tag, source) = match want {
            Some(r) => (PREFILL_TAG, *r as u64),
            None => (DECODE_TAG, unit as u64),
        };
        let at = unit * BLOCK_BYTES;
        assert!(
            got[at..at + BLOCK_BYTES] == unit_bytes(tag, source, BLOCK_BYTES)[..],
            "decode unit {unit} (layer {}, {}, block {}) is not {}",
            unit / BLOCKS / 2,
            if (unit / BLOCKS).is_multiple_of(2) {
                "K"
            } else {
                "V"
            },
            unit % BLOCKS,
            match want {
                Some(r) => format!("prefill unit {r}"),
                None => "its own fill".into(),
            }
        );
    }
    assert_eq!(
        prefill.verdict(),
        format!("notifications {REQUESTS} of Some({REQUESTS})")
    );
}
