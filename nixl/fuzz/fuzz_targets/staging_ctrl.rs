//! What any peer may send to a staging rail: the staging protocol's control messages
//! (OFFER, FETCH, DONE, FETCHED; `nixl::backends::staging::fuzz_ctrl_message`). Never a panic,
//! and what decodes re-encodes to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(nixl::backends::staging::fuzz_ctrl_message(data));
    // Behind each magic, so the fields are reached without the fuzzer finding it first.
    for prefix in [
        b"NXST\x01\x01".as_slice(),
        b"NXST\x01\x02".as_slice(),
        b"NXST\x01\x03".as_slice(),
        b"NXST\x01\x04".as_slice(),
    ] {
        let mut framed = prefix.to_vec();
        framed.extend_from_slice(data);
        assert!(nixl::backends::staging::fuzz_ctrl_message(&framed));
    }
});
