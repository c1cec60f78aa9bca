#!/usr/bin/env bash
# The main benchmark: sets up .venv and the package, then runs the prefill
# benchmark on the best device present (CUDA if a GPU is visible, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
bash scripts/setup_env.sh
ROOT=$PWD
(cd /tmp && "$ROOT/.venv/bin/python" "$ROOT/bench/bench_prefill.py" --device auto "$@")
