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
// docs.rs (nightly) marks what each feature adds.
#![cfg_attr(docsrs, feature(doc_cfg))]

use core::mem::{offset_of, size_of};

pub mod mlx5;

/// `GIO_ABI_VERSION`: bumped with any layout change.
pub const GIO_ABI_VERSION: u32 = 2;

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
pub const GIO_MR_HOST: u32 = 0x4;

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

/// `seq` of an entry published as an image ([`entry_encode`]).
pub const GIO_SEQ_IMAGE: u64 = 1 << 63;
/// Word 7's bits 32..37 carry bit 63 of words 1..6 in an encoded image.
pub const GIO_IMAGE_TOP_SHIFT: u32 = 32;

/// The lap phase an image of `ticket` carries in bit 63 of words 1-7
/// (`gio_entry_phase`): 1 on even laps, so a zeroed ring never looks published.
pub fn entry_phase(ticket: u64, ring_size: u32) -> u64 {
    ((ticket / ring_size as u64) & 1) ^ 1
}

/// `gio_entry_encode`: the words of an entry (`reserved` zero) encoded for publication
/// as an image of `ticket` (see `gio_ring_entry` in the header).
pub fn entry_encode(w: &mut [u64; 8], ticket: u64, ring_size: u32) {
    let phase = entry_phase(ticket, ring_size) << 63;
    let mut top = 0;
    for (k, word) in w.iter_mut().enumerate().take(7).skip(1) {
        top |= (*word >> 63) << (GIO_IMAGE_TOP_SHIFT as usize + k - 1);
        *word = (*word & !(1 << 63)) | phase;
    }
    w[7] = (w[7] & 0xffff_ffff) | top | phase;
    w[0] = (ticket + 1) | GIO_SEQ_IMAGE;
}

/// `gio_entry_decode`: `true` with the entry's words restored in `w` (seq = ticket + 1),
/// `false` while a word still belongs to the slot's previous lap (read it again later).
pub fn entry_decode(w: &mut [u64; 8], ticket: u64, ring_size: u32) -> bool {
    let phase = entry_phase(ticket, ring_size);
    if w[0] != (ticket + 1) | GIO_SEQ_IMAGE || w[1..].iter().any(|x| x >> 63 != phase) {
        return false;
    }
    let top = w[7];
    for (k, word) in w.iter_mut().enumerate().take(7).skip(1) {
        let bit = (top >> (GIO_IMAGE_TOP_SHIFT as usize + k - 1)) & 1;
        *word = (*word & !(1 << 63)) | (bit << 63);
    }
    w[7] &= 0xffff_ffff;
    w[0] = ticket + 1;
    true
}

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
    pub last_post_ns: u64,
    pub pad1: [u8; 32],
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
    /// CPU_PROXY: a wait's first completion read waits this long after the latest post.
    pub first_poll_ns: u64,
    pub reserved: [u8; 40],
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
            last_post_ns: 0,
            pad1: [0; 32],
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
            first_poll_ns: 0,
            reserved: [0; 40],
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
    (
        "gio_ring_dev_state",
        "last_post_ns",
        offset_of!(gio_ring_dev_state, last_post_ns),
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
    (
        "gio_dev_qp",
        "first_poll_ns",
        offset_of!(gio_dev_qp, first_poll_ns),
    ),
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
    assert!(offset_of!(gio_ring_dev_state, last_post_ns) == 24);
    assert!(size_of::<gio_dev_mr>() == 32);
    assert!(offset_of!(gio_dev_mr, flags) == 16);
    assert!(size_of::<gio_dev_qp>() == 128);
    assert!(offset_of!(gio_dev_qp, ring) == 16);
    assert!(offset_of!(gio_dev_qp, mrs) == 40);
    assert!(offset_of!(gio_dev_qp, counters) == 48);
    assert!(offset_of!(gio_dev_qp, timeout_ns) == 64);
    assert!(offset_of!(gio_dev_qp, mlx5) == 72);
    assert!(offset_of!(gio_dev_qp, first_poll_ns) == 80);
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
    /// `gio_entry_encode` as host C compiles it (abi_check.c).
    pub fn gio_abi_check_encode(w: *mut u64, ticket: u64, ring_size: u32);
    /// `gio_entry_decode` as host C compiles it (abi_check.c).
    pub fn gio_abi_check_decode(w: *mut u64, ticket: u64, ring_size: u32) -> i32;
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

    /// Entries with every top bit and field pattern that matters: each word's bit 63
    /// set and clear, all ones, zeros.
    fn sample_entries() -> Vec<[u64; 8]> {
        let mut v = vec![[0u64; 8]];
        let mut ones = [u64::MAX; 8];
        ones[7] = 0xffff_ffff;
        v.push(ones);
        for k in 1..7 {
            let mut w = [0x0123_4567_89ab_cdef_u64; 8];
            w[7] = 0x89ab_cdef;
            w[k] |= 1 << 63;
            v.push(w);
        }
        v
    }

    #[test]
    fn image_encoding_round_trips_and_matches_host_c() {
        for size in [1u32, 2, 256] {
            for ticket in [0u64, 1, 255, 256, 257, 511, 512, 1 << 40] {
                for original in sample_entries() {
                    let mut rust = original;
                    entry_encode(&mut rust, ticket, size);
                    let mut c = original;
                    // SAFETY: an 8-word array, as the C function reads and writes.
                    unsafe { gio_abi_check_encode(c.as_mut_ptr(), ticket, size) };
                    assert_eq!(rust, c, "encode ticket {ticket} size {size}");
                    let mut decoded = rust;
                    assert!(entry_decode(&mut decoded, ticket, size));
                    let mut expect = original;
                    expect[0] = ticket + 1;
                    assert_eq!(decoded, expect, "round trip ticket {ticket} size {size}");
                    let mut c_decoded = rust;
                    // SAFETY: as above.
                    let ok = unsafe { gio_abi_check_decode(c_decoded.as_mut_ptr(), ticket, size) };
                    assert_eq!((ok, c_decoded), (1, expect));
                }
            }
        }
    }

    #[test]
    fn image_decoding_refuses_any_word_of_the_previous_lap() {
        let size = 4u32;
        for ticket in [4u64, 5, 9, 1000] {
            let mut old = [0x1111_u64; 8];
            old[7] = 0x22;
            entry_encode(&mut old, ticket - size as u64, size);
            let mut new = [0x3333_u64; 8];
            new[7] = 0x44;
            entry_encode(&mut new, ticket, size);
            // Every mix of old and new words but all-new is refused.
            for mask in 0u32..256 {
                let mut w = [0u64; 8];
                for k in 0..8 {
                    w[k] = if mask & (1 << k) != 0 { new[k] } else { old[k] };
                }
                assert_eq!(
                    entry_decode(&mut w, ticket, size),
                    mask == 255,
                    "mask {mask:08b}"
                );
            }
        }
        // A zeroed slot is never a published first-lap entry.
        let mut zero = [0u64; 8];
        zero[0] = 1 | GIO_SEQ_IMAGE;
        assert!(!entry_decode(&mut zero, 0, size));
    }

    #[test]
    fn header_constants_match_the_rust_constants() {
        // Every `#define GIO_…` of the header has a Rust constant of the same value.
        let consts: &[(&str, i128)] = &[
            ("GIO_ABI_VERSION", GIO_ABI_VERSION as i128),
            ("GIO_NIC_HANDLER_AUTO", GIO_NIC_HANDLER_AUTO as i128),
            (
                "GIO_NIC_HANDLER_CPU_PROXY",
                GIO_NIC_HANDLER_CPU_PROXY as i128,
            ),
            (
                "GIO_NIC_HANDLER_INTRA_NODE",
                GIO_NIC_HANDLER_INTRA_NODE as i128,
            ),
            ("GIO_NIC_HANDLER_MLX5", GIO_NIC_HANDLER_MLX5 as i128),
            ("GIO_OP_NOP", GIO_OP_NOP as i128),
            ("GIO_OP_PUT", GIO_OP_PUT as i128),
            ("GIO_OP_PUT_INLINE", GIO_OP_PUT_INLINE as i128),
            ("GIO_OP_GET", GIO_OP_GET as i128),
            ("GIO_OP_SIGNAL", GIO_OP_SIGNAL as i128),
            ("GIO_OP_FENCE", GIO_OP_FENCE as i128),
            ("GIO_OP_MAX", GIO_OP_MAX as i128),
            ("GIO_FLAG_SIGNAL", GIO_FLAG_SIGNAL as i128),
            ("GIO_FLAG_COUNTER", GIO_FLAG_COUNTER as i128),
            ("GIO_FLAGS_ALL", GIO_FLAGS_ALL as i128),
            ("GIO_MR_REMOTE", GIO_MR_REMOTE as i128),
            ("GIO_MR_MAPPED", GIO_MR_MAPPED as i128),
            ("GIO_MR_HOST", GIO_MR_HOST as i128),
            ("GIO_SEQ_IMAGE", GIO_SEQ_IMAGE as i128),
            ("GIO_IMAGE_TOP_SHIFT", GIO_IMAGE_TOP_SHIFT as i128),
            ("GIO_OK", GIO_OK as i128),
            ("GIO_ERR_BAD_ENTRY", GIO_ERR_BAD_ENTRY as i128),
            ("GIO_ERR_BOUNDS", GIO_ERR_BOUNDS as i128),
            ("GIO_ERR_TRANSPORT", GIO_ERR_TRANSPORT as i128),
            ("GIO_ERR_PEER_GONE", GIO_ERR_PEER_GONE as i128),
            ("GIO_ERR_TIMEOUT", GIO_ERR_TIMEOUT as i128),
            ("GIO_ERR_SHUTDOWN", GIO_ERR_SHUTDOWN as i128),
            ("GIO_ERR_MIXED_LEVELS", GIO_ERR_MIXED_LEVELS as i128),
            ("GIO_ERR_CQE", GIO_ERR_CQE as i128),
            ("GIO_NO_COUNTER", GIO_NO_COUNTER as i128),
            ("GIO_QP_SAME_DEVICE", GIO_QP_SAME_DEVICE as i128),
            ("GIO_LEVEL_UNUSED", GIO_LEVEL_UNUSED as i128),
            ("GIO_LEVEL_HIGH", GIO_LEVEL_HIGH as i128),
            ("GIO_LEVEL_LOW", GIO_LEVEL_LOW as i128),
        ];
        assert_header_defines(GIO_ABI_H, "GIO_", consts);
    }

    /// Every `#define NAME VALUE` of `header` whose name starts with `prefix` (and has a
    /// numeric value) equals the Rust constant of that name in `consts`, and every one of
    /// `consts` is defined there.
    pub(crate) fn assert_header_defines(header: &str, prefix: &str, consts: &[(&str, i128)]) {
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
            let value = value.trim_end_matches(['u', 'l']);
            let parsed = match value.strip_prefix("0x") {
                Some(hex) => i128::from_str_radix(hex, 16),
                None => value.parse::<i128>(),
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
