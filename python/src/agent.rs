//! The agent as a Python object: a thin layer over [`nixl::Agent`] that the pure-Python
//! `rdma_nixl._api` drives with NIXL's signatures.
//!
//! Every call that can block (backend creation, registration, metadata exchange over
//! TCP, loading a peer, posting and polling) runs with the GIL released.

use crate::descs;
use crate::device::GpuHandle;
use crate::errors::{nixlInvalidParamError, nixlNotFoundError, IntoPyResult};
use crate::etcd::{Fetched, Store};
use crate::xfer::{Dlist, Xfer};
use nixl::{Agent as RustAgent, AgentConfig, BackendParams, Desc, DescList, MemKind, XferOp};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

/// One registered descriptor, as `deregister_memory` names it again.
type RegKey = (MemKind, Desc);

/// `nixlAgent`.
#[derive(Debug)]
#[pyclass(module = "rdma_nixl._core", frozen)]
pub struct Agent {
    /// Dropped by hand (see `Drop`), under the caller's CUDA context.
    agent: std::mem::ManuallyDrop<RustAgent>,
    /// Registrations by descriptor (a stack per descriptor: registering the same range
    /// twice needs two deregistrations, as in NIXL). Each descriptor is registered on
    /// its own so that any subset can be deregistered.
    regs: Mutex<HashMap<RegKey, Vec<nixl::RegistrationHandle>>>,
    /// The central metadata store, when `NIXL_ETCD_ENDPOINTS` was set at creation.
    etcd: Option<Store>,
}

fn op(name: &str) -> PyResult<XferOp> {
    XferOp::parse(name).ok_or_else(|| {
        nixlInvalidParamError::new_err(format!("unknown operation `{name}` (READ or WRITE)"))
    })
}

fn mem_name(kind: MemKind) -> &'static str {
    match kind {
        MemKind::Dram => "DRAM_SEG",
        MemKind::Vram => "VRAM_SEG",
        MemKind::File => "FILE_SEG",
        MemKind::Block => "BLK_SEG",
        MemKind::Object => "OBJ_SEG",
    }
}

fn resolve(ip: &str, port: u16) -> PyResult<SocketAddr> {
    (ip, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| nixlInvalidParamError::new_err(format!("cannot resolve `{ip}` port {port}")))
}

impl Agent {
    /// The store the metadata calls without an address use (a
    /// `nixlInvalidParamError` without one, as NIXL's).
    fn store(&self, what: &str) -> PyResult<&Store> {
        self.etcd.as_ref().ok_or_else(|| {
            nixlInvalidParamError::new_err(format!(
                "{what}: no peer address given and no central metadata store configured (set NIXL_ETCD_ENDPOINTS)"
            ))
        })
    }

    fn backend_names(&self, names: &Option<Vec<String>>) -> PyResult<()> {
        if let Some(names) = names {
            let have = self.agent.backends();
            if let Some(missing) = names
                .iter()
                .find(|n| !have.iter().any(|b| b.name().eq_ignore_ascii_case(n)))
            {
                return Err(nixlNotFoundError::new_err(format!(
                    "backend `{missing}` was not created on this agent"
                )));
            }
        }
        Ok(())
    }
}

#[pymethods]
impl Agent {
    /// `listen_port` starts the metadata listener on every interface (0: any free port);
    /// `stall_timeout_s` bounds a transfer that makes no progress, `metadata_timeout_s`
    /// each metadata exchange over TCP, `etcd_timeout_s` each etcd request and a fetch's
    /// wait for a key (NIXL's `etcdWatchTimeout`). `NIXL_ETCD_ENDPOINTS` and
    /// `NIXL_ETCD_NAMESPACE` are read here, as NIXL reads them when an agent is made.
    #[new]
    #[pyo3(signature = (name, progress_thread=true, listen_port=None, stall_timeout_s=30.0, metadata_timeout_s=10.0, etcd_timeout_s=5.0))]
    fn new(
        py: Python<'_>,
        name: String,
        progress_thread: bool,
        listen_port: Option<u16>,
        stall_timeout_s: f64,
        metadata_timeout_s: f64,
        etcd_timeout_s: f64,
    ) -> PyResult<Self> {
        let _cuda = crate::keep_cuda_context();
        let seconds = |s: f64, what: &str| {
            Duration::try_from_secs_f64(s).map_err(|_| {
                nixlInvalidParamError::new_err(format!("{what} {s} s is not a duration"))
            })
        };
        // Fields added to AgentConfig later keep their defaults.
        #[allow(clippy::needless_update)]
        let config = AgentConfig {
            progress_thread,
            listen_addr: listen_port.map(|p| SocketAddr::from(([0, 0, 0, 0], p))),
            stall_timeout: seconds(stall_timeout_s, "stall timeout")?,
            metadata_timeout: seconds(metadata_timeout_s, "metadata timeout")?,
            ..AgentConfig::default()
        };
        let etcd_timeout = seconds(etcd_timeout_s, "etcd timeout")?;
        if etcd_timeout.is_zero() {
            return Err(nixlInvalidParamError::new_err(
                "the etcd timeout must be positive",
            ));
        }
        let agent = py.detach(|| RustAgent::new(name, config)).py_err()?;
        Ok(Self {
            agent: std::mem::ManuallyDrop::new(agent),
            regs: Mutex::new(HashMap::new()),
            etcd: Store::from_env(etcd_timeout),
        })
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> &str {
        self.agent.name()
    }

    /// The port the listener is bound to, or `None` without one.
    #[getter]
    fn listen_port(&self) -> Option<u16> {
        self.agent.listen_addr().map(|a| a.port())
    }

    /// Whether the metadata calls without an address go to etcd (`NIXL_ETCD_ENDPOINTS`
    /// was set when the agent was made, and this build has etcd).
    #[getter]
    fn etcd_configured(&self) -> bool {
        self.etcd.is_some()
    }

    /// Backend names this build can create.
    #[staticmethod]
    fn available_backends() -> Vec<&'static str> {
        RustAgent::available_backends()
    }

    /// Creates a backend; returns `(name, mem_types)`: the name peers see (a `FAULT`
    /// wrapper reports its inner backend's) and the kinds it registers (`"DRAM_SEG"`, …).
    fn create_backend(
        &self,
        py: Python<'_>,
        name: &str,
        params: HashMap<String, String>,
    ) -> PyResult<(String, Vec<&'static str>)> {
        let _cuda = crate::keep_cuda_context();
        let params: BackendParams = params;
        let backend = py
            .detach(|| self.agent.create_backend(name, &params))
            .py_err()?;
        Ok((
            backend.name().to_string(),
            backend
                .supported_mem()
                .iter()
                .map(|k| mem_name(*k))
                .collect(),
        ))
    }

    /// `(name, mem_types)` of every backend, in creation order.
    fn backends(&self) -> Vec<(String, Vec<&'static str>)> {
        self.agent
            .backends()
            .iter()
            .map(|b| {
                (
                    b.name().to_string(),
                    b.supported_mem().iter().map(|k| mem_name(*k)).collect(),
                )
            })
            .collect()
    }

    /// Registers every descriptor (with the named backends only, if given). All or
    /// nothing: on an error the ones already registered are released.
    ///
    /// The caller (Python) vouches that the memory stays valid until deregistered, as
    /// NIXL's API requires.
    #[pyo3(signature = (mem_type, packed, backends=None))]
    fn register(
        &self,
        py: Python<'_>,
        mem_type: u8,
        packed: &[u8],
        backends: Option<Vec<String>>,
    ) -> PyResult<()> {
        let _cuda = crate::keep_cuda_context();
        let list = descs::list(mem_type, packed)?;
        self.backend_names(&backends)?;
        let kind = list.kind();
        let done = py.detach(
            || -> nixl::Result<Vec<(RegKey, nixl::RegistrationHandle)>> {
                let only: Option<Vec<&str>> = backends
                    .as_ref()
                    .map(|v| v.iter().map(String::as_str).collect());
                let mut done = Vec::with_capacity(list.len());
                for (index, desc) in list.descs().iter().enumerate() {
                    let one = DescList::from_descs(kind, [*desc]);
                    // SAFETY: NIXL's Python API makes the caller responsible for keeping
                    // registered memory alive until deregister_memory (the buffers belong to
                    // numpy/torch/ctypes objects the caller holds).
                    let handle = unsafe { self.agent.register_mem(&one, only.as_deref()) }
                        .map_err(|e| renumber(e, index))?;
                    done.push(((kind, *desc), handle));
                }
                Ok(done)
            },
        );
        let done = done.py_err()?;
        let mut regs = self.regs.lock();
        for (key, handle) in done {
            regs.entry(key).or_default().push(handle);
        }
        Ok(())
    }

    /// Deregisters descriptors registered before (each exactly as registered). Raises
    /// `nixlNotFoundError` naming the first one that is not registered, changing nothing.
    #[pyo3(signature = (mem_type, packed, backends=None))]
    fn deregister(
        &self,
        py: Python<'_>,
        mem_type: u8,
        packed: &[u8],
        backends: Option<Vec<String>>,
    ) -> PyResult<()> {
        let _cuda = crate::keep_cuda_context();
        let list = descs::list(mem_type, packed)?;
        self.backend_names(&backends)?;
        let kind = list.kind();
        let mut released = Vec::with_capacity(list.len());
        {
            let mut regs = self.regs.lock();
            // Count first, so that a missing descriptor changes nothing.
            let mut wanted: HashMap<RegKey, usize> = HashMap::new();
            for (index, desc) in list.descs().iter().enumerate() {
                let n = wanted.entry((kind, *desc)).or_default();
                *n += 1;
                if regs.get(&(kind, *desc)).map_or(0, Vec::len) < *n {
                    return Err(nixlNotFoundError::new_err(format!(
                        "descriptor {index} ({kind:?} {:#x}+{} on device {}) is not registered",
                        desc.addr, desc.len, desc.dev_id
                    )));
                }
            }
            for desc in list.descs() {
                let key = (kind, *desc);
                if let Some(stack) = regs.get_mut(&key) {
                    released.extend(stack.pop());
                    if stack.is_empty() {
                        regs.remove(&key);
                    }
                }
            }
        }
        py.detach(|| drop(released));
        Ok(())
    }

    /// For each descriptor: `None` where `backend` has not registered it, else a dict
    /// `{"backend": name, "mode": how}` (`mode` e.g. `staged`/`direct`, or `""`).
    fn query_mem<'py>(
        &self,
        py: Python<'py>,
        mem_type: u8,
        packed: &[u8],
        backend: &str,
    ) -> PyResult<Vec<Option<Bound<'py, PyDict>>>> {
        let list = descs::list(mem_type, packed)?;
        self.backend_names(&Some(vec![backend.to_string()]))?;
        let found = py.detach(|| self.agent.query_mem(&list));
        found
            .into_iter()
            .map(|entry| {
                let Some(names) = entry else { return Ok(None) };
                let Some(hit) = names.iter().find(|n| {
                    let base = n.split('(').next().unwrap_or(n);
                    base.eq_ignore_ascii_case(backend)
                }) else {
                    return Ok(None);
                };
                let mode = hit
                    .split_once('(')
                    .map_or("", |(_, m)| m.trim_end_matches(')'));
                let d = PyDict::new(py);
                d.set_item("backend", backend)?;
                d.set_item("mode", mode)?;
                Ok(Some(d))
            })
            .collect()
    }

    /// NIXL's `queryMem` answered by the backend from each descriptor's metadata (e.g.
    /// `POSIX`: a file path): per descriptor `None` where the thing named does not exist,
    /// else the backend's dict (`size`, `mode`, `mtime` for files). `None` for the whole
    /// list where the backend has no such queries (the caller then answers from the
    /// registrations, `query_mem`).
    fn query_mem_info<'py>(
        &self,
        py: Python<'py>,
        mem_type: u8,
        metas: Vec<Vec<u8>>,
        backend: &str,
    ) -> PyResult<Option<Vec<Option<Bound<'py, PyDict>>>>> {
        let kind = descs::kind(mem_type)?;
        let meta: Vec<&[u8]> = metas.iter().map(Vec::as_slice).collect();
        let answers = match py.detach(|| self.agent.query_mem_info(backend, kind, &meta)) {
            Err(nixl::Error::NotSupported { .. }) => return Ok(None),
            other => other.py_err()?,
        };
        answers
            .into_iter()
            .map(|entry| {
                let Some(info) = entry else { return Ok(None) };
                let d = PyDict::new(py);
                for (k, v) in info {
                    d.set_item(k, v)?;
                }
                Ok(Some(d))
            })
            .collect::<PyResult<Vec<_>>>()
            .map(Some)
    }

    /// Full metadata.
    fn local_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let blob = py.detach(|| self.agent.local_metadata()).py_err()?;
        Ok(PyBytes::new(py, &blob))
    }

    /// Partial metadata: the registrations covering the descriptors (none for an empty
    /// list), and connection information if `inc_conn_info`.
    fn partial_metadata<'py>(
        &self,
        py: Python<'py>,
        mem_type: u8,
        packed: &[u8],
        inc_conn_info: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let list = descs::list(mem_type, packed)?;
        let blob = py
            .detach(|| {
                self.agent
                    .local_partial_metadata((!list.is_empty()).then_some(&list), inc_conn_info)
            })
            .py_err()?;
        Ok(PyBytes::new(py, &blob))
    }

    /// Loads a peer's metadata; returns its name.
    fn load_remote_metadata(&self, py: Python<'_>, blob: &[u8]) -> PyResult<String> {
        let _cuda = crate::keep_cuda_context();
        py.detach(|| self.agent.load_remote_metadata(blob)).py_err()
    }

    /// Forgets a peer and disconnects it; returns whether it was known.
    fn invalidate_remote(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        let _cuda = crate::keep_cuda_context();
        match py.detach(|| self.agent.invalidate_remote(name)) {
            Ok(()) => Ok(true),
            Err(nixl::Error::UnknownAgent(_)) => Ok(false),
            Err(e) => Err(crate::errors::to_py(e)),
        }
    }

    /// Whether the peer's metadata is loaded (and, for a non-empty list, covers every
    /// descriptor of it).
    fn has_remote(
        &self,
        py: Python<'_>,
        name: &str,
        mem_type: u8,
        packed: &[u8],
    ) -> PyResult<bool> {
        let list = descs::list(mem_type, packed)?;
        // Preparing the list resolves every descriptor (and may set up device tables).
        Ok(py.detach(|| {
            self.agent.has_remote(name)
                && (list.is_empty() || self.agent.prep_xfer_dlist(Some(name), &list).is_ok())
        }))
    }

    /// Pushes the full metadata to the listener at `ip:port`.
    fn send_local_metadata(&self, py: Python<'_>, ip: &str, port: u16) -> PyResult<()> {
        let addr = resolve(ip, port)?;
        py.detach(|| self.agent.send_local_metadata(addr)).py_err()
    }

    /// Pushes partial metadata to the listener at `ip:port`.
    #[allow(clippy::too_many_arguments)]
    fn send_partial_metadata(
        &self,
        py: Python<'_>,
        mem_type: u8,
        packed: &[u8],
        inc_conn_info: bool,
        ip: &str,
        port: u16,
    ) -> PyResult<()> {
        let list = descs::list(mem_type, packed)?;
        let addr = resolve(ip, port)?;
        py.detach(|| {
            self.agent.send_local_partial_metadata(
                addr,
                (!list.is_empty()).then_some(&list),
                inc_conn_info,
            )
        })
        .py_err()
    }

    /// Fetches and loads the metadata of the agent listening at `ip:port`; returns its name.
    fn fetch_remote_metadata(&self, py: Python<'_>, ip: &str, port: u16) -> PyResult<String> {
        let _cuda = crate::keep_cuda_context();
        let addr = resolve(ip, port)?;
        py.detach(|| self.agent.fetch_remote_metadata(addr))
            .py_err()
    }

    /// Tells the agent listening at `ip:port` to forget this one.
    fn invalidate_local_metadata(&self, py: Python<'_>, ip: &str, port: u16) -> PyResult<()> {
        let addr = resolve(ip, port)?;
        py.detach(|| self.agent.invalidate_local_metadata(addr))
            .py_err()
    }

    /// Publishes the full metadata to etcd (`{namespace}/{name}/metadata`).
    fn etcd_send_local_metadata(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.store("sendLocalMD")?;
        py.detach(|| store.publish(&self.agent)).py_err()
    }

    /// Publishes partial metadata to etcd under `label` (required).
    fn etcd_send_partial_metadata(
        &self,
        py: Python<'_>,
        mem_type: u8,
        packed: &[u8],
        inc_conn_info: bool,
        label: &str,
    ) -> PyResult<()> {
        let list = descs::list(mem_type, packed)?;
        let store = self.store("sendLocalPartialMD")?;
        py.detach(|| {
            store.publish_partial(
                &self.agent,
                label,
                (!list.is_empty()).then_some(&list),
                inc_conn_info,
            )
        })
        .py_err()
    }

    /// Fetches `remote`'s metadata from etcd (`label`; empty: the full metadata) and
    /// watches the peer. `True`: loaded; `False`: not published yet, waited for in the
    /// background (poll `has_remote`).
    fn etcd_fetch_remote_metadata(
        &self,
        py: Python<'_>,
        remote: &str,
        label: &str,
    ) -> PyResult<bool> {
        let _cuda = crate::keep_cuda_context();
        let store = self.store("fetchRemoteMD")?;
        let fetched = py
            .detach(|| store.fetch(&self.agent, remote, label))
            .py_err()?;
        Ok(fetched == Fetched::Loaded)
    }

    /// Removes this agent's keys from etcd (peers watching it invalidate it).
    fn etcd_invalidate_local_metadata(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.store("invalidateLocalMD")?;
        py.detach(|| store.unpublish()).py_err()
    }

    /// Validates a list once for many transfers: `agent` is `None` for local memory, a
    /// peer's name (or this agent's own, for loopback) for the remote side.
    #[pyo3(signature = (agent, mem_type, packed))]
    fn prep_xfer_dlist(
        &self,
        py: Python<'_>,
        agent: Option<String>,
        mem_type: u8,
        packed: &[u8],
    ) -> PyResult<Dlist> {
        let _cuda = crate::keep_cuda_context();
        let list = descs::list(mem_type, packed)?;
        let prepared = py
            .detach(|| self.agent.prep_xfer_dlist(agent.as_deref(), &list))
            .py_err()?;
        Ok(Dlist::new(prepared))
    }

    /// A request from prepared lists by index (`local_idx`/`remote_idx`: little-endian
    /// i64 byte strings).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (operation, local, local_idx, remote, remote_idx, notif=None, backend=None))]
    fn make_xfer_req(
        &self,
        py: Python<'_>,
        operation: &str,
        local: &Dlist,
        local_idx: &[u8],
        remote: &Dlist,
        remote_idx: &[u8],
        notif: Option<Vec<u8>>,
        backend: Option<String>,
    ) -> PyResult<Xfer> {
        let _cuda = crate::keep_cuda_context();
        let op = op(operation)?;
        let local_idx = descs::indices(local_idx, "local")?;
        let remote_idx = descs::indices(remote_idx, "remote")?;
        if std::ptr::eq(local, remote) {
            return Err(nixlInvalidParamError::new_err(
                "the same prepared list was given for both sides (prepare the local side with NIXL_INIT_AGENT and the remote side with the peer's name)",
            ));
        }
        let local_guard = local.lock()?;
        let remote_guard = remote.lock()?;
        let (Some(l), Some(r)) = (local_guard.as_ref(), remote_guard.as_ref()) else {
            return Err(nixlInvalidParamError::new_err(
                "a prepared list was released",
            ));
        };
        let req = py
            .detach(|| {
                self.agent.make_xfer_req(
                    op,
                    l,
                    &local_idx,
                    r,
                    &remote_idx,
                    notif,
                    backend.as_deref(),
                )
            })
            .py_err()?;
        Ok(Xfer::new(req))
    }

    /// Prepares both lists and makes the request (descriptor i to descriptor i).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (operation, local_type, local, remote_type, remote, agent, notif=None, backend=None))]
    fn create_xfer_req(
        &self,
        py: Python<'_>,
        operation: &str,
        local_type: u8,
        local: &[u8],
        remote_type: u8,
        remote: &[u8],
        agent: &str,
        notif: Option<Vec<u8>>,
        backend: Option<String>,
    ) -> PyResult<Xfer> {
        let _cuda = crate::keep_cuda_context();
        let op = op(operation)?;
        let local = descs::list(local_type, local)?;
        let remote = descs::list(remote_type, remote)?;
        let req = py
            .detach(|| {
                if local.len() != remote.len() {
                    return Err(nixl::Error::Mismatch(format!(
                        "{} local descriptors but {} remote",
                        local.len(),
                        remote.len()
                    )));
                }
                let l = self.agent.prep_xfer_dlist(None, &local)?;
                let r = self.agent.prep_xfer_dlist(Some(agent), &remote)?;
                let idx: Vec<usize> = (0..local.len()).collect();
                self.agent
                    .make_xfer_req(op, &l, &idx, &r, &idx, notif, backend.as_deref())
            })
            .py_err()?;
        Ok(Xfer::new(req))
    }

    /// A memory view of a list for kernels (NIXL's `prepMemView`): `agent` `None` for
    /// local memory (sources of `nixlPut`), a peer's name (or this agent's own) for its
    /// memory (targets of `nixlPut` / `nixlAtomicAdd`). `backend` names the backend;
    /// `None` takes the first whose device API accepts the list.
    #[pyo3(signature = (agent, mem_type, packed, backend=None))]
    fn prep_mem_view(
        &self,
        py: Python<'_>,
        agent: Option<String>,
        mem_type: u8,
        packed: &[u8],
        backend: Option<String>,
    ) -> PyResult<GpuHandle> {
        let _cuda = crate::keep_cuda_context();
        let list = descs::list(mem_type, packed)?;
        if list.is_empty() {
            return Err(nixlInvalidParamError::new_err(
                "a memory view needs at least one descriptor",
            ));
        }
        let view = py
            .detach(|| {
                let prepared = self.agent.prep_xfer_dlist(agent.as_deref(), &list)?;
                self.agent.prep_mem_view(&prepared, backend.as_deref())
            })
            .py_err()?;
        Ok(GpuHandle::from_mem_view(view))
    }

    /// Sends a standalone notification.
    fn gen_notif(&self, py: Python<'_>, agent: &str, msg: &[u8]) -> PyResult<()> {
        let _cuda = crate::keep_cuda_context();
        py.detach(|| self.agent.gen_notif(agent, msg)).py_err()
    }

    /// Notifications received since the last call: `{sender: [message, …]}`.
    fn get_notifs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let notifs = py.detach(|| self.agent.get_notifs());
        notif_dict(py, notifs)
    }

    /// [`Agent::get_notifs`] that blocks (GIL released, no CPU used) until at least one
    /// notification is there or `timeout_s` seconds have passed (then `{}`). The wait is
    /// cut into slices of [`SIGNAL_CHECK`] between which Python's signal handlers run, so
    /// Ctrl-C interrupts a long wait.
    fn wait_notifs<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyDict>> {
        let timeout = Duration::try_from_secs_f64(timeout_s).map_err(|_| {
            nixlInvalidParamError::new_err(format!("timeout {timeout_s} s is not a duration"))
        })?;
        let start = std::time::Instant::now();
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            let notifs = py.detach(|| self.agent.wait_notifs(left.min(SIGNAL_CHECK)));
            if !notifs.is_empty() || left <= SIGNAL_CHECK {
                return notif_dict(py, notifs);
            }
            py.check_signals()?;
        }
    }

    /// Cancels every request, forgets every peer, stops the listener. Idempotent.
    /// The etcd client goes first: its lease is revoked, so this agent's keys go.
    fn shutdown(&self, py: Python<'_>) {
        let _cuda = crate::keep_cuda_context();
        py.detach(|| {
            if let Some(store) = &self.etcd {
                store.close();
            }
            self.agent.shutdown()
        });
    }
}

/// Longest a `wait_notifs` call stays without the GIL before Python's signal handlers
/// run (a Ctrl-C waits at most this long).
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

fn notif_dict(
    py: Python<'_>,
    notifs: HashMap<String, Vec<Vec<u8>>>,
) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for (agent, msgs) in notifs {
        let list: Vec<Bound<'_, PyBytes>> = msgs.iter().map(|m| PyBytes::new(py, m)).collect();
        out.set_item(agent, list)?;
    }
    Ok(out)
}

/// Errors of a one-descriptor registration name descriptor 0: give the list position.
fn renumber(e: nixl::Error, at: usize) -> nixl::Error {
    use nixl::Error as E;
    match e {
        E::ZeroLength { .. } => E::ZeroLength { index: at },
        E::Overflow { addr, len, .. } => E::Overflow {
            index: at,
            addr,
            len,
        },
        E::NotDeviceMemory {
            addr,
            len,
            dev_id,
            reason,
            ..
        } => E::NotDeviceMemory {
            index: at,
            addr,
            len,
            dev_id,
            reason,
        },
        other => other,
    }
}

/// Registrations and the agent (its backends, streams and mappings) go with the caller's
/// CUDA context kept: Python drops objects on whatever thread holds the last reference,
/// and tearing down a backend binds its GPUs' contexts.
impl Drop for Agent {
    fn drop(&mut self) {
        let _cuda = crate::keep_cuda_context();
        self.regs.get_mut().clear();
        // SAFETY: dropped exactly once, here; `self` is never used after `drop`.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.agent) };
    }
}
