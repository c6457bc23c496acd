//! `hf3fs-gdr-daemon --mount DIR [OPTIONS]`: serves a mount directory for `hf3fs-gdr`
//! clients (see `hf3fs_gdr::daemon`). Prints `ready <socket path>` on stdout once it
//! listens (and not before: a mount that cannot be served fails first).

use clap::Parser;
use hf3fs_gdr::daemon::{run, DaemonConfig, DirectPolicy};
use std::io::Write;
use std::path::PathBuf;

/// Serves a mount directory for hf3fs-gdr clients: O_DIRECT readers and a pinned
/// staging pipeline into VRAM
#[derive(Parser, Debug)]
#[command(
    name = "hf3fs-gdr-daemon",
    version,
    max_term_width = 100,
    after_help = "Prints `ready <socket path>` on standard output once it listens. RUST_LOG sets \
the log on standard error (default: warnings and errors)."
)]
struct Cli {
    /// The directory to serve (it must exist)
    #[arg(long, value_name = "DIR")]
    mount: PathBuf,
    /// Worker threads [default: CPUs, at least 4]
    #[arg(long, value_name = "N", value_parser = positive)]
    threads: Option<usize>,
    /// Pinned staging memory per GPU, in MiB
    #[arg(long = "staging-mib", value_name = "M", default_value_t = 256, value_parser = positive)]
    staging_mib: usize,
    /// Largest piece a worker moves at once, in KiB [default: staging / (threads x slots),
    /// 64 to 4096]
    #[arg(long = "chunk-kib", value_name = "K", value_parser = positive)]
    chunk_kib: Option<usize>,
    /// Pinned staging slots per worker: device copies in flight while it reads the next
    /// chunk [default: 2]
    #[arg(long, value_name = "S", value_parser = positive)]
    slots: Option<usize>,
    /// GPU iovs, cached data: start a device copy after every C KiB read (a multiple of
    /// 4; 0: one copy per chunk)
    #[arg(long = "copy-kib", value_name = "C", default_value_t = 0, value_parser = multiple_of_4)]
    copy_kib: usize,
    /// O_DIRECT policy: auto (cached data from the page cache, the rest O_DIRECT), always,
    /// never
    #[arg(long, value_name = "P", default_value = "auto", value_parser = direct_policy)]
    direct: DirectPolicy,
    /// Fault injection: chunks of files named *.slow wait D ms
    #[arg(long = "inject-delay-ms", value_name = "D", default_value_t = 0)]
    inject_delay_ms: u64,
    /// Also admit clients of user UID (repeatable; root and the daemon's own user are
    /// always admitted). With any --allow-uid/--allow-gid the socket is made 0666 and the
    /// check at connect (the kernel's SO_PEERCRED) keeps everyone else out
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uids: Vec<u32>,
    /// Also admit clients whose primary group is GID (repeatable)
    #[arg(long = "allow-gid", value_name = "GID")]
    allow_gids: Vec<u32>,
    /// Files one client may register at once [default: 4096]
    #[arg(long = "max-client-files", value_name = "N", value_parser = positive)]
    max_client_files: Option<usize>,
    /// Iovs one client may register at once [default: 4096]
    #[arg(long = "max-client-iovs", value_name = "N", value_parser = positive)]
    max_client_iovs: Option<usize>,
    /// Rings one client may attach at once [default: 128]
    #[arg(long = "max-client-rings", value_name = "N", value_parser = positive)]
    max_client_rings: Option<usize>,
    /// Clients served at once [default: 256]
    #[arg(long = "max-clients", value_name = "N", value_parser = positive)]
    max_clients: Option<usize>,
}

fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{text}` is not a whole number")),
    }
}

fn multiple_of_4(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n % 4 == 0 => Ok(n),
        Ok(_) => Err("must be a multiple of 4".into()),
        Err(_) => Err(format!("`{text}` is not a whole number")),
    }
}

fn direct_policy(text: &str) -> Result<DirectPolicy, String> {
    text.parse()
}

/// Everything a user can get wrong, checked before anything is created: the mount is
/// a directory, and the sizes make sense together.
fn config(cli: Cli) -> Result<DaemonConfig, String> {
    if !cli.mount.is_dir() {
        return Err(format!(
            "--mount {}: {}",
            cli.mount.display(),
            if cli.mount.exists() {
                "not a directory"
            } else {
                "no such directory (create it, or name the mount to serve)"
            }
        ));
    }
    let staging = cli
        .staging_mib
        .checked_mul(1 << 20)
        .ok_or("--staging-mib: too large for this machine")?;
    let defaults = DaemonConfig::new(&cli.mount);
    let mut config =
        DaemonConfig::with(cli.mount, cli.threads.unwrap_or(defaults.threads), staging);
    if let Some(slots) = cli.slots {
        config.slots_per_worker = slots;
        config.chunk_bytes =
            DaemonConfig::default_chunk(config.staging_bytes, config.threads, slots);
    }
    if let Some(k) = cli.chunk_kib {
        config.chunk_bytes = k.checked_mul(1 << 10).ok_or("--chunk-kib: too large")?;
    }
    config.copy_piece_bytes = cli
        .copy_kib
        .checked_mul(1 << 10)
        .ok_or("--copy-kib: too large")?;
    config.inject_delay = std::time::Duration::from_millis(cli.inject_delay_ms);
    config.direct = cli.direct;
    config.allow_uids = cli.allow_uids;
    config.allow_gids = cli.allow_gids;
    let limits = &mut config.limits;
    limits.files = cli.max_client_files.unwrap_or(limits.files);
    limits.iovs = cli.max_client_iovs.unwrap_or(limits.iovs);
    limits.rings = cli.max_client_rings.unwrap_or(limits.rings);
    limits.clients = cli.max_clients.unwrap_or(limits.clients);
    Ok(config)
}

/// Raises the soft limit on open descriptors to the hard one: the daemon holds every
/// client's registered files and host iovs open (each client within its
/// `--max-client-*` share).
fn raise_descriptor_limit() {
    // SAFETY: plain C struct.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 && lim.rlim_cur < lim.rlim_max
    {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: a valid rlimit; failure only leaves the soft limit as it was.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    }
}

fn main() {
    // The daemon's errors and warnings reach standard error through the subscriber.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                e.exit();
            }
            // One line: clap's message and tips (not its usage block), and where the
            // full usage is.
            let text = e.render().to_string();
            let parts: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more"))
                .filter(|l| !l.is_empty())
                .collect();
            eprintln!(
                "hf3fs-gdr-daemon: {}; see 'hf3fs-gdr-daemon --help'",
                parts.join(" ").trim_start_matches("error: ")
            );
            std::process::exit(2);
        }
    };
    let config = match config(cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("hf3fs-gdr-daemon: {e}");
            std::process::exit(2);
        }
    };
    raise_descriptor_limit();
    let summary = format!(
        "hf3fs-gdr-daemon: serving {} with {} workers, {} KiB chunks, {} staging slots each, \
         copies every {} KiB, O_DIRECT {:?}",
        config.mount.display(),
        config.threads,
        config.chunk_bytes >> 10,
        config.slots_per_worker,
        if config.copy_piece_bytes == 0 {
            config.chunk_bytes
        } else {
            config.copy_piece_bytes
        } >> 10,
        config.direct
    );
    // Announced once it listens: a mount it cannot serve fails before any "serving".
    let result = run(config, |socket| {
        eprintln!("{summary}");
        println!("ready {}", socket.display());
        let _ = std::io::stdout().flush();
    });
    if let Err(e) = result {
        eprintln!("hf3fs-gdr-daemon: {e}");
        std::process::exit(1);
    }
}
