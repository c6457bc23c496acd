/* Values the Rust ABI test (tests/abi.rs) compares with the hand-written items of
 * src/lib.rs: the macro aliases of infiniband/verbs_api.h and the port attribute
 * layouts behind the `ibv_query_port` macro. */
#include <stddef.h>
#include "wrapper.h"

const unsigned long long ibverbs_sys_abi_IBV_QPF_GRH_REQUIRED = IBV_QPF_GRH_REQUIRED;
const unsigned long long ibverbs_sys_abi_IBV_ACCESS_OPTIONAL_RANGE = IBV_ACCESS_OPTIONAL_RANGE;
const unsigned long long ibverbs_sys_abi_IBV_ACCESS_OPTIONAL_FIRST = IBV_ACCESS_OPTIONAL_FIRST;
const unsigned long long ibverbs_sys_abi_IBV_ADVISE_MR_ADVICE_PREFETCH = IBV_ADVISE_MR_ADVICE_PREFETCH;
const unsigned long long ibverbs_sys_abi_IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE = IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE;
const unsigned long long ibverbs_sys_abi_IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT = IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT;
const unsigned long long ibverbs_sys_abi_IBV_ADVISE_MR_FLAG_FLUSH = IBV_ADVISE_MR_FLAG_FLUSH;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_KEYMAT_AES_GCM = IBV_FLOW_ACTION_ESP_KEYMAT_AES_GCM;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_IV_ALGO_SEQ = IBV_FLOW_ACTION_IV_ALGO_SEQ;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_REPLAY_NONE = IBV_FLOW_ACTION_ESP_REPLAY_NONE;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_REPLAY_BMP = IBV_FLOW_ACTION_ESP_REPLAY_BMP;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_INLINE_CRYPTO = IBV_FLOW_ACTION_ESP_FLAGS_INLINE_CRYPTO;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_FULL_OFFLOAD = IBV_FLOW_ACTION_ESP_FLAGS_FULL_OFFLOAD;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_TUNNEL = IBV_FLOW_ACTION_ESP_FLAGS_TUNNEL;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_TRANSPORT = IBV_FLOW_ACTION_ESP_FLAGS_TRANSPORT;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_DECRYPT = IBV_FLOW_ACTION_ESP_FLAGS_DECRYPT;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_ENCRYPT = IBV_FLOW_ACTION_ESP_FLAGS_ENCRYPT;
const unsigned long long ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_ESN_NEW_WINDOW = IBV_FLOW_ACTION_ESP_FLAGS_ESN_NEW_WINDOW;

const size_t ibverbs_sys_abi_port_attr_size = sizeof(struct ibv_port_attr);
const size_t ibverbs_sys_abi_port_attr_link_layer = offsetof(struct ibv_port_attr, link_layer);
const size_t ibverbs_sys_abi_wc_size = sizeof(struct ibv_wc);
const size_t ibverbs_sys_abi_wc_wc_flags = offsetof(struct ibv_wc, wc_flags);
const size_t ibverbs_sys_abi_send_wr_size = sizeof(struct ibv_send_wr);
const size_t ibverbs_sys_abi_qp_attr_size = sizeof(struct ibv_qp_attr);
const size_t ibverbs_sys_abi_context_size = sizeof(struct ibv_context);
