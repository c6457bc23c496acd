//! `cargo xtask rxe`: run a command in a throw-away QEMU guest that has soft-RoCE (`rxe0`).
//!
//! The host kernel has no RDMA support, so the guest boots Debian's own generic kernel
//! (the only flavour with `CONFIG_RDMA_RXE=m`) under QEMU TCG. Its root file system is the
//! host's `/` (read-only 9p under a tmpfs overlay), so binaries built on the host run
//! unchanged; the current directory is shared read-write at the same path. The command's
//! stdout, stderr and exit status come back to the caller.
//!
//! - [`kernel`]: host packages, the cache, the kernel download, `vmlinux` and modules.
//! - [`initramfs`]: busybox, the module closure and `guest-init.sh` in a cpio archive.
//! - [`guest`]: one QEMU run.
//! - [`pair`]: two guests joined by an Ethernet link (`--two-guests`).
//!
//! Cache: `${RXE_VM_CACHE:-${XDG_CACHE_HOME:-~/.cache}/rdma-rs-rxe}`. `RXE_VM_KERNEL_PKG`
//! picks another kernel package; delete the cache to pick up a newer kernel.

mod guest;
mod initramfs;
mod kernel;
mod pair;

pub use pair::PeerCommand;

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// How to boot the guest. `Default` gives what `cargo xtask rxe` uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestOptions {
    /// Wall-clock limit, boot included; past it the run returns 124.
    pub timeout: Duration,
    /// The guest must reach the command within this long, or the run ends with 125
    /// ("boot stalled"): a heavily loaded host has been seen to leave a TCG boot stuck
    /// before any console output, and a caller can then simply boot again.
    pub boot_timeout: Duration,
    pub memory_mb: u32,
    pub cpus: u32,
    /// The network device under `rxe0`.
    pub netdev: Netdev,
    /// Load `rdma_rxe` and create `rxe0` (about 0.7 s of boot).
    pub rxe: bool,
    /// Host directories shared read-write at the same path (besides the current one).
    pub extra_shares: Vec<PathBuf>,
    /// Share the current directory read-write (otherwise it is seen read-only, as at boot).
    pub share_cwd: bool,
    /// Copy the guest console and timings to stderr.
    pub verbose: bool,
    /// Extra environment for the command, on top of the caller's.
    pub env: Vec<(String, String)>,
}

impl Default for GuestOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(600),
            boot_timeout: Duration::from_secs(240),
            memory_mb: 2048,
            cpus: 2,
            netdev: Netdev::Dummy,
            rxe: true,
            extra_shares: Vec::new(),
            share_cwd: true,
            verbose: false,
            env: Vec::new(),
        }
    }
}

/// The network device `rxe0` is created on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Netdev {
    /// `dummy0`: 192.0.2.1/24, MTU 9000 (`active_mtu` 4096). rdma_cm works.
    Dummy,
    /// `lo`: verbs work (GID 1), but rdma_cm refuses loopback (`ENODEV`).
    Loopback,
}

impl Netdev {
    fn name(self) -> &'static str {
        match self {
            Netdev::Dummy => "dummy",
            Netdev::Loopback => "lo",
        }
    }
}

/// Prepare everything (packages, kernel cache, initramfs). Idempotent, fast when cached.
pub fn setup(verbose: bool) -> Result<()> {
    let boot = kernel::prepare(verbose)?;
    eprintln!(
        "rxe: ready: kernel {}, initramfs {}",
        boot.kernel.display(),
        boot.initramfs.display()
    );
    Ok(())
}

/// Boot one guest and run `command` (argv) in the current directory with the caller's
/// environment plus `opts.env` and `RXE_VM=1`. The command's stdout and stderr stream to
/// ours. Returns its exit status, 124 on timeout, 125 when the guest failed (the reason
/// and the console tail are on stderr), or 128 + signal when we were interrupted.
/// `Err` means the host side could not start the guest at all.
pub fn run_in_guest(opts: &GuestOptions, command: &[String]) -> Result<i32> {
    if command.is_empty() {
        bail!("no command to run");
    }
    let started = std::time::Instant::now();
    let boot = kernel::prepare(opts.verbose)?;
    if opts.verbose {
        eprintln!("rxe: setup took {:.2?}", started.elapsed());
    }
    guest::run(opts, command, &boot, started)
}

/// Boot two guests joined by an Ethernet link (see [`pair`]) and run `command` in guest
/// `a` and `peer` in guest `b`. Returns `a`'s status when it failed, else `b`'s; codes as
/// for [`run_in_guest`]. `opts.netdev` is ignored: each guest's `rxe0` is on its link.
pub fn run_two_guests(opts: &GuestOptions, command: &[String], peer: &PeerCommand) -> Result<i32> {
    if command.is_empty() {
        bail!("no command to run");
    }
    let started = std::time::Instant::now();
    let boot = kernel::prepare(opts.verbose)?;
    pair::run(opts, command, peer, &boot, started)
}

/// CLI: `cargo xtask rxe [options] -- <command> [args...]` and `cargo xtask rxe --setup`.
/// Returns the exit code; errors of our own are 125, as with `env(1)`, so a runner's
/// caller can tell them from the command's.
pub fn run(args: &[String]) -> Result<i32> {
    let cli = match parse_args(args) {
        Ok(cli) => cli,
        Err(err) => {
            eprintln!("rxe: {err:#}\n{USAGE}");
            return Ok(125);
        }
    };
    let result = match cli.action {
        Action::Help => {
            println!("{USAGE}");
            return Ok(0);
        }
        Action::Setup => setup(cli.opts.verbose).map(|()| 0),
        Action::Run(command) => match &cli.peer {
            Some(peer) => run_two_guests(&cli.opts, &command, peer),
            None => run_in_guest(&cli.opts, &command),
        },
    };
    Ok(result.unwrap_or_else(|err| {
        eprintln!("rxe: error: {err:#}");
        125
    }))
}

const USAGE: &str = "usage: cargo xtask rxe [options] [--] COMMAND [ARGS...]
       cargo xtask rxe --setup     install packages, fetch the kernel, build the initramfs

Runs COMMAND as root in a QEMU guest with soft-RoCE (rxe0), in the current directory
(shared read-write), with the caller's environment plus RXE_VM=1 and stdin /dev/null. The guest's root is the
host's / (read-only, writes go to a tmpfs). Exit status: the command's; 124 timeout;
125 the guest or this tool failed.

options:
  -t, --timeout SEC   give up after SEC seconds, boot included (default 600)
      --boot-timeout SEC  exit 125 if the guest has not reached the command after SEC
                      seconds (default 240; a starved TCG boot can stall silently)
  -m, --mem MB        guest memory (default 2048)
  -s, --smp N         guest CPUs (default 2; busy-polling tools need 2)
  -n, --netdev DEV    dummy: rxe0 on dummy0, 192.0.2.1/24, MTU 9000 (default)
                      lo: rxe0 on lo (verbs only; rdma_cm refuses loopback)
      --no-rxe        skip rdma_rxe and rxe0
      --share DIR     also share DIR read-write at the same path (repeatable)
      --no-cwd        do not share the current directory
  -v, --verbose       guest console and timings on stderr
      --two-guests    boot two guests, a (192.0.2.1) and b (192.0.2.2), each with rxe0 on
                      its own NIC, joined by an Ethernet link (MTU 1500); COMMAND runs in a,
                      and b serves a's requests (xtask/src/rxe/pair.rs) unless --guest-b
      --guest-b CMD   with --two-guests: run the shell command CMD (sh -c) in guest b; the
                      exit status is a's if it failed, else b's; both are reported
  -h, --help

environment: RXE_VM_CACHE (cache dir), RXE_VM_KERNEL_PKG (kernel package to use)";

#[derive(Debug, PartialEq, Eq)]
enum Action {
    Help,
    Setup,
    Run(Vec<String>),
}

#[derive(Debug)]
struct Cli {
    opts: GuestOptions,
    action: Action,
    /// `Some` in the two-guest mode: what guest b runs.
    peer: Option<PeerCommand>,
}

fn parse_args(args: &[String]) -> Result<Cli> {
    let mut opts = GuestOptions::default();
    let mut setup_only = false;
    let (mut two_guests, mut guest_b) = (false, None);
    let mut rest = args.iter();
    let mut command = Vec::new();
    while let Some(arg) = rest.next() {
        // `--name=value` is the same as `--name value`.
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value.to_string())),
            _ => (arg.as_str(), None),
        };
        if inline.is_some()
            && matches!(
                name,
                "--no-rxe" | "--no-cwd" | "--verbose" | "--setup" | "--two-guests"
            )
        {
            bail!("{name} takes no value");
        }
        let mut value = || -> Result<String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => rest
                    .next()
                    .cloned()
                    .with_context(|| format!("{name} needs a value")),
            }
        };
        match name {
            "-t" | "--timeout" => opts.timeout = Duration::from_secs(number(name, &value()?)?),
            "--boot-timeout" => opts.boot_timeout = Duration::from_secs(number(name, &value()?)?),
            "-m" | "--mem" => opts.memory_mb = number(name, &value()?)?,
            "-s" | "--smp" => opts.cpus = number(name, &value()?)?,
            "-n" | "--netdev" => {
                opts.netdev = match value()?.as_str() {
                    "dummy" => Netdev::Dummy,
                    "lo" => Netdev::Loopback,
                    other => bail!("--netdev: expected dummy or lo, got `{other}`"),
                }
            }
            "--share" => opts.extra_shares.push(value()?.into()),
            "--no-rxe" => opts.rxe = false,
            "--no-cwd" => opts.share_cwd = false,
            "-v" | "--verbose" => opts.verbose = true,
            "--setup" => setup_only = true,
            "--two-guests" => two_guests = true,
            "--guest-b" => guest_b = Some(value()?),
            "-h" | "--help" => {
                return Ok(Cli {
                    opts,
                    action: Action::Help,
                    peer: None,
                })
            }
            "--" => {
                command.extend(rest.cloned());
                break;
            }
            _ if arg.starts_with('-') => bail!("unknown option `{arg}`"),
            // The first word that is not an option starts the command.
            _ => {
                command.push(arg.clone());
                command.extend(rest.cloned());
                break;
            }
        }
    }
    if opts.memory_mb < 256 || opts.cpus == 0 || opts.timeout.is_zero() {
        bail!("--mem must be at least 256, --smp and --timeout at least 1");
    }
    let action = match (setup_only, command.is_empty()) {
        (true, true) => Action::Setup,
        (true, false) => bail!("--setup takes no command"),
        (false, true) => bail!("no command given"),
        (false, false) => Action::Run(command),
    };
    let peer = match (two_guests, guest_b) {
        (false, None) => None,
        (false, Some(_)) => bail!("--guest-b needs --two-guests"),
        (true, _) if !opts.rxe => bail!("--two-guests needs rxe (no --no-rxe)"),
        (true, None) => Some(PeerCommand::Serve),
        (true, Some(cmd)) => Some(PeerCommand::Run(vec!["sh".into(), "-c".into(), cmd])),
    };
    Ok(Cli { opts, action, peer })
}

fn number<T: std::str::FromStr>(option: &str, text: &str) -> Result<T> {
    text.parse()
        .ok()
        .with_context(|| format!("{option}: expected a whole number, got `{text}`"))
}

/// A uniquely named directory, removed with its contents on drop.
#[derive(Debug)]
struct TempDir(PathBuf);

impl TempDir {
    fn new_in(parent: &Path, prefix: &str) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        use std::sync::atomic::{AtomicU32, Ordering};
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = parent.join(format!("{prefix}{}.{n}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(Self(path)),
                // Left over from a dead process with the same pid: take the next name.
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(err) => {
                    return Err(err).with_context(|| format!("creating {}", path.display()))
                }
            }
        }
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Run a command with inherited stderr; fail on a non-zero status.
fn check(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

fn output_bytes(cmd: &mut Command) -> Result<Vec<u8>> {
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({})", out.status);
    }
    Ok(out.stdout)
}

fn output(cmd: &mut Command) -> Result<String> {
    String::from_utf8(output_bytes(cmd)?).context("output is not UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli> {
        parse_args(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    fn command(args: &[&str]) -> Vec<String> {
        match parse(args).unwrap().action {
            Action::Run(command) => command,
            other => panic!("expected a command, got {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let cli = parse(&["--", "true"]).unwrap();
        assert_eq!(cli.opts, GuestOptions::default());
        assert_eq!(cli.opts.timeout, Duration::from_secs(600));
        assert_eq!((cli.opts.memory_mb, cli.opts.cpus), (2048, 2));
        assert!(cli.opts.rxe && cli.opts.share_cwd && !cli.opts.verbose);
        assert_eq!(cli.action, Action::Run(vec!["true".into()]));
    }

    #[test]
    fn options() {
        let tmp = std::env::temp_dir().canonicalize().unwrap();
        let cli = parse(&[
            "-t",
            "5",
            "--mem=512",
            "-s",
            "3",
            "-n",
            "lo",
            "--no-rxe",
            "--no-cwd",
            "-v",
            "--share",
            tmp.to_str().unwrap(),
            "--",
            "sleep",
            "100",
        ])
        .unwrap();
        let o = &cli.opts;
        assert_eq!(o.timeout, Duration::from_secs(5));
        assert_eq!((o.memory_mb, o.cpus, o.netdev), (512, 3, Netdev::Loopback));
        assert!(!o.rxe && !o.share_cwd && o.verbose);
        assert_eq!(o.extra_shares, vec![tmp]);
        assert_eq!(cli.action, Action::Run(vec!["sleep".into(), "100".into()]));
    }

    #[test]
    fn options_after_the_command_belong_to_it() {
        assert_eq!(
            command(&["--", "ls", "-t", "--", "-v"]),
            ["ls", "-t", "--", "-v"]
        );
        assert_eq!(command(&["-v", "ls", "-t"]), ["ls", "-t"]);
        assert_eq!(command(&["--", "--setup"]), ["--setup"]);
    }

    #[test]
    fn two_guests() {
        let cli = parse(&["--two-guests", "--", "true"]).unwrap();
        assert_eq!(cli.peer, Some(PeerCommand::Serve));
        let cli = parse(&["--two-guests", "--guest-b", "ib_write_bw", "true"]).unwrap();
        assert_eq!(
            cli.peer,
            Some(PeerCommand::Run(vec![
                "sh".into(),
                "-c".into(),
                "ib_write_bw".into()
            ]))
        );
        assert_eq!(parse(&["--", "true"]).unwrap().peer, None);
        for args in [
            &["--guest-b", "x", "true"][..],
            &["--two-guests", "--no-rxe", "true"],
            &["--two-guests=1", "true"],
        ] {
            assert!(parse(args).is_err(), "{args:?} was accepted");
        }
    }

    #[test]
    fn setup_and_help() {
        assert_eq!(parse(&["--setup", "-v"]).unwrap().action, Action::Setup);
        assert_eq!(
            parse(&["-t", "1", "--help", "junk"]).unwrap().action,
            Action::Help
        );
    }

    #[test]
    fn bad_arguments() {
        for args in [
            &[][..],
            &["-t"],
            &["-t", "soon", "true"],
            &["-t", "0", "true"],
            &["--mem", "-1", "true"],
            &["-n", "eth0", "true"],
            &["--bogus", "true"],
            &["--verbose=yes", "true"],
            &["--setup", "true"],
            &["-v", "--"],
        ] {
            assert!(parse(args).is_err(), "{args:?} was accepted");
        }
    }

    #[test]
    fn temp_dirs_are_unique_and_removed() {
        let a = TempDir::new_in(&std::env::temp_dir(), "rxe-test.").unwrap();
        let b = TempDir::new_in(&std::env::temp_dir(), "rxe-test.").unwrap();
        assert_ne!(a.path(), b.path());
        let path = a.path().to_path_buf();
        std::fs::write(path.join("f"), "x").unwrap();
        drop(a);
        assert!(!path.exists());
    }
}
