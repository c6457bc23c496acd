//! Build script of `ibverbs-sys`: find libibverbs (and librdmacm with feature `rdmacm`),
//! compile the shim of static inline functions and the ABI-check values, export the
//! include dirs and version as `DEP_IBVERBS_INCLUDE` / `DEP_IBVERBS_VERSION`.

#[cfg(feature = "bindgen")]
#[path = "gen.rs"]
mod gen;

use std::env;
use std::path::{Path, PathBuf};

/// A library found on the build machine.
struct Found {
    include_dirs: Vec<PathBuf>,
    lib_dirs: Vec<PathBuf>,
    version: String,
}

fn env_var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

/// `<PREFIX>_INCLUDE_DIR` + `<PREFIX>_LIB_DIR`, else pkg-config `package` in `range`.
fn find(prefix: &str, package: &str, lib: &str, range: (&str, &str)) -> Found {
    let inc = env_var(&format!("{prefix}_INCLUDE_DIR"));
    let libdir = env_var(&format!("{prefix}_LIB_DIR"));
    match (inc, libdir) {
        (Some(inc), Some(libdir)) => {
            let version = version_from_soname(Path::new(&libdir), lib)
                .unwrap_or_else(|| "unknown".to_owned());
            return Found {
                include_dirs: vec![PathBuf::from(inc)],
                lib_dirs: vec![PathBuf::from(libdir)],
                version,
            };
        }
        (Some(_), None) | (None, Some(_)) => panic!(
            "set both {prefix}_INCLUDE_DIR and {prefix}_LIB_DIR (or neither, to use pkg-config `{package}`)"
        ),
        (None, None) => {}
    }
    for var in [
        "PKG_CONFIG_PATH",
        "PKG_CONFIG_LIBDIR",
        "PKG_CONFIG_SYSROOT_DIR",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    match pkg_config::Config::new()
        .range_version(range.0..range.1)
        .cargo_metadata(false)
        .probe(package)
    {
        Ok(library) => {
            let mut include_dirs = library.include_paths.clone();
            // pkg-config drops system directories such as /usr/include; dependants
            // (mlx5dv-sys, bindgen) still need to know where the headers are.
            if let Ok(dir) = pkg_config::get_variable(package, "includedir") {
                let dir = PathBuf::from(dir);
                if !include_dirs.contains(&dir) {
                    include_dirs.push(dir);
                }
            }
            Found {
                include_dirs,
                lib_dirs: library.link_paths.clone(),
                version: library.version,
            }
        }
        Err(err) => panic!(
            "lib{lib} not found ({err}).\n\
             Install the development package of rdma-core (Debian/Ubuntu: `apt install {deb}`; \
             RHEL/Fedora: `dnf install rdma-core-devel`), or set {prefix}_INCLUDE_DIR and \
             {prefix}_LIB_DIR. Supported: pkg-config `{package}` >= {} and < {}.",
            range.0,
            range.1,
            deb = if lib == "ibverbs" {
                "libibverbs-dev"
            } else {
                "librdmacm-dev"
            },
        ),
    }
}

/// `libibverbs.so.1.14.44.0` in `dir` → `1.14.44`.
fn version_from_soname(dir: &Path, lib: &str) -> Option<String> {
    let prefix = format!("lib{lib}.so.");
    let mut best: Option<String> = None;
    for entry in std::fs::read_dir(dir).ok()? {
        let name = entry.ok()?.file_name().into_string().ok()?;
        if let Some(v) = name.strip_prefix(&prefix) {
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
    println!("cargo:rerun-if-changed=rdmacm_wrapper.h");
    println!("cargo:rerun-if-changed=abi_check.c");
    println!("cargo:rerun-if-changed=sized_shims.c");
    println!("cargo:rerun-if-changed=src/generated");
    if env_var("DOCS_RS").is_some() {
        // docs.rs: the committed bindings are enough; link and compile nothing.
        return;
    }
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let rdmacm = env::var_os("CARGO_FEATURE_RDMACM").is_some();

    let verbs = find("IBVERBS", "libibverbs", "ibverbs", ("1.14.44", "2"));
    let cm = rdmacm.then(|| find("RDMACM", "librdmacm", "rdmacm", ("1.3.44", "2")));

    let mut include_dirs = verbs.include_dirs.clone();
    if let Some(cm) = &cm {
        for dir in &cm.include_dirs {
            if !include_dirs.contains(dir) {
                include_dirs.push(dir.clone());
            }
        }
    }
    let joined = env::join_paths(&verbs.include_dirs).expect("include dir with a path separator");
    println!("cargo:include={}", joined.to_string_lossy());
    println!("cargo:version={}", verbs.version);
    if let Some(cm) = &cm {
        println!("cargo:rdmacm_version={}", cm.version);
    }

    let generated = if cfg!(feature = "bindgen") {
        let dir = out_dir.join("generated");
        #[cfg(feature = "bindgen")]
        gen::generate(&crate_dir, &include_dirs, &dir).expect("generating the bindings");
        dir
    } else {
        crate_dir.join("src/generated")
    };

    let mut build = cc::Build::new();
    build
        .include(&crate_dir)
        .includes(&include_dirs)
        .warnings(false);
    build
        .file(generated.join("verbs_static.c"))
        .file(crate_dir.join("abi_check.c"))
        .file(crate_dir.join("sized_shims.c"));
    if rdmacm {
        build.file(generated.join("rdmacm_static.c"));
    }
    build.compile("ibverbs_sys_shim");

    for dir in verbs
        .lib_dirs
        .iter()
        .chain(cm.iter().flat_map(|c| c.lib_dirs.iter()))
    {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    if rdmacm {
        println!("cargo:rustc-link-lib=rdmacm");
    }
    println!("cargo:rustc-link-lib=ibverbs");
}
