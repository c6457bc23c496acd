//! NIXL's telemetry ring file, written by an agent whose telemetry is on and
//! `NIXL_TELEMETRY_DIR` set (NIXL's built-in `BUFFER` exporter), so that NIXL's readers
//! (`examples/python/telemetry_reader.py`, `examples/cpp/telemetry_reader.cpp`) read ours.
//!
//! The file is NIXL's `sharedRingBuffer<nixlTelemetryEvent>` (telemetry version 4), in
//! the machine's byte order: a 40-byte header
//! `{write_pos: usize, read_pos: usize, version: i32, expected_version: i32,
//! capacity: usize, mask: usize}` and then `capacity` 16-byte events
//! `{event_type: u32, 4 bytes of padding, value: u64}`. The agent is the one producer
//! (its pushes are serialised by a lock); readers in other processes consume by
//! advancing `read_pos`. A full ring drops the new event, as NIXL's does. The positions
//! are atomics in the shared mapping: an event is written before `write_pos` is
//! published with release ordering, and `read_pos` is read with acquire ordering, the
//! protocol NIXL's C++ reader follows.

use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// The ring's header, at offset 0 of the file (NIXL's `bufferHeader`).
#[repr(C)]
struct Header {
    write_pos: AtomicUsize,
    read_pos: AtomicUsize,
    version: AtomicI32,
    expected_version: i32,
    capacity: usize,
    mask: usize,
}

/// One event (NIXL's `nixlTelemetryEvent`: a `uint32_t` enum, then a `uint64_t`).
#[repr(C)]
#[derive(Clone, Copy)]
struct Event {
    event_type: u32,
    padding: u32,
    value: u64,
}

// NIXL's readers hard-code these sizes (ctypes structs with `_pack_ = 1`).
const _: () = assert!(std::mem::size_of::<Header>() == 40);
const _: () = assert!(std::mem::size_of::<Event>() == 16);
const _: () = assert!(std::mem::align_of::<Event>() <= 8);

/// The file mapped read-write and shared; unmapped on drop.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: the mapping is plain memory owned by this value (no thread affinity); every
// access goes through `TelemetryRing`'s mutex, and other processes only touch it through
// the atomic positions.
unsafe impl Send for Mapping {}

impl Mapping {
    fn header(&self) -> &Header {
        // SAFETY: `base` is page-aligned, maps at least `size_of::<Header>()` bytes and was
        // initialised with a `Header` in `TelemetryRing::new`; it lives as long as `self`.
        unsafe { self.base.cast::<Header>().as_ref() }
    }

    /// Appends one event; false when the ring is full (the event is dropped).
    fn push(&self, event: Event) -> bool {
        let header = self.header();
        let write = header.write_pos.load(Ordering::Relaxed);
        let next = (write + 1) & header.mask;
        if next == header.read_pos.load(Ordering::Acquire) {
            return false;
        }
        // A reader may have corrupted write_pos: never write outside the ring.
        if write >= self.capacity {
            return false;
        }
        // SAFETY: `write < capacity`, so the slot lies inside the mapping (the events
        // follow the header); readers do not read it until `write_pos` moves past it.
        unsafe {
            self.base
                .as_ptr()
                .add(std::mem::size_of::<Header>())
                .cast::<Event>()
                .add(write)
                .write(event);
        }
        header.write_pos.store(next, Ordering::Release);
        true
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly what mmap returned; nothing refers to the
        // mapping after this value is gone.
        unsafe {
            if libc::msync(self.base.as_ptr().cast(), self.len, libc::MS_SYNC) != 0 {
                tracing::warn!(
                    "telemetry ring: msync failed: {}",
                    std::io::Error::last_os_error()
                );
            }
            if libc::munmap(self.base.as_ptr().cast(), self.len) != 0 {
                tracing::warn!(
                    "telemetry ring: munmap failed: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

/// An agent's telemetry ring file (NIXL's `BUFFER` exporter's format).
#[pyclass(module = "rdma_nixl._core", frozen)]
pub struct TelemetryRing {
    map: Mutex<Option<Mapping>>,
    path: String,
    capacity: usize,
}

impl std::fmt::Debug for TelemetryRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelemetryRing")
            .field("path", &self.path)
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[pymethods]
impl TelemetryRing {
    /// Creates (or recreates, emptied) the ring file at `path` with room for `capacity`
    /// events (a power of two, as NIXL requires) and stamps it with `version`.
    #[new]
    fn new(path: String, capacity: usize, version: i32) -> PyResult<Self> {
        if !capacity.is_power_of_two() {
            return Err(PyValueError::new_err(format!(
                "Telemetry buffer size must be a power of 2 (got {capacity})"
            )));
        }
        let len = capacity
            .checked_mul(std::mem::size_of::<Event>())
            .and_then(|n| n.checked_add(std::mem::size_of::<Header>()))
            .ok_or_else(|| {
                PyValueError::new_err(format!("telemetry buffer size {capacity} is too large"))
            })?;
        // NIXL creates the file rw-r--r--.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&path)?;
        file.set_len(len as u64)?;
        // SAFETY: a fresh shared read-write mapping of the whole file (`len` bytes, just
        // sized); the kernel picks the address.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        let base = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| PyValueError::new_err("mmap returned a null mapping"))?;
        let header = Header {
            write_pos: AtomicUsize::new(0),
            read_pos: AtomicUsize::new(0),
            version: AtomicI32::new(0),
            expected_version: version,
            capacity,
            mask: capacity - 1,
        };
        // SAFETY: the mapping is page-aligned and at least a header long; no reader can
        // trust it before `version` is published below.
        unsafe { base.cast::<Header>().as_ptr().write(header) };
        let map = Mapping {
            base,
            len,
            capacity,
        };
        map.header().version.store(version, Ordering::Release);
        Ok(Self {
            map: Mutex::new(Some(map)),
            path,
            capacity,
        })
    }

    /// Appends one event; false when the ring is full or closed (the event is dropped).
    fn push(&self, event_type: u32, value: u64) -> bool {
        self.map.lock().as_ref().is_some_and(|m| {
            m.push(Event {
                event_type,
                padding: 0,
                value,
            })
        })
    }

    /// Appends events in order; returns how many fit (the rest are dropped).
    fn push_many(&self, events: Vec<(u32, u64)>) -> usize {
        let guard = self.map.lock();
        let Some(map) = guard.as_ref() else { return 0 };
        let mut pushed = 0;
        for (event_type, value) in events {
            pushed += usize::from(map.push(Event {
                event_type,
                padding: 0,
                value,
            }));
        }
        pushed
    }

    /// Events written and not yet consumed by a reader.
    fn __len__(&self) -> usize {
        self.map.lock().as_ref().map_or(0, |m| {
            let h = m.header();
            h.write_pos
                .load(Ordering::Acquire)
                .wrapping_sub(h.read_pos.load(Ordering::Acquire))
                & h.mask
        })
    }

    /// Unmaps the file (flushing it); later pushes drop their events. Idempotent.
    fn close(&self) {
        drop(self.map.lock().take());
    }

    /// The file's path.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// Events the ring holds (one slot always stays free, as in NIXL's).
    #[getter]
    fn capacity(&self) -> usize {
        self.capacity
    }
}
