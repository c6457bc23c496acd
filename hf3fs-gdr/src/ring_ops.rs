//! The interface an [`crate::Ior`] drives its ring through, whoever serves it: `ior`'s
//! local daemon ring and 3FS's (`ior::lib_ring`) both implement it, and neither
//! imports the other.

use crate::error::Result;
use crate::iov::Iov;
use crate::ring::Cqe;
use crate::shm::Id;
use std::os::fd::RawFd;
use std::time::Instant;

/// What [`crate::Ior`] needs from a ring, whoever serves it: the local daemon's
/// shared-memory ring (`ior::LocalRing`) or 3FS's (`ior::lib_ring::LibRing`). Arguments
/// arrive checked by [`crate::Ior`].
pub(crate) trait RingOps: Send + Sync + std::fmt::Debug {
    fn id(&self) -> &Id;
    fn entries(&self) -> u32;
    /// I/Os prepared and not yet reaped.
    fn outstanding(&self) -> u64;
    #[allow(clippy::too_many_arguments)]
    fn prep_io(
        &mut self,
        iov: &Iov,
        read: bool,
        ptr: u64,
        fd: RawFd,
        offset: u64,
        len: u64,
        userdata: u64,
    ) -> Result<i32>;
    fn submit_ios(&mut self) -> Result<()>;
    fn wait_for_ios(
        &mut self,
        cqes: &mut [Cqe],
        min_results: usize,
        deadline: Option<Instant>,
    ) -> Result<usize>;
    /// Whether whatever serves the ring has taken it.
    fn attached(&self) -> bool;
    /// `Ok` while whatever serves the ring can still complete its I/O (no waiting).
    fn check_alive(&self) -> Result<()>;
}
