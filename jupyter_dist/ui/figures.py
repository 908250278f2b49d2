"""The panel figure format shared by the live widget (drawn with Plotly in the browser) and the static export.

A *figure* is a plain dict (JSON-safe, no plotly import in the kernel), one of four kinds:

``line``::

    {"id": "loss", "kind": "line", "title": "Loss", "x_title": "step", "y_title": "loss", "y_log": False,
     "traces": [{"name": "rank 0", "x": [0, 1, ...], "y": [2.3, 2.1, ...], "color": "#1f77b4",
                 "width": 1.0, "dash": "solid" | "dot" | "dash", "opacity": 1.0}, ...],
     "hlines": [{"y": 1.5, "name": "plan", "color": "#888", "dash": "dash"}, ...],
     "vlines": [{"x": 120, "name": "restart 1", "color": "#6a1b9a"}, ...],   # events on the x axis
     "note": "text shown when there is no data yet"}

``bar`` (grouped bars, one group per category)::

    {"id": "memory", "kind": "bar", "title": "Memory per rank", "y_title": "GiB",
     "categories": ["rank 0", "rank 1"],
     "series": [{"name": "current", "values": [1.2, 1.3], "color": "#1f77b4"}, ...],
     "bar_colors": None | ["#2e7d32", "#c62828"],  # per-category colours (single-series bars)
     "labels": None | ["forward", "backward"],       # per-category text drawn on the bars
     "hlines": [...], "note": "..."}

``hbar`` (horizontal stacked bars, one row per category; the planner's memory chart)::

    {"id": "plan-memory", "kind": "hbar", "title": "...", "x_title": "GiB per GPU",
     "categories": ["zero2", "fsdp2"], "series": [{"name": "params", "values": [12.6, 3.1], "color": "#..."}, ...],
     "labels": ["66.3 GiB fits"], "label_colors": ["#2e7d32"], "highlight": [0],   # row indices drawn bold
     "vlines": [{"x": 79.6, "name": "H100 80GB: 79.6 GiB", "color": "#c62828"}],
     "x_max": None | 160.0,   # cut longer bars at this value (their label still gives the total)
     "note": "..."}

``heatmap``::

    {"id": "comm", "kind": "heatmap", "title": "...", "x_title": "time (s)", "y_title": "rank",
     "x": [0.0, 1.0, ...], "y": ["rank 0", ...], "z": [[...per x...] per y], "z_title": "s in collectives",
     "note": "..."}

Values may be ``None`` (a gap). Line traces are capped in length by the producer (min/max decimation).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PALETTE", "rank_color", "Figure"]

Figure = dict[str, Any]

PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
"""Plotly's default qualitative colours (plotly.colors.qualitative.Plotly / D3 Category10)."""


def rank_color(rank: int) -> str:
    """The colour of ``rank`` in every panel."""
    return PALETTE[rank % len(PALETTE)]
