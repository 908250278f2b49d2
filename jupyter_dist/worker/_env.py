"""What a worker process learns from its environment, read once (stdlib only)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..errors import JupyterDistError, PlanInputError
from ..plan.parallel import DegreesDoNotDivide, ParallelDims
from ..plan.pipeline import PP_SCHEDULES, stages_per_rank
from ..plan.strategies import STRATEGIES, get_strategy
from ..plan.training import AC_NAMES, Precision, parse_checkpointing

__all__ = [
    "parse_window", "MAX_WINDOW", "ENV_VARS", "PP_SCHEDULES", "WorkerEnv", "WorkerError", "PRECISIONS", "TORCHRUN_VARS",
    "started_by_torchrun", "SPEED_VALUES", "FP8_RECIPES",
]  # fmt: skip

PRECISIONS = tuple(p.value for p in Precision)
"""Values of ``JD_PRECISION`` (the :class:`~jupyter_dist.plan.training.Precision` enum's; its ``fp8`` runs the blocks'
linear layers in FP8 through torchao, bf16 elsewhere: :mod:`jupyter_dist.worker._float8`)."""

FP8_RECIPES = ("tensorwise", "rowwise")
"""Values of ``JD_FP8_RECIPE`` (torchao's float8 scaling recipes)."""

SPEED_VALUES = ("auto", "1", "0")
"""Values of ``JD_FUSED`` and ``JD_COMPILE``: ``auto`` (on CUDA only), ``1`` (on), ``0`` (off)."""

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Environment variables whose presence means "started by torchrun (or an equivalent launcher)"."""


def started_by_torchrun(env: Mapping[str, str]) -> bool:
    """Whether ``env`` has every one of :data:`TORCHRUN_VARS` (a rank of torchrun or an equivalent launcher)."""
    return all(env.get(k) for k in TORCHRUN_VARS)


class WorkerError(JupyterDistError, RuntimeError):
    """The worker cannot do what was asked with this environment or these objects; the message says why."""


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise WorkerError(f"{name}={raw!r} is not an integer") from None


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "")
    if raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise WorkerError(f"{name}={raw!r} is not a number") from None


_WINDOW = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
MAX_WINDOW = 1000
"""Most steps one window may hold (a trace grows with every operator of every step)."""


def parse_window(text: str | int | tuple[int, int] | range) -> tuple[int, int]:
    """``"5:8"`` -> ``(5, 8)`` (steps 5, 6, 7); ``"3"`` or ``3`` -> ``(3, 4)``; a ``range(5, 8)`` or ``(5, 8)``.

    Raises
    ------
    WorkerError
        For anything else, saying what is valid.
    """
    if isinstance(text, range):
        if text.step != 1:
            raise WorkerError(f"profile window {text!r} must have step 1")
        start, stop = text.start, text.stop
    elif isinstance(text, tuple) and len(text) == 2 and all(isinstance(v, int) for v in text):
        start, stop = text
    elif isinstance(text, int) and not isinstance(text, bool):
        start, stop = text, text + 1
    elif isinstance(text, str) and (m := _WINDOW.match(text)):
        start = int(m.group(1))
        stop = int(m.group(2)) if m.group(2) is not None else start + 1
    else:
        raise WorkerError(f"profile window {text!r} is not valid: give STEP (e.g. 3) or START:STOP (e.g. 5:8, steps "
                          "5 to 7)")  # fmt: skip
    if start < 0 or stop <= start:
        raise WorkerError(f"profile window {start}:{stop} is empty or negative: STOP must be > START >= 0")
    if stop - start > MAX_WINDOW:
        raise WorkerError(f"profile window {start}:{stop} holds {stop - start} steps; at most {MAX_WINDOW}")
    return start, stop



@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnv:
    """The launch contract between the launcher and a worker (see ``jupyter_dist/launch``)."""

    distributed: bool
    """Started by torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are all set."""
    rank: int = 0
    """Global rank (``RANK``); 0 outside torchrun."""
    world_size: int = 1
    """Number of processes (``WORLD_SIZE``); 1 outside torchrun."""
    local_rank: int = 0
    """Rank on this node (``LOCAL_RANK``); selects the GPU."""
    local_world_size: int = 1
    """Processes on this node (``LOCAL_WORLD_SIZE``); the shard group size of hybrid strategies."""
    run_dir: str | None = None
    """``JD_RUN_DIR``: the run directory with ``telemetry/``, ``checkpoints/`` and ``logs/``; ``None`` when unset."""
    strategy: str = "none"
    """``JD_STRATEGY``: ``"none"`` or a canonical name from ``jupyter_dist.plan.strategies``."""
    ds_config: str | None = None
    """``JD_DS_CONFIG``: path of the DeepSpeed JSON (``zero*`` strategies); a relative path is taken relative to
    ``JD_RUN_DIR``."""
    precision: str = "fp32"
    """``JD_PRECISION``: one of :data:`PRECISIONS`."""
    log_stdio: bool = False
    """``JD_LOG_STDIO=1``: redirect fd 1 and 2 to ``logs/rank-<k>.log`` at import."""
    heartbeat_s: float = 2.0
    """``JD_HEARTBEAT_S``: seconds between ``hb`` (and ``mem``/``gpu``) records; 0 turns them off."""
    checkpoint_every: int = 0
    """``JD_CHECKPOINT_EVERY``: ``jd.checkpoint(state, step)`` saves when ``step + 1`` is a multiple (0: never)."""
    async_save: bool = False
    """``JD_ASYNC_SAVE=1``: ``jd.checkpoint`` writes in the background (``torch.distributed.checkpoint.async_save``)."""
    keep: int | None = None
    """``JD_KEEP``: checkpoints kept by ``jd.checkpoint`` (older ones are pruned; ``None``: all)."""
    telemetry_interval_s: float = 1.0
    """``JD_TELEMETRY_INTERVAL_S``: seconds between writes of the buffered ``jd.log`` calls (each call is kept whole;
    0 writes each call at once)."""
    telemetry_stdout: bool = False
    """``JD_TELEMETRY_STDOUT=1``: also print each record after the sentinel on stdout (for log-stream back-ends)."""
    tp: int = 1
    """``JD_TP``: tensor-parallel degree (innermost mesh dimension, inside a node)."""
    pp: int = 1
    """``JD_PP``: pipeline-parallel degree (outermost mesh dimension)."""
    cp: int = 1
    """``JD_CP``: context-parallel degree (the sequence split across ranks)."""
    ep: int = 1
    """``JD_EP``: expert-parallel degree (borrows ranks from the data-parallel x context-parallel dims)."""
    sp: bool = False
    """``JD_SP=1``: sequence parallelism with tensor parallelism (norms and residuals split along the sequence)."""
    pp_schedule: str = "1f1b"
    """``JD_PP_SCHEDULE``: the pipeline schedule, ``gpipe``, ``1f1b`` or ``interleaved-1f1b``."""
    pp_virtual: int = 0
    """``JD_PP_VIRTUAL``: pipeline stages per rank (``interleaved-1f1b`` needs >= 2; 0: 2 for it, else 1)."""
    microbatches: int = 0
    """``JD_MICROBATCHES``: micro-batches per optimizer step in :func:`jupyter_dist.worker.train_step` (the plan's
    gradient accumulation; 0: the number of pipeline stages under pipeline parallelism, else 1)."""
    ac: str = "none"
    """``JD_AC``: activation checkpointing of the repeated blocks, named as the planner names it
    (:data:`~jupyter_dist.plan.training.AC_NAMES`): ``none``, ``selective`` (the attention core is recomputed),
    ``op`` (torchtitan's op-level policy), ``layer:K`` (every K-th block fully) or ``full`` (every block)."""
    profile: str = ""
    """``JD_PROFILE``: the steps whose ``torch.profiler`` trace each rank writes, ``START:STOP`` or ``STEP``
    (``""``: no profiler; see :mod:`jupyter_dist.worker._profile`)."""
    dp_replicate: int = 1
    """``JD_DP_REPLICATE``: data-parallel replicas across which FSDP2 does not shard (HSDP's outer dimension); the
    data-parallel shard degree is what is left: ``world / (pp * dp_replicate * cp * tp)``."""
    fused: str = "auto"
    """``JD_FUSED``: a torch Adam/AdamW/SGD steps with its fused kernel: ``auto`` (on CUDA), ``1`` (also elsewhere),
    ``0`` (never); see :mod:`jupyter_dist.worker._speed`."""
    compile: str = "auto"
    """``JD_COMPILE``: ``torch.compile`` of each repeated block: ``auto`` (on CUDA), ``1`` (also elsewhere), ``0``
    (never); a failure falls back to eager with one log line."""
    fp8_recipe: str = "tensorwise"
    """``JD_FP8_RECIPE``: the scaling of ``JD_PRECISION=fp8``, ``tensorwise`` (one scale per tensor; FSDP2 gathers
    the weights in float8) or ``rowwise``."""
    fp8_emulate: bool = False
    """``JD_FP8_EMULATE=1``: ``JD_PRECISION=fp8`` through torchao's emulation (tests on CPU; no FP8 hardware)."""
    versions: str = ""
    """``JD_VERSIONS``: the kernel's package versions (``torch=2.13.0,cloudpickle=3.1.1``) that each rank of a cluster
    run compares with its own before the cell runs (``jupyter_dist.launch.remote_env``); empty: no check."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise WorkerError(f"WORLD_SIZE={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise WorkerError(f"RANK={self.rank} must be in [0, WORLD_SIZE={self.world_size})")
        if self.precision not in PRECISIONS:
            raise WorkerError(f"JD_PRECISION={self.precision!r} is not valid; valid: {', '.join(PRECISIONS)}")
        if self.heartbeat_s < 0:
            raise WorkerError(f"JD_HEARTBEAT_S={self.heartbeat_s} must be >= 0 (0 turns heartbeats off)")
        if self.checkpoint_every < 0:
            raise WorkerError(f"JD_CHECKPOINT_EVERY={self.checkpoint_every} must be >= 0 (0: no periodic saves)")
        if self.keep is not None and self.keep < 1:
            raise WorkerError(f"JD_KEEP={self.keep} must be >= 1")
        if self.pp_schedule not in PP_SCHEDULES:
            raise WorkerError(f"JD_PP_SCHEDULE={self.pp_schedule!r} is not valid; valid: {', '.join(PP_SCHEDULES)}")
        if self.pp_virtual < 0 or self.microbatches < 0:
            raise WorkerError("JD_PP_VIRTUAL and JD_MICROBATCHES must be >= 0 (0: automatic)")
        if self.pp_schedule == "interleaved-1f1b" and self.pp_virtual == 1:
            raise WorkerError("JD_PP_SCHEDULE=interleaved-1f1b needs JD_PP_VIRTUAL >= 2 stages per rank")
        try:
            parse_checkpointing(self.ac, what="JD_AC")
        except PlanInputError:
            raise WorkerError(f"JD_AC={self.ac!r} is not valid; valid: {', '.join(AC_NAMES)}") from None
        for dim in ("tp", "pp", "cp", "ep", "dp_replicate"):
            value = getattr(self, dim)
            if value < 1:
                raise WorkerError(f"JD_{dim.upper()}={value} must be >= 1")
        if self.distributed:
            try:  # the one "the degrees divide the world" check, worded for the worker's environment
                ParallelDims.split(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, dp_replicate=self.dp_replicate)
            except DegreesDoNotDivide as exc:
                raise WorkerError(
                    f"pp ({self.pp}) x dp_replicate ({self.dp_replicate}) x cp ({self.cp}) x tp ({self.tp}) = "
                    f"{exc.model} does not divide WORLD_SIZE={self.world_size}; launch a multiple of {exc.model} "
                    "processes"
                ) from None
        if self.profile:
            try:
                parse_window(self.profile)
            except WorkerError as e:
                raise WorkerError(f"JD_PROFILE: {e}") from None
        if self.fp8_recipe not in FP8_RECIPES:
            raise WorkerError(f"JD_FP8_RECIPE={self.fp8_recipe!r} is not valid; valid: {', '.join(FP8_RECIPES)}")
        for name in ("fused", "compile"):
            if getattr(self, name) not in SPEED_VALUES:
                raise WorkerError(f"JD_{name.upper()}={getattr(self, name)!r} is not valid; valid: "
                                  f"{', '.join(SPEED_VALUES)}")  # fmt: skip
        if self.telemetry_interval_s < 0:
            raise WorkerError(
                f"JD_TELEMETRY_INTERVAL_S={self.telemetry_interval_s} must be >= 0 (0 writes every jd.log call)"
            )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read the contract from ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        distributed = started_by_torchrun(env)
        strategy = env.get("JD_STRATEGY", "").strip() or "none"
        if strategy.lower() != "none":
            try:
                strategy = get_strategy(strategy).name
            except JupyterDistError as e:
                raise WorkerError(f"JD_STRATEGY: {e}") from None
        else:
            strategy = "none"
        heartbeat = _float(env, "JD_HEARTBEAT_S", 2.0)
        interval = _float(env, "JD_TELEMETRY_INTERVAL_S", 1.0)
        world_size = _int(env, "WORLD_SIZE", 1) if distributed else 1
        run_dir = env.get("JD_RUN_DIR") or None
        ds_config = env.get("JD_DS_CONFIG") or None
        if ds_config and run_dir and not os.path.isabs(ds_config):
            ds_config = os.path.join(run_dir, ds_config)
        return cls(
            distributed=distributed,
            rank=_int(env, "RANK", 0) if distributed else 0,
            world_size=world_size,
            local_rank=_int(env, "LOCAL_RANK", 0) if distributed else 0,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world_size) if distributed else 1,
            run_dir=run_dir,
            strategy=strategy,
            ds_config=ds_config,
            precision=(env.get("JD_PRECISION", "").strip().lower() or "fp32"),
            log_stdio=env.get("JD_LOG_STDIO", "") == "1",
            heartbeat_s=heartbeat,
            telemetry_interval_s=interval,
            checkpoint_every=_int(env, "JD_CHECKPOINT_EVERY", 0),
            keep=_int(env, "JD_KEEP", 0) or None,
            async_save=env.get("JD_ASYNC_SAVE", "") == "1",
            telemetry_stdout=env.get("JD_TELEMETRY_STDOUT", "") == "1",
            tp=_int(env, "JD_TP", 1),
            pp=_int(env, "JD_PP", 1),
            cp=_int(env, "JD_CP", 1),
            ep=_int(env, "JD_EP", 1),
            sp=env.get("JD_SP", "") == "1",
            dp_replicate=_int(env, "JD_DP_REPLICATE", 1),
            ac=(env.get("JD_AC", "").strip().lower() or "none"),
            pp_schedule=(env.get("JD_PP_SCHEDULE", "").strip().lower() or "1f1b"),
            pp_virtual=_int(env, "JD_PP_VIRTUAL", 0),
            microbatches=_int(env, "JD_MICROBATCHES", 0),
            profile=env.get("JD_PROFILE", "").strip(),
            versions=env.get("JD_VERSIONS", "").strip(),
            fp8_recipe=env.get("JD_FP8_RECIPE", "").strip().lower() or "tensorwise",
            fp8_emulate=env.get("JD_FP8_EMULATE", "") == "1",
            fused=env.get("JD_FUSED", "").strip().lower() or "auto",
            compile=env.get("JD_COMPILE", "").strip().lower() or "auto",
        )

    @classmethod
    def for_launch(cls, *, world_size: int = 1, **fields: Any) -> WorkerEnv:
        """The contract a launcher hands to ``world_size`` processes (validated here, before anything starts)."""
        return cls(distributed=world_size > 1, world_size=world_size, **fields)

    def to_environ(self) -> dict[str, str]:
        """The ``JD_*`` variables that make :meth:`from_environ` read this contract back: their one writer.

        ``JD_STRATEGY`` and ``JD_PRECISION`` are always written, every other variable only when it differs from its
        default (a dry run shows what was chosen, not every knob). The torchrun variables (``RANK``, ...) are the
        launcher's to set.
        """
        out: dict[str, str] = {}
        for name, var in ENV_VARS.items():
            value = getattr(self, name)
            if value == _DEFAULTS[name] and name not in ("strategy", "precision"):
                continue
            out[var] = "1" if value is True else repr(value) if isinstance(value, float) else str(value)
        return out

    @property
    def dims(self) -> ParallelDims:
        """The degrees this process runs with, as the plan names them (``dp``: what ``WORLD_SIZE`` leaves; at least 1).

        Raises ``ParallelismError`` for degrees no plan can have (``ep`` that does not divide ``dp x cp``).
        """
        dp = max(1, self.world_size // (self.tp * self.pp * self.cp))
        return ParallelDims(dp=dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, sp=self.sp,
                            dp_replicate=self.dp_replicate)  # fmt: skip

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks FSDP2 shards over (``world / (pp * dp_replicate * cp * tp)``)."""
        return max(1, self.world_size // (self.pp * self.dp_replicate * self.cp * self.tp))

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank holds (virtual stages of the interleaved schedule)."""
        return stages_per_rank(self.pp_schedule, self.pp_virtual)

    @property
    def model_parallel(self) -> bool:
        """Any of tp, pp, cp, ep above 1."""
        return max(self.tp, self.pp, self.cp, self.ep) > 1

    @property
    def family(self) -> str:
        """``"none"``, ``"ddp"``, ``"fsdp"`` (FSDP1 wrapper), ``"fsdp2"`` or ``"deepspeed"``.

        ``zero1`` with model parallelism is ``"fsdp2"`` (see :attr:`reshard_after_forward`): DeepSpeed's engine
        cannot take DTensors, and FSDP2 without resharding after forward keeps ZeRO-1's promise.
        """
        if self.zero1_as_fsdp2:
            return "fsdp2"
        return "none" if self.strategy == "none" else get_strategy(self.strategy).family

    @property
    def zero1_as_fsdp2(self) -> bool:
        """``zero1`` with tp/pp/cp/ep: run as FSDP2 with ``reshard_after_forward=False`` over the data-parallel dims.

        Optimizer states and gradients sharded, parameters gathered once per step and kept from forward to backward
        (memory at most ZeRO-1's, which keeps them whole); an all-gather plus a reduce-scatter per step, the volume
        of ZeRO-1's all-reduce (Megatron-LM's distributed optimizer, torchtitan's ``reshard_after_forward=False``).
        """
        spec = STRATEGIES.get(self.strategy)
        return self.model_parallel and spec is not None and spec.fsdp2_with_model_parallelism

    @property
    def reshard_after_forward(self) -> bool:
        """Whether FSDP2 frees the gathered parameters after forward (all but ``zero1`` under model parallelism)."""
        return not self.zero1_as_fsdp2


ENV_VARS: dict[str, str] = {
    "run_dir": "JD_RUN_DIR", "strategy": "JD_STRATEGY", "ds_config": "JD_DS_CONFIG", "precision": "JD_PRECISION",
    "log_stdio": "JD_LOG_STDIO", "heartbeat_s": "JD_HEARTBEAT_S", "checkpoint_every": "JD_CHECKPOINT_EVERY",
    "async_save": "JD_ASYNC_SAVE", "keep": "JD_KEEP", "telemetry_interval_s": "JD_TELEMETRY_INTERVAL_S",
    "telemetry_stdout": "JD_TELEMETRY_STDOUT", "tp": "JD_TP", "pp": "JD_PP", "cp": "JD_CP", "ep": "JD_EP",
    "sp": "JD_SP", "dp_replicate": "JD_DP_REPLICATE", "ac": "JD_AC",
    "pp_schedule": "JD_PP_SCHEDULE", "pp_virtual": "JD_PP_VIRTUAL", "microbatches": "JD_MICROBATCHES",
    "profile": "JD_PROFILE", "fused": "JD_FUSED", "compile": "JD_COMPILE",
    "fp8_recipe": "JD_FP8_RECIPE", "fp8_emulate": "JD_FP8_EMULATE",
    "versions": "JD_VERSIONS",
}  # fmt: skip
""":class:`WorkerEnv` field -> the ``JD_*`` variable it is read from (every JD_ field; the rest are torchrun's)."""

_DEFAULTS = {f.name: f.default for f in fields(WorkerEnv) if f.name in ENV_VARS}
