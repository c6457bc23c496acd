//! What confines the daemon's clients: who may connect (by the credentials the kernel
//! recorded for the socket, never by anything a client says), and the only file system
//! changes the daemon makes for a client — removing the publications it proved it owns
//! when it dies. The daemon never opens a file by a name a client chose: memory and
//! files reach it as descriptors the client opened itself (`SCM_RIGHTS`), so a client
//! can reach only what its own credentials reach, and the access mode it opened with is
//! never widened.
//!
//! Removal works on directory descriptors the daemon opened at start (the mount's
//! `3fs-virt/iovs` and `/dev/shm`), by one path component, with the entry's identity
//! (device, inode, owner) checked just before `unlinkat`. Both directories are sticky
//! (`/dev/shm` is `1777`, the daemon makes `iovs` `1733`): an entry a client owns can
//! be replaced only by that client (or root), so what the daemon removes is always a
//! name the client could have removed itself.

use crate::error::{os_err, Error, Result};
use crate::shm::{cstring, fstat, to_hex, Id, SHM_DIR};
use crate::virt::{self, GdrLink};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// Who may connect (see [`super::DaemonConfig::allow_uids`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct Admission {
    pub daemon_uid: u32,
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
}

impl Admission {
    /// Root, the daemon's own user, a listed user, or a listed primary group.
    pub(crate) fn admits(&self, uid: u32, gid: u32) -> bool {
        uid == 0 || uid == self.daemon_uid || self.uids.contains(&uid) || self.gids.contains(&gid)
    }

    /// Whether only root and the daemon's user may connect (the socket can then be
    /// `0600`; with other users or groups admitted it must be `0666`, and the check
    /// at connect is what keeps others out).
    pub(crate) fn owner_only(&self) -> bool {
        self.uids.is_empty() && self.gids.is_empty()
    }
}

fn open_dir(path: &Path) -> Result<OwnedFd> {
    let c = cstring(path)?;
    // SAFETY: NUL-terminated path; the descriptor is owned below. O_NOFOLLOW: the
    // directory itself is not a symlink someone planted.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(os_err(
            "open",
            std::io::Error::last_os_error(),
            path.display(),
        ));
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
fn stat_entry(dir: &OwnedFd, name: &str) -> Option<libc::stat> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a directory descriptor, a NUL-terminated name, a valid out-pointer.
    let ret = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            c.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    (ret == 0).then_some(st)
}

fn read_link_at(dir: &OwnedFd, name: &str) -> Option<String> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: a directory descriptor, a NUL-terminated name, a buffer of the size given.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            c.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 || n as usize >= buf.len() {
        return None;
    }
    buf.truncate(n as usize);
    String::from_utf8(buf).ok()
}

fn unlink_at(dir: &OwnedFd, name: &str) {
    let Ok(c) = std::ffi::CString::new(name) else {
        return;
    };
    // SAFETY: a directory descriptor and a NUL-terminated single component.
    unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) };
}

/// The entry `name` of `/dev/shm` a host publication names, if it names one directly
/// (no further directories, no `..`).
fn shm_component(target: &str) -> Option<&str> {
    let name = target.strip_prefix(SHM_DIR)?.strip_prefix('/')?;
    (!name.is_empty() && !name.contains('/') && name != "." && name != "..").then_some(name)
}

fn owned_by(dir: &OwnedFd, path: &Path, daemon_uid: u32) -> Result<()> {
    let st = fstat(dir, path)?;
    if st.st_uid != daemon_uid {
        return Err(Error::InvalidArgument(format!(
            "{} belongs to uid {}, not the daemon's uid {daemon_uid}: remove it and let the \
             daemon create it",
            path.display(),
            st.st_uid
        )));
    }
    Ok(())
}

/// Opens a publication directory, checks it is the daemon's and makes it `1733`.
fn drop_box(path: &Path, daemon_uid: u32) -> Result<OwnedFd> {
    let dir = open_dir(path)?;
    owned_by(&dir, path, daemon_uid)?;
    // SAFETY: a directory descriptor we own.
    if unsafe { libc::fchmod(dir.as_raw_fd(), 0o1733) } < 0 {
        return Err(os_err(
            "fchmod",
            std::io::Error::last_os_error(),
            path.display(),
        ));
    }
    Ok(dir)
}

/// A publication a client proved it owns, as it was when it claimed it.
#[derive(Debug, Clone)]
pub(crate) struct OwnedPublication {
    /// Device and inode of the symlink `iovs/<id hex>`.
    link: (u64, u64),
    /// The `/dev/shm` entry to remove too, and its device and inode.
    segment: Option<(String, u64, u64)>,
}

/// The directories the daemon removes publications from, opened once at start.
#[derive(Debug)]
pub(crate) struct Dirs {
    iovs: OwnedFd,
    shm: OwnedFd,
}

impl Dirs {
    /// Opens `<mount>/3fs-virt/iovs` and `/dev/shm`. The virtual directory and its
    /// `iovs`/`iors` must belong to the daemon's user (else another user could swap
    /// them); `iovs` and `iors` are made `1733`: every admitted user can publish, nobody
    /// but the daemon's user can list what others published, and the sticky bit keeps
    /// each user's links its own.
    pub(crate) fn open(mount: &Path, daemon_uid: u32) -> Result<Self> {
        let virt_path = mount.join(virt::VIRT_DIR);
        owned_by(&open_dir(&virt_path)?, &virt_path, daemon_uid)?;
        let iovs = drop_box(&virt::iovs_dir(mount), daemon_uid)?;
        drop_box(&virt::iors_dir(mount), daemon_uid)?;
        Ok(Self {
            iovs,
            shm: open_dir(Path::new(SHM_DIR))?,
        })
    }

    /// Checks a client's claim on publication `id`: the link `iovs/<id hex>` is the
    /// client's (`uid`); for a host iov (`fd`: the segment the client opened) the link
    /// names that very file directly under `/dev/shm`, and with `segment_too` the file
    /// is the client's as well; a GPU iov's link (no descriptor) is a `gdr://` link.
    pub(crate) fn verify_claim(
        &self,
        id: &Id,
        uid: u32,
        segment_too: bool,
        fd: Option<&OwnedFd>,
    ) -> std::result::Result<OwnedPublication, i32> {
        let name = to_hex(id);
        let link = stat_entry(&self.iovs, &name).ok_or(libc::ENOENT)?;
        if link.st_mode & libc::S_IFMT != libc::S_IFLNK || link.st_uid != uid {
            return Err(libc::EPERM);
        }
        let target = read_link_at(&self.iovs, &name).ok_or(libc::ENOENT)?;
        let segment = match fd {
            None if GdrLink::is_gdr(&target) => None,
            None => return Err(libc::EBADF),
            Some(fd) => {
                let component = shm_component(&target).ok_or(libc::EPERM)?;
                let entry = stat_entry(&self.shm, component).ok_or(libc::ENOENT)?;
                let held = fstat(fd, Path::new(&target)).map_err(|e| e.errno())?;
                if entry.st_mode & libc::S_IFMT != libc::S_IFREG
                    || (entry.st_dev, entry.st_ino) != (held.st_dev, held.st_ino)
                    || (segment_too && entry.st_uid != uid)
                {
                    return Err(libc::EPERM);
                }
                segment_too.then(|| (component.to_string(), entry.st_dev, entry.st_ino))
            }
        };
        Ok(OwnedPublication {
            link: (link.st_dev, link.st_ino),
            segment,
        })
    }

    /// Removes a dead client's publication: each entry only if it is still the one the
    /// client claimed (same device and inode).
    pub(crate) fn remove(&self, id: &Id, owned: &OwnedPublication) {
        let name = to_hex(id);
        if let Some((component, dev, ino)) = &owned.segment {
            if stat_entry(&self.shm, component)
                .is_some_and(|st| (st.st_dev, st.st_ino) == (*dev, *ino))
            {
                unlink_at(&self.shm, component);
            }
        }
        if stat_entry(&self.iovs, &name).is_some_and(|st| (st.st_dev, st.st_ino) == owned.link) {
            unlink_at(&self.iovs, &name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_and_shm_components() {
        let a = Admission {
            daemon_uid: 1000,
            uids: vec![2000],
            gids: vec![300],
        };
        assert!(a.admits(0, 0) && a.admits(1000, 5) && a.admits(2000, 5) && a.admits(7, 300));
        assert!(!a.admits(65534, 65534));
        assert!(!a.owner_only());
        assert!(Admission::default().owner_only());
        assert_eq!(shm_component("/dev/shm/x"), Some("x"));
        for bad in [
            "/dev/shm/",
            "/dev/shm/a/b",
            "/dev/shm/..",
            "/dev/shmx",
            "/etc/x",
        ] {
            assert_eq!(shm_component(bad), None, "{bad}");
        }
    }
}
