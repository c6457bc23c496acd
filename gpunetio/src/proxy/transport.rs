//! What the proxy needs of a network: register memory, describe it to the peer, post
//! one-sided writes, reads and 64-bit atomic adds, and report their completions.
//! Implemented over libfabric ([`super::FabricTransport`]) and ibverbs RC
//! ([`super::VerbsTransport`]).

use crate::error::{Error, Result};
use gpu_mem::DeviceBuffer;
use std::fmt;

/// Which transport a descriptor or connection blob belongs to (checked on decode: a
/// verbs key is meaningless to libfabric).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TransportKind(pub u8);

impl TransportKind {
    /// A libfabric endpoint.
    pub const FABRIC: Self = Self(1);
    /// An ibverbs RC queue pair.
    pub const VERBS: Self = Self(2);
}

/// How a peer reaches a registered region: base address, length and key. Serialised with
/// [`to_bytes`](Self::to_bytes) (versioned, little endian) and sent out of band;
/// [`from_bytes`](Self::from_bytes) refuses anything malformed with a typed error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteDescriptor {
    /// The transport the key belongs to.
    pub transport: TransportKind,
    /// Target address of byte 0 (a virtual address, or 0 where the transport addresses
    /// regions by offset).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub key: u64,
}

const DESC_MAGIC: [u8; 4] = *b"GIOD";
const DESC_VERSION: u8 = 1;

impl RemoteDescriptor {
    /// Size of the encoding.
    pub const WIRE_SIZE: usize = 32;

    /// `"GIOD"`, version, transport, two zero bytes, then `addr`, `len`, `key` as
    /// little-endian u64s.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_SIZE] {
        let mut b = [0u8; Self::WIRE_SIZE];
        b[..4].copy_from_slice(&DESC_MAGIC);
        b[4] = DESC_VERSION;
        b[5] = self.transport.0;
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.key.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes); anything else is [`Error::Malformed`].
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let bad = |reason: String| Error::Malformed {
            what: "remote memory descriptor",
            reason,
        };
        if b.len() != Self::WIRE_SIZE {
            return Err(bad(format!(
                "{} bytes, expected {}",
                b.len(),
                Self::WIRE_SIZE
            )));
        }
        if b[..4] != DESC_MAGIC {
            return Err(bad("no GIOD magic".into()));
        }
        if b[4] != DESC_VERSION {
            return Err(bad(format!(
                "version {}, this build reads {DESC_VERSION}",
                b[4]
            )));
        }
        let transport = TransportKind(b[5]);
        if transport != TransportKind::FABRIC && transport != TransportKind::VERBS {
            return Err(bad(format!("unknown transport {}", b[5])));
        }
        if b[6..8] != [0, 0] {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let d = RemoteDescriptor {
            transport,
            addr: word(8),
            len: word(16),
            key: word(24),
        };
        if d.addr.checked_add(d.len).is_none() {
            return Err(bad(format!("{:#x} + {} overflows", d.addr, d.len)));
        }
        Ok(d)
    }
}

/// One operation the proxy asks a transport to post. `wr_id` comes back in its
/// [`TransportCompletion`]; `slot` (below the window given to
/// [`Transport::prepare`]) names scratch memory the transport may use until then.
#[derive(Debug)]
pub enum WorkRequest<'a, R> {
    /// RDMA write of `len` bytes at `addr` (inside `local`) to `remote` + `offset`.
    Write {
        /// Completion id.
        wr_id: u64,
        /// The registration covering the source.
        local: &'a R,
        /// Source address (proxy-visible).
        addr: u64,
        /// Bytes.
        len: u64,
        /// Target region.
        remote: &'a RemoteDescriptor,
        /// Offset in it.
        offset: u64,
    },
    /// RDMA write of `len` (1..=8) bytes carried in the request.
    WriteInline {
        /// Completion id.
        wr_id: u64,
        /// The bytes (the first `len`).
        data: [u8; 8],
        /// How many.
        len: u8,
        /// Target region.
        remote: &'a RemoteDescriptor,
        /// Offset in it.
        offset: u64,
        /// Scratch slot.
        slot: usize,
    },
    /// RDMA read of `len` bytes at `remote` + `offset` into `addr` (inside `local`).
    Read {
        /// Completion id.
        wr_id: u64,
        /// The registration covering the destination.
        local: &'a R,
        /// Destination address.
        addr: u64,
        /// Bytes.
        len: u64,
        /// Source region.
        remote: &'a RemoteDescriptor,
        /// Offset in it.
        offset: u64,
    },
    /// Atomic add of `add` to the u64 at `remote` + `offset` (8-byte aligned).
    AtomicAdd {
        /// Completion id.
        wr_id: u64,
        /// Target region.
        remote: &'a RemoteDescriptor,
        /// Offset in it.
        offset: u64,
        /// The addend.
        add: u64,
        /// Scratch slot.
        slot: usize,
    },
}

/// The outcome of a posted [`WorkRequest`].
#[derive(Debug)]
pub struct TransportCompletion {
    /// The request's id.
    pub wr_id: u64,
    /// `Ok`, or the failure with whether it means the peer is gone.
    pub result: std::result::Result<(), TransportFailure>,
}

/// A failed operation.
#[derive(Debug)]
pub struct TransportFailure {
    /// The peer disconnected (flushed, retry exceeded, connection reset): the ring
    /// reports `GIO_ERR_PEER_GONE` rather than `GIO_ERR_TRANSPORT`.
    pub peer_gone: bool,
    /// The transport's error.
    pub error: Error,
}

impl fmt::Display for TransportFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}",
            self.error,
            if self.peer_gone { " (peer gone)" } else { "" }
        )
    }
}

/// Whether a post was taken or must be retried once completions are reaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posted {
    /// Posted.
    Yes,
    /// The transport's queue is full: reap completions and post again.
    Busy,
}

/// How the proxy asks for one request to be posted ([`Transport::post_with`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PostFlags {
    /// More requests follow at once (`FI_MORE`): the transport may hold this one back
    /// until the next post, or at the latest until its next [`poll`](Transport::poll).
    pub more: bool,
    /// No completion on success. Set only on an [`ordered`](Transport::ordered)
    /// transport: the next request posted with a completion covers this one. A failure
    /// is still reported, with this request's `wr_id`.
    pub unsignaled: bool,
}

/// A network the CPU proxy posts on. One proxy owns its transport; the proxy thread
/// (or the caller of `cpu_proxy_progress`) calls it from one thread at a time.
pub trait Transport: Send + 'static {
    /// A local registration (kept in the proxy's memory table).
    type Registration: Send + 'static;

    /// Which transport this is (stamped into descriptors).
    fn kind(&self) -> TransportKind;

    /// The out-of-band blob a peer passes to [`connect`](Self::connect).
    fn local_info(&self) -> Result<Vec<u8>>;

    /// Connects to the peer whose [`local_info`](Self::local_info) this is.
    fn connect(&mut self, peer_info: &[u8]) -> Result<()>;

    /// Sets up `window` scratch slots (8 bytes each) for inline data and atomic
    /// operands; called once, before anything is posted.
    fn prepare(&mut self, window: usize) -> Result<()>;

    /// Registers host memory for local and remote access.
    ///
    /// # Safety
    /// `[addr, addr + len)` is host memory of this process that stays allocated until the
    /// registration is dropped and every operation on it has completed.
    unsafe fn register_host(&mut self, addr: *mut u8, len: usize) -> Result<Self::Registration>;

    /// Registers device memory directly (GPUDirect RDMA: DMA-BUF, `FI_HMEM`), or
    /// [`Error::Unsupported`] where this transport cannot.
    fn register_device(&mut self, buf: &DeviceBuffer) -> Result<Self::Registration>;

    /// Registers `[addr, addr + len)` of GPU `device`'s memory directly (memory this
    /// crate did not allocate), or [`Error::Unsupported`] (the default).
    ///
    /// # Safety
    /// The range is device memory of that GPU that stays allocated until the
    /// registration is dropped and every operation on it has completed.
    unsafe fn register_device_range(
        &mut self,
        addr: u64,
        len: usize,
        device: usize,
    ) -> Result<Self::Registration> {
        let _ = (addr, len, device);
        Err(Error::Unsupported(
            "this transport registers only device buffers it is given".into(),
        ))
    }

    /// What the peer needs to target `reg`.
    fn descriptor(&self, reg: &Self::Registration) -> RemoteDescriptor;

    /// Posts one request.
    fn post(&mut self, wr: &WorkRequest<'_, Self::Registration>) -> Result<Posted>;

    /// Whether writes and atomic adds to the peer are *placed* in the order they were
    /// posted, whatever their size, and [`PostFlags::unsignaled`] is honoured. The proxy
    /// then posts a put's signal right behind its data (not after the data's
    /// completion), and asks a completion only of the last request of a batch: its
    /// delivery implies every write posted before it was delivered. Default: `false`.
    fn ordered(&self) -> bool {
        false
    }

    /// Posts one request with batching hints ([`PostFlags`]); the default ignores them
    /// and calls [`post`](Self::post).
    fn post_with(
        &mut self,
        wr: &WorkRequest<'_, Self::Registration>,
        flags: PostFlags,
    ) -> Result<Posted> {
        let _ = flags;
        self.post(wr)
    }

    /// Appends completions that arrived to `out`; an `Err` is a failure of the
    /// transport as a whole (not of one request).
    fn poll(&mut self, out: &mut Vec<TransportCompletion>) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trip_and_refusals() {
        let d = RemoteDescriptor {
            transport: TransportKind::VERBS,
            addr: 0x7f00_0000_1000,
            len: 4096,
            key: 0x1234,
        };
        let b = d.to_bytes();
        assert_eq!(RemoteDescriptor::from_bytes(&b).unwrap(), d);
        let refused = |b: &[u8]| {
            matches!(
                RemoteDescriptor::from_bytes(b),
                Err(Error::Malformed { .. })
            )
        };
        assert!(refused(&b[..31]));
        let mut x = b;
        x[0] = b'X';
        assert!(refused(&x));
        let mut x = b;
        x[4] = 2;
        assert!(refused(&x));
        let mut x = b;
        x[5] = 9;
        assert!(refused(&x));
        let mut x = b;
        x[7] = 1;
        assert!(refused(&x));
        let mut x = b;
        x[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(refused(&x));
    }
}
