//! The `CpuProxy` NIC handler: GPU kernels (or host threads) write work into a ring in
//! host-mapped memory, and a CPU proxy posts it on any transport this stack speaks — a
//! libfabric RDM endpoint ([`FabricTransport`]) or an ibverbs RC queue pair
//! ([`VerbsTransport`]) — reporting completions back into the ring (DOCA GPUNetIO's
//! `DOCA_GPUNETIO_VERBS_NIC_HANDLER_CPU_PROXY`).
//!
//! - [`RingMemory`]: the ring (`gio_ring_entry` slots, `gio_ring_ctrl`, counters, the
//!   producers' state), in mapped pinned memory for a GPU ([`RingMemory::cuda`]) or plain
//!   host memory for host producers and tests ([`RingMemory::host`]).
//! - [`HostProducer`]: the device library's producer protocol on the host.
//! - [`CpuProxy`]: the memory table (local regions, the peer's regions from their
//!   [`RemoteDescriptor`]s), connection ([`CpuProxy::local_info`] /
//!   [`CpuProxy::connect`]), progress by a proxy thread ([`CpuProxy::start`]) or by the
//!   caller ([`CpuProxy::cpu_proxy_progress`], DOCA's `doca_gpu_verbs_cpu_proxy_progress`),
//!   and export to a kernel argument ([`CpuProxy::export`]).
//!
//! # Device memory
//! Local device memory is registered with the transport where it can be (ibverbs
//! DMA-BUF, libfabric `FI_HMEM`); otherwise the proxy *stages* it through pinned bounce
//! buffers: a put copies the chunk device → host (`cuMemcpyDtoH`, synchronous, on the
//! proxy thread) before posting it, a get copies host → device after the chunk's read
//! completes. The cost is one extra PCIe crossing per byte plus a blocking copy per chunk
//! (tens of microseconds of proxy time per 256 KiB chunk), and at most
//! `staging_slots × staging_chunk` bytes in flight. The peer's device memory must be
//! registrable by the peer's transport: a staged region has no [`RemoteDescriptor`]
//! ([`Error::Unsupported`]).
//!
//! # Throughput and latency
//! Each round the proxy takes every published entry (a warp's 32 at once), posts them
//! with `FI_MORE` while more follow, and retires the completed prefix with one store of
//! `ctrl.completed` and one add per counter. Over a write-ordered transport
//! ([`FabricTransport::new_ordered`], granted by shm) a batch asks for one completion and
//! a put's signal follows its data at once instead of after its completion. A target
//! whose peer writes into it over a manual-progress provider must keep progressing its
//! endpoint: run its proxy thread, with [`CpuProxyBuilder::busy_poll`] for rate.
//! [`CpuProxyBuilder::busy_poll`], [`CpuProxyBuilder::pin_to_cpu`] and
//! [`CpuProxyBuilder::idle_poll_rounds`] trade a core for the time a GPU post waits
//! before the proxy sees it.
//!
//! A kernel's post costs no system-scope fence: the entry goes out as an image whose
//! every 8-byte word carries the ring lap's phase (`gio_entry_encode`), and the proxy
//! takes it only once all eight words landed; the data the entry moves is ordered by a
//! GPU-scope fence (device memory; system scope for host regions). A kernel's wait
//! reads `ctrl.completed` with acquire loads, the first one
//! [`CpuProxyBuilder::first_poll_delay`] after the post: a read of host memory is a
//! PCIe round trip returning what memory held when it arrived, so a read issued at once
//! comes back stale and the answer costs a second round trip. `gpu_proxy_rtt` prints the
//! post and round-trip latencies and bounds post → proxy sees it (figures measured on an
//! H100: `docs/BENCHMARKS.md` in the repository, "gpunetio: CPU proxy").
//!
//! ```no_run
//! # #[cfg(feature = "fabric")] fn main() -> gpunetio::Result<()> {
//! use gpunetio::proxy::{CpuProxy, Entry, FabricTransport, HostProducer, RingMemory};
//! use std::time::Duration;
//! let ring = RingMemory::host(64, 1)?;
//! let proxy = CpuProxy::new(FabricTransport::new("shm")?, &ring)?;
//! # let peer_info = proxy.local_info()?; let peer_desc = [0u8; 32];
//! proxy.connect(&peer_info)?;                       // the peer's blob, out of band
//! let mut src = vec![7u8; 4096];
//! // SAFETY: `src` outlives the proxy.
//! let local = unsafe { proxy.register_local(src.as_mut_ptr(), src.len())? };
//! let remote = proxy.add_remote(&gpunetio::proxy::RemoteDescriptor::from_bytes(&peer_desc)?)?;
//! proxy.start()?;
//! let producer = HostProducer::new(&ring, Duration::from_secs(5))?;
//! let t = producer.post(&Entry::put(remote, 0, local, 0, 4096))?;
//! producer.wait(t)?;
//! # Ok(()) }
//! # #[cfg(not(feature = "fabric"))] fn main() {}
//! ```

#[cfg(feature = "fabric")]
mod fabric;
mod progress;
mod ring;
mod table;
mod transport;
#[cfg(feature = "verbs")]
mod verbs;

#[cfg(feature = "fabric")]
pub use self::fabric::FabricTransport;
pub use crate::status::GioStatus;
pub use ring::{Entry, HostProducer, RingDevicePtrs, RingMemory, MAX_RING_SIZE};
#[doc(hidden)]
pub use table::fuzz_ring_entry;
pub use table::{DeviceCopy, DeviceRange, MAX_REGIONS};
pub use transport::{
    PostFlags, Posted, RemoteDescriptor, Transport, TransportCompletion, TransportFailure,
    TransportKind, WorkRequest,
};
#[cfg(feature = "verbs")]
pub use verbs::VerbsTransport;

use crate::error::{Error, Result};
use gpu_mem::{DeviceBuffer, Gpu, HostBuffer};
use gpunetio_sys as ffi;
use parking_lot::{Mutex, MutexGuard};
use progress::{Engine, Staging};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use table::{Local, Region};

/// [`CpuProxyBuilder::first_poll_delay`]'s default.
pub const DEFAULT_FIRST_POLL: Duration = Duration::from_nanos(350);

/// Options of a [`CpuProxy`].
#[derive(Debug, Clone)]
pub struct CpuProxyBuilder {
    staging_chunk: usize,
    staging_slots: usize,
    timeout: Duration,
    gpu: Option<Gpu>,
    busy_poll: bool,
    cpu: Option<usize>,
    idle_poll_rounds: u32,
    index_floor: u32,
    first_poll: Duration,
}

impl Default for CpuProxyBuilder {
    fn default() -> Self {
        Self {
            staging_chunk: 256 << 10,
            staging_slots: 16,
            timeout: Duration::from_secs(10),
            gpu: None,
            busy_poll: false,
            cpu: None,
            idle_poll_rounds: progress::IDLE_TRANSPORT_POLL,
            index_floor: 0,
            first_poll: DEFAULT_FIRST_POLL,
        }
    }
}

impl CpuProxyBuilder {
    /// Default options: 16 bounce buffers of 256 KiB, a 10 s device-side timeout, no GPU.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps table indices below `n` for regions placed at an index of the caller's
    /// choice ([`CpuProxy::register_local_at`], [`CpuProxy::register_device_range`]):
    /// everything else is added at `n` or above. Several proxies can then give the same
    /// local region the same index, so one device-side descriptor serves them all.
    pub fn reserve_indices(mut self, n: u32) -> Self {
        self.index_floor = n;
        self
    }

    /// Bytes per bounce buffer of staged device memory (default 256 KiB).
    pub fn staging_chunk(mut self, bytes: usize) -> Self {
        self.staging_chunk = bytes.max(64);
        self
    }

    /// Bounce buffers (default 16): staged bytes in flight are at most slots × chunk.
    pub fn staging_slots(mut self, slots: usize) -> Self {
        self.staging_slots = slots.clamp(1, (1 << 19) - 1);
        self
    }

    /// The bound on every device-side wait (`gio_dev_qp.timeout_ns`; zero: none).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The GPU whose memory is staged (bounce buffers are then pinned, so the copies run
    /// at full speed) and which [`CpuProxy::export`] exports to.
    pub fn gpu(mut self, gpu: &Gpu) -> Self {
        self.gpu = Some(gpu.clone());
        self
    }

    /// The proxy thread never yields or sleeps (default: it spins while there is work,
    /// then yields, then sleeps 50 µs between rounds). A target whose peer writes into
    /// it over a manual-progress provider (`shm`, `tcp;ofi_rxm`) sees no work of its
    /// own, yet serves the peer only when it polls: busy polling keeps that served
    /// within a round, and a GPU post is seen within a round however long the ring was
    /// idle. Costs one core.
    pub fn busy_poll(mut self, on: bool) -> Self {
        self.busy_poll = on;
        self
    }

    /// Pins the proxy thread to CPU `cpu` (`sched_setaffinity`) when it starts; a
    /// failure is the thread's first error ([`CpuProxy::take_error`]).
    pub fn pin_to_cpu(mut self, cpu: usize) -> Self {
        self.cpu = Some(cpu);
        self
    }

    /// With nothing in flight, poll the transport every `rounds` rounds (default 16;
    /// at least 1). A round without a transport poll is a few loads of the ring, one
    /// with it a provider progress call (microseconds with syscalls, as `tcp;ofi_rxm`
    /// makes): more rounds between polls let an idle proxy see a GPU post sooner, fewer
    /// serve a peer's operations on a manual-progress provider sooner.
    pub fn idle_poll_rounds(mut self, rounds: u32) -> Self {
        self.idle_poll_rounds = rounds.max(1);
        self
    }

    /// How long after a post a kernel's `gio::wait` issues its first read of the
    /// completion count (`gio_dev_qp.first_poll_ns`; zero: at once). A read of host
    /// memory takes a PCIe round trip and returns what memory held when it arrived:
    /// issued at once, it arrives before the proxy answered and the answer is seen a
    /// round trip later. Default 350 ns, just past the delay after which a busy proxy's
    /// answer to a NOP was found there (see `docs/BENCHMARKS.md` in the repository).
    pub fn first_poll_delay(mut self, delay: Duration) -> Self {
        self.first_poll = delay;
        self
    }

    /// A proxy over `transport` consuming `ring`. Progress is the caller's
    /// ([`CpuProxy::cpu_proxy_progress`]) until [`CpuProxy::start`].
    pub fn build<T: Transport>(self, transport: T, ring: &Arc<RingMemory>) -> Result<CpuProxy<T>> {
        let mut engine = Engine::new(ring.clone(), transport)?;
        engine.idle_poll_rounds = self.idle_poll_rounds;
        Ok(CpuProxy {
            shared: Arc::new(Shared {
                engine: Mutex::new(engine),
                stop: AtomicBool::new(false),
                thread_error: Mutex::new(None),
            }),
            ring: ring.clone(),
            thread: Mutex::new(None),
            options: self,
        })
    }
}

struct Shared<T: Transport> {
    engine: Mutex<Engine<T>>,
    stop: AtomicBool,
    /// The first failure the proxy thread saw.
    thread_error: Mutex<Option<Error>>,
}

/// A CPU proxy queue pair: a ring, a transport, a memory table.
pub struct CpuProxy<T: Transport> {
    shared: Arc<Shared<T>>,
    ring: Arc<RingMemory>,
    thread: Mutex<Option<JoinHandle<()>>>,
    options: CpuProxyBuilder,
}

impl<T: Transport> std::fmt::Debug for CpuProxy<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuProxy")
            .field("ring", &self.ring)
            .field("thread", &self.is_running())
            .finish()
    }
}

/// How long the proxy thread spins on an idle ring before it starts yielding, and
/// yields before it sleeps: a busy ring is served within a poll, an idle one costs
/// little CPU.
const SPIN_ROUNDS: u32 = u32::MAX - 1;
const YIELD_ROUNDS: u32 = 4000;
const IDLE_SLEEP: Duration = Duration::from_micros(50);

impl<T: Transport> CpuProxy<T> {
    /// A proxy with default options over `transport` consuming `ring`
    /// ([`CpuProxyBuilder`] for the options).
    pub fn new(transport: T, ring: &Arc<RingMemory>) -> Result<Self> {
        CpuProxyBuilder::new().build(transport, ring)
    }

    fn engine(&self) -> MutexGuard<'_, Engine<T>> {
        self.shared.engine.lock()
    }

    /// The ring.
    pub fn ring(&self) -> &Arc<RingMemory> {
        &self.ring
    }

    /// Runs `f` on the transport (its endpoint or queue pair), with the proxy paused.
    pub fn with_transport<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        f(&mut self.engine().transport)
    }

    /// The blob the peer passes to its [`connect`](Self::connect).
    pub fn local_info(&self) -> Result<Vec<u8>> {
        self.engine().transport.local_info()
    }

    /// Connects to the peer whose [`local_info`](Self::local_info) this is.
    pub fn connect(&self, peer_info: &[u8]) -> Result<()> {
        self.engine().transport.connect(peer_info)
    }

    /// Registers local host memory; returns its index in the memory table.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must stay allocated until the proxy is dropped; while the ring
    /// uses it, the transport reads and writes it at any time (synchronise through
    /// completions, counters and signals).
    pub unsafe fn register_local(&self, ptr: *mut u8, len: usize) -> Result<u32> {
        // SAFETY: forwarded contract.
        unsafe { self.place_host(None, ptr, len) }
    }

    /// Registers host memory at table index `at` (vacant, or past the end), else the
    /// next free one.
    ///
    /// # Safety
    /// As [`register_local`](Self::register_local).
    unsafe fn place_host(&self, at: Option<u32>, ptr: *mut u8, len: usize) -> Result<u32> {
        if ptr.is_null() || len == 0 {
            return Err(Error::InvalidArgument("a null or empty region".into()));
        }
        let mut engine = self.engine();
        // SAFETY: forwarded contract.
        let reg = unsafe { engine.transport.register_host(ptr, len) }?;
        let region = Region::Local(Local::Direct {
            reg,
            host: true,
            addr: ptr as u64,
            len: len as u64,
            dev_addr: 0,
            _keep: None,
        });
        match at {
            Some(index) => engine.table.place(index, region).map(|()| index),
            None => engine.table.push_from(self.options.index_floor, region),
        }
    }

    /// Registers a pinned, mapped host buffer: the GPU addresses it through its device
    /// pointer, the transport through its host address.
    pub fn register_host_buffer(&self, buf: &Arc<HostBuffer>) -> Result<u32> {
        let dev_addr = buf.device_ptr().unwrap_or(0);
        let mut engine = self.engine();
        // SAFETY: the buffer is kept alive by the table entry below.
        let reg = unsafe {
            engine
                .transport
                .register_host(buf.as_ptr().cast_mut(), buf.len())
        }?;
        engine.table.push_from(
            self.options.index_floor,
            Region::Local(Local::Direct {
                reg,
                host: true,
                addr: buf.as_ptr() as u64,
                len: buf.len() as u64,
                dev_addr,
                _keep: Some(buf.clone()),
            }),
        )
    }

    /// Registers device memory: directly where the transport can register it, else
    /// staged through bounce buffers (see the module docs for the cost). Returns the
    /// index and whether it is staged.
    pub fn register_device(&self, buf: &Arc<DeviceBuffer>) -> Result<(u32, bool)> {
        let mut engine = self.engine();
        match engine.transport.register_device(buf) {
            Ok(reg) => {
                let index = engine.table.push_from(
                    self.options.index_floor,
                    Region::Local(Local::Direct {
                        reg,
                        host: false,
                        addr: buf.ptr(),
                        len: buf.len() as u64,
                        dev_addr: buf.ptr(),
                        _keep: Some(buf.clone()),
                    }),
                )?;
                Ok((index, false))
            }
            Err(Error::Unsupported(why)) => {
                tracing::debug!("proxy: staging device memory: {why}");
                drop(engine);
                let mem = DeviceRange::of_buffer(buf.clone())?;
                Ok((self.register_staged(Arc::new(mem))?, true))
            }
            Err(e) => Err(e),
        }
    }

    /// Registers memory the proxy reaches only by copies (staged through bounce
    /// buffers): a local source of puts and destination of gets, never a peer's target.
    pub fn register_staged(&self, mem: Arc<dyn DeviceCopy>) -> Result<u32> {
        if mem.is_empty() {
            return Err(Error::InvalidArgument("an empty staged region".into()));
        }
        let mut engine = self.engine();
        if engine.staging.is_none() {
            let staging = self.alloc_staging(&mut engine)?;
            engine.staging = Some(staging);
        }
        engine.table.push_from(
            self.options.index_floor,
            Region::Local(Local::Staged { mem }),
        )
    }

    fn alloc_staging(&self, engine: &mut Engine<T>) -> Result<Staging<T::Registration>> {
        let (chunk, slots) = (self.options.staging_chunk, self.options.staging_slots);
        let bytes = chunk * slots;
        let (base, mem): (*mut u8, Box<dyn Send + Sync>) = match &self.options.gpu {
            Some(gpu) => {
                let mut buf = HostBuffer::alloc(gpu, bytes)?;
                (buf.as_mut_ptr(), Box::new(buf))
            }
            None => {
                let mut buf = vec![0u8; bytes].into_boxed_slice();
                (buf.as_mut_ptr(), Box::new(buf))
            }
        };
        // SAFETY: the memory is owned by the Staging value with the registration, which
        // drops the registration first.
        let reg = unsafe { engine.transport.register_host(base, bytes) }?;
        Ok(Staging {
            base,
            chunk,
            reg,
            free: (0..slots).rev().collect(),
            _mem: mem,
        })
    }

    /// As [`register_local`](Self::register_local), at table index `index` (vacant, or
    /// past the end).
    ///
    /// # Safety
    /// As [`register_local`](Self::register_local).
    pub unsafe fn register_local_at(&self, index: u32, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.place_host(Some(index), ptr, len) }.map(drop)
    }

    /// Registers `[addr, addr + len)` of GPU `gpu`'s memory that this crate did not
    /// allocate (a framework's tensor, a caller's registration): directly where the
    /// transport can, else staged through bounce buffers. At table index `at` where
    /// given (vacant, or past the end), else the next free one. Returns the index and
    /// whether it is staged.
    ///
    /// # Safety
    /// The range is device memory of `gpu` that stays allocated until the region is
    /// removed ([`remove_region`](Self::remove_region)) or the proxy is dropped.
    pub unsafe fn register_device_range(
        &self,
        at: Option<u32>,
        gpu: &Gpu,
        addr: u64,
        len: usize,
    ) -> Result<(u32, bool)> {
        if addr == 0 || len == 0 {
            return Err(Error::InvalidArgument("a null or empty region".into()));
        }
        let mut engine = self.engine();
        // SAFETY: forwarded contract.
        let region = match unsafe {
            engine
                .transport
                .register_device_range(addr, len, gpu.ordinal())
        } {
            Ok(reg) => Region::Local(Local::Direct {
                reg,
                host: false,
                addr,
                len: len as u64,
                dev_addr: addr,
                _keep: None,
            }),
            Err(Error::Unsupported(why)) => {
                tracing::debug!("proxy: staging device memory: {why}");
                if engine.staging.is_none() {
                    let staging = self.alloc_staging(&mut engine)?;
                    engine.staging = Some(staging);
                }
                // SAFETY: forwarded contract.
                let mem = unsafe { DeviceRange::new(gpu, addr, len as u64) }?;
                Region::Local(Local::Staged { mem: Arc::new(mem) })
            }
            Err(e) => return Err(e),
        };
        let staged = matches!(region, Region::Local(Local::Staged { .. }));
        let index = match at {
            Some(index) => engine.table.place(index, region).map(|()| index)?,
            None => engine.table.push_from(self.options.index_floor, region)?,
        };
        Ok((index, staged))
    }

    /// Removes region `index` (local or the peer's): entries naming it are refused from
    /// then on, and its registration is released. Waits (at most the proxy's timeout)
    /// for entries already taken from the ring that use it to retire.
    pub fn remove_region(&self, index: u32) -> Result<()> {
        let deadline = Instant::now() + self.options.timeout;
        loop {
            let mut engine = self.engine();
            let busy = u16::try_from(index).is_ok_and(|mr| engine.in_use(mr));
            if !busy {
                let old = engine.table.remove(index)?;
                drop(engine);
                drop(old);
                return Ok(());
            }
            if !self.is_running() {
                let _ = engine.progress();
            }
            drop(engine);
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: "removing a region still used by operations in flight",
                    after: self.options.timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// What the peer needs to target local region `mr` (send it out of band; the peer
    /// calls [`add_remote`](Self::add_remote)). A staged region has none.
    pub fn descriptor(&self, mr: u32) -> Result<RemoteDescriptor> {
        let engine = self.engine();
        match engine.table.regions.get(mr as usize) {
            Some(Region::Local(Local::Direct { reg, .. })) => {
                Ok(engine.transport.descriptor(reg))
            }
            Some(Region::Local(Local::Staged { .. })) => Err(Error::Unsupported(format!(
                "region {mr} is staged device memory: the transport cannot register it, so a peer cannot target it"
            ))),
            Some(Region::Remote(_)) => Err(Error::InvalidArgument(format!(
                "region {mr} is the peer's"
            ))),
            None | Some(Region::Vacant) => {
                Err(Error::InvalidArgument(format!("no region {mr}")))
            }
        }
    }

    /// Adds the peer's region; returns its index in the memory table.
    pub fn add_remote(&self, desc: &RemoteDescriptor) -> Result<u32> {
        let mut engine = self.engine();
        if desc.transport != engine.transport.kind() {
            return Err(Error::InvalidArgument(format!(
                "a {:?} descriptor on a {:?} transport",
                desc.transport,
                engine.transport.kind()
            )));
        }
        engine
            .table
            .push_from(self.options.index_floor, Region::Remote(*desc))
    }

    /// One round of proxy work (DOCA's `doca_gpu_verbs_cpu_proxy_progress`): take
    /// published entries, post them, reap completions, advance `ctrl.completed`.
    /// `Ok(true)` if anything progressed. A failure is returned once as its typed error
    /// ([`Error::BadEntry`], [`Error::EntryFailed`]); later calls return
    /// [`Error::RingFailed`]. Not while the proxy thread runs ([`Error::InvalidArgument`]).
    #[doc(alias = "doca_gpu_verbs_cpu_proxy_progress")]
    pub fn cpu_proxy_progress(&self) -> Result<bool> {
        if self.is_running() {
            return Err(Error::InvalidArgument(
                "cpu_proxy_progress while the proxy thread runs".into(),
            ));
        }
        self.engine().progress()
    }

    /// Whether the proxy thread runs.
    pub fn is_running(&self) -> bool {
        self.thread.lock().is_some()
    }

    /// Starts the proxy thread (DOCA's service thread): it spins while there is work,
    /// then yields, then sleeps briefly between polls; it stops on [`stop`](Self::stop)
    /// or drop. Its first failure is kept for [`take_error`](Self::take_error).
    pub fn start(&self) -> Result<()> {
        let mut thread = self.thread.lock();
        if thread.is_some() {
            return Ok(());
        }
        self.shared.stop.store(false, Ordering::Release);
        let shared = self.shared.clone();
        let (busy_poll, cpu) = (self.options.busy_poll, self.options.cpu);
        let handle = std::thread::Builder::new()
            .name("gio-cpu-proxy".into())
            .spawn(move || {
                if let Some(cpu) = cpu {
                    if let Err(e) = pin_to_cpu(cpu) {
                        shared.thread_error.lock().get_or_insert(e);
                    }
                }
                proxy_thread(&shared, busy_poll)
            })?;
        *thread = Some(handle);
        Ok(())
    }

    /// Stops the proxy thread (progress is the caller's again).
    pub fn stop(&self) {
        let handle = self.thread.lock().take();
        if let Some(handle) = handle {
            self.shared.stop.store(true, Ordering::Release);
            if handle.join().is_err() {
                tracing::error!("proxy thread panicked");
            }
        }
    }

    /// The proxy thread's first failure, if any (taken).
    pub fn take_error(&self) -> Option<Error> {
        self.shared.thread_error.lock().take()
    }

    /// Sets `ctrl.shutdown`: producers' waits end with `GIO_ERR_SHUTDOWN`, and the proxy
    /// takes nothing more off the ring.
    pub fn shutdown(&self) {
        self.ring.shutdown();
    }

    /// Copies the memory table and a `gio_dev_qp` to device memory for a kernel
    /// ([`RingMemory::cuda`] rings only). Regions added later are not in the export.
    pub fn export(&self) -> Result<ExportedProxyQueuePair> {
        if !self.ring.is_cuda() {
            return Err(Error::Unsupported(
                "exporting a host ring: no GPU can reach it (use RingMemory::cuda)".into(),
            ));
        }
        let gpu = self
            .options
            .gpu
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("export needs the builder's gpu()".into()))?;
        let engine = self.engine();
        let mrs: Vec<ffi::gio_dev_mr> = engine
            .table
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| r.dev_mr(i as u32))
            .collect();
        drop(engine);
        let mrs_bytes = std::mem::size_of::<ffi::gio_dev_mr>() * mrs.len();
        let mrs_buf = DeviceBuffer::alloc(gpu, mrs_bytes.max(1))?;
        // SAFETY: gio_dev_mr is a repr(C) struct of integers; viewing the vector's
        // initialised elements as bytes is sound.
        let table = unsafe { std::slice::from_raw_parts(mrs.as_ptr().cast::<u8>(), mrs_bytes) };
        mrs_buf.copy_from_host(0, table)?;
        let p = self.ring.device_ptrs();
        let dev = ffi::gio_dev_qp {
            nic_handler: ffi::GIO_NIC_HANDLER_CPU_PROXY,
            ring_size: self.ring.ring_size(),
            num_mrs: mrs.len() as u32,
            ring: p.ring,
            ctrl: p.ctrl,
            state: p.state,
            mrs: mrs_buf.ptr(),
            counters: p.counters,
            num_counters: self.ring.num_counters(),
            timeout_ns: self.options.timeout.as_nanos().min(u64::MAX as u128) as u64,
            first_poll_ns: self.options.first_poll.as_nanos().min(u64::MAX as u128) as u64,
            ..ffi::gio_dev_qp::default()
        };
        let qp = DeviceBuffer::alloc(gpu, std::mem::size_of::<ffi::gio_dev_qp>())?;
        // SAFETY: as above, a repr(C) struct of integers and byte arrays.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&dev as *const ffi::gio_dev_qp).cast::<u8>(),
                std::mem::size_of::<ffi::gio_dev_qp>(),
            )
        };
        qp.copy_from_host(0, bytes)?;
        Ok(ExportedProxyQueuePair {
            qp,
            _mrs: mrs_buf,
            _ring: self.ring.clone(),
        })
    }
}

/// Pins the calling thread to `cpu`.
fn pin_to_cpu(cpu: usize) -> Result<()> {
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
        return Err(Error::InvalidArgument(format!("CPU {cpu} is out of range")));
    }
    // SAFETY: cpu is below the set's capacity (checked above).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of that size.
    let ret = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if ret != 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::Io(std::io::Error::new(
            e.kind(),
            format!("sched_setaffinity of the proxy thread to CPU {cpu}: {e}"),
        )));
    }
    Ok(())
}

fn proxy_thread<T: Transport>(shared: &Shared<T>, busy_poll: bool) {
    let mut idle = 0u32;
    while !shared.stop.load(Ordering::Acquire) {
        let result = shared.engine.lock().progress();
        match result {
            Ok(true) => idle = 0,
            Ok(false) => idle = idle.saturating_add(1),
            Err(e) => {
                let mut slot = shared.thread_error.lock();
                if slot.is_none() && !matches!(e, Error::RingFailed { .. }) {
                    *slot = Some(e);
                }
                idle = idle.saturating_add(1);
            }
        }
        if idle == 0 {
            continue;
        } else if busy_poll || idle < SPIN_ROUNDS {
            std::hint::spin_loop();
        } else if idle < YIELD_ROUNDS {
            std::thread::yield_now();
        } else {
            // Each round after a sleep polls the transport: the peer's operations on
            // this side progress every sleep, not every 16th.
            shared.engine.lock().poll_transport_next();
            std::thread::sleep(IDLE_SLEEP);
        }
    }
}

impl<T: Transport> Drop for CpuProxy<T> {
    fn drop(&mut self) {
        self.stop();
        self.ring.shutdown();
        // Memory registered with the transport must not be released under a transfer:
        // reap what is in flight (bounded).
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut engine = self.engine();
        while engine.outstanding() > 0 && Instant::now() < deadline {
            let _ = engine.progress();
            std::thread::yield_now();
        }
        if engine.outstanding() > 0 {
            tracing::warn!(
                "proxy dropped with {} operations in flight",
                engine.outstanding()
            );
        }
    }
}

/// A proxy queue pair exported to device memory: [`device_ptr`](Self::device_ptr) is
/// the `gio_dev_qp *` kernel argument. Keeps the ring alive; no kernel may use it after
/// it is dropped.
#[derive(Debug)]
pub struct ExportedProxyQueuePair {
    qp: DeviceBuffer,
    _mrs: DeviceBuffer,
    _ring: Arc<RingMemory>,
}

impl ExportedProxyQueuePair {
    /// The device address of the `gio_dev_qp`.
    pub fn device_ptr(&self) -> u64 {
        self.qp.ptr()
    }
}
