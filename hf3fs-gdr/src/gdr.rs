//! The GPU memory registration manager (3FS's GDR manager, feature `rdma`): registers
//! GPU and host memory with RDMA devices through a [`RegistrationCache`] keyed by
//! memory domain and address range.
//!
//! GPU memory is registered **DMA-BUF first** — the range is exported with
//! `cuMemGetHandleForAddressRange` and registered with `ibv_reg_dmabuf_mr`, which needs
//! no kernel module beyond the GPU driver and a DMA-BUF capable NIC — and where that is
//! unsupported (older kernel or driver, soft-RoCE), by **peer memory**: `ibv_reg_mr` on
//! the device pointer, which works where `nvidia-peermem` is loaded. Host memory takes
//! `ibv_reg_mr`. [`GpuRegistration`] narrows the choice.
//!
//! Each registration covers every device of the registrar (one memory region each,
//! in [`MemoryRegistrar::devices`] order). Memory the caller owns stays cached until
//! [`MemoryRegistrar::invalidate`] is called for it (do so before freeing it); memory
//! handed over as an `Arc` ([`MemoryRegistrar::register_owned`]) is kept alive by its
//! registration and released with the last handle.

use crate::error::{Error, Result};
use crate::regcache::{Handle, MemoryDomain, RegistrationCache};
use ibverbs::{AccessFlags, Context, MemoryRegion, ProtectionDomain};
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// How GPU memory is registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuRegistration {
    /// DMA-BUF, else peer memory (the default).
    #[default]
    DmaBufFirst,
    /// DMA-BUF only: `Unsupported` where it is.
    DmaBufOnly,
    /// Peer memory only (`ibv_reg_mr` on the device pointer).
    PeerMemoryOnly,
}

/// How a registration was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistrationMethod {
    /// `ibv_reg_mr` of host memory.
    Host,
    /// `ibv_reg_dmabuf_mr` of a DMA-BUF of the memory.
    DmaBuf,
    /// `ibv_reg_mr` of a device pointer (`nvidia-peermem`).
    PeerMemory,
}

/// The memory regions of one registration, one per device of the registrar.
#[derive(Debug)]
pub struct Registered {
    method: RegistrationMethod,
    mrs: Vec<MemoryRegion>,
    /// Why DMA-BUF was not used, where peer memory was.
    dmabuf_refusal: Option<String>,
}

impl Registered {
    /// How it was registered.
    pub fn method(&self) -> RegistrationMethod {
        self.method
    }

    /// The memory region on device `index` (in [`MemoryRegistrar::devices`] order).
    pub fn mr(&self, index: usize) -> Option<&MemoryRegion> {
        self.mrs.get(index)
    }

    /// All memory regions, in device order.
    pub fn mrs(&self) -> &[MemoryRegion] {
        &self.mrs
    }

    /// Why DMA-BUF registration was not used (when the method is peer memory).
    pub fn dmabuf_refusal(&self) -> Option<&str> {
        self.dmabuf_refusal.as_deref()
    }
}

/// A counted handle on a cached registration.
pub type Registration = Handle<Registered>;

/// Memory whose lifetime a registration can hold (an `Arc` of it).
pub trait OwnedMemory: Send + Sync + 'static {
    /// Where it lives.
    fn domain(&self) -> MemoryDomain;
    /// Its first byte's address (host virtual or device).
    fn addr(&self) -> u64;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl OwnedMemory for gpu_mem::DeviceBuffer {
    fn domain(&self) -> MemoryDomain {
        MemoryDomain::Gpu(self.gpu().ordinal())
    }
    fn addr(&self) -> u64 {
        self.ptr()
    }
    fn len(&self) -> usize {
        gpu_mem::DeviceBuffer::len(self)
    }
}

impl OwnedMemory for crate::Iov {
    fn domain(&self) -> MemoryDomain {
        self.gpu_device()
            .map_or(MemoryDomain::Host, MemoryDomain::Gpu)
    }
    fn addr(&self) -> u64 {
        self.base()
    }
    fn len(&self) -> usize {
        self.size() as usize
    }
}

/// Page-aligned, zeroed host memory of our own (anonymous `mmap`), for registrations
/// that own their buffer.
#[derive(Debug)]
pub struct HostMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain process memory; access through raw pointers is the user's to order
// (as with any registered memory).
unsafe impl Send for HostMemory {}
// SAFETY: see `Send`.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// `len` zeroed bytes.
    pub fn alloc(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("host memory of 0 bytes".into()));
        }
        // SAFETY: a fresh private anonymous mapping; no existing memory is involved.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(crate::error::os_err(
                "mmap",
                std::io::Error::last_os_error(),
                format!("{len} bytes"),
            ));
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl OwnedMemory for HostMemory {
    fn domain(&self) -> MemoryDomain {
        MemoryDomain::Host
    }
    fn addr(&self) -> u64 {
        self.ptr as u64
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once; registrations holding it are gone (they
        // own the `Arc` this lives in).
        if unsafe { libc::munmap(self.ptr.cast(), self.len) } != 0 {
            tracing::warn!("munmap host memory: {}", std::io::Error::last_os_error());
        }
    }
}

/// One RDMA device of the registrar.
#[derive(Debug)]
pub struct RdmaDevice {
    pd: ProtectionDomain,
}

impl RdmaDevice {
    /// The device's name (`rxe0`, `mlx5_0`).
    pub fn name(&self) -> &str {
        self.pd.context().name()
    }

    /// Its protection domain (queue pairs using the registrations must share it).
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Its context.
    pub fn context(&self) -> &Context {
        self.pd.context()
    }
}

/// Registers memory with RDMA devices and caches the registrations (3FS's GDR
/// manager; see the module docs).
#[derive(Debug)]
pub struct MemoryRegistrar {
    devices: Vec<RdmaDevice>,
    access: AccessFlags,
    gpu: GpuRegistration,
    cache: RegistrationCache<Registered>,
}

fn rdma_err(what: impl Into<String>, e: ibverbs::Error) -> Error {
    match e {
        ibverbs::Error::Unsupported { .. } => Error::Unsupported(format!("{}: {e}", what.into())),
        source => Error::Rdma {
            what: what.into(),
            source,
        },
    }
}

impl MemoryRegistrar {
    /// A registrar over the devices named (all devices of the machine when `names` is
    /// empty), each with a new protection domain.
    pub fn open(names: &[&str]) -> Result<Self> {
        let list = ibverbs::devices().map_err(|e| rdma_err("ibv_get_device_list", e))?;
        let mut pds = Vec::new();
        for dev in list.iter() {
            let name = dev.name();
            if !names.is_empty() && !names.contains(&name.as_str()) {
                continue;
            }
            let ctx = dev
                .open()
                .map_err(|e| rdma_err(format!("open {name}"), e))?;
            pds.push(
                ctx.alloc_pd()
                    .map_err(|e| rdma_err(format!("alloc_pd on {name}"), e))?,
            );
        }
        if let Some(missing) = names
            .iter()
            .find(|n| !pds.iter().any(|pd| pd.context().name() == **n))
        {
            return Err(Error::InvalidArgument(format!(
                "no RDMA device called {missing}"
            )));
        }
        Self::from_pds(pds)
    }

    /// A registrar over existing protection domains (so queue pairs on them can use
    /// its registrations).
    pub fn from_pds(pds: Vec<ProtectionDomain>) -> Result<Self> {
        if pds.is_empty() {
            return Err(Error::Unsupported(
                "no RDMA device to register memory with".into(),
            ));
        }
        Ok(Self {
            devices: pds.into_iter().map(|pd| RdmaDevice { pd }).collect(),
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            gpu: GpuRegistration::default(),
            cache: RegistrationCache::new(),
        })
    }

    /// Access rights of new registrations (default: local write, remote read and write).
    pub fn with_access(mut self, access: AccessFlags) -> Self {
        self.access = access;
        self
    }

    /// How GPU memory is registered (default: DMA-BUF first).
    pub fn with_gpu_registration(mut self, gpu: GpuRegistration) -> Self {
        self.gpu = gpu;
        self
    }

    /// The devices, in the order of each registration's memory regions.
    pub fn devices(&self) -> &[RdmaDevice] {
        &self.devices
    }

    /// The cache (statistics, size).
    pub fn cache(&self) -> &RegistrationCache<Registered> {
        &self.cache
    }

    /// A registration covering `[addr, addr + len)` of `domain`: a cached one, or a new
    /// one kept until [`Self::invalidate`].
    ///
    /// # Safety
    /// The range is memory of this process (host, or device memory of that GPU) that
    /// stays allocated until it is invalidated here and every handle is dropped; while
    /// registered the devices may read and write it as the access flags allow.
    pub unsafe fn register(
        &self,
        domain: MemoryDomain,
        addr: u64,
        len: usize,
    ) -> Result<Registration> {
        self.cache
            .get_or_register(domain, addr, len as u64, || self.make(domain, addr, len))
    }

    /// Registers memory the registration then holds (and frees with its last handle).
    pub fn register_owned<M: OwnedMemory>(&self, memory: Arc<M>) -> Result<Registration> {
        let (domain, addr, len) = (memory.domain(), memory.addr(), memory.len());
        self.cache
            .get_or_register_owned(memory, domain, addr, len as u64, || {
                self.make(domain, addr, len)
            })
    }

    /// Registers `len` bytes at `offset` of a DMA-BUF someone exported, addressed as
    /// `iova` in `domain` (cached like caller memory). `Unsupported` where a device
    /// cannot register DMA-BUF memory.
    pub fn register_dmabuf(
        &self,
        domain: MemoryDomain,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> Result<Registration> {
        self.cache.get_or_register(domain, iova, len as u64, || {
            Ok(Registered {
                method: RegistrationMethod::DmaBuf,
                mrs: self.reg_dmabuf(fd, offset, len, iova)?,
                dmabuf_refusal: None,
            })
        })
    }

    /// A cached registration covering the range, if any.
    pub fn lookup(&self, domain: MemoryDomain, addr: u64, len: usize) -> Option<Registration> {
        self.cache.lookup(domain, addr, len as u64)
    }

    /// Forgets every registration overlapping the range (call before freeing it);
    /// returns how many. Handles still held keep theirs until dropped.
    pub fn invalidate(&self, domain: MemoryDomain, addr: u64, len: usize) -> usize {
        self.cache.invalidate(domain, addr, len as u64)
    }

    fn reg_dmabuf(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> Result<Vec<MemoryRegion>> {
        self.devices
            .iter()
            .map(|d| {
                d.pd.reg_dmabuf_mr(fd, offset, len, iova, self.access)
                    .map_err(|e| rdma_err(format!("ibv_reg_dmabuf_mr on {}", d.name()), e))
            })
            .collect()
    }

    fn reg_pointer(&self, addr: u64, len: usize) -> Result<Vec<MemoryRegion>> {
        self.devices
            .iter()
            .map(|d| {
                // SAFETY: the callers (`register`'s contract, `register_owned`'s Arc)
                // keep the range allocated while the region lives.
                unsafe { d.pd.reg_mr_raw(addr as *mut u8, len, self.access) }
                    .map_err(|e| rdma_err(format!("ibv_reg_mr on {}", d.name()), e))
            })
            .collect()
    }

    fn make(&self, domain: MemoryDomain, addr: u64, len: usize) -> Result<Registered> {
        let device = match domain {
            MemoryDomain::Host => {
                return Ok(Registered {
                    method: RegistrationMethod::Host,
                    mrs: self.reg_pointer(addr, len)?,
                    dmabuf_refusal: None,
                })
            }
            MemoryDomain::Gpu(device) => device,
        };
        let mut refusal = None;
        if self.gpu != GpuRegistration::PeerMemoryOnly {
            let attempt = export_dmabuf(device, addr, len as u64)
                .and_then(|(fd, offset)| self.reg_dmabuf(fd.as_fd(), offset, len, addr));
            match attempt {
                Ok(mrs) => {
                    return Ok(Registered {
                        method: RegistrationMethod::DmaBuf,
                        mrs,
                        dmabuf_refusal: None,
                    })
                }
                Err(e) if self.gpu == GpuRegistration::DmaBufOnly => return Err(e),
                Err(e) => {
                    tracing::debug!(
                        "GPU {device} {addr:#x}+{len}: DMA-BUF refused ({e}), peer memory next"
                    );
                    refusal = Some(e.to_string());
                }
            }
        }
        let mrs = self.reg_pointer(addr, len).map_err(|e| match &refusal {
            Some(why) => Error::Unsupported(format!(
                "GPU {device} {addr:#x}+{len} registers neither by DMA-BUF ({why}) nor as peer memory ({e})"
            )),
            None => e,
        })?;
        Ok(Registered {
            method: RegistrationMethod::PeerMemory,
            mrs,
            dmabuf_refusal: refusal,
        })
    }
}

/// A DMA-BUF of the page-aligned range around `[addr, addr + len)` of GPU `device`,
/// and the offset of `addr` in it.
fn export_dmabuf(device: usize, addr: u64, len: u64) -> Result<(OwnedFd, u64)> {
    use gpu_mem::cudarc::driver::sys;
    let gpu = gpu_mem::Gpu::open(device)?;
    if !gpu.dmabuf_supported() {
        return Err(Error::Unsupported(format!(
            "GPU {device} cannot export DMA-BUF (driver or kernel lacks support)"
        )));
    }
    // SAFETY: plain libc query.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let start = addr / page * page;
    let end = addr
        .checked_add(len)
        .map(|e| e.next_multiple_of(page))
        .ok_or_else(|| Error::InvalidArgument(format!("range {addr:#x}+{len} overflows")))?;
    gpu.bind()?;
    let mut fd: libc::c_int = -1;
    // SAFETY: for DMA_BUF_FD handles the driver writes an `int` to the out-pointer; the
    // range is page aligned.
    let result = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut libc::c_int).cast(),
            start,
            (end - start) as usize,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    result.result().map_err(|e| {
        Error::Unsupported(format!(
            "cuMemGetHandleForAddressRange {start:#x}+{}: {e:?}",
            end - start
        ))
    })?;
    // SAFETY: a new descriptor the driver handed over, owned from here.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, addr - start))
}
