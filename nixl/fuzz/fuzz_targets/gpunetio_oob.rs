//! What peers send `GPUNETIO`: a sender's stream on the out-of-band notification
//! channel, a NIC path's connection information and a remote memory descriptor
//! (`nixl::backends::gpunetio::fuzz_oob_message`). Never a panic, never an allocation
//! beyond the frame limit, and what decodes encodes back.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(nixl::backends::gpunetio::fuzz_oob_message(data));
    // Behind each magic, so the fields are reached without the fuzzer finding it first.
    for prefix in [b"GIOD\x01".as_slice()] {
        let mut framed = prefix.to_vec();
        framed.extend_from_slice(data);
        assert!(nixl::backends::gpunetio::fuzz_oob_message(&framed));
    }
});
