#!/usr/bin/env bash
# The main benchmark: sets up the virtual environment and the package, then runs the
# prefill benchmark on the best device present (CUDA if a GPU is visible, else CPU).
# Arguments go to bench/bench_prefill.py (e.g. --n 8192 32k --json out.json).
#   KVPRUNE_VENV   virtual environment, absolute or relative to the repository root
#                  (default .venv; the one scripts/setup_env.sh creates)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${KVPRUNE_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
bash scripts/setup_env.sh
# A script run by path puts its own folder (bench/), not the repository, on sys.path, so the
# installed package is the one imported; relative paths in the arguments (--json) are from here.
"$VENV/bin/python" bench/bench_prefill.py --device auto "$@"
