//! The peer process of the examples that measure cross-process GPU copies: this
//! executable re-run with `--exporter SIZE` allocates a buffer, prints its CUDA-IPC
//! handle and lives until its stdin closes. Included with `#[path]` by each example.

use gpunetio::{DeviceBuffer, Gpu, IpcHandle};
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};

/// If this process was started as an exporter (`--exporter SIZE`), runs it and returns
/// true.
pub fn run_if_exporter(args: &[String], parse_size: impl Fn(&str) -> usize) -> bool {
    if args.first().map(String::as_str) != Some("--exporter") {
        return false;
    }
    exporter(parse_size(&args[1]));
    true
}

/// The exporting process: allocates, prints its IPC handle, waits for stdin to close.
fn exporter(size: usize) {
    let gpu = Gpu::open(0).expect("GPU 0");
    let buf = DeviceBuffer::alloc(&gpu, size).expect("device buffer");
    buf.fill(7).expect("fill");
    let handle = buf.export_ipc().expect("export");
    let hex: String = handle
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("{hex}");
    std::io::stdout().flush().expect("stdout");
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
}

pub struct Exporter {
    child: std::process::Child,
    pub handle: IpcHandle,
}

impl Exporter {
    pub fn start(size: usize) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .args(["--exporter", &size.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn exporter");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("exporter's handle");
        let bytes: Vec<u8> = (0..64)
            .map(|i| u8::from_str_radix(&line.trim()[2 * i..2 * i + 2], 16).expect("hex"))
            .collect();
        Self {
            child,
            handle: IpcHandle::from_bytes(&bytes).expect("64 bytes"),
        }
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}
