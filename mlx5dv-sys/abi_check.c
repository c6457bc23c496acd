/* Layout of the hand-written `mlx5_wqe_ctrl_seg` and the values of the WQE macros,
 * compiled from the real header; tests/abi.rs compares them with the Rust side. */
#include <stddef.h>
#include "wrapper.h"

const size_t mlx5dv_sys_abi_ctrl_seg_size = sizeof(struct mlx5_wqe_ctrl_seg);
const size_t mlx5dv_sys_abi_ctrl_seg_align = _Alignof(struct mlx5_wqe_ctrl_seg);
const size_t mlx5dv_sys_abi_ctrl_seg_opmod_idx_opcode = offsetof(struct mlx5_wqe_ctrl_seg, opmod_idx_opcode);
const size_t mlx5dv_sys_abi_ctrl_seg_qpn_ds = offsetof(struct mlx5_wqe_ctrl_seg, qpn_ds);
const size_t mlx5dv_sys_abi_ctrl_seg_signature = offsetof(struct mlx5_wqe_ctrl_seg, signature);
const size_t mlx5dv_sys_abi_ctrl_seg_dci_stream_channel_id = offsetof(struct mlx5_wqe_ctrl_seg, dci_stream_channel_id);
const size_t mlx5dv_sys_abi_ctrl_seg_fm_ce_se = offsetof(struct mlx5_wqe_ctrl_seg, fm_ce_se);
const size_t mlx5dv_sys_abi_ctrl_seg_imm = offsetof(struct mlx5_wqe_ctrl_seg, imm);
const size_t mlx5dv_sys_abi_data_seg_size = sizeof(struct mlx5_wqe_data_seg);
const size_t mlx5dv_sys_abi_raddr_seg_size = sizeof(struct mlx5_wqe_raddr_seg);
const size_t mlx5dv_sys_abi_atomic_seg_size = sizeof(struct mlx5_wqe_atomic_seg);
const size_t mlx5dv_sys_abi_cqe64_size = sizeof(struct mlx5_cqe64);
const size_t mlx5dv_sys_abi_qp_size = sizeof(struct mlx5dv_qp);
const size_t mlx5dv_sys_abi_obj_size = sizeof(struct mlx5dv_obj);

/* mlx5dv_set_ctrl_seg() on a known input: the Rust test fills the hand-written struct
 * through the shim and compares bytes with this one. */
void mlx5dv_sys_abi_fill_ctrl_seg(struct mlx5_wqe_ctrl_seg *seg)
{
	mlx5dv_set_ctrl_seg(seg, 0x1234, MLX5_OPCODE_RDMA_WRITE, 0x5a, 0xabcdef, MLX5_WQE_CTRL_CQ_UPDATE, 3, 0x77, 0x01020304);
}
