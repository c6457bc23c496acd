/*
 * ABI check: the values of libfabric's function-like macros, of the constants
 * libfabric-sys writes by hand, and of a few constants and sizes bindgen produced,
 * computed by the C compiler from the real headers. tests/abi.rs compares them
 * with the Rust side.
 */
#include <stddef.h>
#include <stdint.h>
#include "wrapper.h"

const uint32_t libfabric_sys_abi_version_1_17 = FI_VERSION(1, 17);
const uint32_t libfabric_sys_abi_version_2_0 = FI_VERSION(2, 0);
const uint32_t libfabric_sys_abi_version_header = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
const uint32_t libfabric_sys_abi_major_3_21 = FI_MAJOR(FI_VERSION(3, 21));
const uint32_t libfabric_sys_abi_minor_3_21 = FI_MINOR(FI_VERSION(3, 21));
const int libfabric_sys_abi_ge_1_18_1_17 = FI_VERSION_GE(FI_VERSION(1, 18), FI_VERSION(1, 17));
const int libfabric_sys_abi_ge_1_17_1_17 = FI_VERSION_GE(FI_VERSION(1, 17), FI_VERSION(1, 17));
const int libfabric_sys_abi_lt_1_17_1_18 = FI_VERSION_LT(FI_VERSION(1, 17), FI_VERSION(1, 18));
const int libfabric_sys_abi_lt_2_0_1_18 = FI_VERSION_LT(FI_VERSION(2, 0), FI_VERSION(1, 18));

const uint64_t libfabric_sys_abi_addr_unspec = FI_ADDR_UNSPEC;
const uint64_t libfabric_sys_abi_addr_notavail = FI_ADDR_NOTAVAIL;
const uint64_t libfabric_sys_abi_key_notavail = FI_KEY_NOTAVAIL;
const size_t libfabric_sys_abi_shared_context = FI_SHARED_CONTEXT;

const int libfabric_sys_abi_eagain = FI_EAGAIN;
const int libfabric_sys_abi_eavail = FI_EAVAIL;
const int libfabric_sys_abi_eopnotsupp = FI_EOPNOTSUPP;
const int libfabric_sys_abi_etrunc = FI_ETRUNC;
const uint64_t libfabric_sys_abi_msg = FI_MSG;
const uint64_t libfabric_sys_abi_rma = FI_RMA;
const uint64_t libfabric_sys_abi_remote_cq_data = FI_REMOTE_CQ_DATA;
const uint64_t libfabric_sys_abi_more = FI_MORE;
const uint64_t libfabric_sys_abi_hmem = FI_HMEM;
const uint64_t libfabric_sys_abi_context = FI_CONTEXT;
const int libfabric_sys_abi_mr_local = FI_MR_LOCAL;
const int libfabric_sys_abi_mr_virt_addr = FI_MR_VIRT_ADDR;
const int libfabric_sys_abi_mr_prov_key = FI_MR_PROV_KEY;
const int libfabric_sys_abi_mr_endpoint = FI_MR_ENDPOINT;
const int libfabric_sys_abi_mr_hmem = FI_MR_HMEM;
const uint32_t libfabric_sys_abi_ep_rdm = FI_EP_RDM;
const uint32_t libfabric_sys_abi_connected = FI_CONNECTED;

const size_t libfabric_sys_abi_sizeof_fi_info = sizeof(struct fi_info);
const size_t libfabric_sys_abi_sizeof_fi_domain_attr = sizeof(struct fi_domain_attr);
const size_t libfabric_sys_abi_sizeof_fi_ep_attr = sizeof(struct fi_ep_attr);
const size_t libfabric_sys_abi_sizeof_fi_cq_data_entry = sizeof(struct fi_cq_data_entry);
const size_t libfabric_sys_abi_sizeof_fi_cq_err_entry = sizeof(struct fi_cq_err_entry);
const size_t libfabric_sys_abi_sizeof_fi_mr_attr = sizeof(struct fi_mr_attr);
const size_t libfabric_sys_abi_sizeof_fi_context2 = sizeof(struct fi_context2);
const size_t libfabric_sys_abi_offsetof_fi_info_domain_attr = offsetof(struct fi_info, domain_attr);
const size_t libfabric_sys_abi_offsetof_fi_cq_data_entry_data = offsetof(struct fi_cq_data_entry, data);
