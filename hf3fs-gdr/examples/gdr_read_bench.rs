//! Reads a file into GPU memory through `hf3fs-gdr-daemon` and prints the bandwidth, or
//! 4 KiB random-read IOPS; the numbers to put beside KvikIO's.
//!
//! ```text
//! gdr_read_bench --mount DIR --file PATH [--daemon BIN] [--daemon-threads N]
//!     [--staging-mib M] [--chunk-kib K] [--direct auto|always|never]
//!     [--mode seq|rand] [--size BYTES] [--block BYTES] [--depth N] [--rings R]
//!     [--iters K] [--seconds S] [--gpu G] [--create BYTES] [--verify] [--h2d]
//!     [--memory gpu|host] [--host] [--cold] [--reference odirect]
//!     [--ref-threads N] [--ref-block BYTES] [--slots N] [--copy-kib C]
//! ```
//! - `--daemon BIN` starts the daemon on `--mount`; without it a daemon already serving
//!   the mount is used, else the `hf3fs-gdr-daemon` beside this example is started.
//! - `--create BYTES` writes a patterned file of that size first if `--file` is missing.
//! - `seq`: `--size` bytes (default: the file) split among `--rings` threads, each with
//!   a ring keeping `--depth` (default 16) reads of `--block` bytes (default 64 MiB) in
//!   flight (the daemon splits them into chunks for its workers), into
//!   one GPU iov; `--iters` passes, best and mean GB/s (10^9 bytes/s).
//! - `rand`: `--block` (default 4 KiB) reads at random aligned offsets for `--seconds`,
//!   `--depth` (default 128) in flight per ring.
//! - `--cold` (or `--drop-cache`) evicts the file from the page cache before each pass
//!   (`fsync`, then `posix_fadvise(DONTNEED)`: no root needed) and checks with
//!   `mincore` that less than 1% of its pages stay resident (cold reads: the daemon
//!   then reads with `O_DIRECT`).
//! - `--reference odirect` (seq mode) alternates each daemon pass with a pass of the
//!   device's own `O_DIRECT` bandwidth: `--ref-threads` (default: the daemon's
//!   threads) threads reading `--ref-block` (default 8 MiB) aligned blocks of the same
//!   range into aligned host memory, evicted before it too under `--cold`; prints both
//!   medians and their ratio.
//! - `--memory host` (or `--host`) reads into shared host memory instead (file->DRAM
//!   numbers; needs no GPU).
//! - `--slots N` pinned staging slots per daemon worker, `--copy-kib C` a device copy
//!   after every C KiB of a cached chunk (both passed to a daemon started here).
//! - `--verify` checks the VRAM against the file after the first pass; `--h2d` measures
//!   pinned host-to-device copies for reference.
//!
//! Sizes accept K, M, G suffixes (powers of 1024).

use gpu_mem::{DeviceBuffer, Gpu, HostBuffer};
use hf3fs_gdr::{reg_fd, Cqe, Ior, Iov};
use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct Opts {
    mount: PathBuf,
    file: PathBuf,
    daemon: Option<PathBuf>,
    daemon_threads: usize,
    staging_mib: usize,
    chunk_kib: Option<usize>,
    direct: String,
    random: bool,
    size: Option<u64>,
    block: Option<u64>,
    depth: Option<u32>,
    rings: usize,
    iters: usize,
    seconds: f64,
    gpu: usize,
    create: Option<u64>,
    verify: bool,
    h2d: bool,
    /// Read into host shared memory instead of VRAM (file->DRAM numbers).
    host: bool,
    /// Evict the file from the page cache before each pass (cold reads).
    drop_cache: bool,
    /// Alternate with `O_DIRECT` passes of this many threads (0: no reference).
    ref_threads: Option<usize>,
    reference: bool,
    ref_block: u64,
    slots: Option<usize>,
    copy_kib: Option<usize>,
}

fn size_arg(s: &str) -> Result<u64, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mult)
        .map_err(|_| format!("{s:?} is not a size"))
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        mount: PathBuf::new(),
        file: PathBuf::new(),
        daemon: None,
        daemon_threads: 16,
        staging_mib: 512,
        chunk_kib: None,
        direct: "auto".into(),
        random: false,
        size: None,
        block: None,
        depth: None,
        rings: 1,
        iters: 5,
        seconds: 5.0,
        gpu: 0,
        create: None,
        verify: false,
        h2d: false,
        host: false,
        drop_cache: false,
        ref_threads: None,
        reference: false,
        ref_block: 8 << 20,
        slots: None,
        copy_kib: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut v = || args.next().ok_or_else(|| format!("{a} needs a value"));
        let num = |s: String| {
            s.parse::<usize>()
                .map_err(|_| format!("{s:?} is not a number"))
        };
        match a.as_str() {
            "--mount" => o.mount = v()?.into(),
            "--file" => o.file = v()?.into(),
            "--daemon" => o.daemon = Some(v()?.into()),
            "--daemon-threads" => o.daemon_threads = num(v()?)?,
            "--staging-mib" => o.staging_mib = num(v()?)?,
            "--chunk-kib" => o.chunk_kib = Some(num(v()?)?),
            "--direct" => o.direct = v()?,
            "--mode" => {
                o.random = match v()?.as_str() {
                    "seq" => false,
                    "rand" => true,
                    m => return Err(format!("mode {m:?} (seq or rand)")),
                }
            }
            "--size" => o.size = Some(size_arg(&v()?)?),
            "--block" => o.block = Some(size_arg(&v()?)?),
            "--depth" => o.depth = Some(num(v()?)?.max(1) as u32),
            "--rings" => o.rings = num(v()?)?.max(1),
            "--iters" => o.iters = num(v()?)?.max(1),
            "--seconds" => o.seconds = v()?.parse().map_err(|_| "--seconds: not a number")?,
            "--gpu" => o.gpu = num(v()?)?,
            "--create" => o.create = Some(size_arg(&v()?)?),
            "--verify" => o.verify = true,
            "--h2d" => o.h2d = true,
            "--drop-cache" | "--cold" => o.drop_cache = true,
            "--host" => o.host = true,
            "--reference" => match v()?.as_str() {
                "odirect" => o.reference = true,
                r => return Err(format!("reference {r:?} (odirect)")),
            },
            "--ref-threads" => o.ref_threads = Some(num(v()?)?.max(1)),
            "--ref-block" => o.ref_block = size_arg(&v()?)?.next_multiple_of(4096),
            "--slots" => o.slots = Some(num(v()?)?.max(1)),
            "--copy-kib" => o.copy_kib = Some(num(v()?)?),
            "--memory" => {
                o.host = match v()?.as_str() {
                    "gpu" => false,
                    "host" => true,
                    m => return Err(format!("memory {m:?} (gpu or host)")),
                }
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if o.mount.as_os_str().is_empty() || o.file.as_os_str().is_empty() {
        return Err("--mount and --file are required".into());
    }
    Ok(o)
}

fn pattern_byte(i: u64) -> u8 {
    ((i as u32).wrapping_mul(0x9e37_79b1) >> 24) as u8 ^ (i as u8)
}

fn create_file(o: &Opts) {
    let Some(size) = o.create else { return };
    if o.file.exists() {
        return;
    }
    use std::io::Write;
    let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&o.file).unwrap());
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0u64;
    while off < size {
        let n = (size - off).min(buf.len() as u64) as usize;
        for (i, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern_byte(off + i as u64);
        }
        f.write_all(&buf[..n]).unwrap();
        off += n as u64;
    }
    f.flush().unwrap();
    println!("created {} ({size} bytes)", o.file.display());
}

/// The daemon to start: `--daemon`, else (when nothing serves the mount yet) the
/// `hf3fs-gdr-daemon` beside this example (the GPU bundle's `bin/`) or one folder up
/// (cargo's `target/<profile>/`).
fn daemon_binary(o: &Opts) -> Option<PathBuf> {
    if let Some(bin) = &o.daemon {
        return Some(bin.clone());
    }
    let socket = hf3fs_gdr::virt::daemon_socket(&o.mount);
    if socket.exists() && hf3fs_gdr::daemon_stats(&o.mount).is_ok() {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [
        dir.join("hf3fs-gdr-daemon"),
        dir.parent()?.join("hf3fs-gdr-daemon"),
    ]
    .into_iter()
    .find(|p| p.exists())
}

fn start_daemon(o: &Opts) -> Option<Child> {
    let bin = daemon_binary(o)?;
    println!("starting {}", bin.display());
    let mut cmd = Command::new(&bin);
    cmd.arg("--mount")
        .arg(&o.mount)
        .args(["--threads", &o.daemon_threads.to_string()])
        .args(["--staging-mib", &o.staging_mib.to_string()])
        .args(["--direct", &o.direct])
        .stdout(Stdio::piped());
    if let Some(k) = o.chunk_kib {
        cmd.args(["--chunk-kib", &k.to_string()]);
    }
    if let Some(n) = o.slots {
        cmd.args(["--slots", &n.to_string()]);
    }
    if let Some(c) = o.copy_kib {
        cmd.args(["--copy-kib", &c.to_string()]);
    }
    let mut child = cmd.spawn().expect("start the daemon");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("ready"), "daemon said {line:?}");
    Some(child)
}

/// One ring's share of a sequential pass: `[start, end)` of the file in `block` reads,
/// `depth` in flight.
fn seq_pass(
    ior: &mut Ior,
    iov: &Iov,
    fd: i32,
    start: u64,
    end: u64,
    block: u64,
    depth: u32,
) -> u64 {
    let mut next = start;
    let mut inflight = 0u32;
    let mut bytes = 0u64;
    let mut cqes = vec![Cqe::default(); depth as usize];
    while next < end || inflight > 0 {
        while next < end && inflight < depth {
            let len = block.min(end - next);
            ior.prep_io(iov, true, iov.base() + next, fd, next, len, next)
                .unwrap();
            next += len;
            inflight += 1;
        }
        ior.submit_ios().unwrap();
        let n = ior
            .wait_for_ios(&mut cqes, 1, Some(Instant::now() + Duration::from_secs(60)))
            .unwrap();
        assert!(n > 0, "no completion in 60 s");
        for c in &cqes[..n] {
            assert!(
                c.result >= 0,
                "read at {} failed: errno {}",
                c.userdata,
                -c.result
            );
            bytes += c.result as u64;
        }
        inflight -= n as u32;
    }
    bytes
}

/// One ring's random-read loop.
struct RandJob {
    /// File bytes to pick offsets in.
    size: u64,
    block: u64,
    depth: u32,
    until: Instant,
    seed: u64,
    /// Where this ring's slots start in the iov.
    part: u64,
}

fn rand_pass(ior: &mut Ior, iov: &Iov, fd: i32, job: &RandJob) -> u64 {
    let mut x = job.seed | 1;
    let slots = (job.size / job.block).max(1);
    let mut ops = 0u64;
    let mut inflight = 0u32;
    let mut cqes = vec![Cqe::default(); job.depth as usize];
    let mut slot = 0u64;
    loop {
        let running = Instant::now() < job.until;
        while running && inflight < job.depth {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = (x % slots) * job.block;
            let dst = iov.base() + job.part + (slot % job.depth as u64) * job.block;
            slot += 1;
            ior.prep_io(iov, true, dst, fd, off, job.block, off)
                .unwrap();
            inflight += 1;
        }
        if inflight == 0 {
            return ops;
        }
        ior.submit_ios().unwrap();
        let n = ior
            .wait_for_ios(&mut cqes, 1, Some(Instant::now() + Duration::from_secs(60)))
            .unwrap();
        for c in &cqes[..n] {
            assert_eq!(c.result, job.block as i64, "random read at {}", c.userdata);
        }
        ops += n as u64;
        inflight -= n as u32;
    }
}

/// Fraction of `file`'s pages in the page cache (`mincore` on a mapping of it).
fn resident_fraction(file: &std::fs::File) -> f64 {
    let len = file.metadata().unwrap().len() as usize;
    if len == 0 {
        return 0.0;
    }
    // SAFETY: a read-only shared mapping of the file, unmapped below; never touched
    // (touching would fault pages in).
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
    assert_ne!(map, libc::MAP_FAILED, "mmap for mincore");
    let pages = len.div_ceil(4096);
    let mut vec = vec![0u8; pages];
    // SAFETY: `vec` has a byte per page of the mapping.
    let r = unsafe { libc::mincore(map, len, vec.as_mut_ptr()) };
    // SAFETY: mapped above.
    unsafe { libc::munmap(map, len) };
    assert_eq!(r, 0, "mincore");
    vec.iter().filter(|b| **b & 1 != 0).count() as f64 / pages as f64
}

/// Evicts `file` from the page cache (no root needed: its pages are clean after the
/// `fsync`) and checks that less than 1% stayed; returns that fraction.
fn evict(file: &std::fs::File) -> f64 {
    file.sync_all().ok();
    // SAFETY: a valid descriptor; advice only.
    let r = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0, "posix_fadvise(DONTNEED)");
    let left = resident_fraction(file);
    assert!(
        left < 0.01,
        "{:.1}% of the file still in the page cache after eviction",
        left * 100.0
    );
    left
}

/// The device's `O_DIRECT` bandwidth on `[start, end)` of `path`: `threads` threads,
/// each reading `block` aligned bytes at a time (the next block from a shared cursor)
/// into its own page-aligned buffer. Returns bytes read.
fn odirect_pass(path: &std::path::Path, start: u64, end: u64, threads: usize, block: u64) -> u64 {
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open with O_DIRECT");
    let cursor = AtomicU64::new(start);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (file, cursor) = (&file, &cursor);
                s.spawn(move || {
                    let layout = std::alloc::Layout::from_size_align(block as usize, 4096).unwrap();
                    // SAFETY: a non-zero size; freed below.
                    let buf = unsafe { std::alloc::alloc(layout) };
                    assert!(!buf.is_null());
                    let mut bytes = 0u64;
                    loop {
                        let off = cursor.fetch_add(block, Ordering::Relaxed);
                        if off >= end {
                            break;
                        }
                        let len = block.min(end - off).next_multiple_of(4096);
                        // SAFETY: `buf` has `block` >= `len` bytes.
                        let n = unsafe {
                            libc::pread(file.as_raw_fd(), buf.cast(), len as usize, off as i64)
                        };
                        assert!(
                            n >= 0,
                            "O_DIRECT pread: {}",
                            std::io::Error::last_os_error()
                        );
                        bytes += (n as u64).min(end - off);
                    }
                    // SAFETY: allocated above with this layout.
                    unsafe { std::alloc::dealloc(buf, layout) };
                    bytes
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn h2d_reference(gpu: &Gpu) {
    let len = 256 << 20;
    let host = HostBuffer::alloc(gpu, len).unwrap();
    let dev = DeviceBuffer::alloc(gpu, len).unwrap();
    let mut best = f64::MAX;
    for _ in 0..10 {
        let t = Instant::now();
        dev.copy_from_host(0, host.as_slice()).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "pinned H2D reference: {:.1} GB/s (256 MiB copies, best of 10)",
        len as f64 / best / 1e9
    );
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gdr_read_bench: {e}\n(see the top of examples/gdr_read_bench.rs)");
            std::process::exit(2);
        }
    };
    if !o.host || o.h2d {
        let gpu = match Gpu::open(o.gpu) {
            Ok(gpu) => gpu,
            Err(e) => {
                eprintln!(
                    "gdr_read_bench: GPU {}: {e} (--memory host reads into DRAM)",
                    o.gpu
                );
                std::process::exit(1);
            }
        };
        println!("GPU {}: {}", o.gpu, gpu.name().unwrap_or_default());
        if o.h2d {
            h2d_reference(&gpu);
        }
    }
    let new_iov = |len: u64| {
        if o.host {
            Iov::create(&o.mount, len, 0, -1)
        } else {
            Iov::create_gpu(&o.mount, len, 0, o.gpu)
        }
        .expect("create the iov")
    };
    let into = if o.host { "DRAM" } else { "VRAM" };
    create_file(&o);
    let mut daemon = start_daemon(&o);
    let file = std::fs::File::open(&o.file).expect("open --file");
    let fd = file.as_raw_fd();
    reg_fd(fd, 0).unwrap();
    let file_size = file.metadata().unwrap().len();
    let size = o.size.unwrap_or(file_size).min(file_size);
    let rings = o.rings;
    if !o.random {
        let block = o.block.unwrap_or(64 << 20);
        let depth = o.depth.unwrap_or(16);
        let iov = Arc::new(new_iov(size));
        let mut iors: Vec<Ior> = (0..rings)
            .map(|_| Ior::create(&o.mount, depth, true, 0, Duration::ZERO, -1, 0).unwrap())
            .collect();
        let share = size.div_ceil(rings as u64).next_multiple_of(4096);
        let mut rates = Vec::new();
        let mut ref_rates = Vec::new();
        let ref_threads = o.ref_threads.unwrap_or(o.daemon_threads);
        for pass in 0..o.iters {
            // The reference runs before the daemon on even passes and after it on odd
            // ones, so neither gains from what a device or host cache kept of the other.
            let mut reference_pass = || {
                let left = if o.drop_cache {
                    evict(&file)
                } else {
                    resident_fraction(&file)
                };
                let t = Instant::now();
                let moved = odirect_pass(&o.file, 0, size, ref_threads, o.ref_block);
                let secs = t.elapsed().as_secs_f64();
                assert_eq!(
                    moved, size,
                    "O_DIRECT pass {pass} read {moved} of {size} bytes"
                );
                let rate = size as f64 / secs / 1e9;
                println!(
                    "pass {pass}: O_DIRECT reference {size} bytes in {secs:.4} s = {rate:.2} GB/s ({ref_threads} threads, {} KiB blocks, {:.2}% resident before)",
                    o.ref_block >> 10,
                    left * 100.0
                );
                ref_rates.push(rate);
            };
            if o.reference && pass % 2 == 0 {
                reference_pass();
            }
            let left = if o.drop_cache {
                evict(&file)
            } else {
                resident_fraction(&file)
            };
            let stats0 = hf3fs_gdr::daemon_stats(&o.mount).ok();
            let t = Instant::now();
            let moved: u64 = std::thread::scope(|s| {
                let handles: Vec<_> = iors
                    .iter_mut()
                    .enumerate()
                    .map(|(r, ior)| {
                        let iov = iov.clone();
                        let (start, end) = (
                            (r as u64 * share).min(size),
                            ((r as u64 + 1) * share).min(size),
                        );
                        s.spawn(move || seq_pass(ior, &iov, fd, start, end, block, depth))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).sum()
            });
            let secs = t.elapsed().as_secs_f64();
            assert_eq!(moved, size, "pass {pass} moved {moved} of {size} bytes");
            let rate = size as f64 / secs / 1e9;
            let ops = match (stats0, hf3fs_gdr::daemon_stats(&o.mount).ok()) {
                (Some(a), Some(b)) => format!(
                    ", daemon chunks: {} O_DIRECT, {} page cache",
                    b.direct_ops - a.direct_ops,
                    b.buffered_ops - a.buffered_ops
                ),
                _ => String::new(),
            };
            println!(
                "pass {pass}: daemon {size} bytes in {secs:.4} s = {rate:.2} GB/s ({:.2}% resident before, {:.2}% after{ops})",
                left * 100.0,
                resident_fraction(&file) * 100.0
            );
            rates.push(rate);
            if o.reference && pass % 2 == 1 {
                reference_pass();
            }
            if pass == 0 && o.verify {
                let mut got = vec![0u8; size as usize];
                iov.read_at(0, &mut got).unwrap();
                let expected = std::fs::read(&o.file).unwrap();
                match got.iter().zip(&expected).position(|(a, b)| a != b) {
                    None => println!("verify: {into} matches the file ({size} bytes)"),
                    Some(i) => panic!("verify: byte {i} differs"),
                }
            }
        }
        let best = rates.iter().cloned().fold(0.0, f64::max);
        let mean = rates.iter().sum::<f64>() / rates.len() as f64;
        let cold = if o.drop_cache { "cold" } else { "cached" };
        println!(
            "RESULT seq {cold} file->{into}: best {best:.2} GB/s, mean {mean:.2} GB/s, median {:.2} GB/s (size {size}, block {block}, depth {}, rings {rings})",
            median(&rates),
            depth
        );
        if o.reference {
            let (d, r) = (median(&rates), median(&ref_rates));
            println!(
                "RESULT O_DIRECT reference ({cold}): median {r:.2} GB/s, best {:.2} GB/s ({ref_threads} threads, {} KiB blocks); daemon/O_DIRECT median ratio {:.3}",
                ref_rates.iter().cloned().fold(0.0, f64::max),
                o.ref_block >> 10,
                d / r
            );
        }
    } else {
        let block = o.block.unwrap_or(4096);
        let depth = o.depth.unwrap_or(128);
        let iov = Arc::new(new_iov(block * depth as u64 * rings as u64));
        let mut iors: Vec<Ior> = (0..rings)
            .map(|_| Ior::create(&o.mount, depth, true, 0, Duration::ZERO, -1, 0).unwrap())
            .collect();
        let until = Instant::now() + Duration::from_secs_f64(o.seconds);
        let t = Instant::now();
        let ops: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = iors
                .iter_mut()
                .enumerate()
                .map(|(r, ior)| {
                    let iov = iov.clone();
                    let job = RandJob {
                        size,
                        block,
                        depth,
                        until,
                        seed: 0x9e37_79b9 ^ ((r as u64 + 1) * 0x1234_5678_9abc),
                        part: r as u64 * depth as u64 * block,
                    };
                    s.spawn(move || rand_pass(ior, &iov, fd, &job))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        let secs = t.elapsed().as_secs_f64();
        println!(
            "RESULT rand {block}-byte reads into {into}: {:.0} IOPS, {:.2} GB/s ({ops} reads in {secs:.2} s, depth {}, rings {rings})",
            ops as f64 / secs,
            ops as f64 * block as f64 / secs / 1e9,
            depth
        );
    }
    hf3fs_gdr::dereg_fd(fd);
    if let Some(d) = daemon.as_mut() {
        let _ = d.kill();
        let _ = d.wait();
    }
}
