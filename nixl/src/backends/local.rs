//! `LOCAL`: transfers between two buffers of the same agent: DRAM↔DRAM by `memcpy`, and
//! with feature `cuda` VRAM↔VRAM and VRAM↔DRAM on the backend's own streams (parameter
//! `num_streams`, default 4 per GPU), completed by events that status polls: many small
//! copies as one gather/scatter kernel, others by `cuMemcpyAsync` (parameter
//! `copy_engine=auto|kernel|memcpy|batch`, default `auto`: see `cuda_copy`).
//!
//! The loopback path that needs no transport (NIXL's storage backends are local-only in
//! the same way). Notifications to the agent itself are queued directly, after the data.

use crate::backend::{
    Backend, BackendInit, BackendXfer, Capabilities, ListSide, LocalMd, NotifWaker, PostParams,
    PreparedList, RemoteMd, XferEntry, XferOp, XferProgress, XferStatus,
};
use crate::error::{Error, Result};
use crate::mem::{Desc, MemKind, Region};
use std::any::Any;
use std::sync::Arc;

/// The backend's name.
pub const NAME: &str = "LOCAL";

/// The memcpy backend.
#[derive(Debug)]
pub struct LocalBackend {
    agent_name: String,
    notifs: NotifQueue,
    #[cfg(feature = "cuda")]
    streams: super::cuda_copy::StreamPools,
    /// (copying GPU, other GPU) pairs tried so far: whether peer access is on.
    #[cfg(feature = "cuda")]
    peer_pairs: parking_lot::Mutex<std::collections::HashMap<(usize, usize), bool>>,
    #[cfg(feature = "cuda")]
    copy_engine: super::cuda_copy::CopyEngine,
}

type NotifQueue = Arc<super::shared::NotifInbox>;

pub(crate) fn create(init: &BackendInit) -> Result<Arc<dyn Backend>> {
    let params = &init.params;
    if let Some(key) = params
        .keys()
        .find(|k| !cfg!(feature = "cuda") || !["num_streams", "copy_engine"].contains(&k.as_str()))
    {
        return Err(Error::InvalidParam(format!(
            "{NAME} takes no parameter `{key}`{}",
            if cfg!(feature = "cuda") {
                " (only num_streams and copy_engine)"
            } else {
                ""
            }
        )));
    }
    Ok(Arc::new(LocalBackend {
        agent_name: init.agent_name.clone(),
        notifs: NotifQueue::default(),
        #[cfg(feature = "cuda")]
        streams: super::cuda_copy::StreamPools::new(super::shared::param(
            NAME,
            params,
            "num_streams",
            4usize,
        )?),
        #[cfg(feature = "cuda")]
        peer_pairs: Default::default(),
        #[cfg(feature = "cuda")]
        copy_engine: super::shared::param(
            NAME,
            params,
            super::cuda_copy::CopyEngine::PARAM,
            super::cuda_copy::CopyEngine::Auto,
        )?,
    }))
}

#[derive(Debug)]
struct Md {
    /// DRAM, pinned on its first copy to or from VRAM (unpinned when the registration
    /// goes and no prepared list holds it any more).
    #[cfg(feature = "cuda")]
    pin: Option<Arc<super::cuda_copy::LazyPin>>,
}

impl Md {
    fn new(_region: &Region) -> Self {
        Self {
            #[cfg(feature = "cuda")]
            pin: (_region.kind == MemKind::Dram).then(|| {
                Arc::new(super::cuda_copy::LazyPin::new(
                    _region.desc.addr,
                    _region.desc.len,
                ))
            }),
        }
    }
}

impl LocalMd for Md {
    fn public_md(&self) -> Vec<u8> {
        Vec::new()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The agent's view of its own region (nothing to parse: the address is the address).
#[derive(Debug)]
struct RemoteView;

impl RemoteMd for RemoteView {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl LocalBackend {
    fn check_self(&self, agent: &str) -> Result<()> {
        if agent == self.agent_name {
            Ok(())
        } else {
            Err(Error::InvalidParam(format!(
                "{NAME} only moves data within agent `{}`, not to `{agent}`",
                self.agent_name
            )))
        }
    }
}

/// One side of a GPU copy: the range, and where it lives.
#[cfg(feature = "cuda")]
type Side = (Desc, super::cuda_copy::MemLoc);

/// A list resolved once for requests by index: each descriptor with its memory kind
/// and, for DRAM of this agent's side, its registration's pin.
#[derive(Debug)]
struct PreparedDescs {
    /// Whether it is the remote side of a transfer (this agent seen as a peer).
    remote: bool,
    /// (range, memory kind, index in `pins` or `NO_PIN`)
    descs: Vec<(Desc, MemKind, u32)>,
    #[cfg(feature = "cuda")]
    pins: Vec<Arc<super::cuda_copy::LazyPin>>,
}

/// A descriptor without a pin of its own (VRAM, or the remote side's view of DRAM).
const NO_PIN: u32 = u32::MAX;

impl PreparedList for PreparedDescs {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl LocalBackend {
    fn prepare_list(&self, side: ListSide<'_>) -> Result<PreparedDescs> {
        match side {
            ListSide::Local(entries) => {
                #[cfg(feature = "cuda")]
                let mut pins: Vec<Arc<super::cuda_copy::LazyPin>> = Vec::new();
                let descs = entries
                    .iter()
                    .map(|e| {
                        let md = e.md.as_any().downcast_ref::<Md>().ok_or_else(|| {
                            Error::InvalidParam(format!("{NAME}: metadata of another backend"))
                        })?;
                        #[cfg(feature = "cuda")]
                        let pin = match &md.pin {
                            Some(pin) => match pins.iter().rposition(|p| Arc::ptr_eq(p, pin)) {
                                Some(i) => i as u32,
                                None => {
                                    pins.push(pin.clone());
                                    (pins.len() - 1) as u32
                                }
                            },
                            None => NO_PIN,
                        };
                        #[cfg(not(feature = "cuda"))]
                        let pin = {
                            let _ = md;
                            NO_PIN
                        };
                        Ok((e.desc, e.region.kind, pin))
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(PreparedDescs {
                    remote: false,
                    descs,
                    #[cfg(feature = "cuda")]
                    pins,
                })
            }
            ListSide::Remote { agent, entries } => {
                self.check_self(agent)?;
                Ok(PreparedDescs {
                    remote: true,
                    descs: entries
                        .iter()
                        .map(|e| (e.desc, e.region.kind, NO_PIN))
                        .collect(),
                    #[cfg(feature = "cuda")]
                    pins: Vec::new(),
                })
            }
        }
    }

    fn prepare_indexed(
        &self,
        op: XferOp,
        local: &dyn PreparedList,
        local_idx: &[usize],
        remote: &dyn PreparedList,
        remote_idx: &[usize],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        self.check_self(agent)?;
        let (Some(local), Some(remote)) = (
            local.as_any().downcast_ref::<PreparedDescs>(),
            remote.as_any().downcast_ref::<PreparedDescs>(),
        ) else {
            return Err(Error::InvalidParam(format!(
                "{NAME}: prepared lists of another backend"
            )));
        };
        if local.remote || !remote.remote {
            return Err(Error::InvalidParam(format!(
                "{NAME}: a local list and a remote list are needed, in that order"
            )));
        }
        let pair = |li: usize, ri: usize| -> Result<_> {
            match (local.descs.get(li), remote.descs.get(ri)) {
                (Some(l), Some(r)) => Ok((l, r)),
                _ => Err(Error::InvalidParam(format!(
                    "{NAME}: index {li} or {ri} is out of range"
                ))),
            }
        };
        let pairs = || {
            local_idx
                .iter()
                .zip(remote_idx)
                .map(|(&li, &ri)| pair(li, ri))
        };
        #[cfg(feature = "cuda")]
        {
            let mut any_vram = false;
            for p in pairs() {
                let (l, r) = p?;
                any_vram |= l.1 == MemKind::Vram || r.1 == MemKind::Vram;
            }
            if any_vram {
                use super::cuda_copy::MemLoc;
                let sides = pairs()
                    .map(|p| {
                        let (l, r) = p?;
                        let local_loc = match l.1 {
                            MemKind::Vram => MemLoc::Gpu(l.0.dev_id as usize),
                            _ => MemLoc::Host {
                                pinned: local
                                    .pins
                                    .get(l.2 as usize)
                                    .is_some_and(|pin| pin.ensure()),
                            },
                        };
                        let remote_loc = match r.1 {
                            MemKind::Vram => MemLoc::Gpu(r.0.dev_id as usize),
                            _ => MemLoc::Host { pinned: false },
                        };
                        Ok(((l.0, local_loc), (r.0, remote_loc)))
                    })
                    .collect::<Result<Vec<(Side, Side)>>>()?;
                return self.gpu_xfer_of(op, sides.into_iter());
            }
        }
        Ok(Box::new(CopyXfer {
            op,
            copies: pairs()
                .map(|p| p.map(|(l, r)| (l.0.addr, r.0.addr, l.0.len as usize)))
                .collect::<Result<_>>()?,
            agent: agent.to_string(),
            notifs: self.notifs.clone(),
        }))
    }
}

#[cfg(feature = "cuda")]
impl LocalBackend {
    /// Copies on the GPU of the VRAM side (the destination's when both are VRAM).
    fn prep_gpu_xfer(&self, op: XferOp, entries: &[XferEntry<'_>]) -> Result<Box<dyn BackendXfer>> {
        use super::cuda_copy::MemLoc;
        // Where a side lives: VRAM of its GPU, or DRAM (pinned on its first GPU copy).
        let loc = |desc: crate::mem::Desc, region: &Region, md: &dyn LocalMd| match region.kind {
            MemKind::Vram => MemLoc::Gpu(desc.dev_id as usize),
            _ => MemLoc::Host {
                pinned: md
                    .as_any()
                    .downcast_ref::<Md>()
                    .and_then(|m| m.pin.as_deref())
                    .is_some_and(super::cuda_copy::LazyPin::ensure),
            },
        };
        self.gpu_xfer_of(
            op,
            entries.iter().map(|e| {
                // The remote side's metadata is a view without the registration's pin:
                // its DRAM counts as unpinned (the kernel is then not used for it).
                let remote_loc = match e.remote_region.kind {
                    MemKind::Vram => MemLoc::Gpu(e.remote.dev_id as usize),
                    _ => MemLoc::Host { pinned: false },
                };
                (
                    (e.local, loc(e.local, e.local_region, e.local_md)),
                    (e.remote, remote_loc),
                )
            }),
        )
    }

    /// Copies of (local, remote) pairs, each side with where it lives, on the GPU of the
    /// VRAM side (the destination's when both are VRAM).
    fn gpu_xfer_of(
        &self,
        op: XferOp,
        pairs: impl ExactSizeIterator<Item = (Side, Side)>,
    ) -> Result<Box<dyn BackendXfer>> {
        use super::cuda_copy::{Copy, GpuXfer, MemLoc};
        let copies = pairs.map(|(local, remote)| {
            let (mut src, dst) = match op {
                XferOp::Write => (local, remote),
                XferOp::Read => (remote, local),
            };
            let gpu = match (dst.1, src.1) {
                (MemLoc::Gpu(g), _) | (_, MemLoc::Gpu(g)) => g,
                _ => 0,
            };
            // VRAM of another GPU: with peer access on, the copying GPU's copy engines
            // and kernels address it over the link (a plain allocation, not an IPC
            // mapping, so peer access is all it takes).
            if let (MemLoc::Gpu(other), MemLoc::Gpu(_)) = (src.1, dst.1) {
                if other != gpu && self.enable_peer_access(gpu, other) {
                    src.1 = MemLoc::Gpu(gpu);
                }
            }
            (
                gpu,
                Copy {
                    dst: dst.0.addr,
                    src: src.0.addr,
                    len: src.0.len as usize,
                    dst_loc: dst.1,
                    src_loc: src.1,
                },
            )
        });
        let sink = Arc::new(SelfSink {
            agent: self.agent_name.clone(),
            notifs: self.notifs.clone(),
        });
        Ok(Box::new(GpuXfer::new(
            &self.streams,
            copies,
            usize::MAX,
            self.copy_engine,
            sink,
            Vec::new(),
        )?))
    }
}

#[cfg(feature = "cuda")]
impl LocalBackend {
    /// Lets GPU `run`'s copy engines reach GPU `other`'s memory over the link (once per
    /// pair); without peer access the driver stages such copies through host memory,
    /// which is logged. Whether peer access is on.
    fn enable_peer_access(&self, run: usize, other: usize) -> bool {
        if let Some(on) = self.peer_pairs.lock().get(&(run, other)) {
            return *on;
        }
        let result = self
            .streams
            .get(run)
            .and_then(|r| Ok((r, self.streams.get(other)?)))
            .and_then(|(r, o)| {
                gpu_mem::enable_peer_access(&r.gpu, &o.gpu)
                    .map_err(super::cuda_copy::gpu_err("enabling peer access"))
            });
        if let Err(e) = &result {
            tracing::warn!("{NAME}: copies GPU {other} -> GPU {run} go through host memory: {e}");
        }
        self.peer_pairs.lock().insert((run, other), result.is_ok());
        result.is_ok()
    }
}

/// Notifications of GPU transfers, queued for the agent itself once the copies are done.
#[cfg(feature = "cuda")]
#[derive(Debug)]
struct SelfSink {
    agent: String,
    notifs: NotifQueue,
}

#[cfg(feature = "cuda")]
impl super::cuda_copy::NotifSink for SelfSink {
    fn deliver(&self, msg: Vec<u8>) -> Result<()> {
        self.notifs.push(self.agent.clone(), msg);
        Ok(())
    }
}

impl Backend for LocalBackend {
    fn name(&self) -> &str {
        NAME
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: false,
            notif: true,
        }
    }
    fn supported_mem(&self) -> &[MemKind] {
        if cfg!(feature = "cuda") {
            &[MemKind::Dram, MemKind::Vram]
        } else {
            &[MemKind::Dram]
        }
    }
    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        Ok(Arc::new(Md::new(region)))
    }
    fn connection_info(&self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn load_remote_conn_info(&self, _agent: &str, _info: &[u8]) -> Result<()> {
        Ok(())
    }
    fn load_remote_md(
        &self,
        _agent: &str,
        _region: &Region,
        _public: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        Ok(Arc::new(RemoteView))
    }
    fn disconnect(&self, _agent: &str) {}
    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        self.check_self(agent)?;
        #[cfg(feature = "cuda")]
        if entries
            .iter()
            .any(|e| e.local_region.kind == MemKind::Vram || e.remote_region.kind == MemKind::Vram)
        {
            return self.prep_gpu_xfer(op, entries);
        }
        Ok(Box::new(CopyXfer {
            op,
            copies: entries
                .iter()
                .map(|e| (e.local.addr, e.remote.addr, e.local.len as usize))
                .collect(),
            agent: agent.to_string(),
            notifs: self.notifs.clone(),
        }))
    }
    fn prep_list(&self, side: ListSide<'_>) -> Result<Option<Arc<dyn PreparedList>>> {
        Ok(Some(Arc::new(self.prepare_list(side)?)))
    }
    fn prep_xfer_indexed(
        &self,
        op: XferOp,
        local: &Arc<dyn PreparedList>,
        local_idx: &[usize],
        remote: &Arc<dyn PreparedList>,
        remote_idx: &[usize],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        self.prepare_indexed(op, &**local, local_idx, &**remote, remote_idx, agent)
    }
    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        self.check_self(agent)?;
        self.notifs.push(self.agent_name.clone(), msg.to_vec());
        Ok(())
    }
    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.notifs.take(into);
    }
    fn set_notif_waker(&self, waker: NotifWaker) -> bool {
        // Every notification is queued by the thread that posts or polls the transfer.
        self.notifs.add_waker(waker);
        true
    }
}

#[derive(Debug)]
struct CopyXfer {
    op: XferOp,
    /// (local address, remote address, length)
    copies: Vec<(u64, u64, usize)>,
    agent: String,
    notifs: NotifQueue,
}

impl BackendXfer for CopyXfer {
    fn post(&mut self, notif: Option<&[u8]>, _params: &PostParams) -> Result<XferStatus> {
        for &(local, remote, len) in &self.copies {
            let (src, dst) = match self.op {
                XferOp::Write => (local, remote),
                XferOp::Read => (remote, local),
            };
            // SAFETY: both ranges were checked by the agent to lie inside regions
            // registered through `Agent::register_mem`, whose contract keeps them valid
            // while a transfer exists; `copy` tolerates overlap.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        }
        if let Some(msg) = notif {
            self.notifs.push(self.agent.clone(), msg.to_vec());
        }
        Ok(XferStatus::Done)
    }

    fn check(&mut self) -> Result<XferProgress> {
        Ok(XferProgress {
            status: XferStatus::Done,
            completed_ops: self.copies.len() as u64,
        })
    }

    fn op_count(&self) -> usize {
        self.copies.len()
    }
}
