"""The training shape: batch, sequence, precision, optimizer, recomputation (stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, TypeVar

from ..errors import PlanInputError
from .pipeline import PP_SCHEDULES, stages_per_rank

__all__ = [
    "Precision", "OptimizerKind", "Checkpointing", "TrainingShape", "TORCH_DTYPES", "parse_enum", "precision_names",
    "AC_NAMES", "fp8_strategy_problem", "parse_checkpointing", "checkpointing_name",
]  # fmt: skip

E = TypeVar("E", bound=Enum)


class Precision(str, Enum):
    """Numeric format of training (names follow PyTorch Lightning's ``precision=`` values)."""

    BF16_MIXED = "bf16-mixed"
    """bf16 compute, fp32 master weights and optimizer states."""
    FP16_MIXED = "fp16-mixed"
    """fp16 compute with dynamic loss scaling, fp32 master weights and optimizer states."""
    BF16_TRUE = "bf16-true"
    """Everything in bf16 (no fp32 master copy)."""
    FP32 = "fp32"
    """Everything in fp32."""
    FP8 = "fp8"
    """The repeated blocks' linear layers multiply in FP8 (torchao ``Float8Linear``, dynamic scaling), everything else
    in bf16, fp32 master weights and optimizer states: torchtitan's float8 recipe (fp32 parameters, FSDP2 mixed
    precision bf16). Needs FP8 tensor cores (:func:`~jupyter_dist.plan.hardware.fp8_problem`)."""

    @property
    def compute_dtype(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"fp32"``: the dtype matrix multiplies run in (autocast's, FSDP's param dtype).

        ``fp8`` answers ``"bf16"``: what runs outside the blocks' FP8 linears (attention, the head, the rest) and the
        dtype around them; the planner's time model adds the FP8 part itself (:func:`.perf.compute_parts`).
        """
        return {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-true": "bf16", "fp32": "fp32", "fp8": "bf16"}[
            self.value
        ]

    @property
    def is_mixed(self) -> bool:
        """fp32 master weights and optimizer states under low-precision compute: bf16-mixed, fp16-mixed, fp8."""
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED, Precision.FP8)

    @property
    def bytes_per_activation(self) -> int:
        """Bytes of one activation element."""
        return 4 if self is Precision.FP32 else 2


TORCH_DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
""":attr:`Precision.compute_dtype` -> the ``torch`` dtype's attribute name (``getattr(torch, TORCH_DTYPES[d])``)."""


def fp8_strategy_problem(family: str, tp: int = 1) -> str | None:
    """Why ``jd.wrap`` cannot run ``fp8`` with this strategy family and tensor-parallel degree (one line), or ``None``.

    The worker refuses the same (:func:`jupyter_dist.worker._float8.convert_float8`): torchao's ``Float8Linear``
    composes with FSDP2 (float8 all-gather), FSDP1 and DDP (torchao float8 README, torchtitan docs/float8.md), not
    with DeepSpeed's engine, and tensor parallelism needs torchao's float8 parallel styles, not wired yet.
    """
    if family == "deepspeed":
        return (
            "fp8 runs torchao's Float8Linear, which jd.wrap does not put under DeepSpeed's engine (torchao's float8 "
            "composes with FSDP2, FSDP1 and DDP); use fsdp2/ddp for fp8, or bf16-mixed with DeepSpeed"
        )
    if tp > 1:
        return (
            f"fp8 with tensor parallelism (tp{tp}) is not wired yet (it needs torchao's float8 parallel styles); "
            "run fp8 with fsdp2/ddp, or bf16-mixed with tp"
        )
    return None


def precision_names() -> list[str]:
    """Every ``--precision`` / ``JD_PRECISION`` value, the default (bf16-mixed) first.

    ``fp8`` comes last: it needs FP8 tensor cores (:func:`~jupyter_dist.plan.hardware.fp8_problem`).
    """
    return [p.value for p in Precision]


class OptimizerKind(str, Enum):
    """Optimizer, which sets the bytes of state per parameter."""

    ADAMW = "adamw"
    """Adam with decoupled weight decay: two states (momentum, variance)."""
    ADAMW_8BIT = "adamw-8bit"
    """bitsandbytes 8-bit AdamW: two 1-byte states (Dettmers et al. 2022)."""
    SGD = "sgd"
    """SGD with momentum: one state."""


class Checkpointing(str, Enum):
    """Activation checkpointing (recomputation), named as torchtitan, Megatron-LM and Hugging Face name it.

    The user-facing names (``--checkpointing``, ``JD_AC``) are :data:`AC_NAMES`; ``layer:K`` is :attr:`LAYER` with
    :attr:`TrainingShape.checkpoint_every` = K.
    """

    NONE = "none"
    """Store every activation (HF ``gradient_checkpointing=False``; torchtitan ``mode = "none"``)."""
    SELECTIVE = "selective"
    """Korthikanti et al. 2022's selective recomputation: recompute the attention core only (Megatron-LM
    ``--recompute-granularity selective``)."""
    OP = "op"
    """PyTorch op-level selective checkpointing with torchtitan's policy: keep the outputs of the attention kernel
    and of every other matmul, recompute the rest (torchtitan ``mode = "selective"``, ``selective_ac_option =
    "op"``)."""
    LAYER = "layer"
    """Every K-th block fully checkpointed, the others store everything (torchtitan ``selective_ac_option = K``)."""
    FULL = "full"
    """Store only each block's input; recompute the block in backward (Megatron-LM ``--recompute-granularity full``,
    HF ``gradient_checkpointing=True``, torchtitan ``mode = "full"``)."""


AC_NAMES: tuple[str, ...] = ("none", "selective", "op", "layer:K", "full")
"""The activation-checkpointing names users write (planner ``--checkpointing``, wizard, worker ``JD_AC``)."""


def parse_checkpointing(value: str | Checkpointing, *, what: str = "checkpointing") -> tuple[Checkpointing, int]:
    """``"layer:3"`` -> ``(Checkpointing.LAYER, 3)``, ``"full"`` -> ``(Checkpointing.FULL, 1)``; the one table.

    ``layer`` alone means every second block (torchtitan's example ``selective_ac_option = "2"``).
    """
    if isinstance(value, Checkpointing):
        return value, (2 if value is Checkpointing.LAYER else 1)
    key = str(value).strip().lower().replace("_", "-")
    name, sep, every = key.partition(":")
    if name == "layer":
        if not sep:
            return Checkpointing.LAYER, 2
        if not every.isdigit() or int(every) < 1:
            raise PlanInputError(f"{what} {value!r}: layer:K needs a positive integer K (every K-th block)")
        return Checkpointing.LAYER, int(every)
    if sep:
        raise PlanInputError(f"unknown {what} {value!r}; valid: {', '.join(AC_NAMES)}")
    key = _ALIASES.get(key, key)
    for member in Checkpointing:
        if member.value == key:
            return member, 1
    raise PlanInputError(f"unknown {what} {value!r}; valid: {', '.join(AC_NAMES)}")


def checkpointing_name(mode: Checkpointing, every: int = 1) -> str:
    """Inverse of :func:`parse_checkpointing`: the name a user writes (``"layer:3"``)."""
    return f"layer:{every}" if mode is Checkpointing.LAYER else mode.value


_ALIASES: dict[str, str] = {
    "bf16": "bf16-mixed", "fp16": "fp16-mixed", "16-mixed": "fp16-mixed", "bf16-pure": "bf16-true",
    "pure-bf16": "bf16-true", "float8": "fp8", "fp8-mixed": "fp8",
    "32": "fp32", "32-true": "fp32", "float32": "fp32", "adam": "adamw",
    "adamw8bit": "adamw-8bit", "adamw-8": "adamw-8bit", "8bit-adamw": "adamw-8bit", "sgd-momentum": "sgd",
    "off": "none", "no": "none", "false": "none", "on": "full", "true": "full",
}  # fmt: skip


def parse_enum(enum: type[E], value: str | E, *, what: str) -> E:
    """Parse a user string into ``enum`` with aliases; the error lists the valid values."""
    if isinstance(value, enum):
        return value
    key = str(value).strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    for member in enum:
        if member.value == key:
            return member
    valid = ", ".join(m.value for m in enum)
    raise PlanInputError(f"unknown {what} {value!r}; valid: {valid}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingShape:
    """What one optimizer step looks like."""

    micro_batch: int = 1
    """Sequences per GPU per forward/backward pass."""
    seq_len: int = 2048
    """Tokens per sequence."""
    grad_accum: int | None = None
    """Micro-batches accumulated per optimizer step; ``None`` derives it from ``global_batch`` (or 1)."""
    global_batch: int | None = None
    """Sequences per optimizer step across all data-parallel ranks; exclusive with ``grad_accum``."""
    precision: Precision = Precision.BF16_MIXED
    """Numeric format (see :class:`Precision`)."""
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    """Optimizer (see :class:`OptimizerKind`)."""
    checkpointing: Checkpointing = Checkpointing.NONE
    """Activation checkpointing (see :class:`Checkpointing`; a string such as ``"layer:3"`` sets both fields)."""
    checkpoint_every: int = 1
    """With :attr:`Checkpointing.LAYER`: every how many blocks one is fully checkpointed (``layer:K``)."""
    flash_attention: bool = True
    """Fused attention that never stores the seq x seq score matrix (FlashAttention, SDPA)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule under pipeline parallelism (``JD_PP_SCHEDULE``): ``gpipe``, ``1f1b`` or ``interleaved-1f1b``;
    it decides how many micro-batches' activations a stage holds at once and the bubble."""
    pp_virtual: int = 0
    """Pipeline stages per rank (``JD_PP_VIRTUAL``); 0: 2 for ``interleaved-1f1b``, else 1."""
    pp_light_edges: bool = False
    """Llama 3's pipeline layout: the embedding and the output layer each take a block's place, so the first and the
    last stage hold one block fewer (:func:`~.pipeline.light_edge_bounds`; with one block per virtual stage an edge
    chunk holds only the embedding or the output). The planner models it; the workers split stages by cost
    (:func:`~.pipeline.stage_bounds`) and do not run it, so a launch refuses a plan made with it."""
    compile: bool | None = None
    """Regional ``torch.compile`` of each repeated block (``JD_COMPILE``); ``None``: what the worker does by default,
    on for GPUs and off for CPU processes (:meth:`speed_options`)."""
    fused_optimizer: bool | None = None
    """The optimizer's fused implementation (``JD_FUSED``) instead of torch's default ``foreach`` one; ``None``: the
    worker's default, on for GPUs and off for CPU processes (:meth:`speed_options`)."""

    def __post_init__(self) -> None:
        for f in ("micro_batch", "seq_len"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanInputError(f"{f.replace('_', '-')} must be a positive integer, got {value!r}")
        for f in ("grad_accum", "global_batch"):
            value = getattr(self, f)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PlanInputError(f"{f.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.grad_accum is not None and self.global_batch is not None:
            raise PlanInputError("give grad-accum or global-batch, not both (global = micro x accum x dp)")
        object.__setattr__(self, "precision", parse_enum(Precision, self.precision, what="precision"))
        object.__setattr__(self, "optimizer", parse_enum(OptimizerKind, self.optimizer, what="optimizer"))
        every = self.checkpoint_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise PlanInputError(f"checkpoint-every must be a positive integer, got {every!r}")
        mode, parsed = parse_checkpointing(self.checkpointing)
        if ":" in str(getattr(self.checkpointing, "value", self.checkpointing)) or every == 1:
            every = parsed  # "layer:K" names K itself; "layer" alone is every second block
        object.__setattr__(self, "checkpointing", mode)
        object.__setattr__(self, "checkpoint_every", every if mode is Checkpointing.LAYER else 1)
        schedule = str(self.pp_schedule).strip().lower().replace("_", "-")
        if schedule not in PP_SCHEDULES:
            raise PlanInputError(f"unknown pp-schedule {self.pp_schedule!r}; valid: {', '.join(PP_SCHEDULES)}")
        object.__setattr__(self, "pp_schedule", schedule)
        if not isinstance(self.pp_light_edges, bool):
            raise PlanInputError(f"pp-light-edges must be True or False, got {self.pp_light_edges!r}")
        for f in ("compile", "fused_optimizer"):
            value = getattr(self, f)
            if value is not None and not isinstance(value, bool):
                raise PlanInputError(f"{f.replace('_', '-')} must be True, False or None (the default), got {value!r}")
        virtual = self.pp_virtual
        if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 0:
            raise PlanInputError(f"pp-virtual must be a non-negative integer, got {virtual!r}")
        if virtual > 1 and schedule != "interleaved-1f1b":
            raise PlanInputError(
                f"pp-virtual {virtual}: more than one stage per rank needs pp-schedule interleaved-1f1b"
            )
        if virtual == 1 and schedule == "interleaved-1f1b":
            raise PlanInputError("pp-schedule interleaved-1f1b needs pp-virtual >= 2 stages per rank (0: 2)")

    def speed_options(self, vendor: str) -> tuple[bool, bool]:
        """``(compile, fused optimizer)`` on an accelerator of ``vendor`` (``"cpu"`` for CPU processes).

        The fields where given, else the worker's defaults (:mod:`jupyter_dist.worker._speed`: on for CUDA, off on CPU).
        """
        gpu = vendor != "cpu"
        compiled = gpu if self.compile is None else self.compile
        fused = gpu if self.fused_optimizer is None else self.fused_optimizer
        return compiled, fused

    @property
    def pp_stages_per_rank(self) -> int:
        """Pipeline stages each rank holds under :attr:`pp_schedule` (2 for interleaved 1F1B unless given)."""
        return stages_per_rank(self.pp_schedule, self.pp_virtual)

    @property
    def checkpointing_name(self) -> str:
        """The checkpointing as users write it: ``none``, ``selective``, ``op``, ``layer:K``, ``full``."""
        return checkpointing_name(self.checkpointing, self.checkpoint_every)

    def accumulation_for(self, dp: int) -> int:
        """Micro-batches per step for ``dp`` data-parallel ranks; raises when the global batch does not split."""
        if self.global_batch is None:
            return self.grad_accum or 1
        per_step = self.micro_batch * dp
        if self.global_batch % per_step:
            raise PlanInputError(
                f"global batch {self.global_batch} is not a multiple of micro-batch {self.micro_batch} x "
                f"data-parallel size {dp} = {per_step}; use a multiple of {per_step}"
            )
        return self.global_batch // per_step

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict (enums as their string values; ``checkpointing`` as :attr:`checkpointing_name`)."""
        out = {f.name: (v.value if isinstance(v := getattr(self, f.name), Enum) else v) for f in fields(self)}
        out["checkpointing"] = self.checkpointing_name
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingShape:
        """Inverse of :meth:`to_dict`."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
