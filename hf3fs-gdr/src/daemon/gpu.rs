//! The GPU staging pipeline of one worker: pinned host chunks filled from the file
//! (`O_DIRECT` where aligned: the chunks are page aligned), each copied to the device
//! with `cuMemcpyHtoDAsync` on the worker's stream while the worker reads the next
//! chunk into another slot. A slot is reused only after its copy's event completed; a
//! chunk counts as done only then, so a completion is posted after the data is in
//! device memory.

use super::io::{cache_serves, file_io, Chunk};
use super::logging::daemon_error;
use super::memory::MappedIov;
use super::stats::Stats;
use gpu_mem::cudarc::driver::sys::{self, CUevent, CUresult, CUstream};
use gpu_mem::{Gpu, HostBuffer};
use std::sync::atomic::Ordering;

fn ok(call: &str, r: CUresult) -> Result<(), String> {
    r.result().map_err(|e| format!("{call}: {e:?}"))
}

struct Slot {
    buf: HostBuffer,
    event: CUevent,
    /// The chunk whose copy the event tracks, and the bytes it moved.
    pending: Option<(Chunk, i64)>,
}

/// One worker's staging state for one GPU.
pub(crate) struct Staging {
    gpu: Gpu,
    stream: CUstream,
    slots: Vec<Slot>,
    next: usize,
    /// Bytes read before each device copy of a cached chunk (0: the whole chunk).
    copy_piece: u64,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("gpu", &self.gpu.ordinal())
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl Staging {
    pub(crate) fn new(
        gpu: Gpu,
        chunk_bytes: usize,
        slots: usize,
        copy_piece: usize,
    ) -> Result<Self, String> {
        gpu.bind().map_err(|e| e.to_string())?;
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the GPU's context is current.
        ok("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        let mut staging = Self {
            gpu: gpu.clone(),
            stream,
            slots: Vec::new(),
            next: 0,
            copy_piece: copy_piece as u64,
        };
        for _ in 0..slots.max(1) {
            let buf = HostBuffer::alloc(&gpu, chunk_bytes).map_err(|e| e.to_string())?;
            let mut event: CUevent = std::ptr::null_mut();
            // SAFETY: valid out-pointer; context current.
            ok("cuEventCreate", unsafe {
                sys::cuEventCreate(
                    &mut event,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            })?;
            staging.slots.push(Slot {
                buf,
                event,
                pending: None,
            });
        }
        Ok(staging)
    }

    pub(crate) fn has_pending(&self) -> bool {
        self.slots.iter().any(|s| s.pending.is_some())
    }

    /// Waits for a slot's copy and completes its chunk.
    fn retire(slot: &mut Slot, stats: Option<&Stats>) {
        if let Some((chunk, moved)) = slot.pending.take() {
            // SAFETY: the event was recorded on our stream after the copy.
            let synced = ok("cuEventSynchronize", unsafe {
                sys::cuEventSynchronize(slot.event)
            });
            match synced {
                Ok(()) => {
                    if let Some(stats) = stats {
                        stats
                            .gpu_bytes
                            .fetch_add(moved.max(0) as u64, Ordering::Relaxed);
                    }
                    chunk.finish(moved)
                }
                Err(e) => {
                    daemon_error!("copy for ring index {}: {e}", chunk.req.index);
                    chunk.finish(-(libc::EIO as i64))
                }
            }
        }
    }

    /// Completes the chunks whose copies already finished, without waiting: their
    /// completions go out now rather than when the slot is next reused (a client that
    /// keeps a fixed number of I/Os in flight refills sooner).
    fn retire_finished(&mut self, stats: &Stats) {
        for slot in &mut self.slots {
            if slot.pending.is_some()
                // SAFETY: an event of ours; a query does not wait.
                && unsafe { sys::cuEventQuery(slot.event) } == CUresult::CUDA_SUCCESS
            {
                Self::retire(slot, Some(stats));
            }
        }
    }

    /// Completes every chunk whose copy is in flight (counted in `stats` if given).
    pub(crate) fn flush(&mut self, stats: Option<&Stats>) {
        if self.gpu.bind().is_err() {
            daemon_error!("GPU {}: cannot bind its context", self.gpu.ordinal());
        }
        for slot in &mut self.slots {
            Self::retire(slot, stats);
        }
    }

    /// Runs one chunk of a GPU iov.
    pub(crate) fn run(&mut self, chunk: Chunk, stats: &Stats) {
        let MappedIov::Gpu { base, .. } = &*chunk.iov else {
            chunk.finish(-(libc::EINVAL as i64));
            return;
        };
        let dev_ptr = base + chunk.iov_offset;
        if let Err(e) = self.gpu.bind() {
            daemon_error!("GPU {}: {e}", self.gpu.ordinal());
            chunk.finish(-(libc::EIO as i64));
            return;
        }
        let i = self.next;
        self.next = (self.next + 1) % self.slots.len();
        let slot = &mut self.slots[i];
        Self::retire(slot, Some(stats));
        let len = chunk.len.min(slot.buf.len() as u64);
        let host = slot.buf.as_mut_ptr();
        if chunk.read {
            // Data the page cache holds is copied to the device piece by piece as it
            // is read (the device reads each piece while it is still in the CPU's
            // cache); `O_DIRECT` reads stay whole (fewer, larger device requests).
            let piece = match self.copy_piece {
                p if p > 0 && p < len && cache_serves(&chunk.file, chunk.file_offset, len) => p,
                _ => len,
            };
            let (mut done, mut failed) = (0u64, None);
            while done < len {
                let want = piece.min(len - done);
                // SAFETY: `host + done` has buf.len() - done >= want bytes, owned by this
                // worker.
                let got = unsafe {
                    file_io(
                        &chunk.file,
                        host.add(done as usize),
                        want,
                        chunk.file_offset + done,
                        true,
                        stats,
                    )
                };
                if got < 0 {
                    failed = Some(got);
                    break;
                }
                if got > 0 {
                    // SAFETY: `got` bytes of pinned memory to the same offset of the
                    // chunk's device range, inside the iov's mapping (checked by the ring
                    // thread); the slot is not reused before its event says every copy
                    // issued here finished.
                    let issued = ok("cuMemcpyHtoDAsync", unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            dev_ptr + done,
                            host.add(done as usize).cast(),
                            got as usize,
                            self.stream,
                        )
                    });
                    if let Err(e) = issued {
                        daemon_error!("GPU {}: {e}", self.gpu.ordinal());
                        failed = Some(-(libc::EIO as i64));
                        break;
                    }
                    done += got as u64;
                }
                if (got as u64) < want {
                    break; // end of file
                }
            }
            if done == 0 {
                // Nothing was handed to the device: done now.
                chunk.finish(failed.unwrap_or(0));
                return;
            }
            // SAFETY: event and stream are ours.
            let recorded = ok("cuEventRecord", unsafe {
                sys::cuEventRecord(slot.event, self.stream)
            });
            match recorded {
                // Even a failed chunk waits for the copies it issued before its slot is
                // reused or its completion says anything.
                Ok(()) => slot.pending = Some((chunk, failed.unwrap_or(done as i64))),
                Err(e) => {
                    daemon_error!("GPU {}: {e}", self.gpu.ordinal());
                    // The copies may still run: wait for the stream before the slot is
                    // reused.
                    // SAFETY: our stream.
                    let _ = unsafe { sys::cuStreamSynchronize(self.stream) };
                    chunk.finish(-(libc::EIO as i64));
                }
            }
            self.retire_finished(stats);
        } else {
            // SAFETY: device range inside the iov; `host` has `len` bytes; the stream is
            // synchronised before the bytes are used.
            let copied = ok("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.cast(), dev_ptr, len as usize, self.stream)
            })
            .and_then(|()| {
                // SAFETY: our stream.
                ok("cuStreamSynchronize", unsafe {
                    sys::cuStreamSynchronize(self.stream)
                })
            });
            if let Err(e) = copied {
                daemon_error!("GPU {}: {e}", self.gpu.ordinal());
                chunk.finish(-(libc::EIO as i64));
                return;
            }
            // SAFETY: `host` has `len` bytes just filled.
            let put = unsafe { file_io(&chunk.file, host, len, chunk.file_offset, false, stats) };
            if put > 0 {
                stats.gpu_bytes.fetch_add(put as u64, Ordering::Relaxed);
            }
            chunk.finish(put);
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.flush(None);
        for slot in &self.slots {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(slot.event) };
        }
        // SAFETY: created in `new`, destroyed once, after its work was synchronised.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.stream) };
    }
}
