//! `AgentMetadata::decode` on arbitrary bytes: never a panic, never an allocation larger
//! than the input allows; what decodes re-encodes to the same value. The input is tried
//! twice: as a whole blob (the integrity check must refuse what `encode` did not make)
//! and as a body sealed with a correct check, so the parser behind the check is reached.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl::metadata::{crc32c, crc32c_append, AgentMetadata, VERSION};

/// A version-2 blob around `body`: magic, version, body length, CRC-32C, body.
fn seal(body: &[u8]) -> Vec<u8> {
    let mut blob = b"NIXLMD".to_vec();
    blob.extend_from_slice(&VERSION.to_le_bytes());
    blob.extend_from_slice(&(body.len() as u32).to_le_bytes());
    let check = crc32c_append(crc32c(&blob), body);
    blob.extend_from_slice(&check.to_le_bytes());
    blob.extend_from_slice(body);
    blob
}

fn round_trip(blob: &[u8]) {
    if let Ok(meta) = AgentMetadata::decode(blob) {
        let again = meta.encode().expect("a decoded blob re-encodes");
        assert_eq!(AgentMetadata::decode(&again).expect("re-decodes"), meta);
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip(data);
    round_trip(&seal(data));
});
