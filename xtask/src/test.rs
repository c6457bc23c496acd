//! `cargo xtask test`: the whole test suite on a fresh machine.
//!
//! 1. installs the Debian packages that are missing;
//! 2. runs `cargo test --workspace` on the host, where tests that need an RDMA device
//!    or a GPU skip with a printed reason (the two-network-namespace tests `netns_*` run
//!    when we are root, and then must not skip), and every device source is compiled with NVRTC
//!    (fetched into target/nvrtc by `cargo xtask nvrtc`; a kernel that does not compile
//!    fails); `nixl`'s agent core alone (`--no-default-features`) builds and passes its
//!    tests with pkg-config hidden, so no RDMA library can be in its build;
//! 3. builds the Python extension (`python/`, PyO3 + maturin) into a venv under
//!    `target/pyenv` and runs its pytest suite (`python/tests`) against it;
//! 4. builds every test target whose name starts with `rxe_` and runs them all in ONE
//!    soft-RoCE guest boot with `RDMA_TEST_DEVICE=rxe0`, where a missing device fails;
//! 5. runs the targets named `rxe2_` in guest `a` of ONE two-guest boot (`cargo xtask
//!    rxe --two-guests`: two soft-RoCE guests joined by an Ethernet link), guest `b`
//!    serving their peers (and killed and rebooted when a test asks).

use crate::bindings::workspace_root;
use crate::rxe::{self, GuestOptions};
use anyhow::{bail, Context, Result};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Test targets with this name prefix need an RDMA device and run in the guest.
const GUEST_TEST_PREFIX: &str = "rxe_";
/// Test targets with this name prefix run in guest `a` of the two-guest mode
/// (`cargo xtask rxe --two-guests`), with guest `b` serving them.
const TWO_GUEST_TEST_PREFIX: &str = "rxe2_";
/// How the guest suite names a library's unit-test binary, which it runs with the filter
/// [`GUEST_TEST_PREFIX`] (only its guest tests).
const GUEST_LIB_PREFIX: &str = "lib:";
/// The device every guest test is told to use.
const GUEST_DEVICE: &str = "rxe0";

pub fn run(args: &[String]) -> Result<i32> {
    let (mut host, mut guest, mut two_guests, mut python) = (true, true, true, true);
    for arg in args {
        match arg.as_str() {
            "--host-only" => (guest, two_guests) = (false, false),
            "--guest-only" => (host, python) = (false, false),
            "--two-guests-only" => (host, guest, python) = (false, false, false),
            "--python-only" => (host, guest, two_guests) = (false, false, false),
            other => bail!(
                "usage: cargo xtask test [--host-only|--guest-only|--two-guests-only|--python-only] (got `{other}`)"
            ),
        }
    }
    crate::deps::ensure_workspace_packages()?;
    let root = workspace_root();
    if host {
        // Device code is compiled by NVRTC in the host tests: every kernel must compile.
        let nvrtc = crate::nvrtc::ensure()?;
        // As root the two-namespace LIBFABRIC tests (nixl/tests/netns_*.rs) must run: a
        // missing `ip netns` fails them instead of skipping.
        // SAFETY: geteuid has no preconditions and touches no memory.
        let require_netns = if unsafe { libc::geteuid() } == 0 {
            // `ip netns` (a minimal Debian image lacks it; `unshare` is essential).
            crate::deps::ensure_packages(&["iproute2"])?;
            "1"
        } else {
            "0"
        };
        // Feature-gated suites that need only host software (etcd on loopback), and the
        // GPU code built with features `cuda` and `gpunetio` (which implies it): its unit
        // tests and NVRTC checks of the device sources run, its GPU tests skip here with
        // a printed reason (they run on a GPU machine: `cargo xtask gpu-bundle`).
        for args in [
            &["test", "--workspace"][..],
            &["test", "-p", "rdma-rs-nixl", "--no-default-features"][..],
            // Only what feature `etcd` changes: the library (its etcd module) and the etcd
            // suites; every other test target is the same binary as without it, built and
            // run above (rebuilding them all doubled the suite's disk and time).
            &[
                "test",
                "-p",
                "rdma-rs-nixl",
                "--features",
                "etcd",
                "--lib",
                "--test",
                "etcd*",
            ][..],
            &[
                "test",
                "-p",
                "rdma-rs-tools",
                "--features",
                "cuda,etcd,file",
                "--bin",
                "nixlbench",
                "--test",
                "nixlbench_etcd",
                "--test",
                "gpu_nixlbench",
                "--test",
                "nixlbench_file",
                "--test",
                "gpu_nixlbench_file",
                "--test",
                "cli",
                // The soak through etcd (its P2P run is part of the workspace's tests).
                "--test",
                "soak",
            ][..],
            &[
                "test",
                "-p",
                "rdma-rs-nixl",
                "--features",
                "file,posix",
                "--lib",
                "--test",
                "file_backend",
                "--test",
                "posix_backend",
            ][..],
            &[
                "test",
                "-p",
                "rdma-rs-nixl",
                "--features",
                "gpunetio,file,posix",
                "--lib",
                "--test",
                "gpu_*",
                "--test",
                "agent_local",
            ][..],
        ] {
            eprintln!("xtask: host tests (cargo {})", args.join(" "));
            let mut command = cargo(&root);
            if args.contains(&"--no-default-features") {
                // The agent core alone: with pkg-config hidden, any RDMA `-sys` crate in its
                // build fails to find its library.
                command
                    .env("PKG_CONFIG_LIBDIR", "/nonexistent")
                    .env("PKG_CONFIG_PATH", "");
            }
            let status = command
                .args(args)
                .env("LD_LIBRARY_PATH", crate::nvrtc::library_path(&nvrtc))
                .env("GPUNETIO_REQUIRE_NVRTC", "1")
                .env("NIXL_REQUIRE_NETNS", require_netns)
                .status()?;
            if !status.success() {
                eprintln!("xtask: host tests failed");
                return Ok(status.code().unwrap_or(1));
            }
        }
    }
    if python {
        let code = python_suite(&root)?;
        if code != 0 {
            eprintln!("xtask: Python suite failed");
            return Ok(code);
        }
    }
    if guest || two_guests {
        rxe::setup(false)?;
        let binaries = build_guest_tests(&root)?;
        let (pair, single): (Vec<_>, Vec<_>) = binaries
            .into_iter()
            .partition(|(name, _)| name.starts_with(TWO_GUEST_TEST_PREFIX));
        let env = vec![("RDMA_TEST_DEVICE".to_string(), GUEST_DEVICE.to_string())];
        if guest {
            if single.is_empty() {
                bail!("no `{GUEST_TEST_PREFIX}*` test targets were built: the guest suite would test nothing");
            }
            let script = write_suite_script(&root, "run.sh", &single)?;
            eprintln!("xtask: {} guest test binaries, one boot", single.len());
            let options = GuestOptions {
                timeout: Duration::from_secs(40 * 60),
                env: env.clone(),
                ..GuestOptions::default()
            };
            let command = ["bash".to_string(), script.display().to_string()];
            let code = retry_boot_failure(|| rxe::run_in_guest(&options, &command))?;
            if code != 0 {
                eprintln!("xtask: guest suite failed (exit status {code})");
                return Ok(code);
            }
        }
        if two_guests {
            if pair.is_empty() {
                bail!("no `{TWO_GUEST_TEST_PREFIX}*` test targets were built: the two-guest suite would test nothing");
            }
            let script = write_suite_script(&root, "run2.sh", &pair)?;
            eprintln!(
                "xtask: {} two-guest test binaries, in guest a of one two-guest boot",
                pair.len()
            );
            let options = GuestOptions {
                timeout: Duration::from_secs(20 * 60),
                env,
                ..GuestOptions::default()
            };
            let command = ["bash".to_string(), script.display().to_string()];
            let started = std::time::Instant::now();
            let code = retry_boot_failure(|| {
                rxe::run_two_guests(&options, &command, &rxe::PeerCommand::Serve)
            })?;
            eprintln!("xtask: two-guest suite took {:.0?}", started.elapsed());
            if code != 0 {
                eprintln!("xtask: two-guest suite failed (exit status {code})");
                return Ok(code);
            }
        }
    }
    Ok(0)
}

/// Runs a guest suite, and once more when the harness (not a test) failed: exit status
/// 125, e.g. a boot stalled on a starved host.
fn retry_boot_failure(mut run: impl FnMut() -> Result<i32>) -> Result<i32> {
    let code = run()?;
    if code != 125 {
        return Ok(code);
    }
    eprintln!("xtask: the guest failed before finishing; booting once more");
    run()
}

/// Python packages the extension's build and suite need, installed into the venv.
const PYTHON_PACKAGES: &[&str] = &["maturin>=1.5,<2", "pytest", "numpy"];

/// Builds the `rdma_nixl` extension into `target/pyenv` (created with the system
/// `python3` on first use) and runs `python/tests` there; returns pytest's exit status.
fn python_suite(root: &Path) -> Result<i32> {
    let venv = root.join("target/pyenv");
    let python = venv.join("bin/python");
    if !python.exists() {
        eprintln!("xtask: creating {}", venv.display());
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .context("python3 -m venv (Debian: python3-venv)")?;
        if !status.success() {
            bail!("python3 -m venv {} failed", venv.display());
        }
    }
    let status = Command::new(&python)
        .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
        .args(PYTHON_PACKAGES)
        .status()
        .context("pip install into target/pyenv")?;
    if !status.success() {
        bail!("pip install {} failed", PYTHON_PACKAGES.join(" "));
    }
    // `maturin develop` installs into the venv named by VIRTUAL_ENV, building in a target
    // directory of its own (python/ is a separate cargo project with its own lock file).
    let path = std::env::join_paths(std::iter::once(venv.join("bin")).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))?;
    eprintln!("xtask: building the Python extension (maturin develop --release)");
    let status = Command::new(venv.join("bin/maturin"))
        .args(["develop", "--release", "--quiet", "--manifest-path"])
        .arg(root.join("python/Cargo.toml"))
        .env("VIRTUAL_ENV", &venv)
        .env("PATH", &path)
        .env("CARGO_TARGET_DIR", root.join("target/python"))
        .status()
        .context("maturin develop")?;
    if !status.success() {
        bail!("building the Python extension failed");
    }
    eprintln!("xtask: Python suite (pytest python/tests)");
    let status = Command::new(&python)
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "python/tests",
        ])
        .current_dir(root)
        .env("NIXL_PY_IMPL", "ours")
        .env("PATH", &path)
        .status()
        .context("pytest")?;
    Ok(status.code().unwrap_or(1))
}

pub(crate) fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root);
    cmd
}

/// `cargo metadata --format-version 1` with `args` (e.g. `--no-deps`), parsed.
pub(crate) fn cargo_metadata(root: &Path, args: &[&str]) -> Result<serde_json::Value> {
    let out = cargo(root)
        .args(["metadata", "--format-version", "1"])
        .args(args)
        .output()
        .context("cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    serde_json::from_slice(&out.stdout).context("cargo metadata's JSON")
}

/// Builds all test targets (same profile as the host run, so nothing is rebuilt) and
/// returns the executables of those named `rxe_*` and `rxe2_*`, as (target name, path).
fn build_guest_tests(root: &Path) -> Result<Vec<(String, PathBuf)>> {
    let keep = |kinds: &[&str], name: &str| {
        kinds.contains(&"test")
            && (name.starts_with(GUEST_TEST_PREFIX) || name.starts_with(TWO_GUEST_TEST_PREFIX))
    };
    // Libraries' unit tests named `rxe_*` run in the guest too (the binary, filtered):
    // keep every library's test binary, under a name that says so.
    let keep_lib = |kinds: &[&str], _: &str| kinds.contains(&"lib");
    let mut binaries = built_executables(root, &["test", "--workspace", "--no-run"], keep)?;
    binaries.extend(
        built_executables(
            root,
            &["test", "--workspace", "--lib", "--no-run"],
            keep_lib,
        )?
        .into_iter()
        .map(|(name, path)| (format!("{GUEST_LIB_PREFIX}{name}"), path)),
    );
    // Guest suites behind a feature (`required-features` on the target), built for their
    // package alone so that nothing else is rebuilt with the feature.
    binaries.extend(built_executables(
        root,
        &[
            "test",
            "-p",
            "rdma-rs-hf3fs-gdr",
            "--features",
            "rdma",
            "--no-run",
        ],
        keep,
    )?);
    binaries.sort();
    binaries.dedup();
    Ok(binaries)
}

/// Runs the cargo build command `args` (JSON messages are asked for) and returns the
/// executables it produced whose target `keep(kinds, name)` accepts, as (target name,
/// path), sorted.
pub(crate) fn built_executables(
    root: &Path,
    args: &[&str],
    keep: impl Fn(&[&str], &str) -> bool,
) -> Result<Vec<(String, PathBuf)>> {
    let mut child = cargo(root)
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cargo {}", args.join(" ")))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut binaries = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line?;
        let Ok(message) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let target = &message["target"];
        let kinds: Vec<&str> = target["kind"]
            .as_array()
            .map(|kinds| kinds.iter().filter_map(|k| k.as_str()).collect())
            .unwrap_or_default();
        let name = target["name"].as_str().unwrap_or_default();
        if let (true, Some(executable)) = (keep(&kinds, name), message["executable"].as_str()) {
            binaries.push((name.to_string(), PathBuf::from(executable)));
        }
    }
    if !child.wait()?.success() {
        bail!("cargo {} failed", args.join(" "));
    }
    binaries.sort();
    binaries.dedup();
    Ok(binaries)
}

/// The in-guest driver `target/rxe-suite/<name>`: checks the device, runs each binary,
/// prints a summary line.
fn write_suite_script(root: &Path, name: &str, binaries: &[(String, PathBuf)]) -> Result<PathBuf> {
    let dir = root.join("target/rxe-suite");
    std::fs::create_dir_all(&dir)?;
    let mut script = String::from(
        "#!/bin/bash\n\
         # generated by `cargo xtask test`: runs these test binaries in this guest\n\
         set -u\n\
         if ! ibv_devices | grep -qw \"$RDMA_TEST_DEVICE\"; then\n\
         \x20 echo \"guest suite: RDMA device $RDMA_TEST_DEVICE is missing\" >&2; exit 1\n\
         fi\n\
         passed=0; failed=0; failures=''\n\
         run() {\n\
         \x20 echo \"=== $1\"\n\
         \x20 \"$2\" \"${@:3}\" 2>&1 | tee -a /tmp/rxe-suite.log\n\
         \x20 if [ \"${PIPESTATUS[0]}\" = 0 ]; then passed=$((passed+1)); else failed=$((failed+1)); failures=\"$failures $1\"; fi\n\
         }\n",
    );
    for (name, path) in binaries {
        // A library's unit tests: only its guest ones (`rxe_*`).
        let filter = if name.starts_with(GUEST_LIB_PREFIX) {
            format!(" {GUEST_TEST_PREFIX}")
        } else {
            String::new()
        };
        script.push_str(&format!(
            "run {} {}{filter}\n",
            shell_quote(name),
            shell_quote(&path.display().to_string())
        ));
    }
    script.push_str(
        "echo \"guest binaries: $passed passed, $failed failed${failures:+ (failed:$failures)}\"\n\
         set -- $(awk '/^test result:/ { for (i = 2; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } } END { print p+0, f+0 }' /tmp/rxe-suite.log); tp=$1; tf=$2\n\
         [ \"$tf\" -lt \"$failed\" ] && tf=$failed\n\
         echo \"guest: $tp passed, $tf failed\"\n\
         [ \"$failed\" = 0 ]\n",
    );
    let path = dir.join(name);
    std::fs::write(&path, script)?;
    Ok(path)
}

pub(crate) fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::shell_quote;

    #[test]
    fn quotes_survive_the_shell() {
        let quoted = shell_quote("it's a $path");
        let out = std::process::Command::new("sh")
            .args(["-c", &format!("printf %s {quoted}")])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8(out.stdout).unwrap(), "it's a $path");
    }
}
