#!/bin/bash
# Issue 23's cross-GPU figures in one call on a machine with two or more GPUs, from the
# GPU bundle (`cargo xtask gpu-bundle`; no Rust toolchain there):
#   - a plain peer copy GPU0 -> GPU1 (torch `copy_`), the link's reference, per size;
#   - nixlbench CUDA_IPC and GPUNETIO, VRAM GPU0 -> VRAM GPU1, WRITE and READ, batch 1;
#     then GPUNETIO's queue-pair kernel (`copy_engine=gio`) and CUDA_IPC's host-staged
#     path (`peer_access=off`), WRITE;
#   - kvbench (the Rust agent, default backend choice): 1,024 and 8,192 descriptors of
#     32 KiB per request, random block ids, same GPU and GPU0 -> GPU1, data verified.
#
#   bash tools/peer/multi-gpu-bench.sh BUNDLE_DIR [OUT_DIR]
set -uo pipefail
bundle="${1:?usage: multi-gpu-bench.sh BUNDLE_DIR [OUT_DIR]}"
out="${2:-${OUT:-/tmp/multi-gpu-bench}}"
mkdir -p "$out"
log="$out/multi-gpu-bench.log"
: >"$log"
say() { echo "$*" | tee -a "$log"; }
tool() { timeout -k 5 "${RUN_TIMEOUT:-150}" bash "$bundle/run.sh" --tool "$@" 2>&1 | tee -a "$log"; }

say "multi-gpu-bench: $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv,noheader 2>&1 | tee -a "$log"
nvidia-smi topo -m 2>&1 | head -8 | tee -a "$log"

say "=== plain peer copy GPU0 -> GPU1 (torch copy_, median of 20)"
python3 - <<'PY' 2>&1 | tee -a "$log"
import torch, time
for mib in (1, 16, 64, 256):
    n = mib << 20
    a = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    times = []
    for _ in range(20):
        t = time.perf_counter(); b.copy_(a); torch.cuda.synchronize(1); times.append(time.perf_counter() - t)
    times.sort()
    print(f"peer copy {mib:4d} MiB: {n / times[len(times) // 2] / 1e9:8.1f} GB/s")
PY

for backend in CUDA_IPC GPUNETIO; do
  for op in WRITE READ; do
    say "=== nixlbench $backend VRAM GPU0 -> VRAM GPU1 $op, batch 1"
    tool nixlbench --backend "$backend" --initiator_seg_type VRAM --target_seg_type VRAM \
      --initiator_gpu 0 --target_gpu 1 --op_type "$op" --start_block_size 65536 \
      --max_block_size 67108864 --start_batch_size 1 --max_batch_size 1 --num_iter 200 \
      --warmup_iter 20 --large_blk_iter_ftr 4
  done
done

# A/B: GPUNETIO's own queue-pair kernel instead of the copy engines, and CUDA_IPC's
# host-staged path (what a pair without peer access gets), same flags.
for variant in "GPUNETIO copy_engine=gio" "CUDA_IPC peer_access=off"; do
  set -- $variant
  say "=== nixlbench $1 ($2) VRAM GPU0 -> VRAM GPU1 WRITE, batch 1"
  tool nixlbench --backend "$1" --backend_param "$2" --initiator_seg_type VRAM \
    --target_seg_type VRAM --initiator_gpu 0 --target_gpu 1 --op_type WRITE \
    --start_block_size 65536 --max_block_size 67108864 --start_batch_size 1 \
    --max_batch_size 1 --num_iter 200 --warmup_iter 20 --large_blk_iter_ftr 4
done

for gpus in "0 0" "0 1"; do
  set -- $gpus
  for bpr in 16 128; do
    say "=== kvbench READ VRAM: target GPU $1 -> initiator GPU $2, $bpr blocks/request (32 layers x K/V)"
    tool kvbench --initiator-mem vram --target-mem vram --target-gpu "$1" --initiator-gpu "$2" \
      --blocks-per-request "$bpr" --requests 50 --warmup 5
  done
done
say "multi-gpu-bench: done $(date -u +%FT%TZ)"
