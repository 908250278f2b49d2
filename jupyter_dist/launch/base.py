"""The one launcher interface every back-end implements, and the registry that rebuilds a launcher from ``run.json``.

A launcher is pure until it starts (ipyparallel's ``BaseLauncher`` split): ``args()`` (the commands it would run),
``env()`` (the environment it adds) and ``task()`` (what it submits: the sbatch script, the SkyPilot task dict) can be
shown by ``--dry-run`` and tested without side effects. ``start()``, ``stop()``, ``poll()`` and ``wait()`` act.
``to_dict()`` goes into ``run.json`` under ``"launcher"`` and :func:`launcher_from_dict` rebuilds the launcher from it,
so a run can be reattached after a kernel restart (``%dist_attach``).

The local launcher (:class:`~.local.LocalLauncher`) watches its own child processes. Remote launchers
(:class:`RemoteLauncher`: SLURM, SkyPilot) track a job id, and their output arrives as a log stream that
:meth:`RemoteLauncher.follow` hands, line by line, to a :class:`~.stream.LogRouter`.
"""

from __future__ import annotations

import importlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from ..errors import JupyterDistError

__all__ = [
    "BACKENDS",
    "JobState",
    "Launcher",
    "RemoteLauncher",
    "Follower",
    "launcher_from_dict",
]

BACKENDS: dict[str, str] = {
    "local": "jupyter_dist.launch.backends.local:LocalLauncher",
    "slurm": "jupyter_dist.launch.backends.slurm:SlurmLauncher",
    "skypilot": "jupyter_dist.launch.backends.skypilot:SkyPilotLauncher",
}
"""Back-end name -> ``module:class`` (imported lazily: SkyPilot is an optional extra)."""

JobState = str
"""A remote job's state as the Run reports it: pending, running, succeeded, failed, stopped, timed out, unknown."""


class Launcher(ABC):
    """Pure ``args()/env()/task()``, side-effecting ``start/stop/poll/wait``, ``to_dict/from_dict``."""

    kind: str = ""
    """Back-end name (a key of :data:`BACKENDS`), saved in ``run.json``."""
    remote: bool = False
    """Whether the job runs outside this kernel's process tree (tracked by job id, output from a log stream)."""
    state: str
    """``before`` -> ``running`` -> ``after``."""

    @abstractmethod
    def args(self) -> list[list[str]]:
        """The commands this launcher runs (argv lists; nothing started)."""

    @abstractmethod
    def env(self) -> dict[str, str]:
        """Environment added to the job's processes (never a secret's value)."""

    def task(self) -> Any:
        """What the launcher submits (an sbatch script, a SkyPilot task dict); ``None`` for a local run."""
        return None

    @abstractmethod
    def start(self) -> Any:
        """Start or submit the job."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """Enough to rebuild the launcher after a kernel restart (with ``"kind"``)."""


class Follower:
    """A daemon thread that runs ``target(stop_event)`` and can be asked to finish (it may read a last time)."""

    def __init__(self, target: Callable[[threading.Event], None], name: str) -> None:
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                target(self.stop_event)
            except BaseException as exc:  # noqa: BLE001 - reported through .error, never kills the kernel
                self.error = exc

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def finish(self, timeout: float = 10.0) -> None:
        """Ask the thread to stop after reading what is left; wait up to ``timeout`` s."""
        self.stop_event.set()
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self.thread.is_alive()


class RemoteLauncher(Launcher):
    """A job outside this machine's process tree: submitted, polled by id, cancelled, its output streamed."""

    remote = True
    poll_interval: float = 1.0
    """Seconds between state polls of the Run's watcher."""
    unknown_grace: float = 30.0
    """Seconds the scheduler may answer ``unknown`` before the Run judges the job from the ranks' exit files."""

    job_id: str | None
    """The scheduler's id once submitted (SLURM job id, SkyPilot ``cluster/job``)."""

    @abstractmethod
    def poll(self) -> JobState:
        """The job's state now (one cheap query; ``unknown`` when the scheduler cannot tell)."""

    @abstractmethod
    def cancel(self) -> None:
        """Cancel the job (``scancel``, ``sky.cancel``); returns at once, the state follows through :meth:`poll`."""

    @abstractmethod
    def follow(self, on_lines: Callable[[list[str]], None]) -> Follower:
        """Start following the job's output; ``on_lines`` gets every new line (without newline), in order."""

    def stop(self, timeout: float = 60.0) -> JobState:
        """Cancel and wait until the scheduler reports a final state (or ``timeout`` s)."""
        self.cancel()
        return self.wait(timeout)

    def wait(self, timeout: float | None = None) -> JobState:
        """Poll until the job is final (or ``timeout`` s); returns the last state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.poll()
            if state in FINAL_STATES or (deadline is not None and time.monotonic() >= deadline):
                return state
            time.sleep(self.poll_interval)

    def describe(self) -> str:
        """One line for status cards: where the job runs."""
        return f"{self.kind} job {self.job_id}"


FINAL_STATES = ("succeeded", "failed", "stopped", "timed out")


def launcher_from_dict(data: dict[str, Any]) -> Launcher:
    """Rebuild a launcher from ``run.json``'s ``"launcher"`` entry (``kind`` picks the back-end)."""
    kind = str(data.get("kind", "local"))
    target = BACKENDS.get(kind)
    if target is None:
        raise JupyterDistError(f"run.json names an unknown launcher kind {kind!r}; known: {', '.join(BACKENDS)}")
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    launcher: Launcher = cls.from_dict(data)
    return launcher
