//! Host packages, the cache and the guest kernel.
//!
//! The kernel package is fetched with `apt-get download` and unpacked into the cache, never
//! installed (no initramfs-tools or bootloader hooks run). Of the 390 MB tree only the boot
//! image and the closure of the modules the guest loads are kept.

use super::{check, initramfs, output, output_bytes, TempDir};
use anyhow::{bail, Context, Result};
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Host packages the guest needs. The guest runs the host's userspace, so the RDMA
/// libraries and tools come from here too.
const HOST_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "kmod",
    "cpio",
    "xz-utils",
    "iproute2",
    "ibverbs-providers",
    "ibverbs-utils",
    "librdmacm1",
    "perftest",
    "rdmacm-utils",
];

/// Modules `guest-init.sh` loads; the cache keeps these and their dependencies.
const GUEST_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_console",
    "9pnet_virtio",
    "9p",
    "overlay",
    "crc32_generic",
    "rdma_rxe",
    "ib_uverbs",
    "rdma_ucm",
    "ib_umad",
    "dummy",
    // The two-guest mode's link (`cargo xtask rxe --two-guests`).
    "virtio_net",
];

/// Marks a complete kernel cache entry and holds the kernel release. Bump the suffix
/// when what an entry holds changes (e.g. `GUEST_MODULES`): older entries are then ignored.
const READY: &str = "ready-v2";

/// What QEMU boots.
#[derive(Debug)]
pub(super) struct Boot {
    /// An ELF `vmlinux` (PVH entry) when it could be extracted, else the bzImage.
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
}

/// Install what is missing, fetch the kernel if no cached one fits, build the initramfs.
/// Holds the cache lock, so concurrent runs download and build once.
pub(super) fn prepare(verbose: bool) -> Result<Boot> {
    let cache = cache_dir()?;
    fs::create_dir_all(cache.join("kernels"))
        .with_context(|| format!("creating the cache {}", cache.display()))?;
    let _lock = Lock::exclusive(&cache.join(".lock"))?;
    // Under the lock: concurrent apt-get runs would fail on dpkg's lock.
    crate::deps::ensure_packages(HOST_PACKAGES)?;
    let entry = kernel_entry(&cache)?;
    let kernel = ["vmlinux", "vmlinuz"]
        .iter()
        .map(|name| entry.join(name))
        .find(|path| path.exists())
        .with_context(|| format!("no kernel image in {}", entry.display()))?;
    let initramfs = initramfs::build(&entry, verbose)?;
    Ok(Boot { kernel, initramfs })
}

fn cache_dir() -> Result<PathBuf> {
    let var = |name| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var("RXE_VM_CACHE") {
        return Ok(dir);
    }
    let base = match var("XDG_CACHE_HOME") {
        Some(dir) => dir,
        None => var("HOME")
            .context("neither RXE_VM_CACHE nor HOME is set")?
            .join(".cache"),
    };
    Ok(base.join("rdma-rs-rxe"))
}

/// An exclusive `flock` on a file, released when dropped (the descriptor closes).
#[derive(Debug)]
struct Lock {
    _file: fs::File,
}

impl Lock {
    fn exclusive(path: &Path) -> Result<Self> {
        use std::os::fd::AsRawFd;
        let file =
            fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        loop {
            // SAFETY: flock only takes a descriptor, and `file` keeps it open for the call.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Self { _file: file });
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err).with_context(|| format!("locking {}", path.display()));
            }
        }
    }
}

/// The cache entry to boot: the newest complete one for the wanted package, else a fresh
/// download. Once something is cached no apt call is made, so warm runs work offline.
fn kernel_entry(cache: &Path) -> Result<PathBuf> {
    let kernels = cache.join("kernels");
    let wanted = std::env::var("RXE_VM_KERNEL_PKG")
        .ok()
        .filter(|p| !p.is_empty());
    let prefix = wanted
        .as_ref()
        .map_or("linux-image-".to_string(), |p| format!("{p}_"));
    if let Some(entry) = newest_entry(&kernels, &prefix)? {
        return Ok(entry);
    }
    let resolve = || match &wanted {
        Some(pkg) => Ok(pkg.clone()),
        None => kernel_package(),
    };
    match resolve().and_then(|pkg| fetch(&kernels, &pkg)) {
        Ok(entry) => Ok(entry),
        Err(err) => {
            // Stale package lists name a kernel the archive no longer has.
            eprintln!("rxe: {err:#}; updating the package lists and trying again");
            apt_update()?;
            fetch(&kernels, &resolve()?)
        }
    }
}

fn newest_entry(kernels: &Path, prefix: &str) -> Result<Option<PathBuf>> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for dirent in fs::read_dir(kernels).with_context(|| format!("reading {}", kernels.display()))? {
        let path = dirent?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if !name.starts_with(prefix) {
            continue;
        }
        if let Ok(modified) = fs::metadata(path.join(READY)).and_then(|m| m.modified()) {
            if best.as_ref().is_none_or(|(newest, _)| modified > *newest) {
                best = Some((modified, path));
            }
        }
    }
    Ok(best.map(|(_, path)| path))
}

/// The versioned package `linux-image-amd64` points to: the generic flavour, the only one
/// with `CONFIG_RDMA_RXE` (the cloud flavour has neither rxe nor 9p).
fn kernel_package() -> Result<String> {
    let out = output(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))?;
    parse_kernel_dependency(&out).context("apt-cache knows no linux-image-amd64 dependency")
}

fn parse_kernel_dependency(apt_cache_depends: &str) -> Option<String> {
    apt_cache_depends.lines().find_map(|line| {
        let pkg = line.trim().strip_prefix("Depends: ")?;
        pkg.strip_prefix("linux-image-")
            .filter(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
            .map(|_| pkg.to_string())
    })
}

fn fetch(kernels: &Path, pkg: &str) -> Result<PathBuf> {
    // Unpacked trees (400 MB) of runs killed mid-download; we hold the lock, so none is live.
    for dirent in fs::read_dir(kernels)?.flatten() {
        if dirent
            .file_name()
            .to_string_lossy()
            .starts_with(".download.")
        {
            let _ = fs::remove_dir_all(dirent.path());
        }
    }
    let work = TempDir::new_in(kernels, ".download.")?;
    eprintln!("rxe: downloading {pkg}");
    let mut download = Command::new("apt-get");
    download.current_dir(work.path()).args(["download", "-q"]);
    if is_root() {
        // apt's `_apt` sandbox user cannot write into root's private temporary directory.
        download.args(["-o", "APT::Sandbox::User=root"]);
    }
    check(download.arg(pkg))?;
    let deb = fs::read_dir(work.path())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download {pkg} left no .deb"))?;
    let version = output(Command::new("dpkg-deb").arg("-f").arg(&deb).arg("Version"))?;
    let tree = work.path().join("tree");
    check(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree))?;
    fs::remove_file(&deb)?;

    let release = fs::read_dir(tree.join("boot"))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .find_map(|name| name.strip_prefix("vmlinuz-").map(str::to_string))
        .with_context(|| format!("{pkg} has no /boot/vmlinuz-*"))?;
    let config = fs::read_to_string(tree.join(format!("boot/config-{release}")))?;
    if !config
        .lines()
        .any(|l| l == "CONFIG_RDMA_RXE=m" || l == "CONFIG_RDMA_RXE=y")
    {
        bail!("{pkg} is built without CONFIG_RDMA_RXE");
    }

    let entry = work.path().join("entry");
    fs::create_dir(&entry)?;
    let bzimage = fs::read(tree.join(format!("boot/vmlinuz-{release}")))?;
    // QEMU boots an ELF vmlinux through its PVH entry directly, which skips the in-guest
    // xz decompression: 4-5 s under TCG.
    let pvh = config.lines().any(|l| l == "CONFIG_PVH=y");
    if !(pvh && extract_vmlinux(&bzimage, &entry.join("vmlinux"))?) {
        fs::write(entry.join("vmlinuz"), &bzimage)?;
    }
    copy_modules(&tree, &release, &entry.join("root"))?;
    fs::write(entry.join(READY), &release)?;

    let dest = kernels.join(format!("{pkg}_{}", version.trim()));
    let _ = fs::remove_dir_all(&dest);
    fs::rename(&entry, &dest)?;
    eprintln!("rxe: kernel {release} cached in {}", dest.display());
    Ok(dest)
}

/// Decompress the bzImage's xz payload into `dest`; false (and no file) if that gives no ELF.
fn extract_vmlinux(bzimage: &[u8], dest: &Path) -> Result<bool> {
    let Some(payload) = xz_payload(bzimage) else {
        return Ok(false);
    };
    let out = fs::File::create(dest)?;
    // The payload ends with the kernel's 4-byte size trailer: --single-stream ignores it.
    let mut xz = Command::new("xz")
        .args(["-dcq", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(out)
        .spawn()
        .context("running xz")?;
    let fed = xz.stdin.take().expect("piped stdin").write_all(payload);
    let ok = xz.wait()?.success() && fed.is_ok();
    let mut magic = [0; 4];
    let elf = ok && fs::File::open(dest)?.read_exact(&mut magic).is_ok() && &magic == b"\x7fELF";
    if !elf {
        fs::remove_file(dest)?;
    }
    Ok(elf)
}

const XZ_MAGIC: &[u8] = b"\xfd7zXZ\x00";

/// The xz stream in a bzImage: where the x86 boot header's `payload_offset` and
/// `payload_length` say (boot protocol 2.08+), else the first xz magic.
fn xz_payload(bzimage: &[u8]) -> Option<&[u8]> {
    let u32_at = |at: usize| {
        Some(u32::from_le_bytes(
            bzimage.get(at..at + 4)?.try_into().ok()?,
        ))
    };
    let from_header = || -> Option<&[u8]> {
        if bzimage.get(0x202..0x206)? != b"HdrS" {
            return None;
        }
        let protocol = u16::from_le_bytes(bzimage.get(0x206..0x208)?.try_into().ok()?);
        if protocol < 0x208 {
            return None;
        }
        let setup_sects = match *bzimage.get(0x1f1)? {
            0 => 4,
            n => usize::from(n),
        };
        let start = (setup_sects + 1) * 512 + usize::try_from(u32_at(0x248)?).ok()?;
        let len = usize::try_from(u32_at(0x24c)?).ok()?;
        bzimage.get(start..start.checked_add(len)?)
    };
    from_header()
        .filter(|payload| payload.starts_with(XZ_MAGIC))
        .or_else(|| {
            let at = bzimage
                .windows(XZ_MAGIC.len())
                .position(|w| w == XZ_MAGIC)?;
            Some(&bzimage[at..])
        })
}

/// Copy the closure of `GUEST_MODULES` (computed by the host's kmod over the unpacked
/// tree) into `root/lib/modules/<release>`, signatures stripped, and index it with depmod.
fn copy_modules(tree: &Path, release: &str, root: &Path) -> Result<()> {
    let rel_dir = format!("lib/modules/{release}");
    let src = tree.join(&rel_dir);
    let dest = root.join(&rel_dir);
    check(Command::new("depmod").arg("-b").arg(tree).arg(release))?;
    let plan = output(
        Command::new("modprobe")
            .args(["-C", "/dev/null", "-d"])
            .arg(tree)
            .args(["-S", release, "--show-depends", "-a"])
            .args(GUEST_MODULES),
    )?;
    let mut count = 0;
    for line in plan.lines() {
        let Some(path) = line
            .strip_prefix("insmod ")
            .and_then(|l| l.split_whitespace().next())
        else {
            continue; // `builtin <name>`
        };
        let rel = Path::new(path)
            .strip_prefix(&src)
            .with_context(|| format!("module {path}"))?;
        let mut module = fs::read(path)?;
        let mut rel = rel.to_path_buf();
        if rel.extension().is_some_and(|e| e == "xz") {
            module = output_bytes(Command::new("xz").arg("-dc").arg(path))?;
            rel.set_extension("");
        }
        let target = dest.join(&rel);
        fs::create_dir_all(target.parent().expect("module path has a parent"))?;
        fs::write(&target, strip_module_signature(&module))?;
        count += 1;
    }
    if count == 0 {
        bail!("modprobe --show-depends found none of {GUEST_MODULES:?}");
    }
    for index in [
        "modules.order",
        "modules.builtin",
        "modules.builtin.modinfo",
    ] {
        fs::copy(src.join(index), dest.join(index)).with_context(|| format!("copying {index}"))?;
    }
    check(Command::new("depmod").arg("-b").arg(root).arg(release))
}

const SIG_MAGIC: &[u8] = b"~Module signature appended~\n";
/// `struct module_signature`: algo, hash, id_type, signer_len, key_id_len, pad[3], be32 sig_len.
const SIG_INFO_LEN: usize = 12;

/// The module without its appended signature. Debian's kernel does not enforce signatures
/// (no `MODULE_SIG_FORCE`, no lockdown), so an unsigned module only taints it, and the RSA
/// check it skips costs ~0.2 s of boot under TCG.
fn strip_module_signature(module: &[u8]) -> &[u8] {
    let Some(body) = module.strip_suffix(SIG_MAGIC) else {
        return module;
    };
    let Some(info_at) = body.len().checked_sub(SIG_INFO_LEN) else {
        return module;
    };
    let len_bytes: [u8; 4] = body[body.len() - 4..].try_into().expect("4 bytes");
    let sig_len = u32::from_be_bytes(len_bytes) as usize;
    match info_at.checked_sub(sig_len) {
        Some(end) => &module[..end],
        None => module,
    }
}

fn is_root() -> bool {
    fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn apt_update() -> Result<()> {
    let mut cmd = if is_root() {
        Command::new("apt-get")
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg("apt-get");
        sudo
    };
    check(
        cmd.args(["update", "-qq"])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signed(body: &[u8], sig: &[u8]) -> Vec<u8> {
        let mut module = body.to_vec();
        module.extend_from_slice(sig);
        module.extend_from_slice(&[0, 0, 2, 0, 0, 0, 0, 0]); // PKCS#7, as Debian signs
        module.extend_from_slice(&u32::try_from(sig.len()).unwrap().to_be_bytes());
        module.extend_from_slice(SIG_MAGIC);
        module
    }

    #[test]
    fn strips_an_appended_signature() {
        let body = b"\x7fELF module body";
        assert_eq!(strip_module_signature(&signed(body, &[0xa5; 681])), body);
        assert_eq!(strip_module_signature(&signed(body, &[])), body);
        assert_eq!(strip_module_signature(&signed(b"", b"sig")), b"");
    }

    #[test]
    fn leaves_unsigned_or_corrupt_modules_alone() {
        let body = b"\x7fELF no signature here";
        assert_eq!(strip_module_signature(body), body);
        // A sig_len longer than the file must not cut into nothing.
        let mut bad = signed(b"x", b"sig");
        let at = bad.len() - SIG_MAGIC.len() - 4;
        bad[at..at + 4].copy_from_slice(&1000u32.to_be_bytes());
        assert_eq!(strip_module_signature(&bad), &bad[..]);
        let short = [&b"abc"[..], SIG_MAGIC].concat();
        assert_eq!(strip_module_signature(&short), &short[..]);
    }

    fn bzimage(setup_sects: u8, payload_offset: u32, payload: &[u8]) -> Vec<u8> {
        let sects = if setup_sects == 0 {
            4
        } else {
            usize::from(setup_sects)
        };
        let start = (sects + 1) * 512 + payload_offset as usize;
        let mut image = vec![0u8; start];
        image[0x1f1] = setup_sects;
        image[0x202..0x206].copy_from_slice(b"HdrS");
        image[0x206..0x208].copy_from_slice(&0x20fu16.to_le_bytes());
        image[0x248..0x24c].copy_from_slice(&payload_offset.to_le_bytes());
        image[0x24c..0x250].copy_from_slice(&u32::try_from(payload.len()).unwrap().to_le_bytes());
        image.extend_from_slice(payload);
        image.extend_from_slice(b"trailing setup data");
        image
    }

    #[test]
    fn finds_the_xz_payload_from_the_boot_header() {
        let payload = [XZ_MAGIC, b"compressed kernel", &[1, 2, 3, 4]].concat();
        for (sects, offset) in [(39, 0x2b8), (0, 0), (1, 7)] {
            let image = bzimage(sects, offset, &payload);
            assert_eq!(
                xz_payload(&image),
                Some(&payload[..]),
                "setup_sects {sects}"
            );
        }
    }

    #[test]
    fn falls_back_to_the_xz_magic() {
        // A header pointing at the wrong place: the first magic wins.
        let mut image = bzimage(39, 16, b"not xz");
        image.extend_from_slice(XZ_MAGIC);
        image.extend_from_slice(b"tail");
        let at = image.len() - XZ_MAGIC.len() - 4;
        assert_eq!(xz_payload(&image), Some(&image[at..]));
        // No header at all.
        let raw = [&b"junk"[..], XZ_MAGIC, b"x"].concat();
        assert_eq!(xz_payload(&raw), Some(&raw[4..]));
        assert_eq!(xz_payload(&bzimage(39, 0, b"gzip payload")), None);
        assert_eq!(xz_payload(b""), None);
    }

    #[test]
    fn finds_the_versioned_kernel_package() {
        let out = "linux-image-amd64\n  Depends: linux-image-6.1.0-56-amd64\n";
        assert_eq!(
            parse_kernel_dependency(out).as_deref(),
            Some("linux-image-6.1.0-56-amd64")
        );
        let virtual_only = "linux-image-amd64\n  Depends: <linux-image-virtual>\n";
        assert_eq!(parse_kernel_dependency(virtual_only), None);
        assert_eq!(parse_kernel_dependency(""), None);
    }
}
