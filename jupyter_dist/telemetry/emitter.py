"""The in-worker telemetry emitter: writes :mod:`~jupyter_dist.telemetry.records` lines to its sinks.

Stdlib only at module level (the layer guard checks it); torch is never imported here, only looked up in
``sys.modules`` for CUDA memory figures when the training script has already imported it.

Sinks are two-method objects (``write_line(line)`` / ``close()``), the emitter is the fan-out container. It
differs from torchtitan's ``log(metrics, step)`` loggers in one way, on purpose: the envelope (rank, seq, time)
is built once by the emitter, so every sink writes the identical line and readers can de-duplicate records that
reach them twice (a file and a log stream).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .records import MAX_BATCH, SENTINEL, check_metrics, decode, encode, make_record, steps_fields

__all__ = ["Sink", "JsonlFileSink", "StreamSink", "Emitter", "Nvml", "telemetry_path", "memory_fields", "cuda_index"]

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


def memory_fields(device_index: int | None = None) -> dict[str, Any]:
    """The fields of a ``mem`` record: resident memory of this process and, with CUDA, the allocator's figures.

    CUDA figures come from ``torch.cuda.memory_stats`` and only when the script has imported torch and
    initialised CUDA (this never initialises it).
    """
    out: dict[str, Any] = {"device": "cpu"}
    try:
        with open("/proc/self/statm") as f:
            out["rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["max_rss"] = maxrss if sys.platform == "darwin" else maxrss * 1024
    except (ImportError, OSError):  # pragma: no cover - Windows
        pass
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available() and cuda.is_initialized():
        index = cuda.current_device() if device_index is None else device_index
        stats = cuda.memory_stats(index)
        out["device"] = f"cuda:{index}"
        out["allocated"] = int(stats.get("allocated_bytes.all.current", 0))
        out["reserved"] = int(stats.get("reserved_bytes.all.current", 0))
        out["peak_allocated"] = int(stats.get("allocated_bytes.all.peak", 0))
        out["peak_active"] = int(stats.get("active_bytes.all.peak", 0))
        out["alloc_retries"] = int(stats.get("num_alloc_retries", 0))
        out["ooms"] = int(stats.get("num_ooms", 0))
        out["device_total"] = int(cuda.get_device_properties(index).total_memory)
    return out


def cuda_index(local_index: int, visible: str | None) -> int | str:
    """The NVML device (index, or UUID string) behind CUDA device ``local_index`` given ``CUDA_VISIBLE_DEVICES``."""
    if not visible:
        return local_index
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if local_index >= len(items):
        return local_index
    item = items[local_index]
    return int(item) if item.isdigit() else item


class Nvml:
    """``gpu`` record fields from NVML (``pip install nvidia-ml-py``); disabled for good after the first failure."""

    def __init__(self, device: int | str) -> None:
        self.device = device
        self._handle: Any = None
        self._nvml: Any = None
        self.disabled = False

    def _open(self) -> Any:
        if self._handle is None and not self.disabled:
            try:
                import pynvml

                pynvml.nvmlInit()
                if isinstance(self.device, str):
                    self._handle = pynvml.nvmlDeviceGetHandleByUUID(self.device)
                else:
                    self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device)
                self._nvml = pynvml
            except Exception:  # no library, no driver, no such device: no gpu records
                self.disabled = True
        return self._handle

    def fields(self) -> dict[str, Any] | None:
        """Utilisation, memory, power and temperature of the device, or ``None`` when NVML is not usable."""
        handle = self._open()
        if handle is None:
            return None
        nv = self._nvml
        out: dict[str, Any] = {"index": self.device}
        try:
            util = nv.nvmlDeviceGetUtilizationRates(handle)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            out.update(util=float(util.gpu), mem_util=float(util.memory), mem_used=int(mem.used),
                       mem_total=int(mem.total))  # fmt: skip
        except Exception:
            self.disabled = True
            return None
        with contextlib.suppress(Exception):
            out["power_w"] = nv.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
        with contextlib.suppress(Exception):
            out["temp_c"] = float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
        return out


def _as_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def _tensor_values(values: list[Any]) -> list[float]:
    """Floats of one-element tensors with one ``.tolist()`` per device and dtype (one device sync per batch).

    Each value is converted in its own dtype (a bf16 loss is the bf16 number it was, as a float), never summed or
    rounded; a group that cannot be stacked falls back to ``.item()`` per value.
    """
    torch = sys.modules.get("torch")
    out: list[float] = [0.0] * len(values)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault((str(getattr(v, "device", "")), str(getattr(v, "dtype", ""))), []).append(i)
    for idx in groups.values():
        try:
            if torch is None or len(idx) == 1:
                raise TypeError
            floats = torch.stack([values[i].reshape(()) for i in idx]).tolist()
        except (TypeError, RuntimeError):
            floats = [_as_float(values[i]) for i in idx]
        for i, f in zip(idx, floats, strict=True):
            out[i] = float(f)
    return out


class Emitter:
    """Builds records for one rank and fans them out to its sinks; thread-safe.

    Every :meth:`log` call is kept with its step, its time and its values: calls are buffered and written as one
    ``steps`` record when ``interval_s`` has passed since the last write, when :data:`~.records.MAX_BATCH` calls
    are waiting, at once for the first call, on :meth:`flush`, at exit, and from the monitor thread once the batch
    is older than ``interval_s``. Only the *write* is batched, never the values. One-element tensors are kept
    (detached) and converted when the batch is written, with one ``.tolist()`` per device (one sync per batch).

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
    interval_s
        Seconds between ``steps`` writes (0: one write per :meth:`log` call); values are never merged.
    """

    def __init__(
        self,
        *,
        rank: int,
        sinks: Sequence[Sink] = (),
        first_seq: int = 0,
        clock: Callable[[], float] = time.time,
        interval_s: float = 1.0,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.rank = rank
        self.sinks = list(sinks)
        self.interval_s = interval_s
        self._seq = first_seq
        self._clock = clock
        self._lock = threading.RLock()
        self._closed = False
        self._ended = False  # the ``exit`` record is written: it stays the rank's last
        self._failed = False
        self._monitor: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_step: int | None = None
        """The step of the last :meth:`log` call (``None`` before the first)."""
        self._calls: list[tuple[int, float, dict[str, Any]]] = []  # (step, time, values) not written yet
        self._tensors = False  # whether a value in _calls is a tensor
        self._ref: tuple[float, int] | None = None  # (time, step) of the last call of the previous batch
        self._last_flush: float | None = None
        self._phase: tuple[str, float] = ("init", clock())
        self.nvml: Nvml | None = None
        """Source of ``gpu`` records (set by the worker when it uses CUDA)."""
        self.cuda_device: int | None = None
        """CUDA device whose allocator figures go into ``mem`` records."""
        self.comm: Any = None
        """Source of ``comm`` records: an object whose ``take()`` returns the window's fields or ``None``."""

    @classmethod
    def for_run_dir(cls, run_dir: str | os.PathLike[str] | None, *, rank: int, stream_fd: int | None = None,
                    interval_s: float = 1.0) -> Emitter:  # fmt: skip
        """The emitter of a worker: a JSONL file under ``run_dir`` (if given) and a sentinel stream (if given).

        The sequence continues after the last record this rank already wrote to the file, so a restarted worker
        never repeats a ``(rank, seq)`` pair. With a stream sink the sequence starts no lower than the clock in
        milliseconds: a cluster job recovered on a fresh node (no file left to continue from) then still never
        repeats a pair that the notebook's reader has seen in the stream.
        """
        sinks: list[Sink] = []
        first_seq = 0
        if run_dir is not None:
            file_sink = JsonlFileSink(telemetry_path(run_dir, rank))
            first_seq = file_sink.last_seq(rank) + 1
            sinks.append(file_sink)
        if stream_fd is not None:
            sinks.append(StreamSink(stream_fd))
            first_seq = max(first_seq, int(time.time() * 1000))
        return cls(rank=rank, sinks=sinks, first_seq=first_seq, interval_s=interval_s)

    @property
    def enabled(self) -> bool:
        """Whether records go anywhere."""
        return bool(self.sinks) and not self._closed

    @property
    def next_seq(self) -> int:
        """The ``seq`` the next record will get."""
        return self._seq

    @property
    def phase(self) -> str:
        """What the main thread is doing (reported in ``hb`` records)."""
        return self._phase[0]

    def set_phase(self, name: str) -> None:
        """Enter phase ``name`` (cheap: no lock, no I/O)."""
        if self._phase[0] != name:
            self._phase = (name, self._clock())

    def emit(self, kind: str, **fields: Any) -> dict[str, Any] | None:
        """Write one record of ``kind``; returns it, or ``None`` when disabled or closed."""
        if not self.enabled:
            return None
        with self._lock:
            return self._emit_locked(kind, fields)

    def _emit_locked(self, kind: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        if self._closed or self._ended:
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

    # ---- step records --------------------------------------------------------------------------------------
    def log(self, metrics: dict[str, Any], step: int) -> dict[str, Any] | None:
        """Keep one call (validates even when disabled); returns the ``steps`` record if this call wrote one."""
        step_int, values = check_metrics(step, metrics)
        self.last_step = step_int
        if self._phase[0] == "setup":  # the first step: the cell's set-up is over
            self.set_phase("forward")
        if not self.enabled:
            return None
        now = self._clock()
        with self._lock:
            self._calls.append((step_int, now, values))
            if not self._tensors and any(hasattr(v, "detach") for v in values.values()):
                self._tensors = True
            if (self._last_flush is None or self.interval_s == 0 or now - self._last_flush >= self.interval_s
                    or len(self._calls) >= MAX_BATCH):  # fmt: skip
                return self._flush_locked(now)
        return None

    @property
    def pending(self) -> int:
        """Calls kept but not written yet."""
        return len(self._calls)

    def flush(self, *, if_older_than: float | None = None) -> dict[str, Any] | None:
        """Write the pending calls now (or only if the last write is ``if_older_than`` seconds old)."""
        with self._lock:
            if not self._calls or self._closed:
                return None
            now = self._clock()
            if if_older_than is not None and self._last_flush is not None and now - self._last_flush < if_older_than:
                return None
            return self._flush_locked(now)

    def _flush_locked(self, now: float) -> dict[str, Any] | None:
        calls, self._calls = self._calls, []
        if self._tensors:
            self._tensors = False
            where = [(i, k) for i, (_, _, vals) in enumerate(calls) for k, v in vals.items() if hasattr(v, "detach")]
            floats = _tensor_values([calls[i][2][k] for i, k in where])
            for (i, k), f in zip(where, floats, strict=True):
                calls[i][2][k] = f
        fields = steps_fields(calls, self._ref)
        self._ref = (calls[-1][1], calls[-1][0])
        self._last_flush = now
        return self._emit_locked("steps", fields)

    # ---- other records --------------------------------------------------------------------------------------
    def start_record(self, **fields: Any) -> dict[str, Any] | None:
        """Write the ``start`` record; ``pid`` and ``host`` are filled in unless given."""
        fields.setdefault("pid", os.getpid())
        fields.setdefault("host", socket.gethostname())
        return self.emit("start", **fields)

    def error_record(self, error: BaseException, traceback_text: str = "") -> dict[str, Any] | None:
        """Write an ``error`` record: type, message and the last 30 lines of ``traceback_text``."""
        tail = "\n".join(traceback_text.rstrip().splitlines()[-30:])
        return self.emit("error", error_type=type(error).__name__, error=str(error), traceback=tail)

    def exit_record(self, status: str, error: BaseException | None = None, **fields: Any) -> dict[str, Any] | None:
        """Write the pending ``jd.log`` calls and collective timings, then the ``exit`` record (status, error).

        On CUDA (:attr:`cuda_device` set) a last ``mem`` and ``gpu`` record come first: the run's peak device memory,
        even when it ended before the monitor's first round (a short run on a GPU had only a record from before its
        first allocation).

        The ``exit`` record is the rank's last: the monitor is told to stop first, and a round of it that was already
        under way writes nothing after it (a ``mem`` after ``exit`` broke "the last record says how the rank ended").
        """
        self._stop.set()
        self.flush()
        with contextlib.suppress(Exception):
            self.comm_record()
        if self.cuda_device is not None:
            with contextlib.suppress(Exception):
                self.memory()
        self.set_phase("done")
        with self._lock:  # reentrant: emit takes it again
            record = self.emit(
                "exit",
                status=status,
                error_type=None if error is None else type(error).__name__,
                error=None if error is None else str(error),
                step=self.last_step,
                **fields,
            )
            self._ended = True
            return record

    def heartbeat(self) -> dict[str, Any] | None:
        """Write one ``hb`` record (last step, phase and seconds in it)."""
        name, since = self._phase
        return self.emit("hb", step=self.last_step, phase=name, phase_s=round(max(0.0, self._clock() - since), 3))

    def memory(self) -> dict[str, Any] | None:
        """Write one ``mem`` record and, when NVML is usable, one ``gpu`` record."""
        try:
            fields = memory_fields(self.cuda_device)
        except Exception as e:  # a broken CUDA context must not kill the monitor
            fields = {"device": "unknown", "error": str(e)}
        record = self.emit("mem", **fields)
        if self.nvml is not None and not self.nvml.disabled:
            gpu = self.nvml.fields()
            if gpu is not None:
                self.emit("gpu", **gpu)
        return record

    def tick(self) -> None:
        """One round of the monitor thread: pending calls older than the interval, then ``hb``, ``mem``, ``gpu``."""
        self.flush(if_older_than=self.interval_s)
        self.heartbeat()
        self.memory()
        self.comm_record()

    def comm_record(self) -> dict[str, Any] | None:
        """Write the collective timings gathered since the last call as one ``comm`` record (if any)."""
        if self.comm is None:
            return None
        fields = self.comm.take()
        return self.emit("comm", **fields) if fields else None

    def start_monitor(self, interval_s: float) -> None:
        """Run :meth:`tick` every ``interval_s`` seconds from a daemon thread until :meth:`close`."""
        if interval_s <= 0 or self._monitor is not None or not self.enabled:
            return

        def run() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.tick()
                except Exception as e:  # pragma: no cover - never let the monitor die silently mid-run
                    _log.warning("jupyter_dist telemetry monitor: %s", e)

        self._monitor = threading.Thread(target=run, name="jupyter-dist-monitor", daemon=True)
        self._monitor.start()

    start_heartbeat = start_monitor

    def stop_monitor(self, timeout: float = 1.0) -> None:
        """Stop the monitor thread and wait up to ``timeout`` s for it to end; records can still be written."""
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=timeout)

    def close(self) -> None:
        """Flush, stop the monitor and close the sinks; later records are dropped."""
        self.flush()
        self.stop_monitor()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sink in self.sinks:
                sink.close()
