//! The `-p cpu_proxy` NIC handler of `gpunetio-put-bw` and `gpunetio-write-lat`: each
//! side runs a [`CpuProxy`] over a libfabric endpoint (`--provider`), its memory in VRAM
//! where the transport registers device memory directly (`FI_HMEM`), else in pinned host
//! memory the GPU maps (`--mem auto`; `vram` / `dram` force one). A side that sends gets a
//! CUDA ring its kernel posts into; a proxy thread on each side posts and progresses.
//! Connection info crosses as hex words on one text line (the tools' TCP side channel).
// Shared by two binaries, each of which uses a part.
#![allow(dead_code)]

use gpunetio::proxy::{
    CpuProxy, CpuProxyBuilder, ExportedProxyQueuePair, FabricTransport, RemoteDescriptor,
    RingMemory,
};
use gpunetio::{DeviceBuffer, Gpu, HostBuffer};
use std::sync::Arc;
use std::time::Duration;

/// Where a side's memory lives (`--mem`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MemChoice {
    /// VRAM where the transport registers it directly, else pinned DRAM.
    Auto,
    /// VRAM, or an error naming why not.
    Vram,
    /// Pinned, mapped host memory.
    Dram,
}

/// There is a CUDA driver and a GPU `gpu` (`-d`): checked before anything starts, so
/// that a machine without one gets one line saying so.
pub fn check_gpu(gpu: usize) -> Result<(), String> {
    if !gpunetio::is_available() {
        return Err("no CUDA driver on this machine (libcuda): this tool runs GPU kernels".into());
    }
    let count = gpunetio::device_count();
    if gpu >= count {
        return Err(format!("-d {gpu}: this machine has {count} GPU(s)"));
    }
    Ok(())
}

/// The default provider: `shm` when the peer is on this host, else `tcp;ofi_rxm`.
pub fn default_provider(peer_host: &str) -> &'static str {
    if matches!(peer_host, "127.0.0.1" | "localhost" | "::1" | "") {
        "shm"
    } else {
        "tcp;ofi_rxm"
    }
}

/// Memory registered with a proxy: VRAM or pinned host memory (shared by the proxies of
/// several queue pairs).
#[derive(Clone)]
pub enum Mem {
    Vram(Arc<DeviceBuffer>),
    Dram(Arc<HostBuffer>),
}

impl Mem {
    pub fn is_vram(&self) -> bool {
        matches!(self, Mem::Vram(_))
    }

    /// The address a kernel of this process uses.
    pub fn device_ptr(&self) -> Result<u64, String> {
        match self {
            Mem::Vram(b) => Ok(b.ptr()),
            Mem::Dram(b) => b.device_ptr().map_err(|e| e.to_string()),
        }
    }

    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), String> {
        match self {
            Mem::Vram(b) => b.copy_to_host(offset, out).map_err(|e| e.to_string()),
            Mem::Dram(b) => {
                for (i, o) in out.iter_mut().enumerate() {
                    // SAFETY: inside the buffer (HostBuffer bounds below); volatile, as
                    // the transport writes it.
                    *o = unsafe { std::ptr::read_volatile(b.as_ptr().add(offset + i)) };
                }
                Ok(())
            }
        }
    }

    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), String> {
        match self {
            Mem::Vram(b) => b.copy_from_host(offset, data).map_err(|e| e.to_string()),
            Mem::Dram(b) => {
                if offset + data.len() > b.len() {
                    return Err("write outside the buffer".into());
                }
                for (i, d) in data.iter().enumerate() {
                    // SAFETY: inside the buffer (checked); volatile, as the transport
                    // reads it.
                    unsafe { std::ptr::write_volatile(b.as_ptr().cast_mut().add(offset + i), *d) };
                }
                Ok(())
            }
        }
    }

    pub fn zero(&self) -> Result<(), String> {
        match self {
            Mem::Vram(b) => b.fill(0).map_err(|e| e.to_string()),
            Mem::Dram(b) => self.write(0, &vec![0; b.len()]),
        }
    }
}

/// One side: its proxy (thread running), its registered memory, and for a sending side
/// the exported queue pair.
pub struct Side {
    /// Kernel argument (`gio_dev_qp *`), for a side with a CUDA ring.
    pub qp: Option<ExportedProxyQueuePair>,
    pub proxy: CpuProxy<FabricTransport>,
    /// Index of each registered buffer in the proxy's table, in registration order.
    pub mrs: Vec<u32>,
    pub mems: Vec<Mem>,
}

/// A side over `provider` with `lens` buffers placed per `mem`, a CUDA ring of
/// `ring_size` entries when `ring_size > 0` (else a host ring no one posts into).
pub fn side(
    gpu: &Gpu,
    provider: &str,
    mem: MemChoice,
    lens: &[usize],
    ring_size: u32,
) -> Result<Side, String> {
    let transport = FabricTransport::new(provider).map_err(|e| format!("{provider}: {e}"))?;
    let ring = if ring_size > 0 {
        RingMemory::cuda(gpu, ring_size, 1)
    } else {
        RingMemory::host(8, 0)
    }
    .map_err(|e| e.to_string())?;
    let proxy = CpuProxyBuilder::new()
        .gpu(gpu)
        .busy_poll(true)
        .timeout(Duration::from_secs(60))
        .build(transport, &ring)
        .map_err(|e| e.to_string())?;
    let (mut mrs, mut mems) = (Vec::new(), Vec::new());
    for &len in lens {
        let (mr, m) = register(gpu, &proxy, mem, len)?;
        mrs.push(mr);
        mems.push(m);
    }
    Ok(Side {
        qp: None,
        proxy,
        mrs,
        mems,
    })
}

/// Another side over `provider` registering the same memory as `mems` (another queue
/// pair onto the same buffers), with its own CUDA ring of `ring_size` entries when
/// `ring_size > 0`.
pub fn side_sharing(
    gpu: &Gpu,
    provider: &str,
    mems: &[Mem],
    ring_size: u32,
) -> Result<Side, String> {
    let mut side = side(gpu, provider, MemChoice::Dram, &[], ring_size)?;
    for m in mems {
        let mr = match m {
            Mem::Vram(buf) => {
                let (mr, staged) = side.proxy.register_device(buf).map_err(|e| e.to_string())?;
                if staged {
                    return Err(
                        "a second endpoint stages VRAM the first registered directly".into(),
                    );
                }
                mr
            }
            Mem::Dram(buf) => side
                .proxy
                .register_host_buffer(buf)
                .map_err(|e| e.to_string())?,
        };
        side.mrs.push(mr);
        side.mems.push(m.clone());
    }
    Ok(side)
}

fn register(
    gpu: &Gpu,
    proxy: &CpuProxy<FabricTransport>,
    mem: MemChoice,
    len: usize,
) -> Result<(u32, Mem), String> {
    if mem != MemChoice::Dram {
        let buf = Arc::new(DeviceBuffer::alloc(gpu, len).map_err(|e| e.to_string())?);
        buf.fill(0).map_err(|e| e.to_string())?;
        // Direct registration only: a staged region can be neither a peer's target nor
        // polled by this side's kernel. It is removed, so its index goes to the host
        // buffer instead (every queue pair of a side then has the same table).
        let (mr, staged) = proxy.register_device(&buf).map_err(|e| e.to_string())?;
        if !staged {
            return Ok((mr, Mem::Vram(buf)));
        }
        proxy.remove_region(mr).map_err(|e| e.to_string())?;
        if mem == MemChoice::Vram {
            return Err("the transport cannot register VRAM (no FI_HMEM with RMA and atomics); use --mem dram".into());
        }
    }
    let mut buf = HostBuffer::alloc(gpu, len).map_err(|e| e.to_string())?;
    buf.as_mut_slice().fill(0);
    let buf = Arc::new(buf);
    let mr = proxy
        .register_host_buffer(&buf)
        .map_err(|e| e.to_string())?;
    Ok((mr, Mem::Dram(buf)))
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err(format!("odd hex length {}", s.len()));
    }
    (0..s.len() / 2)
        .map(|i| {
            s.get(2 * i..2 * i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad hex at {i}"))
        })
        .collect()
}

impl Side {
    /// `<endpoint name> <descriptor of each buffer>`, hex words.
    pub fn info_words(&self) -> Result<String, String> {
        let mut words = vec![hex(&self.proxy.local_info().map_err(|e| e.to_string())?)];
        for &mr in &self.mrs {
            let d = self.proxy.descriptor(mr).map_err(|e| e.to_string())?;
            words.push(hex(&d.to_bytes()));
        }
        Ok(words.join(" "))
    }

    /// Connects to the peer of `words` ([`info_words`](Self::info_words)) and adds its
    /// buffers; returns their indices in this side's table.
    pub fn connect(&self, words: &[&str]) -> Result<Vec<u32>, String> {
        let (name, descs) = words.split_first().ok_or("no peer info")?;
        self.proxy
            .connect(&unhex(name)?)
            .map_err(|e| e.to_string())?;
        descs
            .iter()
            .map(|d| {
                let d = RemoteDescriptor::from_bytes(&unhex(d)?).map_err(|e| e.to_string())?;
                self.proxy.add_remote(&d).map_err(|e| e.to_string())
            })
            .collect()
    }

    /// Starts the proxy thread and, for a CUDA ring, exports the queue pair.
    pub fn start(&mut self) -> Result<(), String> {
        self.proxy.start().map_err(|e| e.to_string())?;
        if self.proxy.ring().is_cuda() {
            self.qp = Some(self.proxy.export().map_err(|e| e.to_string())?);
        }
        Ok(())
    }

    /// The proxy thread's first failure.
    pub fn check(&self) -> Result<(), String> {
        match self.proxy.take_error() {
            Some(e) => Err(format!("proxy: {e}")),
            None => Ok(()),
        }
    }

    /// `vram` or `dram`, per buffer.
    pub fn placement(&self) -> String {
        let v: Vec<&str> = self
            .mems
            .iter()
            .map(|m| if m.is_vram() { "vram" } else { "dram" })
            .collect();
        v.join("/")
    }
}
