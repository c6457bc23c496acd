//! Connection information and the liveness of peers on other hosts.
//!
//! The connection information is the rail list (each rail's endpoint name), then, from
//! peers that can tell, the process identity that [`super::liveness`] watches (a peer on
//! this host), then the address of the peer's heartbeat hub ([`super::super::heartbeat`]),
//! then, from a peer that serves READ assists ([`super::assist`]) or direct VRAM copies
//! ([`super::peer_copy`]), the section that says which, then the public key its
//! notifications are sealed under ([`super::notif_mac`]; a peer without it is refused at
//! load).
//!
//! A peer on another host that vanishes (its link cut, its machine killed) is reported
//! by no provider in time: `tcp;ofi_rxm` and `sockets` keep retrying for minutes. So
//! each backend runs a heartbeat hub: a listener on the backend's address (`node` where
//! it is an IP address, else the agent's listen address, else the address this host
//! sends from on its default route, else loopback — then only peers on this host use
//! it) and one thread. Loading a peer's connection information connects
//! to the peer's hub, which then sends a heartbeat every `heartbeat_ms` (default 100)
//! from its own thread, whatever data the peer moves; after `heartbeat_misses` (default
//! 5) intervals of silence the peer is declared dead and every transfer to it — in
//! flight or posted later — and every notification fails with
//! [`crate::Error::RemoteDisconnect`]. Measured between two network namespaces with the
//! link cut mid-transfer: see `nixl/tests/netns_libfabric.rs`. A peer whose hub cannot be
//! reached when it is loaded is logged and left to the transport and the stall timeout.

use super::assist;
use super::liveness::ProcessId;
use super::notif_mac;
use super::{Error, Result, NAME};
use crate::backends::heartbeat::{HeartbeatConfig, Hub, HubAddr, PeerWatch};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

/// How long a transfer holds a provider's plain error (e.g. `sockets`' FI_EIO for a lost
/// connection) while the peer's watches confirm whether the peer died: then the error is
/// its death, [`crate::Error::RemoteDisconnect`]. A dead process's heartbeat connection
/// closes within milliseconds, so this only delays errors of live peers. Also the longest
/// a transfer with operations pending may still complete after the watches report the
/// peer gone (it may have left right after our last operation reached it): it waits for
/// its rails to read their queues a couple of times (`xfer::DeathSeen`), this long only
/// where a rail makes no progress.
pub(super) const DEATH_GRACE: Duration = Duration::from_millis(250);

/// What a peer's connection information says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PeerInfo {
    /// Each rail's endpoint name.
    pub(super) names: Vec<Vec<u8>>,
    /// The peer's process, where it could tell.
    pub(super) process: Option<ProcessId>,
    /// The peer's heartbeat hub, where it runs one.
    pub(super) hub: Option<HubAddr>,
    /// The peer pushes pieces of READs on request ([`super::assist`]).
    pub(super) assists: bool,
    /// The peer copies between its DRAM and this side's VRAM on request
    /// ([`super::peer_copy`]).
    pub(super) peer_copies: bool,
    /// The public key its notifications are sealed under ([`super::notif_mac`]); `None`
    /// from a peer built before sealing (refused at load).
    pub(super) notif_key: Option<[u8; 32]>,
}

/// This backend's connection information: `names` (each rail's endpoint name), this
/// process's identity, the hub's address, what it serves (READ assists, direct VRAM
/// copies: [`assist::SERVES_ASSISTS`], [`assist::SERVES_PEER_COPIES`]; 0: no section)
/// and the public key of its notification seals.
pub(super) fn encode_conn_info(
    names: &[Vec<u8>],
    hub: Option<&Hub>,
    serves: u8,
    notif_key: &[u8; 32],
) -> Vec<u8> {
    let mut out = vec![names.len() as u8];
    for name in names {
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
    }
    if let Some(me) = ProcessId::current() {
        me.encode(&mut out);
    }
    if let Some(hub) = hub {
        hub.addr().encode(&mut out);
    }
    if serves != 0 {
        assist::encode_conn_section(&mut out, serves);
    }
    notif_mac::encode_conn_section(&mut out, notif_key);
    out
}

/// Parses connection information (bounded against hostile input).
pub(super) fn parse_conn_info(bytes: &[u8]) -> Result<PeerInfo> {
    let (names, mut rest) = split_rail_list(bytes, "connection info")?;
    let bad = |why: String| Error::MalformedMetadata(format!("{NAME} connection info: {why}"));
    let later_section =
        |rest: &[u8]| rest.starts_with(assist::CONN_TAG) || rest.starts_with(notif_mac::CONN_TAG);
    let mut process = None;
    if !rest.is_empty() && !HubAddr::starts(rest) && !later_section(rest) {
        let n = rest.len().min(super::liveness::WIRE_SIZE);
        process = ProcessId::decode(&rest[..n])?;
        rest = &rest[n..];
    }
    let mut hub = None;
    if !rest.is_empty() && !later_section(rest) {
        let (addr, tail) = HubAddr::decode(rest)?;
        hub = Some(addr);
        rest = tail;
    }
    let mut serves = 0;
    if !rest.is_empty() && !rest.starts_with(notif_mac::CONN_TAG) {
        let n = rest.len().min(assist::CONN_WIRE_SIZE);
        serves = assist::decode_conn_section(&rest[..n]).map_err(bad)?;
        rest = &rest[n..];
    }
    let mut notif_key = None;
    if !rest.is_empty() {
        let n = rest.len().min(notif_mac::CONN_WIRE_SIZE);
        notif_key = Some(notif_mac::decode_conn_section(&rest[..n]).map_err(bad)?);
        rest = &rest[n..];
    }
    if !rest.is_empty() {
        return Err(Error::MalformedMetadata(format!(
            "{NAME} connection info: trailing bytes"
        )));
    }
    Ok(PeerInfo {
        names,
        process,
        hub,
        assists: serves & assist::SERVES_ASSISTS != 0,
        peer_copies: serves & assist::SERVES_PEER_COPIES != 0,
        notif_key,
    })
}

/// `count:u8 (len:u16le name)*` at the start of `bytes`, and what follows it.
fn split_rail_list<'a>(bytes: &'a [u8], what: &str) -> Result<(Vec<Vec<u8>>, &'a [u8])> {
    let bad = |why: &str| Error::MalformedMetadata(format!("{NAME} {what}: {why}"));
    let (&count, mut rest) = bytes.split_first().ok_or_else(|| bad("empty"))?;
    if count == 0 {
        return Err(bad("no rails"));
    }
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        if rest.len() < 2 {
            return Err(bad("truncated"));
        }
        let len = u16::from_le_bytes([rest[0], rest[1]]) as usize;
        rest = &rest[2..];
        if rest.len() < len {
            return Err(bad("truncated"));
        }
        out.push(rest[..len].to_vec());
        rest = &rest[len..];
    }
    Ok((out, rest))
}

/// Starts this backend's heartbeat hub (`None` with `heartbeat_ms=0`), on `node` where
/// it is an IP address, else on the agent's listen address, else on the default route's
/// source address, else on loopback.
pub(super) fn start_hub(
    config: HeartbeatConfig,
    agent: &str,
    node: Option<&str>,
    agent_addr: Option<IpAddr>,
) -> Result<Option<Hub>> {
    if config.interval.is_none() {
        return Ok(None);
    }
    let ip = node
        .and_then(|n| n.parse::<IpAddr>().ok())
        .filter(|ip| !ip.is_unspecified())
        .or(agent_addr.filter(|ip| !ip.is_unspecified()))
        .or_else(default_route_ip)
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    Ok(Some(Hub::start(NAME, agent, ip, config)?))
}

/// The address this host sends from toward other hosts (its default route's source),
/// asked of the kernel by connecting a UDP socket, which sends nothing.
fn default_route_ip() -> Option<IpAddr> {
    let socket = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
    // TEST-NET-1 (RFC 5737): routed like any remote address, never a real peer.
    socket.connect((Ipv4Addr::new(192, 0, 2, 1), 9)).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified() && !ip.is_loopback()).then_some(ip)
}

/// Watches `agent` through its hub where both sides run one (see [`Hub::watch_peer`]).
pub(super) fn watch_peer(
    hub: Option<&Hub>,
    agent: &str,
    peer: &PeerInfo,
) -> Option<Arc<PeerWatch>> {
    let same_host = peer.process.is_some_and(|p| p.on_this_host());
    let local = peer.process.and_then(|p| p.local_process());
    hub?.watch_peer(NAME, agent, peer.hub?, same_host, local)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    #[test]
    fn the_hub_listens_on_node_then_the_agent_then_the_default_route() {
        let config = HeartbeatConfig::default();
        let at = |node: Option<&str>, agent: Option<IpAddr>| {
            start_hub(config, "t", node, agent)
                .unwrap()
                .unwrap()
                .addr()
                .addr
                .ip()
        };
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(at(Some("127.0.0.1"), None), lo);
        assert_eq!(at(Some("not-an-ip"), Some(lo)), lo);
        assert_eq!(at(Some("0.0.0.0"), Some(lo)), lo);
        let fallback = at(None, None);
        assert_eq!(fallback, default_route_ip().unwrap_or(lo));
        println!("without node or listen address: {fallback}");
        let off = HeartbeatConfig {
            interval: None,
            ..config
        };
        assert!(start_hub(off, "t", None, None).unwrap().is_none());
    }

    /// Metadata of a peer whose backend is gone (its hub closed) or restarted (another
    /// incarnation's hub under the address) gives a watch that is dead from the start;
    /// a live hub gives a live one.
    #[test]
    fn a_peer_whose_hub_is_gone_or_newer_is_dead_on_arrival() {
        let config = HeartbeatConfig::default();
        let lo = Some("127.0.0.1");
        let mine = start_hub(config, "survivor", lo, None).unwrap().unwrap();
        let theirs = start_hub(config, "peer", lo, None).unwrap().unwrap();
        let peer = |hub: HubAddr| PeerInfo {
            names: vec![vec![9]],
            process: ProcessId::current(),
            hub: Some(hub),
            assists: false,
            peer_copies: false,
            notif_key: None,
        };
        let live = theirs.addr();
        let watch = watch_peer(Some(&mine), "peer", &peer(live)).expect("watched");
        assert!(!watch.is_dead());
        let stale = HubAddr {
            nonce: live.nonce ^ 1,
            ..live
        };
        let watch = watch_peer(Some(&mine), "peer", &peer(stale)).expect("a dead watch");
        let err = watch.check("peer").unwrap_err().to_string();
        assert!(err.contains("restarted"), "{err}");
        drop(theirs);
        let watch = watch_peer(Some(&mine), "peer", &peer(live)).expect("a dead watch");
        let err = watch.check("peer").unwrap_err().to_string();
        assert!(err.contains("refused"), "{err}");
    }

    #[test]
    fn connection_info_parsing_is_bounded() {
        assert!(parse_conn_info(&[]).is_err());
        assert!(parse_conn_info(&[0]).is_err());
        assert!(parse_conn_info(&[1, 5, 0, 1]).is_err());
        // What follows the rail list is the process identity, then the hub, or nothing.
        let bare = PeerInfo {
            names: vec![vec![9]],
            process: None,
            hub: None,
            assists: false,
            peer_copies: false,
            notif_key: None,
        };
        assert_eq!(parse_conn_info(&[1, 1, 0, 9]).unwrap(), bare);
        assert!(parse_conn_info(&[1, 1, 0, 9, 9]).is_err());
        let me = ProcessId::current().unwrap();
        let hub = HubAddr {
            nonce: 7,
            addr: SocketAddr::from(([10, 0, 0, 1], 4000)),
        };
        let mut info = vec![1, 1, 0, 9];
        me.encode(&mut info);
        let with_process = PeerInfo {
            process: Some(me),
            ..bare.clone()
        };
        assert_eq!(parse_conn_info(&info).unwrap(), with_process);
        hub.encode(&mut info);
        let with_hub = PeerInfo {
            hub: Some(hub),
            ..with_process.clone()
        };
        assert_eq!(parse_conn_info(&info).unwrap(), with_hub);
        let hub_end = info.len();
        super::assist::encode_conn_section(&mut info, super::assist::SERVES_ASSISTS);
        let full = PeerInfo {
            assists: true,
            ..with_hub
        };
        assert_eq!(parse_conn_info(&info).unwrap(), full);
        let assist_end = info.len();
        notif_mac::encode_conn_section(&mut info, &[7; 32]);
        let full = PeerInfo {
            notif_key: Some([7; 32]),
            ..full
        };
        assert_eq!(parse_conn_info(&info).unwrap(), full);
        // Every cut is malformed but those between the sections.
        let between = [4 + super::super::liveness::WIRE_SIZE, hub_end, assist_end];
        for cut in (5..info.len()).filter(|c| !between.contains(c)) {
            assert!(parse_conn_info(&info[..cut]).is_err(), "cut at {cut}");
        }
        info.push(0);
        assert!(parse_conn_info(&info).is_err(), "trailing bytes");
        // The assist section right after the identity (no hub), and alone.
        let mut info = vec![1, 1, 0, 9];
        me.encode(&mut info);
        super::assist::encode_conn_section(&mut info, super::assist::SERVES_PEER_COPIES);
        assert_eq!(
            parse_conn_info(&info).unwrap(),
            PeerInfo {
                peer_copies: true,
                ..with_process.clone()
            }
        );
        let mut info = vec![1, 1, 0, 9];
        super::assist::encode_conn_section(&mut info, super::assist::SERVES_ASSISTS);
        let parsed = parse_conn_info(&info).unwrap();
        assert!(parsed.assists && !parsed.peer_copies);
        // The key section right after the rail list, after the hub, and in a newer
        // version (a typed error).
        let mut info = vec![1, 1, 0, 9];
        notif_mac::encode_conn_section(&mut info, &[3; 32]);
        assert_eq!(parse_conn_info(&info).unwrap().notif_key, Some([3; 32]));
        let mut info = vec![1, 1, 0, 9];
        hub.encode(&mut info);
        notif_mac::encode_conn_section(&mut info, &[4; 32]);
        let parsed = parse_conn_info(&info).unwrap();
        assert_eq!((parsed.hub, parsed.notif_key), (Some(hub), Some([4; 32])));
        let at = info.len() - 33;
        info[at] = 9;
        assert!(matches!(
            parse_conn_info(&info),
            Err(Error::MalformedMetadata(why)) if why.contains("version 9")
        ));
        // A hub without a process identity (a peer where /proc does not answer).
        let mut info = vec![1, 1, 0, 9];
        hub.encode(&mut info);
        assert_eq!(
            parse_conn_info(&info).unwrap(),
            PeerInfo {
                hub: Some(hub),
                ..bare
            }
        );
    }
}
