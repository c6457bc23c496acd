//! VRAM on VERBS: the staging parameters, whether the devices can register DMA-BUF at
//! all (probed at creation), registering VRAM directly (`ibv_reg_dmabuf_mr` of the
//! range's DMA-BUF) or staged, and cutting a transfer's staged entries into the staging
//! engine's chunks.

use super::stage_net::VerbsAddr;
use super::{Device, Outgoing, VerbsBackend, VerbsLocalMd, VerbsRemoteMd, NAME};
use crate::backend::{BackendParams, LocalMd, XferEntry, XferOp};
use crate::backends::staging::{self, Plan, Side};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use ibverbs::{AccessFlags, MemoryRegion};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// How VRAM registrations are made (parameter `vram_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum VramMode {
    /// Directly where the devices register the range's DMA-BUF, else staged.
    Auto,
    /// Always staged.
    Staged,
    /// Directly or not at all (the refusal is the registration's error).
    Direct,
}

/// How one registration is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RegMode {
    /// Host memory registered with the devices.
    Plain,
    /// Device memory registered through its DMA-BUF.
    Direct,
    /// Through the staging pipeline.
    Staged,
}

impl RegMode {
    /// What [`crate::Agent::query_mem`] shows in parentheses.
    pub(super) fn name(self) -> Option<&'static str> {
        match self {
            RegMode::Plain => None,
            RegMode::Direct => Some("direct"),
            RegMode::Staged => Some("staged"),
        }
    }
}

/// The staging parameters, as LIBFABRIC names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct StagingParams {
    pub(super) vram_mode: VramMode,
    pub(super) cfg: staging::Config,
    /// Stage DRAM registrations too (tests the pipeline without a GPU).
    pub(super) stage_dram: bool,
}

fn flag(params: &BackendParams, key: &str) -> Result<bool> {
    match params.get(key).map(String::as_str) {
        None | Some("0" | "false" | "no") => Ok(false),
        Some("1" | "true" | "yes") => Ok(true),
        Some(v) => Err(Error::InvalidParam(format!(
            "{NAME} parameter {key}=`{v}`: 0 or 1"
        ))),
    }
}

impl StagingParams {
    pub(super) fn parse(params: &BackendParams) -> Result<Self> {
        let vram_mode = match params.get("vram_mode").map(String::as_str) {
            None | Some("auto") => VramMode::Auto,
            Some("staged") => VramMode::Staged,
            Some("direct") => VramMode::Direct,
            Some(v) => {
                return Err(Error::InvalidParam(format!(
                    "{NAME} parameter vram_mode=`{v}`: auto, staged or direct"
                )))
            }
        };
        let chunk: usize = super::param(params, "staging_chunk", staging::DEFAULT_CHUNK)?;
        if !(4096..=(1 << 30)).contains(&chunk) || !chunk.is_multiple_of(4096) {
            return Err(Error::InvalidParam(format!(
                "{NAME}: staging_chunk must be a multiple of 4096 in 4 KiB..=1 GiB, not {chunk}"
            )));
        }
        let chunks: usize = super::param(params, "staging_chunks", staging::DEFAULT_CHUNKS)?;
        if !(2..=1024).contains(&chunks) {
            return Err(Error::InvalidParam(format!(
                "{NAME}: staging_chunks must be 2..=1024, not {chunks}"
            )));
        }
        Ok(Self {
            vram_mode,
            cfg: staging::Config { chunk, chunks },
            stage_dram: flag(params, "stage_dram")?,
        })
    }
}

/// Why VRAM will not be registered directly, decided at creation: `vram_mode=staged`, a
/// device without DMA-BUF registration (soft-RoCE), or a build without feature `cuda`.
pub(super) fn direct_refusal(mode: VramMode, devices: &[Arc<Device>]) -> Option<String> {
    if mode == VramMode::Staged {
        return Some("vram_mode=staged".into());
    }
    if let Some(why) = devices.iter().find_map(|d| probe_dmabuf(d)) {
        return Some(why);
    }
    (!cfg!(feature = "cuda")).then(|| "built without feature cuda".into())
}

/// Whether `dev` registers DMA-BUF memory at all: a registration of a descriptor that is
/// no DMA-BUF is refused as unsupported by a device (or provider library) without it,
/// and as an invalid argument by one that looked at the descriptor.
fn probe_dmabuf(dev: &Device) -> Option<String> {
    let not_dmabuf = match std::fs::File::open("/dev/null") {
        Ok(f) => f,
        Err(e) => return Some(format!("cannot probe DMA-BUF registration: /dev/null: {e}")),
    };
    use std::os::fd::AsFd;
    match dev
        .pd
        .reg_dmabuf_mr(not_dmabuf.as_fd(), 0, 4096, 0, AccessFlags::LOCAL_WRITE)
    {
        Err(e @ ibverbs::Error::Unsupported { .. }) => Some(format!(
            "unsupported: device {} cannot register DMA-BUF memory ({e})",
            dev.name
        )),
        Err(_) | Ok(_) => None,
    }
}

/// A direct registration that did not happen: why, and whether it is "unsupported"
/// (the device, driver or build cannot) rather than a failure of this range.
#[derive(Debug)]
pub(super) struct Refusal {
    pub(super) unsupported: bool,
    pub(super) code: i32,
    pub(super) why: String,
}

impl Refusal {
    fn unsupported(why: impl Into<String>) -> Self {
        Self {
            unsupported: true,
            code: libc::EOPNOTSUPP,
            why: why.into(),
        }
    }

    /// The registration's error under `vram_mode=direct`: `Backend` with `EOPNOTSUPP`
    /// when unsupported, else the failing call's code.
    pub(super) fn into_error(self, region: &Region) -> Error {
        Error::Backend {
            backend: NAME.into(),
            code: self.code,
            message: format!(
                "direct VRAM registration ({:#x}+{} on GPU {}) refused{}: {}",
                region.desc.addr,
                region.desc.len,
                region.desc.dev_id,
                if self.unsupported {
                    " (unsupported)"
                } else {
                    ""
                },
                self.why
            ),
        }
    }
}

/// A DMA-BUF of the page-aligned range around `addr..addr+len` of GPU `dev`, and where
/// `addr` lies in it.
#[cfg(feature = "cuda")]
fn export_dmabuf(
    addr: u64,
    len: u64,
    dev: usize,
) -> std::result::Result<(std::os::fd::OwnedFd, u64), Refusal> {
    use gpu_mem::cudarc::driver::sys;
    use std::os::fd::FromRawFd;
    let failed = |code: i32, why: String| Refusal {
        unsupported: false,
        code,
        why,
    };
    let gpu =
        gpu_mem::Gpu::open(dev).map_err(|e| failed(libc::ENODEV, format!("GPU {dev}: {e}")))?;
    if !gpu.dmabuf_supported() {
        return Err(Refusal::unsupported(format!(
            "GPU {dev} cannot export DMA-BUF (driver or kernel lacks support)"
        )));
    }
    // SAFETY: plain libc query.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let start = addr / page * page;
    let end = addr
        .checked_add(len)
        .map(|e| e.next_multiple_of(page))
        .ok_or_else(|| failed(libc::EINVAL, "range overflows".into()))?;
    gpu.bind()
        .map_err(|e| failed(libc::EINVAL, format!("binding GPU {dev}: {e}")))?;
    let mut fd: libc::c_int = -1;
    // SAFETY: for DMA_BUF_FD handles the driver writes an `int` to the out-pointer; the
    // range is page aligned.
    let result = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut libc::c_int).cast(),
            start,
            (end - start) as usize,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    result.result().map_err(|e| {
        failed(
            libc::EINVAL,
            format!(
                "cuMemGetHandleForAddressRange {start:#x}+{}: {e:?}",
                end - start
            ),
        )
    })?;
    // SAFETY: a new descriptor the driver handed over, owned from here.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    Ok((fd, addr - start))
}

impl VerbsBackend {
    /// Registers VRAM through its DMA-BUF on every device, or says why not.
    pub(super) fn register_direct(
        &self,
        region: &Region,
    ) -> std::result::Result<Vec<Arc<MemoryRegion>>, Refusal> {
        if let Some(why) = &self.direct_refusal {
            return Err(Refusal::unsupported(why.clone()));
        }
        #[cfg(feature = "cuda")]
        {
            use std::os::fd::AsFd;
            let dev = usize::try_from(region.desc.dev_id)
                .map_err(|_| Refusal::unsupported("device id out of range"))?;
            let (fd, offset) = export_dmabuf(region.desc.addr, region.desc.len, dev)?;
            let len = usize::try_from(region.desc.len)
                .map_err(|_| Refusal::unsupported("region larger than the address space"))?;
            let access =
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
            let mut mrs = Vec::with_capacity(self.common.devices.len());
            for d in &self.common.devices {
                // The region is addressed by its device address (iova), like host memory
                // by its virtual address; the registration keeps the DMA-BUF.
                let mr =
                    d.pd.reg_dmabuf_mr(fd.as_fd(), offset, len, region.desc.addr, access)
                        .map_err(|e| Refusal {
                            unsupported: matches!(e, ibverbs::Error::Unsupported { .. }),
                            code: e.errno().unwrap_or(libc::EIO),
                            why: format!("ibv_reg_dmabuf_mr on {}: {e}", d.name),
                        })?;
                mrs.push(Arc::new(mr));
            }
            Ok(mrs)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = region;
            Err(Refusal::unsupported("built without feature cuda"))
        }
    }

    /// VRAM: directly where the devices can, else staged (see `vram_mode`). Without
    /// feature `cuda` nothing can copy VRAM: `direct` says why, the others refuse the
    /// kind.
    pub(super) fn register_vram(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        let dev = usize::try_from(region.desc.dev_id).map_err(|_| {
            Error::InvalidParam(format!("CUDA device {} out of range", region.desc.dev_id))
        })?;
        let mode = self.staging.vram_mode;
        if !cfg!(feature = "cuda") && mode != VramMode::Direct {
            return Err(Error::UnsupportedMemKind {
                backend: NAME.into(),
                kind: MemKind::Vram,
            });
        }
        if mode == VramMode::Staged {
            return self.register_staged(region, Some(dev));
        }
        let refusal = match self.register_direct(region) {
            Ok(mrs) => {
                return Ok(Arc::new(VerbsLocalMd {
                    mrs,
                    rails: self.rails_for(region),
                    mode: RegMode::Direct,
                    staged: None,
                }))
            }
            Err(refusal) => refusal,
        };
        if mode == VramMode::Direct {
            return Err(refusal.into_error(region));
        }
        if !self.staged_logged.swap(true, Ordering::Relaxed) {
            tracing::info!(
                gpu = dev,
                unsupported = refusal.unsupported,
                reason = %refusal.why,
                "VERBS: VRAM is registered staged (direct registration refused)"
            );
        } else {
            tracing::debug!(gpu = dev, reason = %refusal.why, "VERBS: VRAM registered staged");
        }
        self.register_staged(region, Some(dev))
    }

    /// A region reached through the staging pipeline: the pool is allocated (pinned for
    /// GPU `dev`) and registered on first use; the region becomes nameable by peers.
    pub(super) fn register_staged(
        &self,
        region: &Region,
        dev: Option<usize>,
    ) -> Result<Arc<dyn LocalMd>> {
        let common = &self.common;
        let id = {
            let mut engine = common.stager.engine();
            engine.ensure_bounce(&common.stager.net, dev)?;
            engine.add_region(region.desc.addr, region.desc.len, dev)
        };
        Ok(Arc::new(VerbsLocalMd {
            mrs: Vec::new(),
            rails: Vec::new(),
            mode: RegMode::Staged,
            staged: Some(StagedReg {
                common: common.clone(),
                id,
                slot: common.stager.cfg.chunk as u32,
                dev,
            }),
        }))
    }

    /// Cuts the staged entries (indices into `entries`) into chunks: grouped by how each
    /// side is reached and by device, at most one slot each (the smaller of ours and the
    /// peer's where both stage), rails taken in turn, keys resolved for the chunk's rail.
    pub(super) fn plan_staged(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        staged: &[usize],
        conn: &Arc<Outgoing>,
    ) -> Result<Plan<VerbsAddr>> {
        // (local side, remote staged, remote device) → entries, in first-seen order.
        type GroupKey = (Side, bool, u64);
        let mut groups: Vec<(GroupKey, u64, Vec<usize>)> = Vec::new();
        for &i in staged {
            let e = &entries[i];
            let (local, remote) = e.metadata::<VerbsLocalMd, VerbsRemoteMd>(NAME)?;
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
        let rails = &self.common.rails;
        let nrails = rails.len();
        let max_piece = self
            .common
            .devices
            .iter()
            .map(|d| d.max_msg as u64)
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
                let dev = rails[rail].dev;
                let mut pieces = Vec::with_capacity(refs.len());
                for p in &refs {
                    let e = &entries[p.entry];
                    let (local, remote) = e.metadata::<VerbsLocalMd, VerbsRemoteMd>(NAME)?;
                    // Memory is addressed remotely by its own address (the iova).
                    let local_net = match side {
                        Side::Plain => (e.local.addr + p.offset, u64::from(local.mrs[dev].rkey())),
                        Side::Staged(_) => (0, 0),
                    };
                    let remote_at = if remote_staged {
                        (e.remote.addr + p.offset, 0)
                    } else {
                        let rkey = *remote.rkeys.get(conn.remote_dev[rail]).ok_or_else(|| {
                            Error::MalformedMetadata(format!(
                                "{NAME}: region of `{}` has {} keys, its device {} has none",
                                conn.peer,
                                remote.rkeys.len(),
                                conn.remote_dev[rail]
                            ))
                        })?;
                        (e.remote.addr + p.offset, u64::from(rkey))
                    };
                    pieces.push(staging::Piece {
                        local: e.local.addr + p.offset,
                        local_net,
                        remote: remote_at,
                        len: p.len,
                        slot_off: p.slot_off,
                    });
                }
                chunks.push(staging::Chunk {
                    rail,
                    dest: VerbsAddr::Out(conn.clone(), rail),
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
}

/// A staged region's entry in the staging engine (removed on drop), the slot size peers
/// chunk for, and the GPU its copies run on.
#[derive(Debug)]
pub(super) struct StagedReg {
    common: Arc<super::Common>,
    id: u64,
    pub(super) slot: u32,
    pub(super) dev: Option<usize>,
}

impl Drop for StagedReg {
    fn drop(&mut self) {
        self.common.stager.engine().remove_region(self.id);
    }
}

/// First byte of a staged region's public metadata (a key list starts with its device
/// count, 1..=16).
pub(super) const STAGED_MD: u8 = 0;
pub(super) const STAGED_MD_VERSION: u8 = 1;

/// A staged region's public metadata: `0 | version 1 | slot size u32`.
pub(super) fn encode_staged_md(slot: u32) -> Vec<u8> {
    let mut out = vec![STAGED_MD, STAGED_MD_VERSION];
    out.extend_from_slice(&slot.to_le_bytes());
    out
}

/// The slot size of a staged region's public metadata (the part after [`STAGED_MD`]).
pub(super) fn decode_staged_md(rest: &[u8]) -> Result<u64> {
    let bad = |why: &str| Error::MalformedMetadata(format!("{NAME} region metadata: {why}"));
    let slot = match rest {
        [STAGED_MD_VERSION, a, b, c, d] => u32::from_le_bytes([*a, *b, *c, *d]),
        [STAGED_MD_VERSION, ..] => return Err(bad("wrong length")),
        _ => return Err(bad("unknown staged-region version")),
    };
    if slot < 4096 {
        return Err(bad("staging slot smaller than 4 KiB"));
    }
    Ok(u64::from(slot))
}
