//! The target process: an agent with a metadata listener and a `LIBFABRIC` backend,
//! one registered buffer of slots, and a loop that checks every notification of the
//! legitimate initiator against the bytes its slot holds and answers it.
//!
//! Protocol with the harness (its standard input and output): the target prints
//! `ATTACK_TARGET <listen address> <buffer address> <buffer bytes>` once it serves, and
//! `ATTACK_TARGET_STATS key=value ...` when its standard input closes, then exits. Each
//! line the harness writes (`mark <phase>`) is answered with `ATTACK_TARGET_HEAP
//! in_use=.. peak_in_use=.. system=.. peak_system=..`: the allocator's bytes in use and
//! bytes taken from the system (glibc's `mallinfo2`, sampled every 10 ms), now and at
//! their peak since the previous mark, so that RSS growth can be split into live heap,
//! free memory the allocator keeps, and memory outside `malloc` (e.g. a provider's
//! mappings).
//! A legitimate notification is `w <seq> <slot> <nonce>`; the answer is `ok <seq>` or
//! `bad <seq>`. A notification under the initiator's name without the run's nonce is a
//! forged one that was delivered: counted, never acted on.

use crate::wire::holds_pattern;
use crate::INITIATOR;
use nixl::{Agent, AgentConfig, BackendParams, Desc, DescList, MemKind};
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub(crate) const TARGET: &str = "attack-target";

pub(crate) struct TargetArgs {
    pub(crate) provider: String,
    pub(crate) params: BackendParams,
    pub(crate) block: usize,
    pub(crate) slots: usize,
    pub(crate) nonce: String,
}

#[derive(Default)]
struct Counts {
    verified: u64,
    bad: u64,
    forged_as_initiator: u64,
    strangers: u64,
    answer_errors: u64,
}

pub(crate) fn run(args: &TargetArgs) -> Result<(), String> {
    let config = AgentConfig {
        listen_addr: Some("127.0.0.1:0".parse().map_err(|e| format!("{e}"))?),
        ..AgentConfig::default()
    };
    let agent = Agent::new(TARGET, config).map_err(|e| e.to_string())?;
    agent
        .create_backend("LIBFABRIC", &args.params)
        .map_err(|e| format!("LIBFABRIC provider {}: {e}", args.provider))?;
    // Written by the initiator from now on: reached through `base` only, never through a
    // reference, while registered.
    let mut buffer = vec![0u8; args.block * args.slots];
    let base = buffer.as_mut_ptr();
    let list = DescList::from_descs(
        MemKind::Dram,
        [Desc::new(base as u64, buffer.len() as u64, 0)],
    );
    // SAFETY: `buffer` is neither moved nor dropped before the registration (dropped at
    // the end of this function, first).
    let registration = unsafe { agent.register_mem(&list, None) }.map_err(|e| e.to_string())?;
    let listening = agent
        .listen_addr()
        .ok_or("the target's metadata listener did not start")?;
    println!(
        "ATTACK_TARGET {listening} {} {}",
        base as u64,
        args.block * args.slots
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;

    // The harness closes our standard input to stop us (and so does its death); each
    // line before that asks for the heap counters.
    let stop = Arc::new(AtomicBool::new(false));
    let heap = Arc::new(HeapPeaks::default());
    {
        let (stop, heap) = (stop.clone(), heap.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                heap.sample();
                std::thread::sleep(Duration::from_millis(10));
            }
        });
    }
    {
        let (stop, heap) = (stop.clone(), heap.clone());
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                if line.is_err() {
                    break;
                }
                heap.sample();
                let [in_use, peak_in_use, system, peak_system] = heap.mark();
                println!(
                    "ATTACK_TARGET_HEAP in_use={in_use} peak_in_use={peak_in_use} \
                     system={system} peak_system={peak_system}"
                );
                std::io::stdout().flush().ok();
            }
            stop.store(true, Ordering::SeqCst);
        });
    }
    let mut counts = Counts::default();
    while !stop.load(Ordering::SeqCst) {
        for (sender, messages) in agent.wait_notifs(Duration::from_millis(100)) {
            if sender != INITIATOR {
                counts.strangers += messages.len() as u64;
                continue;
            }
            for message in messages {
                serve_one(&agent, base, args, &message, &mut counts);
            }
        }
    }
    println!(
        "ATTACK_TARGET_STATS verified={} bad={} forged_as_initiator={} strangers={} \
         answer_errors={}",
        counts.verified,
        counts.bad,
        counts.forged_as_initiator,
        counts.strangers,
        counts.answer_errors,
    );
    std::io::stdout().flush().ok();
    drop(registration);
    drop(buffer);
    Ok(())
}

/// Checks one notification of the initiator's name and answers it.
fn serve_one(
    agent: &Agent,
    base: *const u8,
    args: &TargetArgs,
    message: &[u8],
    counts: &mut Counts,
) {
    let text = String::from_utf8_lossy(message);
    let mut fields = text.split(' ');
    let parsed = match (fields.next(), fields.next(), fields.next(), fields.next()) {
        (Some("w"), Some(seq), Some(slot), Some(nonce)) if nonce == args.nonce => seq
            .parse::<u64>()
            .ok()
            .zip(slot.parse::<usize>().ok().filter(|s| *s < args.slots)),
        _ => None,
    };
    let Some((seq, slot)) = parsed else {
        counts.forged_as_initiator += 1;
        return;
    };
    // The slot is ours to read: the initiator writes it again only after our answer, and
    // its bytes landed before the notification was released (the backend's guarantee).
    let mut bytes = vec![0u8; args.block];
    // SAFETY: `slot < slots`, so the range lies inside the registered buffer, which lives
    // until `run` returns; a copy through the raw pointer makes no reference to memory
    // another process writes.
    unsafe {
        std::ptr::copy_nonoverlapping(base.add(slot * args.block), bytes.as_mut_ptr(), args.block)
    };
    let good = holds_pattern(seq, &bytes);
    if good {
        counts.verified += 1;
    } else {
        counts.bad += 1;
    }
    let answer = format!("{} {seq}", if good { "ok" } else { "bad" });
    if agent.gen_notif(INITIATOR, answer.as_bytes()).is_err() {
        counts.answer_errors += 1;
    }
}

/// The allocator's counters, now and at their peak since the last mark.
#[derive(Default)]
struct HeapPeaks {
    in_use: AtomicU64,
    peak_in_use: AtomicU64,
    system: AtomicU64,
    peak_system: AtomicU64,
}

impl HeapPeaks {
    fn sample(&self) {
        if let Some((in_use, system)) = heap_counters() {
            self.in_use.store(in_use, Ordering::Relaxed);
            self.system.store(system, Ordering::Relaxed);
            self.peak_in_use.fetch_max(in_use, Ordering::Relaxed);
            self.peak_system.fetch_max(system, Ordering::Relaxed);
        }
    }

    /// Now and the peaks (in use, from the system); the peaks restart from now.
    fn mark(&self) -> [u64; 4] {
        let (in_use, system) = (
            self.in_use.load(Ordering::Relaxed),
            self.system.load(Ordering::Relaxed),
        );
        [
            in_use,
            self.peak_in_use.swap(in_use, Ordering::Relaxed),
            system,
            self.peak_system.swap(system, Ordering::Relaxed),
        ]
    }
}

/// glibc's heap counters over every arena: bytes handed out (small and mmapped blocks),
/// and bytes taken from the system (arenas and mmapped blocks).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_counters() -> Option<(u64, u64)> {
    // SAFETY: mallinfo2 takes no argument and returns a plain struct.
    let m = unsafe { libc::mallinfo2() };
    Some(((m.uordblks + m.hblkhd) as u64, (m.arena + m.hblkhd) as u64))
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap_counters() -> Option<(u64, u64)> {
    None
}
