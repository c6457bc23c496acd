//! The initiator's side of direct VRAM ↔ peer DRAM copies (see `peer_copy`): choosing
//! the path when a transfer is prepared, and the prepared transfer, with the ordinary
//! transfer beside it as the fallback.

use super::notif_mac;
use super::peer_copy::{
    choose, cut, encode_request, home_gpu, pieces_per_request, plan_requests, Case, Direction,
    PairFacts, Piece, PieceHome, RunState, STREAMS,
};
use super::worker::Progress;
use super::xfer::{encode_notif, send_message_blocking, FabricXfer, XferShared};
use super::{
    fabric_error, FabricLocalMd, FabricRemoteMd, LibfabricBackend, NotifKeys, Peer, PeerAddrs,
    Rail, NAME,
};
use crate::backend::{BackendXfer, PostParams, XferEntry, XferOp, XferProgress, XferStatus};
use crate::backends::cuda_copy::{Copy, CopyEngine, GpuXfer, MemLoc, NotifSink};
use crate::backends::peer_dram::mailbox::Mailbox;
use crate::backends::peer_dram::{decode, trace, Message};
use crate::error::{Error, Result};
use crate::mem::MemKind;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a post waits for a rail to take a request.
const SEND_DEADLINE: Duration = Duration::from_secs(5);
/// How long releasing a transfer waits for the peer's answers to requests in flight (the
/// peer may still be copying into this process's VRAM).
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// A transfer prepared for the direct path.
#[derive(Debug)]
pub(super) enum Direct {
    /// Host memory here: this process copies ([`GpuXfer`] on its own streams).
    Local { xfer: GpuXfer, bytes: u64 },
    /// Host memory at the peer: the peer copies on request.
    Remote(RemotePlan),
}

/// The requests one post sends.
#[derive(Debug)]
pub(super) struct RemotePlan {
    direction: Direction,
    /// (rail, pieces) per request.
    requests: Vec<(usize, Vec<Piece>)>,
    /// Each rail's endpoint name (where a refusal goes).
    names: Vec<Vec<u8>>,
    bytes: u64,
    /// The current post.
    run: Option<Arc<RunState>>,
    ids: Vec<u64>,
    notif: Option<Vec<u8>>,
    /// The requests' encoding, reused by every post.
    scratch: Vec<u8>,
    /// Where tracing (`peer_copy::trace`): the current post's stamps.
    stamps: trace::PostStamps,
    /// The peer's shared lane (module `worker::peer_copies`) and the rail that rings it,
    /// as of the current post.
    lane: Option<(Arc<Mailbox>, usize)>,
    /// An answer copied out of the lane.
    answer: Vec<u8>,
}

impl LibfabricBackend {
    /// The direct path for this transfer, where it fits as a whole (see `peer_copy`'s
    /// "Choice and fallback"); `None`: the ordinary path.
    pub(super) fn prep_peer_copy(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        peer: &Peer,
        fallback: &FabricXfer,
    ) -> Result<Option<Direct>> {
        let mut facts = Vec::with_capacity(entries.len());
        for e in entries {
            let (local, remote) = e.metadata::<FabricLocalMd, FabricRemoteMd>(NAME)?;
            facts.push(PairFacts {
                local: e.local_region.kind,
                remote: e.remote_region.kind,
                local_exported: local.peer.export.is_some(),
                remote_exported: remote
                    .vram_export
                    .is_some_and(|x| x.holds(e.remote_region.desc.len)),
            });
        }
        match choose(
            self.common.peer_copy.enabled,
            peer.same_host,
            peer.serves_peer_copies,
            facts,
        ) {
            Some(Case::InitiatorOwned) => self.prep_local(op, entries, peer, fallback),
            Some(Case::TargetOwned) => self.prep_remote(op, entries),
            None => Ok(None),
        }
    }

    /// DRAM here, the peer's VRAM imported: this process copies.
    fn prep_local(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        peer: &Peer,
        fallback: &FabricXfer,
    ) -> Result<Option<Direct>> {
        let mut copies = Vec::new();
        let mut keep: Vec<Arc<dyn std::any::Any + Send + Sync>> = Vec::new();
        let mut bytes = 0;
        for e in entries {
            let (local, remote) = e.metadata::<FabricLocalMd, FabricRemoteMd>(NAME)?;
            let (MemKind::Dram, MemKind::Vram, Some(pin), Some(export)) = (
                e.local_region.kind,
                e.remote_region.kind,
                local.peer.pin.as_ref(),
                remote.vram_export.as_ref(),
            ) else {
                return Ok(None);
            };
            if !export.holds(e.remote_region.desc.len) {
                return Ok(None);
            }
            let Some(gpu) = home_gpu(export) else {
                return Ok(None);
            };
            let mapping = match peer.source.imports.get(&gpu, export) {
                Ok(m) => m,
                Err(err) => {
                    tracing::info!(
                        peer = %peer.source.agent,
                        "{NAME}: the peer's VRAM does not import here ({err}): staged instead"
                    );
                    return Ok(None);
                }
            };
            let at = export.offset + (e.remote.addr - e.remote_region.desc.addr);
            if at
                .checked_add(e.local.len)
                .is_none_or(|end| end > mapping.len())
            {
                return Ok(None);
            }
            let device = MemLoc::Gpu(gpu.ordinal());
            // Pieces of at most PIECE_BYTES, cut again where the DRAM's pinned chunks end
            // (a copy spanning two registrations would not be a pinned copy).
            let runs = cut(e.local.len).flat_map(|(off, len)| {
                pin.runs(e.local.addr + off, len)
                    .map(move |(o, n)| (off + o, n))
            });
            for (off, len) in runs {
                let vram = mapping.ptr() + at + off;
                let dram = e.local.addr + off;
                let host = MemLoc::Host {
                    pinned: pin.ensure_at(dram),
                };
                copies.push((
                    gpu.ordinal(),
                    match op {
                        XferOp::Write => Copy {
                            dst: vram,
                            src: dram,
                            len: len as usize,
                            dst_loc: device,
                            src_loc: host,
                        },
                        XferOp::Read => Copy {
                            dst: dram,
                            src: vram,
                            len: len as usize,
                            dst_loc: host,
                            src_loc: device,
                        },
                    },
                ));
            }
            bytes += e.local.len;
            if !keep.iter().any(|k| {
                k.downcast_ref::<gpu_mem::IpcMapping>()
                    .is_some_and(|m| m.ptr() == mapping.ptr())
            }) {
                keep.push(mapping);
            }
        }
        let sink = Arc::new(NotifAfterCopies {
            rail0: fallback.rails[0].clone(),
            peer: fallback.peer.clone(),
            progress: fallback.progress.clone(),
            sender: self.agent_name.clone(),
            keys: self.keys.clone(),
            health: fallback.shared.clone(),
        });
        let xfer = GpuXfer::new(
            &self.common.peer_copy.streams,
            copies,
            STREAMS,
            CopyEngine::Memcpy,
            sink,
            keep,
        )?;
        Ok(Some(Direct::Local { xfer, bytes }))
    }

    /// VRAM here, DRAM at the peer: the peer copies on request.
    fn prep_remote(&self, op: XferOp, entries: &[XferEntry<'_>]) -> Result<Option<Direct>> {
        let names = self
            .rails
            .iter()
            .map(|r| r.ep.name().map_err(fabric_error))
            .collect::<Result<Vec<_>>>()?;
        let per_request = self
            .rails
            .iter()
            .zip(&names)
            // The request goes sealed (module `notif_mac`): its seal takes room too.
            .map(|(r, n)| {
                let seal = notif_mac::CONTROL_OVERHEAD + self.agent_name.len();
                pieces_per_request(r.inject_size.saturating_sub(seal), n.len())
            })
            .min()
            .unwrap_or(0);
        if per_request == 0 {
            return Ok(None);
        }
        let mut pieces = Vec::new();
        let mut bytes = 0;
        for e in entries {
            let (local, _) = e.metadata::<FabricLocalMd, FabricRemoteMd>(NAME)?;
            let Some(export) = local.peer.export.as_ref() else {
                return Ok(None);
            };
            let home = PieceHome {
                handle: export.handle,
                vram_region: e.local_region.desc.addr,
                dram_region: e.remote_region.desc.addr,
            };
            for (off, len) in cut(e.local.len) {
                pieces.push((
                    home,
                    Piece {
                        vram: e.local.addr + off,
                        dram: e.remote.addr + off,
                        len,
                    },
                ));
            }
            bytes += e.local.len;
        }
        let requests = plan_requests(
            pieces,
            per_request,
            self.rails.len(),
            self.next_rail.fetch_add(1, Ordering::Relaxed),
        );
        Ok(Some(Direct::Remote(RemotePlan {
            direction: match op {
                XferOp::Write => Direction::ToDram,
                XferOp::Read => Direction::ToVram,
            },
            requests,
            names,
            bytes,
            run: None,
            ids: Vec::new(),
            notif: None,
            scratch: Vec::new(),
            stamps: trace::PostStamps::default(),
            lane: None,
            answer: Vec::new(),
        })))
    }
}

/// Sends the notification once the copies of a transfer completed (an ordinary
/// notification message counting no data: the bytes are in place).
#[derive(Debug)]
struct NotifAfterCopies {
    rail0: Arc<Rail>,
    peer: Arc<PeerAddrs>,
    progress: Arc<Progress>,
    sender: String,
    keys: Arc<NotifKeys>,
    /// The peer's process and heartbeats.
    health: Arc<XferShared>,
}

impl NotifSink for NotifAfterCopies {
    fn deliver(&self, msg: Vec<u8>) -> Result<()> {
        self.health.peer_alive()?;
        let message = encode_notif(&self.sender, self.keys.next(), 0, &msg)?;
        send_message_blocking(&self.rail0, self.peer.clone(), &message, &self.progress)
    }
    fn alive(&self) -> Result<()> {
        self.health.peer_alive()
    }
}

/// A transfer prepared for the direct path, with the ordinary one beside it for a peer
/// that declines.
#[derive(Debug)]
pub(super) struct PeerCopyXfer {
    direct: Direct,
    fallback: FabricXfer,
    /// The peer declined: this post and every later one run the fallback.
    on_fallback: bool,
    common: Arc<super::Common>,
    /// Bytes of the current post are counted once.
    counted: bool,
}

impl PeerCopyXfer {
    pub(super) fn new(direct: Direct, fallback: FabricXfer, common: Arc<super::Common>) -> Self {
        PeerCopyXfer {
            direct,
            fallback,
            on_fallback: false,
            common,
            counted: false,
        }
    }

    /// Sends the current post's requests.
    fn send_requests(&mut self, notif: Option<&[u8]>) -> Result<()> {
        let Direct::Remote(plan) = &mut self.direct else {
            return Ok(());
        };
        let posted = trace::stamp();
        let waits = &self.common.peer_copy.waits;
        waits.forget(&plan.ids);
        plan.ids.clear();
        let run = Arc::new(RunState::new(&self.fallback.agent, plan.requests.len()));
        plan.run = Some(run.clone());
        plan.notif = notif.map(<[u8]>::to_vec);
        if plan.lane.is_none() {
            plan.lane = self.fallback.peer.lane.get().cloned();
        }
        for (rail, pieces) in &plan.requests {
            let id = waits.add(&run);
            plan.ids.push(id);
            // One buffer for every request of the transfer: no allocation per post.
            let message = &mut plan.scratch;
            message.clear();
            encode_request(
                message,
                id,
                plan.direction,
                pieces,
                &plan.names[*rail],
                None,
            );
            if let Some((lane, ring_rail)) = &plan.lane {
                // Only the peer's process holds the lane: nothing to seal.
                if lane.push_request(message) {
                    self.common
                        .peer_copy
                        .stats
                        .lane_requests
                        .fetch_add(1, Ordering::Relaxed);
                    if lane.target_asleep() {
                        if let Err(e) = self.fallback.peer.ring_lane(*ring_rail) {
                            waits.forget(&plan.ids);
                            plan.run = None;
                            return Err(fabric_error(e));
                        }
                    }
                    continue;
                }
            }
            // Sealed for the peer, which acts only on what its key proves.
            let message = &self.fallback.peer.sealer.seal_control(message);
            let r = &self.fallback.rails[*rail];
            let dest = self.fallback.peer.addrs[*rail];
            let deadline = Instant::now() + SEND_DEADLINE;
            if let Err(e) = r.ep.retry(deadline, || r.ep.inject(message, dest)) {
                waits.forget(&plan.ids);
                plan.run = None;
                return Err(fabric_error(e));
            }
        }
        plan.stamps = trace::PostStamps {
            posted,
            sent: trace::stamp(),
            ..Default::default()
        };
        self.fallback.progress.poll_inline();
        Ok(())
    }

    /// Polls the current post's requests.
    fn check_remote(&mut self) -> Result<XferProgress> {
        let Direct::Remote(plan) = &mut self.direct else {
            return Err(Error::Backend {
                backend: NAME.into(),
                code: 0,
                message: "a direct transfer checked as remote".into(),
            });
        };
        self.fallback.progress.poll_inline();
        read_lane_answers(plan, &self.common.peer_copy.waits, &self.fallback.agent);
        let Some(run) = plan.run.clone() else {
            return Ok(XferProgress {
                status: XferStatus::Done,
                completed_ops: 0,
            });
        };
        let answered = run.answered.load(Ordering::Relaxed);
        let in_progress = XferProgress {
            status: XferStatus::InProgress,
            completed_ops: answered,
        };
        if let Some((code, text)) = run.failed.lock().clone() {
            self.common.peer_copy.waits.forget(&plan.ids);
            plan.run = None;
            self.fallback.peer_alive()?;
            return Err(Error::Backend {
                backend: NAME.into(),
                code,
                message: format!("transfer to `{}`: {text}", self.fallback.agent),
            });
        }
        if run.pending.load(Ordering::Acquire) > 0 {
            if let Err(e) = self.fallback.peer_alive() {
                self.common.peer_copy.waits.forget(&plan.ids);
                plan.run = None;
                return Err(e);
            }
            return Ok(in_progress);
        }
        if run.declined.load(Ordering::Acquire) {
            // The peer will not copy: the ordinary path, now and for later posts.
            plan.run = None;
            let notif = plan.notif.take();
            self.on_fallback = true;
            self.common
                .peer_copy
                .stats
                .fallbacks
                .fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                peer = %self.fallback.agent,
                "{NAME}: the peer declined direct VRAM copies; this request runs staged"
            );
            self.fallback
                .post(notif.as_deref(), &PostParams::default())?;
            return Ok(in_progress);
        }
        if let Some(msg) = plan.notif.take() {
            // Every answer is in: the bytes are in place at the peer.
            self.fallback.peer_alive()?;
            let message =
                encode_notif(&self.fallback.self_name, self.fallback.keys.next(), 0, &msg)?;
            send_message_blocking(
                &self.fallback.rails[0],
                self.fallback.peer.clone(),
                &message,
                &self.fallback.progress,
            )?;
        }
        if trace::on() && plan.requests.len() == 1 {
            let post = trace::PostStamps {
                answer_read: run.answer_read.load(Ordering::Relaxed),
                notified: trace::now_ns(),
                ..plan.stamps
            };
            let done = trace::PostStamps {
                done: trace::now_ns(),
                ..post
            };
            trace::record(&done, &run.target_trace());
        }
        plan.run = None;
        plan.ids.clear();
        self.common
            .peer_copy
            .stats
            .bytes
            .fetch_add(plan.bytes, Ordering::Relaxed);
        Ok(XferProgress {
            status: XferStatus::Done,
            completed_ops: answered,
        })
    }
}

/// Takes the answers waiting in the peer's lane (to any request of this backend's to
/// that peer: each goes to its waiting request, as one from the rails would).
fn read_lane_answers(plan: &mut RemotePlan, waits: &super::peer_copy::Waits, agent: &str) {
    let Some((lane, _)) = &plan.lane else {
        return;
    };
    loop {
        match lane.pop_answer(&mut plan.answer) {
            Ok(true) => {
                trace::mark_received();
                match decode(&plan.answer) {
                    Ok(Message::Done(done)) => {
                        if let Some(run) = waits.take(done.id, Some(agent)) {
                            run.answer_done(&done);
                            trace::since_received(trace::Step::AnswerReceivedToRead);
                        }
                    }
                    other => tracing::debug!("{NAME}: not an answer in the lane: {other:?}"),
                }
            }
            Ok(false) => return,
            // Broken by the peer: its answers come on the rails from now.
            Err(_) => {
                plan.lane = None;
                return;
            }
        }
    }
}

impl BackendXfer for PeerCopyXfer {
    fn post(&mut self, notif: Option<&[u8]>, params: &PostParams) -> Result<XferStatus> {
        if self.on_fallback {
            return self.fallback.post(notif, params);
        }
        if let Err(e) = self.fallback.peer_alive() {
            self.fallback.peer.settle_if_ended();
            return Err(e);
        }
        self.counted = false;
        match &mut self.direct {
            Direct::Local { xfer, .. } => xfer.post(notif, params),
            Direct::Remote(_) => {
                self.send_requests(notif)?;
                Ok(XferStatus::InProgress)
            }
        }
    }

    fn check(&mut self) -> Result<XferProgress> {
        if self.on_fallback {
            return self.fallback.check();
        }
        match &mut self.direct {
            Direct::Local { xfer, bytes } => {
                let progress = match xfer.check() {
                    Ok(p) => p,
                    // A copy into the VRAM of a process that ended: its death.
                    Err(Error::Gpu(text)) if self.fallback.peer_alive().is_err() => {
                        return Err(Error::RemoteDisconnect {
                            agent: self.fallback.agent.clone(),
                            reason: text,
                        })
                    }
                    Err(e) => return Err(e),
                };
                if progress.status == XferStatus::Done && !self.counted {
                    self.counted = true;
                    self.common
                        .peer_copy
                        .stats
                        .bytes
                        .fetch_add(*bytes, Ordering::Relaxed);
                }
                Ok(progress)
            }
            Direct::Remote(_) => self.check_remote(),
        }
    }

    fn op_count(&self) -> usize {
        if self.on_fallback {
            return self.fallback.op_count();
        }
        match &self.direct {
            Direct::Local { xfer, .. } => xfer.op_count(),
            Direct::Remote(plan) => plan.requests.iter().map(|(_, p)| p.len()).sum(),
        }
    }

    fn staged_bytes(&self) -> u64 {
        if self.on_fallback {
            self.fallback.staged_bytes()
        } else {
            0
        }
    }
}

impl Drop for PeerCopyXfer {
    fn drop(&mut self) {
        let Direct::Remote(plan) = &mut self.direct else {
            // A local batch waits for its copies when dropped.
            return;
        };
        if let Some(run) = plan.run.take() {
            // The peer may still be copying into this process's VRAM: wait (bounded) for
            // its answers while it lives.
            let deadline = Instant::now() + RELEASE_WAIT;
            while run.pending.load(Ordering::Acquire) > 0
                && self.fallback.peer_alive().is_ok()
                && Instant::now() < deadline
            {
                self.fallback.progress.poll_inline();
                read_lane_answers(plan, &self.common.peer_copy.waits, &self.fallback.agent);
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        self.common.peer_copy.waits.forget(&plan.ids);
    }
}
