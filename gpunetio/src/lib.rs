//! GPU memory for RDMA and GPU-initiated networking: the memory layer of DOCA
//! GPUNetIO's host API (`doca_gpu_create`, `doca_gpu_mem_alloc`, `doca_gpu_dmabuf_fd`),
//! over [`cudarc`] with the driver loaded at run time.
//!
//! The crate builds, and its docs build, on a machine with no CUDA at all; every call
//! returns [`Error::NoDriver`] there, and [`is_available`] says whether a driver loads.
//!
//! - [`Gpu`]: open by ordinal or PCI bus id; name, UUID, bus id, compute capability, and
//!   whether DMA-BUF, GPUDirect RDMA and VMM are supported.
//! - [`DeviceBuffer`]: exportable device memory — `cuMemAlloc` (CUDA-IPC handle) or VMM
//!   `cuMemCreate` (POSIX fd) — never cudarc's stream-ordered pool, which cannot be
//!   exported; DMA-BUF fd export for NIC registration.
//! - [`IpcHandle`] / [`IpcMapping`], [`VmmExport`] / [`VmmMapping`], [`send_vmm`] /
//!   [`recv_vmm`]: share device memory between processes of one node; importing returns
//!   a mapping closed on drop.
//! - [`HostBuffer`] / [`HostRegistration`]: pinned, portable, mapped host memory, allocated
//!   or registered in place, with its device pointer.
//! - [`pointer_info`] / [`DeviceMemoryRef`]: classify any pointer (pageable, pinned,
//!   device, managed; which GPU; which allocation) and borrow memory a framework owns.
//!
//! ```no_run
//! use gpunetio::{DeviceBuffer, Gpu, IpcMapping};
//! # fn main() -> gpunetio::Result<()> {
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
//! # GPU-initiated networking
//! The device library (`gpunetio/gio_device.cuh`, from `gpunetio-sys`) lets kernels put,
//! get, signal and wait; [`device_code::compile`] compiles kernels that include it with
//! NVRTC at run time. [`proxy`] is the `CpuProxy` NIC handler: a ring in host-mapped
//! memory that a CPU proxy posts on a libfabric endpoint or an ibverbs RC queue pair.
//! [`mlx5`] is the native ConnectX handler (DEVX queue pair on GPU-resident queues), and
//! [`GpuQueuePair`] the front over all three: a handler asked for by name, or `Auto`
//! (`Mlx5` where it works, else `CpuProxy`, saying why).

mod device_buffer;
pub mod device_code;
mod error;
mod gpu;
mod host_buffer;
pub mod intra_node;
mod ipc;
pub mod mlx5;
mod pointer;
pub mod proxy;
pub mod queue_pair;

pub use cudarc;
pub use device_buffer::{DeviceBuffer, DmaBuf, DEVICE_BUFFER_ALIGN};
pub use error::{Error, Result};
pub use gpu::{device_count, find_by_uuid, format_uuid, is_available, Gpu};
pub use host_buffer::{HostBuffer, HostRegistration};
pub use ipc::{
    recv_fds, recv_vmm, send_fds, send_vmm, IpcHandle, IpcMapping, VmmExport, VmmMapping,
    IPC_HANDLE_BYTES, MAX_FDS_PER_MESSAGE,
};
pub use pointer::{check_device_range, pointer_info, DeviceMemoryRef, MemoryKind, PointerInfo};
pub use queue_pair::{
    EndpointInfo, ExportedGpuQueuePair, GpuQueuePair, GpuQueuePairOptions, Mlx5Endpoint,
    NicHandler, RemoteRegion,
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

/// For GPU tests: whether the suite must have a GPU (`NIXL_REQUIRE_GPU=1` on the GPU
/// machine) and so fail rather than skip when none is found.
pub fn gpu_required() -> bool {
    std::env::var("NIXL_REQUIRE_GPU").is_ok_and(|v| v == "1")
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
