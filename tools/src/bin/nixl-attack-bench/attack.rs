//! The attackers, each run to its end on threads of the harness: hostile connections to
//! the metadata listener, junk frames, and forged notifications from a raw libfabric
//! endpoint on the target's rail. None of them has an agent.

use crate::wire::{self, frame_header, notification, Rng, FETCH_MD, INVALIDATE, SEND_MD};
use crate::INITIATOR;
use fabric::{
    Address, AddressVector, AvType, Caps, CompletionQueue, CqFormat, Domain, EndpointBuilder,
    EndpointType, Fabric, InfoBuilder,
};
use socket2::{Domain as SockDomain, Protocol, Socket, Type};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an attacker did.
#[derive(Debug, Default, Clone)]
pub(crate) struct AttackReport {
    /// Connections opened, or bytes sent, or messages sent.
    pub(crate) done: u64,
    /// Connections the target's backlog did not take in time, or sends that failed.
    pub(crate) failed: u64,
}

/// Source addresses of the hostile connections: `127.0.0.{2..=251}`, as 250 hosts
/// (the listener's limits are per address and in all). The legitimate probe comes from
/// 127.0.0.1.
fn attacker_ip(k: usize) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 2 + (k % 250) as u8], 0))
}

fn connect_from(from: SocketAddr, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    let socket = Socket::new(SockDomain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    socket.bind(&from.into())?;
    socket.connect_timeout(&to.into(), timeout)?;
    Ok(socket.into())
}

/// `total` hostile connections to the listener at `to`, a third of each kind: opened and
/// closed at once; opened and held silent; opened and fed a request header one byte at a
/// time (slowloris). Held connections stay open until every connection was made and
/// `linger` passed (the target closes what it will meanwhile).
pub(crate) fn connections(to: SocketAddr, total: usize, linger: Duration) -> AttackReport {
    const THREADS: usize = 4;
    let next = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..THREADS)
        .map(|_| {
            let next = next.clone();
            let failed = failed.clone();
            std::thread::spawn(move || {
                let header = frame_header(FETCH_MD, 0, None);
                let mut held = Vec::new();
                let mut slow: Vec<(TcpStream, usize)> = Vec::new();
                let mut last_trickle = Instant::now();
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= total {
                        break;
                    }
                    match connect_from(attacker_ip(k), to, Duration::from_millis(500)) {
                        Ok(s) => match k % 3 {
                            0 => drop(s),
                            1 => held.push(s),
                            _ => {
                                s.set_nonblocking(true).ok();
                                slow.push((s, 0))
                            }
                        },
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if last_trickle.elapsed() >= Duration::from_millis(100) {
                        trickle(&mut slow, &header);
                        last_trickle = Instant::now();
                    }
                }
                let end = Instant::now() + linger;
                while Instant::now() < end {
                    trickle(&mut slow, &header);
                    std::thread::sleep(Duration::from_millis(100));
                }
                drop(held);
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    AttackReport {
        done: total as u64,
        failed: failed.load(Ordering::Relaxed),
    }
}

/// One more header byte on each slow connection (a closed one is dropped).
fn trickle(slow: &mut Vec<(TcpStream, usize)>, header: &[u8]) {
    slow.retain_mut(|(s, at)| {
        let byte = [header[*at % header.len()]];
        match s.write(&byte) {
            Ok(1) => {
                *at += 1;
                true
            }
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
            Ok(_) => false,
        }
    });
}

/// `budget` bytes of junk frames to the listener at `to`, from 8 connections at a time:
/// metadata pushes announcing 1 to 16 MiB (three in four) or 16 to 48 MiB whose payload
/// fails the frame check (the bulk),
/// fetches and invalidations with 64 KiB of junk, pushes announcing more than the
/// listener takes, and plain random bytes. The senders pin themselves to `cpus`, if given.
pub(crate) fn junk(to: SocketAddr, budget: u64, cpus: Option<Vec<usize>>) -> AttackReport {
    const THREADS: usize = 8;
    let sent = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let sent = sent.clone();
            let failed = failed.clone();
            let cpus = cpus.clone();
            std::thread::spawn(move || {
                if let Some(cpus) = &cpus {
                    if let Err(e) = crate::pin_to(cpus) {
                        eprintln!("{}: junk sender: {e}", crate::PROGRAM);
                    }
                }
                let mut rng = Rng(0x6a75_6e6b ^ t as u64);
                let mut chunk = vec![0u8; 256 << 10];
                rng.fill(&mut chunk);
                let mut k = t;
                while sent.load(Ordering::Relaxed) < budget {
                    k += THREADS;
                    let Ok(mut s) = connect_from(attacker_ip(k), to, Duration::from_secs(2)) else {
                        failed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    s.set_write_timeout(Some(Duration::from_secs(5))).ok();
                    let (head, body): (Vec<u8>, u64) = match k % 8 {
                        0 => (Vec::new(), 64 << 10),
                        1 => (frame_header(FETCH_MD, 64 << 10, None).to_vec(), 64 << 10),
                        2 => (frame_header(INVALIDATE, 64 << 10, None).to_vec(), 64 << 10),
                        3 => (frame_header(SEND_MD, u32::MAX, None).to_vec(), 64 << 10),
                        // Most pushes up to 16 MiB, which a listener without a job
                        // token still reads whole; every fourth 16 to 48 MiB.
                        4..=6 => {
                            let len = (1 << 20) + rng.next() % (15 << 20);
                            (frame_header(SEND_MD, len as u32, None).to_vec(), len)
                        }
                        _ => {
                            let len = (16 << 20) + rng.next() % (32 << 20);
                            (frame_header(SEND_MD, len as u32, None).to_vec(), len)
                        }
                    };
                    let mut left = body;
                    let mut ok = s.write_all(&head).is_ok();
                    if ok {
                        sent.fetch_add(head.len() as u64, Ordering::Relaxed);
                    }
                    while ok && left > 0 {
                        let n = left.min(chunk.len() as u64) as usize;
                        match s.write(&chunk[..n]) {
                            Ok(0) | Err(_) => ok = false,
                            Ok(w) => {
                                left -= w as u64;
                                sent.fetch_add(w as u64, Ordering::Relaxed);
                            }
                        }
                    }
                    if !ok && k % 8 >= 4 {
                        // Refused before its end (over the listener's buffer bound).
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    AttackReport {
        done: sent.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
    }
}

/// A raw RDM endpoint on `provider`: no agent, no backend.
struct RawEndpoint {
    ep: fabric::Endpoint,
    av: AddressVector,
    _cq: CompletionQueue,
    _domain: Domain,
    _fabric: Fabric,
}

impl RawEndpoint {
    fn open(provider: &str) -> Result<Self, String> {
        let mut hints = InfoBuilder::new()
            .provider(provider)
            .ep_type(EndpointType::RDM)
            .caps(Caps::MSG | Caps::RMA);
        if provider != "shm" {
            hints = hints.node("127.0.0.1").source(true);
        }
        let e = |what: &str, err: fabric::Error| format!("raw {provider} endpoint: {what}: {err}");
        let info = hints.get_first().map_err(|x| e("fi_getinfo", x))?;
        let fabric = Fabric::new(&info).map_err(|x| e("fabric", x))?;
        let domain = Domain::new(&fabric, &info).map_err(|x| e("domain", x))?;
        let cq = CompletionQueue::builder()
            .format(CqFormat::Data)
            .size(1024)
            .open(&domain)
            .map_err(|x| e("cq", x))?;
        let av = AddressVector::new(&domain, AvType::Map, 8).map_err(|x| e("av", x))?;
        let ep = EndpointBuilder::new(&domain, &info)
            .cq(&cq)
            .av(&av)
            .build()
            .map_err(|x| e("endpoint", x))?;
        Ok(Self {
            ep,
            av,
            _cq: cq,
            _domain: domain,
            _fabric: fabric,
        })
    }
}

/// `total` forged notification messages to the target's rail `rail` (its endpoint name)
/// from a raw endpoint on `provider`, a quarter of each kind: under the legitimate
/// initiator's name (refused: without the initiator's seal, half of them plain and half
/// sealed under a made-up tag and sequence), under strangers' names with nothing to
/// wait for (delivered where the target takes anyone's notifications, `notif_senders=any`),
/// under strangers' names announcing data that never comes (waiting, bounded per
/// sender), and malformed messages.
pub(crate) fn forged_notifications(
    provider: &str,
    rail: &[u8],
    total: u64,
) -> Result<AttackReport, String> {
    let inject_max = 512usize;
    let mut rng = Rng(0xf0f0_4e58);
    let filler = vec![b'x'; 400];
    flood_rail(provider, rail, total, |k| {
        let key = rng.next() >> 1;
        let message = match k % 4 {
            0 if k % 8 == 0 => notification(INITIATOR, key, 0, b"w 0 0 forged"),
            0 => wire::sealed(
                rng.next(),
                &notification(INITIATOR, key, 0, b"w 0 0 forged"),
            ),
            1 => notification(&format!("stranger-{}", k % 64), key, 0, &filler),
            2 => notification(&format!("stranger-{}", k % 64), key, 1 + k % 7, &filler),
            _ => {
                let mut junk = notification("junk", key, 0, &filler);
                junk.truncate(30 + (k as usize % 100));
                let at = 4 + (rng.next() as usize % (junk.len() - 4));
                junk[at] ^= 0xff;
                junk
            }
        };
        debug_assert!(message.len() <= inject_max);
        message
    })
}

/// `total` sealed rail control frames (`NXRS`: a staging OFFER inside, a made-up tag)
/// naming strangers, each under a fresh random public key, to the target's rail `rail`
/// from a raw endpoint on `provider`: a target that agreed on a key with each (an X25519
/// apiece) before finding the tag wrong would fall far behind the flood.
pub(crate) fn forged_control_frames(
    provider: &str,
    rail: &[u8],
    total: u64,
) -> Result<AttackReport, String> {
    let mut rng = Rng(0xc0_4e7a_1f00);
    flood_rail(provider, rail, total, |k| {
        let mut public = [0u8; 32];
        rng.fill(&mut public);
        wire::control_frame(
            rng.next() >> 8,
            &public,
            &format!("stranger-{}", k % 64),
            b"NXST forged offer",
        )
    })
}

/// Injects `message(k)` for each `k` below `total` into the target's rail `rail` (its
/// endpoint name) from a raw endpoint on `provider`, each retried for up to 10 s while
/// the rail is busy; counts what went and what did not.
fn flood_rail(
    provider: &str,
    rail: &[u8],
    total: u64,
    mut message: impl FnMut(u64) -> Vec<u8>,
) -> Result<AttackReport, String> {
    let raw = RawEndpoint::open(provider)?;
    let dest: Address = raw
        .av
        .insert(rail)
        .map_err(|e| format!("inserting the target's rail: {e}"))?;
    let mut report = AttackReport::default();
    for k in 0..total {
        let message = message(k);
        let deadline = Instant::now() + Duration::from_secs(10);
        match raw.ep.retry(deadline, || raw.ep.inject(&message, dest)) {
            Ok(()) => report.done += 1,
            Err(_) => report.failed += 1,
        }
    }
    Ok(report)
}

/// Whether the listener at `to` still answers a fetch from 127.0.0.1 within `timeout`;
/// how long it took.
pub(crate) fn probe(to: SocketAddr, timeout: Duration) -> Result<Duration, String> {
    let start = Instant::now();
    wire::fetch_metadata(to, timeout).map(|_| start.elapsed())
}
