//! Hostile ring entries on stable Rust: the inputs of the `ring_entries` `cargo fuzz`
//! target (`gpunetio/fuzz`) as a deterministic mutation loop. Valid entries (in place and
//! image-encoded) are mutated; `gpunetio::proxy::fuzz_ring_entry` must never panic, and
//! every entry the proxy's validation accepts must stay inside the regions and counters
//! it names. `GPUNETIO_HOSTILE_ITERS` scales it.

use gpunetio_sys as ffi;

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

/// One to four edits: bit flips, boundary values written over a field, random bytes.
fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        if b.is_empty() {
            break;
        }
        let at = rng.below(b.len());
        match rng.below(4) {
            0 => b[at] ^= 1 << rng.below(8),
            1 => {
                let values = [0u64, 1, 7, 8, 4096, 8192, u64::MAX, 1 << 63, rng.next()];
                let v = values[rng.below(values.len())].to_le_bytes();
                let width = [1, 2, 4, 8][rng.below(4)];
                for (k, byte) in v[..width].iter().enumerate() {
                    if let Some(slot) = b.get_mut(at + k) {
                        *slot = *byte;
                    }
                }
            }
            2 => b[at] = rng.next() as u8,
            _ => b.truncate(at),
        }
    }
    b
}

/// `gio_ring_entry` as words, then the ticket, the ring size's log2 and the counters.
fn input(words: [u64; 8], ticket: u64, log2_ring: u8, counters: u8) -> Vec<u8> {
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.extend_from_slice(&(ticket << 1).to_le_bytes());
    out.extend_from_slice(&[log2_ring, counters]);
    out
}

/// An entry's words: seq, the opcode/flags/regions word, then the offsets and lengths.
#[allow(clippy::too_many_arguments)]
fn entry(
    seq: u64,
    opcode: u8,
    flags: u8,
    (local, remote, signal): (u16, u16, u16),
    local_off: u64,
    remote_off: u64,
    length: u64,
    (signal_off, signal_add, counter): (u64, u64, u32),
) -> [u64; 8] {
    // The layout after `seq` is opcode u8, flags u8, local_mr u16, remote_mr u16,
    // signal_mr u16 (one word), then five u64s and counter u32 + reserved u32.
    [
        seq,
        u64::from(opcode)
            | u64::from(flags) << 8
            | u64::from(local) << 16
            | u64::from(remote) << 32
            | u64::from(signal) << 48,
        local_off,
        remote_off,
        length,
        signal_off,
        signal_add,
        u64::from(counter),
    ]
}

#[test]
fn ring_entries_survive_mutations() {
    let put = entry(
        1,
        ffi::GIO_OP_PUT,
        ffi::GIO_FLAG_SIGNAL | ffi::GIO_FLAG_COUNTER,
        (0, 1, 1),
        0,
        64,
        128,
        (8, 1, 1),
    );
    let get = entry(6, ffi::GIO_OP_GET, 0, (0, 1, 0), 4000, 8000, 96, (0, 0, 0));
    let inline = entry(
        3,
        ffi::GIO_OP_PUT_INLINE,
        0,
        (0, 1, 0),
        0x1122_3344_5566_7788,
        8184,
        8,
        (0, 0, 0),
    );
    let signal = entry(2, ffi::GIO_OP_SIGNAL, 0, (0, 0, 1), 0, 0, 0, (8184, 3, 0));
    let mut image = put;
    ffi::entry_encode(&mut image, 37, 16);
    let seeds = [
        input(put, 0, 4, 2),
        input(get, 5, 4, 0),
        input(inline, 2, 10, 0),
        input(signal, 1, 0, 0),
        input(image, 37, 4, 2),
    ];
    for seed in &seeds {
        assert!(gpunetio::proxy::fuzz_ring_entry(seed), "seed {seed:02x?}");
    }
    let iterations = std::env::var("GPUNETIO_HOSTILE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let mut rng = Rng(0x243f_6a88_85a3_08d3);
    for i in 0..iterations {
        let input = mutate(&mut rng, &seeds[i % seeds.len()]);
        assert!(
            gpunetio::proxy::fuzz_ring_entry(&input),
            "the input {input:02x?} fails"
        );
    }
}
