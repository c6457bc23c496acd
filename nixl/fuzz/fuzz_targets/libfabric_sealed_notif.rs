//! A sealed LIBFABRIC notification (`NXNS seq tag inner`): splitting it, opening it under
//! a pair key (a forged tag never opens; a frame that opens is a replay the second
//! time), and the replay window against a model
//! (`nixl::backends::libfabric::fuzz_sealed_notif`). Never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(nixl::backends::libfabric::fuzz_sealed_notif(data));
    // Behind the magic, so the fields are reached without the fuzzer finding it first.
    let mut framed = b"NXNS".to_vec();
    framed.extend_from_slice(data);
    assert!(nixl::backends::libfabric::fuzz_sealed_notif(&framed));
});
