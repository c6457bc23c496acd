//! Same-host WRITEs copied from both ends at once.
//!
//! libfabric 1.17's `shm` moves a large WRITE with CMA on the target: its progress
//! thread calls `process_vm_readv` on the initiator, and the kernel pins the initiator's
//! source pages 4 KiB at a time under the page-table lock of their 2 MiB region. Pieces
//! of one region pulled by several rails therefore copy one after the other (see
//! [`super::DEFAULT_SHM_STRIPING_THRESHOLD`]): striping a 2 MiB block over rails did not
//! make it faster. A piece *pushed* by the initiator (`process_vm_writev`) pins the
//! target's pages instead — the other process's page table, no lock in common with the
//! target's pull. So a WRITE to a peer on this host of at least [`PUSH_THRESHOLD`] is
//! split into pieces that alternate: even pieces go through the provider (the target
//! pulls them), odd pieces are pushed by the initiator's rail worker while the target
//! copies. `tools/bench/cma-pushpull.c` measures it: a pull and a push of halves nearly
//! double one pull, where two pulls or two pushes do not (`docs/BENCHMARKS.md`).
//!
//! A push needs the peer's process on this host in this pid namespace (its advertised
//! pid and start time match `/proc` here), DRAM on both sides, and ptrace access to the
//! peer — the check the provider's own CMA passes (same user, Yama's `ptrace_scope`) —
//! probed once per peer by reading one byte of a region it registered; a peer that
//! refuses it gets no pushes. Parameter `cma_write` (default 1; 0 leaves every byte to
//! the provider). A READ's second copy has to pin the initiator's pages, which only the
//! target can do: the target pushes it on request ([`super::assist`]) while this
//! process pulls the other piece itself (`process_vm_readv`, same checks as a push).
//!
//! Unlike the provider's copy, a push is not checked against the target's registration
//! key: it relies on the agent's check that the range lies inside a region the peer
//! registered (as UCX's CMA transport does), and is made only where the whole
//! descriptor lies inside DRAM the peer advertised to this backend (its metadata: module
//! `sources`), into the process its connection information named. A peer that deregisters and reuses memory
//! while a WRITE to it is still running may receive that WRITE's bytes, where the
//! provider would have failed the WRITE; NIXL's contract keeps memory registered while
//! transfers to it run. A push is issued only after the peer was found alive (the rail
//! worker asks its pidfd first), so a recycled pid would have to be reused within
//! microseconds.
//!
//! Small transfers (`cma_inline`, at most 1 MiB in all by default) go by CMA whole,
//! copied by the thread that posts them (`xfer::InlineCopy`): under the same checks,
//! they cost one system call instead of a round trip through both sides' progress.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// WRITE blocks from this size are split into pulled and pushed pieces (two 1 MiB
/// pieces at the threshold: a 2 MiB block is where one pull fell below the 1 MiB
/// block's bandwidth).
pub(super) const PUSH_THRESHOLD: usize = 2 << 20;

/// Blocks per `process_vm_writev`/`process_vm_readv` call (the kernel's `UIO_MAXIOV`).
const MAX_IOVECS: usize = 1024;

/// Tests slow every push down by this much (a notification must still follow the data).
#[cfg(test)]
pub(super) static TEST_PUSH_DELAY_MS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// A peer process this one may copy into.
#[derive(Debug)]
pub(super) struct CmaPeer {
    pid: u32,
    /// Whether the OS lets this process copy into the peer: probed at the first
    /// transfer that would push.
    allowed: OnceLock<bool>,
    /// The peer pushes pieces of READs into this process on request (see
    /// [`super::assist`]), until it refused once.
    assists: AtomicBool,
}

/// Why a push or a pull failed.
#[derive(Debug)]
pub(super) struct CopyError {
    /// The peer's process is gone (`ESRCH`).
    pub(super) disconnect: bool,
    pub(super) errno: i32,
    pub(super) text: String,
}

impl CopyError {
    /// A CMA operation of a transfer without a same-host peer (a planning bug).
    pub(super) fn unroutable() -> Self {
        CopyError {
            disconnect: false,
            errno: 0,
            text: "a piece to copy by CMA for a peer not on this host".into(),
        }
    }
}

impl CmaPeer {
    /// The peer whose process is `pid` here (see `ProcessId::local_pid`).
    pub(super) fn new(pid: u32) -> Self {
        CmaPeer {
            pid,
            allowed: OnceLock::new(),
            assists: AtomicBool::new(false),
        }
    }

    /// The peer serves READ assists (its connection information says so).
    pub(super) fn with_assists(self, assists: bool) -> Self {
        self.assists.store(assists, Ordering::Relaxed);
        self
    }

    /// Whether to ask the peer to push pieces of READs.
    pub(super) fn assists(&self) -> bool {
        self.assists.load(Ordering::Relaxed)
    }

    /// The peer refused an assist (it may not copy into this process): ask no more.
    pub(super) fn refuse_assists(&self) {
        if self.assists.swap(false, Ordering::Relaxed) {
            tracing::info!(
                pid = self.pid,
                "same-host READs from this peer go through the provider alone: it may not \
                 copy into this process (CMA)"
            );
        }
    }

    /// Whether pushes to this peer are allowed; the first call reads one byte at
    /// `remote`, an address inside a region the peer registered.
    pub(super) fn allowed(&self, remote: u64) -> bool {
        *self.allowed.get_or_init(|| {
            let mut byte = 0u8;
            let local = libc::iovec {
                iov_base: (&raw mut byte).cast(),
                iov_len: 1,
            };
            let far = libc::iovec {
                iov_base: remote as *mut libc::c_void,
                iov_len: 1,
            };
            // SAFETY: the local iovec names one byte of this stack frame; the remote one
            // is only read by the kernel, in the peer's address space.
            let n =
                unsafe { libc::process_vm_readv(self.pid as libc::pid_t, &local, 1, &far, 1, 0) };
            if n != 1 {
                tracing::info!(
                    pid = self.pid,
                    error = %std::io::Error::last_os_error(),
                    "same-host WRITEs to this peer go through the provider alone: \
                     this process may not copy into it (CMA)"
                );
            }
            n == 1
        })
    }

    /// Copies `len` bytes at `local` (this process) to `remote` in the peer's memory.
    ///
    /// # Safety
    /// `local..local + len` must be readable memory of this process.
    pub(super) unsafe fn push(&self, local: u64, len: usize, remote: u64) -> Result<(), CopyError> {
        // SAFETY: the caller vouches for the local range, which is only read.
        unsafe { self.copy(local, len, remote, true) }
    }

    /// Copies `len` bytes at `remote` in the peer's memory to `local` (this process).
    ///
    /// # Safety
    /// `local..local + len` must be writable memory of this process that nothing else
    /// uses meanwhile.
    pub(super) unsafe fn pull(&self, local: u64, len: usize, remote: u64) -> Result<(), CopyError> {
        // SAFETY: the caller vouches for the local range, which is written.
        unsafe { self.copy(local, len, remote, false) }
    }

    /// Copies every block, `(local, remote, len)`: this process's memory into the
    /// peer's (`push`) or the peer's into this process's, with one system call per
    /// [`MAX_IOVECS`] blocks.
    ///
    /// # Safety
    /// As [`CmaPeer::push`] or [`CmaPeer::pull`], for every block's local range.
    pub(super) unsafe fn copy_blocks(
        &self,
        blocks: &[(u64, u64, usize)],
        push: bool,
    ) -> Result<(), CopyError> {
        if let [(local, remote, len)] = blocks {
            // SAFETY: as the caller vouches.
            return unsafe { self.copy(*local, *len, *remote, push) };
        }
        for group in blocks.chunks(MAX_IOVECS) {
            let iovec = |addr: u64, len: usize| libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: len,
            };
            let here: Vec<libc::iovec> = group.iter().map(|b| iovec(b.0, b.2)).collect();
            let far: Vec<libc::iovec> = group.iter().map(|b| iovec(b.1, b.2)).collect();
            let pid = self.pid as libc::pid_t;
            let count = group.len() as libc::c_ulong;
            // SAFETY: the caller vouches for the local ranges; the remote ones are read or
            // written by the kernel in the peer's address space, which checks its mapping.
            let n = unsafe {
                if push {
                    libc::process_vm_writev(pid, here.as_ptr(), count, far.as_ptr(), count, 0)
                } else {
                    libc::process_vm_readv(pid, here.as_ptr(), count, far.as_ptr(), count, 0)
                }
            };
            let total: usize = group.iter().map(|b| b.2).sum();
            if n >= 0 && n as usize == total {
                continue;
            }
            // Short (the kernel stops at the first range it cannot copy): the rest block
            // by block, which names the failing one.
            let mut skip = n.max(0) as usize;
            for &(local, remote, len) in group {
                let done = skip.min(len);
                skip -= done;
                if done < len {
                    let at = done as u64;
                    // SAFETY: as the caller vouches.
                    unsafe { self.copy(local + at, len - done, remote + at, push) }?;
                }
            }
        }
        Ok(())
    }

    /// `process_vm_writev` (`push`) or `process_vm_readv` until all `len` bytes moved.
    ///
    /// # Safety
    /// As [`CmaPeer::push`] or [`CmaPeer::pull`].
    unsafe fn copy(
        &self,
        local: u64,
        len: usize,
        remote: u64,
        push: bool,
    ) -> Result<(), CopyError> {
        #[cfg(test)]
        std::thread::sleep(std::time::Duration::from_millis(
            TEST_PUSH_DELAY_MS.load(std::sync::atomic::Ordering::Relaxed),
        ));
        let mut done = 0usize;
        while done < len {
            let here = libc::iovec {
                iov_base: (local as usize + done) as *mut libc::c_void,
                iov_len: len - done,
            };
            let far = libc::iovec {
                iov_base: (remote as usize + done) as *mut libc::c_void,
                iov_len: len - done,
            };
            let pid = self.pid as libc::pid_t;
            // SAFETY: the caller vouches for the local range; the remote range is read or
            // written by the kernel in the peer's address space, which checks its mapping.
            let n = unsafe {
                if push {
                    libc::process_vm_writev(pid, &here, 1, &far, 1, 0)
                } else {
                    libc::process_vm_readv(pid, &here, 1, &far, 1, 0)
                }
            };
            if n <= 0 {
                let e = std::io::Error::last_os_error();
                let errno = if n == 0 {
                    libc::EFAULT
                } else {
                    e.raw_os_error().unwrap_or(0)
                };
                return Err(CopyError {
                    disconnect: errno == libc::ESRCH,
                    errno,
                    text: format!(
                        "copying {} bytes {} peer process {} at {:#x} failed: {}",
                        len - done,
                        if push { "into" } else { "from" },
                        self.pid,
                        remote as usize + done,
                        if n == 0 {
                            "nothing was copied".to_string()
                        } else {
                            e.to_string()
                        }
                    ),
                });
            }
            done += n as usize;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_lands_every_byte_and_its_failures_are_typed() {
        let me = CmaPeer::new(std::process::id());
        let src: Vec<u8> = (0..(3 << 20) + 5)
            .map(|i: usize| (i * 31 + i / 4096) as u8)
            .collect();
        let mut dst = vec![0u8; src.len()];
        assert!(me.allowed(dst.as_ptr() as u64));
        // SAFETY: `src` is readable for its length.
        unsafe { me.push(src.as_ptr() as u64, src.len(), dst.as_mut_ptr() as u64) }.unwrap();
        assert!(dst == src);
        let mut back = vec![0u8; src.len()];
        // SAFETY: `back` is writable for its length and used by nothing else.
        unsafe { me.pull(back.as_mut_ptr() as u64, back.len(), dst.as_ptr() as u64) }.unwrap();
        assert!(back == src);
        // SAFETY: as above.
        let e = unsafe { me.pull(back.as_mut_ptr() as u64, 4096, 8) }.unwrap_err();
        assert!(!e.disconnect && e.errno == libc::EFAULT, "{e:?}");
        // An address the peer has not mapped: EFAULT, not a disconnect.
        // SAFETY: as above.
        let e = unsafe { me.push(src.as_ptr() as u64, 4096, 8) }.unwrap_err();
        assert!(!e.disconnect && e.errno == libc::EFAULT, "{e:?}");
        // A process that has ended: a disconnect.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let gone = CmaPeer::new(pid);
        assert!(!gone.allowed(dst.as_ptr() as u64));
        // SAFETY: as above.
        let e =
            unsafe { gone.push(src.as_ptr() as u64, 4096, dst.as_mut_ptr() as u64) }.unwrap_err();
        assert!(e.disconnect && e.errno == libc::ESRCH, "{e:?}");
    }
}
