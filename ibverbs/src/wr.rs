//! Work requests: send (`ibv_send_wr`: SEND, RDMA WRITE/READ, atomics, memory-window
//! binds) with inline data, and receive (`ibv_recv_wr`), built safely and posted as
//! chains.

use crate::ffi;
use crate::mr::{RemoteMemory, Sge};
use crate::pd::AddressHandle;
use std::fmt;
use std::marker::PhantomData;

/// A send work request (`struct ibv_send_wr`), `repr(transparent)`: a slice of them is
/// posted as one chain by [`QueuePair::post_send`](crate::QueuePair::post_send).
#[repr(transparent)]
pub struct SendWr<'a> {
    pub(crate) raw: ffi::ibv_send_wr,
    _borrow: PhantomData<(&'a [Sge<'a>], &'a AddressHandle)>,
}

impl WrRaw for SendWr<'_> {
    type Raw = ffi::ibv_send_wr;
}

impl fmt::Debug for SendWr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendWr")
            .field("wr_id", &self.raw.wr_id)
            .field("opcode", &self.raw.opcode)
            .field("num_sge", &self.raw.num_sge)
            .field(
                "send_flags",
                &SendFlags::from_bits_retain(self.raw.send_flags),
            )
            .finish()
    }
}

/// Inline data for [`SendWr::send_inline`] / [`SendWr::write_inline`]: any bytes, copied
/// into the work queue at post time.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct InlineSge<'a> {
    raw: ffi::ibv_sge,
    _data: PhantomData<&'a [u8]>,
}

impl fmt::Debug for InlineSge<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InlineSge")
            .field("length", &self.raw.length)
            .finish()
    }
}

impl<'a> InlineSge<'a> {
    /// Inline `data` (at most the QP's `max_inline_data` in total).
    pub fn new(data: &'a [u8]) -> Self {
        InlineSge {
            raw: ffi::ibv_sge {
                addr: data.as_ptr() as u64,
                length: data.len() as u32,
                lkey: 0,
            },
            _data: PhantomData,
        }
    }
}

impl<'a> SendWr<'a> {
    fn with(wr_id: u64, opcode: u32, sg: *const ffi::ibv_sge, num_sge: usize) -> Self {
        // SAFETY: all-zero is a valid `ibv_send_wr`.
        let mut raw: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        raw.wr_id = wr_id;
        raw.opcode = opcode;
        raw.sg_list = sg.cast_mut();
        raw.num_sge = num_sge as i32;
        SendWr {
            raw,
            _borrow: PhantomData,
        }
    }
    fn rdma(mut self, remote: RemoteMemory) -> Self {
        self.raw.wr.rdma.remote_addr = remote.addr;
        self.raw.wr.rdma.rkey = remote.rkey;
        self
    }

    /// SEND of `sg` (`IBV_WR_SEND`).
    pub fn send(wr_id: u64, sg: &'a [Sge<'a>]) -> Self {
        Self::with(wr_id, ffi::IBV_WR_SEND, sg.as_ptr().cast(), sg.len())
    }
    /// SEND with 32-bit immediate data (`IBV_WR_SEND_WITH_IMM`; host order here).
    pub fn send_with_imm(wr_id: u64, sg: &'a [Sge<'a>], imm: u32) -> Self {
        let mut wr = Self::with(
            wr_id,
            ffi::IBV_WR_SEND_WITH_IMM,
            sg.as_ptr().cast(),
            sg.len(),
        );
        wr.raw.__bindgen_anon_1.imm_data = imm.to_be();
        wr
    }
    /// SEND of inline data (`IBV_WR_SEND` + `IBV_SEND_INLINE`).
    pub fn send_inline(wr_id: u64, data: &'a [InlineSge<'a>]) -> Self {
        Self::with(wr_id, ffi::IBV_WR_SEND, data.as_ptr().cast(), data.len())
            .flags(SendFlags::INLINE)
    }
    /// RDMA WRITE of `sg` to `remote` (`IBV_WR_RDMA_WRITE`).
    pub fn write(wr_id: u64, sg: &'a [Sge<'a>], remote: RemoteMemory) -> Self {
        Self::with(wr_id, ffi::IBV_WR_RDMA_WRITE, sg.as_ptr().cast(), sg.len()).rdma(remote)
    }
    /// RDMA WRITE of inline data (`IBV_WR_RDMA_WRITE` + `IBV_SEND_INLINE`).
    pub fn write_inline(wr_id: u64, data: &'a [InlineSge<'a>], remote: RemoteMemory) -> Self {
        Self::with(
            wr_id,
            ffi::IBV_WR_RDMA_WRITE,
            data.as_ptr().cast(),
            data.len(),
        )
        .rdma(remote)
        .flags(SendFlags::INLINE)
    }
    /// RDMA WRITE with immediate data, consuming a receive at the peer
    /// (`IBV_WR_RDMA_WRITE_WITH_IMM`).
    pub fn write_with_imm(wr_id: u64, sg: &'a [Sge<'a>], remote: RemoteMemory, imm: u32) -> Self {
        let mut wr = Self::with(
            wr_id,
            ffi::IBV_WR_RDMA_WRITE_WITH_IMM,
            sg.as_ptr().cast(),
            sg.len(),
        )
        .rdma(remote);
        wr.raw.__bindgen_anon_1.imm_data = imm.to_be();
        wr
    }
    /// RDMA READ from `remote` into `sg` (`IBV_WR_RDMA_READ`).
    pub fn read(wr_id: u64, sg: &'a [Sge<'a>], remote: RemoteMemory) -> Self {
        Self::with(wr_id, ffi::IBV_WR_RDMA_READ, sg.as_ptr().cast(), sg.len()).rdma(remote)
    }
    /// 64-bit compare-and-swap at `remote` (8-byte aligned); the old value lands in `sg`
    /// (8 bytes) in big-endian byte order (`IBV_WR_ATOMIC_CMP_AND_SWP`).
    pub fn compare_swap(
        wr_id: u64,
        sg: &'a [Sge<'a>],
        remote: RemoteMemory,
        compare: u64,
        swap: u64,
    ) -> Self {
        let mut wr = Self::with(
            wr_id,
            ffi::IBV_WR_ATOMIC_CMP_AND_SWP,
            sg.as_ptr().cast(),
            sg.len(),
        );
        wr.raw.wr.atomic.remote_addr = remote.addr;
        wr.raw.wr.atomic.rkey = remote.rkey;
        wr.raw.wr.atomic.compare_add = compare;
        wr.raw.wr.atomic.swap = swap;
        wr
    }
    /// 64-bit fetch-and-add at `remote`; the old value lands in `sg`
    /// (`IBV_WR_ATOMIC_FETCH_AND_ADD`).
    pub fn fetch_add(wr_id: u64, sg: &'a [Sge<'a>], remote: RemoteMemory, add: u64) -> Self {
        let mut wr = Self::with(
            wr_id,
            ffi::IBV_WR_ATOMIC_FETCH_AND_ADD,
            sg.as_ptr().cast(),
            sg.len(),
        );
        wr.raw.wr.atomic.remote_addr = remote.addr;
        wr.raw.wr.atomic.rkey = remote.rkey;
        wr.raw.wr.atomic.compare_add = add;
        wr
    }
    /// Invalidate `rkey` on this side (`IBV_WR_LOCAL_INV`): a type 2
    /// [`MemoryWindow`](crate::MemoryWindow) bound through this QP; the peer's next access with that rkey
    /// fails with a remote access error.
    #[doc(alias = "IBV_WR_LOCAL_INV")]
    pub fn local_inv(wr_id: u64, rkey: u32) -> Self {
        let mut wr = Self::with(wr_id, ffi::IBV_WR_LOCAL_INV, std::ptr::null(), 0);
        wr.raw.__bindgen_anon_1.invalidate_rkey = rkey;
        wr
    }
    /// SEND of `sg` that also invalidates `rkey` at the peer (`IBV_WR_SEND_WITH_INV`):
    /// a type 2 window the peer bound through its QP. The peer's receive completion
    /// reports it ([`WorkCompletion::invalidated_rkey`](crate::WorkCompletion::invalidated_rkey)).
    #[doc(alias = "IBV_WR_SEND_WITH_INV")]
    pub fn send_with_inv(wr_id: u64, sg: &'a [Sge<'a>], rkey: u32) -> Self {
        let mut wr = Self::with(
            wr_id,
            ffi::IBV_WR_SEND_WITH_INV,
            sg.as_ptr().cast(),
            sg.len(),
        );
        wr.raw.__bindgen_anon_1.invalidate_rkey = rkey;
        wr
    }
    /// Add `flags` (flags are only ever added, so an inline request stays inline).
    pub fn flags(mut self, flags: SendFlags) -> Self {
        self.raw.send_flags |= flags.bits();
        self
    }
    /// Add `IBV_SEND_SIGNALED`.
    pub fn signaled(self) -> Self {
        self.flags(SendFlags::SIGNALED)
    }
    /// UD destination: address handle, remote QPN and Q_Key.
    pub fn ud(mut self, ah: &'a AddressHandle, remote_qpn: u32, remote_qkey: u32) -> Self {
        self.raw.wr.ud.ah = ah.as_raw();
        self.raw.wr.ud.remote_qpn = remote_qpn;
        self.raw.wr.ud.remote_qkey = remote_qkey;
        self
    }
    /// The C struct.
    pub fn as_ffi(&self) -> &ffi::ibv_send_wr {
        &self.raw
    }
}

/// A receive work request (`struct ibv_recv_wr`), `repr(transparent)`.
#[repr(transparent)]
pub struct RecvWr<'a> {
    pub(crate) raw: ffi::ibv_recv_wr,
    _borrow: PhantomData<&'a [Sge<'a>]>,
}

impl WrRaw for RecvWr<'_> {
    type Raw = ffi::ibv_recv_wr;
}

impl fmt::Debug for RecvWr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvWr")
            .field("wr_id", &self.raw.wr_id)
            .field("num_sge", &self.raw.num_sge)
            .finish()
    }
}

impl<'a> RecvWr<'a> {
    /// Receive into `sg` (UD: the first 40 bytes get the GRH).
    pub fn new(wr_id: u64, sg: &'a [Sge<'a>]) -> Self {
        RecvWr {
            raw: ffi::ibv_recv_wr {
                wr_id,
                next: std::ptr::null_mut(),
                sg_list: sg.as_ptr().cast_mut().cast(),
                num_sge: sg.len() as i32,
            },
            _borrow: PhantomData,
        }
    }
}

pub(crate) fn link_recv(wrs: &mut [RecvWr<'_>]) {
    link(wrs, |w| &mut w.raw.next);
}

bitflags::bitflags! {
    /// Flags of a send work request (`enum ibv_send_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct SendFlags: u32 {
        /// `IBV_SEND_FENCE`
        const FENCE = ffi::IBV_SEND_FENCE;
        /// `IBV_SEND_SIGNALED`: produce a completion (always, with `sq_sig_all`).
        const SIGNALED = ffi::IBV_SEND_SIGNALED;
        /// `IBV_SEND_SOLICITED`
        const SOLICITED = ffi::IBV_SEND_SOLICITED;
        /// `IBV_SEND_INLINE`: copy the data into the WQE at post time.
        const INLINE = ffi::IBV_SEND_INLINE;
        /// `IBV_SEND_IP_CSUM`
        const IP_CSUM = ffi::IBV_SEND_IP_CSUM;
    }
}

/// Set the `next` pointers of a slice of work requests so it is one chain.
pub(crate) fn link<T>(wrs: &mut [T], next: impl Fn(&mut T) -> &mut *mut <T as WrRaw>::Raw)
where
    T: WrRaw,
{
    let n = wrs.len();
    let base = wrs.as_mut_ptr();
    for (i, wr) in wrs.iter_mut().enumerate() {
        *next(wr) = if i + 1 < n {
            // SAFETY: `i + 1 < n`, inside the slice; the WR types are repr(transparent).
            unsafe { base.add(i + 1).cast::<T::Raw>() }
        } else {
            std::ptr::null_mut()
        };
    }
}

/// Work request types that are `repr(transparent)` over a C struct.
pub(crate) trait WrRaw {
    type Raw;
}
