//! Discovery: `fi_getinfo` with a hints builder, and the typed attributes of each result.

use crate::error::{cvt, Error, Result};
use crate::ffi;
use std::ffi::{c_char, CStr, CString};
use std::fmt;
use std::ptr;

bitflags::bitflags! {
    /// Capabilities (`fi_info::caps`) and the operation/completion flags that share their
    /// bits.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Caps: u64 {
        /// `FI_MSG`: send/receive messaging.
        const MSG = ffi::FI_MSG;
        /// `FI_RMA`: remote memory access (read/write).
        const RMA = ffi::FI_RMA;
        /// `FI_TAGGED`: tagged messaging.
        const TAGGED = ffi::FI_TAGGED;
        /// `FI_ATOMIC`: remote atomics.
        const ATOMIC = ffi::FI_ATOMIC;
        /// `FI_MULTICAST`.
        const MULTICAST = ffi::FI_MULTICAST;
        /// `FI_COLLECTIVE`.
        const COLLECTIVE = ffi::FI_COLLECTIVE;
        /// `FI_READ`: initiate reads.
        const READ = ffi::FI_READ;
        /// `FI_WRITE`: initiate writes.
        const WRITE = ffi::FI_WRITE;
        /// `FI_RECV`: receive.
        const RECV = ffi::FI_RECV;
        /// `FI_SEND`: send.
        const SEND = ffi::FI_SEND;
        /// `FI_REMOTE_READ`: be the target of reads.
        const REMOTE_READ = ffi::FI_REMOTE_READ;
        /// `FI_REMOTE_WRITE`: be the target of writes.
        const REMOTE_WRITE = ffi::FI_REMOTE_WRITE;
        /// `FI_MULTI_RECV`.
        const MULTI_RECV = ffi::FI_MULTI_RECV;
        /// `FI_REMOTE_CQ_DATA` (a completion flag).
        const REMOTE_CQ_DATA = ffi::FI_REMOTE_CQ_DATA;
        /// `FI_TRIGGER`: triggered operations.
        const TRIGGER = ffi::FI_TRIGGER;
        /// `FI_FENCE`.
        const FENCE = ffi::FI_FENCE;
        /// `FI_HMEM`: device (GPU) memory.
        const HMEM = ffi::FI_HMEM;
        /// `FI_RMA_PMEM`.
        const RMA_PMEM = ffi::FI_RMA_PMEM;
        /// `FI_SOURCE`: source addresses on receive completions.
        const SOURCE = ffi::FI_SOURCE;
        /// `FI_SOURCE_ERR`.
        const SOURCE_ERR = ffi::FI_SOURCE_ERR;
        /// `FI_LOCAL_COMM`: talk to peers on this node.
        const LOCAL_COMM = ffi::FI_LOCAL_COMM;
        /// `FI_REMOTE_COMM`: talk to peers on other nodes.
        const REMOTE_COMM = ffi::FI_REMOTE_COMM;
        /// `FI_SHARED_AV`.
        const SHARED_AV = ffi::FI_SHARED_AV;
        /// `FI_RMA_EVENT`: counters/completions for remote RMA.
        const RMA_EVENT = ffi::FI_RMA_EVENT;
        /// `FI_NAMED_RX_CTX`.
        const NAMED_RX_CTX = ffi::FI_NAMED_RX_CTX;
        /// `FI_DIRECTED_RECV`.
        const DIRECTED_RECV = ffi::FI_DIRECTED_RECV;
        /// `FI_VARIABLE_MSG`.
        const VARIABLE_MSG = ffi::FI_VARIABLE_MSG;
        /// `FI_AV_USER_ID`.
        const AV_USER_ID = ffi::FI_AV_USER_ID;
        /// Bits this crate does not name.
        const _ = !0;
    }
}

bitflags::bitflags! {
    /// Operational mode bits (`fi_info::mode`): requirements the application accepts.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Mode: u64 {
        /// `FI_CONTEXT`.
        const CONTEXT = ffi::FI_CONTEXT;
        /// `FI_CONTEXT2`.
        const CONTEXT2 = ffi::FI_CONTEXT2;
        /// `FI_MSG_PREFIX`.
        const MSG_PREFIX = ffi::FI_MSG_PREFIX;
        /// `FI_ASYNC_IOV`.
        const ASYNC_IOV = ffi::FI_ASYNC_IOV;
        /// `FI_RX_CQ_DATA`: remote CQ data consumes a posted receive.
        const RX_CQ_DATA = ffi::FI_RX_CQ_DATA;
        /// `FI_LOCAL_MR` (old name of `FI_MR_LOCAL`).
        const LOCAL_MR = ffi::FI_LOCAL_MR;
        /// Bits this crate does not name.
        const _ = !0;
    }
}

bitflags::bitflags! {
    /// Memory-registration mode bits (`fi_domain_attr::mr_mode`): what the provider
    /// requires of registrations. See [`crate::MemoryRegion`] for how each is honoured.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct MrMode: i32 {
        /// `FI_MR_LOCAL`: local buffers must be registered; pass their descriptors.
        const LOCAL = ffi::FI_MR_LOCAL;
        /// `FI_MR_RAW`: keys larger than 64 bits (not supported by this crate).
        const RAW = ffi::FI_MR_RAW;
        /// `FI_MR_VIRT_ADDR`: remote addresses are virtual addresses, not offsets.
        const VIRT_ADDR = ffi::FI_MR_VIRT_ADDR;
        /// `FI_MR_ALLOCATED`: only allocated (backed) memory may be registered.
        const ALLOCATED = ffi::FI_MR_ALLOCATED;
        /// `FI_MR_PROV_KEY`: the provider chooses keys.
        const PROV_KEY = ffi::FI_MR_PROV_KEY;
        /// `FI_MR_MMU_NOTIFY`.
        const MMU_NOTIFY = ffi::FI_MR_MMU_NOTIFY;
        /// `FI_MR_RMA_EVENT`.
        const RMA_EVENT = ffi::FI_MR_RMA_EVENT;
        /// `FI_MR_ENDPOINT`: regions are bound to an endpoint and enabled.
        const ENDPOINT = ffi::FI_MR_ENDPOINT;
        /// `FI_MR_HMEM`: device memory must be registered.
        const HMEM = ffi::FI_MR_HMEM;
        /// `FI_MR_COLLECTIVE`.
        const COLLECTIVE = ffi::FI_MR_COLLECTIVE;
        /// Bits this crate does not name.
        const _ = !0;
    }
}

impl MrMode {
    /// Every bit this crate honours: the default `mr_mode` of [`InfoBuilder`].
    pub const SUPPORTED: MrMode = MrMode::LOCAL
        .union(MrMode::VIRT_ADDR)
        .union(MrMode::ALLOCATED)
        .union(MrMode::PROV_KEY)
        .union(MrMode::ENDPOINT)
        .union(MrMode::HMEM);
}

macro_rules! c_value {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $value:expr),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(transparent)]
        pub struct $name(pub u32);
        impl $name {
            $($(#[$vmeta])* pub const $variant: $name = $name($value);)*
        }
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match *self {
                    $($name::$variant => f.write_str(stringify!($variant)),)*
                    $name(other) => write!(f, "{}({})", stringify!($name), other),
                }
            }
        }
    };
}

c_value!(
    /// `enum fi_ep_type` (a value the library returns: unknown values are kept).
    EndpointType {
        /// `FI_EP_UNSPEC`.
        UNSPEC = ffi::FI_EP_UNSPEC,
        /// `FI_EP_MSG`: connected, reliable.
        MSG = ffi::FI_EP_MSG,
        /// `FI_EP_DGRAM`: unreliable datagrams.
        DGRAM = ffi::FI_EP_DGRAM,
        /// `FI_EP_RDM`: reliable datagrams (connectionless, with an address vector).
        RDM = ffi::FI_EP_RDM,
    }
);

c_value!(
    /// `enum fi_threading`.
    Threading {
        /// `FI_THREAD_UNSPEC`.
        UNSPEC = ffi::FI_THREAD_UNSPEC,
        /// `FI_THREAD_SAFE`: every object may be used from any thread.
        SAFE = ffi::FI_THREAD_SAFE,
        /// `FI_THREAD_FID`.
        FID = ffi::FI_THREAD_FID,
        /// `FI_THREAD_DOMAIN`.
        DOMAIN = ffi::FI_THREAD_DOMAIN,
        /// `FI_THREAD_COMPLETION`.
        COMPLETION = ffi::FI_THREAD_COMPLETION,
        /// `FI_THREAD_ENDPOINT`.
        ENDPOINT = ffi::FI_THREAD_ENDPOINT,
    }
);

c_value!(
    /// `enum fi_progress`.
    Progress {
        /// `FI_PROGRESS_UNSPEC`.
        UNSPEC = ffi::FI_PROGRESS_UNSPEC,
        /// `FI_PROGRESS_AUTO`: the provider progresses by itself.
        AUTO = ffi::FI_PROGRESS_AUTO,
        /// `FI_PROGRESS_MANUAL`: the application must call into the provider (this crate
        /// does: see [`crate::Domain`]).
        MANUAL = ffi::FI_PROGRESS_MANUAL,
    }
);

c_value!(
    /// The address formats (`FI_FORMAT_UNSPEC`, `FI_SOCKADDR_IN`, …).
    AddressFormat {
        /// `FI_FORMAT_UNSPEC`.
        UNSPEC = ffi::FI_FORMAT_UNSPEC,
        /// `FI_SOCKADDR`.
        SOCKADDR = ffi::FI_SOCKADDR,
        /// `FI_SOCKADDR_IN`.
        SOCKADDR_IN = ffi::FI_SOCKADDR_IN,
        /// `FI_SOCKADDR_IN6`.
        SOCKADDR_IN6 = ffi::FI_SOCKADDR_IN6,
        /// `FI_SOCKADDR_IB`.
        SOCKADDR_IB = ffi::FI_SOCKADDR_IB,
        /// `FI_ADDR_STR`.
        STR = ffi::FI_ADDR_STR,
    }
);

/// The libfabric runtime's version as `(major, minor)` (`fi_version()`).
#[doc(alias = "fi_version")]
pub fn version() -> (u32, u32) {
    // SAFETY: fi_version has no preconditions.
    let v = unsafe { ffi::fi_version() };
    (ffi::FI_MAJOR(v), ffi::FI_MINOR(v))
}

/// The oldest libfabric runtime this crate supports.
pub const MIN_VERSION: (u32, u32) = (1, 17);

/// Fails with [`Error::Unsupported`] if the runtime library is older than [`MIN_VERSION`].
pub fn check_version() -> Result<()> {
    let (major, minor) = version();
    if (major, minor) < MIN_VERSION {
        return Err(Error::Unsupported {
            call: "fi_version",
            errno: ffi::FI_ENOSYS,
            detail: format!(
                "libfabric {major}.{minor} is older than {}.{}",
                MIN_VERSION.0, MIN_VERSION.1
            ),
        });
    }
    Ok(())
}

/// Hints for [`Info`] discovery (`fi_getinfo`), built over a zeroed `fi_info` from
/// `fi_allocinfo`. Setters are named after the C fields.
///
/// Defaults chosen for this crate: `threading = FI_THREAD_SAFE` (objects are `Send + Sync`),
/// `mr_mode` = [`MrMode::SUPPORTED`], `mode = 0` (contexts are plain values).
///
/// ```no_run
/// use fabric::{Caps, EndpointType, InfoBuilder};
/// let infos = InfoBuilder::new()
///     .provider("tcp;ofi_rxm")
///     .ep_type(EndpointType::RDM)
///     .caps(Caps::MSG | Caps::RMA)
///     .node("127.0.0.1")
///     .source(true)
///     .get()?;
/// for info in &infos {
///     println!("{} {:?}", info.provider_name(), info.caps());
/// }
/// # Ok::<(), fabric::Error>(())
/// ```
#[derive(Debug)]
pub struct InfoBuilder {
    hints: *mut ffi::fi_info,
    node: Option<CString>,
    service: Option<CString>,
    flags: u64,
    version: u32,
}

// SAFETY: the builder exclusively owns its fi_info allocation; nothing else refers to it.
unsafe impl Send for InfoBuilder {}

impl Default for InfoBuilder {
    fn default() -> Self {
        Self::new()
    }
}

fn strdup(s: &str) -> *mut c_char {
    let c = CString::new(s).unwrap_or_default();
    // SAFETY: c is a valid NUL-terminated string; the copy is malloc'd as fi_freeinfo expects.
    unsafe { libc::strdup(c.as_ptr()) }
}

impl InfoBuilder {
    /// Empty hints with this crate's defaults.
    #[doc(alias = "fi_allocinfo")]
    pub fn new() -> Self {
        // SAFETY: fi_allocinfo has no preconditions; the result is owned by the builder.
        let hints = unsafe { ffi::fi_allocinfo() };
        assert!(!hints.is_null(), "fi_allocinfo: out of memory");
        let builder = InfoBuilder {
            hints,
            node: None,
            service: None,
            flags: 0,
            version: ffi::FI_VERSION_BINDINGS,
        };
        builder
            .threading(Threading::SAFE)
            .mr_mode(MrMode::SUPPORTED)
    }

    fn info(&mut self) -> &mut ffi::fi_info {
        // SAFETY: hints is a valid, exclusively owned fi_info for the builder's lifetime.
        unsafe { &mut *self.hints }
    }

    /// Required capabilities (`caps`).
    pub fn caps(mut self, caps: Caps) -> Self {
        self.info().caps = caps.bits();
        self
    }

    /// Modes the application supports (`mode`).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.info().mode = mode.bits();
        self
    }

    /// Endpoint type (`ep_attr->type`).
    pub fn ep_type(mut self, ty: EndpointType) -> Self {
        // SAFETY: fi_allocinfo allocated ep_attr.
        unsafe { (*self.info().ep_attr).type_ = ty.0 };
        self
    }

    /// Address format (`addr_format`).
    pub fn addr_format(mut self, format: AddressFormat) -> Self {
        self.info().addr_format = format.0;
        self
    }

    /// `mr_mode` bits the application is able to honour (`domain_attr->mr_mode`).
    pub fn mr_mode(mut self, mode: MrMode) -> Self {
        // SAFETY: fi_allocinfo allocated domain_attr.
        unsafe { (*self.info().domain_attr).mr_mode = mode.bits() };
        self
    }

    /// Threading level (`domain_attr->threading`). This crate shares objects across
    /// threads and accepts only [`Threading::SAFE`] when a domain is opened.
    pub fn threading(mut self, threading: Threading) -> Self {
        // SAFETY: fi_allocinfo allocated domain_attr.
        unsafe { (*self.info().domain_attr).threading = threading.0 };
        self
    }

    /// Data progress model (`domain_attr->data_progress`).
    pub fn data_progress(mut self, progress: Progress) -> Self {
        // SAFETY: fi_allocinfo allocated domain_attr.
        unsafe { (*self.info().domain_attr).data_progress = progress.0 };
        self
    }

    /// Control progress model (`domain_attr->control_progress`).
    pub fn control_progress(mut self, progress: Progress) -> Self {
        // SAFETY: fi_allocinfo allocated domain_attr.
        unsafe { (*self.info().domain_attr).control_progress = progress.0 };
        self
    }

    /// Provider name (`fabric_attr->prov_name`), e.g. `"tcp;ofi_rxm"`.
    pub fn provider(mut self, name: &str) -> Self {
        // SAFETY: fi_allocinfo allocated fabric_attr; the old value (malloc'd or NULL) is freed.
        unsafe {
            let attr = &mut *self.info().fabric_attr;
            libc::free(attr.prov_name.cast());
            attr.prov_name = strdup(name);
        }
        self
    }

    /// Fabric name (`fabric_attr->name`).
    pub fn fabric_name(mut self, name: &str) -> Self {
        // SAFETY: as in `provider`.
        unsafe {
            let attr = &mut *self.info().fabric_attr;
            libc::free(attr.name.cast());
            attr.name = strdup(name);
        }
        self
    }

    /// Domain name (`domain_attr->name`), e.g. an interface.
    pub fn domain_name(mut self, name: &str) -> Self {
        // SAFETY: as in `provider`.
        unsafe {
            let attr = &mut *self.info().domain_attr;
            libc::free(attr.name.cast());
            attr.name = strdup(name);
        }
        self
    }

    /// Default operation flags of the transmit context (`tx_attr->op_flags`), e.g.
    /// `FI_DELIVERY_COMPLETE`.
    pub fn tx_op_flags(mut self, flags: u64) -> Self {
        // SAFETY: fi_allocinfo allocated tx_attr.
        unsafe { (*self.info().tx_attr).op_flags = flags };
        self
    }

    /// Transmit contexts of a scalable endpoint (`ep_attr->tx_ctx_cnt`).
    pub fn tx_ctx_cnt(mut self, count: usize) -> Self {
        // SAFETY: fi_allocinfo allocated ep_attr.
        unsafe { (*self.info().ep_attr).tx_ctx_cnt = count };
        self
    }

    /// Receive contexts of a scalable endpoint (`ep_attr->rx_ctx_cnt`).
    pub fn rx_ctx_cnt(mut self, count: usize) -> Self {
        // SAFETY: fi_allocinfo allocated ep_attr.
        unsafe { (*self.info().ep_attr).rx_ctx_cnt = count };
        self
    }

    /// Transmit queue depth (`tx_attr->size`).
    pub fn tx_size(mut self, size: usize) -> Self {
        // SAFETY: fi_allocinfo allocated tx_attr.
        unsafe { (*self.info().tx_attr).size = size };
        self
    }

    /// Message ordering required (`tx_attr->msg_order` and `rx_attr->msg_order`).
    pub fn msg_order(mut self, order: u64) -> Self {
        // SAFETY: fi_allocinfo allocated tx_attr and rx_attr.
        unsafe {
            (*self.info().tx_attr).msg_order = order;
            (*self.info().rx_attr).msg_order = order;
        }
        self
    }

    /// The node (host name or address) passed to `fi_getinfo`.
    pub fn node(mut self, node: &str) -> Self {
        self.node = Some(CString::new(node).unwrap_or_default());
        self
    }

    /// The service (port) passed to `fi_getinfo`.
    pub fn service(mut self, service: &str) -> Self {
        self.service = Some(CString::new(service).unwrap_or_default());
        self
    }

    /// `FI_SOURCE`: node/service name the local (source) address instead of the peer.
    pub fn source(mut self, source: bool) -> Self {
        if source {
            self.flags |= ffi::FI_SOURCE;
        } else {
            self.flags &= !ffi::FI_SOURCE;
        }
        self
    }

    /// The API version asked for (default: the bindings' version, 1.17). Structures
    /// returned by the library have the layout of that version.
    pub fn api_version(mut self, major: u32, minor: u32) -> Self {
        self.version = ffi::FI_VERSION(major, minor);
        self
    }

    /// Runs `fi_getinfo` and returns every match, best first.
    ///
    /// No match is [`Error::Unsupported`] (`FI_ENODATA`): the provider does not offer what
    /// the hints ask for.
    #[doc(alias = "fi_getinfo")]
    pub fn get(&self) -> Result<Vec<Info>> {
        check_version()?;
        let mut list = ptr::null_mut();
        // SAFETY: hints is a valid fi_info; node/service are NUL-terminated or NULL; list
        // receives a list owned by us and freed below.
        let ret = unsafe {
            ffi::fi_getinfo(
                self.version,
                self.node.as_ref().map_or(ptr::null(), |n| n.as_ptr()),
                self.service.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
                self.flags,
                self.hints,
                &mut list,
            )
        };
        if ret == -ffi::FI_ENODATA {
            return Err(Error::Unsupported {
                call: "fi_getinfo",
                errno: ffi::FI_ENODATA,
                detail: format!("no provider matches the hints: {}", self.describe()),
            });
        }
        cvt("fi_getinfo", ret).map_err(|e| e.context(|| self.describe()))?;
        let mut out = Vec::new();
        let mut cur = list;
        while !cur.is_null() {
            // SAFETY: cur is an entry of the list fi_getinfo returned.
            let dup = unsafe { ffi::fi_dupinfo(cur) };
            if dup.is_null() {
                // SAFETY: list came from fi_getinfo and is freed once.
                unsafe { ffi::fi_freeinfo(list) };
                return Err(Error::from_errno(
                    "fi_dupinfo",
                    ffi::FI_ENOMEM,
                    String::new(),
                ));
            }
            // SAFETY: dup is a fresh single fi_info; its `next` is not ours to follow.
            unsafe { (*dup).next = ptr::null_mut() };
            out.push(Info { raw: dup });
            // SAFETY: cur is a valid entry.
            cur = unsafe { (*cur).next };
        }
        // SAFETY: list came from fi_getinfo and is freed once.
        unsafe { ffi::fi_freeinfo(list) };
        Ok(out)
    }

    /// The first match of [`get`](Self::get).
    pub fn get_first(&self) -> Result<Info> {
        self.get()?
            .into_iter()
            .next()
            .ok_or_else(|| Error::Unsupported {
                call: "fi_getinfo",
                errno: ffi::FI_ENODATA,
                detail: format!("no provider matches the hints: {}", self.describe()),
            })
    }

    fn describe(&self) -> String {
        // SAFETY: hints is valid; its attr pointers were allocated by fi_allocinfo.
        unsafe {
            let h = &*self.hints;
            let prov = cstr_opt((*h.fabric_attr).prov_name).unwrap_or("any");
            format!(
                "provider {prov}, ep_type {:?}, caps {:?}, mode {:?}, node {:?}",
                EndpointType((*h.ep_attr).type_),
                Caps::from_bits_retain(h.caps),
                Mode::from_bits_retain(h.mode),
                self.node
            )
        }
    }
}

impl Drop for InfoBuilder {
    fn drop(&mut self) {
        // SAFETY: hints came from fi_allocinfo and is freed once.
        unsafe { ffi::fi_freeinfo(self.hints) };
    }
}

/// SAFETY: `p` is NULL or a NUL-terminated string that outlives the result.
unsafe fn cstr_opt<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        None
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { CStr::from_ptr(p) }.to_str().ok()
    }
}

/// One discovery result (`struct fi_info`), owned (a `fi_dupinfo` copy, freed on drop).
pub struct Info {
    raw: *mut ffi::fi_info,
}

// SAFETY: an Info is an exclusively owned heap copy that this crate never mutates after
// discovery; libfabric only reads it.
unsafe impl Send for Info {}
// SAFETY: as above: shared access is read-only.
unsafe impl Sync for Info {}

impl Clone for Info {
    fn clone(&self) -> Self {
        // SAFETY: raw is a valid fi_info.
        let raw = unsafe { ffi::fi_dupinfo(self.raw) };
        assert!(!raw.is_null(), "fi_dupinfo: out of memory");
        Info { raw }
    }
}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: raw was allocated by fi_dupinfo and is freed once.
        unsafe { ffi::fi_freeinfo(self.raw) };
    }
}

impl fmt::Debug for Info {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Info")
            .field("provider", &self.provider_name())
            .field("fabric", &self.fabric_name())
            .field("domain", &self.domain_name())
            .field("ep_type", &self.ep_type())
            .field("caps", &self.caps())
            .field("mr_mode", &self.mr_mode())
            .finish()
    }
}

impl fmt::Display for Info {
    /// `fi_tostr(FI_TYPE_INFO)`: the same text `fi_info -v` prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: raw is a valid fi_info; fi_tostr returns a thread-local NUL-terminated
        // buffer, copied before anything else calls it.
        let text = unsafe {
            let p = ffi::fi_tostr(self.raw.cast(), ffi::FI_TYPE_INFO);
            cstr_opt(p).unwrap_or("").to_owned()
        };
        f.write_str(&text)
    }
}

impl Info {
    fn info(&self) -> &ffi::fi_info {
        // SAFETY: raw is valid for self's lifetime.
        unsafe { &*self.raw }
    }
    fn domain_attr(&self) -> &ffi::fi_domain_attr {
        // SAFETY: fi_getinfo results always carry a domain_attr.
        unsafe { &*self.info().domain_attr }
    }
    fn ep_attr(&self) -> &ffi::fi_ep_attr {
        // SAFETY: fi_getinfo results always carry an ep_attr.
        unsafe { &*self.info().ep_attr }
    }
    fn tx_attr(&self) -> &ffi::fi_tx_attr {
        // SAFETY: fi_getinfo results always carry a tx_attr.
        unsafe { &*self.info().tx_attr }
    }
    fn fabric_attr(&self) -> &ffi::fi_fabric_attr {
        // SAFETY: fi_getinfo results always carry a fabric_attr.
        unsafe { &*self.info().fabric_attr }
    }

    /// The raw `fi_info` (valid while `self` lives).
    pub fn as_raw(&self) -> *mut ffi::fi_info {
        self.raw
    }

    /// Takes ownership of a single `fi_info`.
    ///
    /// # Safety
    /// `raw` must be a valid `fi_info` allocated by libfabric, owned by nobody else
    /// (it is freed with `fi_freeinfo` on drop); its `next` list is freed with it.
    pub unsafe fn from_raw(raw: *mut ffi::fi_info) -> Self {
        Info { raw }
    }

    /// Capabilities (`caps`).
    pub fn caps(&self) -> Caps {
        Caps::from_bits_retain(self.info().caps)
    }
    /// Modes the provider requires (`mode`).
    pub fn mode(&self) -> Mode {
        Mode::from_bits_retain(self.info().mode)
    }
    /// Endpoint type.
    pub fn ep_type(&self) -> EndpointType {
        EndpointType(self.ep_attr().type_)
    }
    /// Address format.
    pub fn addr_format(&self) -> AddressFormat {
        AddressFormat(self.info().addr_format)
    }
    /// The `mr_mode` bits the provider requires.
    pub fn mr_mode(&self) -> MrMode {
        MrMode::from_bits_retain(self.domain_attr().mr_mode)
    }
    /// Threading level.
    pub fn threading(&self) -> Threading {
        Threading(self.domain_attr().threading)
    }
    /// Data progress model.
    pub fn data_progress(&self) -> Progress {
        Progress(self.domain_attr().data_progress)
    }
    /// Control progress model.
    pub fn control_progress(&self) -> Progress {
        Progress(self.domain_attr().control_progress)
    }
    /// Provider name, e.g. `"tcp;ofi_rxm"`.
    pub fn provider_name(&self) -> &str {
        // SAFETY: the string lives as long as the fi_info.
        unsafe { cstr_opt(self.fabric_attr().prov_name) }.unwrap_or("")
    }
    /// Provider version as `(major, minor)`.
    pub fn provider_version(&self) -> (u32, u32) {
        let v = self.fabric_attr().prov_version;
        (ffi::FI_MAJOR(v), ffi::FI_MINOR(v))
    }
    /// Fabric name.
    pub fn fabric_name(&self) -> &str {
        // SAFETY: the string lives as long as the fi_info.
        unsafe { cstr_opt(self.fabric_attr().name) }.unwrap_or("")
    }
    /// Domain name.
    pub fn domain_name(&self) -> &str {
        // SAFETY: the string lives as long as the fi_info.
        unsafe { cstr_opt(self.domain_attr().name) }.unwrap_or("")
    }
    /// Largest message (`ep_attr->max_msg_size`).
    pub fn max_msg_size(&self) -> usize {
        self.ep_attr().max_msg_size
    }
    /// Largest inject (`tx_attr->inject_size`).
    pub fn inject_size(&self) -> usize {
        self.tx_attr().inject_size
    }
    /// Bytes of remote CQ data (`domain_attr->cq_data_size`).
    pub fn cq_data_size(&self) -> usize {
        self.domain_attr().cq_data_size
    }
    /// Size of memory keys (`domain_attr->mr_key_size`).
    pub fn mr_key_size(&self) -> usize {
        self.domain_attr().mr_key_size
    }
    /// Transmit contexts (`ep_attr->tx_ctx_cnt`; scalable endpoints).
    pub fn tx_ctx_cnt(&self) -> usize {
        self.ep_attr().tx_ctx_cnt
    }
    /// Receive contexts (`ep_attr->rx_ctx_cnt`; scalable endpoints).
    pub fn rx_ctx_cnt(&self) -> usize {
        self.ep_attr().rx_ctx_cnt
    }
    /// Transmit queue depth (`tx_attr->size`).
    pub fn tx_size(&self) -> usize {
        self.tx_attr().size
    }
    /// Default transmit op flags (`tx_attr->op_flags`).
    pub fn tx_op_flags(&self) -> u64 {
        self.tx_attr().op_flags
    }
    /// Ordering of transmitted operations the provider granted (`tx_attr->msg_order`,
    /// `FI_ORDER_*` bits).
    pub fn tx_msg_order(&self) -> u64 {
        self.tx_attr().msg_order
    }
    /// Largest write-after-write whose *data* is placed in order
    /// (`ep_attr->max_order_waw_size`; beyond it only the operations' start is
    /// ordered; `usize::MAX`: any size).
    pub fn max_order_waw_size(&self) -> usize {
        self.ep_attr().max_order_waw_size
    }
    /// The source address, as bytes.
    pub fn src_addr(&self) -> Option<&[u8]> {
        let i = self.info();
        (!i.src_addr.is_null()).then(|| {
            // SAFETY: src_addr points to src_addrlen bytes owned by the fi_info.
            unsafe { std::slice::from_raw_parts(i.src_addr.cast::<u8>(), i.src_addrlen) }
        })
    }
    /// The destination address, as bytes.
    pub fn dest_addr(&self) -> Option<&[u8]> {
        let i = self.info();
        (!i.dest_addr.is_null()).then(|| {
            // SAFETY: dest_addr points to dest_addrlen bytes owned by the fi_info.
            unsafe { std::slice::from_raw_parts(i.dest_addr.cast::<u8>(), i.dest_addrlen) }
        })
    }
}
