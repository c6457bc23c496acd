//! Completion queues (`fid_cq`): reading, typed errors, blocking reads and wait fds.

use crate::av::Address;
use crate::domain::{Domain, DomainInner, Progressed};
use crate::error::{cvt, strerror, CompletionError, Error, Result};
use crate::{close_fid, ffi};
use parking_lot::Mutex;
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CStr};
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Contexts with this bit set are the crate's own (operations on owned buffers); user
/// contexts must leave it clear.
pub(crate) const INTERNAL_CONTEXT: u64 = 1 << 63;

/// The completion format (`enum fi_cq_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CqFormat {
    /// `FI_CQ_FORMAT_CONTEXT`: the context only.
    Context,
    /// `FI_CQ_FORMAT_MSG`: context, flags, length.
    Msg,
    /// `FI_CQ_FORMAT_DATA`: plus buffer and remote CQ data.
    Data,
    /// `FI_CQ_FORMAT_TAGGED`: plus the tag.
    Tagged,
}

impl CqFormat {
    fn raw(self) -> ffi::fi_cq_format {
        match self {
            CqFormat::Context => ffi::FI_CQ_FORMAT_CONTEXT,
            CqFormat::Msg => ffi::FI_CQ_FORMAT_MSG,
            CqFormat::Data => ffi::FI_CQ_FORMAT_DATA,
            CqFormat::Tagged => ffi::FI_CQ_FORMAT_TAGGED,
        }
    }
}

/// How a queue can be waited on (`enum fi_wait_obj`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitObj {
    /// `FI_WAIT_NONE`: poll only.
    None,
    /// `FI_WAIT_UNSPEC`: blocking reads (`sread`) with a provider-chosen mechanism.
    Unspec,
    /// `FI_WAIT_FD`: blocking reads and a file descriptor for `poll`/`epoll`.
    Fd,
}

impl WaitObj {
    pub(crate) fn raw(self) -> ffi::fi_wait_obj {
        match self {
            WaitObj::None => ffi::FI_WAIT_NONE,
            WaitObj::Unspec => ffi::FI_WAIT_UNSPEC,
            WaitObj::Fd => ffi::FI_WAIT_FD,
        }
    }
}

/// One completion, whatever the queue's format (fields the format lacks are 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Completion {
    /// The context given when the operation was posted.
    pub context: u64,
    /// `FI_SEND`, `FI_RECV`, `FI_WRITE | FI_RMA`, `FI_REMOTE_CQ_DATA`, … (see [`crate::Caps`]).
    pub flags: u64,
    /// Bytes received (receive completions).
    pub len: usize,
    /// Where received data starts (receive completions), as an address.
    pub buf: usize,
    /// Remote CQ data, valid when `flags` has `FI_REMOTE_CQ_DATA`.
    pub data: u64,
    /// The tag of a tagged receive.
    pub tag: u64,
    /// Who sent it, as a handle of the endpoint's address vector: only on a queue
    /// opened with [`CqBuilder::source`] (read with `fi_cq_readfrom`) and bound to an
    /// endpoint with [`crate::Caps::SOURCE`], for receives and remote CQ data; `None`
    /// where the provider could not tell (a sender whose address is not in the vector:
    /// `FI_ADDR_NOTAVAIL`) or was not asked.
    pub src: Option<Address>,
}

impl Completion {
    /// Whether `flags` contains every bit of `flag`.
    pub fn has(&self, flag: u64) -> bool {
        self.flags & flag == flag
    }
}

/// What an operation on owned memory keeps alive until its completion.
pub(crate) struct InFlight {
    pub(crate) user_context: u64,
    pub(crate) _keepalive: Arc<dyn Any + Send + Sync>,
}

pub(crate) struct CqInner {
    pub(crate) raw: *mut ffi::fid_cq,
    pub(crate) domain: Arc<DomainInner>,
    format: CqFormat,
    wait: WaitObj,
    /// Read with `fi_cq_readfrom` ([`CqBuilder::source`]).
    source: bool,
    inflight: Mutex<HashMap<u64, InFlight>>,
    inflight_count: AtomicUsize,
    next_internal: AtomicU64,
    stash: Mutex<VecDeque<Completion>>,
    stash_count: AtomicUsize,
}

// SAFETY: the CQ belongs to an FI_THREAD_SAFE domain (checked in Domain::new); the Rust
// side state is behind mutexes and atomics.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: the fid of an open CQ; endpoints bound to it hold an Arc and are closed.
        let _guard = self.domain.control_guard();
        close_fid("completion queue", crate::fid_of(self.raw));
    }
}

impl Progressed for CqInner {
    /// Progress without consuming entries (`fi_cq_read(cq, NULL, 0)`).
    fn progress(&self) {
        let mut scratch = ffi::fi_cq_tagged_entry::default();
        // SAFETY: a zero-count read of an open CQ: nothing is written to the scratch entry.
        let _ = unsafe { ffi::fi_cq_read(self.raw, ptr::addr_of_mut!(scratch).cast(), 0) };
    }
}

/// Most entries one read takes from the provider (one `fi_cq_read`, whose call also
/// progresses the provider once). A reader that asks for many must get many: `ofi_rxm`
/// takes up to 32 incoming messages off its connections per progress call, and a
/// message that finds no posted receive waits in a bounce buffer of its own, without
/// bound; a reader taking fewer entries per call than that (16 before) let a flood of
/// small messages grow those buffers by the difference on every call
/// (`docs/BENCHMARKS.md`, "load under attack").
const READ_BATCH: usize = 128;

impl CqInner {
    pub(crate) fn register(&self, user_context: u64, keepalive: Arc<dyn Any + Send + Sync>) -> u64 {
        let id = INTERNAL_CONTEXT | self.next_internal.fetch_add(1, Ordering::Relaxed);
        let mut map = self.inflight.lock();
        map.insert(
            id,
            InFlight {
                user_context,
                _keepalive: keepalive,
            },
        );
        self.inflight_count.fetch_add(1, Ordering::Release);
        id
    }

    /// Undo `register` for an operation that was never posted.
    pub(crate) fn unregister(&self, id: u64) {
        let mut map = self.inflight.lock();
        if map.remove(&id).is_some() {
            self.inflight_count.fetch_sub(1, Ordering::Release);
        }
    }

    /// Maps a context read from the queue to the user's, releasing owned memory.
    fn resolve(&self, context: u64) -> u64 {
        if context & INTERNAL_CONTEXT == 0 || self.inflight_count.load(Ordering::Acquire) == 0 {
            return context;
        }
        let mut map = self.inflight.lock();
        match map.remove(&context) {
            Some(op) => {
                self.inflight_count.fetch_sub(1, Ordering::Release);
                op.user_context
            }
            None => context,
        }
    }

    fn read_raw(&self, out: &mut [Completion]) -> Result<usize> {
        macro_rules! read_as {
            ($ty:ty, |$e:ident| $conv:expr) => {{
                let mut buf: [MaybeUninit<$ty>; READ_BATCH] =
                    [const { MaybeUninit::uninit() }; READ_BATCH];
                let mut from = [ffi::FI_ADDR_NOTAVAIL; READ_BATCH];
                let n = out.len().min(buf.len());
                let ret = if self.source {
                    // SAFETY: buf has room for n entries of the queue's format, `from` for
                    // n source addresses.
                    unsafe {
                        ffi::fi_cq_readfrom(self.raw, buf.as_mut_ptr().cast(), n, from.as_mut_ptr())
                    }
                } else {
                    // SAFETY: buf has room for n entries of the queue's format.
                    unsafe { ffi::fi_cq_read(self.raw, buf.as_mut_ptr().cast(), n) }
                };
                if ret > 0 {
                    for ((dst, src), addr) in out.iter_mut().zip(&buf[..ret as usize]).zip(from) {
                        // SAFETY: the provider initialised the first `ret` entries.
                        let $e = unsafe { src.assume_init_ref() };
                        *dst = $conv;
                        dst.context = self.resolve(dst.context);
                        dst.src = (self.source && addr != ffi::FI_ADDR_NOTAVAIL)
                            .then_some(Address(addr));
                    }
                }
                ret
            }};
        }
        let ret = match self.format {
            CqFormat::Context => read_as!(ffi::fi_cq_entry, |e| Completion {
                context: e.op_context as u64,
                flags: 0,
                len: 0,
                buf: 0,
                data: 0,
                tag: 0,
                src: None
            }),
            CqFormat::Msg => read_as!(ffi::fi_cq_msg_entry, |e| Completion {
                context: e.op_context as u64,
                flags: e.flags,
                len: e.len,
                buf: 0,
                data: 0,
                tag: 0,
                src: None
            }),
            CqFormat::Data => read_as!(ffi::fi_cq_data_entry, |e| Completion {
                context: e.op_context as u64,
                flags: e.flags,
                len: e.len,
                buf: e.buf as usize,
                data: e.data,
                tag: 0,
                src: None
            }),
            CqFormat::Tagged => read_as!(ffi::fi_cq_tagged_entry, |e| Completion {
                context: e.op_context as u64,
                flags: e.flags,
                len: e.len,
                buf: e.buf as usize,
                data: e.data,
                tag: e.tag,
                src: None
            }),
        };
        self.convert(ret, "fi_cq_read")
    }

    fn convert(&self, ret: isize, call: &'static str) -> Result<usize> {
        if ret >= 0 {
            Ok(ret as usize)
        } else if ret == -(ffi::FI_EAGAIN as isize) {
            Ok(0)
        } else if ret == -(ffi::FI_EAVAIL as isize) {
            Err(self.read_error(call))
        } else {
            Err(Error::from_ret(call, ret))
        }
    }

    /// `fi_cq_readerr` turned into a typed error.
    fn read_error(&self, call: &'static str) -> Error {
        let mut entry = ffi::fi_cq_err_entry::default();
        // SAFETY: entry is a zeroed fi_cq_err_entry (err_data_size 0: the provider keeps
        // its own error data buffer).
        let ret = unsafe { ffi::fi_cq_readerr(self.raw, &mut entry, 0) };
        if ret < 0 {
            return Error::from_ret("fi_cq_readerr", ret);
        }
        let mut text = [0 as std::ffi::c_char; 256];
        // SAFETY: text is a writable buffer of the given length; err_data comes from the
        // entry just read.
        let prov_message = unsafe {
            let p = ffi::fi_cq_strerror(
                self.raw,
                entry.prov_errno,
                entry.err_data,
                text.as_mut_ptr(),
                text.len(),
            );
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        // Some providers (shm 1.17) report negative errnos here.
        let errno = entry.err.abs();
        Error::completion(CompletionError {
            call,
            context: self.resolve(entry.op_context as u64),
            flags: entry.flags,
            len: entry.len,
            data: entry.data,
            tag: entry.tag,
            olen: entry.olen,
            errno,
            prov_errno: entry.prov_errno,
            message: strerror(errno),
            prov_message,
        })
    }
}

/// A completion queue (`fid_cq`).
///
/// Reading progresses the provider. Operations on owned buffers are resolved here: their
/// completions carry the context the caller gave, and the buffer is released.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("format", &self.inner.format)
            .field("wait", &self.inner.wait)
            .field("source", &self.inner.source)
            .finish()
    }
}

/// Attributes of a new [`CompletionQueue`] (`struct fi_cq_attr`).
#[derive(Debug, Clone)]
pub struct CqBuilder {
    size: usize,
    format: CqFormat,
    wait: WaitObj,
    source: bool,
}

impl Default for CqBuilder {
    fn default() -> Self {
        CqBuilder {
            size: 0,
            format: CqFormat::Tagged,
            wait: WaitObj::None,
            source: false,
        }
    }
}

impl CqBuilder {
    /// Queue depth (`size`; 0: the provider's default).
    pub fn size(mut self, size: usize) -> Self {
        self.size = size;
        self
    }
    /// Entry format (`format`; default [`CqFormat::Tagged`], the richest).
    pub fn format(mut self, format: CqFormat) -> Self {
        self.format = format;
        self
    }
    /// Wait object (`wait_obj`; default [`WaitObj::None`]).
    pub fn wait_obj(mut self, wait: WaitObj) -> Self {
        self.wait = wait;
        self
    }

    /// Read with `fi_cq_readfrom`, so that each completion tells who sent it
    /// ([`Completion::src`]); the endpoints bound to it need [`crate::Caps::SOURCE`]
    /// (default off: `fi_cq_read`).
    #[doc(alias = "fi_cq_readfrom")]
    pub fn source(mut self, on: bool) -> Self {
        self.source = on;
        self
    }

    /// Opens the queue (`fi_cq_open`).
    #[doc(alias = "fi_cq_open")]
    pub fn open(self, domain: &Domain) -> Result<CompletionQueue> {
        let mut attr = ffi::fi_cq_attr {
            size: self.size,
            format: self.format.raw(),
            wait_obj: self.wait.raw(),
            ..Default::default()
        };
        let mut raw = ptr::null_mut();
        // SAFETY: domain is open; attr is valid; raw receives the new CQ.
        let ret =
            unsafe { ffi::fi_cq_open(domain.inner.raw, &mut attr, &mut raw, ptr::null_mut()) };
        cvt("fi_cq_open", ret).map_err(|e| e.context(|| format!("{self:?}")))?;
        let inner = Arc::new(CqInner {
            raw,
            domain: Arc::clone(&domain.inner),
            format: self.format,
            wait: self.wait,
            source: self.source,
            inflight: Mutex::new(HashMap::new()),
            inflight_count: AtomicUsize::new(0),
            next_internal: AtomicU64::new(1),
            stash: Mutex::new(VecDeque::new()),
            stash_count: AtomicUsize::new(0),
        });
        if let Some(progress) = &domain.inner.progress {
            progress.add(&inner);
        }
        Ok(CompletionQueue { inner })
    }
}

impl CompletionQueue {
    /// A builder for a new queue.
    pub fn builder() -> CqBuilder {
        CqBuilder::default()
    }

    /// The raw `fid_cq`.
    pub fn as_raw(&self) -> *mut ffi::fid_cq {
        self.inner.raw
    }

    /// Wraps an open `fid_cq` of `domain` with the given format.
    ///
    /// # Safety
    /// `raw` must be an open CQ of `domain`, opened with `format` and `wait`, owned by
    /// nobody else (closed on drop).
    pub unsafe fn from_raw(
        domain: &Domain,
        raw: *mut ffi::fid_cq,
        format: CqFormat,
        wait: WaitObj,
    ) -> CompletionQueue {
        CompletionQueue {
            inner: Arc::new(CqInner {
                raw,
                domain: Arc::clone(&domain.inner),
                format,
                wait,
                source: false,
                inflight: Mutex::new(HashMap::new()),
                inflight_count: AtomicUsize::new(0),
                next_internal: AtomicU64::new(1),
                stash: Mutex::new(VecDeque::new()),
                stash_count: AtomicUsize::new(0),
            }),
        }
    }

    /// The entry format.
    pub fn format(&self) -> CqFormat {
        self.inner.format
    }

    /// Reads up to `out.len()` completions (`fi_cq_read`); `Ok(0)` when the queue is empty.
    /// A failed operation is returned as its typed error (`fi_cq_readerr`):
    /// [`Error::Completion`], or [`Error::RemoteDisconnect`] when the peer went away.
    #[doc(alias = "fi_cq_read")]
    #[doc(alias = "fi_cq_readerr")]
    pub fn read(&self, out: &mut [Completion]) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        if self.inner.stash_count.load(Ordering::Acquire) > 0 {
            let mut stash = self.inner.stash.lock();
            let mut n = 0;
            while n < out.len() {
                match stash.pop_front() {
                    Some(c) => {
                        out[n] = c;
                        n += 1;
                    }
                    None => break,
                }
            }
            self.inner.stash_count.store(stash.len(), Ordering::Release);
            if n > 0 {
                return Ok(n);
            }
        }
        self.inner.read_raw(out)
    }

    /// Reads one completion, `Ok(None)` when the queue is empty.
    pub fn read_one(&self) -> Result<Option<Completion>> {
        let mut c = [Completion::default(); 1];
        Ok((self.read(&mut c)? == 1).then_some(c[0]))
    }

    /// Progresses the provider without consuming completions.
    pub fn progress(&self) {
        self.inner.progress();
    }

    /// Reads what is available into the queue's own buffer, so later reads still return
    /// it, and returns an error entry as its typed error. Used while retrying a post.
    pub(crate) fn poll_keep(&self) -> Result<()> {
        let mut buf = [Completion::default(); 16];
        let n = self.inner.read_raw(&mut buf)?;
        if n > 0 {
            let mut stash = self.inner.stash.lock();
            stash.extend(&buf[..n]);
            self.inner.stash_count.store(stash.len(), Ordering::Release);
        }
        Ok(())
    }

    /// Blocks until at least one completion arrives or `timeout` passes (`fi_cq_sread`).
    /// Needs a queue opened with a wait object. A timeout is [`Error::TimedOut`].
    #[doc(alias = "fi_cq_sread")]
    pub fn sread(&self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        if self.inner.wait == WaitObj::None {
            return Err(Error::InvalidArgument {
                call: "fi_cq_sread",
                detail: "the queue was opened with WaitObj::None".into(),
            });
        }
        let n = self.read(out)?;
        if n > 0 {
            return Ok(n);
        }
        if self.inner.domain.info.data_progress() == crate::Progress::MANUAL {
            // Manual progress: libfabric 1.17's utility CQs (shm) may block past the
            // timeout in fi_cq_sread; reading progresses them, so poll instead.
            let deadline = Instant::now() + timeout;
            loop {
                let n = self.read(out)?;
                if n > 0 {
                    return Ok(n);
                }
                if Instant::now() >= deadline {
                    return Err(Error::TimedOut {
                        call: "fi_cq_sread",
                        after: timeout,
                    });
                }
                std::thread::yield_now();
            }
        }
        let mut buf = [ffi::fi_cq_tagged_entry::default(); 16];
        let count = out.len().min(buf.len());
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        let mut from = [ffi::FI_ADDR_NOTAVAIL; 16];
        let ret = if self.inner.source {
            // SAFETY: as below; `from` has room for `count` source addresses.
            unsafe {
                ffi::fi_cq_sreadfrom(
                    self.inner.raw,
                    buf.as_mut_ptr().cast(),
                    count,
                    from.as_mut_ptr(),
                    ptr::null(),
                    ms,
                )
            }
        } else {
            // SAFETY: buf is large enough for `count` entries of any format (tagged is
            // the largest); the CQ has a wait object.
            unsafe {
                ffi::fi_cq_sread(
                    self.inner.raw,
                    buf.as_mut_ptr().cast(),
                    count,
                    ptr::null(),
                    ms,
                )
            }
        };
        if ret == -(ffi::FI_EAGAIN as isize) || ret == -(ffi::FI_ETIMEDOUT as isize) {
            return Err(Error::TimedOut {
                call: "fi_cq_sread",
                after: timeout,
            });
        }
        let n = self.inner.convert(ret, "fi_cq_sread")?;
        // Re-decode the raw entries according to the format.
        let base = buf.as_ptr().cast::<u8>();
        for (i, dst) in out.iter_mut().enumerate().take(n) {
            // SAFETY: the provider wrote n entries of the queue's format contiguously.
            *dst = unsafe { decode(self.inner.format, base, i) };
            dst.context = self.inner.resolve(dst.context);
            dst.src =
                (self.inner.source && from[i] != ffi::FI_ADDR_NOTAVAIL).then_some(Address(from[i]));
        }
        Ok(n)
    }

    /// The file descriptor to wait on (`fi_control(FI_GETWAIT)`), for a queue opened
    /// with [`WaitObj::Fd`]. Before sleeping on it, call [`CompletionQueue::trywait`].
    #[doc(alias = "fi_control")]
    pub fn wait_fd(&self) -> Result<RawFd> {
        let mut fd: RawFd = -1;
        // SAFETY: FI_GETWAIT on a CQ with FI_WAIT_FD writes an int.
        let ret = unsafe {
            ffi::fi_control(
                ptr::addr_of_mut!((*self.inner.raw).fid),
                ffi::FI_GETWAIT as i32,
                ptr::addr_of_mut!(fd).cast::<c_void>(),
            )
        };
        cvt("fi_control(FI_GETWAIT)", ret)?;
        Ok(fd)
    }

    /// `fi_trywait`: `Ok(true)` when it is safe to block on the wait fd (nothing pending),
    /// `Ok(false)` when the queue must be read first.
    #[doc(alias = "fi_trywait")]
    pub fn trywait(&self) -> Result<bool> {
        let mut fid = [
            // SAFETY: the fid of the open CQ.
            unsafe { ptr::addr_of_mut!((*self.inner.raw).fid) },
        ];
        // SAFETY: the fabric is open; fid is a one-element array of open fids.
        let ret = unsafe { ffi::fi_trywait(self.inner.domain.fabric_raw(), fid.as_mut_ptr(), 1) };
        if ret == -ffi::FI_EAGAIN {
            return Ok(false);
        }
        cvt("fi_trywait", ret)?;
        Ok(true)
    }

    /// Polls (progressing) until the completion whose context is `context` arrives, or
    /// `timeout` passes. Other completions read meanwhile are kept and returned by later
    /// reads. An error completion for `context` is returned as its typed error; an error
    /// for another operation is returned too (it cannot be kept).
    pub fn wait_for(&self, context: u64, timeout: Duration) -> Result<Completion> {
        let deadline = Instant::now() + timeout;
        {
            let mut stash = self.inner.stash.lock();
            if let Some(pos) = stash.iter().position(|c| c.context == context) {
                let c = stash.remove(pos).unwrap_or_default();
                self.inner.stash_count.store(stash.len(), Ordering::Release);
                return Ok(c);
            }
        }
        let mut buf = [Completion::default(); 16];
        loop {
            let n = self.inner.read_raw(&mut buf)?;
            let mut found = None;
            let mut others = Vec::new();
            for c in &buf[..n] {
                if found.is_none() && c.context == context {
                    found = Some(*c);
                } else {
                    others.push(*c);
                }
            }
            if !others.is_empty() {
                let mut stash = self.inner.stash.lock();
                stash.extend(others);
                self.inner.stash_count.store(stash.len(), Ordering::Release);
            }
            if let Some(c) = found {
                return Ok(c);
            }
            if Instant::now() >= deadline {
                return Err(Error::TimedOut {
                    call: "fi_cq_read",
                    after: timeout,
                });
            }
            if n == 0 {
                std::hint::spin_loop();
            }
        }
    }

    /// Reads until `count` completions arrived or `timeout` passes, returning them.
    pub fn wait_n(&self, count: usize, timeout: Duration) -> Result<Vec<Completion>> {
        let deadline = Instant::now() + timeout;
        let mut got = Vec::with_capacity(count);
        let mut buf = [Completion::default(); 16];
        while got.len() < count {
            let want = (count - got.len()).min(buf.len());
            let n = self.read(&mut buf[..want])?;
            got.extend_from_slice(&buf[..n]);
            if n == 0 && Instant::now() >= deadline {
                return Err(Error::TimedOut {
                    call: "fi_cq_read",
                    after: timeout,
                });
            }
        }
        Ok(got)
    }
}

/// SAFETY: `base` points to at least `i + 1` entries of `format`.
unsafe fn decode(format: CqFormat, base: *const u8, i: usize) -> Completion {
    // SAFETY: guaranteed by the caller; entries are read unaligned-safe via read_unaligned.
    unsafe {
        match format {
            CqFormat::Context => {
                let e = base.cast::<ffi::fi_cq_entry>().add(i).read_unaligned();
                Completion {
                    context: e.op_context as u64,
                    ..Default::default()
                }
            }
            CqFormat::Msg => {
                let e = base.cast::<ffi::fi_cq_msg_entry>().add(i).read_unaligned();
                Completion {
                    context: e.op_context as u64,
                    flags: e.flags,
                    len: e.len,
                    ..Default::default()
                }
            }
            CqFormat::Data => {
                let e = base.cast::<ffi::fi_cq_data_entry>().add(i).read_unaligned();
                Completion {
                    context: e.op_context as u64,
                    flags: e.flags,
                    len: e.len,
                    buf: e.buf as usize,
                    data: e.data,
                    tag: 0,
                    src: None,
                }
            }
            CqFormat::Tagged => {
                let e = base
                    .cast::<ffi::fi_cq_tagged_entry>()
                    .add(i)
                    .read_unaligned();
                Completion {
                    context: e.op_context as u64,
                    flags: e.flags,
                    len: e.len,
                    buf: e.buf as usize,
                    data: e.data,
                    tag: e.tag,
                    src: None,
                }
            }
        }
    }
}
