//! `LOCAL`: transfers between two DRAM buffers of the same agent, by `memcpy`.
//!
//! The loopback path that needs no transport (NIXL's storage backends are local-only in
//! the same way). Notifications to the agent itself are queued directly.

use crate::agent::Agent;
use crate::backend::{
    Backend, BackendParams, BackendXfer, Capabilities, LocalMd, PostParams, RemoteMd, XferEntry,
    XferOp, XferProgress, XferStatus,
};
use crate::error::{Error, Result};
use crate::mem::{MemKind, Region};
use std::any::Any;
use std::sync::{Arc, Mutex};

/// The backend's name.
pub const NAME: &str = "LOCAL";

/// The memcpy backend.
#[derive(Debug)]
pub struct LocalBackend {
    agent_name: String,
    notifs: NotifQueue,
}

type NotifQueue = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

pub(crate) fn create(agent: &Agent, params: &BackendParams) -> Result<Arc<dyn Backend>> {
    if let Some(key) = params.keys().next() {
        return Err(Error::InvalidParam(format!(
            "{NAME} takes no parameters (got `{key}`)"
        )));
    }
    Ok(Arc::new(LocalBackend {
        agent_name: agent.name().to_string(),
        notifs: NotifQueue::default(),
    }))
}

#[derive(Debug)]
struct Md;

impl LocalMd for Md {
    fn public_md(&self) -> Vec<u8> {
        Vec::new()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl RemoteMd for Md {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl LocalBackend {
    fn check_self(&self, agent: &str) -> Result<()> {
        if agent == self.agent_name {
            Ok(())
        } else {
            Err(Error::InvalidParam(format!(
                "{NAME} only moves data within agent `{}`, not to `{agent}`",
                self.agent_name
            )))
        }
    }
}

impl Backend for LocalBackend {
    fn name(&self) -> &str {
        NAME
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: false,
            notif: true,
        }
    }
    fn supported_mem(&self) -> &[MemKind] {
        &[MemKind::Dram]
    }
    fn register_mem(&self, _region: &Region) -> Result<Arc<dyn LocalMd>> {
        Ok(Arc::new(Md))
    }
    fn connection_info(&self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn load_remote_conn_info(&self, _agent: &str, _info: &[u8]) -> Result<()> {
        Ok(())
    }
    fn load_remote_md(
        &self,
        _agent: &str,
        _region: &Region,
        _public: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        Ok(Arc::new(Md))
    }
    fn disconnect(&self, _agent: &str) {}
    fn prep_xfer(
        &self,
        op: XferOp,
        entries: &[XferEntry<'_>],
        agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        self.check_self(agent)?;
        Ok(Box::new(CopyXfer {
            op,
            copies: entries
                .iter()
                .map(|e| (e.local.addr, e.remote.addr, e.local.len as usize))
                .collect(),
            agent: agent.to_string(),
            notifs: self.notifs.clone(),
        }))
    }
    fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<()> {
        self.check_self(agent)?;
        self.notifs
            .lock()
            .expect("notif lock")
            .push((self.agent_name.clone(), msg.to_vec()));
        Ok(())
    }
    fn take_notifs(&self, into: &mut Vec<(String, Vec<u8>)>) {
        into.append(&mut self.notifs.lock().expect("notif lock"));
    }
}

#[derive(Debug)]
struct CopyXfer {
    op: XferOp,
    /// (local address, remote address, length)
    copies: Vec<(u64, u64, usize)>,
    agent: String,
    notifs: NotifQueue,
}

impl BackendXfer for CopyXfer {
    fn post(&mut self, notif: Option<&[u8]>, _params: &PostParams) -> Result<XferStatus> {
        for &(local, remote, len) in &self.copies {
            let (src, dst) = match self.op {
                XferOp::Write => (local, remote),
                XferOp::Read => (remote, local),
            };
            // SAFETY: both ranges were checked by the agent to lie inside regions
            // registered through `Agent::register_mem`, whose contract keeps them valid
            // while a transfer exists; `copy` tolerates overlap.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        }
        if let Some(msg) = notif {
            self.notifs
                .lock()
                .expect("notif lock")
                .push((self.agent.clone(), msg.to_vec()));
        }
        Ok(XferStatus::Done)
    }

    fn check(&mut self) -> Result<XferProgress> {
        Ok(XferProgress {
            status: XferStatus::Done,
            completed_ops: self.copies.len() as u64,
        })
    }

    fn op_count(&self) -> usize {
        self.copies.len()
    }
}
