//! The sweep's progress on standard error: which point runs (block size, batch size),
//! how many are done and the time left. A bar when standard error is a terminal; with
//! `--progress` elsewhere, a line per point; the table on standard output is never
//! mixed with it (the bar steps aside while a row is printed).

use crate::options::ProgressMode;
use std::io::IsTerminal;
use std::time::Duration;
use tools::units::size_label;

/// One point of the sweep, as the estimate needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Point {
    pub(crate) block: usize,
    pub(crate) batch: usize,
    /// Iterations it runs: warm-up and timed.
    pub(crate) iterations: usize,
}

impl Point {
    /// Bytes one iteration of one thread moves.
    fn bytes(&self) -> f64 {
        (self.block * self.batch) as f64
    }
}

/// The time one iteration takes as a function of its bytes, fitted on the points done:
/// a latency and a bandwidth through the last two points of different sizes (one point:
/// its time per iteration, flat).
#[derive(Debug, Default, Clone)]
pub(crate) struct Estimate {
    /// `(bytes per iteration, seconds per iteration)` of the points done, latest last.
    done: Vec<(f64, f64)>,
}

impl Estimate {
    /// Records a finished point and how long it took.
    pub(crate) fn record(&mut self, point: &Point, took: Duration) {
        let per_iteration = took.as_secs_f64() / point.iterations.max(1) as f64;
        self.done.push((point.bytes(), per_iteration));
    }

    /// Seconds per iteration of `bytes`, or `None` before the first point.
    fn per_iteration(&self, bytes: f64) -> Option<f64> {
        let &(b2, t2) = self.done.last()?;
        let earlier = self.done.iter().rev().find(|(b, _)| *b != b2);
        let slope = match earlier {
            Some(&(b1, t1)) => ((t2 - t1) / (b2 - b1)).max(0.0),
            None => 0.0,
        };
        Some((t2 + slope * (bytes - b2)).max(t2.min(1e-9)))
    }

    /// The time the points `rest` will take, or `None` before the first point is done.
    pub(crate) fn remaining(&self, rest: &[Point]) -> Option<Duration> {
        let seconds = rest.iter().try_fold(0.0, |sum, p| {
            Some(sum + self.per_iteration(p.bytes())? * p.iterations as f64)
        })?;
        Some(Duration::from_secs_f64(seconds.max(0.0)))
    }
}

/// `1h02m`, `3m05s`, `42s`.
pub(crate) fn short_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// How progress is shown.
enum Display {
    Hidden,
    Bar(indicatif::ProgressBar),
    /// `--progress` without a terminal: a line per point.
    Lines,
}

pub(crate) struct Progress {
    display: Display,
    points: Vec<Point>,
    next: usize,
    estimate: Estimate,
}

impl Progress {
    /// Progress over `points` as `mode` says (a bar only where standard error is a
    /// terminal).
    pub(crate) fn new(mode: ProgressMode, points: Vec<Point>) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let display = match (mode, terminal) {
            (ProgressMode::Never, _) | (ProgressMode::Auto, false) => Display::Hidden,
            (_, true) => {
                let bar = indicatif::ProgressBar::new(points.len() as u64);
                if let Ok(style) =
                    indicatif::ProgressStyle::with_template("{bar:24} {pos}/{len} {msg}")
                {
                    bar.set_style(style);
                }
                Display::Bar(bar)
            }
            (ProgressMode::Always, false) => Display::Lines,
        };
        Self {
            display,
            points,
            next: 0,
            estimate: Estimate::default(),
        }
    }

    /// What the line says while point `next` runs.
    fn message(&self) -> String {
        let Some(p) = self.points.get(self.next) else {
            return String::new();
        };
        let eta = match self.estimate.remaining(&self.points[self.next..]) {
            Some(left) => format!("ETA {}", short_duration(left)),
            None => "ETA after the first point".into(),
        };
        format!(
            "block {} batch {} ({} iterations), {eta}",
            size_label(p.block as u64),
            p.batch,
            p.iterations
        )
    }

    /// Point `next` starts.
    pub(crate) fn start_point(&self) {
        let message = self.message();
        match &self.display {
            Display::Hidden => {}
            Display::Bar(bar) => bar.set_message(message),
            Display::Lines => eprintln!(
                "nixlbench: point {}/{}: {message}",
                self.next + 1,
                self.points.len()
            ),
        }
    }

    /// Point `next` is done after `took`; `print` writes its row to standard output
    /// (with the bar out of the way).
    pub(crate) fn finish_point(&mut self, took: Duration, print: impl FnOnce()) {
        if let Some(p) = self.points.get(self.next) {
            self.estimate.record(p, took);
        }
        self.next += 1;
        match &self.display {
            Display::Bar(bar) => {
                bar.suspend(print);
                bar.inc(1);
            }
            _ => print(),
        }
    }

    pub(crate) fn finish(&self) {
        if let Display::Bar(bar) = &self.display {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(block: usize, batch: usize, iterations: usize) -> Point {
        Point {
            block,
            batch,
            iterations,
        }
    }

    #[test]
    fn estimate_follows_latency_and_bandwidth() {
        // A link of 5 us latency and 1 GB/s: t = 5e-6 + bytes / 1e9.
        let law = |bytes: f64| 5e-6 + bytes / 1e9;
        let mut e = Estimate::default();
        let points = [
            point(4096, 1, 1000),
            point(8192, 1, 1000),
            point(1 << 20, 1, 100),
        ];
        assert_eq!(e.remaining(&points), None);
        e.record(&points[0], Duration::from_secs_f64(law(4096.0) * 1000.0));
        // One point: its time per iteration for the rest (an underestimate).
        let flat = e.remaining(&points[1..]).unwrap().as_secs_f64();
        assert!((flat - law(4096.0) * 1100.0).abs() < 1e-9, "{flat}");
        e.record(&points[1], Duration::from_secs_f64(law(8192.0) * 1000.0));
        // Two sizes: latency and bandwidth fitted, the rest predicted exactly.
        let left = e.remaining(&points[2..]).unwrap().as_secs_f64();
        let want = law((1 << 20) as f64) * 100.0;
        assert!((left - want).abs() / want < 1e-6, "{left} vs {want}");
        // Points of one size (a batch sweep of one block) keep the fit of the last two
        // different sizes.
        e.record(&points[1], Duration::from_secs_f64(law(8192.0) * 1000.0));
        let again = e.remaining(&points[2..]).unwrap().as_secs_f64();
        assert!((again - want).abs() / want < 1e-6, "{again} vs {want}");
        assert_eq!(e.remaining(&[]), Some(Duration::ZERO));
    }

    #[test]
    fn durations_read_short() {
        assert_eq!(short_duration(Duration::from_secs(42)), "42s");
        assert_eq!(short_duration(Duration::from_secs(185)), "3m05s");
        assert_eq!(short_duration(Duration::from_secs(3720)), "1h02m");
    }

    #[test]
    fn message_names_the_point_and_time_left() {
        let mut p = Progress::new(
            ProgressMode::Never,
            vec![point(4096, 2, 100), point(65536, 2, 100)],
        );
        assert_eq!(
            p.message(),
            "block 4K batch 2 (100 iterations), ETA after the first point"
        );
        p.finish_point(Duration::from_secs(2), || {});
        assert_eq!(p.message(), "block 64K batch 2 (100 iterations), ETA 2s");
    }
}
