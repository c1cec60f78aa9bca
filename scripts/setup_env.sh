#!/usr/bin/env bash
# Creates (once) the virtual environment .venv with PyTorch and the test tools,
# then builds and installs kvprune_cuda into it. Safe to re-run: the build
# directory under build/ is reused, so only changed files recompile.
#   KVPRUNE_VENV    virtual environment, absolute or relative to the repository
#                   root (default .venv)
#   KVPRUNE_TORCH   torch requirement (default torch==2.14.1, a CUDA 13.0 build;
#                   torch==2.13.0 is a CPU build)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${KVPRUNE_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
"$PY" -m pip install -q --upgrade pip setuptools wheel
"$PY" -c "import torch" 2>/dev/null || \
  "$PY" -m pip install -q "${KVPRUNE_TORCH:-torch==2.14.1}"
# transformers: tests/test_hf.py runs kvprune_cuda.hf on a tiny random model (no download).
"$PY" -m pip install -q numpy pytest expecttest "transformers==5.2.0"
mkdir -p build
# setuptools copies build/lib.* into the wheel as it is: a module moved or deleted since the
# last build would be installed again, so the package is staged afresh (the compiled
# objects stay in the per-interpreter CMake folder).
rm -rf build/lib.* build/bdist.*
"$PY" -m pip install --no-build-isolation --no-deps -v . > build/pip-install.log 2>&1 || {
  tail -n 60 build/pip-install.log; echo "kvprune_cuda: build failed (full log: build/pip-install.log)"; exit 1; }
(cd /tmp && "$PY" -c "import kvprune_cuda as kp; print('kvprune_cuda', kp.build_info())")
