#!/bin/bash
# NIXL 1.5.1's own wheel and our nixlbench, side by side, in one call on the GPU machine.
#
#   bash tools/peer/compare.sh NIXL NIXLBENCH [ROUNDS]
#
# NIXL       the repacked wheel from tools/peer/fetch-nixl-wheel.sh (.peer/nixl_cu13-*.whl),
#            a folder holding it (.peer), or a folder where it is already installed or
#            unpacked (holding nixl_cu13/); a wheel is installed into a temporary site
#            folder with `pip install --no-deps --target` (no network needed)
# NIXLBENCH  our nixlbench built with feature cuda, e.g. target/gpu-bundle/bin/nixlbench
#            from `cargo xtask gpu-bundle` (a library this machine lacks is taken from the
#            bundle's lib/ beside bin/)
# ROUNDS     rounds (default 3); each round runs NIXL's bench and ours, the order
#            alternating between rounds; a round starts only if it fits the time budget
#
# NIXL side: tools/peer/nixl_peer_bench.py, UCX, WRITE and READ for VRAM->VRAM,
# VRAM->DRAM, DRAM->VRAM and DRAM->DRAM (initiator -> target), one process pair.
# Our side: nixlbench --backend CUDA_IPC (VRAM->VRAM, DRAM->VRAM) and LIBFABRIC (DRAM->DRAM
# with its default provider, shm on one host; VRAM->DRAM), WRITE and READ, each a run.
# Both: block sizes 4 KiB..64 MiB, batch 1, 1000 iterations (1000/16 from 1 MiB), 100
# warmup, --check_consistency. Prints per size the bandwidth of both and ours/NIXL (median
# of the per-round ratios, with their range).
#
# Writes to ${OUT:-/tmp/peer-out}: compare.log (everything), rows.csv (every row of every
# run), ratios.csv (the summary table). Environment: PYTHON (python3), ROUNDS,
# BUDGET_S (270: no round starts that would end later), START_BLOCK_SIZE (4096),
# MAX_BLOCK_SIZE (67108864), NUM_ITER (1000), WARMUP_ITER (100), SEGS (NIXL's cases,
# INITIATOR:TARGET comma-separated), OURS_CASES (BACKEND:INITIATOR:TARGET, space-separated),
# OPS (WRITE READ), REQUIRE_GPU (1: a missing GPU fails NIXL's VRAM cases), CASE_TIMEOUT
# (90 s per nixlbench run), NIXL_TIMEOUT (150 s per NIXL run).
set -uo pipefail

usage() { sed -n '2,31p' "$0"; exit 2; }
[ $# -ge 2 ] || usage
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nixl_src="$1"
nixlbench="$(readlink -f "$2")"
rounds="${3:-${ROUNDS:-3}}"
py="${PYTHON:-python3}"
out="${OUT:-/tmp/peer-out}"
budget="${BUDGET_S:-270}"
start_bs="${START_BLOCK_SIZE:-4096}"
max_bs="${MAX_BLOCK_SIZE:-67108864}"
num_iter="${NUM_ITER:-1000}"
warmup="${WARMUP_ITER:-100}"
segs="${SEGS:-VRAM:VRAM,VRAM:DRAM,DRAM:VRAM,DRAM:DRAM}"
ours_cases="${OURS_CASES:-CUDA_IPC:VRAM:VRAM CUDA_IPC:DRAM:VRAM LIBFABRIC:VRAM:DRAM LIBFABRIC:DRAM:DRAM}"
ops="${OPS:-WRITE READ}"

mkdir -p "$out"
log="$out/compare.log"
: >"$log"
say() { echo "$*" | tee -a "$log"; }
work="$(mktemp -d "${TMPDIR:-/tmp}/peer-compare.XXXXXX")"
trap 'rm -rf "$work"' EXIT
t0=$SECONDS

say "compare: $(date -u +%FT%TZ) on $(hostname), kernel $(uname -r)"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$log"
else
    say "nvidia-smi: not found"
fi
manifest="$(dirname "$nixlbench")/../MANIFEST"
[ -f "$manifest" ] && head -n 2 "$manifest" | tee -a "$log"

# NIXL's package: a wheel to install, or a folder that already holds it.
site=''
whl=''
if [ -f "$nixl_src" ]; then
    whl="$nixl_src"
elif [ -d "$nixl_src" ] && ls -d "$nixl_src"/nixl_cu1[0-9] >/dev/null 2>&1; then
    site="$(readlink -f "$nixl_src")"
elif [ -d "$nixl_src" ]; then
    whl="$(ls "$nixl_src"/nixl_cu1[0-9]-*.whl 2>/dev/null | head -n 1)"
fi
if [ -z "$site" ]; then
    [ -n "$whl" ] || { say "compare: no NIXL wheel at $nixl_src (run tools/peer/fetch-nixl-wheel.sh)"; exit 2; }
    site="$work/site"
    deps=("$(dirname "$whl")"/deps/*.whl)
    [ -e "${deps[0]}" ] || deps=()
    say "compare: installing $(basename "$whl") into $site"
    if ! "$py" -m pip install --quiet --no-deps --no-compile --disable-pip-version-check \
        --target "$site" "$whl" "${deps[@]}" 2>>"$log"; then
        say "compare: pip failed: unpacking the wheel instead"
        "$py" - "$site" "$whl" "${deps[@]}" <<'PY' || exit 2
import os, sys, zipfile
site = sys.argv[1]
for w in sys.argv[2:]:
    if not os.path.isfile(w):
        continue
    with zipfile.ZipFile(w) as z:
        for info in z.infolist():
            path = z.extract(info, site)
            mode = info.external_attr >> 16
            if mode:
                os.chmod(path, mode & 0o7777)
PY
    fi
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# The package this wheel provides (nixl_cu13 or nixl_cu12): the bench imports that one.
NIXL_MODULE="$(basename "$(ls -d "$site"/nixl_cu1[0-9] 2>/dev/null | head -n 1)")"
[ -n "$NIXL_MODULE" ] || { say "compare: no nixl_cu1* package in $site"; exit 2; }
export NIXL_MODULE NIXL_SITE="$site"
if ! "$py" - >>"$log" 2>&1 <<'PY'; then
import importlib, os, sys
import numpy
name = os.environ["NIXL_MODULE"]
mod = importlib.import_module(name)
site = os.path.realpath(os.environ["NIXL_SITE"])
if not os.path.realpath(mod.__file__).startswith(site + os.sep):
    sys.exit(f"{name} was imported from {mod.__file__}, not from {site}")
try:
    import torch
    print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}, torch {torch.__version__},"
          f" CUDA available: {torch.cuda.is_available()}, NIXL package {name}")
except ImportError:
    print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}, no torch, NIXL package {name}")
PY
    say "compare: NIXL's package does not import with $py (see above)"
    tail -n 5 "$log"
    exit 2
fi
tail -n 1 "$log"

# Our nixlbench: a library this machine lacks comes from the bundle's lib/.
[ -x "$nixlbench" ] || { say "compare: $nixlbench is not an executable"; exit 2; }
bundle_lib="$(dirname "$nixlbench")/../lib"
shim="$work/libs"
mkdir -p "$shim"
export LD_LIBRARY_PATH="$shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
while command -v ldd >/dev/null; do
    added=0
    for lib in $(ldd "$nixlbench" 2>/dev/null | awk '$2 == "=>" && $3 == "not" { print $1 }'); do
        if [ -e "$bundle_lib/$lib" ] && [ ! -e "$shim/$lib" ]; then
            ln -s "$(readlink -f "$bundle_lib/$lib")" "$shim/$lib"
            say "compare: $lib is not installed here: using the bundle's copy"
            added=1
        elif [ ! -e "$bundle_lib/$lib" ]; then
            say "compare: nixlbench needs $lib, which neither this machine nor $bundle_lib has"
        fi
    done
    [ "$added" = 1 ] || break
done

common=(--start_block_size "$start_bs" --max_block_size "$max_bs" --num_iter "$num_iter"
        --warmup_iter "$warmup" --large_blk_iter_ftr 16 --check_consistency)
nixl_flags=(--segs "$segs" --op_type "${ops// /,}")
[ "${REQUIRE_GPU:-1}" = 1 ] && nixl_flags+=(--require_gpu)
failed_cases=' '
nixl_failed=''

run_nixl() {
    local r=$1 f="$work/nixl.$1.log" s=$SECONDS
    say "=== round $r: NIXL (nixl_peer_bench.py)"
    timeout -k 5 "${NIXL_TIMEOUT:-150}" "$py" "$here/nixl_peer_bench.py" "${common[@]}" \
        "${nixl_flags[@]}" >"$f" 2>&1
    local rc=$?
    grep -v "NIXL INFO" "$f" >>"$log"
    if [ $rc != 0 ]; then
        say "=== round $r: NIXL exit status $rc$([ $rc = 124 ] && echo ' (timed out)')"
        nixl_failed="$nixl_failed $r"
    fi
    say "=== round $r: NIXL took $((SECONDS - s)) s"
}

run_ours() {
    local r=$1 f="$work/ours.$1.log" s=$SECONDS c backend iseg tseg op rc
    say "=== round $r: ours (nixlbench)"
    : >"$f"
    for c in $ours_cases; do
        IFS=: read -r backend iseg tseg <<<"$c"
        for op in $ops; do
            case "$failed_cases" in *" $c:$op "*) say "--- $c $op: failed in an earlier round, not run"; continue ;; esac
            timeout -k 5 "${CASE_TIMEOUT:-90}" "$nixlbench" --backend "$backend" \
                --initiator_seg_type "$iseg" --target_seg_type "$tseg" --op_type "$op" \
                --total_buffer_size "$max_bs" --no_progress "${common[@]}" >>"$f" 2>&1
            rc=$?
            if [ $rc != 0 ]; then
                echo "nixlbench $c $op: exit status $rc$([ $rc = 124 ] && echo ' (timed out)')" >>"$f"
                failed_cases="$failed_cases$c:$op "
            fi
        done
    done
    cat "$f" >>"$log"
    say "=== round $r: ours took $((SECONDS - s)) s"
}

last=0
for r in $(seq 1 "$rounds"); do
    elapsed=$((SECONDS - t0))
    if [ "$r" -gt 1 ] && [ $((elapsed + last)) -gt "$budget" ]; then
        say "=== round $r not started: ${elapsed} s spent, a round takes ${last} s, budget ${budget} s"
        break
    fi
    s=$SECONDS
    if [ $((r % 2)) = 1 ]; then run_nixl "$r"; run_ours "$r"; else run_ours "$r"; run_nixl "$r"; fi
    last=$((SECONDS - s))
done

say "=== summary (ours/NIXL: median over rounds of the per-round ratio; range over rounds)"
"$py" "$here/summarize.py" --out "$out" "$work"/ours.*.log "$work"/nixl.*.log 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
[ "$failed_cases" = ' ' ] || say "compare: our runs that failed:$failed_cases(their errors are in compare.log)"
[ -z "$nixl_failed" ] || say "compare: NIXL runs that failed: rounds$nixl_failed (errors in compare.log)"
say "compare: done in $((SECONDS - t0)) s; results in $out (compare.log, rows.csv, ratios.csv)"
# Any failed run fails the comparison (after everything that did run is summarized).
[ "$failed_cases" = ' ' ] && [ -z "$nixl_failed" ] || exit 1
exit "$status"
