"""A run's telemetry condensed into one small dict: what the runs table shows (stdlib only).

:func:`summarize_records` reads the records once: steps, the last and best loss (the mean over the ranks that logged
it of each logged step's value: every ``jd.log`` call is kept, so with one rank, or ranks that log the same value,
the last loss is the last value logged), and from the one measurement (:mod:`.measurement`) the throughput
(tokens/s, else samples/s, else steps/s; each data-parallel replica counted once) and each rank's peak memory in
bytes; the time span, and restarts (the most ``start`` records of one rank, minus one). :func:`write_summary` puts
it in ``<run dir>/summary.json`` when a run ends, so a table over hundreds of runs reads one small file per run
instead of every telemetry line.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._atomic import write_atomic
from .measurement import MeasureBuilder

__all__ = [
    "SUMMARY_FILE",
    "SUMMARY_VERSION",
    "SummaryBuilder",
    "summarize_records",
    "summarize_dir",
    "write_summary",
    "read_summary",
]

SUMMARY_FILE = "summary.json"
"""The summary's file name inside a run directory."""
SUMMARY_VERSION = 2
"""Layout version written as ``v``; a summary with another version is recomputed (2: lossless steps, rates counted
once per data-parallel replica)."""


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


class SummaryBuilder:
    """The summary built record by record: :meth:`add` batches as they arrive (a live run), :meth:`result` any time.

    Memory grows with the logged steps (one float per step and rank), not with other records.
    """

    def __init__(self, *, metric: str = "loss") -> None:
        self.metric = metric
        self.by_step: dict[int, list[float]] = {}
        self.measure = MeasureBuilder()
        self.starts: dict[int, int] = {}
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.max_step: int | None = None
        self.n = 0
        self.ranks: set[int] = set()

    def add(self, records: Iterable[dict[str, Any]]) -> SummaryBuilder:
        """Take records (any order, any ranks); returns self."""
        records = list(records)
        self.measure.add(records)
        for rec in records:
            self.n += 1
            try:
                rank = int(rec["rank"])
            except (KeyError, TypeError, ValueError):
                continue
            self.ranks.add(rank)
            t = _finite(rec.get("t"))
            if t is not None:
                self.first_t = t if self.first_t is None else min(self.first_t, t)
                self.last_t = t if self.last_t is None else max(self.last_t, t)
            kind = rec.get("kind")
            if kind == "step" and isinstance(rec.get("step"), int):
                step = rec["step"]
                self.max_step = step if self.max_step is None else max(self.max_step, step)
                value = _finite(rec.get(self.metric))
                if value is not None:
                    self.by_step.setdefault(step, []).append(value)
            elif kind == "start":
                self.starts[rank] = self.starts.get(rank, 0) + 1
        return self

    def result(self) -> dict[str, Any]:
        """The summary of everything added so far (see :func:`summarize_records`)."""
        means = {s: sum(v) / len(v) for s, v in self.by_step.items()}
        last_step = max(means, default=None)
        best_step = min(means, key=lambda s: (means[s], s), default=None)
        measured = self.measure.result()
        throughput, unit = measured.throughput
        return {
            "v": SUMMARY_VERSION,
            "steps": self.max_step + 1 if self.max_step is not None else 0,
            "last_loss": means[last_step] if last_step is not None else None,
            "best_loss": means[best_step] if best_step is not None else None,
            "best_step": best_step,
            "throughput": throughput,
            "throughput_unit": unit,
            "step_time_s": measured.step_time_s,
            "dp_size": measured.dp_size,
            "peak_mem": {str(r): int(b) for r, b in measured.peak_bytes.items()},
            "first_t": self.first_t,
            "last_t": self.last_t,
            "restarts": max((c - 1 for c in self.starts.values()), default=0),
            "ranks": len(self.ranks),
            "records": self.n,
        }


def summarize_records(records: Iterable[dict[str, Any]], *, metric: str = "loss") -> dict[str, Any]:
    """The summary of one run's records (any order, any ranks).

    Keys: ``v``, ``steps`` (the highest logged step + 1, or 0), ``last_loss``, ``best_loss``, ``best_step``,
    ``throughput`` and ``throughput_unit``, ``step_time_s``, ``dp_size`` (the replicas the rates were counted with,
    ``None`` when no worker said), ``peak_mem`` (``{rank: bytes}``, keys as strings), ``first_t`` and
    ``last_t`` (unix seconds), ``restarts``, ``ranks`` and ``records``. Absent figures are ``None``.
    """
    return SummaryBuilder(metric=metric).add(records).result()


def summarize_dir(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The summary of a run directory's ``telemetry/`` files (reads every record once)."""
    from .reader import read_run_records

    return summarize_records(read_run_records(Path(run_dir) / "telemetry").records)


def write_summary(run_dir: str | os.PathLike[str], summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compute (unless given) and atomically write ``<run dir>/summary.json``; returns the summary."""
    summary = summarize_dir(run_dir) if summary is None else summary
    path = Path(run_dir) / SUMMARY_FILE
    write_atomic(path, json.dumps(summary, separators=(",", ":")))
    return summary


def read_summary(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``summary.json`` of a run directory, or ``None`` when it is missing, damaged or of another version."""
    try:
        data = json.loads((Path(run_dir) / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("v") != SUMMARY_VERSION:
        return None
    return data
