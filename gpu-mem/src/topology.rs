//! How two GPUs of this process reach each other: whether one can access the other's
//! memory directly (peer access, over NVLink or PCIe), how the driver ranks the link,
//! whether atomics work across it, and — where NVML is installed — whether it is NVLink.
//! [`enable_peer_access`] turns peer access on between the primary contexts, so that
//! copies and kernels of one GPU reach the other's memory over the link instead of being
//! staged through host memory by the driver.

use crate::error::{cvt, cvt_ctx, Error, Result};
use crate::gpu::{driver, Gpu};
use cudarc::driver::sys::{self, CUdevice_P2PAttribute};

/// The physical link between two GPUs, as far as it can be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerLink {
    /// Both are the same GPU.
    SameGpu,
    /// NVLink (NVML says so).
    NvLink,
    /// Peer access over PCIe (NVML says the pair has no NVLink).
    Pcie,
    /// Peer access over a link of unknown kind (no NVML on this machine).
    Peer,
    /// No peer access at all: data between them goes through host memory.
    None,
}

impl PeerLink {
    /// A short lowercase name (`nvlink`, `pcie`, `peer`, `same-gpu`, `none`).
    pub fn as_str(&self) -> &'static str {
        match self {
            PeerLink::SameGpu => "same-gpu",
            PeerLink::NvLink => "nvlink",
            PeerLink::Pcie => "pcie",
            PeerLink::Peer => "peer",
            PeerLink::None => "none",
        }
    }

    /// Whether one GPU can address the other's memory directly.
    pub fn is_direct(&self) -> bool {
        !matches!(self, PeerLink::None)
    }
}

impl std::fmt::Display for PeerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the driver (and NVML, where present) says of the pair `from` → `to`: `from`'s
/// copies and kernels using `to`'s memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerTopology {
    /// The accessing GPU's ordinal.
    pub from: usize,
    /// The GPU whose memory is accessed.
    pub to: usize,
    /// `cuDeviceCanAccessPeer`: peer access can be enabled.
    pub can_access_peer: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`: the driver's relative rank of the link
    /// (lower is faster; 0 for the same GPU).
    pub performance_rank: i32,
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`.
    pub access_supported: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: atomics on the peer's memory
    /// are native (not emulated or unsupported).
    pub native_atomics: bool,
    /// The link, as far as it can be told.
    pub link: PeerLink,
}

impl PeerTopology {
    /// One line for logs and reports: `GPU 0 -> GPU 1: nvlink (rank 0, atomics)`.
    pub fn describe(&self) -> String {
        format!(
            "GPU {} -> GPU {}: {} (peer access {}, rank {}, {} atomics)",
            self.from,
            self.to,
            self.link,
            if self.can_access_peer {
                "possible"
            } else {
                "impossible"
            },
            self.performance_rank,
            if self.native_atomics {
                "native"
            } else {
                "no native"
            },
        )
    }
}

/// Reads the pair's peer attributes (and NVML's word on NVLink, where NVML loads).
#[doc(alias = "cuDeviceGetP2PAttribute")]
#[doc(alias = "cuDeviceCanAccessPeer")]
pub fn peer_topology(from: &Gpu, to: &Gpu) -> Result<PeerTopology> {
    driver()?;
    if from.ordinal() == to.ordinal() {
        return Ok(PeerTopology {
            from: from.ordinal(),
            to: to.ordinal(),
            can_access_peer: true,
            performance_rank: 0,
            access_supported: true,
            native_atomics: true,
            link: PeerLink::SameGpu,
        });
    }
    let can_access_peer = from.can_access_peer(to)?;
    let attr = |a: CUdevice_P2PAttribute| -> Result<i32> {
        let mut v = 0;
        cvt_ctx(
            "cuDeviceGetP2PAttribute",
            // SAFETY: `v` is a valid out-pointer; both device handles come from cudarc.
            unsafe {
                sys::cuDeviceGetP2PAttribute(
                    &mut v,
                    a,
                    from.context().cu_device(),
                    to.context().cu_device(),
                )
            },
            || format!("{a:?} of GPU {} -> GPU {}", from.ordinal(), to.ordinal()),
        )?;
        Ok(v)
    };
    let performance_rank = attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?;
    let access_supported =
        attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)? != 0;
    let native_atomics =
        attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0;
    let nvlink = match (from.pci_bus_id(), to.pci_bus_id()) {
        (Ok(a), Ok(b)) => crate::nvml::nvlink_between(&a, &b),
        _ => None,
    };
    Ok(PeerTopology {
        from: from.ordinal(),
        to: to.ordinal(),
        can_access_peer,
        performance_rank,
        access_supported,
        native_atomics,
        link: classify_link(can_access_peer && access_supported, nvlink),
    })
}

/// The link from what the driver says (`direct`: peer access possible) and what NVML
/// says of NVLink (`None`: no NVML, or it could not tell).
pub(crate) fn classify_link(direct: bool, nvlink: Option<bool>) -> PeerLink {
    match (direct, nvlink) {
        (false, _) => PeerLink::None,
        (true, Some(true)) => PeerLink::NvLink,
        (true, Some(false)) => PeerLink::Pcie,
        (true, None) => PeerLink::Peer,
    }
}

/// Lets `from`'s context (its primary context: every stream, kernel and mapping of this
/// crate and of cudarc uses it) access memory of `to`'s, so that `from`'s copy engines
/// and kernels reach `to`'s memory over the link. Idempotent (peer access already enabled
/// is success) and a no-op for the same GPU. A pair without peer access is
/// [`Error::NoPeerAccess`]. Enables one direction only: call it both ways for both.
#[doc(alias = "cuCtxEnablePeerAccess")]
pub fn enable_peer_access(from: &Gpu, to: &Gpu) -> Result<()> {
    driver()?;
    if from.ordinal() == to.ordinal() {
        return Ok(());
    }
    if !from.can_access_peer(to)? {
        return Err(Error::NoPeerAccess {
            from: from.ordinal(),
            to: to.ordinal(),
        });
    }
    from.bind()?;
    // SAFETY: `from`'s context is current; `to`'s context is a live primary context
    // retained by `to`; flags must be 0.
    match unsafe { sys::cuCtxEnablePeerAccess(to.context().cu_ctx(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        sys::CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
        | sys::CUresult::CUDA_ERROR_TOO_MANY_PEERS => Err(Error::NoPeerAccess {
            from: from.ordinal(),
            to: to.ordinal(),
        }),
        other => cvt("cuCtxEnablePeerAccess", other),
    }
}

/// The device of the context current on the calling thread, if one is (a framework such
/// as torch makes its device's context current once it has initialised CUDA there).
#[doc(alias = "cuCtxGetCurrent")]
pub fn current_device() -> Result<Option<usize>> {
    driver()?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer.
    cvt("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    if ctx.is_null() {
        return Ok(None);
    }
    let mut dev = 0;
    // SAFETY: a context is current; `dev` is a valid out-pointer.
    cvt("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
    Ok(usize::try_from(dev).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_follows_peer_access_then_nvml() {
        assert_eq!(classify_link(false, Some(true)), PeerLink::None);
        assert_eq!(classify_link(false, None), PeerLink::None);
        assert_eq!(classify_link(true, Some(true)), PeerLink::NvLink);
        assert_eq!(classify_link(true, Some(false)), PeerLink::Pcie);
        assert_eq!(classify_link(true, None), PeerLink::Peer);
        assert!(!PeerLink::None.is_direct());
        assert!(PeerLink::Pcie.is_direct() && PeerLink::SameGpu.is_direct());
        assert_eq!(PeerLink::NvLink.to_string(), "nvlink");
    }

    #[test]
    fn a_pair_is_described_in_one_line() {
        let t = PeerTopology {
            from: 0,
            to: 1,
            can_access_peer: true,
            performance_rank: 0,
            access_supported: true,
            native_atomics: true,
            link: PeerLink::NvLink,
        };
        assert_eq!(
            t.describe(),
            "GPU 0 -> GPU 1: nvlink (peer access possible, rank 0, native atomics)"
        );
    }

    #[test]
    fn without_a_driver_calls_are_typed_errors() {
        if crate::is_available() {
            return;
        }
        assert!(matches!(current_device(), Err(Error::NoDriver)));
    }
}
