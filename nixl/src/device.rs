//! The GPU device API: handles a CUDA kernel takes to write, signal and wait on
//! transfers this agent prepared (NIXL's `nixlGpuXferReqH` and `nixlMemViewH`), and the
//! device header that uses them, `nixl/nixl_device.cuh`.
//!
//! Host side: [`crate::XferReq::create_gpu_xfer_req`] (the request form of NIXL's
//! device-API guide) and [`crate::Agent::prep_mem_view`] (the memory-view form of
//! current NIXL). Both need a backend with a device API (`GPUNETIO`); other backends
//! answer [`crate::Error::NotSupported`].
//!
//! Device side: compile kernels with `compile_options` (feature `cuda`; or include [`HEADER`] with
//! `gpunetio::device_code::CompileOptions::header`), `#include "nixl/nixl_device.cuh"`,
//! and call `nixlGpuPostSingleWriteXferReq<LEVEL>`, `nixlGpuPostSignalXferReq<LEVEL>`,
//! `nixlGpuReadSignal`, `nixlGpuGetXferStatus`, `nixlPut`, `nixlAtomicAdd`, `nixlGetPtr`
//! with a handle's [`GpuHandle::raw`] as the kernel argument (16 bytes, by value).
//!
//! A handle stays safe to use after release: it names a slot of a table the backend
//! keeps, and a released slot's generation moves on, so a kernel holding a stale handle
//! gets `NIXL_ERR_INVALID_PARAM` instead of touching freed memory.

use std::any::Any;

/// `nixl/nixl_device.cuh`: the device API, by its include name.
pub const HEADER: (&str, &str) = (
    "nixl/nixl_device.cuh",
    include_str!("../device/nixl_device.cuh"),
);

/// Every device source of the crate, by name: the GPUNETIO backend's transfer kernel and
/// the write-and-signal kernels of the example and tests. CI compiles each with NVRTC.
pub const DEVICE_SOURCES: &[(&str, &str)] = &[
    (
        "nixl_gpunetio.cu",
        include_str!("../device/nixl_gpunetio.cu"),
    ),
    (
        "nixl_write_signal.cu",
        include_str!("../device/nixl_write_signal.cu"),
    ),
];

/// NIXL's device status codes (`nixl_status_t`), as the device API returns them.
pub mod status {
    /// Posted, not complete yet.
    pub const IN_PROG: i32 = 1;
    /// Done.
    pub const SUCCESS: i32 = 0;
    /// A bad handle, index, offset or size.
    pub const ERR_INVALID_PARAM: i32 = -2;
    /// The transport failed.
    pub const ERR_BACKEND: i32 = -3;
    /// Not available on this queue pair.
    pub const ERR_NOT_SUPPORTED: i32 = -9;
    /// The peer went away.
    pub const ERR_REMOTE_DISCONNECT: i32 = -10;
    /// The queue pair was shut down.
    pub const ERR_CANCELED: i32 = -11;
}

/// The device-side view of a request's descriptor pair or of a view's element
/// (`nixl_gpu_desc`): addresses and the queue pair's region indices.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuDesc {
    /// The local buffer (device-addressable).
    pub local_addr: u64,
    /// The peer's buffer where it is mapped here, else 0.
    pub remote_addr: u64,
    /// Bytes.
    pub len: u64,
    /// Index of the local region in the queue pair's table (`u32::MAX`: none).
    pub local_mr: u32,
    /// Index of the remote region in the queue pair's table (`u32::MAX`: none).
    pub remote_mr: u32,
    /// Where the local bytes start in region `local_mr`.
    pub local_off: u64,
    /// Where the remote bytes start in region `remote_mr`.
    pub remote_off: u64,
}

/// A slot of the handle table (`nixl_gpu_slot`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuSlot {
    /// Odd while the request or view lives, even once released.
    pub generation: u64,
    /// Device address of the queue pair (`gio_dev_qp *`).
    pub qp: u64,
    /// Device address of the `count` descriptors.
    pub descs: u64,
    /// Number of descriptors.
    pub count: u32,
    /// `SLOT_*` flags.
    pub flags: u32,
}

/// The slot holds a request.
pub const SLOT_REQUEST: u32 = 1;
/// The slot holds a memory view.
pub const SLOT_VIEW: u32 = 2;
/// The view is of local memory (sources, not targets).
pub const SLOT_LOCAL: u32 = 4;

const _: () = assert!(std::mem::size_of::<GpuDesc>() == 48);
const _: () = assert!(std::mem::offset_of!(GpuDesc, local_off) == 32);
const _: () = assert!(std::mem::offset_of!(GpuDesc, remote_off) == 40);
const _: () = assert!(std::mem::size_of::<GpuSlot>() == 32);
const _: () = assert!(std::mem::offset_of!(GpuSlot, qp) == 8);
const _: () = assert!(std::mem::offset_of!(GpuSlot, descs) == 16);
const _: () = assert!(std::mem::offset_of!(GpuSlot, count) == 24);

/// The kernel argument of a request or view handle (`nixlGpuXferReqH` /
/// `nixlMemViewH`): the slot's device address and the generation it had.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawGpuHandle {
    /// Device address of the slot.
    pub slot: u64,
    /// The slot's generation when the handle was made.
    pub generation: u64,
}

const _: () = assert!(std::mem::size_of::<RawGpuHandle>() == 16);

/// A device handle and what keeps its memory alive; dropping it releases the handle
/// (its slot's generation moves on, so kernels still holding it get an error status).
pub struct GpuHandle {
    raw: RawGpuHandle,
    _owner: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for GpuHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuHandle").field("raw", &self.raw).finish()
    }
}

impl GpuHandle {
    /// A handle whose release is `owner`'s drop.
    pub fn new(raw: RawGpuHandle, owner: Box<dyn Any + Send + Sync>) -> Self {
        Self { raw, _owner: owner }
    }

    /// The kernel argument.
    pub fn raw(&self) -> RawGpuHandle {
        self.raw
    }
}

/// A GPU request handle (NIXL's `nixlGpuXferReqH`), from
/// [`crate::XferReq::create_gpu_xfer_req`]. Dropping it is `releaseGpuXferReq`.
#[derive(Debug)]
pub struct GpuXferReqH(pub(crate) GpuHandle);

impl GpuXferReqH {
    /// The kernel argument (`nixlGpuXferReqH`, 16 bytes by value).
    pub fn raw(&self) -> RawGpuHandle {
        self.0.raw()
    }
}

/// A memory view (NIXL's `nixlMemViewH`), from [`crate::Agent::prep_mem_view`].
/// Dropping it is `releaseMemView`.
#[derive(Debug)]
pub struct MemViewH(pub(crate) GpuHandle);

impl MemViewH {
    /// The kernel argument (`nixlMemViewH`, 16 bytes by value).
    pub fn raw(&self) -> RawGpuHandle {
        self.0.raw()
    }
}

/// Size in bytes of a signal word for `nixlGpuPostSignalXferReq` (NIXL's
/// `getGpuSignalSize`): a 64-bit counter, 8-byte aligned.
#[doc(alias = "getGpuSignalSize")]
pub const GPU_SIGNAL_SIZE: usize = 8;

#[cfg(feature = "cuda")]
pub use gpu::*;

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use crate::error::{Error, Result};
    use gpunetio::device_code::CompileOptions;
    use gpunetio::{DeviceBuffer, Gpu};
    use std::sync::{Arc, Mutex};

    // SAFETY: RawGpuHandle is repr(C), 16 bytes of plain integers, laid out as the
    // device's nixlGpuXferReqH / nixlMemViewH (asserted on both sides).
    unsafe impl gpunetio::cudarc::driver::DeviceRepr for RawGpuHandle {}

    /// Options to compile kernels that include `nixl/nixl_device.cuh` for `gpu`.
    pub fn compile_options(gpu: &Gpu) -> Result<CompileOptions> {
        Ok(CompileOptions::for_gpu(gpu)
            .map_err(|e| Error::Gpu(format!("reading the compute capability: {e}")))?
            .header(HEADER.0, HEADER.1))
    }

    /// Prepares signal memory for `nixlGpuPostSignalXferReq` (NIXL's `prepGpuSignal`):
    /// zeroes the 64-bit word at `ptr` (device memory, 8-byte aligned).
    #[doc(alias = "prepGpuSignal")]
    pub fn prep_gpu_signal(gpu: &Gpu, ptr: u64) -> Result<()> {
        if ptr % 8 != 0 {
            return Err(Error::InvalidParam(format!(
                "signal word {ptr:#x} is not 8-byte aligned"
            )));
        }
        gpunetio::check_device_range(ptr, GPU_SIGNAL_SIZE as u64, gpu.ordinal())
            .map_err(|e| Error::InvalidParam(format!("signal word {ptr:#x}: {e}")))?;
        gpu.bind()
            .map_err(|e| Error::Gpu(format!("binding the context: {e}")))?;
        // SAFETY: the 8 bytes at ptr were checked to be device memory of this GPU.
        unsafe { gpunetio::cudarc::driver::sys::cuMemsetD8_v2(ptr, 0, GPU_SIGNAL_SIZE) }
            .result()
            .map_err(|e| Error::Gpu(format!("cuMemsetD8 on the signal word: {e:?}")))
    }

    /// The table of device handle slots a backend keeps for its whole life (handles
    /// point into it, so it never moves or shrinks).
    #[derive(Debug)]
    pub struct HandleTable {
        slots: DeviceBuffer,
        state: Mutex<TableState>,
    }

    #[derive(Debug)]
    struct TableState {
        /// Generation of each slot as last written (odd: in use).
        generations: Vec<u64>,
        free: Vec<usize>,
    }

    impl HandleTable {
        /// A table of `capacity` slots on `gpu`.
        pub fn new(gpu: &Gpu, capacity: usize) -> Result<Arc<Self>> {
            let bytes = capacity.max(1) * std::mem::size_of::<GpuSlot>();
            let slots = DeviceBuffer::alloc(gpu, bytes)
                .map_err(|e| Error::Gpu(format!("allocating the handle table: {e}")))?;
            slots
                .fill(0)
                .map_err(|e| Error::Gpu(format!("clearing the handle table: {e}")))?;
            Ok(Arc::new(Self {
                slots,
                state: Mutex::new(TableState {
                    generations: vec![0; capacity.max(1)],
                    free: (0..capacity.max(1)).rev().collect(),
                }),
            }))
        }

        fn write(&self, index: usize, slot: &GpuSlot) -> Result<()> {
            // SAFETY: GpuSlot is repr(C) plain old data with no padding (32 bytes of
            // integers, asserted above).
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    (slot as *const GpuSlot).cast::<u8>(),
                    std::mem::size_of::<GpuSlot>(),
                )
            };
            self.slots
                .copy_from_host(index * std::mem::size_of::<GpuSlot>(), bytes)
                .map_err(|e| Error::Gpu(format!("writing handle slot {index}: {e}")))
        }

        /// Publishes `count` descriptors at `descs` on queue pair `qp` in a free slot;
        /// the handle releases it when dropped, and keeps `owner` alive until then.
        pub fn publish(
            self: &Arc<Self>,
            qp: u64,
            descs: u64,
            count: u32,
            flags: u32,
            owner: Box<dyn Any + Send + Sync>,
        ) -> Result<GpuHandle> {
            let (index, generation) = {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let index = st.free.pop().ok_or_else(|| {
                    Error::InvalidParam(format!(
                        "all {} GPU handles are in use: release some first",
                        st.generations.len()
                    ))
                })?;
                st.generations[index] += 1;
                (index, st.generations[index])
            };
            let slot = GpuSlot {
                generation,
                qp,
                descs,
                count,
                flags,
            };
            if let Err(e) = self.write(index, &slot) {
                self.release(index);
                return Err(e);
            }
            let raw = RawGpuHandle {
                slot: self.slots.ptr() + (index * std::mem::size_of::<GpuSlot>()) as u64,
                generation,
            };
            let release = SlotRelease {
                table: self.clone(),
                index,
                _owner: owner,
            };
            Ok(GpuHandle::new(raw, Box::new(release)))
        }

        fn release(&self, index: usize) {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.generations[index] += 1;
            let slot = GpuSlot {
                generation: st.generations[index],
                ..GpuSlot::default()
            };
            // A slot whose release could not be written stays out of use: a stale handle
            // must never see it live again.
            match self.write(index, &slot) {
                Ok(()) => st.free.push(index),
                Err(e) => tracing::warn!("releasing GPU handle slot {index}: {e}"),
            }
        }
    }

    /// Releases a slot when the handle goes (then drops what the slot pointed to).
    struct SlotRelease {
        table: Arc<HandleTable>,
        index: usize,
        _owner: Box<dyn Any + Send + Sync>,
    }

    impl Drop for SlotRelease {
        fn drop(&mut self) {
            self.table.release(self.index);
        }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use gpunetio::device_code::{compile, nvrtc_available, CompileOptions};

    /// Every device source compiles with NVRTC (CI sets GPUNETIO_REQUIRE_NVRTC=1 and
    /// installs libnvrtc, so a kernel that does not compile fails CI, not a GPU run).
    #[test]
    fn every_device_source_compiles_with_nvrtc() {
        if !nvrtc_available() {
            assert!(
                std::env::var("GPUNETIO_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "NVRTC is required here but libnvrtc does not load"
            );
            eprintln!("skipped: libnvrtc is not installed (cargo xtask nvrtc fetches it)");
            return;
        }
        for (name, source) in DEVICE_SOURCES {
            for arch in ["compute_80", "compute_90"] {
                for debug in [false, true] {
                    let mut options = CompileOptions {
                        arch: arch.into(),
                        ..CompileOptions::default()
                    }
                    .header(HEADER.0, HEADER.1);
                    if debug {
                        options = options.define("GIO_DEBUG");
                    }
                    if let Err(e) = compile(name, source, &options) {
                        panic!("{name} for {arch} (debug {debug}): {e}");
                    }
                }
            }
        }
    }
}
