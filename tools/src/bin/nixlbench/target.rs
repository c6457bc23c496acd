//! The target side: registers its memory, then serves consistency checks until the
//! initiator says DONE.

use crate::mem::{register, Init, Mem, TARGET_SEED};
use crate::options::{Options, Side};
use crate::provider::with_provider;
use crate::setup::Setup;
use crate::{quiet, INITIATOR, TARGET};
use nixl::Agent;
use std::io::Write;
use std::time::{Duration, Instant};
use tools::rdma::local_providers;

pub(crate) fn run_target(o: &Options) -> Result<(), String> {
    if o.backend == "LOCAL" {
        return Err("LOCAL moves data inside one agent: run without --role".into());
    }
    // Printed by the self-launched target too: its long stages are the initiator's wait.
    let setup = Setup::new("nixlbench target", true);
    let mem = Mem::for_side_init(o, Side::Target, Init::Pattern(TARGET_SEED), &setup)?;
    setup.finish("starting its agent");
    // LIBFABRIC without a provider follows the initiator's choice (module docs).
    let follow = o.is_libfabric() && o.user_provider().is_none();
    let name = if o.is_libfabric() {
        with_provider(TARGET, o.user_provider())
    } else {
        TARGET.to_string()
    };
    let agent = Agent::new(name, o.agent_config(Some(o.listen))).map_err(|e| e.to_string())?;
    let listening = agent
        .listen_addr()
        .ok_or("the target's metadata listener did not start")?;
    let mut reg = None;
    if !follow {
        setup.stage(format!("creating the {} backend", o.backend), 0);
        agent
            .create_backend(&o.backend, &o.params(Side::Target, None))
            .map_err(|e| format!("{}: {e}", o.backend))?;
        setup.stage(format!("registering {}", mem.describe()), mem.len() as u64);
        reg = Some(register(&agent, &mem, None)?);
        setup.finish("announcing its address");
    }
    println!("NIXLBENCH_TARGET {listening}");
    std::io::stdout().flush().ok();
    if follow {
        setup.finish("waiting for the initiator's provider choice");
        let provider = wait_for_provider(&agent)?;
        setup.stage(format!("creating the {} backend", o.backend), 0);
        agent
            .create_backend(&o.backend, &o.params(Side::Target, Some(&provider)))
            .map_err(|e| format!("{} provider {provider}: {e}", o.backend))?;
        setup.stage(format!("registering {}", mem.describe()), mem.len() as u64);
        reg = Some(register(&agent, &mem, None)?);
        setup.finish("serving");
        if !quiet() {
            eprintln!("nixlbench target: LIBFABRIC provider {provider} (the initiator's choice)");
        }
    }
    if !quiet() {
        eprintln!(
            "nixlbench target: {} at {}, {}",
            agent.name(),
            listening,
            mem.describe()
        );
    }
    let served = serve(&agent, &mem, &|| None);
    drop(reg);
    served
}

/// Waits for an initiator's metadata (`nixlbench-initiator@PROVIDER`) and returns its
/// provider.
pub(crate) fn wait_for_provider(agent: &Agent) -> Result<String, String> {
    let providers = local_providers();
    if providers.is_empty() {
        return Err("no libfabric provider with RDM endpoints on this host".into());
    }
    let start = Instant::now();
    loop {
        if let Some(p) = providers
            .iter()
            .find(|p| agent.has_remote(&with_provider(INITIATOR, Some(p))))
        {
            return Ok(p.clone());
        }
        if start.elapsed() > Duration::from_secs(600) {
            return Err(format!(
                "target: no initiator named {INITIATOR}@PROVIDER (PROVIDER one of {}) \
                 sent its metadata in 10 minutes",
                providers.join(", ")
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// How often `serve` asks whether the initiator is gone.
const ASK_GONE_EVERY: Duration = Duration::from_secs(1);

/// Serves until the initiator says DONE: answers CHECK requests by verifying its own
/// memory (`CHECK id seed block batch stride base` → `CHECKED id ok|<what differs>`).
/// `initiator_gone` is asked about once a second; a reason it gives ends the wait with
/// that error (after the notifications already here are read: DONE may be among them).
///
/// Between notifications it sleeps in [`Agent::wait_notifs`], waking only for one (or
/// to ask): a poll every millisecond woke it about 700 times a second in the soft-RoCE
/// guest, whose two CPUs also run the kernel's data path of the transfers it serves.
pub(crate) fn serve(
    agent: &Agent,
    mem: &Mem,
    initiator_gone: &dyn Fn() -> Option<String>,
) -> Result<(), String> {
    let mut last = Instant::now();
    let mut last_asked = Instant::now();
    let mut gone: Option<String> = None;
    loop {
        let notifs = if gone.is_some() {
            // The last look, without waiting.
            agent.get_notifs()
        } else {
            agent.wait_notifs(ASK_GONE_EVERY.saturating_sub(last_asked.elapsed()))
        };
        for (sender, msgs) in notifs {
            last = Instant::now();
            for msg in msgs {
                let text = String::from_utf8_lossy(&msg);
                if text == "DONE" {
                    return Ok(());
                }
                if let Some(rest) = text.strip_prefix("CHECK ") {
                    let (id, verdict) = match check_request(mem, rest) {
                        Ok((id, Ok(()))) => (id, "ok".to_string()),
                        Ok((id, Err(e))) => (id, e),
                        Err(e) => ("?".to_string(), e),
                    };
                    agent
                        .gen_notif(&sender, format!("CHECKED {id} {verdict}").as_bytes())
                        .map_err(|e| format!("target: answering {sender}'s check: {e}"))?;
                }
            }
        }
        if let Some(why) = gone {
            return Err(format!("target: {why} before saying DONE"));
        }
        if last.elapsed() > Duration::from_secs(600) {
            return Err("target: no word from the initiator for 10 minutes".into());
        }
        if last_asked.elapsed() >= ASK_GONE_EVERY {
            last_asked = Instant::now();
            // One more round of notifications is read before this ends the wait.
            gone = initiator_gone();
        }
    }
}

pub(crate) type Verdict = Result<(), String>;

pub(crate) fn check_request(mem: &Mem, request: &str) -> Result<(String, Verdict), String> {
    let f: Vec<&str> = request.split_whitespace().collect();
    let bad = || format!("malformed check request `{request}`");
    if f.len() != 6 {
        return Err(bad());
    }
    let n = |s: &str| s.parse::<u64>().map_err(|_| bad());
    let (seed, block, batch, stride, base) = (n(f[1])?, n(f[2])?, n(f[3])?, n(f[4])?, n(f[5])?);
    // The message comes from a peer: every block it names must lie in this memory, and
    // all of them together can be no more than it (a request cannot make the target
    // check the same bytes 2^64 times, or wrap an offset around).
    let len = mem.len() as u64;
    let last_end = batch
        .checked_sub(1)
        .and_then(|last| last.checked_mul(stride))
        .and_then(|o| o.checked_add(base))
        .and_then(|o| o.checked_add(block));
    let total = batch.checked_mul(block);
    if !matches!((last_end, total), (Some(end), Some(t)) if end <= len && t <= len) {
        return Err(format!(
            "check request `{request}` names blocks outside this target's {len} bytes"
        ));
    }
    let verdict = (0..batch).try_for_each(|i| {
        let off = (base + i * stride) as usize;
        mem.check_pattern(off, block as usize, seed)
    });
    Ok((f[0].to_string(), verdict))
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{point_seed, Mem, INITIATOR_FILL};
    use nixl::MemKind;

    #[test]
    fn target_answers_check_requests() {
        let mem = Mem::alloc(MemKind::Dram, 0, 1 << 16, INITIATOR_FILL, false).unwrap();
        let seed = point_seed(1024, 3);
        for i in 0..3 {
            mem.fill_pattern(4096 + i * 2048, 1024, seed).unwrap();
        }
        let req = format!("1024-3-1 {seed} 1024 3 2048 4096");
        let (id, verdict) = check_request(&mem, &req).unwrap();
        assert_eq!(id, "1024-3-1");
        verdict.unwrap();
        mem.clear(4096 + 2 * 2048 + 1000, 1).unwrap();
        let (_, verdict) = check_request(&mem, &req).unwrap();
        assert!(verdict.unwrap_err().contains("byte 9192"));
        assert!(check_request(&mem, "x 1 2").is_err());
    }

    /// A peer's request cannot make the target spin (2^64 checks of one block) or wrap an
    /// offset around: it is refused at once, naming the bound.
    #[test]
    fn check_requests_outside_the_memory_are_refused() {
        let mem = Mem::alloc(MemKind::Dram, 0, 1 << 16, INITIATOR_FILL, false).unwrap();
        let huge = u64::MAX;
        for req in [
            format!("a 1 1 {huge} 0 0"),
            format!("a 1 4096 {huge} 4096 0"),
            format!("a 1 4096 2 {huge} 0"),
            format!("a 1 4096 1 0 {huge}"),
            "a 1 4096 17 4096 0".to_string(),
            "a 1 65537 1 0 0".to_string(),
            "a 1 2 40000 0 0".to_string(),
        ] {
            let err = check_request(&mem, &req).unwrap_err();
            assert!(
                err.contains("outside this target's 65536 bytes"),
                "{req}: {err}"
            );
        }
        // The largest request that fits is answered (a verdict, not a refusal).
        assert!(check_request(&mem, "a 1 4096 16 4096 0").is_ok());
        // No blocks at all is no request nixlbench makes: refused too.
        assert!(check_request(&mem, "a 1 4096 0 4096 0").is_err());
    }
}
