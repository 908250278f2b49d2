"""What every back-end does to a cell before launching it: strategy, worker prelude, shipped objects, ``DryRun``.

``resolve_strategy`` turns ``--strategy`` into a strategy name, ``PRELUDE`` goes in front of the cell's code,
``_ship`` pickles the notebook's objects into the run directory, and ``DryRun`` is what ``--dry-run`` shows instead of
launching. Shared by the local path (``session.py``) and the cluster back-ends (``cluster.py``, ``skypilot.py``), which
``session.start_run`` dispatches to: it lives below all three so that no back-end imports the session back
(docs/architecture.md, "No import circles").
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from ..errors import JupyterDistError
from .rundir import RunDir

__all__ = ["PRELUDE", "STRATEGY_CHOICES", "DryRun", "resolve_strategy"]

STRATEGY_CHOICES = ("auto", "none", "ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3", "zero3-offload",
                    "zero2-offload", "zero3-offload-params", "fsdp2-hybrid")  # fmt: skip
_ALIASES = {"fsdp": "fsdp-full-shard"}


def resolve_strategy(strategy: str, plan: Any, world_size: int) -> str:
    """``auto`` -> the plan's recommendation (or DDP for more than one process); aliases -> strategy names."""
    if strategy not in STRATEGY_CHOICES:
        raise JupyterDistError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGY_CHOICES)}")
    if strategy == "auto":
        if plan is not None and plan.best is not None:
            return str(plan.best.strategy)
        return "ddp" if world_size > 1 else "none"
    return _ALIASES.get(strategy, strategy)


@dataclass
class DryRun:
    """What ``--dry-run`` shows: the script, the configs and the commands, nothing started."""

    script: str
    argv: list[list[str]]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)

    def to_text(self) -> str:
        """Plain text: commands, environment, files."""
        out = ["# commands (one per node)"] + [shlex.join(a) for a in self.argv]
        out += ["", "# environment added"] + [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        for name, text in {"script.py": self.script, **self.files}.items():
            out += ["", f"# ---- {name} ----", text.rstrip()]
        return "\n".join(out)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        import html

        return {"text/plain": self.to_text(), "text/html": f"<pre>{html.escape(self.to_text())}</pre>"}


PRELUDE = """\
# --- added by jupyter-dist: the worker API is bound as `jd` ---
import jupyter_dist.worker as jd  # noqa: E402
# --- the cell ---
"""


def _ship(rd: RunDir, objects: dict[str, Any]) -> None:
    import pickle

    import cloudpickle

    try:
        payload = cloudpickle.dumps(objects)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        names = ", ".join(objects)
        raise JupyterDistError(f"--ship {names}: cannot be pickled for the workers ({exc})") from None
    (rd.path / "shipped.pkl").write_bytes(payload)
