//! The agent's half of the GPU device API: GPU request handles and memory views
//! (see [`crate::device`]).

use super::{Agent, LocalReg, RemoteReg, XferDlist, XferReq};
use crate::backend::{ViewEntry, ViewMd};
use crate::device::{GpuHandle, GpuXferReqH, MemViewH};
use crate::error::{Error, Result};
use std::sync::Arc;

impl XferReq {
    /// A handle for kernels to post this request's descriptors themselves (NIXL's
    /// `createGpuXferReq`): descriptor `i` of the request is `desc_idx` `i` of
    /// `nixlGpuPostSingleWriteXferReq` / `nixlGpuPostSignalXferReq`. It keeps the
    /// registrations alive; dropping it is `releaseGpuXferReq`. The request's backend
    /// must have a device API (`GPUNETIO`), else [`Error::NotSupported`].
    #[doc(alias = "createGpuXferReq")]
    pub fn create_gpu_xfer_req(&self) -> Result<GpuXferReqH> {
        let mut slot = self.slot.lock();
        let Some(inner) = slot.as_mut() else {
            return Err(Error::Canceled);
        };
        let handle = inner.gpu_xfer_req().map_err(|e| match e {
            Error::NotSupported { what, .. } => Error::NotSupported {
                backend: self.backend.name().to_string(),
                what,
            },
            other => other,
        })?;
        let keep = (self._keep_local.clone(), self._keep_remote.clone());
        Ok(GpuXferReqH(GpuHandle::new(
            handle.raw(),
            Box::new((handle, keep)),
        )))
    }
}

impl Agent {
    /// Releases a GPU request handle (NIXL's `releaseGpuXferReq`; dropping it is the same).
    #[doc(alias = "releaseGpuXferReq")]
    pub fn release_gpu_xfer_req(&self, handle: GpuXferReqH) {
        drop(handle);
    }

    /// A memory view of a prepared list for kernels (NIXL's `prepMemView`): element `i`
    /// is the list's descriptor `i`. A list prepared with a peer's name is a remote view
    /// (targets of `nixlPut` and `nixlAtomicAdd`, `nixlGetPtr` where mapped here); a
    /// local list is a local view (sources of `nixlPut`). `backend` names the backend;
    /// `None` takes the first whose device API accepts the list. Dropping the view is
    /// `releaseMemView`.
    #[doc(alias = "prepMemView")]
    pub fn prep_mem_view(&self, list: &XferDlist, backend: Option<&str>) -> Result<MemViewH> {
        if list.descs.is_empty() {
            return Err(Error::InvalidParam(
                "a memory view needs at least one descriptor".into(),
            ));
        }
        if self.is_shut_down() {
            return Err(Error::Canceled);
        }
        let refreshed = match list.agent.as_deref() {
            Some(peer) => self.current_remote_list(peer, list)?.0,
            None => None,
        };
        let list = refreshed.as_ref().unwrap_or(list);
        if list.agent.is_none() {
            if let Some(index) = (0..list.descs.len()).find(|&i| list.is_released(i)) {
                return Err(list.deregistered(index));
            }
        }
        let backends = self.backends();
        let candidates: Vec<usize> = match backend {
            Some(name) => vec![backends
                .iter()
                .position(|b| b.name().eq_ignore_ascii_case(name))
                .ok_or_else(|| Error::UnknownBackend(name.to_string()))?],
            None => (0..backends.len()).collect(),
        };
        let mut last = None;
        for bi in candidates {
            // Element i is descriptor i, in the registration its slot names.
            let entries: Option<Vec<ViewEntry<'_>>> = match list.agent {
                None => list
                    .slots
                    .iter()
                    .zip(&list.descs)
                    .map(|(&slot, d)| {
                        let reg = list.local_regs.get(slot as usize)?;
                        Some(ViewEntry {
                            desc: *d,
                            region: &reg.region,
                            md: ViewMd::Local(reg.mds.get(bi)?.as_deref()?),
                        })
                    })
                    .collect(),
                Some(_) => list
                    .slots
                    .iter()
                    .zip(&list.descs)
                    .map(|(&slot, d)| {
                        let reg = list.remote_regs.get(slot as usize)?;
                        Some(ViewEntry {
                            desc: *d,
                            region: &reg.region,
                            md: ViewMd::Remote(reg.mds.get(bi)?.as_deref()?),
                        })
                    })
                    .collect(),
            };
            let Some(entries) = entries else {
                last = Some(Error::InvalidParam(format!(
                    "backend {} has not registered every descriptor of the list",
                    backends[bi].name()
                )));
                continue;
            };
            match backends[bi].prep_mem_view(list.agent.as_deref(), &entries) {
                Ok(handle) => {
                    let keep: (Vec<Arc<LocalReg>>, Vec<Arc<RemoteReg>>) =
                        (list.local_regs.clone(), list.remote_regs.clone());
                    return Ok(MemViewH(GpuHandle::new(
                        handle.raw(),
                        Box::new((handle, keep)),
                    )));
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::NotSupported {
            backend: "any backend of this agent".into(),
            what: "memory views (the device API)".into(),
        }))
    }

    /// Releases a memory view (NIXL's `releaseMemView`; dropping it is the same).
    #[doc(alias = "releaseMemView")]
    pub fn release_mem_view(&self, view: MemViewH) {
        drop(view);
    }
}
