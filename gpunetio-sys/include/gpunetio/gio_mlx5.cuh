/*
 * gpunetio native mlx5 handler (GIO_NIC_HANDLER_MLX5): device code builds ConnectX send
 * WQEs in a GPU-resident send queue, rings the doorbell itself and polls CQEs, as DOCA
 * GPUNetIO's GPU_SM_DB / GPU_SM_BF modes do (doca_gpunetio_dev_verbs_qp.cuh, _cq.cuh).
 *
 * The first part (the ABI: structs, constants) is plain C so host C (abi_check.c) checks
 * its static asserts; the device code below it compiles only as CUDA. The Rust mirror is
 * gpunetio_sys::mlx5; the host encoder gpunetio::mlx5 produces the same bytes, and the
 * GPU test gpu_mlx5.rs compares them.
 *
 * Wire format (rdma-core infiniband/mlx5dv.h, PRM "Send WQE"): a WQE is a sequence of
 * 16-byte segments in 64-byte basic blocks (WQEBB), all fields big-endian:
 *   ctrl  (16): opmod_idx_opcode = opmod<<24 | wqe_index<<8 | opcode,
 *               qpn_ds = qpn<<8 | size in 16-byte units, signature, 2 reserved bytes,
 *               fm_ce_se (fence mode, CQ update, solicited), imm
 *   raddr (16): remote address, rkey, reserved
 *   data  (16): byte_count, lkey, address (byte_count 0 means 2 GiB: never used)
 *   inline    : byte_count | MLX5_INLINE_SEG, payload, padded to 16 bytes
 *   atomic(16): swap_add, compare
 * Every WQE here fits one WQEBB (inline payload <= GIO_MLX5_MAX_INLINE).
 */
#ifndef GPUNETIO_GIO_MLX5_CUH
#define GPUNETIO_GIO_MLX5_CUH

#include "gio_abi.h"

/* ---- mlx5 constants (values of rdma-core's mlx5dv.h; cross-checked in Rust) ---------- */
#define GIO_MLX5_OPCODE_NOP 0x00u
#define GIO_MLX5_OPCODE_RDMA_WRITE 0x08u
#define GIO_MLX5_OPCODE_RDMA_WRITE_IMM 0x09u
#define GIO_MLX5_OPCODE_RDMA_READ 0x10u
#define GIO_MLX5_OPCODE_ATOMIC_CS 0x11u
#define GIO_MLX5_OPCODE_ATOMIC_FA 0x12u

/* fm_ce_se */
#define GIO_MLX5_CTRL_SOLICITED 0x02u
#define GIO_MLX5_CTRL_CQ_UPDATE 0x08u
#define GIO_MLX5_CTRL_FENCE 0x80u

#define GIO_MLX5_INLINE_SEG 0x80000000u
#define GIO_MLX5_WQEBB 64u
/* ctrl + raddr + 4-byte inline header leave 28 payload bytes in one WQEBB. */
#define GIO_MLX5_MAX_INLINE 28u

/* CQE opcodes (op_own >> 4) and the owner bit (op_own & 1). */
#define GIO_MLX5_CQE_REQ 0x0u
#define GIO_MLX5_CQE_RESP_WR_IMM 0x1u
#define GIO_MLX5_CQE_RESP_SEND 0x2u
#define GIO_MLX5_CQE_RESP_SEND_IMM 0x3u
#define GIO_MLX5_CQE_RESP_SEND_INV 0x4u
#define GIO_MLX5_CQE_REQ_ERR 0xdu
#define GIO_MLX5_CQE_RESP_ERR 0xeu
#define GIO_MLX5_CQE_INVALID 0xfu
#define GIO_MLX5_CQE_OWNER_MASK 0x1u
#define GIO_MLX5_CQE_SIZE 64u

/* Error CQE syndromes (mlx5_err_cqe.syndrome). */
#define GIO_MLX5_SYNDROME_LOCAL_LENGTH_ERR 0x01u
#define GIO_MLX5_SYNDROME_LOCAL_QP_OP_ERR 0x02u
#define GIO_MLX5_SYNDROME_LOCAL_PROT_ERR 0x04u
#define GIO_MLX5_SYNDROME_WR_FLUSH_ERR 0x05u
#define GIO_MLX5_SYNDROME_MW_BIND_ERR 0x06u
#define GIO_MLX5_SYNDROME_BAD_RESP_ERR 0x10u
#define GIO_MLX5_SYNDROME_LOCAL_ACCESS_ERR 0x11u
#define GIO_MLX5_SYNDROME_REMOTE_INVAL_REQ_ERR 0x12u
#define GIO_MLX5_SYNDROME_REMOTE_ACCESS_ERR 0x13u
#define GIO_MLX5_SYNDROME_REMOTE_OP_ERR 0x14u
#define GIO_MLX5_SYNDROME_TRANSPORT_RETRY_EXC_ERR 0x15u
#define GIO_MLX5_SYNDROME_RNR_RETRY_EXC_ERR 0x16u
#define GIO_MLX5_SYNDROME_REMOTE_ABORTED_ERR 0x22u

/* CQE byte offsets (mlx5_cqe64 / mlx5_err_cqe). */
#define GIO_MLX5_CQE_OFF_VENDOR_SYNDROME 54u
#define GIO_MLX5_CQE_OFF_SYNDROME 55u
#define GIO_MLX5_CQE_OFF_BYTE_CNT 44u
#define GIO_MLX5_CQE_OFF_SOP_DROP_QPN 56u
#define GIO_MLX5_CQE_OFF_WQE_COUNTER 60u
#define GIO_MLX5_CQE_OFF_OP_OWN 63u

/* The send doorbell record is the second 32-bit word of the QP's doorbell record. */
#define GIO_MLX5_SND_DBR 1u

/* ---- gio_mlx5_qp.flags ------------------------------------------------------------------ */
/* Ring with a BlueFlame write of the whole WQE to the register instead of its first
 * 8 bytes (DOCA GPU_SM_BF). */
#define GIO_MLX5_QP_BLUEFLAME 0x1u

/* The wire address and key of one memory table entry (gio_dev_qp.mrs, same index):
 * lkey for local regions, the peer's rkey for remote ones. */
struct gio_mlx5_key {
  gio_u64 addr;     /*  0: address as the NIC sees it (local or the peer's) */
  uint32_t key;      /*  8: lkey (local) or rkey (remote) */
  uint32_t reserved; /* 12 */
};
GIO_STATIC_ASSERT(sizeof(struct gio_mlx5_key) == 16, "gio_mlx5_key");
GIO_ASSERT_OFFSET(gio_mlx5_key, key, 8);

/* The mlx5 handler's state, in device memory, named by gio_dev_qp.mlx5. The first cache
 * line is written by the host at export; the rest by device code only. Requirements on
 * the host: sq_wqe_cnt and cq_cqe_cnt powers of two with cq_cqe_cnt >= sq_wqe_cnt (every
 * WQE asks for a CQE, so the CQ never overflows), every CQE's op_own initialised to
 * GIO_MLX5_CQE_INVALID << 4, the CQ created with overrun ignore (concurrent waiters may
 * store the CQ doorbell record out of order). */
struct gio_mlx5_qp {
  uint8_t *sq_buf;           /*   0: send queue, sq_wqe_cnt WQEBBs (GPU memory) */
  uint32_t *dbrec;           /*   8: QP doorbell record ([1]: send counter, BE) */
  gio_u64 *db;              /*  16: UAR doorbell / BlueFlame register, GPU-mapped MMIO */
  uint8_t *cq_buf;           /*  24: cq_cqe_cnt 64-byte CQEs (GPU memory) */
  uint32_t *cq_dbrec;        /*  32: CQ doorbell record ([0]: consumer index, BE) */
  struct gio_mlx5_key *keys; /*  40: num_keys entries, parallel to gio_dev_qp.mrs */
  gio_u64 scratch_addr;     /*  48: 8 local bytes the fetched value of atomics lands in */
  uint32_t scratch_lkey;     /*  56 */
  uint32_t qpn;              /*  60 */
  uint32_t sq_wqe_cnt;       /*  64: WQEBBs, a power of two */
  uint32_t cq_cqe_cnt;       /*  68: CQEs, a power of two >= sq_wqe_cnt */
  uint32_t flags;            /*  72: GIO_MLX5_QP_* */
  uint32_t num_keys;         /*  76 */
  uint8_t pad0[48];          /*  80 */
  /* device-written: producer index = gio_dev_qp.state->reserved (WQEs reserved) */
  gio_u64 sq_rung;          /* 128: WQEs handed to the NIC (doorbells rung in order) */
  gio_u64 sq_completed;     /* 136: WQEs whose completion was seen (in order) */
  gio_u64 error_wqe;        /* 144: WQE index of the first error CQE */
  int32_t error;             /* 152: GIO_OK, or GIO_ERR_CQE after an error CQE */
  uint32_t syndrome;         /* 156: of the first error CQE: vendor_syndrome << 8 | syndrome */
  uint8_t pad1[32];          /* 160 */
};
GIO_STATIC_ASSERT(sizeof(struct gio_mlx5_qp) == 192, "gio_mlx5_qp");
GIO_ASSERT_OFFSET(gio_mlx5_qp, dbrec, 8);
GIO_ASSERT_OFFSET(gio_mlx5_qp, db, 16);
GIO_ASSERT_OFFSET(gio_mlx5_qp, cq_buf, 24);
GIO_ASSERT_OFFSET(gio_mlx5_qp, cq_dbrec, 32);
GIO_ASSERT_OFFSET(gio_mlx5_qp, keys, 40);
GIO_ASSERT_OFFSET(gio_mlx5_qp, scratch_addr, 48);
GIO_ASSERT_OFFSET(gio_mlx5_qp, scratch_lkey, 56);
GIO_ASSERT_OFFSET(gio_mlx5_qp, qpn, 60);
GIO_ASSERT_OFFSET(gio_mlx5_qp, sq_wqe_cnt, 64);
GIO_ASSERT_OFFSET(gio_mlx5_qp, cq_cqe_cnt, 68);
GIO_ASSERT_OFFSET(gio_mlx5_qp, flags, 72);
GIO_ASSERT_OFFSET(gio_mlx5_qp, num_keys, 76);
GIO_ASSERT_OFFSET(gio_mlx5_qp, sq_rung, 128);
GIO_ASSERT_OFFSET(gio_mlx5_qp, sq_completed, 136);
GIO_ASSERT_OFFSET(gio_mlx5_qp, error_wqe, 144);
GIO_ASSERT_OFFSET(gio_mlx5_qp, error, 152);
GIO_ASSERT_OFFSET(gio_mlx5_qp, syndrome, 156);

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

namespace gio {
namespace mlx5 {

typedef unsigned long long u64;

__device__ __forceinline__ uint32_t be32(uint32_t v) { return __byte_perm(v, 0, 0x0123); }
__device__ __forceinline__ uint16_t be16(uint16_t v) { return (uint16_t)((v >> 8) | (v << 8)); }
__device__ __forceinline__ u64 be64(u64 v) {
  return ((u64)be32((uint32_t)v) << 32) | be32((uint32_t)(v >> 32));
}

/* A WQE under construction: 64 bytes as four 16-byte segments. Built in registers and
 * stored with 16-byte stores, so the NIC never sees a torn segment from this thread. */
struct wqe {
  uint4 seg[4];
};

__device__ __forceinline__ uint4 ctrl_seg(uint32_t opcode, uint16_t wqe_index, uint32_t qpn,
                                          uint32_t ds, uint32_t fm_ce_se, uint32_t imm_be) {
  uint4 s;
  s.x = be32(((uint32_t)wqe_index << 8) | (opcode & 0xff));
  s.y = be32((qpn << 8) | (ds & 0x3f));
  /* signature 0, dci_stream_channel_id 0, fm_ce_se in byte 11 (little-endian word). */
  s.z = (fm_ce_se & 0xff) << 24;
  s.w = imm_be;
  return s;
}

__device__ __forceinline__ uint4 raddr_seg(u64 raddr, uint32_t rkey) {
  const u64 a = be64(raddr);
  uint4 s;
  s.x = (uint32_t)a;
  s.y = (uint32_t)(a >> 32);
  s.z = be32(rkey);
  s.w = 0;
  return s;
}

__device__ __forceinline__ uint4 data_seg(uint32_t byte_count, uint32_t lkey, u64 addr) {
  const u64 a = be64(addr);
  uint4 s;
  s.x = be32(byte_count);
  s.y = be32(lkey);
  s.z = (uint32_t)a;
  s.w = (uint32_t)(a >> 32);
  return s;
}

__device__ __forceinline__ uint4 atomic_seg(u64 swap_add, u64 compare) {
  const u64 a = be64(swap_add), c = be64(compare);
  uint4 s;
  s.x = (uint32_t)a;
  s.y = (uint32_t)(a >> 32);
  s.z = (uint32_t)c;
  s.w = (uint32_t)(c >> 32);
  return s;
}

__device__ __forceinline__ uint4 zero_seg() { return make_uint4(0, 0, 0, 0); }

/* ---- WQE preparation (doca_gpu_dev_verbs_wqe_prepare_*) ------------------------------ */
/* Each returns the WQE's size in 16-byte units (the ds of its ctrl segment). Unused
 * segments are zeroed so a WQEBB's bytes are fully determined. */

__device__ __forceinline__ uint32_t prepare_nop(wqe *w, uint16_t idx, uint32_t qpn,
                                                uint32_t fm_ce_se) {
  w->seg[0] = ctrl_seg(GIO_MLX5_OPCODE_NOP, idx, qpn, 1, fm_ce_se, 0);
  w->seg[1] = w->seg[2] = w->seg[3] = zero_seg();
  return 1;
}

/* RDMA WRITE (or WRITE with immediate, `imm_be` already big-endian) / RDMA READ of
 * `len` bytes; len 0 carries no data segment (a byte_count of 0 would mean 2 GiB). */
__device__ __forceinline__ uint32_t prepare_rdma(wqe *w, uint32_t opcode, uint16_t idx,
                                                 uint32_t qpn, uint32_t fm_ce_se, u64 raddr,
                                                 uint32_t rkey, u64 laddr, uint32_t lkey,
                                                 uint32_t len, uint32_t imm_be) {
  const uint32_t ds = len ? 3 : 2;
  w->seg[0] = ctrl_seg(opcode, idx, qpn, ds, fm_ce_se, imm_be);
  w->seg[1] = raddr_seg(raddr, rkey);
  w->seg[2] = len ? data_seg(len, lkey, laddr) : zero_seg();
  w->seg[3] = zero_seg();
  return ds;
}

/* RDMA WRITE of `len` (<= GIO_MLX5_MAX_INLINE) bytes carried in the WQE. */
__device__ __forceinline__ uint32_t prepare_write_inline(wqe *w, uint16_t idx, uint32_t qpn,
                                                         uint32_t fm_ce_se, u64 raddr,
                                                         uint32_t rkey, const void *data,
                                                         uint32_t len) {
  const uint32_t ds = 2 + (4 + len + 15) / 16;
  w->seg[0] = ctrl_seg(GIO_MLX5_OPCODE_RDMA_WRITE, idx, qpn, ds, fm_ce_se, 0);
  w->seg[1] = raddr_seg(raddr, rkey);
  /* Header word then payload, zero padded: assembled as 32 bytes. */
  uint32_t words[8];
  unsigned char *b = (unsigned char *)words;
  words[0] = be32(len | GIO_MLX5_INLINE_SEG);
  for (int i = 1; i < 8; i++) words[i] = 0;
  const unsigned char *src = (const unsigned char *)data;
  for (uint32_t i = 0; i < len; i++) b[4 + i] = src[i];
  w->seg[2] = make_uint4(words[0], words[1], words[2], words[3]);
  w->seg[3] = make_uint4(words[4], words[5], words[6], words[7]);
  return ds;
}

/* Atomic fetch-and-add (ATOMIC_FA: `compare` unused, 0) or compare-and-swap (ATOMIC_CS:
 * swap `swap_add` if the 8 remote bytes equal `compare`); the old value lands at laddr. */
__device__ __forceinline__ uint32_t prepare_atomic(wqe *w, uint32_t opcode, uint16_t idx,
                                                   uint32_t qpn, uint32_t fm_ce_se, u64 raddr,
                                                   uint32_t rkey, u64 laddr, uint32_t lkey,
                                                   u64 swap_add, u64 compare) {
  w->seg[0] = ctrl_seg(opcode, idx, qpn, 4, fm_ce_se, 0);
  w->seg[1] = raddr_seg(raddr, rkey);
  w->seg[2] = atomic_seg(swap_add, opcode == GIO_MLX5_OPCODE_ATOMIC_CS ? compare : 0);
  w->seg[3] = data_seg(8, lkey, laddr);
  return 4;
}

/* ---- send queue ------------------------------------------------------------------------- */

/* The WQEBB of producer index `pi` (wraps at sq_wqe_cnt; the 16-bit WQE counter of the
 * ctrl segment wraps at 0x10000 independently). */
__device__ __forceinline__ uint4 *wqe_ptr(const gio_mlx5_qp *m, u64 pi) {
  return (uint4 *)(m->sq_buf + (pi & (u64)(m->sq_wqe_cnt - 1)) * GIO_MLX5_WQEBB);
}

__device__ __forceinline__ void store_wqe(const gio_mlx5_qp *m, u64 pi, const wqe &w) {
  uint4 *d = wqe_ptr(m, pi);
  for (int i = 0; i < 4; i++) d[i] = w.seg[i];
}

/* A 64-bit store to the NIC's register: MMIO, never merged or reordered with other
 * MMIO stores of this thread. */
__device__ __forceinline__ void mmio_store(gio_u64 *reg, u64 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("st.mmio.relaxed.sys.global.b64 [%0], %1;" ::"l"(reg), "l"(v) : "memory");
#else
  *(volatile u64 *)reg = v;
#endif
}

/* Hands WQEs up to producer index `pi_end` (exclusive; the last one at pi_end - 1) to
 * the NIC (doca_gpu_dev_verbs_ring_db / ring_bf): the WQEs are visible system-wide before
 * the doorbell record says so, and the record before the UAR store. */
__device__ __forceinline__ void ring_db(const gio_mlx5_qp *m, u64 pi_end) {
  __threadfence_system();
  *(volatile uint32_t *)&m->dbrec[GIO_MLX5_SND_DBR] = be32((uint32_t)(pi_end & 0xffff));
  __threadfence_system();
  const u64 *last = (const u64 *)wqe_ptr(m, pi_end - 1);
  if (m->flags & GIO_MLX5_QP_BLUEFLAME) {
    /* BlueFlame: the whole WQEBB goes to the register; the NIC need not fetch it. */
    for (int i = 0; i < 8; i++) mmio_store(m->db + i, ((volatile const u64 *)last)[i]);
  } else {
    /* The first 8 bytes of the ctrl segment: opcode/index and qpn/ds. */
    mmio_store(m->db, *(volatile const u64 *)last);
  }
  __threadfence_system();
}

/* ---- completion queue (doca_gpu_dev_verbs_poll_cq_at) --------------------------------- */

/* What one CQE slot says about consumer index `ci`. */
struct cqe_view {
  int ready;         /* 0: the NIC has not written it for this pass */
  uint32_t opcode;   /* op_own >> 4 */
  uint16_t wqe_counter;
  uint8_t syndrome;
  uint8_t vendor_syndrome;
};

__device__ __forceinline__ const volatile unsigned char *cqe_ptr(const gio_mlx5_qp *m, u64 ci) {
  return (const volatile unsigned char *)(m->cq_buf +
                                          (ci & (u64)(m->cq_cqe_cnt - 1)) * GIO_MLX5_CQE_SIZE);
}

/* Reads the CQE of consumer index `ci`: it is ready when its opcode is not INVALID and
 * its owner bit equals the pass parity (ci & cq_cqe_cnt), as rdma-core's get_sw_cqe. */
__device__ __forceinline__ cqe_view read_cqe(const gio_mlx5_qp *m, u64 ci) {
  const volatile unsigned char *c = cqe_ptr(m, ci);
  cqe_view v;
  const uint8_t op_own = c[GIO_MLX5_CQE_OFF_OP_OWN];
  v.opcode = op_own >> 4;
  const uint32_t parity = (ci & (u64)m->cq_cqe_cnt) ? 1u : 0u;
  v.ready = v.opcode != GIO_MLX5_CQE_INVALID && (op_own & GIO_MLX5_CQE_OWNER_MASK) == parity;
  v.wqe_counter = v.syndrome = v.vendor_syndrome = 0;
  if (v.ready) {
    /* The rest of the CQE only after its ownership was seen. */
    __threadfence();
    v.wqe_counter = (uint16_t)((c[GIO_MLX5_CQE_OFF_WQE_COUNTER] << 8) |
                               c[GIO_MLX5_CQE_OFF_WQE_COUNTER + 1]);
    v.syndrome = c[GIO_MLX5_CQE_OFF_SYNDROME];
    v.vendor_syndrome = c[GIO_MLX5_CQE_OFF_VENDOR_SYNDROME];
  }
  return v;
}

/* The device status of a ready CQE: GIO_OK, or GIO_ERR_CQE for REQ_ERR / RESP_ERR (the
 * syndrome says why), GIO_ERR_TRANSPORT for an opcode a send CQ never carries. */
__device__ __forceinline__ int cqe_status(const cqe_view &v) {
  if (v.opcode == GIO_MLX5_CQE_REQ || v.opcode == GIO_MLX5_CQE_RESP_WR_IMM ||
      (v.opcode >= GIO_MLX5_CQE_RESP_SEND && v.opcode <= GIO_MLX5_CQE_RESP_SEND_INV))
    return GIO_OK;
  if (v.opcode == GIO_MLX5_CQE_REQ_ERR || v.opcode == GIO_MLX5_CQE_RESP_ERR) return GIO_ERR_CQE;
  return GIO_ERR_TRANSPORT;
}

/* Records the first error CQE in the state (error, syndrome, error_wqe). */
__device__ __forceinline__ void record_error(gio_mlx5_qp *m, const cqe_view &v, int st, u64 wqe) {
  if (atomicCAS(&m->error, GIO_OK, st) == GIO_OK) {
    m->syndrome = ((uint32_t)v.vendor_syndrome << 8) | v.syndrome;
    m->error_wqe = wqe;
    __threadfence();
  }
}

/* Consumer index `ci` was consumed: the CQ doorbell record tells the NIC (24 bits). */
__device__ __forceinline__ void update_cq_dbrec(gio_mlx5_qp *m, u64 ci_end) {
  const u64 old = atomicMax(&m->sq_completed, ci_end);
  if (old < ci_end) *(volatile uint32_t *)m->cq_dbrec = be32((uint32_t)(ci_end & 0xffffff));
}

/* GIO_OK once WQE `pi` completed, 1 while pending, else the failure. Every WQE asks for a
 * CQE and an RC send queue completes in order, so CQE number `pi` is WQE `pi`'s; its
 * slot cannot be reused before sq_completed passed `pi` (the producer waits for that),
 * which is checked first. */
__device__ __forceinline__ int poll_wqe(gio_mlx5_qp *m, u64 pi) {
  if (*(volatile u64 *)&m->sq_completed > pi) {
    const int e = *(volatile int32_t *)&m->error;
    return (e != GIO_OK && *(volatile u64 *)&m->error_wqe <= pi) ? e : GIO_OK;
  }
  const cqe_view v = read_cqe(m, pi);
  if (!v.ready) return 1;
  if (v.wqe_counter != (uint16_t)(pi & 0xffff)) return GIO_ERR_TRANSPORT;
  const int st = cqe_status(v);
  if (st != GIO_OK) record_error(m, v, st, pi);
  update_cq_dbrec(m, pi + 1);
  if (st != GIO_OK) return st;
  /* A later error only matters to later WQEs. */
  return GIO_OK;
}

} /* namespace mlx5 */
} /* namespace gio */

#endif /* CUDA */

#endif /* GPUNETIO_GIO_MLX5_CUH */
