"""A run's telemetry condensed into one small dict: what the runs table shows (stdlib only).

:func:`summarize_records` reads the records once: steps, the last and best loss (the mean over ranks of each logged
step), throughput (tokens/s, else samples/s, else steps/s: the sum over ranks of each rank's median rate, steps/s
the mean), each rank's peak memory in bytes, the time span, and restarts (the most ``start`` records of one rank,
minus one). :func:`write_summary` puts it in ``<run dir>/summary.json`` when a run ends, so a table over hundreds
of runs reads one small file per run instead of every telemetry line.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
SUMMARY_VERSION = 1
"""Layout version written as ``v``; a summary with another version is recomputed."""
_RATES = (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"))


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
        self.rates: dict[str, dict[int, list[float]]] = {}
        self.step_times: dict[int, list[float]] = {}
        self.peaks: dict[int, float] = {}
        self.starts: dict[int, int] = {}
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.max_step: int | None = None
        self.n = 0
        self.ranks: set[int] = set()

    def add(self, records: Iterable[dict[str, Any]]) -> SummaryBuilder:
        """Take records (any order, any ranks); returns self."""
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
                for key, _unit in _RATES:
                    rate = _finite(rec.get(key))
                    if rate is not None:
                        self.rates.setdefault(key, {}).setdefault(rank, []).append(rate)
                st = _finite(rec.get("step_time"))
                if st is not None and st > 0:
                    self.step_times.setdefault(rank, []).append(1.0 / st)
            elif kind == "mem":
                peak = max((_finite(rec.get(k)) or 0.0) for k in ("peak_active", "peak_allocated", "max_rss", "rss"))
                self.peaks[rank] = max(self.peaks.get(rank, 0.0), peak)
            elif kind == "start":
                self.starts[rank] = self.starts.get(rank, 0) + 1
        return self

    def result(self) -> dict[str, Any]:
        """The summary of everything added so far (see :func:`summarize_records`)."""
        means = {s: sum(v) / len(v) for s, v in self.by_step.items()}
        last_step = max(means, default=None)
        best_step = min(means, key=lambda s: (means[s], s), default=None)
        throughput, unit = None, None
        for key, name in _RATES:
            if self.rates.get(key):
                throughput, unit = sum(statistics.median(v) for v in self.rates[key].values()), name
                break
        if throughput is None and self.step_times:
            per_rank = [statistics.median(v) for v in self.step_times.values()]
            throughput, unit = sum(per_rank) / len(per_rank), "steps/s"
        return {
            "v": SUMMARY_VERSION,
            "steps": self.max_step + 1 if self.max_step is not None else 0,
            "last_loss": means[last_step] if last_step is not None else None,
            "best_loss": means[best_step] if best_step is not None else None,
            "best_step": best_step,
            "throughput": throughput,
            "throughput_unit": unit,
            "peak_mem": {str(r): int(b) for r, b in sorted(self.peaks.items())},
            "first_t": self.first_t,
            "last_t": self.last_t,
            "restarts": max((c - 1 for c in self.starts.values()), default=0),
            "ranks": len(self.ranks),
            "records": self.n,
        }


def summarize_records(records: Iterable[dict[str, Any]], *, metric: str = "loss") -> dict[str, Any]:
    """The summary of one run's records (any order, any ranks).

    Keys: ``v``, ``steps`` (the highest logged step + 1, or 0), ``last_loss``, ``best_loss``, ``best_step``,
    ``throughput`` and ``throughput_unit``, ``peak_mem`` (``{rank: bytes}``, keys as strings), ``first_t`` and
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
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, separators=(",", ":")), encoding="utf-8")
    os.replace(tmp, path)
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
