//! GPU memory on a real GPU: attributes and lookup, plain and VMM device buffers,
//! CUDA-IPC handles and VMM fds mapped by a second process (this binary re-executed as
//! `peer_process`, lines over its stdin/stdout), borrowed framework memory, killed
//! importers and exporters, DMA-BUF export, and the classification of every kind of
//! pointer.
//!
//! Without a GPU every test prints why it skips; with `NIXL_REQUIRE_GPU=1` (the GPU
//! machine) a missing GPU fails them. The tests of this file run one at a time (they share
//! one lock: pointer classification of freed memory must not race another test's
//! allocations), each under a watchdog.

use gpu_mem::cudarc::driver::sys;
use gpu_mem::{
    check_device_range, device_count, find_by_uuid, format_uuid, is_available, pointer_info,
    recv_vmm, send_vmm, DeviceBuffer, DeviceMemoryRef, Error, Gpu, HostBuffer, HostRegistration,
    IpcHandle, IpcMapping, MemoryKind, VmmMapping, DEVICE_BUFFER_ALIGN, IPC_HANDLE_BYTES,
};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Longest wait for one line or one exit of the peer.
const T: Duration = Duration::from_secs(30);
/// A length that is neither a page nor a granularity multiple.
const LEN: usize = (1 << 20) + 333;
/// Environment of the peer process.
const PEER_ROLE: &str = "GPU_MEM_PEER_ROLE";
const PEER_SOCKET: &str = "GPU_MEM_PEER_SOCKET";

// ---- helpers ---------------------------------------------------------------------------

/// Position-dependent bytes; two seeds differ at every byte.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(0x9e37_79b1) >> 24) as u8 ^ (i as u8) ^ seed)
        .collect()
}

/// Panics at the first differing byte (without printing megabytes).
fn assert_bytes(got: &[u8], expected: &[u8], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    if let Some(i) = got.iter().zip(expected).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {i} of {} is {:#04x}, expected {:#04x}",
            got.len(),
            got[i],
            expected[i]
        );
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Copies `len` bytes of device memory mapped in this process to the host.
fn read_device(gpu: &Gpu, ptr: u64, len: usize) -> Vec<u8> {
    gpu.bind().unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: `out` has `len` writable bytes; callers pass a device range of at least
    // `len` bytes mapped in this process.
    let result = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, len) };
    result
        .result()
        .unwrap_or_else(|e| panic!("cuMemcpyDtoH from {ptr:#x}+{len}: {e:?}"));
    out
}

/// Copies `data` to device memory mapped in this process, and waits until it landed (a
/// copy from pageable memory may return before its DMA is done).
fn write_device(gpu: &Gpu, ptr: u64, data: &[u8]) {
    gpu.bind().unwrap();
    // SAFETY: `data` is a live slice; callers pass a device range of at least
    // `data.len()` bytes mapped in this process.
    let result = unsafe { sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), data.len()) };
    result
        .result()
        .unwrap_or_else(|e| panic!("cuMemcpyHtoD to {ptr:#x}+{}: {e:?}", data.len()));
    // SAFETY: no arguments; the context is current.
    let result = unsafe { sys::cuCtxSynchronize() };
    result.result().unwrap();
}

/// Runs the tests of this file one at a time, each under a watchdog that aborts the
/// process if the test outlives `secs`.
struct Serial {
    _done: Sender<()>,
    _lock: MutexGuard<'static, ()>,
}

fn serial(test: &'static str, secs: u64) -> Serial {
    static LOCK: Mutex<()> = Mutex::new(());
    let lock = LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let (done, rx) = channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
            rx.recv_timeout(Duration::from_secs(secs))
        {
            eprintln!("{test}: watchdog: still running after {secs} s, aborting");
            std::process::abort();
        }
    });
    Serial {
        _done: done,
        _lock: lock,
    }
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!("gpu-mem-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---- the peer (child process) ------------------------------------------------------------

/// Entry point of the peer process; does nothing unless `GPU_MEM_PEER_ROLE` is set.
#[test]
#[ignore = "the peer process of the two-process tests; run by them"]
fn peer_process() {
    let Ok(role) = std::env::var(PEER_ROLE) else {
        return;
    };
    // Never outlive a parent that failed or hung.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        eprintln!("peer_process: watchdog: still running after 60 s, exiting");
        std::process::exit(3);
    });
    let gpu = Gpu::open(0).expect("peer: GPU 0");
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines().map(|l| l.expect("peer: stdin"));
    match role.as_str() {
        // IPC <handle hex> <offset> <len> <seed to find> <seed to write>
        "import-ipc" => {
            let line = lines.next().expect("peer: an IPC line");
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(f[0], "IPC", "peer: got {line}");
            let handle = IpcHandle::from_bytes(&unhex(f[1])).unwrap();
            let [offset, len, seed_in, seed_out] =
                [f[2], f[3], f[4], f[5]].map(|v| v.parse::<u64>().unwrap());
            let mapping = IpcMapping::open(&gpu, &handle).unwrap();
            println!("MAPPED {} {}", mapping.ptr(), mapping.len());
            check_and_write(
                &gpu,
                mapping.ptr(),
                mapping.len(),
                offset,
                len as usize,
                (seed_in as u8, seed_out as u8),
            );
            // Keep the mapping until the parent closes stdin (or kills us).
            for _ in lines.by_ref() {}
            drop(mapping);
        }
        // The fd arrives over the socket; then VMM <seed to find> <seed to write>.
        "import-vmm" => {
            let path = std::env::var(PEER_SOCKET).expect("peer: socket path");
            let sock = UnixStream::connect(&path).unwrap();
            let export = recv_vmm(&sock).unwrap();
            println!("RECEIVED {} {}", export.size, export.len);
            let line = lines.next().expect("peer: a VMM line");
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(f[0], "VMM", "peer: got {line}");
            let [seed_in, seed_out] = [f[1], f[2]].map(|v| v.parse::<u8>().unwrap());
            let mapping = VmmMapping::import(&gpu, export.fd.as_fd(), export.size).unwrap();
            // The mapping holds the allocation: the descriptor is no longer needed.
            drop(export.fd);
            println!("MAPPED {} {}", mapping.ptr(), mapping.len());
            check_and_write(
                &gpu,
                mapping.ptr(),
                mapping.len(),
                0,
                export.len as usize,
                (seed_in, seed_out),
            );
            for _ in lines.by_ref() {}
            drop(mapping);
        }
        // EXPORT <len> <seed>: allocate, fill, hand out the IPC handle, wait to be killed.
        "export-ipc" => {
            let line = lines.next().expect("peer: an EXPORT line");
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(f[0], "EXPORT", "peer: got {line}");
            let len: usize = f[1].parse().unwrap();
            let seed: u8 = f[2].parse().unwrap();
            let buf = DeviceBuffer::alloc(&gpu, len).unwrap();
            buf.copy_from_host(0, &pattern(seed, len)).unwrap();
            println!("HANDLE {}", hex(buf.export_ipc().unwrap().as_bytes()));
            for _ in lines.by_ref() {}
            drop(buf);
        }
        other => panic!("peer: unknown role {other}"),
    }
}

/// The importer's part: checks `len` bytes at `base + offset` hold `seeds.0`'s pattern
/// (prints `VERIFIED ok` or what differs), then writes `seeds.1`'s pattern over the second
/// half of the range and prints `WROTE` once it landed.
fn check_and_write(
    gpu: &Gpu,
    base: u64,
    mapped: u64,
    offset: u64,
    len: usize,
    (seed_in, seed_out): (u8, u8),
) {
    if offset + len as u64 > mapped {
        println!("VERIFIED bad: {offset}+{len} outside a mapping of {mapped} bytes");
        return;
    }
    let ptr = base + offset;
    let got = read_device(gpu, ptr, len);
    let expected = pattern(seed_in, len);
    match got.iter().zip(&expected).position(|(a, b)| a != b) {
        None => println!("VERIFIED ok"),
        Some(i) => println!(
            "VERIFIED bad: byte {i} is {:#04x}, expected {:#04x}",
            got[i], expected[i]
        ),
    }
    let half = len / 2;
    write_device(gpu, ptr + half as u64, &pattern(seed_out, len)[half..]);
    println!("WROTE {half}");
}

// ---- the parent ----------------------------------------------------------------------------

struct Peer {
    role: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Peer {
    fn spawn(role: &str, env: &[(&str, &str)]) -> Peer {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "peer_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PEER_ROLE, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn the peer");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Peer {
            role: role.to_string(),
            stdin: child.stdin.take(),
            child,
            lines: rx,
        }
    }

    /// What follows `prefix` on the next line that has it, within `T`.
    fn expect(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + T;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                // libtest may print `test peer_process ... ` before the first line.
                Ok(line) => {
                    if let Some(at) = line.find(prefix) {
                        return line[at + prefix.len()..].trim().to_owned();
                    }
                }
                Err(e) => {
                    let status = self.child.try_wait();
                    panic!(
                        "peer {}: no `{prefix}` line ({e}); its status: {status:?}",
                        self.role
                    );
                }
            }
        }
    }

    fn say(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Closes stdin and waits (bounded) for a successful exit.
    fn finish(mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + T;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "peer {} exited with {status}", self.role);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "peer {} did not exit after its stdin closed",
                self.role
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL, and reap it.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        let status = self.child.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL), "peer {}", self.role);
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Accepts the peer's connection, giving up after `T` or when the peer exits.
fn accept(listener: &UnixListener, peer: &mut Peer) -> UnixStream {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + T;
    loop {
        match listener.accept() {
            Ok((sock, _)) => {
                sock.set_nonblocking(false).unwrap();
                return sock;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(status) = peer.child.try_wait().unwrap() {
                    panic!("peer {} exited ({status}) before connecting", peer.role);
                }
                assert!(
                    Instant::now() < deadline,
                    "peer {} never connected",
                    peer.role
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// Has a new peer map `handle`, check `len` bytes at `offset` hold `seeds.0`'s pattern and
/// write `seeds.1`'s over their second half. Returns the peer, still holding the mapping.
fn import_in_peer(handle: &IpcHandle, offset: u64, len: usize, seeds: (u8, u8)) -> Peer {
    let mut peer = Peer::spawn("import-ipc", &[]);
    peer.say(&format!(
        "IPC {} {offset} {len} {} {}",
        hex(handle.as_bytes()),
        seeds.0,
        seeds.1
    ));
    let mapped = peer.expect("MAPPED ");
    let mapped_len: u64 = mapped.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(
        mapped_len >= offset + len as u64,
        "the peer mapped {mapped_len} bytes, fewer than {offset}+{len}"
    );
    assert_eq!(
        peer.expect("VERIFIED "),
        "ok",
        "the peer read other bytes through the IPC mapping"
    );
    assert_eq!(peer.expect("WROTE "), (len / 2).to_string());
    peer
}

/// `buf[offset..offset + len]`: first half `seeds.0`'s pattern, second half `seeds.1`'s.
fn assert_halves(got: &[u8], len: usize, seeds: (u8, u8), what: &str) {
    let half = len / 2;
    assert_bytes(
        &got[..half],
        &pattern(seeds.0, len)[..half],
        &format!("{what}: first half (kept)"),
    );
    assert_bytes(
        &got[half..],
        &pattern(seeds.1, len)[half..],
        &format!("{what}: second half (written by the peer)"),
    );
}

// ---- 1. the GPU ------------------------------------------------------------------------------

#[test]
fn gpu_topology_of_a_gpu_with_itself_and_every_other() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_topology_of_a_gpu_with_itself_and_every_other")
    else {
        return;
    };
    let _serial = serial("gpu_topology_of_a_gpu_with_itself_and_every_other", 120);
    let me = gpu_mem::peer_topology(&gpu, &gpu).unwrap();
    assert_eq!(me.link, gpu_mem::PeerLink::SameGpu);
    assert!(me.can_access_peer && me.access_supported);
    gpu_mem::enable_peer_access(&gpu, &gpu).unwrap();
    gpu.bind().unwrap();
    assert_eq!(gpu_mem::current_device().unwrap(), Some(gpu.ordinal()));
    for other in gpu_mem::Gpu::all().unwrap().iter().skip(1) {
        let t = gpu_mem::peer_topology(&gpu, other).unwrap();
        eprintln!("{}", t.describe());
        assert_eq!(t.link.is_direct(), t.can_access_peer && t.access_supported);
        // Enabling is idempotent, or a typed refusal for a pair without peer access.
        for _ in 0..2 {
            match gpu_mem::enable_peer_access(&gpu, other) {
                Ok(()) => assert!(t.can_access_peer),
                Err(gpu_mem::Error::NoPeerAccess { from, to }) => {
                    assert!(!t.can_access_peer);
                    assert_eq!((from, to), (gpu.ordinal(), other.ordinal()));
                }
                Err(e) => panic!("enable_peer_access: {e}"),
            }
        }
    }
}

#[test]
fn gpu_attributes_and_lookup() {
    let Some(gpu) = gpu_mem::gpu_for_test("gpu_attributes_and_lookup") else {
        return;
    };
    let _serial = serial("gpu_attributes_and_lookup", 120);
    let name = gpu.name().unwrap();
    assert!(!name.trim().is_empty(), "empty device name");

    let uuid = gpu.uuid().unwrap();
    assert_ne!(uuid, [0; 16], "all-zero UUID");
    let uuid_string = gpu.uuid_string().unwrap();
    assert_eq!(uuid_string, format_uuid(&uuid));
    let groups: Vec<&str> = uuid_string
        .strip_prefix("GPU-")
        .unwrap_or_else(|| panic!("{uuid_string}: no GPU- prefix"))
        .split('-')
        .collect();
    assert_eq!(
        groups.iter().map(|g| g.len()).collect::<Vec<_>>(),
        [8, 4, 4, 4, 12],
        "{uuid_string}"
    );
    assert!(
        groups
            .iter()
            .flat_map(|g| g.chars())
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
        "{uuid_string}: not lower-case hex"
    );
    let found = find_by_uuid(&uuid)
        .unwrap()
        .expect("find_by_uuid finds GPU 0");
    assert_eq!(found.ordinal(), gpu.ordinal());
    assert!(find_by_uuid(&[0xee; 16]).unwrap().is_none());

    // "0000:8A:00.0": domain, bus, device.function, all hex.
    let bus_id = gpu.pci_bus_id().unwrap();
    let parts: Vec<&str> = bus_id.split(':').collect();
    assert_eq!(parts.len(), 3, "{bus_id}: not domain:bus:device.function");
    let (dev, func) = parts[2]
        .split_once('.')
        .unwrap_or_else(|| panic!("{bus_id}: no .function"));
    for field in [parts[0], parts[1], dev, func] {
        assert!(
            !field.is_empty() && u32::from_str_radix(field, 16).is_ok(),
            "{bus_id}: `{field}` is not hex"
        );
    }
    let short = format!("{}:{}", parts[1], parts[2]);
    for form in [
        bus_id.clone(),
        bus_id.to_lowercase(),
        short.clone(),
        short.to_lowercase(),
    ] {
        let opened = Gpu::open_pci(&form).unwrap_or_else(|e| panic!("open_pci({form:?}): {e}"));
        assert_eq!(opened.ordinal(), gpu.ordinal(), "open_pci({form:?})");
    }

    let cc = gpu.compute_capability().unwrap();
    assert!(cc >= (7, 0), "compute capability {cc:?} < 7.0");
    assert_eq!(
        gpu.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .unwrap(),
        cc.0
    );
    let total = gpu.total_mem().unwrap();
    assert!(total >= 1 << 30, "{total} bytes of device memory");
    assert!(gpu.vmm_supported(), "no VMM on a cc {cc:?} GPU");
    assert!(gpu.posix_fd_supported(), "no POSIX-fd VMM handles");
    assert!(gpu.can_access_peer(&gpu).unwrap());
    gpu.new_stream().unwrap();
    let all = Gpu::all().unwrap();
    assert_eq!(all.len(), device_count());
    assert_eq!(all[gpu.ordinal()].uuid().unwrap(), uuid);
    eprintln!(
        "GPU {}: {name}, {uuid_string}, {bus_id}, cc {}.{}, {} MiB; DMA-BUF {}, GPUDirect RDMA {}",
        gpu.ordinal(),
        cc.0,
        cc.1,
        total >> 20,
        gpu.dmabuf_supported(),
        gpu.gpudirect_rdma_supported()
    );

    for bad in [device_count(), 999] {
        assert!(
            matches!(Gpu::open(bad), Err(Error::NoSuchGpu(_))),
            "Gpu::open({bad})"
        );
    }
    for bad in ["ff:1f.7", "0000:ff:1f.7", "not a bus id"] {
        assert!(
            matches!(Gpu::open_pci(bad), Err(Error::NoSuchGpu(_))),
            "Gpu::open_pci({bad:?})"
        );
    }
    assert!(matches!(
        Gpu::open_pci("8a:00.0\0"),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn driver_presence_agrees_with_the_gpu() {
    let Some(gpu) = gpu_mem::gpu_for_test("driver_presence_agrees_with_the_gpu") else {
        return;
    };
    let _serial = serial("driver_presence_agrees_with_the_gpu", 60);
    assert!(is_available(), "a GPU opened but is_available() is false");
    let n = device_count();
    assert!(n >= 1, "a GPU opened but device_count() is 0");
    assert!(gpu.ordinal() < n);
    assert_eq!(Gpu::all().unwrap().len(), n);
}

// ---- 2. device buffers -------------------------------------------------------------------------

#[test]
fn device_buffers_round_trip_at_offsets_and_refuse_bad_ranges() {
    let Some(gpu) =
        gpu_mem::gpu_for_test("device_buffers_round_trip_at_offsets_and_refuse_bad_ranges")
    else {
        return;
    };
    let _serial = serial(
        "device_buffers_round_trip_at_offsets_and_refuse_bad_ranges",
        120,
    );
    let plain = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    let vmm = DeviceBuffer::alloc_vmm(&gpu, LEN).unwrap();
    for (buf, is_vmm, what) in [(&plain, false, "cuMemAlloc"), (&vmm, true, "VMM")] {
        assert_eq!(
            buf.ptr() % DEVICE_BUFFER_ALIGN,
            0,
            "{what}: {:#x}",
            buf.ptr()
        );
        assert_eq!(buf.ptr() % 256, 0);
        assert_eq!(buf.len(), LEN);
        assert!(!buf.is_empty());
        assert_eq!(buf.is_vmm(), is_vmm);
        assert_eq!(buf.gpu().ordinal(), gpu.ordinal());

        buf.fill(0xa5).unwrap();
        let mut mirror = vec![0xa5u8; LEN];
        assert_bytes(
            &buf.to_vec().unwrap(),
            &mirror,
            &format!("{what}: after fill"),
        );

        // Writes at unaligned offsets, the last one ending exactly at the end.
        for (i, (offset, n)) in [
            (0, 100),
            (1, 4095),
            (255, 70_000),
            (4096 + 7, 1),
            (LEN / 2 + 3, 200_000),
            (LEN - 777, 777),
        ]
        .into_iter()
        .enumerate()
        {
            let data = pattern(i as u8 + 1, n);
            buf.copy_from_host(offset, &data).unwrap();
            mirror[offset..offset + n].copy_from_slice(&data);
        }
        assert_bytes(
            &buf.to_vec().unwrap(),
            &mirror,
            &format!("{what}: after writes"),
        );
        for (offset, n) in [(0, 1), (250, 10_000), (LEN - 1, 1), (LEN / 3, LEN / 3)] {
            let mut part = vec![0u8; n];
            buf.copy_to_host(offset, &mut part).unwrap();
            assert_bytes(
                &part,
                &mirror[offset..offset + n],
                &format!("{what}: read {offset}+{n}"),
            );
        }
        buf.copy_to_host(LEN, &mut []).unwrap();

        // Out of range: typed errors, and nothing was written.
        for (offset, n) in [(LEN - 10, 11), (LEN, 1), (LEN + 4096, 1), (usize::MAX, 2)] {
            let r = buf.copy_from_host(offset, &vec![0; n]);
            assert!(
                matches!(r, Err(Error::InvalidArgument(_))),
                "{what}: copy_from_host({offset}, {n} bytes) gave {r:?}"
            );
            let r = buf.copy_to_host(offset, &mut vec![0; n]);
            assert!(
                matches!(r, Err(Error::InvalidArgument(_))),
                "{what}: copy_to_host({offset}, {n} bytes) gave {r:?}"
            );
        }
        assert_bytes(
            &buf.to_vec().unwrap(),
            &mirror,
            &format!("{what}: after refused copies"),
        );
    }

    // Each kind exports its own way only.
    let handle = plain.export_ipc().unwrap();
    assert_ne!(handle.as_bytes(), &[0; IPC_HANDLE_BYTES]);
    let r = plain.export_fd();
    assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
    let r = vmm.export_ipc();
    assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
    let export = vmm.export_fd().unwrap();
    assert!(export.fd.as_raw_fd() >= 0);
    assert_eq!(export.len, LEN as u64);
    assert!(export.size >= LEN as u64, "export size {}", export.size);
    let r = VmmMapping::import(&gpu, export.fd.as_fd(), 0);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");

    // Empty buffers are refused.
    for r in [
        DeviceBuffer::alloc(&gpu, 0),
        DeviceBuffer::alloc_vmm(&gpu, 0),
    ] {
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }
    let r = HostBuffer::alloc(&gpu, 0);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    // An all-zero handle names no allocation.
    let r = IpcMapping::open(&gpu, &IpcHandle([0; IPC_HANDLE_BYTES]));
    assert!(matches!(r, Err(Error::Driver { .. })), "{r:?}");
}

// ---- 3. two processes --------------------------------------------------------------------------

#[test]
fn ipc_handle_maps_in_another_process() {
    let Some(gpu) = gpu_mem::gpu_for_test("ipc_handle_maps_in_another_process") else {
        return;
    };
    let _serial = serial("ipc_handle_maps_in_another_process", 120);
    let buf = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    buf.copy_from_host(0, &pattern(11, LEN)).unwrap();
    let handle = buf.export_ipc().unwrap();
    // The handle survives serialisation (it travels in metadata).
    let handle: IpcHandle = serde_json::from_str(&serde_json::to_string(&handle).unwrap()).unwrap();
    let peer = import_in_peer(&handle, 0, LEN, (11, 12));
    assert_halves(&buf.to_vec().unwrap(), LEN, (11, 12), "IPC buffer");
    peer.finish();
    // The exporter's buffer is intact after the importer unmapped and left.
    assert_halves(
        &buf.to_vec().unwrap(),
        LEN,
        (11, 12),
        "IPC buffer after exit",
    );
}

#[test]
fn vmm_fd_maps_in_another_process() {
    let Some(gpu) = gpu_mem::gpu_for_test("vmm_fd_maps_in_another_process") else {
        return;
    };
    let _serial = serial("vmm_fd_maps_in_another_process", 120);
    let dir = TempDir::new("vmm");
    let path = dir.0.join("sock");
    let listener = UnixListener::bind(&path).unwrap();
    let buf = DeviceBuffer::alloc_vmm(&gpu, LEN).unwrap();
    buf.copy_from_host(0, &pattern(21, LEN)).unwrap();
    let mut peer = Peer::spawn("import-vmm", &[(PEER_SOCKET, path.to_str().unwrap())]);
    let sock = accept(&listener, &mut peer);
    let export = buf.export_fd().unwrap();
    send_vmm(&sock, &export).unwrap();
    assert_eq!(
        peer.expect("RECEIVED "),
        format!("{} {LEN}", export.size),
        "the peer got another size/length"
    );
    drop(export);
    peer.say("VMM 21 22");
    let mapped = peer.expect("MAPPED ");
    let mapped_len: usize = mapped.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(mapped_len >= LEN, "the peer mapped {mapped_len} bytes");
    assert_eq!(
        peer.expect("VERIFIED "),
        "ok",
        "the peer read other bytes through the VMM mapping"
    );
    assert_eq!(peer.expect("WROTE "), (LEN / 2).to_string());
    assert_halves(&buf.to_vec().unwrap(), LEN, (21, 22), "VMM buffer");
    peer.finish();
    assert_halves(
        &buf.to_vec().unwrap(),
        LEN,
        (21, 22),
        "VMM buffer after exit",
    );
}

#[test]
fn borrowed_range_maps_at_its_offset_in_another_process() {
    let Some(gpu) = gpu_mem::gpu_for_test("borrowed_range_maps_at_its_offset_in_another_process")
    else {
        return;
    };
    let _serial = serial("borrowed_range_maps_at_its_offset_in_another_process", 120);
    // A framework's caching allocator hands out ranges inside one big allocation.
    const BIG: usize = 8 << 20;
    const OFF: usize = (1 << 20) + 256;
    const VIEW: usize = (2 << 20) + 100;
    let big = DeviceBuffer::alloc(&gpu, BIG).unwrap();
    big.fill(0).unwrap();
    big.copy_from_host(OFF, &pattern(31, VIEW)).unwrap();
    let view = DeviceMemoryRef::wrap(big.ptr() + OFF as u64, VIEW as u64, gpu.ordinal()).unwrap();
    assert_eq!(view.ptr(), big.ptr() + OFF as u64);
    assert_eq!(view.len(), VIEW as u64);
    assert_eq!(view.device(), gpu.ordinal());
    assert_eq!(view.info().range_start, big.ptr());
    assert_eq!(view.offset_in_allocation(), OFF as u64);
    let (handle, offset) = view.export_ipc().unwrap();
    assert_eq!(offset, OFF as u64);
    // The handle is the whole allocation's.
    assert_eq!(handle, big.export_ipc().unwrap());

    let peer = import_in_peer(&handle, offset, VIEW, (31, 32));
    let all = big.to_vec().unwrap();
    assert_halves(&all[OFF..OFF + VIEW], VIEW, (31, 32), "borrowed view");
    assert!(
        all[..OFF].iter().chain(&all[OFF + VIEW..]).all(|b| *b == 0),
        "the peer wrote outside the view"
    );
    peer.finish();

    // Wrapping refuses what the view cannot hold.
    let r = DeviceMemoryRef::wrap(big.ptr(), 0, gpu.ordinal());
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    let r = DeviceMemoryRef::wrap(big.ptr() + OFF as u64, BIG as u64, gpu.ordinal());
    assert!(matches!(r, Err(Error::NotDeviceMemory { .. })), "{r:?}");
    // VMM memory has no legacy IPC handle.
    let vmm = DeviceBuffer::alloc_vmm(&gpu, LEN).unwrap();
    let vmm_view = DeviceMemoryRef::wrap(vmm.ptr() + 4096, 4096, gpu.ordinal()).unwrap();
    let r = vmm_view.export_ipc();
    assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
}

#[test]
fn killed_importer_leaves_the_exporter_working() {
    let Some(gpu) = gpu_mem::gpu_for_test("killed_importer_leaves_the_exporter_working") else {
        return;
    };
    let _serial = serial("killed_importer_leaves_the_exporter_working", 180);
    let buf = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    buf.copy_from_host(0, &pattern(41, LEN)).unwrap();
    let mut peer = import_in_peer(&buf.export_ipc().unwrap(), 0, LEN, (41, 42));
    peer.kill();
    drop(peer);

    // The exporter's memory is still its own: written, read, freed.
    assert_halves(&buf.to_vec().unwrap(), LEN, (41, 42), "after the kill");
    buf.copy_from_host(0, &pattern(43, LEN)).unwrap();
    assert_bytes(&buf.to_vec().unwrap(), &pattern(43, LEN), "rewritten");
    drop(buf);

    // A new allocation is exported to a new importer as if nothing happened.
    let buf = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    buf.copy_from_host(0, &pattern(44, LEN)).unwrap();
    let peer = import_in_peer(&buf.export_ipc().unwrap(), 0, LEN, (44, 45));
    assert_halves(&buf.to_vec().unwrap(), LEN, (44, 45), "second importer");
    peer.finish();
}

#[test]
fn killed_exporter_leaves_the_importer_working() {
    let Some(gpu) = gpu_mem::gpu_for_test("killed_exporter_leaves_the_importer_working") else {
        return;
    };
    let _serial = serial("killed_exporter_leaves_the_importer_working", 180);
    let mut peer = Peer::spawn("export-ipc", &[]);
    peer.say(&format!("EXPORT {LEN} 51"));
    let handle = IpcHandle::from_bytes(&unhex(&peer.expect("HANDLE "))).unwrap();
    let mapping = IpcMapping::open(&gpu, &handle).unwrap();
    assert!(
        mapping.len() >= LEN as u64,
        "mapped {} bytes",
        mapping.len()
    );
    assert_eq!(mapping.gpu().ordinal(), gpu.ordinal());
    let info = pointer_info(mapping.ptr()).unwrap();
    assert_eq!(info.kind, MemoryKind::Device, "{info:?}");
    assert_bytes(
        &read_device(&gpu, mapping.ptr(), LEN),
        &pattern(51, LEN),
        "read through the IPC mapping",
    );

    peer.kill();
    // Closing a mapping of a dead exporter may fail (logged), but must not panic.
    drop(mapping);
    drop(peer);

    let buf = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    buf.copy_from_host(0, &pattern(52, LEN)).unwrap();
    assert_bytes(
        &buf.to_vec().unwrap(),
        &pattern(52, LEN),
        "own memory after",
    );
    buf.fill(7).unwrap();
    assert!(buf.to_vec().unwrap().iter().all(|b| *b == 7));
    let vmm = DeviceBuffer::alloc_vmm(&gpu, LEN).unwrap();
    vmm.copy_from_host(0, &pattern(53, LEN)).unwrap();
    assert_bytes(
        &vmm.to_vec().unwrap(),
        &pattern(53, LEN),
        "own VMM memory after",
    );
}

// ---- 4. DMA-BUF ----------------------------------------------------------------------------------

#[test]
fn dmabuf_export_of_plain_and_vmm_buffers() {
    let Some(gpu) = gpu_mem::gpu_for_test("dmabuf_export_of_plain_and_vmm_buffers") else {
        return;
    };
    let _serial = serial("dmabuf_export_of_plain_and_vmm_buffers", 120);
    // Sizes that are not page multiples; large enough to start on a page of their own.
    let plain = DeviceBuffer::alloc(&gpu, (4 << 20) + 1000).unwrap();
    let vmm = DeviceBuffer::alloc_vmm(&gpu, (3 << 20) + 1000).unwrap();
    if !gpu.dmabuf_supported() {
        eprintln!("dmabuf_export_of_plain_and_vmm_buffers: DMA-BUF NOT supported on this GPU/driver: checking the typed error");
        for buf in [&plain, &vmm] {
            let r = buf.dmabuf_fd();
            assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
        }
        return;
    }
    eprintln!("dmabuf_export_of_plain_and_vmm_buffers: DMA-BUF supported: exporting");
    for (buf, what) in [(&plain, "cuMemAlloc"), (&vmm, "VMM")] {
        let d = buf
            .dmabuf_fd()
            .unwrap_or_else(|e| panic!("{what}: dmabuf_fd: {e}"));
        // SAFETY: all-zero is a valid `stat`; it is only an out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a descriptor we own and a valid out-pointer.
        let rc = unsafe { libc::fstat(d.fd.as_raw_fd(), &mut st) };
        assert_eq!(
            rc,
            0,
            "{what}: fstat of the DMA-BUF fd: {}",
            std::io::Error::last_os_error()
        );
        let link = std::fs::read_link(format!("/proc/self/fd/{}", d.fd.as_raw_fd()));
        eprintln!("{what}: DMA-BUF {d:?}, st_size {}, {link:?}", st.st_size);
        assert_eq!(d.range_start % 4096, 0, "{what}: {d:?}");
        assert_eq!(d.range_len % 4096, 0, "{what}: {d:?}");
        assert_eq!(d.len, buf.len() as u64, "{what}: {d:?}");
        assert_eq!(d.range_start + d.offset, buf.ptr(), "{what}: {d:?}");
        assert!(d.offset + d.len <= d.range_len, "{what}: {d:?}");
        if st.st_size != 0 {
            assert_eq!(st.st_size as u64, d.range_len, "{what}: DMA-BUF size");
        }
    }
}

// ---- 5. pointer classification -------------------------------------------------------------------

#[test]
fn every_kind_of_pointer_is_classified() {
    let Some(gpu) = gpu_mem::gpu_for_test("every_kind_of_pointer_is_classified") else {
        return;
    };
    let _serial = serial("every_kind_of_pointer_is_classified", 120);
    let ord = gpu.ordinal();

    // Pageable host memory.
    let mut pageable = pattern(61, 1 << 20);
    let info = pointer_info(pageable.as_ptr() as u64).unwrap();
    assert_eq!(info.kind, MemoryKind::Host, "pageable: {info:?}");
    assert_eq!(info.device, None, "pageable: {info:?}");
    assert_eq!((info.range_start, info.range_size), (0, 0));
    assert!(!info.ipc_capable);

    // Pinned host memory, allocated.
    let mut host = HostBuffer::alloc(&gpu, 64 << 10).unwrap();
    assert!(host.as_slice().iter().all(|b| *b == 0), "not zeroed");
    let info = pointer_info(host.as_ptr() as u64).unwrap();
    assert_eq!(info.kind, MemoryKind::PinnedHost, "HostBuffer: {info:?}");
    assert!(!info.ipc_capable);

    // Pinned host memory, registered in place, and unpinned again.
    let p = pageable.as_mut_ptr();
    // SAFETY: `pageable` stays allocated and unmoved until both registrations are dropped.
    let reg = unsafe { HostRegistration::register(&gpu, p, 1 << 20) }.unwrap();
    assert!(reg.pinned_here());
    assert_eq!(reg.len(), 1 << 20);
    assert_eq!(reg.as_ptr(), p);
    let info = pointer_info(p as u64 + 4096).unwrap();
    assert_eq!(info.kind, MemoryKind::PinnedHost, "registered: {info:?}");
    // A second registration of pinned memory is accepted and unpins nothing.
    // SAFETY: as above.
    let again = unsafe { HostRegistration::register(&gpu, p, 1 << 20) }.unwrap();
    assert!(!again.pinned_here());
    drop(again);
    let info = pointer_info(p as u64).unwrap();
    assert_eq!(
        info.kind,
        MemoryKind::PinnedHost,
        "after dropping the 2nd: {info:?}"
    );
    // The device pointers read what the host wrote.
    let d = reg.device_ptr().unwrap();
    assert_ne!(d, 0);
    assert_bytes(
        &read_device(&gpu, d + 100, 8192),
        &pageable[100..8292],
        "registered memory through its device pointer",
    );
    host.as_mut_slice().copy_from_slice(&pattern(62, 64 << 10));
    let d = host.device_ptr().unwrap();
    assert_ne!(d, 0);
    assert_bytes(
        &read_device(&gpu, d, 64 << 10),
        &pattern(62, 64 << 10),
        "HostBuffer through its device pointer",
    );
    drop(reg);
    let info = pointer_info(p as u64).unwrap();
    assert_eq!(info.kind, MemoryKind::Host, "after unregistering: {info:?}");
    assert_eq!(info.device, None);

    // Device memory: cuMemAlloc and VMM.
    let plain = DeviceBuffer::alloc(&gpu, LEN).unwrap();
    let info = pointer_info(plain.ptr() + 1000).unwrap();
    assert_eq!(info.kind, MemoryKind::Device, "cuMemAlloc: {info:?}");
    assert_eq!(info.device, Some(ord));
    assert!(info.range_start <= plain.ptr(), "{info:?}");
    assert!(info.contains(plain.ptr(), LEN as u64), "{info:?}");
    assert!(info.ipc_capable, "cuMemAlloc memory: {info:?}");
    assert_ne!(info.buffer_id, 0);
    let vmm = DeviceBuffer::alloc_vmm(&gpu, LEN).unwrap();
    let vinfo = pointer_info(vmm.ptr()).unwrap();
    assert_eq!(vinfo.kind, MemoryKind::Device, "VMM: {vinfo:?}");
    assert_eq!(vinfo.device, Some(ord));
    assert!(vinfo.contains(vmm.ptr(), LEN as u64), "{vinfo:?}");
    assert!(!vinfo.ipc_capable, "VMM memory: {vinfo:?}");
    assert_ne!(vinfo.buffer_id, info.buffer_id);

    // Managed memory.
    assert_eq!(
        gpu.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)
            .unwrap(),
        1
    );
    gpu.bind().unwrap();
    let mut managed = 0;
    // SAFETY: a valid out-pointer; the context is current.
    let result = unsafe {
        sys::cuMemAllocManaged(
            &mut managed,
            1 << 20,
            sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32,
        )
    };
    result.result().unwrap();
    let minfo = pointer_info(managed + 64);
    let mcheck = check_device_range(managed, 64, ord);
    // SAFETY: allocated above, freed once, not used afterwards.
    let result = unsafe { sys::cuMemFree_v2(managed) };
    result.result().unwrap();
    let minfo = minfo.unwrap();
    assert_eq!(minfo.kind, MemoryKind::Managed, "managed: {minfo:?}");
    assert!(
        matches!(mcheck, Err(Error::NotDeviceMemory { .. })),
        "{mcheck:?}"
    );

    // Freed device memory is no longer device memory.
    let freed = DeviceBuffer::alloc(&gpu, 8 << 20).unwrap();
    let (ptr, id) = (freed.ptr(), pointer_info(freed.ptr()).unwrap().buffer_id);
    drop(freed);
    let info = pointer_info(ptr).unwrap();
    assert_eq!(
        info.kind,
        MemoryKind::Host,
        "freed (buffer id was {id}): {info:?}"
    );
    assert_eq!(info.device, None);
    let r = check_device_range(ptr, 1, ord);
    assert!(matches!(r, Err(Error::NotDeviceMemory { .. })), "{r:?}");

    // check_device_range: the whole allocation passes; host memory, a range running past
    // the end and another GPU's ordinal fail with the pointer and length asked about.
    let pinfo = pointer_info(plain.ptr()).unwrap();
    let ok = check_device_range(plain.ptr(), LEN as u64, ord).unwrap();
    assert_eq!(ok.buffer_id, pinfo.buffer_id);
    check_device_range(pinfo.range_start + pinfo.range_size - 1, 1, ord).unwrap();
    let host_ptr = pageable.as_ptr() as u64;
    for (ptr, len, dev, what) in [
        (host_ptr, 64, ord, "pageable host memory"),
        (host.as_ptr() as u64, 64, ord, "pinned host memory"),
        (
            plain.ptr() + 4096,
            pinfo.range_size,
            ord,
            "a range past the end",
        ),
        (plain.ptr(), 64, ord + 1, "another GPU's ordinal"),
    ] {
        match check_device_range(ptr, len, dev) {
            Err(Error::NotDeviceMemory {
                ptr: p,
                len: l,
                expected_device,
                found,
            }) => {
                assert_eq!((p, l, expected_device), (ptr, len, dev), "{what}");
                eprintln!("{what}: {found}");
            }
            other => panic!("{what}: check_device_range gave {other:?}"),
        }
    }
    let r = DeviceMemoryRef::wrap(host_ptr, 64, ord);
    assert!(matches!(r, Err(Error::NotDeviceMemory { .. })), "{r:?}");
}
