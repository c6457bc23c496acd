//! Compiling device code at run time with NVRTC (loaded at run time as well, so builds
//! need no CUDA toolkit).
//!
//! NVRTC has no view of a crate's files once it is built, so the headers a program
//! includes are handed over with the source: [`CompileOptions::header`] makes a string
//! includable by name (a crate embeds its `.cuh` files with `include_str!`), and
//! [`CompileOptions::include_dir`] adds a folder NVRTC searches on disk (a CUDA toolkit's
//! `include`, a user's own headers). A layer above adds its device library's headers on
//! top (`gpunetio::device_code::compile` adds `gpunetio/gio_device.cuh`).

use crate::error::{Error, Result};
use cudarc::nvrtc::sys;
use cudarc::nvrtc::Ptx;
use std::borrow::Cow;
use std::ffi::{c_char, CString};
use std::path::PathBuf;

/// How to compile a program.
#[derive(Debug, Clone)]
pub struct CompileOptions {
    /// Virtual architecture, e.g. `compute_90` (H100).
    pub arch: String,
    /// `NAME` or `NAME=VALUE` preprocessor definitions.
    pub defines: Vec<String>,
    /// Further NVRTC options, passed as given.
    pub extra: Vec<String>,
    /// Headers includable by name (`("mylib/api.cuh", source)`), looked up before the
    /// include folders. When two have the same name, the last one given is used (so a
    /// caller can replace a header a layer added).
    pub headers: Vec<(Cow<'static, str>, Cow<'static, str>)>,
    /// Folders searched for `#include`s that no embedded header answers
    /// (`--include-path`), in order.
    pub include_dirs: Vec<PathBuf>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        Self {
            arch: "compute_90".into(),
            defines: Vec::new(),
            extra: Vec::new(),
            headers: Vec::new(),
            include_dirs: Vec::new(),
        }
    }
}

impl CompileOptions {
    /// For the compute capability of `gpu`.
    pub fn for_gpu(gpu: &crate::Gpu) -> Result<Self> {
        let (major, minor) = gpu.compute_capability()?;
        Ok(Self {
            arch: format!("compute_{major}{minor}"),
            ..Self::default()
        })
    }

    /// Adds a preprocessor definition.
    pub fn define(mut self, define: impl Into<String>) -> Self {
        self.defines.push(define.into());
        self
    }

    /// Makes `source` includable as `name`.
    pub fn header(
        mut self,
        name: impl Into<Cow<'static, str>>,
        source: impl Into<Cow<'static, str>>,
    ) -> Self {
        self.headers.push((name.into(), source.into()));
        self
    }

    /// Makes each `(name, source)` includable by its name (a device library's header
    /// table, e.g. `gpunetio_sys::HEADERS`).
    pub fn headers<N, S>(mut self, headers: impl IntoIterator<Item = (N, S)>) -> Self
    where
        N: Into<Cow<'static, str>>,
        S: Into<Cow<'static, str>>,
    {
        self.headers
            .extend(headers.into_iter().map(|(n, s)| (n.into(), s.into())));
        self
    }

    /// Adds a folder to search for headers on disk.
    pub fn include_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.include_dirs.push(dir.into());
        self
    }
}

/// Whether NVRTC can be loaded on this machine.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library; no NVRTC call is made.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_available() {
        return Err(Error::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion", "")?;
    Ok((major, minor))
}

/// Compiles `source` (named `name` in messages) to PTX, with the headers and include
/// folders of `options`.
pub fn compile(name: &str, source: &str, options: &CompileOptions) -> Result<Ptx> {
    if !nvrtc_available() {
        return Err(Error::NoNvrtc);
    }
    let cstr = |s: &str| {
        CString::new(s)
            .map_err(|_| Error::InvalidArgument(format!("a NUL byte in `{name}` or its options")))
    };
    let src = cstr(source)?;
    let cname = cstr(name)?;
    // NVRTC refuses two headers of one name (NVRTC_ERROR_INVALID_INPUT): the last one
    // given replaces the earlier ones, so a caller can replace a layer's header.
    let mut chosen: Vec<&(Cow<'static, str>, Cow<'static, str>)> = Vec::new();
    for header in options.headers.iter().rev() {
        if !chosen.iter().any(|c| c.0 == header.0) {
            chosen.push(header);
        }
    }
    chosen.reverse();
    let headers: Vec<CString> = chosen.iter().map(|(_, h)| cstr(h)).collect::<Result<_>>()?;
    let include_names: Vec<CString> = chosen.iter().map(|(n, _)| cstr(n)).collect::<Result<_>>()?;
    let header_ptrs: Vec<*const c_char> = headers.iter().map(|h| h.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = include_names.iter().map(|h| h.as_ptr()).collect();
    let mut opts = vec![
        format!("--gpu-architecture={}", options.arch),
        "--std=c++17".into(),
    ];
    opts.extend(options.defines.iter().map(|d| format!("-D{d}")));
    for dir in &options.include_dirs {
        let dir = dir.to_str().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "include folder {} of `{name}` is not UTF-8",
                dir.display()
            ))
        })?;
        opts.push(format!("--include-path={dir}"));
    }
    opts.extend(options.extra.iter().cloned());
    let copts: Vec<CString> = opts.iter().map(|o| cstr(o)).collect::<Result<_>>()?;
    let opt_ptrs: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();

    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a NUL-terminated string alive for this call; the
    // two header arrays have `header_ptrs.len()` entries each.
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            header_ptrs.len() as i32,
            header_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    };
    check(r, "nvrtcCreateProgram", name)?;
    let program = Program(prog);
    // SAFETY: a live program and `opt_ptrs.len()` valid option strings.
    let compiled =
        unsafe { sys::nvrtcCompileProgram(program.0, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Compile {
            name: name.to_string(),
            code: format!("{compiled:?}"),
            log: program.log(),
        });
    }
    let mut size = 0usize;
    // SAFETY: a compiled program and a valid out-pointer.
    let r = unsafe { sys::nvrtcGetPTXSize(program.0, &mut size) };
    check(r, "nvrtcGetPTXSize", name)?;
    let mut ptx = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes NVRTC reported.
    let r = unsafe { sys::nvrtcGetPTX(program.0, ptx.as_mut_ptr().cast()) };
    check(r, "nvrtcGetPTX", name)?;
    while ptx.last() == Some(&0) {
        ptx.pop();
    }
    let text = String::from_utf8(ptx).map_err(|_| Error::Compile {
        name: name.to_string(),
        code: "PTX is not UTF-8".into(),
        log: String::new(),
    })?;
    Ok(Ptx::from_src(text))
}

fn check(r: sys::nvrtcResult, call: &str, name: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Compile {
            name: name.to_string(),
            code: format!("{call}: {r:?}"),
            log: String::new(),
        })
    }
}

/// Destroys the program on drop.
struct Program(sys::nvrtcProgram);

impl Program {
    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        let r = unsafe { sys::nvrtcGetProgramLogSize(self.0, &mut size) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return String::new();
        }
        let mut log = vec![0u8; size];
        // SAFETY: the buffer holds the `size` bytes NVRTC reported.
        let r = unsafe { sys::nvrtcGetProgramLog(self.0, log.as_mut_ptr().cast()) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .to_string()
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        let r = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            tracing::debug!("nvrtcDestroyProgram: {r:?}");
        }
    }
}
