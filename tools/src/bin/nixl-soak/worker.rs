//! One soak agent in its own process: registers one region (see
//! [`tools::soak::Layout`]), publishes its metadata, then WRITEs (with a notification)
//! and READs random sizes to and from random peers, checking every byte, until it is
//! asked to leave or killed.
//!
//! A WRITE goes into the target's slot for this agent; its notification names the
//! pattern. The target checks the slot against it and stores an acknowledgement word;
//! before this agent writes to that target again it READs the word back, so a WRITE is
//! never overwritten before it was checked, and a notification that never arrives is
//! found (no acknowledgement within the stall bound). A READ takes a random range of the
//! peer's read area, whose pattern every agent knows.
//!
//! Errors that a dead or leaving peer explains (the coordinator announces every fault
//! before it injects it) are counted by kind; any other error, a wrong byte, or a wait
//! past the stall bound is a [`FromWorker::Problem`].

use nixl::{Agent, AgentConfig, Desc, DescList, Error, MemKind, XferOp, XferStatus};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use tools::soak::{
    ack_word, agent_index, agent_name, fill_pattern, mismatches, read_seed, unix_ms, Counters,
    FromWorker, HeapSample, Layout, Rng, ToWorker, WorkerConfig,
};

/// How often counters go to the coordinator (a killed worker loses at most this much).
const REPORT_EVERY: Duration = Duration::from_millis(500);
/// How long an error waits for the announcement of a fault that would explain it (the
/// announcement is written before the fault, so it is in the pipe already).
const EXPLAIN_GRACE: Duration = Duration::from_secs(2);
/// A transfer's expected time: this much plus its bytes at [`EXPECTED_RATE`] (loose: 32
/// processes share two cores).
const EXPECTED_BASE: Duration = Duration::from_millis(20);
const EXPECTED_RATE: f64 = 10e6;

/// The one registered region, accessed through raw pointers only: peers write into it
/// and read from it at any time, so no Rust reference to its bytes is ever formed.
struct Arena {
    ptr: *mut u64,
    words: usize,
}

impl Arena {
    fn new(len: usize) -> Self {
        let words = len.div_ceil(8);
        let ptr = Box::into_raw(vec![0u64; words].into_boxed_slice()) as *mut u64;
        Self { ptr, words }
    }

    fn addr(&self, offset: usize) -> u64 {
        self.ptr as u64 + offset as u64
    }

    fn desc(&self) -> Desc {
        Desc::new(self.addr(0), (self.words * 8) as u64, 0)
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(offset + len <= self.words * 8, "arena access out of range");
    }

    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        self.check(offset, len);
        let mut out = vec![0u8; len];
        // SAFETY: the range is inside the allocation (checked); `out` is a distinct
        // allocation. A peer writing concurrently can only make the copy observe mixed
        // bytes, which the pattern check reports.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.ptr as *const u8).add(offset),
                out.as_mut_ptr(),
                len,
            );
        }
        out
    }

    fn write(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: as in `read`, in the other direction.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (self.ptr as *mut u8).add(offset),
                data.len(),
            );
        }
    }

    fn read_word(&self, offset: usize) -> u64 {
        assert!(offset.is_multiple_of(8));
        self.check(offset, 8);
        // SAFETY: aligned (the allocation is of u64, the offset a multiple of 8) and in
        // range; volatile because other processes write it.
        unsafe { std::ptr::read_volatile(self.ptr.add(offset / 8)) }
    }

    fn write_word(&self, offset: usize, value: u64) {
        assert!(offset.is_multiple_of(8));
        self.check(offset, 8);
        // SAFETY: as in `read_word`.
        unsafe { std::ptr::write_volatile(self.ptr.add(offset / 8), value) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `Box::into_raw` of a boxed slice of `words` u64s and is
        // freed once, here.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.words)) });
    }
}

/// What this worker knows of one peer.
#[derive(Debug, Default)]
struct Peer {
    /// The incarnation the coordinator last announced up, and its listener.
    up: Option<(u64, Option<SocketAddr>)>,
    /// The last incarnation announced down, and when (Unix ms).
    down: Option<(u64, u64)>,
    /// The incarnation whose metadata this worker loaded last (the etcd watch may have
    /// loaded a later one since).
    loaded: Option<u64>,
    /// A transfer to the loaded incarnation failed with a disconnect.
    dead: bool,
    /// A WRITE not yet acknowledged: its acknowledgement word, when it completed.
    outstanding: Option<(u64, Instant)>,
    /// A new incarnation was loaded and nothing reached it yet.
    fresh: bool,
    next_seq: u64,
}

impl Peer {
    /// Whether incarnation `inc` is announced gone (down, or replaced by a later one).
    fn is_gone(&self, inc: u64) -> bool {
        self.down.is_some_and(|(d, _)| d >= inc) || self.up.is_some_and(|(u, _)| u > inc)
    }

    /// When incarnation `inc` was announced down (Unix ms).
    fn down_at(&self, inc: u64) -> Option<u64> {
        self.down.filter(|(d, _)| *d == inc).map(|(_, at)| at)
    }
}

fn error_kind(e: &Error) -> &'static str {
    match e {
        Error::RemoteDisconnect { .. } => "remote_disconnect",
        Error::UnknownAgent(_) => "unknown_agent",
        Error::MetadataRefused { .. } => "metadata_refused",
        Error::Timeout(_) => "timeout",
        Error::Io(_) => "io",
        Error::Stalled(_) => "stalled",
        Error::Canceled => "canceled",
        Error::Backend { .. } => "backend",
        Error::RemoteOutOfBounds { .. } => "remote_out_of_bounds",
        Error::MalformedMetadata(_) => "malformed_metadata",
        _ => "other",
    }
}

/// Errors a peer that died or left explains; any other (a stall above all) is a problem
/// whatever happened to the peer.
fn explained_by_a_fault(e: &Error) -> bool {
    matches!(
        e,
        Error::RemoteDisconnect { .. }
            | Error::UnknownAgent(_)
            | Error::MetadataRefused { .. }
            | Error::Timeout(_)
            | Error::Io(_)
            | Error::RemoteOutOfBounds { .. }
    ) || matches!(e, Error::Backend { backend, .. } if backend == "etcd" || backend == "listener")
}

struct Worker {
    config: WorkerConfig,
    layout: Layout,
    name: String,
    agent: Agent,
    arena: Arena,
    #[cfg(feature = "etcd")]
    etcd: Option<nixl::etcd::EtcdMetadata>,
    control: Receiver<ToWorker>,
    leave: bool,
    peers: Vec<Peer>,
    rng: Rng,
    /// Warm-up: every peer once, in random order, before random choices.
    first_round: Vec<usize>,
    /// The last acknowledgement word stored per initiator (strictly increasing).
    acked: Vec<u64>,
    counters: Counters,
    last_report: Instant,
}

fn send(msg: &FromWorker) {
    let line = serde_json::to_string(msg).expect("messages serialize");
    let mut out = std::io::stdout().lock();
    // The coordinator gone: nothing to report to (standard input ends too, and the
    // worker leaves).
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn dram(desc: Desc) -> DescList {
    DescList::from_descs(MemKind::Dram, [desc])
}

impl Worker {
    fn problem(&mut self, what: String) {
        tracing::error!("{what}");
        send(&FromWorker::Problem {
            what: format!("{}: {what}", self.name),
        });
    }

    fn report(&mut self, force: bool) {
        if force || self.last_report.elapsed() >= REPORT_EVERY {
            if !self.counters.is_empty() {
                send(&FromWorker::Counters(std::mem::take(&mut self.counters)));
            }
            if self.config.malloc_trim {
                HeapSample::trim();
            }
            if let Some(heap) = HeapSample::current() {
                send(&FromWorker::Heap(heap));
            }
            self.last_report = Instant::now();
        }
    }

    fn apply(&mut self, msg: ToWorker) {
        match msg {
            ToWorker::Leave => self.leave = true,
            ToWorker::Sweep => {
                let mut round: Vec<usize> = (0..self.config.agents)
                    .filter(|&j| j != self.config.index)
                    .collect();
                shuffle(&mut self.rng, &mut round);
                self.first_round = round;
            }
            ToWorker::Up {
                index,
                incarnation,
                listen,
            } if index < self.peers.len() && index != self.config.index => {
                let peer = &mut self.peers[index];
                if peer.up.is_none_or(|(u, _)| u < incarnation) {
                    peer.up = Some((incarnation, listen.and_then(|l| l.parse().ok())));
                    // A new incarnation starts with nothing of ours to acknowledge.
                    peer.outstanding = None;
                }
            }
            ToWorker::Down {
                index,
                incarnation,
                at_ms,
                ..
            } if index < self.peers.len() => {
                self.peers[index].down = Some((incarnation, at_ms));
            }
            _ => {}
        }
    }

    fn drain_control(&mut self) {
        loop {
            match self.control.try_recv() {
                Ok(msg) => self.apply(msg),
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.leave = true;
                    return;
                }
            }
        }
    }

    /// Counts `e`, met while reaching incarnation `inc` of peer `j`: as typed if the
    /// peer's death or departure explains it (waiting briefly for its announcement),
    /// otherwise as a problem. `posted_ms`: when the failed transfer was posted.
    fn classify(&mut self, j: usize, inc: u64, e: &Error, posted_ms: Option<u64>) {
        let kind = error_kind(e);
        if explained_by_a_fault(e) {
            let deadline = Instant::now() + EXPLAIN_GRACE;
            while !self.peers[j].is_gone(inc) && Instant::now() < deadline {
                match self.control.recv_timeout(Duration::from_millis(20)) {
                    Ok(msg) => self.apply(msg),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            if self.peers[j].is_gone(inc) {
                *self
                    .counters
                    .typed_errors
                    .entry(kind.to_string())
                    .or_default() += 1;
                if let (Some(down), Some(posted), Error::RemoteDisconnect { .. }) =
                    (self.peers[j].down_at(inc), posted_ms, e)
                {
                    if posted <= down {
                        let detection = unix_ms().saturating_sub(down);
                        self.counters.longest_detection_ms =
                            self.counters.longest_detection_ms.max(detection);
                    }
                }
                return;
            }
        }
        *self
            .counters
            .unexpected
            .entry(kind.to_string())
            .or_default() += 1;
        self.problem(format!(
            "{kind} from peer {} (incarnation {inc}, which no fault explains): {e}",
            agent_name(j)
        ));
    }

    fn serve_notifs(&mut self, notifs: HashMap<String, Vec<Vec<u8>>>) {
        for (from, msgs) in notifs {
            for msg in msgs {
                self.verify_notif(&from, &msg);
            }
        }
    }

    /// A WRITE's notification `W inc seq len seed`: checks the sender's slot and stores
    /// the acknowledgement.
    fn verify_notif(&mut self, from: &str, msg: &[u8]) {
        let text = String::from_utf8_lossy(msg);
        let fields: Vec<u64> = text
            .strip_prefix("W ")
            .map(|rest| rest.split(' ').filter_map(|f| f.parse().ok()).collect())
            .unwrap_or_default();
        let (Some(index), [inc, seq, len, seed]) = (agent_index(from), fields.as_slice()) else {
            self.problem(format!("malformed notification from `{from}`: {text:?}"));
            return;
        };
        let len = *len as usize;
        if index >= self.acked.len() || len > self.config.max_size {
            self.problem(format!("notification out of range from `{from}`: {text:?}"));
            return;
        }
        let word = ack_word(*inc, *seq);
        // A notification of an incarnation that is gone (announced down, or a later one
        // up) may be taken after its successor wrote into the same slot, or after the
        // successor's notifications: this worker takes its notifications only between
        // its own requests, which on a starved machine wait seconds (etcd requests). The
        // library delivered what landed; the slot no longer holds it. Counted, not
        // checked (found by a 30-minute etcd run at load 50: "corrupted" bytes that
        // were the next incarnation's).
        self.drain_control();
        if self.peers[index].is_gone(*inc) {
            let data = self.arena.read(self.layout.slot(index), len);
            if word <= self.acked[index] || mismatches(*seed, 0, &data).is_some() {
                *self
                    .counters
                    .typed_errors
                    .entry("superseded_notification".into())
                    .or_default() += 1;
                return;
            }
        }
        if word <= self.acked[index] {
            self.problem(format!(
                "notification from `{from}` out of order: {text:?} after ack {:#x}",
                self.acked[index]
            ));
            return;
        }
        let data = self.arena.read(self.layout.slot(index), len);
        if let Some((at, wrong)) = mismatches(*seed, 0, &data) {
            self.counters.corrupt_bytes += wrong as u64;
            self.problem(format!(
                "WRITE from `{from}` (incarnation {inc}, seq {seq}, {len} B): {wrong} corrupted bytes, the first at {at}"
            ));
            return;
        }
        self.acked[index] = word;
        self.arena.write_word(self.layout.ack(index), word);
        self.counters.notifs_verified += 1;
    }

    /// Waits (serving notifications and control messages) for up to `d`.
    fn idle(&mut self, d: Duration) {
        let notifs = self.agent.wait_notifs(d);
        self.serve_notifs(notifs);
        self.drain_control();
    }

    /// Loads peer `j`'s announced incarnation if it is not loaded; `false` if it cannot
    /// be reached now.
    fn ensure_loaded(&mut self, j: usize) -> bool {
        let Some((inc, listen)) = self.peers[j].up else {
            return false;
        };
        if self.peers[j].is_gone(inc) {
            return false;
        }
        let peer = &self.peers[j];
        if peer.loaded == Some(inc) && !peer.dead {
            return true;
        }
        if peer.loaded == Some(inc) && peer.dead {
            return false;
        }
        let name = agent_name(j);
        let mut refused_once = false;
        loop {
            let loaded = self.fetch(&name, listen);
            match loaded {
                Ok(_) => {
                    self.counters.loads += 1;
                    let peer = &mut self.peers[j];
                    peer.loaded = Some(inc);
                    peer.dead = false;
                    peer.fresh = true;
                    return true;
                }
                // The previous incarnation is bound until something says it is gone:
                // the directory does, so this application invalidates it.
                Err(Error::MetadataRefused { .. })
                    if !refused_once
                        && self.peers[j]
                            .loaded
                            .is_some_and(|l| self.peers[j].is_gone(l)) =>
                {
                    refused_once = true;
                    *self
                        .counters
                        .typed_errors
                        .entry("metadata_refused".into())
                        .or_default() += 1;
                    let _ = self.agent.invalidate_remote(&name);
                }
                Err(e) => {
                    self.classify(j, inc, &e, None);
                    return false;
                }
            }
        }
    }

    fn fetch(&mut self, name: &str, listen: Option<SocketAddr>) -> nixl::Result<String> {
        let by_etcd = match (self.config.metadata.uses_p2p(), listen) {
            (true, Some(_)) if self.config.metadata.uses_etcd() => self.rng.chance(0.5),
            (true, Some(_)) => false,
            _ => true,
        };
        if !by_etcd {
            let addr = listen.expect("checked");
            return self.agent.fetch_remote_metadata(addr);
        }
        #[cfg(feature = "etcd")]
        if let Some(etcd) = &self.etcd {
            return etcd.fetch(name);
        }
        Err(Error::InvalidParam(format!(
            "no way to fetch `{name}`: etcd is not in this build"
        )))
    }

    /// Runs one transfer of `len` bytes between local `local` and the peer's `remote`
    /// offsets, serving notifications while it is in flight. `Ok(elapsed)` when done.
    fn transfer(
        &mut self,
        j: usize,
        op: XferOp,
        local: usize,
        remote: usize,
        len: usize,
        notif: Option<Vec<u8>>,
    ) -> Result<Duration, Error> {
        let name = agent_name(j);
        let want = self.layout.len() as u64;
        let base = self
            .agent
            .remote_regions(&name)?
            .into_iter()
            .find(|r| r.desc.len >= want)
            .map(|r| r.desc.addr)
            .ok_or_else(|| Error::UnknownAgent(name.clone()))?;
        let mut req = self.agent.create_xfer_req(
            op,
            &dram(Desc::new(self.arena.addr(local), len as u64, 0)),
            &dram(Desc::new(base + remote as u64, len as u64, 0)),
            &name,
            notif,
        )?;
        let start = Instant::now();
        let hang = Duration::from_millis(self.config.stall_bound_ms) * 2;
        let mut status = req.post()?;
        let mut nap = Duration::from_micros(100);
        while status != XferStatus::Done {
            if start.elapsed() > hang {
                // Released by the drop below; the stall is the problem reported.
                return Err(Error::Stalled(start.elapsed()));
            }
            self.idle(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
            status = req.status()?;
        }
        let elapsed = start.elapsed();
        let expected = EXPECTED_BASE + Duration::from_secs_f64(len as f64 / EXPECTED_RATE);
        let stall = elapsed.saturating_sub(expected).as_millis() as u64;
        self.counters.longest_stall_ms = self.counters.longest_stall_ms.max(stall);
        if stall > self.config.stall_bound_ms {
            self.problem(format!(
                "{op:?} of {len} B to {name} took {elapsed:?}: {stall} ms past its expected time, beyond the bound"
            ));
        }
        if std::mem::take(&mut self.peers[j].fresh) {
            self.counters.longest_reconnect_ms = self
                .counters
                .longest_reconnect_ms
                .max(elapsed.as_millis() as u64);
        }
        Ok(elapsed)
    }

    /// A transfer that failed: counted, and the peer marked unreachable when it said so.
    fn failed(&mut self, j: usize, inc: u64, e: Error, posted_ms: u64) {
        if matches!(
            e,
            Error::RemoteDisconnect { .. }
                | Error::UnknownAgent(_)
                | Error::RemoteOutOfBounds { .. }
        ) {
            self.peers[j].dead = true;
        }
        self.classify(j, inc, &e, Some(posted_ms));
    }

    fn random_size(&mut self) -> usize {
        self.rng
            .range(self.config.min_size as u64, self.config.max_size as u64) as usize
    }

    fn do_read(&mut self, j: usize, inc: u64) {
        let len = self.random_size();
        let offset = self
            .rng
            .range(0, (self.layout.read_area_len() - len) as u64) as usize;
        let posted = unix_ms();
        match self.transfer(
            j,
            XferOp::Read,
            self.layout.read_destination(),
            self.layout.read_area() + offset,
            len,
            None,
        ) {
            Ok(_) => {
                let data = self.arena.read(self.layout.read_destination(), len);
                if let Some((at, wrong)) = mismatches(read_seed(j), offset, &data) {
                    self.counters.corrupt_bytes += wrong as u64;
                    self.problem(format!(
                        "READ of {len} B at {offset} from {}: {wrong} corrupted bytes, the first at {at}",
                        agent_name(j)
                    ));
                } else {
                    self.counters.reads += 1;
                    self.counters.bytes += len as u64;
                }
            }
            Err(e) => self.failed(j, inc, e, posted),
        }
    }

    /// Whether the outstanding WRITE to `j` was acknowledged (READing the word); `None`
    /// when the READ failed.
    fn check_ack(&mut self, j: usize, inc: u64) -> Option<bool> {
        let Some((want, since)) = self.peers[j].outstanding else {
            return Some(true);
        };
        let posted = unix_ms();
        let scratch = self.layout.ack_scratch();
        match self.transfer(
            j,
            XferOp::Read,
            scratch,
            self.layout.ack(self.config.index),
            8,
            None,
        ) {
            Ok(_) => {
                self.counters.ack_reads += 1;
                let got = self.arena.read_word(scratch);
                if got == want {
                    self.peers[j].outstanding = None;
                    return Some(true);
                }
                let mine = got >> 32 == self.config.incarnation;
                if mine && got > want {
                    self.problem(format!(
                        "{} acknowledged {got:#x}, beyond the last WRITE {want:#x}",
                        agent_name(j)
                    ));
                    self.peers[j].outstanding = None;
                    return Some(true);
                }
                let waited = since.elapsed();
                if waited > Duration::from_millis(self.config.stall_bound_ms) {
                    self.counters.longest_stall_ms = self
                        .counters
                        .longest_stall_ms
                        .max(waited.as_millis() as u64);
                    self.problem(format!(
                        "the WRITE {want:#x} to {} (incarnation {inc}) was not verified by its target within {waited:?} (acknowledgement word {got:#x}): notification lost?",
                        agent_name(j)
                    ));
                    self.peers[j].outstanding = None;
                }
                Some(false)
            }
            Err(e) => {
                self.failed(j, inc, e, posted);
                None
            }
        }
    }

    fn do_write(&mut self, j: usize, inc: u64) {
        match self.check_ack(j, inc) {
            Some(true) => {}
            // Not yet checked by the target: READ this turn instead.
            Some(false) => return self.do_read(j, inc),
            None => return,
        }
        let len = self.random_size();
        let seed = self.rng.next_u64();
        let mut data = vec![0u8; len];
        fill_pattern(seed, 0, &mut data);
        self.arena.write(self.layout.write_source(), &data);
        let seq = self.peers[j].next_seq + 1;
        self.peers[j].next_seq = seq;
        let notif = format!("W {} {seq} {len} {seed}", self.config.incarnation).into_bytes();
        let posted = unix_ms();
        match self.transfer(
            j,
            XferOp::Write,
            self.layout.write_source(),
            self.layout.slot(self.config.index),
            len,
            Some(notif),
        ) {
            Ok(_) => {
                self.counters.writes += 1;
                self.counters.bytes += len as u64;
                self.peers[j].outstanding =
                    Some((ack_word(self.config.incarnation, seq), Instant::now()));
            }
            Err(e) => self.failed(j, inc, e, posted),
        }
    }

    fn pick_peer(&mut self) -> usize {
        if let Some(j) = self.first_round.pop() {
            return j;
        }
        let others = self.config.agents as u64 - 1;
        let k = self.rng.range(0, others - 1) as usize;
        if k >= self.config.index {
            k + 1
        } else {
            k
        }
    }

    fn step(&mut self) {
        let j = self.pick_peer();
        if !self.ensure_loaded(j) {
            return;
        }
        let inc = self.peers[j].loaded.expect("loaded");
        if self.rng.chance(0.5) {
            self.do_write(j, inc);
        } else {
            self.do_read(j, inc);
        }
    }

    fn run(&mut self) {
        let interval = Duration::from_secs_f64(1.0 / self.config.rate.max(0.01));
        let mut next = Instant::now();
        while !self.leave {
            let now = Instant::now();
            if now >= next {
                self.step();
                next = now.max(next) + self.rng.exponential(interval);
            } else {
                self.idle((next - now).min(Duration::from_millis(50)));
            }
            self.report(false);
        }
    }

    /// Leaves as a well-behaved agent does: unpublishes, tells the peers it knows.
    fn leave(&mut self) {
        #[cfg(feature = "etcd")]
        if let Some(etcd) = &self.etcd {
            if let Err(e) = etcd.unpublish() {
                tracing::warn!("unpublishing: {e}");
            }
        }
        if self.config.metadata.uses_p2p() {
            let addrs: Vec<SocketAddr> = self
                .peers
                .iter()
                .filter(|p| p.up.is_some_and(|(inc, _)| !p.is_gone(inc)))
                .filter_map(|p| p.up.and_then(|(_, a)| a))
                .collect();
            for addr in addrs {
                // A peer that is gone meanwhile does not need telling.
                let _ = self.agent.invalidate_local_metadata(addr);
            }
        }
        let counters = std::mem::take(&mut self.counters);
        self.agent.shutdown();
        #[cfg(feature = "etcd")]
        drop(self.etcd.take());
        send(&FromWorker::Bye(counters));
    }
}

fn shuffle(rng: &mut Rng, v: &mut [usize]) {
    for i in (1..v.len()).rev() {
        let k = rng.range(0, i as u64) as usize;
        v.swap(i, k);
    }
}

/// The worker process: runs until asked to leave (exit 0), or fails to start (exit 1).
pub fn main(config: WorkerConfig) -> ExitCode {
    match start(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nixl-soak worker: {e}");
            ExitCode::FAILURE
        }
    }
}

fn start(config: WorkerConfig) -> nixl::Result<()> {
    let name = agent_name(config.index);
    let layout = config.layout();
    let agent = Agent::new(
        &name,
        AgentConfig {
            progress_thread: config.progress_thread,
            listen_addr: config
                .metadata
                .uses_p2p()
                .then(|| "127.0.0.1:0".parse().expect("an address")),
            stall_timeout: Duration::from_millis(config.stall_bound_ms),
            metadata_timeout: Duration::from_millis(config.metadata_timeout_ms),
            job_token: None,
        },
    )?;
    let params = config
        .backend_params
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    agent.create_backend("LIBFABRIC", &params)?;
    let arena = Arena::new(layout.len());
    let mut area = vec![0u8; layout.read_area_len()];
    fill_pattern(read_seed(config.index), 0, &mut area);
    arena.write(layout.read_area(), &area);
    // SAFETY: the arena outlives the registration: both live until this function
    // returns, the agent shut down (every transfer released) before either is dropped.
    let handle = unsafe { agent.register_mem(&dram(arena.desc()), None)? };

    #[cfg(feature = "etcd")]
    let etcd = if config.metadata.uses_etcd() {
        let mut c = nixl::etcd::EtcdConfig::new(config.etcd_endpoints.clone());
        c.namespace = config.etcd_namespace.clone();
        c.timeout = Duration::from_millis(config.metadata_timeout_ms);
        let etcd = nixl::etcd::EtcdMetadata::connect(&agent, c)?;
        etcd.publish()?;
        Some(etcd)
    } else {
        None
    };
    #[cfg(not(feature = "etcd"))]
    if config.metadata.uses_etcd() {
        return Err(Error::InvalidParam(
            "metadata through etcd needs nixl-soak built with feature `etcd`".into(),
        ));
    }

    let (tx, control) = mpsc::channel();
    std::thread::Builder::new()
        .name("soak-control".into())
        .spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<ToWorker>(&line) {
                    Ok(msg) => {
                        if tx.send(msg).is_err() {
                            return;
                        }
                    }
                    Err(e) => tracing::error!("bad control line {line:?}: {e}"),
                }
            }
            // The coordinator is gone or closed the pipe: leave.
            let _ = tx.send(ToWorker::Leave);
        })?;

    send(&FromWorker::Ready {
        listen: agent.listen_addr().map(|a| a.to_string()),
    });
    let mut rng = Rng::new(config.seed);
    let mut first_round: Vec<usize> = (0..config.agents).filter(|&j| j != config.index).collect();
    shuffle(&mut rng, &mut first_round);
    let mut worker = Worker {
        layout,
        name,
        agent,
        arena,
        #[cfg(feature = "etcd")]
        etcd,
        control,
        leave: false,
        peers: (0..config.agents).map(|_| Peer::default()).collect(),
        rng,
        first_round,
        acked: vec![0; config.agents],
        counters: Counters::default(),
        last_report: Instant::now(),
        config,
    };
    worker.run();
    worker.report(true);
    worker.leave();
    // The registration goes after the agent shut down, the arena (in `worker`) last.
    drop(handle);
    drop(worker);
    Ok(())
}
