//! What anyone may send to a LIBFABRIC rail: notification messages, READ assist
//! messages and direct VRAM copy messages, plain or sealed (`nixl::backends::libfabric::fuzz_rail_message`). Never a panic, and what
//! decodes encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(nixl::backends::libfabric::fuzz_rail_message(data));
    // Behind each magic, so the fields are reached without the fuzzer finding it first.
    for magic in [b"NXNT", b"NXNS", b"NXCM", b"NXPV", b"NXRS"] {
        let mut framed = magic.to_vec();
        framed.extend_from_slice(data);
        assert!(nixl::backends::libfabric::fuzz_rail_message(&framed));
    }
});
