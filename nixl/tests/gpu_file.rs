//! The FILE backend with VRAM (features `cuda` and `file`): READ file → VRAM and WRITE
//! VRAM → file through an `hf3fs-gdr` daemon child, verified byte for byte, and a
//! daemon killed while a read into VRAM is in flight failing the transfer, typed, within
//! the timeout.
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead.
#![cfg(all(feature = "cuda", feature = "file"))]

mod file_support;

use file_support::{assert_bytes, checksum, file_agent, pattern, serve_if_daemon, Daemon, TempDir};
use gpu_mem::DeviceBuffer;
use nixl::{Desc, DescList, Error, MemKind, XferOp, XferStatus};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const TIMEOUT: Duration = Duration::from_secs(60);

fn vram(buf: &DeviceBuffer, ranges: &[(usize, usize)]) -> DescList {
    let dev = buf.gpu().ordinal() as u64;
    DescList::from_descs(
        MemKind::Vram,
        ranges
            .iter()
            .map(|&(o, l)| Desc::new(buf.ptr() + o as u64, l as u64, dev)),
    )
}

fn file_list(fd: i32, ranges: &[(u64, u64)]) -> DescList {
    DescList::from_descs(
        MemKind::File,
        ranges
            .iter()
            .map(|&(off, len)| Desc::new(off, len, fd as u64)),
    )
}

#[test]
fn gpu_file_reads_into_vram_and_writes_from_vram() {
    serve_if_daemon();
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_file_reads_into_vram_and_writes_from_vram") else {
        return;
    };
    let d = Daemon::start("gpu_file_reads_into_vram_and_writes_from_vram", 0);
    let data = TempDir::new("nixl-gpu-file");
    let len = 256 * MIB;
    let bytes = pattern(11, len);
    let src_path = data.path().join("weights.bin");
    std::fs::write(&src_path, &bytes).unwrap();
    let src = std::fs::File::open(&src_path).unwrap();
    let dst_path = data.path().join("out.bin");
    let dst = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&dst_path)
        .unwrap();
    let agent = file_agent("gpu", d.path(), &[]);
    let buf = DeviceBuffer::alloc(&gpu, len + MIB).unwrap();
    buf.fill(0).unwrap();
    // SAFETY: the buffer and both files outlive the handles and every request.
    let _v = unsafe { agent.register_mem(&vram(&buf, &[(0, len + MIB)]), None) }.unwrap();
    // SAFETY: as above.
    let _f = unsafe {
        agent.register_mem(
            &DescList::from_descs(
                MemKind::File,
                [
                    Desc::new(0, len as u64, src.as_raw_fd() as u64),
                    Desc::new(0, len as u64, dst.as_raw_fd() as u64),
                ],
            ),
            None,
        )
    }
    .unwrap();
    assert_eq!(
        agent.query_mem(&vram(&buf, &[(0, 4096)])),
        vec![Some(vec!["FILE(direct)".to_string()])]
    );

    // The whole file into VRAM at an odd offset, timed.
    let at = 4096 + 3;
    let start = Instant::now();
    let mut r = agent
        .create_xfer_req(
            XferOp::Read,
            &vram(&buf, &[(at, len)]),
            &file_list(src.as_raw_fd(), &[(0, len as u64)]),
            "gpu",
            Some(b"in vram".to_vec()),
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    let took = start.elapsed();
    assert_eq!(agent.get_notifs()["gpu"], vec![b"in vram".to_vec()]);
    let mut back = vec![0u8; len];
    buf.copy_to_host(at, &mut back).unwrap();
    assert_eq!(checksum(&back), checksum(&bytes), "file -> VRAM checksum");
    assert_bytes(&back, &bytes, "file -> VRAM");
    eprintln!(
        "FILE READ file -> VRAM: {len} bytes in {took:?} = {:.2} GB/s (first read: the \
         daemon imports the IPC handle)",
        len as f64 / took.as_secs_f64() / 1e9
    );
    // Again, warm.
    let start = Instant::now();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    let took = start.elapsed();
    eprintln!(
        "FILE READ file -> VRAM again: {:.2} GB/s",
        len as f64 / took.as_secs_f64() / 1e9
    );

    // Several pieces, reordered, out of VRAM into the second file.
    let pieces = [
        (at, 5 * MIB + 1),
        (at + 64 * MIB, 4096),
        (at + 100 * MIB, 3),
    ];
    let file_at = [10 * MIB as u64, 0, 9 * MIB as u64];
    let mut w = agent
        .create_xfer_req(
            XferOp::Write,
            &vram(&buf, &pieces),
            &file_list(
                dst.as_raw_fd(),
                &pieces
                    .iter()
                    .zip(file_at)
                    .map(|(&(_, l), f)| (f, l as u64))
                    .collect::<Vec<_>>(),
            ),
            "gpu",
            None,
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    use std::os::unix::fs::FileExt;
    for (&(o, l), f) in pieces.iter().zip(file_at) {
        let mut got = vec![0u8; l];
        dst.read_exact_at(&mut got, f).unwrap();
        assert_bytes(&got, &bytes[o - at..o - at + l], "VRAM -> file");
    }
    let stats = hf3fs_gdr::daemon_stats(d.path()).unwrap();
    assert!(stats.gpu_bytes >= 2 * len as u64, "{stats:?}");
}

#[test]
fn gpu_file_daemon_killed_mid_vram_read_fails_typed() {
    serve_if_daemon();
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_file_daemon_killed_mid_vram_read_fails_typed")
    else {
        return;
    };
    let mut d = Daemon::start("gpu_file_daemon_killed_mid_vram_read_fails_typed", 60_000);
    let data = TempDir::new("nixl-gpu-file");
    let path = data.path().join("stuck.slow");
    std::fs::write(&path, pattern(5, MIB)).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let agent = file_agent("gpu-dies", d.path(), &[]);
    let buf = DeviceBuffer::alloc(&gpu, MIB).unwrap();
    // SAFETY: the buffer and the file outlive the handles and the request.
    let _v = unsafe { agent.register_mem(&vram(&buf, &[(0, MIB)]), None) }.unwrap();
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(file.as_raw_fd(), &[(0, MIB as u64)]), None) }
        .unwrap();
    let mut req = agent
        .create_xfer_req(
            XferOp::Read,
            &vram(&buf, &[(0, MIB)]),
            &file_list(file.as_raw_fd(), &[(0, MIB as u64)]),
            "gpu-dies",
            None,
        )
        .unwrap();
    assert_eq!(req.post().unwrap(), XferStatus::InProgress);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(req.status().unwrap(), XferStatus::InProgress);
    d.kill();
    let start = Instant::now();
    let r = req.wait(Duration::from_secs(20));
    let took = start.elapsed();
    assert!(
        matches!(r, Err(Error::Backend { code, .. }) if code == libc::ENOTCONN),
        "{r:?}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
}
