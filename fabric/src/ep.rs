//! Endpoints (`fid_ep`, RDM and MSG): their builder and data operations (the type itself
//! is in `ep_handle`).

use crate::atomic::{AtomicDatatype, AtomicOp};
use crate::av::{Address, AddressVector};
use crate::cntr::Counter;
use crate::cq::{Completion, CompletionQueue, INTERNAL_CONTEXT};
use crate::domain::Domain;
use crate::ep_handle::{Endpoint, EpInner};
use crate::eq::EventQueue;
use crate::error::{cvt, Error, Result};
use crate::info::{EndpointType, Info};
use crate::mr::{Access, MemoryRegion, RegisteredBuffer, RemoteMemory};
use crate::{close_fid, ffi, fid_of, get_name};
use std::any::Any;
use std::ffi::c_void;
use std::ops::Range;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Objects to bind to a new [`Endpoint`] (`fi_endpoint`, `fi_ep_bind`, `fi_enable`).
#[derive(Debug)]
pub struct EndpointBuilder<'a> {
    domain: &'a Domain,
    info: &'a Info,
    tx_cq: Option<CompletionQueue>,
    rx_cq: Option<CompletionQueue>,
    av: Option<AddressVector>,
    eq: Option<EventQueue>,
    counters: Vec<(Counter, u64)>,
    selective_completion: bool,
}

impl<'a> EndpointBuilder<'a> {
    /// An endpoint of `domain` described by `info` (for an accepting MSG endpoint: the
    /// info of the `FI_CONNREQ` event).
    pub fn new(domain: &'a Domain, info: &'a Info) -> Self {
        EndpointBuilder {
            domain,
            info,
            tx_cq: None,
            rx_cq: None,
            av: None,
            eq: None,
            counters: Vec::new(),
            selective_completion: false,
        }
    }
    /// Binds the transmit queue with `FI_SELECTIVE_COMPLETION`: a successful transmit
    /// operation writes a completion only when posted with `FI_COMPLETION` (the
    /// `*msg_raw` calls' flags); failures are always reported.
    #[doc(alias = "FI_SELECTIVE_COMPLETION")]
    pub fn selective_completion(mut self, on: bool) -> Self {
        self.selective_completion = on;
        self
    }
    /// One queue for transmit and receive completions.
    pub fn cq(mut self, cq: &CompletionQueue) -> Self {
        self.tx_cq = Some(cq.clone());
        self.rx_cq = Some(cq.clone());
        self
    }
    /// The transmit completion queue (`FI_TRANSMIT`).
    pub fn tx_cq(mut self, cq: &CompletionQueue) -> Self {
        self.tx_cq = Some(cq.clone());
        self
    }
    /// The receive completion queue (`FI_RECV`).
    pub fn rx_cq(mut self, cq: &CompletionQueue) -> Self {
        self.rx_cq = Some(cq.clone());
        self
    }
    /// The address vector (RDM endpoints).
    pub fn av(mut self, av: &AddressVector) -> Self {
        self.av = Some(av.clone());
        self
    }
    /// The event queue (MSG endpoints: connection events).
    pub fn eq(mut self, eq: &EventQueue) -> Self {
        self.eq = Some(eq.clone());
        self
    }
    /// A counter for the operations in `flags` (`FI_SEND`, `FI_RECV`, `FI_READ`,
    /// `FI_WRITE`, `FI_REMOTE_READ`, `FI_REMOTE_WRITE`).
    pub fn counter(mut self, counter: &Counter, flags: Access) -> Self {
        self.counters.push((counter.clone(), flags.bits()));
        self
    }

    /// Opens, binds and enables the endpoint.
    #[doc(alias = "fi_endpoint")]
    #[doc(alias = "fi_ep_bind")]
    #[doc(alias = "fi_enable")]
    pub fn build(self) -> Result<Endpoint> {
        let guard = self.domain.inner.control_guard();
        let mut raw = ptr::null_mut();
        // SAFETY: the domain is open, info valid; raw receives the endpoint.
        let ret = unsafe {
            ffi::fi_endpoint(
                self.domain.inner.raw,
                self.info.as_raw(),
                &mut raw,
                ptr::null_mut(),
            )
        };
        cvt("fi_endpoint", ret).map_err(|e| e.context(|| self.info.provider_name().to_owned()))?;
        if let Err(e) = self.bind_and_enable(raw) {
            close_fid("endpoint", fid_of(raw));
            return Err(e);
        }
        drop(guard);
        Ok(Endpoint {
            inner: Arc::new(EpInner {
                raw,
                domain: Arc::clone(&self.domain.inner),
                tx_cq: self.tx_cq,
                rx_cq: self.rx_cq,
                _av: self.av,
                eq: self.eq,
                _counters: self.counters.into_iter().map(|(c, _)| c).collect(),
                ep_type: self.info.ep_type(),
                _parent: None,
            }),
        })
    }

    fn bind_and_enable(&self, raw: *mut ffi::fid_ep) -> Result<()> {
        let bind = |fid: *mut ffi::fid, flags: u64, what: &'static str| -> Result<()> {
            // SAFETY: both objects are open and belong to the same domain/fabric.
            cvt("fi_ep_bind", unsafe { ffi::fi_ep_bind(raw, fid, flags) })
                .map_err(|e| e.context(|| what.to_owned()))
        };
        let selective = if self.selective_completion {
            ffi::FI_SELECTIVE_COMPLETION
        } else {
            0
        };
        match (&self.tx_cq, &self.rx_cq) {
            (Some(tx), Some(rx)) if Arc::ptr_eq(&tx.inner, &rx.inner) => {
                bind(
                    fid_of(tx.inner.raw),
                    ffi::FI_TRANSMIT | ffi::FI_RECV | selective,
                    "cq",
                )?;
            }
            (tx, rx) => {
                if let Some(tx) = tx {
                    bind(fid_of(tx.inner.raw), ffi::FI_TRANSMIT | selective, "tx cq")?;
                }
                if let Some(rx) = rx {
                    bind(fid_of(rx.inner.raw), ffi::FI_RECV, "rx cq")?;
                }
            }
        }
        if let Some(av) = &self.av {
            bind(fid_of(av.inner.raw), 0, "av")?;
        }
        if let Some(eq) = &self.eq {
            bind(fid_of(eq.inner.raw), 0, "eq")?;
        }
        for (cntr, flags) in &self.counters {
            bind(fid_of(cntr.inner.raw), *flags, "counter")?;
        }
        // SAFETY: the endpoint is open and bound.
        cvt("fi_enable", unsafe { ffi::fi_enable(raw) })
    }
}

/// One write of a batch posted with `FI_MORE` ([`Endpoint::write_batch`]).
#[derive(Debug, Clone)]
pub struct WriteOp<'a> {
    /// Source buffer.
    pub buf: &'a RegisteredBuffer,
    /// Bytes of `buf` to write.
    pub range: Range<usize>,
    /// The target.
    pub dest: Address,
    /// The target region.
    pub remote: RemoteMemory,
    /// Offset in the target region.
    pub remote_offset: u64,
    /// The completion's context.
    pub context: u64,
}

fn datatype_size(dt: AtomicDatatype) -> usize {
    match dt {
        AtomicDatatype::I8 | AtomicDatatype::U8 => 1,
        AtomicDatatype::I32 | AtomicDatatype::U32 | AtomicDatatype::F32 => 4,
        _ => 8,
    }
}

impl Endpoint {
    /// The raw `fid_ep`.
    pub fn as_raw(&self) -> *mut ffi::fid_ep {
        self.inner.raw
    }

    /// Wraps an open, bound, enabled `fid_ep` of `domain`.
    ///
    /// # Safety
    /// `raw` must be an enabled endpoint of `domain`, bound to `tx_cq`/`rx_cq` (if given),
    /// owned by nobody else (closed on drop).
    pub unsafe fn from_raw(
        domain: &Domain,
        raw: *mut ffi::fid_ep,
        ep_type: EndpointType,
        tx_cq: Option<&CompletionQueue>,
        rx_cq: Option<&CompletionQueue>,
    ) -> Endpoint {
        Endpoint {
            inner: Arc::new(EpInner {
                raw,
                domain: Arc::clone(&domain.inner),
                tx_cq: tx_cq.cloned(),
                rx_cq: rx_cq.cloned(),
                _av: None,
                eq: None,
                _counters: Vec::new(),
                ep_type,
                _parent: None,
            }),
        }
    }

    /// The endpoint type.
    pub fn ep_type(&self) -> EndpointType {
        self.inner.ep_type
    }

    /// The transmit completion queue.
    pub fn tx_cq(&self) -> Option<&CompletionQueue> {
        self.inner.tx_cq.as_ref()
    }

    /// The receive completion queue.
    pub fn rx_cq(&self) -> Option<&CompletionQueue> {
        self.inner.rx_cq.as_ref()
    }

    /// The endpoint's address as bytes (`fi_getname`): give it to peers, who insert it in
    /// their address vector.
    #[doc(alias = "fi_getname")]
    pub fn name(&self) -> Result<Vec<u8>> {
        get_name(self.fid(), "fi_getname")
    }

    /// The connected peer's address (`fi_getpeer`, MSG endpoints).
    #[doc(alias = "fi_getpeer")]
    pub fn peer(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: buf has len writable bytes.
        cvt("fi_getpeer", unsafe {
            ffi::fi_getpeer(self.inner.raw, buf.as_mut_ptr().cast(), &mut len)
        })?;
        buf.truncate(len);
        Ok(buf)
    }

    /// Allocates and registers `len` bytes for use with this endpoint, binding and
    /// enabling the registration here when the provider needs `FI_MR_ENDPOINT`.
    pub fn alloc_registered(&self, len: usize, access: Access) -> Result<RegisteredBuffer> {
        let domain = Domain {
            inner: Arc::clone(&self.inner.domain),
        };
        RegisteredBuffer::alloc(&domain, Some(self), len, access)
    }

    /// Progresses the endpoint's queues without consuming completions.
    pub fn progress(&self) {
        if let Some(cq) = &self.inner.tx_cq {
            cq.progress();
        }
        if let Some(cq) = &self.inner.rx_cq {
            if !self
                .inner
                .tx_cq
                .as_ref()
                .is_some_and(|t| Arc::ptr_eq(&t.inner, &cq.inner))
            {
                cq.progress();
            }
        }
    }

    /// The descriptor of `mr`, or an error when the provider needs `FI_MR_LOCAL` and
    /// none was given.
    fn raw_desc(&self, call: &'static str, mr: Option<&MemoryRegion>) -> Result<*mut c_void> {
        match mr {
            Some(mr) => Ok(mr.desc()),
            None if crate::mr::rules::needs_desc(self.inner.domain.mr_mode) => {
                Err(Error::InvalidArgument {
                    call,
                    detail: "the provider requires FI_MR_LOCAL: pass the buffer's MemoryRegion"
                        .into(),
                })
            }
            None => Ok(ptr::null_mut()),
        }
    }

    fn check_context(call: &'static str, context: u64) -> Result<()> {
        if context & INTERNAL_CONTEXT != 0 {
            return Err(Error::InvalidArgument {
                call,
                detail: format!("context {context:#x} has the top bit set (reserved)"),
            });
        }
        Ok(())
    }

    fn finish(&self, call: &'static str, ret: isize) -> Result<()> {
        if ret == 0 {
            return Ok(());
        }
        if ret == -(ffi::FI_EAGAIN as isize) {
            self.progress();
        }
        Err(Error::from_ret(call, ret))
    }

    fn cq_for(&self, call: &'static str, tx: bool) -> Result<&CompletionQueue> {
        let cq = if tx {
            &self.inner.tx_cq
        } else {
            &self.inner.rx_cq
        };
        cq.as_ref().ok_or_else(|| Error::InvalidArgument {
            call,
            detail: format!(
                "the endpoint has no {} completion queue",
                if tx { "transmit" } else { "receive" }
            ),
        })
    }

    /// Posts an operation on owned memory: the keepalive is held by the queue until the
    /// completion is read.
    fn post_owned(
        &self,
        call: &'static str,
        tx: bool,
        context: u64,
        keepalive: Arc<dyn Any + Send + Sync>,
        post: impl FnOnce(*mut c_void) -> isize,
    ) -> Result<()> {
        Self::check_context(call, context)?;
        let cq = self.cq_for(call, tx)?;
        let id = cq.inner.register(context, keepalive);
        let ret = post(id as usize as *mut c_void);
        if ret != 0 {
            cq.inner.unregister(id);
        }
        self.finish(call, ret)
    }

    fn range_ptr(buf: &RegisteredBuffer, range: &Range<usize>) -> *mut c_void {
        // SAFETY: check_range was called: the offset is within the allocation.
        unsafe { buf.as_ptr().add(range.start) as *mut c_void }
    }

    fn remote_target(
        call: &'static str,
        remote: &RemoteMemory,
        offset: u64,
        len: usize,
    ) -> Result<u64> {
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|end| end > remote.len) {
            return Err(Error::InvalidArgument {
                call,
                detail: format!(
                    "{len} bytes at offset {offset} exceed the remote region of {} bytes",
                    remote.len
                ),
            });
        }
        Ok(remote.address_at(offset))
    }

    // ---- messages -------------------------------------------------------------------

    /// Sends `buf[range]` to `dest` (`fi_send`).
    #[doc(alias = "fi_send")]
    pub fn send(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        dest: Address,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_send", &range)?;
        let (p, len, desc) = (Self::range_ptr(buf, &range), range.len(), buf.mr().desc());
        self.post_owned("fi_send", true, context, buf.inner.clone(), |ctx| {
            // SAFETY: p..p+len is kept alive by the keepalive until the completion.
            unsafe { ffi::fi_send(self.inner.raw, p, len, desc, dest.0, ctx) }
        })
    }

    /// Sends `buf[range]` with remote CQ data (`fi_senddata`).
    #[doc(alias = "fi_senddata")]
    pub fn senddata(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        data: u64,
        dest: Address,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_senddata", &range)?;
        let (p, len, desc) = (Self::range_ptr(buf, &range), range.len(), buf.mr().desc());
        self.post_owned("fi_senddata", true, context, buf.inner.clone(), |ctx| {
            // SAFETY: p..p+len is kept alive by the keepalive until the completion.
            unsafe { ffi::fi_senddata(self.inner.raw, p, len, desc, data, dest.0, ctx) }
        })
    }

    /// Posts a receive into `buf[range]` from `src` (`Address::UNSPEC`: anyone)
    /// (`fi_recv`).
    #[doc(alias = "fi_recv")]
    pub fn recv(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        src: Address,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_recv", &range)?;
        let (p, len, desc) = (Self::range_ptr(buf, &range), range.len(), buf.mr().desc());
        self.post_owned("fi_recv", false, context, buf.inner.clone(), |ctx| {
            // SAFETY: p..p+len is kept alive by the keepalive until the completion.
            unsafe { ffi::fi_recv(self.inner.raw, p, len, desc, src.0, ctx) }
        })
    }

    /// Sends `buf[range]` with `tag` (`fi_tsend`).
    #[doc(alias = "fi_tsend")]
    pub fn tsend(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        dest: Address,
        tag: u64,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_tsend", &range)?;
        let (p, len, desc) = (Self::range_ptr(buf, &range), range.len(), buf.mr().desc());
        self.post_owned("fi_tsend", true, context, buf.inner.clone(), |ctx| {
            // SAFETY: p..p+len is kept alive by the keepalive until the completion.
            unsafe { ffi::fi_tsend(self.inner.raw, p, len, desc, dest.0, tag, ctx) }
        })
    }

    /// Receives a message whose tag matches `tag` outside the `ignore` bits (`fi_trecv`).
    #[doc(alias = "fi_trecv")]
    pub fn trecv(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        src: Address,
        tag: u64,
        ignore: u64,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_trecv", &range)?;
        let (p, len, desc) = (Self::range_ptr(buf, &range), range.len(), buf.mr().desc());
        self.post_owned("fi_trecv", false, context, buf.inner.clone(), |ctx| {
            // SAFETY: p..p+len is kept alive by the keepalive until the completion.
            unsafe { ffi::fi_trecv(self.inner.raw, p, len, desc, src.0, tag, ignore, ctx) }
        })
    }

    /// Sends a small message, copied before returning; no completion (`fi_inject`).
    #[doc(alias = "fi_inject")]
    pub fn inject(&self, data: &[u8], dest: Address) -> Result<()> {
        // SAFETY: fi_inject copies data before returning.
        let ret =
            unsafe { ffi::fi_inject(self.inner.raw, data.as_ptr().cast(), data.len(), dest.0) };
        self.finish("fi_inject", ret)
    }

    /// [`inject`](Self::inject) with remote CQ data (`fi_injectdata`).
    #[doc(alias = "fi_injectdata")]
    pub fn injectdata(&self, data: &[u8], cq_data: u64, dest: Address) -> Result<()> {
        // SAFETY: fi_injectdata copies data before returning.
        let ret = unsafe {
            ffi::fi_injectdata(
                self.inner.raw,
                data.as_ptr().cast(),
                data.len(),
                cq_data,
                dest.0,
            )
        };
        self.finish("fi_injectdata", ret)
    }

    /// Tagged [`inject`](Self::inject) (`fi_tinject`).
    #[doc(alias = "fi_tinject")]
    pub fn tinject(&self, data: &[u8], dest: Address, tag: u64) -> Result<()> {
        // SAFETY: fi_tinject copies data before returning.
        let ret = unsafe {
            ffi::fi_tinject(
                self.inner.raw,
                data.as_ptr().cast(),
                data.len(),
                dest.0,
                tag,
            )
        };
        self.finish("fi_tinject", ret)
    }

    // ---- RMA ------------------------------------------------------------------------

    /// Writes `buf[range]` to `remote` at `remote_offset` on `dest` (`fi_write`).
    #[doc(alias = "fi_write")]
    pub fn write(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        dest: Address,
        remote: &RemoteMemory,
        remote_offset: u64,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_write", &range)?;
        let addr = Self::remote_target("fi_write", remote, remote_offset, range.len())?;
        let (p, len, desc, key) = (
            Self::range_ptr(buf, &range),
            range.len(),
            buf.mr().desc(),
            remote.key,
        );
        self.post_owned("fi_write", true, context, buf.inner.clone(), |ctx| {
            // SAFETY: p..p+len is kept alive by the keepalive until the completion.
            unsafe { ffi::fi_write(self.inner.raw, p, len, desc, dest.0, addr, key, ctx) }
        })
    }

    /// [`write`](Self::write) that also delivers `data` in a completion at the target's
    /// receive queue (`FI_REMOTE_CQ_DATA`) (`fi_writedata`).
    #[doc(alias = "fi_writedata")]
    #[allow(clippy::too_many_arguments)]
    pub fn writedata(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        data: u64,
        dest: Address,
        remote: &RemoteMemory,
        remote_offset: u64,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_writedata", &range)?;
        let addr = Self::remote_target("fi_writedata", remote, remote_offset, range.len())?;
        let (p, len, desc, key) = (
            Self::range_ptr(buf, &range),
            range.len(),
            buf.mr().desc(),
            remote.key,
        );
        self.post_owned("fi_writedata", true, context, buf.inner.clone(), |ctx| {
            // SAFETY: p..p+len is kept alive by the keepalive until the completion.
            unsafe { ffi::fi_writedata(self.inner.raw, p, len, desc, data, dest.0, addr, key, ctx) }
        })
    }

    /// Reads `remote` at `remote_offset` on `src` into `buf[range]` (`fi_read`).
    #[doc(alias = "fi_read")]
    pub fn read(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        src: Address,
        remote: &RemoteMemory,
        remote_offset: u64,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_read", &range)?;
        let addr = Self::remote_target("fi_read", remote, remote_offset, range.len())?;
        let (p, len, desc, key) = (
            Self::range_ptr(buf, &range),
            range.len(),
            buf.mr().desc(),
            remote.key,
        );
        self.post_owned("fi_read", true, context, buf.inner.clone(), |ctx| {
            // SAFETY: p..p+len is kept alive by the keepalive until the completion.
            unsafe { ffi::fi_read(self.inner.raw, p, len, desc, src.0, addr, key, ctx) }
        })
    }

    /// Writes a small buffer, copied before returning; no completion (`fi_inject_write`).
    #[doc(alias = "fi_inject_write")]
    pub fn inject_write(
        &self,
        data: &[u8],
        dest: Address,
        remote: &RemoteMemory,
        remote_offset: u64,
    ) -> Result<()> {
        let addr = Self::remote_target("fi_inject_write", remote, remote_offset, data.len())?;
        // SAFETY: fi_inject_write copies data before returning.
        let ret = unsafe {
            ffi::fi_inject_write(
                self.inner.raw,
                data.as_ptr().cast(),
                data.len(),
                dest.0,
                addr,
                remote.key,
            )
        };
        self.finish("fi_inject_write", ret)
    }

    /// Posts several writes, all but the last with `FI_MORE` so the provider may batch
    /// them (`fi_writemsg`). On an error, the writes before it are posted.
    #[doc(alias = "fi_writemsg")]
    pub fn write_batch(&self, ops: &[WriteOp<'_>]) -> Result<()> {
        for (i, op) in ops.iter().enumerate() {
            op.buf.check_range("fi_writemsg", &op.range)?;
            let addr =
                Self::remote_target("fi_writemsg", &op.remote, op.remote_offset, op.range.len())?;
            let mut iov = libc::iovec {
                iov_base: Self::range_ptr(op.buf, &op.range),
                iov_len: op.range.len(),
            };
            let mut desc = op.buf.mr().desc();
            let mut rma = ffi::fi_rma_iov {
                addr,
                len: op.range.len(),
                key: op.remote.key,
            };
            let flags = if i + 1 < ops.len() { ffi::FI_MORE } else { 0 } | ffi::FI_COMPLETION;
            self.post_owned(
                "fi_writemsg",
                true,
                op.context,
                op.buf.inner.clone(),
                |ctx| {
                    let msg = ffi::fi_msg_rma {
                        msg_iov: ptr::addr_of_mut!(iov).cast(),
                        desc: &mut desc,
                        iov_count: 1,
                        addr: op.dest.0,
                        rma_iov: &mut rma,
                        rma_iov_count: 1,
                        context: ctx,
                        data: 0,
                    };
                    // SAFETY: msg points to locals valid for the call; the data is kept alive
                    // by the keepalive until the completion.
                    unsafe { ffi::fi_writemsg(self.inner.raw, &msg, flags) }
                },
            )?;
        }
        Ok(())
    }

    // ---- atomics --------------------------------------------------------------------

    /// How many elements of `dt` one `op` may carry, or [`Error::Unsupported`]
    /// (`fi_atomicvalid`).
    #[doc(alias = "fi_atomicvalid")]
    pub fn atomic_valid(&self, dt: AtomicDatatype, op: AtomicOp) -> Result<usize> {
        let mut count = 0;
        // SAFETY: count receives the result.
        let ret = unsafe { ffi::fi_atomicvalid(self.inner.raw, dt.0, op.0, &mut count) };
        cvt("fi_atomicvalid", ret).map_err(|e| e.context(|| format!("{dt:?} {op:?}")))?;
        Ok(count)
    }

    /// Like [`atomic_valid`](Self::atomic_valid) for fetching atomics
    /// (`fi_fetch_atomicvalid`).
    #[doc(alias = "fi_fetch_atomicvalid")]
    pub fn fetch_atomic_valid(&self, dt: AtomicDatatype, op: AtomicOp) -> Result<usize> {
        let mut count = 0;
        // SAFETY: count receives the result.
        let ret = unsafe { ffi::fi_fetch_atomicvalid(self.inner.raw, dt.0, op.0, &mut count) };
        cvt("fi_fetch_atomicvalid", ret).map_err(|e| e.context(|| format!("{dt:?} {op:?}")))?;
        Ok(count)
    }

    /// Applies `op` with the elements of `buf[range]` to `remote` at `remote_offset`
    /// (`fi_atomic`).
    #[doc(alias = "fi_atomic")]
    #[allow(clippy::too_many_arguments)]
    pub fn atomic(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        dest: Address,
        remote: &RemoteMemory,
        remote_offset: u64,
        dt: AtomicDatatype,
        op: AtomicOp,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_atomic", &range)?;
        let addr = Self::remote_target("fi_atomic", remote, remote_offset, range.len())?;
        let count = range.len() / datatype_size(dt);
        let (p, desc, key) = (Self::range_ptr(buf, &range), buf.mr().desc(), remote.key);
        self.post_owned("fi_atomic", true, context, buf.inner.clone(), |ctx| {
            // SAFETY: the operand is kept alive by the keepalive until the completion.
            unsafe {
                ffi::fi_atomic(
                    self.inner.raw,
                    p,
                    count,
                    desc,
                    dest.0,
                    addr,
                    key,
                    dt.0,
                    op.0,
                    ctx,
                )
            }
        })
    }

    /// Applies `op` and returns the previous remote values into `result[result_range]`
    /// (`fi_fetch_atomic`).
    #[doc(alias = "fi_fetch_atomic")]
    #[allow(clippy::too_many_arguments)]
    pub fn fetch_atomic(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        result: &RegisteredBuffer,
        result_offset: usize,
        dest: Address,
        remote: &RemoteMemory,
        remote_offset: u64,
        dt: AtomicDatatype,
        op: AtomicOp,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_fetch_atomic", &range)?;
        let result_range = result_offset..result_offset + range.len();
        result.check_range("fi_fetch_atomic", &result_range)?;
        let addr = Self::remote_target("fi_fetch_atomic", remote, remote_offset, range.len())?;
        let count = range.len() / datatype_size(dt);
        let (p, desc, key) = (Self::range_ptr(buf, &range), buf.mr().desc(), remote.key);
        let (r, rdesc) = (Self::range_ptr(result, &result_range), result.mr().desc());
        let keep: Arc<dyn Any + Send + Sync> = Arc::new((buf.inner.clone(), result.inner.clone()));
        self.post_owned("fi_fetch_atomic", true, context, keep, |ctx| {
            // SAFETY: operand and result are kept alive until the completion.
            unsafe {
                ffi::fi_fetch_atomic(
                    self.inner.raw,
                    p,
                    count,
                    desc,
                    r,
                    rdesc,
                    dest.0,
                    addr,
                    key,
                    dt.0,
                    op.0,
                    ctx,
                )
            }
        })
    }

    /// Compare-and-swap family (`fi_compare_atomic`): where the remote value compares with
    /// `compare[range]` under `op` (`AtomicOp::CSWAP`: equal), it becomes `buf[range]`; the
    /// previous values land in `result`.
    #[doc(alias = "fi_compare_atomic")]
    #[allow(clippy::too_many_arguments)]
    pub fn compare_atomic(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        compare: &RegisteredBuffer,
        result: &RegisteredBuffer,
        dest: Address,
        remote: &RemoteMemory,
        remote_offset: u64,
        dt: AtomicDatatype,
        op: AtomicOp,
        context: u64,
    ) -> Result<()> {
        buf.check_range("fi_compare_atomic", &range)?;
        compare.check_range("fi_compare_atomic", &(0..range.len()))?;
        result.check_range("fi_compare_atomic", &(0..range.len()))?;
        let addr = Self::remote_target("fi_compare_atomic", remote, remote_offset, range.len())?;
        let count = range.len() / datatype_size(dt);
        let (p, desc, key) = (Self::range_ptr(buf, &range), buf.mr().desc(), remote.key);
        let (c, cdesc) = (compare.as_ptr() as *const c_void, compare.mr().desc());
        let (r, rdesc) = (result.as_ptr() as *mut c_void, result.mr().desc());
        let keep: Arc<dyn Any + Send + Sync> = Arc::new((
            buf.inner.clone(),
            compare.inner.clone(),
            result.inner.clone(),
        ));
        self.post_owned("fi_compare_atomic", true, context, keep, |ctx| {
            // SAFETY: operand, compare and result buffers are kept alive until the completion.
            unsafe {
                ffi::fi_compare_atomic(
                    self.inner.raw,
                    p,
                    count,
                    desc,
                    c,
                    cdesc,
                    r,
                    rdesc,
                    dest.0,
                    addr,
                    key,
                    dt.0,
                    op.0,
                    ctx,
                )
            }
        })
    }

    // ---- caller memory (unsafe) -----------------------------------------------------

    /// `fi_send` of caller memory.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and unmodified until the completion for `context`
    /// is read; `mr` must cover it when the provider requires `FI_MR_LOCAL`.
    #[doc(alias = "fi_send")]
    pub unsafe fn send_raw(
        &self,
        buf: *const u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        dest: Address,
        context: u64,
    ) -> Result<()> {
        Self::check_context("fi_send", context)?;
        let desc = self.raw_desc("fi_send", mr)?;
        // SAFETY: forwarded contract.
        let ret = unsafe {
            ffi::fi_send(
                self.inner.raw,
                buf.cast(),
                len,
                desc,
                dest.0,
                context as usize as *mut c_void,
            )
        };
        self.finish("fi_send", ret)
    }

    /// `fi_recv` into caller memory.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid, and not be accessed, until the completion for
    /// `context` is read; `mr` must cover it when the provider requires `FI_MR_LOCAL`.
    #[doc(alias = "fi_recv")]
    pub unsafe fn recv_raw(
        &self,
        buf: *mut u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        src: Address,
        context: u64,
    ) -> Result<()> {
        Self::check_context("fi_recv", context)?;
        let desc = self.raw_desc("fi_recv", mr)?;
        // SAFETY: forwarded contract.
        let ret = unsafe {
            ffi::fi_recv(
                self.inner.raw,
                buf.cast(),
                len,
                desc,
                src.0,
                context as usize as *mut c_void,
            )
        };
        self.finish("fi_recv", ret)
    }

    /// `fi_tsend` of caller memory with `tag`.
    ///
    /// # Safety
    /// As [`send_raw`](Self::send_raw).
    #[doc(alias = "fi_tsend")]
    pub unsafe fn tsend_raw(
        &self,
        buf: *const u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        dest: Address,
        tag: u64,
        context: u64,
    ) -> Result<()> {
        Self::check_context("fi_tsend", context)?;
        let desc = self.raw_desc("fi_tsend", mr)?;
        // SAFETY: forwarded contract.
        let ret = unsafe {
            ffi::fi_tsend(
                self.inner.raw,
                buf.cast(),
                len,
                desc,
                dest.0,
                tag,
                context as usize as *mut c_void,
            )
        };
        self.finish("fi_tsend", ret)
    }

    /// `fi_trecv` into caller memory, matching `tag` outside the `ignore` bits.
    ///
    /// # Safety
    /// As [`recv_raw`](Self::recv_raw).
    #[doc(alias = "fi_trecv")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn trecv_raw(
        &self,
        buf: *mut u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        src: Address,
        tag: u64,
        ignore: u64,
        context: u64,
    ) -> Result<()> {
        Self::check_context("fi_trecv", context)?;
        let desc = self.raw_desc("fi_trecv", mr)?;
        // SAFETY: forwarded contract.
        let ret = unsafe {
            ffi::fi_trecv(
                self.inner.raw,
                buf.cast(),
                len,
                desc,
                src.0,
                tag,
                ignore,
                context as usize as *mut c_void,
            )
        };
        self.finish("fi_trecv", ret)
    }

    /// `fi_write` from caller memory to `addr` (a value from [`RemoteMemory::address_at`])
    /// with `key`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and unmodified until the completion for `context`
    /// is read; `mr` must cover it when the provider requires `FI_MR_LOCAL`.
    #[allow(clippy::too_many_arguments)]
    #[doc(alias = "fi_write")]
    pub unsafe fn write_raw(
        &self,
        buf: *const u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        dest: Address,
        addr: u64,
        key: u64,
        context: u64,
    ) -> Result<()> {
        Self::check_context("fi_write", context)?;
        let desc = self.raw_desc("fi_write", mr)?;
        // SAFETY: forwarded contract.
        let ret = unsafe {
            ffi::fi_write(
                self.inner.raw,
                buf.cast(),
                len,
                desc,
                dest.0,
                addr,
                key,
                context as usize as *mut c_void,
            )
        };
        self.finish("fi_write", ret)
    }

    /// `fi_writedata` from caller memory, with remote CQ data.
    ///
    /// # Safety
    /// As [`write_raw`](Self::write_raw).
    #[allow(clippy::too_many_arguments)]
    #[doc(alias = "fi_writedata")]
    pub unsafe fn writedata_raw(
        &self,
        buf: *const u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        data: u64,
        dest: Address,
        addr: u64,
        key: u64,
        context: u64,
    ) -> Result<()> {
        Self::check_context("fi_writedata", context)?;
        let desc = self.raw_desc("fi_writedata", mr)?;
        // SAFETY: forwarded contract.
        let ret = unsafe {
            ffi::fi_writedata(
                self.inner.raw,
                buf.cast(),
                len,
                desc,
                data,
                dest.0,
                addr,
                key,
                context as usize as *mut c_void,
            )
        };
        self.finish("fi_writedata", ret)
    }

    /// `fi_writemsg` of one buffer from caller memory with per-operation `flags`
    /// (`FI_MORE`, `FI_DELIVERY_COMPLETE`, `FI_COMPLETION`, …), which replace the
    /// endpoint's default op flags for this write.
    ///
    /// # Safety
    /// As [`write_raw`](Self::write_raw).
    #[allow(clippy::too_many_arguments)]
    #[doc(alias = "fi_writemsg")]
    pub unsafe fn writemsg_raw(
        &self,
        buf: *const u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        dest: Address,
        addr: u64,
        key: u64,
        context: u64,
        flags: u64,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.writemsg_inner(buf, len, mr, dest, addr, key, context, flags, None) }
    }

    /// [`writemsg_raw`](Self::writemsg_raw) carrying remote CQ data `data`
    /// (`FI_REMOTE_CQ_DATA` is added to `flags`): e.g. a write with data whose completion
    /// must mean delivery (`FI_DELIVERY_COMPLETE`), which `fi_writedata` cannot ask for.
    ///
    /// # Safety
    /// As [`write_raw`](Self::write_raw).
    #[allow(clippy::too_many_arguments)]
    #[doc(alias = "fi_writemsg")]
    pub unsafe fn writedatamsg_raw(
        &self,
        buf: *const u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        data: u64,
        dest: Address,
        addr: u64,
        key: u64,
        context: u64,
        flags: u64,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            self.writemsg_inner(
                buf,
                len,
                mr,
                dest,
                addr,
                key,
                context,
                flags | ffi::FI_REMOTE_CQ_DATA,
                Some(data),
            )
        }
    }

    /// `fi_writemsg` of one buffer, with remote CQ data where `data` is given.
    ///
    /// # Safety
    /// As [`write_raw`](Self::write_raw).
    #[allow(clippy::too_many_arguments)]
    unsafe fn writemsg_inner(
        &self,
        buf: *const u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        dest: Address,
        addr: u64,
        key: u64,
        context: u64,
        flags: u64,
        data: Option<u64>,
    ) -> Result<()> {
        Self::check_context("fi_writemsg", context)?;
        let mut desc = self.raw_desc("fi_writemsg", mr)?;
        let iov = libc::iovec {
            iov_base: buf as *mut c_void,
            iov_len: len,
        };
        let rma = ffi::fi_rma_iov { addr, len, key };
        let msg = ffi::fi_msg_rma {
            msg_iov: ptr::addr_of!(iov).cast(),
            desc: &mut desc,
            iov_count: 1,
            addr: dest.0,
            rma_iov: &rma,
            rma_iov_count: 1,
            context: context as usize as *mut c_void,
            data: data.unwrap_or(0),
        };
        // SAFETY: msg points to locals valid for the call; the data's lifetime is the
        // caller's contract.
        let ret = unsafe { ffi::fi_writemsg(self.inner.raw, &msg, flags) };
        self.finish("fi_writemsg", ret)
    }

    /// `fi_atomicmsg`: `op` with the `count` elements of `dt` at `buf` applied to `addr`
    /// with `key`, with per-operation `flags` as for [`writemsg_raw`](Self::writemsg_raw).
    ///
    /// # Safety
    /// As [`write_raw`](Self::write_raw), for `count` elements of `dt` at `buf`.
    #[allow(clippy::too_many_arguments)]
    #[doc(alias = "fi_atomicmsg")]
    pub unsafe fn atomicmsg_raw(
        &self,
        buf: *const u8,
        count: usize,
        mr: Option<&MemoryRegion>,
        dest: Address,
        addr: u64,
        key: u64,
        dt: AtomicDatatype,
        op: AtomicOp,
        context: u64,
        flags: u64,
    ) -> Result<()> {
        Self::check_context("fi_atomicmsg", context)?;
        let mut desc = self.raw_desc("fi_atomicmsg", mr)?;
        let ioc = ffi::fi_ioc {
            addr: buf as *mut c_void,
            count,
        };
        let rma = ffi::fi_rma_ioc { addr, count, key };
        let msg = ffi::fi_msg_atomic {
            msg_iov: &ioc,
            desc: &mut desc,
            iov_count: 1,
            addr: dest.0,
            rma_iov: &rma,
            rma_iov_count: 1,
            datatype: dt.0,
            op: op.0,
            context: context as usize as *mut c_void,
            data: 0,
        };
        // SAFETY: msg points to locals valid for the call; the operand's lifetime is the
        // caller's contract.
        let ret = unsafe { ffi::fi_atomicmsg(self.inner.raw, &msg, flags) };
        self.finish("fi_atomicmsg", ret)
    }

    /// `fi_read` into caller memory from `addr` with `key`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid, and not be accessed, until the completion for
    /// `context` is read; `mr` must cover it when the provider requires `FI_MR_LOCAL`.
    #[allow(clippy::too_many_arguments)]
    #[doc(alias = "fi_read")]
    pub unsafe fn read_raw(
        &self,
        buf: *mut u8,
        len: usize,
        mr: Option<&MemoryRegion>,
        src: Address,
        addr: u64,
        key: u64,
        context: u64,
    ) -> Result<()> {
        Self::check_context("fi_read", context)?;
        let desc = self.raw_desc("fi_read", mr)?;
        // SAFETY: forwarded contract.
        let ret = unsafe {
            ffi::fi_read(
                self.inner.raw,
                buf.cast(),
                len,
                desc,
                src.0,
                addr,
                key,
                context as usize as *mut c_void,
            )
        };
        self.finish("fi_read", ret)
    }

    // ---- blocking helpers -----------------------------------------------------------

    /// Retries `post` while it returns [`Error::WouldBlock`], up to `deadline`. Between
    /// tries the endpoint's queues are read (completions are kept for later reads) and its
    /// event queue, if any, is checked, so an error explaining the back-pressure — a lost
    /// peer — is returned instead of spinning until the deadline.
    pub fn retry(&self, deadline: Instant, mut post: impl FnMut() -> Result<()>) -> Result<()> {
        let start = Instant::now();
        loop {
            match post() {
                Err(Error::WouldBlock { call }) => {
                    if Instant::now() >= deadline {
                        return Err(Error::TimedOut {
                            call,
                            after: start.elapsed(),
                        });
                    }
                    for cq in [&self.inner.tx_cq, &self.inner.rx_cq].into_iter().flatten() {
                        cq.poll_keep()?;
                    }
                    // A bound event queue reports what the queues may not: a peer that
                    // refuses to (re)connect (rxm) or went away.
                    if let Some(eq) = &self.inner.eq {
                        match eq.read() {
                            Ok(Some(ev)) if ev.event == ffi::FI_SHUTDOWN => {
                                return Err(Error::RemoteDisconnect {
                                    call,
                                    errno: ffi::FI_ESHUTDOWN,
                                    detail: "FI_SHUTDOWN event".into(),
                                    completion: None,
                                });
                            }
                            Ok(_) => {}
                            Err(e) => return Err(e),
                        }
                    }
                    std::thread::yield_now();
                }
                other => return other,
            }
        }
    }

    fn wait_tx(&self, call: &'static str, context: u64, deadline: Instant) -> Result<Completion> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.cq_for(call, true)?.wait_for(context, left)
    }

    /// [`write`](Self::write), retried on `WouldBlock`, then waits for its completion.
    #[allow(clippy::too_many_arguments)]
    pub fn write_sync(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        dest: Address,
        remote: &RemoteMemory,
        remote_offset: u64,
        context: u64,
        timeout: Duration,
    ) -> Result<Completion> {
        let deadline = Instant::now() + timeout;
        self.retry(deadline, || {
            self.write(buf, range.clone(), dest, remote, remote_offset, context)
        })?;
        self.wait_tx("fi_write", context, deadline)
    }

    /// [`read`](Self::read), retried on `WouldBlock`, then waits for its completion.
    #[allow(clippy::too_many_arguments)]
    pub fn read_sync(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        src: Address,
        remote: &RemoteMemory,
        remote_offset: u64,
        context: u64,
        timeout: Duration,
    ) -> Result<Completion> {
        let deadline = Instant::now() + timeout;
        self.retry(deadline, || {
            self.read(buf, range.clone(), src, remote, remote_offset, context)
        })?;
        self.wait_tx("fi_read", context, deadline)
    }

    /// [`send`](Self::send), retried on `WouldBlock`, then waits for its completion.
    pub fn send_sync(
        &self,
        buf: &RegisteredBuffer,
        range: Range<usize>,
        dest: Address,
        context: u64,
        timeout: Duration,
    ) -> Result<Completion> {
        let deadline = Instant::now() + timeout;
        self.retry(deadline, || self.send(buf, range.clone(), dest, context))?;
        self.wait_tx("fi_send", context, deadline)
    }

    // ---- connections (MSG) ----------------------------------------------------------

    fn eq(&self, call: &'static str) -> Result<&EventQueue> {
        self.inner
            .eq
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument {
                call,
                detail: "the endpoint has no event queue".into(),
            })
    }

    /// Starts connecting to the passive endpoint named `addr` (`fi_connect`); then
    /// [`wait_connected`](Self::wait_connected).
    #[doc(alias = "fi_connect")]
    pub fn connect(&self, addr: &[u8]) -> Result<()> {
        self.eq("fi_connect")?;
        // SAFETY: addr is a raw address of the endpoint's format, read during the call.
        cvt("fi_connect", unsafe {
            ffi::fi_connect(self.inner.raw, addr.as_ptr().cast(), ptr::null(), 0)
        })
    }

    /// Accepts the connection request this endpoint was opened for (`fi_accept`); then
    /// [`wait_connected`](Self::wait_connected).
    #[doc(alias = "fi_accept")]
    pub fn accept(&self) -> Result<()> {
        self.eq("fi_accept")?;
        // SAFETY: the endpoint is open; no connection data.
        cvt("fi_accept", unsafe {
            ffi::fi_accept(self.inner.raw, ptr::null(), 0)
        })
    }

    /// Waits for `FI_CONNECTED` on the endpoint's event queue.
    pub fn wait_connected(&self, timeout: Duration) -> Result<()> {
        self.eq("fi_eq_sread")?
            .wait_event(ffi::FI_CONNECTED, "FI_CONNECTED", timeout)
            .map(drop)
    }

    /// Waits for the peer's `FI_SHUTDOWN` on the endpoint's event queue.
    pub fn wait_shutdown(&self, timeout: Duration) -> Result<()> {
        self.eq("fi_eq_sread")?
            .wait_event(ffi::FI_SHUTDOWN, "FI_SHUTDOWN", timeout)
            .map(drop)
    }

    /// Closes the connection (`fi_shutdown`); the peer sees `FI_SHUTDOWN`.
    #[doc(alias = "fi_shutdown")]
    pub fn shutdown(&self) -> Result<()> {
        // SAFETY: the endpoint is open.
        cvt("fi_shutdown", unsafe {
            ffi::fi_shutdown(self.inner.raw, 0)
        })
    }
}
