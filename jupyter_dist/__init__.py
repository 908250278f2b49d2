"""jupyter-dist: plan, compile, run and watch distributed PyTorch training from a notebook.

Importing the package is cheap: the planner is stdlib only, and notebook pieces load when the extension does.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__

__all__ = ["__version__", "plan", "open_run", "Dashboard", "Wizard", "load_ipython_extension",
           "unload_ipython_extension"]


def plan(*args: Any, **kwargs: Any) -> Any:
    """Plan distributed training; see :func:`jupyter_dist.plan.planner.plan`."""
    from .plan.planner import plan as _plan

    return _plan(*args, **kwargs)


def open_run(path: Any) -> Any:
    """Reopen a run from its directory (after a kernel restart); see :func:`jupyter_dist.launch.run.open_run`."""
    from .launch.run import open_run as _open

    return _open(path)


def Dashboard(source: Any, **kwargs: Any) -> Any:  # noqa: N802 - reads as the class it returns
    """Live panels for a Run or a run directory; see :class:`jupyter_dist.ui.dashboard.Dashboard`."""
    from .ui.dashboard import Dashboard as _Dashboard

    return _Dashboard(source, **kwargs)


def Wizard(model: Any = None, **kwargs: Any) -> Any:  # noqa: N802 - reads as the class it returns
    """The strategy wizard panel; see :class:`jupyter_dist.ui.wizard.Wizard`."""
    from .ui.wizard import Wizard as _Wizard

    return _Wizard(model, **kwargs)


def _live_panels(run: Any, **kwargs: Any) -> Any:
    from .ui.dashboard import Dashboard as _Dashboard

    return _Dashboard(run, **kwargs)


def _static_panels(run: Any) -> str:
    from .ui.dashboard import Dashboard as _Dashboard

    return str(_Dashboard(run, widget=False).static_html())


# The one place that wires the ui layer to the launch layer: a Run shows the notebook panels through these hooks
# (run.dashboard(), a finished run's card), and jupyter_dist.launch never imports jupyter_dist.ui.
from .launch import views as _views  # noqa: E402

_views.subscribe(live=_live_panels, static=_static_panels)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext jupyter_dist``: register the magics (imported lazily)."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext jupyter_dist``: remove the magics again."""
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)
