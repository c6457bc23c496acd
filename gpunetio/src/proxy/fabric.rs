//! The proxy over a libfabric RDM endpoint: `fi_write` / `fi_read` on registered
//! memory, `fi_atomic` (`FI_SUM`, `FI_UINT64`) for signals.
//!
//! Inline puts are written from a registered 8-byte scratch word with a completion
//! rather than `fi_inject_write`: an inject reports no completion, so the proxy could
//! neither advance `ctrl.completed` truthfully nor order a following signal after it.
//!
//! # Batching
//! Writes and atomics are posted with `fi_writemsg` / `fi_atomicmsg`: `FI_MORE` while
//! the proxy has more to post in the same round, `FI_DELIVERY_COMPLETE` always. A
//! transport opened with [`FabricTransport::new_ordered`] asks for `FI_ORDER_WAW`; where
//! the provider grants it for data of any size (`max_order_waw_size` = `SIZE_MAX`: shm
//! does, processing one command queue per peer in order; `tcp;ofi_rxm` grants no
//! write-after-write ordering between RMA and atomics) it is
//! [`ordered`](Transport::ordered): the completion queue is bound with
//! `FI_SELECTIVE_COMPLETION`, a request in the middle of a batch is posted without
//! `FI_COMPLETION`, and the delivery of the batch's last request stands for all of them.
//! Failures are reported whatever the flags. The price: shm then queues every write for
//! the target to apply (its target must progress), where unordered it writes into the
//! peer's memory itself (CMA).

use super::transport::{
    PostFlags, Posted, RemoteDescriptor, Transport, TransportCompletion, TransportFailure,
    TransportKind, WorkRequest,
};
use crate::error::{Error, Result};
use fabric::ffi;
use fabric::{
    Access, Address, AddressVector, AtomicDatatype, AtomicOp, AvType, Caps, Completion,
    CompletionQueue, Domain, Endpoint, EndpointBuilder, EndpointType, Fabric, HmemIface, Info,
    InfoBuilder, MemoryRegion,
};
use gpu_mem::DeviceBuffer;

fn fab(context: impl Into<String>) -> impl FnOnce(fabric::Error) -> Error {
    let context = context.into();
    move |source| Error::Fabric { context, source }
}

/// A registration of local memory with the endpoint's domain.
#[derive(Debug)]
pub struct FabricRegistration {
    mr: MemoryRegion,
}

/// Registered 8-byte operands: two words per window slot (an inline put's data and its
/// signal's addend are in flight together on an ordered transport). A word is written
/// only when its ticket's entry is taken, and the proxy takes ticket `t + window` only
/// once `t` retired, so no operation still reads it.
struct Scratch {
    // Field order is drop order: the registration before the memory.
    mr: MemoryRegion,
    words: Box<[u64]>,
}

// SAFETY: the words are written only by the proxy thread that owns the transport, and
// read by the provider under the protocol above.
unsafe impl Send for Scratch {}

/// A libfabric RDM endpoint as a proxy transport.
pub struct FabricTransport {
    info: Info,
    // Field order is drop order: the scratch registration and the endpoint before its
    // queues and domain (each also holds its parents through Arc).
    scratch: Option<Scratch>,
    ep: Endpoint,
    av: AddressVector,
    cq: CompletionQueue,
    domain: Domain,
    _fabric: Fabric,
    peer: Option<Address>,
    ordered: bool,
    completions: Vec<Completion>,
}

impl std::fmt::Debug for FabricTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricTransport")
            .field("provider", &self.info.provider_name())
            .field("peer", &self.peer)
            .field("ordered", &self.ordered)
            .finish()
    }
}

/// Whether `info` grants write-after-write ordering of data of any size.
fn grants_ordering(info: &Info) -> bool {
    info.tx_msg_order() & ffi::FI_ORDER_WAW != 0 && info.max_order_waw_size() == usize::MAX
}

impl FabricTransport {
    /// An RDM endpoint of `provider` (e.g. `"tcp;ofi_rxm"`, `"shm"`) with RMA and
    /// atomics; network providers bind to the loopback address (`127.0.0.1`). Every
    /// write and atomic reports its own delivery, and a put's signal is posted once its
    /// data completed. Use [`from_info`](Self::from_info) for anything else.
    pub fn new(provider: &str) -> Result<Self> {
        Self::open(provider, false, "127.0.0.1")
    }

    /// As [`new`](Self::new), a network provider bound to `node` (an address of this
    /// host that peers on other nodes reach; ignored by `shm`).
    pub fn new_at(provider: &str, node: &str) -> Result<Self> {
        Self::open(provider, false, node)
    }

    /// As [`new`](Self::new), asking for write-after-write ordering first (see the
    /// module docs) and falling back to none: where granted, a batch of writes costs one
    /// completion and a signal follows its data at once, but the target must progress
    /// its endpoint for every write (shm stops writing into the peer directly), which can
    /// make it slower than [`new`](Self::new) over shm (see `docs/BENCHMARKS.md` in the
    /// repository).
    pub fn new_ordered(provider: &str) -> Result<Self> {
        Self::open(provider, true, "127.0.0.1")
    }

    fn open(provider: &str, ordering: bool, node: &str) -> Result<Self> {
        let hints = |order: u64| {
            let mut hints = InfoBuilder::new()
                .provider(provider)
                .ep_type(EndpointType::RDM)
                .caps(Caps::MSG | Caps::RMA | Caps::ATOMIC)
                // A completion must mean the data is in the peer's memory: the proxy
                // reports it to the GPU as done. FI_COMPLETION: calls without flags
                // (fi_read) still complete under FI_SELECTIVE_COMPLETION.
                .tx_op_flags(ffi::FI_DELIVERY_COMPLETE | ffi::FI_COMPLETION)
                .msg_order(order);
            if provider != "shm" {
                hints = hints.node(node).source(true);
            }
            hints
        };
        let ordered = ordering
            .then(|| hints(ffi::FI_ORDER_WAW).get_first().ok())
            .flatten()
            .filter(grants_ordering);
        let info = match ordered {
            Some(info) => info,
            None => hints(0).get_first().map_err(fab(format!(
                "fi_getinfo for {provider} with RMA and atomics"
            )))?,
        };
        Self::from_info(info)
    }

    /// An RDM endpoint from discovered `info` (must offer RMA and atomics; `FI_HMEM`
    /// lets device memory be registered directly). Ask for `FI_DELIVERY_COMPLETE` in
    /// the transmit op flags: with transmit completion (rxm's default for small
    /// writes) a put is reported done before it reached the peer. The transport is
    /// ordered where `info` grants `FI_ORDER_WAW` for data of any size.
    pub fn from_info(info: Info) -> Result<Self> {
        let fabric = Fabric::new(&info).map_err(fab("fi_fabric"))?;
        let domain = Domain::new(&fabric, &info).map_err(fab("fi_domain"))?;
        let cq = CompletionQueue::builder()
            .size(4096)
            .open(&domain)
            .map_err(fab("fi_cq_open"))?;
        let av = AddressVector::new(&domain, AvType::Table, 4).map_err(fab("fi_av_open"))?;
        let ordered = grants_ordering(&info);
        let ep = EndpointBuilder::new(&domain, &info)
            .cq(&cq)
            .av(&av)
            .selective_completion(ordered)
            .build()
            .map_err(fab("fi_endpoint"))?;
        Ok(Self {
            info,
            scratch: None,
            ep,
            av,
            cq,
            domain,
            _fabric: fabric,
            peer: None,
            ordered,
            completions: vec![Completion::default(); 256],
        })
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    /// The provider's description of the endpoint.
    pub fn info(&self) -> &Info {
        &self.info
    }

    fn peer(&self) -> Result<Address> {
        self.peer
            .ok_or_else(|| Error::InvalidArgument("the fabric transport is not connected".into()))
    }
}

/// Writes `value` into scratch word `word`; returns its address and registration.
fn scratch_word(
    scratch: &mut Option<Scratch>,
    word: usize,
    value: u64,
) -> Result<(*const u8, &MemoryRegion)> {
    let scratch = scratch
        .as_mut()
        .ok_or_else(|| Error::InvalidArgument("the fabric transport was not prepared".into()))?;
    let slot = scratch
        .words
        .get_mut(word)
        .ok_or_else(|| Error::InvalidArgument(format!("scratch word {word} outside the window")))?;
    // SAFETY: a plain write to our own memory; no operation reads this word now (the
    // Scratch protocol).
    unsafe { std::ptr::write_volatile(slot, value) };
    Ok((slot as *const u64 as *const u8, &scratch.mr))
}

/// The per-request flags of `fi_writemsg` / `fi_atomicmsg`.
fn msg_flags(flags: PostFlags) -> u64 {
    // Unsignaled requests keep FI_DELIVERY_COMPLETE: shm 1.17 without it picks a
    // protocol for a 4 KiB write that faults in the sender's memcpy when the peer is
    // another process (seen in two_processes).
    let mut f = if flags.unsignaled {
        ffi::FI_DELIVERY_COMPLETE
    } else {
        ffi::FI_COMPLETION | ffi::FI_DELIVERY_COMPLETE
    };
    if flags.more {
        f |= ffi::FI_MORE;
    }
    f
}

/// `Ok` → posted, `WouldBlock` → busy, anything else is the error.
fn posted(result: fabric::Result<()>, call: &str) -> Result<Posted> {
    match result {
        Ok(()) => Ok(Posted::Yes),
        Err(e) if e.is_would_block() => Ok(Posted::Busy),
        Err(e) => Err(fab(call)(e)),
    }
}

impl Transport for FabricTransport {
    type Registration = FabricRegistration;

    fn kind(&self) -> TransportKind {
        TransportKind::FABRIC
    }

    fn local_info(&self) -> Result<Vec<u8>> {
        self.ep.name().map_err(fab("fi_getname"))
    }

    fn connect(&mut self, peer_info: &[u8]) -> Result<()> {
        let addr = self.av.insert(peer_info).map_err(|source| Error::Fabric {
            context: format!("fi_av_insert of a {}-byte peer address", peer_info.len()),
            source,
        })?;
        self.peer = Some(addr);
        Ok(())
    }

    fn prepare(&mut self, window: usize) -> Result<()> {
        let mut words = vec![0u64; 2 * window.max(1)].into_boxed_slice();
        // SAFETY: `words` lives in the Scratch value with the registration, which drops
        // the registration first.
        let mr = unsafe {
            MemoryRegion::reg_raw(
                &self.domain,
                Some(&self.ep),
                words.as_mut_ptr().cast::<u8>(),
                words.len() * 8,
                Access::ALL,
                HmemIface::System,
            )
        }
        .map_err(fab("fi_mr_regattr of the scratch words"))?;
        self.scratch = Some(Scratch { mr, words });
        Ok(())
    }

    unsafe fn register_host(&mut self, addr: *mut u8, len: usize) -> Result<FabricRegistration> {
        // SAFETY: forwarded contract (memory valid while registered).
        let mr = unsafe {
            MemoryRegion::reg_raw(
                &self.domain,
                Some(&self.ep),
                addr,
                len,
                Access::ALL,
                HmemIface::System,
            )
        }
        .map_err(fab(format!("fi_mr_regattr of {len} bytes of host memory")))?;
        Ok(FabricRegistration { mr })
    }

    fn register_device(&mut self, buf: &DeviceBuffer) -> Result<FabricRegistration> {
        // SAFETY: the buffer is device memory of that GPU; the proxy's table keeps it
        // alive while registered.
        unsafe { self.register_device_range(buf.ptr(), buf.len(), buf.gpu().ordinal()) }
    }

    unsafe fn register_device_range(
        &mut self,
        addr: u64,
        len: usize,
        device: usize,
    ) -> Result<FabricRegistration> {
        if !self.info.caps().contains(Caps::HMEM) {
            return Err(Error::Unsupported(format!(
                "provider {} was opened without FI_HMEM: device memory is staged",
                self.info.provider_name()
            )));
        }
        let iface = HmemIface::Cuda(device as i32);
        // SAFETY: forwarded contract (device memory of that GPU, allocated while
        // registered).
        let mr = unsafe {
            MemoryRegion::reg_hmem(&self.domain, Some(&self.ep), addr, len, Access::ALL, iface)
        };
        match mr {
            Ok(mr) => Ok(FabricRegistration { mr }),
            Err(fabric::Error::Unsupported { detail, .. }) => Err(Error::Unsupported(detail)),
            Err(e) => Err(fab("fi_mr_regattr of CUDA memory")(e)),
        }
    }

    fn descriptor(&self, reg: &FabricRegistration) -> RemoteDescriptor {
        let r = reg.mr.remote();
        RemoteDescriptor {
            transport: TransportKind::FABRIC,
            addr: r.addr,
            len: r.len,
            key: r.key,
        }
    }

    fn post(&mut self, wr: &WorkRequest<'_, FabricRegistration>) -> Result<Posted> {
        self.post_with(wr, PostFlags::default())
    }

    fn ordered(&self) -> bool {
        self.ordered
    }

    fn post_with(
        &mut self,
        wr: &WorkRequest<'_, FabricRegistration>,
        flags: PostFlags,
    ) -> Result<Posted> {
        let peer = self.peer()?;
        let flags = PostFlags {
            unsignaled: flags.unsignaled && self.ordered,
            ..flags
        };
        match *wr {
            WorkRequest::Write {
                wr_id,
                local,
                addr,
                len,
                remote,
                offset,
            } => {
                // SAFETY: `addr..addr+len` lies in `local` (validated by the proxy's
                // table), registered memory that outlives the operation.
                let r = unsafe {
                    self.ep.writemsg_raw(
                        addr as *const u8,
                        len as usize,
                        Some(&local.mr),
                        peer,
                        remote.addr.wrapping_add(offset),
                        remote.key,
                        wr_id,
                        msg_flags(flags),
                    )
                };
                posted(r, "fi_writemsg")
            }
            WorkRequest::Read {
                wr_id,
                local,
                addr,
                len,
                remote,
                offset,
            } => {
                // Reads always complete (their data lands here); the endpoint's op
                // flags carry FI_COMPLETION.
                // SAFETY: as for writes; the proxy does not touch the range until the
                // completion.
                let r = unsafe {
                    self.ep.read_raw(
                        addr as *mut u8,
                        len as usize,
                        Some(&local.mr),
                        peer,
                        remote.addr.wrapping_add(offset),
                        remote.key,
                        wr_id,
                    )
                };
                posted(r, "fi_read")
            }
            WorkRequest::WriteInline {
                wr_id,
                data,
                len,
                remote,
                offset,
                slot,
            } => {
                let (buf, mr) =
                    scratch_word(&mut self.scratch, 2 * slot, u64::from_ne_bytes(data))?;
                // SAFETY: the scratch word is registered and not rewritten before this
                // entry retires (Scratch).
                let r = unsafe {
                    self.ep.writemsg_raw(
                        buf,
                        len as usize,
                        Some(mr),
                        peer,
                        remote.addr.wrapping_add(offset),
                        remote.key,
                        wr_id,
                        msg_flags(flags),
                    )
                };
                posted(r, "fi_writemsg (inline)")
            }
            WorkRequest::AtomicAdd {
                wr_id,
                remote,
                offset,
                add,
                slot,
            } => {
                let (buf, mr) = scratch_word(&mut self.scratch, 2 * slot + 1, add)?;
                // SAFETY: as for inline writes; one u64 operand.
                let r = unsafe {
                    self.ep.atomicmsg_raw(
                        buf,
                        1,
                        Some(mr),
                        peer,
                        remote.addr.wrapping_add(offset),
                        remote.key,
                        AtomicDatatype::U64,
                        AtomicOp::SUM,
                        wr_id,
                        msg_flags(flags),
                    )
                };
                posted(r, "fi_atomicmsg")
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<TransportCompletion>) -> Result<()> {
        loop {
            match self.cq.read(&mut self.completions) {
                Ok(0) => return Ok(()),
                Ok(n) => out.extend(self.completions[..n].iter().map(|c| TransportCompletion {
                    wr_id: c.context,
                    result: Ok(()),
                })),
                Err(e) => {
                    let Some(wr_id) = e.completion_error().map(|c| c.context) else {
                        return Err(fab("fi_cq_read")(e));
                    };
                    let peer_gone = matches!(e, fabric::Error::RemoteDisconnect { .. });
                    out.push(TransportCompletion {
                        wr_id,
                        result: Err(TransportFailure {
                            peer_gone,
                            error: fab("completion")(e),
                        }),
                    });
                }
            }
        }
    }
}
