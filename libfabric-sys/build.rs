//! Finds libfabric, links it, and compiles the C shim for its `static inline` API.
//!
//! Discovery order (documented in the crate docs as well):
//! 1. `LIBFABRIC_INCLUDE_DIR` + `LIBFABRIC_LIB_DIR` (both, or a panic saying which is missing);
//! 2. pkg-config `libfabric`, version `>= 1.17, < 3`.
//!
//! Under `DOCS_RS` nothing is linked or compiled.

#[cfg(feature = "bindgen")]
#[path = "gen.rs"]
mod gen;

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const MIN_VERSION: (u32, u32) = (1, 17);
const MAX_VERSION_EXCLUSIVE: &str = "3";

struct Library {
    include_dirs: Vec<PathBuf>,
    version: String,
}

fn env_var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=gen.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=csrc/abi_check.c");
    println!("cargo:rerun-if-changed=src/generated/wrap_static.c");

    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));

    if env_var("DOCS_RS").is_some() {
        // docs.rs has no libfabric: document the committed bindings, link nothing.
        if cfg!(feature = "bindgen") {
            fs::copy(
                crate_dir.join("src/generated/bindings.rs"),
                out_dir.join("bindings.rs"),
            )
            .expect("copying the committed bindings for docs.rs");
        }
        return;
    }

    let library = find_library();
    let joined = env::join_paths(&library.include_dirs).expect("include dirs joinable");
    println!("cargo:include={}", joined.to_string_lossy());
    println!("cargo:version={}", library.version);

    let shim = generate_or_committed(&crate_dir, &out_dir, &library);

    let mut build = cc::Build::new();
    build
        .file(&shim)
        .file(crate_dir.join("csrc/abi_check.c"))
        .include(&crate_dir)
        .includes(&library.include_dirs)
        // The shim forwards deprecated inline functions too; calling them is its job.
        .flag_if_supported("-Wno-deprecated-declarations");
    build.compile("fabric_sys_shim");
}

#[cfg(feature = "bindgen")]
fn generate_or_committed(crate_dir: &Path, out_dir: &Path, library: &Library) -> PathBuf {
    if let Err(err) = gen::generate(crate_dir, &library.include_dirs, out_dir) {
        panic!("libfabric-sys: bindgen failed: {err}");
    }
    out_dir.join("wrap_static.c")
}

#[cfg(not(feature = "bindgen"))]
fn generate_or_committed(crate_dir: &Path, _out_dir: &Path, _library: &Library) -> PathBuf {
    crate_dir.join("src/generated/wrap_static.c")
}

fn find_library() -> Library {
    let include = env_var("LIBFABRIC_INCLUDE_DIR");
    let lib = env_var("LIBFABRIC_LIB_DIR");
    match (include, lib) {
        (Some(include), Some(lib)) => from_env(PathBuf::from(include), PathBuf::from(lib)),
        (Some(_), None) => panic!(
            "libfabric-sys: LIBFABRIC_INCLUDE_DIR is set but LIBFABRIC_LIB_DIR is not; \
             set both (the directories holding rdma/fabric.h and libfabric.so) or neither"
        ),
        (None, Some(_)) => panic!(
            "libfabric-sys: LIBFABRIC_LIB_DIR is set but LIBFABRIC_INCLUDE_DIR is not; \
             set both (the directories holding rdma/fabric.h and libfabric.so) or neither"
        ),
        (None, None) => from_pkg_config(),
    }
}

fn from_env(include: PathBuf, lib: PathBuf) -> Library {
    let header = include.join("rdma/fabric.h");
    let version = header_version(&header).unwrap_or_else(|| {
        panic!(
            "libfabric-sys: LIBFABRIC_INCLUDE_DIR={} has no readable rdma/fabric.h with \
             FI_MAJOR_VERSION/FI_MINOR_VERSION",
            include.display()
        )
    });
    let (major, minor) = parse_major_minor(&version);
    if (major, minor) < MIN_VERSION || major >= 3 {
        panic!(
            "libfabric-sys: {} is libfabric {version}; supported: >= {}.{}, < {MAX_VERSION_EXCLUSIVE}",
            header.display(),
            MIN_VERSION.0,
            MIN_VERSION.1
        );
    }
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=fabric");
    Library {
        include_dirs: vec![include],
        version,
    }
}

fn from_pkg_config() -> Library {
    let min = format!("{}.{}", MIN_VERSION.0, MIN_VERSION.1);
    match pkg_config::Config::new()
        .range_version(min.as_str()..MAX_VERSION_EXCLUSIVE)
        .probe("libfabric")
    {
        Ok(lib) => {
            let mut include_dirs = lib.include_paths.clone();
            if include_dirs.is_empty() {
                // A system install: pkg-config strips the default include directory, but
                // dependants (and the metadata) still want to know where the headers are.
                if let Ok(dir) = pkg_config::get_variable("libfabric", "includedir") {
                    if !dir.is_empty() {
                        include_dirs.push(PathBuf::from(dir));
                    }
                }
            }
            Library {
                include_dirs,
                version: lib.version,
            }
        }
        Err(err) => panic!(
            "libfabric-sys: libfabric >= {min}, < {MAX_VERSION_EXCLUSIVE} not found ({err}).\n\
             Install its development files: `apt-get install libfabric-dev` (Debian/Ubuntu) or \
             `dnf install libfabric-devel` (RHEL/Fedora), or point LIBFABRIC_INCLUDE_DIR and \
             LIBFABRIC_LIB_DIR at a libfabric build."
        ),
    }
}

/// `"<major>.<minor>.<revision>"` from the `#define`s in `rdma/fabric.h`.
fn header_version(header: &Path) -> Option<String> {
    let text = fs::read_to_string(header).ok()?;
    let find = |name: &str| -> Option<u32> {
        text.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| words.next()?.parse().ok())
                .flatten()
        })
    };
    let major = find("FI_MAJOR_VERSION")?;
    let minor = find("FI_MINOR_VERSION")?;
    let revision = find("FI_REVISION_VERSION").unwrap_or(0);
    Some(format!("{major}.{minor}.{revision}"))
}

fn parse_major_minor(version: &str) -> (u32, u32) {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}
