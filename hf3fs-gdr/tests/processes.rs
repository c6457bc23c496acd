//! Several processes: a host iov shared between two, a daemon killed with I/O in
//! flight (every waiting client gets a typed error within its deadline), a client
//! killed with I/O in flight (the daemon releases its rings and publications and keeps
//! serving another client). Children are this binary re-executed with a role.

mod common;

use common::{
    after, assert_bytes, child_lines, data_dir, pattern, patterned_file, role, spawn_child,
    wait_until, Daemon, T,
};
use hf3fs_gdr::{daemon_stats, dereg_fd, id_from_hex, reg_fd, to_hex, Cqe, Error, Ior, Iov};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn env_path(key: &str) -> PathBuf {
    PathBuf::from(std::env::var(key).unwrap())
}

/// Child of `host_iov_crosses_processes`: opens the parent's iov by id, checks the
/// parent's bytes, writes its own into the second half, reads a file into it through
/// the daemon, then says done.
fn iov_peer() {
    let mount = env_path("HF3FS_MOUNT");
    let id = id_from_hex(&std::env::var("HF3FS_IOV").unwrap()).unwrap();
    let iov = Iov::open(&id, &mount, 2 << 20, 0, -1).unwrap();
    let mut got = vec![0u8; 1 << 20];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &pattern(7, 1 << 20), "parent's half");
    iov.write_at(1 << 20, &pattern(8, 1 << 20)).unwrap();
    // The opened iov works for I/O too (the daemon finds it by its publication).
    let file = std::fs::File::open(env_path("HF3FS_FILE")).unwrap();
    reg_fd(file.as_raw_fd(), 0).unwrap();
    let mut ior = Ior::create(&mount, 4, true, 0, Duration::ZERO, -1, 0).unwrap();
    ior.prep_io(&iov, true, iov.base() + 4096, file.as_raw_fd(), 0, 4096, 1)
        .unwrap();
    ior.submit_ios().unwrap();
    let mut c = [Cqe::default(); 1];
    assert_eq!(ior.wait_for_ios(&mut c, 1, after(T)).unwrap(), 1);
    assert_eq!(c[0].result, 4096);
    dereg_fd(file.as_raw_fd());
    println!("@@done");
}

#[test]
fn host_iov_crosses_processes() {
    if role().as_deref() == Some("iov_peer") {
        return iov_peer();
    }
    let d = Daemon::start(2);
    let data = data_dir();
    let (path, bytes) = patterned_file(data.path(), "f", 9, 8192);
    let iov = Iov::create(d.path(), 2 << 20, 0, -1).unwrap();
    iov.write_at(0, &pattern(7, 1 << 20)).unwrap();
    let mut child = spawn_child(
        "host_iov_crosses_processes",
        "iov_peer",
        &[
            ("HF3FS_MOUNT", d.path().display().to_string()),
            ("HF3FS_IOV", to_hex(iov.id())),
            ("HF3FS_FILE", path.display().to_string()),
        ],
    );
    let lines = child_lines(&mut child);
    assert_eq!(lines.recv_timeout(T).unwrap(), "done");
    assert!(child.wait().unwrap().success());
    let mut got = vec![0u8; 1 << 20];
    iov.read_at(1 << 20, &mut got).unwrap();
    // The child's bytes, with the page it read from the file at 4096.
    let mut expected = pattern(8, 1 << 20);
    expected[..4096].copy_from_slice(&bytes[..4096]);
    // The file read landed at iov offset 4096, inside the parent's half.
    let mut first = vec![0u8; 4096];
    iov.read_at(4096, &mut first).unwrap();
    assert_bytes(
        &first,
        &bytes[..4096],
        "the child's read, seen by the parent",
    );
    assert_bytes(&got, &pattern(8, 1 << 20), "the child's half");
}

/// Starts an I/O that stays in flight: a read of a `.slow` file on a daemon started
/// with a long `--inject-delay-ms`.
fn stuck_read(mount: &Path, slow: &Path) -> (Iov, Ior, std::fs::File) {
    let f = std::fs::File::open(slow).unwrap();
    reg_fd(f.as_raw_fd(), 0).unwrap();
    let iov = Iov::create(mount, 1 << 20, 0, -1).unwrap();
    let mut ior = Ior::create(mount, 4, true, 0, Duration::ZERO, -1, 0).unwrap();
    ior.prep_io(&iov, true, iov.base(), f.as_raw_fd(), 0, 4096, 1)
        .unwrap();
    ior.submit_ios().unwrap();
    (iov, ior, f)
}

#[test]
fn daemon_killed_mid_io_fails_waiters_within_their_deadline() {
    let mut d = Daemon::start_with(2, &["--inject-delay-ms", "60000"]);
    let data = data_dir();
    let (slow, _) = patterned_file(data.path(), "f.slow", 1, 8192);
    let (_iov, mut ior, f) = stuck_read(d.path(), &slow);
    // A second ring waits too.
    let (_iov2, mut ior2, f2) = stuck_read(d.path(), &slow);
    let mut c = [Cqe::default(); 1];
    assert_eq!(
        ior.wait_for_ios(&mut c, 1, after(Duration::from_millis(100)))
            .unwrap(),
        0,
        "the FIFO read is in flight"
    );
    let waiter = std::thread::spawn(move || {
        let start = Instant::now();
        let mut c = [Cqe::default(); 1];
        let r = ior2.wait_for_ios(&mut c, 1, after(Duration::from_secs(20)));
        (r, start.elapsed())
    });
    std::thread::sleep(Duration::from_millis(100));
    d.kill();
    let start = Instant::now();
    let r = ior.wait_for_ios(&mut c, 1, after(Duration::from_secs(20)));
    let took = start.elapsed();
    assert!(matches!(r, Err(Error::DaemonGone { .. })), "{r:?}");
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let (r2, took2) = waiter.join().unwrap();
    assert!(matches!(r2, Err(Error::DaemonGone { .. })), "{r2:?}");
    assert!(took2 < Duration::from_secs(3), "took {took2:?}");
    // Later calls fail at once, typed.
    let r = ior.wait_for_ios(&mut c, 1, None);
    assert!(matches!(r, Err(Error::DaemonGone { .. })), "{r:?}");
    // New rings are refused, typed.
    assert!(matches!(
        Ior::create(d.path(), 4, true, 0, Duration::ZERO, -1, 0),
        Err(Error::NoDaemon { .. })
    ));
    dereg_fd(f.as_raw_fd());
    dereg_fd(f2.as_raw_fd());
}

/// Child of `client_killed_daemon_serves_others`: publishes an iov and a ring with a
/// stuck read, says their ids, then waits to be killed.
fn stuck_client() {
    let mount = env_path("HF3FS_MOUNT");
    let (iov, ior, _f) = stuck_read(&mount, &env_path("HF3FS_SLOW"));
    println!("@@{} {}", to_hex(iov.id()), to_hex(ior.id()));
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn client_killed_daemon_serves_others() {
    if role().as_deref() == Some("stuck_client") {
        return stuck_client();
    }
    let d = Daemon::start_with(2, &["--inject-delay-ms", "60000"]);
    let data = data_dir();
    let (slow, _) = patterned_file(data.path(), "f.slow", 1, 8192);
    let mut child = spawn_child(
        "client_killed_daemon_serves_others",
        "stuck_client",
        &[
            ("HF3FS_MOUNT", d.path().display().to_string()),
            ("HF3FS_SLOW", slow.display().to_string()),
        ],
    );
    let lines = child_lines(&mut child);
    let ids = lines.recv_timeout(T).unwrap();
    let (iov_hex, ior_hex) = ids.split_once(' ').unwrap();
    let iov_link = hf3fs_gdr::virt::iovs_dir(d.path()).join(iov_hex);
    let iov_shm = std::fs::read_link(&iov_link).unwrap();
    assert!(iov_shm.exists());
    // Rings are sealed memfds handed to the daemon: nothing is published for them.
    let ior_link = hf3fs_gdr::virt::iors_dir(d.path()).join(ior_hex);
    assert!(std::fs::symlink_metadata(&ior_link).is_err());
    let before = daemon_stats(d.path()).unwrap();
    assert_eq!(
        before.clients_now, 2,
        "the child and this stats call: {before:?}"
    );

    child.kill().unwrap();
    child.wait().unwrap();
    // The daemon notices, releases the child's rings and removes its publications.
    assert!(
        // Each stats call is a connection of its own: only the child's can keep the
        // count above 1.
        wait_until(Duration::from_secs(5), || {
            daemon_stats(d.path()).unwrap().clients_now == 1
        }),
        "the daemon did not release the killed client"
    );
    for p in [&iov_link, &iov_shm] {
        assert!(
            std::fs::symlink_metadata(p).is_err(),
            "{} left behind",
            p.display()
        );
    }
    // The dead client's delayed chunk was cancelled: both workers serve others (the
    // three reads below would otherwise wait for the 60 s delay).

    // Another client is served as before.
    let (path, bytes) = patterned_file(data.path(), "f", 4, 3 << 20);
    let file = std::fs::File::open(&path).unwrap();
    reg_fd(file.as_raw_fd(), 0).unwrap();
    let iov = Iov::create(d.path(), 3 << 20, 0, -1).unwrap();
    let mut ior = Ior::create(d.path(), 8, true, 0, Duration::ZERO, -1, 0).unwrap();
    for i in 0..3u64 {
        ior.prep_io(
            &iov,
            true,
            iov.base() + (i << 20),
            file.as_raw_fd(),
            i << 20,
            1 << 20,
            i,
        )
        .unwrap();
    }
    ior.submit_ios().unwrap();
    let mut c = [Cqe::default(); 3];
    let mut got = 0;
    while got < 3 {
        let n = ior.wait_for_ios(&mut c[got..], 3 - got, after(T)).unwrap();
        assert!(n > 0, "no completion in {T:?}");
        got += n;
    }
    assert!(c.iter().all(|c| c.result == 1 << 20), "{c:?}");
    let mut data_back = vec![0u8; 3 << 20];
    iov.read_at(0, &mut data_back).unwrap();
    assert_bytes(&data_back, &bytes, "read after another client died");
    dereg_fd(file.as_raw_fd());
}

#[test]
fn a_frozen_daemon_costs_waiters_only_their_deadline() {
    let mut d = Daemon::start(2);
    let data = data_dir();
    let (path, _) = patterned_file(data.path(), "f", 2, 1 << 20);
    let file = std::fs::File::open(&path).unwrap();
    reg_fd(file.as_raw_fd(), 0).unwrap();
    let iov = Iov::create(d.path(), 1 << 20, 0, -1).unwrap();
    let mut ior = Ior::create(d.path(), 4, true, 0, Duration::ZERO, -1, 0).unwrap();
    // One read first: the file's registration round trip is done (a request to a
    // frozen daemon would wait for the 20 s request timeout, then fail typed).
    ior.prep_io(&iov, true, iov.base(), file.as_raw_fd(), 0, 4096, 0)
        .unwrap();
    let mut c = [Cqe::default(); 1];
    assert_eq!(ior.wait_for_ios(&mut c, 1, after(T)).unwrap(), 1);
    d.freeze();
    ior.prep_io(&iov, true, iov.base(), file.as_raw_fd(), 0, 1 << 20, 1)
        .unwrap();
    ior.submit_ios().unwrap();
    let start = Instant::now();
    let n = ior
        .wait_for_ios(&mut c, 1, after(Duration::from_millis(300)))
        .unwrap();
    let took = start.elapsed();
    assert_eq!(n, 0);
    assert!(took < Duration::from_secs(2), "took {took:?}");
    // Thawed, it completes the read.
    d.thaw();
    assert_eq!(ior.wait_for_ios(&mut c, 1, after(T)).unwrap(), 1);
    assert_eq!(c[0].result, 1 << 20);
    assert!(d.alive());
    dereg_fd(file.as_raw_fd());
}
