//! What the binaries of this package share: their command-line conventions.
//!
//! - [`cli`]: the tracing subscriber every binary installs (`RUST_LOG`, standard error),
//!   and clap's outcomes turned into the tools' contract: `--help` and `--version` on
//!   standard output with exit status 0, errors as one line on standard error that ends
//!   with where to look, exit status 2.
//! - [`gflags`]: argument forms as NIXL's nixlbench (gflags) reads them — `--flag value`,
//!   `--flag=value`, `-flag`, `-` or `_` alike in names, booleans as `--x`, `--x=false`,
//!   `--nox` — rewritten into the one form clap parses.
//! - [`units`]: byte sizes with binary suffixes (`64K`, `8GiB`) in and out.
//! - [`backend`]: backend names checked against this build's `nixl` before anything
//!   starts (`UCX` runs `LIBFABRIC`, as the Python package maps it).
//! - [`kv`]: `kvbench`'s paged KV cache: layouts, the block ids of each request, the
//!   data pattern and what every block holds afterwards.
//! - [`rdma`]: this machine's RDMA devices, so a `--device_list` naming one it lacks is
//!   refused at once.
//! - [`soak`]: `nixl-soak`'s coordinator–worker messages, data patterns, `/proc` samples
//!   and growth check.
//!
//! The binaries are the product; this library exists so that they behave alike and is
//! not meant as a stable API.

pub mod backend;
pub mod cli;
pub mod gflags;
pub mod kv;
pub mod rdma;
pub mod soak;
pub mod units;
