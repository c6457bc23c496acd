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
