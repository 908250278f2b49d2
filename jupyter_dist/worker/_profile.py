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
from typing import Any

from ._env import MAX_WINDOW, parse_window

__all__ = ["parse_window", "StepProfiler", "trace_path", "MAX_WINDOW"]

_log = logging.getLogger("jupyter_dist.worker")


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

    def __init__(self, window: tuple[int, int], path: str | None, *, cuda: bool | None = None,
                 manual: bool = False) -> None:  # fmt: skip
        self.start, self.stop = window
        self.path = path
        self.cuda = cuda
        self.manual = manual
        """Started only by ``with`` (``jd.profile()`` without steps), never by :meth:`on_log`."""
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
        if torch.autograd._profiler_enabled():  # the script runs a profiler of its own: a second one would end it
            _log.warning("jupyter_dist.worker: a profiler is already running; no trace for steps %d:%d", self.start,
                         self.stop)  # fmt: skip
            self.done = True
            return
        prof = profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False)
        try:
            prof.start()
        except Exception as exc:  # never end the training for a trace
            _log.warning("jupyter_dist.worker: the profiler did not start (%s); no trace for steps %d:%d", exc,
                         self.start, self.stop)  # fmt: skip
            self.done = True
            return
        self.prof = prof
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
            if self.manual:
                return
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
