use super::*;

fn pairs() -> ((Sealer, Opener), (Sealer, Opener)) {
    let a = Identity::generate().unwrap();
    let b = Identity::generate().unwrap();
    (
        a.pair("a", "b", &b.public()).unwrap(),
        b.pair("b", "a", &a.public()).unwrap(),
    )
}

#[test]
fn a_seal_opens_once_and_only_in_its_direction() {
    let ((a_seal, a_open), (b_seal, b_open)) = pairs();
    let sealed = a_seal.seal(b"NXNT hello");
    let frame = Sealed::split(&sealed).unwrap();
    assert_eq!(frame.inner, b"NXNT hello");
    assert_eq!(frame.encode(), sealed);
    // B opens what A sealed, once.
    assert_eq!(b_open.open(&frame), Ok(()));
    assert_eq!(b_open.open(&frame), Err(Refusal::Replayed));
    // A's own opener (B → A) does not take it: no reflection.
    assert_eq!(a_open.open(&frame), Err(Refusal::BadTag));
    // And the other direction works.
    let back = b_seal.seal(b"NXNT back");
    assert_eq!(a_open.open(&Sealed::split(&back).unwrap()), Ok(()));
}

#[test]
fn any_change_or_a_stranger_key_fails_the_tag() {
    let ((a_seal, _), (_, b_open)) = pairs();
    let sealed = a_seal.seal(b"NXNT kv ready");
    for i in 0..sealed.len() {
        let mut bad = sealed.clone();
        bad[i] ^= 0x01;
        let Some(frame) = Sealed::split(&bad) else {
            assert!(i < 4, "only the magic makes it no seal");
            continue;
        };
        assert_eq!(b_open.open(&frame), Err(Refusal::BadTag), "byte {i}");
    }
    // A third party that knows both public keys but neither secret: its own pair with
    // B yields another key.
    let eve = Identity::generate().unwrap();
    let b = Identity::generate().unwrap();
    let (eve_seal, _) = eve.pair("a", "b", &b.public()).unwrap();
    let forged = eve_seal.seal(b"NXNT forged");
    assert_eq!(
        b_open.open(&Sealed::split(&forged).unwrap()),
        Err(Refusal::BadTag)
    );
    // The genuine frame still opens (failed tags do not move the window).
    assert_eq!(b_open.open(&Sealed::split(&sealed).unwrap()), Ok(()));
}

#[test]
fn low_order_public_keys_are_refused() {
    let me = Identity::generate().unwrap();
    for point in [[0u8; 32], {
        let mut one = [0u8; 32];
        one[0] = 1;
        one
    }] {
        assert!(matches!(
            me.pair("me", "evil", &point),
            Err(Error::MetadataRefused { .. })
        ));
    }
}

#[test]
fn the_window_takes_reordered_frames_once_and_refuses_old_ones() {
    let mut w = ReplayWindow::default();
    assert!(!w.accept(0));
    assert!(w.accept(10));
    assert!(w.accept(5), "overtaken");
    assert!(!w.accept(5));
    assert!(w.accept(10 + REPLAY_WINDOW - 1));
    assert!(!w.accept(10), "seen");
    assert!(w.accept(11), "still inside the window");
    assert!(!w.accept(5), "now behind the window");
    // Shifts of every size keep what is inside.
    let mut w = ReplayWindow::default();
    let mut seq = 1000;
    assert!(w.accept(seq));
    for step in [1, 63, 64, 65, 127, 200, 1000, REPLAY_WINDOW - 1] {
        let prev = seq;
        seq += step;
        assert!(w.accept(seq));
        assert!(!w.accept(prev), "step {step}");
        if step < REPLAY_WINDOW - 1 {
            assert!(w.accept(seq - 1) || step == 1, "step {step}");
        }
    }
    assert!(w.accept(seq + 10 * REPLAY_WINDOW));
    assert!(!w.accept(seq), "far behind");
}

#[test]
fn a_reloaded_sealer_starts_above_the_old_one() {
    let a = Identity::generate().unwrap();
    let b = Identity::generate().unwrap();
    let (first, _) = a.pair("a", "b", &b.public()).unwrap();
    let (_, b_open) = b.pair("b", "a", &a.public()).unwrap();
    for _ in 0..100 {
        let f = first.seal(b"x");
        assert_eq!(b_open.open(&Sealed::split(&f).unwrap()), Ok(()));
    }
    std::thread::sleep(std::time::Duration::from_millis(1));
    let (second, _) = a.pair("a", "b", &b.public()).unwrap();
    let f = second.seal(b"y");
    assert_eq!(b_open.open(&Sealed::split(&f).unwrap()), Ok(()));
}

#[test]
fn the_fuzz_entry_point_holds_on_samples() {
    let ((a_seal, _), _) = pairs();
    for input in [
        &b""[..],
        b"NXNS",
        b"NXNS\x01\x00\x00\x00\x00\x00\x00\x00",
        &a_seal.seal(b"NXNT"),
        &[0xff; 200],
        &[
            1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0,
        ],
    ] {
        assert!(fuzz_sealed_notif(input), "{input:?}");
    }
}

/// Sealing and opening a small notification costs a few microseconds at most (the
/// figure itself goes to docs/BENCHMARKS.md; this prints it and guards the order of
/// magnitude, loosely enough for a loaded debug build).
#[test]
fn sealing_and_opening_are_cheap() {
    let ((a_seal, _), (_, b_open)) = pairs();
    let inner = [0x5a_u8; 64];
    const N: u32 = 20_000;
    let start = Instant::now();
    for _ in 0..N {
        let sealed = a_seal.seal(&inner);
        let frame = Sealed::split(&sealed).unwrap();
        assert_eq!(b_open.open(&frame), Ok(()));
    }
    let each = start.elapsed() / N;
    println!("seal + open of a 64-byte notification: {each:?}");
    assert!(each < std::time::Duration::from_millis(2), "{each:?}");
}

#[test]
fn a_control_seal_names_its_sender_and_opens_once_in_its_direction() {
    let ((a_seal, a_open), (b_seal, b_open)) = pairs();
    let sealed = a_seal.seal_control(b"NXCM request");
    let frame = ControlFrame::split(&sealed).unwrap();
    assert_eq!(frame.sender, b"a");
    assert_eq!(frame.sealed.inner, b"NXCM request");
    assert_eq!(frame.encode(), sealed);
    assert_eq!(b_open.open(&frame.sealed), Ok(()));
    assert_eq!(b_open.open(&frame.sealed), Err(Refusal::Replayed));
    // Reflected back to its sender: another direction's key.
    assert_eq!(a_open.open(&frame.sealed), Err(Refusal::BadTag));
    // One sequence per direction for notifications and control messages: a control
    // frame's seal rewrapped as a notification is the same sequence number (a replay).
    let notif = a_seal.seal(b"NXNT n");
    let control = a_seal.seal_control(b"NXST s");
    let control = ControlFrame::split(&control).unwrap();
    let rewrapped = Sealed {
        seq: control.sealed.seq,
        tag: control.sealed.tag,
        inner: control.sealed.inner,
    };
    assert_eq!(b_open.open(&Sealed::split(&notif).unwrap()), Ok(()));
    assert_eq!(b_open.open(&control.sealed), Ok(()));
    assert_eq!(b_open.open(&rewrapped), Err(Refusal::Replayed));
    // Every changed byte of the sequence, the tag, the name or the message fails. (The
    // public key is for receivers that have not loaded the sender: it chooses their
    // key, and a changed one fails there; one that loaded the sender uses its key.)
    let sealed = b_seal.seal_control(b"NXPV answer");
    let public = SEAL_OVERHEAD..SEAL_OVERHEAD + 32;
    for i in (4..sealed.len()).filter(|i| !public.contains(i)) {
        let mut bad = sealed.clone();
        bad[i] ^= 0x01;
        if let Some(frame) = ControlFrame::split(&bad) {
            if frame.sender == b"b" {
                assert_eq!(a_open.open(&frame.sealed), Err(Refusal::BadTag), "byte {i}");
            }
        }
    }
    assert_eq!(
        a_open.open(&ControlFrame::split(&sealed).unwrap().sealed),
        Ok(())
    );
}

/// A receiver that never loaded the sender derives the same pair key from the public key
/// the frame carries: the frame opens (once), and the answer sealed under the channel
/// opens at the sender. A frame claiming another's public key without its secret does not
/// open, so its sender gets no answer sealed for that key's owner.
#[test]
fn a_channel_with_an_unloaded_sender_is_the_pair_key() {
    let a = Identity::generate().unwrap();
    let b = Arc::new(Identity::generate().unwrap());
    let (a_seal, a_open) = a.pair("a", "b", &b.public()).unwrap();
    let channels = Channels::new(b.clone(), "b");
    let sealed = a_seal.seal_control(b"NXST offer");
    let frame = ControlFrame::split(&sealed).unwrap();
    let channel = channels.open(&frame, |_| false).unwrap();
    assert_eq!(
        channels.open(&frame, |_| false).map(drop),
        Err(Refusal::Replayed)
    );
    let answer = channel.sealer.seal_control(b"NXST done");
    let answer = ControlFrame::split(&answer).unwrap();
    assert_eq!(answer.sender, b"b");
    assert_eq!(a_open.open(&answer.sealed), Ok(()));
    // Eve claims `a`'s public key: she cannot seal under it.
    let eve = Identity::generate().unwrap();
    let (eve_seal, _) = eve.pair("a", "b", &b.public()).unwrap();
    let forged = eve_seal.seal_control(b"NXST forged");
    let mut frame = ControlFrame::split(&forged).unwrap();
    frame.public = a.public();
    // (Refused for its tag, or before it where its sequence number is already behind
    // the channel's window.)
    assert!(matches!(
        channels.open(&frame, |_| false).map(drop),
        Err(Refusal::BadTag | Refusal::Replayed)
    ));
    frame.sealed.seq = ControlFrame::split(&sealed).unwrap().sealed.seq + 1;
    assert_eq!(
        channels.open(&frame, |_| false).map(drop),
        Err(Refusal::BadTag)
    );
    // Under a made-up key it opens nothing and takes no room.
    let mut junk = ControlFrame::split(&forged).unwrap();
    junk.public = Identity::generate().unwrap().public();
    assert_eq!(
        channels.open(&junk, |_| false).map(drop),
        Err(Refusal::BadTag)
    );
    assert_eq!(channels.table.lock().open.len(), 1);
}

#[test]
fn channels_are_bounded_and_never_evict_one_in_use() {
    let b = Arc::new(Identity::generate().unwrap());
    let channels = Channels::new(b.clone(), "b");
    let name = |i: usize| format!("sender-{i}");
    let mut senders = Vec::new();
    // Each new key a pace apart (the agreement budget's clock).
    let start = Instant::now();
    let pace = Duration::from_secs(1) / AGREEMENTS_PER_SEC;
    for i in 0..MAX_CHANNELS {
        let id = Identity::generate().unwrap();
        let (seal, _) = id.pair(&name(i), "b", &b.public()).unwrap();
        let frame = seal.seal_control(b"NXST x");
        assert!(channels
            .open_at(
                &ControlFrame::split(&frame).unwrap(),
                |_| false,
                start + pace * i as u32
            )
            .is_ok());
        senders.push(seal);
    }
    let late = Identity::generate().unwrap();
    let (late_seal, _) = late.pair("late", "b", &b.public()).unwrap();
    let frame = late_seal.seal_control(b"NXST y");
    let frame = ControlFrame::split(&frame).unwrap();
    assert_eq!(
        channels.open(&frame, |_| false).map(drop),
        Err(Refusal::NoRoom)
    );
    // Once a sender is loaded its channel may go, and there is room again; the others
    // keep theirs (and their windows).
    assert!(channels.open(&frame, |n| n == name(0)).is_ok());
    let again = senders[1].seal_control(b"NXST z");
    assert!(channels
        .open(&ControlFrame::split(&again).unwrap(), |_| false)
        .is_ok());
}

#[test]
fn the_control_fuzz_entry_point_holds_on_samples() {
    let ((a_seal, _), _) = pairs();
    for input in [
        &b""[..],
        b"NXRS",
        &a_seal.seal_control(b"NXCM"),
        &[0xff; 200],
        &ControlFrame {
            sealed: Sealed {
                seq: 1,
                tag: [0; 16],
                inner: b"NXST",
            },
            public: [0; 32],
            sender: b"a",
        }
        .encode(),
    ] {
        assert!(fuzz_sealed_control(input), "{input:?}");
    }
}

/// Sealing and opening rail control messages: a staged FETCH's answer (FETCHED, 26
/// bytes: one per FETCH), a READ assist request (about 150 bytes) and a staging OFFER of
/// 128 pieces (about 3.7 KiB); and a channel's one-time key agreement. Printed (figures
/// go to docs/BENCHMARKS.md), loosely bounded.
#[test]
fn sealing_and_opening_control_messages_is_cheap() {
    let ((a_seal, _), (_, b_open)) = pairs();
    // (Bounds per message, loose enough for a debug build on a loaded machine.)
    for (what, len, n, bound_ms) in [
        ("a FETCH's answer", 26, 20_000, 2),
        ("an assist request", 150, 20_000, 2),
        ("a 128-piece OFFER", 3700, 2_000, 50),
    ] {
        let inner = vec![0x5a_u8; len];
        let start = Instant::now();
        for _ in 0..n {
            let sealed = a_seal.seal_control(&inner);
            let frame = ControlFrame::split(&sealed).unwrap();
            assert_eq!(b_open.open(&frame.sealed), Ok(()));
        }
        let each = start.elapsed() / n;
        println!("seal + open of {what} ({len} bytes): {each:?}");
        assert!(
            each < std::time::Duration::from_millis(bound_ms),
            "{each:?}"
        );
    }
    let b = Arc::new(Identity::generate().unwrap());
    let channels = Channels::new(b.clone(), "b");
    let a = Identity::generate().unwrap();
    let (seal, _) = a.pair("a", "b", &b.public()).unwrap();
    let start = Instant::now();
    const M: u32 = 200;
    for i in 0..M {
        // A new name each time: a new channel, one key agreement.
        let frame = seal.seal_control(b"NXST x");
        let mut frame = ControlFrame::split(&frame).unwrap();
        let name = format!("a{i}");
        frame.sender = name.as_bytes();
        let _ = channels.open(&frame, |_| false);
    }
    println!(
        "a new channel (X25519 + key derivation): {:?}",
        start.elapsed() / M
    );
}

/// Junk under one made-up key costs one key agreement, however much of it comes; keys
/// not seen yet are agreed on at most [`AGREEMENT_BURST`] at once and then
/// [`AGREEMENTS_PER_SEC`] a second, beyond which their frames are refused unopened
/// ([`Refusal::Busy`]); a real sender's frame opens once the budget has earned again,
/// and the channel it opened is not paced any more.
#[test]
fn key_agreements_with_unknown_keys_are_paced() {
    let b = Arc::new(Identity::generate().unwrap());
    let channels = Channels::new(b.clone(), "b");
    let t0 = Instant::now();
    let junk = |public: [u8; 32], seq: u64| {
        ControlFrame {
            sealed: Sealed {
                seq,
                tag: [seq as u8; 16],
                inner: b"NXST forged",
            },
            public,
            sender: b"eve",
        }
        .encode()
    };
    // One key, many frames: one agreement.
    let one = Identity::generate().unwrap().public();
    for seq in 1..=100 {
        let frame = junk(one, seq);
        assert_eq!(
            channels
                .open_at(&ControlFrame::split(&frame).unwrap(), |_| false, t0)
                .map(drop),
            Err(Refusal::BadTag)
        );
    }
    assert_eq!(channels.agreements(), 1);
    // Fresh keys: the rest of the burst, then refused without an agreement.
    let mut refused = 0;
    for i in 0..200u64 {
        let mut public = [0u8; 32];
        public[..8].copy_from_slice(&(i + 1).to_le_bytes());
        public[31] = 0x40;
        let frame = junk(public, 1);
        match channels.open_at(&ControlFrame::split(&frame).unwrap(), |_| false, t0) {
            Err(Refusal::Busy) => refused += 1,
            Err(Refusal::BadTag) => {}
            other => panic!("{:?}", other.map(drop)),
        }
    }
    assert_eq!(channels.agreements(), u64::from(AGREEMENT_BURST));
    assert_eq!(refused, 200 - (u64::from(AGREEMENT_BURST) - 1));
    // A real sender while the budget is spent: refused, then served once it earned one.
    let a = Identity::generate().unwrap();
    let (a_seal, _) = a.pair("a", "b", &b.public()).unwrap();
    let first = a_seal.seal_control(b"NXST offer");
    let first = ControlFrame::split(&first).unwrap();
    assert_eq!(
        channels.open_at(&first, |_| false, t0).map(drop),
        Err(Refusal::Busy)
    );
    let later = t0 + Duration::from_secs(1) / AGREEMENTS_PER_SEC;
    assert!(channels.open_at(&first, |_| false, later).is_ok());
    // Its channel is open: its next frames cost no agreement, spent budget or not.
    let agreed = channels.agreements();
    for _ in 0..10 {
        let next = a_seal.seal_control(b"NXST more");
        assert!(channels
            .open_at(&ControlFrame::split(&next).unwrap(), |_| false, later)
            .is_ok());
    }
    assert_eq!(channels.agreements(), agreed);
    // The budget refills to its burst, no further.
    let much_later = later + Duration::from_secs(3600);
    let mut agreed_again = 0;
    for i in 0..(2 * AGREEMENT_BURST as u64) {
        let mut public = [1u8; 32];
        public[..8].copy_from_slice(&(i + 1000).to_le_bytes());
        public[31] = 0x40;
        let frame = junk(public, 1);
        if channels
            .open_at(&ControlFrame::split(&frame).unwrap(), |_| false, much_later)
            .map(drop)
            != Err(Refusal::Busy)
        {
            agreed_again += 1;
        }
    }
    assert_eq!(agreed_again, u64::from(AGREEMENT_BURST));
}

/// A replayed frame, and one whose sequence number lies beyond any its sender can have
/// reached, are refused before their tag is computed (a flood of them costs no HMAC).
#[test]
fn implausible_sequence_numbers_are_refused_before_the_tag() {
    let ((a_seal, _), (_, b_open)) = pairs();
    let sealed = a_seal.seal(b"NXNT one");
    let frame = Sealed::split(&sealed).unwrap();
    assert_eq!(b_open.open(&frame), Ok(()));
    // Far ahead, whatever the tag.
    let ahead = Sealed {
        seq: frame.seq + MAX_SEQ_JUMP + 1,
        ..frame
    };
    assert_eq!(b_open.open(&ahead), Err(Refusal::Ahead));
    // Within reach, a made-up tag is a bad tag.
    let near = Sealed {
        seq: frame.seq + MAX_SEQ_JUMP,
        tag: [0; 16],
        ..frame
    };
    assert_eq!(b_open.open(&near), Err(Refusal::BadTag));
    // A replay with a broken tag is a replay (the window answered, not the MAC).
    let replay = Sealed {
        tag: [0; 16],
        ..frame
    };
    assert_eq!(b_open.open(&replay), Err(Refusal::Replayed));
    // And the window did not move for the refused ones: the next genuine frame opens.
    let next = a_seal.seal(b"NXNT two");
    assert_eq!(b_open.open(&Sealed::split(&next).unwrap()), Ok(()));
}
