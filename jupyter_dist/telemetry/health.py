"""Health judgements from telemetry (stdlib only): how stale a rank's heartbeat is.

Heartbeats come from a daemon thread in each worker, so they keep coming while the main thread waits inside a
collective; a heartbeat that stops means the process is frozen (GIL held, stopped, swapping) or gone.
"""

from __future__ import annotations

__all__ = ["HB_STATES", "HB_COLORS", "hb_state", "bus_factor", "bus_bandwidth"]

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
