//! Debian packages: what the workspace needs, installed only when missing.

use anyhow::{bail, Context, Result};
use std::process::Command;

/// Packages needed to build and test the whole workspace on the host.
/// (The guest's own packages are listed in `rxe.rs`.)
pub const WORKSPACE_PACKAGES: &[&str] = &[
    "pkg-config",
    "libclang-dev",
    "clang",
    "libibverbs-dev",
    "librdmacm-dev",
    "ibverbs-providers",
    "libfabric-dev",
    "libfabric-bin",
    // xtask's own unit tests read its initramfs back with GNU cpio.
    "cpio",
    // nixl's `etcd` feature: protoc builds etcd-client, its tests start a real etcd.
    "protobuf-compiler",
    "libprotobuf-dev", // google/protobuf/*.proto, which etcd-client's protos import
    "etcd-server",
    // `cargo xtask nvrtc` fetches the nvidia-cuda-nvrtc wheel with pip.
    "python3-pip",
    // The Python package's suite runs in a venv (target/pyenv) with maturin and pytest.
    "python3-venv",
];

pub fn ensure_workspace_packages() -> Result<()> {
    ensure_packages(WORKSPACE_PACKAGES)
}

/// `dpkg-query` says whether a package is installed.
pub fn is_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

/// Install the packages of `packages` that are missing (`apt-get update` only if the
/// first install attempt fails, so a warm machine makes no network call).
pub fn ensure_packages(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !is_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if std::env::var_os("XTASK_NO_INSTALL").is_some() {
        bail!(
            "missing Debian packages: {} (XTASK_NO_INSTALL is set)",
            missing.join(" ")
        );
    }
    let as_root = running_as_root();
    eprintln!("xtask: installing {}", missing.join(" "));
    let install = |update: bool| -> Result<bool> {
        let mut steps: Vec<Vec<&str>> = Vec::new();
        if update {
            steps.push(vec!["apt-get", "update", "-qq"]);
        }
        let mut install = vec!["apt-get", "install", "-y", "-qq", "--no-install-recommends"];
        install.extend(missing.iter().copied());
        steps.push(install);
        for step in steps {
            let mut cmd = if as_root {
                Command::new(step[0])
            } else {
                let mut c = Command::new("sudo");
                c.arg(step[0]);
                c
            };
            cmd.args(&step[1..])
                .env("DEBIAN_FRONTEND", "noninteractive");
            let status = cmd
                .status()
                .with_context(|| format!("running {}", step.join(" ")))?;
            if !status.success() {
                return Ok(false);
            }
        }
        Ok(true)
    };
    if !install(false)? && !install(true)? {
        bail!("apt-get install {} failed", missing.join(" "));
    }
    Ok(())
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
