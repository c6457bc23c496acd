//! The rail workers' cost when nothing moves, and their response while traffic flows.

use super::*;
use std::time::Instant;

/// CPU seconds used so far by this process's threads named `name`.
fn thread_cpu(name: &str) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    let mut total = 0.0;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // Fields after the parenthesized name: state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: f64 = fields[11].parse().unwrap();
        let stime: f64 = fields[12].parse().unwrap();
        total += (utime + stime) / tick;
    }
    total
}

#[test]
fn idle_rail_workers_do_not_burn_a_core() {
    for provider in ["shm", "tcp;ofi_rxm"] {
        let agent = Agent::new(format!("idle-{provider}"), crate::AgentConfig::default()).unwrap();
        let params: BackendParams = [("provider".to_string(), provider.to_string())].into();
        let backend = open(&agent, &params).unwrap();
        // Past the spin after activity and the short naps that follow it.
        std::thread::sleep(SPIN_AFTER_ACTIVITY + Duration::from_millis(500));
        let before = thread_cpu("nixl-fabric-rai");
        let window = Duration::from_millis(1000);
        std::thread::sleep(window);
        let used = thread_cpu("nixl-fabric-rai") - before;
        let share = used / window.as_secs_f64();
        println!(
            "{provider}: idle rail worker used {:.1}% of a core (wait fd {}, remote op counter {})",
            share * 100.0,
            backend.rails[0].idle.has_wait_fd(),
            backend.rails[0].idle.counts_remote_ops()
        );
        // A spinning worker shows 50-100% here; a sleeping one a few percent at most.
        assert!(
            share < 0.15,
            "{provider}: an idle worker used {:.0}% of a core",
            share * 100.0
        );
        drop(backend);
    }
}

/// A target whose worker went to sleep still answers WRITEs without notification
/// promptly: incoming traffic wakes it (a wait fd) or keeps it spinning (the remote
/// operation counter), so deliveries do not wait out its naps one by one.
#[test]
fn a_sleeping_target_answers_writes_without_notification_promptly() {
    use crate::{params, Desc, DescList, XferOp};
    for provider in ["shm", "tcp;ofi_rxm"] {
        let make = |name: &str| {
            let agent = Agent::new(name, crate::AgentConfig::default()).unwrap();
            agent
                .create_backend("LIBFABRIC", &params([("provider", provider)]))
                .unwrap();
            agent
        };
        let tag = provider.replace(';', "_");
        let initiator = make(&format!("wake-init-{tag}"));
        let target = make(&format!("wake-tgt-{tag}"));
        let src = vec![5u8; 4096];
        let mut dst = vec![0u8; 4096];
        let dst_p = dst.as_mut_ptr() as u64;
        let one = |p: u64| DescList::from_descs(MemKind::Dram, [Desc::new(p, 4096, 0)]);
        // SAFETY: both buffers outlive the registrations and the request.
        let _hi = unsafe { initiator.register_mem(&one(src.as_ptr() as u64), None) }.unwrap();
        // SAFETY: as above.
        let _ht = unsafe { target.register_mem(&one(dst_p), None) }.unwrap();
        let name = initiator
            .load_remote_metadata(&target.local_metadata().unwrap())
            .unwrap();
        let mut req = initiator
            .create_xfer_req(
                XferOp::Write,
                &one(src.as_ptr() as u64),
                &one(dst_p),
                &name,
                None,
            )
            .unwrap();
        // Both workers deep asleep (the longest naps).
        std::thread::sleep(SPIN_AFTER_ACTIVITY + Duration::from_millis(500));
        let mut lat = Vec::new();
        for _ in 0..300 {
            let start = Instant::now();
            req.post().unwrap();
            req.wait(Duration::from_secs(10)).unwrap();
            lat.push(start.elapsed());
        }
        lat.sort();
        let median = lat[lat.len() / 2];
        println!(
            "{provider}: 4 KiB WRITE after an idle spell: median {median:?}, slowest {:?}",
            lat.last().unwrap()
        );
        assert_eq!(dst, src, "{provider}: data delivered");
        // Napping through every delivery would cost about a nap (up to 1 ms) each.
        assert!(
            median < Duration::from_micros(400),
            "{provider}: median {median:?}: the target sleeps through traffic"
        );
    }
}
