#!/bin/bash
# Two nixlbench builds (or one build with two settings) side by side on one machine:
# rounds alternate A and B (the order swapping every round), and per block size the
# median bandwidth and latency of each and the median of the per-round ratios B/A are
# printed. For noisy machines.
#
#   bash tools/peer/nixlbench_ab.sh A_NIXLBENCH B_NIXLBENCH [ROUNDS] [-- NIXLBENCH ARGS...]
#   A_ARGS="--backend_param num_rails=1" bash tools/peer/nixlbench_ab.sh NB NB 5 -- ...
#
# Default nixlbench arguments: --start_block_size 4096 --max_block_size 67108864
# --num_iter 1000 --warmup_iter 100 (plus --no_progress). Arguments after `--` replace
# them, e.g. `-- --backend_param provider=tcp;ofi_rxm --max_block_size 65536`.
# Environment: OUT (folder for the raw tables, default a temporary one), A_ARGS and
# B_ARGS (more arguments for one side only, split on spaces).
set -uo pipefail
[ $# -ge 2 ] || { sed -n '2,15p' "$0"; exit 2; }
a="$(readlink -f "$1")"
b="$(readlink -f "$2")"
shift 2
rounds=5
if [ $# -gt 0 ] && [ "$1" != "--" ]; then rounds="$1"; shift; fi
[ "${1:-}" = "--" ] && shift
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--start_block_size 4096 --max_block_size 67108864 --num_iter 1000 --warmup_iter 100)
out="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/nixlbench-ab.XXXXXX")}"
mkdir -p "$out"
read -r -a a_args <<<"${A_ARGS:-}"
read -r -a b_args <<<"${B_ARGS:-}"
echo "A: $a ${A_ARGS:-}"
echo "B: $b ${B_ARGS:-}"
echo "args: ${args[*]}  rounds: $rounds  tables: $out"
for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then order="a b"; else order="b a"; fi
    for side in $order; do
        bin="$a"; extra=("${a_args[@]}")
        [ "$side" = b ] && { bin="$b"; extra=("${b_args[@]}"); }
        "$bin" --no_progress "${args[@]}" "${extra[@]}" >"$out/$side.$r.txt" 2>&1 || {
            echo "round $r $side failed:"; tail -5 "$out/$side.$r.txt"; exit 1; }
    done
done
python3 - "$out" "$rounds" <<'EOF'
import statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rows(path):
    got = {}
    for line in open(path):
        f = line.split()
        if len(f) >= 4 and f[0].isdigit() and f[1].isdigit():
            got[int(f[0])] = (float(f[2]), float(f[3]))
    return got
runs = {s: [rows(f"{out}/{s}.{r}.txt") for r in range(1, rounds + 1)] for s in "ab"}
sizes = sorted(set().union(*[set(t) for t in runs["a"]]))
print(f"{'block':>10} {'A GB/s':>9} {'B GB/s':>9} {'B/A bw':>7} {'(min-max)':>13} {'A us':>9} {'B us':>9}")
for size in sizes:
    pairs = [(ra[size], rb[size]) for ra, rb in zip(runs["a"], runs["b"]) if size in ra and size in rb]
    if not pairs:
        continue
    ratios = [b[0] / a[0] for a, b in pairs if a[0] > 0]
    med = lambda xs: statistics.median(xs)
    label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    print(f"{label:>10} {med([a[0] for a, _ in pairs]):9.3f} {med([b[0] for _, b in pairs]):9.3f} "
          f"{med(ratios):7.2f} {f'({min(ratios):.2f}-{max(ratios):.2f})':>13} "
          f"{med([a[1] for a, _ in pairs]):9.1f} {med([b[1] for _, b in pairs]):9.1f}")
EOF
