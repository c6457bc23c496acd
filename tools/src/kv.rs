//! The paged KV cache `kvbench` moves, as vLLM's NIXL connector sees it: its layout in
//! memory, which blocks each request moves, the bytes every block holds and what each
//! block must hold once the requests have run.
//!
//! A cache has `layers` layers, each with a K and a V half of `blocks` blocks of
//! `block_bytes` bytes. One *unit* is one (layer, K/V, block): the connector's
//! descriptor, numbered `(layer * 2 + kv) * blocks + block` in the prepared descriptor
//! lists whatever the layout. The layout only says where a unit lies ([`Layout`]).

/// Where the units of a KV cache lie in its one allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Layer by layer, K then V, each a contiguous run of its blocks (vLLM's default:
    /// one `[2, blocks, ...]` tensor per layer, here all layers in one allocation).
    BlockMajor,
    /// Block by block: a block's units of every layer and both halves lie together, so
    /// consecutive blocks of one layer's K (or V) are `layers * 2 * block_bytes` apart.
    Strided,
}

/// The shape of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Layers.
    pub layers: usize,
    /// Blocks per layer (per K and per V).
    pub blocks: usize,
    /// Bytes of one block of one layer's K (or V).
    pub block_bytes: usize,
    /// Where the units lie.
    pub layout: Layout,
}

impl KvShape {
    /// Units (descriptors of a prepared list): layers × 2 × blocks.
    pub fn units(&self) -> usize {
        self.layers * 2 * self.blocks
    }

    /// Bytes of the whole cache; `None` where that overflows.
    pub fn bytes(&self) -> Option<usize> {
        self.layers
            .checked_mul(2)?
            .checked_mul(self.blocks)?
            .checked_mul(self.block_bytes)
    }

    /// The unit of (`layer`, `kv` (0 K, 1 V), `block`): its descriptor index.
    pub fn unit(&self, layer: usize, kv: usize, block: usize) -> usize {
        (layer * 2 + kv) * self.blocks + block
    }

    /// Byte offset of `unit` in the cache.
    pub fn offset(&self, unit: usize) -> usize {
        self.slot_of(unit) * self.block_bytes
    }

    /// The position of `unit` in address order (its offset over `block_bytes`).
    fn slot_of(&self, unit: usize) -> usize {
        match self.layout {
            Layout::BlockMajor => unit,
            Layout::Strided => {
                let (layer_kv, block) = (unit / self.blocks, unit % self.blocks);
                block * self.layers * 2 + layer_kv
            }
        }
    }

    /// The unit at position `slot` in address order (the inverse of [`Self::offset`]).
    pub fn unit_at_slot(&self, slot: usize) -> usize {
        match self.layout {
            Layout::BlockMajor => slot,
            Layout::Strided => {
                let per_block = self.layers * 2;
                let (block, layer_kv) = (slot / per_block, slot % per_block);
                layer_kv * self.blocks + block
            }
        }
    }

    /// The descriptor indices of `blocks` across every layer and both halves, in the
    /// connector's order (layer, K/V, then the blocks as given).
    pub fn indices(&self, blocks: &[usize]) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.layers * 2 * blocks.len());
        for layer in 0..self.layers {
            for kv in 0..2 {
                out.extend(blocks.iter().map(|&b| self.unit(layer, kv, b)));
            }
        }
        out
    }
}

/// How the block ids of the requests are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOrder {
    /// Seeded random ids (as a running server's free-block lists scatter them).
    Random,
    /// Consecutive ids, wrapping around.
    Sequential,
}

/// One request: which blocks of the initiator's cache (`local`) move to or from which
/// blocks of the target's (`remote`), pairwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The initiator's block ids.
    pub local: Vec<usize>,
    /// The target's block ids.
    pub remote: Vec<usize>,
}

/// splitmix64: the generator of the block ids and the hash of the data pattern.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The block ids of `count` requests of `per_request` blocks each on a cache of
/// `blocks` blocks, for `inflight` requests in flight at a time: on each side, a
/// request's blocks are distinct and none is a block of the `inflight - 1` requests
/// before it, so no two requests that may be in flight together touch the same block
/// (the final contents are then those of the last request to each block, whatever the
/// order in which requests in flight complete). Both processes compute the same plan
/// from the same arguments.
pub fn plan(
    blocks: usize,
    per_request: usize,
    count: usize,
    inflight: usize,
    order: BlockOrder,
    seed: u64,
) -> Result<Vec<Request>, String> {
    if per_request == 0 || inflight == 0 {
        return Err("blocks per request and requests in flight must be at least 1".into());
    }
    match per_request.checked_mul(inflight) {
        Some(n) if n <= blocks => {}
        _ => {
            return Err(format!(
                "{inflight} request(s) in flight of {per_request} blocks need {} distinct \
                 blocks, and the cache has {blocks}: raise --blocks or lower \
                 --blocks-per-request or --inflight",
                per_request.saturating_mul(inflight)
            ))
        }
    }
    let mut out = Vec::with_capacity(count);
    match order {
        BlockOrder::Sequential => {
            for i in 0..count {
                let ids: Vec<usize> = (0..per_request)
                    .map(|j| (i * per_request + j) % blocks)
                    .collect();
                out.push(Request {
                    local: ids.clone(),
                    remote: ids,
                });
            }
        }
        BlockOrder::Random => {
            let mut state = splitmix64(seed ^ 0x4B56_4245_4E43_4821);
            let mut next = move || {
                state = state.wrapping_add(1);
                splitmix64(state)
            };
            // Per side, the request that last used each block (for the in-flight rule).
            let mut last_local = vec![usize::MAX; blocks];
            let mut last_remote = vec![usize::MAX; blocks];
            for i in 0..count {
                let mut pick = |last: &mut Vec<usize>| {
                    let mut ids = Vec::with_capacity(per_request);
                    while ids.len() < per_request {
                        let b = (next() % blocks as u64) as usize;
                        let busy = last[b] != usize::MAX && i - last[b] < inflight;
                        if !busy && last[b] != i {
                            last[b] = i;
                            ids.push(b);
                        }
                    }
                    ids
                };
                let local = pick(&mut last_local);
                let remote = pick(&mut last_remote);
                out.push(Request { local, remote });
            }
        }
    }
    Ok(out)
}

/// The data pattern of `unit` of the cache filled with `seed`, at bytes `[at, at +
/// out.len())` of the unit (`at` a multiple of 8): every 8-byte word a different hash
/// of the seed, the unit and the word's place, so a block at the wrong place, of the
/// wrong side or cut short differs.
pub fn pattern(seed: u64, unit: usize, at: usize, out: &mut [u8]) {
    let base = seed ^ (unit as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let word = ((at / 8 + i) as u64).wrapping_mul(0xA076_1D64_78BD_642F);
        let bytes = splitmix64(base ^ word).to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// What one unit of a destination cache holds once every request has run: its own fill
/// (`None`) or the source's fill of this source unit.
pub type Expected = Option<usize>;

/// What each unit of the destination cache (the initiator's for READ, the target's for
/// WRITE: `destination_is_local`) holds after `requests` ran in order.
pub fn expected(
    shape: &KvShape,
    requests: &[Request],
    destination_is_local: bool,
) -> Vec<Expected> {
    let mut out = vec![None; shape.units()];
    for r in requests {
        let (dst, src) = if destination_is_local {
            (&r.local, &r.remote)
        } else {
            (&r.remote, &r.local)
        };
        for (d, s) in shape.indices(dst).into_iter().zip(shape.indices(src)) {
            out[d] = Some(s);
        }
    }
    out
}

/// Checks `got`, the bytes of consecutive units of a cache starting at address-order
/// position `first_slot`, against `expected`: a unit that kept its own fill holds
/// `own_seed`'s pattern of itself, a written one `source_seed`'s pattern of its source
/// unit. The error names the first unit and byte that differ.
pub fn check_slots(
    shape: &KvShape,
    first_slot: usize,
    got: &[u8],
    expected: &[Expected],
    own_seed: u64,
    source_seed: u64,
) -> Result<(), String> {
    let mut want = vec![0u8; shape.block_bytes];
    for (i, chunk) in got.chunks(shape.block_bytes).enumerate() {
        let unit = shape.unit_at_slot(first_slot + i);
        let (seed, source) = match expected[unit] {
            None => (own_seed, unit),
            Some(s) => (source_seed, s),
        };
        pattern(seed, source, 0, &mut want[..chunk.len()]);
        if let Some(b) = chunk.iter().zip(&want).position(|(g, w)| g != w) {
            let (layer_kv, block) = (unit / shape.blocks, unit % shape.blocks);
            return Err(format!(
                "layer {} {} block {block} byte {b} is {:#04x}, expected {:#04x} ({})",
                layer_kv / 2,
                if layer_kv.is_multiple_of(2) { "K" } else { "V" },
                chunk[b],
                want[b],
                match expected[unit] {
                    None => "its own fill: no request wrote it".to_string(),
                    Some(s) => format!("the source's unit {s}"),
                }
            ));
        }
    }
    Ok(())
}

/// Percentile `p` (0..=100) of sorted `values`, nearest rank; `None` when empty.
pub fn percentile<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(layout: Layout) -> KvShape {
        KvShape {
            layers: 3,
            blocks: 5,
            block_bytes: 16,
            layout,
        }
    }

    #[test]
    fn layouts_tile_the_cache_and_invert() {
        for layout in [Layout::BlockMajor, Layout::Strided] {
            let s = shape(layout);
            assert_eq!(s.units(), 30);
            assert_eq!(s.bytes(), Some(480));
            let mut seen = vec![false; s.units()];
            for unit in 0..s.units() {
                let slot = s.offset(unit) / s.block_bytes;
                assert!(!seen[slot], "{layout:?}: slot {slot} twice");
                seen[slot] = true;
                assert_eq!(s.unit_at_slot(slot), unit);
            }
        }
        // Strided: one layer's K blocks are layers * 2 units apart; block-major: adjacent.
        let s = shape(Layout::Strided);
        assert_eq!(
            s.offset(s.unit(1, 0, 3)) - s.offset(s.unit(1, 0, 2)),
            6 * 16
        );
        assert_eq!(s.offset(s.unit(1, 1, 2)) - s.offset(s.unit(1, 0, 2)), 16);
        let s = shape(Layout::BlockMajor);
        assert_eq!(s.offset(s.unit(1, 0, 3)) - s.offset(s.unit(1, 0, 2)), 16);
        assert_eq!(s.offset(s.unit(2, 1, 0)), (5 * 5) * 16);
    }

    #[test]
    fn indices_cover_every_layer_and_half() {
        let s = shape(Layout::Strided);
        assert_eq!(
            s.indices(&[4, 1]),
            vec![4, 1, 9, 6, 14, 11, 19, 16, 24, 21, 29, 26]
        );
    }

    #[test]
    fn requests_in_flight_together_never_share_a_block() {
        for (order, inflight) in [(BlockOrder::Random, 3), (BlockOrder::Sequential, 4)] {
            let p = plan(64, 16, 200, inflight, order, 7).unwrap();
            assert_eq!(p.len(), 200);
            for w in p.windows(inflight) {
                for side in [0, 1] {
                    let mut all: Vec<usize> = w
                        .iter()
                        .flat_map(|r| if side == 0 { &r.local } else { &r.remote }.clone())
                        .collect();
                    assert!(all.iter().all(|&b| b < 64));
                    all.sort_unstable();
                    let n = all.len();
                    all.dedup();
                    assert_eq!(all.len(), n, "{order:?}: a block twice in one window");
                }
            }
        }
        // Seeded: the same arguments, the same plan; another seed, another.
        let a = plan(64, 8, 10, 2, BlockOrder::Random, 1).unwrap();
        assert_eq!(a, plan(64, 8, 10, 2, BlockOrder::Random, 1).unwrap());
        assert_ne!(a, plan(64, 8, 10, 2, BlockOrder::Random, 2).unwrap());
        assert_ne!(a[0].local, a[0].remote, "the sides' ids are drawn apart");
        let e = plan(64, 40, 10, 2, BlockOrder::Random, 1).unwrap_err();
        assert!(e.contains("raise --blocks"), "{e}");
        assert!(plan(64, 0, 1, 1, BlockOrder::Random, 1).is_err());
    }

    #[test]
    fn expected_contents_follow_the_last_request_to_each_block() {
        let s = KvShape {
            layers: 1,
            blocks: 4,
            block_bytes: 8,
            layout: Layout::BlockMajor,
        };
        let reqs = [
            Request {
                local: vec![0],
                remote: vec![2],
            },
            Request {
                local: vec![0],
                remote: vec![3],
            },
        ];
        // READ: the initiator's block 0 holds the target's block 3 (K: unit 3, V: 7).
        let e = expected(&s, &reqs, true);
        assert_eq!(
            e,
            vec![Some(3), None, None, None, Some(7), None, None, None]
        );
        // WRITE: the target's blocks 2 and 3 both hold the initiator's block 0.
        let e = expected(&s, &reqs, false);
        assert_eq!(e[2], Some(0));
        assert_eq!(e[3], Some(0));
        assert_eq!(e[6], Some(4));
        assert_eq!(e[0], None);
    }

    #[test]
    fn the_check_finds_a_wrong_block_and_names_it() {
        let s = shape(Layout::Strided);
        let mut expected = vec![None; s.units()];
        expected[s.unit(2, 1, 4)] = Some(s.unit(0, 0, 0));
        let (own, source) = (11, 22);
        let mut cache = vec![0u8; s.bytes().unwrap()];
        for slot in 0..s.units() {
            let unit = s.unit_at_slot(slot);
            let (seed, u) = match expected[unit] {
                None => (own, unit),
                Some(src) => (source, src),
            };
            pattern(seed, u, 0, &mut cache[slot * 16..(slot + 1) * 16]);
        }
        check_slots(&s, 0, &cache, &expected, own, source).unwrap();
        // From the middle, as a piece at a time is checked.
        check_slots(&s, 7, &cache[7 * 16..], &expected, own, source).unwrap();
        // The written unit still holding its own fill: found, named.
        let at = s.offset(s.unit(2, 1, 4));
        pattern(own, s.unit(2, 1, 4), 0, &mut cache[at..at + 16]);
        let e = check_slots(&s, 0, &cache, &expected, own, source).unwrap_err();
        assert!(e.contains("layer 2 V block 4 byte 0"), "{e}");
        // One flipped byte of an untouched unit.
        let mut cache2 = cache.clone();
        pattern(source, s.unit(0, 0, 0), 0, &mut cache2[at..at + 16]);
        cache2[5] ^= 1;
        let e = check_slots(&s, 0, &cache2, &expected, own, source).unwrap_err();
        assert!(e.contains("byte 5") && e.contains("its own fill"), "{e}");
    }

    #[test]
    fn patterns_differ_by_seed_unit_and_place() {
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        pattern(1, 2, 0, &mut a);
        pattern(1, 2, 0, &mut b);
        assert_eq!(a, b);
        pattern(1, 3, 0, &mut b);
        assert_ne!(a, b);
        pattern(2, 2, 0, &mut b);
        assert_ne!(a, b);
        let mut tail = [0u8; 16];
        pattern(1, 2, 16, &mut tail);
        assert_eq!(&a[16..], &tail);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u32> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 100.0), Some(100));
        assert_eq!(percentile(&[7u32], 99.0), Some(7));
        assert_eq!(percentile::<u32>(&[], 50.0), None);
    }
}
