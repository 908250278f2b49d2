"""Rank 0's prints under a %%dist_train cell in a real JupyterLab in headless Chromium: they appear while the run
goes, under that cell (not under the cell the kernel runs when they arrive), prefixed, in order, without the
telemetry records and without rank 1's lines."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from browser import JupyterLabServer, cell_locator, open_notebook, wait_for_kernel_idle, write_notebook

TRAIN = """%%dist_train --nproc 2 --strategy none --name r --timeout 240
import os, time
if jd.rank == 0:
    print("hello from rank 0")
    print("@@JD@@" + '{"v": 1, "kind": "hb", "rank": 0, "seq": 99999, "t": 0}')
    while not os.path.exists(GO):  # the test lets the rank go on once it saw the first line in the page
        time.sleep(0.05)
    for i in range(3):
        print(f"after go {i}")
else:
    print("hello from rank 1")
"""

# the kernel runs this cell while rank 0's later lines arrive: they must still land under the %%dist_train cell
WAIT = 'status = r.wait()\nprint("cell two saw", status)'

OUTPUT_TEXT = """(el) => [...el.querySelectorAll('.jp-OutputArea-output')].map(o => o.innerText).join('\\n')"""

PANELS_FIRST = """(el) => {
  const dash = el.querySelector('.jd-dash, .jd-static-dashboard');
  const out = [...el.querySelectorAll('.jp-OutputArea-output')].find(o => o.innerText.includes('[rank0]'));
  return !!(dash && out && (dash.compareDocumentPosition(out) & Node.DOCUMENT_POSITION_FOLLOWING));
}"""


def shot(cell: Any, path: Path) -> None:
    """A picture of the cell's rank output (the cell itself is taller than the page, with the panels above it)."""
    out = cell.locator(".jp-OutputArea-output", has_text="[rank0]").first
    out.scroll_into_view_if_needed()
    out.screenshot(path=str(path), animations="disabled")


@pytest.mark.browser
@pytest.mark.slow
def test_rank_0_prints_appear_under_the_dist_train_cell_while_it_runs(
    jupyterlab: JupyterLabServer, browser_page: Any, artifacts: Path
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    go = jupyterlab.root_dir / "go-output"
    write_notebook(jupyterlab.root_dir / "out.ipynb",
                   ["%load_ext jupyter_dist", TRAIN.replace("GO", repr(str(go))), WAIT])  # fmt: skip
    open_notebook(page, jupyterlab, "out.ipynb", timeout=90)
    # run every cell without waiting: the second cell blocks in r.wait() until the test lets rank 0 finish
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    train = cell_locator(page, 1)
    t0 = time.monotonic()
    expect(train).to_contain_text("[rank0] hello from rank 0", timeout=120_000)
    seen_after = time.monotonic() - t0
    assert not go.exists()  # rank 0 is still waiting: the line came while the run goes
    shot(train, artifacts / "output-live.png")
    go.touch()
    expect(train).to_contain_text("[rank0] after go 2", timeout=60_000)
    waiting = cell_locator(page, 2)
    expect(waiting).to_contain_text("cell two saw succeeded", timeout=60_000)
    wait_for_kernel_idle(page, "out.ipynb", timeout=60)
    train = cell_locator(page, 1)
    text = train.evaluate(OUTPUT_TEXT)
    lines = [ln for ln in text.splitlines() if ln.startswith("[rank")]
    assert lines == ["[rank0] hello from rank 0", *(f"[rank0] after go {i}" for i in range(3))], text
    assert "@@JD@@" not in text and "hello from rank 1" not in text
    assert "[rank0]" not in cell_locator(page, 2).evaluate(OUTPUT_TEXT)  # nothing went to the cell that ran then
    assert cell_locator(page, 1).evaluate(PANELS_FIRST), "the prints should come below the panels"
    shot(cell_locator(page, 1), artifacts / "output-final.png")
    (artifacts / "timing.txt").write_text(f"first rank-0 line in the page {seen_after:.1f} s after run-all\n")
