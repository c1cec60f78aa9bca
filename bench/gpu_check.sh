#!/usr/bin/env bash
# The one GPU check (lent H200): environment, build + install, all tests, compute-sanitizer,
# benchmarks, then a summary table (printed last).
#
#   OUT=/path/to/outdir bash bench/gpu_check.sh        # from the repo root
#
# Each step appends to a log under $OUT and runs under `timeout`; a failing step is recorded
# and the next one runs anyway. Timeouts are capped so the whole script ends within
# GPU_CHECK_BUDGET_S seconds (default 465, under 8 minutes), keeping time for later steps.
# Files left in $OUT (8): setup.log tests.log sanitize.log bench.log prefill.json prefill.png
# paged.json summary.txt
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"  # Python runs from here, so `import kvprune_cuda` is the installed package
SANITIZER="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
export REPO OUT PY WORK SANITIZER PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=$(( START + ${GPU_CHECK_BUDGET_S:-465} ))
NAMES=(); STATES=(); SECONDS_TAKEN=()

# step NAME LOG MAX_S RESERVE_S FUNCTION
# Runs FUNCTION (a bash function below) with a timeout of min(MAX_S, time left - RESERVE_S),
# output appended to $OUT/LOG.
step() {
  local name=$1 log=$2 max=$3 reserve=$4 fn=$5
  local left limit t0 rc state
  left=$(( DEADLINE - $(date +%s) - reserve ))
  limit=$(( max < left ? max : left ))
  if (( limit < 10 )); then
    NAMES+=("$name"); STATES+=("SKIPPED (no time left)"); SECONDS_TAKEN+=(0)
    echo "=== [$name] skipped: no time left" >> "$OUT/$log"
    return
  fi
  echo "=== [$name] $(date -u +%T) timeout ${limit}s" >> "$OUT/$log"
  echo ">>> $name (timeout ${limit}s, log $log)"
  t0=$(date +%s)
  (cd "$WORK" && timeout --kill-after=10 "$limit" bash -c "set -o pipefail; $fn") >> "$OUT/$log" 2>&1
  rc=$?
  case $rc in
    0) state=ok ;;
    124|137) state="TIMEOUT (${limit}s)" ;;
    *) state="FAIL (rc $rc)" ;;
  esac
  echo "=== [$name] $state after $(( $(date +%s) - t0 ))s" >> "$OUT/$log"
  NAMES+=("$name"); STATES+=("$state"); SECONDS_TAKEN+=($(( $(date +%s) - t0 )))
}

env_info() {
  nvidia-smi
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv
  "$PY" -c 'import sys, torch; print("python", sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name())'
  command -v nvcc && nvcc --version | tail -2
  echo "compute-sanitizer: $SANITIZER"; nproc
}

build_install() {
  cd "$REPO" && MAX_JOBS=16 KVPRUNE_CUDA_ARCHS=90a "$PY" -m pip install --no-build-isolation --no-deps -v . || return 1
  cd "$WORK" && "$PY" -c '
import kvprune_cuda as kp
info = kp.build_info()
print(kp.__file__)
print(info)
assert info["cuda"], "installed kvprune_cuda has no CUDA kernels"' || return 1
  # A C++ runtime linked into _C beside torch's crashes at the first error message
  # (cmake/torch.cmake says why): fail here, not in the tests.
  local so
  so=$("$PY" -c 'import kvprune_cuda._C as c; print(c.__file__)') || return 1
  if command -v nm > /dev/null && nm -C --defined-only "$so" | grep -q ' std::locale::classic()'; then
    echo "$so defines libstdc++'s own std::locale: a second C++ runtime"; return 1
  fi
}

run_tests() {
  # Not -x: every failure is worth seeing. The emulated CUDA tests (cuda_emu,
  # tests/test_emulator.py) run in CI on CPUs; device time is for the GPU, so the tests
  # that run CUDA kernels go first and the CPU-only rest after them.
  # 8 workers of 2 threads where pytest-xdist is installed (the H200 image has it): a
  # crash then costs one worker, not the rest of the run.
  local workers=() rc=0
  "$PY" -c "import xdist" 2>/dev/null && workers=(-n 8)
  for part in "cuda and not cuda_emu" "not cuda"; do
    echo "--- tests: -k '$part'"
    OMP_NUM_THREADS=2 "$PY" -m pytest "$REPO/tests" -q -rs --maxfail=30 -p no:cacheprovider \
      --durations=10 "${workers[@]}" -k "$part" --ignore="$REPO/tests/test_emulator.py" || rc=1
  done
  return $rc
}

memcheck() {
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck --error-exitcode 3 \
    --print-limit 20 "$PY" "$REPO/bench/sanitize_case.py"
}

racecheck() {
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool racecheck --error-exitcode 3 \
    --print-limit 20 "$PY" "$REPO/bench/sanitize_case.py"
}

bench_prefill() {
  "$PY" "$REPO/bench/bench_prefill.py" --device cuda --json "$OUT/prefill.json"
}

bench_select() {
  "$PY" "$REPO/bench/bench_select.py"
}

bench_decode() {
  "$PY" "$REPO/bench/bench_decode.py" --device cuda --repeats 20
}

bench_paged() {
  "$PY" "$REPO/bench/bench_paged.py" --device cuda --reps 20 --n 4096 32768 --json "$OUT/paged.json"
}

plot_prefill() {
  "$PY" "$REPO/bench/plot_prefill.py" "$OUT/prefill.json" -o "$OUT/prefill.png"
}

export -f env_info build_install run_tests memcheck racecheck bench_prefill bench_select bench_decode bench_paged plot_prefill

#    name           log           max  reserve(for the steps after)
step env            setup.log      60  420 env_info
step build          setup.log     300  200 build_install
step tests          tests.log     360   90 run_tests
step memcheck       sanitize.log   90   75 memcheck
step racecheck      sanitize.log   90   60 racecheck
step bench_prefill  bench.log     180   30 bench_prefill
step bench_select   bench.log      60   40 bench_select
step bench_decode   bench.log      40   10 bench_decode
step bench_paged    bench.log      40   10 bench_paged
step plot           bench.log      30    0 plot_prefill

{
  echo
  echo "---- tests ----"; grep -E "^(--- tests|FAILED|ERROR)|[0-9]+ (passed|failed)|TIMEOUT" "$OUT/tests.log" | tail -n 40
  echo "---- sanitizers ----"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases ok|FAIL " "$OUT/sanitize.log"
  echo "---- bench (rows) ----"
  grep -vE "^(===|>>>)" "$OUT/bench.log" | grep -E "^(N=|method| *[0-9]+ |kvpress|torch|kvprune|kp\.|bench_|kvprune_cuda|\| (window_scores|snapkv|compact) )" | tail -n 110
  echo
  echo "---- gpu_check summary ($(( $(date +%s) - START ))s total) ----"
  printf "%-15s %-24s %6s\n" step status seconds
  for i in "${!NAMES[@]}"; do
    printf "%-15s %-24s %6s\n" "${NAMES[$i]}" "${STATES[$i]}" "${SECONDS_TAKEN[$i]}"
  done
} | tee "$OUT/summary.txt"
rm -rf "$WORK"
for s in "${STATES[@]}"; do [[ $s == ok ]] || exit 1; done
exit 0
