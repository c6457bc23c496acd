//! A side's setup before its sweep (creating the backend, allocating and filling its
//! buffer, registering it): what it is doing and how far it got ([`Setup`]), printed
//! per stage and, under the ETCD runtime, published to the peer; and how long a side
//! waits for a peer that is still setting up (`PeerWait`): the bound follows the
//! peer's progress, so tens of GiB may take their time, and a wait is never silent.

use parking_lot::Mutex;
#[cfg(feature = "etcd")]
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tools::units::human_bytes;

/// The slowest rate at which a peer's stage over a byte count is still expected to
/// advance (registering pins every page in one call that reports nothing until it
/// returns): a stage of `bytes` extends the peer's wait by `bytes / SLOWEST_SETUP_RATE`.
#[cfg(feature = "etcd")]
const SLOWEST_SETUP_RATE: u64 = 256 << 20;
/// How often a waiting side prints what its peer is doing.
#[cfg(feature = "etcd")]
const PRINT_EVERY: Duration = Duration::from_secs(5);
/// Stages shorter than this are not printed (small runs stay as they were)...
const PRINT_STAGES_FROM: Duration = Duration::from_millis(500);
/// ...unless they set up at least this many bytes.
const PRINT_STAGES_OF: u64 = 256 << 20;

#[cfg(feature = "etcd")]
/// What a side is doing: a stage (`what`), over `bytes` of which `done` are done
/// (`bytes` 0: no byte count), for `secs` so far.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SetupReport {
    pub(crate) what: String,
    pub(crate) bytes: u64,
    pub(crate) done: u64,
    pub(crate) secs: f64,
}

#[cfg(feature = "etcd")]
impl SetupReport {
    /// Whether `self` shows progress over `before`: another stage, or more bytes done.
    fn advanced_from(&self, before: &SetupReport) -> bool {
        self.what != before.what || self.done > before.done
    }

    /// Extra time a stage over many bytes may take beyond the plain wait.
    fn allowance(&self) -> Duration {
        let left = self.bytes.saturating_sub(self.done);
        Duration::from_secs(left / SLOWEST_SETUP_RATE)
    }
}

#[cfg(feature = "etcd")]
impl std::fmt::Display for SetupReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.what)?;
        if self.bytes > 0 {
            write!(
                f,
                ", {} of {}",
                human_bytes(self.done),
                human_bytes(self.bytes)
            )?;
        }
        write!(f, " ({:.0} s)", self.secs)
    }
}

struct Stage {
    what: String,
    bytes: u64,
    started: Instant,
}

/// This side's setup: the stage it is in and the bytes done of it (the fill threads add
/// to them), printed per stage when `print` (each stage that took long enough to matter).
pub(crate) struct Setup {
    stage: Mutex<Option<Stage>>,
    done: AtomicU64,
    print: bool,
    /// Prefix of the printed lines (`nixlbench`, `nixlbench target`).
    who: &'static str,
}

impl Setup {
    pub(crate) fn new(who: &'static str, print: bool) -> Self {
        Self {
            stage: Mutex::new(None),
            done: AtomicU64::new(0),
            print,
            who,
        }
    }

    /// A setup that prints nothing (tests, in-process runs).
    pub(crate) fn silent() -> Self {
        Self::new("nixlbench", false)
    }

    /// Ends the current stage (printing it) and starts `what`, over `bytes` (0: none).
    pub(crate) fn stage(&self, what: impl Into<String>, bytes: u64) {
        let mut stage = self.stage.lock();
        self.print_end(stage.as_ref());
        self.done.store(0, Ordering::Relaxed);
        *stage = Some(Stage {
            what: what.into(),
            bytes,
            started: Instant::now(),
        });
    }

    /// Ends the current stage (printing it); `what` says what this side does next.
    pub(crate) fn finish(&self, what: impl Into<String>) {
        self.stage(what, 0);
    }

    /// `n` more bytes of the current stage are done.
    pub(crate) fn add(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }

    #[cfg(feature = "etcd")]
    pub(crate) fn report(&self) -> SetupReport {
        let stage = self.stage.lock();
        match stage.as_ref() {
            Some(s) => SetupReport {
                what: s.what.clone(),
                bytes: s.bytes,
                done: self.done.load(Ordering::Relaxed).min(s.bytes),
                secs: s.started.elapsed().as_secs_f64(),
            },
            None => SetupReport {
                what: "starting".into(),
                bytes: 0,
                done: 0,
                secs: 0.0,
            },
        }
    }

    fn print_end(&self, stage: Option<&Stage>) {
        let Some(s) = stage else { return };
        let took = s.started.elapsed();
        let long = took >= PRINT_STAGES_FROM;
        if self.print
            && s.bytes > 0
            && took < Duration::from_millis(100)
            && s.bytes >= PRINT_STAGES_OF
        {
            // Too short for a meaningful rate.
            eprintln!(
                "{}: setup: {}, {}: {:.2} s",
                self.who,
                s.what,
                human_bytes(s.bytes),
                took.as_secs_f64()
            );
        } else if self.print && s.bytes > 0 && (long || s.bytes >= PRINT_STAGES_OF) {
            eprintln!(
                "{}: setup: {}, {}: {:.1} s ({:.1} GB/s)",
                self.who,
                s.what,
                human_bytes(s.bytes),
                took.as_secs_f64(),
                s.bytes as f64 / took.as_secs_f64() / 1e9
            );
        } else if self.print && long {
            eprintln!(
                "{}: setup: {}: {:.1} s",
                self.who,
                s.what,
                took.as_secs_f64()
            );
        }
    }
}

#[cfg(feature = "etcd")]
/// What a waiting side does next.
#[derive(Debug, PartialEq)]
pub(crate) enum Verdict {
    /// Keep waiting.
    Wait,
    /// Keep waiting, and print this line (what the peer is doing).
    Print(String),
    /// Stop: the peer shows no progress within the bound.
    GiveUp(String),
}

#[cfg(feature = "etcd")]
/// The bound on one wait for a peer: `wait` after the peer's last progress (its stage
/// changed or its bytes grew), plus the time its current stage may need for the bytes
/// it has left ([`SLOWEST_SETUP_RATE`]). A peer that says nothing (an older nixlbench,
/// or one not started yet) gets the plain `wait`.
pub(crate) struct PeerWait {
    wait: Duration,
    started: Instant,
    last_progress: Instant,
    last: Option<SetupReport>,
    last_print: Instant,
}

#[cfg(feature = "etcd")]
impl PeerWait {
    pub(crate) fn new(wait: Duration, now: Instant) -> Self {
        Self {
            wait,
            started: now,
            last_progress: now,
            last: None,
            last_print: now,
        }
    }

    /// The verdict at `now`, with the peer's latest report (`None`: it published none);
    /// `waiting_for` names the wait and `peer` the peer in the lines printed.
    pub(crate) fn observe(
        &mut self,
        now: Instant,
        report: Option<SetupReport>,
        waiting_for: &str,
        peer: &str,
    ) -> Verdict {
        if let Some(r) = &report {
            if self.last.as_ref().is_none_or(|l| r.advanced_from(l)) {
                self.last_progress = now;
                self.last = Some(r.clone());
            } else if let Some(last) = &mut self.last {
                // Same stage and bytes: only the time moved.
                last.secs = r.secs;
            }
        }
        let allowance = self
            .last
            .as_ref()
            .map_or(Duration::ZERO, SetupReport::allowance);
        let bound = self.wait + allowance;
        let stalled = now.saturating_duration_since(self.last_progress);
        let waited = now.saturating_duration_since(self.started).as_secs_f64();
        if stalled > bound {
            return Verdict::GiveUp(match &self.last {
                Some(r) => format!(
                    "{peer} made no progress for {:.0} s (last: {r}), after {waited:.0} s \
                     of waiting for {waiting_for}",
                    stalled.as_secs_f64()
                ),
                None => format!(
                    "{peer} said nothing within {:.0} s of waiting for {waiting_for}",
                    stalled.as_secs_f64()
                ),
            });
        }
        if now.saturating_duration_since(self.last_print) >= PRINT_EVERY {
            self.last_print = now;
            return Verdict::Print(match &self.last {
                Some(r) => format!("waiting for {waiting_for} ({waited:.0} s): {peer}: {r}"),
                None => format!(
                    "waiting for {waiting_for} ({waited:.0} s): {peer} has said nothing yet \
                     (gives up after {:.0} s)",
                    bound.as_secs_f64()
                ),
            });
        }
        Verdict::Wait
    }
}

#[cfg(all(test, feature = "etcd"))]
mod tests {
    use super::*;

    fn report(what: &str, bytes: u64, done: u64) -> Option<SetupReport> {
        Some(SetupReport {
            what: what.into(),
            bytes,
            done,
            secs: 1.0,
        })
    }

    /// A peer that keeps filling 32 GiB is waited for past the plain bound; one that
    /// stops advancing is given up on `wait` plus its stage's allowance later.
    #[test]
    fn the_bound_follows_the_peers_progress() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = PeerWait::new(s(60), t0);
        let gib = 1u64 << 30;
        // Progress every 10 s for 200 s: never given up.
        for i in 0..20u64 {
            let v = w.observe(
                t0 + s(10 * i),
                report("filling", 32 * gib, i * gib),
                "x",
                "p",
            );
            assert!(!matches!(v, Verdict::GiveUp(_)), "{v:?} at {i}");
        }
        // Then no progress: 13 GiB left at 256 MiB/s is 52 s beyond the 60 s.
        let last = t0 + s(190);
        let stuck = report("filling", 32 * gib, 19 * gib);
        let mut at = |d: u64| w.observe(last + s(d), stuck.clone(), "x", "the target");
        assert!(!matches!(at(111), Verdict::GiveUp(_)));
        let Verdict::GiveUp(why) = at(113) else {
            panic!("not given up 113 s after the last progress")
        };
        assert!(
            why.contains("the target made no progress for 113 s") && why.contains("filling"),
            "{why}"
        );
    }

    #[test]
    fn a_silent_peer_gets_the_plain_wait_and_waits_are_printed() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = PeerWait::new(s(60), t0);
        assert_eq!(w.observe(t0 + s(1), None, "x", "p"), Verdict::Wait);
        let Verdict::Print(line) = w.observe(t0 + s(5), None, "the target's agent", "the target")
        else {
            panic!("nothing printed after 5 s")
        };
        assert!(line.contains("has said nothing yet"), "{line}");
        assert_eq!(w.observe(t0 + s(6), None, "x", "p"), Verdict::Wait);
        assert!(matches!(
            w.observe(t0 + s(61), None, "x", "p"),
            Verdict::GiveUp(_)
        ));
        // A stage without bytes advances only by changing.
        let mut w = PeerWait::new(s(60), t0);
        w.observe(t0, report("registering", 0, 0), "x", "p");
        let Verdict::Print(line) =
            w.observe(t0 + s(30), report("creating", 0, 0), "a", "the target")
        else {
            panic!("nothing printed after 30 s")
        };
        assert!(
            line.starts_with("waiting for a (30 s): the target: creating"),
            "{line}"
        );
        assert!(!matches!(
            w.observe(t0 + s(89), report("creating", 0, 0), "x", "p"),
            Verdict::GiveUp(_)
        ));
        assert!(matches!(
            w.observe(t0 + s(91), report("creating", 0, 0), "x", "p"),
            Verdict::GiveUp(_)
        ));
    }

    #[test]
    fn setup_reports_the_stage_and_its_bytes() {
        let setup = Setup::silent();
        assert_eq!(setup.report().what, "starting");
        setup.stage("filling DRAM", 100);
        setup.add(40);
        setup.add(80);
        let r = setup.report();
        assert_eq!(
            (r.what.as_str(), r.bytes, r.done),
            ("filling DRAM", 100, 100)
        );
        setup.finish("waiting");
        let r = setup.report();
        assert_eq!((r.what.as_str(), r.bytes, r.done), ("waiting", 0, 0));
        assert_eq!(
            SetupReport {
                what: "x".into(),
                bytes: 2 << 30,
                done: 1 << 30,
                secs: 2.4
            }
            .to_string(),
            format!(
                "x, {} of {} (2 s)",
                human_bytes(1 << 30),
                human_bytes(2 << 30)
            )
        );
    }
}
