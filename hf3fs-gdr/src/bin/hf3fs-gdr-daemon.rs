//! `hf3fs-gdr-daemon --mount DIR [--threads N] [--staging-mib M] [--chunk-kib K]
//! [--slots S] [--copy-kib C] [--direct auto|always|never] [--inject-delay-ms D]`:
//! serves a mount directory for `hf3fs-gdr` clients (see `hf3fs_gdr::daemon`). Prints
//! `ready <socket path>` on stdout once it listens.

use hf3fs_gdr::daemon::{run, DaemonConfig};
use std::io::Write;
use std::path::PathBuf;

const USAGE: &str = "usage: hf3fs-gdr-daemon --mount DIR [--threads N] [--staging-mib M] \
[--chunk-kib K] [--slots S] [--copy-kib C] [--direct auto|always|never] [--inject-delay-ms D]
  --threads N        worker threads (default: CPUs, at least 4)
  --staging-mib M    pinned staging memory per GPU (default 256)
  --chunk-kib K      largest piece a worker moves at once (default: staging / (N S),
                     64 to 4096 KiB)
  --slots S          pinned staging slots per worker: device copies in flight while it
                     reads the next chunk (default 2)
  --copy-kib C       GPU iovs, cached data: start a device copy after every C KiB read
                     (a multiple of 4; default 0: one copy per chunk)
  --direct P         O_DIRECT policy: auto (cached data from the page cache, the rest
                     O_DIRECT; default), always, never
  --inject-delay-ms D  fault injection: chunks of files named *.slow wait D ms";

fn parse() -> Result<DaemonConfig, String> {
    let mut mount: Option<PathBuf> = None;
    let mut threads: Option<usize> = None;
    let mut staging_mib: usize = 256;
    let mut chunk_kib: Option<usize> = None;
    let mut slots: Option<usize> = None;
    let mut copy_kib: usize = 0;
    let mut delay_ms: u64 = 0;
    let mut direct = hf3fs_gdr::daemon::DirectPolicy::Auto;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let number = |name: &str, v: String| {
            v.parse::<usize>()
                .map_err(|_| format!("{name}: {v:?} is not a number"))
        };
        match arg.as_str() {
            "--mount" => mount = Some(PathBuf::from(value("--mount")?)),
            "--threads" => threads = Some(number("--threads", value("--threads")?)?),
            "--staging-mib" => staging_mib = number("--staging-mib", value("--staging-mib")?)?,
            "--chunk-kib" => chunk_kib = Some(number("--chunk-kib", value("--chunk-kib")?)?),
            "--copy-kib" => copy_kib = number("--copy-kib", value("--copy-kib")?)?,
            "--slots" => slots = Some(number("--slots", value("--slots")?)?),
            "--direct" => direct = value("--direct")?.parse()?,
            "--inject-delay-ms" => {
                delay_ms = number("--inject-delay-ms", value("--inject-delay-ms")?)? as u64
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let mount = mount.ok_or("--mount is required")?;
    let defaults = DaemonConfig::new(&mount);
    let mut config = DaemonConfig::with(
        mount,
        threads.unwrap_or(defaults.threads),
        staging_mib << 20,
    );
    if let Some(s) = slots {
        if s == 0 {
            return Err("--slots must be positive".into());
        }
        config.slots_per_worker = s;
        config.chunk_bytes = DaemonConfig::default_chunk(config.staging_bytes, config.threads, s);
    }
    if let Some(k) = chunk_kib {
        if k == 0 {
            return Err("--chunk-kib must be positive".into());
        }
        config.chunk_bytes = k << 10;
    }
    if !copy_kib.is_multiple_of(4) {
        return Err("--copy-kib must be a multiple of 4".into());
    }
    config.copy_piece_bytes = copy_kib << 10;
    config.inject_delay = std::time::Duration::from_millis(delay_ms);
    config.direct = direct;
    Ok(config)
}

fn main() {
    hf3fs_gdr::daemon::log_to_stderr(true);
    let config = match parse() {
        Ok(c) => c,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("hf3fs-gdr-daemon: {e}");
            }
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    eprintln!(
        "hf3fs-gdr-daemon: serving {} with {} workers, {} KiB chunks, {} staging slots each, copies every {} KiB, O_DIRECT {:?}",
        config.mount.display(),
        config.threads,
        config.chunk_bytes >> 10,
        config.slots_per_worker,
        if config.copy_piece_bytes == 0 { config.chunk_bytes } else { config.copy_piece_bytes } >> 10,
        config.direct
    );
    let result = run(config, |socket| {
        println!("ready {}", socket.display());
        let _ = std::io::stdout().flush();
    });
    if let Err(e) = result {
        eprintln!("hf3fs-gdr-daemon: {e}");
        std::process::exit(1);
    }
}
