//! Issue 28, finding 3: `CUDA_IPC`'s notification socket "is open to every local user
//! (an abstract Unix socket with no peer-credential check, whose `FRAME_FD_REQUEST` with
//! sequential ids hands out the fd of a whole VMM allocation)". A victim process exports
//! a real VMM allocation; a process of another user (`nobody`: forked and switched by
//! root) asks its socket for ids 0..32 and the real id, first as a stranger, then after
//! a forged metadata push made the victim load metadata advertising that very process
//! (so that only the kernel's word on the user, `SO_PEERCRED`, stops it). It gets no
//! descriptor and no answer: each connection is closed as it is accepted. The real peer
//! then READs the allocation through `CUDA_IPC`, byte for byte.
//!
//! Needs a GPU and root: without a GPU it skips with a printed reason; without root it
//! skips too, unless `NIXL_REQUIRE_GPU=1` (the GPU machine, which runs as root), where
//! either missing fails. The socket server alone is tested without a GPU by
//! `cuda_ipc::tests::a_process_of_another_user_gets_no_vmm_descriptor` in the library.
#![cfg(feature = "cuda")]

mod common;
#[path = "common/other_user.rs"]
mod other_user;

use common::{announce, announce_path, pattern, self_test, vram, wait_file, wait_notif, whole};
use gpu_mem::{DeviceBuffer, Gpu};
use nixl::metadata::{crc32c, crc32c_append, AgentMetadata};
use nixl::{Agent, AgentConfig, Desc, XferOp};
use other_user::{fork_other_user, other_user_answers};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(30);
const BUF: usize = 8 << 20;
/// `CUDA_IPC`'s frame asking for a VMM allocation's descriptor.
const FRAME_FD_REQUEST: u8 = 2;
/// Bytes of `CUDA_IPC`'s connection information before its socket name (magic, version,
/// boot id, pid, start time, pid namespace, the name's length).
const CONN_FIXED: usize = 4 + 1 + 16 + 4 + 8 + 8 + 1;
/// Where the pid and the start time sit in that connection information.
const CONN_PID: usize = 4 + 1 + 16;
const CONN_START_TIME: usize = CONN_PID + 4;
/// The metadata listener's push and acknowledgement.
const SEND_MD: u8 = 1;
const ACK: u8 = 5;

fn agent(name: &str) -> Agent {
    let config = AgentConfig {
        listen_addr: Some("127.0.0.1:0".parse().unwrap()),
        // A forged push is what this test sends: no token, as where none is configured.
        job_token: None,
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).unwrap();
    agent
        .create_backend("CUDA_IPC", &Default::default())
        .unwrap();
    agent
}

/// The victim (a process of its own, run by [`victim`]): exports a VMM allocation filled
/// with `pattern(9)` and announces its listener, socket name, allocation id and address;
/// serves until the initiator says `bye`.
#[test]
fn other_user_victim_main() {
    let Ok(path) = std::env::var("NIXL_OTHER_USER_VICTIM") else {
        return;
    };
    // Never outlive a failed parent.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(120));
        std::process::exit(3);
    });
    let gpu = Gpu::open(0).unwrap();
    let v = agent("victim");
    let vmm = DeviceBuffer::alloc_vmm(&gpu, BUF).unwrap();
    vmm.copy_from_host(0, &pattern(9, BUF)).unwrap();
    // SAFETY: the allocation lives until the process exits.
    let _h = unsafe { v.register_mem(&vram([whole(&vmm)]), None).unwrap() };
    // What an attacker reads from the victim's metadata: the socket's name and the id.
    let md = AgentMetadata::decode(&v.local_metadata().unwrap()).unwrap();
    let section = md
        .sections
        .iter()
        .find(|s| s.backend == "CUDA_IPC")
        .unwrap();
    let info = section.conn_info.as_ref().unwrap();
    assert_eq!(usize::from(info[CONN_FIXED - 1]), info.len() - CONN_FIXED);
    let socket = String::from_utf8(info[CONN_FIXED..].to_vec()).unwrap();
    let public = &section.regions[0].1;
    assert_eq!(public[1], 2, "the allocation is published as VMM");
    let id = u64::from_le_bytes(public[2..10].try_into().unwrap());
    announce(
        &path,
        &format!("{} {socket} {id} {}", v.listen_addr().unwrap(), vmm.ptr()),
    );
    assert_eq!(wait_notif(&v, "initiator"), b"bye");
}

fn victim() -> (std::process::Child, String) {
    let path = announce_path("nixl-other-user", "victim");
    let mut child = self_test("other_user_victim_main", false)
        .arg("--nocapture")
        .env("NIXL_OTHER_USER_VICTIM", &path)
        .spawn()
        .unwrap();
    let text = wait_file(&path, &mut child);
    (child, text)
}

/// A process's start time (clock ticks after boot), as `CUDA_IPC` advertises it.
fn start_time(pid: libc::pid_t) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    // Field 22 of stat(5); the state (field 3) is the first after the name.
    after_name.split(' ').nth(19).unwrap().parse().unwrap()
}

/// Metadata under the name `mallory` advertising process `pid` (as an attacker pushes
/// it): `template`'s, with its `CUDA_IPC` pid and start time replaced.
fn forged_metadata(template: &Agent, pid: libc::pid_t) -> Vec<u8> {
    let mut md = AgentMetadata::decode(&template.local_metadata().unwrap()).unwrap();
    md.agent = "mallory".into();
    let section = md
        .sections
        .iter_mut()
        .find(|s| s.backend == "CUDA_IPC")
        .unwrap();
    let info = section.conn_info.as_mut().unwrap();
    info[CONN_PID..CONN_PID + 4].copy_from_slice(&(pid as u32).to_le_bytes());
    info[CONN_START_TIME..CONN_START_TIME + 8].copy_from_slice(&start_time(pid).to_le_bytes());
    md.encode().unwrap()
}

/// Pushes `blob` to the metadata listener at `to` as a raw client; the reply's type.
fn push_raw(to: SocketAddr, blob: &[u8]) -> u8 {
    let mut frame = b"NXP2".to_vec();
    frame.push(SEND_MD);
    frame.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    let check = crc32c_append(crc32c(&frame), blob);
    frame.extend_from_slice(&check.to_le_bytes());
    frame.extend_from_slice(blob);
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.write_all(&frame).unwrap();
    let mut header = [0u8; 13];
    s.read_exact(&mut header).unwrap();
    header[4]
}

#[test]
fn cuda_ipc_a_process_of_another_user_gets_no_vmm_descriptor() {
    let test = "cuda_ipc_a_process_of_another_user_gets_no_vmm_descriptor";
    let Some(gpu) = gpu_mem::gpu_for_test(test) else {
        return;
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(
            !gpu_mem::gpu_required(),
            "{test}: NIXL_REQUIRE_GPU=1 but not root (a process of another user needs root)"
        );
        eprintln!("skipped {test}: needs root (to run a process as another user)");
        return;
    }
    let (mut child, text) = victim();
    let mut it = text.split(' ');
    let addr: SocketAddr = it.next().unwrap().parse().unwrap();
    let socket = it.next().unwrap().to_string();
    let id: u64 = it.next().unwrap().parse().unwrap();
    let remote_ptr: u64 = it.next().unwrap().parse().unwrap();
    let mut ids: Vec<u64> = (0..32).collect();
    ids.push(id);
    let initiator = agent("initiator");
    for loaded in [false, true] {
        let (pid, go, answers) = fork_other_user(&socket, &ids, FRAME_FD_REQUEST);
        if loaded {
            assert_eq!(
                push_raw(addr, &forged_metadata(&initiator, pid)),
                ACK,
                "the forged push (no token configured) is taken"
            );
        }
        let got = other_user_answers(pid, go, answers, ids.len());
        for (asked, answer) in ids.iter().zip(&got) {
            assert_eq!(
                answer[1], 0,
                "loaded {loaded}: the descriptor of id {asked} reached another user"
            );
            assert!(
                answer[0] <= 0,
                "loaded {loaded}: id {asked} was answered ({} bytes): the connection of \
                 another user was served",
                answer[0]
            );
        }
    }
    // The real peer still gets the allocation: READ through CUDA_IPC, byte for byte.
    assert_eq!(initiator.fetch_remote_metadata(addr).unwrap(), "victim");
    initiator.send_local_metadata(addr).unwrap();
    let local = DeviceBuffer::alloc(&gpu, BUF).unwrap();
    local.fill(0).unwrap();
    // SAFETY: the buffer outlives the handle and the request.
    let _h = unsafe {
        initiator
            .register_mem(&vram([whole(&local)]), None)
            .unwrap()
    };
    let dev = gpu.ordinal() as u64;
    let mut req = initiator
        .create_xfer_req(
            XferOp::Read,
            &vram([whole(&local)]),
            &vram([Desc::new(remote_ptr, BUF as u64, dev)]),
            "victim",
            None,
        )
        .unwrap();
    req.post().unwrap();
    req.wait(TIMEOUT).unwrap();
    assert!(
        local.to_vec().unwrap() == pattern(9, BUF),
        "the READ of the victim's VMM allocation by its real peer"
    );
    initiator.gen_notif("victim", b"bye").unwrap();
    assert!(child.wait().unwrap().success(), "the victim failed");
}
