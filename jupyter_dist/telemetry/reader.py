"""Read telemetry records: from a run's ``telemetry/rank-<k>.jsonl`` files or from log lines carrying the sentinel.

Records are de-duplicated by (rank, seq); torn, partial or foreign lines are counted, never fatal. A ``steps``
batch is handed out as one ``step`` record per ``jd.log`` call (:func:`~.records.expand_steps`), so every reader
sees every logged value at its step.

* :class:`RecordSet` -- parse lines, de-duplicate, keep the records (the whole run, for post-hoc analysis);
* :class:`FileFollower` -- the new complete lines of every ``rank-*.jsonl`` in a folder since the last call, for
  files that grow, appear late, or end with a line still being written;
* :class:`TelemetryReader` -- follows a folder and/or log lines fed to it on a background thread, keeps bounded
  ring buffers per kind and hands new records to listeners (the live dashboard). It never blocks the caller.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .records import KINDS, SENTINEL, decode, expand_steps

__all__ = [  # fmt: skip
    "SENTINEL", "RecordSet", "Dedup", "FileFollower", "TelemetryReader", "read_run_records", "StepColumns",
    "RunColumns", "read_run_columns",
]

_log = logging.getLogger(__name__)

Listener = Callable[[list[dict[str, Any]]], None]


class Dedup:
    """Remembers which (rank, seq) pairs were seen, in bounded memory.

    Per rank it keeps the exact set of the last ``window`` sequence numbers; anything at or below the floor under
    that window counts as seen (records of one rank arrive nearly in order from a file or a log stream).
    """

    def __init__(self, window: int = 4096) -> None:
        self.window = window
        self._seen: dict[int, set[int]] = {}
        self._floor: dict[int, int] = {}

    def first_time(self, rank: int, seq: int) -> bool:
        """True (and remember it) when ``(rank, seq)`` was not seen before."""
        if seq <= self._floor.get(rank, -1):
            return False
        seen = self._seen.setdefault(rank, set())
        if seq in seen:
            return False
        seen.add(seq)
        if len(seen) > 2 * self.window:
            floor = max(seen) - self.window
            self._seen[rank] = {s for s in seen if s > floor}
            self._floor[rank] = floor
        return True


@dataclass
class RecordSet:
    """Records seen so far, in arrival order, de-duplicated by (rank, seq)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    """Accepted records."""
    bad_lines: int = 0
    """Torn or foreign lines skipped."""
    duplicates: int = 0
    """Records dropped because their (rank, seq) was seen already."""
    _dedup: Dedup = field(default_factory=Dedup, repr=False)

    def add_lines(self, lines: Iterable[str]) -> int:
        """Parse and add lines; returns how many records were accepted."""
        added = 0
        for rec in self.parse(lines):
            self.records.append(rec)
            added += 1
        return added

    def unique(self, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
        """The records as written among ``lines`` (a ``steps`` batch whole), each (rank, seq) once; counts the rest."""
        for line in lines:
            if not line.strip():
                continue
            rec = decode(line)
            if rec is None:
                self.bad_lines += 1
                continue
            try:
                rank, seq = int(rec["rank"]), int(rec["seq"])
            except (TypeError, ValueError):
                self.bad_lines += 1
                continue
            if not self._dedup.first_time(rank, seq):
                self.duplicates += 1
                continue
            yield rec

    def parse(self, lines: Iterable[str]) -> list[dict[str, Any]]:
        """The new records among ``lines`` (counting bad lines and duplicates), without keeping them."""
        out = []
        for rec in self.unique(lines):
            if rec.get("kind") == "steps":
                calls = expand_steps(rec)
                if not calls:
                    self.bad_lines += 1
                out.extend(calls)
            else:
                out.append(rec)
        return out

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Records of one kind (``step``, ``exit``, ...)."""
        return [r for r in self.records if r.get("kind") == kind]


def read_run_records(telemetry_dir: str | os.PathLike[str]) -> RecordSet:
    """All records of a run directory's ``telemetry/`` folder (complete lines only)."""
    rs = RecordSet()
    follower = FileFollower(telemetry_dir)
    while rs.add_lines(lines := follower.poll()) or lines:  # a poll reads at most max_bytes_per_poll
        pass
    return rs


class FileFollower:
    """The new complete lines of ``<folder>/rank-*.jsonl`` since the last :meth:`poll`.

    Keeps a byte offset per file and holds back a last line without its newline until it is complete. Files that
    appear later are picked up by the next poll; a file that shrank (replaced) is read again from the start.
    """

    def __init__(self, folder: str | os.PathLike[str], pattern: str = "rank-*.jsonl", *,
                 max_bytes_per_poll: int = 64 << 20) -> None:  # fmt: skip
        self.folder = Path(folder)
        self.pattern = pattern
        self.max_bytes_per_poll = max_bytes_per_poll
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def poll(self) -> list[str]:
        """Complete new lines of every file, file by file (each file's lines in order)."""
        if not self.folder.is_dir():
            return []
        lines: list[str] = []
        budget = self.max_bytes_per_poll
        for path in sorted(self.folder.glob(self.pattern)):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            offset = self._offsets.get(path, 0)
            if size < offset:  # replaced or truncated
                offset = self._offsets[path] = 0
                self._partial.pop(path, None)
            if size == offset or budget <= 0:
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(min(size - offset, budget))
            except OSError:
                continue
            budget -= len(data)
            self._offsets[path] = offset + len(data)
            data = self._partial.pop(path, b"") + data
            cut = data.rfind(b"\n")
            if cut < 0:
                self._partial[path] = data
                continue
            if cut + 1 < len(data):
                self._partial[path] = data[cut + 1 :]
            lines.extend(data[:cut].decode("utf-8", "replace").split("\n"))
        return lines

    @property
    def pending_bytes(self) -> int:
        """Bytes held back as incomplete last lines."""
        return sum(len(b) for b in self._partial.values())


class TelemetryReader:
    """Follows a run's telemetry on a background thread and hands new records to listeners.

    Parameters
    ----------
    telemetry_dir
        A run's ``telemetry/`` folder to follow (``None``: only lines given to :meth:`feed`).
    interval
        Seconds between polls of the background thread.
    maxlen
        Records kept per kind in :attr:`buffers` (ring buffers; older ones are dropped).

    Listeners are called on the reader's thread with each batch of new records (de-duplicated, in arrival order);
    an exception in a listener is logged and counted in :attr:`listener_errors`, and the reader goes on.
    """

    def __init__(self, telemetry_dir: str | os.PathLike[str] | None = None, *, interval: float = 0.5,
                 maxlen: int = 10_000) -> None:  # fmt: skip
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.follower = FileFollower(telemetry_dir) if telemetry_dir is not None else None
        self.interval = interval
        self.records = RecordSet()
        self.buffers: dict[str, deque[dict[str, Any]]] = {k: deque(maxlen=maxlen) for k in KINDS}
        self.latest: dict[tuple[str, int], dict[str, Any]] = {}
        """The newest record of each (kind, rank)."""
        self.accepted = 0
        self.listener_errors = 0
        self._fed: deque[str] = deque()
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- inputs ---------------------------------------------------------------------------------------------
    def feed(self, lines: Iterable[str]) -> None:
        """Queue log-stream lines (any line; records are found after the sentinel); thread-safe, never blocks."""
        with self._lock:
            self._fed.extend(lines)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(records)`` with every batch of new records."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    # ---- polling --------------------------------------------------------------------------------------------
    def poll(self) -> list[dict[str, Any]]:
        """One round: read new file lines and fed lines, keep the new records, call the listeners; returns them."""
        with self._poll_lock:
            file_lines = self.follower.poll() if self.follower is not None else []
            with self._lock:
                fed = list(self._fed)
                self._fed.clear()
            new = self.records.parse(file_lines)
            if fed:
                new += self._parse_stream(fed)
            for rec in new:
                kind = str(rec.get("kind"))
                buf = self.buffers.get(kind)
                if buf is None:  # a kind from a newer writer: keep it too
                    buf = self.buffers[kind] = deque(maxlen=next(iter(self.buffers.values())).maxlen)
                buf.append(rec)
                self.latest[(kind, int(rec["rank"]))] = rec
            self.accepted += len(new)
            if new:
                for listener in list(self._listeners):
                    try:
                        listener(new)
                    except Exception:
                        self.listener_errors += 1
                        _log.exception("jupyter_dist telemetry listener %r failed", listener)
            return new

    def _parse_stream(self, lines: list[str]) -> list[dict[str, Any]]:
        # in a log stream most lines are ordinary output: only lines with the sentinel are records
        tagged = [ln for ln in lines if SENTINEL in ln]
        return self.records.parse(tagged)

    @property
    def bad_lines(self) -> int:
        """Torn or damaged record lines skipped so far."""
        return self.records.bad_lines

    @property
    def duplicates(self) -> int:
        """Records dropped as already seen."""
        return self.records.duplicates

    # ---- thread ---------------------------------------------------------------------------------------------
    def start(self) -> TelemetryReader:
        """Poll every :attr:`interval` seconds on a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="jupyter-dist-reader", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # pragma: no cover - a reader must never die silently
                _log.exception("jupyter_dist telemetry reader poll failed")
            self._stop.wait(self.interval)

    def stop(self, *, final_poll: bool = True) -> None:
        """Stop the thread (after one last poll, so nothing already written is missed)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        if final_poll:
            self.poll()

    @property
    def running(self) -> bool:
        """Whether the background thread is alive."""
        return self._thread is not None and self._thread.is_alive()


def _numpy() -> Any:
    """The numpy module when importable (pandas and torch bring it): the columns' fast paths; else ``None``."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with pandas and torch
        return None
    return numpy


@dataclass
class StepColumns:
    """Every ``jd.log`` call of one rank as columns (in the order the rank made them): the fast way to a table.

    ``step`` (int64) and ``t`` (float64, unix time) are arrays; ``metrics[name]`` is an ``array("d")`` when every
    call logged ``name``, else a list with ``None`` for the calls that did not. ``starts`` holds the indices of the
    first call after each (re)start of the rank, whose time since a previous call is unknown.
    """

    rank: int
    step: array[int] = field(default_factory=lambda: array("q"))
    t: array[float] = field(default_factory=lambda: array("d"))
    metrics: dict[str, Any] = field(default_factory=dict)
    starts: list[int] = field(default_factory=list)
    _derived: tuple[int, dict[str, Any]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.step)

    @property
    def fresh(self) -> list[bool]:
        """Per call: whether it is the first after a (re)start."""
        out = [False] * len(self.step)
        for i in self.starts:
            out[i] = True
        return out

    def column(self, name: str) -> Any:
        """A metric as a float64 numpy array (NaN where not logged); needs numpy."""
        np = _numpy()
        col = self.metrics[name]
        if isinstance(col, array):
            return np.frombuffer(col, dtype=np.float64)
        return np.array(col, dtype=np.float64)  # None -> NaN

    def derived(self) -> dict[str, Any]:
        """``step_time`` and ``tokens_per_s`` / ``samples_per_s`` per call, as :func:`~.records.expand_steps` does.

        From the time since the previous call (undefined for a call after a (re)start); no column for a name the
        rank logged itself. float64 numpy arrays with NaN where undefined (lists with ``None`` without numpy).
        """
        key = len(self.step)
        if self._derived is not None and self._derived[0] == key:
            return self._derived[1]
        np = _numpy()
        out: dict[str, Any] = {}
        if np is not None and key:
            t = np.frombuffer(self.t, dtype=np.float64)
            steps = np.frombuffer(self.step, dtype=np.int64)
            spans = np.full(key, np.nan)
            spans[1:] = np.diff(t)
            spans[self.starts] = np.nan
            spans[~(spans > 0)] = np.nan
            with np.errstate(divide="ignore", invalid="ignore"):
                if "step_time" not in self.metrics:
                    ds = np.zeros(key)
                    ds[1:] = np.diff(steps)
                    out["step_time"] = np.where(ds > 0, spans / np.where(ds > 0, ds, 1), np.nan)
                for unit in ("tokens", "samples"):
                    if unit in self.metrics and f"{unit}_per_s" not in self.metrics:
                        units = self.column(unit)
                        out[f"{unit}_per_s"] = np.where(np.isfinite(units), units / spans, np.nan)
        elif key:
            fresh = self.fresh
            t, steps = self.t, self.step
            spans_l: list[float | None] = [None]
            spans_l += [b - a if not f and b > a else None for a, b, f in zip(t, t[1:], fresh[1:], strict=False)]
            if "step_time" not in self.metrics:
                ds_l = [0] + [b - a for a, b in zip(steps, steps[1:], strict=False)]
                out["step_time"] = [sp / d if sp is not None and d > 0 else None
                                    for sp, d in zip(spans_l, ds_l, strict=True)]  # fmt: skip
            for unit in ("tokens", "samples"):
                units_l = self.metrics.get(unit)
                if units_l is not None and f"{unit}_per_s" not in self.metrics:
                    out[f"{unit}_per_s"] = [u / sp if sp is not None and u is not None and math.isfinite(u) else None
                                            for u, sp in zip(units_l, spans_l, strict=True)]  # fmt: skip
        self._derived = (key, out)
        return out

    def thin(self, metric: str | None, target: int) -> list[int]:
        """Indices of about ``target`` calls to draw (every index when there are few calls).

        The first, the last, and per bucket of calls those with the smallest and largest ``metric``: a spike stays.
        """
        n = len(self.step)
        if n <= target or target < 4:
            return list(range(n))
        buckets = max(1, (target - 2) // 2)
        keep = {0, n - 1}
        np = _numpy()
        if metric is None or metric not in self.metrics:
            keep.update(b * n // buckets for b in range(buckets))
            return sorted(keep)
        if np is not None:
            col = self.column(metric)
            width = -(-n // buckets)
            padded = np.full(width * buckets, np.nan)
            padded[:n] = col
            grid = padded.reshape(buckets, width)
            base = np.arange(buckets) * width
            finite = np.isfinite(grid)
            lo = np.argmin(np.where(finite, grid, np.inf), axis=1) + base
            hi = np.argmax(np.where(finite, grid, -np.inf), axis=1) + base
            keep.update(int(i) for i in np.concatenate([lo, hi]) if i < n)
            return sorted(keep)
        col_l = self.metrics[metric]
        for b in range(buckets):
            lo_i, hi_i = b * n // buckets, (b + 1) * n // buckets
            finite_i = [i for i in range(lo_i, hi_i) if col_l[i] is not None and math.isfinite(col_l[i])]
            if finite_i:
                keep.add(min(finite_i, key=col_l.__getitem__))
                keep.add(max(finite_i, key=col_l.__getitem__))
            elif lo_i < hi_i:
                keep.add(lo_i)
        return sorted(keep)

    def records(self, indices: Iterable[int]) -> list[dict[str, Any]]:
        """The ``step`` records of the calls at ``indices`` (derived values included), as a reader would give them."""
        derived = self.derived()
        out = []
        for i in indices:
            rec: dict[str, Any] = {"v": 1, "kind": "step", "rank": self.rank, "seq": -1, "t": self.t[i],
                                   "step": self.step[i]}  # fmt: skip
            for name, col in self.metrics.items():
                if col[i] is not None:
                    rec[name] = col[i]
            for name, col in derived.items():
                v = col[i]
                if v is not None and v == v:
                    rec[name] = float(v)
            out.append(rec)
        return out

    def _extend(self, steps: Any, ts: Any, cols: dict[str, Any], fresh: bool) -> None:
        n0, n = len(self.step), len(steps)
        if fresh:
            self.starts.append(n0)
        self.step.extend(steps if isinstance(steps, array) else array("q", steps))
        self.t.extend(ts if isinstance(ts, array) else array("d", ts))
        for name in [k for k in cols if k not in self.metrics]:  # in the order the rank logged them
            self.metrics[name] = [None] * n0 if n0 else (array("d") if isinstance(cols[name], array) else [])
        for name, col in list(self.metrics.items()):
            new = cols.get(name)
            if isinstance(col, array) and isinstance(new, array):
                col.extend(new)
                continue
            if isinstance(col, array):  # no longer logged by every call: a list with None
                col = self.metrics[name] = col.tolist()
            if new is None:
                col.extend([None] * n)
            else:
                col.extend(new.tolist() if isinstance(new, array) else new)


@dataclass
class RunColumns:
    """A run's telemetry read for analysis: the steps per rank as :class:`StepColumns`, the other records whole."""

    steps: dict[int, StepColumns] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    """Every record that is not a logged call (``start``, ``mem``, ``exit``, ...)."""
    names: dict[str, None] = field(default_factory=dict)
    """Every metric name logged, in first-seen order (also those whose columns were not decoded)."""
    bad_lines: int = 0


def read_run_columns(telemetry_dir: str | os.PathLike[str], *, follower: FileFollower | None = None,
                     metrics: Any = None) -> RunColumns:  # fmt: skip
    """Every logged call of a run's ``telemetry/`` folder as columns, without a dict per call.

    Reads ``steps`` batches straight into lists (older one-record-per-call ``step`` records are added as they are),
    de-duplicated by (rank, seq) like :class:`RecordSet`. For 8 ranks x 100k calls this is the difference between
    about a second and most of a minute (``benchmarks/lossless_telemetry.py``). With ``follower`` (a live
    reader's), reading starts where it stands and leaves it at the end, so the reader goes on with new lines only.
    ``metrics`` (names) decodes only those metrics' columns (steps and times always).
    """
    from .records import ENVELOPE, steps_arrays

    out = RunColumns()
    seen = RecordSet()
    follower = follower if follower is not None else FileFollower(telemetry_dir)
    lines: list[str] = []
    while batch := follower.poll():  # a poll reads at most max_bytes_per_poll
        lines.extend(batch)
    for rec in seen.unique(lines):
        rank = int(rec["rank"])
        kind = rec.get("kind")
        if kind == "steps":
            try:
                steps, ts, cols = steps_arrays(rec, metrics)
            except ValueError:
                out.bad_lines += 1
                continue
            target = out.steps.setdefault(rank, StepColumns(rank))
            target._extend(steps, ts, cols, rec.get("prev") is None)
            if isinstance(rec.get("m"), dict):
                for name in rec["m"]:
                    out.names.setdefault(name)
        elif kind == "step" and isinstance(rec.get("step"), int):
            values = {k: float(v) for k, v in rec.items() if k not in ENVELOPE and k != "step"
                      and isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
            target = out.steps.setdefault(rank, StepColumns(rank))
            target._extend([rec["step"]], [float(rec["t"])], {k: [v] for k, v in values.items()}, False)
            for name in values:
                out.names.setdefault(name)
        else:
            out.records.append(rec)
    out.bad_lines += seen.bad_lines
    return out
