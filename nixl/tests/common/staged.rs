//! The staging scenarios every backend that stages runs (LIBFABRIC and VERBS, with DRAM
//! registered as staged: `stage_dram=1`): WRITE and READ with the data checked the moment
//! the notification arrives, notifications only after the last chunk, and polling
//! without progress threads.

use super::{agent_with_backend, dram, pattern, wait_notif, wait_notifs, with_extra, TIMEOUT};
use nixl::{Agent, AgentConfig, BackendParams, Desc, XferOp, XferStatus};
use std::time::Instant;

/// A backend that stages, opened with `params` (its provider or device) and a `label`
/// that tells its agents apart in messages.
pub struct StagedBackend {
    pub name: &'static str,
    pub label: String,
    pub params: BackendParams,
}

impl StagedBackend {
    pub fn new(name: &'static str, params: BackendParams) -> Self {
        let label = params
            .get("provider")
            .or_else(|| params.get("device"))
            .map_or_else(|| name.to_string(), |p| p.replace(';', "_"));
        Self {
            name,
            label,
            params,
        }
    }

    /// The backend's parameters, staging DRAM where `stage`, with `extra` added (which
    /// may say otherwise).
    pub fn params(&self, stage: bool, extra: &[(&str, &str)]) -> BackendParams {
        let mut p = self.params.clone();
        p.insert("stage_dram".into(), if stage { "1" } else { "0" }.into());
        with_extra(p, extra)
    }

    pub fn agent_with(
        &self,
        name: &str,
        stage: bool,
        extra: &[(&str, &str)],
        config: AgentConfig,
    ) -> Agent {
        agent_with_backend(name, config, self.name, &self.params(stage, extra))
    }

    pub fn agent(&self, name: &str, stage: bool, extra: &[(&str, &str)]) -> Agent {
        self.agent_with(name, stage, extra, AgentConfig::default())
    }

    /// The mode `query_mem` shows for a registration of DRAM staged (or not).
    fn shown(&self, stages: bool) -> String {
        if stages {
            format!("{}(staged)", self.name)
        } else {
            self.name.to_string()
        }
    }

    /// WRITE then READ back (twice) `sizes` blocks placed at odd offsets, between an
    /// initiator and a target that stage (or not) as told; the target checks its memory
    /// the moment the WRITE's notification arrives.
    pub fn round_trip(
        &self,
        init_stages: bool,
        tgt_stages: bool,
        sizes: &[usize],
        extra: &[(&str, &str)],
    ) {
        let tag = format!(
            "{}-{}{}-{}-{}",
            self.label,
            u8::from(init_stages),
            u8::from(tgt_stages),
            sizes.len(),
            extra.len()
        );
        let initiator = self.agent(&format!("si-{tag}"), init_stages, extra);
        let target = self.agent(&format!("st-{tag}"), tgt_stages, extra);
        let span: usize = sizes.iter().map(|s| s + 3).sum::<usize>() + 64;
        let src = pattern(sizes.len() as u8, span);
        let dst = vec![0u8; span];
        let mut back = vec![0u8; span];
        let back_p = back.as_mut_ptr() as u64;
        // SAFETY: the buffers outlive the handles and requests (dropped at the end).
        let _hi = unsafe {
            initiator
                .register_mem(
                    &dram([Desc::from_slice(&src), Desc::new(back_p, span as u64, 0)]),
                    None,
                )
                .unwrap()
        };
        // SAFETY: as above.
        let _ht = unsafe {
            target
                .register_mem(&dram([Desc::from_slice(&dst)]), None)
                .unwrap()
        };
        let mode_of = |agent: &Agent, buf: &[u8]| {
            agent.query_mem(&dram([Desc::from_slice(buf)]))[0]
                .as_ref()
                .expect("registered")[0]
                .clone()
        };
        assert_eq!(mode_of(&initiator, &src), self.shown(init_stages), "{tag}");
        assert_eq!(mode_of(&target, &dst), self.shown(tgt_stages), "{tag}");
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        let mut offs = Vec::new();
        let mut at = 1usize;
        for &s in sizes {
            offs.push(at);
            at += s + 3;
        }
        let n = sizes.len();
        let block = |base: u64, i: usize| Desc::new(base + offs[i] as u64, sizes[i] as u64, 0);
        let local = dram((0..n).map(|i| block(src.as_ptr() as u64, i)));
        let remote = dram((0..n).map(|i| block(dst.as_ptr() as u64, i)));
        let mut w = initiator
            .create_xfer_req(XferOp::Write, &local, &remote, &name, Some(b"w".to_vec()))
            .unwrap();
        w.post().unwrap();
        assert_eq!(wait_notif(&target, initiator.name()), b"w", "{tag}");
        // Checked the moment the notification is seen, before the initiator's completion.
        for i in 0..n {
            let r = offs[i]..offs[i] + sizes[i];
            assert!(
                src[r.clone()] == dst[r],
                "{tag}: block {i} of {} bytes",
                sizes[i]
            );
            assert_eq!(dst[offs[i] - 1], 0, "{tag}: byte before block {i}");
            assert_eq!(dst[offs[i] + sizes[i]], 0, "{tag}: byte after block {i}");
        }
        w.wait(TIMEOUT).unwrap();
        let t = w.telemetry();
        assert_eq!(t.staged_bytes, t.total_bytes, "{tag}: everything staged");
        let readback = dram((0..n).map(|i| block(back_p, i)));
        let mut r = initiator
            .create_xfer_req(XferOp::Read, &readback, &remote, &name, Some(b"r".to_vec()))
            .unwrap();
        for round in 0..2 {
            if round == 1 {
                back.fill(0);
            }
            assert_eq!(r.post().unwrap(), XferStatus::InProgress);
            r.wait(TIMEOUT).unwrap();
            assert_eq!(wait_notif(&target, initiator.name()), b"r", "{tag}");
            for i in 0..n {
                let rg = offs[i]..offs[i] + sizes[i];
                assert!(
                    back[rg.clone()] == src[rg],
                    "{tag}: read block {i} round {round}"
                );
            }
        }
        assert_eq!(
            r.telemetry().staged_bytes,
            t.total_bytes,
            "{tag}: READ staged"
        );
    }

    /// The target checks its memory at the moment the notification arrives (the
    /// initiator's request is not waited for first), over rounds of a staged WRITE of
    /// `len` bytes in many descriptors whose chunks land in any order.
    pub fn notification_only_after_the_last_chunk(
        &self,
        init_stages: bool,
        len: usize,
        extra: &[(&str, &str)],
    ) {
        let tag = format!("ord-{}-{init_stages}", self.label);
        let initiator = self.agent(&format!("{tag}-i"), init_stages, extra);
        let target = self.agent(&format!("{tag}-t"), true, extra);
        let mut src = pattern(1, len);
        let dst = vec![0u8; len];
        // SAFETY: the buffers outlive the handles and the request.
        let _hi = unsafe {
            initiator
                .register_mem(&dram([Desc::from_slice(&src)]), None)
                .unwrap()
        };
        // SAFETY: as above.
        let _ht = unsafe {
            target
                .register_mem(&dram([Desc::from_slice(&dst)]), None)
                .unwrap()
        };
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        let n = 48;
        let block = len / n;
        let at = |b: u64, i: usize| Desc::new(b + (i * block) as u64, block as u64, 0);
        let mut req = initiator
            .create_xfer_req(
                XferOp::Write,
                &dram((0..n).map(|i| at(src.as_ptr() as u64, i))),
                &dram((0..n).map(|i| at(dst.as_ptr() as u64, i))),
                &name,
                None,
            )
            .unwrap();
        for round in 0..4u8 {
            src.iter_mut().for_each(|b| *b = b.wrapping_add(round + 1));
            req.post_with(Some(vec![round]), &Default::default())
                .unwrap();
            assert_eq!(wait_notifs(&target, initiator.name()), vec![vec![round]]);
            // Checked the moment the notification is seen.
            let wrong = src.iter().zip(&dst).position(|(a, b)| a != b);
            assert_eq!(
                wrong, None,
                "{tag}: round {round}: notified before the data"
            );
            req.wait(TIMEOUT).unwrap();
        }
    }

    /// Both sides staged and without progress threads: the caller's polls of the request
    /// and of notifications drive the pipeline, a WRITE then a READ of `len` bytes.
    pub fn without_progress_threads(&self, len: usize) {
        let config = AgentConfig {
            progress_thread: false,
            ..AgentConfig::default()
        };
        let tag = &self.label;
        let initiator = self.agent_with(&format!("np-si-{tag}"), true, &[], config.clone());
        let target = self.agent_with(&format!("np-st-{tag}"), true, &[], config);
        let src = pattern(9, len);
        let dst = vec![0u8; len];
        let mut back = vec![0u8; len];
        let back_p = back.as_mut_ptr() as u64;
        // SAFETY: the buffers outlive the handles and the requests.
        let _hi = unsafe {
            initiator
                .register_mem(
                    &dram([Desc::from_slice(&src), Desc::new(back_p, len as u64, 0)]),
                    None,
                )
                .unwrap()
        };
        // SAFETY: as above.
        let _ht = unsafe {
            target
                .register_mem(&dram([Desc::from_slice(&dst)]), None)
                .unwrap()
        };
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        let mut req = initiator
            .create_xfer_req(
                XferOp::Write,
                &dram([Desc::from_slice(&src)]),
                &dram([Desc::from_slice(&dst)]),
                &name,
                Some(b"inline".to_vec()),
            )
            .unwrap();
        req.post().unwrap();
        let deadline = Instant::now() + TIMEOUT;
        let (mut done, mut notif) = (false, None);
        while !(done && notif.is_some()) {
            assert!(Instant::now() < deadline, "{tag}: no progress");
            done = done || req.status().unwrap() == XferStatus::Done;
            if let Some(mut msgs) = target.get_notifs().remove(initiator.name()) {
                notif = Some(msgs.remove(0));
                assert!(src == dst, "{tag}: notification before the data");
            }
        }
        let mut read = initiator
            .create_xfer_req(
                XferOp::Read,
                &dram([Desc::new(back_p, len as u64, 0)]),
                &dram([Desc::from_slice(&dst)]),
                &name,
                None,
            )
            .unwrap();
        read.post().unwrap();
        while read.status().unwrap() != XferStatus::Done {
            assert!(
                Instant::now() < deadline,
                "{tag}: the read made no progress"
            );
            target.get_notifs();
        }
        assert!(back == src, "{tag}");
    }
}
