//! The initiating side of a control connection (module `peer_dram`): frames out, answers
//! in, and the shared lane the peer hands over on a same-host connection.

use super::*;

/// The initiating side of a control connection toward one peer (module `peer_dram`):
/// requests and notifications go out as control frames, the peer's answers come back
/// on the same connection and are read as the initiator polls.
#[derive(Debug)]
pub(in crate::backends::gpunetio) struct ControlConn {
    peer: String,
    pub(super) stream: Stream,
    /// A TCP connection's addresses, as recorded in `own` (a Unix one records none: the
    /// peer asks the kernel who connected).
    ends: Option<(SocketAddr, SocketAddr)>,
    own: Arc<OwnConns>,
    /// Answers as they arrive (cut into frames); taken under this lock by whoever polls.
    incoming: Mutex<FrameBuf>,
    /// Frames go out whole and in order.
    outgoing: Mutex<Vec<u8>>,
    gone: AtomicBool,
    /// The shared lane the peer handed over (same host): requests go there while it
    /// has room, answers come back there.
    pub(super) lane: OnceLock<Arc<Mailbox>>,
    /// A descriptor that came with the lane's frame, until that frame is read.
    lane_fd: Mutex<Option<OwnedFd>>,
    /// An answer copied out of the lane.
    lane_answer: Mutex<Vec<u8>>,
}

impl ControlConn {
    /// Connects as `me` to `peer`'s notification address `addr`, recording the
    /// connection in `own` (what the peer asks this agent's listener about).
    pub(in crate::backends::gpunetio) fn connect(
        me: &str,
        peer: &str,
        addr: SocketAddr,
        own: Arc<OwnConns>,
    ) -> Result<Self> {
        let unreachable = |e: std::io::Error| Error::RemoteDisconnect {
            agent: peer.to_string(),
            reason: format!("opening a control connection to {addr}: {e}"),
        };
        let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(unreachable)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(CONNECT_TIMEOUT))?;
        let ends = (stream.local_addr()?, stream.peer_addr()?);
        // Recorded before the hello: the peer may ask as soon as it reads it.
        own.insert(ends);
        if let Err(e) = stream.write_all(&frame(&First::Control(me.to_string()).encode())) {
            own.remove(&ends);
            return Err(unreachable(e));
        }
        Ok(Self::over(peer, Stream::Tcp(stream), Some(ends), own))
    }

    /// Connects as `me` to `peer`'s Unix socket `name` (same host), held by the process
    /// `who` — checked (`SO_PEERCRED`) before anything is sent, so a process that took
    /// the name never sees a request. Only for a peer whose pids mean the same here.
    pub(in crate::backends::gpunetio) fn connect_local(
        me: &str,
        peer: &str,
        name: &[u8],
        who: &LocalIdentity,
        own: Arc<OwnConns>,
    ) -> Result<Self> {
        let unreachable = |e: std::io::Error| Error::RemoteDisconnect {
            agent: peer.to_string(),
            reason: format!("opening a same-host control connection: {e}"),
        };
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name).map_err(unreachable)?;
        let stream = UnixStream::connect_addr(&addr).map_err(unreachable)?;
        if !who.is_at_other_end_of(stream.as_raw_fd()) {
            return Err(Error::Unreachable {
                backend: "GPUNETIO".into(),
                agent: peer.to_string(),
                reason: "its same-host control socket is held by another process".into(),
            });
        }
        let stream = Stream::Unix(stream);
        stream.set_write_timeout(Some(CONNECT_TIMEOUT))?;
        let mut first = frame(&First::Control(me.to_string()).encode());
        // The peer answers with a shared lane for requests and answers, once it has
        // confirmed this connection (read as this side polls).
        first.extend_from_slice(&frame(&[CONTROL_LANE]));
        (&stream).write_all(&first).map_err(unreachable)?;
        Ok(Self::over(peer, stream, None, own))
    }

    fn over(
        peer: &str,
        stream: Stream,
        ends: Option<(SocketAddr, SocketAddr)>,
        own: Arc<OwnConns>,
    ) -> Self {
        Self {
            peer: peer.to_string(),
            stream,
            ends,
            own,
            incoming: Mutex::new(FrameBuf::default()),
            outgoing: Mutex::new(Vec::new()),
            gone: AtomicBool::new(false),
            lane: OnceLock::new(),
            lane_fd: Mutex::new(None),
            lane_answer: Mutex::new(Vec::new()),
        }
    }

    /// Sends a direct-copy request: through the shared lane where there is one with room
    /// (ringing the connection where the peer said it sleeps), else as a control frame.
    /// Returns whether it went through the lane.
    pub(in crate::backends::gpunetio) fn send_request(&self, body: &[u8]) -> Result<bool> {
        if let Some(lane) = self.lane.get() {
            if lane.push_request(body) {
                if lane.target_asleep() {
                    self.send(CONTROL_DOORBELL, &[])?;
                }
                return Ok(true);
            }
        }
        self.send(CONTROL_PEER_COPY, body).map(|()| false)
    }

    /// Takes the lane whose descriptor came with a `CONTROL_LANE` frame.
    fn take_lane(&self) {
        let Some(fd) = self.lane_fd.lock().take() else {
            tracing::debug!(peer = %self.peer, "GPUNETIO: a lane frame without a descriptor");
            return;
        };
        match Mailbox::take(fd) {
            Ok(lane) => {
                let _ = self.lane.set(Arc::new(lane));
            }
            Err(e) => {
                tracing::warn!(peer = %self.peer, "GPUNETIO: its shared lane is refused: {e}")
            }
        }
    }

    /// Reads from the socket without waiting (`WouldBlock`: nothing there); a descriptor
    /// that came along is kept for the lane's frame (one at most: any other is closed).
    fn recv_some(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        let Stream::Unix(s) = &self.stream else {
            // SAFETY: a valid socket fd and a buffer of `buf.len()` bytes; MSG_DONTWAIT
            // never blocks.
            let n = unsafe {
                libc::recv(
                    self.stream.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            return usize::try_from(n).map_err(|_| std::io::Error::last_os_error());
        };
        match gpu_mem::try_recv_fds(s, buf) {
            Ok(Some((n, fds))) => {
                for fd in fds {
                    let mut kept = self.lane_fd.lock();
                    if kept.is_none() && self.lane.get().is_none() {
                        *kept = Some(fd);
                    }
                }
                Ok(n)
            }
            Ok(None) => Err(std::io::ErrorKind::WouldBlock.into()),
            Err(gpu_mem::Error::Io(e)) => Err(e),
            Err(e) => Err(std::io::Error::other(e.to_string())),
        }
    }

    fn disconnected(&self, reason: String) -> Error {
        self.gone.store(true, Ordering::Release);
        Error::RemoteDisconnect {
            agent: self.peer.clone(),
            reason,
        }
    }

    /// Whether the connection failed or the peer closed it (a new one is needed).
    pub(in crate::backends::gpunetio) fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    /// Sends `body` as one control frame of `kind`.
    pub(in crate::backends::gpunetio) fn send(&self, kind: u8, body: &[u8]) -> Result<()> {
        if body.len() >= MAX_FRAME {
            return Err(Error::InvalidParam(format!(
                "a {}-byte control frame (GPUNETIO carries at most {MAX_FRAME})",
                body.len()
            )));
        }
        if self.gone.load(Ordering::Acquire) {
            return Err(self.disconnected("its control connection closed".into()));
        }
        // One buffer reused: a request costs no allocation once it has grown.
        let mut out = self.outgoing.lock();
        out.clear();
        out.extend_from_slice(&(body.len() as u32 + 1).to_le_bytes());
        out.push(kind);
        out.extend_from_slice(body);
        (&self.stream)
            .write_all(&out)
            .map_err(|e| self.disconnected(format!("sending on its control connection: {e}")))
    }

    /// Reads what has arrived (never waits) and hands each whole frame's kind and body
    /// to `on_frame`; fails once the peer closed the connection.
    pub(in crate::backends::gpunetio) fn poll(
        &self,
        mut on_frame: impl FnMut(u8, &[u8]),
    ) -> Result<()> {
        if self.gone.load(Ordering::Acquire) {
            return Err(self.disconnected("its control connection closed".into()));
        }
        if let Some(lane) = self.lane.get() {
            let mut answer = self.lane_answer.lock();
            loop {
                match lane.pop_answer(&mut answer) {
                    Ok(true) => {
                        trace::mark_received();
                        on_frame(CONTROL_PEER_COPY, &answer);
                    }
                    Ok(false) => break,
                    // Broken by the peer: its answers come on the connection from now.
                    Err(_) => break,
                }
            }
        }
        let mut frames = self.incoming.lock();
        let mut buf = [0u8; 4096];
        loop {
            match self.recv_some(&mut buf) {
                Ok(0) => {
                    return Err(self.disconnected("the peer closed its control connection".into()))
                }
                Ok(n) => {
                    trace::mark_received();
                    frames.push(&buf[..n]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.disconnected(format!("its control connection: {e}"))),
            }
        }
        loop {
            match frames.next(MAX_FRAME) {
                Ok(Some(f)) => match control_frame(&f) {
                    Some((CONTROL_LANE, _)) if self.lane.get().is_none() => self.take_lane(),
                    Some((kind, body)) => on_frame(kind, body),
                    None => {}
                },
                Ok(None) => return Ok(()),
                Err(why) => return Err(self.disconnected(why)),
            }
        }
    }
}

impl Drop for ControlConn {
    fn drop(&mut self) {
        if let Some(ends) = &self.ends {
            self.own.remove(ends);
        }
    }
}
