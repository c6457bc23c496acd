//! Wire formats: the connection information in metadata, the side-channel handshake
//! (HELLO and its reply, length-prefixed frames) and notification messages. Every
//! decoder is bounds-checked against hostile input.

use super::super::liveness::ProcessId;
use super::super::shared::put_socket_addr;
use super::{MAX_NOTIF_BYTES, MAX_RAILS, NAME, NOTIF_HEADER};
use crate::error::{Error, Result};
use ibverbs::{Endpoint, Gid, Mtu};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// 2: the handshake's reply carries the target's id of the connection; 3: and the
/// target's heartbeat interval.
const WIRE_VERSION: u8 = 3;
const NOTIF_MAGIC: &[u8; 4] = b"NXVN";
const MAX_FRAME: usize = 64 << 10;

/// One rail as the connection information describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RailInfo {
    pub(super) dev: u8,
    pub(super) gid: Gid,
    pub(super) lid: u16,
    pub(super) mtu: Mtu,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ConnInfo {
    pub(super) nonce: u64,
    pub(super) addr: SocketAddr,
    pub(super) rails: Vec<RailInfo>,
    /// Who the agent's process is, where `/proc` told it: a peer on the same host
    /// watches it through the OS (`liveness`), as LIBFABRIC does.
    pub(super) process: Option<ProcessId>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hello {
    pub(super) target_nonce: u64,
    pub(super) nonce: u64,
    pub(super) name: String,
    pub(super) endpoints: Vec<Endpoint>,
}

#[derive(Debug)]
pub(super) enum ReplyError {
    Refused(String),
    Malformed(String),
}

const CONN_MAGIC: &[u8; 4] = b"NXVC";
const HELLO_MAGIC: &[u8; 4] = b"NXVH";
const REPLY_MAGIC: &[u8; 4] = b"NXVR";
const VERIFY_MAGIC: &[u8; 4] = b"NXVV";

/// A bounds-checked reader over a received byte string.
struct Rd<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Rd<'a> {
    fn new(b: &'a [u8], what: &'static str) -> Self {
        Rd { b, what }
    }
    fn bad(&self, why: &str) -> Error {
        Error::MalformedMetadata(format!("{NAME} {}: {why}", self.what))
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(self.bad("truncated"));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn gid(&mut self) -> Result<Gid> {
        Ok(Gid {
            raw: self.take(16)?.try_into().expect("16"),
        })
    }
    fn magic(&mut self, magic: &[u8; 4]) -> Result<()> {
        if self.take(4)? != magic || self.u8()? != WIRE_VERSION {
            return Err(self.bad("wrong magic or version"));
        }
        Ok(())
    }
    fn end(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(self.bad("trailing bytes"))
        }
    }
}

fn get_addr(rd: &mut Rd<'_>) -> Result<SocketAddr> {
    let ip = match rd.u8()? {
        4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(rd.take(4)?).expect("4"))),
        6 => IpAddr::V6(Ipv6Addr::from(
            <[u8; 16]>::try_from(rd.take(16)?).expect("16"),
        )),
        _ => return Err(rd.bad("bad address family")),
    };
    Ok(SocketAddr::new(ip, rd.u16()?))
}

/// `NXVC ver nonce:u64 addr nrails:u8 {dev:u8 gid:16 lid:u16 mtu:u8}* [identity]`, the
/// identity being `liveness`'s block (absent where the process could not say who it is).
pub(super) fn encode_conn_info(
    nonce: u64,
    addr: SocketAddr,
    rails: &[RailInfo],
    process: Option<&ProcessId>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + rails.len() * 20);
    out.extend_from_slice(CONN_MAGIC);
    out.push(WIRE_VERSION);
    out.extend_from_slice(&nonce.to_le_bytes());
    put_socket_addr(&mut out, addr);
    out.push(rails.len() as u8);
    for r in rails {
        out.push(r.dev);
        out.extend_from_slice(&r.gid.raw);
        out.extend_from_slice(&r.lid.to_le_bytes());
        out.push(r.mtu.0 as u8);
    }
    if let Some(process) = process {
        process.encode(&mut out);
    }
    out
}

pub(super) fn decode_conn_info(b: &[u8]) -> Result<ConnInfo> {
    let mut rd = Rd::new(b, "connection info");
    rd.magic(CONN_MAGIC)?;
    let nonce = rd.u64()?;
    let addr = get_addr(&mut rd)?;
    let n = rd.u8()? as usize;
    if n == 0 || n > MAX_RAILS {
        return Err(rd.bad("rail count out of range"));
    }
    let mut rails = Vec::with_capacity(n);
    for _ in 0..n {
        let dev = rd.u8()?;
        if dev as usize >= MAX_RAILS {
            return Err(rd.bad("device index out of range"));
        }
        rails.push(RailInfo {
            dev,
            gid: rd.gid()?,
            lid: rd.u16()?,
            mtu: Mtu(u32::from(rd.u8()?)),
        });
    }
    let process = ProcessId::decode(rd.b)?;
    Ok(ConnInfo {
        nonce,
        addr,
        rails,
        process,
    })
}

/// `NXVH ver target_nonce:u64 nonce:u64 name:str16 n:u8 {qpn:u32 psn:u32 gid:16 lid:u16 mtu:u8}*`
pub(super) fn encode_hello(h: &Hello) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + h.name.len() + h.endpoints.len() * 27);
    out.extend_from_slice(HELLO_MAGIC);
    out.push(WIRE_VERSION);
    out.extend_from_slice(&h.target_nonce.to_le_bytes());
    out.extend_from_slice(&h.nonce.to_le_bytes());
    out.extend_from_slice(&(h.name.len() as u16).to_le_bytes());
    out.extend_from_slice(h.name.as_bytes());
    out.push(h.endpoints.len() as u8);
    for e in &h.endpoints {
        out.extend_from_slice(&e.qp_num.to_le_bytes());
        out.extend_from_slice(&e.psn.to_le_bytes());
        out.extend_from_slice(&e.gid.raw);
        out.extend_from_slice(&e.lid.to_le_bytes());
        out.push(e.mtu.0 as u8);
    }
    out
}

pub(super) fn decode_hello(b: &[u8]) -> Result<Hello> {
    let mut rd = Rd::new(b, "handshake");
    rd.magic(HELLO_MAGIC)?;
    let target_nonce = rd.u64()?;
    let nonce = rd.u64()?;
    let name_len = rd.u16()? as usize;
    if name_len == 0 {
        return Err(rd.bad("empty agent name"));
    }
    let name = String::from_utf8(rd.take(name_len)?.to_vec())
        .map_err(|_| rd.bad("agent name is not UTF-8"))?;
    let n = rd.u8()? as usize;
    if n == 0 || n > MAX_RAILS {
        return Err(rd.bad("rail count out of range"));
    }
    let mut endpoints = Vec::with_capacity(n);
    for _ in 0..n {
        endpoints.push(Endpoint {
            qp_num: rd.u32()?,
            psn: rd.u32()?,
            gid: rd.gid()?,
            lid: rd.u16()?,
            mtu: Mtu(u32::from(rd.u8()?)),
        });
    }
    rd.end()?;
    Ok(Hello {
        target_nonce,
        nonce,
        name,
        endpoints,
    })
}

/// `NXVR ver 0 conn:u64 heartbeat_ms:u32 n:u8 {qpn:u32 psn:u32}*` or
/// `NXVR ver 1 why:str16`; `conn` is the target's id of the connection, `heartbeat_ms`
/// how often it sends heartbeats on the side channel (0: never).
pub(super) fn encode_reply(conn: u64, heartbeat_ms: u32, answers: &[(u32, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + answers.len() * 8);
    out.extend_from_slice(REPLY_MAGIC);
    out.push(WIRE_VERSION);
    out.push(0);
    out.extend_from_slice(&conn.to_le_bytes());
    out.extend_from_slice(&heartbeat_ms.to_le_bytes());
    out.push(answers.len() as u8);
    for (qpn, psn) in answers {
        out.extend_from_slice(&qpn.to_le_bytes());
        out.extend_from_slice(&psn.to_le_bytes());
    }
    out
}

pub(super) fn encode_reply_error(why: &str) -> Vec<u8> {
    let why = &why.as_bytes()[..why.len().min(4096)];
    let mut out = Vec::with_capacity(8 + why.len());
    out.extend_from_slice(REPLY_MAGIC);
    out.push(WIRE_VERSION);
    out.push(1);
    out.extend_from_slice(&(why.len() as u16).to_le_bytes());
    out.extend_from_slice(why);
    out
}

/// The target's handshake answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Reply {
    /// The target's id of the connection (below 2^31: a staged notification key
    /// carries it above a 32-bit sequence, bit 63 clear).
    pub(super) conn: u64,
    /// The target's heartbeat interval (0: it sends none).
    pub(super) heartbeat_ms: u32,
    /// Each QP's number and PSN.
    pub(super) answers: Vec<(u32, u32)>,
}

pub(super) fn decode_reply(b: &[u8]) -> std::result::Result<Reply, ReplyError> {
    let malformed = |e: Error| ReplyError::Malformed(e.to_string());
    let mut rd = Rd::new(b, "handshake reply");
    rd.magic(REPLY_MAGIC).map_err(malformed)?;
    match rd.u8().map_err(malformed)? {
        0 => {
            let conn = rd.u64().map_err(malformed)?;
            if conn >= 1 << 31 {
                return Err(malformed(rd.bad("connection id out of range")));
            }
            let heartbeat_ms = rd.u32().map_err(malformed)?;
            let n = rd.u8().map_err(malformed)? as usize;
            let mut answers = Vec::with_capacity(n);
            for _ in 0..n {
                answers.push((rd.u32().map_err(malformed)?, rd.u32().map_err(malformed)?));
            }
            rd.end().map_err(malformed)?;
            Ok(Reply {
                conn,
                heartbeat_ms,
                answers,
            })
        }
        1 => {
            let len = rd.u16().map_err(malformed)? as usize;
            let why = String::from_utf8_lossy(rd.take(len).map_err(malformed)?).into_owned();
            Err(ReplyError::Refused(why))
        }
        _ => Err(malformed(rd.bad("unknown status"))),
    }
}

/// `NXVV ver sender_addr receiver_addr`: a target asks the agent a HELLO named whether
/// the side-channel connection from `sender` to `receiver` is one it opened.
pub(super) fn encode_verify(sender: SocketAddr, receiver: SocketAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(48);
    out.extend_from_slice(VERIFY_MAGIC);
    out.push(WIRE_VERSION);
    put_socket_addr(&mut out, sender);
    put_socket_addr(&mut out, receiver);
    out
}

/// The two addresses of a verification request, or `None` when `b` is none.
pub(super) fn decode_verify(b: &[u8]) -> Option<(SocketAddr, SocketAddr)> {
    let mut rd = Rd::new(b, "verification request");
    rd.magic(VERIFY_MAGIC).ok()?;
    let sender = get_addr(&mut rd).ok()?;
    let receiver = get_addr(&mut rd).ok()?;
    rd.end().ok()?;
    Some((sender, receiver))
}

pub(super) fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    s.write_all(&frame)
}

/// Reads one frame, whole within `within` (a deadline for the frame, not for each read:
/// a peer trickling bytes cannot hold the reader longer). The body grows with the bytes
/// that arrive, never from the length a peer announces.
pub(super) fn read_frame(s: &mut TcpStream, within: Duration) -> std::io::Result<Vec<u8>> {
    let deadline = Instant::now() + within;
    let mut len = [0u8; 4];
    read_until(s, &mut len, deadline)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("side-channel frame of {len} bytes"),
        ));
    }
    let mut body = Vec::new();
    let mut chunk = [0u8; 4096];
    while body.len() < len {
        let n = (len - body.len()).min(chunk.len());
        read_until(s, &mut chunk[..n], deadline)?;
        body.extend_from_slice(&chunk[..n]);
    }
    Ok(body)
}

/// Fills `buf` from `s` before `deadline`.
fn read_until(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "side-channel frame not whole in time",
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // The read timeout ran out (Linux reports it as EAGAIN): the loop's deadline
            // check answers with the typed timeout.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `NXVN seq:u32 expected:u32 msg`
pub(super) fn encode_notif(seq: u32, expected: u32, msg: &[u8]) -> Result<Vec<u8>> {
    if msg.len() > MAX_NOTIF_BYTES {
        return Err(Error::InvalidParam(format!(
            "notification of {} bytes is too large for {NAME} (at most {MAX_NOTIF_BYTES})",
            msg.len()
        )));
    }
    let mut out = Vec::with_capacity(NOTIF_HEADER + msg.len());
    out.extend_from_slice(NOTIF_MAGIC);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&expected.to_le_bytes());
    out.extend_from_slice(msg);
    Ok(out)
}

pub(super) fn decode_notif(b: &[u8]) -> Result<(u32, u32, &[u8])> {
    if b.len() < NOTIF_HEADER || &b[..4] != NOTIF_MAGIC {
        return Err(Error::MalformedMetadata("malformed notification".into()));
    }
    let seq = u32::from_le_bytes(b[4..8].try_into().expect("4"));
    let expected = u32::from_le_bytes(b[8..12].try_into().expect("4"));
    Ok((seq, expected, &b[NOTIF_HEADER..]))
}
