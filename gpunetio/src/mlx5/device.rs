//! Finding an mlx5 device that the native handler can use (a leaf module of `mlx5`).

use crate::error::{Error, Result};

/// An mlx5 RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mlx5Device {
    /// The verbs device name (`mlx5_0`).
    pub name: String,
    /// Whether a DEVX context opens on it (`mlx5dv_open_device` with
    /// `MLX5DV_CONTEXT_FLAGS_DEVX`): needed to create GPU-resident queues.
    pub devx: bool,
}

/// Every verbs device, with whether it is an mlx5 device (`mlx5dv_is_supported`) and
/// then whether DEVX opens on it; non-mlx5 devices are listed with `None`.
#[cfg(feature = "mlx5")]
#[doc(alias = "mlx5dv_is_supported")]
pub fn devices() -> Result<Vec<(String, Option<Mlx5Device>)>> {
    use mlx5dv_sys as dv;
    let list = ibverbs::devices().map_err(|source| Error::Verbs {
        context: "listing RDMA devices".into(),
        source,
    })?;
    let mut out = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        // SAFETY: a device of a live list.
        let is_mlx5 = unsafe { dv::mlx5dv_is_supported(dev.as_raw()) };
        if !is_mlx5 {
            out.push((name, None));
            continue;
        }
        let mut attr = dv::mlx5dv_context_attr {
            flags: dv::MLX5DV_CONTEXT_FLAGS_DEVX,
            comp_mask: 0,
        };
        // SAFETY: a device of a live list and a valid attribute struct.
        let ctx = unsafe { dv::mlx5dv_open_device(dev.as_raw(), &mut attr) };
        let devx = !ctx.is_null();
        if devx {
            // SAFETY: opened just above, closed once.
            let r = unsafe { dv::ibverbs_sys::ibv_close_device(ctx) };
            if r != 0 {
                tracing::warn!("ibv_close_device({name}) after the DEVX probe: {r}");
            }
        }
        out.push((name.clone(), Some(Mlx5Device { name, devx })));
    }
    Ok(out)
}

/// The first mlx5 device that opens with DEVX, or [`Error::Unsupported`] saying why the
/// native mlx5 handler cannot run here (no RDMA device, no mlx5 device, no DEVX).
pub fn probe() -> Result<Mlx5Device> {
    #[cfg(feature = "mlx5")]
    {
        let all = devices()?;
        if all.is_empty() {
            return Err(Error::Unsupported(
                "native mlx5 handler: no RDMA device on this machine".into(),
            ));
        }
        let mut mlx5_without_devx = Vec::new();
        for (_, dev) in &all {
            match dev {
                Some(d) if d.devx => return Ok(d.clone()),
                Some(d) => mlx5_without_devx.push(d.name.clone()),
                None => {}
            }
        }
        let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
        if mlx5_without_devx.is_empty() {
            Err(Error::Unsupported(format!(
                "native mlx5 handler: no mlx5 (ConnectX) device among {names:?}"
            )))
        } else {
            Err(Error::Unsupported(format!(
                "native mlx5 handler: DEVX does not open on {mlx5_without_devx:?} (kernel without DEVX, or missing permissions)"
            )))
        }
    }
    #[cfg(not(feature = "mlx5"))]
    {
        Err(Error::Unsupported(
            "native mlx5 handler: gpunetio was built without the `mlx5` feature".into(),
        ))
    }
}
