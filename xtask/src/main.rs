//! `cargo xtask <command>`: the project's build helpers.
//!
//! - `bindgen [--check]`: regenerate the committed FFI bindings of the `-sys` crates
//!   (`--check`: regenerate into a temporary directory and fail on any difference).
//! - `rxe [options] -- <command>`: run a command in a QEMU guest with soft-RoCE (`rxe0`).
//! - `test`: install what is missing, run the host tests, then every RDMA test binary
//!   in one guest boot.
//! - `deps`: install the Debian packages the workspace needs (idempotent).
//! - `gpu-bundle [--list]`: build every `gpu_*` test target and GPU tool in release,
//!   stripped into `target/gpu-bundle/` with a `run.sh`, for a GPU machine that has no
//!   Rust toolchain (`--list`: what would be included, building nothing).
//! - `modcycles [--crate DIR]...`: report import circles between sibling modules of each
//!   crate (every workspace library by default); exit status 1 if there is one.
//! - `msrv`: the declared `rust-version` is one the lock files satisfy.

mod bindings;
mod deps;
mod gpu;
mod modcycles;
mod msrv;
mod nvrtc;
mod rxe;
mod test;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((command, rest)) = args.split_first() else {
        eprintln!("{}", USAGE);
        return ExitCode::from(2);
    };
    let result = match command.as_str() {
        "bindgen" => bindings::run(rest),
        "rxe" => rxe::run(rest),
        "test" => test::run(rest),
        "deps" => deps::ensure_workspace_packages().map(|()| 0),
        "gpu-bundle" => gpu::run(rest),
        "nvrtc" => nvrtc::run(rest),
        "modcycles" => modcycles::run(rest),
        "msrv" => msrv::run(rest),
        "-h" | "--help" | "help" => {
            println!("{}", USAGE);
            Ok(0)
        }
        other => {
            eprintln!("xtask: unknown command `{other}`\n{USAGE}");
            Ok(2)
        }
    };
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::from(1)
        }
    }
}

const USAGE: &str = "usage: cargo xtask <command>
  bindgen [--check]          regenerate committed bindings (--check: fail on a diff)
  nvrtc                      fetch NVRTC (nvidia-cuda-nvrtc wheel, 13.0) into target/nvrtc, print its lib folder
  rxe [options] -- CMD ...   run CMD in the soft-RoCE QEMU guest (rxe0); `rxe --help` for options
  test [--host-only|--guest-only|--python-only]
                             install deps, run host tests, the Python package's pytest suite
                             (python/, in target/pyenv), then all RDMA tests in one guest
                             boot; --python-only: just the Python suite
  deps                       install the Debian packages the workspace needs
  modcycles [--crate DIR]... report import circles between sibling modules (exit 1 if any);
                             default: every library of the workspace
  msrv                       check the declared rust-version against what the locks need
  gpu-bundle [--list]        build every gpu_* test and GPU tool (release, stripped) into
                             target/gpu-bundle/ with a run.sh; --list: show, build nothing.
                             Copy target/gpu-bundle to the GPU machine (no Rust needed), then
                             `bash target/gpu-bundle/run.sh [NAME...]`: NIXL_REQUIRE_GPU=1,
                             logs in $OUT/gpu-suite.log and $OUT/logs/ (OUT: /tmp/gpu-out)";
