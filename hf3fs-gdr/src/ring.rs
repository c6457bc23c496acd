//! The shared-memory layout of an I/O ring, used by the client ([`crate::Ior`]) and the
//! daemon: a header of sequence numbers, then a submission array and a completion
//! array of `entries` slots each.
//!
//! Sequence numbers only grow; slot = sequence % entries.
//! - `sq_tail` (client): I/Os prepared. The daemon reads SQEs below it (acquire).
//! - `sq_submitted` (client): `sq_tail` at the last `submit_ios` — the hint that lets
//!   the daemon process a partial batch at once when `io_depth < 0`.
//! - `sq_head` (daemon): SQEs copied out (the slot may be rewritten).
//! - `cq_tail` (daemon): completions posted (release after the CQE is written).
//! - `cq_head` (client): completions reaped.
//!
//! The client prepares only while `sq_tail - cq_head < entries`: an I/O holds its SQ
//! slot until its completion is reaped, so neither array can overflow.
//! Sleepers use shared futexes on the two doorbell words, each with a flag saying a
//! waker is needed, and every wait is bounded so liveness is checked regularly.

use crate::shm::Id;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64};

/// `"HF3FSIOR"` read as a little-endian u64.
pub(crate) const RING_MAGIC: u64 = u64::from_le_bytes(*b"HF3FSIOR");
pub(crate) const RING_VERSION: u32 = 1;

/// One cache line holding one hot word, so the two sides do not false-share.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub(crate) struct Line<T>(pub T);

/// Daemon state word values.
pub(crate) const DAEMON_NONE: u32 = 0;
pub(crate) const DAEMON_ATTACHED: u32 = 1;
pub(crate) const DAEMON_DETACHED: u32 = 2;

#[repr(C)]
#[derive(Debug)]
pub(crate) struct RingHeader {
    pub magic: u64,
    pub version: u32,
    pub entries: u32,
    pub for_read: u32,
    pub io_depth: i32,
    /// Milliseconds (3FS's `timeout`).
    pub timeout_ms: i32,
    pub numa: i32,
    pub flags: u64,
    pub id: Id,
    pub client_pid: u32,
    pub daemon_state: AtomicU32,
    pub daemon_pid: AtomicI32,
    pub sq_tail: Line<AtomicU64>,
    pub sq_submitted: Line<AtomicU64>,
    /// Bumped by `submit_ios`; the daemon sleeps on it.
    pub sq_doorbell: Line<AtomicU32>,
    /// Set by the daemon before it sleeps on `sq_doorbell`.
    pub daemon_sleeping: Line<AtomicU32>,
    pub sq_head: Line<AtomicU64>,
    pub cq_tail: Line<AtomicU64>,
    /// Bumped by the daemon after posting; the client sleeps on it.
    pub cq_doorbell: Line<AtomicU32>,
    /// Set by the client before it sleeps on `cq_doorbell`.
    pub client_sleeping: Line<AtomicU32>,
    pub cq_head: Line<AtomicU64>,
}

/// A submission entry: where the data goes (iov id and offset in it) and where it comes
/// from (the file as the daemon knows it, offset, length).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sqe {
    pub iov_id: Id,
    pub iov_offset: u64,
    pub file_offset: u64,
    pub len: u64,
    pub userdata: u64,
    /// The daemon's id of the file (from the registration round trip).
    pub file_id: u32,
    /// 1: read the file into the iov; 0: write the iov to the file.
    pub read: u32,
    pub _reserved: [u64; 1],
}

/// A completion, laid out as 3FS's `struct hf3fs_cqe`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cqe {
    /// The index [`crate::Ior::prep_io`] returned for the I/O.
    pub index: i32,
    /// Unused (3FS's `reserved`).
    pub reserved: i32,
    /// Bytes moved (fewer than asked at end of file), or −errno.
    pub result: i64,
    /// The userdata given to `prep_io`.
    pub userdata: u64,
}

const _: () = assert!(std::mem::size_of::<Sqe>() == 64);
const _: () = assert!(std::mem::size_of::<Cqe>() == 24);
const _: () = assert!(std::mem::align_of::<RingHeader>() == 64);

/// Bytes of the header rounded up to a cache line.
pub(crate) const HEADER_BYTES: usize = std::mem::size_of::<RingHeader>().next_multiple_of(64);

/// Bytes of shared memory a ring of `entries` needs (3FS's `hf3fs_ior_size`).
#[doc(alias = "hf3fs_ior_size")]
pub fn ior_size(entries: u32) -> usize {
    HEADER_BYTES
        + entries as usize * std::mem::size_of::<Sqe>()
        + (entries as usize * std::mem::size_of::<Cqe>()).next_multiple_of(64)
}

/// Raw views of a mapped ring. Holders keep the mapping alive.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingView {
    base: *mut u8,
    entries: u32,
}

// SAFETY: only raw pointers into a shared mapping that its owner keeps alive; every
// shared word is atomic and every slot is handed over by a release/acquire pair.
unsafe impl Send for RingView {}
// SAFETY: as above.
unsafe impl Sync for RingView {}

impl RingView {
    /// # Safety
    /// `base` points at a mapping of at least `ior_size(entries)` bytes, 64-byte aligned,
    /// alive while the view is used.
    pub(crate) unsafe fn new(base: *mut u8, entries: u32) -> Self {
        Self { base, entries }
    }

    pub(crate) fn header(&self) -> &RingHeader {
        // SAFETY: the mapping starts with a header (`new`'s contract); all mutable
        // fields are atomics.
        unsafe { &*(self.base as *const RingHeader) }
    }

    pub(crate) fn entries(&self) -> u32 {
        self.entries
    }

    fn sqe_ptr(&self, seq: u64) -> *mut Sqe {
        let slot = (seq % self.entries as u64) as usize;
        // SAFETY: slot < entries, inside the submission array.
        unsafe { (self.base.add(HEADER_BYTES) as *mut Sqe).add(slot) }
    }

    fn cqe_ptr(&self, seq: u64) -> *mut Cqe {
        let slot = (seq % self.entries as u64) as usize;
        let array = HEADER_BYTES + self.entries as usize * std::mem::size_of::<Sqe>();
        // SAFETY: slot < entries, inside the completion array.
        unsafe { (self.base.add(array) as *mut Cqe).add(slot) }
    }

    /// Writes the SQE of sequence `seq` (client, before publishing `sq_tail`).
    pub(crate) fn write_sqe(&self, seq: u64, sqe: &Sqe) {
        // SAFETY: the slot is the client's until `sq_tail` passes it (ring protocol);
        // volatile because the daemon process reads it.
        unsafe { self.sqe_ptr(seq).write_volatile(*sqe) }
    }

    /// Reads the SQE of sequence `seq` (daemon, after an acquire of `sq_tail`).
    pub(crate) fn read_sqe(&self, seq: u64) -> Sqe {
        // SAFETY: in bounds; the client does not rewrite it before `sq_head` passes it.
        unsafe { self.sqe_ptr(seq).read_volatile() }
    }

    pub(crate) fn write_cqe(&self, seq: u64, cqe: &Cqe) {
        // SAFETY: in bounds; the slot is free until `cq_tail` passes it.
        unsafe { self.cqe_ptr(seq).write_volatile(*cqe) }
    }

    pub(crate) fn read_cqe(&self, seq: u64) -> Cqe {
        // SAFETY: in bounds; published by the daemon's release of `cq_tail`.
        unsafe { self.cqe_ptr(seq).read_volatile() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn cqe_matches_hf3fs_cqe_layout() {
        // struct hf3fs_cqe { int32_t index; int32_t reserved; int64_t result; const void *userdata; }
        assert_eq!(offset_of!(Cqe, index), 0);
        assert_eq!(offset_of!(Cqe, reserved), 4);
        assert_eq!(offset_of!(Cqe, result), 8);
        assert_eq!(offset_of!(Cqe, userdata), 16);
        assert_eq!(std::mem::size_of::<Cqe>(), 24);
    }

    #[test]
    fn hot_words_sit_on_their_own_cache_lines() {
        let offsets = [
            offset_of!(RingHeader, sq_tail),
            offset_of!(RingHeader, sq_submitted),
            offset_of!(RingHeader, sq_doorbell),
            offset_of!(RingHeader, daemon_sleeping),
            offset_of!(RingHeader, sq_head),
            offset_of!(RingHeader, cq_tail),
            offset_of!(RingHeader, cq_doorbell),
            offset_of!(RingHeader, client_sleeping),
            offset_of!(RingHeader, cq_head),
        ];
        for w in offsets.windows(2) {
            assert_eq!(w[1] - w[0], 64);
        }
        assert_eq!(offsets[0] % 64, 0);
        assert_eq!(ior_size(4), HEADER_BYTES + 4 * 64 + 128);
    }
}
