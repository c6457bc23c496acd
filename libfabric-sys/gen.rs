//! The one bindgen configuration of `libfabric-sys`.
//!
//! Used by the crate's build script (feature `bindgen`: generate into `OUT_DIR`) and by
//! `cargo xtask bindgen` (rewrite the committed `src/generated/` files). It depends on
//! `bindgen` and `std` only, so both can include it with `#[path]`.
//!
//! Output: `<out_dir>/bindings.rs` and `<out_dir>/wrap_static.c`, byte-identical on every
//! run with the same headers and bindgen version.

use bindgen::callbacks::{IntKind, ParseCallbacks};
use std::error::Error;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

/// Constants that `src/lib.rs` writes by hand (casts and `SIZE_MAX` that bindgen cannot
/// evaluate, or evaluates differently across header versions).
const HAND_WRITTEN: &[&str] = &[
    "FI_ADDR_UNSPEC",
    "FI_ADDR_NOTAVAIL",
    "FI_KEY_NOTAVAIL",
    "FI_SHARED_CONTEXT",
];

/// Generate `bindings.rs` and `wrap_static.c` into `out_dir` from `crate_dir/wrapper.h`,
/// searching `include_dirs` (in order) before the compiler's default include path.
pub fn generate(
    crate_dir: &Path,
    include_dirs: &[PathBuf],
    out_dir: &Path,
) -> Result<(), Box<dyn Error>> {
    let header = crate_dir.join("wrapper.h");
    let header = header
        .canonicalize()
        .map_err(|e| format!("{}: {e}", header.display()))?;
    let header_str = header
        .to_str()
        .ok_or("the crate directory's path is not UTF-8")?
        .to_owned();
    fs::create_dir_all(out_dir)?;
    // bindgen appends `.c` to this path.
    let shim_stem = out_dir.join("wrap_static");

    let mut builder = bindgen::Builder::default()
        .header(header_str.clone())
        .clang_args(
            include_dirs
                .iter()
                .map(|dir| format!("-I{}", dir.display())),
        )
        // Everything declared in rdma/fabric.h and rdma/fi_*.h, and what it uses.
        .allowlist_file(r".*/rdma/fabric\.h")
        .allowlist_file(r".*/rdma/fi_[a-z_]+\.h")
        .blocklist_file(r".*/rdma/fi_ext_[a-z0-9_]+\.h")
        // Values returned by the library are plain constants, never Rust enums.
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .translate_enum_integer_types(true)
        .default_macro_constant_type(bindgen::MacroTypeVariation::Unsigned)
        .parse_callbacks(Box::new(Callbacks))
        .derive_default(true)
        .derive_debug(true)
        .impl_debug(false)
        .layout_tests(true)
        .generate_comments(true)
        .use_core()
        .sort_semantically(true)
        .merge_extern_blocks(true)
        .wrap_unsafe_ops(true)
        .size_t_is_usize(true)
        // libfabric's data path is `static inline`: reach it through a C shim.
        .wrap_static_fns(true)
        .wrap_static_fns_path(&shim_stem)
        .rust_target(bindgen::RustTarget::stable(82, 0).map_err(|e| e.to_string())?);
    for name in HAND_WRITTEN {
        builder = builder.blocklist_item(*name);
    }
    // `fi_allocinfo()` is `fi_dupinfo(NULL)`: written in Rust, no shim call needed.
    builder = builder.blocklist_function("fi_allocinfo");
    let bindings = builder.generate()?;

    let rust = postprocess_rust(&bindings.to_string());
    fs::write(out_dir.join("bindings.rs"), rust)?;

    let shim_path = out_dir.join("wrap_static.c");
    let shim = fs::read_to_string(&shim_path)?;
    fs::write(&shim_path, postprocess_shim(&shim, &header_str)?)?;
    Ok(())
}

/// Integer types of `#define` constants: flags and caps are `u64` (the type of every
/// `caps`/`flags`/`mode` field), errno codes are `c_int` (the type `fi_strerror` takes
/// and every call returns, negated), `mr_mode` bits are `c_int` (the type of
/// `fi_domain_attr::mr_mode`), version numbers are `u32` (what `fi_version` returns).
#[derive(Debug)]
struct Callbacks;

impl ParseCallbacks for Callbacks {
    fn int_macro(&self, name: &str, value: i64) -> Option<IntKind> {
        Some(macro_kind(name, value))
    }
}

fn is_errno(name: &str, value: i64) -> bool {
    name == "FI_SUCCESS"
        || name == "FI_ERRNO_OFFSET"
        || (name.starts_with("FI_E") && (0..4096).contains(&value))
}

fn macro_kind(name: &str, value: i64) -> IntKind {
    const MR_MODE_BITS: &[&str] = &[
        "FI_MR_LOCAL",
        "FI_MR_RAW",
        "FI_MR_VIRT_ADDR",
        "FI_MR_ALLOCATED",
        "FI_MR_PROV_KEY",
        "FI_MR_MMU_NOTIFY",
        "FI_MR_RMA_EVENT",
        "FI_MR_ENDPOINT",
        "FI_MR_HMEM",
        "FI_MR_COLLECTIVE",
    ];
    if is_errno(name, value) || MR_MODE_BITS.contains(&name) {
        IntKind::Int
    } else if name.ends_with("_VERSION")
        || name.starts_with("FI_PROV_SPECIFIC")
        || name == "FI_COLLECTIVE_OFFSET"
    {
        IntKind::U32
    } else {
        IntKind::U64
    }
}

/// Anonymous C enums come out as `pub const X: _bindgen_ty_N = v;` with a numbered
/// alias that changes whenever a header adds an enum. Give those constants a named
/// type instead (errno codes `c_int`, like the `#define`d ones; the rest the enum's
/// underlying integer type) and drop the numbered aliases.
fn postprocess_rust(src: &str) -> String {
    // `pub type _bindgen_ty_N = u32;` -> ("_bindgen_ty_N", "u32")
    let aliases: Vec<(String, String)> = src
        .lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix("pub type _bindgen_ty_")?;
            let (num, ty) = rest.split_once(" = ")?;
            Some((
                format!("_bindgen_ty_{num}"),
                ty.trim_end_matches(';').to_owned(),
            ))
        })
        .collect();
    let still_used =
        |alias: &str| src.contains(&format!(": {alias},")) || src.contains(&format!(": {alias})"));
    let mut out = String::with_capacity(src.len());
    for line in src.lines() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        if let Some(rest) = trimmed.strip_prefix("pub type ") {
            if let Some((alias, _)) = rest.split_once(" = ") {
                if alias.starts_with("_bindgen_ty_") && !still_used(alias) {
                    continue;
                }
            }
        }
        if let Some(rest) = trimmed.strip_prefix("pub const ") {
            if let Some((name, tail)) = rest.split_once(": _bindgen_ty_") {
                if let Some((num, value)) = tail.split_once(" = ") {
                    let alias = format!("_bindgen_ty_{num}");
                    let value = value.trim_end_matches(';');
                    let underlying = aliases
                        .iter()
                        .find(|(a, _)| *a == alias)
                        .map_or("u32", |(_, ty)| ty.as_str());
                    let ty = if is_errno(name, value.parse::<i64>().unwrap_or(-1)) {
                        "::core::ffi::c_int"
                    } else {
                        underlying
                    };
                    let _ = writeln!(out, "{indent}pub const {name}: {ty} = {value};");
                    continue;
                }
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The shim includes the wrapper by absolute path; make it relative so the committed
/// file is the same on every machine (build.rs compiles it with `-I<crate dir>`).
fn postprocess_shim(src: &str, header_abs: &str) -> Result<String, Box<dyn Error>> {
    let absolute = format!("#include \"{header_abs}\"");
    if !src.contains(&absolute) {
        return Err(format!("wrap_static.c does not include {header_abs}").into());
    }
    let mut out = String::from(
        "/* Generated by libfabric-sys/gen.rs (bindgen wrap_static_fns): do not edit. */\n",
    );
    out.push_str(&src.replace(&absolute, "#include \"wrapper.h\""));
    Ok(out)
}
