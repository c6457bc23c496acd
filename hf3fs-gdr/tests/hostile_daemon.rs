//! Stable-Rust mutation runs over what a client can send the daemon (the entry points
//! the cargo-fuzz targets in `hf3fs-gdr/fuzz` drive): request sequences, with and
//! without descriptors, and ring entries. Seeds are well-formed messages; mutations flip,
//! insert and cut bytes with a fixed pseudo-random sequence, so a failure reproduces.

use hf3fs_gdr::daemon::fuzz::{fuzz_daemon_requests, fuzz_ring_entries};

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(8) {
        match rng.below(4) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(v.len() + 1);
                v.insert(i, rng.next() as u8);
            }
            2 if !v.is_empty() => {
                let i = rng.below(v.len());
                v.truncate(i);
            }
            _ if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = [0, 0xff, 0x7f, 0x80, 1][rng.below(5)];
            }
            _ => v.push(rng.next() as u8),
        }
    }
    v
}

/// `[flags][len][msg]` framing of `fuzz_daemon_requests`.
fn frame(flags: u8, msg: &[u8]) -> Vec<u8> {
    let mut v = vec![flags, msg.len() as u8];
    v.extend_from_slice(msg);
    v
}

#[test]
fn hostile_request_sequences_keep_the_daemon_whole() {
    let id = [7u8; 16];
    // OP_ADD_IOR, the id, then a ring header of 4 entries (which goes into the memfd).
    let mut ring_header = vec![4u8];
    ring_header.extend_from_slice(&id);
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(b"HF3FSIOR");
    h[8..12].copy_from_slice(&1u32.to_le_bytes());
    h[12..16].copy_from_slice(&4u32.to_le_bytes());
    h[40..56].copy_from_slice(&id);
    ring_header.extend_from_slice(&h);
    let mut seeds: Vec<Vec<u8>> = vec![
        frame(0, &[1, 0, 0, 0, 0]),
        frame(1, &[2, 0, 0, 0, 0]),
        frame(0, &[3, 1, 0, 0, 0]),
        frame(3, &ring_header),
        frame(0, &[5].iter().chain(&id).copied().collect::<Vec<_>>()),
        frame(1, &[6].iter().chain(&id).copied().collect::<Vec<_>>()),
        frame(0, &[7].iter().chain(&id).copied().collect::<Vec<_>>()),
        frame(0, &[8]),
        frame(1, &[9].iter().chain(&id).copied().collect::<Vec<_>>()),
        frame(
            1,
            &[10]
                .iter()
                .chain(&id)
                .chain(&[1])
                .copied()
                .collect::<Vec<_>>(),
        ),
        frame(
            0,
            &[10]
                .iter()
                .chain(&id)
                .chain(&[2])
                .chain(&[0; 88])
                .copied()
                .collect::<Vec<_>>(),
        ),
    ];
    seeds.push(seeds.concat());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for seed in &seeds {
        assert!(fuzz_daemon_requests(seed), "seed {seed:?}");
    }
    for i in 0..3000 {
        let input = mutate(&mut rng, &seeds[i % seeds.len()]);
        assert!(fuzz_daemon_requests(&input), "input {input:?}");
    }
}

#[test]
fn hostile_ring_entries_each_complete_once() {
    let entry = |iov_off: u64, file_off: u64, len: u64, userdata: u64, file: u64| {
        [iov_off, file_off, len, userdata, file]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let mut seed = vec![1u8];
    seed.extend(entry(0, 0, 4096, 1, 1));
    seed.extend(entry(4096, 60 << 10, 8192, 3, 1));
    seed.extend(entry(0, 0, 64 << 10, 5, 1));
    seed.extend(entry(1, 0, u64::MAX, 7, 1));
    seed.extend(entry(0, u64::MAX - 10, 100, 9, 1));
    seed.extend(entry(0, 0, 4096, 2, 1));
    seed.extend(entry(0, 0, 4096, 1, 0));
    seed.extend(entry(65535, 0, 1, 11, 1));
    let mut write = seed.clone();
    write[0] = 0;
    assert!(fuzz_ring_entries(&seed));
    assert!(fuzz_ring_entries(&write));
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for i in 0..300 {
        let input = mutate(&mut rng, if i % 2 == 0 { &seed } else { &write });
        assert!(fuzz_ring_entries(&input), "input {input:?}");
    }
}
