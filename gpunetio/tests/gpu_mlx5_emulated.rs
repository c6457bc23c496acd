//! The native mlx5 handler end to end on a real GPU against an emulated NIC: kernels
//! post through the high-level device calls onto a GPU-resident send queue, the
//! doorbell record sits in device memory and the "UAR" is a pinned host page mapped
//! into the GPU; a CPU thread plays the ConnectX. It watches the UAR for doorbells,
//! reads the doorbell record and the send queue (asynchronous copies on its own
//! stream, concurrent with the kernel), decodes every WQE with the host decoder
//! (`gpunetio::mlx5::wqe::decode`), performs the writes, inline writes, reads and
//! atomics on device memory, and writes CQEs into the GPU-resident CQ (body first,
//! then the owner byte) with the right owner bit across CQ wraparound — good CQEs, and
//! error CQEs (bad rkey → remote access error, then flush errors) as a ConnectX in
//! error state would. The queue pair is exported with `gpunetio::mlx5::export` (the
//! same code that exports a DEVX queue pair). Everything but the silicon is exercised:
//! WQE bytes, doorbell ordering (record before UAR, UAR naming the last WQE), 16-bit
//! WQE counter wraparound, send-queue slot reuse, CQE ownership, error syndromes as
//! `GIO_ERR_CQE` and the recorded syndrome, and data, signals and counters.
//!
//! Also: the NIC-handler front (`GpuQueuePair`, `Auto`) on this GPU. Skips with a
//! printed reason without a GPU; fails with NIXL_REQUIRE_GPU=1.

use cudarc::driver::{sys, CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::ffi;
use gpunetio::mlx5::cqe::{self, Syndrome, CQE_SIZE};
use gpunetio::mlx5::export::{export, ExportedMlx5QueuePair, MemoryTable, QueueLayout};
use gpunetio::mlx5::wqe::{self, Wqe, CQ_UPDATE, WQEBB};
use gpunetio::{gpu_for_test, DeviceBuffer, Gpu, HostBuffer};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KERNELS: &str = r#"
#include "gpunetio/gio_device.cuh"
using gio::u64;
using gio::scope;
using gio::sharing;

// Regions: 0 src (local), 1 dst (remote), 2 sig (remote), 3 back (local).
// put, p<u32>, signal, put_counter, fence, get (dst -> back), put_signal, quiet.
extern "C" __global__ void emu_high_level(gio_dev_qp *qp, u64 len, uint32_t value, u64 add,
                                          int *st, u64 *tickets) {
  st[0] = gio::put<scope::thread, sharing::exclusive>(qp, 1, 0, 0, 0, len, &tickets[0]);
  st[1] = gio::p<uint32_t, scope::thread, sharing::exclusive>(qp, 1, len, value, &tickets[1]);
  st[2] = gio::signal<scope::thread, sharing::exclusive>(qp, 2, 0, add, &tickets[2]);
  st[3] = gio::put_counter<scope::thread, sharing::exclusive>(qp, 1, 3 * len, 0, 0, len, 0,
                                                              &tickets[3]);
  st[4] = gio::fence<scope::thread, sharing::exclusive>(qp);
  st[5] = gio::get<scope::thread, sharing::exclusive>(qp, 3, 0, 1, 0, len, &tickets[5]);
  st[6] = gio::put_signal<scope::thread, sharing::exclusive>(qp, 1, 2 * len, 0, 0, len, 2, 0,
                                                             add, &tickets[6]);
  st[7] = gio::quiet(qp);
}

// `n` fences (NOP WQEs) by one thread, then quiet: wraps the send queue, the CQ and
// the 16-bit WQE counter. st[0] = first failure or GIO_OK, st[1] = quiet.
extern "C" __global__ void emu_fences(gio_dev_qp *qp, unsigned n, int *st) {
  int first = GIO_OK;
  for (unsigned i = 0; i < n && first == GIO_OK; i++)
    first = gio::fence<scope::thread, sharing::exclusive>(qp);
  st[0] = first;
  st[1] = gio::quiet(qp);
}

// Every warp of the grid puts its own `len`-byte chunk (src -> dst at warp * len) with
// WARP scope on a GPU-wide shared queue, then quiets. st[warp] = put's result,
// st[warps + warp] = quiet's.
extern "C" __global__ void emu_put_warps(gio_dev_qp *qp, u64 len, int *st, unsigned warps) {
  const unsigned warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int s = gio::put<scope::warp, sharing::gpu>(qp, 1, warp * len, 0, warp * len, len);
  const int q = gio::quiet(qp);
  if (gio::lane_id() == 0) {
    st[warp] = s;
    st[warps + warp] = q;
  }
}

// A put to a region whose rkey the NIC refuses (mr 4), a good put behind it, then
// wait on the first, another put, and quiet: st[0..5].
extern "C" __global__ void emu_error(gio_dev_qp *qp, u64 len, int *st, u64 *tickets) {
  st[0] = gio::put<scope::thread, sharing::exclusive>(qp, 4, 0, 0, 0, len, &tickets[0]);
  st[1] = gio::put<scope::thread, sharing::exclusive>(qp, 1, 0, 0, 0, len, &tickets[1]);
  st[2] = gio::wait(qp, tickets[0]);
  st[3] = gio::put<scope::thread, sharing::exclusive>(qp, 1, 0, 0, 0, len, &tickets[3]);
  st[4] = gio::quiet(qp);
}
"#;

fn module(gpu: &Gpu) -> Arc<CudaModule> {
    let options = CompileOptions::for_gpu(gpu).expect("compute capability");
    let ptx = compile("gio_mlx5_emulated.cu", KERNELS, &options).expect("kernels compile");
    gpu.context().load_module(ptx).expect("module loads")
}

fn function(m: &Arc<CudaModule>, name: &str) -> CudaFunction {
    m.load_function(name)
        .unwrap_or_else(|e| panic!("{name}: {e:?}"))
}

fn cfg(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn zeroed(gpu: &Gpu, len: usize) -> Arc<DeviceBuffer> {
    let b = DeviceBuffer::alloc(gpu, len).expect("alloc");
    b.fill(0).expect("clear");
    Arc::new(b)
}

fn i32s(b: &DeviceBuffer, n: usize) -> Vec<i32> {
    let mut v = vec![0u8; 4 * n];
    b.copy_to_host(0, &mut v).expect("read back");
    v.chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn u64s(b: &DeviceBuffer, n: usize) -> Vec<u64> {
    let mut v = vec![0u8; 8 * n];
    b.copy_to_host(0, &mut v).expect("read back");
    v.chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

// ---- the emulated NIC ---------------------------------------------------------------------

/// A region the NIC knows: key, device address, length.
#[derive(Debug, Clone, Copy)]
struct Region {
    key: u32,
    addr: u64,
    len: u64,
}

fn covers(regions: &[Region], key: u32, addr: u64, len: u64) -> bool {
    regions
        .iter()
        .any(|r| r.key == key && addr >= r.addr && addr + len <= r.addr + r.len)
}

/// What the NIC thread needs (addresses only, so it moves to the thread).
struct NicConfig {
    gpu: Gpu,
    /// Host address of the UAR page's doorbell register.
    uar_host: usize,
    sq: u64,
    dbrec: u64,
    cq: u64,
    sq_wqe_cnt: u32,
    cq_cqe_cnt: u32,
    qpn: u32,
    local: Vec<Region>,
    remote: Vec<Region>,
    vendor_syndrome: u8,
}

/// What the NIC saw and did.
#[derive(Debug, Default)]
struct NicReport {
    doorbells: u64,
    wqes: u64,
    good_cqes: u64,
    error_cqes: Vec<(u64, Syndrome)>,
    by_opcode: std::collections::BTreeMap<u8, u64>,
    /// Protocol violations by the device code (must stay empty).
    violations: Vec<String>,
}

/// Staging layout in pinned host memory.
const ST_DBREC: usize = 0;
const ST_SQ: usize = 64;

struct Nic {
    c: NicConfig,
    stream: Arc<cudarc::driver::CudaStream>,
    staging: HostBuffer,
    st_cqe: usize,
    st_atomic: usize,
    done: u64,
    cq_pi: u64,
    in_error: bool,
    r: NicReport,
}

fn check(call: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call}");
}

impl Nic {
    fn new(c: NicConfig) -> Self {
        let sq_bytes = c.sq_wqe_cnt as usize * WQEBB;
        let st_cqe = ST_SQ + sq_bytes;
        let st_atomic = st_cqe + c.sq_wqe_cnt as usize * CQE_SIZE;
        let staging =
            HostBuffer::alloc(&c.gpu, st_atomic + 16 * c.sq_wqe_cnt as usize).expect("staging");
        // A non-blocking stream: its copies run concurrently with the kernel's stream.
        let stream = c.gpu.new_stream().expect("NIC stream");
        Self {
            c,
            stream,
            staging,
            st_cqe,
            st_atomic,
            done: 0,
            cq_pi: 0,
            in_error: false,
            r: NicReport::default(),
        }
    }

    fn host(&mut self, off: usize) -> *mut u8 {
        // SAFETY: every caller stays inside the staging buffer's layout.
        unsafe { self.staging.as_mut_ptr().add(off) }
    }

    fn dtoh(&mut self, off: usize, src: u64, len: usize) {
        let dst = self.host(off);
        // SAFETY: `dst` has `len` bytes of pinned staging; `src` is device memory of a
        // live buffer.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.stream.cu_stream())
        });
    }

    fn htod(&mut self, dst: u64, off: usize, len: usize) {
        let src = self.host(off);
        // SAFETY: as dtoh, the other way.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.stream.cu_stream())
        });
    }

    fn dtod(&self, dst: u64, src: u64, len: usize) {
        // SAFETY: both ranges were checked against the registered regions.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream.cu_stream())
        });
    }

    fn sync(&self) {
        // SAFETY: the NIC's own stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.stream.cu_stream())
        });
    }

    fn staged(&self, off: usize, len: usize) -> Vec<u8> {
        // SAFETY: inside the staging buffer; copies into it were synchronised.
        unsafe { std::slice::from_raw_parts(self.staging.as_ptr().add(off), len) }.to_vec()
    }

    fn violation(&mut self, what: String) {
        if self.r.violations.len() < 32 {
            self.r.violations.push(what);
        }
    }

    fn run(mut self, stop: &AtomicBool, deadline: Duration) -> NicReport {
        let _ = self.c.gpu.bind();
        let start = Instant::now();
        let mut last_uar = 0u64;
        while !stop.load(Ordering::Acquire) {
            if start.elapsed() > deadline {
                self.violation(format!("the emulated NIC ran past {deadline:?}"));
                break;
            }
            // SAFETY: the UAR page is pinned host memory alive for the test.
            let uar = unsafe { std::ptr::read_volatile(self.c.uar_host as *const u64) };
            if uar == last_uar {
                std::hint::spin_loop();
                continue;
            }
            last_uar = uar;
            self.r.doorbells += 1;
            self.doorbell(uar.to_ne_bytes());
        }
        self.r
    }

    /// A doorbell: read the doorbell record, then every WQE it announces.
    fn doorbell(&mut self, uar: [u8; 8]) {
        self.dtoh(ST_DBREC, self.c.dbrec + 4, 4);
        self.sync();
        let rec = self.staged(ST_DBREC, 4);
        let pi16 = u32::from_be_bytes(rec.try_into().unwrap()) as u16;
        let rung = u16::from_be_bytes([uar[1], uar[2]]);
        // The record is written before the UAR: it must already cover the rung WQE.
        if pi16.wrapping_sub(rung.wrapping_add(1)) >= 0x8000 {
            self.violation(format!(
                "doorbell for WQE {rung} while the doorbell record says {pi16}"
            ));
        }
        let pending = u64::from(pi16.wrapping_sub(self.done as u16));
        if pending == 0 {
            return; // an older doorbell whose WQEs an earlier batch took
        }
        if pending > u64::from(self.c.sq_wqe_cnt) {
            self.violation(format!(
                "{pending} WQEs posted on a {}-WQEBB send queue (record {pi16}, done {})",
                self.c.sq_wqe_cnt, self.done
            ));
            return;
        }
        let sq_bytes = self.c.sq_wqe_cnt as usize * WQEBB;
        self.dtoh(ST_SQ, self.c.sq, sq_bytes);
        self.sync();
        // The UAR carries the first 8 bytes of the rung WQE's ctrl segment.
        let last = self.done + pending - 1;
        let back = u64::from((pi16.wrapping_sub(1)).wrapping_sub(rung));
        if back <= last && last - back >= self.done {
            let pi_r = last - back;
            let slot = (pi_r % u64::from(self.c.sq_wqe_cnt)) as usize;
            let ctrl = self.staged(ST_SQ + slot * WQEBB, 8);
            if ctrl != uar {
                self.violation(format!(
                    "UAR {uar:02x?} is not WQE {pi_r}'s ctrl segment {ctrl:02x?}"
                ));
            }
        }
        for k in 0..pending {
            self.execute(self.done + k, k as usize);
        }
        self.done += pending;
        self.sync();
    }

    fn local_ok(&self, key: u32, addr: u64, len: u64) -> bool {
        len == 0 || covers(&self.c.local, key, addr, len)
    }

    fn remote_ok(&self, key: u32, addr: u64, len: u64) -> bool {
        covers(&self.c.remote, key, addr, len)
    }

    /// Executes WQE `pi` (batch position `k`) and writes its CQE.
    fn execute(&mut self, pi: u64, k: usize) {
        let slot = (pi % u64::from(self.c.sq_wqe_cnt)) as usize;
        let at = ST_SQ + slot * WQEBB;
        let bytes: [u8; WQEBB] = self.staged(at, WQEBB).try_into().unwrap();
        self.r.wqes += 1;
        let (header, w) = match wqe::decode(&bytes) {
            Ok(x) => x,
            Err(e) => {
                self.violation(format!("WQE {pi}: {e}"));
                self.in_error = true;
                self.complete(pi, k, bytes[3], Err(Syndrome::LOCAL_QP_OPERATION));
                return;
            }
        };
        *self.r.by_opcode.entry(w.opcode()).or_default() += 1;
        if header.wqe_index != pi as u16 {
            self.violation(format!("WQE {pi} carries counter {}", header.wqe_index));
        }
        if header.qpn != self.c.qpn {
            self.violation(format!("WQE {pi} names QP {:#x}", header.qpn));
        }
        if header.fm_ce_se & CQ_UPDATE == 0 {
            // A ConnectX writes no CQE for it, and the device library would wait forever.
            self.violation(format!("WQE {pi} asks for no CQE"));
            return;
        }
        let result = if self.in_error {
            Err(Syndrome::WR_FLUSH)
        } else {
            self.perform(&w, at, k)
        };
        if result.is_err() {
            self.in_error = true;
        }
        self.complete(pi, k, w.opcode(), result);
    }

    /// Performs one operation on device memory; the byte count or the syndrome.
    fn perform(&mut self, w: &Wqe<'_>, at: usize, k: usize) -> Result<u32, Syndrome> {
        match *w {
            Wqe::Nop => Ok(0),
            Wqe::Write {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
            }
            | Wqe::WriteImm {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
                ..
            } => {
                if !self.local_ok(lkey, laddr, len.into()) {
                    return Err(Syndrome::LOCAL_PROTECTION);
                }
                if !self.remote_ok(rkey, raddr, len.into()) {
                    return Err(Syndrome::REMOTE_ACCESS);
                }
                if len > 0 {
                    self.dtod(raddr, laddr, len as usize);
                }
                Ok(len)
            }
            Wqe::WriteInline { raddr, rkey, data } => {
                if !self.remote_ok(rkey, raddr, data.len() as u64) {
                    return Err(Syndrome::REMOTE_ACCESS);
                }
                if !data.is_empty() {
                    // The payload follows the 4-byte inline header at byte 36 of the
                    // staged WQE (the staging is not rewritten before the batch's sync).
                    self.htod(raddr, at + 36, data.len());
                }
                Ok(data.len() as u32)
            }
            Wqe::Read {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
            } => {
                if !self.local_ok(lkey, laddr, len.into()) {
                    return Err(Syndrome::LOCAL_PROTECTION);
                }
                if !self.remote_ok(rkey, raddr, len.into()) {
                    return Err(Syndrome::REMOTE_ACCESS);
                }
                if len > 0 {
                    self.dtod(laddr, raddr, len as usize);
                }
                Ok(len)
            }
            Wqe::FetchAdd {
                raddr,
                rkey,
                laddr,
                lkey,
                add,
            } => self.atomic(raddr, rkey, laddr, lkey, k, |old| old.wrapping_add(add)),
            Wqe::CompareSwap {
                raddr,
                rkey,
                laddr,
                lkey,
                compare,
                swap,
            } => self.atomic(raddr, rkey, laddr, lkey, k, |old| {
                if old == compare {
                    swap
                } else {
                    old
                }
            }),
        }
    }

    /// A 64-bit atomic: read the remote word, store `op(old)`, return `old` to laddr.
    fn atomic(
        &mut self,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        k: usize,
        op: impl Fn(u64) -> u64,
    ) -> Result<u32, Syndrome> {
        if !self.local_ok(lkey, laddr, 8) {
            return Err(Syndrome::LOCAL_PROTECTION);
        }
        if !raddr.is_multiple_of(8) {
            return Err(Syndrome::REMOTE_INVALID_REQUEST);
        }
        if !self.remote_ok(rkey, raddr, 8) {
            return Err(Syndrome::REMOTE_ACCESS);
        }
        let off = self.st_atomic + 16 * k;
        // Earlier writes of this batch to the same word must land first.
        self.sync();
        self.dtoh(off, raddr, 8);
        self.sync();
        let old = u64::from_le_bytes(self.staged(off, 8).try_into().unwrap());
        // SAFETY: inside the staging buffer.
        unsafe { std::ptr::write(self.host(off + 8).cast::<[u8; 8]>(), op(old).to_le_bytes()) };
        self.htod(raddr, off + 8, 8);
        self.htod(laddr, off, 8);
        Ok(8)
    }

    /// Writes the CQE of WQE `pi`: body, then the owner byte (same stream, in order).
    fn complete(&mut self, pi: u64, k: usize, opcode: u8, result: Result<u32, Syndrome>) {
        let (ci, n) = (self.cq_pi, self.c.cq_cqe_cnt);
        let c = match result {
            Ok(bytes) => {
                self.r.good_cqes += 1;
                cqe::synthetic_cqe(ci, n, pi as u16, self.c.qpn, bytes)
            }
            Err(s) => {
                self.r.error_cqes.push((pi, s));
                cqe::synthetic_error_cqe(
                    ci,
                    n,
                    pi as u16,
                    self.c.qpn,
                    opcode,
                    s,
                    self.c.vendor_syndrome,
                )
            }
        };
        let off = self.st_cqe + k * CQE_SIZE;
        // SAFETY: inside the staging buffer.
        unsafe { std::ptr::write(self.host(off).cast::<[u8; CQE_SIZE]>(), c) };
        let dst = self.c.cq + (ci % u64::from(n)) * CQE_SIZE as u64;
        self.htod(dst, off, CQE_SIZE - 1);
        self.htod(dst + CQE_SIZE as u64 - 1, off + CQE_SIZE - 1, 1);
        self.cq_pi += 1;
    }
}

// ---- the queue under test -----------------------------------------------------------------

/// The GPU-resident queue, the "peer's" memory and the exported queue pair.
struct Emulated {
    gpu: Gpu,
    src: Arc<DeviceBuffer>,
    dst: Arc<DeviceBuffer>,
    sig: Arc<DeviceBuffer>,
    back: Arc<DeviceBuffer>,
    qp: ExportedMlx5QueuePair,
    nic: Option<Nic>,
}

const LKEY: u32 = 0x1001;
const RKEY_DST: u32 = 0x2002;
const RKEY_SIG: u32 = 0x3003;
const LKEY_SCRATCH: u32 = 0x4004;
const RKEY_UNKNOWN: u32 = 0xbad0;
const VENDOR_SYNDROME: u8 = 0x68;
const QPN: u32 = 0x00c0_ffee & 0x00ff_ffff;

impl Emulated {
    fn new(gpu: &Gpu, sq_wqe_cnt: u32, cq_cqe_cnt: u32, bytes: usize) -> Self {
        let sq = zeroed(gpu, sq_wqe_cnt as usize * WQEBB);
        let dbrec = zeroed(gpu, 64);
        let cq_dbrec = zeroed(gpu, 64);
        let cq = zeroed(gpu, cq_cqe_cnt as usize * CQE_SIZE);
        let mut empty = Vec::new();
        for _ in 0..cq_cqe_cnt {
            empty.extend_from_slice(&cqe::empty_cqe());
        }
        cq.copy_from_host(0, &empty).expect("CQ init");
        let uar = Arc::new(HostBuffer::alloc(gpu, 4096).expect("UAR page"));
        let scratch = zeroed(gpu, 64);
        let src = zeroed(gpu, bytes);
        let pattern: Vec<u8> = (0..bytes).map(|i| (i * 7 + 3) as u8).collect();
        src.copy_from_host(0, &pattern).expect("pattern");
        let dst = zeroed(gpu, 4 * bytes);
        let sig = zeroed(gpu, 64);
        let back = zeroed(gpu, bytes);
        let mut table = MemoryTable::new();
        let keep = |b: &Arc<DeviceBuffer>| Some(b.clone() as Arc<dyn std::any::Any + Send + Sync>);
        assert_eq!(
            table
                .push_local(src.ptr(), bytes as u64, LKEY, keep(&src))
                .unwrap(),
            0
        );
        assert_eq!(
            table
                .push_remote(dst.ptr(), 4 * bytes as u64, RKEY_DST)
                .unwrap(),
            1
        );
        assert_eq!(table.push_remote(sig.ptr(), 64, RKEY_SIG).unwrap(), 2);
        assert_eq!(
            table
                .push_local(back.ptr(), bytes as u64, LKEY, keep(&back))
                .unwrap(),
            3
        );
        // A region whose rkey the NIC does not know: puts to it fail remotely.
        assert_eq!(
            table
                .push_remote(dst.ptr(), bytes as u64, RKEY_UNKNOWN)
                .unwrap(),
            4
        );
        let layout = QueueLayout {
            sq: sq.ptr(),
            dbrec: dbrec.ptr(),
            db: uar.device_ptr().expect("UAR device pointer"),
            cq: cq.ptr(),
            cq_dbrec: cq_dbrec.ptr(),
            qpn: QPN,
            sq_wqe_cnt,
            cq_cqe_cnt,
            flags: 0,
            scratch: (scratch.ptr(), LKEY_SCRATCH),
        };
        let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::new((
            sq.clone(),
            dbrec.clone(),
            cq_dbrec,
            cq.clone(),
            uar.clone(),
            scratch.clone(),
        ));
        let qp = export(gpu, &layout, &table, 2, Duration::from_secs(30), owner).expect("export");
        let nic = Nic::new(NicConfig {
            gpu: gpu.clone(),
            uar_host: uar.as_ptr() as usize,
            sq: sq.ptr(),
            dbrec: dbrec.ptr(),
            cq: cq.ptr(),
            sq_wqe_cnt,
            cq_cqe_cnt,
            qpn: QPN,
            local: vec![
                Region {
                    key: LKEY,
                    addr: src.ptr(),
                    len: bytes as u64,
                },
                Region {
                    key: LKEY,
                    addr: back.ptr(),
                    len: bytes as u64,
                },
                Region {
                    key: LKEY_SCRATCH,
                    addr: scratch.ptr(),
                    len: 64,
                },
            ],
            remote: vec![
                Region {
                    key: RKEY_DST,
                    addr: dst.ptr(),
                    len: 4 * bytes as u64,
                },
                Region {
                    key: RKEY_SIG,
                    addr: sig.ptr(),
                    len: 64,
                },
            ],
            vendor_syndrome: VENDOR_SYNDROME,
        });
        Self {
            gpu: gpu.clone(),
            src,
            dst,
            sig,
            back,
            qp,
            nic: Some(nic),
        }
    }

    /// Runs `launch` (which launches on `stream` and returns) while the NIC thread
    /// serves the queue; waits for the kernel, stops the NIC, returns its report.
    fn run(&mut self, launch: impl FnOnce(&Arc<cudarc::driver::CudaStream>)) -> NicReport {
        let stream = self.gpu.new_stream().expect("kernel stream");
        let nic = self.nic.take().expect("one run per queue");
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || nic.run(&stop2, Duration::from_secs(120)));
        launch(&stream);
        let synced = stream.synchronize();
        stop.store(true, Ordering::Release);
        let report = thread.join().expect("NIC thread");
        synced.expect("kernel");
        eprintln!(
            "emulated NIC: {} doorbells, {} WQEs, {} good CQEs, errors {:?}, opcodes {:?}",
            report.doorbells, report.wqes, report.good_cqes, report.error_cqes, report.by_opcode
        );
        assert!(report.violations.is_empty(), "{:#?}", report.violations);
        report
    }
}

#[test]
fn gpu_mlx5_emulated_high_level_calls_move_data_signals_and_counters() {
    let Some(gpu) = gpu_for_test("gpu_mlx5_emulated_high_level_calls") else {
        return;
    };
    let m = module(&gpu);
    let f = function(&m, "emu_high_level");
    let len = 4096usize;
    let mut e = Emulated::new(&gpu, 8, 8, len);
    let st = zeroed(&gpu, 4 * 8);
    st.fill(0xff).unwrap();
    let tickets = zeroed(&gpu, 8 * 8);
    let (qp, len64, value, add) = (e.qp.device_ptr(), len as u64, 0xa1b2_c3d4u32, 5u64);
    let (s, t) = (st.ptr(), tickets.ptr());
    let report = e.run(|stream| {
        let mut l = stream.launch_builder(&f);
        l.arg(&qp).arg(&len64).arg(&value).arg(&add).arg(&s).arg(&t);
        // SAFETY: emu_high_level(gio_dev_qp *, u64, u32, u64, int *, u64 *) writes 8
        // statuses and tickets; every buffer outlives the synchronize in run().
        unsafe { l.launch(cfg(1, 1)) }.expect("launch");
    });
    assert_eq!(
        i32s(&st, 8),
        vec![ffi::GIO_OK; 8],
        "put, p, signal, put_counter, fence, get, put_signal, quiet"
    );
    // put, p (inline), signal (FA), put_counter, fence (NOP), get, put_signal (write+FA).
    assert_eq!(report.wqes, 8);
    assert_eq!(report.good_cqes, 8);
    assert_eq!(
        report.by_opcode.get(&0x08),
        Some(&4),
        "three writes and one inline"
    );
    assert_eq!(report.by_opcode.get(&0x12), Some(&2), "two fetch-adds");
    assert_eq!(report.by_opcode.get(&0x10), Some(&1), "one read");
    assert_eq!(report.by_opcode.get(&0x00), Some(&1), "one NOP");
    let src = e.src.to_vec().unwrap();
    let dst = e.dst.to_vec().unwrap();
    assert_eq!(&dst[..len], &src[..], "put");
    assert_eq!(&dst[len..len + 4], &value.to_le_bytes(), "p");
    assert_eq!(&dst[2 * len..3 * len], &src[..], "put_signal's data");
    assert_eq!(&dst[3 * len..4 * len], &src[..], "put_counter's data");
    assert_eq!(e.back.to_vec().unwrap(), src, "get");
    assert_eq!(u64s(&e.sig, 1)[0], 2 * add, "signal + put_signal");
    assert_eq!(e.qp.counter(0).unwrap(), 1, "put_counter's counter");
    let state = e.qp.device_state().unwrap();
    assert_eq!(
        (state.sq_rung, state.sq_completed, state.error),
        (8, 8, None)
    );
}

#[test]
fn gpu_mlx5_emulated_fences_wrap_the_queues_and_the_16_bit_counter() {
    let Some(gpu) = gpu_for_test("gpu_mlx5_emulated_fences_wrap") else {
        return;
    };
    let m = module(&gpu);
    let f = function(&m, "emu_fences");
    // 70,000 WQEs on an 8-WQEBB send queue and an 8-CQE CQ: 8,750 passes over both
    // rings (the CQE owner bit flips on each) and past 0xffff of the WQE counter.
    let n = 70_000u32;
    let mut e = Emulated::new(&gpu, 8, 8, 64);
    let st = zeroed(&gpu, 8);
    st.fill(0xff).unwrap();
    let (qp, s) = (e.qp.device_ptr(), st.ptr());
    let report = e.run(|stream| {
        let mut l = stream.launch_builder(&f);
        l.arg(&qp).arg(&n).arg(&s);
        // SAFETY: emu_fences(gio_dev_qp *, unsigned, int *) writes two statuses.
        unsafe { l.launch(cfg(1, 1)) }.expect("launch");
    });
    assert_eq!(i32s(&st, 2), vec![ffi::GIO_OK, ffi::GIO_OK]);
    assert_eq!(report.wqes, u64::from(n));
    assert_eq!(report.good_cqes, u64::from(n));
    let state = e.qp.device_state().unwrap();
    assert_eq!(state.sq_rung, u64::from(n));
    assert_eq!(state.sq_completed, u64::from(n));
    assert_eq!(state.error, None);
}

#[test]
fn gpu_mlx5_emulated_warps_share_one_queue() {
    let Some(gpu) = gpu_for_test("gpu_mlx5_emulated_warps_share_one_queue") else {
        return;
    };
    let m = module(&gpu);
    let f = function(&m, "emu_put_warps");
    // 64 warps (8 blocks of 256 threads) on a 16-WQEBB queue with a 32-CQE CQ.
    let (blocks, threads, chunk) = (8u32, 256u32, 1024usize);
    let warps = blocks * threads / 32;
    let mut e = Emulated::new(&gpu, 16, 32, warps as usize * chunk);
    let st = zeroed(&gpu, 8 * warps as usize);
    st.fill(0xff).unwrap();
    let (qp, c, s) = (e.qp.device_ptr(), chunk as u64, st.ptr());
    let report = e.run(|stream| {
        let mut l = stream.launch_builder(&f);
        l.arg(&qp).arg(&c).arg(&s).arg(&warps);
        // SAFETY: emu_put_warps(gio_dev_qp *, u64, int *, unsigned) writes 2 statuses
        // per warp; the grid has exactly `warps` warps.
        unsafe { l.launch(cfg(blocks, threads)) }.expect("launch");
    });
    let statuses = i32s(&st, 2 * warps as usize);
    assert!(statuses.iter().all(|&x| x == ffi::GIO_OK), "{statuses:?}");
    assert_eq!(report.wqes, u64::from(warps));
    let src = e.src.to_vec().unwrap();
    let dst = e.dst.to_vec().unwrap();
    assert_eq!(&dst[..src.len()], &src[..], "every warp's chunk");
    let state = e.qp.device_state().unwrap();
    assert_eq!(state.sq_rung, u64::from(warps));
    assert_eq!(state.sq_completed, u64::from(warps));
}

#[test]
fn gpu_mlx5_emulated_error_cqe_is_gio_err_cqe_with_the_syndrome() {
    let Some(gpu) = gpu_for_test("gpu_mlx5_emulated_error_cqe") else {
        return;
    };
    let m = module(&gpu);
    let f = function(&m, "emu_error");
    let len = 256usize;
    let mut e = Emulated::new(&gpu, 8, 8, len);
    let st = zeroed(&gpu, 4 * 5);
    st.fill(0xff).unwrap();
    let tickets = zeroed(&gpu, 8 * 5);
    let (qp, len64, s, t) = (e.qp.device_ptr(), len as u64, st.ptr(), tickets.ptr());
    let report = e.run(|stream| {
        let mut l = stream.launch_builder(&f);
        l.arg(&qp).arg(&len64).arg(&s).arg(&t);
        // SAFETY: emu_error(gio_dev_qp *, u64, int *, u64 *) writes 5 statuses and
        // tickets.
        unsafe { l.launch(cfg(1, 1)) }.expect("launch");
    });
    assert_eq!(
        i32s(&st, 5),
        vec![
            ffi::GIO_OK,      // the bad put is posted
            ffi::GIO_OK,      // and the good one behind it
            ffi::GIO_ERR_CQE, // waiting on the bad one sees its error CQE
            ffi::GIO_ERR_CQE, // nothing more is posted on a failed queue pair
            ffi::GIO_ERR_CQE, // quiet reports it
        ]
    );
    assert_eq!(
        report.error_cqes,
        vec![(0, Syndrome::REMOTE_ACCESS), (1, Syndrome::WR_FLUSH)],
        "the bad put fails, the one behind it is flushed"
    );
    assert_eq!(report.wqes, 2, "the third put never reached the NIC");
    assert!(
        e.dst.to_vec().unwrap().iter().all(|&b| b == 0),
        "a flushed put moves nothing"
    );
    let state = e.qp.device_state().unwrap();
    assert_eq!(
        state.error,
        Some((0, Syndrome::REMOTE_ACCESS, VENDOR_SYNDROME)),
        "the first error CQE's WQE and syndrome are recorded"
    );
    assert_eq!(
        state.error_word(),
        Some((u32::from(VENDOR_SYNDROME) << 8) | 0x13)
    );
    assert_eq!(state.sq_rung, 2);
}

#[test]
fn gpu_mlx5_emulated_auto_front_on_this_gpu() {
    let Some(gpu) = gpu_for_test("gpu_mlx5_emulated_auto_front_on_this_gpu") else {
        return;
    };
    use gpunetio::{GpuQueuePair, GpuQueuePairOptions, NicHandler};
    let qp = GpuQueuePair::create(&gpu, &GpuQueuePairOptions::default()).expect("create");
    let probe = gpunetio::mlx5::probe();
    eprintln!(
        "Auto on this GPU: {:?} ({:?})",
        qp.handler(),
        qp.fallback_reason()
    );
    match qp.handler() {
        NicHandler::CpuProxy => {
            let why = qp.fallback_reason().expect("Auto says why it fell back");
            assert!(
                why.contains("native mlx5 handler") || why.contains("creating the mlx5"),
                "{why}"
            );
            if let Err(e) = &probe {
                assert_eq!(why, e.to_string());
            }
            assert!(
                !std::env::var("GPUNETIO_REQUIRE_MLX5").is_ok_and(|v| v == "1"),
                "GPUNETIO_REQUIRE_MLX5=1 but {why}"
            );
            let endpoint = qp.local_endpoint().expect("endpoint");
            assert!(matches!(endpoint, gpunetio::EndpointInfo::CpuProxy(_)));
            let exported = qp.export().expect("export");
            assert_ne!(exported.device_ptr(), 0);
            assert_eq!(exported.handler(), NicHandler::CpuProxy);
            exported.unexport();
        }
        NicHandler::Mlx5 => {
            // A ConnectX with DEVX on this machine: a real GPU-initiated queue pair,
            // connected to itself (loopback), runs the high-level kernel.
            assert!(probe.is_ok());
            assert!(qp.fallback_reason().is_none());
            mlx5_loopback(&gpu, qp);
        }
        other => panic!("Auto resolved to {other:?}"),
    }
}

/// The high-level kernel on a real mlx5 queue pair: `a` (Auto's) puts into memory
/// registered on a second mlx5 queue pair `b` of this machine, connected to it
/// (loopback through the NIC).
fn mlx5_loopback(gpu: &Gpu, mut a: gpunetio::GpuQueuePair) {
    use gpunetio::{GpuQueuePair, GpuQueuePairOptions, NicHandler};
    let options = GpuQueuePairOptions {
        handler: NicHandler::Mlx5,
        ..GpuQueuePairOptions::default()
    };
    let mut b = GpuQueuePair::create(gpu, &options).expect("a second mlx5 queue pair");
    let (ea, eb) = (a.local_endpoint().unwrap(), b.local_endpoint().unwrap());
    a.connect(&eb).expect("connect a -> b");
    b.connect(&ea).expect("connect b -> a");
    let len = 4096usize;
    let src = zeroed(gpu, len);
    let pattern: Vec<u8> = (0..len).map(|i| (i * 13 + 1) as u8).collect();
    src.copy_from_host(0, &pattern).unwrap();
    let dst = zeroed(gpu, 4 * len);
    let sig = zeroed(gpu, 64);
    let back = zeroed(gpu, len);
    let d = b.register_local(&dst).unwrap();
    let g = b.register_local(&sig).unwrap();
    assert_eq!(a.register_local(&src).unwrap(), 0);
    assert_eq!(a.add_remote(&b.descriptor(d).unwrap()).unwrap(), 1);
    assert_eq!(a.add_remote(&b.descriptor(g).unwrap()).unwrap(), 2);
    assert_eq!(a.register_local(&back).unwrap(), 3);
    let exported = a.export().expect("export");
    let m = module(gpu);
    let f = function(&m, "emu_high_level");
    let st = zeroed(gpu, 4 * 8);
    st.fill(0xff).unwrap();
    let tickets = zeroed(gpu, 8 * 8);
    let (qp, len64, value, add) = (exported.device_ptr(), len as u64, 0x0102_0304u32, 3u64);
    let (s, t) = (st.ptr(), tickets.ptr());
    let stream = gpu.new_stream().unwrap();
    let mut l = stream.launch_builder(&f);
    l.arg(&qp).arg(&len64).arg(&value).arg(&add).arg(&s).arg(&t);
    // SAFETY: as in the emulated test: 8 statuses and tickets, buffers outlive the sync.
    unsafe { l.launch(cfg(1, 1)) }.expect("launch");
    stream.synchronize().expect("kernel");
    assert_eq!(i32s(&st, 8), vec![ffi::GIO_OK; 8]);
    let dst_bytes = dst.to_vec().unwrap();
    assert_eq!(&dst_bytes[..len], &pattern[..], "put through the NIC");
    assert_eq!(&dst_bytes[len..len + 4], &value.to_le_bytes(), "p");
    assert_eq!(&dst_bytes[2 * len..3 * len], &pattern[..], "put_signal");
    assert_eq!(back.to_vec().unwrap(), pattern, "get");
    assert_eq!(u64s(&sig, 1)[0], 2 * add, "signal + put_signal");
    assert_eq!(exported.counter(0).unwrap(), 1);
    exported.unexport();
    drop(b);
}

/// The kernels above compile with NVRTC for sm_80 and sm_90, with and without the
/// debug checks (no GPU needed; skipped without libnvrtc unless GPUNETIO_REQUIRE_NVRTC=1
/// or NIXL_REQUIRE_GPU=1).
#[test]
fn emulated_nic_kernels_compile_with_nvrtc() {
    if !gpunetio::device_code::nvrtc_available() {
        let required = std::env::var("GPUNETIO_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
            || gpunetio::gpu_required();
        assert!(
            !required,
            "NVRTC is required here but libnvrtc does not load"
        );
        eprintln!("skipped emulated_nic_kernels_compile_with_nvrtc: no libnvrtc");
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        for debug in [false, true] {
            let mut options = CompileOptions {
                arch: arch.into(),
                ..CompileOptions::default()
            };
            if debug {
                options = options.define("GIO_DEBUG");
            }
            if let Err(e) = compile("gio_mlx5_emulated.cu", KERNELS, &options) {
                panic!("{arch} (debug {debug}): {e}");
            }
        }
    }
}
