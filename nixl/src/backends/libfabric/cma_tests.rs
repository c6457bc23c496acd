//! Same-host WRITEs and READs copied from both ends (modules `cma` and `assist`), end to
//! end over `shm` between two agents of this process: every byte lands, a notification
//! follows all of them, and only blocks from the threshold are pushed.

use super::*;
use crate::Agent;
use crate::{params, Desc, DescList, XferOp};

fn agent(name: &str, rails: &str, cma: &str) -> (Agent, Arc<LibfabricBackend>) {
    agent_with(name, rails, cma, true)
}

fn agent_with(
    name: &str,
    rails: &str,
    cma: &str,
    progress_thread: bool,
) -> (Agent, Arc<LibfabricBackend>) {
    let config = crate::AgentConfig {
        progress_thread,
        ..crate::AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    let backend = Arc::new(
        open_for(
            &agent,
            &params([
                ("provider", "shm"),
                ("num_rails", rails),
                ("cma_write", cma),
                ("cma_read", cma),
            ]),
        )
        .unwrap(),
    );
    agent.add_backend(backend.clone()).unwrap();
    (agent, backend)
}

#[test]
fn large_blocks_are_pushed_in_part_and_land_before_their_notification() {
    let len = 8 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 13 + i / 4096) as u8).collect();
    for (rails, cma_write, slow_pushes) in
        [("1", "1", 0), ("4", "1", 0), ("4", "1", 300), ("2", "0", 0)]
    {
        // Pushes slower than the provider's pieces: the notification (and a READ's
        // completion) must wait for them.
        cma::TEST_PUSH_DELAY_MS.store(slow_pushes, Ordering::Relaxed);
        let tag = format!("{rails}-{cma_write}-{slow_pushes}");
        let (initiator, pusher) = agent(&format!("cma-init-{tag}"), rails, cma_write);
        let (target, _t) = agent(&format!("cma-tgt-{tag}"), rails, cma_write);
        let mut dst = vec![0u8; len];
        let mut back = vec![0u8; len];
        let (src_p, dst_p, back_p) = (
            src.as_ptr() as u64,
            dst.as_mut_ptr() as u64,
            back.as_mut_ptr() as u64,
        );
        let list = |descs: &[(u64, usize)]| {
            DescList::from_descs(
                MemKind::Dram,
                descs.iter().map(|&(p, n)| Desc::new(p, n as u64, 0)),
            )
        };
        // SAFETY: the buffers outlive the registrations and requests.
        let _hi =
            unsafe { initiator.register_mem(&list(&[(src_p, len), (back_p, len)]), None) }.unwrap();
        // SAFETY: as above.
        let _ht = unsafe { target.register_mem(&list(&[(dst_p, len)]), None) }.unwrap();
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        // The target serves READ assists to initiators it loaded, into what they
        // advertised (see the `assist` module's trust model).
        target
            .load_remote_metadata(&initiator.local_metadata().unwrap())
            .unwrap();
        // Blocks below the threshold, at it, unaligned, and a batch mixing them.
        let cases: [&[usize]; 5] = [
            &[(2 << 20) - 1],
            &[2 << 20],
            &[(3 << 20) + 5],
            &[len],
            &[64 << 10, (2 << 20) + 4097, 1 << 20, (2 << 20) + 12_288],
        ];
        for (case, blocks) in cases.iter().enumerate() {
            let mut at = 0usize;
            let descs: Vec<(usize, usize)> = blocks
                .iter()
                .map(|&n| {
                    let d = (at, n);
                    at += n + 4096 * 3;
                    d
                })
                .collect();
            let total: usize = blocks.iter().sum();
            let pushable: usize = blocks.iter().filter(|&&n| n >= cma::PUSH_THRESHOLD).sum();
            // The case's descriptors at `base`.
            let on = |base: u64| {
                list(
                    &descs
                        .iter()
                        .map(|&(o, n)| (base + o as u64, n))
                        .collect::<Vec<_>>(),
                )
            };
            for notif in [None, Some(format!("case {case}").into_bytes())] {
                dst.iter_mut().for_each(|b| *b = 0);
                let before = pusher.pushed_bytes();
                let mut req = initiator
                    .create_xfer_req(XferOp::Write, &on(src_p), &on(dst_p), &name, notif.clone())
                    .unwrap();
                req.post().unwrap();
                if let Some(msg) = &notif {
                    // The target looks at its memory as soon as the message is there.
                    let deadline = Instant::now() + Duration::from_secs(10);
                    'wait: loop {
                        for got in target.get_notifs().into_values().flatten() {
                            if got == *msg {
                                break 'wait;
                            }
                        }
                        assert!(
                            Instant::now() < deadline,
                            "{tag} case {case}: no notification"
                        );
                        std::thread::yield_now();
                    }
                    for &(o, n) in &descs {
                        assert!(
                            dst[o..o + n] == src[o..o + n],
                            "{tag} case {case}: the notification came before the data"
                        );
                    }
                }
                req.wait(Duration::from_secs(10)).unwrap();
                let mut expected = vec![0u8; len];
                for &(o, n) in &descs {
                    expected[o..o + n].copy_from_slice(&src[o..o + n]);
                }
                assert!(dst == expected, "{tag} case {case}: WRITE of {blocks:?}");
                let pushed = pusher.pushed_bytes() - before;
                if cma_write == "0" || pushable == 0 {
                    assert_eq!(pushed, 0, "{tag} case {case}");
                } else {
                    // Every other piece of each block from the threshold, never all of it.
                    assert!(
                        pushed > 0 && (pushed as usize) < pushable && (pushed as usize) < total,
                        "{tag} case {case}: {pushed} of {pushable} bytes pushed"
                    );
                }
            }
            // READs: of a block from the threshold the target pushes every other piece on
            // request and this side pulls the others itself; it pushes nothing.
            dst.copy_from_slice(&src);
            for notif in [None, Some(format!("read {case}").into_bytes())] {
                back.iter_mut().for_each(|b| *b = 0);
                let (pushed_before, assisted_before, pulled_before) = (
                    pusher.pushed_bytes(),
                    pusher.assisted_bytes(),
                    pusher.pulled_bytes(),
                );
                let mut req = initiator
                    .create_xfer_req(XferOp::Read, &on(back_p), &on(dst_p), &name, notif.clone())
                    .unwrap();
                req.post().unwrap();
                req.wait(Duration::from_secs(10)).unwrap();
                for &(o, n) in &descs {
                    assert!(back[o..o + n] == src[o..o + n], "{tag} case {case}: READ");
                }
                assert_eq!(
                    pusher.pushed_bytes(),
                    pushed_before,
                    "{tag} case {case}: a READ pushed"
                );
                let assisted = pusher.assisted_bytes() - assisted_before;
                let pulled = pusher.pulled_bytes() - pulled_before;
                if cma_write == "0" || pushable == 0 {
                    assert_eq!((assisted, pulled), (0, 0), "{tag} case {case}");
                } else {
                    // Both ends copy, and nothing of those blocks goes through the provider.
                    assert!(
                        assisted > 0 && pulled > 0 && (assisted + pulled) as usize == pushable,
                        "{tag} case {case}: {assisted} bytes pushed by the target and {pulled} \
                         pulled of {pushable}"
                    );
                }
                if let Some(msg) = &notif {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while !target
                        .get_notifs()
                        .into_values()
                        .flatten()
                        .any(|got| got == *msg)
                    {
                        assert!(
                            Instant::now() < deadline,
                            "{tag} case {case}: no READ notif"
                        );
                        std::thread::yield_now();
                    }
                }
            }
        }
    }
}

/// The notification `msg` from the target's point of view: waits for it (polling `req`,
/// which drives the initiator's rails where there are no progress threads), then checks
/// that `dst` already holds `want` (a notification must never come before its data).
fn await_notif_after_data(
    target: &Agent,
    req: &mut crate::XferReq,
    msg: &[u8],
    (dst, want): (&[u8], &[u8]),
    tag: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !target
        .get_notifs()
        .into_values()
        .flatten()
        .any(|got| got == msg)
    {
        assert!(Instant::now() < deadline, "{tag}: no notification");
        req.status().unwrap();
        std::thread::yield_now();
    }
    assert!(dst == want, "{tag}: the notification came before the data");
}

#[test]
fn small_transfers_are_copied_by_the_poster_and_land_before_their_notification() {
    let len = 256 << 10;
    let src: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096 + 1) as u8).collect();
    // (progress threads, cma_inline): the default, without progress threads, below the
    // largest case, none.
    let configs = [
        (true, None),
        (false, None),
        (true, Some("65536")),
        (true, Some("0")),
    ];
    for (progress_thread, inline) in configs {
        let limit = inline.map_or(DEFAULT_CMA_INLINE, |v| v.parse().unwrap());
        let tag = format!("{progress_thread}-{inline:?}");
        let open = |name: &str| {
            let config = crate::AgentConfig {
                progress_thread,
                ..crate::AgentConfig::default()
            };
            let agent = Agent::new(name, config).unwrap();
            let mut p = vec![("provider", "shm"), ("num_rails", "2")];
            p.extend(inline.map(|v| ("cma_inline", v)));
            let backend = Arc::new(open_for(&agent, &params(p)).unwrap());
            agent.add_backend(backend.clone()).unwrap();
            (agent, backend)
        };
        let (initiator, poster) = open(&format!("inline-init-{tag}"));
        let (target, _t) = open(&format!("inline-tgt-{tag}"));
        let mut dst = vec![0u8; len];
        let mut back = vec![0u8; len];
        let (src_p, dst_p, back_p) = (
            src.as_ptr() as u64,
            dst.as_mut_ptr() as u64,
            back.as_mut_ptr() as u64,
        );
        let list = |descs: &[(u64, usize)]| {
            DescList::from_descs(
                MemKind::Dram,
                descs.iter().map(|&(p, n)| Desc::new(p, n as u64, 0)),
            )
        };
        // SAFETY: the buffers outlive the registrations and requests.
        let _hi =
            unsafe { initiator.register_mem(&list(&[(src_p, len), (back_p, len)]), None) }.unwrap();
        // SAFETY: as above.
        let _ht = unsafe { target.register_mem(&list(&[(dst_p, len)]), None) }.unwrap();
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        // One block, one unaligned byte, a batch of odd blocks, the whole region.
        let cases: [&[(usize, usize)]; 4] = [
            &[(0, 4096)],
            &[(4099, 1)],
            &[(3, 3000), (9000, 5000), (65_536, 12_345), (200_000, 7)],
            &[(0, len)],
        ];
        for (case, descs) in cases.iter().enumerate() {
            let total: usize = descs.iter().map(|d| d.1).sum();
            let copies = total <= limit;
            let on = |base: u64| {
                list(
                    &descs
                        .iter()
                        .map(|&(o, n)| (base + o as u64, n))
                        .collect::<Vec<_>>(),
                )
            };
            let mut want = vec![0u8; len];
            for &(o, n) in descs.iter() {
                want[o..o + n].copy_from_slice(&src[o..o + n]);
            }
            for notif in [None, Some(format!("{tag} write {case}").into_bytes())] {
                dst.iter_mut().for_each(|b| *b = 0);
                let before = poster.inline_bytes();
                let mut req = initiator
                    .create_xfer_req(XferOp::Write, &on(src_p), &on(dst_p), &name, notif.clone())
                    .unwrap();
                let status = req.post().unwrap();
                let copied = poster.inline_bytes() - before;
                if copies {
                    // Copied within the post: done there when nothing is left to send.
                    assert_eq!(copied as usize, total, "{tag} case {case}");
                    if notif.is_none() {
                        assert_eq!(status, crate::XferStatus::Done, "{tag} case {case}");
                        assert!(dst == want, "{tag} case {case}: WRITE done before its data");
                    }
                } else {
                    assert_eq!(copied, 0, "{tag} case {case}: copied, over cma_inline");
                }
                if let Some(msg) = &notif {
                    let tag = format!("{tag} {case}");
                    await_notif_after_data(&target, &mut req, msg, (&dst, &want), &tag);
                }
                req.wait(Duration::from_secs(10)).unwrap();
                assert!(dst == want, "{tag} case {case}: WRITE");
            }
            dst.copy_from_slice(&src);
            for notif in [None, Some(format!("{tag} read {case}").into_bytes())] {
                back.iter_mut().for_each(|b| *b = 0);
                let before = poster.inline_bytes();
                let mut req = initiator
                    .create_xfer_req(XferOp::Read, &on(back_p), &on(dst_p), &name, notif.clone())
                    .unwrap();
                req.post().unwrap();
                req.wait(Duration::from_secs(10)).unwrap();
                assert!(back == want, "{tag} case {case}: READ");
                let copied = poster.inline_bytes() - before;
                let expected = if copies { total } else { 0 };
                assert_eq!(copied as usize, expected, "{tag} case {case}: READ");
                if let Some(msg) = &notif {
                    let tag = format!("{tag} r{case}");
                    await_notif_after_data(&target, &mut req, msg, (&back, &want), &tag);
                }
            }
        }
    }
}

#[test]
fn a_target_that_refuses_read_assists_is_read_by_the_provider_and_asked_no_more() {
    let len = 4 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 29 + i / 4096) as u8).collect();
    let mut back = vec![0u8; len];
    let (initiator, reader) = agent("assist-refused-init", "2", "1");
    let (target, served) = agent("assist-refused-tgt", "2", "1");
    let server = served.common.assist.as_ref().unwrap();
    server.refuse.store(true, Ordering::Relaxed);
    let one = |p: u64| DescList::from_descs(MemKind::Dram, [Desc::new(p, len as u64, 0)]);
    let (src_p, back_p) = (src.as_ptr() as u64, back.as_mut_ptr() as u64);
    // SAFETY: the buffers outlive the registrations and requests.
    let _hi = unsafe { initiator.register_mem(&one(back_p), None) }.unwrap();
    // SAFETY: as above.
    let _ht = unsafe { target.register_mem(&one(src_p), None) }.unwrap();
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    target
        .load_remote_metadata(&initiator.local_metadata().unwrap())
        .unwrap();
    let mut req = initiator
        .create_xfer_req(XferOp::Read, &one(back_p), &one(src_p), &name, None)
        .unwrap();
    for round in 0..3 {
        back.iter_mut().for_each(|b| *b = 0);
        req.post().unwrap();
        req.wait(Duration::from_secs(10)).unwrap();
        assert!(back == src, "round {round}");
        assert_eq!(reader.assisted_bytes(), 0, "round {round}");
        // This side's own half still is its own.
        assert_eq!(
            reader.pulled_bytes(),
            (round + 1) * len as u64 / 2,
            "round {round}"
        );
        // Willing again, but this initiator no longer asks.
        server.refuse.store(false, Ordering::Relaxed);
    }
    // A new connection asks again.
    let (again, reader2) = agent("assist-refused-again", "2", "1");
    // SAFETY: as above.
    let _ha = unsafe { again.register_mem(&one(back_p), None) }.unwrap();
    let name = again
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    target
        .load_remote_metadata(&again.local_metadata().unwrap())
        .unwrap();
    back.iter_mut().for_each(|b| *b = 0);
    let mut req = again
        .create_xfer_req(XferOp::Read, &one(back_p), &one(src_p), &name, None)
        .unwrap();
    req.post().unwrap();
    req.wait(Duration::from_secs(10)).unwrap();
    assert!(back == src);
    assert!(reader2.assisted_bytes() > 0);
}

#[test]
fn read_assists_are_served_only_by_targets_with_progress_threads() {
    let len = 4 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 17 + i / 4096) as u8).collect();
    let mut back = vec![0u8; len];
    let one = |p: u64| DescList::from_descs(MemKind::Dram, [Desc::new(p, len as u64, 0)]);
    let (src_p, back_p) = (src.as_ptr() as u64, back.as_mut_ptr() as u64);
    // (initiator threads, target threads): a polled initiator still asks a threaded
    // target; a polled target does not offer (it would answer only when polled).
    for (init_threads, target_threads) in [(false, true), (true, false)] {
        let tag = format!("{init_threads}-{target_threads}");
        let (initiator, reader) =
            agent_with(&format!("assist-poll-init-{tag}"), "1", "1", init_threads);
        let (target, _t) = agent_with(&format!("assist-poll-tgt-{tag}"), "1", "1", target_threads);
        // SAFETY: the buffers outlive the registrations and requests.
        let _hi = unsafe { initiator.register_mem(&one(back_p), None) }.unwrap();
        // SAFETY: as above.
        let _ht = unsafe { target.register_mem(&one(src_p), None) }.unwrap();
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        target
            .load_remote_metadata(&initiator.local_metadata().unwrap())
            .unwrap();
        back.iter_mut().for_each(|b| *b = 0);
        let mut req = initiator
            .create_xfer_req(XferOp::Read, &one(back_p), &one(src_p), &name, None)
            .unwrap();
        req.post().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while req.status().unwrap() != crate::XferStatus::Done {
            // A polled target gets its turns too (one-sided traffic needs none over shm).
            let _ = target.get_notifs();
            assert!(Instant::now() < deadline, "{tag}: READ did not complete");
            std::thread::yield_now();
        }
        assert!(back == src, "{tag}");
        assert_eq!(reader.assisted_bytes() > 0, target_threads, "{tag}");
    }
}

#[test]
fn bulk_shares_cover_every_block_once_in_order() {
    let blocks: Vec<(u64, u64, usize)> = (0..100u64)
        .map(|i| (i, i, 1000 + (i as usize % 7) * 300))
        .collect();
    for parts in [1, 2, 3, 8, 100, 500] {
        let shares = xfer::split_by_bytes(&blocks, parts);
        assert!(!shares.is_empty() && shares.len() <= parts.min(blocks.len()));
        assert!(
            shares.iter().all(|s| !s.is_empty()),
            "{parts}: an empty share"
        );
        let joined: Vec<_> = shares.concat();
        assert_eq!(
            joined, blocks,
            "{parts}: blocks lost, repeated or reordered"
        );
        if parts <= 8 {
            // About equal bytes: no share more than twice the mean.
            let total: usize = blocks.iter().map(|b| b.2).sum();
            for s in &shares {
                let bytes: usize = s.iter().map(|b| b.2).sum();
                assert!(
                    bytes * shares.len() <= 2 * total,
                    "{parts}: {bytes} of {total}"
                );
            }
        }
    }
    assert!(xfer::split_by_bytes(&[], 4).is_empty());
}

/// A KV-cache-shaped transfer (many small blocks, random order) to a peer on this host
/// is copied within `post` by several threads: every block lands where its descriptor
/// says, in both directions, and the notification comes after all of them.
#[test]
fn bulk_transfers_are_copied_by_several_threads_before_their_notification() {
    // Every other block is moved: 160 blocks, 10 MiB, over the bulk thresholds.
    let (block, blocks) = (64 << 10, 320usize);
    let len = block * blocks;
    let open = |name: &str| {
        let agent = Agent::new(name, crate::AgentConfig::default()).unwrap();
        let backend = Arc::new(
            open_for(
                &agent,
                &params([
                    ("provider", "shm"),
                    ("num_rails", "2"),
                    ("cma_threads", "4"),
                ]),
            )
            .unwrap(),
        );
        agent.add_backend(backend.clone()).unwrap();
        (agent, backend)
    };
    let (initiator, poster) = open("bulk-init");
    let (target, _t) = open("bulk-tgt");
    let src: Vec<u8> = (0..len).map(|i| (i * 31 + i / block) as u8).collect();
    let mut dst = vec![0u8; len];
    let mut back = vec![0u8; len];
    let (src_p, dst_p, back_p) = (
        src.as_ptr() as u64,
        dst.as_mut_ptr() as u64,
        back.as_mut_ptr() as u64,
    );
    let whole = |p: u64| DescList::from_descs(MemKind::Dram, [Desc::new(p, len as u64, 0)]);
    // SAFETY: the buffers outlive the registrations and requests.
    let _hi = unsafe { initiator.register_mem(&whole(src_p), None) }.unwrap();
    // SAFETY: as above.
    let _hb = unsafe { initiator.register_mem(&whole(back_p), None) }.unwrap();
    // SAFETY: as above.
    let _ht = unsafe { target.register_mem(&whole(dst_p), None) }.unwrap();
    let name = initiator
        .load_remote_metadata(&target.local_metadata().unwrap())
        .unwrap();
    // Block i of the source goes to block perm(i) of the target, every other block.
    let picked: Vec<usize> = (0..blocks).step_by(2).collect();
    let perm = |i: usize| (i * 37 + 11) % blocks;
    let list = |base: u64, ids: &mut dyn Iterator<Item = usize>| {
        DescList::from_descs(
            MemKind::Dram,
            ids.map(|i| Desc::new(base + (i * block) as u64, block as u64, 0)),
        )
    };
    let mut want = vec![0u8; len];
    for &i in &picked {
        want[perm(i) * block..][..block].copy_from_slice(&src[i * block..][..block]);
    }
    let before = poster.inline_bytes();
    let mut req = initiator
        .create_xfer_req(
            XferOp::Write,
            &list(src_p, &mut picked.iter().copied()),
            &list(dst_p, &mut picked.iter().map(|&i| perm(i))),
            &name,
            Some(b"bulk write".to_vec()),
        )
        .unwrap();
    req.post().unwrap();
    assert_eq!(
        (poster.inline_bytes() - before) as usize,
        picked.len() * block,
        "the bulk WRITE was not copied within post"
    );
    await_notif_after_data(&target, &mut req, b"bulk write", (&dst, &want), "bulk");
    req.wait(Duration::from_secs(10)).unwrap();
    assert!(dst == want, "bulk WRITE: blocks landed in the wrong places");
    // READ them back into other places.
    let mut req = initiator
        .create_xfer_req(
            XferOp::Read,
            &list(back_p, &mut picked.iter().copied()),
            &list(dst_p, &mut picked.iter().map(|&i| perm(i))),
            &name,
            None,
        )
        .unwrap();
    assert_eq!(req.post().unwrap(), crate::XferStatus::Done);
    req.wait(Duration::from_secs(10)).unwrap();
    let mut want_back = vec![0u8; len];
    for &i in &picked {
        want_back[i * block..][..block].copy_from_slice(&src[i * block..][..block]);
    }
    assert!(
        back == want_back,
        "bulk READ: blocks landed in the wrong places"
    );
    assert_eq!(
        (poster.inline_bytes() - before) as usize,
        2 * picked.len() * block
    );
    dst.clear();
    back.clear();
}
