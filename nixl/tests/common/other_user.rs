//! A process of another user asking `CUDA_IPC`'s notification socket for VMM descriptors
//! (issue 28, finding 3): shared by the library's socket test and the GPU test, each
//! including this file as a module of its own.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// How a process of another user fared with one descriptor request: the bytes
/// answered (0: the connection was closed unanswered; negative: connecting or
/// receiving failed) and the descriptors that came with them.
pub type OtherUserAnswer = [i64; 2];

/// The user and group a process of another user runs as (`nobody`).
pub const NOBODY: u32 = 65534;

/// Forks a process that waits for a byte on the returned `go` pipe, becomes `nobody`,
/// then for each of `ids` connects to the abstract socket `socket`, asks for VMM
/// allocation `id`'s descriptor (a frame of kind `fd_request`, `CUDA_IPC`'s) and writes its [`OtherUserAnswer`] to the returned
/// `answers` pipe. Needs root (to change user). Returns (pid, go, answers).
pub fn fork_other_user(
    socket: &str,
    ids: &[u64],
    fd_request: u8,
) -> (libc::pid_t, OwnedFd, OwnedFd) {
    // Everything the child touches is made before the fork: it runs raw system calls
    // only (this process has other threads, whose locks a fork copies held).
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    assert!(socket.len() < addr.sun_path.len());
    for (i, b) in socket.bytes().enumerate() {
        // Abstract namespace: the name follows a leading NUL.
        addr.sun_path[i + 1] = b as libc::c_char;
    }
    let addr_len = (std::mem::size_of::<libc::sa_family_t>() + 1 + socket.len()) as libc::socklen_t;
    let requests: Vec<[u8; 13]> = ids
        .iter()
        .map(|id| {
            let mut frame = [0u8; 13];
            frame[..4].copy_from_slice(&9u32.to_le_bytes());
            frame[4] = fd_request;
            frame[5..].copy_from_slice(&id.to_le_bytes());
            frame
        })
        .collect();
    let pipe = || {
        let mut fds = [0; 2];
        // SAFETY: a valid out-array of two ints.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors were just created and are owned here.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    };
    let (go_read, go_write) = pipe();
    let (answers_read, answers_write) = pipe();
    // SAFETY: the child runs `other_user_requests` only (raw system calls on memory
    // made above) and ends in `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: in the child: the arguments live (copied by the fork) until `_exit`.
        unsafe {
            other_user_requests(
                &addr,
                addr_len,
                &requests,
                go_read.as_raw_fd(),
                answers_write.as_raw_fd(),
            )
        }
    }
    (pid, go_write, answers_read)
}

/// The forked child of [`fork_other_user`].
///
/// # Safety
/// Only in a child just forked; `addr` (of `addr_len` bytes) and `requests` are valid,
/// `go` and `answers` are open pipe ends.
unsafe fn other_user_requests(
    addr: &libc::sockaddr_un,
    addr_len: libc::socklen_t,
    requests: &[[u8; 13]],
    go: libc::c_int,
    answers: libc::c_int,
) -> ! {
    // SAFETY: raw system calls on the caller's valid memory and descriptors (see
    // the function's contract); the child never returns.
    unsafe {
        let mut byte = 0u8;
        if libc::read(go, (&mut byte as *mut u8).cast(), 1) != 1 {
            libc::_exit(2);
        }
        if libc::setgroups(0, std::ptr::null()) != 0
            || libc::setgid(NOBODY) != 0
            || libc::setuid(NOBODY) != 0
        {
            libc::_exit(3);
        }
        for request in requests {
            let mut answer: OtherUserAnswer = [-1, 0];
            let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            if s < 0 {
                libc::_exit(4);
            }
            let timeout = libc::timeval {
                tv_sec: 5,
                tv_usec: 0,
            };
            libc::setsockopt(
                s,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
            let connected =
                libc::connect(s, (addr as *const libc::sockaddr_un).cast(), addr_len) == 0;
            if connected {
                libc::send(
                    s,
                    request.as_ptr().cast(),
                    request.len(),
                    libc::MSG_NOSIGNAL,
                );
                let mut data = [0u8; 16];
                let mut iov = libc::iovec {
                    iov_base: data.as_mut_ptr().cast(),
                    iov_len: data.len(),
                };
                // Aligned room for several descriptors' control message.
                let mut control = [0u64; 16];
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = control.as_mut_ptr().cast();
                msg.msg_controllen = std::mem::size_of_val(&control) as _;
                let n = libc::recvmsg(s, &mut msg, libc::MSG_CMSG_CLOEXEC);
                answer[0] = n as i64;
                let mut c = libc::CMSG_FIRSTHDR(&msg);
                while !c.is_null() {
                    if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                        let payload = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                        answer[1] += (payload / std::mem::size_of::<libc::c_int>()) as i64;
                    }
                    c = libc::CMSG_NXTHDR(&msg, c);
                }
            }
            libc::close(s);
            let bytes = std::mem::size_of_val(&answer);
            if libc::write(answers, answer.as_ptr().cast(), bytes) != bytes as isize {
                libc::_exit(5);
            }
        }
        libc::_exit(0)
    }
}

/// Lets the child of [`fork_other_user`] go and collects its answers (one per id) and
/// its exit status.
pub fn other_user_answers(
    pid: libc::pid_t,
    go: OwnedFd,
    answers: OwnedFd,
    ids: usize,
) -> Vec<OtherUserAnswer> {
    std::fs::File::from(go).write_all(&[1]).unwrap();
    let mut raw = Vec::new();
    std::fs::File::from(answers).read_to_end(&mut raw).unwrap();
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the other user's process failed: status {status:#x} (exit 3: it could not \
         become nobody, e.g. no CAP_SETUID)"
    );
    let got: Vec<OtherUserAnswer> = raw
        .chunks_exact(16)
        .map(|c| {
            [
                i64::from_ne_bytes(c[..8].try_into().unwrap()),
                i64::from_ne_bytes(c[8..].try_into().unwrap()),
            ]
        })
        .collect();
    assert_eq!(got.len(), ids);
    got
}
