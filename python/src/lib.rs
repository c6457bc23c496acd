//! `rdma_nixl._core`: the Rust side of the `rdma_nixl` Python package.
//!
//! The classes here ([`agent::Agent`], [`xfer::Dlist`], [`xfer::Xfer`],
//! [`device::GpuHandle`]) are thin wrappers over the `nixl` crate;
//! `rdma_nixl/_agent.py` builds NIXL's low-level `nixlAgent` (camelCase methods, int
//! handles) on them and `rdma_nixl/_api.py` NIXL's Python API (`nixl_agent`,
//! `nixl_agent_config`) on that, with NIXL's signatures, defaults and return values;
//! `rdma_nixl/device.py` has the device API's helpers (headers, compile options, kernel
//! arguments). [`etcd`] routes the metadata calls without an address to etcd
//! (`NIXL_ETCD_ENDPOINTS`). [`telemetry::TelemetryRing`] writes NIXL's telemetry ring file. Errors
//! are raised as NIXL's exception classes ([`errors`]).

mod agent;
mod descs;
mod device;
mod errors;
mod etcd;
mod telemetry;
mod xfer;

use pyo3::prelude::*;

/// Keeps the caller's current CUDA context across a call into the agent: the agent binds
/// the contexts of the GPUs it uses to the calling thread, and torch's or CuPy's current
/// device follows the current context (an agent created after `torch.cuda.set_device(1)`
/// must not move later allocations to GPU 0).
#[cfg(feature = "cuda")]
pub(crate) fn keep_cuda_context() -> gpunetio::gpu_mem::ContextScope {
    gpunetio::gpu_mem::ContextScope::save()
}

/// Without CUDA there is no context to keep.
#[cfg(not(feature = "cuda"))]
pub(crate) struct NoCudaContext;

/// Without CUDA there is no context to keep.
#[cfg(not(feature = "cuda"))]
pub(crate) fn keep_cuda_context() -> NoCudaContext {
    NoCudaContext
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<agent::Agent>()?;
    m.add_class::<xfer::Dlist>()?;
    m.add_class::<xfer::Xfer>()?;
    m.add_class::<device::GpuHandle>()?;
    m.add_class::<telemetry::TelemetryRing>()?;
    m.add_function(wrap_pyfunction!(descs::pack_descs, m)?)?;
    m.add_function(wrap_pyfunction!(descs::pack_indices, m)?)?;
    m.add_function(wrap_pyfunction!(device::prep_gpu_signal, m)?)?;
    m.add_function(wrap_pyfunction!(device::gpu_arch, m)?)?;
    m.add_function(wrap_pyfunction!(device::gpu_count, m)?)?;
    m.add_function(wrap_pyfunction!(device::device_api_unavailable, m)?)?;
    m.add_function(wrap_pyfunction!(device::_test_gpu_handle, m)?)?;
    m.add_function(wrap_pyfunction!(device::_test_released, m)?)?;
    m.add("GPU_SIGNAL_SIZE", device::GPU_SIGNAL_SIZE)?;
    m.add("GPU_HANDLE_SIZE", device::RAW_SIZE)?;
    m.add("DEVICE_HEADERS", device::headers())?;
    errors::add_to(m)?;
    m.add("CUDA", cfg!(feature = "cuda"))?;
    m.add("ETCD", etcd::AVAILABLE)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
