use super::*;

/// A peer as a transport attributed it.
#[derive(Default)]
struct TestPeer {
    vram: AdvertisedVram,
    imports: Imports,
}

impl PeerVram for TestPeer {
    fn agent(&self) -> &str {
        "initiator"
    }
    fn advertised(&self) -> &AdvertisedVram {
        &self.vram
    }
    fn imports(&self) -> &Imports {
        &self.imports
    }
}

pub(crate) fn export() -> VramExport {
    VramExport {
        handle: std::array::from_fn(|i| i as u8),
        offset: 4096,
        alloc_len: 1 << 30,
        gpu_uuid: [7; 16],
    }
}

#[test]
fn the_export_section_round_trips_and_bad_ones_are_errors() {
    let e = export();
    let mut wire = vec![1, 2, 3];
    e.encode(&mut wire);
    assert_eq!(wire.len(), 3 + MD_WIRE_SIZE);
    assert_eq!(split_md(&wire), Ok((&[1u8, 2, 3][..], Some(e))));
    // Metadata without the section is left whole.
    assert_eq!(split_md(&[1, 2, 3]), Ok((&[1u8, 2, 3][..], None)));
    let section = &wire[3..];
    for cut in 0..section.len() {
        assert!(VramExport::decode(&section[..cut]).is_err());
    }
    for (at, value) in [(4, 9u8), (5, 2u8)] {
        let mut bad = section.to_vec();
        bad[at] = value;
        assert!(VramExport::decode(&bad).is_err());
    }
    // An offset outside its allocation.
    let mut outside = e;
    outside.offset = outside.alloc_len;
    let mut bad = Vec::new();
    outside.encode(&mut bad);
    assert!(VramExport::decode(&bad).is_err());
    assert!(e.holds(e.alloc_len - e.offset));
    assert!(!e.holds(e.alloc_len - e.offset + 1));
    assert!(!e.holds(u64::MAX));
}

#[test]
fn messages_round_trip_and_malformed_ones_are_refused() {
    let req = Request {
        id: 42,
        direction: Direction::ToVram,
        pieces: vec![
            Piece {
                vram: 0x7000_0000,
                dram: 0x1000,
                len: 4097,
            },
            Piece {
                vram: 0x7100_0000,
                dram: 0x9000,
                len: PIECE_BYTES,
            },
        ],
        reply_to: b"nixl-1-2-abcdef".to_vec(),
        notif: None,
    };
    let wire = req.encode();
    assert_eq!(wire.len(), request_len(2, req.reply_to.len()));
    assert_eq!(decode(&wire), Ok(Message::Request(req.clone())));
    let done = Done {
        id: u64::MAX,
        errno: libc::EACCES,
        trace: None,
    };
    assert_eq!(decode(&done.encode()), Ok(Message::Done(done)));
    for cut in 0..wire.len() {
        assert!(decode(&wire[..cut]).is_err(), "cut at {cut}");
    }
    let mut long = wire.clone();
    long.push(0);
    assert!(decode(&long).is_err());
    // Version, kind, direction.
    for (at, value) in [(4, 2u8), (5, 9u8), (14, 2u8)] {
        let mut bad = wire.clone();
        bad[at] = value;
        assert!(decode(&bad).is_err(), "byte {at}");
    }
    // A bit flipped anywhere decodes to something else or to an error.
    for i in 0..wire.len() * 8 {
        let mut bad = wire.clone();
        bad[i / 8] ^= 1 << (i % 8);
        assert_ne!(decode(&bad), Ok(Message::Request(req.clone())));
    }
    // Empty, oversized, wrapping pieces; no pieces; too many.
    let with = |pieces: Vec<Piece>| Request {
        pieces,
        ..req.clone()
    };
    for p in [
        Piece {
            vram: 1,
            dram: 1,
            len: 0,
        },
        Piece {
            vram: 1,
            dram: 1,
            len: PIECE_BYTES + 1,
        },
        Piece {
            vram: u64::MAX - 2,
            dram: 1,
            len: 4,
        },
        Piece {
            vram: 1,
            dram: u64::MAX,
            len: 1,
        },
    ] {
        assert!(decode(&with(vec![p]).encode()).is_err(), "{p:?}");
    }
    assert!(decode(&with(Vec::new()).encode()).is_err());
    let many = vec![req.pieces[0]; MAX_PIECES + 1];
    assert!(decode(&with(many).encode()).is_err());
    // A lane offer names a descriptor number (never a negative or oversized one); a
    // doorbell carries nothing.
    assert_eq!(decode(&encode_lane(7)), Ok(Message::Lane(7)));
    assert_eq!(decode(&encode_doorbell()), Ok(Message::Doorbell));
    for fd in [u64::from(u32::MAX), i32::MAX as u64 + 1, u64::MAX] {
        let mut bad = encode_lane(0);
        bad[6..14].copy_from_slice(&fd.to_le_bytes());
        assert!(decode(&bad).is_err(), "descriptor {fd}");
    }
    for wire in [encode_lane(3), encode_doorbell()] {
        for cut in 0..wire.len() {
            assert!(decode(&wire[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = wire.clone();
        long.push(0);
        assert!(decode(&long).is_err());
    }
}

/// A request carrying its notification and a traced answer round trip; a carried
/// notification is bounded, must be whole, and ends the message; every cut or flipped
/// bit is an error or another message.
#[test]
fn a_carried_notification_and_a_traced_answer_round_trip() {
    let req = Request {
        id: 7,
        direction: Direction::ToDram,
        pieces: vec![Piece {
            vram: 0x7000_0000,
            dram: 0x1000,
            len: 1 << 20,
        }],
        reply_to: b"initiator".to_vec(),
        notif: Some(b"check d 3 1048576 1048576 1 9 0".to_vec()),
    };
    let wire = req.encode();
    assert_eq!(decode(&wire), Ok(Message::Request(req.clone())));
    // An empty notification is one too (not the same as none).
    let empty = Request {
        notif: Some(Vec::new()),
        ..req.clone()
    };
    assert_eq!(decode(&empty.encode()), Ok(Message::Request(empty.clone())));
    assert_ne!(
        empty.encode(),
        Request {
            notif: None,
            ..req.clone()
        }
        .encode()
    );
    // The largest carried notification decodes, one byte more does not.
    let largest = Request {
        notif: Some(vec![0xa5; MAX_NOTIF_IN_REQUEST]),
        ..req.clone()
    };
    assert_eq!(
        decode(&largest.encode()),
        Ok(Message::Request(largest.clone()))
    );
    let over = Request {
        notif: Some(vec![0xa5; MAX_NOTIF_IN_REQUEST + 1]),
        ..req.clone()
    };
    assert!(decode(&over.encode()).is_err());
    for cut in 0..wire.len() {
        assert!(decode(&wire[..cut]).is_err(), "cut at {cut}");
    }
    let mut long = wire.clone();
    long.push(0);
    assert!(decode(&long).is_err());
    // A length claiming more than what follows, or a huge one.
    let len_at = wire.len() - req.notif.as_ref().unwrap().len() - 4;
    for claim in [u32::MAX, (MAX_NOTIF_IN_REQUEST + 1) as u32, 10_000] {
        let mut bad = wire.clone();
        bad[len_at..len_at + 4].copy_from_slice(&claim.to_le_bytes());
        assert!(decode(&bad).is_err(), "claims {claim}");
    }
    for i in 0..wire.len() * 8 {
        let mut bad = wire.clone();
        bad[i / 8] ^= 1 << (i % 8);
        assert_ne!(decode(&bad), Ok(Message::Request(req.clone())));
    }
    // Traced answers carry the target's four stamps; untraced ones stay as they were.
    let traced = Done {
        id: 7,
        errno: 0,
        trace: Some(trace::TargetStamps {
            read: 1,
            launched: 2,
            complete: u64::MAX,
            answered: 4,
        }),
    };
    let bytes = traced.encode();
    assert_eq!(bytes.len(), DONE_LEN + 32);
    assert_eq!(decode(&bytes), Ok(Message::Done(traced)));
    let plain = Done {
        trace: None,
        ..traced
    };
    assert_eq!(plain.encode().len(), DONE_LEN);
    for cut in 0..bytes.len() {
        assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(decode(&long).is_err());
}

#[test]
fn requests_fit_the_rails_inject_size() {
    let name = 40;
    let n = pieces_per_request(4096, name);
    assert!(n > 100 && n <= MAX_PIECES);
    assert!(request_len(n, name) <= 4096);
    assert!(request_len(n + 1, name) > 4096 || n == MAX_PIECES);
    assert_eq!(pieces_per_request(30, name), 0);
    assert_eq!(pieces_per_request(1 << 20, name), MAX_PIECES);
}

#[test]
fn answers_count_and_only_the_runs_peer_may_answer() {
    let waits = Waits::default();
    let run = Arc::new(RunState::new("target", 3));
    let ids: Vec<u64> = (0..3).map(|_| waits.add(&run)).collect();
    // Another agent's answer is not taken; the peer's is, once.
    assert!(waits.take(ids[0], Some("intruder")).is_none());
    waits.take(ids[0], Some("target")).unwrap().answer(0);
    assert!(waits.take(ids[0], Some("target")).is_none());
    // A provider that names no sender: the id alone.
    waits
        .take(ids[1], None)
        .unwrap()
        .answer(libc::EADDRNOTAVAIL);
    assert!(run.declined.load(Ordering::Acquire));
    assert!(run.failed.lock().is_none());
    waits.take(ids[2], None).unwrap().answer(libc::EACCES);
    assert_eq!(run.pending.load(Ordering::Acquire), 0);
    assert_eq!(run.answered.load(Ordering::Relaxed), 3);
    assert_eq!(run.failed.lock().as_ref().map(|f| f.0), Some(libc::EACCES));
    // Forgotten ids are not answered.
    let later = waits.add(&run);
    waits.forget(&[later]);
    assert!(waits.take(later, None).is_none());
    assert!(is_declined(libc::ENODEV) && !is_declined(libc::EIO));
}

/// A post's state reused by the next post starts afresh: nothing of the last post's
/// answers, failure or decline (or traced stamps) carries over.
#[test]
fn a_reused_run_starts_afresh() {
    let waits = Waits::default();
    let mut run = Arc::new(RunState::new("target", 2));
    let ids: Vec<u64> = (0..2).map(|_| waits.add(&run)).collect();
    waits
        .take(ids[0], None)
        .unwrap()
        .answer(libc::EADDRNOTAVAIL);
    waits.take(ids[1], None).unwrap().answer_done(&Done {
        id: ids[1],
        errno: libc::EIO,
        trace: Some(trace::TargetStamps {
            read: 1,
            launched: 2,
            complete: 3,
            answered: 4,
        }),
    });
    assert_eq!(run.pending.load(Ordering::Acquire), 0);
    let state = Arc::get_mut(&mut run).expect("no wait holds it once answered");
    state.reset(3);
    assert_eq!(run.pending.load(Ordering::Acquire), 3);
    assert_eq!(run.answered.load(Ordering::Relaxed), 0);
    assert!(!run.declined.load(Ordering::Acquire));
    assert!(run.failed.lock().is_none());
    assert_eq!(run.answer_read.load(Ordering::Relaxed), 0);
    assert_eq!(run.target_trace(), trace::TargetStamps::default());
    assert_eq!(run.agent, "target");
}

fn facts(
    local: MemKind,
    remote: MemKind,
    local_exported: bool,
    remote_exported: bool,
) -> PairFacts {
    PairFacts {
        local,
        remote,
        local_exported,
        remote_exported,
    }
}

#[test]
fn the_direct_path_is_chosen_only_where_every_pair_fits() {
    use MemKind::{Dram, Vram};
    let dram_to_vram = facts(Dram, Vram, false, true);
    let vram_to_dram = facts(Vram, Dram, true, false);
    // Each case, alone and in a batch.
    assert_eq!(
        choose(true, true, false, [dram_to_vram; 64]),
        Some(Case::InitiatorOwned)
    );
    assert_eq!(
        choose(true, true, true, [vram_to_dram; 64]),
        Some(Case::TargetOwned)
    );
    // Off, another host, nothing to move.
    assert_eq!(choose(false, true, true, [dram_to_vram]), None);
    assert_eq!(choose(true, false, true, [dram_to_vram]), None);
    assert_eq!(choose(true, true, true, []), None);
    // A peer that does not copy on request: only the initiator-owned case.
    assert_eq!(choose(true, true, false, [vram_to_dram]), None);
    // Unexported memory (VMM, or a peer without CUDA): the ordinary path.
    assert_eq!(
        choose(true, true, true, [facts(Dram, Vram, false, false)]),
        None
    );
    assert_eq!(
        choose(true, true, true, [facts(Vram, Dram, false, false)]),
        None
    );
    // Other kinds, and mixed transfers.
    for other in [
        facts(Dram, Dram, false, false),
        facts(Vram, Vram, true, true),
    ] {
        assert_eq!(choose(true, true, true, [other]), None, "{other:?}");
        assert_eq!(choose(true, true, true, [dram_to_vram, other]), None);
    }
    assert_eq!(choose(true, true, true, [dram_to_vram, vram_to_dram]), None);
    assert_eq!(
        choose(
            true,
            true,
            true,
            [dram_to_vram, facts(Dram, Vram, false, false)]
        ),
        None
    );
}

#[test]
fn requests_group_pieces_by_allocation_and_bound_their_size() {
    // Blocks with gaps between them (neighbours would merge: see the coalescing test).
    let piece = |i: u64| Piece {
        vram: 0x7000_0000 + i * 8192,
        dram: 0x1000 + i * 8192,
        len: 4096,
    };
    let (a, b) = (home([1u8; 64]), home([2u8; 64]));
    // 10 pieces of one allocation, 4 per request, 3 rails from rail 2.
    let reqs = plan_requests((0..10).map(|i| (a, piece(i))), 4, 3, 2);
    let shape: Vec<(usize, usize)> = reqs.iter().map(|(r, p)| (*r, p.len())).collect();
    assert_eq!(shape, [(2, 4), (0, 4), (1, 2)]);
    let flat: Vec<Piece> = reqs.into_iter().flat_map(|(_, p)| p).collect();
    assert_eq!(flat, (0..10).map(piece).collect::<Vec<_>>(), "order kept");
    // A new allocation starts a new request.
    let reqs = plan_requests(
        [(a, piece(0)), (a, piece(1)), (b, piece(2)), (a, piece(3))],
        100,
        1,
        0,
    );
    assert_eq!(
        reqs.iter().map(|(_, p)| p.len()).collect::<Vec<_>>(),
        [2, 1, 1]
    );
    // Bounds: at most MAX_PIECES, at least one; no rails is one rail.
    let reqs = plan_requests((0..300).map(|i| (a, piece(i))), 10_000, 0, 5);
    assert_eq!(
        reqs.iter().map(|(_, p)| p.len()).collect::<Vec<_>>(),
        [MAX_PIECES, 300 - MAX_PIECES]
    );
    assert!(reqs.iter().all(|(r, _)| *r == 0));
    assert_eq!(
        plan_requests((0..3).map(|i| (a, piece(i))), 0, 2, 0).len(),
        3
    );
    assert!(plan_requests(std::iter::empty(), 4, 2, 0).is_empty());
    // Cutting: pieces of at most PIECE_BYTES covering the block exactly.
    for len in [
        1,
        PIECE_BYTES - 1,
        PIECE_BYTES,
        PIECE_BYTES + 1,
        64 << 20,
        (64 << 20) + 3,
    ] {
        let pieces: Vec<_> = cut(len).collect();
        assert!(
            pieces.iter().all(|&(_, n)| n > 0 && n <= PIECE_BYTES),
            "{len}"
        );
        assert_eq!(pieces.iter().map(|p| p.1).sum::<u64>(), len);
        assert!(pieces.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
    }
    assert_eq!(cut(0).count(), 0);
}

/// Where a test's pieces lie: allocation `handle`, one registration on each side.
fn home(handle: [u8; 64]) -> PieceHome {
    PieceHome {
        handle,
        vram_region: 0x7000_0000,
        dram_region: 0x1000,
    }
}

/// A request's pieces, flattened, as (VRAM, DRAM, length).
fn flat(requests: &[(usize, Vec<Piece>)]) -> Vec<(u64, u64, u64)> {
    requests
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| (p.vram, p.dram, p.len)))
        .collect()
}

#[test]
fn neighbouring_pieces_merge_up_to_the_piece_size() {
    let a = home([1u8; 64]);
    let at = |i: u64, len: u64| Piece {
        vram: 0x7000_0000 + i,
        dram: 0x1000 + i,
        len,
    };
    // 512 neighbouring blocks of 64 KiB (upstream nixlbench's batch): 32 MiB in four
    // pieces of PIECE_BYTES, in one request.
    let k64 = 64 << 10;
    let reqs = plan_requests((0..512).map(|i| (a, at(i * k64, k64))), MAX_PIECES, 1, 0);
    assert_eq!(reqs.len(), 1);
    assert_eq!(
        flat(&reqs),
        (0..4)
            .map(|i| (
                0x7000_0000 + i * PIECE_BYTES,
                0x1000 + i * PIECE_BYTES,
                PIECE_BYTES
            ))
            .collect::<Vec<_>>()
    );
    // Crossing the piece size: 3 blocks of 3 MiB are 8 MiB and 1 MiB, every byte once.
    let m3 = 3 << 20;
    let reqs = plan_requests((0..3).map(|i| (a, at(i * m3, m3))), MAX_PIECES, 1, 0);
    assert_eq!(
        flat(&reqs),
        [
            (0x7000_0000, 0x1000, PIECE_BYTES),
            (
                0x7000_0000 + PIECE_BYTES,
                0x1000 + PIECE_BYTES,
                (9 << 20) - PIECE_BYTES
            )
        ]
    );
    // A large block already cut, then its neighbour: the full pieces stay, the neighbour
    // joins the last one.
    let big = (12 << 20) as u64;
    let pieces = cut(big)
        .map(|(off, len)| (a, at(off, len)))
        .chain([(a, at(big, k64))]);
    assert_eq!(
        flat(&plan_requests(pieces, MAX_PIECES, 1, 0)),
        [
            (0x7000_0000, 0x1000, PIECE_BYTES),
            (
                0x7000_0000 + PIECE_BYTES,
                0x1000 + PIECE_BYTES,
                big + k64 - PIECE_BYTES
            )
        ]
    );
    // What does not merge: a gap on either side, an overlap, reversed order, another
    // registration on either side, another allocation.
    let keep_apart = |second: (PieceHome, Piece)| {
        let reqs = plan_requests([(a, at(0, 4096)), second], MAX_PIECES, 1, 0);
        assert_eq!(flat(&reqs).len(), 2, "{second:?}");
    };
    keep_apart((a, at(4097, 4096)));
    keep_apart((
        a,
        Piece {
            vram: 0x7000_0000 + 4096,
            dram: 0x1000 + 8192,
            len: 4096,
        },
    ));
    keep_apart((
        a,
        Piece {
            vram: 0x7000_0000 + 8192,
            dram: 0x1000 + 4096,
            len: 4096,
        },
    ));
    keep_apart((a, at(2048, 4096)));
    keep_apart((a, at(0, 4096)));
    keep_apart((
        PieceHome {
            dram_region: 0x1000 + 4096,
            ..a
        },
        at(4096, 4096),
    ));
    keep_apart((
        PieceHome {
            vram_region: 0x7000_0000 + 4096,
            ..a
        },
        at(4096, 4096),
    ));
    keep_apart((home([2u8; 64]), at(4096, 4096)));
    let reqs = plan_requests([(a, at(4096, 4096)), (a, at(0, 4096))], MAX_PIECES, 1, 0);
    assert_eq!(
        flat(&reqs),
        [(0x7000_1000, 0x2000, 4096), (0x7000_0000, 0x1000, 4096)]
    );
    // Merging never crosses a request of another allocation, and a merged piece may fill
    // a request up: the piece after it starts the next one.
    let reqs = plan_requests(
        [
            (a, at(0, 4096)),
            (a, at(4096, 4096)),
            (a, at(3 * 4096, 4096)),
            (a, at(4 * 4096, 4096)),
            (a, at(6 * 4096, 4096)),
        ],
        2,
        1,
        0,
    );
    assert_eq!(
        reqs.iter().map(|(_, p)| p.len()).collect::<Vec<_>>(),
        [2, 1]
    );
    assert_eq!(
        flat(&reqs),
        [
            (0x7000_0000, 0x1000, 8192),
            (0x7000_0000 + 3 * 4096, 0x1000 + 3 * 4096, 8192),
            (0x7000_0000 + 6 * 4096, 0x1000 + 6 * 4096, 4096)
        ]
    );
    // absorb alone: a full piece takes nothing, no wrapping at the top of memory.
    let mut full = at(0, PIECE_BYTES);
    assert_eq!(absorb(&mut full, &at(PIECE_BYTES, 1)), 0);
    let mut top = Piece {
        vram: u64::MAX - 1,
        dram: 0,
        len: 1,
    };
    assert_eq!(
        absorb(
            &mut top,
            &Piece {
                vram: 0,
                dram: 1,
                len: 1
            }
        ),
        0
    );
}

/// The target's checks, all made before anything touches a GPU (so they run here):
/// VRAM the peer did not advertise is declined, DRAM outside this backend's
/// registrations fails, a request spanning two allocations is malformed, and a GPU
/// this process does not see declines.
#[cfg(feature = "cuda")]
#[test]
fn a_target_checks_where_a_request_points_before_any_copy() {
    let server = Arc::new(Server::new(crate::backends::cuda_copy::CopyEngine::Auto));
    let stats = Stats::default();
    let dram = vec![0u8; 1 << 20];
    let base = dram.as_ptr() as u64;
    let served = server.add(base, dram.len() as u64);
    let peer = TestPeer::default();
    let vram = 0x7000_0000u64;
    let e = export();
    peer.vram.add(vram, 1 << 20, e);
    let mut other = e;
    other.handle[0] ^= 1;
    peer.vram.add(vram + (2 << 20), 1 << 20, other);
    let serve = |pieces: &[(u64, u64, u64)], direction| {
        let req = Request {
            id: 1,
            direction,
            pieces: pieces
                .iter()
                .map(|&(vram, dram, len)| Piece { vram, dram, len })
                .collect(),
            reply_to: b"rail".to_vec(),
            notif: None,
        };
        server.serve(&req, &peer, &stats).err()
    };
    for d in [Direction::ToDram, Direction::ToVram] {
        // VRAM the peer never advertised, or past the end of what it did: declined.
        assert_eq!(
            serve(&[(vram - 4096, base, 4096)], d),
            Some(libc::EADDRNOTAVAIL)
        );
        assert_eq!(
            serve(&[(vram + (1 << 20) - 8, base, 16)], d),
            Some(libc::EADDRNOTAVAIL)
        );
        assert!(is_declined(libc::EADDRNOTAVAIL));
        // DRAM outside the registrations: the transfer's error.
        for dram_at in [base - 8, base + (1 << 20) - 8, 0x10] {
            assert_eq!(serve(&[(vram, dram_at, 16)], d), Some(libc::EACCES));
        }
        assert!(!is_declined(libc::EACCES));
        // Two allocations in one request.
        assert_eq!(
            serve(&[(vram, base, 16), (vram + (2 << 20), base + 16, 16)], d),
            Some(libc::EINVAL)
        );
        // All in place, but the GPU holding the peer's VRAM is not seen here.
        assert_eq!(
            serve(
                &[(vram + 8, base + 8, 4096), (vram + 8192, base + 8192, 8)],
                d
            ),
            Some(libc::ENODEV)
        );
        assert!(is_declined(libc::ENODEV));
    }
    assert!(dram.iter().all(|&b| b == 0), "nothing was written");
    let refused = stats.refused.load(Ordering::Relaxed);
    assert_eq!(refused, 6, "declines are counted");
    // Deregistered: nothing of it is served any more.
    drop(served);
    assert_eq!(
        serve(&[(vram, base, 16)], Direction::ToDram),
        Some(libc::EACCES)
    );
}

/// The target merges neighbouring pieces of a request within one of its registrations
/// (whatever the initiator sent), never across two neighbouring registrations, and keeps
/// the rest apart; every byte is served once.
#[cfg(feature = "cuda")]
#[test]
fn a_target_merges_neighbouring_pieces_within_one_registration() {
    let server = Arc::new(Server::new(crate::backends::cuda_copy::CopyEngine::Auto));
    let stats = Stats::default();
    let dram = vec![0u8; 4 << 20];
    let base = dram.as_ptr() as u64;
    // Two neighbouring registrations: the first 2 MiB and the rest.
    let _low = server.add(base, 2 << 20);
    let _high = server.add(base + (2 << 20), 2 << 20);
    let peer = TestPeer::default();
    let vram = 0x7000_0000u64;
    let e = export();
    peer.vram.add(vram, 4 << 20, e);
    let locate = |pieces: &[(u64, u64, u64)]| {
        let req = Request {
            id: 1,
            direction: Direction::ToDram,
            pieces: pieces
                .iter()
                .map(|&(v, d, len)| Piece {
                    vram: vram + v,
                    dram: base + d,
                    len,
                })
                .collect(),
            reply_to: b"rail".to_vec(),
            notif: None,
        };
        let (export, located) = server.locate(&req, &peer, &stats).unwrap();
        assert_eq!(export, e);
        located
    };
    let shape = |located: &[Located]| -> Vec<(u64, u64, u64)> {
        located
            .iter()
            // Back to the test's offsets: VRAM from the allocation's offset, DRAM from base.
            .map(|(p, _)| (p.vram - e.offset, p.dram - base, p.len))
            .collect()
    };
    let k64 = 64 << 10;
    // 48 neighbouring blocks of 64 KiB, across the two registrations: one piece each side.
    let blocks: Vec<_> = (0..48).map(|i| (i * k64, i * k64, k64)).collect();
    let located = locate(&blocks);
    assert_eq!(
        shape(&located),
        [(0, 0, 2 << 20), (2 << 20, 2 << 20, 1 << 20)]
    );
    assert!(!Arc::ptr_eq(&located[0].1, &located[1].1));
    // Gaps on either side, an overlap, reversed order: apart.
    for pair in [
        [(0, 0, 4096), (4097, 4096, 4096)],
        [(0, 0, 4096), (4096, 4097, 4096)],
        [(0, 0, 4096), (2048, 2048, 4096)],
        [(4096, 4096, 4096), (0, 0, 4096)],
    ] {
        assert_eq!(shape(&locate(&pair)), pair, "{pair:?}");
    }
    // Pieces at most PIECE_BYTES: a full one takes nothing more.
    let big = vec![0u8; (2 * PIECE_BYTES) as usize];
    let big_base = big.as_ptr() as u64;
    let _big = server.add(big_base, big.len() as u64);
    peer.vram.add(vram + (8 << 20), 2 * PIECE_BYTES, e);
    let req = Request {
        id: 2,
        direction: Direction::ToVram,
        pieces: (0..2 * PIECE_BYTES / (1 << 20))
            .map(|i| Piece {
                vram: vram + (8 << 20) + (i << 20),
                dram: big_base + (i << 20),
                len: 1 << 20,
            })
            .collect(),
        reply_to: b"rail".to_vec(),
        notif: None,
    };
    let (_, located) = server.locate(&req, &peer, &stats).unwrap();
    assert_eq!(
        located.iter().map(|(p, _)| p.len).collect::<Vec<_>>(),
        [PIECE_BYTES, PIECE_BYTES]
    );
    assert_eq!(located[1].0.dram, big_base + PIECE_BYTES);
    assert_eq!(stats.refused.load(Ordering::Relaxed), 0);
}

/// Pieces are cut where pinned chunks end: every run inside one chunk, covering the
/// piece exactly; outside the region nothing is pinned.
#[cfg(feature = "cuda")]
#[test]
fn served_dram_is_cut_at_pinned_chunk_ends() {
    let base = 3 * PIN_CHUNK - 4096;
    let pin = ChunkedPin::new(base, 2 * PIN_CHUNK);
    for (at, len) in [
        (base, 4096),
        (base, 4097),
        (base + 100, PIECE_BYTES),
        (base + 4096, 1),
        (base + PIN_CHUNK, PIN_CHUNK - 4096),
        (base + 2 * PIN_CHUNK - 3, 3),
    ] {
        let runs: Vec<(u64, u64)> = pin.runs(at, len).collect();
        assert_eq!(runs.iter().map(|r| r.1).sum::<u64>(), len, "{at:#x}+{len}");
        assert!(runs.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
        for (off, n) in runs {
            let (first, last) = (at + off, at + off + n - 1);
            assert_eq!(first / PIN_CHUNK, last / PIN_CHUNK, "{at:#x}+{len}");
        }
    }
    assert_eq!(pin.runs(base, 4097).count(), 2);
    assert_eq!(pin.runs(base, 0).count(), 0);
    // Outside the region's chunks (no GPU here: inside, pinning is refused too).
    assert!(!pin.ensure_at(base - PIN_CHUNK));
    assert!(!pin.ensure_at(base + 4 * PIN_CHUNK));
    assert!(ChunkedPin::new(0x1000, 0).runs(0x1000, 0).next().is_none());
}

#[test]
fn advertised_vram_is_found_by_range() {
    let adv = AdvertisedVram::default();
    let e = export();
    adv.add(0x7000_0000, 1 << 20, e);
    // Larger than its allocation holds, empty, wrapping: ignored.
    adv.add(0x9000_0000, e.alloc_len, e);
    adv.add(0xa000_0000, 0, e);
    adv.add(u64::MAX - 4, 16, e);
    assert_eq!(adv.find(0x7000_0000, 1 << 20), Some((0x7000_0000, e)));
    assert_eq!(adv.find(0x7000_1000, 4096), Some((0x7000_0000, e)));
    assert_eq!(adv.find(0x7000_0000, (1 << 20) + 1), None);
    assert_eq!(adv.find(0x6fff_ffff, 2), None);
    assert_eq!(adv.find(0x9000_0000, 1), None);
    assert_eq!(adv.find(u64::MAX, 2), None);
}

/// The host side of one 1 MiB request, end to end without a GPU or a transport:
/// planning (cut, group), encoding into a reused buffer, the target's decoding, and
/// the initiator's wait for its answer. Prints the figures (docs/BENCHMARKS.md keeps
/// them); the bound is loose so a loaded CI machine passes.
#[test]
fn a_one_mib_request_costs_microseconds_on_the_host() {
    let waits = Waits::default();
    let handle = home([3u8; 64]);
    let mut buf = Vec::new();
    let rounds = 20_000u32;
    let mut plan_ns = 0u128;
    let mut wire_ns = 0u128;
    let mut wait_ns = 0u128;
    for i in 0..rounds {
        let t = std::time::Instant::now();
        let pieces = cut(1 << 20).map(|(off, len)| {
            (
                handle,
                Piece {
                    vram: 0x7000_0000 + off,
                    dram: 0x1000 + off,
                    len,
                },
            )
        });
        let requests = plan_requests(pieces, MAX_PIECES, 1, 0);
        plan_ns += t.elapsed().as_nanos();
        let t = std::time::Instant::now();
        let run = Arc::new(RunState::new("target", requests.len()));
        let id = waits.add(&run);
        buf.clear();
        encode_request(
            &mut buf,
            id,
            Direction::ToDram,
            &requests[0].1,
            b"initiator",
            None,
        );
        let Ok(Message::Request(req)) = decode(&buf) else {
            panic!("round {i}: the request does not decode");
        };
        let done = Done {
            id: req.id,
            errno: 0,
            trace: None,
        }
        .encode();
        let Ok(Message::Done(done)) = decode(&done) else {
            panic!("round {i}: the answer does not decode");
        };
        wire_ns += t.elapsed().as_nanos();
        let t = std::time::Instant::now();
        waits
            .take(done.id, Some("target"))
            .unwrap()
            .answer(done.errno);
        assert_eq!(run.pending.load(Ordering::Acquire), 0);
        wait_ns += t.elapsed().as_nanos();
    }
    let per = |ns: u128| ns as f64 / f64::from(rounds) / 1000.0;
    eprintln!(
        "1 MiB request, host side: plan {:.2} us, encode+decode both messages {:.2} us, \
         wait bookkeeping {:.2} us",
        per(plan_ns),
        per(wire_ns),
        per(wait_ns)
    );
    assert!(per(plan_ns + wire_ns + wait_ns) < 200.0);
}
