"""The options of one run as one typed value: ``RunOptions``, what ``start_run`` and the back-ends take whole.

``%%dist_train`` (``magics/dist.py``), ``jupyter-dist launch`` (``scriptrun.py``) and a Python caller of
:func:`~.session.start_run` build one :class:`RunOptions`; ``start_run`` hands it to the local path or to
:func:`~.backends.cluster.start_cluster_run` unchanged. Each option is checked once, here, when the value is made
(one-line :class:`~jupyter_dist.errors.JupyterDistError`, the wording the flags have always had); what depends on
the back-end's resolution (the launcher on this machine, the capacity, the GPUs of ``--gpus``) is checked where it
is resolved.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import JupyterDistError
from .base import DEFAULT_BACKEND, backend_spec

__all__ = ["DEGREE_OPTIONS", "RunOptions"]

DEGREE_OPTIONS = ("tp", "pp", "cp", "ep", "sp")
"""The options that override the candidate's degrees (``--tp/--pp/--cp/--ep/--sp``; ``None``: not given)."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """How to run a cell (or ``--script``): every option of :func:`~.session.start_run`, checked when made."""

    nproc: int | None = None
    """Processes per node (``None``: the machine's GPUs, else 2; on a cluster ``--gpus``' count or the plan's)."""
    nodes: int = 1
    """Nodes (a cluster run with a plan and ``nodes=1`` takes the plan's)."""
    strategy: str = "auto"
    """``auto`` (the plan's recommended candidate), ``none``, a strategy or a candidate name (``fsdp2+tp2+sp``)."""
    plan: Any = None
    """A :class:`~jupyter_dist.plan.plan.Plan`: its candidate, precision, configs."""
    launcher: str = "torchrun"
    """``torchrun``, ``deepspeed`` or ``accelerate`` (local runs)."""
    name: str = "run"
    """The run's name (its folder is ``<runs_dir>/<name>-<time>``)."""
    ship: dict[str, Any] | None = None
    """Objects of the kernel sent to the cell (pickled into the run directory)."""
    max_restarts: int = 0
    """torchrun's restarts of the whole job."""
    timeout: float | None = None
    """Seconds after which the run is stopped."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables added for the ranks (``--env NAME=VALUE``)."""
    runs_dir: str | os.PathLike[str] = "runs"
    """The folder of the run directories."""
    port: int | None = None
    """The rendezvous port (local runs; ``None``: a free one)."""
    dry_run: bool = False
    """Show the script, configs and commands; start nothing."""
    hang_timeout: float | None = None
    """Seconds of silence after which a local run's ranks are diagnosed as hung."""
    backend: str = DEFAULT_BACKEND
    """A registered back-end (:data:`~.base.BACKEND_SPECS`)."""
    cluster: Any = None
    """A cluster back-end's :class:`~.backends.cluster.ClusterOptions` (``None``: the defaults)."""
    tp: int | None = None
    """``--tp``: the tensor-parallel degree instead of the candidate's (``None``: the candidate's)."""
    pp: int | None = None
    """``--pp``: pipeline stages instead of the candidate's (``1`` drops them, on purpose)."""
    cp: int | None = None
    """``--cp``: the context-parallel degree instead of the candidate's."""
    ep: int | None = None
    """``--ep``: the expert-parallel degree instead of the candidate's."""
    sp: bool | None = None
    """``--sp``: sequence parallelism on (needs a tp) or off."""
    worker: dict[str, Any] = field(default_factory=dict)
    """Other :class:`~jupyter_dist.worker._env.WorkerEnv` fields (``checkpoint_every``, ``heartbeat_s``, ...)."""
    log_to: str | Iterable[str] | None = None
    """Metric sinks the kernel forwards the run's records to (``"tensorboard,wandb"``)."""
    secrets: tuple[str, ...] = ()
    """Names of the environment variables the sinks need (never their values)."""
    script: str | None = None
    """An existing script to run instead of the cell (``--script``)."""
    script_args: tuple[str, ...] = ()
    """The script's arguments."""
    output: str | Iterable[int] | None = "0"
    """Whose prints are shown while the run goes: ``"0"``, ``"all"``, ``"none"``, ``"0,2"``."""
    oversubscribe: bool = False
    """Let a local run start more ranks than the machine holds."""

    def __post_init__(self) -> None:
        for name in ("env", "worker"):  # None (the old keyword default) is the empty mapping; a copy is kept
            value = getattr(self, name)
            object.__setattr__(self, name, dict(value) if value is not None else {})
        object.__setattr__(self, "secrets", tuple(self.secrets))
        object.__setattr__(self, "script_args", tuple(self.script_args))
        spec = backend_spec(self.backend)  # an unknown back-end: one line naming the valid ones
        if self.nproc is not None and self.nproc < 1:
            raise JupyterDistError(f"--nproc must be >= 1, got {self.nproc}")
        for dim in DEGREE_OPTIONS[:-1]:
            value = getattr(self, dim)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise JupyterDistError(f"--{dim} must be >= 1, got {value!r}")
        if self.timeout is not None and self.timeout <= 0:
            raise JupyterDistError(f"--timeout must be positive seconds, got {self.timeout}")
        if self.hang_timeout is not None:
            if spec.cluster:
                raise JupyterDistError(f"--hang-timeout watches local ranks only; drop it with --backend {spec.name}")
            if self.hang_timeout <= 0:
                raise JupyterDistError(f"--hang-timeout must be positive seconds, got {self.hang_timeout}")
        for key in self.env:
            if not _ENV_NAME.match(key):
                raise JupyterDistError(f"--env name {key!r} is not a valid environment variable name")
        from ..telemetry.sinks import check_sinks, parse_log_to
        from .output import parse_output

        shown = parse_output(self.output)
        if self.nproc is not None:  # a rank the run will not have is refused before anything starts
            shown.resolve(self.nproc * self.nodes)
        check_sinks(parse_log_to(self.log_to), self.secrets)

    def degrees(self) -> dict[str, int | bool]:
        """The degrees given (``--tp 2 --sp`` -> ``{"tp": 2, "sp": True}``): they override the candidate's.

        Only the given ones, since ``--pp 1`` (drop the candidate's stages) and no ``--pp`` (keep them) differ; the
        candidate with them becomes a :class:`~jupyter_dist.plan.parallel.ParallelDims` in
        :func:`~jupyter_dist.plan.candidates.resolve_launch`.
        """
        return {d: getattr(self, d) for d in DEGREE_OPTIONS if getattr(self, d) is not None}

    @classmethod
    def from_kwargs(cls, options: RunOptions | None = None, /, **kwargs: Any) -> RunOptions:
        """``options`` with ``kwargs`` over it (or the options ``kwargs`` name): ``start_run``'s keywords, whole.

        An unknown keyword is a ``TypeError`` naming it, as a function's would be.
        """
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"start_run() got an unexpected keyword argument {unknown[0]!r}")
        return replace(options, **kwargs) if options is not None else cls(**kwargs)
