//! `rdma_nixl._core`: the Rust side of the `rdma_nixl` Python package.
//!
//! The classes here ([`agent::Agent`], [`xfer::Dlist`], [`xfer::Xfer`]) are thin
//! wrappers over the `nixl` crate; `rdma_nixl/_api.py` builds NIXL's Python API
//! (`nixl_agent`, `nixl_agent_config`) on them, with NIXL's signatures, defaults and
//! return values. Errors are raised as NIXL's exception classes ([`errors`]).

mod agent;
mod descs;
mod errors;
mod xfer;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<agent::Agent>()?;
    m.add_class::<xfer::Dlist>()?;
    m.add_class::<xfer::Xfer>()?;
    errors::add_to(m)?;
    m.add("CUDA", cfg!(feature = "cuda"))?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
