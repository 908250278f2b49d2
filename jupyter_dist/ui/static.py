"""Static, kernel-free rendering of the panel figures (see :mod:`jupyter_dist.ui.figures`) as inline SVG in HTML.

This is what a saved notebook shows for a finished run's dashboard where there is no kernel and no JavaScript:
GitHub's notebook viewer, an nbconvert HTML export, a reopened notebook before the widget loads. Stdlib only.

* Every figure is one ``<svg viewBox="0 0 W H" width="100%">`` that scales with its cell; no ``<script>``, no
  ``<style>`` element, no ids and no external resources; all styling uses presentation attributes, so an HTML
  sanitizer that strips ``style`` attributes still leaves a readable chart.
* All user text (titles, names, notes, labels, categories, colours) is HTML-escaped; the output is well-formed XML.
* Output is deterministic; coordinates are rounded to 0.1 viewBox units. Line segments with more points than twice
  the plot width are reduced to the min and max of every 1-unit pixel column (invisible at this resolution),
  so a figure stays small whatever the trace length.
* Values: ``None`` breaks a line (a gap); NaN, infinities, non-numbers and, on a log axis, values <= 0 are skipped.

One piece: a small SVG plotting library whose four figure kinds (line, bar, horizontal bar, heatmap; ~80 lines
each) share the scales, ticks, frame and legend above them; if a figure kind is added, the split is the shared axes
and text helpers apart from one module per figure kind.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from .figures import PALETTE, Figure

__all__ = ["figure_svg", "dashboard_html", "format_number", "format_ticks", "nice_ticks", "log_ticks"]

FONT = "system-ui,-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif"
TEXT = "#333"
MUTED = "#777"
GRID = "#ebebeb"
FRAME = "#c8c8c8"
CHAR_W = 0.58  # average glyph width per font-size unit, for layout estimates
MAX_LEGEND = 8
VIRIDIS = (
    "#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725",
)  # fmt: skip
"""Plotly's Viridis colour scale, interpolated linearly in RGB."""

_DASHES = {"dot": "1.5,2.5", "dash": "5,3", "dashdot": "5,2,1.5,2", "longdash": "9,3", "longdashdot": "9,2,1.5,2"}
_BAD_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")
_COLOR_RE = re.compile(r"^[#a-zA-Z0-9(),.% ]{1,40}$")

Point = tuple[float, float]


# ----------------------------------------------------------------------------------------------------- numbers


def _plain(x: float, sig: int) -> str:
    a = abs(x)
    dec = max(0, sig - 1 - math.floor(math.log10(a))) if a > 0 else 0
    s = f"{x:.{dec}f}"
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def format_number(v: float, sig: int = 3) -> str:
    """Human format with ``sig`` significant digits: ``1.5k``, ``2M``, ``0.25``, ``1e-3``, ``1e15``."""
    if not math.isfinite(v):
        return str(v)
    if v == 0:
        return "0"
    v = float(f"{v:.{sig}g}")
    a = abs(v)
    if a >= 1e15 or a < 1e-2:
        mant, exp = f"{v:.{sig - 1}e}".split("e")
        if "." in mant:
            mant = mant.rstrip("0").rstrip(".")
        return f"{mant}e{int(exp)}"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return _plain(v / div, sig) + suffix
    return _plain(v, sig)


def format_ticks(values: Sequence[float], *, log: bool = False) -> list[str]:
    """Labels for a set of ticks: the shortest human format that keeps them distinct and consistent.

    Linear ticks below 1000 share one number of decimals; ``log`` ticks are formatted one by one (``1e-4``).
    """
    vals = [float(v) for v in values]
    top = max((abs(v) for v in vals), default=0.0)
    if not log and 1e-2 <= top < 1e3:
        # plain decimals, as many as the finest tick needs (0, 0.005, 0.01 rather than 0, 5e-3, 0.01)
        for dec in range(0, 9):
            if all(abs(round(v, dec) - v) <= 1e-9 * max(1.0, abs(v)) for v in vals):
                break
        out = []
        for v in vals:
            s = f"{v:.{dec}f}"
            if "." in s:
                s = s.rstrip("0").rstrip(".")
            out.append("0" if s in ("-0", "") else s)
        if len(set(out)) == len(out):
            return out
    labels = [format_number(v) for v in vals]
    for sig in range(4, 10):
        if len(set(labels)) == len(labels):
            break
        labels = [format_number(v, sig) for v in vals]
    return labels


def _tick_value(i: int, m: int, e: int) -> float:
    # exact integers divided by an exact power of ten: the float nearest the decimal (no 0.30000000000000004)
    return float(i * m * 10**e) if e >= 0 else (i * m) / 10 ** (-e)


def _degenerate(lo: float, hi: float) -> tuple[float, float]:
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        d = abs(lo) * 0.1 or 1.0
        lo, hi = lo - d, hi + d
    return lo, hi


def nice_ticks(lo: float, hi: float, *, target: int = 5, expand: bool = False) -> list[float]:
    """About ``target`` ticks on a 1-2-5 step; ``expand`` extends them to cover ``[lo, hi]`` (else they lie inside).

    With ``expand`` the first and last tick are the nice axis bounds. Equal bounds are widened first.
    """
    lo, hi = _degenerate(lo, hi)
    e0 = math.floor(math.log10(hi - lo))
    best: list[float] = []
    best_key: tuple[int, float] | None = None
    for e in range(e0 - 2, e0 + 2):
        for m in (1, 2, 5):
            step = m * 10.0**e
            if expand:
                i0, i1 = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
            else:
                i0, i1 = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
            n = i1 - i0 + 1
            if n < 2 or n > 4 * max(target, 2):
                continue
            key = (abs(n - target), -step)  # closest to target; on a tie the fewer, wider steps
            if best_key is None or key < best_key:
                best_key, best = key, [_tick_value(i, m, e) for i in range(i0, i1 + 1)]
    return best or [lo, hi]


def log_ticks(lo: float, hi: float, *, target: int = 5) -> list[float]:
    """Ticks for a log axis over ``[lo, hi]`` (both > 0): powers of ten where the range spans a few decades.

    Over fewer than three decades, 1-2-5 multiples; over a narrow range, linear nice ticks inside it.
    """
    lo, hi = min(lo, hi), max(lo, hi)
    a, b = math.log10(lo), math.log10(hi)
    e0, e1 = math.ceil(a - 1e-9), math.floor(b + 1e-9)
    n = e1 - e0 + 1
    if n >= 3:
        d = max(1, math.ceil(n / (target + 1)))
        start = math.ceil(e0 / d) * d
        return [10.0**e for e in range(start, e1 + 1, d)]
    ticks = [
        _tick_value(m, 1, e)
        for e in range(e0 - 1, e1 + 1)
        for m in (1, 2, 5)
        if lo * (1 - 1e-9) <= m * 10.0**e <= hi * (1 + 1e-9)
    ]
    if len(ticks) >= 3:
        return ticks
    return [t for t in nice_ticks(lo, hi, target=4) if t > 0] or ticks


# ----------------------------------------------------------------------------------------------------- helpers


def _esc(s: Any) -> str:
    return html.escape(_BAD_CHARS.sub("", str(s)), quote=True)


def _c(v: float) -> str:
    s = f"{v:.1f}"
    if s.endswith(".0"):
        s = s[:-2]
    return "0" if s == "-0" else s


def _num(v: Any) -> float | None:
    """A finite float, or None for anything else (NaN, inf, strings, None)."""
    if v is None or isinstance(v, (str, bytes)):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None


def _list(v: Any) -> list[Any]:
    if v is None or isinstance(v, (str, bytes, dict)):
        return []
    try:
        return list(v)
    except TypeError:
        return []


def _text_w(s: str, size: float) -> float:
    return len(s) * size * CHAR_W


def _fit(s: str, max_px: float, size: float) -> str:
    n = max(1, int(max_px / (size * CHAR_W)))
    return s if len(s) <= n else s[: max(1, n - 1)] + "\u2026"


def _color(v: Any, default: str) -> str:
    return v if isinstance(v, str) and _COLOR_RE.match(v) else default


def _text(
    x: float, y: float, s: str, *, size: float = 10, anchor: str = "start", fill: str = "", extra: str = ""
) -> str:
    a = f' text-anchor="{anchor}"' if anchor != "start" else ""
    f = f' fill="{fill}"' if fill else ""
    sz = f' font-size="{_c(size)}"' if size != 10 else ""
    return f'<text x="{_c(x)}" y="{_c(y)}"{sz}{a}{f}{extra}>{_esc(s)}</text>'


def _viridis(t: float) -> str:
    t = min(1.0, max(0.0, t)) * (len(VIRIDIS) - 1)
    i = min(int(t), len(VIRIDIS) - 2)
    f = t - i
    c0, c1 = VIRIDIS[i], VIRIDIS[i + 1]
    rgb = [round(int(c0[k : k + 2], 16) * (1 - f) + int(c1[k : k + 2], 16) * f) for k in (1, 3, 5)]
    return "#" + "".join(f"{c:02x}" for c in rgb)


@dataclass(frozen=True)
class _Scale:
    """Maps data values onto pixels (linear or log10)."""

    lo: float
    hi: float
    p0: float
    p1: float
    log: bool = False

    def __call__(self, v: float) -> float:
        f = math.log10 if self.log else float
        a, b = f(self.lo), f(self.hi)
        return self.p0 + (f(v) - a) / (b - a) * (self.p1 - self.p0) if b != a else (self.p0 + self.p1) / 2


@dataclass
class _Frame:
    """The common parts of every figure: canvas size, title, legend, and the plot area left for the axes."""

    w: float
    h: float
    parts: list[str]
    top: float


def _begin(fig: Figure, w: float, h: float, legend: list[tuple[str, str, str, str]]) -> _Frame:
    parts = [f'<rect width="{_c(w)}" height="{_c(h)}" fill="#fff"/>']
    title = str(fig.get("title") or "")
    top = 8.0
    if title:
        parts.append(
            _text(w / 2, 17, _fit(title, w - 12, 12.5), size=12.5, anchor="middle", extra=' font-weight="600"')
        )
        top = 26.0
    if len(legend) >= 2:
        lparts, top = _legend(legend, 8.0, w - 8.0, top + 2, max(1, int(h * 0.16 / 12)))
        parts.append('<g class="legend" font-size="9">' + "".join(lparts) + "</g>")
    return _Frame(w, h, parts, top)


def _legend(
    entries: list[tuple[str, str, str, str]], x0: float, x1: float, y: float, max_rows: int
) -> tuple[list[str], float]:
    """A flowing legend of (name, colour, 'line'|'box', dasharray) entries.

    At most MAX_LEGEND entries and ``max_rows`` rows are shown; the rest are summed up as '+N more'.
    """
    fs, row_h = 9.0, 12.0
    names = [_fit(e[0], 130, fs) for e in entries]
    shown = min(len(entries), MAX_LEGEND)
    while True:
        more = len(entries) - shown
        items: list[int | str] = [*range(shown), *([f"+{more} more"] if more else [])]
        layout: list[tuple[float, int, int | str]] = []
        x, row = x0, 0
        for item in items:
            wd = _text_w(item, fs) if isinstance(item, str) else _text_w(names[item], fs) + 15
            if x > x0 and x + wd > x1:
                x, row = x0, row + 1
            if row >= max_rows:
                break
            layout.append((x, row, item))
            x += wd + 10
        if len(layout) == len(items) or shown == 0:
            break
        shown -= 1
    parts: list[str] = []
    for x, row, item in layout:
        cy = y + row * row_h + 6
        if isinstance(item, str):
            parts.append(_text(x, cy + 3, item, size=fs, fill=MUTED))
            continue
        _, color, kind, dash = entries[item]
        if kind == "box":
            parts.append(f'<rect x="{_c(x)}" y="{_c(cy - 4)}" width="11" height="8" fill="{_esc(color)}"/>')
        else:
            da = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(
                f'<line x1="{_c(x)}" y1="{_c(cy)}" x2="{_c(x + 12)}" y2="{_c(cy)}" stroke="{_esc(color)}" '
                f'stroke-width="2"{da}/>'
            )
        parts.append(_text(x + 15, cy + 3, names[item], size=fs))
    rows = 1 + max((row for _, row, _ in layout), default=0)
    return parts, y + rows * row_h + 2


def _finish(fig: Figure, frame: _Frame, body: list[str]) -> str:
    title = _esc(fig.get("title") or fig.get("id") or "figure")
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_c(frame.w)} {_c(frame.h)}" width="100%" '
        f'style="max-width:100%;height:auto" role="img" aria-label="{title}" font-family="{FONT}" '
        f'font-size="10" fill="{TEXT}">' + "".join(frame.parts) + "".join(body) + "</svg>"
    )


def _note_figure(fig: Figure, w: float, h: float, note: str | None = None) -> str:
    """The empty figure: title, an empty plot frame and the note (or 'no data yet')."""
    frame = _begin(fig, w, h, [])
    x0, y0, x1, y1 = 12.0, frame.top + 4, w - 12, h - 12
    text = note if note is not None else str(fig.get("note") or "no data yet")
    words, lines, cur = text.split(), list[str](), ""
    max_px = x1 - x0 - 16
    for word in words:
        if cur and _text_w(cur + " " + word, 10) > max_px:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    lines.append(cur)
    lines = lines[:4]
    cy = (y0 + y1) / 2 - (len(lines) - 1) * 7 + 3.5
    body = [
        f'<rect x="{_c(x0)}" y="{_c(y0)}" width="{_c(x1 - x0)}" height="{_c(y1 - y0)}" fill="none" stroke="{FRAME}"/>'
    ]
    body.append('<g class="note" font-style="italic">')
    body += [_text(w / 2, cy + i * 14, _fit(ln, max_px, 10), anchor="middle", fill=MUTED) for i, ln in enumerate(lines)]
    body.append("</g>")
    return _finish(fig, frame, body)


def _y_axis(ticks: list[float], sy: _Scale, x0: float, x1: float) -> tuple[list[str], list[str]]:
    """Gridlines and labels of the y axis: (grid parts, label parts)."""
    grid, labels = [], []
    for t, lab in zip(ticks, format_ticks(ticks, log=sy.log), strict=True):
        py = sy(t)
        grid.append(f'<line x1="{_c(x0)}" y1="{_c(py)}" x2="{_c(x1)}" y2="{_c(py)}"/>')
        labels.append(_text(x0 - 4, py + 3.5, lab, anchor="end"))
    return grid, labels


def _axis_titles(fig: Figure, x0: float, y0: float, x1: float, y1: float, h: float) -> list[str]:
    out = []
    xt, yt = str(fig.get("x_title") or ""), str(fig.get("y_title") or "")
    if xt:
        out.append(_text((x0 + x1) / 2, h - 5, _fit(xt, x1 - x0, 10), anchor="middle", fill=MUTED))
    if yt:
        cy = (y0 + y1) / 2
        out.append(
            _text(
                11,
                cy,
                _fit(yt, y1 - y0, 10),
                anchor="middle",
                fill=MUTED,
                extra=f' transform="rotate(-90 11 {_c(cy)})"',
            )
        )
    return out


def _y_ticks(lo: float, hi: float, log: bool) -> tuple[list[float], float, float]:
    """Ticks and the y domain: nice expanded bounds on a linear axis, the padded data range on a log axis."""
    if log:
        a, b = math.log10(lo), math.log10(hi)
        pad = (b - a) * 0.05 if b > a else 0.5
        dlo, dhi = 10 ** (a - pad), 10 ** (b + pad)
        return log_ticks(dlo, dhi), dlo, dhi
    ticks = nice_ticks(lo, hi, expand=True)
    return ticks, ticks[0], ticks[-1]


def _x_ticks(lo: float, hi: float, plot_w: float) -> list[float]:
    target = 5
    while True:
        ticks = nice_ticks(lo, hi, target=target)
        widest = max(_text_w(s, 10) for s in format_ticks(ticks))
        if target <= 2 or len(ticks) < 2 or (widest + 8) * (len(ticks) - 1) <= plot_w * 0.9:
            return ticks
        target -= 1


def _hlines(fig: Figure, log: bool) -> list[tuple[float, str, str, str]]:
    out = []
    for hl in _list(fig.get("hlines")):
        if not isinstance(hl, dict):
            continue
        y = _num(hl.get("y"))
        if y is None or (log and y <= 0):
            continue
        name = str(hl.get("name") or "") or format_number(y)
        out.append((y, name, _color(hl.get("color"), "#888"), _DASHES.get(str(hl.get("dash") or "dash"), "")))
    return out


def _draw_hlines(hls: list[tuple[float, str, str, str]], sy: _Scale, x0: float, x1: float) -> list[str]:
    if not hls:
        return []
    out = ['<g class="hlines">']
    for y, name, color, dash in hls:
        py = sy(y)
        da = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{_c(x0)}" y1="{_c(py)}" x2="{_c(x1)}" y2="{_c(py)}" stroke="{_esc(color)}"{da}/>')
        halo = ' stroke="#fff" stroke-width="2.5" paint-order="stroke"'  # readable over bars and lines
        out.append(_text(x1 - 3, py - 3, _fit(name, (x1 - x0) / 2, 9), size=9, anchor="end", fill=color, extra=halo))
    out.append("</g>")
    return out


def _draw_vlines(fig: Figure, sx: _Scale, xlo: float, xhi: float, y0: float, y1: float) -> list[str]:
    """Events on a line figure's x axis (e.g. an elastic restart): ``{"x": ..., "name": ..., "color": ...}``."""
    out = []
    for vl in _list(fig.get("vlines")):
        x = _num(vl.get("x")) if isinstance(vl, dict) else None
        if x is None or not xlo <= x <= xhi:
            continue
        color = _color(vl.get("color"), "#6a1b9a")
        px = sx(x)
        out.append(f'<line x1="{_c(px)}" y1="{_c(y0)}" x2="{_c(px)}" y2="{_c(y1)}" stroke="{_esc(color)}" '
                   'stroke-dasharray="4,3"/>')  # fmt: skip
        out.append(_text(px + 3, y0 + 10, _fit(str(vl.get("name") or ""), 80, 9), size=9, fill=color))
    return ['<g class="vlines">', *out, "</g>"] if out else []


# ----------------------------------------------------------------------------------------------------- line


def _segments(xs: list[Any], ys: list[Any], log: bool) -> list[list[Point]]:
    """Runs of finite points; a ``None`` x or y ends a run, other unusable values are skipped."""
    segs: list[list[Point]] = []
    cur: list[Point] = []
    for xv, yv in zip(xs, ys, strict=False):  # a longer x or y is cut to the shorter
        if xv is None or yv is None:
            if cur:
                segs.append(cur)
            cur = []
            continue
        x, y = _num(xv), _num(yv)
        if x is None or y is None or (log and y <= 0):
            continue
        cur.append((x, y))
    if cur:
        segs.append(cur)
    return segs


def _decimate(pts: list[Point], limit: int) -> list[Point]:
    """Keep the min and max of every 1-unit pixel column (plus both ends) when there are more than ``limit``."""
    if len(pts) <= limit:
        return pts
    out: list[Point] = [pts[0]]
    i, n = 1, len(pts) - 1
    while i < n:
        col = math.floor(pts[i][0])
        j = i
        while j < n and math.floor(pts[j][0]) == col:
            j += 1
        run = range(i, j)
        lo = min(run, key=lambda k: pts[k][1])
        hi = max(run, key=lambda k: pts[k][1])
        out += [pts[k] for k in sorted({lo, hi})]
        i = j
    out.append(pts[-1])
    return out


def _line(fig: Figure, w: float, h: float) -> str:
    log = bool(fig.get("y_log"))
    traces = [t for t in _list(fig.get("traces")) if isinstance(t, dict)]
    data: list[tuple[dict[str, Any], int, list[list[Point]]]] = []
    for i, t in enumerate(traces):
        ys = _list(t.get("y"))
        xs = _list(t.get("x")) if t.get("x") is not None else list(range(len(ys)))
        data.append((t, i, _segments(xs, ys, log)))
    xs_all = [p[0] for _, _, segs in data for s in segs for p in s]
    ys_all = [p[1] for _, _, segs in data for s in segs for p in s]
    if not xs_all:
        return _note_figure(fig, w, h)
    hls = _hlines(fig, log)
    ylo, yhi = min(ys_all + [y for y, *_ in hls]), max(ys_all + [y for y, *_ in hls])
    yticks, dlo, dhi = _y_ticks(ylo, yhi, log)

    legend = [
        (
            str(t.get("name") or f"trace {i}"),
            _color(t.get("color"), PALETTE[i % len(PALETTE)]),
            "line",
            _DASHES.get(str(t.get("dash") or "solid"), ""),
        )
        for t, i, _ in data
    ]
    frame = _begin(fig, w, h, legend)
    x0 = 8 + (14 if fig.get("y_title") else 0) + max(_text_w(s, 10) for s in format_ticks(yticks, log=log)) + 4
    x0 = max(x0, 28.0)
    x1, y0 = w - 14, frame.top + 6
    y1 = h - (32 if fig.get("x_title") else 20)
    xlo, xhi = _degenerate(min(xs_all), max(xs_all))
    xticks = _x_ticks(xlo, xhi, x1 - x0)
    sx, sy = _Scale(xlo, xhi, x0, x1), _Scale(dlo, dhi, y1, y0, log)

    grid, ylabels = _y_axis(yticks, sy, x0, x1)
    xlabels = []
    for tick, lab in zip(xticks, format_ticks(xticks), strict=True):
        px = sx(tick)
        grid.append(f'<line x1="{_c(px)}" y1="{_c(y0)}" x2="{_c(px)}" y2="{_c(y1)}"/>')
        xlabels.append(_text(px, y1 + 13, lab, anchor="middle"))
    body = [f'<g class="grid" stroke="{GRID}" stroke-width="1">', *grid, "</g>"]
    body.append(
        f'<rect x="{_c(x0)}" y="{_c(y0)}" width="{_c(x1 - x0)}" height="{_c(y1 - y0)}" fill="none" stroke="{FRAME}"/>'
    )
    body += _draw_hlines(hls, sy, x0, x1)
    body += _draw_vlines(fig, sx, xlo, xhi, y0, y1)

    limit = max(16, int(2 * (x1 - x0)))
    body.append('<g class="traces" fill="none" stroke-linejoin="round" stroke-linecap="round">')
    for (t, _i, segs), (name, color, _, dash) in zip(data, legend, strict=True):
        width = min(10.0, max(0.1, _num(t.get("width")) or 1.5))
        opacity = _num(t.get("opacity"))
        attrs = f' stroke="{_esc(color)}" stroke-width="{_c(width) if width >= 0.15 else "0.1"}"'
        if dash:
            attrs += f' stroke-dasharray="{dash}"'
        if opacity is not None and opacity < 1:
            attrs += f' stroke-opacity="{max(0.0, opacity):.2f}"'
        body.append(f'<g class="trace"{attrs}><title>{_esc(name)}</title>')
        for seg in segs:
            pts = _decimate([(sx(x), sy(y)) for x, y in seg], limit)
            if len(pts) == 1:
                px, py = pts[0]
                body.append(f'<circle cx="{_c(px)}" cy="{_c(py)}" r="{_c(max(1.5, width))}" fill="{_esc(color)}"/>')
            else:
                body.append('<polyline points="' + " ".join(f"{_c(px)},{_c(py)}" for px, py in pts) + '"/>')
        body.append("</g>")
    body.append("</g>")
    body += ['<g class="yaxis">', *ylabels, "</g>", '<g class="xaxis">', *xlabels, "</g>"]
    body += _axis_titles(fig, x0, y0, x1, y1, h)
    return _finish(fig, frame, body)


# ----------------------------------------------------------------------------------------------------- bar


def _category_labels(
    cats: list[str], centers: list[float], band: float, y: float, max_h: float, size: float = 9
) -> tuple[list[str], float]:
    """Category labels under a band axis: horizontal when they fit, else rotated -45 degrees and thinned out.

    Returns the parts and the height they take below ``y``.
    """
    widest = max((_text_w(c, size) for c in cats), default=0.0)
    if widest + 4 <= band:
        return [_text(cx, y + 12, c, size=size, anchor="middle") for c, cx in zip(cats, centers, strict=True)], 16.0
    step = max(1, math.ceil((size + 2) / max(band, 1e-9)))
    max_px = max(size, (max_h - 8) / 0.71)
    labels = [_fit(c, max_px, size) for c in cats]
    used = 8 + min(max_px, max(_text_w(s, size) for s in labels)) * 0.71 + 4
    parts = []
    for i in range(0, len(cats), step):
        cx, ly = centers[i] + 3, y + 9
        parts.append(
            _text(cx, ly, labels[i], size=size, anchor="end", extra=f' transform="rotate(-45 {_c(cx)} {_c(ly)})"')
        )
    return parts, used


def _bar(fig: Figure, w: float, h: float) -> str:
    log = bool(fig.get("y_log"))
    series = [s for s in _list(fig.get("series")) if isinstance(s, dict)]
    values = [[_num(v) for v in _list(s.get("values"))] for s in series]
    if log:
        values = [[v if v is not None and v > 0 else None for v in vs] for vs in values]
    cats = [str(c) for c in _list(fig.get("categories"))]
    n = len(cats) or max((len(vs) for vs in values), default=0)
    cats += [str(i) for i in range(len(cats), n)]
    finite = [v for vs in values for v in vs[:n] if v is not None]
    if not n or not finite:
        return _note_figure(fig, w, h)
    bar_colors = _list(fig.get("bar_colors"))
    texts = [str(t) if t is not None else "" for t in _list(fig.get("labels"))]
    hls = _hlines(fig, log)
    span = finite + [y for y, *_ in hls]
    lo, hi = (min(span), max(span)) if log else (min(0.0, *span), max(0.0, *span))
    if any(texts) and not log:
        hi += 0.12 * (hi - lo)
    yticks, dlo, dhi = _y_ticks(lo, hi, log)

    colors = [_color(s.get("color"), PALETTE[i % len(PALETTE)]) for i, s in enumerate(series)]
    legend = [(str(s.get("name") or f"series {i}"), colors[i], "box", "") for i, s in enumerate(series)]
    frame = _begin(fig, w, h, legend)
    x0 = 8 + (14 if fig.get("y_title") else 0) + max(_text_w(s, 10) for s in format_ticks(yticks, log=log)) + 4
    x0 = max(x0, 28.0)
    x1, y0 = w - 12, frame.top + 6
    band = (x1 - x0) / n
    centers = [x0 + (i + 0.5) * band for i in range(n)]
    x_title_h = 14 if fig.get("x_title") else 0
    # category labels take what they need below the plot, up to a third of the height
    _, label_h = _category_labels(cats, centers, band, 0, h * 0.3)
    y1 = h - label_h - x_title_h - 2
    clabels, _ = _category_labels(cats, centers, band, y1, h * 0.3)
    sy = _Scale(dlo, dhi, y1, y0, log)
    grid, ylabels = _y_axis(yticks, sy, x0, x1)
    body = [f'<g class="grid" stroke="{GRID}" stroke-width="1">', *grid, "</g>"]
    body.append(
        f'<rect x="{_c(x0)}" y="{_c(y0)}" width="{_c(x1 - x0)}" height="{_c(y1 - y0)}" fill="none" stroke="{FRAME}"/>'
    )

    base = sy(dlo) if log else sy(0.0)
    m = max(1, len(series))
    bw = band * 0.8 / m
    bars, labels = ['<g class="bars">'], ['<g class="labels" font-size="9">']
    for i in range(n):
        cat_color = bar_colors[i] if i < len(bar_colors) else None
        tops = []
        for k, vs in enumerate(values):
            v = vs[i] if i < len(vs) else None
            if v is None:
                continue
            py = sy(v)
            top, bot = min(py, base), max(py, base)
            tops.append(top)
            bx = x0 + i * band + band * 0.1 + k * bw
            fill = _color(cat_color, colors[k])
            tip = (
                f"{cats[i]} \u00b7 {legend[k][0]}: {format_number(v, 4)}"
                if m > 1
                else f"{cats[i]}: {format_number(v, 4)}"
            )
            bars.append(
                f'<rect x="{_c(bx)}" y="{_c(top)}" width="{_c(max(bw - (0.5 if bw > 2 else 0), 0.3))}" '
                f'height="{_c(max(bot - top, 0.1))}" fill="{_esc(fill)}"><title>{_esc(tip)}</title></rect>'
            )
        text = texts[i] if i < len(texts) else ""
        if not text or not tops:
            continue
        top, cx = min(tops), centers[i]
        if _text_w(text, 9) + 2 <= band:
            labels.append(_text(cx, top - 3, text, size=9, anchor="middle"))
        elif band >= 7 and top - y0 > 12:
            s = _fit(text, top - y0 - 4, 9)
            labels.append(
                _text(cx + 3, top - 3, s, size=9, extra=f' transform="rotate(-90 {_c(cx + 3)} {_c(top - 3)})"')
            )
    bars.append("</g>")
    labels.append("</g>")
    body += bars + labels + _draw_hlines(hls, sy, x0, x1)
    body += ['<g class="yaxis">', *ylabels, "</g>", '<g class="xaxis">', *clabels, "</g>"]
    body += _axis_titles(fig, x0, y0, x1, y1, h)
    return _finish(fig, frame, body)


# ----------------------------------------------------------------------------------------------------- hbar


def _hbar(fig: Figure, w: float, h: float) -> str:
    """Horizontal stacked bars: one row per category, series stacked left to right, ``vlines`` as limits."""
    series = [s for s in _list(fig.get("series")) if isinstance(s, dict)]
    values = [[_num(v) for v in _list(s.get("values"))] for s in series]
    cats = [str(c) for c in _list(fig.get("categories"))]
    n = len(cats)
    totals = [sum(max(0.0, vs[i] or 0.0) for vs in values if i < len(vs)) for i in range(n)]
    vls = [(x, str(vl.get("name") or ""), _color(vl.get("color"), "#c62828"))
           for vl in _list(fig.get("vlines")) if isinstance(vl, dict) and (x := _num(vl.get("x"))) is not None]
    if not n or not any(totals):
        return _note_figure(fig, w, h)
    texts = [str(t) if t is not None else "" for t in _list(fig.get("labels"))]
    text_colors = _list(fig.get("label_colors"))
    bold = {i for i in _list(fig.get("highlight")) if isinstance(i, int)}
    colors = [_color(s.get("color"), PALETTE[i % len(PALETTE)]) for i, s in enumerate(series)]
    legend = [(str(s.get("name") or f"series {i}"), colors[i], "box", "") for i, s in enumerate(series)]
    frame = _begin(fig, w, h, legend)
    cat_w = min(w * 0.34, max(_text_w(c, 9.5) for c in cats) + 10)
    text_w = min(w * 0.22, max((_text_w(t, 9) for t in texts), default=0.0) + 8)
    x0, x1 = 6 + cat_w, w - 8 - text_w
    y0 = frame.top + 4 + (10 if vls else 0)
    y1 = h - 16 - (14 if fig.get("x_title") else 0)
    hi = max(*totals, *(x for x, *_ in vls)) * 1.02
    x_max = _num(fig.get("x_max"))
    clipped = x_max is not None and 0 < x_max < hi
    if clipped:
        hi = float(x_max)  # type: ignore[arg-type]
    ticks = [t for t in _x_ticks(0.0, hi, x1 - x0) if t <= hi * 1.0001] if clipped else _x_ticks(0.0, hi, x1 - x0)
    hi = hi if clipped else max(hi, ticks[-1])
    sx = _Scale(0.0, hi, x0, x1)
    band = (y1 - y0) / n
    body = [f'<g class="grid" stroke="{GRID}" stroke-width="1">']
    body += [f'<line x1="{_c(sx(t))}" y1="{_c(y0)}" x2="{_c(sx(t))}" y2="{_c(y1)}"/>' for t in ticks]
    body.append("</g>")
    body.append('<g class="xaxis">')
    body += [_text(sx(t), y1 + 12, lab, size=9, anchor="middle", fill=MUTED)
             for t, lab in zip(ticks, format_ticks(ticks), strict=True)]  # fmt: skip
    body.append("</g>")
    bars, labels = ['<g class="bars">'], ['<g class="labels" font-size="9.5">']
    bh = max(2.0, min(band * 0.72, 18.0))
    for i, cat in enumerate(cats):
        cy = y0 + (i + 0.5) * band
        weight = ' font-weight="700"' if i in bold else ""
        labels.append(_text(x0 - 5, cy + 3.5, _fit(cat, cat_w - 6, 9.5), size=9.5, anchor="end", extra=weight))
        acc = 0.0
        for k, vs in enumerate(values):
            v = vs[i] if i < len(vs) else None
            if v is None or v <= 0 or acc >= hi:
                acc += max(v or 0.0, 0.0)
                continue
            a, b = sx(acc), sx(min(acc + v, hi))
            acc += v
            tip = f"{cat} \u00b7 {legend[k][0]}: {format_number(v, 3)}"
            bars.append(f'<rect x="{_c(a)}" y="{_c(cy - bh / 2)}" width="{_c(max(b - a, 0.3))}" height="{_c(bh)}" '
                        f'fill="{_esc(colors[k])}"><title>{_esc(tip)}</title></rect>')  # fmt: skip
        end = sx(min(acc, hi))
        if acc > hi:  # cut: a white zig-zag says the bar goes on
            top, bot = cy - bh / 2, cy + bh / 2
            bars.append(f'<polyline points="{_c(end - 6)},{_c(top)} {_c(end - 2)},{_c(cy)} {_c(end - 6)},{_c(bot)}" '
                        'fill="none" stroke="#fff" stroke-width="2"/>')  # fmt: skip
        if i < len(texts) and texts[i]:
            tc = _color(text_colors[i], TEXT) if i < len(text_colors) else TEXT
            if end + 4 + _text_w(texts[i], 9) > w - 2:  # no room right of a cut bar: write it inside
                labels.append(_text(end - 10, cy + 3.5, texts[i], size=9, anchor="end", fill="#fff",
                                    extra=weight + ' stroke="' + tc + '" stroke-width="2.5" paint-order="stroke"'))
            else:
                labels.append(_text(end + 4, cy + 3.5, texts[i], size=9, fill=tc, extra=weight))
    bars.append("</g>")
    labels.append("</g>")
    body += bars + labels
    for x, name, color in vls:
        px = sx(x)
        body.append(f'<line x1="{_c(px)}" y1="{_c(y0 - 8)}" x2="{_c(px)}" y2="{_c(y1)}" stroke="{_esc(color)}" '
                    'stroke-width="1.5" stroke-dasharray="5,3"/>')  # fmt: skip
        anchor = "end" if px > (x0 + x1) / 2 else "start"
        dx = -3 if anchor == "end" else 3
        body.append(_text(px + dx, y0 - 2, _fit(name, (x1 - x0) / 2, 9), size=9, anchor=anchor, fill=color))
    if fig.get("x_title"):
        body.append(_text((x0 + x1) / 2, h - 4, str(fig["x_title"]), size=9.5, anchor="middle", fill=MUTED))
    return _finish(fig, frame, body)


# ----------------------------------------------------------------------------------------------------- heatmap


def _heatmap(fig: Figure, w: float, h: float) -> str:
    xs, ys = _list(fig.get("x")), _list(fig.get("y"))
    rows = [_list(r) for r in _list(fig.get("z"))]
    ny = len(ys) or len(rows)
    nx = len(xs) or max((len(r) for r in rows), default=0)
    z = [[_num(rows[j][i]) if j < len(rows) and i < len(rows[j]) else None for i in range(nx)] for j in range(ny)]
    finite = [v for r in z for v in r if v is not None]
    if not nx or not ny or not finite:
        return _note_figure(fig, w, h)
    zmin, zmax = min(finite), max(finite)
    ylabels_txt = [str(v) for v in ys] + [str(j) for j in range(len(ys), ny)]

    xnum = [_num(v) for v in xs]
    numeric = len(xs) == nx and all(v is not None for v in xnum)
    xv = [v for v in xnum if v is not None]
    if numeric and all(b > a for a, b in pairwise(xv)):
        if nx == 1:
            edges = [xv[0] - 0.5, xv[0] + 0.5]
        else:
            mids = [(a + b) / 2 for a, b in pairwise(xv)]
            edges = [xv[0] - (xv[1] - xv[0]) / 2, *mids, xv[-1] + (xv[-1] - xv[-2]) / 2]
        cat_x = False
    else:
        edges, cat_x = [float(i) for i in range(nx + 1)], True

    frame = _begin(fig, w, h, [])
    zlab = [format_number(zmax), format_number(zmin)]
    z_title = str(fig.get("z_title") or "")
    x1 = w - 12 - 10 - 4 - max(_text_w(s, 9) for s in zlab) - (14 if z_title else 0) - 6
    row_lab_w = min(w * 0.3, max(_text_w(s, 9) for s in ylabels_txt))
    x0 = max(28.0, 8 + (14 if fig.get("y_title") else 0) + row_lab_w + 4)
    y0 = frame.top + 6
    x_title_h = 14 if fig.get("x_title") else 0
    sx = _Scale(edges[0], edges[-1], x0, x1)
    if cat_x:
        xcats = [str(v) for v in xs] + [str(i) for i in range(len(xs), nx)]
        band = (x1 - x0) / nx
        centers = [x0 + (i + 0.5) * band for i in range(nx)]
        _, lab_h = _category_labels(xcats, centers, band, 0, h * 0.3)
        y1 = h - lab_h - x_title_h - 2
        xlabels, _ = _category_labels(xcats, centers, band, y1, h * 0.3)
    else:
        y1 = h - 20 - x_title_h
        xticks = _x_ticks(edges[0], edges[-1], x1 - x0)
        xlabels = [_text(sx(t), y1 + 13, s, anchor="middle") for t, s in zip(xticks, format_ticks(xticks), strict=True)]
    row_h = (y1 - y0) / ny

    zr = zmax - zmin
    cells = ['<g class="cells" shape-rendering="crispEdges">']
    for j in range(ny):
        top = y1 - (j + 1) * row_h  # y[0] at the bottom, as Plotly draws it
        for i in range(nx):
            v = z[j][i]
            fill = "none" if v is None else _viridis((v - zmin) / zr if zr > 0 else 0.5)
            left, right = sx(edges[i]), sx(edges[i + 1])
            cells.append(
                f'<rect x="{_c(left)}" y="{_c(top)}" width="{_c(right - left)}" height="{_c(row_h)}" fill="{fill}"/>'
            )
    cells.append("</g>")
    body = cells
    body.append(
        f'<rect x="{_c(x0)}" y="{_c(y0)}" width="{_c(x1 - x0)}" height="{_c(y1 - y0)}" fill="none" stroke="{FRAME}"/>'
    )

    step = max(1, math.ceil(10 / row_h))
    ylab = [
        _text(x0 - 4, y1 - (j + 0.5) * row_h + 3, _fit(ylabels_txt[j], row_lab_w, 9), size=9, anchor="end")
        for j in range(0, ny, step)
    ]
    body += ['<g class="yaxis">', *ylab, "</g>", '<g class="xaxis">', *xlabels, "</g>"]

    cb_x, nstops = x1 + 8, 32
    cb_h = (y1 - y0) / nstops
    cbar = ['<g class="colorbar" shape-rendering="crispEdges">']
    for k in range(nstops):
        cbar.append(
            f'<rect x="{_c(cb_x)}" y="{_c(y1 - (k + 1) * cb_h)}" width="10" height="{_c(cb_h + 0.2)}" '
            f'fill="{_viridis((k + 0.5) / nstops)}"/>'
        )
    cbar.append(_text(cb_x + 13, y0 + 7, zlab[0], size=9))
    cbar.append(_text(cb_x + 13, y1, zlab[1], size=9))
    if z_title:
        tx, cy = w - 8, (y0 + y1) / 2
        cbar.append(
            _text(tx, cy, _fit(z_title, y1 - y0, 9), size=9, anchor="middle", fill=MUTED,
                  extra=f' transform="rotate(-90 {_c(tx)} {_c(cy)})"')
        )  # fmt: skip
    cbar.append("</g>")
    body += cbar + _axis_titles(fig, x0, y0, x1, y1, h)
    return _finish(fig, frame, body)


# ----------------------------------------------------------------------------------------------------- public


def figure_svg(fig: Figure, *, width: int = 420, height: int = 240) -> str:
    """One figure dict as a self-contained ``<svg>`` that scales to its container (``width`` x ``height`` viewBox)."""
    w, h = float(max(width, 120)), float(max(height, 90))
    kind = fig.get("kind", "line")
    if kind == "line":
        return _line(fig, w, h)
    if kind == "bar":
        return _bar(fig, w, h)
    if kind == "heatmap":
        return _heatmap(fig, w, h)
    if kind == "hbar":
        return _hbar(fig, w, h)
    return _note_figure(fig, w, h, f"unsupported figure kind {kind!r}")


def dashboard_html(figures: Sequence[Figure], *, header_html: str = "", columns_min_px: int = 360) -> str:
    """The figures in a responsive CSS grid, after ``header_html`` (trusted markup, inserted as is)."""
    cells = "".join(f'<div style="min-width:0">{figure_svg(f)}</div>' for f in figures)
    cols = max(1, int(columns_min_px))
    return (
        f'<div class="jd-static-dashboard" style="font-family:{FONT};color:{TEXT};max-width:100%">{header_html}'
        f'<div style="display:grid;grid-template-columns:repeat(auto-fill, minmax({cols}px, 1fr));gap:8px">'
        f"{cells}</div></div>"
    )
