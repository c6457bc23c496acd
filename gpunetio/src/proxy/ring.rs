//! The CPU proxy ring as host code sees it: the memory (`gio_ring_entry` slots, the
//! `gio_ring_ctrl` block, completion counters, the producers' `gio_ring_dev_state`) laid
//! out exactly as `gio_abi.h` says, and [`HostProducer`], a host-side producer that
//! follows the device library's protocol step for step (`gio_device.cuh`:
//! `reserve_slots` → `entry_ptr` → `prepare` → `mark_ready`; `wait` / `quiet`).

use crate::error::{Error, Result};
use crate::status::GioStatus;
use gpu_mem::{DeviceBuffer, Gpu, HostBuffer};
use gpunetio_sys as ffi;
use std::alloc::{self, Layout};
use std::fmt;
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `gio_ring_ctrl` with atomic fields: the proxy stores, producers load.
#[repr(C)]
pub(crate) struct CtrlAtomic {
    pub consumed: AtomicU64,
    _pad0: [u8; 56],
    pub completed: AtomicU64,
    _pad1: [u8; 56],
    pub error: AtomicI32,
    pub shutdown: AtomicU32,
    pub error_ticket: AtomicU64,
    _pad2: [u8; 48],
}

/// `gio_ring_dev_state` with atomic fields (host-resident rings only).
#[repr(C)]
pub(crate) struct StateAtomic {
    pub reserved: AtomicU64,
    pub cached_consumed: AtomicU64,
    _level: AtomicU32,
    _pad: [u8; 44],
}

// The atomic views must be the ABI structs, byte for byte.
const _: () = {
    assert!(size_of::<CtrlAtomic>() == size_of::<ffi::gio_ring_ctrl>());
    assert!(offset_of!(CtrlAtomic, consumed) == offset_of!(ffi::gio_ring_ctrl, consumed));
    assert!(offset_of!(CtrlAtomic, completed) == offset_of!(ffi::gio_ring_ctrl, completed));
    assert!(offset_of!(CtrlAtomic, error) == offset_of!(ffi::gio_ring_ctrl, error));
    assert!(offset_of!(CtrlAtomic, shutdown) == offset_of!(ffi::gio_ring_ctrl, shutdown));
    assert!(offset_of!(CtrlAtomic, error_ticket) == offset_of!(ffi::gio_ring_ctrl, error_ticket));
    assert!(size_of::<StateAtomic>() == size_of::<ffi::gio_ring_dev_state>());
    assert!(offset_of!(StateAtomic, reserved) == offset_of!(ffi::gio_ring_dev_state, reserved));
    assert!(
        offset_of!(StateAtomic, cached_consumed)
            == offset_of!(ffi::gio_ring_dev_state, cached_consumed)
    );
    assert!(offset_of!(ffi::gio_ring_entry, seq) == 0);
};

const ENTRY: usize = size_of::<ffi::gio_ring_entry>();
const CTRL: usize = size_of::<ffi::gio_ring_ctrl>();
const STATE: usize = size_of::<ffi::gio_ring_dev_state>();
const LINE: usize = 64;

/// Largest ring (entries): tickets index slots with a mask, and the proxy's window of
/// outstanding work is one ring.
pub const MAX_RING_SIZE: u32 = 1 << 20;

/// Byte offsets of the host-visible part: entries, control block, counters.
struct Layout3 {
    ctrl: usize,
    counters: usize,
    state: usize,
    total: usize,
}

fn layout(ring_size: u32, num_counters: u32) -> Layout3 {
    let ctrl = ring_size as usize * ENTRY;
    let counters = ctrl + CTRL;
    let state = (counters + 8 * num_counters as usize).next_multiple_of(LINE);
    Layout3 {
        ctrl,
        counters,
        state,
        total: state + STATE,
    }
}

/// Plain host memory, cache-line aligned and zeroed (rings without CUDA).
struct HostAlloc {
    ptr: *mut u8,
    layout: Layout,
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `RingMemory::host` with this layout, freed once.
        unsafe { alloc::dealloc(self.ptr, self.layout) };
    }
}

enum Backing {
    /// Everything in one host allocation; device addresses are host addresses (no GPU
    /// can use them: for host producers and tests).
    Host(HostAlloc),
    /// Entries, control block and counters in mapped pinned host memory; the producers'
    /// state in device memory, as the device library expects.
    Cuda {
        _host: HostBuffer,
        state: DeviceBuffer,
        host_dev_ptr: u64,
    },
}

/// The memory of one CPU proxy ring: `ring_size` entries, the control block, and
/// `num_counters` completion counters, laid out per `gio_abi.h`.
pub struct RingMemory {
    backing: Backing,
    ring_size: u32,
    num_counters: u32,
    entries: *mut ffi::gio_ring_entry,
    ctrl: *const CtrlAtomic,
    counters: *const AtomicU64,
    /// The producers' state, where the host can reach it (host-resident rings).
    state: Option<*const StateAtomic>,
}

// SAFETY: the memory is owned by this value and only reached through atomics (seq,
// control block, counters, state) or through slots whose ownership the ring protocol
// hands over (a producer writes a slot only below consumed + size, the proxy reads it
// only once its seq is published); HostBuffer/DeviceBuffer are Send + Sync.
unsafe impl Send for RingMemory {}
// SAFETY: as above.
unsafe impl Sync for RingMemory {}

impl fmt::Debug for RingMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingMemory")
            .field("ring_size", &self.ring_size)
            .field("num_counters", &self.num_counters)
            .field("cuda", &matches!(self.backing, Backing::Cuda { .. }))
            .finish()
    }
}

/// Where a ring's parts live in the GPU's address space (the `gio_dev_qp` fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingDevicePtrs {
    /// `gio_ring_entry *ring`.
    pub ring: u64,
    /// `gio_ring_ctrl *ctrl`.
    pub ctrl: u64,
    /// `gio_ring_dev_state *state`.
    pub state: u64,
    /// `uint64_t *counters`.
    pub counters: u64,
}

fn check_sizes(ring_size: u32, num_counters: u32) -> Result<()> {
    if !ring_size.is_power_of_two() || ring_size > MAX_RING_SIZE {
        return Err(Error::InvalidArgument(format!(
            "ring size {ring_size}: a power of two up to {MAX_RING_SIZE}"
        )));
    }
    if num_counters > 1 << 20 {
        return Err(Error::InvalidArgument(format!(
            "{num_counters} counters: at most {}",
            1 << 20
        )));
    }
    Ok(())
}

impl RingMemory {
    /// A ring in plain host memory: for host producers ([`HostProducer`]) and tests with
    /// a CPU thread standing in for the GPU. No GPU can reach it.
    pub fn host(ring_size: u32, num_counters: u32) -> Result<Arc<Self>> {
        check_sizes(ring_size, num_counters)?;
        let l = layout(ring_size, num_counters);
        let layout = Layout::from_size_align(l.total, LINE)
            .map_err(|e| Error::InvalidArgument(format!("ring layout: {e}")))?;
        // SAFETY: a non-zero size (the control block alone is 192 bytes).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        let host = HostAlloc { ptr, layout };
        // SAFETY: the offsets lie inside the allocation (layout()).
        let (entries, ctrl, counters, state) = unsafe {
            (
                ptr.cast::<ffi::gio_ring_entry>(),
                ptr.add(l.ctrl).cast::<CtrlAtomic>(),
                ptr.add(l.counters).cast::<AtomicU64>(),
                ptr.add(l.state).cast::<StateAtomic>(),
            )
        };
        Ok(Arc::new(Self {
            backing: Backing::Host(host),
            ring_size,
            num_counters,
            entries,
            ctrl,
            counters,
            state: Some(state),
        }))
    }

    /// A ring a GPU produces into: entries, control block and counters in pinned,
    /// mapped host memory (the GPU writes entries and reads the control block through
    /// PCIe/C2C), the producers' reservation state in device memory.
    pub fn cuda(gpu: &Gpu, ring_size: u32, num_counters: u32) -> Result<Arc<Self>> {
        check_sizes(ring_size, num_counters)?;
        let l = layout(ring_size, num_counters);
        // The state slot of the host layout is left unused: it lives on the device.
        let mut host = HostBuffer::alloc(gpu, l.state)?;
        let host_dev_ptr = host.device_ptr()?;
        let state = DeviceBuffer::alloc(gpu, STATE)?;
        state.fill(0)?;
        let base = host.as_mut_ptr();
        // SAFETY: the offsets lie inside the buffer (layout()); HostBuffer is page aligned.
        let (entries, ctrl, counters) = unsafe {
            (
                base.cast::<ffi::gio_ring_entry>(),
                base.add(l.ctrl).cast::<CtrlAtomic>(),
                base.add(l.counters).cast::<AtomicU64>(),
            )
        };
        Ok(Arc::new(Self {
            backing: Backing::Cuda {
                _host: host,
                state,
                host_dev_ptr,
            },
            ring_size,
            num_counters,
            entries,
            ctrl,
            counters,
            state: None,
        }))
    }

    /// Entries in the ring (a power of two).
    pub fn ring_size(&self) -> u32 {
        self.ring_size
    }

    /// Completion counters.
    pub fn num_counters(&self) -> u32 {
        self.num_counters
    }

    /// Whether the producers' state lives in device memory (a GPU ring).
    pub fn is_cuda(&self) -> bool {
        matches!(self.backing, Backing::Cuda { .. })
    }

    /// The `gio_dev_qp` fields that locate this ring (host addresses for a host ring).
    pub fn device_ptrs(&self) -> RingDevicePtrs {
        let l = layout(self.ring_size, self.num_counters);
        match &self.backing {
            Backing::Host(h) => RingDevicePtrs {
                ring: h.ptr as u64,
                ctrl: h.ptr as u64 + l.ctrl as u64,
                state: h.ptr as u64 + l.state as u64,
                counters: h.ptr as u64 + l.counters as u64,
            },
            Backing::Cuda {
                state,
                host_dev_ptr,
                ..
            } => RingDevicePtrs {
                ring: *host_dev_ptr,
                ctrl: host_dev_ptr + l.ctrl as u64,
                state: state.ptr(),
                counters: host_dev_ptr + l.counters as u64,
            },
        }
    }

    pub(crate) fn ctrl(&self) -> &CtrlAtomic {
        // SAFETY: points into memory owned by self, initialised (zeroed) at allocation.
        unsafe { &*self.ctrl }
    }

    fn state(&self) -> Option<&StateAtomic> {
        // SAFETY: as ctrl().
        self.state.map(|s| unsafe { &*s })
    }

    /// The slot of `ticket`.
    pub(crate) fn slot(&self, ticket: u64) -> *mut ffi::gio_ring_entry {
        let index = (ticket & (self.ring_size as u64 - 1)) as usize;
        // SAFETY: index < ring_size, inside the entry array.
        unsafe { self.entries.add(index) }
    }

    /// The sequence word of `ticket`'s slot.
    pub(crate) fn seq(&self, ticket: u64) -> &AtomicU64 {
        // SAFETY: seq is the slot's first field, 8-byte aligned, only accessed atomically.
        unsafe { AtomicU64::from_ptr(self.slot(ticket).cast::<u64>()) }
    }

    /// `ticket`'s entry once its producer published all of it: in place (seq = ticket + 1,
    /// stored last with release) or as an image (every word of `ticket`'s lap: see
    /// `gio_entry_encode`); `None` while it is not (yet) there.
    pub(crate) fn published(&self, ticket: u64) -> Option<ffi::gio_ring_entry> {
        let seq = self.seq(ticket).load(Ordering::Acquire);
        if seq & !ffi::GIO_SEQ_IMAGE != ticket + 1 {
            return None;
        }
        let base = self.slot(ticket).cast::<u64>();
        let mut w = [0u64; 8];
        w[0] = seq;
        for (k, word) in w.iter_mut().enumerate().skip(1) {
            // SAFETY: word k of the slot (inside the entry array, 8-byte aligned); the
            // producer writes these words only with aligned 8-byte stores (image) or
            // before its release of seq (in place), so an atomic load is a whole word.
            *word = unsafe { AtomicU64::from_ptr(base.add(k)) }.load(Ordering::Acquire);
        }
        if seq & ffi::GIO_SEQ_IMAGE != 0 && !ffi::entry_decode(&mut w, ticket, self.ring_size) {
            return None;
        }
        // SAFETY: gio_ring_entry is 64 bytes of integers, any bit pattern valid.
        Some(unsafe { std::mem::transmute::<[u64; 8], ffi::gio_ring_entry>(w) })
    }

    /// Completion counter `index`.
    pub(crate) fn counter_ref(&self, index: u32) -> Option<&AtomicU64> {
        // SAFETY: index < num_counters, inside the counter array.
        (index < self.num_counters).then(|| unsafe { &*self.counters.add(index as usize) })
    }

    /// Completion counter `index` (entries with `GIO_FLAG_COUNTER` that completed).
    pub fn counter(&self, index: u32) -> Result<u64> {
        self.counter_ref(index)
            .map(|c| c.load(Ordering::Acquire))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "counter {index} of a ring with {}",
                    self.num_counters
                ))
            })
    }

    /// `ctrl.consumed`: entries the proxy took off the ring.
    pub fn consumed(&self) -> u64 {
        self.ctrl().consumed.load(Ordering::Acquire)
    }

    /// `ctrl.completed`: entries completed, in ticket order.
    pub fn completed(&self) -> u64 {
        self.ctrl().completed.load(Ordering::Acquire)
    }

    /// `ctrl.error` and `ctrl.error_ticket`, once the ring failed.
    pub fn error(&self) -> Option<(GioStatus, u64)> {
        let e = self.ctrl().error.load(Ordering::Acquire);
        (e != ffi::GIO_OK).then(|| {
            (
                GioStatus(e),
                self.ctrl().error_ticket.load(Ordering::Acquire),
            )
        })
    }

    /// Whether `ctrl.shutdown` is set.
    pub fn is_shut_down(&self) -> bool {
        self.ctrl().shutdown.load(Ordering::Acquire) != 0
    }

    /// Sets `ctrl.shutdown`: every producer wait ends with `GIO_ERR_SHUTDOWN`.
    pub fn shutdown(&self) {
        self.ctrl().shutdown.store(1, Ordering::Release);
    }

    /// Records the first failure (later ones are dropped): the ticket first, so a
    /// producer that sees the status also sees its ticket.
    pub(crate) fn set_error(&self, status: GioStatus, ticket: u64) -> bool {
        let ctrl = self.ctrl();
        if ctrl.error.load(Ordering::Acquire) != ffi::GIO_OK {
            return false;
        }
        ctrl.error_ticket.store(ticket, Ordering::Relaxed);
        ctrl.error
            .compare_exchange(ffi::GIO_OK, status.0, Ordering::Release, Ordering::Relaxed)
            .is_ok()
    }

    /// The host's verdict as the device library's `host_status` reads it.
    fn host_status(&self) -> GioStatus {
        let e = self.ctrl().error.load(Ordering::Acquire);
        if e != ffi::GIO_OK {
            GioStatus(e)
        } else if self.is_shut_down() {
            GioStatus::SHUTDOWN
        } else {
            GioStatus::OK
        }
    }
}

/// One ring entry to post, built like the device library's `prepare_*` calls (same
/// argument order). [`Entry::raw`] posts any bit pattern (the proxy validates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry(pub ffi::gio_ring_entry);

impl Entry {
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        opcode: u8,
        local_mr: u32,
        local_off: u64,
        remote_mr: u32,
        remote_off: u64,
        length: u64,
        signal_mr: u32,
        signal_off: u64,
        signal_add: u64,
    ) -> Self {
        Entry(ffi::gio_ring_entry {
            seq: 0,
            opcode,
            flags: 0,
            local_mr: local_mr as u16,
            remote_mr: remote_mr as u16,
            signal_mr: signal_mr as u16,
            local_off,
            remote_off,
            length,
            signal_off,
            signal_add,
            counter: ffi::GIO_NO_COUNTER,
            reserved: 0,
        })
    }

    /// `GIO_OP_PUT`: `len` bytes from (`local_mr`, `local_off`) to (`remote_mr`,
    /// `remote_off`) (`gio::prepare_put`).
    pub fn put(remote_mr: u32, remote_off: u64, local_mr: u32, local_off: u64, len: u64) -> Self {
        Self::prepare(
            ffi::GIO_OP_PUT,
            local_mr,
            local_off,
            remote_mr,
            remote_off,
            len,
            0,
            0,
            0,
        )
    }

    /// `GIO_OP_PUT_INLINE`: the `bytes` (1, 2, 4 or 8) low bytes of `value`, little
    /// endian, to (`remote_mr`, `remote_off`) (`gio::p`).
    pub fn put_inline(remote_mr: u32, remote_off: u64, value: u64, bytes: u64) -> Self {
        Self::prepare(
            ffi::GIO_OP_PUT_INLINE,
            0,
            value,
            remote_mr,
            remote_off,
            bytes,
            0,
            0,
            0,
        )
    }

    /// `GIO_OP_GET`: `len` bytes from (`remote_mr`, `remote_off`) into (`local_mr`,
    /// `local_off`).
    pub fn get(local_mr: u32, local_off: u64, remote_mr: u32, remote_off: u64, len: u64) -> Self {
        Self::prepare(
            ffi::GIO_OP_GET,
            local_mr,
            local_off,
            remote_mr,
            remote_off,
            len,
            0,
            0,
            0,
        )
    }

    /// `GIO_OP_SIGNAL`: atomically add `add` to the peer's u64 at (`signal_mr`,
    /// `signal_off`).
    pub fn signal(signal_mr: u32, signal_off: u64, add: u64) -> Self {
        Self::prepare(
            ffi::GIO_OP_SIGNAL,
            0,
            0,
            0,
            0,
            0,
            signal_mr,
            signal_off,
            add,
        )
    }

    /// `GIO_OP_FENCE`.
    pub fn fence() -> Self {
        Self::prepare(ffi::GIO_OP_FENCE, 0, 0, 0, 0, 0, 0, 0, 0)
    }

    /// `GIO_OP_NOP`.
    pub fn nop() -> Self {
        Self::prepare(ffi::GIO_OP_NOP, 0, 0, 0, 0, 0, 0, 0, 0)
    }

    /// Any entry, as is (`seq` is set when posting).
    pub fn raw(entry: ffi::gio_ring_entry) -> Self {
        Entry(entry)
    }

    /// Adds `GIO_FLAG_SIGNAL`: after the data, add `add` at (`signal_mr`, `signal_off`)
    /// (`gio::add_signal`).
    pub fn with_signal(mut self, signal_mr: u32, signal_off: u64, add: u64) -> Self {
        self.0.flags |= ffi::GIO_FLAG_SIGNAL;
        self.0.signal_mr = signal_mr as u16;
        self.0.signal_off = signal_off;
        self.0.signal_add = add;
        self
    }

    /// Adds `GIO_FLAG_COUNTER`: bump counter `counter` on completion (`gio::add_counter`).
    pub fn with_counter(mut self, counter: u32) -> Self {
        self.0.flags |= ffi::GIO_FLAG_COUNTER;
        self.0.counter = counter;
        self
    }
}

/// A producer on the host, following the device library's protocol exactly: reserve a
/// ticket with an atomic add on the state's `reserved`, wait (bounded) until its slot is
/// free (`ticket < consumed + ring_size`), write every field, then publish `seq = ticket
/// + 1` with release ordering. [`wait`](Self::wait) and [`quiet`](Self::quiet) poll
/// `ctrl.completed` and report `ctrl.error` / shutdown, like `gio::wait` / `gio::quiet`.
///
/// Any number of threads may share one producer (or hold their own) on one ring.
/// Only rings whose state the host can reach ([`RingMemory::host`]) take a host producer:
/// a GPU ring's state is device memory, reserved by kernels.
#[derive(Debug, Clone)]
pub struct HostProducer {
    ring: Arc<RingMemory>,
    timeout: Option<Duration>,
}

impl HostProducer {
    /// A producer on `ring`; every wait is bounded by `timeout` (zero: unbounded, as a
    /// `gio_dev_qp` with `timeout_ns` 0).
    pub fn new(ring: &Arc<RingMemory>, timeout: Duration) -> Result<Self> {
        if ring.state().is_none() {
            return Err(Error::Unsupported(
                "a host producer on a GPU ring: its reservation state is device memory".into(),
            ));
        }
        Ok(Self {
            ring: ring.clone(),
            timeout: (!timeout.is_zero()).then_some(timeout),
        })
    }

    /// The ring.
    pub fn ring(&self) -> &Arc<RingMemory> {
        &self.ring
    }

    fn state(&self) -> &StateAtomic {
        self.ring.state().expect("checked in new")
    }

    /// Reserves `n` consecutive tickets; returns the first (`gio::reserve_slots`).
    pub fn reserve(&self, n: u32) -> u64 {
        self.state().reserved.fetch_add(n as u64, Ordering::AcqRel)
    }

    /// Waits until the slot of `ticket` is free (`gio::entry_ptr`): the proxy took the
    /// entry `ring_size` tickets earlier.
    fn wait_slot(&self, ticket: u64) -> Result<()> {
        let size = self.ring.ring_size as u64;
        let state = self.state();
        if ticket < state.cached_consumed.load(Ordering::Relaxed) + size {
            return Ok(());
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let consumed = self.ring.ctrl().consumed.load(Ordering::Acquire);
            if ticket < consumed + size {
                state.cached_consumed.fetch_max(consumed, Ordering::Relaxed);
                return Ok(());
            }
            self.check_host("waiting for a free ring slot")?;
            self.check_timeout(start, "waiting for a free ring slot")?;
            backoff(&mut spins);
        }
    }

    fn check_host(&self, _what: &'static str) -> Result<()> {
        match self.ring.host_status() {
            GioStatus::OK => Ok(()),
            GioStatus::SHUTDOWN => Err(Error::Shutdown),
            status => Err(Error::RingFailed {
                status,
                ticket: self.ring.ctrl().error_ticket.load(Ordering::Acquire),
            }),
        }
    }

    fn check_timeout(&self, start: Instant, what: &'static str) -> Result<()> {
        match self.timeout {
            Some(t) if start.elapsed() > t => Err(Error::Timeout { what, after: t }),
            _ => Ok(()),
        }
    }

    /// Writes `entry` into `ticket`'s slot and publishes it (`gio::prepare` +
    /// `gio::mark_ready`). The ticket must come from [`reserve`](Self::reserve) and be
    /// written once.
    pub fn write(&self, ticket: u64, entry: &Entry) -> Result<()> {
        self.wait_slot(ticket)?;
        let slot = self.ring.slot(ticket);
        let e = entry.0;
        // SAFETY: the slot is ours: the ticket was reserved by us and the proxy has taken
        // the previous occupant (wait_slot); seq is left alone until the release below.
        unsafe {
            use std::ptr::{addr_of_mut, write_volatile};
            write_volatile(addr_of_mut!((*slot).opcode), e.opcode);
            write_volatile(addr_of_mut!((*slot).flags), e.flags);
            write_volatile(addr_of_mut!((*slot).local_mr), e.local_mr);
            write_volatile(addr_of_mut!((*slot).remote_mr), e.remote_mr);
            write_volatile(addr_of_mut!((*slot).signal_mr), e.signal_mr);
            write_volatile(addr_of_mut!((*slot).local_off), e.local_off);
            write_volatile(addr_of_mut!((*slot).remote_off), e.remote_off);
            write_volatile(addr_of_mut!((*slot).length), e.length);
            write_volatile(addr_of_mut!((*slot).signal_off), e.signal_off);
            write_volatile(addr_of_mut!((*slot).signal_add), e.signal_add);
            write_volatile(addr_of_mut!((*slot).counter), e.counter);
            write_volatile(addr_of_mut!((*slot).reserved), e.reserved);
        }
        // The device's __threadfence_system + st.release.sys: every field before seq.
        self.ring.seq(ticket).store(ticket + 1, Ordering::Release);
        Ok(())
    }

    /// Writes `entry` into `ticket`'s slot as an image (`gio::publish_image`): the eight
    /// encoded words, each one aligned 8-byte store, in the order `order` gives (word
    /// indices 0..8, each once), without any fence between them, as a GPU's stores may
    /// land. `stop_after` words only (the rest later with another call): a test can
    /// leave an entry half-written.
    pub fn write_image_words(
        &self,
        ticket: u64,
        entry: &Entry,
        order: &[usize],
        stop_after: usize,
    ) -> Result<()> {
        let mut seen = [false; 8];
        if order.len() != 8
            || order
                .iter()
                .any(|&k| k >= 8 || std::mem::replace(&mut seen[k], true))
        {
            return Err(Error::InvalidArgument(
                "an image's word order names each of words 0..8 once".into(),
            ));
        }
        self.wait_slot(ticket)?;
        // SAFETY: gio_ring_entry is 64 bytes of integers.
        let mut w = unsafe { std::mem::transmute::<ffi::gio_ring_entry, [u64; 8]>(entry.0) };
        w[7] &= 0xffff_ffff; // `reserved` is zero in an image
        ffi::entry_encode(&mut w, ticket, self.ring.ring_size);
        let base = self.ring.slot(ticket).cast::<u64>();
        for &k in order.iter().take(stop_after) {
            // SAFETY: word k of our reserved slot (wait_slot), 8-byte aligned; the proxy
            // reads the slot's words only atomically.
            unsafe { AtomicU64::from_ptr(base.add(k)) }.store(w[k], Ordering::Relaxed);
        }
        Ok(())
    }

    /// Posts one entry; returns its ticket (`post_entry`).
    pub fn post(&self, entry: &Entry) -> Result<u64> {
        let ticket = self.reserve(1);
        self.write(ticket, entry)?;
        Ok(ticket)
    }

    /// `Ok(true)` once `ticket` completed, `Ok(false)` while pending, else the ring's
    /// failure (`gio::poll_completion`).
    pub fn poll(&self, ticket: u64) -> Result<bool> {
        if self.ring.ctrl().completed.load(Ordering::Acquire) > ticket {
            return Ok(true);
        }
        self.check_host("polling a completion")?;
        Ok(false)
    }

    /// Waits until `ticket` completed (`gio::wait`).
    pub fn wait(&self, ticket: u64) -> Result<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        while !self.poll(ticket)? {
            self.check_timeout(start, "waiting for a completion")?;
            backoff(&mut spins);
        }
        Ok(())
    }

    /// Waits until everything reserved on the ring so far completed (`gio::quiet`).
    pub fn quiet(&self) -> Result<()> {
        let reserved = self.state().reserved.load(Ordering::Acquire);
        if reserved == 0 {
            return self.check_host("quiet");
        }
        self.wait(reserved - 1)
    }
}

/// Spins briefly, then yields: a host producer shares the CPU with the proxy.
fn backoff(spins: &mut u32) {
    if *spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
    *spins = spins.saturating_add(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_layout_matches_the_abi() {
        let ring = RingMemory::host(8, 3).unwrap();
        let p = ring.device_ptrs();
        assert_eq!(p.ring % 64, 0);
        assert_eq!(p.ctrl - p.ring, 8 * 64);
        assert_eq!(p.counters - p.ctrl, 192);
        assert_eq!(p.state % 64, 0);
        assert!(p.state >= p.counters + 24);
        assert_eq!(ring.seq(9).as_ptr() as u64, p.ring + 64);
    }

    #[test]
    fn sizes_are_checked() {
        assert!(matches!(
            RingMemory::host(6, 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(RingMemory::host(MAX_RING_SIZE * 2, 0).is_err());
    }

    #[test]
    fn producer_publishes_seq_last_and_blocks_on_a_full_ring() {
        let ring = RingMemory::host(4, 0).unwrap();
        let p = HostProducer::new(&ring, Duration::from_millis(50)).unwrap();
        for i in 0..4 {
            assert_eq!(p.post(&Entry::nop()).unwrap(), i);
            assert_eq!(ring.seq(i).load(Ordering::Acquire), i + 1);
        }
        // The fifth waits for the proxy and times out.
        let err = p.post(&Entry::put(1, 2, 3, 4, 5)).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        // A ring that failed ends the wait with the failure.
        ring.set_error(GioStatus::BOUNDS, 2);
        assert!(
            !ring.set_error(GioStatus::TRANSPORT, 3),
            "first failure wins"
        );
        let err = p.write(5, &Entry::nop()).unwrap_err();
        assert!(
            matches!(
                err,
                Error::RingFailed {
                    status: GioStatus::BOUNDS,
                    ticket: 2
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn wait_sees_completion_and_shutdown() {
        let ring = RingMemory::host(4, 0).unwrap();
        let p = HostProducer::new(&ring, Duration::from_secs(1)).unwrap();
        let t = p.post(&Entry::fence()).unwrap();
        assert!(!p.poll(t).unwrap());
        ring.ctrl().completed.store(1, Ordering::Release);
        p.wait(t).unwrap();
        p.quiet().unwrap();
        let t = p.post(&Entry::fence()).unwrap();
        ring.shutdown();
        assert!(matches!(p.wait(t), Err(Error::Shutdown)));
    }

    #[test]
    fn status_names() {
        assert_eq!(format!("{}", GioStatus::PEER_GONE), "GIO_ERR_PEER_GONE");
        assert_eq!(format!("{}", GioStatus(8)), "GIO_ERR_CQE");
        assert_eq!(format!("{:?}", GioStatus(42)), "GioStatus(42)");
    }

    /// Every `GIO_OK` / `GIO_ERR_*` define of gio_abi.h has a name, and the name is the
    /// define's.
    #[test]
    fn every_header_status_is_named() {
        let header = ffi::GIO_ABI_H;
        let mut seen = 0;
        for line in header.lines() {
            let mut words = line.split_whitespace();
            let (Some("#define"), Some(name), Some(value)) =
                (words.next(), words.next(), words.next())
            else {
                continue;
            };
            if name != "GIO_OK" && !name.starts_with("GIO_ERR_") {
                continue;
            }
            let value: i32 = value.trim_end_matches('u').parse().expect(name);
            assert_eq!(GioStatus(value).name(), Some(name), "{name} = {value}");
            assert!(
                GioStatus::ALL.contains(&GioStatus(value)),
                "{name} not in ALL"
            );
            seen += 1;
        }
        assert_eq!(
            seen,
            GioStatus::ALL.len(),
            "ALL names a status the header lacks"
        );
    }
}
