//! The bindgen configuration of `mlx5dv-sys`, in one place.
//!
//! Used by `build.rs` (feature `bindgen`: generate into `OUT_DIR`) and by
//! `cargo xtask bindgen` (rewrites `src/generated/`). It may use only `bindgen` and `std`.
//!
//! Files written into `out_dir`: `mlx5dv.rs` (the items of `infiniband/mlx5dv.h` and
//! `mlx5_api.h`, generated without recursion so that every verbs type is the one of
//! `ibverbs-sys`) and `mlx5dv_static.c` (the shim of the static inline functions:
//! `mlx5dv_set_*_seg`, `mlx5dv_x_*`, `mlx5dv_wr_*`, ...).

use std::error::Error;
use std::path::{Path, PathBuf};

/// Generate every binding file of the crate into `out_dir`.
///
/// `crate_dir` is the `mlx5dv-sys` folder (it holds `wrapper.h`), `include_dirs` the
/// include directories of libmlx5/libibverbs (may be empty).
pub fn generate(
    crate_dir: &Path,
    include_dirs: &[PathBuf],
    out_dir: &Path,
) -> Result<(), Box<dyn Error>> {
    std::fs::create_dir_all(out_dir)?;
    let header = crate_dir.join("wrapper.h");
    let shim_stem = out_dir.join("mlx5dv_static");
    let bindings = bindgen::Builder::default()
        .header(header.to_str().ok_or("non-UTF-8 crate path")?)
        .clang_args(include_dirs.iter().map(|d| format!("-I{}", d.display())))
        .rust_target(bindgen::RustTarget::stable(82, 0).map_err(|e| e.to_string())?)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .translate_enum_integer_types(true)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .generate_comments(true)
        .sort_semantically(true)
        .merge_extern_blocks(true)
        .size_t_is_usize(true)
        .use_core()
        .wrap_unsafe_ops(true)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&shim_stem)
        .allowlist_recursively(false)
        .allowlist_file(r".*/infiniband/mlx5dv\.h")
        .allowlist_file(r".*/infiniband/mlx5_api\.h")
        .allowlist_file(r".*/infiniband/mlx5_user_ioctl_verbs\.h")
        .allowlist_file(r".*/rdma/mlx5_user_ioctl_verbs\.h")
        .allowlist_file(r".*/infiniband/tm_types\.h")
        // `__attribute__((packed, aligned(4)))`: bindgen cannot express both; written by
        // hand in lib.rs and checked against C in tests/abi.rs.
        .blocklist_type("mlx5_wqe_ctrl_seg")
        // Endianness helpers of <endian.h>/<byteswap.h>, not part of the API.
        // Static inlines passing `sizeof(*out)` of the build headers: lib.rs calls the
        // exported `_mlx5dv_*` functions with the Rust size instead.
        .blocklist_function("mlx5dv_query_port")
        .blocklist_function("mlx5dv_mkey_check")
        .blocklist_function("__bswap_.*")
        .blocklist_function("__uint.*_identity")
        .parse_callbacks(Box::new(Callbacks))
        .raw_line("#[allow(unused_imports)]")
        .raw_line("use crate::*;")
        .raw_line("#[allow(unused_imports)]")
        .raw_line("use ibverbs_sys::*;")
        .raw_line("#[allow(unused_imports)]")
        .raw_line("use libc::{off_t, FILE};")
        .generate()
        .map_err(|e| format!("bindgen (mlx5dv): {e}"))?;
    bindings.write_to_file(out_dir.join("mlx5dv.rs"))?;

    let shim = shim_stem.with_extension("c");
    let text = std::fs::read_to_string(&shim)?;
    let absolute = format!("#include \"{}\"", header.display());
    if !text.contains(&absolute) {
        return Err(format!("{}: no `{absolute}` line to rewrite", shim.display()).into());
    }
    std::fs::write(&shim, text.replace(&absolute, "#include \"wrapper.h\""))?;
    Ok(())
}

#[derive(Debug)]
struct Callbacks;

impl bindgen::callbacks::ParseCallbacks for Callbacks {
    /// Anonymous enums get a crate prefix so they never collide with `ibverbs-sys`'s
    /// `_bindgen_ty_N` through glob imports.
    fn item_name(&self, item: bindgen::callbacks::ItemInfo<'_>) -> Option<String> {
        item.name
            .strip_prefix("_bindgen_ty_")
            .map(|n| format!("_mlx5dv_anon_{n}"))
    }

    /// Types defined outside these headers: the verbs types of `ibverbs-sys` (bindgen
    /// structs: `Copy` + `Default`), `mlx5_wqe_ctrl_seg` (hand-written: `Copy` +
    /// `Default`) and libc's `FILE` (only used behind pointers).
    fn blocklisted_type_implements_trait(
        &self,
        name: &str,
        derive_trait: bindgen::callbacks::DeriveTrait,
    ) -> Option<bindgen::callbacks::ImplementsTrait> {
        use bindgen::callbacks::{DeriveTrait, ImplementsTrait};
        match derive_trait {
            DeriveTrait::Copy => Some(ImplementsTrait::Yes),
            DeriveTrait::Default if name != "FILE" && name != "off_t" => Some(ImplementsTrait::Yes),
            _ => Some(ImplementsTrait::No),
        }
    }
}
