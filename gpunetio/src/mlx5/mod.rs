//! The native mlx5 NIC handler (`GIO_NIC_HANDLER_MLX5`, DOCA GPUNetIO's `GPU_SM_DB` /
//! `GPU_SM_BF`): kernels build ConnectX send WQEs in a GPU-resident send queue, ring
//! the doorbell through a UAR page mapped into the GPU, and poll CQEs themselves
//! (`gpunetio/gio_mlx5.cuh`, dispatched from the high-level calls of
//! `gpunetio/gio_device.cuh`).
//!
//! This module holds the host half:
//! - [`wqe`]: the WQE encoder (ctrl, remote-address, data, inline and atomic segments;
//!   [`wqe::SendQueue`] indexing, doorbell record and doorbell value) — the reference the
//!   GPU-built bytes are compared with, and what a CPU would post;
//! - [`cqe`]: CQE parsing (owner bit, opcode, WQE counter, error syndromes as
//!   [`cqe::CqeErrorKind`]), synthetic CQEs, [`cqe::CompletionQueue`];
//! - [`probe`]: whether an mlx5 device with DEVX is present ([`crate::Error::Unsupported`]
//!   naming why not);
//! - [`UarMapping`]: a UAR doorbell page registered as I/O memory for the GPU
//!   (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_IOMEMORY`, as DOCA's
//!   `doca_gpu_verbs_export_uar`).
//!
//! - [`prm`]: PRM command mailboxes (CREATE_CQ, CREATE_QP, RST2INIT / INIT2RTR / RTR2RTS,
//!   QUERY_HCA_CAP) built by an `MLX5_SET`-style bit-field encoder;
//! - [`devx`] (feature `mlx5`): the DEVX context, UAR, DMA-BUF umems and firmware objects;
//! - [`Mlx5QueuePair`] (feature `mlx5`): the queue pair itself on GPU-resident queues,
//!   connected through DEVX modify commands and exported to kernels;
//! - [`export`]: filling `gio_mlx5_qp` and `gio_dev_qp` for any queue laid out the way a
//!   ConnectX reads it ([`export::QueueLayout`]).
//!
//! # What runs without a ConnectX
//! Everything but the DEVX calls: encoders, the CQE parser, the export and the device
//! code are tested on the GPU against an emulated NIC (`tests/gpu_mlx5_emulated.rs`).
//! Creating the DEVX objects and ringing doorbells on silicon needs a ConnectX with
//! DEVX; elsewhere [`probe`] and [`DevxContext::open`] return [`crate::Error::Unsupported`].

pub mod cqe;
mod device;
#[cfg(feature = "mlx5")]
pub mod devx;
pub mod export;
pub mod prm;
#[cfg(feature = "mlx5")]
mod queue_pair;
mod uar;
pub mod wqe;

#[cfg(feature = "mlx5")]
pub use device::devices;
pub use device::{probe, Mlx5Device};
#[cfg(feature = "mlx5")]
pub use devx::DevxContext;
pub use export::{ExportedMlx5QueuePair, Mlx5DeviceState};
#[cfg(feature = "mlx5")]
pub use queue_pair::{queue_offsets, Mlx5Options, Mlx5QueuePair, QpState, QueueOffsets};
pub use uar::UarMapping;
