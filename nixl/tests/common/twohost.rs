//! Two "hosts" on one machine for the LIBFABRIC tests: two network namespaces joined by a
//! veth pair, [`ADDRS`]`[0]` in the first and [`ADDRS`]`[1]` in the second, each with its
//! own loopback. A process started with [`NetnsPair::command`] sees only its namespace's
//! interfaces, so traffic between the two crosses the veth link, which a test can cut
//! ([`NetnsPair::cut_link`]). Needs root and `ip netns` (iproute2); without them
//! [`NetnsPair::create`] says why, and the caller skips — unless `NIXL_REQUIRE_NETNS=1`
//! (set by `cargo xtask test` when it runs as root), where a missing substrate fails.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// The two hosts' addresses on the link (a /24 of the private 10/8 range).
pub const ADDRS: [&str; 2] = ["10.77.0.1", "10.77.0.2"];

/// Two namespaces and the veth pair between them; both removed on drop (deleting a
/// namespace deletes its end of the pair, and with it the other end).
#[derive(Debug)]
pub struct NetnsPair {
    /// Namespace names, as `ip netns` knows them.
    pub ns: [String; 2],
    /// The veth end inside each namespace.
    pub veth: [String; 2],
}

impl NetnsPair {
    /// Creates the pair, named after this process and `tag`. `Err` is the reason the
    /// substrate is missing (not root, no `ip netns`): the caller prints it and skips, or
    /// fails it when `NIXL_REQUIRE_NETNS=1` (see [`skip_or_fail`]).
    pub fn create(tag: &str) -> Result<Self, String> {
        // SAFETY: geteuid has no preconditions and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: network namespaces need CAP_SYS_ADMIN".into());
        }
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let pair = NetnsPair {
            ns: [0, 1].map(|side| format!("nixl2h-{pid}-{n}-{tag}-{side}")),
            // Interface names are at most 15 bytes: v + 7-digit pid + . + n + a/b.
            veth: ["a", "b"].map(|side| format!("v{pid}.{n}{side}")),
        };
        for ns in &pair.ns {
            ip(&["netns", "add", ns]).map_err(|e| format!("`ip netns` is unavailable: {e}"))?;
        }
        // From here on, Drop removes whatever was made.
        let [a, b] = &pair.veth;
        ip(&[
            "link",
            "add",
            a,
            "netns",
            &pair.ns[0],
            "type",
            "veth",
            "peer",
            "name",
            b,
            "netns",
            &pair.ns[1],
        ])
        .map_err(|e| format!("no veth pair: {e}"))?;
        for ((ns, veth), addr) in pair.ns.iter().zip(&pair.veth).zip(ADDRS) {
            let cidr = format!("{addr}/24");
            for args in [
                &["-n", ns, "link", "set", "lo", "up"][..],
                &["-n", ns, "addr", "add", &cidr, "dev", veth],
                &["-n", ns, "link", "set", veth, "up"],
            ] {
                ip(args).map_err(|e| format!("configuring {ns}: {e}"))?;
            }
        }
        Ok(pair)
    }

    /// `program` run inside namespace `side` (0 or 1) by `ip netns exec`, which keeps
    /// the caller's environment.
    pub fn command(&self, side: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns[side]]).arg(program);
        cmd
    }

    /// The same, in a fresh pid namespace as well (`unshare --pid --fork --mount-proc`):
    /// the process's pid and start time then mean nothing on this side, as for a process
    /// on another machine, so nothing can watch it through the OS (e.g. the LIBFABRIC
    /// backend's same-host liveness check) and only the network speaks for it.
    pub fn remote_command(&self, side: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = self.command(side, "unshare");
        cmd.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
            .arg(program);
        cmd
    }

    /// Cuts the link by taking namespace `side`'s end down (the other end loses its
    /// carrier; addresses and routes stay, as on a host whose cable was pulled).
    pub fn cut_link(&self, side: usize) -> Result<(), String> {
        ip(&[
            "-n",
            &self.ns[side],
            "link",
            "set",
            &self.veth[side],
            "down",
        ])
    }

    /// The shell command that does [`cut_link`](Self::cut_link), for a child process.
    pub fn cut_link_argv(&self, side: usize) -> Vec<String> {
        self.link_argv(side, "down")
    }

    /// The shell command that puts namespace `side`'s end of the link up again after a
    /// cut (the kernel restores the address's route with it), for a child process.
    pub fn restore_link_argv(&self, side: usize) -> Vec<String> {
        self.link_argv(side, "up")
    }

    fn link_argv(&self, side: usize, state: &str) -> Vec<String> {
        [
            "ip",
            "-n",
            &self.ns[side],
            "link",
            "set",
            &self.veth[side],
            state,
        ]
        .map(String::from)
        .to_vec()
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        for ns in &self.ns {
            // A namespace that was never made is simply not found.
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Prints why the two-namespace tests cannot run and returns (the test then passes as
/// skipped), or panics with the reason when `NIXL_REQUIRE_NETNS=1`.
pub fn skip_or_fail(reason: &str) {
    if std::env::var("NIXL_REQUIRE_NETNS").as_deref() == Ok("1") {
        panic!("NIXL_REQUIRE_NETNS=1 but the namespaces cannot be made: {reason}");
    }
    println!("skipped: {reason}");
}

/// `ip ARGS`, its stderr in the error.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
