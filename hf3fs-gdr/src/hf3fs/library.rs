//! Loading `libhf3fs_api_shared` at run time: the usrbio symbols are required, the GDR
//! extension's (`hf3fs_iovcreate_device`, ...) optional, so one build runs against
//! 3FS with or without GPU-direct support, and against no 3FS at all.

use super::ffi;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// The library's file name, found through the loader's search path by default.
pub const DEFAULT_LIBRARY: &str = "libhf3fs_api_shared.so";

/// Environment variable naming the 3FS library to load.
pub const LIBRARY_ENV: &str = "HF3FS_GDR_LIBRARY";

/// The required usrbio entry points.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Usrbio {
    pub extract_mount_point: ffi::ExtractMountPointFn,
    pub iovcreate: ffi::IovCreateFn,
    pub iovopen: ffi::IovOpenFn,
    pub iovwrap: ffi::IovWrapFn,
    pub iovunlink: ffi::IovVoidFn,
    pub iovdestroy: ffi::IovVoidFn,
    pub iorcreate4: ffi::IorCreate4Fn,
    pub iordestroy: ffi::IorDestroyFn,
    pub reg_fd: ffi::RegFdFn,
    pub dereg_fd: ffi::DeregFdFn,
    pub prep_io: ffi::PrepIoFn,
    pub submit_ios: ffi::SubmitIosFn,
    pub wait_for_ios: ffi::WaitForIosFn,
}

/// The GDR extension's entry points, each present or not.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Gdr {
    pub iovcreate_device: Option<ffi::IovCreateDeviceFn>,
    pub iovopen_device: Option<ffi::IovOpenFn>,
    pub iovwrap_device: Option<ffi::IovWrapFn>,
    pub gdr_available: Option<ffi::GdrAvailableFn>,
    pub gdr_device_count: Option<ffi::GdrDeviceCountFn>,
    pub iov_mem_type: Option<ffi::IovMemTypeFn>,
    pub iov_device_id: Option<ffi::IovDeviceIdFn>,
    pub iovsync: Option<ffi::IovSyncFn>,
}

/// A loaded `libhf3fs_api_shared` (never unloaded: iovs and rings may outlive any
/// handle to it, and 3FS keeps process-wide state).
#[derive(Debug)]
pub struct Library {
    path: PathBuf,
    pub(crate) usrbio: Usrbio,
    pub(crate) gdr: Gdr,
    pub(crate) is_hf3fs: Option<ffi::IsHf3fsFn>,
    /// Descriptors registered with this library: our fd number → (dev, ino) it named.
    pub(crate) fds: Mutex<HashMap<i32, (u64, u64)>>,
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns null or a thread-local NUL-terminated string.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next dl* call on this thread.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

struct Handle(*mut libc::c_void);

impl Handle {
    /// The symbol's address, or `None` when the library lacks it.
    fn symbol(&self, name: &str) -> Option<*mut libc::c_void> {
        let cname = CString::new(name).expect("symbol names have no NUL");
        // SAFETY: a live handle from dlopen (never closed) and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.0, cname.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

macro_rules! required {
    ($handle:expr, $path:expr, $name:literal, $ty:ty) => {{
        let p = $handle.symbol($name).ok_or_else(|| {
            Error::Unsupported(format!(
                "{} lacks {} (not a 3FS usrbio library?)",
                $path.display(),
                $name
            ))
        })?;
        // SAFETY: the symbol of this name in libhf3fs_api_shared has the C signature of
        // hf3fs_usrbio.h that `$ty` mirrors.
        unsafe { std::mem::transmute::<*mut libc::c_void, $ty>(p) }
    }};
}

macro_rules! optional {
    ($handle:expr, $name:literal, $ty:ty) => {
        $handle.symbol($name).map(|p| {
            // SAFETY: as for `required!`: the header's signature for this name.
            unsafe { std::mem::transmute::<*mut libc::c_void, $ty>(p) }
        })
    };
}

impl Library {
    /// Loads the library at `path` (a bare file name goes through the loader's search
    /// path). A missing file or a library without the usrbio symbols is
    /// [`Error::Unsupported`] naming why.
    fn load(path: &Path) -> Result<Self> {
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::InvalidArgument(format!("library path {path:?} has a NUL")))?;
        // SAFETY: NUL-terminated path; loading runs the library's constructors, which is
        // what using 3FS means.
        let raw = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if raw.is_null() {
            return Err(Error::Unsupported(format!(
                "3FS library {} does not load: {}",
                path.display(),
                dlerror_text()
            )));
        }
        let h = Handle(raw);
        let usrbio = Usrbio {
            extract_mount_point: required!(
                h,
                path,
                "hf3fs_extract_mount_point",
                ffi::ExtractMountPointFn
            ),
            iovcreate: required!(h, path, "hf3fs_iovcreate", ffi::IovCreateFn),
            iovopen: required!(h, path, "hf3fs_iovopen", ffi::IovOpenFn),
            iovwrap: required!(h, path, "hf3fs_iovwrap", ffi::IovWrapFn),
            iovunlink: required!(h, path, "hf3fs_iovunlink", ffi::IovVoidFn),
            iovdestroy: required!(h, path, "hf3fs_iovdestroy", ffi::IovVoidFn),
            iorcreate4: required!(h, path, "hf3fs_iorcreate4", ffi::IorCreate4Fn),
            iordestroy: required!(h, path, "hf3fs_iordestroy", ffi::IorDestroyFn),
            reg_fd: required!(h, path, "hf3fs_reg_fd", ffi::RegFdFn),
            dereg_fd: required!(h, path, "hf3fs_dereg_fd", ffi::DeregFdFn),
            prep_io: required!(h, path, "hf3fs_prep_io", ffi::PrepIoFn),
            submit_ios: required!(h, path, "hf3fs_submit_ios", ffi::SubmitIosFn),
            wait_for_ios: required!(h, path, "hf3fs_wait_for_ios", ffi::WaitForIosFn),
        };
        let gdr = Gdr {
            iovcreate_device: optional!(h, "hf3fs_iovcreate_device", ffi::IovCreateDeviceFn),
            iovopen_device: optional!(h, "hf3fs_iovopen_device", ffi::IovOpenFn),
            iovwrap_device: optional!(h, "hf3fs_iovwrap_device", ffi::IovWrapFn),
            gdr_available: optional!(h, "hf3fs_gdr_available", ffi::GdrAvailableFn),
            gdr_device_count: optional!(h, "hf3fs_gdr_device_count", ffi::GdrDeviceCountFn),
            iov_mem_type: optional!(h, "hf3fs_iov_mem_type", ffi::IovMemTypeFn),
            iov_device_id: optional!(h, "hf3fs_iov_device_id", ffi::IovDeviceIdFn),
            iovsync: optional!(h, "hf3fs_iovsync", ffi::IovSyncFn),
        };
        let is_hf3fs = optional!(h, "hf3fs_is_hf3fs", ffi::IsHf3fsFn);
        Ok(Self {
            path: path.to_path_buf(),
            usrbio,
            gdr,
            is_hf3fs,
            fds: Mutex::default(),
        })
    }

    /// The library at `path` (`None`: `$HF3FS_GDR_LIBRARY`, else
    /// [`DEFAULT_LIBRARY`]), loaded once per path per process.
    pub fn open(path: Option<&Path>) -> Result<Arc<Self>> {
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => std::env::var_os(LIBRARY_ENV)
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_LIBRARY)),
        };
        let mut loaded = loaded_table().lock();
        if let Some(lib) = loaded.get(&path) {
            return Ok(lib.clone());
        }
        let lib = Arc::new(Self::load(&path)?);
        loaded.insert(path, lib.clone());
        Ok(lib)
    }

    /// Where it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the GDR extension (`hf3fs_iovcreate_device`) is present.
    pub fn has_gdr(&self) -> bool {
        self.gdr.iovcreate_device.is_some()
    }

    /// The 3FS mount `path` lies on (`hf3fs_extract_mount_point`), `None` if it is not
    /// on one.
    #[doc(alias = "hf3fs_extract_mount_point")]
    pub fn mount_point_of(&self, path: &Path) -> Result<Option<PathBuf>> {
        let cpath = c_path(path)?;
        let mut buf = vec![0 as libc::c_char; 4096];
        loop {
            // SAFETY: `buf` has `buf.len()` writable chars; `cpath` is NUL-terminated.
            let n = unsafe {
                (self.usrbio.extract_mount_point)(
                    buf.as_mut_ptr(),
                    buf.len() as i32,
                    cpath.as_ptr(),
                )
            };
            if n < 0 {
                return Ok(None);
            }
            if n as usize > buf.len() {
                buf.resize(n as usize, 0);
                continue;
            }
            // SAFETY: the library wrote a NUL-terminated string of n-1 chars into `buf`.
            let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
            return Ok(Some(PathBuf::from(std::ffi::OsStr::from_bytes(
                s.to_bytes(),
            ))));
        }
    }

    /// Whether `fd` is a file on a 3FS mount (`hf3fs_is_hf3fs`; `None` if the library
    /// lacks the call).
    #[doc(alias = "hf3fs_is_hf3fs")]
    pub fn is_hf3fs(&self, fd: std::os::fd::RawFd) -> Option<bool> {
        // SAFETY: a plain int argument; the library checks the descriptor.
        self.is_hf3fs.map(|f| unsafe { f(fd) })
    }

    /// `hf3fs_gdr_available`, false without the GDR extension.
    #[doc(alias = "hf3fs_gdr_available")]
    pub fn gdr_available(&self) -> bool {
        // SAFETY: no arguments.
        self.gdr.gdr_available.is_some_and(|f| unsafe { f() })
    }

    /// `hf3fs_gdr_device_count`, 0 without the GDR extension.
    #[doc(alias = "hf3fs_gdr_device_count")]
    pub fn gdr_device_count(&self) -> usize {
        // SAFETY: no arguments.
        self.gdr
            .gdr_device_count
            .map_or(0, |f| unsafe { f() }.max(0) as usize)
    }

    /// Registers `fd` (already in our registry, naming `(dev, ino)`) with 3FS on first
    /// use (`hf3fs_reg_fd`).
    pub(crate) fn ensure_registered(&self, fd: i32, identity: (u64, u64)) -> Result<()> {
        let mut fds = self.fds.lock();
        match fds.get(&fd) {
            Some(&known) if known == identity => return Ok(()),
            Some(_) => {
                // The number names another file now: 3FS refuses a re-registration of a
                // number unless it was deregistered.
                // SAFETY: plain int argument.
                unsafe { (self.usrbio.dereg_fd)(fd) };
                fds.remove(&fd);
            }
            None => {}
        }
        // SAFETY: plain arguments; the library dups the descriptor itself.
        let ret = unsafe { (self.usrbio.reg_fd)(fd, 0) };
        if ret > 0 {
            return Err(Error::Hf3fs {
                call: "hf3fs_reg_fd",
                errno: ret,
            });
        }
        fds.insert(fd, identity);
        Ok(())
    }

    /// `hf3fs_dereg_fd` if `fd` was registered with this library.
    pub(crate) fn forget_fd(&self, fd: i32) {
        if self.fds.lock().remove(&fd).is_some() {
            // SAFETY: plain int argument.
            unsafe { (self.usrbio.dereg_fd)(fd) };
        }
    }
}

type LoadedTable = Mutex<HashMap<PathBuf, Arc<Library>>>;

fn loaded_table() -> &'static LoadedTable {
    static LOADED: OnceLock<LoadedTable> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// Every library loaded so far (for `dereg_fd`).
pub(crate) fn loaded_libraries() -> Vec<Arc<Library>> {
    loaded_table().lock().values().cloned().collect()
}

pub(crate) fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::InvalidArgument(format!("path {path:?} has a NUL")))
}
