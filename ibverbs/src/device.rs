//! Devices, the device context, device/port attributes, GIDs and async events.

use crate::error::{cvt, cvt_ptr, last_errno, Error, Result};
use crate::ffi;
use crate::newtype::c_newtype;
use serde::{Deserialize, Serialize};
use std::ffi::{c_int, CStr};
use std::fmt;
use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

/// The RDMA devices of this machine (`ibv_get_device_list`).
///
/// Empty, not an error, when the machine has no RDMA subsystem (libibverbs then
/// reports `ENOSYS`).
#[doc(alias = "ibv_get_device_list")]
pub fn devices() -> Result<DeviceList> {
    let mut num: c_int = 0;
    // SAFETY: `num` is a valid out-pointer.
    let list = unsafe { ffi::ibv_get_device_list(&mut num) };
    if list.is_null() {
        let errno = last_errno();
        if errno == libc::ENOSYS {
            return Ok(DeviceList { list: None, len: 0 });
        }
        return Err(Error::from_errno("ibv_get_device_list", errno));
    }
    Ok(DeviceList {
        list: NonNull::new(list),
        len: num.max(0) as usize,
    })
}

/// A list of devices, freed on drop (`ibv_free_device_list`). Open the devices you need
/// before dropping it; opened contexts stay valid afterwards.
pub struct DeviceList {
    list: Option<NonNull<*mut ffi::ibv_device>>,
    len: usize,
}

impl DeviceList {
    /// Number of devices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no device.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The devices.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Device<'_>> + '_ {
        (0..self.len).map(move |i| {
            let list = self.list.expect("non-empty list has a pointer");
            // SAFETY: the list holds `len` valid device pointers while `self` lives.
            let raw = unsafe { *list.as_ptr().add(i) };
            Device {
                raw,
                _list: std::marker::PhantomData,
            }
        })
    }

    /// The device called `name` (e.g. `rxe0`, `mlx5_0`).
    pub fn get(&self, name: &str) -> Result<Device<'_>> {
        self.iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::DeviceNotFound {
                name: name.to_owned(),
                available: self.iter().map(|d| d.name()).collect(),
            })
    }
}

impl fmt::Debug for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.iter().map(|d| d.name()))
            .finish()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if let Some(list) = self.list {
            // SAFETY: the list came from ibv_get_device_list and is freed once.
            unsafe { ffi::ibv_free_device_list(list.as_ptr()) };
        }
    }
}

/// One device of a [`DeviceList`].
#[derive(Clone, Copy)]
pub struct Device<'list> {
    raw: *mut ffi::ibv_device,
    _list: std::marker::PhantomData<&'list DeviceList>,
}

impl Device<'_> {
    /// Kernel name of the device (`ibv_get_device_name`).
    #[doc(alias = "ibv_get_device_name")]
    pub fn name(&self) -> String {
        // SAFETY: `raw` is a listed device; the name is a NUL-terminated string it owns.
        unsafe { CStr::from_ptr(ffi::ibv_get_device_name(self.raw)) }
            .to_string_lossy()
            .into_owned()
    }

    /// Node GUID (`ibv_get_device_guid`), in host byte order.
    #[doc(alias = "ibv_get_device_guid")]
    pub fn guid(&self) -> u64 {
        // SAFETY: `raw` is a listed device.
        u64::from_be(unsafe { ffi::ibv_get_device_guid(self.raw) })
    }

    /// Open the device (`ibv_open_device`).
    #[doc(alias = "ibv_open_device")]
    pub fn open(&self) -> Result<Context> {
        // SAFETY: `raw` is a listed device.
        let ctx = cvt_ptr(unsafe { ffi::ibv_open_device(self.raw) }, "ibv_open_device")?;
        Ok(Context {
            inner: Arc::new(ContextInner {
                ctx,
                owned: true,
                name: self.name(),
                kernel_wc_flags: Default::default(),
            }),
        })
    }

    /// The raw `ibv_device` (valid while the list lives).
    pub fn as_raw(&self) -> *mut ffi::ibv_device {
        self.raw
    }
}

impl fmt::Debug for Device<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .finish()
    }
}

pub(crate) struct ContextInner {
    pub(crate) ctx: NonNull<ffi::ibv_context>,
    owned: bool,
    name: String,
    /// Whether the provider copies the kernel's `ib_wc_flags` into `ibv_wc::wc_flags`
    /// (see [`Context::reports_kernel_wc_flags`]); found out on first use.
    kernel_wc_flags: std::sync::OnceLock<bool>,
}

// SAFETY: rdma-core's libibverbs is thread-safe: a context and every verb on it may be
// used from any thread concurrently (the library locks internally; see ibv_alloc_td(3)).
unsafe impl Send for ContextInner {}
// SAFETY: as above, shared use of a context from several threads is allowed.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: every child object holds a clone of the Arc, so none is left.
        let ret = unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) };
        if let Err(err) = cvt(ret, "ibv_close_device") {
            tracing::error!(device = %self.name, %err, "closing the device failed");
        }
    }
}

/// An open device (`struct ibv_context`). Cheap to clone; closed when the last clone and
/// the last object created from it are gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.name)
            .finish()
    }
}

impl Context {
    /// Open the device called `name`.
    pub fn open(name: &str) -> Result<Self> {
        devices()?.get(name)?.open()
    }

    /// Wrap a raw context.
    ///
    /// # Safety
    /// `ctx` must be a valid open context. With `owned`, this wrapper closes it when the
    /// last clone drops, and nothing else may close it; without, it must stay open for
    /// as long as any clone or child object lives.
    pub unsafe fn from_raw(ctx: NonNull<ffi::ibv_context>, owned: bool) -> Self {
        // SAFETY: the caller guarantees `ctx` is open; its device pointer is valid.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name((*ctx.as_ptr()).device)) }
            .to_string_lossy()
            .into_owned();
        Context {
            inner: Arc::new(ContextInner {
                ctx,
                owned,
                name,
                kernel_wc_flags: Default::default(),
            }),
        }
    }

    /// The raw `ibv_context`.
    pub fn as_raw(&self) -> *mut ffi::ibv_context {
        self.inner.ctx.as_ptr()
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether the provider hands the kernel's `ib_wc_flags` to user space unchanged:
    /// soft-RoCE (`rdma_rxe`, vendor id `0xffffff`) does (seen with kernel 6.1 and
    /// rdma-core 44; rdma-core's rxe provider still copies the kernel's completion
    /// as it is), so a completion of a SEND_WITH_INV carries `IB_WC_WITH_INVALIDATE`
    /// (`1 << 2`, which is `IBV_WC_IP_CSUM_OK` in user space) instead of
    /// `IBV_WC_WITH_INV` (`1 << 3`). [`CompletionQueue::poll`](crate::CompletionQueue::poll)
    /// swaps the two bits back on such devices.
    pub(crate) fn reports_kernel_wc_flags(&self) -> bool {
        const RXE_VENDOR_ID: u32 = 0x00ff_ffff;
        *self.inner.kernel_wc_flags.get_or_init(|| {
            self.query_device()
                .is_ok_and(|attr| attr.vendor_id() == RXE_VENDOR_ID)
        })
    }

    /// Device attributes (`ibv_query_device_ex`, falling back to `ibv_query_device`).
    #[doc(alias = "ibv_query_device_ex")]
    #[doc(alias = "ibv_query_device")]
    pub fn query_device(&self) -> Result<DeviceAttr> {
        // SAFETY: all-zero is a valid `ibv_device_attr_ex`.
        let mut attr: ffi::ibv_device_attr_ex = unsafe { std::mem::zeroed() };
        // SAFETY: open context; valid out-pointer; no input attributes.
        let ret = unsafe { ffi::ibv_query_device_ex(self.as_raw(), std::ptr::null(), &mut attr) };
        if ret != 0 {
            // SAFETY: as above, the classic call fills the embedded `orig_attr`.
            let ret = unsafe { ffi::ibv_query_device(self.as_raw(), &mut attr.orig_attr) };
            cvt(ret, "ibv_query_device")?;
        }
        Ok(DeviceAttr { raw: attr })
    }

    /// Port attributes (`ibv_query_port`).
    #[doc(alias = "ibv_query_port")]
    pub fn query_port(&self, port_num: u8) -> Result<PortAttr> {
        // SAFETY: all-zero is a valid `ibv_port_attr`.
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: open context, valid out-pointer.
        let ret = unsafe { ffi::ibv_query_port(self.as_raw(), port_num, &mut attr) };
        cvt(ret, "ibv_query_port")?;
        Ok(PortAttr { raw: attr })
    }

    /// One GID (`ibv_query_gid`).
    #[doc(alias = "ibv_query_gid")]
    pub fn query_gid(&self, port_num: u8, index: u32) -> Result<Gid> {
        let mut gid = MaybeUninit::<ffi::ibv_gid>::zeroed();
        // SAFETY: open context, valid out-pointer.
        let ret = unsafe {
            ffi::ibv_query_gid(self.as_raw(), port_num, index as c_int, gid.as_mut_ptr())
        };
        if ret != 0 {
            return Err(Error::Gid {
                port: port_num,
                gid_index: index,
                reason: format!("ibv_query_gid: {}", std::io::Error::last_os_error()),
            });
        }
        // SAFETY: zero-initialised and filled by the call.
        Ok(Gid::from(unsafe { gid.assume_init() }))
    }

    /// One GID table entry with its type (`ibv_query_gid_ex`).
    #[doc(alias = "ibv_query_gid_ex")]
    pub fn query_gid_entry(&self, port_num: u8, index: u32) -> Result<GidEntry> {
        // SAFETY: all-zero is a valid `ibv_gid_entry`.
        let mut entry: ffi::ibv_gid_entry = unsafe { std::mem::zeroed() };
        // SAFETY: open context, valid out-pointer, flags 0.
        let ret =
            unsafe { ffi::ibv_query_gid_ex(self.as_raw(), port_num.into(), index, &mut entry, 0) };
        if ret != 0 {
            let errno = crate::error::ret_errno(ret);
            return Err(if errno == libc::EOPNOTSUPP {
                Error::Unsupported {
                    call: "ibv_query_gid_ex",
                }
            } else {
                Error::Gid {
                    port: port_num,
                    gid_index: index,
                    reason: format!(
                        "ibv_query_gid_ex: {}",
                        std::io::Error::from_raw_os_error(errno)
                    ),
                }
            });
        }
        Ok(GidEntry::from(entry))
    }

    /// Every valid GID of every port (`ibv_query_gid_table`).
    #[doc(alias = "ibv_query_gid_table")]
    pub fn gid_table(&self) -> Result<Vec<GidEntry>> {
        let attr = self.query_device()?;
        let mut max = 0usize;
        for port in 1..=attr.phys_port_cnt() {
            max += self.query_port(port)?.gid_tbl_len() as usize;
        }
        // SAFETY: all-zero is a valid `ibv_gid_entry`.
        let mut entries: Vec<ffi::ibv_gid_entry> = vec![unsafe { std::mem::zeroed() }; max];
        // SAFETY: `entries` has room for `max` entries; flags 0.
        let n = unsafe { ffi::ibv_query_gid_table(self.as_raw(), entries.as_mut_ptr(), max, 0) };
        if n < 0 {
            return Err(Error::from_errno("ibv_query_gid_table", (-n) as c_int));
        }
        entries.truncate(n as usize);
        Ok(entries.into_iter().map(GidEntry::from).collect())
    }

    /// The RoCE v2 GID of `port_num` whose address is of `family` (IPv4-mapped or IPv6).
    /// On InfiniBand (`link_layer` IB) returns the port's GID 0.
    pub fn find_roce_v2_gid(&self, port_num: u8, family: IpFamily) -> Result<GidEntry> {
        let port = self.query_port(port_num)?;
        if port.link_layer() == LinkLayer::INFINIBAND {
            return self.query_gid_entry(port_num, 0);
        }
        for index in 0..port.gid_tbl_len() {
            let Ok(entry) = self.query_gid_entry(port_num, index) else {
                continue;
            };
            if entry.gid_type != GidType::ROCE_V2 || entry.gid.is_zero() {
                continue;
            }
            let is_v4 = entry.gid.to_ipv4().is_some();
            if is_v4 == (family == IpFamily::V4) {
                return Ok(entry);
            }
        }
        Err(Error::Gid {
            port: port_num,
            gid_index: port.gid_tbl_len(),
            reason: format!("no RoCE v2 GID for {family:?} in the table"),
        })
    }

    /// The file descriptor of async events, for epoll/mio/tokio.
    pub fn async_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd belongs to the context and stays open while `self` lives.
        unsafe { BorrowedFd::borrow_raw((*self.as_raw()).async_fd) }
    }

    /// Make [`get_async_event`](Self::get_async_event) non-blocking
    /// ([`Error::WouldBlock`] when no event is pending).
    pub fn set_async_nonblocking(&self, nonblocking: bool) -> Result<()> {
        set_nonblocking(self.async_fd().as_raw_fd(), nonblocking)
    }

    /// Read the next async event (`ibv_get_async_event`) and acknowledge it
    /// (`ibv_ack_async_event`). Blocks unless made non-blocking.
    #[doc(alias = "ibv_get_async_event")]
    #[doc(alias = "ibv_ack_async_event")]
    pub fn get_async_event(&self) -> Result<AsyncEvent> {
        let mut ev = MaybeUninit::<ffi::ibv_async_event>::zeroed();
        // SAFETY: open context, valid out-pointer.
        let ret = unsafe { ffi::ibv_get_async_event(self.as_raw(), ev.as_mut_ptr()) };
        if ret != 0 {
            return Err(Error::last("ibv_get_async_event"));
        }
        // SAFETY: filled by the successful call.
        let mut ev = unsafe { ev.assume_init() };
        let kind = AsyncEventType(ev.event_type);
        // SAFETY: the union member matches the event type (ibv_get_async_event(3)); the
        // object cannot be destroyed before the event is acknowledged below.
        let element = unsafe {
            match kind.0 {
                ffi::IBV_EVENT_CQ_ERR => AsyncElement::Cq {
                    handle: (*ev.element.cq).handle,
                },
                ffi::IBV_EVENT_QP_FATAL
                | ffi::IBV_EVENT_QP_REQ_ERR
                | ffi::IBV_EVENT_QP_ACCESS_ERR
                | ffi::IBV_EVENT_COMM_EST
                | ffi::IBV_EVENT_SQ_DRAINED
                | ffi::IBV_EVENT_PATH_MIG
                | ffi::IBV_EVENT_PATH_MIG_ERR
                | ffi::IBV_EVENT_QP_LAST_WQE_REACHED => AsyncElement::Qp {
                    qp_num: (*ev.element.qp).qp_num,
                },
                ffi::IBV_EVENT_SRQ_ERR | ffi::IBV_EVENT_SRQ_LIMIT_REACHED => AsyncElement::Srq {
                    handle: (*ev.element.srq).handle,
                },
                ffi::IBV_EVENT_PORT_ACTIVE
                | ffi::IBV_EVENT_PORT_ERR
                | ffi::IBV_EVENT_LID_CHANGE
                | ffi::IBV_EVENT_PKEY_CHANGE
                | ffi::IBV_EVENT_SM_CHANGE
                | ffi::IBV_EVENT_CLIENT_REREGISTER
                | ffi::IBV_EVENT_GID_CHANGE => AsyncElement::Port {
                    port_num: ev.element.port_num as u8,
                },
                _ => AsyncElement::Device,
            }
        };
        // SAFETY: `ev` came from ibv_get_async_event and is acknowledged once.
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Ok(AsyncEvent {
            event_type: kind,
            element,
        })
    }
}

pub(crate) fn set_nonblocking(fd: RawFd, nonblocking: bool) -> Result<()> {
    // SAFETY: fcntl on an fd we borrow; F_GETFL/F_SETFL do not touch memory.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(Error::Io {
            context: "fcntl(F_GETFL)",
            source: std::io::Error::last_os_error(),
        });
    }
    let flags = if nonblocking {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        return Err(Error::Io {
            context: "fcntl(F_SETFL)",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// An async event (`struct ibv_async_event`), already acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// What happened.
    pub event_type: AsyncEventType,
    /// To which object.
    pub element: AsyncElement,
}

/// The object an [`AsyncEvent`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncElement {
    /// A queue pair, by number (compare with `QueuePair::qp_num`).
    Qp {
        /// QP number.
        qp_num: u32,
    },
    /// A completion queue, by kernel handle (`CompletionQueue::handle`).
    Cq {
        /// CQ handle.
        handle: u32,
    },
    /// A shared receive queue, by kernel handle (`SharedReceiveQueue::handle`).
    Srq {
        /// SRQ handle.
        handle: u32,
    },
    /// A port.
    Port {
        /// Port number.
        port_num: u8,
    },
    /// The whole device.
    Device,
}

c_newtype! {
    /// Async event type (`enum ibv_event_type`); unknown values are kept as they are.
    AsyncEventType(u32) {
        /// `IBV_EVENT_CQ_ERR`
        CQ_ERR = ffi::IBV_EVENT_CQ_ERR,
        /// `IBV_EVENT_QP_FATAL`
        QP_FATAL = ffi::IBV_EVENT_QP_FATAL,
        /// `IBV_EVENT_QP_REQ_ERR`
        QP_REQ_ERR = ffi::IBV_EVENT_QP_REQ_ERR,
        /// `IBV_EVENT_QP_ACCESS_ERR`
        QP_ACCESS_ERR = ffi::IBV_EVENT_QP_ACCESS_ERR,
        /// `IBV_EVENT_COMM_EST`
        COMM_EST = ffi::IBV_EVENT_COMM_EST,
        /// `IBV_EVENT_SQ_DRAINED`
        SQ_DRAINED = ffi::IBV_EVENT_SQ_DRAINED,
        /// `IBV_EVENT_PATH_MIG`
        PATH_MIG = ffi::IBV_EVENT_PATH_MIG,
        /// `IBV_EVENT_PATH_MIG_ERR`
        PATH_MIG_ERR = ffi::IBV_EVENT_PATH_MIG_ERR,
        /// `IBV_EVENT_DEVICE_FATAL`
        DEVICE_FATAL = ffi::IBV_EVENT_DEVICE_FATAL,
        /// `IBV_EVENT_PORT_ACTIVE`
        PORT_ACTIVE = ffi::IBV_EVENT_PORT_ACTIVE,
        /// `IBV_EVENT_PORT_ERR` (port down)
        PORT_ERR = ffi::IBV_EVENT_PORT_ERR,
        /// `IBV_EVENT_LID_CHANGE`
        LID_CHANGE = ffi::IBV_EVENT_LID_CHANGE,
        /// `IBV_EVENT_PKEY_CHANGE`
        PKEY_CHANGE = ffi::IBV_EVENT_PKEY_CHANGE,
        /// `IBV_EVENT_SM_CHANGE`
        SM_CHANGE = ffi::IBV_EVENT_SM_CHANGE,
        /// `IBV_EVENT_SRQ_ERR`
        SRQ_ERR = ffi::IBV_EVENT_SRQ_ERR,
        /// `IBV_EVENT_SRQ_LIMIT_REACHED`
        SRQ_LIMIT_REACHED = ffi::IBV_EVENT_SRQ_LIMIT_REACHED,
        /// `IBV_EVENT_QP_LAST_WQE_REACHED`
        QP_LAST_WQE_REACHED = ffi::IBV_EVENT_QP_LAST_WQE_REACHED,
        /// `IBV_EVENT_CLIENT_REREGISTER`
        CLIENT_REREGISTER = ffi::IBV_EVENT_CLIENT_REREGISTER,
        /// `IBV_EVENT_GID_CHANGE`
        GID_CHANGE = ffi::IBV_EVENT_GID_CHANGE,
        /// `IBV_EVENT_WQ_FATAL`
        WQ_FATAL = ffi::IBV_EVENT_WQ_FATAL,
    }
}

c_newtype! {
    /// Port state (`enum ibv_port_state`).
    PortState(u32) {
        /// `IBV_PORT_NOP`
        NOP = ffi::IBV_PORT_NOP,
        /// `IBV_PORT_DOWN`
        DOWN = ffi::IBV_PORT_DOWN,
        /// `IBV_PORT_INIT`
        INIT = ffi::IBV_PORT_INIT,
        /// `IBV_PORT_ARMED`
        ARMED = ffi::IBV_PORT_ARMED,
        /// `IBV_PORT_ACTIVE`
        ACTIVE = ffi::IBV_PORT_ACTIVE,
        /// `IBV_PORT_ACTIVE_DEFER`
        ACTIVE_DEFER = ffi::IBV_PORT_ACTIVE_DEFER,
    }
}

c_newtype! {
    /// Path MTU (`enum ibv_mtu`): 256 to 4096 bytes.
    Mtu(u32) {
        /// `IBV_MTU_256`
        MTU_256 = ffi::IBV_MTU_256,
        /// `IBV_MTU_512`
        MTU_512 = ffi::IBV_MTU_512,
        /// `IBV_MTU_1024`
        MTU_1024 = ffi::IBV_MTU_1024,
        /// `IBV_MTU_2048`
        MTU_2048 = ffi::IBV_MTU_2048,
        /// `IBV_MTU_4096`
        MTU_4096 = ffi::IBV_MTU_4096,
    }
}

impl Mtu {
    /// The MTU in bytes (0 for an unknown value).
    pub fn bytes(self) -> u32 {
        if (1..=5).contains(&self.0) {
            128 << self.0
        } else {
            0
        }
    }
}

c_newtype! {
    /// Link layer of a port (`IBV_LINK_LAYER_*`).
    LinkLayer(u8) {
        /// `IBV_LINK_LAYER_UNSPECIFIED`
        UNSPECIFIED = ffi::IBV_LINK_LAYER_UNSPECIFIED,
        /// `IBV_LINK_LAYER_INFINIBAND`
        INFINIBAND = ffi::IBV_LINK_LAYER_INFINIBAND,
        /// `IBV_LINK_LAYER_ETHERNET` (RoCE)
        ETHERNET = ffi::IBV_LINK_LAYER_ETHERNET,
    }
}

c_newtype! {
    /// GID type (`enum ibv_gid_type`).
    GidType(u32) {
        /// `IBV_GID_TYPE_IB`
        IB = ffi::IBV_GID_TYPE_IB,
        /// `IBV_GID_TYPE_ROCE_V1`
        ROCE_V1 = ffi::IBV_GID_TYPE_ROCE_V1,
        /// `IBV_GID_TYPE_ROCE_V2`
        ROCE_V2 = ffi::IBV_GID_TYPE_ROCE_V2,
    }
}

c_newtype! {
    /// Atomic operation support (`enum ibv_atomic_cap`).
    AtomicCap(u32) {
        /// `IBV_ATOMIC_NONE`
        NONE = ffi::IBV_ATOMIC_NONE,
        /// `IBV_ATOMIC_HCA`
        HCA = ffi::IBV_ATOMIC_HCA,
        /// `IBV_ATOMIC_GLOB`
        GLOB = ffi::IBV_ATOMIC_GLOB,
    }
}

/// IP address family, to pick a RoCE v2 GID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpFamily {
    /// IPv4 (an IPv4-mapped GID, `::ffff:a.b.c.d`).
    V4,
    /// IPv6.
    V6,
}

/// A 128-bit GID (`union ibv_gid`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Gid {
    /// The bytes, in network order.
    pub raw: [u8; 16],
}

impl Gid {
    /// Whether all bytes are zero (an empty table slot).
    pub fn is_zero(&self) -> bool {
        self.raw == [0; 16]
    }

    /// As an IPv6 address.
    pub fn to_ipv6(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.raw)
    }

    /// The IPv4 address of an IPv4-mapped GID.
    pub fn to_ipv4(&self) -> Option<Ipv4Addr> {
        self.to_ipv6().to_ipv4_mapped()
    }

    /// As an IP address (IPv4 when mapped).
    pub fn to_ip(&self) -> IpAddr {
        match self.to_ipv4() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(self.to_ipv6()),
        }
    }
}

impl From<ffi::ibv_gid> for Gid {
    fn from(g: ffi::ibv_gid) -> Self {
        // SAFETY: every bit pattern of the union is a valid byte array.
        let raw = unsafe { g.raw };
        Gid { raw }
    }
}

impl From<Gid> for ffi::ibv_gid {
    fn from(g: Gid) -> Self {
        ffi::ibv_gid { raw: g.raw }
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({})", self.to_ipv6())
    }
}

/// One GID table entry (`struct ibv_gid_entry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// The GID.
    pub gid: Gid,
    /// Its table index.
    pub gid_index: u32,
    /// Its port.
    pub port_num: u32,
    /// IB, RoCE v1 or RoCE v2.
    pub gid_type: GidType,
    /// The netdev's ifindex (RoCE).
    pub ndev_ifindex: u32,
}

impl From<ffi::ibv_gid_entry> for GidEntry {
    fn from(e: ffi::ibv_gid_entry) -> Self {
        GidEntry {
            gid: e.gid.into(),
            gid_index: e.gid_index,
            port_num: e.port_num,
            gid_type: GidType(e.gid_type),
            ndev_ifindex: e.ndev_ifindex,
        }
    }
}

/// Device attributes (`struct ibv_device_attr_ex`).
#[derive(Clone, Copy)]
pub struct DeviceAttr {
    raw: ffi::ibv_device_attr_ex,
}

impl fmt::Debug for DeviceAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceAttr")
            .field("max_qp", &self.max_qp())
            .field("max_qp_wr", &self.max_qp_wr())
            .field("max_cqe", &self.max_cqe())
            .field("max_sge", &self.max_sge())
            .field("atomic_cap", &self.atomic_cap())
            .field("phys_port_cnt", &self.phys_port_cnt())
            .finish_non_exhaustive()
    }
}

impl DeviceAttr {
    /// The C struct, for fields without an accessor.
    pub fn as_ffi(&self) -> &ffi::ibv_device_attr_ex {
        &self.raw
    }
    /// `max_qp`
    pub fn max_qp(&self) -> u32 {
        self.raw.orig_attr.max_qp as u32
    }
    /// `max_qp_wr`: work requests per queue.
    pub fn max_qp_wr(&self) -> u32 {
        self.raw.orig_attr.max_qp_wr as u32
    }
    /// `max_sge`
    pub fn max_sge(&self) -> u32 {
        self.raw.orig_attr.max_sge as u32
    }
    /// `max_cqe`
    pub fn max_cqe(&self) -> u32 {
        self.raw.orig_attr.max_cqe as u32
    }
    /// `max_mr_size`
    pub fn max_mr_size(&self) -> u64 {
        self.raw.orig_attr.max_mr_size
    }
    /// `max_qp_rd_atom`: outstanding RDMA READ/atomic per QP as target.
    pub fn max_qp_rd_atom(&self) -> u32 {
        self.raw.orig_attr.max_qp_rd_atom as u32
    }
    /// `max_qp_init_rd_atom`: outstanding RDMA READ/atomic per QP as initiator.
    pub fn max_qp_init_rd_atom(&self) -> u32 {
        self.raw.orig_attr.max_qp_init_rd_atom as u32
    }
    /// `max_srq` (0: no SRQ support).
    pub fn max_srq(&self) -> u32 {
        self.raw.orig_attr.max_srq as u32
    }
    /// `max_srq_wr`
    pub fn max_srq_wr(&self) -> u32 {
        self.raw.orig_attr.max_srq_wr as u32
    }
    /// `max_mw` (0: no memory windows).
    pub fn max_mw(&self) -> u32 {
        self.raw.orig_attr.max_mw as u32
    }
    /// `max_ah`
    pub fn max_ah(&self) -> u32 {
        self.raw.orig_attr.max_ah as u32
    }
    /// `atomic_cap`
    pub fn atomic_cap(&self) -> AtomicCap {
        AtomicCap(self.raw.orig_attr.atomic_cap)
    }
    /// `device_cap_flags` (`IBV_DEVICE_*`).
    pub fn device_cap_flags(&self) -> u32 {
        self.raw.orig_attr.device_cap_flags
    }
    /// `phys_port_cnt`
    pub fn phys_port_cnt(&self) -> u8 {
        self.raw.orig_attr.phys_port_cnt
    }
    /// `vendor_id`
    pub fn vendor_id(&self) -> u32 {
        self.raw.orig_attr.vendor_id
    }
    /// `completion_timestamp_mask` (0: no completion timestamps).
    pub fn completion_timestamp_mask(&self) -> u64 {
        self.raw.completion_timestamp_mask
    }
}

/// Port attributes (`struct ibv_port_attr`).
#[derive(Clone, Copy)]
pub struct PortAttr {
    raw: ffi::ibv_port_attr,
}

impl fmt::Debug for PortAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PortAttr")
            .field("state", &self.state())
            .field("active_mtu", &self.active_mtu())
            .field("lid", &self.lid())
            .field("link_layer", &self.link_layer())
            .field("gid_tbl_len", &self.gid_tbl_len())
            .finish_non_exhaustive()
    }
}

impl PortAttr {
    /// The C struct.
    pub fn as_ffi(&self) -> &ffi::ibv_port_attr {
        &self.raw
    }
    /// `state`
    pub fn state(&self) -> PortState {
        PortState(self.raw.state)
    }
    /// `active_mtu`
    pub fn active_mtu(&self) -> Mtu {
        Mtu(self.raw.active_mtu)
    }
    /// `max_mtu`
    pub fn max_mtu(&self) -> Mtu {
        Mtu(self.raw.max_mtu)
    }
    /// `lid` (0 on RoCE).
    pub fn lid(&self) -> u16 {
        self.raw.lid
    }
    /// `link_layer`
    pub fn link_layer(&self) -> LinkLayer {
        LinkLayer(self.raw.link_layer)
    }
    /// `gid_tbl_len`
    pub fn gid_tbl_len(&self) -> u32 {
        self.raw.gid_tbl_len as u32
    }
    /// `max_msg_sz`
    pub fn max_msg_sz(&self) -> u32 {
        self.raw.max_msg_sz
    }
}
