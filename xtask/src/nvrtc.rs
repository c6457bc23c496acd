//! NVRTC for compiling device code without a GPU or a CUDA toolkit: the
//! `nvidia-cuda-nvrtc` wheel (pinned to the 13.0 series, the GPU machine's CUDA) unpacked
//! under `target/nvrtc/`. `cargo xtask test` puts its `lib` folder on `LD_LIBRARY_PATH`
//! and sets `GPUNETIO_REQUIRE_NVRTC=1`, so every device source must compile.

use crate::bindings::workspace_root;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;

/// The pinned wheel version (CUDA 13.0, as the GPU machine's driver).
pub const NVRTC_VERSION: &str = "13.0.88";

/// The folder holding `libnvrtc.so.13`, fetched and unpacked first if missing.
pub fn ensure() -> Result<PathBuf> {
    let base = workspace_root()
        .join("target")
        .join("nvrtc")
        .join(NVRTC_VERSION);
    let lib = base.join("nvidia").join("cu13").join("lib");
    if lib.join("libnvrtc.so.13").exists() {
        return Ok(lib);
    }
    let download = base.join("download");
    std::fs::create_dir_all(&download)?;
    eprintln!("xtask: fetching nvidia-cuda-nvrtc=={NVRTC_VERSION} (pip download)");
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
        ])
        .arg("--dest")
        .arg(&download)
        .arg(format!("nvidia-cuda-nvrtc=={NVRTC_VERSION}"))
        .status()
        .context("running python3 -m pip (Debian: python3-pip)")?;
    if !status.success() {
        bail!("pip download of nvidia-cuda-nvrtc=={NVRTC_VERSION} failed ({status})");
    }
    let wheel = std::fs::read_dir(&download)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip downloaded no wheel")?;
    let status = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&base)
        .status()?;
    if !status.success() || !lib.join("libnvrtc.so.13").exists() {
        bail!(
            "unpacking {} gave no libnvrtc.so.13 in {}",
            wheel.display(),
            lib.display()
        );
    }
    Ok(lib)
}

/// `cargo xtask nvrtc`: fetch it and print the folder.
pub fn run(args: &[String]) -> Result<i32> {
    if !args.is_empty() {
        bail!(
            "usage: cargo xtask nvrtc   (fetches NVRTC {NVRTC_VERSION} and prints its lib folder)"
        );
    }
    println!("{}", ensure()?.display());
    Ok(0)
}

/// `LD_LIBRARY_PATH` with `lib` first.
pub fn library_path(lib: &std::path::Path) -> std::ffi::OsString {
    let mut path = lib.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
        path.push(":");
        path.push(old);
    }
    path
}
