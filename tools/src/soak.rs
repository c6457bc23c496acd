//! `nixl-soak`'s parts that need no agent: the messages between the coordinator and its
//! worker processes, the data patterns every transfer is checked against, the random
//! numbers that pick peers, sizes and faults, the `/proc` samples of each worker and the
//! check that long-lived workers do not grow.
//!
//! # Protocol
//! The coordinator starts each worker with its [`WorkerConfig`] and talks to it over its
//! standard input and output, one JSON object per line: [`ToWorker`] down (the directory
//! of who is up, and the request to leave), [`FromWorker`] up (ready, counters, what went
//! wrong). A worker whose standard input ends leaves, so a coordinator that dies leaves no
//! workers behind.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// How peers find each other's metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum MetadataPath {
    /// Each agent's listener; peers fetch from it, a leaving agent invalidates itself
    /// at every peer.
    P2p,
    /// etcd: each agent publishes under its name; peers fetch and watch.
    Etcd,
    /// Both: each load picks one of the two at random.
    Both,
}

impl MetadataPath {
    /// Whether agents listen for peer-to-peer requests.
    pub fn uses_p2p(self) -> bool {
        matches!(self, Self::P2p | Self::Both)
    }

    /// Whether agents publish to etcd.
    pub fn uses_etcd(self) -> bool {
        matches!(self, Self::Etcd | Self::Both)
    }
}

/// Everything a worker process is told at its start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerConfig {
    /// Its slot: the agent name is [`agent_name`]`(index)`.
    pub index: usize,
    /// Starts at 1; each restart under the same name adds one.
    pub incarnation: u64,
    /// Number of agent slots in the run (every worker's memory has one slot per agent).
    pub agents: usize,
    /// Seed of its random choices.
    pub seed: u64,
    /// How it finds its peers' metadata.
    pub metadata: MetadataPath,
    /// etcd endpoints (when `metadata` uses etcd).
    pub etcd_endpoints: Vec<String>,
    /// etcd key namespace of this run.
    pub etcd_namespace: String,
    /// LIBFABRIC parameters.
    pub backend_params: BTreeMap<String, String>,
    /// `AgentConfig::progress_thread`.
    pub progress_thread: bool,
    /// Transfer sizes, bytes.
    pub min_size: usize,
    pub max_size: usize,
    /// Transfers started per second (at most; fewer when they take longer).
    pub rate: f64,
    /// A transfer (or a notification's verification) waiting this much beyond its
    /// expected completion is a stall past the bound.
    pub stall_bound_ms: u64,
    /// Bound on each metadata request: a listener fetch, and every etcd request.
    #[serde(default = "default_metadata_timeout_ms")]
    pub metadata_timeout_ms: u64,
    /// Whether the worker returns the allocator's free memory to the OS
    /// (`malloc_trim(0)`) before each [`HeapSample`], so that its RSS shows what is
    /// allocated rather than what the allocator keeps for later.
    pub malloc_trim: bool,
}

/// The bound on metadata requests where a configuration does not say (5 s).
pub fn default_metadata_timeout_ms() -> u64 {
    5_000
}

impl WorkerConfig {
    /// The memory a worker registers: `agents` acknowledgement words, one receive slot
    /// per agent, the area its peers READ, and its own source, destination and scratch.
    pub fn layout(&self) -> Layout {
        Layout::new(self.agents, self.max_size)
    }
}

/// Where each part lies in a worker's one registered region (offsets from its start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    agents: usize,
    max_size: usize,
}

/// Alignment of every part (a cache line; slots of several peers never share one).
const PART_ALIGN: usize = 64;

fn align_up(n: usize) -> usize {
    n.div_ceil(PART_ALIGN) * PART_ALIGN
}

impl Layout {
    /// The layout for `agents` slots of `max_size` bytes.
    pub fn new(agents: usize, max_size: usize) -> Self {
        Self {
            agents,
            max_size: align_up(max_size.max(1)),
        }
    }

    /// The acknowledgement word of agent `from` (8 bytes): the last WRITE of `from`
    /// that this agent verified, [`ack_word`].
    pub fn ack(&self, from: usize) -> usize {
        from * 8
    }

    /// The receive slot of agent `from` (`max_size` bytes): only `from` writes there.
    pub fn slot(&self, from: usize) -> usize {
        align_up(self.agents * 8) + from * self.max_size
    }

    /// The area peers READ from, filled with [`read_seed`] of this agent at start.
    pub fn read_area(&self) -> usize {
        self.slot(self.agents)
    }

    /// Its length: four times the largest transfer.
    pub fn read_area_len(&self) -> usize {
        4 * self.max_size
    }

    /// Where this agent's WRITEs come from.
    pub fn write_source(&self) -> usize {
        self.read_area() + self.read_area_len()
    }

    /// Where this agent's READs land.
    pub fn read_destination(&self) -> usize {
        self.write_source() + self.max_size
    }

    /// Where an acknowledgement word READ from a peer lands (8 bytes).
    pub fn ack_scratch(&self) -> usize {
        self.read_destination() + self.max_size
    }

    /// The whole region's length.
    pub fn len(&self) -> usize {
        self.ack_scratch() + PART_ALIGN
    }

    /// Never empty (kept for clippy's `len` without `is_empty` rule).
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// The agent name of slot `index`.
pub fn agent_name(index: usize) -> String {
    format!("soak-{index}")
}

/// The slot of an agent name made by [`agent_name`].
pub fn agent_index(name: &str) -> Option<usize> {
    name.strip_prefix("soak-")?.parse().ok()
}

/// The acknowledgement word for WRITE `seq` of incarnation `incarnation`.
pub fn ack_word(incarnation: u64, seq: u64) -> u64 {
    (incarnation << 32) | (seq & 0xffff_ffff)
}

/// The seed of the bytes agent `index` serves to READs (the same for every incarnation:
/// a READ checks data, the incarnation is checked through the acknowledgements).
pub fn read_seed(index: usize) -> u64 {
    splitmix(0x5eed_0000_0000_0000 ^ index as u64)
}

/// The byte at `offset` of pattern `seed`: differs at every offset and between seeds
/// (no short period, so a piece landing at a wrong offset is caught).
pub fn pattern_byte(seed: u64, offset: usize) -> u8 {
    let x = (offset as u64 / 8) ^ seed;
    let word = splitmix(x);
    (word >> ((offset % 8) * 8)) as u8
}

/// Fills `buf` with pattern `seed` from `offset` on.
pub fn fill_pattern(seed: u64, offset: usize, buf: &mut [u8]) {
    let mut cached = (usize::MAX, 0u64);
    for (i, b) in buf.iter_mut().enumerate() {
        let at = offset + i;
        if cached.0 != at / 8 {
            cached = (at / 8, splitmix((at as u64 / 8) ^ seed));
        }
        *b = (cached.1 >> ((at % 8) * 8)) as u8;
    }
}

/// The first position of `buf` that is not pattern `seed` from `offset` on, if any, and
/// how many positions differ in all.
pub fn mismatches(seed: u64, offset: usize, buf: &[u8]) -> Option<(usize, usize)> {
    let mut want = vec![0u8; buf.len()];
    fill_pattern(seed, offset, &mut want);
    let first = buf.iter().zip(&want).position(|(a, b)| a != b)?;
    let count = buf[first..]
        .iter()
        .zip(&want[first..])
        .filter(|(a, b)| a != b)
        .count();
    Some((first, count))
}

/// The first position of `buf` that is not pattern `seed` from `offset` on, if any.
pub fn first_mismatch(seed: u64, offset: usize, buf: &[u8]) -> Option<usize> {
    mismatches(seed, offset, buf).map(|(first, _)| first)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small, seeded random number generator (splitmix64): reproducible choices without a
/// dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        splitmix(self.0)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponentially distributed with mean `mean` (the gaps of a Poisson process).
    pub fn exponential(&mut self, mean: Duration) -> Duration {
        let u = self.unit().max(1e-12);
        mean.mul_f64(-u.ln()).min(mean * 8)
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
}

/// Down the worker's standard input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToWorker {
    /// Incarnation `incarnation` of agent `index` is up: its metadata is published (etcd)
    /// and its listener, if any, at `listen`.
    Up {
        index: usize,
        incarnation: u64,
        listen: Option<String>,
    },
    /// Incarnation `incarnation` of agent `index` is going away (at `at_ms`, Unix ms):
    /// `crash` (SIGKILL, sent right after this) or `leave` (asked to leave cleanly).
    Down {
        index: usize,
        incarnation: u64,
        at_ms: u64,
        how: String,
    },
    /// Leave cleanly: unpublish, invalidate, shut down, say [`FromWorker::Bye`], exit 0.
    Leave,
    /// Reach every peer that is up once more, in random order (before the final
    /// resource samples: every pair connected, as after the warm-up).
    Sweep,
}

/// Counters a worker reports (each report holds what happened since the last one; the
/// longest times are maxima over that period).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Verified WRITEs (the data checked by the target, its acknowledgement READ back).
    pub writes: u64,
    /// Verified READs.
    pub reads: u64,
    /// Acknowledgement READs (8 bytes each).
    pub ack_reads: u64,
    /// Notifications received and their data verified, as a target.
    pub notifs_verified: u64,
    /// Payload bytes of verified WRITEs and READs.
    pub bytes: u64,
    /// Metadata loads (fetches from listeners or etcd).
    pub loads: u64,
    /// Typed errors that a dead or leaving peer explains, by kind.
    pub typed_errors: BTreeMap<String, u64>,
    /// Errors no fault explains, by kind (each also reported as [`FromWorker::Problem`]).
    pub unexpected: BTreeMap<String, u64>,
    /// Corrupted bytes found (as initiator or target).
    pub corrupt_bytes: u64,
    /// Longest time a transfer or a notification's verification waited beyond its
    /// expected completion, ms.
    pub longest_stall_ms: u64,
    /// Longest time from a peer's kill to the typed error of a transfer in flight to it, ms.
    pub longest_detection_ms: u64,
    /// Longest first transfer to a peer after loading a new incarnation of it, ms.
    pub longest_reconnect_ms: u64,
}

impl Counters {
    /// Adds `other` (sums and maxima).
    pub fn merge(&mut self, other: &Counters) {
        self.writes += other.writes;
        self.reads += other.reads;
        self.ack_reads += other.ack_reads;
        self.notifs_verified += other.notifs_verified;
        self.bytes += other.bytes;
        self.loads += other.loads;
        for (k, v) in &other.typed_errors {
            *self.typed_errors.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.unexpected {
            *self.unexpected.entry(k.clone()).or_default() += v;
        }
        self.corrupt_bytes += other.corrupt_bytes;
        self.longest_stall_ms = self.longest_stall_ms.max(other.longest_stall_ms);
        self.longest_detection_ms = self.longest_detection_ms.max(other.longest_detection_ms);
        self.longest_reconnect_ms = self.longest_reconnect_ms.max(other.longest_reconnect_ms);
    }

    /// Whether nothing was counted.
    pub fn is_empty(&self) -> bool {
        *self == Counters::default()
    }

    /// Sum of the typed errors.
    pub fn typed_total(&self) -> u64 {
        self.typed_errors.values().sum()
    }

    /// Sum of the unexpected errors.
    pub fn unexpected_total(&self) -> u64 {
        self.unexpected.values().sum()
    }
}

/// Up the worker's standard output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromWorker {
    /// Published and listening (at `listen` when peer-to-peer).
    Ready { listen: Option<String> },
    /// Counters since the last report.
    Counters(Counters),
    /// Something no fault explains (corruption, a stall past the bound, an unexpected
    /// error): the coordinator prints it and fails the run.
    Problem { what: String },
    /// Left cleanly; the last counters.
    Bye(Counters),
    /// What the worker's allocator holds now (sent with the counters).
    Heap(HeapSample),
}

/// The C allocator's own account of a worker process (glibc's `mallinfo2`): every Rust
/// allocation and every library's `malloc` (libfabric's included) is in it. Bytes
/// allocated and not freed are what a leak grows; the resident set also holds what the
/// allocator keeps after a free (fragmented arenas, one arena per thread that ever
/// allocated), which is not a leak and which `malloc_trim` gives back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeapSample {
    /// Allocated and not freed, KiB (`uordblks + hblkhd`).
    pub in_use_kib: u64,
    /// Held from the OS by the allocator, KiB (`arena + hblkhd`): in use plus free
    /// chunks kept for later.
    pub held_kib: u64,
}

impl HeapSample {
    /// This process's allocator, now; `None` where the C library is not glibc.
    pub fn current() -> Option<Self> {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: mallinfo2 takes no arguments and returns a plain struct by value
            // (glibc 2.33 and later); it takes the arenas' locks itself.
            let info = unsafe { libc::mallinfo2() };
            Some(Self {
                in_use_kib: ((info.uordblks + info.hblkhd) / 1024) as u64,
                held_kib: ((info.arena + info.hblkhd) / 1024) as u64,
            })
        }
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        None
    }

    /// Returns the allocator's free memory at the top of each arena and its free
    /// whole pages to the OS (`malloc_trim(0)`); a no-op where the C library is not glibc.
    pub fn trim() {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim takes a padding size and touches only the allocator's own
        // state, under its locks.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// One `/proc` sample of a process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcSample {
    /// Open file descriptors.
    pub fds: u64,
    /// Threads.
    pub threads: u64,
    /// Resident set, KiB.
    pub rss_kib: u64,
    /// Of which anonymous memory (the heap, stacks, anonymous mappings), KiB.
    #[serde(default)]
    pub rss_anon_kib: u64,
    /// Of which pages of mapped files (the binary's and libraries' code and data, paged
    /// in as code paths first run), KiB.
    #[serde(default)]
    pub rss_file_kib: u64,
    /// Allocated and not freed, KiB, as the process's allocator last reported it
    /// ([`HeapSample::in_use_kib`]; 0 when it did not report).
    #[serde(default)]
    pub heap_kib: u64,
}

impl ProcSample {
    /// Samples process `pid` from `/proc`; `None` once it is gone.
    pub fn of(pid: u32) -> Option<Self> {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        Some(Self {
            fds,
            ..Self::from_status(&status)
        })
    }

    /// Threads and RSS from the text of `/proc/PID/status` (`fds` 0).
    pub fn from_status(status: &str) -> Self {
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        Self {
            fds: 0,
            threads: field("Threads:"),
            rss_kib: field("VmRSS:"),
            rss_anon_kib: field("RssAnon:"),
            rss_file_kib: field("RssFile:"),
            heap_kib: 0,
        }
    }

    /// The largest of each field.
    pub fn max(self, other: Self) -> Self {
        Self {
            fds: self.fds.max(other.fds),
            threads: self.threads.max(other.threads),
            rss_kib: self.rss_kib.max(other.rss_kib),
            rss_anon_kib: self.rss_anon_kib.max(other.rss_anon_kib),
            rss_file_kib: self.rss_file_kib.max(other.rss_file_kib),
            heap_kib: self.heap_kib.max(other.heap_kib),
        }
    }
}

/// How much a long-lived worker may grow between the end of the warm-up and the end of
/// the run. The live heap is the leak check (bytes allocated and never freed grow it and
/// nothing else does); the resident set's slack is looser, since an allocator keeps
/// freed memory and fragments (not a leak, and not flat over a long run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slack {
    pub fds: u64,
    pub threads: u64,
    pub rss_kib: u64,
    pub heap_kib: u64,
}

/// What a long-lived worker's samples say about growth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Growth {
    /// The largest of each count in the baseline window.
    pub baseline: ProcSample,
    /// The largest of each count in the final window.
    pub last: ProcSample,
    /// Each count that grew beyond its slack, described.
    pub beyond_slack: Vec<String>,
}

/// Compares the maxima of `samples` (seconds since the start, sample) in window
/// `baseline` with those in window `last` (both `(from, to)`, seconds). The windows are
/// meant to be alike (every agent up, every pair connected), so that what differs is what
/// the run in between left behind. `None` when a window holds no sample.
pub fn growth(
    samples: &[(f64, ProcSample)],
    baseline: (f64, f64),
    last: (f64, f64),
    slack: Slack,
) -> Option<Growth> {
    let max_in = |(from, to): (f64, f64)| {
        samples
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|(_, s)| *s)
            .reduce(ProcSample::max)
    };
    let baseline = max_in(baseline)?;
    let last = max_in(last)?;
    let mut beyond_slack = Vec::new();
    let mut check = |what: &str, before: u64, after: u64, slack: u64| {
        if after > before + slack {
            beyond_slack.push(format!(
                "{what} grew from {before} to {after} (slack {slack})"
            ));
        }
    };
    check("fds", baseline.fds, last.fds, slack.fds);
    check("threads", baseline.threads, last.threads, slack.threads);
    check("RSS KiB", baseline.rss_kib, last.rss_kib, slack.rss_kib);
    check(
        "live heap KiB",
        baseline.heap_kib,
        last.heap_kib,
        slack.heap_kib,
    );
    Some(Growth {
        baseline,
        last,
        beyond_slack,
    })
}

/// Parses a duration such as `90s`, `5m`, `1h`, `250ms` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (number, unit) = match t.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(at) => t.split_at(at),
        None => (t, "s"),
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (e.g. 90s, 5m, 250ms)"))?;
    let secs = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => return Err(format!("unknown unit `{other}` in `{text}` (ms, s, m, h)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{text}`: {e}"))
}

/// Milliseconds since the Unix epoch (the clock both sides of a kill share).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_by_offset_and_seed() {
        let mut a = vec![0u8; 4096];
        fill_pattern(7, 100, &mut a);
        assert_eq!(first_mismatch(7, 100, &a), None);
        assert_eq!(first_mismatch(7, 101, &a).map(|p| p < 8), Some(true));
        assert!(first_mismatch(8, 100, &a).is_some());
        a[4000] ^= 1;
        a[4001] ^= 1;
        assert_eq!(first_mismatch(7, 100, &a), Some(4000));
        assert_eq!(mismatches(7, 100, &a), Some((4000, 2)));
        let one: Vec<u8> = (0..16).map(|i| pattern_byte(7, 100 + i)).collect();
        assert_eq!(&one[..], &a[..16]);
        // A block of the same pattern shifted by its own length is caught too.
        let mut b = vec![0u8; 64];
        fill_pattern(7, 64, &mut b);
        assert!(first_mismatch(7, 0, &b).is_some());
    }

    #[test]
    fn layout_parts_do_not_overlap() {
        let l = Layout::new(32, 100_000);
        assert!(l.ack(31) + 8 <= l.slot(0));
        assert!(l.slot(31) + 100_000 <= l.read_area());
        assert!(l.read_area() + l.read_area_len() <= l.write_source());
        assert!(l.write_source() + 100_000 <= l.read_destination());
        assert!(l.read_destination() + 100_000 <= l.ack_scratch());
        assert!(l.ack_scratch() + 8 <= l.len());
        assert!(l.slot(5).is_multiple_of(8) && l.ack_scratch().is_multiple_of(8));
    }

    #[test]
    fn names_and_ack_words_round_trip() {
        assert_eq!(agent_index(&agent_name(17)), Some(17));
        assert_eq!(agent_index("other-1"), None);
        assert_ne!(ack_word(1, 5), ack_word(2, 5));
        assert_eq!(ack_word(3, 9) >> 32, 3);
    }

    #[test]
    fn messages_are_one_json_line() {
        let m = ToWorker::Down {
            index: 3,
            incarnation: 2,
            at_ms: 5,
            how: "crash".into(),
        };
        let line = serde_json::to_string(&m).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<ToWorker>(&line).unwrap(), m);
        let mut c = Counters::default();
        c.typed_errors.insert("remote_disconnect".into(), 2);
        let line = serde_json::to_string(&FromWorker::Counters(c.clone())).unwrap();
        assert_eq!(
            serde_json::from_str::<FromWorker>(&line).unwrap(),
            FromWorker::Counters(c)
        );
    }

    #[test]
    fn counters_merge_sums_and_maxima() {
        let mut a = Counters {
            writes: 2,
            longest_stall_ms: 5,
            ..Default::default()
        };
        a.typed_errors.insert("x".into(), 1);
        let mut b = Counters {
            writes: 3,
            longest_stall_ms: 2,
            ..Default::default()
        };
        b.typed_errors.insert("x".into(), 2);
        a.merge(&b);
        assert_eq!(a.writes, 5);
        assert_eq!(a.longest_stall_ms, 5);
        assert_eq!(a.typed_errors["x"], 3);
        assert!(!a.is_empty() && Counters::default().is_empty());
    }

    #[test]
    fn proc_status_fields() {
        let s = ProcSample::from_status(
            "Name:\tx\nVmRSS:\t  1234 kB\nRssAnon:\t  1000 kB\nRssFile:\t   234 kB\nThreads:\t7\n",
        );
        assert_eq!((s.threads, s.rss_kib), (7, 1234));
        assert_eq!((s.rss_anon_kib, s.rss_file_kib), (1000, 234));
        let me = ProcSample::of(std::process::id()).unwrap();
        assert!(me.fds > 0 && me.threads > 0 && me.rss_kib > 0);
        assert_eq!(ProcSample::of(u32::MAX), None);
    }

    #[test]
    fn growth_beyond_slack_is_named() {
        let slack = Slack {
            fds: 2,
            threads: 1,
            rss_kib: 1000,
            heap_kib: 500,
        };
        let s = |fds, threads, rss_kib, heap_kib| ProcSample {
            fds,
            threads,
            rss_kib,
            heap_kib,
            ..ProcSample::default()
        };
        let flat: Vec<_> = (0..100).map(|t| (t as f64, s(10, 4, 5000, 900))).collect();
        let g = growth(&flat, (10.0, 20.0), (89.0, 99.0), slack).unwrap();
        assert!(g.beyond_slack.is_empty(), "{g:?}");
        let leaking: Vec<_> = (0..100)
            .map(|t| (t as f64, s(10 + t / 10, 4, 5000 + 100 * t, 900 + 10 * t)))
            .collect();
        let g = growth(&leaking, (10.0, 20.0), (89.0, 99.0), slack).unwrap();
        assert_eq!(g.beyond_slack.len(), 3, "{g:?}");
        assert!(
            g.beyond_slack[0].starts_with("fds grew from 12 to 19"),
            "{g:?}"
        );
        assert!(g.beyond_slack[1].starts_with("RSS KiB"), "{g:?}");
        assert!(
            g.beyond_slack[2].starts_with("live heap KiB grew from 1100 to 1890"),
            "{g:?}"
        );
        // Allocator noise: the resident set grows within its slack while the live heap
        // stays flat: no growth reported.
        let fragmenting: Vec<_> = (0..100)
            .map(|t| (t as f64, s(10, 4, 5000 + 9 * t, 900 + t % 7)))
            .collect();
        let g = growth(&fragmenting, (10.0, 20.0), (89.0, 99.0), slack).unwrap();
        assert!(g.beyond_slack.is_empty(), "{g:?}");
        assert!(growth(&flat, (10.0, 20.0), (200.0, 210.0), slack).is_none());
    }

    #[test]
    fn heap_samples_see_a_live_allocation_and_its_free() {
        let Some(before) = HeapSample::current() else {
            println!("skipped: the C library is not glibc (no mallinfo2)");
            return;
        };
        let block = vec![1u8; 64 << 20];
        let during = HeapSample::current().unwrap();
        assert!(
            during.in_use_kib >= before.in_use_kib + (60 << 10),
            "{before:?} -> {during:?}"
        );
        assert!(during.held_kib >= during.in_use_kib, "{during:?}");
        drop(block);
        HeapSample::trim();
        let after = HeapSample::current().unwrap();
        assert!(
            after.in_use_kib + (60 << 10) <= during.in_use_kib,
            "{during:?} -> {after:?}"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("x").is_err());
    }

    #[test]
    fn rng_is_reproducible_and_in_range() {
        let (mut a, mut b) = (Rng::new(1), Rng::new(1));
        for _ in 0..1000 {
            let x = a.range(3, 9);
            assert_eq!(x, b.range(3, 9));
            assert!((3..=9).contains(&x));
            let u = a.unit();
            b.unit();
            assert!((0.0..1.0).contains(&u));
        }
        assert!(a.exponential(Duration::from_secs(1)) <= Duration::from_secs(8));
    }
}
