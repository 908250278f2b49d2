"""What the ranks print, shown while the run goes: their log files followed, filtered, prefixed and rate-limited.

Each rank writes its stdout and stderr to ``logs/rank-<k>.log`` (:mod:`.bootstrap`; on SkyPilot the
:class:`~.backends.stream.LogRouter` writes the same files from the job's log stream, on SLURM the ranks write them
on the shared filesystem). A rank never writes into a pipe the kernel has to drain, so a rank printing in a tight
loop cannot block on a slow notebook or terminal. :class:`RankOutput` follows the chosen ranks' files from a daemon
thread of the kernel (or of ``jupyter-dist launch``) and writes their new lines, each prefixed ``[rank<k>] ``, to a
sink:

* in a notebook (an IPython kernel) a :class:`DisplaySink`: one display under the cell, updated through its display
  id (as the dashboard's final panels are), so lines that arrive after the cell has finished still land under it,
  and the text stays in the saved notebook;
* elsewhere (a terminal, ``jupyter-dist launch``, IPython without a kernel) a :class:`StreamSink` on ``sys.stdout``.

At most ``rate`` lines per second are shown (a burst of ``burst`` first); the others are counted and said in one
line (``[rank0] ... 99,800 lines dropped (over 50 lines/s); every line is in .../rank-0.log``). Telemetry records
printed after the ``SENTINEL`` are never shown. ``--output all|0|none|0,2`` chooses the ranks (:func:`parse_output`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import JupyterDistError
from ..telemetry.records import SENTINEL

__all__ = ["DEFAULT_BURST", "DEFAULT_RATE", "DisplaySink", "OutputSelection", "RankOutput", "StreamSink",
           "default_sink", "parse_output"]  # fmt: skip

DEFAULT_RATE = 50.0
"""Lines per second shown of all the followed ranks together; the rest are counted and said as dropped."""
DEFAULT_BURST = 200
"""Lines shown at once before the rate applies (a script's start-up banner, a short traceback)."""
NOTE_EVERY_S = 2.0
"""While a rank keeps printing over the rate, how often the count of dropped lines is said."""
MAX_LINE = 4000
"""Characters of one line shown (the log keeps it whole)."""
_CHUNK = 1 << 20
_SENTINEL = SENTINEL.encode()
_VALID = "want all, none or rank numbers such as 0 or 0,2"


@dataclass(frozen=True, slots=True)
class OutputSelection:
    """Which ranks' output is shown: ``ranks=None`` is every rank, ``()`` none."""

    ranks: tuple[int, ...] | None
    """The ranks in the order given, without repeats (``None``: all)."""

    def resolve(self, world_size: int) -> list[int]:
        """The ranks of a run of ``world_size`` ranks; a one-line error for a rank the run does not have."""
        if self.ranks is None:
            return list(range(world_size))
        missing = [r for r in self.ranks if r >= world_size]
        if missing and world_size > 0:
            raise JupyterDistError(f"--output {self}: the run has ranks 0..{world_size - 1}, not "
                                   f"{', '.join(map(str, missing))}")  # fmt: skip
        return list(self.ranks)

    def __str__(self) -> str:
        if self.ranks is None:
            return "all"
        return ",".join(map(str, self.ranks)) or "none"


def parse_output(value: str | Iterable[int] | OutputSelection | None) -> OutputSelection:
    """``"0"``, ``"0,2"``, ``"all"``, ``"none"`` (or a list of ranks) as an :class:`OutputSelection`.

    Anything else is a one-line :class:`~jupyter_dist.errors.JupyterDistError` that lists what is valid.
    """
    if isinstance(value, OutputSelection):
        return value
    if value is None:
        return OutputSelection(())
    if isinstance(value, str):
        text = value.strip().strip("'\"").strip().lower()
        if text == "all":
            return OutputSelection(None)
        if text == "none":
            return OutputSelection(())
        words = [w.strip() for w in text.split(",")]
        if not text or not all(w.isdigit() and w.isascii() for w in words):
            raise JupyterDistError(f"--output {value!r}: {_VALID}")
        ranks = [int(w) for w in words]
    else:
        try:
            ranks = list(value)
        except TypeError:
            raise JupyterDistError(f"output={value!r}: {_VALID}") from None
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            raise JupyterDistError(f"output={value!r}: {_VALID}")
    return OutputSelection(tuple(dict.fromkeys(ranks)))


# ------------------------------------------------------------------------------------------------------- sinks
class Sink(Protocol):
    """Where the followed lines go: ``write`` gets each batch (from the follower's thread), ``close`` the end."""

    def write(self, lines: list[str]) -> None: ...  # noqa: D102

    def close(self) -> None: ...  # noqa: D102


class StreamSink:
    """Lines to a text stream as they come (default: whatever ``sys.stdout`` is when they are written)."""

    def __init__(self, stream: Any = None) -> None:
        self._stream = stream

    def write(self, lines: list[str]) -> None:
        """Write and flush one batch."""
        stream = self._stream if self._stream is not None else sys.stdout
        stream.write("".join(line + "\n" for line in lines))
        stream.flush()

    def close(self) -> None:
        """Nothing to close (the stream is not ours)."""


class _Text:
    """Plain text as a display object (shown as preformatted text, kept in the saved notebook)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text}


class DisplaySink:
    """One display under the current cell, updated through its display id with the last ``keep`` lines.

    Made while the cell runs (the display is placed under it); updated from the follower's thread, also after the
    cell has finished: an update names the display, not the cell that runs now, so it cannot land in another cell.
    ``who`` says whose output it is (``"rank 0"``), in the text shown before the first line and when none came.
    """

    def __init__(self, who: str, *, keep: int = 1000, display: Callable[..., Any] | None = None) -> None:
        if display is None:
            from IPython.display import display
        self.who = who
        self.lines: deque[str] = deque(maxlen=keep)
        self.total = 0
        self._lock = threading.Lock()
        self.handle = display(_Text(f"({who} has printed nothing yet)"), display_id=True)

    def text(self) -> str:
        """What the display shows now."""
        hidden = self.total - len(self.lines)
        head = [f"... {hidden:,} earlier lines are not shown here (the logs keep every line)"] if hidden else []
        return "\n".join([*head, *self.lines])

    def write(self, lines: list[str]) -> None:
        """Add one batch and update the display."""
        with self._lock:
            self.lines.extend(lines)
            self.total += len(lines)
            self.handle.update(_Text(self.text()))

    def close(self) -> None:
        """Say so when nothing was printed at all."""
        with self._lock:
            if self.total == 0:
                self.handle.update(_Text(f"({self.who} printed nothing)"))


def _ranks_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def default_sink(ranks: list[int]) -> Sink:
    """A :class:`DisplaySink` under the running cell in an IPython kernel, else a :class:`StreamSink` on stdout."""
    try:
        from IPython import get_ipython
    except ImportError:
        return StreamSink()
    shell = get_ipython()  # type: ignore[no-untyped-call]
    if shell is not None and getattr(shell, "kernel", None) is not None:
        return DisplaySink(_ranks_words(ranks))
    return StreamSink()


# ---------------------------------------------------------------------------------------------------- follower
class _Followed:
    """One rank's log file: how far it was read, the unfinished last line, dropped lines not said yet."""

    def __init__(self, rank: int, path: Path) -> None:
        self.rank = rank
        self.path = path
        self.pos = 0
        self.partial = b""
        self.unsaid = 0
        self.unsaid_since = 0.0


class RankOutput:
    """Follows ranks' log files and writes their new lines, prefixed and rate-limited, to a sink.

    Parameters
    ----------
    logs_dir
        The run's ``logs/`` folder (``rank-<k>.log`` in it).
    ranks
        The ranks to follow, in the order their lines are taken each round.
    sink
        Where the lines go (:class:`StreamSink`, :class:`DisplaySink`, or anything with ``write(lines)``/``close()``).
    done
        Whether the run has ended (every rank's output is then complete): the follower reads to the end once more,
        says what it dropped, closes the sink and stops.
    rate, burst
        At most ``rate`` lines per second of all the ranks together, after a first ``burst``.
    interval
        Seconds between reads of the files.
    clock
        Monotonic seconds (tests pass a fake one).
    """

    def __init__(self, logs_dir: str | Path, ranks: Iterable[int], *, sink: Sink, done: Callable[[], bool],
                 rate: float = DEFAULT_RATE, burst: int = DEFAULT_BURST, interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not rate > 0 or burst < 1 or not interval > 0:
            raise ValueError(f"rate (>0), burst (>=1) and interval (>0) must be positive: {rate}, {burst}, {interval}")
        self.logs_dir = Path(logs_dir)
        self.files = [_Followed(r, self.logs_dir / f"rank-{r}.log") for r in dict.fromkeys(ranks)]
        self.sink = sink
        self.rate = float(rate)
        self.burst = int(burst)
        self.interval = interval
        self.clock = clock
        self._done = done
        self._tokens = float(burst)
        self._refilled: float | None = None
        self.shown: dict[int, int] = {f.rank: 0 for f in self.files}
        """Lines shown per rank."""
        self.dropped: dict[int, int] = {f.rank: 0 for f in self.files}
        """Lines not shown per rank (over the rate), each said in a note."""
        self.finished = threading.Event()
        """Set once the run ended and its last lines were written (or the follower was stopped)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ranks(self) -> list[int]:
        """The followed ranks."""
        return [f.rank for f in self.files]

    # ---- one round ------------------------------------------------------------------------------------------
    def poll(self, *, final: bool = False) -> list[str]:
        """Read what the ranks wrote since the last round and write what is shown to the sink; returns it.

        ``final``: the run has ended; unfinished last lines are taken as lines and every dropped count is said.
        """
        now = self.clock()
        if self._refilled is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now
        out: list[str] = []
        for f in self.files:
            self._read(f, out, now, final=final)
            if f.unsaid and (final or now - f.unsaid_since >= NOTE_EVERY_S):
                out.append(self._note(f))
        if out:
            self.sink.write(out)
        return out

    def _read(self, f: _Followed, out: list[str], now: float, *, final: bool) -> None:
        try:
            with open(f.path, "rb") as fh:
                size = fh.seek(0, 2)
                if size < f.pos:  # rewritten from its start (a log stream replayed on reattach)
                    f.pos, f.partial = 0, b""
                fh.seek(f.pos)
                while True:
                    data = fh.read(_CHUNK)
                    if not data:
                        break
                    f.pos += len(data)
                    data = f.partial + data
                    cut = data.rfind(b"\n") + 1
                    f.partial = data[cut:]
                    self._take(f, data[:cut], out, now)
                    if len(f.partial) > _CHUNK:  # a megabyte without a newline (progress bars): take it as a line
                        self._take(f, f.partial + b"\n", out, now)
                        f.partial = b""
        except FileNotFoundError:  # the rank has not started yet
            return
        except OSError as exc:
            logging.getLogger(__name__).warning("cannot read %s: %s", f.path, exc)
            return
        if final and f.partial:
            self._take(f, f.partial + b"\n", out, now)
            f.partial = b""

    def _take(self, f: _Followed, data: bytes, out: list[str], now: float) -> None:
        """Complete lines (``data`` ends with a newline): show while the bucket has tokens, count the rest."""
        if not data:
            return
        lines = data.split(b"\n")[:-1]
        for i, raw in enumerate(lines):
            if self._tokens < 1.0:  # over the rate: count the rest without decoding it
                rest = lines[i:]
                n = len(rest) if _SENTINEL not in data else sum(1 for ln in rest if _SENTINEL not in ln)
                self._drop(f, n, now)
                return
            if _SENTINEL in raw:  # a telemetry record, not output
                continue
            if f.unsaid:
                out.append(self._note(f))
            text = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if "\r" in text:  # a progress bar redrawn in place: what the terminal would show last
                text = text.rsplit("\r", 1)[-1]
            if len(text) > MAX_LINE:
                text = text[:MAX_LINE] + f" ... ({len(text) - MAX_LINE:,} more characters in the log)"
            out.append(f"[rank{f.rank}] {text}")
            self._tokens -= 1.0
            self.shown[f.rank] += 1

    def _drop(self, f: _Followed, n: int, now: float) -> None:
        if n <= 0:
            return
        if not f.unsaid:
            f.unsaid_since = now
        f.unsaid += n
        self.dropped[f.rank] += n

    def _note(self, f: _Followed) -> str:
        n, f.unsaid = f.unsaid, 0
        return (f"[rank{f.rank}] ... {n:,} lines dropped (over {self.rate:g} lines/s); every line is in "
                f"{f.path}")  # fmt: skip

    # ---- the thread -----------------------------------------------------------------------------------------
    def start(self) -> RankOutput:
        """Follow on a daemon thread until the run ends (then read once more, close the sink and stop)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jupyter-dist-output", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        log = logging.getLogger(__name__)
        try:
            while not self._stop.is_set():
                done = self._done()  # asked before reading: a run that has ended has written all it will
                try:
                    self.poll(final=done)
                except BrokenPipeError:  # `jupyter-dist launch ... | head`: the reader left
                    break
                except Exception:  # the sink is broken (the files are read safely): stop showing, never the run
                    log.exception("jupyter_dist: showing the ranks' output failed; the logs keep every line")
                    break
                if done:
                    break
                self._stop.wait(self.interval)
            try:
                self.sink.close()
            except Exception:
                log.exception("jupyter_dist: closing the ranks' output failed")
        finally:
            self.finished.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the last lines were written (the run ended); whether they were within ``timeout`` s."""
        return self.finished.wait(timeout)

    def stop(self) -> None:
        """Stop following (what was shown stays)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.finished.set()
