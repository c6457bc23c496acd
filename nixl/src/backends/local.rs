//! `LOCAL`: transfers between two buffers of the same agent: DRAM↔DRAM by `memcpy`, and
//! with feature `cuda` VRAM↔VRAM and VRAM↔DRAM on the backend's own streams (parameter
//! `num_streams`, default 4 per GPU), completed by events that status polls: many small
//! copies as one gather/scatter kernel, others by `cuMemcpyAsync` (parameter
//! `copy_engine=auto|kernel|memcpy|batch`, default `auto`: see `cuda_copy`).
//!
//! The loopback path that needs no transport (NIXL's storage backends are local-only in
//! the same way). Notifications to the agent itself are queued directly, after the data.

use crate::backend::{
    Backend, BackendInit, BackendXfer, Capabilities, LocalMd, NotifWaker, PostParams, RemoteMd,
    XferEntry, XferOp, XferProgress, XferStatus,
};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
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
    /// goes).
    #[cfg(feature = "cuda")]
    pin: Option<super::cuda_copy::LazyPin>,
}

impl Md {
    fn new(_region: &Region) -> Self {
        Self {
            #[cfg(feature = "cuda")]
            pin: (_region.kind == MemKind::Dram)
                .then(|| super::cuda_copy::LazyPin::new(_region.desc.addr, _region.desc.len)),
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

#[cfg(feature = "cuda")]
impl LocalBackend {
    /// Copies on the GPU of the VRAM side (the destination's when both are VRAM).
    fn prep_gpu_xfer(&self, op: XferOp, entries: &[XferEntry<'_>]) -> Result<Box<dyn BackendXfer>> {
        use super::cuda_copy::{Copy, GpuXfer, MemLoc};
        // Where a side lives: VRAM of its GPU, or DRAM (pinned on its first GPU copy).
        let loc = |desc: crate::mem::Desc, region: &Region, md: &dyn LocalMd| match region.kind {
            MemKind::Vram => MemLoc::Gpu(desc.dev_id as usize),
            _ => MemLoc::Host {
                pinned: md
                    .as_any()
                    .downcast_ref::<Md>()
                    .and_then(|m| m.pin.as_ref())
                    .is_some_and(super::cuda_copy::LazyPin::ensure),
            },
        };
        let copies = entries.iter().map(|e| {
            let local = (e.local, loc(e.local, e.local_region, e.local_md));
            // The remote side's metadata is a view without the registration's pin: its
            // DRAM counts as unpinned (the kernel is then not used for it).
            let remote_kind_loc = match e.remote_region.kind {
                MemKind::Vram => MemLoc::Gpu(e.remote.dev_id as usize),
                _ => MemLoc::Host { pinned: false },
            };
            let remote = (e.remote, remote_kind_loc);
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
