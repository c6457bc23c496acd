//! `#[repr(C)]` mirrors of the structs and function types of 3FS's
//! `src/lib/api/hf3fs_usrbio.h` (deepseek-ai/3FS), for the run-time loaded
//! `libhf3fs_api_shared`. Layouts are asserted at compile time (x86-64 / aarch64 LP64)
//! and checked against a C compiler by the `hf3fs_abi` test.

#![allow(non_camel_case_types)]

use libc::{c_char, c_int, c_void, size_t, timespec};

/// `HF3FS_SUPER_MAGIC`: `statfs(2)`'s `f_type` of a 3FS FUSE mount.
pub const HF3FS_SUPER_MAGIC: u32 = 0x8f3f_5fff;
/// `HF3FS_IOR_ALLOW_READ_UNCOMMITTED`.
pub const HF3FS_IOR_ALLOW_READ_UNCOMMITTED: u64 = 1;
/// `HF3FS_IOR_FORBID_READ_HOLES`.
pub const HF3FS_IOR_FORBID_READ_HOLES: u64 = 2;
/// `enum hf3fs_mem_type` values (a plain `int`: an unknown value stays a value).
pub const HF3FS_MEM_HOST: c_int = 0;
/// See [`HF3FS_MEM_HOST`].
pub const HF3FS_MEM_DEVICE: c_int = 1;
/// See [`HF3FS_MEM_HOST`].
pub const HF3FS_MEM_MANAGED: c_int = 2;
/// `hf3fs_iovsync` direction: GPU writes visible before a storage write.
pub const HF3FS_SYNC_TO_STORAGE: c_int = 0;
/// `hf3fs_iovsync` direction: storage (RDMA) writes visible to later GPU work.
pub const HF3FS_SYNC_FROM_STORAGE: c_int = 1;

/// `hf3fs_iov_handle`.
pub type hf3fs_iov_handle = *mut c_void;
/// `hf3fs_ior_handle`.
pub type hf3fs_ior_handle = *mut c_void;

/// `struct hf3fs_iov`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hf3fs_iov {
    /// `uint8_t *base`.
    pub base: *mut u8,
    /// `hf3fs_iov_handle iovh`.
    pub iovh: hf3fs_iov_handle,
    /// `char id[16]`.
    pub id: [u8; 16],
    /// `char mount_point[256]`.
    pub mount_point: [c_char; 256],
    /// `size_t size`.
    pub size: size_t,
    /// `size_t block_size`.
    pub block_size: size_t,
    /// `int numa`.
    pub numa: c_int,
}

/// `struct hf3fs_ior`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hf3fs_ior {
    /// `struct hf3fs_iov iov` (the ring's own shared memory).
    pub iov: hf3fs_iov,
    /// `hf3fs_ior_handle iorh`.
    pub iorh: hf3fs_ior_handle,
    /// `char mount_point[256]`.
    pub mount_point: [c_char; 256],
    /// `bool for_read`.
    pub for_read: bool,
    /// `int io_depth`.
    pub io_depth: c_int,
    /// `int priority`.
    pub priority: c_int,
    /// `int timeout` (milliseconds).
    pub timeout: c_int,
    /// `uint64_t flags`.
    pub flags: u64,
}

/// `struct hf3fs_cqe`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hf3fs_cqe {
    /// `int32_t index`.
    pub index: i32,
    /// `int32_t reserved`.
    pub reserved: i32,
    /// `int64_t result`.
    pub result: i64,
    /// `const void *userdata`.
    pub userdata: *const c_void,
}

impl hf3fs_iov {
    /// All zero (what the C API expects to fill in).
    pub fn zeroed() -> Self {
        // SAFETY: plain C struct; all-zero is a valid value of every field.
        unsafe { std::mem::zeroed() }
    }
}

impl hf3fs_ior {
    /// All zero (what the C API expects to fill in).
    pub fn zeroed() -> Self {
        // SAFETY: plain C struct; all-zero is a valid value of every field.
        unsafe { std::mem::zeroed() }
    }
}

impl hf3fs_cqe {
    /// All zero.
    pub fn zeroed() -> Self {
        // SAFETY: plain C struct; all-zero is a valid value of every field.
        unsafe { std::mem::zeroed() }
    }
}

macro_rules! assert_layout {
    ($t:ty, size $size:expr, align $align:expr, $($field:ident @ $off:expr),* $(,)?) => {
        const _: () = assert!(std::mem::size_of::<$t>() == $size);
        const _: () = assert!(std::mem::align_of::<$t>() == $align);
        $(const _: () = assert!(std::mem::offset_of!($t, $field) == $off);)*
    };
}

#[cfg(target_pointer_width = "64")]
assert_layout!(hf3fs_iov, size 312, align 8,
    base @ 0, iovh @ 8, id @ 16, mount_point @ 32, size @ 288, block_size @ 296, numa @ 304);
#[cfg(target_pointer_width = "64")]
assert_layout!(hf3fs_ior, size 600, align 8,
    iov @ 0, iorh @ 312, mount_point @ 320, for_read @ 576, io_depth @ 580, priority @ 584,
    timeout @ 588, flags @ 592);
#[cfg(target_pointer_width = "64")]
assert_layout!(hf3fs_cqe, size 24, align 8, index @ 0, reserved @ 4, result @ 8, userdata @ 16);

/// `(name, size, align, [(field, offset)])` of one struct.
pub type Layout = (&'static str, usize, usize, Vec<(&'static str, usize)>);

/// The layout of each mirrored struct as Rust lays it out: what the `hf3fs_abi` test
/// compares with the C compiler's answer.
pub fn layouts() -> Vec<Layout> {
    use std::mem::{align_of, offset_of, size_of};
    vec![
        (
            "hf3fs_iov",
            size_of::<hf3fs_iov>(),
            align_of::<hf3fs_iov>(),
            vec![
                ("base", offset_of!(hf3fs_iov, base)),
                ("iovh", offset_of!(hf3fs_iov, iovh)),
                ("id", offset_of!(hf3fs_iov, id)),
                ("mount_point", offset_of!(hf3fs_iov, mount_point)),
                ("size", offset_of!(hf3fs_iov, size)),
                ("block_size", offset_of!(hf3fs_iov, block_size)),
                ("numa", offset_of!(hf3fs_iov, numa)),
            ],
        ),
        (
            "hf3fs_ior",
            size_of::<hf3fs_ior>(),
            align_of::<hf3fs_ior>(),
            vec![
                ("iov", offset_of!(hf3fs_ior, iov)),
                ("iorh", offset_of!(hf3fs_ior, iorh)),
                ("mount_point", offset_of!(hf3fs_ior, mount_point)),
                ("for_read", offset_of!(hf3fs_ior, for_read)),
                ("io_depth", offset_of!(hf3fs_ior, io_depth)),
                ("priority", offset_of!(hf3fs_ior, priority)),
                ("timeout", offset_of!(hf3fs_ior, timeout)),
                ("flags", offset_of!(hf3fs_ior, flags)),
            ],
        ),
        (
            "hf3fs_cqe",
            size_of::<hf3fs_cqe>(),
            align_of::<hf3fs_cqe>(),
            vec![
                ("index", offset_of!(hf3fs_cqe, index)),
                ("reserved", offset_of!(hf3fs_cqe, reserved)),
                ("result", offset_of!(hf3fs_cqe, result)),
                ("userdata", offset_of!(hf3fs_cqe, userdata)),
            ],
        ),
    ]
}

/// `bool hf3fs_is_hf3fs(int fd)`.
pub type IsHf3fsFn = unsafe extern "C" fn(fd: c_int) -> bool;
/// `int hf3fs_extract_mount_point(char *out, int size, const char *path)`.
pub type ExtractMountPointFn =
    unsafe extern "C" fn(out: *mut c_char, size: c_int, path: *const c_char) -> c_int;
/// `int hf3fs_iovcreate(iov, mount, size, block_size, numa)`.
pub type IovCreateFn = unsafe extern "C" fn(
    iov: *mut hf3fs_iov,
    mount: *const c_char,
    size: size_t,
    block_size: size_t,
    numa: c_int,
) -> c_int;
/// `int hf3fs_iovopen(iov, id, mount, size, block_size, numa)` (and
/// `hf3fs_iovopen_device`, whose last argument is the device).
pub type IovOpenFn = unsafe extern "C" fn(
    iov: *mut hf3fs_iov,
    id: *const u8,
    mount: *const c_char,
    size: size_t,
    block_size: size_t,
    numa_or_device: c_int,
) -> c_int;
/// `int hf3fs_iovwrap(iov, base, id, mount, size, block_size, numa)` (and
/// `hf3fs_iovwrap_device`, whose last argument is the device).
pub type IovWrapFn = unsafe extern "C" fn(
    iov: *mut hf3fs_iov,
    base: *mut c_void,
    id: *const u8,
    mount: *const c_char,
    size: size_t,
    block_size: size_t,
    numa_or_device: c_int,
) -> c_int;
/// `void hf3fs_iovunlink(iov)` / `void hf3fs_iovdestroy(iov)`.
pub type IovVoidFn = unsafe extern "C" fn(iov: *mut hf3fs_iov);
/// `int hf3fs_iorcreate4(ior, mount, entries, for_read, io_depth, timeout, numa, flags)`.
pub type IorCreate4Fn = unsafe extern "C" fn(
    ior: *mut hf3fs_ior,
    mount: *const c_char,
    entries: c_int,
    for_read: bool,
    io_depth: c_int,
    timeout: c_int,
    numa: c_int,
    flags: u64,
) -> c_int;
/// `void hf3fs_iordestroy(ior)`.
pub type IorDestroyFn = unsafe extern "C" fn(ior: *mut hf3fs_ior);
/// `int hf3fs_reg_fd(int fd, uint64_t flags)`: ≤ 0 on success, a positive errno on
/// failure (the opposite sign of every other call).
pub type RegFdFn = unsafe extern "C" fn(fd: c_int, flags: u64) -> c_int;
/// `void hf3fs_dereg_fd(int fd)`.
pub type DeregFdFn = unsafe extern "C" fn(fd: c_int);
/// `int hf3fs_io_entries(const struct hf3fs_ior *)`.
pub type IoEntriesFn = unsafe extern "C" fn(ior: *const hf3fs_ior) -> c_int;
/// `int hf3fs_prep_io(ior, iov, read, ptr, fd, off, len, userdata)`.
pub type PrepIoFn = unsafe extern "C" fn(
    ior: *const hf3fs_ior,
    iov: *const hf3fs_iov,
    read: bool,
    ptr: *mut c_void,
    fd: c_int,
    off: size_t,
    len: u64,
    userdata: *const c_void,
) -> c_int;
/// `int hf3fs_submit_ios(const struct hf3fs_ior *)`.
pub type SubmitIosFn = unsafe extern "C" fn(ior: *const hf3fs_ior) -> c_int;
/// `int hf3fs_wait_for_ios(ior, cqes, cqec, min_results, abs_timeout)`; the timeout is
/// absolute `CLOCK_REALTIME`, null for none.
pub type WaitForIosFn = unsafe extern "C" fn(
    ior: *const hf3fs_ior,
    cqes: *mut hf3fs_cqe,
    cqec: c_int,
    min_results: c_int,
    abs_timeout: *const timespec,
) -> c_int;
/// `int hf3fs_iovcreate_device(iov, mount, size, block_size, device_id)`.
pub type IovCreateDeviceFn = IovCreateFn;
/// `bool hf3fs_gdr_available(void)`.
pub type GdrAvailableFn = unsafe extern "C" fn() -> bool;
/// `int hf3fs_gdr_device_count(void)`.
pub type GdrDeviceCountFn = unsafe extern "C" fn() -> c_int;
/// `enum hf3fs_mem_type hf3fs_iov_mem_type(const struct hf3fs_iov *)` (an `int`).
pub type IovMemTypeFn = unsafe extern "C" fn(iov: *const hf3fs_iov) -> c_int;
/// `int hf3fs_iov_device_id(const struct hf3fs_iov *)`.
pub type IovDeviceIdFn = unsafe extern "C" fn(iov: *const hf3fs_iov) -> c_int;
/// `int hf3fs_iovsync(const struct hf3fs_iov *, int direction)`.
pub type IovSyncFn = unsafe extern "C" fn(iov: *const hf3fs_iov, direction: c_int) -> c_int;
