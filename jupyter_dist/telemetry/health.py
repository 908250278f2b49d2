"""Health judgements from telemetry (stdlib only): how stale a rank's heartbeat is.

Heartbeats come from a daemon thread in each worker, so they keep coming while the main thread waits inside a
collective; a heartbeat that stops means the process is frozen (GIL held, stopped, swapping) or gone.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "HB_STATES", "HB_COLORS", "hb_state", "bus_factor", "bus_bandwidth", "straggler_scores", "hang_report",
    "HealthTracker", "WatchdogLimits", "STEP_PHASES", "SETUP_PHASES",
]  # fmt: skip

HB_STATES = ("ok", "slow", "suspect", "hung", "dead", "exited", "unknown")
"""Heartbeat states, from fresh to gone."""

HB_COLORS = {
    "ok": "#2e7d32", "slow": "#f9a825", "suspect": "#ef6c00", "hung": "#c62828", "dead": "#4a0000",
    "exited": "#9e9e9e", "unknown": "#bdbdbd",
}  # fmt: skip
"""Colour of each state in the dashboard."""


def hb_state(age_s: float, interval_s: float, *, exited: bool = False, alive: bool | None = None) -> str:
    """Judge a heartbeat ``age_s`` seconds old from a worker that beats every ``interval_s`` seconds.

    ``ok`` up to 2 intervals (one may be late), ``slow`` up to 5, ``suspect`` up to 15, then ``hung``; ``dead``
    when the process is known to be gone (``alive=False``) without an exit record, ``exited`` after one.
    """
    if exited:
        return "exited"
    if alive is False:
        return "dead"
    period = max(interval_s, 0.5)
    if age_s <= 2 * period:
        return "ok"
    if age_s <= 5 * period:
        return "slow"
    if age_s <= 15 * period:
        return "suspect"
    return "hung"


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of collective ``op`` over ``n`` ranks.

    2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for broadcast and reduce (nccl-tests,
    doc/PERFORMANCE.md, "Bus bandwidth").
    """
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"no bus-bandwidth factor for {op!r}; valid: all_reduce, all_gather, reduce_scatter, broadcast")


def bus_bandwidth(op: str, size_bytes: float, seconds: float, n: int) -> tuple[float, float]:
    """``(algorithm bandwidth, bus bandwidth)`` in bytes/s for one collective of ``size_bytes`` taking ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    alg = size_bytes / seconds
    return alg, alg * bus_factor(op, n)


MIN_STRAGGLER_LAG_S = 0.002
"""A straggler named from busy time must also reach collectives at least this much later than the first rank, on
average, when arrival times are known (DDP's bucket all-reduces and torch.distributed calls are timed)."""


def straggler_scores(windows: dict[int, tuple[float, float]], *, threshold: float = 0.75) -> dict[str, Any]:
    """Score ranks from their time inside collectives over the same stretch of a run.

    ``windows`` maps rank -> ``(seconds inside collectives, wall seconds)``. In a synchronous job every rank waits
    in each collective for the slowest one, so the straggler is the rank that waits *least*: its busy time (wall
    minus waiting) is the longest. A rank's score is the fastest rank's busy time over its own (1.0 = as fast as
    the fastest); a score under ``threshold`` names a straggler, with how much slower it computes.
    """
    busy = {r: max(wall - comm, 1e-9) for r, (comm, wall) in windows.items() if wall > 0}
    if len(busy) < 2:
        return {"scores": {r: 1.0 for r in busy}, "straggler": None, "slowdown": None}
    fastest = min(busy.values())
    scores = {r: fastest / b for r, b in busy.items()}
    worst = min(scores, key=lambda r: scores[r])
    if scores[worst] >= threshold:
        return {"scores": scores, "straggler": None, "slowdown": None}
    return {"scores": scores, "straggler": worst, "slowdown": busy[worst] / fastest - 1.0}


def hang_report(*, now: float, last_step_t: dict[int, float], last_hb: dict[int, dict[str, Any]],
                issued: dict[int, int], timeout: float) -> dict[str, Any] | None:  # fmt: skip
    """Judge whether a run hangs: no rank logged a step for ``timeout`` seconds while heartbeats still come.

    The rank behind is the one whose count of issued collectives is lowest (the others entered a collective it
    never reached; PyTorch's flight recorder reasons the same way with its sequence numbers); when all counts are
    equal, every rank is inside the same collective and the fabric (network, NCCL) is suspected. Returns ``None``
    when the run makes progress (or has not logged a step yet).
    """
    if not last_step_t:
        return None
    stalled_for = now - max(last_step_t.values())
    if stalled_for < timeout:
        return None
    fresh = {r for r, hb in last_hb.items() if now - float(hb.get("t", 0.0)) < timeout}
    phases = {r: str(hb.get("phase")) for r, hb in last_hb.items()}
    report: dict[str, Any] = {"stalled_s": round(stalled_for, 1), "phases": phases, "issued": dict(issued),
                              "alive": sorted(fresh), "culprit": None, "reason": ""}  # fmt: skip
    if issued and len(set(issued.values())) > 1:
        low = min(issued.values())
        behind = sorted(r for r, c in issued.items() if c == low)
        report["culprit"] = behind[0] if len(behind) == 1 else None
        others = max(issued.values())
        report["reason"] = (f"rank(s) {', '.join(map(str, behind))} issued {low} collectives, the others "
                            f"{others}: they never reached the collective the others wait in"
                            f" (phase {phases.get(behind[0], '?')})")  # fmt: skip
    elif issued:
        report["reason"] = ("every rank issued the same number of collectives and waits inside it: the fabric "
                            "(network, NCCL/gloo transport) is suspected")  # fmt: skip
    else:
        stuck = sorted(r for r in last_step_t if r in fresh)
        report["reason"] = f"no step for {stalled_for:.0f} s; no collective timings to tell which rank is behind"
        report["alive"] = stuck
    return report


STEP_PHASES = frozenset({"forward", "backward", "optimizer", "data"})
"""Phases inside the training loop: their limit scales with the measured step time."""
SETUP_PHASES = frozenset({"init", "setup", "wrap", "resume"})
"""Phases before the loop (process group, the user's set-up, wrapping the model, loading a checkpoint)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WatchdogLimits:
    """How long a rank may stay in one phase without progress before the run is judged ``hung``.

    Progress is a new phase or a new logged step. ``explicit`` (``--hang-timeout S``) is the limit of every phase
    once a rank reports (and ``max(S, 60)`` before its first heartbeat: importing torch and the rendezvous); the
    defaults scale: a step phase gets ``max(step_floor_s, step_factor x the median step time)``. Set in the kernel
    with ``JD_WATCHDOG="step_floor_s=5,setup_s=120"`` (:meth:`from_env`).
    """

    launch_s: float = 600.0
    """Launch to a rank's first heartbeat: importing torch and the script, the rendezvous, the process group."""
    setup_s: float = 300.0
    """``init``, ``setup`` (the cell before its first step), ``wrap``, ``resume``."""
    checkpoint_s: float = 600.0
    """``checkpoint``: one save."""
    step_floor_s: float = 120.0
    """The least a step phase may take before it counts as stuck."""
    step_factor: float = 20.0
    """A step phase may take this many median steps."""
    other_s: float = 600.0
    """A phase of another name (``jd.phase("eval")``...)."""
    explicit: float | None = None
    """``--hang-timeout``: one limit for every phase (the run is then stopped when it hangs)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "explicit" and value is None:
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"watchdog {f.name}={value!r} must be a finite number of seconds > 0")

    @classmethod
    def from_env(cls, environ: Any, *, explicit: float | None = None) -> WatchdogLimits:
        """Defaults, overridden by ``JD_WATCHDOG`` (``name=seconds`` pairs, comma-separated) and ``explicit``."""
        over: dict[str, float] = {}
        text = str(environ.get("JD_WATCHDOG") or "").strip()
        names = [f.name for f in fields(cls) if f.name != "explicit"]
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name.strip() not in names:
                raise ValueError(f"JD_WATCHDOG: {part!r} is not name=seconds; valid names: {', '.join(names)}")
            try:
                over[name.strip()] = float(value)
            except ValueError:
                raise ValueError(f"JD_WATCHDOG: {part!r} wants a number of seconds") from None
        return cls(**over, explicit=explicit)

    def limit(self, phase: str, median_step_s: float | None) -> float:
        """The limit of ``phase`` (``launching``: before the first heartbeat)."""
        if phase == "launching":
            return max(self.explicit, 60.0) if self.explicit is not None else self.launch_s
        if self.explicit is not None:
            return self.explicit
        if phase in STEP_PHASES:
            return max(self.step_floor_s, self.step_factor * (median_step_s or 0.0))
        if phase in SETUP_PHASES:
            return self.setup_s
        if phase == "checkpoint":
            return self.checkpoint_s
        return self.other_s


class HealthTracker:
    """Follows a run's records for the health judgements.

    Keeps the last step time, heartbeat and collective count per rank, and the recent collective windows for
    straggler scores. Pure and incremental (feed it batches in any order).
    """

    def __init__(self, *, recent: int = 5) -> None:
        self.recent = recent
        self.last_step_t: dict[int, float] = {}
        self.last_hb: dict[int, dict[str, Any]] = {}
        self.issued: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.exited: dict[int, str] = {}
        self._comm: dict[int, list[tuple[float, float]]] = {}
        self._arrivals: dict[int, dict[int, float]] = {}
        self._step_gaps: list[float] = []  # recent seconds between a rank's consecutive steps (all ranks)
        self._prev_step: dict[int, tuple[int, float]] = {}

    def ingest(self, records: Any) -> None:
        """Take records of any kinds."""
        for rec in records:
            try:
                rank, t = int(rec["rank"]), float(rec["t"])
            except (KeyError, TypeError, ValueError):
                continue
            kind = rec.get("kind")
            if kind == "step":
                self.last_step_t[rank] = max(t, self.last_step_t.get(rank, t))
                prev = self._prev_step.get(rank)
                step = rec.get("step")
                if isinstance(step, int) and (prev is None or step > prev[0]):
                    if prev is not None and t >= prev[1]:
                        self._step_gaps.append((t - prev[1]) / (step - prev[0]))
                        del self._step_gaps[:-256]
                    self._prev_step[rank] = (step, t)
            elif kind == "hb":
                if rank not in self.last_hb or t >= float(self.last_hb[rank]["t"]):
                    self.last_hb[rank] = rec
            elif kind == "comm":
                if isinstance(rec.get("issued"), int):
                    self.issued[rank] = max(self.issued.get(rank, 0), rec["issued"])
                arrivals = self._arrivals.setdefault(rank, {})
                for item in rec.get("recent") or []:
                    if isinstance(item, list) and len(item) == 2:
                        arrivals[int(item[0])] = float(item[1])
                if len(arrivals) > 64:
                    for n in sorted(arrivals)[:-64]:
                        del arrivals[n]
                window = self._comm.setdefault(rank, [])
                window.append((float(rec.get("seconds") or 0.0), float(rec.get("window_s") or 0.0)))
                del window[: -self.recent]
            elif kind == "start":
                if isinstance(rec.get("pid"), int):
                    self.pids[rank] = rec["pid"]
                self.exited.pop(rank, None)
            elif kind == "exit":
                self.exited[rank] = str(rec.get("status"))

    def straggler(self) -> dict[str, Any]:
        """:func:`straggler_scores` over each rank's last ``recent`` collective windows, plus arrival lags."""
        windows = {r: (sum(c for c, _ in v), sum(w for _, w in v)) for r, v in self._comm.items() if v}
        out = straggler_scores(windows)
        lags = self.arrival_lags()
        out["arrival_lag_s"] = lags
        worst = out["straggler"]
        if worst is not None and len(lags) == len(windows) and lags.get(worst, 0.0) < MIN_STRAGGLER_LAG_S:
            # a rank that computes longer also reaches each collective later; when the arrival order (one clock,
            # the same collectives) does not show it, the busy-time gap is scheduling noise of the windows
            out.update(straggler=None, slowdown=None, unconfirmed=worst)
        return out

    def arrival_lags(self) -> dict[int, float]:
        """Mean seconds each rank issues a collective after the first rank to issue it.

        Over the last 32 collectives every rank reported; needs one host's clock, or clocks in sync across nodes.
        """
        if len(self._arrivals) < 2:
            return {}
        common = set.intersection(*(set(a) for a in self._arrivals.values()))
        numbers = sorted(common)[-32:]
        if not numbers:
            return {}
        lags = {r: 0.0 for r in self._arrivals}
        for n in numbers:
            first = min(a[n] for a in self._arrivals.values())
            for r, a in self._arrivals.items():
                lags[r] += a[n] - first
        return {r: round(v / len(numbers), 6) for r, v in lags.items()}

    def median_step_s(self) -> float | None:
        """The median seconds per step over the recent steps of every rank (``None`` before two steps)."""
        return statistics.median(self._step_gaps) if self._step_gaps else None

    def where(self, now: float, world_size: int, started: float) -> dict[int, dict[str, Any]]:
        """Per rank: its phase (``launching`` before its first heartbeat), seconds without progress, last step."""
        out: dict[int, dict[str, Any]] = {}
        for r in range(world_size):
            hb = self.last_hb.get(r)
            if hb is None:
                out[r] = {"phase": "launching", "since": started, "stalled_s": round(now - started, 1), "step": None}
                continue
            t = float(hb.get("t") or 0.0)
            phase_start = t - float(hb.get("phase_s") or 0.0)
            since = max(phase_start, self.last_step_t.get(r, phase_start))
            out[r] = {"phase": str(hb.get("phase")), "since": since, "stalled_s": round(now - since, 1),
                      "step": hb.get("step")}  # fmt: skip
        return out

    def stall(self, now: float, limits: WatchdogLimits, *, world_size: int, started: float) -> dict[str, Any] | None:
        """The watchdog: a hang report when *every* rank stayed in its phase longer than the phase's limit.

        ``None`` while any rank makes progress, once any rank has exited (that is not a hang), and under the default
        limits while no rank has sent a heartbeat (a script that never calls ``jd`` cannot be judged). The
        report has each rank's ``phases``, ``stalled`` seconds and ``limits``, ``stalled_s`` (the least of them),
        ``last_step``, ``median_step_s`` and the culprit reasoning of :func:`hang_report` (collective counts).
        """
        if self.exited or world_size < 1:
            return None
        if limits.explicit is None and not self.last_hb:  # a script that never uses jd beats no heart: not judged
            return None
        median = self.median_step_s()
        where = self.where(now, world_size, started)
        limit = {r: limits.limit(w["phase"], median) for r, w in where.items()}
        if any(w["stalled_s"] < limit[r] for r, w in where.items()):
            return None
        stalled = min(w["stalled_s"] for w in where.values())
        steps = [w["step"] for w in where.values() if isinstance(w["step"], int)]
        base = hang_report(now=now, last_step_t={r: now - stalled for r in where}, last_hb=self.last_hb,
                           issued=self.issued, timeout=0.0) or {}  # fmt: skip
        phases = {r: w["phase"] for r, w in where.items()}
        reason = base.get("reason") or ""
        if not self.issued:
            reason = "every rank stayed in its phase past its limit; no collective timings to tell which rank is behind"
        return {**base, "stalled_s": round(stalled, 1), "phases": phases, "reason": reason,
                "stalled": {r: w["stalled_s"] for r, w in where.items()}, "limits": limit,
                "last_step": max(steps) if steps else None, "median_step_s": median,
                "explicit": limits.explicit}  # fmt: skip

    def hang(self, now: float, timeout: float) -> dict[str, Any] | None:
        """:func:`hang_report` from what was seen (``None`` once any rank has exited: that is not a hang)."""
        if self.exited:
            return None
        return hang_report(now=now, last_step_t=self.last_step_t, last_hb=self.last_hb, issued=self.issued,
                           timeout=timeout)  # fmt: skip
