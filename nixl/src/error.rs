//! The crate's one error type.

use crate::mem_kind::MemKind;

/// Everything that can go wrong in the agent, typed so callers can branch on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument is invalid (the message says which and why).
    #[error("invalid parameter: {0}")]
    InvalidParam(String),
    /// A descriptor has length zero.
    #[error("descriptor {index} has length zero")]
    ZeroLength {
        /// Position in its list.
        index: usize,
    },
    /// `addr + len` overflows the address space.
    #[error("descriptor {index} overflows: addr {addr:#x} + len {len}")]
    Overflow {
        /// Position in its list.
        index: usize,
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A descriptor of a prepared local list lies in a registration that was released
    /// (its [`RegistrationHandle`](crate::RegistrationHandle) dropped) after the list was
    /// prepared: its memory may be freed, so no new request may reach it.
    #[error("local descriptor {index} ({kind:?} {addr:#x}+{len} on device {dev_id}) lies in a registration released after its list was prepared: prepare the list again")]
    Deregistered {
        /// Position in its list.
        index: usize,
        /// Memory kind of the list.
        kind: MemKind,
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// Device id.
        dev_id: u64,
    },
    /// Local memory that no registration covers (or only partly covers).
    #[error("local descriptor {index} ({kind:?} {addr:#x}+{len} on device {dev_id}) is not inside one registered region{}", if *.partial { " (it is partly registered)" } else { "" })]
    NotRegistered {
        /// Position in its list.
        index: usize,
        /// Memory kind of the list.
        kind: MemKind,
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// Device id.
        dev_id: u64,
        /// Some of the range is registered, but not all of it in one region.
        partial: bool,
    },
    /// A remote descriptor that is not inside a region the peer registered (checked against
    /// the peer's metadata before anything is posted).
    #[error("remote descriptor {index} ({kind:?} {addr:#x}+{len} on device {dev_id}) is outside every region agent `{agent}` registered")]
    RemoteOutOfBounds {
        /// The peer.
        agent: String,
        /// Position in its list.
        index: usize,
        /// Memory kind.
        kind: MemKind,
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// Device id.
        dev_id: u64,
    },
    /// No metadata of that agent is loaded.
    #[error("unknown remote agent `{0}` (load its metadata first)")]
    UnknownAgent(String),
    /// No backend of that name is known to the agent (or compiled in).
    #[error("unknown backend `{0}`")]
    UnknownBackend(String),
    /// The chosen backend does not handle this memory kind.
    #[error("backend {backend} does not support {kind:?} memory")]
    UnsupportedMemKind {
        /// Backend name.
        backend: String,
        /// The memory kind asked for.
        kind: MemKind,
    },
    /// No backend can carry this transfer (none is shared by both sides for these kinds).
    #[error("no backend can transfer {local:?} to {remote:?} memory of agent `{agent}`")]
    NoCommonBackend {
        /// Peer.
        agent: String,
        /// Local memory kind.
        local: MemKind,
        /// Remote memory kind.
        remote: MemKind,
    },
    /// The two descriptor lists of a transfer do not match (count or lengths).
    #[error("descriptor lists do not match: {0}")]
    Mismatch(String),
    /// A metadata blob is malformed (truncated, oversized, bad counts or lengths, wrong magic).
    #[error("malformed metadata: {0}")]
    MalformedMetadata(String),
    /// The request is already posted and still in flight.
    #[error("transfer request is still in flight; wait for it before reposting")]
    RepostActive,
    /// The request has not been posted.
    #[error("transfer request was never posted")]
    NotPosted,
    /// The peer's process or connection is gone.
    #[error("remote agent `{agent}` disconnected: {reason}")]
    RemoteDisconnect {
        /// Peer.
        agent: String,
        /// What the transport reported.
        reason: String,
    },
    /// A transfer made no progress within the stall timeout.
    #[error("transfer stalled: no progress for {0:?}")]
    Stalled(std::time::Duration),
    /// The transfer was released (or the agent shut down) while in flight.
    #[error("transfer canceled")]
    Canceled,
    /// A network operation timed out (metadata exchange, connection).
    #[error("timed out: {0}")]
    Timeout(String),
    /// The backend failed; `code` is the transport's error number when it has one.
    #[error("backend {backend}: {message}")]
    Backend {
        /// Backend name.
        backend: String,
        /// The transport's error number (libfabric `FI_E*` / errno), or 0.
        code: i32,
        /// What failed.
        message: String,
    },
    /// A VRAM descriptor that is not device memory of the GPU it names: host memory,
    /// memory already freed, another GPU's memory, or a range running past its allocation.
    #[error("VRAM descriptor {index} ({addr:#x}+{len} on GPU {dev_id}): {reason}")]
    NotDeviceMemory {
        /// Position in its list.
        index: usize,
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// The GPU ordinal the descriptor names.
        dev_id: u64,
        /// What the memory really is.
        reason: String,
    },
    /// A GPU operation failed, or GPU memory was used where no CUDA driver or GPU exists.
    #[error("GPU: {0}")]
    Gpu(String),
    /// The backend cannot reach that peer at all (e.g. `CUDA_IPC` to another node).
    #[error("backend {backend} cannot reach agent `{agent}`: {reason}")]
    Unreachable {
        /// Backend name.
        backend: String,
        /// Peer.
        agent: String,
        /// Why (e.g. different boot ids).
        reason: String,
    },
    /// The backend has no such capability (e.g. a GPU device API on a host-only
    /// transport).
    #[error("backend {backend} does not support {what}")]
    NotSupported {
        /// Backend name.
        backend: String,
        /// What was asked.
        what: String,
    },
    /// Metadata that this agent will not load or act on: it names this agent itself, it
    /// would rebind a live peer's name to other connection information, or it came over
    /// the listener from an address the named peer is not known at (see
    /// [`crate::Agent::load_remote_metadata`], "Binding"). Nothing of it was loaded.
    #[error("metadata of `{agent}` refused: {reason}")]
    MetadataRefused {
        /// The agent the metadata (or the invalidation) names.
        agent: String,
        /// Why.
        reason: String,
    },
    /// The metadata listener's job token did not match (or one side has none): the
    /// request was not served (see [`crate::AgentConfig::job_token`]); or etcd refused
    /// this client's credentials, or their absence (`nixl::etcd`, feature `etcd`). The
    /// message names which.
    #[error("authentication failed: {0}")]
    Unauthenticated(String),
    /// Socket or file I/O.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Shorthand used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
