//! `fabric-bench`: libfabric benchmarks over the safe `fabric` crate, with the options and
//! output columns of libfabric's `fi_pingpong` and fabtests' `fi_rma_bw`.
//!
//! ```text
//! fabric-bench pingpong [OPTIONS]              start a server
//! fabric-bench pingpong [OPTIONS] <srv_addr>   connect to a server
//! fabric-bench rma-bw   [OPTIONS] [<srv_addr>]
//! fabric-bench compare  [OPTIONS]              run fi_pingpong and ours on 127.0.0.1, print ours/theirs
//! ```
//!
//! Options (as `fi_pingpong`): `-B <src_port>` (server control port, default 47592),
//! `-P <dst_port>`, `-p <provider>`, `-e msg|rdm`, `-d <domain>`, `-I <iterations>`,
//! `-S <size>|all` (default: 64, 256, 1k, 4k, 64k, 1m), `-c` (check data),
//! `-m msg|tagged`, `-v`. `rma-bw` adds `-o write|read|writedata` and `-W <window>`
//! (as `fi_rma_bw`). `compare` adds `-r <repeats>` (paired runs, order alternating; it
//! prints the best of each tool, their ratio, and the median of the paired ratios) and
//! `-a <server_cpu>,<client_cpu>` (pin both tools' processes alike with `taskset`).
//!
//! Addresses and keys are exchanged over a TCP control connection, as `fi_pingpong` does.

use fabric::{
    Access, Address, AddressVector, AvType, Caps, Completion, CompletionQueue, CqFormat, Domain,
    Endpoint, EndpointBuilder, EndpointType, Error, EventQueue, Fabric, Info, InfoBuilder,
    PassiveEndpoint, RegisteredBuffer, RemoteMemory,
};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

const DEFAULT_PORT: u16 = 47592;
const DEFAULT_SIZES: [usize; 6] = [64, 256, 1024, 4096, 65536, 1 << 20];
const MAX_POWER_TWO: u32 = 22;
/// Untimed operations before each rma-bw size, as fabtests' warm-up.
const WARMUP: usize = 10;

#[derive(Debug, Clone)]
struct Opts {
    src_port: u16,
    dst_port: u16,
    provider: Option<String>,
    ep_type: EndpointType,
    domain: Option<String>,
    iterations: usize,
    sizes: Vec<usize>,
    check: bool,
    tagged: bool,
    verbose: bool,
    op: RmaOp,
    window: usize,
    repeats: usize,
    pin: Option<(String, String)>,
    dst_addr: Option<String>,
    iterations_given: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RmaOp {
    Write,
    Read,
    WriteData,
}

fn usage() -> &'static str {
    "usage:
  fabric-bench pingpong [OPTIONS]             start server
  fabric-bench pingpong [OPTIONS] <srv_addr>  connect to server
  fabric-bench rma-bw [OPTIONS] [<srv_addr>]  RMA bandwidth (fi_rma_bw)
  fabric-bench compare [OPTIONS]              fi_pingpong vs ours on 127.0.0.1, ratio per size

Options:
 -B <src_port>   source control port number (server: 47592, client: auto)
 -P <dst_port>   destination control port number (client: 47592)
 -d <domain>     domain name
 -p <provider>   specific provider name eg tcp, tcp;ofi_rxm, sockets, shm
 -e <ep_type>    endpoint type: msg|rdm
 -I <number>     number of iterations (pingpong 10, rma-bw 1000)
 -S <size>       specific transfer size or 'all' (default 64,256,1k,4k,64k,1m; comma list ok)
 -c              enables data_integrity checks
 -m <mode>       transmit mode type: msg|tagged (msg)
 -o <op>         rma-bw operation: write|read|writedata (write)
 -W <window>     rma-bw window size (64)
 -r <repeats>    compare: paired runs per size (3)
 -a <s>,<c>      compare: pin servers to CPU s and clients to CPU c (taskset)
 -v              enable debugging output
 -h              display this help output"
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim().to_ascii_lowercase();
    let (num, mult) = match s.chars().last() {
        Some('k') => (&s[..s.len() - 1], 1 << 10),
        Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('g') => (&s[..s.len() - 1], 1 << 30),
        _ => (&s[..], 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|e| format!("bad size `{s}`: {e}"))
}

fn all_sizes() -> Vec<usize> {
    let mut out = vec![1];
    for i in 1..=MAX_POWER_TWO {
        let p = 1usize << i;
        out.push(p);
        out.push(p + p / 2);
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn parse_opts(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        src_port: DEFAULT_PORT,
        dst_port: DEFAULT_PORT,
        provider: None,
        ep_type: EndpointType::RDM,
        domain: None,
        iterations: 10,
        sizes: DEFAULT_SIZES.to_vec(),
        check: false,
        tagged: false,
        verbose: false,
        op: RmaOp::Write,
        window: 64,
        repeats: 3,
        pin: None,
        dst_addr: None,
        iterations_given: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            "-B" => o.src_port = val()?.parse().map_err(|e| format!("-B: {e}"))?,
            "-P" => o.dst_port = val()?.parse().map_err(|e| format!("-P: {e}"))?,
            "-p" => o.provider = Some(val()?),
            "-d" => o.domain = Some(val()?),
            "-e" => {
                o.ep_type = match val()?.as_str() {
                    "msg" => EndpointType::MSG,
                    "rdm" => EndpointType::RDM,
                    other => return Err(format!("-e {other}: msg or rdm")),
                }
            }
            "-I" => {
                o.iterations = val()?.parse().map_err(|e| format!("-I: {e}"))?;
                o.iterations_given = true;
            }
            "-S" => {
                let v = val()?;
                o.sizes = if v == "all" {
                    all_sizes()
                } else {
                    v.split(',').map(parse_size).collect::<Result<_, _>>()?
                };
            }
            "-c" => o.check = true,
            "-v" => o.verbose = true,
            "-m" => {
                o.tagged = match val()?.as_str() {
                    "msg" => false,
                    "tagged" => true,
                    other => return Err(format!("-m {other}: msg or tagged")),
                }
            }
            "-o" => {
                o.op = match val()?.as_str() {
                    "write" => RmaOp::Write,
                    "read" => RmaOp::Read,
                    "writedata" => RmaOp::WriteData,
                    other => return Err(format!("-o {other}: write, read or writedata")),
                }
            }
            "-W" => o.window = val()?.parse().map_err(|e| format!("-W: {e}"))?,
            "-r" => o.repeats = val()?.parse().map_err(|e| format!("-r: {e}"))?,
            "-a" => {
                let v = val()?;
                let (s, c) = v.split_once(',').ok_or("-a <server_cpu>,<client_cpu>")?;
                o.pin = Some((s.to_owned(), c.to_owned()));
            }
            "-h" => return Err(String::new()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s => o.dst_addr = Some(s.to_owned()),
        }
    }
    if o.window == 0 {
        return Err("-W must be > 0".into());
    }
    Ok(o)
}

// ---- output, as fi_pingpong / fabtests -------------------------------------------------

fn size_str(size: u64) -> String {
    let (base, mag) = if size >= 1 << 30 {
        (1u64 << 30, "g")
    } else if size >= 1 << 20 {
        (1 << 20, "m")
    } else if size >= 1 << 10 {
        (1 << 10, "k")
    } else {
        (1, "")
    };
    let fraction = if size / base < 10 {
        (size % base) * 10 / base
    } else {
        0
    };
    if fraction != 0 {
        format!("{}.{}{}", size / base, fraction, mag)
    } else {
        format!("{}{}", size / base, mag)
    }
}

fn cnt_str(cnt: u64) -> String {
    if cnt >= 1_000_000_000 {
        format!("{}b", cnt / 1_000_000_000)
    } else if cnt >= 1_000_000 {
        format!("{}m", cnt / 1_000_000)
    } else if cnt >= 1000 {
        format!("{}k", cnt / 1000)
    } else {
        cnt.to_string()
    }
}

/// `fi_pingpong`'s show_perf (xfers_per_iter = 2).
fn show_pingpong(header: &mut bool, tsize: usize, sent: u64, acked: u64, elapsed: Duration) {
    if *header {
        println!(
            "{:<8}{:<8}{:<9}{:<8}{:>8} {:>10}{:>13}{:>13}",
            "bytes", "#sent", "#ack", "total", "time", "MB/sec", "usec/xfer", "Mxfers/sec"
        );
        *header = false;
    }
    let us = elapsed.as_secs_f64() * 1e6;
    let bytes = sent * tsize as u64 * 2;
    let ack = if sent == acked {
        format!("={}", cnt_str(acked))
    } else if sent < acked {
        format!("-{}", cnt_str(acked - sent))
    } else {
        format!("+{}", cnt_str(sent - acked))
    };
    let usec_per_xfer = us / sent as f64 / 2.0;
    println!(
        "{:<8}{:<8}{:<9}{:<8}{:>8.2}s{:>10.2}{:>11.2}{:>11.2}",
        size_str(tsize as u64),
        cnt_str(sent),
        ack,
        size_str(bytes),
        us / 1e6,
        bytes as f64 / us,
        usec_per_xfer,
        1.0 / usec_per_xfer
    );
}

/// fabtests' show_perf (xfers_per_iter = 1), as `fi_rma_bw` prints it.
fn show_bw(header: &mut bool, tsize: usize, iters: u64, elapsed: Duration) {
    if *header {
        println!(
            "{:<8}{:<8}{:<8}{:>8} {:>10}{:>13}{:>13}",
            "bytes", "iters", "total", "time", "MB/sec", "usec/xfer", "Mxfers/sec"
        );
        *header = false;
    }
    let us = elapsed.as_secs_f64() * 1e6;
    let bytes = iters * tsize as u64;
    let usec_per_xfer = us / iters as f64;
    println!(
        "{:<8}{:<8}{:<8}{:>8.2}s{:>10.2}{:>11.2}{:>11.2}",
        size_str(tsize as u64),
        cnt_str(iters),
        size_str(bytes),
        us / 1e6,
        bytes as f64 / us,
        usec_per_xfer,
        1.0 / usec_per_xfer
    );
}

// ---- control channel --------------------------------------------------------------------

struct Ctrl(TcpStream);

impl Ctrl {
    fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.0.write_all(&(bytes.len() as u32).to_le_bytes())?;
        self.0.write_all(bytes)?;
        self.0.flush()
    }
    fn recv(&mut self) -> std::io::Result<Vec<u8>> {
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len)?;
        let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
        self.0.read_exact(&mut buf)?;
        Ok(buf)
    }
    fn send_u64(&mut self, v: u64) -> std::io::Result<()> {
        self.send(&v.to_le_bytes())
    }
    fn recv_u64(&mut self) -> std::io::Result<u64> {
        let b = self.recv()?;
        let arr: [u8; 8] = b
            .as_slice()
            .try_into()
            .map_err(|_| std::io::Error::other("bad u64"))?;
        Ok(u64::from_le_bytes(arr))
    }
    /// A barrier: both sides send and receive one message.
    fn sync(&mut self) -> std::io::Result<()> {
        self.send(b"q")?;
        self.recv().map(drop)
    }
}

fn ctrl_connect(o: &Opts) -> Result<Ctrl, Box<dyn std::error::Error>> {
    match &o.dst_addr {
        Some(host) => {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match TcpStream::connect((host.as_str(), o.dst_port)) {
                    Ok(s) => {
                        s.set_nodelay(true)?;
                        return Ok(Ctrl(s));
                    }
                    Err(e) if Instant::now() < deadline => {
                        if o.verbose {
                            eprintln!("control connect: {e}; retrying");
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        None => {
            let listener = TcpListener::bind(("127.0.0.1", o.src_port))?;
            let (s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            Ok(Ctrl(s))
        }
    }
}

// ---- fabric setup -----------------------------------------------------------------------

struct Conn {
    _fabric: Fabric,
    ep: Endpoint,
    tx_cq: CompletionQueue,
    rx_cq: CompletionQueue,
    _av: Option<AddressVector>,
    peer: Address,
    info: Info,
}

fn hints(o: &Opts, caps: Caps) -> InfoBuilder {
    let mut b = InfoBuilder::new().ep_type(o.ep_type).caps(caps);
    if let Some(p) = &o.provider {
        b = b.provider(p);
    }
    if let Some(d) = &o.domain {
        b = b.domain_name(d);
    }
    if o.provider.as_deref() != Some("shm") {
        b = b.node("127.0.0.1").source(true);
    }
    b
}

fn open_endpoint(
    fabric: &Fabric,
    info: &Info,
    eq: Option<&EventQueue>,
    av: bool,
) -> fabric::Result<(
    Endpoint,
    CompletionQueue,
    CompletionQueue,
    Option<AddressVector>,
)> {
    // Busy polling: no background progress thread.
    let domain = Domain::with_progress_interval(fabric, info, None)?;
    // The context-only format, as fi_pingpong uses: nothing else is read.
    let tx_cq = CompletionQueue::builder()
        .size(1024)
        .format(CqFormat::Context)
        .open(&domain)?;
    let rx_cq = CompletionQueue::builder()
        .size(1024)
        .format(CqFormat::Context)
        .open(&domain)?;
    let av = if av {
        Some(AddressVector::new(&domain, AvType::Table, 2)?)
    } else {
        None
    };
    let mut b = EndpointBuilder::new(&domain, info)
        .tx_cq(&tx_cq)
        .rx_cq(&rx_cq);
    if let Some(av) = &av {
        b = b.av(av);
    }
    if let Some(eq) = eq {
        b = b.eq(eq);
    }
    Ok((b.build()?, tx_cq, rx_cq, av))
}

/// Sets up the fabric connection and exchanges addresses over `ctrl`.
fn connect(o: &Opts, ctrl: &mut Ctrl, caps: Caps) -> Result<Conn, Box<dyn std::error::Error>> {
    let server = o.dst_addr.is_none();
    let info = hints(o, caps).get_first()?;
    if o.verbose {
        eprintln!("{info}");
    }
    let fabric = Fabric::new(&info)?;
    if o.ep_type == EndpointType::RDM {
        let (ep, tx_cq, rx_cq, av) = open_endpoint(&fabric, &info, None, true)?;
        ctrl.send(&ep.name()?)?;
        let peer_name = ctrl.recv()?;
        let peer = av.as_ref().expect("rdm av").insert(&peer_name)?;
        return Ok(Conn {
            _fabric: fabric,
            ep,
            tx_cq,
            rx_cq,
            _av: av,
            peer,
            info,
        });
    }
    let eq = EventQueue::new(&fabric)?;
    if server {
        let pep = PassiveEndpoint::listen(&fabric, &info, &eq)?;
        ctrl.send(&pep.name()?)?;
        let request = pep.wait_connreq(Duration::from_secs(30))?;
        let (ep, tx_cq, rx_cq, av) = open_endpoint(&fabric, &request, Some(&eq), false)?;
        ep.accept()?;
        // The client's side of the handshake runs in its own process.
        ep.wait_connected(Duration::from_secs(30))?;
        Ok(Conn {
            _fabric: fabric,
            ep,
            tx_cq,
            rx_cq,
            _av: av,
            peer: Address::UNSPEC,
            info: request,
        })
    } else {
        let addr = ctrl.recv()?;
        let (ep, tx_cq, rx_cq, av) = open_endpoint(&fabric, &info, Some(&eq), false)?;
        ep.connect(&addr)?;
        ep.wait_connected(Duration::from_secs(30))?;
        Ok(Conn {
            _fabric: fabric,
            ep,
            tx_cq,
            rx_cq,
            _av: av,
            peer: Address::UNSPEC,
            info,
        })
    }
}

/// Spins on `cq` until one completion arrives.
#[inline]
fn wait_one(cq: &CompletionQueue) -> fabric::Result<Completion> {
    let mut c = [Completion::default(); 1];
    loop {
        if cq.read(&mut c)? == 1 {
            return Ok(c[0]);
        }
    }
}

/// Posts with `post`; while the provider answers EAGAIN, reaps `cq` (progressing it) and
/// counts the reaped completions off `pending`.
#[inline]
fn post_retry(
    cq: &CompletionQueue,
    mut post: impl FnMut() -> fabric::Result<()>,
    pending: &mut u64,
) -> fabric::Result<()> {
    loop {
        match post() {
            Err(Error::WouldBlock { .. }) => {
                if *pending > 0 {
                    let mut c = [Completion::default(); 16];
                    let want = (*pending).min(16) as usize;
                    *pending -= cq.read(&mut c[..want])? as u64;
                } else {
                    cq.progress();
                }
            }
            other => return other,
        }
    }
}

/// Reaps `cq` until `pending` completions have arrived.
#[inline]
fn drain(cq: &CompletionQueue, pending: &mut u64) -> fabric::Result<()> {
    let mut c = [Completion::default(); 16];
    while *pending > 0 {
        let want = (*pending).min(16) as usize;
        *pending -= cq.read(&mut c[..want])? as u64;
    }
    Ok(())
}

// ---- pingpong -----------------------------------------------------------------------------

fn fill(buf: &mut RegisteredBuffer, size: usize, seed: u8) {
    let s = buf.as_mut_slice().expect("idle buffer");
    for (i, b) in s[..size].iter_mut().enumerate() {
        *b = (i as u8).wrapping_add(seed);
    }
}

fn pingpong(o: &Opts) -> Result<(), Box<dyn std::error::Error>> {
    let mut ctrl = ctrl_connect(o)?;
    let client = o.dst_addr.is_some();
    let caps = if o.tagged { Caps::TAGGED } else { Caps::MSG };
    // Declared before the connection so they are dropped after it: the last posted
    // receive is still outstanding when the run ends, and the endpoint must be closed
    // before the memory it may write goes.
    let (mut tx, rx): (RegisteredBuffer, RegisteredBuffer);
    let c = connect(o, &mut ctrl, caps)?;
    // The client's iterations and sizes rule, as both sides print them.
    let (iters, sizes) = if client {
        ctrl.send_u64(o.iterations as u64)?;
        ctrl.send(
            &o.sizes
                .iter()
                .flat_map(|s| (*s as u64).to_le_bytes())
                .collect::<Vec<u8>>(),
        )?;
        (o.iterations, o.sizes.clone())
    } else {
        let iters = ctrl.recv_u64()? as usize;
        let raw = ctrl.recv()?;
        let sizes = raw
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()) as usize)
            .collect();
        (iters, sizes)
    };
    let max = sizes.iter().copied().max().unwrap_or(1).max(64);
    if max > c.info.max_msg_size() {
        return Err(format!(
            "size {max} exceeds the provider's max_msg_size {}",
            c.info.max_msg_size()
        )
        .into());
    }
    tx = c.ep.alloc_registered(max, Access::SEND | Access::RECV)?;
    rx = c.ep.alloc_registered(max, Access::SEND | Access::RECV)?;
    let inject_size = c.info.inject_size();
    let (ep, peer) = (&c.ep, c.peer);
    // Receives are never reaped while posting (that would eat the reply): on EAGAIN the
    // receive queue is only progressed.
    let post_rx = || -> fabric::Result<()> {
        let mut none = 0u64;
        let pending = &mut none;
        post_retry(
            &c.rx_cq,
            || {
                // SAFETY: rx outlives the endpoint (declared before it), so a receive still
                // posted at the end cannot write freed memory; it is not read while a
                // receive is outstanding except after that receive's completion.
                unsafe {
                    if o.tagged {
                        ep.trecv_raw(
                            rx.as_ptr() as *mut u8,
                            max,
                            Some(rx.mr()),
                            Address::UNSPEC,
                            0x1234,
                            0,
                            2,
                        )
                    } else {
                        ep.recv_raw(
                            rx.as_ptr() as *mut u8,
                            max,
                            Some(rx.mr()),
                            Address::UNSPEC,
                            2,
                        )
                    }
                }
            },
            pending,
        )
    };
    let mut header = true;
    post_rx()?;
    let mut tx_pending = 0u64;
    for &size in &sizes {
        if o.check {
            fill(&mut tx, size, size as u8);
        }
        ctrl.sync()?;
        // A send's completion is reaped right after posting, as fi_pingpong does: on tcp,
        // reaping it later (while polling for the reply) measured ~15% slower at 4 KiB.
        let tx_once = |tx_pending: &mut u64| -> fabric::Result<()> {
            if size < inject_size {
                post_retry(
                    &c.tx_cq,
                    || {
                        if o.tagged {
                            ep.tinject(&tx.as_slice()[..size], peer, 0x1234)
                        } else {
                            ep.inject(&tx.as_slice()[..size], peer)
                        }
                    },
                    tx_pending,
                )
            } else {
                drain(&c.tx_cq, tx_pending)?;
                post_retry(
                    &c.tx_cq,
                    // SAFETY: tx outlives the operation (its completion is reaped before
                    // the buffer is written again or dropped) and is not written meanwhile.
                    || unsafe {
                        if o.tagged {
                            ep.tsend_raw(tx.as_ptr(), size, Some(tx.mr()), peer, 0x1234, 1)
                        } else {
                            ep.send_raw(tx.as_ptr(), size, Some(tx.mr()), peer, 1)
                        }
                    },
                    tx_pending,
                )?;
                *tx_pending += 1;
                drain(&c.tx_cq, tx_pending)
            }
        };
        let start = Instant::now();
        let mut acked = 0u64;
        for _ in 0..iters {
            if client {
                tx_once(&mut tx_pending)?;
                wait_one(&c.rx_cq)?;
                if o.check && rx.to_vec_volatile()[..size] != tx.as_slice()[..size] {
                    return Err(format!("data check failed at size {size}").into());
                }
                post_rx()?;
                acked += 1;
            } else {
                wait_one(&c.rx_cq)?;
                post_rx()?;
                acked += 1;
                tx_once(&mut tx_pending)?;
            }
        }
        drain(&c.tx_cq, &mut tx_pending)?;
        let elapsed = start.elapsed();
        show_pingpong(&mut header, size, iters as u64, acked, elapsed);
    }
    ctrl.sync()?;
    Ok(())
}

// ---- rma-bw -------------------------------------------------------------------------------

fn rma_bw(o: &Opts) -> Result<(), Box<dyn std::error::Error>> {
    let mut ctrl = ctrl_connect(o)?;
    let client = o.dst_addr.is_some();
    let c = connect(o, &mut ctrl, Caps::MSG | Caps::RMA)?;
    let iters = if o.iterations_given {
        o.iterations
    } else {
        1000
    };
    let max = o.sizes.iter().copied().max().unwrap_or(1);
    let buf = c.ep.alloc_registered(max, Access::ALL)?;
    ctrl.send(&buf.remote().to_bytes())?;
    let remote = RemoteMemory::from_bytes(&ctrl.recv()?)?;
    let mut header = true;
    let ep = &c.ep;
    for &size in &o.sizes {
        ctrl.sync()?;
        if client {
            // Warm-up (as fabtests: 10 operations, untimed), then the timed run.
            let mut outstanding = 0u64;
            let mut done = 0u64;
            let mut cbuf = [Completion::default(); 64];
            let mut start = Instant::now();
            for i in 0..WARMUP + iters {
                if i == WARMUP {
                    while done < outstanding {
                        done += c.tx_cq.read(&mut cbuf)? as u64;
                    }
                    start = Instant::now();
                }
                let post = || {
                    // SAFETY: buf outlives every operation: all completions are reaped
                    // before the next size and before it is dropped.
                    unsafe {
                        match o.op {
                            RmaOp::Write => ep.write_raw(
                                buf.as_ptr(),
                                size,
                                Some(buf.mr()),
                                c.peer,
                                remote.address_at(0),
                                remote.key,
                                i as u64,
                            ),
                            RmaOp::Read => ep.read_raw(
                                buf.as_ptr() as *mut u8,
                                size,
                                Some(buf.mr()),
                                c.peer,
                                remote.address_at(0),
                                remote.key,
                                i as u64,
                            ),
                            RmaOp::WriteData => ep.writedata_raw(
                                buf.as_ptr(),
                                size,
                                Some(buf.mr()),
                                i as u64,
                                c.peer,
                                remote.address_at(0),
                                remote.key,
                                i as u64,
                            ),
                        }
                    }
                };
                loop {
                    match post() {
                        Ok(()) => break,
                        Err(Error::WouldBlock { .. }) => {
                            done += c.tx_cq.read(&mut cbuf)? as u64;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                outstanding += 1;
                if outstanding - done >= o.window as u64 {
                    while outstanding - done >= o.window as u64 {
                        done += c.tx_cq.read(&mut cbuf)? as u64;
                    }
                }
            }
            while done < outstanding {
                done += c.tx_cq.read(&mut cbuf)? as u64;
            }
            let elapsed = start.elapsed();
            ctrl.send(b"done")?;
            show_bw(&mut header, size, iters as u64, elapsed);
        } else {
            // The target progresses (manual-progress providers) until the initiator is done;
            // with writedata it also counts the remote CQ data completions.
            ctrl.0.set_nonblocking(true)?;
            let mut got = 0u64;
            let mut cbuf = [Completion::default(); 64];
            let start = Instant::now();
            loop {
                got += c.rx_cq.read(&mut cbuf)? as u64;
                c.tx_cq.progress();
                let mut probe = [0u8; 1];
                match ctrl.0.peek(&mut probe) {
                    Ok(n) if n > 0 => break,
                    Ok(_) => return Err("control connection closed".into()),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e.into()),
                }
            }
            ctrl.0.set_nonblocking(false)?;
            ctrl.recv()?;
            if o.op == RmaOp::WriteData {
                while got < (WARMUP + iters) as u64 {
                    got += c.rx_cq.read(&mut cbuf)? as u64;
                }
            }
            let _ = start;
        }
    }
    ctrl.sync()?;
    Ok(())
}

// ---- compare -----------------------------------------------------------------------------

/// The MB/sec column of the client's result lines, per size.
fn parse_mbps(out: &str) -> Vec<(String, f64)> {
    out.lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            if cols.len() >= 8 && cols[0] != "bytes" {
                cols[5].parse::<f64>().ok().map(|v| (cols[0].to_owned(), v))
            } else {
                None
            }
        })
        .collect()
}

fn run_pair(
    server: &mut Command,
    client: &mut Command,
) -> Result<String, Box<dyn std::error::Error>> {
    let mut srv = server.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = client.stderr(Stdio::inherit()).output();
    let deadline = Instant::now() + Duration::from_secs(20);
    while srv.try_wait()?.is_none() {
        if Instant::now() > deadline {
            let _ = srv.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = srv.wait();
    let out = out?;
    if !out.status.success() {
        return Err(format!("client failed: {}", out.status).into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn compare(o: &Opts) -> Result<(), Box<dyn std::error::Error>> {
    let prov = o.provider.clone().unwrap_or_else(|| "tcp".into());
    let ep = if o.ep_type == EndpointType::MSG {
        "msg"
    } else {
        "rdm"
    };
    let iters = if o.iterations_given {
        o.iterations
    } else {
        1000
    };
    let me = std::env::current_exe()?;
    // The same placement for both tools: taskset -c CPU PROGRAM ARGS...
    let cmd = |program: &std::path::Path, cpu: Option<&String>| match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", cpu.as_str()]).arg(program);
            c
        }
        None => Command::new(program),
    };
    let (srv_cpu, cli_cpu) = match &o.pin {
        Some((s, c)) => (Some(s), Some(c)),
        None => (None, None),
    };
    let fi_pingpong = std::path::Path::new("fi_pingpong");
    println!(
        "provider {prov}, ep {ep}, {iters} iterations, {} paired runs per size (order alternating)",
        o.repeats
    );
    println!(
        "{:<8}{:>14}{:>14}{:>12}{:>14}",
        "bytes", "fi_pingpong", "fabric-bench", "best/best", "median pair"
    );
    let mut port = 47700u16;
    for &size in &o.sizes {
        let s = size.to_string();
        let (mut theirs, mut ours) = (0f64, 0f64);
        let mut pairs = Vec::with_capacity(o.repeats);
        for r in 0..o.repeats {
            port += 2;
            let common = [
                "-p",
                prov.as_str(),
                "-e",
                ep,
                "-S",
                s.as_str(),
                "-I",
                &iters.to_string(),
            ]
            .map(String::from);
            let theirs_port = port.to_string();
            let ours_port = (port + 1).to_string();
            let run_theirs = || -> Result<f64, Box<dyn std::error::Error>> {
                let out = run_pair(
                    cmd(fi_pingpong, srv_cpu)
                        .args(&common)
                        .args(["-B", &theirs_port]),
                    cmd(fi_pingpong, cli_cpu)
                        .args(&common)
                        .args(["-P", &theirs_port, "127.0.0.1"]),
                )?;
                Ok(parse_mbps(&out).first().map_or(0.0, |(_, v)| *v))
            };
            let run_ours = || -> Result<f64, Box<dyn std::error::Error>> {
                let out = run_pair(
                    cmd(&me, srv_cpu)
                        .arg("pingpong")
                        .args(&common)
                        .args(["-B", &ours_port]),
                    cmd(&me, cli_cpu).arg("pingpong").args(&common).args([
                        "-P",
                        &ours_port,
                        "127.0.0.1",
                    ]),
                )?;
                Ok(parse_mbps(&out).first().map_or(0.0, |(_, v)| *v))
            };
            let (t, u) = if r % 2 == 0 {
                let t = run_theirs()?;
                (t, run_ours()?)
            } else {
                let u = run_ours()?;
                (run_theirs()?, u)
            };
            theirs = theirs.max(t);
            ours = ours.max(u);
            if t > 0.0 {
                pairs.push(u / t);
            }
        }
        pairs.sort_by(f64::total_cmp);
        let median = pairs.get(pairs.len() / 2).copied().unwrap_or(f64::NAN);
        let ratio = if theirs > 0.0 {
            ours / theirs
        } else {
            f64::NAN
        };
        println!(
            "{:<8}{:>14.2}{:>14.2}{:>11.2}x{:>13.2}x",
            size_str(size as u64),
            theirs,
            ours,
            ratio,
            median
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        eprintln!("{}", usage());
        return ExitCode::from(2);
    };
    let opts = match parse_opts(rest) {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("fabric-bench: {e}");
            }
            eprintln!("{}", usage());
            return ExitCode::from(2);
        }
    };
    let result = match cmd.as_str() {
        "pingpong" => pingpong(&opts),
        "rma-bw" => rma_bw(&opts),
        "compare" => compare(&opts),
        "-h" | "--help" | "help" => {
            println!("{}", usage());
            return ExitCode::SUCCESS;
        }
        other => Err(format!("unknown command `{other}`").into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fabric-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
