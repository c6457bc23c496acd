//! Hostile input on stable Rust: a deterministic mutation loop over the same entry
//! points as the `cargo fuzz` targets in `nixl/fuzz` (the metadata parser and the P2P
//! listener's request path), seeded with real blobs and frames. A panic fails the test;
//! what decodes must re-encode to the same value. `NIXL_HOSTILE_ITERS` scales the run.

use nixl::metadata::{AgentMetadata, BackendSection};
use nixl::{Agent, AgentConfig, Desc, DescList, MemKind, Region};

/// xorshift64*: reproducible, no dependency.
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

const INTERESTING: &[u8] = &[0, 1, 2, 0x7f, 0x80, 0xfe, 0xff];

/// One to four random edits: bit flips, interesting bytes, little-endian lengths written
/// over the input, insertions, deletions, truncation, duplication of a slice.
fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(b.len() + 1);
        match rng.below(8) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => {
                let values = [
                    0u32,
                    1,
                    0xff,
                    0xffff,
                    0x7fff_ffff,
                    u32::MAX,
                    rng.next() as u32,
                ];
                let v = values[rng.below(values.len())].to_le_bytes();
                let width = [1, 2, 4][rng.below(3)];
                for (k, byte) in v[..width].iter().enumerate() {
                    if let Some(slot) = b.get_mut(at + k) {
                        *slot = *byte;
                    }
                }
            }
            3 => b.insert(at.min(b.len()), rng.next() as u8),
            4 if !b.is_empty() => {
                b.remove(at.min(b.len() - 1));
            }
            5 => b.truncate(at),
            6 if !b.is_empty() => {
                let from = rng.below(b.len());
                let len = rng.below(b.len() - from).min(64);
                let chunk = b[from..from + len].to_vec();
                let at = at.min(b.len());
                b.splice(at..at, chunk);
            }
            _ => {
                let len = rng.below(16);
                b.extend((0..len).map(|_| rng.next() as u8));
            }
        }
    }
    b
}

fn iterations(default: usize) -> usize {
    std::env::var("NIXL_HOSTILE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn seed_blobs() -> Vec<Vec<u8>> {
    let agent = Agent::new("seed-agent", AgentConfig::default()).unwrap();
    agent.create_backend("LOCAL", &Default::default()).unwrap();
    let bufs: Vec<Vec<u8>> = (0..3).map(|i| vec![0u8; 4096 * (i + 1)]).collect();
    // SAFETY: the buffers outlive the handle (both dropped at the end of this function).
    let _h = unsafe {
        agent
            .register_mem(
                &DescList::from_descs(MemKind::Dram, bufs.iter().map(|b| Desc::from_slice(b))),
                None,
            )
            .unwrap()
    };
    let synthetic = AgentMetadata {
        agent: "prefill-7".into(),
        sections: vec![
            BackendSection {
                backend: "LIBFABRIC".into(),
                conn_info: Some(vec![2, 3, 0, 1, 2, 3, 3, 0, 4, 5, 6]),
                regions: vec![
                    (
                        Region {
                            kind: MemKind::Vram,
                            desc: Desc::new(0x7f00_0000_0000, 1 << 30, 3),
                        },
                        vec![1; 33],
                    ),
                    (
                        Region {
                            kind: MemKind::Dram,
                            desc: Desc::new(0x1000, 4096, 0),
                        },
                        vec![],
                    ),
                ],
            },
            BackendSection {
                backend: "VERBS".into(),
                conn_info: Some(vec![9; 40]),
                regions: vec![],
            },
        ],
    };
    vec![
        agent.local_metadata().unwrap(),
        agent.local_partial_metadata(None, true).unwrap(),
        synthetic.encode().unwrap(),
    ]
}

fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = b"NXP1".to_vec();
    f.push(kind);
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

/// Inputs `cargo fuzz` found, kept as regressions.
#[test]
fn fuzz_findings_stay_fixed() {
    // An empty backend name decoded but could not be re-encoded.
    let empty_backend = b"NIXLMD\x01\x00\x01\x00D\x01\x00\x00\x01\x01\x00\x00\x00I";
    assert!(matches!(
        AgentMetadata::decode(empty_backend),
        Err(nixl::Error::MalformedMetadata(m)) if m.contains("empty backend")
    ));
}

#[test]
fn metadata_decode_survives_mutations() {
    let seeds = seed_blobs();
    for seed in &seeds {
        let meta = AgentMetadata::decode(seed).unwrap();
        assert_eq!(
            AgentMetadata::decode(&meta.encode().unwrap()).unwrap(),
            meta
        );
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut ok, n) = (0usize, iterations(300_000));
    for _ in 0..n {
        let seed = &seeds[rng.below(seeds.len())];
        let input = mutate(&mut rng, seed);
        match AgentMetadata::decode(&input) {
            Ok(meta) => {
                ok += 1;
                let again = AgentMetadata::decode(&meta.encode().unwrap()).unwrap();
                assert_eq!(again, meta, "round trip of a mutated blob {input:?}");
            }
            Err(nixl::Error::MalformedMetadata(_)) => {}
            Err(e) => panic!("untyped error {e:?} for {input:?}"),
        }
    }
    eprintln!("{n} mutated blobs, {ok} decoded");
    assert!(
        ok > 0,
        "the mutations never produced a valid blob: the loop tests nothing"
    );
}

#[test]
fn listener_request_path_survives_mutations() {
    let agent = Agent::new("hostile-listener", AgentConfig::default()).unwrap();
    agent.create_backend("LOCAL", &Default::default()).unwrap();
    let blobs = seed_blobs();
    let mut seeds: Vec<Vec<u8>> = blobs.iter().map(|b| frame(1, b)).collect();
    seeds.push(frame(2, b""));
    seeds.push(frame(4, b"prefill-7"));
    seeds.push(frame(9, b"?"));
    // The unmutated requests do what they say.
    let reply = nixl::fuzz_serve(&agent, &seeds[2]);
    assert_eq!(&reply[..5], b"NXP1\x05", "metadata push acknowledged");
    assert!(agent.has_remote("prefill-7"));
    let reply = nixl::fuzz_serve(&agent, &frame(4, b"prefill-7"));
    assert_eq!(&reply[..5], b"NXP1\x05", "invalidation acknowledged");
    assert!(!agent.has_remote("prefill-7"));
    let reply = nixl::fuzz_serve(&agent, &frame(2, b""));
    assert_eq!(&reply[..5], b"NXP1\x03", "metadata served");
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    let mut replies = [0usize; 256];
    let n = iterations(100_000);
    for _ in 0..n {
        let seed = &seeds[rng.below(seeds.len())];
        let input = mutate(&mut rng, seed);
        let reply = nixl::fuzz_serve(&agent, &input);
        if reply.len() >= 5 {
            replies[reply[4] as usize] += 1;
        }
        agent.invalidate_all_remotes();
    }
    eprintln!(
        "{n} mutated requests: {} acks, {} metadata replies, {} refusals",
        replies[5], replies[3], replies[6]
    );
    assert!(replies[5] > 0 && replies[6] > 0, "both outcomes must occur");
}
