"""The telemetry record: one JSON object per line, per rank (stdlib only).

Every record has the envelope

``v``
    schema version (:data:`SCHEMA_VERSION`);
``kind``
    one of :data:`KINDS`;
``rank``
    global rank of the process that wrote it;
``seq``
    per-rank sequence number, strictly increasing over the life of a run directory (a restarted worker
    continues after the last number in its file, so readers can de-duplicate by ``(rank, seq)``);
``t``
    unix time in seconds (float).

and then the fields of its kind:

``start``
    ``world_size``, ``local_rank``, ``pid``, ``host``, ``strategy``, ``precision``, ``device``, ``backend``
    (``null`` without a process group), ``torch`` (version or ``null``);
``step``
    ``step`` (int) and every metric passed to ``jd.log`` as a float;
``heartbeat``
    ``step`` (the last logged step or ``null``), ``rss_bytes``, ``max_rss_bytes`` and, when CUDA is in use,
    ``cuda_allocated_bytes`` and ``cuda_max_allocated_bytes``;
``exit``
    ``status`` (``"ok"``, ``"error"`` or ``"terminated"``), ``error_type`` and ``error`` (``null`` when ok),
    ``step`` (the last logged step or ``null``) and, for ``"terminated"``, ``signal`` (e.g. ``"SIGTERM"``).

Non-finite metric values: JSON has no NaN or infinity (``JSON.parse`` and most strict readers reject Python's
``NaN`` token), so a non-finite metric is written as ``null`` and named in an extra ``nonfinite`` object that
keeps the distinction, e.g. ``{"loss": null, "nonfinite": {"loss": "nan"}}``; :func:`decode` restores the floats.
A record is always exactly one line: :func:`encode` escapes newlines inside strings, so a torn write can damage
at most the last line of a file, and :func:`decode` answers ``None`` for it.

Where only a log stream exists (SkyPilot, SLURM) the same line is printed after :data:`SENTINEL`; launchers may
prefix the line, so readers look for the sentinel anywhere in it.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "SENTINEL",
    "KINDS",
    "ENVELOPE",
    "make_record",
    "metric_value",
    "step_fields",
    "encode",
    "decode",
]

SCHEMA_VERSION = 1
"""Version of the record layout written in ``v``; readers skip records with a newer major layout."""

SENTINEL = "@@JD@@"
"""Marker before a record printed into a log stream: ``<any prefix>@@JD@@{json}`` (same as the reader's)."""

KINDS = ("start", "step", "heartbeat", "exit")
"""Record kinds this version writes."""

ENVELOPE = ("v", "kind", "rank", "seq", "t")
"""Fields every record has, in this order."""

_RESERVED = frozenset(ENVELOPE) | {"step", "nonfinite"}
_NONFINITE_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def metric_value(name: str, value: Any) -> float:
    """Convert one metric to a float: numbers, bools, and tensors or numpy scalars (through ``.item()``).

    Raises
    ------
    TypeError
        For anything else (strings, lists, tensors with more than one element), naming the metric.
    """
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except (ValueError, RuntimeError) as e:  # a tensor with more than one element
            raise TypeError(f"metric {name!r} must be a scalar; .item() failed: {e}") from e
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise TypeError(f"metric {name!r} must be a number or a one-element tensor, got {type(value).__name__}")


def make_record(kind: str, *, rank: int, seq: int, t: float, **fields: Any) -> dict[str, Any]:
    """Build a record dict: the envelope first, then ``fields`` in the given order.

    Raises
    ------
    ValueError
        For an unknown ``kind`` or a field that would overwrite the envelope.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}; valid: {', '.join(KINDS)}")
    clash = sorted(set(fields) & set(ENVELOPE))
    if clash:
        raise ValueError(f"record fields {clash} clash with the envelope {list(ENVELOPE)}")
    record: dict[str, Any] = {"v": SCHEMA_VERSION, "kind": kind, "rank": int(rank), "seq": int(seq), "t": float(t)}
    record.update(fields)
    return record


def step_fields(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """The fields of a ``step`` record: ``step`` then each metric converted by :func:`metric_value`.

    Raises
    ------
    ValueError
        For a metric named like an envelope field, ``step`` or ``nonfinite``.
    TypeError
        For a non-integer step or a non-numeric metric.
    """
    value: Any = step
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()  # a one-element tensor or numpy integer
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    clash = sorted(set(metrics) & _RESERVED)
    if clash:
        raise ValueError(f"metric names {clash} are reserved; rename them (reserved: {sorted(_RESERVED)})")
    out: dict[str, Any] = {"step": value}
    for name, value in metrics.items():
        out[name] = metric_value(name, value)
    return out


def encode(record: dict[str, Any]) -> str:
    """One line of JSON (no trailing newline); non-finite floats become ``null`` and are listed in ``nonfinite``."""
    nonfinite: dict[str, str] = {}
    clean: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            nonfinite[key] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            clean[key] = None
        else:
            clean[key] = value
    if nonfinite:
        clean["nonfinite"] = nonfinite
    # ensure_ascii keeps the line free of raw U+2028 and friends, which some line splitters treat as newlines
    return json.dumps(clean, separators=(",", ":"), allow_nan=False, ensure_ascii=True, default=str)


def decode(line: str) -> dict[str, Any] | None:
    """Parse one line (a bare record, or any line that contains :data:`SENTINEL` followed by one).

    Returns ``None`` for a torn, empty or foreign line instead of raising. Values listed in ``nonfinite`` are
    restored to ``nan``/``inf``/``-inf`` and the ``nonfinite`` field is removed.
    """
    idx = line.find(SENTINEL)
    text = line[idx + len(SENTINEL) :] if idx >= 0 else line
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not all(k in obj for k in ENVELOPE):
        return None
    nonfinite = obj.pop("nonfinite", None)
    if isinstance(nonfinite, dict):
        for key, name in nonfinite.items():
            if key in obj and obj[key] is None and name in _NONFINITE_NAMES:
                obj[key] = _NONFINITE_NAMES[name]
    return obj
