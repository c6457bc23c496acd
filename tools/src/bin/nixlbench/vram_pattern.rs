//! The data pattern written into VRAM by a kernel (`pattern.cu`, compiled with NVRTC on
//! first use and kept per GPU): a VRAM target of tens of GiB is filled at the GPU's
//! memory bandwidth instead of through host pieces copied over PCIe. Without NVRTC the
//! caller copies host pieces instead ([`fill`] answers `Ok(false)`).

use crate::mem::pattern_bytes;
use gpunetio::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use gpunetio::gpu_mem::device_code::{compile, nvrtc_available, CompileOptions};
use gpunetio::DeviceBuffer;
use parking_lot::Mutex;

/// The kernel's source.
pub(crate) const SOURCE: &str = include_str!("pattern.cu");
/// Its entry point.
const ENTRY: &str = "nixlbench_pattern";
/// Threads per block of the fill.
const THREADS: u32 = 256;
/// Blocks of the fill: enough to keep every SM busy; the kernel strides over the rest.
const BLOCKS: u32 = 4096;

/// The loaded kernel of each GPU (by ordinal): compiled once per process and GPU.
static KERNELS: Mutex<Vec<(usize, CudaFunction)>> = Mutex::new(Vec::new());

fn kernel(buf: &DeviceBuffer) -> Result<CudaFunction, String> {
    let gpu = buf.gpu();
    let mut kernels = KERNELS.lock();
    if let Some((_, f)) = kernels.iter().find(|(o, _)| *o == gpu.ordinal()) {
        return Ok(f.clone());
    }
    let options = CompileOptions::for_gpu(gpu).map_err(|e| e.to_string())?;
    let ptx = compile("pattern.cu", SOURCE, &options).map_err(|e| e.to_string())?;
    let module = gpu
        .context()
        .load_module(ptx)
        .map_err(|e| format!("loading the pattern kernel: {e:?}"))?;
    let f = module
        .load_function(ENTRY)
        .map_err(|e| format!("{ENTRY}: {e:?}"))?;
    kernels.push((gpu.ordinal(), f.clone()));
    Ok(f)
}

/// Writes the pattern `seed` over `[offset, offset + len)` of `buf`: the whole words by
/// the kernel, the bytes before the first and after the last word boundary from the
/// host. `Ok(false)`: NVRTC is not there, nothing was written.
pub(crate) fn fill(
    buf: &DeviceBuffer,
    offset: usize,
    len: usize,
    seed: u64,
) -> Result<bool, String> {
    if !nvrtc_available() {
        return Ok(false);
    }
    let end = offset + len;
    let first = offset.next_multiple_of(8).min(end);
    let last = (end / 8 * 8).max(first);
    for (at, n) in [(offset, first - offset), (last, end - last)] {
        if n > 0 {
            buf.copy_from_host(at, &pattern_bytes(seed, at, n))
                .map_err(|e| e.to_string())?;
        }
    }
    let words = ((last - first) / 8) as u64;
    if words == 0 {
        return Ok(true);
    }
    let f = kernel(buf)?;
    let stream = buf.gpu().context().default_stream();
    let dst = buf.ptr() + first as u64;
    let first_word = (first / 8) as u64;
    let blocks = (words.div_ceil(u64::from(THREADS))).min(u64::from(BLOCKS)) as u32;
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&f);
    launch.arg(&dst).arg(&first_word).arg(&words).arg(&seed);
    // SAFETY: nixlbench_pattern(u64 *dst, u64, u64, u64) writes `words` words from
    // `dst`, which are inside `buf` (`[first, last)` of it, 8-byte aligned as the
    // allocation is); the synchronize below ends the kernel before `buf` can go.
    unsafe { launch.launch(config) }.map_err(|e| format!("launching {ENTRY}: {e:?}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("{ENTRY}: {e:?}"))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel compiles for the GPUs we meet (CI sets GPUNETIO_REQUIRE_NVRTC=1 with
    /// NVRTC installed; elsewhere this skips with the reason).
    #[test]
    fn the_pattern_kernel_compiles() {
        if !nvrtc_available() {
            let required = std::env::var("GPUNETIO_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "NVRTC is required here but libnvrtc does not load"
            );
            eprintln!("skipped: libnvrtc is not installed (cargo xtask nvrtc fetches it)");
            return;
        }
        for arch in ["compute_80", "compute_90"] {
            let options = CompileOptions {
                arch: arch.into(),
                ..CompileOptions::default()
            };
            compile("pattern.cu", SOURCE, &options).unwrap_or_else(|e| panic!("{arch}: {e}"));
        }
    }
}
