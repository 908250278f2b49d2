"""The demo job: a small transformer LM trained on 2 CPU processes (gloo) through ``%%dist_train``'s launch path.

Progress is printed as the ranks' telemetry arrives. ``jupyter-dist demo`` runs it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .launch.examples import DEMO_CELL

__all__ = ["DEMO_CELL", "run_demo"]


def run_demo(*, nproc: int = 2, strategy: str = "ddp", steps: int = 300, runs_dir: str = "runs",
             out: TextIO = sys.stdout, timeout: float = 600.0) -> Any:  # fmt: skip
    """Train the demo model on ``nproc`` fresh processes; print live progress; write the panels; return the Run.

    The terminal shows what the notebook's dashboard shows (the same panel model): loss per record of rank 0 and
    the smoothed mean over ranks, throughput, memory and heartbeat state per rank. At the end the panels are
    written to ``<run dir>/dashboard.html`` (static SVG, opens in any browser without a kernel).
    """
    from .launch.session import start_run
    from .ui.dashboard import Dashboard

    run: Any = start_run(DEMO_CELL.format(steps=steps), nproc=nproc, strategy=strategy, name="demo",
                         runs_dir=runs_dir, timeout=timeout)  # fmt: skip
    print(f"started {nproc} processes ({strategy}); run directory {run.dir}", file=out)
    dash = Dashboard(run, widget=False, interval=0.5)
    t0 = time.time()
    shown = -1  # the last seq of rank 0 printed
    while True:
        done = run.done
        dash.update()
        fresh = sorted((r for r in dash.reader.buffers["step"] if r["rank"] == 0 and r["seq"] > shown),
                       key=lambda r: r["seq"])  # fmt: skip
        for rec in fresh:
            print(_progress_line(dash, rec, time.time() - t0), file=out, flush=True)
            shown = rec["seq"]
        if done:
            break
        time.sleep(0.5)
    page = Path(run.dir) / "dashboard.html"
    page.write_text(_html_page(f"jupyter-dist demo: {run.name}", dash.static_html()), encoding="utf-8")
    print(run.summary(), file=out)
    print(f"panels: {page}", file=out)
    return run


def _progress_line(dash: Any, rec: dict[str, Any], elapsed: float) -> str:
    model = dash.model
    parts = [f"  step {rec['step']:5d}  loss {rec.get('loss', float('nan')):.3f}"]
    mean = model.lines["loss"].by_key.get("mean")
    if mean is not None and model.lines["loss"].series[mean].ys:
        parts.append(f"(mean over ranks {model.lines['loss'].series[mean].ys[-1]:.3f})")
    thr = model.lines["throughput"].series
    if thr and thr[0].ys and thr[0].ys[-1] is not None:
        parts.append(f"{thr[0].ys[-1]:,.0f} {model.rate_unit}")
    mem = model.memory_figure()["series"][0]["values"]
    if any(v is not None for v in mem):
        parts.append("RSS " + "/".join("?" if v is None else f"{v:.2f}" for v in mem) + " GiB")
    hb = model.heartbeat_figure()["labels"]
    if hb and any(hb):
        parts.append("hb " + ", ".join(label.split(" · ")[-1] if label else "?" for label in hb))
    return "  ".join(parts) + f"  ({elapsed:5.1f} s)"


def _html_page(title: str, body: str) -> str:
    import html

    head = f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
    return f"{head}<body style='font-family:sans-serif;margin:16px'><h3>{html.escape(title)}</h3>{body}</body></html>"
