"""The one launcher interface every back-end implements, and the back-end registry (:data:`BACKEND_SPECS`).

A launcher is pure until it starts (ipyparallel's ``BaseLauncher`` split): ``args()`` (the commands it would run),
``env()`` (the environment it adds) and ``task()`` (what it submits: the sbatch script, the SkyPilot task dict) can be
shown by ``--dry-run`` and tested without side effects. ``start()``, ``stop()``, ``poll()`` and ``wait()`` act.
``to_dict()`` goes into ``run.json`` under ``"launcher"`` and :func:`launcher_from_dict` rebuilds the launcher from it,
so a run can be reattached after a kernel restart (``%dist_attach``).

The local launcher (:class:`~.local.LocalLauncher`) watches its own child processes. Remote launchers
(:class:`RemoteLauncher`: SLURM, SkyPilot) track a job id, and their output arrives as a log stream that
:meth:`RemoteLauncher.follow` hands, line by line, to a :class:`~.stream.LogRouter`.

The registry says everything the package needs of a back-end (a :class:`BackendSpec`: its launcher class, its
label, whether it is a cluster, the hooks that start and reattach its runs), so no caller compares a back-end's name:
they read a property of its spec (``tests/test_names.py`` fails on a name spelled elsewhere). Launchers sit below
the ``Run``; the code that starts a run (``start_run``, ``start_cluster_run`` and the back-ends' start hooks) above it.
"""

from __future__ import annotations

import importlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import JupyterDistError

__all__ = [
    "BACKENDS",
    "BACKEND_SPECS",
    "CLUSTER_BACKENDS",
    "DEFAULT_BACKEND",
    "BackendSpec",
    "JobState",
    "Launcher",
    "RemoteLauncher",
    "Follower",
    "attach_ref",
    "backend_spec",
    "launcher_from_dict",
    "load_target",
    "runs_here",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendSpec:
    """One back-end as the rest of the package sees it: every property a caller reads instead of its name.

    The targets are ``module:attribute`` strings, imported on first use (:func:`load_target`): this module imports
    nothing heavy, and a reattached run imports only its own back-end (SkyPilot is an optional extra).
    """

    name: str
    """What ``--backend`` takes and ``run.json`` saves (the launcher's ``kind``)."""
    launcher: str
    """``module:class`` of its :class:`Launcher`, rebuilt from ``run.json`` by :func:`launcher_from_dict`."""
    label: str
    """The wizard's "Run on" choice."""
    where: str
    """Where a started run is, in the wizard's line ("on SLURM")."""
    cluster: bool = False
    """A cluster job: ``ClusterOptions`` apply, ``start_cluster_run`` starts it through :attr:`start`, the Run
    follows it by job id. ``False``: processes on this machine that the kernel starts and watches."""
    start: str | None = None
    """``module:class`` of the hooks ``start_cluster_run`` calls (``ClusterHooks`` in
    :mod:`.backends.cluster`: the options it accepts, what it adds to the job's environment, how it submits)."""
    attach: str | None = None
    """``module:function`` that reopens a job from a reference of its own (``CLUSTER/JOB``) for ``%dist_attach``:
    ``function(ref, runs_dir=...)`` returns the Run, or ``None`` when the reference is not of its form."""
    priced: bool = False
    """Its dry run and the wizard's Launch tab price the nodes from SkyPilot's catalog (:mod:`.cost`)."""


BACKEND_SPECS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(name="local", launcher="jupyter_dist.launch.backends.local:LocalLauncher",
                    label="this machine (torchrun)", where="on this machine"),
        BackendSpec(name="slurm", launcher="jupyter_dist.launch.backends.slurm:SlurmLauncher", label="SLURM",
                    where="on SLURM", cluster=True, start="jupyter_dist.launch.backends.slurm:SlurmStart"),
        BackendSpec(name="skypilot", launcher="jupyter_dist.launch.backends.skypilot:SkyPilotLauncher",
                    label="SkyPilot", where="on SkyPilot", cluster=True,
                    start="jupyter_dist.launch.backends.skypilot:SkyPilotStart",
                    attach="jupyter_dist.launch.backends.skypilot:attach_ref", priced=True),
    )
}  # fmt: skip
"""The back-end registry: name -> :class:`BackendSpec`. The one place a back-end's name is spelled."""

DEFAULT_BACKEND = "local"
"""Where a run goes when no ``--backend`` is given (and what a ``run.json`` that names none ran on)."""

BACKENDS: dict[str, str] = {name: spec.launcher for name, spec in BACKEND_SPECS.items()}
"""Back-end name -> ``module:class`` of its launcher (imported lazily: SkyPilot is an optional extra)."""

CLUSTER_BACKENDS: tuple[str, ...] = tuple(name for name, spec in BACKEND_SPECS.items() if spec.cluster)
"""The back-ends that take ``ClusterOptions`` and start through ``start_cluster_run``."""


def backend_spec(name: str) -> BackendSpec:
    """The registry's entry for ``name``; a one-line error naming the valid ones otherwise."""
    spec = BACKEND_SPECS.get(name)
    if spec is None:
        raise JupyterDistError(f"unknown backend {name!r}; valid: {', '.join(BACKEND_SPECS)}")
    return spec


def runs_here(name: str | None) -> bool:
    """Whether ``name`` is a registered back-end whose processes run on this machine (not a cluster job)."""
    spec = BACKEND_SPECS.get(name or "")
    return spec is not None and not spec.cluster


def load_target(target: str) -> Any:
    """Import ``module:attribute`` (a registry target) and return the attribute."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def attach_ref(ref: str, *, runs_dir: Any = "runs") -> Any:
    """The Run a back-end's own job reference (SkyPilot's ``CLUSTER/JOB``) names, else ``None``."""
    for spec in BACKEND_SPECS.values():
        if spec.attach is not None:
            run = load_target(spec.attach)(ref, runs_dir=runs_dir)
            if run is not None:
                return run
    return None


JobState = str
"""A remote job's state as the Run reports it: pending, running, succeeded, failed, stopped, timed out, unknown."""


class Launcher(ABC):
    """Pure ``args()/env()/task()``, side-effecting ``start/stop/poll/wait``, ``to_dict/from_dict``."""

    kind: str = ""
    """Back-end name (a key of :data:`BACKEND_SPECS`), saved in ``run.json``."""
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
        self.ended = threading.Event()
        """Set when ``target`` returned (a stream that ends with its job: a sign to poll the job's state now)."""
        self.error: BaseException | None = None

        def run() -> None:
            try:
                target(self.stop_event)
            except BaseException as exc:  # noqa: BLE001 - reported through .error, never kills the kernel
                self.error = exc
            finally:
                self.ended.set()

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

    def next_poll_in(self, unchanged: int) -> float:
        """Seconds the Run's watcher waits before the next :meth:`poll` (default: :attr:`poll_interval`).

        ``unchanged``: how many polls in a row answered the state before them (about a submitted job). The watcher
        polls at once when the output stream ends or the run is asked to stop.
        """
        return self.poll_interval

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
    kind = str(data.get("kind", DEFAULT_BACKEND))
    spec = BACKEND_SPECS.get(kind)
    if spec is None:
        raise JupyterDistError(f"run.json names an unknown launcher kind {kind!r}; known: {', '.join(BACKENDS)}")
    launcher: Launcher = load_target(spec.launcher).from_dict(data)
    return launcher
