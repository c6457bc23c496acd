//! The P2P listener's request path on arbitrary connection bytes: frame parsing, the
//! request types (metadata push, fetch, invalidate) against a live agent, and the reply
//! framing. Never a panic. The input is served twice: as raw connection bytes (the
//! frame's integrity check must refuse what was not framed) and, from its first byte
//! (the request type) and the rest (the payload; for a metadata push, a blob body sealed
//! with a correct check), as a correctly checked frame, so the request handlers run.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl::metadata::{crc32c, crc32c_append, VERSION};
use nixl::{Agent, AgentConfig};
use std::sync::OnceLock;

const SEND_MD: u8 = 1;

fn agent() -> &'static Agent {
    static AGENT: OnceLock<Agent> = OnceLock::new();
    AGENT.get_or_init(|| {
        let agent = Agent::new("fuzz-listener", AgentConfig::default()).expect("agent");
        agent
            .create_backend("LOCAL", &Default::default())
            .expect("LOCAL backend");
        agent
    })
}

/// A version-2 metadata blob around `body`.
fn seal(body: &[u8]) -> Vec<u8> {
    let mut blob = b"NIXLMD".to_vec();
    blob.extend_from_slice(&VERSION.to_le_bytes());
    blob.extend_from_slice(&(body.len() as u32).to_le_bytes());
    let check = crc32c_append(crc32c(&blob), body);
    blob.extend_from_slice(&check.to_le_bytes());
    blob.extend_from_slice(body);
    blob
}

/// A version-2 listener frame: "NXP2" type len CRC-32C payload.
fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = b"NXP2".to_vec();
    f.push(kind);
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    let check = crc32c_append(crc32c(&f), payload);
    f.extend_from_slice(&check.to_le_bytes());
    f.extend_from_slice(payload);
    f
}

fuzz_target!(|data: &[u8]| {
    let agent = agent();
    nixl::fuzz_serve(agent, data);
    agent.invalidate_all_remotes();
    if let Some((&kind, rest)) = data.split_first() {
        let payload = if kind == SEND_MD {
            seal(rest)
        } else {
            rest.to_vec()
        };
        nixl::fuzz_serve(agent, &frame(kind, &payload));
        // Metadata pushed by the input is forgotten, so runs stay independent.
        agent.invalidate_all_remotes();
    }
});
