"""The live dashboard in a real JupyterLab in headless Chromium: a 2-process CPU run started with %%dist_train,
its panels drawn by plotly.js, growing while the run goes on, and static SVG panels once it has ended."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from browser import JupyterLabServer, cell_locator, open_notebook_and_run_all, screenshot_cell, write_notebook

TRAIN = """%%dist_train --nproc 2 --strategy ddp --name r --heartbeat 0.5 --telemetry-interval 0.25 --timeout 240
import time
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = jd.wrap(model, opt)
X, y = torch.randn(256, 16), torch.randn(256, 1)
for step in range(400):
    loss = torch.nn.functional.mse_loss(model(X), y)
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss, tokens=256)
    time.sleep(0.04)
"""

POINTS = """(el) => {
  const div = el.querySelector('.jd-panel[data-figure="loss"]');
  if (!div || !div.data) return -1;
  return div.data.reduce((n, t) => n + (t.x ? t.x.length : 0), 0);
}"""


TRACE_SHAPES = """(el) => {
  const out = [];
  for (const id of ["loss", "throughput", "comm"]) {
    const div = el.querySelector(`.jd-panel[data-figure="${id}"]`);
    if (!div || !div.data) continue;
    div.data.forEach((t, i) => {
      const x = Array.from(t.x || []);
      out.push({fig: id, trace: i, nx: x.length, ny: (t.y || []).length,
                sorted: x.every((v, k) => k === 0 || v >= x[k - 1])});
    });
  }
  return out;
}"""


@pytest.mark.browser
@pytest.mark.slow
def test_live_panels_render_update_and_turn_static(jupyterlab: JupyterLabServer, browser_page: Any,
                                                   artifacts: Path) -> None:  # fmt: skip
    from playwright.sync_api import expect

    page = browser_page
    write_notebook(jupyterlab.root_dir / "dash.ipynb", ["%load_ext jupyter_dist", TRAIN])
    t0 = time.monotonic()
    open_notebook_and_run_all(page, jupyterlab, "dash.ipynb", timeout=90)
    dash = cell_locator(page, 1).locator(".jd-dash")
    expect(dash).to_have_attribute("data-ready", "1", timeout=60_000)  # plotly.js loaded from the kernel, drawn
    appeared = time.monotonic() - t0
    for fig in ("loss", "throughput", "memory", "heartbeat"):
        expect(dash.locator(f'.jd-panel[data-figure="{fig}"] .main-svg').first).to_be_attached()

    # live: the loss traces grow while the ranks train (points arrive as extendTraces batches)
    deadline = time.monotonic() + 60
    first = dash.evaluate(POINTS)
    while first <= 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        first = dash.evaluate(POINTS)
    assert first > 0, "no loss points reached the page"
    later = first
    while later <= first and time.monotonic() < deadline:
        time.sleep(0.5)
        later = dash.evaluate(POINTS)
    assert later > first, f"the loss panel did not grow ({first} points)"
    expect(dash.locator(".jd-status-wrap")).to_contain_text("ranks alive")
    screenshot_cell(page, 1, artifacts / "dashboard-live.png")
    # later in the run, the whole cell at a desktop size (the README's screenshot)
    while dash.evaluate(POINTS) < 100 and time.monotonic() < deadline:
        time.sleep(0.5)
    # what Plotly draws is what the kernel sent: as many x as y in every trace, x increasing (no zig-zags)
    shapes = dash.evaluate(TRACE_SHAPES)
    assert shapes and all(s["nx"] == s["ny"] and s["sorted"] for s in shapes), shapes
    page.set_viewport_size({"width": 1280, "height": 1500})
    screenshot_cell(page, 1, artifacts / "dashboard-readme.png")
    assert int(dash.get_attribute("data-extends") or 0) > 0

    # the run ends: the live widget is replaced by static SVG panels (what a saved notebook keeps)
    static = cell_locator(page, 1).locator(".jd-static-dashboard svg, svg").first
    expect(static).to_be_attached(timeout=120_000)
    expect(cell_locator(page, 1)).to_contain_text("succeeded", timeout=30_000)
    screenshot_cell(page, 1, artifacts / "dashboard-final.png")
    (artifacts / "timing.txt").write_text(f"panels ready {appeared:.1f} s after opening the notebook\n")
