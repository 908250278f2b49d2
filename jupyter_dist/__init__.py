"""jupyter-dist: plan, compile, run and watch distributed PyTorch training from a notebook.

Importing the package is cheap: the planner is stdlib only, and everything else (runs, pools, panels, the wizard)
loads on first use. ``jupyter_dist.plan`` is both the planning subpackage (``from jupyter_dist.plan import
ModelSpec``) and the planner itself (``jupyter_dist.plan("llama-3-8b")``): the subpackage is callable.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from . import plan
from ._version import __version__

_LAZY: dict[str, str] = {
    "Plan": "jupyter_dist.plan", "Candidate": "jupyter_dist.plan", "ModelSpec": "jupyter_dist.plan",
    "Hardware": "jupyter_dist.plan", "TrainingShape": "jupyter_dist.plan", "ParallelDims": "jupyter_dist.plan",
    "Run": "jupyter_dist.launch.run", "open_run": "jupyter_dist.launch.run", "Pool": "jupyter_dist.pool.kernel",
    "start_run": "jupyter_dist.launch.session", "DryRun": "jupyter_dist.launch.session",
    "Bundle": "jupyter_dist.render.bundle", "render_bundle": "jupyter_dist.render.bundle",
    "Dashboard": "jupyter_dist.ui.dashboard", "Wizard": "jupyter_dist.ui.wizard",
    "runs": "jupyter_dist.launch.runs", "RunTable": "jupyter_dist.launch.runs", "compare": "jupyter_dist.ui.compare",
    "Comparison": "jupyter_dist.ui.compare", "profile_summary": "jupyter_dist.telemetry.profile",
}  # fmt: skip
"""Public name -> the module that owns it; imported on first attribute access (PEP 562), so ``isinstance`` works."""

__all__ = ["__version__", "plan", "load_ipython_extension", "unload_ipython_extension", *_LAZY]


def __getattr__(name: str) -> Any:
    owner = _LAZY.get(name)
    if owner is None:
        raise AttributeError(f"module 'jupyter_dist' has no attribute {name!r}")
    value = getattr(import_module(owner), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _live_panels(run: Any, **kwargs: Any) -> Any:
    from .ui.dashboard import Dashboard as _Dashboard

    return _Dashboard(run, **kwargs)


def _static_panels(run: Any) -> str:
    from .ui.dashboard import Dashboard as _Dashboard

    return str(_Dashboard(run, widget=False).static_html())


# The one place that wires the ui layer to the launch layer: a Run shows the notebook panels through these hooks
# (run.dashboard(), a finished run's card), and jupyter_dist.launch never imports jupyter_dist.ui.
from .launch import views as _views  # noqa: E402


def _runs_widget(table: Any) -> Any:
    from .ui.runs_view import RunsWidget

    return RunsWidget(table)


_views.subscribe(live=_live_panels, static=_static_panels, table=_runs_widget)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext jupyter_dist``: register the magics (imported lazily)."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext jupyter_dist``: remove the magics again."""
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)
