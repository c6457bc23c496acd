//! The worker threads and their queue: each worker runs chunks, host iovs in place
//! (`file_io`), GPU iovs through its staging pipeline (`gpu.rs`).

use super::gpu::Staging;
use super::io::{file_io, Chunk};
use super::logging::daemon_error;
use super::memory::MappedIov;
use super::stats::Stats;
use parking_lot::{Condvar, Mutex};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What each worker is told (from [`super::DaemonConfig`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkerConfig {
    pub chunk_bytes: usize,
    pub slots: usize,
    pub copy_piece: usize,
    pub inject_delay: Duration,
}

/// The worker threads and their queue.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    queue: Mutex<VecDeque<Chunk>>,
    ready: Condvar,
}

impl Pool {
    pub(crate) fn push(&self, chunks: impl IntoIterator<Item = Chunk>) {
        let mut q = self.queue.lock();
        let before = q.len();
        q.extend(chunks);
        let added = q.len() - before;
        drop(q);
        if added == 1 {
            self.ready.notify_one();
        } else if added > 1 {
            self.ready.notify_all();
        }
    }

    /// A worker's loop: runs chunks; when the queue is empty, first finishes the device
    /// copies it left in flight, then sleeps.
    pub(crate) fn work(self: Arc<Self>, config: WorkerConfig, stats: Arc<Stats>) {
        let WorkerConfig {
            chunk_bytes,
            slots,
            copy_piece,
            inject_delay,
        } = config;
        let mut staging: HashMap<usize, Staging> = HashMap::new();
        loop {
            let next = {
                let mut q = self.queue.lock();
                loop {
                    if let Some(c) = q.pop_front() {
                        break Some(c);
                    }
                    if staging.values().any(Staging::has_pending) {
                        break None;
                    }
                    self.ready.wait(&mut q);
                }
            };
            let Some(chunk) = next else {
                staging.values_mut().for_each(|s| s.flush(Some(&stats)));
                continue;
            };
            if chunk.file.slow && !inject_delay.is_zero() {
                let start = Instant::now();
                while start.elapsed() < inject_delay && !chunk.req.ring.cancelled() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            if chunk.req.ring.cancelled() {
                chunk.finish(-(libc::ECANCELED as i64));
                continue;
            }
            match &*chunk.iov {
                MappedIov::Host { shm } => {
                    // SAFETY: the ring thread checked iov_offset + len against the
                    // mapping, which the chunk keeps alive.
                    let ptr = unsafe { shm.as_ptr().add(chunk.iov_offset as usize) };
                    // SAFETY: `ptr..ptr+len` is inside the mapping (above).
                    let result = unsafe {
                        file_io(
                            &chunk.file,
                            ptr,
                            chunk.len,
                            chunk.file_offset,
                            chunk.read,
                            &stats,
                        )
                    };
                    if result > 0 {
                        stats.host_bytes.fetch_add(result as u64, Ordering::Relaxed);
                    }
                    chunk.finish(result);
                }
                MappedIov::Gpu { gpu, .. } => {
                    let device = gpu.ordinal();
                    let stage = match staging.entry(device) {
                        Entry::Occupied(e) => e.into_mut(),
                        Entry::Vacant(e) => {
                            match Staging::new(gpu.clone(), chunk_bytes, slots, copy_piece) {
                                Ok(s) => e.insert(s),
                                Err(err) => {
                                    daemon_error!("staging on GPU {device}: {err}");
                                    chunk.finish(-(libc::ENOMEM as i64));
                                    continue;
                                }
                            }
                        }
                    };
                    stage.run(chunk, &stats);
                }
            }
        }
    }
}
