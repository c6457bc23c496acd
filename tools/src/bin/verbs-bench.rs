//! `verbs-bench`: RDMA verbs micro-benchmarks over the `ibverbs` crate, with perftest's
//! options and output columns so that lines compare one to one with `ib_write_bw`,
//! `ib_read_bw`, `ib_send_bw`, `ib_write_lat`, `ib_read_lat`, `ib_send_lat`.
//!
//! ```text
//! verbs-bench write-bw|read-bw|send-bw|write-lat|read-lat|send-lat
//!     [-d DEV] [-i PORT] [-x GID_INDEX] [-s SIZE] [-n ITERS] [-p TCP_PORT]
//!     [-t TX_DEPTH] [--report_gbits] [SERVER_ADDR]
//! verbs-bench compare [-d DEV] [-x GID_INDEX] [-s SIZE]...
//! ```
//!
//! Without `SERVER_ADDR` it is the server (waits on `-p`, default 18515 as perftest);
//! with it, the client, which measures and prints. `compare` runs perftest's tool and
//! ours, server and client on this machine (over 127.0.0.1), for each size (default
//! 4 KiB, 64 KiB, 1 MiB) and test (`write-bw`, `write-lat`), and prints the ratio
//! ours/perftest (bandwidth: higher is better; latency: lower is better).

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
    gbits: bool,
    server: Option<String>,
}

const USAGE: &str = "usage: verbs-bench write-bw|read-bw|send-bw|write-lat|read-lat|send-lat \
[-d DEV] [-i PORT] [-x GID_INDEX] [-s SIZE] [-n ITERS] [-p TCP_PORT] [-t TX_DEPTH] \
[--report_gbits] [SERVER_ADDR]\n       verbs-bench compare [-d DEV] [-x GID_INDEX] [-s SIZE]...";

fn parse(args: &[String]) -> Result<Opts, String> {
    let test = Test::parse(args.first().map(String::as_str).unwrap_or("")).ok_or(USAGE)?;
    let mut o = Opts {
        test,
        dev: default_device(),
        ib_port: 1,
        gid_index: None,
        size: if test.is_bw() { 65536 } else { 2 },
        iters: if test.is_bw() { 5000 } else { 1000 },
        tcp_port: 18515,
        tx_depth: 128,
        gbits: false,
        server: None,
    };
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().cloned().ok_or(format!("{name} needs a value"));
        let num = |v: String| v.parse::<usize>().map_err(|e| format!("{v}: {e}"));
        match a.as_str() {
            "-d" | "--ib-dev" => o.dev = val(a)?,
            "-i" | "--ib-port" => o.ib_port = num(val(a)?)? as u8,
            "-x" | "--gid-index" => o.gid_index = Some(num(val(a)?)? as u8),
            "-s" | "--size" => o.size = num(val(a)?)?,
            "-n" | "--iters" => o.iters = num(val(a)?)?,
            "-p" | "--port" => o.tcp_port = num(val(a)?)? as u16,
            "-t" | "--tx-depth" => o.tx_depth = num(val(a)?)?.max(1),
            "--report_gbits" => o.gbits = true,
            s if !s.starts_with('-') && o.server.is_none() => o.server = Some(s.to_owned()),
            other => return Err(format!("unknown option {other}\n{USAGE}")),
        }
    }
    if o.size == 0 || o.iters == 0 {
        return Err("size and iterations must be positive".into());
    }
    Ok(o)
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
    let rd_atomic = attr.max_qp_rd_atom().clamp(1, 16) as u8;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(depth * 2 + 16, None, 0)?;
    let prepared = pd
        .create_qp(QpType::RC, &cq, &cq)
        .max_send_wr(depth)
        .max_recv_wr(depth)
        .max_inline_data(if o.test.is_bw() { 0 } else { 220 })
        .build()?;
    let max_inline = prepared.cap().max_inline_data as usize;
    let mr = pd.reg_mr(2 * o.size.max(64), AccessFlags::all_remote())?;
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
    })
}

/// Wait for at least one completion; returns how many, all checked.
fn reap(cq: &CompletionQueue, wcs: &mut [WorkCompletion]) -> Res<usize> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut spins = 0u32;
    loop {
        let got = cq.poll(wcs)?;
        if !got.is_empty() {
            for wc in got.iter() {
                wc.result()?;
            }
            return Ok(got.len());
        }
        if Instant::now() > deadline {
            return Err("no completion within 60 s".into());
        }
        relax(&mut spins);
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

/// WRITE/READ/SEND bandwidth: keep `tx_depth` requests in flight, signal every
/// `cq_mod`-th.
fn bw_client(o: &Opts, c: &mut Conn) -> Res<(f64, f64, f64)> {
    let depth = c.qp.cap().max_send_wr as usize;
    let depth = if o.test == Test::ReadBw {
        depth.min(16)
    } else {
        depth
    };
    let cq_mod = (depth / 4).clamp(1, 100);
    let sge = [c.mr.sge(0..o.size)];
    let remote = c.remote.slice(0, o.size as u64);
    let mut wcs = [WorkCompletion::default(); 16];
    let (mut posted, mut done) = (0usize, 0usize);
    let mut stamps = Vec::with_capacity(o.iters / cq_mod + 2);
    let start = Instant::now();
    while done < o.iters {
        while posted < o.iters && posted - done < depth {
            let signaled = (posted + 1) % cq_mod == 0 || posted + 1 == o.iters;
            let wr = match o.test {
                Test::WriteBw => SendWr::write(posted as u64, &sge, remote),
                Test::ReadBw => SendWr::read(posted as u64, &sge, remote),
                _ => SendWr::send(posted as u64, &sge),
            };
            let wr = if signaled { wr.signaled() } else { wr };
            c.qp.post_send(&mut [wr])?;
            posted += 1;
        }
        let n = reap(&c.cq, &mut wcs)?;
        for wc in &wcs[..n] {
            // Each signaled completion retires everything up to it.
            done = wc.wr_id() as usize + 1;
            stamps.push((Instant::now(), done));
        }
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
    let mut samples = Vec::with_capacity(o.iters);
    let mut since_signal = 0usize;
    let mut waiter = Waiter::default();
    for it in 0..o.iters {
        let tag = (it % 250 + 1) as u8;
        let t0 = Instant::now();
        if !client {
            waiter.wait_peer(c, is_send, base, size - 1, tag)?;
        }
        since_signal += 1;
        let signaled = is_send || since_signal >= 32;
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
        samples.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    Ok(samples)
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
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut spins = 0u32;
        while self.sends == 0 {
            relax(&mut spins);
            self.drain(c)?;
            if Instant::now() > deadline {
                return Err("no send completion within 60 s".into());
            }
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
        let deadline = Instant::now() + Duration::from_secs(60);
        if is_send {
            let mut spins = 0u32;
            while self.recvs == 0 {
                relax(&mut spins);
                self.drain(c)?;
                if Instant::now() > deadline {
                    return Err("no receive within 60 s".into());
                }
            }
            self.recvs -= 1;
            let sge = [c.mr.sge(0..last + 1)];
            c.qp.post_recv(&mut [RecvWr::new(0, &sge)])?;
            return Ok(());
        }
        let mut spins = 0u32;
        while read_tag(base, last) != tag {
            if Instant::now() > deadline {
                return Err("no write within 60 s".into());
            }
            relax(&mut spins);
        }
        Ok(())
    }
}

/// Busy-poll politely: spin, and every 256 rounds give the CPU away so that a software
/// provider's kernel work (rxe runs in softirq/workqueue context) is not starved by two
/// spinning processes on few CPUs.
fn relax(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if *spins & 0xff == 0 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
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
    let mut samples = Vec::with_capacity(o.iters);
    for i in 0..o.iters {
        let t0 = Instant::now();
        c.qp.post_send(&mut [SendWr::read(i as u64, &sge, remote).signaled()])?;
        reap(&c.cq, &mut wcs)?;
        samples.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    Ok(samples)
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

fn run_pair(server: Vec<String>, client: Vec<String>) -> Res<String> {
    let mut srv = Command::new(&server[0])
        .args(&server[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    std::thread::sleep(Duration::from_millis(300));
    let mut last_err = String::new();
    for _ in 0..20 {
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
        std::thread::sleep(Duration::from_millis(300));
    }
    let _ = srv.kill();
    let _ = srv.wait();
    Err(format!("{} failed: {last_err}", client.join(" ")).into())
}

fn compare(args: &[String]) -> Res<()> {
    let mut dev = default_device();
    let mut gid = None;
    let mut sizes = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-d" => dev = it.next().ok_or("-d needs a value")?.clone(),
            "-x" => gid = Some(it.next().ok_or("-x needs a value")?.clone()),
            "-s" => sizes.push(it.next().ok_or("-s needs a value")?.parse::<usize>()?),
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if sizes.is_empty() {
        sizes = vec![4096, 65536, 1 << 20];
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
        "{:<10} {:>9} {:>7} {:>16} {:>16} {:>8}",
        "test", "bytes", "iters", "perftest", "verbs-bench", "ratio"
    );
    let mut port = 18600u16;
    for test in [Test::WriteBw, Test::WriteLat] {
        for &size in &sizes {
            let iters = match (test.is_bw(), size) {
                (true, s) if s >= 1 << 20 => 50,
                (true, s) if s >= 65536 => 300,
                (true, _) => 2000,
                (false, s) if s >= 1 << 20 => 50,
                (false, s) if s >= 65536 => 200,
                (false, _) => 500,
            };
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
            let mut results = Vec::new();
            for ours in [false, true] {
                port += 1;
                let mut base = if ours {
                    vec![me.clone(), test.name().to_owned()]
                } else {
                    vec![test.perftest().to_owned()]
                };
                base.extend(common.iter().cloned());
                base.extend(["-p".to_owned(), port.to_string()]);
                let mut client = base.clone();
                client.push("127.0.0.1".into());
                let out = run_pair(base, client)?;
                let v = parse_result(&out, test.is_bw())
                    .ok_or_else(|| format!("no result line in:\n{out}"))?;
                results.push(v);
            }
            let unit = if test.is_bw() { "Gb/s" } else { "us" };
            println!(
                "{:<10} {:>9} {:>7} {:>11.3} {unit:<4} {:>11.3} {unit:<4} {:>8.2}",
                test.name(),
                size,
                iters,
                results[0],
                results[1],
                results[1] / results[0]
            );
        }
    }
    println!("ratio = verbs-bench / perftest (bandwidth: >= 1 is as fast or faster; latency: <= 1 is as fast or faster)");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().map(String::as_str) == Some("compare") {
        compare(&args[1..])
    } else {
        match parse(&args) {
            Ok(o) => run(&o),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("verbs-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
