//! `LIBFABRIC`: RDM endpoints over the `fabric` crate, one or more rails, striping,
//! and notifications that fire only after the data has landed.
//!
//! # Rails
//! A rail is one fabric + domain + RDM endpoint + address vector + completion queue,
//! driven by its own worker thread, which issues the operations of posted transfers
//! (batching them with `FI_MORE`-free back-to-back posts and retrying on `FI_EAGAIN`)
//! and reads the completion queue (that also gives manual-progress providers such as
//! `tcp;ofi_rxm` their progress). `num_rails` rails may share one interface, so
//! striping is exercised on loopback. Descriptors of at least `striping_threshold`
//! bytes (default 128 KiB) are split across all rails; smaller ones go round-robin.
//!
//! # Notifications
//! With a notification, every WRITE is an `fi_writedata` whose 64-bit remote CQ data is
//! the transfer's key, drawn at random per post (63 bits, `NotifKeys`). The
//! notification itself is a message sent on rail 0 carrying the same key and the number
//! of writes to expect. The target counts remote CQ data completions per key (they
//! arrive on any rail, in any order, in any batch) and releases the notification only
//! when the count is reached and the message is in, so it can neither fire early nor be
//! lost. For READ the message is sent after the last read completed locally, with
//! nothing to count. A transfer of an agent to itself delivers its notification
//! directly once every operation completed.
//!
//! Who sent a notification: every notification leaves sealed (module `notif_mac`: an
//! HMAC-SHA256 under a key only the two agents of the pair can compute, from X25519 key
//! pairs whose public halves are in the connection information, and a sequence number
//! against replays). A message naming a loaded peer is delivered under that name only
//! with that peer's seal, whatever endpoint the provider names (libfabric 1.17's `shm`
//! misattributes a flood); without it, it is dropped and counted
//! ([`LibfabricBackend::unproven_notifications`]), unless the loaded incarnation's
//! process ended (then as below: its restarted successor seals under a key not loaded
//! yet). Other messages are judged by what the transport says (module `sources`): a
//! message from a loaded peer's endpoint that names another is refused; one that names an
//! agent this backend never loaded is delivered under that
//! name with `notif_senders=any` (the default: a target need not load its initiators'
//! metadata, as in NIXL) and refused with `notif_senders=loaded`. Where the provider
//! names the senders of remote CQ data too (`shm`, `sockets`), data counts only toward
//! notifications of the peer that sent it; elsewhere (`tcp;ofi_rxm`) the key, which no
//! one else has seen, ties data to its notification. Each sender (a loaded peer, or all
//! senders that are none, together) may have [`MAX_PENDING_NOTIFS`] notifications
//! waiting for their data or message; beyond that a message is dropped (counted in
//! [`LibfabricBackend::refused_notifications`], logged).
//!
//! # Dead peers
//! A transfer to a peer whose process died fails with `RemoteDisconnect`: from the
//! provider where it reports the broken connection (`tcp;ofi_rxm` flushes in-flight
//! operations within milliseconds), and on every provider from the OS where the peer
//! runs on the same host: the connection information carries the process's boot id,
//! pid and start time, and a transfer's status poll asks the peer's pidfd (`/proc` where
//! no pidfd can be opened), and `/proc/<pid>/stat` for a kill in progress: a killed
//! process takes its kernel's teardown to end (up to hundreds of milliseconds on a
//! loaded host), but it never runs again once SIGKILL is pending, so it is reported
//! then (the private `liveness` module). A SIGKILLed peer over `shm` (which never
//! reports one itself: only the 30 s stall timeout caught it before) is so reported
//! within milliseconds of the kill, as over `tcp;ofi_rxm` and `sockets`
//! (`nixl/tests/dead_peer.rs`, `restart_matrix.rs`; figures in `docs/BENCHMARKS.md`).
//! Metadata of an incarnation that is already gone (a registry's stale copy) is
//! recognised when it is loaded — its heartbeat hub refuses the handshake, or a newer
//! incarnation's hub answers — and transfers to it fail with `RemoteDisconnect` at once.
//! A peer
//! on another host (or in another pid namespace) that vanishes — its link cut, its
//! machine killed — is found by heartbeats (the private `conn` module): the peer's own thread sends one
//! every `heartbeat_ms` over a TCP connection of its own, and `heartbeat_misses`
//! intervals of silence (0.5 s by default) fail its transfers with `RemoteDisconnect`.
//!
//! A transfer whose operations are still pending when the OS or the heartbeats report
//! the peer gone fails once its rails have read their queues twice more (what the peer
//! answered before it ended is reaped first), at most the 250 ms grace of the private
//! `conn` module where a rail makes no progress. A restarted peer (same name, new
//! process) is reached as soon as its new connection information is loaded: its
//! addresses are new entries of the AVs, and the dead incarnation's go once no transfer
//! or queued job uses them.
//!
//! libfabric 1.17's `shm` lets a dead peer stop a rail for good in two ways, which the
//! backend undoes once the OS says that the peer's process ended (module `shm_orphans`;
//! it checks the provider's layout before it touches anything, and otherwise leaves the
//! rail as the provider has it):
//! - an operation larger than a command's inline data waits in the sender's response
//!   queue for the peer's answer, and the queue is reaped in order: one operation a dead
//!   peer never answered blocked every later completion of the rail, to every peer (a
//!   restarted peer and a second peer stalled until the stall timeout,
//!   `nixl/tests/restart_matrix.rs`). Those operations are failed (`ECONNRESET`).
//! - every operation to a peer takes a spinlock inside the peer's shared region, which
//!   the peer's own progress holds while it copies: a peer killed then leaves it taken,
//!   whoever writes to that peer next spins inside the provider, and reaping an
//!   operation of that peer waits for it. The lock is released.
//!
//! The rail workers also ask the OS and the heartbeats before every job, so a peer known
//! to be dead is never called into. One that dies while operations to it are being
//! issued can wedge the worker issuing them inside the provider until its lock is
//! released (when a transfer to it is polled); meanwhile later transfers on that rail
//! fail with a typed `Backend` error naming the wedged rail once its round has lasted
//! 5 s (`WEDGED_AFTER`). Not undone: a peer killed while it writes into this process's
//! own region (it holds this region's lock for microseconds per operation), and any of
//! this on a libfabric whose `shm` layout is not 1.17's (`local_provider=none`, same-host
//! peers over the network provider, avoids shm there). A dead peer's regions are
//! emptied — their memory freed, while the provider keeps them mapped (`Rail::forget`)
//! — once it is forgotten, and by the next process on this host whose backend opens shm.
//!
//! Without a progress thread (`AgentConfig::progress_thread = false`) there are no
//! workers: posting issues what it can, and the caller's `XferReq::status` and
//! `Agent::get_notifs` drive the rails (a target must then poll `get_notifs` for
//! one-sided traffic to move on manual-progress providers, as in NIXL).
//!
//! # VRAM (feature `cuda`)
//! Each VRAM registration is made one of two ways, chosen per registration and shown by
//! [`crate::Agent::query_mem`] as `LIBFABRIC(direct)` or `LIBFABRIC(staged)`:
//! - **direct**: where the provider advertises `FI_HMEM` and, when the backend is
//!   created, accepts a probe registration of a small device buffer, the provider is
//!   opened with `FI_HMEM` and VRAM is registered with `FI_HMEM_CUDA` and the device
//!   ordinal; it moves like DRAM. Its public metadata is the ordinary key list.
//! - **staged**: where the provider has no `FI_HMEM` (`tcp`, `sockets`), or refuses the
//!   probe (a libfabric built without CUDA answers `FI_ENOSYS` even on `shm`, which
//!   advertises `FI_HMEM` regardless), or refuses a registration, the reason — the typed
//!   `Unsupported` — is logged (and kept: `LibfabricBackend::direct_vram_refusal`) and
//!   the provider stays in its plain variant (`shm` opened with `FI_HMEM` moves DRAM
//!   several times slower: `docs/BENCHMARKS.md`). The region goes through the staging
//!   pipeline ([`super::staging`]):
//!   chunks of at most one slot move through pinned, NIC-registered host bounce slots,
//!   the device copy of one chunk overlapping the network operation of the previous
//!   one. Its public metadata is `0 | 1 | slot size u32`, so a peer knows to stage.
//!
//! A peer's VRAM is reachable even without feature `cuda` here: the peer stages it (or
//! registered it directly). Per chunk (see [`super::staging`] for the protocol): a
//! WRITE from local VRAM is copied VRAM→slot and RMA-written from the slot; a READ into
//! local VRAM is RMA-read into a slot and copied slot→VRAM; for remote staged VRAM the
//! initiator sends an `NXST` control message on its rail (OFFER for a WRITE, FETCH for a
//! READ) and the target, the active side, RMA-reads the chunk into one of its serve
//! slots and copies it into its VRAM (then answers DONE; the chunk counts toward the
//! notification only now), or copies VRAM→slot and RMA-writes it back with remote CQ
//! data `1<<63 | token` (notification keys keep bit 63 clear), each write completing
//! only once delivered, and then answers FETCHED. The initiator takes the chunk as
//! fetched only on that sealed answer (and its data words): remote CQ data carries no
//! seal and `shm` misattributes a flood, so a data word with a guessed or observed
//! token ends nothing. A staged transfer's notification therefore fires only once its
//! last byte is in the target's VRAM.
//!
//! Resources are bounded: `staging_chunks` slots for this side's transfers and as many
//! for serving peers (the halves never lend to each other, so two agents writing to each
//! other cannot deadlock), at most `2 × staging_chunks` requests outstanding, 1,024
//! staging operations in flight, 64 control-message buffers. A released request starts
//! nothing more, waits (bounded) for device copies touching its memory, and returns its
//! slots as their operations complete — except a slot a peer may still write into (an
//! unanswered FETCH), which returns when the answer comes or the peer is invalidated or
//! reconnects. A peer that dies mid-pipeline fails the transfer with `RemoteDisconnect`
//! where the transport notices, else `Stalled` (the target holds nothing for it).
//!
//! Cost: each staged side adds one copy through host memory (two on a VRAM→VRAM
//! transfer), each at the pinned copy rate, and a control message
//! per chunk for remote staged memory (two for a READ: the FETCH and its answer). Pipelined, the expected bandwidth is about
//! min(network, pinned copy rate) for transfers of several chunks; a transfer of a single
//! chunk pays the copies in series. `staging_chunk` trades that latency (smaller chunks
//! overlap sooner) against per-operation cost (larger messages run closer to the
//! network's peak; figures in `docs/BENCHMARKS.md`).
//!
//! # VRAM and a peer's DRAM on this host (feature `cuda`)
//! Between VRAM and the DRAM of another process on this host, a transfer is one copy
//! engine copy instead of the staged pipeline (module `peer_copy`): the process that
//! owns the host memory copies against the other side's VRAM imported through CUDA IPC
//! (imported once per peer incarnation; host regions pinned once, on first use). For
//! READ peer VRAM → local DRAM and WRITE local DRAM → peer VRAM this side copies on its
//! own streams (the target advertises its VRAM's IPC handle in the region's metadata);
//! for WRITE local VRAM → peer DRAM and READ peer DRAM → local VRAM the target copies on
//! request, after checking that the request comes from a loaded peer (the transport's
//! word), that the VRAM lies in what that peer advertised and the DRAM in its own
//! registrations, and answers when its copies completed. Notifications go after the
//! last byte. Chosen per transfer where every descriptor pair fits; a target that
//! declines (no GPU, or it never loaded this side's metadata) makes the request run its
//! ordinary path (staged, or direct `FI_HMEM`). Parameter `vram_peer_copy` (`auto`, the
//! default, or `off`; `vram_mode=staged` implies `off`). Which path a transfer takes:
//! its telemetry's `staged_bytes` (0 on this path), the peer's
//! [`crate::backend::Backend::peer_transport`] (which nixlbench prints), and
//! [`crate::Agent::query_mem_info`] with meta `peer:<agent>`: the path (`vram_peer_dram`)
//! and the counters of what moved directly, was served to peers, or fell back
//! (`peer_copy_bytes`, `peer_copy_served_bytes`, `peer_copy_fallbacks`).
//!
//! # Peers on this host
//! Beside the network provider's rails the backend opens `shm` rails (unless
//! `local_provider=none`, or the provider is `shm`), registers memory with both, and
//! reaches a peer that shares this host's memory (same boot, pid namespace, and mount
//! namespace or `/dev/shm`) through `shm`, every other peer through the network
//! provider (module `local_rails`).
//!
//! # Parameters
//! `provider` (default: the first of `cxi`, `efa`, `tcp;ofi_rxm`, `sockets` found),
//! `local_provider` (`shm`, the default where `shm` is present, or `none`),
//! `local_rails` (the `shm` plane's rail count, 1..=16; default as `num_rails` for `shm`),
//! `node` (default `127.0.0.1` for tcp and sockets), `num_rails` (default: one per two
//! cores, at most eight, for `tcp`, `sockets` and `udp`, and one per four cores, at most
//! four, for `shm`, where a CPU copies the data, so that large blocks are striped over
//! several copying threads; 1 for NIC providers; see `default_rails` for `shm`'s price
//! when peers die mid-transfer),
//! `striping_threshold` (bytes, default 131072; 4 MiB for `shm`, whose pieces are at
//! least 1 MiB), `cma_write` (`shm` only, default `1`: WRITE blocks of at least 2 MiB
//! to a peer on this host are split into pieces the peer pulls through the provider
//! and pieces this process pushes into it at the same time; `0`: the provider copies
//! everything; see the `cma` module), `cma_read` (`shm` only, default `1`: READ blocks
//! of at least 2 MiB from a peer on this host that serves it are split into pieces this
//! process copies from the peer itself and pieces the peer pushes into it on request,
//! and this backend serves such requests — with its rail workers' threads only; `0`:
//! neither; see the `assist` module), `cma_inline` (`shm` only, bytes, default 1 MiB: a
//! transfer of at most this many bytes in all to or from a peer on this host, DRAM on
//! both sides, is copied by CMA in the thread that posts it, where `cma_write` /
//! `cma_read` allow it — no progress thread of either side takes part, and a WRITE
//! without notification is done when `post` returns; 0: never; see `xfer::InlineCopy`),
//! `cma_threads` (`shm` only, default a quarter of the CPUs, at most 8; below 2: off: a
//! transfer of many blocks — at least 64, 8 MiB in all, at most 2 MiB each on average,
//! a KV-cache pull — to or from a peer on this host, under the same conditions as
//! `cma_inline`, is copied within `post` by that many threads, each a share of the
//! blocks in `process_vm_readv`/`process_vm_writev` calls of up to 1,024 blocks),
//! `busy_poll` (`1`: rail workers never
//! sleep — default `0`: spin while busy and for 20 ms after any activity, incoming
//! remote operations included (1 s where there is no wait fd), then sleep on the
//! queue's wait fd or nap; see
//! the `idle` module for what wakes a worker), `heartbeat_ms` (default 100; 0: no
//! heartbeats), `heartbeat_misses` (default 5; see the private `conn` module) and
//! `notif_senders` (`any`, the default, or `loaded`: whose notifications are delivered,
//! see "Notifications").
//!
//! Staging: `vram_mode` (`auto`: direct where possible, else staged — the default;
//! `staged`: always staged, and the provider is opened without `FI_HMEM`; `direct`: a
//! refused direct registration is the registration's error, `Backend` with the
//! provider's code), `staging_chunk` (slot size in bytes, a multiple of 4096, default
//! 524288), `staging_chunks` (slots per half, 2..=1024, default 16: 16 MiB of pinned
//! memory in all, allocated and registered at the first staged registration),
//! `stage_dram` (`1`: DRAM registrations are staged too, with `memcpy` for the copies —
//! the pipeline end to end without a GPU, for tests), `vram_peer_copy` (`auto`: VRAM ↔
//! a same-host peer's DRAM in one direct copy where it fits, see above — the default;
//! `off`: never).
//!
//! Memory under a flood of messages (`tcp;ofi_rxm`): `ofi_rxm` keeps every message that
//! finds no posted receive in a bounce buffer of `FI_OFI_RXM_BUFFER_SIZE` bytes (default
//! 16 KiB), without limit, until a rail worker takes it; a process flooding a rail with
//! small messages faster than the worker takes them grows the target by that much per
//! message (hundreds of MiB under 100,000 on a loaded machine; docs/BENCHMARKS.md,
//! "nixl: load under attack"). Where peers may be hostile, set a small size (512: larger
//! messages then go by rendezvous, which leaves their bytes at the sender) in the
//! environment of *every* process of the job before it first uses libfabric (with it
//! set in the target alone, the initiator's first WRITE never completed in our run),
//! and libfabric reads it once. This backend does not set it itself for that reason.

mod assist;
mod cma;
mod conn;
mod host;
mod idle;
/// Moved to the backends' shared module (VERBS watches same-host peers too).
use super::liveness;
mod local_rails;
mod notif_mac;
mod peer_copy;
#[cfg(feature = "cuda")]
mod peer_xfer;
mod shm_orphans;
mod sources;
mod stage_net;
mod vram;
mod worker;
mod xfer;
use xfer::{
    decode_notif, encode_notif, is_disconnect, send_message, send_message_blocking, Copier,
    FabricXfer, InlineCopy, PeerHealth, RailOp, XferShared,
};

use super::heartbeat::{HeartbeatConfig, Hub, PeerWatch};
use super::shared::NotifTracker;
use super::staging::{self, Failure, NetError, Plan, RunSink, RunSpec, Side, StageNet};
use crate::backend::{
    Backend, BackendInit, BackendParams, BackendXfer, Capabilities, LocalMd, NotifWaker, RemoteMd,
    XferEntry, XferOp,
};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use cma::{CmaPeer, PUSH_THRESHOLD};
use conn::{encode_conn_info, parse_conn_info, start_hub, watch_peer};
use fabric::{
    Access, Address, AddressVector, AvType, Caps, CompletionQueue, Counter, CqFormat, Domain,
    EndpointBuilder, EndpointType, Fabric, HmemIface, Info, InfoBuilder, MemoryRegion,
    RemoteMemory, WaitObj,
};
use idle::IdleWait;
use liveness::Liveness;
pub use notif_mac::{fuzz_sealed_control, fuzz_sealed_notif};
use notif_mac::{Identity, Sealer};
use parking_lot::{Mutex, RwLock};
use sources::{PeerSource, Sources};
use stage_net::{failure_of, FabAddr, Stager};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vram::choose_info;
use worker::{run_worker, Progress, RailJob, Worker};

/// The backend's name.
pub const NAME: &str = "LIBFABRIC";
/// Providers tried in order when none is named (NIXL's priority).
pub const PROVIDER_PRIORITY: &[&str] = &["cxi", "efa", "tcp;ofi_rxm", "sockets"];
/// Default size from which one descriptor is split across all rails.
pub const DEFAULT_STRIPING_THRESHOLD: usize = 128 << 10;
/// The same over `shm`: its copies stay on one core up to a few MiB (from 4 MiB several
/// rails multiply one rail's bandwidth; at 2 MiB, splitting gained nothing measurable:
/// `docs/BENCHMARKS.md`, "nixl: LIBFABRIC over shm").
///
/// Why pieces of one 2 MiB block do not copy in parallel: libfabric 1.17's `shm` moves
/// large RMA with CMA (`process_vm_readv`, by the side that receives the data: the
/// target for a WRITE, the initiator for a READ), and the kernel pins the source's
/// pages 4 KiB at a time under the page-table lock of their 2 MiB region, so copies
/// whose sources share a region serialise (`tools/bench/cma-scaling.c` shows two
/// threads copying a 2 MiB block at half the rate they reach when the halves lie in two
/// regions). One thread's copy itself slows from 1 MiB to 2 MiB (the core's 2 MiB L2).
/// Figures: `docs/BENCHMARKS.md`. Blocks from 2 MiB
/// get around it by copying from both ends (`cma_write`, module `cma`; `cma_read`,
/// module `assist`): a WRITE's piece pushed by the initiator pins the target's pages, not
/// the initiator's; a READ's piece pushed by the target pins the initiator's.
pub const DEFAULT_SHM_STRIPING_THRESHOLD: usize = 4 << 20;
/// The smallest piece a striped block is split into over `shm` (a lower
/// `striping_threshold` splits into fewer pieces rather than smaller ones): a block of a
/// few hundred KiB split over rails moved slower than whole (`docs/BENCHMARKS.md`).
pub const SHM_MIN_STRIPE_PIECE: usize = 1 << 20;
/// Transfers of at most this many bytes to or from a peer on this host are copied by
/// CMA in the thread that posts them (parameter `cma_inline`; module `xfer`'s
/// `InlineCopy`).
pub const DEFAULT_CMA_INLINE: usize = 1 << 20;
/// A transfer of at least this many blocks and [`CMA_BULK_MIN_BYTES`] in all to or from
/// a peer on this host (a KV-cache pull: thousands of blocks of some KiB) is copied by
/// CMA in the posting call by several threads at once (parameter `cma_threads`): the
/// provider's path costs an operation per block and copies in one thread per side.
pub const CMA_BULK_MIN_BLOCKS: usize = 64;
/// See [`CMA_BULK_MIN_BLOCKS`].
pub const CMA_BULK_MIN_BYTES: u64 = 8 << 20;
/// Mean block size up to which a transfer counts as bulk: larger blocks keep the
/// provider's path, whose pulls and pushes of halves suit them.
pub const CMA_BULK_MAX_MEAN_BYTES: u64 = 2 << 20;

/// Default `cma_threads`: a quarter of the CPUs, at most 8; below 2 the bulk path is off
/// (a machine with few cores keeps them for the application).
pub fn default_cma_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    (cpus / 4).min(8)
}

/// How many rails a block of `len` bytes is split over: all of them from `threshold`,
/// but no piece under `min_piece` (0: no floor); 1 means not striped.
fn stripe_pieces(len: usize, nrails: usize, threshold: usize, min_piece: usize) -> usize {
    if nrails < 2 || len < threshold {
        return 1;
    }
    match len.checked_div(min_piece) {
        Some(pieces) => pieces.clamp(1, nrails),
        None => nrails,
    }
}
/// Largest notification message (header, sender name and seal included).
pub const MAX_NOTIF_BYTES: usize = NOTIF_SLOT;

const NOTIF_SLOT: usize = 8192;
const NOTIF_SLOTS: usize = 64;
const NOTIF_MAGIC: &[u8; 4] = b"NXNT";
/// Contexts with this bit are receive slots; the fabric crate reserves bit 63.
const RECV_CONTEXT: u64 = 1 << 62;
/// Operations one rail keeps in flight before it waits for completions.
const MAX_OUTSTANDING: usize = 512;
/// Contexts of staging operations: the engine's operation id in the low 44 bits, a
/// control-message buffer (+1) in bits 44..60.
const STAGE_CONTEXT: u64 = 1 << 60;
const STAGE_OP_BITS: u32 = staging::ID_BITS;
/// Control-message send buffers (each [`staging::MAX_CTRL_BYTES`]).
const CTRL_SLOTS: usize = 64;
/// Most requester addresses a target keeps resolved.
const MAX_REPLY_ADDRS: usize = 1024;
/// Notifications one sender may have waiting for their data or message.
pub const MAX_PENDING_NOTIFS: usize = 4096;

/// Notification keys: unpredictable per transfer (SipHash of a counter under a random
/// key of this backend), so that no one but the target, which receives them, can name a
/// transfer's key — remote CQ data that a provider does not attribute to its sender
/// counts only toward the notification whose key it carries. Bit 63 stays clear: remote
/// CQ data with it set is a staged FETCH's.
#[derive(Debug, Default)]
struct NotifKeys {
    hasher: std::collections::hash_map::RandomState,
    next: AtomicU64,
}

impl NotifKeys {
    fn next(&self) -> u64 {
        use std::hash::BuildHasher;
        self.hasher
            .hash_one(self.next.fetch_add(1, Ordering::Relaxed))
            & !staging::FETCH_DATA
    }
}

#[derive(Debug)]
struct Rail {
    /// `shm`: fails the operations a peer whose process ended left unanswered, which
    /// would block the rail's completions for good (see [`shm_orphans`]). First, so that
    /// it is dropped first: it unregisters the endpoint before the endpoint closes.
    orphans: Option<shm_orphans::Repairs>,
    _fabric: Fabric,
    domain: Domain,
    ep: fabric::Endpoint,
    av: AddressVector,
    cq: CompletionQueue,
    submit: Mutex<VecDeque<RailJob>>,
    /// How the rail's worker sleeps when idle, and what wakes it.
    idle: IdleWait,
    inject_size: usize,
    max_msg: usize,
    /// Departed peers stay in the AV (`shm`: see [`Rail::forget`]).
    keeps_departed: bool,
    /// Completions name their senders (`FI_SOURCE`; module `sources`).
    names_senders: bool,
    /// ... of remote CQ data too (`shm`, `sockets`; `tcp;ofi_rxm` 1.17 leaves it unset).
    names_data_senders: bool,
    /// The handle a sender the AV does not hold is reported as (`shm`: 0, taken by this
    /// rail's own endpoint): never attributed.
    unattributable: Option<Address>,
    /// When the round of progress now running on this rail began ([`round_clock_ns`];
    /// 0: none running): a round that never ends is a thread stuck inside the provider
    /// (the module documentation's known limit), see [`Rail::wedged_for`].
    round_since: AtomicU64,
    /// Rounds of progress completed on this rail: a transfer whose peer died waits for
    /// a few of them (its last completions reaped), not for a fixed time.
    rounds: AtomicU64,
    /// A round lasting past [`WEDGED_AFTER`] means a stuck provider call (`shm`: a dead
    /// peer's region lock); elsewhere it means a starved thread, whose transfers are
    /// not failed for it (their operations are in the provider and will complete).
    can_wedge: bool,
}

/// How long one round of a `shm` rail's progress may run before the rail counts as
/// wedged. Rounds take microseconds (provider calls never block); this only bounds how soon
/// transfers behind a wedged rail fail instead of waiting for the stall timeout, with
/// room for a thread descheduled on a loaded machine.
const WEDGED_AFTER: Duration = Duration::from_secs(5);

/// Monotonic nanoseconds from an epoch an hour before this process first asked, so
/// never 0 (a rail's "no round running").
fn round_clock_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = EPOCH.get_or_init(|| {
        let now = Instant::now();
        now.checked_sub(Duration::from_secs(3600)).unwrap_or(now)
    });
    (epoch.elapsed().as_nanos() as u64).max(1)
}

impl Rail {
    /// Whether `addr` names no one in particular (see [`Rail::unattributable`]).
    fn is_unattributable(&self, addr: Address) -> bool {
        self.unattributable == Some(addr)
    }

    /// A round of progress begins (`true`) or ends (`false`).
    fn in_round(&self, running: bool) {
        let stamp = if running { round_clock_ns() } else { 0 };
        self.round_since.store(stamp, Ordering::Relaxed);
        if !running {
            self.rounds.fetch_add(1, Ordering::Release);
        }
    }

    /// Rounds of progress this rail completed so far.
    fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Acquire)
    }

    /// How long the running round has lasted, once it is past [`WEDGED_AFTER`].
    fn wedged_for(&self) -> Option<Duration> {
        let since = self.round_since.load(Ordering::Relaxed);
        if since == 0 || !self.can_wedge {
            return None;
        }
        let lasted = Duration::from_nanos(round_clock_ns().saturating_sub(since));
        (lasted > WEDGED_AFTER).then_some(lasted)
    }

    /// Removes a departed peer's address from the AV — except on `shm`, where libfabric
    /// 1.17 hands the slot to the next peer inserted and that peer's rail worker then
    /// crashes in `fi_cq_read` (an agent invalidated and another loaded after it, e.g.
    /// the etcd watch test: SIGSEGV with `provider=shm` before this). Kept, each holds
    /// a slot of the AV until the backend closes; once the provider has no slot left,
    /// loading a peer fails on shm and the network plane takes it ([`local_rails`]). The
    /// provider keeps a kept peer's region mapped: that of a peer whose process ended is
    /// emptied instead ([`shm_orphans`]), so it holds no memory.
    fn forget(&self, addr: Address) {
        if self.keeps_departed {
            return;
        }
        if let Err(e) = self.av.remove(&[addr]) {
            tracing::debug!(error = %e, "fi_av_remove of a departed peer failed");
        }
    }

    /// Queues a job for the rail's worker and wakes it if it sleeps.
    fn push_job(&self, mut job: RailJob) {
        // Every notification leaves sealed ([`notif_mac`]), whoever queued it.
        if let Some((_, message)) = job.notif.as_mut() {
            *message = job.peer.seal_notif(std::mem::take(message));
        }
        self.submit.lock().push_back(job);
        self.idle.wake();
    }
}

/// Shared between the backend and its workers.
#[derive(Debug)]
struct Common {
    /// Notifications, released only after their data (key: [`NotifKeys`]), bounded per
    /// sender ([`MAX_PENDING_NOTIFS`]).
    notifs: Arc<NotifTracker<u64>>,
    /// The loaded peers' endpoints: who sent what (module `sources`).
    sources: Arc<Sources>,
    /// Notifications only from loaded peers (`notif_senders=loaded`).
    loaded_senders_only: bool,
    /// This backend's agent (a notification naming it never comes from the network).
    agent_name: String,
    /// Notification messages and data refused for who sent them.
    refused_notifs: AtomicU64,
    /// Of those, notifications naming a loaded peer without its proof ([`notif_mac`]):
    /// forged, replayed or unsealed.
    unproven_notifs: AtomicU64,
    /// Rail control messages (staging, READ assist, direct copy) dropped for their seal:
    /// one naming or coming from a loaded peer without its proof (forged, replayed or
    /// unsealed), or a channel's that does not open ([`notif_mac`]).
    unproven_controls: AtomicU64,
    /// Rail messages dropped as malformed (anyone may send them).
    malformed: AtomicU64,
    /// Pair keys with senders of sealed control messages this side has not loaded.
    channels: notif_mac::Channels,
    /// The VRAM staging pipeline (idle and costless until something is staged).
    stager: Arc<Stager>,
    /// Local rail i → this peer's address in rail i's AV, per peer.
    peers: RwLock<HashMap<String, Peer>>,
    stop: AtomicBool,
    /// Workers never block: incoming one-sided traffic on manual-progress providers
    /// (which the target cannot see as completions) moves at full speed.
    busy_poll: bool,
    /// Bytes of WRITEs the rail workers copied into same-host peers themselves.
    pushed_bytes: AtomicU64,
    /// Bytes of READs the rail workers copied from same-host peers themselves.
    pulled_bytes: AtomicU64,
    /// Bytes of READs that same-host peers pushed into this process on request.
    assisted_bytes: AtomicU64,
    /// Serves READ assists to same-host peers (`cma_read`; see [`assist`]).
    assist: Option<Arc<assist::Server>>,
    /// Direct VRAM ↔ same-host peer DRAM copies (see [`peer_copy`]).
    peer_copy: peer_copy::Shared,
}

#[derive(Debug, Clone)]
struct Peer {
    conn_info: Vec<u8>,
    /// Who it is as the transport knows it (module `sources`).
    source: Arc<PeerSource>,
    addrs: Arc<PeerAddrs>,
    /// The peer's process, where the OS can tell us when it ends (same host).
    liveness: Option<Arc<Liveness>>,
    /// The peer's heartbeats, where both sides send them (see [`conn`]).
    watch: Option<Arc<PeerWatch>>,
    /// The peer's process, where WRITEs to it may be pushed into it (see [`cma`]), or
    /// it may push pieces of READs (see [`assist`]).
    cma: Option<Arc<CmaPeer>>,
    /// Another process on this host (same boot and pid namespace, another pid): its
    /// VRAM may be imported through CUDA IPC (see [`peer_copy`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    same_host: bool,
    /// ... and it copies between its DRAM and this side's VRAM on request.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    serves_peer_copies: bool,
}

/// A peer's address in each rail's AV. Removed from the AVs only when the last holder
/// lets go: the peer table, and every prepared transfer and queued job that may still
/// post to it. (Removing it while a worker could still post to it made `fi_writedata`
/// dereference a freed rxm peer: a crash when a peer was invalidated or reloaded while
/// transfers to it were in flight.)
#[derive(Debug)]
struct PeerAddrs {
    rails: Vec<Arc<Rail>>,
    addrs: Vec<Address>,
    /// The peer's endpoint names, as inserted into each rail's AV.
    names: Vec<Vec<u8>>,
    /// The peer's process, where the OS can tell when it ends (same host).
    process: Option<Arc<Liveness>>,
    /// Seals this side's notifications to the peer ([`notif_mac`]): shared by every
    /// load of the same peer incarnation, so its sequence never goes back.
    sealer: Arc<Sealer>,
    /// The peer's public key the sealer was made with.
    notif_key: [u8; 32],
    /// The shared lane the peer offered (same host; module `worker::peer_copies`) and the
    /// rail that rings its reader: this side's notifications and direct-copy requests to
    /// it go there while it has room.
    lane: OnceLock<(Arc<crate::backends::peer_dram::mailbox::Mailbox>, usize)>,
}

impl PeerAddrs {
    /// `message` sealed for this peer where it is a plain notification frame; anything
    /// else (already sealed, or another kind of message) as it is.
    fn seal_notif(&self, message: Vec<u8>) -> Vec<u8> {
        if message.starts_with(NOTIF_MAGIC) {
            self.sealer.seal(&message)
        } else {
            message
        }
    }

    /// Puts `message` (a sealed notification) in the peer's shared lane, ringing its
    /// reader where it said it sleeps. `None`: not through the lane (none, or the
    /// message does not fit a slot: the caller sends it on a rail); `WouldBlock`: the
    /// lane is full for now — the caller tries again, as with a busy rail, so that the
    /// peer's messages keep their order.
    fn send_by_lane(&self, message: &[u8]) -> Option<fabric::Result<()>> {
        use crate::backends::peer_dram::mailbox::Push;
        let (lane, ring) = self.lane.get()?;
        match lane.try_push_request(message) {
            Push::Pushed => {}
            Push::Full => {
                return Some(Err(fabric::Error::WouldBlock {
                    call: "a shared lane's push",
                }))
            }
            Push::Unusable => return None,
        }
        if !lane.target_asleep() {
            return Some(Ok(()));
        }
        Some(self.ring_lane(*ring))
    }

    /// Rings the reader of the peer's lane (a sealed doorbell on rail `ring`, where its
    /// worker is woken by traffic), waiting up to 5 s for the rail to take it.
    fn ring_lane(&self, ring: usize) -> fabric::Result<()> {
        let bell = self.sealer.seal_control(&peer_copy::encode_doorbell());
        let (rail, dest) = (&self.rails[ring], self.addrs[ring]);
        let deadline = Instant::now() + Duration::from_secs(5);
        rail.ep.retry(deadline, || rail.ep.inject(&bell, dest))
    }

    /// Over shm, once the peer's process is known to have ended: fails what it left
    /// unanswered and releases the lock it may have left taken (see `shm_orphans`), also
    /// for a rail worker stuck on that lock inside the provider. At most every few
    /// milliseconds.
    fn settle_if_ended(&self) {
        let (Some(process), Some(repairs)) = (
            &self.process,
            self.rails.iter().find_map(|r| r.orphans.as_ref()),
        ) else {
            return;
        };
        if process.has_ended() {
            repairs.after_death(process.pid(), &self.names);
        }
    }
}

impl Drop for PeerAddrs {
    fn drop(&mut self) {
        for (rail, addr) in self.rails.iter().zip(&self.addrs) {
            rail.forget(*addr);
        }
        // Over shm the departed peer stays mapped (see `Rail::forget`): once its process
        // ended, what it left unanswered is failed and its regions' memory freed (see
        // `shm_orphans`).
        if let Some(process) = &self.process {
            if self.rails.iter().any(|r| r.orphans.is_some()) && process.has_ended_now() {
                shm_orphans::settle_logged(process.pid(), &self.names, true);
            }
        }
    }
}

/// The LIBFABRIC backend.
#[derive(Debug)]
pub struct LibfabricBackend {
    agent_name: String,
    rails: Vec<Arc<Rail>>,
    common: Arc<Common>,
    progress: Arc<Progress>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    striping_threshold: usize,
    /// No striped piece is smaller ([`SHM_MIN_STRIPE_PIECE`] over shm; 0: no floor).
    stripe_min_piece: usize,
    /// Large WRITEs to peers on this host are copied from both ends (`shm`, parameter
    /// `cma_write`; see [`cma`]).
    cma_write: bool,
    /// Large READs from peers on this host are copied from both ends too (`shm`,
    /// parameter `cma_read`; see [`assist`]).
    cma_read: bool,
    /// Transfers of at most this many bytes to or from a peer on this host are copied
    /// in the posting thread, where `cma_write` / `cma_read` allow it (parameter
    /// `cma_inline`; see `xfer::InlineCopy`).
    cma_inline: usize,
    /// Threads that copy a bulk transfer to or from a peer on this host within `post`
    /// (parameter `cma_threads`; below 2: none; see [`CMA_BULK_MIN_BLOCKS`]).
    cma_threads: usize,
    /// Bytes so copied.
    inline_bytes: Arc<AtomicU64>,
    keys: Arc<NotifKeys>,
    next_rail: AtomicUsize,
    mem_kinds: Vec<MemKind>,
    remote_kinds: Vec<MemKind>,
    provider: String,
    /// The provider was opened with `FI_HMEM` (device memory may register directly).
    hmem: bool,
    /// Why it was not (the probe's typed refusal, or the provider lacking `FI_HMEM`).
    direct_refusal: Option<String>,
    vram_mode: VramMode,
    /// Stage DRAM registrations too (tests the pipeline without a GPU).
    stage_dram: bool,
    /// The first staged VRAM registration was logged with its reason.
    staged_logged: AtomicBool,
    /// Sends heartbeats to the peers that watch this backend, watches those it loaded.
    hub: Option<Hub>,
    /// The key pair whose Diffie-Hellman secrets with the loaded peers' public keys
    /// seal notifications and rail control messages ([`notif_mac`]).
    notif_identity: Arc<Identity>,
}

/// How VRAM registrations are made (parameter `vram_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum VramMode {
    /// Directly where the provider has `FI_HMEM` and accepts the registration, else
    /// staged.
    Auto,
    /// Always staged.
    Staged,
    /// Directly or not at all (the provider's refusal is the registration's error).
    Direct,
}

/// How one registration is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RegMode {
    /// Host memory registered with the provider.
    Plain,
    /// Device memory registered with the provider (`FI_HMEM`).
    Direct,
    /// Through the staging pipeline.
    Staged,
}

fn fabric_error(e: fabric::Error) -> Error {
    match e {
        fabric::Error::RemoteDisconnect { detail, errno, .. } => Error::RemoteDisconnect {
            agent: String::new(),
            reason: format!("{detail} (errno {errno})"),
        },
        other => Error::Backend {
            backend: NAME.into(),
            code: other.errno().unwrap_or(0),
            message: other.to_string(),
        },
    }
}

fn param<T: std::str::FromStr>(params: &BackendParams, key: &str, default: T) -> Result<T> {
    super::shared::param(NAME, params, key, default)
}

pub(crate) fn create(init: &BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(local_rails::open_planes(init)?))
}

/// [`open`] for `agent`'s name and settings, in tests.
#[cfg(test)]
fn open_for(agent: &crate::Agent, params: &BackendParams) -> Result<LibfabricBackend> {
    open(&agent.backend_init(params.clone()))
}

fn open(init: &BackendInit) -> Result<LibfabricBackend> {
    let params = &init.params;
    const KNOWN: &[&str] = &[
        "provider",
        "node",
        "num_rails",
        "striping_threshold",
        "busy_poll",
        "vram_mode",
        "staging_chunk",
        "staging_chunks",
        "stage_dram",
        "cma_write",
        "cma_read",
        "cma_inline",
        "cma_threads",
        "notif_senders",
        peer_copy::PARAM,
        HeartbeatConfig::KEYS[0],
        HeartbeatConfig::KEYS[1],
    ];
    if let Some(key) = params.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(Error::InvalidParam(format!(
            "{NAME} has no parameter `{key}` (known: {})",
            KNOWN.join(", ")
        )));
    }
    // Unset: chosen for the provider once it is known (`default_rails`).
    let num_rails: Option<usize> = match params.get("num_rails") {
        Some(_) => Some(param(params, "num_rails", 1)?),
        None => None,
    };
    if num_rails.is_some_and(|n| !(1..=16).contains(&n)) {
        return Err(Error::InvalidParam(format!(
            "{NAME}: num_rails must be 1..=16"
        )));
    }
    // Unset: chosen for the provider once it is known.
    let striping_threshold: Option<usize> = match params.get("striping_threshold") {
        Some(_) => Some(param(params, "striping_threshold", 1usize)?.max(1)),
        None => None,
    };
    let busy_poll = flag(params, "busy_poll")?;
    let cma_write = params.get("cma_write").is_none() || flag(params, "cma_write")?;
    let cma_read = params.get("cma_read").is_none() || flag(params, "cma_read")?;
    let cma_inline: usize = param(params, "cma_inline", DEFAULT_CMA_INLINE)?;
    let cma_threads: usize = param(params, "cma_threads", default_cma_threads())?;
    let stage_dram = flag(params, "stage_dram")?;
    let loaded_senders_only = match params.get("notif_senders").map(String::as_str) {
        None | Some("any") => false,
        Some("loaded") => true,
        Some(v) => {
            return Err(Error::InvalidParam(format!(
                "{NAME} parameter notif_senders=`{v}`: any or loaded"
            )))
        }
    };
    let vram_mode = match params.get("vram_mode").map(String::as_str) {
        None | Some("auto") => VramMode::Auto,
        Some("staged") => VramMode::Staged,
        Some("direct") => VramMode::Direct,
        Some(v) => {
            return Err(Error::InvalidParam(format!(
                "{NAME} parameter vram_mode=`{v}`: auto, staged or direct"
            )))
        }
    };
    // `vram_mode=staged` must stage: no direct copies either.
    let peer_copy_wanted = match params.get(peer_copy::PARAM).map(String::as_str) {
        None | Some("auto") => vram_mode != VramMode::Staged,
        Some("off") => false,
        Some(v) => {
            return Err(Error::InvalidParam(format!(
                "{NAME} parameter {}=`{v}`: auto or off",
                peer_copy::PARAM
            )))
        }
    };
    let chunk: usize = param(params, "staging_chunk", staging::DEFAULT_CHUNK)?;
    if !(4096..=(1 << 30)).contains(&chunk) || !chunk.is_multiple_of(4096) {
        return Err(Error::InvalidParam(format!(
            "{NAME}: staging_chunk must be a multiple of 4096 in 4 KiB..=1 GiB, not {chunk}"
        )));
    }
    let chunks: usize = param(params, "staging_chunks", staging::DEFAULT_CHUNKS)?;
    if !(2..=1024).contains(&chunks) {
        return Err(Error::InvalidParam(format!(
            "{NAME}: staging_chunks must be 2..=1024, not {chunks}"
        )));
    }
    let heartbeat = HeartbeatConfig::parse(NAME, params)?;
    let (info, direct_refusal) = choose_info(params, vram_mode)?;
    let provider = info.provider_name().to_string();
    let hmem = info.caps().contains(Caps::HMEM);
    // VRAM registers (directly or staged) with GPU support; a peer's VRAM is reachable
    // even without it (the peer stages, or registered it directly).
    let mem_kinds = if cfg!(feature = "cuda") {
        vec![MemKind::Dram, MemKind::Vram]
    } else {
        vec![MemKind::Dram]
    };
    let num_rails = num_rails.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        default_rails(&provider, cores)
    });
    let striping_threshold = striping_threshold.unwrap_or(if provider == "shm" {
        DEFAULT_SHM_STRIPING_THRESHOLD
    } else {
        DEFAULT_STRIPING_THRESHOLD
    });
    let cma_write = cma_write && provider == "shm";
    let cma_read = cma_read && provider == "shm";
    // A target serves assists from its rail workers' threads: without them it would
    // answer only when its owner polls.
    let serves_assists = cma_read && init.progress_thread;
    let stripe_min_piece = if provider == "shm" {
        SHM_MIN_STRIPE_PIECE
    } else {
        0
    };
    let mut rails = Vec::with_capacity(num_rails);
    for _ in 0..num_rails {
        rails.push(Arc::new(open_rail(&info)?));
    }
    let notifs = Arc::new(NotifTracker::bounded(MAX_PENDING_NOTIFS));
    let sources = Arc::new(Sources::default());
    let stager = Arc::new(Stager::new(
        &rails,
        notifs.clone(),
        (sources.clone(), loaded_senders_only),
        staging::Config { chunk, chunks },
    )?);
    // Assists are served only to the loaded peer that the transport names as the sender.
    let serves_assists = serves_assists && rails.iter().all(|r| r.names_senders);
    // Direct VRAM copies: with a GPU here; served (as assists) from the rail workers'
    // threads, to the peer the transport names.
    let peer_copy = peer_copy::Shared::new(
        peer_copy_wanted && peer_copy::gpu_present(),
        init.progress_thread && rails.iter().all(|r| r.names_senders),
    );
    let common = Arc::new(Common {
        notifs,
        sources,
        loaded_senders_only,
        agent_name: init.agent_name.clone(),
        refused_notifs: AtomicU64::new(0),
        unproven_notifs: AtomicU64::new(0),
        unproven_controls: AtomicU64::new(0),
        malformed: AtomicU64::new(0),
        channels: notif_mac::Channels::new(Arc::new(Identity::generate()?), &init.agent_name),
        stager,
        peers: RwLock::default(),
        stop: AtomicBool::new(false),
        busy_poll,
        pushed_bytes: AtomicU64::new(0),
        pulled_bytes: AtomicU64::new(0),
        assisted_bytes: AtomicU64::new(0),
        assist: serves_assists.then(Default::default),
        peer_copy,
    });
    let notif_identity = common.channels.identity().clone();
    let backend = LibfabricBackend {
        agent_name: init.agent_name.clone(),
        rails,
        common,
        progress: Arc::new(Progress {
            workers: Vec::new(),
            inline: false,
        }),
        threads: Mutex::new(Vec::new()),
        striping_threshold,
        stripe_min_piece,
        cma_write,
        cma_read,
        cma_inline,
        cma_threads,
        inline_bytes: Arc::default(),
        keys: Arc::default(),
        next_rail: AtomicUsize::new(0),
        mem_kinds,
        remote_kinds: vec![MemKind::Dram, MemKind::Vram],
        provider,
        hmem,
        direct_refusal,
        vram_mode,
        stage_dram,
        staged_logged: AtomicBool::new(false),
        hub: start_hub(
            heartbeat,
            &init.agent_name,
            params.get("node").map(String::as_str),
            init.listen_addr.map(|a| a.ip()),
        )?,
        notif_identity,
    };
    let mut workers = Vec::with_capacity(backend.rails.len());
    for (index, rail) in backend.rails.iter().enumerate() {
        workers.push(Mutex::new(Worker::new(
            index,
            rail.clone(),
            backend.rails.clone(),
            backend.common.clone(),
        )?));
    }
    // Without a progress thread the caller's polls (status, get_notifs) drive the rails.
    let inline = !init.progress_thread;
    let mut backend = backend;
    backend.progress = Arc::new(Progress { workers, inline });
    if !inline {
        let mut threads = Vec::with_capacity(backend.rails.len());
        for index in 0..backend.rails.len() {
            let progress = backend.progress.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("nixl-fabric-rail{index}"))
                    .spawn(move || run_worker(&progress, index))?,
            );
        }
        *backend.threads.lock() = threads;
    }
    tracing::debug!(
        provider = %backend.provider,
        rails = num_rails,
        hmem,
        "LIBFABRIC backend up"
    );
    Ok(backend)
}

/// Rails when `num_rails` is not given. Where a CPU moves the data, one rail copies a
/// large block on one thread on each side, at one core's copy rate, which falls as the
/// block outgrows the caches; blocks striped over several rails are copied by as many
/// threads. So `tcp`, `sockets` and `udp` get one rail per two cores, at most eight
/// (eight rails beat four at every block size on a 16-core host). `shm` gets one per
/// four cores, at most four (more rails, more bandwidth), because of its price:
/// libfabric 1.17's `shm` corrupts its queues when a peer dies mid-transfer, and every
/// rail is one more endpoint exposed to that (`dead_peer_over_shm` failed more often
/// with four rails than with one; a spinning worker no longer hangs the backend's drop).
/// Figures: `docs/BENCHMARKS.md`, "nixl: LIBFABRIC rails".
/// Where peers die mid-transfer, `num_rails=1` (`local_rails=1` for the shm plane beside
/// a network provider) trades the bandwidth back. NIC providers (the NIC moves the
/// data) get one.
fn default_rails(provider: &str, cores: usize) -> usize {
    match provider.split(';').next() {
        Some("tcp" | "sockets" | "udp") => (cores / 2).clamp(1, 8),
        Some("shm") => (cores / 4).clamp(1, 4),
        _ => 1,
    }
}

fn flag(params: &BackendParams, key: &str) -> Result<bool> {
    match params.get(key).map(String::as_str) {
        None | Some("0" | "false" | "no") => Ok(false),
        Some("1" | "true" | "yes") => Ok(true),
        Some(v) => Err(Error::InvalidParam(format!(
            "{NAME} parameter {key}=`{v}`: 0 or 1"
        ))),
    }
}

/// A name for this process's `shm` endpoints that no other process on the host has:
/// `nixl-<pid namespace>-<pid>-<random>`. libfabric 1.17's `shm` names them after the
/// pid by default and creates their shared regions under that name in `/dev/shm`: two
/// processes of the same pid in different pid namespaces that share `/dev/shm`
/// (containers, `unshare --pid`) opened one region, and one of them crashed reading the
/// other's pointers in it (SIGSEGV while enabling the endpoint, seen in the
/// network-namespace tests, whose peers are all pid 1). The first call also removes the
/// regions such names left behind (see [`remove_stale_shm_regions`]).
fn unique_shm_name() -> String {
    use std::hash::{BuildHasher, Hasher};
    // (pid namespace, random): a forked child inherits both; its pid tells it apart.
    static ONCE: OnceLock<(u64, u64)> = OnceLock::new();
    let (ns, nonce) = *ONCE.get_or_init(|| {
        // 0 where unreadable: nothing is removed then.
        let ns = super::shared::pid_namespace("self").unwrap_or(0);
        remove_stale_shm_regions(Path::new("/dev/shm"), ns);
        // RandomState's keys are random per process.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        (ns, h.finish())
    });
    format!("nixl-{ns}-{}-{nonce:016x}", std::process::id())
}

/// Removes, from `dir`, the `shm` regions of processes of pid namespace `ns` that have
/// ended (emptied first, see [`shm_orphans`]): a process killed without closing its
/// endpoints leaves them (16 MiB each), and unique names are never reused by a later
/// process the way pids were. Only names of
/// this pid namespace (where `kill(pid, 0)` answers for the pid) and of dead pids go;
/// nothing happens where the namespace is unknown.
fn remove_stale_shm_regions(dir: &Path, ns: u64) {
    if ns == 0 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!("nixl-{ns}-");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: signal 0 only asks whether the process exists.
        let gone = pid > 0
            && unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        // Emptied first: processes that had the dead one as a peer keep their mappings
        // of the file (libfabric's shm never unmaps a departed peer), which would keep
        // its memory alive after the name is gone.
        if gone {
            shm_orphans::empty_file(&entry.path());
        }
        if gone && std::fs::remove_file(entry.path()).is_ok() {
            tracing::debug!(region = ?name, "removed the shm region of an ended process");
        }
    }
}

/// The provider's info (the first of the priority list that answers); with `want_hmem`,
/// that provider's `FI_HMEM` variant where it has one.
fn discover(params: &BackendParams, want_hmem: bool) -> Result<Info> {
    let named = params.get("provider").map(String::as_str);
    let candidates: Vec<&str> = match named {
        Some(p) => vec![p],
        None => PROVIDER_PRIORITY.to_vec(),
    };
    let mut last_error = None;
    for provider in candidates {
        let hints = |caps: Caps| {
            let mut hints = InfoBuilder::new()
                .provider(provider)
                .ep_type(EndpointType::RDM)
                .caps(caps);
            let node = params.get("node").cloned().or_else(|| {
                if provider.starts_with("tcp") || provider == "sockets" {
                    Some("127.0.0.1".into())
                } else if provider == local_rails::LOCAL_PROVIDER {
                    Some(unique_shm_name())
                } else {
                    None
                }
            });
            if let Some(node) = &node {
                hints = hints.node(node).source(true);
            }
            hints
        };
        // `FI_SOURCE`: completions name their senders (module `sources`); a provider
        // without it still works, and then no message is attributed to a peer.
        let base = Caps::MSG | Caps::RMA;
        if want_hmem {
            for caps in [base | Caps::HMEM | Caps::SOURCE, base | Caps::HMEM] {
                if let Ok(info) = hints(caps).get_first() {
                    return Ok(info);
                }
            }
        }
        match hints(base | Caps::SOURCE)
            .get_first()
            .or_else(|_| hints(base).get_first())
        {
            Ok(info) => return Ok(info),
            Err(e) => last_error = Some((provider, e)),
        }
    }
    let (provider, e) = last_error.expect("at least one candidate");
    Err(match e {
        fabric::Error::Unsupported { .. } => Error::Backend {
            backend: NAME.into(),
            code: e.errno().unwrap_or(0),
            message: format!("no usable provider (last tried `{provider}`: {e})"),
        },
        other => Error::Backend {
            backend: NAME.into(),
            code: other.errno().unwrap_or(0),
            message: format!("provider `{provider}`: {other}"),
        },
    })
}

fn open_rail(info: &Info) -> Result<Rail> {
    let fabric = Fabric::new(info).map_err(fabric_error)?;
    // The rail worker reads the queue all the time: no extra progress thread needed.
    let domain = Domain::with_progress_interval(&fabric, info, None).map_err(fabric_error)?;
    // A wait fd lets incoming traffic wake an idle worker; without one it naps.
    let names_senders = info.caps().contains(Caps::SOURCE);
    let cq_with = |wait: Option<WaitObj>| {
        let builder = CompletionQueue::builder()
            .format(CqFormat::Data)
            .size(4096)
            .source(names_senders);
        match wait {
            Some(wait) => builder.wait_obj(wait),
            None => builder,
        }
        .open(&domain)
    };
    let cq = cq_with(Some(WaitObj::Fd))
        .or_else(|_| cq_with(Some(WaitObj::Unspec)))
        .or_else(|_| cq_with(None))
        .map_err(fabric_error)?;
    let av = AddressVector::new(&domain, AvType::Map, 64).map_err(fabric_error)?;
    let build = |counter: Option<&Counter>| {
        let builder = EndpointBuilder::new(&domain, info).cq(&cq).av(&av);
        match counter {
            Some(c) => builder.counter(c, Access::REMOTE_WRITE | Access::REMOTE_READ),
            None => builder,
        }
        .build()
    };
    // Without a wait fd, a counter of remote operations tells a napping worker that
    // traffic flows (see `idle`); it is only a hint, so a refusal leaves it out.
    let remote_ops = if cq.wait_fd().is_err() && info.caps().contains(Caps::RMA_EVENT) {
        Counter::new(&domain).ok()
    } else {
        None
    };
    let (ep, remote_ops) = match remote_ops.as_ref().map(|c| build(Some(c))) {
        Some(Ok(ep)) => (ep, remote_ops),
        _ => (build(None).map_err(fabric_error)?, None),
    };
    let idle = IdleWait::new(&cq, remote_ops)?;
    let shm = info.provider_name() == local_rails::LOCAL_PROVIDER;
    // libfabric 1.17's shm reports a sender it was never given as handle 0 (its peer
    // map's default): this rail's own endpoint takes handle 0 first (module `sources`).
    let unattributable = if shm && names_senders {
        let own = av
            .insert(&ep.name().map_err(fabric_error)?)
            .map_err(fabric_error)?;
        if own != Address(0) {
            return Err(Error::Backend {
                backend: NAME.into(),
                code: 0,
                message: format!(
                    "shm rail: its own endpoint took handle {own:?} of a fresh address \
                     vector, not 0: senders could not be told apart"
                ),
            });
        }
        Some(own)
    } else {
        None
    };
    let orphans = shm
        .then(|| ep.name().map(shm_orphans::Repairs::new))
        .transpose()
        .map_err(fabric_error)?;
    tracing::debug!(
        provider = info.provider_name(),
        wait_fd = idle.has_wait_fd(),
        remote_op_counter = idle.counts_remote_ops(),
        "rail opened"
    );
    Ok(Rail {
        idle,
        inject_size: info.inject_size(),
        max_msg: info.max_msg_size().max(4096),
        keeps_departed: shm,
        names_senders,
        names_data_senders: names_senders
            && matches!(
                info.provider_name(),
                local_rails::LOCAL_PROVIDER | "sockets"
            ),
        unattributable,
        orphans,
        round_since: AtomicU64::new(0),
        rounds: AtomicU64::new(0),
        can_wedge: shm,

        _fabric: fabric,
        domain,
        ep,
        av,
        cq,
        submit: Mutex::new(VecDeque::new()),
    })
}

/// Registrations, one per rail (none for a staged region).
#[derive(Debug)]
struct FabricLocalMd {
    /// Where this backend serves READ assists from the region (see [`assist`]); dropped
    /// before the registrations, so that no push reads a range the provider let go.
    _served: Option<assist::Served>,
    mrs: Vec<MemoryRegion>,
    mode: RegMode,
    /// A staged region: its entry in the staging engine (removed on drop), the slot size
    /// peers chunk for, and the GPU its copies run on.
    staged: Option<StagedReg>,
    /// Its part in direct copies with same-host peers (see [`peer_copy`]).
    peer: peer_copy::LocalPart,
}

#[derive(Debug)]
struct StagedReg {
    stager: Arc<Stager>,
    id: u64,
    slot: u32,
    dev: Option<usize>,
}

impl Drop for StagedReg {
    fn drop(&mut self) {
        self.stager.engine().remove_region(self.id);
    }
}

/// First byte of a staged region's public metadata (a key list starts with its rail
/// count, 1..=16).
const STAGED_MD: u8 = 0;
const STAGED_MD_VERSION: u8 = 1;

impl LocalMd for FabricLocalMd {
    /// A key list (`rails:u8`, then address, key and length per rail) for memory the
    /// provider registered (DRAM, or VRAM registered directly), or for a staged region
    /// `0 | version 1 | slot size u32`: peers send it through the staging protocol.
    ///
    /// VRAM with a CUDA-IPC handle is followed by its export section (see
    /// [`peer_copy::VramExport`]): same-host peers copy to and from it directly.
    fn public_md(&self) -> Vec<u8> {
        let mut out = if let Some(staged) = &self.staged {
            let mut out = vec![STAGED_MD, STAGED_MD_VERSION];
            out.extend_from_slice(&staged.slot.to_le_bytes());
            out
        } else {
            let mut out = Vec::with_capacity(1 + self.mrs.len() * RemoteMemory::WIRE_SIZE);
            out.push(self.mrs.len() as u8);
            for mr in &self.mrs {
                out.extend_from_slice(&mr.remote().to_bytes());
            }
            out
        };
        if let Some(export) = &self.peer.export {
            export.encode(&mut out);
        }
        out
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn mode(&self) -> Option<&'static str> {
        match self.mode {
            RegMode::Plain => None,
            RegMode::Direct => Some("direct"),
            RegMode::Staged => Some("staged"),
        }
    }
}

/// A peer region's address and key on each of its rails, or (staged) the size of the
/// peer's slots; for VRAM, its CUDA-IPC export where it has one.
#[derive(Debug)]
struct FabricRemoteMd {
    remotes: Vec<RemoteMemory>,
    staged_slot: Option<u64>,
    vram_export: Option<peer_copy::VramExport>,
}

/// The VRAM export a peer region's metadata carries (see [`peer_copy`]).
fn remote_export(md: &dyn RemoteMd) -> Option<peer_copy::VramExport> {
    md.as_any()
        .downcast_ref::<FabricRemoteMd>()
        .and_then(|m| m.vram_export)
}

impl RemoteMd for FabricRemoteMd {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Backend for LibfabricBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: true,
            notif: true,
        }
    }

    fn supported_mem(&self) -> &[MemKind] {
        &self.mem_kinds
    }

    fn supported_remote_mem(&self) -> &[MemKind] {
        &self.remote_kinds
    }

    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        match region.kind {
            MemKind::Dram if self.stage_dram => self.register_staged(region, None),
            MemKind::Dram => {
                let mrs = self.register_rails(region, HmemIface::System)?;
                let served = self.common.assist.as_ref().map(|server| {
                    let rails: Vec<(u64, u64)> = mrs
                        .iter()
                        .map(|mr| (mr.remote().key, mr.remote().address_at(0)))
                        .collect();
                    server.add(&rails, region.desc.addr, region.desc.len)
                });
                Ok(Arc::new(FabricLocalMd {
                    _served: served,
                    mrs,
                    mode: RegMode::Plain,
                    staged: None,
                    peer: self.peer_part(region),
                }))
            }
            MemKind::Vram if self.mem_kinds.contains(&MemKind::Vram) => {
                let dev = i32::try_from(region.desc.dev_id).map_err(|_| {
                    Error::InvalidParam(format!("CUDA device {} out of range", region.desc.dev_id))
                })?;
                self.register_vram(region, dev)
            }
            kind => Err(Error::UnsupportedMemKind {
                backend: NAME.into(),
                kind,
            }),
        }
    }

    fn connection_info(&self) -> Result<Vec<u8>> {
        let names = self
            .rails
            .iter()
            .map(|rail| rail.ep.name().map_err(fabric_error))
            .collect::<Result<Vec<_>>>()?;
        let mut serves = 0;
        if self.common.assist.is_some() {
            serves |= assist::SERVES_ASSISTS;
        }
        if self.serves_peer_copies() {
            serves |= assist::SERVES_PEER_COPIES;
        }
        Ok(encode_conn_info(
            &names,
            self.hub.as_ref(),
            serves,
            &self.notif_identity.public(),
        ))
    }

    fn load_remote_conn_info(&self, agent: &str, info: &[u8]) -> Result<()> {
        let parsed = parse_conn_info(info)?;
        let names = &parsed.names;
        let Some(notif_key) = parsed.notif_key else {
            return Err(Error::MetadataRefused {
                agent: agent.to_string(),
                reason: format!(
                    "its {NAME} connection information has no notification key: the peer \
                     runs a version of this library from before sealed notifications \
                     (upgrade it; its notifications could not be verified)"
                ),
            });
        };
        let (sealer, opener) = self
            .notif_identity
            .pair(&self.agent_name, agent, &notif_key)?;
        if let Some(old) = self.common.peers.read().get(agent) {
            // The same peer, unless its heartbeats stopped: then watch it afresh.
            if old.conn_info == info && !old.watch.as_ref().is_some_and(|w| w.is_dead()) {
                return Ok(());
            }
        }
        let mut addrs = Vec::with_capacity(self.rails.len());
        let mut inserted = Vec::with_capacity(self.rails.len());
        for (i, rail) in self.rails.iter().enumerate() {
            let name = &names[i % names.len()];
            addrs.push(rail.av.insert(name).map_err(fabric_error)?);
            inserted.push(name.clone());
        }
        let liveness = parsed.process.as_ref().and_then(Liveness::watch);
        // The same incarnation loaded again keeps its sealer: its sequence goes on.
        let sealer = self
            .common
            .peers
            .read()
            .get(agent)
            .filter(|p| p.addrs.notif_key == notif_key)
            .map_or_else(|| Arc::new(sealer), |p| p.addrs.sealer.clone());
        // The same incarnation loaded again keeps the lane it offered.
        let lane = OnceLock::new();
        if let Some(kept) = self
            .common
            .peers
            .read()
            .get(agent)
            .filter(|p| p.addrs.notif_key == notif_key)
            .and_then(|p| p.addrs.lane.get().cloned())
        {
            let _ = lane.set(kept);
        }
        let addrs = Arc::new(PeerAddrs {
            rails: self.rails.clone(),
            addrs,
            names: inserted,
            process: liveness.clone(),
            sealer,
            notif_key,
            lane,
        });
        let is_self = agent == self.agent_name;
        let cma = parsed
            .process
            .as_ref()
            .filter(|_| self.cma_write || self.cma_read)
            .and_then(|p| p.local_pid())
            .map(|pid| {
                // This agent never asks itself (its requests would come from no one).
                let assists = self.cma_read && parsed.assists && !is_self;
                Arc::new(CmaPeer::new(pid).with_assists(assists))
            });
        // Another process: CUDA IPC does not import a process's own allocations (two
        // agents of one process keep the ordinary path).
        let same_host = parsed
            .process
            .as_ref()
            .and_then(|p| p.local_pid())
            .is_some_and(|pid| pid != std::process::id());
        let source = self.peer_source(agent, info, parsed.process, cma.clone());
        source.set_opener(opener);
        source.set_sealer(addrs.sealer.clone());
        let endpoints = self.source_endpoints(names, &addrs)?;
        // Built before the peer table is locked: the heartbeat handshake waits for the
        // peer's hub (up to its connect bound), and transfers read the table.
        let peer = Peer {
            conn_info: info.to_vec(),
            source: source.clone(),
            addrs,
            liveness,
            watch: watch_peer(self.hub.as_ref(), agent, &parsed),
            cma,
            same_host,
            serves_peer_copies: same_host && parsed.peer_copies,
        };
        // The old addresses go when nothing uses them any more.
        let old = self.common.peers.write().insert(agent.to_string(), peer);
        self.bind_source(&source, endpoints);
        if let Some(old) = old {
            self.common.stager.peer_gone(
                &old.addrs,
                &format!("`{agent}` reconnected (new connection information)"),
            );
        }
        Ok(())
    }

    fn load_remote_md(
        &self,
        agent: &str,
        region: &Region,
        public_md: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        let md = parse_remote_md(public_md)?;
        // What the peer advertised, against which its READ assists and direct copy
        // requests are checked.
        self.advertise(agent, region, remote_export(&*md).as_ref());
        Ok(md)
    }

    fn peer_gone(&self, agent: &str) -> bool {
        self.common.peers.read().get(agent).is_some_and(|p| {
            p.watch.as_ref().is_some_and(|w| w.is_dead())
                || p.liveness.as_ref().is_some_and(|l| l.check(agent).is_err())
        })
    }

    fn disconnect(&self, agent: &str) {
        // The addresses go when no prepared transfer or queued job uses them any more.
        let removed = self.common.peers.write().remove(agent);
        self.unbind_source(agent);
        if let Some(old) = removed {
            self.common
                .stager
                .peer_gone(&old.addrs, &format!("`{agent}` was disconnected"));
        }
    }

    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        let peer = self
            .common
            .peers
            .read()
            .get(agent)
            .cloned()
            .ok_or_else(|| Error::UnknownAgent(agent.to_string()))?;
        let fabric = self.prep_fabric(op, entries, agent, &peer)?;
        // One copy between VRAM and a same-host peer's DRAM where it fits, with the
        // ordinary transfer beside it for a peer that declines (see `peer_copy`).
        #[cfg(feature = "cuda")]
        if let Some(direct) = self.prep_peer_copy(op, entries, &peer, &fabric)? {
            return Ok(Box::new(peer_xfer::PeerCopyXfer::new(
                direct,
                fabric,
                self.common.clone(),
            )));
        }
        Ok(Box::new(fabric))
    }

    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        let (dest, watch) = self
            .common
            .peers
            .read()
            .get(agent)
            .map(|p| (p.addrs.clone(), p.watch.clone()))
            .ok_or_else(|| Error::UnknownAgent(agent.to_string()))?;
        if let Some(watch) = watch {
            watch.check(agent)?;
        }
        let message = encode_notif(&self.agent_name, self.keys.next(), 0, msg)?;
        if agent == self.agent_name {
            // To itself: nothing to wait for, and its own endpoints are no one's to the
            // transport on every provider (module `sources`).
            self.common.notifs.deliver(agent, msg.to_vec());
            return Ok(());
        }
        send_message_blocking(&self.rails[0], dest, &message, &self.progress)
    }

    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.progress.poll_inline();
        self.common.notifs.take(into);
    }

    fn set_notif_waker(&self, waker: NotifWaker) -> bool {
        self.common.notifs.add_waker(waker);
        // The rail workers release notifications (and wake) as they land; inline
        // progress (no progress thread) sees them only when `take_notifs` polls.
        !self.progress.inline
    }
}

/// A peer region's public metadata (bounded against hostile input).
fn parse_remote_md(public_md: &[u8]) -> Result<Arc<dyn RemoteMd>> {
    let bad = |why: &str| Error::MalformedMetadata(format!("{NAME} region metadata: {why}"));
    // The transport's part has a length its first byte fixes (and the export section's
    // 102 bytes are no multiple of a key's 24): only what is longer carries a section.
    let whole = match public_md.first() {
        Some(&STAGED_MD) => public_md.len() == 6,
        Some(&n) => public_md.len() == 1 + n as usize * RemoteMemory::WIRE_SIZE,
        None => true,
    };
    let (public_md, vram_export) = if whole {
        (public_md, None)
    } else {
        peer_copy::split_md(public_md).map_err(|why| bad(&why))?
    };
    let (&count, rest) = public_md.split_first().ok_or_else(|| bad("empty"))?;
    if count == STAGED_MD {
        let slot = match rest {
            [STAGED_MD_VERSION, a, b, c, d] => u32::from_le_bytes([*a, *b, *c, *d]),
            [STAGED_MD_VERSION, ..] => return Err(bad("wrong length")),
            _ => return Err(bad("unknown staged-region version")),
        };
        if slot < 4096 {
            return Err(bad("staging slot smaller than 4 KiB"));
        }
        return Ok(Arc::new(FabricRemoteMd {
            remotes: Vec::new(),
            staged_slot: Some(u64::from(slot)),
            vram_export,
        }));
    }
    if count == 0 || rest.len() != count as usize * RemoteMemory::WIRE_SIZE {
        return Err(bad("wrong length"));
    }
    let remotes = rest
        .chunks_exact(RemoteMemory::WIRE_SIZE)
        .map(RemoteMemory::from_bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(&e.to_string()))?;
    Ok(Arc::new(FabricRemoteMd {
        remotes,
        staged_slot: None,
        vram_export,
    }))
}

impl LibfabricBackend {
    /// The transfer through the rails (and the staging pipeline, CMA, inline copies),
    /// as it runs when the direct path of [`peer_copy`] does not.
    fn prep_fabric(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
        peer: &Peer,
    ) -> Result<FabricXfer> {
        let peer = peer.clone();
        let nrails = self.rails.len();
        // Sized up front: growing 15,000-entry vectors by doubling costs more than filling them.
        let per_rail = entries.len().div_ceil(nrails) + 1;
        let mut rail_ops: Vec<Vec<RailOp>> =
            (0..nrails).map(|_| Vec::with_capacity(per_rail)).collect();
        let mut round_robin = self.next_rail.fetch_add(entries.len(), Ordering::Relaxed) % nrails;
        let mut mrs: Vec<MemoryRegion> = Vec::new();
        let mut last_md: Option<(*const FabricLocalMd, u32)> = None;
        // Entries with a staged side go through the staging pipeline.
        let mut staged: Vec<usize> = Vec::new();
        // WRITEs: pieces pushed into the peer; READs: pieces the peer pushes on request
        // and pieces this process pulls.
        let cma = peer.cma.as_deref().filter(|cma| match op {
            XferOp::Write => self.cma_write,
            XferOp::Read => cma.assists(),
        });
        let mut cma_ops = 0usize;
        // Small enough to be copied in the posting thread: no operations for the rails.
        let inline = self.inline_copy(op, entries, &peer, agent)?;
        for (index, entry) in entries.iter().enumerate().filter(|_| inline.is_none()) {
            let (local, remote) = entry.metadata::<FabricLocalMd, FabricRemoteMd>(NAME)?;
            if local.staged.is_some() || remote.staged_slot.is_some() {
                staged.push(index);
                continue;
            }
            let len = entry.local.len as usize;
            let remote_offset = entry.remote.addr - entry.remote_region.desc.addr;
            // (rail, offset within the descriptor, length) pieces.
            // Registrations are shared by many descriptors: one table entry per region.
            let mr_base = match last_md {
                Some((ptr, base)) if std::ptr::eq(ptr, local) => base,
                _ => {
                    let base = mrs.len() as u32;
                    mrs.extend(local.mrs.iter().cloned());
                    last_md = Some((local as *const FabricLocalMd, base));
                    base
                }
            };
            // Blocks from the threshold are copied from both ends (`cma`, `assist`). A
            // push goes by the peer's virtual address, with no key to check it: only
            // inside DRAM the peer advertised to this backend.
            let pushable = cma.is_some_and(|cma| {
                len >= PUSH_THRESHOLD
                    && entry.local_region.kind == MemKind::Dram
                    && entry.remote_region.kind == MemKind::Dram
                    && peer.source.advertised(entry.remote.addr, entry.remote.len)
                    && cma.allowed(entry.remote.addr)
            });
            let mut add_piece = |r: usize, start: usize, piece_len: usize, copier: Copier| {
                let max_msg = self.rails[r].max_msg;
                // Local rail r talks to the peer's rail r (mod its rail count).
                let remote_rail = if r < remote.remotes.len() {
                    r
                } else {
                    r % remote.remotes.len()
                };
                let remote_mem = remote.remotes[remote_rail];
                let mut done = 0;
                while done < piece_len {
                    let n = (piece_len - done).min(max_msg);
                    let at = (start + done) as u64;
                    rail_ops[r].push(RailOp {
                        local: entry.local.addr + at,
                        len: n,
                        mr: mr_base + r as u32,
                        dest: peer.addrs.addrs[r],
                        // This process copies at the peer's own virtual address; the
                        // provider, and a peer asked to push (which checks the range
                        // against its registration), go by the provider's addressing.
                        remote_addr: if copier == Copier::ThisProcess {
                            entry.remote.addr + at
                        } else {
                            remote_mem.address_at(remote_offset + at)
                        },
                        key: remote_mem.key,
                        copier,
                    });
                    cma_ops += usize::from(copier != Copier::Provider);
                    done += n;
                }
            };
            // A block copied from both ends goes in pairs of pieces, each pair on one rail:
            // a WRITE's provider piece (the peer pulls it) then the piece this process
            // pushes; a READ's piece the peer is asked to push (the request goes first)
            // then the piece this process pulls — itself, not through the provider, whose
            // `fi_read` holds the lock of the peer's region of that rail for the whole
            // copy, and the peer's progress needs that lock to receive the request (a pair
            // on one rail then copied one piece after the other). Each pair pins the two
            // processes' page tables (see `cma`), and pairs over several rails keep every
            // worker of both sides copying — also for a batch of blocks, whose pairs take
            // the rails in turn (GPU machine, four rails, medians of six alternating
            // rounds against one piece per rail: 8 MiB WRITE 56 GB/s vs 28, READ 58 vs 28;
            // four 2 MiB blocks WRITE 60 vs 21, READ 61 vs 29; 1-4 MiB blocks alike,
            // within the ±15% that separates identical builds there).
            let per_rail = if pushable { 2 } else { 1 };
            let pieces = if pushable {
                2 * stripe_pieces(
                    len,
                    nrails,
                    self.striping_threshold.min(PUSH_THRESHOLD),
                    2 * self.stripe_min_piece,
                )
            } else {
                stripe_pieces(len, nrails, self.striping_threshold, self.stripe_min_piece)
            };
            let groups = pieces / per_rail;
            let chunk = len.div_ceil(pieces).next_multiple_of(4096);
            let mut r = 0;
            for i in 0..pieces {
                // One group per rail when there are as many; else on the next rails in
                // turn, so that blocks of several descriptors (or requests) spread over
                // all of them.
                if i % per_rail == 0 {
                    r = if groups == nrails {
                        i / per_rail
                    } else {
                        round_robin = if round_robin + 1 >= nrails {
                            0
                        } else {
                            round_robin + 1
                        };
                        round_robin
                    };
                }
                let copier = match (pushable, op, i % 2) {
                    (false, _, _) | (true, XferOp::Write, 0) => Copier::Provider,
                    (true, XferOp::Read, 0) => Copier::Peer,
                    (true, _, _) => Copier::ThisProcess,
                };
                let start = i * chunk;
                if start < len {
                    add_piece(r, start, chunk.min(len - start), copier);
                }
            }
        }
        let total: usize = rail_ops.iter().map(Vec::len).sum();
        let staged = if staged.is_empty() {
            None
        } else {
            Some(Arc::new(self.plan_staged(op, entries, &staged, &peer)?))
        };
        Ok(FabricXfer {
            staged,
            stager: self.common.stager.clone(),
            op,
            // `Arc::new` keeps each vector's allocation (`Arc<[_]>` would copy it).
            rail_ops: rail_ops.into_iter().map(Arc::new).collect(),
            mrs: Arc::from(mrs),
            rails: self.rails.clone(),
            agent: agent.to_string(),
            notif_dest: peer.addrs.addrs[0],
            peer: peer.addrs.clone(),
            error_held: None,
            death_seen: None,
            self_name: self.agent_name.clone(),
            keys: self.keys.clone(),
            loopback: agent == self.agent_name,
            notifs: self.common.notifs.clone(),
            total,
            cma_ops,
            shared: Arc::new(XferShared {
                peer: PeerHealth {
                    agent: agent.to_string(),
                    liveness: peer.liveness.clone(),
                    watch: peer.watch.clone(),
                    cma: peer.cma.clone(),
                },
                ..XferShared::default()
            }),
            progress: self.progress.clone(),
            inline,
        })
    }

    /// The provider in use.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Bytes of WRITEs this backend's rail workers copied into peers on this host
    /// themselves (`process_vm_writev`) while the peers pulled the rest through `shm`
    /// (parameter `cma_write`).
    pub fn pushed_bytes(&self) -> u64 {
        self.common.pushed_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of READs this process copied from peers on this host itself, beside what
    /// they pushed (parameter `cma_read`).
    pub fn pulled_bytes(&self) -> u64 {
        self.common.pulled_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of READs that peers on this host pushed into this process on request
    /// (parameter `cma_read`).
    pub fn assisted_bytes(&self) -> u64 {
        self.common.assisted_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of small transfers to and from peers on this host that the posting thread
    /// copied itself (parameter `cma_inline`).
    pub fn inline_bytes(&self) -> u64 {
        self.inline_bytes.load(Ordering::Relaxed)
    }

    /// Notification messages and data arrivals dropped: naming a loaded peer without
    /// its proof (see [`LibfabricBackend::unproven_notifications`]), from an endpoint of
    /// no loaded peer that named a loaded one (or any, with `notif_senders=loaded`), from
    /// one peer's endpoint naming another, or beyond a sender's [`MAX_PENDING_NOTIFS`].
    pub fn refused_notifications(&self) -> u64 {
        self.common.refused_notifs.load(Ordering::Relaxed) + self.common.notifs.refused()
    }

    /// Notification messages dropped because they named a loaded peer without that
    /// peer's seal (a MAC under the pair's key, module `notif_mac`): forged, replayed, or
    /// unsealed. Counted in [`LibfabricBackend::refused_notifications`] too.
    pub fn unproven_notifications(&self) -> u64 {
        self.common.unproven_notifs.load(Ordering::Relaxed)
    }

    /// Rail control messages (staging OFFER / FETCH / DONE, READ assist requests and
    /// answers, direct copy requests and answers) dropped for their seal: naming or
    /// coming from a loaded peer without that peer's proof (forged, replayed or
    /// unsealed), or sealed under a key they carry that does not open them (module
    /// `notif_mac`). None of them was acted upon.
    pub fn unproven_control_messages(&self) -> u64 {
        self.common.unproven_controls.load(Ordering::Relaxed)
    }

    /// READ assist requests refused: from an endpoint of no loaded peer, naming another
    /// process than that peer advertised, or writing outside what it advertised (see
    /// the `assist` module's trust model).
    pub fn refused_assists(&self) -> u64 {
        self.common.assist.as_ref().map_or(0, |s| s.refused())
    }

    /// Bytes of this backend's transfers moved by one copy between VRAM and a same-host
    /// peer's DRAM (module `peer_copy`), by this process or by the peer on request.
    pub fn peer_copy_bytes(&self) -> u64 {
        self.common.peer_copy.stats.bytes.load(Ordering::Relaxed)
    }

    /// Bytes this backend copied between its DRAM and same-host peers' VRAM on their
    /// request (module `peer_copy`).
    pub fn peer_copy_served_bytes(&self) -> u64 {
        self.common
            .peer_copy
            .stats
            .served_bytes
            .load(Ordering::Relaxed)
    }

    /// Posts prepared for a direct copy that the peer declined (no GPU there, this
    /// agent's metadata not loaded there, ...) and that ran the ordinary path instead.
    pub fn peer_copy_fallbacks(&self) -> u64 {
        self.common
            .peer_copy
            .stats
            .fallbacks
            .load(Ordering::Relaxed)
    }

    /// Direct copy requests this backend declined or refused (see `peer_copy`).
    pub fn refused_peer_copies(&self) -> u64 {
        self.common.peer_copy.stats.refused.load(Ordering::Relaxed)
    }

    /// How VRAM <-> `agent`'s DRAM (and DRAM <-> its VRAM) moves where it is one direct
    /// copy (module `peer_copy`): `None` where it is not (another host, no GPU here,
    /// `vram_peer_copy=off`).
    pub(super) fn peer_copy_path(&self, agent: &str) -> Option<String> {
        if !self.common.peer_copy.enabled {
            return None;
        }
        let peers = self.common.peers.read();
        let peer = peers.get(agent).filter(|p| p.same_host)?;
        Some(if peer.serves_peer_copies {
            "VRAM <-> the peer's DRAM and DRAM <-> its VRAM: one direct copy through CUDA IPC \
             by the side that owns the DRAM (staged where the peer declines)"
                .into()
        } else {
            "DRAM <-> the peer's VRAM: one direct copy through CUDA IPC; VRAM <-> its DRAM: \
             staged (the peer does not copy on request)"
                .into()
        })
    }

    /// How this backend reaches `agent` (answered to `query_mem_info` with meta
    /// `peer:<agent>`): `provider`; `vram_peer_dram` — `direct` (VRAM <-> its DRAM and
    /// DRAM <-> its VRAM in one copy), `direct_from_dram` (DRAM <-> its VRAM only: the
    /// peer does not copy on request) or `staged`; and this backend's direct-copy
    /// counters over all peers: `peer_copy_bytes`, `peer_copy_served_bytes`,
    /// `peer_copy_fallbacks` (see the `LibfabricBackend` methods of those names) and
    /// `peer_copy_lane_requests` (requests sent through the peer's shared lane).
    pub(super) fn peer_path_info(&self, agent: &str) -> crate::backend::BackendParams {
        let path = {
            let peers = self.common.peers.read();
            match peers.get(agent) {
                Some(p) if self.common.peer_copy.enabled && p.same_host => {
                    if p.serves_peer_copies {
                        "direct"
                    } else {
                        "direct_from_dram"
                    }
                }
                _ => "staged",
            }
        };
        [
            ("provider", self.provider.clone()),
            ("vram_peer_dram", path.to_string()),
            ("peer_copy_bytes", self.peer_copy_bytes().to_string()),
            (
                "peer_copy_served_bytes",
                self.peer_copy_served_bytes().to_string(),
            ),
            (
                "peer_copy_fallbacks",
                self.peer_copy_fallbacks().to_string(),
            ),
            (
                "peer_copy_lane_requests",
                self.common
                    .peer_copy
                    .stats
                    .lane_requests
                    .load(Ordering::Relaxed)
                    .to_string(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        // Where tracing (`NIXL_PEER_COPY_TRACE=1`), the direct requests' summed timings.
        .chain(
            peer_copy::trace::counters()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string())),
        )
        .collect()
    }

    /// Whether this backend copies for same-host peers on request.
    fn serves_peer_copies(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.common.peer_copy.server.is_some();
        #[cfg(not(feature = "cuda"))]
        return false;
    }

    /// A registration's part in direct copies: VRAM's CUDA-IPC export, DRAM's pin and
    /// served entry (nothing where direct copies are off).
    fn peer_part(&self, region: &Region) -> peer_copy::LocalPart {
        #[cfg(feature = "cuda")]
        if self.common.peer_copy.enabled {
            let d = &region.desc;
            return match region.kind {
                MemKind::Vram => peer_copy::LocalPart {
                    export: usize::try_from(d.dev_id)
                        .ok()
                        .and_then(|dev| peer_copy::export_vram(d.addr, d.len, dev)),
                    ..Default::default()
                },
                MemKind::Dram => peer_copy::LocalPart {
                    pin: Some(peer_copy::DramPin::new(d.addr, d.len)),
                    _served: self
                        .common
                        .peer_copy
                        .server
                        .as_ref()
                        .map(|server| server.add(d.addr, d.len)),
                    ..Default::default()
                },
                _ => peer_copy::LocalPart::default(),
            };
        }
        let _ = region;
        peer_copy::LocalPart::default()
    }

    /// Whether the provider was opened with `FI_HMEM` (VRAM may register directly).
    pub fn has_hmem(&self) -> bool {
        self.hmem
    }

    /// Why VRAM registrations will be staged, if they will (decided when the backend
    /// was created: `vram_mode`, a provider without `FI_HMEM`, or its refusal of a
    /// probe registration).
    pub fn direct_vram_refusal(&self) -> Option<&str> {
        self.direct_refusal.as_deref()
    }

    /// The transfer as one the posting thread copies by CMA ([`InlineCopy`]), where it
    /// is that small (`cma_inline`), its peer another process on this host that this
    /// one may copy to and from, and every block DRAM inside what the peer advertised.
    fn inline_copy(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        peer: &Peer,
        agent: &str,
    ) -> Result<Option<InlineCopy>> {
        let allowed_op = match op {
            XferOp::Write => self.cma_write,
            XferOp::Read => self.cma_read,
        };
        let cma = match &peer.cma {
            Some(cma) if allowed_op && agent != self.agent_name => cma,
            _ => return Ok(None),
        };
        let bytes: u64 = entries.iter().map(|e| e.local.len).sum();
        let bulk = self.cma_threads >= 2
            && entries.len() >= CMA_BULK_MIN_BLOCKS
            && bytes >= CMA_BULK_MIN_BYTES
            && bytes / entries.len() as u64 <= CMA_BULK_MAX_MEAN_BYTES;
        if entries.is_empty() || (bytes > self.cma_inline as u64 && !bulk) {
            return Ok(None);
        }
        let mut blocks = Vec::with_capacity(entries.len());
        for entry in entries {
            let (local, remote) = entry.metadata::<FabricLocalMd, FabricRemoteMd>(NAME)?;
            let copyable = local.staged.is_none()
                && remote.staged_slot.is_none()
                && entry.local_region.kind == MemKind::Dram
                && entry.remote_region.kind == MemKind::Dram
                && peer.source.advertised(entry.remote.addr, entry.remote.len);
            if !copyable {
                return Ok(None);
            }
            blocks.push((
                entry.local.addr,
                entry.remote.addr,
                entry.local.len as usize,
            ));
        }
        if !cma.allowed(entries[0].remote.addr) {
            return Ok(None);
        }
        Ok(Some(InlineCopy {
            cma: cma.clone(),
            blocks,
            threads: if bulk { self.cma_threads } else { 1 },
            copied: self.inline_bytes.clone(),
        }))
    }

    /// Registers `region` with every rail's domain.
    fn register_rails(&self, region: &Region, iface: HmemIface) -> Result<Vec<MemoryRegion>> {
        self.try_register_rails(region, iface).map_err(fabric_error)
    }

    fn try_register_rails(
        &self,
        region: &Region,
        iface: HmemIface,
    ) -> std::result::Result<Vec<MemoryRegion>, fabric::Error> {
        let len = usize::try_from(region.desc.len).map_err(|_| fabric::Error::InvalidArgument {
            call: "fi_mr_regattr",
            detail: "region larger than the address space".into(),
        })?;
        let access = Access::READ
            | Access::WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_WRITE
            | Access::SEND
            | Access::RECV;
        let mut mrs = Vec::with_capacity(self.rails.len());
        for rail in &self.rails {
            // SAFETY: `Agent::register_mem`'s contract keeps the memory valid while the
            // registration (this metadata) and every transfer using it exist.
            let mr = unsafe {
                MemoryRegion::reg_raw(
                    &rail.domain,
                    Some(&rail.ep),
                    region.desc.addr as *const u8,
                    len,
                    access,
                    iface,
                )
            }?;
            mrs.push(mr);
        }
        Ok(mrs)
    }
}

impl Drop for LibfabricBackend {
    fn drop(&mut self) {
        self.common.stop.store(true, Ordering::SeqCst);
        for rail in &self.rails {
            rail.idle.wake();
        }
        let threads = std::mem::take(self.threads.get_mut());
        let stuck = super::shared::join_bounded(threads, WORKER_STOP_TIMEOUT);
        if !stuck.is_empty() {
            tracing::warn!(
                "{NAME}: rail workers {stuck:?} did not stop within {WORKER_STOP_TIMEOUT:?} \
                 (stuck in the provider, as libfabric 1.17's shm after a peer died \
                 mid-transfer): left running with what they hold"
            );
        }
    }
}

/// Fuzzing entry point (not a stable API): the decoders of what anyone may send to a
/// rail — notification messages (plain and sealed), READ assist messages and direct
/// VRAM copy messages (plain and in a control seal) — on `input`. Returns whether whatever decoded encodes back to
/// `input` (decoding itself must never panic).
#[doc(hidden)]
pub fn fuzz_rail_message(input: &[u8]) -> bool {
    let peer_copy_ok = match peer_copy::decode(input) {
        Ok(peer_copy::Message::Request(r)) => r.encode() == input,
        Ok(peer_copy::Message::Done(d)) => d.encode() == input,
        Ok(peer_copy::Message::Lane(fd)) => peer_copy::encode_lane(fd) == input,
        Ok(peer_copy::Message::Doorbell) => peer_copy::encode_doorbell() == input,
        Err(_) => true,
    };
    let assist_ok = match assist::decode(input) {
        Ok(assist::Message::Request(r)) => r.encode() == input,
        Ok(assist::Message::Done(d)) => d.encode() == input,
        Err(_) => true,
    };
    let notif_ok = match decode_notif(input) {
        Ok((key, expected, sender, msg)) => {
            encode_notif(&sender, key, expected, &msg).ok().as_deref() == Some(input)
                || input.len() > MAX_NOTIF_BYTES - notif_mac::SEAL_OVERHEAD
        }
        Err(_) => true,
    };
    // A sealed notification splits into a seal and a frame that encode back.
    let sealed_ok = notif_mac::Sealed::split(input).is_none_or(|frame| frame.encode() == input);
    // So does a sealed control message, whose inner message decodes as one sent plain.
    let control_ok = notif_mac::ControlFrame::split(input)
        .is_none_or(|frame| frame.encode() == input && fuzz_rail_message(frame.sealed.inner));
    assist_ok && notif_ok && peer_copy_ok && sealed_ok && control_ok
}

/// How long dropping a backend waits for its rail workers to stop.
const WORKER_STOP_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod cma_tests;
#[cfg(test)]
mod idle_tests;
#[cfg(test)]
mod probe_tests;
#[cfg(test)]
mod security_tests;
#[cfg(test)]
mod staged_tests;

#[cfg(test)]
mod tests;
