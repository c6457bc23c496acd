//! The pure parts of the staging protocol: cutting descriptors into chunks, the
//! control messages (checked against hostile input), and slot accounting.

use super::{
    FLAG_KEY, KIND_DONE, KIND_FETCH, KIND_FETCHED, KIND_OFFER, MAGIC, MAX_NAME, MAX_PIECES,
    MAX_REASON, PIECE_WIRE, VERSION,
};
use crate::error::{Error, Result};

// ---- chunking ---------------------------------------------------------------------------

/// A piece of one chunk: `len` bytes at `offset` of entry `entry`, at `slot_off` of the
/// chunk's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PieceRef {
    pub(crate) entry: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) slot_off: u64,
}

/// Cuts entries `(index, length)` into chunks of at most `capacity` bytes and
/// `max_pieces` pieces of at most `max_piece` bytes each, in order; an entry crosses
/// chunk boundaries where it must. Zero-length entries are skipped.
pub(crate) fn plan_chunks(
    entries: impl IntoIterator<Item = (usize, u64)>,
    capacity: u64,
    max_pieces: usize,
    max_piece: u64,
) -> Vec<Vec<PieceRef>> {
    let capacity = capacity.max(1);
    let max_pieces = max_pieces.max(1);
    let max_piece = max_piece.max(1);
    let mut chunks: Vec<Vec<PieceRef>> = Vec::new();
    let mut current: Vec<PieceRef> = Vec::new();
    let mut used = 0u64;
    for (entry, len) in entries {
        let mut offset = 0u64;
        while offset < len {
            if used == capacity || current.len() == max_pieces {
                chunks.push(std::mem::take(&mut current));
                used = 0;
            }
            let n = (len - offset).min(capacity - used).min(max_piece);
            current.push(PieceRef {
                entry,
                offset,
                len: n,
                slot_off: used,
            });
            used += n;
            offset += n;
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

// ---- control messages -------------------------------------------------------------------

/// One piece of a request: the requester's memory as the target addresses it remotely
/// (`peer_addr`, `peer_key`), and the target's own raw address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WirePiece {
    pub(crate) peer_addr: u64,
    pub(crate) peer_key: u64,
    pub(crate) target: u64,
    pub(crate) len: u32,
}

/// An OFFER or FETCH.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) token: u64,
    /// Notification key to count when the chunk landed (OFFER of a notified WRITE).
    pub(crate) key: Option<u64>,
    /// The requester's address on the rail it sent from.
    pub(crate) reply_to: Vec<u8>,
    pub(crate) pieces: Vec<WirePiece>,
}

/// A decoded control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ctrl {
    /// Pull these bytes of the requester into the target's memory.
    Offer(Request),
    /// Push these bytes of the target into the requester's memory.
    Fetch(Request),
    /// The target finished (or refused) request `token`.
    Done {
        token: u64,
        status: i32,
        reason: String,
    },
    /// The target wrote every piece of FETCH `token` and each is delivered: `pieces`
    /// writes of `bytes` in all (what the requester checks against what it asked for).
    Fetched { token: u64, pieces: u16, bytes: u64 },
}

fn header(kind: u8, flags: u8, token: u64, cap: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(cap);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[VERSION, kind, flags, 0]);
    out.extend_from_slice(&token.to_le_bytes());
    out
}

impl Ctrl {
    /// Encodes the message; fails (`InvalidParam`) where it would not fit the limits.
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        match self {
            Ctrl::Offer(r) | Ctrl::Fetch(r) => {
                let kind = if matches!(self, Ctrl::Offer(_)) {
                    KIND_OFFER
                } else {
                    KIND_FETCH
                };
                if r.pieces.is_empty() || r.pieces.len() > MAX_PIECES {
                    return Err(Error::InvalidParam(format!(
                        "a staging request carries 1..={MAX_PIECES} pieces, not {}",
                        r.pieces.len()
                    )));
                }
                if r.reply_to.len() > MAX_NAME {
                    return Err(Error::InvalidParam(format!(
                        "endpoint name of {} bytes (at most {MAX_NAME})",
                        r.reply_to.len()
                    )));
                }
                let flags = if r.key.is_some() { FLAG_KEY } else { 0 };
                let mut out = header(
                    kind,
                    flags,
                    r.token,
                    30 + r.reply_to.len() + r.pieces.len() * PIECE_WIRE,
                );
                out.extend_from_slice(&r.key.unwrap_or(0).to_le_bytes());
                out.extend_from_slice(&(r.reply_to.len() as u16).to_le_bytes());
                out.extend_from_slice(&r.reply_to);
                out.extend_from_slice(&(r.pieces.len() as u16).to_le_bytes());
                for p in &r.pieces {
                    out.extend_from_slice(&p.peer_addr.to_le_bytes());
                    out.extend_from_slice(&p.peer_key.to_le_bytes());
                    out.extend_from_slice(&p.target.to_le_bytes());
                    out.extend_from_slice(&p.len.to_le_bytes());
                }
                Ok(out)
            }
            Ctrl::Done {
                token,
                status,
                reason,
            } => {
                let mut cut = reason.len().min(MAX_REASON);
                while !reason.is_char_boundary(cut) {
                    cut -= 1;
                }
                let reason = &reason.as_bytes()[..cut];
                let mut out = header(KIND_DONE, 0, *token, 22 + reason.len());
                out.extend_from_slice(&status.to_le_bytes());
                out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
                out.extend_from_slice(reason);
                Ok(out)
            }
            Ctrl::Fetched {
                token,
                pieces,
                bytes,
            } => {
                if *pieces == 0 || usize::from(*pieces) > MAX_PIECES {
                    return Err(Error::InvalidParam(format!(
                        "a FETCH answer counts 1..={MAX_PIECES} pieces, not {pieces}"
                    )));
                }
                let mut out = header(KIND_FETCHED, 0, *token, 26);
                out.extend_from_slice(&pieces.to_le_bytes());
                out.extend_from_slice(&bytes.to_le_bytes());
                Ok(out)
            }
        }
    }

    /// Decodes a message, refusing anything malformed (never panics, never allocates
    /// more than the message's own size).
    pub(crate) fn decode(b: &[u8]) -> Result<Ctrl> {
        let bad = |why: &str| Error::MalformedMetadata(format!("staging message: {why}"));
        let mut r = Reader { b, at: 0 };
        if r.take(4).ok_or_else(|| bad("truncated"))? != MAGIC {
            return Err(bad("wrong magic"));
        }
        let [version, kind, flags, zero] = r.array::<4>().ok_or_else(|| bad("truncated"))?;
        if version != VERSION {
            return Err(bad("unknown version"));
        }
        if zero != 0 {
            return Err(bad("reserved byte set"));
        }
        let token = r.u64().ok_or_else(|| bad("truncated"))?;
        let msg = match kind {
            KIND_OFFER | KIND_FETCH => {
                if flags & !FLAG_KEY != 0 {
                    return Err(bad("unknown flags"));
                }
                let key = r.u64().ok_or_else(|| bad("truncated"))?;
                let name_len = r.u16().ok_or_else(|| bad("truncated"))? as usize;
                if name_len == 0 || name_len > MAX_NAME {
                    return Err(bad("bad name length"));
                }
                let reply_to = r.take(name_len).ok_or_else(|| bad("truncated"))?.to_vec();
                let count = r.u16().ok_or_else(|| bad("truncated"))? as usize;
                if count == 0 || count > MAX_PIECES {
                    return Err(bad("bad piece count"));
                }
                if r.left() != count * PIECE_WIRE {
                    return Err(bad("length does not match the piece count"));
                }
                let mut pieces = Vec::with_capacity(count);
                for _ in 0..count {
                    let piece = WirePiece {
                        peer_addr: r.u64().ok_or_else(|| bad("truncated"))?,
                        peer_key: r.u64().ok_or_else(|| bad("truncated"))?,
                        target: r.u64().ok_or_else(|| bad("truncated"))?,
                        len: r.u32().ok_or_else(|| bad("truncated"))?,
                    };
                    if piece.len == 0 {
                        return Err(bad("empty piece"));
                    }
                    if piece.target.checked_add(u64::from(piece.len)).is_none()
                        || piece.peer_addr.checked_add(u64::from(piece.len)).is_none()
                    {
                        return Err(bad("piece overflows the address space"));
                    }
                    pieces.push(piece);
                }
                let req = Request {
                    token,
                    key: (flags & FLAG_KEY != 0).then_some(key),
                    reply_to,
                    pieces,
                };
                if kind == KIND_OFFER {
                    Ctrl::Offer(req)
                } else {
                    Ctrl::Fetch(req)
                }
            }
            KIND_DONE => {
                if flags != 0 {
                    return Err(bad("unknown flags"));
                }
                let status = r.u32().ok_or_else(|| bad("truncated"))? as i32;
                let len = r.u16().ok_or_else(|| bad("truncated"))? as usize;
                if len > MAX_REASON {
                    return Err(bad("reason too long"));
                }
                let reason = r.take(len).ok_or_else(|| bad("truncated"))?;
                Ctrl::Done {
                    token,
                    status,
                    reason: String::from_utf8_lossy(reason).into_owned(),
                }
            }
            KIND_FETCHED => {
                if flags != 0 {
                    return Err(bad("unknown flags"));
                }
                let pieces = r.u16().ok_or_else(|| bad("truncated"))?;
                if pieces == 0 || usize::from(pieces) > MAX_PIECES {
                    return Err(bad("bad piece count"));
                }
                let bytes = r.u64().ok_or_else(|| bad("truncated"))?;
                Ctrl::Fetched {
                    token,
                    pieces,
                    bytes,
                }
            }
            _ => return Err(bad("unknown kind")),
        };
        if r.left() != 0 {
            return Err(bad("trailing bytes"));
        }
        Ok(msg)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.b.get(self.at..end)?;
        self.at = end;
        Some(s)
    }
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }
    fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }
    fn left(&self) -> usize {
        self.b.len() - self.at
    }
}

// ---- slots ------------------------------------------------------------------------------

/// Free-list accounting of `count` slots numbered from `first`.
#[derive(Debug)]
pub(crate) struct SlotPool {
    first: u32,
    free: Vec<u32>,
    in_use: Vec<bool>,
}

impl SlotPool {
    pub(crate) fn new(first: u32, count: u32) -> Self {
        Self {
            first,
            // Popped from the back: lowest slots first.
            free: (first..first + count).rev().collect(),
            in_use: vec![false; count as usize],
        }
    }

    pub(crate) fn acquire(&mut self) -> Option<u32> {
        let slot = self.free.pop()?;
        self.in_use[(slot - self.first) as usize] = true;
        Some(slot)
    }

    /// Returns a slot; a slot that is not this pool's or not in use is refused (`false`)
    /// and logged, never double-freed.
    pub(crate) fn release(&mut self, slot: u32) -> bool {
        let Some(used) = slot
            .checked_sub(self.first)
            .and_then(|i| self.in_use.get_mut(i as usize))
        else {
            tracing::error!(slot, "staging: releasing a slot of another pool");
            return false;
        };
        if !*used {
            tracing::error!(slot, "staging: releasing a free slot");
            return false;
        }
        *used = false;
        self.free.push(slot);
        true
    }

    pub(crate) fn available(&self) -> usize {
        self.free.len()
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.in_use.len()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small deterministic generator (xorshift), so failures reproduce.
    pub(crate) struct Rng(pub(crate) u64);
    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        pub(crate) fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    fn check_plan(lens: &[u64], capacity: u64, max_pieces: usize, max_piece: u64) {
        let chunks = plan_chunks(
            lens.iter().copied().enumerate(),
            capacity,
            max_pieces,
            max_piece,
        );
        // Every byte of every entry exactly once, in order.
        let mut expect = lens
            .iter()
            .enumerate()
            .filter(|(_, l)| **l > 0)
            .map(|(i, _)| (i, 0u64));
        let mut current = expect.next();
        for chunk in &chunks {
            assert!(!chunk.is_empty());
            assert!(chunk.len() <= max_pieces);
            let mut slot = 0;
            for p in chunk {
                assert!(p.len > 0 && p.len <= max_piece, "{p:?}");
                assert_eq!(p.slot_off, slot, "pieces are packed");
                slot += p.len;
                let (entry, offset) = current.expect("no more bytes expected");
                assert_eq!((p.entry, p.offset), (entry, offset));
                current = if offset + p.len == lens[entry] {
                    expect.next()
                } else {
                    Some((entry, offset + p.len))
                };
            }
            assert!(slot <= capacity);
        }
        assert!(current.is_none(), "bytes left unplanned");
        // Chunks are full except where the piece limit or the end cut them.
        for chunk in &chunks[..chunks.len().saturating_sub(1)] {
            let used: u64 = chunk.iter().map(|p| p.len).sum();
            assert!(used == capacity || chunk.len() == max_pieces);
        }
    }

    #[test]
    fn chunking_covers_every_byte_across_boundaries() {
        const MIB: u64 = 1 << 20;
        check_plan(&[1], MIB, 128, u64::MAX);
        check_plan(
            &[4097, 1, 3 * MIB + 5, MIB, MIB - 1, 0, 7],
            MIB,
            128,
            u64::MAX,
        );
        check_plan(&[3 * MIB + 5], 64 << 10, 128, 10_000);
        check_plan(&[100; 1000], 4096, 128, u64::MAX);
        check_plan(&[4096; 300], MIB, 128, u64::MAX);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..300 {
            let lens: Vec<u64> = (0..rng.below(40) + 1)
                .map(|_| match rng.below(4) {
                    0 => rng.below(5),
                    1 => rng.below(1 << 22),
                    _ => rng.below(70_000),
                })
                .collect();
            let cap = 4096 * (rng.below(64) + 1);
            check_plan(
                &lens,
                cap,
                rng.below(MAX_PIECES as u64) as usize + 1,
                rng.below(200_000) + 1,
            );
        }
        assert!(plan_chunks([(0, 0)], 4096, 4, 4096).is_empty());
    }

    fn request(pieces: usize) -> Request {
        Request {
            token: 0x0123_4567_89ab_cdef,
            key: Some(42),
            reply_to: b"fi_sockaddr_in://127.0.0.1:5555".to_vec(),
            pieces: (0..pieces as u64)
                .map(|i| WirePiece {
                    peer_addr: 0x7f00_0000_0000 + i * 4096,
                    peer_key: 17 + i,
                    target: 0x7000_0000_0000 + i * 8192,
                    len: 4096 + i as u32,
                })
                .collect(),
        }
    }

    #[test]
    fn control_messages_round_trip() {
        let mut no_key = request(1);
        no_key.key = None;
        let cases = [
            Ctrl::Offer(request(1)),
            Ctrl::Fetch(request(MAX_PIECES)),
            Ctrl::Offer(no_key),
            Ctrl::Done {
                token: 9,
                status: 0,
                reason: String::new(),
            },
            Ctrl::Done {
                token: u64::MAX >> 1,
                status: -22,
                reason: "piece 3 outside".into(),
            },
            Ctrl::Fetched {
                token: 7,
                pieces: 1,
                bytes: 4096,
            },
            Ctrl::Fetched {
                token: (1 << 44) - 1,
                pieces: MAX_PIECES as u16,
                bytes: u64::MAX,
            },
        ];
        for msg in cases {
            let bytes = msg.encode().unwrap();
            assert!(bytes.len() <= crate::backends::staging::MAX_CTRL_BYTES);
            assert_eq!(Ctrl::decode(&bytes).unwrap(), msg);
            for cut in 0..bytes.len() {
                assert!(Ctrl::decode(&bytes[..cut]).is_err(), "cut at {cut}");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(Ctrl::decode(&longer).is_err(), "trailing byte");
        }
        // A long reason is cut at a character boundary, not refused.
        let long = Ctrl::Done {
            token: 1,
            status: 5,
            reason: "é".repeat(1000),
        };
        let Ctrl::Done { reason, .. } = Ctrl::decode(&long.encode().unwrap()).unwrap() else {
            panic!("kind changed");
        };
        assert!(reason.len() <= MAX_REASON && reason.chars().all(|c| c == 'é'));
        // What cannot be encoded is refused before it is sent.
        assert!(Ctrl::Offer(request(0)).encode().is_err());
        assert!(Ctrl::Offer(request(MAX_PIECES + 1)).encode().is_err());
        let mut long_name = request(1);
        long_name.reply_to = vec![b'x'; MAX_NAME + 1];
        assert!(Ctrl::Fetch(long_name).encode().is_err());
        for pieces in [0, MAX_PIECES as u16 + 1] {
            let answer = Ctrl::Fetched {
                token: 1,
                pieces,
                bytes: 1,
            };
            assert!(answer.encode().is_err(), "{pieces} pieces");
        }
    }

    #[test]
    fn hostile_control_messages_are_refused() {
        let good = Ctrl::Offer(request(3)).encode().unwrap();
        let with = |at: usize, bytes: &[u8]| {
            let mut b = good.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            b
        };
        let name_len = request(3).reply_to.len();
        let count_at = 26 + name_len;
        let piece0 = count_at + 2;
        let hostile: Vec<(&str, Vec<u8>)> = vec![
            ("empty", Vec::new()),
            ("wrong magic", with(0, b"NXNT")),
            ("version", with(4, &[2])),
            ("kind", with(5, &[9])),
            ("flags", with(6, &[0x80])),
            ("reserved", with(7, &[1])),
            ("name length 0", with(24, &0u16.to_le_bytes())),
            ("name length huge", with(24, &u16::MAX.to_le_bytes())),
            ("name past the end", with(24, &4000u16.to_le_bytes())),
            ("piece count 0", with(count_at, &0u16.to_le_bytes())),
            ("piece count too high", with(count_at, &4u16.to_le_bytes())),
            (
                "piece count over the limit",
                with(count_at, &1000u16.to_le_bytes()),
            ),
            ("empty piece", with(piece0 + 24, &0u32.to_le_bytes())),
            (
                "target overflows",
                with(piece0 + 16, &(u64::MAX - 10).to_le_bytes()),
            ),
            (
                "peer address overflows",
                with(piece0, &(u64::MAX - 10).to_le_bytes()),
            ),
        ];
        for (what, bytes) in hostile {
            assert!(Ctrl::decode(&bytes).is_err(), "{what} accepted");
        }
        let done = Ctrl::Done {
            token: 1,
            status: 0,
            reason: "x".into(),
        }
        .encode()
        .unwrap();
        let mut long_reason = done.clone();
        long_reason[20..22].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(Ctrl::decode(&long_reason).is_err());
        let mut done_flags = done;
        done_flags[6] = 1;
        assert!(Ctrl::decode(&done_flags).is_err());
        let fetched = Ctrl::Fetched {
            token: 1,
            pieces: 2,
            bytes: 8192,
        }
        .encode()
        .unwrap();
        for (what, at, bytes) in [
            ("FETCHED flags", 6, &[1u8][..]),
            ("FETCHED of 0 pieces", 16, &0u16.to_le_bytes()[..]),
            (
                "FETCHED over the piece limit",
                16,
                &129u16.to_le_bytes()[..],
            ),
        ] {
            let mut b = fetched.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            assert!(Ctrl::decode(&b).is_err(), "{what} accepted");
        }
        // Random corruption never panics; whatever still decodes is self-consistent.
        let mut rng = Rng(7);
        for _ in 0..20_000 {
            let mut b = good.clone();
            for _ in 0..rng.below(4) + 1 {
                let at = rng.below(b.len() as u64) as usize;
                b[at] = rng.next() as u8;
            }
            b.truncate(b.len() - rng.below(3) as usize);
            if let Ok(Ctrl::Offer(r) | Ctrl::Fetch(r)) = Ctrl::decode(&b) {
                assert!(!r.pieces.is_empty() && r.pieces.len() <= MAX_PIECES);
                assert!(r.pieces.iter().all(|p| p.len > 0));
            }
            let garbage: Vec<u8> = (0..rng.below(200)).map(|_| rng.next() as u8).collect();
            let _ = Ctrl::decode(&garbage);
        }
    }

    #[test]
    fn slot_accounting_refuses_double_and_foreign_releases() {
        let mut pool = SlotPool::new(8, 3);
        assert_eq!(pool.capacity(), 3);
        let a = pool.acquire().unwrap();
        let b = pool.acquire().unwrap();
        let c = pool.acquire().unwrap();
        assert_eq!((a, b, c), (8, 9, 10), "lowest first, numbered from `first`");
        assert_eq!(pool.acquire(), None);
        assert!(pool.release(b));
        assert!(!pool.release(b), "double release");
        assert!(!pool.release(7), "another pool's slot");
        assert!(!pool.release(11), "past the end");
        assert_eq!(pool.available(), 1);
        assert_eq!(pool.acquire(), Some(9));
        assert!(pool.release(a) && pool.release(c) && pool.release(9));
        assert_eq!(pool.available(), 3);
    }
}
