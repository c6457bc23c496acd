//! What a test of a connection cap sees of the server it floods: threads of this process
//! by name, and how long the server takes to close a silent or trickling connection.
//! Shared by the VERBS side channel's library test and its guest test (each includes this
//! file as a module of its own).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Threads of this process named `name` (the kernel keeps 15 bytes of a name).
pub fn threads_named(name: &str) -> usize {
    let short = &name.as_bytes()[..name.len().min(15)];
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .flatten()
                .filter(|t| {
                    std::fs::read(t.path().join("comm"))
                        .is_ok_and(|c| c.strip_suffix(b"\n").unwrap_or(&c) == short)
                })
                .count()
        })
        .unwrap_or(0)
}

/// How long until the server closes `stream` (EOF or a reset), sending a byte every
/// 100 ms meanwhile when `trickle`; `None`: still open after `limit`.
pub fn closed_after(mut stream: TcpStream, trickle: bool, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 64];
    while started.elapsed() < limit {
        if trickle && stream.write_all(b"x").is_err() {
            return Some(started.elapsed());
        }
        match stream.read(&mut buf) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => panic!("the server answered a frame that never ended"),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(started.elapsed()),
        }
    }
    None
}
