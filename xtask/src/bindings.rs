//! `cargo xtask bindgen [--check]`: regenerate the committed bindings of every `-sys` crate.
//!
//! Each `-sys` crate keeps its whole bindgen configuration in `<crate>/gen.rs`; its build
//! script uses the same file under the opt-in `bindgen` feature, so the committed files
//! and a build-time regeneration cannot drift apart. Include directories come from
//! pkg-config, as in the build scripts' default path.

use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};

#[path = "../../ibverbs-sys/gen.rs"]
mod ibverbs_gen;
#[path = "../../libfabric-sys/gen.rs"]
mod libfabric_gen;
#[path = "../../mlx5dv-sys/gen.rs"]
mod mlx5dv_gen;

type Generator = fn(&Path, &[PathBuf], &Path) -> Result<(), Box<dyn std::error::Error>>;

/// (crate folder, pkg-config packages whose include dirs it needs, generator)
const SYS_CRATES: &[(&str, &[&str], Generator)] = &[
    (
        "ibverbs-sys",
        &["libibverbs", "librdmacm"],
        ibverbs_gen::generate,
    ),
    (
        "mlx5dv-sys",
        &["libmlx5", "libibverbs"],
        mlx5dv_gen::generate,
    ),
    ("libfabric-sys", &["libfabric"], libfabric_gen::generate),
];

pub fn run(args: &[String]) -> Result<i32> {
    let check = match args {
        [] => false,
        [flag] if flag == "--check" => true,
        _ => bail!("usage: cargo xtask bindgen [--check]"),
    };
    crate::deps::ensure_workspace_packages()?;
    let root = workspace_root();
    let mut stale = Vec::new();
    for (name, packages, generate) in SYS_CRATES {
        let crate_dir = root.join(name);
        let committed = crate_dir.join("src/generated");
        let include_dirs = include_dirs(packages)?;
        let out_dir = if check {
            let tmp = root.join("target/xtask-bindgen").join(name);
            let _ = std::fs::remove_dir_all(&tmp);
            std::fs::create_dir_all(&tmp)?;
            tmp
        } else {
            std::fs::create_dir_all(&committed)?;
            committed.clone()
        };
        generate(&crate_dir, &include_dirs, &out_dir)
            .map_err(|e| anyhow!("generating bindings for {name}: {e}"))?;
        if check {
            stale.extend(compare_dirs(&out_dir, &committed)?);
        } else {
            eprintln!("xtask: wrote {}", committed.display());
        }
    }
    if stale.is_empty() {
        if check {
            eprintln!("xtask: committed bindings are up to date");
        }
        Ok(0)
    } else {
        for line in &stale {
            eprintln!("xtask: {line}");
        }
        eprintln!(
            "xtask: committed bindings differ from a fresh generation: run `cargo xtask bindgen`"
        );
        Ok(1)
    }
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn include_dirs(packages: &[&str]) -> Result<Vec<PathBuf>> {
    let mut dirs = Vec::new();
    for package in packages {
        let library = pkg_config::Config::new()
            .cargo_metadata(false)
            .env_metadata(false)
            .probe(package)
            .with_context(|| format!("pkg-config {package}"))?;
        for dir in library.include_paths {
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
    }
    Ok(dirs)
}

/// Differences between a fresh generation and the committed folder, one line each.
fn compare_dirs(fresh: &Path, committed: &Path) -> Result<Vec<String>> {
    let list = |dir: &Path| -> Result<Vec<String>> {
        let mut names = Vec::new();
        if dir.exists() {
            for entry in std::fs::read_dir(dir).with_context(|| dir.display().to_string())? {
                names.push(entry?.file_name().to_string_lossy().into_owned());
            }
        }
        names.sort();
        Ok(names)
    };
    let (fresh_names, committed_names) = (list(fresh)?, list(committed)?);
    let mut diffs = Vec::new();
    for name in &committed_names {
        if !fresh_names.contains(name) {
            diffs.push(format!(
                "{} is committed but no longer generated",
                committed.join(name).display()
            ));
        }
    }
    for name in &fresh_names {
        let new = std::fs::read(fresh.join(name))?;
        match std::fs::read(committed.join(name)) {
            Ok(old) if old == new => {}
            Ok(_) => diffs.push(format!("{} differs", committed.join(name).display())),
            Err(_) => diffs.push(format!("{} is missing", committed.join(name).display())),
        }
    }
    Ok(diffs)
}
