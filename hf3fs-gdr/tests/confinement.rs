//! The daemon confines its clients (issue 28, finding 2): each test plays an attacker,
//! through the library or a raw client speaking the wire protocol, and checks the
//! victim's files and the daemon afterwards. Attackers of another user run as `nobody`
//! (this binary re-executed with `setuid`); the tests need root for that and say so
//! when they skip.

mod common;

use common::{
    after, assert_bytes, child_lines, data_dir, patterned_file, role, wait_until, Daemon, T,
};
use hf3fs_gdr::{
    daemon_stats, dereg_fd, id_from_hex, ior_size, reg_fd, to_hex, Cqe, Error, Ior, Iov,
};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const NOBODY: u32 = 65534;
const LEN: usize = 64 << 10;

// The wire protocol (src/proto.rs): an op byte, then little-endian fields.
const OP_HELLO: u8 = 1;
const OP_REG_FD: u8 = 2;
const OP_ADD_IOR: u8 = 4;
const OP_OWN_IOV: u8 = 6;
const OP_OWN_IOV_LINK: u8 = 9;
const OP_REG_IOV: u8 = 10;
const IOV_HOST: u8 = 1;

fn is_root() -> bool {
    // SAFETY: no arguments.
    unsafe { libc::geteuid() == 0 }
}

/// Runs this test binary again as `nobody`, playing `role`.
fn spawn_as_nobody(test: &str, role: &str, env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("HF3FS_TEST_ROLE", role)
        .current_dir("/")
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Whether this machine can run a client as `nobody`: root here, and the test binary
/// reachable by `nobody` (a target directory under a private home is not). Says why not.
fn nobody_can_run(test: &str) -> bool {
    if !is_root() {
        println!("skipped: needs root to run a client as nobody");
        return false;
    }
    let ran = spawn_as_nobody(test, "probe", &[])
        .wait_with_output()
        .is_ok_and(|out| {
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("@@probe")
        });
    if !ran {
        println!("skipped: nobody cannot run this test binary (is its directory private?)");
    }
    ran
}

/// A child started to see whether `nobody` can run this binary.
fn probe() -> bool {
    if role().as_deref() == Some("probe") {
        println!("@@probe");
        return true;
    }
    false
}

/// The child's `@@` lines, once it has exited.
fn child_report(test: &str, role: &str, env: &[(&str, String)]) -> Vec<String> {
    let mut child = spawn_as_nobody(test, role, env);
    let lines = child_lines(&mut child);
    assert!(child.wait().unwrap().success(), "the {role} child failed");
    let mut out = Vec::new();
    while let Ok(l) = lines.recv_timeout(Duration::from_secs(1)) {
        out.push(l);
    }
    out
}

/// A daemon whose mount other users can reach (the tempdir is 0700).
fn open_daemon(extra: &[&str]) -> Daemon {
    let d = Daemon::start_with(2, extra);
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

fn env_path(key: &str) -> PathBuf {
    PathBuf::from(std::env::var(key).unwrap())
}

/// A raw client: sends requests as bytes, with at most one descriptor.
struct Raw(OwnedFd);

impl Raw {
    fn connect(mount: &Path) -> Self {
        let path = hf3fs_gdr::virt::daemon_socket(mount);
        // SAFETY: plain socket creation; owned below.
        let fd =
            unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor we own.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain C struct.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = path.to_str().unwrap().as_bytes();
        for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        // SAFETY: a filled sockaddr_un.
        let ret = unsafe {
            libc::connect(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        assert_eq!(ret, 0, "connect: {}", std::io::Error::last_os_error());
        let raw = Self(sock);
        assert!(raw.request(&[OP_HELLO, 0, 0, 0, 0], None) > 0);
        raw
    }

    /// Sends `msg` (with `fd` attached) and returns the reply's value.
    fn request(&self, msg: &[u8], fd: Option<RawFd>) -> i64 {
        // SAFETY: pure size computation.
        let space = unsafe { libc::CMSG_SPACE(4) } as usize;
        let mut control = vec![0u8; space];
        let mut iov = libc::iovec {
            iov_base: msg.as_ptr() as *mut libc::c_void,
            iov_len: msg.len(),
        };
        // SAFETY: plain C struct.
        let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        if let Some(fd) = fd {
            hdr.msg_control = control.as_mut_ptr().cast();
            hdr.msg_controllen = space as _;
            // SAFETY: the control buffer has CMSG_SPACE(4) bytes.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&hdr);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(4) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
            }
        }
        // SAFETY: `hdr` points at live buffers.
        let sent = unsafe { libc::sendmsg(self.0.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL) };
        assert_eq!(sent, msg.len() as isize);
        let mut buf = [0u8; 256];
        // SAFETY: a live buffer of its length.
        let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        assert!(n >= 8, "no reply ({n})");
        i64::from_le_bytes(buf[..8].try_into().unwrap())
    }
}

fn msg(op: u8, id: &[u8; 16]) -> Vec<u8> {
    let mut m = vec![op];
    m.extend_from_slice(id);
    m
}

/// A 64 KiB read of a patterned file into a fresh iov, checked byte for byte: the
/// daemon still serves this (honest) client.
fn honest_read(mount: &Path) {
    let data = data_dir();
    let (path, bytes) = patterned_file(data.path(), "f", 3, LEN);
    let file = std::fs::File::open(&path).unwrap();
    reg_fd(file.as_raw_fd(), 0).unwrap();
    let iov = Iov::create(mount, LEN as u64, 0, -1).unwrap();
    let mut ior = Ior::create(mount, 4, true, 0, Duration::ZERO, -1, 0).unwrap();
    ior.prep_io(&iov, true, iov.base(), file.as_raw_fd(), 0, LEN as u64, 1)
        .unwrap();
    ior.submit_ios().unwrap();
    let mut c = [Cqe::default(); 1];
    assert_eq!(ior.wait_for_ios(&mut c, 1, after(T)).unwrap(), 1);
    assert_eq!(c[0].result, LEN as i64);
    let mut got = vec![0u8; LEN];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &bytes, "the honest client's read");
    drop(ior);
    dereg_fd(file.as_raw_fd());
}

/// What a file holds, and whether any of it is `secret`'s.
fn leaked(out: &Path, secret: &[u8]) -> usize {
    let got = std::fs::read(out).unwrap_or_default();
    got.iter()
        .zip(secret)
        .filter(|(a, b)| a == b && **a != 0)
        .count()
}

/// Child of `a_symlink_in_a_client_folder_is_never_followed` (as `nobody`): publishes
/// a link to its own `/dev/shm` folder, where `evil` points at root's secret, and asks
/// the daemon to write that iov into a file of its own.
fn symlink_attacker() {
    let mount = env_path("HF3FS_MOUNT");
    let folder = env_path("HF3FS_FOLDER");
    std::fs::create_dir(&folder).unwrap();
    let evil = folder.join("evil");
    std::os::unix::fs::symlink(env_path("HF3FS_SECRET"), &evil).unwrap();
    let id = [0x5e; 16];
    std::os::unix::fs::symlink(&evil, hf3fs_gdr::virt::iovs_dir(&mount).join(to_hex(&id))).unwrap();
    let out_path = folder.join("out");
    let out = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&out_path)
        .unwrap();
    out.set_len(LEN as u64).unwrap();
    reg_fd(out.as_raw_fd(), 0).unwrap();
    let mut buf = vec![0u8; LEN];
    // SAFETY: `buf` outlives the iov.
    let iov = unsafe { Iov::wrap(buf.as_mut_ptr(), &id, &mount, LEN as u64, 0, -1) }.unwrap();
    let mut ior = Ior::create(&mount, 4, false, 0, Duration::ZERO, -1, 0).unwrap();
    match ior.prep_io(&iov, false, iov.base(), out.as_raw_fd(), 0, LEN as u64, 1) {
        Ok(_) => {
            ior.submit_ios().unwrap();
            let mut c = [Cqe::default(); 1];
            let n = ior.wait_for_ios(&mut c, 1, after(T)).unwrap();
            println!("@@submitted {n} {}", c[0].result);
        }
        Err(e) => println!("@@refused {e}"),
    }
}

#[test]
fn a_symlink_in_a_client_folder_is_never_followed() {
    if role().as_deref() == Some("symlink_attacker") {
        return symlink_attacker();
    }
    if probe() || !nobody_can_run("a_symlink_in_a_client_folder_is_never_followed") {
        return;
    }
    let d = open_daemon(&["--allow-uid", &NOBODY.to_string()]);
    let data = data_dir();
    let (secret_path, secret) = patterned_file(data.path(), "secret", 0x77, LEN);
    std::fs::set_permissions(&secret_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let folder = PathBuf::from(format!(
        "/dev/shm/hf3fs-gdr-test-attack-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&folder);
    let report = child_report(
        "a_symlink_in_a_client_folder_is_never_followed",
        "symlink_attacker",
        &[
            ("HF3FS_MOUNT", d.path().display().to_string()),
            ("HF3FS_FOLDER", folder.display().to_string()),
            ("HF3FS_SECRET", secret_path.display().to_string()),
        ],
    );
    let leaked = leaked(&folder.join("out"), &secret);
    std::fs::remove_dir_all(&folder).unwrap();
    assert_eq!(
        leaked, 0,
        "bytes of root's secret reached nobody's file: {report:?}"
    );
    assert!(
        report.iter().any(|l| l.starts_with("refused")),
        "{report:?}"
    );
    assert_bytes(&std::fs::read(&secret_path).unwrap(), &secret, "the secret");
}

/// Child of `another_clients_iov_is_neither_listed_nor_reachable` (as `nobody`).
fn iov_snooper() {
    let mount = env_path("HF3FS_MOUNT");
    let id = id_from_hex(&std::env::var("HF3FS_IOV").unwrap()).unwrap();
    match std::fs::read_dir(hf3fs_gdr::virt::iovs_dir(&mount)) {
        Ok(entries) => println!("@@listed {}", entries.count()),
        Err(e) => println!("@@list refused {:?}", e.kind()),
    }
    match Iov::open(&id, &mount, LEN as u64, 0, -1) {
        Ok(_) => println!("@@opened"),
        Err(e) => println!("@@open refused {e}"),
    }
    // Through the daemon: wrap the victim's id around our own buffer and write it
    // into our own file.
    let out_path = env_path("HF3FS_OUT");
    let out = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&out_path)
        .unwrap();
    reg_fd(out.as_raw_fd(), 0).unwrap();
    let mut buf = vec![0u8; LEN];
    // SAFETY: `buf` outlives the iov.
    let iov = unsafe { Iov::wrap(buf.as_mut_ptr(), &id, &mount, LEN as u64, 0, -1) }.unwrap();
    let mut ior = Ior::create(&mount, 4, false, 0, Duration::ZERO, -1, 0).unwrap();
    match ior.prep_io(&iov, false, iov.base(), out.as_raw_fd(), 0, LEN as u64, 1) {
        Ok(_) => {
            ior.submit_ios().unwrap();
            let mut c = [Cqe::default(); 1];
            let n = ior.wait_for_ios(&mut c, 1, after(T)).unwrap();
            println!("@@submitted {n} {}", c[0].result);
        }
        Err(e) => println!("@@io refused {e}"),
    }
}

#[test]
fn another_clients_iov_is_neither_listed_nor_reachable() {
    if role().as_deref() == Some("iov_snooper") {
        return iov_snooper();
    }
    if probe() || !nobody_can_run("another_clients_iov_is_neither_listed_nor_reachable") {
        return;
    }
    let d = open_daemon(&["--allow-uid", &NOBODY.to_string()]);
    let secret = common::pattern(0x33, LEN);
    let victim = Iov::create(d.path(), LEN as u64, 0, -1).unwrap();
    victim.write_at(0, &secret).unwrap();
    let out = PathBuf::from(format!(
        "/dev/shm/hf3fs-gdr-test-snoop-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&out);
    let report = child_report(
        "another_clients_iov_is_neither_listed_nor_reachable",
        "iov_snooper",
        &[
            ("HF3FS_MOUNT", d.path().display().to_string()),
            ("HF3FS_IOV", to_hex(victim.id())),
            ("HF3FS_OUT", out.display().to_string()),
        ],
    );
    let leaked = leaked(&out, &secret);
    let _ = std::fs::remove_file(&out);
    assert_eq!(
        leaked, 0,
        "bytes of the victim's iov reached nobody's file: {report:?}"
    );
    for expected in ["list refused", "open refused", "io refused"] {
        assert!(
            report.iter().any(|l| l.starts_with(expected)),
            "{expected}: {report:?}"
        );
    }
}

#[test]
fn own_iov_of_a_foreign_id_is_refused_and_the_files_survive() {
    let d = Daemon::start(2);
    let victim = Iov::create(d.path(), LEN as u64, 0, -1).unwrap();
    let id = *victim.id();
    let link = hf3fs_gdr::virt::iovs_dir(d.path()).join(to_hex(&id));
    let segment = std::fs::read_link(&link).unwrap();
    let released = daemon_stats(d.path()).unwrap().clients_released;
    {
        // The same user as the victim (the strongest case the daemon can tell apart).
        let raw = Raw::connect(d.path());
        assert_eq!(
            raw.request(&msg(OP_OWN_IOV, &id), None),
            -(libc::EBADF as i64),
            "a host iov is claimed with its segment"
        );
        let seg = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&segment)
            .unwrap();
        for op in [OP_OWN_IOV, OP_OWN_IOV_LINK] {
            assert_eq!(
                raw.request(&msg(op, &id), Some(seg.as_raw_fd())),
                -(libc::EPERM as i64),
                "the victim's session claimed it first"
            );
        }
        // Another segment than the one the link names.
        let other = tempfile::tempfile_in("/dev/shm").unwrap();
        other.set_len(LEN as u64).unwrap();
        assert_eq!(
            raw.request(&msg(OP_OWN_IOV, &[9; 16]), Some(other.as_raw_fd())),
            -(libc::ENOENT as i64)
        );
    }
    assert!(
        wait_until(T, || daemon_stats(d.path()).unwrap().clients_released
            > released),
        "the raw client was not released"
    );
    assert!(
        std::fs::symlink_metadata(&link).is_ok(),
        "the victim's link was removed"
    );
    assert!(segment.exists(), "the victim's segment was removed");
    honest_read(d.path());
    drop(victim);
    assert!(std::fs::symlink_metadata(&link).is_err());
}

#[test]
fn iovs_are_registered_by_a_readable_writable_shared_memory_descriptor_only() {
    let d = Daemon::start(2);
    let raw = Raw::connect(d.path());
    let mut reg = msg(OP_REG_IOV, &[4; 16]);
    reg.push(IOV_HOST);
    // No descriptor: the daemon never looks an iov up by its name.
    assert_eq!(raw.request(&reg, None), -(libc::EBADF as i64));
    // A file on disk (it could be on a file system its client serves).
    let data = data_dir();
    let (path, _) = patterned_file(data.path(), "disk", 1, LEN);
    let disk = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    assert_eq!(
        raw.request(&reg, Some(disk.as_raw_fd())),
        -(libc::EINVAL as i64)
    );
    // Shared memory opened read-only: never made writable.
    let shm = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
    shm.as_file().set_len(LEN as u64).unwrap();
    let read_only = std::fs::File::open(shm.path()).unwrap();
    assert_eq!(
        raw.request(&reg, Some(read_only.as_raw_fd())),
        -(libc::EINVAL as i64)
    );
    // Read-write shared memory is taken.
    let rw = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(shm.path())
        .unwrap();
    assert_eq!(raw.request(&reg, Some(rw.as_raw_fd())), 0);
}

#[test]
fn one_client_cannot_exhaust_the_daemon_for_the_others() {
    let d = Daemon::start_with(
        2,
        &[
            "--max-client-files",
            "64",
            "--max-client-rings",
            "2",
            "--max-clients",
            "2",
        ],
    );
    let raw = Raw::connect(d.path());
    let data = data_dir();
    let (path, _) = patterned_file(data.path(), "f", 1, LEN);
    let file = std::fs::File::open(&path).unwrap();
    for _ in 0..64 {
        assert!(raw.request(&[OP_REG_FD, 0, 0, 0, 0], Some(file.as_raw_fd())) > 0);
    }
    assert_eq!(
        raw.request(&[OP_REG_FD, 0, 0, 0, 0], Some(file.as_raw_fd())),
        -(libc::EMFILE as i64)
    );
    // Rings: two at most.
    for (i, expected) in [(1u8, 0), (2, 0), (3, -(libc::ENOSPC as i64))] {
        let id = [i; 16];
        let name = std::ffi::CString::new("ring").unwrap();
        // SAFETY: NUL-terminated name; owned below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor we own.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a memfd of ours.
        let sized = unsafe { libc::ftruncate(memfd.as_raw_fd(), ior_size(4) as libc::off_t) };
        assert_eq!(sized, 0);
        write_ring_header(memfd.as_raw_fd(), &id, 4);
        // SAFETY: a memfd created with MFD_ALLOW_SEALING.
        let sealed =
            unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(sealed, 0);
        assert_eq!(
            raw.request(&msg(OP_ADD_IOR, &id), Some(memfd.as_raw_fd())),
            expected
        );
    }
    // Clients: two at once; a third is told to come back later.
    let second = Raw::connect(d.path());
    let path = hf3fs_gdr::virt::daemon_socket(d.path());
    // SAFETY: plain socket creation; owned below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    // SAFETY: a new descriptor we own.
    let third = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain C struct.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr
        .sun_path
        .iter_mut()
        .zip(path.to_str().unwrap().as_bytes())
    {
        *d = *s as libc::c_char;
    }
    // SAFETY: a filled sockaddr_un.
    let ret = unsafe {
        libc::connect(
            third.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    assert_eq!(ret, 0);
    let refused = Raw(third).request(&[OP_HELLO, 0, 0, 0, 0], None);
    assert_eq!(refused, -(libc::EAGAIN as i64));
    // Once they are gone, others are served.
    drop((raw, second));
    assert!(wait_until(T, || daemon_stats(d.path()).is_ok()));
    honest_read(d.path());
}

/// Writes a ring header for `entries` entries named `id` at the start of `fd`.
fn write_ring_header(fd: RawFd, id: &[u8; 16], entries: u32) {
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(b"HF3FSIOR");
    h[8..12].copy_from_slice(&1u32.to_le_bytes());
    h[12..16].copy_from_slice(&entries.to_le_bytes());
    h[16..20].copy_from_slice(&1u32.to_le_bytes());
    h[28..32].copy_from_slice(&(-1i32).to_le_bytes());
    h[40..56].copy_from_slice(id);
    // SAFETY: a live buffer of its length.
    let written = unsafe { libc::pwrite(fd, h.as_ptr().cast(), h.len(), 0) };
    assert_eq!(written, h.len() as isize);
}

#[test]
fn a_truncated_ring_fails_only_its_client() {
    let mut d = Daemon::start(2);
    let raw = Raw::connect(d.path());
    let len = ior_size(4);
    // A ring in a plain /dev/shm file, published the way rings once were.
    let id = [0x71; 16];
    let path = PathBuf::from(format!(
        "/dev/shm/hf3fs-gdr-test-ring-{}",
        std::process::id()
    ));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    file.set_len(len as u64).unwrap();
    write_ring_header(file.as_raw_fd(), &id, 4);
    let link = hf3fs_gdr::virt::iors_dir(d.path()).join(to_hex(&id));
    std::os::unix::fs::symlink(&path, &link).unwrap();
    let added = raw.request(&msg(OP_ADD_IOR, &id), Some(file.as_raw_fd()));
    // The ring that can shrink is refused; shrinking it anyway hurts nobody.
    file.set_len(0).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    std::fs::remove_file(&path).unwrap();
    std::fs::remove_file(&link).unwrap();
    assert!(d.alive(), "the daemon died of a truncated ring");
    assert_eq!(added, -(libc::EINVAL as i64));

    // A sealed memfd is taken, and cannot be shrunk under the daemon.
    let name = std::ffi::CString::new("attacker-ring").unwrap();
    // SAFETY: NUL-terminated name; owned below.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: a new descriptor we own.
    let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: a memfd of ours.
    let sized = unsafe { libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t) };
    assert_eq!(sized, 0);
    let id2 = [0x72; 16];
    write_ring_header(memfd.as_raw_fd(), &id2, 4);
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    // SAFETY: a memfd created with MFD_ALLOW_SEALING.
    let sealed = unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    assert_eq!(sealed, 0);
    assert_eq!(
        raw.request(&msg(OP_ADD_IOR, &id2), Some(memfd.as_raw_fd())),
        0
    );
    // SAFETY: a memfd of ours.
    let shrunk = unsafe { libc::ftruncate(memfd.as_raw_fd(), 0) };
    assert_ne!(shrunk, 0, "a sealed ring shrank");
    std::thread::sleep(Duration::from_millis(100));
    assert!(d.alive());
    // Another client is served.
    honest_read(d.path());
    drop(raw);
}

/// Child of `a_user_not_admitted_is_refused_at_connect` (as `nobody`).
fn stranger() {
    match daemon_stats(env_path("HF3FS_MOUNT")) {
        Ok(s) => println!("@@served {s:?}"),
        Err(Error::Refused { errno, .. }) => println!("@@refused {errno}"),
        Err(e) => println!("@@failed {e}"),
    }
}

#[test]
fn a_user_not_admitted_is_refused_at_connect() {
    if role().as_deref() == Some("stranger") {
        return stranger();
    }
    if probe() || !nobody_can_run("a_user_not_admitted_is_refused_at_connect") {
        return;
    }
    // By default only root and the daemon's user: the socket is 0600 too.
    let d = open_daemon(&[]);
    let socket = hf3fs_gdr::virt::daemon_socket(d.path());
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    // Another user admitted: the socket is open to all, and the check at connect
    // (SO_PEERCRED) refuses nobody.
    let d = open_daemon(&["--allow-uid", "4242"]);
    let socket = hf3fs_gdr::virt::daemon_socket(d.path());
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o666, "socket mode {mode:o}");
    let report = child_report(
        "a_user_not_admitted_is_refused_at_connect",
        "stranger",
        &[("HF3FS_MOUNT", d.path().display().to_string())],
    );
    assert_eq!(report, [format!("refused {}", libc::EACCES)]);
    // Root is served.
    assert_eq!(daemon_stats(d.path()).unwrap().clients_now, 1);
}
