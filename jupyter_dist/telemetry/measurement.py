"""One measurement of a run from its records: step time, throughput, peak memory per rank (stdlib only).

Every view of a run's speed calls :func:`measure_records` (or, live, :func:`job_rate` with the same rule): the run
summary and the runs table (:mod:`.summary`), the live panels (``ui/panels.py``), ``compare``, ``Run.summary()``,
``run.plan_check()`` and ``%dist_tune`` (``launch/measure.py``). So one run has one tokens/s wherever it is shown.

**Counting rule.** Each rank logs the tokens (or samples) *its* batch held. The ranks of one tensor, pipeline or
context-parallel group process the same batch, so the job's rate counts each data-parallel replica once:

    job rate = mean over the ranks that logged of (that rank's median rate) x data-parallel replicas

where the replicas are ``world / (tp x pp x cp)`` (expert parallelism is carved from the data-parallel ranks, which
each hold their own tokens). Each worker writes its ``dp_size`` in its ``start`` record; for records without one
(older runs, scripts that do not use ``jd``), every rank is taken as its own replica (plain data parallelism). Under
DDP or FSDP this is the sum over ranks; under ``fsdp2+tp2`` on 2 ranks it is one rank's rate, not twice it.

A rank's rate is the median over its logged calls after :data:`WARMUP_STEPS` of ``tokens / time since the previous
call`` (the ``tokens_per_s`` of its ``step`` records), and the step time is the slowest rank's median seconds per
step; steps/s (when neither tokens nor samples are logged) is its inverse.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from math import isfinite
from typing import Any

__all__ = ["WARMUP_STEPS", "RATES", "Measured", "MeasureBuilder", "measure_records", "job_rate", "replicas"]

WARMUP_STEPS = 2
"""Steps left out of the medians (first-step allocation, lazy initialisation, compilation)."""

RATES = (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"))
"""The rates a ``step`` record may carry, in order of preference, with their units."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """What one run measured."""

    step_time_s: float | None
    """Median seconds per step after the warm-up, on the slowest rank (``None``: too few steps logged)."""
    tokens_per_s: float | None
    """Tokens per second, whole job, each data-parallel replica counted once (``None``: no ``tokens`` logged)."""
    samples_per_s: float | None = None
    """Samples per second, whole job, counted like :attr:`tokens_per_s` (``None``: no ``samples`` logged)."""
    peak_bytes: dict[int, int] = field(default_factory=dict)
    """Peak memory per rank: CUDA ``peak_allocated`` on GPUs, the process's ``max_rss`` on CPU."""
    memory_kind: str = "rss"
    """``"cuda"`` or ``"rss"``: what :attr:`peak_bytes` counts."""
    steps: int = 0
    """Steps logged (the highest logged step + 1)."""
    dp_size: int | None = None
    """Data-parallel replicas the rates were counted with (``None``: no rank reported it; every rank counted)."""
    world_size: int | None = None
    """Ranks of the run (from the ``start`` records, else the ranks seen)."""
    step_time_per_rank: dict[int, float] = field(default_factory=dict)
    """Median seconds per step of each rank after the warm-up."""
    mfu: float | None = None
    """Model FLOPs utilisation from :attr:`tokens_per_s` (set where the model's FLOPs are known: the plan)."""

    @property
    def peak(self) -> int:
        """The largest rank's peak (bytes; 0 when none was recorded)."""
        return max(self.peak_bytes.values(), default=0)

    @property
    def throughput(self) -> tuple[float | None, str | None]:
        """``(value, unit)``: tokens/s, else samples/s, else steps/s, else ``(None, None)``."""
        if self.tokens_per_s is not None:
            return self.tokens_per_s, "tokens/s"
        if self.samples_per_s is not None:
            return self.samples_per_s, "samples/s"
        if self.step_time_s:
            return 1.0 / self.step_time_s, "steps/s"
        return None, None


def job_rate(per_rank: dict[int, float], *, dp_size: int | None, world_size: int | None) -> float | None:
    """The job's rate from each rank's rate, counting each data-parallel replica once (see the module docstring)."""
    if not per_rank:
        return None
    mean = sum(per_rank.values()) / len(per_rank)
    if dp_size is None:  # no rank said: every rank is its own replica
        return mean * max(len(per_rank), world_size or 0)
    return mean * dp_size


def replicas(records: Iterable[dict[str, Any]]) -> tuple[int | None, int | None]:
    """``(dp_size, world_size)`` from ``start`` records (``None`` where no record says)."""
    dp = world = None
    for rec in records:
        if rec.get("kind") != "start":
            continue
        d, w = rec.get("dp_size"), rec.get("world_size")
        if isinstance(d, int) and d > 0:
            dp = d
        if isinstance(w, int) and w > 0:
            world = w
    return dp, world


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


class MeasureBuilder:
    """:func:`measure_records` fed batch by batch (a live run or a reader's pages); :meth:`result` any time."""

    def __init__(self, *, warmup: int = WARMUP_STEPS, dp_size: int | None = None,
                 world_size: int | None = None) -> None:  # fmt: skip
        self.warmup = warmup
        self.dp_size = dp_size
        self.world_size = world_size
        self._fixed_dp = dp_size is not None
        self.rates: dict[str, dict[int, list[float]]] = {}
        self.step_times: dict[int, list[float]] = {}
        self.peaks: dict[int, int] = {}
        self.memory_kind = "rss"
        self.max_step: int | None = None
        self.ranks: set[int] = set()

    def add(self, records: Iterable[dict[str, Any]]) -> MeasureBuilder:
        """Take records of any kinds and ranks; returns self."""
        for rec in records:
            kind = rec.get("kind")
            try:
                rank = int(rec["rank"])
            except (KeyError, TypeError, ValueError):
                continue
            self.ranks.add(rank)
            if kind == "step" and isinstance(rec.get("step"), int):
                step = rec["step"]
                self.max_step = step if self.max_step is None else max(self.max_step, step)
                if step < self.warmup:
                    continue
                for key, _unit in RATES:
                    rate = _finite(rec.get(key))
                    if rate is not None:
                        self.rates.setdefault(key, {}).setdefault(rank, []).append(rate)
                st = _finite(rec.get("step_time"))
                if st is not None and st > 0:
                    self.step_times.setdefault(rank, []).append(st)
            elif kind == "mem":
                if rec.get("peak_allocated") is not None:
                    self.memory_kind = "cuda"
                    value = int(rec["peak_allocated"])
                else:
                    value = int(_finite(rec.get("max_rss")) or _finite(rec.get("rss")) or 0)
                self.peaks[rank] = max(self.peaks.get(rank, 0), value)
            elif kind == "start":
                d, w = rec.get("dp_size"), rec.get("world_size")
                if isinstance(d, int) and d > 0 and not self._fixed_dp:
                    self.dp_size = d
                if isinstance(w, int) and w > 0:
                    self.world_size = max(w, self.world_size or 0)
        return self

    def add_columns(self, columns: Iterable[Any]) -> MeasureBuilder:
        """Take every call of :class:`~.reader.StepColumns`; returns self.

        The same as :meth:`add` of their ``step`` records, without a dict per call.
        """
        for cols in columns:
            rank = cols.rank
            self.ranks.add(rank)
            if not cols.step:
                continue
            top = max(cols.step)
            self.max_step = top if self.max_step is None else max(self.max_step, top)
            derived = dict(cols.derived())
            for k in ("step_time", "tokens_per_s", "samples_per_s"):
                if k in cols.metrics:  # logged by the rank itself
                    derived[k] = cols.metrics[k]
            try:
                import numpy as np

                warm: Any = np.frombuffer(cols.step, dtype=np.int64) >= self.warmup
            except (ImportError, TypeError, ValueError):  # pragma: no cover - numpy comes with pandas and torch
                warm = [s >= self.warmup for s in cols.step]
            for key in ("tokens_per_s", "samples_per_s", "step_time"):
                col = derived.get(key)
                if col is None:
                    continue
                if hasattr(col, "dtype"):  # numpy: one mask, no Python object per call
                    import numpy as np

                    mask = np.asarray(warm, dtype=bool) & np.isfinite(np.asarray(col, dtype=np.float64))
                    if key == "step_time":
                        mask &= col > 0
                    vals = col[mask].tolist()
                else:
                    vals = [float(v) for v, w in zip(col, warm, strict=True) if w and v is not None and isfinite(v)
                            and (key != "step_time" or v > 0)]  # fmt: skip
                if not vals:
                    continue
                if key == "step_time":
                    self.step_times.setdefault(rank, []).extend(vals)
                else:
                    self.rates.setdefault(key, {}).setdefault(rank, []).extend(vals)
        return self

    def rate(self, key: str) -> float | None:
        """The job's ``tokens_per_s`` or ``samples_per_s`` (``None`` when not logged)."""
        per_rank = {r: statistics.median(v) for r, v in self.rates.get(key, {}).items() if v}
        return job_rate(per_rank, dp_size=self.dp_size, world_size=self.world_size)

    def result(self) -> Measured:
        """The measurement of everything added so far."""
        per_rank = {r: statistics.median(v) for r, v in sorted(self.step_times.items()) if v}
        memory_peaks = {r: p for r, p in sorted(self.peaks.items())}
        return Measured(
            step_time_s=max(per_rank.values()) if per_rank else None,
            tokens_per_s=self.rate("tokens_per_s"),
            samples_per_s=self.rate("samples_per_s"),
            peak_bytes=memory_peaks,
            memory_kind=self.memory_kind,
            steps=self.max_step + 1 if self.max_step is not None else 0,
            dp_size=self.dp_size,
            world_size=self.world_size or (len(self.ranks) or None),
            step_time_per_rank=per_rank,
        )


def measure_records(records: Iterable[dict[str, Any]], *, warmup: int = WARMUP_STEPS, dp_size: int | None = None,
                    world_size: int | None = None) -> Measured:  # fmt: skip
    """Step time, job throughput and peak memory per rank from a run's records (any order, any ranks).

    ``dp_size`` overrides what the ``start`` records say (a caller that knows the candidate that ran).
    """
    return MeasureBuilder(warmup=warmup, dp_size=dp_size, world_size=world_size).add(records).result()
