//! The mount's virtual directory, where clients publish iovs for each other (3FS's
//! `<mount>/3fs-virt/`; the local daemon serves only iovs its clients register over the
//! socket, never one found here), and the `gdr://` link format of GPU iovs.
//!
//! - `<mount>/3fs-virt/iovs/<id hex>`: a symlink to the iov's `/dev/shm` file (host
//!   iovs), or to `gdr://v1/device/{N}/size/{S}/ipc/{128 hex digits}[/offset/{O}]`
//!   (GPU iovs: the CUDA-IPC handle of the allocation holding the iov, and the iov's
//!   offset inside it when it is not the allocation's start).
//! - `<mount>/3fs-virt/iors/`: kept for 3FS's layout; the local daemon's rings are
//!   sealed memfds passed over its socket, published nowhere.
//! - `<mount>/3fs-virt/daemon.sock`: the daemon's `SOCK_SEQPACKET` socket.

use crate::error::{os_err, Error, Result};
use crate::shm::{from_hex, to_hex, Id};
use gpu_mem::{IpcHandle, IPC_HANDLE_BYTES};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// The virtual directory's name under a mount.
pub const VIRT_DIR: &str = "3fs-virt";

/// `<mount>/3fs-virt/iovs`.
pub fn iovs_dir(mount: &Path) -> PathBuf {
    mount.join(VIRT_DIR).join("iovs")
}

/// `<mount>/3fs-virt/iors`.
pub fn iors_dir(mount: &Path) -> PathBuf {
    mount.join(VIRT_DIR).join("iors")
}

/// `<mount>/3fs-virt/daemon.sock`.
pub fn daemon_socket(mount: &Path) -> PathBuf {
    mount.join(VIRT_DIR).join("daemon.sock")
}

/// Creates the virtual directories if missing.
pub(crate) fn ensure_dirs(mount: &Path) -> Result<()> {
    if !mount.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "mount {} is not a directory",
            mount.display()
        )));
    }
    for dir in [iovs_dir(mount), iors_dir(mount)] {
        std::fs::create_dir_all(&dir).map_err(|e| os_err("mkdir", e, dir.display()))?;
    }
    Ok(())
}

/// The publication of an iov or ring named `id` in `dir`.
pub(crate) fn link_path(dir: &Path, id: &Id) -> PathBuf {
    dir.join(to_hex(id))
}

/// Publishes `target` as `dir/<id hex>` (fails if the name is taken).
pub(crate) fn publish(dir: &Path, id: &Id, target: &str) -> Result<PathBuf> {
    let link = link_path(dir, id);
    std::os::unix::fs::symlink(target, &link).map_err(|e| os_err("symlink", e, link.display()))?;
    Ok(link)
}

/// What `dir/<id hex>` points at.
pub(crate) fn read_publication(dir: &Path, id: &Id) -> Result<String> {
    let link = link_path(dir, id);
    match std::fs::read_link(&link) {
        Ok(target) => target
            .into_os_string()
            .into_string()
            .map_err(|t| Error::Malformed {
                what: "publication",
                detail: format!("{} points at non-UTF-8 {t:?}", link.display()),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::NotFound {
            id: to_hex(id),
            dir: dir.to_path_buf(),
        }),
        Err(e) => Err(os_err("readlink", e, link.display())),
    }
}

/// A GPU iov's publication: which device, how many bytes, the IPC handle of the
/// allocation and the iov's offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrLink {
    /// The GPU ordinal in the publishing process.
    pub device: usize,
    /// The iov's size in bytes.
    pub size: u64,
    /// The CUDA-IPC handle of the allocation holding the iov.
    pub ipc: IpcHandle,
    /// The iov's offset inside that allocation.
    pub offset: u64,
}

const GDR_PREFIX: &str = "gdr://v1/";

impl GdrLink {
    /// `gdr://v1/device/{N}/size/{S}/ipc/{hex}` (and `/offset/{O}` when not 0).
    pub fn format(&self) -> String {
        let mut s = format!(
            "{GDR_PREFIX}device/{}/size/{}/ipc/{}",
            self.device,
            self.size,
            to_hex(self.ipc.as_bytes())
        );
        if self.offset != 0 {
            s.push_str(&format!("/offset/{}", self.offset));
        }
        s
    }

    /// Whether a publication is a GPU link (else it is a shared memory path).
    pub fn is_gdr(target: &str) -> bool {
        target.starts_with(GDR_PREFIX)
    }

    /// Parses what [`GdrLink::format`] wrote.
    pub fn parse(target: &str) -> Result<Self> {
        let bad = |detail: &str| Error::Malformed {
            what: "gdr link",
            detail: format!("{target:?}: {detail}"),
        };
        let rest = target
            .strip_prefix(GDR_PREFIX)
            .ok_or_else(|| bad("does not start with gdr://v1/"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        if !(parts.len() == 6 || parts.len() == 8)
            || parts[0] != "device"
            || parts[2] != "size"
            || parts[4] != "ipc"
            || (parts.len() == 8 && parts[6] != "offset")
        {
            return Err(bad("expected device/N/size/S/ipc/HEX[/offset/O]"));
        }
        let device = parts[1]
            .parse()
            .map_err(|_| bad("device is not a number"))?;
        let size = parts[3].parse().map_err(|_| bad("size is not a number"))?;
        let handle = from_hex(parts[5])
            .filter(|b| b.len() == IPC_HANDLE_BYTES)
            .ok_or_else(|| bad("ipc is not 128 hex digits"))?;
        let ipc = IpcHandle::from_bytes(&handle)?;
        let offset = match parts.get(7) {
            Some(o) => o.parse().map_err(|_| bad("offset is not a number"))?,
            None => 0,
        };
        Ok(Self {
            device,
            size,
            ipc,
            offset,
        })
    }
}

/// How an iov is handed to the daemon (`OP_REG_IOV`): the daemon never opens an iov
/// by its name, so a process can give it only memory it could open itself.
#[derive(Debug)]
pub(crate) enum IovRegistration {
    /// The `/dev/shm` file of a host iov, opened read-write by this process.
    Host(OwnedFd),
    /// A GPU iov's device, size, offset and CUDA-IPC handle.
    Gpu(GdrLink),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdr_links_round_trip_and_reject_garbage() {
        let link = GdrLink {
            device: 3,
            size: 1 << 30,
            ipc: IpcHandle(std::array::from_fn(|i| i as u8)),
            offset: 0,
        };
        let s = link.format();
        assert!(s.starts_with("gdr://v1/device/3/size/1073741824/ipc/000102"));
        assert!(GdrLink::is_gdr(&s));
        assert_eq!(GdrLink::parse(&s).unwrap(), link);
        let with_offset = GdrLink {
            offset: 4096,
            ..link
        };
        assert!(with_offset.format().ends_with("/offset/4096"));
        assert_eq!(GdrLink::parse(&with_offset.format()).unwrap(), with_offset);
        for bad in [
            "/dev/shm/x",
            "gdr://v1/device/x/size/1/ipc/00",
            "gdr://v1/device/0/size/1/ipc/00",
            "gdr://v1/device/0/size/1/ipc",
            &format!("{s}/offset"),
        ] {
            assert!(
                matches!(GdrLink::parse(bad), Err(Error::Malformed { .. })),
                "{bad}"
            );
        }
    }
}
