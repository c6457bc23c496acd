//! The `POSIX` backend: DRAM <-> FILE by `pread`/`pwrite` within one agent, with and
//! without progress threads, its typed errors, and `query_mem_info` on file paths.
#![cfg(feature = "posix")]

use nixl::{Agent, AgentConfig, BackendParams, Desc, DescList, Error, MemKind, XferOp, XferStatus};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(30);

/// A scratch file path unique to this process and `tag`, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!("nixl-posix-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        Self(path)
    }
    fn open_rw(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&self.0)
            .unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
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

fn posix_agent(name: &str, progress_thread: bool) -> Agent {
    let agent = Agent::new(
        name,
        AgentConfig {
            progress_thread,
            ..AgentConfig::default()
        },
    )
    .unwrap();
    agent
        .create_backend("POSIX", &BackendParams::new())
        .unwrap();
    agent
}

fn backend_code<T: std::fmt::Debug>(r: &nixl::Result<T>) -> Option<i32> {
    match r {
        Err(Error::Backend { backend, code, .. }) if backend == "POSIX" => Some(*code),
        _ => None,
    }
}

/// Drives a request to its end by status checks only (no waiting helper), as a caller
/// without progress threads does.
fn drive(req: &mut nixl::XferReq) -> nixl::Result<()> {
    let start = Instant::now();
    loop {
        match req.status()? {
            XferStatus::Done => return Ok(()),
            XferStatus::InProgress => {
                assert!(start.elapsed() < TIMEOUT, "transfer did not finish");
                std::thread::yield_now();
            }
        }
    }
}

/// WRITEs three pieces of a buffer to reordered file offsets, READs them back into a
/// cleared buffer, and checks both the memory and the file contents.
fn round_trip(progress_thread: bool) {
    let scratch = Scratch::new(&format!("round-trip-{progress_thread}"));
    let file = scratch.open_rw();
    let fd = file.as_raw_fd();
    let agent = posix_agent("rt", progress_thread);
    let len = 3 << 20;
    let src = pattern(7, len);
    let mut dst = vec![0u8; len];
    // SAFETY: the buffers and the file outlive the handles and the requests.
    let _s = unsafe { agent.register_mem(&dram([Desc::from_slice(&src)]), None) }.unwrap();
    // SAFETY: as above.
    let _d = unsafe { agent.register_mem(&dram([Desc::from_slice(&dst)]), None) }.unwrap();
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(fd, &[(0, 8 << 20)]), None) }.unwrap();
    let pieces = [
        (0usize, 4096usize),
        (8192, (2 << 20) + 17),
        (len - 1000, 1000),
    ];
    let file_at = [5u64 << 20, 0, (5 << 20) + 4096];
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
    let mut w = agent
        .create_xfer_req(XferOp::Write, &mem(src.as_ptr() as u64), &files, "rt", None)
        .unwrap();
    w.post().unwrap();
    drive(&mut w).unwrap();
    for (&(o, l), at) in pieces.iter().zip(file_at) {
        let mut back = vec![0u8; l];
        file.read_exact_at(&mut back, at).unwrap();
        assert!(back == src[o..o + l], "file contents at {at}");
    }
    let mut r = agent
        .create_xfer_req(XferOp::Read, &mem(dst.as_ptr() as u64), &files, "rt", None)
        .unwrap();
    r.post().unwrap();
    drive(&mut r).unwrap();
    for &(o, l) in &pieces {
        assert!(dst[o..o + l] == src[o..o + l], "piece at {o}");
    }
    // Reposting moves the data again (into a cleared destination).
    dst.fill(0);
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    for &(o, l) in &pieces {
        assert!(dst[o..o + l] == src[o..o + l], "piece at {o}, again");
    }
}

#[test]
fn write_then_read_round_trips_with_progress_threads() {
    round_trip(true);
}

#[test]
fn write_then_read_round_trips_driven_by_checks_without_progress_threads() {
    round_trip(false);
}

#[test]
fn without_progress_threads_the_post_only_arms_and_the_check_does_the_io() {
    let scratch = Scratch::new("armed");
    std::fs::write(&scratch.0, pattern(3, 4096)).unwrap();
    let file = std::fs::File::open(&scratch.0).unwrap();
    let fd = file.as_raw_fd();
    let agent = posix_agent("armed", false);
    let buf = vec![0u8; 4096];
    // SAFETY: the buffer and the file outlive the handles and the request.
    let _h = unsafe { agent.register_mem(&dram([Desc::from_slice(&buf)]), None) }.unwrap();
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(fd, &[(0, 4096)]), None) }.unwrap();
    let mut req = agent
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::from_slice(&buf)]),
            &file_list(fd, &[(0, 4096)]),
            "armed",
            None,
        )
        .unwrap();
    assert_eq!(req.post().unwrap(), XferStatus::InProgress);
    assert!(buf.iter().all(|&b| b == 0), "the post moved data");
    assert_eq!(req.status().unwrap(), XferStatus::Done);
    assert!(buf == pattern(3, 4096));
}

#[test]
fn a_read_past_the_end_of_the_file_is_enodata() {
    let scratch = Scratch::new("eof");
    std::fs::write(&scratch.0, pattern(3, 10_000)).unwrap();
    let file = std::fs::File::open(&scratch.0).unwrap();
    let fd = file.as_raw_fd();
    for progress_thread in [true, false] {
        let agent = posix_agent("eof", progress_thread);
        let buf = vec![0u8; 64 * 1024];
        // SAFETY: the buffer and the file outlive the handles and the requests.
        let _h = unsafe { agent.register_mem(&dram([Desc::from_slice(&buf)]), None) }.unwrap();
        // The region may extend past the end (files grow); reading there is the error.
        // SAFETY: as above.
        let _f = unsafe { agent.register_mem(&file_list(fd, &[(0, 1 << 20)]), None) }.unwrap();
        let base = buf.as_ptr() as u64;
        // Straddling the end (a short count) and wholly past it (0 bytes).
        for (off, len) in [(8192u64, 4096u64), (20_000, 4096)] {
            let mut req = agent
                .create_xfer_req(
                    XferOp::Read,
                    &dram([Desc::new(base, len, 0)]),
                    &file_list(fd, &[(off, len)]),
                    "eof",
                    None,
                )
                .unwrap();
            let r = req.post().and_then(|_| drive(&mut req));
            assert_eq!(backend_code(&r), Some(libc::ENODATA), "{off}+{len}: {r:?}");
            let msg = r.unwrap_err().to_string();
            assert!(msg.contains("past the end of the file"), "{msg}");
        }
    }
}

#[test]
fn closed_descriptors_are_refused_and_failed_io_is_typed_with_its_errno() {
    let scratch = Scratch::new("closed");
    std::fs::write(&scratch.0, pattern(5, 4096)).unwrap();
    let agent = posix_agent("closed", true);
    let buf = vec![0u8; 4096];
    // SAFETY: the buffer outlives the handle and the requests.
    let _h = unsafe { agent.register_mem(&dram([Desc::from_slice(&buf)]), None) }.unwrap();

    // A descriptor that is not open: the highest number (closing one of ours would race
    // with the other tests' files taking its number).
    let closed = i32::MAX;
    // SAFETY: refused before anything is used.
    let r = unsafe { agent.register_mem(&file_list(closed, &[(0, 4096)]), None) };
    assert!(
        matches!(r, Err(Error::InvalidParam(ref m)) if m.contains("not an open file descriptor")),
        "{r:?}"
    );

    // An I/O error: a WRITE to a file opened read-only fails with EBADF, typed.
    let file = std::fs::File::open(&scratch.0).unwrap();
    let fd = file.as_raw_fd();
    // SAFETY: the buffer and the file outlive the handle and the request.
    let _f = unsafe { agent.register_mem(&file_list(fd, &[(0, 4096)]), None) }.unwrap();
    let mut req = agent
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(&buf)]),
            &file_list(fd, &[(0, 4096)]),
            "closed",
            None,
        )
        .unwrap();
    let r = req.post().and_then(|_| req.wait(TIMEOUT));
    assert_eq!(backend_code(&r), Some(libc::EBADF), "{r:?}");
    assert!(r.unwrap_err().to_string().contains("pwrite"));
}

#[test]
fn other_agents_and_notifications_are_refused() {
    let scratch = Scratch::new("refused");
    let file = scratch.open_rw();
    let fd = file.as_raw_fd();
    let agent = posix_agent("me", true);
    let buf = vec![0u8; 4096];
    // SAFETY: the buffer and the file outlive the handles and the request.
    let _h = unsafe { agent.register_mem(&dram([Desc::from_slice(&buf)]), None) }.unwrap();
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(fd, &[(0, 4096)]), None) }.unwrap();
    let backend = &agent.backends()[0];
    let caps = backend.capabilities();
    assert!(caps.local && !caps.remote && !caps.notif, "{caps:?}");
    let r = agent.create_xfer_req(
        XferOp::Write,
        &dram([Desc::from_slice(&buf)]),
        &file_list(fd, &[(0, 4096)]),
        "me",
        Some(b"hello".to_vec()),
    );
    let r = r.and_then(|mut req| req.post().and_then(|_| req.wait(TIMEOUT)));
    assert!(matches!(r, Err(Error::NotSupported { .. })), "{r:?}");
    // VRAM and other kinds are not POSIX's.
    let r = unsafe {
        // SAFETY: refused before anything is used.
        agent.register_mem(
            &DescList::from_descs(MemKind::Object, [Desc::new(0, 16, 1)]),
            Some(&["POSIX"]),
        )
    };
    assert!(r.is_err(), "{r:?}");
}

#[test]
fn concurrent_requests_on_one_file_each_move_their_own_range() {
    let scratch = Scratch::new("concurrent");
    let file = scratch.open_rw();
    let fd = file.as_raw_fd();
    let agent = posix_agent("many", true);
    let count = 8;
    let piece = 256 * 1024;
    let src = pattern(11, count * piece);
    let dst = vec![0u8; count * piece];
    // SAFETY: the buffers and the file outlive the handles and the requests.
    let _s = unsafe { agent.register_mem(&dram([Desc::from_slice(&src)]), None) }.unwrap();
    // SAFETY: as above.
    let _d = unsafe { agent.register_mem(&dram([Desc::from_slice(&dst)]), None) }.unwrap();
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(fd, &[(0, (count * piece) as u64)]), None) }
        .unwrap();
    let one = |op: XferOp, base: u64, i: usize| {
        let at = (i * piece) as u64;
        agent
            .create_xfer_req(
                op,
                &dram([Desc::new(base + at, piece as u64, 0)]),
                &file_list(fd, &[(at, piece as u64)]),
                "many",
                None,
            )
            .unwrap()
    };
    // All posted before any is waited for.
    let mut writes: Vec<_> = (0..count)
        .map(|i| one(XferOp::Write, src.as_ptr() as u64, i))
        .collect();
    for w in &mut writes {
        w.post().unwrap();
    }
    for w in &mut writes {
        w.wait(TIMEOUT).unwrap();
    }
    let mut reads: Vec<_> = (0..count)
        .map(|i| one(XferOp::Read, dst.as_ptr() as u64, i))
        .collect();
    for r in &mut reads {
        r.post().unwrap();
    }
    for r in &mut reads {
        r.wait(TIMEOUT).unwrap();
    }
    assert!(dst == src);
}

#[test]
fn query_mem_info_stats_file_paths_and_answers_none_for_missing_ones() {
    let scratch = Scratch::new("query");
    std::fs::write(&scratch.0, b"twelve bytes").unwrap();
    let agent = posix_agent("query", true);
    let present = scratch.0.to_str().unwrap().as_bytes().to_vec();
    let missing = b"/nonexistent/nixl-posix-query".to_vec();
    let meta: Vec<&[u8]> = vec![&present, &missing, b"", &present];
    let answers = agent.query_mem_info("POSIX", MemKind::File, &meta).unwrap();
    assert_eq!(answers.len(), 4);
    let info = answers[0].as_ref().expect("the file exists");
    assert_eq!(info["size"], "12");
    let st = std::fs::metadata(&scratch.0).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(info["mode"], st.mode().to_string());
    assert_eq!(info["mtime"], st.mtime().to_string());
    assert!(answers[1].is_none() && answers[2].is_none());
    assert_eq!(answers[3], answers[0]);
    assert!(agent
        .query_mem_info("POSIX", MemKind::File, &[])
        .unwrap()
        .is_empty());
    // Not a backend of this agent; a backend without queries.
    assert!(matches!(
        agent.query_mem_info("NOPE", MemKind::File, &meta),
        Err(Error::UnknownBackend(_))
    ));
    agent
        .create_backend("LOCAL", &BackendParams::new())
        .unwrap();
    assert!(matches!(
        agent.query_mem_info("LOCAL", MemKind::File, &meta),
        Err(Error::NotSupported { .. })
    ));
}
