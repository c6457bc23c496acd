//! The staging pipeline over real providers without a GPU: DRAM registered as staged
//! (`stage_dram=1`) goes through exactly the protocol VRAM does, with `memcpy` in place
//! of the device copies. What needs the crate's insides (slots given back, requester
//! addresses forgotten) and the measurements; the scenarios VERBS runs too are in
//! `tests/libfabric_staging.rs`.

use super::LibfabricBackend;
use crate::{params, Agent, AgentConfig, Desc, DescList, MemKind, XferOp, XferStatus};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(60);

fn agent(name: &str, provider: &str, stage: bool, extra: &[(&str, &str)]) -> Agent {
    agent_with(name, provider, stage, extra, AgentConfig::default())
}

fn agent_with(
    name: &str,
    provider: &str,
    stage: bool,
    extra: &[(&str, &str)],
    config: AgentConfig,
) -> Agent {
    let agent = Agent::new(name, config).unwrap();
    let mut p = params([
        ("provider", provider),
        // The provider itself, not shm, to the peers on this host.
        ("local_provider", "none"),
        ("stage_dram", if stage { "1" } else { "0" }),
    ]);
    for (k, v) in extra {
        p.insert(k.to_string(), v.to_string());
    }
    agent.create_backend("LIBFABRIC", &p).unwrap();
    agent
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .rotate_left(u32::from(seed) % 31) as u8
                ^ seed
        })
        .collect()
}

fn dram(descs: impl IntoIterator<Item = Desc>) -> DescList {
    DescList::from_descs(MemKind::Dram, descs)
}

/// Bandwidth of WRITE (or READ) of `batch` blocks of `block` bytes, over `rounds`
/// posts: GB/s.
fn bandwidth(
    provider: &str,
    op: XferOp,
    init: (bool, &[(&str, &str)]),
    tgt: (bool, &[(&str, &str)]),
    block: usize,
    batch: usize,
    rounds: usize,
) -> f64 {
    let tag = format!(
        "bw-{}-{block}-{}{}",
        provider.replace(';', "_"),
        init.0,
        tgt.0
    );
    let initiator = agent(&format!("i{tag}"), provider, init.0, init.1);
    let target = agent(&format!("t{tag}"), provider, tgt.0, tgt.1);
    let span = block * batch;
    let src = pattern(3, span);
    let dst = vec![0u8; span];
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
    let at = |base: u64, i: usize| Desc::new(base + (i * block) as u64, block as u64, 0);
    let local = dram((0..batch).map(|i| at(src.as_ptr() as u64, i)));
    let remote = dram((0..batch).map(|i| at(dst.as_ptr() as u64, i)));
    let mut req = initiator
        .create_xfer_req(op, &local, &remote, &name, None)
        .unwrap();
    for _ in 0..3 {
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
    }
    let start = Instant::now();
    for _ in 0..rounds {
        req.post().unwrap();
        req.wait(TIMEOUT).unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    if op == XferOp::Write {
        assert!(src == dst);
    }
    (span * rounds) as f64 / secs / 1e9
}

/// DRAM against staged DRAM (memcpy in place of the device copies: on a small host the
/// extra copies compete with the provider for the CPU, which a GPU's copy engines do
/// not). `cargo test --release -p rdma-rs-nixl --lib staged_bandwidth -- --ignored --nocapture`,
/// with `NIXL_BW_BLOCKS`, `NIXL_BW_CHUNK`, `NIXL_BW_CHUNKS`, `NIXL_BW_PROVIDERS`,
/// `NIXL_BW_TRIALS`, `NIXL_BW_BUSY` to vary it.
#[test]
#[ignore = "a measurement, not a check"]
fn staged_bandwidth() {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let sizes: Vec<usize> = env("NIXL_BW_BLOCKS", "1048576,4194304")
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    let chunk = env("NIXL_BW_CHUNK", "524288");
    let chunks = env("NIXL_BW_CHUNKS", "16");
    let providers = env("NIXL_BW_PROVIDERS", "shm,tcp;ofi_rxm");
    let trials: usize = env("NIXL_BW_TRIALS", "3").parse().unwrap();
    let busy = env("NIXL_BW_BUSY", "0");
    let staged: &[(&str, &str)] = &[
        ("staging_chunk", chunk.as_str()),
        ("staging_chunks", chunks.as_str()),
        ("busy_poll", busy.as_str()),
    ];
    let plain: &[(&str, &str)] = &[("busy_poll", busy.as_str())];
    for provider in providers.split(',') {
        for op in [XferOp::Write, XferOp::Read] {
            for &block in &sizes {
                let batch = ((16 << 20) / block).max(1);
                let (mut d, mut s) = (Vec::new(), Vec::new());
                for _ in 0..trials {
                    d.push(bandwidth(
                        provider,
                        op,
                        (false, plain),
                        (false, plain),
                        block,
                        batch,
                        30,
                    ));
                    s.push(bandwidth(
                        provider,
                        op,
                        (true, staged),
                        (true, staged),
                        block,
                        batch,
                        30,
                    ));
                }
                let med = |v: &mut Vec<f64>| {
                    v.sort_by(f64::total_cmp);
                    v[v.len() / 2]
                };
                let (dm, sm) = (med(&mut d), med(&mut s));
                println!(
                    "{provider:12} {op:?} block {block:>8} x{batch:<4}: DRAM {dm:.2} GB/s, staged both sides {sm:.2} GB/s ({:.2}x)",
                    sm / dm
                );
            }
        }
    }
}

/// Requests released mid-pipeline (and a peer forgotten) leave no slot held on either
/// side, and the next transfers get every slot.
#[test]
fn released_staged_requests_return_their_slots() {
    use crate::backend::Backend;
    let open_agent = |name: &str| {
        let agent = Agent::new(name, AgentConfig::default()).unwrap();
        let backend = Arc::new(
            super::open_for(
                &agent,
                &params([
                    ("provider", "tcp;ofi_rxm"),
                    ("stage_dram", "1"),
                    ("staging_chunk", "65536"),
                    ("staging_chunks", "4"),
                ]),
            )
            .unwrap(),
        );
        agent
            .add_backend(backend.clone() as Arc<dyn Backend>)
            .unwrap();
        (agent, backend)
    };
    let (initiator, ib) = open_agent("rel-i");
    let (target, tb) = open_agent("rel-t");
    let len = 8 << 20;
    let src = pattern(2, len);
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
    let settle = |b: &LibfabricBackend| {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            b.common.stager.progress();
            let (busy, slots) = {
                let e = b.common.stager.engine();
                (e.busy(), e.slots_in_use())
            };
            if !busy && slots == (0, 0) {
                return;
            }
            assert!(Instant::now() < deadline, "slots held: {slots:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    for round in 0..20 {
        let op = if round % 2 == 0 {
            XferOp::Write
        } else {
            XferOp::Read
        };
        let local = if op == XferOp::Write {
            Desc::from_slice(&src)
        } else {
            Desc::new(back_p, len as u64, 0)
        };
        let mut req = initiator
            .create_xfer_req(
                op,
                &dram([local]),
                &dram([Desc::from_slice(&dst)]),
                &name,
                Some(b"x".to_vec()),
            )
            .unwrap();
        req.post().unwrap();
        std::thread::sleep(Duration::from_micros(100 * (round % 5)));
        drop(req);
    }
    settle(&ib);
    settle(&tb);
    // Everything still works, with every slot.
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(&src)]),
            &dram([Desc::from_slice(&dst)]),
            &name,
            None,
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert!(src == dst);
    settle(&ib);
    settle(&tb);
    // Forgetting the peer fails nothing that is done and leaves nothing held.
    initiator.invalidate_remote(&name).unwrap();
    settle(&ib);
}

// ---- two processes -------------------------------------------------------------------

const PEER_LEN: usize = 16 << 20;

/// The target side of the two-process tests: runs only when re-executed with
/// NIXL_STAGED_PEER (`announce-file provider`).
#[test]
fn staged_peer_process_main() {
    let Ok(role) = std::env::var("NIXL_STAGED_PEER") else {
        return;
    };
    let (announce, provider) = role.split_once(' ').unwrap();
    let peer = agent_with(
        "staged-peer",
        provider,
        true,
        &[],
        AgentConfig {
            listen_addr: Some("127.0.0.1:0".parse().unwrap()),
            ..AgentConfig::default()
        },
    );
    let buf = pattern(42, PEER_LEN);
    // SAFETY: `buf` lives until the process exits.
    let _h = unsafe {
        peer.register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    std::fs::write(
        format!("{announce}.tmp"),
        format!("{} {}", peer.listen_addr().unwrap(), buf.as_ptr() as u64),
    )
    .unwrap();
    std::fs::rename(format!("{announce}.tmp"), announce).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    while Instant::now() < deadline {
        if let Some(msgs) = peer.get_notifs().remove("staged-initiator") {
            // Checked at the moment the notification arrives.
            assert_eq!(msgs, vec![b"second half".to_vec()]);
            let half = PEER_LEN / 2;
            assert!(
                buf[half..] == pattern(7, PEER_LEN)[half..],
                "data after notification"
            );
            assert!(
                buf[..half] == pattern(42, PEER_LEN)[..half],
                "first half untouched"
            );
            std::fs::write(format!("{announce}.ok"), "PEER OK").unwrap();
            return;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    panic!("the initiator never finished");
}

struct PeerProcess {
    child: std::process::Child,
    addr: std::net::SocketAddr,
    base: u64,
    announce: std::path::PathBuf,
}

impl PeerProcess {
    fn spawn(tag: &str, provider: &str) -> Self {
        let announce = std::env::temp_dir().join(format!(
            "nixl-staged-{}-{tag}-{}",
            std::process::id(),
            provider.replace(';', "_")
        ));
        let _ = std::fs::remove_file(&announce);
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "backends::libfabric::staged_tests::staged_peer_process_main",
                "--test-threads=1",
            ])
            .env(
                "NIXL_STAGED_PEER",
                format!("{} {provider}", announce.display()),
            )
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + TIMEOUT;
        let (addr, base) = loop {
            if let Ok(text) = std::fs::read_to_string(&announce) {
                let (a, b) = text.split_once(' ').unwrap();
                break (a.parse().unwrap(), b.parse().unwrap());
            }
            assert!(Instant::now() < deadline, "the peer never announced itself");
            assert!(child.try_wait().unwrap().is_none(), "the peer exited early");
            std::thread::sleep(Duration::from_millis(10));
        };
        Self {
            child,
            addr,
            base,
            announce,
        }
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.announce);
        let _ = std::fs::remove_file(format!("{}.ok", self.announce.display()));
    }
}

#[test]
fn staged_two_processes_then_a_killed_peer() {
    for provider in ["tcp;ofi_rxm", "shm"] {
        let initiator = agent_with(
            "staged-initiator",
            provider,
            true,
            &[],
            AgentConfig {
                stall_timeout: Duration::from_secs(5),
                ..AgentConfig::default()
            },
        );
        let local = pattern(7, PEER_LEN);
        let mut first_half = vec![0u8; PEER_LEN / 2];
        let fh = first_half.as_mut_ptr() as u64;
        // SAFETY: both buffers outlive the handle and the requests.
        let _h = unsafe {
            initiator
                .register_mem(
                    &dram([
                        Desc::from_slice(&local),
                        Desc::new(fh, (PEER_LEN / 2) as u64, 0),
                    ]),
                    None,
                )
                .unwrap()
        };
        let half = (PEER_LEN / 2) as u64;
        let mut peer = PeerProcess::spawn("data", provider);
        let name = initiator.fetch_remote_metadata(peer.addr).unwrap();
        let mut read = initiator
            .create_xfer_req(
                XferOp::Read,
                &dram([Desc::new(fh, half, 0)]),
                &dram([Desc::new(peer.base, half, 0)]),
                &name,
                None,
            )
            .unwrap();
        read.post().unwrap();
        read.wait(TIMEOUT).unwrap();
        assert!(
            first_half == pattern(42, PEER_LEN)[..PEER_LEN / 2],
            "{provider}: READ"
        );
        let mut write = initiator
            .create_xfer_req(
                XferOp::Write,
                &dram([Desc::new(local.as_ptr() as u64 + half, half, 0)]),
                &dram([Desc::new(peer.base + half, half, 0)]),
                &name,
                Some(b"second half".to_vec()),
            )
            .unwrap();
        write.post().unwrap();
        write.wait(TIMEOUT).unwrap();
        assert!(
            peer.child.wait().unwrap().success(),
            "{provider}: the peer failed"
        );
        assert_eq!(
            std::fs::read_to_string(format!("{}.ok", peer.announce.display())).unwrap(),
            "PEER OK"
        );
        drop(peer);
        if provider == "shm" {
            // Not killed over shm: a process killed while it holds a lock of its shared
            // memory region leaves libfabric 1.17's shm spinning in the survivor's
            // `fi_cq_read` (seen here; DRAM transfers alike).
            continue;
        }

        // A peer killed mid-pipeline: the transfer fails typed (the transport noticed, or
        // the stall bound), never hangs, and the initiator's slots come back.
        let mut victim = PeerProcess::spawn("victim", provider);
        let name = initiator.fetch_remote_metadata(victim.addr).unwrap();
        let mut big = initiator
            .create_xfer_req(
                XferOp::Write,
                &dram([Desc::from_slice(&local)]),
                &dram([Desc::new(victim.base, PEER_LEN as u64, 0)]),
                &name,
                None,
            )
            .unwrap();
        big.post().unwrap();
        victim.child.kill().unwrap();
        victim.child.wait().unwrap();
        let started = Instant::now();
        let err = loop {
            match big.status() {
                Ok(XferStatus::Done) => {
                    if let Err(e) = big.post() {
                        break e;
                    }
                }
                Ok(XferStatus::InProgress) => std::thread::sleep(Duration::from_micros(200)),
                Err(e) => break e,
            }
            assert!(
                started.elapsed() < TIMEOUT,
                "{provider}: the dead peer was never noticed"
            );
        };
        assert!(
            matches!(
                err,
                crate::Error::RemoteDisconnect { .. } | crate::Error::Stalled(_)
            ),
            "{provider}: {err:?}"
        );
        println!("{provider}: killed peer -> {err}");
        drop(big);
        // Forgetting the dead peer gives back what was held for it.
        initiator.invalidate_remote(&name).unwrap();
    }
}

/// DRAM with the provider opened with and without `FI_HMEM` (feature `cuda` asks for it
/// where VRAM may register directly).
/// `cargo test --release -p rdma-rs-nixl --features cuda --lib hmem_dram_bandwidth -- --ignored --nocapture`
#[test]
#[ignore = "a measurement, not a check"]
fn hmem_dram_bandwidth() {
    let plain: &[(&str, &str)] = &[];
    let no_hmem: &[(&str, &str)] = &[("vram_mode", "staged")];
    for provider in ["shm", "tcp;ofi_rxm"] {
        for op in [XferOp::Write, XferOp::Read] {
            for block in [64 << 10, 1 << 20] {
                let batch = (16 << 20) / block;
                let (mut a, mut b) = (Vec::new(), Vec::new());
                for _ in 0..7 {
                    a.push(bandwidth(
                        provider,
                        op,
                        (false, plain),
                        (false, plain),
                        block,
                        batch,
                        20,
                    ));
                    b.push(bandwidth(
                        provider,
                        op,
                        (false, no_hmem),
                        (false, no_hmem),
                        block,
                        batch,
                        20,
                    ));
                }
                a.sort_by(f64::total_cmp);
                b.sort_by(f64::total_cmp);
                println!(
                    "{provider:12} {op:?} {block:>8} x{batch:<4}: default {:.2} GB/s, without FI_HMEM {:.2} GB/s",
                    a[3], b[3]
                );
            }
        }
    }
}

/// A target's AV holds the initiator twice: resolved from a request it served before it
/// loaded the initiator (a sealed request of a sender it has not loaded is answered at
/// the address the request names), and as a peer once loaded. Releasing the resolved one
/// (`fi_av_remove`) must leave the peer entry working (the AV counts duplicate inserts).
#[test]
fn a_released_requester_address_leaves_the_peer_entry_working() {
    use crate::backend::Backend;
    for provider in ["tcp;ofi_rxm", "shm"] {
        let tag = provider.replace(';', "_");
        let open_agent = |name: &str| {
            let agent = Agent::new(name, AgentConfig::default()).unwrap();
            let backend = Arc::new(
                super::open_for(
                    &agent,
                    &params([("provider", provider), ("stage_dram", "1")]),
                )
                .unwrap(),
            );
            agent
                .add_backend(backend.clone() as Arc<dyn Backend>)
                .unwrap();
            (agent, backend)
        };
        let (a, _ab) = open_agent(&format!("sym-a-{tag}"));
        let (b, bb) = open_agent(&format!("sym-b-{tag}"));
        let len = 3 << 20;
        let (abuf, bbuf) = (pattern(1, len), vec![0u8; len]);
        // SAFETY: the buffers outlive the handles and the requests.
        let _ha = unsafe {
            a.register_mem(&dram([Desc::from_slice(&abuf)]), None)
                .unwrap()
        };
        // SAFETY: as above.
        let _hb = unsafe {
            b.register_mem(&dram([Desc::from_slice(&bbuf)]), None)
                .unwrap()
        };
        let b_name = a
            .load_remote_metadata(&b.local_metadata().unwrap())
            .unwrap();
        let write = |from: &Agent, src: &[u8], to: &str, dst: &[u8]| {
            let mut req = from
                .create_xfer_req(
                    XferOp::Write,
                    &dram([Desc::from_slice(src)]),
                    &dram([Desc::from_slice(dst)]),
                    to,
                    None,
                )
                .unwrap();
            req.post().unwrap();
            req.wait(TIMEOUT).unwrap();
        };
        // A → B: B serves A's OFFERs, resolving A's name into its AV.
        write(&a, &abuf, &b_name, &bbuf);
        assert!(abuf == bbuf, "{provider}");
        // Now B loads A: a second entry for A's name.
        let a_name = b
            .load_remote_metadata(&a.local_metadata().unwrap())
            .unwrap();
        assert!(bb.common.stager.net.forget_requesters() > 0, "{provider}");
        // B → A through B's own peer entry for A.
        let back = pattern(2, len);
        // SAFETY: as above.
        let _hback = unsafe {
            b.register_mem(&dram([Desc::from_slice(&back)]), None)
                .unwrap()
        };
        write(&b, &back, &a_name, &abuf);
        assert!(abuf == back, "{provider}: B's peer entry for A still works");
        // And A → B again (B resolves A anew).
        write(&a, &abuf, &b_name, &bbuf);
        assert!(bbuf == back, "{provider}: again");
    }
}

/// A staged peer frozen (SIGSTOP) mid-pipeline, as a hung host: its process lives on and
/// the transport says nothing, so only heartbeats tell. The transfer fails with
/// `RemoteDisconnect` within the bound (the default stall timeout stays; the staged part
/// is checked like the direct one), and once the request is released no slot stays held
/// for the frozen peer (READ: its FETCHes go unanswered), without it being invalidated.
#[test]
fn a_frozen_staged_peer_fails_typed_and_its_slots_come_back() {
    use crate::backend::Backend;
    let provider = "tcp;ofi_rxm";
    let agent = Agent::new("staged-initiator", AgentConfig::default()).unwrap();
    let backend = Arc::new(
        super::open_for(
            &agent,
            &params([("provider", provider), ("stage_dram", "1")]),
        )
        .unwrap(),
    );
    agent
        .add_backend(backend.clone() as Arc<dyn Backend>)
        .unwrap();
    let mut local = vec![0u8; PEER_LEN];
    let local_p = local.as_mut_ptr() as u64;
    // SAFETY: `local` outlives the handle and the request.
    let _h = unsafe {
        agent
            .register_mem(&dram([Desc::new(local_p, PEER_LEN as u64, 0)]), None)
            .unwrap()
    };
    let victim = PeerProcess::spawn("frozen", provider);
    let name = agent.fetch_remote_metadata(victim.addr).unwrap();
    let mut big = agent
        .create_xfer_req(
            XferOp::Read,
            &dram([Desc::new(local_p, PEER_LEN as u64, 0)]),
            &dram([Desc::new(victim.base, PEER_LEN as u64, 0)]),
            &name,
            None,
        )
        .unwrap();
    big.post().unwrap();
    // SAFETY: kill(2) with the pid of our own (not yet reaped) child.
    let stopped = unsafe { libc::kill(victim.child.id() as libc::pid_t, libc::SIGSTOP) };
    assert_eq!(stopped, 0);
    let frozen = Instant::now();
    let err = loop {
        match big.status() {
            Ok(XferStatus::Done) => {
                if let Err(e) = big.post() {
                    break e;
                }
            }
            Ok(XferStatus::InProgress) => std::thread::sleep(Duration::from_micros(200)),
            Err(e) => break e,
        }
        assert!(
            frozen.elapsed() < TIMEOUT,
            "the frozen peer was never noticed"
        );
    };
    let took = frozen.elapsed();
    println!("{provider}: staged peer frozen -> {err} after {took:?}");
    assert!(
        matches!(&err, crate::Error::RemoteDisconnect { agent, .. } if *agent == name),
        "{err:?}"
    );
    assert!(took < Duration::from_secs(5), "after {took:?}");
    drop(big);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        backend.common.stager.progress();
        let slots = backend.common.stager.engine().slots_in_use();
        if slots == (0, 0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "slots still held for the dead peer: {slots:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(victim);
    drop(local);
}
