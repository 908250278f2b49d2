"""The runs table as a widget: filter text, sort column, the table, and buttons that open or compare runs.

Controls + one ``Output`` + one handler (CONVENTIONS 10): every change re-renders the table from the pure
:class:`~jupyter_dist.launch.runs.RunTable` (``filter(text=...)`` then ``sort(...)``, by a column or a
hyperparameter, ``hp.<name>``); "open" shows the chosen run's panels under the table, "compare" overlays the chosen
runs (:func:`jupyter_dist.ui.compare.compare`).
"""

from __future__ import annotations

from typing import Any

from ..errors import MissingDependencyError

__all__ = ["RunsWidget"]

SORT_CHOICES = ("started", "name", "status", "steps", "last_loss", "best_loss", "throughput", "peak_mem_max",
                "duration", "restarts", "strategy")  # fmt: skip


def RunsWidget(table: Any) -> Any:  # noqa: N802 - a widget factory, named like the class it returns
    """An ipywidgets ``VBox`` over ``table`` (a :class:`~jupyter_dist.launch.runs.RunTable`)."""
    try:
        import ipywidgets as w
    except ImportError:
        raise MissingDependencyError('the runs widget needs ipywidgets: pip install "jupyter-dist[notebook]"') from None

    text = w.Text(placeholder="filter: name, strategy, status, tag, lr=0.001 ...", description="filter",
                  layout=w.Layout(width="320px"))  # fmt: skip
    hp = tuple(f"hp.{k}" for k in table.hparam_names)  # every hyperparameter is a column too
    sort = w.Dropdown(options=SORT_CHOICES + hp, value="started", description="sort by",
                      layout=w.Layout(width="240px"))  # fmt: skip
    desc = w.Checkbox(value=True, description="descending", indent=False, layout=w.Layout(width="110px"))
    pick = w.SelectMultiple(options=[r.name for r in table], rows=min(6, max(2, len(table))), description="runs",
                            layout=w.Layout(width="520px"))  # fmt: skip
    open_btn = w.Button(description="open panels", tooltip="show the first chosen run's panels")
    cmp_btn = w.Button(description="compare", tooltip="overlay the chosen runs")
    grid = w.HTML(table.html())
    out = w.Output()
    box = w.VBox([w.HBox([text, sort, desc]), grid, w.HBox([pick, w.VBox([open_btn, cmp_btn])]), out])
    box.add_class("jd-runs-widget")
    box.table = table

    def current() -> Any:
        shown = table.filter(text=text.value) if text.value.strip() else table
        return shown.sort(sort.value, descending=desc.value)

    def render(_change: Any = None) -> None:
        try:
            shown = current()
            grid.value = shown.html()
            pick.options = [r.name for r in shown]
            box.shown = shown
        except Exception:
            from IPython import get_ipython

            ip = get_ipython()
            if ip is not None:
                ip.showtraceback()

    def on_open(_b: Any) -> None:
        with out:
            out.clear_output(wait=True)
            if not pick.value:
                print("choose a run in the list first")
                return
            from IPython.display import display

            display(table.open(pick.value[0]))

    def on_compare(_b: Any) -> None:
        with out:
            out.clear_output(wait=True)
            if len(pick.value) < 1:
                print("choose runs in the list first")
                return
            from .compare import compare

            compare(*[table.row(n) for n in pick.value]).show()

    for control in (text, sort, desc):
        control.observe(render, names="value")
    open_btn.on_click(on_open)
    cmp_btn.on_click(on_compare)
    render()
    return box
