"""Health judgements from telemetry (stdlib only): how stale a rank's heartbeat is.

Heartbeats come from a daemon thread in each worker, so they keep coming while the main thread waits inside a
collective; a heartbeat that stops means the process is frozen (GIL held, stopped, swapping) or gone.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "HB_STATES", "HB_COLORS", "hb_state", "bus_factor", "bus_bandwidth", "straggler_scores", "hang_report",
    "HealthTracker",
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

    def hang(self, now: float, timeout: float) -> dict[str, Any] | None:
        """:func:`hang_report` from what was seen (``None`` once any rank has exited: that is not a hang)."""
        if self.exited:
            return None
        return hang_report(now=now, last_step_t=self.last_step_t, last_hb=self.last_hb, issued=self.issued,
                           timeout=timeout)  # fmt: skip
