//! Connection management over IP with librdmacm (feature `rdmacm`): listen, connect and
//! accept by IP address and port, yielding connected queue pairs of this crate.
//!
//! The QPs are the caller's own ([`PreparedQueuePair`], created on a
//! [`Context`](crate::Context) of the device the address resolves to): the helper moves
//! them through INIT → RTR → RTS with the attributes the connection manager computes
//! (`rdma_init_qp_attr`), exactly as librdmacm does for the QPs it creates itself, and
//! hands them back as a [`Connection`] that dereferences to [`QueuePair`].
//!
//! Every wait is bounded ([`CmOptions::timeout`]); what goes wrong is typed:
//! [`Error::Unreachable`] (no RDMA device for the address, no answer to address/route
//! resolution or to the connection request), [`Error::ConnectionRefused`] (nobody
//! listens on that port), [`Error::Rejected`] (the peer said no, with its private
//! data), [`Error::Timeout`].
//!
//! ```no_run
//! use ibverbs::cm::{CmOptions, Listener, Route};
//! use ibverbs::QpType;
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), ibverbs::Error> {
//! // Passive side.
//! let listener = Listener::bind("192.0.2.1:7471".parse().unwrap())?;
//! let request = listener.get_request(Duration::from_secs(10))?;
//! let ctx = ibverbs::Context::open(&request.device_name())?;
//! let (pd, cq) = (ctx.alloc_pd()?, ctx.create_cq(64, None, 0)?);
//! let qp = pd.create_qp(QpType::RC, &cq, &cq).build()?;
//! let opts = CmOptions { private_data: b"welcome".to_vec(), ..Default::default() };
//! let conn = request.accept(qp, &opts)?;
//! println!("client said {:?}", conn.private_data());
//! # Ok(())
//! # }
//! # fn client() -> Result<(), ibverbs::Error> {
//! // Active side.
//! let route = Route::resolve("192.0.2.1:7471".parse().unwrap(), &CmOptions::default())?;
//! let ctx = ibverbs::Context::open(&route.device_name())?;
//! let (pd, cq) = (ctx.alloc_pd()?, ctx.create_cq(64, None, 0)?);
//! let mut qp = pd.create_qp(QpType::RC, &cq, &cq).build()?;
//! route.init_qp(&mut qp)?; // optional: INIT now, to post receives before connecting
//! let conn = route.connect(qp, &CmOptions::default())?;
//! # Ok(())
//! # }
//! ```
//!
//! Private data travels in the connection messages, zero-padded to their fixed size by
//! the transport: on InfiniBand and RoCE at most 56 bytes with a connect request, 196
//! with an accept and 148 with a reject.

use crate::error::{cvt, last_errno, Error, Result};
use crate::ffi;
use crate::mr::AccessFlags;
use crate::newtype::c_newtype;
use crate::qp::{PreparedQueuePair, QpAttr, QpAttrMask, QueuePair};
use crate::status::QpState;
use std::ffi::CStr;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

c_newtype! {
    /// Connection manager event type (`enum rdma_cm_event_type`).
    #[doc(alias = "rdma_cm_event_type")]
    CmEventType(u32) {
        /// `RDMA_CM_EVENT_ADDR_RESOLVED`
        ADDR_RESOLVED = ffi::RDMA_CM_EVENT_ADDR_RESOLVED,
        /// `RDMA_CM_EVENT_ADDR_ERROR`
        ADDR_ERROR = ffi::RDMA_CM_EVENT_ADDR_ERROR,
        /// `RDMA_CM_EVENT_ROUTE_RESOLVED`
        ROUTE_RESOLVED = ffi::RDMA_CM_EVENT_ROUTE_RESOLVED,
        /// `RDMA_CM_EVENT_ROUTE_ERROR`
        ROUTE_ERROR = ffi::RDMA_CM_EVENT_ROUTE_ERROR,
        /// `RDMA_CM_EVENT_CONNECT_REQUEST`
        CONNECT_REQUEST = ffi::RDMA_CM_EVENT_CONNECT_REQUEST,
        /// `RDMA_CM_EVENT_CONNECT_RESPONSE`
        CONNECT_RESPONSE = ffi::RDMA_CM_EVENT_CONNECT_RESPONSE,
        /// `RDMA_CM_EVENT_CONNECT_ERROR`
        CONNECT_ERROR = ffi::RDMA_CM_EVENT_CONNECT_ERROR,
        /// `RDMA_CM_EVENT_UNREACHABLE`
        UNREACHABLE = ffi::RDMA_CM_EVENT_UNREACHABLE,
        /// `RDMA_CM_EVENT_REJECTED`
        REJECTED = ffi::RDMA_CM_EVENT_REJECTED,
        /// `RDMA_CM_EVENT_ESTABLISHED`
        ESTABLISHED = ffi::RDMA_CM_EVENT_ESTABLISHED,
        /// `RDMA_CM_EVENT_DISCONNECTED`
        DISCONNECTED = ffi::RDMA_CM_EVENT_DISCONNECTED,
        /// `RDMA_CM_EVENT_DEVICE_REMOVAL`
        DEVICE_REMOVAL = ffi::RDMA_CM_EVENT_DEVICE_REMOVAL,
        /// `RDMA_CM_EVENT_MULTICAST_JOIN`
        MULTICAST_JOIN = ffi::RDMA_CM_EVENT_MULTICAST_JOIN,
        /// `RDMA_CM_EVENT_MULTICAST_ERROR`
        MULTICAST_ERROR = ffi::RDMA_CM_EVENT_MULTICAST_ERROR,
        /// `RDMA_CM_EVENT_ADDR_CHANGE`
        ADDR_CHANGE = ffi::RDMA_CM_EVENT_ADDR_CHANGE,
        /// `RDMA_CM_EVENT_TIMEWAIT_EXIT`
        TIMEWAIT_EXIT = ffi::RDMA_CM_EVENT_TIMEWAIT_EXIT,
    }
}

/// The InfiniBand CM reject reason "invalid service ID": nobody listens on that port.
const REJ_INVALID_SERVICE_ID: i32 = 8;
/// Private data limits of InfiniBand/RoCE connection messages (after rdma_cm's own
/// header in the request).
const REQ_PRIVATE_DATA: usize = 56;
const REP_PRIVATE_DATA: usize = 196;
const REJ_PRIVATE_DATA: usize = 148;
/// `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH`: "as many as the device allows".
const DEVICE_MAX: u8 = 255;

/// Options of a connection: the `struct rdma_conn_param` fields (named after them),
/// the QP's access rights, and the bound on every wait.
#[derive(Debug, Clone)]
#[doc(alias = "rdma_conn_param")]
pub struct CmOptions {
    /// Bound on each blocking step: address and route resolution plus the connection
    /// handshake for [`Route::resolve`] + [`Route::connect`], the handshake for
    /// [`ConnectRequest::accept`]. Default 10 s.
    pub timeout: Duration,
    /// Sent to the peer with the request (connect), reply (accept): see the
    /// [module docs](self) for the limits.
    pub private_data: Vec<u8>,
    /// `responder_resources`: RDMA READs/atomics the peer may have outstanding towards
    /// us. Default 255 (`RDMA_MAX_RESP_RES`): as many as both devices allow.
    pub responder_resources: u8,
    /// `initiator_depth`: RDMA READs/atomics we may have outstanding. Default 255
    /// (`RDMA_MAX_INIT_DEPTH`).
    pub initiator_depth: u8,
    /// `retry_count` (transport retries; default 7).
    pub retry_count: u8,
    /// `rnr_retry_count` (7 = retry forever when the peer has no receive posted).
    pub rnr_retry_count: u8,
    /// `flow_control` (announced to the peer; default 1).
    pub flow_control: u8,
    /// `qp_access_flags` set when the QP enters INIT (default: local write, remote
    /// read, write and atomic).
    pub access: AccessFlags,
    /// Source address for [`Route::resolve`] (default: chosen by the routing table).
    pub src_addr: Option<SocketAddr>,
}

impl Default for CmOptions {
    fn default() -> Self {
        CmOptions {
            timeout: Duration::from_secs(10),
            private_data: Vec::new(),
            responder_resources: DEVICE_MAX,
            initiator_depth: DEVICE_MAX,
            retry_count: 7,
            rnr_retry_count: 7,
            flow_control: 1,
            access: AccessFlags::all_remote(),
            src_addr: None,
        }
    }
}

impl CmOptions {
    fn conn_param(&self, qp_num: u32, srq: bool) -> ffi::rdma_conn_param {
        ffi::rdma_conn_param {
            private_data: if self.private_data.is_empty() {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            // Checked against the transport's limit (at most 196) by the callers.
            private_data_len: self.private_data.len() as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: self.flow_control,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: srq as u8,
            qp_num,
        }
    }
}

/// What an event said, copied out before it is acknowledged.
struct Event {
    kind: CmEventType,
    status: i32,
    private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
    /// For `CONNECT_REQUEST`: the new id (on the listener's channel).
    new_id: Option<NonNull<ffi::rdma_cm_id>>,
}

struct IdInner {
    id: NonNull<ffi::rdma_cm_id>,
    channel: NonNull<ffi::rdma_event_channel>,
}

// SAFETY: librdmacm is thread-safe: each id has its own mutex and the calls on it may be
// made from any thread; the event channel is a file descriptor. Waiting for events
// takes `&self` but only one kind of wait is ever in progress per typestate object,
// which `&mut`/by-value methods ensure.
unsafe impl Send for IdInner {}
// SAFETY: as above; shared access only reads addresses and the device pointer.
unsafe impl Sync for IdInner {}

impl Drop for IdInner {
    fn drop(&mut self) {
        // Destroying a connected id sends a disconnect request to the peer. Every event
        // of this id has been acknowledged as soon as it was read, so this never waits.
        // SAFETY: created by this wrapper (or handed over through `from_raw`), destroyed
        // once, before its channel.
        let ret = unsafe { ffi::rdma_destroy_id(self.id.as_ptr()) };
        if let Err(err) = cvt(ret, "rdma_destroy_id") {
            tracing::error!(%err, "destroying an rdma_cm id failed");
        }
        // SAFETY: the channel's only id is gone.
        unsafe { ffi::rdma_destroy_event_channel(self.channel.as_ptr()) };
    }
}

/// An rdma_cm identifier (`struct rdma_cm_id`) with its own event channel
/// (`struct rdma_event_channel`), the escape hatch under [`Listener`],
/// [`ConnectRequest`], [`Route`] and [`Connection`].
#[doc(alias = "rdma_cm_id")]
#[doc(alias = "rdma_event_channel")]
pub struct CmId {
    inner: IdInner,
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .field("device", &self.device_name())
            .finish()
    }
}

fn new_channel() -> Result<NonNull<ffi::rdma_event_channel>> {
    // SAFETY: no arguments; NULL means errno.
    let ch = NonNull::new(unsafe { ffi::rdma_create_event_channel() })
        .ok_or_else(|| Error::last("rdma_create_event_channel"))?;
    // SAFETY: a live channel; its fd is open.
    let fd = unsafe { (*ch.as_ptr()).fd };
    if let Err(err) = crate::device::set_nonblocking(fd, true) {
        // SAFETY: just created, no id uses it.
        unsafe { ffi::rdma_destroy_event_channel(ch.as_ptr()) };
        return Err(err);
    }
    Ok(ch)
}

impl CmId {
    /// A new id for reliable connections (`RDMA_PS_TCP`) on a new non-blocking event
    /// channel (`rdma_create_event_channel` + `rdma_create_id`).
    #[doc(alias = "rdma_create_id")]
    #[doc(alias = "rdma_create_event_channel")]
    pub fn new() -> Result<CmId> {
        let channel = new_channel()?;
        let mut id = std::ptr::null_mut();
        // SAFETY: live channel, valid out-pointer, no user context.
        let ret = unsafe {
            ffi::rdma_create_id(
                channel.as_ptr(),
                &mut id,
                std::ptr::null_mut(),
                ffi::RDMA_PS_TCP,
            )
        };
        let id = match cvt(ret, "rdma_create_id").map(|()| NonNull::new(id)) {
            Ok(Some(id)) => id,
            Ok(None) | Err(_) => {
                let err = Error::last("rdma_create_id");
                // SAFETY: no id was created on it.
                unsafe { ffi::rdma_destroy_event_channel(channel.as_ptr()) };
                return Err(err);
            }
        };
        Ok(CmId {
            inner: IdInner { id, channel },
        })
    }

    /// Wrap a raw id and the channel it reports to; both are destroyed on drop.
    ///
    /// # Safety
    /// `id` must be a live id whose channel is `channel`, which no other id uses; nothing
    /// else may destroy either; every event of `id` read so far has been acknowledged.
    /// The channel must be non-blocking (`O_NONBLOCK`) for the bounded waits.
    pub unsafe fn from_raw(
        id: NonNull<ffi::rdma_cm_id>,
        channel: NonNull<ffi::rdma_event_channel>,
    ) -> Self {
        CmId {
            inner: IdInner { id, channel },
        }
    }

    /// The raw `rdma_cm_id`.
    pub fn as_raw(&self) -> *mut ffi::rdma_cm_id {
        self.inner.id.as_ptr()
    }

    /// The raw event channel.
    pub fn channel_as_raw(&self) -> *mut ffi::rdma_event_channel {
        self.inner.channel.as_ptr()
    }

    /// Local address and port (`rdma_get_local_addr`), once bound or resolved.
    #[doc(alias = "rdma_get_local_addr")]
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: live id; the function returns a pointer into it.
        unsafe { socket_addr(ffi::rdma_get_local_addr(self.as_raw())) }
    }

    /// Peer address and port (`rdma_get_peer_addr`), once resolved or connected.
    #[doc(alias = "rdma_get_peer_addr")]
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: live id; the function returns a pointer into it.
        unsafe { socket_addr(ffi::rdma_get_peer_addr(self.as_raw())) }
    }

    /// Name of the RDMA device the id is bound to (`id->verbs`), once bound to a
    /// device address, resolved, or created by a connection request.
    pub fn device_name(&self) -> Option<String> {
        // SAFETY: live id; `verbs` is NULL or librdmacm's open context of the device.
        let verbs = unsafe { (*self.as_raw()).verbs };
        if verbs.is_null() {
            return None;
        }
        // SAFETY: an open context has a device with a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name((*verbs).device)) };
        Some(name.to_string_lossy().into_owned())
    }

    /// Port of the device (`id->port_num`; 0 until bound to a device).
    pub fn port_num(&self) -> u8 {
        // SAFETY: live id.
        unsafe { (*self.as_raw()).port_num }
    }

    /// Whether the device speaks the InfiniBand transport (InfiniBand and RoCE), where
    /// the private data limits of the module docs apply.
    fn is_ib_transport(&self) -> bool {
        // SAFETY: live id; `verbs` is NULL or an open context.
        unsafe {
            let verbs = (*self.as_raw()).verbs;
            !verbs.is_null() && (*(*verbs).device).transport_type == ffi::IBV_TRANSPORT_IB
        }
    }

    /// Wait for the next event of this id (until `deadline`), copy it and
    /// acknowledge it (`rdma_get_cm_event` + `rdma_ack_cm_event`).
    fn next_event(&self, deadline: Deadline, waiting_for: &'static str) -> Result<Event> {
        loop {
            let mut ev = std::ptr::null_mut();
            // SAFETY: live channel (non-blocking); valid out-pointer.
            let ret = unsafe { ffi::rdma_get_cm_event(self.channel_as_raw(), &mut ev) };
            if ret == 0 {
                // SAFETY: a successful call returns an event, valid until acknowledged.
                let event = unsafe { copy_event(ev) };
                // SAFETY: acknowledged once, after everything was copied out of it.
                unsafe { ffi::rdma_ack_cm_event(ev) };
                return Ok(event);
            }
            let errno = last_errno();
            if errno != libc::EAGAIN && errno != libc::EINTR {
                return Err(Error::from_errno("rdma_get_cm_event", errno));
            }
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: waiting_for,
                    after: deadline.bound,
                });
            }
            let mut pfd = libc::pollfd {
                fd: self.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 && last_errno() != libc::EINTR {
                return Err(Error::Io {
                    context: "poll on the rdma_cm event channel",
                    source: io::Error::last_os_error(),
                });
            }
        }
    }

    /// `rdma_init_qp_attr` for `state`, applied to `qp` (with `access` at INIT, and the
    /// READ/atomic depths when given).
    fn move_qp(
        &self,
        qp: &mut PreparedQueuePair,
        state: QpState,
        access: AccessFlags,
        depths: Option<(u8, u8)>,
    ) -> Result<()> {
        // SAFETY: all-zero is a valid `ibv_qp_attr`.
        let mut raw: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        raw.qp_state = state.0;
        let mut mask = 0;
        // SAFETY: live id with a device; valid out-pointers.
        let ret = unsafe { ffi::rdma_init_qp_attr(self.as_raw(), &mut raw, &mut mask) };
        cvt(ret, "rdma_init_qp_attr")?;
        let mut attr = QpAttr::from_ffi(raw, QpAttrMask::from_bits_retain(mask as u32));
        if state == QpState::INIT {
            attr = attr.qp_access_flags(access);
        }
        if let Some((responder_resources, initiator_depth)) = depths {
            if state == QpState::RTR {
                attr = attr.max_dest_rd_atomic(responder_resources);
            }
            if state == QpState::RTS {
                attr = attr.max_rd_atomic(initiator_depth);
            }
        }
        qp.modify(&attr)
    }

    /// The QP must live on the device this id is bound to.
    fn check_device(&self, qp: &PreparedQueuePair) -> Result<()> {
        let ours = qp.pd().context().name();
        match self.device_name() {
            Some(dev) if dev == ours => Ok(()),
            dev => Err(Error::InvalidArgument(format!(
                "the QP was created on device {ours}, but the connection goes through {}",
                dev.as_deref().unwrap_or("no device yet")
            ))),
        }
    }

    fn check_private_data(&self, len: usize, limit: usize, what: &str) -> Result<()> {
        if len > u8::MAX as usize || (self.is_ib_transport() && len > limit) {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes of private data: {what} carries at most {limit} on InfiniBand/RoCE"
            )));
        }
        Ok(())
    }
}

impl AsRawFd for CmId {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: live channel.
        unsafe { (*self.channel_as_raw()).fd }
    }
}

impl AsFd for CmId {
    /// The event channel's file descriptor (readable when an event is pending).
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open while the channel lives.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

/// Copy what this module uses out of an event.
///
/// # Safety
/// `ev` is an event returned by `rdma_get_cm_event` and not yet acknowledged.
unsafe fn copy_event(ev: *mut ffi::rdma_cm_event) -> Event {
    // SAFETY: per the contract; for connected (RC) ids the `conn` member of the union is
    // the one librdmacm fills; its private data pointer covers `private_data_len` bytes.
    unsafe {
        let e = &*ev;
        let kind = CmEventType(e.event);
        let conn = e.param.conn;
        let private_data = if conn.private_data.is_null() || conn.private_data_len == 0 {
            Vec::new()
        } else {
            std::slice::from_raw_parts(
                conn.private_data.cast::<u8>(),
                conn.private_data_len as usize,
            )
            .to_vec()
        };
        Event {
            kind,
            status: e.status,
            private_data,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
            new_id: if kind == CmEventType::CONNECT_REQUEST {
                NonNull::new(e.id)
            } else {
                None
            },
        }
    }
}

fn event_name(kind: CmEventType) -> &'static str {
    kind.name().unwrap_or("an unknown rdma_cm event")
}

fn status_error(status: i32) -> io::Error {
    io::Error::from_raw_os_error(if status < 0 { -status } else { libc::EIO })
}

/// The `sockaddr` of `addr` (IPv4 or IPv6), as storage that any family fits in.
fn raw_sockaddr(addr: &SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: all-zero is a valid `sockaddr_storage`.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: `sockaddr_storage` is larger than and aligned for `sockaddr_in`.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: `sockaddr_storage` is larger than and aligned for `sockaddr_in6`.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
        }
    }
    storage
}

/// The socket address behind a `sockaddr` pointer (IPv4/IPv6), if any.
///
/// # Safety
/// `sa` is NULL or points to a `sockaddr` as large as its family requires.
unsafe fn socket_addr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: per the contract.
    unsafe {
        match (*sa).sa_family as i32 {
            libc::AF_INET => {
                let sin = &*sa.cast::<libc::sockaddr_in>();
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                Some(SocketAddr::V4(SocketAddrV4::new(
                    ip,
                    u16::from_be(sin.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let sin6 = &*sa.cast::<libc::sockaddr_in6>();
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::V6(SocketAddrV6::new(
                    ip,
                    u16::from_be(sin6.sin6_port),
                    sin6.sin6_flowinfo,
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

fn ms(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// The end of a bounded wait, and the bound (for the error).
#[derive(Clone, Copy)]
struct Deadline {
    at: Instant,
    bound: Duration,
}

impl Deadline {
    fn after(bound: Duration) -> Deadline {
        Deadline {
            at: Instant::now() + bound,
            bound,
        }
    }
    fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }
}

/// A listening rdma_cm id (`rdma_bind_addr` + `rdma_listen`): accepts connection
/// requests for one IP address (or all, with an unspecified address) and port.
#[doc(alias = "rdma_listen")]
pub struct Listener {
    id: CmId,
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener")
            .field("local", &self.local_addr())
            .finish()
    }
}

impl Listener {
    /// Listen on `addr` (port 0 picks a free port: see
    /// [`local_addr`](Self::local_addr)), with a backlog of 128 pending requests.
    #[doc(alias = "rdma_bind_addr")]
    #[doc(alias = "rdma_listen")]
    pub fn bind(addr: SocketAddr) -> Result<Listener> {
        let id = CmId::new()?;
        let mut raw = raw_sockaddr(&addr);
        // SAFETY: live id; `raw` holds a valid sockaddr of `addr`'s family.
        let ret = unsafe {
            ffi::rdma_bind_addr(
                id.as_raw(),
                (&mut raw as *mut libc::sockaddr_storage).cast(),
            )
        };
        if ret != 0 {
            let errno = last_errno();
            return Err(match errno {
                libc::ENODEV | libc::EADDRNOTAVAIL => Error::Unreachable {
                    addr,
                    stage: "rdma_bind_addr",
                    source: io::Error::from_raw_os_error(errno),
                },
                _ => Error::from_errno("rdma_bind_addr", errno),
            });
        }
        // SAFETY: live, bound id.
        cvt(unsafe { ffi::rdma_listen(id.as_raw(), 128) }, "rdma_listen")?;
        Ok(Listener { id })
    }

    /// The address and port listened on (`rdma_get_local_addr`).
    #[doc(alias = "rdma_get_local_addr")]
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// The underlying id.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// Wait up to `timeout` for the next connection request
    /// (`RDMA_CM_EVENT_CONNECT_REQUEST`); [`Error::Timeout`] if none arrives. The
    /// request gets its own event channel (`rdma_migrate_id`), so it and the connection
    /// it becomes are independent of the listener.
    #[doc(alias = "rdma_get_cm_event")]
    #[doc(alias = "rdma_migrate_id")]
    pub fn get_request(&self, timeout: Duration) -> Result<ConnectRequest> {
        let deadline = Deadline::after(timeout);
        loop {
            let ev = self
                .id
                .next_event(deadline, "waiting for RDMA_CM_EVENT_CONNECT_REQUEST")?;
            match ev.kind {
                CmEventType::CONNECT_REQUEST => {
                    let Some(new_id) = ev.new_id else {
                        return Err(Error::UnexpectedCmEvent {
                            waiting_for: "a connection request",
                            event: "RDMA_CM_EVENT_CONNECT_REQUEST without an id",
                            status: ev.status,
                        });
                    };
                    let channel = match new_channel() {
                        Ok(ch) => ch,
                        Err(err) => {
                            // SAFETY: the request's id is ours and has no events.
                            unsafe { ffi::rdma_destroy_id(new_id.as_ptr()) };
                            return Err(err);
                        }
                    };
                    // SAFETY: live id and channel; the id's only event (the request,
                    // reported on the listener) was acknowledged.
                    let ret = unsafe { ffi::rdma_migrate_id(new_id.as_ptr(), channel.as_ptr()) };
                    // SAFETY: from here the id reports to `channel`, which only it
                    // uses; if the migration failed, it still reports to the listener's
                    // channel, and destroying it there is equally fine.
                    let id = unsafe { CmId::from_raw(new_id, channel) };
                    cvt(ret, "rdma_migrate_id")?;
                    return Ok(ConnectRequest {
                        id,
                        private_data: ev.private_data,
                        responder_resources: ev.responder_resources,
                        initiator_depth: ev.initiator_depth,
                    });
                }
                CmEventType::ADDR_CHANGE => continue,
                other => {
                    return Err(Error::UnexpectedCmEvent {
                        waiting_for: "a connection request",
                        event: event_name(other),
                        status: ev.status,
                    })
                }
            }
        }
    }
}

/// A connection request received by a [`Listener`]: accept it with a QP of the device it
/// arrived on ([`device_name`](Self::device_name)), or reject it. Dropping it rejects.
#[doc(alias = "RDMA_CM_EVENT_CONNECT_REQUEST")]
#[doc(alias = "rdma_get_request")]
pub struct ConnectRequest {
    id: CmId,
    private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

impl fmt::Debug for ConnectRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectRequest")
            .field("id", &self.id)
            .field("private_data_len", &self.private_data.len())
            .finish()
    }
}

impl ConnectRequest {
    /// The peer's private data (zero-padded by the transport to the message's size).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }
    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }
    /// Our address the request came to.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }
    /// The RDMA device the request arrived on: create the QP on a
    /// [`Context`](crate::Context) of it.
    pub fn device_name(&self) -> String {
        self.id.device_name().unwrap_or_default()
    }
    /// The device port.
    pub fn port_num(&self) -> u8 {
        self.id.port_num()
    }
    /// The underlying id.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// Move `qp` to INIT now (`rdma_init_qp_attr`), e.g. to post receives before
    /// accepting; [`accept`](Self::accept) does it otherwise. Uses the default access
    /// rights of [`CmOptions`]; `accept` applies its own again.
    #[doc(alias = "rdma_init_qp_attr")]
    pub fn init_qp(&self, qp: &mut PreparedQueuePair) -> Result<()> {
        self.id.check_device(qp)?;
        self.id
            .move_qp(qp, QpState::INIT, CmOptions::default().access, None)
    }

    /// Accept with `qp` (an RC QP of [`device_name`](Self::device_name), in RESET or
    /// INIT): INIT → RTR → RTS with the negotiated attributes, `rdma_accept` with
    /// `opts.private_data`, then wait (bounded by `opts.timeout`) until the peer
    /// confirms (`RDMA_CM_EVENT_ESTABLISHED`).
    #[doc(alias = "rdma_accept")]
    pub fn accept(self, mut qp: PreparedQueuePair, opts: &CmOptions) -> Result<Connection> {
        let deadline = Deadline::after(opts.timeout);
        self.id.check_device(&qp)?;
        self.id
            .check_private_data(opts.private_data.len(), REP_PRIVATE_DATA, "an accept")?;
        // As librdmacm's rdma_accept: "as many as the device allows" is capped by what
        // the peer asked for.
        let attr = qp.pd().context().query_device()?;
        let cap = |v: u32| v.min(u8::MAX as u32) as u8;
        let responder_resources = if opts.responder_resources == DEVICE_MAX {
            self.responder_resources.min(cap(attr.max_qp_rd_atom()))
        } else {
            opts.responder_resources
        };
        let initiator_depth = if opts.initiator_depth == DEVICE_MAX {
            self.initiator_depth.min(cap(attr.max_qp_init_rd_atom()))
        } else {
            opts.initiator_depth
        };
        let depths = Some((responder_resources, initiator_depth));
        for state in [QpState::INIT, QpState::RTR, QpState::RTS] {
            self.id.move_qp(&mut qp, state, opts.access, depths)?;
        }
        let mut param = opts.conn_param(qp.qp_num(), qp.has_srq());
        param.responder_resources = responder_resources;
        param.initiator_depth = initiator_depth;
        // SAFETY: live id; `param` and its private data are valid for the call.
        let ret = unsafe { ffi::rdma_accept(self.id.as_raw(), &mut param) };
        cvt(ret, "rdma_accept")?;
        let peer = self.peer_addr();
        let ev = self
            .id
            .next_event(deadline, "accept: waiting for RDMA_CM_EVENT_ESTABLISHED")?;
        if ev.kind != CmEventType::ESTABLISHED {
            return Err(handshake_error(
                ev,
                peer,
                "accept: waiting for RDMA_CM_EVENT_ESTABLISHED",
            ));
        }
        Ok(Connection {
            id: self.id,
            qp: qp.into_ready()?,
            private_data: self.private_data,
            disconnected: false,
        })
    }

    /// Reject the request (`rdma_reject`), sending `private_data` (at most 148 bytes on
    /// InfiniBand/RoCE); the peer gets [`Error::Rejected`].
    #[doc(alias = "rdma_reject")]
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        self.id
            .check_private_data(private_data.len(), REJ_PRIVATE_DATA, "a reject")?;
        // SAFETY: live id; the data is valid for the call.
        cvt(
            unsafe {
                ffi::rdma_reject(
                    self.id.as_raw(),
                    private_data.as_ptr().cast(),
                    private_data.len() as u8,
                )
            },
            "rdma_reject",
        )
    }
}

/// The error for an event that ended a connection handshake.
fn handshake_error(ev: Event, peer: Option<SocketAddr>, waiting_for: &'static str) -> Error {
    let addr = peer.unwrap_or_else(|| SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
    match ev.kind {
        CmEventType::REJECTED if ev.status == REJ_INVALID_SERVICE_ID => {
            Error::ConnectionRefused { addr }
        }
        CmEventType::REJECTED => Error::Rejected {
            addr,
            reason: ev.status,
            private_data: ev.private_data,
        },
        CmEventType::UNREACHABLE => Error::Unreachable {
            addr,
            stage: "connection request (RDMA_CM_EVENT_UNREACHABLE)",
            source: status_error(ev.status),
        },
        kind => Error::UnexpectedCmEvent {
            waiting_for,
            event: event_name(kind),
            status: ev.status,
        },
    }
}

/// The active side after address and route resolution (`rdma_resolve_addr` +
/// `rdma_resolve_route`): the device to create the QP on is known
/// ([`device_name`](Self::device_name)); [`connect`](Self::connect) makes the connection.
#[doc(alias = "rdma_resolve_route")]
pub struct Route {
    id: CmId,
    dst: SocketAddr,
}

impl fmt::Debug for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Route")
            .field("dst", &self.dst)
            .field("id", &self.id)
            .finish()
    }
}

impl Route {
    /// Resolve `dst` (IP address and port of a [`Listener`]) to an RDMA device, port and
    /// path, within `opts.timeout`. [`Error::Unreachable`] when no RDMA device serves
    /// the route to it or resolution fails; [`Error::Timeout`] when it takes too long.
    #[doc(alias = "rdma_resolve_addr")]
    #[doc(alias = "rdma_resolve_route")]
    pub fn resolve(dst: SocketAddr, opts: &CmOptions) -> Result<Route> {
        let deadline = Deadline::after(opts.timeout);
        let id = CmId::new()?;
        let mut src = opts.src_addr.as_ref().map(raw_sockaddr);
        let mut raw_dst = raw_sockaddr(&dst);
        let src_ptr = src.as_mut().map_or(std::ptr::null_mut(), |s| {
            (s as *mut libc::sockaddr_storage).cast()
        });
        let unreachable = |stage, errno| Error::Unreachable {
            addr: dst,
            stage,
            source: io::Error::from_raw_os_error(errno),
        };
        // SAFETY: live id; the addresses are valid sockaddrs for the call.
        let ret = unsafe {
            ffi::rdma_resolve_addr(
                id.as_raw(),
                src_ptr,
                (&mut raw_dst as *mut libc::sockaddr_storage).cast(),
                ms(deadline.remaining()),
            )
        };
        if ret != 0 {
            return Err(unreachable("rdma_resolve_addr", last_errno()));
        }
        let ev = id.next_event(
            deadline,
            "rdma_resolve_addr: waiting for RDMA_CM_EVENT_ADDR_RESOLVED",
        )?;
        match ev.kind {
            CmEventType::ADDR_RESOLVED => {}
            CmEventType::ADDR_ERROR => {
                return Err(unreachable(
                    "address resolution (RDMA_CM_EVENT_ADDR_ERROR)",
                    if ev.status < 0 { -ev.status } else { libc::EIO },
                ))
            }
            kind => {
                return Err(Error::UnexpectedCmEvent {
                    waiting_for: "RDMA_CM_EVENT_ADDR_RESOLVED",
                    event: event_name(kind),
                    status: ev.status,
                })
            }
        }
        // SAFETY: live id with a resolved address.
        let ret = unsafe { ffi::rdma_resolve_route(id.as_raw(), ms(deadline.remaining())) };
        if ret != 0 {
            return Err(unreachable("rdma_resolve_route", last_errno()));
        }
        let ev = id.next_event(
            deadline,
            "rdma_resolve_route: waiting for RDMA_CM_EVENT_ROUTE_RESOLVED",
        )?;
        match ev.kind {
            CmEventType::ROUTE_RESOLVED => Ok(Route { id, dst }),
            CmEventType::ROUTE_ERROR => Err(unreachable(
                "route resolution (RDMA_CM_EVENT_ROUTE_ERROR)",
                if ev.status < 0 { -ev.status } else { libc::EIO },
            )),
            kind => Err(Error::UnexpectedCmEvent {
                waiting_for: "RDMA_CM_EVENT_ROUTE_RESOLVED",
                event: event_name(kind),
                status: ev.status,
            }),
        }
    }

    /// The RDMA device the route goes through: create the QP on a
    /// [`Context`](crate::Context) of it.
    pub fn device_name(&self) -> String {
        self.id.device_name().unwrap_or_default()
    }
    /// The device port.
    pub fn port_num(&self) -> u8 {
        self.id.port_num()
    }
    /// The destination.
    pub fn dst(&self) -> SocketAddr {
        self.dst
    }
    /// The underlying id.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// Move `qp` to INIT now (`rdma_init_qp_attr`), e.g. to post receives before
    /// connecting; [`connect`](Self::connect) does it otherwise.
    #[doc(alias = "rdma_init_qp_attr")]
    pub fn init_qp(&self, qp: &mut PreparedQueuePair) -> Result<()> {
        self.id.check_device(qp)?;
        self.id
            .move_qp(qp, QpState::INIT, CmOptions::default().access, None)
    }

    /// Connect `qp` (an RC QP of [`device_name`](Self::device_name), in RESET or INIT):
    /// `rdma_connect` with `opts.private_data`, wait for the peer's reply (bounded by
    /// `opts.timeout`), INIT → RTR → RTS with the negotiated attributes, and confirm
    /// (`rdma_establish`). [`Error::ConnectionRefused`] when nobody listens,
    /// [`Error::Rejected`] when the peer rejects, [`Error::Unreachable`] when the request
    /// gets no answer from the transport, [`Error::Timeout`] otherwise.
    #[doc(alias = "rdma_connect")]
    #[doc(alias = "rdma_establish")]
    pub fn connect(self, mut qp: PreparedQueuePair, opts: &CmOptions) -> Result<Connection> {
        let deadline = Deadline::after(opts.timeout);
        self.id.check_device(&qp)?;
        self.id.check_private_data(
            opts.private_data.len(),
            REQ_PRIVATE_DATA,
            "a connect request",
        )?;
        self.id.move_qp(&mut qp, QpState::INIT, opts.access, None)?;
        let mut param = opts.conn_param(qp.qp_num(), qp.has_srq());
        // SAFETY: live id with a resolved route; `param` and its private data are valid
        // for the call (librdmacm copies them).
        let ret = unsafe { ffi::rdma_connect(self.id.as_raw(), &mut param) };
        cvt(ret, "rdma_connect")?;
        let waiting_for = "connect: waiting for RDMA_CM_EVENT_CONNECT_RESPONSE";
        let ev = self.id.next_event(deadline, waiting_for)?;
        if ev.kind != CmEventType::CONNECT_RESPONSE {
            return Err(handshake_error(ev, Some(self.dst), waiting_for));
        }
        // As librdmacm does for its own QPs: INIT again (the attributes now reflect
        // the reply), then RTR and RTS.
        for state in [QpState::INIT, QpState::RTR, QpState::RTS] {
            self.id.move_qp(&mut qp, state, opts.access, None)?;
        }
        // SAFETY: live id that got a connect response; the QP is not attached to it.
        let ret = unsafe { ffi::rdma_establish(self.id.as_raw()) };
        cvt(ret, "rdma_establish")?;
        Ok(Connection {
            id: self.id,
            qp: qp.into_ready()?,
            private_data: ev.private_data,
            disconnected: false,
        })
    }
}

/// A connected RC queue pair with its rdma_cm id. Dereferences to [`QueuePair`] for
/// posting and state queries. Dropping it disconnects (the peer gets
/// `RDMA_CM_EVENT_DISCONNECTED`) and destroys the QP.
#[doc(alias = "rdma_connect")]
#[doc(alias = "rdma_accept")]
pub struct Connection {
    // Dropped first: destroying a connected id sends the disconnect request.
    id: CmId,
    qp: QueuePair,
    private_data: Vec<u8>,
    disconnected: bool,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("qp", &self.qp)
            .field("local", &self.id.local_addr())
            .field("peer", &self.id.peer_addr())
            .finish()
    }
}

impl Deref for Connection {
    type Target = QueuePair;
    fn deref(&self) -> &QueuePair {
        &self.qp
    }
}

impl DerefMut for Connection {
    fn deref_mut(&mut self) -> &mut QueuePair {
        &mut self.qp
    }
}

impl Connection {
    /// The queue pair.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }
    /// The queue pair, mutably (for [`QueuePair::wr_start`]).
    pub fn qp_mut(&mut self) -> &mut QueuePair {
        &mut self.qp
    }
    /// The peer's private data: of its accept (active side) or its request (passive
    /// side), zero-padded by the transport.
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }
    /// The underlying id (its fd becomes readable when the peer disconnects).
    pub fn id(&self) -> &CmId {
        &self.id
    }
    /// Our address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }
    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// Disconnect (`rdma_disconnect`): the QP goes to ERR (outstanding work is flushed)
    /// and the peer gets `RDMA_CM_EVENT_DISCONNECTED`; then wait, up to `timeout`, for
    /// the peer's confirmation. Idempotent.
    #[doc(alias = "rdma_disconnect")]
    pub fn disconnect(&mut self, timeout: Duration) -> Result<()> {
        if self.disconnected {
            return Ok(());
        }
        self.qp.to_error()?;
        // SAFETY: live, connected id.
        let ret = unsafe { ffi::rdma_disconnect(self.id.as_raw()) };
        cvt(ret, "rdma_disconnect")?;
        self.wait_disconnected(timeout)
    }

    /// Wait, up to `timeout`, until the connection is gone (`RDMA_CM_EVENT_DISCONNECTED`:
    /// the peer disconnected, dropped its connection or exited); then the QP is moved to
    /// ERR and the peer's disconnect is confirmed. [`Error::Timeout`] if the connection
    /// is still up.
    pub fn wait_disconnected(&mut self, timeout: Duration) -> Result<()> {
        if self.disconnected {
            return Ok(());
        }
        let deadline = Deadline::after(timeout);
        loop {
            let ev = self
                .id
                .next_event(deadline, "waiting for RDMA_CM_EVENT_DISCONNECTED")?;
            match ev.kind {
                CmEventType::DISCONNECTED => break,
                CmEventType::ADDR_CHANGE | CmEventType::ESTABLISHED => continue,
                kind => {
                    return Err(Error::UnexpectedCmEvent {
                        waiting_for: "RDMA_CM_EVENT_DISCONNECTED",
                        event: event_name(kind),
                        status: ev.status,
                    })
                }
            }
        }
        self.disconnected = true;
        self.qp.to_error()?;
        // Answer the peer's disconnect request (a no-op if we sent it).
        // SAFETY: live id.
        unsafe { ffi::rdma_disconnect(self.id.as_raw()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_round_trip() {
        for text in ["192.0.2.1:7471", "[fe80::1%3]:18515", "0.0.0.0:0"] {
            let addr: SocketAddr = text.parse().unwrap();
            let raw = raw_sockaddr(&addr);
            // SAFETY: `raw` holds a sockaddr of `addr`'s family.
            let back = unsafe { socket_addr((&raw as *const libc::sockaddr_storage).cast()) };
            assert_eq!(back, Some(addr), "{text}");
        }
        // SAFETY: NULL is allowed.
        assert_eq!(unsafe { socket_addr(std::ptr::null()) }, None);
    }

    #[test]
    fn option_defaults_mean_device_maximum() {
        let o = CmOptions::default();
        let p = o.conn_param(7, true);
        assert_eq!((p.qp_num, p.srq, p.private_data_len), (7, 1, 0));
        assert!(p.private_data.is_null());
        assert_eq!(
            (p.responder_resources, p.initiator_depth),
            (ffi::RDMA_MAX_RESP_RES as u8, ffi::RDMA_MAX_INIT_DEPTH as u8)
        );
        assert_eq!((p.retry_count, p.rnr_retry_count), (7, 7));
        assert_eq!(CmEventType(4), CmEventType::CONNECT_REQUEST);
        assert_eq!(event_name(CmEventType(999)), "an unknown rdma_cm event");
    }
}
