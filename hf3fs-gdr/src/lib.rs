//! 3FS usrbio-style storage I/O into host and GPU memory: iovs, I/O rings in shared
//! memory, and a local daemon (`hf3fs-gdr-daemon`) that serves them.
//!
//! The API follows 3FS's `hf3fs_usrbio.h` and its GPU-direct design, with Rust names
//! (each carries the C name as a doc alias):
//! - [`gdr_available`], [`gdr_device_count`];
//! - [`Iov`]: host iovs in POSIX shared memory ([`Iov::create`], [`Iov::open`],
//!   [`Iov::wrap`], [`Iov::unlink`], [`Iov::destroy`], and [`Iov::wrap_shm`] for a
//!   caller's own `/dev/shm` segment whose publication the iov owns) and GPU iovs
//!   ([`Iov::create_gpu`], [`Iov::wrap_gpu`], [`Iov::export_gpu`], [`Iov::import_gpu`],
//!   [`Iov::is_gpu`], [`Iov::gpu_device`], [`Iov::sync`]);
//! - [`Ior`]: rings ([`Ior::create`], [`Ior::prep_io`], [`Ior::submit_ios`],
//!   [`Ior::wait_for_ios`], [`Ior::check_alive`] before reusing a pooled ring) and
//!   [`reg_fd`] / [`dereg_fd`].
//!
//! Two backends serve these types, chosen per mount (see [`hf3fs`] for the rule and
//! the overrides: [`set_backend`], `$HF3FS_GDR_BACKEND`): the local daemon below, and
//! on a real 3FS mount the official `libhf3fs_api_shared`, loaded at run time (its GDR
//! extension, where present, for GPU iovs). [`Iov::backend`] and [`Ior::backend`] say
//! which one an object uses.
//!
//! GPU memory (devices, buffers, CUDA-IPC handles and mappings, pointer classification)
//! comes from [`gpu_mem`], re-exported here, with the CUDA driver loaded at run time: the
//! crate builds without CUDA and links no RDMA library. With feature `rdma`, module `gdr`
//! (not built by default) is 3FS's GDR manager: it registers GPU memory with RDMA
//! devices (DMA-BUF first, peer memory as fallback) and host memory over `ibverbs`,
//! cached by memory domain and address range ([`regcache`]).
//!
//! | feature | default | what it adds |
//! | --- | --- | --- |
//! | `rdma` | off | module `gdr`: GPU and host memory registered with RDMA devices (links libibverbs) |
//!
//! With the local daemon, iovs are published under the mount's virtual directory (see
//! [`virt`]) for other processes: a host iov as a symlink to its `/dev/shm` file, a GPU
//! iov as a symlink to `gdr://v1/device/{N}/size/{S}/ipc/{hex}`. The daemon ([`daemon`])
//! listens on `<mount>/3fs-virt/daemon.sock` and admits clients by their socket
//! credentials; each client process keeps one connection per mount, over which it
//! hands over what its rings use — files and host iovs as descriptors it opened itself,
//! GPU iovs by their CUDA-IPC handle, rings as sealed memfds — and by which each side
//! learns that the other died. The daemon never opens anything by a name a client
//! chose (the README's "Deploying the daemon" says what each check protects against).
//!
//! Example (local daemon):
//!
//! ```no_run
//! use hf3fs_gdr::{reg_fd, Cqe, Ior, Iov};
//! use std::os::fd::AsRawFd;
//! use std::time::{Duration, Instant};
//! # fn main() -> hf3fs_gdr::Result<()> {
//! // A daemon serves /mnt/data: `hf3fs-gdr-daemon --mount /mnt/data`.
//! let iov = Iov::create_gpu("/mnt/data", 64 << 20, 0, 0)?;
//! let mut ior = Ior::create("/mnt/data", 64, true, 0, Duration::ZERO, -1, 0)?;
//! let file = std::fs::File::open("/mnt/data/weights.bin").unwrap();
//! reg_fd(file.as_raw_fd(), 0)?;
//! ior.prep_io(&iov, true, iov.base(), file.as_raw_fd(), 0, 64 << 20, 7)?;
//! ior.submit_ios()?;
//! let mut cqes = [Cqe::default(); 1];
//! let n = ior.wait_for_ios(&mut cqes, 1, Some(Instant::now() + Duration::from_secs(10)))?;
//! assert_eq!((n, cqes[0].userdata), (1, 7));
//! println!("{} bytes read into GPU memory", cqes[0].result);
//! # Ok(()) }
//! ```

// docs.rs (nightly) marks what each feature adds.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod client;
pub mod daemon;
mod error;
mod fd_registry;
#[cfg(feature = "rdma")]
pub mod gdr;
pub mod hf3fs;
mod ior;
mod iov;
mod proto;
pub mod regcache;
mod ring;
mod ring_ops;
mod shm;
pub mod virt;

pub use client::{daemon_stats, DaemonStats};
pub use error::{Error, Result};
pub use fd_registry::reg_fd;
pub use gpu_mem;
pub use hf3fs::{backend_of, set_backend, Backend, BackendChoice};
pub use ior::{Ior, IOR_ALLOW_READ_UNCOMMITTED, IOR_FORBID_READ_HOLES, MAX_IOR_ENTRIES};
pub use iov::{GpuIovHandle, Iov, SyncDirection, GPU_IOV_HANDLE_BYTES};
pub use ring::{ior_size, Cqe};
pub use shm::{from_hex, id_from_hex, to_hex, Id};

/// Whether GPU iovs can be made here: a CUDA driver loads and sees at least one GPU
/// (3FS GDR's `hf3fs_gdr_available`). It says nothing about the daemon's side.
#[doc(alias = "hf3fs_gdr_available")]
pub fn gdr_available() -> bool {
    gpu_mem::is_available() && gpu_mem::device_count() > 0
}

/// Forgets a registration (3FS's `hf3fs_dereg_fd`): the daemons this process talks to
/// drop their copies, and 3FS's library its registration. Unknown descriptors are
/// ignored. Here at the root because it tells every backend; the registry itself is a
/// leaf module they all read.
#[doc(alias = "hf3fs_dereg_fd")]
pub fn dereg_fd(fd: std::os::fd::RawFd) {
    if !fd_registry::unregister(fd) {
        return;
    }
    client::forget_file(fd);
    for lib in hf3fs::loaded_libraries() {
        lib.forget_fd(fd);
    }
}

/// GPUs this process sees (0 without a driver; 3FS GDR's `hf3fs_gdr_device_count`).
#[doc(alias = "hf3fs_gdr_device_count")]
pub fn gdr_device_count() -> usize {
    gpu_mem::device_count()
}
