//! `cargo xtask gpu-bundle [--list]`: every GPU test binary and GPU tool, built here in
//! release and stripped into `target/gpu-bundle/`, with a `run.sh` that runs the suite on
//! a GPU machine that has no Rust toolchain.
//!
//! What goes in is read from `cargo metadata` at run time:
//! - every test target named `gpu_*` in the workspace, built with the features of
//!   [`GPU_FEATURES`] each package has (today `nixl/cuda`, `nixl/gpunetio`, `nixl/file`,
//!   `nixl/posix`) → `tests/<name>`;
//! - the binaries of `tools` and `hf3fs-gdr` and the examples of `gpunetio`, `nixl` and
//!   `hf3fs-gdr` (each with its package's [`GPU_FEATURES`]) → `bin/<name>`;
//! - the shared libraries those link beyond glibc (libfabric, libibverbs and theirs) →
//!   `lib/`, which `run.sh` uses only for a library the GPU machine lacks;
//! - `run.sh` and `MANIFEST` (commit, build commands, files).
//!
//! Binaries are stripped and `bin/` and `tests/` travel as `payload.tar.xz` (xz with a
//! 64 MiB window: the test binaries share most of their code, and xz finds it again
//! across files, where gzip's 32 KiB window cannot)
//! (`run.sh` unpacks it into a temporary folder first): the bundle must stay under
//! [`MAX_BUNDLE_BYTES`], since it travels to the GPU machine with the tree.

use crate::test::{built_executables, shell_quote};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Package features GPU builds turn on where a package has them: GPU memory and the GPU
/// backends (`cuda`), GPU-initiated networking (`gpunetio`: nixl's GPUNETIO backend, its
/// tests and device-API examples), the storage backends whose GPU tests read files into
/// VRAM (`file`, `posix`).
const GPU_FEATURES: &[&str] = &["cuda", "gpunetio", "file", "posix"];
/// Test targets with this name prefix need a GPU.
const GPU_TEST_PREFIX: &str = "gpu_";
/// Packages whose binaries (`bin`) or examples (`example`) are GPU tools.
const TOOL_TARGETS: &[(&str, &str)] = &[
    ("rdma-rs-tools", "bin"),
    ("rdma-rs-gpunetio", "example"),
    ("rdma-rs-nixl", "example"),
    ("rdma-rs-hf3fs-gdr", "bin"),
    ("rdma-rs-hf3fs-gdr", "example"),
];
/// The bundle's size limit: the working tree a device call carries is at most 64 MiB
/// (67.1 MB) and the tracked tree is about 7.5 MB. (Packed with xz the whole bundle is
/// about 16 MB, so the Python package's GPU bundle and the peer wheels fit beside it.)
const MAX_BUNDLE_BYTES: u64 = 55_000_000;
/// The packed binaries, beside `run.sh`.
const PAYLOAD: &str = "payload.tar.xz";
/// Libraries every Linux machine has (glibc and the compiler runtime): never bundled.
const SYSTEM_LIBS: &[&str] = &[
    "linux-vdso.so",
    "ld-linux",
    "libc.so",
    "libm.so",
    "libpthread.so",
    "libdl.so",
    "librt.so",
    "libutil.so",
    "libresolv.so",
    "libgcc_s.so",
];

const USAGE: &str = "usage: cargo xtask gpu-bundle [--list]
  builds every `gpu_*` test target and GPU tool in release, strips them into
  target/gpu-bundle/ with a run.sh; --list prints what would be included, building nothing";

/// One cargo build command of the bundle and what it contributes.
#[derive(Debug)]
struct Build {
    /// cargo arguments.
    args: Vec<String>,
    /// The target kind kept from its artifacts (`test`, `bin`, `example`).
    kind: &'static str,
    /// Target names to keep.
    names: Vec<String>,
    /// Bundle folder they go to.
    folder: &'static str,
}

pub fn run(args: &[String]) -> Result<i32> {
    let list = match args {
        [] => false,
        [flag] if flag == "--list" => true,
        [flag] if flag == "-h" || flag == "--help" => {
            println!("{USAGE}");
            return Ok(0);
        }
        _ => bail!("{USAGE}"),
    };
    let root = crate::bindings::workspace_root();
    let metadata = metadata(&root)?;
    let builds = plan(&metadata)?;
    if list {
        for build in &builds {
            println!("{}/ (cargo {}):", build.folder, build.args.join(" "));
            for name in &build.names {
                println!("  {name}");
            }
        }
        println!(
            "lib/ (shared libraries the binaries link beyond glibc, used only where the GPU \
             machine lacks them), run.sh, MANIFEST"
        );
        return Ok(0);
    }

    let target_dir = metadata["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let bundle = target_dir.join("gpu-bundle");
    // Build everything before touching the old bundle.
    let mut files: Vec<(&'static str, String, PathBuf)> = Vec::new();
    for build in &builds {
        eprintln!("xtask: cargo {}", build.args.join(" "));
        let args: Vec<&str> = build.args.iter().map(String::as_str).collect();
        let built = built_executables(&root, &args, |kinds, name| {
            kinds.contains(&build.kind) && build.names.iter().any(|n| n == name)
        })?;
        for name in &build.names {
            if !built.iter().any(|(n, _)| n == name) {
                bail!(
                    "cargo {} produced no executable for `{name}`",
                    args.join(" ")
                );
            }
        }
        files.extend(
            built
                .into_iter()
                .map(|(name, path)| (build.folder, name, path)),
        );
    }

    if bundle.exists() {
        std::fs::remove_dir_all(&bundle)
            .with_context(|| format!("clearing {}", bundle.display()))?;
    }
    let mut copied: Vec<PathBuf> = Vec::new();
    for (folder, name, path) in &files {
        let dir = bundle.join(folder);
        std::fs::create_dir_all(&dir)?;
        let dest = dir.join(name);
        if copied.contains(&dest) {
            bail!("two targets would both be bundled as {}", dest.display());
        }
        strip(path, &dest)?;
        copied.push(dest);
    }
    let libs = bundle_libraries(&copied, &bundle.join("lib"))?;
    copied.extend(libs);

    let names = |folder: &str| -> Vec<String> {
        files
            .iter()
            .filter(|(f, _, _)| *f == folder)
            .map(|(_, n, _)| n.clone())
            .collect()
    };
    let tests = names("tests");
    let tools = names("bin");
    let run_sh = bundle.join("run.sh");
    std::fs::write(&run_sh, run_script(&tests, &tools))?;
    set_executable(&run_sh)?;
    copied.push(run_sh);
    let manifest = bundle.join("MANIFEST");
    std::fs::write(&manifest, manifest_text(&root, &builds, &bundle, &copied)?)?;
    copied.push(manifest);
    let copied = pack_payload(&bundle, copied)?;

    let mut total = 0;
    for path in &copied {
        let size = std::fs::metadata(path)?.len();
        total += size;
        println!(
            "{:>10}  {}",
            size,
            path.strip_prefix(&bundle).unwrap_or(path).display()
        );
    }
    println!(
        "gpu bundle: {} files, {total} bytes ({:.1} MB) in {}",
        copied.len(),
        total as f64 / 1e6,
        bundle.display()
    );
    if total > MAX_BUNDLE_BYTES {
        bail!(
            "the bundle is {total} bytes, over its {MAX_BUNDLE_BYTES}-byte limit (it travels \
             with the working tree to the GPU machine)"
        );
    }
    println!(
        "copy {} to the GPU machine and run: bash {}/run.sh   (logs: $OUT or /tmp/gpu-out)",
        bundle.display(),
        bundle.strip_prefix(&root).unwrap_or(&bundle).display()
    );
    Ok(0)
}

fn metadata(root: &Path) -> Result<Value> {
    crate::test::cargo_metadata(root, &["--no-deps"])
}

/// The cargo builds of the bundle, from the workspace's packages as they are now.
fn plan(metadata: &Value) -> Result<Vec<Build>> {
    let packages = metadata["packages"]
        .as_array()
        .context("cargo metadata: no packages")?;
    let package = |name: &str| packages.iter().find(|p| p["name"] == name);
    let gpu_features = |p: &Value| -> Vec<&str> {
        GPU_FEATURES
            .iter()
            .copied()
            .filter(|f| p["features"].get(f).is_some())
            .collect()
    };
    let targets = |p: &Value, kind: &str, prefix: &str| -> Vec<String> {
        let mut names: Vec<String> = p["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|t| {
                t["kind"]
                    .as_array()
                    .is_some_and(|k| k.iter().any(|k| k == kind))
            })
            .filter_map(|t| t["name"].as_str())
            .filter(|n| n.starts_with(prefix))
            .map(str::to_string)
            .collect();
        names.sort();
        names
    };
    let release = |args: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        v.push("--release".into());
        v
    };

    let mut builds = Vec::new();
    let mut test_names = Vec::new();
    let mut features = Vec::new();
    for p in packages {
        let names = targets(p, "test", GPU_TEST_PREFIX);
        if names.is_empty() {
            continue;
        }
        for f in gpu_features(p) {
            features.push(format!("{}/{f}", p["name"].as_str().unwrap_or_default()));
        }
        test_names.extend(names);
    }
    test_names.sort();
    if let Some(dup) = test_names.windows(2).find(|w| w[0] == w[1]) {
        bail!(
            "two packages have a test target `{}`: the bundle names them alike",
            dup[0]
        );
    }
    if test_names.is_empty() {
        bail!(
            "no `{GPU_TEST_PREFIX}*` test targets in the workspace: the bundle would test nothing"
        );
    }
    let mut args = release(&["test", "--no-run", "--workspace"]);
    if !features.is_empty() {
        args.extend(["--features".to_string(), features.join(",")]);
    }
    for name in &test_names {
        args.extend(["--test".to_string(), name.clone()]);
    }
    builds.push(Build {
        args,
        kind: "test",
        names: test_names,
        folder: "tests",
    });

    for (pkg, kind) in TOOL_TARGETS {
        let Some(p) = package(pkg) else {
            bail!("the workspace has no package `{pkg}`");
        };
        let names = targets(p, kind, "");
        if names.is_empty() {
            continue;
        }
        let selector = if *kind == "bin" {
            "--bins"
        } else {
            "--examples"
        };
        let mut args = release(&["build", "-p", pkg, selector]);
        let features = gpu_features(p);
        if !features.is_empty() {
            args.extend(["--features".to_string(), features.join(",")]);
        }
        builds.push(Build {
            args,
            kind,
            names,
            folder: "bin",
        });
    }
    Ok(builds)
}

/// Moves the binaries (`bin/`, `tests/`) into `payload.tar.xz`, which `run.sh` unpacks
/// (with `xz`, or Python's `tarfile` where the machine has no `xz`): they shrink to
/// about a tenth. Returns the bundle's files after packing.
fn pack_payload(bundle: &Path, files: Vec<PathBuf>) -> Result<Vec<PathBuf>> {
    let payload = bundle.join(PAYLOAD);
    let status = Command::new("tar")
        .current_dir(bundle)
        .env("XZ_OPT", "-9 -T0")
        .args(["-cJf", PAYLOAD, "bin", "tests"])
        .status()
        .context("running tar (with xz: Debian's xz-utils)")?;
    if !status.success() {
        bail!("tar -cJf {} failed: {status}", payload.display());
    }
    for folder in ["bin", "tests"] {
        std::fs::remove_dir_all(bundle.join(folder))?;
    }
    let mut kept: Vec<PathBuf> = files.into_iter().filter(|f| f.exists()).collect();
    kept.push(payload);
    Ok(kept)
}

/// Copies `src` to `dest` without debug info and symbol tables (`strip --strip-all`,
/// else `objcopy`): a quarter smaller, so the bundle fits a device call; panics still
/// print their messages, backtraces lose function names.
fn strip(src: &Path, dest: &Path) -> Result<()> {
    for (tool, flag) in [("strip", "--strip-all"), ("objcopy", "--strip-all")] {
        match Command::new(tool)
            .arg(flag)
            .arg(src)
            .arg("-o")
            .arg(dest)
            .status()
        {
            Ok(status) if status.success() => return Ok(()),
            Ok(status) => bail!("{tool} {flag} {} failed: {status}", src.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).context(tool),
        }
    }
    bail!("neither `strip` nor `objcopy` is installed (Debian: binutils)")
}

/// Copies the shared libraries `binaries` load beyond glibc (as `ldd` resolves them here)
/// into `dir`, under their sonames. Returns the copies.
fn bundle_libraries(binaries: &[PathBuf], dir: &Path) -> Result<Vec<PathBuf>> {
    let mut libs: Vec<(String, PathBuf)> = Vec::new();
    for bin in binaries {
        let out = Command::new("ldd")
            .arg(bin)
            .output()
            .context("ldd (Debian: libc-bin)")?;
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines() {
            // "\tlibfabric.so.1 => /lib/x86_64-linux-gnu/libfabric.so.1 (0x...)"
            let mut f = line.split_whitespace();
            let (Some(soname), Some("=>"), Some(path)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            if path == "not" {
                bail!(
                    "{} needs {soname}, which is not installed here",
                    bin.display()
                );
            }
            if SYSTEM_LIBS.iter().any(|s| soname.starts_with(s)) {
                continue;
            }
            if !libs.iter().any(|(s, _)| s == soname) {
                libs.push((soname.to_string(), PathBuf::from(path)));
            }
        }
    }
    libs.sort();
    let mut copies = Vec::new();
    if libs.is_empty() {
        return Ok(copies);
    }
    std::fs::create_dir_all(dir)?;
    for (soname, path) in libs {
        let dest = dir.join(&soname);
        // Follows the soname link to the library itself.
        std::fs::copy(&path, &dest).with_context(|| format!("copying {}", path.display()))?;
        copies.push(dest);
    }
    Ok(copies)
}

fn set_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut perms = std::fs::metadata(path)?.permissions();
    perms.set_mode(0o755);
    std::fs::set_permissions(path, perms)?;
    Ok(())
}

fn manifest_text(
    root: &Path,
    builds: &[Build],
    bundle: &Path,
    files: &[PathBuf],
) -> Result<String> {
    let git = |args: &[&str]| -> String {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let commit = git(&["rev-parse", "HEAD"]);
    let dirty = if git(&["status", "--porcelain", "--untracked-files=no"]).is_empty() {
        ""
    } else {
        " (plus uncommitted changes)"
    };
    let mut text =
        format!("gpu bundle built by `cargo xtask gpu-bundle`\ncommit {commit}{dirty}\n");
    for build in builds {
        text.push_str(&format!("cargo {}\n", build.args.join(" ")));
    }
    for path in files {
        text.push_str(&format!(
            "{:>10}  {}\n",
            std::fs::metadata(path)?.len(),
            path.strip_prefix(bundle).unwrap_or(path).display()
        ));
    }
    Ok(text)
}

/// The script the GPU machine runs.
fn run_script(tests: &[String], tools: &[String]) -> String {
    let list = |names: &[String]| -> String {
        names
            .iter()
            .map(|n| shell_quote(n))
            .collect::<Vec<_>>()
            .join(" ")
    };
    format!(
        r#"#!/bin/bash
# Generated by `cargo xtask gpu-bundle`: runs this bundle's GPU test binaries on a GPU
# machine (no Rust toolchain needed).
#
#   bash run.sh                   every test binary, one after the other
#   bash run.sh NAME...           only these test binaries
#   bash run.sh --list            the test binaries and tools of the bundle
#   bash run.sh --tool NAME ARGS  run a bundled tool (bin/NAME) with the same environment
#
# NIXL_REQUIRE_GPU=1: a missing GPU fails the tests instead of skipping them. Each binary
# runs with --test-threads=1 --nocapture (its ignored peer tests run only through their
# parents) under a timeout of GPU_TEST_TIMEOUT seconds (default 480); GPU_TEST_ARGS adds
# libtest arguments (e.g. a test name filter). Output goes to the terminal, to
# $OUT/logs/NAME.log and, all of it, to $OUT/gpu-suite.log (OUT defaults to /tmp/gpu-out).
# A shared library this machine lacks is taken from the bundle's lib/.
set -u
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
# The binaries travel packed: unpack them next to a copy of the rest, in a temporary folder.
unpacked="$(mktemp -d "${{TMPDIR:-/tmp}}/gpu-bundle.XXXXXX")"
if command -v xz >/dev/null 2>&1; then
    tar -C "$unpacked" -xJf "$here/payload.tar.xz"
else
    python3 - "$here/payload.tar.xz" "$unpacked" <<'UNPACK'
import sys, tarfile
with tarfile.open(sys.argv[1]) as payload:
    try:
        payload.extractall(sys.argv[2], filter="tar")
    except TypeError:  # a Python without extraction filters
        payload.extractall(sys.argv[2])
UNPACK
fi || {{ echo "run.sh: cannot unpack $here/payload.tar.xz (needs xz or python3)" >&2; exit 2; }}
cp -r "$here/MANIFEST" "$here/lib" "$unpacked/" 2>/dev/null
here="$unpacked"
tests=({tests})
tools=({tools})
export NIXL_REQUIRE_GPU=1

# NVRTC (device code is compiled at run time): the loader's, else a CUDA toolkit's or a
# pip wheel's (nvidia-cuda-nvrtc) lib folder.
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so\.13'; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
      $(python3 -c 'import site; print(" ".join(p + "/nvidia/cu13/lib" for p in site.getsitepackages()))' 2>/dev/null); do
    if [ -e "$d/libnvrtc.so.13" ]; then
      export LD_LIBRARY_PATH="$d${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
      echo "run.sh: NVRTC from $d"
      break
    fi
  done
fi

# Symlinks to the bundled copies of the libraries this machine cannot resolve, first on
# the library path; everything else still comes from the system.
shim="$(mktemp -d "${{TMPDIR:-/tmp}}/gpu-bundle-libs.XXXXXX")"
trap 'rm -rf "$shim" "$unpacked"' EXIT
export LD_LIBRARY_PATH="$shim${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
resolve_libs() {{
  command -v ldd >/dev/null || return 0
  local bin lib added
  for bin in "$@"; do
    while :; do
      added=0
      for lib in $(ldd "$bin" 2>/dev/null | awk '$2 == "=>" && $3 == "not" {{ print $1 }}'); do
        if [ -e "$here/lib/$lib" ] && [ ! -e "$shim/$lib" ]; then
          ln -s "$here/lib/$lib" "$shim/$lib"
          echo "run.sh: $lib is not installed here: using the bundle's copy"
          added=1
        elif [ ! -e "$here/lib/$lib" ]; then
          echo "run.sh: $(basename "$bin") needs $lib, which neither this machine nor the bundle has"
        fi
      done
      [ "$added" = 1 ] || break
    done
  done
}}

case "${{1:-}}" in
  --list)
    echo "tests: ${{tests[*]}}"
    echo "tools: ${{tools[*]}}"
    exit 0 ;;
  --tool)
    [ $# -ge 2 ] || {{ echo "usage: run.sh --tool NAME [ARGS...] (tools: ${{tools[*]}})" >&2; exit 2; }}
    tool="$here/bin/$2"; shift 2
    [ -x "$tool" ] || {{ echo "run.sh: no tool $(basename "$tool") (tools: ${{tools[*]}})" >&2; exit 2; }}
    resolve_libs "$tool" >&2
    "$tool" "$@"; exit $? ;;
  -h|--help)
    sed -n '2,18p' "$0"; exit 0 ;;
esac

selected=("$@")
[ $# -gt 0 ] || selected=("${{tests[@]}}")
for name in "${{selected[@]}}"; do
  if [ ! -x "$here/tests/$name" ]; then
    echo "run.sh: no test binary $name (tests: ${{tests[*]}})" >&2; exit 2
  fi
done

out="${{OUT:-/tmp/gpu-out}}"
mkdir -p "$out/logs"
suite="$out/gpu-suite.log"
: > "$suite"
say() {{ echo "$*" | tee -a "$suite"; }}
say "gpu suite: $(date -u +%FT%TZ) on $(hostname), kernel $(uname -r)"
head -n 2 "$here/MANIFEST" 2>/dev/null | tee -a "$suite"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$suite"
else
  say "nvidia-smi: not found"
fi
resolve_libs "${{selected[@]/#/$here/tests/}}" 2>&1 | tee -a "$suite"

passed=0; failed=0; bad=0; failures=''
for name in "${{selected[@]}}"; do
  log="$out/logs/$name.log"
  : > "$log"
  say "=== $name"
  # shellcheck disable=SC2086
  timeout -k 10 "${{GPU_TEST_TIMEOUT:-480}}" "$here/tests/$name" --test-threads=1 --nocapture ${{GPU_TEST_ARGS:-}} 2>&1 \
    | tee -a "$log" "$suite"
  status=${{PIPESTATUS[0]}}
  read -r p f < <(awk '/^test result:/ {{ for (i = 2; i <= NF; i++) {{ if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) }} }} END {{ print p+0, f+0 }}' "$log")
  if [ "$status" != 0 ]; then
    [ "$status" = 124 ] && say "=== $name: timed out after ${{GPU_TEST_TIMEOUT:-480}} s"
    say "=== $name: exit status $status"
    # A crash or a timeout fails at least one test even without a result line.
    [ "$f" -gt 0 ] || f=1
    bad=$((bad+1)); failures="$failures $name"
  fi
  passed=$((passed+p)); failed=$((failed+f))
done
say "gpu binaries: $((${{#selected[@]}}-bad)) passed, $bad failed${{failures:+ (failed:$failures)}}"
say "gpu suite: $passed passed, $failed failed"
[ "$bad" = 0 ]
"#,
        tests = list(tests),
        tools = list(tools),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_script_is_valid_bash() {
        let script = run_script(
            &["gpu_memory".into(), "gpu_vram".into()],
            &["nixlbench".into()],
        );
        let out = Command::new("bash")
            .args(["-n", "-c", &script])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(script.contains("tests=('gpu_memory' 'gpu_vram')"));
        assert!(script.contains("export NIXL_REQUIRE_GPU=1"));
        assert!(!script.contains("--ignored"));
    }
}
