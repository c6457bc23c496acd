//! What `gpu_vram_peer_dram`, `gpu_multi_vram_peer_dram` and `gpu_gpunetio_peer_dram`
//! share: the target process (DRAM and VRAM, checking WRITEs at their notification), the
//! initiator's memory, and the cases (VRAM → peer DRAM and DRAM → peer VRAM, WRITE and
//! READ, batch 1 and 64, odd sizes and offsets, bandwidth beside pinned copies of the
//! same block size measured in the same run). The backend is LIBFABRIC unless a binary
//! sets [`BACKEND`] (the target process gets it through its environment).
#![allow(dead_code)]

use super::common::{
    announce, announce_path, device_buffer as device, dram, listening, pattern, self_test, vram,
    wait_file, TIMEOUT,
};
use gpu_mem::{DeviceBuffer, Gpu, HostBuffer};
use nixl::{params, Agent, AgentConfig, Desc, DescList, MemKind, RegistrationHandle, XferOp};
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

/// The test, in each binary, that runs [`target_main`].
pub const TARGET_TEST: &str = "gpu_peer_dram_target_main";

/// Each side's DRAM and VRAM region: room for 64 MiB at odd offsets.
pub const REGION: usize = (64 << 20) + (1 << 20);

/// The backend under test, where a binary sets it (LIBFABRIC otherwise).
pub static BACKEND: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
/// How the target process learns the backend.
const BACKEND_ENV: &str = "NIXL_PEER_DRAM_BACKEND";
/// How the target process learns its `copy_engine` parameter (where a case sets one).
const ENGINE_ENV: &str = "NIXL_PEER_DRAM_ENGINE";

pub fn backend() -> &'static str {
    BACKEND.get().copied().unwrap_or("LIBFABRIC")
}

pub fn agent(name: &str, extra: &[(&str, &str)], config: AgentConfig) -> Agent {
    let mut p = params([]);
    for (k, v) in extra {
        p.insert(k.to_string(), v.to_string());
    }
    super::common::agent_with_backend(name, config, backend(), &p)
}

// ---- the target process ---------------------------------------------------------------

/// What a WRITE's notification asks the target to check: `count` blocks of `size`
/// bytes every `stride` from `offset` in its DRAM or VRAM, holding `pattern(seed, …)` at
/// the same offsets from the first block.
#[derive(Debug, Clone, Copy)]
pub struct Check {
    vram: bool,
    offset: usize,
    stride: usize,
    size: usize,
    count: usize,
    seed: u8,
    /// Block `i` lies in slot `shuffled(count, order)[i]` (0: in slot `i`).
    order: u64,
}

impl Check {
    pub fn message(&self) -> String {
        format!(
            "check {} {} {} {} {} {} {}",
            if self.vram { "v" } else { "d" },
            self.offset,
            self.stride,
            self.size,
            self.count,
            self.seed,
            self.order
        )
    }

    pub fn parse(text: &str) -> Option<Check> {
        let mut words = text.split(' ');
        if words.next()? != "check" {
            return None;
        }
        let vram = words.next()? == "v";
        let mut num = || words.next()?.parse::<usize>().ok();
        Some(Check {
            vram,
            offset: num()?,
            stride: num()?,
            size: num()?,
            count: num()?,
            seed: u8::try_from(num()?).ok()?,
            order: words.next()?.parse().ok()?,
        })
    }

    pub fn span(&self) -> usize {
        (self.count - 1) * self.stride + self.size
    }

    /// `ok`, or the first block that differs (block `i` of the source's pattern, in its
    /// slot).
    pub fn verify(&self, read: impl Fn(usize, usize) -> Vec<u8>) -> String {
        let got = read(self.offset, self.span());
        let want = pattern(self.seed, self.span());
        let slots = slots(self.count, self.order);
        for (i, &slot) in slots.iter().enumerate() {
            let at = slot * self.stride;
            if got[at..at + self.size] != want[i * self.stride..i * self.stride + self.size] {
                return format!("block {i} (slot {slot}) of {:?} differs", self);
            }
        }
        "ok".into()
    }
}

/// Slot of each of `n` blocks: `0..n` in a shuffled order from `order` (a fixed
/// xorshift Fisher-Yates, the same in both processes), or in order for 0.
pub fn slots(n: usize, order: u64) -> Vec<usize> {
    let mut slots: Vec<usize> = (0..n).collect();
    if order == 0 {
        return slots;
    }
    let mut x = order;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        slots.swap(i, (x % (i as u64 + 1)) as usize);
    }
    slots
}

/// How a case lays out its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// An odd gap between blocks on both sides: no two blocks are neighbours.
    Gapped,
    /// Neighbours on both sides (upstream nixlbench's batches, consecutive KV blocks):
    /// the planning merges them into large copies.
    Contiguous,
    /// The local blocks neighbours, each going to a slot of the target's neighbouring
    /// slots in a shuffled order (`slots(n, order)`: vLLM's random block ids).
    Scattered(u64),
}

impl Layout {
    /// Stride between slots of `size`-byte blocks, and the shuffle (0: none).
    fn shape(self, size: usize) -> (usize, u64) {
        match self {
            Layout::Gapped => (size + 1, 0),
            Layout::Contiguous => (size, 0),
            Layout::Scattered(order) => (size, order),
        }
    }
}

/// The target process, its announced addresses, killed when dropped.
pub struct Target {
    pub child: Child,
    path: PathBuf,
    pub addr: std::net::SocketAddr,
    dram: u64,
    vram: u64,
    gpu: usize,
}

impl Target {
    pub fn spawn(tag: &str, gpu: usize) -> Target {
        Self::spawn_with_engine(tag, gpu, None)
    }

    /// A target whose backend has parameter `copy_engine=engine` (the copies it serves).
    pub fn spawn_with_engine(tag: &str, gpu: usize, engine: Option<&str>) -> Target {
        let path = announce_path("nixl-peer-dram", tag);
        let mut cmd = self_test(TARGET_TEST, false);
        cmd.env("NIXL_PEER_DRAM", format!("{} {gpu}", path.display()));
        cmd.env(BACKEND_ENV, backend());
        if let Some(engine) = engine {
            cmd.env(ENGINE_ENV, engine);
        }
        let mut child = cmd.spawn().unwrap();
        let text = wait_file(&path, &mut child);
        let words: Vec<&str> = text.split(' ').collect();
        Target {
            addr: words[0].parse().unwrap(),
            dram: words[1].parse().unwrap(),
            vram: words[2].parse().unwrap(),
            child,
            path,
            gpu,
        }
    }

    /// `count` blocks of `size` every `stride` from `offset` in the target's memory.
    pub fn blocks(
        &self,
        kind: MemKind,
        offset: usize,
        stride: usize,
        size: usize,
        n: usize,
    ) -> DescList {
        self.blocks_in(kind, offset, stride, size, &slots(n, 0))
    }

    /// Blocks of `size` in the slots `slots` names (a slot every `stride` from `offset`).
    pub fn blocks_in(
        &self,
        kind: MemKind,
        offset: usize,
        stride: usize,
        size: usize,
        slots: &[usize],
    ) -> DescList {
        let (base, dev) = match kind {
            MemKind::Vram => (self.vram, self.gpu as u64),
            _ => (self.dram, 0),
        };
        DescList::from_descs(
            kind,
            slots
                .iter()
                .map(|&s| Desc::new(base + (offset + s * stride) as u64, size as u64, dev)),
        )
    }

    /// Says bye and waits for the verdict.
    pub fn finish(mut self, initiator: &Agent, name: &str) {
        initiator.gen_notif(name, b"bye").unwrap();
        assert!(self.child.wait().unwrap().success(), "the target failed");
        assert_eq!(
            std::fs::read_to_string(format!("{}.ok", self.path.display())).unwrap(),
            "PEER OK"
        );
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_file(format!("{}.ok", self.path.display()));
        super::common::remove_shm_of(self.child.id());
    }
}

// ---- the initiator's memory -----------------------------------------------------------

/// The initiator's DRAM and VRAM (source and read-back of each), registered.
pub struct Local {
    /// First: deregistered before the memory goes.
    _handles: Vec<RegistrationHandle>,
    gpu: Gpu,
    host_src: Vec<u8>,
    host_back: Vec<u8>,
    dev_src: DeviceBuffer,
    dev_back: DeviceBuffer,
}

impl Local {
    pub fn new(gpu: &Gpu, agent: &Agent) -> Local {
        let host_src = vec![0u8; REGION];
        let host_back = vec![0u8; REGION];
        let dev_src = device(gpu, REGION, &[]);
        let dev_back = device(gpu, REGION, &[]);
        let dev = gpu.ordinal() as u64;
        // SAFETY: the buffers are moved into `Local` beside the handles, which are
        // dropped first (heap and device memory do not move with their owners).
        let handles = unsafe {
            vec![
                agent
                    .register_mem(
                        &dram([Desc::from_slice(&host_src), Desc::from_slice(&host_back)]),
                        None,
                    )
                    .unwrap(),
                agent
                    .register_mem(
                        &vram([
                            Desc::new(dev_src.ptr(), REGION as u64, dev),
                            Desc::new(dev_back.ptr(), REGION as u64, dev),
                        ]),
                        None,
                    )
                    .unwrap(),
            ]
        };
        Local {
            _handles: handles,
            gpu: gpu.clone(),
            host_src,
            host_back,
            dev_src,
            dev_back,
        }
    }

    /// Fills the source of `kind` with `pattern(seed, span)` at `offset`.
    pub fn fill(&mut self, kind: MemKind, offset: usize, seed: u8, span: usize) {
        let bytes = pattern(seed, span);
        match kind {
            MemKind::Vram => self.dev_src.copy_from_host(offset, &bytes).unwrap(),
            _ => self.host_src[offset..offset + span].copy_from_slice(&bytes),
        }
    }

    /// Clears the read-back buffer of `kind`.
    pub fn clear_back(&mut self, kind: MemKind) {
        match kind {
            MemKind::Vram => self.dev_back.fill(0).unwrap(),
            _ => self.host_back.fill(0),
        }
    }

    pub fn back(&self, kind: MemKind) -> Vec<u8> {
        match kind {
            MemKind::Vram => self.dev_back.to_vec().unwrap(),
            _ => self.host_back.clone(),
        }
    }

    pub fn blocks(
        &self,
        kind: MemKind,
        back: bool,
        offset: usize,
        stride: usize,
        size: usize,
        n: usize,
    ) -> DescList {
        let (base, dev) = match (kind, back) {
            (MemKind::Vram, false) => (self.dev_src.ptr(), self.gpu.ordinal() as u64),
            (MemKind::Vram, true) => (self.dev_back.ptr(), self.gpu.ordinal() as u64),
            (_, false) => (self.host_src.as_ptr() as u64, 0),
            (_, true) => (self.host_back.as_ptr() as u64, 0),
        };
        DescList::from_descs(
            kind,
            (0..n).map(|i| Desc::new(base + (offset + i * stride) as u64, size as u64, dev)),
        )
    }
}

/// How the backend reaches `peer` and what its direct copies moved (`query_mem_info`
/// with `peer:<agent>`).
pub fn peer_copy_info(agent: &Agent, peer: &str) -> nixl::BackendParams {
    let meta = format!("peer:{peer}");
    agent
        .query_mem_info(backend(), MemKind::Vram, &[meta.as_bytes()])
        .unwrap()
        .remove(0)
        .expect("a loaded peer")
}

/// The steps of a direct request the backend times with `NIXL_PEER_COPY_TRACE=1` (in
/// both processes), in order: each reported as `peer_copy_trace_<step>_ns`, summed over
/// the posts of one request so far (`peer_copy_trace_count`).
pub const TRACE_STEPS: [&str; 9] = [
    "post_to_sent",
    "sent_to_target_read",
    "target_read_to_launched",
    "launched_to_complete",
    "complete_to_answer_sent",
    "answer_sent_to_read",
    "answer_read_to_notif_sent",
    "notif_sent_to_done",
    "post_to_done",
];

/// The timed posts so far and each step's summed nanoseconds ([`TRACE_STEPS`]), where
/// the backend traces (`NIXL_PEER_COPY_TRACE=1`).
pub fn trace_sums(agent: &Agent, peer: &str) -> Option<(u64, Vec<u64>)> {
    let info = peer_copy_info(agent, peer);
    let count = info.get("peer_copy_trace_count")?.parse().ok()?;
    let steps = TRACE_STEPS
        .iter()
        .map(|s| {
            info.get(&format!("peer_copy_trace_{s}_ns"))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        })
        .collect();
    Some((count, steps))
}

/// `REPORT` line of the mean time of each step of the posts timed between `before` and
/// now ([`trace_sums`]); nothing where the backend does not trace or no post of one
/// request ran (this side copied itself).
pub fn report_trace(
    test: &str,
    what: &str,
    agent: &Agent,
    peer: &str,
    before: &Option<(u64, Vec<u64>)>,
) {
    let (Some((n0, s0)), Some((n1, s1))) = (before, trace_sums(agent, peer)) else {
        return;
    };
    let posts = n1 - n0;
    if posts == 0 {
        return;
    }
    let means: Vec<String> = TRACE_STEPS
        .iter()
        .zip(s1.iter().zip(s0))
        .map(|(step, (after, before))| {
            format!("{step} {:.2}", (after - before) as f64 / posts as f64 / 1e3)
        })
        .collect();
    println!(
        "REPORT {test} {}: trace {what}, {posts} posts, mean us: {}",
        backend(),
        means.join(", ")
    );
}

/// `REPORT` line (on stderr itself: a target process's test output is captured) of the
/// mean of each step this process timed inside its handling of direct requests, over its
/// whole run (`peer_copy_step_*`, where the backend traces); nothing where none ran.
pub fn report_steps(side: &str, agent: &Agent, peer: &str) {
    use std::io::Write;
    let info = peer_copy_info(agent, peer);
    let mut steps = Vec::new();
    for (key, count) in &info {
        let Some(step) = key
            .strip_prefix("peer_copy_step_")
            .and_then(|k| k.strip_suffix("_count"))
        else {
            continue;
        };
        let count: u64 = count.parse().unwrap_or(0);
        let ns: u64 = info
            .get(&format!("peer_copy_step_{step}_ns"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if count > 0 {
            steps.push(format!(
                "{step} {:.2} ({count})",
                ns as f64 / count as f64 / 1e3
            ));
        }
    }
    if !steps.is_empty() {
        steps.sort();
        let _ = writeln!(
            std::io::stderr(),
            "REPORT {} {side} steps, mean us: {}",
            backend(),
            steps.join(", ")
        );
    }
}

/// Pinned device-to-host and host-to-device bandwidth (GB/s) of `len`-byte copies.
pub fn pinned_copy_rates(gpu: &Gpu, len: usize) -> (f64, f64) {
    let dev = device(gpu, len, &[]);
    let mut host = HostBuffer::alloc(gpu, len).unwrap();
    // About 512 MiB per direction, at least 8 copies.
    let rounds = ((512 << 20) / len).max(8);
    dev.copy_to_host(0, host.as_mut_slice()).unwrap();
    let start = Instant::now();
    for _ in 0..rounds {
        dev.copy_to_host(0, host.as_mut_slice()).unwrap();
    }
    let d2h = (len * rounds) as f64 / start.elapsed().as_secs_f64() / 1e9;
    let start = Instant::now();
    for _ in 0..rounds {
        dev.copy_from_host(0, host.as_slice()).unwrap();
    }
    let h2d = (len * rounds) as f64 / start.elapsed().as_secs_f64() / 1e9;
    (d2h, h2d)
}

/// One case: `n` blocks of `size`, local `local_kind` ↔ the target's `remote_kind`:
/// WRITE with a checked notification, READ back and compare. Returns the WRITE's and
/// READ's staged bytes.
#[allow(clippy::too_many_arguments)]
pub fn write_and_read(
    initiator: &Agent,
    name: &str,
    local: &mut Local,
    target: &Target,
    local_kind: MemKind,
    remote_kind: MemKind,
    size: usize,
    n: usize,
    seed: u8,
    checked_at_target: bool,
) -> (u64, u64) {
    write_and_read_in(
        Layout::Gapped,
        initiator,
        name,
        local,
        target,
        (local_kind, remote_kind),
        size,
        n,
        seed,
        checked_at_target,
    )
}

/// [`write_and_read`] with the blocks laid out as `layout` says (at odd offsets on
/// both sides).
#[allow(clippy::too_many_arguments)]
pub fn write_and_read_in(
    layout: Layout,
    initiator: &Agent,
    name: &str,
    local: &mut Local,
    target: &Target,
    (local_kind, remote_kind): (MemKind, MemKind),
    size: usize,
    n: usize,
    seed: u8,
    checked_at_target: bool,
) -> (u64, u64) {
    let tag = format!("{local_kind:?}->peer {remote_kind:?} {n} x {size} B, {layout:?}");
    let (local_off, remote_off) = (1, 3);
    let (stride, order) = layout.shape(size);
    let target_slots = slots(n, order);
    let span = (n - 1) * stride + size;
    local.fill(local_kind, local_off, seed, span);
    let check = Check {
        vram: remote_kind == MemKind::Vram,
        offset: remote_off,
        stride,
        size,
        count: n,
        seed,
        order,
    };
    let mut w = initiator
        .create_xfer_req(
            XferOp::Write,
            &local.blocks(local_kind, false, local_off, stride, size, n),
            &target.blocks_in(remote_kind, remote_off, stride, size, &target_slots),
            name,
            Some(check.message().into_bytes()),
        )
        .unwrap();
    w.post().unwrap();
    w.wait(TIMEOUT).unwrap();
    if checked_at_target {
        let verdict = super::common::wait_notif(initiator, "peer-dram-target");
        assert_eq!(String::from_utf8(verdict).unwrap(), "ok", "{tag}: WRITE");
    }
    local.clear_back(local_kind);
    let mut r = initiator
        .create_xfer_req(
            XferOp::Read,
            &local.blocks(local_kind, true, local_off, stride, size, n),
            &target.blocks_in(remote_kind, remote_off, stride, size, &target_slots),
            name,
            None,
        )
        .unwrap();
    r.post().unwrap();
    r.wait(TIMEOUT).unwrap();
    let got = local.back(local_kind);
    let want = pattern(seed, span);
    for i in 0..n {
        let at = local_off + i * stride;
        assert!(
            got[at..at + size] == want[i * stride..i * stride + size],
            "{tag}: READ block {i} differs"
        );
        // Nothing between blocks (gapped) or beside them.
        let gap = at + size..local_off + (i + 1) * stride;
        assert!(
            got[gap].iter().all(|&b| b == 0),
            "{tag}: READ wrote after block {i}"
        );
    }
    assert_eq!(
        got[local_off - 1],
        0,
        "{tag}: READ wrote before the first block"
    );
    assert_eq!(
        got[local_off + span],
        0,
        "{tag}: READ wrote after the last block"
    );
    (w.telemetry().staged_bytes, r.telemetry().staged_bytes)
}

/// Bandwidth (GB/s) of `rounds` posts of one `len`-byte block.
#[allow(clippy::too_many_arguments)]
pub fn rate(
    initiator: &Agent,
    name: &str,
    local: &Local,
    target: &Target,
    op: XferOp,
    local_kind: MemKind,
    remote_kind: MemKind,
    len: usize,
) -> f64 {
    rate_blocks(
        initiator,
        name,
        local,
        target,
        op,
        (local_kind, remote_kind),
        len,
        1,
    )
}

/// Bandwidth (GB/s) of posts of one request of `n` adjacent `len`-byte blocks.
#[allow(clippy::too_many_arguments)]
pub fn rate_blocks(
    initiator: &Agent,
    name: &str,
    local: &Local,
    target: &Target,
    op: XferOp,
    kinds: (MemKind, MemKind),
    len: usize,
    n: usize,
) -> f64 {
    rate_blocks_in(
        Layout::Contiguous,
        initiator,
        name,
        local,
        target,
        op,
        kinds,
        len,
        n,
    )
}

/// Bandwidth (GB/s) of posts of one request of `n` `len`-byte blocks laid out as
/// `layout` says.
#[allow(clippy::too_many_arguments)]
pub fn rate_blocks_in(
    layout: Layout,
    initiator: &Agent,
    name: &str,
    local: &Local,
    target: &Target,
    op: XferOp,
    (local_kind, remote_kind): (MemKind, MemKind),
    len: usize,
    n: usize,
) -> f64 {
    let (stride, order) = layout.shape(len);
    let mut req = initiator
        .create_xfer_req(
            op,
            &local.blocks(local_kind, false, 0, stride, len, n),
            &target.blocks_in(remote_kind, 0, stride, len, &slots(n, order)),
            name,
            None,
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    // As many bytes as the pinned copies it is compared with.
    let bytes = len * n;
    let rounds = ((512 << 20) / bytes).max(8);
    let start = Instant::now();
    for _ in 0..rounds {
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
    }
    (bytes * rounds) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Blocks per request of [`many_blocks`]: upstream nixlbench's GPUNETIO line's batch.
pub const MANY: usize = 512;

/// The shuffle of [`many_blocks`]' scattered layout.
const SCATTER: u64 = 0x9e37_79b9_7f4a_7c15;

/// VRAM ↔ peer DRAM in requests of [`MANY`] blocks of 4 KiB .. 128 KiB, the target
/// serving its copies with each of `engines` (`None`: its default): each engine's data
/// checked in every [`Layout`] (512 x 64 KiB WRITE checked at the target at its
/// notification, READ back; the contiguous blocks merge into large copies, the
/// scattered ones mostly do not), then bandwidth of contiguous and of scattered blocks
/// beside pinned copies of 64 MiB measured in the same run (no assertion: the ratios
/// are the report).
pub fn many_blocks(test: &str, gpu: &Gpu, engines: &[Option<&str>]) {
    let (d2h, h2d) = pinned_copy_rates(gpu, 64 << 20);
    println!(
        "REPORT {test} {}: pinned copy 64 MiB: D2H {d2h:.1} GB/s, H2D {h2d:.1} GB/s",
        backend()
    );
    let initiator = agent("peer-dram-initiator", &[], listening());
    let mut local = Local::new(gpu, &initiator);
    for (i, engine) in engines.iter().enumerate() {
        let target = Target::spawn_with_engine(&format!("{test}-{i}"), gpu.ordinal(), *engine);
        let name = initiator.fetch_remote_metadata(target.addr).unwrap();
        initiator.send_local_metadata(target.addr).unwrap();
        let layouts = [
            Layout::Gapped,
            Layout::Contiguous,
            Layout::Scattered(SCATTER),
        ];
        for (j, layout) in layouts.into_iter().enumerate() {
            let staged = write_and_read_in(
                layout,
                &initiator,
                &name,
                &mut local,
                &target,
                (MemKind::Vram, MemKind::Dram),
                64 << 10,
                MANY,
                (i as u8).wrapping_mul(29).wrapping_add(7 + j as u8),
                true,
            );
            assert_eq!(
                staged,
                (0, 0),
                "{MANY} x 64 KiB {layout:?}: the direct path"
            );
        }
        let engine = engine.unwrap_or("default");
        for layout in [Layout::Contiguous, Layout::Scattered(SCATTER)] {
            let shape = match layout {
                Layout::Contiguous => "contiguous",
                _ => "scattered",
            };
            for len in [4 << 10, 16 << 10, 64 << 10, 128 << 10] {
                for (op, pinned) in [(XferOp::Write, d2h), (XferOp::Read, h2d)] {
                    let gbs = rate_blocks_in(
                        layout,
                        &initiator,
                        &name,
                        &local,
                        &target,
                        op,
                        (MemKind::Vram, MemKind::Dram),
                        len,
                        MANY,
                    );
                    println!(
                        "REPORT {test} {}: copy_engine={engine} {op:?} Vram->peer Dram {MANY} x {:>3} KiB {shape}: {gbs:.1} GB/s, pinned {pinned:.1} GB/s ({:.2}x)",
                        backend(),
                        len >> 10,
                        gbs / pinned
                    );
                }
            }
        }
        let info = peer_copy_info(&initiator, &name);
        assert_eq!(info["peer_copy_fallbacks"], "0", "{info:?}");
        target.finish(&initiator, &name);
        initiator.invalidate_remote(&name).unwrap();
    }
}

pub const CASES: &[(usize, usize)] = &[
    (4096, 1),
    (4096, 64),
    (4097, 1),
    (4097, 64),
    ((1 << 20) + 3, 1),
    (1 << 20, 64),
    ((16 << 20) + 5, 1),
    (64 << 20, 1),
];

/// Every case both ways on `target_gpu` (the initiator's VRAM on GPU 0).
pub fn direct_both_ways(test: &str, gpus: &[Gpu], target_gpu: usize) {
    let initiator = agent("peer-dram-initiator", &[], listening());
    let mut local = Local::new(&gpus[0], &initiator);
    let target = Target::spawn(test, target_gpu);
    let name = initiator.fetch_remote_metadata(target.addr).unwrap();
    // The target checks requests against what this side advertised.
    initiator.send_local_metadata(target.addr).unwrap();
    let mut seed = 1u8;
    for &(local_kind, remote_kind) in &[
        (MemKind::Vram, MemKind::Dram),
        (MemKind::Dram, MemKind::Vram),
    ] {
        for &(size, n) in CASES {
            seed = seed.wrapping_add(17);
            let staged = write_and_read(
                &initiator,
                &name,
                &mut local,
                &target,
                local_kind,
                remote_kind,
                size,
                n,
                seed,
                true,
            );
            assert_eq!(
                staged,
                (0, 0),
                "{local_kind:?}->peer {remote_kind:?} {n} x {size}: the direct path"
            );
        }
    }
    // Every case ran directly: nothing fell back, and the bytes are counted (GPUNETIO's
    // DRAM -> peer VRAM runs on its intra-node path, not counted there).
    let info = peer_copy_info(&initiator, &name);
    assert_eq!(info["vram_peer_dram"], "direct", "{info:?}");
    assert_eq!(info["peer_copy_fallbacks"], "0", "{info:?}");
    if backend() == "GPUNETIO" {
        // Both processes share a pid namespace: requests ride the target's Unix socket.
        assert_eq!(info["peer_copy_local_control"], "1", "{info:?}");
    }
    // Once the target offered its shared lane (after the first request it served),
    // requests go through it.
    assert_ne!(info["peer_copy_lane_requests"], "0", "{info:?}");
    let directions = if backend() == "GPUNETIO" { 1 } else { 2 };
    let moved: u64 = CASES
        .iter()
        .map(|&(s, n)| directions * 2 * (s * n) as u64)
        .sum();
    assert!(
        info["peer_copy_bytes"].parse::<u64>().unwrap() >= moved,
        "{info:?}: every byte of the cases moved directly ({moved})"
    );
    // Bandwidth beside pinned copies of the same block size, measured now on this GPU
    // (no assertion: the ratios are the report).
    for len in [1 << 20, 4 << 20, 16 << 20, 64 << 20] {
        let (d2h, h2d) = pinned_copy_rates(&gpus[0], len);
        println!(
            "REPORT {test} {}: pinned copy {:>2} MiB: D2H {d2h:.1} GB/s, H2D {h2d:.1} GB/s",
            backend(),
            len >> 20
        );
        for (op, lk, rk, pinned) in [
            (XferOp::Write, MemKind::Vram, MemKind::Dram, d2h),
            (XferOp::Read, MemKind::Vram, MemKind::Dram, h2d),
            (XferOp::Write, MemKind::Dram, MemKind::Vram, h2d),
            (XferOp::Read, MemKind::Dram, MemKind::Vram, d2h),
        ] {
            let traced = trace_sums(&initiator, &name);
            let gbs = rate(&initiator, &name, &local, &target, op, lk, rk, len);
            report_trace(
                test,
                &format!("{op:?} {lk:?}->peer {rk:?} {:>3} MiB", len >> 20),
                &initiator,
                &name,
                &traced,
            );
            println!(
                "REPORT {test} {}: {op:?} {lk:?}->peer {rk:?} {:>3} MiB: {gbs:.1} GB/s, pinned {pinned:.1} GB/s ({:.2}x)",
                backend(),
                len >> 20,
                gbs / pinned
            );
        }
    }
    report_steps("initiator", &initiator, &name);
    target.finish(&initiator, &name);
}

/// The target: DRAM and VRAM (on the GPU its role names) registered, announced as
/// `metadata-address dram-base vram-base`; answers each `check …` notification with
/// `ok` or what differs, checked at the moment it arrives; ends at `bye`. Runs only when
/// re-executed with `NIXL_PEER_DRAM` (`announce-file gpu-ordinal`), as the test named
/// [`TARGET_TEST`] of the binary.
pub fn target_main() {
    let Ok(role) = std::env::var("NIXL_PEER_DRAM") else {
        return;
    };
    let (path, ordinal) = role.split_once(' ').unwrap();
    if let Ok(name) = std::env::var(BACKEND_ENV) {
        let name: &'static str = Box::leak(name.into_boxed_str());
        let _ = BACKEND.set(name);
    }
    let gpu = Gpu::open(ordinal.parse().unwrap()).unwrap();
    let engine = std::env::var(ENGINE_ENV).ok();
    let extra: Vec<(&str, &str)> = engine.iter().map(|e| ("copy_engine", e.as_str())).collect();
    let target = agent("peer-dram-target", &extra, listening());
    let host = vec![0u8; REGION];
    let dev = device(&gpu, REGION, &[]);
    // SAFETY: both buffers live until the process exits.
    let _hd = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&host)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _hv = unsafe {
        target
            .register_mem(
                &vram([Desc::new(dev.ptr(), REGION as u64, gpu.ordinal() as u64)]),
                None,
            )
            .unwrap()
    };
    announce(
        path,
        &format!(
            "{} {} {}",
            target.listen_addr().unwrap(),
            host.as_ptr() as u64,
            dev.ptr()
        ),
    );
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        assert!(Instant::now() < deadline, "the initiator never said bye");
        for (from, msgs) in target.wait_notifs(Duration::from_millis(100)) {
            for msg in msgs {
                let text = String::from_utf8(msg).unwrap();
                if text == "bye" {
                    report_steps("target", &target, &from);
                    std::fs::write(format!("{path}.ok"), "PEER OK").unwrap();
                    return;
                }
                // Read at arrival: the notification must follow the last byte.
                let verdict = match Check::parse(&text) {
                    Some(check) => check.verify(|off, len| {
                        if check.vram {
                            let mut out = vec![0u8; len];
                            dev.copy_to_host(off, &mut out).unwrap();
                            out
                        } else {
                            host[off..off + len].to_vec()
                        }
                    }),
                    None => format!("unknown message {text}"),
                };
                // The initiator's metadata may not be here (the fallback case): then
                // nothing can be answered, and the initiator reads back instead.
                let _ = target.gen_notif(&from, verdict.as_bytes());
            }
        }
    }
}
