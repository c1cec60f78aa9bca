#!/usr/bin/env bash
# The vLLM integration test: sets up .venv-vllm (scripts/setup_vllm_env.sh), then runs
# tests/vllm_engine (kvprune_cuda.vllm in vLLM 0.32.0's CPU engine on a tiny random Qwen2).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup_vllm_env.sh
VENV=${KVPRUNE_VLLM_VENV:-.venv-vllm}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
ROOT=$PWD
(cd /tmp && "$VENV/bin/python" -m pytest "$ROOT/tests/vllm_engine" -q -rs -p no:cacheprovider "$@")
echo "vLLM integration test finished in $((SECONDS - start)) s"
