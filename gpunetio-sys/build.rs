//! Checks the ABI header with the host C compiler and exports its folder to dependents
//! (`DEP_GPUNETIO_INCLUDE`).

fn main() {
    let manifest =
        std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let include = manifest.join("include");
    println!("cargo:rerun-if-changed=abi_check.c");
    println!("cargo:rerun-if-changed=include");
    println!("cargo:include={}", include.display());
    if std::env::var_os("DOCS_RS").is_some() {
        return;
    }
    cc::Build::new()
        .file(manifest.join("abi_check.c"))
        .include(&include)
        .std("c11")
        .warnings_into_errors(true)
        .compile("gpunetio_abi_check");
}
