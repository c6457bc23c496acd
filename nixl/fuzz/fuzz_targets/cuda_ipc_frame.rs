//! What reaches a `CUDA_IPC` agent from other processes: its connection information
//! and the frames on its notification socket (`nixl::backends::cuda_ipc::fuzz_socket_frame`).
//! Never a panic, and what decodes encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(nixl::backends::cuda_ipc::fuzz_socket_frame(data));
    // Behind each magic, so the fields are reached without the fuzzer finding it first.
    for prefix in [
        b"\x01".as_slice(),
        b"\x02".as_slice(),
        b"CIPC\x02".as_slice(),
    ] {
        let mut framed = prefix.to_vec();
        framed.extend_from_slice(data);
        assert!(nixl::backends::cuda_ipc::fuzz_socket_frame(&framed));
    }
});
