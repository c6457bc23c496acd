//! The interface through which a backend reaches peers' memory by CUDA IPC without
//! knowing the backend that implements it: `CUDA_IPC` implements it, `GPUNETIO`'s
//! intra-node path uses it (connection information, region metadata, importing a peer's
//! allocations, notifications).

use super::cuda_copy::NotifSink;
use crate::backend::{Backend, LocalMd, RemoteMd, XferEntry};
use crate::error::Result;
use crate::mem::Desc;
use std::any::Any;
use std::sync::Arc;

/// A CUDA IPC control plane: a [`Backend`] (registration, connection information,
/// peers' metadata, notifications) that also maps peers' memory for another backend's
/// copies.
pub(crate) trait IpcPlane: Backend {
    /// Maps the peer's side of every pair into this process (importing each allocation
    /// once per GPU; `agent` may be this agent: loopback) and pins local DRAM. Each pair
    /// runs on the local side's GPU (VRAM), else the one holding the peer's memory — or,
    /// with `kernel_gpu`, on that GPU, whose kernels then address every mapping: peer
    /// access to the peer's GPU is enabled, and a pair without peer access is
    /// [`crate::Error::NotSupported`] (never an address the kernel cannot reach).
    fn resolve(
        &self,
        entries: &[XferEntry<'_>],
        agent: &str,
        kernel_gpu: Option<usize>,
    ) -> Result<Resolved>;
    /// Maps the peer's ranges (in the regions their metadata name) into this process for
    /// the kernels of `gpu` (peer access enabled toward the peer's GPU; a pair without it
    /// is [`crate::Error::NotSupported`]): (addresses, what keeps the mappings alive).
    fn map_remote(
        &self,
        agent: &str,
        ranges: &[(Desc, &dyn RemoteMd)],
        gpu: usize,
    ) -> Result<(Vec<u64>, KeepAlive)>;
    /// Whether `md` is one of this plane's local DRAM registrations (pinned on first use,
    /// which this does).
    fn pin_local_dram(&self, md: &dyn LocalMd) -> bool;
}

/// What must outlive a transfer's or view's use of the peer's memory (its mappings).
pub(crate) type KeepAlive = Vec<Arc<dyn Any + Send + Sync>>;

/// One descriptor pair of a transfer with the peer's side mapped into this process.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ResolvedPair {
    /// The GPU the copy runs on (the imposed kernel GPU, else the local side's, else the
    /// one holding the peer's memory); the peer's memory is mapped for it.
    pub(crate) gpu: usize,
    /// The local range's address.
    pub(crate) local: u64,
    /// The peer's range, at its address mapped here.
    pub(crate) remote: u64,
    /// Bytes.
    pub(crate) len: u64,
    /// Whether kernels of `gpu` can address the peer's range (same GPU, or peer access
    /// on with the mapping in `gpu`'s context); otherwise only copy calls reach it.
    pub(crate) kernel_reach: bool,
    /// Where `gpu` has no peer access to the GPU holding the peer's memory: that GPU's
    /// ordinal. The peer's range is then mapped in that GPU's context, and the copy is
    /// staged through pinned host memory between the two (`CUDA_IPC` only: a kernel GPU
    /// never gets such a pair).
    pub(crate) staged_home: Option<usize>,
}

/// A transfer's pairs, what must outlive them (the peer's mappings), and where its
/// notification goes.
#[derive(Debug)]
pub(crate) struct Resolved {
    pub(crate) pairs: Vec<ResolvedPair>,
    pub(crate) keep: KeepAlive,
    pub(crate) sink: Arc<dyn NotifSink>,
}
