#![cfg(feature = "libfabric")]
//! The LIBFABRIC backend over loopback providers: data verified byte for byte,
//! notifications only after the data, striping, many descriptors, many threads, and two
//! processes.

mod common;

use common::{
    announce_agent, announce_path, dram, listening, pattern, self_test, wait_notif, PeerProcess,
    TIMEOUT,
};
use nixl::{params, Agent, AgentConfig, Desc, DescList, Error, MemKind, XferOp};
use std::time::Instant;

const PROVIDERS: &[&str] = &["tcp;ofi_rxm", "sockets", "shm"];

fn agent(name: &str, provider: &str, rails: usize) -> Agent {
    agent_with(name, provider, rails, AgentConfig::default())
}

fn agent_with(name: &str, provider: &str, rails: usize, config: AgentConfig) -> Agent {
    let agent = Agent::new(name, config).unwrap();
    let rails = rails.to_string();
    agent
        .create_backend(
            "LIBFABRIC",
            &params([
                ("provider", provider),
                // This provider itself, not shm, to the agents of this host.
                ("local_provider", "none"),
                ("num_rails", rails.as_str()),
                ("striping_threshold", "65536"),
            ]),
        )
        .unwrap_or_else(|e| panic!("LIBFABRIC on {provider}: {e}"));
    agent
}

/// WRITE then READ back `count` non-contiguous blocks between two agents of this process.
fn write_read_batches(provider: &str, rails: usize, count: usize, block: usize) {
    let tag = format!("{}-{rails}-{count}", provider.replace(';', "_"));
    let initiator = agent(&format!("init-{tag}"), provider, rails);
    let target = agent(&format!("tgt-{tag}"), provider, rails);
    let span = count * block * 2;
    let src = pattern(count as u8, span);
    let mut dst = vec![0u8; span];
    let mut back = vec![0u8; span];
    let (src_p, dst_p, back_p) = (
        src.as_ptr() as u64,
        dst.as_mut_ptr() as u64,
        back.as_mut_ptr() as u64,
    );
    // SAFETY: the buffers outlive the handles and requests (all dropped before the end of
    // this function, handles last).
    let _hi = unsafe {
        initiator
            .register_mem(
                &dram([
                    Desc::new(src_p, span as u64, 0),
                    Desc::new(back_p, span as u64, 0),
                ]),
                None,
            )
            .unwrap()
    };
    // SAFETY: as above.
    let _ht = unsafe {
        target
            .register_mem(&dram([Desc::new(dst_p, span as u64, 0)]), None)
            .unwrap()
    };
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    // Every other block, mapped in reverse order on the target.
    let at = |i: usize| (2 * i * block) as u64;
    let local = dram((0..count).map(|i| Desc::new(src_p + at(i), block as u64, 0)));
    let remote = dram((0..count).map(|i| Desc::new(dst_p + at(count - 1 - i), block as u64, 0)));
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &local,
            &remote,
            &name,
            Some(b"written".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&target, initiator.name()), b"written");
    for i in 0..count {
        let s = &src[at(i) as usize..at(i) as usize + block];
        let d = &dst[at(count - 1 - i) as usize..at(count - 1 - i) as usize + block];
        assert_eq!(s, d, "{tag}: block {i}");
    }
    // Gaps untouched.
    assert!(dst[block..2 * block].iter().all(|b| *b == 0));
    let readback = dram((0..count).map(|i| Desc::new(back_p + at(i), block as u64, 0)));
    let mut req = initiator
        .create_xfer_req(
            XferOp::Read,
            &readback,
            &remote,
            &name,
            Some(b"read".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&target, initiator.name()), b"read");
    for i in 0..count {
        assert_eq!(
            &back[at(i) as usize..at(i) as usize + block],
            &src[at(i) as usize..at(i) as usize + block],
            "{tag}: read block {i}"
        );
    }
}

#[test]
fn write_read_one_descriptor_each_provider() {
    for provider in PROVIDERS {
        write_read_batches(provider, 1, 1, 4096);
    }
}

#[test]
fn write_read_1000_descriptors_each_provider() {
    for provider in PROVIDERS {
        write_read_batches(provider, 1, 1000, 512);
    }
}

#[test]
fn write_read_15000_descriptors() {
    write_read_batches("tcp;ofi_rxm", 2, 15_000, 64);
}

#[test]
fn striping_over_two_to_four_rails() {
    for rails in 2..=4 {
        // 8 blocks of 1 MiB: each split across every rail (threshold 64 KiB).
        write_read_batches("tcp;ofi_rxm", rails, 8, 1 << 20);
    }
    write_read_batches("shm", 3, 4, 256 << 10);
}

#[test]
fn notification_fires_only_after_all_data_landed() {
    for provider in ["tcp;ofi_rxm", "shm"] {
        let initiator = agent(&format!("ni-{provider}"), provider, 2);
        let target = agent(&format!("nt-{provider}"), provider, 2);
        let len = 8 << 20;
        let rounds = 5u8;
        let src = vec![0u8; len];
        let dst = vec![0u8; len];
        // SAFETY: both buffers outlive the handles and the requests of this scope.
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
        // 2048 blocks of 4 KiB: many completions, on two rails, in any order.
        let n = len / 4096;
        let local =
            dram((0..n).map(|i| Desc::new(src.as_ptr() as u64 + (i * 4096) as u64, 4096, 0)));
        let remote =
            dram((0..n).map(|i| Desc::new(dst.as_ptr() as u64 + (i * 4096) as u64, 4096, 0)));
        let l = initiator.prep_xfer_dlist(None, &local).unwrap();
        let r = initiator.prep_xfer_dlist(Some(&name), &remote).unwrap();
        let idx: Vec<usize> = (0..n).collect();
        let mut req = initiator
            .make_xfer_req(XferOp::Write, &l, &idx, &r, &idx, None, None)
            .unwrap();
        for round in 1..=rounds {
            // SAFETY: no transfer reads `src` while it is refilled (the last one is done).
            unsafe { std::ptr::write_bytes(src.as_ptr() as *mut u8, round, len) };
            req.post_with(Some(vec![round]), &Default::default())
                .unwrap();
            let msg = wait_notif(&target, initiator.name());
            // The moment the notification is seen, every byte must be there.
            // SAFETY: reading our own buffer; nothing writes it until the next post.
            let seen = unsafe { std::slice::from_raw_parts(dst.as_ptr(), len) };
            assert_eq!(msg, vec![round]);
            let wrong = seen.iter().position(|b| *b != round);
            assert_eq!(
                wrong, None,
                "{provider}: round {round}: notification before byte {wrong:?} landed"
            );
            req.wait(TIMEOUT).unwrap();
        }
    }
}

#[test]
fn standalone_notifications_and_loopback() {
    let a = agent("loopy", "tcp;ofi_rxm", 1);
    let b = agent("other", "tcp;ofi_rxm", 1);
    b.load_remote_metadata(&a.local_metadata().unwrap())
        .unwrap();
    b.gen_notif("loopy", b"hello").unwrap();
    let big = vec![7u8; 6000];
    b.gen_notif("loopy", &big).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let mut got = Vec::new();
    while got.len() < 2 && Instant::now() < deadline {
        got.extend(a.get_notifs().remove("other").unwrap_or_default());
    }
    assert_eq!(got, vec![b"hello".to_vec(), big]);
    assert!(matches!(
        b.gen_notif("loopy", &vec![0; 9000]),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        b.gen_notif("nobody", b"x"),
        Err(Error::UnknownAgent(_))
    ));
    // Loopback: a transfer from an agent to itself.
    let src = pattern(3, 65536);
    let dst = vec![0u8; 65536];
    // SAFETY: both buffers outlive the handle and the request.
    let _h = unsafe {
        a.register_mem(
            &dram([Desc::from_slice(&src), Desc::from_slice(&dst)]),
            None,
        )
        .unwrap()
    };
    let mut req = a
        .create_xfer_req(
            XferOp::Write,
            &dram([Desc::from_slice(&src)]),
            &dram([Desc::from_slice(&dst)]),
            "loopy",
            Some(b"self".to_vec()),
        )
        .unwrap();
    assert_eq!(req.backend_name(), "LIBFABRIC");
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert_eq!(wait_notif(&a, "loopy"), b"self");
    assert_eq!(src, dst);
}

#[test]
fn concurrent_posting_from_eight_threads() {
    let initiator = agent("mt-i", "tcp;ofi_rxm", 2);
    let target = agent("mt-t", "tcp;ofi_rxm", 2);
    let block = 16 << 10;
    let src = pattern(9, 8 * block);
    let dst = vec![0u8; 8 * block];
    let dst_p = dst.as_ptr() as u64;
    // SAFETY: both buffers outlive every thread (scoped) and the handles.
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
    std::thread::scope(|s| {
        for t in 0..8usize {
            let (initiator, name, src_p) = (initiator.clone(), name.clone(), src.as_ptr() as u64);
            s.spawn(move || {
                let off = (t * block) as u64;
                let l = dram([Desc::new(src_p + off, block as u64, 0)]);
                let r = dram([Desc::new(dst_p + off, block as u64, 0)]);
                for i in 0..20u32 {
                    let mut req = initiator
                        .create_xfer_req(
                            XferOp::Write,
                            &l,
                            &r,
                            &name,
                            Some(format!("{t}:{i}").into_bytes()),
                        )
                        .unwrap();
                    req.post().unwrap();
                    req.wait(TIMEOUT).unwrap();
                }
            });
        }
    });
    assert_eq!(src, dst);
    let deadline = Instant::now() + TIMEOUT;
    let mut count = 0;
    while count < 160 && Instant::now() < deadline {
        count += target.get_notifs().remove("mt-i").map_or(0, |v| v.len());
    }
    assert_eq!(count, 160, "every notification arrives exactly once");
}

#[test]
fn bad_input_is_refused_before_posting() {
    let a = agent("bad-a", "tcp;ofi_rxm", 1);
    let b = agent("bad-b", "tcp;ofi_rxm", 1);
    let buf = vec![0u8; 8192];
    let base = buf.as_ptr() as u64;
    // SAFETY: `buf` outlives the handles.
    let _ha = unsafe {
        a.register_mem(&dram([Desc::new(base, 4096, 0)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let _hb = unsafe {
        b.register_mem(&dram([Desc::new(base, 4096, 0)]), None)
            .unwrap()
    };
    a.load_remote_metadata(&b.local_metadata().unwrap())
        .unwrap();
    let ok = dram([Desc::new(base, 64, 0)]);
    assert!(matches!(
        a.create_xfer_req(
            XferOp::Write,
            &dram([Desc::new(base + 4096, 64, 0)]),
            &ok,
            "bad-b",
            None
        ),
        Err(Error::NotRegistered { .. })
    ));
    assert!(matches!(
        a.create_xfer_req(
            XferOp::Write,
            &ok,
            &dram([Desc::new(base + 4064, 64, 0)]),
            "bad-b",
            None
        ),
        Err(Error::RemoteOutOfBounds { .. })
    ));
    assert!(matches!(
        a.create_xfer_req(XferOp::Write, &ok, &ok, "nobody", None),
        Err(Error::UnknownAgent(_))
    ));
    // SAFETY: refused: nothing is registered.
    let vram = unsafe {
        a.register_mem(
            &DescList::from_descs(MemKind::File, [Desc::new(0, 64, 3)]),
            None,
        )
    };
    assert!(matches!(
        vram,
        Err(Error::UnsupportedMemKind {
            kind: MemKind::File,
            ..
        })
    ));
    assert!(matches!(
        Agent::new("p", AgentConfig::default())
            .unwrap()
            .create_backend("LIBFABRIC", &params([("num_rails", "0")])),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        Agent::new("q", AgentConfig::default())
            .unwrap()
            .create_backend("LIBFABRIC", &params([("bogus", "1")])),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        Agent::new("r", AgentConfig::default())
            .unwrap()
            .create_backend("LIBFABRIC", &params([("provider", "no-such-provider")])),
        Err(Error::Backend { .. })
    ));
    // A corrupt region key section is a typed error, not a panic.
    let mut md = b.local_metadata().unwrap();
    let last = md.len() - 1;
    md.truncate(last);
    assert!(matches!(
        a.load_remote_metadata(&md),
        Err(Error::MalformedMetadata(_))
    ));
}

/// The peer side of `two_processes`: runs only when re-executed with NIXL_TEST_ROLE.
#[test]
fn target_process_main() {
    let Ok(provider) = std::env::var("NIXL_TEST_ROLE_TARGET") else {
        return;
    };
    let target = agent_with("proc-target", &provider, 2, listening());
    let buf = pattern(42, 1 << 20);
    // SAFETY: `buf` lives until the process exits.
    let _h = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    // Announced through a file: the test harness owns the child's stdout.
    let announce = std::env::var("NIXL_TEST_ANNOUNCE").unwrap();
    announce_agent(&announce, &target, buf.as_ptr() as u64);
    let msg = wait_notif(&target, "proc-initiator");
    assert_eq!(msg, b"second half written");
    // The second half now holds the initiator's pattern.
    assert_eq!(&buf[512 << 10..], &pattern(7, 1 << 20)[512 << 10..]);
    std::fs::write(format!("{announce}.ok"), "TARGET OK").unwrap();
}

#[test]
fn two_processes() {
    for provider in ["tcp;ofi_rxm", "sockets", "shm"] {
        let announce = announce_path("nixl-two-processes", provider);
        let mut cmd = self_test("target_process_main", false);
        cmd.env("NIXL_TEST_ROLE_TARGET", provider)
            .env("NIXL_TEST_ANNOUNCE", &announce);
        let mut target = PeerProcess::spawn(cmd, announce);
        let (addr, remote_base) = (target.addr, target.base);
        let initiator = agent("proc-initiator", provider, 2);
        let name = initiator.fetch_remote_metadata(addr).unwrap();
        let local = pattern(7, 1 << 20);
        let mut first_half = vec![0u8; 512 << 10];
        // SAFETY: both buffers outlive the handle and the requests.
        let _h = unsafe {
            initiator
                .register_mem(
                    &dram([Desc::from_slice(&local), Desc::from_slice(&first_half)]),
                    None,
                )
                .unwrap()
        };
        let half = 512u64 << 10;
        let mut read = initiator
            .create_xfer_req(
                XferOp::Read,
                &dram([Desc::new(first_half.as_mut_ptr() as u64, half, 0)]),
                &dram([Desc::new(remote_base, half, 0)]),
                &name,
                None,
            )
            .unwrap();
        read.post().unwrap();
        read.wait(TIMEOUT).unwrap();
        assert_eq!(first_half, pattern(42, 1 << 20)[..512 << 10].to_vec());
        let mut write = initiator
            .create_xfer_req(
                XferOp::Write,
                &dram([Desc::new(local.as_ptr() as u64 + half, half, 0)]),
                &dram([Desc::new(remote_base + half, half, 0)]),
                &name,
                Some(b"second half written".to_vec()),
            )
            .unwrap();
        write.post().unwrap();
        write.wait(TIMEOUT).unwrap();
        assert_eq!(target.verdict(), "TARGET OK", "{provider}");
    }
}

#[test]
fn without_progress_threads_the_callers_polls_drive_the_rails() {
    let config = AgentConfig {
        progress_thread: false,
        ..AgentConfig::default()
    };
    for provider in ["tcp;ofi_rxm", "shm"] {
        let initiator = agent_with(&format!("np-i-{provider}"), provider, 2, config.clone());
        let target = agent_with(&format!("np-t-{provider}"), provider, 2, config.clone());
        let len = 1 << 20;
        let src = pattern(5, len);
        let dst = vec![0u8; len];
        let mut back = vec![0u8; len];
        let back_p = back.as_mut_ptr() as u64;
        // SAFETY: the buffers outlive the handles and the requests of this iteration.
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
        // 64 blocks of 16 KiB, two rails, nobody but us progressing either side.
        let n = len / (16 << 10);
        let at = |base: u64, i: usize| Desc::new(base + (i * (16 << 10)) as u64, 16 << 10, 0);
        let local = dram((0..n).map(|i| at(src.as_ptr() as u64, i)));
        let remote = dram((0..n).map(|i| at(dst.as_ptr() as u64, i)));
        let mut req = initiator
            .create_xfer_req(
                XferOp::Write,
                &local,
                &remote,
                &name,
                Some(b"inline".to_vec()),
            )
            .unwrap();
        req.post().unwrap();
        let deadline = Instant::now() + TIMEOUT;
        let (mut done, mut notif) = (false, None);
        while !(done && notif.is_some()) {
            assert!(
                Instant::now() < deadline,
                "{provider}: no progress without threads"
            );
            done = done || req.status().unwrap() == nixl::XferStatus::Done;
            if let Some(mut msgs) = target.get_notifs().remove(initiator.name()) {
                notif = Some(msgs.remove(0));
            }
        }
        assert_eq!(notif.unwrap(), b"inline");
        assert_eq!(src, dst, "{provider}");
        let readback = dram((0..n).map(|i| at(back_p, i)));
        let mut read = initiator
            .create_xfer_req(XferOp::Read, &readback, &remote, &name, None)
            .unwrap();
        read.post().unwrap();
        while read.status().unwrap() != nixl::XferStatus::Done {
            assert!(
                Instant::now() < deadline,
                "{provider}: read made no progress"
            );
            target.get_notifs();
        }
        assert_eq!(back, src, "{provider}");
    }
}

/// `Agent::wait_notifs` over the network provider: woken by the rail workers as each
/// notification lands; without progress threads, by re-polling (which progresses).
#[test]
fn wait_notifs_is_woken_by_arrivals() {
    let target = agent("wait-t", "tcp;ofi_rxm", 2);
    let sender = agent("wait-s", "tcp;ofi_rxm", 2);
    sender
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    common::notif_wait::check_wait_notifs(&target, &sender);
    let config = AgentConfig {
        progress_thread: false,
        ..AgentConfig::default()
    };
    let target = agent_with("wait-np-t", "tcp;ofi_rxm", 1, config.clone());
    let sender = agent_with("wait-np-s", "tcp;ofi_rxm", 1, config);
    sender
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    common::notif_wait::check_wait_notifs(&target, &sender);
}
