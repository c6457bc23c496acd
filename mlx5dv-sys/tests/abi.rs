//! ABI check of the hand-written `mlx5_wqe_ctrl_seg` (and a few generated structs) against
//! values compiled from the real `infiniband/mlx5dv.h` by `abi_check.c` (build.rs).

use core::mem::{align_of, offset_of, size_of};
use mlx5dv_sys::*;

extern "C" {
    static mlx5dv_sys_abi_ctrl_seg_size: usize;
    static mlx5dv_sys_abi_ctrl_seg_align: usize;
    static mlx5dv_sys_abi_ctrl_seg_opmod_idx_opcode: usize;
    static mlx5dv_sys_abi_ctrl_seg_qpn_ds: usize;
    static mlx5dv_sys_abi_ctrl_seg_signature: usize;
    static mlx5dv_sys_abi_ctrl_seg_dci_stream_channel_id: usize;
    static mlx5dv_sys_abi_ctrl_seg_fm_ce_se: usize;
    static mlx5dv_sys_abi_ctrl_seg_imm: usize;
    static mlx5dv_sys_abi_data_seg_size: usize;
    static mlx5dv_sys_abi_raddr_seg_size: usize;
    static mlx5dv_sys_abi_atomic_seg_size: usize;
    static mlx5dv_sys_abi_cqe64_size: usize;
    static mlx5dv_sys_abi_qp_size: usize;
    static mlx5dv_sys_abi_obj_size: usize;
    fn mlx5dv_sys_abi_fill_ctrl_seg(seg: *mut mlx5_wqe_ctrl_seg);
}

macro_rules! check {
    ($c:ident, $rust:expr) => {
        // SAFETY: the static is a `const size_t` defined in abi_check.c.
        let c = unsafe { $c };
        assert_eq!(c, $rust, "{} differs between C and Rust", stringify!($c));
    };
}

#[test]
fn ctrl_seg_layout_matches_c() {
    check!(mlx5dv_sys_abi_ctrl_seg_size, size_of::<mlx5_wqe_ctrl_seg>());
    check!(
        mlx5dv_sys_abi_ctrl_seg_align,
        align_of::<mlx5_wqe_ctrl_seg>()
    );
    check!(
        mlx5dv_sys_abi_ctrl_seg_opmod_idx_opcode,
        offset_of!(mlx5_wqe_ctrl_seg, opmod_idx_opcode)
    );
    check!(
        mlx5dv_sys_abi_ctrl_seg_qpn_ds,
        offset_of!(mlx5_wqe_ctrl_seg, qpn_ds)
    );
    check!(
        mlx5dv_sys_abi_ctrl_seg_signature,
        offset_of!(mlx5_wqe_ctrl_seg, signature)
    );
    check!(
        mlx5dv_sys_abi_ctrl_seg_dci_stream_channel_id,
        offset_of!(mlx5_wqe_ctrl_seg, dci_stream_channel_id)
    );
    check!(
        mlx5dv_sys_abi_ctrl_seg_fm_ce_se,
        offset_of!(mlx5_wqe_ctrl_seg, fm_ce_se)
    );
    check!(
        mlx5dv_sys_abi_ctrl_seg_imm,
        offset_of!(mlx5_wqe_ctrl_seg, imm)
    );
}

#[test]
fn other_wqe_structs_match_c() {
    check!(mlx5dv_sys_abi_data_seg_size, size_of::<mlx5_wqe_data_seg>());
    check!(
        mlx5dv_sys_abi_raddr_seg_size,
        size_of::<mlx5_wqe_raddr_seg>()
    );
    check!(
        mlx5dv_sys_abi_atomic_seg_size,
        size_of::<mlx5_wqe_atomic_seg>()
    );
    check!(mlx5dv_sys_abi_cqe64_size, size_of::<mlx5_cqe64>());
    check!(mlx5dv_sys_abi_qp_size, size_of::<mlx5dv_qp>());
    // `mlx5dv_init_obj` only writes the members whose type bit is requested; newer
    // headers append members (rdma-core 65 does), so C may be larger, never smaller.
    // SAFETY: a `const` object defined in abi_check.c.
    let c_obj = unsafe { mlx5dv_sys_abi_obj_size };
    assert!(
        c_obj >= size_of::<mlx5dv_obj>(),
        "mlx5dv_obj shrank: C {c_obj}, Rust {}",
        size_of::<mlx5dv_obj>()
    );
}

/// The shim's `mlx5dv_set_ctrl_seg` writes the hand-written struct exactly as C does.
#[test]
fn set_ctrl_seg_through_shim_matches_c() {
    let mut from_c = mlx5_wqe_ctrl_seg::default();
    let mut from_rust = mlx5_wqe_ctrl_seg::default();
    // SAFETY: both point to a valid, writable `mlx5_wqe_ctrl_seg`.
    unsafe {
        mlx5dv_sys_abi_fill_ctrl_seg(&mut from_c);
        mlx5dv_set_ctrl_seg(
            &mut from_rust,
            0x1234,
            MLX5_OPCODE_RDMA_WRITE as u8,
            0x5a,
            0xabcdef,
            MLX5_WQE_CTRL_CQ_UPDATE as u8,
            3,
            0x77,
            0x01020304,
        );
    }
    assert_eq!(from_c, from_rust);
    // Field-level decode: opcode 0x08 (RDMA WRITE), index 0x1234, opmod 0x5a.
    assert_eq!(u32::from_be(from_rust.opmod_idx_opcode), 0x5a12_3408);
    assert_eq!(u32::from_be(from_rust.qpn_ds), (0xabcdef << 8) | 3);
    assert_eq!(from_rust.signature, 0x77);
    assert_eq!(from_rust.fm_ce_se, MLX5_WQE_CTRL_CQ_UPDATE as u8);
    assert_eq!(from_rust.imm, 0x01020304);
}

/// Every listed entry point links (the DEVX family and the object accessors).
#[test]
fn devx_and_dv_entry_points_link() {
    let fns: &[*const ()] = &[
        mlx5dv_query_device as *const (),
        mlx5dv_init_obj as *const (),
        mlx5dv_create_qp as *const (),
        mlx5dv_create_cq as *const (),
        mlx5dv_devx_obj_create as *const (),
        mlx5dv_devx_obj_modify as *const (),
        mlx5dv_devx_obj_query as *const (),
        mlx5dv_devx_obj_destroy as *const (),
        mlx5dv_devx_umem_reg as *const (),
        mlx5dv_devx_umem_reg_ex as *const (),
        mlx5dv_devx_umem_dereg as *const (),
        mlx5dv_devx_alloc_uar as *const (),
        mlx5dv_devx_free_uar as *const (),
        mlx5dv_devx_general_cmd as *const (),
        mlx5dv_devx_query_eqn as *const (),
        mlx5dv_is_supported as *const (),
        mlx5dv_set_data_seg as *const (),
        mlx5dv_set_ctrl_seg as *const (),
    ];
    assert!(fns.iter().all(|f| !f.is_null()));
}

/// Without an RDMA subsystem no device is an mlx5 device, and asking does not crash.
#[test]
fn is_supported_on_host() {
    let mut n = 0;
    // SAFETY: valid out-pointer; the list is freed below.
    let list = unsafe { ibverbs_sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return; // ENOSYS: no RDMA subsystem, nothing to ask about.
    }
    for i in 0..n as usize {
        // SAFETY: `list` has `n` entries; mlx5dv_is_supported only reads the device.
        let _ = unsafe { mlx5dv_is_supported(*list.add(i)) };
    }
    // SAFETY: freed once.
    unsafe { ibverbs_sys::ibv_free_device_list(list) };
}
