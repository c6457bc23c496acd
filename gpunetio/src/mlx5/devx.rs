//! DEVX objects of the native mlx5 handler (the host side of DOCA GPUNetIO's
//! `doca_gpu_verbs` / GDAKI): a device context opened with DEVX and its protection
//! domain ([`DevxContext`]), a UAR ([`Uar`]), GPU memory registered as a umem through
//! its DMA-BUF ([`Umem`]), and firmware objects created from PRM mailboxes
//! ([`DevxObject`]). Every object owns what it was created from through an `Arc`, so
//! destruction follows the dependency graph whatever order the user drops things in;
//! a failed destroy is logged, never a panic.

use super::prm;
use crate::error::{Error, Result};
use gpu_mem::DeviceBuffer;
use mlx5dv_sys as dv;
use std::any::Any;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::Arc;

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn verbs(context: impl Into<String>) -> impl FnOnce(ibverbs::Error) -> Error {
    let context = context.into();
    move |source| Error::Verbs { context, source }
}

/// An mlx5 device opened with DEVX (`mlx5dv_open_device` with
/// `MLX5DV_CONTEXT_FLAGS_DEVX`), with a protection domain and its number.
pub struct DevxContext {
    // Field order is drop order: the PD before the context it belongs to (the PD also
    // holds a clone of the context).
    pd: ibverbs::ProtectionDomain,
    ctx: ibverbs::Context,
    pdn: u32,
}

impl std::fmt::Debug for DevxContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevxContext")
            .field("device", &self.ctx.name())
            .field("pdn", &self.pdn)
            .finish()
    }
}

impl DevxContext {
    /// Opens `device` (a verbs name such as `mlx5_0`), or the first mlx5 device DEVX
    /// opens on ([`super::probe`]). [`Error::Unsupported`] says why when there is none,
    /// or when `device` is not an mlx5 device.
    #[doc(alias = "mlx5dv_open_device")]
    pub fn open(device: Option<&str>) -> Result<Arc<Self>> {
        let name = match device {
            Some(n) => n.to_string(),
            None => super::device::probe()?.name,
        };
        let list = ibverbs::devices().map_err(verbs("listing RDMA devices"))?;
        let dev = list
            .get(&name)
            .map_err(verbs(format!("finding RDMA device {name}")))?;
        // SAFETY: a device of a live list.
        if !unsafe { dv::mlx5dv_is_supported(dev.as_raw()) } {
            return Err(Error::Unsupported(format!(
                "native mlx5 handler: {name} is not an mlx5 (ConnectX) device"
            )));
        }
        let mut attr = dv::mlx5dv_context_attr {
            flags: dv::MLX5DV_CONTEXT_FLAGS_DEVX,
            comp_mask: 0,
        };
        // SAFETY: a device of a live list and a valid attribute struct.
        let raw = unsafe { dv::mlx5dv_open_device(dev.as_raw(), &mut attr) };
        let Some(raw) = NonNull::new(raw) else {
            return Err(Error::Unsupported(format!(
                "native mlx5 handler: DEVX does not open on {name} (errno {}: kernel without DEVX, or missing permissions)",
                errno()
            )));
        };
        // SAFETY: opened just above; the wrapper owns and closes it.
        let ctx = unsafe { ibverbs::Context::from_raw(raw.cast(), true) };
        let pd = ctx
            .alloc_pd()
            .map_err(verbs(format!("ibv_alloc_pd on {name}")))?;
        let mut out = dv::mlx5dv_pd {
            pdn: 0,
            comp_mask: 0,
        };
        // SAFETY: zeroed is a valid bit pattern for the struct of pointers.
        let mut obj: dv::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.pd.in_ = pd.as_raw().cast();
        obj.pd.out = &mut out;
        // SAFETY: `obj` names a live PD of a DEVX context and a valid out struct.
        let r = unsafe { dv::mlx5dv_init_obj(&mut obj, u64::from(dv::MLX5DV_OBJ_PD)) };
        if r != 0 {
            return Err(Error::Devx {
                call: "mlx5dv_init_obj(PD)",
                errno: r,
                status: 0,
                syndrome: 0,
            });
        }
        Ok(Arc::new(Self {
            pd,
            ctx,
            pdn: out.pdn,
        }))
    }

    /// The verbs context (ports, GIDs, memory registration).
    pub fn context(&self) -> &ibverbs::Context {
        &self.ctx
    }

    /// The protection domain queue pairs and memory regions share.
    pub fn pd(&self) -> &ibverbs::ProtectionDomain {
        &self.pd
    }

    /// The protection domain's number (`qpc.pd`).
    pub fn pdn(&self) -> u32 {
        self.pdn
    }

    /// The completion event queue of interrupt vector `vector` (`cqc.c_eqn`).
    #[doc(alias = "mlx5dv_devx_query_eqn")]
    pub fn query_eqn(&self, vector: u32) -> Result<u32> {
        let mut eqn = 0u32;
        // SAFETY: a live DEVX context and a valid out-pointer.
        let r = unsafe { dv::mlx5dv_devx_query_eqn(self.ctx.as_raw().cast(), vector, &mut eqn) };
        if r != 0 {
            return Err(Error::Devx {
                call: "mlx5dv_devx_query_eqn",
                errno: if r > 0 { r } else { errno() },
                status: 0,
                syndrome: 0,
            });
        }
        Ok(eqn)
    }

    /// Runs a command that creates no object (`mlx5dv_devx_general_cmd`), such as
    /// QUERY_HCA_CAP; returns its output mailbox of `out_len` bytes.
    #[doc(alias = "mlx5dv_devx_general_cmd")]
    pub fn general_cmd(&self, call: &'static str, input: &[u8], out_len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; out_len.max(prm::OUT_BYTES)];
        // SAFETY: in/out buffers of the given lengths on a live DEVX context.
        let r = unsafe {
            dv::mlx5dv_devx_general_cmd(
                self.ctx.as_raw().cast(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if r != 0 {
            return Err(Error::Devx {
                call,
                errno: if r > 0 { r } else { errno() },
                status: prm::get(&out, prm::cmd_out::STATUS) as u8,
                syndrome: prm::get(&out, prm::cmd_out::SYNDROME) as u32,
            });
        }
        prm::check_out(call, &out)?;
        Ok(out)
    }
}

/// A UAR page for doorbells (`mlx5dv_devx_alloc_uar`), freed on drop.
pub struct Uar {
    raw: NonNull<dv::mlx5dv_devx_uar>,
    blueflame: bool,
    _ctx: Arc<DevxContext>,
}

// SAFETY: the UAR is an mmap of device registers plus its id; rdma-core allows freeing
// it from any thread, and this type exposes only its addresses.
unsafe impl Send for Uar {}
// SAFETY: no method mutates through `&self`.
unsafe impl Sync for Uar {}

impl std::fmt::Debug for Uar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uar")
            .field("page_id", &self.page_id())
            .field("blueflame", &self.blueflame)
            .finish()
    }
}

impl Uar {
    /// A non-cached UAR (plain doorbells), or where the device has none a BlueFlame one.
    #[doc(alias = "mlx5dv_devx_alloc_uar")]
    pub fn alloc(ctx: &Arc<DevxContext>) -> Result<Self> {
        for (kind, blueflame) in [
            (dv::MLX5_IB_UAPI_UAR_ALLOC_TYPE_NC, false),
            (dv::MLX5_IB_UAPI_UAR_ALLOC_TYPE_BF, true),
        ] {
            // SAFETY: a live DEVX context.
            let raw = unsafe { dv::mlx5dv_devx_alloc_uar(ctx.ctx.as_raw().cast(), kind) };
            if let Some(raw) = NonNull::new(raw) {
                return Ok(Self {
                    raw,
                    blueflame,
                    _ctx: ctx.clone(),
                });
            }
        }
        Err(Error::Devx {
            call: "mlx5dv_devx_alloc_uar",
            errno: errno(),
            status: 0,
            syndrome: 0,
        })
    }

    /// `page_id` (`cqc.uar_page`, `qpc.uar_page`).
    pub fn page_id(&self) -> u32 {
        // SAFETY: allocated by `alloc`, valid until drop.
        unsafe { self.raw.as_ref().page_id }
    }

    /// The page's mapping (`base_addr`, page aligned).
    pub fn base_addr(&self) -> *mut u8 {
        // SAFETY: as above.
        unsafe { self.raw.as_ref().base_addr.cast() }
    }

    /// The doorbell register (`reg_addr`, inside the page).
    pub fn reg_addr(&self) -> *mut u8 {
        // SAFETY: as above.
        unsafe { self.raw.as_ref().reg_addr.cast() }
    }

    /// Whether it is a BlueFlame UAR (the whole WQE may be written to the register).
    pub fn is_blueflame(&self) -> bool {
        self.blueflame
    }
}

impl Drop for Uar {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc`, freed once.
        unsafe { dv::mlx5dv_devx_free_uar(self.raw.as_ptr()) };
    }
}

/// GPU memory registered for DEVX objects through its DMA-BUF
/// (`mlx5dv_devx_umem_reg_ex` with `MLX5DV_UMEM_MASK_DMABUF`), deregistered on drop.
pub struct Umem {
    raw: NonNull<dv::mlx5dv_devx_umem>,
    _ctx: Arc<DevxContext>,
    _buf: Arc<DeviceBuffer>,
}

// SAFETY: only the umem id is read; deregistration is allowed from any thread.
unsafe impl Send for Umem {}
// SAFETY: no method mutates through `&self`.
unsafe impl Sync for Umem {}

impl std::fmt::Debug for Umem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Umem").field("id", &self.id()).finish()
    }
}

/// 4 KiB: the page size umems are registered with (`log_page_size` 0 in the contexts).
pub const UMEM_PAGE: u64 = 4096;

impl Umem {
    /// Registers all of `buf` (its start must be 4 KiB aligned) for local read/write.
    #[doc(alias = "mlx5dv_devx_umem_reg_ex")]
    pub fn register(ctx: &Arc<DevxContext>, buf: &Arc<DeviceBuffer>) -> Result<Self> {
        if !buf.ptr().is_multiple_of(UMEM_PAGE) {
            return Err(Error::InvalidArgument(format!(
                "umem of device buffer {:#x}: a 4 KiB aligned start is needed",
                buf.ptr()
            )));
        }
        let dmabuf = buf.dmabuf_fd()?;
        let mut umem_in = dv::mlx5dv_devx_umem_in {
            // For a DMA-BUF, `addr` is the offset of the registered range in it.
            addr: dmabuf.offset as *mut std::ffi::c_void,
            size: buf.len(),
            access: dv::ibverbs_sys::IBV_ACCESS_LOCAL_WRITE,
            pgsz_bitmap: UMEM_PAGE,
            comp_mask: u64::from(dv::MLX5DV_UMEM_MASK_DMABUF),
            dmabuf_fd: dmabuf.fd.as_raw_fd(),
        };
        // SAFETY: a live DEVX context and a filled-in struct; the kernel takes its own
        // reference on the DMA-BUF, so the fd may close after the call.
        let raw = unsafe { dv::mlx5dv_devx_umem_reg_ex(ctx.ctx.as_raw().cast(), &mut umem_in) };
        let Some(raw) = NonNull::new(raw) else {
            let e = errno();
            if e == libc::EOPNOTSUPP || e == libc::EINVAL {
                return Err(Error::Unsupported(format!(
                    "native mlx5 handler: the kernel refuses a DMA-BUF umem (errno {e}: rdma-core or kernel too old for DMA-BUF umems, or no GPUDirect RDMA)"
                )));
            }
            return Err(Error::Devx {
                call: "mlx5dv_devx_umem_reg_ex",
                errno: e,
                status: 0,
                syndrome: 0,
            });
        };
        Ok(Self {
            raw,
            _ctx: ctx.clone(),
            _buf: buf.clone(),
        })
    }

    /// `umem_id` (`*_umem_id` fields of the contexts).
    pub fn id(&self) -> u32 {
        // SAFETY: registered by `register`, valid until drop.
        unsafe { self.raw.as_ref().umem_id }
    }
}

impl Drop for Umem {
    fn drop(&mut self) {
        // SAFETY: registered by `register`, deregistered once (objects using it hold an
        // Arc of it and are destroyed first).
        let r = unsafe { dv::mlx5dv_devx_umem_dereg(self.raw.as_ptr()) };
        if r != 0 {
            tracing::warn!("mlx5dv_devx_umem_dereg(umem {}): {r}", self.id());
        }
    }
}

/// A firmware object created from a PRM mailbox (`mlx5dv_devx_obj_create`): a CQ or a
/// QP here. The kernel issues the matching destroy command on drop; what it depends on
/// (umems, UAR, its CQ) is held until then.
pub struct DevxObject {
    raw: NonNull<dv::mlx5dv_devx_obj>,
    what: &'static str,
    number: u32,
    _deps: Vec<Arc<dyn Any + Send + Sync>>,
    _ctx: Arc<DevxContext>,
}

// SAFETY: DEVX objects may be modified and destroyed from any thread (each call is one
// ioctl; libibverbs is thread-safe); modifications are serialised by `&mut self`.
unsafe impl Send for DevxObject {}
// SAFETY: `&self` methods only read the number.
unsafe impl Sync for DevxObject {}

impl std::fmt::Debug for DevxObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevxObject")
            .field("what", &self.what)
            .field("number", &self.number)
            .finish()
    }
}

impl DevxObject {
    /// Runs create command `input` (`call` names it in errors); `deps` stay alive as
    /// long as the object.
    #[doc(alias = "mlx5dv_devx_obj_create")]
    pub fn create(
        ctx: &Arc<DevxContext>,
        call: &'static str,
        input: &[u8],
        deps: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Self> {
        let mut out = [0u8; prm::OUT_BYTES];
        // SAFETY: in/out mailboxes of the given lengths on a live DEVX context.
        let raw = unsafe {
            dv::mlx5dv_devx_obj_create(
                ctx.ctx.as_raw().cast(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        let Some(raw) = NonNull::new(raw) else {
            return Err(Error::Devx {
                call,
                errno: errno(),
                status: prm::get(&out, prm::cmd_out::STATUS) as u8,
                syndrome: prm::get(&out, prm::cmd_out::SYNDROME) as u32,
            });
        };
        Ok(Self {
            raw,
            what: call,
            number: prm::object_number(&out),
            _deps: deps,
            _ctx: ctx.clone(),
        })
    }

    /// The object's number from the create output (`cqn`, `qpn`).
    pub fn number(&self) -> u32 {
        self.number
    }

    /// Runs modify command `input` (a QP state transition).
    #[doc(alias = "mlx5dv_devx_obj_modify")]
    pub fn modify(&mut self, call: &'static str, input: &[u8]) -> Result<()> {
        let mut out = [0u8; prm::OUT_BYTES];
        // SAFETY: a live object and in/out mailboxes of the given lengths.
        let r = unsafe {
            dv::mlx5dv_devx_obj_modify(
                self.raw.as_ptr(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if r != 0 {
            return Err(Error::Devx {
                call,
                errno: if r > 0 { r } else { errno() },
                status: prm::get(&out, prm::cmd_out::STATUS) as u8,
                syndrome: prm::get(&out, prm::cmd_out::SYNDROME) as u32,
            });
        }
        prm::check_out(call, &out)
    }
}

impl Drop for DevxObject {
    fn drop(&mut self) {
        // SAFETY: created by `create`, destroyed once.
        let r = unsafe { dv::mlx5dv_devx_obj_destroy(self.raw.as_ptr()) };
        if r != 0 {
            tracing::warn!("destroying DEVX {} {:#x}: {r}", self.what, self.number);
        }
    }
}
