//! The proxy's consumer side: takes published entries off the ring, validates them,
//! posts them on the transport, and reports completions in ticket order.
//!
//! Per entry: *data* (the put, get, inline put or signal itself; a staged entry is
//! several chunks through bounce buffers), then for `GIO_FLAG_SIGNAL` the *signal* (the
//! remote atomic add, posted only once the data's completion arrived, so a peer that
//! sees the signal sees the data). Data is posted in ticket order; a `GIO_OP_FENCE` holds
//! everything after it until everything before it completed. `ctrl.completed` advances
//! only over a complete prefix: a completion that arrives early waits for the ones before
//! it. `GIO_FLAG_COUNTER` bumps its counter when the entry retires.
//!
//! Batching: a request is posted with [`PostFlags::more`] when the next entry can be
//! posted right behind it in the same round. On an [`ordered`](Transport::ordered)
//! transport a put's signal follows its data at once, and a write or atomic with more
//! behind it is posted *unsignaled*: it is done when a later request's completion
//! arrives (its delivery implies the earlier writes were placed), so a batch costs one
//! completion. Reads always complete on their own (their data lands here).

use super::ring::RingMemory;
use super::table::{Local, MemoryTable, Op, OpKind, Region};
use super::transport::{PostFlags, Posted, Transport, TransportCompletion, WorkRequest};
use crate::error::{Error, Result};
use crate::status::GioStatus;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Low bits of a work request id: 0 = the data, [`SIGNAL_PART`] = the signal, else a
/// staged chunk (its bounce slot + 1).
const PART_BITS: u32 = 20;
const PART_MASK: u64 = (1 << PART_BITS) - 1;
const SIGNAL_PART: u64 = PART_MASK;

fn wr_id(ticket: u64, part: u64) -> u64 {
    (ticket << PART_BITS) | part
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Data,
    Signal,
    Done,
}

/// A staged chunk in flight.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    bounce: usize,
    /// Offset in the local (staged) region.
    local_off: u64,
    len: u64,
    get: bool,
}

/// An entry taken off the ring and not yet retired.
#[derive(Debug)]
struct Slot {
    ticket: u64,
    op: Op,
    phase: Phase,
    /// Transport operations in flight.
    outstanding: u32,
    /// Every data operation was posted (or none was needed).
    data_posted: bool,
    /// Staged entries: bytes handed to chunks so far.
    staged_off: u64,
    chunks: Vec<Chunk>,
    /// Staged put: a bounce buffer holding the next chunk, copied but not yet posted.
    ready: Option<usize>,
    signal_posted: bool,
}

/// Bounce buffers for staged regions: `slots` chunks of `chunk` bytes in one registered
/// host allocation.
pub(crate) struct Staging<R> {
    pub(crate) base: *mut u8,
    pub(crate) chunk: usize,
    pub(crate) reg: R,
    pub(crate) free: Vec<usize>,
    /// Owns the memory (dropped after `reg`, which is declared first).
    pub(crate) _mem: Box<dyn Send + Sync>,
}

// SAFETY: `base` points into `_mem`, owned here; chunks are handed out exclusively.
unsafe impl<R: Send> Send for Staging<R> {}

/// Idle rounds between transport polls by default (see [`Engine::progress`]).
pub(crate) const IDLE_TRANSPORT_POLL: u32 = 16;

/// The proxy engine: one per queue pair, driven by one thread at a time.
pub(crate) struct Engine<T: Transport> {
    pub(crate) ring: Arc<RingMemory>,
    pub(crate) transport: T,
    pub(crate) table: MemoryTable<T::Registration>,
    pub(crate) staging: Option<Staging<T::Registration>>,
    /// Tickets `[retired, taken)`.
    window: VecDeque<Slot>,
    retired: u64,
    taken: u64,
    /// First ticket whose data is not fully posted.
    next_post: u64,
    window_size: u64,
    /// Transport operations in flight, all entries together.
    outstanding: usize,
    /// Rounds since the transport was last polled while nothing was in flight.
    idle_rounds: u32,
    /// Idle rounds between transport polls.
    pub(crate) idle_poll_rounds: u32,
    failure: Option<(GioStatus, u64)>,
    /// The typed error of the failure, returned once by `progress`.
    pending_error: Option<Error>,
    completions: Vec<TransportCompletion>,
    /// The transport places writes in order ([`Transport::ordered`]).
    ordered: bool,
    /// Work request ids of unsignaled requests not yet covered by a later completion,
    /// in posting order (which is id order: tickets ascend, a signal follows its data).
    uncovered: VecDeque<u64>,
    /// Per-counter increments of one retirement, applied with one add each.
    counter_adds: Vec<(u32, u64)>,
}

impl<T: Transport> Engine<T> {
    pub(crate) fn new(ring: Arc<RingMemory>, mut transport: T) -> Result<Self> {
        let window_size = ring.ring_size() as u64;
        transport.prepare(window_size as usize)?;
        let ordered = transport.ordered();
        Ok(Self {
            ring,
            transport,
            table: MemoryTable::new(),
            staging: None,
            window: VecDeque::new(),
            retired: 0,
            taken: 0,
            next_post: 0,
            window_size,
            outstanding: 0,
            idle_rounds: 0,
            idle_poll_rounds: IDLE_TRANSPORT_POLL,
            failure: None,
            pending_error: None,
            completions: Vec::new(),
            ordered,
            uncovered: VecDeque::new(),
            counter_adds: Vec::new(),
        })
    }

    /// Makes the next round poll the transport even if nothing is in flight (a proxy
    /// thread about to sleep progresses the peer's operations on this side first).
    pub(crate) fn poll_transport_next(&mut self) {
        self.idle_rounds = self.idle_poll_rounds;
    }

    /// Transport operations in flight.
    pub(crate) fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Whether an entry taken from the ring and not yet retired uses region `mr`.
    pub(crate) fn in_use(&self, mr: u16) -> bool {
        self.window.iter().any(|slot| slot.op.uses(mr))
    }

    /// One round: reap, take, post, retire. `Ok(true)` if anything moved; the first
    /// failure is returned once as its typed error, later rounds report the ring's
    /// status (they still reap completions, so memory is not freed under a transfer,
    /// and complete the entries before the failure).
    pub(crate) fn progress(&mut self) -> Result<bool> {
        // With nothing in flight, the transport is polled only every
        // `idle_poll_rounds` rounds (it still progresses what peers send us): a round
        // is then a few loads of the ring, so a GPU post is seen within a fraction of a
        // microsecond instead of after a provider's progress call.
        let poll_transport = self.outstanding > 0 || {
            self.idle_rounds += 1;
            self.idle_rounds >= self.idle_poll_rounds
        };
        let mut progressed = false;
        if poll_transport {
            self.idle_rounds = 0;
            progressed = self.reap()?;
        }
        if self.failure.is_none() {
            progressed |= self.take();
        }
        for _ in 0..2 {
            // A retirement can release a fence: post again once.
            progressed |= self.post_pass();
            if !self.retire() {
                break;
            }
            progressed = true;
        }
        if let Some(e) = self.pending_error.take() {
            return Err(e);
        }
        if let Some((status, ticket)) = self.failure {
            return Err(Error::RingFailed { status, ticket });
        }
        Ok(progressed)
    }

    fn fail(&mut self, status: GioStatus, ticket: u64, error: Error) {
        if self.failure.is_some() {
            tracing::debug!("proxy: later failure at ticket {ticket}: {error}");
            return;
        }
        tracing::warn!("proxy: ring entry {ticket} failed ({status}): {error}");
        self.ring.set_error(status, ticket);
        // The ring's first failure wins (a producer may have seen it already).
        let (status, ticket) = self.ring.error().unwrap_or((status, ticket));
        self.failure = Some((status, ticket));
        self.pending_error = Some(error);
    }

    /// Takes published entries, up to one ring of work in flight.
    fn take(&mut self) -> bool {
        if self.ring.is_shut_down() {
            return false;
        }
        let start = self.taken;
        let num_counters = self.ring.num_counters();
        while self.taken < self.retired + self.window_size {
            let ticket = self.taken;
            let Some(entry) = self.ring.published(ticket) else {
                break;
            };
            match self.table.validate(&entry, num_counters) {
                Ok(op) => {
                    self.window.push_back(Slot {
                        ticket,
                        op,
                        phase: Phase::Data,
                        outstanding: 0,
                        data_posted: false,
                        staged_off: 0,
                        chunks: Vec::new(),
                        ready: None,
                        signal_posted: false,
                    });
                    self.taken += 1;
                }
                Err((status, reason)) => {
                    self.fail(
                        status,
                        ticket,
                        Error::BadEntry {
                            ticket,
                            status,
                            reason,
                        },
                    );
                    break;
                }
            }
        }
        if self.taken != start {
            self.ring
                .ctrl()
                .consumed
                .store(self.taken, Ordering::Release);
            return true;
        }
        false
    }

    /// Reads completions and applies them to their entries.
    /// Polls even with nothing in flight: that progresses a manual-progress provider
    /// for the peer's operations that target this side.
    fn reap(&mut self) -> Result<bool> {
        let mut done = std::mem::take(&mut self.completions);
        done.clear();
        if let Err(e) = self.transport.poll(&mut done) {
            // The transport as a whole failed: fail the oldest entry in flight.
            let ticket = self.window.front().map_or(self.retired, |s| s.ticket);
            self.fail(GioStatus::TRANSPORT, ticket, e);
        }
        let progressed = !done.is_empty();
        for c in done.drain(..) {
            self.complete(c);
        }
        self.completions = done;
        Ok(progressed)
    }

    /// The window index of `ticket`, if it is in flight.
    fn index_of(&self, ticket: u64) -> Option<usize> {
        ticket
            .checked_sub(self.retired)
            .filter(|i| *i < self.window.len() as u64)
            .map(|i| i as usize)
    }

    /// One request of `wr_id` finished (completed, covered, or failed).
    fn request_done(&mut self, wr_id: u64) {
        if let Some(index) = self.index_of(wr_id >> PART_BITS) {
            let slot = &mut self.window[index];
            slot.outstanding = slot.outstanding.saturating_sub(1);
            self.outstanding = self.outstanding.saturating_sub(1);
        }
    }

    fn complete(&mut self, c: TransportCompletion) {
        let ticket = c.wr_id >> PART_BITS;
        let part = c.wr_id & PART_MASK;
        if c.result.is_ok() {
            // Its delivery covers every unsignaled write posted before it.
            while let Some(&u) = self.uncovered.front() {
                if u >= c.wr_id {
                    break;
                }
                self.uncovered.pop_front();
                self.request_done(u);
            }
        } else if let Some(pos) = self.uncovered.iter().position(|&u| u == c.wr_id) {
            // A failed unsignaled request reports itself; it covers nothing.
            self.uncovered.remove(pos);
            if let Err(f) = c.result {
                self.request_done(c.wr_id);
                self.fail_completion(ticket, f);
            }
            return;
        }
        let Some(index) = self.index_of(ticket) else {
            match c.result {
                // An unsignaled request that a later completion covered already.
                Err(f) => self.fail_completion(ticket, f),
                Ok(()) => {
                    tracing::error!("proxy: completion {:#x} for no entry in flight", c.wr_id)
                }
            }
            return;
        };
        self.outstanding = self.outstanding.saturating_sub(1);
        let slot = &mut self.window[index];
        slot.outstanding = slot.outstanding.saturating_sub(1);
        let mut copy_error = None;
        if part != 0 && part != SIGNAL_PART {
            let bounce = (part - 1) as usize;
            if let Some(pos) = slot.chunks.iter().position(|ch| ch.bounce == bounce) {
                let chunk = slot.chunks.swap_remove(pos);
                let staging = self.staging.as_mut().expect("chunks imply staging");
                if chunk.get && c.result.is_ok() {
                    // A staged get lands in the bounce buffer, then in device memory.
                    let OpKind::Get { local, .. } = slot.op.kind else {
                        unreachable!("get chunk of a get")
                    };
                    if let Region::Local(Local::Staged { mem }) = self.table.get(local) {
                        // SAFETY: the chunk's bounce slot is ours until freed below; the
                        // transport finished writing it (its completion).
                        let src = unsafe {
                            std::slice::from_raw_parts(
                                staging.base.add(bounce * staging.chunk),
                                chunk.len as usize,
                            )
                        };
                        if let Err(e) = mem.copy_from_host(chunk.local_off, src) {
                            copy_error = Some(e);
                        }
                    }
                }
                staging.free.push(bounce);
            }
        }
        if let Err(f) = c.result {
            self.fail_completion(ticket, f);
        } else if let Some(e) = copy_error {
            self.fail(
                GioStatus::TRANSPORT,
                ticket,
                Error::EntryFailed {
                    ticket,
                    status: GioStatus::TRANSPORT,
                    source: Box::new(e),
                },
            );
        }
    }

    fn fail_completion(&mut self, ticket: u64, f: super::transport::TransportFailure) {
        let status = if f.peer_gone {
            GioStatus::PEER_GONE
        } else {
            GioStatus::TRANSPORT
        };
        self.fail(
            status,
            ticket,
            Error::EntryFailed {
                ticket,
                status,
                source: Box::new(f.error),
            },
        );
    }

    /// Whether the entry after `index` can be posted right behind it in this round
    /// (a direct write, inline write, signal or read: no fence, nop or staging).
    fn next_follows(&self, index: usize) -> bool {
        let Some(next) = self.window.get(index + 1) else {
            return false;
        };
        if next.data_posted || next.ticket >= self.failure.map_or(u64::MAX, |f| f.1) {
            return false;
        }
        match next.op.kind {
            OpKind::PutInline { .. } | OpKind::Signal { .. } => true,
            OpKind::Put { local, len, .. } | OpKind::Get { local, len, .. } => {
                len > 0 && matches!(self.table.get(local), Region::Local(Local::Direct { .. }))
            }
            OpKind::Nop | OpKind::Fence => false,
        }
    }

    /// The flags of a request of entry `index`: `then_signal` when its signal is posted
    /// right behind it (ordered transports), `read` for reads (always signaled).
    fn flags(&self, index: usize, then_signal: bool, read: bool) -> PostFlags {
        let more = then_signal || self.next_follows(index);
        PostFlags {
            more,
            unsignaled: self.ordered && more && !read,
        }
    }

    /// Bookkeeping of a request posted with `flags`.
    fn posted_request(&mut self, index: usize, posted: Posted, wr_id: u64, flags: PostFlags) {
        if posted == Posted::Yes {
            self.window[index].outstanding += 1;
            self.outstanding += 1;
            if flags.unsignaled {
                self.uncovered.push_back(wr_id);
            }
        }
    }

    /// Advances phases and posts what may be posted. Returns whether anything moved.
    fn post_pass(&mut self) -> bool {
        let mut progressed = false;
        let mut index = 0;
        // After a failure, entries before it still complete; nothing at or after it
        // is posted.
        let limit = self.failure.map_or(u64::MAX, |f| f.1);
        while index < self.window.len() {
            let ticket = self.window[index].ticket;
            if ticket >= limit {
                break;
            }
            progressed |= self.advance(index);
            let slot = &self.window[index];
            if slot.phase == Phase::Signal && !slot.signal_posted {
                match self.post_signal(index) {
                    Ok(Posted::Yes) => progressed = true,
                    Ok(Posted::Busy) => break,
                    Err(e) => {
                        self.post_failed(ticket, e);
                        break;
                    }
                }
            }
            if ticket == self.next_post {
                match self.post_data(index) {
                    Ok(true) => {
                        progressed = true;
                        self.next_post += 1;
                        self.advance(index);
                        if self.window[index].phase == Phase::Signal {
                            // Ordered: the signal goes right behind its data (this index
                            // again, now past its data).
                            continue;
                        }
                    }
                    Ok(false) => break,
                    Err(e) => {
                        self.post_failed(ticket, e);
                        break;
                    }
                }
            } else if ticket > self.next_post {
                break;
            }
            index += 1;
        }
        progressed
    }

    fn post_failed(&mut self, ticket: u64, e: Error) {
        self.fail(
            GioStatus::TRANSPORT,
            ticket,
            Error::EntryFailed {
                ticket,
                status: GioStatus::TRANSPORT,
                source: Box::new(e),
            },
        );
    }

    /// Data done → signal or done; signal done → done.
    fn advance(&mut self, index: usize) -> bool {
        let slot = &mut self.window[index];
        match slot.phase {
            // Ordered transports place the signal after the data: no wait for the data.
            Phase::Data
                if slot.data_posted
                    && slot.op.signal.is_some()
                    && (self.ordered || slot.outstanding == 0) =>
            {
                slot.phase = Phase::Signal;
                true
            }
            Phase::Data if slot.data_posted && slot.outstanding == 0 => {
                slot.phase = Phase::Done;
                true
            }
            Phase::Signal if slot.signal_posted && slot.outstanding == 0 => {
                slot.phase = Phase::Done;
                true
            }
            _ => false,
        }
    }

    fn scratch(&self, ticket: u64) -> usize {
        (ticket & (self.window_size - 1)) as usize
    }

    fn post_signal(&mut self, index: usize) -> Result<Posted> {
        let flags = self.flags(index, false, false);
        let slot = &self.window[index];
        let (mr, off, add) = slot.op.signal.expect("signal phase");
        let id = wr_id(slot.ticket, SIGNAL_PART);
        let Region::Remote(remote) = self.table.get(mr) else {
            unreachable!("validated: signal regions are remote")
        };
        let posted = self.transport.post_with(
            &WorkRequest::AtomicAdd {
                wr_id: id,
                remote,
                offset: off,
                add,
                slot: self.scratch(slot.ticket),
            },
            flags,
        )?;
        if posted == Posted::Yes {
            self.window[index].signal_posted = true;
        }
        self.posted_request(index, posted, id, flags);
        Ok(posted)
    }

    /// Posts the entry's data; `Ok(true)` once all of it is posted, `Ok(false)` when
    /// blocked (queue full, no bounce buffer, a fence waiting).
    fn post_data(&mut self, index: usize) -> Result<bool> {
        let ticket = self.window[index].ticket;
        let kind = self.window[index].op.kind;
        let scratch = self.scratch(ticket);
        let posted = match kind {
            OpKind::Nop => Posted::Yes,
            OpKind::Fence => {
                // Everything earlier retired: the fence is passed.
                if index != 0 {
                    return Ok(false);
                }
                Posted::Yes
            }
            OpKind::PutInline {
                remote,
                remote_off,
                data,
                len,
            } => {
                let flags = self.flags(index, self.signal_follows(index), false);
                let Region::Remote(remote) = self.table.get(remote) else {
                    unreachable!("validated")
                };
                let posted = self.transport.post_with(
                    &WorkRequest::WriteInline {
                        wr_id: wr_id(ticket, 0),
                        data,
                        len,
                        remote,
                        offset: remote_off,
                        slot: scratch,
                    },
                    flags,
                )?;
                self.posted_request(index, posted, wr_id(ticket, 0), flags);
                posted
            }
            OpKind::Signal { mr, off, add } => {
                let flags = self.flags(index, false, false);
                let Region::Remote(remote) = self.table.get(mr) else {
                    unreachable!("validated")
                };
                let posted = self.transport.post_with(
                    &WorkRequest::AtomicAdd {
                        wr_id: wr_id(ticket, 0),
                        remote,
                        offset: off,
                        add,
                        slot: scratch,
                    },
                    flags,
                )?;
                self.posted_request(index, posted, wr_id(ticket, 0), flags);
                posted
            }
            OpKind::Put {
                local,
                local_off,
                remote,
                remote_off,
                len,
            }
            | OpKind::Get {
                local,
                local_off,
                remote,
                remote_off,
                len,
            } => {
                let get = matches!(kind, OpKind::Get { .. });
                if len == 0 {
                    Posted::Yes
                } else {
                    match self.table.get(local) {
                        Region::Local(Local::Direct { .. }) => {
                            self.post_direct(index, get, local, local_off, remote, remote_off, len)?
                        }
                        Region::Local(Local::Staged { .. }) => {
                            return self
                                .post_staged(index, get, local, local_off, remote, remote_off, len)
                        }
                        Region::Remote(_) | Region::Vacant => unreachable!(
                            "validated, and a region is removed only while no entry uses it"
                        ),
                    }
                }
            }
        };
        if posted == Posted::Yes {
            self.window[index].data_posted = true;
            return Ok(true);
        }
        Ok(false)
    }

    /// Whether entry `index`'s signal is posted right behind its data.
    fn signal_follows(&self, index: usize) -> bool {
        self.ordered && self.window[index].op.signal.is_some()
    }

    #[allow(clippy::too_many_arguments)]
    fn post_direct(
        &mut self,
        index: usize,
        get: bool,
        local: u16,
        local_off: u64,
        remote: u16,
        remote_off: u64,
        len: u64,
    ) -> Result<Posted> {
        let ticket = self.window[index].ticket;
        let flags = self.flags(index, !get && self.signal_follows(index), get);
        let (Region::Local(Local::Direct { reg, addr, .. }), Region::Remote(remote)) =
            (self.table.get(local), self.table.get(remote))
        else {
            unreachable!("validated")
        };
        let (wr_id, addr) = (wr_id(ticket, 0), addr + local_off);
        let wr = if get {
            WorkRequest::Read {
                wr_id,
                local: reg,
                addr,
                len,
                remote,
                offset: remote_off,
            }
        } else {
            WorkRequest::Write {
                wr_id,
                local: reg,
                addr,
                len,
                remote,
                offset: remote_off,
            }
        };
        let posted = self.transport.post_with(&wr, flags)?;
        self.posted_request(index, posted, wr_id, flags);
        Ok(posted)
    }

    /// Staged: chunk by chunk through bounce buffers. A put copies device → bounce
    /// (synchronously: `cuMemcpyDtoH` on the proxy thread) before posting; a get copies
    /// bounce → device when the chunk's read completes.
    #[allow(clippy::too_many_arguments)]
    fn post_staged(
        &mut self,
        index: usize,
        get: bool,
        local: u16,
        local_off: u64,
        remote: u16,
        remote_off: u64,
        len: u64,
    ) -> Result<bool> {
        let ticket = self.window[index].ticket;
        let (Region::Local(Local::Staged { mem }), Region::Remote(remote)) =
            (self.table.get(local), self.table.get(remote))
        else {
            unreachable!("validated")
        };
        let staging = self.staging.as_mut().expect("staged regions imply staging");
        let slot = &mut self.window[index];
        while slot.staged_off < len {
            let off = slot.staged_off;
            let n = (len - off).min(staging.chunk as u64);
            // A put chunk copied out before its post found the queue full is not copied
            // again.
            let (bounce, copied) = match slot.ready.take() {
                Some(bounce) => (bounce, true),
                None => match staging.free.pop() {
                    Some(bounce) => (bounce, false),
                    None => return Ok(false),
                },
            };
            // SAFETY: bounce slot `bounce` is ours until its completion frees it.
            let buf = unsafe { staging.base.add(bounce * staging.chunk) };
            if !get && !copied {
                // SAFETY: as above; n <= chunk.
                let dst = unsafe { std::slice::from_raw_parts_mut(buf, n as usize) };
                if let Err(e) = mem.copy_to_host(local_off + off, dst) {
                    staging.free.push(bounce);
                    return Err(e);
                }
            }
            let wr_id = wr_id(ticket, bounce as u64 + 1);
            let (addr, offset) = (buf as u64, remote_off + off);
            let wr = if get {
                WorkRequest::Read {
                    wr_id,
                    local: &staging.reg,
                    addr,
                    len: n,
                    remote,
                    offset,
                }
            } else {
                WorkRequest::Write {
                    wr_id,
                    local: &staging.reg,
                    addr,
                    len: n,
                    remote,
                    offset,
                }
            };
            match self.transport.post(&wr) {
                Ok(Posted::Yes) => {}
                Ok(Posted::Busy) => {
                    if get {
                        staging.free.push(bounce);
                    } else {
                        slot.ready = Some(bounce);
                    }
                    return Ok(false);
                }
                Err(e) => {
                    staging.free.push(bounce);
                    return Err(e);
                }
            }
            slot.chunks.push(Chunk {
                bounce,
                local_off: local_off + off,
                len: n,
                get,
            });
            slot.staged_off += n;
            slot.outstanding += 1;
            self.outstanding += 1;
        }
        slot.data_posted = true;
        Ok(true)
    }

    /// Retires the complete prefix: counters, then `ctrl.completed`.
    fn retire(&mut self) -> bool {
        let start = self.retired;
        while let Some(slot) = self.window.front() {
            if slot.phase != Phase::Done {
                break;
            }
            if let Some(c) = slot.op.counter {
                match self.counter_adds.iter_mut().find(|(i, _)| *i == c) {
                    Some((_, n)) => *n += 1,
                    None => self.counter_adds.push((c, 1)),
                }
            }
            self.window.pop_front();
            self.retired += 1;
        }
        // One add per counter and one store of `completed` per round: each is a write
        // the GPU may be polling over PCIe.
        for (c, n) in self.counter_adds.drain(..) {
            if let Some(counter) = self.ring.counter_ref(c) {
                counter.fetch_add(n, Ordering::Release);
            }
        }
        if self.retired != start {
            self.ring
                .ctrl()
                .completed
                .store(self.retired, Ordering::Release);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::super::ring::{Entry, HostProducer};
    use super::super::transport::{RemoteDescriptor, TransportFailure, TransportKind};
    use super::*;
    use gpu_mem::DeviceBuffer;
    use parking_lot::Mutex;
    use std::time::Duration;

    /// A transport whose completions the test releases, in any order.
    #[derive(Default)]
    struct MockState {
        /// (wr_id, what) in post order.
        posted: Vec<(u64, &'static str)>,
        /// Completions to deliver at the next poll: (wr_id, ok, peer gone).
        release: Vec<(u64, bool, bool)>,
        /// The flags of each post, in post order.
        flags: Vec<PostFlags>,
        /// Whether the mock claims write ordering.
        ordered: bool,
        /// (source address, target offset) of each write and the addend of each atomic.
        writes: Vec<(u64, u64)>,
        adds: Vec<u64>,
    }

    struct Mock(Arc<Mutex<MockState>>);

    impl Transport for Mock {
        type Registration = ();
        fn kind(&self) -> TransportKind {
            TransportKind::FABRIC
        }
        fn local_info(&self) -> Result<Vec<u8>> {
            Ok(Vec::new())
        }
        fn connect(&mut self, _: &[u8]) -> Result<()> {
            Ok(())
        }
        fn prepare(&mut self, _: usize) -> Result<()> {
            Ok(())
        }
        unsafe fn register_host(&mut self, _: *mut u8, _: usize) -> Result<()> {
            Ok(())
        }
        fn register_device(&mut self, _: &DeviceBuffer) -> Result<()> {
            Err(Error::Unsupported("mock".into()))
        }
        fn descriptor(&self, _: &()) -> RemoteDescriptor {
            unreachable!()
        }
        fn post(&mut self, wr: &WorkRequest<'_, ()>) -> Result<Posted> {
            let mut s = self.0.lock();
            let (id, what) = match wr {
                WorkRequest::Write {
                    wr_id,
                    addr,
                    offset,
                    ..
                } => {
                    s.writes.push((*addr, *offset));
                    (*wr_id, "write")
                }
                WorkRequest::WriteInline { wr_id, .. } => (*wr_id, "inline"),
                WorkRequest::Read { wr_id, .. } => (*wr_id, "read"),
                WorkRequest::AtomicAdd { wr_id, add, .. } => {
                    s.adds.push(*add);
                    (*wr_id, "add")
                }
            };
            s.posted.push((id, what));
            Ok(Posted::Yes)
        }
        fn ordered(&self) -> bool {
            self.0.lock().ordered
        }
        fn post_with(&mut self, wr: &WorkRequest<'_, ()>, flags: PostFlags) -> Result<Posted> {
            self.0.lock().flags.push(flags);
            self.post(wr)
        }
        fn poll(&mut self, out: &mut Vec<TransportCompletion>) -> Result<()> {
            for (wr_id, ok, peer_gone) in self.0.lock().release.drain(..) {
                out.push(TransportCompletion {
                    wr_id,
                    result: if ok {
                        Ok(())
                    } else {
                        Err(TransportFailure {
                            peer_gone,
                            error: Error::InvalidArgument("mock failure".into()),
                        })
                    },
                });
            }
            Ok(())
        }
    }

    struct Fixture {
        engine: Engine<Mock>,
        state: Arc<Mutex<MockState>>,
        p: HostProducer,
        ring: Arc<RingMemory>,
    }

    /// Region 0 local (1 KiB), region 1 remote (1 KiB).
    fn fixture() -> Fixture {
        fixture_with(false)
    }

    fn fixture_with(ordered: bool) -> Fixture {
        let ring = RingMemory::host(8, 2).unwrap();
        let state = Arc::new(Mutex::new(MockState {
            ordered,
            ..MockState::default()
        }));
        let mut engine = Engine::new(ring.clone(), Mock(state.clone())).unwrap();
        engine
            .table
            .push(Region::Local(Local::Direct {
                reg: (),
                host: true,
                addr: 0x1000,
                len: 1024,
                dev_addr: 0,
                _keep: None,
            }))
            .unwrap();
        engine
            .table
            .push(Region::Remote(RemoteDescriptor {
                transport: TransportKind::FABRIC,
                addr: 0,
                len: 1024,
                key: 1,
            }))
            .unwrap();
        let p = HostProducer::new(&ring, Duration::from_secs(1)).unwrap();
        Fixture {
            engine,
            state,
            p,
            ring,
        }
    }

    impl Fixture {
        fn posted(&self) -> Vec<(u64, &'static str)> {
            self.state.lock().posted.clone()
        }
        fn flags(&self) -> Vec<(bool, bool)> {
            let s = self.state.lock();
            s.flags.iter().map(|f| (f.more, f.unsignaled)).collect()
        }
        fn release(&self, wr_id: u64, ok: bool, peer_gone: bool) {
            self.state.lock().release.push((wr_id, ok, peer_gone));
        }
    }

    #[test]
    fn completions_out_of_order_wait_for_the_prefix() {
        let mut f = fixture();
        for i in 0..3 {
            f.p.post(&Entry::put(1, i * 8, 0, 0, 8).with_counter(0))
                .unwrap();
        }
        f.engine.progress().unwrap();
        assert_eq!(
            f.posted(),
            [
                (wr_id(0, 0), "write"),
                (wr_id(1, 0), "write"),
                (wr_id(2, 0), "write")
            ]
        );
        assert_eq!(f.ring.consumed(), 3);
        f.release(wr_id(2, 0), true, false);
        f.release(wr_id(1, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(f.ring.completed(), 0, "a later completion retired early");
        assert_eq!(f.ring.counter(0).unwrap(), 0);
        f.release(wr_id(0, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(f.ring.completed(), 3);
        assert_eq!(f.ring.counter(0).unwrap(), 3);
    }

    #[test]
    fn image_entries_are_taken_only_once_every_word_landed() {
        let mut f = fixture();
        // Two laps of the 8-slot ring, each entry's words landing in a different order
        // (seq first, last, in the middle), the proxy polling after every word.
        let orders: [[usize; 8]; 3] = [
            [0, 1, 2, 3, 4, 5, 6, 7],
            [7, 6, 5, 4, 3, 2, 1, 0],
            [3, 0, 6, 1, 7, 2, 5, 4],
        ];
        for ticket in 0..16u64 {
            assert_eq!(f.p.reserve(1), ticket);
            let order = orders[ticket as usize % 3];
            let entry = Entry::put(1, ticket * 8, 0, ticket, 8)
                .with_signal(1, 1016, u64::MAX - ticket)
                .with_counter(1);
            for landed in 1..=8 {
                // A fresh writer each time: write words order[..landed] (re-storing the
                // earlier ones is harmless, they hold the same values).
                f.p.write_image_words(ticket, &entry, &order, landed)
                    .unwrap();
                f.engine.progress().unwrap();
                let taken = f.ring.consumed() > ticket;
                assert_eq!(taken, landed == 8, "ticket {ticket}: {landed} words landed");
            }
            let wr = wr_id(ticket, 0);
            assert_eq!(f.posted().last(), Some(&(wr, "write")));
            f.release(wr, true, false);
            f.engine.progress().unwrap();
            assert_eq!(
                f.state.lock().writes.last(),
                Some(&(0x1000 + ticket, ticket * 8))
            );
            let signal = f.posted().last().copied().unwrap();
            assert_eq!(signal.1, "add", "ticket {ticket}");
            f.release(signal.0, true, false);
            f.engine.progress().unwrap();
            assert_eq!(f.ring.completed(), ticket + 1);
        }
        assert_eq!(f.ring.counter(1).unwrap(), 16);
        // The decoded fields are the ones written: the last signal's add kept bit 63.
        let s = f.state.lock();
        assert_eq!(s.adds.last(), Some(&(u64::MAX - 15)));
    }

    #[test]
    fn signal_is_posted_after_the_data_completes() {
        let mut f = fixture();
        f.p.post(&Entry::put_inline(1, 0, 5, 4).with_signal(1, 8, 2))
            .unwrap();
        f.engine.progress().unwrap();
        f.engine.progress().unwrap();
        assert_eq!(f.posted(), [(wr_id(0, 0), "inline")]);
        f.release(wr_id(0, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(
            f.posted(),
            [(wr_id(0, 0), "inline"), (wr_id(0, SIGNAL_PART), "add")]
        );
        assert_eq!(f.ring.completed(), 0, "done before its signal");
        f.release(wr_id(0, SIGNAL_PART), true, false);
        f.engine.progress().unwrap();
        assert_eq!(f.ring.completed(), 1);
    }

    #[test]
    fn fence_holds_later_entries_until_earlier_ones_complete() {
        let mut f = fixture();
        f.p.post(&Entry::put(1, 0, 0, 0, 8)).unwrap();
        f.p.post(&Entry::fence()).unwrap();
        f.p.post(&Entry::get(0, 0, 1, 0, 8)).unwrap();
        f.p.post(&Entry::nop()).unwrap();
        f.engine.progress().unwrap();
        f.engine.progress().unwrap();
        assert_eq!(f.posted(), [(wr_id(0, 0), "write")]);
        f.release(wr_id(0, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(f.posted(), [(wr_id(0, 0), "write"), (wr_id(2, 0), "read")]);
        assert_eq!(f.ring.completed(), 2);
        f.release(wr_id(2, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(f.ring.completed(), 4);
    }

    #[test]
    fn failed_completion_is_typed_and_stops_posting() {
        for (peer_gone, status) in [(false, GioStatus::TRANSPORT), (true, GioStatus::PEER_GONE)] {
            let mut f = fixture();
            f.p.post(&Entry::put(1, 0, 0, 0, 8)).unwrap();
            f.p.post(&Entry::put(1, 8, 0, 0, 8)).unwrap();
            f.p.post(&Entry::fence()).unwrap();
            f.p.post(&Entry::put(1, 16, 0, 0, 8)).unwrap();
            f.engine.progress().unwrap();
            f.release(wr_id(1, 0), false, peer_gone);
            match f.engine.progress() {
                Err(Error::EntryFailed {
                    ticket: 1,
                    status: s,
                    ..
                }) => assert_eq!(s, status),
                other => panic!("{other:?}"),
            }
            assert_eq!(f.ring.error(), Some((status, 1)));
            // The entry before still completes; nothing after the failure is posted.
            f.release(wr_id(0, 0), true, false);
            assert!(matches!(
                f.engine.progress(),
                Err(Error::RingFailed { ticket: 1, .. })
            ));
            assert_eq!(f.ring.completed(), 1);
            assert_eq!(f.posted().len(), 2);
            assert_eq!(f.engine.outstanding(), 0);
        }
    }

    /// (more, unsignaled) of an unsignaled request in the middle of a batch, and of the
    /// batch's last (signaled) one.
    const MIDDLE: (bool, bool) = (true, true);
    const LAST: (bool, bool) = (false, false);

    #[test]
    fn unordered_batches_use_more_and_complete_every_request() {
        let mut f = fixture();
        for i in 0..3 {
            f.p.post(&Entry::put(1, i * 8, 0, 0, 8)).unwrap();
        }
        f.engine.progress().unwrap();
        assert_eq!(f.flags(), [(true, false), (true, false), (false, false)]);
        f.release(wr_id(2, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(
            f.ring.completed(),
            0,
            "a completion covered others unordered"
        );
    }

    #[test]
    fn ordered_batch_completes_on_its_last_request() {
        let mut f = fixture_with(true);
        f.p.post(&Entry::put(1, 0, 0, 0, 8)).unwrap();
        f.p.post(&Entry::put_inline(1, 8, 5, 8).with_counter(0))
            .unwrap();
        f.p.post(&Entry::put(1, 16, 0, 0, 8).with_signal(1, 64, 1))
            .unwrap();
        f.p.post(&Entry::signal(1, 72, 1).with_counter(0)).unwrap();
        f.engine.progress().unwrap();
        // The signal of ticket 2 goes right behind its data; only the last request
        // asks for a completion.
        assert_eq!(
            f.posted(),
            [
                (wr_id(0, 0), "write"),
                (wr_id(1, 0), "inline"),
                (wr_id(2, 0), "write"),
                (wr_id(2, SIGNAL_PART), "add"),
                (wr_id(3, 0), "add")
            ]
        );
        assert_eq!(f.flags(), [MIDDLE, MIDDLE, MIDDLE, MIDDLE, LAST]);
        assert_eq!(f.engine.outstanding(), 5);
        f.release(wr_id(3, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(f.ring.completed(), 4);
        assert_eq!(f.ring.counter(0).unwrap(), 2);
        assert_eq!(f.engine.outstanding(), 0);
    }

    #[test]
    fn ordered_reads_always_complete_and_cover_earlier_writes() {
        let mut f = fixture_with(true);
        f.p.post(&Entry::put(1, 0, 0, 0, 8)).unwrap();
        f.p.post(&Entry::get(0, 0, 1, 8, 8)).unwrap();
        f.p.post(&Entry::put(1, 16, 0, 0, 8)).unwrap();
        f.engine.progress().unwrap();
        assert_eq!(f.flags(), [MIDDLE, (true, false), LAST]);
        f.release(wr_id(1, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(f.ring.completed(), 2, "the read covers the write before it");
        f.release(wr_id(2, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(f.ring.completed(), 3);
    }

    /// A batch that straddles the ring's end (ring of 8, tickets 5..13) is one batch:
    /// tickets stay ordered across the wrap, scratch slots wrap with them.
    #[test]
    fn ordered_batch_across_wraparound() {
        let mut f = fixture_with(true);
        for _ in 0..5 {
            f.p.post(&Entry::nop()).unwrap();
        }
        f.engine.progress().unwrap();
        assert_eq!(f.ring.completed(), 5);
        let first = f.p.reserve(8);
        assert_eq!(first, 5);
        for t in first..first + 8 {
            f.p.write(t, &Entry::put_inline(1, t * 8, t, 8).with_counter(1))
                .unwrap();
        }
        f.engine.progress().unwrap();
        let posted = f.posted();
        assert_eq!(posted.len(), 8);
        assert!(posted.iter().zip(5..).all(|(p, t)| p.0 == wr_id(t, 0)));
        assert_eq!(f.flags()[..7], [MIDDLE; 7]);
        assert_eq!(f.flags()[7], LAST);
        f.release(wr_id(12, 0), true, false);
        f.engine.progress().unwrap();
        assert_eq!(f.ring.completed(), 13);
        assert_eq!(f.ring.counter(1).unwrap(), 8);
    }

    /// An unsignaled request in the middle of a batch fails: its ticket gets the typed
    /// status, the entries before it complete (covered by the batch's last request),
    /// and nothing at or after it is reported complete, whichever completion is read
    /// first.
    #[test]
    fn ordered_failure_in_the_middle_of_a_batch() {
        for failure_first in [true, false] {
            let mut f = fixture_with(true);
            for i in 0..5 {
                f.p.post(&Entry::put(1, i * 8, 0, 0, 8).with_counter(0))
                    .unwrap();
            }
            f.engine.progress().unwrap();
            assert_eq!(f.flags(), [MIDDLE, MIDDLE, MIDDLE, MIDDLE, LAST]);
            if failure_first {
                f.release(wr_id(2, 0), false, true);
                f.release(wr_id(4, 0), true, false);
            } else {
                f.release(wr_id(4, 0), true, false);
                f.release(wr_id(2, 0), false, true);
            }
            match f.engine.progress() {
                Err(Error::EntryFailed {
                    ticket: 2, status, ..
                }) => assert_eq!(status, GioStatus::PEER_GONE),
                other => panic!("{other:?}"),
            }
            assert_eq!(f.ring.error(), Some((GioStatus::PEER_GONE, 2)));
            assert_eq!(f.ring.completed(), 2, "failure_first {failure_first}");
            assert_eq!(f.ring.counter(0).unwrap(), 2);
            assert!(matches!(
                f.engine.progress(),
                Err(Error::RingFailed { ticket: 2, .. })
            ));
            assert_eq!(f.ring.completed(), 2);
            assert_eq!(f.posted().len(), 5, "posted after the failure");
        }
    }
}
