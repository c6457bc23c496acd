//! The `POSIX` backend with VRAM (features `cuda` and `posix`): READ file → VRAM and
//! WRITE VRAM → file through pinned staging slots, with and without progress threads,
//! one large descriptor at an odd offset and many of odd sizes in a scrambled order
//! (more pieces than slots, so slots are reused), verified byte for byte in VRAM and in
//! the files; `query_mem` saying `POSIX(staged)`; a READ past the end of the file failing
//! typed (`ENODATA`) with VRAM left as the completed pieces made it; and VRAM of two
//! GPUs in one transfer where there are two.
//!
//! Needs a GPU: without one every test prints why it skips; with `NIXL_REQUIRE_GPU=1`
//! (the GPU machine) a missing GPU fails instead (the two-GPU test: fewer than two).
#![cfg(all(feature = "cuda", feature = "posix"))]

use gpu_mem::DeviceBuffer;
use nixl::{Agent, AgentConfig, BackendParams, Desc, DescList, Error, MemKind, XferOp};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const TIMEOUT: Duration = Duration::from_secs(60);

/// A scratch file unique to this process and `tag`, removed on drop.
struct Scratch(PathBuf, std::fs::File);

impl Scratch {
    fn new(tag: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("nixl-gpu-posix-{}-{tag}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        Self(path, file)
    }
    fn fd(&self) -> i32 {
        self.1.as_raw_fd()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed) >> 5) as u8)
        .collect()
}

fn vram(buf: &DeviceBuffer, ranges: &[(usize, usize)]) -> DescList {
    let dev = buf.gpu().ordinal() as u64;
    DescList::from_descs(
        MemKind::Vram,
        ranges
            .iter()
            .map(|&(o, l)| Desc::new(buf.ptr() + o as u64, l as u64, dev)),
    )
}

fn file_list(fd: i32, ranges: &[(usize, usize)]) -> DescList {
    DescList::from_descs(
        MemKind::File,
        ranges
            .iter()
            .map(|&(off, len)| Desc::new(off as u64, len as u64, fd as u64)),
    )
}

/// A POSIX agent whose transfers stage through `slots` slots of `slot` bytes.
fn posix_agent(name: &str, progress_thread: bool, slot: usize, slots: usize) -> Agent {
    let agent = Agent::new(
        name,
        AgentConfig {
            progress_thread,
            ..AgentConfig::default()
        },
    )
    .unwrap();
    agent
        .create_backend(
            "POSIX",
            &BackendParams::from([
                ("staging_slot_size".to_string(), slot.to_string()),
                ("staging_size".to_string(), (slot * slots).to_string()),
            ]),
        )
        .unwrap();
    agent
}

fn run(agent: &Agent, op: XferOp, mem: &DescList, files: &DescList) -> nixl::Result<()> {
    let mut req = agent.create_xfer_req(op, mem, files, agent.name(), None)?;
    req.post()?;
    req.wait(TIMEOUT)
}

fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i} of {} (got {:#x}, want {:#x})",
            want.len(),
            got[i],
            want[i]
        );
    }
    assert_eq!(got.len(), want.len(), "{what}: length");
}

/// Many descriptors of odd sizes: (memory offset, file offset, length); memory in one
/// order, the file in the reverse one (the last memory piece is first in the file).
fn scattered() -> Vec<(usize, usize, usize)> {
    let lens: Vec<usize> = (0..200usize)
        .map(|i| match i % 5 {
            0 => 1,
            1 => 4095,
            2 => 65_537,
            3 => 3 * MIB / 2 + 11,
            _ => 777,
        })
        .collect();
    let mut mem = Vec::with_capacity(lens.len());
    let mut at = 3usize;
    for &len in &lens {
        mem.push(at);
        at += len + 13;
    }
    let mut file = vec![0usize; lens.len()];
    let mut at = 0usize;
    for i in (0..lens.len()).rev() {
        file[i] = at;
        at += lens[i] + 7;
    }
    (0..lens.len())
        .map(|i| (mem[i], file[i], lens[i]))
        .collect()
}

fn round_trip(progress_thread: bool) {
    let test = format!("gpu_posix_round_trip_progress_{progress_thread}");
    let Some(gpu) = gpu_mem::gpu_for_test(&test) else {
        return;
    };
    // 3 slots of 1 MiB: every large piece cycles through them.
    let agent = posix_agent("gpu-posix", progress_thread, MIB, 3);
    let len = 64 * MIB;
    let bytes = pattern(11, len);
    let src = Scratch::new(&format!("src-{progress_thread}"));
    src.1.write_all_at(&bytes, 0).unwrap();
    let dst = Scratch::new(&format!("dst-{progress_thread}"));
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
                    Desc::new(0, 2 * len as u64, src.fd() as u64),
                    Desc::new(0, 2 * len as u64, dst.fd() as u64),
                ],
            ),
            None,
        )
    }
    .unwrap();
    assert_eq!(
        agent.query_mem(&vram(&buf, &[(0, 4096)])),
        vec![Some(vec!["POSIX(staged)".to_string()])]
    );

    // The whole file into VRAM at an odd offset.
    let at = 4096 + 3;
    let start = Instant::now();
    run(
        &agent,
        XferOp::Read,
        &vram(&buf, &[(at, len)]),
        &file_list(src.fd(), &[(0, len)]),
    )
    .unwrap();
    let took = start.elapsed();
    let mut back = vec![0u8; len];
    buf.copy_to_host(at, &mut back).unwrap();
    assert_same(&back, &bytes, "file -> VRAM");
    eprintln!(
        "POSIX READ file -> VRAM (3 x 1 MiB slots): {len} bytes in {took:?} = {:.2} GB/s",
        len as f64 / took.as_secs_f64() / 1e9
    );

    // Many odd descriptors out of VRAM into the second file, scrambled.
    let pieces = scattered();
    let mem_ranges: Vec<(usize, usize)> = pieces.iter().map(|&(m, _, l)| (at + m, l)).collect();
    let file_ranges: Vec<(usize, usize)> = pieces.iter().map(|&(_, f, l)| (f, l)).collect();
    assert!(pieces.iter().all(|&(m, _, l)| m + l <= len));
    let start = Instant::now();
    run(
        &agent,
        XferOp::Write,
        &vram(&buf, &mem_ranges),
        &file_list(dst.fd(), &file_ranges),
    )
    .unwrap();
    eprintln!(
        "POSIX WRITE VRAM -> file, {} descriptors: {:?}",
        pieces.len(),
        start.elapsed()
    );
    for &(m, f, l) in &pieces {
        let mut got = vec![0u8; l];
        dst.1.read_exact_at(&mut got, f as u64).unwrap();
        assert_same(&got, &bytes[m..m + l], &format!("VRAM -> file at {f}"));
    }

    // And back: the second file's pieces into a cleared VRAM, each where it came from.
    buf.fill(0xA5).unwrap();
    run(
        &agent,
        XferOp::Read,
        &vram(&buf, &mem_ranges),
        &file_list(dst.fd(), &file_ranges),
    )
    .unwrap();
    let mut back = vec![0u8; len + MIB];
    buf.copy_to_host(0, &mut back).unwrap();
    let mut want = vec![0xA5u8; len + MIB];
    for &(m, _, l) in &pieces {
        want[at + m..at + m + l].copy_from_slice(&bytes[m..m + l]);
    }
    assert_same(
        &back,
        &want,
        "file -> VRAM, many descriptors (and nothing else touched)",
    );
}

#[test]
fn gpu_posix_round_trip_with_progress_threads() {
    round_trip(true);
}

#[test]
fn gpu_posix_round_trip_on_the_checking_thread() {
    round_trip(false);
}

#[test]
fn gpu_posix_read_past_the_end_into_vram_fails_typed() {
    let test = "gpu_posix_read_past_the_end_into_vram_fails_typed";
    let Some(gpu) = gpu_mem::gpu_for_test(test) else {
        return;
    };
    let agent = posix_agent("gpu-posix-short", true, 64 << 10, 2);
    let file = Scratch::new("short");
    let bytes = pattern(3, MIB + 100);
    file.1.write_all_at(&bytes, 0).unwrap();
    let buf = DeviceBuffer::alloc(&gpu, 2 * MIB).unwrap();
    buf.fill(0).unwrap();
    // SAFETY: the buffer and the file outlive the handles and the request.
    let _v = unsafe { agent.register_mem(&vram(&buf, &[(0, 2 * MIB)]), None) }.unwrap();
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(file.fd(), &[(0, 2 * MIB)]), None) }.unwrap();
    let r = run(
        &agent,
        XferOp::Read,
        &vram(&buf, &[(0, 2 * MIB)]),
        &file_list(file.fd(), &[(0, 2 * MIB)]),
    );
    assert!(
        matches!(&r, Err(Error::Backend { backend, code, .. }) if backend == "POSIX" && *code == libc::ENODATA),
        "{r:?}"
    );
    // The pieces before the end were copied in full before the failure was reported.
    let mut back = vec![0u8; MIB];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_same(&back, &bytes[..MIB], "the pieces read before the end");
}

#[test]
fn gpu_posix_vram_of_two_gpus_in_one_transfer() {
    let test = "gpu_posix_vram_of_two_gpus_in_one_transfer";
    let Some(gpus) = gpu_mem::gpus_for_test(test, 2) else {
        return;
    };
    let agent = posix_agent("gpu-posix-two", true, 256 << 10, 4);
    let len = 8 * MIB;
    let bytes = pattern(5, 2 * len);
    let file = Scratch::new("two-gpus");
    file.1.write_all_at(&bytes, 0).unwrap();
    let bufs: Vec<DeviceBuffer> = gpus
        .iter()
        .take(2)
        .map(|g| {
            let b = DeviceBuffer::alloc(g, len).unwrap();
            b.fill(0).unwrap();
            b
        })
        .collect();
    let descs = |ranges: [(usize, usize); 2]| {
        DescList::from_descs(
            MemKind::Vram,
            bufs.iter().zip(ranges).map(|(b, (o, l))| {
                Desc::new(b.ptr() + o as u64, l as u64, b.gpu().ordinal() as u64)
            }),
        )
    };
    // SAFETY: the buffers and the file outlive the handles and the requests.
    let _v = unsafe { agent.register_mem(&descs([(0, len), (0, len)]), None) }.unwrap();
    // SAFETY: as above.
    let _f = unsafe { agent.register_mem(&file_list(file.fd(), &[(0, 2 * len)]), None) }.unwrap();
    // GPU 0 gets the second half of the file, GPU 1 the first.
    run(
        &agent,
        XferOp::Read,
        &descs([(0, len), (0, len)]),
        &file_list(file.fd(), &[(len, len), (0, len)]),
    )
    .unwrap();
    let mut back = vec![0u8; len];
    bufs[0].copy_to_host(0, &mut back).unwrap();
    assert_same(&back, &bytes[len..], "file -> GPU 0");
    bufs[1].copy_to_host(0, &mut back).unwrap();
    assert_same(&back, &bytes[..len], "file -> GPU 1");
    // Both back out, swapped, into the file.
    run(
        &agent,
        XferOp::Write,
        &descs([(0, len), (0, len)]),
        &file_list(file.fd(), &[(0, len), (len, len)]),
    )
    .unwrap();
    let mut on_disk = vec![0u8; 2 * len];
    file.1.read_exact_at(&mut on_disk, 0).unwrap();
    assert_same(&on_disk[..len], &bytes[len..], "GPU 0 -> file");
    assert_same(&on_disk[len..], &bytes[..len], "GPU 1 -> file");
}
