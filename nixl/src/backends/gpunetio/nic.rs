//! `GPUNETIO`'s NIC path: peers on other nodes, a peer's DRAM, and every peer under
//! `nic_handler=cpu_proxy`, through `gpunetio`'s `CpuProxy` NIC handler over a libfabric
//! endpoint (the transfer kernel and device-API kernels write ring entries, a proxy
//! thread posts them).
//!
//! - **Serving**: one proxy whose endpoint (its address is in the connection info) has
//!   every local registration registered, so peers can target it; its thread keeps the
//!   endpoint progressing, which manual-progress providers (`tcp;ofi_rxm`) need for the
//!   peers' writes and atomics to land.
//! - **Per peer**: one proxy with its own ring, thread and endpoint, connected to the
//!   peer's serving endpoint: a peer that fails takes only its own ring down. Every
//!   local registration sits at the same table index (its *slot*) in every proxy, so a
//!   local view's element names its source region the same way whichever peer a kernel
//!   puts to; the peer's regions are added above the slots, once per remote region.
//! - **Device memory**: registered directly where the provider registers it (`FI_HMEM`),
//!   else staged through pinned bounce buffers by the proxy — a source or destination of
//!   this side's operations, never a peer's target (its metadata then has no
//!   descriptor, and a peer's transfer to it is refused as unsupported).
//! - **Notifications**: over the OOB channel ([`super::oob`]), after the data.
//! - **Heartbeats**: a hub (module `heartbeat`, as `LIBFABRIC`'s) on the notification
//!   address sends heartbeats to the peers that watch this backend and watches every
//!   peer whose connection information advertised one. A peer's transfers check its
//!   watch (at post, while in flight, and when a kernel failed): once it is dead they
//!   end in `RemoteDisconnect` and the peer's ring is shut down, so the kernels that wait
//!   on it end instead of waiting out the device timeout; no new proxy is made toward
//!   it. Its connection information loaded again (a restored link, a new incarnation)
//!   watches it afresh and builds a new proxy; requests on the old one keep it until
//!   they are released.

use super::oob::{OobListener, OobSender};
use super::NAME;
use crate::backends::heartbeat::{HeartbeatConfig, Hub, HubAddr, PeerWatch};
use crate::backends::shared::LocalProcess;
use crate::error::{Error, Result};
use crate::mem::MemKind;
use gpunetio::proxy::{CpuProxy, CpuProxyBuilder, FabricTransport, RemoteDescriptor, RingMemory};
use gpunetio::Gpu;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Table indices `[0, LOCAL_SLOTS)` are local registrations' slots; the peers' regions
/// go above.
pub(super) const LOCAL_SLOTS: u32 = 32_768;
/// Ring entries of a peer's proxy (a full ring makes producers wait, bounded).
const PEER_RING: u32 = 4096;
/// Nothing posts on the serving proxy's ring: it exists for its thread and table.
const SERVE_RING: u32 = 8;

fn nic_err(context: &'static str) -> impl FnOnce(gpunetio::Error) -> Error {
    move |e| Error::Backend {
        backend: NAME.into(),
        code: -1,
        message: format!("{context}: {e}"),
    }
}

/// What a peer publishes for the NIC path (part of the backend's connection info).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct NicInfo {
    /// The libfabric provider of its endpoints.
    pub provider: String,
    /// Its serving endpoint's address.
    pub endpoint: Vec<u8>,
    /// Where its notifications listener accepts.
    pub oob: SocketAddr,
}

/// A local registration the NIC path knows.
#[derive(Debug, Clone, Copy)]
struct LocalSpec {
    kind: MemKind,
    addr: u64,
    len: u64,
}

#[derive(Debug, Default)]
struct Locals {
    live: BTreeMap<u32, LocalSpec>,
    free: Vec<u32>,
    next: u32,
}

#[derive(Debug)]
struct PeerEntry {
    info: NicInfo,
    /// Its heartbeat hub, as its connection information advertised it.
    hub: Option<HubAddr>,
    /// Its heartbeats, where both sides send them; dead once they stopped.
    watch: Option<Arc<PeerWatch>>,
    link: Option<Arc<NicPeer>>,
}

/// The proxy and notification channel toward one peer.
#[derive(Debug)]
pub(super) struct NicPeer {
    pub(super) name: String,
    pub(super) proxy: CpuProxy<FabricTransport>,
    pub(super) oob: OobSender,
    /// The peer's heartbeats (see [`NicPath::load_peer`]).
    watch: Option<Arc<PeerWatch>>,
}

impl NicPeer {
    /// `Err(RemoteDisconnect)` once the peer's heartbeats stopped or its notification
    /// connection closed. A peer found silent has its ring shut down: the kernels
    /// waiting on it end (`GIO_ERR_SHUTDOWN`) instead of waiting out the device
    /// timeout for operations a vanished host never completes, so releasing their
    /// requests does not wait either.
    pub(super) fn alive(&self) -> Result<()> {
        if let Some(watch) = &self.watch {
            if let Err(e) = watch.check(&self.name) {
                self.proxy.shutdown();
                return Err(e);
            }
        }
        self.oob.alive()
    }
}

/// The NIC path of one backend.
#[derive(Debug)]
pub(super) struct NicPath {
    me: String,
    gpu: Gpu,
    provider: String,
    node: IpAddr,
    timeout: Duration,
    serve: CpuProxy<FabricTransport>,
    // Lock order: `locals` before `peers`.
    locals: Mutex<Locals>,
    peers: Mutex<HashMap<String, PeerEntry>>,
    oob: OobListener,
    /// Sends heartbeats to the peers that watch this backend and watches the peers it
    /// loaded (`None` with `heartbeat_ms=0`).
    hub: Option<Hub>,
}

impl NicPath {
    pub(super) fn new(
        me: &str,
        gpu: &Gpu,
        provider: &str,
        node: IpAddr,
        timeout: Duration,
        heartbeat: HeartbeatConfig,
    ) -> Result<Arc<Self>> {
        let serve = Self::proxy(gpu, provider, node, timeout, SERVE_RING)?;
        serve
            .start()
            .map_err(nic_err("starting the serving proxy"))?;
        // On the notification address: where peers already reach this backend.
        let hub = match heartbeat.interval {
            Some(_) => Some(Hub::start(NAME, me, node, heartbeat)?),
            None => None,
        };
        Ok(Arc::new(Self {
            me: me.to_string(),
            gpu: gpu.clone(),
            provider: provider.to_string(),
            node,
            timeout,
            serve,
            locals: Mutex::default(),
            peers: Mutex::default(),
            oob: OobListener::bind(node, me)?,
            hub,
        }))
    }

    /// Where peers reach this backend's heartbeat hub (`None`: heartbeats off).
    pub(super) fn hub_addr(&self) -> Option<HubAddr> {
        self.hub.as_ref().map(Hub::addr)
    }

    /// Checks, without a GPU, that `provider` opens an endpoint at `node`: a wrong
    /// provider is refused when the backend is created, not at its first NIC transfer.
    pub(super) fn probe_provider(provider: &str, node: IpAddr) -> Result<()> {
        FabricTransport::new_at(provider, &node.to_string())
            .map(drop)
            .map_err(|e| {
                Error::InvalidParam(format!(
                    "{NAME}: the CPU proxy's libfabric provider `{provider}` at {node}: {e}"
                ))
            })
    }

    fn proxy(
        gpu: &Gpu,
        provider: &str,
        node: IpAddr,
        timeout: Duration,
        ring: u32,
    ) -> Result<CpuProxy<FabricTransport>> {
        let transport = FabricTransport::new_at(provider, &node.to_string()).map_err(|e| {
            Error::InvalidParam(format!(
                "{NAME}: the CPU proxy's libfabric provider `{provider}` at {node}: {e}"
            ))
        })?;
        let ring = RingMemory::cuda(gpu, ring, 0).map_err(nic_err("allocating a proxy ring"))?;
        CpuProxyBuilder::new()
            .gpu(gpu)
            .timeout(timeout)
            .reserve_indices(LOCAL_SLOTS)
            .build(transport, &ring)
            .map_err(nic_err("building a CPU proxy"))
    }

    /// What peers need: provider, serving endpoint, notification address.
    pub(super) fn info(&self) -> Result<NicInfo> {
        Ok(NicInfo {
            provider: self.provider.clone(),
            endpoint: self
                .serve
                .local_info()
                .map_err(nic_err("the serving endpoint's address"))?,
            oob: self.oob.addr(),
        })
    }

    /// The provider the proxies use.
    pub(super) fn provider(&self) -> &str {
        &self.provider
    }

    /// Registers local memory with every proxy at a new slot.
    pub(super) fn register(
        self: &Arc<Self>,
        kind: MemKind,
        addr: u64,
        len: u64,
    ) -> Result<NicLocal> {
        let mut locals = self.locals.lock();
        let slot = match locals.free.pop() {
            Some(slot) => slot,
            None if locals.next < LOCAL_SLOTS => {
                locals.next += 1;
                locals.next - 1
            }
            None => {
                return Err(Error::InvalidParam(format!(
                    "{NAME}: at most {LOCAL_SLOTS} registrations at once"
                )))
            }
        };
        let spec = LocalSpec { kind, addr, len };
        let placed = self.place(&self.serve, slot, spec);
        let staged = match placed {
            Ok(staged) => staged,
            Err(e) => {
                locals.free.push(slot);
                return Err(e);
            }
        };
        let desc = if staged {
            None
        } else {
            Some(
                self.serve
                    .descriptor(slot)
                    .map_err(nic_err("describing a registration"))?,
            )
        };
        let peers = self.peers.lock();
        let mut done: Vec<&Arc<NicPeer>> = Vec::new();
        for link in peers.values().filter_map(|p| p.link.as_ref()) {
            if let Err(e) = self.place(&link.proxy, slot, spec) {
                for l in done {
                    let _ = l.proxy.remove_region(slot);
                }
                let _ = self.serve.remove_region(slot);
                locals.free.push(slot);
                return Err(e);
            }
            done.push(link);
        }
        drop(peers);
        locals.live.insert(slot, spec);
        Ok(NicLocal {
            slot,
            desc,
            staged,
            path: Arc::downgrade(self),
        })
    }

    /// Registers `spec` in `proxy` at `slot`; whether it is staged.
    fn place(&self, proxy: &CpuProxy<FabricTransport>, slot: u32, spec: LocalSpec) -> Result<bool> {
        let len = usize::try_from(spec.len)
            .map_err(|_| Error::InvalidParam(format!("{NAME}: a {}-byte region", spec.len)))?;
        match spec.kind {
            // SAFETY: the agent keeps a registration's memory allocated until it is
            // deregistered, and the NicLocal removes it from every proxy first.
            MemKind::Dram => unsafe { proxy.register_local_at(slot, spec.addr as *mut u8, len) }
                .map(|()| false)
                .map_err(nic_err("registering DRAM with a CPU proxy")),
            MemKind::Vram => {
                // SAFETY: as above, device memory of the backend's GPU (checked at
                // registration).
                unsafe { proxy.register_device_range(Some(slot), &self.gpu, spec.addr, len) }
                    .map(|(_, staged)| staged)
                    .map_err(nic_err("registering VRAM with a CPU proxy"))
            }
            other => Err(Error::InvalidParam(format!(
                "{NAME} does not move {other:?}"
            ))),
        }
    }

    fn release(&self, slot: u32) {
        let mut locals = self.locals.lock();
        locals.live.remove(&slot);
        let peers = self.peers.lock();
        for link in peers.values().filter_map(|p| p.link.as_ref()) {
            if let Err(e) = link.proxy.remove_region(slot) {
                tracing::warn!("{NAME}: releasing slot {slot} toward {}: {e}", link.name);
            }
        }
        drop(peers);
        if let Err(e) = self.serve.remove_region(slot) {
            tracing::warn!("{NAME}: releasing slot {slot}: {e}");
        }
        locals.free.push(slot);
    }

    /// Records (or replaces) what `agent` published, and watches its heartbeats where
    /// it advertised a hub (`hub`; `same_host`: it runs on this node, `process`: and in
    /// this pid namespace — see [`watch_peer`]). The same information loaded again keeps
    /// the peer as it is, unless its heartbeats stopped: then it is watched afresh and
    /// reached through a new proxy (a restored link).
    pub(super) fn load_peer(
        &self,
        agent: &str,
        info: NicInfo,
        hub: Option<HubAddr>,
        same_host: bool,
        process: Option<LocalProcess>,
    ) -> Result<()> {
        if info.provider != self.provider {
            return Err(Error::Unreachable {
                backend: NAME.into(),
                agent: agent.to_string(),
                reason: format!(
                    "its CPU proxy uses provider `{}`, this backend `{}`",
                    info.provider, self.provider
                ),
            });
        }
        let unchanged = |peers: &HashMap<String, PeerEntry>| {
            peers.get(agent).is_some_and(|p| {
                p.info == info && p.hub == hub && !p.watch.as_ref().is_some_and(|w| w.is_dead())
            })
        };
        if unchanged(&self.peers.lock()) {
            return Ok(());
        }
        // Outside the table's lock: the handshake waits for the peer's hub (up to its
        // connect bound), and transfers read the table.
        let watch = watch_peer(self.hub.as_ref(), agent, hub, same_host, process);
        let mut peers = self.peers.lock();
        if unchanged(&peers) {
            return Ok(()); // a concurrent load did it
        }
        // A hello naming it is asked about at the address it advertised.
        self.oob.know(agent, info.oob);
        // A new incarnation (or a peer whose heartbeats had stopped): requests on the
        // old link keep it until they are released.
        peers.insert(
            agent.to_string(),
            PeerEntry {
                info,
                hub,
                watch,
                link: None,
            },
        );
        Ok(())
    }

    /// Whether `agent`'s heartbeats stopped (the incarnation loaded last is over, or
    /// the link to it is gone).
    pub(super) fn peer_gone(&self, agent: &str) -> bool {
        self.peers
            .lock()
            .get(agent)
            .and_then(|p| p.watch.as_ref())
            .is_some_and(|w| w.is_dead())
    }

    /// Whether `agent` published a NIC path.
    pub(super) fn knows(&self, agent: &str) -> bool {
        self.peers.lock().contains_key(agent)
    }

    pub(super) fn forget(&self, agent: &str) {
        self.peers.lock().remove(agent);
        self.oob.forget(agent);
    }

    /// The proxy toward `agent`, made on first use.
    pub(super) fn link(&self, agent: &str) -> Result<Arc<NicPeer>> {
        let locals = self.locals.lock();
        let mut peers = self.peers.lock();
        let entry = peers.get_mut(agent).ok_or_else(|| Error::Unreachable {
            backend: NAME.into(),
            agent: agent.to_string(),
            reason: "no NIC path: its metadata was not loaded (or it has no GPUNETIO NIC path)"
                .into(),
        })?;
        if let Some(link) = &entry.link {
            return Ok(link.clone());
        }
        // No proxy toward a peer known silent: its requests would wait for nothing.
        if let Some(watch) = &entry.watch {
            watch.check(agent)?;
        }
        let proxy = Self::proxy(
            &self.gpu,
            &self.provider,
            self.node,
            self.timeout,
            PEER_RING,
        )?;
        proxy
            .connect(&entry.info.endpoint)
            .map_err(nic_err("connecting a CPU proxy to the peer's endpoint"))?;
        for (&slot, &spec) in &locals.live {
            self.place(&proxy, slot, spec)?;
        }
        proxy
            .start()
            .map_err(nic_err("starting a peer's CPU proxy"))?;
        let link = Arc::new(NicPeer {
            name: agent.to_string(),
            proxy,
            oob: OobSender::new(&self.me, agent, entry.info.oob, self.oob.own_conns()),
            watch: entry.watch.clone(),
        });
        entry.link = Some(link.clone());
        Ok(link)
    }

    /// The notification connections this backend opened (what peers ask about).
    pub(super) fn own_conns(&self) -> Arc<super::oob::OwnConns> {
        self.oob.own_conns()
    }

    /// The Unix socket where same-host control connections are accepted (module `oob`).
    pub(super) fn oob_unix(&self) -> Option<&[u8]> {
        self.oob.unix_name()
    }

    /// `agent` advertised itself as process `who` for same-host control connections.
    pub(super) fn know_process(&self, agent: &str, who: Option<super::oob::LocalIdentity>) {
        self.oob.know_process(agent, who);
    }

    /// Serves control connections' requests and their shared lanes (module
    /// `peer_dram`).
    pub(super) fn serve_control(
        &self,
        handler: super::oob::ControlHandler,
        lanes: super::oob::LaneHandler,
    ) {
        self.oob.serve_lanes_with(lanes);
        self.oob.serve_control(handler);
    }

    /// Notification connections refused for whom they named (module `oob`).
    pub(super) fn refused_senders(&self) -> u64 {
        self.oob.refused()
    }

    /// Notifications received from peers.
    pub(super) fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        self.oob.take(into);
    }

    /// Adds an agent's waker, woken by each notification a peer sends from now on.
    pub(super) fn add_notif_waker(&self, waker: crate::backend::NotifWaker) {
        self.oob.add_waker(waker);
    }
}

/// A local registration's place in the NIC path; released from every proxy on drop.
#[derive(Debug)]
pub(super) struct NicLocal {
    pub(super) slot: u32,
    /// How peers target it; `None` when it is staged.
    pub(super) desc: Option<RemoteDescriptor>,
    pub(super) staged: bool,
    path: Weak<NicPath>,
}

impl Drop for NicLocal {
    fn drop(&mut self) {
        if let Some(path) = self.path.upgrade() {
            path.release(self.slot);
        }
    }
}

/// A peer's region as the NIC path sees it: its descriptor, and its index in the proxy
/// toward that peer once a transfer used it (removed from that proxy on drop).
#[derive(Debug)]
pub(super) struct NicRemote {
    desc: Option<RemoteDescriptor>,
    added: Mutex<Option<(Weak<NicPeer>, u32)>>,
}

impl NicRemote {
    pub(super) fn new(desc: Option<RemoteDescriptor>) -> Self {
        Self {
            desc,
            added: Mutex::new(None),
        }
    }

    /// Its index in `peer`'s proxy, added on first use.
    pub(super) fn index(&self, peer: &Arc<NicPeer>) -> Result<u32> {
        let desc = self.desc.as_ref().ok_or_else(|| Error::NotSupported {
            backend: NAME.into(),
            what: format!(
                "targeting this region of `{}` through the NIC: its provider cannot register that device memory (it is staged there)",
                peer.name
            ),
        })?;
        let mut added = self.added.lock();
        if let Some((p, index)) = added.as_ref() {
            if p.upgrade().is_some_and(|p| Arc::ptr_eq(&p, peer)) {
                return Ok(*index);
            }
        }
        let index = peer
            .proxy
            .add_remote(desc)
            .map_err(nic_err("adding the peer's region to its CPU proxy"))?;
        if let Some((old, old_index)) = added.replace((Arc::downgrade(peer), index)) {
            if let Some(old) = old.upgrade() {
                let _ = old.proxy.remove_region(old_index);
            }
        }
        Ok(index)
    }
}

impl Drop for NicRemote {
    fn drop(&mut self) {
        if let Some((peer, index)) = self.added.lock().take() {
            if let Some(peer) = peer.upgrade() {
                if let Err(e) = peer.proxy.remove_region(index) {
                    tracing::warn!("{NAME}: releasing a region of `{}`: {e}", peer.name);
                }
            }
        }
    }
}

/// Notifications of a transfer on the NIC path: over the OOB channel, after the data.
#[derive(Debug)]
pub(super) struct NicSink {
    pub(super) peer: Arc<NicPeer>,
}

impl crate::backends::cuda_copy::NotifSink for NicSink {
    fn deliver(&self, msg: Vec<u8>) -> Result<()> {
        self.peer.oob.send(&msg)
    }
    fn alive(&self) -> Result<()> {
        self.peer.alive()
    }
}

/// Watches `agent` through its hub at `at` where both sides run one (see
/// [`Hub::watch_peer`]).
pub(super) fn watch_peer(
    hub: Option<&Hub>,
    agent: &str,
    at: Option<HubAddr>,
    same_host: bool,
    process: Option<LocalProcess>,
) -> Option<Arc<PeerWatch>> {
    hub?.watch_peer(NAME, agent, at?, same_host, process)
}

// ---- wire encodings -------------------------------------------------------------------

/// Appends `bytes` with a u16 length.
pub(super) fn put_field(out: &mut Vec<u8>, bytes: &[u8]) -> Result<()> {
    let n = u16::try_from(bytes.len())
        .map_err(|_| Error::InvalidParam(format!("{NAME}: a {}-byte field", bytes.len())))?;
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(bytes);
    Ok(())
}

/// Reads fields written by [`put_field`]; anything short is malformed metadata.
pub(super) struct Fields<'a> {
    rest: &'a [u8],
    what: &'static str,
}

impl<'a> Fields<'a> {
    pub(super) fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Self { rest: bytes, what }
    }

    fn bad(&self, why: &str) -> Error {
        Error::MalformedMetadata(format!("{NAME} {}: {why}", self.what))
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.rest.len() < n {
            return Err(self.bad(&format!("{} bytes left, {n} needed", self.rest.len())));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    /// What is left to read.
    pub(super) fn rest(&self) -> &'a [u8] {
        self.rest
    }

    pub(super) fn field(&mut self) -> Result<&'a [u8]> {
        let n = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes"));
        self.take(n as usize)
    }

    pub(super) fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn finish(self) -> Result<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(self.bad(&format!("{} trailing bytes", self.rest.len())))
        }
    }
}

impl NicInfo {
    pub(super) fn encode(&self, out: &mut Vec<u8>) -> Result<()> {
        put_field(out, self.provider.as_bytes())?;
        put_field(out, &self.endpoint)?;
        put_field(out, self.oob.to_string().as_bytes())
    }

    pub(super) fn decode(f: &mut Fields<'_>) -> Result<Self> {
        let provider = String::from_utf8(f.field()?.to_vec())
            .map_err(|_| f.bad("a non-UTF-8 provider name"))?;
        let endpoint = f.field()?.to_vec();
        let oob = std::str::from_utf8(f.field()?)
            .ok()
            .and_then(|s| s.parse::<SocketAddr>().ok())
            .ok_or_else(|| f.bad("a bad notification address"))?;
        if provider.is_empty() || endpoint.is_empty() {
            return Err(f.bad("an empty provider or endpoint"));
        }
        Ok(Self {
            provider,
            endpoint,
            oob,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nic_info_round_trip_and_refusals() {
        let info = NicInfo {
            provider: "tcp;ofi_rxm".into(),
            endpoint: vec![1, 2, 3, 4],
            oob: "127.0.0.1:4242".parse().unwrap(),
        };
        let mut b = Vec::new();
        info.encode(&mut b).unwrap();
        let mut f = Fields::new(&b, "connection info");
        assert_eq!(NicInfo::decode(&mut f).unwrap(), info);
        f.finish().unwrap();
        for cut in 0..b.len() {
            let mut f = Fields::new(&b[..cut], "connection info");
            assert!(matches!(
                NicInfo::decode(&mut f),
                Err(Error::MalformedMetadata(_))
            ));
        }
        let mut bad = Vec::new();
        put_field(&mut bad, b"shm").unwrap();
        put_field(&mut bad, b"x").unwrap();
        put_field(&mut bad, b"not an address").unwrap();
        assert!(NicInfo::decode(&mut Fields::new(&bad, "connection info")).is_err());
        let mut trailing = b.clone();
        trailing.push(0);
        let mut f = Fields::new(&trailing, "connection info");
        NicInfo::decode(&mut f).unwrap();
        assert!(f.finish().is_err());
    }
}
