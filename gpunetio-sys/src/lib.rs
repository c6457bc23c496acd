//! The C ABI of gpunetio's GPU-initiated networking, shared by host code and the CUDA
//! device library shipped in this crate.
//!
//! The layout is defined once, in `include/gpunetio/gio_abi.h`; the structs here mirror
//! it with const asserts on every size and offset that matters, the build script
//! compiles the header with the host C compiler (its `static_assert`s), NVRTC checks it
//! whenever device code is compiled, and a GPU test compares `sizeof`/`offsetof` read in
//! a kernel with [`LAYOUT`].
//!
//! Device code: [`HEADERS`] holds the headers by include name, for NVRTC (which has no
//! file system view of this crate); build scripts of dependents find the folder through
//! `DEP_GPUNETIO_INCLUDE`. The device API is documented in `gio_device.cuh`, next to the
//! DOCA GPUNetIO names it mirrors.
//!
//! Nothing here is safe to use without the host side (`gpunetio`) that builds these
//! structs; values the device or the host report (statuses, opcodes) are plain integer
//! constants, never Rust enums: an unknown value must not be undefined behaviour.
#![allow(non_camel_case_types)]

use core::mem::{offset_of, size_of};

pub mod mlx5;

/// `GIO_ABI_VERSION`: bumped with any layout change.
pub const GIO_ABI_VERSION: u32 = 1;

pub const GIO_NIC_HANDLER_AUTO: u32 = 0;
pub const GIO_NIC_HANDLER_CPU_PROXY: u32 = 1;
pub const GIO_NIC_HANDLER_INTRA_NODE: u32 = 2;
pub const GIO_NIC_HANDLER_MLX5: u32 = 3;

pub const GIO_OP_NOP: u8 = 0;
pub const GIO_OP_PUT: u8 = 1;
pub const GIO_OP_PUT_INLINE: u8 = 2;
pub const GIO_OP_GET: u8 = 3;
pub const GIO_OP_SIGNAL: u8 = 4;
pub const GIO_OP_FENCE: u8 = 5;
pub const GIO_OP_MAX: u8 = 5;

pub const GIO_FLAG_SIGNAL: u8 = 0x1;
pub const GIO_FLAG_COUNTER: u8 = 0x2;
pub const GIO_FLAGS_ALL: u8 = 0x3;

pub const GIO_MR_REMOTE: u32 = 0x1;
pub const GIO_MR_MAPPED: u32 = 0x2;

pub const GIO_OK: i32 = 0;
pub const GIO_ERR_BAD_ENTRY: i32 = 1;
pub const GIO_ERR_BOUNDS: i32 = 2;
pub const GIO_ERR_TRANSPORT: i32 = 3;
pub const GIO_ERR_PEER_GONE: i32 = 4;
pub const GIO_ERR_TIMEOUT: i32 = 5;
pub const GIO_ERR_SHUTDOWN: i32 = 6;
pub const GIO_ERR_MIXED_LEVELS: i32 = 7;
/// MLX5: the NIC returned an error completion (`gio_mlx5_qp.syndrome` says why).
pub const GIO_ERR_CQE: i32 = 8;

pub const GIO_QP_SAME_DEVICE: u32 = 0x1;

pub const GIO_NO_COUNTER: u32 = 0xffff_ffff;

pub const GIO_LEVEL_UNUSED: u32 = 0;
pub const GIO_LEVEL_HIGH: u32 = 1;
pub const GIO_LEVEL_LOW: u32 = 2;

/// One unit of work in a CPU proxy ring (one cache line; `seq` = ticket + 1, stored
/// last by the producer).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct gio_ring_entry {
    pub seq: u64,
    pub opcode: u8,
    pub flags: u8,
    pub local_mr: u16,
    pub remote_mr: u16,
    pub signal_mr: u16,
    pub local_off: u64,
    pub remote_off: u64,
    pub length: u64,
    pub signal_off: u64,
    pub signal_add: u64,
    pub counter: u32,
    pub reserved: u32,
}

/// The host-written control block of a ring (host-mapped; the GPU polls it).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gio_ring_ctrl {
    pub consumed: u64,
    pub pad0: [u8; 56],
    pub completed: u64,
    pub pad1: [u8; 56],
    pub error: i32,
    pub shutdown: u32,
    pub error_ticket: u64,
    pub pad2: [u8; 48],
}

/// The GPU-written bookkeeping of a ring (device memory).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gio_ring_dev_state {
    pub reserved: u64,
    pub cached_consumed: u64,
    pub level: u32,
    pub pad0: u32,
    pub pad1: [u8; 40],
}

/// One region of a queue pair's memory table.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct gio_dev_mr {
    pub addr: u64,
    pub length: u64,
    pub flags: u32,
    pub index: u32,
    pub reserved: u64,
}

/// A queue pair as kernels see it (passed by device pointer).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gio_dev_qp {
    pub abi_version: u32,
    pub nic_handler: u32,
    pub ring_size: u32,
    pub num_mrs: u32,
    pub ring: u64,
    pub ctrl: u64,
    pub state: u64,
    pub mrs: u64,
    pub counters: u64,
    pub num_counters: u32,
    pub flags: u32,
    pub timeout_ns: u64,
    /// `struct gio_mlx5_qp *` (device memory) for `GIO_NIC_HANDLER_MLX5`, else 0.
    pub mlx5: u64,
    pub reserved: [u8; 48],
}

impl Default for gio_ring_ctrl {
    fn default() -> Self {
        Self {
            consumed: 0,
            pad0: [0; 56],
            completed: 0,
            pad1: [0; 56],
            error: GIO_OK,
            shutdown: 0,
            error_ticket: 0,
            pad2: [0; 48],
        }
    }
}

impl Default for gio_ring_dev_state {
    fn default() -> Self {
        Self {
            reserved: 0,
            cached_consumed: 0,
            level: GIO_LEVEL_UNUSED,
            pad0: 0,
            pad1: [0; 40],
        }
    }
}

impl Default for gio_dev_qp {
    fn default() -> Self {
        Self {
            abi_version: GIO_ABI_VERSION,
            nic_handler: GIO_NIC_HANDLER_CPU_PROXY,
            ring_size: 0,
            num_mrs: 0,
            ring: 0,
            ctrl: 0,
            state: 0,
            mrs: 0,
            counters: 0,
            num_counters: 0,
            flags: 0,
            timeout_ns: 0,
            mlx5: 0,
            reserved: [0; 48],
        }
    }
}

/// `(struct, field, offset)` for every checked field, plus `(struct, "sizeof", size)`:
/// the same table the header's static asserts encode, compared on the GPU.
pub const LAYOUT: &[(&str, &str, usize)] = &[
    ("gio_ring_entry", "sizeof", size_of::<gio_ring_entry>()),
    ("gio_ring_entry", "seq", offset_of!(gio_ring_entry, seq)),
    (
        "gio_ring_entry",
        "opcode",
        offset_of!(gio_ring_entry, opcode),
    ),
    ("gio_ring_entry", "flags", offset_of!(gio_ring_entry, flags)),
    (
        "gio_ring_entry",
        "local_mr",
        offset_of!(gio_ring_entry, local_mr),
    ),
    (
        "gio_ring_entry",
        "remote_mr",
        offset_of!(gio_ring_entry, remote_mr),
    ),
    (
        "gio_ring_entry",
        "signal_mr",
        offset_of!(gio_ring_entry, signal_mr),
    ),
    (
        "gio_ring_entry",
        "local_off",
        offset_of!(gio_ring_entry, local_off),
    ),
    (
        "gio_ring_entry",
        "remote_off",
        offset_of!(gio_ring_entry, remote_off),
    ),
    (
        "gio_ring_entry",
        "length",
        offset_of!(gio_ring_entry, length),
    ),
    (
        "gio_ring_entry",
        "signal_off",
        offset_of!(gio_ring_entry, signal_off),
    ),
    (
        "gio_ring_entry",
        "signal_add",
        offset_of!(gio_ring_entry, signal_add),
    ),
    (
        "gio_ring_entry",
        "counter",
        offset_of!(gio_ring_entry, counter),
    ),
    ("gio_ring_ctrl", "sizeof", size_of::<gio_ring_ctrl>()),
    (
        "gio_ring_ctrl",
        "consumed",
        offset_of!(gio_ring_ctrl, consumed),
    ),
    (
        "gio_ring_ctrl",
        "completed",
        offset_of!(gio_ring_ctrl, completed),
    ),
    ("gio_ring_ctrl", "error", offset_of!(gio_ring_ctrl, error)),
    (
        "gio_ring_ctrl",
        "shutdown",
        offset_of!(gio_ring_ctrl, shutdown),
    ),
    (
        "gio_ring_ctrl",
        "error_ticket",
        offset_of!(gio_ring_ctrl, error_ticket),
    ),
    (
        "gio_ring_dev_state",
        "sizeof",
        size_of::<gio_ring_dev_state>(),
    ),
    (
        "gio_ring_dev_state",
        "reserved",
        offset_of!(gio_ring_dev_state, reserved),
    ),
    (
        "gio_ring_dev_state",
        "cached_consumed",
        offset_of!(gio_ring_dev_state, cached_consumed),
    ),
    (
        "gio_ring_dev_state",
        "level",
        offset_of!(gio_ring_dev_state, level),
    ),
    ("gio_dev_mr", "sizeof", size_of::<gio_dev_mr>()),
    ("gio_dev_mr", "addr", offset_of!(gio_dev_mr, addr)),
    ("gio_dev_mr", "length", offset_of!(gio_dev_mr, length)),
    ("gio_dev_mr", "flags", offset_of!(gio_dev_mr, flags)),
    ("gio_dev_mr", "index", offset_of!(gio_dev_mr, index)),
    ("gio_dev_qp", "sizeof", size_of::<gio_dev_qp>()),
    (
        "gio_dev_qp",
        "abi_version",
        offset_of!(gio_dev_qp, abi_version),
    ),
    (
        "gio_dev_qp",
        "nic_handler",
        offset_of!(gio_dev_qp, nic_handler),
    ),
    ("gio_dev_qp", "ring_size", offset_of!(gio_dev_qp, ring_size)),
    ("gio_dev_qp", "num_mrs", offset_of!(gio_dev_qp, num_mrs)),
    ("gio_dev_qp", "ring", offset_of!(gio_dev_qp, ring)),
    ("gio_dev_qp", "ctrl", offset_of!(gio_dev_qp, ctrl)),
    ("gio_dev_qp", "state", offset_of!(gio_dev_qp, state)),
    ("gio_dev_qp", "mrs", offset_of!(gio_dev_qp, mrs)),
    ("gio_dev_qp", "counters", offset_of!(gio_dev_qp, counters)),
    (
        "gio_dev_qp",
        "num_counters",
        offset_of!(gio_dev_qp, num_counters),
    ),
    (
        "gio_dev_qp",
        "timeout_ns",
        offset_of!(gio_dev_qp, timeout_ns),
    ),
    ("gio_dev_qp", "mlx5", offset_of!(gio_dev_qp, mlx5)),
];

// The header's static asserts, on the Rust side.
const _: () = {
    assert!(size_of::<gio_ring_entry>() == 64);
    assert!(offset_of!(gio_ring_entry, opcode) == 8);
    assert!(offset_of!(gio_ring_entry, local_mr) == 10);
    assert!(offset_of!(gio_ring_entry, signal_mr) == 14);
    assert!(offset_of!(gio_ring_entry, local_off) == 16);
    assert!(offset_of!(gio_ring_entry, length) == 32);
    assert!(offset_of!(gio_ring_entry, signal_add) == 48);
    assert!(offset_of!(gio_ring_entry, counter) == 56);
    assert!(size_of::<gio_ring_ctrl>() == 192);
    assert!(offset_of!(gio_ring_ctrl, completed) == 64);
    assert!(offset_of!(gio_ring_ctrl, error) == 128);
    assert!(offset_of!(gio_ring_ctrl, shutdown) == 132);
    assert!(offset_of!(gio_ring_ctrl, error_ticket) == 136);
    assert!(size_of::<gio_ring_dev_state>() == 64);
    assert!(offset_of!(gio_ring_dev_state, level) == 16);
    assert!(size_of::<gio_dev_mr>() == 32);
    assert!(offset_of!(gio_dev_mr, flags) == 16);
    assert!(size_of::<gio_dev_qp>() == 128);
    assert!(offset_of!(gio_dev_qp, ring) == 16);
    assert!(offset_of!(gio_dev_qp, mrs) == 40);
    assert!(offset_of!(gio_dev_qp, counters) == 48);
    assert!(offset_of!(gio_dev_qp, timeout_ns) == 64);
    assert!(offset_of!(gio_dev_qp, mlx5) == 72);
};

/// `gio_abi.h`.
pub const GIO_ABI_H: &str = include_str!("../include/gpunetio/gio_abi.h");
/// `gio_device.cuh`: the device library.
pub const GIO_DEVICE_CUH: &str = include_str!("../include/gpunetio/gio_device.cuh");
/// `gio_mlx5.cuh`: the native mlx5 handler (WQE building, doorbells, CQE polling).
pub const GIO_MLX5_CUH: &str = include_str!("../include/gpunetio/gio_mlx5.cuh");

/// Every header by the name device code includes it with (`#include "gpunetio/…"`, or
/// the bare file name from a sibling header).
pub const HEADERS: &[(&str, &str)] = &[
    ("gpunetio/gio_abi.h", GIO_ABI_H),
    ("gpunetio/gio_device.cuh", GIO_DEVICE_CUH),
    ("gpunetio/gio_mlx5.cuh", GIO_MLX5_CUH),
    ("gio_abi.h", GIO_ABI_H),
    ("gio_device.cuh", GIO_DEVICE_CUH),
    ("gio_mlx5.cuh", GIO_MLX5_CUH),
];

extern "C" {
    /// From `abi_check.c` (compiled against the header by the build script):
    /// `GIO_ABI_VERSION` as host C sees it.
    pub fn gio_abi_check_version() -> u32;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_c_sees_the_same_abi_version() {
        // SAFETY: a plain C function without arguments or side effects.
        let version = unsafe { gio_abi_check_version() };
        assert_eq!(version, GIO_ABI_VERSION);
    }

    #[test]
    fn header_constants_match_the_rust_constants() {
        // Every `#define GIO_…` of the header has a Rust constant of the same value.
        let consts: &[(&str, i64)] = &[
            ("GIO_ABI_VERSION", GIO_ABI_VERSION as i64),
            ("GIO_NIC_HANDLER_AUTO", GIO_NIC_HANDLER_AUTO as i64),
            (
                "GIO_NIC_HANDLER_CPU_PROXY",
                GIO_NIC_HANDLER_CPU_PROXY as i64,
            ),
            (
                "GIO_NIC_HANDLER_INTRA_NODE",
                GIO_NIC_HANDLER_INTRA_NODE as i64,
            ),
            ("GIO_NIC_HANDLER_MLX5", GIO_NIC_HANDLER_MLX5 as i64),
            ("GIO_OP_NOP", GIO_OP_NOP as i64),
            ("GIO_OP_PUT", GIO_OP_PUT as i64),
            ("GIO_OP_PUT_INLINE", GIO_OP_PUT_INLINE as i64),
            ("GIO_OP_GET", GIO_OP_GET as i64),
            ("GIO_OP_SIGNAL", GIO_OP_SIGNAL as i64),
            ("GIO_OP_FENCE", GIO_OP_FENCE as i64),
            ("GIO_OP_MAX", GIO_OP_MAX as i64),
            ("GIO_FLAG_SIGNAL", GIO_FLAG_SIGNAL as i64),
            ("GIO_FLAG_COUNTER", GIO_FLAG_COUNTER as i64),
            ("GIO_FLAGS_ALL", GIO_FLAGS_ALL as i64),
            ("GIO_MR_REMOTE", GIO_MR_REMOTE as i64),
            ("GIO_MR_MAPPED", GIO_MR_MAPPED as i64),
            ("GIO_OK", GIO_OK as i64),
            ("GIO_ERR_BAD_ENTRY", GIO_ERR_BAD_ENTRY as i64),
            ("GIO_ERR_BOUNDS", GIO_ERR_BOUNDS as i64),
            ("GIO_ERR_TRANSPORT", GIO_ERR_TRANSPORT as i64),
            ("GIO_ERR_PEER_GONE", GIO_ERR_PEER_GONE as i64),
            ("GIO_ERR_TIMEOUT", GIO_ERR_TIMEOUT as i64),
            ("GIO_ERR_SHUTDOWN", GIO_ERR_SHUTDOWN as i64),
            ("GIO_ERR_MIXED_LEVELS", GIO_ERR_MIXED_LEVELS as i64),
            ("GIO_ERR_CQE", GIO_ERR_CQE as i64),
            ("GIO_NO_COUNTER", GIO_NO_COUNTER as i64),
            ("GIO_QP_SAME_DEVICE", GIO_QP_SAME_DEVICE as i64),
            ("GIO_LEVEL_UNUSED", GIO_LEVEL_UNUSED as i64),
            ("GIO_LEVEL_HIGH", GIO_LEVEL_HIGH as i64),
            ("GIO_LEVEL_LOW", GIO_LEVEL_LOW as i64),
        ];
        assert_header_defines(GIO_ABI_H, "GIO_", consts);
    }

    /// Every `#define NAME VALUE` of `header` whose name starts with `prefix` (and has a
    /// numeric value) equals the Rust constant of that name in `consts`, and every one of
    /// `consts` is defined there.
    pub(crate) fn assert_header_defines(header: &str, prefix: &str, consts: &[(&str, i64)]) {
        let mut defined = Vec::new();
        for line in header.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("#define") {
                continue;
            }
            let (Some(name), Some(value)) = (words.next(), words.next()) else {
                continue;
            };
            if !name.starts_with(prefix) || name.contains('(') {
                continue;
            }
            let value = value.trim_end_matches('u');
            let parsed = match value.strip_prefix("0x") {
                Some(hex) => i64::from_str_radix(hex, 16),
                None => value.parse::<i64>(),
            };
            let Ok(parsed) = parsed else { continue };
            defined.push(name.to_string());
            let rust = consts.iter().find(|(n, _)| *n == name);
            assert_eq!(rust.map(|(_, v)| *v), Some(parsed), "{name}");
        }
        for (name, _) in consts {
            assert!(
                defined.iter().any(|d| d == name),
                "{name} is not in the header"
            );
        }
    }
}
