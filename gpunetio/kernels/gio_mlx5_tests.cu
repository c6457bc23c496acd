// Kernels of the mlx5 handler's tests (gpunetio/tests/gpu_mlx5.rs): WQEs built on the
// GPU into a device buffer standing in for the send queue, doorbells rung into a fake
// doorbell record and UAR in device memory, CQEs placed by the host parsed, and the
// mlx5 structs' layout measured. No NIC is involved.
#include "gpunetio/gio_device.cuh"

using gio::u64;

template <typename T, typename F> __device__ u64 field_offset(const T &object, const F &field) {
  return (u64)((const char *)&field - (const char *)&object);
}

// sizeof/offsetof in the order of gpunetio_sys::mlx5::MLX5_LAYOUT.
extern "C" __global__ void gio_mlx5_layout(u64 *out, int *count) {
  gio_mlx5_key gio_mlx5_key_;
  gio_mlx5_qp gio_mlx5_qp_;
#define GIO_FIELD(s, f) field_offset(s##_, s##_.f)
  const u64 v[] = {
      sizeof(gio_mlx5_key), GIO_FIELD(gio_mlx5_key, addr), GIO_FIELD(gio_mlx5_key, key),
      sizeof(gio_mlx5_qp), GIO_FIELD(gio_mlx5_qp, sq_buf), GIO_FIELD(gio_mlx5_qp, dbrec),
      GIO_FIELD(gio_mlx5_qp, db), GIO_FIELD(gio_mlx5_qp, cq_buf), GIO_FIELD(gio_mlx5_qp, cq_dbrec),
      GIO_FIELD(gio_mlx5_qp, keys), GIO_FIELD(gio_mlx5_qp, scratch_addr),
      GIO_FIELD(gio_mlx5_qp, scratch_lkey), GIO_FIELD(gio_mlx5_qp, qpn),
      GIO_FIELD(gio_mlx5_qp, sq_wqe_cnt), GIO_FIELD(gio_mlx5_qp, cq_cqe_cnt),
      GIO_FIELD(gio_mlx5_qp, flags), GIO_FIELD(gio_mlx5_qp, num_keys),
      GIO_FIELD(gio_mlx5_qp, sq_rung), GIO_FIELD(gio_mlx5_qp, sq_completed),
      GIO_FIELD(gio_mlx5_qp, error_wqe), GIO_FIELD(gio_mlx5_qp, error),
      GIO_FIELD(gio_mlx5_qp, syndrome),
  };
  const int n = sizeof(v) / sizeof(v[0]);
  for (int i = 0; i < n; i++) out[i] = v[i];
  *count = n;
}

// One WQE to build (mirrored by `TestOp` in gpu_mlx5.rs): `kind` is the mlx5 opcode, or
// GIO_TEST_INLINE for an inline RDMA WRITE of `len` bytes of `inline_data`.
#define GIO_TEST_INLINE 0x108u
struct gio_test_op {
  uint32_t kind;      //  0
  uint32_t fm_ce_se;  //  4
  u64 pi;             //  8
  u64 raddr;          // 16
  u64 laddr;          // 24
  uint32_t rkey;      // 32
  uint32_t lkey;      // 36
  uint32_t len;       // 40
  uint32_t imm_be;    // 44
  u64 swap_add;       // 48
  u64 compare;        // 56
  unsigned char inline_data[32]; // 64
};
static_assert(sizeof(gio_test_op) == 96, "gio_test_op");

__device__ void build_one(const gio_mlx5_qp *m, const gio_test_op &op) {
  gio::mlx5::wqe w;
  const uint16_t idx = (uint16_t)op.pi;
  switch (op.kind) {
  case GIO_MLX5_OPCODE_NOP:
    gio::mlx5::prepare_nop(&w, idx, m->qpn, op.fm_ce_se);
    break;
  case GIO_MLX5_OPCODE_RDMA_WRITE:
  case GIO_MLX5_OPCODE_RDMA_WRITE_IMM:
  case GIO_MLX5_OPCODE_RDMA_READ:
    gio::mlx5::prepare_rdma(&w, op.kind, idx, m->qpn, op.fm_ce_se, op.raddr, op.rkey, op.laddr,
                            op.lkey, op.len, op.imm_be);
    break;
  case GIO_MLX5_OPCODE_ATOMIC_FA:
  case GIO_MLX5_OPCODE_ATOMIC_CS:
    gio::mlx5::prepare_atomic(&w, op.kind, idx, m->qpn, op.fm_ce_se, op.raddr, op.rkey, op.laddr,
                              op.lkey, op.swap_add, op.compare);
    break;
  default:
    gio::mlx5::prepare_write_inline(&w, idx, m->qpn, op.fm_ce_se, op.raddr, op.rkey,
                                    op.inline_data, op.len);
    break;
  }
  gio::mlx5::store_wqe(m, op.pi, w);
}

// Builds `n` WQEs (low-level API) and rings the doorbell after each: the doorbell record
// and the fake UAR end up naming the last one.
extern "C" __global__ void gio_mlx5_build(gio_mlx5_qp *m, const gio_test_op *ops, int n) {
  for (int i = 0; i < n; i++) {
    build_one(m, ops[i]);
    gio::mlx5::ring_db(m, ops[i].pi + 1);
  }
}

// Polls producer indices `pis` once each in order: statuses[i] = poll_wqe's result
// (GIO_OK, 1 pending, GIO_ERR_*).
extern "C" __global__ void gio_mlx5_poll(gio_mlx5_qp *m, const u64 *pis, int n, int *statuses) {
  for (int i = 0; i < n; i++) statuses[i] = gio::mlx5::poll_wqe(m, pis[i]);
}

// The high-level calls on a GIO_NIC_HANDLER_MLX5 queue pair (exclusive use, one thread):
// put (mr 0 -> 1), p<uint32_t>, signal (mr 2), get (1 -> 0), fence, put_signal; then
// quiet. statuses[0..6] are the calls' results, statuses[7] quiet's; tickets[i] theirs.
extern "C" __global__ void gio_mlx5_high_level(gio_dev_qp *qp, u64 len, uint32_t value, u64 add,
                                               int *statuses, u64 *tickets) {
  using gio::scope;
  using gio::sharing;
  statuses[0] = gio::put<scope::thread, sharing::exclusive>(qp, 1, 0, 0, 0, len, &tickets[0]);
  statuses[1] = gio::p<uint32_t, scope::thread, sharing::exclusive>(qp, 1, 8, value, &tickets[1]);
  statuses[2] = gio::signal<scope::thread, sharing::exclusive>(qp, 2, 0, add, &tickets[2]);
  statuses[3] = gio::get<scope::thread, sharing::exclusive>(qp, 0, 0, 1, 0, len, &tickets[3]);
  statuses[4] = gio::fence<scope::thread, sharing::exclusive>(qp);
  statuses[5] = gio::put_signal<scope::thread, sharing::exclusive>(qp, 1, 0, 0, 0, len, 2, 0, add,
                                                                   &tickets[5]);
  statuses[6] = gio::put<scope::thread, sharing::gpu>(qp, 1, 0, 0, 0, 1ull << 31, &tickets[6]);
  statuses[7] = gio::quiet(qp);
}

// WARP scope and GPU-wide sharing: every warp of the grid puts once (one WQE per warp),
// then lane 0 of warp 0 quiets. statuses[warp] = put's result, tickets[warp] its WQE.
extern "C" __global__ void gio_mlx5_put_warps(gio_dev_qp *qp, u64 len, int *statuses,
                                              u64 *tickets) {
  const unsigned warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  u64 t = 0;
  const int st = gio::put<gio::scope::warp, gio::sharing::gpu>(qp, 1, 0, 0, 0, len, &t);
  if (gio::lane_id() == 0) {
    statuses[warp] = st;
    tickets[warp] = t;
  }
}
