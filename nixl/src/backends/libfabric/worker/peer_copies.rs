//! Direct VRAM copies (module `peer_copy`) as a rail worker sees them: serving a peer's
//! requests and answering them, taking the answers to this side's requests; and the
//! shared lanes (module `peer_dram::mailbox`) that carry a same-host peer's
//! notifications, its direct-copy requests and their answers between the two processes.
//!
//! A lane is made by the receiving side for a loaded same-host peer once it took a proven
//! notification or served a sealed request from it, and offered in a sealed message naming
//! the lane's descriptor in its process; the peer takes it with `pidfd_getfd` from the
//! process its connection information advertised (where the OS lets it reach into that
//! process: the permission cross-memory attach needs too; otherwise everything stays on
//! the rails). Notifications go through the lane still sealed, and are judged by their seal
//! as on a rail; requests go unsealed: only that peer's process holds the lane (and any
//! process that could reach into either side's memory anyway). What a rail's inbound queue
//! holds (anyone on the host can fill it) no longer delays them. A full lane is waited for,
//! as a busy rail is, so a peer's notifications keep their order; one too long for a slot
//! (4 KiB) goes on the rail. The worker that made a lane reads it each round while it
//! spins; before it sleeps it says so in the lane, and a sender that sees it sleeping rings
//! it with a sealed doorbell on the rail.

use super::{notif_mac, peer_copy, Proof, Worker};
use crate::backends::libfabric::sources::{PeerSource, Source};
use crate::backends::libfabric::stage_net::FabAddr;
use crate::backends::libfabric::xfer::NotifView;
use crate::backends::peer_dram::mailbox::Mailbox;
use fabric::Address;
use std::sync::Arc;

/// Where a served request's answer goes.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub(super) enum AnswerTo {
    /// On the rail, sealed, to the peer's endpoint.
    Rail(FabAddr),
    /// In the lane it came through (on the rail where the lane is full).
    Lane(Arc<Mailbox>, FabAddr),
}

/// A lane this worker serves: the peer it was made for, the lane, where rail answers go.
#[derive(Debug)]
pub(super) struct ServedLane {
    peer: Arc<PeerSource>,
    lane: Arc<Mailbox>,
    /// Where the answers to its requests go when the lane is full.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    reply: FabAddr,
}

impl Worker {
    /// Starts the copies a peer asked for (or declines: see `peer_copy`'s checks); the
    /// answer goes once they completed.
    pub(super) fn serve_peer_copy(
        &mut self,
        request: &peer_copy::Request,
        proof: &Proof,
        src: Option<Address>,
    ) {
        let read = peer_copy::trace::request_read();
        let stats = &self.common.peer_copy.stats;
        let (errno, answer_to) = match proof {
            Proof::Peer(peer) => match self.common.sources.find(self.index, &request.reply_to) {
                // Only GPUNETIO's control connections carry a notification in a request
                // (this backend's go on its rails after the answer): declined, so the
                // transfer runs its ordinary path and its notification with it.
                Some(s) if Arc::ptr_eq(&s.peer, peer) && request.notif.is_some() => (
                    stats.refuse(
                        libc::EOPNOTSUPP,
                        format_args!("a request carrying a notification"),
                    ),
                    Some(s.reply.clone()),
                ),
                Some(s) if Arc::ptr_eq(&s.peer, peer) => {
                    match self.start_serving(request, &s, read) {
                        Ok(()) => {
                            self.offer_lane(&s);
                            return;
                        }
                        Err(errno) => (errno, Some(s.reply.clone())),
                    }
                }
                _ => (
                    stats.refuse(
                        libc::EPERM,
                        format_args!("it names none of its sender's endpoints on this rail"),
                    ),
                    None,
                ),
            },
            _ => (
                stats.refuse(libc::EPERM, format_args!("no loaded peer sealed it")),
                None,
            ),
        };
        let done = peer_copy::Done::unstarted(request.id, errno, read);
        let sender = self.control_sender(proof, src);
        self.answer(
            answer_to,
            &sender,
            &request.reply_to,
            done.encode(),
            "a direct copy's",
        );
    }

    /// Checks and queues a request's copies (`Err`: the answer's errno).
    #[cfg(feature = "cuda")]
    fn start_serving(
        &mut self,
        request: &peer_copy::Request,
        source: &Source,
        read: u64,
    ) -> std::result::Result<(), i32> {
        self.queue_copies(
            request,
            &source.peer,
            AnswerTo::Rail(source.reply.clone()),
            read,
        )
    }

    /// Checks `peer`'s request and queues its copies, whose answer goes to `answer_to`.
    #[cfg(feature = "cuda")]
    fn queue_copies(
        &mut self,
        request: &peer_copy::Request,
        peer: &Arc<PeerSource>,
        answer_to: AnswerTo,
        read: u64,
    ) -> std::result::Result<(), i32> {
        let shared = &self.common.peer_copy;
        let Some(server) = &shared.server else {
            return Err(libc::EOPNOTSUPP);
        };
        let serving = server.serve(request, &**peer, &shared.stats)?;
        let stamps = peer_copy::trace::TargetStamps {
            read,
            launched: peer_copy::trace::stamp(),
            ..Default::default()
        };
        self.serving.push((serving, answer_to, request.id, stamps));
        Ok(())
    }

    /// Without CUDA nothing is served this way.
    #[cfg(not(feature = "cuda"))]
    fn start_serving(
        &mut self,
        _request: &peer_copy::Request,
        _source: &Source,
        _read: u64,
    ) -> std::result::Result<(), i32> {
        Err(libc::EOPNOTSUPP)
    }

    /// Answers the requests whose copies completed.
    #[cfg(feature = "cuda")]
    pub(super) fn poll_serving(&mut self) {
        let stats = &self.common.peer_copy.stats;
        let mut i = 0;
        while i < self.serving.len() {
            match self.serving[i].0.poll(stats) {
                Some(errno) => {
                    let complete = peer_copy::trace::stamp();
                    let (serving, answer_to, id, stamps) = self.serving.swap_remove(i);
                    // The copies are done (or failed): the mappings and guards may go.
                    drop(serving);
                    // Where tracing, "answered" is when the answer is queued (it is
                    // sent at the end of this pass).
                    let trace = peer_copy::trace::on().then(|| peer_copy::trace::TargetStamps {
                        complete,
                        answered: peer_copy::trace::now_ns(),
                        ..stamps
                    });
                    let done = peer_copy::Done { id, errno, trace }.encode();
                    match answer_to {
                        AnswerTo::Lane(lane, _) if lane.push_answer(&done) => {}
                        AnswerTo::Lane(_, dest) | AnswerTo::Rail(dest) => {
                            self.replies.push_back((dest, done))
                        }
                    }
                }
                None => i += 1,
            }
        }
        if !self.replies.is_empty() {
            self.send_replies();
        }
    }

    /// An answer to a direct copy request of this backend: taken only where sealed by a
    /// loaded peer, and then only for a request that went to it.
    pub(super) fn peer_copy_done(&mut self, done: peer_copy::Done, proof: &Proof) {
        let from = match proof {
            Proof::Peer(peer) => Some(peer.agent.clone()),
            _ => {
                self.refuse_control(format_args!(
                    "a direct copy answer sealed by no loaded peer (id {})",
                    done.id
                ));
                return;
            }
        };
        match self.common.peer_copy.waits.take(done.id, from.as_deref()) {
            Some(run) => {
                run.answer_done(&done);
                peer_copy::trace::since_received(peer_copy::trace::Step::AnswerReceivedToRead);
            }
            None => tracing::debug!(id = done.id, "a direct copy answer for no waiting request"),
        }
    }

    /// Makes a lane for the loaded peer `source` names (whose request this side served,
    /// or whose proven notification it took), once, and offers it (sealed, on the rail):
    /// only for another process of this host and pid namespace, which can take a
    /// descriptor from this one.
    pub(super) fn offer_lane(&mut self, source: &Source) {
        let peer = &source.peer;
        if peer.served_lane.get().is_some()
            || peer.is_self
            || peer.process.as_ref().and_then(|p| p.local_pid()).is_none()
        {
            return;
        }
        let lane = match Mailbox::create() {
            Ok(lane) => Arc::new(lane),
            Err(e) => {
                tracing::debug!(peer = %peer.agent, "no shared lane for the peer: {e}");
                return;
            }
        };
        let Some(fd) = lane.fd() else {
            return;
        };
        if peer.served_lane.set(lane.clone()).is_err() {
            return;
        }
        self.replies
            .push_back((source.reply.clone(), peer_copy::encode_lane(fd)));
        self.send_replies();
        self.lanes.push(ServedLane {
            peer: peer.clone(),
            lane,
            reply: source.reply.clone(),
        });
    }

    /// Takes the lane a loaded peer offered (sealed by it) from its process, for what
    /// this side sends it (the addresses of that peer's load).
    pub(super) fn take_lane(&mut self, fd: i32, proof: &Proof) {
        let Proof::Peer(peer) = proof else {
            self.refuse_control(format_args!("a lane offer sealed by no loaded peer"));
            return;
        };
        let addrs = self
            .common
            .peers
            .read()
            .get(&peer.agent)
            .filter(|p| Arc::ptr_eq(&p.source, peer))
            .map(|p| p.addrs.clone());
        let Some(addrs) = addrs.filter(|a| a.lane.get().is_none()) else {
            return;
        };
        let Some(process) = &peer.process else {
            return;
        };
        let taken = process
            .take_fd(fd)
            .map_err(|e| e.to_string())
            .and_then(|fd| Mailbox::take(fd).map_err(|e| e.to_string()));
        match taken {
            Ok(lane) => {
                let _ = addrs.lane.set((Arc::new(lane), self.index));
            }
            Err(e) => tracing::info!(
                peer = %peer.agent,
                "messages to the peer stay on the rails (its shared lane: {e})"
            ),
        }
    }

    /// Serves the requests and notifications waiting in the lanes this worker made;
    /// whether there were any. A lane whose peer was unloaded or reloaded, or which its
    /// peer broke, goes.
    pub(super) fn serve_lanes(&mut self) -> bool {
        let generation = self.common.sources.generation();
        if generation != self.lanes_generation {
            self.lanes_generation = generation;
            let sources = &self.common.sources;
            let mut gone = Vec::new();
            self.lanes.retain(|l| {
                let current = sources
                    .peer(&l.peer.agent)
                    .is_some_and(|p| Arc::ptr_eq(&p, &l.peer));
                if !current {
                    gone.push(l.lane.clone());
                }
                current
            });
            for lane in gone {
                self.close_lane(&lane);
            }
        }
        let mut any = false;
        let mut buf = std::mem::take(&mut self.lane_buf);
        for i in 0..self.lanes.len() {
            let lane = self.lanes[i].lane.clone();
            match lane.take_requests(&mut buf, |entry| self.serve_lane_request(i, entry)) {
                Ok(0) => {}
                Ok(_) => {
                    // The peer has taken the lane: this side's descriptor may go.
                    lane.release_fd();
                    any = true;
                }
                Err(e) => {
                    let peer = &self.lanes[i].peer.agent;
                    tracing::warn!(peer = %peer, "{e}; its requests come on the rails");
                }
            }
        }
        self.lane_buf = buf;
        self.lanes.retain(|l| !l.lane.is_broken());
        any
    }

    /// A lane whose peer was unloaded or reloaded: closed (its sender's messages go on
    /// the rails from now). What waits in it is judged as if it came on a rail
    /// (notifications: by their seal), requests declined, so that no transfer waits for
    /// an answer that never comes (the initiator runs them the ordinary way).
    fn close_lane(&mut self, lane: &Mailbox) {
        lane.close();
        lane.release_fd();
        let mut buf = Vec::new();
        while let Ok(true) = lane.pop_request(&mut buf) {
            if buf.starts_with(notif_mac::SEALED_MAGIC) {
                self.lane_notification(&buf);
            } else if let Ok(peer_copy::Message::Request(r)) = peer_copy::decode(&buf) {
                let done = peer_copy::Done {
                    id: r.id,
                    errno: libc::ESRCH,
                    trace: None,
                };
                lane.push_answer(&done.encode());
            }
        }
    }

    /// A sealed notification from a lane: judged by its seal, as one from a rail is
    /// (whose endpoint it came from says nothing more: a lane has none).
    fn lane_notification(&mut self, bytes: &[u8]) {
        let Some(frame) = notif_mac::Sealed::split(bytes) else {
            return self.drop_malformed("sealed notification", &"truncated seal");
        };
        match NotifView::parse(frame.inner) {
            Some(notif) => self.notification(None, Some(&frame), &notif),
            None => self.drop_malformed("notification", &"malformed notification"),
        }
    }

    /// One entry of lane `i`: a sealed notification, or (with CUDA) a direct copy
    /// request, which is that lane's peer's.
    fn serve_lane_request(&mut self, i: usize, bytes: &[u8]) {
        if bytes.starts_with(notif_mac::SEALED_MAGIC) {
            return self.lane_notification(bytes);
        }
        #[cfg(feature = "cuda")]
        self.serve_lane_copy(i, bytes);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = i;
            self.drop_malformed("lane entry", &"not a notification");
        }
    }

    /// A direct copy request from lane `i`.
    #[cfg(feature = "cuda")]
    fn serve_lane_copy(&mut self, i: usize, bytes: &[u8]) {
        let (peer, lane, reply) = {
            let l = &self.lanes[i];
            (l.peer.clone(), l.lane.clone(), l.reply.clone())
        };
        let request = match peer_copy::decode(bytes) {
            Ok(peer_copy::Message::Request(r)) => r,
            Ok(_) => return self.drop_malformed("lane entry", &"not a request"),
            Err(e) => return self.drop_malformed("lane request", &e),
        };
        let read = peer_copy::trace::request_read();
        let errno = if request.notif.is_some() {
            self.common.peer_copy.stats.refuse(
                libc::EOPNOTSUPP,
                format_args!("a request carrying a notification"),
            )
        } else {
            match self.queue_copies(
                &request,
                &peer,
                AnswerTo::Lane(lane.clone(), reply.clone()),
                read,
            ) {
                Ok(()) => return,
                Err(errno) => errno,
            }
        };
        let done = peer_copy::Done::unstarted(request.id, errno, read).encode();
        if !lane.push_answer(&done) {
            self.replies.push_back((reply, done));
            self.send_replies();
        }
    }

    /// Before the worker sleeps: each lane says so, and is looked at once more (a
    /// request pushed meanwhile is then seen, or its initiator rings). Returns whether a
    /// request waits (the worker then does not sleep).
    pub(super) fn lanes_going_to_sleep(&self) -> bool {
        for l in &self.lanes {
            l.lane.set_asleep(true);
        }
        self.lanes.iter().any(|l| l.lane.has_request())
    }

    /// After the worker woke.
    pub(super) fn lanes_awake(&self) {
        for l in &self.lanes {
            l.lane.set_asleep(false);
        }
    }
}
