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
quiet pip install -q -e ".[test]"
# --fast: the tier to run before every commit (no torchrun job, kernel, browser or scheduler; docs/development.md)
if [ "${1:-}" = "--fast" ]; then shift; set -- -m "not slow" "$@"; fi
# two workers (xdist), one file each at a time: the multi-process tests leave a core idle while they wait on
# processes; JD_TEST_WORKERS=0 runs in this process
python -m pytest -n "${JD_TEST_WORKERS:-2}" "$@"
