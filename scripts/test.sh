#!/usr/bin/env bash
# Install jupyter-dist with its test tools into ./.venv and run the whole test suite.
# This is the README's test command, and exactly what .ci/run runs on a fresh clone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_CONSTRAINT="$PWD/constraints-cpu.txt" PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, the CPU build (any other torch spec would pull gigabytes of CUDA packages on this kind of machine)
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
python -c "import torch" 2>/dev/null || quiet pip install -q "torch==2.13.0"
# then the rest through uv (the test extra has it; tests/test_extras_alone.py resolves with it too): the same versions
# as pip's resolver, venv + torch + the rest in ~100 s on 2 cores where pip took ~250 s; pip where uv cannot be
# installed. --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE=1 (this image), a package without .pyc
# files is compiled again by every process that imports it (`import deepspeed` 5 -> 10 CPU-s, `import sky` 6 -> 12)
if quiet pip install -q "uv>=0.4" && uv --version >/dev/null 2>&1; then
  uv pip install -q --compile-bytecode --python "$(command -v python)" --constraints constraints-cpu.txt -e ".[test]"
else
  quiet pip install -q -e ".[test]"
fi
# the suite's own modules (jupyter_dist, tests/) get .pyc files like a user's do: with PYTHONDONTWRITEBYTECODE=1 every
# worker recompiled the test files (collection 23 -> 12 CPU-s each) and every rank the package modules it imports
unset PYTHONDONTWRITEBYTECODE
# --fast: the tier to run before every commit (no torchrun job, kernel, browser or scheduler; docs/development.md)
if [ "${1:-}" = "--fast" ]; then shift; set -- -m "not slow" "$@"; fi
# two xdist workers, one file each at a time (tests/scheduling.py); JD_TEST_WORKERS=0 runs in this process. Three
# (the third running the SLURM/SkyPilot files alone) measured slower on 2 cores: 51 min against 44, 18 % more CPU
python -m pytest -n "${JD_TEST_WORKERS:-2}" "$@"
