//! Which backend a transfer that names none takes (`Agent::make_xfer_req` with
//! `backend: None`): a backend that prefers the pair of memory kinds
//! (`Backend::prefers`, e.g. `CUDA_IPC` for VRAM to VRAM) before the others whatever the
//! creation order, unless it cannot reach the peer; creation order otherwise.
//!
//! Two fake backends, built through a `BackendRegistry`, on loopback transfers of one
//! agent: `GENERAL` carries every kind and prefers nothing (as `LIBFABRIC`), `SPECIAL`
//! prefers VRAM to VRAM (as `CUDA_IPC`). Nothing is posted: the choice is the request's
//! backend.
//!
//! With feature `cuda` the agent asks the driver about every VRAM descriptor it
//! registers, which the host buffers standing in for VRAM here are not: the GPU tests
//! (`gpu_multi_kv`) check the choice on real VRAM.
#![cfg(not(feature = "cuda"))]

use nixl::backend::{
    Backend, BackendInit, BackendRegistry, BackendXfer, Capabilities, LocalMd, PostParams,
    RemoteMd, XferEntry, XferOp, XferProgress, XferStatus,
};
use nixl::{Agent, AgentConfig, Desc, DescList, Error, MemKind, Region, Result};
use std::any::Any;
use std::sync::Arc;

#[derive(Debug)]
struct Fake {
    name: &'static str,
    prefers_vram: bool,
    unreachable: bool,
}

#[derive(Debug)]
struct FakeMd;

impl LocalMd for FakeMd {
    fn public_md(&self) -> Vec<u8> {
        Vec::new()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl RemoteMd for FakeMd {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[derive(Debug)]
struct FakeXfer;

impl BackendXfer for FakeXfer {
    fn post(&mut self, _notif: Option<&[u8]>, _params: &PostParams) -> Result<XferStatus> {
        Ok(XferStatus::Done)
    }
    fn check(&mut self) -> Result<XferProgress> {
        Ok(XferProgress {
            status: XferStatus::Done,
            completed_ops: 1,
        })
    }
    fn op_count(&self) -> usize {
        1
    }
}

impl Backend for Fake {
    fn name(&self) -> &str {
        self.name
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: true,
            notif: false,
        }
    }
    fn supported_mem(&self) -> &[MemKind] {
        &[MemKind::Dram, MemKind::Vram]
    }
    fn prefers(&self, local: MemKind, remote: MemKind) -> bool {
        self.prefers_vram && local == MemKind::Vram && remote == MemKind::Vram
    }
    fn reach(&self, agent: &str) -> Result<()> {
        if self.unreachable {
            return Err(Error::Unreachable {
                backend: self.name.into(),
                agent: agent.into(),
                reason: "another node".into(),
            });
        }
        Ok(())
    }
    fn register_mem(&self, _region: &Region) -> Result<Arc<dyn LocalMd>> {
        Ok(Arc::new(FakeMd))
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
        _public_md: &[u8],
    ) -> Result<Arc<dyn RemoteMd>> {
        Ok(Arc::new(FakeMd))
    }
    fn disconnect(&self, _agent: &str) {}
    fn prep_xfer(
        &self,
        _op: XferOp,
        _entries: &[XferEntry<'_>],
        _agent: &str,
    ) -> Result<Box<dyn BackendXfer>> {
        Ok(Box::new(FakeXfer))
    }
    fn gen_notif(&self, _agent: &str, _msg: &[u8]) -> Result<()> {
        Ok(())
    }
    fn take_notifs(&self, _into: &mut Vec<(String, Vec<u8>)>) {}
}

fn general(_init: &BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(Fake {
        name: "GENERAL",
        prefers_vram: false,
        unreachable: false,
    }))
}

fn special(init: &BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(Fake {
        name: "SPECIAL",
        prefers_vram: true,
        unreachable: init.params.get("unreachable").is_some_and(|v| v == "1"),
    }))
}

/// An agent with the fakes created in `order` (with `special_params`), holding one
/// DRAM and one "VRAM" region of 4 KiB.
struct Setup {
    agent: Agent,
    _buffers: Vec<Vec<u8>>,
    _regs: Vec<nixl::RegistrationHandle>,
    dram: Desc,
    vram: Desc,
}

fn setup(order: &[&str], special_params: &[(&str, &str)]) -> Setup {
    let mut registry = BackendRegistry::new();
    registry.register("GENERAL", general).unwrap();
    registry.register("SPECIAL", special).unwrap();
    let agent = Agent::with_registry("me", AgentConfig::default(), registry).unwrap();
    for name in order {
        let params = if *name == "SPECIAL" {
            nixl::params(special_params.iter().copied())
        } else {
            Default::default()
        };
        agent.create_backend(name, &params).unwrap();
    }
    let buffers = vec![vec![0u8; 4096], vec![0u8; 4096]];
    let dram = Desc::new(buffers[0].as_ptr() as u64, 4096, 0);
    let vram = Desc::new(buffers[1].as_ptr() as u64, 4096, 0);
    let regs = [(MemKind::Dram, dram), (MemKind::Vram, vram)]
        .into_iter()
        .map(|(kind, d)| {
            // SAFETY: the buffers outlive the registrations (both in `Setup`, the
            // handles dropped first) and the fake backends never touch the memory.
            unsafe { agent.register_mem(&DescList::from_descs(kind, [d]), None) }.unwrap()
        })
        .collect();
    Setup {
        agent,
        _buffers: buffers,
        _regs: regs,
        dram,
        vram,
    }
}

impl Setup {
    /// The backend a loopback transfer from local `from` to the agent's own `to` takes.
    fn chosen(&self, from: MemKind, to: MemKind, named: Option<&str>) -> Result<String> {
        let desc = |kind| match kind {
            MemKind::Vram => self.vram,
            _ => self.dram,
        };
        let local = self
            .agent
            .prep_xfer_dlist(None, &DescList::from_descs(from, [desc(from)]))?;
        let remote = self
            .agent
            .prep_xfer_dlist(Some("me"), &DescList::from_descs(to, [desc(to)]))?;
        let req =
            self.agent
                .make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], None, named)?;
        Ok(req.backend_name().to_string())
    }
}

#[test]
fn vram_to_vram_takes_the_backend_that_prefers_it_whatever_the_creation_order() {
    for order in [&["GENERAL", "SPECIAL"], &["SPECIAL", "GENERAL"]] {
        let s = setup(order, &[]);
        assert_eq!(
            s.chosen(MemKind::Vram, MemKind::Vram, None).unwrap(),
            "SPECIAL",
            "{order:?}"
        );
    }
}

#[test]
fn other_pairs_keep_creation_order() {
    let s = setup(&["GENERAL", "SPECIAL"], &[]);
    for (from, to) in [
        (MemKind::Dram, MemKind::Dram),
        (MemKind::Dram, MemKind::Vram),
        (MemKind::Vram, MemKind::Dram),
    ] {
        assert_eq!(
            s.chosen(from, to, None).unwrap(),
            "GENERAL",
            "{from:?} -> {to:?}"
        );
    }
    // Created first, the preferring backend is simply first for every pair.
    let s = setup(&["SPECIAL", "GENERAL"], &[]);
    assert_eq!(
        s.chosen(MemKind::Dram, MemKind::Dram, None).unwrap(),
        "SPECIAL"
    );
}

#[test]
fn an_unreachable_preferred_backend_is_passed_over() {
    let s = setup(&["GENERAL", "SPECIAL"], &[("unreachable", "1")]);
    assert_eq!(
        s.chosen(MemKind::Vram, MemKind::Vram, None).unwrap(),
        "GENERAL"
    );
    // Named, its own error is the request's.
    let err = s
        .chosen(MemKind::Vram, MemKind::Vram, Some("SPECIAL"))
        .unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
}

#[test]
fn a_named_backend_is_used_even_where_another_is_preferred() {
    let s = setup(&["SPECIAL", "GENERAL"], &[]);
    assert_eq!(
        s.chosen(MemKind::Vram, MemKind::Vram, Some("GENERAL"))
            .unwrap(),
        "GENERAL"
    );
}

#[test]
fn with_only_the_preferring_backend_absent_the_others_carry_vram() {
    let s = setup(&["GENERAL"], &[]);
    assert_eq!(
        s.chosen(MemKind::Vram, MemKind::Vram, None).unwrap(),
        "GENERAL"
    );
}

/// NIXL's default set in a build without CUDA: `LIBFABRIC` alone, created once.
#[cfg(feature = "libfabric")]
#[test]
fn the_default_backends_are_libfabric_without_cuda() {
    let agent = Agent::new("defaults", AgentConfig::default()).unwrap();
    let made = agent.create_default_backends().unwrap();
    let names: Vec<&str> = made.iter().map(|b| b.name()).collect();
    assert_eq!(names, ["LIBFABRIC"]);
    assert!(agent.create_default_backends().unwrap().is_empty());
    assert_eq!(agent.backends().len(), 1);
}
