"""A ``torch.profiler`` trace of a window of steps, per rank (``%%dist_train --profile 5:8``, ``jd.profile``).

The window is ``START:STOP`` (steps START .. STOP-1, like ``range``) or ``N`` (step N alone). Steps are counted by
``jd.log(step, ...)``, called at the end of each step: the profiler starts when ``jd.log`` reports step START-1
(for START = 0: when ``jd.wrap`` returns, or at once when ``jd.profile`` arms it after that), marks each step as a
``ProfilerStep#<n>`` span (how TensorBoard's profiler splits steps), and stops at ``jd.log(STOP-1)``, writing
``<run dir>/profile/rank-<k>.pt.trace.json`` (Chrome trace-event JSON: Perfetto and TensorBoard's profiler open
it). Outside the window nothing is started: without ``--profile`` the runtime holds no profiler at all.

Stdlib at module level; torch is imported when a window starts.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from ._env import WorkerError

__all__ = ["parse_window", "StepProfiler", "trace_path"]

_log = logging.getLogger("jupyter_dist.worker")
_WINDOW = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
MAX_WINDOW = 1000
"""Most steps one window may hold (a trace grows with every operator of every step)."""


def parse_window(text: str | int | tuple[int, int] | range) -> tuple[int, int]:
    """``"5:8"`` -> ``(5, 8)`` (steps 5, 6, 7); ``"3"`` or ``3`` -> ``(3, 4)``; a ``range(5, 8)`` or ``(5, 8)``.

    Raises
    ------
    WorkerError
        For anything else, saying what is valid.
    """
    if isinstance(text, range):
        if text.step != 1:
            raise WorkerError(f"profile window {text!r} must have step 1")
        start, stop = text.start, text.stop
    elif isinstance(text, tuple) and len(text) == 2 and all(isinstance(v, int) for v in text):
        start, stop = text
    elif isinstance(text, int) and not isinstance(text, bool):
        start, stop = text, text + 1
    elif isinstance(text, str) and (m := _WINDOW.match(text)):
        start = int(m.group(1))
        stop = int(m.group(2)) if m.group(2) is not None else start + 1
    else:
        raise WorkerError(f"profile window {text!r} is not valid: give STEP (e.g. 3) or START:STOP (e.g. 5:8, steps "
                          "5 to 7)")  # fmt: skip
    if start < 0 or stop <= start:
        raise WorkerError(f"profile window {start}:{stop} is empty or negative: STOP must be > START >= 0")
    if stop - start > MAX_WINDOW:
        raise WorkerError(f"profile window {start}:{stop} holds {stop - start} steps; at most {MAX_WINDOW}")
    return start, stop


def trace_path(run_dir: str, rank: int) -> str:
    """``<run dir>/profile/rank-<k>.pt.trace.json``."""
    return os.path.join(run_dir, "profile", f"rank-{rank}.pt.trace.json")


class StepProfiler:
    """One rank's profiling window: started and stopped by :meth:`on_log`, or used as a context manager.

    Parameters
    ----------
    window
        ``(start, stop)`` steps, as :func:`parse_window` returns.
    path
        Where the trace goes (``None``: no file, e.g. outside a launched run).
    cuda
        Also record CUDA kernels (default: when this process has initialised CUDA).
    """

    def __init__(self, window: tuple[int, int], path: str | None, *, cuda: bool | None = None) -> None:
        self.start, self.stop = window
        self.path = path
        self.cuda = cuda
        self.prof: Any = None
        self._marker: Any = None
        self.step: int | None = None
        """The step being recorded now (``None`` outside the window)."""
        self.done = False
        """The window was recorded (or given up)."""
        self.written: str | None = None
        """The trace file, once written."""

    @property
    def active(self) -> bool:
        """Whether the profiler is recording."""
        return self.prof is not None

    # ---- window ---------------------------------------------------------------------------------------------
    def begin(self, step: int | None = None) -> None:
        """Start recording now, the next step being ``step`` (default: the window's start)."""
        if self.active or self.done:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        cuda = self.cuda if self.cuda is not None else torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False)
        self.prof.start()
        self._open(self.start if step is None else step)

    def _open(self, step: int) -> None:
        from torch.autograd.profiler import record_function

        self.step = step
        self._marker = record_function(f"ProfilerStep#{step}")
        self._marker.__enter__()

    def _close(self) -> None:
        if self._marker is not None:
            marker, self._marker = self._marker, None
            marker.__exit__(None, None, None)

    def on_log(self, step: int) -> None:
        """``jd.log(step)`` was called: step ``step`` ended."""
        if self.done:
            return
        if not self.active:
            if step == self.start - 1:
                self.begin(self.start)
            elif self.start <= step < self.stop - 1:  # armed late (jd.profile inside the window): start now
                self.begin(step + 1)
            return
        self._close()
        if step >= self.stop - 1:
            self.end()
        else:
            self._open(step + 1)

    def end(self) -> str | None:
        """Stop recording and write the trace; returns its path (``None`` when nothing was recorded)."""
        if not self.active:
            self.done = True
            return None
        self._close()
        prof, self.prof = self.prof, None
        self.done = True
        self.step = None
        try:
            prof.stop()
            if self.path is not None:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                tmp = self.path + ".tmp"
                prof.export_chrome_trace(tmp)
                os.replace(tmp, self.path)
                self.written = self.path
        except Exception as exc:  # a profiling problem must never end the training
            _log.warning("jupyter_dist.worker: the profiler trace was not written: %s", exc)
            return None
        return self.written

    # ---- context manager ------------------------------------------------------------------------------------
    def __enter__(self) -> StepProfiler:
        self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
