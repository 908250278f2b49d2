"""User-facing errors.

Every error a user can cause by a bad input is a :class:`JupyterDistError`. Magics and the CLI show these as one
line without a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "JupyterDistError",
    "PlanInputError",
    "UnknownModelError",
    "UnknownAcceleratorError",
    "ParallelismError",
    "MissingDependencyError",
]


class JupyterDistError(Exception):
    """Base class of errors caused by user input; the message is one line that says what is valid."""


class PlanInputError(JupyterDistError, ValueError):
    """An input to the planner is out of range or inconsistent."""


class UnknownModelError(PlanInputError):
    """A model preset name that the catalog does not have."""


class UnknownAcceleratorError(PlanInputError):
    """An accelerator or interconnect name that the catalog does not have."""


class ParallelismError(PlanInputError):
    """Parallel degrees that do not divide the world size or the model's dimensions."""


class MissingDependencyError(JupyterDistError, ImportError):
    """An optional dependency is not installed; the message carries the install hint."""
