//! Same-host READs copied from both ends at once: the target pushes part of the block.
//!
//! A READ over libfabric 1.17's `shm` is copied by the initiator (`process_vm_readv`
//! on the target, inside `fi_read`), which pins the target's pages 4 KiB at a time
//! under the page-table lock of their 2 MiB region, so a 2 MiB block runs at one CMA
//! copy's rate whether one rail reads it or several (striped). The WRITE side of this
//! is solved by the initiator pushing half ([`super::cma`]); a READ's second copy has
//! to pin the *initiator's* pages, and only the target can do that: it pushes with
//! `process_vm_writev` into the initiator.
//!
//! So a READ block of at least [`super::cma::PUSH_THRESHOLD`] (2 MiB) from a peer on
//! this host that serves assists (its connection information says so, [`CONN_TAG`]) is
//! split into pairs of pieces, each pair on one rail (pairs over the rails, see
//! `prep_xfer`): the first piece is *assisted*: the initiator's rail worker sends the
//! target a [`Request`] on the rail (the target's range as the provider names it, and its
//! key; the initiator's address, its process identity and its rail's name), and the
//! target's rail worker checks who sent it and where it would write (the trust model
//! below), pushes it and answers [`Done`] with an errno; the
//! piece counts as done when the answer comes, after its bytes are in place. The second
//! piece the initiator's worker meanwhile pulls itself (`process_vm_readv`, module
//! `cma`), not through the provider: `fi_read` copies holding the lock of the target's
//! region of that rail, which the target's progress needs to receive the request, so
//! the two pieces of a rail went one after the other. The target holds its registry's
//! read lock while it pushes, so a deregistration of the source waits for the copy.
//!
//! nixlbench DRAM READs over `shm` from 2 MiB run faster with assists than with the
//! provider alone (`cma_read=0`): figures in `docs/BENCHMARKS.md` in the repository.
//!
//! Answers that mean "not here" ([`is_refusal`]: the target may not copy into the
//! initiator — Yama's `ptrace_scope` 1 lets a parent copy into its child but not the
//! reverse — or cannot see its process, or does not serve this initiator) move the piece
//! through the provider, and the initiator asks that peer no more; a declined piece
//! ([`is_declined`]: its destination is not in what the target knows of the initiator's
//! regions) moves through the provider and the initiator keeps asking. A block is split
//! only where the initiator may copy from the target itself (the `cma` probe); else the
//! provider reads all of it. A source range outside the target's registrations fails
//! the transfer (`EACCES`, as the provider's key check would). A target whose process
//! ends while assists are pending fails the transfer with `RemoteDisconnect` from its
//! pidfd as before; the pending pieces are then given up (nothing can write them any
//! more).
//!
//! # Trust model
//! A request names a destination in another process, and the target writes it with its
//! own credentials, so nothing in the request decides where the bytes go unchecked. The
//! target serves only peers whose metadata it loaded (both sides exchange metadata, as
//! nixlbench does), and checks, in this order ([`Server::serve`]):
//! - **who asks**: the request is sealed (module `notif_mac`): the rail worker acts on it
//!   only when it opens under the key of the loaded peer it names, and its `reply_to`
//!   must be one of that peer's endpoints bound on the rail (else `EPERM`); a request
//!   that names a loaded peer but does not open (forged, replayed, or plain from that
//!   peer's endpoint as the provider names it: `shm` misattributes a flood) is dropped
//!   and counted, unanswered; one from no loaded peer is refused (`EPERM`, logged,
//!   counted in [`Server::refused`]) and answered at the address it names (only a
//!   refusal goes there);
//! - **that it is who it says**: the process identity in the request (boot id, pid,
//!   start time) must equal the one that peer's connection information advertised, else
//!   `EPERM`;
//! - **where the copy goes**: into the process from the peer's connection information
//!   (its pid, found here with the same start time), never the one the request names;
//!   and the destination range must lie inside DRAM regions that peer advertised in its
//!   metadata (`load_remote_md`), else the piece is declined (`EADDRNOTAVAIL`). For a
//!   peer other than this agent itself, a destination overlapping a region this backend
//!   registered is refused (`EPERM`): the target never writes into itself on a peer's
//!   word (two agents of one process each register their own memory);
//! - **what is read**: the source range must lie inside a region this backend registered
//!   on that rail with that key (as the provider's key check does), else `EACCES`; the
//!   registry's read lock is held while the bytes move, so a deregistration waits.
//!
//! The answer goes, sealed, to the peer's endpoint the request names, and the initiator
//! takes an answer only when sealed by the peer its job asked (a forged "in place" would
//! complete a READ before its bytes). What remains
//! trusted is the metadata itself: a peer's connection information
//! and regions are what the agent loaded under its name (binding names to the connection
//! they arrived on is the listener's part), and the kernel's `ptrace` check on the
//! target's credentials still applies to every copy.
//!
//! Parameter `cma_read` (default 1 over `shm`): asks for assists, and serves them where
//! the backend has its rail workers' threads (a target without them would answer only
//! when its owner polls, so it does not advertise them); 0: neither.

use super::liveness::{self, ProcessId};
use super::sources::PeerSource;
use crate::backends::peer_dram::wire::{put_header, put_name, Reader};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// First bytes of an assist message on a rail (beside notifications and staging).
pub(super) const MAGIC: &[u8; 4] = b"NXCM";
const VERSION: u8 = 1;
const REQUEST: u8 = 1;
const DONE: u8 = 2;
/// Tag of the connection information's section that says this backend serves assists.
pub(super) const CONN_TAG: &[u8; 4] = b"NXCA";
/// The section: tag, version, flags ([`SERVES_ASSISTS`], [`SERVES_PEER_COPIES`]).
pub(super) const CONN_WIRE_SIZE: usize = 4 + 1 + 1;
/// Flag of the connection section: the backend serves READ assists.
pub(super) const SERVES_ASSISTS: u8 = 1;
/// Flag of the connection section: the backend serves direct VRAM copies
/// (`super::peer_copy`).
pub(super) const SERVES_PEER_COPIES: u8 = 2;
/// The longest rail name a request carries.
const MAX_NAME: usize = 1024;

/// The connection information's section for a backend that serves what `flags` says.
pub(super) fn encode_conn_section(out: &mut Vec<u8>, flags: u8) {
    out.extend_from_slice(CONN_TAG);
    out.push(VERSION);
    out.push(flags);
}

/// What a peer serves, from its section (`Err`: malformed).
pub(super) fn decode_conn_section(bytes: &[u8]) -> Result<u8, String> {
    match bytes {
        [t0, t1, t2, t3, VERSION, flags] if [*t0, *t1, *t2, *t3] == *CONN_TAG => Ok(*flags),
        [_, _, _, _, v, _] => Err(format!("assist section version {v}")),
        _ => Err("assist section has the wrong size".into()),
    }
}

/// Initiator to target: push `len` bytes of your `src` (registered on this rail under
/// `key`) to my `dst`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Request {
    /// The initiator's job on its rail worker, and the operation within it.
    pub(super) job: u64,
    pub(super) op: u32,
    pub(super) requester: ProcessId,
    pub(super) src: u64,
    pub(super) key: u64,
    pub(super) dst: u64,
    pub(super) len: u64,
    /// The initiator's rail endpoint, where the answer goes.
    pub(super) reply_to: Vec<u8>,
}

/// Target to initiator: the request's piece is in place (`errno` 0), or why not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Done {
    pub(super) job: u64,
    pub(super) op: u32,
    pub(super) errno: i32,
}

/// A decoded assist message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Message {
    Request(Request),
    Done(Done),
}

fn header(kind: u8, job: u64, op: u32, out: &mut Vec<u8>) {
    put_header(out, MAGIC, VERSION, kind);
    out.extend_from_slice(&job.to_le_bytes());
    out.extend_from_slice(&op.to_le_bytes());
}

impl Request {
    /// `NXCM 1 1 job:u64 op:u32 process:LIVE-block src key dst len:u64 name:str16`
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(18 + liveness::WIRE_SIZE + 34 + self.reply_to.len());
        header(REQUEST, self.job, self.op, &mut out);
        self.requester.encode(&mut out);
        for v in [self.src, self.key, self.dst, self.len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        put_name(&mut out, &self.reply_to);
        out
    }
}

impl Done {
    /// `NXCM 1 2 job:u64 op:u32 errno:i32`
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(22);
        header(DONE, self.job, self.op, &mut out);
        out.extend_from_slice(&self.errno.to_le_bytes());
        out
    }
}

/// Decodes an assist message (bounded against hostile input: a malformed one is an
/// `Err` to log and drop).
pub(super) fn decode(bytes: &[u8]) -> Result<Message, String> {
    let (kind, mut r) = Reader::open(bytes, MAGIC, VERSION, "assist")?;
    let job = r.u64()?;
    let op = r.u32()?;
    let message = match kind {
        REQUEST => {
            let block = r.take::<{ liveness::WIRE_SIZE }>()?;
            let requester = ProcessId::decode(&block)
                .map_err(|e| e.to_string())?
                .ok_or("no requester")?;
            let (src, key, dst, len) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
            let reply_to = r.name(MAX_NAME)?;
            Message::Request(Request {
                job,
                op,
                requester,
                src,
                key,
                dst,
                len,
                reply_to,
            })
        }
        DONE => Message::Done(Done {
            job,
            op,
            errno: r.i32()?,
        }),
        other => return Err(format!("unknown assist message kind {other}")),
    };
    r.finish()?;
    Ok(message)
}

/// Whether an answer means "not from this peer" (move the piece through the provider
/// and ask no more) rather than a failed transfer.
pub(super) fn is_refusal(errno: i32) -> bool {
    matches!(errno, libc::EPERM | libc::ESRCH | libc::EOPNOTSUPP)
}

/// Whether an answer means "not this piece" (its destination is not in what the target
/// knows of this process's regions, e.g. registered after the target loaded this side's
/// metadata): move it through the provider and keep asking.
pub(super) fn is_declined(errno: i32) -> bool {
    errno == libc::EADDRNOTAVAIL
}

/// What an answer's errno means, for the transfer's error.
pub(super) fn describe(errno: i32, len: usize) -> String {
    match errno {
        libc::EACCES => format!(
            "the peer refused to copy {len} bytes of a READ: the range is not inside a region \
             it registered with that key"
        ),
        libc::EINVAL => format!("the peer refused a malformed READ piece of {len} bytes"),
        e => format!(
            "the peer failed to copy {len} bytes of a READ into this process: {}",
            std::io::Error::from_raw_os_error(e)
        ),
    }
}

/// A served registration on one rail: the address peers name it by (the provider's:
/// the virtual address or an offset, as the provider registers), where it is here, and
/// its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ServedRange {
    remote: u64,
    addr: u64,
    len: u64,
}

/// A target's side: the regions it serves (by rail and key), and what it refused.
#[derive(Debug, Default)]
pub(super) struct Server {
    regions: RwLock<HashMap<(usize, u64), ServedRange>>,
    /// Requests refused for who sent them or where they would write (see the module's
    /// trust model).
    refused: AtomicU64,
    /// Tests make the target refuse (as one without ptrace access to its initiator).
    #[cfg(test)]
    pub(super) refuse: std::sync::atomic::AtomicBool,
}

/// A registration's entries in [`Server`]; removed on drop.
#[derive(Debug)]
pub(super) struct Served {
    server: Arc<Server>,
    entries: Vec<((usize, u64), ServedRange)>,
}

impl Drop for Served {
    fn drop(&mut self) {
        // Waits for a push from the region in progress (it holds the read lock).
        let mut regions = self.server.regions.write();
        for (key, range) in &self.entries {
            if regions.get(key) == Some(range) {
                regions.remove(key);
            }
        }
    }
}

impl Server {
    /// Serves `addr..addr + len`, registered on rail i as `rails[i]` (key, the address
    /// peers name its start by).
    pub(super) fn add(self: &Arc<Self>, rails: &[(u64, u64)], addr: u64, len: u64) -> Served {
        let entries: Vec<_> = rails
            .iter()
            .enumerate()
            .map(|(rail, &(key, remote))| ((rail, key), ServedRange { remote, addr, len }))
            .collect();
        let mut regions = self.regions.write();
        for (key, range) in &entries {
            regions.insert(*key, *range);
        }
        Served {
            server: self.clone(),
            entries,
        }
    }

    /// Requests refused so far for who sent them or where they would write.
    pub(super) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Counts and logs a refused request; its errno.
    pub(super) fn refuse(&self, errno: i32, why: std::fmt::Arguments<'_>) -> i32 {
        let n = self.refused.fetch_add(1, Ordering::Relaxed);
        // The first, then one in 1024: a flood must not flood the log.
        if n.is_multiple_of(1024) {
            tracing::warn!(refused = n + 1, "READ assist request refused: {why}");
        }
        errno
    }

    /// Carries out a request that arrived on `rail` from `peer`'s endpoint (the transport
    /// said so): the errno of its answer. See the module's trust model.
    pub(super) fn serve(&self, rail: usize, req: &Request, peer: &PeerSource) -> i32 {
        #[cfg(test)]
        if self.refuse.load(Ordering::Relaxed) {
            return libc::EPERM;
        }
        let Ok(len) = usize::try_from(req.len) else {
            return libc::EINVAL;
        };
        if len == 0 || req.dst.checked_add(req.len).is_none() {
            return libc::EINVAL;
        }
        if peer.process != Some(req.requester) {
            return self.refuse(
                libc::EPERM,
                format_args!(
                    "`{}` names another process than its connection information",
                    peer.agent
                ),
            );
        }
        // The process the connection information named, not the request.
        let Some(cma) = &peer.cma else {
            return libc::ESRCH;
        };
        if !peer.advertised(req.dst, req.len) {
            return self.refuse(
                libc::EADDRNOTAVAIL,
                format_args!(
                    "{len} bytes at {:#x} are not in a region `{}` advertised",
                    req.dst, peer.agent
                ),
            );
        }
        let regions = self.regions.read();
        if !peer.is_self && overlaps_any(&regions, req.dst, req.len) {
            return self.refuse(
                libc::EPERM,
                format_args!(
                    "`{}` asked for a copy into memory this backend registered",
                    peer.agent
                ),
            );
        }
        // The range as the peer names it (the provider's addressing), here.
        let src = regions.get(&(rail, req.key)).and_then(|range| {
            let offset = req.src.checked_sub(range.remote)?;
            (offset.checked_add(req.len)? <= range.len).then_some(range.addr + offset)
        });
        let Some(src) = src else {
            return libc::EACCES;
        };
        // SAFETY: `src..src + len` lies inside a region this backend registered (checked
        // under the read lock, which its deregistration waits for), so it is mapped,
        // readable memory of this process for the whole copy.
        match unsafe { cma.push(src, len, req.dst) } {
            Ok(()) => 0,
            Err(e) => e.errno.max(1),
        }
    }
}

/// Whether `addr..addr + len` overlaps a served region (in this process).
fn overlaps_any(regions: &HashMap<(usize, u64), ServedRange>, addr: u64, len: u64) -> bool {
    let end = addr.saturating_add(len);
    regions
        .values()
        .any(|r| addr < r.addr.saturating_add(r.len) && r.addr < end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(src: u64, key: u64, dst: u64, len: u64) -> Request {
        Request {
            job: 7,
            op: 3,
            requester: ProcessId::current().unwrap(),
            src,
            key,
            dst,
            len,
            reply_to: b"nixl-1-2-abcdef".to_vec(),
        }
    }

    #[test]
    fn messages_round_trip_and_malformed_ones_are_refused() {
        let req = request(0x1000, 42, 0x2000, 4096);
        let wire = req.encode();
        assert_eq!(decode(&wire), Ok(Message::Request(req.clone())));
        let done = Done {
            job: u64::MAX,
            op: 9,
            errno: -3,
        };
        assert_eq!(decode(&done.encode()), Ok(Message::Done(done)));
        // Every truncation, and a trailing byte, is an error, never a panic.
        for cut in 0..wire.len() {
            assert!(decode(&wire[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = wire.clone();
        long.push(0);
        assert!(decode(&long).is_err());
        // Another version or kind.
        for (at, value) in [(4, 2u8), (5, 9u8)] {
            let mut bad = wire.clone();
            bad[at] = value;
            assert!(decode(&bad).is_err());
        }
        // A bit flipped anywhere decodes to something else or to an error.
        for i in 0..wire.len() * 8 {
            let mut bad = wire.clone();
            bad[i / 8] ^= 1 << (i % 8);
            assert_ne!(decode(&bad), Ok(Message::Request(req.clone())));
        }
        // The connection section.
        let mut section = Vec::new();
        encode_conn_section(&mut section, SERVES_ASSISTS | SERVES_PEER_COPIES);
        assert_eq!(section.len(), CONN_WIRE_SIZE);
        assert_eq!(
            decode_conn_section(&section),
            Ok(SERVES_ASSISTS | SERVES_PEER_COPIES)
        );
        section[4] = 9;
        assert!(decode_conn_section(&section).is_err());
        assert!(decode_conn_section(&section[..3]).is_err());
    }

    /// This process as a loaded peer that advertised `regions`.
    fn peer(regions: &[(u64, u64)], is_self: bool) -> PeerSource {
        let me = ProcessId::current().unwrap();
        let cma = Arc::new(super::super::cma::CmaPeer::new(me.local_pid().unwrap()));
        let peer = PeerSource::new("initiator", 2, Some(me), Some(cma), is_self);
        for &(addr, len) in regions {
            peer.advertise(addr, len);
        }
        peer
    }

    #[test]
    fn a_target_pushes_only_inside_its_registrations() {
        let server = Arc::new(Server::default());
        let src: Vec<u8> = (0..3 << 20)
            .map(|i: usize| (i * 7 + i / 4096) as u8)
            .collect();
        let mut dst = vec![0u8; src.len()];
        let dst_p = dst.as_mut_ptr() as u64;
        let base = src.as_ptr() as u64;
        let served = server.add(&[(11, base), (12, 0)], base, src.len() as u64);
        let from = peer(&[(dst_p, dst.len() as u64)], false);
        // A piece in the middle, on rail 1 with its key (named by offset there).
        let req = request(4096, 12, dst_p + 4096, 1 << 20);
        assert_eq!(server.serve(1, &req, &from), 0);
        assert!(dst[4096..4096 + (1 << 20)] == src[4096..4096 + (1 << 20)]);
        assert!(dst[..4096].iter().all(|&b| b == 0));
        // The same piece by virtual address on rail 0.
        dst.fill(0);
        let by_addr = request(base + 4096, 11, dst_p + 4096, 1 << 20);
        assert_eq!(server.serve(0, &by_addr, &from), 0);
        assert!(dst[4096..4096 + (1 << 20)] == src[4096..4096 + (1 << 20)]);
        // The other rail's key, an unknown key, a range past the end or before the start.
        assert_eq!(server.serve(0, &req, &from), libc::EACCES);
        assert_eq!(server.serve(1, &by_addr, &from), libc::EACCES);
        assert_eq!(
            server.serve(1, &request(base, 13, dst_p, 16), &from),
            libc::EACCES
        );
        let past = request(base + src.len() as u64 - 8, 11, dst_p, 16);
        assert_eq!(server.serve(0, &past, &from), libc::EACCES);
        assert_eq!(
            server.serve(0, &request(base - 8, 11, dst_p, 16), &from),
            libc::EACCES
        );
        assert_eq!(
            server.serve(0, &request(u64::MAX - 4, 11, dst_p, 16), &from),
            libc::EACCES
        );
        // Zero bytes or a destination that wraps: malformed.
        assert_eq!(
            server.serve(0, &request(base, 11, 0, 0), &from),
            libc::EINVAL
        );
        assert_eq!(
            server.serve(0, &request(base, 11, u64::MAX - 4, 16), &from),
            libc::EINVAL
        );
        assert_eq!(server.refused(), 0);
        // A destination the peer did not advertise: declined, counted, nothing written.
        let unadvertised = vec![0u8; 4096];
        let elsewhere = request(base, 11, unadvertised.as_ptr() as u64, 4096);
        assert_eq!(server.serve(0, &elsewhere, &from), libc::EADDRNOTAVAIL);
        assert!(is_declined(libc::EADDRNOTAVAIL) && !is_refusal(libc::EADDRNOTAVAIL));
        assert!(unadvertised.iter().all(|&b| b == 0));
        // Straddling the end of what it advertised.
        let straddle = request(base, 11, dst_p + dst.len() as u64 - 8, 16);
        assert_eq!(server.serve(0, &straddle, &from), libc::EADDRNOTAVAIL);
        // Into memory this backend registered (the source itself), though advertised.
        let into_me = peer(&[(base, src.len() as u64)], false);
        let req_me = request(base, 11, base + 4096, 4096);
        assert_eq!(server.serve(0, &req_me, &into_me), libc::EPERM);
        // Unless the peer is this agent itself (loopback).
        let me = peer(&[(base, src.len() as u64)], true);
        assert_eq!(
            server.serve(0, &request(base + 8192, 11, base + 8192, 8), &me),
            0
        );
        assert_eq!(server.refused(), 3);
        // A request naming another process than the peer advertised: refused.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let mut other = request(base, 11, dst_p, 16);
        let mut block = Vec::new();
        other.requester.encode(&mut block);
        block[21..25].copy_from_slice(&pid.to_le_bytes());
        other.requester = ProcessId::decode(&block).unwrap().unwrap();
        assert_eq!(server.serve(0, &other, &from), libc::EPERM);
        assert!(is_refusal(libc::EPERM));
        assert_eq!(server.refused(), 4);
        // A peer whose process is not here: refused, not failed.
        let far = PeerSource::new("far", 3, Some(req.requester), None, false);
        far.advertise(dst_p, dst.len() as u64);
        assert_eq!(
            server.serve(0, &request(base, 11, dst_p, 16), &far),
            libc::ESRCH
        );
        assert!(is_refusal(libc::ESRCH));
        // A destination the requester has not mapped, though advertised: EFAULT, the
        // transfer's error.
        let unmapped = peer(&[(8, 4096)], false);
        assert_eq!(
            server.serve(0, &request(base, 11, 8, 4096), &unmapped),
            libc::EFAULT
        );
        assert!(!is_refusal(libc::EFAULT) && !is_refusal(libc::EACCES));
        // Deregistered: nothing is served from it any more.
        drop(served);
        assert_eq!(server.serve(1, &req, &from), libc::EACCES);
    }
}
