//! The FILE backend (feature `file`) against a real `hf3fs-gdr` daemon process: WRITE
//! DRAM → file and READ file → DRAM round trips (staged and zero-copy host memory),
//! several descriptors, a 64 MiB transfer split across rings, notifications after the
//! data, and the failure model: a read past the end of the file, a closed descriptor,
//! unregistered or out-of-range descriptors, a mount nobody serves, and a daemon killed
//! mid-transfer — each a typed error, none a hang — and a restarted daemon serving the
//! same requests again.
#![cfg(feature = "file")]

mod file_support;

use file_support::{
    assert_bytes, checksum, file_agent, params, pattern, serve_if_daemon, Daemon, ShmBuffer,
    TempDir,
};
use nixl::{Agent, AgentConfig, Desc, DescList, Error, MemKind, XferOp, XferStatus};
use std::os::fd::{AsRawFd, IntoRawFd};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const TIMEOUT: Duration = Duration::from_secs(30);

/// Every test of this file holds this while it runs: the restart test counts the
/// process's file descriptors and threads, which other tests' agents and daemons would
/// change under it.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    // A test that failed while holding it poisons it; the next one still runs alone.
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn dram(descs: impl IntoIterator<Item = Desc>) -> DescList {
    DescList::from_descs(MemKind::Dram, descs)
}

fn file_list(fd: i32, ranges: &[(u64, u64)]) -> DescList {
    DescList::from_descs(
        MemKind::File,
        ranges
            .iter()
            .map(|&(off, len)| Desc::new(off, len, fd as u64)),
    )
}

/// A file opened read-write in `dir`, created empty.
fn open_rw(dir: &TempDir, name: &str) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.path().join(name))
        .unwrap()
}

fn backend_code(r: &nixl::Result<impl std::fmt::Debug>) -> Option<i32> {
    match r {
        Err(Error::Backend { backend, code, .. }) if backend == "FILE" => Some(*code),
        _ => None,
    }
}

/// WRITE three pieces of `src` to the file, READ them back into `dst` (cleared), with
/// a notification after each transfer; `src` and `dst` are registered already.
fn round_trip(agent: &Agent, fd: i32, src: &mut [u8], dst: &mut [u8]) {
    let seed = src.as_ptr() as u64;
    src.copy_from_slice(&pattern(seed, src.len()));
    // Three pieces of different sizes, reordered between memory and file.
    let pieces = [(0usize, 4096usize), (8192, 3 * MIB + 17), (5 * MIB, 1000)];
    let file_at = [4 * MIB as u64, 0, 4 * MIB as u64 + 4096];
    let mem = |base: u64| {
        dram(
            pieces
                .iter()
                .map(|&(o, l)| Desc::new(base + o as u64, l as u64, 0)),
        )
    };
    let files = file_list(
        fd,
        &pieces
            .iter()
            .zip(file_at)
            .map(|(&(_, l), at)| (at, l as u64))
            .collect::<Vec<_>>(),
    );
    let name = agent.name().to_string();
    let mut w = agent
        .create_xfer_req(
            XferOp::Write,
            &mem(src.as_ptr() as u64),
            &files,
            &name,
            Some(b"written".to_vec()),
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    assert_eq!(agent.get_notifs()[&name], vec![b"written".to_vec()]);
    dst.fill(0);
    let mut r = agent
        .create_xfer_req(
            XferOp::Read,
            &mem(dst.as_ptr() as u64),
            &files,
            &name,
            Some(b"read".to_vec()),
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(agent.get_notifs()[&name], vec![b"read".to_vec()]);
    for &(o, l) in &pieces {
        assert_eq!(
            checksum(&dst[o..o + l]),
            checksum(&src[o..o + l]),
            "piece at {o}"
        );
        assert_bytes(&dst[o..o + l], &src[o..o + l], "piece");
    }
    // The file holds each piece where the list put it.
    let mut at = 0;
    for (&(o, l), f) in pieces.iter().zip(file_at) {
        let mut back = vec![0u8; l];
        use std::os::unix::fs::FileExt;
        // SAFETY: `fd` is open for the duration (borrowed, not closed).
        let file = std::mem::ManuallyDrop::new(unsafe {
            <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd)
        });
        file.read_exact_at(&mut back, f).unwrap();
        assert_bytes(&back, &src[o..o + l], "file contents");
        at += l;
    }
    assert!(at > 3 * MIB);
    // Reposting moves it again (a fresh READ over a cleared destination).
    dst.fill(0);
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_bytes(
        &dst[8192..8192 + 3 * MIB + 17],
        &src[8192..8192 + 3 * MIB + 17],
        "again",
    );
}

#[test]
fn write_then_read_round_trips_staged_and_zero_copy_dram() {
    let _serial = serial();
    serve_if_daemon();
    let d = Daemon::start("write_then_read_round_trips_staged_and_zero_copy_dram", 0);
    let data = TempDir::new("nixl-file-data");
    let file = open_rw(&data, "round");
    let fd = file.as_raw_fd();
    // Default rings; 3FS's partial batches (io_depth -4 on one ring: three I/Os go as
    // one partial batch once submitted); small I/Os through 4 staging slots (48 pieces
    // of the 3 MiB descriptor wait for slots in turn).
    for extra in [
        &[][..],
        &[("io_depth", "-4"), ("timeout_ms", "5"), ("rings", "1")][..],
        &[
            ("max_io_size", "65536"),
            ("staging_size", "262144"),
            ("staging_slot_size", "65536"),
        ][..],
    ] {
        let agent = file_agent("self", d.path(), extra);
        let mut src = vec![0u8; 6 * MIB];
        let mut dst = vec![0u8; 6 * MIB];
        // SAFETY: the buffers and the file outlive the handle and every request.
        let _h = unsafe {
            agent
                .register_mem(
                    &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
                    None,
                )
                .unwrap()
        };
        // SAFETY: as above.
        let _f = unsafe {
            agent
                .register_mem(&file_list(fd, &[(0, 16 * MIB as u64)]), None)
                .unwrap()
        };
        let modes = agent.query_mem(&dram([Desc::from_slice(&src)]));
        assert_eq!(
            modes,
            vec![Some(vec!["FILE(staged)".to_string()])],
            "{extra:?}"
        );
        round_trip(&agent, fd, &mut src, &mut dst);
    }
    // Host memory the daemon maps itself: no staging.
    let agent = file_agent("zc", d.path(), &[]);
    let mut src = ShmBuffer::new(6 * MIB);
    let mut dst = ShmBuffer::new(6 * MIB);
    let list = dram([
        Desc::from_slice(src.as_slice()),
        Desc::from_slice(dst.as_slice()),
    ]);
    // SAFETY: the mappings and the file outlive the handles and every request.
    let _h = unsafe { agent.register_mem(&list, None).unwrap() };
    // SAFETY: as above.
    let _f = unsafe {
        agent
            .register_mem(&file_list(fd, &[(0, 16 * MIB as u64)]), None)
            .unwrap()
    };
    assert_eq!(
        agent.query_mem(&list),
        vec![Some(vec!["FILE(zero-copy)".to_string()]); 2]
    );
    round_trip(&agent, fd, src.as_mut_slice(), dst.as_mut_slice());
    let stats = hf3fs_gdr::daemon_stats(d.path()).unwrap();
    assert!(stats.host_bytes > 0, "{stats:?}");
}

#[test]
fn a_64_mib_transfer_is_split_across_rings() {
    let _serial = serial();
    serve_if_daemon();
    let d = Daemon::start("a_64_mib_transfer_is_split_across_rings", 0);
    let data = TempDir::new("nixl-file-data");
    let file = open_rw(&data, "big");
    let fd = file.as_raw_fd();
    let agent = file_agent(
        "big",
        d.path(),
        &[("rings", "4"), ("max_io_size", "4194304")],
    );
    let len = 64 * MIB;
    let mut src = ShmBuffer::new(len);
    src.as_mut_slice().copy_from_slice(&pattern(64, len));
    let dst = ShmBuffer::new(len);
    let staged = vec![0u8; len];
    // SAFETY: all three buffers and the file outlive the handles and the requests.
    let _h = unsafe {
        agent
            .register_mem(
                &dram([
                    Desc::from_slice(src.as_slice()),
                    Desc::from_slice(dst.as_slice()),
                    Desc::from_slice(&staged),
                ]),
                None,
            )
            .unwrap()
    };
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(fd, &[(0, len as u64)]), None) }.unwrap();
    let whole = |b: &[u8]| dram([Desc::from_slice(b)]);
    let file_whole = file_list(fd, &[(0, len as u64)]);
    let start = Instant::now();
    let mut w = agent
        .create_xfer_req(
            XferOp::Write,
            &whole(src.as_slice()),
            &file_whole,
            "big",
            None,
        )
        .unwrap();
    assert_eq!(w.op_count(), 16, "64 MiB in 4 MiB I/Os");
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    let mut r = agent
        .create_xfer_req(
            XferOp::Read,
            &whole(dst.as_slice()),
            &file_whole,
            "big",
            None,
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    assert_eq!(checksum(dst.as_slice()), checksum(src.as_slice()));
    // Staged: 64 pieces of one 1 MiB slot each, through 64 slots.
    let mut s = agent
        .create_xfer_req(XferOp::Read, &whole(&staged), &file_whole, "big", None)
        .unwrap();
    assert_eq!(s.op_count(), 64);
    assert_eq!(s.telemetry().staged_bytes, len as u64);
    s.post().unwrap();
    s.wait(TIMEOUT).unwrap();
    assert_eq!(checksum(&staged), checksum(src.as_slice()));
    eprintln!(
        "64 MiB written, read zero-copy and read staged in {:?}",
        start.elapsed()
    );
}

#[test]
fn a_read_past_the_end_of_the_file_fails_at_check() {
    let _serial = serial();
    serve_if_daemon();
    let d = Daemon::start("a_read_past_the_end_of_the_file_fails_at_check", 0);
    let data = TempDir::new("nixl-file-data");
    let path = data.path().join("short");
    std::fs::write(&path, pattern(3, 10_000)).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    let agent = file_agent("eof", d.path(), &[]);
    let buf = vec![0u8; 64 * 1024];
    // SAFETY: the buffer and the file outlive the handles and the requests.
    let _h = unsafe { agent.register_mem(&dram([Desc::from_slice(&buf)]), None) }.unwrap();
    // The region may extend past the end (files grow); reading there is the error.
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(fd, &[(0, 1 << 20)]), None) }.unwrap();
    let base = buf.as_ptr() as u64;
    // Inside: fine.
    let mut ok = agent
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::new(base, 10_000, 0)]),
            &file_list(fd, &[(0, 10_000)]),
            "eof",
            None,
        )
        .unwrap();
    ok.post().unwrap();
    ok.wait(TIMEOUT).unwrap();
    assert_bytes(&buf[..10_000], &pattern(3, 10_000), "inside the file");
    // Straddling the end: a short count; wholly past it: 0 bytes. Both ENODATA, at
    // check, with nothing reported done.
    for (off, len) in [(8192u64, 4096u64), (20_000, 4096)] {
        let mut req = agent
            .create_xfer_req(
                XferOp::Read,
                &dram([Desc::new(base, len, 0)]),
                &file_list(fd, &[(off, len)]),
                "eof",
                Some(b"never".to_vec()),
            )
            .unwrap();
        let posted = req.post();
        let r = match posted {
            Ok(XferStatus::Done) => panic!("a read past the end reported Done"),
            Ok(XferStatus::InProgress) => req.wait(TIMEOUT),
            Err(e) => Err(e),
        };
        assert_eq!(backend_code(&r), Some(libc::ENODATA), "{off}+{len}: {r:?}");
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("past the end of the file"), "{msg}");
    }
    assert!(
        agent.get_notifs().is_empty(),
        "no notification for a failed transfer"
    );
}

#[test]
fn closed_and_unregistered_descriptors_are_typed_errors() {
    let _serial = serial();
    serve_if_daemon();
    let d = Daemon::start("closed_and_unregistered_descriptors_are_typed_errors", 0);
    let data = TempDir::new("nixl-file-data");
    let agent = file_agent("bad", d.path(), &[]);
    let buf = vec![0u8; 1 << 20];
    let base = buf.as_ptr() as u64;
    // SAFETY: the buffer outlives the handle and the requests.
    let _h = unsafe { agent.register_mem(&dram([Desc::from_slice(&buf)]), None) }.unwrap();

    // Registering a descriptor that is not open.
    let closed = open_rw(&data, "gone").into_raw_fd();
    // SAFETY: we own `closed` (into_raw_fd) and close it once.
    unsafe { libc::close(closed) };
    // SAFETY: refused before anything is used.
    let r = unsafe { agent.register_mem(&file_list(closed, &[(0, 4096)]), None) };
    assert!(
        matches!(r, Err(Error::InvalidParam(ref m)) if m.contains("not an open file")),
        "{r:?}"
    );

    // A descriptor closed after registration: the transfer fails with EBADF.
    let file = open_rw(&data, "f");
    file.set_len(1 << 20).unwrap();
    let fd = file.into_raw_fd();
    // SAFETY: the buffer outlives the handle; the descriptor is closed on purpose below.
    let f = unsafe { agent.register_mem(&file_list(fd, &[(0, 1 << 20)]), None) }.unwrap();
    let mut req = agent
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::new(base, 4096, 0)]),
            &file_list(fd, &[(0, 4096)]),
            "bad",
            None,
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    // SAFETY: we own `fd` (into_raw_fd) and close it once.
    unsafe { libc::close(fd) };
    let r = req
        .post()
        .and_then(|_| req.wait(TIMEOUT).map(|()| XferStatus::Done));
    assert_eq!(backend_code(&r), Some(libc::EBADF), "{r:?}");
    // Its number reused by another file: still refused (never I/O on the wrong file).
    let other = open_rw(&data, "other");
    let reused = other.as_raw_fd();
    if reused == fd {
        let r = req
            .post()
            .and_then(|_| req.wait(TIMEOUT).map(|()| XferStatus::Done));
        assert_eq!(backend_code(&r), Some(libc::EBADF), "{r:?}");
        // And registering the new file under the old number is refused while the old
        // registration lives, then accepted once it is gone.
        // SAFETY: refused before anything is used.
        let r = unsafe { agent.register_mem(&file_list(reused, &[(0, 4096)]), None) };
        assert!(
            matches!(r, Err(Error::InvalidParam(ref m)) if m.contains("another file")),
            "{r:?}"
        );
        drop(req);
        drop(f);
        // SAFETY: `other` outlives the handle.
        let again = unsafe { agent.register_mem(&file_list(reused, &[(0, 4096)]), None) };
        assert!(again.is_ok(), "{again:?}");
    } else {
        eprintln!("descriptor number {fd} was not reused ({reused}): reuse case skipped");
    }

    // Two agents of this process register one descriptor: either may go first.
    let shared_file = open_rw(&data, "shared");
    shared_file.set_len(8192).unwrap();
    let sfd = shared_file.as_raw_fd();
    let other_agent = file_agent("other", d.path(), &[]);
    // SAFETY: the buffer outlives the handle and the requests.
    let _oh = unsafe { other_agent.register_mem(&dram([Desc::from_slice(&buf)]), None) }.unwrap();
    // SAFETY: the file outlives both handles.
    let first = unsafe { agent.register_mem(&file_list(sfd, &[(0, 8192)]), None) }.unwrap();
    // SAFETY: as above.
    let _second = unsafe { other_agent.register_mem(&file_list(sfd, &[(0, 8192)]), None) }.unwrap();
    drop(first);
    let mut req = other_agent
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::new(base, 8192, 0)]),
            &file_list(sfd, &[(0, 8192)]),
            "other",
            None,
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();

    // Descriptors outside what was registered, on either side.
    let file = open_rw(&data, "g");
    // SAFETY: the file outlives the handle.
    let _g =
        unsafe { agent.register_mem(&file_list(file.as_raw_fd(), &[(4096, 8192)]), None) }.unwrap();
    let g = file.as_raw_fd();
    let r = agent.create_xfer_req(
        XferOp::Write,
        &dram([Desc::new(base, 8192, 0)]),
        &file_list(g, &[(0, 8192)]),
        "bad",
        None,
    );
    assert!(matches!(r, Err(Error::RemoteOutOfBounds { .. })), "{r:?}");
    let r = agent.create_xfer_req(
        XferOp::Write,
        &dram([Desc::new(base + (1 << 20) - 100, 200, 0)]),
        &file_list(g, &[(4096, 200)]),
        "bad",
        None,
    );
    assert!(matches!(r, Err(Error::NotRegistered { .. })), "{r:?}");
    // Another agent's files, and FILE on the local side.
    let r = agent.create_xfer_req(
        XferOp::Write,
        &dram([Desc::new(base, 100, 0)]),
        &file_list(g, &[(4096, 100)]),
        "someone-else",
        None,
    );
    assert!(matches!(r, Err(Error::UnknownAgent(_))), "{r:?}");
    let r = agent.create_xfer_req(
        XferOp::Write,
        &file_list(g, &[(4096, 100)]),
        &file_list(g, &[(4096, 100)]),
        "bad",
        None,
    );
    assert!(r.is_err(), "FILE to FILE: {r:?}");
    let r = agent.gen_notif("someone-else", b"x");
    assert!(r.is_err(), "{r:?}");
}

#[test]
fn bad_parameters_and_a_mount_nobody_serves_are_refused() {
    let _serial = serial();
    serve_if_daemon();
    let agent = Agent::new(
        "p",
        AgentConfig {
            listen_addr: None,
            ..AgentConfig::default()
        },
    )
    .unwrap();
    let r = agent.create_backend("FILE", &Default::default());
    assert!(
        matches!(r, Err(Error::InvalidParam(ref m)) if m.contains("`mount`")),
        "{r:?}"
    );
    let empty = TempDir::new("nixl-file-unserved");
    let r = agent.create_backend("FILE", &params(empty.path(), &[]));
    assert!(
        matches!(r, Err(Error::InvalidParam(ref m)) if m.contains("not served")),
        "{r:?}"
    );
    let r = agent.create_backend("FILE", &params(&empty.path().join("missing"), &[]));
    assert!(
        matches!(r, Err(Error::InvalidParam(ref m)) if m.contains("not a directory")),
        "{r:?}"
    );
    for (k, v, what) in [
        ("entries", "0", "entries=0"),
        ("io_depth", "300", "exceeds entries"),
        ("io_depth", "4", "use io_depth=-4"),
        ("rings", "0", "rings=0"),
        ("staging_size", "10", "smaller than one staging slot"),
        ("max_io_size", "x", "not valid"),
        ("colour", "blue", "no parameter `colour`"),
    ] {
        let r = agent.create_backend("FILE", &params(empty.path(), &[(k, v)]));
        assert!(
            matches!(r, Err(Error::InvalidParam(ref m)) if m.contains(what)),
            "{k}={v}: {r:?}"
        );
    }
}

#[test]
fn a_daemon_killed_mid_transfer_fails_it_within_the_timeout() {
    let _serial = serial();
    serve_if_daemon();
    let mut d = Daemon::start(
        "a_daemon_killed_mid_transfer_fails_it_within_the_timeout",
        60_000,
    );
    let data = TempDir::new("nixl-file-data");
    let path = data.path().join("stuck.slow");
    std::fs::write(&path, pattern(9, 1 << 20)).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let fd = file.as_raw_fd();
    let agent = file_agent("dies", d.path(), &[]);
    let zero_copy = ShmBuffer::new(1 << 20);
    let staged = vec![0u8; 1 << 20];
    // SAFETY: the buffers and the file outlive the handles and the requests.
    let _h = unsafe {
        agent.register_mem(
            &dram([
                Desc::from_slice(zero_copy.as_slice()),
                Desc::from_slice(&staged),
            ]),
            None,
        )
    }
    .unwrap();
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(fd, &[(0, 1 << 20)]), None) }.unwrap();
    let mut reqs: Vec<_> = [zero_copy.as_slice(), &staged[..]]
        .iter()
        .map(|b| {
            agent
                .create_xfer_req(
                    XferOp::Read,
                    &dram([Desc::from_slice(b)]),
                    &file_list(fd, &[(0, 1 << 20)]),
                    "dies",
                    None,
                )
                .unwrap()
        })
        .collect();
    for req in &mut reqs {
        assert_eq!(req.post().unwrap(), XferStatus::InProgress);
    }
    std::thread::sleep(Duration::from_millis(100));
    for req in &mut reqs {
        assert_eq!(
            req.status().unwrap(),
            XferStatus::InProgress,
            "stuck in the daemon"
        );
    }
    d.kill();
    let start = Instant::now();
    for req in &mut reqs {
        let r = req.wait(Duration::from_secs(20));
        assert_eq!(backend_code(&r), Some(libc::ENOTCONN), "{r:?}");
    }
    let took = start.elapsed();
    assert!(took < Duration::from_secs(2), "took {took:?}");
    // A failed request stays failed (the agent's rule); a new one fails at once,
    // typed: its ring finds no daemon to attach to.
    let mut fresh: Vec<_> = [zero_copy.as_slice(), &staged[..]]
        .iter()
        .map(|b| {
            agent
                .create_xfer_req(
                    XferOp::Read,
                    &dram([Desc::from_slice(b)]),
                    &file_list(fd, &[(0, 1 << 20)]),
                    "dies",
                    None,
                )
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    let r = fresh[0].post();
    assert!(start.elapsed() < Duration::from_secs(2), "{r:?}");
    assert!(
        matches!(backend_code(&r), Some(libc::ENOTCONN | libc::ECONNREFUSED)),
        "{r:?}"
    );
    // A daemon restarted on the mount serves the same registrations, and the request
    // whose post was refused posts again.
    d.restart(
        "a_daemon_killed_mid_transfer_fails_it_within_the_timeout",
        0,
    );
    for (req, buf) in fresh.iter_mut().zip([zero_copy.as_slice(), &staged[..]]) {
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
        assert_bytes(buf, &pattern(9, 1 << 20), "after the restart");
    }
}

/// What the agent's process holds that a daemon restart could leak: file descriptors,
/// threads, `/dev/shm` files it maps, and its publications under the mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    fds: usize,
    threads: usize,
    shm_mapped: usize,
    published: usize,
}

impl Held {
    fn now(mount: &std::path::Path) -> Self {
        let count = |dir: &str| std::fs::read_dir(dir).unwrap().count();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let shm: std::collections::HashSet<&str> = maps
            .lines()
            .filter_map(|l| l.split_once("/dev/shm/").map(|(_, name)| name))
            .collect();
        Self {
            fds: count("/proc/self/fd"),
            threads: count("/proc/self/task"),
            shm_mapped: shm.len(),
            published: count_tree(&mount.join("3fs-virt")),
        }
    }
}

/// Entries under `dir`, recursively (0 where it does not exist).
fn count_tree(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => 1 + count_tree(&e.path()),
                    _ => 1,
                })
                .sum()
        })
        .unwrap_or(0)
}

/// The daemon killed after I/O (idle) and in the middle of a WRITE and of a READ, then
/// started again on the same mount, four times over: while it is down a post fails at
/// once with `ENOTCONN` or `ECONNREFUSED` (the request in flight with `ENOTCONN` within
/// 2 s); once it is back the same registrations are served — the backend attaches fresh
/// rings to the new daemon on the next post, and the registered descriptors need no
/// re-registration — with WRITE and READ back verified, through zero-copy and staged
/// memory alike; and after each cycle of restarts the agent holds as many descriptors,
/// threads, `/dev/shm` mappings and publications under the mount as after the first.
#[test]
fn a_restarted_daemon_is_reached_again_without_leaks() {
    let _serial = serial();
    const TEST: &str = "a_restarted_daemon_is_reached_again_without_leaks";
    const LEN: usize = 1 << 20;
    const SLOW_MS: u64 = 400;
    serve_if_daemon();
    let mut d = Daemon::start(TEST, SLOW_MS);
    let data = TempDir::new("nixl-file-restart");
    let fast_file = open_rw(&data, "fast.bin");
    let slow_file = open_rw(&data, "stuck.slow");
    fast_file.set_len(LEN as u64).unwrap();
    slow_file.set_len(LEN as u64).unwrap();
    let (fast, slow) = (fast_file.as_raw_fd(), slow_file.as_raw_fd());
    let agent = file_agent("restarts", d.path(), &[]);
    let mut zero_copy = ShmBuffer::new(LEN);
    let mut staged = vec![0u8; LEN];
    let mut back = vec![0u8; LEN];
    // SAFETY: the buffers and the files outlive the handles and every request (all
    // dropped before them, at the end of this function).
    let _h = unsafe {
        agent.register_mem(
            &dram([
                Desc::from_slice(zero_copy.as_slice()),
                Desc::from_slice(&staged),
                Desc::from_slice(&back),
            ]),
            None,
        )
    }
    .unwrap();
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(fast, &[(0, LEN as u64)]), None) }.unwrap();
    // SAFETY: as above.
    let _s = unsafe { agent.register_mem(&file_list(slow, &[(0, LEN as u64)]), None) }.unwrap();
    let req = |op: XferOp, mem: &[u8], fd: i32| {
        agent
            .create_xfer_req(
                op,
                &dram([Desc::from_slice(mem)]),
                &file_list(fd, &[(0, LEN as u64)]),
                "restarts",
                None,
            )
            .unwrap()
    };
    // WRITE `src` (filled with `seed`'s pattern) to the fast file, READ it back,
    // verified; returns how long the first post took to complete.
    let mut seed = 0;
    let mut verified_round = |src: &mut [u8], back: &mut [u8], label: &str| -> Duration {
        seed += 1;
        src.copy_from_slice(&pattern(seed, LEN));
        let started = Instant::now();
        let mut w = req(XferOp::Write, src, fast);
        w.post().unwrap();
        w.wait(TIMEOUT)
            .unwrap_or_else(|e| panic!("{label}: WRITE: {e}"));
        let took = started.elapsed();
        back.fill(0);
        let mut r = req(XferOp::Read, back, fast);
        r.post().unwrap();
        r.wait(TIMEOUT)
            .unwrap_or_else(|e| panic!("{label}: READ: {e}"));
        assert_bytes(back, src, label);
        took
    };
    let down = |r: &nixl::Result<XferStatus>, label: &str| {
        assert!(
            matches!(backend_code(r), Some(libc::ENOTCONN | libc::ECONNREFUSED)),
            "{label}: a post with the daemon down: {r:?}"
        );
    };
    verified_round(zero_copy.as_mut_slice(), &mut back, "first, zero-copy");
    verified_round(&mut staged, &mut back, "first, staged");
    // What the agent holds once it has lived through one restart of each kind (the
    // rings it keeps attached depend on the transfers it ran, not on the restarts).
    let mut baseline = None;
    for cycle in 0..4 {
        // Killed after I/O: the next post finds no daemon, in the post itself: the idle
        // rings it would take (attached to the dead daemon, whose socket closed when it
        // ended, before `kill` returned) are asked first and dropped.
        d.kill();
        let mut first = req(XferOp::Read, &back, fast);
        let started = Instant::now();
        let r = first.post();
        let failed = started.elapsed();
        assert!(
            r.is_err(),
            "cycle {cycle}: the post took a dead daemon's ring (it would fail only at \
             check): {r:?}"
        );
        assert!(failed < Duration::from_secs(2), "{r:?} after {failed:?}");
        down(&r, "idle");
        d.restart(TEST, SLOW_MS);
        let restarted = Instant::now();
        first.post().unwrap();
        first.wait(TIMEOUT).unwrap();
        let reached = restarted.elapsed();
        drop(first);
        verified_round(zero_copy.as_mut_slice(), &mut back, "after an idle restart");

        // Killed in the middle of a WRITE, then of a READ (the slow file's chunks wait
        // in the daemon).
        for op in [XferOp::Write, XferOp::Read] {
            let buf: &[u8] = if op == XferOp::Write { &staged } else { &back };
            let mut stuck = req(op, buf, slow);
            assert_eq!(stuck.post().unwrap(), XferStatus::InProgress);
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(stuck.status().unwrap(), XferStatus::InProgress, "{op:?}");
            // Counted from the signal, not from the end of the daemon's teardown: a kill
            // in progress is seen through /proc.
            d.send_kill();
            let killed = Instant::now();
            let r = stuck.wait(Duration::from_secs(20));
            let failed = killed.elapsed();
            d.kill();
            assert_eq!(backend_code(&r), Some(libc::ENOTCONN), "{op:?}: {r:?}");
            assert!(
                failed < Duration::from_secs(2),
                "{op:?}: failed after {failed:?}"
            );
            drop(stuck);
            d.restart(TEST, SLOW_MS);
            let first = verified_round(&mut staged, &mut back, "after a restart mid-I/O");
            println!(
                "cycle {cycle}, killed mid-{op:?}: ENOTCONN {:.1} ms after the kill ({}); \
                 the restarted daemon served a 1 MiB WRITE in {:.1} ms",
                failed.as_secs_f64() * 1e3,
                r.as_ref().unwrap_err(),
                first.as_secs_f64() * 1e3
            );
        }
        let held = Held::now(d.path());
        println!(
            "cycle {cycle}: killed idle, the next post failed after {:.1} ms \
             ({}); reached again {:.1} ms after the restart; held {held:?} (after the \
             first cycle {baseline:?})",
            failed.as_secs_f64() * 1e3,
            r.unwrap_err(),
            reached.as_secs_f64() * 1e3
        );
        assert_eq!(
            held,
            *baseline.get_or_insert(held),
            "cycle {cycle}: the restarts leaked"
        );
    }
}

/// A daemon being killed is told before the kernel has torn it down: its socket closes
/// only at the end of the teardown (long for a daemon holding much memory, or on a loaded
/// host), while its `/proc` status shows the SIGKILL pending at once. A READ stuck in the
/// daemon fails typed (`ENOTCONN`) within the bound; how it was seen, and when the
/// daemon ended, are printed (docs/BENCHMARKS.md).
#[test]
fn a_daemon_being_killed_is_told_before_its_teardown_ends() {
    let _serial = serial();
    const TEST: &str = "a_daemon_being_killed_is_told_before_its_teardown_ends";
    const LEN: usize = 1 << 20;
    const BALLAST_MIB: usize = 1024;
    serve_if_daemon();
    let data = TempDir::new("nixl-file-doomed");
    let slow_file = open_rw(&data, "stuck.slow");
    slow_file.set_len(LEN as u64).unwrap();
    let slow = slow_file.as_raw_fd();
    let back = vec![0u8; LEN];
    for round in 0..3 {
        let mut d = Daemon::start_with_ballast(TEST, 400, BALLAST_MIB);
        let agent = file_agent("doomed", d.path(), &[]);
        // SAFETY: the buffer and the file outlive the handles and the request (dropped
        // at the end of the round).
        let _h = unsafe { agent.register_mem(&dram([Desc::from_slice(&back)]), None) }.unwrap();
        // SAFETY: as above.
        let _s = unsafe { agent.register_mem(&file_list(slow, &[(0, LEN as u64)]), None) }.unwrap();
        let mut stuck = agent
            .create_xfer_req(
                XferOp::Read,
                &dram([Desc::from_slice(&back)]),
                &file_list(slow, &[(0, LEN as u64)]),
                "doomed",
                None,
            )
            .unwrap();
        assert_eq!(stuck.post().unwrap(), XferStatus::InProgress);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(stuck.status().unwrap(), XferStatus::InProgress);
        d.send_kill();
        let killed = Instant::now();
        let r = stuck.wait(Duration::from_secs(20));
        let told = killed.elapsed();
        d.kill();
        let ended = killed.elapsed();
        assert_eq!(backend_code(&r), Some(libc::ENOTCONN), "{r:?}");
        assert!(told < Duration::from_secs(2), "told after {told:?}: {r:?}");
        println!(
            "round {round}: a daemon holding {BALLAST_MIB} MiB killed mid-READ: ENOTCONN \
             {:.1} ms after the signal ({}); the daemon ended {:.1} ms after it",
            told.as_secs_f64() * 1e3,
            r.unwrap_err(),
            ended.as_secs_f64() * 1e3
        );
    }
}
