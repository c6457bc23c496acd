//! The side channel: the handshake that connects a pair of RC QPs per rail (initiator
//! and target side), and the thread that accepts handshakes and watches every peer's
//! socket for EOF (a dead peer process).

use super::wire::{
    decode_hello, decode_reply, encode_hello, encode_reply, encode_reply_error, read_frame,
    write_frame, ConnInfo, Hello, ReplyError,
};
use super::{
    create_qp, verbs_error, Common, Incoming, Outgoing, VerbsBackend, HANDSHAKE_TIMEOUT,
    MAX_OUTSTANDING, MONITOR_PERIOD, NAME,
};
use crate::error::{Error, Result};
use ibverbs::Endpoint;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

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
        let (remote_id, answers) = decode_reply(&reply).map_err(|e| match e {
            ReplyError::Refused(why) => disconnect(format!("refused: {why}")),
            ReplyError::Malformed(why) => Error::MalformedMetadata(why),
        })?;
        if answers.len() != prepared.len() {
            return Err(Error::MalformedMetadata(format!(
                "{NAME} handshake: {} QPs answered for {} rails",
                answers.len(),
                prepared.len()
            )));
        }
        let mut qps = Vec::with_capacity(prepared.len());
        let mut remote_dev = Vec::with_capacity(prepared.len());
        for (r, (qp, (qpn, psn))) in prepared.into_iter().zip(answers).enumerate() {
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
            remote_id,
            staging_told: AtomicBool::new(false),
        }))
    }
}

pub(super) fn side_channel_thread(listener: TcpListener, common: Arc<Common>) {
    while !common.stop.load(Ordering::Relaxed) {
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    if let Err(e) = serve_handshake(&common, stream) {
                        tracing::warn!(%from, error = %e, "VERBS handshake failed");
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
            .expect("outgoing lock")
            .values()
            .filter(|c| !c.staging_told.load(Ordering::Acquire))
            .cloned()
            .collect();
        for conn in outgoing {
            if !conn.is_dead() && peer_gone(&conn.stream) {
                conn.kill("the peer's process is gone (its side channel closed)");
            }
            // However it died (here, or a failed work request): staged requests waiting
            // for the peer fail, and the slots it could have written come back.
            if let Some(reason) = conn.dead_reason() {
                common.stager.peer_gone(&conn, &reason);
            }
        }
        let gone: Vec<u64> = common
            .incoming
            .read()
            .expect("incoming lock")
            .values()
            .filter(|c| peer_gone(&c.stream))
            .map(|c| c.id)
            .collect();
        for id in gone {
            common.remove_incoming(id);
        }
        wait_readable(&listener, &common);
    }
}

/// Blocks until the listener or a watched side-channel socket is readable (a new
/// handshake, or a peer's EOF), or `MONITOR_PERIOD` passed.
fn wait_readable(listener: &TcpListener, common: &Common) {
    let mut fds = vec![libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    let watch = |stream: &TcpStream| libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    fds.extend(
        common
            .outgoing
            .read()
            .expect("outgoing lock")
            .values()
            .filter(|c| !c.is_dead())
            .map(|c| watch(&c.stream)),
    );
    fds.extend(
        common
            .incoming
            .read()
            .expect("incoming lock")
            .values()
            .map(|c| watch(&c.stream)),
    );
    // SAFETY: `fds` is a live array of pollfds; the sockets stay open during the call
    // (a connection closed meanwhile only makes its slot report an error or nothing).
    unsafe {
        libc::poll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            MONITOR_PERIOD.as_millis() as i32,
        )
    };
}

/// Whether a (non-blocking) side-channel socket was closed by the other end.
fn peer_gone(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match stream.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => {
            // Peers send nothing after the handshake: discard it (or it would keep the
            // socket readable forever).
            let mut sink = [0u8; 256];
            let _ = (&*stream).read(&mut sink);
            false
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => false,
        Err(_) => true,
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
        let mut by_qpn = common.incoming_qpn.write().expect("qpn lock");
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
    });
    common
        .incoming
        .write()
        .expect("incoming lock")
        .insert(id, conn);
    if let Err(e) = write_frame(&mut stream, &encode_reply(id, &answers)) {
        common.remove_incoming(id);
        return Err(e.into());
    }
    stream.set_nonblocking(true)?;
    tracing::debug!(
        peer = %peer,
        incarnation = hello.nonce,
        rails = answers.len(),
        "VERBS incoming connection"
    );
    Ok(())
}
