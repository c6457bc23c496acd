//! Iovs: the memory I/O lands in. Host iovs are POSIX shared memory published as a
//! symlink in the mount's virtual iov directory; GPU iovs are `cuMemAlloc` memory (ours
//! or a framework's) published as a `gdr://` link carrying its CUDA-IPC handle.

use crate::client;
use crate::error::{Error, Result};
use crate::hf3fs::{
    self, Backend, LibIov, Resolved, HF3FS_SYNC_FROM_STORAGE, HF3FS_SYNC_TO_STORAGE,
};
use crate::shm::{open_segment, random_id, to_hex, Id, Shm, SHM_DIR};
use crate::virt::{self, GdrLink, IovRegistration};
use gpu_mem::{DeviceBuffer, DeviceMemoryRef, Gpu, IpcHandle, IpcMapping, IPC_HANDLE_BYTES};
use parking_lot::Mutex;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which way [`Iov::sync`] orders memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncDirection {
    /// Before a write to storage: work that filled the iov (kernels, copies) finishes.
    ToStorage,
    /// After a read from storage completed: the data is visible to later work.
    FromStorage,
}

/// What backs an iov; held for its `Drop` (unmap, free, close the IPC mapping).
#[derive(Debug)]
#[allow(dead_code)]
pub(crate) enum Memory {
    /// A `/dev/shm` segment we created (unlinked by `unlink`/`destroy`).
    HostCreated(Shm),
    /// Someone else's segment, mapped here.
    HostOpened(Shm),
    /// Memory the caller mapped; never unmapped here.
    HostWrapped,
    /// `cuMemAlloc` memory we allocated.
    GpuCreated(DeviceBuffer),
    /// A framework's device memory (only our publication is ours).
    GpuWrapped(DeviceMemoryRef),
    /// Another process's GPU iov mapped here by its IPC handle.
    GpuImported(IpcMapping),
    /// An iov of 3FS's library (host or GPU), destroyed through it.
    Hf3fs(LibIov),
}

#[derive(Debug)]
pub(crate) struct IovInner {
    pub(crate) id: Id,
    pub(crate) mount: PathBuf,
    pub(crate) base: u64,
    pub(crate) size: u64,
    block_size: u64,
    numa: i32,
    device: Option<usize>,
    /// Link to IPC-export again ([`Iov::export_gpu`]): handle and offset in allocation.
    gdr: Option<GdrLink>,
    memory: Memory,
    /// Our publication, removed by `unlink` (or when the last reference goes).
    link: Mutex<Option<PathBuf>>,
    /// The daemon connection that knows we own the publication (kept open while the
    /// iov lives, so the daemon removes the publication only if this process dies).
    _owner: Option<Arc<client::DaemonConn>>,
}

/// A region of host or GPU memory that I/O reads into or writes from (3FS's
/// `struct hf3fs_iov`). Cheap to clone; memory is released when the last clone and the
/// last I/O in flight on it are gone.
#[derive(Debug, Clone)]
pub struct Iov {
    pub(crate) inner: Arc<IovInner>,
}

/// What [`Iov::export_gpu`] hands to another process: the iov's id, device, size and
/// the CUDA-IPC handle (3FS's GDR fork calls it `hf3fs_gpu_ipc_handle_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuIovHandle {
    /// The iov's id (its name in the mount's iov directory).
    pub id: Id,
    /// The GPU ordinal in the exporting process.
    pub device: usize,
    /// The iov's size.
    pub size: u64,
    /// The iov's block size.
    pub block_size: u64,
    /// Offset of the iov in the allocation the handle names.
    pub offset: u64,
    /// The CUDA-IPC handle.
    pub ipc: IpcHandle,
}

/// Bytes of [`GpuIovHandle::to_bytes`].
pub const GPU_IOV_HANDLE_BYTES: usize = 16 + 8 * 4 + IPC_HANDLE_BYTES;

impl GpuIovHandle {
    /// A fixed-size encoding to send anywhere.
    pub fn to_bytes(&self) -> [u8; GPU_IOV_HANDLE_BYTES] {
        let mut out = [0u8; GPU_IOV_HANDLE_BYTES];
        out[..16].copy_from_slice(&self.id);
        out[16..24].copy_from_slice(&(self.device as u64).to_le_bytes());
        out[24..32].copy_from_slice(&self.size.to_le_bytes());
        out[32..40].copy_from_slice(&self.block_size.to_le_bytes());
        out[40..48].copy_from_slice(&self.offset.to_le_bytes());
        out[48..].copy_from_slice(self.ipc.as_bytes());
        out
    }

    /// Decodes [`GpuIovHandle::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != GPU_IOV_HANDLE_BYTES {
            return Err(Error::Malformed {
                what: "GPU iov handle",
                detail: format!("{} bytes, expected {GPU_IOV_HANDLE_BYTES}", bytes.len()),
            });
        }
        let u = |r: std::ops::Range<usize>| {
            u64::from_le_bytes(bytes[r].try_into().expect("8-byte range"))
        };
        Ok(Self {
            id: bytes[..16].try_into().expect("16 bytes"),
            device: u(16..24) as usize,
            size: u(24..32),
            block_size: u(32..40),
            offset: u(40..48),
            ipc: IpcHandle::from_bytes(&bytes[48..])?,
        })
    }
}

fn check_sizes(size: u64, block_size: u64) -> Result<()> {
    if size == 0 {
        return Err(Error::InvalidArgument("an iov of 0 bytes".into()));
    }
    if block_size != 0 && !size.is_multiple_of(block_size) {
        return Err(Error::InvalidArgument(format!(
            "block_size {block_size} does not divide size {size}"
        )));
    }
    Ok(())
}

fn shm_name(id: &Id) -> String {
    format!("hf3fs-gdr-iov-{}", to_hex(id))
}

/// Tells the daemon (if one runs) that this process owns the publication, so a crash
/// of this process gets it removed.
/// `segment_too`: the `/dev/shm` segment the publication names is ours to remove as well.
fn claim(
    mount: &Path,
    id: &Id,
    segment_too: bool,
    segment: Option<BorrowedFd<'_>>,
) -> Option<Arc<client::DaemonConn>> {
    let conn = client::connect(mount).ok()?;
    match conn.own_iov(id, segment_too, segment) {
        Ok(()) => Some(conn),
        Err(e) => {
            tracing::debug!("own iov {}: {e}", to_hex(id));
            None
        }
    }
}

impl Iov {
    // Private: every caller passes each part by position, in one place per kind of iov.
    #[allow(clippy::too_many_arguments)]
    fn new(
        id: Id,
        mount: &Path,
        base: u64,
        size: u64,
        block_size: u64,
        numa: i32,
        memory: Memory,
        device: Option<usize>,
        gdr: Option<GdrLink>,
        link: Option<PathBuf>,
        owner: Option<Arc<client::DaemonConn>>,
    ) -> Self {
        Self {
            inner: Arc::new(IovInner {
                id,
                mount: mount.to_path_buf(),
                base,
                size,
                block_size,
                numa,
                device,
                gdr,
                memory,
                link: Mutex::new(link),
                _owner: owner,
            }),
        }
    }

    fn from_lib(iov: LibIov, mount: &Path, size: u64, block_size: u64, numa: i32) -> Self {
        let (id, base, device) = (iov.id(), iov.base(), iov.device);
        Self::new(
            id,
            mount,
            base,
            size,
            block_size,
            numa,
            Memory::Hf3fs(iov),
            device,
            None,
            None,
            None,
        )
    }

    /// `size` bytes of shared host memory (on NUMA node `numa` when ≥ 0), published
    /// under `mount` (3FS's `hf3fs_iovcreate`).
    #[doc(alias = "hf3fs_iovcreate")]
    pub fn create(mount: impl AsRef<Path>, size: u64, block_size: u64, numa: i32) -> Result<Self> {
        let mount = mount.as_ref();
        check_sizes(size, block_size)?;
        if let Resolved::Hf3fs { lib, mount_point } = hf3fs::resolve(mount)? {
            let iov = LibIov::create(lib, &mount_point, size, block_size, numa)?;
            return Ok(Self::from_lib(iov, mount, size, block_size, numa));
        }
        virt::ensure_dirs(mount)?;
        let id = random_id()?;
        let shm = Shm::create(&shm_name(&id), size as usize)?;
        let published = shm.prefer_numa(numa).and_then(|()| {
            let target = shm.path().to_str().expect("ascii path").to_string();
            virt::publish(&virt::iovs_dir(mount), &id, &target)
        });
        let link = match published {
            Ok(link) => link,
            Err(e) => {
                let _ = shm.unlink();
                return Err(e);
            }
        };
        let owner = claim(mount, &id, true, Some(shm.fd()));
        let base = shm.as_ptr() as u64;
        Ok(Self::new(
            id,
            mount,
            base,
            size,
            block_size,
            numa,
            Memory::HostCreated(shm),
            None,
            None,
            Some(link),
            owner,
        ))
    }

    /// Opens an iov another process published (3FS's `hf3fs_iovopen`, and
    /// `hf3fs_iovopen_device` for GPU iovs, which are imported by their IPC handle).
    /// Destroying it releases only this process's mapping. On a 3FS mount this is
    /// `hf3fs_iovopen` (host iovs); GPU iovs there are reopened by id and device with
    /// [`Iov::import_gpu`] (`hf3fs_iovopen_device`).
    #[doc(alias = "hf3fs_iovopen")]
    #[doc(alias = "hf3fs_iovopen_device")]
    pub fn open(
        id: &Id,
        mount: impl AsRef<Path>,
        size: u64,
        block_size: u64,
        numa: i32,
    ) -> Result<Self> {
        let mount = mount.as_ref();
        check_sizes(size, block_size)?;
        if let Resolved::Hf3fs { lib, mount_point } = hf3fs::resolve(mount)? {
            let iov = LibIov::open(lib, id, &mount_point, size, block_size, numa, None)?;
            return Ok(Self::from_lib(iov, mount, size, block_size, numa));
        }
        let target = virt::read_publication(&virt::iovs_dir(mount), id)?;
        if GdrLink::is_gdr(&target) {
            let link = GdrLink::parse(&target)?;
            if link.size < size {
                return Err(Error::InvalidArgument(format!(
                    "GPU iov {} has {} bytes, fewer than {size}",
                    to_hex(id),
                    link.size
                )));
            }
            return Self::import_gpu(
                &GpuIovHandle {
                    id: *id,
                    device: link.device,
                    size,
                    block_size,
                    offset: link.offset,
                    ipc: link.ipc,
                },
                mount,
            );
        }
        let shm = Shm::open(Path::new(&target), size as usize)?;
        let base = shm.as_ptr() as u64;
        Ok(Self::new(
            *id,
            mount,
            base,
            size,
            block_size,
            numa,
            Memory::HostOpened(shm),
            None,
            None,
            None,
            None,
        ))
    }

    /// An iov over shared memory the caller already mapped at `base` — a segment
    /// published under `mount` as `id` (3FS's `hf3fs_iovwrap`). Nothing is unmapped or
    /// unlinked by this value.
    ///
    /// # Safety
    /// `[base, base + size)` is that segment's mapping and stays mapped while this iov,
    /// its clones or I/O on it live.
    #[doc(alias = "hf3fs_iovwrap")]
    pub unsafe fn wrap(
        base: *mut u8,
        id: &Id,
        mount: impl AsRef<Path>,
        size: u64,
        block_size: u64,
        numa: i32,
    ) -> Result<Self> {
        let mount = mount.as_ref();
        check_sizes(size, block_size)?;
        if base.is_null() {
            return Err(Error::InvalidArgument("wrap of a null pointer".into()));
        }
        if let Resolved::Hf3fs { lib, mount_point } = hf3fs::resolve(mount)? {
            // SAFETY: the caller keeps `base` mapped (this function's contract).
            let iov =
                unsafe { LibIov::wrap(lib, base, id, &mount_point, size, block_size, numa, None)? };
            return Ok(Self::from_lib(iov, mount, size, block_size, numa));
        }
        let target = virt::read_publication(&virt::iovs_dir(mount), id)?;
        if GdrLink::is_gdr(&target) {
            return Err(Error::InvalidArgument(format!(
                "{} is a GPU iov: use wrap_gpu or open",
                to_hex(id)
            )));
        }
        Ok(Self::new(
            *id,
            mount,
            base as u64,
            size,
            block_size,
            numa,
            Memory::HostWrapped,
            None,
            None,
            None,
            None,
        ))
    }

    /// Publishes a `/dev/shm` segment the caller created and mapped at `base` (its
    /// offset 0) as iov `id` under `mount`, and wraps it. Unlike [`Iov::wrap`], the
    /// publication is this iov's: [`Iov::unlink`], [`Iov::destroy`] or dropping the
    /// last clone removes the link and tells the daemon to drop its mapping of the
    /// segment (it would otherwise keep it until this process disconnects). The segment
    /// itself stays the caller's: it is never unmapped or unlinked here, not even by
    /// the daemon when this process dies (then only the link goes).
    ///
    /// `shm_path` must be a regular file directly under `/dev/shm` with at least
    /// `size` bytes. On a 3FS mount this is `Unsupported` (3FS's library publishes
    /// only segments it created: use [`Iov::create`] there).
    ///
    /// # Safety
    /// `[base, base + size)` is a shared mapping of `shm_path` from its offset 0, and
    /// stays mapped while this iov, its clones or I/O on it live.
    #[doc(alias = "hf3fs_iovwrap")]
    pub unsafe fn wrap_shm(
        base: *mut u8,
        shm_path: impl AsRef<Path>,
        id: &Id,
        mount: impl AsRef<Path>,
        size: u64,
        block_size: u64,
        numa: i32,
    ) -> Result<Self> {
        let (shm_path, mount) = (shm_path.as_ref(), mount.as_ref());
        check_sizes(size, block_size)?;
        if base.is_null() {
            return Err(Error::InvalidArgument("wrap of a null pointer".into()));
        }
        let target = shm_path
            .to_str()
            .filter(|t| host_target_allowed(t) && shm_path.parent() == Some(Path::new(SHM_DIR)))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} is not a segment directly under {SHM_DIR}",
                    shm_path.display()
                ))
            })?;
        let meta = std::fs::metadata(shm_path)
            .map_err(|e| crate::error::os_err("stat", e, shm_path.display()))?;
        if !meta.is_file() || meta.len() < size {
            return Err(Error::InvalidArgument(format!(
                "{} is not a regular file of at least {size} bytes ({} bytes)",
                shm_path.display(),
                meta.len()
            )));
        }
        if let Resolved::Hf3fs { .. } = hf3fs::resolve(mount)? {
            return Err(Error::Unsupported(format!(
                "wrap_shm on the 3FS mount {}: 3FS publishes only segments its library \
                 created (use Iov::create)",
                mount.display()
            )));
        }
        virt::ensure_dirs(mount)?;
        let segment = open_segment(Path::new(target))?;
        let link = virt::publish(&virt::iovs_dir(mount), id, target)?;
        let owner = claim(mount, id, false, Some(segment.as_fd()));
        Ok(Self::new(
            *id,
            mount,
            base as u64,
            size,
            block_size,
            numa,
            Memory::HostWrapped,
            None,
            None,
            Some(link),
            owner,
        ))
    }

    /// `size` bytes of exportable device memory on GPU `device`, published under
    /// `mount` for the daemon (the GDR design's `hf3fs_iovcreate_device`). Fails with
    /// `Unsupported`/`Gpu` errors where there is no GPU: never falls back to host memory.
    #[doc(alias = "hf3fs_iovcreate_device")]
    #[doc(alias = "hf3fs_iovcreate_gpu")]
    pub fn create_gpu(
        mount: impl AsRef<Path>,
        size: u64,
        block_size: u64,
        device: usize,
    ) -> Result<Self> {
        let mount = mount.as_ref();
        check_sizes(size, block_size)?;
        if let Resolved::Hf3fs { lib, mount_point } = hf3fs::resolve(mount)? {
            let iov = LibIov::create_device(lib, &mount_point, size, block_size, device)?;
            return Ok(Self::from_lib(iov, mount, size, block_size, -1));
        }
        virt::ensure_dirs(mount)?;
        let gpu = Gpu::open(device)?;
        let buf = DeviceBuffer::alloc(&gpu, size as usize)?;
        let link = GdrLink {
            device,
            size,
            ipc: buf.export_ipc()?,
            offset: 0,
        };
        let id = random_id()?;
        let path = virt::publish(&virt::iovs_dir(mount), &id, &link.format())?;
        let owner = claim(mount, &id, true, None);
        let base = buf.ptr();
        Ok(Self::new(
            id,
            mount,
            base,
            size,
            block_size,
            -1,
            Memory::GpuCreated(buf),
            Some(device),
            Some(link),
            Some(path),
            owner,
        ))
    }

    /// Publishes device memory a framework owns (`ptr`, `size` bytes on GPU `device`,
    /// checked to lie inside one `cuMemAlloc` allocation) as iov `id` (the GDR design's
    /// `hf3fs_iovwrap_device`). Destroying it removes only the publication.
    ///
    /// # Safety
    /// The memory stays allocated while this iov, its clones, its importers or I/O on
    /// it live.
    #[doc(alias = "hf3fs_iovwrap_device")]
    #[doc(alias = "hf3fs_iovwrap_gpu")]
    pub unsafe fn wrap_gpu(
        ptr: u64,
        id: &Id,
        mount: impl AsRef<Path>,
        size: u64,
        block_size: u64,
        device: usize,
    ) -> Result<Self> {
        let mount = mount.as_ref();
        check_sizes(size, block_size)?;
        if let Resolved::Hf3fs { lib, mount_point } = hf3fs::resolve(mount)? {
            // SAFETY: the caller keeps the device memory allocated (this function's
            // contract).
            let iov = unsafe {
                LibIov::wrap(
                    lib,
                    ptr as *mut u8,
                    id,
                    &mount_point,
                    size,
                    block_size,
                    -1,
                    Some(device),
                )?
            };
            return Ok(Self::from_lib(iov, mount, size, block_size, -1));
        }
        virt::ensure_dirs(mount)?;
        let view = DeviceMemoryRef::wrap(ptr, size, device)?;
        let (ipc, offset) = view.export_ipc()?;
        let link = GdrLink {
            device,
            size,
            ipc,
            offset,
        };
        let path = virt::publish(&virt::iovs_dir(mount), id, &link.format())?;
        let owner = claim(mount, id, true, None);
        Ok(Self::new(
            *id,
            mount,
            ptr,
            size,
            block_size,
            -1,
            Memory::GpuWrapped(view),
            Some(device),
            Some(link),
            Some(path),
            owner,
        ))
    }

    /// The handle another process passes to [`Iov::import_gpu`] (3FS GDR's
    /// `hf3fs_iov_export_gpu`).
    #[doc(alias = "hf3fs_iov_export_gpu")]
    pub fn export_gpu(&self) -> Result<GpuIovHandle> {
        if let (Some(_), Some(device)) = (self.inner.lib_iov(), self.inner.device) {
            // 3FS published it itself; another process reopens it by id and device.
            let view = DeviceMemoryRef::wrap(self.inner.base, self.inner.size, device)?;
            let (ipc, offset) = view.export_ipc()?;
            return Ok(GpuIovHandle {
                id: self.inner.id,
                device,
                size: self.inner.size,
                block_size: self.inner.block_size,
                offset,
                ipc,
            });
        }
        let link = self.inner.gdr.ok_or_else(|| {
            Error::InvalidArgument(format!("iov {} is not GPU memory", to_hex(&self.inner.id)))
        })?;
        Ok(GpuIovHandle {
            id: self.inner.id,
            device: link.device,
            size: self.inner.size,
            block_size: self.inner.block_size,
            offset: link.offset,
            ipc: link.ipc,
        })
    }

    /// Maps another process's GPU iov into this one (3FS GDR's `hf3fs_iov_import_gpu`).
    /// The exporter's publication stays the exporter's.
    #[doc(alias = "hf3fs_iov_import_gpu")]
    pub fn import_gpu(handle: &GpuIovHandle, mount: impl AsRef<Path>) -> Result<Self> {
        check_sizes(handle.size, handle.block_size)?;
        let mount = mount.as_ref();
        if let Resolved::Hf3fs { lib, mount_point } = hf3fs::resolve(mount)? {
            let iov = LibIov::open(
                lib,
                &handle.id,
                &mount_point,
                handle.size,
                handle.block_size,
                -1,
                Some(handle.device),
            )?;
            return Ok(Self::from_lib(
                iov,
                mount,
                handle.size,
                handle.block_size,
                -1,
            ));
        }
        let gpu = Gpu::open(handle.device)?;
        let mapping = IpcMapping::open(&gpu, &handle.ipc)?;
        if handle
            .offset
            .checked_add(handle.size)
            .is_none_or(|end| end > mapping.len())
        {
            return Err(Error::InvalidArgument(format!(
                "GPU iov {}+{} outside its allocation of {} bytes",
                handle.offset,
                handle.size,
                mapping.len()
            )));
        }
        let base = mapping.ptr() + handle.offset;
        Ok(Self::new(
            handle.id,
            mount,
            base,
            handle.size,
            handle.block_size,
            -1,
            Memory::GpuImported(mapping),
            Some(handle.device),
            Some(GdrLink {
                device: handle.device,
                size: handle.size,
                ipc: handle.ipc,
                offset: handle.offset,
            }),
            None,
            None,
        ))
    }

    /// The id (3FS's `iov->id`).
    pub fn id(&self) -> &Id {
        &self.inner.id
    }

    /// Which backend made it (and serves I/O on it).
    pub fn backend(&self) -> Backend {
        match self.inner.memory {
            Memory::Hf3fs(_) => Backend::Hf3fs,
            _ => Backend::LocalDaemon,
        }
    }

    /// The mount it is published under.
    pub fn mount(&self) -> &Path {
        &self.inner.mount
    }

    /// The address of its first byte: a host pointer, or a device pointer for GPU iovs.
    pub fn base(&self) -> u64 {
        self.inner.base
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.size
    }

    /// Block size (0: none).
    pub fn block_size(&self) -> u64 {
        self.inner.block_size
    }

    /// The NUMA node hint (−1: none).
    pub fn numa(&self) -> i32 {
        self.inner.numa
    }

    /// Whether it is GPU memory (3FS GDR's `hf3fs_iov_is_gpu` / `hf3fs_iov_mem_type`).
    #[doc(alias = "hf3fs_iov_is_gpu")]
    #[doc(alias = "hf3fs_iov_mem_type")]
    pub fn is_gpu(&self) -> bool {
        self.inner.device.is_some()
    }

    /// The GPU ordinal of a GPU iov (3FS GDR's `hf3fs_iov_device_id`).
    #[doc(alias = "hf3fs_iov_device_id")]
    #[doc(alias = "hf3fs_iov_gpu_device")]
    pub fn gpu_device(&self) -> Option<usize> {
        self.inner.device
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<u64> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.inner.size => Ok(self.inner.base + offset),
            _ => Err(Error::InvalidArgument(format!(
                "range {offset}+{len} outside an iov of {} bytes",
                self.inner.size
            ))),
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the iov (host or GPU).
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let src = self.check_range(offset, dst.len())?;
        match self.inner.device {
            None => {
                // SAFETY: the range is inside the mapping (checked); the daemon may write
                // it concurrently only while an I/O on it is in flight, which the caller
                // orders by waiting for the completion.
                unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len())
                };
                Ok(())
            }
            Some(device) => gpu_copy(device, |_| {
                // SAFETY: the device range is inside the iov (checked); `dst` is live.
                unsafe {
                    gpu_mem::cudarc::driver::sys::cuMemcpyDtoH_v2(
                        dst.as_mut_ptr().cast(),
                        src,
                        dst.len(),
                    )
                }
            }),
        }
    }

    /// Copies `src` into the iov at `offset` (host or GPU).
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<()> {
        let dst = self.check_range(offset, src.len())?;
        match self.inner.device {
            None => {
                // SAFETY: inside the mapping (checked); see `read_at`.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
                Ok(())
            }
            Some(device) => gpu_copy(device, |_| {
                // SAFETY: the device range is inside the iov (checked); `src` is live.
                unsafe {
                    gpu_mem::cudarc::driver::sys::cuMemcpyHtoD_v2(
                        dst,
                        src.as_ptr().cast(),
                        src.len(),
                    )
                }
            }),
        }
    }

    /// Orders the iov's memory against I/O (3FS GDR's `hf3fs_iovsync`).
    /// [`SyncDirection::ToStorage`] (before submitting writes) waits for this process's
    /// outstanding work on the iov's GPU, so kernels or copies filling it are done.
    /// [`SyncDirection::FromStorage`] (after reads completed) needs no device wait: the
    /// daemon posts a completion only after its copies into the iov finished, so it is
    /// a memory fence. Host iovs get a fence either way.
    #[doc(alias = "hf3fs_iovsync")]
    #[doc(alias = "hf3fs_iovsync_gpu")]
    pub fn sync(&self, direction: SyncDirection) -> Result<()> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if let Some(iov) = self.inner.lib_iov() {
            return iov.sync(match direction {
                SyncDirection::ToStorage => HF3FS_SYNC_TO_STORAGE,
                SyncDirection::FromStorage => HF3FS_SYNC_FROM_STORAGE,
            });
        }
        match (self.inner.device, direction) {
            (Some(device), SyncDirection::ToStorage) => gpu_copy(device, |_| {
                // SAFETY: no arguments; the device's context is current.
                unsafe { gpu_mem::cudarc::driver::sys::cuCtxSynchronize() }
            }),
            _ => Ok(()),
        }
    }

    /// Removes the publication (3FS's `hf3fs_iovunlink`): the daemon can no longer find
    /// it for new I/O, while this process keeps its memory. A host segment we created is
    /// unlinked from `/dev/shm` as well.
    #[doc(alias = "hf3fs_iovunlink")]
    pub fn unlink(&self) -> Result<()> {
        self.inner.unlink()
    }

    /// Unlinks and drops this handle (3FS's `hf3fs_iovdestroy`); memory goes when I/O
    /// still in flight on it has completed and been reaped.
    #[doc(alias = "hf3fs_iovdestroy")]
    #[doc(alias = "hf3fs_iovdestroy_gpu")]
    pub fn destroy(self) -> Result<()> {
        self.inner.unlink()
    }

    /// The host pointer of a host iov.
    pub fn as_ptr(&self) -> Option<*mut u8> {
        (!self.is_gpu()).then_some(self.inner.base as *mut u8)
    }
}

fn gpu_copy(
    device: usize,
    call: impl FnOnce(()) -> gpu_mem::cudarc::driver::sys::CUresult,
) -> Result<()> {
    let gpu = Gpu::open(device)?;
    gpu.bind()?;
    call(())
        .result()
        .map_err(|e| Error::Unsupported(format!("CUDA copy on GPU {device}: {e:?}")))
}

impl IovInner {
    /// What the daemon needs to serve this iov (see [`IovRegistration`]).
    pub(crate) fn registration(&self) -> Result<IovRegistration> {
        let dup = |shm: &Shm| {
            shm.fd()
                .try_clone_to_owned()
                .map_err(|e| crate::error::os_err("dup", e, shm.path().display()))
        };
        match &self.memory {
            Memory::HostCreated(shm) | Memory::HostOpened(shm) => {
                Ok(IovRegistration::Host(dup(shm)?))
            }
            // Memory the caller mapped: the segment its publication names, opened with
            // this process's own rights.
            Memory::HostWrapped => {
                let target = virt::read_publication(&virt::iovs_dir(&self.mount), &self.id)?;
                if !host_target_allowed(&target) {
                    return Err(Error::InvalidArgument(format!(
                        "iov {} points outside {SHM_DIR}: {target}",
                        to_hex(&self.id)
                    )));
                }
                Ok(IovRegistration::Host(open_segment(Path::new(&target))?))
            }
            Memory::GpuCreated(_) | Memory::GpuWrapped(_) | Memory::GpuImported(_) => self
                .gdr
                .map(IovRegistration::Gpu)
                .ok_or_else(|| Error::InvalidArgument("a GPU iov without its IPC link".into())),
            Memory::Hf3fs(_) => Err(Error::Unsupported(
                "an iov of 3FS's library is served by 3FS, not the local daemon".into(),
            )),
        }
    }

    /// The library's iov, for a 3FS ring.
    pub(crate) fn lib_iov(&self) -> Option<&LibIov> {
        match &self.memory {
            Memory::Hf3fs(iov) => Some(iov),
            _ => None,
        }
    }

    fn unlink(&self) -> Result<()> {
        if let Memory::Hf3fs(iov) = &self.memory {
            iov.unlink();
            return Ok(());
        }
        let link = self.link.lock().take();
        if let Some(link) = link {
            crate::shm::remove_if_present(&link)?;
            if let Memory::HostCreated(shm) = &self.memory {
                shm.unlink()?;
            }
            if let Some(conn) = client::existing(&self.mount) {
                conn.forget_iov(&self.id);
            }
        }
        Ok(())
    }
}

impl Drop for IovInner {
    fn drop(&mut self) {
        if let Err(e) = self.unlink() {
            tracing::warn!("iov {}: {e}", to_hex(&self.id));
        }
        // An iov opened or wrapped here and registered for I/O: the daemon's mapping goes.
        if let Some(conn) = client::existing(&self.mount) {
            conn.forget_registered(&self.id);
        }
    }
}

/// Where the daemon accepts a host segment: under `/dev/shm` only.
pub(crate) fn host_target_allowed(target: &str) -> bool {
    Path::new(target).starts_with(SHM_DIR) && !target.contains("/..")
}

#[allow(dead_code)]
fn assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Iov>();
}
