#!/usr/bin/env bash
# nixlbench's VERBS backend against verbs-bench (perftest's ib_{read,write}_bw) on the
# same memory footprint, in ONE soft-RoCE guest boot, pairs alternating (which tool goes
# first alternates too), so that one noisy run does not decide:
#
#   cargo build --release -p rdma-rs-tools --bin nixlbench --bin verbs-bench
#   cargo xtask rxe -t 1800 -- bash tools/bench/nixlbench-vs-verbs.sh [PAIRS]
#
# For each point (op, size x batch) it prints both tools' median GB/s and the median and
# range of the per-pair ratios nixlbench / verbs-bench. verbs-bench runs with
# `-t BATCH --spread 2*SIZE*BATCH`: the blocks nixlbench's batch touches (two sizes
# apart), so both copy the same bytes through the emulated NIC. Environment:
# BIN (default target/release), DEV (rxe0), POINTS ("OP:SIZE:BATCH ...").
set -euo pipefail
pairs=${1:-6}
bin=${BIN:-target/release}
dev=${DEV:-rxe0}
points=${POINTS:-"READ:65536:32 READ:262144:8 READ:1048576:8 WRITE:65536:32 WRITE:262144:8 WRITE:1048576:8"}
[ "${RXE_VM:-}" = 1 ] || { echo "run me in the guest: cargo xtask rxe -- bash $0" >&2; exit 2; }

# verbs-bench: server in the background, client prints perftest's table; GB/s = BW
# average (MB/s) / 1000.
verbs() { # OP SIZE BATCH
  local test=read-bw iters=$((4000 * 65536 / $2))
  [ "$1" = WRITE ] && test=write-bw
  [ $iters -lt 1000 ] && iters=1000
  local spread=$((2 * $2 * $3))
  "$bin/verbs-bench" "$test" -d "$dev" -s "$2" -n "$iters" -t "$3" --spread "$spread" -p 18600 \
    >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  "$bin/verbs-bench" "$test" -d "$dev" -s "$2" -n "$iters" -t "$3" --spread "$spread" -p 18600 \
    127.0.0.1 2>/dev/null | awk '/#bytes/ {hdr=1; next} hdr && NF >= 4 {printf "%.4f\n", $4 / 1000; exit}'
  wait "$server" 2>/dev/null || true
}

# nixlbench: starts its own target process; GB/s is column 3 of the result line.
nixl() { # OP SIZE BATCH
  "$bin/nixlbench" --backend VERBS --device_list "$dev" --op_type "$1" \
    --start_block_size "$2" --max_block_size "$2" --start_batch_size "$3" --max_batch_size "$3" \
    2>/dev/null | awk -v s="$2" '$1 == s && NF >= 4 {print $3; exit}'
}

median() { sort -g | awk '{v[NR]=$1} END {if (NR == 0) print "nan"; else if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }

printf '%-6s %8s %5s %10s %10s %14s\n' op size batch nixl_GB/s verbs_GB/s 'ratio [range]'
for point in $points; do
  IFS=: read -r op size batch <<<"$point"
  ours=() theirs=() ratios=()
  for ((k = 0; k < pairs; k++)); do
    if ((k % 2)); then a=$(nixl "$op" "$size" "$batch"); b=$(verbs "$op" "$size" "$batch")
    else b=$(verbs "$op" "$size" "$batch"); a=$(nixl "$op" "$size" "$batch"); fi
    [ -n "$a" ] && [ -n "$b" ] || { echo "pair $k of $point: a run printed no result" >&2; continue; }
    ours+=("$a") theirs+=("$b")
    ratios+=("$(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.3f", a / b}')")
  done
  [ ${#ratios[@]} -gt 0 ] || continue
  lo=$(printf '%s\n' "${ratios[@]}" | sort -g | head -1)
  hi=$(printf '%s\n' "${ratios[@]}" | sort -g | tail -1)
  printf '%-6s %8s %5s %10s %10s %6s [%s-%s]\n' "$op" "$size" "$batch" \
    "$(printf '%s\n' "${ours[@]}" | median)" "$(printf '%s\n' "${theirs[@]}" | median)" \
    "$(printf '%s\n' "${ratios[@]}" | median)" "$lo" "$hi"
done
