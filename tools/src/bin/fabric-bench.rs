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

use clap::{Args, Parser, Subcommand};
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RmaOp {
    Write,
    Read,
    #[value(name = "writedata")]
    WriteData,
}

/// libfabric benchmarks with the options and output columns of fi_pingpong and fi_rma_bw
#[derive(Parser, Debug)]
#[command(
    name = "fabric-bench",
    version,
    subcommand_required = true,
    max_term_width = 100,
    after_help = "Without <srv_addr> pingpong and rma-bw are the server (waiting on -B); with it, \
the client. RUST_LOG sets the libraries' log (default: warnings)."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Message ping-pong (fi_pingpong)
    Pingpong {
        #[command(flatten)]
        common: Common,
        /// The server to connect to (none: be the server)
        #[arg(value_name = "srv_addr")]
        dst_addr: Option<String>,
    },
    /// RMA bandwidth (fi_rma_bw)
    #[command(name = "rma-bw")]
    RmaBw {
        #[command(flatten)]
        common: Common,
        /// RMA operation
        #[arg(short = 'o', value_name = "op", value_enum, default_value_t = RmaOp::Write)]
        op: RmaOp,
        /// Operations in flight
        #[arg(short = 'W', value_name = "window", default_value_t = 64, value_parser = positive)]
        window: usize,
        /// The server to connect to (none: be the server)
        #[arg(value_name = "srv_addr")]
        dst_addr: Option<String>,
    },
    /// fi_pingpong and ours on 127.0.0.1, paired runs, ours/theirs per size
    Compare {
        #[command(flatten)]
        common: Common,
        /// Paired runs per size (order alternating)
        #[arg(short = 'r', value_name = "repeats", default_value_t = 3, value_parser = positive)]
        repeats: usize,
        /// Pin servers to CPU s and clients to CPU c (taskset)
        #[arg(short = 'a', value_name = "s,c", value_parser = cpu_pair)]
        pin: Option<(String, String)>,
    },
}

/// fi_pingpong's options.
#[derive(Args, Debug, Clone)]
struct Common {
    /// Source control port number (server)
    #[arg(short = 'B', value_name = "src_port", default_value_t = DEFAULT_PORT)]
    src_port: u16,
    /// Destination control port number (client)
    #[arg(short = 'P', value_name = "dst_port", default_value_t = DEFAULT_PORT)]
    dst_port: u16,
    /// Specific provider name, e.g. tcp, tcp;ofi_rxm, sockets, shm
    #[arg(short = 'p', value_name = "provider")]
    provider: Option<String>,
    /// Endpoint type
    #[arg(short = 'e', value_name = "ep_type", value_enum, default_value_t = EpType::Rdm)]
    ep_type: EpType,
    /// Domain name
    #[arg(short = 'd', value_name = "domain")]
    domain: Option<String>,
    /// Number of iterations [default: pingpong 10, rma-bw and compare 1000]
    #[arg(short = 'I', value_name = "number", value_parser = positive)]
    iterations: Option<usize>,
    /// Transfer size, comma list (k, m, g suffixes), or 'all' [default: 64,256,1k,4k,64k,1m]
    #[arg(short = 'S', value_name = "size", value_parser = parse_sizes)]
    sizes: Option<Sizes>,
    /// Enable data integrity checks
    #[arg(short = 'c')]
    check: bool,
    /// Transmit mode type
    #[arg(short = 'm', value_name = "mode", value_enum, default_value_t = Mode::Msg)]
    mode: Mode,
    /// Enable debugging output
    #[arg(short = 'v')]
    verbose: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum EpType {
    Msg,
    Rdm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    Msg,
    Tagged,
}

/// `-S`'s sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Sizes(Vec<usize>);

fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{text}` is not a whole number")),
    }
}

fn parse_sizes(text: &str) -> Result<Sizes, String> {
    if text == "all" {
        return Ok(Sizes(all_sizes()));
    }
    text.split(',')
        .map(|s| match tools::units::parse_size_usize(s)? {
            0 => Err("sizes must be at least 1 byte".to_string()),
            n => Ok(n),
        })
        .collect::<Result<_, _>>()
        .map(Sizes)
}

fn cpu_pair(text: &str) -> Result<(String, String), String> {
    match text.split_once(',') {
        Some((s, c)) if !s.is_empty() && !c.is_empty() => Ok((s.to_owned(), c.to_owned())),
        _ => Err(format!("`{text}` is not <server_cpu>,<client_cpu>")),
    }
}

impl Common {
    fn into_opts(self, dst_addr: Option<String>) -> Opts {
        Opts {
            src_port: self.src_port,
            dst_port: self.dst_port,
            provider: self.provider,
            ep_type: match self.ep_type {
                EpType::Msg => EndpointType::MSG,
                EpType::Rdm => EndpointType::RDM,
            },
            domain: self.domain,
            iterations: self.iterations.unwrap_or(10),
            iterations_given: self.iterations.is_some(),
            sizes: self.sizes.map_or_else(|| DEFAULT_SIZES.to_vec(), |s| s.0),
            check: self.check,
            tagged: self.mode == Mode::Tagged,
            verbose: self.verbose,
            op: RmaOp::Write,
            window: 64,
            repeats: 3,
            pin: None,
            dst_addr,
        }
    }
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

/// The providers of this host, by name.
fn provider_names() -> Vec<String> {
    let mut names: Vec<String> = InfoBuilder::new()
        .get()
        .unwrap_or_default()
        .iter()
        .map(|i| i.provider_name().to_string())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The fabric of the run, found before the control connection: a provider that is not
/// there, or offers nothing the run needs, fails here instead of after a peer waited.
fn discover(o: &Opts, caps: Caps) -> Result<Info, Box<dyn std::error::Error>> {
    let err = match hints(o, caps).get_first() {
        Ok(info) => return Ok(info),
        Err(e) => e,
    };
    let Some(wanted) = &o.provider else {
        return Err(err.into());
    };
    let names = provider_names();
    // A layered provider is named with its core: `tcp;ofi_rxm`.
    let known = names
        .iter()
        .any(|n| n == wanted || n.split(';').any(|part| part == wanted));
    let ep = if o.ep_type == EndpointType::MSG {
        "msg"
    } else {
        "rdm"
    };
    if known {
        Err(format!(
            "provider `{wanted}` has no {ep} endpoint for this test ({err}); try -e {}",
            if ep == "msg" { "rdm" } else { "msg" }
        )
        .into())
    } else {
        Err(format!(
            "no provider `{wanted}` on this host; -p takes one of: {}",
            names.join(", ")
        )
        .into())
    }
}

/// Sets up the fabric connection on `info` and exchanges addresses over `ctrl`.
fn connect(o: &Opts, info: Info, ctrl: &mut Ctrl) -> Result<Conn, Box<dyn std::error::Error>> {
    let server = o.dst_addr.is_none();
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
    let caps = if o.tagged { Caps::TAGGED } else { Caps::MSG };
    let info = discover(o, caps)?;
    let mut ctrl = ctrl_connect(o)?;
    let client = o.dst_addr.is_some();
    // Declared before the connection so they are dropped after it: the last posted
    // receive is still outstanding when the run ends, and the endpoint must be closed
    // before the memory it may write goes.
    let (mut tx, rx): (RegisteredBuffer, RegisteredBuffer);
    let c = connect(o, info, &mut ctrl)?;
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
    let info = discover(o, Caps::MSG | Caps::RMA)?;
    let mut ctrl = ctrl_connect(o)?;
    let client = o.dst_addr.is_some();
    let c = connect(o, info, &mut ctrl)?;
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
    tools::cli::init_tracing();
    let cli: Cli = tools::cli::parse_or_exit("fabric-bench");
    let result = match cli.command {
        Cmd::Pingpong { common, dst_addr } => pingpong(&common.into_opts(dst_addr)),
        Cmd::RmaBw {
            common,
            op,
            window,
            dst_addr,
        } => {
            let mut o = common.into_opts(dst_addr);
            o.op = op;
            o.window = window;
            rma_bw(&o)
        }
        Cmd::Compare {
            common,
            repeats,
            pin,
        } => {
            let mut o = common.into_opts(None);
            o.repeats = repeats;
            o.pin = pin;
            compare(&o)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => tools::cli::fail("fabric-bench", e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tools::cli::{try_parse, Stop};

    fn parse(line: &str) -> Result<Cli, Stop> {
        try_parse(
            "fabric-bench",
            std::iter::once("fabric-bench").chain(line.split_whitespace()),
        )
    }

    #[test]
    fn fi_pingpong_options() {
        let Cmd::Pingpong { common, dst_addr } =
            parse("pingpong -B 5000 -P 5001 -p tcp;ofi_rxm -e msg -d lo -I 20 -S 1k,64k -c -m tagged -v 127.0.0.1")
                .unwrap()
                .command
        else {
            panic!("pingpong");
        };
        let o = common.into_opts(dst_addr);
        assert_eq!((o.src_port, o.dst_port), (5000, 5001));
        assert_eq!(o.provider.as_deref(), Some("tcp;ofi_rxm"));
        assert_eq!(o.ep_type, EndpointType::MSG);
        assert_eq!(o.domain.as_deref(), Some("lo"));
        assert_eq!((o.iterations, o.iterations_given), (20, true));
        assert_eq!(o.sizes, vec![1024, 65536]);
        assert!(o.check && o.tagged && o.verbose);
        assert_eq!(o.dst_addr.as_deref(), Some("127.0.0.1"));
        // fi_pingpong's defaults.
        let Cmd::Pingpong { common, dst_addr } = parse("pingpong").unwrap().command else {
            panic!("pingpong");
        };
        let o = common.into_opts(dst_addr);
        assert_eq!(
            (o.src_port, o.iterations, o.iterations_given),
            (47592, 10, false)
        );
        assert_eq!(
            (o.ep_type, o.tagged, o.sizes.len()),
            (EndpointType::RDM, false, 6)
        );
        let Cmd::Pingpong { common, .. } = parse("pingpong -S all").unwrap().command else {
            panic!("pingpong");
        };
        assert_eq!(common.sizes.unwrap().0, all_sizes());
    }

    #[test]
    fn rma_bw_and_compare_options() {
        let Cmd::RmaBw {
            op,
            window,
            dst_addr,
            ..
        } = parse("rma-bw -o writedata -W 8 -p shm host")
            .unwrap()
            .command
        else {
            panic!("rma-bw");
        };
        assert_eq!(
            (op, window, dst_addr.as_deref()),
            (RmaOp::WriteData, 8, Some("host"))
        );
        let Cmd::Compare { repeats, pin, .. } =
            parse("compare -r 5 -a 0,1 -p tcp -S 4k").unwrap().command
        else {
            panic!("compare");
        };
        assert_eq!((repeats, pin), (5, Some(("0".into(), "1".into()))));
    }

    #[test]
    fn wrong_invocations_are_one_line() {
        for (line, want) in [
            ("", "a command is required: pingpong, rma-bw, compare"),
            ("pingpong -e dgram", "dgram"),
            ("pingpong -m stream", "stream"),
            ("pingpong -I 0", "must be at least 1"),
            ("pingpong -S 0", "at least 1 byte"),
            ("pingpong -S 4q", "not a size"),
            ("pingpong -B 99999", "99999"),
            ("pingpong -o read", "unexpected argument '-o'"),
            ("rma-bw -W 0", "must be at least 1"),
            ("rma-bw -o copy", "copy"),
            ("compare -a 1", "<server_cpu>,<client_cpu>"),
            ("compare -r x", "not a whole number"),
            ("ping", "unrecognized subcommand"),
        ] {
            match parse(line) {
                Err(Stop::Usage(e)) => {
                    assert!(!e.contains('\n') && e.contains(want), "{line}: {e}");
                }
                other => panic!("{line}: {other:?}"),
            }
        }
        for line in [
            "--help",
            "-h",
            "pingpong -h",
            "rma-bw --help",
            "--version",
            "-V",
        ] {
            assert!(matches!(parse(line), Err(Stop::Print(_))), "{line}");
        }
    }

    /// A provider that does not exist is refused before the server waits for a client.
    #[test]
    fn unknown_provider_fails_before_waiting() {
        let Cmd::Pingpong { common, dst_addr } =
            parse("pingpong -p nosuchprov -B 1").unwrap().command
        else {
            panic!("pingpong");
        };
        let o = common.into_opts(dst_addr);
        let e = discover(&o, Caps::MSG).unwrap_err().to_string();
        assert!(e.contains("no provider `nosuchprov` on this host"), "{e}");
    }
}
