#!/usr/bin/env bash
# Run the selected tests N times in a row; stop at the first failure, saying which iteration failed, with its log.
#
#   scripts/soak.sh -k PATTERN [-n 20] [-- or more pytest args, e.g. tests/test_worker.py -m slow]
#
# A test that fails one run in a few is a defect: this is how to show it does not (or catch the failing run).
# Each iteration's pytest output goes to $SOAK_DIR/iter-<i>.log (default: a fresh temporary folder); the logs of
# passing iterations are removed unless SOAK_KEEP=1. Exit status: 0 when all N passed, else pytest's status.
set -u

usage() {
    echo "usage: scripts/soak.sh -k PATTERN [-n N] [pytest args...]   (N: a positive integer, default 20)" >&2
    exit 2
}

pattern=""
n=20
while [ $# -gt 0 ]; do
    case "$1" in
        -k) [ $# -ge 2 ] || usage; pattern="$2"; shift 2 ;;
        -n) [ $# -ge 2 ] || usage; n="$2"; shift 2 ;;
        -h|--help) usage ;;
        --) shift; break ;;
        *) break ;;
    esac
done
[ -n "$pattern" ] || { echo "soak.sh: -k PATTERN is required (which tests to repeat)" >&2; usage; }
case "$n" in
    ''|*[!0-9]*|0) echo "soak.sh: -n must be a positive integer, got '$n'" >&2; usage ;;
esac

root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
dir="${SOAK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/soak.XXXXXX")}"
mkdir -p "$dir"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

echo "soak: -k '$pattern' x $n  ($*)  logs in $dir"
start=$(date +%s)
for i in $(seq 1 "$n"); do
    log="$dir/iter-$i.log"
    t0=$(date +%s)
    (cd "$root" && "$python" -m pytest -q -p no:cacheprovider -k "$pattern" "$@") >"$log" 2>&1
    rc=$?
    summary="$(tail -n 1 "$log")"
    if [ $rc -eq 5 ]; then
        echo "soak: no test matched -k '$pattern' $*" >&2
        cat "$log" >&2
        exit 5
    fi
    if [ $rc -ne 0 ]; then
        echo "soak: iteration $i of $n FAILED (pytest exit $rc) after $(($(date +%s) - t0)) s; its log ($log):"
        cat "$log"
        echo "soak: FAILED at iteration $i of $n ($((i - 1)) passed before it)"
        exit $rc
    fi
    echo "soak: iteration $i/$n passed in $(($(date +%s) - t0)) s: $summary"
    [ "${SOAK_KEEP:-0}" = 1 ] || rm -f "$log"
done
echo "soak: all $n iterations passed in $(($(date +%s) - start)) s"
