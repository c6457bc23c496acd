#!/bin/bash
# File -> VRAM on a GPU machine, one run, alternating: hf3fs-gdr's daemon (gdr_read_bench)
# against KvikIO at its best thread count (cached 4 GiB file), the daemon against the
# device's own O_DIRECT bandwidth (cold file), and 4 KiB random-read IOPS beside KvikIO's.
# Usage: BUNDLE=target/gpu-bundle WHEELS=target/peer-wheels bash tools/peer/storage_bench.sh [rounds]
set -u
bundle="${BUNDLE:-target/gpu-bundle}"
wheels="${WHEELS:-target/peer-wheels}"
rounds="${1:-3}"
work="${STORAGE_BENCH_DIR:-/tmp/storage-bench}"
mkdir -p "$work/mnt"
file="$work/file4g"
py=python3
[ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3
kv="$work/kvikio"
if [ ! -d "$kv" ]; then
  "$py" -m pip install -q --no-deps --target "$kv" "$wheels"/*.whl || echo "storage_bench: KvikIO did not install"
fi
n=0
# A fresh mount each call: the bench starts (and stops) its own daemon with the flags given.
gdr() {
  n=$((n + 1))
  mkdir -p "$work/mnt$n"
  "$bundle/bin/gdr_read_bench" --mount "$work/mnt$n" --file "$file" "$@"
}
gdr --create 4G --iters 1 --mode seq >/dev/null 2>&1 || gdr --create 4G --iters 1
for r in $(seq "$rounds"); do
  for cfg in "--chunk-kib 4096" "--chunk-kib 2048" "--chunk-kib 4096 --copy-kib 512" "--chunk-kib 8192"; do
    echo "=== round $r cached: hf3fs-gdr $cfg"
    # shellcheck disable=SC2086
    gdr --iters 5 --h2d $cfg 2>&1
  done
  echo "=== round $r cached: KvikIO"
  PYTHONPATH="$kv" "$py" tools/peer/kvikio_read_bench.py "$file" --threads 8,16 --rounds 2 2>&1
done
echo "=== cold: hf3fs-gdr vs O_DIRECT reference"
gdr --cold --reference odirect --size 2G --iters 6 2>&1
echo "=== random 4 KiB, after the cold pass (part of the file on disk): hf3fs-gdr"
gdr --mode rand --seconds 5 2>&1
echo "=== random 4 KiB, after the cold pass: KvikIO"
PYTHONPATH="$kv" "$py" tools/peer/kvikio_read_bench.py "$file" --threads 16 --rounds 1 --random4k 20000 --depth 64 2>&1
cat "$file" > /dev/null
echo "=== random 4 KiB, cached file: hf3fs-gdr"
gdr --mode rand --seconds 5 2>&1
echo "=== random 4 KiB, cached file: KvikIO"
PYTHONPATH="$kv" "$py" tools/peer/kvikio_read_bench.py "$file" --threads 16 --rounds 1 --random4k 100000 --depth 64 2>&1
