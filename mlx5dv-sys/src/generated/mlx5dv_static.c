#include "wrapper.h"

// Static wrappers

void mlx5dv_wr_set_dc_addr__extern(struct mlx5dv_qp_ex *mqp, struct ibv_ah *ah, uint32_t remote_dctn, uint64_t remote_dc_key) { mlx5dv_wr_set_dc_addr(mqp, ah, remote_dctn, remote_dc_key); }
void mlx5dv_wr_set_dc_addr_stream__extern(struct mlx5dv_qp_ex *mqp, struct ibv_ah *ah, uint32_t remote_dctn, uint64_t remote_dc_key, uint16_t stream_id) { mlx5dv_wr_set_dc_addr_stream(mqp, ah, remote_dctn, remote_dc_key, stream_id); }
void mlx5dv_wr_mr_interleaved__extern(struct mlx5dv_qp_ex *mqp, struct mlx5dv_mkey *mkey, uint32_t access_flags, uint32_t repeat_count, uint16_t num_interleaved, struct mlx5dv_mr_interleaved *data) { mlx5dv_wr_mr_interleaved(mqp, mkey, access_flags, repeat_count, num_interleaved, data); }
void mlx5dv_wr_mr_list__extern(struct mlx5dv_qp_ex *mqp, struct mlx5dv_mkey *mkey, uint32_t access_flags, uint16_t num_sges, struct ibv_sge *sge) { mlx5dv_wr_mr_list(mqp, mkey, access_flags, num_sges, sge); }
void mlx5dv_wr_mkey_configure__extern(struct mlx5dv_qp_ex *mqp, struct mlx5dv_mkey *mkey, uint8_t num_setters, struct mlx5dv_mkey_conf_attr *attr) { mlx5dv_wr_mkey_configure(mqp, mkey, num_setters, attr); }
void mlx5dv_wr_set_mkey_access_flags__extern(struct mlx5dv_qp_ex *mqp, uint32_t access_flags) { mlx5dv_wr_set_mkey_access_flags(mqp, access_flags); }
void mlx5dv_wr_set_mkey_layout_list__extern(struct mlx5dv_qp_ex *mqp, uint16_t num_sges, const struct ibv_sge *sge) { mlx5dv_wr_set_mkey_layout_list(mqp, num_sges, sge); }
void mlx5dv_wr_set_mkey_layout_interleaved__extern(struct mlx5dv_qp_ex *mqp, uint32_t repeat_count, uint16_t num_interleaved, const struct mlx5dv_mr_interleaved *data) { mlx5dv_wr_set_mkey_layout_interleaved(mqp, repeat_count, num_interleaved, data); }
void mlx5dv_wr_set_mkey_sig_block__extern(struct mlx5dv_qp_ex *mqp, const struct mlx5dv_sig_block_attr *attr) { mlx5dv_wr_set_mkey_sig_block(mqp, attr); }
void mlx5dv_wr_set_mkey_crypto__extern(struct mlx5dv_qp_ex *mqp, const struct mlx5dv_crypto_attr *attr) { mlx5dv_wr_set_mkey_crypto(mqp, attr); }
void mlx5dv_wr_memcpy__extern(struct mlx5dv_qp_ex *mqp, uint32_t dest_lkey, uint64_t dest_addr, uint32_t src_lkey, uint64_t src_addr, size_t length) { mlx5dv_wr_memcpy(mqp, dest_lkey, dest_addr, src_lkey, src_addr, length); }
void mlx5dv_wr_raw_wqe__extern(struct mlx5dv_qp_ex *mqp, const void *wqe) { mlx5dv_wr_raw_wqe(mqp, wqe); }
uint8_t mlx5dv_get_cqe_owner__extern(struct mlx5_cqe64 *cqe) { return mlx5dv_get_cqe_owner(cqe); }
void mlx5dv_set_cqe_owner__extern(struct mlx5_cqe64 *cqe, uint8_t val) { mlx5dv_set_cqe_owner(cqe, val); }
uint8_t mlx5dv_get_cqe_se__extern(struct mlx5_cqe64 *cqe) { return mlx5dv_get_cqe_se(cqe); }
uint8_t mlx5dv_get_cqe_format__extern(struct mlx5_cqe64 *cqe) { return mlx5dv_get_cqe_format(cqe); }
uint8_t mlx5dv_get_cqe_opcode__extern(struct mlx5_cqe64 *cqe) { return mlx5dv_get_cqe_opcode(cqe); }
void mlx5dv_set_ctrl_seg__extern(struct mlx5_wqe_ctrl_seg *seg, uint16_t pi, uint8_t opcode, uint8_t opmod, uint32_t qp_num, uint8_t fm_ce_se, uint8_t ds, uint8_t signature, uint32_t imm) { mlx5dv_set_ctrl_seg(seg, pi, opcode, opmod, qp_num, fm_ce_se, ds, signature, imm); }
void mlx5dv_set_dgram_seg__extern(struct mlx5_wqe_datagram_seg *seg, uint64_t key, uint32_t dqp_dct, uint8_t ext, uint8_t stat_rate_sl, uint8_t fl_mlid, uint16_t rlid, uint8_t *rmac, uint8_t tclass, uint8_t hop_limit, uint32_t grh_gid_fi, uint8_t *rgid) { mlx5dv_set_dgram_seg(seg, key, dqp_dct, ext, stat_rate_sl, fl_mlid, rlid, rmac, tclass, hop_limit, grh_gid_fi, rgid); }
void mlx5dv_set_data_seg__extern(struct mlx5_wqe_data_seg *seg, uint32_t length, uint32_t lkey, uintptr_t address) { mlx5dv_set_data_seg(seg, length, lkey, address); }
void mlx5dv_set_eth_seg__extern(struct mlx5_wqe_eth_seg *seg, uint8_t cs_flags, uint16_t mss, uint16_t inline_hdr_sz, uint8_t *inline_hdr_start) { mlx5dv_set_eth_seg(seg, cs_flags, mss, inline_hdr_sz, inline_hdr_start); }
uint64_t mlx5dv_ts_to_ns__extern(struct mlx5dv_clock_info *clock_info, uint64_t device_timestamp) { return mlx5dv_ts_to_ns(clock_info, device_timestamp); }
void _devx_set__extern(void *p, uint32_t value, size_t bit_off, size_t bit_sz) { _devx_set(p, value, bit_off, bit_sz); }
uint32_t _devx_get__extern(const void *p, size_t bit_off, size_t bit_sz) { return _devx_get(p, bit_off, bit_sz); }
void _devx_set64__extern(void *p, uint64_t v, size_t bit_off) { _devx_set64(p, v, bit_off); }
uint64_t _devx_get64__extern(const void *p, size_t bit_off) { return _devx_get64(p, bit_off); }
