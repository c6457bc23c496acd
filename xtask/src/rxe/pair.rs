//! The two-guest mode (`cargo xtask rxe --two-guests`): guests `a` and `b`, each with its
//! own soft-RoCE device `rxe0` on its own virtio NIC `eth0`, joined by an Ethernet link
//! made of two unix datagram sockets on the host (QEMU's `dgram` netdev: no host network,
//! no privileges). `a` is 192.0.2.1/24, `b` 192.0.2.2/24, MTU 1500.
//!
//! Guest `a` runs the command. Guest `b` runs `--guest-b`'s command, or by default serves
//! guest `a`: it runs the commands `a` asks for, through a directory both guests share
//! read-write (`RXE_PAIR_DIR`). The protocol, for tests (nixl/tests/common/peer_guest.rs
//! is a client):
//!
//! - `b/ready`: guest `b` serves (removed when it goes away).
//! - `b/<id>.req`: a script for `b`'s bash (written whole: `.tmp`, then renamed). `b`
//!   renames it `<id>.sh`, runs it in the background and writes `<id>.pid`, then
//!   `<id>.out` (stdout and stderr) and, when it ends, `<id>.rc` (its exit status).
//! - `b/<id>.kill`: `b` kills that command (SIGKILL).
//! - `kill-guest-b`: the host kills guest `b`'s QEMU — the whole host is gone at once, as
//!   on a power cut — empties `b/`, writes `guest-b-killed`, then boots a fresh guest `b`
//!   (a new `ready` appears once it serves again).
//! - `done`: written by the host when `a`'s command ended; `b` stops serving.
//!
//! Both guests see `RXE_GUEST` (`a`/`b`), `RXE_ADDR`, `RXE_PEER_ADDR` and `RXE_PAIR_DIR`.

use super::guest::{self, End, Guest, LinkEnd, SignalGuard, SIGNAL};
use super::kernel::Boot;
use super::{GuestOptions, TempDir};
use anyhow::{Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

/// The guests' addresses on the link.
pub const ADDR_A: &str = "192.0.2.1";
pub const ADDR_B: &str = "192.0.2.2";
/// How long guest `b` may take to stop by itself once `a` is done.
const B_GRACE: Duration = Duration::from_secs(10);

/// What guest `b` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerCommand {
    /// Serve guest `a`'s requests (see the module docs).
    Serve,
    /// Run this command (argv), as guest `a` runs its own.
    Run(Vec<String>),
}

/// Guest `b`'s service loop. Bash, for `read -t` as a sleep without a process (each
/// process costs tens of milliseconds under TCG).
const SERVE_SCRIPT: &str = r#"#!/bin/bash
# Guest b of `cargo xtask rxe --two-guests`: runs what guest a asks (xtask/src/rxe/pair.rs).
set -u
dir=$RXE_PAIR_DIR/b
exec {nap}<> <(:)
start() {
	local id=$1
	mv "$dir/$id.req" "$dir/$id.sh" || return
	# (bash's "Killed" notices of the commands killed on order are dropped.)
	(
		bash "$dir/$id.sh" >"$dir/$id.out" 2>&1 </dev/null &
		echo $! >"$dir/$id.pid.tmp" && mv "$dir/$id.pid.tmp" "$dir/$id.pid"
		wait $!
		echo $? >"$dir/$id.rc.tmp" && mv "$dir/$id.rc.tmp" "$dir/$id.rc"
	) 2>/dev/null &
}
read -r up _ </proc/uptime
echo "$up" >"$dir/ready.tmp" && mv "$dir/ready.tmp" "$dir/ready"
echo "guest b serves (booted ${up}s ago)"
while [ ! -e "$RXE_PAIR_DIR/done" ]; do
	for req in "$dir"/*.req; do
		[ -e "$req" ] || continue
		id=${req##*/}
		start "${id%.req}"
	done
	for order in "$dir"/*.kill; do
		[ -e "$order" ] || continue
		id=${order##*/}
		id=${id%.kill}
		if [ -e "$dir/$id.pid" ]; then
			kill -9 "$(<"$dir/$id.pid")" 2>/dev/null
			rm -f "$order"
		elif [ ! -e "$dir/$id.sh" ] && [ ! -e "$dir/$id.req" ]; then
			# Nothing of that id runs here (e.g. it ran in a guest b since killed).
			rm -f "$order"
		fi
		# Else it is starting: its .pid comes next.
	done
	read -t 0.02 -u $nap
done
kill -9 $(jobs -p) 2>/dev/null
exit 0
"#;

/// Boots both guests, runs `command` in `a` and `peer` in `b`; returns `a`'s status when
/// it failed, else `b`'s (both are reported on stderr). Codes as for one guest.
pub(super) fn run(
    opts: &GuestOptions,
    command: &[String],
    peer: &PeerCommand,
    boot: &Boot,
    started: Instant,
) -> Result<i32> {
    let pair_dir = TempDir::new_in(&std::env::temp_dir(), "rdma-rs-rxe-pair.")?;
    let pair = pair_dir.path().to_path_buf();
    fs::create_dir(pair.join("b"))?;
    // The sockets of the link live apart from the shared directory.
    let link_dir = TempDir::new_in(&std::env::temp_dir(), "rdma-rs-rxe-link.")?;
    let [end_a, end_b] = link_ends(link_dir.path());
    let mut opts_a = opts.clone();
    opts_a.extra_shares.push(pair.clone());
    opts_a.env.extend(env(&pair, ADDR_A, ADDR_B));
    let mut opts_b = opts_a.clone();
    opts_b.env.truncate(opts.env.len());
    opts_b.env.extend(env(&pair, ADDR_B, ADDR_A));
    let command_b = match peer {
        PeerCommand::Serve => {
            let script = pair.join("serve.sh");
            fs::write(&script, SERVE_SCRIPT)?;
            vec!["bash".to_string(), script.display().to_string()]
        }
        PeerCommand::Run(argv) => argv.clone(),
    };
    let shares = guest::shares(&opts_a)?;
    let _signals = SignalGuard::install();
    let mut a = Guest::start(&opts_a, command, boot, &shares, Some(&end_a))?;
    let mut b = Some(Guest::start(
        &opts_b,
        &command_b,
        boot,
        &shares,
        Some(&end_b),
    )?);
    if opts.verbose {
        eprintln!("rxe: both guests started after {:.2?}", started.elapsed());
    }
    let deadline = a.spawned + opts.timeout;
    let mut b_exit = None;
    let mut boots_b = 1;
    let end_a = loop {
        if let Some(status) = a.try_wait()? {
            break End::Exited(status);
        }
        if let Some(guest) = &mut b {
            if let Some(status) = guest.try_wait()? {
                // b ended by itself while a runs: its result is kept for the report.
                b_exit = Some(b.take().expect("b runs").finish(
                    End::Exited(status),
                    &opts_b,
                    started,
                ));
            } else if guest.boot_stalled(&opts_b) {
                b_exit = Some(
                    b.take()
                        .expect("b runs")
                        .finish(End::BootStalled, &opts_b, started),
                );
            }
        }
        let kill_order = pair.join("kill-guest-b");
        if kill_order.exists() {
            let killed = kill_b(&mut b, &pair, &kill_order)?;
            eprintln!("rxe: guest b killed on guest a's request; booting a fresh one");
            let _ = fs::remove_file(&end_b.local);
            b = Some(Guest::start(
                &opts_b,
                &command_b,
                boot,
                &shares,
                Some(&end_b),
            )?);
            boots_b += 1;
            if opts.verbose {
                eprintln!("rxe: guest b killed after {killed:.2?}, booted again");
            }
        }
        match SIGNAL.load(Ordering::SeqCst) {
            0 if Instant::now() >= deadline => break End::Timeout,
            0 if a.boot_stalled(&opts_a) => break End::BootStalled,
            0 => thread::sleep(Duration::from_millis(10)),
            signal => break End::Signal(signal),
        }
    };
    let code_a = a.finish(end_a, &opts_a, started);
    let _ = fs::write(pair.join("done"), "");
    if let Some(mut guest) = b.take() {
        let grace = Instant::now() + B_GRACE;
        let end = loop {
            if let Some(status) = guest.try_wait()? {
                break End::Exited(status);
            }
            if Instant::now() >= grace || SIGNAL.load(Ordering::SeqCst) != 0 {
                guest.kill();
                break End::Timeout;
            }
            thread::sleep(Duration::from_millis(10));
        };
        b_exit = Some(match (end, peer) {
            // Serving b stops with a; one that did not is stopped quietly.
            (End::Timeout, PeerCommand::Serve) => 0,
            (End::Timeout, PeerCommand::Run(_)) => {
                eprintln!("rxe: guest b: still running when guest a finished; stopped");
                124
            }
            (end, _) => guest.finish(end, &opts_b, started),
        });
    }
    let code_b = b_exit.unwrap_or(0);
    eprintln!(
        "rxe: guest a exited {code_a}, guest b exited {code_b} (guest b booted {boots_b} time{}), after {:.1?}",
        if boots_b == 1 { "" } else { "s" },
        started.elapsed()
    );
    Ok(if code_a != 0 { code_a } else { code_b })
}

/// Kills guest `b`'s QEMU for a `kill-guest-b` order and acknowledges it.
fn kill_b(b: &mut Option<Guest>, pair: &Path, order: &Path) -> Result<Duration> {
    let t = Instant::now();
    if let Some(mut guest) = b.take() {
        guest.kill();
    }
    let took = t.elapsed();
    // What the dead guest ran is gone with it: a fresh guest b starts from an empty
    // directory (and never kills a pid of the old one).
    let b_dir = pair.join("b");
    for entry in fs::read_dir(&b_dir)?.flatten() {
        let _ = fs::remove_file(entry.path());
    }
    fs::remove_file(order).context("removing the kill-guest-b order")?;
    let ack = pair.join("guest-b-killed");
    fs::write(pair.join("guest-b-killed.tmp"), format!("{took:?}\n"))?;
    fs::rename(pair.join("guest-b-killed.tmp"), &ack)?;
    Ok(took)
}

fn link_ends(dir: &Path) -> [LinkEnd; 2] {
    let (a, b): (PathBuf, PathBuf) = (dir.join("a.sock"), dir.join("b.sock"));
    [
        LinkEnd {
            name: "a",
            cidr: "192.0.2.1/24",
            mac: "52:54:00:00:77:01",
            local: a.clone(),
            remote: b.clone(),
        },
        LinkEnd {
            name: "b",
            cidr: "192.0.2.2/24",
            mac: "52:54:00:00:77:02",
            local: b,
            remote: a,
        },
    ]
}

fn env(pair: &Path, addr: &str, peer: &str) -> Vec<(String, String)> {
    vec![
        ("RXE_PAIR_DIR".into(), pair.display().to_string()),
        ("RXE_ADDR".into(), addr.into()),
        ("RXE_PEER_ADDR".into(), peer.into()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_ends_face_each_other() {
        let [a, b] = link_ends(Path::new("/l"));
        assert_eq!((a.local.clone(), a.remote.clone()), (b.remote, b.local));
        assert_ne!(a.mac, b.mac);
        assert!(a.cidr.starts_with(ADDR_A) && b.cidr.starts_with(ADDR_B));
    }

    #[test]
    fn the_serve_script_parses() {
        let dir = TempDir::new_in(&std::env::temp_dir(), "rxe-serve.").unwrap();
        let script = dir.path().join("serve.sh");
        fs::write(&script, SERVE_SCRIPT).unwrap();
        let status = std::process::Command::new("bash")
            .arg("-n")
            .arg(&script)
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// The service loop, run on this host: a request runs and reports, a kill order
    /// kills, `done` stops it.
    #[test]
    fn the_serve_script_serves() {
        let dir = TempDir::new_in(&std::env::temp_dir(), "rxe-serve.").unwrap();
        let pair = dir.path();
        fs::create_dir(pair.join("b")).unwrap();
        fs::write(pair.join("serve.sh"), SERVE_SCRIPT).unwrap();
        let mut server = std::process::Command::new("bash")
            .arg(pair.join("serve.sh"))
            .env("RXE_PAIR_DIR", pair)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let wait_for = |path: PathBuf| {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !path.exists() {
                assert!(Instant::now() < deadline, "{} never came", path.display());
                thread::sleep(Duration::from_millis(10));
            }
            fs::read_to_string(path).unwrap()
        };
        wait_for(pair.join("b/ready"));
        fs::write(pair.join("b/one.req"), "echo hello; exit 3\n").unwrap();
        assert_eq!(wait_for(pair.join("b/one.rc")).trim(), "3");
        assert_eq!(
            fs::read_to_string(pair.join("b/one.out")).unwrap(),
            "hello\n"
        );
        fs::write(pair.join("b/two.req"), "exec sleep 60\n").unwrap();
        wait_for(pair.join("b/two.pid"));
        fs::write(pair.join("b/two.kill"), "").unwrap();
        assert_eq!(wait_for(pair.join("b/two.rc")).trim(), "137");
        // An order for a command this guest never ran is dropped.
        fs::write(pair.join("b/ghost.kill"), "").unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while pair.join("b/ghost.kill").exists() {
            assert!(Instant::now() < deadline, "the stale order stayed");
            thread::sleep(Duration::from_millis(10));
        }
        fs::write(pair.join("done"), "").unwrap();
        assert!(server.wait().unwrap().success());
    }
}
