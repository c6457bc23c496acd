//! The native mlx5 handler's device code on a real GPU, without a NIC: WQEs built by
//! kernels into a device buffer standing in for the send queue are compared byte for
//! byte with the host encoder (`gpunetio::mlx5::wqe`) for every opcode, size, inline
//! length and across producer-index wraparound; the doorbell record and a fake UAR
//! (device memory) are checked after each doorbell, BlueFlame included; CQEs placed by
//! the host are parsed to statuses; the high-level calls (put, p, signal, get, fence,
//! put_signal, quiet) on a `GIO_NIC_HANDLER_MLX5` queue pair produce the expected WQEs;
//! and the mlx5 structs' layout is measured in a kernel. Skips with a printed reason
//! without a GPU; fails with NIXL_REQUIRE_GPU=1.

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use gpunetio::device_code::{compile, CompileOptions};
use gpunetio::ffi;
use gpunetio::ffi::mlx5 as abi;
use gpunetio::mlx5::cqe::{self, Syndrome};
use gpunetio::mlx5::wqe::{self, Wqe, CQ_UPDATE, FENCE, WQEBB};
use gpunetio::{gpu_for_test, DeviceBuffer, Gpu};
use std::sync::Arc;

fn module(gpu: &Gpu) -> Arc<CudaModule> {
    let (name, src) = gpunetio::DEVICE_SOURCES
        .iter()
        .find(|(n, _)| *n == "gio_mlx5_tests.cu")
        .expect("gio_mlx5_tests.cu is shipped");
    let options = CompileOptions::for_gpu(gpu).expect("compute capability");
    let ptx = compile(name, src, &options).expect("gio_mlx5_tests.cu compiles");
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

fn bytes_of<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: the callers pass repr(C) structs of integers and byte arrays (no padding
    // left uninitialised: every struct here is laid out without implicit padding).
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

fn slice_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: as bytes_of, for a slice.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn read(buf: &DeviceBuffer, offset: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    buf.copy_to_host(offset, &mut v).expect("read back");
    v
}

fn upload(gpu: &Gpu, bytes: &[u8]) -> DeviceBuffer {
    let b = DeviceBuffer::alloc(gpu, bytes.len().max(8)).expect("alloc");
    b.fill(0).expect("clear");
    b.copy_from_host(0, bytes).expect("upload");
    b
}

/// A fake mlx5 queue: send queue, doorbell record, UAR, CQ and CQ doorbell record in
/// device memory, and the gio_mlx5_qp naming them.
struct FakeQueue {
    sq: DeviceBuffer,
    dbrec: DeviceBuffer,
    uar: DeviceBuffer,
    cq: DeviceBuffer,
    cq_dbrec: DeviceBuffer,
    _keys: DeviceBuffer,
    m: DeviceBuffer,
    sq_wqe_cnt: u32,
    cq_cqe_cnt: u32,
    qpn: u32,
    stream: Arc<CudaStream>,
}

const KEYS: [abi::gio_mlx5_key; 3] = [
    abi::gio_mlx5_key {
        addr: 0x7f00_0000_1000,
        key: 0x1111,
        reserved: 0,
    },
    abi::gio_mlx5_key {
        addr: 0x5500_0000_2000,
        key: 0x2222,
        reserved: 0,
    },
    abi::gio_mlx5_key {
        addr: 0x5500_0000_3000,
        key: 0x3333,
        reserved: 0,
    },
];
const SCRATCH: (u64, u32) = (0x7f00_0000_9000, 0x4444);

impl FakeQueue {
    fn new(gpu: &Gpu, sq_wqe_cnt: u32, cq_cqe_cnt: u32, flags: u32) -> Self {
        let sq = upload(gpu, &vec![0u8; sq_wqe_cnt as usize * WQEBB]);
        let dbrec = upload(gpu, &[0u8; 8]);
        let uar = upload(gpu, &[0u8; 64]);
        let mut cq_bytes = Vec::new();
        for _ in 0..cq_cqe_cnt {
            cq_bytes.extend_from_slice(&cqe::empty_cqe());
        }
        let cq = upload(gpu, &cq_bytes);
        let cq_dbrec = upload(gpu, &[0u8; 8]);
        let keys = upload(gpu, slice_bytes(&KEYS));
        let qpn = 0x00ab_cdef;
        let state = abi::gio_mlx5_qp {
            sq_buf: sq.ptr(),
            dbrec: dbrec.ptr(),
            db: uar.ptr(),
            cq_buf: cq.ptr(),
            cq_dbrec: cq_dbrec.ptr(),
            keys: keys.ptr(),
            scratch_addr: SCRATCH.0,
            scratch_lkey: SCRATCH.1,
            qpn,
            sq_wqe_cnt,
            cq_cqe_cnt,
            flags,
            num_keys: KEYS.len() as u32,
            ..abi::gio_mlx5_qp::default()
        };
        let m = upload(gpu, bytes_of(&state));
        Self {
            sq,
            dbrec,
            uar,
            cq,
            cq_dbrec,
            _keys: keys,
            m,
            sq_wqe_cnt,
            cq_cqe_cnt,
            qpn,
            stream: gpu.new_stream().expect("stream"),
        }
    }

    fn wqe_at(&self, pi: u64) -> Vec<u8> {
        let slot = (pi & u64::from(self.sq_wqe_cnt - 1)) as usize;
        read(&self.sq, slot * WQEBB, WQEBB)
    }

    fn state(&self) -> abi::gio_mlx5_qp {
        let b = read(&self.m, 0, std::mem::size_of::<abi::gio_mlx5_qp>());
        // SAFETY: gio_mlx5_qp is a repr(C) struct of integers; any bytes are valid.
        unsafe { std::ptr::read_unaligned(b.as_ptr().cast()) }
    }

    fn place_cqe(&self, ci: u64, cqe: &[u8; 64]) {
        let slot = (ci & u64::from(self.cq_cqe_cnt - 1)) as usize;
        self.cq.copy_from_host(slot * 64, cqe).expect("place CQE");
    }
}

/// `gio_test_op` of gio_mlx5_tests.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TestOp {
    kind: u32,
    fm_ce_se: u32,
    pi: u64,
    raddr: u64,
    laddr: u64,
    rkey: u32,
    lkey: u32,
    len: u32,
    imm_be: u32,
    swap_add: u64,
    compare: u64,
    inline_data: [u8; 32],
}
const _: () = assert!(std::mem::size_of::<TestOp>() == 96);
const TEST_INLINE: u32 = 0x108;

fn test_op(w: &Wqe<'_>, pi: u64, fm_ce_se: u8) -> TestOp {
    let mut op = TestOp {
        kind: u32::from(w.opcode()),
        fm_ce_se: u32::from(fm_ce_se),
        pi,
        ..TestOp::default()
    };
    match *w {
        Wqe::Nop => {}
        Wqe::Write {
            raddr,
            rkey,
            laddr,
            lkey,
            len,
        }
        | Wqe::Read {
            raddr,
            rkey,
            laddr,
            lkey,
            len,
        } => (op.raddr, op.rkey, op.laddr, op.lkey, op.len) = (raddr, rkey, laddr, lkey, len),
        Wqe::WriteImm {
            raddr,
            rkey,
            laddr,
            lkey,
            len,
            imm,
        } => {
            (op.raddr, op.rkey, op.laddr, op.lkey, op.len) = (raddr, rkey, laddr, lkey, len);
            op.imm_be = imm.swap_bytes();
        }
        Wqe::WriteInline { raddr, rkey, data } => {
            op.kind = TEST_INLINE;
            (op.raddr, op.rkey, op.len) = (raddr, rkey, data.len() as u32);
            op.inline_data[..data.len()].copy_from_slice(data);
        }
        Wqe::FetchAdd {
            raddr,
            rkey,
            laddr,
            lkey,
            add,
        } => {
            (op.raddr, op.rkey, op.laddr, op.lkey) = (raddr, rkey, laddr, lkey);
            op.swap_add = add;
        }
        Wqe::CompareSwap {
            raddr,
            rkey,
            laddr,
            lkey,
            compare,
            swap,
        } => {
            (op.raddr, op.rkey, op.laddr, op.lkey) = (raddr, rkey, laddr, lkey);
            (op.swap_add, op.compare) = (swap, compare);
        }
    }
    op
}

#[test]
fn gpu_mlx5_layout_matches_the_rust_mirror() {
    let Some(gpu) = gpu_for_test("gpu_mlx5_layout_matches_the_rust_mirror") else {
        return;
    };
    let m = module(&gpu);
    let f = function(&m, "gio_mlx5_layout");
    let out = DeviceBuffer::alloc(&gpu, 8 * 64).expect("out");
    let count = DeviceBuffer::alloc(&gpu, 4).expect("count");
    let stream = gpu.new_stream().expect("stream");
    let (o, c) = (out.ptr(), count.ptr());
    let mut launch = stream.launch_builder(&f);
    launch.arg(&o).arg(&c);
    // SAFETY: gio_mlx5_layout(u64 *out, int *count) writes at most 64 words and an int
    // into buffers that outlive the synchronize below.
    unsafe { launch.launch(cfg(1, 1)) }.expect("launch");
    stream.synchronize().expect("sync");
    let n = i32::from_le_bytes(read(&count, 0, 4).try_into().unwrap()) as usize;
    assert_eq!(n, abi::MLX5_LAYOUT.len());
    for (i, (s, field, value)) in abi::MLX5_LAYOUT.iter().enumerate() {
        let got = u64::from_le_bytes(read(&out, 8 * i, 8).try_into().unwrap());
        assert_eq!(got as usize, *value, "{s}.{field} on the GPU");
    }
}

fn build_cases(data: &[u8; 32]) -> Vec<(Wqe<'_>, u8)> {
    let mut cases = vec![
        (Wqe::Nop, CQ_UPDATE),
        (Wqe::Nop, CQ_UPDATE | FENCE),
        (
            Wqe::Write {
                raddr: 0x1122_3344_5566_7788,
                rkey: 0xaabb_ccdd,
                laddr: 0x0102_0304_0506_0708,
                lkey: 0x1020_3040,
                len: 1,
            },
            CQ_UPDATE,
        ),
        (
            Wqe::Write {
                raddr: 0x1000,
                rkey: 1,
                laddr: 0x2000,
                lkey: 2,
                len: 0,
            },
            0,
        ),
        (
            Wqe::Write {
                raddr: 0x1000,
                rkey: 1,
                laddr: 0x2000,
                lkey: 2,
                len: 0x7fff_ffff,
            },
            CQ_UPDATE,
        ),
        (
            Wqe::WriteImm {
                raddr: 0x1000,
                rkey: 1,
                laddr: 0x2000,
                lkey: 2,
                len: 4096,
                imm: 0xdead_beef,
            },
            CQ_UPDATE,
        ),
        (
            Wqe::Read {
                raddr: 0x3000,
                rkey: 3,
                laddr: 0x4000,
                lkey: 4,
                len: 65536,
            },
            CQ_UPDATE,
        ),
        (
            Wqe::FetchAdd {
                raddr: 0x5000,
                rkey: 5,
                laddr: 0x6000,
                lkey: 6,
                add: 0x0123_4567_89ab_cdef,
            },
            CQ_UPDATE,
        ),
        (
            Wqe::CompareSwap {
                raddr: 0x5000,
                rkey: 5,
                laddr: 0x6000,
                lkey: 6,
                compare: 7,
                swap: u64::MAX,
            },
            CQ_UPDATE | FENCE,
        ),
    ];
    for len in [0usize, 1, 2, 4, 8, 11, 12, 13, 16, 27, 28] {
        cases.push((
            Wqe::WriteInline {
                raddr: 0x7000 + len as u64,
                rkey: 8,
                data: &data[..len],
            },
            CQ_UPDATE,
        ));
    }
    cases
}

fn launch_build(gpu: &Gpu, f: &CudaFunction, q: &FakeQueue, ops: &[TestOp]) {
    let ops_buf = upload(gpu, slice_bytes(ops));
    let (m, o, n) = (q.m.ptr(), ops_buf.ptr(), ops.len() as i32);
    let mut launch = q.stream.launch_builder(f);
    launch.arg(&m).arg(&o).arg(&n);
    // SAFETY: gio_mlx5_build(gio_mlx5_qp *, const gio_test_op *, int) writes only into
    // the fake queue's buffers, all alive until the synchronize.
    unsafe { launch.launch(cfg(1, 1)) }.expect("launch");
    q.stream.synchronize().expect("sync");
}

#[test]
fn gpu_built_wqes_match_the_host_encoder_with_doorbells_across_wraparound() {
    let Some(gpu) = gpu_for_test("gpu_built_wqes_match_the_host_encoder") else {
        return;
    };
    let module = module(&gpu);
    let f = function(&module, "gio_mlx5_build");
    let data: [u8; 32] = std::array::from_fn(|i| 0xa0 ^ i as u8);
    for blueflame in [false, true] {
        let flags = if blueflame {
            abi::GIO_MLX5_QP_BLUEFLAME
        } else {
            0
        };
        let q = FakeQueue::new(&gpu, 8, 8, flags);
        // Producer indices run from just below the 16-bit counter's wrap past it, so
        // both the ring slot (pi & 7) and the WQE counter (pi & 0xffff) wrap.
        let mut pi = 0xfff0u64;
        for (w, fm) in build_cases(&data) {
            launch_build(&gpu, &f, &q, &[test_op(&w, pi, fm)]);
            let want = wqe::encode(&w, pi as u16, q.qpn, fm).unwrap();
            assert_eq!(
                q.wqe_at(pi),
                want.to_vec(),
                "{w:?} at {pi:#x} (bf {blueflame})"
            );
            let dbrec = read(&q.dbrec, 0, 8);
            assert_eq!(&dbrec[..4], &[0; 4], "the receive counter is untouched");
            assert_eq!(&dbrec[4..], &(((pi + 1) & 0xffff) as u32).to_be_bytes());
            let uar = read(&q.uar, 0, 64);
            if blueflame {
                assert_eq!(uar, want.to_vec(), "BlueFlame copies the WQEBB");
            } else {
                assert_eq!(&uar[..8], &want[..8], "doorbell: first 8 bytes of ctrl");
            }
            pi += 1;
        }
        assert!(pi > 0x1_0000, "wrapped the 16-bit counter");
    }
}

#[test]
fn gpu_parses_host_placed_cqes_to_statuses() {
    let Some(gpu) = gpu_for_test("gpu_parses_host_placed_cqes_to_statuses") else {
        return;
    };
    let module = module(&gpu);
    let f = function(&module, "gio_mlx5_poll");
    let n = 4u32;
    let q = FakeQueue::new(&gpu, 4, n, 0);
    // WQEs 0..5 complete (two passes over the 4-entry CQ: the owner bit flips), 6 fails
    // with retry exceeded, 7 flushed; 8 was never written.
    let poll = |pis: &[u64]| -> Vec<i32> {
        let pis_buf = upload(&gpu, slice_bytes(pis));
        let out = DeviceBuffer::alloc(&gpu, 4 * pis.len()).expect("statuses");
        let (m, p, k, o) = (q.m.ptr(), pis_buf.ptr(), pis.len() as i32, out.ptr());
        let mut launch = q.stream.launch_builder(&f);
        launch.arg(&m).arg(&p).arg(&k).arg(&o);
        // SAFETY: gio_mlx5_poll(gio_mlx5_qp *, const u64 *, int, int *) reads the fake
        // CQ and writes `k` ints; all buffers outlive the synchronize.
        unsafe { launch.launch(cfg(1, 1)) }.expect("launch");
        q.stream.synchronize().expect("sync");
        read(&out, 0, 4 * pis.len())
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    assert_eq!(poll(&[0]), vec![1], "an empty CQ: pending");
    for ci in 0..4u64 {
        q.place_cqe(ci, &cqe::synthetic_cqe(ci, n, ci as u16, q.qpn, 0));
    }
    assert_eq!(poll(&[0, 1, 2, 3, 4]), vec![0, 0, 0, 0, 1]);
    assert_eq!(q.state().sq_completed, 4);
    assert_eq!(read(&q.cq_dbrec, 0, 4), 4u32.to_be_bytes().to_vec());
    // Stale first-pass CQEs must not complete WQE 4..7 (owner parity).
    assert_eq!(poll(&[4, 5]), vec![1, 1]);
    for ci in 4..6u64 {
        q.place_cqe(ci, &cqe::synthetic_cqe(ci, n, ci as u16, q.qpn, 0));
    }
    q.place_cqe(
        6,
        &cqe::synthetic_error_cqe(
            6,
            n,
            6,
            q.qpn,
            0x08,
            Syndrome::TRANSPORT_RETRY_EXCEEDED,
            0x81,
        ),
    );
    q.place_cqe(
        7,
        &cqe::synthetic_error_cqe(7, n, 7, q.qpn, 0x08, Syndrome::WR_FLUSH, 0),
    );
    let st = poll(&[5, 6, 7, 3]);
    assert_eq!(
        st,
        vec![ffi::GIO_OK, ffi::GIO_ERR_CQE, ffi::GIO_ERR_CQE, ffi::GIO_OK]
    );
    let s = q.state();
    assert_eq!(s.error, ffi::GIO_ERR_CQE);
    assert_eq!(
        s.syndrome, 0x8115,
        "the first error's vendor syndrome and syndrome"
    );
    assert_eq!(s.error_wqe, 6);
    assert_eq!(s.sq_completed, 8);
    assert_eq!(read(&q.cq_dbrec, 0, 4), 8u32.to_be_bytes().to_vec());
    // Host parsing of the same bytes agrees.
    let e = cqe::synthetic_error_cqe(
        6,
        n,
        6,
        q.qpn,
        0x08,
        Syndrome::TRANSPORT_RETRY_EXCEEDED,
        0x81,
    );
    match cqe::parse_cqe(&e, 6, n) {
        cqe::CqePoll::Err(err) => assert_eq!(err.status_word(), s.syndrome),
        other => panic!("{other:?}"),
    }
}

/// A gio_dev_qp of the MLX5 handler over `q`: memory table local 0, remote 1, remote
/// signal 2 (lengths only: no data moves without a NIC).
fn mlx5_dev_qp(
    gpu: &Gpu,
    q: &FakeQueue,
    timeout_ns: u64,
) -> (DeviceBuffer, DeviceBuffer, DeviceBuffer) {
    let len = 1u64 << 32;
    let mrs = [
        ffi::gio_dev_mr {
            length: len,
            index: 0,
            ..Default::default()
        },
        ffi::gio_dev_mr {
            length: len,
            flags: ffi::GIO_MR_REMOTE,
            index: 1,
            ..Default::default()
        },
        ffi::gio_dev_mr {
            length: 64,
            flags: ffi::GIO_MR_REMOTE,
            index: 2,
            ..Default::default()
        },
    ];
    let mrs_buf = upload(gpu, slice_bytes(&mrs));
    let state = upload(gpu, bytes_of(&ffi::gio_ring_dev_state::default()));
    let dev = ffi::gio_dev_qp {
        nic_handler: ffi::GIO_NIC_HANDLER_MLX5,
        num_mrs: mrs.len() as u32,
        state: state.ptr(),
        mrs: mrs_buf.ptr(),
        timeout_ns,
        mlx5: q.m.ptr(),
        ..ffi::gio_dev_qp::default()
    };
    (upload(gpu, bytes_of(&dev)), mrs_buf, state)
}

#[test]
fn high_level_calls_on_the_mlx5_handler_build_the_expected_wqes() {
    let Some(gpu) = gpu_for_test("high_level_calls_on_the_mlx5_handler") else {
        return;
    };
    let module = module(&gpu);
    let f = function(&module, "gio_mlx5_high_level");
    let q = FakeQueue::new(&gpu, 16, 16, 0);
    let (qp, _mrs, _state) = mlx5_dev_qp(&gpu, &q, 2_000_000_000);
    // The NIC's part, done ahead: good CQEs for the 7 WQEs the calls post, so quiet
    // returns.
    for ci in 0..7u64 {
        q.place_cqe(ci, &cqe::synthetic_cqe(ci, 16, ci as u16, q.qpn, 0));
    }
    let statuses = DeviceBuffer::alloc(&gpu, 4 * 8).expect("statuses");
    statuses.fill(0xff).expect("clear");
    let tickets = DeviceBuffer::alloc(&gpu, 8 * 8).expect("tickets");
    tickets.fill(0xff).expect("clear");
    let (len, value, add) = (4096u64, 0xcafe_f00du32, 3u64);
    let (qp_ptr, s, t) = (qp.ptr(), statuses.ptr(), tickets.ptr());
    let mut launch = q.stream.launch_builder(&f);
    launch
        .arg(&qp_ptr)
        .arg(&len)
        .arg(&value)
        .arg(&add)
        .arg(&s)
        .arg(&t);
    // SAFETY: gio_mlx5_high_level(gio_dev_qp *, u64, u32, u64, int *, u64 *) posts into
    // the fake queue and writes 8 statuses and tickets; all alive until the synchronize.
    unsafe { launch.launch(cfg(1, 1)) }.expect("launch");
    q.stream.synchronize().expect("sync");
    let st: Vec<i32> = read(&statuses, 0, 32)
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        st,
        vec![0, 0, 0, 0, 0, 0, ffi::GIO_ERR_BAD_ENTRY, 0],
        "put, p, signal, get, fence, put_signal, a 2 GiB put, quiet"
    );
    let tk: Vec<u64> = read(&tickets, 0, 64)
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(&tk[..4], &[0, 1, 2, 3]);
    assert_eq!(tk[5], 6, "put_signal's ticket is its atomic");
    let (l, r, sg) = (KEYS[0], KEYS[1], KEYS[2]);
    let value_bytes = value.to_le_bytes();
    let expected = [
        Wqe::Write {
            raddr: r.addr,
            rkey: r.key,
            laddr: l.addr,
            lkey: l.key,
            len: len as u32,
        },
        Wqe::WriteInline {
            raddr: r.addr + 8,
            rkey: r.key,
            data: &value_bytes,
        },
        Wqe::FetchAdd {
            raddr: sg.addr,
            rkey: sg.key,
            laddr: SCRATCH.0,
            lkey: SCRATCH.1,
            add,
        },
        Wqe::Read {
            raddr: r.addr,
            rkey: r.key,
            laddr: l.addr,
            lkey: l.key,
            len: len as u32,
        },
        Wqe::Nop,
        Wqe::Write {
            raddr: r.addr,
            rkey: r.key,
            laddr: l.addr,
            lkey: l.key,
            len: len as u32,
        },
        Wqe::FetchAdd {
            raddr: sg.addr,
            rkey: sg.key,
            laddr: SCRATCH.0,
            lkey: SCRATCH.1,
            add,
        },
    ];
    for (pi, w) in expected.iter().enumerate() {
        let fm = if pi == 4 {
            CQ_UPDATE | FENCE
        } else {
            CQ_UPDATE
        };
        let want = wqe::encode(w, pi as u16, q.qpn, fm).unwrap();
        assert_eq!(q.wqe_at(pi as u64), want.to_vec(), "WQE {pi}: {w:?}");
    }
    assert_eq!(&read(&q.dbrec, 4, 4), &7u32.to_be_bytes());
    let last = wqe::encode(&expected[6], 6, q.qpn, CQ_UPDATE).unwrap();
    assert_eq!(&read(&q.uar, 0, 8), &last[..8]);
    let s = q.state();
    assert_eq!((s.sq_rung, s.sq_completed, s.error), (7, 7, ffi::GIO_OK));
}

#[test]
fn warps_sharing_a_queue_post_in_order_and_wrap_the_send_queue() {
    let Some(gpu) = gpu_for_test("warps_sharing_a_queue_post_in_order") else {
        return;
    };
    let module = module(&gpu);
    let f = function(&module, "gio_mlx5_put_warps");
    // 12 warps on a 4-entry send queue: WQE i waits for the CQE of WQE i - 4, which the
    // host placed ahead for WQEs 0..7.
    let (warps, sq) = (12u32, 4u32);
    let q = FakeQueue::new(&gpu, sq, 16, 0);
    let (qp, _mrs, _state) = mlx5_dev_qp(&gpu, &q, 2_000_000_000);
    for ci in 0..8u64 {
        q.place_cqe(ci, &cqe::synthetic_cqe(ci, 16, ci as u16, q.qpn, 0));
    }
    let statuses = DeviceBuffer::alloc(&gpu, 4 * warps as usize).expect("statuses");
    statuses.fill(0xff).expect("clear");
    let tickets = DeviceBuffer::alloc(&gpu, 8 * warps as usize).expect("tickets");
    let (qp_ptr, len, s, t) = (qp.ptr(), 256u64, statuses.ptr(), tickets.ptr());
    let mut launch = q.stream.launch_builder(&f);
    launch.arg(&qp_ptr).arg(&len).arg(&s).arg(&t);
    // SAFETY: gio_mlx5_put_warps(gio_dev_qp *, u64, int *, u64 *) writes one status and
    // ticket per warp (12 warps: 3 blocks of 128 threads); buffers outlive the sync.
    unsafe { launch.launch(cfg(warps / 4, 128)) }.expect("launch");
    q.stream.synchronize().expect("sync");
    let st: Vec<i32> = read(&statuses, 0, 4 * warps as usize)
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(st.iter().all(|&x| x == ffi::GIO_OK), "{st:?}");
    let mut tk: Vec<u64> = read(&tickets, 0, 8 * warps as usize)
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    tk.sort_unstable();
    assert_eq!(
        tk,
        (0..u64::from(warps)).collect::<Vec<_>>(),
        "one WQE per warp"
    );
    // The last pass over the ring holds WQEs 8..11 with their own counters.
    for pi in 8..12u64 {
        let want = wqe::encode(
            &Wqe::Write {
                raddr: KEYS[1].addr,
                rkey: KEYS[1].key,
                laddr: KEYS[0].addr,
                lkey: KEYS[0].key,
                len: 256,
            },
            pi as u16,
            q.qpn,
            CQ_UPDATE,
        )
        .unwrap();
        assert_eq!(q.wqe_at(pi), want.to_vec(), "WQE {pi}");
    }
    assert_eq!(&read(&q.dbrec, 4, 4), &12u32.to_be_bytes());
    let s = q.state();
    assert_eq!(s.sq_rung, 12);
    assert!(s.sq_completed >= 8 - u64::from(sq), "{}", s.sq_completed);
}
