//! The P2P listener's request path on arbitrary connection bytes: frame parsing, the
//! request types (metadata push, fetch, invalidate) against a live agent, and the reply
//! framing. Never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl::{Agent, AgentConfig};
use std::sync::OnceLock;

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

fuzz_target!(|data: &[u8]| {
    let agent = agent();
    nixl::fuzz_serve(agent, data);
    // Metadata pushed by the input is forgotten, so runs stay independent.
    agent.invalidate_all_remotes();
});
