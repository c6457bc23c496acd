//! A proxy queue pair's memory table (local regions and the peer's, by the 16-bit index
//! ring entries carry) and the validation of every entry against it.

use super::transport::RemoteDescriptor;
use crate::error::{Error, Result};
use crate::status::GioStatus;
use gpu_mem::DeviceBuffer;
use gpunetio_sys as ffi;
use std::sync::Arc;

/// Most regions in one table (indices are 16 bits in ring entries).
pub const MAX_REGIONS: usize = u16::MAX as usize + 1;

/// Device memory the proxy reaches by copies (bounce buffers) because the transport
/// cannot register it. Implemented for [`DeviceBuffer`] (`cuMemcpyDtoH`/`HtoD`); any
/// other memory with copy routines can be staged the same way.
pub trait DeviceCopy: Send + Sync + 'static {
    /// Length in bytes.
    fn len(&self) -> u64;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the GPU addresses it (0 if nowhere).
    fn device_addr(&self) -> u64 {
        0
    }
    /// Copies `dst.len()` bytes at `offset` out (before a put).
    fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` in at `offset` (after a get).
    fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<()>;
}

impl DeviceCopy for DeviceBuffer {
    fn len(&self) -> u64 {
        DeviceBuffer::len(self) as u64
    }
    fn device_addr(&self) -> u64 {
        self.ptr()
    }
    fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        Ok(DeviceBuffer::copy_to_host(self, offset as usize, dst)?)
    }
    fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<()> {
        Ok(DeviceBuffer::copy_from_host(self, offset as usize, src)?)
    }
}

/// Device memory reached by copies: a caller's range (framework memory, a registration
/// of another layer) or a [`DeviceBuffer`] the transport cannot register.
///
/// Copies run on a private non-blocking stream: a kernel that waits for the proxy may sit
/// on the legacy default stream, and a plain `cuMemcpyDtoH` (legacy stream) would wait
/// for that kernel, which waits for the copy.
#[derive(Debug)]
pub struct DeviceRange {
    gpu: gpu_mem::Gpu,
    addr: u64,
    len: u64,
    stream: CopyStream,
    _keep: Option<Arc<DeviceBuffer>>,
}

#[derive(Debug)]
struct CopyStream {
    gpu: gpu_mem::Gpu,
    raw: cudarc::driver::sys::CUstream,
}

// SAFETY: a CUDA stream handle may be used from any thread of the process that made it.
unsafe impl Send for CopyStream {}
// SAFETY: as above; the driver serialises work submitted to one stream.
unsafe impl Sync for CopyStream {}

impl CopyStream {
    fn new(gpu: &gpu_mem::Gpu) -> Result<Self> {
        use cudarc::driver::sys;
        gpu.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` receives a new stream of the current context.
        gpu_mem::cvt("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Self {
            gpu: gpu.clone(),
            raw,
        })
    }

    fn finish(&self, call: &'static str, queued: cudarc::driver::sys::CUresult) -> Result<()> {
        gpu_mem::cvt(call, queued)?;
        // SAFETY: our stream, alive until drop.
        Ok(gpu_mem::cvt("cuStreamSynchronize", unsafe {
            cudarc::driver::sys::cuStreamSynchronize(self.raw)
        })?)
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: our stream; nothing is queued on it (every copy synchronised).
        unsafe { cudarc::driver::sys::cuStreamDestroy_v2(self.raw) };
    }
}

impl DeviceRange {
    /// `[addr, addr + len)` of `gpu`'s memory.
    ///
    /// # Safety
    /// The range must stay allocated while the value (and any proxy table holding it)
    /// lives.
    pub unsafe fn new(gpu: &gpu_mem::Gpu, addr: u64, len: u64) -> Result<Self> {
        Ok(Self {
            gpu: gpu.clone(),
            addr,
            len,
            stream: CopyStream::new(gpu)?,
            _keep: None,
        })
    }

    /// The whole of `buf`, kept alive by the value.
    pub fn of_buffer(buf: Arc<DeviceBuffer>) -> Result<Self> {
        Ok(Self {
            gpu: buf.gpu().clone(),
            addr: buf.ptr(),
            len: buf.len() as u64,
            stream: CopyStream::new(buf.gpu())?,
            _keep: Some(buf),
        })
    }

    fn check(&self, offset: u64, n: usize) -> Result<u64> {
        if offset > self.len || n as u64 > self.len - offset {
            return Err(Error::InvalidArgument(format!(
                "{offset}+{n} outside a device range of {} bytes",
                self.len
            )));
        }
        Ok(self.addr + offset)
    }
}

impl DeviceCopy for DeviceRange {
    fn len(&self) -> u64 {
        self.len
    }
    fn device_addr(&self) -> u64 {
        self.addr
    }
    fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let src = self.check(offset, dst.len())?;
        self.gpu.bind()?;
        // SAFETY: the source is inside the range kept allocated (constructor contract or
        // the buffer held); `dst` is a live slice of that length, synchronised before
        // return.
        let queued = unsafe {
            cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr().cast(),
                src,
                dst.len(),
                self.stream.raw,
            )
        };
        self.stream.finish("cuMemcpyDtoHAsync", queued)
    }
    fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<()> {
        let dst = self.check(offset, src.len())?;
        self.gpu.bind()?;
        // SAFETY: as above, with the roles swapped.
        let queued = unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                dst,
                src.as_ptr().cast(),
                src.len(),
                self.stream.raw,
            )
        };
        self.stream.finish("cuMemcpyHtoDAsync", queued)
    }
}

/// A local region.
pub(crate) enum Local<R> {
    /// Registered with the transport: operations go straight to `addr`.
    Direct {
        reg: R,
        /// Address the transport uses (host pointer or registered device pointer).
        addr: u64,
        len: u64,
        /// Where the GPU addresses it (the memory table's `addr`), 0 if nowhere.
        dev_addr: u64,
        /// Host memory (`GIO_MR_HOST`: a kernel's stores to it need a system-scope
        /// fence before a post that moves them).
        host: bool,
        /// Keeps the memory alive where the proxy owns a reference to it.
        _keep: Option<Arc<dyn Send + Sync>>,
    },
    /// Reached through bounce buffers.
    Staged { mem: Arc<dyn DeviceCopy> },
}

/// One entry of the table.
pub(crate) enum Region<R> {
    Local(Local<R>),
    Remote(RemoteDescriptor),
    /// A removed region's index: entries naming it are refused (bounds), and a later
    /// region may take it.
    Vacant,
}

impl<R> Region<R> {
    fn len(&self) -> u64 {
        match self {
            Region::Local(Local::Direct { len, .. }) => *len,
            Region::Local(Local::Staged { mem }) => mem.len(),
            Region::Remote(d) => d.len,
            Region::Vacant => 0,
        }
    }

    /// The `gio_dev_mr` a kernel's bounds checks read.
    pub(crate) fn dev_mr(&self, index: u32) -> ffi::gio_dev_mr {
        let (addr, flags) = match self {
            Region::Local(Local::Direct { dev_addr, host, .. }) => (
                *dev_addr,
                ffi::GIO_MR_MAPPED | if *host { ffi::GIO_MR_HOST } else { 0 },
            ),
            Region::Local(Local::Staged { mem }) => (mem.device_addr(), ffi::GIO_MR_MAPPED),
            Region::Remote(_) => (0, ffi::GIO_MR_REMOTE),
            Region::Vacant => (0, 0),
        };
        ffi::gio_dev_mr {
            addr,
            length: self.len(),
            flags,
            index,
            reserved: 0,
        }
    }
}

/// The table: regions by index.
pub(crate) struct MemoryTable<R> {
    pub(crate) regions: Vec<Region<R>>,
}

/// A validated entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Nop,
    Fence,
    Put {
        local: u16,
        local_off: u64,
        remote: u16,
        remote_off: u64,
        len: u64,
    },
    PutInline {
        remote: u16,
        remote_off: u64,
        data: [u8; 8],
        len: u8,
    },
    Get {
        local: u16,
        local_off: u64,
        remote: u16,
        remote_off: u64,
        len: u64,
    },
    Signal {
        mr: u16,
        off: u64,
        add: u64,
    },
}

/// A validated entry with its flags resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Op {
    pub kind: OpKind,
    /// `GIO_FLAG_SIGNAL`: (region, offset, addend) after the data.
    pub signal: Option<(u16, u64, u64)>,
    /// `GIO_FLAG_COUNTER`: counter index.
    pub counter: Option<u32>,
}

impl Op {
    /// Whether the operation reads or writes region `mr`.
    pub(crate) fn uses(&self, mr: u16) -> bool {
        let data = match self.kind {
            OpKind::Nop | OpKind::Fence => false,
            OpKind::Put { local, remote, .. } | OpKind::Get { local, remote, .. } => {
                local == mr || remote == mr
            }
            OpKind::PutInline { remote, .. } => remote == mr,
            OpKind::Signal { mr: m, .. } => m == mr,
        };
        data || self.signal.is_some_and(|(m, _, _)| m == mr)
    }
}

/// Why an entry is refused: the status for `ctrl.error` and a reason for the host.
pub(crate) type Refusal = (GioStatus, String);

fn bad(reason: String) -> Refusal {
    (GioStatus::BAD_ENTRY, reason)
}

fn bounds(reason: String) -> Refusal {
    (GioStatus::BOUNDS, reason)
}

impl<R> MemoryTable<R> {
    pub(crate) fn new() -> Self {
        Self {
            regions: Vec::new(),
        }
    }

    /// Adds `region` at the first vacant index at or above `floor`, else at the end.
    pub(crate) fn push_from(&mut self, floor: u32, region: Region<R>) -> Result<u32> {
        let floor = floor as usize;
        if let Some(i) = self
            .regions
            .iter()
            .skip(floor)
            .position(|r| matches!(r, Region::Vacant))
        {
            self.regions[floor + i] = region;
            return Ok((floor + i) as u32);
        }
        let at = self.regions.len().max(floor);
        self.place(at as u32, region)?;
        Ok(at as u32)
    }

    /// Adds `region` at the end (or the first vacant index).
    #[cfg(test)]
    pub(crate) fn push(&mut self, region: Region<R>) -> Result<u32> {
        self.push_from(0, region)
    }

    /// Puts `region` at `index`, which must be vacant or past the end (the gap is
    /// vacant).
    pub(crate) fn place(&mut self, index: u32, region: Region<R>) -> Result<()> {
        let index = index as usize;
        if index >= MAX_REGIONS {
            return Err(Error::InvalidArgument(format!(
                "a queue pair's memory table holds at most {MAX_REGIONS} regions (index {index})"
            )));
        }
        if index < self.regions.len() {
            if !matches!(self.regions[index], Region::Vacant) {
                return Err(Error::InvalidArgument(format!(
                    "region {index} of the memory table is taken"
                )));
            }
            self.regions[index] = region;
        } else {
            self.regions.resize_with(index, || Region::Vacant);
            self.regions.push(region);
        }
        Ok(())
    }

    /// Vacates `index`; returns what was there (the caller drops it outside the lock).
    pub(crate) fn remove(&mut self, index: u32) -> Result<Region<R>> {
        match self.regions.get_mut(index as usize) {
            Some(r) if !matches!(r, Region::Vacant) => Ok(std::mem::replace(r, Region::Vacant)),
            _ => Err(Error::InvalidArgument(format!(
                "no region {index} in the memory table"
            ))),
        }
    }

    pub(crate) fn get(&self, index: u16) -> &Region<R> {
        &self.regions[index as usize]
    }

    /// `[off, off + len)` inside region `mr`, which must be remote or local as asked.
    fn check_range(
        &self,
        what: &str,
        mr: u16,
        off: u64,
        len: u64,
        remote: bool,
    ) -> Result<(), Refusal> {
        let Some(region) = self.regions.get(mr as usize) else {
            return Err(bounds(format!(
                "{what} region {mr} is not in the table ({} regions)",
                self.regions.len()
            )));
        };
        if matches!(region, Region::Vacant) {
            return Err(bounds(format!("{what} region {mr} was removed")));
        }
        let is_remote = matches!(region, Region::Remote(_));
        if is_remote != remote {
            return Err(bounds(format!(
                "{what} region {mr} is {}, expected {}",
                if is_remote { "the peer's" } else { "local" },
                if remote { "the peer's" } else { "local" }
            )));
        }
        let rlen = region.len();
        if off > rlen || len > rlen - off {
            return Err(bounds(format!(
                "{what} range {off}+{len} exceeds region {mr} of {rlen} bytes"
            )));
        }
        Ok(())
    }

    fn check_signal(&self, mr: u16, off: u64) -> Result<(), Refusal> {
        if off & 7 != 0 {
            return Err(bounds(format!("signal offset {off} is not 8-byte aligned")));
        }
        self.check_range("signal", mr, off, 8, true)
    }

    /// Validates an entry the way the device library's checks and the ABI define it;
    /// a refusal is never posted.
    pub(crate) fn validate(
        &self,
        e: &ffi::gio_ring_entry,
        num_counters: u32,
    ) -> Result<Op, Refusal> {
        if e.opcode > ffi::GIO_OP_MAX {
            return Err(bad(format!(
                "opcode {} (at most {})",
                e.opcode,
                ffi::GIO_OP_MAX
            )));
        }
        if e.flags & !ffi::GIO_FLAGS_ALL != 0 {
            return Err(bad(format!("unknown flags {:#x}", e.flags)));
        }
        if e.reserved != 0 {
            return Err(bad(format!("reserved field {:#x} is not zero", e.reserved)));
        }
        let signal_flag = e.flags & ffi::GIO_FLAG_SIGNAL != 0;
        let counter_flag = e.flags & ffi::GIO_FLAG_COUNTER != 0;
        let data_op = matches!(e.opcode, ffi::GIO_OP_PUT | ffi::GIO_OP_PUT_INLINE);
        if signal_flag && !data_op {
            return Err(bad(format!(
                "GIO_FLAG_SIGNAL on opcode {} (puts only)",
                e.opcode
            )));
        }
        if counter_flag && matches!(e.opcode, ffi::GIO_OP_NOP | ffi::GIO_OP_FENCE) {
            return Err(bad(format!("GIO_FLAG_COUNTER on opcode {}", e.opcode)));
        }
        let counter = if counter_flag {
            if e.counter >= num_counters {
                return Err(bounds(format!("counter {} of {num_counters}", e.counter)));
            }
            Some(e.counter)
        } else {
            None
        };
        let signal = if signal_flag {
            self.check_signal(e.signal_mr, e.signal_off)?;
            Some((e.signal_mr, e.signal_off, e.signal_add))
        } else {
            None
        };
        let kind = match e.opcode {
            ffi::GIO_OP_NOP => OpKind::Nop,
            ffi::GIO_OP_FENCE => OpKind::Fence,
            ffi::GIO_OP_PUT | ffi::GIO_OP_GET => {
                self.check_range("remote", e.remote_mr, e.remote_off, e.length, true)?;
                self.check_range("local", e.local_mr, e.local_off, e.length, false)?;
                let (local, local_off, remote, remote_off, len) =
                    (e.local_mr, e.local_off, e.remote_mr, e.remote_off, e.length);
                if e.opcode == ffi::GIO_OP_PUT {
                    OpKind::Put {
                        local,
                        local_off,
                        remote,
                        remote_off,
                        len,
                    }
                } else {
                    OpKind::Get {
                        local,
                        local_off,
                        remote,
                        remote_off,
                        len,
                    }
                }
            }
            ffi::GIO_OP_PUT_INLINE => {
                if !matches!(e.length, 1 | 2 | 4 | 8) {
                    return Err(bad(format!(
                        "inline put of {} bytes (1, 2, 4 or 8)",
                        e.length
                    )));
                }
                self.check_range("remote", e.remote_mr, e.remote_off, e.length, true)?;
                OpKind::PutInline {
                    remote: e.remote_mr,
                    remote_off: e.remote_off,
                    data: e.local_off.to_le_bytes(),
                    len: e.length as u8,
                }
            }
            ffi::GIO_OP_SIGNAL => {
                self.check_signal(e.signal_mr, e.signal_off)?;
                OpKind::Signal {
                    mr: e.signal_mr,
                    off: e.signal_off,
                    add: e.signal_add,
                }
            }
            _ => unreachable!("opcode checked above"),
        };
        Ok(Op {
            kind,
            signal,
            counter,
        })
    }
}

/// Fuzzing entry point (not a stable API): a ring slot's 64 bytes as a producer may
/// leave them, from `input` (zero-padded; bytes 64..72: the ticket, byte 72: the ring
/// size's log2, byte 73: the number of counters). The slot is decoded as the proxy reads
/// an image entry (`entry_decode`) and validated as stored and as decoded against a table
/// of a local region, a peer's region and a removed one. Returns whether every accepted
/// entry stays inside the regions and counters it names and the image encoding round
/// trips (validation itself must never panic).
#[doc(hidden)]
pub fn fuzz_ring_entry(input: &[u8]) -> bool {
    use super::transport::TransportKind;
    const LOCAL_LEN: u64 = 4096;
    const REMOTE_LEN: u64 = 8192;
    let byte = |i: usize| input.get(i).copied().unwrap_or(0);
    let word = |k: usize| u64::from_le_bytes(std::array::from_fn(|i| byte(8 * k + i)));
    let raw: [u64; 8] = std::array::from_fn(word);
    let ticket = word(8) >> 1;
    let ring_size = 1u32 << (byte(72) % 21);
    let num_counters = u32::from(byte(73));

    let mut table = MemoryTable::<()>::new();
    let regions = [
        Region::Local(Local::Direct {
            reg: (),
            host: true,
            addr: 0x1000,
            len: LOCAL_LEN,
            dev_addr: 0,
            _keep: None,
        }),
        Region::Remote(RemoteDescriptor {
            transport: TransportKind::FABRIC,
            addr: 0x7f00_0000,
            len: REMOTE_LEN,
            key: 1,
        }),
        Region::Vacant,
    ];
    for (index, region) in regions.into_iter().enumerate() {
        if table.place(index as u32, region).is_err() {
            return false;
        }
    }
    let inside = |mr: u16, off: u64, len: u64, remote: bool| {
        let limit = match (mr, remote) {
            (0, false) => LOCAL_LEN,
            (1, true) => REMOTE_LEN,
            _ => return false,
        };
        off.checked_add(len).is_some_and(|end| end <= limit)
    };
    let accepted_ok = |w: [u64; 8]| {
        // SAFETY: gio_ring_entry is 64 bytes of integers, any bit pattern valid.
        let entry = unsafe { std::mem::transmute::<[u64; 8], ffi::gio_ring_entry>(w) };
        let Ok(op) = table.validate(&entry, num_counters) else {
            return true;
        };
        let data_ok = match op.kind {
            OpKind::Nop | OpKind::Fence => true,
            OpKind::Put {
                local,
                local_off,
                remote,
                remote_off,
                len,
            }
            | OpKind::Get {
                local,
                local_off,
                remote,
                remote_off,
                len,
            } => inside(local, local_off, len, false) && inside(remote, remote_off, len, true),
            OpKind::PutInline {
                remote,
                remote_off,
                len,
                ..
            } => matches!(len, 1 | 2 | 4 | 8) && inside(remote, remote_off, len.into(), true),
            OpKind::Signal { mr, off, .. } => off.is_multiple_of(8) && inside(mr, off, 8, true),
        };
        let signal_ok = op
            .signal
            .is_none_or(|(mr, off, _)| off.is_multiple_of(8) && inside(mr, off, 8, true));
        let counter_ok = op.counter.is_none_or(|c| c < num_counters);
        data_ok && signal_ok && counter_ok
    };

    let mut decoded = raw;
    let image_ok = if ffi::entry_decode(&mut decoded, ticket, ring_size) {
        // What decodes is published again as the same words.
        let mut again = decoded;
        ffi::entry_encode(&mut again, ticket, ring_size);
        let mut twice = again;
        ffi::entry_decode(&mut twice, ticket, ring_size) && twice == decoded
    } else {
        true
    };
    accepted_ok(raw) && accepted_ok(decoded) && image_ok
}

#[cfg(test)]
mod tests {
    use super::super::ring::Entry;
    use super::super::transport::TransportKind;
    use super::*;

    fn table() -> MemoryTable<()> {
        let mut t = MemoryTable::new();
        t.push(Region::Local(Local::Direct {
            reg: (),
            host: true,
            addr: 0x1000,
            len: 100,
            dev_addr: 0,
            _keep: None,
        }))
        .unwrap();
        t.push(Region::Remote(RemoteDescriptor {
            transport: TransportKind::FABRIC,
            addr: 0,
            len: 64,
            key: 1,
        }))
        .unwrap();
        t
    }

    fn status(e: Entry) -> GioStatus {
        match table().validate(&e.0, 2) {
            Ok(_) => GioStatus::OK,
            Err((s, _)) => s,
        }
    }

    #[test]
    fn good_entries_pass() {
        for e in [
            Entry::put(1, 0, 0, 36, 64),
            Entry::put(1, 64, 0, 100, 0),
            Entry::get(0, 0, 1, 0, 64),
            Entry::put_inline(1, 56, 7, 8),
            Entry::put_inline(1, 63, 7, 1),
            Entry::signal(1, 8, 1),
            Entry::put(1, 0, 0, 0, 8)
                .with_signal(1, 56, 1)
                .with_counter(1),
            Entry::put_inline(1, 0, 1, 4).with_signal(1, 0, 1),
            Entry::get(0, 0, 1, 0, 8).with_counter(0),
            Entry::fence(),
            Entry::nop(),
        ] {
            assert_eq!(status(e), GioStatus::OK, "{e:?}");
        }
    }

    #[test]
    fn removed_regions_refuse_entries_and_are_reused() {
        let mut t = table();
        assert!(matches!(t.remove(1).unwrap(), Region::Remote(_)));
        assert!(t.remove(1).is_err(), "removed twice");
        let (s, why) = t.validate(&Entry::put(1, 0, 0, 0, 8).0, 0).unwrap_err();
        assert_eq!(s, GioStatus::BOUNDS);
        assert!(why.contains("removed"), "{why}");
        let remote = || {
            Region::Remote(RemoteDescriptor {
                transport: TransportKind::FABRIC,
                addr: 0,
                len: 8,
                key: 2,
            })
        };
        assert_eq!(t.push(remote()).unwrap(), 1, "the vacant index is reused");
        assert_eq!(t.push_from(5, remote()).unwrap(), 5, "gap below the floor");
        assert!(matches!(t.regions[3], Region::Vacant));
        assert_eq!(t.push_from(2, remote()).unwrap(), 2);
        assert!(t.place(5, remote()).is_err(), "taken");
        t.place(3, remote()).unwrap();
        assert_eq!(t.regions.len(), 6);
        assert!(t.place(MAX_REGIONS as u32, remote()).is_err());
        let op = t
            .validate(&Entry::put(2, 0, 0, 0, 8).with_signal(3, 0, 1).0, 0)
            .unwrap();
        assert!(op.uses(0) && op.uses(2) && op.uses(3) && !op.uses(1));
    }

    #[test]
    fn bad_entries_are_typed() {
        let mut raw = Entry::nop().0;
        raw.opcode = 6;
        assert_eq!(status(Entry::raw(raw)), GioStatus::BAD_ENTRY);
        let mut raw = Entry::nop().0;
        raw.flags = 4;
        assert_eq!(status(Entry::raw(raw)), GioStatus::BAD_ENTRY);
        let mut raw = Entry::nop().0;
        raw.reserved = 1;
        assert_eq!(status(Entry::raw(raw)), GioStatus::BAD_ENTRY);
        assert_eq!(status(Entry::put_inline(1, 0, 1, 3)), GioStatus::BAD_ENTRY);
        assert_eq!(
            status(Entry::get(0, 0, 1, 0, 8).with_signal(1, 0, 1)),
            GioStatus::BAD_ENTRY
        );
        assert_eq!(status(Entry::fence().with_counter(0)), GioStatus::BAD_ENTRY);
        // Bounds: index, kind, range, alignment, counter.
        assert_eq!(status(Entry::put(2, 0, 0, 0, 8)), GioStatus::BOUNDS);
        assert_eq!(status(Entry::put(0, 0, 0, 0, 8)), GioStatus::BOUNDS);
        assert_eq!(status(Entry::put(1, 0, 1, 0, 8)), GioStatus::BOUNDS);
        assert_eq!(status(Entry::put(1, 60, 0, 0, 8)), GioStatus::BOUNDS);
        assert_eq!(status(Entry::put(1, 0, 0, 96, 8)), GioStatus::BOUNDS);
        assert_eq!(status(Entry::put(1, u64::MAX, 0, 0, 8)), GioStatus::BOUNDS);
        assert_eq!(status(Entry::put_inline(1, 60, 1, 8)), GioStatus::BOUNDS);
        assert_eq!(status(Entry::signal(1, 4, 1)), GioStatus::BOUNDS);
        assert_eq!(status(Entry::signal(1, 64, 1)), GioStatus::BOUNDS);
        assert_eq!(status(Entry::signal(0, 0, 1)), GioStatus::BOUNDS);
        assert_eq!(
            status(Entry::put(1, 0, 0, 0, 8).with_signal(1, 3, 1)),
            GioStatus::BOUNDS
        );
        assert_eq!(
            status(Entry::put(1, 0, 0, 0, 8).with_counter(2)),
            GioStatus::BOUNDS
        );
    }
}
