//! The write-and-signal kernels (`nixl/device/nixl_write_signal.cu`) as the GPUNETIO tests
//! use them: the data pattern they write and check, and their module.
#![cfg(feature = "gpunetio")]

use gpunetio::cudarc::driver::{CudaFunction, CudaModule};
use gpunetio::Gpu;
use nixl::device;
use std::sync::Arc;

/// Byte `i` of slice `r` (as `pattern()` in nixl_write_signal.cu).
pub fn pattern_byte(r: u64, i: u64, seed: u32) -> u8 {
    ((i.wrapping_mul(131) + r * 7 + u64::from(seed)) ^ (i >> 9)) as u8
}

/// The first `len` bytes the kernels write with `seed`, in slices of `slice` bytes.
pub fn expected(len: u64, slice: u64, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|k| pattern_byte(k / slice, k % slice, seed))
        .collect()
}

/// The kernels, compiled with NVRTC for `gpu` and loaded.
pub fn module(gpu: &Gpu) -> Arc<CudaModule> {
    let (name, src) = device::DEVICE_SOURCES
        .iter()
        .find(|(n, _)| *n == "nixl_write_signal.cu")
        .unwrap();
    let ptx = gpunetio::device_code::compile(name, src, &device::compile_options(gpu).unwrap())
        .expect("the example's kernels compile");
    gpu.context().load_module(ptx).unwrap()
}

/// Kernel `name` of the module.
pub fn function(m: &Arc<CudaModule>, name: &str) -> CudaFunction {
    m.load_function(name).unwrap()
}
