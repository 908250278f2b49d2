"""Start a run on a cluster back-end (SLURM, SkyPilot) from a cell's code: the same run directory and Run handle.

``start_run(code, backend=..., cluster=ClusterOptions(...))`` lands here for every back-end whose registry entry is a
cluster (:data:`~jupyter_dist.launch.base.BACKEND_SPECS`). What every cluster job shares is done here, the same for
each: the launch contract, the plan (the user's ``--plan``, or one made for the requested hardware), the ``Layout``,
the kernel's wheel and versions, the DeepSpeed config, the script. What differs is asked of the back-end's own
:class:`ClusterHooks` (its spec's ``start``): which options it takes, what it adds to the contract and the
environment, where ``--script`` is on its nodes, and how it submits the :class:`ClusterJob` (``render_sbatch``,
``render_skypilot_task``, so what is submitted is what ``%dist_plan`` / ``jupyter-dist config`` shows). No back-end
is named here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import JupyterDistError
from ..base import BACKEND_SPECS, CLUSTER_BACKENDS, load_target

if TYPE_CHECKING:
    from ...render.common import Layout
    from ..options import RunOptions

__all__ = ["CLUSTER_BACKENDS", "ClusterHooks", "ClusterJob", "ClusterOptions", "parse_gpus", "start_cluster_run"]

_GPUS_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_.-]*)(?::(\d+))?$")
_CLUSTER_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_gpus(spec: str) -> tuple[str, int]:
    """``"H100:8"`` -> ``("H100", 8)``; ``"A100"`` -> ``("A100", 1)``; a one-line error otherwise."""
    m = _GPUS_RE.match(spec.strip())
    if not m or (m.group(2) is not None and int(m.group(2)) < 1):
        raise JupyterDistError(f"--gpus {spec!r}: write NAME[:COUNT] per node, e.g. H100:8 or A100-80GB:4")
    return m.group(1), int(m.group(2) or 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterOptions:
    """What a cluster back-end needs beyond the local options. Validated here: one-line errors."""

    partition: str | None = None
    """SLURM ``--partition``."""
    account: str | None = None
    """SLURM ``--account``."""
    time_limit: str | None = None
    """SLURM ``--time`` (``[D-]HH:MM:SS``, ``MM`` or ``HH:MM``); default 24:00:00."""
    gpus: str | None = None
    """SkyPilot accelerators per node, ``NAME[:COUNT]`` (``H100:8``); ``None``: CPU processes (gloo)."""
    cluster: str | None = None
    """SkyPilot cluster name (reused when it exists); default ``jd-<run name>``."""
    infra: str | None = None
    """SkyPilot infra: ``aws``, ``gcp/us-central1``, ``kubernetes``, ``slurm``, ... (default: SkyPilot chooses)."""
    spot: bool = False
    """SkyPilot spot / preemptible instances."""
    idle_minutes: int | None = None
    """SkyPilot autostop after this many idle minutes (with ``down``: tear down instead of stop)."""
    down: bool = False
    """SkyPilot: tear the cluster down when the job ends (``sky launch --down``)."""
    managed: bool = False
    """SkyPilot managed job (``sky jobs launch``): recovers from preemption and errors, resumes from checkpoints."""
    max_restarts_on_errors: int = 0
    """Managed jobs: restarts after a user-code error (recovery after preemption is always on)."""
    secrets: tuple[str, ...] = ()
    """Environment variable names whose values go to the job from this kernel's environment (never into files)."""
    setup: str | None = None
    """Set-up commands on each node after the jupyter-dist wheel is installed (replace the version pins; default:
    the kernel's versions, see :mod:`.remote_env`)."""
    requirements: str | None = None
    """A requirements file installed on each node instead of the kernel's version pins."""
    image: str | None = None
    """SkyPilot ``image_id`` (e.g. ``docker:pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime``): its packages are kept."""
    ship_env: bool = False
    """SLURM: the nodes do not share this kernel's environment: install the wheel and the pins on each node first
    (SkyPilot jobs always do)."""
    workdir: str | None = None
    """A project folder copied to the nodes (ignore rules of ``.skyignore``/``.gitignore``); importable there."""
    workdir_limit: str = "1GB"
    """Refuse a ``workdir`` bigger than this (the biggest files are named)."""
    steps: int | None = None
    """Optimizer steps the run will take: with the plan's step time, the dry run's cost estimate."""
    mounts: tuple[str, ...] = ()
    """SkyPilot ``DEST=SOURCE`` bucket mounts (``/data=s3://bucket/path``); see :mod:`.project`."""
    checkpoint_dir: str | None = None
    """SkyPilot: checkpoint root on the nodes (a bucket mount for managed jobs); the job's folder is keyed on
    ``SKYPILOT_TASK_ID`` under it. Default ``checkpoints`` in the workdir."""

    def __post_init__(self) -> None:
        if self.gpus is not None:
            parse_gpus(self.gpus)
        if self.cluster is not None and not _CLUSTER_RE.match(self.cluster):
            raise JupyterDistError(
                f"--cluster {self.cluster!r}: 1-63 lower-case letters, digits or dashes, starting with a letter"
            )
        if self.idle_minutes is not None and self.idle_minutes < 0:
            raise JupyterDistError(f"--idle-minutes must be >= 0, got {self.idle_minutes}")
        if self.max_restarts_on_errors < 0:
            raise JupyterDistError(f"--max-restarts must be >= 0, got {self.max_restarts_on_errors}")
        for name in self.secrets:
            if not _ENV_RE.match(name):
                raise JupyterDistError(f"--secret {name!r} is not an environment variable name (letters, digits, _)")
        if self.managed and (self.cluster is not None or self.idle_minutes is not None or self.down):
            raise JupyterDistError(
                "--managed jobs run on clusters SkyPilot creates and tears down itself: drop --cluster, "
                "--idle-minutes and --down"
            )
        from ...render.common import SLURM_TIME_RE
        from ..project import parse_mount, parse_size

        for spec in self.mounts:
            parse_mount(spec)
        parse_size(self.workdir_limit)
        if self.steps is not None and self.steps < 1:
            raise JupyterDistError(f"--steps must be >= 1, got {self.steps}")
        if self.workdir is not None and not os.path.isdir(os.path.expanduser(self.workdir)):
            raise JupyterDistError(f"--workdir {self.workdir}: not a folder here")
        if self.requirements is not None and not os.path.isfile(os.path.expanduser(self.requirements)):
            raise JupyterDistError(f"--requirements {self.requirements}: no such file here")
        if self.setup is not None and self.requirements is not None:
            raise JupyterDistError("--setup and --requirements both replace the version pins: give one")
        if self.time_limit is not None and not SLURM_TIME_RE.match(self.time_limit):
            raise JupyterDistError(f"--time {self.time_limit!r}: write HH:MM:SS, MM, HH:MM or D-HH:MM:SS")
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not re.match(r"^[A-Za-z0-9_.-]+$", value):
                raise JupyterDistError(f"{flag} {value!r} may only hold letters, digits, '_', '.' and '-'")


def _job_name(name: str) -> str:
    safe = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not safe or not safe[0].isalpha():
        safe = "jd-" + safe
    return safe[:63].rstrip("-") or "jupyter-dist"


def _plan_for(plan: Any, strategy: str, nproc: int, nodes: int, gpus: tuple[str, int] | None) -> Any:
    """The user's plan, or one made for the requested hardware (CPU processes when no GPU is asked for)."""
    if plan is not None:
        hw = plan.hardware
        if hw.nodes != nodes or hw.gpus_per_node != nproc:
            raise JupyterDistError(
                f"--plan is for {hw.nodes} node(s) x {hw.gpus_per_node} GPU(s), the run asks for {nodes} x {nproc}: "
                f"pass --nodes {hw.nodes} --nproc {hw.gpus_per_node} (or leave them out), or plan for this shape"
            )
        return plan
    from ...plan import Hardware, ModelSpec, TrainingShape
    from ...plan import plan as make_plan
    from ...plan.hardware import get_accelerator

    if gpus is None:
        acc = get_accelerator("cpu")
        precision = "fp32"
    else:
        from ...render.skypilot import SKYPILOT_ACCELERATORS

        reverse = {v.lower(): k for k, v in SKYPILOT_ACCELERATORS.items()}
        try:
            acc = get_accelerator(reverse.get(gpus[0].lower(), gpus[0]))
        except JupyterDistError:
            known = ", ".join(sorted(SKYPILOT_ACCELERATORS.values()))
            raise JupyterDistError(
                f"--gpus {gpus[0]}: not in the hardware catalog; known: {known} "
                "(or pass --plan with a custom accelerator)"
            ) from None
        precision = "bf16-mixed"
    hw = Hardware(accelerator=acc, gpus_per_node=nproc, nodes=nodes)
    shape = TrainingShape(precision=precision)
    model = ModelSpec.from_params(1e6, name="cell")
    return make_plan(model, hw, shape, strategy=None if strategy in ("none",) else strategy)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterJob:
    """What :func:`start_cluster_run` resolved for one run, handed to the back-end's :meth:`ClusterHooks.start`."""

    script: str
    """The job's ``script.py``: the prelude and the cell, or the ``--script`` runner."""
    files: dict[str, str]
    """Other files the job needs, by name (``ds_config.json``)."""
    plan: Any
    """The plan compiled for this run (the user's, or one made for the requested hardware)."""
    user_plan: Any
    """The user's ``--plan`` (``None`` if none), saved in ``run.json``."""
    candidate: str | None
    cluster: ClusterOptions
    nproc: int
    nodes: int
    job: str
    """The scheduler-safe job name."""
    name: str
    """The run's name (its directory's prefix)."""
    strat: str
    """The base strategy the ranks apply."""
    contract: Any
    """The launch contract (``WorkerEnv``) after the back-end's :meth:`ClusterHooks.contract`."""
    extras: dict[str, str]
    """Environment beyond the contract: the user's ``--env`` and what the back-end adds."""
    ship: dict[str, Any] | None
    timeout: float | None
    runs_dir: str | Path
    port: int | None
    dry_run: bool
    max_restarts: int
    layout: Layout
    """The one ``Layout`` of this run: every renderer gets it."""
    renv: Any = None
    """The ``RemoteEnv`` that travels with the job (the kernel's wheel and versions), or ``None``."""
    script_copy: Path | None = None
    """A ``--script`` file to copy next to the job's script (outside the workdir the nodes see)."""
    choice: Any = None
    """The resolved ``LaunchChoice``."""

    @property
    def jd_env(self) -> dict[str, str]:
        """The job's environment: the contract's ``JD_*`` variables and the extras."""
        return {**self.contract.to_environ(), **self.extras}


class ClusterHooks(Protocol):
    """What a cluster back-end tells :func:`start_cluster_run` (a class named by its registry entry's ``start``)."""

    def check(self, cluster: ClusterOptions) -> None:
        """Refuse, in one line, the options this back-end does not take."""

    def ships_env(self, cluster: ClusterOptions) -> bool:
        """Whether the kernel's jupyter-dist wheel and versions travel with the job."""

    def wheel_site(self, site: str) -> str:
        """Where the shipped wheel is unpacked on a node (``site``: the wheel's folder name)."""

    def contract(self, contract: Any) -> Any:
        """The launch contract as the job's ranks see it (e.g. the run directory where the job runs)."""

    def extras(self, cluster: ClusterOptions, renv: Any) -> dict[str, str]:
        """Environment variables the back-end adds to the job's (after the user's ``--env``)."""

    def script_path(self, script_file: str, cluster: ClusterOptions) -> tuple[str, Path | None]:
        """``--script``'s path as the job sees it, and the file to copy next to the job's script (or ``None``)."""

    def start(self, job: ClusterJob) -> Any:
        """Submit the job (or describe it, for a dry run): a :class:`~jupyter_dist.launch.run.Run` or a ``DryRun``."""


def cluster_hooks(backend: str) -> ClusterHooks:
    """The hooks of a cluster back-end (its registry entry's ``start``); a one-line error for any other name."""
    spec = BACKEND_SPECS.get(backend)
    if spec is None or not spec.cluster or spec.start is None:
        raise JupyterDistError(f"unknown backend {backend!r}; valid: {', '.join(BACKEND_SPECS)}")
    hooks: ClusterHooks = load_target(spec.start)()
    return hooks


def start_cluster_run(code: str, options: RunOptions | None = None, /, **kwargs: Any) -> Any:
    """Compile and submit ``code`` on ``options.backend``; returns a :class:`~.run.Run` (or a ``DryRun``).

    ``options`` is the run's :class:`~..options.RunOptions` (or its fields as keywords, as for ``start_run``);
    ``strategy``, ``plan`` and the degrees resolve as for a local run (:func:`~.prepare.launch_contract`); the
    ``JD_*`` variables come from that contract's ``WorkerEnv.to_environ()``.
    """
    from dataclasses import replace

    from ...render.common import SECRET_NAMES, RenderOptions
    from ..options import RunOptions
    from ..prepare import PRELUDE, launch_contract

    opts = RunOptions.from_kwargs(options, **kwargs)
    backend, plan, name, nproc, nodes = opts.backend, opts.plan, opts.name, opts.nproc, opts.nodes
    cluster: ClusterOptions = opts.cluster or ClusterOptions()
    hooks = cluster_hooks(backend)
    if opts.launcher != "torchrun":
        raise JupyterDistError(
            f"--launcher {opts.launcher}: cluster back-ends start torchrun on every node (DeepSpeed strategies run "
            "under it); drop --launcher"
        )
    hooks.check(cluster)
    gpus = parse_gpus(cluster.gpus) if cluster.gpus else None
    if gpus is not None:
        if nproc is not None and nproc != gpus[1]:
            raise JupyterDistError(f"--nproc {nproc} != {gpus[1]} GPUs per node from --gpus {cluster.gpus}")
        nproc = gpus[1]
    if nproc is None:
        nproc = plan.hardware.gpus_per_node if plan is not None and hasattr(plan, "hardware") else 1
    if plan is not None and hasattr(plan, "hardware") and nodes == 1:  # --nodes left at its default: the plan's
        nodes = plan.hardware.nodes
    if nproc < 1 or nodes < 1:
        raise JupyterDistError(f"--nproc and --nodes must be >= 1, got {nproc} and {nodes}")
    if plan is not None and not hasattr(plan, "best"):
        raise JupyterDistError(f"--plan must name a Plan object, got a {type(plan).__name__}")
    precision = None if plan is not None else ("bf16-mixed" if gpus else "fp32")
    choice, contract = launch_contract(
        opts.strategy, plan, nproc=nproc, nodes=nodes, degrees=opts.degrees(), worker=opts.worker, precision=precision
    )
    strat = choice.strategy
    env = opts.env
    for key in env:  # a valid name: RunOptions checked it
        if key in SECRET_NAMES or key in cluster.secrets:
            raise JupyterDistError(f"--env {key}=... looks like a secret: pass it with --secret {key} (by name only)")
    missing = [s for s in cluster.secrets if not os.environ.get(s)]
    if missing and not opts.dry_run:
        raise JupyterDistError(
            f"--secret {', '.join(missing)}: not set in this kernel's environment (set it first, e.g. "
            f"os.environ[{missing[0]!r}] = ..., or drop --secret)"
        )
    the_plan = _plan_for(plan, strat, nproc, nodes, gpus)
    job = _job_name(name)
    candidate = strat if strat not in ("none", "auto") else None
    from ...render.common import layout_of

    layout = layout_of(the_plan, RenderOptions(candidate=candidate))  # once per run: every artifact below uses it
    files: dict[str, str] = {}
    renv = None
    if hooks.ships_env(cluster):  # the kernel's jupyter-dist and versions travel with the job
        from ..remote_env import DIST_NAME, RemoteEnv, kernel_pins, package_wheel, torch_variant, versions_env

        wheel = package_wheel()
        pins = kernel_pins(strategy=strat)
        acc = the_plan.hardware.accelerator
        variant = torch_variant(pins.get("torch", ""), acc.name, acc.vendor)
        renv = RemoteEnv(wheel=wheel, pins=pins, torch_variant=variant,
                         requirements=".jd/requirements.txt" if cluster.requirements else None, image=cluster.image,
                         site=hooks.wheel_site(wheel.site))  # fmt: skip
        import platform

        checked = {**pins, DIST_NAME: wheel.version, "python": platform.python_version()}
        contract = replace(contract, versions=versions_env(checked))
    if cluster.workdir is not None:
        from ..project import check_workdir, parse_size

        check_workdir(cluster.workdir, parse_size(cluster.workdir_limit))
    if layout.strategy.family == "deepspeed":  # not zero1 with tp/pp/cp/ep: that runs as FSDP2
        from ...render.deepspeed import render_deepspeed_json

        files["ds_config.json"] = render_deepspeed_json(the_plan, RenderOptions(candidate=strat), layout=layout)
        contract = replace(contract, ds_config="ds_config.json")
    contract = hooks.contract(contract)
    extras = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}
    extras.update(hooks.extras(cluster, renv))
    script = PRELUDE + code
    script_copy = None
    if opts.script is not None:  # --script: an existing script runs as the job's __main__ (project.script_runner)
        from ..project import script_runner

        job_path, script_copy = hooks.script_path(opts.script, cluster)
        script = script_runner(job_path, opts.script_args)
    return hooks.start(ClusterJob(
        script=script, files=files, plan=the_plan, user_plan=plan, candidate=candidate, cluster=cluster, nproc=nproc,
        nodes=nodes, job=job, name=name, strat=strat, contract=contract, extras=extras, ship=opts.ship,
        timeout=opts.timeout, runs_dir=opts.runs_dir, port=opts.port, dry_run=opts.dry_run,
        max_restarts=opts.max_restarts, layout=layout, renv=renv, script_copy=script_copy, choice=choice,
    ))  # fmt: skip
