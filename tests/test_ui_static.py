"""The static (kernel-free) SVG/HTML renderer of the panel figures: structure, geometry, axes and escaping."""

from __future__ import annotations

import math
import random
import re
import xml.etree.ElementTree as ET
from typing import Any

import pytest

from jupyter_dist.ui.figures import PALETTE
from jupyter_dist.ui.static import (
    VIRIDIS,
    dashboard_html,
    figure_svg,
    format_number,
    format_ticks,
    log_ticks,
    nice_ticks,
)

NS = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{NS}svg"
    return root


def group(root: ET.Element, cls: str) -> ET.Element:
    found = [g for g in root.iter(f"{NS}g") if g.get("class") == cls]
    assert len(found) == 1, f"expected one <g class={cls!r}>, found {len(found)}"
    return found[0]


def texts(el: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in el.iter(f"{NS}text")]


def points(pl: ET.Element) -> list[tuple[float, float]]:
    out = []
    for pair in (pl.get("points") or "").split():
        x, y = pair.split(",")
        out.append((float(x), float(y)))
    return out


def polylines(root: ET.Element) -> list[list[tuple[float, float]]]:
    return [points(pl) for pl in group(root, "traces").iter(f"{NS}polyline")]


def parse_label(s: str) -> float:
    mult = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(s[:-1]) * mult[s[-1]] if s[-1] in mult else float(s)


def is_nice_step(step: float) -> bool:
    mant = step / 10 ** math.floor(math.log10(step) + 1e-9)
    return any(math.isclose(mant, m, rel_tol=1e-6) for m in (1, 2, 5, 10))


def line_fig(*traces: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"id": "f", "kind": "line", "title": "T", "x_title": "step", "y_title": "loss", "traces": list(traces), **kw}


# ----------------------------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (1500, "1.5k"),
        (2_000_000, "2M"),
        (3.2e9, "3.2G"),
        (0.001, "1e-3"),
        (0.00025, "2.5e-4"),
        (0.25, "0.25"),
        (12.345, "12.3"),
        (-1500, "-1.5k"),
        (999.96, "1k"),
        (1e16, "1e16"),
    ],
)
def test_format_number(value: float, text: str) -> None:
    assert format_number(value) == text


def test_format_ticks_are_distinct_and_consistent() -> None:
    assert format_ticks([0, 0.005, 0.01, 0.015]) == ["0", "0.005", "0.01", "0.015"]
    assert format_ticks([0, 500, 1000, 1500]) == ["0", "500", "1k", "1.5k"]
    assert format_ticks([2000, 2005, 2010]) == ["2k", "2.005k", "2.01k"]
    assert format_ticks([0, 2e-4, 4e-4]) == ["0", "2e-4", "4e-4"]
    assert format_ticks([1e-4, 1e-2, 1, 100], log=True) == ["1e-4", "0.01", "1", "100"]


def test_nice_ticks_use_1_2_5_steps_and_cover_the_range() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        lo = rng.uniform(-1, 1) * 10 ** rng.uniform(-6, 9)
        hi = lo + max(abs(rng.gauss(0, 1)) * 10 ** rng.uniform(-6, 9), abs(lo) * 1e-6)  # spans floats can resolve
        for expand in (True, False):
            ticks = nice_ticks(lo, hi, expand=expand)
            assert 3 <= len(ticks) <= 7, (lo, hi, ticks)
            steps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
            step = float(f"{steps[0]:.6g}")  # differences of large floats are inexact
            assert all(math.isclose(s, step, rel_tol=1e-6) for s in steps)
            assert is_nice_step(step)
            assert all(math.isclose(t / step, round(t / step), rel_tol=1e-9, abs_tol=1e-6) for t in ticks)
            if expand:
                assert ticks[0] <= lo + 1e-6 * step and ticks[-1] >= hi - 1e-6 * step
            else:
                assert lo - 1e-6 * step <= ticks[0] and ticks[-1] <= hi + 1e-6 * step
    assert nice_ticks(0, 1, expand=True) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]  # exact decimals, no 0.6000000000000001
    assert len(nice_ticks(5, 5)) >= 3  # equal bounds are widened


def test_log_ticks() -> None:
    assert log_ticks(1e-5, 1e2) == [1e-4, 1e-2, 1.0, 100.0]
    assert log_ticks(0.5, 5e3) == [1.0, 10.0, 100.0, 1000.0]
    assert log_ticks(0.3, 3.3) == [0.5, 1.0, 2.0]  # one decade: 1-2-5
    ticks = log_ticks(2.1, 2.3)  # narrower: linear nice ticks inside
    assert len(ticks) >= 2 and all(2.1 <= t <= 2.3 for t in ticks)


# ----------------------------------------------------------------------------------------------------- line


def test_line_polyline_points_map_monotonically() -> None:
    n = 50
    root = parse(figure_svg(line_fig({"name": "a", "x": list(range(n)), "y": [i * i for i in range(n)]})))
    (pts,) = polylines(root)
    assert len(pts) == n
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    assert all(b > a for a, b in zip(xs, xs[1:], strict=False))  # larger x further right
    assert all(b < a for a, b in zip(ys[1:], ys[2:], strict=False))  # larger y drawn higher
    # every coordinate is inside the viewBox and rounded to one decimal
    _, _, w, h = map(float, (root.get("viewBox") or "").split())
    assert all(0 <= x <= w and 0 <= y <= h for x, y in pts)
    assert all(
        re.fullmatch(r"-?\d+(\.\d)?", c)
        for pair in root.iter(f"{NS}polyline")
        for c in re.split(r"[ ,]", pair.get("points", ""))
    )


def test_none_splits_a_line_and_nan_inf_are_skipped() -> None:
    y: list[Any] = [1.0, 2.0, float("nan"), 3.0, None, 4.0, float("inf"), 5.0, 6.0, None, 7.0]
    root = parse(figure_svg(line_fig({"name": "a", "x": list(range(len(y))), "y": y})))
    assert [len(p) for p in polylines(root)] == [3, 3]  # [1, 2, 3] and [4, 5, 6]; NaN/inf dropped, not a break
    circles = list(group(root, "traces").iter(f"{NS}circle"))
    assert len(circles) == 1  # the lone 7.0 after the last gap is a dot
    first, second = polylines(root)
    assert first[-1][0] < second[0][0]


def test_trace_style_and_legend() -> None:
    fig = line_fig(
        {"name": "rank 0", "y": [1, 2, 3], "color": "#123456", "width": 2.5, "dash": "dot", "opacity": 0.5},
        {"name": "rank 1", "y": [3, 2, 1]},
        hlines=[{"y": 2.5, "name": "plan", "color": "#888", "dash": "dash"}],
    )
    root = parse(figure_svg(fig))
    traces = [g for g in group(root, "traces") if g.get("class") == "trace"]
    assert traces[0].get("stroke") == "#123456" and traces[0].get("stroke-width") == "2.5"
    assert traces[0].get("stroke-dasharray") and traces[0].get("stroke-opacity") == "0.50"
    assert traces[1].get("stroke") == PALETTE[1] and traces[1].get("stroke-dasharray") is None
    assert texts(group(root, "legend")) == ["rank 0", "rank 1"]
    hl = group(root, "hlines")
    (line,) = hl.iter(f"{NS}line")
    assert line.get("stroke-dasharray") and texts(hl) == ["plan"]
    # the hline sits between the pixel rows of y=2 and y=3
    ys = sorted({y for pl in polylines(root) for _, y in pl})
    y_hl = float(line.get("y1") or "nan")
    assert ys[0] < y_hl < ys[1]


def test_legend_is_capped_with_more() -> None:
    fig = line_fig(*({"name": f"r{i}", "y": [i, i + 1]} for i in range(20)))
    legend = texts(group(parse(figure_svg(fig)), "legend"))
    assert len(legend) <= 9 and legend[-1].startswith("+") and legend[-1].endswith("more")
    assert int(legend[-1].split()[0][1:]) + len(legend) - 1 == 20


def test_y_axis_ticks_are_nice_and_cover_the_data() -> None:
    root = parse(figure_svg(line_fig({"name": "a", "y": [0.37, 2.91, 1.4]})))
    labels = [parse_label(s) for s in texts(group(root, "yaxis"))]
    assert 3 <= len(labels) <= 7
    step = labels[1] - labels[0]
    assert is_nice_step(step) and labels[0] <= 0.37 and labels[-1] >= 2.91
    xlabels = [parse_label(s) for s in texts(group(root, "xaxis"))]
    assert xlabels[0] == 0 and is_nice_step(xlabels[1] - xlabels[0])


def test_log_axis_ticks_are_powers_of_ten() -> None:
    y = [10 ** (-5 + 7 * i / 99) for i in range(100)]
    y[10] = 0.0  # not drawable on a log axis: skipped
    root = parse(figure_svg(line_fig({"name": "a", "y": y}, y_log=True)))
    labels = [parse_label(s) for s in texts(group(root, "yaxis"))]
    assert len(labels) >= 3
    assert all(math.isclose(math.log10(v), round(math.log10(v)), abs_tol=1e-9) for v in labels)
    (pts,) = polylines(root)
    assert len(pts) == 99
    ys = [p[1] for p in pts]
    assert all(b < a for a, b in zip(ys, ys[1:], strict=False))
    # equal ratios are equal distances on a log axis (the skipped point leaves one double step)
    d = sorted(a - b for a, b in zip(ys, ys[1:], strict=False))
    assert d[-2] - d[0] < 0.25 and d[-1] == pytest.approx(2 * d[0], abs=0.3)


def test_all_equal_single_point_and_mismatched_lengths_render() -> None:
    for fig in (
        line_fig({"name": "a", "y": [3.0] * 10}),
        line_fig({"name": "a", "x": [5], "y": [7]}),
        line_fig({"name": "a", "x": [1, 2, 3, 4], "y": [1, 2]}),
        line_fig({"name": "a", "y": [0, 0, 0]}, y_log=True, note="nothing positive"),
    ):
        svg = figure_svg(fig)
        root = parse(svg)
        assert "nan" not in svg and "inf" not in svg
        assert len(texts(root)) >= 2
    assert len(polylines(parse(figure_svg(line_fig({"name": "a", "y": [3.0] * 10}))))[0]) == 10
    one = parse(figure_svg(line_fig({"name": "a", "x": [5], "y": [7]})))
    assert not polylines(one) and len(list(group(one, "traces").iter(f"{NS}circle"))) == 1


def test_long_traces_stay_small_and_keep_extremes() -> None:
    rng = random.Random(1)
    traces = []
    for r in range(10):
        v, ys = 2.0, []
        for _ in range(2000):
            v += rng.gauss(0, 0.05)
            ys.append(v)
        traces.append({"name": f"rank {r}", "x": list(range(2000)), "y": ys})
    traces[0]["y"][1234] = 50.0  # a spike must survive the per-pixel reduction
    svg = figure_svg(line_fig(*traces))
    assert len(svg.encode()) < 150_000
    root = parse(svg)
    lines = polylines(root)
    assert len(lines) == 10 and all(len(p) <= 2 * 420 for p in lines)
    top = min(y for pts in lines for _, y in pts)
    assert min(y for _, y in lines[0]) == top  # the spike is the highest point drawn
    assert figure_svg(line_fig(*traces)) == svg  # deterministic


# ----------------------------------------------------------------------------------------------------- bar


def test_grouped_bars_with_per_category_colors_and_labels() -> None:
    fig = {
        "id": "phase",
        "kind": "bar",
        "title": "Phase",
        "y_title": "s",
        "categories": ["forward", "backward", "optimizer"],
        "series": [{"name": "time", "values": [0.1, 0.3, None], "color": "#1f77b4"}],
        "bar_colors": ["#2e7d32", "#c62828", "#1565c0"],
        "labels": ["fwd", "bwd", "opt"],
    }
    root = parse(figure_svg(fig))
    rects = list(group(root, "bars").iter(f"{NS}rect"))
    assert [r.get("fill") for r in rects] == ["#2e7d32", "#c62828"]  # None draws no bar
    assert float(rects[1].get("height") or 0) == pytest.approx(3 * float(rects[0].get("height") or 0), rel=0.02)
    assert texts(group(root, "labels")) == ["fwd", "bwd"]
    assert texts(group(root, "xaxis")) == ["forward", "backward", "optimizer"]

    two = {**fig, "bar_colors": None, "labels": None}
    two["series"] = [{"name": "a", "values": [1, 2, 3]}, {"name": "b", "values": [3, 2, -1], "color": "#ff0000"}]
    root = parse(figure_svg(two))
    rects = list(group(root, "bars").iter(f"{NS}rect"))
    assert [r.get("fill") for r in rects] == [PALETTE[0], "#ff0000"] * 3
    xs = [float(r.get("x") or 0) for r in rects]
    assert xs == sorted(xs)  # grouped: a, b side by side in each category
    assert texts(group(root, "legend")) == ["a", "b"]
    neg = rects[-1]  # the negative bar hangs below the zero line
    assert float(neg.get("y") or 0) == pytest.approx(
        float(rects[0].get("y") or 0) + float(rects[0].get("height") or 0), abs=0.2
    )


def test_many_categories_are_thinned_and_rotated() -> None:
    fig = {
        "kind": "bar",
        "title": "Step time per rank",
        "categories": [f"rank {i}" for i in range(64)],
        "series": [{"name": "s", "values": [1 + i / 64 for i in range(64)]}],
    }
    root = parse(figure_svg(fig))
    assert len(list(group(root, "bars").iter(f"{NS}rect"))) == 64
    labels = list(group(root, "xaxis").iter(f"{NS}text"))
    assert 4 <= len(labels) < 64 and labels[0].text == "rank 0"
    assert all("rotate(" in (t.get("transform") or "") for t in labels)


# ----------------------------------------------------------------------------------------------------- heatmap


def test_heatmap_cells_colour_bar_and_min_max() -> None:
    x = [0.5 * i for i in range(12)]
    y = [f"rank {j}" for j in range(5)]
    z: list[list[Any]] = [[float(i + 10 * j) for i in range(12)] for j in range(5)]
    z[2][3] = None
    fig = {
        "kind": "heatmap",
        "title": "Comm",
        "x_title": "time (s)",
        "y_title": "rank",
        "x": x,
        "y": y,
        "z": z,
        "z_title": "s",
    }
    root = parse(figure_svg(fig))
    cells = list(group(root, "cells").iter(f"{NS}rect"))
    assert len(cells) == len(x) * len(y)
    fills = [c.get("fill") for c in cells]
    assert fills[0] == VIRIDIS[0] and fills[-1] == VIRIDIS[-1]  # z min and z max
    assert fills.count("none") == 1
    # row 0 (y[0]) is at the bottom; columns go left to right
    assert float(cells[0].get("y") or 0) > float(cells[12].get("y") or 0)
    assert float(cells[0].get("x") or 0) < float(cells[1].get("x") or 0)
    cbar = group(root, "colorbar")
    assert len(list(cbar.iter(f"{NS}rect"))) >= 8
    assert "0" in texts(cbar) and "51" in texts(cbar)
    assert set(texts(group(root, "yaxis"))) <= set(y)


def test_heatmap_with_categorical_x_and_ragged_rows() -> None:
    fig = {"kind": "heatmap", "title": "H", "x": ["fwd", "bwd", "opt"], "y": ["a", "b"], "z": [[1, 2, 3], [4]]}
    root = parse(figure_svg(fig))
    assert len(list(group(root, "cells").iter(f"{NS}rect"))) == 6
    assert texts(group(root, "xaxis")) == ["fwd", "bwd", "opt"]


# ----------------------------------------------------------------------------------------------- empty, escaping, page


@pytest.mark.parametrize(
    "fig",
    [
        {"kind": "line", "title": "Loss", "traces": [], "note": "waiting for step 1"},
        {"kind": "line", "title": "Loss", "traces": [{"name": "a", "x": [], "y": []}], "note": "waiting for step 1"},
        {"kind": "line", "title": "Loss", "traces": [{"y": [None, float("nan")]}], "note": "waiting for step 1"},
        {
            "kind": "bar",
            "title": "Mem",
            "categories": ["rank 0"],
            "series": [{"values": [None]}],
            "note": "waiting for step 1",
        },
        {"kind": "heatmap", "title": "Comm", "x": [], "y": [], "z": [], "note": "waiting for step 1"},
    ],
)
def test_empty_figures_show_the_note(fig: dict[str, Any]) -> None:
    root = parse(figure_svg(fig))
    assert texts(group(root, "note")) == ["waiting for step 1"]
    assert (
        not list(root.iter(f"{NS}polyline")) and "Loss" in texts(root) or "Mem" in texts(root) or "Comm" in texts(root)
    )
    no_note = {k: v for k, v in fig.items() if k != "note"}
    assert texts(group(parse(figure_svg(no_note)), "note")) == ["no data yet"]


def test_user_strings_are_escaped() -> None:
    evil = '<script>alert("x")</script>&'
    figs = [
        line_fig(
            {"name": evil, "y": [1, 2], "color": 'red" onload="alert(1)'},
            {"name": "b", "y": [2, 1]},
            title=evil,
            x_title=evil,
            y_title=evil,
            hlines=[{"y": 1.5, "name": evil}],
        ),
        {
            "kind": "bar",
            "title": "b",
            "categories": [evil],
            "series": [{"name": evil, "values": [1]}],
            "labels": [evil],
        },
        {"kind": "heatmap", "title": "h", "x": [evil], "y": [evil], "z": [[1]], "z_title": evil},
        {"kind": "line", "title": evil, "traces": [], "note": evil + "\x00\x07"},
    ]
    for fig in figs:
        svg = figure_svg(fig)
        assert "<script" not in svg and "onload=" not in svg
        root = parse(svg)  # control characters are dropped: still well-formed XML
        assert any(evil[:20] in t for t in texts(root)) or any(
            evil in (el.text or "") for el in root.iter(f"{NS}title")
        )
    line = parse(figure_svg(figs[0]))
    trace = next(g for g in line.iter(f"{NS}g") if g.get("class") == "trace")
    assert trace.get("stroke") == PALETTE[0]  # an invalid colour falls back to the palette


def test_svg_is_self_contained_and_responsive() -> None:
    svg = figure_svg(line_fig({"name": "a", "y": [1, 2, 3]}), width=500, height=300)
    root = parse(svg)
    assert root.get("viewBox") == "0 0 500 300" and root.get("width") == "100%"
    assert "max-width:100%" in (root.get("style") or "") and "height:auto" in (root.get("style") or "")
    assert root.get("height") is None
    lowered = svg.lower()
    assert "<script" not in lowered and "<style" not in lowered and "href" not in lowered
    assert "http" not in lowered.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_dashboard_html_grid_header_and_figures() -> None:
    figs = [
        line_fig({"name": "a", "y": [1, 2]}),
        {"kind": "bar", "title": "b", "categories": ["x"], "series": [{"values": [1]}]},
        {"kind": "heatmap", "title": "h", "x": [0, 1], "y": ["r0"], "z": [[1, 2]]},
        {"kind": "line", "title": "empty", "traces": []},
    ]
    page = dashboard_html(figs, header_html="<h3 class='hdr'>Run <b>done</b></h3>", columns_min_px=300)
    assert "grid-template-columns:repeat(auto-fill, minmax(300px, 1fr))" in page
    assert "<h3 class='hdr'>Run <b>done</b></h3>" in page  # trusted: not escaped
    root = ET.fromstring(page)  # the whole block is well-formed (given a well-formed header)
    assert root.tag == "div"
    assert page.index("<h3") < page.index("<svg")
    svgs = list(root.iter(f"{NS}svg"))
    assert len(svgs) == 4
    assert dashboard_html([]).startswith("<div")
