//! What a same-host peer may write into a shared lane (`nixl::backends::fuzz_lane`): its
//! indices and request slots. The other side never reads past a slot, never takes more
//! than a ringful, and pushes and pops afterwards without fault.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(nixl::backends::fuzz_lane(data));
});
