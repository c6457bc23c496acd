//! The metadata blob: a versioned binary format with one section per backend.
//!
//! ```text
//! blob    = "NIXLMD" version:u16le name:str16 nsections:u16le section*
//! section = backend:str8 tag:u8 len:u32le payload[len]
//!   tag 1 = connection info: payload is the backend's opaque bytes
//!   tag 2 = memory regions:  count:u32le region*
//! region  = kind:u8 dev_id:u64le addr:u64le len:u64le md:bytes16
//! strN    = uN little-endian length + UTF-8 bytes;  bytes16 = u16le length + bytes
//! ```
//! Unknown section tags and backends are skipped (their length is known), so newer
//! senders stay readable. Every length, count and offset is checked against what is
//! left of the blob before anything is allocated: a hostile blob costs at most its own
//! size, and gives [`Error::MalformedMetadata`], never a panic.

use crate::error::{Error, Result};
use crate::mem::{Desc, MemKind, Region};

const MAGIC: &[u8; 6] = b"NIXLMD";
/// The format version this crate writes and reads.
pub const VERSION: u16 = 1;
/// Largest blob accepted (15,000 regions take about 0.6 MB; this leaves room for many more).
pub const MAX_METADATA_BYTES: usize = 64 << 20;
const MAX_SECTIONS: u16 = 256;
/// Smallest encoding of one region: kind, dev_id, addr, len, empty md.
const MIN_REGION_BYTES: usize = 1 + 8 + 8 + 8 + 2;

const TAG_CONN_INFO: u8 = 1;
const TAG_REGIONS: u8 = 2;

/// One backend's part of an agent's metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendSection {
    /// Backend name (e.g. `LIBFABRIC`).
    pub backend: String,
    /// Connection information, if included.
    pub conn_info: Option<Vec<u8>>,
    /// Registered regions with the backend's public metadata (remote keys) for each.
    pub regions: Vec<(Region, Vec<u8>)>,
}

/// An agent's metadata: what a peer needs to reach it and to address its memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentMetadata {
    /// The agent's name.
    pub agent: String,
    /// One section per backend.
    pub sections: Vec<BackendSection>,
}

impl AgentMetadata {
    /// Serializes; fails only if a field exceeds its wire limit.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        put_str(&mut out, &self.agent, u16::MAX as usize, 2)?;
        let mut count = 0u16;
        let count_at = out.len();
        out.extend_from_slice(&0u16.to_le_bytes());
        for section in &self.sections {
            if let Some(info) = &section.conn_info {
                put_section(&mut out, &section.backend, TAG_CONN_INFO, info)?;
                count += 1;
            }
            if !section.regions.is_empty() {
                let mut payload = Vec::with_capacity(4 + section.regions.len() * 40);
                let n = u32::try_from(section.regions.len())
                    .map_err(|_| Error::InvalidParam("too many regions".into()))?;
                payload.extend_from_slice(&n.to_le_bytes());
                for (region, md) in &section.regions {
                    payload.push(region.kind.code());
                    payload.extend_from_slice(&region.desc.dev_id.to_le_bytes());
                    payload.extend_from_slice(&region.desc.addr.to_le_bytes());
                    payload.extend_from_slice(&region.desc.len.to_le_bytes());
                    put_bytes16(&mut payload, md)?;
                }
                put_section(&mut out, &section.backend, TAG_REGIONS, &payload)?;
                count += 1;
            }
            if count > MAX_SECTIONS {
                return Err(Error::InvalidParam("too many metadata sections".into()));
            }
        }
        out[count_at..count_at + 2].copy_from_slice(&count.to_le_bytes());
        if out.len() > MAX_METADATA_BYTES {
            return Err(Error::InvalidParam(format!(
                "metadata of {} bytes exceeds the {MAX_METADATA_BYTES}-byte limit",
                out.len()
            )));
        }
        Ok(out)
    }

    /// Parses and validates a blob.
    pub fn decode(blob: &[u8]) -> Result<Self> {
        if blob.len() > MAX_METADATA_BYTES {
            return Err(malformed(format!("{} bytes exceeds the limit", blob.len())));
        }
        let mut r = Reader { buf: blob, pos: 0 };
        if r.take(MAGIC.len(), "magic")? != MAGIC {
            return Err(malformed("not a metadata blob (bad magic)"));
        }
        let version = r.u16("version")?;
        if version != VERSION {
            return Err(malformed(format!(
                "unsupported version {version} (this build reads {VERSION})"
            )));
        }
        let agent = r.str16("agent name")?;
        if agent.is_empty() {
            return Err(malformed("empty agent name"));
        }
        let nsections = r.u16("section count")?;
        if nsections > MAX_SECTIONS {
            return Err(malformed(format!(
                "{nsections} sections exceeds {MAX_SECTIONS}"
            )));
        }
        let mut meta = AgentMetadata {
            agent,
            sections: Vec::new(),
        };
        for _ in 0..nsections {
            let backend = r.str8("backend name")?;
            if backend.is_empty() {
                // `encode` refuses it too: what decodes must re-encode.
                return Err(malformed("empty backend name"));
            }
            let tag = r.u8("section tag")?;
            let len = r.u32("section length")? as usize;
            let payload = r.take(len, "section payload")?;
            let section = match meta.sections.iter().position(|s| s.backend == backend) {
                Some(i) => &mut meta.sections[i],
                None => {
                    meta.sections.push(BackendSection {
                        backend,
                        ..Default::default()
                    });
                    meta.sections.last_mut().expect("just pushed")
                }
            };
            match tag {
                TAG_CONN_INFO => section.conn_info = Some(payload.to_vec()),
                TAG_REGIONS => section.regions.extend(decode_regions(payload)?),
                _ => {} // a newer sender's section: skipped, its length was honoured
            }
        }
        if r.pos != blob.len() {
            return Err(malformed(format!("{} trailing bytes", blob.len() - r.pos)));
        }
        // A backend seen only in skipped (or empty) sections carries nothing: dropping it
        // keeps decoding canonical (decode(encode(m)) == m), as the fuzz target checks.
        meta.sections
            .retain(|s| s.conn_info.is_some() || !s.regions.is_empty());
        Ok(meta)
    }
}

fn decode_regions(payload: &[u8]) -> Result<Vec<(Region, Vec<u8>)>> {
    let mut r = Reader {
        buf: payload,
        pos: 0,
    };
    let count = r.u32("region count")? as usize;
    // Bound the allocation by what the payload can actually hold.
    if count > r.remaining() / MIN_REGION_BYTES {
        return Err(malformed(format!(
            "region count {count} cannot fit in {} bytes",
            r.remaining()
        )));
    }
    let mut regions = Vec::with_capacity(count);
    for i in 0..count {
        let code = r.u8("region kind")?;
        let dev_id = r.u64("region device")?;
        let addr = r.u64("region address")?;
        let len = r.u64("region length")?;
        let md = r.bytes16("region metadata")?.to_vec();
        let kind = MemKind::from_code(code)
            .ok_or_else(|| malformed(format!("region {i}: unknown memory kind {code}")))?;
        let desc = Desc::new(addr, len, dev_id);
        desc.checked_end(i)
            .map_err(|e| malformed(format!("region {i}: {e}")))?;
        regions.push((Region { kind, desc }, md));
    }
    if r.remaining() != 0 {
        return Err(malformed("trailing bytes in a region section"));
    }
    Ok(regions)
}

fn malformed(why: impl Into<String>) -> Error {
    Error::MalformedMetadata(why.into())
}

fn put_section(out: &mut Vec<u8>, backend: &str, tag: u8, payload: &[u8]) -> Result<()> {
    if backend.is_empty() {
        return Err(Error::InvalidParam("empty backend name".into()));
    }
    put_str(out, backend, u8::MAX as usize, 1)?;
    out.push(tag);
    let len = u32::try_from(payload.len())
        .map_err(|_| Error::InvalidParam("metadata section over 4 GiB".into()))?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(payload);
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str, max: usize, width: usize) -> Result<()> {
    if s.len() > max {
        return Err(Error::InvalidParam(format!(
            "`{s}` is longer than {max} bytes"
        )));
    }
    out.extend_from_slice(&(s.len() as u64).to_le_bytes()[..width]);
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_bytes16(out: &mut Vec<u8>, bytes: &[u8]) -> Result<()> {
    let len = u16::try_from(bytes.len())
        .map_err(|_| Error::InvalidParam("backend region metadata over 64 KiB".into()))?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(bytes);
    Ok(())
}

/// A bounds-checked cursor: every read names what it was reading when it runs out.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(malformed(format!(
                "truncated {what}: needs {n} bytes at offset {}, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("took N bytes"))
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn bytes16(&mut self, what: &str) -> Result<&'a [u8]> {
        let len = self.u16(what)? as usize;
        self.take(len, what)
    }

    fn utf8(&mut self, len: usize, what: &str) -> Result<String> {
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| malformed(format!("{what} is not UTF-8")))
    }

    fn str8(&mut self, what: &str) -> Result<String> {
        let len = self.u8(what)? as usize;
        self.utf8(len, what)
    }

    fn str16(&mut self, what: &str) -> Result<String> {
        let len = self.u16(what)? as usize;
        self.utf8(len, what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata {
            agent: "prefill-0".into(),
            sections: vec![
                BackendSection {
                    backend: "LIBFABRIC".into(),
                    conn_info: Some(vec![1, 2, 3]),
                    regions: vec![
                        (
                            Region {
                                kind: MemKind::Dram,
                                desc: Desc::new(0x1000, 4096, 0),
                            },
                            vec![9; 24],
                        ),
                        (
                            Region {
                                kind: MemKind::Vram,
                                desc: Desc::new(0x7f00_0000, 1 << 20, 3),
                            },
                            vec![],
                        ),
                    ],
                },
                BackendSection {
                    backend: "VERBS".into(),
                    conn_info: None,
                    regions: vec![(
                        Region {
                            kind: MemKind::Dram,
                            desc: Desc::new(0x1000, 4096, 0),
                        },
                        vec![7; 8],
                    )],
                },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let meta = sample();
        let blob = meta.encode().unwrap();
        assert_eq!(AgentMetadata::decode(&blob).unwrap(), meta);
    }

    #[test]
    fn every_truncation_is_a_typed_error() {
        let blob = sample().encode().unwrap();
        for cut in 0..blob.len() {
            match AgentMetadata::decode(&blob[..cut]) {
                Err(Error::MalformedMetadata(_)) => {}
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn every_single_byte_corruption_is_handled() {
        let blob = sample().encode().unwrap();
        for i in 0..blob.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut bad = blob.clone();
                bad[i] ^= flip;
                // Either decodes to something or fails with the typed error; never panics.
                if let Err(e) = AgentMetadata::decode(&bad) {
                    assert!(matches!(e, Error::MalformedMetadata(_)), "{e:?}");
                }
            }
        }
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let mut blob = Vec::new();
        blob.extend_from_slice(MAGIC);
        blob.extend_from_slice(&VERSION.to_le_bytes());
        blob.extend_from_slice(&1u16.to_le_bytes());
        blob.push(b'a');
        blob.extend_from_slice(&1u16.to_le_bytes());
        blob.push(1);
        blob.push(b'X');
        blob.push(TAG_REGIONS);
        blob.extend_from_slice(&4u32.to_le_bytes());
        blob.extend_from_slice(&u32::MAX.to_le_bytes());
        let err = AgentMetadata::decode(&blob).unwrap_err();
        assert!(err.to_string().contains("cannot fit"), "{err}");
    }

    #[test]
    fn unknown_sections_are_skipped() {
        let mut meta = sample();
        meta.sections.truncate(1);
        let mut blob = meta.encode().unwrap();
        // Append a section with an unknown tag and bump the count.
        put_section(&mut blob, "FUTURE", 99, b"whatever").unwrap();
        let at = MAGIC.len() + 2 + 2 + meta.agent.len();
        let n = u16::from_le_bytes([blob[at], blob[at + 1]]) + 1;
        blob[at..at + 2].copy_from_slice(&n.to_le_bytes());
        let decoded = AgentMetadata::decode(&blob).unwrap();
        assert_eq!(decoded.sections[0], meta.sections[0]);
        assert!(decoded
            .sections
            .iter()
            .all(|s| s.regions.is_empty() || s.backend != "FUTURE"));
    }

    #[test]
    fn bad_magic_version_and_region_are_rejected() {
        let blob = sample().encode().unwrap();
        let mut bad = blob.clone();
        bad[0] = b'X';
        assert!(AgentMetadata::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut bad = blob.clone();
        bad[6] = 9;
        assert!(AgentMetadata::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("version"));
        let mut meta = sample();
        meta.sections[0].regions[0].0.desc.len = 0;
        let bad = meta.encode().unwrap();
        assert!(AgentMetadata::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("length zero"));
    }
}
