//! VRAM ↔ a same-host peer's DRAM in one copy: the process that owns the host memory
//! drives a copy engine against the other side's VRAM, imported through CUDA IPC. The
//! transport-neutral parts (exports, requests, planning, the target's checks and copies)
//! are `backends::peer_dram`'s, shared with GPUNETIO; here is how LIBFABRIC carries them.
//!
//! The staged pipeline moves such a transfer through pinned bounce slots and the `shm`
//! rails (a device copy, then a CPU copy by the provider, then the peer's); here one
//! `cuMemcpyAsync` between the host memory and the IPC-mapped VRAM moves the bytes, at
//! the pinned copy rate. Two cases, by who owns the host memory:
//!
//! - **initiator-owned** (READ peer VRAM → local DRAM, WRITE local DRAM → peer VRAM):
//!   the target advertises its VRAM's CUDA-IPC handle in the region's public metadata
//!   ([`VramExport`], appended to the ordinary metadata); the initiator imports the
//!   allocation once per peer incarnation (cached in the peer's `PeerSource`), pins its
//!   DRAM registration once (`cuMemHostRegister`, on first use) and copies on its own
//!   streams (`cuda_copy::GpuXfer`); the notification goes after the last copy
//!   completed, as an ordinary notification message that counts no data.
//! - **target-owned** (WRITE local VRAM → peer DRAM, READ peer DRAM → local VRAM): the
//!   initiator sends the target a [`Request`] on the rails (the initiator's VRAM by its
//!   virtual address, the target's DRAM by its virtual address, pieces of at most
//!   [`PIECE_BYTES`], several requests of up to [`MAX_PIECES`] pieces spread over the
//!   rails, all in flight at once); the target's rail worker checks it (below), imports
//!   the initiator's allocation (cached per peer incarnation), pins its own DRAM region
//!   (once), queues the copies on its streams and answers [`Done`] once their events
//!   completed. The initiator sends the notification after the last answer: it reaches
//!   the target strictly after the last byte. After the first request it served, the
//!   target offers the peer a shared lane (`worker::peer_copies`, `peer_dram::mailbox`):
//!   later requests and their answers cross as a few stores in shared memory instead of
//!   sealed rail messages, where the OS lets the initiator take the lane's descriptor
//!   from the target's process (`pidfd_getfd`); otherwise they stay on the rails.
//!
//! # What the target checks
//! A request makes the target copy between its own memory and memory of another
//! process, so nothing in it is taken on its word:
//! - **who asks**: a request read from a lane is the peer's the lane was made for (only
//!   its process holds it). On the rails, the request's seal (module `notif_mac`): it is
//!   acted upon only when
//!   it opens under the key of the loaded peer it names, and answered (sealed) at that
//!   peer's endpoint it names; one naming a loaded peer that does not open is dropped
//!   and counted, unanswered; one from no loaded peer is declined (`EPERM`), answered at
//!   the name it gives (only a refusal goes there). The initiator takes an answer only
//!   when sealed by the peer the request went to;
//! - **the peer's VRAM**: each piece's VRAM range must lie inside a VRAM region *that
//!   peer* advertised in metadata this backend loaded, with its IPC handle (the handle
//!   comes from that metadata, never from the request); else declined
//!   (`EADDRNOTAVAIL`): a target that never loaded its initiator's metadata is fine,
//!   the transfer then runs staged (below);
//! - **its own DRAM**: each piece's DRAM range must lie inside one DRAM region
//!   registered with this backend, else the transfer fails (`EACCES`, as the provider's
//!   key check would); a registration dropped while copies from or into it run waits for
//!   them.
//!
//! # Choice and fallback
//! A transfer goes this way as a whole when: parameter `vram_peer_copy` is `auto` (the
//! default; `off` disables it, and `vram_mode=staged` implies `off`), this process has
//! a GPU, the peer is another process on this host (same boot, same pid namespace), and
//! every descriptor pair is DRAM ↔ peer VRAM with the peer's IPC handle known
//! (initiator-owned), or every pair is VRAM ↔ peer DRAM with this side's VRAM exported
//! and the peer serving such requests (its connection information says so: a backend
//! with a GPU and its rail workers' threads). Memory with no legacy IPC handle (VMM
//! allocations) is not exported, and goes staged. The ordinary transfer (staged, or
//! direct `FI_HMEM`) is prepared beside it: when the target declines (no GPU, the
//! initiator's metadata not loaded, import refused), that post and every later post of
//! the request run it instead (counted in [`Stats::fallbacks`]).
//!
//! Which path ran: [`crate::backend::BackendXfer::staged_bytes`] (the telemetry's
//! `staged_bytes`) is 0 for a transfer prepared for this path; `Agent::query_mem_info`
//! on `LIBFABRIC` with meta `peer:<agent>` names the path to that peer (`vram_peer_dram`:
//! `direct`, `direct_from_dram` or `staged`) and counts what moved directly, what this
//! side served to peers and the posts that fell back (`peer_copy_bytes`,
//! `peer_copy_served_bytes`, `peer_copy_fallbacks`); `peer_transport` (nixlbench's header)
//! says it in words. `query_mem` keeps naming how the backend registered the VRAM
//! (`LIBFABRIC(staged)` / `LIBFABRIC(direct)`), the fallback's path.

pub(super) use crate::backends::peer_dram::*;

use super::sources::PeerSource;

/// A rail's request is attributed to the loaded peer whose endpoint sent it (module
/// `sources`); what that peer advertised is what the target checks against.
impl PeerVram for PeerSource {
    fn agent(&self) -> &str {
        &self.agent
    }
    fn advertised(&self) -> &AdvertisedVram {
        &self.vram
    }
    fn imports(&self) -> &Imports {
        &self.imports
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_metadata_carries_the_export_after_the_transport_part() {
        use super::super::{parse_remote_md, remote_export};
        let e = crate::backends::peer_dram::tests::export();
        let staged = vec![0u8, 1, 0, 0, 1, 0];
        // Five rails' keys, whose bytes happen to hold the section's tag where a section
        // would start: the length says it is a key list alone.
        let mut keys = vec![5u8];
        keys.extend((0..5 * 24).map(|i| i as u8));
        let at = keys.len() - MD_WIRE_SIZE;
        keys[at..at + 4].copy_from_slice(MD_TAG);
        for transport in [staged, keys] {
            let md = parse_remote_md(&transport).unwrap();
            assert_eq!(remote_export(&*md), None);
            let mut with = transport.clone();
            e.encode(&mut with);
            let md = parse_remote_md(&with).unwrap();
            assert_eq!(remote_export(&*md), Some(e));
            // A damaged section, or one cut short: malformed, never misread.
            let last = with.len() - 1;
            let mut bad = with.clone();
            bad[last - MD_WIRE_SIZE + 5] = 9;
            assert!(parse_remote_md(&bad).is_err());
            assert!(parse_remote_md(&with[..last]).is_err());
        }
    }
}
