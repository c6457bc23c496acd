//! An MoE-style all-to-all among N processes, one per GPU of one node, through agents
//! with NIXL's default backends (the host API; VRAM to VRAM goes through `CUDA_IPC`):
//! rank r WRITEs a different 64 MiB slice to every other rank j (into j's receive
//! buffer at slice r), all its requests in flight together, for several rounds; every
//! byte received is checked. The aggregate bandwidth is printed beside the same
//! exchange done with plain peer copies (`cuMemcpyPeerAsync`, peer access enabled) in
//! the same run.
//!
//! The same exchange through the device API (feature `gpunetio`): each rank's kernel
//! puts its slices into every other rank's receive buffer through `GPUNETIO` memory
//! views (`nixlPut`), adds to a counter of each peer's (`nixlAtomicAdd`), and a second
//! kernel waits until every peer's counter here says that peer's slice has landed
//! (`nixl/device/nixl_alltoall.cu`); every byte is checked and the aggregate printed
//! beside plain peer copies in the same run.
//!
//! `gpu_multi_alltoall_2gpu` and `gpu_multi_alltoall_device_2gpu` run 2 ranks and need 2
//! GPUs; `gpu_multi_alltoall_4gpu` and `gpu_multi_alltoall_device_4gpu` run 4 and need 4.
//! With fewer GPUs each prints why it skips; with `NIXL_REQUIRE_GPU=1` (the GPU machine)
//! each fails — so on a 2-GPU machine run the `_2gpu` tests alone (the 4-rank cases need a
//! 4-GPU machine).
#![cfg(all(feature = "cuda", feature = "libfabric"))]

mod common;
mod multi_gpu;

use common::{listening, self_test};
use gpu_mem::cudarc::driver::sys;
use gpu_mem::gpus_for_test;
use gpu_mem::{DeviceBuffer, Gpu};
use multi_gpu::{publish, unit_bytes, wait_all, wait_child, watchdog};
use nixl::{Agent, Desc, DescList, MemKind, XferOp, XferStatus};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Bytes each rank sends to each other rank.
const SLICE: usize = 64 << 20;
/// Rounds of the whole exchange (timed together: start skew between processes is
/// small beside them).
const ROUNDS: usize = 10;
const RANK_ENV: &str = "NIXL_A2A_RANK";
const RANKS_ENV: &str = "NIXL_A2A_RANKS";
const DIR_ENV: &str = "NIXL_A2A_DIR";
/// `host` (agents' requests) or `device` (kernels through memory views).
const MODE_ENV: &str = "NIXL_A2A_MODE";
const LIMIT: Duration = Duration::from_secs(180);

/// What rank `from` sends rank `to`.
fn slice_bytes(from: usize, to: usize) -> Vec<u8> {
    unit_bytes(0xA0 + from as u64, to as u64, SLICE)
}

fn file(dir: &Path, what: &str, rank: usize) -> PathBuf {
    dir.join(format!("{what}-{rank}"))
}

fn all(dir: &Path, what: &str, ranks: usize) -> Vec<PathBuf> {
    (0..ranks).map(|r| file(dir, what, r)).collect()
}

/// One rank (run by the tests below as a copy of this binary, one process per GPU).
#[test]
fn alltoall_rank_main() {
    let Ok(rank) = std::env::var(RANK_ENV) else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let ranks: usize = std::env::var(RANKS_ENV).unwrap().parse().unwrap();
    let dir = PathBuf::from(std::env::var(DIR_ENV).unwrap());
    let device = std::env::var(MODE_ENV).as_deref() == Ok("device");
    watchdog(LIMIT + Duration::from_secs(30));
    let verdict = std::panic::catch_unwind(|| {
        if device {
            run_rank_device(rank, ranks, &dir)
        } else {
            run_rank(rank, ranks, &dir)
        }
    });
    let text = match &verdict {
        Ok(elapsed) => format!("OK {}", elapsed.as_nanos()),
        Err(e) => format!(
            "FAILED {}",
            e.downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        ),
    };
    publish(&file(&dir, "result", rank), &text);
    // Nobody leaves (and unmaps its buffers) before everyone is done with them.
    wait_all(&all(&dir, "result", ranks), LIMIT);
}

/// Rank `rank` of `ranks`: returns how long its ROUNDS exchanges took.
fn run_rank(rank: usize, ranks: usize, dir: &Path) -> Duration {
    let gpu = Gpu::open(rank).unwrap();
    let name = |r: usize| format!("a2a-{r}");
    let agent = Agent::new(name(rank), listening()).unwrap();
    agent.create_default_backends().unwrap();
    let send = DeviceBuffer::alloc(&gpu, ranks * SLICE).unwrap();
    for to in 0..ranks {
        send.copy_from_host(to * SLICE, &slice_bytes(rank, to))
            .unwrap();
    }
    let recv = DeviceBuffer::alloc(&gpu, ranks * SLICE).unwrap();
    recv.fill(0).unwrap();
    let dev = rank as u64;
    let whole = |b: &DeviceBuffer| Desc::new(b.ptr(), b.len() as u64, dev);
    // SAFETY: the buffers outlive the registration and every request (declared first).
    let _reg = unsafe {
        agent
            .register_mem(
                &DescList::from_descs(MemKind::Vram, [whole(&send), whole(&recv)]),
                None,
            )
            .unwrap()
    };
    publish(
        &file(dir, "addr", rank),
        &format!("{} {}", agent.listen_addr().unwrap(), recv.ptr()),
    );
    wait_all(&all(dir, "addr", ranks), LIMIT);
    let peers: Vec<usize> = (0..ranks).filter(|&j| j != rank).collect();
    let mut remote_recv = vec![0u64; ranks];
    for &j in &peers {
        let text = std::fs::read_to_string(file(dir, "addr", j)).unwrap();
        let (addr, base) = text.split_once(' ').unwrap();
        let addr = addr.parse().unwrap();
        assert_eq!(agent.fetch_remote_metadata(addr).unwrap(), name(j));
        agent.send_local_metadata(addr).unwrap();
        remote_recv[j] = base.parse().unwrap();
    }
    publish(&file(dir, "loaded", rank), "");
    wait_all(&all(dir, "loaded", ranks), LIMIT);

    let local = agent
        .prep_xfer_dlist(
            None,
            &DescList::from_descs(
                MemKind::Vram,
                (0..ranks).map(|j| Desc::new(send.ptr() + (j * SLICE) as u64, SLICE as u64, dev)),
            ),
        )
        .unwrap();
    let mut reqs = Vec::new();
    for &j in &peers {
        // Into j's receive buffer, at this rank's slice.
        let at = Desc::new(
            remote_recv[j] + (rank * SLICE) as u64,
            SLICE as u64,
            j as u64,
        );
        let remote = agent
            .prep_xfer_dlist(Some(&name(j)), &DescList::from_descs(MemKind::Vram, [at]))
            .unwrap();
        let req = agent
            .make_xfer_req(
                XferOp::Write,
                &local,
                &[j],
                &remote,
                &[0],
                Some(format!("a2a {rank}").into_bytes()),
                None,
            )
            .unwrap();
        assert_eq!(
            req.backend_name(),
            "CUDA_IPC",
            "VRAM to VRAM on one node goes through CUDA_IPC by default"
        );
        reqs.push(req);
    }
    publish(&file(dir, "ready", rank), "");
    wait_all(&all(dir, "ready", ranks), LIMIT);

    let start = Instant::now();
    let mut notifs = 0usize;
    for _ in 0..ROUNDS {
        for req in &mut reqs {
            req.post().unwrap();
        }
        for req in &mut reqs {
            while req.status().unwrap() != XferStatus::Done {
                std::hint::spin_loop();
            }
        }
        notifs += agent.get_notifs().values().map(Vec::len).sum::<usize>();
    }
    let elapsed = start.elapsed();
    // Every peer's every round has landed here once its notification has.
    let deadline = Instant::now() + LIMIT;
    while notifs < peers.len() * ROUNDS {
        assert!(
            Instant::now() < deadline,
            "rank {rank}: {notifs} of {} notifications",
            peers.len() * ROUNDS
        );
        notifs += agent
            .wait_notifs(Duration::from_millis(100))
            .values()
            .map(Vec::len)
            .sum::<usize>();
    }
    check_received(&recv, rank, ranks);
    elapsed
}

/// Every peer's slice landed whole in `recv` at its slot, and nothing in this rank's own.
fn check_received(recv: &DeviceBuffer, rank: usize, ranks: usize) {
    let mut got = vec![0u8; SLICE];
    for from in (0..ranks).filter(|&j| j != rank) {
        recv.copy_to_host(from * SLICE, &mut got).unwrap();
        assert!(
            got == slice_bytes(from, rank),
            "rank {rank}: the slice from rank {from} differs"
        );
    }
    recv.copy_to_host(rank * SLICE, &mut got).unwrap();
    assert!(
        got.iter().all(|b| *b == 0),
        "rank {rank}: its own slot was written"
    );
}

/// Rank `rank` of `ranks` through the device API: returns how long its ROUNDS exchanges
/// took (kernels only, metadata and views prepared before).
#[cfg(feature = "gpunetio")]
fn run_rank_device(rank: usize, ranks: usize, dir: &Path) -> Duration {
    use gpu_mem::cudarc::driver::{LaunchConfig, PushKernelArg};
    use nixl::device::RawGpuHandle;
    let gpu = Gpu::open(rank).unwrap();
    let name = |r: usize| format!("a2a-dev-{r}");
    let agent = Agent::new(name(rank), listening()).unwrap();
    agent
        .create_backend(
            "GPUNETIO",
            &nixl::params([
                ("nic_handler", "intra_node"),
                ("gpu_devices", &rank.to_string()),
            ]),
        )
        .unwrap();
    let send = DeviceBuffer::alloc(&gpu, ranks * SLICE).unwrap();
    for to in 0..ranks {
        send.copy_from_host(to * SLICE, &slice_bytes(rank, to))
            .unwrap();
    }
    let recv = DeviceBuffer::alloc(&gpu, ranks * SLICE).unwrap();
    recv.fill(0).unwrap();
    // Counter `s`: how many of sender s's blocks have landed their share here.
    let counters = DeviceBuffer::alloc(&gpu, ranks * 8).unwrap();
    counters.fill(0).unwrap();
    let dev = rank as u64;
    let whole = |b: &DeviceBuffer| Desc::new(b.ptr(), b.len() as u64, dev);
    // SAFETY: the buffers outlive the registration, the views and every kernel (declared
    // first; the kernels are waited for before the views go).
    let _reg = unsafe {
        agent
            .register_mem(
                &DescList::from_descs(
                    MemKind::Vram,
                    [whole(&send), whole(&recv), whole(&counters)],
                ),
                None,
            )
            .unwrap()
    };
    publish(
        &file(dir, "addr", rank),
        &format!(
            "{} {} {}",
            agent.listen_addr().unwrap(),
            recv.ptr(),
            counters.ptr()
        ),
    );
    wait_all(&all(dir, "addr", ranks), LIMIT);
    let peers: Vec<usize> = (0..ranks).filter(|&j| j != rank).collect();
    let mut remote = vec![(0u64, 0u64); ranks];
    for &j in &peers {
        let text = std::fs::read_to_string(file(dir, "addr", j)).unwrap();
        let mut words = text.split(' ');
        let addr = words.next().unwrap().parse().unwrap();
        assert_eq!(agent.fetch_remote_metadata(addr).unwrap(), name(j));
        agent.send_local_metadata(addr).unwrap();
        remote[j] = (
            words.next().unwrap().parse().unwrap(),
            words.next().unwrap().parse().unwrap(),
        );
    }
    publish(&file(dir, "loaded", rank), "");
    wait_all(&all(dir, "loaded", ranks), LIMIT);

    // The local view: element j is the slice for rank j. A remote view per peer: its
    // receive slot for this rank, and its counter word for this rank.
    let local = agent
        .prep_xfer_dlist(
            None,
            &DescList::from_descs(
                MemKind::Vram,
                (0..ranks).map(|j| Desc::new(send.ptr() + (j * SLICE) as u64, SLICE as u64, dev)),
            ),
        )
        .unwrap();
    let local_view = agent.prep_mem_view(&local, Some("GPUNETIO")).unwrap();
    let remote_views: Vec<_> = peers
        .iter()
        .map(|&j| {
            let (recv_j, counters_j) = remote[j];
            let list = agent
                .prep_xfer_dlist(
                    Some(&name(j)),
                    &DescList::from_descs(
                        MemKind::Vram,
                        [
                            Desc::new(recv_j + (rank * SLICE) as u64, SLICE as u64, j as u64),
                            Desc::new(counters_j + (rank * 8) as u64, 8, j as u64),
                        ],
                    ),
                )
                .unwrap();
            agent.prep_mem_view(&list, Some("GPUNETIO")).unwrap()
        })
        .collect();
    let raw: Vec<u8> = remote_views
        .iter()
        .flat_map(|v| {
            let h: RawGpuHandle = v.raw();
            [
                h.slot.to_le_bytes().to_vec(),
                h.generation.to_le_bytes().to_vec(),
                h.descs.to_le_bytes().to_vec(),
                h.qp.to_le_bytes().to_vec(),
                h.count.to_le_bytes().to_vec(),
                h.flags.to_le_bytes().to_vec(),
            ]
            .concat()
        })
        .collect();
    assert_eq!(raw.len(), peers.len() * std::mem::size_of::<RawGpuHandle>());
    let remotes = DeviceBuffer::alloc(&gpu, raw.len()).unwrap();
    remotes.copy_from_host(0, &raw).unwrap();
    let peer_ids: Vec<u8> = peers
        .iter()
        .flat_map(|&j| (j as u32).to_le_bytes())
        .collect();
    let peer_buf = DeviceBuffer::alloc(&gpu, peer_ids.len()).unwrap();
    peer_buf.copy_from_host(0, &peer_ids).unwrap();
    let status = DeviceBuffer::alloc(&gpu, 8).unwrap();
    status.fill(0).unwrap();

    let (source_name, source) = nixl::device::DEVICE_SOURCES
        .iter()
        .find(|(n, _)| *n == "nixl_alltoall.cu")
        .unwrap();
    let ptx = gpunetio::device_code::compile(
        source_name,
        source,
        &nixl::device::compile_options(&gpu).unwrap(),
    )
    .expect("the all-to-all kernels compile");
    let module = gpu.context().load_module(ptx).unwrap();
    let put = module.load_function("nixl_alltoall_put").unwrap();
    let wait = module.load_function("nixl_alltoall_wait").unwrap();
    // The fewest SMs of the ranks' GPUs: every rank computes the same blocks per peer,
    // which is what each receiver's counters count to.
    let sms = (0..ranks)
        .map(|r| {
            Gpu::open(r)
                .unwrap()
                .context()
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .unwrap() as u32
        })
        .min()
        .unwrap();
    let npeers = peers.len() as u32;
    // Two blocks per SM over all peers: every SM copies, none idles behind a tail.
    let blocks_per_peer = (2 * sms).div_ceil(npeers).max(1);
    // 16 warps a block where the kernel's registers allow it, else 8.
    let threads: u32 = match put.occupancy_max_active_blocks_per_multiprocessor(512, 0, None) {
        Ok(n) if n > 0 => 512,
        _ => 256,
    };
    let stream = gpu.new_stream().unwrap();
    let (lv, remotes_ptr, peers_ptr, status_ptr, counters_ptr) = (
        local_view.raw(),
        remotes.ptr(),
        peer_buf.ptr(),
        status.ptr(),
        counters.ptr(),
    );
    let slice = SLICE as u64;
    let timeout_ns: u64 = 30_000_000_000;
    publish(&file(dir, "ready", rank), "");
    wait_all(&all(dir, "ready", ranks), LIMIT);

    let start = Instant::now();
    for round in 1..=ROUNDS as u64 {
        let mut launch = stream.launch_builder(&put);
        launch
            .arg(&lv)
            .arg(&remotes_ptr)
            .arg(&peers_ptr)
            .arg(&npeers)
            .arg(&blocks_per_peer)
            .arg(&slice)
            .arg(&status_ptr);
        // SAFETY: nixl_alltoall_put(nixlMemViewH, const nixlMemViewH*, const unsigned*,
        // unsigned, unsigned, unsigned long long, int*): `remotes` holds `npeers` handles
        // of live views, `peer_buf` `npeers` ranks, `status` an int; the views' memory
        // (registered here, mapped from the peers) outlives the kernel (the stream is
        // synchronized before anything is released).
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (blocks_per_peer * npeers, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .unwrap();
        let expected = u64::from(blocks_per_peer) * round;
        let mut launch = stream.launch_builder(&wait);
        launch
            .arg(&counters_ptr)
            .arg(&peers_ptr)
            .arg(&npeers)
            .arg(&expected)
            .arg(&timeout_ns)
            .arg(&status_ptr);
        // SAFETY: nixl_alltoall_wait(const unsigned long long*, const unsigned*, unsigned,
        // unsigned long long, unsigned long long, int*): `counters` holds `ranks` words,
        // every peer id is below `ranks`; the wait is bounded by `timeout_ns`.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .unwrap();
    }
    stream.synchronize().unwrap();
    let elapsed = start.elapsed();
    let mut word = [0u8; 4];
    status.copy_to_host(0, &mut word).unwrap();
    assert_eq!(
        i32::from_le_bytes(word),
        0,
        "rank {rank}: a kernel failed (a device-API status, or 1000: a peer's counter timed out)"
    );
    let mut got = [0u8; 8];
    for &j in &peers {
        counters.copy_to_host(j * 8, &mut got).unwrap();
        assert_eq!(
            u64::from_le_bytes(got),
            u64::from(blocks_per_peer) * ROUNDS as u64,
            "rank {rank}: rank {j}'s signals"
        );
    }
    check_received(&recv, rank, ranks);
    drop(remote_views);
    drop(local_view);
    elapsed
}

#[cfg(not(feature = "gpunetio"))]
fn run_rank_device(_rank: usize, _ranks: usize, _dir: &Path) -> Duration {
    panic!("the device-API all-to-all needs feature gpunetio");
}

/// The same exchange (ROUNDS × every ordered pair of GPUs, SLICE each) done with plain
/// peer copies from this one process: one stream per pair on the sending GPU, peer
/// access enabled both ways. Returns how long it took.
fn peer_copy_exchange(gpus: &[Gpu]) -> Duration {
    let n = gpus.len();
    let send: Vec<DeviceBuffer> = gpus
        .iter()
        .map(|g| DeviceBuffer::alloc(g, n * SLICE).unwrap())
        .collect();
    let recv: Vec<DeviceBuffer> = gpus
        .iter()
        .map(|g| DeviceBuffer::alloc(g, n * SLICE).unwrap())
        .collect();
    for (i, a) in gpus.iter().enumerate() {
        send[i].fill(i as u8 + 1).unwrap();
        for b in gpus {
            // A pair without peer access copies through host memory (the driver stages
            // it), as CUDA_IPC then does too: the comparison stays like for like.
            match gpu_mem::enable_peer_access(a, b) {
                Ok(()) | Err(gpu_mem::Error::NoPeerAccess { .. }) => {}
                Err(e) => panic!("enabling peer access {i} -> {}: {e}", b.ordinal()),
            }
        }
    }
    let streams: Vec<Vec<_>> = gpus
        .iter()
        .map(|g| (0..n).map(|_| g.new_stream().unwrap()).collect())
        .collect();
    let run = || {
        for (i, a) in gpus.iter().enumerate() {
            a.bind().unwrap();
            for (j, b) in gpus.iter().enumerate() {
                if i == j {
                    continue;
                }
                // SAFETY: both ranges lie inside live allocations of SLICE bytes or more
                // (slice j of i's send buffer, slice i of j's receive buffer); the stream
                // belongs to `a`'s context, and both contexts are live.
                let r = unsafe {
                    sys::cuMemcpyPeerAsync(
                        recv[j].ptr() + (i * SLICE) as u64,
                        b.context().cu_ctx(),
                        send[i].ptr() + (j * SLICE) as u64,
                        a.context().cu_ctx(),
                        SLICE,
                        streams[i][j].cu_stream(),
                    )
                };
                assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "peer copy {i} -> {j}");
            }
        }
        for s in streams.iter().flatten() {
            s.synchronize().unwrap();
        }
    };
    run(); // warm-up
    let start = Instant::now();
    for _ in 0..ROUNDS {
        run();
    }
    let elapsed = start.elapsed();
    // The copies moved what they were given (one slice checked per pair).
    for (j, r) in recv.iter().enumerate() {
        for i in (0..n).filter(|&i| i != j) {
            let mut got = vec![0u8; 4096];
            r.copy_to_host(i * SLICE + SLICE - 4096, &mut got).unwrap();
            assert!(
                got.iter().all(|b| *b == i as u8 + 1),
                "peer copy {i} -> {j}"
            );
        }
    }
    elapsed
}

fn alltoall(test: &str, ranks: usize) {
    exchange(test, ranks, false);
}

/// Runs the exchange among `ranks` processes, through the device API with `device`.
fn exchange(test: &str, ranks: usize, device: bool) {
    // One exchange at a time: the two tests share the GPUs (and the timings).
    let _one = common::serial();
    let Some(gpus) = gpus_for_test(test, ranks) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("nixl-a2a-{}-{ranks}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut children: Vec<_> = (0..ranks)
        .map(|r| {
            let mut cmd = self_test("alltoall_rank_main", false);
            cmd.arg("--nocapture")
                .env(RANK_ENV, r.to_string())
                .env(RANKS_ENV, ranks.to_string())
                .env(DIR_ENV, &dir)
                .env(MODE_ENV, if device { "device" } else { "host" });
            cmd.spawn().unwrap()
        })
        .collect();
    for (r, child) in children.iter_mut().enumerate() {
        wait_child(child, &format!("rank {r}"), LIMIT + Duration::from_secs(60));
    }
    let mut slowest = Duration::ZERO;
    for r in 0..ranks {
        let text = std::fs::read_to_string(file(&dir, "result", r)).unwrap();
        let ns = text
            .strip_prefix("OK ")
            .unwrap_or_else(|| panic!("rank {r}: {text}"));
        slowest = slowest.max(Duration::from_nanos(ns.parse().unwrap()));
    }
    let _ = std::fs::remove_dir_all(&dir);
    let bytes = (ranks * (ranks - 1) * SLICE * ROUNDS) as f64;
    let ours = bytes / slowest.as_secs_f64() / 1e9;
    let peer = bytes / peer_copy_exchange(&gpus).as_secs_f64() / 1e9;
    let how = if device {
        "kernels (GPUNETIO device API)"
    } else {
        "agents (CUDA_IPC)"
    };
    eprintln!(
        "{test}: {ranks} ranks, {} MiB per pair, {ROUNDS} rounds: {how} {ours:.1} GB/s \
         aggregate, plain peer copies {peer:.1} GB/s, ratio {:.2}",
        SLICE >> 20,
        ours / peer
    );
}

#[test]
fn gpu_multi_alltoall_2gpu() {
    alltoall("gpu_multi_alltoall_2gpu", 2);
}

#[test]
fn gpu_multi_alltoall_4gpu() {
    alltoall("gpu_multi_alltoall_4gpu", 4);
}

#[cfg(feature = "gpunetio")]
#[test]
fn gpu_multi_alltoall_device_2gpu() {
    exchange("gpu_multi_alltoall_device_2gpu", 2, true);
}

#[cfg(feature = "gpunetio")]
#[test]
fn gpu_multi_alltoall_device_4gpu() {
    exchange("gpu_multi_alltoall_device_4gpu", 4, true);
}
