/*
 * gpunetio ABI: the structures host code (Rust, C) and device code (CUDA C++) share.
 *
 * Defined once here; the Rust mirror in gpunetio-sys/src/lib.rs asserts the same sizes
 * and offsets, the host C compiler checks this file in abi_check.c at build time, NVRTC
 * checks it whenever device code is compiled, and a GPU test reads sizeof/offsetof
 * from a kernel. Change a layout only together with GIO_ABI_VERSION.
 *
 * Names follow DOCA GPUNetIO where a concept matches (see gio_device.cuh).
 */
#ifndef GPUNETIO_GIO_ABI_H
#define GPUNETIO_GIO_ABI_H

#if defined(__CUDACC_RTC__)
/* NVRTC has no libc headers. */
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int int32_t;
typedef long long int64_t;
#else
#include <stddef.h>
#include <stdint.h>
#endif

/* The ABI's 64-bit word. `unsigned long long` everywhere, not uint64_t: under nvcc on
 * LP64 hosts uint64_t is `unsigned long`, which CUDA's atomics and the device library's
 * own u64 are not, so code including these headers from nvcc would not compile. */
typedef unsigned long long gio_u64;

#if defined(__cplusplus)
#define GIO_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define GIO_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

/* NVRTC has no constant offsetof: there sizes are asserted at compile time and offsets
 * at run time (the gio_layout kernel); host C and Rust assert both. */
#if defined(__CUDACC_RTC__)
#define GIO_ASSERT_OFFSET(type, field, offset)
#else
#define GIO_ASSERT_OFFSET(type, field, offset) \
  GIO_STATIC_ASSERT(offsetof(struct type, field) == (offset), #type "." #field " offset")
#endif

GIO_STATIC_ASSERT(sizeof(gio_u64) == 8, "gio_u64 is 64 bits");

#define GIO_ABI_VERSION 2u

/* ---- NIC handlers (how a queue pair's work reaches the network) ---------------------- */
/* Chosen by the host; `AUTO` is resolved before export and never reaches device code. */
#define GIO_NIC_HANDLER_AUTO 0u
/* Entries go into a host-mapped ring; a CPU proxy posts them on any transport. */
#define GIO_NIC_HANDLER_CPU_PROXY 1u
/* Peer memory mapped through CUDA IPC: puts are stores, signals system-scope atomics. */
#define GIO_NIC_HANDLER_INTRA_NODE 2u
/* Native mlx5: the GPU writes WQEs and rings the doorbell itself. */
#define GIO_NIC_HANDLER_MLX5 3u

/* ---- ring entry opcodes ---------------------------------------------------------------- */
#define GIO_OP_NOP 0u
/* Write `length` bytes from (local_mr, local_off) to (remote_mr, remote_off). */
#define GIO_OP_PUT 1u
/* Write the `length` (1, 2, 4 or 8) low bytes of `inline_value` to (remote_mr, remote_off). */
#define GIO_OP_PUT_INLINE 2u
/* Read `length` bytes from (remote_mr, remote_off) into (local_mr, local_off). */
#define GIO_OP_GET 3u
/* Atomic 64-bit add of `signal_add` to (signal_mr, signal_off) only. */
#define GIO_OP_SIGNAL 4u
/* Everything before completes before anything after starts. */
#define GIO_OP_FENCE 5u
#define GIO_OP_MAX 5u

/* ---- entry flags ----------------------------------------------------------------------- */
/* After the data of this entry is delivered, atomically add `signal_add` at
 * (signal_mr, signal_off) of the peer (put_signal). */
#define GIO_FLAG_SIGNAL 0x1u
/* When this entry completes locally, add 1 to counters[counter] (the *_counter calls). */
#define GIO_FLAG_COUNTER 0x2u
#define GIO_FLAGS_ALL 0x3u

/* ---- memory table entry flags ---------------------------------------------------------- */
/* The region belongs to the peer (a destination of puts, a source of gets). */
#define GIO_MR_REMOTE 0x1u
/* `addr` is valid in this GPU's address space (local memory; a peer's memory mapped
 * through CUDA IPC for INTRA_NODE). */
#define GIO_MR_MAPPED 0x2u
/* The region is host memory: data a kernel stored there reaches the NIC handler only
 * after a system-scope fence (device memory needs a GPU-scope one). */
#define GIO_MR_HOST 0x4u

/* ---- statuses (reported by the host into gio_ring_ctrl.error, returned by device calls) */
#define GIO_OK 0
/* The entry is malformed (opcode, flags, length). */
#define GIO_ERR_BAD_ENTRY 1
/* A memory index or range outside the registered table. */
#define GIO_ERR_BOUNDS 2
/* The transport failed the operation. */
#define GIO_ERR_TRANSPORT 3
/* The peer is gone. */
#define GIO_ERR_PEER_GONE 4
/* A device-side wait ran past its timeout. */
#define GIO_ERR_TIMEOUT 5
/* The queue pair was unexported or destroyed by the host. */
#define GIO_ERR_SHUTDOWN 6
/* Low-level and high-level calls mixed on one queue pair (debug builds). */
#define GIO_ERR_MIXED_LEVELS 7
/* MLX5: the NIC returned an error completion; gio_mlx5_qp.syndrome says why. */
#define GIO_ERR_CQE 8

/* ---- queue pair flags (gio_dev_qp.flags) ------------------------------------------------ */
/* Every peer region is memory of this same GPU (INTRA_NODE between processes sharing a
 * device): ordering and atomics need only GPU scope, not system scope. */
#define GIO_QP_SAME_DEVICE 0x1u

/* Ring slots and counters: no counter. */
#define GIO_NO_COUNTER 0xffffffffu

/* One unit of work in a CPU proxy ring: one cache line, written by the GPU into
 * host-mapped memory. The proxy takes an entry only once its seq (without
 * GIO_SEQ_IMAGE) equals its ticket + 1, and only whole, so wraparound needs no
 * clearing. Two ways to publish one:
 *  - in place (low level: prepare_* into the slot, then mark_ready): every field is
 *    stored before `seq`, which is stored last with a system-scope release;
 *  - as an image (high level): seq carries GIO_SEQ_IMAGE and the eight words are stored
 *    in any order without a fence; each of words 1-7 carries the slot's lap phase in
 *    bit 63 (gio_entry_encode) and the proxy takes the entry only once all seven show
 *    the phase of its ticket. Single-copy atomicity of aligned 8-byte stores makes a
 *    word either the old lap's or the new one; a system-scope release (~0.6 us on an
 *    H100 over PCIe) is then needed for nothing but the data the entry points at. */
struct gio_ring_entry {
  gio_u64 seq;          /*  0: ticket + 1 (| GIO_SEQ_IMAGE) */
  uint8_t opcode;        /*  8: GIO_OP_* */
  uint8_t flags;         /*  9: GIO_FLAG_* */
  uint16_t local_mr;     /* 10: index in the memory table (GIO_OP_PUT/GET) */
  uint16_t remote_mr;    /* 12: index in the memory table */
  uint16_t signal_mr;    /* 14: index in the memory table (GIO_FLAG_SIGNAL, GIO_OP_SIGNAL) */
  gio_u64 local_off;    /* 16: byte offset in local_mr; GIO_OP_PUT_INLINE: the value */
  gio_u64 remote_off;   /* 24 */
  gio_u64 length;       /* 32 */
  gio_u64 signal_off;   /* 40: 8-byte aligned */
  gio_u64 signal_add;   /* 48 */
  uint32_t counter;      /* 56: GIO_FLAG_COUNTER: index in the counter array */
  uint32_t reserved;     /* 60: zero */
};
GIO_STATIC_ASSERT(sizeof(struct gio_ring_entry) == 64, "gio_ring_entry is one cache line");
GIO_ASSERT_OFFSET(gio_ring_entry, opcode, 8);
GIO_ASSERT_OFFSET(gio_ring_entry, local_mr, 10);
GIO_ASSERT_OFFSET(gio_ring_entry, signal_mr, 14);
GIO_ASSERT_OFFSET(gio_ring_entry, local_off, 16);
GIO_ASSERT_OFFSET(gio_ring_entry, length, 32);
GIO_ASSERT_OFFSET(gio_ring_entry, signal_add, 48);
GIO_ASSERT_OFFSET(gio_ring_entry, counter, 56);

/* seq of an entry published as an image (gio_entry_encode). */
#define GIO_SEQ_IMAGE 0x8000000000000000ull
/* Word 7's bits 32..37 hold bit 63 of words 1..6 in an encoded image; bits 38..62 are
 * zero (the entry's `reserved` field). */
#define GIO_IMAGE_TOP_SHIFT 32u

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define GIO_HOST_DEVICE __host__ __device__
#else
#define GIO_HOST_DEVICE
#endif

/* The lap phase an image of `ticket` carries in bit 63 of words 1-7: 1 on even laps, so
 * a zeroed ring never looks published. `ring_size` is a power of two. */
static inline GIO_HOST_DEVICE gio_u64 gio_entry_phase(gio_u64 ticket, uint32_t ring_size) {
  return ((ticket / ring_size) & 1u) ^ 1u;
}

/* Encodes the eight words of an entry (as laid out in struct gio_ring_entry, `reserved`
 * zero) for publication as an image of `ticket`: bit 63 of words 1..6 moves into word 7
 * (GIO_IMAGE_TOP_SHIFT), bit 63 of words 1..7 becomes the phase, word 0 the image seq. */
static inline GIO_HOST_DEVICE void gio_entry_encode(gio_u64 w[8], gio_u64 ticket,
                                                    uint32_t ring_size) {
  const gio_u64 phase = gio_entry_phase(ticket, ring_size) << 63;
  gio_u64 top = 0;
  for (unsigned k = 1; k <= 6; k++) {
    top |= (w[k] >> 63) << (GIO_IMAGE_TOP_SHIFT + k - 1);
    w[k] = (w[k] & ~(1ull << 63)) | phase;
  }
  w[7] = (w[7] & 0xffffffffull) | top | phase;
  w[0] = (ticket + 1) | GIO_SEQ_IMAGE;
}

/* Decodes an image of `ticket` read from its slot: 1 with the entry's words in `w` (seq
 * = ticket + 1), or 0 while some word still belongs to the previous lap (the GPU's
 * stores are in flight: read the slot again later). */
static inline GIO_HOST_DEVICE int gio_entry_decode(gio_u64 w[8], gio_u64 ticket,
                                                   uint32_t ring_size) {
  const gio_u64 phase = gio_entry_phase(ticket, ring_size);
  if (w[0] != ((ticket + 1) | GIO_SEQ_IMAGE)) return 0;
  for (unsigned k = 1; k <= 7; k++)
    if ((w[k] >> 63) != phase) return 0;
  const gio_u64 top = w[7];
  for (unsigned k = 1; k <= 6; k++)
    w[k] = (w[k] & ~(1ull << 63)) | (((top >> (GIO_IMAGE_TOP_SHIFT + k - 1)) & 1u) << 63);
  w[7] &= 0xffffffffull;
  w[0] = ticket + 1;
  return 1;
}

/* The host-written half of a ring, in host-mapped memory the GPU reads. Fields the GPU
 * polls sit on their own cache lines. */
struct gio_ring_ctrl {
  gio_u64 consumed;     /*   0: entries the proxy took off the ring (slots below
                          *      consumed + size are free) */
  uint8_t pad0[56];
  gio_u64 completed;    /*  64: entries whose operations completed, in ticket order */
  uint8_t pad1[56];
  int32_t error;         /* 128: first failure (GIO_ERR_*), GIO_OK while healthy */
  uint32_t shutdown;     /* 132: nonzero once the host unexported the queue pair */
  gio_u64 error_ticket; /* 136: ticket of the first failed entry */
  uint8_t pad2[48];
};
GIO_STATIC_ASSERT(sizeof(struct gio_ring_ctrl) == 192, "gio_ring_ctrl is three cache lines");
GIO_ASSERT_OFFSET(gio_ring_ctrl, completed, 64);
GIO_ASSERT_OFFSET(gio_ring_ctrl, error, 128);
/* host_verdict() reads error and shutdown as one 8-byte word. */
GIO_ASSERT_OFFSET(gio_ring_ctrl, shutdown, 132);
GIO_ASSERT_OFFSET(gio_ring_ctrl, error_ticket, 136);

/* The GPU-written half of a ring's bookkeeping, in device memory. */
struct gio_ring_dev_state {
  gio_u64 reserved;        /*  0: next ticket (atomically advanced by producers) */
  gio_u64 cached_consumed; /*  8: last value of gio_ring_ctrl.consumed seen */
  uint32_t level;           /* 16: GIO_LEVEL_* once an API level was used (debug check) */
  uint32_t pad0;            /* 20 */
  gio_u64 last_post_ns;    /* 24: %globaltimer of the latest post (wait's first poll) */
  uint8_t pad1[32];
};
GIO_STATIC_ASSERT(sizeof(struct gio_ring_dev_state) == 64, "gio_ring_dev_state");
GIO_ASSERT_OFFSET(gio_ring_dev_state, level, 16);
GIO_ASSERT_OFFSET(gio_ring_dev_state, last_post_ns, 24);

#define GIO_LEVEL_UNUSED 0u
#define GIO_LEVEL_HIGH 1u
#define GIO_LEVEL_LOW 2u

/* One registered memory region of a queue pair's table (local or the peer's). */
struct gio_dev_mr {
  gio_u64 addr;   /*  0: GIO_MR_MAPPED: where this GPU addresses it; else 0 */
  gio_u64 length; /*  8 */
  uint32_t flags;  /* 16: GIO_MR_* */
  uint32_t index;  /* 20: its own index (checked by the proxy) */
  gio_u64 reserved; /* 24 */
};
GIO_STATIC_ASSERT(sizeof(struct gio_dev_mr) == 32, "gio_dev_mr");
GIO_ASSERT_OFFSET(gio_dev_mr, flags, 16);

/* The mlx5 handler's state (gio_mlx5.cuh). */
struct gio_mlx5_qp;

/* A queue pair as a kernel sees it: passed by pointer (device memory) as a kernel
 * argument. Built and owned by the host (`gpunetio::GpuQueuePair::export`). */
struct gio_dev_qp {
  uint32_t abi_version;        /*   0: GIO_ABI_VERSION */
  uint32_t nic_handler;        /*   4: GIO_NIC_HANDLER_* (never AUTO) */
  uint32_t ring_size;          /*   8: entries, a power of two (CPU_PROXY) */
  uint32_t num_mrs;            /*  12 */
  struct gio_ring_entry *ring; /*  16: host-mapped entries (CPU_PROXY) */
  struct gio_ring_ctrl *ctrl;  /*  24: host-mapped control block */
  struct gio_ring_dev_state *state; /* 32: device memory */
  struct gio_dev_mr *mrs;      /*  40: device memory, num_mrs entries */
  gio_u64 *counters;          /*  48: host-mapped completion counters */
  uint32_t num_counters;       /*  56 */
  uint32_t flags;              /*  60: GIO_QP_* */
  gio_u64 timeout_ns;         /*  64: bound on every device-side wait (0: none) */
  struct gio_mlx5_qp *mlx5;    /*  72: device memory (MLX5), else null */
  gio_u64 first_poll_ns;      /*  80: CPU_PROXY: a wait's first read of the completion
                                *      count is issued this long after the latest post
                                *      (0: at once); see gio::wait */
  uint8_t reserved[40];        /*  88 */
};
GIO_STATIC_ASSERT(sizeof(struct gio_dev_qp) == 128, "gio_dev_qp");
GIO_ASSERT_OFFSET(gio_dev_qp, ring, 16);
GIO_ASSERT_OFFSET(gio_dev_qp, mrs, 40);
GIO_ASSERT_OFFSET(gio_dev_qp, counters, 48);
GIO_ASSERT_OFFSET(gio_dev_qp, timeout_ns, 64);
GIO_ASSERT_OFFSET(gio_dev_qp, mlx5, 72);
GIO_ASSERT_OFFSET(gio_dev_qp, first_poll_ns, 80);

#endif /* GPUNETIO_GIO_ABI_H */
