"""Write tests/durations.json, the seconds each test file took, from a pytest log run with ``--durations=0``.

The test scheduler (tests/conftest.py) starts the longest files first so the two workers end together; refresh the
table after adding slow tests:

    python -m pytest -n 2 -p no:cacheprovider --durations=0 -q | tee /tmp/suite.log
    python scripts/durations.py /tmp/suite.log

``--simulate`` prints the wall time the scheduler would reach with 1-4 workers from the table, without running.
``--cpu FILE`` prints the CPU seconds per file (and the 15 costliest tests) from a run with ``JD_TEST_CPU=FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(tests/[^:\s]+\.py)(::\S*)?")


def parse(log: str) -> dict[str, float]:
    """Seconds per test file (setup + call + teardown of every test) in a ``--durations=0`` report."""
    out: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            out[Path(m.group(3)).name] += float(m.group(1))
    return dict(out)


def simulate(seconds: dict[str, float], workers: int) -> float:
    """Wall time of longest-first list scheduling of the files (and the SLURM files as one unit) on ``workers``.

    With more than two, the SLURM unit is one worker's only work (tests/scheduling.py). CPU contention is not
    modelled: three workers on two cores slow the CPU-bound files down.
    """
    sys.path.insert(0, str(TABLE.parent))
    from scheduling import estimate, scope_of  # tests/ is not a package

    units = {scope_of(f"tests/{name}") for name in seconds}
    alone = 0.0  # the cluster unit's own worker, with more than two
    if workers > 2 and "cluster" in units:
        units.discard("cluster")
        alone, workers = estimate("cluster", seconds), workers - 1
    ends = [0.0] * workers
    for s in sorted((estimate(u, seconds) for u in units), reverse=True):
        ends[ends.index(min(ends))] += s
    return max(*ends, alone)


def cpu_table(path: str, top: int = 15) -> str:
    """CPU and wall seconds per file, the costliest first, from the lines ``JD_TEST_CPU`` wrote."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    tests = []
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        rec = json.loads(raw)
        f = files[rec["test"].split("::", 1)[0]]
        f[0], f[1], f[2] = f[0] + rec["cpu"], f[1] + rec["wall"], f[2] + 1
        tests.append((rec["cpu"], rec["wall"], rec["test"]))
    cpu, wall = sum(v[0] for v in files.values()), sum(v[1] for v in files.values())
    rows = [f"{cpu:9.0f} CPU-s {wall:7.0f} s  {sum(v[2] for v in files.values())} tests in {len(files)} files"]
    rows += [f"{c:9.1f} CPU-s {w:7.1f} s  {int(n):4d}  {name}" for name, (c, w, n) in
             sorted(files.items(), key=lambda kv: -kv[1][0])]  # fmt: skip
    rows += ["", f"the {top} costliest tests:"] + [f"{c:9.1f} CPU-s {w:7.1f} s  {t}" for c, w, t in
                                                    sorted(tests, reverse=True)[:top]]  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    """Write the table from a log, and/or simulate the schedule from the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", nargs="?", help="a pytest log with --durations=0")
    ap.add_argument("--simulate", action="store_true", help="print the wall time 1-4 workers would reach")
    ap.add_argument("--cpu", metavar="FILE", help="CPU seconds per file from a run with JD_TEST_CPU=FILE")
    a = ap.parse_args()
    if a.cpu:
        print(cpu_table(a.cpu))
    if a.log:
        seconds = parse(Path(a.log).read_text(encoding="utf-8", errors="replace"))
        if not seconds:
            sys.exit(f"no durations in {a.log}: run pytest with --durations=0")
        text = json.dumps({k: round(v, 1) for k, v in sorted(seconds.items())}, indent=1) + "\n"
        fd, tmp = tempfile.mkstemp(dir=TABLE.parent, prefix=".durations.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, TABLE)
        print(f"{TABLE}: {len(seconds)} files, {sum(seconds.values()) / 60:.1f} min of tests")
    if a.simulate:
        seconds = json.loads(TABLE.read_text())
        total = sum(seconds.values())
        for n in (1, 2, 3, 4):
            print(f"{n} worker(s): {simulate(seconds, n) / 60:5.1f} min (work {total / 60:.1f} min)")


if __name__ == "__main__":
    main()
