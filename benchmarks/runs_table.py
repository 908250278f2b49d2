"""How long ``jupyter_dist.runs()`` takes over many recorded runs (target: 200 runs in under a second).

Run: python benchmarks/runs_table.py [--runs 200] [--steps 2000] [--ranks 2] [--folder DIR]

Writes ``--runs`` run directories as finished local runs leave them (``run.json``, ``telemetry/rank-<k>.jsonl`` with
one ``step`` record per step and rank plus ``mem``/``hb`` records, ``summary.json``), then times:

1. ``runs(folder)`` with every run's ``summary.json`` present (the normal case: a run writes it when it ends);
2. the same table once more (warm page cache);
3. ``runs(folder)`` after deleting every ``summary.json`` (runs recorded before summaries existed: each is read
   from its telemetry once and its summary saved), then again (summaries back);
4. with a tenth of the runs still running (no summary yet): the first table, then the next ones (only the lines
   written since the previous table are read);
5. sort + filter + the HTML table of the 200 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_dist.launch.runs import runs  # noqa: E402
from jupyter_dist.telemetry.records import encode, make_record  # noqa: E402
from jupyter_dist.telemetry.summary import write_summary  # noqa: E402


def make_run(root: Path, i: int, steps: int, ranks: int) -> None:
    strategy = ("ddp", "fsdp2", "zero2", "fsdp2+tp2")[i % 4]
    d = root / f"run{i:04d}-20261125-{i:06d}"
    (d / "telemetry").mkdir(parents=True)
    t0 = 1.79e9 + i * 1000.0
    meta = {"name": f"run{i}", "status": "succeeded" if i % 7 else "failed", "strategy": strategy.split("+")[0],
            "candidate": strategy, "world_size": ranks, "notes": [f"{ranks} ranks: dp {ranks}"], "started": t0,
            "ended": t0 + steps * 0.1, "launcher": {"kind": "local"}, "env": {"JD_STRATEGY": strategy}}  # fmt: skip
    (d / "run.json").write_text(json.dumps(meta, indent=2))
    for r in range(ranks):
        seq, lines = 0, [encode(make_record("start", rank=r, seq=0, t=t0, world_size=ranks))]
        for s in range(steps):
            seq += 1
            t = t0 + s * 0.1
            lines.append(encode(make_record("step", rank=r, seq=seq, t=t, step=s, n=1, loss=3.0 / (1 + s) + 0.01 * i,
                                            step_time=0.1, tokens_per_s=40960.0)))  # fmt: skip
            if s % 20 == 0:
                seq += 1
                lines.append(encode(make_record("mem", rank=r, seq=seq, t=t, rss=3e8, max_rss=3e8 + s * 1e4)))
                seq += 1
                lines.append(encode(make_record("hb", rank=r, seq=seq, t=t, step=s, phase="forward", phase_s=0.01)))
        (d / "telemetry" / f"rank-{r}.jsonl").write_text("\n".join(lines) + "\n")
    write_summary(d)


def timed(label: str, fn, reps: int = 1):  # type: ignore[no-untyped-def]
    best, out = float("inf"), None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    print(f"{label:<58} {best * 1e3:8.1f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--folder", help="where to write the runs (default: a temporary folder, removed after)")
    args = ap.parse_args()
    root = Path(args.folder or tempfile.mkdtemp(prefix="jd-runs-bench-"))
    try:
        t = time.perf_counter()
        for i in range(args.runs):
            make_run(root, i, args.steps, args.ranks)
        size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        print(f"wrote {args.runs} runs x {args.ranks} ranks x {args.steps} steps ({size / 2**20:.0f} MiB) "
              f"in {time.perf_counter() - t:.1f} s")  # fmt: skip
        table = timed(f"runs() over {args.runs} runs, summaries present", lambda: runs(root))
        assert len(table) == args.runs
        timed("runs() again (warm cache, best of 3)", lambda: runs(root), reps=3)
        for p in root.glob("*/summary.json"):
            os.remove(p)
        timed("runs() without summaries (reads telemetry, saves them)", lambda: runs(root))
        timed("runs() after that (summaries back, best of 3)", lambda: runs(root), reps=3)
        live = sorted(root.iterdir())[: args.runs // 10]  # a tenth of them still running: followed incrementally
        for d in live:
            meta = json.loads((d / "run.json").read_text())
            (d / "run.json").write_text(json.dumps({**meta, "status": "running", "ended": None}))
            os.remove(d / "summary.json")
        timed(f"runs() with {len(live)} running (first: reads their telemetry)", lambda: runs(root))
        timed(f"runs() with {len(live)} running (then: only new lines, best of 3)", lambda: runs(root), reps=3)
        timed("sort(best_loss) + filter(strategy=fsdp2) + html()",
              lambda: table.sort("best_loss").filter(strategy="fsdp2").html(), reps=3)  # fmt: skip
        timed("html() of every row", table.html, reps=3)
    finally:
        if not args.folder:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
