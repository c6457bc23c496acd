//! Storage runs (`--backend FILE`, feature `file`): one agent moves blocks between its
//! memory (DRAM or VRAM) and files it registered, through the hf3fs-gdr daemon serving
//! `--hf3fs_mount` — one started here (and stopped at the end) when none serves it.
//!
//! Files: `--num_files` of them in `--filepath`, created or truncated, filled with data
//! (a read of a hole would measure nothing) and removed at the end. Descriptor `i` of
//! thread `t` in a batch of `batch` blocks is block `g = t * batch + i` of the run; it
//! lives in file `g mod N` at offset `(g / N) * block`, so each file is read or written
//! from its start in block order. DRAM is a shared `/dev/shm` mapping, which the daemon
//! moves without a copy; VRAM is the GPU's.

use crate::mem::{pattern_bytes, register, Mem, INITIATOR_FILL};
use crate::options::{Options, Side};
use crate::sweep::{sweep, Peer, RemoteMem, Row};
use nixl::{Agent, Desc, DescList, MemKind};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The argument that makes nixlbench run the daemon built into it (see [`serve`]).
pub(crate) const DAEMON_ARG: &str = "__hf3fs-gdr-daemon";
/// How long a started daemon may take to say it listens.
const DAEMON_START: Duration = Duration::from_secs(30);

/// The run's files, removed on drop.
pub(crate) struct FileSet {
    files: Vec<File>,
    paths: Vec<PathBuf>,
    /// Bytes each file is registered (and filled) with.
    size: u64,
}

impl FileSet {
    /// `n` files of `size` bytes in `dir`, each filled with its own pattern.
    fn create(dir: &Path, n: usize, size: u64) -> Result<Self, String> {
        let mut set = Self {
            files: Vec::with_capacity(n),
            paths: Vec::with_capacity(n),
            size,
        };
        for k in 0..n {
            let path = dir.join(format!("nixlbench_file_{}_{k}", std::process::id()));
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| format!("creating {}: {e}", path.display()))?;
            set.paths.push(path.clone());
            let mut at = 0u64;
            while at < size {
                let len = (size - at).min(8 << 20) as usize;
                file.write_all_at(&pattern_bytes(k as u64 ^ 0xF11E, at as usize, len), at)
                    .map_err(|e| format!("filling {}: {e}", path.display()))?;
                at += len as u64;
            }
            set.files.push(file);
        }
        Ok(set)
    }

    fn place(&self, g: usize, block: usize) -> (usize, u64) {
        let n = self.files.len();
        (g % n, ((g / n) * block) as u64)
    }

    /// The FILE descriptor of block `g` of `block` bytes.
    pub(crate) fn desc(&self, g: usize, block: usize) -> Desc {
        let (k, offset) = self.place(g, block);
        Desc::new(offset, block as u64, self.files[k].as_raw_fd() as u64)
    }

    /// Writes the bytes memory would hold at `offset` under `seed` into block `g`.
    pub(crate) fn write_pattern(
        &self,
        g: usize,
        block: usize,
        seed: u64,
        offset: usize,
    ) -> Result<(), String> {
        let (k, at) = self.place(g, block);
        self.files[k]
            .write_all_at(&pattern_bytes(seed, offset, block), at)
            .map_err(|e| format!("{}: {e}", self.paths[k].display()))
    }

    /// Compares block `g` with the bytes memory held at `offset` under `seed`.
    pub(crate) fn check_pattern(
        &self,
        g: usize,
        block: usize,
        seed: u64,
        offset: usize,
    ) -> Result<(), String> {
        let (k, at) = self.place(g, block);
        let mut got = vec![0u8; block];
        self.files[k]
            .read_exact_at(&mut got, at)
            .map_err(|e| format!("{}: {e}", self.paths[k].display()))?;
        let want = pattern_bytes(seed, offset, block);
        match got.iter().zip(&want).position(|(g, w)| g != w) {
            None => Ok(()),
            Some(i) => Err(format!(
                "{} byte {} is {:#04x}, expected {:#04x}",
                self.paths[k].display(),
                at as usize + i,
                got[i],
                want[i]
            )),
        }
    }

    /// The registration list: every file from offset 0, `size` bytes.
    fn reg_list(&self) -> DescList {
        DescList::from_descs(
            MemKind::File,
            self.files
                .iter()
                .map(|f| Desc::new(0, self.size, f.as_raw_fd() as u64)),
        )
    }
}

impl Drop for FileSet {
    fn drop(&mut self) {
        for p in &self.paths {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A daemon this run started: stopped on drop, and the mount's virtual directory
/// removed if the daemon made it.
struct StartedDaemon {
    child: Child,
    made_virt: Option<PathBuf>,
}

impl Drop for StartedDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.made_virt {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The daemon program: `$HF3FS_GDR_DAEMON`, `hf3fs-gdr-daemon` beside nixlbench or on
/// the PATH, else nixlbench itself with [`DAEMON_ARG`].
fn daemon_command(mount: &Path) -> Result<(Command, String), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let beside = exe.parent().map(|d| d.join("hf3fs-gdr-daemon"));
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("hf3fs-gdr-daemon"))
            .find(|p| p.is_file())
    });
    let program = std::env::var_os("HF3FS_GDR_DAEMON")
        .map(PathBuf::from)
        .or(beside.filter(|p| p.is_file()))
        .or(on_path);
    let mut cmd = match &program {
        Some(p) => Command::new(p),
        None => {
            let mut c = Command::new(&exe);
            c.arg(DAEMON_ARG);
            c
        }
    };
    cmd.arg("--mount").arg(mount);
    let what = match program {
        Some(p) => p.display().to_string(),
        None => "nixlbench's built-in daemon".into(),
    };
    Ok((cmd, what))
}

/// Makes sure a daemon serves `mount`: the one running, or one started now (with
/// O_DIRECT for every file if `direct`).
fn ensure_daemon(mount: &Path, direct: bool) -> Result<(Option<StartedDaemon>, String), String> {
    if hf3fs_gdr::daemon_stats(mount).is_ok() {
        if direct {
            return Err(format!(
                "--storage_enable_direct: a daemon already serves {} with its own O_DIRECT \
                 policy; stop it (nixlbench then starts one with --direct always), or run \
                 it with --direct always and drop the flag",
                mount.display()
            ));
        }
        return Ok((None, "already running".into()));
    }
    let (mut cmd, what) = daemon_command(mount)?;
    if direct {
        cmd.args(["--direct", "always"]);
    }
    let virt = mount.join(hf3fs_gdr::virt::VIRT_DIR);
    let made_virt = (!virt.exists()).then_some(virt);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting {what}: {e}"))?;
    let stdout = child.stdout.take();
    let started = StartedDaemon { child, made_virt };
    let stdout = stdout.ok_or_else(|| format!("{what}: its standard output was not captured"))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.starts_with("ready ") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(DAEMON_START).map_err(|_| {
        format!(
            "{what} did not say it serves {} within {DAEMON_START:?}",
            mount.display()
        )
    })?;
    Ok((Some(started), format!("started {what}")))
}

/// `nixlbench __hf3fs-gdr-daemon --mount DIR [--direct auto|always|never]`: the daemon
/// library in this process, for machines without the `hf3fs-gdr-daemon` binary.
pub(crate) fn serve(args: &[String]) -> Result<(), String> {
    let usage = || format!("{DAEMON_ARG} --mount DIR [--direct auto|always|never]");
    let (mount, direct) = match args {
        [flag, dir] if flag == "--mount" => (PathBuf::from(dir), None),
        [flag, dir, d, policy] if flag == "--mount" && d == "--direct" => {
            (PathBuf::from(dir), Some(policy.parse()?))
        }
        _ => return Err(usage()),
    };
    if !mount.is_dir() {
        return Err(format!("--mount {}: not a directory", mount.display()));
    }
    let mut config = hf3fs_gdr::daemon::DaemonConfig::new(mount);
    if let Some(direct) = direct {
        config.direct = direct;
    }
    // Its errors and warnings reach standard error through the tracing subscriber.
    hf3fs_gdr::daemon::run(config, |socket| {
        println!("ready {}", socket.display());
        let _ = std::io::stdout().flush();
    })
    .map_err(|e| e.to_string())
}

/// The storage run: files, daemon, agent, sweep.
pub(crate) fn run(o: &Options) -> Result<Vec<Row>, String> {
    let dir = match &o.filepath {
        Some(d) => d.clone(),
        None => std::env::current_dir().map_err(|e| e.to_string())?,
    };
    let mount = o
        .hf3fs_mount
        .clone()
        .or_else(|| std::env::var_os("NIXLBENCH_HF3FS_MOUNT").map(PathBuf::from))
        .unwrap_or_else(|| dir.clone());
    let (_daemon, daemon_how) = ensure_daemon(&mount, o.storage_direct)?;
    // Enough for every point: ceil(blocks / N) blocks of the largest size per file.
    let per_file = o.buffer_bytes().div_ceil(o.num_files) + o.max_block_size;
    let files = FileSet::create(&dir, o.num_files, per_file as u64)?;
    let local = Mem::for_side_shared(o, Side::Initiator, INITIATOR_FILL)?;
    let agent = Agent::new("nixlbench", o.agent_config(None)).map_err(|e| e.to_string())?;
    let mut params = o.params(Side::Initiator, None);
    params
        .entry("mount".into())
        .or_insert_with(|| mount.display().to_string());
    agent
        .create_backend("FILE", &params)
        .map_err(|e| format!("FILE: {e}"))?;
    let _local_reg = register(&agent, &local, None)?;
    // SAFETY: the files outlive the handle (declared after them: dropped first).
    let _file_reg = unsafe { agent.register_mem(&files.reg_list(), None) }
        .map_err(|e| format!("registering the files: {e}"))?;
    let how = agent
        .query_mem(&DescList::from_descs(local.kind(), [local.desc(0, 1)]))
        .into_iter()
        .flatten()
        .flatten()
        .collect::<Vec<_>>()
        .join(",");
    let header = format!(
        "nixlbench: backend FILE (one process, {how}), {:?}, {} <-> {} file(s) in {}, \
         {} thread(s), hf3fs-gdr daemon on {} ({daemon_how})",
        o.op,
        local.describe(),
        o.num_files,
        dir.display(),
        o.num_threads,
        mount.display()
    );
    let peer = Peer::Files {
        name: agent.name().to_string(),
        files: &files,
    };
    let remote = RemoteMem {
        kind: MemKind::File,
        addr: 0,
        len: 0,
        dev_id: 0,
    };
    let rows = sweep(&agent, &peer, &local, remote, o, &header)?;
    if let Some(best) = rows.iter().max_by(|a, b| a.gbps.total_cmp(&b.gbps)) {
        println!(
            "FILE {:?} {} peak: {:.3} GB/s at block size {} B, batch {} ({} thread(s))",
            o.op,
            local.describe(),
            best.gbps,
            best.block_size,
            best.batch_size,
            o.num_threads
        );
    }
    Ok(rows)
}
