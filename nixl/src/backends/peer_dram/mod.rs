//! VRAM ↔ a same-host peer's DRAM in one copy, for every backend that has such a path
//! (LIBFABRIC's `peer_copy`, GPUNETIO's `peer_dram`): the process that owns the host
//! memory drives a copy engine against the other side's VRAM, imported through CUDA IPC.
//!
//! This module is the transport-neutral part; each backend carries the messages on its
//! own channel and attributes them by what its transport says about the sender:
//! - **exports** ([`VramExport`]): the CUDA-IPC handle, offset, allocation size and GPU
//!   of a VRAM region, appended to the region's public metadata;
//! - **requests** ([`Request`], [`Done`], [`decode`]): the initiator's VRAM and the
//!   target's DRAM by their virtual addresses, pieces of at most [`PIECE_BYTES`], at most
//!   [`MAX_PIECES`] per request, answered with an errno ([`is_declined`]: "not this way",
//!   the transfer runs its ordinary path);
//! - **planning** ([`choose`], [`cut`], [`plan_requests`]): which case a transfer is, and
//!   its pieces grouped per allocation;
//! - **waiting** ([`Waits`], [`RunState`]): an initiator's requests by id, answerable only
//!   by the peer they went to;
//! - **serving** (`Server`, with feature `cuda`): the target's checks — the peer's VRAM
//!   must lie in a region *that peer* advertised ([`PeerVram`], from metadata the backend
//!   loaded; the IPC handle comes from there, never from the request), its own DRAM in a
//!   region registered with the backend — then the import (cached per peer incarnation,
//!   [`Imports`]), the pin of its DRAM (once) and the copies on its streams;
//! - **telemetry** ([`Stats`]).
//!
//! A target that never loaded its initiator's metadata declines (`EADDRNOTAVAIL`), and
//! the transfer runs its ordinary path.

// Without feature `cuda` only LIBFABRIC's answers and the decoders run (this side never
// initiates a direct copy): the initiator's half is unused there; GPUNETIO alone uses
// no metadata splitting or rail sizing.
#![cfg_attr(not(all(feature = "cuda", feature = "libfabric")), allow(dead_code))]

pub(crate) mod mailbox;
#[doc(hidden)]
pub use mailbox::fuzz_lane;
pub(crate) mod trace;
pub(crate) mod wire;

use crate::mem::MemKind;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use wire::{put_header, put_name, Reader};

/// First bytes of a peer-copy message (beside notifications, staging, assists).
pub(crate) const MAGIC: &[u8; 4] = b"NXPV";
/// First bytes of the region metadata section that carries a VRAM export.
pub(crate) const MD_TAG: &[u8; 4] = b"NXPC";
const VERSION: u8 = 1;
const KIND_REQUEST: u8 = 1;
const KIND_DONE: u8 = 2;
/// A request that carries the transfer's notification, which the target delivers itself
/// once the copies completed (sent only to a peer that said it understands it).
const KIND_REQUEST_NOTIF: u8 = 3;
/// An answer with the target's timing stamps ([`trace`], only where it traces).
const KIND_DONE_TRACED: u8 = 4;
/// Target to initiator on the same host: a shared lane ([`mailbox`]) for this pair,
/// open in the target's process under the descriptor number the message carries (the
/// initiator takes it with `pidfd_getfd`; LIBFABRIC, which has no socket to pass it on).
const KIND_LANE: u8 = 5;
/// Initiator to target: a request waits in the lane of a target that said it sleeps.
const KIND_DOORBELL: u8 = 6;
/// The metadata section's only kind: a legacy CUDA-IPC handle.
const EXPORT_IPC: u8 = 1;
/// The metadata section: tag, version, kind, handle, offset, allocation size, GPU UUID.
pub(crate) const MD_WIRE_SIZE: usize = 4 + 1 + 1 + 64 + 8 + 8 + 16;
/// Bytes of one request piece: VRAM address, DRAM address, length.
const PIECE_WIRE: usize = 24;
/// Request header: magic, version, kind, id, direction, piece count.
const REQUEST_HEADER: usize = 4 + 1 + 1 + 8 + 1 + 2;
/// Bytes of an answer: magic, version, kind, id, errno.
pub(crate) const DONE_LEN: usize = 4 + 1 + 1 + 8 + 4;
/// Largest notification a request carries (a larger one follows the answer as before).
pub(crate) const MAX_NOTIF_IN_REQUEST: usize = 64 << 10;
/// Most pieces in one request.
pub(crate) const MAX_PIECES: usize = 256;
/// Largest piece: a large descriptor is cut into pieces the target spreads over its
/// streams, so several copies are in flight for one block.
pub(crate) const PIECE_BYTES: u64 = 8 << 20;
/// The longest reply name a request carries (a rail endpoint's, or an agent's).
pub(crate) const MAX_NAME: usize = 1024;
/// Streams per GPU each side copies on.
pub(crate) const STREAMS: usize = 4;
/// A served DRAM registration is pinned in chunks of this size as copies first touch
/// them (a multiple of the largest page size).
pub(crate) const PIN_CHUNK: u64 = 256 << 20;

/// Parameter `vram_peer_copy`.
pub(crate) const PARAM: &str = "vram_peer_copy";

/// How a VRAM region is reached by a same-host peer's copy engine: the CUDA-IPC handle
/// of the allocation holding it, where the region starts in it, the allocation's size
/// and the GPU's UUID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct VramExport {
    pub(crate) handle: [u8; 64],
    pub(crate) offset: u64,
    pub(crate) alloc_len: u64,
    pub(crate) gpu_uuid: [u8; 16],
}

impl VramExport {
    /// `NXPC | version 1 | kind 1 | handle [64] | offset u64 | alloc_len u64 | uuid [16]`
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(MD_TAG);
        out.push(VERSION);
        out.push(EXPORT_IPC);
        out.extend_from_slice(&self.handle);
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.alloc_len.to_le_bytes());
        out.extend_from_slice(&self.gpu_uuid);
    }

    /// Exactly [`MD_WIRE_SIZE`] bytes (bounded against hostile input).
    pub(crate) fn decode(b: &[u8]) -> Result<Self, String> {
        if b.len() != MD_WIRE_SIZE {
            return Err("VRAM export section has the wrong size".into());
        }
        if &b[..4] != MD_TAG {
            return Err("not a VRAM export section".into());
        }
        if b[4] != VERSION {
            return Err(format!("VRAM export section version {}", b[4]));
        }
        if b[5] != EXPORT_IPC {
            return Err(format!("VRAM export kind {}", b[5]));
        }
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let export = VramExport {
            handle: b[6..70].try_into().expect("64 bytes"),
            offset: u64_at(70),
            alloc_len: u64_at(78),
            gpu_uuid: b[86..102].try_into().expect("16 bytes"),
        };
        if export.offset >= export.alloc_len {
            return Err("VRAM export offset outside its allocation".into());
        }
        Ok(export)
    }

    /// Whether a region of `len` bytes at this export's offset fits in the allocation.
    pub(crate) fn holds(&self, len: u64) -> bool {
        self.offset
            .checked_add(len)
            .is_some_and(|end| end <= self.alloc_len)
    }
}

/// Splits a region's public metadata into its transport part and its VRAM export
/// section, if it ends with one.
pub(crate) fn split_md(md: &[u8]) -> Result<(&[u8], Option<VramExport>), String> {
    if md.len() > MD_WIRE_SIZE {
        let (head, tail) = md.split_at(md.len() - MD_WIRE_SIZE);
        if tail.starts_with(MD_TAG) {
            return Ok((head, Some(VramExport::decode(tail)?)));
        }
    }
    Ok((md, None))
}

/// Which way the target copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// The initiator's VRAM into the target's DRAM (a WRITE).
    ToDram,
    /// The target's DRAM into the initiator's VRAM (a READ).
    ToVram,
}

/// One piece of a request: the initiator's VRAM and the target's DRAM, by their
/// virtual addresses in their processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) vram: u64,
    pub(crate) dram: u64,
    pub(crate) len: u64,
}

/// Initiator to target: copy these pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) id: u64,
    pub(crate) direction: Direction,
    pub(crate) pieces: Vec<Piece>,
    /// The initiator's rail endpoint: where a refusal to a stranger goes.
    pub(crate) reply_to: Vec<u8>,
    /// The transfer's notification, for the target to deliver once the copies completed
    /// (never on a declined or failed request).
    pub(crate) notif: Option<Vec<u8>>,
}

/// Target to initiator: the request's pieces are in place (`errno` 0), or why not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Done {
    pub(crate) id: u64,
    pub(crate) errno: i32,
    /// The target's stamps of the request, where it traces ([`trace`]).
    pub(crate) trace: Option<trace::TargetStamps>,
}

/// A decoded peer-copy message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    Request(Request),
    Done(Done),
    /// A shared lane, by its descriptor number in the sender's process.
    Lane(i32),
    Doorbell,
}

/// `NXPV 1 5 fd:u64`: a lane offer ([`Message::Lane`]).
pub(crate) fn encode_lane(fd: i32) -> Vec<u8> {
    let mut out = Vec::with_capacity(DONE_LEN);
    put_header(&mut out, MAGIC, VERSION, KIND_LANE);
    out.extend_from_slice(&(fd as u64).to_le_bytes());
    out
}

/// `NXPV 1 6 0:u64`: a doorbell ([`Message::Doorbell`]).
pub(crate) fn encode_doorbell() -> Vec<u8> {
    let mut out = Vec::with_capacity(DONE_LEN);
    put_header(&mut out, MAGIC, VERSION, KIND_DOORBELL);
    out.extend_from_slice(&0u64.to_le_bytes());
    out
}

/// Bytes a request of `pieces` pieces and a rail name of `name` bytes takes.
pub(crate) fn request_len(pieces: usize, name: usize) -> usize {
    REQUEST_HEADER + pieces * PIECE_WIRE + 2 + name
}

/// Most pieces a request may carry so that it fits in `inject_size` bytes with a rail
/// name of `name` bytes (0: none fits).
pub(crate) fn pieces_per_request(inject_size: usize, name: usize) -> usize {
    inject_size
        .saturating_sub(REQUEST_HEADER + 2 + name)
        .checked_div(PIECE_WIRE)
        .unwrap_or(0)
        .min(MAX_PIECES)
}

impl Request {
    /// `NXPV 1 1 id:u64 direction:u8 count:u16 (vram dram len:u64)* name:str16`, or kind
    /// 3 with `notif_len:u32 notif` after the name.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let notif = self.notif.as_ref().map_or(0, |n| 4 + n.len());
        let mut out =
            Vec::with_capacity(request_len(self.pieces.len(), self.reply_to.len()) + notif);
        self.encode_into(&mut out);
        out
    }

    /// Appends the encoding to `out`.
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        encode_request(
            out,
            self.id,
            self.direction,
            &self.pieces,
            &self.reply_to,
            self.notif.as_deref(),
        );
    }
}

/// Appends a request's encoding to `out` from its parts: a sender reuses one buffer and
/// its planned pieces, so a post costs no allocation per request. `notif` (at most
/// [`MAX_NOTIF_IN_REQUEST`] bytes, for a peer that understands it) rides along.
pub(crate) fn encode_request(
    out: &mut Vec<u8>,
    id: u64,
    direction: Direction,
    pieces: &[Piece],
    reply_to: &[u8],
    notif: Option<&[u8]>,
) {
    let kind = if notif.is_some() {
        KIND_REQUEST_NOTIF
    } else {
        KIND_REQUEST
    };
    put_header(out, MAGIC, VERSION, kind);
    out.extend_from_slice(&id.to_le_bytes());
    out.push(match direction {
        Direction::ToDram => 0,
        Direction::ToVram => 1,
    });
    out.extend_from_slice(&(pieces.len() as u16).to_le_bytes());
    for p in pieces {
        for v in [p.vram, p.dram, p.len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    put_name(out, reply_to);
    if let Some(n) = notif {
        out.extend_from_slice(&(n.len() as u32).to_le_bytes());
        out.extend_from_slice(n);
    }
}

impl Done {
    /// The answer to request `id` that the target did not start (`errno`), with its stamps
    /// (read at `read`, answered now) where it traces.
    pub(crate) fn unstarted(id: u64, errno: i32, read: u64) -> Self {
        Done {
            id,
            errno,
            trace: trace::on().then(|| trace::TargetStamps {
                read,
                answered: trace::now_ns(),
                ..Default::default()
            }),
        }
    }

    /// `NXPV 1 2 id:u64 errno:i32`, or kind 4 with the target's four stamps (`u64`
    /// each) after.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(DONE_LEN + 32);
        self.encode_into(&mut out);
        out
    }

    /// Appends the encoding to `out` (an answering thread reuses one buffer).
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        let kind = if self.trace.is_some() {
            KIND_DONE_TRACED
        } else {
            KIND_DONE
        };
        put_header(out, MAGIC, VERSION, kind);
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.errno.to_le_bytes());
        if let Some(t) = &self.trace {
            for v in [t.read, t.launched, t.complete, t.answered] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// Decodes a peer-copy message (bounded against hostile input: a malformed one is an
/// `Err` to log and drop). Pieces are checked for shape here (non-empty, no wrapping, at
/// most [`PIECE_BYTES`]); where they point is the target's check.
pub(crate) fn decode(bytes: &[u8]) -> Result<Message, String> {
    let (kind, mut r) = Reader::open(bytes, MAGIC, VERSION, "peer-copy")?;
    let id = r.u64()?;
    let message = match kind {
        KIND_REQUEST | KIND_REQUEST_NOTIF => {
            let direction = match r.u8()? {
                0 => Direction::ToDram,
                1 => Direction::ToVram,
                d => return Err(format!("peer-copy direction {d}")),
            };
            let count = usize::from(r.u16()?);
            if count == 0 || count > MAX_PIECES {
                return Err(format!("{count} pieces in a peer-copy request"));
            }
            if r.remaining() < count * PIECE_WIRE {
                return Err("truncated".into());
            }
            let mut pieces = Vec::with_capacity(count);
            for _ in 0..count {
                let (vram, dram, len) = (r.u64()?, r.u64()?, r.u64()?);
                if len == 0
                    || len > PIECE_BYTES
                    || vram.checked_add(len).is_none()
                    || dram.checked_add(len).is_none()
                {
                    return Err("a malformed peer-copy piece".into());
                }
                pieces.push(Piece { vram, dram, len });
            }
            let reply_to = r.name(MAX_NAME)?;
            let notif = if kind == KIND_REQUEST_NOTIF {
                let n = r.u32()? as usize;
                if n > MAX_NOTIF_IN_REQUEST || r.remaining() < n {
                    return Err("a malformed notification in a peer-copy request".into());
                }
                Some(r.bytes(n)?)
            } else {
                None
            };
            Message::Request(Request {
                id,
                direction,
                pieces,
                reply_to,
                notif,
            })
        }
        KIND_DONE | KIND_DONE_TRACED => {
            let errno = r.i32()?;
            let trace = if kind == KIND_DONE_TRACED {
                Some(trace::TargetStamps {
                    read: r.u64()?,
                    launched: r.u64()?,
                    complete: r.u64()?,
                    answered: r.u64()?,
                })
            } else {
                None
            };
            Message::Done(Done { id, errno, trace })
        }
        KIND_LANE => match i32::try_from(id) {
            Ok(fd) if fd >= 0 => Message::Lane(fd),
            _ => return Err(format!("a lane offer naming descriptor {id}")),
        },
        KIND_DOORBELL if id == 0 => Message::Doorbell,
        KIND_DOORBELL => return Err("a doorbell with a word".into()),
        other => return Err(format!("unknown peer-copy message kind {other}")),
    };
    r.finish()?;
    Ok(message)
}

/// Whether an answer means "not this way" (the transfer runs its ordinary path instead)
/// rather than a failed transfer.
pub(crate) fn is_declined(errno: i32) -> bool {
    matches!(
        errno,
        libc::EADDRNOTAVAIL | libc::EOPNOTSUPP | libc::EPERM | libc::ENODEV | libc::ESRCH
    )
}

/// What a failing answer's errno means, for the transfer's error.
pub(crate) fn describe(errno: i32) -> String {
    match errno {
        libc::EACCES => "the peer refused a direct copy: its DRAM range is not inside a region \
                         it registered"
            .into(),
        libc::EINVAL => "the peer refused a malformed direct-copy request".into(),
        e => format!(
            "the peer's direct copy failed: {}",
            std::io::Error::from_raw_os_error(e)
        ),
    }
}

/// Who copies a transfer that takes the direct path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Case {
    /// DRAM here, the peer's VRAM imported: this process copies.
    InitiatorOwned,
    /// VRAM here, DRAM at the peer: the peer copies on request.
    TargetOwned,
}

/// What the choice knows of one descriptor pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PairFacts {
    pub(crate) local: MemKind,
    pub(crate) remote: MemKind,
    /// This side's region is VRAM with an IPC export.
    pub(crate) local_exported: bool,
    /// The peer's region is VRAM whose metadata carries an IPC export that holds it.
    pub(crate) remote_exported: bool,
}

/// Whether (and how) a transfer takes the direct path: `enabled` (parameter and a GPU
/// here), the peer another process on this host, and every pair the same case — DRAM ↔
/// exported peer VRAM, or exported VRAM ↔ peer DRAM with a peer that serves requests.
/// Mixed transfers, other kinds, and an empty transfer keep the ordinary path.
pub(crate) fn choose(
    enabled: bool,
    same_host: bool,
    peer_serves: bool,
    pairs: impl IntoIterator<Item = PairFacts>,
) -> Option<Case> {
    if !enabled || !same_host {
        return None;
    }
    let mut case = None;
    for p in pairs {
        let this = match (p.local, p.remote) {
            (MemKind::Dram, MemKind::Vram) if p.remote_exported => Case::InitiatorOwned,
            (MemKind::Vram, MemKind::Dram) if p.local_exported && peer_serves => Case::TargetOwned,
            _ => return None,
        };
        if case.is_some_and(|c| c != this) {
            return None;
        }
        case = Some(this);
    }
    case
}

/// Where a planned piece lies: the allocation of this side's VRAM (a request never spans
/// two: the target imports one per request) and the registrations holding it on both
/// sides. Pieces merge only within the same ones: the target checks each piece against
/// one region the initiator advertised and one DRAM registration of its own, and a piece
/// spanning two neighbouring registrations would fail that check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PieceHome {
    /// The CUDA-IPC handle of the allocation holding this side's VRAM.
    pub(crate) handle: [u8; 64],
    /// Start of this side's VRAM registration.
    pub(crate) vram_region: u64,
    /// Start of the peer's DRAM registration.
    pub(crate) dram_region: u64,
}

/// Grows `last` by the head of `next` where `next` continues it on both sides (its VRAM
/// and its DRAM start where `last`'s end), up to [`PIECE_BYTES`]; the bytes taken from
/// `next`'s head (0: it does not continue `last`, or `last` is full).
///
/// A batch of neighbouring blocks (upstream nixlbench's layout, a KV cache's consecutive
/// blocks) then moves as a few large copies instead of one copy-engine launch per block,
/// each of which costs microseconds.
pub(crate) fn absorb(last: &mut Piece, next: &Piece) -> u64 {
    let continues = last.vram.checked_add(last.len) == Some(next.vram)
        && last.dram.checked_add(last.len) == Some(next.dram);
    if !continues {
        return 0;
    }
    let taken = next.len.min(PIECE_BYTES.saturating_sub(last.len));
    last.len += taken;
    taken
}

/// The requests of a target-owned transfer: `pieces` (where each lies, and the piece)
/// already cut to at most [`PIECE_BYTES`], neighbours within the same registrations
/// merged ([`absorb`]), grouped into requests of one allocation and at most
/// `per_request` pieces, on the rails in turn from `first_rail`.
pub(crate) fn plan_requests(
    pieces: impl IntoIterator<Item = (PieceHome, Piece)>,
    per_request: usize,
    nrails: usize,
    first_rail: usize,
) -> Vec<(usize, Vec<Piece>)> {
    let per_request = per_request.clamp(1, MAX_PIECES);
    let nrails = nrails.max(1);
    let mut rail = first_rail % nrails;
    let mut requests: Vec<(usize, Vec<Piece>)> = Vec::new();
    let mut current: Option<PieceHome> = None;
    for (home, mut piece) in pieces {
        if current == Some(home) {
            if let Some(last) = requests.last_mut().and_then(|(_, p)| p.last_mut()) {
                let taken = absorb(last, &piece);
                piece.vram += taken;
                piece.dram += taken;
                piece.len -= taken;
            }
            if piece.len == 0 {
                continue;
            }
        }
        let fits = current.is_some_and(|c| c.handle == home.handle)
            && requests.last().is_some_and(|(_, p)| p.len() < per_request);
        if !fits {
            requests.push((rail, Vec::new()));
            rail = (rail + 1) % nrails;
        }
        current = Some(home);
        if let Some((_, p)) = requests.last_mut() {
            p.push(piece);
        }
    }
    requests
}

/// Cuts `len` bytes into pieces of at most [`PIECE_BYTES`]: (offset, length).
pub(crate) fn cut(len: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len.div_ceil(PIECE_BYTES)).map(move |i| {
        let off = i * PIECE_BYTES;
        (off, PIECE_BYTES.min(len - off))
    })
}

/// What moved this way (telemetry).
#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// Bytes of this backend's transfers moved by one copy between VRAM and a peer's
    /// DRAM (by this process or by the peer on request).
    pub(crate) bytes: AtomicU64,
    /// Bytes this backend copied for peers on their request.
    pub(crate) served_bytes: AtomicU64,
    /// Posts that the peer declined and that ran the ordinary path instead.
    pub(crate) fallbacks: AtomicU64,
    /// Requests declined or refused for who sent them or what they named.
    pub(crate) refused: AtomicU64,
    /// Requests sent through a shared lane ([`mailbox`]) rather than the transport.
    pub(crate) lane_requests: AtomicU64,
}

impl Stats {
    /// Counts and logs a declined request; its errno.
    pub(crate) fn refuse(&self, errno: i32, why: std::fmt::Arguments<'_>) -> i32 {
        let n = self.refused.fetch_add(1, Ordering::Relaxed);
        // The first, then one in 1024: a flood must not flood the log.
        if n.is_multiple_of(1024) {
            tracing::info!(refused = n + 1, "direct VRAM copy request declined: {why}");
        }
        errno
    }
}

/// An initiator's requests waiting for their answers, by request id.
#[derive(Debug, Default)]
pub(crate) struct Waits {
    table: Mutex<HashMap<u64, Arc<RunState>>>,
    next: AtomicU64,
}

/// One post's requests: how many are unanswered, and how it went.
#[derive(Debug)]
pub(crate) struct RunState {
    /// The peer that must answer.
    pub(crate) agent: String,
    pub(crate) pending: AtomicUsize,
    pub(crate) answered: AtomicU64,
    pub(crate) declined: AtomicBool,
    pub(crate) failed: Mutex<Option<(i32, String)>>,
    /// Where tracing: when the last answer was read, and the target's stamps in it
    /// (read, launched, complete, answered).
    pub(crate) answer_read: AtomicU64,
    pub(crate) target_stamps: [AtomicU64; 4],
}

impl RunState {
    pub(crate) fn new(agent: &str, requests: usize) -> Self {
        RunState {
            agent: agent.to_string(),
            pending: AtomicUsize::new(requests),
            answered: AtomicU64::new(0),
            declined: AtomicBool::new(false),
            failed: Mutex::new(None),
            answer_read: AtomicU64::new(0),
            target_stamps: Default::default(),
        }
    }

    /// The state of a new post of `requests` requests to the same peer, reusing this one
    /// (no allocation per post). GPUNETIO's initiator reuses its state; LIBFABRIC's
    /// requests keep one per post.
    #[cfg_attr(not(feature = "gpunetio"), allow(dead_code))]
    pub(crate) fn reset(&mut self, requests: usize) {
        *self.pending.get_mut() = requests;
        *self.answered.get_mut() = 0;
        *self.declined.get_mut() = false;
        *self.failed.get_mut() = None;
        *self.answer_read.get_mut() = 0;
        for s in &mut self.target_stamps {
            *s.get_mut() = 0;
        }
    }

    /// One request answered by `done`: its stamps kept where tracing (before the answer
    /// counts, so whoever sees the run complete sees them), then [`RunState::answer`].
    pub(crate) fn answer_done(&self, done: &Done) {
        if trace::on() {
            self.answer_read.store(trace::now_ns(), Ordering::Relaxed);
            let t = done.trace.unwrap_or_default();
            for (slot, v) in self
                .target_stamps
                .iter()
                .zip([t.read, t.launched, t.complete, t.answered])
            {
                slot.store(v, Ordering::Relaxed);
            }
        }
        self.answer(done.errno);
    }

    /// The target's stamps of the last answer (zeros where it did not trace).
    pub(crate) fn target_trace(&self) -> trace::TargetStamps {
        let [read, launched, complete, answered] = self
            .target_stamps
            .each_ref()
            .map(|a| a.load(Ordering::Relaxed));
        trace::TargetStamps {
            read,
            launched,
            complete,
            answered,
        }
    }

    /// One request answered with `errno`.
    pub(crate) fn answer(&self, errno: i32) {
        match errno {
            0 => {}
            e if is_declined(e) => self.declined.store(true, Ordering::Release),
            e => {
                let mut failed = self.failed.lock();
                if failed.is_none() {
                    *failed = Some((e, describe(e)));
                }
            }
        }
        self.answered.fetch_add(1, Ordering::Relaxed);
        self.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Waits {
    /// A fresh request id waiting on `run`.
    pub(crate) fn add(&self, run: &Arc<RunState>) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.table.lock().insert(id, run.clone());
        id
    }

    /// The run waiting for answer `id` from `from` (where the transport named the
    /// sender: only the run's peer may answer), removed.
    pub(crate) fn take(&self, id: u64, from: Option<&str>) -> Option<Arc<RunState>> {
        let mut table = self.table.lock();
        match (table.get(&id), from) {
            (Some(run), Some(from)) if run.agent != from => None,
            (Some(_), _) => table.remove(&id),
            (None, _) => None,
        }
    }

    /// Forgets ids whose answers will not be awaited any more.
    pub(crate) fn forget(&self, ids: &[u64]) {
        let mut table = self.table.lock();
        for id in ids {
            table.remove(id);
        }
    }
}

/// VRAM regions a peer advertised with their exports (start, length, export).
#[derive(Debug, Default)]
pub(crate) struct AdvertisedVram(parking_lot::RwLock<Vec<(u64, u64, VramExport)>>);

impl AdvertisedVram {
    /// The peer advertised VRAM at `addr..addr + len`, reachable through `export`.
    pub(crate) fn add(&self, addr: u64, len: u64, export: VramExport) {
        if len == 0 || addr.checked_add(len).is_none() || !export.holds(len) {
            return;
        }
        let mut regions = self.0.write();
        regions.retain(|&(a, l, _)| !(a == addr && l == len));
        regions.push((addr, len, export));
    }

    /// The advertised region holding `addr..addr + len`: (its start, its export).
    pub(crate) fn find(&self, addr: u64, len: u64) -> Option<(u64, VramExport)> {
        let end = addr.checked_add(len)?;
        self.0
            .read()
            .iter()
            .find(|&&(a, l, _)| a <= addr && end <= a + l)
            .map(|&(a, _, e)| (a, e))
    }
}

/// An allocation's CUDA-IPC handle and the GPU it is mapped for.
#[cfg(feature = "cuda")]
type ImportKey = ([u8; 64], usize);

/// A peer's VRAM mapped into this process, per (allocation, GPU), for the lifetime of the
/// peer's incarnation (its `PeerSource`).
#[derive(Debug, Default)]
pub(crate) struct Imports {
    #[cfg(feature = "cuda")]
    map: Mutex<HashMap<ImportKey, Arc<gpu_mem::IpcMapping>>>,
}

#[cfg(feature = "cuda")]
impl Imports {
    /// The allocation behind `export`, mapped for `gpu` (imported on first use).
    pub(crate) fn get(
        &self,
        gpu: &gpu_mem::Gpu,
        export: &VramExport,
    ) -> gpu_mem::Result<Arc<gpu_mem::IpcMapping>> {
        let key = (export.handle, gpu.ordinal());
        let mut map = self.map.lock();
        if let Some(m) = map.get(&key) {
            return Ok(m.clone());
        }
        let mapping = Arc::new(gpu_mem::IpcMapping::open(
            gpu,
            &gpu_mem::IpcHandle(export.handle),
        )?);
        map.insert(key, mapping.clone());
        Ok(mapping)
    }
}

/// What a target knows of the peer a request came from (the transport attributed it):
/// its name, the VRAM it advertised with exports, and its VRAM imported here.
pub(crate) trait PeerVram {
    fn agent(&self) -> &str;
    fn advertised(&self) -> &AdvertisedVram;
    fn imports(&self) -> &Imports;
}

impl<T: PeerVram + ?Sized> PeerVram for Arc<T> {
    fn agent(&self) -> &str {
        (**self).agent()
    }
    fn advertised(&self) -> &AdvertisedVram {
        (**self).advertised()
    }
    fn imports(&self) -> &Imports {
        (**self).imports()
    }
}

#[cfg(feature = "cuda")]
pub(crate) use gpu::*;

#[cfg(feature = "cuda")]
mod gpu {
    //! The CUDA side: exporting VRAM, pinning DRAM, importing and copying.

    use super::{
        absorb, trace, Direction, PeerVram, Piece, Request, Stats, VramExport, Waits, PIN_CHUNK,
        STREAMS,
    };
    use crate::backends::cuda_copy::{Copy, CopyBatch, CopyEngine, MemLoc, StreamPools};
    use parking_lot::RwLock;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Whether this process can copy with a GPU (a driver and a device).
    pub(crate) fn gpu_present() -> bool {
        gpu_mem::is_available() && gpu_mem::device_count() > 0
    }

    /// The export of VRAM at `addr..addr + len` on GPU `dev`: `None` where it has no
    /// legacy IPC handle (VMM memory) or the driver refuses (logged).
    pub(crate) fn export_vram(addr: u64, len: u64, dev: usize) -> Option<VramExport> {
        let export = || -> gpu_mem::Result<Option<VramExport>> {
            let view = gpu_mem::DeviceMemoryRef::wrap(addr, len, dev)?;
            if !view.info().ipc_capable {
                return Ok(None);
            }
            let (handle, offset) = view.export_ipc()?;
            let gpu_uuid = gpu_mem::Gpu::open(dev)?.uuid()?;
            Ok(Some(VramExport {
                handle: handle.0,
                offset,
                alloc_len: view.info().range_size,
                gpu_uuid,
            }))
        };
        match export() {
            Ok(e) => e,
            Err(e) => {
                tracing::debug!("VRAM {addr:#x}+{len}: no direct peer copies ({e})");
                None
            }
        }
    }

    /// The GPU of this process holding the allocation `export` names. Looked up once per
    /// GPU UUID for the process (the devices a process sees do not change): a target
    /// asks for every request, and the lookup opens each device and reads its UUID.
    pub(crate) fn home_gpu(export: &VramExport) -> Option<gpu_mem::Gpu> {
        type ByUuid = parking_lot::Mutex<std::collections::HashMap<[u8; 16], Option<gpu_mem::Gpu>>>;
        static BY_UUID: std::sync::OnceLock<ByUuid> = std::sync::OnceLock::new();
        let cache = BY_UUID.get_or_init(ByUuid::default);
        if let Some(gpu) = cache.lock().get(&export.gpu_uuid) {
            return gpu.clone();
        }
        // A failed lookup is not remembered: the next request asks again.
        let found = gpu_mem::find_by_uuid(&export.gpu_uuid).ok()?;
        cache.lock().insert(export.gpu_uuid, found.clone());
        found
    }

    /// A DRAM registration's part in the copies this side makes against a peer's VRAM:
    /// pinned chunk by chunk as copies first touch it ([`ChunkedPin`]).
    pub(crate) type DramPin = ChunkedPin;

    /// A served DRAM registration's pin, made one chunk at a time as peers' copies first
    /// touch it: registering tens of GiB with the driver in one call takes seconds (every
    /// page pinned and mapped), which a first request would wait for, and a peer may
    /// only ever touch a part. Chunks end at multiples of [`PIN_CHUNK`] (page-aligned),
    /// so neighbouring chunks share no page.
    #[derive(Debug)]
    pub(crate) struct ChunkedPin {
        addr: u64,
        len: u64,
        chunks: Vec<std::sync::OnceLock<Option<gpu_mem::HostRegistration>>>,
    }

    impl ChunkedPin {
        pub(crate) fn new(addr: u64, len: u64) -> Self {
            let end = addr.saturating_add(len);
            let n = if len == 0 {
                0
            } else {
                end.div_ceil(PIN_CHUNK) - addr / PIN_CHUNK
            };
            Self {
                addr,
                len,
                chunks: (0..n).map(|_| std::sync::OnceLock::new()).collect(),
            }
        }

        /// `at..at + len` (inside the region) cut at chunk ends: (offset from `at`,
        /// length).
        pub(crate) fn runs(&self, at: u64, len: u64) -> impl Iterator<Item = (u64, u64)> {
            let end = at + len;
            let mut cur = at;
            std::iter::from_fn(move || {
                if cur >= end {
                    return None;
                }
                let next = ((cur / PIN_CHUNK + 1) * PIN_CHUNK).min(end);
                let run = (cur - at, next - cur);
                cur = next;
                Some(run)
            })
        }

        /// Pins the chunk holding `at` if it is not yet (once; a refusal is remembered);
        /// whether it is pinned.
        pub(crate) fn ensure_at(&self, at: u64) -> bool {
            let first = self.addr / PIN_CHUNK;
            let Some(chunk) = (at / PIN_CHUNK)
                .checked_sub(first)
                .and_then(|i| self.chunks.get(i as usize))
            else {
                return false;
            };
            chunk
                .get_or_init(|| {
                    let lo = self.addr.max(at / PIN_CHUNK * PIN_CHUNK);
                    let hi = (self.addr + self.len).min((at / PIN_CHUNK + 1) * PIN_CHUNK);
                    crate::backends::cuda_copy::pin_host(lo, hi - lo)
                })
                .is_some()
        }
    }

    /// A target's side: the DRAM regions it serves copies into and out of.
    #[derive(Debug)]
    pub(crate) struct Server {
        regions: RwLock<BTreeMap<u64, Arc<DramRegion>>>,
        streams: StreamPools,
        /// How requests' copies run (`auto`: see [`serving_engine`]).
        engine: CopyEngine,
    }

    /// A request's copies from this many on, each this small on average and all touching
    /// pinned host memory, run as one gather/scatter kernel under `auto`: the copy
    /// engines pay microseconds per `cuMemcpyAsync`, which a batch of 512 blocks of
    /// 64 KiB (upstream nixlbench's GPUNETIO line) spends more on than on its bytes.
    const HOST_KERNEL_MAX_MEAN_BYTES: usize = 256 << 10;

    /// The engine a request's `copies` run on under `engine`.
    pub(crate) fn serving_engine(engine: CopyEngine, copies: &[Copy]) -> CopyEngine {
        use crate::backends::cuda_copy::KERNEL_MIN_COPIES;
        if engine != CopyEngine::Auto {
            return engine;
        }
        let n = copies.len();
        let total: usize = copies.iter().map(|c| c.len).sum();
        let pinned = |loc: MemLoc| !matches!(loc, MemLoc::Host { pinned: false });
        if n >= KERNEL_MIN_COPIES
            && total / n <= HOST_KERNEL_MAX_MEAN_BYTES
            && copies
                .iter()
                .all(|c| pinned(c.src_loc) && pinned(c.dst_loc))
        {
            CopyEngine::Kernel
        } else {
            CopyEngine::Memcpy
        }
    }

    #[derive(Debug)]
    pub(super) struct DramRegion {
        addr: u64,
        len: u64,
        pin: ChunkedPin,
        /// Copies from or into it still running.
        in_flight: AtomicUsize,
    }

    /// A request's piece as the target copies it: its VRAM by offset in the peer's
    /// allocation, and the registration holding its DRAM.
    pub(super) type Located = (Piece, Arc<DramRegion>);

    /// A DRAM registration served to peers; removed on drop, after the copies touching it.
    #[derive(Debug)]
    pub(crate) struct ServedDram {
        server: Arc<Server>,
        region: Arc<DramRegion>,
    }

    /// How long dropping a served registration waits for copies touching it.
    const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

    impl Drop for ServedDram {
        fn drop(&mut self) {
            {
                let mut regions = self.server.regions.write();
                if regions
                    .get(&self.region.addr)
                    .is_some_and(|r| Arc::ptr_eq(r, &self.region))
                {
                    regions.remove(&self.region.addr);
                }
            }
            // A device copy cannot be recalled: the memory must outlive it.
            let deadline = Instant::now() + DRAIN_TIMEOUT;
            while self.region.in_flight.load(Ordering::Acquire) > 0 {
                if Instant::now() > deadline {
                    tracing::warn!(
                        addr = self.region.addr,
                        "a DRAM registration went while peers' direct copies into it still ran"
                    );
                    break;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Marks a copy touching a region as running while it lives.
    #[derive(Debug)]
    struct InFlight(Arc<DramRegion>);

    impl Drop for InFlight {
        fn drop(&mut self) {
            self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// A request's copies, queued on the GPU.
    #[derive(Debug)]
    pub(crate) struct Serving {
        /// First: dropping it waits for the copies, before the guards and mappings go.
        batch: CopyBatch,
        _guards: Vec<InFlight>,
        _mapping: Arc<gpu_mem::IpcMapping>,
        bytes: u64,
    }

    impl Serving {
        /// `Some(errno)` once the copies completed (0) or failed.
        pub(crate) fn poll(&mut self, stats: &Stats) -> Option<i32> {
            match self.batch.poll() {
                Ok((true, _)) => {
                    stats.served_bytes.fetch_add(self.bytes, Ordering::Relaxed);
                    Some(0)
                }
                Ok((false, _)) => None,
                Err(e) => {
                    tracing::warn!("a peer's direct copy failed on the GPU: {e}");
                    Some(libc::EIO)
                }
            }
        }
    }

    impl Server {
        pub(crate) fn new(engine: CopyEngine) -> Self {
            Server {
                regions: RwLock::default(),
                streams: StreamPools::new(STREAMS),
                engine,
            }
        }

        /// Serves `addr..addr + len` (a DRAM registration).
        pub(crate) fn add(self: &Arc<Self>, addr: u64, len: u64) -> ServedDram {
            let region = Arc::new(DramRegion {
                addr,
                len,
                pin: ChunkedPin::new(addr, len),
                in_flight: AtomicUsize::new(0),
            });
            self.regions.write().insert(addr, region.clone());
            ServedDram {
                server: self.clone(),
                region,
            }
        }

        /// The registered region holding `addr..addr + len`.
        fn region_of(&self, addr: u64, len: u64) -> Option<Arc<DramRegion>> {
            let end = addr.checked_add(len)?;
            let regions = self.regions.read();
            let (_, r) = regions.range(..=addr).next_back()?;
            (end <= r.addr + r.len).then(|| r.clone())
        }

        /// A request's pieces checked (see the module's checks) and located: each by its
        /// offset in the peer's allocation (`vram`) with the registration holding its DRAM,
        /// neighbours in the same registration merged ([`absorb`]: fewer, larger copies,
        /// whatever the initiator sent); and the allocation's export.
        pub(super) fn locate(
            &self,
            req: &Request,
            peer: &dyn PeerVram,
            stats: &Stats,
        ) -> Result<(VramExport, Vec<Located>), i32> {
            // Every piece's VRAM in one advertised allocation (the initiator cuts its
            // requests so): one import per request.
            let first = req.pieces.first().ok_or(libc::EINVAL)?;
            let Some((_, export)) = peer.advertised().find(first.vram, first.len) else {
                return Err(stats.refuse(
                    libc::EADDRNOTAVAIL,
                    format_args!(
                        "VRAM at {:#x} is not in a region `{}` advertised to this agent",
                        first.vram,
                        peer.agent()
                    ),
                ));
            };
            let mut located: Vec<Located> = Vec::with_capacity(req.pieces.len());
            for p in &req.pieces {
                let Some((start, e)) = peer.advertised().find(p.vram, p.len) else {
                    return Err(stats.refuse(
                        libc::EADDRNOTAVAIL,
                        format_args!(
                            "VRAM at {:#x} is not in a region `{}` advertised to this agent",
                            p.vram,
                            peer.agent()
                        ),
                    ));
                };
                if e.handle != export.handle {
                    // Another allocation: the initiator cuts requests per allocation.
                    return Err(libc::EINVAL);
                }
                let Some(region) = self.region_of(p.dram, p.len) else {
                    return Err(libc::EACCES);
                };
                let mut piece = Piece {
                    vram: e.offset + (p.vram - start),
                    dram: p.dram,
                    len: p.len,
                };
                if let Some((last, last_region)) = located.last_mut() {
                    if Arc::ptr_eq(last_region, &region) {
                        let taken = absorb(last, &piece);
                        piece.vram += taken;
                        piece.dram += taken;
                        piece.len -= taken;
                    }
                }
                if piece.len > 0 {
                    located.push((piece, region));
                }
            }
            Ok((export, located))
        }

        /// Checks a request from `peer` (the transport said so) and queues its copies, or
        /// says why not (the errno of its answer). See the module's checks.
        pub(crate) fn serve(
            &self,
            req: &Request,
            peer: &dyn PeerVram,
            stats: &Stats,
        ) -> Result<Serving, i32> {
            let started = trace::stamp();
            let (export, located) = self.locate(req, peer, stats)?;
            let located_at = trace::step(trace::Step::ServeLocate, started);
            let Some(gpu) = home_gpu(&export) else {
                return Err(stats.refuse(
                    libc::ENODEV,
                    format_args!(
                        "the GPU holding `{}`'s VRAM is not visible here",
                        peer.agent()
                    ),
                ));
            };
            let mapping = peer.imports().get(&gpu, &export).map_err(|e| {
                stats.refuse(
                    libc::ENODEV,
                    format_args!("importing `{}`'s VRAM failed: {e}", peer.agent()),
                )
            })?;
            let imported_at = trace::step(trace::Step::ServeImport, located_at);
            let mut copies = Vec::with_capacity(located.len());
            let mut guards = Vec::with_capacity(located.len());
            let mut bytes = 0;
            for (p, region) in located {
                let at = p.vram;
                if at.checked_add(p.len).is_none_or(|end| end > mapping.len()) {
                    return Err(libc::EINVAL);
                }
                let device = MemLoc::Gpu(gpu.ordinal());
                // One copy per pinned chunk the piece touches (a copy spanning two
                // registrations would not be a pinned copy).
                for (off, len) in region.pin.runs(p.dram, p.len) {
                    let host = MemLoc::Host {
                        pinned: region.pin.ensure_at(p.dram + off),
                    };
                    let (dram, vram) = (p.dram + off, mapping.ptr() + at + off);
                    copies.push(match req.direction {
                        Direction::ToDram => Copy {
                            dst: dram,
                            src: vram,
                            len: len as usize,
                            dst_loc: host,
                            src_loc: device,
                        },
                        Direction::ToVram => Copy {
                            dst: vram,
                            src: dram,
                            len: len as usize,
                            dst_loc: device,
                            src_loc: host,
                        },
                    });
                }
                region.in_flight.fetch_add(1, Ordering::AcqRel);
                guards.push(InFlight(region));
                bytes += p.len;
            }
            let pool = self.streams.get(gpu.ordinal()).map_err(|e| {
                tracing::warn!("direct copies for `{}`: {e}", peer.agent());
                libc::ENODEV
            })?;
            let engine = serving_engine(self.engine, &copies);
            let mut batch = CopyBatch::new(pool, copies, STREAMS, engine).map_err(|e| {
                tracing::warn!("direct copies for `{}`: {e}", peer.agent());
                libc::EIO
            })?;
            let batch_at = trace::step(trace::Step::ServeBatch, imported_at);
            // SAFETY (of the copies, in `post`): the DRAM ranges lie inside registrations
            // of this backend that wait for them (`InFlight`) before they go; the VRAM
            // ranges inside the peer's allocation, mapped while `_mapping` lives, which
            // outlives the batch (dropped first, it waits for the copies).
            batch.post(None).map_err(|e| {
                tracing::warn!("direct copies for `{}`: {e}", peer.agent());
                libc::EIO
            })?;
            trace::step(trace::Step::ServePost, batch_at);
            Ok(Serving {
                batch,
                _guards: guards,
                _mapping: mapping,
                bytes,
            })
        }
    }

    /// The peer-copy state of a backend: what it served and moved, the answers it awaits,
    /// and (where it serves peers) its served DRAM.
    #[derive(Debug)]
    pub(crate) struct Shared {
        /// This backend takes the direct path where it fits (`vram_peer_copy=auto` and
        /// a GPU here).
        pub(crate) enabled: bool,
        pub(crate) stats: Stats,
        pub(crate) waits: Waits,
        /// Serves peers' requests (enabled, and rail workers' threads to serve from).
        pub(crate) server: Option<Arc<Server>>,
        /// The streams of this side's own copies (initiator-owned host memory).
        pub(crate) streams: StreamPools,
    }

    impl Shared {
        pub(crate) fn new(enabled: bool, serves: bool) -> Self {
            Self::with_engine(enabled, serves, CopyEngine::Auto)
        }

        /// As [`Shared::new`], serving copies on `engine`.
        pub(crate) fn with_engine(enabled: bool, serves: bool, engine: CopyEngine) -> Self {
            Shared {
                enabled,
                stats: Stats::default(),
                waits: Waits::default(),
                server: (enabled && serves).then(|| Arc::new(Server::new(engine))),
                streams: StreamPools::new(STREAMS),
            }
        }
    }
}

/// Without CUDA no GPU copies for this backend.
#[cfg(not(feature = "cuda"))]
pub(crate) fn gpu_present() -> bool {
    false
}

/// Without CUDA nothing is exported, served or copied this way: the state is the
/// counters and the (always empty) waits alone.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) enabled: bool,
    pub(crate) stats: Stats,
    pub(crate) waits: Waits,
}

#[cfg(not(feature = "cuda"))]
impl Shared {
    pub(crate) fn new(_enabled: bool, _serves: bool) -> Self {
        Shared {
            enabled: false,
            stats: Stats::default(),
            waits: Waits::default(),
        }
    }
}

/// A local registration's part in peer copies: its VRAM export (advertised in its
/// metadata), or for DRAM its pin (on first use) and its entry in the served regions.
#[derive(Debug, Default)]
pub(crate) struct LocalPart {
    pub(crate) export: Option<VramExport>,
    #[cfg(feature = "cuda")]
    pub(crate) pin: Option<DramPin>,
    #[cfg(feature = "cuda")]
    pub(crate) _served: Option<ServedDram>,
}
#[cfg(test)]
pub(crate) mod tests;
