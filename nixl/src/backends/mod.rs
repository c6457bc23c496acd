//! The backends built into this crate, each behind its own feature, and the registry
//! that names them.
//!
//! Every backend is built from a [`BackendInit`](crate::backend::BackendInit) and sees
//! the agent through nothing else; the agent core imports no module of this one. Shared
//! backend support (`shared`, `staging`, `heartbeat`) depends on the backend interface
//! only. Siblings meet through interfaces too: `GPUNETIO` reaches peers' VRAM through
//! `CUDA_IPC`'s control plane through the `ipc_plane` interface, not through its backend
//! type.
//!
//! | feature | backends | links |
//! |---|---|---|
//! | (none) | `LOCAL` (DRAM), `FAULT` | nothing beyond `libc` |
//! | `libfabric` (default) | `LIBFABRIC` | libfabric |
//! | `verbs` (default) | `VERBS` | libibverbs |
//! | `cuda` | `CUDA_IPC`, VRAM in `LOCAL`, `LIBFABRIC` and `VERBS` | the CUDA driver, at run time |
//! | `gpunetio` | `GPUNETIO` | the CUDA driver at run time, libfabric |
//! | `file` | `FILE` | an `hf3fs-gdr` daemon's protocol |
//! | `posix` | `POSIX` | nothing beyond `libc` |
//!
//! Features rather than one crate per backend: the backends share the staging engine,
//! the heartbeat monitor and the notification bookkeeping, which would otherwise be a
//! published crate of internals with no user of its own; a feature gives the user who
//! wants only the core the same build (no transport library linked, checked in CI with
//! the RDMA headers hidden) and keeps one version of the interface.

use crate::backend::BackendRegistry;

// Shared support serves several backends: a build with only some of them leaves parts
// of it unused, hence the `allow(dead_code)` of partial builds below.
#[cfg(feature = "cuda")]
#[cfg_attr(
    not(all(feature = "libfabric", feature = "verbs", feature = "gpunetio")),
    allow(dead_code)
)]
mod cuda_copy;
#[cfg(feature = "cuda")]
pub mod cuda_ipc;
pub mod fault;
#[cfg(feature = "file")]
pub mod file;
#[cfg(feature = "gpunetio")]
pub mod gpunetio;
#[cfg(any(feature = "libfabric", feature = "verbs", feature = "gpunetio"))]
#[cfg_attr(not(all(feature = "libfabric", feature = "verbs")), allow(dead_code))]
pub(crate) mod heartbeat;
/// Fuzzing entry point (not a stable API): the heartbeat hub's decoders.
#[cfg(any(feature = "libfabric", feature = "verbs", feature = "gpunetio"))]
#[doc(hidden)]
pub use heartbeat::fuzz_message as fuzz_heartbeat_message;
#[cfg(feature = "cuda")]
#[cfg_attr(not(feature = "gpunetio"), allow(dead_code))]
mod ipc_plane;
#[cfg(feature = "libfabric")]
pub mod libfabric;
/// Whether a same-host peer's process still runs (or is being killed), asked of the OS;
/// shared by LIBFABRIC and VERBS.
#[cfg(any(feature = "libfabric", feature = "verbs"))]
#[cfg_attr(not(all(feature = "libfabric", feature = "verbs")), allow(dead_code))]
pub(crate) mod liveness;
pub mod local;
/// Direct VRAM ↔ same-host peer DRAM copies, shared by LIBFABRIC and GPUNETIO.
#[cfg(any(feature = "libfabric", feature = "gpunetio"))]
pub(crate) mod peer_dram;
#[cfg(any(feature = "libfabric", feature = "gpunetio"))]
#[doc(hidden)]
pub use peer_dram::fuzz_lane;
#[cfg(feature = "posix")]
pub mod posix;
#[cfg_attr(
    not(all(
        feature = "libfabric",
        feature = "verbs",
        feature = "cuda",
        feature = "file"
    )),
    allow(dead_code)
)]
pub(crate) mod shared;
#[cfg(any(feature = "libfabric", feature = "verbs", feature = "cuda"))]
#[cfg_attr(
    not(all(feature = "libfabric", feature = "verbs", feature = "cuda")),
    allow(dead_code)
)]
pub mod staging;
#[cfg(feature = "verbs")]
pub mod verbs;

/// The backends built into this crate with the features enabled, by NIXL's names:
/// what [`crate::Agent::new`] creates backends from.
pub fn builtin_registry() -> BackendRegistry {
    let entries: &[(&'static str, crate::backend::CreateBackend)] = &[
        #[cfg(feature = "cuda")]
        (cuda_ipc::NAME, cuda_ipc::create),
        (fault::NAME, fault::create),
        #[cfg(feature = "file")]
        (file::NAME, file::create),
        #[cfg(feature = "gpunetio")]
        (gpunetio::NAME, gpunetio::create),
        #[cfg(feature = "libfabric")]
        (libfabric::NAME, libfabric::create),
        (local::NAME, local::create),
        #[cfg(feature = "posix")]
        (posix::NAME, posix::create),
        #[cfg(feature = "verbs")]
        (verbs::NAME, verbs::create),
    ];
    let mut registry = BackendRegistry::new();
    for (name, create) in entries {
        // Distinct constant names: registration cannot fail.
        let _ = registry.register(name, *create);
    }
    registry
}
