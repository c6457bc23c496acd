//! What a producer (a GPU kernel, or anything that can write the ring's memory) leaves
//! in a proxy ring slot: the image decoding and the proxy's validation
//! (`gpunetio::proxy::fuzz_ring_entry`). Never a panic; an accepted entry stays inside
//! the regions and counters it names; the image encoding round trips.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(gpunetio::proxy::fuzz_ring_entry(data));
});
