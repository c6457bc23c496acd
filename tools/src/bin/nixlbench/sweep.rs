//! The measurement: every (block size, batch size) point, its threads, timings and the
//! consistency check, printed as nixlbench's table.

use crate::mem::{point_seed, Mem, TARGET_SEED};
use crate::options::{BlockLayout, Options};
use crate::progress::{Point, Progress};
use nixl::{Agent, Desc, DescList, MemKind, PostParams, XferOp};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tools::units::human_bytes;

#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) block_size: usize,
    pub(crate) batch_size: usize,
    pub(crate) gbps: f64,
    pub(crate) avg_lat_us: f64,
    pub(crate) prep: (f64, f64),
    pub(crate) post: (f64, f64),
    pub(crate) tx: (f64, f64),
}

pub(crate) fn avg_p99(mut samples: Vec<f64>) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort_by(f64::total_cmp);
    let avg = samples.iter().sum::<f64>() / samples.len() as f64;
    let p99 = samples[((samples.len() as f64 * 0.99).ceil() as usize).clamp(1, samples.len()) - 1];
    (avg, p99)
}

pub(crate) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

pub(crate) struct ThreadResult {
    /// Preparation times: one, or one per iteration with `--recreate_xfer`.
    pub(crate) prep: Vec<f64>,
    pub(crate) post: Vec<f64>,
    pub(crate) tx: Vec<f64>,
}

/// The other side of the transfers.
pub(crate) enum Peer<'a> {
    /// Another process: WRITE data is verified by the target on request.
    Remote {
        name: String,
        /// One thread at a time sends a check and reads the notifications for its answer.
        check_lock: Mutex<()>,
    },
    /// This agent (LOCAL): WRITE data is verified here.
    InProcess { name: String, mem: &'a Mem },
    /// This agent's files (FILE): READ sources are written and WRITE data is read back
    /// here, with plain file I/O outside the timed loop.
    #[cfg(feature = "file")]
    Files {
        name: String,
        files: &'a crate::storage::FileSet,
    },
}

impl Peer<'_> {
    pub(crate) fn name(&self) -> &str {
        match self {
            Self::Remote { name, .. } | Self::InProcess { name, .. } => name,
            #[cfg(feature = "file")]
            Self::Files { name, .. } => name,
        }
    }

    /// Descriptor `index` of thread `thread`'s batch of `batch` blocks, at `offset` of
    /// the buffers: the same offset of the target's memory, or (files) the block's
    /// place in the file set.
    #[allow(clippy::too_many_arguments)]
    fn remote_desc(
        &self,
        remote: RemoteMem,
        thread: usize,
        index: usize,
        batch: usize,
        offset: usize,
        block: usize,
    ) -> Desc {
        match self {
            #[cfg(feature = "file")]
            Self::Files { files, .. } => files.desc(thread * batch + index, block),
            _ => {
                let _ = (thread, index, batch);
                Desc::new(remote.addr + offset as u64, block as u64, remote.dev_id)
            }
        }
    }
}

/// Where the target's memory is: the region it registered.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemoteMem {
    pub(crate) kind: MemKind,
    pub(crate) addr: u64,
    /// Its length (files: 0, their blocks are placed by the file set).
    pub(crate) len: u64,
    pub(crate) dev_id: u64,
}

/// Timed iterations of a point of `block`-byte blocks: `--num_iter`, divided by
/// `--large_blk_iter_ftr` from 1 MiB (at least one).
pub(crate) fn timed_iterations(o: &Options, block: usize) -> usize {
    if block >= 1 << 20 {
        (o.num_iter / o.large_blk_iter_ftr).max(1)
    } else {
        o.num_iter
    }
}

/// Warm-up iterations of a point of `block`-byte blocks: `--warmup_iter`, divided by
/// `--large_blk_iter_ftr` from 1 MiB as the timed ones are (upstream's nixlbench divides
/// both; a full warm-up of 64 MiB x 512 blocks would double that point's time), and no
/// more than the timed iterations.
pub(crate) fn warmup_iterations(o: &Options, block: usize) -> usize {
    let warmup = if block >= 1 << 20 {
        o.warmup_iter / o.large_blk_iter_ftr
    } else {
        o.warmup_iter
    };
    warmup.min(timed_iterations(o, block))
}

/// One (block size, batch size) point: every thread moves `batch` blocks per request.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_point(
    agent: &Agent,
    peer: &Peer<'_>,
    local: &Mem,
    remote: RemoteMem,
    o: &Options,
    block: usize,
    batch: usize,
) -> Result<Row, String> {
    let per_thread = o.per_thread_bytes();
    let stride = if o.block_layout == BlockLayout::Spaced && batch * block * 2 <= per_thread {
        2 * block
    } else {
        block
    };
    let iters = timed_iterations(o, block);
    let seed = point_seed(block, batch);
    let results: Vec<Result<ThreadResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..o.num_threads)
            .map(|t| {
                s.spawn(move || -> Result<ThreadResult, String> {
                    let base = t * per_thread;
                    let offsets: Vec<usize> = (0..batch).map(|i| base + i * stride).collect();
                    let l = DescList::from_descs(
                        local.kind(),
                        offsets.iter().map(|&off| local.desc(off, block)),
                    );
                    let r = DescList::from_descs(
                        remote.kind,
                        offsets
                            .iter()
                            .enumerate()
                            .map(|(i, &off)| peer.remote_desc(remote, t, i, batch, off, block)),
                    );
                    let idx: Vec<usize> = (0..batch).collect();
                    // Both lists prepared and the request made, timed (the Prep columns).
                    let make = || -> Result<(nixl::XferReq, f64), String> {
                        let start = Instant::now();
                        let lh = agent.prep_xfer_dlist(None, &l).map_err(|e| e.to_string())?;
                        let rh = agent
                            .prep_xfer_dlist(Some(peer.name()), &r)
                            .map_err(|e| e.to_string())?;
                        let req = agent
                            .make_xfer_req(o.op, &lh, &idx, &rh, &idx, None, None)
                            .map_err(|e| e.to_string())?;
                        Ok((req, us(start.elapsed())))
                    };
                    let (mut req, first_prep) = make()?;
                    let mut prep = vec![first_prep];
                    if o.check_consistency {
                        for &off in &offsets {
                            match o.op {
                                XferOp::Write => local.fill_pattern(off, block, seed)?,
                                // The destination starts cleared: a READ that moved nothing fails.
                                XferOp::Read => local.clear(off, block)?,
                            }
                            // Files hold what a target's memory would at that offset.
                            #[cfg(feature = "file")]
                            if let (XferOp::Read, Peer::Files { files, .. }) = (o.op, peer) {
                                let g = t * batch + (off - base) / stride;
                                files.write_pattern(g, block, TARGET_SEED, off)?;
                            }
                        }
                    }
                    let timeout = Duration::from_secs(60);
                    for _ in 0..warmup_iterations(o, block) {
                        if o.recreate_xfer {
                            req = make()?.0;
                        }
                        req.post().map_err(|e| e.to_string())?;
                        req.wait(timeout).map_err(|e| e.to_string())?;
                    }
                    let mut post = Vec::with_capacity(iters);
                    let mut tx = Vec::with_capacity(iters);
                    for i in 0..iters {
                        // `--recreate_xfer`: every timed iteration has its own request (the
                        // first one made above serves the first).
                        if o.recreate_xfer && i > 0 {
                            let (fresh, time) = make()?;
                            req = fresh;
                            prep.push(time);
                        }
                        let start = Instant::now();
                        req.post().map_err(|e| e.to_string())?;
                        post.push(us(start.elapsed()));
                        req.wait(timeout).map_err(|e| e.to_string())?;
                        tx.push(us(start.elapsed()));
                    }
                    if o.check_consistency {
                        let check = Check {
                            thread: t,
                            id: format!("{block}-{batch}-{t}"),
                            seed,
                            block,
                            batch,
                            stride,
                            base,
                        };
                        verify(agent, peer, &mut req, local, o, &check).map_err(|e| {
                            format!(
                                "consistency check failed: block size {block}, batch {batch}: {e}"
                            )
                        })?;
                    }
                    Ok(ThreadResult { prep, post, tx })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a benchmark thread panicked".into()))
            })
            .collect()
    });
    let mut prep = Vec::new();
    let mut post = Vec::new();
    let mut tx = Vec::new();
    let mut wall = 0f64;
    for r in results {
        let r = r?;
        wall = wall.max(r.tx.iter().sum::<f64>());
        prep.extend(r.prep);
        post.extend(r.post);
        tx.extend(r.tx);
    }
    let bytes = (block * batch * iters * o.num_threads) as f64;
    Ok(Row {
        block_size: block,
        batch_size: batch,
        gbps: bytes / (wall / 1e6) / 1e9,
        avg_lat_us: wall / iters as f64,
        prep: avg_p99(prep),
        post: avg_p99(post),
        tx: avg_p99(tx),
    })
}

/// One thread's blocks of one point: `batch` blocks at `base + i * stride`.
pub(crate) struct Check {
    /// The thread (storage runs place its blocks by it).
    #[cfg_attr(not(feature = "file"), allow(dead_code))]
    pub(crate) thread: usize,
    pub(crate) id: String,
    pub(crate) seed: u64,
    pub(crate) block: usize,
    pub(crate) batch: usize,
    pub(crate) stride: usize,
    pub(crate) base: usize,
}

impl Check {
    pub(crate) fn offsets(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.batch).map(|i| self.base + i * self.stride)
    }
}

/// Verifies the destination of the point's transfers on the side that owns it.
/// READ: the initiator's blocks must hold the target's pattern. WRITE: the target's
/// blocks must hold the point's pattern — checked by the target itself (its own memory,
/// VRAM copied back to the host), asked through one more transfer whose notification
/// arrives only after the data; in one process, checked here.
pub(crate) fn verify(
    agent: &Agent,
    peer: &Peer<'_>,
    req: &mut nixl::XferReq,
    local: &Mem,
    o: &Options,
    c: &Check,
) -> Result<(), String> {
    match (o.op, peer) {
        (XferOp::Read, _) => c
            .offsets()
            .try_for_each(|off| local.check_pattern(off, c.block, TARGET_SEED)),
        (XferOp::Write, Peer::InProcess { mem, .. }) => c
            .offsets()
            .try_for_each(|off| mem.check_pattern(off, c.block, c.seed)),
        #[cfg(feature = "file")]
        (XferOp::Write, Peer::Files { files, .. }) => {
            c.offsets().enumerate().try_for_each(|(i, off)| {
                files.check_pattern(c.thread * c.batch + i, c.block, c.seed, off)
            })
        }
        (XferOp::Write, Peer::Remote { name, check_lock }) => {
            // A thread that failed while holding it left nothing half-done behind.
            let _one_at_a_time = check_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let msg = format!(
                "CHECK {} {} {} {} {} {}",
                c.id, c.seed, c.block, c.batch, c.stride, c.base
            );
            req.post_with(Some(msg.into_bytes()), &PostParams::default())
                .map_err(|e| format!("posting the checked transfer: {e}"))?;
            req.wait(Duration::from_secs(60))
                .map_err(|e| format!("the checked transfer: {e}"))?;
            let answer = wait_answer(agent, name, &c.id)?;
            if answer == "ok" {
                Ok(())
            } else {
                Err(format!("the target reports: {answer}"))
            }
        }
    }
}

/// The target's `CHECKED id …` answer (sleeping in [`Agent::wait_notifs`] until it
/// comes).
pub(crate) fn wait_answer(agent: &Agent, target: &str, id: &str) -> Result<String, String> {
    const BOUND: Duration = Duration::from_secs(60);
    let prefix = format!("CHECKED {id} ");
    let start = Instant::now();
    loop {
        let left = BOUND.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err("the target did not answer the check within 60 s".into());
        }
        let mut notifs: HashMap<String, Vec<Vec<u8>>> = agent.wait_notifs(left);
        if let Some(msgs) = notifs.remove(target) {
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg);
                if let Some(answer) = text.strip_prefix(&prefix) {
                    return Ok(answer.to_string());
                }
            }
        }
    }
}

pub(crate) fn sizes(start: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = start;
    while s <= max {
        v.push(s);
        match s.checked_mul(2) {
            Some(n) => s = n,
            None => break,
        }
    }
    v
}

pub(crate) fn describe_remote(r: RemoteMem) -> String {
    match r.kind {
        MemKind::Vram => format!("VRAM (GPU {})", r.dev_id),
        kind => format!("{kind:?}").to_ascii_uppercase(),
    }
}

/// Runs every (block, batch) point and prints nixlbench's table.
pub(crate) fn sweep(
    agent: &Agent,
    peer: &Peer<'_>,
    local: &Mem,
    remote: RemoteMem,
    o: &Options,
    header: &str,
) -> Result<Vec<Row>, String> {
    let points: Vec<(usize, usize)> = sizes(o.start_block_size, o.max_block_size)
        .into_iter()
        .flat_map(|b| {
            sizes(o.start_batch_size, o.max_batch_size)
                .into_iter()
                .map(move |n| (b, n))
        })
        .filter(|(b, n)| b.saturating_mul(*n) <= o.per_thread_bytes())
        .collect();
    if points.is_empty() {
        return Err("no block/batch size fits in --total_buffer_size / --num_threads".into());
    }
    if remote.kind != MemKind::File && remote.len < o.buffer_bytes() as u64 {
        return Err(format!(
            "the target registered {} and this run needs {}: start the target with the same \
             --total_buffer_size, --max_block_size, --max_batch_size and --num_threads",
            human_bytes(remote.len),
            human_bytes(o.buffer_bytes() as u64)
        ));
    }
    let mut progress = Progress::new(
        o.progress,
        points
            .iter()
            .map(|&(block, batch)| {
                let iters = timed_iterations(o, block);
                Point {
                    block,
                    batch,
                    iterations: iters + warmup_iterations(o, block),
                }
            })
            .collect(),
    );
    println!("{header}");
    println!("{}", "-".repeat(150));
    println!(
        "{:<18} {:<12} {:<14} {:<16} {:<14} {:<14} {:<14} {:<14} {:<14} {:<14}",
        "Block Size (B)",
        "Batch Size",
        "B/W (GB/Sec)",
        "Avg Lat. (us)",
        "Avg Prep (us)",
        "P99 Prep (us)",
        "Avg Post (us)",
        "P99 Post (us)",
        "Avg Tx (us)",
        "P99 Tx (us)"
    );
    println!("{}", "-".repeat(150));
    let mut rows = Vec::new();
    for (block, batch) in points {
        progress.start_point();
        let start = Instant::now();
        let row = run_point(agent, peer, local, remote, o, block, batch);
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                progress.finish();
                return Err(e);
            }
        };
        progress.finish_point(start.elapsed(), || {
            println!(
                "{:<18} {:<12} {:<14.6} {:<16.3} {:<14.3} {:<14.3} {:<14.3} {:<14.3} {:<14.3} {:<14.3}",
                row.block_size, row.batch_size, row.gbps, row.avg_lat_us, row.prep.0, row.prep.1,
                row.post.0, row.post.1, row.tx.0, row.tx.1
            )
        });
        rows.push(row);
    }
    progress.finish();
    if o.check_consistency {
        println!(
            "consistency check: every block verified ({})",
            match (o.op, peer) {
                (XferOp::Write, Peer::Remote { .. }) => "WRITE: by the target, in its own memory",
                (XferOp::Write, Peer::InProcess { .. }) => "WRITE: in the target buffer",
                #[cfg(feature = "file")]
                (XferOp::Write, Peer::Files { .. }) => "WRITE: read back from the files",
                (XferOp::Read, _) => "READ: in the initiator's memory",
            }
        );
    }
    Ok(rows)
}

pub(crate) fn remote_mem(agent: &Agent, target: &str) -> Result<RemoteMem, String> {
    // The first region the target advertised: it registers exactly one buffer.
    let md = agent.remote_regions(target).map_err(|e| e.to_string())?;
    md.first()
        .map(|r| RemoteMem {
            kind: r.kind,
            addr: r.desc.addr,
            len: r.desc.len,
            dev_id: r.desc.dev_id,
        })
        .ok_or_else(|| format!("target `{target}` registered no memory"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(line: &str) -> Options {
        let args: Vec<String> = line.split_whitespace().map(String::from).collect();
        crate::options::parse_args(&args).unwrap()
    }

    /// From 1 MiB both the timed and the warm-up iterations are divided by
    /// `--large_blk_iter_ftr`, as upstream divides them; a warm-up is never longer than
    /// the timed part.
    #[test]
    fn large_blocks_divide_timed_and_warmup_iterations() {
        let o = options("");
        let at = |block| (timed_iterations(&o, block), warmup_iterations(&o, block));
        assert_eq!(at(512 << 10), (1000, 100));
        assert_eq!(at(1 << 20), (62, 6));
        assert_eq!(at(64 << 20), (62, 6));
        let o = options("--num_iter 10 --warmup_iter 50 --large_blk_iter_ftr 4");
        let at = |block| (timed_iterations(&o, block), warmup_iterations(&o, block));
        assert_eq!(at(4096), (10, 10));
        assert_eq!(at(1 << 20), (2, 2));
    }
}
