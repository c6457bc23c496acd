//! What the multi-GPU tests `gpu_multi_kv` and `gpu_multi_alltoall` share: a data pattern
//! per (tag, unit), seeded block ids, files as barriers between peer processes, and
//! bounded waits. (The GPUs a test needs: `gpu_mem::gpus_for_test`.)
#![allow(dead_code)]

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

/// The bytes of unit `unit` (a KV block, an all-to-all slice) of `len` bytes filled
/// with `tag`: 8-byte words `tag << 56 | unit << 24 | word index`, so a block at the
/// wrong place, from the wrong sender or cut short differs.
pub fn unit_bytes(tag: u64, unit: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    for word in 0..len.div_ceil(8) as u64 {
        let w = (tag << 56) | (unit << 24) | (word & 0xFF_FFFF);
        out.extend_from_slice(&w.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// splitmix64: seeded block ids.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `count` distinct ids below `below`, seeded (a partial Fisher–Yates shuffle).
pub fn distinct_ids(seed: u64, count: usize, below: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..below).collect();
    let mut state = seed;
    for i in 0..count {
        state = splitmix64(state);
        let j = i + (state % (below - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(count);
    all
}

/// Waits until every file of `paths` exists (a barrier between peer processes); fails
/// after `limit`.
pub fn wait_all(paths: &[std::path::PathBuf], limit: Duration) {
    let deadline = Instant::now() + limit;
    while !paths.iter().all(|p| p.exists()) {
        assert!(
            Instant::now() < deadline,
            "barrier: {:?} missing after {limit:?}",
            paths.iter().filter(|p| !p.exists()).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Writes `text` to `path` whole (a reader never sees it partly written).
pub fn publish(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Waits for `child` to exit successfully within `limit` (killing it otherwise).
pub fn wait_child(child: &mut Child, what: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{what} exited with {status}");
            return;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Ends this (child) process after `limit` whatever it is doing: a peer never outlives
/// a failed parent.
pub fn watchdog(limit: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!("peer process: watchdog after {limit:?}");
        std::process::exit(3);
    });
}
