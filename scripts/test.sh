#!/usr/bin/env bash
# The test command: sets up .venv and the package, then runs the C++ core tests
# (ctest, torch-free) and the pytest suite. CUDA tests run when a GPU is present
# and are skipped otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
bash scripts/setup_env.sh
cmake -S . -B build/cpp-tests -G Ninja -DKVPRUNE_BUILD_TESTS=ON -DKVPRUNE_ENABLE_CUDA=OFF > /dev/null
cmake --build build/cpp-tests -j "$(nproc)" > /dev/null
(cd build/cpp-tests && ctest --output-on-failure)
# Run from outside the source tree so the installed package is the one imported.
ROOT=$PWD
(cd /tmp && "$ROOT/.venv/bin/python" -m pytest "$ROOT/tests" -q -rs "$@")
