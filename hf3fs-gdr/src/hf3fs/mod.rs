//! The 3FS backend: where a real 3FS mount exists, [`Iov`](crate::Iov) and
//! [`Ior`](crate::Ior) call the official `libhf3fs_api_shared` (loaded at run time);
//! elsewhere they talk to the local `hf3fs-gdr-daemon`.
//!
//! # Which backend serves a mount
//! 1. A choice made with [`set_backend`] for that mount (canonical path), else
//! 2. `$HF3FS_GDR_BACKEND`: `auto` (the default), `daemon`, or `3fs`, else `auto`:
//!    a mount whose file system is 3FS (`statfs` type `HF3FS_SUPER_MAGIC`) goes to the
//!    library, anything else to the local daemon (which reports
//!    [`Error::NoDaemon`] when none runs).
//!
//! The library is `$HF3FS_GDR_LIBRARY` if set, else `libhf3fs_api_shared.so` from the
//! loader's search path, or the path given in [`BackendChoice::Hf3fs`]. Choosing 3FS
//! where the library does not load, or for a path the library's
//! `hf3fs_extract_mount_point` says is not on a 3FS mount, is
//! [`Error::Unsupported`] with the reason.
//!
//! GPU iovs on 3FS need the library's GDR extension (`hf3fs_iovcreate_device`,
//! `hf3fs_iovopen_device`, `hf3fs_iovwrap_device`, `hf3fs_iovsync`, ...); every one of
//! those symbols is optional, and a missing one makes the matching call `Unsupported`.

pub mod ffi;
mod library;

pub use ffi::{HF3FS_SYNC_FROM_STORAGE, HF3FS_SYNC_TO_STORAGE};
pub(crate) use library::{c_path, loaded_libraries};
pub use library::{Library, DEFAULT_LIBRARY, LIBRARY_ENV};

use crate::error::{Error, Result};
use crate::shm::{to_hex, Id};
use parking_lot::Mutex;
use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// Environment variable choosing the backend: `auto`, `daemon` or `3fs`.
pub const BACKEND_ENV: &str = "HF3FS_GDR_BACKEND";

/// What serves a mount, as asked for ([`set_backend`], `$HF3FS_GDR_BACKEND`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// 3FS mounts → the library, anything else → the local daemon.
    #[default]
    Auto,
    /// The local `hf3fs-gdr-daemon`.
    LocalDaemon,
    /// The official library; `library` overrides `$HF3FS_GDR_LIBRARY` / the default.
    Hf3fs {
        /// Path of `libhf3fs_api_shared.so` to load.
        library: Option<PathBuf>,
    },
}

impl std::str::FromStr for BackendChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Self::Auto),
            "daemon" | "local" => Ok(Self::LocalDaemon),
            "3fs" | "hf3fs" => Ok(Self::Hf3fs { library: None }),
            other => Err(Error::InvalidArgument(format!(
                "{BACKEND_ENV}={other:?}: expected auto, daemon or 3fs"
            ))),
        }
    }
}

/// What serves a mount, resolved ([`backend_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The local `hf3fs-gdr-daemon`.
    LocalDaemon,
    /// The official `libhf3fs_api_shared`.
    Hf3fs,
}

/// The backend resolved for one call, with what it needs.
#[derive(Debug, Clone)]
pub(crate) enum Resolved {
    Daemon,
    Hf3fs {
        lib: Arc<Library>,
        /// The 3FS mount point (from `hf3fs_extract_mount_point`).
        mount_point: PathBuf,
    },
}

type Choices = Mutex<HashMap<PathBuf, BackendChoice>>;

fn choices() -> &'static Choices {
    static CHOICES: OnceLock<Choices> = OnceLock::new();
    CHOICES.get_or_init(Default::default)
}

fn canonical_or_given(mount: &Path) -> PathBuf {
    mount.canonicalize().unwrap_or_else(|_| mount.to_path_buf())
}

/// Chooses the backend of `mount` for this process (overrides `$HF3FS_GDR_BACKEND`);
/// [`BackendChoice::Auto`] restores the default rule. Iovs and rings made before keep
/// theirs.
pub fn set_backend(mount: impl AsRef<Path>, choice: BackendChoice) {
    let mount = canonical_or_given(mount.as_ref());
    let mut table = choices().lock();
    if choice == BackendChoice::Auto {
        table.remove(&mount);
    } else {
        table.insert(mount, choice);
    }
}

/// Which backend serves `mount` now (see the module docs for the rule).
pub fn backend_of(mount: impl AsRef<Path>) -> Result<Backend> {
    Ok(match resolve(mount.as_ref())? {
        Resolved::Daemon => Backend::LocalDaemon,
        Resolved::Hf3fs { .. } => Backend::Hf3fs,
    })
}

/// Whether `path` is on a 3FS FUSE mount, by its file system type.
pub fn is_hf3fs_mount(path: impl AsRef<Path>) -> bool {
    let Ok(cpath) = c_path(path.as_ref()) else {
        return false;
    };
    // SAFETY: plain C struct filled by statfs.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: NUL-terminated path and a valid out-pointer.
    let ret = unsafe { libc::statfs(cpath.as_ptr(), &mut st) };
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    let f_type = st.f_type as u64 as u32;
    ret == 0 && f_type == ffi::HF3FS_SUPER_MAGIC
}

pub(crate) fn resolve(mount: &Path) -> Result<Resolved> {
    let chosen = choices().lock().get(&canonical_or_given(mount)).cloned();
    let choice = match chosen {
        Some(c) => c,
        None => match std::env::var(BACKEND_ENV) {
            Ok(v) => v.parse()?,
            Err(_) => BackendChoice::Auto,
        },
    };
    let library = match choice {
        BackendChoice::LocalDaemon => return Ok(Resolved::Daemon),
        BackendChoice::Auto if !is_hf3fs_mount(mount) => return Ok(Resolved::Daemon),
        BackendChoice::Auto => None,
        BackendChoice::Hf3fs { library } => library,
    };
    let lib = Library::open(library.as_deref())?;
    let mount_point = lib.mount_point_of(mount)?.ok_or_else(|| {
        Error::Unsupported(format!(
            "{} is not on a 3FS mount (hf3fs_extract_mount_point of {})",
            mount.display(),
            lib.path().display()
        ))
    })?;
    Ok(Resolved::Hf3fs { lib, mount_point })
}

/// `mount` as the C API takes it (shorter than `mount_point[256]`).
pub(crate) fn c_mount(mount: &Path) -> Result<std::ffi::CString> {
    let c = c_path(mount)?;
    if c.as_bytes().len() >= 256 {
        return Err(Error::InvalidArgument(format!(
            "3FS mount point {} is longer than 255 bytes",
            mount.display()
        )));
    }
    Ok(c)
}

/// A 3FS return value: ≥ 0 is success, −errno is [`Error::Hf3fs`].
pub(crate) fn cvt(call: &'static str, ret: libc::c_int) -> Result<libc::c_int> {
    if ret < 0 {
        Err(Error::Hf3fs { call, errno: -ret })
    } else {
        Ok(ret)
    }
}

/// How a library iov came to be, which decides what unlink and destroy may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LibIovKind {
    /// `hf3fs_iovcreate` / `hf3fs_iovcreate_device`: ours to unlink and free.
    Created,
    /// `hf3fs_iovopen` / `hf3fs_iovopen_device`: only our mapping is ours.
    Opened,
    /// `hf3fs_iovwrap`: 3FS keeps no handle (`iovh` is null), so neither unlink nor
    /// destroy may be called.
    WrappedHost,
    /// `hf3fs_iovwrap_device`: our publication and registration, not the memory.
    WrappedDevice,
}

/// An iov the library made: its C struct (boxed: the library may keep its address).
#[derive(Debug)]
pub(crate) struct LibIov {
    pub(crate) lib: Arc<Library>,
    /// In a cell: the library writes it (unlink, destroy) while rings read it.
    raw: Box<UnsafeCell<ffi::hf3fs_iov>>,
    pub(crate) kind: LibIovKind,
    pub(crate) device: Option<usize>,
    unlinked: Mutex<bool>,
}

// SAFETY: the C struct's pointers are the library's handle and the mapped memory, both
// process-wide and valid from any thread; mutation goes through the library, which
// serialises its own state.
unsafe impl Send for LibIov {}
// SAFETY: see `Send`.
unsafe impl Sync for LibIov {}

impl LibIov {
    fn new(lib: Arc<Library>, raw: Box<ffi::hf3fs_iov>, kind: LibIovKind) -> Self {
        let raw = Box::new(UnsafeCell::new(*raw));
        let device = match (kind, lib.gdr.iov_mem_type, lib.gdr.iov_device_id) {
            (_, Some(mem_type), Some(device_id)) => {
                // SAFETY: a struct the library filled in and still owns a handle for.
                let t = unsafe { mem_type(raw.get()) };
                // SAFETY: as above.
                let d = unsafe { device_id(raw.get()) };
                (t == ffi::HF3FS_MEM_DEVICE && d >= 0).then_some(d as usize)
            }
            _ => None,
        };
        Self {
            lib,
            raw,
            kind,
            device,
            unlinked: Mutex::new(false),
        }
    }

    /// `hf3fs_iovcreate`.
    pub(crate) fn create(
        lib: Arc<Library>,
        mount: &Path,
        size: u64,
        block_size: u64,
        numa: i32,
    ) -> Result<Self> {
        let cmount = c_mount(mount)?;
        let mut raw = Box::new(ffi::hf3fs_iov::zeroed());
        // SAFETY: `raw` is a writable struct; `cmount` NUL-terminated and < 256 bytes.
        let ret = unsafe {
            (lib.usrbio.iovcreate)(
                &mut *raw,
                cmount.as_ptr(),
                size as usize,
                block_size as usize,
                numa,
            )
        };
        cvt("hf3fs_iovcreate", ret)?;
        Ok(Self::new(lib, raw, LibIovKind::Created))
    }

    /// `hf3fs_iovcreate_device` (GDR extension).
    pub(crate) fn create_device(
        lib: Arc<Library>,
        mount: &Path,
        size: u64,
        block_size: u64,
        device: usize,
    ) -> Result<Self> {
        let f = lib
            .gdr
            .iovcreate_device
            .ok_or_else(|| no_gdr(&lib, "hf3fs_iovcreate_device"))?;
        let cmount = c_mount(mount)?;
        let device_id = device_arg(device)?;
        let mut raw = Box::new(ffi::hf3fs_iov::zeroed());
        // SAFETY: as in `create`.
        let ret = unsafe {
            f(
                &mut *raw,
                cmount.as_ptr(),
                size as usize,
                block_size as usize,
                device_id,
            )
        };
        cvt("hf3fs_iovcreate_device", ret)?;
        let mut iov = Self::new(lib, raw, LibIovKind::Created);
        iov.device.get_or_insert(device);
        Ok(iov)
    }

    /// `hf3fs_iovopen`, or `hf3fs_iovopen_device` when `device` is given.
    pub(crate) fn open(
        lib: Arc<Library>,
        id: &Id,
        mount: &Path,
        size: u64,
        block_size: u64,
        numa: i32,
        device: Option<usize>,
    ) -> Result<Self> {
        let (f, call, last) = match device {
            None => (lib.usrbio.iovopen, "hf3fs_iovopen", numa),
            Some(d) => (
                lib.gdr
                    .iovopen_device
                    .ok_or_else(|| no_gdr(&lib, "hf3fs_iovopen_device"))?,
                "hf3fs_iovopen_device",
                device_arg(d)?,
            ),
        };
        let cmount = c_mount(mount)?;
        let mut raw = Box::new(ffi::hf3fs_iov::zeroed());
        // SAFETY: writable struct, 16-byte id, NUL-terminated mount.
        let ret = unsafe {
            f(
                &mut *raw,
                id.as_ptr(),
                cmount.as_ptr(),
                size as usize,
                block_size as usize,
                last,
            )
        };
        cvt(call, ret)?;
        let mut iov = Self::new(lib, raw, LibIovKind::Opened);
        if let Some(d) = device {
            iov.device.get_or_insert(d);
        }
        Ok(iov)
    }

    /// `hf3fs_iovwrap`, or `hf3fs_iovwrap_device` when `device` is given.
    ///
    /// # Safety
    /// `base` stays valid for `size` bytes while the iov and I/O on it live.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn wrap(
        lib: Arc<Library>,
        base: *mut u8,
        id: &Id,
        mount: &Path,
        size: u64,
        block_size: u64,
        numa: i32,
        device: Option<usize>,
    ) -> Result<Self> {
        let (f, call, last, kind) = match device {
            None => (
                lib.usrbio.iovwrap,
                "hf3fs_iovwrap",
                numa,
                LibIovKind::WrappedHost,
            ),
            Some(d) => (
                lib.gdr
                    .iovwrap_device
                    .ok_or_else(|| no_gdr(&lib, "hf3fs_iovwrap_device"))?,
                "hf3fs_iovwrap_device",
                device_arg(d)?,
                LibIovKind::WrappedDevice,
            ),
        };
        let cmount = c_mount(mount)?;
        let mut raw = Box::new(ffi::hf3fs_iov::zeroed());
        // SAFETY: writable struct, 16-byte id, NUL-terminated mount; the caller keeps
        // `base` valid.
        let ret = unsafe {
            f(
                &mut *raw,
                base.cast(),
                id.as_ptr(),
                cmount.as_ptr(),
                size as usize,
                block_size as usize,
                last,
            )
        };
        cvt(call, ret)?;
        let mut iov = Self::new(lib, raw, kind);
        if let Some(d) = device {
            iov.device.get_or_insert(d);
        }
        Ok(iov)
    }

    /// The library's struct, for calls that take it.
    pub(crate) fn as_ptr(&self) -> *mut ffi::hf3fs_iov {
        self.raw.get()
    }

    pub(crate) fn id(&self) -> Id {
        // SAFETY: the library fills `id` at creation and never changes it.
        unsafe { (*self.raw.get()).id }
    }

    pub(crate) fn base(&self) -> u64 {
        // SAFETY: as for `id`.
        unsafe { (*self.raw.get()).base as u64 }
    }

    /// `hf3fs_iovunlink`, once, where 3FS allows it.
    pub(crate) fn unlink(&self) {
        let mut done = self.unlinked.lock();
        if *done || !matches!(self.kind, LibIovKind::Created | LibIovKind::WrappedDevice) {
            return;
        }
        *done = true;
        // SAFETY: a struct the library filled with a live handle (created or
        // device-wrapped, so `iovh` is set); the `unlinked` lock serialises unlinks.
        unsafe { (self.lib.usrbio.iovunlink)(self.raw.get()) };
    }

    /// `hf3fs_iovsync` (a no-op for host iovs, `Unsupported` without the symbol).
    pub(crate) fn sync(&self, direction: libc::c_int) -> Result<()> {
        if self.device.is_none() {
            return Ok(());
        }
        let f = self
            .lib
            .gdr
            .iovsync
            .ok_or_else(|| no_gdr(&self.lib, "hf3fs_iovsync"))?;
        // SAFETY: a live library iov.
        cvt("hf3fs_iovsync", unsafe { f(self.raw.get(), direction) }).map(drop)
    }
}

impl Drop for LibIov {
    fn drop(&mut self) {
        if self.kind == LibIovKind::WrappedHost {
            return;
        }
        // SAFETY: the library's own struct, destroyed once, after every ring holding
        // this iov for I/O in flight let go of it.
        unsafe { (self.lib.usrbio.iovdestroy)(self.raw.get()) };
        tracing::trace!("3FS iov {} destroyed", to_hex(&self.id()));
    }
}

fn no_gdr(lib: &Library, symbol: &str) -> Error {
    Error::Unsupported(format!(
        "{} has no GDR extension ({symbol} missing): GPU iovs need a 3FS built with GDR",
        lib.path().display()
    ))
}

fn device_arg(device: usize) -> Result<libc::c_int> {
    libc::c_int::try_from(device)
        .map_err(|_| Error::InvalidArgument(format!("GPU ordinal {device}")))
}
