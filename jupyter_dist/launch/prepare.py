"""What every back-end does to a cell before launching it: what runs, worker prelude, shipped objects, ``DryRun``.

``resolve_strategy`` / :func:`launch_contract` turn ``--strategy``, ``--plan`` and the degrees into what runs and the
:class:`~jupyter_dist.worker._env.WorkerEnv` that carries it to the workers, ``PRELUDE`` goes in front of the cell's
code, :func:`write_shipped` pickles the notebook's objects into the run directory, and ``DryRun`` is what
``--dry-run`` shows instead of launching. Shared by the local path (``session.py``) and the cluster back-ends
(``cluster.py``, ``slurm.py``, ``skypilot.py``), which ``session.start_run`` dispatches to: it lives below them so
that no back-end imports the session back (docs/architecture.md, "No import circles").
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from .._atomic import write_atomic
from ..errors import JupyterDistError
from ..plan.candidates import LaunchChoice, resolve_launch
from ..plan.strategies import strategy_names
from .rundir import RunDir

__all__ = ["PRELUDE", "STRATEGY_CHOICES", "DryRun", "launch_contract", "resolve_strategy", "write_shipped"]

STRATEGY_CHOICES = ("auto", "none", *strategy_names())
"""Plain names ``--strategy`` takes; it also takes every candidate name the planner prints (``fsdp2+tp2+sp``,
see :func:`~jupyter_dist.plan.candidates.parse_candidate`) and the aliases of
:func:`~jupyter_dist.plan.strategies.get_strategy`."""


def resolve_strategy(strategy: str, plan: Any, world_size: int) -> str:
    """The base strategy ``world_size`` processes run (``auto``: the plan's recommendation, else DDP/none).

    Kept for callers that want only the name; launches use :func:`launch_contract`, which keeps the degrees.
    """
    return resolve_launch(strategy, plan, world_size).strategy


def launch_contract(
    strategy: str, plan: Any, *, nproc: int, nodes: int = 1, degrees: dict[str, Any] | None = None,
    precision: str | None = None, worker: dict[str, Any] | None = None,
) -> tuple[LaunchChoice, Any]:  # fmt: skip
    """``--strategy``/``--plan``/``--tp ...`` -> (what runs, the WorkerEnv that carries it to the workers).

    Every launch path writes its ``JD_*`` variables from that WorkerEnv's
    ``to_environ()``; errors are one line (the degrees that don't fit, what cannot run yet).
    """
    from ..worker._env import WorkerEnv, WorkerError

    if plan is not None and not hasattr(plan, "best"):
        raise JupyterDistError(f"--plan must name a Plan object, got a {type(plan).__name__}")
    world = nproc * nodes
    choice = resolve_launch(strategy, plan, world, nproc_per_node=nproc, degrees=degrees)
    if precision is None:
        precision = plan.training.precision.value if plan is not None else "fp32"
    fields = {**choice.worker_fields(), **(worker or {})}
    if plan is not None and "ac" not in fields:  # the planned activation checkpointing (jd.wrap applies it)
        fields["ac"] = plan.training.checkpointing_name
    if plan is not None and choice.dims.pp > 1 and "pp_schedule" not in fields:  # the planned schedule (the memory
        fields["pp_schedule"] = plan.training.pp_schedule  # and bubble the plan shows are this schedule's)
        if plan.training.pp_virtual:
            fields["pp_virtual"] = plan.training.pp_virtual
    if plan is not None and "microbatches" not in fields:  # the plan's gradient accumulation: jd.train_step's
        planned = next((c for c in plan.candidates if c.name == choice.candidate.name), None)  # micro-batches
        if planned is not None and planned.grad_accum > 1:
            fields["microbatches"] = planned.grad_accum
    try:
        env = WorkerEnv.for_launch(world_size=world, precision=precision, **fields)
    except WorkerError as exc:
        raise JupyterDistError(str(exc)) from None
    return choice, env


@dataclass
class DryRun:
    """What ``--dry-run`` shows: the script, the configs and the commands, nothing started."""

    script: str
    argv: list[list[str]]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """What runs, in words: the mesh (``mesh: dp_shard=2 x tp=2 (4 processes)``) and any rehearsal note."""

    def to_text(self) -> str:
        """Plain text: what runs, commands, environment, files."""
        out = [f"# {n}" for n in self.notes] + ["# commands (one per node)"] + [shlex.join(a) for a in self.argv]
        out += ["", "# environment added"] + [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        for name, text in {"script.py": self.script, **self.files}.items():
            out += ["", f"# ---- {name} ----", text.rstrip()]
        return "\n".join(out)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        import html

        return {"text/plain": self.to_text(), "text/html": f"<pre>{html.escape(self.to_text())}</pre>"}


PRELUDE = """\
# --- added by jupyter-dist: the worker API is bound as `jd`; HF / Lightning Trainers log to it (JD_AUTO_CALLBACKS) ---
import jupyter_dist.worker as jd; __import__("jupyter_dist.integrations", fromlist=["_"]).autoattach()  # noqa
# --- the cell ---
"""
"""Three lines (the hang and early-exit reports count script lines): binds ``jd`` and arms
:func:`jupyter_dist.integrations.autoattach` (HF ``Trainer`` / Lightning callbacks attach themselves when imported)."""


def write_shipped(rd: RunDir, objects: dict[str, Any]) -> None:
    """Pickle the notebook's ``--ship`` objects (cloudpickle) into the run directory's ``shipped.pkl``."""
    import pickle

    import cloudpickle

    try:
        payload = cloudpickle.dumps(objects)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        names = ", ".join(objects)
        raise JupyterDistError(f"--ship {names}: cannot be pickled for the workers ({exc})") from None
    write_atomic(rd.path / "shipped.pkl", payload)
