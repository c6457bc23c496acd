//! `Iov::wrap_shm` (a caller's `/dev/shm` segment published by the iov, forgotten by
//! the daemon when the iov goes, never removed by anyone but the caller) and
//! `Ior::check_alive` (pooled rings checked before reuse, without waiting).

mod common;

use common::{
    after, assert_bytes, child_lines, data_dir, patterned_file, role, spawn_child, wait_until,
    Daemon, T,
};
use hf3fs_gdr::{dereg_fd, reg_fd, to_hex, Cqe, Error, Id, Ior, Iov};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LEN: u64 = 1 << 20;

/// A `/dev/shm` segment of `len` bytes, mapped shared; unmapped and removed on drop.
struct Segment {
    path: PathBuf,
    base: *mut u8,
    len: usize,
}

impl Segment {
    fn new(tag: &str, len: usize) -> Self {
        let path = PathBuf::from(format!(
            "/dev/shm/hf3fs-gdr-test-{tag}-{}-{}",
            std::process::id(),
            Instant::now().elapsed().as_nanos()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        f.set_len(len as u64).unwrap();
        // SAFETY: a shared mapping of the whole file, unmapped in drop.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        Self {
            path,
            base: base.cast(),
            len,
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping lives as long as self; no I/O is in flight when called.
        unsafe { std::slice::from_raw_parts(self.base, self.len) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: mapped in new, not used any more.
        unsafe { libc::munmap(self.base.cast(), self.len) };
        let _ = std::fs::remove_file(&self.path);
    }
}

fn id_for(tag: u8) -> Id {
    let mut id = [tag; 16];
    id[..4].copy_from_slice(&std::process::id().to_le_bytes());
    id
}

/// Whether the daemon process maps `path` now.
fn daemon_maps(d: &Daemon, path: &Path) -> bool {
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", d.child.id())).unwrap();
    maps.contains(path.to_str().unwrap())
}

fn read_into(ior: &mut Ior, iov: &Iov, fd: i32, len: u64) {
    ior.prep_io(iov, true, iov.base(), fd, 0, len, 1).unwrap();
    ior.submit_ios().unwrap();
    let mut c = [Cqe::default(); 1];
    assert_eq!(ior.wait_for_ios(&mut c, 1, after(T)).unwrap(), 1);
    assert_eq!(c[0].result, len as i64);
}

#[test]
fn wrap_shm_owns_its_publication_and_the_daemon_forgets_it() {
    let d = Daemon::start(2);
    let data = data_dir();
    let (path, bytes) = patterned_file(data.path(), "f", 3, LEN as usize);
    let seg = Segment::new("wrap", LEN as usize);
    let id = id_for(1);

    // Bad input: typed errors, nothing published.
    let refused = [
        // SAFETY: refused (not a /dev/shm segment) before the memory is used.
        unsafe { Iov::wrap_shm(seg.base, &path, &id, d.path(), LEN, 0, -1) },
        // SAFETY: refused (larger than the segment) before the memory is used.
        unsafe { Iov::wrap_shm(seg.base, &seg.path, &id, d.path(), 2 * LEN, 0, -1) },
        // SAFETY: refused (null) before the memory is used.
        unsafe { Iov::wrap_shm(std::ptr::null_mut(), &seg.path, &id, d.path(), LEN, 0, -1) },
    ];
    for r in refused {
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }
    let link = hf3fs_gdr::virt::iovs_dir(d.path()).join(to_hex(&id));
    assert!(std::fs::symlink_metadata(&link).is_err());

    // SAFETY: `seg` maps the whole segment and outlives the iov.
    let iov = unsafe { Iov::wrap_shm(seg.base, &seg.path, &id, d.path(), LEN, 0, -1) }.unwrap();
    assert_eq!(std::fs::read_link(&link).unwrap(), seg.path);
    // The id is taken: a second publication under it is refused.
    // SAFETY: refused before use.
    let twice = unsafe { Iov::wrap_shm(seg.base, &seg.path, &id, d.path(), LEN, 0, -1) };
    assert!(
        matches!(
            twice,
            Err(Error::Os {
                call: "symlink",
                ..
            })
        ),
        "{twice:?}"
    );

    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    reg_fd(fd, 0).unwrap();
    let mut ior = Ior::create(d.path(), 4, true, 0, Duration::ZERO, -1, 0).unwrap();
    read_into(&mut ior, &iov, fd, LEN);
    assert_bytes(seg.bytes(), &bytes, "file read into the wrapped segment");
    assert!(daemon_maps(&d, &seg.path), "the daemon mapped the segment");

    // A clone keeps the iov; the last one going removes the link and the daemon's
    // mapping, while this process still uses its segment.
    let clone = iov.clone();
    iov.destroy().unwrap();
    assert!(
        std::fs::symlink_metadata(&link).is_err(),
        "link left behind"
    );
    assert!(
        wait_until(Duration::from_secs(5), || !daemon_maps(&d, &seg.path)),
        "the daemon still maps the destroyed iov's segment"
    );
    assert!(seg.path.exists(), "the caller's segment was removed");
    drop(clone);
    assert_bytes(seg.bytes(), &bytes, "the segment after destroy");

    // Plain `Iov::wrap` of a publication the caller made: the daemon maps the segment
    // while the iov is registered by this process, and drops it with the iov.
    let id2 = id_for(2);
    let link2 = hf3fs_gdr::virt::iovs_dir(d.path()).join(to_hex(&id2));
    std::os::unix::fs::symlink(&seg.path, &link2).unwrap();
    // SAFETY: `seg` outlives the iov.
    let plain = unsafe { Iov::wrap(seg.base, &id2, d.path(), LEN, 0, -1) }.unwrap();
    read_into(&mut ior, &plain, fd, LEN);
    plain.destroy().unwrap();
    std::fs::remove_file(&link2).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || !daemon_maps(&d, &seg.path)),
        "the daemon still maps the segment of a dropped wrap"
    );
    assert!(seg.path.exists(), "the caller's segment was removed");
    drop(ior);
    dereg_fd(fd);
}

/// Child of `wrap_shm_of_a_killed_client_leaves_the_segment`: wraps the parent's
/// segment, reads into it, says done and waits to be killed.
fn wrapping_client() {
    let mount = PathBuf::from(std::env::var("HF3FS_MOUNT").unwrap());
    let shm = PathBuf::from(std::env::var("HF3FS_SEGMENT").unwrap());
    let file = std::fs::File::open(std::env::var("HF3FS_FILE").unwrap()).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&shm)
        .unwrap();
    // SAFETY: a shared mapping of the segment, kept until the process is killed.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let id = id_for(3);
    // SAFETY: mapped above for the life of this process.
    let iov = unsafe { Iov::wrap_shm(base.cast(), &shm, &id, &mount, LEN, 0, -1) }.unwrap();
    reg_fd(file.as_raw_fd(), 0).unwrap();
    let mut ior = Ior::create(&mount, 4, true, 0, Duration::ZERO, -1, 0).unwrap();
    read_into(&mut ior, &iov, file.as_raw_fd(), LEN);
    println!("@@{}", to_hex(iov.id()));
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn wrap_shm_of_a_killed_client_leaves_the_segment() {
    if role().as_deref() == Some("wrapping_client") {
        return wrapping_client();
    }
    let d = Daemon::start(2);
    let data = data_dir();
    let (path, bytes) = patterned_file(data.path(), "f", 4, LEN as usize);
    let seg = Segment::new("killed", LEN as usize);
    let mut child = spawn_child(
        "wrap_shm_of_a_killed_client_leaves_the_segment",
        "wrapping_client",
        &[
            ("HF3FS_MOUNT", d.path().display().to_string()),
            ("HF3FS_SEGMENT", seg.path.display().to_string()),
            ("HF3FS_FILE", path.display().to_string()),
        ],
    );
    let lines = child_lines(&mut child);
    let hex = lines.recv_timeout(T).unwrap();
    let link = hf3fs_gdr::virt::iovs_dir(d.path()).join(&hex);
    assert_eq!(std::fs::read_link(&link).unwrap(), seg.path);
    assert_bytes(seg.bytes(), &bytes, "the child's read, seen here");
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || std::fs::symlink_metadata(&link)
            .is_err()),
        "the dead client's link was not removed"
    );
    assert!(
        seg.path.exists(),
        "the daemon removed a segment it does not own"
    );
    assert_bytes(seg.bytes(), &bytes, "the segment after the child died");
}

#[test]
fn check_alive_tells_a_dead_daemon_without_waiting() {
    let mut d = Daemon::start(1);
    let mut ior = Ior::create(d.path(), 4, true, 0, Duration::ZERO, -1, 0).unwrap();
    ior.check_alive().unwrap();
    // Usable after the check.
    let data = data_dir();
    let (path, _) = patterned_file(data.path(), "f", 5, 4096);
    let file = std::fs::File::open(&path).unwrap();
    reg_fd(file.as_raw_fd(), 0).unwrap();
    let iov = Iov::create(d.path(), 4096, 0, -1).unwrap();
    read_into(&mut ior, &iov, file.as_raw_fd(), 4096);
    ior.check_alive().unwrap();

    d.kill();
    // The socket closing is seen at once; each check returns without waiting.
    let start = Instant::now();
    let mut last = Ok(());
    while start.elapsed() < Duration::from_secs(2) {
        let t = Instant::now();
        last = ior.check_alive();
        assert!(
            t.elapsed() < Duration::from_millis(50),
            "check_alive took {:?}",
            t.elapsed()
        );
        if last.is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(matches!(last, Err(Error::DaemonGone { .. })), "{last:?}");
    // Stays failed.
    assert!(matches!(ior.check_alive(), Err(Error::DaemonGone { .. })));
    dereg_fd(file.as_raw_fd());
}
