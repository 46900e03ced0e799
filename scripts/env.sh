# Sourced by scripts/test and scripts/demo: make .venv with torch and autopar installed.
# A python that already has torch >= 2.11 (a GPU machine's) is reused through
# --system-site-packages; otherwise torch is pinned to 2.13.0 so a CPU machine never pulls an
# unpinned multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
HAS_TORCH='import torch, sys; v = tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])); sys.exit(v < (2, 11))'
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "$HAS_TORCH" 2>/dev/null; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
# A python that is itself a venv's sees its torch, but the venv made from it sees only the
# base interpreter's packages: check the new venv, so that `-e .` never resolves torch itself.
if ! .venv/bin/python -c "$HAS_TORCH" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
export PATH="$PWD/.venv/bin:$PATH"
