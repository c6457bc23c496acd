#!/bin/bash
# NIXL's own Python tests and examples (ai-dynamo/nixl test/python and examples/python),
# run against NIXL's wheel and against rdma_nixl side by side, with only the import
# lines changed; prints one table. See nixl_python_tests.py for what runs.
#
#   bash tools/peer/nixl-python-tests.sh                       # clone NIXL at the default commit
#   bash tools/peer/nixl-python-tests.sh --commit <sha>
#   bash tools/peer/nixl-python-tests.sh --nixl-src ~/src/nixl  # a local checkout, as it is
#   bash tools/peer/nixl-python-tests.sh --python /path/venv/bin/python   # both packages there
#   bash tools/peer/nixl-python-tests.sh --nixl-python A --ours-python B  # one per side
#
# The interpreter(s) need pytest, numpy and torch (NIXL's tests import torch). NIXL's
# wheel: `pip install nixl-cu12==1.5.1` (runs on CPU with UCX for DRAM), or
# tools/peer/fetch-nixl-wheel.sh for a machine without PyPI. rdma_nixl: `pip install
# ./python`, or `maturin build` and install the wheel.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-python3}"
exec "$py" "$here/nixl_python_tests.py" "$@"
