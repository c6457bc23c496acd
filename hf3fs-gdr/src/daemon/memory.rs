//! The iovs the daemon maps for its clients' I/O: host iovs by their `/dev/shm`
//! segment, GPU iovs by their CUDA-IPC handle (one mapping per allocation, shared by the
//! iovs that are slices of it), both as the client handed them over (`OP_REG_IOV`). A leaf module of the daemon: the data path and the
//! sessions both use it.

use crate::error::{Error, Result};
use crate::shm::{to_hex, Id, Shm};
use crate::virt::GdrLink;
use gpu_mem::{Gpu, IpcMapping};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Weak};

/// An iov mapped into the daemon.
#[derive(Debug)]
pub(crate) enum MappedIov {
    Host {
        shm: Shm,
    },
    Gpu {
        _mapping: Arc<IpcMapping>,
        gpu: Gpu,
        /// Device address of the iov's first byte in this process.
        base: u64,
        size: u64,
    },
}

/// The daemon's CUDA-IPC mappings by (device, handle): iovs that are parts of one
/// allocation (a client's threads registering slices of one buffer) share its mapping —
/// a process opens an IPC handle once; a second open of the same handle can fail.
type IpcMappings = Mutex<HashMap<(usize, gpu_mem::IpcHandle), Weak<IpcMapping>>>;

fn shared_mapping(gpu: &Gpu, handle: &gpu_mem::IpcHandle) -> Result<Arc<IpcMapping>> {
    static MAPPINGS: std::sync::OnceLock<IpcMappings> = std::sync::OnceLock::new();
    let mut map = MAPPINGS.get_or_init(Default::default).lock();
    let key = (gpu.ordinal(), *handle);
    if let Some(m) = map.get(&key).and_then(Weak::upgrade) {
        return Ok(m);
    }
    map.retain(|_, m| m.strong_count() > 0);
    let m = Arc::new(IpcMapping::open(gpu, handle)?);
    map.insert(key, Arc::downgrade(&m));
    Ok(m)
}

impl MappedIov {
    /// A host iov from the descriptor its client passed: shared memory, open read-write
    /// (the kernel refuses a writable shared mapping of a read-only or `O_PATH`
    /// descriptor, so the client reaches nothing it could not write itself) and name a
    /// regular file. All of the file is mapped; a client that truncates it later makes
    /// only its own I/O fail (`pread`/`pwrite` into a missing page return `EFAULT`, the
    /// daemon never touches iov memory itself).
    pub(crate) fn host(fd: OwnedFd, id: &Id) -> Result<Self> {
        // SAFETY: a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 || flags & libc::O_PATH != 0 || flags & libc::O_ACCMODE != libc::O_RDWR {
            return Err(Error::InvalidArgument(format!(
                "iov {}: the descriptor is not open for reading and writing",
                to_hex(id)
            )));
        }
        // Shared memory only (tmpfs, memfd, hugetlbfs): a file of another file system
        // could be one the client serves itself (FUSE), whose page faults it could stall
        // forever, and with them a worker every client shares.
        // SAFETY: plain C struct.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: a descriptor we own and a valid out-pointer.
        let ret = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) };
        if ret < 0 || !matches!(fs.f_type, libc::TMPFS_MAGIC | libc::HUGETLBFS_MAGIC) {
            return Err(Error::InvalidArgument(format!(
                "iov {}: not shared memory (tmpfs, memfd or hugetlbfs)",
                to_hex(id)
            )));
        }
        let label = PathBuf::from(format!("iov {}", to_hex(id)));
        Ok(Self::Host {
            shm: Shm::from_fd(fd, 1, &label)?,
        })
    }

    /// A GPU iov by the CUDA-IPC handle its client sent (a handle is a capability: the
    /// client had it, so it could open the memory itself).
    pub(crate) fn gpu(id: &Id, link: &GdrLink) -> Result<Self> {
        let gpu = Gpu::open(link.device)?;
        let mapping = shared_mapping(&gpu, &link.ipc)?;
        if link
            .offset
            .checked_add(link.size)
            .is_none_or(|e| e > mapping.len())
        {
            return Err(Error::InvalidArgument(format!(
                "GPU iov {}: {}+{} outside its allocation of {} bytes",
                to_hex(id),
                link.offset,
                link.size,
                mapping.len()
            )));
        }
        let base = mapping.ptr() + link.offset;
        Ok(Self::Gpu {
            _mapping: mapping,
            gpu,
            base,
            size: link.size,
        })
    }

    pub(crate) fn size(&self) -> u64 {
        match self {
            Self::Host { shm } => shm.len() as u64,
            Self::Gpu { size, .. } => *size,
        }
    }
}
