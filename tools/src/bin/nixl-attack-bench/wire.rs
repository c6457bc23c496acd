//! What the attackers and the listener probe put on the wire, written here by hand as an
//! attacker without an agent would: listener frames, notification messages, and the
//! rail names read out of fetched metadata.

use nixl::metadata::{crc32c, crc32c_append, AgentMetadata};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub(crate) const SEND_MD: u8 = 1;
pub(crate) const FETCH_MD: u8 = 2;
pub(crate) const MD_REPLY: u8 = 3;
pub(crate) const INVALIDATE: u8 = 4;
/// Header of a listener frame: "NXP2", type, length, CRC-32C.
pub(crate) const FRAME_HEADER_BYTES: usize = 13;

/// A version-2 listener frame header for a payload of `len` bytes whose check is
/// `check` (a correct check needs the payload; junk gets any value).
pub(crate) fn frame_header(kind: u8, len: u32, check: Option<u32>) -> [u8; FRAME_HEADER_BYTES] {
    let mut h = [0u8; FRAME_HEADER_BYTES];
    h[..4].copy_from_slice(b"NXP2");
    h[4] = kind;
    h[5..9].copy_from_slice(&len.to_le_bytes());
    let check = check.unwrap_or_else(|| crc32c(&h[..9]) ^ 0x5a5a_5a5a);
    h[9..].copy_from_slice(&check.to_le_bytes());
    h
}

/// A whole, correct frame.
pub(crate) fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    let head = frame_header(kind, len, Some(0));
    let check = crc32c_append(crc32c(&head[..9]), payload);
    let mut out = frame_header(kind, len, Some(check)).to_vec();
    out.extend_from_slice(payload);
    out
}

/// A `FETCH_MD` from this process, as a client without an agent sends it; the metadata
/// blob of the reply.
pub(crate) fn fetch_metadata(to: SocketAddr, timeout: Duration) -> Result<Vec<u8>, String> {
    let mut s = TcpStream::connect_timeout(&to, timeout).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(timeout)).ok();
    s.set_write_timeout(Some(timeout)).ok();
    s.write_all(&frame(FETCH_MD, &[]))
        .map_err(|e| format!("send: {e}"))?;
    let mut header = [0u8; FRAME_HEADER_BYTES];
    s.read_exact(&mut header)
        .map_err(|e| format!("reply header: {e}"))?;
    let len = u32::from_le_bytes([header[5], header[6], header[7], header[8]]) as usize;
    if len > 64 << 20 {
        return Err(format!("reply of {len} bytes"));
    }
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)
        .map_err(|e| format!("reply payload: {e}"))?;
    if header[4] != MD_REPLY {
        return Err(format!(
            "reply type {}: {}",
            header[4],
            String::from_utf8_lossy(&payload)
        ));
    }
    Ok(payload)
}

/// The endpoint names of the rails a `LIBFABRIC` section's connection information
/// advertises (`count:u8 (len:u16le name)*` at its start).
pub(crate) fn libfabric_rails(blob: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let md = AgentMetadata::decode(blob).map_err(|e| format!("metadata: {e}"))?;
    let conn = md
        .sections
        .iter()
        .find(|s| s.backend == "LIBFABRIC")
        .and_then(|s| s.conn_info.as_deref())
        .ok_or("no LIBFABRIC connection information in the target's metadata")?;
    let count = *conn.first().ok_or("empty connection information")? as usize;
    if count == 0xd7 {
        return Err(
            "the target advertises two planes (network and shm): run it with \
                    local_provider=none"
                .into(),
        );
    }
    let mut at = 1;
    let mut names = Vec::with_capacity(count);
    for _ in 0..count {
        let len = conn
            .get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
            .ok_or("truncated rail list")?;
        let name = conn
            .get(at + 2..at + 2 + len)
            .ok_or("truncated rail name")?;
        names.push(name.to_vec());
        at += 2 + len;
    }
    Ok(names)
}

/// A `LIBFABRIC` notification message: `NXNT key-low:u32 key-high:u32 expected:u64
/// name:str16 msg:u32-prefixed`.
pub(crate) fn notification(sender: &str, key: u64, expected: u64, msg: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(26 + sender.len() + msg.len());
    out.extend_from_slice(b"NXNT");
    out.extend_from_slice(&(key as u32).to_le_bytes());
    out.extend_from_slice(&((key >> 32) as u32).to_le_bytes());
    out.extend_from_slice(&expected.to_le_bytes());
    out.extend_from_slice(&(sender.len() as u16).to_le_bytes());
    out.extend_from_slice(sender.as_bytes());
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(msg);
    out
}

/// `inner` in a `LIBFABRIC` notification seal, `NXNS seq:u64le tag:[u8; 16] inner`, with
/// a tag made up from `guess` (the attacker has no pair key: a real seal is an
/// HMAC-SHA256 under one).
pub(crate) fn sealed(guess: u64, inner: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(28 + inner.len());
    out.extend_from_slice(b"NXNS");
    out.extend_from_slice(&(guess >> 1).to_le_bytes());
    out.extend_from_slice(&guess.to_le_bytes());
    out.extend_from_slice(&guess.rotate_left(17).to_le_bytes());
    out.extend_from_slice(inner);
    out
}

/// A sealed rail control frame as the target's `notif_mac` splits it: `NXRS seq:u64le
/// tag:[u8; 16] public:[u8; 32] name_len:u16le name inner`, the tag made up.
pub(crate) fn control_frame(seq: u64, public: &[u8; 32], sender: &str, inner: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(62 + sender.len() + inner.len());
    out.extend_from_slice(b"NXRS");
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&seq.rotate_left(7).to_le_bytes());
    out.extend_from_slice(&seq.rotate_left(29).to_le_bytes());
    out.extend_from_slice(public);
    out.extend_from_slice(&(sender.len() as u16).to_le_bytes());
    out.extend_from_slice(sender.as_bytes());
    out.extend_from_slice(inner);
    out
}

/// splitmix64: reproducible patterns and junk without a dependency.
#[derive(Debug, Clone)]
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// The bytes transfer `seq` writes into a slot.
pub(crate) fn pattern(seq: u64, out: &mut [u8]) {
    Rng(seq.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0xa5a5).fill(out);
}

/// Whether `got` holds transfer `seq`'s bytes.
pub(crate) fn holds_pattern(seq: u64, got: &[u8]) -> bool {
    let mut want = vec![0u8; got.len()];
    pattern(seq, &mut want);
    want == got
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_a_correct_check() {
        let f = frame(FETCH_MD, b"abc");
        let check = crc32c_append(crc32c(&f[..9]), b"abc");
        assert_eq!(&f[9..13], &check.to_le_bytes());
        let junk = frame_header(SEND_MD, 10, None);
        assert_ne!(&junk[9..13], &crc32c(&junk[..9]).to_le_bytes());
    }

    #[test]
    fn patterns_differ_per_transfer() {
        let mut a = vec![0u8; 100];
        pattern(1, &mut a);
        assert!(holds_pattern(1, &a));
        assert!(!holds_pattern(2, &a));
    }
}
