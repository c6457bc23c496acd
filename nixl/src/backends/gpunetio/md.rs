//! `GPUNETIO`'s metadata on the wire: connection information and region metadata,
//! local and peer regions.

use super::*;

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
