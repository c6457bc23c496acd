//! Request sequences on one daemon connection, with and without a descriptor
//! (`hf3fs_gdr::daemon::fuzz::fuzz_daemon_requests`): every reply a value or a −errno,
//! no panic, and the session released as if its client died.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(hf3fs_gdr::daemon::fuzz::fuzz_daemon_requests(data));
});
