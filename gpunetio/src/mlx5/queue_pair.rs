//! A GPU-initiated RC queue pair created through DEVX (DOCA GPUNetIO's
//! `doca_gpu_verbs_create_qp_hl` with `GPU_SM_DB`): send queue, completion queue and
//! both doorbell records live in one GPU buffer registered as a umem through its
//! DMA-BUF; the UAR page is mapped into the GPU; kernels build WQEs, ring the doorbell
//! and poll CQEs themselves (`gio_mlx5.cuh`).
//!
//! ```no_run
//! # fn main() -> gpunetio::Result<()> {
//! use gpunetio::mlx5::{DevxContext, Mlx5Options, Mlx5QueuePair};
//! use gpunetio::{DeviceBuffer, Gpu};
//! use std::sync::Arc;
//! let gpu = Gpu::open(0)?;
//! let ctx = DevxContext::open(None)?; // Unsupported without a ConnectX
//! let mut qp = Mlx5QueuePair::create(&gpu, &ctx, &Mlx5Options::default())?;
//! let local = Arc::new(DeviceBuffer::alloc(&gpu, 1 << 20)?);
//! let src = qp.register_local(&local)?;
//! let peer = qp.endpoint(); // send it to the peer, receive theirs
//! # let (peer_endpoint, peer_desc) = (peer, qp.descriptor(src)?);
//! qp.connect(&peer_endpoint)?;
//! let dst = qp.add_remote(&peer_desc)?;
//! let exported = qp.export()?; // exported.device_ptr() is the kernel argument
//! # let _ = (dst, exported); Ok(()) }
//! ```

use super::devx::{DevxContext, DevxObject, Uar, Umem, UMEM_PAGE};
use super::export::{export, ExportedMlx5QueuePair, MemoryTable, QueueLayout};
use super::uar::UarMapping;
use super::{cqe, prm};
use crate::error::{Error, Result};
use crate::proxy::{RemoteDescriptor, TransportKind};
use gpu_mem::{DeviceBuffer, Gpu};
use gpunetio_sys::mlx5 as abi;
use ibverbs::{AccessFlags, Endpoint, Gid, LinkLayer, Mtu};
use mlx5dv_sys as dv;
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

/// Options of an [`Mlx5QueuePair`].
#[derive(Debug, Clone)]
pub struct Mlx5Options {
    /// WQEBBs in the send queue (a power of two; the CQ gets as many CQEs).
    pub sq_wqe_cnt: u32,
    /// The port (1-based).
    pub port: u8,
    /// Completion counters for the `*_counter` device calls.
    pub num_counters: u32,
    /// Bound on every device-side wait (zero: unbounded).
    pub timeout: Duration,
    /// Transport retries and ACK timeout code (4.096 us * 2^code).
    pub retry_count: u8,
    /// See `retry_count`.
    pub ack_timeout: u8,
}

impl Default for Mlx5Options {
    fn default() -> Self {
        Self {
            sq_wqe_cnt: 256,
            port: 1,
            num_counters: 4,
            timeout: Duration::from_secs(10),
            retry_count: 7,
            ack_timeout: 20,
        }
    }
}

/// Where the queues sit in the queue buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueOffsets {
    /// The send queue (offset 0).
    pub sq: u64,
    /// The CQ (page aligned).
    pub cq: u64,
    /// The QP doorbell record (its own page).
    pub qp_dbrec: u64,
    /// The CQ doorbell record (a cache line after the QP's).
    pub cq_dbrec: u64,
    /// Bytes of the buffer.
    pub len: u64,
}

/// The queue buffer's layout for `sq_wqe_cnt` WQEBBs and `cq_cqe_cnt` CQEs: send queue,
/// CQ and a doorbell page, each page aligned, rounded up to 2 MiB (so `cuMemAlloc`
/// returns a 2 MiB-aligned buffer a umem can start at).
pub fn queue_offsets(sq_wqe_cnt: u32, cq_cqe_cnt: u32) -> QueueOffsets {
    let page = |x: u64| x.div_ceil(UMEM_PAGE) * UMEM_PAGE;
    let sq_bytes = u64::from(sq_wqe_cnt) * abi::GIO_MLX5_WQEBB as u64;
    let cq = page(sq_bytes);
    let qp_dbrec = cq + page(u64::from(cq_cqe_cnt) * abi::GIO_MLX5_CQE_SIZE as u64);
    let len = (qp_dbrec + UMEM_PAGE).div_ceil(2 << 20) * (2 << 20);
    QueueOffsets {
        sq: 0,
        cq,
        qp_dbrec,
        cq_dbrec: qp_dbrec + 64,
        len,
    }
}

/// The UAR and its GPU mapping: the mapping is dropped (unregistered) before the UAR is
/// freed (unmapped).
#[derive(Debug)]
struct GpuUar {
    mapping: UarMapping,
    uar: Uar,
}

/// QP states this type moves through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Created, not connected.
    Reset,
    /// Connected: RST → INIT → RTR → RTS done.
    ReadyToSend,
}

/// An RC queue pair on GPU-resident queues, created with DEVX. Destroyed on drop in
/// dependency order (QP, CQ, umem, UAR mapping, UAR, buffers, PD, context).
pub struct Mlx5QueuePair {
    qp: DevxObject,
    cq: Arc<DevxObject>,
    uar: Arc<GpuUar>,
    queue: Arc<DeviceBuffer>,
    // The memory region before the buffer it covers.
    scratch_mr: Arc<ibverbs::MemoryRegion>,
    scratch: Arc<DeviceBuffer>,
    table: MemoryTable,
    /// (region index, rkey) of the local regions, for descriptors.
    remote_keys: Vec<(u32, u32)>,
    offsets: QueueOffsets,
    sq_wqe_cnt: u32,
    options: Mlx5Options,
    local: Endpoint,
    sgid_index: u8,
    link_layer: LinkLayer,
    /// log2 of the RDMA reads/atomics in flight the device allows.
    log_rd_atomic: u8,
    state: QpState,
    ctx: Arc<DevxContext>,
    gpu: Gpu,
}

impl std::fmt::Debug for Mlx5QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mlx5QueuePair")
            .field("device", &self.ctx.context().name())
            .field("qpn", &self.qp.number())
            .field("cqn", &self.cq.number())
            .field("state", &self.state)
            .finish()
    }
}

fn verbs(context: impl Into<String>) -> impl FnOnce(ibverbs::Error) -> Error {
    let context = context.into();
    move |source| Error::Verbs { context, source }
}

fn log2(x: u32) -> u8 {
    x.trailing_zeros() as u8
}

fn full_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC
}

fn reg_device(ctx: &DevxContext, buf: &DeviceBuffer) -> Result<ibverbs::MemoryRegion> {
    let dmabuf = buf.dmabuf_fd()?;
    use std::os::fd::AsFd;
    ctx.pd()
        .reg_dmabuf_mr(
            dmabuf.fd.as_fd(),
            dmabuf.offset,
            buf.len(),
            buf.ptr(),
            full_access(),
        )
        .map_err(verbs(format!(
            "ibv_reg_dmabuf_mr of device buffer {:#x}+{}",
            buf.ptr(),
            buf.len()
        )))
}

impl Mlx5QueuePair {
    /// Creates the queues on `gpu` and the CQ and QP objects on `ctx` (state RESET).
    pub fn create(gpu: &Gpu, ctx: &Arc<DevxContext>, options: &Mlx5Options) -> Result<Self> {
        let sq_wqe_cnt = options.sq_wqe_cnt;
        if !sq_wqe_cnt.is_power_of_two() || !(2..=1 << 15).contains(&sq_wqe_cnt) {
            return Err(Error::InvalidArgument(format!(
                "send queue of {sq_wqe_cnt} WQEBBs: a power of two in 2..=32768 is needed"
            )));
        }
        let attr = ctx
            .context()
            .query_device()
            .map_err(verbs("ibv_query_device"))?;
        if sq_wqe_cnt > attr.max_qp_wr() || sq_wqe_cnt > attr.max_cqe() {
            return Err(Error::InvalidArgument(format!(
                "send queue of {sq_wqe_cnt} WQEBBs: the device allows {} WQEs and {} CQEs",
                attr.max_qp_wr(),
                attr.max_cqe()
            )));
        }
        // floor(log2): never more reads/atomics in flight than the device allows.
        let log_rd_atomic = (31 - attr.max_qp_rd_atom().clamp(1, 16).leading_zeros()) as u8;
        let port = ctx
            .context()
            .query_port(options.port)
            .map_err(verbs(format!("ibv_query_port({})", options.port)))?;
        let link_layer = port.link_layer();
        let (gid, sgid_index) = if link_layer == LinkLayer::ETHERNET {
            let e = ctx
                .context()
                .find_roce_v2_gid(options.port, ibverbs::IpFamily::V4)
                .or_else(|_| {
                    ctx.context()
                        .find_roce_v2_gid(options.port, ibverbs::IpFamily::V6)
                })
                .map_err(verbs(format!("no RoCE v2 GID on port {}", options.port)))?;
            (e.gid, e.gid_index as u8)
        } else {
            (Gid::default(), 0)
        };

        let cq_cqe_cnt = sq_wqe_cnt;
        let offsets = queue_offsets(sq_wqe_cnt, cq_cqe_cnt);
        let queue = Arc::new(DeviceBuffer::alloc(gpu, offsets.len as usize)?);
        queue.fill(0)?;
        let mut cqes = Vec::with_capacity(cq_cqe_cnt as usize * cqe::CQE_SIZE);
        for _ in 0..cq_cqe_cnt {
            cqes.extend_from_slice(&cqe::empty_cqe());
        }
        queue.copy_from_host(offsets.cq as usize, &cqes)?;
        let umem = Arc::new(Umem::register(ctx, &queue)?);

        let uar = Uar::alloc(ctx)?;
        // SAFETY: the UAR page stays mapped until `uar` is freed, which GpuUar does
        // after dropping the mapping.
        let mapping = unsafe { UarMapping::register(gpu, uar.base_addr(), UMEM_PAGE as usize) }?;
        let uar = Arc::new(GpuUar { mapping, uar });

        let eqn = ctx.query_eqn(0)?;
        let cq_in = prm::create_cq(&prm::CqParams {
            log_cq_size: log2(cq_cqe_cnt),
            uar_page: uar.uar.page_id(),
            eqn,
            buf: prm::UmemRef {
                umem_id: umem.id(),
                offset: offsets.cq,
            },
            dbr: prm::UmemRef {
                umem_id: umem.id(),
                offset: offsets.cq_dbrec,
            },
            log_page_size: 0,
        })?;
        let cq = Arc::new(DevxObject::create(
            ctx,
            "CREATE_CQ",
            &cq_in,
            vec![umem.clone() as Arc<dyn Any + Send + Sync>, uar.clone()],
        )?);
        let qp_params = prm::QpParams {
            pdn: ctx.pdn(),
            uar_page: uar.uar.page_id(),
            log_sq_size: log2(sq_wqe_cnt),
            cqn: cq.number(),
            sq: prm::UmemRef {
                umem_id: umem.id(),
                offset: offsets.sq,
            },
            dbr: prm::UmemRef {
                umem_id: umem.id(),
                offset: offsets.qp_dbrec,
            },
            log_page_size: 0,
            ts_format: prm::qpc::TS_FORMAT_DEFAULT,
        };
        let deps =
            || -> Vec<Arc<dyn Any + Send + Sync>> { vec![cq.clone(), umem.clone(), uar.clone()] };
        // Devices with the `qp_ts_format` capability take the default timestamp format;
        // older ones keep those bits reserved and refuse a non-zero value.
        let qp = match DevxObject::create(ctx, "CREATE_QP", &prm::create_qp(&qp_params)?, deps()) {
            Ok(qp) => qp,
            Err(Error::Devx { status, .. }) if status != 0 => {
                tracing::debug!("CREATE_QP with the default timestamp format refused (status {status:#x}): retrying free running");
                let free = prm::QpParams {
                    ts_format: prm::qpc::TS_FORMAT_FREE_RUNNING,
                    ..qp_params
                };
                DevxObject::create(ctx, "CREATE_QP", &prm::create_qp(&free)?, deps())?
            }
            Err(e) => return Err(e),
        };

        let scratch = Arc::new(DeviceBuffer::alloc(gpu, UMEM_PAGE as usize)?);
        scratch.fill(0)?;
        let scratch_mr = Arc::new(reg_device(ctx, &scratch)?);
        let local = Endpoint {
            qp_num: qp.number(),
            psn: 0,
            gid,
            lid: port.lid(),
            mtu: port.active_mtu(),
        };
        tracing::debug!(
            qpn = qp.number(),
            cqn = cq.number(),
            device = ctx.context().name(),
            "mlx5: created a GPU queue pair"
        );
        Ok(Self {
            qp,
            cq,
            uar,
            queue,
            scratch_mr,
            scratch,
            table: MemoryTable::new(),
            remote_keys: Vec::new(),
            offsets,
            sq_wqe_cnt,
            options: options.clone(),
            local,
            sgid_index,
            link_layer,
            log_rd_atomic,
            state: QpState::Reset,
            ctx: ctx.clone(),
            gpu: gpu.clone(),
        })
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qp.number()
    }

    /// The state this queue pair is in.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// What the peer needs to connect (QPN, PSN, GID or LID, MTU): the same endpoint a
    /// verbs RC queue pair exchanges, so either side may be a CPU `ibverbs` QP.
    pub fn endpoint(&self) -> Endpoint {
        self.local
    }

    /// Registers a local device buffer (DMA-BUF memory region); returns its index in
    /// the memory table.
    pub fn register_local(&mut self, buf: &Arc<DeviceBuffer>) -> Result<u32> {
        let mr = Arc::new(reg_device(&self.ctx, buf)?);
        // Tuple fields drop in order: the memory region before the buffer it covers.
        let keep: Arc<dyn Any + Send + Sync> = Arc::new((mr.clone(), buf.clone()));
        let index = self
            .table
            .push_local(buf.ptr(), buf.len() as u64, mr.lkey(), Some(keep))?;
        self.remote_keys.push((index, mr.rkey()));
        Ok(index)
    }

    /// What the peer needs to target local region `mr` (send it out of band; the peer
    /// calls [`add_remote`](Self::add_remote) or a CPU proxy's `add_remote`).
    pub fn descriptor(&self, mr: u32) -> Result<RemoteDescriptor> {
        let key = self
            .remote_keys
            .iter()
            .find(|(i, _)| *i == mr)
            .map(|(_, k)| *k)
            .ok_or_else(|| Error::InvalidArgument(format!("no local region {mr}")))?;
        let k = self.table.key(mr).expect("a local region is in the table");
        let len = self.table.len_of(mr).unwrap_or(0);
        Ok(RemoteDescriptor {
            transport: TransportKind::VERBS,
            addr: k.addr,
            len,
            key: u64::from(key),
        })
    }

    /// Adds the peer's region; returns its index in the memory table.
    pub fn add_remote(&mut self, desc: &RemoteDescriptor) -> Result<u32> {
        if desc.transport != TransportKind::VERBS {
            return Err(Error::InvalidArgument(format!(
                "a {:?} descriptor on an mlx5 queue pair (verbs keys are needed)",
                desc.transport
            )));
        }
        let rkey = u32::try_from(desc.key)
            .map_err(|_| Error::InvalidArgument(format!("rkey {:#x} exceeds 32 bits", desc.key)))?;
        self.table.push_remote(desc.addr, desc.len, rkey)
    }

    fn route(&self, remote: &Endpoint) -> Result<prm::Route> {
        if self.link_layer != LinkLayer::ETHERNET {
            return Ok(prm::Route::Ib {
                rlid: remote.lid,
                grh: None,
            });
        }
        // The kernel resolves the next hop's MAC when it creates an address handle;
        // mlx5's address vector carries it (as NVSHMEM's IBGDA does).
        let ah = self
            .ctx
            .pd()
            .create_ah(
                &ibverbs::AhAttr::default()
                    .port_num(self.options.port)
                    .dgid(remote.gid)
                    .sgid_index(self.sgid_index)
                    .hop_limit(0xff),
            )
            .map_err(verbs("ibv_create_ah (resolving the peer's MAC)"))?;
        let mut out: dv::mlx5dv_ah = dv::mlx5dv_ah {
            av: std::ptr::null_mut(),
            comp_mask: 0,
        };
        // SAFETY: zeroed is a valid bit pattern for the struct of pointers.
        let mut obj: dv::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.ah.in_ = ah.as_raw().cast();
        obj.ah.out = &mut out;
        // SAFETY: a live AH of an mlx5 context and a valid out struct.
        let r = unsafe { dv::mlx5dv_init_obj(&mut obj, u64::from(dv::MLX5DV_OBJ_AH)) };
        if r != 0 || out.av.is_null() {
            return Err(Error::Devx {
                call: "mlx5dv_init_obj(AH)",
                errno: r,
                status: 0,
                syndrome: 0,
            });
        }
        // SAFETY: `av` points into the live AH.
        let rmac = unsafe { (*out.av).rmac };
        Ok(prm::Route::Roce {
            rgid: remote.gid.raw,
            rmac,
            sgid_index: self.sgid_index,
            // RoCE v2 source ports come from 0xC000..=0xFFFF; the QP numbers give ECMP
            // entropy (the kernel derives it from the flow label the same way).
            udp_sport: 0xc000 | ((self.qp.number() ^ remote.qp_num) & 0x3fff) as u16,
        })
    }

    /// Connects to the peer whose [`endpoint`](Self::endpoint) this is: RST → INIT →
    /// RTR → RTS through DEVX modify commands.
    pub fn connect(&mut self, remote: &Endpoint) -> Result<()> {
        if self.state != QpState::Reset {
            return Err(Error::InvalidArgument(
                "the mlx5 queue pair is already connected".into(),
            ));
        }
        let qpn = self.qp.number();
        self.qp
            .modify("RST2INIT_QP", &prm::rst2init_qp(qpn, self.options.port, 0)?)?;
        let mtu = self.local.mtu.0.min(remote.mtu.0).max(Mtu::MTU_256.0) as u8;
        let rtr = prm::RtrParams {
            remote_qpn: remote.qp_num,
            next_rcv_psn: remote.psn,
            mtu,
            log_msg_max: 30,
            log_rra_max: self.log_rd_atomic,
            min_rnr_nak: 12,
            port: self.options.port,
            route: self.route(remote)?,
        };
        self.qp
            .modify("INIT2RTR_QP", &prm::init2rtr_qp(qpn, &rtr)?)?;
        let rts = prm::RtsParams {
            next_send_psn: self.local.psn,
            retry_count: self.options.retry_count.min(7),
            rnr_retry: 7,
            ack_timeout: self.options.ack_timeout.min(31),
            log_sra_max: self.log_rd_atomic,
        };
        self.qp.modify("RTR2RTS_QP", &prm::rtr2rts_qp(qpn, &rts)?)?;
        self.state = QpState::ReadyToSend;
        Ok(())
    }

    /// The queues' addresses and sizes as device code addresses them.
    pub fn layout(&self) -> QueueLayout {
        let base = self.queue.ptr();
        let uar = &self.uar;
        let reg_off = uar.uar.reg_addr() as u64 - uar.uar.base_addr() as u64;
        QueueLayout {
            sq: base + self.offsets.sq,
            // The send counter is the second dword of the QP doorbell record.
            dbrec: base + self.offsets.qp_dbrec,
            db: uar.mapping.device_ptr() + reg_off,
            cq: base + self.offsets.cq,
            cq_dbrec: base + self.offsets.cq_dbrec,
            qpn: self.qp.number(),
            sq_wqe_cnt: self.sq_wqe_cnt,
            cq_cqe_cnt: self.sq_wqe_cnt,
            flags: if uar.uar.is_blueflame() {
                abi::GIO_MLX5_QP_BLUEFLAME
            } else {
                0
            },
            scratch: (self.scratch.ptr(), self.scratch_mr.lkey()),
        }
    }

    /// Exports the connected queue pair for kernels ([`QpState::ReadyToSend`] only).
    /// The export owns the queue pair: dropping it destroys everything in order.
    pub fn export(mut self) -> Result<ExportedMlx5QueuePair> {
        if self.state != QpState::ReadyToSend {
            return Err(Error::InvalidArgument(
                "export of an mlx5 queue pair that is not connected (call connect first)".into(),
            ));
        }
        let layout = self.layout();
        let gpu = self.gpu.clone();
        let (num_counters, timeout) = (self.options.num_counters, self.options.timeout);
        let table = std::mem::take(&mut self.table);
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(self);
        export(&gpu, &layout, &table, num_counters, timeout, owner)
    }
}
