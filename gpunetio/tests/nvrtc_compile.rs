//! Every device source of the crate compiles with NVRTC (no GPU needed: NVRTC runs on
//! any machine). CI installs the `nvidia-cuda-nvrtc` wheel (13.0 series) and sets
//! `GPUNETIO_REQUIRE_NVRTC=1`, so a kernel that does not compile fails CI; elsewhere the
//! test skips with the reason when libnvrtc is missing.

use gpunetio::device_code::{compile, nvrtc_available, nvrtc_version, CompileOptions};

fn nvrtc_for_test(test: &str) -> bool {
    if nvrtc_available() {
        return true;
    }
    let required =
        std::env::var("GPUNETIO_REQUIRE_NVRTC").is_ok_and(|v| v == "1") || gpunetio::gpu_required();
    assert!(
        !required,
        "{test}: NVRTC is required here but libnvrtc does not load (LD_LIBRARY_PATH={:?})",
        std::env::var("LD_LIBRARY_PATH").ok()
    );
    eprintln!("skipped {test}: libnvrtc is not installed (cargo xtask nvrtc fetches it)");
    false
}

#[test]
fn every_device_source_compiles_for_sm80_and_sm90_with_and_without_debug_checks() {
    if !nvrtc_for_test("every_device_source_compiles") {
        return;
    }
    let (major, minor) = nvrtc_version().expect("nvrtcVersion");
    eprintln!("NVRTC {major}.{minor}");
    for (name, source) in gpunetio::DEVICE_SOURCES {
        for arch in ["compute_80", "compute_90"] {
            for debug in [false, true] {
                let mut options = CompileOptions {
                    arch: arch.into(),
                    ..CompileOptions::default()
                };
                if debug {
                    options = options.define("GIO_DEBUG");
                }
                if let Err(e) = compile(name, source, &options) {
                    panic!("{name} for {arch} (debug {debug}): {e}");
                }
            }
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_a_typed_error_with_the_log() {
    if !nvrtc_for_test("a_kernel_that_does_not_compile") {
        return;
    }
    let bad = "#include \"gpunetio/gio_device.cuh\"\nextern \"C\" __global__ void k() { gio::no_such_call(); }\n";
    match compile("bad.cu", bad, &CompileOptions::default()) {
        Err(gpunetio::gpu_mem::Error::Compile { name, log, .. }) => {
            assert_eq!(name, "bad.cu");
            assert!(log.contains("no_such_call"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn the_abi_header_static_asserts_hold_under_nvrtc() {
    if !nvrtc_for_test("the_abi_header_static_asserts_hold_under_nvrtc") {
        return;
    }
    let src = "#include \"gpunetio/gio_abi.h\"\nextern \"C\" __global__ void k(gio_dev_qp *q) { q->flags = sizeof(gio_ring_entry); }\n";
    compile("abi.cu", src, &CompileOptions::default()).expect("the ABI header compiles");
}
