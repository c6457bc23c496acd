//! NVRTC compilation with the headers a program includes passed in: embedded as strings
//! (by name) or found in include folders on disk, and a typed error with NVRTC's log
//! when a program does not compile. No GPU needed: NVRTC runs on any machine.
//!
//! CI installs the `nvidia-cuda-nvrtc` wheel (13.0 series) and sets
//! `GPUNETIO_REQUIRE_NVRTC=1` for the whole workspace, so these tests fail there when
//! libnvrtc does not load; elsewhere they skip with the reason.

use gpu_mem::device_code::{compile, nvrtc_available, nvrtc_version, CompileOptions};
use gpu_mem::Error;
use std::path::PathBuf;

fn nvrtc_for_test(test: &str) -> bool {
    if nvrtc_available() {
        return true;
    }
    let required =
        std::env::var("GPUNETIO_REQUIRE_NVRTC").is_ok_and(|v| v == "1") || gpu_mem::gpu_required();
    assert!(
        !required,
        "{test}: NVRTC is required here but libnvrtc does not load (LD_LIBRARY_PATH={:?})",
        std::env::var("LD_LIBRARY_PATH").ok()
    );
    eprintln!("skipped {test}: libnvrtc is not installed (cargo xtask nvrtc fetches it)");
    false
}

/// A folder removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!("gpu-mem-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const KERNEL: &str = r#"
#include "mylib/scale.cuh"
extern "C" __global__ void scale(float *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = mylib_scale(x[i]);
}
"#;

#[test]
fn an_embedded_header_is_includable_by_name_and_defines_reach_it() {
    if !nvrtc_for_test("an_embedded_header_is_includable_by_name") {
        return;
    }
    let (major, minor) = nvrtc_version().expect("nvrtcVersion");
    eprintln!("NVRTC {major}.{minor}");
    // The header only compiles with FACTOR defined: the definition must reach it.
    let header =
        "#pragma once\n__device__ inline float mylib_scale(float v) { return v * FACTOR; }\n";
    for arch in ["compute_80", "compute_90"] {
        let options = CompileOptions {
            arch: arch.into(),
            ..CompileOptions::default()
        }
        .header("mylib/scale.cuh", header)
        .define("FACTOR=2.0f");
        let ptx = compile("scale.cu", KERNEL, &options).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let text = ptx.to_src();
        assert!(
            text.contains(".entry scale"),
            "{arch}: no kernel in\n{text}"
        );
        let target = format!(".target sm_{}", &arch["compute_".len()..]);
        assert!(text.contains(&target), "{arch}: no `{target}` in\n{text}");
    }
    // Without the definition the header does not compile: the error names the program.
    let options = CompileOptions::default().header("mylib/scale.cuh", header);
    match compile("scale.cu", KERNEL, &options) {
        Err(Error::Compile { name, log, .. }) => {
            assert_eq!(name, "scale.cu");
            assert!(log.contains("FACTOR"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn headers_are_found_in_include_folders_and_embedded_ones_come_first() {
    if !nvrtc_for_test("headers_are_found_in_include_folders") {
        return;
    }
    let dir = TempDir::new("include");
    std::fs::create_dir_all(dir.0.join("mylib")).unwrap();
    std::fs::write(
        dir.0.join("mylib/scale.cuh"),
        "#pragma once\n__device__ inline float mylib_scale(float v) { return v * 3.0f; }\n",
    )
    .unwrap();
    let from_disk = CompileOptions::default().include_dir(&dir.0);
    let ptx = compile("scale.cu", KERNEL, &from_disk).expect("the header is found on disk");
    assert!(ptx.to_src().contains(".entry scale"));

    // An embedded header of the same name wins over the folder's (this one does not
    // compile, which proves it was the one used).
    let shadowed = from_disk.header("mylib/scale.cuh", "#error embedded header used\n");
    match compile("scale.cu", KERNEL, &shadowed) {
        Err(Error::Compile { log, .. }) => {
            assert!(log.contains("embedded header used"), "log: {log}")
        }
        other => panic!("expected the embedded header's #error, got {other:?}"),
    }
    // Of two embedded headers with one name, the last given is used (so a layer's
    // caller can replace one of the layer's headers).
    let good = "#pragma once\n__device__ inline float mylib_scale(float v) { return v; }\n";
    let twice = CompileOptions::default()
        .header("mylib/scale.cuh", "#error first header used\n")
        .header("mylib/scale.cuh", good);
    compile("scale.cu", KERNEL, &twice).expect("the last header is used");
}

#[test]
fn a_missing_header_and_bad_input_are_typed_errors() {
    if !nvrtc_for_test("a_missing_header_and_bad_input_are_typed_errors") {
        return;
    }
    match compile("scale.cu", KERNEL, &CompileOptions::default()) {
        Err(Error::Compile { name, log, .. }) => {
            assert_eq!(name, "scale.cu");
            assert!(log.contains("mylib/scale.cuh"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    let bad = "extern \"C\" __global__ void k() { no_such_call(); }\n";
    match compile("bad.cu", bad, &CompileOptions::default()) {
        Err(Error::Compile { name, log, .. }) => {
            assert_eq!(name, "bad.cu");
            assert!(log.contains("no_such_call"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    let nul = compile("nul.cu", "int x;\0", &CompileOptions::default());
    assert!(matches!(nul, Err(Error::InvalidArgument(_))), "{nul:?}");
}

#[test]
fn without_nvrtc_compiling_says_so() {
    if nvrtc_available() {
        eprintln!("skipped without_nvrtc_compiling_says_so: libnvrtc is installed here");
        return;
    }
    let r = compile("k.cu", "", &CompileOptions::default());
    assert!(matches!(r, Err(Error::NoNvrtc)), "{r:?}");
}
