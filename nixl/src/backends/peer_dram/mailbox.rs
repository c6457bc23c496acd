//! A shared-memory lane for direct-copy requests and their answers between two processes
//! of one host, beside the control connection that set it up: a request or an answer
//! crosses as a few stores and loads instead of a system call on each side and a wake-up
//! of the reader (a 1 MiB request's round trip is mostly those crossings).
//!
//! The target makes the lane when a peer it attributed by the transport (a same-host
//! control connection, `SO_PEERCRED`) asks for one: a `memfd`, sized and then sealed
//! against shrinking and growing (neither side can make the other's loads fault), mapped
//! in the target and handed to that peer alone over the connection (`SCM_RIGHTS`). What
//! arrives in the lane is that connection's peer's, as what arrives on the connection is.
//!
//! Neither side trusts what the other writes there: each copies an entry out (its length
//! bounded by the slot) before decoding it, and an index the other side moved impossibly
//! (more entries than the ring holds) breaks the lane, which then carries nothing more
//! (the connection still does).
//!
//! Layout (little-endian, each index on its own cache line): a header (magic, version,
//! slot counts and sizes), the request ring's head (written by the initiator) and tail
//! (by the target), the answer ring's head (target) and tail (initiator), the target's
//! "asleep" flag (set before it blocks on its connections: a request then also rings the
//! connection), then [`REQUEST_SLOTS`] request slots of [`REQUEST_SLOT`] bytes and
//! [`ANSWER_SLOTS`] answer slots of [`ANSWER_SLOT`] bytes, each a `u32` length and bytes.

use parking_lot::Mutex;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};

/// First bytes of the header.
const MAGIC: u64 = u64::from_le_bytes(*b"NXPVMBX1");
/// Requests the ring holds.
pub(crate) const REQUEST_SLOTS: u64 = 64;
/// Bytes of a request slot (a length and the request): a request longer than the slot
/// goes on the connection.
pub(crate) const REQUEST_SLOT: usize = 4096;
/// Answers the ring holds.
pub(crate) const ANSWER_SLOTS: u64 = 256;
/// Bytes of an answer slot (a traced answer is 50 bytes).
pub(crate) const ANSWER_SLOT: usize = 128;

const LINE: usize = 64;
const REQ_HEAD: usize = LINE;
const REQ_TAIL: usize = 2 * LINE;
const ANS_HEAD: usize = 3 * LINE;
const ANS_TAIL: usize = 4 * LINE;
const ASLEEP: usize = 5 * LINE;
const CLOSED: usize = 6 * LINE;
const REQUESTS: usize = 4096;
const ANSWERS: usize = REQUESTS + REQUEST_SLOTS as usize * REQUEST_SLOT;
/// Bytes of the whole lane.
pub(crate) const LEN: usize = ANSWERS + ANSWER_SLOTS as usize * ANSWER_SLOT;
/// The header's second word: the rings' slot counts and sizes.
const SIZES: u64 = (REQUEST_SLOTS << 48)
    | ((REQUEST_SLOT as u64) << 32)
    | (ANSWER_SLOTS << 16)
    | ANSWER_SLOT as u64;

/// Why a lane cannot be made or taken, or stopped carrying.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LaneError(pub(crate) String);

impl std::fmt::Display for LaneError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn os_error(what: &str) -> LaneError {
    LaneError(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// One side's mapping of a lane.
#[derive(Debug)]
pub(crate) struct Mailbox {
    base: *mut u8,
    /// The target's descriptor, until the peer has its own (a descriptor per lane and
    /// side for as long as peers are loaded would add up; the mapping needs none).
    fd: Mutex<Option<OwnedFd>>,
    /// The other side moved an index impossibly: nothing more goes through.
    broken: AtomicBool,
    /// This side's pushes, and its pops: each ring has one producing and one consuming
    /// side, whose threads take turns here.
    pushing: Mutex<()>,
    popping: Mutex<()>,
}

// SAFETY: the mapping is shared memory touched only through atomics (indices, flag) and
// byte copies of slots the ring protocol gives to one writer at a time; `base` stays
// valid until drop.
unsafe impl Send for Mailbox {}
// SAFETY: as above; each ring has one producing and one consuming side, and this side's
// threads take turns to push and to pop (`pushing`, `popping`).
unsafe impl Sync for Mailbox {}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // SAFETY: `base` is this object's mapping of `LEN` bytes, unmapped once.
        unsafe { libc::munmap(self.base.cast(), LEN) };
    }
}

impl Mailbox {
    /// A new lane (the target's side): a sealed `memfd` of [`LEN`] bytes, mapped, with
    /// its header written.
    pub(crate) fn create() -> Result<Self, LaneError> {
        // SAFETY: a NUL-terminated name and valid flags.
        let raw = unsafe {
            libc::memfd_create(
                c"nixl-peer-copy-lane".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: a descriptor memfd_create just returned, owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a valid descriptor and length.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), LEN as libc::off_t) } != 0 {
            return Err(os_error("ftruncate"));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: a valid memfd made with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(os_error("sealing the lane"));
        }
        let lane = Self::map(fd)?;
        lane.u64_at(0).store(MAGIC, Ordering::Relaxed);
        lane.u64_at(8).store(SIZES, Ordering::Release);
        Ok(lane)
    }

    /// The initiator's side of a lane the target handed over: taken only when it is a
    /// sealed file of the expected size and layout (a lane that could shrink under this
    /// process would fault its loads).
    pub(crate) fn take(fd: OwnedFd) -> Result<Self, LaneError> {
        // SAFETY: a valid descriptor; F_GET_SEALS fails on a file that is not a memfd.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(os_error("the lane's seals"));
        }
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(LaneError("the lane is not sealed against shrinking".into()));
        }
        // SAFETY: plain data, written by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_error("fstat of the lane"));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || (st.st_size as u64) < LEN as u64 {
            return Err(LaneError(format!(
                "the lane is not a regular file of {LEN} bytes ({} bytes)",
                st.st_size
            )));
        }
        let lane = Self::map(fd)?;
        // Mapped: this side needs no descriptor.
        lane.release_fd();
        if lane.u64_at(0).load(Ordering::Relaxed) != MAGIC
            || lane.u64_at(8).load(Ordering::Acquire) != SIZES
        {
            return Err(LaneError("the lane's header is not this version's".into()));
        }
        Ok(lane)
    }

    fn map(fd: OwnedFd) -> Result<Self, LaneError> {
        // SAFETY: a shared mapping of LEN bytes of a file at least that long (checked or
        // sized by the caller, and sealed against shrinking).
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_error("mapping the lane"));
        }
        Ok(Self {
            base: base.cast(),
            fd: Mutex::new(Some(fd)),
            broken: AtomicBool::new(false),
            pushing: Mutex::new(()),
            popping: Mutex::new(()),
        })
    }

    /// The descriptor to hand to the peer (`None` once released).
    pub(crate) fn fd(&self) -> Option<RawFd> {
        self.fd.lock().as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Closes this side's descriptor (the mapping stays): once the peer has its own.
    pub(crate) fn release_fd(&self) {
        self.fd.lock().take();
    }

    /// Whether the other side broke the lane (it carries nothing more).
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    fn u64_at(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is one of the header's 8-byte aligned offsets inside the mapping
        // (page aligned), which lives as long as `self`.
        unsafe { &*self.base.add(at).cast::<AtomicU64>() }
    }

    fn asleep(&self) -> &AtomicU32 {
        // SAFETY: as `u64_at`, a 4-byte aligned offset of the header.
        unsafe { &*self.base.add(ASLEEP).cast::<AtomicU32>() }
    }

    fn closed(&self) -> &AtomicU32 {
        // SAFETY: as `u64_at`, a 4-byte aligned offset of the header.
        unsafe { &*self.base.add(CLOSED).cast::<AtomicU32>() }
    }

    /// Target: the lane carries no more requests (its peer was unloaded or reloaded);
    /// the initiator's pushes fail from now, and what it pushed before is still there
    /// for the target to answer.
    pub(crate) fn close(&self) {
        self.closed().store(1, Ordering::Release);
    }

    /// Puts `bytes` in the next slot of the ring at `slots` (`head` this side's, `tail`
    /// the other's).
    fn push(&self, ring: Ring, bytes: &[u8]) -> Push {
        if self.is_broken() || bytes.len() + 4 > ring.slot {
            return Push::Unusable;
        }
        let _turn = self.pushing.lock();
        let head = self.u64_at(ring.head).load(Ordering::Relaxed);
        let tail = self.u64_at(ring.tail).load(Ordering::Acquire);
        let used = head.wrapping_sub(tail);
        if used > ring.slots {
            self.broken.store(true, Ordering::Relaxed);
            return Push::Unusable;
        }
        if used == ring.slots {
            return Push::Full;
        }
        let at = ring.at + (head % ring.slots) as usize * ring.slot;
        // SAFETY: the slot lies inside the mapping; the protocol gives it to this side
        // until `head` moves past it (the other side reads it only then).
        unsafe {
            let slot = self.base.add(at);
            std::ptr::copy_nonoverlapping((bytes.len() as u32).to_le_bytes().as_ptr(), slot, 4);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), slot.add(4), bytes.len());
        }
        self.u64_at(ring.head).store(head + 1, Ordering::Release);
        Push::Pushed
    }

    /// Copies the ring's next entry into `out` (cleared first); `Ok(false)` where none
    /// is there, `Err` where the other side broke the lane (an impossible index or
    /// length: the lane then carries nothing more).
    fn pop(&self, ring: Ring, out: &mut Vec<u8>) -> Result<bool, LaneError> {
        out.clear();
        if self.is_broken() {
            return Err(LaneError("the lane is broken".into()));
        }
        let _turn = self.popping.lock();
        let tail = self.u64_at(ring.tail).load(Ordering::Relaxed);
        let head = self.u64_at(ring.head).load(Ordering::Acquire);
        let ready = head.wrapping_sub(tail);
        if ready == 0 {
            return Ok(false);
        }
        if ready > ring.slots {
            return Err(self.break_lane("an index moved past the ring"));
        }
        let at = ring.at + (tail % ring.slots) as usize * ring.slot;
        let mut len = [0u8; 4];
        // SAFETY: the slot lies inside the mapping; its length is read once and bounded
        // below before any byte after it is read.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at), len.as_mut_ptr(), 4) };
        let len = u32::from_le_bytes(len) as usize;
        if len + 4 > ring.slot {
            return Err(self.break_lane("an entry longer than its slot"));
        }
        out.resize(len, 0);
        // SAFETY: `len + 4` bytes of the slot lie inside the mapping (checked above);
        // copied out once, so the other side's later stores cannot change what is decoded.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at + 4), out.as_mut_ptr(), len) };
        self.u64_at(ring.tail).store(tail + 1, Ordering::Release);
        Ok(true)
    }

    fn break_lane(&self, why: &str) -> LaneError {
        self.broken.store(true, Ordering::Relaxed);
        LaneError(format!("the peer broke the shared lane: {why}"))
    }

    /// Initiator: queues a request; false where it goes on the connection instead (too
    /// long, the ring full, the lane broken).
    pub(crate) fn push_request(&self, request: &[u8]) -> bool {
        self.try_push_request(request) == Push::Pushed
    }

    /// Initiator: queues a request or says why not: `Full` (for now: the reader is
    /// behind) or `Unusable` (too long for a slot, the lane closed or broken: never).
    pub(crate) fn try_push_request(&self, request: &[u8]) -> Push {
        if self.closed().load(Ordering::Acquire) != 0 {
            return Push::Unusable;
        }
        self.push(Ring::REQUESTS, request)
    }

    /// Initiator: whether the target said it sleeps (a request must then also ring the
    /// connection). Called after [`Self::push_request`]; the fence orders the two so that
    /// a target going to sleep either sees the request or has said it sleeps.
    pub(crate) fn target_asleep(&self) -> bool {
        fence(Ordering::SeqCst);
        self.asleep().load(Ordering::Relaxed) != 0
    }

    /// Target: the next request, copied into `out`.
    pub(crate) fn pop_request(&self, out: &mut Vec<u8>) -> Result<bool, LaneError> {
        self.pop(Ring::REQUESTS, out)
    }

    /// Target: hands each waiting request to `each` (copied into `buf`, and marked
    /// received for `peer_dram::trace`), a ringful at most: the caller's other work gets
    /// its turn. Returns how many; `Err` where the peer broke the lane (those before it
    /// were handed over).
    pub(crate) fn take_requests(
        &self,
        buf: &mut Vec<u8>,
        mut each: impl FnMut(&[u8]),
    ) -> Result<u64, LaneError> {
        let mut taken = 0;
        while taken < REQUEST_SLOTS && self.pop_request(buf)? {
            super::trace::mark_received();
            each(buf);
            taken += 1;
        }
        Ok(taken)
    }

    /// Target: says it is about to block (`true`) or awake (`false`). After saying it
    /// sleeps, the target looks at the ring once more before blocking (see
    /// [`Self::target_asleep`]).
    pub(crate) fn set_asleep(&self, asleep: bool) {
        self.asleep().store(u32::from(asleep), Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Requests pushed so far (the ring's head).
    #[cfg(test)]
    pub(crate) fn requests_pushed(&self) -> u64 {
        self.u64_at(REQ_HEAD).load(Ordering::Acquire)
    }

    /// Target: whether a request waits (without taking it).
    pub(crate) fn has_request(&self) -> bool {
        let tail = self.u64_at(REQ_TAIL).load(Ordering::Relaxed);
        self.u64_at(REQ_HEAD).load(Ordering::Acquire) != tail
    }

    /// Target: queues an answer; false where it goes on the connection instead.
    pub(crate) fn push_answer(&self, answer: &[u8]) -> bool {
        self.push(Ring::ANSWERS, answer) == Push::Pushed
    }

    /// Initiator: the next answer, copied into `out`.
    pub(crate) fn pop_answer(&self, out: &mut Vec<u8>) -> Result<bool, LaneError> {
        self.pop(Ring::ANSWERS, out)
    }
}

/// What a peer may do to a lane (`input`: anything it writes over the indices and the
/// request slots) must never make the other side read past a slot, take more than a
/// ringful, or fail to push and pop afterwards: the fuzzing driver (`nixl/fuzz`, target
/// `peer_lane`). One lane per thread, its shared words reset each time.
#[doc(hidden)]
pub fn fuzz_lane(input: &[u8]) -> bool {
    thread_local! {
        static LANE: Option<Mailbox> = Mailbox::create().ok();
    }
    LANE.with(|lane| {
        let Some(lane) = lane else {
            return true;
        };
        // A fresh lane's shared words, then the peer's bytes over the four indices and
        // the request slots.
        for at in [REQ_HEAD, REQ_TAIL, ANS_HEAD, ANS_TAIL] {
            lane.u64_at(at).store(0, Ordering::Relaxed);
        }
        lane.broken.store(false, Ordering::Relaxed);
        for (i, chunk) in input.chunks(8).take(4).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            let at = [REQ_HEAD, REQ_TAIL, ANS_HEAD, ANS_TAIL][i];
            lane.u64_at(at)
                .store(u64::from_le_bytes(word), Ordering::Relaxed);
        }
        let slots = input.get(32..).unwrap_or_default();
        let room = REQUEST_SLOTS as usize * REQUEST_SLOT;
        let slots = &slots[..slots.len().min(room)];
        // SAFETY: `slots` fits the request ring, inside the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(slots.as_ptr(), lane.base.add(REQUESTS), slots.len())
        };
        let mut out = Vec::new();
        let mut taken = 0u64;
        while let Ok(true) = lane.pop_request(&mut out) {
            taken += 1;
            if out.len() + 4 > REQUEST_SLOT || taken > REQUEST_SLOTS {
                return false;
            }
        }
        // Answers behind whatever tail the peer wrote: bounded, never past the ring.
        for _ in 0..=ANSWER_SLOTS {
            lane.push_answer(b"answer");
        }
        let mut answers = 0u64;
        while let Ok(true) = lane.pop_answer(&mut out) {
            answers += 1;
            if answers > ANSWER_SLOTS {
                return false;
            }
        }
        true
    })
}

/// What became of a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Push {
    Pushed,
    /// No room now: the reader is behind.
    Full,
    /// Never through this lane: too long for a slot, or the lane closed or broken.
    Unusable,
}

/// One ring of a lane: where its indices and slots are.
#[derive(Debug, Clone, Copy)]
struct Ring {
    head: usize,
    tail: usize,
    at: usize,
    slots: u64,
    slot: usize,
}

impl Ring {
    const REQUESTS: Ring = Ring {
        head: REQ_HEAD,
        tail: REQ_TAIL,
        at: REQUESTS,
        slots: REQUEST_SLOTS,
        slot: REQUEST_SLOT,
    };
    const ANSWERS: Ring = Ring {
        head: ANS_HEAD,
        tail: ANS_TAIL,
        at: ANSWERS,
        slots: ANSWER_SLOTS,
        slot: ANSWER_SLOT,
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The initiator's side of `target`'s lane, as the handover gives it.
    fn other_side(target: &Mailbox) -> Mailbox {
        // SAFETY: dup of a valid descriptor, owned by the new OwnedFd.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::dup(target.fd().unwrap())) };
        Mailbox::take(fd).unwrap()
    }

    #[test]
    fn requests_and_answers_cross_in_order_until_a_ring_is_full() {
        let target = Mailbox::create().unwrap();
        let initiator = other_side(&target);
        let mut out = Vec::new();
        assert!(!target.pop_request(&mut out).unwrap());
        for i in 0..REQUEST_SLOTS {
            assert!(initiator.push_request(&i.to_le_bytes()), "slot {i}");
        }
        assert!(!initiator.push_request(b"one too many"));
        assert!(target.has_request());
        for i in 0..REQUEST_SLOTS {
            assert!(target.pop_request(&mut out).unwrap());
            assert_eq!(out, i.to_le_bytes());
        }
        assert!(!target.has_request());
        // Room again, and the ring wraps.
        for round in 0..3u8 {
            assert!(initiator.push_request(&[round; 100]));
            assert!(target.pop_request(&mut out).unwrap());
            assert_eq!(out, [round; 100]);
        }
        assert!(target.push_answer(b"done"));
        assert!(initiator.pop_answer(&mut out).unwrap());
        assert_eq!(out, b"done");
        // Closed by the target: requests go elsewhere, what was pushed stays readable.
        assert!(initiator.push_request(b"before"));
        target.close();
        assert!(!initiator.push_request(b"after"));
        assert!(target.pop_request(&mut out).unwrap());
        assert_eq!(out, b"before");
        assert!(!target.pop_request(&mut out).unwrap());
        assert!(!initiator.pop_answer(&mut out).unwrap());
        // Too long for a slot: the caller uses the connection.
        assert!(!initiator.push_request(&vec![0; REQUEST_SLOT]));
        assert!(!target.push_answer(&[0; ANSWER_SLOT]));
    }

    #[test]
    fn hostile_lane_contents_never_read_past_a_slot() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for len in [0usize, 7, 32, 100, 4096, 40_000] {
            for _ in 0..50 {
                let bytes: Vec<u8> = (0..len)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        state as u8
                    })
                    .collect();
                assert!(fuzz_lane(&bytes));
            }
        }
        // Plausible indices: a few real entries, then lengths past the slot.
        let mut input = vec![0u8; 32 + 2 * REQUEST_SLOT];
        input[..8].copy_from_slice(&2u64.to_le_bytes());
        input[32..36].copy_from_slice(&3u32.to_le_bytes());
        input[32 + REQUEST_SLOT..36 + REQUEST_SLOT].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(fuzz_lane(&input));
    }

    #[test]
    fn the_asleep_flag_is_seen_by_the_other_side() {
        let target = Mailbox::create().unwrap();
        let initiator = other_side(&target);
        assert!(!initiator.target_asleep());
        target.set_asleep(true);
        assert!(initiator.target_asleep());
        target.set_asleep(false);
        assert!(!initiator.target_asleep());
    }

    #[test]
    fn a_hostile_index_or_length_breaks_the_lane_and_nothing_is_read_past_it() {
        let target = Mailbox::create().unwrap();
        let initiator = other_side(&target);
        // The initiator claims more requests than the ring holds.
        initiator
            .u64_at(REQ_HEAD)
            .store(REQUEST_SLOTS + 5, Ordering::Release);
        let mut out = Vec::new();
        assert!(target.pop_request(&mut out).is_err());
        assert!(target.is_broken());
        assert!(!target.push_answer(b"x"), "a broken lane carries nothing");

        let target = Mailbox::create().unwrap();
        let initiator = other_side(&target);
        assert!(initiator.push_request(b"abc"));
        // ...then rewrites the slot's length past the slot.
        // SAFETY: the first request slot's length field, inside the mapping.
        unsafe {
            let len = (REQUEST_SLOT as u32).to_le_bytes();
            std::ptr::copy_nonoverlapping(len.as_ptr(), initiator.base.add(REQUESTS), 4);
        }
        assert!(target.pop_request(&mut out).is_err());
        assert!(out.is_empty());

        // The target answers behind an impossible tail: refused, the lane broken.
        let target = Mailbox::create().unwrap();
        let initiator = other_side(&target);
        initiator.u64_at(ANS_TAIL).store(1000, Ordering::Release);
        assert!(!target.push_answer(b"x"));
        assert!(target.is_broken());
    }

    #[test]
    fn only_a_sealed_file_of_the_right_size_and_header_is_taken() {
        // An unsealed memfd: it could shrink under the taker.
        // SAFETY: a NUL-terminated name and valid flags.
        let raw = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid descriptor and length.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), LEN as i64) }, 0);
        let err = Mailbox::take(fd).unwrap_err();
        assert!(err.0.contains("seal"), "{err}");
        // A plain file is no memfd.
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(Mailbox::take(OwnedFd::from(f)).is_err());
        // Sealed, right size, but no header: not a lane.
        // SAFETY: as above.
        let raw = unsafe {
            libc::memfd_create(
                c"test".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        // SAFETY: a fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid descriptor, length and seals.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), LEN as i64), 0);
            assert_eq!(
                libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK),
                0
            );
        }
        let err = Mailbox::take(fd).unwrap_err();
        assert!(err.0.contains("header"), "{err}");
        // A lane cannot be shrunk by either side.
        let lane = Mailbox::create().unwrap();
        // SAFETY: valid descriptor.
        assert_ne!(unsafe { libc::ftruncate(lane.fd().unwrap(), 4096) }, 0);
        // Released, the lane still works.
        let initiator = other_side(&lane);
        lane.release_fd();
        assert_eq!(lane.fd(), None);
        assert!(initiator.push_request(b"still"));
        let mut out = Vec::new();
        assert!(lane.pop_request(&mut out).unwrap());
    }
}
