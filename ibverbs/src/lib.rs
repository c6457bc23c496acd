//! Safe RDMA verbs over libibverbs (rdma-core).
//!
//! Devices and contexts ([`devices`], [`Context`]), protection domains
//! ([`ProtectionDomain`]), memory regions ([`MemoryRegion`]), completion queues and
//! channels ([`CompletionQueue`], [`CompletionChannel`]), memory windows ([`mw`]), queue
//! pairs brought up as a typestate ([`PreparedQueuePair`] → [`QueuePair`]) from an
//! exchangeable [`Endpoint`], shared receive queues, address handles, async events,
//! both post APIs (the classic [`QueuePair::post_send`] chains and the `ibv_wr_*`
//! [`WrBatch`]), and, with the default feature `rdmacm`, connection management by IP
//! address and port (`cm`).
//!
//! Object graph: every object holds its parent through an `Arc` (`Context →
//! ProtectionDomain → {MemoryRegion, QueuePair, …}`, `Context → CompletionQueue`), so
//! drop order never matters; a failed destroy is logged with `tracing`, never a panic.
//!
//! Errors are one enum, [`Error`]; work-completion failures are typed ([`WcStatus`],
//! [`WorkCompletion::result`]).
//!
//! The raw bindings are re-exported as [`ffi`] (the escape hatch); every wrapper has
//! `as_raw()` and `unsafe from_raw()`.
//!
//! # Features
//!
//! - `rdmacm` (default): the `cm` module, connection management over IP with
//!   librdmacm (listen/connect/accept by address and port, yielding connected QPs). It
//!   is on by default because librdmacm ships with libibverbs in rdma-core everywhere
//!   (Debian/Ubuntu `librdmacm-dev`, RHEL/Fedora `rdma-core-devel`); build with
//!   `default-features = false` to link libibverbs alone.
//!
//! ```no_run
//! use ibverbs::{AccessFlags, ConnectOptions, QpType, RecvWr, SendWr};
//!
//! # fn main() -> Result<(), ibverbs::Error> {
//! let ctx = ibverbs::Context::open("rxe0")?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(64, None, 0)?;
//! let mut mr = pd.reg_mr(4096, AccessFlags::all_remote())?;
//! let qp = pd.create_qp(QpType::RC, &cq, &cq).build()?;
//! let opts = ConnectOptions { gid_index: 1, ..Default::default() };
//! let local = qp.endpoint(&opts)?;
//! // ... send `local` to the peer (it is serde-serializable), receive `remote` ...
//! # let remote = local;
//! let qp = qp.connect(&remote, &opts)?;
//! mr.as_mut_slice()[..5].copy_from_slice(b"hello");
//! let sge = [mr.sge(0..5)];
//! qp.post_send(&mut [SendWr::send(1, &sge).signaled()])?;
//! let mut wcs = [ibverbs::WorkCompletion::default(); 16];
//! loop {
//!     let done = cq.poll(&mut wcs)?;
//!     if let Some(wc) = done.first() {
//!         wc.result()?;
//!         break;
//!     }
//! }
//! # let _ = RecvWr::new(0, &sge);
//! # Ok(())
//! # }
//! ```

// docs.rs (nightly) marks what each feature adds.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use ibverbs_sys as ffi;

#[cfg(feature = "rdmacm")]
pub mod cm;
mod cq;
mod device;
mod endpoint;
mod error;
mod mr;
pub mod mw;
mod newtype;
mod pd;
mod qp;
mod srq;
mod status;
mod wr;

pub use cq::{
    CompletionChannel, CompletionQueue, CqEvent, CqInitAttrEx, ExCompletion, WcFlags, WcOpcode,
    WorkCompletion,
};
pub use device::{
    devices, AsyncElement, AsyncEvent, AsyncEventType, AtomicCap, Context, Device, DeviceAttr,
    DeviceList, Gid, GidEntry, GidType, IpFamily, LinkLayer, Mtu, PortAttr, PortState,
};
pub use endpoint::Endpoint;
pub use error::{Error, Result};
pub use mr::{AccessFlags, MemoryRegion, RemoteMemory, Sge};
pub use mw::{MemoryWindow, MwType};
pub use pd::{AddressHandle, AhAttr, ProtectionDomain};
pub use qp::{
    required_mask, ConnectOptions, PreparedQueuePair, QpAttr, QpAttrMask, QpType, QueuePair,
    QueuePairBuilder, SendOpsFlags, WrBatch,
};
pub use srq::{SharedReceiveQueue, SrqAttr};
pub use status::{QpState, WcStatus};
pub use wr::{InlineSge, RecvWr, SendFlags, SendWr};
