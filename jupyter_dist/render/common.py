"""What every renderer shares: the options a user gives, and the resolved :class:`Layout` of one plan candidate.

A :class:`Layout` is checked once (world size, batch identity, node geometry); every artifact is then rendered from
the same numbers, so the DeepSpeed JSON, the torchrun line, the SkyPilot task and the SLURM script cannot disagree.
Pure and stdlib only.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..errors import JupyterDistError
from ..plan.parallel import ParallelDims
from ..plan.plan import Candidate, Plan
from ..plan.strategies import StrategySpec, get_strategy, runs_as
from ..plan.training import Checkpointing, OptimizerKind, Precision

__all__ = ["RenderError", "RenderOptions", "Layout", "layout_of", "SECRET_NAMES", "shell_env_line"]


class RenderError(JupyterDistError, ValueError):
    """The plan or the options cannot be compiled into consistent artifacts."""


SECRET_NAMES = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY")
"""Environment variables that are never written into generated files, only referenced by name."""

LAUNCHERS = ("torchrun", "deepspeed", "accelerate")
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SLURM_TIME_RE = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")


@dataclass(frozen=True, kw_only=True, slots=True)
class RenderOptions:
    """Choices the plan does not make: names, paths, launcher, scheduler and cloud parameters."""

    candidate: str | None = None
    """Plan candidate to compile (e.g. ``"zero3"``); ``None`` takes the plan's recommendation."""
    name: str = "jupyter-dist"
    """Run / job / cluster name: lower case letters, digits and dashes."""
    script: str = "train.py"
    """Training script, relative to the working directory."""
    script_args: tuple[str, ...] = ()
    """Arguments passed to the training script (quoted when rendered)."""
    launcher: str = "torchrun"
    """``torchrun``, ``deepspeed`` (head-node-only hostfile launch) or ``accelerate``."""
    rdzv: str = "c10d"
    """Multi-node rendezvous for torchrun: ``c10d`` (elastic) or ``static`` (master address + node rank)."""
    master_addr: str = "127.0.0.1"
    """Address of the first node (single-node default); cluster renderers derive it from the scheduler."""
    master_port: int = 29500
    """Rendezvous port on the first node."""
    max_restarts: int = 0
    """torchrun ``--max-restarts``: how often a failed worker group is restarted."""
    lr: float = 3e-4
    """Learning rate written into the optimizer section / code."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables it)."""
    nvme_path: str | None = None
    """Offload to NVMe at this local path instead of CPU memory (ZeRO-Infinity); needs libaio."""
    checkpoint_dir: str = "checkpoints"
    """Checkpoint folder; cluster renderers key it on the task/job id so a recovered job resumes."""
    partition: str | None = None
    """SLURM partition (not baked in: omitted when None)."""
    account: str | None = None
    """SLURM account (omitted when None)."""
    time_limit: str = "24:00:00"
    """SLURM wall-clock limit, ``[D-]HH:MM:SS``."""
    cloud: str | None = None
    """SkyPilot cloud/infra (``aws``, ``gcp``, ``slurm``...); ``None`` lets SkyPilot choose."""
    use_spot: bool = False
    """SkyPilot spot/preemptible instances."""
    setup: str | None = None
    """SkyPilot setup commands run once per node; ``None``: install what the generated script imports (torch, and
    deepspeed or accelerate when they launch it). ``%%dist_train`` ships the kernel's jupyter-dist wheel and pins the
    kernel's versions instead (``jupyter_dist.launch.remote_env``)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables (name, value) for every process; secrets are refused here."""
    secrets: tuple[str, ...] = ("WANDB_API_KEY", "HF_TOKEN")
    """Secret names forwarded from the launching environment by reference, never by value."""
    nccl_debug: str = "WARN"
    """``NCCL_DEBUG`` level: VERSION, WARN, INFO or TRACE."""
    node_setup: str = ""
    """SLURM: bash each node runs before the launcher, in the job's folder (installs the job's environment when the
    nodes do not share the submitting one; ``jupyter_dist.launch.remote_env``)."""

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise RenderError(
                f"name {self.name!r} must be 1-63 lower-case letters, digits or dashes, starting with a letter "
                "(it becomes a cluster, job and file name)"
            )
        if self.launcher not in LAUNCHERS:
            raise RenderError(f"unknown launcher {self.launcher!r}; valid: {', '.join(LAUNCHERS)}")
        if self.rdzv not in ("c10d", "static"):
            raise RenderError(f"unknown rendezvous {self.rdzv!r}; valid: c10d, static")
        if not 1024 <= self.master_port <= 65535:
            raise RenderError(f"master port must be in 1024..65535, got {self.master_port}")
        if self.max_restarts < 0:
            raise RenderError(f"max-restarts must be >= 0, got {self.max_restarts}")
        if self.lr <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise RenderError("lr must be > 0; weight decay and grad clip must be >= 0")
        if not self.script or self.script.startswith("-"):
            raise RenderError(f"script {self.script!r} must be a file path")
        if not SLURM_TIME_RE.match(self.time_limit):
            raise RenderError(f"time limit {self.time_limit!r} must look like HH:MM:SS or D-HH:MM:SS")
        if self.nccl_debug.upper() not in ("VERSION", "WARN", "INFO", "TRACE"):
            raise RenderError(f"NCCL debug level {self.nccl_debug!r}; valid: VERSION, WARN, INFO, TRACE")
        for key, _ in self.env:
            if not _ENV_RE.match(key):
                raise RenderError(f"environment variable name {key!r} is not valid (letters, digits, _)")
            if key in SECRET_NAMES or key in self.secrets:
                raise RenderError(
                    f"{key} looks like a secret: list it in secrets=(...) so it is forwarded by name, "
                    "never written into a file"
                )
        for key in self.secrets:
            if not _ENV_RE.match(key):
                raise RenderError(f"secret name {key!r} is not a valid environment variable name")
        for value in (self.partition, self.account):
            if value is not None and not re.match(r"^[A-Za-z0-9_.-]+$", value):
                raise RenderError(f"SLURM partition/account {value!r} may only hold letters, digits, '_', '.', '-'")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """The numbers every artifact is rendered from, checked for consistency once."""

    plan: Plan
    """The plan compiled."""
    candidate: Candidate
    """The chosen candidate."""
    strategy: StrategySpec
    """Its strategy as it runs: ``zero1`` with tp/pp/cp/ep is FSDP2's layout (``plan.strategies.runs_as``)."""
    dims: ParallelDims
    """Its parallel degrees."""
    nodes: int
    """Nodes."""
    gpus_per_node: int
    """Processes per node (one per GPU)."""
    micro_batch: int
    """Sequences per GPU per micro-step."""
    grad_accum: int
    """Micro-steps per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    precision: Precision
    """Numeric format."""
    optimizer: OptimizerKind
    """Optimizer."""
    checkpointing: Checkpointing
    """Activation checkpointing."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The plan's bucket sizes and group sizes."""

    @property
    def world_size(self) -> int:
        """Total processes."""
        return self.nodes * self.gpus_per_node

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro x accumulation x data-parallel size."""
        return self.micro_batch * self.grad_accum * self.dims.dp

    @property
    def multi_node(self) -> bool:
        """More than one node."""
        return self.nodes > 1


def layout_of(plan: Plan, opts: RenderOptions | None = None) -> Layout:
    """Resolve the candidate to compile and check that its numbers agree with each other."""
    opts = opts or RenderOptions()
    if opts.candidate is not None:
        try:
            cand = plan.candidate(opts.candidate)
        except KeyError:
            try:
                wanted = get_strategy(opts.candidate).name
            except JupyterDistError:
                wanted = None
            names = [c.name for c in plan.candidates if c.strategy == wanted]
            if not names:
                raise RenderError(
                    f"the plan has no candidate {opts.candidate!r}; have: {', '.join(c.name for c in plan.candidates)}"
                ) from None
            cand = plan.candidate(names[0])
    elif plan.best is not None:
        cand = plan.best
    else:
        raise RenderError(
            "nothing fits in this plan, so there is no recommendation to compile; pick a candidate explicitly "
            f"(one of: {', '.join(c.name for c in plan.candidates)}) or change the hardware/shape"
        )
    hw = plan.hardware
    dims = cand.dims
    if dims.world_size != hw.world_size:
        raise RenderError(
            f"dp ({dims.dp}) x tp ({dims.tp}) x pp ({dims.pp}) x cp ({dims.cp}) = {dims.world_size} != world size "
            f"{hw.world_size} ({hw.nodes} nodes x {hw.gpus_per_node} GPUs)"
        )
    if (dims.dp * dims.cp) % dims.ep:
        raise RenderError(f"ep ({dims.ep}) must divide dp x cp ({dims.dp * dims.cp})")
    t = plan.training
    if t.global_batch is not None and t.global_batch != t.micro_batch * cand.grad_accum * dims.dp:
        raise RenderError(
            f"global batch {t.global_batch} != micro-batch {t.micro_batch} x accumulation {cand.grad_accum} x "
            f"data-parallel {dims.dp} = {t.micro_batch * cand.grad_accum * dims.dp}"
        )
    return Layout(
        plan=plan, candidate=cand, dims=dims,
        strategy=runs_as(get_strategy(cand.strategy), model_parallel=not dims.is_data_parallel_only), nodes=hw.nodes,
        gpus_per_node=hw.gpus_per_node, micro_batch=t.micro_batch, grad_accum=cand.grad_accum, seq_len=t.seq_len,
        precision=t.precision, optimizer=t.optimizer, checkpointing=t.checkpointing, settings=dict(cand.settings),
    )  # fmt: skip


def shell_env_line(env: dict[str, str]) -> str:
    """``export A=1 B='x y'`` with every value quoted."""
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) if env else ""
