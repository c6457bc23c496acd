//! Ring entries as a client writes them, run by the daemon's ring thread and worker
//! (`hf3fs_gdr::daemon::fuzz::fuzz_ring_entries`): each completes exactly once, in time,
//! with −errno or at most its length.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(hf3fs_gdr::daemon::fuzz::fuzz_ring_entries(data));
});
