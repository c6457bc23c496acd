//! VRAM on LIBFABRIC: choosing the provider variant (with `FI_HMEM` only where a probe
//! registration of device memory succeeds), registering VRAM directly or staged, and
//! cutting a transfer's staged entries into the staging engine's chunks.

use super::{
    discover, FabAddr, FabricLocalMd, FabricRemoteMd, LibfabricBackend, Peer, RegMode, Side,
    StagedReg, VramMode, NAME,
};
use crate::backend::{BackendParams, LocalMd, XferEntry, XferOp};
use crate::backends::staging::{self, Plan};
use crate::error::{Error, Result};
use crate::mem::Region;
use fabric::{Caps, HmemIface, Info, MemoryRegion};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The provider's info, with `FI_HMEM` only where direct VRAM registration can be used:
/// with `vram_mode=auto` a small device buffer is registered on a probe rail first, and a
/// refusal (or no GPU to probe with) keeps the provider's plain variant — `shm` opened
/// with `FI_HMEM` moves DRAM several times slower (`docs/BENCHMARKS.md`), for nothing
/// when its libfabric has no CUDA. Returns the info and why VRAM will be staged, if it
/// will.
pub(super) fn choose_info(
    params: &BackendParams,
    vram_mode: VramMode,
) -> Result<(Info, Option<String>)> {
    if !cfg!(feature = "cuda") || vram_mode == VramMode::Staged {
        let why = if cfg!(feature = "cuda") {
            "vram_mode=staged"
        } else {
            "built without feature cuda"
        };
        return Ok((discover(params, false)?, Some(why.into())));
    }
    let info = discover(params, true)?;
    if !info.caps().contains(Caps::HMEM) {
        let why = format!(
            "provider `{}` does not advertise FI_HMEM",
            info.provider_name()
        );
        return Ok((info, Some(why)));
    }
    if vram_mode == VramMode::Direct {
        return Ok((info, None));
    }
    match probe_direct(&info) {
        Ok(()) => Ok((info, None)),
        Err(why) => {
            // The same provider, without FI_HMEM.
            let mut plain = params.clone();
            plain.insert("provider".into(), info.provider_name().to_string());
            Ok((discover(&plain, false)?, Some(why)))
        }
    }
}

/// Registers a small device buffer with `FI_HMEM_CUDA` on a throw-away rail.
#[cfg(feature = "cuda")]
fn probe_direct(info: &Info) -> std::result::Result<(), String> {
    let Some(buf) = crate::backends::cuda_copy::probe_buffer(1 << 16) else {
        return Err("no GPU to probe direct registration with".into());
    };
    let rail = super::open_rail(info).map_err(|e| e.to_string())?;
    let dev = buf.gpu().ordinal() as i32;
    // SAFETY: `buf` is device memory of GPU `dev` that outlives the region (dropped at
    // the end of this block, before the buffer).
    let mr = unsafe {
        MemoryRegion::reg_hmem(
            &rail.domain,
            Some(&rail.ep),
            buf.ptr(),
            buf.len(),
            fabric::Access::READ
                | fabric::Access::WRITE
                | fabric::Access::REMOTE_READ
                | fabric::Access::REMOTE_WRITE,
            HmemIface::Cuda(dev),
        )
    };
    match mr {
        Ok(mr) => {
            drop(mr);
            Ok(())
        }
        Err(e) => Err(format!(
            "{}direct registration refused by `{}`: {e}",
            if matches!(e, fabric::Error::Unsupported { .. }) {
                "unsupported: "
            } else {
                ""
            },
            info.provider_name()
        )),
    }
}

#[cfg(not(feature = "cuda"))]
fn probe_direct(_info: &Info) -> std::result::Result<(), String> {
    Err("built without feature cuda".into())
}

impl LibfabricBackend {
    /// Registers device memory with the provider (`FI_HMEM_CUDA` and the device), or
    /// says why not: `Unsupported` without `FI_HMEM`, else the provider's refusal (a
    /// libfabric built without CUDA answers `FI_ENOSYS`, also `Unsupported`).
    pub(super) fn register_direct(
        &self,
        region: &Region,
        dev: i32,
    ) -> std::result::Result<Vec<MemoryRegion>, fabric::Error> {
        if !self.hmem {
            return Err(fabric::Error::Unsupported {
                call: "fi_getinfo",
                errno: fabric::ffi::FI_EOPNOTSUPP,
                detail: self
                    .direct_refusal
                    .clone()
                    .unwrap_or_else(|| format!("provider `{}` without FI_HMEM", self.provider)),
            });
        }
        self.try_register_rails(region, HmemIface::Cuda(dev))
    }

    /// VRAM: directly (`FI_HMEM` with the device) where the provider can, else staged.
    pub(super) fn register_vram(&self, region: &Region, dev: i32) -> Result<Arc<dyn LocalMd>> {
        if self.vram_mode == VramMode::Staged {
            return self.register_staged(region, Some(dev as usize));
        }
        let refusal = match self.register_direct(region, dev) {
            Ok(mrs) => {
                return Ok(Arc::new(FabricLocalMd {
                    _served: None,
                    mrs,
                    mode: RegMode::Direct,
                    staged: None,
                    peer: self.peer_part(region),
                }))
            }
            Err(e) => e,
        };
        let unsupported = matches!(refusal, fabric::Error::Unsupported { .. });
        if self.vram_mode == VramMode::Direct {
            return Err(Error::Backend {
                backend: NAME.into(),
                code: refusal.errno().unwrap_or(0),
                message: format!(
                    "direct VRAM registration ({:#x}+{} on GPU {dev}) refused{}: {refusal}",
                    region.desc.addr,
                    region.desc.len,
                    if unsupported { " (unsupported)" } else { "" }
                ),
            });
        }
        if !self.staged_logged.swap(true, Ordering::Relaxed) {
            tracing::info!(
                provider = %self.provider,
                gpu = dev,
                unsupported,
                reason = %refusal,
                "LIBFABRIC: VRAM is registered staged (direct registration refused)"
            );
        } else {
            tracing::debug!(gpu = dev, reason = %refusal, "LIBFABRIC: VRAM registered staged");
        }
        self.register_staged(region, Some(dev as usize))
    }

    /// Cuts the staged entries (indices into `entries`) into chunks: grouped by how each
    /// side is reached and by device, at most one slot each (the smaller of ours and the
    /// peer's where both stage), rails taken in turn, keys resolved for the chunk's rail.
    pub(super) fn plan_staged(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        staged: &[usize],
        peer: &Peer,
    ) -> Result<Plan<FabAddr>> {
        // (local side, remote staged, remote device) → entries, in first-seen order.
        type GroupKey = (Side, bool, u64);
        let mut groups: Vec<(GroupKey, u64, Vec<usize>)> = Vec::new();
        for &i in staged {
            let e = &entries[i];
            let (local, remote) = e.metadata::<FabricLocalMd, FabricRemoteMd>(NAME)?;
            let side = match &local.staged {
                Some(s) => Side::Staged(s.dev),
                None => Side::Plain,
            };
            let key = (
                side,
                remote.staged_slot.is_some(),
                e.remote_region.desc.dev_id,
            );
            let mut capacity = u64::MAX;
            if local.staged.is_some() {
                capacity = self.common.stager.cfg.chunk as u64;
            }
            if let Some(slot) = remote.staged_slot {
                capacity = capacity.min(slot);
            }
            match groups.iter_mut().find(|(k, ..)| *k == key) {
                Some((_, cap, list)) => {
                    *cap = (*cap).min(capacity);
                    list.push(i);
                }
                None => groups.push((key, capacity, vec![i])),
            }
        }
        let nrails = self.rails.len();
        let max_piece = self
            .rails
            .iter()
            .map(|r| r.max_msg as u64)
            .min()
            .unwrap_or(u64::MAX)
            .min(u64::from(u32::MAX));
        let mut rail = self.next_rail.fetch_add(1, Ordering::Relaxed) % nrails;
        let mut chunks = Vec::new();
        for ((side, remote_staged, _), capacity, list) in groups {
            let planned = staging::plan_chunks(
                list.iter().map(|&i| (i, entries[i].local.len)),
                capacity,
                staging::MAX_PIECES,
                max_piece,
            );
            for refs in planned {
                rail = (rail + 1) % nrails;
                let pieces = refs
                    .iter()
                    .map(|p| {
                        let e = &entries[p.entry];
                        let (local, remote) = e.metadata::<FabricLocalMd, FabricRemoteMd>(NAME)?;
                        let local_net = if side == Side::Plain {
                            let mr = local.mrs[rail].remote();
                            let at = e.local.addr - e.local_region.desc.addr + p.offset;
                            (mr.address_at(at), mr.key)
                        } else {
                            (0, 0)
                        };
                        let remote_at = if remote_staged {
                            (e.remote.addr + p.offset, 0)
                        } else {
                            let rm = remote.remotes[rail % remote.remotes.len()];
                            let at = e.remote.addr - e.remote_region.desc.addr + p.offset;
                            (rm.address_at(at), rm.key)
                        };
                        Ok(staging::Piece {
                            local: e.local.addr + p.offset,
                            local_net,
                            remote: remote_at,
                            len: p.len,
                            slot_off: p.slot_off,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                chunks.push(staging::Chunk {
                    rail,
                    dest: FabAddr::Peer(peer.addrs.clone(), rail),
                    local: side,
                    remote_staged,
                    pieces,
                });
            }
        }
        Ok(Plan {
            write: op == XferOp::Write,
            chunks,
        })
    }

    /// A region reached through the staging pipeline: the pool is allocated (pinned for
    /// GPU `dev`) and registered on first use; the region becomes nameable by peers.
    pub(super) fn register_staged(
        &self,
        region: &Region,
        dev: Option<usize>,
    ) -> Result<Arc<dyn LocalMd>> {
        let stager = self.common.stager.clone();
        let id = {
            let mut engine = stager.engine();
            engine.ensure_bounce(&stager.net, dev)?;
            engine.add_region(region.desc.addr, region.desc.len, dev)
        };
        Ok(Arc::new(FabricLocalMd {
            _served: None,
            mrs: Vec::new(),
            mode: RegMode::Staged,
            staged: Some(StagedReg {
                slot: stager.cfg.chunk as u32,
                stager,
                id,
                dev,
            }),
            peer: self.peer_part(region),
        }))
    }
}
