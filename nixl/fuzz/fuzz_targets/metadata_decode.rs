//! `AgentMetadata::decode` on arbitrary bytes: never a panic, never an allocation larger
//! than the input allows; what decodes re-encodes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl::metadata::AgentMetadata;

fuzz_target!(|data: &[u8]| {
    if let Ok(meta) = AgentMetadata::decode(data) {
        let blob = meta.encode().expect("a decoded blob re-encodes");
        assert_eq!(AgentMetadata::decode(&blob).expect("re-decodes"), meta);
    }
});
