//! Completion queues (classic and extended), work completions, completion channels.

use crate::device::{set_nonblocking, Context};
use crate::error::{cvt, cvt_ptr, Error, Result};
use crate::ffi;
use crate::newtype::c_newtype;
use crate::status::WcStatus;
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

c_newtype! {
    /// Work completion opcode (`enum ibv_wc_opcode`).
    WcOpcode(u32) {
        /// `IBV_WC_SEND`
        SEND = ffi::IBV_WC_SEND,
        /// `IBV_WC_RDMA_WRITE`
        RDMA_WRITE = ffi::IBV_WC_RDMA_WRITE,
        /// `IBV_WC_RDMA_READ`
        RDMA_READ = ffi::IBV_WC_RDMA_READ,
        /// `IBV_WC_COMP_SWAP`
        COMP_SWAP = ffi::IBV_WC_COMP_SWAP,
        /// `IBV_WC_FETCH_ADD`
        FETCH_ADD = ffi::IBV_WC_FETCH_ADD,
        /// `IBV_WC_BIND_MW`
        BIND_MW = ffi::IBV_WC_BIND_MW,
        /// `IBV_WC_LOCAL_INV`
        LOCAL_INV = ffi::IBV_WC_LOCAL_INV,
        /// `IBV_WC_TSO`
        TSO = ffi::IBV_WC_TSO,
        /// `IBV_WC_RECV`
        RECV = ffi::IBV_WC_RECV,
        /// `IBV_WC_RECV_RDMA_WITH_IMM`
        RECV_RDMA_WITH_IMM = ffi::IBV_WC_RECV_RDMA_WITH_IMM,
    }
}

/// One work completion (`struct ibv_wc`). `#[repr(transparent)]`, so a slice of these is
/// what `ibv_poll_cq` fills.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct WorkCompletion {
    raw: ffi::ibv_wc,
}

impl Default for WorkCompletion {
    fn default() -> Self {
        // SAFETY: all-zero is a valid `ibv_wc`.
        let raw = unsafe { std::mem::zeroed() };
        WorkCompletion { raw }
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("qp_num", &self.qp_num())
            .field("imm_data", &self.imm_data())
            .finish()
    }
}

impl WorkCompletion {
    /// The `wr_id` of the work request.
    pub fn wr_id(&self) -> u64 {
        self.raw.wr_id
    }
    /// The status.
    pub fn status(&self) -> WcStatus {
        WcStatus(self.raw.status)
    }
    /// Whether the status is `IBV_WC_SUCCESS`.
    pub fn is_success(&self) -> bool {
        self.raw.status == ffi::IBV_WC_SUCCESS
    }
    /// The opcode (only meaningful on success).
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode(self.raw.opcode)
    }
    /// Bytes received (receive completions) or transferred.
    pub fn byte_len(&self) -> u32 {
        self.raw.byte_len
    }
    /// The immediate data in host order, if the completion carries one
    /// (`IBV_WC_WITH_IMM`).
    pub fn imm_data(&self) -> Option<u32> {
        if self.raw.wc_flags & ffi::IBV_WC_WITH_IMM != 0 {
            // SAFETY: the union holds `imm_data` when IBV_WC_WITH_IMM is set.
            Some(u32::from_be(unsafe { self.raw.__bindgen_anon_1.imm_data }))
        } else {
            None
        }
    }
    /// The rkey the peer invalidated with a SEND_WITH_INV (`IBV_WC_WITH_INV`), on a
    /// receive completion.
    pub fn invalidated_rkey(&self) -> Option<u32> {
        if self.raw.wc_flags & ffi::IBV_WC_WITH_INV != 0 {
            // SAFETY: the union holds `invalidated_rkey` when IBV_WC_WITH_INV is set.
            Some(unsafe { self.raw.__bindgen_anon_1.invalidated_rkey })
        } else {
            None
        }
    }
    /// Local QP number.
    pub fn qp_num(&self) -> u32 {
        self.raw.qp_num
    }
    /// Source QP (UD receives).
    pub fn src_qp(&self) -> u32 {
        self.raw.src_qp
    }
    /// Whether a GRH precedes the payload in the receive buffer (UD).
    pub fn has_grh(&self) -> bool {
        self.raw.wc_flags & ffi::IBV_WC_GRH != 0
    }
    /// Provider-specific error detail.
    pub fn vendor_err(&self) -> u32 {
        self.raw.vendor_err
    }
    /// `Ok(())` on success, else the typed error: [`Error::RemoteDisconnect`] for flushed
    /// and retry-exceeded completions, [`Error::WorkCompletion`] for the others.
    pub fn result(&self) -> Result<()> {
        let status = self.status();
        match status {
            WcStatus::SUCCESS => Ok(()),
            WcStatus::WR_FLUSH_ERR | WcStatus::RETRY_EXC_ERR | WcStatus::RNR_RETRY_EXC_ERR => {
                Err(Error::RemoteDisconnect {
                    wr_id: self.wr_id(),
                    status,
                    qp_num: self.qp_num(),
                })
            }
            _ => Err(Error::WorkCompletion {
                wr_id: self.wr_id(),
                status,
                vendor_err: self.vendor_err(),
                qp_num: self.qp_num(),
            }),
        }
    }
    /// The C struct.
    pub fn as_ffi(&self) -> &ffi::ibv_wc {
        &self.raw
    }
}

struct ChannelInner {
    ch: NonNull<ffi::ibv_comp_channel>,
    _ctx: Context,
}

// SAFETY: a completion channel is a file descriptor plus bookkeeping that rdma-core uses
// from any thread (ibv_get_cq_event may be called concurrently with other verbs).
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel holds a clone, so none is left.
        let ret = unsafe { ffi::ibv_destroy_comp_channel(self.ch.as_ptr()) };
        if let Err(err) = cvt(ret, "ibv_destroy_comp_channel") {
            tracing::error!(%err, "destroying a completion channel failed");
        }
    }
}

/// A completion channel (`struct ibv_comp_channel`): a file descriptor that becomes
/// readable when an armed CQ gets a completion. Register [`AsFd`] with epoll, mio or
/// tokio's `AsyncFd` (after [`set_nonblocking`](Self::set_nonblocking)); this crate
/// depends on no runtime.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.as_raw_fd())
            .finish()
    }
}

/// A completion event read from a channel (already acknowledged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqEvent {
    /// Kernel handle of the CQ that got the completion ([`CompletionQueue::handle`]).
    pub cq_handle: u32,
}

impl Context {
    /// Create a completion channel (`ibv_create_comp_channel`).
    #[doc(alias = "ibv_create_comp_channel")]
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        // SAFETY: open context.
        let ch = cvt_ptr(
            unsafe { ffi::ibv_create_comp_channel(self.as_raw()) },
            "ibv_create_comp_channel",
        )?;
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                ch,
                _ctx: self.clone(),
            }),
        })
    }

    /// Create a classic CQ with at least `cqe` entries (`ibv_create_cq`), optionally
    /// reporting to `channel` (arm it with [`CompletionQueue::req_notify`]).
    #[doc(alias = "ibv_create_cq")]
    pub fn create_cq(
        &self,
        cqe: u32,
        channel: Option<&CompletionChannel>,
        comp_vector: u32,
    ) -> Result<CompletionQueue> {
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.inner.ch.as_ptr());
        // SAFETY: open context; `ch` is null or a live channel of it.
        let cq = unsafe {
            ffi::ibv_create_cq(
                self.as_raw(),
                cqe as i32,
                std::ptr::null_mut(),
                ch,
                comp_vector as i32,
            )
        };
        let cq = cvt_ptr(cq, "ibv_create_cq")?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                cq,
                ex: None,
                wc_flags: WcFlags::empty(),
                kernel_wc_flags: self.reports_kernel_wc_flags(),
                ctx: self.clone(),
                channel: channel.cloned(),
            }),
        })
    }

    /// Create an extended CQ (`ibv_create_cq_ex`).
    #[doc(alias = "ibv_create_cq_ex")]
    pub fn create_cq_ex(&self, attr: &CqInitAttrEx) -> Result<CompletionQueue> {
        let mut raw = attr.raw;
        if let Some(ch) = &attr.channel {
            raw.channel = ch.inner.ch.as_ptr();
        }
        // SAFETY: open context; `raw` is fully initialised.
        let cq = unsafe { ffi::ibv_create_cq_ex(self.as_raw(), &mut raw) };
        let ex = cvt_ptr(cq, "ibv_create_cq_ex")?;
        // SAFETY: `ex` is a live extended CQ; ibv_cq_ex_to_cq only casts.
        let cq = NonNull::new(unsafe { ffi::ibv_cq_ex_to_cq(ex.as_ptr()) })
            .expect("ibv_cq_ex_to_cq of a live CQ");
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                cq,
                ex: Some(ex),
                wc_flags: WcFlags::from_bits_retain(attr.raw.wc_flags),
                kernel_wc_flags: self.reports_kernel_wc_flags(),
                ctx: self.clone(),
                channel: attr.channel.clone(),
            }),
        })
    }
}

impl CompletionChannel {
    /// The raw `ibv_comp_channel`.
    pub fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.inner.ch.as_ptr()
    }

    /// Make [`get_event`](Self::get_event) return [`Error::WouldBlock`] instead of
    /// blocking when no event is pending.
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<()> {
        set_nonblocking(self.as_raw_fd(), nonblocking)
    }

    /// Read one completion event (`ibv_get_cq_event`) and acknowledge it at once
    /// (`ibv_ack_cq_events`), so that destroying the CQ never waits. Re-arm the CQ with
    /// [`CompletionQueue::req_notify`] and then poll it.
    #[doc(alias = "ibv_get_cq_event")]
    #[doc(alias = "ibv_ack_cq_events")]
    pub fn get_event(&self) -> Result<CqEvent> {
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: live channel; valid out-pointers.
        let ret = unsafe { ffi::ibv_get_cq_event(self.as_raw(), &mut cq, &mut ctx) };
        if ret != 0 {
            return Err(Error::last("ibv_get_cq_event"));
        }
        // SAFETY: the CQ cannot be destroyed while this event is unacknowledged.
        let cq_handle = unsafe { (*cq).handle };
        // SAFETY: one event of `cq` was read and is acknowledged once.
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(CqEvent { cq_handle })
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: live channel.
        unsafe { (*self.as_raw()).fd }
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open while the channel lives.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

bitflags::bitflags! {
    /// Fields an extended CQ reports (`enum ibv_create_cq_wc_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct WcFlags: u64 {
        /// `IBV_WC_EX_WITH_BYTE_LEN`
        const BYTE_LEN = ffi::IBV_WC_EX_WITH_BYTE_LEN as u64;
        /// `IBV_WC_EX_WITH_IMM`
        const IMM = ffi::IBV_WC_EX_WITH_IMM as u64;
        /// `IBV_WC_EX_WITH_QP_NUM`
        const QP_NUM = ffi::IBV_WC_EX_WITH_QP_NUM as u64;
        /// `IBV_WC_EX_WITH_SRC_QP`
        const SRC_QP = ffi::IBV_WC_EX_WITH_SRC_QP as u64;
        /// `IBV_WC_EX_WITH_SLID`
        const SLID = ffi::IBV_WC_EX_WITH_SLID as u64;
        /// `IBV_WC_EX_WITH_SL`
        const SL = ffi::IBV_WC_EX_WITH_SL as u64;
        /// `IBV_WC_EX_WITH_DLID_PATH_BITS`
        const DLID_PATH_BITS = ffi::IBV_WC_EX_WITH_DLID_PATH_BITS as u64;
        /// `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`
        const COMPLETION_TIMESTAMP = ffi::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP as u64;
    }
}

/// Attributes of an extended CQ (`struct ibv_cq_init_attr_ex`); setters named after the
/// C fields.
#[derive(Clone)]
pub struct CqInitAttrEx {
    raw: ffi::ibv_cq_init_attr_ex,
    channel: Option<CompletionChannel>,
}

impl fmt::Debug for CqInitAttrEx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqInitAttrEx")
            .field("cqe", &self.raw.cqe)
            .field("wc_flags", &WcFlags::from_bits_retain(self.raw.wc_flags))
            .finish_non_exhaustive()
    }
}

impl CqInitAttrEx {
    /// `cqe` entries; reports byte length, immediate data, QP number and source QP.
    pub fn new(cqe: u32) -> Self {
        // SAFETY: all-zero is a valid `ibv_cq_init_attr_ex`.
        let mut raw: ffi::ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
        raw.cqe = cqe;
        raw.wc_flags =
            (WcFlags::BYTE_LEN | WcFlags::IMM | WcFlags::QP_NUM | WcFlags::SRC_QP).bits();
        CqInitAttrEx { raw, channel: None }
    }
    /// `wc_flags`
    pub fn wc_flags(mut self, flags: WcFlags) -> Self {
        self.raw.wc_flags = flags.bits();
        self
    }
    /// `channel`
    pub fn channel(mut self, channel: &CompletionChannel) -> Self {
        self.channel = Some(channel.clone());
        self
    }
    /// `comp_vector`
    pub fn comp_vector(mut self, vector: u32) -> Self {
        self.raw.comp_vector = vector;
        self
    }
}

pub(crate) struct CqInner {
    pub(crate) cq: NonNull<ffi::ibv_cq>,
    ex: Option<NonNull<ffi::ibv_cq_ex>>,
    wc_flags: WcFlags,
    /// Swap `wc_flags` bits 2 and 3 after polling (see `Context::reports_kernel_wc_flags`).
    kernel_wc_flags: bool,
    ctx: Context,
    channel: Option<CompletionChannel>,
}

// SAFETY: rdma-core CQs may be polled and used from any thread; the providers lock the CQ
// internally (unless created with IBV_CREATE_CQ_ATTR_SINGLE_THREADED, which this crate
// never sets).
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP/SRQ using the CQ holds a clone, so none is left; events from
        // the channel are acknowledged as they are read, so this does not block.
        let ret = unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
        if let Err(err) = cvt(ret, "ibv_destroy_cq") {
            tracing::error!(%err, "destroying a completion queue failed");
        }
    }
}

/// A completion queue (`struct ibv_cq`, or `struct ibv_cq_ex` when extended). Cheap to
/// clone; shared by the QPs that use it.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("handle", &self.handle())
            .field("cqe", &self.cqe())
            .field("extended", &self.inner.ex.is_some())
            .finish()
    }
}

/// One completion of an extended CQ, read field by field (`ibv_wc_read_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExCompletion {
    /// `wr_id`
    pub wr_id: u64,
    /// `status`
    pub status: WcStatus,
    /// `ibv_wc_read_opcode`
    pub opcode: WcOpcode,
    /// `ibv_wc_read_vendor_err`
    pub vendor_err: u32,
    /// `ibv_wc_read_byte_len` (0 unless [`WcFlags::BYTE_LEN`]).
    pub byte_len: u32,
    /// `ibv_wc_read_imm_data` in host order (with [`WcFlags::IMM`] and an immediate).
    pub imm_data: Option<u32>,
    /// `ibv_wc_read_qp_num` (0 unless [`WcFlags::QP_NUM`]).
    pub qp_num: u32,
    /// `ibv_wc_read_src_qp` (0 unless [`WcFlags::SRC_QP`]).
    pub src_qp: u32,
    /// `ibv_wc_read_completion_ts` (with [`WcFlags::COMPLETION_TIMESTAMP`]).
    pub completion_ts: Option<u64>,
}

impl CompletionQueue {
    /// The raw `ibv_cq`.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.cq.as_ptr()
    }

    /// The raw `ibv_cq_ex`, if this CQ was created extended.
    pub fn as_raw_ex(&self) -> Option<*mut ffi::ibv_cq_ex> {
        self.inner.ex.map(NonNull::as_ptr)
    }

    /// Wrap a raw classic CQ, destroyed when the last clone drops.
    ///
    /// # Safety
    /// `cq` must be a valid CQ of `ctx`, without a completion channel, that nothing else
    /// destroys.
    pub unsafe fn from_raw(cq: NonNull<ffi::ibv_cq>, ctx: Context) -> Self {
        CompletionQueue {
            inner: Arc::new(CqInner {
                cq,
                ex: None,
                wc_flags: WcFlags::empty(),
                kernel_wc_flags: ctx.reports_kernel_wc_flags(),
                ctx,
                channel: None,
            }),
        }
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Kernel handle (matches [`CqEvent::cq_handle`] and async events).
    pub fn handle(&self) -> u32 {
        // SAFETY: live CQ.
        unsafe { (*self.as_raw()).handle }
    }

    /// Number of entries (may exceed what was asked for).
    pub fn cqe(&self) -> u32 {
        // SAFETY: live CQ.
        unsafe { (*self.as_raw()).cqe as u32 }
    }

    /// Poll up to `buf.len()` completions into `buf` (`ibv_poll_cq`; on an extended CQ
    /// `ibv_start_poll`/`ibv_end_poll`). Returns the filled prefix;
    /// reuse `buf` across calls, nothing is allocated.
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll<'b>(&self, buf: &'b mut [WorkCompletion]) -> Result<&'b mut [WorkCompletion]> {
        if self.inner.ex.is_some() {
            let mut n = 0;
            self.poll_ex_with(buf.len(), |c| {
                let wc = &mut buf[n].raw;
                wc.wr_id = c.wr_id;
                wc.status = c.status.0;
                wc.opcode = c.opcode.0;
                wc.vendor_err = c.vendor_err;
                wc.byte_len = c.byte_len;
                wc.qp_num = c.qp_num;
                wc.src_qp = c.src_qp;
                wc.wc_flags = 0;
                wc.__bindgen_anon_1.imm_data = 0;
                if let Some(imm) = c.imm_data {
                    wc.wc_flags |= ffi::IBV_WC_WITH_IMM;
                    wc.__bindgen_anon_1.imm_data = imm.to_be();
                }
                n += 1;
            })?;
            return Ok(&mut buf[..n]);
        }
        let max = i32::try_from(buf.len()).unwrap_or(i32::MAX);
        // SAFETY: live CQ; `buf` has room for `max` `ibv_wc` (repr(transparent)).
        let n = unsafe { ffi::ibv_poll_cq(self.as_raw(), max, buf.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(Error::from_errno("ibv_poll_cq", -n));
        }
        let done = &mut buf[..n as usize];
        if self.inner.kernel_wc_flags {
            for wc in done.iter_mut() {
                wc.raw.wc_flags = kernel_to_user_wc_flags(wc.raw.wc_flags);
            }
        }
        Ok(done)
    }

    /// Poll up to `max` completions of an extended CQ, handing each to `f` with every
    /// field the CQ was created to report. [`Error::Unsupported`] on a classic CQ.
    #[doc(alias = "ibv_start_poll")]
    #[doc(alias = "ibv_end_poll")]
    pub fn poll_ex_with(&self, max: usize, mut f: impl FnMut(&ExCompletion)) -> Result<usize> {
        let Some(ex) = self.inner.ex else {
            return Err(Error::Unsupported {
                call: "ibv_start_poll on a classic CQ",
            });
        };
        if max == 0 {
            return Ok(0);
        }
        let ex = ex.as_ptr();
        // One completion per poll session (start → read → end). Providers disagree on
        // what `ibv_next_poll` returning ENOENT means: rxe ends the session there (it
        // stores the consumer index and unlocks), so a following `ibv_end_poll` would
        // skip an entry; mlx5 requires the `ibv_end_poll`. Short sessions are correct on
        // both.
        let mut n = 0;
        while n < max {
            // SAFETY: all-zero is a valid `ibv_poll_cq_attr`.
            let mut attr: ffi::ibv_poll_cq_attr = unsafe { std::mem::zeroed() };
            // SAFETY: live extended CQ, no session open.
            let ret = unsafe { ffi::ibv_start_poll(ex, &mut attr) };
            if ret == libc::ENOENT {
                break;
            }
            cvt(ret, "ibv_start_poll")?;
            // SAFETY: inside a poll session on a live extended CQ; only the fields the CQ
            // was created with are read.
            let c = unsafe { read_ex(ex, self.inner.wc_flags) };
            // SAFETY: ends the session started above.
            unsafe { ffi::ibv_end_poll(ex) };
            f(&c);
            n += 1;
        }
        Ok(n)
    }

    /// Arm the CQ: the next completion (or next solicited one) raises an event on its
    /// channel (`ibv_req_notify_cq`).
    #[doc(alias = "ibv_req_notify_cq")]
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.inner.channel.is_none() {
            return Err(Error::InvalidArgument(
                "req_notify on a CQ without a completion channel".into(),
            ));
        }
        // SAFETY: live CQ with a channel.
        cvt(
            unsafe { ffi::ibv_req_notify_cq(self.as_raw(), solicited_only as i32) },
            "ibv_req_notify_cq",
        )
    }

    /// The channel this CQ reports to.
    pub fn channel(&self) -> Option<&CompletionChannel> {
        self.inner.channel.as_ref()
    }

    /// Resize to at least `cqe` entries (`ibv_resize_cq`).
    #[doc(alias = "ibv_resize_cq")]
    pub fn resize(&self, cqe: u32) -> Result<()> {
        // SAFETY: live CQ.
        cvt(
            unsafe { ffi::ibv_resize_cq(self.as_raw(), cqe as i32) },
            "ibv_resize_cq",
        )
    }
}

/// The kernel's `IB_WC_WITH_INVALIDATE` (`1 << 2`) and `IB_WC_IP_CSUM_OK` (`1 << 3`) as
/// user space's `IBV_WC_WITH_INV` (`1 << 3`) and `IBV_WC_IP_CSUM_OK` (`1 << 2`).
fn kernel_to_user_wc_flags(flags: u32) -> u32 {
    let (bit2, bit3) = (flags & (1 << 2), flags & (1 << 3));
    (flags & !0b1100) | (bit2 << 1) | (bit3 >> 1)
}

/// Read the current completion of a poll session.
///
/// # Safety
/// `ex` is a live extended CQ inside a successful `ibv_start_poll`.
unsafe fn read_ex(ex: *mut ffi::ibv_cq_ex, create_flags: WcFlags) -> ExCompletion {
    // SAFETY: per the function contract; only fields requested at creation are read.
    unsafe {
        let wc_flags = ffi::ibv_wc_read_wc_flags(ex);
        let status = WcStatus((*ex).status);
        let with = |f: WcFlags| create_flags.contains(f);
        ExCompletion {
            wr_id: (*ex).wr_id,
            status,
            opcode: WcOpcode(ffi::ibv_wc_read_opcode(ex)),
            vendor_err: ffi::ibv_wc_read_vendor_err(ex),
            byte_len: if with(WcFlags::BYTE_LEN) {
                ffi::ibv_wc_read_byte_len(ex)
            } else {
                0
            },
            imm_data: (with(WcFlags::IMM) && wc_flags & ffi::IBV_WC_WITH_IMM != 0)
                .then(|| u32::from_be(ffi::ibv_wc_read_imm_data(ex))),
            qp_num: if with(WcFlags::QP_NUM) {
                ffi::ibv_wc_read_qp_num(ex)
            } else {
                0
            },
            src_qp: if with(WcFlags::SRC_QP) {
                ffi::ibv_wc_read_src_qp(ex)
            } else {
                0
            },
            completion_ts: with(WcFlags::COMPLETION_TIMESTAMP)
                .then(|| ffi::ibv_wc_read_completion_ts(ex)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_wc_flags_are_translated() {
        let grh_imm = ffi::IBV_WC_GRH | ffi::IBV_WC_WITH_IMM;
        // IB_WC_WITH_INVALIDATE (1 << 2) -> IBV_WC_WITH_INV (1 << 3), other bits kept.
        assert_eq!(
            kernel_to_user_wc_flags(ffi::IBV_WC_GRH | (1 << 2)),
            ffi::IBV_WC_GRH | ffi::IBV_WC_WITH_INV
        );
        // IB_WC_IP_CSUM_OK (1 << 3) -> IBV_WC_IP_CSUM_OK (1 << 2).
        assert_eq!(
            kernel_to_user_wc_flags(grh_imm | (1 << 3)),
            grh_imm | ffi::IBV_WC_IP_CSUM_OK
        );
        assert_eq!(
            kernel_to_user_wc_flags(grh_imm | 0b1100 | 0x40),
            grh_imm | 0b1100 | 0x40
        );
        assert_eq!(kernel_to_user_wc_flags(0), 0);
    }
}
