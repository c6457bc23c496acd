#![cfg(feature = "libfabric")]
//! Concurrency stress over LIBFABRIC: threads posting and polling transfers, threads
//! taking notifications, and threads invalidating and reloading the same peer, all at
//! once. Bounded in iterations and every wait bounded in time: a deadlock fails the test
//! instead of hanging it. Checks: every transfer that reported done has its notification
//! delivered exactly once, nothing is delivered that was not posted, and the data of the
//! last transfers is in place.

mod common;

use common::dram;
use nixl::{params, Agent, AgentConfig, Desc, Error, XferOp, XferStatus};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(120);
const POSTERS: usize = 4;
const ITERATIONS: usize = 150;
const BLOCK: usize = 16 << 10;

fn agent(name: &str) -> Agent {
    let agent = Agent::new(
        name,
        AgentConfig {
            stall_timeout: Duration::from_secs(20),
            ..AgentConfig::default()
        },
    )
    .unwrap();
    agent
        .create_backend(
            "LIBFABRIC",
            &params([
                ("provider", "tcp;ofi_rxm"),
                ("local_provider", "none"),
                ("num_rails", "2"),
            ]),
        )
        .unwrap();
    agent
}

fn fill(t: usize, i: usize) -> u8 {
    (t * 31 + i * 7) as u8 | 1
}

/// Polls a request to an end, bounded.
fn drive(req: &mut nixl::XferReq) -> nixl::Result<()> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if req.status()? == XferStatus::Done {
            return Ok(());
        }
        assert!(Instant::now() < deadline, "a transfer hung");
        std::thread::yield_now();
    }
}

#[test]
fn posting_polling_and_invalidating_at_once() {
    let initiator = agent("stress-i");
    let target = agent("stress-t");
    let bystander = agent("stress-b");
    let src = vec![0u8; POSTERS * BLOCK];
    // Each poster's block, then one block per poster that only the final round writes.
    let dst = vec![0u8; 2 * POSTERS * BLOCK];
    let (src_p, dst_p) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    // SAFETY: the buffers outlive the handles and every thread (scoped below).
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
    let target_md = target.local_metadata().unwrap();
    let bystander_md = bystander.local_metadata().unwrap();
    initiator.load_remote_metadata(&target_md).unwrap();
    initiator.load_remote_metadata(&bystander_md).unwrap();

    let done_msgs: Mutex<HashSet<Vec<u8>>> = Mutex::default();
    let posted_msgs: Mutex<HashSet<Vec<u8>>> = Mutex::default();
    let received: Mutex<HashMap<Vec<u8>, usize>> = Mutex::default();
    let posters_left = AtomicUsize::new(POSTERS);
    let stop = AtomicBool::new(false);
    let outcomes: Mutex<HashMap<&'static str, usize>> = Mutex::default();
    let count = |what: &'static str| *outcomes.lock().unwrap().entry(what).or_default() += 1;
    let started = Instant::now();

    std::thread::scope(|s| {
        // Posters: each owns one block of the source and of the target.
        for t in 0..POSTERS {
            let (initiator, done_msgs, posted_msgs, posters_left, count) =
                (&initiator, &done_msgs, &posted_msgs, &posters_left, &count);
            s.spawn(move || {
                let off = (t * BLOCK) as u64;
                let local = dram([Desc::new(src_p + off, BLOCK as u64, 0)]);
                let remote = dram([Desc::new(dst_p + off, BLOCK as u64, 0)]);
                let deadline = Instant::now() + TIMEOUT;
                let mut i = 0;
                while i < ITERATIONS {
                    assert!(Instant::now() < deadline, "poster {t} made no headway");
                    // SAFETY: this thread is the only writer of its block and no request
                    // of it is in flight here (the previous one ended or was dropped).
                    unsafe { std::ptr::write_bytes((src_p + off) as *mut u8, fill(t, i), BLOCK) };
                    let msg = format!("{t}:{i}").into_bytes();
                    let made = initiator.create_xfer_req(
                        XferOp::Write,
                        &local,
                        &remote,
                        "stress-t",
                        Some(msg.clone()),
                    );
                    let mut req = match made {
                        Ok(req) => req,
                        // Invalidated, or reloaded between prepare and make: try the next.
                        // (the same iteration is tried again).
                        Err(Error::UnknownAgent(_)) => {
                            count("unknown");
                            std::thread::sleep(Duration::from_micros(100));
                            continue;
                        }
                        Err(Error::InvalidParam(m)) if m.contains("reloaded") => {
                            count("reloaded");
                            continue;
                        }
                        Err(e) => panic!("make: {e:?}"),
                    };
                    match req.post() {
                        Ok(_) => {}
                        Err(Error::RemoteDisconnect { .. }) => {
                            count("stale");
                            i += 1;
                            continue;
                        }
                        Err(e) => panic!("post: {e:?}"),
                    }
                    posted_msgs.lock().unwrap().insert(msg.clone());
                    match drive(&mut req) {
                        Ok(()) => {
                            count("done");
                            done_msgs.lock().unwrap().insert(msg);
                        }
                        Err(Error::RemoteDisconnect { .. }) => count("disconnected"),
                        Err(e) => panic!("status: {e:?}"),
                    }
                    // Sometimes release one in flight instead of waiting.
                    if i % 10 == 5 {
                        let mut extra = initiator.create_xfer_req(
                            XferOp::Write,
                            &local,
                            &remote,
                            "stress-t",
                            None,
                        );
                        if let Ok(extra) = extra.as_mut() {
                            let _ = extra.post();
                        }
                    }
                    i += 1;
                }
                posters_left.fetch_sub(1, Ordering::AcqRel);
            });
        }
        // Notification takers, concurrently with everything else.
        for _ in 0..2 {
            let (target, received, stop) = (&target, &received, &stop);
            s.spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    for (from, msgs) in target.get_notifs() {
                        assert_eq!(from, "stress-i");
                        let mut received = received.lock().unwrap();
                        for m in msgs {
                            *received.entry(m).or_default() += 1;
                        }
                    }
                    std::thread::sleep(Duration::from_micros(100));
                }
            });
        }
        // Invalidators: the target itself (full and partial reloads), and a bystander.
        {
            let (initiator, posters_left, target_md, count) =
                (&initiator, &posters_left, &target_md, &count);
            s.spawn(move || {
                let mut n = 0u64;
                while posters_left.load(Ordering::Acquire) > 0 {
                    assert!(started.elapsed() < TIMEOUT, "posters never finished");
                    n += 1;
                    match initiator.invalidate_remote("stress-t") {
                        Ok(()) | Err(Error::UnknownAgent(_)) => {}
                        Err(e) => panic!("invalidate: {e:?}"),
                    }
                    std::thread::sleep(Duration::from_micros(200 + (n % 7) * 300));
                    initiator.load_remote_metadata(target_md).unwrap();
                    count("invalidations");
                    std::thread::sleep(Duration::from_millis(2 + n % 5));
                }
            });
            let bystander_md = &bystander_md;
            s.spawn(move || {
                while posters_left.load(Ordering::Acquire) > 0 {
                    let _ = initiator.invalidate_remote("stress-b");
                    initiator.load_remote_metadata(bystander_md).unwrap();
                    let _ = initiator.remote_regions("stress-t");
                    let _ = initiator.has_remote("stress-t");
                    std::thread::sleep(Duration::from_micros(300));
                }
            });
        }
        // When every poster is through, the final round below runs undisturbed; the
        // takers keep collecting until it is accounted for.
        s.spawn(|| {
            while posters_left.load(Ordering::Acquire) > 0 {
                assert!(started.elapsed() < TIMEOUT, "posters never finished");
                std::thread::sleep(Duration::from_millis(1));
            }
            initiator.load_remote_metadata(&target_md).unwrap();
            // A last write per block, with the peer stable: its data must be in place.
            for t in 0..POSTERS {
                let off = (t * BLOCK) as u64;
                // SAFETY: the posters are done; nothing else writes the source.
                unsafe {
                    std::ptr::write_bytes((src_p + off) as *mut u8, fill(t, ITERATIONS), BLOCK)
                };
                let msg = format!("{t}:final").into_bytes();
                let mut req = initiator
                    .create_xfer_req(
                        XferOp::Write,
                        &dram([Desc::new(src_p + off, BLOCK as u64, 0)]),
                        &dram([Desc::new(
                            dst_p + ((POSTERS + t) * BLOCK) as u64,
                            BLOCK as u64,
                            0,
                        )]),
                        "stress-t",
                        Some(msg.clone()),
                    )
                    .unwrap();
                req.post().unwrap();
                drive(&mut req).unwrap();
                posted_msgs.lock().unwrap().insert(msg.clone());
                done_msgs.lock().unwrap().insert(msg);
            }
            // Every done transfer's notification arrives.
            let deadline = Instant::now() + TIMEOUT;
            loop {
                let missing: Vec<String> = {
                    let received = received.lock().unwrap();
                    done_msgs
                        .lock()
                        .unwrap()
                        .iter()
                        .filter(|m| !received.contains_key(*m))
                        .map(|m| String::from_utf8_lossy(m).into_owned())
                        .collect()
                };
                if missing.is_empty() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "notifications of done transfers lost: {missing:?}"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            stop.store(true, Ordering::Release);
        });
    });

    let received = received.into_inner().unwrap();
    let posted = posted_msgs.into_inner().unwrap();
    for (msg, n) in &received {
        assert_eq!(
            *n,
            1,
            "{} delivered {n} times",
            String::from_utf8_lossy(msg)
        );
        assert!(posted.contains(msg), "never posted: {msg:?}");
    }
    for t in 0..POSTERS {
        let block = &dst[(POSTERS + t) * BLOCK..(POSTERS + t + 1) * BLOCK];
        assert!(block.iter().all(|b| *b == fill(t, ITERATIONS)), "block {t}");
    }
    let outcomes = outcomes.into_inner().unwrap();
    eprintln!("stress outcomes: {outcomes:?}");
    assert!(
        outcomes.get("done").copied().unwrap_or(0) > 0,
        "nothing ever completed"
    );
    assert!(
        outcomes.get("invalidations").copied().unwrap_or(0) > 0,
        "the peer was never invalidated"
    );
}
