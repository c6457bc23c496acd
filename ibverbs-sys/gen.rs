//! The bindgen configuration of `ibverbs-sys`, in one place.
//!
//! Used by `build.rs` (feature `bindgen`: generate into `OUT_DIR`) and by
//! `cargo xtask bindgen` (rewrites `src/generated/`). It may use only `bindgen` and `std`.
//!
//! Files written into `out_dir`:
//! - `verbs.rs`, `verbs_static.c`: `infiniband/verbs.h` and the shim for its static
//!   inline functions (`ibv_post_send`, `ibv_poll_cq`, `ibv_wr_*`, ...).
//! - `rdmacm.rs`, `rdmacm_static.c`: `rdma/rdma_cma.h` + `rdma/rdma_verbs.h`, generated
//!   without recursion so that every verbs type (`ibv_qp`, ...) is the one of `verbs.rs`.

use std::error::Error;
use std::path::{Path, PathBuf};

/// Generate every binding file of the crate into `out_dir`.
///
/// `crate_dir` is the `ibverbs-sys` folder (it holds `wrapper.h` and `rdmacm_wrapper.h`),
/// `include_dirs` the include directories of libibverbs/librdmacm (may be empty: the
/// compiler's default search path is used).
pub fn generate(
    crate_dir: &Path,
    include_dirs: &[PathBuf],
    out_dir: &Path,
) -> Result<(), Box<dyn Error>> {
    std::fs::create_dir_all(out_dir)?;
    generate_one(crate_dir, include_dirs, out_dir, Part::Verbs)?;
    generate_one(crate_dir, include_dirs, out_dir, Part::RdmaCm)?;
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum Part {
    Verbs,
    RdmaCm,
}

impl Part {
    fn header(self) -> &'static str {
        match self {
            Part::Verbs => "wrapper.h",
            Part::RdmaCm => "rdmacm_wrapper.h",
        }
    }
    fn stem(self) -> &'static str {
        match self {
            Part::Verbs => "verbs",
            Part::RdmaCm => "rdmacm",
        }
    }
}

fn generate_one(
    crate_dir: &Path,
    include_dirs: &[PathBuf],
    out_dir: &Path,
    part: Part,
) -> Result<(), Box<dyn Error>> {
    let header = crate_dir.join(part.header());
    let shim_stem = out_dir.join(format!("{}_static", part.stem()));
    let mut builder = bindgen::Builder::default()
        .header(header.to_str().ok_or("non-UTF-8 crate path")?)
        .clang_args(include_dirs.iter().map(|d| format!("-I{}", d.display())))
        .rust_target(bindgen::RustTarget::stable(82, 0).map_err(|e| e.to_string())?)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .translate_enum_integer_types(true)
        .derive_default(true)
        .derive_debug(true)
        .impl_debug(false)
        .layout_tests(true)
        .generate_comments(true)
        .sort_semantically(true)
        .merge_extern_blocks(true)
        .size_t_is_usize(true)
        .use_core()
        .wrap_unsafe_ops(true)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&shim_stem)
        .raw_line("#[allow(unused_imports)]")
        .raw_line("use core::ffi::*;");
    match part {
        Part::Verbs => {
            builder = builder
                .allowlist_file(r".*/infiniband/verbs\.h")
                .allowlist_file(r".*/infiniband/verbs_api\.h")
                .allowlist_file(r".*/infiniband/ib_user_ioctl_verbs\.h")
                .allowlist_file(r".*/rdma/ib_user_ioctl_verbs\.h")
                // The symbol takes the old `_compat_ibv_port_attr`; the header's macro
                // routes every call to the static inline `___ibv_query_port`, which lib.rs
                // re-exports under the name `ibv_query_port`.
                .blocklist_function("ibv_query_port")
                // These static inlines pass `sizeof(*attr)` of the headers they are compiled
                // against: with newer headers than the committed bindings (rdma-core 50
                // grew `ibv_port_attr`) the library would write past the Rust struct.
                // lib.rs defines them with the Rust size instead (sized_shims.c).
                .blocklist_function("___ibv_query_port")
                .blocklist_function("ibv_query_device_ex")
                .blocklist_function("ibv_query_gid_ex")
                .blocklist_function("ibv_query_gid_table")
                // `__ibv_reg_mr*` only re-dispatch on `__builtin_constant_p`; the exported
                // symbols `ibv_reg_mr`/`ibv_reg_mr_iova` are the ones to call from Rust.
                .blocklist_function("__ibv_reg_mr")
                .blocklist_function("__ibv_reg_mr_iova")
                // Only defined under RDMA_STATIC_PROVIDERS.
                .blocklist_function("__ibv_get_device_list")
                // C helpers that are not part of the verbs API (byte order, memcpy).
                .blocklist_function("__bswap_.*")
                .blocklist_function("__uint.*_identity");
        }
        Part::RdmaCm => {
            builder = builder
                .allowlist_recursively(false)
                .parse_callbacks(Box::new(RdmaCmCallbacks))
                .allowlist_file(r".*/rdma/rdma_cma\.h")
                .allowlist_file(r".*/rdma/rdma_verbs\.h")
                .allowlist_file(r".*/infiniband/sa\.h")
                .allowlist_file(r".*/infiniband/ib\.h")
                .raw_line("#[allow(unused_imports)]")
                .raw_line("use crate::*;")
                .raw_line("#[allow(unused_imports)]")
                .raw_line("use libc::{sa_family_t, sockaddr, sockaddr_in, sockaddr_in6, sockaddr_storage, socklen_t};");
        }
    }
    let bindings = builder
        .generate()
        .map_err(|e| format!("bindgen ({}): {e}", part.stem()))?;
    bindings.write_to_file(out_dir.join(format!("{}.rs", part.stem())))?;
    fix_shim(&shim_stem.with_extension("c"), &header, part.header())?;
    Ok(())
}

/// Callbacks for the non-recursive rdma_cm generation.
#[derive(Debug)]
struct RdmaCmCallbacks;

impl bindgen::callbacks::ParseCallbacks for RdmaCmCallbacks {
    /// Anonymous enums get their own prefix so that they never collide with the
    /// `_bindgen_ty_N` of `verbs.rs` when both are glob-re-exported.
    fn item_name(&self, item: bindgen::callbacks::ItemInfo<'_>) -> Option<String> {
        item.name
            .strip_prefix("_bindgen_ty_")
            .map(|n| format!("_rdmacm_anon_{n}"))
    }

    /// Types defined elsewhere (the verbs types of `verbs.rs`, libc's socket types):
    /// all are `Copy`; the verbs ones also implement `Default` (bindgen's
    /// `derive_default`); none is assumed to implement `Debug` (unions do not).
    fn blocklisted_type_implements_trait(
        &self,
        name: &str,
        derive_trait: bindgen::callbacks::DeriveTrait,
    ) -> Option<bindgen::callbacks::ImplementsTrait> {
        use bindgen::callbacks::{DeriveTrait, ImplementsTrait};
        let libc = name.starts_with("sockaddr")
            || name.starts_with("in_")
            || name.starts_with("in6_")
            || name == "sa_family_t"
            || name == "socklen_t";
        match derive_trait {
            DeriveTrait::Copy => Some(ImplementsTrait::Yes),
            DeriveTrait::Default if !libc => Some(ImplementsTrait::Yes),
            _ => Some(ImplementsTrait::No),
        }
    }
}

/// Make the generated shim include its header by relative name (and so be the same file
/// on every machine): build.rs compiles it with `-I<crate dir>`.
fn fix_shim(shim: &Path, header: &Path, name: &str) -> Result<(), Box<dyn Error>> {
    let text = std::fs::read_to_string(shim)?;
    let absolute = format!("#include \"{}\"", header.display());
    if !text.contains(&absolute) {
        return Err(format!("{}: no `{absolute}` line to rewrite", shim.display()).into());
    }
    let text = text.replace(&absolute, &format!("#include \"{name}\""));
    std::fs::write(shim, text)?;
    Ok(())
}
