//! The engine against a simulated transport: two sides in one thread, operations
//! delivered in a random order (seeded), every case of the protocol, cancellation,
//! failures, hostile requests, a busy transport, and slot accounting at the end.

use super::*;
use parking_lot::Mutex;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};

const CHUNK: usize = 64 << 10;
const CHUNKS: usize = 4;

#[derive(Debug)]
enum Kind {
    Write(Option<u64>),
    Read,
    Send(Vec<u8>),
    /// A send's local completion, delivered on its own (after the message).
    SendDone,
}

#[derive(Debug)]
struct Posted {
    from: usize,
    dest: usize,
    rail: usize,
    offset: u64,
    len: usize,
    addr: u64,
    kind: Kind,
    op: u64,
    completes: bool,
}

/// A side's transport: records posts, answers from a shared queue.
#[derive(Debug)]
struct MockNet {
    me: usize,
    queue: std::rc::Rc<RefCell<Vec<Posted>>>,
    base: Cell<u64>,
    len: Cell<usize>,
    /// Units landed: (key, side that offered them).
    landed: RefCell<Vec<(u64, usize)>>,
    /// Every n-th post is refused as busy (0: never).
    busy_every: Cell<u64>,
    posts: Cell<u64>,
    /// Completions of this side's RMA operations fail with a disconnect.
    fail_rma: Cell<bool>,
    /// Completions of this side's sends fail (after the message was delivered).
    fail_sends: Cell<bool>,
    /// FETCHes complete on the target's FETCHED ([`StageNet::fetch_answered`]), as on
    /// LIBFABRIC (the same on both sides, as a transport's wire version is).
    answered: Cell<bool>,
}

impl MockNet {
    fn busy(&self) -> bool {
        self.posts.set(self.posts.get() + 1);
        let n = self.busy_every.get();
        n != 0 && self.posts.get().is_multiple_of(n)
    }
}

impl StageNet for MockNet {
    type Addr = usize;
    /// The sending side's index, as the simulated transport knows it.
    type Sender = usize;
    fn rails(&self) -> usize {
        2
    }
    fn register_bounce(&self, ptr: *mut u8, len: usize) -> std::result::Result<(), Failure> {
        self.base.set(ptr as u64);
        self.len.set(len);
        Ok(())
    }
    fn bounce_remote(&self, _rail: usize, offset: u64) -> (u64, u64) {
        (self.base.get() + offset, 0)
    }
    fn local_name(&self, _rail: usize) -> Vec<u8> {
        format!("side{}", self.me).into_bytes()
    }
    fn resolve(
        &self,
        _rail: usize,
        name: &[u8],
        sender: &usize,
    ) -> std::result::Result<usize, Failure> {
        let named: usize = std::str::from_utf8(name)
            .ok()
            .and_then(|s| s.strip_prefix("side"))
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| Failure::new(22, "unknown name"))?;
        if named != *sender {
            return Err(Failure::new(1, "a name that is not the sender's"));
        }
        Ok(named)
    }
    fn is_sender(&self, addr: &usize, sender: &usize) -> bool {
        addr == sender
    }
    fn fetch_answered(&self) -> bool {
        self.answered.get()
    }
    fn write(
        &self,
        rail: usize,
        dest: &usize,
        offset: u64,
        len: usize,
        addr: u64,
        _key: u64,
        imm: Option<u64>,
        op: u64,
    ) -> std::result::Result<(), NetError> {
        assert!(
            offset + len as u64 <= self.len.get() as u64,
            "outside the pool"
        );
        if self.busy() {
            return Err(NetError::Busy);
        }
        self.queue.borrow_mut().push(Posted {
            from: self.me,
            dest: *dest,
            rail,
            offset,
            len,
            addr,
            kind: Kind::Write(imm),
            op,
            completes: true,
        });
        Ok(())
    }
    fn read(
        &self,
        rail: usize,
        src: &usize,
        offset: u64,
        len: usize,
        addr: u64,
        _key: u64,
        op: u64,
    ) -> std::result::Result<(), NetError> {
        assert!(
            offset + len as u64 <= self.len.get() as u64,
            "outside the pool"
        );
        if self.busy() {
            return Err(NetError::Busy);
        }
        self.queue.borrow_mut().push(Posted {
            from: self.me,
            dest: *src,
            rail,
            offset,
            len,
            addr,
            kind: Kind::Read,
            op,
            completes: true,
        });
        Ok(())
    }
    fn send(
        &self,
        rail: usize,
        dest: &usize,
        msg: &[u8],
        op: u64,
    ) -> std::result::Result<bool, NetError> {
        assert!(msg.len() <= MAX_CTRL_BYTES);
        if self.busy() {
            return Err(NetError::Busy);
        }
        // Small messages are "injected": no completion.
        let completes = msg.len() > 64;
        self.queue.borrow_mut().push(Posted {
            from: self.me,
            dest: *dest,
            rail,
            offset: 0,
            len: msg.len(),
            addr: 0,
            kind: Kind::Send(msg.to_vec()),
            op,
            completes,
        });
        Ok(completes)
    }
    fn landed(&self, key: u64, sender: &usize) -> bool {
        self.landed.borrow_mut().push((key, *sender));
        true
    }
}

#[derive(Debug, Default)]
struct SinkState {
    canceled: AtomicBool,
    progressed: AtomicUsize,
    finished: AtomicUsize,
    failed: Mutex<Option<Failure>>,
    user_copies: AtomicIsize,
}

#[derive(Debug)]
struct Sink(Arc<SinkState>);

impl RunSink for Sink {
    fn canceled(&self) -> bool {
        self.0.canceled.load(Ordering::Relaxed)
    }
    fn progressed(&self) {
        self.0.progressed.fetch_add(1, Ordering::Relaxed);
    }
    fn finished(&self) {
        assert!(self.0.failed.lock().is_none(), "finished after failing");
        self.0.finished.fetch_add(1, Ordering::Relaxed);
    }
    fn failed(&self, failure: Failure) {
        let mut f = self.0.failed.lock();
        assert!(f.is_none(), "failure reported twice");
        assert_eq!(
            self.0.finished.load(Ordering::Relaxed),
            0,
            "failed after finishing"
        );
        *f = Some(failure);
    }
    fn user_copy(&self, started: bool) {
        self.0
            .user_copies
            .fetch_add(if started { 1 } else { -1 }, Ordering::Relaxed);
    }
}

struct Side {
    engine: RefCell<Engine<usize, usize>>,
    net: MockNet,
}

struct World {
    sides: Vec<Side>,
    queue: std::rc::Rc<RefCell<Vec<Posted>>>,
    rng: super::wire::tests::Rng,
    /// Deliveries so far.
    steps: usize,
}

impl World {
    fn new(seed: u64) -> Self {
        let queue = std::rc::Rc::new(RefCell::new(Vec::new()));
        let sides = (0..2)
            .map(|me| Side {
                engine: RefCell::new(Engine::new(
                    Config {
                        chunk: CHUNK,
                        chunks: CHUNKS,
                    },
                    Box::<HostCopier>::default(),
                )),
                net: MockNet {
                    me,
                    queue: queue.clone(),
                    base: Cell::new(0),
                    len: Cell::new(0),
                    landed: RefCell::new(Vec::new()),
                    busy_every: Cell::new(0),
                    posts: Cell::new(0),
                    fail_rma: Cell::new(false),
                    fail_sends: Cell::new(false),
                    answered: Cell::new(false),
                },
            })
            .collect::<Vec<_>>();
        for s in &sides {
            s.engine.borrow_mut().ensure_bounce(&s.net, None).unwrap();
        }
        Self {
            sides,
            queue,
            // Small seeds mixed: xorshift's first outputs from them are not.
            rng: super::wire::tests::Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            steps: 0,
        }
    }

    /// The same world where FETCHes complete on their target's answer (LIBFABRIC).
    fn answered(seed: u64) -> Self {
        let w = Self::new(seed);
        for s in &w.sides {
            s.net.answered.set(true);
        }
        w
    }

    fn stage(&self, side: usize, buf: &[u8]) -> u64 {
        self.sides[side]
            .engine
            .borrow_mut()
            .add_region(buf.as_ptr() as u64, buf.len() as u64, None)
    }

    /// Delivers one posted operation (a random one); `false` when none is left.
    fn deliver_one(&mut self) -> bool {
        let n = self.queue.borrow().len();
        if n == 0 {
            return false;
        }
        let at = self.rng.below(n as u64) as usize;
        let p = self.queue.borrow_mut().swap_remove(at);
        self.steps += 1;
        if std::env::var("TRACE_MOCK").is_ok() {
            let what = match &p.kind {
                Kind::Send(m) => format!(
                    "{:?}",
                    Ctrl::decode(m).map(|c| match c {
                        Ctrl::Offer(r) => format!("OFFER {} pieces", r.pieces.len()),
                        Ctrl::Fetch(_) => "FETCH".into(),
                        Ctrl::Done { status, .. } => format!("DONE {status}"),
                        Ctrl::Fetched { pieces, .. } => format!("FETCHED {pieces}"),
                    })
                ),
                k => format!("{k:?}"),
            };
            eprintln!("deliver {at} of {n}: {what} from {}", p.from);
        }
        let from = &self.sides[p.from];
        let to = &self.sides[p.dest];
        let fail = from.net.fail_rma.get() && matches!(p.kind, Kind::Write(_) | Kind::Read);
        if let Kind::SendDone = p.kind {
            let result = if from.net.fail_sends.get() {
                Err(Failure::new(5, "send failed"))
            } else {
                Ok(())
            };
            from.engine
                .borrow_mut()
                .on_complete(&from.net, p.op, result);
            return true;
        }
        match &p.kind {
            _ if fail => {}
            Kind::Write(imm) => {
                // SAFETY: the engine posted a range of its pool, to memory the test owns.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (from.net.base.get() + p.offset) as *const u8,
                        p.addr as *mut u8,
                        p.len,
                    )
                };
                match imm {
                    Some(d) if d & FETCH_DATA != 0 => {
                        to.engine
                            .borrow_mut()
                            .on_fetch_data(&to.net, d & !FETCH_DATA, &p.from)
                    }
                    Some(key) => {
                        to.net.landed(*key, &p.from);
                    }
                    None => {}
                }
            }
            Kind::Read => {
                // SAFETY: as above, the other way.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        p.addr as *const u8,
                        (from.net.base.get() + p.offset) as *mut u8,
                        p.len,
                    )
                };
            }
            Kind::Send(msg) => {
                to.engine
                    .borrow_mut()
                    .on_message(&to.net, p.rail, &p.from, msg);
                if p.completes {
                    // Completes later, in any order with what the message caused.
                    self.queue.borrow_mut().push(Posted {
                        kind: Kind::SendDone,
                        ..p
                    });
                    return true;
                }
            }
            Kind::SendDone => unreachable!(),
        }
        if p.completes {
            let result = if fail {
                Err(Failure {
                    disconnect: true,
                    code: 107,
                    text: "peer gone".into(),
                })
            } else {
                Ok(())
            };
            from.engine
                .borrow_mut()
                .on_complete(&from.net, p.op, result);
        }
        true
    }

    /// Runs until nothing moves any more. Like the transport's workers, it polls an
    /// engine only while the engine asks to be polled; otherwise only deliveries drive
    /// it (so work that waits for a poll nobody makes shows up as a stall in `idle`).
    fn settle(&mut self) {
        for _ in 0..1_000_000 {
            if !self.deliver_one() {
                let mut polled = false;
                for s in &self.sides {
                    let mut e = s.engine.borrow_mut();
                    if e.needs_poll() {
                        e.progress(&s.net);
                        polled = true;
                    }
                }
                if self.queue.borrow().is_empty() && !polled {
                    return;
                }
            }
        }
        panic!("the pipeline never settled");
    }

    fn idle(&self) {
        for (i, s) in self.sides.iter().enumerate() {
            let e = s.engine.borrow();
            assert_eq!(e.slots_in_use(), (0, 0), "side {i} holds slots");
            assert!(!e.busy(), "side {i} still has work");
            assert_eq!(e.owners.len(), 0, "side {i} awaits operations");
            assert_eq!(e.requests, 0, "side {i} request count");
            assert_eq!(e.net_ops, 0, "side {i} operation count");
        }
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .rotate_left(u32::from(seed) % 31) as u8
                ^ seed
        })
        .collect()
}

/// A plan from side 0 to side 1: entries (local address, remote address, length).
fn plan(
    write: bool,
    local: Side_,
    remote_staged: bool,
    entries: &[(u64, u64, u64)],
    capacity: usize,
) -> Arc<Plan<usize>> {
    let refs = plan_chunks(
        entries.iter().enumerate().map(|(i, e)| (i, e.2)),
        capacity as u64,
        MAX_PIECES,
        u64::MAX,
    );
    let chunks = refs
        .into_iter()
        .enumerate()
        .map(|(c, pieces)| Chunk {
            rail: c % 2,
            dest: 1,
            local,
            remote_staged,
            pieces: pieces
                .iter()
                .map(|p| {
                    let (l, r, _) = entries[p.entry];
                    Piece {
                        local: l + p.offset,
                        local_net: (l + p.offset, 0),
                        remote: (r + p.offset, 0),
                        len: p.len,
                        slot_off: p.slot_off,
                    }
                })
                .collect(),
        })
        .collect();
    Arc::new(Plan { write, chunks })
}

use super::Side as Side_;

fn submit(w: &World, plan: Arc<Plan<usize>>, key: Option<u64>) -> Arc<SinkState> {
    let state = Arc::new(SinkState::default());
    let s = &w.sides[0];
    s.engine.borrow_mut().submit(
        &s.net,
        RunSpec {
            plan,
            key,
            peer: 1,
            sink: Box::new(Sink(state.clone())),
        },
    );
    state
}

/// Entries of the given sizes at odd offsets in `local` and `remote`.
fn layout(sizes: &[usize], local: &[u8], remote: &[u8]) -> Vec<(u64, u64, u64)> {
    let mut at = 1u64;
    sizes
        .iter()
        .map(|&s| {
            let e = (
                local.as_ptr() as u64 + at,
                remote.as_ptr() as u64 + at,
                s as u64,
            );
            at += s as u64 + 3;
            e
        })
        .collect()
}

#[test]
fn every_case_moves_the_data_and_returns_every_slot() {
    let sizes = [1usize, 4097, (3 << 20) + 5, CHUNK, CHUNK - 1, 100];
    let span: usize = sizes.iter().map(|s| s + 3).sum::<usize>() + 8;
    for (seed, (local_staged, remote_staged, answered)) in [
        (true, false, false),
        (false, true, false),
        (true, true, false),
        (false, true, true),
        (true, true, true),
    ]
    .into_iter()
    .enumerate()
    {
        let mut w = if answered {
            World::answered(seed as u64 + 11)
        } else {
            World::new(seed as u64 + 11)
        };
        let src = pattern(seed as u8, span);
        let dst = vec![0u8; span];
        let back = vec![0u8; span];
        if local_staged {
            w.stage(0, &src);
            w.stage(0, &back);
        }
        if remote_staged {
            w.stage(1, &dst);
        }
        let side = if local_staged {
            Side_::Staged(None)
        } else {
            Side_::Plain
        };
        // Both stage: the smaller slot; one side: its slot.
        let entries = layout(&sizes, &src, &dst);
        let p = plan(true, side, remote_staged, &entries, CHUNK);
        let units: u64 = p.chunks.iter().map(Chunk::units).sum();
        let sink = submit(&w, p, Some(77));
        w.settle();
        assert!(sink.failed.lock().is_none(), "{:?}", sink.failed);
        assert_eq!(sink.finished.load(Ordering::Relaxed), 1);
        assert_eq!(sink.user_copies.load(Ordering::Relaxed), 0);
        let blocks_ok = sizes.iter().zip(&entries).all(|(&s, e)| {
            let o = (e.0 - src.as_ptr() as u64) as usize;
            src[o..o + s] == dst[o..o + s] && dst[o - 1] == 0 && dst[o + s] == 0
        });
        assert!(
            blocks_ok,
            "WRITE local_staged={local_staged} remote_staged={remote_staged}"
        );
        let landed = w.sides[1].net.landed.borrow().clone();
        assert_eq!(landed.len() as u64, units, "notification data units");
        assert!(
            landed.iter().all(|k| *k == (77, 0)),
            "keys, offered by side 0"
        );
        w.idle();
        // READ it back.
        let entries = layout(&sizes, &back, &dst);
        let sink = submit(&w, plan(false, side, remote_staged, &entries, CHUNK), None);
        w.settle();
        assert!(sink.failed.lock().is_none(), "{:?}", sink.failed);
        assert_eq!(sink.finished.load(Ordering::Relaxed), 1);
        let back_ok = sizes.iter().zip(&entries).all(|(&s, e)| {
            let o = (e.0 - back.as_ptr() as u64) as usize;
            back[o..o + s] == src[o..o + s]
        });
        assert!(
            back_ok,
            "READ local_staged={local_staged} remote_staged={remote_staged} answered={answered}"
        );
        w.idle();
    }
}

#[test]
fn many_transfers_in_flight_share_bounded_slots_without_deadlock() {
    let mut w = World::new(5);
    const N: usize = 24;
    const LEN: usize = 300_000;
    let src: Vec<Vec<u8>> = (0..N).map(|i| pattern(i as u8, LEN)).collect();
    let dst: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; LEN]).collect();
    for (s, d) in src.iter().zip(&dst) {
        w.stage(0, s);
        w.stage(1, d);
    }
    w.sides[0].net.busy_every.set(3);
    w.sides[1].net.busy_every.set(5);
    let sinks: Vec<_> = (0..N)
        .map(|i| {
            let local = if i % 2 == 0 {
                Side_::Staged(None)
            } else {
                Side_::Plain
            };
            let e = [(src[i].as_ptr() as u64, dst[i].as_ptr() as u64, LEN as u64)];
            submit(&w, plan(true, local, i % 3 != 0, &e, CHUNK), Some(i as u64))
        })
        .collect();
    w.settle();
    for (i, s) in sinks.iter().enumerate() {
        assert!(s.failed.lock().is_none(), "{i}: {:?}", s.failed);
        assert_eq!(s.finished.load(Ordering::Relaxed), 1, "{i}");
        assert!(src[i] == dst[i], "{i}");
    }
    w.idle();
}

#[test]
fn a_released_transfer_stops_and_returns_its_slots() {
    for (stop_after, answered) in [1, 3, 10, 25, 40]
        .into_iter()
        .flat_map(|n| [(n, false), (n, true)])
    {
        let mut w = if answered {
            World::answered(stop_after)
        } else {
            World::new(stop_after)
        };
        let src = pattern(1, 2 << 20);
        let dst = vec![0u8; 2 << 20];
        w.stage(0, &src);
        w.stage(1, &dst);
        let e = [(src.as_ptr() as u64, dst.as_ptr() as u64, src.len() as u64)];
        for (write, remote_staged) in [(true, true), (false, true), (true, false), (false, false)] {
            let sink = submit(
                &w,
                plan(write, Side_::Staged(None), remote_staged, &e, CHUNK),
                None,
            );
            for _ in 0..stop_after {
                w.deliver_one();
            }
            // (A transfer that finished before its release stays finished.)
            let before = sink.finished.load(Ordering::Relaxed);
            sink.canceled.store(true, Ordering::Relaxed);
            w.settle();
            assert_eq!(
                sink.finished.load(Ordering::Relaxed),
                before,
                "stop after {stop_after}, write {write}, remote staged {remote_staged}, \
                 answered {answered}"
            );
            assert_eq!(sink.user_copies.load(Ordering::Relaxed), 0);
            w.idle();
        }
    }
}

#[test]
fn requests_naming_memory_that_is_not_staged_are_refused() {
    let mut w = World::new(3);
    let src = pattern(1, 100_000);
    let staged = vec![0u8; 100_000];
    let other = vec![0u8; 100_000];
    w.stage(1, &staged);
    for (what, remote, len) in [
        ("outside every region", other.as_ptr() as u64, 1000),
        (
            "running past the region",
            staged.as_ptr() as u64 + 99_000,
            2000,
        ),
    ] {
        for write in [true, false] {
            let e = [(src.as_ptr() as u64, remote, len)];
            let sink = submit(&w, plan(write, Side_::Plain, true, &e, CHUNK), Some(1));
            w.settle();
            let f = sink.failed.lock().clone();
            let f = f.unwrap_or_else(|| panic!("{what}: accepted"));
            assert_eq!(f.code, STATUS_INVALID, "{what}: {f:?}");
            assert!(!f.disconnect);
            assert!(w.sides[1].net.landed.borrow().is_empty());
            w.idle();
        }
    }
    assert!(other.iter().all(|b| *b == 0), "refused memory untouched");
    // A chunk larger than the target's slots is refused too.
    let e = [(src.as_ptr() as u64, staged.as_ptr() as u64, 100_000)];
    let sink = submit(&w, plan(true, Side_::Plain, true, &e, 100_000), None);
    w.settle();
    assert_eq!(sink.failed.lock().as_ref().unwrap().code, STATUS_INVALID);
    w.idle();
    // Garbage is dropped without a reply.
    let s = &w.sides[1];
    s.engine
        .borrow_mut()
        .on_message(&s.net, 0, &0, b"NXST\x01\x07\0\0garbage");
    assert!(w.queue.borrow().is_empty());
}

#[test]
fn failed_operations_fail_the_transfer_as_a_disconnect_and_free_the_slots() {
    for (write, remote_staged) in [(true, false), (false, false), (true, true), (false, true)] {
        let mut w = World::new(9);
        let src = pattern(2, 500_000);
        let dst = vec![0u8; 500_000];
        w.stage(0, &src);
        w.stage(1, &dst);
        // The side doing the RMA fails: the initiator for plain remote memory, the
        // target (serving) for staged.
        w.sides[usize::from(remote_staged)].net.fail_rma.set(true);
        let e = [(src.as_ptr() as u64, dst.as_ptr() as u64, src.len() as u64)];
        let sink = submit(
            &w,
            plan(write, Side_::Staged(None), remote_staged, &e, CHUNK),
            Some(3),
        );
        w.settle();
        let f = sink.failed.lock().clone().expect("failed");
        if remote_staged {
            assert_eq!(f.code, STATUS_FAILED, "the target reports it: {f:?}");
        } else {
            assert!(f.disconnect, "{f:?}");
        }
        assert_eq!(sink.finished.load(Ordering::Relaxed), 0);
        w.idle();
    }
}

#[test]
fn a_peer_gone_mid_fetch_releases_the_slots_it_could_have_written() {
    let mut w = World::new(4);
    let back = vec![0u8; 1 << 20];
    let remote = pattern(3, 1 << 20);
    w.stage(0, &back);
    w.stage(1, &remote);
    let e = [(
        back.as_ptr() as u64,
        remote.as_ptr() as u64,
        back.len() as u64,
    )];
    let sink = submit(&w, plan(false, Side_::Staged(None), true, &e, CHUNK), None);
    // The FETCHes went out and were never answered: the slots are held for the peer.
    let requests: Vec<Posted> = std::mem::take(&mut *w.queue.borrow_mut());
    assert!(!requests.is_empty());
    assert_eq!(w.sides[0].engine.borrow().slots_in_use().0, CHUNKS);
    // Released by the user: the slots stay (the peer may still write into them).
    sink.canceled.store(true, Ordering::Relaxed);
    w.settle();
    assert_eq!(
        w.sides[0].engine.borrow().slots_in_use().0,
        CHUNKS,
        "quarantined"
    );
    let s = &w.sides[0];
    s.engine.borrow_mut().peer_gone(&s.net, 1, "gone");
    assert_eq!(s.engine.borrow().slots_in_use(), (0, 0));
    assert!(!s.engine.borrow().busy());
    // Released before: nothing is reported to a request that is gone.
    assert!(sink.failed.lock().is_none());
    assert_eq!(sink.finished.load(Ordering::Relaxed), 0);
}

#[test]
fn a_notified_write_counts_one_unit_per_chunk_only_after_its_copy() {
    let mut w = World::new(8);
    let src = pattern(4, 5 * CHUNK + 17);
    let dst = vec![0u8; src.len()];
    w.stage(1, &dst);
    let e = [(src.as_ptr() as u64, dst.as_ptr() as u64, src.len() as u64)];
    let p = plan(true, Side_::Plain, true, &e, CHUNK);
    assert_eq!(p.chunks.len(), 6);
    let sink = submit(&w, p, Some(5));
    // Each unit that landed stands for a chunk already in the destination.
    while w.deliver_one() {
        let landed = w.sides[1].net.landed.borrow().len();
        let filled = dst
            .chunks(CHUNK)
            .zip(src.chunks(CHUNK))
            .filter(|(d, s)| d == s)
            .count();
        assert!(
            filled >= landed,
            "{landed} units but {filled} chunks in place"
        );
    }
    w.settle();
    assert_eq!(w.sides[1].net.landed.borrow().len(), 6);
    assert_eq!(sink.finished.load(Ordering::Relaxed), 1);
    assert!(w.steps > 6);
    w.idle();
}

#[test]
fn a_run_reports_one_outcome_even_when_its_last_operations_fail_late() {
    let mut outcomes = (0, 0);
    for seed in 0..200 {
        let mut w = World::new(seed);
        let src = pattern(5, 3 * CHUNK);
        let dst = vec![0u8; src.len()];
        w.stage(0, &src);
        w.stage(1, &dst);
        // A DONE may come before the completion of the OFFER's send, which then fails
        // (OFFERs of several pieces are too large to inject: their sends complete).
        w.sides[0].net.fail_sends.set(true);
        let e = layout(&[1000; 10], &src, &dst);
        let sink = submit(
            &w,
            plan(true, Side_::Staged(None), true, &e, CHUNK),
            Some(1),
        );
        w.settle();
        let finished = sink.finished.load(Ordering::Relaxed);
        let failed = sink.failed.lock().is_some();
        assert!(
            finished + usize::from(failed) == 1,
            "seed {seed}: one outcome"
        );
        outcomes.0 += finished;
        outcomes.1 += usize::from(failed);
        w.idle();
    }
    assert!(
        outcomes.0 > 0 && outcomes.1 > 0,
        "both orders seen: {outcomes:?}"
    );
}

/// The attacker of the tests below: a peer that is neither side (the transport names it
/// as side 2) and speaks the protocol, with tokens it guessed or observed.
const ATTACKER: usize = 2;

/// The token of the request side 0 has queued for side 1 (the first one found).
fn queued_request_token(w: &World) -> u64 {
    w.queue
        .borrow()
        .iter()
        .find_map(|p| match &p.kind {
            Kind::Send(m) => match Ctrl::decode(m) {
                Ok(Ctrl::Offer(r) | Ctrl::Fetch(r)) => Some(r.token),
                _ => None,
            },
            _ => None,
        })
        .expect("a request is queued")
}

#[test]
fn a_done_from_another_peer_than_the_target_is_refused() {
    for status in [STATUS_OK, STATUS_FAILED] {
        let mut w = World::new(21);
        let src = pattern(6, 3000);
        let dst = vec![0u8; src.len()];
        w.stage(1, &dst);
        let e = [(src.as_ptr() as u64, dst.as_ptr() as u64, src.len() as u64)];
        let sink = submit(&w, plan(true, Side_::Plain, true, &e, CHUNK), Some(9));
        let token = queued_request_token(&w);
        let forged = Ctrl::Done {
            token,
            status,
            reason: "forged".into(),
        }
        .encode()
        .unwrap();
        let s = &w.sides[0];
        s.engine
            .borrow_mut()
            .on_message(&s.net, 0, &ATTACKER, &forged);
        // Before the target read a byte: nothing may end, neither way.
        assert_eq!(sink.finished.load(Ordering::Relaxed), 0, "released early");
        assert!(sink.failed.lock().is_none(), "failed by a stranger");
        assert_eq!(s.engine.borrow().refused(), 1);
        w.settle();
        assert_eq!(sink.finished.load(Ordering::Relaxed), 1);
        assert_eq!(dst, src, "the real target's answer counts");
        assert_eq!(*w.sides[1].net.landed.borrow(), vec![(9, 0)]);
        w.idle();
    }
}

#[test]
fn fetch_data_from_another_peer_than_the_target_is_refused() {
    let mut w = World::new(22);
    let remote = pattern(7, 5000);
    let back = vec![0u8; remote.len()];
    w.stage(1, &remote);
    let e = [(
        back.as_ptr() as u64,
        remote.as_ptr() as u64,
        remote.len() as u64,
    )];
    let sink = submit(&w, plan(false, Side_::Plain, true, &e, CHUNK), None);
    let token = queued_request_token(&w);
    let s = &w.sides[0];
    for _ in 0..4 {
        s.engine
            .borrow_mut()
            .on_fetch_data(&s.net, token, &ATTACKER);
    }
    assert_eq!(
        sink.finished.load(Ordering::Relaxed),
        0,
        "a READ done without data"
    );
    assert_eq!(s.engine.borrow().refused(), 4);
    w.settle();
    assert_eq!(sink.finished.load(Ordering::Relaxed), 1);
    assert_eq!(back, remote);
    w.idle();
}

#[test]
fn a_request_naming_another_requester_is_refused() {
    let mut w = World::new(23);
    let victim = pattern(8, 4096);
    let staged = vec![0u8; 4096];
    w.stage(1, &staged);
    for offer in [true, false] {
        // The attacker asks the target to pull from (OFFER) or push to (FETCH) side 0's
        // memory, answering side 0.
        let req = Request {
            token: 5,
            key: offer.then_some(3),
            reply_to: b"side0".to_vec(),
            pieces: vec![WirePiece {
                peer_addr: victim.as_ptr() as u64,
                peer_key: 0,
                target: staged.as_ptr() as u64,
                len: 4096,
            }],
        };
        let msg = if offer {
            Ctrl::Offer(req)
        } else {
            Ctrl::Fetch(req)
        };
        let s = &w.sides[1];
        s.engine
            .borrow_mut()
            .on_message(&s.net, 0, &ATTACKER, &msg.encode().unwrap());
        assert!(w.queue.borrow().is_empty(), "the target acted on it");
        w.settle();
    }
    assert_eq!(w.sides[1].engine.borrow().refused(), 2);
    assert!(staged.iter().all(|b| *b == 0), "staged memory untouched");
    assert!(w.sides[1].net.landed.borrow().is_empty(), "no unit counted");
    w.idle();
}

/// Issue 26: the staged pipeline keeps several chunks of ONE transfer in flight on both
/// sides (not one chunk at a time): this side's slots while its chunks' network
/// operations run, the target's serve slots while it pulls or pushes several chunks,
/// and several network operations queued at once — every case, WRITE and READ.
#[test]
fn one_transfer_keeps_several_chunks_in_flight_on_both_sides() {
    let len = 8 * CHUNK + 5;
    for (seed, (write, local_staged, remote_staged)) in [
        (true, true, false),
        (false, true, false),
        (true, false, true),
        (false, false, true),
        (true, true, true),
        (false, true, true),
    ]
    .into_iter()
    .enumerate()
    {
        let mut w = World::new(seed as u64 + 101);
        let src = pattern(seed as u8 + 1, len);
        let dst = vec![0u8; len];
        if local_staged {
            w.stage(0, &src);
        }
        if remote_staged {
            w.stage(1, &dst);
        }
        let side = if local_staged {
            Side_::Staged(None)
        } else {
            Side_::Plain
        };
        let (from, to) = if write { (&src, &dst) } else { (&dst, &src) };
        // READ: fill the remote side first (plain copy), then read it into `src`'s place.
        let remote_fill = pattern(seed as u8 + 7, len);
        let target_buf: &[u8] = if write { &dst } else { &remote_fill };
        if !write && remote_staged {
            w.stage(1, &remote_fill);
        }
        let local_buf = if write { from } else { to };
        let e = [(
            local_buf.as_ptr() as u64,
            target_buf.as_ptr() as u64,
            len as u64,
        )];
        let sink = submit(&w, plan(write, side, remote_staged, &e, CHUNK), None);
        let (mut max_local, mut max_serve, mut max_queued) = (0, 0, 0);
        for _ in 0..1_000_000 {
            max_queued = max_queued.max(w.queue.borrow().len());
            max_local = max_local.max(w.sides[0].engine.borrow().slots_in_use().0);
            max_serve = max_serve.max(w.sides[1].engine.borrow().slots_in_use().1);
            if !w.deliver_one() {
                let mut polled = false;
                for s in &w.sides {
                    let mut e = s.engine.borrow_mut();
                    if e.needs_poll() {
                        e.progress(&s.net);
                        polled = true;
                    }
                }
                if w.queue.borrow().is_empty() && !polled {
                    break;
                }
            }
        }
        let tag =
            format!("write={write} local_staged={local_staged} remote_staged={remote_staged}");
        assert!(sink.failed.lock().is_none(), "{tag}: {:?}", sink.failed);
        assert_eq!(sink.finished.load(Ordering::Relaxed), 1, "{tag}");
        let (got, want) = if write {
            (&dst[..], &src[..])
        } else {
            (&src[..], &remote_fill[..])
        };
        assert!(got == want, "{tag}: data");
        assert!(max_queued >= 2, "{tag}: one network operation at a time");
        if local_staged {
            assert!(max_local >= 2, "{tag}: one local slot at a time");
        }
        if remote_staged {
            assert!(
                max_serve >= 2,
                "{tag}: the target serves one chunk at a time"
            );
        }
        w.idle();
    }
}

/// The token of the FETCH side 0 has queued for side 1, and its piece count.
fn queued_fetch(w: &World) -> (u64, usize) {
    w.queue
        .borrow()
        .iter()
        .find_map(|p| match &p.kind {
            Kind::Send(m) => match Ctrl::decode(m) {
                Ok(Ctrl::Fetch(r)) => Some((r.token, r.pieces.len())),
                _ => None,
            },
            _ => None,
        })
        .expect("a FETCH is queued")
}

/// Issue 28, the last LIBFABRIC gap: a FETCH's data is remote CQ data, which cannot be
/// sealed, and `shm` attributes a flood's words to a loaded peer. Where FETCHes are
/// answered, data words with the live token — from a stranger, and from the target
/// itself (what a misattributed forgery looks like) — more than the FETCH has pieces,
/// end nothing: no byte is copied out of the slot, the slot stays held, no answer is
/// taken from anyone but the target, and one with the wrong counts fails the transfer.
/// The real FETCH then completes with the target's bytes.
#[test]
fn with_answered_fetches_forged_data_words_end_nothing() {
    for (seed, local) in [(31, Side_::Plain), (32, Side_::Staged(None))] {
        let mut w = World::answered(seed);
        let remote = pattern(9, 3 * CHUNK / 2);
        let back = vec![0u8; remote.len()];
        w.stage(1, &remote);
        if local != Side_::Plain {
            w.stage(0, &back);
        }
        let entries = layout(&[1000, 5000, 20_000], &back, &remote);
        let sink = submit(&w, plan(false, local, true, &entries, CHUNK), None);
        let (token, pieces) = queued_fetch(&w);
        let s = &w.sides[0];
        let held = s.engine.borrow().slots_in_use();
        for from in [ATTACKER, 1] {
            for _ in 0..=pieces {
                s.engine.borrow_mut().on_fetch_data(&s.net, token, &from);
            }
        }
        // A FETCHED from anyone but the target is refused.
        let forged = Ctrl::Fetched {
            token,
            pieces: pieces as u16,
            bytes: 26_000,
        }
        .encode()
        .unwrap();
        s.engine
            .borrow_mut()
            .on_message(&s.net, 0, &ATTACKER, &forged);
        assert_eq!(s.engine.borrow().refused(), 1, "{local:?}");
        assert_eq!(
            sink.finished.load(Ordering::Relaxed),
            0,
            "{local:?}: a READ done on forged data words"
        );
        assert!(sink.failed.lock().is_none(), "{local:?}");
        assert_eq!(sink.user_copies.load(Ordering::Relaxed), 0, "{local:?}");
        assert_eq!(s.engine.borrow().slots_in_use(), held, "{local:?}");
        assert!(back.iter().all(|&b| b == 0), "{local:?}: bytes moved");
        w.settle();
        assert!(sink.failed.lock().is_none(), "{local:?}: {:?}", sink.failed);
        assert_eq!(sink.finished.load(Ordering::Relaxed), 1, "{local:?}");
        let ok = entries.iter().all(|e| {
            let o = (e.0 - back.as_ptr() as u64) as usize;
            back[o..o + e.2 as usize] == remote[o..o + e.2 as usize]
        });
        assert!(ok, "{local:?}: the READ's bytes");
        w.idle();
    }
    // The target's answer with counts that are not the FETCH's fails the transfer.
    let mut w = World::answered(33);
    let remote = pattern(10, 4096);
    let back = vec![0u8; remote.len()];
    w.stage(1, &remote);
    let e = [(back.as_ptr() as u64, remote.as_ptr() as u64, 4096)];
    let sink = submit(&w, plan(false, Side_::Plain, true, &e, CHUNK), None);
    let (token, _) = queued_fetch(&w);
    let wrong = Ctrl::Fetched {
        token,
        pieces: 1,
        bytes: 4095,
    }
    .encode()
    .unwrap();
    let s = &w.sides[0];
    s.engine.borrow_mut().on_message(&s.net, 0, &1, &wrong);
    assert_eq!(
        sink.failed.lock().as_ref().map(|f| f.code),
        Some(STATUS_FAILED)
    );
    w.settle();
    assert_eq!(sink.finished.load(Ordering::Relaxed), 0);
    w.idle();
}

/// A released READ whose FETCHes into local slots went out: data words (forged, as many
/// as the pieces) do not free the slots the target may still write into; the target's
/// answer does.
#[test]
fn with_answered_fetches_only_the_answer_frees_a_released_fetch_slot() {
    let mut w = World::answered(34);
    let back = vec![0u8; 2 * CHUNK];
    let remote = pattern(11, back.len());
    w.stage(0, &back);
    w.stage(1, &remote);
    let e = [(
        back.as_ptr() as u64,
        remote.as_ptr() as u64,
        back.len() as u64,
    )];
    let sink = submit(&w, plan(false, Side_::Staged(None), true, &e, CHUNK), None);
    let requests: Vec<Posted> = std::mem::take(&mut *w.queue.borrow_mut());
    let fetches: Vec<(u64, usize)> = requests
        .iter()
        .filter_map(|p| match &p.kind {
            Kind::Send(m) => match Ctrl::decode(m) {
                Ok(Ctrl::Fetch(r)) => Some((r.token, r.pieces.len())),
                _ => None,
            },
            _ => None,
        })
        .collect();
    assert_eq!(fetches.len(), 2);
    sink.canceled.store(true, Ordering::Relaxed);
    let s = &w.sides[0];
    // The release is seen on the next round (nothing else would poll this engine).
    s.engine.borrow_mut().progress(&s.net);
    assert_eq!(s.engine.borrow().slots_in_use().0, 2, "held for the target");
    for &(token, pieces) in &fetches {
        for _ in 0..pieces {
            s.engine
                .borrow_mut()
                .on_fetch_data(&s.net, token, &ATTACKER);
        }
    }
    s.engine.borrow_mut().progress(&s.net);
    assert_eq!(s.engine.borrow().slots_in_use().0, 2, "quarantined");
    // The target gets the FETCHes now: it writes, answers, and the slots go.
    w.queue.borrow_mut().extend(requests);
    w.settle();
    assert_eq!(sink.finished.load(Ordering::Relaxed), 0);
    w.idle();
}
