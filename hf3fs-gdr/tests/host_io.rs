//! Host iovs and rings against a real daemon process: reads and writes, every
//! `io_depth` mode, deadlines, −errno completions, end of file, `O_DIRECT` and its
//! unaligned fallback, bounds and ring-full errors.

mod common;

use common::{after, assert_bytes, data_dir, patterned_file, Daemon};
use hf3fs_gdr::{daemon_stats, dereg_fd, reg_fd, Cqe, Error, Ior, Iov};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn read_ring(d: &Daemon, entries: u32, io_depth: i32, timeout: Duration) -> Ior {
    Ior::create(d.path(), entries, true, io_depth, timeout, -1, 0).unwrap()
}

/// Waits for exactly `n` completions (10 s limit) and returns them by userdata.
fn reap(ior: &mut Ior, n: usize) -> Vec<Cqe> {
    let mut cqes = vec![Cqe::default(); n];
    let mut got = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while got < n {
        let k = ior
            .wait_for_ios(&mut cqes[got..], n - got, Some(deadline))
            .unwrap();
        assert!(
            k > 0 || Instant::now() < deadline,
            "only {got} of {n} completions in 10 s"
        );
        got += k;
    }
    cqes.sort_by_key(|c| c.userdata);
    cqes
}

#[test]
fn reads_and_writes_move_the_right_bytes_direct_and_buffered() {
    let d = Daemon::start_with(4, &["--direct", "always"]);
    let data = data_dir();
    let len = 3 * MIB as usize + 123;
    let (path, bytes) = patterned_file(data.path(), "f", 1, len);
    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    reg_fd(fd, 0).unwrap();

    let iov = Iov::create(d.path(), 4 * MIB, 0, -1).unwrap();
    assert!(!iov.is_gpu() && iov.gpu_device().is_none());
    let mut ior = read_ring(&d, 16, 0, Duration::ZERO);
    let before = daemon_stats(d.path()).unwrap();
    // Aligned (O_DIRECT), the whole file in one I/O (several chunks), and unaligned.
    ior.prep_io(&iov, true, iov.base(), fd, 0, 2 * MIB, 1)
        .unwrap();
    ior.prep_io(&iov, true, iov.base() + 2 * MIB, fd, 4097, 5000, 2)
        .unwrap();
    ior.submit_ios().unwrap();
    let cqes = reap(&mut ior, 2);
    assert_eq!((cqes[0].result, cqes[1].result), (2 * MIB as i64, 5000));
    let mut got = vec![0u8; 2 * MIB as usize];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &bytes[..2 * MIB as usize], "aligned read");
    let mut got = vec![0u8; 5000];
    iov.read_at(2 * MIB, &mut got).unwrap();
    assert_bytes(&got, &bytes[4097..4097 + 5000], "unaligned read");
    let after_stats = daemon_stats(d.path()).unwrap();
    assert!(
        after_stats.direct_ops > before.direct_ops,
        "{after_stats:?}"
    );
    assert!(
        after_stats.buffered_ops > before.buffered_ops,
        "{after_stats:?}"
    );
    assert_eq!(after_stats.host_bytes - before.host_bytes, 2 * MIB + 5000);

    // The whole file, past its end: a short count.
    ior.prep_io(&iov, true, iov.base(), fd, 0, 4 * MIB, 3)
        .unwrap();
    ior.submit_ios().unwrap();
    let cqes = reap(&mut ior, 1);
    assert_eq!(cqes[0].result, len as i64, "short count at end of file");
    let mut got = vec![0u8; len];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &bytes, "whole file");

    // Writes: the iov's bytes land in a new file.
    let out_path = data.path().join("out");
    let out = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&out_path)
        .unwrap();
    reg_fd(out.as_raw_fd(), 0).unwrap();
    let mut wior = Ior::create(d.path(), 8, false, 0, Duration::ZERO, -1, 0).unwrap();
    assert!(!wior.for_read());
    wior.prep_io(&iov, false, iov.base(), out.as_raw_fd(), 0, MIB, 10)
        .unwrap();
    wior.prep_io(&iov, false, iov.base() + MIB, out.as_raw_fd(), MIB, 777, 11)
        .unwrap();
    wior.submit_ios().unwrap();
    let cqes = reap(&mut wior, 2);
    assert_eq!((cqes[0].result, cqes[1].result), (MIB as i64, 777));
    let written = std::fs::read(&out_path).unwrap();
    assert_bytes(&written, &bytes[..MIB as usize + 777], "written file");
    dereg_fd(out.as_raw_fd());
    dereg_fd(fd);
}

#[test]
fn io_depth_modes_batch_as_3fs_says() {
    let d = Daemon::start(2);
    let data = data_dir();
    let (path, bytes) = patterned_file(data.path(), "f", 2, 64 << 10);
    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    reg_fd(fd, 0).unwrap();
    let iov = Iov::create(d.path(), 64 << 10, 4096, -1).unwrap();
    let mut cqes = [Cqe::default(); 8];
    let prep = |ior: &mut Ior, i: u64| {
        ior.prep_io(&iov, true, iov.base() + i * 4096, fd, i * 4096, 4096, i)
            .unwrap()
    };

    // 0: prepared I/Os are processed without submit_ios.
    let mut ior = read_ring(&d, 8, 0, Duration::ZERO);
    for i in 0..3 {
        prep(&mut ior, i);
    }
    assert_eq!(reap(&mut ior, 3).len(), 3);

    // N > 0: exactly N at a time; a partial batch waits even when submitted.
    let mut ior = read_ring(&d, 8, 4, Duration::ZERO);
    for i in 0..3 {
        prep(&mut ior, i);
    }
    ior.submit_ios().unwrap();
    let n = ior
        .wait_for_ios(&mut cqes, 1, after(Duration::from_millis(300)))
        .unwrap();
    assert_eq!(n, 0, "a batch of 3 ran on an io_depth 4 ring");
    prep(&mut ior, 3);
    ior.submit_ios().unwrap();
    let done = reap(&mut ior, 4);
    assert!(done.iter().all(|c| c.result == 4096));

    // N < 0 with a timeout: a partial batch runs after the timeout without submit,
    // at once with submit; more than -N run in several batches.
    let mut ior = read_ring(&d, 8, -4, Duration::from_millis(400));
    let start = Instant::now();
    prep(&mut ior, 0);
    prep(&mut ior, 1);
    assert_eq!(reap(&mut ior, 2).len(), 2);
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(300),
        "partial batch ran after {waited:?}"
    );
    let start = Instant::now();
    prep(&mut ior, 2);
    ior.submit_ios().unwrap();
    assert_eq!(reap(&mut ior, 1).len(), 1);
    assert!(
        start.elapsed() < Duration::from_millis(300),
        "{:?}",
        start.elapsed()
    );
    for i in 0..8 {
        prep(&mut ior, i);
    }
    ior.submit_ios().unwrap();
    let done = reap(&mut ior, 8);
    for (i, c) in done.iter().enumerate() {
        assert_eq!((c.userdata, c.result), (i as u64, 4096));
    }
    let mut got = vec![0u8; 32 << 10];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &bytes[..32 << 10], "batched reads");
    dereg_fd(fd);
}

#[test]
fn deadlines_errors_and_bounds_are_typed() {
    let d = Daemon::start(2);
    let data = data_dir();
    let (path, _) = patterned_file(data.path(), "f", 3, 10_000);
    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    reg_fd(fd, 0).unwrap();
    let iov = Iov::create(d.path(), MIB, 0, -1).unwrap();
    let mut ior = read_ring(&d, 4, 0, Duration::ZERO);
    let mut cqes = [Cqe::default(); 4];

    // A deadline with nothing in flight returns 0 on time.
    let start = Instant::now();
    let n = ior
        .wait_for_ios(&mut cqes, 1, after(Duration::from_millis(200)))
        .unwrap();
    let took = start.elapsed();
    assert_eq!(n, 0);
    assert!(
        took >= Duration::from_millis(190) && took < Duration::from_secs(2),
        "{took:?}"
    );
    // Without a deadline, waiting for more than is outstanding is refused (never a hang).
    assert!(matches!(
        ior.wait_for_ios(&mut cqes, 1, None),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ior.wait_for_ios(&mut cqes[..1], 2, after(Duration::ZERO)),
        Err(Error::InvalidArgument(_))
    ));

    // End of file: a short count, then 0.
    ior.prep_io(&iov, true, iov.base(), fd, 8192, 8192, 1)
        .unwrap();
    ior.prep_io(&iov, true, iov.base() + 8192, fd, 20_000, 4096, 2)
        .unwrap();
    ior.submit_ios().unwrap();
    let c = reap(&mut ior, 2);
    assert_eq!((c[0].result, c[1].result), (10_000 - 8192, 0));

    // A −errno completion: a write-only descriptor read (EBADF: the daemon's copies
    // keep the client's access mode).
    let wo = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    reg_fd(wo.as_raw_fd(), 0).unwrap();
    ior.prep_io(&iov, true, iov.base(), wo.as_raw_fd(), 0, 4096, 3)
        .unwrap();
    ior.submit_ios().unwrap();
    let c = reap(&mut ior, 1);
    assert_eq!(c[0].result, -(libc::EBADF as i64));
    // The daemon takes regular files only: a directory is refused when it is passed.
    let dir = std::fs::File::open(data.path()).unwrap();
    reg_fd(dir.as_raw_fd(), 0).unwrap();
    assert!(matches!(
        ior.prep_io(&iov, true, iov.base(), dir.as_raw_fd(), 0, 4096, 4),
        Err(Error::Refused { errno, .. }) if errno == libc::EINVAL
    ));

    // Typed refusals at prep time.
    let loose = std::fs::File::open(&path).unwrap();
    assert!(matches!(
        ior.prep_io(&iov, true, iov.base(), loose.as_raw_fd(), 0, 10, 0),
        Err(Error::FdNotRegistered(_))
    ));
    assert!(matches!(
        ior.prep_io(&iov, true, iov.base() + MIB - 10, fd, 0, 11, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ior.prep_io(&iov, true, iov.base() - 1, fd, 0, 10, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ior.prep_io(&iov, false, iov.base(), fd, 0, 10, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ior.prep_io(&iov, true, iov.base(), fd, 0, 0, 0),
        Err(Error::InvalidArgument(_))
    ));
    // Ring full: 4 prepared, none reaped.
    for i in 0..4 {
        ior.prep_io(&iov, true, iov.base(), fd, 0, 100, i).unwrap();
    }
    assert!(matches!(
        ior.prep_io(&iov, true, iov.base(), fd, 0, 100, 9),
        Err(Error::RingFull { entries: 4 })
    ));
    assert_eq!(ior.outstanding(), 4);
    assert_eq!(reap(&mut ior, 4).len(), 4);
    ior.prep_io(&iov, true, iov.base(), fd, 0, 100, 9).unwrap();
    assert_eq!(reap(&mut ior, 1)[0].result, 100);

    // Bad ring parameters.
    for (entries, depth) in [(0, 0), (4, 5), (4, -5)] {
        assert!(matches!(
            Ior::create(d.path(), entries, true, depth, Duration::ZERO, -1, 0),
            Err(Error::InvalidArgument(_))
        ));
    }
    assert!(matches!(
        Ior::create(d.path(), 4, true, 0, Duration::ZERO, -1, 8),
        Err(Error::InvalidArgument(_))
    ));
    // A mount without a daemon.
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        Ior::create(empty.path(), 4, true, 0, Duration::ZERO, -1, 0),
        Err(Error::NoDaemon { .. })
    ));
    // Bad iov parameters.
    assert!(matches!(
        Iov::create(d.path(), 0, 0, -1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Iov::create(d.path(), 100, 64, -1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Iov::create("/nonexistent-mount", 100, 0, -1),
        Err(Error::InvalidArgument(_))
    ));
    for f in [&wo, &dir] {
        dereg_fd(f.as_raw_fd());
    }
    dereg_fd(fd);
}

#[test]
fn iov_publication_open_wrap_unlink_destroy() {
    let d = Daemon::start(1);
    let iov = Iov::create(d.path(), 8192, 4096, 0).unwrap();
    assert_eq!((iov.size(), iov.block_size(), iov.numa()), (8192, 4096, 0));
    let link = hf3fs_gdr::virt::iovs_dir(d.path()).join(hf3fs_gdr::to_hex(iov.id()));
    let target = std::fs::read_link(&link).unwrap();
    assert!(target.starts_with("/dev/shm"), "{target:?}");
    iov.write_at(100, b"hello").unwrap();

    // Open by id: the same memory.
    let other = Iov::open(iov.id(), d.path(), 8192, 4096, -1).unwrap();
    let mut got = [0u8; 5];
    other.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"hello");
    assert!(matches!(
        Iov::open(iov.id(), d.path(), 1 << 20, 0, -1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Iov::open(&[0; 16], d.path(), 10, 0, -1),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        other.read_at(8190, &mut got),
        Err(Error::InvalidArgument(_))
    ));

    // Wrap memory the caller mapped itself.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&target)
        .unwrap();
    // SAFETY: a shared mapping of the 8192-byte segment, unmapped at the end.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: the mapping outlives the wrapped iov (dropped before munmap).
    let wrapped = unsafe { Iov::wrap(base.cast(), iov.id(), d.path(), 8192, 0, -1) }.unwrap();
    wrapped.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"hello");
    wrapped.destroy().unwrap();
    assert!(
        link.exists(),
        "destroying a wrapped iov leaves the publication"
    );
    // SAFETY: mapped above, not used any more.
    unsafe { libc::munmap(base, 8192) };

    // Unlink removes the publication and the segment; the memory stays usable.
    iov.unlink().unwrap();
    assert!(std::fs::symlink_metadata(&link).is_err());
    assert!(!target.exists());
    iov.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"hello");
    iov.destroy().unwrap();
    other.destroy().unwrap();
    assert!(!hf3fs_gdr::gdr_available() || hf3fs_gdr::gdr_device_count() > 0);
}

#[test]
fn many_rings_and_threads_at_once() {
    let d = Daemon::start(4);
    let data = data_dir();
    let len = 8 * MIB as usize;
    let (path, bytes) = patterned_file(data.path(), "f", 5, len);
    let bytes = std::sync::Arc::new(bytes);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (mount, path, bytes) = (d.path().to_path_buf(), path.clone(), bytes.clone());
            std::thread::spawn(move || {
                let file = std::fs::File::open(&path).unwrap();
                reg_fd(file.as_raw_fd(), 0).unwrap();
                let iov = Iov::create(&mount, 8 * MIB, 0, -1).unwrap();
                let mut ior =
                    Ior::create(&mount, 32, true, -8, Duration::from_millis(5), -1, 0).unwrap();
                for round in 0..4u64 {
                    for i in 0..32u64 {
                        let off = i * (256 << 10);
                        ior.prep_io(
                            &iov,
                            true,
                            iov.base() + off,
                            file.as_raw_fd(),
                            off,
                            256 << 10,
                            round * 100 + i,
                        )
                        .unwrap();
                    }
                    ior.submit_ios().unwrap();
                    let c = reap(&mut ior, 32);
                    assert!(c.iter().all(|c| c.result == 256 << 10), "thread {t}");
                }
                let mut got = vec![0u8; len];
                iov.read_at(0, &mut got).unwrap();
                assert_bytes(&got, &bytes, "concurrent rings");
                dereg_fd(file.as_raw_fd());
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn auto_direct_policy_serves_cached_data_from_the_cache_and_cold_data_direct() {
    let d = Daemon::start(2);
    let data = data_dir();
    let (path, bytes) = patterned_file(data.path(), "f", 6, 4 * MIB as usize);
    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    reg_fd(fd, 0).unwrap();
    let iov = Iov::create(d.path(), 4 * MIB, 0, -1).unwrap();
    let mut ior = read_ring(&d, 4, 0, Duration::ZERO);
    let read_all = |ior: &mut Ior, tag: u64| {
        let s0 = daemon_stats(d.path()).unwrap();
        ior.prep_io(&iov, true, iov.base(), fd, 0, 4 * MIB, tag)
            .unwrap();
        ior.submit_ios().unwrap();
        assert_eq!(reap(ior, 1)[0].result, 4 * MIB as i64);
        let mut got = vec![0u8; 4 * MIB as usize];
        iov.read_at(0, &mut got).unwrap();
        assert_bytes(&got, &bytes, "auto policy read");
        let s1 = daemon_stats(d.path()).unwrap();
        (
            s1.direct_ops - s0.direct_ops,
            s1.buffered_ops - s0.buffered_ops,
        )
    };
    // Just written: in the page cache, served from it.
    assert_eq!(read_all(&mut ior, 1), (0, 1));
    // Evicted: read with O_DIRECT.
    file.sync_all().unwrap();
    // SAFETY: a valid descriptor; advice only.
    let advised = unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(advised, 0);
    assert_eq!(read_all(&mut ior, 2), (1, 0));
    // ... without filling the page cache on the way (a probe that starts readahead
    // would make the device read a cold file twice).
    assert!(
        resident_fraction(&file) < 0.01,
        "a cold O_DIRECT read left {:.0}% of the file in the page cache",
        resident_fraction(&file) * 100.0
    );
    // Mostly cached: the cache serves it.
    let mut buf = vec![0u8; 3 * MIB as usize];
    std::io::Read::read_exact(&mut &file, &mut buf).unwrap();
    assert_eq!(read_all(&mut ior, 3), (0, 1));
    dereg_fd(fd);
}

/// Fraction of `file`'s pages in the page cache (`mincore` on an untouched mapping).
fn resident_fraction(file: &std::fs::File) -> f64 {
    let len = file.metadata().unwrap().len() as usize;
    // SAFETY: a read-only mapping, never touched, unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    let mut vec = vec![0u8; len.div_ceil(4096)];
    // SAFETY: a byte per page of the mapping.
    assert_eq!(unsafe { libc::mincore(map, len, vec.as_mut_ptr()) }, 0);
    // SAFETY: mapped above.
    unsafe { libc::munmap(map, len) };
    vec.iter().filter(|b| **b & 1 != 0).count() as f64 / vec.len() as f64
}

#[test]
fn daemon_cli_refuses_bad_arguments_and_a_second_daemon() {
    let bin = common::daemon_binary();
    let status = |args: &[&str]| {
        std::process::Command::new(&bin)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap()
            .code()
    };
    assert_eq!(status(&[]), Some(2), "--mount is required");
    assert_eq!(status(&["--mount", "/tmp", "--threads", "x"]), Some(2));
    assert_eq!(
        status(&["--mount", "/tmp", "--direct", "sometimes"]),
        Some(2)
    );
    assert_eq!(status(&["--bogus"]), Some(2));
    assert_eq!(status(&["--mount", "/tmp", "--slots", "0"]), Some(2));
    assert_eq!(status(&["--mount", "/tmp", "--copy-kib", "6"]), Some(2));
    // A mount that is not a directory is a wrong invocation, refused before it starts.
    assert_eq!(status(&["--mount", "/nonexistent-hf3fs-mount"]), Some(2));
    let d = Daemon::start(1);
    let mount = d.path().to_str().unwrap();
    assert_eq!(
        status(&["--mount", mount]),
        Some(1),
        "a daemon already serves it"
    );
    // The first one still serves (the second's probing connection may take a moment
    // to be counted out).
    assert!(common::wait_until(Duration::from_secs(5), || {
        daemon_stats(d.path()).unwrap().clients_now == 1
    }));
}

#[test]
fn gpu_iovs_without_a_gpu_are_typed_errors() {
    if hf3fs_gdr::gdr_available() {
        eprintln!("skipped: this machine has a GPU (gpu_hf3fs covers it)");
        return;
    }
    assert_eq!(hf3fs_gdr::gdr_device_count(), 0);
    let mount = tempfile::tempdir().unwrap();
    let r = Iov::create_gpu(mount.path(), MIB, 0, 0);
    assert!(matches!(r, Err(Error::Gpu(_))), "{r:?}");
    let handle = hf3fs_gdr::GpuIovHandle {
        id: [1; 16],
        device: 0,
        size: MIB,
        block_size: 0,
        offset: 0,
        ipc: gpu_mem::IpcHandle([0; 64]),
    };
    assert!(matches!(
        Iov::import_gpu(&handle, mount.path()),
        Err(Error::Gpu(_))
    ));
    assert!(matches!(
        hf3fs_gdr::GpuIovHandle::from_bytes(&[0; 10]),
        Err(Error::Malformed { .. })
    ));
    // A GPU publication opened where there is no GPU.
    let dir = hf3fs_gdr::virt::iovs_dir(mount.path());
    std::fs::create_dir_all(&dir).unwrap();
    let link = hf3fs_gdr::virt::GdrLink {
        device: 0,
        size: MIB,
        ipc: handle.ipc,
        offset: 0,
    };
    std::os::unix::fs::symlink(link.format(), dir.join(hf3fs_gdr::to_hex(&[2; 16]))).unwrap();
    assert!(matches!(
        Iov::open(&[2; 16], mount.path(), MIB, 0, -1),
        Err(Error::Gpu(_))
    ));
    // A malformed publication.
    std::os::unix::fs::symlink("gdr://v1/device/x", dir.join(hf3fs_gdr::to_hex(&[3; 16]))).unwrap();
    assert!(matches!(
        Iov::open(&[3; 16], mount.path(), MIB, 0, -1),
        Err(Error::Malformed { .. })
    ));
    assert_eq!(Error::RingFull { entries: 1 }.errno(), libc::EAGAIN);
    assert_eq!(Error::FdNotRegistered(3).errno(), libc::EBADF);
}
