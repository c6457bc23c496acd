//! Sharing device memory between processes of one node: legacy CUDA-IPC handles and VMM
//! file descriptors (passed with `SCM_RIGHTS` over a Unix socket), imported as RAII
//! mappings that are closed on drop.

use crate::error::{cvt, cvt_ctx, Error, Result};
use crate::gpu::Gpu;
use crate::vmm::{map_vmm, unmap_vmm};
use cudarc::driver::sys;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// Size of a CUDA-IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// A CUDA-IPC memory handle (`CUipcMemHandle`): 64 opaque bytes naming one `cuMemAlloc`
/// allocation, valid in any process of the same node while the exporter keeps the
/// allocation. Serialises as 64 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle(pub [u8; IPC_HANDLE_BYTES]);

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl IpcHandle {
    /// The handle of the allocation starting at `base` (must be an allocation's start).
    pub(crate) fn get(gpu: &Gpu, base: u64) -> Result<Self> {
        gpu.bind()?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        cvt_ctx(
            "cuIpcGetMemHandle",
            // SAFETY: `raw` is a valid out-pointer; the context of the memory's GPU is current.
            unsafe { sys::cuIpcGetMemHandle(&mut raw, base) },
            || format!("{base:#x} on GPU {}", gpu.ordinal()),
        )?;
        Ok(Self(raw.reserved.map(|b| b as u8)))
    }

    /// The 64 bytes.
    pub fn as_bytes(&self) -> &[u8; IPC_HANDLE_BYTES] {
        &self.0
    }

    /// A handle from bytes (exactly 64).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; IPC_HANDLE_BYTES] = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "an IPC handle has {IPC_HANDLE_BYTES} bytes, not {}",
                bytes.len()
            ))
        })?;
        Ok(Self(arr))
    }
}

impl Serialize for IpcHandle {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for IpcHandle {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = IpcHandle;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{IPC_HANDLE_BYTES} bytes")
            }
            fn visit_bytes<E: serde::de::Error>(
                self,
                v: &[u8],
            ) -> std::result::Result<IpcHandle, E> {
                IpcHandle::from_bytes(v).map_err(E::custom)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<IpcHandle, A::Error> {
                let mut out = [0u8; IPC_HANDLE_BYTES];
                for (i, slot) in out.iter_mut().enumerate() {
                    *slot = seq
                        .next_element()?
                        .ok_or_else(|| serde::de::Error::invalid_length(i, &self))?;
                }
                if seq.next_element::<u8>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(
                        IPC_HANDLE_BYTES + 1,
                        &self,
                    ));
                }
                Ok(IpcHandle(out))
            }
        }
        d.deserialize_bytes(V)
    }
}

/// Another process's `cuMemAlloc` allocation mapped into this one; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    gpu: Gpu,
    ptr: u64,
    len: u64,
}

impl IpcMapping {
    /// Maps the allocation behind `handle` into `gpu`'s context: pass the GPU whose
    /// streams and kernels will use the mapping. When the allocation lives on another GPU,
    /// the driver enables peer access from `gpu` to it on demand
    /// (`CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`), so copies and kernels of `gpu` reach it
    /// over the link; a pair without peer access fails here (see
    /// [`crate::peer_topology`]).
    #[doc(alias = "cuIpcOpenMemHandle")]
    pub fn open(gpu: &Gpu, handle: &IpcHandle) -> Result<Self> {
        gpu.bind()?;
        let raw = sys::CUipcMemHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        cvt_ctx(
            "cuIpcOpenMemHandle",
            // SAFETY: `ptr` is a valid out-pointer; the handle is passed by value.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    raw,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            || format!("{handle:?} into GPU {}", gpu.ordinal()),
        )?;
        let mut base = 0;
        let mut len = 0;
        // SAFETY: valid out-pointers; `ptr` was just mapped.
        let range = cvt("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut len, ptr)
        });
        let mapping = Self {
            gpu: gpu.clone(),
            ptr,
            len: len as u64,
        };
        range?;
        Ok(mapping)
    }

    /// Where the allocation is mapped in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The allocation's size.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the mapping is empty (never, for a successful open).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU whose context holds the mapping.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let result = self.gpu.bind().and_then(|()| {
            // SAFETY: mapped by cuIpcOpenMemHandle in `open`, closed once.
            cvt("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(self.ptr)
            })
        });
        if let Err(e) = result {
            tracing::warn!("IPC mapping {:#x}: {e}", self.ptr);
        }
    }
}

/// A VMM allocation exported as a file descriptor.
#[derive(Debug)]
pub struct VmmExport {
    /// The POSIX file descriptor (closed on drop).
    pub fd: OwnedFd,
    /// Size of the allocation (granularity-rounded): what the importer maps.
    pub size: u64,
    /// The buffer's length as allocated.
    pub len: u64,
}

/// Another process's VMM allocation, imported from its file descriptor and mapped;
/// unmapped and released on drop.
#[derive(Debug)]
pub struct VmmMapping {
    gpu: Gpu,
    ptr: u64,
    size: usize,
}

impl VmmMapping {
    /// Imports the allocation behind `fd` (`size` bytes, as the exporter said) and maps it
    /// read-write for `gpu` (`cuMemSetAccess`): pass the GPU whose streams and kernels
    /// will use it. Memory of another GPU needs peer access between the two (a pair
    /// without it fails here). The caller keeps ownership of `fd`.
    #[doc(alias = "cuMemImportFromShareableHandle")]
    pub fn import(gpu: &Gpu, fd: BorrowedFd<'_>, size: u64) -> Result<Self> {
        if size == 0 {
            return Err(Error::InvalidArgument("a VMM import of 0 bytes".into()));
        }
        gpu.bind()?;
        let mut handle = 0;
        // SAFETY: for POSIX-fd handles the OS handle is the fd value cast to a pointer.
        cvt("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        let size = size as usize;
        let mapped = map_vmm(gpu.ordinal(), handle, size);
        // The mapping holds its own reference to the allocation from here on.
        // SAFETY: imported above, released once.
        let released = cvt("cuMemRelease", unsafe { sys::cuMemRelease(handle) });
        let ptr = mapped?;
        let mapping = Self {
            gpu: gpu.clone(),
            ptr,
            size,
        };
        released?;
        Ok(mapping)
    }

    /// Where the allocation is mapped in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The mapped size.
    pub fn len(&self) -> u64 {
        self.size as u64
    }

    /// Whether the mapping is empty (never, for a successful import).
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The GPU the mapping was made accessible to.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        let result = self
            .gpu
            .bind()
            .and_then(|()| unmap_vmm(self.ptr, self.size, None));
        if let Err(e) = result {
            tracing::warn!("VMM mapping {:#x}: {e}", self.ptr);
        }
    }
}

/// Most descriptors one message carries.
pub const MAX_FDS_PER_MESSAGE: usize = 16;

/// Sends `data` (at least one byte) with `fds` attached (`SCM_RIGHTS`).
pub fn send_fds(sock: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if data.is_empty() || fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(Error::InvalidArgument(format!(
            "send_fds needs 1+ data bytes and at most {MAX_FDS_PER_MESSAGE} fds"
        )));
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let fd_bytes = std::mem::size_of_val(raw.as_slice());
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut control = vec![0u8; space.max(1)];
    let iov = [IoSlice::new(data)];
    // SAFETY: msghdr is plain data; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds CMSG_SPACE(fd_bytes) bytes, so the first header
        // and its data fit.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(raw.as_ptr(), libc::CMSG_DATA(cmsg).cast(), raw.len());
        }
    }
    let mut sent = 0;
    while sent < data.len() {
        let n = if sent == 0 {
            // SAFETY: `msg` points at live buffers for the duration of the call.
            unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) }
        } else {
            let rest = &data[sent..];
            // SAFETY: plain send of a live slice.
            unsafe {
                libc::send(
                    sock.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_NOSIGNAL,
                )
            }
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err.into());
        }
        sent += n as usize;
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes and any descriptors that came with them. Returns the
/// byte count (0: the peer closed) and the descriptors, owned.
pub fn recv_fds(sock: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
    recv_fds_flags(sock, buf, 0)
}

/// As [`recv_fds`], without waiting: `None` where nothing is there yet.
pub fn try_recv_fds(sock: &UnixStream, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>> {
    match recv_fds_flags(sock, buf, libc::MSG_DONTWAIT) {
        Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
        other => other.map(Some),
    }
}

fn recv_fds_flags(
    sock: &UnixStream,
    buf: &mut [u8],
    flags: libc::c_int,
) -> Result<(usize, Vec<OwnedFd>)> {
    // SAFETY: pure size computation.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS_PER_MESSAGE * std::mem::size_of::<RawFd>()) as u32) }
            as usize;
    let mut control = vec![0u8; space];
    let mut iov = [IoSliceMut::new(buf)];
    // SAFETY: plain data, fields set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `msg` points at live buffers; CLOEXEC so descriptors never leak into
        // children.
        let n =
            unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags | libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err.into());
        }
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote, within `msg_controllen`.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::InvalidArgument(format!(
            "more than {MAX_FDS_PER_MESSAGE} descriptors in one message (the rest were dropped)"
        )));
    }
    Ok((n, fds))
}

/// Sends a VMM export (size, length and the descriptor) over a Unix socket.
pub fn send_vmm(sock: &UnixStream, export: &VmmExport) -> Result<()> {
    use std::os::fd::AsFd;
    let mut data = [0u8; 16];
    data[..8].copy_from_slice(&export.size.to_le_bytes());
    data[8..].copy_from_slice(&export.len.to_le_bytes());
    send_fds(sock, &data, &[export.fd.as_fd()])
}

/// Receives what [`send_vmm`] sent.
pub fn recv_vmm(sock: &UnixStream) -> Result<VmmExport> {
    let mut data = [0u8; 16];
    let (mut got, mut fds) = recv_fds(sock, &mut data)?;
    while got < data.len() && got > 0 {
        let (n, more) = recv_fds(sock, &mut data[got..])?;
        if n == 0 {
            break;
        }
        got += n;
        fds.extend(more);
    }
    let fd = match fds.pop() {
        Some(fd) if got == data.len() && fds.is_empty() => fd,
        last => {
            return Err(Error::InvalidArgument(format!(
                "a VMM export message has 16 bytes and 1 fd, got {got} bytes and {} fds",
                fds.len() + usize::from(last.is_some())
            )))
        }
    };
    let word = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&data[at..at + 8]);
        u64::from_le_bytes(bytes)
    };
    Ok(VmmExport {
        fd,
        size: word(0),
        len: word(8),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    #[test]
    fn ipc_handle_serde_round_trip_and_bad_lengths() {
        let h = IpcHandle(std::array::from_fn(|i| i as u8));
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<IpcHandle>(&json).unwrap(), h);
        assert!(serde_json::from_str::<IpcHandle>("[1,2,3]").is_err());
        assert!(IpcHandle::from_bytes(&[0; 63]).is_err());
        assert_eq!(IpcHandle::from_bytes(&[9; 64]).unwrap().as_bytes()[63], 9);
    }

    #[test]
    fn descriptors_cross_a_unix_socket() {
        // A pipe's write end travels; writing through the received copy reaches the
        // original read end.
        let (a, b) = UnixStream::pair().unwrap();
        let mut fds = [0; 2];
        // SAFETY: valid out-array of two ints.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just created and are owned here.
        let (read_end, write_end) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let export = VmmExport {
            fd: write_end,
            size: 2 << 20,
            len: 12345,
        };
        send_vmm(&a, &export).unwrap();
        drop(export);
        let got = recv_vmm(&b).unwrap();
        assert_eq!((got.size, got.len), (2 << 20, 12345));
        let mut w = std::fs::File::from(got.fd);
        w.write_all(b"hi").unwrap();
        drop(w);
        let mut s = String::new();
        std::fs::File::from(read_end)
            .read_to_string(&mut s)
            .unwrap();
        assert_eq!(s, "hi");
        // A message without a descriptor is refused by recv_vmm with a typed error.
        send_fds(&a, &[0; 16], &[]).unwrap();
        assert!(matches!(recv_vmm(&b), Err(Error::InvalidArgument(_))));
        // Too many descriptors are refused before sending.
        let many: Vec<BorrowedFd<'_>> = (0..17).map(|_| a.as_fd()).collect();
        assert!(send_fds(&a, b"x", &many).is_err());
        // A closed peer reads as 0 bytes.
        drop(a);
        let mut buf = [0u8; 4];
        assert_eq!(recv_fds(&b, &mut buf).unwrap().0, 0);
    }
}
