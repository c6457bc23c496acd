//! A GPU queue pair bound to a transport, whatever carries its work: the front of the
//! three NIC handlers (DOCA GPUNetIO's `doca_gpu_verbs_create_qp_hl` with its
//! `nic_handler` argument).
//!
//! - [`NicHandler::Mlx5`]: native GDAKI on ConnectX ([`crate::mlx5::Mlx5QueuePair`]);
//! - [`NicHandler::CpuProxy`]: a host-mapped ring a CPU proxy posts on a libfabric
//!   endpoint ([`crate::proxy::CpuProxy`]); works everywhere;
//! - [`NicHandler::IntraNode`]: the peer's memory mapped through CUDA IPC
//!   ([`crate::intra_node::IntraNodeQueuePair`]); only when asked for, since it needs the
//!   peer on the same node;
//! - [`NicHandler::Auto`]: `Mlx5` when it works here, else `CpuProxy`;
//!   [`GpuQueuePair::fallback_reason`] (and a `tracing` event) says why `Mlx5` was not
//!   taken.
//!
//! The life cycle is the same for all: [`GpuQueuePair::create`], exchange
//! [`EndpointInfo`]s and [`connect`](GpuQueuePair::connect), register local memory and
//! exchange [`RemoteRegion`]s ([`descriptor`](GpuQueuePair::descriptor) /
//! [`add_remote`](GpuQueuePair::add_remote)), then [`export`](GpuQueuePair::export):
//! the [`ExportedGpuQueuePair`]'s device pointer is the `gio_dev_qp *` kernel argument.
//! Dropping the export unexports (a proxy's ring is shut down first) and destroys
//! everything in dependency order.

use crate::error::{Error, Result};
use crate::intra_node::{ExportedQueuePair, IntraNodeQueuePair};
#[cfg(feature = "mlx5")]
use crate::mlx5::ExportedMlx5QueuePair;
use gpu_mem::{DeviceBuffer, Gpu, IpcHandle, IpcMapping};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// How a queue pair's work reaches the network (`GIO_NIC_HANDLER_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NicHandler {
    /// `Mlx5` where it works, else `CpuProxy` (never `IntraNode`).
    Auto,
    /// A CPU proxy thread posts ring entries on a libfabric endpoint.
    CpuProxy,
    /// Peer memory mapped through CUDA IPC; puts are stores.
    IntraNode,
    /// The GPU writes ConnectX WQEs and rings the doorbell itself.
    Mlx5,
}

impl NicHandler {
    /// The `GIO_NIC_HANDLER_*` value device code sees.
    pub fn abi_value(self) -> u32 {
        match self {
            NicHandler::Auto => gpunetio_sys::GIO_NIC_HANDLER_AUTO,
            NicHandler::CpuProxy => gpunetio_sys::GIO_NIC_HANDLER_CPU_PROXY,
            NicHandler::IntraNode => gpunetio_sys::GIO_NIC_HANDLER_INTRA_NODE,
            NicHandler::Mlx5 => gpunetio_sys::GIO_NIC_HANDLER_MLX5,
        }
    }
}

/// Which handler a request resolves to here, and why `Auto` fell back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    /// The handler to build (never `Auto`).
    pub handler: NicHandler,
    /// Why `Mlx5` was not taken for `Auto` (`None` otherwise).
    pub fallback_reason: Option<String>,
}

/// Resolves `requested` on this machine without creating anything: `Auto` becomes
/// `Mlx5` when an mlx5 device opens with DEVX ([`crate::mlx5::probe`]), else `CpuProxy`
/// with the probe's reason. [`GpuQueuePair::create`] may still fall back later when
/// creating the mlx5 queue pair itself fails.
pub fn resolve(requested: NicHandler) -> Resolution {
    match requested {
        NicHandler::Auto => match crate::mlx5::probe() {
            Ok(dev) => {
                tracing::debug!(device = %dev.name, "NIC handler Auto: Mlx5");
                Resolution {
                    handler: NicHandler::Mlx5,
                    fallback_reason: None,
                }
            }
            Err(e) => {
                let reason = e.to_string();
                tracing::info!(%reason, "NIC handler Auto: CpuProxy");
                Resolution {
                    handler: NicHandler::CpuProxy,
                    fallback_reason: Some(reason),
                }
            }
        },
        other => Resolution {
            handler: other,
            fallback_reason: None,
        },
    }
}

/// Options of a [`GpuQueuePair`].
#[derive(Debug, Clone)]
pub struct GpuQueuePairOptions {
    /// The handler asked for.
    pub handler: NicHandler,
    /// CpuProxy: the libfabric provider (`tcp;ofi_rxm`, `shm`, `verbs;ofi_rxm`, ...).
    pub fabric_provider: String,
    /// CpuProxy: ring entries (a power of two).
    pub ring_size: u32,
    /// Mlx5: the verbs device (`None`: the first mlx5 device with DEVX).
    pub mlx5_device: Option<String>,
    /// Mlx5: queue options (send queue depth, port, retries).
    #[cfg(feature = "mlx5")]
    pub mlx5: crate::mlx5::Mlx5Options,
    /// Completion counters.
    pub num_counters: u32,
    /// Bound on every device-side wait (zero: unbounded).
    pub timeout: Duration,
}

impl Default for GpuQueuePairOptions {
    fn default() -> Self {
        Self {
            handler: NicHandler::Auto,
            fabric_provider: "tcp;ofi_rxm".into(),
            ring_size: 1024,
            mlx5_device: None,
            #[cfg(feature = "mlx5")]
            mlx5: crate::mlx5::Mlx5Options::default(),
            num_counters: 4,
            timeout: Duration::from_secs(10),
        }
    }
}

/// What the peer needs to connect, sent out of band (serde).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EndpointInfo {
    /// A CPU proxy's transport blob (`CpuProxy::local_info`).
    CpuProxy(Vec<u8>),
    /// Intra-node: the GPU the queue pair lives on (peers exchange memory, not
    /// connections).
    IntraNode {
        /// The GPU's UUID.
        gpu_uuid: [u8; 16],
    },
    /// An mlx5 (or any verbs RC) queue pair's endpoint.
    Mlx5(Mlx5Endpoint),
}

/// A verbs RC endpoint (`ibverbs::Endpoint`'s fields), what an mlx5 queue pair's peer
/// needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mlx5Endpoint {
    /// QP number.
    pub qp_num: u32,
    /// First PSN this side sends.
    pub psn: u32,
    /// GID (RoCE; zero on InfiniBand without GRH).
    pub gid: [u8; 16],
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Active MTU of the port (`IBV_MTU_*`).
    pub mtu: u32,
}

#[cfg(feature = "mlx5")]
impl From<ibverbs::Endpoint> for Mlx5Endpoint {
    fn from(e: ibverbs::Endpoint) -> Self {
        Self {
            qp_num: e.qp_num,
            psn: e.psn,
            gid: e.gid.raw,
            lid: e.lid,
            mtu: e.mtu.0,
        }
    }
}

#[cfg(feature = "mlx5")]
impl From<Mlx5Endpoint> for ibverbs::Endpoint {
    fn from(e: Mlx5Endpoint) -> Self {
        Self {
            qp_num: e.qp_num,
            psn: e.psn,
            gid: ibverbs::Gid { raw: e.gid },
            lid: e.lid,
            mtu: ibverbs::Mtu(e.mtu),
        }
    }
}

/// How the peer reaches one registered region, sent out of band (serde).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoteRegion {
    /// Address, length and key (`RemoteDescriptor::to_bytes`): CpuProxy and Mlx5.
    Key(Vec<u8>),
    /// A CUDA IPC handle of the buffer: IntraNode.
    Ipc(IpcHandle),
}

enum Inner {
    #[cfg(feature = "fabric")]
    CpuProxy(Box<crate::proxy::CpuProxy<crate::proxy::FabricTransport>>),
    IntraNode {
        qp: IntraNodeQueuePair,
        /// Local buffers by region index, for their IPC handles.
        local: Vec<(u32, Arc<DeviceBuffer>)>,
    },
    #[cfg(feature = "mlx5")]
    Mlx5(Box<crate::mlx5::Mlx5QueuePair>),
}

/// A GPU queue pair on one of the NIC handlers, before export.
pub struct GpuQueuePair {
    inner: Inner,
    handler: NicHandler,
    fallback_reason: Option<String>,
    gpu: Gpu,
}

impl std::fmt::Debug for GpuQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuQueuePair")
            .field("handler", &self.handler)
            .field("fallback_reason", &self.fallback_reason)
            .finish_non_exhaustive()
    }
}

#[cfg(any(feature = "fabric", feature = "mlx5"))]
fn key_of(bytes: &[u8]) -> Result<crate::proxy::RemoteDescriptor> {
    crate::proxy::RemoteDescriptor::from_bytes(bytes)
}

fn mismatch(local: NicHandler, what: &str) -> Error {
    Error::InvalidArgument(format!("a {what} on a {local:?} queue pair"))
}

impl GpuQueuePair {
    /// Creates a queue pair on `gpu` with the handler `options.handler` resolves to.
    /// For `Auto`, a failure to create the mlx5 queue pair (DMA-BUF umems refused, ...)
    /// falls back to `CpuProxy` too, with the error as the reason.
    pub fn create(gpu: &Gpu, options: &GpuQueuePairOptions) -> Result<Self> {
        let Resolution {
            handler,
            fallback_reason,
        } = resolve(options.handler);
        #[cfg(feature = "mlx5")]
        let (handler, fallback_reason) = if handler == NicHandler::Mlx5 {
            let created =
                crate::mlx5::DevxContext::open(options.mlx5_device.as_deref()).and_then(|ctx| {
                    let mut o = options.mlx5.clone();
                    o.num_counters = options.num_counters;
                    o.timeout = options.timeout;
                    crate::mlx5::Mlx5QueuePair::create(gpu, &ctx, &o)
                });
            match created {
                Ok(qp) => {
                    return Ok(Self {
                        inner: Inner::Mlx5(Box::new(qp)),
                        handler,
                        fallback_reason: None,
                        gpu: gpu.clone(),
                    })
                }
                Err(e) if options.handler == NicHandler::Auto => {
                    let reason = format!("creating the mlx5 queue pair failed: {e}");
                    tracing::info!(%reason, "NIC handler Auto: CpuProxy");
                    (NicHandler::CpuProxy, Some(reason))
                }
                Err(e) => return Err(e),
            }
        } else {
            (handler, fallback_reason)
        };
        let inner = match handler {
            NicHandler::IntraNode => Inner::IntraNode {
                qp: IntraNodeQueuePair::new(gpu, options.num_counters, options.timeout),
                local: Vec::new(),
            },
            #[cfg(feature = "fabric")]
            NicHandler::CpuProxy => {
                let ring =
                    crate::proxy::RingMemory::cuda(gpu, options.ring_size, options.num_counters)?;
                let transport = crate::proxy::FabricTransport::new(&options.fabric_provider)?;
                let proxy = crate::proxy::CpuProxyBuilder::new()
                    .gpu(gpu)
                    .timeout(options.timeout)
                    .build(transport, &ring)?;
                Inner::CpuProxy(Box::new(proxy))
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "NIC handler {other:?}: gpunetio was built without the feature it needs"
                )))
            }
        };
        Ok(Self {
            inner,
            handler,
            fallback_reason,
            gpu: gpu.clone(),
        })
    }

    /// The handler in use (never `Auto`).
    pub fn handler(&self) -> NicHandler {
        self.handler
    }

    /// Why `Auto` did not take `Mlx5` (`None` when it did, or another handler was asked
    /// for).
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// What the peer passes to its [`connect`](Self::connect).
    pub fn local_endpoint(&self) -> Result<EndpointInfo> {
        match &self.inner {
            #[cfg(feature = "fabric")]
            Inner::CpuProxy(p) => Ok(EndpointInfo::CpuProxy(p.local_info()?)),
            Inner::IntraNode { .. } => Ok(EndpointInfo::IntraNode {
                gpu_uuid: self.gpu.uuid()?,
            }),
            #[cfg(feature = "mlx5")]
            Inner::Mlx5(q) => Ok(EndpointInfo::Mlx5(q.endpoint().into())),
        }
    }

    /// Connects to the peer whose [`local_endpoint`](Self::local_endpoint) this is (both
    /// sides must use the same handler).
    pub fn connect(&mut self, peer: &EndpointInfo) -> Result<()> {
        match (&mut self.inner, peer) {
            #[cfg(feature = "fabric")]
            (Inner::CpuProxy(p), EndpointInfo::CpuProxy(blob)) => p.connect(blob),
            (Inner::IntraNode { .. }, EndpointInfo::IntraNode { gpu_uuid }) => {
                // Nothing to connect: the peer's memory is mapped through its IPC handles.
                // The peer's GPU must be visible here.
                match crate::find_by_uuid(gpu_uuid)? {
                    Some(_) => Ok(()),
                    None => Err(Error::Unsupported(format!(
                        "intra-node peer on GPU {} which this process does not see",
                        crate::format_uuid(gpu_uuid)
                    ))),
                }
            }
            #[cfg(feature = "mlx5")]
            (Inner::Mlx5(q), EndpointInfo::Mlx5(e)) => q.connect(&(*e).into()),
            (_, other) => Err(mismatch(self.handler, &format!("{other:?} endpoint"))),
        }
    }

    /// Registers a local device buffer; returns its index in the memory table.
    pub fn register_local(&mut self, buf: &Arc<DeviceBuffer>) -> Result<u32> {
        match &mut self.inner {
            #[cfg(feature = "fabric")]
            Inner::CpuProxy(p) => Ok(p.register_device(buf)?.0),
            Inner::IntraNode { qp, local } => {
                let index = qp.register_local(buf)?;
                local.push((index, buf.clone()));
                Ok(index)
            }
            #[cfg(feature = "mlx5")]
            Inner::Mlx5(q) => q.register_local(buf),
        }
    }

    /// What the peer needs to target local region `mr`.
    pub fn descriptor(&self, mr: u32) -> Result<RemoteRegion> {
        match &self.inner {
            #[cfg(feature = "fabric")]
            Inner::CpuProxy(p) => Ok(RemoteRegion::Key(p.descriptor(mr)?.to_bytes().to_vec())),
            Inner::IntraNode { local, .. } => {
                let buf = local
                    .iter()
                    .find(|(i, _)| *i == mr)
                    .map(|(_, b)| b)
                    .ok_or_else(|| Error::InvalidArgument(format!("no local region {mr}")))?;
                Ok(RemoteRegion::Ipc(buf.export_ipc()?))
            }
            #[cfg(feature = "mlx5")]
            Inner::Mlx5(q) => Ok(RemoteRegion::Key(q.descriptor(mr)?.to_bytes().to_vec())),
        }
    }

    /// Adds the peer's region; returns its index in the memory table.
    pub fn add_remote(&mut self, region: &RemoteRegion) -> Result<u32> {
        match (&mut self.inner, region) {
            #[cfg(feature = "fabric")]
            (Inner::CpuProxy(p), RemoteRegion::Key(b)) => p.add_remote(&key_of(b)?),
            (Inner::IntraNode { qp, .. }, RemoteRegion::Ipc(h)) => {
                let mapping = Arc::new(IpcMapping::open(&self.gpu, h)?);
                qp.add_remote(&mapping)
            }
            #[cfg(feature = "mlx5")]
            (Inner::Mlx5(q), RemoteRegion::Key(b)) => q.add_remote(&key_of(b)?),
            (_, other) => Err(mismatch(self.handler, &format!("{other:?} region"))),
        }
    }

    /// Exports the queue pair for kernels (a CPU proxy's thread is started). Regions
    /// added later are not seen by the export.
    pub fn export(self) -> Result<ExportedGpuQueuePair> {
        let exported = match self.inner {
            #[cfg(feature = "fabric")]
            Inner::CpuProxy(p) => {
                p.start()?;
                let e = p.export()?;
                Exported::CpuProxy {
                    export: e,
                    proxy: p,
                }
            }
            Inner::IntraNode { qp, .. } => Exported::IntraNode(qp.export()?),
            #[cfg(feature = "mlx5")]
            Inner::Mlx5(q) => Exported::Mlx5((*q).export()?),
        };
        Ok(ExportedGpuQueuePair {
            exported,
            handler: self.handler,
        })
    }
}

enum Exported {
    #[cfg(feature = "fabric")]
    CpuProxy {
        // The export (device copies, ring reference) goes before the proxy; the proxy's
        // drop shuts the ring down and reaps what is in flight.
        export: crate::proxy::ExportedProxyQueuePair,
        proxy: Box<crate::proxy::CpuProxy<crate::proxy::FabricTransport>>,
    },
    IntraNode(ExportedQueuePair),
    #[cfg(feature = "mlx5")]
    Mlx5(ExportedMlx5QueuePair),
}

/// A queue pair exported to device memory; dropping it unexports and destroys it (no
/// kernel may use it then).
pub struct ExportedGpuQueuePair {
    exported: Exported,
    handler: NicHandler,
}

impl std::fmt::Debug for ExportedGpuQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportedGpuQueuePair")
            .field("handler", &self.handler)
            .field("device_ptr", &self.device_ptr())
            .finish()
    }
}

impl ExportedGpuQueuePair {
    /// The `gio_dev_qp *` to pass to kernels.
    pub fn device_ptr(&self) -> u64 {
        match &self.exported {
            #[cfg(feature = "fabric")]
            Exported::CpuProxy { export, .. } => export.device_ptr(),
            Exported::IntraNode(e) => e.device_ptr(),
            #[cfg(feature = "mlx5")]
            Exported::Mlx5(e) => e.device_ptr(),
        }
    }

    /// The handler in use.
    pub fn handler(&self) -> NicHandler {
        self.handler
    }

    /// Completion counter `index`.
    pub fn counter(&self, index: u32) -> Result<u64> {
        match &self.exported {
            #[cfg(feature = "fabric")]
            Exported::CpuProxy { proxy, .. } => proxy.ring().counter(index),
            Exported::IntraNode(e) => e.counter(index),
            #[cfg(feature = "mlx5")]
            Exported::Mlx5(e) => e.counter(index),
        }
    }

    /// Unexports: a CPU proxy's ring is shut down (device waits end with
    /// `GIO_ERR_SHUTDOWN`), then everything is destroyed in order. The same as drop,
    /// spelled out.
    pub fn unexport(self) {
        #[cfg(feature = "fabric")]
        if let Exported::CpuProxy { proxy, .. } = &self.exported {
            proxy.shutdown();
        }
        drop(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_handlers_resolve_to_themselves() {
        for h in [
            NicHandler::CpuProxy,
            NicHandler::IntraNode,
            NicHandler::Mlx5,
        ] {
            assert_eq!(
                resolve(h),
                Resolution {
                    handler: h,
                    fallback_reason: None
                }
            );
        }
        assert_eq!(NicHandler::Auto.abi_value(), 0);
        assert_eq!(NicHandler::Mlx5.abi_value(), 3);
    }

    #[test]
    fn endpoint_and_region_descriptions_round_trip_through_serde() {
        let e = EndpointInfo::Mlx5(Mlx5Endpoint {
            qp_num: 7,
            psn: 0,
            gid: [1; 16],
            lid: 3,
            mtu: 5,
        });
        let s = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<EndpointInfo>(&s).unwrap(), e);
        let r = RemoteRegion::Key(vec![1, 2, 3]);
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<RemoteRegion>(&s).unwrap(), r);
    }
}
