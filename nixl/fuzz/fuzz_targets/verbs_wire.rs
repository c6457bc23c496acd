//! What a peer sends `VERBS`: connection information and region metadata, the side
//! channel's handshake and reply, notification messages, staged requesters' names
//! (`nixl::backends::verbs::fuzz_wire_message`). Never a panic, and what decodes
//! encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(nixl::backends::verbs::fuzz_wire_message(data));
    // Behind each magic, so the fields are reached without the fuzzer finding it first.
    for prefix in [
        b"NXVC\x03".as_slice(),
        b"NXVH\x03".as_slice(),
        b"NXVR\x03".as_slice(),
        b"NXVN".as_slice(),
    ] {
        let mut framed = prefix.to_vec();
        framed.extend_from_slice(data);
        assert!(nixl::backends::verbs::fuzz_wire_message(&framed));
    }
});
