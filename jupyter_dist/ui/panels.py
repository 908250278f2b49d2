"""What the dashboard shows, computed from telemetry records: pure Python, no widget or plotly import.

:class:`DashboardModel` ingests records (in any order across ranks), keeps every panel's data in bounded memory
(line traces are min/max-decimated to at most ``max_points``), and hands out *updates*: the new points of each
line trace since the last call (sent to the browser as binary ``extendTraces`` batches), and which figures
changed as a whole (re-sent as state: bar panels, a decimated or new trace). The live widget, the static export
and the tests all read the same model; time comes from an injectable clock.

One piece: :class:`DashboardModel` is the single model that the live widget, the static export and the tests
read, and the helpers here (``Series``, ``decimate_minmax``, the rate and unit helpers) exist only for it; splitting
would spread one model over several files. A new panel is one more figure in this model (docs/architecture.md).
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..telemetry.health import HB_COLORS, HealthTracker, hb_state
from ..telemetry.measurement import MeasureBuilder, job_rate
from .figures import Figure, rank_color

__all__ = ["Series", "Extend", "DashboardModel", "decimate_minmax", "LINE_FIGURES", "SMALL_FIGURES"]

GIB = float(1 << 30)
LINE_FIGURES = ("loss", "throughput", "comm")
SMALL_FIGURES = ("memory", "heartbeat", "comm_heatmap")
_DERIVED = frozenset({"n", "step_time", "tokens_per_s", "samples_per_s", "tokens", "samples"})


def decimate_minmax(xs: list[float], ys: list[float], target: int) -> tuple[list[float], list[float]]:
    """Keep the first, last, and per bucket the minimum and maximum point (in x order): about ``target`` points.

    Unlike plain striding this keeps every spike (a loss spike or a stall stays visible after decimation).
    """
    n = len(xs)
    if n <= target or target < 4:
        return list(xs), list(ys)
    buckets = max(1, (target - 2) // 2)
    inner = n - 2
    out_x, out_y = [xs[0]], [ys[0]]
    for b in range(buckets):
        lo = 1 + b * inner // buckets
        hi = 1 + (b + 1) * inner // buckets
        if lo >= hi:
            continue
        idx_min = idx_max = lo
        for i in range(lo, hi):
            y = ys[i]
            if y is None or (isinstance(y, float) and math.isnan(y)):
                continue
            ymin, ymax = ys[idx_min], ys[idx_max]
            if ymin is None or (isinstance(ymin, float) and math.isnan(ymin)) or y < ymin:
                idx_min = i
            if ymax is None or (isinstance(ymax, float) and math.isnan(ymax)) or y > ymax:
                idx_max = i
        for i in sorted({idx_min, idx_max}):
            out_x.append(xs[i])
            out_y.append(ys[i])
    out_x.append(xs[-1])
    out_y.append(ys[-1])
    return out_x, out_y


@dataclass
class Series:
    """One line trace: its points, how many of them the browser has, and whether it must be re-sent whole."""

    name: str
    color: str
    width: float = 1.5
    dash: str = "solid"
    opacity: float = 1.0
    xs: list[float] = field(default_factory=list)
    ys: list[float | None] = field(default_factory=list)
    sent: int = 0
    replaced: bool = False
    total: int = 0
    """Points ever appended (before decimation)."""
    bucket: float = 0.0
    """Once decimated: the x width whose min and max point new points are folded into (doubles each time)."""
    _open: list[tuple[float, float | None]] = field(default_factory=list, repr=False)
    _open_start: float = 0.0

    def append(self, x: float, y: float | None, cap: int) -> None:
        """Add a point; past ``cap`` points the series is decimated to half and marked for a whole re-send.

        After a decimation, new points are folded at the same resolution (min and max per ``bucket`` of x) before
        they are kept, so a fast stream extends the trace instead of forcing a whole re-send on every update; the
        newest open bucket shows once it closes (a lag of one bucket width).
        """
        x = float(x)
        value = None if y is None or not math.isfinite(y) else float(y)
        self.total += 1
        if self.bucket > 0:
            if self._open and x >= self._open_start + self.bucket:
                self._close_bucket()
            if not self._open:
                self._open_start = x
            self._open.append((x, value))
        else:
            self.xs.append(x)
            self.ys.append(value)
        if len(self.xs) > cap:
            self.xs, self.ys = decimate_minmax(self.xs, self.ys, cap // 2)  # type: ignore[arg-type]
            span = self.xs[-1] - self.xs[0] if len(self.xs) > 1 else 0.0
            self.bucket = max(self.bucket * 2, span / max(1, cap // 4))
            self.replaced = True

    def _close_bucket(self) -> None:
        points = self._open
        self._open = []
        finite = [p for p in points if p[1] is not None]
        if not finite:
            keep = [points[-1]]
        else:
            lo = min(finite, key=lambda p: p[1])  # type: ignore[arg-type, return-value]
            hi = max(finite, key=lambda p: p[1])  # type: ignore[arg-type, return-value]
            keep = sorted({lo, hi})
        for px, py in keep:
            self.xs.append(px)
            self.ys.append(py)

    def trace(self) -> dict[str, Any]:
        """The figure-format trace with all current points."""
        return {"name": self.name, "x": list(self.xs), "y": list(self.ys), "color": self.color, "width": self.width,
                "dash": self.dash, "opacity": self.opacity}  # fmt: skip


@dataclass
class Extend:
    """New points for some traces of one line figure (sent as float64 buffers, x then y per trace)."""

    figure: str
    traces: list[int]
    xs: list[list[float]]
    ys: list[list[float | None]]

    @property
    def points(self) -> int:
        """Points in this update."""
        return sum(len(x) for x in self.xs)


class _LineFigure:
    def __init__(self, fid: str, title: str, x_title: str, y_title: str, note: str) -> None:
        self.id, self.title, self.x_title, self.y_title, self.note = fid, title, x_title, y_title, note
        self.series: list[Series] = []
        self.by_key: dict[Any, int] = {}
        self.hlines: list[dict[str, Any]] = []
        self.vlines: list[dict[str, Any]] = []
        self.y_log = False
        self.dirty = True  # structure changed: re-send whole

    def get(self, key: Any, make: Callable[[], Series]) -> Series:
        idx = self.by_key.get(key)
        if idx is None:
            idx = self.by_key[key] = len(self.series)
            self.series.append(make())
            self.dirty = True
        return self.series[idx]

    def figure(self) -> Figure:
        return {"id": self.id, "kind": "line", "title": self.title, "x_title": self.x_title, "y_title": self.y_title,
                "y_log": self.y_log, "traces": [s.trace() for s in self.series], "hlines": list(self.hlines),
                "vlines": list(self.vlines),
                "note": self.note}  # fmt: skip


class DashboardModel:
    """Panel data of one run, fed with telemetry records.

    Parameters
    ----------
    world_size
        Ranks of the run (``None``: learnt from ``start`` records).
    plan_memory
        The plan's predicted per-GPU memory in bytes, drawn as a line on the memory panel.
    device_limit
        Memory of one device in bytes (default: what ``mem`` records report as ``device_total``).
    hb_interval
        The workers' heartbeat period in seconds (``JD_HEARTBEAT_S``): ages are judged against it.
    max_points
        Cap per line trace; beyond it a trace is min/max-decimated to half.
    per_rank_limit
        Up to this many ranks, loss and communication have a trace per rank; beyond it, mean/min/max and a
        rank x time heatmap.
    metric
        The metric of the loss panel (default ``loss``, else the first one logged).
    smoothing
        Weight of the newest step in the smoothed mean (an exponential moving average per step, debiased as in
        TensorBoard's smoothing; a coalesced record of ``n`` steps, from runs of older versions, weighs as ``n``).
    clock
        Unix time source (tests pass a fake one).
    """

    def __init__(self, world_size: int | None = None, *, plan_memory: float | None = None,
                 device_limit: float | None = None, hb_interval: float = 2.0, max_points: int = 2000,
                 per_rank_limit: int = 16, metric: str | None = None, smoothing: float = 0.1,
                 clock: Callable[[], float] = time.time, t0: float | None = None) -> None:  # fmt: skip
        if max_points < 8:
            raise ValueError(f"max_points must be >= 8, got {max_points}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.world_size = world_size
        self.dp_size: int | None = None
        """Data-parallel replicas (from ``start`` records): the throughput counts each replica once."""
        self.plan_memory = plan_memory
        self.device_limit = device_limit
        self.hb_interval = hb_interval
        self.max_points = max_points
        self.per_rank_limit = per_rank_limit
        self.metric = metric
        self.smoothing = smoothing
        self.clock = clock
        self.state = "running"
        """Run state shown in the status line (set by the owner: running, succeeded, failed, ...)."""
        self.t0: float | None = t0
        """Origin of the time axes (the run's start; default: the earliest record)."""
        self._fixed_t0 = t0 is not None
        self.last_t: float | None = None
        self.max_step: int | None = None
        self.records = 0
        self.bad_lines = 0
        self.duplicates = 0
        self.errors: list[str] = []
        self.restarts = 0
        self._starts: dict[int, int] = {}
        self._latest_metric: dict[int, float] = {}
        self._ema = 0.0
        self._ema_keep = 1.0
        self._rates: dict[int, float] = {}
        self.rate_unit: str | None = None
        self._hb: dict[int, dict[str, Any]] = {}
        self._exited: dict[int, str] = {}
        self._mem: dict[int, dict[str, Any]] = {}
        self._comm_bins: dict[int, dict[int, float]] = {}
        self.health = HealthTracker()
        self.measure = MeasureBuilder()
        """The one measurement (``telemetry/measurement.py``): the status line's throughput is the summary's."""
        self.hang_timeout = 120.0
        """Seconds without a step (while heartbeats come) before the status line reports a hang."""
        self._comm_bin_s = 1.0
        self._comm_cols: set[int] = set()
        self.small_dirty: set[str] = set(SMALL_FIGURES)
        self.lines = {
            "loss": _LineFigure("loss", "Loss", "step", "loss", "waiting for jd.log(step, loss=...)"),
            "throughput": _LineFigure("throughput", "Throughput", "time since start (s)", "per second",
                                      "waiting for step records with step_time or tokens"),
            "comm": _LineFigure("comm", "Time in collectives", "time since start (s)", "seconds per second",
                                "no collective timings yet (comm records)"),
        }  # fmt: skip

    # ---- input ----------------------------------------------------------------------------------------------
    def load(self, columns: Any) -> int:
        """A run's history at once (a :class:`~jupyter_dist.telemetry.reader.RunColumns`): opening a finished run.

        Every call is measured (the status line's throughput is the summary's); the line panels are drawn from
        about ``max_points`` calls per rank (the smallest and largest value of the metric per bucket of calls, so a
        spike stays), which is what the traces would keep after decimating anyway. Returns the records used.
        """
        self.measure.add_columns(columns.steps.values())
        self.measure.add(columns.records)
        metric = self.metric
        if metric is None:
            names = list(getattr(columns, "names", None)
                         or {n: None for c in columns.steps.values() for n in c.metrics})  # fmt: skip
            metric = "loss" if "loss" in names else next(iter(names), None)
            if metric is not None:  # as _on_step would name it from the first record
                self.metric = metric
                self.lines["loss"].title = metric.capitalize() if metric == "loss" else metric
                self.lines["loss"].y_title = metric
        drawn: list[dict[str, Any]] = []
        for cols in columns.steps.values():
            # about a quarter of a trace's cap per rank: the min and max of each bucket, spikes kept
            drawn += cols.records(cols.thin(metric, self.max_points // 4))
        return self.ingest(drawn + columns.records, measure=False)

    def ingest(self, records: Iterable[dict[str, Any]], *, measure: bool = True) -> int:
        """Take records (any kinds, any rank order; a batch is taken in time order); returns how many were used."""
        used = 0
        batch = sorted(records, key=_time_of)
        self.health.ingest(batch)
        if measure:
            self.measure.add(batch)
        for rec in batch:
            kind = rec.get("kind")
            try:
                rank = int(rec["rank"])
                t = float(rec["t"])
            except (KeyError, TypeError, ValueError):
                continue
            self.records += 1
            if not self._fixed_t0:
                self.t0 = t if self.t0 is None else min(self.t0, t)
            self.last_t = t if self.last_t is None else max(self.last_t, t)
            handler = getattr(self, f"_on_{kind}", None)
            if handler is not None:
                handler(rec, rank, t)
                used += 1
        return used

    def _loss_series(self, key: Any) -> Series:
        fig = self.lines["loss"]
        if key == "mean":
            return fig.get("mean", lambda: Series("mean (smoothed)", "#111111", width=2.5))
        if key in ("min", "max"):
            return fig.get(key, lambda: Series(f"{key} over ranks", "#999999", width=1.0, dash="dot"))
        return fig.get(key, lambda: Series(f"rank {key}", rank_color(key), width=1.0, opacity=0.6))

    def _on_start(self, rec: dict[str, Any], rank: int, t: float) -> None:
        ws = rec.get("world_size")
        if isinstance(ws, int) and ws > 0 and (self.world_size is None or ws > self.world_size):
            self.world_size = ws
        dp = rec.get("dp_size")
        if isinstance(dp, int) and dp > 0:
            self.dp_size = dp
        self._starts[rank] = self._starts.get(rank, 0) + 1
        if self._starts[rank] > 1:  # the same rank started again: an elastic restart
            n = self._starts[rank] - 1
            fig = self.lines["loss"]
            if n > self.restarts:  # mark it once, at the last step seen before it
                fig.vlines.append({"x": self.max_step or 0, "name": f"restart {n}", "color": "#6a1b9a"})
                fig.dirty = True
                mean = fig.by_key.get("mean")
                if mean is not None and fig.series[mean].xs:  # the curves continue from the resumed step
                    s = fig.series[mean]
                    s.append(s.xs[-1], None, self.max_points)
            self.restarts = max(self.restarts, n)
            key = fig.by_key.get(rank)
            if key is not None and fig.series[key].xs:
                fig.series[key].append(fig.series[key].xs[-1], None, self.max_points)  # a gap, then the new segment
        self._exited.pop(rank, None)
        self.small_dirty.add("heartbeat")

    def _on_step(self, rec: dict[str, Any], rank: int, t: float) -> None:
        step = rec.get("step")
        if not isinstance(step, int):
            return
        self.max_step = step if self.max_step is None else max(self.max_step, step)
        name = self.metric
        if name is None:
            name = "loss" if "loss" in rec else next((k for k in rec if _is_metric(k, rec[k])), None)
            if name is not None:
                self.metric = name
                self.lines["loss"].title = name.capitalize() if name == "loss" else name
                self.lines["loss"].y_title = name
        value = rec.get(name) if name is not None else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            n = rec.get("n")
            self._add_loss(rank, step, float(value), n if isinstance(n, int) and n > 0 else 1)
        rate, unit = _rate(rec)
        if rate is not None and unit is not None:
            if self.rate_unit is None or _UNITS.index(unit) < _UNITS.index(self.rate_unit):
                if self.rate_unit != unit:
                    self._rates.clear()
                self.rate_unit = unit
                fig = self.lines["throughput"]
                fig.y_title = unit
                fig.dirty = True
            if unit == self.rate_unit:
                self._rates[rank] = rate
                values = list(self._rates.values())
                # the one counting rule (telemetry/measurement.py): each data-parallel replica once
                total = (job_rate(self._rates, dp_size=self.dp_size, world_size=self.world_size)
                         if unit != "steps/s" else sum(values) / len(values))  # fmt: skip
                label = "total" if unit != "steps/s" else "mean over ranks"
                series = self.lines["throughput"].get("total", lambda: Series(label, "#1565c0", width=2.0))
                x = t - (self.t0 or t)
                if not series.xs or x >= series.xs[-1]:  # a late record from a slow reader does not zigzag
                    series.append(x, total, self.max_points)

    def _add_loss(self, rank: int, step: int, value: float, n: int = 1) -> None:
        per_rank = self.world_size is None or self.world_size <= self.per_rank_limit
        if per_rank and rank < self.per_rank_limit:
            self._loss_series(rank).append(step, value, self.max_points)
        if not math.isfinite(value):
            return
        self._latest_metric[rank] = value
        values = list(self._latest_metric.values())
        mean = sum(values) / len(values)
        # the smoothing weight is per step: a coalesced record of n steps (one of len(values) ranks) counts n/ranks
        keep = (1 - self.smoothing) ** (n / len(values))
        self._ema = keep * self._ema + (1 - keep) * mean
        self._ema_keep *= keep
        smoothed = self._ema / (1 - self._ema_keep)  # debiased, as TensorBoard does
        mean_series = self._loss_series("mean")
        # one point per step: the other ranks' records of a step already drawn only move the EMA (appending them
        # at the same x drew a vertical tick at every step)
        if not mean_series.xs or step > mean_series.xs[-1] or mean_series.ys[-1] is None:
            mean_series.append(step, smoothed, self.max_points)
        if not per_rank:
            for key, agg in (("min", min), ("max", max)):
                s = self._loss_series(key)
                if not s.xs or step >= s.xs[-1]:
                    s.append(step, agg(values), self.max_points)

    def _on_hb(self, rec: dict[str, Any], rank: int, t: float) -> None:
        old = self._hb.get(rank)
        if old is None or t >= old["t"]:
            self._hb[rank] = rec
        self.small_dirty.add("heartbeat")

    def _on_mem(self, rec: dict[str, Any], rank: int, t: float) -> None:
        old = self._mem.get(rank)
        if old is None or t >= old["t"]:
            peak = max(_num(rec, "peak_active", "peak_allocated", "max_rss"), _num(old or {}, "peak"))
            self._mem[rank] = {**rec, "peak": peak}
        self.small_dirty.add("memory")

    def _on_gpu(self, rec: dict[str, Any], rank: int, t: float) -> None:
        self._mem.setdefault(rank, {"t": t})["gpu"] = rec
        self.small_dirty.add("memory")

    def _on_comm(self, rec: dict[str, Any], rank: int, t: float) -> None:
        seconds = rec.get("seconds")
        if not isinstance(seconds, (int, float)):
            return
        rel = t - (self.t0 or t)
        per_rank = self.world_size is None or self.world_size <= self.per_rank_limit
        if per_rank:
            fig = self.lines["comm"]
            series = fig.get(rank, lambda: Series(f"rank {rank}", rank_color(rank), width=1.0))
            window = max(float(rec.get("window_s") or 1.0), 1e-3)
            if not series.xs or rel >= series.xs[-1]:
                series.append(rel, float(seconds) / float(window), self.max_points)
        bins = self._comm_bins.setdefault(rank, {})
        b = int(rel // self._comm_bin_s)
        bins[b] = bins.get(b, 0.0) + float(seconds)
        self._comm_cols.add(b)
        if len(self._comm_cols) > 120:  # keep the heatmap <= 120 columns
            self._comm_bin_s *= 2
            for r, old in self._comm_bins.items():
                merged: dict[int, float] = {}
                for k, v in old.items():
                    merged[k // 2] = merged.get(k // 2, 0.0) + v
                self._comm_bins[r] = merged
            self._comm_cols = {k // 2 for k in self._comm_cols}
        self.small_dirty.add("comm_heatmap")

    def _on_error(self, rec: dict[str, Any], rank: int, t: float) -> None:
        self._note_error(f"rank {rank}: {rec.get('error_type')}: {rec.get('error')}")

    def _on_exit(self, rec: dict[str, Any], rank: int, t: float) -> None:
        status = str(rec.get("status"))
        self._exited[rank] = status
        if status == "error":
            self._note_error(f"rank {rank} exited with {rec.get('error_type')}: {rec.get('error')}")
        elif status == "terminated":
            self._note_error(f"rank {rank} was terminated ({rec.get('signal')})")
        self.small_dirty.add("heartbeat")

    def _note_error(self, text: str) -> None:
        if text not in self.errors:
            self.errors.append(text)
            del self.errors[:-20]

    # ---- output ---------------------------------------------------------------------------------------------
    def take_extends(self) -> tuple[list[Extend], set[str]]:
        """New points per line figure since the last call, and the line figures that must be re-sent whole."""
        extends: list[Extend] = []
        whole: set[str] = set()
        for fid, fig in self.lines.items():
            if fig.dirty or any(s.replaced for s in fig.series):
                whole.add(fid)
                fig.dirty = False
                for s in fig.series:
                    s.replaced = False
                    s.sent = len(s.xs)
                continue
            idx, xs, ys = [], [], []
            for i, s in enumerate(fig.series):
                if s.sent < len(s.xs):
                    idx.append(i)
                    xs.append(s.xs[s.sent :])
                    ys.append(s.ys[s.sent :])
                    s.sent = len(s.xs)
            if idx:
                extends.append(Extend(fid, idx, xs, ys))
        return extends, whole

    def take_small(self) -> set[str]:
        """Bar/heatmap figures that changed since the last call (the heartbeat panel changes with time)."""
        dirty = set(self.small_dirty)
        if self._hb:
            dirty.add("heartbeat")
        self.small_dirty.clear()
        return dirty

    def line_figures(self) -> list[Figure]:
        """The line figures with every current point."""
        figs = [self.lines["loss"].figure(), self.lines["throughput"].figure()]
        if self.world_size is None or self.world_size <= self.per_rank_limit:
            figs.append(self.lines["comm"].figure())
        return figs

    def small_figures(self, now: float | None = None) -> list[Figure]:
        """The memory and heartbeat bars and (past ``per_rank_limit`` ranks) the communication heatmap."""
        figs = [self.memory_figure(), self.heartbeat_figure(now)]
        if self.world_size is not None and self.world_size > self.per_rank_limit:
            figs.append(self.comm_heatmap())
        return figs

    def figures(self, now: float | None = None) -> list[Figure]:
        """Every panel, in display order."""
        lines = {f["id"]: f for f in self.line_figures()}
        small = {f["id"]: f for f in self.small_figures(now)}
        order = ["loss", "throughput", "memory", "heartbeat", "comm", "comm_heatmap"]
        both = {**lines, **small}
        return [both[i] for i in order if i in both]

    def _ranks(self) -> list[int]:
        seen = set(self._hb) | set(self._mem) | set(self._starts) | set(self._exited)
        if self.world_size:
            return list(range(self.world_size))
        return sorted(seen)

    def memory_figure(self) -> Figure:
        """Per-rank memory (GiB) against the plan's prediction and the device limit."""
        ranks = self._ranks()
        cuda = any(str(self._mem.get(r, {}).get("device", "cpu")).startswith("cuda") for r in ranks)
        names = (("allocated", "allocated"), ("reserved", "reserved"), ("peak", "peak active")) if cuda else (
            ("rss", "resident (RSS)"), ("peak", "peak RSS"))  # fmt: skip
        colors = {"allocated": "#1f77b4", "reserved": "#aec7e8", "rss": "#1f77b4", "peak": "#ff7f0e"}
        series = []
        for key, label in names:
            values = [_gib(self._mem.get(r, {}).get(key)) for r in ranks]
            series.append({"name": label, "values": values, "color": colors[key]})
        hlines = []
        if self.plan_memory and cuda:  # a per-GPU prediction says nothing about a CPU process's RSS
            hlines.append({"y": self.plan_memory / GIB, "name": "plan", "color": "#6a1b9a", "dash": "dash"})
        limit = self.device_limit or max((_num(self._mem.get(r, {}), "device_total") for r in ranks), default=0)
        if limit and cuda:
            hlines.append({"y": limit / GIB, "name": "device limit", "color": "#c62828", "dash": "solid"})
        gpu_note = [self._mem.get(r, {}).get("gpu") for r in ranks]
        labels = None
        if any(gpu_note):
            labels = [f"{g['util']:.0f}% util" if g and "util" in g else "" for g in gpu_note]
        return {"id": "memory", "kind": "bar", "title": "Memory per rank" + (" (GPU)" if cuda else " (host RSS)"),
                "y_title": "GiB", "categories": [f"rank {r}" for r in ranks], "series": series, "bar_colors": None,
                "labels": labels, "hlines": hlines, "note": "waiting for mem records"}  # fmt: skip

    def heartbeat_figure(self, now: float | None = None) -> Figure:
        """Seconds since each rank's last heartbeat, coloured by state, with the phase it reported."""
        now = self.clock() if now is None else now
        ranks = self._ranks()
        ages: list[float | None] = []
        colors, labels = [], []
        for r in ranks:
            hb = self._hb.get(r)
            exited = self._exited.get(r)
            if hb is None:
                ages.append(None)
                colors.append(HB_COLORS["unknown"])
                labels.append(exited or "")
                continue
            age = max(0.0, now - float(hb["t"]))
            state = hb_state(age, self.hb_interval, exited=exited is not None)
            ages.append(round(age, 2))
            colors.append(HB_COLORS[state])
            labels.append(exited if exited else f"{hb.get('phase', '?')} · {state}")
        return {"id": "heartbeat", "kind": "bar", "title": "Heartbeat age per rank", "y_title": "seconds",
                "categories": [f"rank {r}" for r in ranks], "series": [{"name": "age", "values": ages,
                "color": HB_COLORS["ok"]}], "bar_colors": colors, "labels": labels,
                "hlines": [{"y": self.hb_interval * 5, "name": "slow", "color": "#f9a825", "dash": "dot"}],
                "note": "waiting for hb records"}  # fmt: skip

    def comm_heatmap(self) -> Figure:
        """Seconds inside collectives per rank and time bin (for many ranks)."""
        ranks = self._ranks()
        cols = sorted({k for v in self._comm_bins.values() for k in v})
        z = [[self._comm_bins.get(r, {}).get(c) for c in cols] for r in ranks]
        return {"id": "comm_heatmap", "kind": "heatmap", "title": "Time in collectives (rank x time)",
                "x_title": "time since start (s)", "y_title": "rank", "x": [c * self._comm_bin_s for c in cols],
                "y": [f"rank {r}" for r in ranks], "z": z, "z_title": "s in collectives",
                "note": "no collective timings yet (comm records)"}  # fmt: skip

    def straggler(self) -> dict[str, Any]:
        """Straggler scores from the last five ``comm`` windows of each rank (see ``straggler_scores``)."""
        return self.health.straggler()

    def hang(self, now: float | None = None) -> dict[str, Any] | None:
        """A hang report when no rank logged a step for ``hang_timeout`` seconds (see ``hang_report``)."""
        if self.state != "running":
            return None
        now = self.clock() if now is None else now
        return self.health.hang(now, self.hang_timeout)

    def status(self, now: float | None = None) -> dict[str, Any]:
        """The status line's facts: state, elapsed time, step, ranks alive, restarts, errors, skipped lines."""
        now = self.clock() if now is None else now
        alive = sum(1 for r, hb in self._hb.items() if r not in self._exited and now - float(hb["t"]) <= 5 * max(
            self.hb_interval, 0.5))  # fmt: skip
        rate, unit = self.measure.result().throughput
        return {"state": self.state, "elapsed_s": None if self.t0 is None else round(max(0.0, now - self.t0), 1),
                "throughput": rate, "throughput_unit": unit,
                "step": self.max_step, "world_size": self.world_size, "ranks_alive": alive,
                "restarts": self.restarts, "errors": list(self.errors), "bad_lines": self.bad_lines,
                "duplicates": self.duplicates, "records": self.records, "straggler": self.straggler(),
                "hang": self.hang(now)}  # fmt: skip

    def status_html(self, now: float | None = None, *, title: str = "") -> str:
        """The status line as HTML (escaped)."""
        st = self.status(now)
        # pending: a cluster job still queued or provisioning (grey, not an error)
        color = {"running": "#1565c0", "succeeded": "#2e7d32", "pending": "#555"}.get(st["state"], "#c62828")
        parts = [f'<b style="color:{color}">{html.escape(str(st["state"]))}</b>']
        if title:
            parts.insert(0, f"<b>{html.escape(title)}</b>")
        if st["elapsed_s"] is not None:
            parts.append(f"{st['elapsed_s']:.0f} s")
        if st["step"] is not None:
            parts.append(f"step {st['step']}")
        if st["throughput"] is not None:
            rate = st["throughput"]
            unit = st["throughput_unit"]
            parts.append(f"{rate:,.0f} {unit}" if rate >= 100 else f"{rate:.3g} {unit}")
        if st["world_size"]:
            parts.append(f"{st['ranks_alive']}/{st['world_size']} ranks alive")
        if st["restarts"]:
            parts.append(f"{st['restarts']} restart(s)")
        if st["bad_lines"]:
            parts.append(f"{st['bad_lines']} unreadable line(s) skipped")
        strag = st["straggler"]
        if strag["straggler"] is not None:
            lag = strag.get("arrival_lag_s", {}).get(strag["straggler"])
            late = f", arrives {lag * 1e3:.0f} ms late at collectives" if lag else ""
            parts.append(f'<span style="color:#ef6c00">straggler: rank {strag["straggler"]} computes '
                         f'{strag["slowdown"]:.0%} slower than the fastest{late}</span>')  # fmt: skip
        if st["hang"] is not None:
            parts.append(f'<span style="color:#c62828">hang? no step for {st["hang"]["stalled_s"]:.0f} s: '
                         f"{html.escape(st['hang']['reason'])}</span>")  # fmt: skip
        out = '<div class="jd-status">' + " · ".join(parts) + "</div>"
        if st["errors"]:
            items = "".join(f"<li>{html.escape(e)}</li>" for e in st["errors"][-5:])
            out += f'<ul class="jd-errors" style="color:#c62828;margin:2px 0">{items}</ul>'
        return out


_UNITS = ("tokens/s", "samples/s", "steps/s")


def _time_of(rec: dict[str, Any]) -> float:
    t = rec.get("t")
    return float(t) if isinstance(t, (int, float)) else 0.0


def _rate(rec: dict[str, Any]) -> tuple[float | None, str | None]:
    for key, unit in (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s")):
        v = rec.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v), unit
    st = rec.get("step_time")
    if isinstance(st, (int, float)) and st > 0 and math.isfinite(st):
        return 1.0 / float(st), "steps/s"
    return None, None


def _is_metric(key: str, value: Any) -> bool:
    from ..telemetry.records import ENVELOPE

    return (key not in ENVELOPE and key != "step" and key not in _DERIVED and isinstance(value, (int, float))
            and not isinstance(value, bool))  # fmt: skip


def _num(rec: dict[str, Any], *keys: str) -> float:
    best = 0.0
    for k in keys:
        v = rec.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            best = max(best, float(v))
    return best


def _gib(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return round(float(value) / GIB, 4)
    return None
