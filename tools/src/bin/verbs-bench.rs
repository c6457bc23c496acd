//! `verbs-bench`: RDMA verbs micro-benchmarks over the `ibverbs` crate, with perftest's
//! options and output columns so that lines compare one to one with `ib_write_bw`,
//! `ib_read_bw`, `ib_send_bw`, `ib_write_lat`, `ib_read_lat`, `ib_send_lat`.
//!
//! ```text
//! verbs-bench write-bw|read-bw|send-bw|write-lat|read-lat|send-lat
//!     [-d DEV] [-i PORT] [-x GID_INDEX] [-s SIZE] [-n ITERS] [-p TCP_PORT]
//!     [-t TX_DEPTH] [-Q CQ_MOD] [-l POST_LIST] [--report_gbits] [SERVER_ADDR]
//! verbs-bench compare [-d DEV] [-x GID_INDEX] [-s SIZE]... [--pairs N] [--tests T,...]
//!     [--ours-args 'ARGS'] [--raw]
//! ```
//!
//! Without `SERVER_ADDR` it is the server (waits on `-p`, default 18515 as perftest);
//! with it, the client, which measures and prints. `compare` runs perftest's tool and
//! ours, server and client on this machine (over 127.0.0.1), for each test (default all
//! six) and size (default 4 KiB, 64 KiB, 1 MiB): `--pairs` (default 6, even so that
//! each tool goes first equally often) pairs of runs, perftest and ours alternating (and
//! which of the two goes first alternating too), all in the same boot; `--raw` prints
//! every pair. It prints the median result of each tool and the median of the
//! per-pair ratios ours/perftest, with their range (bandwidth: higher is better;
//! latency: lower is better), so one noisy run on an emulated guest does not decide.
//! `--ours-args` passes extra options to our side only (e.g. `-l 1` to post one request
//! per call as perftest does).
//!
//! The hot paths follow perftest's defaults (outstanding READs up to the device
//! maximum, completion moderation as [`default_cq_mod`]) with two differences chosen by
//! measuring on the soft-RoCE guest: the bandwidth tests chain requests into one
//! `ibv_post_send` per [`CHAIN_BYTES`] (one system call per chain on rxe), and the
//! busy-polls yield the CPU every 16 rounds ([`Spin`]); latencies are taken, as
//! perftest's, from one clock read per iteration.
//!
//! `--spread BYTES` (ours, WRITE/READ bandwidth) spaces the requests over that much of
//! each side's buffer, two sizes apart, request `k` in slot `k % slots`: with
//! `-t BATCH --spread $((2 * SIZE * BATCH))` the memory touched is what
//! `nixlbench --start_batch_size BATCH` touches (its blocks are two sizes apart), so the
//! two compare on equal footing. In the soft-RoCE guest every byte is copied (and
//! checksummed) by an emulated CPU, and perftest's single hot `SIZE` buffer runs faster
//! than the same requests spread over megabytes (`docs/BENCHMARKS.md`).

use clap::{Args, Parser, Subcommand};
use ibverbs::{
    AccessFlags, CompletionQueue, ConnectOptions, Context, Endpoint, InlineSge, MemoryRegion,
    QpType, QueuePair, RecvWr, RemoteMemory, SendFlags, SendWr, WorkCompletion,
};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Test {
    WriteBw,
    ReadBw,
    SendBw,
    WriteLat,
    ReadLat,
    SendLat,
}

impl Test {
    fn parse(s: &str) -> Option<Test> {
        Some(match s {
            "write-bw" => Test::WriteBw,
            "read-bw" => Test::ReadBw,
            "send-bw" => Test::SendBw,
            "write-lat" => Test::WriteLat,
            "read-lat" => Test::ReadLat,
            "send-lat" => Test::SendLat,
            _ => return None,
        })
    }
    fn is_bw(self) -> bool {
        matches!(self, Test::WriteBw | Test::ReadBw | Test::SendBw)
    }
    fn perftest(self) -> &'static str {
        match self {
            Test::WriteBw => "ib_write_bw",
            Test::ReadBw => "ib_read_bw",
            Test::SendBw => "ib_send_bw",
            Test::WriteLat => "ib_write_lat",
            Test::ReadLat => "ib_read_lat",
            Test::SendLat => "ib_send_lat",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write-bw",
            Test::ReadBw => "read-bw",
            Test::SendBw => "send-bw",
            Test::WriteLat => "write-lat",
            Test::ReadLat => "read-lat",
            Test::SendLat => "send-lat",
        }
    }
}

#[derive(Clone, Debug)]
struct Opts {
    test: Test,
    dev: String,
    ib_port: u8,
    gid_index: Option<u8>,
    size: usize,
    iters: usize,
    tcp_port: u16,
    tx_depth: usize,
    /// `-Q`: signal every `cq_mod`-th send (None: [`default_cq_mod`]).
    cq_mod: Option<usize>,
    /// `-l`: work requests per `ibv_post_send` call in the bandwidth tests; 0 (ours by
    /// default) chains as many free slots as fit in [`CHAIN_BYTES`].
    post_list: usize,
    gbits: bool,
    /// `--spread BYTES` (ours): the bandwidth tests' requests go to slots two sizes
    /// apart over this many bytes of each side's buffer, request `k` to slot
    /// `k % slots`, as nixlbench spaces a batch's blocks (0: every request on the
    /// buffer's first `size` bytes, as perftest).
    spread: usize,
    server: Option<String>,
}

/// RDMA verbs micro-benchmarks with perftest's options and output columns
#[derive(Parser, Debug)]
#[command(
    name = "verbs-bench",
    version,
    subcommand_required = true,
    max_term_width = 100,
    after_help = "Without SERVER_ADDR a test is the server (it waits on -p); with it, the client, \
which measures and prints. RUST_LOG sets the libraries' log (default: warnings)."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// RDMA WRITE bandwidth (ib_write_bw)
    #[command(name = "write-bw")]
    WriteBw(TestArgs),
    /// RDMA READ bandwidth (ib_read_bw)
    #[command(name = "read-bw")]
    ReadBw(TestArgs),
    /// SEND bandwidth (ib_send_bw)
    #[command(name = "send-bw")]
    SendBw(TestArgs),
    /// RDMA WRITE latency (ib_write_lat)
    #[command(name = "write-lat")]
    WriteLat(TestArgs),
    /// RDMA READ latency (ib_read_lat)
    #[command(name = "read-lat")]
    ReadLat(TestArgs),
    /// SEND latency (ib_send_lat)
    #[command(name = "send-lat")]
    SendLat(TestArgs),
    /// Runs perftest's tools and ours on this machine (127.0.0.1), alternating, and
    /// prints the medians and the median ratio ours/perftest
    Compare(CompareArgs),
}

/// perftest's options, as `ib_write_bw` and friends take them.
#[derive(Args, Debug, Clone)]
struct TestArgs {
    /// RDMA device [default: $RDMA_TEST_DEVICE, else the first device]
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    dev: Option<String>,
    /// Port of the device
    #[arg(short = 'i', long = "ib-port", value_name = "PORT", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(1..))]
    ib_port: u8,
    /// GID index [default: the port's first RoCE v2 IPv4 GID]
    #[arg(short = 'x', long = "gid-index", value_name = "GID_INDEX")]
    gid_index: Option<u8>,
    /// Message size in bytes [default: 65536 for bandwidth, 2 for latency]
    #[arg(short = 's', long = "size", value_name = "SIZE", value_parser = positive)]
    size: Option<usize>,
    /// Iterations [default: 5000 for bandwidth, 1000 for latency]
    #[arg(short = 'n', long = "iters", value_name = "ITERS", value_parser = positive)]
    iters: Option<usize>,
    /// TCP port of the side channel
    #[arg(
        short = 'p',
        long = "port",
        value_name = "TCP_PORT",
        default_value_t = 18515
    )]
    tcp_port: u16,
    /// Send queue depth
    #[arg(short = 't', long = "tx-depth", value_name = "TX_DEPTH", default_value_t = 128,
          value_parser = positive)]
    tx_depth: usize,
    /// Signal every CQ_MOD-th send [default: as perftest]
    #[arg(short = 'Q', long = "cq-mod", value_name = "CQ_MOD", value_parser = positive)]
    cq_mod: Option<usize>,
    /// Requests per ibv_post_send in the bandwidth tests (0: as many as fit in a chain)
    #[arg(
        short = 'l',
        long = "post_list",
        value_name = "POST_LIST",
        default_value_t = 0
    )]
    post_list: usize,
    /// Bandwidth in Gb/s instead of MB/s
    #[arg(long = "report_gbits")]
    report_gbits: bool,
    /// Ours: spread the bandwidth tests' requests over BYTES of each buffer, two sizes
    /// apart (0: all on the buffer's first SIZE bytes, as perftest)
    #[arg(long = "spread", value_name = "BYTES", default_value_t = 0)]
    spread: usize,
    /// The server to connect to (none: be the server)
    #[arg(value_name = "SERVER_ADDR")]
    server: Option<String>,
}

/// `compare`'s options.
#[derive(Args, Debug, Clone)]
struct CompareArgs {
    /// RDMA device [default: $RDMA_TEST_DEVICE, else the first device]
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    dev: Option<String>,
    /// GID index [default: the port's first RoCE v2 IPv4 GID]
    #[arg(short = 'x', long = "gid-index", value_name = "GID_INDEX")]
    gid_index: Option<u8>,
    /// Message size (repeatable) [default: 4096, 65536, 1048576]
    #[arg(short = 's', long = "size", value_name = "SIZE", value_parser = positive)]
    sizes: Vec<usize>,
    /// Pairs of runs per test and size (perftest and ours alternating)
    #[arg(long = "pairs", value_name = "N", default_value_t = 6, value_parser = positive)]
    pairs: usize,
    /// Tests, comma-separated [default: all six]
    #[arg(long = "tests", value_name = "TEST,...", value_delimiter = ',', value_parser = test_name)]
    tests: Vec<Test>,
    /// Extra options for our side only, e.g. '-l 1'
    #[arg(long = "ours-args", value_name = "ARGS", allow_hyphen_values = true)]
    ours_args: Option<String>,
    /// Print every pair
    #[arg(long = "raw")]
    raw: bool,
}

fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{text}` is not a whole number")),
    }
}

fn test_name(text: &str) -> Result<Test, String> {
    Test::parse(text).ok_or_else(|| {
        format!("`{text}`: write-bw, read-bw, send-bw, write-lat, read-lat or send-lat")
    })
}

impl TestArgs {
    fn into_opts(self, test: Test) -> Opts {
        Opts {
            test,
            dev: self.dev.unwrap_or_else(default_device),
            ib_port: self.ib_port,
            gid_index: self.gid_index,
            size: self.size.unwrap_or(if test.is_bw() { 65536 } else { 2 }),
            iters: self.iters.unwrap_or(if test.is_bw() { 5000 } else { 1000 }),
            tcp_port: self.tcp_port,
            tx_depth: self.tx_depth,
            cq_mod: self.cq_mod,
            post_list: self.post_list,
            gbits: self.report_gbits,
            spread: self.spread,
            server: self.server,
        }
    }
}

fn default_device() -> String {
    std::env::var("RDMA_TEST_DEVICE").ok().unwrap_or_else(|| {
        ibverbs::devices()
            .ok()
            .and_then(|l| l.iter().next().map(|d| d.name()))
            .unwrap_or_else(|| "rxe0".into())
    })
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Serialize, Deserialize)]
struct Hello {
    endpoint: Endpoint,
    memory: RemoteMemory,
}

fn line<T: Serialize>(w: &mut TcpStream, v: &T) -> Res<()> {
    let mut s = serde_json::to_string(v)?;
    s.push('\n');
    w.write_all(s.as_bytes())?;
    Ok(())
}

fn read_line<T: for<'de> Deserialize<'de>>(r: &mut BufReader<TcpStream>) -> Res<T> {
    let mut s = String::new();
    r.read_line(&mut s)?;
    if s.is_empty() {
        return Err("side channel closed".into());
    }
    Ok(serde_json::from_str(&s)?)
}

struct Conn {
    _ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    remote: RemoteMemory,
    w: TcpStream,
    r: BufReader<TcpStream>,
    max_inline: usize,
    rd_atomic: usize,
}

fn setup(o: &Opts) -> Res<Conn> {
    let ctx = Context::open(&o.dev)?;
    let gid_index = match o.gid_index {
        Some(i) => i,
        None => {
            ctx.find_roce_v2_gid(o.ib_port, ibverbs::IpFamily::V4)?
                .gid_index as u8
        }
    };
    let attr = ctx.query_device()?;
    let depth = o.tx_depth.min(attr.max_qp_wr() as usize / 2).max(1) as u32;
    // perftest's default number of outstanding READs: the device maximum.
    let rd_atomic = attr.max_qp_rd_atom().clamp(1, u8::MAX as u32) as u8;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(depth * 2 + 16, None, 0)?;
    let prepared = pd
        .create_qp(QpType::RC, &cq, &cq)
        .max_send_wr(depth)
        .max_recv_wr(depth)
        .max_inline_data(if o.test.is_bw() { 0 } else { 220 })
        .build()?;
    let max_inline = prepared.cap().max_inline_data as usize;
    let mr = pd.reg_mr(
        (2 * o.size.max(64)).max(spread_slots(o) * 2 * o.size),
        AccessFlags::all_remote(),
    )?;
    let copts = ConnectOptions {
        port_num: o.ib_port,
        gid_index,
        max_rd_atomic: rd_atomic,
        max_dest_rd_atomic: rd_atomic,
        ..Default::default()
    };
    let local = prepared.endpoint(&copts)?;
    let stream = match &o.server {
        None => {
            let l = TcpListener::bind(("0.0.0.0", o.tcp_port))?;
            l.accept()?.0
        }
        Some(host) => {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match TcpStream::connect((host.as_str(), o.tcp_port)) {
                    Ok(s) => break s,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
    };
    stream.set_nodelay(true)?;
    let mut w = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    line(
        &mut w,
        &Hello {
            endpoint: local,
            memory: mr.remote(),
        },
    )?;
    let peer: Hello = read_line(&mut r)?;
    let qp = prepared.connect(&peer.endpoint, &copts)?;
    Ok(Conn {
        _ctx: ctx,
        cq,
        qp,
        mr,
        remote: peer.memory,
        w,
        r,
        max_inline,
        rd_atomic: rd_atomic as usize,
    })
}

/// Wait for at least one completion; returns how many, all checked.
fn reap(cq: &CompletionQueue, wcs: &mut [WorkCompletion]) -> Res<usize> {
    let mut spin = Spin::new("no completion within 60 s");
    loop {
        let got = cq.poll(wcs)?;
        if !got.is_empty() {
            for wc in got.iter() {
                wc.result()?;
            }
            return Ok(got.len());
        }
        spin.tick()?;
    }
}

fn sync(c: &mut Conn) -> Res<()> {
    line(&mut c.w, &"sync")?;
    let _: String = read_line(&mut c.r)?;
    Ok(())
}

fn run(o: &Opts) -> Res<()> {
    let mut c = setup(o)?;
    let client = o.server.is_some();
    match o.test {
        Test::WriteBw | Test::ReadBw => {
            if client {
                let (peak, avg, rate) = bw_client(o, &mut c)?;
                print_bw(o, peak, avg, rate);
            }
            sync(&mut c)?;
        }
        Test::SendBw => {
            if client {
                sync(&mut c)?; // the server's receives are posted
                let (peak, avg, rate) = bw_client(o, &mut c)?;
                print_bw(o, peak, avg, rate);
            } else {
                send_bw_server(o, &mut c)?;
            }
            sync(&mut c)?;
        }
        Test::WriteLat | Test::SendLat => {
            let samples = pingpong(o, &mut c, client)?;
            if client {
                print_lat(o, samples, 2.0);
            }
            sync(&mut c)?;
        }
        Test::ReadLat => {
            if client {
                let samples = read_lat(o, &mut c)?;
                print_lat(o, samples, 1.0);
            }
            sync(&mut c)?;
        }
    }
    Ok(())
}

/// Payload per chained `ibv_post_send` call of the WRITE and SEND bandwidth tests
/// (unless `-l`; READs chain every free slot): on
/// soft-RoCE every call is a system call that runs the requester (and, over loopback,
/// the responder and completer) inline, so chaining small messages saves a system call
/// each; large messages gain nothing from it, and long chains of them slow a write
/// stream down (`docs/BENCHMARKS.md`).
const CHAIN_BYTES: usize = 256 << 10;

/// Completion moderation when `-Q` is not given, as perftest's: bandwidth tests signal
/// every 100th request up to 8 KiB and every request above; latency tests every send,
/// except that our WRITE ping-pong signals every 32nd (perftest polls each one).
fn default_cq_mod(o: &Opts) -> usize {
    match o.test {
        Test::WriteLat => 32,
        Test::SendLat | Test::ReadLat => 1,
        _ if o.size > 8192 => 1,
        _ => 100,
    }
}

/// WRITE/READ/SEND bandwidth: keep `tx_depth` requests in flight (READ: at most the
/// outstanding READs the QP allows), signal every `cq_mod`-th; refill the send queue
/// with chained `ibv_post_send` calls of up to [`CHAIN_BYTES`] (`post_list` requests per
/// call when set).
fn bw_client(o: &Opts, c: &mut Conn) -> Res<(f64, f64, f64)> {
    let depth = c.qp.cap().max_send_wr as usize;
    let depth = if o.test == Test::ReadBw {
        depth.min(c.rd_atomic)
    } else {
        depth
    };
    let cq_mod = o.cq_mod.unwrap_or(default_cq_mod(o)).min(depth).max(1);
    let per_call = match (o.post_list, o.test) {
        // A READ request is one small packet whatever its size: the data moves in the
        // responder's context, so chain every free slot.
        (0, Test::ReadBw) => depth,
        (0, _) => (CHAIN_BYTES / o.size).clamp(1, depth),
        (n, _) => n,
    };
    let slots = if o.test == Test::SendBw {
        1
    } else {
        spread_slots(o)
    };
    let sges: Vec<[ibverbs::Sge<'_>; 1]> = (0..slots)
        .map(|k| [c.mr.sge(2 * k * o.size..(2 * k + 1) * o.size)])
        .collect();
    let remotes: Vec<RemoteMemory> = (0..slots)
        .map(|k| c.remote.slice((2 * k * o.size) as u64, o.size as u64))
        .collect();
    let mut wcs = [WorkCompletion::default(); 16];
    let mut wrs: Vec<SendWr<'_>> = Vec::with_capacity(per_call);
    let (mut posted, mut done) = (0usize, 0usize);
    let mut stamps = Vec::with_capacity(o.iters / cq_mod + 2);
    let start = Instant::now();
    while done < o.iters {
        while posted < o.iters && posted - done < depth {
            let n = (depth - (posted - done))
                .min(o.iters - posted)
                .min(per_call);
            wrs.clear();
            for id in posted..posted + n {
                let signaled = (id + 1) % cq_mod == 0 || id + 1 == o.iters;
                let (sge, remote) = (&sges[id % slots][..], remotes[id % slots]);
                let wr = match o.test {
                    Test::WriteBw => SendWr::write(id as u64, sge, remote),
                    Test::ReadBw => SendWr::read(id as u64, sge, remote),
                    _ => SendWr::send(id as u64, sge),
                };
                wrs.push(if signaled { wr.signaled() } else { wr });
            }
            c.qp.post_send(&mut wrs)?;
            posted += n;
        }
        let n = reap(&c.cq, &mut wcs)?;
        let now = Instant::now();
        for wc in &wcs[..n] {
            // Each signaled completion retires everything up to it.
            done = wc.wr_id() as usize + 1;
        }
        stamps.push((now, done));
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = (o.size * o.iters) as f64;
    let avg = bytes / secs;
    // Peak: the best rate over any window of at least a tenth of the messages.
    let window = (o.iters / 10).max(1);
    let mut peak = avg;
    let mut points = vec![(start, 0usize)];
    points.extend(stamps.iter().copied());
    for (i, &(t1, d1)) in points.iter().enumerate() {
        if let Some(&(t0, d0)) = points[..i].iter().rev().find(|&&(_, d0)| d1 - d0 >= window) {
            let dt = t1.duration_since(t0).as_secs_f64();
            if dt > 0.0 {
                peak = peak.max(((d1 - d0) * o.size) as f64 / dt);
            }
        }
    }
    Ok((peak, avg, o.iters as f64 / secs / 1e6))
}

/// Slots of `--spread` (at least one).
fn spread_slots(o: &Opts) -> usize {
    (o.spread / (2 * o.size.max(1))).max(1)
}

fn send_bw_server(o: &Opts, c: &mut Conn) -> Res<()> {
    let depth = c.qp.cap().max_recv_wr as usize;
    let mut posted = 0usize;
    while posted < depth.min(o.iters) {
        let sge = [c.mr.sge(0..o.size)];
        c.qp.post_recv(&mut [RecvWr::new(posted as u64, &sge)])?;
        posted += 1;
    }
    sync(c)?;
    let sge = [c.mr.sge(0..o.size)];
    let mut wcs = [WorkCompletion::default(); 16];
    let mut done = 0;
    while done < o.iters {
        let n = reap(&c.cq, &mut wcs)?;
        done += n;
        for _ in 0..n {
            if posted < o.iters {
                c.qp.post_recv(&mut [RecvWr::new(posted as u64, &sge)])?;
                posted += 1;
            }
        }
    }
    Ok(())
}

/// Ping-pong (perftest's write_lat / send_lat): returns round-trip samples in µs.
/// Our buffer's first half receives the peer's data, the second half is the source.
fn pingpong(o: &Opts, c: &mut Conn, client: bool) -> Res<Vec<f64>> {
    let size = o.size;
    let inline = size <= c.max_inline;
    let is_send = o.test == Test::SendLat;
    let remote = c.remote.slice(0, size as u64);
    let base = c.mr.as_slice().as_ptr();
    let mut payload = vec![0u8; size];
    if is_send {
        for i in 0..2 {
            let sge = [c.mr.sge(0..size)];
            c.qp.post_recv(&mut [RecvWr::new(i, &sge)])?;
        }
    }
    sync(c)?;
    // One clock read per iteration, as perftest's `tposted`: a sample is the time from
    // one iteration's start to the next one's.
    let mut stamps = Vec::with_capacity(o.iters + 1);
    let mut since_signal = 0usize;
    let cq_mod = o.cq_mod.unwrap_or(default_cq_mod(o)).max(1);
    let mut waiter = Waiter::default();
    for it in 0..o.iters {
        let tag = (it % 250 + 1) as u8;
        stamps.push(Instant::now());
        if !client {
            waiter.wait_peer(c, is_send, base, size - 1, tag)?;
        }
        since_signal += 1;
        let signaled = since_signal >= cq_mod;
        if inline {
            payload[size - 1] = tag;
            let inl = [InlineSge::new(&payload)];
            let wr = if is_send {
                SendWr::send_inline(0, &inl)
            } else {
                SendWr::write_inline(0, &inl, remote)
            };
            let wr = if signaled {
                wr.flags(SendFlags::SIGNALED)
            } else {
                wr
            };
            c.qp.post_send(&mut [wr])?;
        } else {
            c.mr.as_mut_slice()[2 * size - 1] = tag;
            let sge = [c.mr.sge(size..2 * size)];
            let wr = if is_send {
                SendWr::send(0, &sge)
            } else {
                SendWr::write(0, &sge, remote)
            };
            let wr = if signaled { wr.signaled() } else { wr };
            c.qp.post_send(&mut [wr])?;
        }
        if signaled {
            since_signal = 0;
            waiter.wait_send(c)?;
        }
        if client {
            waiter.wait_peer(c, is_send, base, size - 1, tag)?;
        }
    }
    stamps.push(Instant::now());
    Ok(intervals_us(&stamps))
}

/// Microseconds between consecutive instants.
fn intervals_us(stamps: &[Instant]) -> Vec<f64> {
    stamps
        .windows(2)
        .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1e6)
        .collect()
}

/// Sorts completions of the one CQ into "our send finished" and "a receive arrived".
#[derive(Default)]
struct Waiter {
    sends: usize,
    recvs: usize,
}

impl Waiter {
    fn drain(&mut self, c: &Conn) -> Res<()> {
        let mut wcs = [WorkCompletion::default(); 8];
        for wc in c.cq.poll(&mut wcs)?.iter() {
            wc.result()?;
            if wc.opcode().0 & ibverbs::ffi::IBV_WC_RECV != 0 {
                self.recvs += 1;
            } else {
                self.sends += 1;
            }
        }
        Ok(())
    }
    fn wait_send(&mut self, c: &Conn) -> Res<()> {
        let mut spin = Spin::new("no send completion within 60 s");
        self.drain(c)?;
        while self.sends == 0 {
            spin.tick()?;
            self.drain(c)?;
        }
        self.sends -= 1;
        Ok(())
    }
    fn wait_peer(
        &mut self,
        c: &mut Conn,
        is_send: bool,
        base: *const u8,
        last: usize,
        tag: u8,
    ) -> Res<()> {
        if is_send {
            let mut spin = Spin::new("no receive within 60 s");
            self.drain(c)?;
            while self.recvs == 0 {
                spin.tick()?;
                self.drain(c)?;
            }
            self.recvs -= 1;
            let sge = [c.mr.sge(0..last + 1)];
            c.qp.post_recv(&mut [RecvWr::new(0, &sge)])?;
            return Ok(());
        }
        let mut spin = Spin::new("no write within 60 s");
        while read_tag(base, last) != tag {
            spin.tick()?;
        }
        Ok(())
    }
}

/// A bounded busy-poll that gives the CPU away every 16 rounds. rxe does most of its
/// work inline in the poster's system call, but what it defers (tasklets, so
/// ksoftirqd on a busy CPU) waits behind a spinner until it yields: in the emulated
/// guest a spinner that yielded rarely (or never, as perftest's) got stuck in a regime
/// of milliseconds per round trip, while a yield is cheap when nothing else is runnable
/// (`docs/BENCHMARKS.md`). The clock is read
/// only every 1024 rounds (on an emulated CPU a clock read costs more than a poll).
struct Spin {
    rounds: u32,
    /// Set at the first check, so that a short wait reads no clock at all.
    deadline: Option<Instant>,
    what: &'static str,
}

impl Spin {
    fn new(what: &'static str) -> Spin {
        Spin {
            rounds: 0,
            deadline: None,
            what,
        }
    }
    fn tick(&mut self) -> Res<()> {
        self.rounds = self.rounds.wrapping_add(1);
        if self.rounds & 0x3ff == 0 {
            let now = Instant::now();
            let deadline = *self.deadline.get_or_insert(now + Duration::from_secs(60));
            if now > deadline {
                return Err(self.what.into());
            }
        }
        if self.rounds & 0xf == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        Ok(())
    }
}

fn read_tag(base: *const u8, last: usize) -> u8 {
    // SAFETY: `base..base+last` is inside the live registered buffer of the benchmark;
    // the peer writes it by RDMA, so it is read volatile.
    unsafe { std::ptr::read_volatile(base.add(last)) }
}

fn read_lat(o: &Opts, c: &mut Conn) -> Res<Vec<f64>> {
    let sge = [c.mr.sge(0..o.size)];
    let remote = c.remote.slice(0, o.size as u64);
    let mut wcs = [WorkCompletion::default(); 1];
    let mut stamps = Vec::with_capacity(o.iters + 1);
    for i in 0..o.iters {
        stamps.push(Instant::now());
        c.qp.post_send(&mut [SendWr::read(i as u64, &sge, remote).signaled()])?;
        reap(&c.cq, &mut wcs)?;
    }
    stamps.push(Instant::now());
    Ok(intervals_us(&stamps))
}

const BAR: &str =
    "---------------------------------------------------------------------------------------";

fn print_bw(o: &Opts, peak: f64, avg: f64, rate: f64) {
    let (unit, f) = if o.gbits {
        ("Gb/sec", 8.0 / 1e9)
    } else {
        ("MB/sec", 1.0 / 1048576.0)
    };
    println!("{BAR}");
    println!(" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]");
    println!(
        " {:<10} {:<10}       {:<.2}               {:<.2}\t\t   {:.6}",
        o.size,
        o.iters,
        peak * f,
        avg * f,
        rate
    );
    println!("{BAR}");
}

fn print_lat(o: &Opts, mut rtt: Vec<f64>, div: f64) {
    for s in rtt.iter_mut() {
        *s /= div;
    }
    rtt.sort_by(|a, b| a.total_cmp(b));
    let n = rtt.len();
    let avg = rtt.iter().sum::<f64>() / n as f64;
    let stdev = (rtt.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / n as f64).sqrt();
    let pct = |p: f64| rtt[((n as f64 * p) as usize).min(n - 1)];
    println!("{BAR}");
    println!(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ");
    println!(
        " {:<7} {:<10}     {:<7.2}        {:<7.2}      {:<7.2}           {:<7.2}           {:<7.2}          {:<7.2}                 {:<7.2}",
        o.size, o.iters, rtt[0], rtt[n - 1], rtt[n / 2], avg, stdev, pct(0.99), pct(0.999)
    );
    println!("{BAR}");
}

/// The result line under perftest's `#bytes` header: (bandwidth average, or typical
/// latency).
fn parse_result(out: &str, bw: bool) -> Option<f64> {
    let mut lines = out
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("#bytes"));
    lines.next()?;
    let cols: Vec<f64> = lines
        .next()?
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .collect();
    if bw {
        cols.get(3).copied()
    } else {
        cols.get(4).copied()
    }
}

/// Whether a TCP socket listens on `port` (from `/proc/net/tcp{,6}`: probing with a
/// connection would use up the single accept of a perftest server).
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|path| {
        std::fs::read_to_string(path).is_ok_and(|table| {
            table.lines().skip(1).any(|line| {
                let mut cols = line.split_whitespace();
                let local = cols.nth(1).unwrap_or("");
                let state = cols.nth(1).unwrap_or("");
                local.ends_with(&want) && state == "0A"
            })
        })
    })
}

/// Run a server and then its client (once the server listens); the client's stdout.
fn run_pair(server: Vec<String>, client: Vec<String>, port: u16) -> Res<String> {
    let mut srv = Command::new(&server[0])
        .args(&server[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !listening(port) {
        if srv.try_wait()?.is_some() || Instant::now() > deadline {
            let _ = srv.kill();
            let _ = srv.wait();
            return Err(format!("{} did not start listening", server.join(" ")).into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut last_err = String::new();
    for _ in 0..5 {
        let out = Command::new(&client[0]).args(&client[1..]).output()?;
        if out.status.success() {
            let _ = srv.wait();
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        last_err = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if srv.try_wait()?.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = srv.kill();
    let _ = srv.wait();
    Err(format!("{} failed: {last_err}", client.join(" ")).into())
}

/// Iterations per run: enough for a fraction of a second per run on the emulated guest.
fn compare_iters(test: Test, size: usize) -> usize {
    match (test.is_bw(), size) {
        (true, s) if s >= 1 << 20 => 100,
        (true, s) if s >= 65536 => 1000,
        (true, _) => 5000,
        (false, s) if s >= 1 << 20 => 50,
        (false, s) if s >= 65536 => 200,
        (false, _) => 1000,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `compare`: for each test and size, `pairs` alternating runs of perftest's tool and
/// ours (which goes first alternates too, so drift of the guest hits both alike), in
/// this boot; prints the medians and the median of the per-pair ratios.
fn compare(args: CompareArgs) -> Res<()> {
    let dev = args.dev.unwrap_or_else(default_device);
    let gid = args.gid_index.map(|g| g.to_string());
    let mut sizes = args.sizes;
    let mut tests = args.tests;
    let pairs = args.pairs;
    let raw = args.raw;
    let ours_args: Vec<String> = args
        .ours_args
        .map(|a| a.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    if sizes.is_empty() {
        sizes = vec![4096, 65536, 1 << 20];
    }
    if tests.is_empty() {
        tests = vec![
            Test::WriteBw,
            Test::ReadBw,
            Test::SendBw,
            Test::WriteLat,
            Test::ReadLat,
            Test::SendLat,
        ];
    }
    let gid = match gid {
        Some(g) => g,
        None => Context::open(&dev)?
            .find_roce_v2_gid(1, ibverbs::IpFamily::V4)?
            .gid_index
            .to_string(),
    };
    let me = std::env::current_exe()?.to_string_lossy().into_owned();
    println!(
        "{pairs} alternating runs of each (bandwidth: BW average; latency: t_typical, the median)"
    );
    println!(
        "{:<10} {:>9} {:>6} {:>16} {:>16} {:>8}  {:<13}",
        "test", "bytes", "iters", "perftest (med)", "verbs-bench (med)", "ratio", "ratio range"
    );
    let mut port = 18600u16;
    let mut worst: Option<(f64, String)> = None;
    for &test in &tests {
        for &size in &sizes {
            let iters = compare_iters(test, size);
            let mut common = vec![
                "-d".to_owned(),
                dev.clone(),
                "-x".into(),
                gid.clone(),
                "-s".into(),
                size.to_string(),
                "-n".into(),
                iters.to_string(),
            ];
            if test.is_bw() {
                common.push("--report_gbits".into());
            }
            let (mut perf, mut ours, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            for pair in 0..pairs {
                let mut got = [0.0f64; 2];
                let order = if pair % 2 == 0 {
                    [false, true]
                } else {
                    [true, false]
                };
                for is_ours in order {
                    port += 1;
                    let mut server = if is_ours {
                        vec![me.clone(), test.name().to_owned()]
                    } else {
                        vec![test.perftest().to_owned()]
                    };
                    server.extend(common.iter().cloned());
                    if is_ours {
                        server.extend(ours_args.iter().cloned());
                    }
                    server.extend(["-p".to_owned(), port.to_string()]);
                    let mut client = server.clone();
                    client.push("127.0.0.1".into());
                    let out = run_pair(server, client, port)?;
                    got[is_ours as usize] = parse_result(&out, test.is_bw())
                        .ok_or_else(|| format!("no result line in:\n{out}"))?;
                }
                if raw {
                    println!(
                        "  {} {size} pair {pair} ({} first): \
                         perftest {:.3} verbs-bench {:.3} ratio {:.3}",
                        test.name(),
                        if pair % 2 == 0 { "perftest" } else { "ours" },
                        got[0],
                        got[1],
                        got[1] / got[0]
                    );
                }
                perf.push(got[0]);
                ours.push(got[1]);
                ratios.push(got[1] / got[0]);
            }
            let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = ratios.iter().copied().fold(0.0, f64::max);
            let ratio = median(ratios);
            let unit = if test.is_bw() { "Gb/s" } else { "us" };
            println!(
                "{:<10} {:>9} {:>6} {:>11.3} {unit:<4} {:>11.3} {unit:<4}  {:>8.3}  {:.2}..{:.2}",
                test.name(),
                size,
                iters,
                median(perf),
                median(ours),
                ratio,
                lo,
                hi
            );
            // How far from the goal: bandwidth below 1, latency above 1.
            let shortfall = if test.is_bw() { 1.0 / ratio } else { ratio };
            if worst.as_ref().is_none_or(|(w, _)| shortfall > *w) {
                worst = Some((shortfall, format!("{} {size}", test.name())));
            }
        }
    }
    println!(
        "ratio = median over the pairs of verbs-bench / perftest \
         (bandwidth: >= 1 is as fast or faster; latency: <= 1 is as fast or faster)"
    );
    if let Some((w, at)) = worst {
        println!(
            "furthest from parity: {at} ({:.1}% {})",
            (w - 1.0).abs() * 100.0,
            if w > 1.0 { "behind" } else { "ahead" }
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    tools::cli::init_tracing();
    let cli: Cli = tools::cli::parse_or_exit("verbs-bench");
    let result = match cli.command {
        Cmd::Compare(args) => compare(args),
        Cmd::WriteBw(a) => run(&a.into_opts(Test::WriteBw)),
        Cmd::ReadBw(a) => run(&a.into_opts(Test::ReadBw)),
        Cmd::SendBw(a) => run(&a.into_opts(Test::SendBw)),
        Cmd::WriteLat(a) => run(&a.into_opts(Test::WriteLat)),
        Cmd::ReadLat(a) => run(&a.into_opts(Test::ReadLat)),
        Cmd::SendLat(a) => run(&a.into_opts(Test::SendLat)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => tools::cli::fail("verbs-bench", e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tools::cli::{try_parse, Stop};

    fn parse(line: &str) -> Result<Cli, Stop> {
        try_parse(
            "verbs-bench",
            std::iter::once("verbs-bench").chain(line.split_whitespace()),
        )
    }

    fn opts(line: &str) -> Opts {
        match parse(line).unwrap().command {
            Cmd::WriteBw(a) => a.into_opts(Test::WriteBw),
            Cmd::ReadLat(a) => a.into_opts(Test::ReadLat),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn perftest_options() {
        let short = opts(
            "write-bw -d rxe0 -i 2 -x 3 -s 4096 -n 100 -p 18600 -t 64 -Q 8 -l 1 \
             --report_gbits --spread 1048576 10.0.0.1",
        );
        let long = opts(
            "write-bw --ib-dev rxe0 --ib-port 2 --gid-index 3 --size 4096 --iters 100 \
             --port 18600 --tx-depth 64 --cq-mod 8 --post_list 1 --report_gbits \
             --spread=1048576 10.0.0.1",
        );
        for o in [short, long] {
            assert_eq!(o.test, Test::WriteBw);
            assert_eq!(
                (o.dev.as_str(), o.ib_port, o.gid_index),
                ("rxe0", 2, Some(3))
            );
            assert_eq!((o.size, o.iters, o.tcp_port), (4096, 100, 18600));
            assert_eq!((o.tx_depth, o.cq_mod, o.post_list), (64, Some(8), 1));
            assert!(o.gbits);
            assert_eq!(o.spread, 1 << 20);
            assert_eq!(o.server.as_deref(), Some("10.0.0.1"));
        }
        // perftest's defaults per kind of test.
        let o = opts("read-lat -d rxe0");
        assert_eq!(
            (o.size, o.iters, o.tcp_port, o.ib_port),
            (2, 1000, 18515, 1)
        );
        assert_eq!((o.server, o.gid_index, o.cq_mod), (None, None, None));
        let o = opts("write-bw -d rxe0");
        assert_eq!((o.size, o.iters), (65536, 5000));
    }

    #[test]
    fn compare_options() {
        let Cmd::Compare(c) = parse(
            "compare -d rxe0 -x 1 -s 4096 -s 65536 --pairs 2 --tests write-bw,read-lat \
             --ours-args=-l --raw",
        )
        .unwrap()
        .command
        else {
            panic!("compare");
        };
        assert_eq!((c.dev.as_deref(), c.gid_index), (Some("rxe0"), Some(1)));
        assert_eq!((c.sizes, c.pairs, c.raw), (vec![4096, 65536], 2, true));
        assert_eq!(c.tests, vec![Test::WriteBw, Test::ReadLat]);
        assert_eq!(c.ours_args.as_deref(), Some("-l"));
        // A value of several words that starts with a dash.
        let args = ["verbs-bench", "compare", "--ours-args", "-l 1"];
        let Cmd::Compare(c) = try_parse::<Cli, _, _>("verbs-bench", args).unwrap().command else {
            panic!("compare");
        };
        assert_eq!(c.ours_args.as_deref(), Some("-l 1"));
    }

    #[test]
    fn wrong_invocations_are_one_line() {
        for (line, want) in [
            ("", "a command is required: write-bw, read-bw"),
            ("write-bw -s 0", "must be at least 1"),
            ("write-bw -i 0", "-i"),
            ("write-bw -p 70000", "70000"),
            ("write-bw -x 300", "300"),
            ("write-bw -n x", "not a whole number"),
            ("write-bw --bogus", "unexpected argument"),
            ("write-bw a b", "unexpected argument 'b'"),
            ("write-bandwidth", "unrecognized subcommand"),
            ("compare --tests write-bw,nope", "`nope`"),
            ("compare --pairs 0", "must be at least 1"),
        ] {
            match parse(line) {
                Err(Stop::Usage(e)) => {
                    assert!(!e.contains('\n') && e.contains(want), "{line}: {e}");
                }
                other => panic!("{line}: {other:?}"),
            }
        }
        for line in ["--help", "write-bw --help", "compare -h", "--version"] {
            assert!(matches!(parse(line), Err(Stop::Print(_))), "{line}");
        }
    }
}
