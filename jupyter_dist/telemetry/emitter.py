"""The in-worker telemetry emitter: writes :mod:`~jupyter_dist.telemetry.records` lines to its sinks.

Stdlib only at module level (the layer guard checks it); torch is never imported here, only looked up in
``sys.modules`` for CUDA memory figures when the training script has already imported it.

Sinks are two-method objects (``write_line(line)`` / ``close()``), the emitter is the fan-out container. It
differs from torchtitan's ``log(metrics, step)`` loggers in one way, on purpose: the envelope (rank, seq, time)
is built once by the emitter, so every sink writes the identical line and readers can de-duplicate records that
reach them twice (a file and a log stream).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .records import SENTINEL, decode, encode, make_record, step_fields

__all__ = ["Sink", "JsonlFileSink", "StreamSink", "Emitter", "telemetry_path", "memory_fields"]

_log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where encoded record lines go."""

    def write_line(self, line: str) -> None:
        """Write one encoded record (without newline) and make it visible to readers at once."""

    def close(self) -> None:
        """Release the sink; later writes are dropped."""


def telemetry_path(run_dir: str | os.PathLike[str], rank: int) -> str:
    """``<run dir>/telemetry/rank-<k>.jsonl``."""
    return os.path.join(os.fspath(run_dir), "telemetry", f"rank-{rank}.jsonl")


class JsonlFileSink:
    """Appends lines to a JSONL file with one unbuffered ``write(2)`` per record (``O_APPEND``).

    A record therefore reaches the file whole or, if the process dies inside the call, as a torn last line
    that readers skip; there is no user-space buffer to flush.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # a torn line left by a killed predecessor must not swallow our first record
        if os.fstat(self._fd).st_size > 0 and not _ends_with_newline(self.path):
            os.write(self._fd, b"\n")

    def last_seq(self, rank: int) -> int:
        """The largest ``seq`` written by ``rank`` into this file so far, or -1 (reads the tail, then all)."""
        size = os.path.getsize(self.path)
        for start in (max(0, size - 65536), 0):
            best = -1
            with open(self.path, "rb") as f:
                f.seek(start)
                for raw in f:
                    rec = decode(raw.decode("utf-8", "replace"))
                    if rec is not None and rec.get("rank") == rank and isinstance(rec.get("seq"), int):
                        best = max(best, rec["seq"])
            if best >= 0 or start == 0:
                return best
        return -1  # pragma: no cover - the loop always returns

    def write_line(self, line: str) -> None:
        """Append ``line`` and a newline in one system call."""
        if self._fd is not None:
            os.write(self._fd, (line + "\n").encode("utf-8"))

    def close(self) -> None:
        """Close the file descriptor."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class StreamSink:
    """Writes ``SENTINEL + line`` to a file descriptor (default: the original stdout, fd 1) in one call."""

    def __init__(self, fd: int = 1) -> None:
        self._fd: int | None = fd

    def write_line(self, line: str) -> None:
        """Write the sentinel line."""
        if self._fd is not None:
            os.write(self._fd, (SENTINEL + line + "\n").encode("utf-8"))

    def close(self) -> None:
        """Stop writing (the descriptor belongs to the process and stays open)."""
        self._fd = None


def memory_fields() -> dict[str, int]:
    """Resident memory of this process and, when the script uses CUDA, torch's allocator figures (bytes)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["max_rss_bytes"] = maxrss if sys.platform == "darwin" else maxrss * 1024
    except (ImportError, OSError):  # pragma: no cover - Windows
        pass
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available() and cuda.is_initialized():
        out["cuda_allocated_bytes"] = int(cuda.memory_allocated())
        out["cuda_max_allocated_bytes"] = int(cuda.max_memory_allocated())
    return out


class Emitter:
    """Builds records for one rank and fans them out to its sinks; thread-safe.

    Parameters
    ----------
    rank
        Global rank written into every record.
    sinks
        Where lines go; with no sinks every call is a cheap no-op.
    first_seq
        Sequence number of the first record (continue after what a file already holds).
    clock
        Source of ``t`` (unix seconds).
    """

    def __init__(
        self,
        *,
        rank: int,
        sinks: Sequence[Sink] = (),
        first_seq: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rank = rank
        self.sinks = list(sinks)
        self._seq = first_seq
        self._clock = clock
        self._lock = threading.Lock()
        self._closed = False
        self._failed = False
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_step: int | None = None
        """The step of the last ``step`` record (``None`` before the first)."""

    @classmethod
    def for_run_dir(cls, run_dir: str | os.PathLike[str] | None, *, rank: int, stream_fd: int | None = None) -> Emitter:
        """The emitter of a worker: a JSONL file under ``run_dir`` (if given) and a sentinel stream (if given).

        The sequence continues after the last record this rank already wrote to the file, so a restarted worker
        never repeats a ``(rank, seq)`` pair.
        """
        sinks: list[Sink] = []
        first_seq = 0
        if run_dir is not None:
            file_sink = JsonlFileSink(telemetry_path(run_dir, rank))
            first_seq = file_sink.last_seq(rank) + 1
            sinks.append(file_sink)
        if stream_fd is not None:
            sinks.append(StreamSink(stream_fd))
        return cls(rank=rank, sinks=sinks, first_seq=first_seq)

    @property
    def enabled(self) -> bool:
        """Whether records go anywhere."""
        return bool(self.sinks) and not self._closed

    @property
    def next_seq(self) -> int:
        """The ``seq`` the next record will get."""
        return self._seq

    def emit(self, kind: str, **fields: Any) -> dict[str, Any] | None:
        """Write one record of ``kind``; returns it, or ``None`` when disabled or closed."""
        if not self.enabled:
            return None
        with self._lock:
            if self._closed:
                return None
            record = make_record(kind, rank=self.rank, seq=self._seq, t=self._clock(), **fields)
            line = encode(record)
            self._seq += 1
            for sink in self.sinks:
                try:
                    sink.write_line(line)
                except OSError as e:  # telemetry must never stop training: report once, keep going
                    if not self._failed:
                        _log.warning("jupyter_dist telemetry: writing to %r failed: %s", sink, e)
                        self._failed = True
        return record

    def log(self, metrics: dict[str, Any], step: int) -> dict[str, Any] | None:
        """Write a ``step`` record (validates and converts metrics even when disabled)."""
        fields = step_fields(step, metrics)
        self.last_step = fields["step"]
        return self.emit("step", **fields)

    def start_record(self, **fields: Any) -> dict[str, Any] | None:
        """Write the ``start`` record; ``pid`` and ``host`` are filled in unless given."""
        fields.setdefault("pid", os.getpid())
        fields.setdefault("host", socket.gethostname())
        return self.emit("start", **fields)

    def exit_record(self, status: str, error: BaseException | None = None, **fields: Any) -> dict[str, Any] | None:
        """Write the ``exit`` record with ``status`` and, for an error, its type and message."""
        return self.emit(
            "exit",
            status=status,
            error_type=None if error is None else type(error).__name__,
            error=None if error is None else str(error),
            step=self.last_step,
            **fields,
        )

    def heartbeat(self) -> dict[str, Any] | None:
        """Write one ``heartbeat`` record (last step and memory figures)."""
        return self.emit("heartbeat", step=self.last_step, **memory_fields())

    def start_heartbeat(self, interval_s: float) -> None:
        """Write a heartbeat every ``interval_s`` seconds from a daemon thread until :meth:`close`."""
        if interval_s <= 0 or self._heartbeat is not None or not self.enabled:
            return

        def run() -> None:
            while not self._stop.wait(interval_s):
                self.heartbeat()

        self._heartbeat = threading.Thread(target=run, name="jupyter-dist-heartbeat", daemon=True)
        self._heartbeat.start()

    def close(self) -> None:
        """Stop the heartbeat and close the sinks; later records are dropped."""
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=1.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sink in self.sinks:
                sink.close()
