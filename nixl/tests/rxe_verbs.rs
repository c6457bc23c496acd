#![cfg(feature = "verbs")]
//! The VERBS backend on soft-RoCE (run in the guest by `cargo xtask test`, which sets
//! `RDMA_TEST_DEVICE=rxe0`): two agents in one process and in two processes, WRITE/READ
//! batches of 1 to 15,000 descriptors verified byte for byte, notifications only after
//! the data, striping over several rails, a peer killed mid-transfer, and a restarted
//! peer reached again after its new metadata is loaded.

mod common;

use common::{
    announce, announce_agent, announce_path, dram, listening, pattern, rdma_device as device,
    self_test, serial, wait_file, wait_notif, PeerProcess, TIMEOUT,
};
use nixl::backends::verbs::VerbsBackend;
use nixl::{params, Agent, AgentConfig, Backend, Desc, DescList, Error, MemKind, XferOp, XferReq};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn agent(name: &str, device: &str, rails: usize) -> Agent {
    agent_with(name, device, rails, AgentConfig::default())
}

fn agent_with(name: &str, device: &str, rails: usize, config: AgentConfig) -> Agent {
    let agent = Agent::new(name, config).unwrap();
    let rails = rails.to_string();
    agent
        .create_backend(
            "VERBS",
            &params([
                ("device", device),
                ("num_rails", rails.as_str()),
                ("striping_threshold", "65536"),
            ]),
        )
        .unwrap_or_else(|e| panic!("VERBS on {device}: {e}"));
    agent
}

fn run(req: &mut XferReq) {
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
}

/// WRITE then READ back `count` non-contiguous blocks between two agents of this process.
fn write_read_batches(device: &str, rails: usize, count: usize, block: usize) {
    write_read_batches_with(device, rails, count, block, true)
}

fn write_read_batches_with(
    device: &str,
    rails: usize,
    count: usize,
    block: usize,
    progress_thread: bool,
) {
    let tag = format!("{rails}-{count}-{block}-{progress_thread}");
    let config = AgentConfig {
        progress_thread,
        ..AgentConfig::default()
    };
    let initiator = agent_with(&format!("init-{tag}"), device, rails, config.clone());
    let target = agent_with(&format!("tgt-{tag}"), device, rails, config);
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
    let start = Instant::now();
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &local,
            &remote,
            &name,
            Some(b"written".to_vec()),
        )
        .unwrap();
    assert_eq!(req.backend_name(), "VERBS");
    run(&mut req);
    assert_eq!(wait_notif(&target, initiator.name()), b"written");
    for i in 0..count {
        let s = &src[at(i) as usize..at(i) as usize + block];
        let d = &dst[at(count - 1 - i) as usize..at(count - 1 - i) as usize + block];
        assert_eq!(s, d, "{tag}: block {i}");
    }
    // Gaps untouched.
    for i in 0..count {
        let gap = at(i) as usize + block..at(i) as usize + 2 * block;
        assert!(dst[gap].iter().all(|b| *b == 0), "{tag}: gap {i} written");
    }
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
    run(&mut req);
    assert_eq!(wait_notif(&target, initiator.name()), b"read");
    for i in 0..count {
        assert_eq!(
            &back[at(i) as usize..at(i) as usize + block],
            &src[at(i) as usize..at(i) as usize + block],
            "{tag}: read block {i}"
        );
    }
    println!(
        "{tag}: {count} x {block} B written and read back in {:?}",
        start.elapsed()
    );
}

#[test]
fn write_read_one_descriptor() {
    let Some(dev) = device() else { return };
    let _s = serial();
    write_read_batches(&dev, 1, 1, 4096);
}

#[test]
fn write_read_1000_descriptors() {
    let Some(dev) = device() else { return };
    let _s = serial();
    write_read_batches(&dev, 1, 1000, 512);
}

#[test]
fn write_read_15000_descriptors_on_two_rails() {
    let Some(dev) = device() else { return };
    let _s = serial();
    write_read_batches(&dev, 2, 15_000, 64);
}

#[test]
fn without_progress_threads_polling_drives_everything() {
    let Some(dev) = device() else { return };
    let _s = serial();
    // Posting issues the first chain, status polls issue the rest and read completions,
    // the target's get_notifs reads its receive queue.
    write_read_batches_with(&dev, 2, 3000, 256, false);
    write_read_batches_with(&dev, 2, 2, 512 << 10, false);
}

#[test]
fn striping_over_two_and_four_rails() {
    let Some(dev) = device() else { return };
    let _s = serial();
    // Blocks of 256 KiB: each split across every rail (threshold 64 KiB).
    write_read_batches(&dev, 2, 4, 256 << 10);
    write_read_batches(&dev, 4, 3, 1 << 20);
}

#[test]
fn notification_fires_only_after_all_data_landed() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let initiator = agent("ni", &dev, 2);
    let target = agent("nt", &dev, 2);
    let len = 2 << 20;
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
    // 512 blocks of 4 KiB round-robin over two rails (two QPs, completing in any order)
    // plus one striped 64 KiB block.
    let n = len / 4096;
    let mut local: Vec<Desc> = (0..n - 16)
        .map(|i| Desc::new(src.as_ptr() as u64 + (i * 4096) as u64, 4096, 0))
        .collect();
    let mut remote: Vec<Desc> = (0..n - 16)
        .map(|i| Desc::new(dst.as_ptr() as u64 + (i * 4096) as u64, 4096, 0))
        .collect();
    let tail = ((n - 16) * 4096) as u64;
    local.push(Desc::new(src.as_ptr() as u64 + tail, 65536, 0));
    remote.push(Desc::new(dst.as_ptr() as u64 + tail, 65536, 0));
    let l = initiator.prep_xfer_dlist(None, &dram(local)).unwrap();
    let r = initiator
        .prep_xfer_dlist(Some(&name), &dram(remote))
        .unwrap();
    let idx: Vec<usize> = (0..l.len()).collect();
    let mut req = initiator
        .make_xfer_req(XferOp::Write, &l, &idx, &r, &idx, None, None)
        .unwrap();
    for round in 1..=5u8 {
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
            "round {round}: notification before byte {wrong:?} landed"
        );
        req.wait(TIMEOUT).unwrap();
    }
}

/// `Agent::wait_notifs` over VERBS: woken by the rail workers as each notification's
/// message lands; without progress threads, by re-polling (which reads the receive
/// queue).
#[test]
fn wait_notifs_is_woken_by_arrivals() {
    let Some(dev) = device() else { return };
    let _s = serial();
    for progress_thread in [true, false] {
        let config = AgentConfig {
            progress_thread,
            ..AgentConfig::default()
        };
        let target = agent_with(
            &format!("wait-t-{progress_thread}"),
            &dev,
            2,
            config.clone(),
        );
        let sender = agent_with(&format!("wait-s-{progress_thread}"), &dev, 1, config);
        sender
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        common::notif_wait::check_wait_notifs(&target, &sender);
    }
}

/// A notification whose sender goes away as soon as `gen_notif` returned (the send
/// completed: the target's transport has it) is still delivered: the sender's side
/// channel closing must not make the target drop what had landed on its connection.
/// With its rail worker (the default) the target reads the receive quickly, racing the
/// side channel's EOF; without one, nothing reads it before the EOF has been seen.
#[test]
fn a_notification_survives_its_sender_leaving_at_once() {
    let Some(dev) = device() else { return };
    let _s = serial();
    for progress_thread in [true, false] {
        let config = AgentConfig {
            progress_thread,
            ..AgentConfig::default()
        };
        let target = agent_with("leave-t", &dev, 1, config);
        for round in 0..20 {
            let name = format!("leave-s{round}");
            let sender = agent(&name, &dev, 1);
            sender
                .load_remote_metadata(&target.local_metadata().unwrap())
                .unwrap();
            sender.gen_notif("leave-t", b"bye").unwrap();
            drop(sender);
            if !progress_thread {
                // The side channel sees the EOF and forgets the connection meanwhile.
                std::thread::sleep(Duration::from_millis(200));
            }
            let got = target.wait_notifs(Duration::from_secs(10));
            assert_eq!(
                got.get(&name),
                Some(&vec![b"bye".to_vec()]),
                "progress thread {progress_thread}, round {round}: {got:?}"
            );
        }
    }
}

/// The side-channel thread never waits for a rail: while one of the target's rails is
/// held (as by a rail worker descheduled mid-round on a loaded host) for several
/// heartbeat timeouts, an initiator leaves and the target closes its connection, and
/// the target's heartbeats to the initiator that stays still go out on time: no false
/// `RemoteDisconnect`. The closed connection is retired once the rail is free (by the
/// rail workers, or without them by the next poll).
#[test]
fn heartbeats_go_out_while_a_rail_is_held_and_an_initiator_leaves() {
    let Some(dev) = device() else { return };
    let _s = serial();
    // The initiator that stays declares the target dead after 10 of its 100 ms
    // heartbeats (1 s: room for a slow guest); the hold is three times that.
    let hold = Duration::from_millis(3000);
    for progress_thread in [true, false] {
        let config = AgentConfig {
            progress_thread,
            ..AgentConfig::default()
        };
        let t = format!("held-t-{progress_thread}");
        let target = Agent::new(&t, config.clone()).unwrap();
        let verbs = Arc::new(
            VerbsBackend::open(
                &target.backend_init(params([("device", dev.as_str()), ("num_rails", "2")])),
            )
            .unwrap(),
        );
        target
            .add_backend(verbs.clone() as Arc<dyn Backend>)
            .unwrap();
        let md = target.local_metadata().unwrap();
        let stays = Agent::new(format!("held-stays-{progress_thread}"), config.clone()).unwrap();
        stays
            .create_backend(
                "VERBS",
                &params([("device", dev.as_str()), ("heartbeat_misses", "10")]),
            )
            .unwrap();
        let leaves = agent_with(&format!("held-leaves-{progress_thread}"), &dev, 1, config);
        stays.load_remote_metadata(&md).unwrap();
        leaves.load_remote_metadata(&md).unwrap();
        let held = verbs.test_hold_rail_lock(1, hold);
        let since = Instant::now();
        drop(leaves);
        // The target's side channel sees the EOF and closes the connection; rail 1,
        // held, cannot retire it yet.
        while verbs.test_closing_connections() == 0 {
            assert!(
                since.elapsed() < hold / 2,
                "progress thread {progress_thread}: the closed connection was not seen"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        held.join().unwrap();
        assert!(since.elapsed() >= hold / 2);
        // Beaten throughout: still connected.
        stays
            .gen_notif(&t, b"still here")
            .unwrap_or_else(|e| panic!("progress thread {progress_thread}: {e}"));
        assert_eq!(wait_notif(&target, stays.name()), b"still here");
        let deadline = Instant::now() + TIMEOUT;
        while verbs.test_closing_connections() != 0 {
            assert!(
                Instant::now() < deadline,
                "progress thread {progress_thread}: the closed connection was never retired"
            );
            target.get_notifs();
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[test]
fn standalone_notifications_loopback_and_reconnect() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let a = agent("loopy", &dev, 1);
    let b = agent("other", &dev, 2);
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
    // Loopback: a transfer from an agent to itself, through its own side channel.
    let src = pattern(3, 65536);
    let dst = vec![0u8; 65536];
    // SAFETY: both buffers outlive the handle and the requests.
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
    run(&mut req);
    assert_eq!(wait_notif(&a, "loopy"), b"self");
    assert_eq!(src, dst);
    // Invalidate: the request made before fails typed, and a reload reconnects.
    b.load_remote_metadata(&a.local_metadata().unwrap())
        .unwrap();
    let remote = dram([Desc::from_slice(&dst)]);
    let local_buf = pattern(9, 65536);
    // SAFETY: `local_buf` outlives the handle and the requests.
    let _hb = unsafe {
        b.register_mem(&dram([Desc::from_slice(&local_buf)]), None)
            .unwrap()
    };
    let local = dram([Desc::from_slice(&local_buf)]);
    let mut before = b
        .create_xfer_req(XferOp::Write, &local, &remote, "loopy", None)
        .unwrap();
    run(&mut before);
    assert_eq!(dst, local_buf);
    b.invalidate_remote("loopy").unwrap();
    match before.post() {
        Err(Error::RemoteDisconnect { agent, reason }) => {
            assert_eq!(agent, "loopy");
            println!("after invalidation: {reason}");
        }
        other => panic!("posting to an invalidated peer: {other:?}"),
    }
    b.load_remote_metadata(&a.local_metadata().unwrap())
        .unwrap();
    let mut after = b
        .create_xfer_req(
            XferOp::Read,
            &local,
            &dram([Desc::from_slice(&src)]),
            "loopy",
            None,
        )
        .unwrap();
    run(&mut after);
    assert_eq!(local_buf, src);
}

#[test]
fn bad_parameters_and_input_are_typed_errors() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let fresh = || Agent::new("p", AgentConfig::default()).unwrap();
    assert!(matches!(
        fresh().create_backend("VERBS", &params([("device", "no_such_dev0")])),
        Err(Error::Backend { .. })
    ));
    assert!(matches!(
        fresh().create_backend("VERBS", &params([("bogus", "1")])),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        fresh().create_backend(
            "VERBS",
            &params([("device", dev.as_str()), ("num_rails", "0")])
        ),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        fresh().create_backend(
            "VERBS",
            &params([("device", dev.as_str()), ("listen_addr", "nonsense")])
        ),
        Err(Error::InvalidParam(_))
    ));
    assert!(matches!(
        fresh().create_backend(
            "VERBS",
            &params([
                ("device", dev.as_str()),
                ("topology_xml", "/nonexistent/topology.xml")
            ])
        ),
        Err(Error::InvalidParam(_))
    ));
    let a = agent("bad-a", &dev, 1);
    let b = agent("bad-b", &dev, 1);
    let buf = vec![0u8; 8192];
    let base = buf.as_ptr() as u64;
    // SAFETY: `buf` outlives the handles.
    let _ha = unsafe {
        a.register_mem(&dram([Desc::new(base, 4096, 0)]), None)
            .unwrap()
    };
    // SAFETY: as above.
    let hb = unsafe {
        b.register_mem(&dram([Desc::new(base + 4096, 4096, 0)]), None)
            .unwrap()
    };
    // SAFETY: refused before anything is registered.
    let vram = unsafe {
        a.register_mem(
            &DescList::from_descs(MemKind::Vram, [Desc::new(base, 64, 0)]),
            Some(&["VERBS"]),
        )
    };
    assert!(matches!(
        vram,
        Err(Error::UnsupportedMemKind {
            kind: MemKind::Vram,
            ..
        })
    ));
    // Metadata of a backend that is gone: the side channel refuses the connection.
    let stale = b.local_metadata().unwrap();
    drop(hb); // the handle holds the agent (and its backends) too
    drop(b);
    match a.load_remote_metadata(&stale) {
        Err(Error::RemoteDisconnect { agent, reason }) => {
            assert_eq!(agent, "bad-b");
            println!("stale metadata: {reason}");
        }
        other => panic!("loading metadata of a dead agent: {other:?}"),
    }
    assert!(!a.has_remote("bad-b"));
    // A corrupt region key section is a typed error, not a panic.
    let c = agent("bad-c", &dev, 1);
    // SAFETY: `buf` outlives the handle.
    let _hc = unsafe {
        c.register_mem(&dram([Desc::new(base + 4096, 4096, 0)]), None)
            .unwrap()
    };
    let mut md = c.local_metadata().unwrap();
    let last = md.len() - 1;
    md.truncate(last);
    assert!(matches!(
        a.load_remote_metadata(&md),
        Err(Error::MalformedMetadata(_))
    ));
}

// ---------------------------------------------------------------------------------------
// Two processes: the test re-executes its own binary as the target.

const TARGET_NAME: &str = "verbs-target";
const INITIATOR_NAME: &str = "verbs-initiator";
const TARGET_LEN: usize = 16 << 20;

/// The target side, run only as a child of `two_processes_batches_kill_and_restart`: it
/// registers a buffer, announces its metadata listener and the buffer's address, and on
/// each notification `verify SEED LEN` checks that its first LEN bytes are
/// `pattern(SEED)`, writing the verdict to a file; `exit` ends it.
#[test]
#[ignore = "target process of two_processes_batches_kill_and_restart"]
fn target_process() {
    let announce_file = std::env::var("NIXL_VERBS_ANNOUNCE")
        .expect("run by two_processes_batches_kill_and_restart");
    let dev = device().expect("RDMA_TEST_DEVICE is inherited");
    let target = agent_with(TARGET_NAME, &dev, 2, listening());
    let buf = pattern(42, TARGET_LEN);
    // SAFETY: `buf` lives until the process exits.
    let _h = unsafe {
        target
            .register_mem(&dram([Desc::from_slice(&buf)]), None)
            .unwrap()
    };
    announce_agent(&announce_file, &target, buf.as_ptr() as u64);
    let deadline = Instant::now() + Duration::from_secs(400);
    loop {
        assert!(Instant::now() < deadline, "target: never told to exit");
        let notifs = target
            .get_notifs()
            .remove(INITIATOR_NAME)
            .unwrap_or_default();
        for msg in notifs {
            let text = String::from_utf8(msg).unwrap();
            let words: Vec<&str> = text.split(' ').collect();
            match words[..] {
                ["verify", seed, len] => {
                    let (seed, len): (u8, usize) = (seed.parse().unwrap(), len.parse().unwrap());
                    // SAFETY: the initiator's writes are done (the notification follows
                    // them); nothing writes the buffer until we answer.
                    let seen = unsafe { std::slice::from_raw_parts(buf.as_ptr(), len) };
                    let verdict = match seen
                        .iter()
                        .zip(pattern(seed, len))
                        .position(|(a, b)| *a != b)
                    {
                        None => "ok".to_string(),
                        Some(i) => format!("byte {i} differs"),
                    };
                    announce(format!("{announce_file}.verify-{seed}"), &verdict);
                }
                ["exit"] => return,
                _ => panic!("target: unexpected notification `{text}`"),
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A copy of this binary running [`target_process`].
fn spawn_target(tag: &str) -> PeerProcess {
    let announce = announce_path("nixl-verbs", tag);
    let mut cmd = self_test("target_process", true);
    cmd.arg("--nocapture").env("NIXL_VERBS_ANNOUNCE", &announce);
    PeerProcess::spawn(cmd, announce)
}

/// Waits for the target's verdict on `seed`.
fn verdict(target: &mut PeerProcess, seed: u8) -> String {
    let path = std::path::PathBuf::from(format!("{}.verify-{seed}", target.announce.display()));
    let text = wait_file(&path, &mut target.child);
    let _ = std::fs::remove_file(&path);
    text
}

/// WRITEs `count` blocks so that the target's first `count * block` bytes become
/// `pattern(seed)` (local block i lands at the target's block `count - 1 - i`), with the
/// notification that makes the target verify them; then READs them back in order.
fn write_verify_read(
    initiator: &Agent,
    target: &mut PeerProcess,
    src: &mut [u8],
    back: &mut [u8],
    count: usize,
    block: usize,
    seed: u8,
) {
    let len = count * block;
    let expected = pattern(seed, len);
    for i in 0..count {
        let from = (count - 1 - i) * block;
        src[i * block..(i + 1) * block].copy_from_slice(&expected[from..from + block]);
    }
    let (src_p, back_p) = (src.as_ptr() as u64, back.as_mut_ptr() as u64);
    let b = block as u64;
    let local = dram((0..count).map(|i| Desc::new(src_p + i as u64 * b, b, 0)));
    let remote =
        dram((0..count).map(|i| Desc::new(target.base + (count - 1 - i) as u64 * b, b, 0)));
    let start = Instant::now();
    let mut write = initiator
        .create_xfer_req(
            XferOp::Write,
            &local,
            &remote,
            TARGET_NAME,
            Some(format!("verify {seed} {len}").into_bytes()),
        )
        .unwrap();
    run(&mut write);
    assert_eq!(
        verdict(target, seed),
        "ok",
        "{count} x {block} B, seed {seed}"
    );
    back[..len].fill(0);
    let readback = dram((0..count).map(|i| Desc::new(back_p + i as u64 * b, b, 0)));
    let in_order = dram((0..count).map(|i| Desc::new(target.base + i as u64 * b, b, 0)));
    let mut read = initiator
        .create_xfer_req(XferOp::Read, &readback, &in_order, TARGET_NAME, None)
        .unwrap();
    run(&mut read);
    let wrong = back[..len].iter().zip(&expected).position(|(a, b)| a != b);
    assert_eq!(wrong, None, "{count} x {block} B read back, seed {seed}");
    println!(
        "two processes: {count} x {block} B written, verified by the target, read back in {:?}",
        start.elapsed()
    );
}

#[test]
fn two_processes_batches_kill_and_restart() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let stall_timeout = Duration::from_secs(10);
    let initiator = agent_with(
        INITIATOR_NAME,
        &dev,
        2,
        AgentConfig {
            stall_timeout,
            ..AgentConfig::default()
        },
    );
    let mut src = vec![0u8; TARGET_LEN];
    let mut back = vec![0u8; TARGET_LEN];
    // SAFETY: both buffers outlive the handle and every request (dropped at the end of
    // this function, after all of them).
    let _h = unsafe {
        initiator
            .register_mem(
                &dram([Desc::from_slice(&src), Desc::from_slice(&back)]),
                None,
            )
            .unwrap()
    };
    let mut target = spawn_target("first");
    assert_eq!(
        initiator.fetch_remote_metadata(target.addr).unwrap(),
        TARGET_NAME
    );
    write_verify_read(&initiator, &mut target, &mut src, &mut back, 1, 1 << 20, 1);
    write_verify_read(&initiator, &mut target, &mut src, &mut back, 1000, 4096, 2);
    write_verify_read(&initiator, &mut target, &mut src, &mut back, 15_000, 64, 3);
    write_verify_read(&initiator, &mut target, &mut src, &mut back, 4, 1 << 20, 4);

    // SIGKILL the target while a 16 MiB WRITE (256 x 64 KiB) is in flight.
    let block = 64u64 << 10;
    let count = TARGET_LEN as u64 / block;
    let src_p = src.as_ptr() as u64;
    let local = dram((0..count).map(|i| Desc::new(src_p + i * block, block, 0)));
    let remote = dram((0..count).map(|i| Desc::new(target.base + i * block, block, 0)));
    let mut big = initiator
        .create_xfer_req(XferOp::Write, &local, &remote, TARGET_NAME, None)
        .unwrap();
    big.post().unwrap();
    target.child.kill().unwrap();
    target.child.wait().unwrap();
    let killed = Instant::now();
    let outcome = big.wait(stall_timeout + Duration::from_secs(5));
    let detected = killed.elapsed();
    match &outcome {
        Err(Error::RemoteDisconnect { agent, reason }) => {
            assert_eq!(agent, TARGET_NAME);
            println!("peer killed mid-transfer: RemoteDisconnect after {detected:?}: {reason}");
        }
        Err(Error::Stalled(_)) => println!("peer killed mid-transfer: Stalled after {detected:?}"),
        other => panic!("a transfer to a killed peer must fail typed, got {other:?}"),
    }
    assert!(detected <= stall_timeout, "detected after {detected:?}");
    // Preparing or posting again to the dead incarnation fails at once, typed.
    let again = initiator
        .create_xfer_req(XferOp::Write, &local, &remote, TARGET_NAME, None)
        .and_then(|mut req| {
            req.post()?;
            req.wait(stall_timeout + Duration::from_secs(5))
        });
    match again {
        Err(Error::RemoteDisconnect { .. }) | Err(Error::Stalled(_)) => {}
        other => panic!("a new transfer to a killed peer: {other:?}"),
    }

    // The peer restarts (new process, new metadata): loading it reconnects, the local
    // agent is the same.
    let mut target = spawn_target("second");
    assert_eq!(
        initiator.fetch_remote_metadata(target.addr).unwrap(),
        TARGET_NAME
    );
    write_verify_read(&initiator, &mut target, &mut src, &mut back, 1000, 4096, 5);
    write_verify_read(&initiator, &mut target, &mut src, &mut back, 2, 1 << 20, 6);
    initiator.gen_notif(TARGET_NAME, b"exit").unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(status) = target.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted target did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "the restarted target failed");
}

/// A HELLO as an initiator sends it, naming `name`, with one endpoint on the target's
/// first rail (from the target's connection information, so its QP connects).
fn raw_hello(target_info: &[u8], name: &str) -> Vec<u8> {
    // `NXVC ver nonce:u64 addr nrails:u8 {dev:u8 gid:16 lid:u16 mtu:u8}*`
    let nonce = &target_info[5..13];
    let rails = match target_info[13] {
        4 => 13 + 7,
        _ => 13 + 19,
    };
    let rail = &target_info[rails + 1..rails + 21];
    let mut hello = b"NXVH\x03".to_vec();
    hello.extend_from_slice(nonce);
    hello.extend_from_slice(&0x5eedu64.to_le_bytes());
    hello.extend_from_slice(&(name.len() as u16).to_le_bytes());
    hello.extend_from_slice(name.as_bytes());
    hello.push(1);
    hello.extend_from_slice(&0x1234u32.to_le_bytes());
    hello.extend_from_slice(&0x77u32.to_le_bytes());
    hello.extend_from_slice(&rail[1..]);
    hello
}

/// Sends `hello` on a fresh side-channel connection; returns the reply's status byte
/// (0: connected, 1: refused).
fn hello_status(at: std::net::SocketAddr, hello: &[u8]) -> u8 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(at).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&(hello.len() as u32).to_le_bytes()).unwrap();
    s.write_all(hello).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut reply = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[..4], b"NXVR");
    reply[5]
}

/// This process plays an attacker on the target's side channel with a HELLO naming a
/// peer the target loaded: the target asks that peer, which does not own the
/// connection, and refuses it (counted); a name the target never loaded is the
/// initiator's word, as in NIXL; the real peer still connects and notifies.
#[test]
fn a_hello_naming_a_loaded_peer_is_refused_unless_that_peer_sent_it() {
    let Some(dev) = device() else { return };
    let _s = serial();
    let target = Agent::new("forge-t", AgentConfig::default()).unwrap();
    let verbs = Arc::new(
        VerbsBackend::open(&target.backend_init(params([("device", dev.as_str())]))).unwrap(),
    );
    target
        .add_backend(verbs.clone() as Arc<dyn Backend>)
        .unwrap();
    let victim = agent("forge-victim", &dev, 1);
    target
        .load_remote_metadata(&victim.local_metadata().unwrap())
        .unwrap();
    let info = verbs.connection_info().unwrap();
    let at = verbs.side_channel_addr();
    assert_eq!(
        hello_status(at, &raw_hello(&info, "forge-victim")),
        1,
        "a HELLO naming a loaded peer accepted from another connection"
    );
    assert_eq!(hello_status(at, &raw_hello(&info, "forge-t")), 1);
    assert_eq!(verbs.refused_hellos(), 2);
    assert_eq!(hello_status(at, &raw_hello(&info, "forge-stranger")), 0);
    victim
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    victim.gen_notif("forge-t", b"real").unwrap();
    assert_eq!(wait_notif(&target, "forge-victim"), b"real");
    assert_eq!(verbs.refused_hellos(), 2);
    assert!(target.get_notifs().is_empty(), "forged notifications");
}
