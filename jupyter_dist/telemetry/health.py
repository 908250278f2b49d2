"""Health judgements from telemetry (stdlib only): how stale a rank's heartbeat is.

Heartbeats come from a daemon thread in each worker, so they keep coming while the main thread waits inside a
collective; a heartbeat that stops means the process is frozen (GIL held, stopped, swapping) or gone.
"""

from __future__ import annotations

__all__ = ["HB_STATES", "HB_COLORS", "hb_state"]

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
