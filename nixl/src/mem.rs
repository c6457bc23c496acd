//! The memory model: kinds, descriptors, descriptor lists, and the interval index used
//! to check descriptors against registrations.

use crate::error::{Error, Result};

pub use crate::mem_kind::MemKind;

/// One contiguous range: `len` bytes at `addr` on device `dev_id` (NIXL's `nixlBasicDesc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Desc {
    /// Start address (or file offset).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device id: GPU ordinal for VRAM, file descriptor for FILE, 0 for DRAM.
    pub dev_id: u64,
}

impl Desc {
    /// A descriptor.
    pub const fn new(addr: u64, len: u64, dev_id: u64) -> Self {
        Self { addr, len, dev_id }
    }

    /// A DRAM descriptor covering `bytes`.
    pub fn from_slice(bytes: &[u8]) -> Self {
        Self::new(bytes.as_ptr() as u64, bytes.len() as u64, 0)
    }

    /// One past the last byte, checked for zero length and overflow (`index` names it in the error).
    pub fn checked_end(&self, index: usize) -> Result<u64> {
        if self.len == 0 {
            return Err(Error::ZeroLength { index });
        }
        self.addr.checked_add(self.len).ok_or(Error::Overflow {
            index,
            addr: self.addr,
            len: self.len,
        })
    }
}

/// A list of descriptors of one memory kind (NIXL's `nixl_xfer_dlist_t` / `nixl_reg_dlist_t`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescList {
    kind: MemKind,
    descs: Vec<Desc>,
}

impl DescList {
    /// An empty list of `kind`.
    pub fn new(kind: MemKind) -> Self {
        Self {
            kind,
            descs: Vec::new(),
        }
    }

    /// A list from descriptors.
    pub fn from_descs(kind: MemKind, descs: impl IntoIterator<Item = Desc>) -> Self {
        Self {
            kind,
            descs: descs.into_iter().collect(),
        }
    }

    /// Appends a descriptor.
    pub fn push(&mut self, desc: Desc) {
        self.descs.push(desc);
    }

    /// The memory kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// The descriptors.
    pub fn descs(&self) -> &[Desc] {
        &self.descs
    }

    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.descs.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    /// Checks every descriptor for zero length and overflow.
    pub fn validate(&self) -> Result<()> {
        for (index, desc) in self.descs.iter().enumerate() {
            desc.checked_end(index)?;
        }
        Ok(())
    }
}

/// A registered (or peer-advertised) range: what bounds checks compare descriptors against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    /// Memory kind.
    pub kind: MemKind,
    /// The range.
    pub desc: Desc,
}

impl Region {
    /// One past the last byte (regions are validated on entry, so this cannot overflow).
    pub fn end(&self) -> u64 {
        self.desc.addr + self.desc.len
    }

    /// Whether `[addr, end)` lies inside this region (same kind and device assumed).
    pub fn contains(&self, addr: u64, end: u64) -> bool {
        self.desc.addr <= addr && end <= self.end()
    }
}

/// Outcome of looking a range up in a [`RegionIndex`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup<T> {
    /// One region contains the whole range.
    Inside(T),
    /// Some region overlaps the range but none contains it.
    Partial,
    /// No region overlaps it.
    Outside,
}

/// Regions of one (kind, device), sorted by start, answering "which region contains
/// `[addr, end)`" in O(log n) for non-overlapping regions and stays correct when
/// registrations overlap.
#[derive(Debug, Clone)]
pub struct RegionIndex<T> {
    /// (start, end, value) sorted by start.
    entries: Vec<(u64, u64, T)>,
    /// `max_end[i]` = max end of `entries[..=i]`: lets the backward scan stop early.
    max_end: Vec<u64>,
}

impl<T> Default for RegionIndex<T> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            max_end: Vec::new(),
        }
    }
}

impl<T: Clone> RegionIndex<T> {
    /// Adds a region.
    pub fn insert(&mut self, start: u64, end: u64, value: T) {
        let at = self.entries.partition_point(|e| e.0 <= start);
        self.entries.insert(at, (start, end, value));
        self.rebuild_max_end(at);
    }

    /// Removes regions for which `remove` says true.
    pub fn remove_where(&mut self, mut remove: impl FnMut(&T) -> bool) {
        self.entries.retain(|e| !remove(&e.2));
        self.rebuild_max_end(0);
    }

    fn rebuild_max_end(&mut self, from: usize) {
        self.max_end.truncate(from);
        let mut running = if from == 0 { 0 } else { self.max_end[from - 1] };
        for entry in &self.entries[from..] {
            running = running.max(entry.1);
            self.max_end.push(running);
        }
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Finds a region containing `[addr, end)`.
    pub fn lookup(&self, addr: u64, end: u64) -> Lookup<&T> {
        match self.lookup_position(addr, end) {
            Lookup::Inside(at) => Lookup::Inside(&self.entries[at].2),
            Lookup::Partial => Lookup::Partial,
            Lookup::Outside => Lookup::Outside,
        }
    }

    /// [`RegionIndex::lookup`], answering the region's position (for
    /// [`RegionIndex::value_at`] and [`RegionIndex::answers_at`]).
    pub fn lookup_position(&self, addr: u64, end: u64) -> Lookup<usize> {
        // Candidates start at or before `addr`; scan backwards while some earlier region
        // could still reach `end`.
        let after = self.entries.partition_point(|e| e.0 <= addr);
        let mut i = after;
        let mut overlaps = false;
        while i > 0 {
            i -= 1;
            if self.max_end[i] <= addr {
                break;
            }
            let (start, region_end, _) = self.entries[i];
            if start <= addr && end <= region_end {
                return Lookup::Inside(i);
            }
            overlaps |= region_end > addr;
        }
        // A region starting inside the range overlaps it too.
        if self.entries.get(after).is_some_and(|e| e.0 < end) {
            overlaps = true;
        }
        if overlaps {
            Lookup::Partial
        } else {
            Lookup::Outside
        }
    }

    /// Whether [`RegionIndex::lookup_position`] of `[addr, end)` answers `at`, checked in
    /// constant time: runs of descriptors inside one region (a KV cache's blocks) skip
    /// the search. True exactly when the region at `at` contains the range and is the
    /// last one starting at or before `addr` (the first the search would try).
    pub fn answers_at(&self, at: usize, addr: u64, end: u64) -> bool {
        self.entries.get(at).is_some_and(|&(start, region_end, _)| {
            start <= addr
                && end <= region_end
                && self.entries.get(at + 1).is_none_or(|next| next.0 > addr)
        })
    }

    /// The value at a position [`RegionIndex::lookup_position`] answered.
    pub fn value_at(&self, at: usize) -> Option<&T> {
        self.entries.get(at).map(|e| &e.2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_codes_round_trip() {
        for kind in MemKind::ALL {
            assert_eq!(MemKind::from_code(kind.code()), Some(kind));
        }
        assert_eq!(MemKind::from_code(5), None);
        assert_eq!(MemKind::parse("blk"), Some(MemKind::Block));
        assert_eq!(MemKind::parse("nvme"), None);
    }

    #[test]
    fn zero_and_overflowing_descriptors_are_rejected() {
        assert!(matches!(
            Desc::new(1, 0, 0).checked_end(3),
            Err(Error::ZeroLength { index: 3 })
        ));
        assert!(matches!(
            Desc::new(u64::MAX, 2, 0).checked_end(0),
            Err(Error::Overflow { .. })
        ));
        assert_eq!(Desc::new(10, 5, 0).checked_end(0).unwrap(), 15);
    }

    #[test]
    fn lookup_inside_partial_outside() {
        let mut index = RegionIndex::default();
        index.insert(100, 200, 'a');
        index.insert(300, 400, 'b');
        assert_eq!(index.lookup(100, 200), Lookup::Inside(&'a'));
        assert_eq!(index.lookup(350, 360), Lookup::Inside(&'b'));
        assert_eq!(index.lookup(150, 250), Lookup::Partial);
        assert_eq!(index.lookup(50, 150), Lookup::Partial);
        assert_eq!(index.lookup(250, 320), Lookup::Partial);
        assert_eq!(index.lookup(200, 300), Lookup::Outside);
        assert_eq!(index.lookup(0, 100), Lookup::Outside);
        assert_eq!(index.lookup(400, 401), Lookup::Outside);
    }

    #[test]
    fn overlapping_registrations_are_searched_backwards() {
        let mut index = RegionIndex::default();
        index.insert(0, 1000, 'B');
        index.insert(10, 20, 's');
        // The nearest start (10) does not contain [15, 500) but the earlier big one does.
        assert_eq!(index.lookup(15, 500), Lookup::Inside(&'B'));
        index.remove_where(|v| *v == 'B');
        assert_eq!(index.lookup(15, 500), Lookup::Partial);
        assert_eq!(index.len(), 1);
    }

    #[test]
    fn answers_at_agrees_with_the_search() {
        let mut index = RegionIndex::default();
        index.insert(0, 1000, 'B');
        index.insert(10, 20, 's');
        index.insert(2000, 3000, 'c');
        let ranges = [
            (0, 5),
            (10, 15),
            (15, 500),
            (25, 30),
            (2000, 2500),
            (2999, 3000),
            (999, 1001),
            (5000, 5001),
        ];
        for (addr, end) in ranges {
            let found = index.lookup_position(addr, end);
            for at in 0..4 {
                // The shortcut may decline (then the search runs), never disagree.
                if index.answers_at(at, addr, end) {
                    assert_eq!(found, Lookup::Inside(at), "[{addr}, {end}) at {at}");
                }
            }
        }
        assert!(index.answers_at(0, 0, 5));
        assert!(index.answers_at(1, 10, 15));
        assert!(index.answers_at(2, 2000, 2500));
        // [25, 30) lies in 'B' (position 0) although 's' (position 1) starts closer:
        // the search answers 'B', and the shortcut claims neither.
        assert_eq!(index.lookup_position(25, 30), Lookup::Inside(0));
        assert!(!index.answers_at(0, 25, 30) && !index.answers_at(1, 25, 30));
        assert_eq!(index.value_at(0), Some(&'B'));
        assert_eq!(index.value_at(7), None);
    }
}
