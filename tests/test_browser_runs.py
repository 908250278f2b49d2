"""The runs table and a comparison in a real JupyterLab in headless Chromium.

The notebook writes three run directories record by record with the telemetry encoder (the rendering is what is
tested here; real 2-process runs feed the same table and comparison in tests/test_compare_profile.py), then shows
``%dist_runs`` (the widget: filter, sort, choose, compare, open a run's panels) and ``jupyter_dist.compare(...)``
(static SVG panels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from browser import JupyterLabServer, cell_locator, open_notebook_and_run_all, screenshot_cell, write_notebook

MAKE_RUNS = """import json, pathlib
from jupyter_dist.telemetry.records import encode, make_record
from jupyter_dist.telemetry.summary import write_summary
root = pathlib.Path("runs")
for i, strategy in enumerate(["ddp", "fsdp2", "zero2"]):
    d = root / f"{strategy}-run-2026112{i}"
    (d / "telemetry").mkdir(parents=True, exist_ok=True)
    t0 = 1.79e9 + 100 * i
    (d / "run.json").write_text(json.dumps({"status": "succeeded", "strategy": strategy, "candidate": strategy,
        "world_size": 2, "notes": ["2 ranks: dp 2"], "started": t0, "ended": t0 + 30}))
    for r in range(2):
        recs = [make_record("step", rank=r, seq=s, t=t0 + s, step=s, loss=(1 + i) / (1 + s), step_time=0.5,
                            tokens_per_s=1000.0 * (i + 1)) for s in range(30)]
        recs.append(make_record("mem", rank=r, seq=99, t=t0 + 10, max_rss=(i + 1) * 2**30))
        (d / "telemetry" / f"rank-{r}.jsonl").write_text("\\n".join(map(encode, recs)) + "\\n")
    write_summary(d)
"""

ROWS = "(el) => el.querySelectorAll('.jd-runs-table tbody tr').length"


@pytest.mark.browser
@pytest.mark.slow
def test_runs_table_and_comparison_render(jupyterlab: JupyterLabServer, browser_page: Any, artifacts: Path) -> None:
    from playwright.sync_api import expect

    page = browser_page
    cells = [
        "%load_ext jupyter_dist",
        MAKE_RUNS,
        "%dist_runs runs",
        "import jupyter_dist\njupyter_dist.compare(*jupyter_dist.runs('runs').filter(strategy=['ddp', 'fsdp2']))",
    ]
    write_notebook(jupyterlab.root_dir / "runs.ipynb", cells)
    open_notebook_and_run_all(page, jupyterlab, "runs.ipynb", timeout=120)

    # the comparison: three static SVG panels, one trace per run, both runs named
    cmp = cell_locator(page, 3).locator(".jd-compare")
    expect(cmp).to_be_attached(timeout=30_000)
    assert cmp.locator("svg").count() == 3
    expect(cmp).to_contain_text("ddp-run-20261120")
    expect(cmp).to_contain_text("fsdp2-run-20261121")
    assert cmp.locator("svg").first.locator("path, polyline").count() >= 2  # two loss curves
    screenshot_cell(page, 3, artifacts / "compare.png")

    # the table widget: three rows; the filter box narrows them; "compare" overlays the chosen runs
    box = cell_locator(page, 2).locator(".jd-runs-widget")
    expect(box).to_be_attached(timeout=30_000)
    assert box.evaluate(ROWS) == 3
    expect(box.locator(".jd-runs-table")).to_contain_text("tokens/s")
    screenshot_cell(page, 2, artifacts / "runs-table.png")
    box.locator("input[type=text]").first.fill("fsdp2")
    box.locator("input[type=text]").first.press("Enter")
    page.wait_for_function("() => document.querySelectorAll('.jd-runs-widget .jd-runs-table tbody tr').length === 1")
    box.locator("select").last.select_option(["fsdp2-run-20261121"])
    box.get_by_role("button", name="compare").click()
    expect(box.locator(".jd-compare svg").first).to_be_attached(timeout=30_000)
    expect(box.locator(".jd-compare")).to_contain_text("fsdp2-run-20261121")
    screenshot_cell(page, 2, artifacts / "runs-table-compare.png")
    # "open panels": the chosen run's dashboard (plotly.js from the kernel) under the table
    box.get_by_role("button", name="open panels").click()
    dash = box.locator(".jd-dash")
    expect(dash).to_have_attribute("data-ready", "1", timeout=60_000)
    expect(dash.locator('.jd-panel[data-figure="loss"] .main-svg').first).to_be_attached()
    screenshot_cell(page, 2, artifacts / "runs-table-open.png")
