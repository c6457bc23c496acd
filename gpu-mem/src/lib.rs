//! GPU memory for RDMA and for sharing between processes, over [`cudarc`] with the CUDA
//! driver (and NVRTC) loaded at run time: the memory layer of DOCA GPUNetIO's host API
//! (`doca_gpu_create`, `doca_gpu_mem_alloc`, `doca_gpu_dmabuf_fd`), without its networking.
//!
//! The crate links nothing: it builds, and its docs build, on a machine with no CUDA at
//! all; every call returns [`Error::NoDriver`] there, and [`is_available`] says whether a
//! driver loads. Storage (`hf3fs-gdr`), transfer agents (`nixl`'s VRAM paths) and
//! GPU-initiated networking (`gpunetio`, which builds on this crate) use it.
//!
//! - [`Gpu`]: open by ordinal or PCI bus id; name, UUID, bus id, compute capability, and
//!   whether DMA-BUF, GPUDirect RDMA and VMM are supported; [`device_count`],
//!   [`find_by_uuid`], [`format_uuid`].
//! - [`peer_topology`] / [`enable_peer_access`] / [`current_device`]: how two GPUs reach
//!   each other (peer access, the driver's rank of the link, native atomics, NVLink where
//!   NVML is installed), turning peer access on between their primary contexts, and the
//!   device of the thread's current context.
//! - [`DeviceBuffer`]: exportable device memory — `cuMemAlloc` (CUDA-IPC handle) or VMM
//!   `cuMemCreate` (POSIX fd) — never cudarc's stream-ordered pool, which cannot be
//!   exported; [`DmaBuf`] fd export for NIC registration (`ibv_reg_dmabuf_mr`).
//! - [`IpcHandle`] / [`IpcMapping`], [`VmmExport`] / [`VmmMapping`], [`send_vmm`] /
//!   [`recv_vmm`] ([`send_fds`] / [`recv_fds`] underneath): share device memory between
//!   processes of one node; importing returns a mapping closed on drop.
//! - [`HostBuffer`] / [`HostRegistration`]: pinned, portable, mapped host memory,
//!   allocated or registered in place, with its device pointer.
//! - [`pointer_info`] / [`check_device_range`] / [`DeviceMemoryRef`]: classify any pointer
//!   (pageable, pinned, device, managed; which GPU; which allocation) and borrow memory a
//!   framework (torch, CuPy) owns.
//! - [`device_code`]: compile CUDA C with NVRTC at run time, the headers it includes
//!   passed in as strings or folders.
//! - [`cvt`] / [`cvt_ctx`]: this crate's typed error for a raw driver call made through
//!   [`cudarc::driver::sys`].
//!
//! ```no_run
//! use gpu_mem::{DeviceBuffer, Gpu, IpcMapping};
//! # fn main() -> gpu_mem::Result<()> {
//! let gpu = Gpu::open(0)?;
//! let buf = DeviceBuffer::alloc(&gpu, 1 << 20)?;
//! buf.copy_from_host(0, b"hello")?;
//! let handle = buf.export_ipc()?; // 64 bytes: send them to another process
//! // ... there:
//! let mapping = IpcMapping::open(&gpu, &handle)?;
//! assert!(mapping.len() >= 1 << 20);
//! # Ok(()) }
//! ```
//!
//! # Tests
//! Tests that need a GPU are named `gpu_*` (the GPU machine's bundle runs them) and take
//! their GPU from [`gpu_for_test`]: without one they print why and skip, unless
//! `NIXL_REQUIRE_GPU=1` says the machine must have one ([`gpu_required`]), where they
//! fail.

// docs.rs (nightly) marks what each feature adds.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod device_buffer;
pub mod device_code;
mod error;
mod gpu;
mod host_buffer;
mod ipc;
mod nvml;
mod pointer;
mod topology;
mod vmm;

pub use cudarc;
pub use device_buffer::{DeviceBuffer, DmaBuf, DEVICE_BUFFER_ALIGN};
pub use error::{cvt, cvt_ctx, Error, Result};
pub use gpu::{device_count, find_by_uuid, format_uuid, is_available, ContextScope, Gpu};
pub use host_buffer::{HostBuffer, HostRegistration};
pub use ipc::{
    recv_fds, recv_vmm, send_fds, send_vmm, try_recv_fds, IpcHandle, IpcMapping, VmmExport,
    VmmMapping, IPC_HANDLE_BYTES, MAX_FDS_PER_MESSAGE,
};
pub use pointer::{check_device_range, pointer_info, DeviceMemoryRef, MemoryKind, PointerInfo};
pub use topology::{current_device, enable_peer_access, peer_topology, PeerLink, PeerTopology};

/// For GPU tests: whether the suite must have a GPU (`NIXL_REQUIRE_GPU=1` on the GPU
/// machine) and so fail rather than skip when none is found.
pub fn gpu_required() -> bool {
    std::env::var("NIXL_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// For GPU tests that need `n` GPUs: GPUs 0..n, or `None` after printing why the test is
/// skipped. Panics (fails the test) instead when [`gpu_required`] says the GPU machine is
/// expected, so a machine with too few GPUs fails a suite that needs them.
pub fn gpus_for_test(test: &str, n: usize) -> Option<Vec<Gpu>> {
    let why = if !is_available() {
        "no CUDA driver (libcuda) on this machine".to_string()
    } else if device_count() < n {
        format!(
            "it needs {n} GPUs and the CUDA driver sees {}",
            device_count()
        )
    } else {
        match (0..n).map(Gpu::open).collect::<Result<Vec<_>>>() {
            Ok(gpus) => return Some(gpus),
            Err(e) => format!("the GPUs do not open: {e}"),
        }
    };
    assert!(!gpu_required(), "{test}: NIXL_REQUIRE_GPU=1 but {why}");
    eprintln!("skipped {test}: {why}");
    None
}

/// For GPU tests: GPU 0, or `None` after printing why the test is skipped. Panics (fails
/// the test) instead when [`gpu_required`] says the GPU machine is expected.
pub fn gpu_for_test(test: &str) -> Option<Gpu> {
    let why = if !is_available() {
        "no CUDA driver (libcuda) on this machine".to_string()
    } else if device_count() == 0 {
        "the CUDA driver sees no GPU".to_string()
    } else {
        match Gpu::open(0) {
            Ok(gpu) => return Some(gpu),
            Err(e) => format!("GPU 0 does not open: {e}"),
        }
    };
    assert!(!gpu_required(), "{test}: NIXL_REQUIRE_GPU=1 but {why}");
    eprintln!("skipped {test}: {why}");
    None
}
