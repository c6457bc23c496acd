#!/bin/bash
# GPUNETIO against its references, one run, alternating, on a GPU machine:
#   1. stream-pool VRAM->VRAM on one node (intra-node path) vs CUDA_IPC, 1-64 MiB;
#   2. the NIC path (CPU proxy) VRAM->peer DRAM vs LIBFABRIC VRAM->DRAM (staged), over
#      shm and tcp;ofi_rxm, 64 KiB-16 MiB.
# Usage: NIXLBENCH=path/to/nixlbench bash tools/peer/gpunetio_bench.sh [rounds] [intra|nic|both]
set -u
nb="${NIXLBENCH:-target/release/nixlbench}"
rounds="${1:-3}"
parts="${2:-both}"
common=(--start_batch_size 1 --max_batch_size 1 --no_progress)
for round in $(seq "$rounds"); do
  [ "$parts" = nic ] || for be in CUDA_IPC GPUNETIO GPUNETIO-depth8; do
    echo "=== round $round intra-node $be VRAM->VRAM"
    extra=()
    [ "$be" = GPUNETIO-depth8 ] && extra=(--backend_param copy_depth=8)
    "$nb" --backend "${be%-depth8}" "${extra[@]}" --initiator_seg_type VRAM --target_seg_type VRAM \
      --start_block_size 1048576 --max_block_size 67108864 --total_buffer_size 268435456 \
      --num_iter 300 --warmup_iter 30 "${common[@]}"
  done
  [ "$parts" = intra ] || for prov in shm 'tcp;ofi_rxm'; do
    for be in LIBFABRIC GPUNETIO; do
      echo "=== round $round NIC path $be VRAM->DRAM provider $prov"
      "$nb" --backend "$be" --initiator_seg_type VRAM --target_seg_type DRAM \
        --backend_param "provider=$prov" \
        --start_block_size 65536 --max_block_size 16777216 --total_buffer_size 67108864 \
        --num_iter 200 --warmup_iter 20 "${common[@]}"
    done
  done
done
