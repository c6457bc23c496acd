//! The side channel: the handshake that connects a pair of RC QPs per rail (initiator
//! and target side), and the thread that accepts handshakes, watches every peer's
//! socket for EOF (a dead peer process) and for heartbeats (a vanished host), and sends
//! heartbeats to the peers that connected to this agent. The thread moves no data and
//! never waits for a peer (each handshake it accepts is served on a thread of its own)
//! nor for a rail (a closed incoming connection is retired by the rails' rounds:
//! `Common::close_incoming`), so a busy agent still beats in time.

use super::wire::{
    decode_hello, decode_reply, encode_hello, encode_reply, encode_reply_error, read_frame,
    write_frame, ConnInfo, Hello, ReplyError,
};
use super::{
    create_qp, verbs_error, Common, Incoming, Outgoing, VerbsBackend, HANDSHAKE_TIMEOUT,
    MAX_OUTSTANDING, MONITOR_PERIOD, NAME,
};
use crate::backends::heartbeat::{drain, poll_timeout, send_beat, Beat, Heard, Pacer};
use crate::error::{Error, Result};
use crate::os::pollfd_in;
use ibverbs::Endpoint;
use parking_lot::Mutex;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How soon the side-channel thread tries again to tell the staging engine of a dead
/// connection when the engine was busy.
const STAGING_RETRY: Duration = Duration::from_millis(10);

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
        let reply = read_frame(&mut stream)
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
        }))
    }
}

pub(super) fn side_channel_thread(listener: TcpListener, common: Arc<Common>) {
    while !common.stop.load(Ordering::Relaxed) {
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    // The handshake waits for the peer: never on this thread, whose
                    // heartbeats must go out on time.
                    let common = common.clone();
                    let spawned = std::thread::Builder::new()
                        .name("nixl-verbs-hello".into())
                        .spawn(move || {
                            if let Err(e) = serve_handshake(&common, stream) {
                                tracing::warn!(%from, error = %e, "VERBS handshake failed");
                            }
                        });
                    if let Err(e) = spawned {
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
                let mut beat = conn.beat.lock();
                match heard {
                    Heard::Closed => {
                        drop(beat);
                        conn.kill("the peer's process is gone (its side channel closed)");
                    }
                    Heard::Beat => beat.heard(now),
                    Heard::Nothing => {
                        if let Some(why) = beat.verdict(now) {
                            drop(beat);
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
    for c in common.outgoing.read().values() {
        if !c.is_dead() {
            fds.push(pollfd_in(c.stream.as_raw_fd()));
            times.extend(c.beat.lock().deadline());
        }
    }
    for c in common.incoming.read().values() {
        if let Some(pacer) = c.pacer.lock().as_ref() {
            fds.push(pollfd_in(c.stream.as_raw_fd()));
            times.extend(pacer.next());
        }
    }
    let cap = if retry { STAGING_RETRY } else { MONITOR_PERIOD };
    let timeout = poll_timeout(Instant::now(), times.into_iter(), cap);
    // SAFETY: `fds` is a live array of pollfds; the sockets stay open during the call
    // (a connection closed meanwhile only makes its slot report an error or nothing).
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
    if ready > 0 && fds[0].revents != 0 {
        common.monitor_wake.drain();
    }
}

/// The target side of the handshake: QPs for each of the initiator's rails.
fn serve_handshake(common: &Arc<Common>, mut stream: TcpStream) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let frame = read_frame(&mut stream)?;
    let hello = decode_hello(&frame)?;
    if hello.target_nonce != common.nonce {
        write_frame(
            &mut stream,
            &encode_reply_error("stale metadata: this agent has restarted since"),
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
