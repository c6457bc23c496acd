//! Rails per peer: the network provider's rails for every peer, and `shm` rails for the
//! peers on this very host, as NIXL's UCX picks shared memory there.
//!
//! The backend the agent sees holds one or two *planes*, each a complete
//! [`LibfabricBackend`] (rails, workers, notifications, staging, heartbeat hub): the
//! network provider's (the `provider` parameter, else the first of
//! [`super::PROVIDER_PRIORITY`]), and — unless that already is `shm`, or
//! `local_provider=none` — an `shm` plane with `shm`'s own rail count. Memory is
//! registered in both; the connection information and each region's public metadata
//! carry both planes' (tagged and versioned, below), with this process's
//! [`HostId`]. Loading a peer picks one plane for it: `shm` where the peer advertises
//! `shm` rails and shares this host's memory exactly (boot id, pid namespace, mount
//! namespace or `/dev/shm`: see [`super::host`]), else the network provider. If the
//! `shm` plane refuses the peer (its address cannot be inserted), the network plane
//! takes it, with a logged warning. Everything of a peer — transfers, notifications
//! both ways, staged VRAM, the OS's watch on its process and its heartbeats — then goes
//! through that plane alone; notifications are collected from both.
//! [`crate::backend::Backend::peer_transport`] names the provider a peer is reached by.
//!
//! What libfabric 1.17's `shm` does with a peer killed in the middle of a transfer (its
//! unanswered operations, the lock it held) holds for these peers as for `provider=shm`,
//! and is undone the same way once its process is known to have ended (see the parent
//! module's "Dead peers"); a peer killed while idle is reported as on any provider (its
//! pidfd).
//!
//! Without an `shm` plane the encodings are the plane's own (as before this module); a
//! backend reads both forms from its peers.
//!
//! Connection information with two planes:
//! `0xd7 | version 1 | host:u8 (0, or 1 and the host identity) | parts:u8 |
//! (kind:u8 (0 network, 1 local) | provider:str8 | info:bytes32)*`;
//! region metadata: `0xd7 | version 1 | parts:u8 | (kind:u8 | metadata:bytes32)*`.
//! A plane's own encodings start with its rail count (1..=16) or 0 (a staged region),
//! never `0xd7`.

use super::host::{self, HostId};
use super::sources::LoadedNames;
use super::{open, LibfabricBackend, NAME};
use crate::backend::{
    Backend, BackendInit, BackendXfer, Capabilities, LocalMd, NotifWaker, RemoteMd, XferEntry,
    XferOp,
};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use parking_lot::RwLock;
use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

/// The parameter that names the provider for peers on this host (`shm` or `none`).
pub(super) const PARAM: &str = "local_provider";
/// The provider of the local plane.
pub(super) const LOCAL_PROVIDER: &str = "shm";
/// The parameter that sets the local plane's rail count (its `num_rails`).
pub(super) const RAILS_PARAM: &str = "local_rails";
/// First byte of the two-plane encodings.
const TAG: u8 = 0xd7;
const VERSION: u8 = 1;
/// Part kinds: the network plane's, the local plane's.
const NET: u8 = 0;
const LOCAL: u8 = 1;

/// The LIBFABRIC backend as the agent sees it: a network plane and, where it has one, an
/// `shm` plane for peers on this host.
#[derive(Debug)]
pub(super) struct Planes {
    /// The network plane first.
    planes: Vec<LibfabricBackend>,
    /// Each loaded peer's plane.
    routes: RwLock<HashMap<String, Route>>,
    /// The loaded peers' names, which every plane knows (a message from another plane's
    /// endpoint naming one of them is an impersonation: module `sources`).
    loaded: Arc<LoadedNames>,
}

#[derive(Debug, Clone)]
struct Route {
    /// Index into [`Planes::planes`].
    plane: usize,
    /// The kind of the peer's part this plane talks to.
    part: u8,
    /// The connection information it was chosen for.
    info: Vec<u8>,
}

/// Opens the network plane and, unless `local_provider=none` or the network provider is
/// `shm` already, the `shm` plane (where `shm` is missing it is left out, logged, unless
/// `local_provider=shm` asked for it).
/// [`open_planes`] for `agent`'s name and settings, in tests.
#[cfg(test)]
fn open_planes_for(agent: &crate::Agent, params: &crate::backend::BackendParams) -> Result<Planes> {
    open_planes(&agent.backend_init(params.clone()))
}

pub(super) fn open_planes(init: &BackendInit) -> Result<Planes> {
    let mut net_params = init.params.clone();
    // Empty: unset (as the Python package's listed default).
    let local_rails = net_params.remove(RAILS_PARAM).filter(|v| !v.is_empty());
    if let Some(v) = &local_rails {
        if !v.parse::<usize>().is_ok_and(|n| (1..=16).contains(&n)) {
            return Err(Error::InvalidParam(format!(
                "{NAME} parameter {RAILS_PARAM}=`{v}`: 1..=16"
            )));
        }
    }
    let (want_local, explicit) = match net_params.remove(PARAM).as_deref() {
        None => (true, false),
        Some(LOCAL_PROVIDER) => (true, true),
        Some("none") => (false, true),
        Some(v) => {
            return Err(Error::InvalidParam(format!(
                "{NAME} parameter {PARAM}=`{v}`: {LOCAL_PROVIDER} or none"
            )))
        }
    };
    let net = open(&init.with_params(net_params.clone()))?;
    let mut planes = vec![net];
    if want_local && planes[0].provider() != LOCAL_PROVIDER {
        let mut local = net_params;
        local.insert("provider".into(), LOCAL_PROVIDER.into());
        // The network's address, rail count and striping are not shm's.
        local.remove("node");
        local.remove("num_rails");
        local.remove("striping_threshold");
        if let Some(n) = local_rails {
            local.insert("num_rails".into(), n);
        }
        // `direct` asks it of the network provider; shm stages what it cannot register.
        if local.get("vram_mode").map(String::as_str) == Some("direct") {
            local.insert("vram_mode".into(), "auto".into());
        }
        match open(&init.with_params(local)) {
            Ok(plane) => planes.push(plane),
            Err(e) if explicit => return Err(e),
            Err(e) => tracing::info!(
                error = %e,
                "{NAME}: no {LOCAL_PROVIDER} rails; peers on this host are reached through `{}`",
                planes[0].provider()
            ),
        }
    }
    tracing::debug!(
        providers = ?planes.iter().map(LibfabricBackend::provider).collect::<Vec<_>>(),
        "{NAME}: planes"
    );
    let loaded = Arc::new(LoadedNames::default());
    for plane in &planes {
        plane.share_loaded_names(loaded.clone());
    }
    Ok(Planes {
        planes,
        routes: RwLock::default(),
        loaded,
    })
}

impl Planes {
    fn route(&self, agent: &str) -> Result<Route> {
        self.routes
            .read()
            .get(agent)
            .cloned()
            .ok_or_else(|| Error::UnknownAgent(agent.to_string()))
    }

    fn providers(&self) -> Vec<&str> {
        self.planes.iter().map(LibfabricBackend::provider).collect()
    }
}

/// One plane's part of a peer's connection information.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ConnPart {
    kind: u8,
    /// `None` from a peer of one plane (its provider is not said).
    provider: Option<String>,
    info: Vec<u8>,
}

/// A peer's connection information, either form.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PeerConn {
    host: Option<HostId>,
    parts: Vec<ConnPart>,
}

impl PeerConn {
    fn part(&self, kind: u8) -> Option<&ConnPart> {
        self.parts.iter().find(|p| p.kind == kind)
    }
}

fn bad(what: &str, why: &str) -> Error {
    Error::MalformedMetadata(format!("{NAME} {what}: {why}"))
}

/// A bounded reader over hostile input.
struct Reader<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(bad(self.what, "truncated"));
        }
        let (head, tail) = self.b.split_at(n);
        self.b = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn bytes32(&mut self) -> Result<&'a [u8]> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes"));
        self.take(n as usize)
    }
    /// The header (tag and version) of a two-plane encoding.
    fn header(&mut self) -> Result<()> {
        self.u8()?;
        match self.u8()? {
            VERSION => Ok(()),
            v => Err(bad(
                self.what,
                &format!("version {v} (this build reads {VERSION})"),
            )),
        }
    }
    /// Part count and kinds: 1..=2 parts, kinds known and distinct, the network's there.
    fn check_kinds(&self, kinds: &[u8]) -> Result<()> {
        let known = kinds.iter().all(|k| [NET, LOCAL].contains(k));
        let distinct = kinds.len() < 2 || kinds[0] != kinds[1];
        if kinds.is_empty() || kinds.len() > 2 || !known || !distinct || !kinds.contains(&NET) {
            return Err(bad(self.what, "bad plane list"));
        }
        Ok(())
    }
    fn end(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(bad(self.what, "trailing bytes"))
        }
    }
}

fn put_bytes32(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn encode_conn(host: Option<&HostId>, parts: &[ConnPart]) -> Vec<u8> {
    let mut out = vec![TAG, VERSION];
    match host {
        Some(h) => {
            out.push(1);
            h.encode(&mut out);
        }
        None => out.push(0),
    }
    out.push(parts.len() as u8);
    for part in parts {
        out.push(part.kind);
        let provider = part.provider.as_deref().unwrap_or("");
        out.push(provider.len() as u8);
        out.extend_from_slice(provider.as_bytes());
        put_bytes32(&mut out, &part.info);
    }
    out
}

/// Either form: a plane's own connection information is the peer's network part.
fn decode_conn(info: &[u8]) -> Result<PeerConn> {
    if info.first() != Some(&TAG) {
        return Ok(PeerConn {
            host: None,
            parts: vec![ConnPart {
                kind: NET,
                provider: None,
                info: info.to_vec(),
            }],
        });
    }
    let mut r = Reader {
        b: info,
        what: "connection info",
    };
    r.header()?;
    let host = match r.u8()? {
        0 => None,
        1 => Some(HostId::decode(r.take(host::WIRE_SIZE)?)?),
        _ => return Err(bad(r.what, "bad host flag")),
    };
    let count = r.u8()? as usize;
    let mut parts = Vec::with_capacity(count.min(2));
    for _ in 0..count.min(3) {
        let kind = r.u8()?;
        let len = r.u8()? as usize;
        let provider = std::str::from_utf8(r.take(len)?)
            .map_err(|_| bad("connection info", "provider name not UTF-8"))?;
        let info = r.bytes32()?.to_vec();
        parts.push(ConnPart {
            kind,
            provider: (!provider.is_empty()).then(|| provider.to_string()),
            info,
        });
    }
    r.check_kinds(&parts.iter().map(|p| p.kind).collect::<Vec<_>>())?;
    r.end()?;
    Ok(PeerConn { host, parts })
}

fn encode_md(parts: &[(u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = vec![TAG, VERSION, parts.len() as u8];
    for (kind, md) in parts {
        out.push(*kind);
        put_bytes32(&mut out, md);
    }
    out
}

/// Either form: a plane's own region metadata is the peer's network part.
fn decode_md(md: &[u8]) -> Result<Vec<(u8, &[u8])>> {
    if md.first() != Some(&TAG) {
        return Ok(vec![(NET, md)]);
    }
    let mut r = Reader {
        b: md,
        what: "region metadata",
    };
    r.header()?;
    let count = r.u8()? as usize;
    let mut parts = Vec::with_capacity(count.min(2));
    for _ in 0..count.min(3) {
        let kind = r.u8()?;
        parts.push((kind, r.bytes32()?));
    }
    r.check_kinds(&parts.iter().map(|p| p.0).collect::<Vec<_>>())?;
    r.end()?;
    Ok(parts)
}

/// The (plane, peer part) pairs to try for a peer, best first: where it shares this
/// host's memory, a plane of ours with the provider of one of its parts (its local part
/// first); then our network plane with its network part.
fn candidates(ours: &[&str], me: Option<&HostId>, peer: &PeerConn) -> Vec<(usize, u8)> {
    let mut out = Vec::new();
    let same_host = matches!((me, &peer.host), (Some(a), Some(b)) if a.shares_memory_with(b));
    if same_host {
        for kind in [LOCAL, NET] {
            let Some(provider) = peer.part(kind).and_then(|p| p.provider.as_deref()) else {
                continue;
            };
            if let Some(plane) = ours.iter().position(|o| *o == provider) {
                out.push((plane, kind));
            }
        }
    }
    if !out.contains(&(0, NET)) {
        out.push((0, NET));
    }
    out
}

/// A registration in every plane.
#[derive(Debug)]
struct PlanesLocalMd {
    mds: Vec<Arc<dyn LocalMd>>,
}

impl LocalMd for PlanesLocalMd {
    fn public_md(&self) -> Vec<u8> {
        match &self.mds[..] {
            [only] => only.public_md(),
            _ => encode_md(&[
                (NET, self.mds[0].public_md()),
                (LOCAL, self.mds[1].public_md()),
            ]),
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    /// The network plane's (its `shm` plane registers the same way, or stages).
    fn mode(&self) -> Option<&'static str> {
        self.mds[0].mode()
    }
}

/// A peer region in each of the peer's planes (by part kind).
#[derive(Debug)]
struct PlanesRemoteMd {
    parts: [Option<Arc<dyn RemoteMd>>; 2],
}

impl RemoteMd for PlanesRemoteMd {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Backend for Planes {
    fn name(&self) -> &str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.planes[0].capabilities()
    }

    fn supported_mem(&self) -> &[MemKind] {
        self.planes[0].supported_mem()
    }

    fn supported_remote_mem(&self) -> &[MemKind] {
        self.planes[0].supported_remote_mem()
    }

    fn register_mem(&self, region: &Region) -> Result<Arc<dyn LocalMd>> {
        let mds = self
            .planes
            .iter()
            .map(|p| p.register_mem(region))
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(PlanesLocalMd { mds }))
    }

    fn connection_info(&self) -> Result<Vec<u8>> {
        if self.planes.len() == 1 {
            return self.planes[0].connection_info();
        }
        let parts = self
            .planes
            .iter()
            .zip([NET, LOCAL])
            .map(|(p, kind)| {
                Ok(ConnPart {
                    kind,
                    provider: Some(p.provider().to_string()),
                    info: p.connection_info()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(encode_conn(HostId::current().as_ref(), &parts))
    }

    fn load_remote_conn_info(&self, agent: &str, info: &[u8]) -> Result<()> {
        let peer = decode_conn(info)?;
        let known = self.routes.read().get(agent).cloned();
        if let Some(route) = known.filter(|r| r.info == info) {
            // The same peer: its plane decides whether to watch it afresh.
            let part = peer.part(route.part).expect("the route's part exists");
            return self.planes[route.plane].load_remote_conn_info(agent, &part.info);
        }
        let providers = self.providers();
        let tries = candidates(&providers, HostId::current().as_ref(), &peer);
        let mut last = None;
        for (i, &(plane, kind)) in tries.iter().enumerate() {
            let part = peer.part(kind).expect("candidates are parts of the peer");
            match self.planes[plane].load_remote_conn_info(agent, &part.info) {
                Ok(()) => {
                    for (other, p) in self.planes.iter().enumerate() {
                        if other != plane {
                            p.disconnect(agent);
                        }
                    }
                    tracing::debug!(peer = agent, provider = providers[plane], "{NAME}: route");
                    self.loaded.insert(agent);
                    self.routes.write().insert(
                        agent.to_string(),
                        Route {
                            plane,
                            part: kind,
                            info: info.to_vec(),
                        },
                    );
                    return Ok(());
                }
                Err(e) if i + 1 < tries.len() => tracing::warn!(
                    peer = agent,
                    provider = providers[plane],
                    error = %e,
                    "{NAME}: this peer on this host is not reachable through {}; trying `{}`",
                    providers[plane],
                    providers[tries[i + 1].0]
                ),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one candidate"))
    }

    fn load_remote_md(
        &self,
        agent: &str,
        region: &Region,
        public_md: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        let mut parts: [Option<Arc<dyn RemoteMd>>; 2] = [None, None];
        let mut export = None;
        for (kind, md) in decode_md(public_md)? {
            // Parsing is the same on every plane.
            let parsed = self.planes[0].load_remote_md(agent, region, md)?;
            export = export.or(super::remote_export(&*parsed));
            parts[kind as usize] = Some(parsed);
        }
        // The plane the peer is reached by checks its READ assists, pushes and direct
        // copy requests against what it advertised (the first plane took note while
        // parsing).
        for plane in &self.planes[1..] {
            plane.advertise(agent, region, export.as_ref());
        }
        Ok(Arc::new(PlanesRemoteMd { parts }))
    }

    fn peer_gone(&self, agent: &str) -> bool {
        self.route(agent)
            .is_ok_and(|route| self.planes[route.plane].peer_gone(agent))
    }

    fn disconnect(&self, agent: &str) {
        self.routes.write().remove(agent);
        self.loaded.remove(agent);
        for plane in &self.planes {
            plane.disconnect(agent);
        }
    }

    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        let route = self.route(agent)?;
        let mut mapped = Vec::with_capacity(entries.len());
        for e in entries {
            let (local, remote) = e.metadata::<PlanesLocalMd, PlanesRemoteMd>(NAME)?;
            let remote_md = remote.parts[route.part as usize]
                .as_deref()
                .ok_or_else(|| {
                    Error::MalformedMetadata(format!(
                        "{NAME}: `{agent}`'s region at {:#x} has no metadata for the rails it is \
                     reached by ({})",
                        e.remote_region.desc.addr,
                        self.planes[route.plane].provider()
                    ))
                })?;
            mapped.push(XferEntry {
                local_md: &*local.mds[route.plane],
                remote_md,
                ..*e
            });
        }
        self.planes[route.plane].prep_xfer(op, &mapped, agent)
    }

    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        self.planes[self.route(agent)?.plane].gen_notif(agent, msg)
    }

    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        for plane in &self.planes {
            plane.take_notifs(into);
        }
    }

    fn set_notif_waker(&self, waker: NotifWaker) -> bool {
        // Every plane gets it (the shm plane receives as the network plane does); the
        // wait is woken by both only if both wake.
        let mut all = true;
        for plane in &self.planes {
            all &= plane.set_notif_waker(waker.clone());
        }
        all
    }

    /// `peer:<agent>` (each meta entry): how this backend reaches that loaded peer and
    /// what its direct VRAM copies moved (see [`LibfabricBackend::peer_path_info`]);
    /// `None` for anything else and for a peer not loaded; a query naming no peer at all
    /// is not supported, as for every backend without storage.
    fn query_mem_info(
        &self,
        _kind: MemKind,
        meta: &[&[u8]],
    ) -> Result<Vec<Option<crate::backend::BackendParams>>> {
        // Without a peer query this backend answers as every backend without storage
        // does (callers such as the Python layer then answer from the registrations).
        if !meta.iter().any(|m| m.starts_with(b"peer:")) {
            return Err(crate::Error::NotSupported {
                backend: self.name().to_string(),
                what: "queries of storage by descriptor metadata (queryMem); \"peer:<agent>\" \
                       names a loaded peer's path"
                    .into(),
            });
        }
        Ok(meta
            .iter()
            .map(|m| {
                let agent = std::str::from_utf8(m).ok()?.strip_prefix("peer:")?;
                let route = self.route(agent).ok()?;
                Some(self.planes[route.plane].peer_path_info(agent))
            })
            .collect())
    }

    /// The provider, and where VRAM <-> a same-host peer's DRAM is one direct copy
    /// (module `peer_copy`), that too.
    fn peer_transport(&self, agent: &str) -> Option<String> {
        let route = self.route(agent).ok()?;
        let plane = &self.planes[route.plane];
        Some(match plane.peer_copy_path(agent) {
            Some(path) => format!("{}; {path}", plane.provider()),
            None => plane.provider().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendParams;
    use crate::Agent;

    fn conn(host: Option<HostId>, local: bool) -> PeerConn {
        let mut parts = vec![ConnPart {
            kind: NET,
            provider: Some("tcp;ofi_rxm".into()),
            info: vec![1, 1, 0, 9],
        }];
        if local {
            parts.push(ConnPart {
                kind: LOCAL,
                provider: Some("shm".into()),
                info: vec![1, 2, 0, 7, 7],
            });
        }
        PeerConn { host, parts }
    }

    #[test]
    fn connection_info_round_trips_and_bad_input_is_a_typed_error() {
        let me = HostId::current().unwrap();
        for (host, local) in [(Some(me), true), (None, true), (Some(me), false)] {
            let peer = conn(host, local);
            let wire = encode_conn(host.as_ref(), &peer.parts);
            assert_eq!(decode_conn(&wire).unwrap(), peer);
            for cut in 0..wire.len() {
                let r = decode_conn(&wire[..cut]);
                // Cut at 0 is the empty (one-plane) form, left to the plane to refuse.
                if cut > 0 {
                    assert!(matches!(r, Err(Error::MalformedMetadata(_))), "cut {cut}");
                }
            }
            let mut long = wire.clone();
            long.push(0);
            assert!(matches!(
                decode_conn(&long),
                Err(Error::MalformedMetadata(_))
            ));
        }
        let wire = encode_conn(Some(&me), &conn(Some(me), true).parts);
        let mut version = wire.clone();
        version[1] = 9;
        let e = decode_conn(&version).unwrap_err();
        assert!(e.to_string().contains("version 9"), "{e}");
        let host_at = 3;
        let mut flag = wire.clone();
        flag[2] = 7;
        assert!(decode_conn(&flag).is_err());
        // Part kinds: unknown, repeated, or the network's missing.
        let parts_at = host_at + host::WIRE_SIZE;
        for (count, kinds) in [
            (0u8, None),
            (3, None),
            (2, Some([NET, NET])),
            (2, Some([LOCAL, 5])),
        ] {
            let mut w = wire.clone();
            w[parts_at] = count;
            if let Some([a, b]) = kinds {
                w[parts_at + 1] = a;
                let second = parts_at + 1 + 1 + 1 + "tcp;ofi_rxm".len() + 4 + 4;
                w[second] = b;
            }
            assert!(
                matches!(decode_conn(&w), Err(Error::MalformedMetadata(_))),
                "{count} {kinds:?}"
            );
        }
        let only_local = encode_conn(Some(&me), &conn(Some(me), true).parts[1..]);
        assert!(decode_conn(&only_local).is_err());
        // A plane's own form is the network part.
        let plain = decode_conn(&[1, 1, 0, 9]).unwrap();
        assert_eq!(plain.parts.len(), 1);
        assert_eq!(plain.host, None);
        assert_eq!(plain.parts[0].info, [1, 1, 0, 9]);
    }

    #[test]
    fn region_metadata_round_trips_and_bad_input_is_a_typed_error() {
        let parts = vec![(NET, vec![1u8, 2, 3]), (LOCAL, vec![0, 1, 0, 0, 1, 0])];
        let wire = encode_md(&parts);
        let back = decode_md(&wire).unwrap();
        assert_eq!(
            back,
            vec![(NET, &[1u8, 2, 3][..]), (LOCAL, &[0, 1, 0, 0, 1, 0][..])]
        );
        for cut in 1..wire.len() {
            assert!(matches!(
                decode_md(&wire[..cut]),
                Err(Error::MalformedMetadata(_))
            ));
        }
        let mut long = wire.clone();
        long.push(1);
        assert!(decode_md(&long).is_err());
        let mut version = wire.clone();
        version[1] = 2;
        assert!(decode_md(&version).is_err());
        let mut same = wire.clone();
        same[3 + 1 + 4 + 3] = NET;
        assert!(decode_md(&same).is_err());
        assert_eq!(decode_md(&[2, 9]).unwrap(), vec![(NET, &[2u8, 9][..])]);
    }

    /// `local_rails` sets the shm plane's rail count (the network plane keeps its own);
    /// a bad count is refused.
    #[test]
    fn local_rails_sets_the_shm_planes_rails() {
        let agent = Agent::new("local-rails", crate::AgentConfig::default()).unwrap();
        let params: BackendParams = [
            (RAILS_PARAM.to_string(), "3".to_string()),
            ("num_rails".to_string(), "1".to_string()),
        ]
        .into_iter()
        .collect();
        let planes = open_planes_for(&agent, &params).unwrap();
        assert_eq!(planes.providers()[1], LOCAL_PROVIDER);
        assert_eq!(planes.planes[0].rails.len(), 1);
        assert_eq!(planes.planes[1].rails.len(), 3);
        let bad: BackendParams = [(RAILS_PARAM.to_string(), "0".to_string())]
            .into_iter()
            .collect();
        assert!(matches!(
            open_planes_for(&agent, &bad),
            Err(Error::InvalidParam(_))
        ));
    }

    /// A peer on this host whose shm address this side's shm rails refuse is reached
    /// through the network provider (logged), not refused.
    #[test]
    fn a_refused_shm_address_falls_back_to_the_network() {
        let agent = |name: &str| Agent::new(name, crate::AgentConfig::default()).unwrap();
        let (a, b) = (agent("fallback-a"), agent("fallback-b"));
        let planes_a = open_planes_for(&a, &BackendParams::new()).unwrap();
        let planes_b = open_planes_for(&b, &BackendParams::new()).unwrap();
        assert_eq!(planes_a.providers()[1], LOCAL_PROVIDER);
        let good = planes_b.connection_info().unwrap();
        planes_a.load_remote_conn_info("b", &good).unwrap();
        assert_eq!(
            planes_a.peer_transport("b").as_deref(),
            Some(LOCAL_PROVIDER)
        );
        // `query_mem_info` with `peer:<agent>` names the path and the direct-copy
        // counters (agents of one process: never the direct path); anything else, or a
        // peer not loaded, is none.
        let info = planes_a
            .query_mem_info(MemKind::Vram, &[b"peer:b", b"peer:nobody", b"b"])
            .unwrap();
        let b_info = info[0].as_ref().expect("a loaded peer");
        assert_eq!(b_info["provider"], LOCAL_PROVIDER);
        assert_eq!(b_info["vram_peer_dram"], "staged");
        for counter in [
            "peer_copy_bytes",
            "peer_copy_served_bytes",
            "peer_copy_fallbacks",
        ] {
            assert_eq!(b_info[counter], "0", "{counter}");
        }
        assert!(info[1].is_none() && info[2].is_none());
        // The same peer, its shm rail named by an empty address.
        let mut peer = decode_conn(&good).unwrap();
        peer.parts[1].info = vec![1, 0, 0];
        let bad = encode_conn(peer.host.as_ref(), &peer.parts);
        planes_a.load_remote_conn_info("b", &bad).unwrap();
        assert_eq!(
            planes_a.peer_transport("b").as_deref(),
            Some(planes_a.providers()[0])
        );
        // Without the network part's help it is the shm plane's typed error.
        let only_local = PeerConn {
            host: peer.host,
            parts: vec![ConnPart {
                kind: NET,
                provider: Some(LOCAL_PROVIDER.into()),
                info: vec![1, 0, 0],
            }],
        };
        let wire = encode_conn(only_local.host.as_ref(), &only_local.parts);
        assert!(planes_a.load_remote_conn_info("c", &wire).is_err());
    }

    #[test]
    fn peers_sharing_this_host_go_through_shm_others_through_the_network() {
        let me = HostId::current().unwrap();
        let mut wire = Vec::new();
        me.encode(&mut wire);
        // Same kernel, a pid namespace of its own (the netns tests' target).
        wire[24] ^= 1;
        let netns = HostId::decode(&wire).unwrap();
        let both = ["tcp;ofi_rxm", "shm"];
        assert_eq!(
            candidates(&both, Some(&me), &conn(Some(me), true)),
            [(1, LOCAL), (0, NET)]
        );
        assert_eq!(
            candidates(&both, Some(&me), &conn(Some(netns), true)),
            [(0, NET)]
        );
        assert_eq!(candidates(&both, Some(&me), &conn(None, true)), [(0, NET)]);
        assert_eq!(candidates(&both, None, &conn(Some(me), true)), [(0, NET)]);
        assert_eq!(
            candidates(&both, Some(&me), &conn(Some(me), false)),
            [(0, NET)]
        );
        // local_provider=none here: the network, though the peer has shm rails.
        assert_eq!(
            candidates(&["tcp;ofi_rxm"], Some(&me), &conn(Some(me), true)),
            [(0, NET)]
        );
        // provider=shm here: the peer's shm part.
        assert_eq!(
            candidates(&["shm"], Some(&me), &conn(Some(me), true)),
            [(0, LOCAL), (0, NET)]
        );
    }
}
