//! The target side of the engine: requests (OFFER, FETCH) checked against the staged
//! regions, queued for a serve slot, served — RMA into the slot and a copy into the
//! region, or a copy out of the region and RMA back with CQ data — and answered.

use super::{
    CopyOp, Ctrl, Engine, NetError, Owner, Request, Serve, ServeStage, StageNet, FETCH_DATA,
    MAX_NET_OPS, STATUS_FAILED, STATUS_INVALID, STATUS_OK,
};
use std::fmt::Debug;

impl<A: Clone + Debug + Send, S: Clone + Debug + Send> Engine<A, S> {
    /// Checks a request against the staged regions; returns the GPU of its memory.
    pub(super) fn validate(&self, req: &Request) -> std::result::Result<Option<usize>, String> {
        let total: u64 = req.pieces.iter().map(|p| u64::from(p.len)).sum();
        if total > self.cfg.chunk as u64 {
            return Err(format!(
                "{total} bytes in one chunk, slots here hold {}",
                self.cfg.chunk
            ));
        }
        if self.bounce.is_none() {
            return Err("nothing is staged here".into());
        }
        let mut dev = None;
        for (i, p) in req.pieces.iter().enumerate() {
            let end = p.target + u64::from(p.len);
            let Some(region) = self
                .regions
                .iter()
                .find(|r| r.start <= p.target && end <= r.end)
            else {
                return Err(format!(
                    "piece {i} ({:#x}+{}) is not inside a staged registration",
                    p.target, p.len
                ));
            };
            if i == 0 {
                dev = region.dev;
            } else if dev != region.dev {
                return Err("pieces of one chunk on different devices".into());
            }
        }
        Ok(dev)
    }

    pub(super) fn on_request<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        rail: usize,
        sender: &S,
        offer: bool,
        req: Request,
    ) {
        let rail = rail % net.rails().max(1);
        // The requester's address must be the sender's own: this side reads from and
        // writes to it, and answers there.
        let from = match net.resolve(rail, &req.reply_to, sender) {
            Ok(a) => a,
            Err(f) => {
                return self.refuse(
                    sender,
                    format_args!("a request whose requester cannot be reached: {}", f.text),
                );
            }
        };
        match self.validate(&req) {
            Ok(dev) => {
                let id = self.id();
                self.serves.push_back(Serve {
                    id,
                    offer,
                    rail,
                    from,
                    sender: sender.clone(),
                    req,
                    dev,
                    slot: None,
                    stage: ServeStage::Queued,
                    ops: 0,
                    failed: false,
                });
            }
            Err(why) => {
                tracing::warn!(reason = %why, "staging: request refused");
                self.reply(rail, from, req.token, STATUS_INVALID, &why);
            }
        }
    }

    pub(super) fn reply(&mut self, rail: usize, to: A, token: u64, status: i32, reason: &str) {
        let msg = Ctrl::Done {
            token,
            status,
            reason: reason.to_string(),
        }
        .encode()
        .expect("a DONE always encodes");
        self.replies.push_back((rail, to, msg));
    }

    /// Queues the answer to a served FETCH ([`StageNet::fetch_answered`]): its piece
    /// and byte counts, which the requester checks against what it asked for.
    fn answer_fetch(&mut self, s: &Serve<A, S>) {
        let bytes = s.req.pieces.iter().map(|p| u64::from(p.len)).sum();
        let pieces = u16::try_from(s.req.pieces.len()).unwrap_or(u16::MAX);
        let answer = Ctrl::Fetched {
            token: s.req.token,
            pieces,
            bytes,
        };
        match answer.encode() {
            Ok(msg) => self.replies.push_back((s.rail, s.from.clone(), msg)),
            // Unreachable for a request that decoded; the requester's stall detection
            // ends its transfer.
            Err(e) => tracing::warn!(error = %e, "staging: a FETCH's answer did not encode"),
        }
    }

    pub(super) fn send_replies<N: StageNet<Addr = A, Sender = S>>(&mut self, net: &N) {
        while let Some((rail, to, msg)) = self.replies.pop_front() {
            let op = self.id();
            match net.send(rail, &to, &msg, op) {
                Ok(completes) => {
                    if completes {
                        self.owners.insert(op, Owner::Reply);
                    }
                }
                Err(NetError::Busy) => {
                    self.replies.push_front((rail, to, msg));
                    self.blocked = true;
                    return;
                }
                Err(NetError::Failed(f)) => {
                    tracing::debug!(error = %f.text, "staging: a DONE reply could not be sent");
                }
            }
        }
    }

    pub(super) fn progress_serves<N: StageNet<Addr = A, Sender = S>>(&mut self, net: &N) {
        let mut i = 0;
        while i < self.serves.len() {
            let mut s = self.serves.remove(i).expect("index in range");
            let keep = self.advance_serve(net, &mut s);
            if keep {
                self.serves.insert(i, s);
                i += 1;
            } else if let Some(slot) = s.slot {
                self.serve_slots.release(slot);
            }
        }
    }

    /// Moves a served request on; `false` when it is finished (its slot may go).
    pub(super) fn advance_serve<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        s: &mut Serve<A, S>,
    ) -> bool {
        loop {
            if s.failed {
                if let ServeStage::Copy { ticket } = s.stage {
                    if let Ok(false) = self.poll_copy(ticket) {
                        return true;
                    }
                    s.stage = ServeStage::Net { next: 0, left: 0 };
                }
                if s.ops > 0 {
                    return true;
                }
                let (rail, from, token) = (s.rail, s.from.clone(), s.req.token);
                self.reply(rail, from, token, STATUS_FAILED, "an operation failed");
                return false;
            }
            match s.stage {
                ServeStage::Queued => {
                    let Some(slot) = self.serve_slots.acquire() else {
                        return true;
                    };
                    s.slot = Some(slot);
                    if s.offer {
                        s.stage = ServeStage::Net {
                            next: 0,
                            left: s.req.pieces.len(),
                        };
                    } else if !self.serve_copy(s) {
                        continue;
                    }
                }
                ServeStage::Net { next, left } => {
                    if next < s.req.pieces.len() {
                        if !self.serve_post(net, s) {
                            return true;
                        }
                        continue;
                    }
                    if left > 0 {
                        return true;
                    }
                    if s.offer {
                        if !self.serve_copy(s) {
                            continue;
                        }
                    } else {
                        // FETCH: every piece was written with its CQ data (and, where
                        // the transport answers FETCHes, delivered: its writes complete
                        // only then), which the answer says.
                        if net.fetch_answered() {
                            self.answer_fetch(s);
                        }
                        return false;
                    }
                }
                ServeStage::Copy { ticket } => match self.poll_copy(ticket) {
                    Ok(false) => return true,
                    Ok(true) => {
                        if s.offer {
                            if let Some(key) = s.req.key {
                                if !net.landed(key, &s.sender) {
                                    // The data is in (the request named staged memory):
                                    // only the count is withheld from another's key.
                                    let sender = s.sender.clone();
                                    self.refuse(
                                        &sender,
                                        format_args!("an OFFER counting toward key {key:#x}, not its sender's"),
                                    );
                                }
                            }
                            let (rail, from, token) = (s.rail, s.from.clone(), s.req.token);
                            self.reply(rail, from, token, STATUS_OK, "");
                            return false;
                        }
                        s.stage = ServeStage::Net {
                            next: 0,
                            left: s.req.pieces.len(),
                        };
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "staging: a copy for a peer failed");
                        s.failed = true;
                        s.stage = ServeStage::Net { next: 0, left: 0 };
                    }
                },
            }
        }
    }

    /// Starts the serve's copy: slot → memory (OFFER) or memory → slot (FETCH). `false`
    /// when it could not start (the serve is failed).
    pub(super) fn serve_copy(&mut self, s: &mut Serve<A, S>) -> bool {
        let slot = s.slot.expect("serving with a slot");
        let mut off = 0u64;
        let copies: Vec<CopyOp> = s
            .req
            .pieces
            .iter()
            .map(|p| {
                let at = self.slot_ptr(slot, off);
                off += u64::from(p.len);
                if s.offer {
                    CopyOp {
                        dst: p.target,
                        src: at,
                        len: p.len as usize,
                    }
                } else {
                    CopyOp {
                        dst: at,
                        src: p.target,
                        len: p.len as usize,
                    }
                }
            })
            .collect();
        match self.start_copy(s.dev, &copies) {
            Ok(ticket) => {
                s.stage = ServeStage::Copy { ticket };
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "staging: a copy for a peer did not start");
                s.failed = true;
                s.stage = ServeStage::Net { next: 0, left: 0 };
                false
            }
        }
    }

    /// Posts the serve's RMA operations; `false` when the transport is busy.
    pub(super) fn serve_post<N: StageNet<Addr = A, Sender = S>>(
        &mut self,
        net: &N,
        s: &mut Serve<A, S>,
    ) -> bool {
        let slot = s.slot.expect("serving with a slot");
        let ServeStage::Net { mut next, left } = s.stage else {
            return true;
        };
        let mut off: u64 = s.req.pieces[..next].iter().map(|p| u64::from(p.len)).sum();
        while next < s.req.pieces.len() {
            if self.net_ops >= MAX_NET_OPS {
                s.stage = ServeStage::Net { next, left };
                self.blocked = true;
                return false;
            }
            let p = s.req.pieces[next];
            let op = self.id();
            let offset = self.slot_offset(slot) + off;
            let posted = if s.offer {
                net.read(
                    s.rail,
                    &s.from,
                    offset,
                    p.len as usize,
                    p.peer_addr,
                    p.peer_key,
                    op,
                )
            } else {
                net.write(
                    s.rail,
                    &s.from,
                    offset,
                    p.len as usize,
                    p.peer_addr,
                    p.peer_key,
                    Some(FETCH_DATA | s.req.token),
                    op,
                )
            };
            match posted {
                Ok(()) => {
                    self.owners.insert(op, Owner::Serve { serve: s.id });
                    self.net_ops += 1;
                    s.ops += 1;
                    next += 1;
                    off += u64::from(p.len);
                }
                Err(NetError::Busy) => {
                    s.stage = ServeStage::Net { next, left };
                    self.blocked = true;
                    return false;
                }
                Err(NetError::Failed(f)) => {
                    tracing::debug!(error = %f.text, "staging: serving a peer's request failed");
                    s.failed = true;
                    s.stage = ServeStage::Net { next: 0, left: 0 };
                    return true;
                }
            }
        }
        s.stage = ServeStage::Net { next, left };
        true
    }
}
