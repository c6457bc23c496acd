//! ABI check of the hand-written items: values compiled from the real headers by
//! `abi_check.c` (build.rs) compared with the Rust side. The generated structs carry
//! bindgen's own compile-time layout asserts.

use core::mem::{offset_of, size_of};
use ibverbs_sys::*;

macro_rules! c_values {
    ($($name:ident: $ty:ty),* $(,)?) => {
        extern "C" { $(static $name: $ty;)* }
    };
}

c_values! {
    ibverbs_sys_abi_IBV_QPF_GRH_REQUIRED: u64,
    ibverbs_sys_abi_IBV_ACCESS_OPTIONAL_RANGE: u64,
    ibverbs_sys_abi_IBV_ACCESS_OPTIONAL_FIRST: u64,
    ibverbs_sys_abi_IBV_ADVISE_MR_ADVICE_PREFETCH: u64,
    ibverbs_sys_abi_IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE: u64,
    ibverbs_sys_abi_IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT: u64,
    ibverbs_sys_abi_IBV_ADVISE_MR_FLAG_FLUSH: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_KEYMAT_AES_GCM: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_IV_ALGO_SEQ: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_REPLAY_NONE: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_REPLAY_BMP: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_INLINE_CRYPTO: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_FULL_OFFLOAD: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_TUNNEL: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_TRANSPORT: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_DECRYPT: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_ENCRYPT: u64,
    ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_ESN_NEW_WINDOW: u64,
    ibverbs_sys_abi_port_attr_size: usize,
    ibverbs_sys_abi_port_attr_link_layer: usize,
    ibverbs_sys_abi_wc_size: usize,
    ibverbs_sys_abi_wc_wc_flags: usize,
    ibverbs_sys_abi_send_wr_size: usize,
    ibverbs_sys_abi_qp_attr_size: usize,
    ibverbs_sys_abi_context_size: usize,
}

macro_rules! check {
    ($c:ident, $rust:expr) => {
        // SAFETY: the static is a `const` object defined in abi_check.c.
        let c = unsafe { $c } as u64;
        assert_eq!(
            c,
            $rust as u64,
            "{} differs between C and Rust",
            stringify!($c)
        );
    };
}

#[test]
fn verbs_api_aliases_match_c() {
    check!(ibverbs_sys_abi_IBV_QPF_GRH_REQUIRED, IBV_QPF_GRH_REQUIRED);
    check!(
        ibverbs_sys_abi_IBV_ACCESS_OPTIONAL_RANGE,
        IBV_ACCESS_OPTIONAL_RANGE
    );
    check!(
        ibverbs_sys_abi_IBV_ACCESS_OPTIONAL_FIRST,
        IBV_ACCESS_OPTIONAL_FIRST
    );
    check!(
        ibverbs_sys_abi_IBV_ADVISE_MR_ADVICE_PREFETCH,
        IBV_ADVISE_MR_ADVICE_PREFETCH
    );
    check!(
        ibverbs_sys_abi_IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE,
        IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE
    );
    check!(
        ibverbs_sys_abi_IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT,
        IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT
    );
    check!(
        ibverbs_sys_abi_IBV_ADVISE_MR_FLAG_FLUSH,
        IBV_ADVISE_MR_FLAG_FLUSH
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_KEYMAT_AES_GCM,
        IBV_FLOW_ACTION_ESP_KEYMAT_AES_GCM
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_IV_ALGO_SEQ,
        IBV_FLOW_ACTION_IV_ALGO_SEQ
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_REPLAY_NONE,
        IBV_FLOW_ACTION_ESP_REPLAY_NONE
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_REPLAY_BMP,
        IBV_FLOW_ACTION_ESP_REPLAY_BMP
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_INLINE_CRYPTO,
        IBV_FLOW_ACTION_ESP_FLAGS_INLINE_CRYPTO
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_FULL_OFFLOAD,
        IBV_FLOW_ACTION_ESP_FLAGS_FULL_OFFLOAD
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_TUNNEL,
        IBV_FLOW_ACTION_ESP_FLAGS_TUNNEL
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_TRANSPORT,
        IBV_FLOW_ACTION_ESP_FLAGS_TRANSPORT
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_DECRYPT,
        IBV_FLOW_ACTION_ESP_FLAGS_DECRYPT
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_ENCRYPT,
        IBV_FLOW_ACTION_ESP_FLAGS_ENCRYPT
    );
    check!(
        ibverbs_sys_abi_IBV_FLOW_ACTION_ESP_FLAGS_ESN_NEW_WINDOW,
        IBV_FLOW_ACTION_ESP_FLAGS_ESN_NEW_WINDOW
    );
}

#[test]
fn struct_layouts_match_c() {
    // Filled by the library with the size we pass (`ibv_query_port` in lib.rs): newer
    // headers may append fields (rdma-core 50 added `active_speed_ex`), never move them.
    // SAFETY: a `const` object defined in abi_check.c.
    let c_port_attr = unsafe { ibverbs_sys_abi_port_attr_size };
    assert!(
        c_port_attr >= size_of::<ibv_port_attr>(),
        "ibv_port_attr shrank: C {c_port_attr}, Rust {}",
        size_of::<ibv_port_attr>()
    );
    check!(
        ibverbs_sys_abi_port_attr_link_layer,
        offset_of!(ibv_port_attr, link_layer)
    );
    check!(ibverbs_sys_abi_wc_size, size_of::<ibv_wc>());
    check!(ibverbs_sys_abi_wc_wc_flags, offset_of!(ibv_wc, wc_flags));
    check!(ibverbs_sys_abi_send_wr_size, size_of::<ibv_send_wr>());
    check!(ibverbs_sys_abi_qp_attr_size, size_of::<ibv_qp_attr>());
    check!(ibverbs_sys_abi_context_size, size_of::<ibv_context>());
}

/// Every static inline function is reachable: the shim's `__extern` symbols link.
#[test]
fn static_inline_shim_links() {
    let fns: &[*const ()] = &[
        ibv_query_port as *const (),
        ibv_post_send as *const (),
        ibv_post_recv as *const (),
        ibv_post_srq_recv as *const (),
        ibv_poll_cq as *const (),
        ibv_req_notify_cq as *const (),
        ibv_query_device_ex as *const (),
        ibv_create_cq_ex as *const (),
        ibv_start_poll as *const (),
        ibv_next_poll as *const (),
        ibv_end_poll as *const (),
        ibv_wc_read_opcode as *const (),
        ibv_wr_start as *const (),
        ibv_wr_rdma_write as *const (),
        ibv_wr_set_sge as *const (),
        ibv_wr_complete as *const (),
        ibv_qp_to_qp_ex as *const (),
        ibv_query_gid_ex as *const (),
        ibv_query_gid_table as *const (),
        ibv_create_qp_ex as *const (),
        ibv_alloc_mw as *const (),
        ibv_bind_mw as *const (),
        ibv_reg_dmabuf_mr as *const (),
        ibv_reg_mr as *const (),
        ibv_reg_mr_iova as *const (),
        ibv_create_comp_channel as *const (),
        ibv_get_cq_event as *const (),
    ];
    assert!(fns.iter().all(|f| !f.is_null()));
}
