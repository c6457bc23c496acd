//! The heartbeat hub's decoders: its address block in metadata, a watcher's handshake
//! head and a hub's answer (`nixl::backends::fuzz_heartbeat_message`). Never a panic,
//! and a decoded address block encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(nixl::backends::fuzz_heartbeat_message(data));
    // Behind each magic, so the fields are reached without the fuzzer finding it first.
    for prefix in [b"NXHB\x01".as_slice()] {
        let mut framed = prefix.to_vec();
        framed.extend_from_slice(data);
        assert!(nixl::backends::fuzz_heartbeat_message(&framed));
    }
});
