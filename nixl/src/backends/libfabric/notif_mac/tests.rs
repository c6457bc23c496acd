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
