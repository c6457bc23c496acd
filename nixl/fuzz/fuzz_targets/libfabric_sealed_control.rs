//! A sealed LIBFABRIC rail control message (`NXRS seq tag public name inner`): splitting
//! it, opening it under a pair key and as a channel with a sender the receiver never
//! loaded (a forged tag never opens; a frame that opens is a replay the second time), and
//! sealing any bytes as a control message, which must split back and open exactly once
//! (`nixl::backends::libfabric::fuzz_sealed_control`). Never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(nixl::backends::libfabric::fuzz_sealed_control(data));
    // Behind the magic, so the fields are reached without the fuzzer finding it first.
    let mut framed = b"NXRS".to_vec();
    framed.extend_from_slice(data);
    assert!(nixl::backends::libfabric::fuzz_sealed_control(&framed));
});
