//! NVML, where it is installed, loaded at run time for the one thing the CUDA driver does
//! not say: whether two GPUs are joined by NVLink. The crate links nothing, so NVML is
//! opened with `dlopen` (it ships with the driver as `libnvidia-ml.so.1`, but containers
//! may lack it); without it the answer is "unknown" and callers rely on the driver's
//! peer attributes alone.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::OnceLock;

/// `nvmlReturn_t`: 0 is success.
const NVML_SUCCESS: c_int = 0;
/// `NVML_P2P_CAPS_INDEX_NVLINK` of `nvmlGpuP2PCapsIndex_t`.
const NVML_P2P_CAPS_INDEX_NVLINK: c_uint = 2;
/// `NVML_P2P_STATUS_OK` of `nvmlGpuP2PStatus_t`.
const NVML_P2P_STATUS_OK: c_uint = 0;

type NvmlDevice = *mut c_void;
type GetHandleByPciBusId = unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> c_int;
type GetP2PStatus = unsafe extern "C" fn(NvmlDevice, NvmlDevice, c_uint, *mut c_uint) -> c_int;

/// The entry points used, from a library initialised once and never unloaded (NVML is
/// process-wide and cheap to keep).
struct Nvml {
    handle_by_pci_bus_id: GetHandleByPciBusId,
    p2p_status: GetP2PStatus,
}

fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(load).as_ref()
}

fn load() -> Option<Nvml> {
    let name = CString::new("libnvidia-ml.so.1").ok()?;
    // SAFETY: dlopen takes a NUL-terminated name and flags; a null result is handled.
    let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        tracing::debug!("no NVML (libnvidia-ml.so.1): NVLink cannot be told from PCIe");
        return None;
    }
    let sym = |s: &str| -> Option<*mut c_void> {
        let c = CString::new(s).ok()?;
        // SAFETY: `lib` is a live handle from dlopen; `c` is NUL-terminated.
        let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let init = sym("nvmlInit_v2")?;
    let by_bus = sym("nvmlDeviceGetHandleByPciBusId_v2")?;
    let p2p = sym("nvmlDeviceGetP2PStatus")?;
    // SAFETY: the symbols have these C signatures in every NVML since the v2 entry points
    // (nvml.h): `nvmlReturn_t nvmlInit_v2(void)`,
    // `nvmlDeviceGetHandleByPciBusId_v2(const char *, nvmlDevice_t *)`,
    // `nvmlDeviceGetP2PStatus(nvmlDevice_t, nvmlDevice_t, nvmlGpuP2PCapsIndex_t,
    // nvmlGpuP2PStatus_t *)`, enums being C ints.
    let (init, handle_by_pci_bus_id, p2p_status) = unsafe {
        (
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(init),
            std::mem::transmute::<*mut c_void, GetHandleByPciBusId>(by_bus),
            std::mem::transmute::<*mut c_void, GetP2PStatus>(p2p),
        )
    };
    // SAFETY: nvmlInit_v2 takes no arguments; it may be called from any thread.
    let rc = unsafe { init() };
    if rc != NVML_SUCCESS {
        tracing::debug!("nvmlInit_v2 failed ({rc}): NVLink cannot be told from PCIe");
        return None;
    }
    Some(Nvml {
        handle_by_pci_bus_id,
        p2p_status,
    })
}

/// Whether the GPUs at these PCI bus ids (as `cuDeviceGetPCIBusId` writes them) are
/// joined by NVLink; `None` where NVML is absent or cannot tell.
pub(crate) fn nvlink_between(bus_a: &str, bus_b: &str) -> Option<bool> {
    let nvml = nvml()?;
    let handle = |bus: &str| -> Option<NvmlDevice> {
        let c = CString::new(bus).ok()?;
        let mut dev: NvmlDevice = std::ptr::null_mut();
        // SAFETY: `c` is NUL-terminated, `dev` a valid out-pointer.
        let rc = unsafe { (nvml.handle_by_pci_bus_id)(c.as_ptr(), &mut dev) };
        (rc == NVML_SUCCESS && !dev.is_null()).then_some(dev)
    };
    let (a, b) = (handle(bus_a)?, handle(bus_b)?);
    let mut status: c_uint = u32::MAX;
    // SAFETY: both handles came from NVML; `status` is a valid out-pointer.
    let rc = unsafe { (nvml.p2p_status)(a, b, NVML_P2P_CAPS_INDEX_NVLINK, &mut status) };
    (rc == NVML_SUCCESS).then_some(status == NVML_P2P_STATUS_OK)
}
