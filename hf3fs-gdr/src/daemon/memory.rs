//! The iovs the daemon maps for its clients' I/O: host iovs by their `/dev/shm`
//! segment, GPU iovs by their CUDA-IPC handle (one mapping per allocation, shared by the
//! iovs that are slices of it). A leaf module of the daemon: the data path and the
//! sessions both use it.

use crate::error::{Error, Result};
use crate::iov::host_target_allowed;
use crate::shm::{to_hex, Id, Shm};
use crate::virt::{self, GdrLink};
use gpu_mem::{Gpu, IpcMapping};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::Path;
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
    pub(crate) fn map(mount: &Path, id: &Id) -> Result<Self> {
        let target = virt::read_publication(&virt::iovs_dir(mount), id)?;
        if GdrLink::is_gdr(&target) {
            let link = GdrLink::parse(&target)?;
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
            return Ok(Self::Gpu {
                _mapping: mapping,
                gpu,
                base,
                size: link.size,
            });
        }
        if !host_target_allowed(&target) {
            return Err(Error::InvalidArgument(format!(
                "iov {} points outside /dev/shm: {target}",
                to_hex(id)
            )));
        }
        Ok(Self::Host {
            shm: Shm::open(Path::new(&target), 1)?,
        })
    }

    pub(crate) fn size(&self) -> u64 {
        match self {
            Self::Host { shm } => shm.len() as u64,
            Self::Gpu { size, .. } => *size,
        }
    }
}
