//! GPU iovs on a real GPU: create, wrap, export and import across processes; files read
//! into VRAM through the daemon (and written back from it), checked byte for byte; the
//! daemon killed and a client killed with GPU I/O in flight.
//!
//! Without a GPU every test prints why it skips; with `NIXL_REQUIRE_GPU=1` (the GPU
//! machine) a missing GPU fails them.

mod common;

use common::{
    after, assert_bytes, child_lines, data_dir, pattern, patterned_file, role, spawn_child,
    wait_until, Daemon, T,
};
use gpu_mem::DeviceBuffer;
use hf3fs_gdr::{
    daemon_stats, dereg_fd, from_hex, gdr_available, gdr_device_count, reg_fd, to_hex, Cqe, Error,
    GpuIovHandle, Ior, Iov, SyncDirection,
};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn env(key: &str) -> String {
    std::env::var(key).unwrap()
}

/// Waits for exactly `n` completions, sorted by userdata.
fn reap(ior: &mut Ior, n: usize) -> Vec<Cqe> {
    let mut cqes = vec![Cqe::default(); n];
    let mut got = 0;
    let deadline = Instant::now() + T;
    while got < n {
        let k = ior
            .wait_for_ios(&mut cqes[got..], n - got, Some(deadline))
            .unwrap();
        assert!(
            k > 0 || Instant::now() < deadline,
            "{got} of {n} completions in {T:?}"
        );
        got += k;
    }
    cqes.sort_by_key(|c| c.userdata);
    cqes
}

fn gpu_iov_peer() {
    let mount = PathBuf::from(env("HF3FS_MOUNT"));
    let handle = GpuIovHandle::from_bytes(&from_hex(&env("HF3FS_HANDLE")).unwrap()).unwrap();
    let imported = Iov::import_gpu(&handle, &mount).unwrap();
    assert!(imported.is_gpu());
    assert_eq!(imported.gpu_device(), Some(0));
    let mut got = vec![0u8; MIB as usize];
    imported.read_at(0, &mut got).unwrap();
    assert_bytes(
        &got,
        &pattern(1, MIB as usize),
        "exporter's bytes via import",
    );
    imported.write_at(MIB, &pattern(2, MIB as usize)).unwrap();
    imported.sync(SyncDirection::ToStorage).unwrap();
    // The wrapped framework buffer, opened by its publication (id and offset).
    let wrapped_id: [u8; 16] = from_hex(&env("HF3FS_WRAPPED")).unwrap().try_into().unwrap();
    let opened = Iov::open(&wrapped_id, &mount, 64 << 10, 0, -1).unwrap();
    assert!(opened.is_gpu());
    let mut got = vec![0u8; 64 << 10];
    opened.read_at(0, &mut got).unwrap();
    assert_bytes(
        &got,
        &pattern(3, 64 << 10),
        "wrapped buffer via its publication",
    );
    opened.destroy().unwrap();
    imported.destroy().unwrap();
    println!("@@done");
}

#[test]
fn gpu_iov_create_wrap_export_import_across_processes() {
    if role().as_deref() == Some("gpu_iov_peer") {
        return gpu_iov_peer();
    }
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_iov_create_wrap_export_import_across_processes")
    else {
        assert!(!gdr_available());
        return;
    };
    assert!(gdr_available() && gdr_device_count() >= 1);
    let mount = tempfile::tempdir().unwrap();
    let iov = Iov::create_gpu(mount.path(), 2 * MIB, 0, 0).unwrap();
    assert!(iov.is_gpu() && iov.gpu_device() == Some(0));
    iov.write_at(0, &pattern(1, MIB as usize)).unwrap();
    let link = hf3fs_gdr::virt::iovs_dir(mount.path()).join(to_hex(iov.id()));
    let target = std::fs::read_link(&link).unwrap();
    let target = target.to_str().unwrap();
    assert!(
        target.starts_with("gdr://v1/device/0/size/2097152/ipc/"),
        "{target}"
    );
    let handle = iov.export_gpu().unwrap();
    assert_eq!(
        GpuIovHandle::from_bytes(&handle.to_bytes()).unwrap(),
        handle
    );

    // Framework memory: a sub-range of someone else's allocation.
    let framework = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    framework
        .copy_from_host(4096, &pattern(3, 64 << 10))
        .unwrap();
    let wrapped_id = [0x5a; 16];
    // SAFETY: `framework` outlives the wrapped iov and its importer (the child).
    let wrapped = unsafe {
        Iov::wrap_gpu(
            framework.ptr() + 4096,
            &wrapped_id,
            mount.path(),
            64 << 10,
            0,
            0,
        )
    }
    .unwrap();
    assert!(wrapped.export_gpu().unwrap().offset == 4096);
    // Host memory is refused by the pointer check; so is a range past the allocation.
    let host = vec![0u8; 4096];
    // SAFETY: the call fails before anything is published.
    let r = unsafe { Iov::wrap_gpu(host.as_ptr() as u64, &[1; 16], mount.path(), 4096, 0, 0) };
    assert!(matches!(r, Err(Error::Gpu(_))), "{r:?}");
    // SAFETY: as above.
    let r = unsafe { Iov::wrap_gpu(framework.ptr(), &[2; 16], mount.path(), 2 << 20, 0, 0) };
    assert!(matches!(r, Err(Error::Gpu(_))), "{r:?}");
    assert!(Iov::create_gpu(mount.path(), MIB, 0, 99).is_err());
    let host_iov = Iov::create(mount.path(), 4096, 0, -1).unwrap();
    assert!(matches!(
        host_iov.export_gpu(),
        Err(Error::InvalidArgument(_))
    ));

    let mut child = spawn_child(
        "gpu_iov_create_wrap_export_import_across_processes",
        "gpu_iov_peer",
        &[
            ("HF3FS_MOUNT", mount.path().display().to_string()),
            ("HF3FS_HANDLE", to_hex(&handle.to_bytes())),
            ("HF3FS_WRAPPED", to_hex(&wrapped_id)),
        ],
    );
    let lines = child_lines(&mut child);
    assert_eq!(lines.recv_timeout(T).unwrap(), "done");
    assert!(child.wait().unwrap().success());
    iov.sync(SyncDirection::FromStorage).unwrap();
    let mut got = vec![0u8; MIB as usize];
    iov.read_at(MIB, &mut got).unwrap();
    assert_bytes(&got, &pattern(2, MIB as usize), "importer's writes");
    // Destroying the wrapped iov removes only the publication: the memory is intact.
    wrapped.destroy().unwrap();
    assert!(std::fs::symlink_metadata(
        hf3fs_gdr::virt::iovs_dir(mount.path()).join(to_hex(&wrapped_id))
    )
    .is_err());
    let mut back = vec![0u8; 64 << 10];
    framework.copy_to_host(4096, &mut back).unwrap();
    assert_bytes(
        &back,
        &pattern(3, 64 << 10),
        "framework memory after destroy",
    );
    iov.destroy().unwrap();
    assert!(std::fs::symlink_metadata(&link).is_err());
}

#[test]
fn gpu_reads_files_into_vram_and_writes_back() {
    let Some(_gpu) = gpu_mem::gpu_for_test("gpu_reads_files_into_vram_and_writes_back") else {
        return;
    };
    let d = Daemon::start_with(4, &["--staging-mib", "64"]);
    let data = data_dir();
    let len = 64 * MIB as usize + 4097;
    let (path, bytes) = patterned_file(data.path(), "f", 4, len);
    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    reg_fd(fd, 0).unwrap();
    let iov = Iov::create_gpu(d.path(), 80 * MIB, 0, 0).unwrap();
    let mut ior = Ior::create(d.path(), 64, true, 0, Duration::ZERO, -1, 0).unwrap();
    let before = daemon_stats(d.path()).unwrap();

    // The whole file past its end in one I/O (many chunks, a short count).
    ior.prep_io(&iov, true, iov.base(), fd, 0, 80 * MIB, 1)
        .unwrap();
    ior.submit_ios().unwrap();
    assert_eq!(reap(&mut ior, 1)[0].result, len as i64);
    let mut got = vec![0u8; len];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &bytes, "whole file in VRAM");

    // Many small and unaligned I/Os at once.
    iov.write_at(0, &vec![0u8; 8 * MIB as usize]).unwrap();
    let mut expected = vec![0u8; 8 * MIB as usize];
    for i in 0..48u64 {
        let off = i * 170_003;
        let n = 4096 + (i * 777) % 60_000;
        ior.prep_io(&iov, true, iov.base() + off, fd, off + 13 * i, n, i)
            .unwrap();
        expected[off as usize..(off + n) as usize]
            .copy_from_slice(&bytes[(off + 13 * i) as usize..(off + 13 * i + n) as usize]);
    }
    ior.submit_ios().unwrap();
    let c = reap(&mut ior, 48);
    for (i, c) in c.iter().enumerate() {
        assert_eq!(c.result, 4096 + (i as i64 * 777) % 60_000, "I/O {i}");
    }
    let mut got = vec![0u8; 8 * MIB as usize];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &expected, "scattered reads in VRAM");
    let stats = daemon_stats(d.path()).unwrap();
    assert!(
        stats.gpu_bytes - before.gpu_bytes >= len as u64,
        "{stats:?}"
    );

    // VRAM back to a file.
    iov.write_at(0, &bytes[..16 * MIB as usize]).unwrap();
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
    iov.sync(SyncDirection::ToStorage).unwrap();
    wior.prep_io(&iov, false, iov.base(), out.as_raw_fd(), 0, 16 * MIB, 1)
        .unwrap();
    wior.submit_ios().unwrap();
    assert_eq!(reap(&mut wior, 1)[0].result, 16 * MIB as i64);
    assert_bytes(
        &std::fs::read(&out_path).unwrap(),
        &bytes[..16 * MIB as usize],
        "file written from VRAM",
    );
    dereg_fd(out.as_raw_fd());
    dereg_fd(fd);
}

#[test]
fn gpu_daemon_killed_mid_io_fails_waiters() {
    let Some(_gpu) = gpu_mem::gpu_for_test("gpu_daemon_killed_mid_io_fails_waiters") else {
        return;
    };
    let mut d = Daemon::start_with(2, &["--inject-delay-ms", "60000"]);
    let data = data_dir();
    let (slow, _) = patterned_file(data.path(), "f.slow", 1, 1 << 20);
    let file = std::fs::File::open(&slow).unwrap();
    reg_fd(file.as_raw_fd(), 0).unwrap();
    let iov = Iov::create_gpu(d.path(), MIB, 0, 0).unwrap();
    let mut ior = Ior::create(d.path(), 4, true, 0, Duration::ZERO, -1, 0).unwrap();
    ior.prep_io(&iov, true, iov.base(), file.as_raw_fd(), 0, MIB, 1)
        .unwrap();
    ior.submit_ios().unwrap();
    let mut c = [Cqe::default(); 1];
    assert_eq!(
        ior.wait_for_ios(&mut c, 1, after(Duration::from_millis(200)))
            .unwrap(),
        0
    );
    d.kill();
    let start = Instant::now();
    let r = ior.wait_for_ios(&mut c, 1, after(Duration::from_secs(20)));
    assert!(matches!(r, Err(Error::DaemonGone { .. })), "{r:?}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    // The GPU iov is still ours and usable.
    iov.write_at(0, b"still here").unwrap();
    dereg_fd(file.as_raw_fd());
}

fn gpu_stuck_client() {
    let mount = PathBuf::from(env("HF3FS_MOUNT"));
    let file = std::fs::File::open(env("HF3FS_SLOW")).unwrap();
    reg_fd(file.as_raw_fd(), 0).unwrap();
    let iov = Iov::create_gpu(&mount, 4 * MIB, 0, 0).unwrap();
    let mut ior = Ior::create(&mount, 4, true, 0, Duration::ZERO, -1, 0).unwrap();
    ior.prep_io(&iov, true, iov.base(), file.as_raw_fd(), 0, 4 * MIB, 1)
        .unwrap();
    ior.submit_ios().unwrap();
    println!("@@{}", to_hex(iov.id()));
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn gpu_client_killed_daemon_serves_others() {
    if role().as_deref() == Some("gpu_stuck_client") {
        return gpu_stuck_client();
    }
    let Some(_gpu) = gpu_mem::gpu_for_test("gpu_client_killed_daemon_serves_others") else {
        return;
    };
    let d = Daemon::start_with(2, &["--inject-delay-ms", "60000"]);
    let data = data_dir();
    let (slow, _) = patterned_file(data.path(), "f.slow", 1, 4 * MIB as usize);
    let mut child = spawn_child(
        "gpu_client_killed_daemon_serves_others",
        "gpu_stuck_client",
        &[
            ("HF3FS_MOUNT", d.path().display().to_string()),
            ("HF3FS_SLOW", slow.display().to_string()),
        ],
    );
    let lines = child_lines(&mut child);
    let iov_hex = lines.recv_timeout(T).unwrap();
    let link = hf3fs_gdr::virt::iovs_dir(d.path()).join(&iov_hex);
    assert!(std::fs::symlink_metadata(&link).is_ok());
    // Let the daemon import the child's GPU memory and start the (delayed) read.
    std::thread::sleep(Duration::from_millis(300));
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || {
            daemon_stats(d.path()).unwrap().clients_now == 1
        }),
        "the daemon did not release the killed client"
    );
    assert!(
        std::fs::symlink_metadata(&link).is_err(),
        "publication left behind"
    );

    // This process's GPU reads are served as before.
    let (path, bytes) = patterned_file(data.path(), "f", 6, 32 * MIB as usize);
    let file = std::fs::File::open(&path).unwrap();
    reg_fd(file.as_raw_fd(), 0).unwrap();
    let iov = Iov::create_gpu(d.path(), 32 * MIB, 0, 0).unwrap();
    let mut ior = Ior::create(d.path(), 8, true, 0, Duration::ZERO, -1, 0).unwrap();
    for i in 0..4u64 {
        ior.prep_io(
            &iov,
            true,
            iov.base() + i * 8 * MIB,
            file.as_raw_fd(),
            i * 8 * MIB,
            8 * MIB,
            i,
        )
        .unwrap();
    }
    ior.submit_ios().unwrap();
    assert!(reap(&mut ior, 4).iter().all(|c| c.result == 8 * MIB as i64));
    let mut got = vec![0u8; 32 * MIB as usize];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &bytes, "VRAM after another client died");
    dereg_fd(file.as_raw_fd());
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
fn gpu_cold_reads_go_direct_and_a_fixed_depth_client_gets_every_byte() {
    let Some(_gpu) =
        gpu_mem::gpu_for_test("gpu_cold_reads_go_direct_and_a_fixed_depth_client_gets_every_byte")
    else {
        return;
    };
    // Small chunks and two workers: each worker cycles its staging slots many times,
    // completions posted as copies finish while it reads on.
    let d = Daemon::start_with(2, &["--chunk-kib", "256", "--slots", "3"]);
    let data = data_dir();
    let len = 48 * MIB as usize;
    let (path, bytes) = patterned_file(data.path(), "f", 6, len);
    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    reg_fd(fd, 0).unwrap();
    let iov = Iov::create_gpu(d.path(), len as u64, 0, 0).unwrap();
    let mut ior = Ior::create(d.path(), 8, true, 0, Duration::ZERO, -1, 0).unwrap();
    file.sync_all().unwrap();
    // SAFETY: a valid descriptor; advice only.
    let advised = unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(advised, 0);
    assert!(
        resident_fraction(&file) < 0.01,
        "{} could not be evicted from the page cache: TMPDIR must be on a disk file \
         system (not tmpfs) for this test",
        path.display()
    );
    let before = daemon_stats(d.path()).unwrap();

    // Four 1 MiB reads in flight, refilled as each completes.
    let block = MIB;
    let (mut next, mut inflight, mut done) = (0u64, 0u32, 0u64);
    let mut cqes = [Cqe::default(); 4];
    while done < len as u64 {
        while inflight < 4 && next < len as u64 {
            ior.prep_io(&iov, true, iov.base() + next, fd, next, block, next)
                .unwrap();
            next += block;
            inflight += 1;
        }
        ior.submit_ios().unwrap();
        let n = ior.wait_for_ios(&mut cqes, 1, after(T)).unwrap();
        assert!(n > 0, "no completion in {T:?}");
        for c in &cqes[..n] {
            assert_eq!(c.result, block as i64, "read at {}", c.userdata);
            done += block;
        }
        inflight -= n as u32;
    }
    let mut got = vec![0u8; len];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &bytes, "cold file in VRAM");
    let stats = daemon_stats(d.path()).unwrap();
    assert_eq!(
        (
            stats.direct_ops - before.direct_ops,
            stats.buffered_ops - before.buffered_ops
        ),
        ((len / (256 << 10)) as u64, 0),
        "every aligned cold chunk with O_DIRECT: {stats:?}"
    );
    assert!(
        resident_fraction(&file) < 0.01,
        "cold reads filled the page cache ({:.0}%)",
        resident_fraction(&file) * 100.0
    );
    dereg_fd(fd);
}

#[test]
fn gpu_cached_reads_copied_piece_by_piece_arrive_whole() {
    let Some(_gpu) = gpu_mem::gpu_for_test("gpu_cached_reads_copied_piece_by_piece_arrive_whole")
    else {
        return;
    };
    // 1 MiB chunks, a device copy after every 64 KiB read from the page cache.
    let d = Daemon::start_with(2, &["--chunk-kib", "1024", "--copy-kib", "64"]);
    let data = data_dir();
    let len = 5 * MIB as usize + 777;
    let (path, bytes) = patterned_file(data.path(), "f", 8, len);
    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    reg_fd(fd, 0).unwrap();
    // Cached: just written, and read once more to be sure.
    assert_eq!(std::fs::read(&path).unwrap().len(), len);
    let iov = Iov::create_gpu(d.path(), 8 * MIB, 0, 0).unwrap();
    let mut ior = Ior::create(d.path(), 16, true, 0, Duration::ZERO, -1, 0).unwrap();
    let before = daemon_stats(d.path()).unwrap();
    // The whole file in one I/O past its end (a short count), then unaligned pieces.
    ior.prep_io(&iov, true, iov.base(), fd, 0, 6 * MIB, 1)
        .unwrap();
    ior.submit_ios().unwrap();
    assert_eq!(reap(&mut ior, 1)[0].result, len as i64);
    let mut got = vec![0u8; len];
    iov.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &bytes, "cached file in VRAM, copied in pieces");
    let stats = daemon_stats(d.path()).unwrap();
    assert!(
        stats.buffered_ops - before.buffered_ops > 6,
        "pieces read separately (more reads than the 6 chunks): {stats:?}"
    );

    iov.write_at(0, &vec![0u8; 4 * MIB as usize]).unwrap();
    let (off, n) = (12_345u64, 3 * MIB + 999);
    ior.prep_io(&iov, true, iov.base() + 100, fd, off, n, 2)
        .unwrap();
    ior.submit_ios().unwrap();
    assert_eq!(reap(&mut ior, 1)[0].result, n as i64);
    let mut got = vec![0u8; n as usize];
    iov.read_at(100, &mut got).unwrap();
    assert_bytes(
        &got,
        &bytes[off as usize..(off + n) as usize],
        "unaligned cached read in pieces",
    );
    dereg_fd(fd);
}
