//! Benchmark memory (DRAM, or VRAM with feature `cuda`) and the data patterns the
//! consistency check compares.

use crate::options::{Options, Side};
use crate::setup::Setup;
use nixl::{Agent, Desc, DescList, MemKind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tools::units::human_bytes;

/// How a new buffer starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Init {
    /// Every byte this value (NIXL's nixlbench memsets its buffers so).
    Byte(u8),
    /// The pattern of this seed (a READ source: the target's memory).
    Pattern(u64),
}

/// The piece of a buffer one fill thread takes at a time.
const FILL_PIECE: usize = 64 << 20;
/// Fill threads at most: first-touching pages and generating the pattern are CPU-bound
/// per thread, and memory bandwidth is reached well before this.
const MAX_FILL_THREADS: usize = 16;
/// The host piece a thread generates before copying it to VRAM (without NVRTC).
#[cfg(feature = "cuda")]
const VRAM_STAGE: usize = 8 << 20;
/// From this length a VRAM range gets its pattern from the GPU (`vram_pattern`): a
/// kernel launch costs about what a small host copy does.
#[cfg(feature = "cuda")]
const VRAM_KERNEL_FROM: usize = 64 << 10;

/// Threads that fill `len` bytes: one per core up to [`MAX_FILL_THREADS`], no more than
/// there are pieces.
fn fill_threads(len: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores
        .min(MAX_FILL_THREADS)
        .min(len.div_ceil(FILL_PIECE))
        .max(1)
}

/// Runs `fill(offset, len)` over `[0, len)` in [`FILL_PIECE`]s on [`fill_threads`]
/// threads, each piece added to `setup`'s bytes done as it completes. Setting up tens of
/// GiB one thread at a time takes minutes (a page fault per 4 KiB page, a hash per
/// word); spread over the cores it runs at memory speed. The first error stops every
/// thread at its next piece.
fn fill_parallel(
    len: usize,
    setup: &Setup,
    fill: impl Fn(usize, usize) -> Result<(), String> + Sync,
) -> Result<(), String> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let work = || -> Result<(), String> {
        loop {
            let at = next.fetch_add(FILL_PIECE, Ordering::Relaxed);
            if at >= len || failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            let n = FILL_PIECE.min(len - at);
            if let Err(e) = fill(at, n) {
                failed.store(true, Ordering::Relaxed);
                return Err(e);
            }
            setup.add(n as u64);
        }
    };
    let threads = fill_threads(len);
    if threads == 1 {
        return work();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(work)).collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err("a fill thread panicked".into()))
        })
    })
}

/// Why benchmark memory cannot be had: found before anything starts where it can be
/// ([`check_fits`]), else when allocating.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MemError {
    #[error(
        "{side} VRAM needs a CUDA driver, and this machine has none (--{side}_seg_type DRAM \
         runs without a GPU)"
    )]
    NoDriver { side: &'static str },
    #[error(
        "{side} VRAM on GPU {gpu}: this machine has {count} GPU(s) (--{side}_gpu N picks \
         one; --{side}_seg_type DRAM runs without)"
    )]
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    NoGpu {
        side: &'static str,
        gpu: usize,
        count: usize,
    },
    #[error("GPU {gpu}: {message}")]
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Gpu { gpu: usize, message: String },
    #[error(
        "this run needs {} of VRAM on GPU {gpu}, which has {}: lower --total_buffer_size, \
         --max_block_size or --max_batch_size",
        human_bytes(*need),
        human_bytes(*have)
    )]
    VramTooSmall { gpu: usize, need: u64, have: u64 },
    #[error(
        "this run needs {} of DRAM ({what}), and {} is available: lower \
         --total_buffer_size, --max_block_size or --max_batch_size",
        human_bytes(*need),
        human_bytes(*available)
    )]
    DramTooSmall {
        need: u64,
        available: u64,
        what: String,
    },
    #[error(
        "allocating {} of DRAM failed: lower --total_buffer_size, --max_block_size or \
         --max_batch_size",
        human_bytes(*len as u64)
    )]
    Alloc { len: usize },
    #[error("filling DRAM: {message}")]
    Fill { message: String },
}

impl Init {
    fn name(self) -> &'static str {
        match self {
            Self::Byte(_) => "byte fill",
            Self::Pattern(_) => "pattern",
        }
    }
}

fn side_name(side: Side) -> &'static str {
    match side {
        Side::Initiator => "initiator",
        Side::Target => "target",
    }
}

/// Bytes of memory this process may still take: `MemAvailable`, and the room left under
/// its cgroup's `memory.max` where one is set (containers). `None` where neither can be
/// read.
fn dram_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = meminfo.as_deref().and_then(|text| {
        text.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    // cgroup v2: "0::/path" names the group of this process.
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_string))
        })
        .and_then(|path| {
            let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
            let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
            let max = read("memory.max")?.trim().parse::<u64>().ok()?;
            let current = read("memory.current")?.trim().parse::<u64>().ok()?;
            Some(max.saturating_sub(current))
        });
    match (available, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// Checks that the buffers of `sides` (those this process allocates) fit: the GPUs of
/// VRAM sides first (there is one, and it has the room), then the machine's DRAM, so that
/// a run too large for this machine says so before it starts anything.
pub(crate) fn check_fits(o: &Options, sides: &[Side]) -> Result<(), MemError> {
    let bytes = o.buffer_bytes() as u64;
    let mut per_gpu: Vec<(usize, u64)> = Vec::new();
    for &side in sides {
        if o.seg(side) != MemKind::Vram {
            continue;
        }
        let gpu = o.gpu(side);
        check_gpu(side, gpu)?;
        match per_gpu.iter_mut().find(|(g, _)| *g == gpu) {
            Some((_, need)) => *need += bytes,
            None => per_gpu.push((gpu, bytes)),
        }
    }
    for (gpu, need) in per_gpu {
        let have = gpu_memory(gpu)?;
        if need > have {
            return Err(MemError::VramTooSmall { gpu, need, have });
        }
    }
    let dram_sides: Vec<&str> = sides
        .iter()
        .filter(|s| o.seg(**s) == MemKind::Dram)
        .map(|s| side_name(*s))
        .collect();
    if dram_sides.is_empty() {
        return Ok(());
    }
    let need = bytes * dram_sides.len() as u64;
    match dram_available() {
        Some(available) if need > available => Err(MemError::DramTooSmall {
            need,
            available,
            what: format!(
                "{} for each of {}",
                human_bytes(bytes),
                dram_sides.join(" and ")
            ),
        }),
        _ => Ok(()),
    }
}

/// There is a GPU `gpu` for `side`.
#[cfg(feature = "cuda")]
fn check_gpu(side: Side, gpu: usize) -> Result<(), MemError> {
    let side = side_name(side);
    if !gpunetio::is_available() {
        return Err(MemError::NoDriver { side });
    }
    let count = gpunetio::device_count();
    if gpu >= count {
        return Err(MemError::NoGpu { side, gpu, count });
    }
    Ok(())
}

/// Without feature cuda no side is VRAM (the options refuse it).
#[cfg(not(feature = "cuda"))]
fn check_gpu(side: Side, _gpu: usize) -> Result<(), MemError> {
    Err(MemError::NoDriver {
        side: side_name(side),
    })
}

#[cfg(feature = "cuda")]
fn gpu_memory(gpu: usize) -> Result<u64, MemError> {
    let err = |e: gpunetio::gpu_mem::Error| MemError::Gpu {
        gpu,
        message: e.to_string(),
    };
    let open = gpunetio::Gpu::open(gpu).map_err(err)?;
    Ok(open.total_mem().map_err(err)? as u64)
}

#[cfg(not(feature = "cuda"))]
fn gpu_memory(_gpu: usize) -> Result<u64, MemError> {
    Ok(0)
}

/// A page-aligned host allocation, every page written once (as NIXL's nixlbench memsets
/// its buffers): an untouched page would be the kernel's shared zero page, which a WRITE
/// source would read from cache. A private anonymous mapping that asks for transparent
/// huge pages (`MADV_HUGEPAGE`: a 2 MiB page is one fault where 4 KiB pages are 512, and
/// pinning it at registration is one page too), or (storage runs) a shared mapping of a
/// `/dev/shm` file, which the hf3fs-gdr daemon maps itself: FILE moves it without a copy.
pub(crate) struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    /// The `/dev/shm` file of a shared buffer (unmapped and removed on drop).
    shm: Option<std::path::PathBuf>,
}

// SAFETY: the buffer is plain memory; threads only touch it through raw copies that the
// benchmark orders (each thread owns its own slice of it).
unsafe impl Send for HostBuffer {}
// SAFETY: as above.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// `len` bytes started as `init`, written by several threads ([`fill_parallel`]);
    /// `Init::Byte` should be non-zero, so the writes cannot be folded into a calloc.
    fn new(len: usize, init: Init, setup: &Setup) -> Result<Self, MemError> {
        // SAFETY: a new private anonymous mapping; nothing else is at the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(MemError::Alloc { len });
        }
        // A hint: where transparent huge pages are off, 4 KiB pages it is.
        // SAFETY: the range is the mapping just made.
        unsafe { libc::madvise(ptr, len.max(1), libc::MADV_HUGEPAGE) };
        let ptr = ptr.cast::<u8>();
        let buf = Self {
            ptr,
            len,
            shm: None,
        };
        setup.stage(
            format!("allocating and filling DRAM ({})", init.name()),
            len as u64,
        );
        let base = ptr as usize;
        fill_parallel(len, setup, |at, n| {
            // SAFETY: `[at, at + n)` is inside the allocation, and each piece is given to
            // one thread only.
            let piece = unsafe { std::slice::from_raw_parts_mut((base + at) as *mut u8, n) };
            match init {
                Init::Byte(b) => piece.fill(b),
                Init::Pattern(seed) => write_pattern(piece, seed, at),
            }
            Ok(())
        })
        .map_err(|message| MemError::Fill { message })?;
        Ok(buf)
    }

    /// `len` bytes of `fill` in a new `/dev/shm` file mapped `MAP_SHARED`.
    #[cfg(feature = "file")]
    fn new_shared(len: usize, fill: u8) -> Result<Self, String> {
        use std::os::fd::AsRawFd;
        let path = std::path::PathBuf::from(format!(
            "/dev/shm/nixlbench-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| format!("creating {}: {e}", path.display()))?;
        let fail = |e: String| {
            let _ = std::fs::remove_file(&path);
            e
        };
        // Reserved up front: a tmpfs too small for it (containers' /dev/shm) fails here
        // instead of with SIGBUS when a page is first touched.
        // SAFETY: a valid descriptor; plain integer arguments.
        let err = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len.max(1) as libc::off_t) };
        if err != 0 {
            let e = std::io::Error::from_raw_os_error(err);
            return Err(fail(format!(
                "reserving {len} bytes in {}: {e}",
                path.display()
            )));
        }
        // SAFETY: a fresh shared mapping of the whole file; unmapped in drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(fail(format!("mapping {}: {e}", path.display())));
        }
        // SAFETY: the mapping holds `len` bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), fill, len) };
        Ok(Self {
            ptr: ptr.cast(),
            len,
            shm: Some(path),
        })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` or `new_shared` with this length.
        unsafe { libc::munmap(self.ptr.cast(), self.len.max(1)) };
        if let Some(path) = &self.shm {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// One side's benchmark memory: host memory, or (feature `cuda`) device memory.
pub(crate) enum Mem {
    Host(HostBuffer),
    #[cfg(feature = "cuda")]
    Device(gpunetio::DeviceBuffer),
}

impl Mem {
    /// `side`'s buffer of the run `o`: its kind, GPU and size, every byte `fill`.
    pub(crate) fn for_side(o: &Options, side: Side, fill: u8) -> Result<Self, String> {
        Self::for_side_init(o, side, Init::Byte(fill), &Setup::silent())
    }

    /// `side`'s buffer of the run `o`, started as `init`, its progress told to `setup`.
    pub(crate) fn for_side_init(
        o: &Options,
        side: Side,
        init: Init,
        setup: &Setup,
    ) -> Result<Self, String> {
        Self::alloc_init(
            o.seg(side),
            o.gpu(side),
            o.buffer_bytes(),
            init,
            o.enable_vmm,
            setup,
        )
    }

    /// `len` bytes of `kind` (VRAM on GPU `gpu`, through the VMM API if `vmm`), every
    /// byte set to `fill`.
    #[cfg(test)]
    pub(crate) fn alloc(
        kind: MemKind,
        gpu: usize,
        len: usize,
        fill: u8,
        vmm: bool,
    ) -> Result<Self, String> {
        Self::alloc_init(kind, gpu, len, Init::Byte(fill), vmm, &Setup::silent())
    }

    /// `Mem::alloc`, started as `init`: DRAM by several threads, a VRAM byte fill by the
    /// GPU (`cuMemsetD8`), a VRAM pattern generated by several host threads and copied.
    pub(crate) fn alloc_init(
        kind: MemKind,
        gpu: usize,
        len: usize,
        init: Init,
        vmm: bool,
        setup: &Setup,
    ) -> Result<Self, String> {
        match kind {
            MemKind::Dram => Ok(Self::Host(
                HostBuffer::new(len, init, setup).map_err(|e| e.to_string())?,
            )),
            #[cfg(feature = "cuda")]
            MemKind::Vram => {
                setup.stage(format!("allocating VRAM on GPU {gpu}"), len as u64);
                let open = gpunetio::Gpu::open(gpu).map_err(|e| format!("GPU {gpu}: {e}"))?;
                let buf = if vmm {
                    gpunetio::DeviceBuffer::alloc_vmm(&open, len)
                } else {
                    gpunetio::DeviceBuffer::alloc(&open, len)
                }
                .map_err(|e| format!("allocating {len} bytes on GPU {gpu}: {e}"))?;
                let mem = Self::Device(buf);
                match init {
                    Init::Byte(fill) => {
                        if let Self::Device(buf) = &mem {
                            buf.fill(fill).map_err(|e| format!("GPU {gpu}: {e}"))?;
                        }
                    }
                    Init::Pattern(seed) => {
                        setup.stage(format!("filling VRAM on GPU {gpu} (pattern)"), len as u64);
                        mem.fill_pattern_with(0, len, seed, setup)?;
                    }
                }
                Ok(mem)
            }
            other => {
                let _ = (gpu, init, vmm, setup);
                Err(format!(
                    "{other:?} memory: not in this build (VRAM needs feature cuda)"
                ))
            }
        }
    }

    /// Like [`Mem::for_side`], but DRAM is a shared `/dev/shm` mapping (storage runs).
    #[cfg(feature = "file")]
    pub(crate) fn for_side_shared(o: &Options, side: Side, fill: u8) -> Result<Self, String> {
        let len = o.buffer_bytes();
        match o.seg(side) {
            MemKind::Dram => match HostBuffer::new_shared(len, fill) {
                Ok(b) => Ok(Self::Host(b)),
                Err(e) => {
                    eprintln!("nixlbench: DRAM in /dev/shm: {e}; heap memory instead (staged)");
                    Ok(Self::Host(
                        HostBuffer::new(len, Init::Byte(fill), &Setup::silent())
                            .map_err(|e| e.to_string())?,
                    ))
                }
            },
            _ => Self::for_side(o, side, fill),
        }
    }

    pub(crate) fn kind(&self) -> MemKind {
        match self {
            Self::Host(_) => MemKind::Dram,
            #[cfg(feature = "cuda")]
            Self::Device(_) => MemKind::Vram,
        }
    }

    pub(crate) fn addr(&self) -> u64 {
        match self {
            Self::Host(b) => b.ptr as u64,
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.ptr(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Host(b) => b.len,
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.len(),
        }
    }

    /// NIXL's `devId`: the GPU ordinal for VRAM, 0 for DRAM.
    pub(crate) fn dev_id(&self) -> u64 {
        match self {
            Self::Host(_) => 0,
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.gpu().ordinal() as u64,
        }
    }

    pub(crate) fn describe(&self) -> String {
        match self.kind() {
            MemKind::Vram => format!("VRAM (GPU {})", self.dev_id()),
            kind => format!("{kind:?}").to_ascii_uppercase(),
        }
    }

    pub(crate) fn desc(&self, offset: usize, len: usize) -> Desc {
        Desc::new(self.addr() + offset as u64, len as u64, self.dev_id())
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(format!(
                "range {offset}+{len} outside the {} byte buffer",
                self.len()
            )),
        }
    }

    pub(crate) fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), String> {
        self.check_range(offset, bytes.len())?;
        match self {
            Self::Host(b) => {
                // SAFETY: in bounds (checked above); `bytes` cannot alias benchmark memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.ptr.add(offset), bytes.len())
                };
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Self::Device(b) => b.copy_from_host(offset, bytes).map_err(|e| e.to_string()),
        }
    }

    pub(crate) fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>, String> {
        self.check_range(offset, len)?;
        match self {
            Self::Host(b) => {
                let mut out = vec![0u8; len];
                // SAFETY: in bounds (checked above); the transfers that wrote the range
                // completed before the caller asked (request completion or notification).
                unsafe { std::ptr::copy_nonoverlapping(b.ptr.add(offset), out.as_mut_ptr(), len) };
                Ok(out)
            }
            #[cfg(feature = "cuda")]
            Self::Device(b) => {
                let mut out = vec![0u8; len];
                b.copy_to_host(offset, &mut out)
                    .map_err(|e| e.to_string())?;
                Ok(out)
            }
        }
    }

    /// Writes the pattern `seed` over `[offset, offset + len)`.
    pub(crate) fn fill_pattern(&self, offset: usize, len: usize, seed: u64) -> Result<(), String> {
        self.fill_pattern_with(offset, len, seed, &Setup::silent())
    }

    /// [`Mem::fill_pattern`], its progress added to `setup`: DRAM written in place, VRAM
    /// by a kernel (`vram_pattern`) or, without NVRTC or for small ranges, a host piece
    /// at a time (a copy of the whole range would double the memory); large ranges on
    /// several threads ([`fill_parallel`]).
    pub(crate) fn fill_pattern_with(
        &self,
        offset: usize,
        len: usize,
        seed: u64,
        setup: &Setup,
    ) -> Result<(), String> {
        self.check_range(offset, len)?;
        #[cfg(feature = "cuda")]
        if let Self::Device(b) = self {
            if len >= VRAM_KERNEL_FROM && crate::vram_pattern::fill(b, offset, len, seed)? {
                setup.add(len as u64);
                return Ok(());
            }
        }
        fill_parallel(len, setup, |at, n| {
            let at = offset + at;
            match self {
                Self::Host(b) => {
                    // SAFETY: in bounds (checked above), each piece given to one thread;
                    // no transfer touches the buffer while it is being filled.
                    let piece = unsafe { std::slice::from_raw_parts_mut(b.ptr.add(at), n) };
                    write_pattern(piece, seed, at);
                    Ok(())
                }
                #[cfg(feature = "cuda")]
                Self::Device(b) => {
                    let mut stage = vec![0u8; VRAM_STAGE.min(n)];
                    let mut done = 0;
                    while done < n {
                        let k = VRAM_STAGE.min(n - done);
                        write_pattern(&mut stage[..k], seed, at + done);
                        b.copy_from_host(at + done, &stage[..k])
                            .map_err(|e| e.to_string())?;
                        done += k;
                    }
                    Ok(())
                }
            }
        })
    }

    pub(crate) fn clear(&self, offset: usize, len: usize) -> Result<(), String> {
        self.write(offset, &vec![0u8; len])
    }

    /// Compares `[offset, offset + len)` (read back to the host for VRAM) with the pattern.
    pub(crate) fn check_pattern(&self, offset: usize, len: usize, seed: u64) -> Result<(), String> {
        let got = self.read(offset, len)?;
        let want = pattern_bytes(seed, offset, len);
        match got.iter().zip(&want).position(|(g, w)| g != w) {
            None => Ok(()),
            Some(i) => Err(format!(
                "{} byte {} is {:#04x}, expected {:#04x}",
                self.describe(),
                offset + i,
                got[i],
                want[i]
            )),
        }
    }
}

/// Registers `mem` with the agent's backends (all, or only `only`).
pub(crate) fn register(
    agent: &Agent,
    mem: &Mem,
    only: Option<&[&str]>,
) -> Result<nixl::RegistrationHandle, String> {
    let list = DescList::from_descs(mem.kind(), [mem.desc(0, mem.len())]);
    // SAFETY: every caller declares the handle after `mem`, so it is dropped (and the
    // memory deregistered) first; the benchmark tolerates peers writing it at any time.
    unsafe { agent.register_mem(&list, only) }
        .map_err(|e| format!("registering {}: {e}", mem.describe()))
}

pub(crate) fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The pattern word `index` (the 8 bytes at `8 * index`) of the pattern `seed`.
fn pattern_word(seed: u64, index: u64) -> [u8; 8] {
    splitmix64(seed ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93)).to_le_bytes()
}

/// Writes the bytes at `[offset, offset + dst.len())` of the pattern `seed` into `dst`:
/// every 8-byte word of the buffer a different hash of its index and the seed, so a
/// block at the wrong place, a stale block of another point and a partial copy all
/// differ. Whole words are written as such (this runs over tens of GiB at setup).
pub(crate) fn write_pattern(dst: &mut [u8], seed: u64, offset: usize) {
    // The bytes up to the first word boundary, the whole words, the bytes after.
    let head = ((8 - offset % 8) % 8).min(dst.len());
    let (head_bytes, rest) = dst.split_at_mut(head);
    for (i, b) in head_bytes.iter_mut().enumerate() {
        let at = offset + i;
        *b = pattern_word(seed, (at >> 3) as u64)[at & 7];
    }
    let first_word = ((offset + head) >> 3) as u64;
    let mut words = rest.chunks_exact_mut(8);
    let mut index = first_word;
    for word in &mut words {
        word.copy_from_slice(&pattern_word(seed, index));
        index += 1;
    }
    let tail = words.into_remainder();
    let last = pattern_word(seed, index);
    tail.copy_from_slice(&last[..tail.len()]);
}

/// The bytes at `[offset, offset + len)` of the pattern `seed` ([`write_pattern`]).
pub(crate) fn pattern_bytes(seed: u64, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    write_pattern(&mut out, seed, offset);
    out
}

/// NIXL nixlbench's initial initiator buffer byte (`XFERBENCH_INITIATOR_BUFFER_ELEMENT`;
/// the target's memory starts as the pattern [`TARGET_SEED`] instead).
pub(crate) const INITIATOR_FILL: u8 = 0xbb;

/// What the target's memory holds (READ's source).
pub(crate) const TARGET_SEED: u64 = 0x5EED_7A26;

/// WRITE's source pattern for one (block size, batch size) point.
pub(crate) fn point_seed(block: usize, batch: usize) -> u64 {
    splitmix64(((block as u64) << 24) ^ batch as u64 ^ 0xC0FF_EE00_0000_0000)
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_differs_by_seed_offset_and_point() {
        let a = pattern_bytes(point_seed(4096, 1), 0, 4096);
        assert_eq!(a, pattern_bytes(point_seed(4096, 1), 0, 4096));
        assert_ne!(a, pattern_bytes(point_seed(8192, 1), 0, 4096));
        assert_ne!(a, pattern_bytes(point_seed(4096, 2), 0, 4096));
        assert_ne!(a, pattern_bytes(point_seed(4096, 1), 8192, 4096));
        // Any sub-range, at any alignment, is the same bytes as the whole.
        assert_eq!(
            &a[13..1000],
            &pattern_bytes(point_seed(4096, 1), 13, 987)[..]
        );
        assert_ne!(a, pattern_bytes(TARGET_SEED, 0, 4096));
    }

    /// The word-at-a-time writer gives the bytes of the pattern as defined: word `i` of
    /// the buffer is `splitmix64(seed ^ i * K)` in little-endian, at any offset and length.
    #[test]
    fn pattern_is_the_word_hash_at_any_alignment() {
        let seed = 0x1234_5678_9abc_def0;
        let reference = |offset: usize, len: usize| -> Vec<u8> {
            (offset..offset + len)
                .map(|at| {
                    let w =
                        splitmix64(seed ^ ((at as u64) >> 3).wrapping_mul(0xD6E8_FEB8_6659_FD93));
                    w.to_le_bytes()[at & 7]
                })
                .collect()
        };
        for offset in [0, 1, 7, 8, 13, 4096, 4099] {
            for len in [0, 1, 5, 7, 8, 9, 16, 23, 100] {
                assert_eq!(
                    pattern_bytes(seed, offset, len),
                    reference(offset, len),
                    "{offset}+{len}"
                );
            }
        }
    }

    /// Buffers larger than a fill piece are filled by several threads, every piece once:
    /// the bytes and the progress count come out as one thread would have them.
    #[test]
    fn parallel_fill_covers_every_piece_once() {
        let len = 2 * FILL_PIECE + 4099;
        let setup = Setup::silent();
        let mem = Mem::alloc_init(
            MemKind::Dram,
            0,
            len,
            Init::Pattern(TARGET_SEED),
            false,
            &setup,
        )
        .unwrap();
        #[cfg(feature = "etcd")]
        assert_eq!(setup.report().done, len as u64);
        for at in [0, FILL_PIECE - 3, FILL_PIECE, 2 * FILL_PIECE, len - 4099] {
            mem.check_pattern(at, 4099.min(len - at), TARGET_SEED)
                .unwrap();
        }
        let seed = point_seed(1, 2);
        mem.fill_pattern_with(5, len - 5, seed, &setup).unwrap();
        mem.check_pattern(5, len - 5, seed).unwrap();
        assert_eq!(mem.read(0, 5).unwrap(), pattern_bytes(TARGET_SEED, 0, 5));
        let mem = Mem::alloc_init(
            MemKind::Dram,
            0,
            len,
            Init::Byte(INITIATOR_FILL),
            false,
            &setup,
        )
        .unwrap();
        assert_eq!(mem.read(len - 2, 2).unwrap(), vec![INITIATOR_FILL; 2]);
        assert!(fill_threads(len) <= 3 && fill_threads(1) == 1);
    }

    #[cfg(feature = "file")]
    #[test]
    fn shared_host_memory_is_a_dev_shm_mapping() {
        let o = crate::options::parse_args(&[
            "--backend".into(),
            "FILE".into(),
            "--max_block_size".into(),
            "16K".into(),
        ])
        .unwrap();
        assert_eq!(o.buffer_bytes(), 32 << 10);
        let mem = Mem::for_side_shared(&o, Side::Initiator, INITIATOR_FILL).unwrap();
        assert_eq!(mem.read(100, 2).unwrap(), vec![INITIATOR_FILL; 2]);
        #[allow(irrefutable_let_patterns)] // without feature cuda, Host is the only kind
        let Mem::Host(b) = &mem
        else {
            unreachable!()
        };
        let path = b.shm.clone().unwrap();
        assert!(path.starts_with("/dev/shm") && path.exists());
        mem.fill_pattern(0, 32 << 10, 7).unwrap();
        mem.check_pattern(0, 32 << 10, 7).unwrap();
        drop(mem);
        assert!(!path.exists(), "removed on drop");
    }

    /// Memory the machine cannot give is an error, never a panic or an abort.
    #[test]
    fn huge_allocations_fail_cleanly() {
        for len in [1usize << 60, isize::MAX as usize] {
            let e = Mem::alloc(MemKind::Dram, 0, len, INITIATOR_FILL, false)
                .err()
                .expect("no machine has this much memory");
            assert!(e.contains("allocating") && e.contains("lower"), "{e}");
        }
    }

    /// `--total_buffer_size 10000000000000` with blocks that touch it all: refused before
    /// anything is allocated, naming the flags to lower.
    #[test]
    fn runs_larger_than_the_machine_are_refused_first() {
        let o = crate::options::parse_args(&[
            "--total_buffer_size".into(),
            "10000000000000".into(),
            "--max_block_size".into(),
            "4000000000000".into(),
        ])
        .unwrap();
        let e = check_fits(&o, &[Side::Initiator, Side::Target]).unwrap_err();
        assert!(matches!(e, MemError::DramTooSmall { .. }), "{e}");
        let e = e.to_string();
        assert!(e.contains("lower --total_buffer_size"), "{e}");
        // The default sweep fits any machine that runs the tests.
        let o = crate::options::parse_args(&[]).unwrap();
        check_fits(&o, &[Side::Initiator, Side::Target]).unwrap();
    }

    /// Upstream's GPUNETIO line (a 32 GiB VRAM initiator) on a machine without a GPU: it
    /// says there is no GPU, before any size is looked at.
    #[cfg(all(feature = "cuda", feature = "etcd"))]
    #[test]
    fn no_gpu_is_said_before_sizes() {
        if gpunetio::device_count() > 0 {
            eprintln!("skipped: this machine has a GPU");
            return;
        }
        let line = "--etcd-endpoints http://etc_server_ip:2379 --backend=GPUNETIO \
                    --initiator_seg_type=VRAM --target_seg_type=DRAM --runtime_type=ETCD \
                    --gpunetio_device_list=0 --device_list=mlx5_0 --start_batch_size=512 \
                    --max_batch_size=512 --total_buffer_size=34359738368";
        let args: Vec<String> = line.split_whitespace().map(String::from).collect();
        let o = crate::options::parse_args(&args).unwrap();
        let e = check_fits(&o, &[Side::Initiator]).unwrap_err();
        assert!(
            matches!(e, MemError::NoDriver { .. } | MemError::NoGpu { .. }),
            "{e}"
        );
    }

    #[test]
    fn check_finds_the_first_wrong_byte() {
        let mem = Mem::alloc(MemKind::Dram, 0, 1 << 16, INITIATOR_FILL, false).unwrap();
        let seed = point_seed(4096, 2);
        mem.fill_pattern(8192, 4096, seed).unwrap();
        mem.check_pattern(8192, 4096, seed).unwrap();
        // A stale block (another point's pattern) and a cleared block both fail.
        assert!(mem.check_pattern(8192, 4096, point_seed(4096, 1)).is_err());
        assert!(mem.check_pattern(0, 4096, seed).is_err());
        let byte = mem.read(8192 + 1234, 1).unwrap()[0];
        mem.write(8192 + 1234, &[!byte]).unwrap();
        let e = mem.check_pattern(8192, 4096, seed).unwrap_err();
        assert!(e.contains("byte 9426"), "{e}");
        assert!(mem.write(1 << 16, &[0]).is_err());
    }
}
