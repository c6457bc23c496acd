//! Descriptor lists resolved once for requests by index
//! ([`Backend::prep_list`](crate::backend::Backend::prep_list)).
//!
//! vLLM's connector prepares one list per KV cache (a descriptor per layer × K/V ×
//! block) and then makes a request per pull from block ids. Resolving a request's
//! descriptors one by one (the region's mapping, where each side lives, whether kernels
//! reach it) cost more than moving its bytes on one GPU. A local list keeps each
//! descriptor's address and location; a peer's list maps its regions once per GPU
//! that copies against them (at that GPU's first request) and keeps every
//! descriptor's address there. A request then looks each pair up in two tables.

use super::{CudaIpcBackend, Importer, LocalRegion, PairCopy, RemoteRegion, NAME};
use crate::backend::{BackendXfer, ListSide, PreparedList, XferOp};
use crate::backends::cuda_copy::{
    Copy, CopyBatch, CopyEngine, DeviceTable, GatherLists, GpuStreams, GpuXfer, MemLoc, NotifSink,
    KERNEL_MIN_COPIES,
};
use crate::backends::ipc_plane::KeepAlive;
use crate::error::{Error, Result};
use crate::mem::Desc;
use parking_lot::Mutex;
use std::any::Any;
use std::sync::Arc;

/// One descriptor of this agent's list: where it is, and where it lives.
#[derive(Debug, Clone, Copy)]
struct LocalSlot {
    addr: u64,
    len: u64,
    loc: MemLoc,
}

/// Largest descriptor the gather kernel takes (one block copies each descriptor whole).
const GATHER_MAX_BYTES: u64 = 256 << 10;

/// This agent's list as `CUDA_IPC` resolved it.
#[derive(Debug)]
pub(super) struct LocalList {
    slots: Vec<LocalSlot>,
    /// The GPU holding every descriptor, where all are VRAM of one GPU, no longer than
    /// [`GATHER_MAX_BYTES`] and few enough to be counted in 32 bits: such a list serves
    /// the gather kernel.
    gather_gpu: Option<usize>,
    /// Its addresses and lengths on that GPU, uploaded at the first gather.
    tables: Mutex<Option<(Arc<DeviceTable>, Arc<DeviceTable>)>>,
}

impl LocalList {
    fn new(slots: Vec<LocalSlot>) -> Self {
        let gpu = match slots.first().map(|s| s.loc) {
            Some(MemLoc::Gpu(g)) => Some(g),
            _ => None,
        };
        let gather_gpu = gpu.filter(|&g| {
            u32::try_from(slots.len()).is_ok()
                && slots
                    .iter()
                    .all(|s| s.loc == MemLoc::Gpu(g) && s.len <= GATHER_MAX_BYTES)
        });
        Self {
            slots,
            gather_gpu,
            tables: Mutex::default(),
        }
    }

    /// (addresses, lengths) on `pool`'s GPU.
    fn tables(&self, pool: &GpuStreams) -> Result<(Arc<DeviceTable>, Arc<DeviceTable>)> {
        let mut tables = self.tables.lock();
        if let Some(t) = &*tables {
            return Ok(t.clone());
        }
        let addrs: Vec<u64> = self.slots.iter().map(|s| s.addr).collect();
        let lens: Vec<u64> = self.slots.iter().map(|s| s.len).collect();
        let made = (
            Arc::new(DeviceTable::new(pool, &addrs)?),
            Arc::new(DeviceTable::new(pool, &lens)?),
        );
        *tables = Some(made.clone());
        Ok(made)
    }
}

impl PreparedList for LocalList {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A peer's list: its descriptors by region, mapped per copying GPU at first use.
#[derive(Debug)]
pub(super) struct RemoteList {
    agent: String,
    /// Each descriptor with the index of its region in `regions`.
    descs: Vec<(Desc, u32)>,
    regions: Vec<RemoteRegion>,
    /// By the local side's GPU (`None`: local DRAM): the list mapped for it.
    mapped: Mutex<Vec<(Option<usize>, Arc<MappedList>)>>,
}

impl PreparedList for RemoteList {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A peer's list mapped into this process for one copying GPU.
#[derive(Debug)]
struct MappedList {
    slots: Vec<MappedSlot>,
    sink: Arc<dyn NotifSink>,
    /// The GPU whose kernels reach every descriptor (all mapped for it, none staged), if
    /// one does: such a list serves the gather kernel.
    kernel_gpu: Option<usize>,
    /// Its addresses on that GPU, uploaded at the first gather.
    table: Mutex<Option<Arc<DeviceTable>>>,
    /// The mappings every address in `slots` points into.
    _keep: KeepAlive,
}

impl MappedList {
    /// The addresses on `pool`'s GPU.
    fn table(&self, pool: &GpuStreams) -> Result<Arc<DeviceTable>> {
        let mut table = self.table.lock();
        if let Some(t) = &*table {
            return Ok(t.clone());
        }
        let addrs: Vec<u64> = self.slots.iter().map(|s| s.addr).collect();
        let made = Arc::new(DeviceTable::new(pool, &addrs)?);
        *table = Some(made.clone());
        Ok(made)
    }
}

impl CudaIpcBackend {
    /// A request as one launch of the gather kernel over both lists' tables on the GPU,
    /// where it can run: many descriptors, the copy engine left to the kernel (`auto` or
    /// `kernel`), every local descriptor VRAM of one GPU, whose kernels reach every
    /// descriptor of the peer's list. `None`: the request is made copy by copy.
    fn gather(
        &self,
        op: XferOp,
        local: &LocalList,
        local_idx: &[usize],
        remote: &RemoteList,
        remote_idx: &[usize],
    ) -> Result<Option<Box<dyn BackendXfer>>> {
        let Some(gpu) = local.gather_gpu else {
            return Ok(None);
        };
        if local_idx.len() < KERNEL_MIN_COPIES
            || !matches!(self.copy_engine, CopyEngine::Auto | CopyEngine::Kernel)
        {
            return Ok(None);
        }
        let mapped = remote.mapped_for(self, Some(gpu))?;
        if mapped.kernel_gpu != Some(gpu) {
            return Ok(None);
        }
        // The kernel indexes the tables with these: each must be inside its list.
        if let Some(&i) = local_idx.iter().find(|&&i| i >= local.slots.len()) {
            return Err(Error::InvalidParam(format!(
                "{NAME}: local index {i} is out of range"
            )));
        }
        if let Some(&i) = remote_idx.iter().find(|&&i| i >= mapped.slots.len()) {
            return Err(Error::InvalidParam(format!(
                "{NAME}: remote index {i} is out of range"
            )));
        }
        let pool = self.streams.get(gpu)?;
        let (local_addrs, lens) = local.tables(&pool)?;
        let remote_addrs = mapped.table(&pool)?;
        let (lists, read) = match op {
            XferOp::Write => (
                GatherLists {
                    src: local_addrs,
                    dst: remote_addrs,
                    lens,
                    lens_by_dst: false,
                },
                false,
            ),
            XferOp::Read => (
                GatherLists {
                    src: remote_addrs,
                    dst: local_addrs,
                    lens,
                    lens_by_dst: true,
                },
                true,
            ),
        };
        // Both lists hold fewer than 2^32 descriptors (`gather_gpu`, `kernel_gpu`).
        let pairs = local_idx.iter().zip(remote_idx).map(|(&l, &r)| {
            let (l, r) = (l as u32, r as u32);
            if read {
                (r, l)
            } else {
                (l, r)
            }
        });
        let Some(batch) = CopyBatch::gather(pool, lists, pairs)? else {
            return Ok(None);
        };
        let sink = mapped.sink.clone();
        Ok(Some(Box::new(GpuXfer::of_batch(
            batch,
            sink,
            vec![mapped as Arc<dyn Any + Send + Sync>],
        ))))
    }
}

/// One descriptor of a peer's list, mapped: see [`super::MappedRange`].
#[derive(Debug, Clone, Copy)]
struct MappedSlot {
    addr: u64,
    gpu: usize,
    kernel_reach: bool,
    staged_home: Option<usize>,
}

impl RemoteList {
    /// The list mapped for copies whose local side is on `local_gpu` (made once).
    fn mapped_for(
        &self,
        backend: &CudaIpcBackend,
        local_gpu: Option<usize>,
    ) -> Result<Arc<MappedList>> {
        let mut mapped = self.mapped.lock();
        if let Some((_, m)) = mapped.iter().find(|(g, _)| *g == local_gpu) {
            return Ok(m.clone());
        }
        let mut importer = Importer::new(backend, &self.agent, None)?;
        let slots = self
            .descs
            .iter()
            .map(|&(desc, region)| {
                let md = self.regions.get(region as usize).ok_or_else(|| {
                    Error::InvalidParam(format!("{NAME}: a prepared list lost a region"))
                })?;
                importer.map(desc, md, local_gpu).map(|m| MappedSlot {
                    addr: m.addr,
                    gpu: m.gpu,
                    kernel_reach: m.kernel_reach,
                    staged_home: m.staged_home,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let kernel_gpu = slots.first().map(|s| s.gpu).filter(|&g| {
            u32::try_from(slots.len()).is_ok()
                && slots
                    .iter()
                    .all(|s| s.gpu == g && s.kernel_reach && s.staged_home.is_none())
        });
        let list = Arc::new(MappedList {
            slots,
            sink: importer.sink(),
            kernel_gpu,
            table: Mutex::default(),
            _keep: importer.keep,
        });
        mapped.push((local_gpu, list.clone()));
        Ok(list)
    }
}

impl CudaIpcBackend {
    /// `Backend::prep_list`: a local list's addresses and locations (DRAM pinned now),
    /// or a peer's descriptors with their regions (mapped at first use, per GPU).
    pub(super) fn prepare_list(&self, side: ListSide<'_>) -> Result<Arc<dyn PreparedList>> {
        match side {
            ListSide::Local(entries) => {
                let slots = entries
                    .iter()
                    .map(|e| {
                        let loc = match e.md.as_any().downcast_ref::<LocalRegion>() {
                            Some(LocalRegion::Dram(pin)) => MemLoc::Host {
                                pinned: pin.ensure(),
                            },
                            Some(LocalRegion::Vram { .. }) => MemLoc::Gpu(e.desc.dev_id as usize),
                            None => {
                                return Err(Error::InvalidParam(format!(
                                    "{NAME}: local metadata of another backend"
                                )))
                            }
                        };
                        Ok(LocalSlot {
                            addr: e.desc.addr,
                            len: e.desc.len,
                            loc,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Arc::new(LocalList::new(slots)))
            }
            ListSide::Remote { agent, entries } => {
                let mut regions: Vec<RemoteRegion> = Vec::new();
                // Distinct regions by their metadata's address (stable while borrowed).
                let mut seen: Vec<(*const (), u32)> = Vec::new();
                let mut descs = Vec::with_capacity(entries.len());
                for e in entries {
                    let key = e.md as *const _ as *const ();
                    let index = match seen.iter().rev().find(|(k, _)| *k == key) {
                        Some(&(_, i)) => i,
                        None => {
                            let region =
                                e.md.as_any()
                                    .downcast_ref::<RemoteRegion>()
                                    .ok_or_else(|| {
                                        Error::InvalidParam(format!(
                                            "{NAME}: remote metadata of another backend"
                                        ))
                                    })?;
                            let i = u32::try_from(regions.len()).map_err(|_| {
                                Error::InvalidParam(format!("{NAME}: too many regions"))
                            })?;
                            regions.push(region.clone());
                            seen.push((key, i));
                            i
                        }
                    };
                    descs.push((e.desc, index));
                }
                Ok(Arc::new(RemoteList {
                    agent: agent.to_string(),
                    descs,
                    regions,
                    mapped: Mutex::default(),
                }))
            }
        }
    }

    /// `Backend::prep_xfer_indexed`: each pair looked up in the two tables, then the
    /// same copies `Backend::prep_xfer` makes.
    pub(super) fn prepare_indexed(
        &self,
        op: XferOp,
        local: &dyn PreparedList,
        local_idx: &[usize],
        remote: &dyn PreparedList,
        remote_idx: &[usize],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        let (Some(local), Some(remote)) = (
            local.as_any().downcast_ref::<LocalList>(),
            remote.as_any().downcast_ref::<RemoteList>(),
        ) else {
            return Err(Error::InvalidParam(format!(
                "{NAME}: prepared lists of another backend"
            )));
        };
        if remote.agent != agent {
            return Err(Error::InvalidParam(format!(
                "{NAME}: a list of `{}` used for `{agent}`",
                remote.agent
            )));
        }
        let out_of_range = |which: &str, i: usize| {
            Error::InvalidParam(format!("{NAME}: {which} index {i} is out of range"))
        };
        if let Some(xfer) = self.gather(op, local, local_idx, remote, remote_idx)? {
            return Ok(xfer);
        }
        let mut copies: Vec<(usize, Copy)> = Vec::with_capacity(local_idx.len());
        let mut staged = Vec::new();
        let mut keep: KeepAlive = Vec::new();
        let mut current: Option<(Option<usize>, Arc<MappedList>)> = None;
        for (&li, &ri) in local_idx.iter().zip(remote_idx) {
            let l = *local
                .slots
                .get(li)
                .ok_or_else(|| out_of_range("local", li))?;
            let local_gpu = match l.loc {
                MemLoc::Gpu(g) => Some(g),
                MemLoc::Host { .. } => None,
            };
            let mapped = match &current {
                Some((g, m)) if *g == local_gpu => m,
                _ => {
                    let m = remote.mapped_for(self, local_gpu)?;
                    keep.push(m.clone());
                    &current.insert((local_gpu, m)).1
                }
            };
            let r = *mapped
                .slots
                .get(ri)
                .ok_or_else(|| out_of_range("remote", ri))?;
            let remote_loc = if r.kernel_reach {
                MemLoc::Gpu(r.gpu)
            } else {
                MemLoc::Host { pinned: false }
            };
            PairCopy {
                gpu: r.gpu,
                staged_home: r.staged_home,
                local: (l.addr, l.loc),
                remote: (r.addr, remote_loc),
                len: l.len,
            }
            .place(op, &mut copies, &mut staged);
        }
        let Some((_, mapped)) = current else {
            return Err(Error::InvalidParam(format!(
                "{NAME}: a transfer needs at least one descriptor"
            )));
        };
        let sink = mapped.sink.clone();
        Ok(Box::new(
            GpuXfer::new(
                &self.streams,
                copies,
                usize::MAX,
                self.copy_engine,
                sink,
                keep,
            )?
            .with_staged(&self.streams, staged)?,
        ))
    }
}
