//! The side channel: the handshake that connects a pair of RC QPs per rail (initiator
//! and target side), and the thread that accepts handshakes, watches every peer's
//! socket for EOF (a dead peer process) and for heartbeats (a vanished host), and sends
//! heartbeats to the peers that connected to this agent. The thread moves no data and
//! never waits for a peer (each handshake it accepts is served on a thread of its own)
//! nor for a rail (a closed incoming connection is retired by the rails' rounds:
//! `Common::close_incoming`), so a busy agent still beats in time.
//!
//! # Who a HELLO is from
//! The name a HELLO gives is the initiator's word, and what the target delivers its
//! notifications under (they are attributed to the connection whose QP they arrive on,
//! never to a name in them). Where the name is that of a peer this agent loaded (and
//! whose connection is alive) or this agent's own, the target asks that agent, at the
//! side-channel address its metadata advertised, whether the connection is one it opened
//! (`NXVV`: the connection's two addresses, answered from its record of its own
//! side-channel connections, [`OwnStreams`]); a HELLO it does not own is refused and
//! counted ([`VerbsBackend::refused_hellos`]). A name this agent never loaded stays the
//! initiator's word, as NIXL's targets need not load their initiators' metadata.
//!
//! # Bounds
//! At most [`MAX_HANDSHAKES`] handshakes are served at once (a connection beyond is
//! closed at accept), each frame must be whole within `HANDSHAKE_TIMEOUT` (a deadline
//! per frame, not per read) and grows with the bytes that arrive, and at most
//! [`MAX_INCOMING`] incoming connections are held.

use super::wire::{
    decode_conn_info, decode_hello, decode_reply, decode_verify, encode_hello, encode_reply,
    encode_reply_error, encode_verify, read_frame, write_frame, ConnInfo, Hello, ReplyError,
};
use super::{
    create_qp, verbs_error, Common, Incoming, Outgoing, VerbsBackend, HANDSHAKE_TIMEOUT,
    MAX_OUTSTANDING, MONITOR_PERIOD, NAME,
};
use crate::backends::heartbeat::{
    drain, poll_timeout, send_beat, Beat, Heard, Pacer, LOCAL_SILENCE_FACTOR,
};
use crate::backends::liveness::{Liveness, ProcessId};
use crate::error::{Error, Result};
use crate::os::pollfd_in;
use ibverbs::Endpoint;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How soon the side-channel thread tries again to tell the staging engine of a dead
/// connection when the engine was busy.
const STAGING_RETRY: Duration = Duration::from_millis(10);
/// Handshakes (and verification requests) served at once, each on a thread of its own;
/// a connection beyond is closed as it is accepted.
pub(super) const MAX_HANDSHAKES: usize = 64;
/// The name of a thread serving a handshake.
pub(super) const HELLO_THREAD: &str = "nixl-verbs-hello";
/// Incoming connections held at once (each holds a QP per rail); a HELLO beyond is
/// refused.
pub(super) const MAX_INCOMING: usize = 1024;
/// Bound on asking the agent a HELLO named whether the connection is its own.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the thread wakes to ask the OS about peers on this host (`liveness`: a kill
/// in progress, read from `/proc` at most every 5 ms per peer, a few microseconds each),
/// whatever else it waits for: a transfer's own poll may be held for tens of
/// milliseconds inside a post (soft-RoCE moves a work request's data in the posting
/// call), and a same-host peer's kill must still be told within the 100 ms goal.
const PROCESS_WATCH_PERIOD: Duration = Duration::from_millis(20);

/// The side-channel connections this agent opened, by (local, remote) address.
#[derive(Debug, Default)]
pub(super) struct OwnStreams(Mutex<HashSet<(SocketAddr, SocketAddr)>>);

impl OwnStreams {
    pub(super) fn contains(&self, ends: &(SocketAddr, SocketAddr)) -> bool {
        self.0.lock().contains(ends)
    }
}

/// A side-channel connection's entry in [`OwnStreams`], removed when dropped.
#[derive(Debug)]
pub(super) struct OwnStream {
    set: Arc<OwnStreams>,
    ends: (SocketAddr, SocketAddr),
}

impl OwnStream {
    /// Records `stream` (before its HELLO goes: the target may ask at once).
    pub(super) fn record(set: &Arc<OwnStreams>, stream: &TcpStream) -> std::io::Result<Self> {
        let ends = (stream.local_addr()?, stream.peer_addr()?);
        set.0.lock().insert(ends);
        Ok(Self {
            set: set.clone(),
            ends,
        })
    }
}

impl Drop for OwnStream {
    fn drop(&mut self) {
        self.set.0.lock().remove(&self.ends);
    }
}

/// Whom a HELLO's name asks the target to check with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claim {
    /// No agent this one knows: the initiator's word.
    Word,
    /// This agent: its own record answers.
    Own,
    /// A loaded peer, whose side channel listens there.
    Ask(SocketAddr),
}

/// What the name of a HELLO claims, seen from `common`.
fn claim_of(common: &Common, name: &str) -> Claim {
    if name == common.agent_name {
        return Claim::Own;
    }
    let outgoing = common.outgoing.read();
    // A peer whose connection died may have restarted: its old address answers no one.
    match outgoing.get(name).filter(|c| !c.is_dead()) {
        Some(c) => decode_conn_info(&c.conn_info).map_or(Claim::Word, |i| Claim::Ask(i.addr)),
        None => Claim::Word,
    }
}

/// Whether the connection `ends` (the initiator's address, this side's) is owned by
/// whom its HELLO's name `claim`s: `own` is this agent's record, `ask` asks a peer.
pub(super) fn hello_owned(
    claim: Claim,
    ends: (SocketAddr, SocketAddr),
    own: &OwnStreams,
    ask: impl FnOnce(SocketAddr, (SocketAddr, SocketAddr)) -> bool,
) -> bool {
    match claim {
        Claim::Word => true,
        Claim::Own => own.contains(&ends),
        Claim::Ask(at) => ask(at, ends),
    }
}

/// Asks the side channel at `at` whether the connection `ends` (its address, ours) is
/// one it opened; no answer in time is a no. A side channel that refuses the connection
/// is a process that ended (the loaded incarnation is gone, as its own liveness check
/// will say): the name is then the initiator's word again, as for a name never loaded.
pub(super) fn ask_owner(at: SocketAddr, ends: (SocketAddr, SocketAddr)) -> bool {
    let attempt = || -> std::io::Result<bool> {
        let mut s = match TcpStream::connect_timeout(&at, VERIFY_TIMEOUT) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                tracing::debug!(%at, "VERBS: a HELLO names a loaded peer that has ended");
                return Ok(true);
            }
            Err(e) => return Err(e),
        };
        s.set_write_timeout(Some(VERIFY_TIMEOUT))?;
        write_frame(&mut s, &encode_verify(ends.0, ends.1))?;
        Ok(read_frame(&mut s, VERIFY_TIMEOUT)? == [1])
    };
    attempt().unwrap_or_else(|e| {
        tracing::debug!(%at, error = %e, "VERBS: asking a HELLO's named agent failed");
        false
    })
}

/// The answer to a verification request `frame`, if it is one: whether the connection
/// it names is in `own`.
pub(super) fn answer_verify(own: &OwnStreams, frame: &[u8]) -> Option<Vec<u8>> {
    decode_verify(frame).map(|ends| vec![u8::from(own.contains(&ends))])
}

impl VerbsBackend {
    /// Opens connection `peer` (one QP per local rail) through the peer's side channel.
    pub(super) fn connect(
        &self,
        peer: &str,
        info: &[u8],
        remote: &ConnInfo,
    ) -> Result<Arc<Outgoing>> {
        let common = &self.common;
        let disconnect = |reason: String| Error::RemoteDisconnect {
            agent: peer.to_string(),
            reason,
        };
        let mut stream = TcpStream::connect_timeout(&remote.addr, HANDSHAKE_TIMEOUT)
            .map_err(|e| disconnect(format!("side channel {}: {e}", remote.addr)))?;
        // Recorded before the HELLO: the peer asks about it if it loaded this agent.
        let side = OwnStream::record(&common.own_streams, &stream)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let mut prepared = Vec::with_capacity(common.rails.len());
        let mut mine = Vec::with_capacity(common.rails.len());
        for rail in &common.rails {
            let dev = &common.devices[rail.dev];
            let qp = create_qp(dev, rail, MAX_OUTSTANDING as u32)?;
            let ep = qp
                .endpoint(&dev.opts)
                .map_err(|e| verbs_error("QP endpoint", e))?;
            mine.push(ep);
            prepared.push(qp);
        }
        let hello = encode_hello(&Hello {
            target_nonce: remote.nonce,
            nonce: common.nonce,
            name: common.agent_name.clone(),
            endpoints: mine,
        });
        write_frame(&mut stream, &hello)
            .map_err(|e| disconnect(format!("side channel {}: {e}", remote.addr)))?;
        let reply = read_frame(&mut stream, HANDSHAKE_TIMEOUT)
            .map_err(|e| disconnect(format!("side channel {}: {e}", remote.addr)))?;
        let reply = decode_reply(&reply).map_err(|e| match e {
            ReplyError::Refused(why) => disconnect(format!("refused: {why}")),
            ReplyError::Malformed(why) => Error::MalformedMetadata(why),
        })?;
        if reply.answers.len() != prepared.len() {
            return Err(Error::MalformedMetadata(format!(
                "{NAME} handshake: {} QPs answered for {} rails",
                reply.answers.len(),
                prepared.len()
            )));
        }
        let mut qps = Vec::with_capacity(prepared.len());
        let mut remote_dev = Vec::with_capacity(prepared.len());
        for (r, (qp, (qpn, psn))) in prepared.into_iter().zip(reply.answers).enumerate() {
            let peer_rail = &remote.rails[r % remote.rails.len()];
            let dev = &common.devices[common.rails[r].dev];
            let endpoint = Endpoint {
                qp_num: qpn,
                psn,
                gid: peer_rail.gid,
                lid: peer_rail.lid,
                mtu: peer_rail.mtu,
            };
            qps.push(
                qp.connect(&endpoint, &dev.opts)
                    .map_err(|e| verbs_error("connecting a QP", e))?,
            );
            remote_dev.push(peer_rail.dev as usize);
        }
        stream.set_nonblocking(true)?;
        Ok(Arc::new(Outgoing {
            peer: peer.to_string(),
            conn_info: info.to_vec(),
            qps,
            remote_dev,
            dead: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            stream,
            // Heard last now: the handshake just came from the peer.
            beat: Mutex::new(Beat::new(
                Instant::now(),
                reply.heartbeat_ms,
                &common.heartbeat,
            )),
            remote_id: reply.conn,
            staging_told: AtomicBool::new(false),
            _side: side,
            process: remote.process.as_ref().and_then(Liveness::watch),
            local_process: remote.process.as_ref().and_then(ProcessId::local_process),
        }))
    }
}

pub(super) fn side_channel_thread(listener: TcpListener, common: Arc<Common>) {
    while !common.stop.load(Ordering::Relaxed) {
        accept_handshakes(
            &listener,
            &common,
            handshakes_of,
            HANDSHAKE_TIMEOUT,
            serve_handshake,
        );
        let outgoing: Vec<Arc<Outgoing>> = common
            .outgoing
            .read()
            .values()
            .filter(|c| !c.staging_told.load(Ordering::Acquire))
            .cloned()
            .collect();
        // Every socket is read before anything is judged: heartbeats that came while
        // this thread was not scheduled count.
        let heard: Vec<Heard> = outgoing
            .iter()
            .map(|c| {
                if c.is_dead() {
                    Heard::Nothing
                } else {
                    drain(&c.stream)
                }
            })
            .collect();
        let now = Instant::now();
        // A dead connection the staging engine could not be told of yet (busy).
        let mut untold = false;
        for (conn, heard) in outgoing.iter().zip(heard) {
            if !conn.is_dead() {
                match heard {
                    Heard::Closed => {
                        conn.kill("the peer's process is gone (its side channel closed)");
                    }
                    // A same-host peer being killed is told here too, while no transfer
                    // to it polls (its teardown closes the socket only later); `kill`
                    // is done by the check.
                    _ if conn.process_gone() => {}
                    Heard::Beat => conn.beat.lock().heard(now),
                    // A peer process on this host that still runs (its death is seen
                    // through the OS) but whose beats a loaded machine did not schedule
                    // is not declared dead before `LOCAL_SILENCE_FACTOR` times the bound,
                    // as LIBFABRIC's hub judges it.
                    Heard::Nothing => {
                        let verdict = {
                            let beat = conn.beat.lock();
                            beat.verdict(now).filter(|_| {
                                conn.local_process.is_none_or(|p| {
                                    !p.runs() || beat.verdict_scaled(now, LOCAL_SILENCE_FACTOR)
                                })
                            })
                        };
                        if let Some(why) = verdict {
                            conn.kill(&why);
                        }
                    }
                }
            }
            // However it died (here, or a failed work request): staged requests waiting
            // for the peer fail, and the slots it could have written come back. Not
            // waiting for the engine, which a rail worker may hold long: a later pass
            // tells it.
            if let Some(reason) = conn.dead_reason() {
                untold |= !common.stager.try_peer_gone(conn, &reason);
            }
        }
        let incoming: Vec<Arc<Incoming>> = common.incoming.read().values().cloned().collect();
        for conn in incoming {
            let mut pacer = conn.pacer.lock();
            // `None`: the handshake is still answering on this socket.
            let Some(pacer) = pacer.as_mut() else {
                continue;
            };
            // Initiators send nothing after the handshake but their EOF.
            let gone = drain(&conn.stream) == Heard::Closed
                || (pacer.due(now) && !send_beat(&conn.stream));
            if gone {
                common.close_incoming(conn.id);
            }
        }
        wait_readable(&listener, &common, untold);
    }
}

/// The count of handshakes `common` is serving.
fn handshakes_of(common: &Common) -> &AtomicUsize {
    &common.handshakes
}

/// Accepts every connection waiting on `listener` (non-blocking) and serves each on a
/// thread of its own ([`HELLO_THREAD`]): its first frame must be whole within
/// `deadline` of the accept, then `serve` answers it. At most [`MAX_HANDSHAKES`] are
/// served at once (`count(state)`); a connection beyond is closed as it is accepted, so a
/// flood of connections that send nothing costs descriptors only while the kernel queues
/// them, never a thread each.
pub(super) fn accept_handshakes<S: Send + Sync + 'static>(
    listener: &TcpListener,
    state: &Arc<S>,
    count: fn(&S) -> &AtomicUsize,
    deadline: Duration,
    serve: fn(&Arc<S>, TcpStream, Vec<u8>) -> Result<()>,
) {
    loop {
        match listener.accept() {
            Ok((stream, from)) => {
                if count(state).fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                    count(state).fetch_sub(1, Ordering::AcqRel);
                    tracing::debug!(%from, "VERBS: a handshake over the cap closed");
                    continue;
                }
                // The handshake waits for the peer: never on the calling thread, whose
                // heartbeats must go out on time.
                let served = state.clone();
                let spawned =
                    std::thread::Builder::new()
                        .name(HELLO_THREAD.into())
                        .spawn(move || {
                            let mut stream = stream;
                            let result = first_frame(&mut stream, deadline)
                                .and_then(|frame| serve(&served, stream, frame));
                            if let Err(e) = result {
                                tracing::warn!(%from, error = %e, "VERBS handshake failed");
                            }
                            count(&served).fetch_sub(1, Ordering::AcqRel);
                        });
                if let Err(e) = spawned {
                    count(state).fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!(error = %e, "VERBS: no thread for a handshake");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => {
                tracing::warn!(error = %e, "VERBS side channel accept failed");
                break;
            }
        }
    }
}

/// The first frame of an accepted side-channel connection, whole within `deadline`
/// (however slowly its bytes trickle); the socket is left blocking, with `deadline` as
/// its write timeout.
fn first_frame(stream: &mut TcpStream, deadline: Duration) -> Result<Vec<u8>> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(deadline))?;
    Ok(read_frame(stream, deadline)?)
}

/// Blocks until the listener or a watched side-channel socket is readable (a new
/// handshake, a heartbeat or a peer's EOF), the wake eventfd is (a new connection, the
/// stop), a heartbeat is due or a peer's is overdue, or `MONITOR_PERIOD` passed
/// (`STAGING_RETRY` when `retry`: a dead connection is still to be told to the staging
/// engine).
fn wait_readable(listener: &TcpListener, common: &Common, retry: bool) {
    let mut fds = vec![
        pollfd_in(common.monitor_wake.as_raw_fd()),
        pollfd_in(listener.as_raw_fd()),
    ];
    let mut times = Vec::new();
    let mut same_host = false;
    for c in common.outgoing.read().values() {
        if !c.is_dead() {
            fds.push(pollfd_in(c.stream.as_raw_fd()));
            times.extend(c.beat.lock().deadline());
            same_host |= c.process.is_some();
        }
    }
    for c in common.incoming.read().values() {
        if let Some(pacer) = c.pacer.lock().as_ref() {
            fds.push(pollfd_in(c.stream.as_raw_fd()));
            times.extend(pacer.next());
        }
    }
    let cap = match (retry, same_host) {
        (true, _) => STAGING_RETRY,
        (false, true) => PROCESS_WATCH_PERIOD,
        (false, false) => MONITOR_PERIOD,
    };
    let timeout = poll_timeout(Instant::now(), times.into_iter(), cap);
    // SAFETY: `fds` is a live array of pollfds; the sockets stay open during the call
    // (a connection closed meanwhile only makes its slot report an error or nothing).
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
    if ready > 0 && fds[0].revents != 0 {
        common.monitor_wake.drain();
    }
}

/// The target side of the handshake: QPs for each of the initiator's rails.
/// `frame` is the connection's first, read by [`accept_handshakes`].
fn serve_handshake(common: &Arc<Common>, mut stream: TcpStream, frame: Vec<u8>) -> Result<()> {
    // A target asking whether a connection that named this agent is its own.
    if let Some(answer) = answer_verify(&common.own_streams, &frame) {
        write_frame(&mut stream, &answer)?;
        return Ok(());
    }
    let hello = decode_hello(&frame)?;
    if hello.target_nonce != common.nonce {
        write_frame(
            &mut stream,
            &encode_reply_error("stale metadata: this agent has restarted since"),
        )?;
        return Ok(());
    }
    let ends = (stream.peer_addr()?, stream.local_addr()?);
    let claim = claim_of(common, &hello.name);
    if !hello_owned(claim, ends, &common.own_streams, ask_owner) {
        let n = common.refused_hellos.fetch_add(1, Ordering::Relaxed);
        if n.is_multiple_of(1024) {
            tracing::warn!(
                from = %ends.0,
                refused = n + 1,
                "VERBS: a HELLO naming `{}` refused: that agent does not own the connection",
                hello.name
            );
        }
        write_frame(
            &mut stream,
            &encode_reply_error(&format!(
                "refused: `{}` does not own this connection",
                hello.name
            )),
        )?;
        return Ok(());
    }
    if common.incoming.read().len() >= MAX_INCOMING {
        write_frame(
            &mut stream,
            &encode_reply_error(&format!(
                "refused: {MAX_INCOMING} incoming connections held already"
            )),
        )?;
        return Ok(());
    }
    let mut qps = Vec::with_capacity(hello.endpoints.len());
    let mut answers = Vec::with_capacity(hello.endpoints.len());
    let result = (|| -> Result<()> {
        for (i, endpoint) in hello.endpoints.iter().enumerate() {
            let rail = &common.rails[i % common.rails.len()];
            let dev = &common.devices[rail.dev];
            // Incoming QPs carry no rail jobs: staging operations only (serving the
            // requester's staged chunks).
            let qp = create_qp(dev, rail, 0)?;
            let ep = qp
                .endpoint(&dev.opts)
                .map_err(|e| verbs_error("QP endpoint", e))?;
            let qp = qp
                .connect(endpoint, &dev.opts)
                .map_err(|e| verbs_error("connecting a QP", e))?;
            answers.push((ep.qp_num, ep.psn));
            qps.push((rail.index, qp));
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = write_frame(&mut stream, &encode_reply_error(&e.to_string()));
        return Err(e);
    }
    let id = common.next_incoming.fetch_add(1, Ordering::Relaxed);
    let peer: Arc<str> = Arc::from(hello.name.as_str());
    {
        // Registered before the answer, so the first immediate finds its connection.
        let mut by_qpn = common.incoming_qpn.write();
        for (rail, qp) in &qps {
            by_qpn.insert((*rail, qp.qp_num()), (id, peer.clone()));
        }
    }
    let conn = Arc::new(Incoming {
        id,
        nonce: hello.nonce,
        peer: peer.clone(),
        qps,
        stream: stream.try_clone()?,
        pacer: Mutex::new(None),
    });
    common.incoming.write().insert(id, conn.clone());
    let reply = encode_reply(id, common.heartbeat.wire_ms(), &answers);
    if let Err(e) = write_frame(&mut stream, &reply).and_then(|()| stream.set_nonblocking(true)) {
        common.close_incoming(id);
        return Err(e.into());
    }
    // Only now may the side-channel thread read and write the socket (non-blocking,
    // nothing of ours left to send on it).
    *conn.pacer.lock() = Some(Pacer::new(Instant::now(), &common.heartbeat));
    // The side-channel thread beats it from now on.
    common.wake_monitor();
    tracing::debug!(
        peer = %peer,
        incarnation = hello.nonce,
        rails = answers.len(),
        "VERBS incoming connection"
    );
    Ok(())
}

/// What a flooding client sees (shared with the guest test).
#[cfg(test)]
#[path = "../../../tests/common/slow_clients.rs"]
mod slow_clients;

#[cfg(test)]
mod tests {
    use super::slow_clients::{closed_after, threads_named};
    use super::*;
    use std::io::Write;
    use std::time::Instant;

    fn loopback() -> TcpListener {
        TcpListener::bind("127.0.0.1:0").unwrap()
    }

    /// An agent's side channel as far as verification goes: answers every request on
    /// `listener` from `own` (one thread per request, as the side channel's).
    fn answer_from(listener: TcpListener, own: Arc<OwnStreams>) {
        std::thread::spawn(move || {
            for mut s in listener.incoming().flatten() {
                let own = own.clone();
                std::thread::spawn(move || {
                    if let Ok(frame) = read_frame(&mut s, Duration::from_secs(5)) {
                        if let Some(answer) = answer_verify(&own, &frame) {
                            let _ = write_frame(&mut s, &answer);
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn a_named_agent_is_asked_and_only_its_own_connections_pass() {
        // The initiator's side: one side-channel connection it opened, recorded.
        let initiator = loopback();
        let at = initiator.local_addr().unwrap();
        let own = Arc::new(OwnStreams::default());
        let target = loopback();
        let real = TcpStream::connect(target.local_addr().unwrap()).unwrap();
        let record = OwnStream::record(&own, &real).unwrap();
        answer_from(initiator, own.clone());
        let (accepted, _) = target.accept().unwrap();
        // As the target sees them: the initiator's address, its own.
        let ends = (
            accepted.peer_addr().unwrap(),
            accepted.local_addr().unwrap(),
        );
        assert!(ask_owner(at, ends));
        // Another process's connection naming the initiator.
        let forged = TcpStream::connect(target.local_addr().unwrap()).unwrap();
        let (accepted, _) = target.accept().unwrap();
        let forged_ends = (
            accepted.peer_addr().unwrap(),
            accepted.local_addr().unwrap(),
        );
        assert_eq!(forged_ends.0, forged.local_addr().unwrap());
        assert!(!ask_owner(at, forged_ends));
        // Once the initiator's connection is gone, its record is too.
        drop(record);
        assert!(!ask_owner(at, ends));
        // This agent's own name: its own record answers, no one is asked.
        let no_asking = |_: SocketAddr, _: (SocketAddr, SocketAddr)| -> bool {
            panic!("asked a peer about this agent's own name")
        };
        let _again = OwnStream::record(&own, &real).unwrap();
        assert!(hello_owned(Claim::Own, ends, &own, no_asking));
        assert!(!hello_owned(Claim::Own, forged_ends, &own, no_asking));
        // A name no agent here knows: the initiator's word.
        assert!(hello_owned(Claim::Word, forged_ends, &own, no_asking));
        assert!(!hello_owned(Claim::Ask(at), forged_ends, &own, ask_owner));
    }

    #[test]
    fn a_silent_named_agent_is_a_no_and_an_ended_one_is_gone() {
        let ends = (
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        );
        // Accepts (the kernel's backlog) but never answers.
        let silent = loopback();
        let started = Instant::now();
        assert!(!ask_owner(silent.local_addr().unwrap(), ends));
        assert!(started.elapsed() < VERIFY_TIMEOUT * 3);
        // Nothing listens any more: the loaded incarnation ended.
        let ended = loopback().local_addr().unwrap();
        assert!(ask_owner(ended, ends));
    }

    #[test]
    fn a_frame_must_be_whole_by_its_deadline_however_it_trickles() {
        let listener = loopback();
        let addr = listener.local_addr().unwrap();
        let writer = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&100u32.to_le_bytes()).unwrap();
            // A byte every 50 ms: each read is quick, the frame never whole.
            for _ in 0..40 {
                if s.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let (mut s, _) = listener.accept().unwrap();
        let started = Instant::now();
        let e = read_frame(&mut s, Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(started.elapsed() < Duration::from_millis(900));
        drop(s);
        writer.join().unwrap();
        // Announcing more than a frame may hold is refused before any body is read.
        let listener = loopback();
        let mut w = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        w.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
        let e = read_frame(&mut s, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }

    /// A server of handshakes as the side channel's accept loop serves them, without a
    /// device: its first frame must be a HELLO, answered by echoing it.
    struct HelloServer {
        handshakes: AtomicUsize,
    }

    fn hello_server_count(s: &HelloServer) -> &AtomicUsize {
        &s.handshakes
    }

    fn echo_hello(_: &Arc<HelloServer>, mut stream: TcpStream, frame: Vec<u8>) -> Result<()> {
        decode_hello(&frame)?;
        write_frame(&mut stream, &frame)?;
        Ok(())
    }

    /// Threads of this process serving a handshake.
    fn hello_threads() -> usize {
        threads_named(HELLO_THREAD)
    }

    fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
        let started = Instant::now();
        while !done() {
            assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Issue 28, finding 6 ("the VERBS side channel starts a thread per connection without
    /// a cap or idle timeout"), on the side channel's own accept loop (no device needed):
    /// raw connections that send junk, nothing, or a byte at a time. Junk is closed at
    /// once; at most `MAX_HANDSHAKES` handshake threads ever run (counted in
    /// `/proc/self/task` and by the counter); a connection over the cap is closed as it
    /// is accepted; silent and trickling ones are closed by the first frame's deadline;
    /// afterwards a real HELLO is still answered. (`rxe_verbs_side_channel` runs the same
    /// attack against a VERBS backend on soft-RoCE, with a real transfer afterwards.)
    #[test]
    fn handshakes_are_capped_and_silent_connections_closed_by_their_deadline() {
        // Long enough for 64 connections to be accepted on a loaded two-core machine
        // before the first of them expires.
        const DEADLINE: Duration = Duration::from_secs(3);
        let listener = loopback();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Arc::new(HelloServer {
            handshakes: AtomicUsize::new(0),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let accepting = {
            let (server, stop) = (server.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    accept_handshakes(&listener, &server, hello_server_count, DEADLINE, echo_hello);
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        };
        let serving = || server.handshakes.load(Ordering::Acquire);
        // Junk: a length no frame may have, and a whole frame that is no HELLO. Each is
        // closed long before the deadline.
        for junk in [
            (u32::MAX).to_le_bytes().to_vec(),
            [8u32.to_le_bytes().to_vec(), b"notahelo".to_vec()].concat(),
        ] {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&junk).unwrap();
            let after = closed_after(s, false, DEADLINE).expect("junk left open");
            assert!(after < DEADLINE / 2, "junk closed only after {after:?}");
        }
        wait_for("junk's threads ended", DEADLINE, || serving() == 0);
        // Every slot taken: half by connections that send nothing, half by ones that
        // announce a frame and send a byte of it every 100 ms.
        let mut holders = Vec::new();
        for i in 0..MAX_HANDSHAKES {
            let mut s = TcpStream::connect(addr).unwrap();
            let trickle = i % 2 == 1;
            if trickle {
                s.write_all(&100u32.to_le_bytes()).unwrap();
            }
            let opened = Instant::now();
            holders.push(std::thread::spawn(move || {
                let closed = closed_after(s, trickle, DEADLINE * 4);
                (opened, closed)
            }));
        }
        // The counter goes up before the thread starts (and names itself).
        wait_for("every slot held", DEADLINE / 2, || {
            serving() == MAX_HANDSHAKES && hello_threads() == MAX_HANDSHAKES
        });
        // Over the cap: closed at once, no thread started.
        for _ in 0..16 {
            let s = TcpStream::connect(addr).unwrap();
            let after =
                closed_after(s, false, DEADLINE).expect("a connection over the cap stayed open");
            assert!(after < DEADLINE / 4, "closed only after {after:?}");
            assert_eq!(serving(), MAX_HANDSHAKES);
            assert_eq!(hello_threads(), MAX_HANDSHAKES);
        }
        // The deadline closes every holder, trickling or silent.
        for holder in holders {
            let (opened, closed) = holder.join().unwrap();
            let closed = closed.expect("a connection that never sent a whole frame stayed open");
            assert!(
                closed < DEADLINE + Duration::from_secs(1),
                "closed {closed:?} after it opened, {:?} ago",
                opened.elapsed()
            );
        }
        wait_for("every handshake thread ended", DEADLINE, || {
            serving() == 0 && hello_threads() == 0
        });
        // A real HELLO is still served.
        let hello = encode_hello(&Hello {
            target_nonce: 1,
            nonce: 2,
            name: "initiator".into(),
            endpoints: vec![Endpoint {
                qp_num: 17,
                psn: 5,
                gid: ibverbs::Gid { raw: [0; 16] },
                lid: 0,
                mtu: ibverbs::Mtu::MTU_1024,
            }],
        });
        let mut s = TcpStream::connect(addr).unwrap();
        write_frame(&mut s, &hello).unwrap();
        assert_eq!(read_frame(&mut s, DEADLINE).unwrap(), hello);
        stop.store(true, Ordering::Relaxed);
        accepting.join().unwrap();
    }
}
