//! The proxy over a libfabric RDM endpoint: `fi_write` / `fi_read` on registered
//! memory, `fi_atomic` (`FI_SUM`, `FI_UINT64`) for signals.
//!
//! Inline puts are written from an 8-byte registered scratch slot with a completion
//! rather than `fi_inject_write`: an inject reports no completion, so the proxy could
//! neither advance `ctrl.completed` truthfully nor order a following signal after it.

use super::transport::{
    Posted, RemoteDescriptor, Transport, TransportCompletion, TransportFailure, TransportKind,
    WorkRequest,
};
use crate::error::{Error, Result};
use crate::DeviceBuffer;
use fabric::{
    Access, Address, AddressVector, AtomicDatatype, AtomicOp, AvType, Caps, Completion,
    CompletionQueue, Domain, Endpoint, EndpointBuilder, EndpointType, Fabric, HmemIface, Info,
    InfoBuilder, MemoryRegion, RegisteredBuffer, RemoteMemory,
};

fn fab(context: impl Into<String>) -> impl FnOnce(fabric::Error) -> Error {
    let context = context.into();
    move |source| Error::Fabric { context, source }
}

/// A registration of local memory with the endpoint's domain.
#[derive(Debug)]
pub struct FabricRegistration {
    mr: MemoryRegion,
}

/// A libfabric RDM endpoint as a proxy transport.
pub struct FabricTransport {
    info: Info,
    // Field order is drop order: endpoint before its queues and domain (each also holds
    // its parents through Arc).
    ep: Endpoint,
    av: AddressVector,
    cq: CompletionQueue,
    domain: Domain,
    _fabric: Fabric,
    peer: Option<Address>,
    /// 8-byte operands of inline puts and atomics, one per window slot (allocated on
    /// first use).
    scratch: Vec<Option<RegisteredBuffer>>,
    completions: Vec<Completion>,
}

impl std::fmt::Debug for FabricTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricTransport")
            .field("provider", &self.info.provider_name())
            .field("peer", &self.peer)
            .finish()
    }
}

impl FabricTransport {
    /// An RDM endpoint of `provider` (e.g. `"tcp;ofi_rxm"`, `"shm"`) with RMA and
    /// atomics; network providers bind to the loopback address (`127.0.0.1`). Use
    /// [`from_info`](Self::from_info) for anything else.
    pub fn new(provider: &str) -> Result<Self> {
        let mut hints = InfoBuilder::new()
            .provider(provider)
            .ep_type(EndpointType::RDM)
            .caps(Caps::MSG | Caps::RMA | Caps::ATOMIC)
            // A completion must mean the data is in the peer's memory: the proxy
            // reports it to the GPU as done, and posts a put's signal after it.
            .tx_op_flags(fabric::ffi::FI_DELIVERY_COMPLETE);
        if provider != "shm" {
            hints = hints.node("127.0.0.1").source(true);
        }
        let info = hints.get_first().map_err(fab(format!(
            "fi_getinfo for {provider} with RMA and atomics"
        )))?;
        Self::from_info(info)
    }

    /// An RDM endpoint from discovered `info` (must offer RMA and atomics; `FI_HMEM`
    /// lets device memory be registered directly). Ask for `FI_DELIVERY_COMPLETE` in
    /// the transmit op flags: with transmit completion (rxm's default for small
    /// writes) a put is reported done before it reached the peer.
    pub fn from_info(info: Info) -> Result<Self> {
        let fabric = Fabric::new(&info).map_err(fab("fi_fabric"))?;
        let domain = Domain::new(&fabric, &info).map_err(fab("fi_domain"))?;
        let cq = CompletionQueue::builder()
            .size(4096)
            .open(&domain)
            .map_err(fab("fi_cq_open"))?;
        let av = AddressVector::new(&domain, AvType::Table, 4).map_err(fab("fi_av_open"))?;
        let ep = EndpointBuilder::new(&domain, &info)
            .cq(&cq)
            .av(&av)
            .build()
            .map_err(fab("fi_endpoint"))?;
        Ok(Self {
            info,
            ep,
            av,
            cq,
            domain,
            _fabric: fabric,
            peer: None,
            scratch: Vec::new(),
            completions: vec![Completion::default(); 64],
        })
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    fn peer(&self) -> Result<Address> {
        self.peer
            .ok_or_else(|| Error::InvalidArgument("the fabric transport is not connected".into()))
    }

    fn scratch(&mut self, slot: usize, value: &[u8]) -> Result<Option<&RegisteredBuffer>> {
        if self.scratch[slot].is_none() {
            let buf = self
                .ep
                .alloc_registered(8, Access::ALL)
                .map_err(fab("scratch slot registration"))?;
            self.scratch[slot] = Some(buf);
        }
        let buf = self.scratch[slot].as_mut().expect("allocated above");
        // Still in use: its previous operation's completion was not read yet.
        let Some(bytes) = buf.as_mut_slice() else {
            return Ok(None);
        };
        bytes[..value.len()].copy_from_slice(value);
        Ok(Some(buf))
    }
}

fn remote_memory(d: &RemoteDescriptor) -> RemoteMemory {
    RemoteMemory {
        addr: d.addr,
        key: d.key,
        len: d.len,
    }
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
        self.scratch = (0..window).map(|_| None).collect();
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
        if !self.info.caps().contains(Caps::HMEM) {
            return Err(Error::Unsupported(format!(
                "provider {} was opened without FI_HMEM: device memory is staged",
                self.info.provider_name()
            )));
        }
        let iface = HmemIface::Cuda(buf.gpu().ordinal() as i32);
        // SAFETY: the buffer is device memory of that GPU; the proxy's table keeps it
        // alive while registered.
        let mr = unsafe {
            MemoryRegion::reg_hmem(
                &self.domain,
                Some(&self.ep),
                buf.ptr(),
                buf.len(),
                Access::ALL,
                iface,
            )
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
        let peer = self.peer()?;
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
                    self.ep.write_raw(
                        addr as *const u8,
                        len as usize,
                        Some(&local.mr),
                        peer,
                        remote.addr.wrapping_add(offset),
                        remote.key,
                        wr_id,
                    )
                };
                posted(r, "fi_write")
            }
            WorkRequest::Read {
                wr_id,
                local,
                addr,
                len,
                remote,
                offset,
            } => {
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
                let len = len as usize;
                let ep = self.ep.clone();
                let Some(buf) = self.scratch(slot, &data[..len])? else {
                    return Ok(Posted::Busy);
                };
                let r = ep.write(buf, 0..len, peer, &remote_memory(remote), offset, wr_id);
                posted(r, "fi_write (inline)")
            }
            WorkRequest::AtomicAdd {
                wr_id,
                remote,
                offset,
                add,
                slot,
            } => {
                let ep = self.ep.clone();
                let Some(buf) = self.scratch(slot, &add.to_ne_bytes())? else {
                    return Ok(Posted::Busy);
                };
                let r = ep.atomic(
                    buf,
                    0..8,
                    peer,
                    &remote_memory(remote),
                    offset,
                    AtomicDatatype::U64,
                    AtomicOp::SUM,
                    wr_id,
                );
                posted(r, "fi_atomic")
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
