//! `nixl-soak`: many agents in separate processes on this host joining, transferring
//! verified data with random peers, leaving and crashing at random, for a bounded time.
//!
//! ```text
//! nixl-soak [--agents 32] [--duration 3m] [--metadata p2p|etcd|both] [--provider tcp;ofi_rxm] ...
//! ```
//!
//! The coordinator (this process) starts `--agents` workers (this binary again, `worker`
//! subcommand), one agent each, tells every worker who is up (their listeners for
//! peer-to-peer metadata; etcd keys by name otherwise), and injects faults: a worker is
//! SIGKILLed or asked to leave cleanly, at random, then started again under the same
//! name. The first `--long-lived` workers are never faulted: their file descriptors,
//! threads and resident memory, sampled from `/proc`, must stay flat after the warm-up.
//!
//! Each worker WRITEs (with a notification, verified by the target, whose
//! acknowledgement the initiator READs back) and READs (verified by the initiator)
//! random sizes to and from random peers. A dead peer's typed error is counted and the
//! worker goes on; anything a fault does not explain is a problem.
//!
//! The run prints a table every `--report-every` and a summary at the end, and exits 1
//! on any corrupted byte, a wait past `--stall-bound`, an unexpected error or exit, a
//! panic, or growth beyond the slack; 0 otherwise. `--json FILE` writes the summary as
//! JSON. Figures of past runs: `docs/SOAK.md`.

mod coordinator;
mod worker;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Soak test: many agents in separate processes, verified transfers, random crashes and
/// restarts; fails on corruption, stalls, unexpected errors or resource growth
#[derive(Parser, Debug)]
#[command(
    name = "nixl-soak",
    version,
    max_term_width = 100,
    args_conflicts_with_subcommands = true,
    after_help = "Exit status: 0 when every check passed, 1 when one failed, 2 for a wrong \
command line. RUST_LOG sets the libraries' log (workers log into the run folder)."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    run: coordinator::Options,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// One agent of a run (started by the coordinator; reads its directory on stdin).
    #[command(hide = true)]
    Worker {
        /// The worker's configuration, JSON.
        #[arg(long)]
        config: String,
    },
}

fn main() -> ExitCode {
    tools::cli::init_tracing();
    let cli: Cli = tools::cli::parse_or_exit("nixl-soak");
    match cli.command {
        Some(Cmd::Worker { config }) => match serde_json::from_str(&config) {
            Ok(config) => worker::main(config),
            Err(e) => tools::cli::fail("nixl-soak worker", format!("bad --config: {e}")),
        },
        None => coordinator::main(cli.run),
    }
}
