//! Who sent a message or a remote CQ data arrival: the loaded peer whose endpoint the
//! transport names, never the name a message gives itself.
//!
//! The rails are opened with `FI_SOURCE` and read with `fi_cq_readfrom`, so each
//! completion carries the sender's handle in the rail's address vector, or none where
//! the sender's address is not in it. The handle's address (`fi_av_lookup`) is matched
//! against the endpoint names of the peers this backend loaded: loading a peer binds
//! each of its rails' names, on the local rail that name sends to, to the peer's
//! [`PeerSource`] — its agent name, its process as its connection information
//! advertised it, and the DRAM ranges its metadata advertised. Every name that may send
//! to a rail is in that rail's address vector (a peer with more rails than this backend
//! sends from several endpoints to one rail: those are inserted too), so that the
//! provider can name them.
//!
//! What libfabric 1.17's providers report (`fabric/tests/source.rs`): `tcp;ofi_rxm` and
//! `sockets` name the senders of messages, and report a sender whose address is not in
//! the vector as none; `shm` reports such a sender as handle 0 (its peer map's default),
//! so every `shm` rail inserts its own endpoint first, which takes handle 0, and handle 0
//! is never attributed (this backend's messages to itself do not go through the rails:
//! the loopback notification is delivered directly). Remote CQ data is attributed on
//! `shm` and `sockets` only: `tcp;ofi_rxm` leaves its source unset (a stale slot of its
//! queue), so there data is matched by its notification key alone, which the sender
//! draws at random per transfer (see [`super::NotifKeys`]).
//!
//! Limits: the attribution is as strong as the provider's. `shm` takes the sender's slot
//! in the receiver's peer map from the command the sender wrote into the receiver's
//! shared region: a process that writes that region directly (it is a file of the same
//! user in `/dev/shm`) rather than through libfabric can claim another slot. Such a
//! process can also `ptrace` the target where Yama allows it. Measured since
//! (`nixl-attack-bench`, docs/BENCHMARKS.md "nixl: load under attack"): a raw `shm`
//! endpoint in a process of its own, sending *through libfabric*, had a flood of its
//! messages reported as coming from the loaded peer's address: none of 3,000, but from
//! some point of a flood on every message (the last 1,368 of 6,000; half of 10,000;
//! all of 10,000 where the rail had 1,024 receive slots instead of its 64), while a few
//! messages (the `security_tests` case) were reported as handle 0. So on `shm` the
//! attribution holds against a stray message but not against a same-user process that
//! floods the rail; `tcp;ofi_rxm` delivered none of the forged messages. So a
//! notification or rail control message (staging, READ assist, direct copy) naming a
//! loaded peer carries a proof of its sender in the message itself (module `notif_mac`),
//! and that proof, not this attribution, decides. This attribution still decides for
//! remote CQ data, which cannot carry a proof.

use super::cma::CmaPeer;
use super::liveness::{self, ProcessId};
use super::notif_mac::{Opener, Sealer};
use super::peer_copy::{AdvertisedVram, Imports, VramExport};
use super::stage_net::{FabAddr, ReplyAddr};
use super::{fabric_error, LibfabricBackend, PeerAddrs};
use crate::error::Result;
use crate::mem::{MemKind, Region};
use parking_lot::RwLock;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Owner of notification arrivals from endpoints that are no loaded peer's (accepted
/// with `notif_senders=any`): all of them share one bound.
pub(super) const STRANGER: u64 = 1;
/// How long a look at a loaded peer's process (alive) stands: every sealed control
/// message asks whether its sender's process ended, and a look reads `/proc` (several
/// files: it cost most of a small staged chunk's round trip, `docs/BENCHMARKS.md`). A process
/// seen ended stays ended; one that ends is seen at most this late (its frames are
/// refused as unproven until then, never taken on its name).
const PROCESS_LOOK_STANDS: Duration = Duration::from_millis(1);

/// A loaded peer as the transport knows it.
#[derive(Debug)]
pub(super) struct PeerSource {
    pub(super) agent: String,
    /// Unique per load of a connection information: pending notifications are charged
    /// to it and forgotten with it.
    pub(super) tag: u64,
    /// Its process as its connection information advertised it (same host).
    pub(super) process: Option<ProcessId>,
    /// Its process where this one may copy into it (same host, same pid namespace).
    pub(super) cma: Option<Arc<CmaPeer>>,
    /// This backend's own agent, loaded as a peer (loopback transfers).
    pub(super) is_self: bool,
    /// DRAM ranges `(start, end)` its metadata advertised, sorted, merged.
    regions: RwLock<Vec<(u64, u64)>>,
    /// VRAM regions its metadata advertised with their CUDA-IPC export (module
    /// `peer_copy`: the only VRAM this backend copies into or out of on its request).
    pub(super) vram: AdvertisedVram,
    /// Its VRAM mapped into this process, for this incarnation (with feature `cuda`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) imports: Imports,
    /// Opens its sealed notifications (module `notif_mac`): the proof that a
    /// notification naming it is its own. Set once, when it is loaded.
    opener: OnceLock<Opener>,
    /// Seals what this side sends it (the sealer of its `PeerAddrs`): answers to its
    /// control messages go sealed, and an answer proven by it is matched to the requests
    /// sent under this sealer.
    sealer: OnceLock<Arc<Sealer>>,
    /// Its process was seen ended (for good: a pid and start time never come back).
    ended: AtomicBool,
    /// When its process was last looked at (`liveness::due`'s clock; `liveness::NEVER`
    /// before the first look).
    looked_at: AtomicU64,
    /// The shared lane this side made for its notifications and direct-copy requests
    /// (module `worker::peer_copies`), offered to it once.
    pub(super) served_lane: OnceLock<Arc<crate::backends::peer_dram::mailbox::Mailbox>>,
}

impl PeerSource {
    pub(super) fn new(
        agent: &str,
        tag: u64,
        process: Option<ProcessId>,
        cma: Option<Arc<CmaPeer>>,
        is_self: bool,
    ) -> Self {
        PeerSource {
            agent: agent.to_string(),
            tag,
            process,
            cma,
            is_self,
            regions: RwLock::default(),
            vram: AdvertisedVram::default(),
            imports: Imports::default(),
            opener: OnceLock::new(),
            sealer: OnceLock::new(),
            ended: AtomicBool::new(false),
            looked_at: AtomicU64::new(liveness::NEVER),
            served_lane: OnceLock::new(),
        }
    }

    /// Whether its advertised process is known to have ended here
    /// ([`ProcessId::has_ended_here`]), looked up at most every
    /// [`PROCESS_LOOK_STANDS`].
    pub(super) fn process_ended(&self) -> bool {
        let Some(process) = &self.process else {
            return false;
        };
        if self.ended.load(Ordering::Relaxed) {
            return true;
        }
        if !liveness::due(&self.looked_at, PROCESS_LOOK_STANDS) {
            return false;
        }
        let ended = process.has_ended_here();
        if ended {
            self.ended.store(true, Ordering::Relaxed);
        }
        ended
    }

    /// Sets what opens its sealed notifications (kept where already set: the same
    /// incarnation loaded again keeps its replay window).
    pub(super) fn set_opener(&self, opener: Opener) {
        let _ = self.opener.set(opener);
    }

    /// What opens its sealed notifications, once loaded.
    pub(super) fn opener(&self) -> Option<&Opener> {
        self.opener.get()
    }

    /// Sets what seals this side's messages to it (kept where already set, as the
    /// opener).
    pub(super) fn set_sealer(&self, sealer: Arc<Sealer>) {
        let _ = self.sealer.set(sealer);
    }

    /// What seals this side's messages to it, once loaded.
    pub(super) fn sealer(&self) -> Option<&Arc<Sealer>> {
        self.sealer.get()
    }

    /// The peer advertised DRAM at `addr..addr + len` (a region of its metadata).
    pub(super) fn advertise(&self, addr: u64, len: u64) {
        let Some(end) = addr.checked_add(len).filter(|_| len > 0) else {
            return;
        };
        let mut regions = self.regions.write();
        regions.push((addr, end));
        regions.sort_unstable();
        // Merge overlapping and touching ranges: a range inside their union is inside
        // what the peer advertised.
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(regions.len());
        for &(s, e) in regions.iter() {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        *regions = merged;
    }

    /// Whether `addr..addr + len` lies inside DRAM the peer advertised.
    pub(super) fn advertised(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let regions = self.regions.read();
        let at = regions.partition_point(|&(s, _)| s <= addr);
        at > 0 && end <= regions[at - 1].1
    }
}

/// A peer's endpoint on a local rail: (local rail, endpoint name).
pub(super) type EndpointKey = (usize, Vec<u8>);

/// One endpoint of a loaded peer, on one local rail: whose it is and where answers to
/// it go (a handle of the rail's address vector, kept while this lives).
#[derive(Debug)]
pub(super) struct Source {
    pub(super) peer: Arc<PeerSource>,
    pub(super) reply: FabAddr,
}

/// Agent names loaded in any plane of the backend (see `local_rails`): a message from no
/// loaded peer's endpoint that claims one of them is an impersonation.
#[derive(Debug, Default)]
pub(super) struct LoadedNames(RwLock<HashSet<String>>);

impl LoadedNames {
    pub(super) fn insert(&self, agent: &str) {
        self.0.write().insert(agent.to_string());
    }
    pub(super) fn remove(&self, agent: &str) {
        self.0.write().remove(agent);
    }
    fn contains(&self, agent: &str) -> bool {
        self.0.read().contains(agent)
    }
}

/// The loaded peers' endpoints, by (local rail, endpoint name).
#[derive(Debug)]
pub(super) struct Sources {
    by_name: RwLock<HashMap<EndpointKey, Arc<Source>>>,
    by_agent: RwLock<HashMap<String, Arc<PeerSource>>>,
    /// Bumped on every change: the rail workers' caches of handles are then stale.
    generation: AtomicU64,
    next_tag: AtomicU64,
    /// The names loaded in every plane, where the backend has several.
    everywhere: OnceLock<Arc<LoadedNames>>,
}

impl Default for Sources {
    fn default() -> Self {
        Sources {
            by_name: RwLock::default(),
            by_agent: RwLock::default(),
            generation: AtomicU64::new(0),
            // Tags 0 and `STRANGER` are not peers'.
            next_tag: AtomicU64::new(STRANGER + 1),
            everywhere: OnceLock::new(),
        }
    }
}

impl Sources {
    /// A tag for a new peer incarnation.
    pub(super) fn next_tag(&self) -> u64 {
        self.next_tag.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Shares the names loaded in all planes (set once, by the planes).
    pub(super) fn share_names(&self, names: Arc<LoadedNames>) {
        let _ = self.everywhere.set(names);
    }

    /// The loaded peer's endpoint `name` on `rail`.
    pub(super) fn find(&self, rail: usize, name: &[u8]) -> Option<Arc<Source>> {
        self.by_name.read().get(&(rail, name.to_vec())).cloned()
    }

    /// The loaded peer `agent`.
    pub(super) fn peer(&self, agent: &str) -> Option<Arc<PeerSource>> {
        self.by_agent.read().get(agent).cloned()
    }

    /// Whether `agent` is a peer loaded here or in another plane.
    pub(super) fn is_loaded(&self, agent: &str) -> bool {
        self.by_agent.read().contains_key(agent)
            || self.everywhere.get().is_some_and(|n| n.contains(agent))
    }

    /// Whether the incarnation of `agent` loaded here is known to be over: its
    /// connection information named a process on this host, and no process with that pid
    /// and start time exists any more. A restarted peer's messages come from endpoints
    /// no load bound yet, under a name no live process holds: they are a stranger's,
    /// not a forgery of a live peer's. (A peer in another pid namespace of this host
    /// never counts as ended: its pid names another process here, or none.)
    pub(super) fn loaded_process_ended(&self, agent: &str) -> bool {
        self.peer(agent).is_some_and(|p| p.process_ended())
    }

    /// Binds `peer`'s endpoints (`(rail, name)` and where answers go), replacing what
    /// was bound for the same agent; returns that older incarnation unless it is `peer`.
    pub(super) fn bind(
        &self,
        peer: &Arc<PeerSource>,
        endpoints: Vec<(EndpointKey, FabAddr)>,
    ) -> Option<Arc<PeerSource>> {
        let mut by_name = self.by_name.write();
        let old = self
            .by_agent
            .write()
            .insert(peer.agent.clone(), peer.clone());
        by_name.retain(|_, s| s.peer.agent != peer.agent);
        for (key, reply) in endpoints {
            let source = Arc::new(Source {
                peer: peer.clone(),
                reply,
            });
            if let Some(other) = by_name.insert(key, source) {
                tracing::warn!(
                    peer = %peer.agent,
                    before = %other.peer.agent,
                    "an endpoint now belongs to another loaded peer (the newest metadata wins)"
                );
            }
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        old.filter(|o| !Arc::ptr_eq(o, peer))
    }

    /// Forgets `agent`'s endpoints; returns the peer that was bound.
    pub(super) fn unbind(&self, agent: &str) -> Option<Arc<PeerSource>> {
        let mut by_name = self.by_name.write();
        let old = self.by_agent.write().remove(agent)?;
        by_name.retain(|_, s| s.peer.agent != agent);
        self.generation.fetch_add(1, Ordering::AcqRel);
        Some(old)
    }
}

/// Loading and forgetting peers' endpoints (called from the backend's connection
/// handling).
impl LibfabricBackend {
    /// The peer `agent` as the transport will know it: the one loaded before where the
    /// connection information is the same (its heartbeats restarted: same incarnation,
    /// same advertised regions), else a new one.
    pub(super) fn peer_source(
        &self,
        agent: &str,
        info: &[u8],
        process: Option<ProcessId>,
        cma: Option<Arc<CmaPeer>>,
    ) -> Arc<PeerSource> {
        let peers = self.common.peers.read();
        if let Some(old) = peers.get(agent).filter(|p| p.conn_info == info) {
            return old.source.clone();
        }
        let tag = self.common.sources.next_tag();
        Arc::new(PeerSource::new(
            agent,
            tag,
            process,
            cma,
            agent == self.agent_name,
        ))
    }

    /// The endpoints a peer with rails `names` sends from to each local rail, and where
    /// answers to each go: the address transfers use (`addrs`), and for a peer with more
    /// rails than this backend (its rail j sends to local rail j mod rails) its other
    /// endpoints, inserted here so that the provider can name them.
    pub(super) fn source_endpoints(
        &self,
        names: &[Vec<u8>],
        addrs: &Arc<PeerAddrs>,
    ) -> Result<Vec<(EndpointKey, FabAddr)>> {
        let mut out = Vec::with_capacity(names.len().max(self.rails.len()));
        for (i, rail) in self.rails.iter().enumerate() {
            if !rail.names_senders {
                continue;
            }
            let sent_to = &names[i % names.len()];
            out.push(((i, sent_to.clone()), FabAddr::Peer(addrs.clone(), i)));
            for name in names.iter().skip(i).step_by(self.rails.len()) {
                if name == sent_to {
                    continue;
                }
                let addr = rail.av.insert(name).map_err(fabric_error)?;
                let held = Arc::new(ReplyAddr::new(
                    rail.clone(),
                    addr,
                    Some(addrs.sealer.clone()),
                ));
                out.push(((i, name.clone()), FabAddr::Reply(held)));
            }
        }
        Ok(out)
    }

    /// Binds a loaded peer's endpoints; what an older incarnation had waiting is dropped.
    pub(super) fn bind_source(
        &self,
        source: &Arc<PeerSource>,
        endpoints: Vec<(EndpointKey, FabAddr)>,
    ) {
        if let Some(old) = self.common.sources.bind(source, endpoints) {
            self.common.notifs.forget_owner(Some(old.tag));
        }
    }

    /// Forgets a peer's endpoints and what it had waiting.
    pub(super) fn unbind_source(&self, agent: &str) {
        if let Some(old) = self.common.sources.unbind(agent) {
            self.common.notifs.forget_owner(Some(old.tag));
        }
    }

    /// `agent` advertised `region` (its metadata): DRAM, which READ assists write, and
    /// VRAM with its export, which direct copies reach (module `peer_copy`).
    pub(super) fn advertise(&self, agent: &str, region: &Region, export: Option<&VramExport>) {
        let Some(peer) = self.common.sources.peer(agent) else {
            return;
        };
        match (region.kind, export) {
            (MemKind::Dram, _) => peer.advertise(region.desc.addr, region.desc.len),
            (MemKind::Vram, Some(export)) => {
                peer.vram.add(region.desc.addr, region.desc.len, *export)
            }
            _ => {}
        }
    }

    /// Shares the names loaded in every plane (see [`LoadedNames`]).
    pub(super) fn share_loaded_names(&self, names: Arc<LoadedNames>) {
        self.common.sources.share_names(names);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// A loaded peer's process is read from `/proc` at most once per
    /// [`PROCESS_LOOK_STANDS`] however often frames ask, and once seen ended it stays
    /// ended.
    #[test]
    fn a_peers_process_is_looked_at_briefly_and_an_end_is_for_good() {
        let me = ProcessId::current().unwrap();
        let start = Instant::now();
        for _ in 0..200 {
            assert!(!me.has_ended_here());
        }
        let one_look = start.elapsed() / 200;
        let alive = PeerSource::new("alive", 2, Some(me), None, false);
        let start = Instant::now();
        let (mut looks, mut last) = (0u64, 0u64);
        for _ in 0..20_000 {
            assert!(!alive.process_ended());
            let at = alive.looked_at.load(Ordering::Relaxed);
            if at != last {
                looks += 1;
                last = at;
            }
        }
        let took = start.elapsed();
        let most = took.as_nanos() / PROCESS_LOOK_STANDS.as_nanos() + 1;
        assert!(u128::from(looks) <= most, "{looks} looks, at most {most}");
        // Looking every time would have taken 20,000 looks.
        assert!(
            took < one_look * 20_000 / 4,
            "{took:?} (a look: {one_look:?})"
        );
        // A pid that names no process here: ended at the first look, and for good.
        let mut wire = Vec::new();
        me.encode(&mut wire);
        wire[21..25].copy_from_slice(&(u32::MAX - 1).to_le_bytes());
        let gone = ProcessId::decode(&wire).unwrap().unwrap();
        let ended = PeerSource::new("gone", 3, Some(gone), None, false);
        assert!(ended.process_ended());
        assert!(ended.process_ended());
        assert!(!PeerSource::new("unknown", 4, None, None, false).process_ended());
    }

    #[test]
    fn advertised_ranges_merge_and_contain() {
        let p = PeerSource::new("p", 2, None, None, false);
        assert!(!p.advertised(0x1000, 1));
        p.advertise(0x1000, 0x1000);
        p.advertise(0x3000, 0x1000);
        p.advertise(0x2000, 0x800); // touches the first: merged
        p.advertise(u64::MAX - 4, 16); // wraps: ignored
        p.advertise(0x9000, 0); // empty: ignored
        assert!(p.advertised(0x1000, 0x1800));
        assert!(p.advertised(0x3000, 0x1000));
        assert!(!p.advertised(0x1000, 0x2000), "across the gap");
        assert!(!p.advertised(0x0fff, 2), "before the start");
        assert!(!p.advertised(0x3fff, 2), "past the end");
        assert!(!p.advertised(u64::MAX - 1, 4), "wrapping");
    }
}
