//! Build script of `mlx5dv-sys`: find libmlx5, compile the shim of static inline
//! functions and the ABI-check values, export `DEP_MLX5_INCLUDE` / `DEP_MLX5_VERSION`.
//! The libibverbs headers come from `ibverbs-sys` through `DEP_IBVERBS_INCLUDE`.

#[cfg(feature = "bindgen")]
#[path = "gen.rs"]
mod gen;

use std::env;
use std::path::{Path, PathBuf};

fn env_var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

/// `libmlx5.so.1.24.44.0` in `dir` → `1.24.44`.
fn version_from_soname(dir: &Path) -> Option<String> {
    let mut best: Option<String> = None;
    for entry in std::fs::read_dir(dir).ok()? {
        let name = entry.ok()?.file_name().into_string().ok()?;
        if let Some(v) = name.strip_prefix("libmlx5.so.") {
            let parts: Vec<&str> = v.split('.').collect();
            if parts.len() >= 3 && best.as_ref().is_none_or(|b| b.len() < v.len()) {
                best = Some(parts[..3].join("."));
            }
        }
    }
    best
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=gen.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=abi_check.c");
    println!("cargo:rerun-if-changed=src/generated");
    if env_var("DOCS_RS").is_some() {
        return;
    }
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));

    let (mut include_dirs, lib_dirs, version) =
        match (env_var("MLX5_INCLUDE_DIR"), env_var("MLX5_LIB_DIR")) {
            (Some(inc), Some(lib)) => {
                let version =
                    version_from_soname(Path::new(&lib)).unwrap_or_else(|| "unknown".to_owned());
                (vec![PathBuf::from(inc)], vec![PathBuf::from(lib)], version)
            }
            (Some(_), None) | (None, Some(_)) => panic!(
            "set both MLX5_INCLUDE_DIR and MLX5_LIB_DIR (or neither, to use pkg-config `libmlx5`)"
        ),
            (None, None) => {
                for var in [
                    "PKG_CONFIG_PATH",
                    "PKG_CONFIG_LIBDIR",
                    "PKG_CONFIG_SYSROOT_DIR",
                ] {
                    println!("cargo:rerun-if-env-changed={var}");
                }
                match pkg_config::Config::new()
                    .range_version("1.24.44".."2")
                    .cargo_metadata(false)
                    .probe("libmlx5")
                {
                    Ok(lib) => {
                        let mut inc = lib.include_paths.clone();
                        if let Ok(dir) = pkg_config::get_variable("libmlx5", "includedir") {
                            let dir = PathBuf::from(dir);
                            if !inc.contains(&dir) {
                                inc.push(dir);
                            }
                        }
                        (inc, lib.link_paths.clone(), lib.version)
                    }
                    Err(err) => panic!(
                        "libmlx5 not found ({err}).\n\
                         Install rdma-core's development files (Debian/Ubuntu: `apt install \
                         libibverbs-dev`, which ships libmlx5; RHEL/Fedora: `dnf install \
                         rdma-core-devel`), or set MLX5_INCLUDE_DIR and MLX5_LIB_DIR. \
                         Supported: pkg-config `libmlx5` >= 1.24.44 and < 2."
                    ),
                }
            }
        };
    // The verbs headers that ibverbs-sys found (mlx5dv.h includes infiniband/verbs.h).
    if let Some(dirs) = env::var_os("DEP_IBVERBS_INCLUDE") {
        for dir in env::split_paths(&dirs) {
            if !include_dirs.contains(&dir) {
                include_dirs.push(dir);
            }
        }
    }
    let joined = env::join_paths(&include_dirs).expect("include dir with a path separator");
    println!("cargo:include={}", joined.to_string_lossy());
    println!("cargo:version={version}");

    let generated = if cfg!(feature = "bindgen") {
        let dir = out_dir.join("generated");
        #[cfg(feature = "bindgen")]
        gen::generate(&crate_dir, &include_dirs, &dir).expect("generating the bindings");
        dir
    } else {
        crate_dir.join("src/generated")
    };
    cc::Build::new()
        .include(&crate_dir)
        .includes(&include_dirs)
        .warnings(false)
        .file(generated.join("mlx5dv_static.c"))
        .file(crate_dir.join("abi_check.c"))
        .compile("mlx5dv_sys_shim");
    for dir in &lib_dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    println!("cargo:rustc-link-lib=mlx5");
}
