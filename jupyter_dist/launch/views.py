"""How a :class:`~.run.Run` is shown: hooks that the ui layer's panels subscribe to; the launch layer knows no UI.

``Run.dashboard()`` asks the subscribed *live* view for the panels that follow the run, and a finished run's card
(``Run._repr_mimebundle_``) appends the subscribed *static* view's HTML. The package root (``jupyter_dist/__init__.py``,
which Python runs before any module of the package) subscribes ``jupyter_dist.ui.dashboard``'s panels, importing them
only when a view is asked for; so a Run shows its panels wherever it is made, and this layer never imports ``ui``
(docs/architecture.md, "No import circles"). Another front-end (a terminal, a web app) may subscribe its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import JupyterDistError

__all__ = ["LiveView", "StaticView", "TableView", "live_view", "static_view", "table_view", "subscribe"]

LiveView = Callable[..., Any]
"""``(run, **kwargs) -> panels``: an object with ``start()`` that follows the run (displayed by the caller)."""
StaticView = Callable[[Any], str]
"""``(run) -> html``: the final panels of a finished run, drawn without JavaScript (they survive export)."""
TableView = Callable[[Any], Any]
"""``(run table) -> widget``: the interactive runs table (:meth:`.runs.RunTable.widget`)."""

_views: dict[str, Any] = {"live": None, "static": None, "table": None}


def subscribe(*, live: LiveView | None = None, static: StaticView | None = None,
              table: TableView | None = None) -> dict[str, Any]:  # fmt: skip
    """Subscribe the views a Run shows (``None`` leaves one as it is); returns the previous ones (to restore them)."""
    previous = dict(_views)
    if live is not None:
        _views["live"] = live
    if static is not None:
        _views["static"] = static
    if table is not None:
        _views["table"] = table
    return previous


def restore(previous: dict[str, Any]) -> None:
    """Put back the views :func:`subscribe` returned."""
    _views.update(previous)


def live_view() -> LiveView:
    """The subscribed live view; a one-line error when no front-end subscribed one."""
    view = _views["live"]
    if view is None:
        raise JupyterDistError("no live view is subscribed for runs; import jupyter_dist (its root subscribes the "
                               "notebook panels) or call jupyter_dist.launch.views.subscribe(live=...)")  # fmt: skip
    return view  # type: ignore[no-any-return]


def static_view() -> StaticView | None:
    """The subscribed static view, or ``None`` (the run's card then shows its summary only)."""
    return _views["static"]  # type: ignore[no-any-return]


def table_view() -> TableView:
    """The subscribed runs-table view; a one-line error when no front-end subscribed one."""
    view = _views["table"]
    if view is None:
        raise JupyterDistError("no runs-table view is subscribed; import jupyter_dist (its root subscribes the "
                               "notebook's) or call jupyter_dist.launch.views.subscribe(table=...)")  # fmt: skip
    return view  # type: ignore[no-any-return]
