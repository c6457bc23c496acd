//! The guest's initramfs: static busybox, the cached modules and `guest-init.sh`, as an
//! uncompressed newc cpio archive (the kernel unpacks it faster than it would decompress).

use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::fs;
use std::hash::{Hash, Hasher};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

const GUEST_INIT: &str = include_str!("../guest-init.sh");
const BUSYBOX: &str = "/bin/busybox";

/// Build `initramfs-<hash>.cpio` in the kernel cache entry unless it exists. The hash covers
/// the init script and busybox's identity (an upgrade replaces the file), so editing
/// `guest-init.sh` rebuilds it, and a warm run reads neither.
pub(super) fn build(entry: &Path, verbose: bool) -> Result<PathBuf> {
    let meta = fs::metadata(BUSYBOX).with_context(|| format!("{BUSYBOX} (busybox-static)"))?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (
        GUEST_INIT,
        meta.ino(),
        meta.len(),
        meta.mtime(),
        meta.mtime_nsec(),
    )
        .hash(&mut hasher);
    let name = format!("initramfs-{:016x}.cpio", hasher.finish());
    let path = entry.join(&name);
    if path.exists() {
        return Ok(path);
    }
    if verbose {
        eprintln!("rxe: building {}", path.display());
    }
    let mut cpio = Cpio::default();
    for dir in [
        "dev", "proc", "sys", "tmp", "mnt/ctl", "mnt/host", "mnt/rw", "newroot",
    ] {
        cpio.dir(dir);
    }
    // The kernel gives init /dev/console as stdin/stdout/stderr before devtmpfs is mounted.
    cpio.node("dev/console", 0o020600, (5, 1));
    cpio.file("init", 0o755, GUEST_INIT.as_bytes());
    let busybox = fs::read(BUSYBOX).with_context(|| format!("reading {BUSYBOX}"))?;
    cpio.file("bin/busybox", 0o755, &busybox);
    let applets = super::output(std::process::Command::new(BUSYBOX).arg("--list-full"))?;
    for applet in applets
        .lines()
        .filter(|a| !a.is_empty() && *a != "bin/busybox")
    {
        if applet.contains("..") || applet.starts_with('/') {
            bail!("odd busybox applet path {applet}");
        }
        cpio.symlink(applet, "/bin/busybox");
    }
    add_tree(&mut cpio, &entry.join("root"), "")?;

    let tmp = entry.join(format!(".{name}.{}", std::process::id()));
    fs::write(&tmp, cpio.finish()).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, &path)?;
    remove_stale(entry, &name);
    Ok(path)
}

/// Drop initramfs files of other init versions, unless recently used (by a run that may
/// still be about to boot one).
fn remove_stale(entry: &Path, keep: &str) {
    let Ok(dir) = fs::read_dir(entry) else { return };
    for dirent in dir.flatten() {
        let name = dirent.file_name();
        let name = name.to_string_lossy();
        let old = dirent
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t < SystemTime::now() - Duration::from_secs(3600));
        if name.starts_with("initramfs-") && name != keep && old {
            let _ = fs::remove_file(dirent.path());
        }
    }
}

/// Add the files under `dir` (sorted, for a reproducible archive) as `prefix/...`.
fn add_tree(cpio: &mut Cpio, dir: &Path, prefix: &str) -> Result<()> {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for dirent in entries {
        let name = dirent
            .file_name()
            .into_string()
            .map_err(|n| anyhow::anyhow!("odd name {n:?}"))?;
        let rel = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let meta = dirent.metadata()?;
        if meta.is_dir() {
            cpio.dir(&rel);
            add_tree(cpio, &dirent.path(), &rel)?;
        } else {
            cpio.file(
                &rel,
                meta.permissions().mode() & 0o777,
                &fs::read(dirent.path())?,
            );
        }
    }
    Ok(())
}

/// A writer of the "newc" cpio format the kernel unpacks: per entry a 110-byte ASCII
/// header, the NUL-terminated name and the data, each padded to 4 bytes. Parent
/// directories are added before their contents, as the kernel does not create them.
#[derive(Debug, Default)]
struct Cpio {
    out: Vec<u8>,
    dirs: BTreeSet<String>,
    inode: u32,
}

impl Cpio {
    fn dir(&mut self, path: &str) {
        self.parents(path);
        if self.dirs.insert(path.to_string()) {
            self.entry(path, 0o040755, (0, 0), b"");
        }
    }

    fn file(&mut self, path: &str, perm: u32, data: &[u8]) {
        self.parents(path);
        self.entry(path, 0o100000 | perm, (0, 0), data);
    }

    fn symlink(&mut self, path: &str, target: &str) {
        self.parents(path);
        self.entry(path, 0o120777, (0, 0), target.as_bytes());
    }

    fn node(&mut self, path: &str, mode: u32, (major, minor): (u32, u32)) {
        self.parents(path);
        self.entry(path, mode, (major, minor), b"");
    }

    fn parents(&mut self, path: &str) {
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
    }

    fn entry(&mut self, name: &str, mode: u32, (rmajor, rminor): (u32, u32), data: &[u8]) {
        self.inode += 1;
        let size = u32::try_from(data.len()).expect("cpio members are under 4 GiB");
        let name_size = u32::try_from(name.len() + 1).expect("short name");
        // ino mode uid gid nlink mtime filesize devmajor devminor rdevmajor rdevminor namesize check
        let fields = [
            self.inode, mode, 0, 0, 1, 0, size, 0, 0, rmajor, rminor, name_size, 0,
        ];
        self.out.extend_from_slice(b"070701");
        for field in fields {
            self.out
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), b"");
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_layout() {
        let mut cpio = Cpio::default();
        cpio.file("a/b/c", 0o644, b"hello");
        let out = cpio.finish();
        // a, a/b, a/b/c, trailer; every header starts 4-byte aligned.
        let headers: Vec<usize> = out
            .windows(6)
            .enumerate()
            .filter(|(_, w)| w == b"070701")
            .map(|(i, _)| i)
            .collect();
        assert_eq!(headers.len(), 4);
        assert!(headers.iter().all(|h| h % 4 == 0), "{headers:?}");
        let file = headers[2];
        assert_eq!(&out[file + 110..file + 116], b"a/b/c\0");
        let mode = &out[file + 14..file + 22];
        assert_eq!(mode, b"000081a4");
        let data = (file + 110 + 6).next_multiple_of(4);
        assert_eq!(&out[data..data + 5], b"hello");
        assert_eq!(out.len() % 4, 0);
    }

    #[test]
    fn cpio_reads_back_with_gnu_cpio() {
        let mut cpio = Cpio::default();
        cpio.file("bin/tool", 0o755, b"#!/bin/sh\n");
        cpio.symlink("sbin/x", "/bin/tool");
        cpio.node("dev/console", 0o020600, (5, 1));
        let dir = super::super::TempDir::new_in(&std::env::temp_dir(), "rxe-cpio.").unwrap();
        let archive = dir.path().join("a.cpio");
        fs::write(&archive, cpio.finish()).unwrap();
        let out = std::process::Command::new("cpio")
            .args(["-t", "--quiet", "-F"])
            .arg(&archive)
            .output()
            .expect("cpio is installed");
        assert!(out.status.success(), "{out:?}");
        let names = String::from_utf8(out.stdout).unwrap();
        assert_eq!(names, "bin\nbin/tool\nsbin\nsbin/x\ndev\ndev/console\n");
    }
}
