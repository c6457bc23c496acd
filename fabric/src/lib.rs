//! A safe layer over [libfabric](https://ofiwg.github.io/libfabric/) (OpenFabrics
//! Interfaces).
//!
//! The objects follow libfabric's: discovery ([`InfoBuilder`] → [`Info`]), [`Fabric`],
//! [`Domain`], [`EventQueue`], [`CompletionQueue`], [`Counter`], [`AddressVector`],
//! [`Endpoint`] (RDM and MSG) and [`PassiveEndpoint`], memory registration
//! ([`MemoryRegion`], [`RegisteredBuffer`]). Control-path objects own their parent through
//! an `Arc` (`Fabric → Domain → {Endpoint, AddressVector, CompletionQueue, MemoryRegion}`),
//! so they can be dropped in any order; `Drop` never panics (a failed `fi_close` is logged
//! with `tracing`).
//!
//! # Progress
//!
//! Providers with `FI_PROGRESS_MANUAL` data progress (`tcp;ofi_rxm`, `shm`, `udp;ofi_rxd`)
//! only move data when the application calls into them. This crate does it for you:
//! reading a completion queue progresses it, an operation that gets `FI_EAGAIN` progresses
//! its queues before returning [`Error::WouldBlock`], and each [`Domain`] runs a small
//! background thread that progresses its completion queues without consuming their
//! entries, so a passive RMA target needs no code at all (opt out with
//! [`Domain::with_progress_interval`]).
//!
//! # Memory registration
//!
//! Every `mr_mode` bit this crate requests is honoured (see [`MemoryRegion`]):
//! `FI_MR_LOCAL` (descriptors passed on every operation), `FI_MR_VIRT_ADDR` (remote
//! addresses are virtual addresses or offsets, computed by [`RemoteMemory`]),
//! `FI_MR_PROV_KEY` (provider keys, or unique requested keys), `FI_MR_ENDPOINT` (bind and
//! enable: [`Endpoint::alloc_registered`]), `FI_MR_ALLOCATED` (only allocated memory is
//! registered), `FI_MR_HMEM` (device memory through `fi_mr_regattr`).
//!
//! # Safety
//!
//! Operations on memory the crate owns ([`RegisteredBuffer`], kept alive until the
//! completion is read) are safe. Operations on caller memory are `unsafe fn`s whose
//! contract is that the memory stays valid and unmoved until the completion is reaped.
//!
//! # Example
//!
//! ```no_run
//! use fabric::{Access, AddressVector, AvType, Caps, CompletionQueue, CqFormat, Domain,
//!              EndpointBuilder, EndpointType, Fabric, InfoBuilder};
//! use std::time::Duration;
//!
//! let info = InfoBuilder::new()
//!     .provider("tcp;ofi_rxm")
//!     .ep_type(EndpointType::RDM)
//!     .caps(Caps::MSG | Caps::RMA)
//!     .node("127.0.0.1")
//!     .source(true)
//!     .get_first()?;
//! let fabric = Fabric::new(&info)?;
//! let domain = Domain::new(&fabric, &info)?;
//! let cq = CompletionQueue::builder().format(CqFormat::Data).open(&domain)?;
//! let av = AddressVector::new(&domain, AvType::Table, 16)?;
//! let ep = EndpointBuilder::new(&domain, &info).cq(&cq).av(&av).build()?;
//! let buf = ep.alloc_registered(4096, Access::WRITE | Access::READ | Access::REMOTE_WRITE)?;
//! let peer = av.insert(&ep.name()?)?; // normally the peer's name, exchanged out of band
//! ep.write_sync(&buf, 0..4096, peer, &buf.remote(), 0, 7, Duration::from_secs(5))?;
//! # Ok::<(), fabric::Error>(())
//! ```

#![warn(missing_docs)]
// docs.rs (nightly) marks what each feature adds.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use libfabric_sys as ffi;

mod atomic;
mod av;
mod cntr;
mod cq;
mod domain;
mod ep;
mod ep_handle;
mod eq;
mod error;
mod info;
mod mr;
mod passive;
mod scalable;

pub use atomic::{AtomicDatatype, AtomicOp};
pub use av::{Address, AddressVector, AvType};
pub use cntr::Counter;
pub use cq::{Completion, CompletionQueue, CqBuilder, CqFormat, WaitObj};
pub use domain::{Domain, Fabric};
pub use ep::{EndpointBuilder, WriteOp};
pub use ep_handle::Endpoint;
pub use eq::{CmEvent, EventQueue};
pub use error::{strerror, CompletionError, Error, Result};
pub use info::{
    check_version, version, AddressFormat, Caps, EndpointType, Info, InfoBuilder, Mode, MrMode,
    Progress, Threading, MIN_VERSION,
};
pub use mr::{Access, HmemIface, MemoryRegion, RegisteredBuffer, RemoteMemory};
pub use passive::PassiveEndpoint;
pub use scalable::ScalableEndpoint;

/// The `fid` of a libfabric object: every `fid_*` struct starts with its `struct fid`.
pub(crate) fn fid_of<T>(raw: *mut T) -> *mut ffi::fid {
    raw.cast()
}

/// The address of an endpoint (active, passive or scalable) as bytes (`fi_getname`),
/// growing the buffer when the provider asks for more.
pub(crate) fn get_name(fid: *mut ffi::fid, call: &'static str) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        let mut len = buf.len();
        // SAFETY: buf has len writable bytes; fid is open.
        let ret = unsafe { ffi::fi_getname(fid, buf.as_mut_ptr().cast(), &mut len) };
        if ret == -ffi::FI_ETOOSMALL && len > buf.len() {
            buf.resize(len, 0);
            continue;
        }
        error::cvt(call, ret)?;
        buf.truncate(len);
        return Ok(buf);
    }
}

/// Closes a fid, logging (never panicking) on failure. Used by every `Drop`.
pub(crate) fn close_fid(what: &'static str, fid: *mut ffi::fid) {
    if fid.is_null() {
        return;
    }
    // SAFETY: fid is an open libfabric object owned by the caller's Drop, closed once.
    let ret = unsafe { ffi::fi_close(fid) };
    if ret != 0 {
        tracing::error!(
            object = what,
            errno = -ret,
            error = %strerror(-ret),
            "fi_close failed; the object is leaked"
        );
    }
}
