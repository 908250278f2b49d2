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
    ``world_size``, ``dp_size`` (data-parallel replicas: ``world / (tp x pp x cp)``, how views count tokens),
    ``local_rank``, ``pid``, ``host``, ``strategy``, ``precision``, ``device``, ``backend``
    (``null`` without a process group), ``torch`` (version or ``null``);
``steps``
    a batch of ``jd.log`` calls, every call kept with its own values (values are never merged; only the *write*
    is batched), as columns of little-endian 8-byte numbers in base64 (``enc`` = :data:`COLUMN_ENCODING`):
    ``count`` (calls), ``step`` (int64 per call), ``ts`` (float64 unix time per call), ``m`` (``{metric: float64
    column}``), ``at`` (only for a metric that not every call logged: ``{metric: [indices of the calls that
    did]}``, its column holding just their values) and ``prev`` (``[time, step]`` of the call before the batch,
    ``null`` for a worker's first). Bit-exact values, NaN and infinities included, read at C speed
    (:func:`steps_columns`). A loop writes one batch per rank per
    ``JD_TELEMETRY_INTERVAL_S`` (default 1 s; 0 writes one per call) or per :data:`MAX_BATCH` calls; the first call,
    a checkpoint and the end of the run write at once. Readers see it as one ``step`` record per call
    (:func:`expand_steps`);
``step``
    one ``jd.log`` call as readers see it: ``step`` (int), every metric logged in that call (a float), and what is
    derived from the time between calls (not logged, never overriding a metric of the same name): ``step_time``
    (seconds per step since the previous call) and ``tokens_per_s`` / ``samples_per_s`` (the call's ``tokens`` /
    ``samples`` over that time). Written directly by older versions, which merged the calls of one interval into one
    record with their mean and a count ``n`` (such records still read, with ``n``);
``hb``
    heartbeat from a daemon thread (it keeps coming while the main thread is blocked in a collective): ``step``
    (last logged step or ``null``), ``phase`` (``init``, ``wrap``, ``forward``, ``backward``, ``optimizer``,
    ``checkpoint``, ``resume``, ``done`` or a name given to ``jd.phase``) and ``phase_s`` (seconds in it);
``mem``
    ``device`` and memory in bytes: ``rss`` and ``max_rss`` of the process; with CUDA also ``allocated``,
    ``reserved``, ``peak_allocated``, ``peak_active`` (from ``torch.cuda.memory_stats``), ``alloc_retries``,
    ``ooms`` and ``device_total``;
``gpu``
    from NVML when ``pynvml`` is importable and CUDA is in use: ``index`` (NVML device index), ``util``
    (% of time a kernel ran), ``mem_util`` (%), ``mem_used`` and ``mem_total`` (bytes), ``power_w``, ``temp_c``;
``comm``
    collective timings of one heartbeat window: ``count``, ``seconds`` (wall time from issue to completion,
    waiting for other ranks included), ``bytes``, ``window_s``, ``issued`` (collectives issued by the rank so far),
    ``recent`` (``[number, unix time]`` of its last 16 issued collectives: arrival order across ranks)
    and ``ops`` (the same per collective, e.g. ``{"all_reduce (DDP buckets)": {"count", "seconds", "bytes"}}``);
``error``
    an uncaught exception in the script: ``error_type``, ``error``, ``traceback`` (its last lines);
``exit``
    ``status`` (``"ok"``, ``"error"`` or ``"terminated"``), ``error_type`` and ``error`` (``null`` when ok),
    ``step`` (the last logged step or ``null``) and, for ``"terminated"``, ``signal`` (e.g. ``"SIGTERM"``).

Run directories written before ``hb`` existed hold ``heartbeat`` records; :func:`decode` reads them as ``hb``.

Non-finite metric values: JSON has no NaN or infinity (``JSON.parse`` and most strict readers reject Python's
``NaN`` token), so a non-finite metric is written as ``null`` and named in an extra ``nonfinite`` object that
keeps the distinction, e.g. ``{"loss": null, "nonfinite": {"loss": "nan"}}``; :func:`decode` restores the floats.
A record is always exactly one line: :func:`encode` escapes newlines inside strings, so a torn write can damage
at most the last line of a file, and :func:`decode` answers ``None`` for it.

Where only a log stream exists (SkyPilot, SLURM) the same line is printed after :data:`SENTINEL`; launchers may
prefix the line, so readers look for the sentinel anywhere in it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from array import array
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "SENTINEL",
    "KINDS",
    "ENVELOPE",
    "make_record",
    "metric_value",
    "step_fields",
    "check_metrics",
    "steps_fields",
    "steps_columns",
    "expand_steps",
    "unpack",
    "unpack_array",
    "steps_arrays",
    "COLUMN_ENCODING",
    "MAX_BATCH",
    "encode",
    "decode",
]

SCHEMA_VERSION = 1
"""Version of the record layout written in ``v``; readers skip records with a newer major layout."""

SENTINEL = "@@JD@@"
"""Marker before a record printed into a log stream: ``<any prefix>@@JD@@{json}`` (same as the reader's)."""

KINDS = ("start", "steps", "step", "hb", "mem", "gpu", "comm", "error", "exit")
"""Record kinds this version writes."""

ENVELOPE = ("v", "kind", "rank", "seq", "t")
"""Fields every record has, in this order."""

MAX_BATCH = 256
"""Most ``jd.log`` calls in one ``steps`` record: a line stays under ~20 KB however fast the loop (log streams)."""

_RESERVED = frozenset(ENVELOPE) | {"step", "n", "nonfinite"}
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
    """The fields of a one-call ``step`` record: ``step`` then each metric as a float (see :func:`check_metrics`)."""
    value, checked = check_metrics(step, metrics)
    out: dict[str, Any] = {"step": value}
    for name, metric in checked.items():
        out[name] = metric_value(name, metric)
    return out


def check_metrics(step: Any, metrics: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Validate one ``jd.log`` call without synchronising with an accelerator.

    Returns the step as an int and the metrics with numbers as floats and one-element tensors kept as detached
    tensors (converted with ``.item()`` only when a coalesced record is written, so logging every step does not
    force a GPU sync per step).

    Raises
    ------
    ValueError
        For a metric named like an envelope field, ``step``, ``n`` or ``nonfinite``.
    TypeError
        For a non-integer step, a non-numeric metric, or a tensor with more than one element.
    """
    value: Any = step
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    clash = sorted(set(metrics) & _RESERVED)
    if clash:
        raise ValueError(f"metric names {clash} are reserved; rename them (reserved: {sorted(_RESERVED)})")
    out: dict[str, Any] = {}
    for name, metric in metrics.items():
        if hasattr(metric, "detach") and hasattr(metric, "numel"):  # a torch tensor: no .item() here
            if metric.numel() != 1:
                raise TypeError(f"metric {name!r} must be a scalar; got a tensor of shape {tuple(metric.shape)}")
            # detach only what autograd tracks: a dispatcher call is ~10 us in a training loop with cold caches
            out[name] = metric.detach() if getattr(metric, "requires_grad", True) else metric
        else:
            out[name] = metric_value(name, metric)
    return value, out


COLUMN_ENCODING = "le8-b64"
"""How a ``steps`` record stores its columns: little-endian 8-byte numbers (``int64`` steps, ``float64`` times and
values), base64 text. The exact bits of every value (NaN and infinities included), and decoded at C speed."""


def _pack(code: str, values: list[Any]) -> str:
    arr = array(code, values)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


def unpack(code: str, text: Any) -> list[Any]:
    """A column of a ``steps`` record: ``code`` ``"q"`` (int64) or ``"d"`` (float64); raises ``ValueError``."""
    return unpack_array(code, text).tolist()


def unpack_array(code: str, text: Any) -> array[Any]:
    """:func:`unpack` as an :class:`array.array` (no Python object per value)."""
    if not isinstance(text, str):
        raise ValueError("a column is base64 text")
    arr = array(code)
    try:
        raw = text.encode("ascii")
        if sys.version_info >= (3, 11):  # strict in C; b64decode(validate=True) runs a regex over the text first
            data = binascii.a2b_base64(raw, strict_mode=True)
        else:  # pragma: no cover - Python 3.10
            data = base64.b64decode(raw, validate=True)
        arr.frombytes(data)
    except (ValueError, binascii.Error, UnicodeEncodeError) as e:
        raise ValueError(f"a damaged column: {e}") from None
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr


def steps_fields(calls: list[tuple[int, float, dict[str, float]]], prev: tuple[float, int] | None) -> dict[str, Any]:
    """The fields of a ``steps`` record from ``(step, time, {metric: float})`` per call, in call order.

    Every value and time is kept bit for bit. A metric that not every call logged has ``at``: the indices of the
    calls that did, and its column holds only their values.
    """
    names: dict[str, None] = {}
    for _, _, values in calls:
        for name in values:
            names.setdefault(name)
    columns: dict[str, str] = {}
    at: dict[str, list[int]] = {}
    for name in names:
        if all(name in values for _, _, values in calls):
            columns[name] = _pack("d", [values[name] for _, _, values in calls])
        else:
            idx = [i for i, (_, _, values) in enumerate(calls) if name in values]
            at[name] = idx
            columns[name] = _pack("d", [calls[i][2][name] for i in idx])
    fields: dict[str, Any] = {
        "enc": COLUMN_ENCODING,
        "count": len(calls),
        "step": _pack("q", [c[0] for c in calls]),
        "ts": _pack("d", [c[1] for c in calls]),
        "m": columns,
        "prev": None if prev is None else [prev[0], prev[1]],
    }
    if at:
        fields["at"] = at
    return fields


def steps_columns(record: dict[str, Any]) -> tuple[list[int], list[float], dict[str, list[float | None]]]:
    """``(steps, times, {metric: [value or None per call]})`` of a ``steps`` record; ``ValueError`` if damaged."""
    steps, ts, cols = steps_arrays(record)
    return steps.tolist(), ts.tolist(), {k: v if isinstance(v, list) else v.tolist() for k, v in cols.items()}


def steps_arrays(record: dict[str, Any], names: Any = None) -> tuple[array[int], array[float], dict[str, Any]]:
    """:func:`steps_columns` with arrays: a metric every call logged is an ``array("d")``, a sparse one a list.

    ``names`` (a container of metric names) decodes only those metrics (the panels need one metric and the rates).
    """
    if record.get("enc") != COLUMN_ENCODING:
        raise ValueError(f"unknown column encoding {record.get('enc')!r}")
    steps, ts = unpack_array("q", record.get("step")), unpack_array("d", record.get("ts"))
    cols, at = record.get("m"), record.get("at") or {}
    n = record.get("count")
    if len(steps) != n or len(ts) != n or not isinstance(cols, dict) or not isinstance(at, dict):
        raise ValueError("columns of different lengths")
    out: dict[str, Any] = {}
    for name, text in cols.items():
        if names is not None and name not in names:
            continue
        values = unpack_array("d", text)
        where = at.get(name)
        if where is None:
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values for {n} calls")
            out[name] = values
            continue
        if not isinstance(where, list) or len(where) != len(values) or not all(
                isinstance(i, int) and 0 <= i < n for i in where):  # fmt: skip
            raise ValueError(f"column {name!r}: bad indices")
        full: list[float | None] = [None] * n
        for i, v in zip(where, values.tolist(), strict=True):
            full[i] = v
        out[name] = full
    return steps, ts, out


def expand_steps(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One ``step`` record per call of a ``steps`` record (see the module docstring); ``[]`` for a damaged one.

    Each gets the batch's envelope (``seq`` included: they sort after the records written before the batch), the
    call's own time as ``t``, its step and logged values, and ``step_time`` / ``tokens_per_s`` /
    ``samples_per_s`` derived from the time since the previous call (unless the call logged those names itself).
    """
    try:
        steps, ts, cols = steps_columns(record)
    except ValueError:
        return []
    prev = record.get("prev")
    last: tuple[float, int] | None = None
    if isinstance(prev, list) and len(prev) == 2 and all(isinstance(x, (int, float)) for x in prev):
        last = (float(prev[0]), int(prev[1]))
    base = {"v": record.get("v"), "kind": "step", "rank": record.get("rank"), "seq": record.get("seq")}
    out: list[dict[str, Any]] = []
    for i, step in enumerate(steps):
        t = ts[i]
        rec: dict[str, Any] = {**base, "t": t, "step": step}
        for name, col in cols.items():
            value = col[i]
            if value is not None:
                rec[name] = value
        if last is not None and t > last[0]:
            span = t - last[0]
            if step > last[1]:
                rec.setdefault("step_time", span / (step - last[1]))
            for unit in ("tokens", "samples"):
                if unit in rec and math.isfinite(rec[unit]):
                    rec.setdefault(f"{unit}_per_s", rec[unit] / span)
        last = (t, step)
        out.append(rec)
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
    if obj["kind"] == "heartbeat":  # the name before schema 1.1
        obj["kind"] = "hb"
    nonfinite = obj.pop("nonfinite", None)
    if isinstance(nonfinite, dict):
        for key, name in nonfinite.items():
            if key in obj and obj[key] is None and name in _NONFINITE_NAMES:
                obj[key] = _NONFINITE_NAMES[name]
    return obj
