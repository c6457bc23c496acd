//! The hand-written macros and constants, and a few generated constants and struct
//! layouts, compared with what the C compiler computes from the real headers
//! (`csrc/abi_check.c`, compiled by the build script).

use core::ffi::c_int;
use libfabric_sys as ffi;

extern "C" {
    static libfabric_sys_abi_version_1_17: u32;
    static libfabric_sys_abi_version_2_0: u32;
    static libfabric_sys_abi_version_header: u32;
    static libfabric_sys_abi_major_3_21: u32;
    static libfabric_sys_abi_minor_3_21: u32;
    static libfabric_sys_abi_ge_1_18_1_17: c_int;
    static libfabric_sys_abi_ge_1_17_1_17: c_int;
    static libfabric_sys_abi_lt_1_17_1_18: c_int;
    static libfabric_sys_abi_lt_2_0_1_18: c_int;
    static libfabric_sys_abi_addr_unspec: u64;
    static libfabric_sys_abi_addr_notavail: u64;
    static libfabric_sys_abi_key_notavail: u64;
    static libfabric_sys_abi_shared_context: usize;
    static libfabric_sys_abi_eagain: c_int;
    static libfabric_sys_abi_eavail: c_int;
    static libfabric_sys_abi_eopnotsupp: c_int;
    static libfabric_sys_abi_etrunc: c_int;
    static libfabric_sys_abi_msg: u64;
    static libfabric_sys_abi_rma: u64;
    static libfabric_sys_abi_remote_cq_data: u64;
    static libfabric_sys_abi_more: u64;
    static libfabric_sys_abi_hmem: u64;
    static libfabric_sys_abi_context: u64;
    static libfabric_sys_abi_mr_local: c_int;
    static libfabric_sys_abi_mr_virt_addr: c_int;
    static libfabric_sys_abi_mr_prov_key: c_int;
    static libfabric_sys_abi_mr_endpoint: c_int;
    static libfabric_sys_abi_mr_hmem: c_int;
    static libfabric_sys_abi_ep_rdm: u32;
    static libfabric_sys_abi_connected: u32;
    static libfabric_sys_abi_sizeof_fi_info: usize;
    static libfabric_sys_abi_sizeof_fi_domain_attr: usize;
    static libfabric_sys_abi_sizeof_fi_ep_attr: usize;
    static libfabric_sys_abi_sizeof_fi_cq_data_entry: usize;
    static libfabric_sys_abi_sizeof_fi_cq_err_entry: usize;
    static libfabric_sys_abi_sizeof_fi_mr_attr: usize;
    static libfabric_sys_abi_sizeof_fi_context2: usize;
    static libfabric_sys_abi_offsetof_fi_info_domain_attr: usize;
    static libfabric_sys_abi_offsetof_fi_cq_data_entry_data: usize;
}

/// Read a C constant (a plain `const` object in the shim library).
macro_rules! c {
    ($name:ident) => {
        // SAFETY: an immutable, initialised C object defined in csrc/abi_check.c.
        unsafe { $name }
    };
}

#[test]
fn version_macros_match_c() {
    assert_eq!(ffi::FI_VERSION(1, 17), c!(libfabric_sys_abi_version_1_17));
    assert_eq!(ffi::FI_VERSION(2, 0), c!(libfabric_sys_abi_version_2_0));
    assert_eq!(
        ffi::FI_MAJOR(ffi::FI_VERSION(3, 21)),
        c!(libfabric_sys_abi_major_3_21)
    );
    assert_eq!(
        ffi::FI_MINOR(ffi::FI_VERSION(3, 21)),
        c!(libfabric_sys_abi_minor_3_21)
    );
    assert_eq!(
        ffi::FI_VERSION_GE(ffi::FI_VERSION(1, 18), ffi::FI_VERSION(1, 17)),
        c!(libfabric_sys_abi_ge_1_18_1_17) != 0
    );
    assert_eq!(
        ffi::FI_VERSION_GE(ffi::FI_VERSION(1, 17), ffi::FI_VERSION(1, 17)),
        c!(libfabric_sys_abi_ge_1_17_1_17) != 0
    );
    assert_eq!(
        ffi::FI_VERSION_LT(ffi::FI_VERSION(1, 17), ffi::FI_VERSION(1, 18)),
        c!(libfabric_sys_abi_lt_1_17_1_18) != 0
    );
    assert_eq!(
        ffi::FI_VERSION_LT(ffi::FI_VERSION(2, 0), ffi::FI_VERSION(1, 18)),
        c!(libfabric_sys_abi_lt_2_0_1_18) != 0
    );
}

#[test]
fn headers_are_not_older_than_the_bindings() {
    // Built against newer headers, the committed (1.17) bindings stay valid: libfabric
    // only appends. Older headers than the bindings would not be.
    assert!(c!(libfabric_sys_abi_version_header) >= ffi::FI_VERSION_BINDINGS);
}

#[test]
fn hand_written_constants_match_c() {
    assert_eq!(ffi::FI_ADDR_UNSPEC, c!(libfabric_sys_abi_addr_unspec));
    assert_eq!(ffi::FI_ADDR_NOTAVAIL, c!(libfabric_sys_abi_addr_notavail));
    assert_eq!(ffi::FI_KEY_NOTAVAIL, c!(libfabric_sys_abi_key_notavail));
    assert_eq!(ffi::FI_SHARED_CONTEXT, c!(libfabric_sys_abi_shared_context));
}

#[test]
fn generated_constants_match_c() {
    assert_eq!(ffi::FI_EAGAIN, c!(libfabric_sys_abi_eagain));
    assert_eq!(ffi::FI_EAVAIL, c!(libfabric_sys_abi_eavail));
    assert_eq!(ffi::FI_EOPNOTSUPP, c!(libfabric_sys_abi_eopnotsupp));
    assert_eq!(ffi::FI_ETRUNC, c!(libfabric_sys_abi_etrunc));
    assert_eq!(ffi::FI_MSG, c!(libfabric_sys_abi_msg));
    assert_eq!(ffi::FI_RMA, c!(libfabric_sys_abi_rma));
    assert_eq!(ffi::FI_REMOTE_CQ_DATA, c!(libfabric_sys_abi_remote_cq_data));
    assert_eq!(ffi::FI_MORE, c!(libfabric_sys_abi_more));
    assert_eq!(ffi::FI_HMEM, c!(libfabric_sys_abi_hmem));
    assert_eq!(ffi::FI_CONTEXT, c!(libfabric_sys_abi_context));
    assert_eq!(ffi::FI_MR_LOCAL, c!(libfabric_sys_abi_mr_local));
    assert_eq!(ffi::FI_MR_VIRT_ADDR, c!(libfabric_sys_abi_mr_virt_addr));
    assert_eq!(ffi::FI_MR_PROV_KEY, c!(libfabric_sys_abi_mr_prov_key));
    assert_eq!(ffi::FI_MR_ENDPOINT, c!(libfabric_sys_abi_mr_endpoint));
    assert_eq!(ffi::FI_MR_HMEM, c!(libfabric_sys_abi_mr_hmem));
    assert_eq!(ffi::FI_EP_RDM, c!(libfabric_sys_abi_ep_rdm));
    assert_eq!(ffi::FI_CONNECTED, c!(libfabric_sys_abi_connected));
}

/// Same header version as the bindings: identical sizes. Newer headers (the committed
/// 1.17 bindings built against 1.2x/2.x): libfabric only appends fields, so the C struct
/// may be larger but the fields bound here keep their offsets; the library keeps the old
/// layout for callers that pass `FI_VERSION_BINDINGS` to `fi_getinfo`.
fn assert_size(name: &str, rust: usize, c: usize) {
    // SAFETY: an immutable, initialised C object defined in csrc/abi_check.c.
    let header = unsafe { libfabric_sys_abi_version_header };
    if header == ffi::FI_VERSION_BINDINGS {
        assert_eq!(rust, c, "sizeof(struct {name})");
    } else {
        assert!(rust <= c, "sizeof(struct {name}): Rust {rust} > C {c}");
    }
}

#[test]
fn struct_layouts_match_c() {
    use core::mem::{offset_of, size_of};
    assert_size(
        "fi_info",
        size_of::<ffi::fi_info>(),
        c!(libfabric_sys_abi_sizeof_fi_info),
    );
    assert_size(
        "fi_domain_attr",
        size_of::<ffi::fi_domain_attr>(),
        c!(libfabric_sys_abi_sizeof_fi_domain_attr),
    );
    assert_size(
        "fi_ep_attr",
        size_of::<ffi::fi_ep_attr>(),
        c!(libfabric_sys_abi_sizeof_fi_ep_attr),
    );
    assert_size(
        "fi_cq_data_entry",
        size_of::<ffi::fi_cq_data_entry>(),
        c!(libfabric_sys_abi_sizeof_fi_cq_data_entry),
    );
    assert_size(
        "fi_cq_err_entry",
        size_of::<ffi::fi_cq_err_entry>(),
        c!(libfabric_sys_abi_sizeof_fi_cq_err_entry),
    );
    assert_size(
        "fi_mr_attr",
        size_of::<ffi::fi_mr_attr>(),
        c!(libfabric_sys_abi_sizeof_fi_mr_attr),
    );
    assert_eq!(
        size_of::<ffi::fi_context2>(),
        c!(libfabric_sys_abi_sizeof_fi_context2)
    );
    assert_eq!(
        offset_of!(ffi::fi_info, domain_attr),
        c!(libfabric_sys_abi_offsetof_fi_info_domain_attr)
    );
    assert_eq!(
        offset_of!(ffi::fi_cq_data_entry, data),
        c!(libfabric_sys_abi_offsetof_fi_cq_data_entry_data)
    );
}

#[test]
fn runtime_library_is_supported() {
    // SAFETY: fi_version has no preconditions.
    let runtime = unsafe { ffi::fi_version() };
    assert!(
        ffi::FI_VERSION_GE(runtime, ffi::FI_VERSION(1, 17)),
        "libfabric runtime {}.{} is older than 1.17",
        ffi::FI_MAJOR(runtime),
        ffi::FI_MINOR(runtime)
    );
}
