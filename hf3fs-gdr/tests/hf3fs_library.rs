//! The 3FS library backend against a fake `libhf3fs_api_shared.so` built here from C
//! (tests/fixtures/fake_hf3fs.c): it records every call with its arguments, so these
//! tests check what `Iov`/`Ior` marshal through the C ABI — not 3FS itself. Also: a
//! missing or wrong library and a path off 3FS are typed `Unsupported` errors.

mod cfixture;

use hf3fs_gdr::{
    backend_of, dereg_fd, reg_fd, set_backend, Backend, BackendChoice, Cqe, Error, Ior, Iov,
    SyncDirection, IOR_FORBID_READ_HOLES,
};
use std::ffi::{CStr, CString};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// One fake library (its own copy, so its own call log) serving `mount`.
struct Fake {
    _dir: tempfile::TempDir,
    lib: PathBuf,
    handle: *mut libc::c_void,
    mount: PathBuf,
}

impl Fake {
    /// Builds the fake (with the GDR extension if `gdr`) and makes it serve a fresh
    /// mount directory; `None` without a C compiler.
    fn build(gdr: bool) -> Option<Self> {
        let cc = cfixture::compiler()?;
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("libhf3fs_api_shared.so");
        let mut args = vec!["-shared", "-fPIC", "-pthread"];
        if gdr {
            args.push("-DFAKE_GDR");
        }
        cfixture::compile(&cc, &["fake_hf3fs.c"], &args, &lib);
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).unwrap();
        let mount = mount.canonicalize().unwrap();
        let c = CString::new(lib.to_str().unwrap()).unwrap();
        // SAFETY: the fake library; the same handle the crate will get for this path.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW) };
        assert!(!handle.is_null());
        let fake = Self {
            _dir: dir,
            lib,
            handle,
            mount,
        };
        let prefix = CString::new(fake.mount.to_str().unwrap()).unwrap();
        // SAFETY: the fixture's `void fake_hf3fs_set_mount(const char *)`.
        unsafe {
            let f: unsafe extern "C" fn(*const libc::c_char) = fake.symbol("fake_hf3fs_set_mount");
            f(prefix.as_ptr());
        }
        set_backend(
            &fake.mount,
            BackendChoice::Hf3fs {
                library: Some(fake.lib.clone()),
            },
        );
        Some(fake)
    }

    /// # Safety
    /// `T` is the fixture function's type.
    unsafe fn symbol<T: Copy>(&self, name: &str) -> T {
        let c = CString::new(name).unwrap();
        // SAFETY: live handle, NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        assert!(!p.is_null(), "fixture lacks {name}");
        // SAFETY: the caller names the right type; a function pointer is pointer-sized.
        unsafe { std::mem::transmute_copy(&p) }
    }

    /// The call log so far.
    fn log(&self) -> Vec<String> {
        // SAFETY: the fixture's `const char *fake_hf3fs_log(void)`, a NUL-terminated
        // static buffer.
        let text = unsafe {
            let f: unsafe extern "C" fn() -> *const libc::c_char = self.symbol("fake_hf3fs_log");
            CStr::from_ptr(f()).to_string_lossy().into_owned()
        };
        text.lines().map(str::to_string).collect()
    }

    /// The log lines after the first `skip`.
    fn since(&self, skip: usize) -> Vec<String> {
        self.log().split_off(skip)
    }

    fn fail_next(&self, call: &str, errno: i32) {
        let c = CString::new(call).unwrap();
        // SAFETY: the fixture's `void fake_hf3fs_fail_next(const char *, int)`.
        unsafe {
            let f: unsafe extern "C" fn(*const libc::c_char, libc::c_int) =
                self.symbol("fake_hf3fs_fail_next");
            f(c.as_ptr(), errno);
        }
    }

    fn m(&self) -> String {
        self.mount.display().to_string()
    }
}

fn hex(id: &[u8]) -> String {
    hf3fs_gdr::to_hex(id)
}

#[test]
fn a_missing_library_is_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere/libhf3fs_api_shared.so");
    set_backend(
        dir.path(),
        BackendChoice::Hf3fs {
            library: Some(missing.clone()),
        },
    );
    let err = Iov::create(dir.path(), 4096, 0, -1).unwrap_err();
    match &err {
        Error::Unsupported(why) => assert!(why.contains("does not load"), "{why}"),
        e => panic!("expected Unsupported, got {e:?}"),
    }
    assert_eq!(err.errno(), libc::ENOTSUP);
    assert!(matches!(
        Ior::create(dir.path(), 8, true, 0, Duration::ZERO, -1, 0),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(backend_of(dir.path()), Err(Error::Unsupported(_))));
    // Back to the default rule: a plain directory is the local daemon's.
    set_backend(dir.path(), BackendChoice::Auto);
    assert_eq!(backend_of(dir.path()).unwrap(), Backend::LocalDaemon);
    assert!(!hf3fs_gdr::hf3fs::is_hf3fs_mount(dir.path()));
}

#[test]
fn a_library_without_usrbio_symbols_is_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    // A real shared library that is not 3FS's.
    set_backend(
        dir.path(),
        BackendChoice::Hf3fs {
            library: Some("libm.so.6".into()),
        },
    );
    match Iov::create(dir.path(), 4096, 0, -1) {
        Err(Error::Unsupported(why)) => assert!(why.contains("lacks hf3fs_"), "{why}"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn the_backend_choice_parses() {
    assert_eq!(
        "auto".parse::<BackendChoice>().unwrap(),
        BackendChoice::Auto
    );
    assert_eq!(
        "DAEMON".parse::<BackendChoice>().unwrap(),
        BackendChoice::LocalDaemon
    );
    assert_eq!(
        "3fs".parse::<BackendChoice>().unwrap(),
        BackendChoice::Hf3fs { library: None }
    );
    assert!(matches!(
        "nfs".parse::<BackendChoice>(),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn a_path_off_3fs_is_unsupported() {
    let Some(fake) = Fake::build(false) else {
        return;
    };
    let elsewhere = tempfile::tempdir().unwrap();
    set_backend(
        elsewhere.path(),
        BackendChoice::Hf3fs {
            library: Some(fake.lib.clone()),
        },
    );
    match Iov::create(elsewhere.path(), 4096, 0, -1) {
        Err(Error::Unsupported(why)) => assert!(why.contains("not on a 3FS mount"), "{why}"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert_eq!(backend_of(&fake.mount).unwrap(), Backend::Hf3fs);
}

#[test]
fn host_iovs_and_rings_marshal_every_argument() {
    let Some(fake) = Fake::build(false) else {
        return;
    };
    let m = fake.m();
    let mut skip = fake.log().len();

    // hf3fs_iovcreate: the mount point the library extracted, sizes, NUMA node; the
    // iov takes the id and base the library filled in.
    let iov = Iov::create(&fake.mount, 1 << 20, 4096, 0).unwrap();
    assert_eq!(iov.backend(), Backend::Hf3fs);
    let id = hex(iov.id());
    assert_eq!(
        fake.since(skip),
        [format!(
            "iovcreate mount={m} size=1048576 block_size=4096 numa=0 -> {id}"
        )]
    );
    assert!(id.starts_with("a0a1a2"), "{id}");
    assert!(!iov.is_gpu());
    iov.write_at(100, b"through the library's memory").unwrap();
    let mut back = [0u8; 28];
    iov.read_at(100, &mut back).unwrap();
    assert_eq!(&back, b"through the library's memory");
    skip = fake.log().len();

    // hf3fs_iorcreate4: every argument in its place.
    let mut ior = Ior::create(
        &fake.mount,
        16,
        true,
        -4,
        Duration::from_millis(50),
        1,
        IOR_FORBID_READ_HOLES,
    )
    .unwrap();
    assert_eq!(ior.backend(), Backend::Hf3fs);
    assert!(ior.daemon_attached());
    assert_eq!(hex(ior.id()), "101112131415161718191a1b1c1d1e1f");
    assert_eq!(
        fake.since(skip),
        [format!(
            "iorcreate4 mount={m} entries=16 for_read=1 io_depth=-4 timeout=50 numa=1 flags=2"
        )]
    );
    skip = fake.log().len();

    // An unregistered descriptor never reaches the library.
    let file = tempfile::tempfile().unwrap();
    let fd = file.as_raw_fd();
    assert!(matches!(
        ior.prep_io(&iov, true, iov.base(), fd, 0, 4096, 1),
        Err(Error::FdNotRegistered(_))
    ));
    assert!(fake.since(skip).is_empty());

    // hf3fs_reg_fd on first use, then hf3fs_prep_io with the pointer, file range and
    // userdata as given.
    reg_fd(fd, 0).unwrap();
    let a = ior
        .prep_io(&iov, true, iov.base() + 8192, fd, 1 << 30, 4096, 0xfeed)
        .unwrap();
    let b = ior
        .prep_io(&iov, true, iov.base(), fd, 12345, 100, 7)
        .unwrap();
    assert_eq!((a, b), (0, 1));
    assert_eq!(ior.outstanding(), 2);
    assert_eq!(
        fake.since(skip),
        [
            format!("reg_fd fd={fd} flags=0"),
            format!(
                "prep_io iov={id} read=1 ptr_offset=8192 fd={fd} off=1073741824 len=4096 userdata=0xfeed -> 0"
            ),
            format!("prep_io iov={id} read=1 ptr_offset=0 fd={fd} off=12345 len=100 userdata=0x7 -> 1"),
        ]
    );
    skip = fake.log().len();

    // hf3fs_submit_ios, then hf3fs_wait_for_ios with the slot count, min_results and a
    // CLOCK_REALTIME deadline; completions come back with index, result and userdata.
    ior.submit_ios().unwrap();
    let mut cqes = [Cqe::default(); 4];
    let n = ior
        .wait_for_ios(&mut cqes, 2, Some(Instant::now() + Duration::from_secs(5)))
        .unwrap();
    assert_eq!(n, 2);
    assert_eq!(
        cqes[..2],
        [
            Cqe {
                index: 0,
                reserved: 0,
                result: 4096,
                userdata: 0xfeed
            },
            Cqe {
                index: 1,
                reserved: 0,
                result: 100,
                userdata: 7
            },
        ]
    );
    assert_eq!(ior.outstanding(), 0);
    // Without a deadline the pointer is null.
    assert_eq!(ior.wait_for_ios(&mut cqes, 0, None).unwrap(), 0);
    assert_eq!(
        fake.since(skip),
        [
            "submit_ios",
            "wait_for_ios cqec=4 min_results=2 deadline=within-an-hour",
            "wait_for_ios cqec=4 min_results=0 deadline=none",
        ]
    );
    skip = fake.log().len();

    // -errno from the library is a typed error carrying it.
    fake.fail_next("prep_io", libc::EBADF);
    match ior.prep_io(&iov, true, iov.base(), fd, 0, 10, 0) {
        Err(
            e @ Error::Hf3fs {
                call: "hf3fs_prep_io",
                errno,
            },
        ) => {
            assert_eq!(errno, libc::EBADF);
            assert_eq!(e.errno(), libc::EBADF);
        }
        other => panic!("expected Hf3fs error, got {other:?}"),
    }
    fake.fail_next("wait_for_ios", libc::EINTR);
    assert!(matches!(
        ior.wait_for_ios(&mut cqes, 0, Some(Instant::now())),
        Err(Error::Hf3fs {
            call: "hf3fs_wait_for_ios",
            errno: libc::EINTR
        })
    ));
    // A write on a read ring is refused before the library is called.
    assert!(matches!(
        ior.prep_io(&iov, false, iov.base(), fd, 0, 10, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(
        fake.since(skip),
        ["wait_for_ios cqec=4 min_results=0 deadline=past"]
    );
    skip = fake.log().len();

    // hf3fs_reg_fd's positive errno is an error too.
    let other = tempfile::tempfile().unwrap();
    reg_fd(other.as_raw_fd(), 0).unwrap();
    fake.fail_next("reg_fd", libc::EINVAL);
    assert!(matches!(
        ior.prep_io(&iov, true, iov.base(), other.as_raw_fd(), 0, 10, 0),
        Err(Error::Hf3fs {
            call: "hf3fs_reg_fd",
            errno: libc::EINVAL
        })
    ));
    dereg_fd(other.as_raw_fd());
    // dereg_fd reaches the library for a descriptor it registered.
    dereg_fd(fd);
    assert_eq!(
        fake.since(skip),
        [
            format!("reg_fd fd={} flags=0", other.as_raw_fd()),
            format!("dereg_fd fd={fd}"),
        ]
    );
    skip = fake.log().len();

    // A local-daemon iov cannot go on a 3FS ring.
    let local_mount = tempfile::tempdir().unwrap();
    let local = Iov::create(local_mount.path(), 4096, 0, -1).unwrap();
    assert_eq!(local.backend(), Backend::LocalDaemon);
    assert!(matches!(
        ior.prep_io(&local, true, local.base(), fd, 0, 10, 0),
        Err(Error::InvalidArgument(_))
    ));
    drop(local);

    // hf3fs_iovopen by id; hf3fs_iovwrap of caller memory (3FS keeps no handle for it,
    // so neither unlink nor destroy may be called on it).
    let opened = Iov::open(iov.id(), &fake.mount, 4096, 0, -1).unwrap();
    assert_eq!(opened.id(), iov.id());
    let mut mem = vec![0u8; 8192];
    let wrap_id = [0x55u8; 16];
    // SAFETY: `mem` outlives the wrapped iov.
    let wrapped =
        unsafe { Iov::wrap(mem.as_mut_ptr(), &wrap_id, &fake.mount, 8192, 0, 1) }.unwrap();
    assert_eq!(wrapped.base(), mem.as_ptr() as u64);
    drop(wrapped);
    drop(opened);
    let ptr = format!("{:p}", mem.as_ptr());
    assert_eq!(
        fake.since(skip),
        [
            format!("iovopen id={id} mount={m} size=4096 block_size=0 numa=-1"),
            format!(
                "iovwrap base={ptr} id={} mount={m} size=8192 block_size=0 numa=1",
                hex(&wrap_id)
            ),
            // The opened iov: its mapping only, never the owner's publication.
            format!("iovdestroy id={id}"),
        ]
    );
    skip = fake.log().len();

    // GPU iovs need the GDR extension, which this library lacks.
    match Iov::create_gpu(&fake.mount, 1 << 20, 0, 0) {
        Err(Error::Unsupported(why)) => assert!(why.contains("hf3fs_iovcreate_device"), "{why}"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
    // The ring goes first, then the iov: unlink (the owner's publication) and destroy.
    drop(ior);
    iov.unlink().unwrap();
    drop(iov);
    assert_eq!(
        fake.since(skip),
        [
            "iordestroy".to_string(),
            format!("iovunlink id={id}"),
            format!("iovdestroy id={id}"),
        ]
    );
    assert!(!fake.log().iter().any(|l| l.contains("NULL-HANDLE")));
}

#[test]
fn gpu_iovs_use_the_gdr_extension_when_present() {
    let Some(fake) = Fake::build(true) else {
        return;
    };
    let m = fake.m();
    let skip = fake.log().len();
    let gpu = Iov::create_gpu(&fake.mount, 1 << 20, 0, 1).unwrap();
    let id = hex(gpu.id());
    assert!(gpu.is_gpu());
    assert_eq!(gpu.gpu_device(), Some(1));
    gpu.sync(SyncDirection::ToStorage).unwrap();
    gpu.sync(SyncDirection::FromStorage).unwrap();
    // Another process would import it by id and device.
    let handle = hf3fs_gdr::GpuIovHandle {
        id: *gpu.id(),
        device: 1,
        size: 1 << 20,
        block_size: 0,
        offset: 0,
        ipc: gpu_mem::IpcHandle::from_bytes(&[0u8; gpu_mem::IPC_HANDLE_BYTES]).unwrap(),
    };
    let imported = Iov::import_gpu(&handle, &fake.mount).unwrap();
    assert!(imported.is_gpu());
    let framework_ptr = 0x7f00_0000_0000u64;
    let wrap_id = [0x77u8; 16];
    // SAFETY: the fake never touches the memory.
    let wrapped =
        unsafe { Iov::wrap_gpu(framework_ptr, &wrap_id, &fake.mount, 4096, 0, 0) }.unwrap();
    assert_eq!(wrapped.base(), framework_ptr);
    assert_eq!(wrapped.gpu_device(), Some(0));
    // Host iovs of a GDR library stay host iovs.
    let host = Iov::create(&fake.mount, 4096, 0, -1).unwrap();
    assert!(!host.is_gpu());
    let host_id = hex(host.id());
    drop((wrapped, imported, host));
    gpu.destroy().unwrap();
    assert_eq!(
        fake.since(skip),
        [
            format!("iovcreate_device mount={m} size=1048576 block_size=0 device=1 -> {id}"),
            format!("iovsync id={id} direction=0"),
            format!("iovsync id={id} direction=1"),
            format!("iovopen_device id={id} mount={m} size=1048576 block_size=0 device=1"),
            format!(
                "iovwrap_device ptr=0x7f0000000000 id={} mount={m} size=4096 block_size=0 device=0",
                hex(&wrap_id)
            ),
            format!("iovcreate mount={m} size=4096 block_size=0 numa=-1 -> {host_id}"),
            // The framework's memory: our publication and registration go.
            format!("iovunlink id={}", hex(&wrap_id)),
            format!("iovdestroy id={}", hex(&wrap_id)),
            // The importer's mapping only.
            format!("iovdestroy id={id}"),
            format!("iovunlink id={host_id}"),
            format!("iovdestroy id={host_id}"),
            format!("iovunlink id={id}"),
            format!("iovdestroy id={id}"),
        ]
    );
}
