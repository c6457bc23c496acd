#!/bin/bash
# The KV benchmark through NIXL's Python API, ours (rdma_nixl) and NIXL's wheel side by
# side in one call: tools/peer/kvbench.py run alternately with --impl ours and --impl
# nixl, each case several rounds, then per case both bandwidths and ours/NIXL (median of
# the per-round ratios, with their range).
#
#   bash tools/peer/kvbench-compare.sh [ROUNDS]
#
# Environment:
#   PYTHON        the interpreter that imports both rdma_nixl and NIXL's wheel
#                 (nixl_cu12 / nixl_cu13; NIXL_MODULE picks one) (python3)
#   OURS_PATH     prepended to PYTHONPATH for --impl ours only (a folder holding a
#                 rdma_nixl built from this tree, when the interpreter's is another)
#   KVBENCH       the Rust kvbench binary (release; feature cuda for VRAM): run in each
#                 round too, as a third column (the Rust agent without Python)
#   CASES         space-separated cases INITIATOR_MEM:TARGET_MEM:BLOCKS_PER_REQUEST
#                 [:INITIATOR_GPU:TARGET_GPU] (default: DRAM:DRAM:16 DRAM:DRAM:128;
#                 with 32 layers, 1,024 and 8,192 descriptors per request)
#   KV_ARGS       more kvbench.py arguments for every run (e.g. --op WRITE --inflight 4)
#   LAYERS (32), BLOCKS (1024), BLOCK_BYTES (32K), REQUESTS (20), WARMUP (2)
#   BACKENDS      --backends for both (default: none, NIXL's default configuration)
#   RUN_TIMEOUT   seconds per run (300)
#   OUT           where kvbench-compare.log and rows.csv go (/tmp/kvbench-compare)
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rounds="${1:-${ROUNDS:-3}}"
py="${PYTHON:-python3}"
out="${OUT:-/tmp/kvbench-compare}"
cases="${CASES:-DRAM:DRAM:16 DRAM:DRAM:128}"
common=(--layers "${LAYERS:-32}" --blocks "${BLOCKS:-1024}" --block-bytes "${BLOCK_BYTES:-32K}"
        --requests "${REQUESTS:-20}" --warmup "${WARMUP:-2}")
[ -n "${BACKENDS:-}" ] && common+=(--backends "$BACKENDS")
# shellcheck disable=SC2206 # word splitting of KV_ARGS is the point
extra=(${KV_ARGS:-})

mkdir -p "$out"
log="$out/kvbench-compare.log"
csv="$out/rows.csv"
: >"$log"
rm -f "$csv"
say() { echo "$*" | tee -a "$log"; }
say "kvbench-compare: $(date -u +%FT%TZ) on $(hostname), kernel $(uname -r), $(nproc) CPUs"
grep -m1 'model name' /proc/cpuinfo | sed 's/^.*: /cpu: /' | tee -a "$log"
command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>&1 | tee -a "$log"

run_one() { # impl case round
    local impl="$1" case="$2" round="$3"
    IFS=: read -r imem tmem bpr igpu tgpu <<<"$case"
    local args=("${common[@]}" --initiator-mem "$imem" --target-mem "$tmem"
                --blocks-per-request "$bpr" --initiator-gpu "${igpu:-0}"
                --target-gpu "${tgpu:-0}" "${extra[@]}" --csv "$out/$impl.csv")
    say "== round $round, $impl, $case"
    if [ "$impl" = ours ] && [ -n "${OURS_PATH:-}" ]; then
        PYTHONPATH="$OURS_PATH${PYTHONPATH:+:$PYTHONPATH}" timeout "${RUN_TIMEOUT:-300}" \
            "$py" "$here/kvbench.py" --impl ours "${args[@]}" 2>&1 | grep -v ' INFO ' | tee -a "$log"
    else
        timeout "${RUN_TIMEOUT:-300}" "$py" "$here/kvbench.py" --impl "$impl" "${args[@]}" \
            2>&1 | grep -v ' INFO ' | tee -a "$log"
    fi
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || say "kvbench-compare: $impl $case round $round failed (exit $rc)"
    # The row just appended, tagged with its case and round.
    if [ "$rc" -eq 0 ] && [ -f "$out/$impl.csv" ]; then
        [ -f "$csv" ] || echo "case,round,$(head -n1 "$out/$impl.csv")" >"$csv"
        echo "$case,$round,$(tail -n1 "$out/$impl.csv")" >>"$csv"
    fi
}

# The Rust kvbench, same case: its table row appended to rust.csv in kvbench.py's columns.
run_rust() { # case round
    local case="$1" round="$2"
    IFS=: read -r imem tmem bpr igpu tgpu <<<"$case"
    say "== round $round, rust, $case"
    local text
    text="$(timeout "${RUN_TIMEOUT:-300}" "$KVBENCH" "${common[@]}" --initiator-mem "$imem" \
        --target-mem "$tmem" --blocks-per-request "$bpr" --initiator-gpu "${igpu:-0}" \
        --target-gpu "${tgpu:-0}" "${extra[@]}" 2>&1)"
    local rc=$?
    echo "$text" | tee -a "$log"
    [ "$rc" -eq 0 ] || { say "kvbench-compare: rust $case round $round failed (exit $rc)"; return; }
    # descs/req bytes/req inflight requests GB/s p50 p99 prep-local prep-remote
    local row
    row="$(echo "$text" | awk '/descs\/req/ {getline; print; exit}')"
    read -r d b i n g p50 p99 pl pr <<<"$row"
    echo "$case,$round,rust,$d,$g,$p50,$pl,$pr" >>"$out/rust.rows"
}

rm -f "$out/ours.csv" "$out/nixl.csv" "$out/rust.rows"
for case in $cases; do
    for round in $(seq 1 "$rounds"); do
        # Alternate which goes first, so that neither always meets a warm (or cold) machine.
        if [ $((round % 2)) -eq 1 ]; then order="nixl ours"; else order="ours nixl"; fi
        for impl in $order; do run_one "$impl" "$case" "$round"; done
        [ -n "${KVBENCH:-}" ] && run_rust "$case" "$round"
    done
done

[ -f "$csv" ] || { say "kvbench-compare: no run succeeded"; exit 1; }
"$py" - "$csv" "$out/rust.rows" <<'EOF' | tee -a "$log"
import csv, os, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
rust = {}
if os.path.exists(sys.argv[2]):
    for line in open(sys.argv[2]):
        case, _round, _impl, _d, gbps, p50, pl, pr = line.strip().split(",")
        rust.setdefault(case, []).append((float(gbps), float(p50), float(pl) + float(pr)))
by = {}
for r in rows:
    by.setdefault((r["case"], r["round"]), {})["nixl" if r["impl"].startswith("nixl") else "ours"] = r
cases = sorted({c for c, _ in by}, key=lambda c: [r["case"] for r in rows].index(c))
print("\ncase (initiator:target:blocks/request) | descs/req | NIXL GB/s | ours GB/s | ours/NIXL (median, range) | NIXL p50 us | ours p50 us | NIXL prep ms | ours prep ms")
print("|".join(["---"] * 9))
for c in cases:
    pairs = [v for (cc, _), v in by.items() if cc == c and len(v) == 2]
    if not pairs:
        print(f"{c} | (no complete round)")
        continue
    med = lambda impl, f: statistics.median(float(p[impl][f]) for p in pairs)
    ratios = sorted(float(p["ours"]["gbps"]) / max(float(p["nixl"]["gbps"]), 1e-12) for p in pairs)
    prep = lambda impl: med(impl, "prep_local_ms") + med(impl, "prep_remote_ms")
    print(f"{c} | {pairs[0]['ours']['descs_per_req']} | {med('nixl', 'gbps'):.2f} | "
          f"{med('ours', 'gbps'):.2f} | {statistics.median(ratios):.2f}x "
          f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {med('nixl', 'p50_us'):.0f} | "
          f"{med('ours', 'p50_us'):.0f} | {prep('nixl'):.1f} | {prep('ours'):.1f}")
if rust:
    print("\ncase | Rust kvbench GB/s (median) | p50 us | prep ms (both lists)")
    print("|".join(["---"] * 4))
    for c, v in rust.items():
        print(f"{c} | {statistics.median(x[0] for x in v):.2f} | "
              f"{statistics.median(x[1] for x in v):.0f} | {statistics.median(x[2] for x in v):.1f}")
print("\nimplementations: " + ", ".join(sorted({r['impl'] for r in rows})))
EOF
