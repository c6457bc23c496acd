#!/bin/bash
# Issue 28's p99 goal on a machine with many cores and no Rust toolchain: runs a prebuilt
# `nixl-attack-bench` (release build) with the target, the initiator and the attackers
# on separate cores, and summarizes p50/p99, RSS and heap growth per phase and the p99
# ratios to the quiet baseline (goal: within 2x; RSS growth under 64 MiB).
#
#   bash tools/peer/attack-bench-gpu-host.sh PATH/TO/nixl-attack-bench [ROUNDS]
#
# Each round runs, per provider, the bench's quiet baseline and every attack phase
# (connections, junk, notifications, all) at full size; rounds alternate the provider
# order. The summary gives per provider and phase the median over rounds (and the range)
# of each figure; a ratio is taken within its own run (its own quiet baseline).
# Environment:
#   OUT            folder for the raw outputs and summary.txt (default a temporary one)
#   PROVIDERS      comma-separated (default "shm,tcp;ofi_rxm")
#   TARGET_CPUS, INITIATOR_CPUS, ATTACKER_CPUS
#                  CPU lists for taskset / the bench (default: of the N online CPUs, the
#                  first quarter for the target, the second for the initiator, the other
#                  half for the attackers; with fewer than 8 CPUs nothing is pinned)
#   BENCH_ARGS     more bench arguments, split on spaces (e.g. "--junk 256M" or
#                  "--backend_param heartbeat_misses=20")
# Needs: bash, taskset (util-linux), python3, libfabric 1.x (providers tcp and shm) where
# the binary's loader finds it (LD_LIBRARY_PATH). Exit status 1 when a run broke (its
# legitimate data not all verified, the target died, a forged notification delivered
# under the initiator's name); a missed goal is reported, not an error.
set -uo pipefail
[ $# -ge 1 ] || { sed -n '2,26p' "$0"; exit 2; }
bin="$(readlink -f "$1")"
rounds="${2:-3}"
[ -x "$bin" ] || { echo "$bin: not an executable (the release nixl-attack-bench)"; exit 2; }
out="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/attack-bench.XXXXXX")}"
mkdir -p "$out"
providers="${PROVIDERS:-shm,tcp;ofi_rxm}"
read -r -a extra <<<"${BENCH_ARGS:-}"

if ! "$bin" --version >/dev/null 2>&1; then
    echo "$bin does not start here:"
    "$bin" --version 2>&1 | tail -3
    ldd "$bin" 2>/dev/null | grep "not found"
    echo "(libfabric.so.1 must be where the loader finds it: LD_LIBRARY_PATH)"
    exit 2
fi

cpus=$(nproc)
quarter=$((cpus / 4))
if [ -z "${TARGET_CPUS:-}${INITIATOR_CPUS:-}${ATTACKER_CPUS:-}" ] && [ "$cpus" -ge 8 ]; then
    TARGET_CPUS="0-$((quarter - 1))"
    INITIATOR_CPUS="$quarter-$((2 * quarter - 1))"
    ATTACKER_CPUS="$((2 * quarter))-$((cpus - 1))"
fi
pin=()
[ -n "${INITIATOR_CPUS:-}" ] && pin=(taskset -c "$INITIATOR_CPUS")
pins=()
[ -n "${TARGET_CPUS:-}" ] && pins+=(--target-cpus "$TARGET_CPUS")
[ -n "${ATTACKER_CPUS:-}" ] && pins+=(--attacker-cpus "$ATTACKER_CPUS")

{
    echo "machine: $(hostname), $cpus CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), load $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "binary: $bin ($("$bin" --version 2>&1))"
    echo "pinning: target ${TARGET_CPUS:-any}, initiator ${INITIATOR_CPUS:-any}, attackers ${ATTACKER_CPUS:-any}"
    echo "providers: $providers; rounds: $rounds; extra arguments: ${BENCH_ARGS:-none}"
} | tee "$out/machine.txt"

broken=0
IFS=',' read -r -a plist <<<"$providers"
for r in $(seq 1 "$rounds"); do
    order=("${plist[@]}")
    if [ $((r % 2)) -eq 0 ]; then
        order=()
        for ((i = ${#plist[@]} - 1; i >= 0; i--)); do order+=("${plist[$i]}"); done
    fi
    for p in "${order[@]}"; do
        tag="$(echo "$p" | tr -c 'a-zA-Z0-9\n' '_').$r"
        echo "round $r: $p (load $(cut -d' ' -f1 /proc/loadavg))"
        start=$(date +%s)
        RUST_LOG="${RUST_LOG:-error}" "${pin[@]}" "$bin" --provider "$p" "${pins[@]}" "${extra[@]}" \
            >"$out/run.$tag.txt" 2>"$out/run.$tag.err"
        rc=$?
        echo "  exit $rc after $(( $(date +%s) - start )) s"
        if [ $rc -ne 0 ]; then
            broken=1
            grep -h "FAILED" "$out/run.$tag.err" | head -5
        fi
    done
done

python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import glob, statistics, sys
out = sys.argv[1]
rows = {}  # (provider, phase) -> list of dicts, one per run
for path in sorted(glob.glob(f"{out}/run.*.txt")):
    run = {}
    for line in open(path):
        if not line.startswith("RESULT "):
            continue
        f = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
        run[f["phase"]] = f
    quiet = run.get("quiet")
    for phase, f in run.items():
        f = dict(f)
        if quiet and phase != "quiet":
            for k in ("xfer_p99_us", "round_p99_us"):
                q = float(quiet[k])
                f[k + "_ratio"] = float(f[k]) / q if q > 0 else float("nan")
        rows.setdefault((f["provider"], phase), []).append(f)
def cell(vals, fmt):
    if not vals:
        return "-"
    m = statistics.median(vals)
    return fmt.format(m) if len(vals) == 1 else (fmt + " ({}-{})").format(m, fmt.format(min(vals)), fmt.format(max(vals)))
mib = lambda b: b / (1 << 20)
order = ["quiet", "connections", "junk", "notifications", "all"]
print(f"{'provider':<12} {'phase':<13} {'runs':>4}  {'p50 us':<22} {'p99 us':<24} {'round p99 us':<24} "
      f"{'p99/quiet':<20} {'round p99/quiet':<20} {'RSS +MiB':<20} {'heap in use +MiB':<20} {'probes ok/all':<13}")
missed = []
for (prov, phase) in sorted(rows, key=lambda k: (k[0], order.index(k[1]) if k[1] in order else 99)):
    rs = rows[(prov, phase)]
    num = lambda k: [float(r[k]) for r in rs if k in r and float(r[k]) >= 0]
    probes = f"{sum(int(r['probes_ok']) for r in rs)}/{sum(int(r['probes_ok']) + int(r['probes_failed']) for r in rs)}"
    print(f"{prov:<12} {phase:<13} {len(rs):>4}  {cell(num('xfer_p50_us'), '{:.1f}'):<22} "
          f"{cell(num('xfer_p99_us'), '{:.1f}'):<24} {cell(num('round_p99_us'), '{:.1f}'):<24} "
          f"{cell(num('xfer_p99_us_ratio'), '{:.2f}'):<20} {cell(num('round_p99_us_ratio'), '{:.2f}'):<20} "
          f"{cell([mib(x) for x in num('rss_growth_bytes')], '{:.1f}'):<20} "
          f"{cell([mib(x) for x in num('heap_in_use_growth_bytes')], '{:.1f}'):<20} {probes:<13}")
    if phase != "quiet":
        worst = max(num('xfer_p99_us_ratio') + num('round_p99_us_ratio') or [0])
        rss = max(num('rss_growth_bytes') or [0])
        if statistics.median(num('xfer_p99_us_ratio') or [0]) > 2 or statistics.median(num('round_p99_us_ratio') or [0]) > 2:
            missed.append(f"{prov} {phase}: median p99 over 2x the quiet baseline (worst run {worst:.2f}x)")
        if rss >= 64 << 20:
            missed.append(f"{prov} {phase}: RSS grew {mib(rss):.1f} MiB in a run (goal: under 64)")
print()
print("goals (issue 28: p99 within 2x of quiet, RSS growth under 64 MiB):", "all met" if not missed else "")
for m in missed:
    print("  missed:", m)
EOF
echo "raw outputs and summary.txt: $out"
exit $broken
