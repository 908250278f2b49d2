"""Metric sinks: forward a run's ``step`` records to TensorBoard, Weights & Biases, MLflow or Trackio.

``%%dist_train --log-to tensorboard,wandb`` (``start_run(log_to=...)``) starts a :class:`SinkForwarder` in the
notebook's kernel: a thread that follows the run's ``telemetry/`` folder (a :class:`~.reader.TelemetryReader`, the
same files the panels read, written locally or routed from a cluster job's log stream) and hands each ``step`` record
of rank 0 to every sink. The ranks never talk to a tracking service, so training never waits on one; a sink that
fails is switched off with its error kept in :attr:`SinkForwarder.errors`, and the others go on.

Every sink implements the two-method protocol ``log(metrics, step)`` / ``close()`` (:class:`MetricSink`); one that
batches also has ``flush()``, called after each poll's records. The run's hyperparameters (its record's ``hparams``:
shipped scalars, ``jd.config``, a Trainer's arguments, Lightning's ``hparams``) reach every sink through
``log_hparams(params)``, called with all of them whenever they change (at the first poll, then when rank 0 records
more): MLflow params, the W&B run's config, a TensorBoard HParams session (the ``hparams`` plugin's
``session_start_info``), the Trackio run's config.

``tensorboard``
    event files in ``<run dir>/tensorboard/`` (``JD_TENSORBOARD_DIR`` overrides), written with TensorBoard's own
    ``EventFileWriter`` (no torch needed); ``tensorboard --logdir runs/`` shows every run;
``wandb``
    ``wandb.init(project=$WANDB_PROJECT or "jupyter-dist", name=<run name>, dir=<run dir>/sinks)``;
    ``WANDB_MODE=offline`` keeps it local (``wandb sync`` uploads later);
``mlflow``
    a run in the experiment ``$MLFLOW_EXPERIMENT_NAME`` (default ``jupyter-dist``) of the tracking server
    ``$MLFLOW_TRACKING_URI`` (MLflow's default otherwise), metrics through ``MlflowClient.log_batch``;
``trackio``
    ``trackio.init(project=..., name=<run name>)`` into its local database (``$TRACKIO_DIR``), or the Space the
    ``TRACKIO_*`` variables name.

Credentials are passed by name: ``--secret WANDB_API_KEY`` says the sink needs that variable of the kernel's
environment. :func:`check_sinks` checks it is set before anything is launched; the libraries read the value from the
kernel's environment, and jupyter-dist writes it nowhere (``run.json`` keeps the names only; a local run's ranks
inherit the kernel's environment as they always do, a cluster job gets it only through ``--secret``).
Each sink's library is an optional extra: a missing one fails at once with its install hint.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import JupyterDistError, MissingDependencyError
from .reader import TelemetryReader

__all__ = [
    "SINKS",
    "SinkError",
    "MetricSink",
    "SinkContext",
    "TensorBoardSink",
    "WandbSink",
    "MlflowSink",
    "TrackioSink",
    "SinkForwarder",
    "parse_log_to",
    "check_sinks",
    "open_sink",
    "step_metrics",
]

_log = logging.getLogger(__name__)

SINKS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}
"""Sink name -> (the module it imports, the jupyter-dist extra that installs it)."""

_NOT_METRICS = frozenset({"v", "kind", "rank", "seq", "t", "step", "n"})
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SinkError(JupyterDistError, ValueError):
    """A ``--log-to`` sink name or a ``--secret`` name that cannot be used."""


class MetricSink(Protocol):
    """What every sink implements (torchtitan's ``BaseLogger`` shape)."""

    name: str

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at ``step``."""

    def close(self) -> None:
        """Flush and end the sink's run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SinkContext:
    """What a sink knows about the run it records."""

    run_name: str
    """The run directory's name: the sink's run name."""
    run_dir: Path
    """The run directory (TensorBoard and W&B files go under it)."""
    project: str = "jupyter-dist"
    """Project / experiment name when the library's own variable (``WANDB_PROJECT``, ...) is not set."""
    config: dict[str, Any] = field(default_factory=dict)
    """Run parameters recorded with the run (strategy, world size, candidate)."""
    secrets: tuple[str, ...] = ()
    """Names of the kernel's environment variables the sinks need (values are never stored here)."""
    hparams: dict[str, Any] = field(default_factory=dict)
    """The run's hyperparameters known when the sinks open (more arrive through ``log_hparams``)."""


def parse_log_to(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` (or a list of names) -> the sink names, in order, without repeats.

    Raises
    ------
    SinkError
        For an unknown or empty name, listing the valid ones.
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names: list[str] = []
    for item in items:
        name = str(item).strip().lower()
        if name not in SINKS:
            shown = repr(str(item).strip()) if str(item).strip() else "an empty name"
            raise SinkError(f"--log-to: unknown sink {shown}; valid: {', '.join(SINKS)} (comma-separated)")
        if name not in names:
            names.append(name)
    return tuple(names)


def check_sinks(names: Iterable[str], secrets: Iterable[str] = ()) -> None:
    """Before a launch: every sink's library is importable and every ``--secret`` name is set in this environment.

    Raises
    ------
    MissingDependencyError
        With the install hint of the first sink whose library is missing.
    SinkError
        For a secret name that is not a variable name or is not set (the value is never shown).
    """
    for name in names:
        module, extra = SINKS[name]
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(f'--log-to {name} needs {module}: pip install "jupyter-dist[{extra}]"')
    for secret in secrets:
        if not _ENV_NAME.match(secret):
            raise SinkError(f"--secret {secret!r} is not an environment variable name (letters, digits, _)")
        if not os.environ.get(secret):
            raise SinkError(f"--secret {secret}: not set in the kernel's environment; set it there (e.g. "
                            f"os.environ[{secret!r}] = ...) -- its value is passed by name, never written")  # fmt: skip


def step_metrics(record: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """A ``step`` record -> (step, its numeric metrics); ``None`` for other records or one without a step."""
    if record.get("kind") != "step" or not isinstance(record.get("step"), int):
        return None
    metrics = {k: float(v) for k, v in record.items()
               if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
    return int(record["step"]), metrics


# ---- the sinks ------------------------------------------------------------------------------------------------------
class TensorBoardSink:
    """Scalars into a TensorBoard event file with TensorBoard's own writer."""

    name = "tensorboard"

    def __init__(self, ctx: SinkContext) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        base = os.environ.get("JD_TENSORBOARD_DIR")
        self.logdir = Path(base) / ctx.run_name if base else ctx.run_dir / "tensorboard"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.logdir), flush_secs=5)
        self._started = time.time()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One event with a scalar per metric."""
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))

    def log_hparams(self, params: dict[str, Any]) -> None:
        """The HParams plugin's session start (every value, each time they change; the newest wins)."""
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb

        pb = hparams_pb(dict(params), trial_id=str(self.logdir.name), start_time_secs=int(self._started))
        self._writer.add_event(self._event(wall_time=time.time(), step=0, summary=pb))

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class WandbSink:
    """A Weights & Biases run (``WANDB_MODE=offline`` writes it under the run directory only)."""

    name = "wandb"

    def __init__(self, ctx: SinkContext) -> None:
        import wandb

        folder = ctx.run_dir / "sinks"
        folder.mkdir(parents=True, exist_ok=True)
        self.run: Any = wandb.init(project=os.environ.get("WANDB_PROJECT") or ctx.project, name=ctx.run_name,
                              dir=str(folder), config={**ctx.config, **ctx.hparams},
                              reinit="create_new")  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        """``run.log(metrics, step=step)``."""
        self.run.log(metrics, step=step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """``run.config.update(params)``."""
        self.run.config.update(dict(params), allow_val_change=True)

    def close(self) -> None:
        """``run.finish()``."""
        self.run.finish()


class MlflowSink:
    """An MLflow run, written with ``MlflowClient`` (a local file store, a database or a tracking server)."""

    name = "mlflow"

    def __init__(self, ctx: SinkContext) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = MlflowClient()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or ctx.project
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=ctx.run_name, tags={"jupyter_dist.run_dir": str(ctx.run_dir)})
        self.run_id: str = run.info.run_id
        self._pending: list[Any] = []
        self._params: dict[str, str] = {}
        self.skipped_params: dict[str, Any] = {}
        """Hyperparameters whose value changed after MLflow stored them (its params are write-once)."""
        for key, value in ctx.config.items():
            self.client.log_param(self.run_id, key, value)
            self._params[key] = str(value)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """New hyperparameters as MLflow params (``log_batch``); one already stored with another value is skipped."""
        from mlflow.entities import Param

        new = []
        for key, value in params.items():
            name, text = _mlflow_key(key), str(value)
            if name not in self._params:
                new.append(Param(name, text))
                self._params[name] = text
            elif self._params[name] != text:
                self.skipped_params[name] = value
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per call
            self.client.log_batch(self.run_id, params=new[i : i + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue every metric at ``step``; :meth:`flush` sends them."""
        now = int(time.time() * 1000)
        metric = self._metric
        self._pending += [metric(key=_mlflow_key(k), value=v, timestamp=now, step=step) for k, v in metrics.items()]

    def flush(self) -> None:
        """Send what is queued in ``log_batch`` calls of up to 1000 metrics (MLflow's limit per call)."""
        while self._pending:
            batch, self._pending = self._pending[:1000], self._pending[1000:]
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        """Send what is queued and mark the run finished."""
        self.flush()
        self.client.set_terminated(self.run_id)


def _mlflow_key(name: str) -> str:
    """MLflow takes letters, digits, ``_ - . space : /`` in metric names: anything else becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", name)


class TrackioSink:
    """A Trackio run (local database under ``$TRACKIO_DIR``, or a Space)."""

    name = "trackio"

    def __init__(self, ctx: SinkContext) -> None:
        import trackio

        self.run: Any = trackio.init(project=os.environ.get("TRACKIO_PROJECT") or ctx.project, name=ctx.run_name,
                                config={**ctx.config, **ctx.hparams}, embed=False, auto_log_gpu=False,
                                auto_log_cpu=False)  # fmt: skip

    def log_hparams(self, params: dict[str, Any]) -> None:
        """Merged into the run's config (sent with its next records)."""
        if isinstance(getattr(self.run, "config", None), dict):
            self.run.config.update(params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """``run.log(metrics, step=step)``."""
        self.run.log(metrics, step=step)

    def close(self) -> None:
        """``run.finish()`` (flushes what is queued)."""
        self.run.finish()


_CLASSES: dict[str, Callable[[SinkContext], MetricSink]] = {
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
    "mlflow": MlflowSink,
    "trackio": TrackioSink,
}


def open_sink(name: str, ctx: SinkContext) -> MetricSink:
    """Build the sink ``name`` (its library is imported now)."""
    if name not in _CLASSES:
        raise SinkError(f"unknown sink {name!r}; valid: {', '.join(SINKS)}")
    return _CLASSES[name](ctx)


# ---- the forwarder --------------------------------------------------------------------------------------------------
class SinkForwarder:
    """Follows a run's telemetry on a kernel thread and forwards rank ``rank``'s ``step`` records to the sinks.

    Parameters
    ----------
    telemetry_dir
        The run's ``telemetry/`` folder.
    names
        Sink names (:func:`parse_log_to`); each is opened on the forwarder's thread, so a slow login never blocks.
    ctx
        What the sinks record about the run.
    done
        Called between polls; when it answers True the forwarder reads what is left, closes the sinks and ends.
    interval
        Seconds between polls.
    opener
        Builds a sink from its name (tests pass their own); default :func:`open_sink`.
    hparams
        Called at every poll: the run's hyperparameters now; when they changed, every sink with a ``log_hparams``
        method gets all of them.
    """

    def __init__(self, telemetry_dir: str | os.PathLike[str], names: Iterable[str], ctx: SinkContext, *,
                 done: Callable[[], bool], interval: float = 1.0, rank: int = 0,
                 opener: Callable[[str, SinkContext], MetricSink] = open_sink,
                 hparams: Callable[[], dict[str, Any]] | None = None) -> None:  # fmt: skip
        self.names = tuple(names)
        self._hparams = hparams
        self.hparams_sent: dict[str, Any] = {}
        """The hyperparameters last handed to the sinks."""
        self.ctx = ctx
        self.rank = rank
        self.interval = interval
        self.sinks: list[MetricSink] = []
        self.errors: dict[str, str] = {}
        """Sink name -> the one-line error that switched it off."""
        self.forwarded = 0
        """``step`` records handed to the sinks."""
        self.finished = threading.Event()
        """Set once every sink is closed."""
        self._done = done
        self._opener = opener
        self._reader = TelemetryReader(telemetry_dir, interval=interval, maxlen=16)
        self._reader.add_listener(self._on_records)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SinkForwarder:
        """Open the sinks and follow the run on a daemon thread (closed at interpreter exit at the latest)."""
        if self._thread is None:
            _LIVE.add(self)
            self._thread = threading.Thread(target=self._run, name="jupyter-dist-sinks", daemon=True)
            self._thread.start()
        return self

    def _fail(self, sink_name: str, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")
        self.errors[sink_name] = msg
        _log.warning("jupyter-dist: --log-to %s switched off: %s", sink_name, msg)

    def _run(self) -> None:
        for name in self.names:
            try:
                self.sinks.append(self._opener(name, self.ctx))
            except Exception as exc:  # a sink that cannot start: the others go on
                self._fail(name, exc)
        try:
            while not self._stop.is_set():
                finished = self._done()
                self._reader.poll()
                self._push_hparams()
                if finished:
                    break
                self._stop.wait(self.interval)
            self._reader.poll()
            self._push_hparams()
        except Exception as exc:  # pragma: no cover - a forwarder must never die silently
            self._fail("forwarder", exc)
        finally:
            for sink in self.sinks:
                try:
                    sink.close()
                except Exception as exc:
                    self._fail(sink.name, exc)
            self.finished.set()

    def _on_records(self, records: list[dict[str, Any]]) -> None:
        for rec in records:
            if rec.get("rank") != self.rank:
                continue
            got = step_metrics(rec)
            if got is None:
                continue
            step, metrics = got
            metrics = {k: v for k, v in metrics.items() if math.isfinite(v) or k == "loss"}
            self.forwarded += 1
            for sink in self._working():
                try:
                    sink.log(metrics, step)
                except Exception as exc:
                    self._fail(sink.name, exc)
        for sink in self._working():  # sinks that batch (MLflow) send once per poll
            flush = getattr(sink, "flush", None)
            if flush is not None:
                try:
                    flush()
                except Exception as exc:
                    self._fail(sink.name, exc)

    def _push_hparams(self) -> None:
        if self._hparams is None:
            return
        try:
            current = dict(self._hparams())
        except Exception as exc:  # a damaged record must not stop the metrics
            self._fail("hparams", exc)
            return
        if not current or current == self.hparams_sent:
            return
        self.hparams_sent = current
        for sink in self._working():
            push = getattr(sink, "log_hparams", None)
            if push is not None:
                try:
                    push(dict(current))
                except Exception as exc:
                    self._fail(sink.name, exc)

    def _working(self) -> list[MetricSink]:
        return [s for s in self.sinks if s.name not in self.errors]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the sinks are closed (after the run ended); returns whether they are."""
        return self.finished.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Forward what is written so far, close the sinks and end the thread (waits up to ``timeout`` s)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def describe(self) -> str:
        """One line: where the metrics go, and any sink that was switched off."""
        text = f"metrics -> {', '.join(self.names)} ({self.forwarded} step records)"
        if self.errors:
            text += "; off: " + "; ".join(f"{k} ({v})" for k, v in self.errors.items())
        return text


_LIVE: weakref.WeakSet[SinkForwarder] = weakref.WeakSet()


@atexit.register
def _close_live_forwarders() -> None:  # the kernel is going away: forward what was written, close the sinks' runs
    for forwarder in list(_LIVE):
        if not forwarder.finished.is_set():
            forwarder.stop(timeout=10.0)
