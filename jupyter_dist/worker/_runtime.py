"""The one per-process runtime behind ``jupyter_dist.worker``: process group, strategy, telemetry, hooks.

Nothing here imports torch at module level; the first call that needs it does.

The training verbs (``wrap``, ``train_step``, ``backward``, ``step``, the data-parallel and context-parallel
coordinates) are :class:`~._training.TrainingVerbs`, in their own module; this one keeps the identity, the life
cycle (process group, hooks, exit records, the defined teardown order) and telemetry, one piece around the one
per-process state they share.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._startup import import_torch_outside_the_collector
from ..telemetry.emitter import Emitter, Nvml, cuda_index
from ._env import WorkerEnv, WorkerError, started_by_torchrun
from ._training import TrainingVerbs

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Runtime", "fresh_runtime", "get_runtime", "on_import"]

_log = logging.getLogger("jupyter_dist.worker")


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() else None


def _pg_ready() -> bool:
    if "torch" not in sys.modules:  # nothing can have made a process group without torch
        return False
    dist = _dist()
    return bool(dist is not None and dist.is_initialized())


def _attempt_store(dist: Any) -> dict[str, Any]:
    """Under torchrun, the agent's store with a prefix per restart attempt (``init_process_group`` kwargs).

    torchrun's agent keeps one TCPStore across elastic restarts and the env:// rendezvous adds no per-attempt
    prefix, so a restarted rank can read the address its peer published in the previous attempt and fail with
    "Connection refused" (seen with gloo on torch 2.13, depending on which rank starts first). A prefix per
    ``TORCHELASTIC_RESTART_COUNT`` keeps attempts apart. Elsewhere: ``{}`` (the default env:// path).
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not env.get("MASTER_PORT"):
        return {}
    from datetime import timedelta

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timedelta(seconds=600))  # fmt: skip
    prefixed = dist.PrefixStore(f"/jupyter_dist/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return {"store": prefixed, "rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"])}


def _drain_gloo_groups(timeout: float = 5.0) -> None:
    """Finish every collective of this rank's gloo groups and let gloo's threads release them (see ``_teardown``)."""
    if not _pg_ready():
        return
    dist = _dist()
    barrier = getattr(dist.barrier, "__wrapped__", dist.barrier)  # not counted as the user's communication
    groups = list(dist.distributed_c10d._world.pg_map)  # creation order: the same on every rank
    drained = False
    for group in groups:
        if dist.get_backend(group) == "gloo":
            barrier(group=group)
            drained = True
    if drained and not _gloo_threads_idle(timeout):
        _log.warning(
            "jupyter_dist.worker: gloo's worker threads were still busy %.0f s after the last barrier", timeout
        )


def _gloo_threads_idle(timeout: float) -> bool:
    """Wait until every gloo worker thread (``pt_gloo_runloop``) of this process is asleep on 3 polls in a row.

    Sleeping between polls releases the GIL, so a thread that waits for it to free a finished work's tensors
    gets it and finishes; a thread with work left is running or runnable (``R``), one with none waits for the next
    work (``S``). Linux only (``/proc``); elsewhere answers True at once.
    """
    task = "/proc/self/task"
    if not os.path.isdir(task):
        return True
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        busy = False
        for tid in os.listdir(task):
            try:
                with open(f"{task}/{tid}/comm") as f:
                    if f.read().strip() != "pt_gloo_runloop":
                        continue
                with open(f"{task}/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # the thread ended
            busy = busy or state not in ("S", "D", "Z", "X")
        quiet = 0 if busy else quiet + 1
        if quiet >= 3:
            return True
        time.sleep(0.005)
    return False


class Runtime(TrainingVerbs):
    """State of one worker process. ``jupyter_dist.worker`` delegates to a single instance (:func:`get_runtime`).

    Tests may build their own from a :class:`WorkerEnv` to exercise one piece without touching the process.
    """

    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self.model: Any = None
        """The model returned by the last :meth:`wrap` (a DeepSpeed engine for ``zero*``)."""
        self.optimizer: Any = None
        """The optimizer returned by the last :meth:`wrap`."""
        self.mesh: Any = None
        """The :class:`~jupyter_dist.worker._parallel.Mesh` built by :meth:`wrap` under model parallelism, else None."""
        self.pipeline: Any = None
        """The :class:`~jupyter_dist.worker._pipeline.Pipeline` under pipeline parallelism, else None."""
        self._lock = threading.RLock()
        self._initialized = False
        self._owns_pg = False
        self._emitter: Emitter | None = None
        self._scaler: Any = None
        self._error: BaseException | None = None
        self._exit_written = False
        self._hooks_installed = False
        self._warned_no_run_dir = False
        self.comm_stats: Any = None
        """Collective timings (``comm`` records) of a launched, distributed worker."""
        self._stop_requested: float | None = None
        self.pending_save: Any = None
        """An async checkpoint still being written (committed at the next save, resume or clean exit)."""
        self.save_group: Any = None
        """The gloo group checkpoint saves agree on (created on the first save)."""
        self.profiler: Any = None
        """The :class:`~jupyter_dist.worker._profile.StepProfiler` of ``JD_PROFILE`` / :meth:`profile` (else None:
        no profiler exists outside a requested window)."""
        self._last_step: int | None = None
        if env.profile:
            self.profile(env.profile)

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        """Global rank; initialises the process group under torchrun."""
        if not self.env.distributed:
            return 0
        self.init()
        return int(_dist().get_rank())

    @property
    def world_size(self) -> int:
        """Number of ranks; initialises the process group under torchrun."""
        if not self.env.distributed:
            return 1
        self.init()
        return int(_dist().get_world_size())

    @property
    def local_rank(self) -> int:
        """Rank on this node."""
        if self.env.distributed:
            self.init()
        return self.env.local_rank

    @property
    def is_main(self) -> bool:
        """``rank == 0``."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """``cuda:<local rank>`` when CUDA is available, else ``cpu``."""
        import torch

        if self.env.distributed:
            self.init()
        if torch.cuda.is_available():
            return torch.device("cuda", self.env.local_rank % max(1, torch.cuda.device_count()))
        return torch.device("cpu")

    # ------------------------------------------------------------------ life cycle
    def init(self) -> None:
        """Initialise once: the process group under torchrun (nccl with CUDA, else gloo), then the ``start`` record.

        Idempotent; a process group created by someone else is used as it is.
        """
        with self._lock:
            if self._initialized:
                return
            self._initialized = True
            backend = None
            if self.env.distributed:
                import torch
                import torch.distributed as dist

                if not dist.is_initialized():
                    kwargs = _attempt_store(dist)
                    if torch.cuda.is_available():
                        torch.cuda.set_device(self.env.local_rank % torch.cuda.device_count())
                        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()),
                                                **kwargs)  # fmt: skip
                    else:
                        dist.init_process_group("gloo", **kwargs)
                    self._owns_pg = True
                backend = str(dist.get_backend())
                if self.env.run_dir is not None:
                    from ._comm import CommStats, enabled, install_collective_timers

                    if enabled():
                        self.comm_stats = CommStats()
                        install_collective_timers(dist, self.comm_stats)
                        self.emitter.comm = self.comm_stats
            self.emitter.set_phase("setup")  # the cell before its first step; jd.log moves it on to "forward"
            self._start_telemetry(backend)

    def _start_telemetry(self, backend: str | None) -> None:
        emitter = self.emitter
        if not emitter.enabled:
            return
        torch = sys.modules.get("torch")
        device = None
        if torch is not None:
            device = "cpu"
            if torch.cuda.is_available():
                index = self.env.local_rank % max(1, torch.cuda.device_count())
                device = f"cuda:{index}"
                emitter.cuda_device = index
                emitter.nvml = Nvml(cuda_index(index, os.environ.get("CUDA_VISIBLE_DEVICES")))
        emitter.start_record(
            world_size=self.env.world_size,
            dp_size=self.dp_size,  # how the views count tokens: once per data-parallel replica
            local_rank=self.env.local_rank,
            strategy=self.env.strategy,
            precision=self.env.precision,
            device=device,
            backend=backend,
            torch=getattr(torch, "__version__", None),
        )
        emitter.heartbeat()
        emitter.memory()
        emitter.start_monitor(self.env.heartbeat_s)

    @property
    def emitter(self) -> Emitter:
        """The telemetry emitter (created on first use; disabled without ``JD_RUN_DIR``)."""
        with self._lock:
            if self._emitter is None:
                self._emitter = Emitter.for_run_dir(
                    self.env.run_dir,
                    rank=self.env.rank,
                    stream_fd=1 if self.env.telemetry_stdout else None,
                    interval_s=self.env.telemetry_interval_s,
                )
            return self._emitter

    def barrier(self) -> None:
        """Wait for every rank (no-op without a process group)."""
        if self.env.distributed:
            self.init()
        if _pg_ready():
            dist = _dist()
            if dist.get_backend() == "nccl":
                import torch

                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()

    def finish(self) -> None:
        """Destroy the process group this runtime created (safe to call twice).

        With DeepSpeed loaded, through ``deepspeed.comm``, which also drops DeepSpeed's references to its groups.
        """
        with self._lock:
            if self._owns_pg and _pg_ready():
                ds_comm = sys.modules.get("deepspeed.comm.comm")
                try:
                    if ds_comm is None or getattr(ds_comm, "cdb", None) is None:
                        raise LookupError("DeepSpeed's communication backend is not initialised")
                    ds_comm.destroy_process_group()
                except Exception:
                    if _pg_ready():
                        _dist().destroy_process_group()
            self._owns_pg = False

    # ------------------------------------------------------------------ telemetry
    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """Append one ``step`` record; see :func:`jupyter_dist.worker.log`."""
        self.init()
        emitter = self.emitter
        if not emitter.enabled and not self._warned_no_run_dir:
            self._warned_no_run_dir = True
            _log.debug("jupyter_dist.worker: JD_RUN_DIR is not set; jd.log records go nowhere")
        record = emitter.log(metrics, step)
        self._last_step = step
        if self.profiler is not None:
            self.profiler.on_log(step)
        return record

    def profile(self, steps: Any = None) -> Any:
        """Arm a profiling window; see :func:`jupyter_dist.worker.profile`. Returns the :class:`StepProfiler`.

        ``steps``: ``"5:8"``, ``3``, ``range(5, 8)``, or ``None`` for a window that a ``with`` block bounds.
        """
        from ._profile import MAX_WINDOW, StepProfiler, parse_window, trace_path

        if steps is None:
            nxt = 0 if self._last_step is None else self._last_step + 1
            window = (nxt, nxt + MAX_WINDOW)
        else:
            window = parse_window(steps)
        if self.profiler is not None and self.profiler.active:
            raise WorkerError(f"jd.profile: a window (steps {self.profiler.start}:{self.profiler.stop}) is being "
                              "recorded; one at a time")  # fmt: skip
        path = trace_path(self.env.run_dir, self.env.rank) if self.env.run_dir else None
        if path is not None and self.profiler is not None and self.profiler.written:  # a second window: its own file
            tag = f"steps-{window[0]}-{window[1]}" if steps is not None else f"block-{window[0]}"
            path = path.replace(".pt.trace.json", f".{tag}.pt.trace.json")
        self.profiler = StepProfiler(window, path, manual=steps is None)
        if steps is not None and window[0] == 0 and self.model is not None and self._last_step is None:
            self.profiler.begin(0)
        return self.profiler

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_root(self, root: str | os.PathLike[str] | None) -> str | None:
        """``root``, else ``$JD_CHECKPOINT_DIR`` (cluster jobs key it on the task id), else the run's checkpoints/."""
        if root is not None:
            return os.fspath(root)
        if os.environ.get("JD_CHECKPOINT_DIR"):
            return os.environ["JD_CHECKPOINT_DIR"]
        if self.env.run_dir is None:
            return None
        return os.path.join(self.env.run_dir, "checkpoints")

    def save(self, state: dict[str, Any], step: int, *, root: Any = None, keep: int | None = None,
             async_: bool = False) -> str | None:  # fmt: skip
        """Collective checkpoint; see :func:`jupyter_dist.worker.save`."""
        from ._checkpoint import save

        self.init()
        self.emitter.flush()
        where = self.checkpoint_root(root)
        if where is None:
            _log.warning(
                "jupyter_dist.worker: JD_RUN_DIR is not set and no root= given; jd.save(step=%s) saved nothing",
                step,
            )
            return None
        with self.phase("checkpoint"):
            return save(self, state, step, root=where, keep=keep, async_=async_)

    def checkpoint(self, state: dict[str, Any], step: int) -> str | None:
        """Save when ``step + 1`` is a multiple of ``JD_CHECKPOINT_EVERY`` (keeping ``JD_KEEP``); else nothing."""
        every = self.env.checkpoint_every
        if every <= 0:
            return None
        from ._checkpoint import all_ranks_ok

        stopping = not all_ranks_ok(self, self._stop_requested is None)  # one tiny all-reduce per call
        if not stopping and (step + 1) % every:
            return None
        path = self.save(state, step, keep=self.env.keep, async_=self.env.async_save and not stopping)
        if stopping:
            _log.warning("jupyter_dist.worker: stopped after saving %s", path)
            self.write_exit("terminated", None, signal="SIGTERM", checkpoint=path)
            raise SystemExit(0)
        return path

    def resume(self, state: dict[str, Any] | None = None, *, root: Any = None) -> tuple[dict[str, Any], int] | None:
        """Load the newest complete checkpoint; see :func:`jupyter_dist.worker.resume`."""
        from ._checkpoint import resume

        self.init()
        if state is None:
            state = {k: v for k, v in (("model", self.model), ("optimizer", self.optimizer)) if v is not None}
            if not state:
                raise WorkerError(
                    "jd.resume() loads into live objects: call jd.wrap(model, optimizer) first, or pass them as "
                    "jd.resume({'model': model, 'optimizer': optimizer})"
                )
        where = self.checkpoint_root(root)
        if where is None:
            return None
        with self.phase("resume"):
            return resume(self, state, root=where)

    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        """Report ``name`` as the phase in heartbeats while the block runs (then the previous phase again)."""
        emitter = self.emitter
        previous = emitter.phase
        emitter.set_phase(name)
        try:
            yield
        finally:
            emitter.set_phase(previous)

    # ------------------------------------------------------------------ process hooks
    def install_hooks(self) -> None:
        """Set up a launched worker's process: stdio, error and signal hooks, exit record.

        Redirects stdio (``JD_LOG_STDIO=1``), records uncaught errors and SIGTERM, and at interpreter exit writes
        the ``exit`` record and destroys the process group.
        """
        with self._lock:
            if self._hooks_installed:
                return
            self._hooks_installed = True
        if self.env.log_stdio and self.env.run_dir:
            self.redirect_stdio()
        previous = sys.excepthook

        def excepthook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            self.record_error(value)
            previous(tp, value, tb)

        sys.excepthook = excepthook
        atexit.register(self._at_exit)
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                    signal.signal(signal.SIGTERM, self._on_sigterm)

    def redirect_stdio(self) -> str:
        """Point fd 1 and 2 at ``<run dir>/logs/rank-<k>.log`` (append) and make ``sys.stdout/err`` line-buffered."""
        if self.env.run_dir is None:
            raise WorkerError("redirect_stdio needs JD_RUN_DIR (the run directory)")
        path = os.path.join(self.env.run_dir, "logs", f"rank-{self.env.rank}.log")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        finally:
            os.close(fd)
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                with contextlib.suppress(Exception):
                    reconfigure(line_buffering=True)
        return path

    def note_exit(self, code: int, error: BaseException | None = None) -> None:
        """Tell the runtime how the script ended when the caller caught it (a bootstrap that runs the script).

        Without this, an exception caught by a wrapper never reaches ``sys.excepthook`` and the ``exit`` record
        would say ``ok``; a non-zero ``code`` without an exception is recorded as ``SystemExit(code)``.
        """
        if error is not None and not (isinstance(error, SystemExit) and code == 0):
            self.record_error(error)
        elif code != 0 and self._error is None:
            self._error = SystemExit(code)

    def record_error(self, error: BaseException) -> None:
        """Remember ``error`` for the ``exit`` record and write an ``error`` record with its traceback (once)."""
        if self._error is error:
            return
        self._error = error
        if isinstance(error, SystemExit) or self._emitter is None:
            return
        import traceback

        # a negative limit: the last frames, whatever sys.tracebacklimit another library set (SkyPilot sets 0)
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-30))
        with contextlib.suppress(Exception):
            self._emitter.error_record(error, text)

    def write_exit(self, status: str, error: BaseException | None = None, **fields: Any) -> None:
        """Write the ``exit`` record once."""
        with self._lock:
            if self._exit_written:
                return
            self._exit_written = True
        self.emitter.exit_record(status, error, **fields)

    def _at_exit(self) -> None:
        error = self._error
        if error is None and self.pending_save is not None:
            from ._checkpoint import commit_pending

            try:  # a clean end commits the last asynchronous save (every rank gets here)
                commit_pending(self)
            except Exception as exc:  # the checkpoint stays uncommitted, so resume ignores it
                _log.warning("jupyter_dist.worker: the last asynchronous checkpoint was not committed: %s", exc)
        if self.profiler is not None and self.profiler.active:  # the script ended inside the window: keep it
            self.profiler.end()
        self.write_exit("ok" if error is None else "error", error)
        if error is None:
            self._teardown()
        if self._emitter is not None:
            self._emitter.close()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    def _teardown(self) -> None:
        """A clean end's teardown, in a defined order, while the interpreter is still whole (an ``atexit`` hook).

        Why: a finished DeepSpeed run on gloo could abort at exit with "terminate called without an active
        exception" (SIGABRT; test_worker.py::test_deepspeed_zero2_through_wrap_on_cpu, one run in ~10 under load).
        The core dump shows the main thread in ``Py_FinalizeEx`` and a gloo worker thread (``pt_gloo_runloop``)
        releasing the last reference to a finished ``AsyncAllreduceWork``: its tensor's Python object was owned by
        the C++ tensor (Python had dropped it while the collective ran), so freeing it takes the GIL; during
        finalisation CPython 3.11 answers that with ``pthread_exit``, whose forced unwind through the noexcept
        ``~AsyncWork`` calls ``std::terminate``. Any collective whose worker thread has not yet let go of its work
        when ``Py_FinalizeEx`` starts can do this (a loaded machine delays that thread), and
        ``destroy_process_group`` does not stop gloo's threads (its ``shutdown`` is a no-op and DeepSpeed keeps
        references to its groups). So, before finalisation:

        1. our threads: the telemetry monitor stops;
        2. every gloo process group of this rank is drained: a barrier on each (gloo's barrier waits for all prior
           work on that group), then we wait, with the GIL released, until gloo's worker threads are all asleep,
           that is have released their last work (:func:`_gloo_threads_idle`);
        3. DeepSpeed's references to its groups are released, then the process group is destroyed.

        Collective, like the commit of a pending save above it: on a clean end every rank gets here.
        """
        if self._emitter is not None:
            self._emitter.stop_monitor()
        with contextlib.suppress(Exception):
            _drain_gloo_groups()
        with contextlib.suppress(Exception):
            self.finish()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.env.checkpoint_every > 0 and self._initialized:
            # a clean stop: the next jd.checkpoint() call saves (all ranks agree on the step) and exits. The SIGTERMs
            # of torchrun and of Run.stop arrive together; one more after 20 s means the save never came: go.
            now = time.monotonic()
            if self._stop_requested is None:
                self._stop_requested = now
                _log.warning("jupyter_dist.worker: SIGTERM: saving a checkpoint at the next jd.checkpoint() call")
                return
            if now - self._stop_requested < 20.0:
                return
        self.write_exit("terminated", None, signal=signal.Signals(signum).name)
        if self._emitter is not None:
            self._emitter.close()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def get_runtime() -> Runtime:
    """The process's runtime, built from ``os.environ`` on first use."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = Runtime(WorkerEnv.from_environ())
        return _RUNTIME


def fresh_runtime() -> Runtime:
    """Replace the process's runtime by a new one built from ``os.environ``, keeping the process group.

    For harnesses that train several ``JD_*`` configurations in sequence in one launch (the equal-math tests run all
    configurations of one world size in one torchrun): the next ``jd.wrap`` builds its mesh from the new degrees.
    The previous runtime drops its model, optimizer, mesh and pipeline; the one that created the process group stays
    its owner (its exit hooks, if any, are unchanged). Returns the new runtime.
    """
    global _RUNTIME
    with _RUNTIME_LOCK:
        old = _RUNTIME
        if old is not None:
            old.model = old.optimizer = old.mesh = old.pipeline = None
            _PREVIOUS.append(old)
        _RUNTIME = Runtime(WorkerEnv.from_environ())
        return _RUNTIME


_PREVIOUS: list[Runtime] = []
"""Runtimes replaced by :func:`fresh_runtime` (the first owns the process group; kept alive for its exit hooks)."""


def on_import() -> None:
    """Called when ``jupyter_dist.worker`` is imported.

    A launched worker (``JD_RUN_DIR``) installs its hooks; then a training process (that, or one started by torchrun
    or an equivalent launcher) imports torch outside the collector (:func:`import_torch_outside_the_collector`: the
    process needs torch anyway). A torch that cannot be imported is left to the script's own ``import torch``.
    Cheap and side-effect free elsewhere: a notebook kernel has neither, and importing ``jupyter_dist.worker`` there
    loads no torch.
    """
    launched = bool(os.environ.get("JD_RUN_DIR"))
    if launched:
        get_runtime().install_hooks()
    if launched or started_by_torchrun(os.environ):
        import_torch_outside_the_collector()  # after the hooks: a broken torch fails in the script's import, recorded
