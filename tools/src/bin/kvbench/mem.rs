//! One side's KV cache: page-aligned host memory, or (feature `cuda`) device memory,
//! filled with the side's pattern and checked against what the requests left there.

use nixl::{Desc, MemKind};
use tools::kv::{self, Expected, KvShape};

/// Units are filled and checked this many bytes at a time (VRAM through a host copy).
const PIECE_BYTES: usize = 64 << 20;

/// Transparent huge pages' size on x86-64 and most arm64 kernels.
const HUGE_PAGE: usize = 2 << 20;

/// Huge-page-aligned host memory.
pub(crate) struct HostBuffer {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: plain memory owned by this value; the benchmark touches it from one thread at
// a time (fill, then transfers the agent orders, then the check).
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    fn new(len: usize) -> Result<Self, String> {
        // Huge-page aligned, and transparent huge pages asked for (as numpy and torch do
        // for large arrays): a KV cache is many small blocks of one large allocation, and
        // a same-host peer's copies pin its pages one by one.
        let layout = std::alloc::Layout::from_size_align(len.max(1), HUGE_PAGE)
            .map_err(|_| format!("{len} bytes of DRAM cannot be allocated"))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(format!(
                "allocating {} of DRAM failed: lower --blocks, --layers or --block-bytes",
                tools::units::human_bytes(len as u64)
            ));
        }
        // SAFETY: the range is this allocation; advice changes no contents. A kernel
        // without transparent huge pages refuses it, which changes nothing either.
        unsafe { libc::madvise(ptr.cast(), layout.size(), libc::MADV_HUGEPAGE) };
        Ok(Self { ptr, layout })
    }

    fn slice_mut(&mut self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.layout.size(), "inside the buffer");
        // SAFETY: in bounds (asserted); `&mut self` excludes other references, and no
        // transfer runs while the benchmark fills or checks.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// There is a GPU `gpu` to hold a cache.
#[cfg(feature = "cuda")]
pub(crate) fn check_gpu(gpu: usize) -> Result<(), String> {
    if !gpunetio::is_available() {
        return Err("needs a CUDA driver, and this machine has none".into());
    }
    let count = gpunetio::device_count();
    if gpu >= count {
        return Err(format!("GPU {gpu}: this machine has {count} GPU(s)"));
    }
    Ok(())
}

/// Without feature cuda there is no VRAM.
#[cfg(not(feature = "cuda"))]
pub(crate) fn check_gpu(_gpu: usize) -> Result<(), String> {
    Err("this build has no GPU support (rebuild with feature cuda)".into())
}

/// One side's cache.
pub(crate) enum KvMem {
    Host(HostBuffer, usize),
    #[cfg(feature = "cuda")]
    Device(gpunetio::DeviceBuffer),
}

impl KvMem {
    /// The cache of `shape` in `kind` memory (VRAM on GPU `gpu`), every unit holding
    /// `seed`'s pattern of itself.
    pub(crate) fn alloc(
        kind: MemKind,
        gpu: usize,
        shape: &KvShape,
        seed: u64,
    ) -> Result<Self, String> {
        let len = shape.bytes().ok_or("the cache's size overflows")?;
        let mut mem = match kind {
            MemKind::Dram => Self::Host(HostBuffer::new(len)?, len),
            #[cfg(feature = "cuda")]
            MemKind::Vram => {
                check_gpu(gpu)?;
                let open = gpunetio::Gpu::open(gpu).map_err(|e| format!("GPU {gpu}: {e}"))?;
                Self::Device(
                    gpunetio::DeviceBuffer::alloc(&open, len)
                        .map_err(|e| format!("allocating {len} bytes on GPU {gpu}: {e}"))?,
                )
            }
            other => {
                let _ = gpu;
                return Err(format!(
                    "{other:?} memory: not in this build (VRAM needs feature cuda)"
                ));
            }
        };
        mem.fill(shape, seed)?;
        Ok(mem)
    }

    pub(crate) fn kind(&self) -> MemKind {
        match self {
            Self::Host(..) => MemKind::Dram,
            #[cfg(feature = "cuda")]
            Self::Device(_) => MemKind::Vram,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Host(_, len) => *len,
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.len(),
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Self::Host(b, _) => b.ptr as u64,
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.ptr(),
        }
    }

    /// NIXL's `devId`: the GPU ordinal for VRAM, 0 for DRAM.
    fn dev_id(&self) -> u64 {
        match self {
            Self::Host(..) => 0,
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.gpu().ordinal() as u64,
        }
    }

    pub(crate) fn desc(&self, offset: usize, len: usize) -> Desc {
        Desc::new(self.addr() + offset as u64, len as u64, self.dev_id())
    }

    pub(crate) fn describe(&self) -> String {
        match self.kind() {
            MemKind::Vram => format!("VRAM (GPU {})", self.dev_id()),
            kind => format!("{kind:?}").to_ascii_uppercase(),
        }
    }

    /// Address-order slots `[first, first + count)` of whole units per piece.
    fn pieces(shape: &KvShape) -> impl Iterator<Item = (usize, usize)> {
        let per_piece = (PIECE_BYTES / shape.block_bytes).max(1);
        let units = shape.units();
        (0..units)
            .step_by(per_piece)
            .map(move |first| (first, per_piece.min(units - first)))
    }

    /// Every unit: `seed`'s pattern of itself.
    fn fill(&mut self, shape: &KvShape, seed: u64) -> Result<(), String> {
        let bb = shape.block_bytes;
        #[cfg(feature = "cuda")]
        let mut staging = Vec::new();
        for (first, count) in Self::pieces(shape) {
            let piece: &mut [u8] = match self {
                Self::Host(b, _) => b.slice_mut(first * bb, count * bb),
                #[cfg(feature = "cuda")]
                Self::Device(_) => {
                    staging.resize(count * bb, 0);
                    &mut staging
                }
            };
            for (i, unit_bytes) in piece.chunks_mut(bb).enumerate() {
                kv::pattern(seed, shape.unit_at_slot(first + i), 0, unit_bytes);
            }
            #[cfg(feature = "cuda")]
            if let Self::Device(b) = self {
                b.copy_from_host(first * bb, &staging)
                    .map_err(|e| format!("filling the cache: {e}"))?;
            }
        }
        Ok(())
    }

    /// Checks every unit against `expected` (its own fill, `own_seed`, or a source unit
    /// of the other side's fill, `source_seed`).
    pub(crate) fn check(
        &mut self,
        shape: &KvShape,
        expected: &[Expected],
        own_seed: u64,
        source_seed: u64,
    ) -> Result<(), String> {
        let bb = shape.block_bytes;
        #[cfg(feature = "cuda")]
        let mut staging = Vec::new();
        for (first, count) in Self::pieces(shape) {
            let piece: &[u8] = match self {
                Self::Host(b, _) => b.slice_mut(first * bb, count * bb),
                #[cfg(feature = "cuda")]
                Self::Device(b) => {
                    staging.resize(count * bb, 0);
                    b.copy_to_host(first * bb, &mut staging)
                        .map_err(|e| format!("reading the cache back: {e}"))?;
                    &staging
                }
            };
            kv::check_slots(shape, first, piece, expected, own_seed, source_seed)?;
        }
        Ok(())
    }
}
