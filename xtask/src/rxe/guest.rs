//! One guest run: the control share, QEMU, the output streams, the timeout and signals.
//!
//! The guest has no NIC at all (`-nodefaults`), so nothing it sends can leave it. It talks
//! to us only through 9p shares and three virtio/serial ports: the console, and the
//! command's stdout and stderr. Those are unix sockets QEMU connects to at start.

use super::kernel::Boot;
use super::{GuestOptions, TempDir};
use anyhow::{bail, Context, Result};
use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Host environment that describes the host shell, not the command's world.
const DROPPED_ENV: &[&str] = &["PWD", "OLDPWD", "SHLVL", "_"];
/// What the guest init prints on the console right before it runs the command.
const COMMAND_STARTED: &[u8] = b"rxe-init: command started";
/// Kept from the console for the failure report.
const CONSOLE_TAIL_BYTES: usize = 64 << 10;

pub(super) fn run(
    opts: &GuestOptions,
    command: &[String],
    boot: &Boot,
    started: Instant,
) -> Result<i32> {
    let shares = shares(opts)?;
    let _signals = SignalGuard::install();
    let mut guest = Guest::start(opts, command, boot, &shares, None)?;
    if opts.verbose {
        eprintln!("rxe: QEMU started after {:.2?}", started.elapsed());
    }
    let deadline = guest.spawned + opts.timeout;
    let end = loop {
        if let Some(status) = guest.try_wait()? {
            break End::Exited(status);
        }
        match SIGNAL.load(Ordering::SeqCst) {
            0 if Instant::now() >= deadline => break End::Timeout,
            0 if guest.boot_stalled(opts) => break End::BootStalled,
            0 => thread::sleep(Duration::from_millis(10)),
            signal => break End::Signal(signal),
        }
    };
    Ok(guest.finish(end, opts, started))
}

/// The directories shared read-write: the current one (unless `--no-cwd`) and the extra
/// ones, canonical and without duplicates.
pub(super) fn shares(opts: &GuestOptions) -> Result<Vec<PathBuf>> {
    if let Some((name, _)) = opts
        .env
        .iter()
        .find(|(name, _)| !is_shell_name(name.as_bytes()))
    {
        bail!("environment variable name `{name}` cannot be exported by a shell");
    }
    let cwd = std::env::current_dir().context("reading the current directory")?;
    let mut shares = Vec::new();
    if opts.share_cwd && cwd != Path::new("/") {
        shares.push(cwd.clone());
    }
    for dir in &opts.extra_shares {
        let dir = dir
            .canonicalize()
            .with_context(|| format!("share {}", dir.display()))?;
        if !dir.is_dir() {
            bail!("share {}: not a directory", dir.display());
        }
        if !shares.contains(&dir) {
            shares.push(dir);
        }
    }
    Ok(shares)
}

/// One end of the two-guest mode's Ethernet link: a virtio NIC on a QEMU `dgram`
/// netdev, a unix datagram socket at `local` that sends to the other guest's at `remote`
/// (no host network, no privileges; a guest that is gone just drops what is sent to it).
#[derive(Debug, Clone)]
pub(super) struct LinkEnd {
    /// `a` or `b`: the guest's hostname is `rxe-vm-<name>`, its output is labelled so.
    pub name: &'static str,
    /// The guest's address on the link, with its prefix length.
    pub cidr: &'static str,
    pub mac: &'static str,
    pub local: PathBuf,
    pub remote: PathBuf,
}

/// One running guest: its control share, output streams and QEMU.
pub(super) struct Guest {
    label: Option<&'static str>,
    // Fields drop in this order: QEMU, then the stream readers, then the run directory.
    qemu: Option<Qemu>,
    streams: Vec<Forward>,
    ctl: PathBuf,
    log_path: PathBuf,
    first_output: Arc<OnceLock<Instant>>,
    command_started: Arc<OnceLock<Instant>>,
    console_tail: Arc<Mutex<Vec<u8>>>,
    pub(super) spawned: Instant,
    _run_dir: TempDir,
}

impl Guest {
    /// Starts QEMU for `command` (see [`run`]); `link` makes it one of a pair.
    pub(super) fn start(
        opts: &GuestOptions,
        command: &[String],
        boot: &Boot,
        shares: &[PathBuf],
        link: Option<&LinkEnd>,
    ) -> Result<Self> {
        let cwd = std::env::current_dir().context("reading the current directory")?;
        let label = link.map(|l| l.name);
        let run_dir = TempDir::new_in(&std::env::temp_dir(), "rdma-rs-rxe.")?;
        let ctl = run_dir.path().join("ctl");
        fs::create_dir(&ctl)?;
        fs::write(ctl.join("shares"), shares_script(shares))?;
        let mut env = guest_env(opts);
        if let Some(link) = link {
            env.push(("RXE_GUEST".into(), link.name.into()));
        }
        fs::write(ctl.join("cmd"), command_script(&cwd, &env, command))?;

        let first_output: Arc<OnceLock<Instant>> = Arc::default();
        let command_started: Arc<OnceLock<Instant>> = Arc::default();
        let console_tail: Arc<Mutex<Vec<u8>>> = Arc::default();
        // Guest b of a pair speaks with a prefix on each line; the others are copied as is.
        let prefix = label.filter(|l| *l != "a").map(|l| format!("[guest {l}] "));
        let streams = vec![
            forward(
                run_dir.path().join("out"),
                copy_to(io::stdout().as_fd(), &first_output, prefix.clone())?,
            )?,
            forward(
                run_dir.path().join("err"),
                copy_to(io::stderr().as_fd(), &first_output, prefix)?,
            )?,
            forward(run_dir.path().join("console"), {
                let tail = Arc::clone(&console_tail);
                let started = Arc::clone(&command_started);
                let mut echo = opts.verbose.then(io::stderr);
                move |data: &[u8]| {
                    if let Some(stderr) = &mut echo {
                        let _ = stderr.write_all(data);
                    }
                    let mut tail = tail.lock().unwrap_or_else(PoisonError::into_inner);
                    // Search the new bytes plus a marker's length before them (a chunk may
                    // split the line).
                    let from = tail.len().saturating_sub(COMMAND_STARTED.len());
                    tail.extend_from_slice(data);
                    if tail[from..]
                        .windows(COMMAND_STARTED.len())
                        .any(|w| w == COMMAND_STARTED)
                    {
                        let _ = started.set(Instant::now());
                    }
                    let excess = tail.len().saturating_sub(CONSOLE_TAIL_BYTES);
                    tail.drain(..excess);
                }
            })?,
        ];

        let log_path = run_dir.path().join("qemu.log");
        let log = File::create(&log_path)?;
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args(qemu_args(opts, boot, run_dir.path(), shares, link))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Our own process group: a terminal's ^C reaches us, and we decide what QEMU gets.
            .process_group(0);
        // SAFETY: the hook runs in the child between fork and exec; it only calls prctl,
        // which is async-signal-safe, and touches no memory of the parent.
        unsafe { cmd.pre_exec(die_with_parent) };
        let spawned = Instant::now();
        let qemu = Qemu(cmd.spawn().context("starting qemu-system-x86_64")?);
        Ok(Guest {
            label,
            qemu: Some(qemu),
            streams,
            ctl,
            log_path,
            first_output,
            command_started,
            console_tail,
            spawned,
            _run_dir: run_dir,
        })
    }

    /// QEMU's exit status once it has exited.
    pub(super) fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        match &mut self.qemu {
            Some(qemu) => Ok(qemu.0.try_wait()?),
            None => bail!("the guest was already stopped"),
        }
    }

    /// Whether the guest has not reached its command within the boot timeout.
    pub(super) fn boot_stalled(&self, opts: &GuestOptions) -> bool {
        self.command_started.get().is_none() && Instant::now() >= self.spawned + opts.boot_timeout
    }

    /// Kills QEMU (SIGKILL, as a host that loses power) and waits for it and the streams.
    pub(super) fn kill(&mut self) {
        self.qemu = None;
        self.streams.clear();
    }

    /// Stops what still runs and turns `end` into the exit code [`run`] documents,
    /// reporting failures (with the console's tail) on stderr.
    pub(super) fn finish(mut self, end: End, opts: &GuestOptions, started: Instant) -> i32 {
        self.kill();
        let who = match self.label {
            Some(label) => format!("rxe: guest {label}"),
            None => "rxe".to_string(),
        };
        if opts.verbose {
            let first = self
                .first_output
                .get()
                .map(|t| format!("{:.2?}", t.duration_since(started)));
            eprintln!(
                "{who}: first output after {}, finished after {:.2?}",
                first.as_deref().unwrap_or("-"),
                started.elapsed()
            );
        }
        let tail = || {
            let tail = self
                .console_tail
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match last_lines(&tail, 30) {
                lines if lines.is_empty() => "(empty; -v adds the kernel's messages)".to_string(),
                lines => lines,
            }
        };
        let status = match end {
            End::Signal(signal) => {
                eprintln!("{who}: interrupted by signal {signal}; guest stopped");
                return 128 + signal;
            }
            End::Timeout => {
                eprintln!(
                    "{who}: timed out after {:?}; guest console:\n{}",
                    opts.timeout,
                    tail()
                );
                return 124;
            }
            End::BootStalled => {
                eprintln!(
                    "{who}: boot stalled: the guest did not reach the command within {:?}; console:\n{}",
                    opts.boot_timeout,
                    tail()
                );
                return 125;
            }
            End::Exited(status) => status,
        };
        if let Ok(text) = fs::read_to_string(self.ctl.join("status")) {
            if let Ok(code) = text.trim().parse() {
                return code;
            }
        }
        match fs::read_to_string(self.ctl.join("error")) {
            Ok(reason) => eprintln!("{who}: guest setup failed: {}", reason.trim()),
            Err(_) => eprintln!("{who}: QEMU exited ({status}) without the command's exit status"),
        }
        let qemu_log = fs::read_to_string(&self.log_path).unwrap_or_default();
        for line in qemu_log.lines() {
            eprintln!("{who}: qemu: {line}");
        }
        eprintln!("{who}: guest console:\n{}", tail());
        125
    }
}

#[derive(Debug)]
pub(super) enum End {
    Exited(ExitStatus),
    Timeout,
    BootStalled,
    Signal(i32),
}

/// Kills QEMU (only it: we hold its pid) when a run ends early: timeout, signal, error.
#[derive(Debug)]
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Even a SIGKILLed xtask takes QEMU with it, so no guest is left spinning on shared cores.
fn die_with_parent() -> io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes two integers and touches no memory.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn qemu_args(
    opts: &GuestOptions,
    boot: &Boot,
    run_dir: &Path,
    shares: &[PathBuf],
    link: Option<&LinkEnd>,
) -> Vec<OsString> {
    let mut append = String::from(concat!(
        "console=ttyS0 8250.nr_uarts=1",
        // Power off instead of hanging on a panic (with -no-reboot QEMU then exits).
        " panic=-1",
        // Boot and run faster under TCG; nothing here needs the protection.
        " mitigations=off cryptomgr.notests audit=0 apparmor=0",
        // Without it the TSC is marked unstable and perftest's clock calibration fails.
        " tsc=reliable no_timer_check",
        // QEMU 7.2's TCG finds translated code by virtual address: without ASLR every
        // process reuses the translation of ld.so and libc (exec is ~3x faster).
        " norandmaps",
    ));
    // -v shows the kernel's boot messages too (they cost ~0.1 s on the serial console).
    append += if opts.verbose {
        " loglevel=7"
    } else {
        " quiet loglevel=4"
    };
    append += &format!(
        " rxevm_rxe={} rxevm_netdev={} rxevm_trace={}",
        u8::from(opts.rxe),
        if link.is_some() {
            "link"
        } else {
            opts.netdev.name()
        },
        u8::from(opts.verbose)
    );
    if let Some(link) = link {
        append += &format!(" rxevm_addr={} rxevm_name={}", link.cidr, link.name);
    }
    let mut args: Vec<OsString> = [
        "-M",
        "q35",
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        "qemu64",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-smp",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    args.push(opts.cpus.to_string().into());
    args.extend(["-m".into(), opts.memory_mb.to_string().into()]);
    args.extend(["-kernel".into(), boot.kernel.clone().into_os_string()]);
    args.extend(["-initrd".into(), boot.initramfs.clone().into_os_string()]);
    args.extend(["-append".into(), append.into()]);
    let chardev = |id: &str, name: &str| {
        let mut spec = OsString::from(format!("socket,id={id},path="));
        spec.push(option_value(&run_dir.join(name)));
        ["-chardev".into(), spec]
    };
    args.extend(chardev("console", "console"));
    args.extend(["-serial".into(), "chardev:console".into()]);
    args.extend(["-device".into(), "virtio-serial-pci".into()]);
    for (id, name) in [("out", "stdout"), ("err", "stderr")] {
        args.extend(chardev(id, id));
        args.extend([
            "-device".into(),
            format!("virtserialport,chardev={id},name={name}").into(),
        ]);
    }
    if let Some(link) = link {
        let mut netdev = OsString::from("dgram,id=link,local.type=unix,local.path=");
        netdev.push(option_value(&link.local));
        netdev.push(",remote.type=unix,remote.path=");
        netdev.push(option_value(&link.remote));
        args.extend(["-netdev".into(), netdev]);
        args.extend([
            "-device".into(),
            format!("virtio-net-pci,netdev=link,mac={}", link.mac).into(),
        ]);
    }
    let mut share = |tag: &str, path: &Path, extra: &str| {
        let mut fsdev = OsString::from(format!("local,id={tag},security_model=none{extra},path="));
        fsdev.push(option_value(path));
        args.extend(["-fsdev".into(), fsdev]);
        args.extend([
            "-device".into(),
            format!("virtio-9p-pci,fsdev={tag},mount_tag={tag}").into(),
        ]);
    };
    // multidevs=remap: the host's / spans several file systems; keep inode numbers unique.
    share("hostroot", Path::new("/"), ",readonly=on,multidevs=remap");
    share("rxectl", &run_dir.join("ctl"), "");
    for (i, dir) in shares.iter().enumerate() {
        share(&format!("share{i}"), dir, ",multidevs=remap");
    }
    args
}

/// A value inside a QEMU `key=value,...` option: commas are doubled.
fn option_value(path: &Path) -> OsString {
    let mut out = Vec::new();
    for &b in path.as_os_str().as_bytes() {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    OsString::from_vec(out)
}

/// The caller's environment minus `DROPPED_ENV`, plus `RXE_VM=1` and `opts.env`.
fn guest_env(opts: &GuestOptions) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(name, _)| !DROPPED_ENV.iter().any(|d| name == d))
        .collect();
    env.push(("RXE_VM".into(), "1".into()));
    env.extend(opts.env.iter().map(|(k, v)| (k.into(), v.into())));
    env
}

/// The script the guest's `/bin/sh` runs: exports, `cd`, `exec`. Variables whose names a
/// shell cannot export (e.g. `BASH_FUNC_f%%`) are left out, as bash itself does.
fn command_script(cwd: &Path, env: &[(OsString, OsString)], argv: &[String]) -> Vec<u8> {
    let mut script = Vec::new();
    for (name, value) in env
        .iter()
        .filter(|(name, _)| is_shell_name(name.as_bytes()))
    {
        script.extend_from_slice(b"export ");
        script.extend_from_slice(name.as_bytes());
        script.push(b'=');
        shell_quote(value, &mut script);
        script.push(b'\n');
    }
    script.extend_from_slice(b"cd ");
    shell_quote(cwd.as_os_str(), &mut script);
    script.extend_from_slice(b" || exit 125\nexec");
    for arg in argv {
        script.push(b' ');
        shell_quote(OsStr::new(arg), &mut script);
    }
    script.push(b'\n');
    script
}

/// `share <tag> <dir>` lines for `guest-init.sh`.
fn shares_script(shares: &[PathBuf]) -> Vec<u8> {
    let mut script = Vec::new();
    for (i, dir) in shares.iter().enumerate() {
        script.extend_from_slice(format!("share share{i} ").as_bytes());
        shell_quote(dir.as_os_str(), &mut script);
        script.push(b'\n');
    }
    script
}

/// Single quotes keep every byte literal; a quote itself becomes `'\''`.
fn shell_quote(value: &OsStr, out: &mut Vec<u8>) {
    out.push(b'\'');
    for &b in value.as_bytes() {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
}

fn is_shell_name(name: &[u8]) -> bool {
    matches!(name.first(), Some(b'A'..=b'Z' | b'a'..=b'z' | b'_'))
        && name.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'_')
}

/// A writer for one of our output streams, unbuffered so the guest's output streams
/// through (with `prefix`, whole lines only, each prefixed); after a write error (a
/// closed pipe) the rest is drained and dropped.
fn copy_to(
    fd: std::os::fd::BorrowedFd<'_>,
    first: &Arc<OnceLock<Instant>>,
    prefix: Option<String>,
) -> Result<impl FnMut(&[u8]) + Send + 'static> {
    let mut out = Some(File::from(fd.try_clone_to_owned()?));
    let first = Arc::clone(first);
    let mut prefixer = prefix.map(LinePrefixer::new);
    Ok(move |data: &[u8]| {
        first.get_or_init(Instant::now);
        let prefixed;
        let data = match &mut prefixer {
            Some(p) => {
                prefixed = p.push(data);
                &prefixed[..]
            }
            None => data,
        };
        if out.as_mut().is_some_and(|f| f.write_all(data).is_err()) {
            out = None;
        }
    })
}

/// Prefixes every complete line; a partial line waits for its end.
#[derive(Debug)]
struct LinePrefixer {
    prefix: String,
    partial: Vec<u8>,
}

impl LinePrefixer {
    fn new(prefix: String) -> Self {
        Self {
            prefix,
            partial: Vec::new(),
        }
    }

    fn push(&mut self, data: &[u8]) -> Vec<u8> {
        self.partial.extend_from_slice(data);
        let Some(last) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return Vec::new();
        };
        let rest = self.partial.split_off(last + 1);
        let whole = std::mem::replace(&mut self.partial, rest);
        let mut out = Vec::with_capacity(whole.len() + 16);
        for line in whole.split_inclusive(|b| *b == b'\n') {
            out.extend_from_slice(self.prefix.as_bytes());
            out.extend_from_slice(line);
        }
        out
    }
}

/// One guest port: a unix socket QEMU connects to, read by a thread until QEMU closes it.
#[derive(Debug)]
struct Forward {
    path: PathBuf,
    thread: Option<JoinHandle<()>>,
}

fn forward(path: PathBuf, mut sink: impl FnMut(&[u8]) + Send + 'static) -> Result<Forward> {
    let listener =
        UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
    let thread = thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        drop(listener);
        let mut buf = vec![0; 64 << 10];
        loop {
            match conn.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => sink(&buf[..n]),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    });
    Ok(Forward {
        path,
        thread: Some(thread),
    })
}

impl Drop for Forward {
    /// Waits for the reader to see EOF. Call once QEMU is gone; if QEMU never connected,
    /// our own connection ends the reader's `accept`.
    fn drop(&mut self) {
        let _ = UnixStream::connect(&self.path);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn last_lines(text: &[u8], lines: usize) -> String {
    let text = String::from_utf8_lossy(text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The signal (SIGINT/SIGTERM) that asked running guests to stop; 0 when none.
pub(super) static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How many runs want our handlers, and the handlers they replaced.
static HANDLERS: Mutex<(usize, Vec<(libc::c_int, libc::sighandler_t)>)> =
    Mutex::new((0, Vec::new()));

extern "C" fn note_signal(signal: libc::c_int) {
    SIGNAL.store(signal, Ordering::SeqCst);
}

/// SIGINT/SIGTERM stop running guests (polled by the wait loop) instead of killing the
/// process, so our Drop guards still stop QEMU and remove the run directory.
#[derive(Debug)]
pub(super) struct SignalGuard;

impl SignalGuard {
    pub(super) fn install() -> Self {
        let mut state = HANDLERS.lock().unwrap_or_else(PoisonError::into_inner);
        if state.0 == 0 {
            SIGNAL.store(0, Ordering::SeqCst);
            let handler = note_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            state.1 = [libc::SIGINT, libc::SIGTERM]
                .iter()
                .map(|&signal| (signal, set_handler(signal, handler)))
                .collect();
        }
        state.0 += 1;
        SignalGuard
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        let mut state = HANDLERS.lock().unwrap_or_else(PoisonError::into_inner);
        state.0 -= 1;
        if state.0 == 0 {
            for (signal, previous) in std::mem::take(&mut state.1) {
                set_handler(signal, previous);
            }
        }
    }
}

fn set_handler(signal: libc::c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: the handlers installed are `note_signal`, which only stores to an atomic
    // (async-signal-safe), or the ones this process had before.
    unsafe { libc::signal(signal, handler) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the generated script with the host's /bin/sh, as the guest does.
    fn run_script(env: &[(&str, &str)], argv: &[&str]) -> (String, String) {
        let cwd = std::env::temp_dir().canonicalize().unwrap();
        let env: Vec<(OsString, OsString)> =
            env.iter().map(|(k, v)| (k.into(), v.into())).collect();
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        let dir = TempDir::new_in(&cwd, "rxe-script.").unwrap();
        let script = dir.path().join("cmd");
        fs::write(&script, command_script(dir.path(), &env, &argv)).unwrap();
        let out = Command::new("/bin/sh")
            .arg(&script)
            .env_clear()
            .current_dir("/")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        (text, dir.path().to_string_lossy().into_owned())
    }

    #[test]
    fn arguments_survive_the_shell() {
        let tricky = [
            "a b", "it's", "$HOME", "`id`", "\"q\"", "x\ny", "", "\\", "*", "'",
        ];
        let mut argv = vec![
            "/bin/sh",
            "-c",
            r#"printf '[%s]' "$@"; printf '{%s}' "$PWD""#,
            "sh",
        ];
        argv.extend(tricky);
        let (out, cwd) = run_script(&[], &argv);
        let expected: String = tricky.iter().map(|a| format!("[{a}]")).collect();
        assert_eq!(out, format!("{expected}{{{cwd}}}"));
    }

    #[test]
    fn environment_survives_the_shell() {
        let value = "q'\"$x `y` \\ \n end";
        let env = [
            ("WEIRD", value),
            ("PATH", "/usr/bin:/bin"),
            ("BASH_FUNC_f%%", "() { :; }"),
        ];
        let (out, _) = run_script(&env, &["/usr/bin/env"]);
        assert!(out.contains(&format!("WEIRD={value}\n")), "{out}");
        assert!(out.contains("PATH=/usr/bin:/bin\n"), "{out}");
        assert!(!out.contains("BASH_FUNC"), "{out}");
    }

    #[test]
    fn later_variables_win() {
        let env = [("X", "host"), ("X", "opts")];
        let (out, _) = run_script(&env, &["/bin/sh", "-c", "printf %s \"$X\""]);
        assert_eq!(out, "opts");
    }

    #[test]
    fn shell_names() {
        assert!(is_shell_name(b"PATH") && is_shell_name(b"_x1"));
        for bad in [&b""[..], b"1X", b"A-B", b"A.B", b"BASH_FUNC_f%%", b"A B"] {
            assert!(!is_shell_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn quoting() {
        let mut out = Vec::new();
        shell_quote(OsStr::new("it's $x"), &mut out);
        assert_eq!(out, b"'it'\\''s $x'");
    }

    #[test]
    fn qemu_option_commas_are_doubled() {
        assert_eq!(
            option_value(Path::new("/a,b,,c")),
            OsString::from("/a,,b,,,,c")
        );
        let boot = Boot {
            kernel: "/k".into(),
            initramfs: "/i".into(),
        };
        let args = qemu_args(
            &GuestOptions::default(),
            &boot,
            Path::new("/run"),
            &["/w,x".into()],
            None,
        );
        let args: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(args.iter().any(|a| a.ends_with(",path=/w,,x")), "{args:?}");
        assert!(!args
            .iter()
            .any(|a| a.contains("-netdev") || a.contains("-nic")));
        let append = &args[args.iter().position(|a| a == "-append").unwrap() + 1];
        assert!(
            append.contains("rxevm_rxe=1 rxevm_netdev=dummy rxevm_trace=0"),
            "{append}"
        );
    }

    #[test]
    fn a_link_end_adds_its_nic() {
        let boot = Boot {
            kernel: "/k".into(),
            initramfs: "/i".into(),
        };
        let link = LinkEnd {
            name: "b",
            cidr: "192.0.2.2/24",
            mac: "52:54:00:00:00:02",
            local: "/p/b,1.sock".into(),
            remote: "/p/a.sock".into(),
        };
        let args: Vec<String> = qemu_args(
            &GuestOptions::default(),
            &boot,
            Path::new("/run"),
            &[],
            Some(&link),
        )
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
        let netdev = &args[args.iter().position(|a| a == "-netdev").unwrap() + 1];
        assert_eq!(
            netdev,
            "dgram,id=link,local.type=unix,local.path=/p/b,,1.sock,remote.type=unix,remote.path=/p/a.sock"
        );
        assert!(args.contains(&"virtio-net-pci,netdev=link,mac=52:54:00:00:00:02".to_string()));
        let append = &args[args.iter().position(|a| a == "-append").unwrap() + 1];
        assert!(
            append.contains("rxevm_netdev=link rxevm_trace=0 rxevm_addr=192.0.2.2/24 rxevm_name=b"),
            "{append}"
        );
    }

    #[test]
    fn lines_are_prefixed_whole() {
        let mut p = LinePrefixer::new("[b] ".into());
        assert_eq!(p.push(b"one\ntw"), b"[b] one\n");
        assert_eq!(p.push(b"o\nthree\nfo"), b"[b] two\n[b] three\n");
        assert_eq!(p.push(b"ur"), b"");
    }

    #[test]
    fn console_tail() {
        assert_eq!(last_lines(b"a\nb\nc\n", 2), "b\nc");
        assert_eq!(last_lines(b"", 2), "");
    }
}
