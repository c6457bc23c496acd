//! Compiling kernels that use gpunetio's device library: [`gpu_mem`]'s NVRTC compile with
//! the library's headers (`gpunetio/gio_device.cuh`, `gpunetio/gio_abi.h`,
//! `gpunetio/gio_mlx5.cuh`, from `gpunetio-sys`) includable. Builds need no CUDA toolkit.

use cudarc::nvrtc::Ptx;
pub use gpu_mem::device_code::{nvrtc_available, nvrtc_version, CompileOptions};

/// Compiles `source` (named `name` in messages) to PTX with the device library's headers
/// includable, besides the headers and include folders of `options` (a header of
/// `options` with the name of a library header replaces it).
pub fn compile(name: &str, source: &str, options: &CompileOptions) -> gpu_mem::Result<Ptx> {
    let mut with_library = options.clone();
    with_library.headers = gpunetio_sys::HEADERS
        .iter()
        .map(|&(n, h)| (n.into(), h.into()))
        .chain(options.headers.iter().cloned())
        .collect();
    gpu_mem::device_code::compile(name, source, &with_library)
}
