use super::*;

const MS: Duration = Duration::from_millis(1);

fn config(ms: u32, misses: u32) -> HeartbeatConfig {
    let params: BackendParams = [
        ("heartbeat_ms".to_string(), ms.to_string()),
        ("heartbeat_misses".to_string(), misses.to_string()),
    ]
    .into();
    HeartbeatConfig::parse("T", &params).unwrap()
}

#[test]
fn parameters_default_on_and_are_checked() {
    let default = HeartbeatConfig::parse("T", &BackendParams::new()).unwrap();
    assert_eq!(default, HeartbeatConfig::default());
    assert_eq!(default.wire_ms(), DEFAULT_INTERVAL_MS);
    assert_eq!(default.misses, DEFAULT_MISSES);
    let off = config(0, 3);
    assert_eq!((off.interval, off.wire_ms()), (None, 0));
    for (key, value) in [
        ("heartbeat_ms", "60001"),
        ("heartbeat_ms", "-1"),
        ("heartbeat_misses", "0"),
        ("heartbeat_misses", "x"),
    ] {
        let params: BackendParams = [(key.to_string(), value.to_string())].into();
        let err = HeartbeatConfig::parse("T", &params).unwrap_err();
        assert!(
            matches!(err, Error::InvalidParam(_)),
            "{key}={value}: {err}"
        );
    }
}

/// Misses are counted in the peer's intervals; the peer is dead only once the silence
/// outlasts `misses` of them, and any heartbeat starts the count again.
#[test]
fn misses_are_counted_and_a_beat_resets_them() {
    let t0 = Instant::now();
    let mut beat = Beat::new(t0, 100, &config(100, 5));
    assert!(beat.watched());
    assert_eq!(beat.deadline(), Some(t0 + 500 * MS));
    assert_eq!(beat.missed(t0 + 99 * MS), 0);
    assert_eq!(beat.missed(t0 + 100 * MS), 1);
    assert_eq!(beat.missed(t0 + 499 * MS), 4);
    assert!(
        beat.verdict(t0 + 500 * MS).is_none(),
        "5 missed: not yet more"
    );
    let why = beat.verdict(t0 + 501 * MS).expect("dead after 5 intervals");
    assert!(why.contains("no heartbeat") && why.contains("5"), "{why}");
    // A heartbeat (even a late one) brings it back to zero.
    beat.heard(t0 + 450 * MS);
    assert_eq!(beat.missed(t0 + 500 * MS), 0);
    assert!(beat.verdict(t0 + 900 * MS).is_none());
    assert!(beat.verdict(t0 + 951 * MS).is_some());
    // Time never goes backwards: an older "heard" changes nothing.
    beat.heard(t0);
    assert_eq!(beat.deadline(), Some(t0 + 950 * MS));
}

/// A peer slower than this side (a longer interval) is judged by its own interval; a
/// peer whose heartbeats come irregularly but within the bound is never declared dead.
#[test]
fn a_slow_but_alive_peer_is_not_declared_dead() {
    let t0 = Instant::now();
    // The peer beats every second; this side's own interval is 100 ms.
    let beat = Beat::new(t0, 1000, &config(100, 3));
    assert!(beat.verdict(t0 + 2900 * MS).is_none());
    assert!(beat.verdict(t0 + 3001 * MS).is_some());
    // Heartbeats every 100 ms, each up to 4 intervals late: never dead.
    let mut beat = Beat::new(t0, 100, &config(100, 5));
    let mut now = t0;
    for i in 0..1000u32 {
        now += (100 + (i % 5) * 100) * MS;
        assert!(beat.verdict(now).is_none(), "declared dead at beat {i}");
        beat.heard(now);
    }
}

#[test]
fn a_peer_without_heartbeats_or_heartbeats_off_here_is_not_watched() {
    let t0 = Instant::now();
    let hour = t0 + Duration::from_secs(3600);
    for beat in [
        Beat::new(t0, 0, &config(100, 5)),
        Beat::new(t0, 100, &config(0, 5)),
    ] {
        assert!(!beat.watched());
        assert_eq!((beat.deadline(), beat.missed(hour)), (None, 0));
        assert!(beat.verdict(hour).is_none());
    }
}

#[test]
fn the_pacer_sends_once_per_interval_and_never_when_off() {
    let t0 = Instant::now();
    let mut pacer = Pacer::new(t0, &config(100, 5));
    assert!(pacer.due(t0), "the first one at once");
    assert!(!pacer.due(t0 + 99 * MS));
    assert_eq!(pacer.next(), Some(t0 + 100 * MS));
    assert!(pacer.due(t0 + 130 * MS));
    assert_eq!(pacer.next(), Some(t0 + 230 * MS));
    let mut off = Pacer::new(t0, &config(0, 5));
    assert!(!off.due(t0 + Duration::from_secs(10)));
    assert_eq!(off.next(), None);
    assert_eq!(poll_timeout(t0, [t0 + 130 * MS].into_iter(), 50 * MS), 50);
    assert_eq!(
        poll_timeout(t0, [t0 + 3 * MS / 2, t0 + 9 * MS].into_iter(), 50 * MS),
        2
    );
    assert_eq!(poll_timeout(t0 + MS, [t0].into_iter(), 50 * MS), 0);
}

#[test]
fn hub_addresses_round_trip_and_decoding_is_bounded() {
    for addr in ["10.1.2.3:4567", "[fe80::1]:9"] {
        let hub = HubAddr {
            nonce: 0x0123_4567_89ab_cdef,
            addr: addr.parse().unwrap(),
        };
        let mut wire = Vec::new();
        hub.encode(&mut wire);
        wire.extend_from_slice(b"rest");
        assert!(HubAddr::starts(&wire));
        assert_eq!(HubAddr::decode(&wire).unwrap(), (hub, &b"rest"[..]));
        for cut in 0..wire.len() - 4 {
            assert!(
                HubAddr::decode(&wire[..cut]).is_err(),
                "{addr} cut at {cut}"
            );
        }
        let mut bad = wire.clone();
        bad[13] = 5;
        assert!(HubAddr::decode(&bad).is_err());
        bad = wire.clone();
        bad[4] = 9;
        assert!(HubAddr::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("version 9"));
    }
}

fn hub(name: &str, ms: u32, misses: u32) -> Hub {
    Hub::start(
        "TEST",
        name,
        "127.0.0.1".parse().unwrap(),
        config(ms, misses),
    )
    .unwrap()
}

/// Waits (bounded) until `watch` reports the peer dead; returns how long it took.
fn time_to_death(watch: &PeerWatch, bound: Duration) -> Duration {
    let since = Instant::now();
    while watch.check("peer").is_ok() {
        assert!(since.elapsed() < bound, "never declared dead");
        std::thread::sleep(MS);
    }
    since.elapsed()
}

/// Two hubs over loopback: a live peer stays alive; one that falls silent (a vanished
/// host) is declared dead within the bound, typed; watching it again once it speaks is
/// a fresh, live watch; a peer whose hub is dropped is seen at once.
#[test]
fn a_silent_peer_is_declared_dead_and_a_reloaded_one_is_watched_again() {
    let watcher = hub("watcher", 100, 5);
    let target = hub("target", 100, 5);
    let watch = watcher
        .watch("target", target.addr())
        .unwrap()
        .expect("both sides beat");
    std::thread::sleep(Duration::from_millis(1500));
    watch.check("target").expect("a live peer stays alive");

    target.set_silent(true);
    let took = time_to_death(&watch, Duration::from_secs(5));
    println!("silent peer declared dead after {took:?}");
    // The last heartbeat came less than an interval before the silence began, so at
    // least 4 of the 5 intervals pass after it (300 ms: slack for scheduling).
    assert!(
        took >= Duration::from_millis(300),
        "dead too early: {took:?}"
    );
    match watch.check("target").unwrap_err() {
        Error::RemoteDisconnect { agent, reason } => {
            assert_eq!(agent, "target");
            assert!(reason.contains("no heartbeat"), "{reason}");
        }
        other => panic!("{other:?}"),
    }

    // Re-added (the peer's metadata loaded again): a new watch, alive.
    target.set_silent(false);
    drop(watch);
    let watch = watcher.watch("target", target.addr()).unwrap().unwrap();
    std::thread::sleep(Duration::from_millis(800));
    watch.check("target").expect("the re-added peer is alive");

    // The peer's backend (its hub) gone: its socket closes, seen within a wake-up.
    drop(target);
    let took = time_to_death(&watch, Duration::from_secs(2));
    println!("closed peer declared dead after {took:?}");
}

/// A stale address (the peer restarted: another incarnation) is refused, typed; a
/// peer with heartbeats off is not watched; nobody listening is an I/O error.
#[test]
fn stale_off_and_absent_peers() {
    let watcher = hub("watcher", 100, 5);
    let target = hub("target", 100, 5);
    let mut stale = target.addr();
    stale.nonce ^= 1;
    assert!(matches!(
        watcher.watch("target", stale),
        Err(Error::RemoteDisconnect { .. })
    ));
    let quiet = hub("quiet", 0, 5);
    assert!(watcher.watch("quiet", quiet.addr()).unwrap().is_none());
    assert!(quiet.watch("target", target.addr()).unwrap().is_none());
    let absent = target.addr();
    drop(target);
    assert!(watcher.watch("target", absent).is_err());
}

/// A peer beating slowly (every 300 ms) is judged by its interval, not the watcher's.
#[test]
fn a_peer_with_a_longer_interval_stays_alive() {
    let watcher = hub("watcher", 50, 3);
    let slow = hub("slow", 300, 3);
    let watch = watcher.watch("slow", slow.addr()).unwrap().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    watch.check("slow").expect("alive");
}

/// CPU seconds used so far by this process's threads whose name starts with `prefix`
/// (names are cut to 15 bytes by the kernel).
fn threads_cpu(prefix: &str) -> f64 {
    let mut total = 0.0;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        let Some(end) = stat.rfind(')') else { continue };
        let fields: Vec<&str> = stat[end + 2..].split_whitespace().collect();
        // utime and stime, fields 14 and 15 (11 and 12 after the name), in USER_HZ.
        let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
        total += ticks / 100.0;
    }
    total
}

/// The idle cost: a watched peer costs a wake-up per interval on each side, not a core.
#[test]
fn a_watched_idle_peer_costs_almost_no_cpu() {
    let watcher = hub("watcher", 100, 5);
    let target = hub("target", 100, 5);
    let watch = watcher.watch("target", target.addr()).unwrap().unwrap();
    let before = threads_cpu("nixl-test-heart");
    let window = Duration::from_secs(2);
    std::thread::sleep(window);
    let used = threads_cpu("nixl-test-heart") - before;
    println!(
        "heartbeat threads used {:.2}% of a core over {window:?}",
        100.0 * used / window.as_secs_f64()
    );
    watch.check("target").unwrap();
    // A polling thread would use 50-100%; a sleeping one well under 1%.
    assert!(used / window.as_secs_f64() < 0.05, "{used} CPU seconds");
}

/// A silent peer whose process runs on this host (here: this very process) is not
/// declared dead at the usual bound — its death would be seen through the OS, and its
/// silence is the machine not scheduling it — but is past the wedged-hub bound; one
/// whose process is gone (a start time no process has) is declared dead as usual.
#[test]
fn a_silent_local_process_that_runs_is_judged_by_the_os() {
    let watcher = hub("watcher", 20, 5);
    let target = hub("target", 20, 5);
    let me = std::process::id();
    let start_time = crate::backends::shared::proc_state(me)
        .expect("/proc answers")
        .1;
    let running = LocalProcess {
        pid: me,
        start_time,
    };
    let gone = LocalProcess {
        pid: me,
        start_time: start_time + 1,
    };
    let alive = watcher
        .watch_process("target", target.addr(), Some(running))
        .unwrap()
        .unwrap();
    let dead = watcher
        .watch_process("target", target.addr(), Some(gone))
        .unwrap()
        .unwrap();
    target.set_silent(true);
    let took = time_to_death(&dead, Duration::from_secs(5));
    println!("a silent peer whose process is gone: dead after {took:?}");
    // 5 × 20 ms is the usual bound; the running one waits 20 times that (2 s).
    std::thread::sleep(Duration::from_millis(600));
    alive
        .check("target")
        .expect("a running local process is not declared dead at the usual bound");
    let took = time_to_death(&alive, Duration::from_secs(10));
    println!("a silent running local process: dead after {took:?} more (wedged hub)");
}
