"""The live dashboard under a ``%%dist_train`` cell: an anywidget that draws the panels with plotly.js.

Design (measured, see the issue and ``benchmarks/dashboard.py``): one widget per run, plotly.js shipped once per
kernel through a shared :class:`PlotlyLibrary` widget and cached per page; new points go out as float64 buffers and
are drawn with one ``Plotly.extendTraces`` per figure per animation frame; traces are capped by min/max decimation.
A background thread polls the run's telemetry files; the kernel is never blocked. When the run ends, the cell's
output is replaced by a static HTML/SVG rendering of the final panels, so a saved notebook or an HTML export
shows the curves without a kernel.
"""

from __future__ import annotations

import json
import math
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MissingDependencyError
from ..telemetry.reader import TelemetryReader
from .panels import DashboardModel, Extend

__all__ = ["Dashboard", "UpdateStats", "plotly_js"]

_HERE = Path(__file__).parent
_LIB: Any = None
_LIB_LOCK = threading.Lock()


def _require_widgets() -> Any:
    try:
        import anywidget
    except ImportError:
        raise MissingDependencyError(
            'the live dashboard needs anywidget and ipywidgets: pip install "jupyter-dist[notebook]"'
        ) from None
    return anywidget


def plotly_js() -> bytes:
    """The minified plotly.js bundled with the ``plotly`` Python package."""
    try:
        import plotly
    except ImportError:
        raise MissingDependencyError('the live dashboard needs plotly: pip install "jupyter-dist[notebook]"') from None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path.read_bytes()


def _library() -> Any:
    """The kernel's single widget that carries plotly.js to the page (created on first use)."""
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            anywidget = _require_widgets()
            import traitlets

            class PlotlyLibrary(anywidget.AnyWidget):  # type: ignore[misc, name-defined]
                _esm = "export default { render({ el }) { el.style.display = 'none'; } };"
                src = traitlets.Bytes(b"").tag(sync=True)

            _LIB = PlotlyLibrary(src=plotly_js())
        return _LIB


def _widget_class() -> Any:
    anywidget = _require_widgets()
    import traitlets

    class DashboardWidget(anywidget.AnyWidget):  # type: ignore[misc, name-defined]
        _esm = _HERE / "dashboard.js"
        lib = traitlets.Unicode("").tag(sync=True)
        layout_ids = traitlets.List(traitlets.Unicode(), []).tag(sync=True)
        line_figs = traitlets.List([]).tag(sync=True)
        small_figs = traitlets.List([]).tag(sync=True)
        status_html = traitlets.Unicode("").tag(sync=True)

    return DashboardWidget  # the panel order is "layout_ids": DOMWidget already has a "layout" trait


_WIDGET_CLASS: Any = None


@dataclass
class UpdateStats:
    """What one :meth:`Dashboard.update` did."""

    records: int = 0
    extends: int = 0
    points: int = 0
    bytes_sent: int = 0
    whole_figures: int = 0


class Dashboard:
    """Live panels for a run (a :class:`~jupyter_dist.launch.run.Run`) or a run directory.

    Parameters
    ----------
    source
        A ``Run``, or the path of a run directory (its ``telemetry/`` folder is followed).
    plan
        A :class:`~jupyter_dist.plan.Plan` whose predicted per-GPU memory is drawn on the memory panel (default:
        the run's plan).
    interval
        Seconds between polls of the background thread.
    max_points
        Cap per line trace (min/max decimation beyond it).
    clock
        Unix time source (tests pass a fake one).
    widget
        Build the anywidget (``False``: model only, e.g. for the static export or benchmarks without a front-end).
    """

    def __init__(self, source: Any, *, plan: Any = None, interval: float = 0.5, max_points: int = 2000,
                 clock: Callable[[], float] = time.time, widget: bool = True,
                 hb_interval: float | None = None) -> None:  # fmt: skip
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        from ..launch.run import Run, open_run

        self.run: Any = source if isinstance(source, Run) else open_run(source)
        self.plan = plan if plan is not None else getattr(self.run, "plan", None)
        self.interval = interval
        self.clock = clock
        meta = getattr(self.run, "_meta", {}) or {}
        env = meta.get("env") or {}
        if hb_interval is None:
            try:
                hb_interval = float(env.get("JD_HEARTBEAT_S") or 2.0)
            except (TypeError, ValueError):
                hb_interval = 2.0
        plan_memory, device_limit = _plan_memory(self.plan, meta.get("strategy"))
        self.model = DashboardModel(self.run.world_size, plan_memory=plan_memory, device_limit=device_limit,
                                    hb_interval=hb_interval, max_points=max_points, clock=clock,
                                    t0=meta.get("started"))  # fmt: skip
        # the panels keep their own bounded data: the reader's ring buffers only need recent records
        self.reader = TelemetryReader(Path(self.run.dir) / "telemetry", interval=interval, maxlen=1000)
        self.stats = UpdateStats()
        """Totals over all updates (bytes sent to the browser, points, ...)."""
        self.last = UpdateStats()
        """The last update."""
        self.widget: Any = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._display: Any = None
        self.finished = threading.Event()
        self._status_html = ""
        self._load_history()
        self.update()
        if widget:
            self._build_widget()

    def _load_history(self) -> None:
        """What the run wrote before the panels opened, read as columns; the reader then follows new lines only.

        A long run's history opens in about a second (``benchmarks/lossless_telemetry.py``).
        """
        from ..telemetry.reader import read_run_columns

        if self.reader.follower is None:
            return
        wanted = {self.model.metric or "loss", "tokens", "samples", "step_time", "tokens_per_s", "samples_per_s"}
        start = dict(self.reader.follower._offsets), dict(self.reader.follower._partial)
        columns = read_run_columns(self.reader.follower.folder, follower=self.reader.follower, metrics=wanted)
        if self.model.metric is None and "loss" not in columns.names and columns.names:  # another first metric
            self.reader.follower._offsets, self.reader.follower._partial = start
            columns = read_run_columns(self.reader.follower.folder, follower=self.reader.follower)
        self.reader.records.bad_lines += columns.bad_lines
        self.model.load(columns)

    # ---- widget ---------------------------------------------------------------------------------------------
    def _build_widget(self) -> None:
        global _WIDGET_CLASS
        if _WIDGET_CLASS is None:
            _WIDGET_CLASS = _widget_class()
        lib = _library()
        now = self.clock()
        self.model.take_extends()  # the initial state holds every point so far
        self.model.take_small()
        self.widget = _WIDGET_CLASS(
            lib=lib.model_id, layout_ids=[f["id"] for f in self.model.figures(now)],
            line_figs=self.model.line_figures(), small_figs=self.model.small_figures(now),
            status_html=self._status(now),
        )  # fmt: skip

    def _status(self, now: float) -> str:
        self.model.state = str(getattr(self.run, "status", "running"))
        self.model.bad_lines = self.reader.bad_lines
        self.model.duplicates = self.reader.duplicates
        return self.model.status_html(now, title=getattr(self.run, "name", ""))

    # ---- updates --------------------------------------------------------------------------------------------
    def update(self, now: float | None = None) -> UpdateStats:
        """Read what the ranks wrote since the last call and send the changes to the browser; returns the stats."""
        with self._lock:
            stats = UpdateStats()
            new = self.reader.poll()
            stats.records = len(new)
            self.model.ingest(new)
            now = self.clock() if now is None else now
            if self.widget is not None:
                extends, whole = self.model.take_extends()
                for ext in extends:
                    stats.bytes_sent += self._send_extend(ext)
                    stats.extends += 1
                    stats.points += ext.points
                if whole:
                    figs = self.model.line_figures()
                    stats.bytes_sent += _json_size(figs)
                    stats.whole_figures += len(whole)
                    stats.points += sum(len(t["x"]) for f in figs for t in f["traces"])
                    self.widget.line_figs = figs
                    self.widget.layout_ids = [f["id"] for f in self.model.figures(now)]
                if self.model.take_small():
                    small = self.model.small_figures(now)
                    if small != self.widget.small_figs:  # traitlets sends nothing for an equal value
                        stats.bytes_sent += _json_size(small)
                        self.widget.small_figs = small
                status = self._status(now)
                if status != self.widget.status_html:
                    stats.bytes_sent += len(status)
                    self.widget.status_html = status
            self.last = stats
            for name in ("records", "extends", "points", "bytes_sent", "whole_figures"):
                setattr(self.stats, name, getattr(self.stats, name) + getattr(stats, name))
            return stats

    def _send_extend(self, ext: Extend) -> int:
        buffers = []
        for xs, ys in zip(ext.xs, ext.ys, strict=True):
            buffers.append(array("d", xs).tobytes())
            buffers.append(array("d", (math.nan if y is None else y for y in ys)).tobytes())
        content = {"type": "extend", "fig": ext.figure, "traces": ext.traces}
        self.widget.send(content, buffers=buffers)
        return len(json.dumps(content)) + sum(len(b) for b in buffers)

    # ---- life cycle -----------------------------------------------------------------------------------------
    def start(self) -> Dashboard:
        """Update every ``interval`` seconds on a daemon thread until the run ends (then once more, and finish)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jupyter-dist-dashboard", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.update()
            except Exception:  # pragma: no cover - keep the panels alive; the next round may succeed
                import logging

                logging.getLogger(__name__).exception("jupyter_dist dashboard update failed")
            if getattr(self.run, "done", True):
                break
            self._stop.wait(self.interval)
        if not self._stop.is_set():
            self.finish()

    def stop(self) -> None:
        """Stop updating (the panels stay as they are)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def finish(self) -> None:
        """Final update, then replace the live display (if shown with :meth:`show`) by the static rendering."""
        self.update()
        if self._display is not None:
            self._display.update(StaticDashboard(self))
        self.finished.set()

    def show(self) -> Dashboard:
        """Display the live panels (in a notebook) and start following; at the end they turn static."""
        from IPython.display import display

        self._display = display(self, display_id=True)
        return self.start()

    # ---- rendering ------------------------------------------------------------------------------------------
    def figures(self) -> list[dict[str, Any]]:
        """Every panel's current figure (the format of :mod:`jupyter_dist.ui.figures`)."""
        return self.model.figures(self.clock())

    def static_html(self) -> str:
        """The panels as HTML with inline SVG: no JavaScript, no kernel needed."""
        from .static import dashboard_html

        return dashboard_html(self.figures(), header_html=self._status(self.clock()))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        bundle: dict[str, Any] = {"text/plain": self.text_summary()}
        if self.widget is not None:
            data = self.widget._repr_mimebundle_(include=include, exclude=exclude) or {}
            if isinstance(data, tuple):  # (data, metadata)
                data = data[0]
            bundle.update(data)
            bundle["text/plain"] = self.text_summary()
        else:
            bundle["text/html"] = self.static_html()
        return bundle

    def text_summary(self) -> str:
        """The status line as plain text."""
        st = self.model.status(self.clock())
        parts = [f"{getattr(self.run, 'name', 'run')}: {st['state']}"]
        if st["step"] is not None:
            parts.append(f"step {st['step']}")
        if st["world_size"]:
            parts.append(f"{st['ranks_alive']}/{st['world_size']} ranks alive")
        parts += st["errors"][-3:]
        return " | ".join(parts)


class StaticDashboard:
    """The final panels of a dashboard as a display object: static HTML (SVG) and a text summary."""

    def __init__(self, dashboard: Dashboard) -> None:
        self.html = dashboard.static_html()
        self.text = dashboard.text_summary()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/html": self.html, "text/plain": self.text}


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str))


def _plan_memory(plan: Any, strategy: Any) -> tuple[float | None, float | None]:
    if plan is None:
        return None, None
    cand = None
    if strategy:
        try:
            cand = plan.candidate(str(strategy))
        except (KeyError, AttributeError):
            cand = None
    cand = cand or getattr(plan, "best", None)
    predicted = float(cand.memory.total) if cand is not None else None
    try:
        limit = float(plan.hardware.accelerator.memory_bytes)
    except AttributeError:
        limit = None
    return predicted, limit
