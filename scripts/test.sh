#!/usr/bin/env bash
# The test command: sets up the virtual environment (KVPRUNE_VENV, default .venv) and
# the package, then runs
#   1. the C++ tests (ctest, torch-free): the core, the CUDA kernels under the SIMT
#      emulator, the emulated mma against the PTX ISA, and the emulator's mutants;
#   2. the same C++ tests under AddressSanitizer and UBSan (exact-size buffers: any
#      out-of-bounds access of an emulated CUDA kernel aborts);
#   3. pytest: every op on "cpu", on "cuda_emu" (the CUDA kernels emulated on the CPU,
#      under two thread schedules compared bitwise) and, where a GPU is present, "cuda".
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
bash scripts/setup_env.sh
PYTHON="$(realpath "${KVPRUNE_VENV:-.venv}")/bin/python"

if [ "${KVPRUNE_SKIP_CPP_TESTS:-0}" != 1 ]; then  # (set by check_readme_commands.sh in CI)
cmake -S . -B build/cpp-tests -G Ninja -DKVPRUNE_BUILD_TESTS=ON -DKVPRUNE_ENABLE_CUDA=OFF > /dev/null
cmake --build build/cpp-tests -j "$(nproc)" > /dev/null
(cd build/cpp-tests && ctest --output-on-failure)

SANITIZE="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B build/cpp-asan -G Ninja -DKVPRUNE_BUILD_TESTS=ON -DKVPRUNE_ENABLE_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="$SANITIZE" > /dev/null
cmake --build build/cpp-asan -j "$(nproc)" > /dev/null
(cd build/cpp-asan && ctest --output-on-failure -E emu_mutants)  # the mutants ran in step 1
fi

# Run from outside the source tree so the installed package is the one imported.
ROOT=$PWD
(cd /tmp && "$PYTHON" -m pytest "$ROOT/tests" -q -rs "$@")
