//! The data pattern written into VRAM by a kernel (`pattern.cu`, compiled with NVRTC on
//! first use and kept per GPU): a VRAM target of tens of GiB is filled at the GPU's
//! memory bandwidth instead of through host pieces copied over PCIe. Without NVRTC the
//! caller copies host pieces instead ([`fill`] answers `Ok(false)`).

use crate::mem::pattern_bytes;
use gpunetio::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use gpunetio::gpu_mem::device_code::{compile, nvrtc_available, CompileOptions};
use gpunetio::DeviceBuffer;
use parking_lot::Mutex;
use std::sync::Arc;

/// The kernel's source.
pub(crate) const SOURCE: &str = include_str!("pattern.cu");
/// Its entry point.
const ENTRY: &str = "nixlbench_pattern";
/// Threads per block of the fill.
const THREADS: u32 = 256;
/// Blocks of the fill: enough to keep every SM busy; the kernel strides over the rest.
const BLOCKS: u32 = 4096;

/// A GPU's loaded kernel and the stream it runs on.
#[derive(Clone)]
struct Filler {
    kernel: CudaFunction,
    /// A non-blocking stream of its own: a fill during the sweep (`--check_consistency`
    /// with several threads) does not wait for, or hold up, other threads' transfers the
    /// way the legacy default stream would.
    stream: Arc<CudaStream>,
}

/// The filler of each GPU (by ordinal): compiled once per process and GPU.
static FILLERS: Mutex<Vec<(usize, Filler)>> = Mutex::new(Vec::new());

fn filler(buf: &DeviceBuffer) -> Result<Filler, String> {
    let gpu = buf.gpu();
    let mut fillers = FILLERS.lock();
    if let Some((_, f)) = fillers.iter().find(|(o, _)| *o == gpu.ordinal()) {
        return Ok(f.clone());
    }
    let options = CompileOptions::for_gpu(gpu).map_err(|e| e.to_string())?;
    let ptx = compile("pattern.cu", SOURCE, &options).map_err(|e| e.to_string())?;
    let module = gpu
        .context()
        .load_module(ptx)
        .map_err(|e| format!("loading the pattern kernel: {e:?}"))?;
    let kernel = module
        .load_function(ENTRY)
        .map_err(|e| format!("{ENTRY}: {e:?}"))?;
    let stream = gpu.new_stream().map_err(|e| e.to_string())?;
    let f = Filler { kernel, stream };
    fillers.push((gpu.ordinal(), f.clone()));
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
    let Filler { kernel, stream } = filler(buf)?;
    let dst = buf.ptr() + first as u64;
    let first_word = (first / 8) as u64;
    let blocks = (words.div_ceil(u64::from(THREADS))).min(u64::from(BLOCKS)) as u32;
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&kernel);
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
