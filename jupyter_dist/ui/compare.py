"""Several runs overlaid: loss, throughput and memory, by step or by time; live while any of them runs.

``jupyter_dist.compare(run_a, run_b, ...)`` takes :class:`~jupyter_dist.launch.run.Run` handles, run directories or
rows of a runs table. :class:`CompareModel` (pure: records in, figures out, the figure format of
:mod:`jupyter_dist.ui.figures`) keeps one trace per run in each panel; :class:`Comparison` follows the runs'
telemetry files and displays the panels as inline SVG (:mod:`jupyter_dist.ui.static`), re-drawn every ``interval``
seconds in the notebook while a run is live, and final (kernel-free, it survives export) once all have ended.
"""

from __future__ import annotations

import bisect
import html
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import JupyterDistError
from ..telemetry.measurement import MeasureBuilder, job_rate
from ..telemetry.reader import TelemetryReader
from .figures import PALETTE, Figure
from .panels import decimate_minmax

__all__ = ["CompareModel", "Comparison", "compare", "X_AXES"]

X_AXES = ("step", "time")
"""What the x axis of a comparison can be: the logged step, or seconds since each run's start."""
GIB = float(1 << 30)


@dataclass
class _RunSeries:
    """What one run contributes to the panels."""

    label: str
    color: str
    t0: float | None = None
    loss: dict[int, list[float]] = field(default_factory=dict)
    loss_t: dict[int, float] = field(default_factory=dict)
    rate: dict[int, dict[int, float]] = field(default_factory=dict)
    rate_t: dict[int, float] = field(default_factory=dict)
    unit: str | None = None
    steps_t: list[tuple[float, int]] = field(default_factory=list)
    mem: list[tuple[float, int, float]] = field(default_factory=list)
    measure: MeasureBuilder = field(default_factory=MeasureBuilder)
    """The one measurement of the run (its throughput is the number the summary and the runs table show)."""


class CompareModel:
    """Panel data of several runs (one trace per run per panel), fed with each run's records.

    Parameters
    ----------
    labels
        One label per run (the legend).
    x
        ``"step"`` or ``"time"`` (seconds since the run's first record).
    metric
        The metric of the loss panel.
    max_points
        Cap per trace (min/max decimation beyond it).
    """

    def __init__(self, labels: list[str], *, x: str = "step", metric: str = "loss", max_points: int = 2000) -> None:
        if x not in X_AXES:
            raise JupyterDistError(f"x={x!r} is not valid; valid: {', '.join(X_AXES)}")
        if not labels:
            raise JupyterDistError("compare needs at least one run")
        self.x = x
        self.metric = metric
        self.max_points = max_points
        self.runs = [_RunSeries(label, PALETTE[i % len(PALETTE)]) for i, label in enumerate(labels)]

    def ingest(self, index: int, records: Iterable[dict[str, Any]]) -> None:
        """Take records of run ``index``."""
        s = self.runs[index]
        records = list(records)
        s.measure.add(records)
        for rec in records:
            t = rec.get("t")
            if not isinstance(t, (int, float)):
                continue
            s.t0 = float(t) if s.t0 is None else min(s.t0, float(t))
            kind = rec.get("kind")
            rank = rec.get("rank")
            if kind == "step" and isinstance(rec.get("step"), int) and isinstance(rank, int):
                step = rec["step"]
                bisect.insort(s.steps_t, (float(t), step))
                v = rec.get(self.metric)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    s.loss.setdefault(step, []).append(float(v))
                    s.loss_t[step] = max(s.loss_t.get(step, 0.0), float(t))
                for key, unit in (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"), ("step_time", "")):
                    v = rec.get(key)
                    if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
                        rate = 1.0 / float(v) if key == "step_time" else float(v)
                        unit = unit or "steps/s"
                        if s.unit is None or unit == s.unit:
                            s.unit = unit
                            s.rate.setdefault(step, {})[rank] = rate
                            s.rate_t[step] = max(s.rate_t.get(step, 0.0), float(t))
                        break
            elif kind == "mem" and isinstance(rank, int):
                peak = max(float(rec.get(k) or 0.0) for k in ("peak_active", "peak_allocated", "max_rss", "rss"))
                s.mem.append((float(t), rank, peak))

    def _x(self, s: _RunSeries, step: int, t: float) -> float:
        return float(step) if self.x == "step" else t - (s.t0 or t)

    def _step_at(self, s: _RunSeries, t: float) -> float:
        """The last step logged at or before ``t`` (0 before the first)."""
        i = bisect.bisect_right(s.steps_t, (t, math.inf))
        return float(s.steps_t[i - 1][1]) if i else 0.0

    def _trace(self, s: _RunSeries, xs: list[float], ys: list[float]) -> dict[str, Any]:
        xs, ys = decimate_minmax(xs, ys, self.max_points)
        return {"name": s.label, "x": xs, "y": ys, "color": s.color, "width": 1.8}

    def loss_figure(self) -> Figure:
        """The metric per run: the mean over ranks of each logged step."""
        traces = []
        for s in self.runs:
            steps = sorted(s.loss)
            xs = [self._x(s, k, s.loss_t[k]) for k in steps]
            ys = [sum(s.loss[k]) / len(s.loss[k]) for k in steps]
            order = sorted(range(len(xs)), key=xs.__getitem__)
            traces.append(self._trace(s, [xs[i] for i in order], [ys[i] for i in order]))
        return {"id": "cmp-loss", "kind": "line", "title": self.metric.capitalize() if self.metric == "loss"
                else self.metric, "x_title": self._x_title(), "y_title": self.metric, "traces": traces,
                "note": "no steps logged yet"}  # fmt: skip

    def throughput_figure(self) -> Figure:
        """Throughput per run at each step: each data-parallel replica counted once (steps/s: the mean over ranks)."""
        traces, units = [], set()
        for s in self.runs:
            steps = sorted(s.rate)
            xs = [self._x(s, k, s.rate_t[k]) for k in steps]
            dp, world = s.measure.dp_size, s.measure.world_size
            ys = [(sum(s.rate[k].values()) / len(s.rate[k]) if s.unit == "steps/s"
                   else float(job_rate(s.rate[k], dp_size=dp, world_size=world) or 0.0)) for k in steps]  # fmt: skip
            if s.unit:
                units.add(s.unit)
            traces.append(self._trace(s, xs, ys))
        return {"id": "cmp-throughput", "kind": "line", "title": "Throughput", "x_title": self._x_title(),
                "y_title": " | ".join(sorted(units)) or "rate", "traces": traces,
                "note": "no throughput yet (log tokens= or samples=)"}  # fmt: skip

    def memory_figure(self) -> Figure:
        """Peak memory so far of the run's largest rank, in GiB."""
        traces = []
        for s in self.runs:
            xs: list[float] = []
            ys: list[float] = []
            peak: dict[int, float] = {}
            for t, rank, value in sorted(s.mem):
                peak[rank] = max(peak.get(rank, 0.0), value)
                xs.append(self._step_at(s, t) if self.x == "step" else t - (s.t0 or t))
                ys.append(max(peak.values()) / GIB)
            if xs:  # the peak so far holds until the run's last step (or record): a level line, not a lone dot
                end = float(s.steps_t[-1][1]) if self.x == "step" and s.steps_t else xs[-1]
                if self.x == "time" and s.steps_t:
                    end = s.steps_t[-1][0] - (s.t0 or s.steps_t[-1][0])
                if end > xs[-1]:
                    xs.append(end)
                    ys.append(ys[-1])
            traces.append(self._trace(s, xs, ys))
        return {"id": "cmp-memory", "kind": "line", "title": "Peak memory (largest rank)", "x_title": self._x_title(),
                "y_title": "GiB", "traces": traces, "note": "no memory records yet"}  # fmt: skip

    def figures(self) -> list[Figure]:
        """Loss, throughput and memory."""
        return [self.loss_figure(), self.throughput_figure(), self.memory_figure()]

    def _x_title(self) -> str:
        return "step" if self.x == "step" else "seconds since start"


def mesh_line(run: Any) -> str:
    """The run's mesh line as it is (:attr:`Run.mesh <jupyter_dist.launch.run.Run.mesh>`: DDP replicates)."""
    mesh = getattr(run, "mesh", None)
    return str(mesh) if mesh is not None else str((getattr(run, "notes", None) or [""])[0])


def hparam_labels(runs: list[Any], *, limit: int = 4) -> list[str]:
    """Legend labels: ``name (candidate)`` and the hyperparameters that differ between the runs (all, for one run).

    At most ``limit`` hyperparameters per label, ``lr=0.001, batch=32``.
    """
    hps = [dict(getattr(r, "hparams", None) or {}) for r in runs]
    names = sorted({k for hp in hps for k in hp})
    if len(runs) > 1:
        names = [k for k in names if len({repr(hp.get(k)) for hp in hps}) > 1]
    labels = []
    for run, hp in zip(runs, hps, strict=True):
        base = Comparison._label(run)
        shown = [f"{k}={_short(hp[k])}" for k in names[:limit] if k in hp]
        labels.append(f"{base} {', '.join(shown)}" if shown else base)
    return labels


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _as_run(item: Any) -> Any:
    from ..launch.run import Run, open_run

    if isinstance(item, Run):
        return item
    path = getattr(item, "path", item)  # a RunRow
    if isinstance(path, (str, Path)):
        return open_run(path)
    raise JupyterDistError(f"compare takes Runs, run directories or runs-table rows, not {type(item).__name__}")


class Comparison:
    """Runs overlaid in three panels; displays itself as SVG (and keeps re-drawing while a run is live)."""

    def __init__(self, runs: list[Any], *, x: str = "step", metric: str = "loss", interval: float = 1.0,
                 labels: list[str] | None = None) -> None:  # fmt: skip
        if interval <= 0:
            raise JupyterDistError(f"interval must be > 0 seconds, got {interval}")
        self.runs = [_as_run(r) for r in runs]
        if labels is not None and len(labels) != len(self.runs):
            raise JupyterDistError(f"labels: {len(labels)} given for {len(self.runs)} runs")
        self.labels = labels or hparam_labels(self.runs)
        self.model = CompareModel(self.labels, x=x, metric=metric)
        self.readers = [TelemetryReader(Path(r.dir) / "telemetry", interval=interval, maxlen=16) for r in self.runs]
        self.interval = interval
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._display: Any = None
        self.finished = threading.Event()
        self.update()

    @staticmethod
    def _label(run: Any) -> str:
        what = getattr(run, "candidate", None) or getattr(run, "strategy", None) or ""
        return f"{run.name} ({what})" if what else str(run.name)

    @property
    def live(self) -> bool:
        """Whether any of the runs is still going."""
        return any(not r.done for r in self.runs)

    def update(self) -> int:
        """Read what the runs wrote since the last call; returns the number of new records."""
        with self._lock:
            total = 0
            for i, reader in enumerate(self.readers):
                new = reader.poll()
                self.model.ingest(i, new)
                total += len(new)
            return total

    def figures(self) -> list[Figure]:
        """The three panels (figure format of :mod:`jupyter_dist.ui.figures`)."""
        with self._lock:
            return self.model.figures()

    def header_html(self) -> str:
        """One line per run: label, status and the mesh."""
        rows = []
        for label, run, color in zip(self.labels, self.runs, (s.color for s in self.model.runs), strict=True):
            mesh = mesh_line(run)
            rows.append(f'<div><span style="color:{color}">&#9632;</span> {html.escape(label)}: '
                        f"{html.escape(run.status)}{' - ' + html.escape(mesh) if mesh else ''}</div>")  # fmt: skip
        return f'<div class="jd-compare-header" style="font-size:12px;margin-bottom:4px">{"".join(rows)}</div>'

    def static_html(self) -> str:
        """The panels as HTML with inline SVG (no JavaScript, no kernel needed)."""
        from .static import dashboard_html

        return dashboard_html(self.figures(), header_html=self.header_html()).replace(
            'class="jd-static-dashboard"', 'class="jd-static-dashboard jd-compare"', 1
        )

    def svg(self) -> list[str]:
        """Each panel as one ``<svg>`` string (to save to files)."""
        from .static import figure_svg

        return [figure_svg(f) for f in self.figures()]

    def save(self, path: str | Path) -> Path:
        """Write the static HTML (inline SVG) to ``path``; returns it."""
        from .._atomic import write_atomic

        return write_atomic(Path(path), f"<!doctype html><meta charset='utf-8'>{self.static_html()}")

    def text(self) -> str:
        """One line per run: label, status, steps, last loss."""
        lines = []
        for s, run in zip(self.model.runs, self.runs, strict=True):
            last = max(s.loss, default=None)
            loss = f"{sum(s.loss[last]) / len(s.loss[last]):.4g}" if last is not None else "-"
            rate, unit = s.measure.result().throughput
            speed = "" if rate is None else f", {rate:,.0f} {unit}" if rate >= 100 else f", {rate:.3g} {unit}"
            lines.append(f"{s.label}: {run.status}, {len(s.loss)} steps logged, last {self.model.metric} {loss}{speed}")
        return "\n".join(lines)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self.static_html()}

    # ---- live -----------------------------------------------------------------------------------------------
    def show(self) -> Comparison:
        """Display the panels; while a run is live they are re-drawn every ``interval`` seconds."""
        from IPython.display import HTML, display

        self._display = display(HTML(self.static_html()), display_id=True)
        if self.live:
            self.start()
        else:
            self.finished.set()
        return self

    def start(self) -> Comparison:
        """Follow the runs on a daemon thread until all have ended (then one last update)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jupyter-dist-compare", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            done = not self.live
            try:
                if self.update() and self._display is not None:
                    from IPython.display import HTML

                    self._display.update(HTML(self.static_html()))
            except Exception:  # pragma: no cover - keep following; the next round may succeed
                import logging

                logging.getLogger(__name__).exception("jupyter_dist comparison update failed")
            if done:
                break
            self._stop.wait(self.interval)
        if self._display is not None:
            from IPython.display import HTML

            self._display.update(HTML(self.static_html()))
        self.finished.set()

    def stop(self) -> None:
        """Stop following (the panels stay as they are)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


def compare(*runs: Any, x: str = "step", metric: str = "loss", interval: float = 1.0,
            labels: list[str] | None = None) -> Comparison:  # fmt: skip
    """Overlay loss, throughput and memory of several runs; display the result (live while a run is going).

    ``runs``: :class:`~jupyter_dist.launch.run.Run` handles, run directories, or rows of ``jupyter_dist.runs()``
    (a whole table: ``compare(*table)``). ``x``: ``"step"`` or ``"time"``. Call ``.show()`` to follow live runs.
    """
    if not runs:
        raise JupyterDistError("compare needs at least one run: compare(run_a, run_b, ...)")
    return Comparison(list(runs), x=x, metric=metric, interval=interval, labels=labels)
