//! `GPUNETIO`'s metadata on the wire: connection information and region metadata,
//! local and peer regions.

use super::*;
use crate::backends::heartbeat::HubAddr;

/// A peer region's public metadata (as [`GnLocal::public_md`] wrote it): its `CUDA_IPC`
/// part, its NIC-path descriptor and its VRAM export for direct peer copies. Bounded
/// against hostile input: anything short, long or unknown is `MalformedMetadata`.
pub(super) fn parse_region_md<'a>(
    agent: &str,
    public_md: &'a [u8],
) -> Result<(
    &'a [u8],
    Option<RemoteDescriptor>,
    Option<crate::backends::peer_dram::VramExport>,
)> {
    let bad =
        |what: String| Error::MalformedMetadata(format!("{NAME} region of `{agent}`: {what}"));
    let mut f = Fields::new(public_md, "region metadata");
    if f.byte()? != WIRE_VERSION {
        return Err(bad(format!("not version {WIRE_VERSION}")));
    }
    let ipc_md = f.field()?;
    let desc = match f.byte()? {
        0 => None,
        1 => Some(
            RemoteDescriptor::from_bytes(f.take(RemoteDescriptor::WIRE_SIZE)?)
                .map_err(|e| bad(e.to_string()))?,
        ),
        other => return Err(bad(format!("descriptor flag {other}"))),
    };
    let export = match f.byte()? {
        0 => None,
        1 => Some(
            crate::backends::peer_dram::VramExport::decode(
                f.take(crate::backends::peer_dram::MD_WIRE_SIZE)?,
            )
            .map_err(bad)?,
        ),
        other => return Err(bad(format!("export flag {other}"))),
    };
    f.finish()?;
    Ok((ipc_md, desc, export))
}

/// `"GNIO"`, then the wire version: the connection info's first bytes.
pub(super) const CONN_MAGIC: &[u8; 4] = b"GNIO";
/// Version of the connection info and region metadata (2: a direct-copy flag in the
/// connection info, a VRAM export section in the region metadata).
pub(super) const WIRE_VERSION: u8 = 2;

/// A local registration: its `CUDA_IPC` export (intra-node path; `None` where the memory
/// cannot be exported) and its NIC-path slot.
#[derive(Debug)]
pub(super) struct GnLocal {
    pub(super) ipc: Option<Arc<dyn LocalMd>>,
    pub(super) nic: Option<NicLocal>,
    /// VRAM's export for same-host peers' direct copies (module `peer_dram`).
    pub(super) export: Option<crate::backends::peer_dram::VramExport>,
    /// DRAM served to same-host peers' direct-copy requests; removed on drop, after
    /// the copies touching it.
    pub(super) _served: Option<crate::backends::peer_dram::ServedDram>,
}

impl LocalMd for GnLocal {
    /// Version, the `CUDA_IPC` metadata (u16 length, empty if none), then a flag and
    /// the NIC path's 32-byte descriptor where peers can target it.
    fn public_md(&self) -> Vec<u8> {
        let mut out = vec![WIRE_VERSION];
        let ipc = self.ipc.as_ref().map(|m| m.public_md()).unwrap_or_default();
        // CUDA_IPC metadata is tens of bytes: the u16 length always fits.
        nic::put_field(&mut out, &ipc).expect("CUDA_IPC metadata fits a u16 length");
        match self.nic.as_ref().and_then(|n| n.desc) {
            Some(d) => {
                out.push(1);
                out.extend_from_slice(&d.to_bytes());
            }
            None => out.push(0),
        }
        match &self.export {
            Some(e) => {
                out.push(1);
                e.encode(&mut out);
            }
            None => out.push(0),
        }
        out
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn mode(&self) -> Option<&'static str> {
        let staged = self.nic.as_ref().map(|n| n.staged);
        Some(match (self.ipc.is_some(), staged) {
            (true, None) => "intra_node",
            (true, Some(false)) => "intra_node+proxy",
            (true, Some(true)) => "intra_node+proxy(staged)",
            (false, Some(false)) => "proxy",
            (false, Some(true)) => "proxy(staged)",
            (false, None) => "none",
        })
    }
}

/// A peer's region: its `CUDA_IPC` metadata (VRAM of a peer that exported it) and its
/// NIC-path descriptor.
#[derive(Debug)]
pub(super) struct GnRemote {
    pub(super) ipc: Option<Arc<dyn RemoteMd>>,
    pub(super) nic: NicRemote,
    pub(super) kind: MemKind,
}

impl RemoteMd for GnRemote {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

pub(super) fn local_md(md: &dyn LocalMd) -> Result<&GnLocal> {
    md.as_any()
        .downcast_ref::<GnLocal>()
        .ok_or_else(|| Error::InvalidParam(format!("not a {NAME} registration")))
}

pub(super) fn remote_md(md: &dyn RemoteMd) -> Result<&GnRemote> {
    md.as_any()
        .downcast_ref::<GnRemote>()
        .ok_or_else(|| Error::InvalidParam(format!("not {NAME} metadata of a peer's region")))
}

/// Flag of the connection information: the NIC path's heartbeat hub's address follows
/// the same-host section (module `nic`, "Heartbeats"). The high bit, clear of the
/// direct-copy flags ([`peer_dram::SERVES_PEER_COPIES`], [`peer_dram::LOCAL_CONTROL`]);
/// connection information without it (an older peer, `heartbeat_ms=0`, no NIC path)
/// stays readable and its peer is simply not watched.
pub(super) const HEARTBEAT_HUB: u8 = 0x80;
/// The flags of the connection information that say what its direct-copy path does.
const PEER_COPY_FLAGS: u8 = peer_dram::SERVES_PEER_COPIES | peer_dram::NOTIF_IN_REQUEST;

/// A peer's connection information, decoded: what [`encode_conn_info`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ConnInfo<'a> {
    /// `CUDA_IPC`'s connection information (the intra-node path).
    pub(super) ipc: &'a [u8],
    /// The NIC path's endpoint and notification address, where it has one.
    pub(super) nic: Option<nic::NicInfo>,
    /// Its direct-copy flags (module `peer_dram`): it serves direct VRAM ↔ DRAM copies
    /// ([`peer_dram::SERVES_PEER_COPIES`]), takes a transfer's notification inside its
    /// request ([`peer_dram::NOTIF_IN_REQUEST`]).
    pub(super) peer_copy: u8,
    /// Its Unix socket and process, for same-host control connections.
    pub(super) local: Option<(Vec<u8>, oob::LocalIdentity)>,
    /// Its NIC path's heartbeat hub, where it runs one.
    pub(super) hub: Option<HubAddr>,
}

/// `GNIO ver ipc:field nic_flag [nic] flags [pid start_time pid_ns unix:field] [hub]`.
pub(super) fn encode_conn_info(info: &ConnInfo<'_>) -> Result<Vec<u8>> {
    let mut out = CONN_MAGIC.to_vec();
    out.push(WIRE_VERSION);
    nic::put_field(&mut out, info.ipc)?;
    match &info.nic {
        Some(nic) => {
            out.push(1);
            nic.encode(&mut out)?;
        }
        None => out.push(0),
    }
    let mut flags = info.peer_copy & PEER_COPY_FLAGS;
    if info.local.is_some() {
        flags |= peer_dram::LOCAL_CONTROL;
    }
    if info.hub.is_some() {
        flags |= HEARTBEAT_HUB;
    }
    out.push(flags);
    if let Some((name, me)) = &info.local {
        out.extend_from_slice(&me.pid.to_le_bytes());
        out.extend_from_slice(&me.start_time.to_le_bytes());
        out.extend_from_slice(&me.pid_ns.to_le_bytes());
        nic::put_field(&mut out, name)?;
    }
    if let Some(hub) = &info.hub {
        hub.encode(&mut out);
    }
    Ok(out)
}

/// Decodes `agent`'s connection information; anything short, long or unknown is
/// `MalformedMetadata`.
pub(super) fn parse_conn_info<'a>(agent: &str, info: &'a [u8]) -> Result<ConnInfo<'a>> {
    let bad = |what: String| {
        Error::MalformedMetadata(format!("{NAME} connection info of `{agent}`: {what}"))
    };
    let mut f = Fields::new(info, "connection info");
    if f.take(CONN_MAGIC.len())? != CONN_MAGIC || f.byte()? != WIRE_VERSION {
        return Err(bad(format!("not this backend's (version {WIRE_VERSION})")));
    }
    let ipc = f.field()?;
    let nic = match f.byte()? {
        0 => None,
        1 => Some(nic::NicInfo::decode(&mut f)?),
        other => return Err(bad(format!("NIC flag {other}"))),
    };
    let flags = f.byte()?;
    let peer_copy = flags & PEER_COPY_FLAGS;
    let local = if flags & peer_dram::LOCAL_CONTROL != 0 {
        let u32_at = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
        let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let who = oob::LocalIdentity {
            pid: u32_at(f.take(4)?),
            start_time: u64_at(f.take(8)?),
            pid_ns: u64_at(f.take(8)?),
        };
        let name = f.field()?;
        if name.is_empty() || name.len() > 107 {
            return Err(bad(format!("a {}-byte socket name", name.len())));
        }
        Some((name.to_vec(), who))
    } else {
        None
    };
    let hub = if flags & HEARTBEAT_HUB != 0 {
        let rest = f.rest();
        let (hub, tail) = HubAddr::decode(rest)?;
        f.take(rest.len() - tail.len())?;
        Some(hub)
    } else {
        None
    };
    f.finish()?;
    Ok(ConnInfo {
        ipc,
        nic,
        peer_copy,
        local,
        hub,
    })
}
