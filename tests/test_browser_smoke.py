"""Smoke test of the browser infrastructure: ipywidgets and anywidget render in JupyterLab in Chromium, and a
change made in the page reaches the kernel and comes back."""

from __future__ import annotations

from pathlib import Path

import pytest
from browser import JupyterLabServer, cell_locator, open_notebook_and_run_all, screenshot_cell, write_notebook

DEFINE = '''
import anywidget
import ipywidgets as widgets
import traitlets


class Hello(anywidget.AnyWidget):
    _esm = """
    function render({ model, el }) {
      const div = document.createElement("div");
      div.className = "jd-hello";
      const draw = () => { div.textContent = `hello ${model.get("value")}`; };
      draw();
      model.on("change:value", draw);
      el.appendChild(div);
    }
    export default { render };
    """
    value = traitlets.Int(42).tag(sync=True)


slider = widgets.IntSlider(value=3, description="jd slider")
hello = Hello()
# the round trip: the page moves the slider, the kernel sees it and updates the anywidget, the page redraws it
slider.observe(lambda change: setattr(hello, "value", change["new"] * 100), names="value")
'''


@pytest.mark.browser
@pytest.mark.slow
def test_widgets_render_and_round_trip(jupyterlab: JupyterLabServer, browser_page, artifacts: Path) -> None:
    from playwright.sync_api import expect

    page = browser_page
    write_notebook(jupyterlab.root_dir / "smoke.ipynb", [DEFINE, "slider", "hello"])
    open_notebook_and_run_all(page, jupyterlab, "smoke.ipynb", timeout=60)

    slider_cell = cell_locator(page, 1)
    expect(slider_cell.locator(".widget-slider")).to_be_visible()
    expect(slider_cell.locator(".widget-readout")).to_have_text("3")
    hello = cell_locator(page, 2).locator(".jd-hello")
    expect(hello).to_have_text("hello 42")
    screenshot_cell(page, 2, artifacts / "anywidget.png")

    # page -> kernel -> page: a key press moves the slider; the kernel's observer sets the anywidget's trait
    slider_cell = cell_locator(page, 1)
    slider_cell.locator(".noUi-handle").focus()
    page.keyboard.press("ArrowRight")
    expect(slider_cell.locator(".widget-readout")).to_have_text("4")
    expect(cell_locator(page, 2).locator(".jd-hello")).to_have_text("hello 400")
    screenshot_cell(page, 1, artifacts / "slider.png")
    screenshot_cell(page, 2, artifacts / "anywidget-after.png")
