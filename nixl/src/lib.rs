//! A transfer agent in the model of NVIDIA NIXL, in Rust.
//!
//! Register memory once, exchange metadata, then move batches of non-contiguous buffers
//! between agents with one-sided READ/WRITE, and be notified when the data has landed.
//!
//! - [`Agent`]: registrations ([`Agent::register_mem`]), metadata
//!   ([`Agent::local_metadata`], [`Agent::load_remote_metadata`], the peer-to-peer
//!   listener), transfers ([`Agent::prep_xfer_dlist`] + [`Agent::make_xfer_req`], or
//!   [`Agent::create_xfer_req`]) and notifications ([`Agent::get_notifs`], or
//!   [`Agent::wait_notifs`] to sleep until one arrives).
//! - [`Backend`]: the transport interface; backends are created by name with string
//!   parameters ([`Agent::create_backend`]) or written by the user ([`Agent::add_backend`]).
//!   A constructor gets a [`BackendInit`] (agent name, progress-thread setting, listener
//!   address, parameters), never the agent; [`BackendRegistry`] names the constructors
//!   ([`Agent::new`] uses the built-in ones, [`Agent::with_registry`] any other set).
//!   [`Agent::create_default_backends`] creates what NIXL's default (`UCX`) stands for:
//!   `LIBFABRIC`, and `CUDA_IPC` where there is a GPU. A transfer that names no backend
//!   takes the first that can carry it, one that [prefers](Backend::prefers) the pair of
//!   memory kinds first (`CUDA_IPC` for VRAM to VRAM on one node).
//! - Every bad input is refused before anything is posted, with a typed [`Error`]:
//!   unregistered or partly registered memory, zero-length or overflowing descriptors,
//!   an unknown peer, a remote descriptor outside every region the peer registered, a
//!   memory kind the backend cannot move.
//!
//! # Layers and features
//! The agent core (agent, backend interface and registry, memory model, metadata, the
//! peer-to-peer listener, etcd with feature `etcd`) imports no backend and links no
//! transport library: `--no-default-features` builds it with `LOCAL` and `FAULT` only.
//! Each transport is a feature ([`backends`] lists them and says why features rather than
//! crates):
//!
//! | feature | adds | links |
//! |---|---|---|
//! | `libfabric` (default) | `LIBFABRIC` | libfabric |
//! | `verbs` (default) | `VERBS` | libibverbs |
//! | `cuda` | VRAM: `CUDA_IPC`, `LOCAL` VRAM copies, staged VRAM over `LIBFABRIC`/`VERBS` | the CUDA driver, loaded at run time |
//! | `gpunetio` | `GPUNETIO` and the device API's NIC path (implies `cuda`, `libfabric`) | as `cuda`, and libfabric |
//! | `file` | `FILE` (files through an `hf3fs-gdr` daemon) | nothing native |
//! | `posix` | `POSIX` (files by `pread`/`pwrite`, no daemon) | nothing beyond `libc` |
//! | `etcd` | the `etcd` metadata service module | nothing native (needs `protoc` to build) |
//!
//! # Failure model
//! No transfer polls "in progress" forever, and every failure is typed
//! ([`XferReq`] has the details):
//! - [`Error::RemoteDisconnect`]: the peer's process or connection is gone (the
//!   transport flushed or refused its operations), its host vanished (`VERBS` and
//!   `LIBFABRIC` receive heartbeats from each peer they loaded and declare it dead after
//!   `heartbeat_misses` × `heartbeat_ms` of silence, 0.5 s by default), or its metadata
//!   was invalidated or replaced by a new incarnation's while the request was in flight.
//! - [`Error::Stalled`]: no operation completed for [`AgentConfig::stall_timeout`]; the
//!   bound also catches a dead peer that the transport never reports.
//! - [`Error::Canceled`]: the request was released by [`Agent::shutdown`] (or by
//!   dropping the agent's last handle). Dropping an in-flight request cancels it: its
//!   remaining operations are not issued and its notification is never delivered before
//!   all of its data.
//! - Errors from [`XferReq::status`] are terminal: the request is released and spent.
//! - Reconnect: a restarted peer publishes new metadata; [`Agent::load_remote_metadata`]
//!   with it replaces the connection (requests made for the old incarnation fail with
//!   [`Error::RemoteDisconnect`]), and new requests succeed without restarting the local
//!   agent — once the old incarnation is known to be gone (a request or notification to
//!   it failed with [`Error::RemoteDisconnect`], or the backend's liveness check declared
//!   it dead) or was invalidated (see "Binding" there; until then other connection
//!   information under its name is [`Error::MetadataRefused`]). A disconnect never makes
//!   the agent forget a peer by itself.
//! - [`backends::fault`] injects each of these failures deterministically.
//!
//! # Trust
//! Peers of one job cooperate, but a peer may only reach memory that the target
//! registered, and a message from outside the job must not redirect, stall or exhaust
//! an agent:
//! - Metadata binding ("Binding" on [`Agent::load_remote_metadata`]): a blob naming the
//!   agent itself is refused; a peer's name stays bound to the connection information it
//!   first arrived with while that incarnation lives; pushes and invalidations over the
//!   listener for a bound name are accepted only from the address the peer is known at.
//! - An optional job token ([`JobToken`], `NIXL_JOB_TOKEN`) authenticates every listener
//!   connection in both directions; it is not encryption ([`JobToken`] says what each
//!   mode protects against).
//! - The listener bounds what a connection can cost: a deadline per request (not per
//!   read), a 64 KiB cap on every frame but a metadata push, connection limits per source
//!   address and in all, and a bound on the frame bytes it holds; a backend's connection
//!   set-up for a new peer (which may wait seconds for it) never holds a lock that
//!   transfers take.
//! - `CUDA_IPC`'s socket admits only the same user (or root), by the kernel's
//!   credentials, and hands a VMM allocation's descriptor only to a loaded peer's process,
//!   for an id this agent exported.
//! - Who sent a notification or request is what the transport proves, never the name in
//!   it: LIBFABRIC's source address, the VERBS QP's connection, `CUDA_IPC`'s peer
//!   credentials; a VERBS HELLO or `GPUNETIO` notification connection naming a loaded
//!   peer (or this agent) is checked with that peer at its advertised address. Staging
//!   requests, answers and keys count only from the peer they belong to. A name no peer
//!   loaded here has stays the sender's word, as NIXL's targets need not load their
//!   initiators' metadata.
//!
//! ```
//! use nixl::{Agent, AgentConfig, Desc, DescList, MemKind, XferOp, XferStatus};
//! # fn main() -> nixl::Result<()> {
//! let agent = Agent::new("a", AgentConfig::default())?;
//! agent.create_backend("LOCAL", &Default::default())?;
//! let src = vec![7u8; 4096];
//! let mut dst = vec![0u8; 4096];
//! let regs = DescList::from_descs(MemKind::Dram, [Desc::from_slice(&src), Desc::from_slice(&dst)]);
//! // SAFETY: both buffers outlive the registration and every transfer below.
//! let _handle = unsafe { agent.register_mem(&regs, None)? };
//! let local = DescList::from_descs(MemKind::Dram, [Desc::from_slice(&src)]);
//! let remote = DescList::from_descs(MemKind::Dram, [Desc::from_slice(&dst)]);
//! let mut req = agent.create_xfer_req(XferOp::Write, &local, &remote, "a", Some(b"done".to_vec()))?;
//! assert_eq!(req.post()?, XferStatus::Done);
//! assert_eq!(agent.get_notifs()["a"], vec![b"done".to_vec()]);
//! # drop(req);
//! assert_eq!(dst[0], 7);
//! # Ok(()) }
//! ```

// docs.rs (nightly) marks what each feature adds.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod agent;
pub mod backend;
pub mod backends;
mod builtin;
pub mod device;
mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
mod listener;
pub mod mem;
mod mem_kind;
pub mod metadata;
mod os;
pub mod topology;

pub use agent::{params, Agent, AgentConfig, RegistrationHandle, XferDlist, XferReq};
pub use backend::{
    Backend, BackendInit, BackendParams, BackendRegistry, Capabilities, PostParams, XferOp,
    XferStatus, XferTelemetry,
};
pub use device::{GpuXferReqH, MemViewH};
pub use error::{Error, Result};
#[doc(hidden)]
pub use listener::fuzz_serve;
pub use listener::JobToken;
pub use mem::{Desc, DescList, MemKind, Region};
