//! The proxy over an ibverbs RC queue pair: RDMA WRITE (inline where it fits), READ,
//! and ATOMIC_FETCH_AND_ADD for signals (the fetched value lands in a registered
//! scratch slot and is ignored). Every work request is signaled: a completion is what
//! the proxy reports to the ring.

use super::transport::{
    Posted, RemoteDescriptor, Transport, TransportCompletion, TransportFailure, TransportKind,
    WorkRequest,
};
use crate::error::{Error, Result};
use gpu_mem::DeviceBuffer;
use ibverbs::{
    AccessFlags, CompletionQueue, ConnectOptions, Context, Gid, InlineSge, MemoryRegion, Mtu,
    PreparedQueuePair, ProtectionDomain, QpType, QueuePair, RemoteMemory, SendFlags, SendWr, Sge,
    WorkCompletion,
};
use std::os::fd::AsFd;

fn verbs(context: impl Into<String>) -> impl FnOnce(ibverbs::Error) -> Error {
    let context = context.into();
    move |source| match source {
        ibverbs::Error::Unsupported { call } => {
            Error::Unsupported(format!("{context}: {call} is not supported by this device"))
        }
        source => Error::Verbs { context, source },
    }
}

/// Bytes a write carries inline (copied into the work queue at post time).
const MAX_INLINE: u32 = 64;

const INFO_MAGIC: [u8; 4] = *b"GIOV";
const INFO_VERSION: u8 = 1;
const INFO_LEN: usize = 36;

/// A memory region of the transport's protection domain.
#[derive(Debug)]
pub struct VerbsRegistration {
    mr: MemoryRegion,
}

/// An ibverbs RC queue pair as a proxy transport.
pub struct VerbsTransport {
    // Field order is drop order: the QP before its CQ and PD (which also hold their
    // parents through Arc).
    qp: Option<QueuePair>,
    prepared: Option<PreparedQueuePair>,
    scratch: Option<MemoryRegion>,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    opts: ConnectOptions,
    local: ibverbs::Endpoint,
    wcs: Vec<WorkCompletion>,
    inline_cap: u32,
}

impl std::fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport")
            .field("local", &self.local)
            .field("connected", &self.qp.is_some())
            .finish()
    }
}

impl VerbsTransport {
    /// An RC queue pair on `ctx` with room for `depth` outstanding work requests (use
    /// the ring size), connected later with `opts` (port, GID index, timeouts;
    /// `max_rd_atomic`/`max_dest_rd_atomic` bound the READs and atomics in flight).
    pub fn new(ctx: &Context, opts: ConnectOptions, depth: u32) -> Result<Self> {
        let depth = depth.max(16);
        let pd = ctx.alloc_pd().map_err(verbs("ibv_alloc_pd"))?;
        let cq = ctx
            .create_cq(depth, None, 0)
            .map_err(verbs(format!("ibv_create_cq of {depth} entries")))?;
        let prepared = pd
            .create_qp(QpType::RC, &cq, &cq)
            .max_send_wr(depth)
            .max_recv_wr(1)
            .max_send_sge(1)
            .max_recv_sge(1)
            .max_inline_data(MAX_INLINE)
            .build()
            .map_err(verbs(format!("ibv_create_qp (RC, {depth} send requests)")))?;
        let inline_cap = prepared.cap().max_inline_data.min(MAX_INLINE);
        let local = prepared.endpoint(&opts).map_err(verbs("local endpoint"))?;
        Ok(Self {
            qp: None,
            prepared: Some(prepared),
            scratch: None,
            cq,
            pd,
            opts,
            local,
            wcs: vec![WorkCompletion::default(); 32],
            inline_cap,
        })
    }

    /// The connected queue pair.
    pub fn queue_pair(&self) -> Option<&QueuePair> {
        self.qp.as_ref()
    }

    /// Destroys the queue pair (the connection is gone for both sides: the peer's next
    /// operation runs out of retries). Posting afterwards is an error.
    pub fn close(&mut self) {
        self.qp = None;
        self.prepared = None;
    }

    fn encode(ep: &ibverbs::Endpoint) -> Vec<u8> {
        let mut b = Vec::with_capacity(INFO_LEN);
        b.extend_from_slice(&INFO_MAGIC);
        b.extend_from_slice(&[INFO_VERSION, 0, 0, 0]);
        b.extend_from_slice(&ep.qp_num.to_le_bytes());
        b.extend_from_slice(&ep.psn.to_le_bytes());
        b.extend_from_slice(&ep.gid.raw);
        b.extend_from_slice(&ep.lid.to_le_bytes());
        b.extend_from_slice(&(ep.mtu.0 as u16).to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<ibverbs::Endpoint> {
        let bad = |reason: String| Error::Malformed {
            what: "verbs connection blob",
            reason,
        };
        if b.len() != INFO_LEN {
            return Err(bad(format!("{} bytes, expected {INFO_LEN}", b.len())));
        }
        if b[..4] != INFO_MAGIC {
            return Err(bad("no GIOV magic".into()));
        }
        if b[4] != INFO_VERSION || b[5..8] != [0, 0, 0] {
            return Err(bad(format!(
                "version {} (this build reads {INFO_VERSION})",
                b[4]
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u16_at = |i: usize| u16::from_le_bytes(b[i..i + 2].try_into().expect("2 bytes"));
        let mtu = u16_at(34) as u32;
        if !(1..=5).contains(&mtu) {
            return Err(bad(format!("MTU code {mtu}")));
        }
        Ok(ibverbs::Endpoint {
            qp_num: u32_at(8),
            psn: u32_at(12),
            gid: Gid {
                raw: b[16..32].try_into().expect("16 bytes"),
            },
            lid: u16_at(32),
            mtu: Mtu(mtu),
        })
    }

    fn qp(&self) -> Result<&QueuePair> {
        self.qp
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("the verbs transport is not connected".into()))
    }

    fn post_one(&self, wr: SendWr<'_>) -> Result<Posted> {
        match self.qp()?.post_send(&mut [wr]) {
            Ok(()) => Ok(Posted::Yes),
            Err(ibverbs::Error::QueueFull { .. }) => Ok(Posted::Busy),
            Err(e) => Err(verbs("ibv_post_send")(e)),
        }
    }
}

fn remote(d: &RemoteDescriptor, offset: u64, len: u64) -> RemoteMemory {
    RemoteMemory {
        addr: d.addr.wrapping_add(offset),
        len,
        rkey: d.key as u32,
    }
}

fn sge_len(len: u64) -> Result<u32> {
    u32::try_from(len)
        .ok()
        .filter(|l| *l <= 1 << 31)
        .ok_or_else(|| {
            Error::InvalidArgument(format!("{len} bytes in one RDMA operation (2 GiB at most)"))
        })
}

impl Transport for VerbsTransport {
    type Registration = VerbsRegistration;

    fn kind(&self) -> TransportKind {
        TransportKind::VERBS
    }

    fn local_info(&self) -> Result<Vec<u8>> {
        Ok(Self::encode(&self.local))
    }

    fn connect(&mut self, peer_info: &[u8]) -> Result<()> {
        let peer = Self::decode(peer_info)?;
        let prepared = self.prepared.take().ok_or_else(|| {
            Error::InvalidArgument("the verbs transport is connected already".into())
        })?;
        let qp = prepared
            .connect(&peer, &self.opts)
            .map_err(verbs(format!("connecting to QP {}", peer.qp_num)))?;
        self.qp = Some(qp);
        Ok(())
    }

    fn prepare(&mut self, window: usize) -> Result<()> {
        let mr = self
            .pd
            .reg_mr(8 * window.max(1), AccessFlags::LOCAL_WRITE)
            .map_err(verbs("ibv_reg_mr of the atomic result slots"))?;
        self.scratch = Some(mr);
        Ok(())
    }

    unsafe fn register_host(&mut self, addr: *mut u8, len: usize) -> Result<VerbsRegistration> {
        // SAFETY: forwarded contract (memory valid while registered).
        let mr = unsafe { self.pd.reg_mr_raw(addr, len, AccessFlags::all_remote()) }
            .map_err(verbs(format!("ibv_reg_mr of {len} bytes")))?;
        Ok(VerbsRegistration { mr })
    }

    fn register_device(&mut self, buf: &DeviceBuffer) -> Result<VerbsRegistration> {
        let dmabuf = buf.dmabuf_fd()?;
        let mr = self
            .pd
            .reg_dmabuf_mr(
                dmabuf.fd.as_fd(),
                dmabuf.offset,
                buf.len(),
                buf.ptr(),
                AccessFlags::all_remote(),
            )
            .map_err(verbs(format!("ibv_reg_dmabuf_mr of {} bytes", buf.len())))?;
        Ok(VerbsRegistration { mr })
    }

    fn descriptor(&self, reg: &VerbsRegistration) -> RemoteDescriptor {
        RemoteDescriptor {
            transport: TransportKind::VERBS,
            addr: reg.mr.addr(),
            len: reg.mr.len() as u64,
            key: reg.mr.rkey() as u64,
        }
    }

    fn post(&mut self, wr: &WorkRequest<'_, VerbsRegistration>) -> Result<Posted> {
        match *wr {
            WorkRequest::Write {
                wr_id,
                local,
                addr,
                len,
                remote: d,
                offset,
            } => {
                let n = sge_len(len)?;
                // SAFETY: the range lies in `local`'s region (validated by the proxy's
                // table), which outlives the operation.
                let sge = [unsafe { Sge::from_raw(addr, n, local.mr.lkey()) }];
                let mut w = SendWr::write(wr_id, &sge, remote(d, offset, len)).signaled();
                if n <= self.inline_cap {
                    w = w.flags(SendFlags::INLINE);
                }
                self.post_one(w)
            }
            WorkRequest::Read {
                wr_id,
                local,
                addr,
                len,
                remote: d,
                offset,
            } => {
                let n = sge_len(len)?;
                // SAFETY: as for writes.
                let sge = [unsafe { Sge::from_raw(addr, n, local.mr.lkey()) }];
                self.post_one(SendWr::read(wr_id, &sge, remote(d, offset, len)).signaled())
            }
            WorkRequest::WriteInline {
                wr_id,
                data,
                len,
                remote: d,
                offset,
                ..
            } => {
                let bytes = &data[..len as usize];
                let inline = [InlineSge::new(bytes)];
                self.post_one(
                    SendWr::write_inline(wr_id, &inline, remote(d, offset, len as u64)).signaled(),
                )
            }
            WorkRequest::AtomicAdd {
                wr_id,
                remote: d,
                offset,
                add,
                slot,
            } => {
                let scratch = self
                    .scratch
                    .as_ref()
                    .ok_or_else(|| Error::InvalidArgument("prepare() was not called".into()))?;
                let at = 8 * slot;
                if at + 8 > scratch.len() {
                    return Err(Error::InvalidArgument(format!("scratch slot {slot}")));
                }
                let sge = [scratch.sge(at..at + 8)];
                self.post_one(SendWr::fetch_add(wr_id, &sge, remote(d, offset, 8), add).signaled())
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<TransportCompletion>) -> Result<()> {
        loop {
            let wcs = self.cq.poll(&mut self.wcs).map_err(verbs("ibv_poll_cq"))?;
            if wcs.is_empty() {
                return Ok(());
            }
            for wc in wcs.iter() {
                let result = wc.result().map_err(|e| TransportFailure {
                    peer_gone: matches!(e, ibverbs::Error::RemoteDisconnect { .. }),
                    error: verbs("completion")(e),
                });
                out.push(TransportCompletion {
                    wr_id: wc.wr_id(),
                    result,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_blob_round_trip_and_refusals() {
        let ep = ibverbs::Endpoint {
            qp_num: 0x11,
            psn: 0x22,
            gid: Gid { raw: [7; 16] },
            lid: 3,
            mtu: Mtu(5),
        };
        let b = VerbsTransport::encode(&ep);
        assert_eq!(b.len(), INFO_LEN);
        assert_eq!(VerbsTransport::decode(&b).unwrap(), ep);
        let refused = |b: &[u8]| matches!(VerbsTransport::decode(b), Err(Error::Malformed { .. }));
        assert!(refused(&b[..35]));
        let mut x = b.clone();
        x[1] = b'X';
        assert!(refused(&x));
        let mut x = b.clone();
        x[4] = 9;
        assert!(refused(&x));
        let mut x = b.clone();
        x[34] = 9;
        assert!(refused(&x));
    }
}
