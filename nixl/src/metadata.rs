//! The metadata blob: a versioned binary format with one section per backend, sealed
//! by an integrity check over the whole blob.
//!
//! ```text
//! blob    = "NIXLMD" version:u16le body_len:u32le check:u32le body[body_len]
//! body    = name:str16 nsections:u16le section*
//! section = backend:str8 tag:u8 len:u32le payload[len]
//!   tag 1 = connection info: payload is the backend's opaque bytes
//!   tag 2 = memory regions:  count:u32le region*
//! region  = kind:u8 dev_id:u64le addr:u64le len:u64le md:bytes16
//! strN    = uN little-endian length + UTF-8 bytes;  bytes16 = u16le length + bytes
//! ```
//!
//! # Integrity
//! A flipped bit in an address, a remote key or a length would otherwise be taken at
//! face value and send transfers to the wrong place, so the version selects an integrity
//! check that [`AgentMetadata::decode`] verifies before it reads a single field of the
//! body. Version 2 (the only one written and read) uses CRC-32C (Castagnoli, the check
//! of iSCSI, ext4 and SCTP; [`crc32c`]) over every byte of the blob except the check
//! field itself. It catches every error burst of up to 32 bits (so every single-bit flip
//! and every overwritten 4-byte word), every truncation or extension (the header states
//! the body length), and other corruption with probability 1 − 2⁻³². It guards against
//! accidents (a bad NIC, memory, a storage or proxy bug), not against an attacker, who
//! can recompute it. Version 1 (no check) is refused with a message naming the version;
//! a future format bumps the version and may choose another check.
//!
//! The same blob is the full metadata ([`crate::Agent::local_metadata`]), the partial
//! metadata ([`crate::Agent::local_partial_metadata`]), the payload the peer-to-peer
//! listener carries (whose frames have a CRC-32C of their own) and the value stored in
//! etcd, so all four are covered.
//!
//! Unknown section tags and backends are skipped (their length is known), so newer
//! senders stay readable. Every length, count and offset is checked against what is
//! left of the blob before anything is allocated: a hostile blob costs at most its own
//! size, and gives [`Error::MalformedMetadata`], never a panic.

use crate::error::{Error, Result};
use crate::mem::{Desc, MemKind, Region};

const MAGIC: &[u8; 6] = b"NIXLMD";
/// The format version this crate writes and reads (2: CRC-32C over the whole blob).
pub const VERSION: u16 = 2;
/// Magic, version, body length and check.
const HEADER_BYTES: usize = MAGIC.len() + 2 + 4 + 4;
/// Where the check field sits in the header (it is left out of the checked bytes).
const CHECK_AT: usize = MAGIC.len() + 2 + 4;
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
        // Body length and check, filled in at the end.
        out.extend_from_slice(&[0; 8]);
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
        let body_len = (out.len() - HEADER_BYTES) as u32; // below MAX_METADATA_BYTES
        out[CHECK_AT - 4..CHECK_AT].copy_from_slice(&body_len.to_le_bytes());
        let check = blob_check(&out);
        out[CHECK_AT..HEADER_BYTES].copy_from_slice(&check.to_le_bytes());
        Ok(out)
    }

    /// Verifies the integrity check, then parses and validates a blob. A blob that fails
    /// the check is refused whole ([`Error::MalformedMetadata`] saying so): nothing of it
    /// is read.
    pub fn decode(blob: &[u8]) -> Result<Self> {
        let body = verify(blob)?;
        let mut r = Reader { buf: body, pos: 0 };
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
        if r.pos != body.len() {
            return Err(malformed(format!("{} trailing bytes", body.len() - r.pos)));
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

/// Checks size, magic, version, body length and the integrity check of `blob`, in that
/// order, and returns the body.
fn verify(blob: &[u8]) -> Result<&[u8]> {
    if blob.len() > MAX_METADATA_BYTES {
        return Err(malformed(format!(
            "{} bytes exceeds the {MAX_METADATA_BYTES}-byte limit",
            blob.len()
        )));
    }
    if blob.len() < MAGIC.len() || &blob[..MAGIC.len()] != MAGIC {
        return Err(malformed("not a metadata blob (bad magic)"));
    }
    let mut r = Reader { buf: blob, pos: 0 };
    r.take(MAGIC.len(), "magic")?;
    let version = r.u16("version")?;
    match version {
        VERSION => {}
        1 => {
            return Err(malformed(format!(
                "format version 1 has no integrity check and is refused; this build reads \
                 version {VERSION} (CRC-32C over the whole blob): upgrade the sender"
            )))
        }
        _ => {
            return Err(malformed(format!(
                "unsupported version {version} (this build reads {VERSION})"
            )))
        }
    }
    let body_len = r.u32("body length")? as usize;
    let stored = r.u32("integrity check")?;
    if body_len != r.remaining() {
        return Err(malformed(format!(
            "length mismatch: the header announces a {body_len}-byte body, {} bytes follow \
             (truncated or extended)",
            r.remaining()
        )));
    }
    let computed = blob_check(blob);
    if stored != computed {
        return Err(malformed(format!(
            "integrity check failed: CRC-32C {computed:#010x} of the blob does not match \
             the stored {stored:#010x} (the blob was corrupted)"
        )));
    }
    Ok(&blob[HEADER_BYTES..])
}

/// The version-2 check of a blob with a complete header: CRC-32C of every byte but the
/// check field.
fn blob_check(blob: &[u8]) -> u32 {
    crc32c_append(crc32c(&blob[..CHECK_AT]), &blob[HEADER_BYTES..])
}

/// CRC-32C (Castagnoli: reflected polynomial `0x82F63B78`, initial value and final XOR
/// `0xFFFFFFFF`; the check value of `b"123456789"` is `0xE3069283`), the integrity check
/// of metadata blobs and listener frames.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c_append(0, bytes)
}

/// Continues `crc` (a [`crc32c`] result) over `bytes`: `crc32c_append(crc32c(a), b)` is
/// the CRC-32C of `a` followed by `b`.
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    let mut crc = !crc;
    // Slicing-by-8: eight table lookups per 8 bytes (about 1-2 GB/s without SSE 4.2).
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let lo = crc ^ u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        crc = CRC_TABLES[7][(lo & 0xff) as usize]
            ^ CRC_TABLES[6][((lo >> 8) & 0xff) as usize]
            ^ CRC_TABLES[5][((lo >> 16) & 0xff) as usize]
            ^ CRC_TABLES[4][(lo >> 24) as usize]
            ^ CRC_TABLES[3][chunk[4] as usize]
            ^ CRC_TABLES[2][chunk[5] as usize]
            ^ CRC_TABLES[1][chunk[6] as usize]
            ^ CRC_TABLES[0][chunk[7] as usize];
    }
    for &byte in chunks.remainder() {
        crc = CRC_TABLES[0][((crc ^ byte as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// `CRC_TABLES[0]` is the byte-at-a-time table; `CRC_TABLES[k][b]` is the CRC of byte `b`
/// followed by `k` zero bytes.
static CRC_TABLES: [[u32; 256]; 8] = crc_tables();

const fn crc_tables() -> [[u32; 256]; 8] {
    const POLY: u32 = 0x82f6_3b78;
    let mut tables = [[0u32; 256]; 8];
    let mut b = 0;
    while b < 256 {
        let mut crc = b as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ POLY
            } else {
                crc >> 1
            };
            bit += 1;
        }
        tables[0][b] = crc;
        b += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut b = 0;
        while b < 256 {
            let prev = tables[k - 1][b];
            tables[k][b] = (prev >> 8) ^ tables[0][(prev & 0xff) as usize];
            b += 1;
        }
        k += 1;
    }
    tables
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

    /// A version-2 blob around `body`, with a correct check: for tests that build or
    /// edit a body by hand.
    fn seal(body: &[u8]) -> Vec<u8> {
        let mut blob = MAGIC.to_vec();
        blob.extend_from_slice(&VERSION.to_le_bytes());
        blob.extend_from_slice(&(body.len() as u32).to_le_bytes());
        blob.extend_from_slice(&[0; 4]);
        blob.extend_from_slice(body);
        let check = blob_check(&blob);
        blob[CHECK_AT..HEADER_BYTES].copy_from_slice(&check.to_le_bytes());
        blob
    }

    #[test]
    fn crc32c_matches_the_standard_check_values() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of 0xff, and ascending.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46dd_794e);
        // Slicing and appending agree with the whole, at every split and alignment.
        let data: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        let whole = crc32c(&data);
        for split in 0..data.len() {
            assert_eq!(crc32c_append(crc32c(&data[..split]), &data[split..]), whole);
        }
    }

    #[test]
    fn every_single_byte_corruption_is_refused() {
        let blob = sample().encode().unwrap();
        for i in 0..blob.len() {
            for flip in [0x01u8, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xff] {
                let mut bad = blob.clone();
                bad[i] ^= flip;
                match AgentMetadata::decode(&bad) {
                    Err(Error::MalformedMetadata(_)) => {}
                    other => panic!("byte {i} ^ {flip:#x} was not refused: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn a_body_corruption_names_the_integrity_check() {
        let blob = sample().encode().unwrap();
        // A bit of the last region's remote key: version 1 took it at face value.
        let mut bad = blob.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0x10;
        let err = AgentMetadata::decode(&bad).unwrap_err().to_string();
        assert!(err.contains("integrity check failed"), "{err}");
        let mut bad = blob.clone();
        bad[CHECK_AT] ^= 1;
        let err = AgentMetadata::decode(&bad).unwrap_err().to_string();
        assert!(err.contains("integrity check failed"), "{err}");
        let mut longer = blob.clone();
        longer.push(0);
        let err = AgentMetadata::decode(&longer).unwrap_err().to_string();
        assert!(err.contains("length mismatch"), "{err}");
    }

    #[test]
    fn version_1_blobs_are_refused_by_name() {
        // What version 1 wrote for an agent `a` with no sections.
        let mut v1 = MAGIC.to_vec();
        v1.extend_from_slice(&1u16.to_le_bytes());
        v1.extend_from_slice(&1u16.to_le_bytes());
        v1.push(b'a');
        v1.extend_from_slice(&0u16.to_le_bytes());
        let err = AgentMetadata::decode(&v1).unwrap_err().to_string();
        assert!(
            err.contains("version 1 has no integrity check") && err.contains("upgrade"),
            "{err}"
        );
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let mut body = Vec::new();
        body.extend_from_slice(&1u16.to_le_bytes());
        body.push(b'a');
        body.extend_from_slice(&1u16.to_le_bytes());
        body.push(1);
        body.push(b'X');
        body.push(TAG_REGIONS);
        body.extend_from_slice(&4u32.to_le_bytes());
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        let err = AgentMetadata::decode(&seal(&body)).unwrap_err();
        assert!(err.to_string().contains("cannot fit"), "{err}");
    }

    #[test]
    fn unknown_sections_are_skipped() {
        let mut meta = sample();
        meta.sections.truncate(1);
        let blob = meta.encode().unwrap();
        let mut body = blob[HEADER_BYTES..].to_vec();
        // Append a section with an unknown tag and bump the count.
        put_section(&mut body, "FUTURE", 99, b"whatever").unwrap();
        let at = 2 + meta.agent.len();
        let n = u16::from_le_bytes([body[at], body[at + 1]]) + 1;
        body[at..at + 2].copy_from_slice(&n.to_le_bytes());
        let decoded = AgentMetadata::decode(&seal(&body)).unwrap();
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
            .contains("unsupported version 9"));
        let mut meta = sample();
        meta.sections[0].regions[0].0.desc.len = 0;
        let bad = meta.encode().unwrap();
        assert!(AgentMetadata::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("length zero"));
    }

    #[test]
    fn a_large_blob_is_checked_quickly() {
        let meta = AgentMetadata {
            agent: "big".into(),
            sections: vec![BackendSection {
                backend: "LIBFABRIC".into(),
                conn_info: Some(vec![1; 64]),
                regions: (0..100_000u64)
                    .map(|i| {
                        (
                            Region {
                                kind: MemKind::Dram,
                                desc: Desc::new(0x1000 + i * 4096, 4096, 0),
                            },
                            vec![3; 24],
                        )
                    })
                    .collect(),
            }],
        };
        let blob = meta.encode().unwrap();
        let start = std::time::Instant::now();
        assert_eq!(AgentMetadata::decode(&blob).unwrap(), meta);
        eprintln!(
            "{} bytes ({} regions) verified and decoded in {:?}",
            blob.len(),
            meta.sections[0].regions.len(),
            start.elapsed()
        );
    }
}
