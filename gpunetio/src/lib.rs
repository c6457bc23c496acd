//! GPU-initiated networking in the manner of DOCA GPUNetIO: queue pairs that CUDA kernels
//! post on (put, get, signal, wait), with the NIC work done by a CPU proxy, by the GPU
//! copying to a peer's mapped memory, or by the GPU ringing a ConnectX's doorbells.
//!
//! - The device library (`gpunetio/gio_device.cuh`, from `gpunetio-sys`, re-exported as
//!   [`ffi`]) is what kernels call; [`device_code::compile`] compiles kernels that
//!   include it with NVRTC at run time (no CUDA toolkit at build time).
//! - [`proxy`] is the `CpuProxy` NIC handler: a ring in host-mapped memory that a CPU
//!   proxy posts on a libfabric endpoint (feature `fabric`) or an ibverbs RC queue pair
//!   (feature `verbs`). [`intra_node`] maps a peer's memory of the same node through
//!   CUDA IPC and lets the kernel's warps copy. [`mlx5`] is the native ConnectX handler
//!   (DEVX queue pair on GPU-resident queues, feature `mlx5`).
//! - [`GpuQueuePair`] is the front over all three: a handler asked for by name, or
//!   `Auto` (`Mlx5` where it works, else `CpuProxy`, saying why).
//!
//! GPU memory (GPUs, device and pinned host buffers, CUDA-IPC/VMM/DMA-BUF export,
//! pointer classification, NVRTC) is the [`gpu_mem`] crate, which this one builds on and
//! re-exports at its root (`gpunetio::{Gpu, DeviceBuffer, IpcHandle, ...}`); code that
//! needs only memory depends on `gpu-mem` alone and links no RDMA library. Its failures
//! reach this crate's callers as [`Error::Gpu`].
//!
//! | feature | default | what it adds |
//! | --- | --- | --- |
//! | `fabric` | on | `proxy::FabricTransport`: the CPU proxy over libfabric |
//! | `verbs` | on | `proxy::VerbsTransport`: the CPU proxy over an ibverbs RC queue pair |
//! | `mlx5` | on | `mlx5::probe` and the native mlx5 handler's host side (needs libmlx5; implies `verbs`) |
//!
//! ```no_run
//! use gpunetio::device_code::{compile, CompileOptions};
//! use gpunetio::Gpu;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let gpu = Gpu::open(0)?;
//! let src = r#"
//! #include "gpunetio/gio_device.cuh"
//! extern "C" __global__ void k(gio_dev_qp *qp) { /* gio::put(...) */ }
//! "#;
//! let ptx = compile("k.cu", src, &CompileOptions::for_gpu(&gpu)?)?;
//! let module = gpu.context().load_module(ptx)?;
//! # let _ = module;
//! # Ok(()) }
//! ```

// docs.rs (nightly) marks what each feature adds.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod device_code;
mod error;
pub mod intra_node;
pub mod mlx5;
pub mod proxy;
pub mod queue_pair;
mod status;

pub use error::{Error, Result};
pub use queue_pair::{
    EndpointInfo, ExportedGpuQueuePair, GpuQueuePair, GpuQueuePairOptions, Mlx5Endpoint,
    NicHandler, RemoteRegion,
};

// The GPU memory layer this crate builds on, re-exported so that code written against
// `gpunetio::{Gpu, DeviceBuffer, ...}` keeps working; new code that needs only memory
// depends on `gpu-mem` alone.
pub use gpu_mem;
pub use gpu_mem::cudarc;
pub use gpu_mem::{
    check_device_range, device_count, find_by_uuid, format_uuid, gpu_for_test, gpu_required,
    is_available, pointer_info, recv_fds, recv_vmm, send_fds, send_vmm, DeviceBuffer,
    DeviceMemoryRef, DmaBuf, Gpu, HostBuffer, HostRegistration, IpcHandle, IpcMapping, MemoryKind,
    PointerInfo, VmmExport, VmmMapping, DEVICE_BUFFER_ALIGN, IPC_HANDLE_BYTES, MAX_FDS_PER_MESSAGE,
};

pub use gpunetio_sys as ffi;

/// Every device source this crate ships, by name: CI compiles each with NVRTC.
pub const DEVICE_SOURCES: &[(&str, &str)] = &[
    ("gio_tests.cu", include_str!("../kernels/gio_tests.cu")),
    ("gio_perf.cu", include_str!("../kernels/gio_perf.cu")),
    (
        "gio_mlx5_tests.cu",
        include_str!("../kernels/gio_mlx5_tests.cu"),
    ),
];
