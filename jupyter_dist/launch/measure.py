"""What a run measured (the one measurement, with the candidate that ran) and the calibration fitted from it.

The measurement itself is :mod:`jupyter_dist.telemetry.measurement`. A rehearsal's ranks (:mod:`.rehearse`)
calibrate one candidate's memory here too (:func:`rehearsal_calibration`).

Shared by the :class:`~.run.Run` handle (its summary compares a finished run with its plan) and ``%dist_tune``
(:mod:`.tune`), which measures several candidates. Reads a run's telemetry through ``run.records(kind)``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..telemetry.measurement import WARMUP_STEPS, Measured, measure_records

__all__ = ["COMM_PARTS", "Measured", "Trial", "WARMUP_STEPS", "fit_calibration", "measure_run", "planned_peak",
           "rehearsal_calibration", "rehearsal_correction", "rehearsal_problem"]  # fmt: skip


def measure_run(run: Any, *, warmup: int = WARMUP_STEPS) -> Measured:
    """Step time, tokens/s, MFU and peak memory per rank from a run's telemetry (any finished or running Run).

    The one measurement (:func:`~jupyter_dist.telemetry.measurement.measure_records`), with the data-parallel size
    of the candidate that ran when the run knows it, and MFU from its plan's model FLOPs.
    """
    world = max(1, int(getattr(run, "world_size", 0) or 0)) or None
    m = measure_records(run.records(), warmup=warmup, dp_size=_dp_size(run, world), world_size=world)
    predicted = _candidate_of(run)
    if predicted is not None and m.tokens_per_s and predicted.time.tokens_per_s and predicted.time.mfu:
        # the same model on the same GPUs: MFU scales with tokens/s
        m = replace(m, mfu=predicted.time.mfu * m.tokens_per_s / predicted.time.tokens_per_s)
    return m


def _candidate_of(run: Any) -> Any:
    plan = getattr(run, "plan", None)
    name = getattr(run, "candidate", None)
    if plan is None:
        return None
    try:
        return plan.candidate(name) if name else plan.best
    except (KeyError, AttributeError):
        return None


def _dp_size(run: Any, world: int | None) -> int | None:
    """Data-parallel ranks of the candidate that ran, when the run knows it (else what the workers said)."""
    plan = getattr(run, "plan", None)
    name = getattr(run, "candidate", None)
    if plan is not None and name and world:
        try:
            return int(plan.candidate(name).dims.dp) if plan.world_size == world else None
        except (KeyError, AttributeError):
            pass
    return None


def planned_peak(memory: Any, kind: str) -> int:
    """The plan's peak in the measurement's terms (bytes).

    CUDA's ``peak_allocated`` sees neither the CUDA context nor the caching allocator's reserve, so those are
    taken off for ``"cuda"``; a process's RSS holds everything.
    """
    if kind != "cuda":
        return int(memory.total)
    return int(memory.total - memory.detail.get("cuda_context", 0) - memory.detail.get("allocator_reserve", 0))


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    """One candidate at one micro-batch size: predicted, and what the run measured."""

    candidate: str
    """Candidate name (``"fsdp2"``, ``"fsdp2+tp2+sp"``)."""
    micro_batch: int
    """Sequences per rank per micro-batch."""
    predicted: Any
    """The plan's :class:`~jupyter_dist.plan.plan.Candidate` for this shape."""
    status: str
    """``"ok"``, ``"does not fit (measured)"`` or ``"failed (measured)"``."""
    measured: Measured | None = None
    """The measurement (``None`` when the run produced no step)."""
    error: str = ""
    """Why it failed, one line."""
    run_dir: str = ""
    """The trial's run directory."""
    accelerator: Any = None
    """The :class:`~jupyter_dist.plan.hardware.Accelerator` the prediction was made for."""

    @property
    def ok(self) -> bool:
        """Whether the trial measured a step time."""
        return self.status == "ok" and self.measured is not None and self.measured.step_time_s is not None

    @property
    def label(self) -> str:
        """``candidate @ mb N``."""
        return f"{self.candidate} @ mb {self.micro_batch}"

    def row(self) -> list[str]:
        """Table cells: trial, predicted / measured step, tokens/s, peak memory, status."""
        p = self.predicted
        m = self.measured
        mib = 2**20

        def fmt(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        return [
            self.label,
            fmt(p.time.step_time_s, ".4g"), fmt(m.step_time_s if m else None, ".4g"),
            fmt(p.time.tokens_per_s, ",.0f"), fmt(m.tokens_per_s if m else None, ",.0f"),
            fmt(planned_peak(p.memory, m.memory_kind if m else "rss") / mib, ",.0f"),
            fmt(m.peak / mib if m and m.peak else None, ",.0f"),
            self.status if not self.error else f"{self.status}: {self.error}",
        ]  # fmt: skip


COMM_PARTS = ("dp_comm", "tp_comm", "pp_p2p", "cp_comm", "ep_comm", "offload")
"""Breakdown parts that scale with the links' speed (the calibration's ``comm_scale``)."""


def fit_calibration(trials: Sequence[Trial], *, source: str = "") -> Any:
    """Fit the matmul rate, per-operator cost and communication speed to the trials' measured step times.

    Each trial's predicted step is split into the matmul part ``a`` (at the published rate), the overhead part ``b``
    (at the published per-operator cost), the communication parts ``c`` and the rest ``d``; the measured time
    ``T = a x + b y + c z + d`` is solved by least squares for the three scales, each trial's equation divided by its
    ``T`` (every trial counts by its relative error, so a slow one does not decide the fast ones' prediction), with a
    weak pull towards 1 (the published figures), so that trials which cannot tell two parts apart share the
    correction between them. The matmul scale stops where the fitted rate would pass the peak.
    ``None`` when no trial measured a step.
    """
    from ..plan.calibration import Calibration, hardware_key

    ok = [t for t in trials if t.ok and t.accelerator is not None]
    if not ok:
        return None
    acc = ok[0].accelerator
    rows = []
    for t in ok:
        bd = t.predicted.time.breakdown
        a, b = bd.get("matmul", 0.0), bd.get("overhead", 0.0)
        c = sum(bd.get(k, 0.0) for k in COMM_PARTS)
        d = t.predicted.time.step_time_s - a - b - c
        w = 1.0 / t.measured.step_time_s  # type: ignore[union-attr]
        rows.append(([a * w, b * w, c * w], (t.measured.step_time_s - d) * w))  # type: ignore[union-attr]
    x, y, z = _ridge(rows, low=(max(LOW, acc.matmul_efficiency), LOW, LOW))
    errors = [abs(t.predicted.time.step_time_s / t.measured.step_time_s - 1) for t in ok]  # type: ignore[union-attr]
    # the offset replaces any older one the prediction already carried
    offsets = [t.measured.peak - (planned_peak(t.predicted.memory, t.measured.memory_kind)
                                  - t.predicted.memory.detail.get("calibration", 0))
               for t in ok if t.measured and t.measured.peak]  # fmt: skip
    return Calibration(
        hardware_key=hardware_key(acc.name), accelerator=acc.name,
        matmul_efficiency=min(1.0, max(1e-4, acc.matmul_efficiency / x)), op_overhead_s=acc.op_overhead_s * y,
        comm_scale=z, memory_offset_bytes=int(max(offsets, default=0)), trials=len(ok),
        step_error=statistics.fmean(errors), measured_at=time.time(), source=source,
    )  # fmt: skip


def rehearsal_problem(plan: Any, predicted: Any, ranks: Sequence[Any]) -> str | None:
    """Why rehearsed ``ranks`` cannot calibrate ``plan``'s candidate ``predicted``, one line; ``None`` when they can.

    Only a rehearsal on the plan's own device stands for its memory: CPU ranks for a CPU plan, ranks on the plan's GPU
    (the rule ``%dist_tune`` applies: an ``h100-80gb`` plan and a device named H100) for a GPU plan.
    """
    if plan is None or predicted is None:
        return "it has no plan to calibrate (rehearse a Plan's candidate)"
    failed = [r for r in ranks if not r.ok]
    if failed:
        return f"rank {failed[0].rank} could not be rehearsed, and the worst rank decides the peak"
    if not ranks:
        return "no rank was rehearsed"
    acc = plan.hardware.accelerator
    devices = {r.device for r in ranks}
    if acc.vendor == "cpu":
        if devices != {"cpu"}:
            gpu = next((str(r.raw.get("device_name") or r.device) for r in ranks if r.device != "cpu"), "")
            return (f"a rehearsal on {gpu} cannot calibrate a plan for cpu processes: its memory is the CUDA "
                    "allocator's, not a CPU process's; rehearse with --device cpu, or plan for this GPU "
                    "(--gpu)")  # fmt: skip
        return None
    if "cpu" in devices:
        return (f"a rehearsal on cpu cannot calibrate a plan for {acc.name}: its memory is for that GPU's CUDA "
                "allocator (its kernels, workspaces and autocast copies), not a CPU process's; rehearse on that "
                "GPU, or plan with --gpu cpu")  # fmt: skip
    family = acc.name.split("-")[0].lower()
    other = [n for n in (str(r.raw.get("device_name", "")) for r in ranks) if family not in n.lower().replace(" ", "")]
    if other:
        return (f"a rehearsal on {other[0] or 'this GPU'} cannot calibrate a plan for {acc.name}: its memory is "
                f"this GPU's; rehearse on a {acc.label}, or plan for this GPU (--gpu)")  # fmt: skip
    return None


def rehearsal_correction(predicted: Any, ranks: Sequence[Any]) -> int:
    """The worst rehearsed rank's step peak minus the plan's, bytes, as the rehearsal's table compares them.

    The plan's peak is taken without any calibration it already carried, so a new rehearsal replaces an older
    correction rather than adding to it.
    """
    mem = predicted.memory
    worst = max(r.measured_peak for r in ranks)
    return int(worst - (planned_peak(mem, "cuda") - mem.detail.get("calibration", 0)))


def rehearsal_calibration(plan: Any, candidate: str, predicted: Any, ranks: Sequence[Any]) -> Any:
    """The calibration of ``plan``'s hardware with ``candidate``'s memory as rehearsed, for this plan's shape.

    An existing calibration of that hardware (``%dist_tune``'s speed fit, other candidates' rehearsals) is kept and
    this candidate's entry replaced; without one, the calibration holds this entry alone (no trials: the published
    rates stay). Refused in one line (:class:`~jupyter_dist.errors.PlanInputError`) where :func:`rehearsal_problem`
    says why. Not saved here.
    """
    from ..errors import PlanInputError
    from ..plan.calibration import Calibration, hardware_key, load_calibration, plan_shape, published

    problem = rehearsal_problem(plan, predicted, ranks)
    if problem:
        raise PlanInputError(f"no calibration from this rehearsal: {problem}")
    acc = plan.hardware.accelerator
    shape = plan_shape(plan.model, plan.training, plan.hardware, plan.assumptions)
    key, correction = hardware_key(acc.name), rehearsal_correction(predicted, ranks)
    base = load_calibration(acc.name)
    if base is not None and base.hardware_key == key:
        return base.with_rehearsal(candidate, correction, shape)
    rates = published(plan.hardware).accelerator  # kept for the file's shape; no trials: never applied
    return Calibration(hardware_key=key, accelerator=acc.name, matmul_efficiency=rates.matmul_efficiency,
                       op_overhead_s=rates.op_overhead_s, memory_offset_bytes=0, trials=0, measured_at=time.time(),
                       memory_by_candidate={candidate: correction}, rehearsed_for={candidate: shape})  # fmt: skip


LOW, HIGH = 1e-2, 1e4
"""Bounds of a fitted scale: a part more than 100x off its published figure is not what the trials say."""


def _ridge(
    rows: list[tuple[list[float], float]], pull: float = 1e-3, low: Sequence[float] | None = None
) -> list[float]:
    """Scales ``s`` (one per column) minimising ``|A s - r|^2 + pull * sum n_k (s_k - 1)^2``, in [low_k, HIGH].

    ``low_k`` is ``low[k]``, LOW by default.
    ``n_k`` is the squared size of column k, so the pull is the same for every part whatever its seconds. A column
    that is zero in every row, or whose unconstrained scale leaves the bounds (the trials cannot pin it: e.g. a
    communication part too small to explain the differences between them), is held at its published value (1) and
    the others are fitted again without it.
    """
    k = len(rows[0][0])
    pinned = {i for i in range(k) if all(r[0][i] == 0.0 for r in rows)}
    while True:
        free = [i for i in range(k) if i not in pinned]
        if not free:
            return [1.0] * k
        target = [(r[0], r[1] - sum(r[0][i] for i in pinned)) for r in rows]  # pinned parts at scale 1
        solved = _solve_free(target, free, pull)
        out = [1.0] * k
        bad = []
        for i, v in zip(free, solved, strict=True):
            if (low[i] if low else LOW) <= v <= HIGH:
                out[i] = v
            else:
                bad.append((abs(v - 1.0), i))
        if not bad:
            return out
        pinned.add(max(bad)[1])  # the worst one first, then fit the rest again


def _solve_free(rows: list[tuple[list[float], float]], free: list[int], pull: float) -> list[float]:
    """The ridge normal equations over the ``free`` columns, by Gauss-Jordan elimination with partial pivoting."""
    k = len(free)
    norm = [sum(r[0][c] ** 2 for r in rows) for c in free]
    m = [[sum(r[0][ci] * r[0][cj] for r in rows) + (pull * norm[i] if i == j else 0.0) for j, cj in enumerate(free)]
         for i, ci in enumerate(free)]  # fmt: skip
    v = [sum(r[0][c] * r[1] for r in rows) + pull * norm[i] for i, c in enumerate(free)]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        v[col], v[piv] = v[piv], v[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(k):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
                v[r] -= f * v[col]
    return [v[i] / m[i][i] if m[i][i] else 1.0 for i in range(k)]
