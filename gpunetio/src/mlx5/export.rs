//! Export of an mlx5 queue to kernels: the `gio_mlx5_qp` the device code reads (queue
//! addresses, sizes, QP number, memory keys) and the `gio_dev_qp` passed as the kernel
//! argument, both in device memory. Used by [`super::Mlx5QueuePair::export`] for a DEVX
//! queue pair, and usable for any queue laid out the way a ConnectX reads it (the
//! emulated-NIC test).

use super::cqe::{CqeError, Syndrome};
use crate::error::{Error, Result};
use gpu_mem::{DeviceBuffer, Gpu};
use gpunetio_sys as ffi;
use gpunetio_sys::mlx5 as abi;
use std::any::Any;
use std::sync::Arc;

/// Where a queue lives, as device code addresses it (device or GPU-mapped addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLayout {
    /// The send queue: `sq_wqe_cnt` 64-byte WQEBBs.
    pub sq: u64,
    /// The QP doorbell record (two big-endian dwords: receive, send).
    pub dbrec: u64,
    /// The doorbell register (a GPU mapping of the UAR's `reg_addr`).
    pub db: u64,
    /// The CQ: `cq_cqe_cnt` 64-byte CQEs, every `op_own` initialised to `INVALID << 4`.
    pub cq: u64,
    /// The CQ doorbell record.
    pub cq_dbrec: u64,
    /// The QP number.
    pub qpn: u32,
    /// WQEBBs in the send queue (a power of two).
    pub sq_wqe_cnt: u32,
    /// CQEs in the CQ (a power of two, at least `sq_wqe_cnt`).
    pub cq_cqe_cnt: u32,
    /// `GIO_MLX5_QP_*` flags (BlueFlame).
    pub flags: u32,
    /// 8 local bytes atomics' fetched values land in, and their lkey.
    pub scratch: (u64, u32),
}

impl QueueLayout {
    fn check(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("mlx5 queue: {why}")));
        if !self.sq_wqe_cnt.is_power_of_two() || !self.cq_cqe_cnt.is_power_of_two() {
            return bad(format!(
                "{} WQEBBs / {} CQEs: powers of two are needed",
                self.sq_wqe_cnt, self.cq_cqe_cnt
            ));
        }
        if self.cq_cqe_cnt < self.sq_wqe_cnt {
            return bad(format!(
                "{} CQEs for {} WQEBBs: every WQE asks for a CQE, so the CQ must be at least as deep",
                self.cq_cqe_cnt, self.sq_wqe_cnt
            ));
        }
        if self.qpn > 0x00ff_ffff {
            return bad(format!("QP number {:#x} exceeds 24 bits", self.qpn));
        }
        if [self.sq, self.dbrec, self.db, self.cq, self.cq_dbrec].contains(&0) {
            return bad("a null queue address".into());
        }
        Ok(())
    }
}

/// The memory table of an mlx5 queue pair: for each region its `gio_dev_mr` (bounds
/// the device code checks) and its wire address and key (lkey local, rkey remote).
#[derive(Default)]
pub struct MemoryTable {
    mrs: Vec<ffi::gio_dev_mr>,
    keys: Vec<abi::gio_mlx5_key>,
    keep: Vec<Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for MemoryTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTable")
            .field("regions", &self.mrs.len())
            .finish()
    }
}

/// Most regions in one table (indices are 16 bits in the device API).
pub const MAX_REGIONS: usize = u16::MAX as usize;

impl MemoryTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    fn push(
        &mut self,
        addr: u64,
        len: u64,
        flags: u32,
        key: u32,
        keep: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<u32> {
        if self.mrs.len() >= MAX_REGIONS {
            return Err(Error::InvalidArgument(format!(
                "a queue pair's memory table holds at most {MAX_REGIONS} regions"
            )));
        }
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(Error::InvalidArgument(format!(
                "region {addr:#x}+{len}: empty or wrapping"
            )));
        }
        let index = self.mrs.len() as u32;
        self.mrs.push(ffi::gio_dev_mr {
            addr: if flags & ffi::GIO_MR_MAPPED != 0 {
                addr
            } else {
                0
            },
            length: len,
            flags,
            index,
            reserved: 0,
        });
        self.keys.push(abi::gio_mlx5_key {
            addr,
            key,
            reserved: 0,
        });
        if let Some(k) = keep {
            self.keep.push(k);
        }
        Ok(index)
    }

    /// A local region at GPU address `addr` with lkey `lkey`; `keep` stays alive with
    /// the table (the buffer, its registration).
    pub fn push_local(
        &mut self,
        addr: u64,
        len: u64,
        lkey: u32,
        keep: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<u32> {
        self.push(addr, len, ffi::GIO_MR_MAPPED, lkey, keep)
    }

    /// The peer's region at its address `addr` with rkey `rkey`.
    pub fn push_remote(&mut self, addr: u64, len: u64, rkey: u32) -> Result<u32> {
        self.push(addr, len, ffi::GIO_MR_REMOTE, rkey, None)
    }

    /// Regions so far.
    pub fn len(&self) -> usize {
        self.mrs.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.mrs.is_empty()
    }

    /// The length of region `index`.
    pub fn len_of(&self, index: u32) -> Option<u64> {
        self.mrs.get(index as usize).map(|m| m.length)
    }

    /// The wire address and key of region `index`.
    pub fn key(&self, index: u32) -> Option<abi::gio_mlx5_key> {
        self.keys.get(index as usize).copied()
    }
}

fn upload<T: Copy>(gpu: &Gpu, items: &[T]) -> Result<DeviceBuffer> {
    let bytes = std::mem::size_of_val(items);
    let buf = DeviceBuffer::alloc(gpu, bytes.max(8))?;
    buf.fill(0)?;
    // SAFETY: the callers pass repr(C) structs of integers and byte arrays (no implicit
    // padding), so their bytes are initialised.
    let raw = unsafe { std::slice::from_raw_parts(items.as_ptr().cast::<u8>(), bytes) };
    buf.copy_from_host(0, raw)?;
    Ok(buf)
}

/// Copies the `gio_mlx5_qp`, the memory table, zeroed producer state and counters, and
/// the `gio_dev_qp` to device memory. `owner` (the queue pair, the emulator's buffers)
/// stays alive as long as the export.
pub fn export(
    gpu: &Gpu,
    layout: &QueueLayout,
    table: &MemoryTable,
    num_counters: u32,
    timeout: std::time::Duration,
    owner: Arc<dyn Any + Send + Sync>,
) -> Result<ExportedMlx5QueuePair> {
    layout.check()?;
    let keys = upload(gpu, &table.keys)?;
    let mrs = upload(gpu, &table.mrs)?;
    let m = abi::gio_mlx5_qp {
        sq_buf: layout.sq,
        dbrec: layout.dbrec,
        db: layout.db,
        cq_buf: layout.cq,
        cq_dbrec: layout.cq_dbrec,
        keys: keys.ptr(),
        scratch_addr: layout.scratch.0,
        scratch_lkey: layout.scratch.1,
        qpn: layout.qpn,
        sq_wqe_cnt: layout.sq_wqe_cnt,
        cq_cqe_cnt: layout.cq_cqe_cnt,
        flags: layout.flags,
        num_keys: table.keys.len() as u32,
        ..abi::gio_mlx5_qp::default()
    };
    let mlx5 = upload(gpu, std::slice::from_ref(&m))?;
    let state = upload(gpu, &[ffi::gio_ring_dev_state::default()])?;
    let counters = DeviceBuffer::alloc(gpu, (8 * num_counters as usize).max(8))?;
    counters.fill(0)?;
    let dev = ffi::gio_dev_qp {
        nic_handler: ffi::GIO_NIC_HANDLER_MLX5,
        num_mrs: table.mrs.len() as u32,
        state: state.ptr(),
        mrs: mrs.ptr(),
        counters: counters.ptr(),
        num_counters,
        timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
        mlx5: mlx5.ptr(),
        ..ffi::gio_dev_qp::default()
    };
    let qp = upload(gpu, std::slice::from_ref(&dev))?;
    Ok(ExportedMlx5QueuePair {
        qp,
        mlx5,
        _keys: keys,
        _mrs: mrs,
        _state: state,
        counters,
        num_counters,
        _keep: table.keep.clone(),
        _owner: owner,
    })
}

/// What the device code recorded on an exported queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mlx5DeviceState {
    /// WQEs handed to the NIC (doorbells rung).
    pub sq_rung: u64,
    /// WQEs whose completion was seen.
    pub sq_completed: u64,
    /// The first error CQE, if any: its WQE index and syndrome.
    pub error: Option<(u64, Syndrome, u8)>,
}

impl Mlx5DeviceState {
    /// The first error as a [`CqeError`]-like status word (`vendor << 8 | syndrome`).
    pub fn error_word(&self) -> Option<u32> {
        self.error
            .map(|(_, s, vendor)| (u32::from(vendor) << 8) | u32::from(s.0))
    }

    /// Whether an error CQE matches `e` (its syndrome).
    pub fn matches(&self, e: &CqeError) -> bool {
        self.error.is_some_and(|(_, s, _)| s == e.syndrome)
    }
}

/// An mlx5 queue pair exported to device memory: [`device_ptr`](Self::device_ptr) is
/// the `gio_dev_qp *` kernel argument. Keeps the queue pair and every region alive; no
/// kernel may use it after it is dropped.
pub struct ExportedMlx5QueuePair {
    qp: DeviceBuffer,
    mlx5: DeviceBuffer,
    _keys: DeviceBuffer,
    _mrs: DeviceBuffer,
    _state: DeviceBuffer,
    counters: DeviceBuffer,
    num_counters: u32,
    _keep: Vec<Arc<dyn Any + Send + Sync>>,
    _owner: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for ExportedMlx5QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportedMlx5QueuePair")
            .field("qp", &self.qp.ptr())
            .finish_non_exhaustive()
    }
}

impl ExportedMlx5QueuePair {
    /// The device address of the `gio_dev_qp`.
    pub fn device_ptr(&self) -> u64 {
        self.qp.ptr()
    }

    /// The device address of the `gio_mlx5_qp`.
    pub fn mlx5_ptr(&self) -> u64 {
        self.mlx5.ptr()
    }

    /// Reads the device-written half of the `gio_mlx5_qp` (synchronous; meaningful
    /// once the kernels using it are done).
    pub fn device_state(&self) -> Result<Mlx5DeviceState> {
        let mut b = vec![0u8; std::mem::size_of::<abi::gio_mlx5_qp>()];
        self.mlx5.copy_to_host(0, &mut b)?;
        // SAFETY: gio_mlx5_qp is a repr(C) struct of integers: any bytes are valid.
        let m: abi::gio_mlx5_qp = unsafe { std::ptr::read_unaligned(b.as_ptr().cast()) };
        Ok(Mlx5DeviceState {
            sq_rung: m.sq_rung,
            sq_completed: m.sq_completed,
            error: (m.error != ffi::GIO_OK).then_some((
                m.error_wqe,
                Syndrome(m.syndrome as u8),
                (m.syndrome >> 8) as u8,
            )),
        })
    }

    /// Completion counter `index` (synchronous read of device memory).
    pub fn counter(&self, index: u32) -> Result<u64> {
        if index >= self.num_counters {
            return Err(Error::InvalidArgument(format!(
                "counter {index} of a queue pair with {}",
                self.num_counters
            )));
        }
        let mut v = [0u8; 8];
        self.counters.copy_to_host(8 * index as usize, &mut v)?;
        Ok(u64::from_le_bytes(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> QueueLayout {
        QueueLayout {
            sq: 0x1000,
            dbrec: 0x2000,
            db: 0x3000,
            cq: 0x4000,
            cq_dbrec: 0x5000,
            qpn: 0x12,
            sq_wqe_cnt: 8,
            cq_cqe_cnt: 8,
            flags: 0,
            scratch: (0x6000, 1),
        }
    }

    #[test]
    fn layouts_the_device_code_cannot_use_are_refused() {
        assert!(layout().check().is_ok());
        for bad in [
            QueueLayout {
                sq_wqe_cnt: 6,
                ..layout()
            },
            QueueLayout {
                cq_cqe_cnt: 4,
                ..layout()
            },
            QueueLayout {
                qpn: 1 << 24,
                ..layout()
            },
            QueueLayout { db: 0, ..layout() },
        ] {
            assert!(
                matches!(bad.check(), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_table_keeps_keys_parallel_to_regions() {
        let mut t = MemoryTable::new();
        assert_eq!(t.push_local(0x7000, 64, 0x11, None).unwrap(), 0);
        assert_eq!(t.push_remote(0x9000, 128, 0x22).unwrap(), 1);
        assert_eq!(t.len(), 2);
        assert_eq!(t.mrs[0].flags, ffi::GIO_MR_MAPPED);
        assert_eq!(t.mrs[0].addr, 0x7000);
        assert_eq!(t.mrs[1].flags, ffi::GIO_MR_REMOTE);
        assert_eq!(t.mrs[1].addr, 0, "a peer's address is not mapped here");
        assert_eq!(t.key(1).unwrap().addr, 0x9000);
        assert_eq!(t.key(1).unwrap().key, 0x22);
        assert!(t.push_remote(1, 0, 1).is_err());
        assert!(t.push_remote(u64::MAX, 2, 1).is_err());
    }
}
