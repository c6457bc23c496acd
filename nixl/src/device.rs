//! The GPU device API: handles a CUDA kernel takes to write, signal and wait on
//! transfers this agent prepared (NIXL's `nixlGpuXferReqH` and `nixlMemViewH`), and the
//! device header that uses them, `nixl/nixl_device.cuh`.
//!
//! Host side: [`crate::XferReq::create_gpu_xfer_req`] (the request form of NIXL's
//! device-API guide) and [`crate::Agent::prep_mem_view`] (the memory-view form of
//! current NIXL). Both need a backend with a device API (`GPUNETIO`); other backends
//! answer [`crate::Error::NotSupported`].
//!
//! Device side: compile kernels with `gpunetio::device_code::compile` and
//! `compile_options` (feature `gpunetio`; or add [`HEADER`] with
//! `CompileOptions::header` yourself), `#include "nixl/nixl_device.cuh"`,
//! and call `nixlGpuPostSingleWriteXferReq<LEVEL>`, `nixlGpuPostSignalXferReq<LEVEL>`,
//! `nixlGpuReadSignal`, `nixlGpuGetXferStatus`, `nixlPut`, `nixlAtomicAdd`, `nixlGetPtr`
//! with a handle's [`GpuHandle::raw`] as the kernel argument (40 bytes, by value).
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

/// Every device source of the crate, by name: the GPUNETIO backend's transfer kernel, the
/// write-and-signal kernels of the example and tests, the gather/scatter copy of
/// `LOCAL` and `CUDA_IPC`, and the device-API all-to-all of the multi-GPU tests. CI
/// compiles each with NVRTC.
pub const DEVICE_SOURCES: &[(&str, &str)] = &[
    (
        "nixl_gpunetio.cu",
        include_str!("../device/nixl_gpunetio.cu"),
    ),
    (
        "nixl_write_signal.cu",
        include_str!("../device/nixl_write_signal.cu"),
    ),
    (
        "nixl_copy_batch.cu",
        include_str!("../device/nixl_copy_batch.cu"),
    ),
    (
        "nixl_alltoall.cu",
        include_str!("../device/nixl_alltoall.cu"),
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

/// The handle is of a request.
pub const SLOT_REQUEST: u32 = 1;
/// The handle is of a memory view.
pub const SLOT_VIEW: u32 = 2;
/// The view is of local memory (sources, not targets).
pub const SLOT_LOCAL: u32 = 4;
/// Every descriptor holds both device addresses (an intra-node queue pair): kernels copy
/// and add on them directly.
pub const HANDLE_DIRECT: u32 = 8;
/// Every peer buffer is on the handle's GPU (GPU-scope ordering suffices).
pub const HANDLE_SAME_DEVICE: u32 = 16;

const _: () = assert!(std::mem::size_of::<GpuDesc>() == 48);
const _: () = assert!(std::mem::offset_of!(GpuDesc, local_off) == 32);
const _: () = assert!(std::mem::offset_of!(GpuDesc, remote_off) == 40);

/// The kernel argument of a request or view handle (`nixlGpuXferReqH` /
/// `nixlMemViewH`, 40 bytes by value): the handle's generation word and the generation it
/// had, the descriptors (a copy the backend's table owns and keeps mapped), the queue
/// pair, the descriptor count and `SLOT_*`/`HANDLE_*` flags.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawGpuHandle {
    /// Device address of the generation word.
    pub slot: u64,
    /// The generation when the handle was made (odd).
    pub generation: u64,
    /// Device address of `count` [`GpuDesc`]s.
    pub descs: u64,
    /// Device address of the queue pair (`gio_dev_qp *`), 0 for a view of local memory.
    pub qp: u64,
    /// Number of descriptors.
    pub count: u32,
    /// `SLOT_*` and `HANDLE_*` flags.
    pub flags: u32,
}

const _: () = assert!(std::mem::size_of::<RawGpuHandle>() == 40);
const _: () = assert!(std::mem::offset_of!(RawGpuHandle, descs) == 16);
const _: () = assert!(std::mem::offset_of!(RawGpuHandle, qp) == 24);
const _: () = assert!(std::mem::offset_of!(RawGpuHandle, count) == 32);
const _: () = assert!(std::mem::offset_of!(RawGpuHandle, flags) == 36);

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
    /// The kernel argument (`nixlGpuXferReqH`, 40 bytes by value).
    pub fn raw(&self) -> RawGpuHandle {
        self.0.raw()
    }
}

/// A memory view (NIXL's `nixlMemViewH`), from [`crate::Agent::prep_mem_view`].
/// Dropping it is `releaseMemView`.
#[derive(Debug)]
pub struct MemViewH(pub(crate) GpuHandle);

impl MemViewH {
    /// The kernel argument (`nixlMemViewH`, 40 bytes by value).
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
    use gpu_mem::{DeviceBuffer, Gpu};
    use parking_lot::Mutex;
    use std::sync::Arc;

    // SAFETY: RawGpuHandle is repr(C), 40 bytes of plain integers, laid out as the
    // device's nixlGpuXferReqH / nixlMemViewH (asserted on both sides).
    unsafe impl gpu_mem::cudarc::driver::DeviceRepr for RawGpuHandle {}

    /// Options to compile kernels that include `nixl/nixl_device.cuh` for `gpu`, with
    /// `gpunetio::device_code::compile` (which adds the device library the header
    /// includes).
    #[cfg(feature = "gpunetio")]
    pub fn compile_options(gpu: &Gpu) -> Result<gpu_mem::device_code::CompileOptions> {
        use gpu_mem::device_code::CompileOptions;
        Ok(CompileOptions::for_gpu(gpu)
            .map_err(|e| Error::Gpu(format!("reading the compute capability: {e}")))?
            .header(HEADER.0, HEADER.1))
    }

    /// Prepares signal memory for `nixlGpuPostSignalXferReq` (NIXL's `prepGpuSignal`):
    /// zeroes the 64-bit word at `ptr` (device memory, 8-byte aligned).
    #[doc(alias = "prepGpuSignal")]
    pub fn prep_gpu_signal(gpu: &Gpu, ptr: u64) -> Result<()> {
        if !ptr.is_multiple_of(8) {
            return Err(Error::InvalidParam(format!(
                "signal word {ptr:#x} is not 8-byte aligned"
            )));
        }
        gpu_mem::check_device_range(ptr, GPU_SIGNAL_SIZE as u64, gpu.ordinal())
            .map_err(|e| Error::InvalidParam(format!("signal word {ptr:#x}: {e}")))?;
        gpu.bind()
            .map_err(|e| Error::Gpu(format!("binding the context: {e}")))?;
        // SAFETY: the 8 bytes at ptr were checked to be device memory of this GPU.
        unsafe { gpu_mem::cudarc::driver::sys::cuMemsetD8_v2(ptr, 0, GPU_SIGNAL_SIZE) }
            .result()
            .map_err(|e| Error::Gpu(format!("cuMemsetD8 on the signal word: {e:?}")))
    }

    /// The table of device handles a backend keeps for its whole life: a generation word
    /// per slot and the slot's copy of its descriptors. Handles point into both, so
    /// neither is freed before the table: a slot's descriptor storage is reused by its
    /// next owner, and storage outgrown is kept until the table goes. A kernel therefore
    /// loads a stale handle's descriptor harmlessly, at the same time as its generation.
    #[derive(Debug)]
    pub struct HandleTable {
        words: DeviceBuffer,
        gpu: Gpu,
        /// Private and non-blocking: writes wait for their own copies, never for kernels.
        stream: Arc<gpu_mem::cudarc::driver::CudaStream>,
        state: Mutex<TableState>,
    }

    #[derive(Debug)]
    struct TableState {
        /// Generation of each slot as last written (odd: in use).
        generations: Vec<u64>,
        /// Each slot's descriptor storage (grown, never shrunk).
        storage: Vec<Option<DeviceBuffer>>,
        /// Storage a slot outgrew: stale handles may still name it.
        outgrown: Vec<DeviceBuffer>,
        free: Vec<usize>,
    }

    impl HandleTable {
        /// A table of `capacity` slots on `gpu`.
        pub fn new(gpu: &Gpu, capacity: usize) -> Result<Arc<Self>> {
            let capacity = capacity.max(1);
            let words = DeviceBuffer::alloc(gpu, capacity * 8)
                .map_err(|e| Error::Gpu(format!("allocating the handle table: {e}")))?;
            words
                .fill(0)
                .map_err(|e| Error::Gpu(format!("clearing the handle table: {e}")))?;
            let stream = gpu
                .new_stream()
                .map_err(|e| Error::Gpu(format!("creating the handle table's stream: {e}")))?;
            Ok(Arc::new(Self {
                words,
                gpu: gpu.clone(),
                stream,
                state: Mutex::new(TableState {
                    generations: vec![0; capacity],
                    storage: (0..capacity).map(|_| None).collect(),
                    outgrown: Vec::new(),
                    free: (0..capacity).rev().collect(),
                }),
            }))
        }

        /// Copies `bytes` to device address `dst` and waits for that copy alone.
        fn write(&self, dst: u64, bytes: &[u8]) -> Result<()> {
            if bytes.is_empty() {
                return Ok(());
            }
            self.gpu
                .bind()
                .map_err(|e| Error::Gpu(format!("binding the context: {e}")))?;
            // SAFETY: `dst` is inside an allocation of this table sized for `bytes` (the
            // callers compute it from the allocation); `bytes` lives until the stream is
            // synchronized below.
            unsafe {
                gpu_mem::cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                    dst,
                    bytes.as_ptr().cast(),
                    bytes.len(),
                    self.stream.cu_stream(),
                )
            }
            .result()
            .map_err(|e| Error::Gpu(format!("writing the handle table: {e:?}")))?;
            self.stream
                .synchronize()
                .map_err(|e| Error::Gpu(format!("writing the handle table: {e:?}")))
        }

        fn word(&self, index: usize) -> u64 {
            self.words.ptr() + (index * 8) as u64
        }

        /// Publishes `descs` on queue pair `qp` (0: none) in a free slot; the handle
        /// releases it when dropped, and keeps `owner` (what the descriptors and the
        /// queue pair point to) alive until then.
        pub fn publish(
            self: &Arc<Self>,
            qp: u64,
            descs: &[GpuDesc],
            flags: u32,
            owner: Box<dyn Any + Send + Sync>,
        ) -> Result<GpuHandle> {
            let count = u32::try_from(descs.len()).map_err(|_| {
                Error::InvalidParam(format!("{} descriptors in one GPU handle", descs.len()))
            })?;
            let mut st = self.state.lock();
            let index = st.free.pop().ok_or_else(|| {
                Error::InvalidParam(format!(
                    "all {} GPU handles are in use: release some first",
                    st.generations.len()
                ))
            })?;
            match self.fill_slot(&mut st, index, descs) {
                Ok(descs_ptr) => {
                    st.generations[index] += 1;
                    let generation = st.generations[index];
                    if let Err(e) = self.write(self.word(index), &generation.to_le_bytes()) {
                        // Not known to be live or released: keep it out of use.
                        tracing::warn!("GPU handle slot {index} left out of use: {e}");
                        return Err(e);
                    }
                    drop(st);
                    let raw = RawGpuHandle {
                        slot: self.word(index),
                        generation,
                        descs: descs_ptr,
                        qp,
                        count,
                        flags,
                    };
                    let release = SlotRelease {
                        table: self.clone(),
                        index,
                        _owner: owner,
                    };
                    Ok(GpuHandle::new(raw, Box::new(release)))
                }
                Err(e) => {
                    st.free.push(index);
                    Err(e)
                }
            }
        }

        /// Writes `descs` into slot `index`'s storage (grown as needed); its address.
        fn fill_slot(&self, st: &mut TableState, index: usize, descs: &[GpuDesc]) -> Result<u64> {
            let bytes = std::mem::size_of_val(descs);
            let fits = st.storage[index].as_ref().is_some_and(|b| b.len() >= bytes);
            if !fits {
                let old_len = st.storage[index].as_ref().map_or(0, |b| b.len());
                let len = bytes
                    .max(2 * old_len)
                    .max(4 * std::mem::size_of::<GpuDesc>());
                let buf = DeviceBuffer::alloc(&self.gpu, len)
                    .map_err(|e| Error::Gpu(format!("allocating handle descriptors: {e}")))?;
                if let Some(old) = st.storage[index].replace(buf) {
                    st.outgrown.push(old);
                }
            }
            let storage = st.storage[index].as_ref().expect("grown above");
            // SAFETY: GpuDesc is repr(C) plain old data without padding (48 bytes of
            // integers, asserted above).
            let raw = unsafe { std::slice::from_raw_parts(descs.as_ptr().cast::<u8>(), bytes) };
            self.write(storage.ptr(), raw)?;
            Ok(storage.ptr())
        }

        fn release(&self, index: usize) {
            let mut st = self.state.lock();
            st.generations[index] += 1;
            let generation = st.generations[index];
            // A slot whose release could not be written stays out of use: a stale handle
            // must never see it live again.
            match self.write(self.word(index), &generation.to_le_bytes()) {
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

#[cfg(all(test, feature = "gpunetio"))]
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
