"""A hardware calibration: the achieved matmul rate, per-operator cost, memory offset, per-candidate memory.

``%dist_tune`` measures the rates and one memory offset per rank; ``%dist_rehearse --save`` measures one candidate's
step peak for one plan (:attr:`Calibration.memory_by_candidate`, for the plan :func:`plan_shape` names). Stored per
hardware in a user-level JSON file, ``~/.cache/jupyter-dist/calibration/<hardware-key>.json`` (the folder is
``$JD_CALIBRATION_DIR`` when set), and used by later plans on the same hardware (``%dist_plan``, ``jupyter-dist
plan``), which say so in their reasons. The key is the accelerator's catalog name for GPUs (an H100 is an H100) and
``cpu-<host name>`` for CPU processes, whose speed is the machine's (stdlib only).

A calibration is for the speed options its trials ran with (:attr:`Calibration.options`: ``compile+fused``,
``eager+foreach``, with ``+fp8`` for FP8 training; :func:`options_key`): blocks compiled by ``torch.compile`` and
eager blocks have different kernels and per-operator costs, so a measurement of one never calibrates the other. Each
option set has its own file, ``<hardware-key>@<options>.json``, except eager+foreach without FP8 (what CPU processes
run by default, and what every calibration measured before the options existed), which keeps ``<hardware-key>.json``;
the rehearsed candidates' memory (keyed by the whole plan, options included) lives there too.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import PlanInputError
from .hardware import Hardware

__all__ = ["Calibration", "calibration_dir", "hardware_key", "load_calibration", "plan_shape", "published", "ENV_DIR",
           "EAGER", "options_key"]  # fmt: skip

ENV_DIR = "JD_CALIBRATION_DIR"
"""Environment variable naming the calibration folder (tests point it at a temporary one)."""


def calibration_dir() -> Path:
    """Where calibrations are kept: ``$JD_CALIBRATION_DIR``, else ``~/.cache/jupyter-dist/calibration``."""
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jupyter-dist" / "calibration"


EAGER = "eager+foreach"
"""The options key of eager blocks, torch's foreach optimizer and no FP8: the file without an ``@<options>`` suffix."""


def options_key(training: Any, vendor: str) -> str:
    """The speed options a run of ``training`` on an accelerator of ``vendor`` uses, as a calibration is keyed.

    ``compile`` or ``eager`` (the blocks), ``fused`` or ``foreach`` (the optimizer), ``+fp8`` with FP8 training:
    ``"compile+fused"``, ``"eager+foreach"``, ``"compile+fused+fp8"``. ``None`` fields resolve as the ranks run them
    (:meth:`~jupyter_dist.plan.training.TrainingShape.speed_options`).
    """
    compiled, fused = training.speed_options(vendor)
    fp8 = getattr(training.precision, "value", training.precision) == "fp8"
    return f"{'compile' if compiled else 'eager'}+{'fused' if fused else 'foreach'}{'+fp8' * fp8}"


def _file(key: str, options: str) -> Path:
    return calibration_dir() / (f"{key}.json" if options == EAGER else f"{key}@{options}.json")


def hardware_key(accelerator: str) -> str:
    """File key of a calibration: the accelerator's name, and for CPU processes the host as well."""
    name = accelerator.strip().lower()
    if name == "cpu":
        host = re.sub(r"[^a-z0-9._-]+", "-", platform.node().lower()) or "localhost"
        name = f"cpu-{host}"
    return re.sub(r"[^a-z0-9._-]+", "-", name)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """What measured runs on one hardware say about the speed and memory model."""

    hardware_key: str
    """See :func:`hardware_key`."""
    accelerator: str
    """Catalog name of the accelerator measured."""
    matmul_efficiency: float
    """Fraction of the dense peak the matmuls reached (fitted over the trials)."""
    op_overhead_s: float
    """Seconds of host-side cost per operator (fitted over the trials)."""
    memory_offset_bytes: int
    """Measured peak per rank minus the planned peak (the largest over the trials; negative: the plan was high)."""
    comm_scale: float = 1.0
    """Measured over modelled communication time (> 1: the links or the collective library are slower than the
    catalog's bus bandwidth; applied as a lower link efficiency)."""
    trials: int
    """Measured trials behind the fit (0: no speed was measured, only :attr:`memory_by_candidate`; the published
    rates stay)."""
    step_error: float = 0.0
    """Mean relative error of the predicted step time over the trials *before* calibration."""
    measured_at: float = 0.0
    """Unix time of the measurement."""
    source: str = ""
    """Where the measurements are (the tune's or run's directory)."""
    memory_by_candidate: dict[str, int] = field(default_factory=dict)
    """Candidate name (``"fsdp2+tp8"``) -> the rehearsed step peak of its worst rehearsed rank minus the planned one,
    bytes (``%dist_rehearse --save``). Used for that candidate, in a plan of the shape :attr:`rehearsed_for` names,
    instead of :attr:`memory_offset_bytes`: its planned peak is then the rehearsed one."""
    rehearsed_for: dict[str, str] = field(default_factory=dict)
    """Candidate name -> the plan its entry of :attr:`memory_by_candidate` was rehearsed for (:func:`plan_shape`)."""
    options: str = EAGER
    """The speed options the trials ran with (:func:`options_key`); the calibration is used only by plans that run
    with the same ones (a file written before this field existed: eager+foreach, what its trials ran)."""

    def __post_init__(self) -> None:
        if not 0 < self.matmul_efficiency <= 1:
            raise PlanInputError(f"calibration matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}")
        if self.op_overhead_s < 0 or self.trials < 0 or self.comm_scale <= 0:
            raise PlanInputError("calibration op_overhead_s must be >= 0, comm_scale > 0 and trials >= 0")
        if self.trials == 0 and not self.memory_by_candidate:
            raise PlanInputError("a calibration measures something: trials >= 1, or a rehearsed candidate's memory")
        if set(self.rehearsed_for) != set(self.memory_by_candidate):
            raise PlanInputError("calibration: every rehearsed candidate's memory says which plan it was measured for")
        if not re.fullmatch(r"(compile|eager)\+(fused|foreach)(\+fp8)?", self.options):
            raise PlanInputError(f"calibration options must be compile|eager + fused|foreach [+ fp8] (e.g. "
                                 f"{EAGER}), got {self.options!r}")  # fmt: skip

    def memory_for(self, shape: str) -> dict[str, int]:
        """The rehearsed candidates' memory corrections (bytes) for a plan of this :func:`plan_shape`."""
        return {c: v for c, v in self.memory_by_candidate.items() if self.rehearsed_for.get(c) == shape}

    def with_rehearsal(self, candidate: str, offset_bytes: int, shape: str) -> Calibration:
        """A copy with ``candidate``'s memory entry set (replaced) for a plan of ``shape``; the rest kept."""
        return replace(self, memory_by_candidate={**self.memory_by_candidate, candidate: int(offset_bytes)},
                       rehearsed_for={**self.rehearsed_for, candidate: shape})  # fmt: skip

    def describe(self) -> str:
        """One line: what was measured, when, and from how many trials."""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.measured_at)) if self.measured_at else "?"
        if not self.trials:
            return (f"no speed measured; the memory of {len(self.memory_by_candidate)} candidate(s) rehearsed "
                    f"({', '.join(sorted(self.memory_by_candidate))}) ({self.path()})")  # fmt: skip
        return (
            f"{self.trials} measured trial(s) ({self.options}) on {when}: matmul efficiency "
            f"{self.matmul_efficiency:.3g}, "
            f"{1e6 * self.op_overhead_s:.3g} us per operator, communication x{self.comm_scale:.3g} the model's, "
            f"memory {self.memory_offset_bytes / 2**20:+,.0f} MiB "
            f"per rank against the model ({self.path()})"
        )

    def apply(self, hardware: Hardware) -> Hardware:
        """``hardware`` with the measured rates (the plan then says it uses them); unchanged without trials."""
        if not self.trials:
            return hardware
        acc = replace(hardware.accelerator, matmul_efficiency=self.matmul_efficiency,
                      op_overhead_s=self.op_overhead_s, comm_scale=self.comm_scale,
                      calibration=self.describe())  # fmt: skip
        return replace(hardware, accelerator=acc)

    def path(self) -> Path:
        """The file this calibration is saved to."""
        return _file(self.hardware_key, self.options if self.trials else EAGER)  # rehearsals alone: the eager file

    def save(self) -> Path:
        """Write it to :meth:`path` (atomically); returns the path.

        The rehearsed candidates' memory entries of the file already there are kept unless this calibration has its
        own for the same candidate (a tune measures speed, a rehearsal one candidate's memory: neither drops the
        other's); everything else is this calibration's.
        """
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        eager = path == _file(self.hardware_key, EAGER)
        if eager:
            data["options"] = EAGER  # rehearsals alone (trials 0) are kept there, whatever plan they were for
        else:  # rehearsed memory lives in the eager file (load_calibration merges it in)
            data["memory_by_candidate"], data["rehearsed_for"] = {}, {}
        old = _read(path) if eager else None
        if old is not None and old.hardware_key == self.hardware_key:
            data["memory_by_candidate"] = {**old.memory_by_candidate, **self.memory_by_candidate}
            data["rehearsed_for"] = {**old.rehearsed_for, **self.rehearsed_for}
        from .._atomic import write_atomic

        return write_atomic(path, json.dumps(data, indent=1))

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["memory_by_candidate"] = dict(self.memory_by_candidate)
        out["rehearsed_for"] = dict(self.rehearsed_for)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """Inverse of :meth:`to_dict` (a file written before a field existed loads with its default)."""
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        if "memory_by_candidate" in fields:
            fields["memory_by_candidate"] = {str(k): int(v) for k, v in dict(fields["memory_by_candidate"]).items()}
            fields["rehearsed_for"] = {str(k): str(v) for k, v in dict(fields.get("rehearsed_for", {})).items()}
        return cls(**fields)


def plan_shape(model: Any, training: Any, hardware: Hardware, assumptions: Any = None) -> str:
    """The plan a rehearsed candidate's memory entry is for, said briefly and pinned by a digest.

    The digest covers the model, the world, the training shape and the memory model's assumptions (another plan gets
    another string); the accelerator's rates (a tune's calibration) are left out: they do not change its memory.
    """
    t = training
    world = [hardware.accelerator.name, hardware.nodes, hardware.gpus_per_node]
    whole = [model.to_dict(), t.to_dict(), world, assumptions.to_dict() if assumptions is not None else None]
    digest = hashlib.sha256(json.dumps(whole, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return (f"{model.name} on {hardware.nodes} x {hardware.gpus_per_node} {hardware.accelerator.name}, micro-batch "
            f"{t.micro_batch}, seq {t.seq_len}, {t.precision.value}, {t.optimizer.value}, checkpointing "
            f"{t.checkpointing_name} [{digest}]")  # fmt: skip


def load_calibration(accelerator: str, options: str | None = None) -> Calibration | None:
    """The saved calibration of this accelerator (on this host, for CPU) for runs with ``options``, or ``None``.

    ``options`` is an :func:`options_key` (``None``: eager+foreach, the file every calibration had before the options
    existed). A tune of other options never answers: a compiled run's rates are not an eager run's. The rehearsed
    candidates' memory of the eager file comes with every options' calibration (each entry is for one whole plan,
    its options included); with no tune of these options, a calibration of that memory alone (the published rates).
    A damaged file is ignored (``None``), as a cache should be.
    """
    key = hardware_key(accelerator)
    base = _read(_file(key, EAGER))
    if base is not None and base.options != EAGER:
        base = None  # a file renamed by hand: not what its name says
    if options is None or options == EAGER:
        return base
    own = _read(_file(key, options))
    if own is not None and own.options != options:
        own = None
    rehearsed = ({**base.memory_by_candidate}, {**base.rehearsed_for}) if base is not None else ({}, {})
    if own is not None:
        return replace(own, memory_by_candidate=rehearsed[0], rehearsed_for=rehearsed[1])
    if base is None or not base.memory_by_candidate:
        return None
    return replace(base, trials=0, memory_offset_bytes=0, step_error=0.0, options=options)


def _read(path: Path) -> Calibration | None:
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, PlanInputError):
        return None


def published(hardware: Hardware) -> Hardware:
    """``hardware`` with a file calibration taken off: the catalog's matmul rate, per-operator cost, communication.

    Figures given by hand (``--efficiency``) stay; an accelerator outside the catalog keeps its own.
    """
    from .hardware import ACCELERATORS

    acc = hardware.accelerator
    if not acc.calibration or acc.calibration.startswith("--"):
        return hardware
    base = ACCELERATORS.get(acc.name, acc)
    plain = replace(acc, matmul_efficiency=base.matmul_efficiency, op_overhead_s=base.op_overhead_s, comm_scale=1.0,
                    calibration="")  # fmt: skip
    return replace(hardware, accelerator=plain)
